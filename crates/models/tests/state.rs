//! Checkpoints of a sequence state (`Runner::checkpoint` / `Runner::restore`): after priming a
//! prefix, taking a checkpoint, continuing, and restoring, a continuation must give exactly the
//! logits it gave the first time and those of a fresh runner fed the same tokens in the same
//! chunks. Run on the hybrid architectures, whose recurrent state (conv windows, Mamba-2 SSM
//! state) the checkpoint must copy, and on gpt-oss (attention only, sliding window), whose KV rows
//! it must leave valid. A checkpoint whose KV rows were overwritten, or one from before a reset,
//! must be refused.
//!
//! Runs on the full ../shared/fixtures set when present (f32 files), else on the compact committed
//! subset (q4_0 files), and says which.

use models::refcheck::{fixture_root, list_cases};
use models::{load, LoadOptions, Outputs, Runner};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Fixture directories covered: conv layers (lfm2, lfm2_moe), Mamba-2 layers (granitemoehybrid),
/// attention only with a sliding window (gpt_oss).
const ARCHS: &[&str] = &["lfm2", "lfm2_moe", "granitemoehybrid", "gpt_oss"];

const PREFIX: &[u32] = &[1, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98];
const CONT_A: &[u32] = &[114, 111, 119, 110, 32, 102, 111, 120, 32, 106, 117, 109, 112, 115];
const CONT_B: &[u32] = &[32, 111, 118, 101, 114, 32, 116, 104, 101];

/// The model file of `arch` to use: f32 when present (full set), else the first variant listed.
fn model_path(root: &Path, arch: &str) -> PathBuf {
    let cases = list_cases(root).expect("fixtures readable");
    let variants: Vec<&String> = cases.iter().filter(|(a, _)| a == arch).map(|(_, v)| v).collect();
    assert!(!variants.is_empty(), "no fixture files for {arch} under {}", root.display());
    let variant = variants.iter().find(|v| v.as_str() == "f32").unwrap_or(&variants[0]);
    root.join(arch).join(format!("model-{variant}.gguf"))
}

fn runner(path: &Path) -> Box<dyn Runner> {
    let model = Arc::new(gguf::GgufModel::open(path).expect("fixture opens"));
    load(&model, &LoadOptions { n_ctx: 128, ..LoadOptions::default() }).expect("fixture loads")
}

/// Logits of `chunks` fed one after another, every position of each chunk.
fn feed(r: &mut dyn Runner, chunks: &[&[u32]]) -> Vec<f32> {
    chunks.iter().flat_map(|c| r.eval(c, Outputs::All).expect("eval")).collect()
}

#[test]
fn restore_replays_a_continuation_exactly() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (root, full) = fixture_root(&repo);
    println!(
        "fixture set: {} ({})",
        root.display(),
        if full { "full shared set, f32 files" } else { "compact committed subset" }
    );
    for arch in ARCHS {
        let path = model_path(&root, arch);
        println!("{arch}: {}", path.display());
        let mut r = runner(&path);
        r.eval(PREFIX, Outputs::Last).expect("prime");
        let cp = r.checkpoint().expect("checkpoint");
        assert_eq!(cp.n_past(), PREFIX.len());
        // Continuation A in two chunks (a batch, then single tokens), then B, then A again.
        let (a1, a2) = CONT_A.split_at(5);
        let singles: Vec<&[u32]> = a2.chunks(1).collect();
        let mut chunks_a = vec![a1];
        chunks_a.extend(singles);
        let first = feed(r.as_mut(), &chunks_a);
        r.restore(&cp).expect("restore after A");
        assert_eq!(r.n_past(), PREFIX.len());
        let other = feed(r.as_mut(), &[CONT_B]);
        r.restore(&cp).expect("restore after B");
        let again = feed(r.as_mut(), &chunks_a);
        assert_eq!(first, again, "{arch}: continuation A after restore differs from the first run");
        // The same tokens in the same chunks from a fresh runner.
        let mut fresh = runner(&path);
        fresh.eval(PREFIX, Outputs::Last).expect("prime fresh");
        let reference = feed(fresh.as_mut(), &chunks_a);
        assert_eq!(first, reference, "{arch}: continuation A differs from a fresh runner's");
        // And B differs from A (the restore is not a no-op on equal inputs).
        assert_ne!(other[..], first[..other.len()], "{arch}: continuations A and B gave equal logits");
    }
}

#[test]
fn restore_refuses_overwritten_or_foreign_checkpoints() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (root, full) = fixture_root(&repo);
    println!("fixture set: {} ({})", root.display(), if full { "full shared set" } else { "compact committed subset" });
    let path = model_path(&root, "granitemoehybrid");
    let mut r = runner(&path);
    r.eval(&PREFIX[..5], Outputs::Last).expect("eval");
    let early = r.checkpoint().expect("checkpoint");
    r.eval(&PREFIX[5..], Outputs::Last).expect("eval");
    let late = r.checkpoint().expect("checkpoint");
    // Going back to `early` and forward again keeps `late`'s rows only until they are rewritten.
    r.restore(&early).expect("restore early");
    r.restore(&late).expect("late is intact: nothing was written since");
    r.restore(&early).expect("restore early again");
    r.eval(&CONT_B[..3], Outputs::Last).expect("eval over late's rows");
    let err = r.restore(&late).expect_err("late's rows 5..8 were overwritten");
    println!("refused as expected: {err}");
    assert!(err.to_string().contains("stale"), "unexpected error: {err}");
    r.restore(&early).expect("early is still intact");
    // A reset starts a new state: older checkpoints no longer apply.
    r.reset().expect("reset");
    let err = r.restore(&early).expect_err("checkpoint from before the reset");
    println!("refused as expected: {err}");
    // Nor does a checkpoint of another runner.
    let mut other = runner(&path);
    other.eval(&PREFIX[..5], Outputs::Last).expect("eval");
    let foreign = other.checkpoint().expect("checkpoint");
    assert!(r.restore(&foreign).is_err(), "a checkpoint of another runner was accepted");
}
