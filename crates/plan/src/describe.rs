//! [`describe`]: what a model is, read from its files' headers only (never the tensor data).

use crate::error::{PlanError, Result};
use gguf::{GgmlType, GgufModel};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A file format found in a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// GGUF (one file or a split set).
    Gguf,
    /// Hugging Face safetensors.
    Safetensors,
    /// ONNX graphs (an `onnx/` folder or `*.onnx` files).
    Onnx,
}

impl Format {
    /// The JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Gguf => "gguf",
            Format::Safetensors => "safetensors",
            Format::Onnx => "onnx",
        }
    }
}

/// What a model computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Task {
    /// Next-token prediction (chat, completion).
    TextGeneration,
    /// Sentence embeddings (a pooling layer over the hidden states).
    Embedding,
    /// A classifier head over the hidden states.
    TextClassification,
    /// Nothing in the files says.
    Unknown,
}

impl Task {
    /// The JSON spelling (`text-generation`).
    pub fn as_str(self) -> &'static str {
        match self {
            Task::TextGeneration => "text-generation",
            Task::Embedding => "embedding",
            Task::TextClassification => "text-classification",
            Task::Unknown => "unknown",
        }
    }
}

/// How the path given was laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    /// One `.gguf` file.
    GgufFile,
    /// A GGUF split set (`NAME-00001-of-0000N.gguf`), named by any of its parts.
    GgufSplit,
    /// A folder in the Hugging Face layout (config.json with weight files).
    Folder,
}

/// One file of the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the folder (for a folder), else the path as opened.
    pub path: PathBuf,
    /// Size on disk.
    pub size_bytes: u64,
    /// The weight format it holds, if it is a weight file.
    pub format: Option<Format>,
}

/// Tensors of one element type.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QuantUse {
    /// ggml type name (`Q4_K`, `F32`) for GGUF; safetensors dtype (`BF16`) otherwise.
    pub dtype: String,
    /// How many tensors have it.
    pub n_tensors: usize,
    /// Their bytes.
    pub size_bytes: u64,
}

/// The tokens that open and close a reasoning block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThinkMarkers {
    /// Opening text (`<think>`).
    pub open: String,
    /// Its token id.
    pub open_id: u32,
    /// Closing text (`</think>`).
    pub close: String,
    /// Its token id.
    pub close_id: u32,
    /// Whether the chat template mentions the opening marker or `enable_thinking`.
    pub in_template: bool,
}

/// Whether a back end can read the model's files (architecture and tensor types).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Readability {
    /// The back end (`cpu`, `gpu`, `gpu_paged`, `hybrid`).
    pub backend: String,
    /// True when it can read every tensor and implements the architecture.
    pub can_read: bool,
    /// Why not, as a refusal code (`model`, `format`, `gpu`, `unimplemented`; see [`crate::Code`]).
    pub code: Option<crate::Code>,
    /// Why not, in words.
    pub reason: Option<String>,
}

