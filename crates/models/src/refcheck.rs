//! Comparing a model's outputs with the reference fixtures (`shared/fixtures`, see its README):
//! logits of every prompt position against transformers (f32 files) or llama.cpp on the
//! dequantized file (`dequant_f32`, for f16 and quantized files), and greedy continuations.
//!
//! Used by the fixture tests and by `diskformer fixtures`, so the table in docs/ and the test
//! verdicts come from one computation.

use crate::arch::{Outputs, Runner};
use crate::error::{ModelError, Result};
use crate::{load_on, LoadOptions};
use compute::cpu::CpuBackend;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Tolerances from the fixtures README: f32 against transformers at every position.
pub const F32_MAX_ABS: f64 = 1e-3;
/// Relative L2 bound for f32 against transformers.
pub const F32_REL_L2: f64 = 1e-4;
/// Relative L2 bound for f16/quantized files against llama.cpp on the dequantized copy.
pub const DEQUANT_REL_L2: f64 = 1e-4;

/// The outcome of one (architecture, variant) check.
#[derive(Clone, Debug)]
pub struct CheckResult {
    /// Fixture directory name (`llama`, `qwen3_moe`).
    pub arch: String,
    /// Variant (`f32`, `q4_k_m`).
    pub variant: String,
    /// What the logits were compared with (`hf all positions`, `dequant_f32 last position`).
    pub against: &'static str,
    /// Largest absolute logit difference.
    pub max_abs: f64,
    /// ‖ours − ref‖₂ / ‖ref‖₂.
    pub rel_l2: f64,
    /// Greedy ids equal to the reference's before the first difference (of `n_gen`).
    pub greedy_prefix: usize,
    /// Greedy ids compared.
    pub n_gen: usize,
    /// Whether every bound held and the greedy ids are equal.
    pub pass: bool,
    /// Why it failed to run, if it did.
    pub error: Option<String>,
}

/// The fixture root: `$DISKFORMER_FIXTURES`, else `../shared/fixtures` beside the repository,
/// else the compact subset committed in `tests/fixtures`. Returns the path and whether it is the
/// full set.
pub fn fixture_root(repo_root: &Path) -> (PathBuf, bool) {
    if let Ok(p) = std::env::var("DISKFORMER_FIXTURES") {
        return (PathBuf::from(p), true);
    }
    let shared = repo_root.join("../shared/fixtures");
    if shared.join("README.md").exists() {
        return (shared, true);
    }
    (repo_root.join("tests/fixtures"), false)
}

/// Every (arch directory, variant) pair present under `root` whose ref.json lists the variant.
pub fn list_cases(root: &Path) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut dirs: Vec<_> = std::fs::read_dir(root)
        .map_err(|e| ModelError::Request { why: format!("cannot read fixtures at {}: {e}", root.display()) })?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("ref.json").exists())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    dirs.sort();
    for d in dirs {
        let r = read_ref(&root.join(&d))?;
        let mut variants: Vec<String> =
            r["llama_cpp"].as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
        variants.sort();
        for v in variants {
            let Some(file) = r["llama_cpp"][&v]["file"].as_str() else { continue };
            if root.join(&d).join(file).is_file() {
                out.push((d.clone(), v));
            }
        }
    }
    Ok(out)
}

fn read_ref(dir: &Path) -> Result<Value> {
    let p = dir.join("ref.json");
    let s = std::fs::read_to_string(&p).map_err(|e| ModelError::Request { why: format!("{}: {e}", p.display()) })?;
    // Python's json writes Infinity and NaN (granitemoehybrid's config has time_step_limit
    // [0.0, Infinity]); JSON has neither, so map them to values serde_json accepts.
    let s = s.replace("-Infinity", "-1.0e308").replace("Infinity", "1.0e308").replace("NaN", "null");
    serde_json::from_str(&s).map_err(|e| ModelError::Request { why: format!("{}: {e}", p.display()) })
}

/// The `gguf_arch` a fixture directory's ref.json records.
pub fn gguf_arch(root: &Path, arch: &str) -> Result<String> {
    Ok(read_ref(&root.join(arch))?["gguf_arch"].as_str().unwrap_or_default().to_string())
}

fn floats(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a
            .iter()
            .flat_map(|x| match x {
                Value::Array(_) => floats(x),
                _ => vec![x.as_f64().unwrap_or(f64::NAN)],
            })
            .collect(),
        _ => vec![],
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()).unwrap_or_default()
}

/// max |a − b| and ‖a − b‖₂ / ‖b‖₂.
pub fn compare(ours: &[f32], reference: &[f64]) -> (f64, f64) {
    let mut max_abs: f64 = 0.0;
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&a, &b) in ours.iter().zip(reference) {
        let d = a as f64 - b;
        max_abs = max_abs.max(d.abs());
        num += d * d;
        den += b * b;
    }
    if ours.len() != reference.len() {
        return (f64::INFINITY, f64::INFINITY);
    }
    (max_abs, (num / den.max(1e-300)).sqrt())
}

