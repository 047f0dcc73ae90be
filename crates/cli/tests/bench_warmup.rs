//! `diskformer bench`'s tg warm-up: one token as llama-bench's with `DISKFORMER_BENCH_WARMUP_MS=0`,
//! and more, for at least that long after the first, otherwise (the GPU's clock ramp after idle
//! made a one-token warm-up leave the first repetition slow: `commands::bench::tg_warmup`).

use std::process::Command;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_diskformer");

fn bench(warmup_ms: u64) -> (serde_json::Value, Duration) {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/llama/model-q4_0.gguf");
    let t0 = Instant::now();
    let out = Command::new(BIN)
        .args(["bench", "-m", model, "--device", "cpu", "-p", "0", "-n", "4", "-r", "2", "-t", "1", "--json"])
        .env("DISKFORMER_BENCH_WARMUP_MS", warmup_ms.to_string())
        .output()
        .expect("diskformer runs");
    let took = t0.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("bench --json: {e}: {stderr}"));
    (json, took)
}

#[test]
fn the_tg_warmup_is_one_token_or_lasts_as_long_as_asked() {
    let (one, _) = bench(0);
    assert_eq!(one["tg_warmup_tokens"], 1, "{one}");
    assert_eq!(one["tg_samples"].as_array().map(Vec::len), Some(2), "two timed repetitions: {one}");
    let first = one["tg_first_token_s"].as_f64().expect("the first token's time");
    assert!(first > 0.0, "{one}");

    // A fixture's step takes about a millisecond: 400 ms of warm-up is many passes of 4 tokens.
    let (long, took) = bench(400);
    let tokens = long["tg_warmup_tokens"].as_u64().expect("warm-up tokens");
    assert!(tokens > 8, "400 ms of warm-up decoded {tokens} tokens: {long}");
    assert!(took >= Duration::from_millis(400), "the run took {took:?}, less than its warm-up");
    assert_eq!(long["tg_samples"].as_array().map(Vec::len), Some(2), "two timed repetitions: {long}");
}
