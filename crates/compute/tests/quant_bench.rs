//! Throughput of `compute::quant::matmul`, printed, not asserted (run on demand):
//! `cargo test --release -p compute --test quant_bench -- --ignored --nocapture`.
//! Decode is one token (a matrix-vector product: weight bandwidth bound); prefill is 64 tokens.
//! GB/s counts the encoded weight bytes read per call. `QUANT_BENCH_TYPES=Q4_0,Q4_K` picks types,
//! `QUANT_BENCH_N_OUT` and `QUANT_BENCH_K` the shape (default 4096 x 4096).

mod quant_common;

use std::time::Instant;

use compute::quant::{self, GgmlType, Kernel, MatmulMode};
use quant_common::{random_rows, Rng};

fn best_seconds(mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < 0.6 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn matmul_throughput() {
    let (n_out, k) = (
        std::env::var("QUANT_BENCH_N_OUT").ok().and_then(|v| v.parse().ok()).unwrap_or(4096usize),
        std::env::var("QUANT_BENCH_K").ok().and_then(|v| v.parse().ok()).unwrap_or(4096usize),
    );
    println!("n_out={n_out} k={k}, {} rayon threads, best kernel {:?}", rayon::current_num_threads(), Kernel::best());
    println!(
        "{:<7} {:>9} | {:>22} | {:>22} | {:>24}",
        "type", "MiB", "decode exact", "decode q8 portable/best", "prefill64 exact / best"
    );
    let mut rng = Rng::new(7);
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::IQ4_NL,
        GgmlType::MXFP4,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
    ];
    // QUANT_BENCH_TYPES=Q4_0,Q4_K runs only those types.
    let only = std::env::var("QUANT_BENCH_TYPES").ok();
    for dtype in types {
        if only.as_deref().is_some_and(|names| !names.split(',').any(|n| n == dtype.name())) {
            continue;
        }
        let w = random_rows(dtype, n_out, k, &mut rng);
        let gb = w.len() as f64 / 1e9;
        let x1: Vec<f32> = (0..k).map(|_| rng.normal()).collect();
        let x64: Vec<f32> = (0..64 * k).map(|_| rng.normal()).collect();
        let mut y1 = vec![0f32; n_out];
        let mut y64 = vec![0f32; 64 * n_out];
        let exact = best_seconds(|| quant::matmul(dtype, &w, n_out, k, &x1, &mut y1, MatmulMode::Exact).unwrap());
        let (portable, best) = if dtype.is_quantized() {
            let p =
                best_seconds(|| quant::matmul_quantized(dtype, &w, n_out, k, &x1, &mut y1, Kernel::Portable).unwrap());
            let b =
                best_seconds(|| quant::matmul_quantized(dtype, &w, n_out, k, &x1, &mut y1, Kernel::best()).unwrap());
            (format!("{:.1}", gb / p), format!("{:.1}", gb / b))
        } else {
            ("-".into(), "-".into())
        };
        let pre_exact = best_seconds(|| quant::matmul(dtype, &w, n_out, k, &x64, &mut y64, MatmulMode::Exact).unwrap());
        let pre_fast = best_seconds(|| {
            quant::matmul(dtype, &w, n_out, k, &x64, &mut y64, MatmulMode::QuantizedActivations).unwrap()
        });
        let gflops = |s: f64| 2.0 * 64.0 * n_out as f64 * k as f64 / s / 1e9;
        println!(
            "{:<7} {:>9.1} | {:>13.1} GB/s | {:>8} / {:>6} GB/s | {:>6.1} / {:>6.1} GFLOP/s",
            dtype.name(),
            w.len() as f64 / (1 << 20) as f64,
            gb / exact,
            portable,
            best,
            gflops(pre_exact),
            gflops(pre_fast),
        );
    }
}
