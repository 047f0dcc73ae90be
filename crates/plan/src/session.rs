//! [`load`] and [`Session`]: a loaded model behind one engine thread, generating as a stream.
//!
//! The model and its sequence state live on one thread that owns them; callers send it commands
//! through a channel and read chunks from another. So compute never runs on the caller's (or an
//! async runtime's) threads, calls from many threads queue in the order they arrive, and a
//! generation can be aborted from anywhere through its [`AbortHandle`].
//!
//! The engine remembers which tokens its KV cache holds. A new request is rendered and encoded
//! in full, and only the tokens after the longest cached prefix are evaluated; when the cache
//! holds something else (another conversation), it returns to the primed system prompt's
//! checkpoint ([`Session::prime`]) if that is a prefix, else starts over.

use crate::describe::describe;
use crate::error::{PlanError, Result};
use crate::plan::{plan_with, BackendKind, Plan, PlanOptions};
use crate::probe::{probe, ProbeOptions};
use compute::quant::MatmulMode;
use compute::ExpertTierStats;
use gguf::GgufModel;
use models::sampling::{Sampler, SamplingParams};
use models::{Checkpoint, Outputs, Runner};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::Instant;
use tokenizer::{ChatMessage, ChatOptions, ChatTemplate, StreamDecoder, Tokenizer};

/// A loading stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Reading the weights from disk into the page cache.
    Read,
    /// Building the model on the back end (uploading the weights to the GPU).
    Upload,
    /// Running one token through the model, so the first request does not pay for first-use
    /// costs (page faults, pipeline compilation).
    WarmUp,
}

/// A loading progress event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// The stage.
    pub stage: Stage,
    /// Bytes done in this stage.
    pub done_bytes: u64,
    /// Bytes this stage handles in all.
    pub total_bytes: u64,
}

/// A receiver of loading progress events.
pub type ProgressFn = Box<dyn FnMut(&Progress) + Send>;

/// How to load a model.
pub struct LoadOptions {
    /// The back end; `None` runs the plan's choice.
    pub backend: Option<BackendKind>,
    /// Budgets, context length and GPU index for the plan.
    pub plan: PlanOptions,
    /// Measure bandwidths before planning (when `backend` is `None`, so the choice is informed).
    pub measure_bandwidth: bool,
    /// CPU matrix-product mode.
    pub matmul: MatmulMode,
    /// Read every weight page before building the model (honest first-token latency).
    pub read_ahead: bool,
    /// Run one token through the model after loading.
    pub warm_up: bool,
    /// Called with each progress event, on the loading thread.
    pub progress: Option<ProgressFn>,
    /// Experts served by this store (e.g. `pager::Pager`) instead of the memory map: the CPU
    /// back end then asks it for each `moe_ffn`'s experts. The planner's RAM check, which
    /// counts every expert as resident, is skipped; the store bounds what experts take.
    pub expert_store: Option<Arc<dyn compute::ExpertStore>>,
    /// Run on the GPU expert tier with these options (`plan::gpu_tier` with the `gpu` feature;
    /// its `matmul` and `gpu_index` are taken from these options and `plan`); the planner's
    /// choice and `expert_store` do not apply. `None` and the planner choosing the tier: it
    /// starts with the planned budget and `paging`.
    pub gpu_tier: Option<crate::GpuTierOptions>,
    /// How the experts are served when the plan pages them by itself (the GPU expert tier, or
    /// a RAM cache for a model larger than the RAM), without `gpu_tier` or `expert_store`.
    pub paging: PagingOptions,
}

/// How a planned paging serves experts (`serve --moe-miss`, `--cache-policy`, `--prefetch`,
/// `--direct-io` apply to it as to an explicit budget).
#[derive(Clone, Copy, Debug)]
pub struct PagingOptions {
    /// The GPU tier's miss mode; `None`: its default for the host's RAM.
    pub miss: Option<crate::TierMiss>,
    /// Which slot or cached expert a miss replaces.
    pub cache_policy: pager::CachePolicy,
    /// RAM cache: read the next layer's likely experts in the background.
    pub prefetch: bool,
    /// RAM cache: read experts with `O_DIRECT`.
    pub direct_io: bool,
}

