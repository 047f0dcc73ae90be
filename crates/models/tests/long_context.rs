//! Long greedy runs with the KV cache (and recurrent state) against recomputing the whole
//! sequence from scratch: every supported architecture of the reference fixtures (its f32
//! file, else q8_0) generates 300 tokens after the fixture prompt in a context of 512, one
//! token per step with the cache; at the first 40 steps and then every 20th, the sequence so
//! far is evaluated again in one batch from an empty state, and the logits of its last position
//! must equal the cached step's (relative L2 within 1e-4, same argmax). This covers what the
//! 16-token fixture runs cannot: cache writes far past the prompt, positions beyond the
//! models' trained context of 256, sliding windows that wrap many times (gemma3's window of 8,
//! gpt-oss), and recurrent state carried over hundreds of steps (lfm2, granitehybrid).
//!
//! Runs the full ../shared/fixtures set when present, else the compact committed subset, and
//! says which.

use models::refcheck::{argmax, fixture_root, gguf_arch, list_cases};
use models::{load, LoadOptions, Outputs, Runner, SUPPORTED_ARCHITECTURES};
use std::path::Path;
use std::sync::Arc;

const N_CTX: usize = 512;
const N_GEN: usize = 300;
/// Steps below this are all checked by full recomputation; later ones every `CHECK_EVERY`.
const CHECK_ALL_BELOW: usize = 40;
const CHECK_EVERY: usize = 20;
const MAX_REL_L2: f64 = 1e-4;

fn rel_l2(ours: &[f32], reference: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&a, &b) in ours.iter().zip(reference) {
        num += (a as f64 - b as f64).powi(2);
        den += (b as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

/// The fixture prompt of an architecture directory (BOS first).
fn prompt_ids(dir: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(dir.join("ref.json")).expect("ref.json readable");
    // Python's json writes Infinity (granitemoehybrid's config); serde_json refuses it.
    let text = text.replace("-Infinity", "-1.0e308").replace("Infinity", "1.0e308").replace("NaN", "null");
    let v: serde_json::Value = serde_json::from_str(&text).expect("ref.json parses");
    v["prompt"]["ids"].as_array().expect("prompt ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// Outcome of one architecture: steps checked, worst relative L2, or what went wrong.
struct Outcome {
    checked: usize,
    worst_rel_l2: f64,
    failure: Option<String>,
}

/// Generates with `runner` (cache) and checks steps against `fresh` (reset, whole sequence).
fn run(runner: &mut dyn Runner, fresh: &mut dyn Runner, prompt: &[u32]) -> models::Result<Outcome> {
    let n_vocab = runner.hparams().n_vocab;
    let mut out = Outcome { checked: 0, worst_rel_l2: 0.0, failure: None };
    let mut seq = prompt.to_vec();
    runner.reset()?;
    let mut cached = runner.eval(prompt, Outputs::Last)?;
    for step in 0..N_GEN {
        let id = argmax(&cached[cached.len() - n_vocab..]);
        if step < CHECK_ALL_BELOW || step % CHECK_EVERY == 0 || step == N_GEN - 1 {
            // Second code path: no cache, the whole sequence in one batch from an empty state.
            fresh.reset()?;
            let full = fresh.eval(&seq, Outputs::Last)?;
            let rel = rel_l2(&cached[cached.len() - n_vocab..], &full);
            out.checked += 1;
            out.worst_rel_l2 = out.worst_rel_l2.max(rel);
            let full_id = argmax(&full);
            if rel > MAX_REL_L2 || full_id != id {
                out.failure = Some(format!(
                    "step {step} (position {}): rel_l2 {rel:.2e}, cached argmax {id}, recomputed argmax {full_id}",
                    seq.len() - 1
                ));
                return Ok(out);
            }
        }
        seq.push(id);
        if step + 1 < N_GEN {
            cached = runner.eval(&[id], Outputs::Last)?;
        }
    }
    Ok(out)
}

#[test]
fn cached_generation_matches_full_recompute() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (root, full) = fixture_root(&repo);
    println!("fixture set: {} ({})", root.display(), if full { "full shared set" } else { "compact committed subset" });
    let cases = list_cases(&root).expect("fixtures readable");
    let mut dirs: Vec<String> = cases.iter().map(|(a, _)| a.clone()).collect();
    dirs.dedup();
    let mut failures = Vec::new();
    let mut ran = 0;
    for dir in dirs {
        let arch = gguf_arch(&root, &dir).expect("ref.json readable");
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            println!("| {dir} | {arch} | not supported, skipped |");
            continue;
        }
        let variant = ["f32", "q8_0"].into_iter().find(|v| cases.iter().any(|(a, cv)| *a == dir && cv == v));
        let Some(variant) = variant else {
            failures.push(format!("{dir}: neither an f32 nor a q8_0 file"));
            continue;
        };
        let file = root.join(&dir).join(format!("model-{variant}.gguf"));
        let started = std::time::Instant::now();
        let model = Arc::new(gguf::GgufModel::open(&file).expect("fixture opens"));
        let opts = LoadOptions { n_ctx: N_CTX, ..LoadOptions::default() };
        let (mut runner, mut fresh) = match (load(&model, &opts), load(&model, &opts)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                failures.push(format!("{dir} {variant}: load failed: {e}"));
                continue;
            }
        };
        let prompt = prompt_ids(&root.join(&dir));
        let outcome = run(runner.as_mut(), fresh.as_mut(), &prompt);
        ran += 1;
        match outcome {
            Ok(o) => {
                println!(
                    "| {dir} | {variant} | {} steps checked of {N_GEN} | worst rel_l2 {:.1e} | {:.1} s | {} |",
                    o.checked,
                    o.worst_rel_l2,
                    started.elapsed().as_secs_f64(),
                    if o.failure.is_none() { "ok" } else { "FAIL" }
                );
                if let Some(f) = o.failure {
                    failures.push(format!("{dir} {variant}: {f}"));
                }
            }
            Err(e) => failures.push(format!("{dir} {variant}: {e}")),
        }
    }
    println!("{ran} architectures ran");
    assert!(ran > 0, "no supported fixture under {}", root.display());
    assert!(failures.is_empty(), "cached and recomputed runs differ:\n{}", failures.join("\n"));
}