/// The numbers the planner's memory and speed estimates are made of, from a GGUF header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WeightFacts {
    /// Bytes of every tensor in the file(s).
    pub tensor_bytes: u64,
    /// Bytes of routed-expert tensors (names containing `_exps`).
    pub expert_bytes: u64,
    /// Bytes of the rest (attention, norms, embeddings, shared experts, dense FFNs).
    pub dense_bytes: u64,
    /// Bytes on the GPU after repacking to aligned blocks (`null` when the gpu back end is not
    /// compiled in, or when a tensor type has no GPU kernel).
    pub gpu_tensor_bytes: Option<u64>,
    /// Of those, the routed experts' bytes.
    pub gpu_expert_bytes: Option<u64>,
    /// Routed experts per MoE layer (0 for dense models).
    pub expert_count: usize,
    /// Experts each token uses.
    pub expert_used_count: usize,
    /// Layers.
    pub n_layers: usize,
    /// Hidden width.
    pub n_embd: usize,
    /// Vocabulary rows of the embedding.
    pub n_vocab: usize,
    /// Widest feed-forward layer (dense or one expert times the experts used).
    pub max_ffn: usize,
    /// KV-cache bytes per position over all layers, f32 cache (0 for recurrent layers).
    pub kv_bytes_per_position: u64,
    /// Bytes of recurrent state (conv windows, SSM states), independent of the context.
    pub recurrent_state_bytes: u64,
    /// GPU activation scratch for a prompt batch of [`crate::plan::N_BATCH`] tokens, as the GPU
    /// expert tier's placement counts it (`pager::placement::activation_scratch_bytes`: 8 rows of
    /// the widest hidden width and a vocabulary row per token, doubled for the pool's rounding);
    /// `null` without the `gpu` feature.
    #[serde(default)]
    pub gpu_scratch_bytes: Option<u64>,
    /// Bytes of one slot of the GPU expert tier's pool: one expert's matrices of the layer with
    /// the largest, as the tier lays them out (`compute::wgpu::expert_slot_bytes`); `null`
    /// without the `gpu` feature, for dense models, or when a type has no GPU layout.
    #[serde(default)]
    pub gpu_slot_bytes: Option<u64>,
    /// Bytes the RAM expert cache (`--ram-budget`, `pager::Pager`) takes beside its slots (its
    /// index of every expert); a cache of n slots takes `ram_cache_index_bytes + n x
    /// ram_slot_bytes`. `null` for dense models.
    #[serde(default)]
    pub ram_cache_index_bytes: Option<u64>,
    /// Bytes of one slot of that cache with its bookkeeping (one expert of the largest layer, each
    /// matrix in an aligned region). `null` for dense models.
    #[serde(default)]
    pub ram_slot_bytes: Option<u64>,
}

/// What [`describe`] reports. The JSON form is documented in docs/PLAN.md and stable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelDescription {
    /// The path given.
    pub path: PathBuf,
    /// File, split set or folder.
    pub source: SourceKind,
    /// Formats present, sorted.
    pub formats: Vec<Format>,
    /// GGUF `general.architecture`, else config.json's `model_type`.
    pub architecture: Option<String>,
    /// config.json's `architectures[0]` (`LlamaForCausalLM`), when there is a config.json.
    pub hf_architecture: Option<String>,
    /// What the model computes.
    pub task: Task,
    /// `general.tags`, plus `moe`, `chat`, `thinking`, `recurrent` as they apply.
    pub tags: Vec<String>,
    /// Every file with its size, sorted by path.
    pub files: Vec<FileEntry>,
    /// Sum of the file sizes.
    pub total_size_bytes: u64,
    /// The GGUF the planner and `load` use (first part of the first set, by name), if any.
    pub gguf: Option<PathBuf>,
    /// Every GGUF set of a folder (first part of each), sorted.
    pub gguf_variants: Vec<PathBuf>,
    /// Element types of the tensors (of the GGUF when there is one, else of the safetensors).
    pub quant_types: Vec<QuantUse>,
    /// All parameters.
    pub params_total: Option<u64>,
    /// Parameters one token uses (MoE: dense ones plus the used experts' share).
    pub params_active: Option<u64>,
    /// Trained context length.
    pub context_length: Option<u64>,
    /// Whether a chat template is stored.
    pub chat_template: bool,
    /// Reasoning markers of the vocabulary.
    pub thinking: Option<ThinkMarkers>,
    /// Per back end, whether it can read the files.
    pub readers: Vec<Readability>,
    /// Memory facts of the GGUF for the planner.
    pub weights: Option<WeightFacts>,
}