impl Default for PagingOptions {
    fn default() -> Self {
        PagingOptions { miss: None, cache_policy: pager::CachePolicy::Lfu, prefetch: false, direct_io: false }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            backend: None,
            plan: PlanOptions::default(),
            measure_bandwidth: true,
            matmul: MatmulMode::QuantizedActivations,
            read_ahead: true,
            warm_up: true,
            progress: None,
            expert_store: None,
            gpu_tier: None,
            paging: PagingOptions::default(),
        }
    }
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("backend", &self.backend)
            .field("plan", &self.plan)
            .field("matmul", &self.matmul)
            .field("read_ahead", &self.read_ahead)
            .field("warm_up", &self.warm_up)
            .field("expert_store", &self.expert_store)
            .finish()
    }
}

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Input {
    /// Raw text, encoded with the model's BOS rule (after the primed text, if any).
    Prompt(String),
    /// A conversation, rendered with the chat template (the primed system message is put
    /// first when the conversation has none).
    Messages(Vec<ChatMessage>),
}

impl From<&str> for Input {
    fn from(s: &str) -> Input {
        Input::Prompt(s.to_string())
    }
}

impl From<Vec<ChatMessage>> for Input {
    fn from(m: Vec<ChatMessage>) -> Input {
        Input::Messages(m)
    }
}

/// Options of one generation.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Sampling (greedy by default, so results repeat).
    pub sampling: SamplingParams,
    /// `Some(false)` asks the template for no reasoning (`enable_thinking = false`),
    /// `Some(true)` for reasoning; `None` leaves the template's default.
    pub thinking: Option<bool>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions { max_tokens: 256, sampling: SamplingParams::greedy(), thinking: None }
    }
}

/// Whether a chunk is part of the answer or of the model's reasoning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkKind {
    /// Answer text.
    Text,
    /// Reasoning, between the model's think markers.
    Reasoning,
}

/// One generated token's worth of output.
#[derive(Clone, Debug, PartialEq)]
pub struct Chunk {
    /// New text (empty for a think marker, or while a UTF-8 character is incomplete).
    pub text: String,
    /// The token, or `None` for the last chunk holding bytes the decoder had held back.
    pub token_id: Option<u32>,
    /// Tokens generated so far in this request, this one included.
    pub n_tokens: usize,
    /// Answer or reasoning. A think marker's chunk has the kind of the text before it.
    pub kind: ChunkKind,
}

/// Why a generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The context is full.
    ContextFull,
    /// [`AbortHandle::abort`] was called, or the [`Generation`] was dropped.
    Aborted,
}

/// How a generation ended.
#[derive(Clone, Debug)]
pub struct Finish {
    /// Why it stopped.
    pub stop: StopReason,
    /// Tokens of the whole prompt.
    pub n_prompt_tokens: usize,
    /// Of those, how many came from the KV cache (not evaluated again).
    pub n_cached_tokens: usize,
    /// Tokens generated (the end-of-generation token included).
    pub n_generated: usize,
    /// Time evaluating the prompt.
    pub prompt_ms: f64,
    /// Time generating.
    pub generate_ms: f64,
    /// When the engine took the request up (after the requests queued before it).
    pub started_at: Instant,
    /// When it finished.
    pub finished_at: Instant,
}

/// A whole generation, collected.
#[derive(Clone, Debug)]
pub struct Completion {
    /// Answer text.
    pub text: String,
    /// Reasoning text.
    pub reasoning: String,
    /// Generated token ids, markers included.
    pub tokens: Vec<u32>,
    /// How it ended.
    pub finish: Finish,
}

/// Stops a generation from any thread. The stream then ends normally, with
/// [`StopReason::Aborted`]; a request aborted while queued ends without tokens.
#[derive(Clone, Debug)]
pub struct AbortHandle(Arc<AtomicBool>);