/// Greedy decoding: `n` ids after feeding `prompt` (argmax, lowest id on ties).
pub fn greedy(runner: &mut dyn Runner, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    runner.reset()?;
    let n_vocab = runner.hparams().n_vocab;
    let mut logits = runner.eval(prompt, Outputs::Last)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let id = argmax(&logits[logits.len() - n_vocab..]);
        out.push(id);
        if out.len() == n {
            break;
        }
        logits = runner.eval(&[id], Outputs::Last)?;
    }
    Ok(out)
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Checks one variant of one fixture architecture on the CPU back end.
pub fn check(root: &Path, arch: &str, variant: &str, opts: &LoadOptions) -> CheckResult {
    check_with(root, arch, variant, |model| load_on(CpuBackend::new(opts.matmul), model, opts))
}

/// Checks one variant with a caller-supplied loader (other back ends, paged experts).
pub fn check_with(
    root: &Path,
    arch: &str,
    variant: &str,
    load: impl Fn(&Arc<gguf::GgufModel>) -> Result<Box<dyn Runner>>,
) -> CheckResult {
    let mut res = CheckResult {
        arch: arch.to_string(),
        variant: variant.to_string(),
        against: "",
        max_abs: f64::NAN,
        rel_l2: f64::NAN,
        greedy_prefix: 0,
        n_gen: 0,
        pass: false,
        error: None,
    };
    if let Err(e) = check_inner(root, arch, variant, load, &mut res) {
        res.error = Some(e.to_string());
        res.pass = false;
    }
    res
}

fn check_inner(
    root: &Path,
    arch: &str,
    variant: &str,
    load: impl Fn(&Arc<gguf::GgufModel>) -> Result<Box<dyn Runner>>,
    res: &mut CheckResult,
) -> Result<()> {
    let dir = root.join(arch);
    let r = read_ref(&dir)?;
    let v = &r["llama_cpp"][variant];
    let file = dir.join(v["file"].as_str().unwrap_or_default());
    let model = Arc::new(gguf::GgufModel::open(&file)?);
    let mut runner = load(&model)?;
    let prompt = ids(&r["prompt"]["ids"]);
    let n_vocab = runner.hparams().n_vocab;
    let (expected_greedy, bound_abs, bound_rel) = if variant == "f32" {
        res.against = "hf, all positions";
        let logits = runner.eval(&prompt, Outputs::All)?;
        let (max_abs, rel) = compare(&logits, &floats(&r["hf"]["logits"]));
        res.max_abs = max_abs;
        res.rel_l2 = rel;
        (ids(&r["hf"]["greedy"]), F32_MAX_ABS, F32_REL_L2)
    } else {
        res.against = "dequant_f32, last position";
        let d = &v["dequant_f32"];
        if d.get("last_logits").is_none() {
            return Err(ModelError::Request { why: format!("ref.json has no dequant_f32 for {variant}") });
        }
        let logits = runner.eval(&prompt, Outputs::Last)?;
        let (max_abs, rel) = compare(&logits[logits.len() - n_vocab..], &floats(&d["last_logits"]));
        res.max_abs = max_abs;
        res.rel_l2 = rel;
        // Where llama.cpp's own f32 run departs from transformers (gemma3's fp16 GELU table,
        // gpt-oss's truncated YaRN: fixtures README notes 1 and 2), its dequant_f32 logits carry
        // that departure too; an engine that follows transformers can only be held to it.
        let peer_gap = r["llama_cpp"]["f32"]["vs_hf"]["all_positions"]["rel_l2"].as_f64().unwrap_or(0.0);
        let bound = if peer_gap > DEQUANT_REL_L2 {
            res.against = "dequant_f32, last position (bound: 2x llama.cpp's own f32 gap)";
            2.0 * peer_gap
        } else {
            DEQUANT_REL_L2
        };
        (ids(&d["greedy"]), f64::INFINITY, bound)
    };
    let ours = greedy(runner.as_mut(), &prompt, expected_greedy.len())?;
    res.n_gen = expected_greedy.len();
    res.greedy_prefix = ours.iter().zip(&expected_greedy).take_while(|(a, b)| a == b).count();
    res.pass = res.max_abs <= bound_abs && res.rel_l2 <= bound_rel && res.greedy_prefix == res.n_gen;
    Ok(())
}

/// The table row of a result: `arch variant against max_abs rel_l2 greedy verdict`.
pub fn format_row(r: &CheckResult) -> String {
    match &r.error {
        Some(e) => format!("| {} | {} | - | - | - | - | ERROR: {e} |", r.arch, r.variant),
        None => format!(
            "| {} | {} | {} | {:.1e} | {:.1e} | {}/{} | {} |",
            r.arch,
            r.variant,
            r.against,
            r.max_abs,
            r.rel_l2,
            r.greedy_prefix,
            r.n_gen,
            if r.pass { "ok" } else { "FAIL" }
        ),
    }
}