/// Architectures whose output is an embedding rather than next-token logits.
const EMBEDDING_ARCHES: &[&str] =
    &["bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "t5encoder", "neo-bert", "modern-bert"];

/// Reasoning marker pairs in the order they are looked for.
const THINK_PAIRS: &[(&str, &str)] = &[
    ("<think>", "</think>"),
    ("<thinking>", "</thinking>"),
    ("<seed:think>", "</seed:think>"),
    ("<|begin_of_thought|>", "<|end_of_thought|>"),
];

/// Describes the model at `path`: one GGUF file, any part of a split set, or a folder in the
/// Hugging Face layout (config.json with `*.gguf`, `*.safetensors` or `onnx/` files). Reads
/// headers only, so it costs milliseconds even for a 100 GB model.
///
/// # Errors
/// [`PlanError::NotAModel`] for a path with no weight file; a GGUF header that does not parse;
/// I/O errors.
pub fn describe(path: &Path) -> Result<ModelDescription> {
    let meta =
        std::fs::metadata(path).map_err(|source| PlanError::Io { path: path.into(), what: "reading", source })?;
    if meta.is_dir() {
        describe_folder(path)
    } else {
        let model = GgufModel::open(path)?;
        let source = if model.files().len() > 1 { SourceKind::GgufSplit } else { SourceKind::GgufFile };
        let files = model
            .files()
            .iter()
            .map(|f| FileEntry { path: f.path().to_path_buf(), size_bytes: f.file_len(), format: Some(Format::Gguf) })
            .collect();
        let mut d = empty(path, source, files);
        d.formats = vec![Format::Gguf];
        d.gguf = Some(model.path().to_path_buf());
        d.gguf_variants = vec![model.path().to_path_buf()];
        fill_from_gguf(&mut d, &model)?;
        Ok(d)
    }
}

fn empty(path: &Path, source: SourceKind, mut files: Vec<FileEntry>) -> ModelDescription {
    files.sort_by(|a, b| a.path.cmp(&b.path));
    ModelDescription {
        path: path.to_path_buf(),
        source,
        formats: Vec::new(),
        architecture: None,
        hf_architecture: None,
        task: Task::Unknown,
        tags: Vec::new(),
        total_size_bytes: files.iter().map(|f| f.size_bytes).sum(),
        files,
        gguf: None,
        gguf_variants: Vec::new(),
        quant_types: Vec::new(),
        params_total: None,
        params_active: None,
        context_length: None,
        chat_template: false,
        thinking: None,
        readers: Vec::new(),
        weights: None,
    }
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<FileEntry>) -> Result<()> {
    let io = |p: &Path, source| PlanError::Io { path: p.into(), what: "listing", source };
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let entry = entry.map_err(|e| io(dir, e))?;
        let p = entry.path();
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue; // .git, .cache: not part of the model
        }
        let md = std::fs::metadata(&p).map_err(|e| io(&p, e))?;
        let rel = p.strip_prefix(root).unwrap_or(&p).to_path_buf();
        if md.is_dir() {
            walk(root, &p, out)?;
        } else {
            let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
            let in_onnx_dir = rel.components().next().is_some_and(|c| c.as_os_str() == "onnx");
            let format = match ext.as_str() {
                "gguf" => Some(Format::Gguf),
                "safetensors" => Some(Format::Safetensors),
                "onnx" | "onnx_data" => Some(Format::Onnx),
                _ if in_onnx_dir && ext == "data" => Some(Format::Onnx),
                _ => None,
            };
            out.push(FileEntry { path: rel, size_bytes: md.len(), format });
        }
    }
    Ok(())
}