impl AbortHandle {
    /// Asks the engine to stop this generation after the current token.
    pub fn abort(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn is_aborted(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Chunks the engine may produce ahead of the reader. Beyond that it waits, so a reader that
/// stops reading holds the engine (and the requests queued behind) instead of letting chunks
/// pile up, and an abort takes effect within this many tokens of the last chunk read.
pub const CHUNK_BUFFER: usize = 16;

enum Event {
    Chunk(Chunk),
    Done(Result<Finish>),
}

/// A running (or queued) generation: an iterator of [`Chunk`]s as they are produced; then
/// [`Generation::finish`] says how it ended. Dropping it aborts the generation.
pub struct Generation {
    rx: Receiver<Event>,
    abort: AbortHandle,
    done: Option<Result<Finish>>,
}

impl Iterator for Generation {
    type Item = Chunk;

    /// The next chunk; blocks until the engine produces it. `None` once the generation ended.
    fn next(&mut self) -> Option<Chunk> {
        if self.done.is_some() {
            return None;
        }
        match self.rx.recv() {
            Ok(Event::Chunk(c)) => Some(c),
            Ok(Event::Done(r)) => {
                self.done = Some(r);
                None
            }
            Err(_) => {
                self.done = Some(Err(PlanError::SessionClosed));
                None
            }
        }
    }
}

impl Generation {
    /// A handle that aborts this generation.
    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }

    /// Waits for the end (dropping chunks not yet read) and says how it ended.
    ///
    /// # Errors
    /// A failure while evaluating (the model's error), a request the session cannot serve, or
    /// [`PlanError::SessionClosed`].
    pub fn finish(mut self) -> Result<Finish> {
        while self.next().is_some() {}
        self.done.take().unwrap_or(Err(PlanError::SessionClosed))
    }

    /// Collects the whole generation.
    ///
    /// # Errors
    /// As [`Generation::finish`].
    pub fn complete(mut self) -> Result<Completion> {
        let (mut text, mut reasoning, mut tokens) = (String::new(), String::new(), Vec::new());
        for c in self.by_ref() {
            match c.kind {
                ChunkKind::Text => text.push_str(&c.text),
                ChunkKind::Reasoning => reasoning.push_str(&c.text),
            }
            tokens.extend(c.token_id);
        }
        let finish = self.done.take().unwrap_or(Err(PlanError::SessionClosed))?;
        Ok(Completion { text, reasoning, tokens, finish })
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if self.done.is_none() {
            self.abort.abort();
        }
    }
}

/// What [`Session::prime`] kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Primed {
    /// Tokens evaluated and kept.
    pub n_tokens: usize,
    /// Whether a checkpoint could be taken (else the prefix is re-evaluated when the cache has
    /// moved on).
    pub checkpoint: bool,
}

enum Command {
    Generate { input: Input, opts: GenerateOptions, tx: SyncSender<Event>, abort: AbortHandle },
    Prime { system: String, reply: Sender<Result<Primed>> },
    Reset { reply: Sender<Result<()>> },
}

/// Facts about a loaded session.
#[derive(Clone, Debug)]
pub struct SessionInfo {
    /// The GGUF loaded.
    pub model: PathBuf,
    /// The back end running it.
    pub backend: BackendKind,
    /// The back end's own name (`cpu`, `wgpu`).
    pub backend_name: &'static str,
    /// Context length.
    pub n_ctx: usize,
    /// Whether the model has a chat template.
    pub chat_template: bool,
    /// Think marker ids (open, close), when the vocabulary has them.
    pub think_markers: Option<(u32, u32)>,
    /// The plan the back end was picked with.
    pub plan: Plan,
    /// On the GPU expert tier: the budget's split and the miss mode, for the log.
    pub gpu_tier: Option<String>,
    /// The budget of the RAM expert cache the session opened itself, when the plan paged the
    /// experts of a model larger than the RAM on the CPU (`None` otherwise, and when the caller
    /// gave its own expert store).
    pub expert_cache_bytes: Option<u64>,
}

/// A loaded model, run by one engine thread. Share it between threads with `Arc`; calls queue.
pub struct Session {
    tx: Option<Sender<Command>>,
    thread: Option<std::thread::JoinHandle<()>>,
    info: SessionInfo,
    /// On the GPU expert tier: its statistics, read at any time.
    tier_stats: Option<TierStats>,
}

/// The GPU expert tier's statistics: as text (the miss mode, then `--stats`' per-layer table),
/// and summed.
struct TierStats {
    text: Box<dyn Fn() -> String + Send + Sync>,
    totals: Box<dyn Fn() -> ExpertTierStats + Send + Sync>,
}

/// Loads the model at `path` (file, split part or folder) on the back end `opts` asks for or
/// the plan chooses, with progress events, and starts its engine thread.
///
/// # Errors
/// Everything [`crate::describe`] and [`Plan::pick`] refuse (bad files, budgets too small with
/// the bytes needed, unsupported architectures, no device); loading errors of the model or the
/// tokenizer.
pub fn load(path: &Path, mut opts: LoadOptions) -> Result<Session> {
    let desc = describe(path)?;
    let gguf_path = desc.gguf.clone().ok_or_else(|| PlanError::NotAModel {
        path: path.into(),
        why: "no GGUF file to load (diskformer runs GGUF models)".into(),
    })?;
    let dir = gguf_path.parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."));
    let machine = probe(&ProbeOptions {
        disk_paths: vec![dir],
        measure_bandwidth: opts.measure_bandwidth && opts.backend.is_none(),
        disk_rate_beyond_ram: crate::disk_rate_beyond_ram(&desc, &opts.plan),
    });
    let plan = plan_with(&desc, &machine, &opts.plan);
    let picked = match (&opts.expert_store, opts.backend) {
        _ if opts.gpu_tier.is_some() => BackendKind::GpuPaged,
        (None, want) => plan.pick(want)?.backend,
        (Some(_), None | Some(BackendKind::Cpu)) => BackendKind::Cpu,
        (Some(_), Some(other)) => {
            return Err(PlanError::NoBackend {
                model: gguf_path.display().to_string(),
                reasons: format!("{}: paged experts (an expert store) run on the CPU back end", other.as_str()),
            })
        }
    };
    let mut report = |p: Progress| {
        if let Some(cb) = opts.progress.as_mut() {
            cb(&p);
        }
    };
    let file = Arc::new(GgufModel::open(&gguf_path)?);
    // The plan pages the experts of a model larger than the RAM on the CPU: open its cache.
    let mut expert_cache_bytes = None;
    if picked == BackendKind::Cpu && opts.expert_store.is_none() {
        if let Some(cache) = plan.backend(BackendKind::Cpu).estimate.as_ref().and_then(|e| e.expert_cache_bytes) {
            let popts = pager::PagerOptions {
                prefetch: opts.paging.prefetch,
                direct_io: opts.paging.direct_io,
                ..pager::PagerOptions::new(cache, opts.paging.cache_policy)
            };
            let p = pager::Pager::open(&file, &popts)?;
            opts.expert_store = Some(Arc::new(p));
            expert_cache_bytes = Some(cache);
        }
    }
    let tensor_bytes = file.tensor_bytes_total();
    if opts.read_ahead {
        read_ahead(&file, tensor_bytes, &mut report);
    }
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let template = ChatTemplate::from_gguf(file.metadata())?;
    let model_opts = models::LoadOptions { n_ctx: plan.n_ctx as usize, matmul: opts.matmul };
    let upload_bytes = match picked {
        BackendKind::Gpu => desc.weights.as_ref().and_then(|w| w.gpu_tensor_bytes).unwrap_or(tensor_bytes),
        _ => tensor_bytes,
    };
    report(Progress { stage: Stage::Upload, done_bytes: 0, total_bytes: upload_bytes });
    let (mut tier_line, mut tier_stats) = (None, None);
    // The plan chose the GPU expert tier: start it with the budget it was planned with.
    if picked == BackendKind::GpuPaged && opts.gpu_tier.is_none() {
        opts.gpu_tier = Some(crate::GpuTierOptions {
            budget_bytes: plan.gpu_tier_budget().unwrap_or(0),
            ram_budget_bytes: opts.plan.ram_budget_bytes,
            miss: opts.paging.miss,
            cache_policy: opts.paging.cache_policy,
            prefetch: opts.paging.prefetch,
            direct_io: opts.paging.direct_io,
            gpu_index: opts.plan.gpu_index,
            matmul: opts.matmul,
        });
    }
    let mut runner = match (&opts.gpu_tier, &opts.expert_store) {
        (Some(t), _) => {
            let t = crate::GpuTierOptions { matmul: opts.matmul, gpu_index: opts.plan.gpu_index, ..t.clone() };
            let (runner, line, stats) = load_gpu_tier(&file, plan.n_ctx, &t, &model_opts)?;
            (tier_line, tier_stats) = (Some(line), Some(stats));
            runner
        }
        (None, Some(store)) => {
            let b = compute::cpu::CpuBackend::new(opts.matmul).with_expert_store(Arc::clone(store));
            models::load_on(b, &file, &model_opts)?
        }
        (None, None) => build_runner(picked, &file, &model_opts, opts.plan.gpu_index)?,
    };
    report(Progress { stage: Stage::Upload, done_bytes: upload_bytes, total_bytes: upload_bytes });
    if opts.warm_up {
        let per_token = plan.backend(picked).estimate.as_ref().map_or(tensor_bytes, |e| e.bytes_per_token);
        report(Progress { stage: Stage::WarmUp, done_bytes: 0, total_bytes: per_token });
        let id = tokenizer.bos().unwrap_or(0);
        runner.eval(&[id], Outputs::Last)?;
        runner.reset()?;
        report(Progress { stage: Stage::WarmUp, done_bytes: per_token, total_bytes: per_token });
    }
    let think_markers = desc.thinking.as_ref().map(|t| (t.open_id, t.close_id));
    let info = SessionInfo {
        model: gguf_path,
        backend: picked,
        backend_name: runner.backend_name(),
        n_ctx: runner.n_ctx(),
        chat_template: template.is_some(),
        think_markers,
        plan,
        gpu_tier: tier_line,
        expert_cache_bytes,
    };
    let engine =
        Engine { runner, tokenizer, template, think_markers, cached: Vec::new(), primed: None, last_prompt: None };
    let (tx, rx) = channel();
    let thread = std::thread::Builder::new()
        .name("diskformer-engine".into())
        .spawn(move || engine.serve(rx))
        .map_err(|source| PlanError::Io { path: info.model.clone(), what: "starting the engine thread", source })?;
    Ok(Session { tx: Some(tx), thread: Some(thread), info, tier_stats })
}

/// Touches every page of the weights so the page cache holds them, reporting every 64 MiB.
fn read_ahead(file: &GgufModel, total_bytes: u64, report: &mut impl FnMut(Progress)) {
    const PAGE: usize = 4096;
    const STEP: u64 = 64 << 20;
    report(Progress { stage: Stage::Read, done_bytes: 0, total_bytes });
    let (mut done, mut next_report) = (0u64, STEP);
    for t in file.tensors() {
        let mut acc = 0u8;
        for page in t.data.chunks(PAGE) {
            acc ^= page[0];
        }
        std::hint::black_box(acc);
        done += t.data.len() as u64;
        if done >= next_report {
            report(Progress { stage: Stage::Read, done_bytes: done, total_bytes });
            next_report = done + STEP;
        }
    }
    report(Progress { stage: Stage::Read, done_bytes: total_bytes, total_bytes });
}

/// The model on the GPU expert tier, the tier's placement and miss mode in one line, and its
/// statistics.
#[cfg(feature = "gpu")]
fn load_gpu_tier(
    file: &Arc<GgufModel>,
    n_ctx: u64,
    t: &crate::GpuTierOptions,
    model_opts: &models::LoadOptions,
) -> Result<(Box<dyn Runner>, String, TierStats)> {
    let tier = crate::gpu_tier(file, n_ctx, t)?;
    let line = format!("{}; {}", tier.placement_line, tier.miss_line);
    let (b, miss_line) = (tier.backend.clone(), tier.miss_line);
    let b2 = b.clone();
    let stats = TierStats {
        text: Box::new(move || format!("{miss_line}\n{}", b.format_expert_tier_stats().unwrap_or_default())),
        totals: Box::new(move || b2.expert_tier_total().unwrap_or_default()),
    };
    Ok((models::load_on(tier.backend, file, model_opts)?, line, stats))
}

#[cfg(not(feature = "gpu"))]
fn load_gpu_tier(
    file: &Arc<GgufModel>,
    _n_ctx: u64,
    _t: &crate::GpuTierOptions,
    _model_opts: &models::LoadOptions,
) -> Result<(Box<dyn Runner>, String, TierStats)> {
    Err(PlanError::NoBackend {
        model: file.path().display().to_string(),
        reasons: "gpu_paged: this build has no GPU back end (built without the `gpu` feature)".into(),
    })
}

fn build_runner(
    kind: BackendKind,
    file: &Arc<GgufModel>,
    model_opts: &models::LoadOptions,
    gpu_index: Option<usize>,
) -> Result<Box<dyn Runner>> {
    match kind {
        BackendKind::Cpu => Ok(models::load(file, model_opts)?),
        #[cfg(feature = "gpu")]
        BackendKind::Gpu => {
            let b = compute::wgpu::WgpuBackend::new(compute::wgpu::WgpuOptions {
                adapter_index: gpu_index,
                prefer_discrete: true,
            })
            .map_err(|e| PlanError::NoDevice { why: e.to_string() })?
            .with_matmul_mode(model_opts.matmul);
            Ok(models::load_on(b, file, model_opts)?)
        }
        other => {
            let _ = gpu_index;
            Err(PlanError::NoBackend {
                model: file.path().display().to_string(),
                reasons: format!("{}: this build cannot run it", other.as_str()),
            })
        }
    }
}

impl Session {
    /// Facts about the session (back end, context, the plan it was loaded with).
    pub fn info(&self) -> &SessionInfo {
        &self.info
    }

