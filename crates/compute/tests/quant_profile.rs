//! A fixed amount of `matmul_quantized` work for instruction counting (run on demand):
//! `RAYON_NUM_THREADS=1 valgrind --tool=callgrind <test binary> --ignored --nocapture`
//! with `QUANT_PROFILE=TYPE:N_OUT:K:N_TOK[,...]` (default: the shapes of SmolLM2-135M Q4_1,
//! Gemma 3 270M Q4_K and a Llama-1B layer in Q4_0/Q4_K, prefill 64 and decode 1).
//! Callgrind's inclusive count of `matmul_quantized` divided by the printed multiply-adds gives
//! instructions per multiply-add, the figure compared with llama.cpp's kernels.

use compute::quant::{self, GgmlType, Kernel};

mod quant_common;
use quant_common::{random_rows, Rng};

fn parse_type(name: &str) -> GgmlType {
    gguf::ALL_TYPES.into_iter().find(|t| t.name() == name).unwrap_or_else(|| panic!("unknown type {name}"))
}

#[test]
#[ignore = "profiling workload: run under callgrind with --ignored"]
fn matmul_profile_workload() {
    let spec = std::env::var("QUANT_PROFILE")
        .unwrap_or_else(|_| "Q4_1:1536:576:64,Q4_1:1536:576:1,Q4_K:2048:640:64,Q4_0:8192:2048:64,Q4_K:8192:2048:64,Q4_0:8192:2048:1,Q4_K:8192:2048:1".into());
    let mut rng = Rng::new(11);
    for case in spec.split(',') {
        let parts: Vec<&str> = case.split(':').collect();
        let dtype = parse_type(parts[0]);
        let [n_out, k, n_tok] = [1, 2, 3].map(|i| parts[i].parse::<usize>().expect("N_OUT:K:N_TOK numbers"));
        let w = random_rows(dtype, n_out, k, &mut rng);
        let x: Vec<f32> = (0..n_tok * k).map(|_| rng.normal()).collect();
        let mut y = vec![0f32; n_tok * n_out];
        quant::matmul_quantized(dtype, &w, n_out, k, &x, &mut y, Kernel::best()).unwrap();
        let checksum: f64 = y.iter().map(|&v| v as f64).sum();
        println!("{case}: {} multiply-adds, checksum {checksum:.3}", n_out * k * n_tok);
    }
}