fn describe_folder(dir: &Path) -> Result<ModelDescription> {
    let mut files = Vec::new();
    walk(dir, dir, &mut files)?;
    let mut d = empty(dir, SourceKind::Folder, files);
    let mut formats: Vec<Format> = d.files.iter().filter_map(|f| f.format).collect();
    formats.sort();
    formats.dedup();
    d.formats = formats;
    let config = read_config(dir)?;
    if d.formats.is_empty() {
        return Err(PlanError::NotAModel {
            path: dir.into(),
            why: "no *.gguf, *.safetensors or onnx/ files found".into(),
        });
    }
    // One entry per GGUF set: single files, and the first part of each split set.
    let mut variants: Vec<PathBuf> = d
        .files
        .iter()
        .filter(|f| f.format == Some(Format::Gguf))
        .filter(|f| match gguf::split_name_parts(&f.path) {
            Some(_) => f.path.to_string_lossy().contains("-00001-of-"),
            None => true,
        })
        .map(|f| dir.join(&f.path))
        .collect();
    variants.sort();
    d.gguf_variants = variants;
    if let Some(cfg) = &config {
        d.hf_architecture =
            cfg.get("architectures").and_then(|a| a.get(0)).and_then(|a| a.as_str()).map(str::to_string);
        d.architecture = cfg.get("model_type").and_then(|a| a.as_str()).map(str::to_string);
        d.context_length = cfg.get("max_position_embeddings").and_then(|v| v.as_u64());
        d.task = task_from_config(cfg, dir);
    }
    if let Some(first) = d.gguf_variants.first().cloned() {
        let model = GgufModel::open(&first)?;
        d.gguf = Some(first);
        fill_from_gguf(&mut d, &model)?;
    } else {
        if d.formats.contains(&Format::Safetensors) {
            fill_from_safetensors(&mut d, dir, config.as_ref())?;
        }
        d.readers = ["cpu", "gpu", "gpu_paged", "hybrid"]
            .iter()
            .map(|b| Readability {
                backend: b.to_string(),
                can_read: false,
                code: Some(crate::Code::Format),
                reason: Some("diskformer reads GGUF only; convert the model (llama.cpp convert_hf_to_gguf.py) or get a GGUF build".into()),
            })
            .collect();
    }
    Ok(d)
}

fn read_config(dir: &Path) -> Result<Option<serde_json::Value>> {
    let p = dir.join("config.json");
    if !p.exists() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(&p).map_err(|source| PlanError::Io { path: p.clone(), what: "reading", source })?;
    serde_json::from_str(&text).map(Some).map_err(|e| PlanError::BadFile { path: p, why: format!("not JSON: {e}") })
}

fn task_from_config(cfg: &serde_json::Value, dir: &Path) -> Task {
    if dir.join("modules.json").exists() || dir.join("sentence_bert_config.json").exists() {
        return Task::Embedding;
    }
    let arch = cfg.get("architectures").and_then(|a| a.get(0)).and_then(|a| a.as_str()).unwrap_or("");
    if arch.ends_with("ForCausalLM") || arch.ends_with("LMHeadModel") || arch.ends_with("ForConditionalGeneration") {
        Task::TextGeneration
    } else if arch.ends_with("ForSequenceClassification") {
        Task::TextClassification
    } else {
        Task::Unknown
    }
}

fn fill_from_safetensors(d: &mut ModelDescription, dir: &Path, config: Option<&serde_json::Value>) -> Result<()> {
    let mut by_dtype: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    let (mut total, mut experts) = (0u64, 0u64);
    for f in d.files.iter().filter(|f| f.format == Some(Format::Safetensors)) {
        let p = dir.join(&f.path);
        for (name, dtype, n_elements, size_bytes) in safetensors_header(&p)? {
            let e = by_dtype.entry(dtype).or_default();
            e.0 += 1;
            e.1 += size_bytes;
            total += n_elements;
            if name.contains(".experts.") {
                experts += n_elements;
            }
        }
    }
    d.quant_types =
        by_dtype.into_iter().map(|(dtype, (n, b))| QuantUse { dtype, n_tensors: n, size_bytes: b }).collect();
    d.params_total = Some(total);
    let key = |k: &str| config.and_then(|c| c.get(k)).and_then(|v| v.as_u64());
    let n_expert = key("num_local_experts").or(key("num_experts")).or(key("n_routed_experts")).unwrap_or(0);
    let n_used = key("num_experts_per_tok").or(key("moe_topk")).unwrap_or(0);
    d.params_active = Some((experts * n_used).checked_div(n_expert).map_or(total, |active| total - experts + active));
    if n_expert > 0 {
        d.tags.push("moe".into());
    }
    Ok(())
}