    /// On the GPU expert tier: its miss mode and per-layer statistics (hits, misses, uploads,
    /// experts computed on the CPU, host reads) since loading, as `--stats` prints them.
    pub fn expert_tier_stats(&self) -> Option<String> {
        self.tier_stats.as_ref().map(|t| (t.text)())
    }

    /// On the GPU expert tier: its counters summed over layers since loading.
    pub fn expert_tier_totals(&self) -> Option<ExpertTierStats> {
        self.tier_stats.as_ref().map(|t| (t.totals)())
    }

    fn send(&self, c: Command) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(c).is_ok())
    }

    /// Starts (or queues, behind earlier calls) a generation and returns its stream at once.
    ///
    /// Read generations in the order they were started, or from different threads: the engine
    /// works on one at a time and waits when [`CHUNK_BUFFER`] chunks are unread, so waiting on
    /// a later generation while holding an earlier, unread one on the same thread never ends.
    /// Dropping a generation aborts it and frees the engine.
    pub fn generate(&self, input: impl Into<Input>, opts: GenerateOptions) -> Generation {
        let (tx, rx) = sync_channel(CHUNK_BUFFER);
        let abort = AbortHandle(Arc::new(AtomicBool::new(false)));
        let mut g = Generation { rx, abort: abort.clone(), done: None };
        if !self.send(Command::Generate { input: input.into(), opts, tx, abort }) {
            g.done = Some(Err(PlanError::SessionClosed));
        }
        g
    }

    /// Evaluates a system prompt and keeps its KV cache (with a checkpoint), so later requests
    /// that start with it do not evaluate it again. With a chat template, the kept prefix is
    /// what every conversation starting with this system message renders before the first
    /// user message's text; later [`Input::Messages`] without a system message get this one.
    /// With raw prompts, the text is put before each prompt. Waits for earlier calls.
    ///
    /// # Errors
    /// The template failing to render; evaluation errors; a prefix longer than the context.
    pub fn prime(&self, system: &str) -> Result<Primed> {
        let (reply, rx) = channel();
        if !self.send(Command::Prime { system: system.to_string(), reply }) {
            return Err(PlanError::SessionClosed);
        }
        rx.recv().unwrap_or(Err(PlanError::SessionClosed))
    }

    /// Forgets the conversation and the primed prompt. Waits for earlier calls.
    ///
    /// # Errors
    /// The back end failing to make a fresh state.
    pub fn reset(&self) -> Result<()> {
        let (reply, rx) = channel();
        if !self.send(Command::Reset { reply }) {
            return Err(PlanError::SessionClosed);
        }
        rx.recv().unwrap_or(Err(PlanError::SessionClosed))
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Closing the channel ends the engine loop once queued requests are served.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The primed prefix: its text (for raw prompts), system message, tokens and checkpoint.
struct PrimedState {
    system: String,
    tokens: Vec<u32>,
    checkpoint: Option<Checkpoint>,
}

struct Engine {
    runner: Box<dyn Runner>,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    think_markers: Option<(u32, u32)>,
    /// Tokens whose KV the runner holds, in order (`runner.n_past()` of them).
    cached: Vec<u32>,
    primed: Option<PrimedState>,
    /// The last prompt and a checkpoint at its end: the next turn of a conversation starts
    /// with it even when the reply, tokenized again, differs from the tokens generated.
    last_prompt: Option<(Vec<u32>, Checkpoint)>,
}

/// Where reasoning stands after `ids`: inside a block when the last open marker comes after
/// the last close marker (templates like DeepSeek-R1's open the block in the prompt).
pub(crate) fn in_reasoning_after(ids: &[u32], markers: Option<(u32, u32)>) -> bool {
    let Some((open, close)) = markers else { return false };
    let last_open = ids.iter().rposition(|&t| t == open);
    let last_close = ids.iter().rposition(|&t| t == close);
    match (last_open, last_close) {
        (Some(o), Some(c)) => o > c,
        (Some(_), None) => true,
        _ => false,
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Engine {
    fn serve(mut self, rx: Receiver<Command>) {
        while let Ok(cmd) = rx.recv() {
            match cmd {
                Command::Generate { input, opts, tx, abort } => {
                    let started_at = Instant::now();
                    let result = self.generate(input, &opts, &tx, &abort, started_at);
                    let _ = tx.send(Event::Done(result));
                }
                Command::Prime { system, reply } => {
                    let _ = reply.send(self.prime(&system));
                }
                Command::Reset { reply } => {
                    let r = self.runner.reset().map_err(PlanError::from);
                    self.cached.clear();
                    self.primed = None;
                    self.last_prompt = None;
                    let _ = reply.send(r);
                }
            }
        }
    }

    fn bos_text(&self) -> Option<&str> {
        self.tokenizer.bos().and_then(|b| self.tokenizer.token_text(b))
    }

    /// Encodes rendered text, adding BOS only when the template has not written it already.
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let has_bos_text =
            self.tokenizer.add_bos() && self.bos_text().is_some_and(|b| !b.is_empty() && text.starts_with(b));
        Ok(self.tokenizer.encode(text, !has_bos_text, true)?)
    }

    fn render(&self, messages: &[ChatMessage], thinking: Option<bool>, add_generation_prompt: bool) -> Result<String> {
        let template = self.template.as_ref().ok_or_else(|| PlanError::Request {
            why: "the model has no chat template (tokenizer.chat_template); send a prompt instead of messages".into(),
        })?;
        let opts = ChatOptions { add_generation_prompt, enable_thinking: thinking, ..Default::default() };
        Ok(template.render(messages, &opts)?)
    }

    /// The text every conversation that starts with `system` renders before the first user
    /// message's content: the common prefix of two renderings that differ only there.
    fn system_prefix(&self, system: &str) -> Result<String> {
        let conv = |user: &str| vec![ChatMessage::new("system", system), ChatMessage::new("user", user)];
        let a = self.render(&conv("A"), None, true)?;
        let b = self.render(&conv("B"), None, true)?;
        let n = a
            .char_indices()
            .zip(b.chars())
            .take_while(|((_, x), y)| x == y)
            .last()
            .map_or(0, |((i, c), _)| i + c.len_utf8());
        Ok(a[..n].to_string())
    }

    /// Evaluates `ids` after the cache and records them.
    fn eval(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let logits = self.runner.eval(ids, Outputs::Last)?;
        self.cached.extend_from_slice(ids);
        Ok(logits)
    }

    fn restart(&mut self) -> Result<()> {
        self.runner.reset()?;
        self.cached.clear();
        self.last_prompt = None;
        Ok(())
    }

    fn prime(&mut self, system: &str) -> Result<Primed> {
        let text = if self.template.is_some() { self.system_prefix(system)? } else { system.to_string() };
        let tokens = self.encode(&text)?;
        if tokens.len() >= self.runner.n_ctx() {
            return Err(PlanError::Request {
                why: format!(
                    "the system prompt has {} tokens but the context holds {}; load with a larger context",
                    tokens.len(),
                    self.runner.n_ctx()
                ),
            });
        }
        self.primed = None;
        self.restart()?;
        if !tokens.is_empty() {
            self.eval(&tokens)?;
        }
        let checkpoint = self.runner.checkpoint().ok();
        let primed = Primed { n_tokens: tokens.len(), checkpoint: checkpoint.is_some() };
        self.primed = Some(PrimedState { system: system.to_string(), tokens, checkpoint });
        Ok(primed)
    }

    /// Full prompt tokens of a request.
    fn prompt_tokens(&self, input: Input, thinking: Option<bool>) -> Result<Vec<u32>> {
        match input {
            Input::Prompt(p) => {
                let text = match &self.primed {
                    Some(pr) if self.template.is_none() => format!("{}{p}", pr.system),
                    _ => p,
                };
                Ok(self.tokenizer.encode(&text, true, true)?)
            }
            Input::Messages(mut messages) => {
                if let Some(pr) = &self.primed {
                    if messages.first().is_none_or(|m| m.role != "system") {
                        messages.insert(0, ChatMessage::new("system", pr.system.as_str()));
                    }
                }
                let text = self.render(&messages, thinking, true)?;
                self.encode(&text)
            }
        }
    }

    /// Brings the cache to a prefix of `prompt` (shorter than it, so at least one token is
    /// evaluated for logits) and returns how many prompt tokens it already holds. In order: the
    /// cache itself when it is a prefix; else the longest anchor (the last prompt's end, the
    /// primed prompt) that is a prefix and whose checkpoint still restores; else the primed
    /// prompt evaluated again; else nothing.
    fn reuse_prefix(&mut self, prompt: &[u32]) -> Result<usize> {
        let common = common_prefix(&self.cached, prompt);
        if common == self.cached.len() && common < prompt.len() {
            return Ok(common);
        }
        let fits = |tokens: &[u32]| tokens.len() < prompt.len() && prompt.starts_with(tokens);
        let mut anchors: Vec<(Vec<u32>, Checkpoint)> = Vec::new();
        if let Some(a) = self.last_prompt.as_ref().filter(|a| fits(&a.0)) {
            anchors.push(a.clone());
        }
        if let Some(p) = self.primed.as_ref().filter(|p| fits(&p.tokens)) {
            anchors.extend(p.checkpoint.clone().map(|cp| (p.tokens.clone(), cp)));
        }
        anchors.sort_by_key(|a| std::cmp::Reverse(a.0.len()));
        for (tokens, cp) in anchors {
            // A refused restore (rows rewritten since, or taken before a reset) changes nothing.
            if self.runner.restore(&cp).is_ok() {
                let n = tokens.len();
                self.cached = tokens;
                return Ok(n);
            }
        }
        if let Some(tokens) = self.primed.as_ref().filter(|p| fits(&p.tokens)).map(|p| p.tokens.clone()) {
            // The primed checkpoint is stale: evaluate the prefix again and keep a new one.
            self.restart()?;
            if !tokens.is_empty() {
                self.eval(&tokens)?;
            }
            let cp = self.runner.checkpoint().ok();
            if let Some(p) = self.primed.as_mut() {
                p.checkpoint = cp;
            }
            return Ok(0);
        }
        self.restart()?;
        Ok(0)
    }

    fn generate(
        &mut self,
        input: Input,
        opts: &GenerateOptions,
        tx: &SyncSender<Event>,
        abort: &AbortHandle,
        started_at: Instant,
    ) -> Result<Finish> {
        let finish = |stop, n_prompt_tokens, n_cached_tokens, n_generated, prompt_ms, generate_ms| Finish {
            stop,
            n_prompt_tokens,
            n_cached_tokens,
            n_generated,
            prompt_ms,
            generate_ms,
            started_at,
            finished_at: Instant::now(),
        };
        if abort.is_aborted() {
            return Ok(finish(StopReason::Aborted, 0, 0, 0, 0.0, 0.0));
        }
        let prompt = self.prompt_tokens(input, opts.thinking)?;
        if prompt.is_empty() {
            return Err(PlanError::Request { why: "the prompt is empty and the model adds no BOS token".into() });
        }
        let n_ctx = self.runner.n_ctx();
        if prompt.len() >= n_ctx {
            return Err(PlanError::Request {
                why: format!(
                    "the prompt has {} tokens but the context holds {n_ctx}; shorten it or load with a larger context",
                    prompt.len()
                ),
            });
        }
        let t0 = Instant::now();
        let n_cached = self.reuse_prefix(&prompt)?;
        let start = self.cached.len();
        let mut logits = self.eval(&prompt[start..])?;
        self.last_prompt = self.runner.checkpoint().ok().map(|cp| (prompt.clone(), cp));
        let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        let n_vocab = self.runner.hparams().n_vocab;
        let mut sampler = Sampler::new(opts.sampling.clone());
        let mut history = prompt.clone();
        let mut reasoning = in_reasoning_after(&prompt, self.think_markers);
        let mut decoder = StreamDecoder::new(&self.tokenizer, false);
        let mut n_generated = 0;
        let kind_of = |r: bool| if r { ChunkKind::Reasoning } else { ChunkKind::Text };
        let stop = loop {
            if abort.is_aborted() {
                break StopReason::Aborted;
            }
            if n_generated >= opts.max_tokens {
                break StopReason::MaxTokens;
            }
            let row = &logits[logits.len() - n_vocab..];
            let id = sampler.sample(row, &history);
            n_generated += 1;
            history.push(id);
            if self.tokenizer.is_eog(id) {
                break StopReason::EndOfGeneration;
            }
            let (text, kind) = match self.think_markers {
                Some((open, close)) if id == open || id == close => {
                    let before = kind_of(reasoning);
                    reasoning = id == open;
                    (decoder.finish(), before)
                }
                _ => (decoder.push(id), kind_of(reasoning)),
            };
            if tx.send(Event::Chunk(Chunk { text, token_id: Some(id), n_tokens: n_generated, kind })).is_err() {
                break StopReason::Aborted;
            }
            if n_generated >= opts.max_tokens {
                break StopReason::MaxTokens;
            }
            if self.runner.n_past() >= n_ctx {
                break StopReason::ContextFull;
            }
            // Read the flag again: an abort during the send should not cost another evaluation.
            if abort.is_aborted() {
                break StopReason::Aborted;
            }
            // Fields, not `self.eval`: the decoder borrows the tokenizer meanwhile.
            self.runner.eval_into(&[id], Outputs::Last, &mut logits)?;
            self.cached.push(id);
        };
        let tail = decoder.finish();
        if !tail.is_empty() {
            let _ = tx.send(Event::Chunk(Chunk {
                text: tail,
                token_id: None,
                n_tokens: n_generated,
                kind: kind_of(reasoning),
            }));
        }
        drop(decoder);
        Ok(finish(stop, prompt.len(), n_cached, n_generated, prompt_ms, t1.elapsed().as_secs_f64() * 1e3))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_state_follows_the_last_marker() {
        let m = Some((7, 8));
        assert!(!in_reasoning_after(&[1, 2, 3], m));
        assert!(in_reasoning_after(&[1, 7, 3], m), "a prompt ending inside <think> starts in reasoning");
        assert!(!in_reasoning_after(&[1, 7, 3, 8, 4], m));
        assert!(in_reasoning_after(&[7, 8, 1, 7], m));
        assert!(!in_reasoning_after(&[1, 7, 3], None));
    }

    #[test]
    fn common_prefix_counts_equal_leading_tokens() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
    }
}