/// (name, dtype, elements, bytes) of each tensor in a safetensors header.
fn safetensors_header(p: &Path) -> Result<Vec<(String, String, u64, u64)>> {
    use std::io::Read;
    let bad = |why: String| PlanError::BadFile { path: p.into(), why };
    let mut f = std::fs::File::open(p).map_err(|source| PlanError::Io { path: p.into(), what: "opening", source })?;
    let file_len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|_| bad("shorter than a safetensors header".into()))?;
    let n = u64::from_le_bytes(len);
    if n > 100 << 20 || n + 8 > file_len {
        return Err(bad(format!("safetensors header length {n} does not fit the file of {file_len} bytes")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| bad(format!("reading the safetensors header: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("safetensors header is not JSON: {e}")))?;
    let obj = json.as_object().ok_or_else(|| bad("safetensors header is not a JSON object".into()))?;
    let mut out = Vec::new();
    for (name, t) in obj {
        if name == "__metadata__" {
            continue;
        }
        let dtype =
            t.get("dtype").and_then(|v| v.as_str()).ok_or_else(|| bad(format!("tensor {name:?} has no dtype")))?;
        let shape =
            t.get("shape").and_then(|v| v.as_array()).ok_or_else(|| bad(format!("tensor {name:?} has no shape")))?;
        let n_elements = shape.iter().map(|d| d.as_u64().unwrap_or(0)).product::<u64>();
        let offsets = t.get("data_offsets").and_then(|v| v.as_array());
        let size_bytes = match offsets.map(|o| (o.first().and_then(|v| v.as_u64()), o.get(1).and_then(|v| v.as_u64())))
        {
            Some((Some(a), Some(b))) if b >= a => b - a,
            _ => return Err(bad(format!("tensor {name:?} has bad data_offsets"))),
        };
        out.push((name.clone(), dtype.to_string(), n_elements, size_bytes));
    }
    Ok(out)
}

fn fill_from_gguf(d: &mut ModelDescription, model: &GgufModel) -> Result<()> {
    let md = model.metadata();
    let in_file = |e: gguf::GgufError| PlanError::Gguf(e.in_file(model.path()));
    let arch = md.str_opt("general.architecture").map_err(in_file)?.map(str::to_string);
    let a = arch.clone().unwrap_or_default();
    let k = |tail: &str| format!("{a}.{tail}");

    let mut by_dtype: BTreeMap<&'static str, (usize, u64)> = BTreeMap::new();
    let (mut total, mut expert_params) = (0u64, 0u64);
    let (mut tensor_bytes, mut expert_bytes) = (0u64, 0u64);
    for t in model.tensors() {
        let e = by_dtype.entry(t.dtype().name()).or_default();
        e.0 += 1;
        e.1 += t.info.size_bytes;
        total += t.info.n_elements();
        tensor_bytes += t.info.size_bytes;
        if is_routed_expert(t.name()) {
            expert_params += t.info.n_elements();
            expert_bytes += t.info.size_bytes;
        }
    }
    d.quant_types = by_dtype
        .into_iter()
        .map(|(n, (c, b))| QuantUse { dtype: n.to_string(), n_tensors: c, size_bytes: b })
        .collect();
    let expert_count = md.u32_opt(&k("expert_count")).map_err(in_file)?.unwrap_or(0) as u64;
    let expert_used = md.u32_opt(&k("expert_used_count")).map_err(in_file)?.unwrap_or(0) as u64;
    d.params_total = Some(total);
    d.params_active = Some(
        (expert_params * expert_used).checked_div(expert_count).map_or(total, |active| total - expert_params + active),
    );
    if let Some(c) = md.u32_opt(&k("context_length")).map_err(in_file)? {
        d.context_length = Some(c as u64);
    }
    let template = md.str_opt("tokenizer.chat_template").map_err(in_file)?;
    d.chat_template = template.is_some();
    d.thinking = think_markers(md, template).map_err(in_file)?;

    let has_pooling = md.get(&k("pooling_type")).is_some();
    d.task = if EMBEDDING_ARCHES.contains(&a.as_str()) || has_pooling {
        Task::Embedding
    } else if model.tensor_opt(gguf::names::TOKEN_EMBD).is_some() {
        Task::TextGeneration
    } else {
        d.task
    };
    d.architecture = arch.clone().or(d.architecture.take());

    let mut tags: Vec<String> = md
        .str_array_opt("general.tags")
        .map_err(in_file)?
        .unwrap_or_default()
        .into_iter()
        .map(str::to_string)
        .collect();
    let facts = weight_facts(model, &a, tensor_bytes, expert_bytes)?;
    if expert_count > 0 {
        tags.push("moe".into());
    }
    if d.chat_template {
        tags.push("chat".into());
    }
    if d.thinking.as_ref().is_some_and(|t| t.in_template) {
        tags.push("thinking".into());
    }
    if facts.recurrent_state_bytes > 0 {
        tags.push("recurrent".into());
    }
    tags.append(&mut d.tags);
    tags.sort();
    tags.dedup();
    d.tags = tags;
    d.readers = readers(model, arch.as_deref(), expert_count > 0);
    d.weights = Some(facts);
    Ok(())
}

/// Routed-expert tensors (`blk.N.ffn_up_exps.weight`); shared experts (`_shexp`) are dense.
pub(crate) fn is_routed_expert(name: &str) -> bool {
    name.contains("_exps")
}

fn think_markers(md: &gguf::Metadata, template: Option<&str>) -> gguf::Result<Option<ThinkMarkers>> {
    let Some(tokens) = md.str_array_opt("tokenizer.ggml.tokens")? else { return Ok(None) };
    let id_of = |text: &str| tokens.iter().position(|t| *t == text).map(|i| i as u32);
    for (open, close) in THINK_PAIRS {
        if let (Some(open_id), Some(close_id)) = (id_of(open), id_of(close)) {
            let in_template = template.is_some_and(|t| t.contains(open) || t.contains("enable_thinking"));
            return Ok(Some(ThinkMarkers {
                open: open.to_string(),
                open_id,
                close: close.to_string(),
                close_id,
                in_template,
            }));
        }
    }
    Ok(None)
}

fn weight_facts(model: &GgufModel, arch: &str, tensor_bytes: u64, expert_bytes: u64) -> Result<WeightFacts> {
    let md = model.metadata();
    let in_file = |e: gguf::GgufError| PlanError::Gguf(e.in_file(model.path()));
    let k = |tail: &str| format!("{arch}.{tail}");
    let u = |tail: &str| -> Result<Option<u64>> { Ok(md.u32_opt(&k(tail)).map_err(in_file)?.map(u64::from)) };
    let n_layers = u("block_count")?.unwrap_or(0) as usize;
    let n_embd = u("embedding_length")?.unwrap_or(0) as usize;
    let per_layer = |tail: &str| -> Result<Option<Vec<u64>>> {
        Ok(md.u32_per_layer_opt(&k(tail), n_layers).map_err(in_file)?.map(|v| v.into_iter().map(u64::from).collect()))
    };
    let heads = per_layer("attention.head_count")?.unwrap_or_else(|| vec![0; n_layers]);
    let heads_kv = per_layer("attention.head_count_kv")?.unwrap_or_else(|| heads.clone());
    let max_heads = heads.iter().copied().max().unwrap_or(0).max(1);
    let key_length = u("attention.key_length")?.unwrap_or(n_embd as u64 / max_heads);
    let value_length = u("attention.value_length")?.unwrap_or(key_length);
    // MLA (deepseek2) caches one compressed latent per position, not per-head keys and values.
    let kv_lora = u("attention.kv_lora_rank")?;
    let rope_dims = u("rope.dimension_count")?.unwrap_or(0);
    let kv_floats_per_layer = |il: usize| -> u64 {
        match kv_lora {
            Some(r) if heads_kv.get(il).copied().unwrap_or(0) > 0 => (r + rope_dims) + r,
            _ => heads_kv.get(il).copied().unwrap_or(0) * (key_length + value_length),
        }
    };
    let kv_bytes_per_position = (0..n_layers).map(|il| kv_floats_per_layer(il) * 4).sum();
    // Recurrent layers: those without KV heads. Mamba2 keeps a conv window and an SSM state,
    // LFM2's short convolutions a window of `l_cache - 1` positions.
    let n_recurrent = heads_kv.iter().filter(|&&h| h == 0).count() as u64;
    let ssm_inner = u("ssm.inner_size")?.unwrap_or(0);
    let ssm_state = u("ssm.state_size")?.unwrap_or(0);
    let ssm_conv = u("ssm.conv_kernel")?.unwrap_or(0);
    let ssm_groups = u("ssm.group_count")?.unwrap_or(1);
    let l_cache = u("shortconv.l_cache")?.unwrap_or(0);
    let per_recurrent_floats = if ssm_inner > 0 {
        ssm_conv.saturating_sub(1) * (ssm_inner + 2 * ssm_groups * ssm_state) + ssm_inner * ssm_state
    } else {
        l_cache.saturating_sub(1) * 3 * n_embd as u64
    };
    let recurrent_state_bytes = n_recurrent * per_recurrent_floats * 4;
    let ffn = per_layer("feed_forward_length")?.unwrap_or_default();
    let expert_ffn = u("expert_feed_forward_length")?.unwrap_or(0);
    let expert_count = u("expert_count")?.unwrap_or(0) as usize;
    let expert_used_count = u("expert_used_count")?.unwrap_or(0) as usize;
    let max_ffn = ffn.iter().copied().max().unwrap_or(0).max(expert_ffn * expert_used_count as u64) as usize;
    let n_vocab = model
        .tensor_opt(gguf::names::TOKEN_EMBD)
        .and_then(|t| t.shape().get(1).copied())
        .unwrap_or(md.str_array_opt("tokenizer.ggml.tokens").map_err(in_file)?.map_or(0, |t| t.len() as u64))
        as usize;
    let (gpu_tensor_bytes, gpu_expert_bytes) = gpu_bytes(model);
    let ram_cache = ram_cache(model);
    Ok(WeightFacts {
        tensor_bytes,
        expert_bytes,
        dense_bytes: tensor_bytes - expert_bytes,
        gpu_tensor_bytes,
        gpu_expert_bytes,
        expert_count,
        expert_used_count,
        n_layers,
        n_embd,
        n_vocab,
        max_ffn,
        kv_bytes_per_position,
        recurrent_state_bytes,
        gpu_scratch_bytes: cfg!(feature = "gpu")
            .then(|| pager::placement::activation_scratch_bytes(model, crate::plan::N_BATCH as usize)),
        gpu_slot_bytes: gpu_slot_bytes(model),
        ram_cache_index_bytes: ram_cache.map(|(index, _)| index),
        ram_slot_bytes: ram_cache.map(|(_, slot)| slot),
    })
}

/// The RAM expert cache's fixed bytes and bytes per slot for `model`, from the pager's own
/// accounting; `None` for a model without experts.
fn ram_cache(model: &GgufModel) -> Option<(u64, u64)> {
    let index = pager::Pager::budget_for_slots(model, 0).ok()?;
    let one = pager::Pager::budget_for_slots(model, 1).ok()?;
    Some((index, one - index))
}

/// The GPU expert tier's slot for `model` (see [`WeightFacts::gpu_slot_bytes`]): the planner's
/// floor for the pool must be the one `run --gpu-budget` asks for, and an average over layers
/// without the tier's padding row per matrix came out ~3% under it.
#[cfg(feature = "gpu")]
fn gpu_slot_bytes(model: &GgufModel) -> Option<u64> {
    let mut layers: std::collections::BTreeMap<&str, Vec<(GgmlType, usize, usize)>> = Default::default();
    for t in model.tensors().filter(|t| is_routed_expert(t.name()) && t.shape().len() == 3) {
        // `blk.N.ffn_*_exps.weight`: grouped by the part before the tensor's own name.
        let layer = t.name().rsplit_once(".ffn_").map_or(t.name(), |(l, _)| l);
        // GGUF order: [k, n_out, n_expert].
        layers.entry(layer).or_default().push((t.dtype(), t.shape()[1] as usize, t.shape()[0] as usize));
    }
    let mut largest = None;
    for m in layers.values() {
        let b = compute::wgpu::expert_slot_bytes(m)?;
        largest = Some(largest.map_or(b, |l: u64| l.max(b)));
    }
    largest
}

#[cfg(not(feature = "gpu"))]
fn gpu_slot_bytes(_model: &GgufModel) -> Option<u64> {
    None
}

/// Bytes of the model's tensors once repacked for the GPU (`compute::wgpu::layout`), total and
/// experts; `None` when a type has no GPU layout.
#[cfg(feature = "gpu")]
fn gpu_bytes(model: &GgufModel) -> (Option<u64>, Option<u64>) {
    use compute::wgpu::layout::TypeLayout;
    let (mut total, mut experts) = (0u64, 0u64);
    for t in model.tensors() {
        let k = t.info.row_len() as usize;
        let Some(layout) = TypeLayout::for_weight(t.dtype(), k) else { return (None, None) };
        let bytes = layout.row_words(k) as u64 * 4 * t.info.n_rows();
        total += bytes;
        if is_routed_expert(t.name()) {
            experts += bytes;
        }
    }
    (Some(total), Some(experts))
}

#[cfg(not(feature = "gpu"))]
fn gpu_bytes(_model: &GgufModel) -> (Option<u64>, Option<u64>) {
    (None, None)
}

/// Tensor types the gpu back end has kernels for.
#[cfg(feature = "gpu")]
fn gpu_reads(dtype: GgmlType) -> bool {
    compute::wgpu::layout::TypeLayout::of(dtype).is_some()
}

fn first_unreadable(model: &GgufModel, reads: impl Fn(GgmlType) -> bool) -> Option<(String, GgmlType)> {
    model.tensors().find(|t| !reads(t.dtype())).map(|t| (t.name().to_string(), t.dtype()))
}

fn readers(model: &GgufModel, arch: Option<&str>, is_moe: bool) -> Vec<Readability> {
    use crate::Code;
    let arch_problem = match arch {
        None => Some("the file has no general.architecture".to_string()),
        Some(a) if !models::SUPPORTED_ARCHITECTURES.contains(&a) => Some(format!(
            "architecture {a:?} is not implemented (supported: {})",
            models::SUPPORTED_ARCHITECTURES.join(", ")
        )),
        Some(_) => None,
    };
    let verdict = |backend: &str, type_problem: Option<(String, GgmlType)>, other: Option<(Code, String)>| {
        let problem = arch_problem
            .clone()
            .map(|r| (Code::Model, r))
            .or_else(|| {
                type_problem.map(|(t, d)| {
                    (
                        Code::Format,
                        format!("tensor {t:?} has type {} which the {backend} back end cannot read", d.name()),
                    )
                })
            })
            .or(other);
        Readability {
            backend: backend.to_string(),
            can_read: problem.is_none(),
            code: problem.as_ref().map(|p| p.0),
            reason: problem.map(|p| p.1),
        }
    };
    let cpu = verdict("cpu", first_unreadable(model, compute::quant::is_supported), None);
    #[cfg(feature = "gpu")]
    let gpu = verdict("gpu", first_unreadable(model, gpu_reads), None);
    #[cfg(not(feature = "gpu"))]
    let gpu = verdict(
        "gpu",
        None,
        Some((Code::Gpu, "this build has no GPU back end (built without the `gpu` feature)".into())),
    );
    let no_experts =
        (Code::Model, "paging moves routed experts between disk, RAM and GPU; this model has none".to_string());
    // The GPU expert tier (`--gpu-budget`) reads what the resident GPU back end reads.
    let gpu_paged = match &gpu.code {
        _ if !is_moe => verdict("gpu_paged", None, Some(no_experts.clone())),
        Some(code) => verdict("gpu_paged", None, Some((*code, gpu.reason.clone().unwrap_or_default()))),
        None => verdict("gpu_paged", None, None),
    };
    let hybrid = verdict(
        "hybrid",
        None,
        Some(if is_moe {
            (
                Code::Unimplemented,
                "every expert on the CPU beside a GPU is not a back end of its own: the GPU expert tier \
                 (gpu_paged, `--gpu-budget B --moe-miss cpu`) computes its misses on the CPU"
                    .to_string(),
            )
        } else {
            no_experts
        }),
    );
    vec![cpu, gpu, gpu_paged, hybrid]
}
