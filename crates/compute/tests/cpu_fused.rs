//! The CPU back end's fused decode ops against the ops they fuse, bit for bit: `matmul_glu`
//! (both products and the gating in one parallel region) against `matmul_many` then `glu`,
//! on random encoded weights of the tiled and untiled types, row counts that leave partial
//! groups of eight rows and tails of the vectorised gating, one token (fused) and several
//! (not fused), in both matmul modes.

mod quant_common;

use std::sync::Arc;

use compute::cpu::{CpuBackend, CpuTensor};
use compute::quant::{GgmlType, MatmulMode};
use compute::spec::{Act, Glu};
use compute::{Backend, HostWeight};
use gguf::{GgufModel, GgufWriter, Value};
use quant_common::{random_rows, Rng};

/// `gate` and `up` weights `[n_ff, k]` of `dtype` with random valid blocks, written to a GGUF
/// file and mapped back as the models load them.
fn gate_up(dtype: GgmlType, n_ff: usize, k: usize, rng: &mut Rng) -> (HostWeight, HostWeight) {
    let path = std::env::temp_dir().join(format!("diskformer-cpu-fused-{}-{dtype}-{n_ff}.gguf", std::process::id()));
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("test".into()));
    let data = [random_rows(dtype, n_ff, k, rng), random_rows(dtype, n_ff, k, rng)];
    for name in ["gate", "up"] {
        w.add_tensor(name, dtype, &[k as u64, n_ff as u64]).unwrap();
    }
    let mut out = w.create(&path).unwrap();
    for bytes in &data {
        out.write_data(bytes).unwrap();
    }
    out.finish().unwrap();
    let model = Arc::new(GgufModel::open(&path).unwrap());
    let weights = (HostWeight::from_model(&model, "gate").unwrap(), HostWeight::from_model(&model, "up").unwrap());
    std::fs::remove_file(&path).ok();
    weights
}

fn bits(t: &CpuTensor) -> Vec<u32> {
    t.data.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn matmul_glu_gives_the_bits_of_matmul_many_then_glu() {
    let mut rng = Rng::new(0x61u64);
    let glus = [Glu::Plain(Act::Silu), Glu::Plain(Act::GeluTanh), Glu::SwiGluOai { alpha: 1.702, limit: 7.0 }];
    // n_ff: one partial group of eight, a ragged last task, a Llama-like width; k of several
    // blocks (two super-blocks for the k-quants).
    for (dtype, n_ff, k) in [
        (GgmlType::Q4_0, 13, 64),
        (GgmlType::Q4_0, 300, 96),
        (GgmlType::Q4_0, 2048, 512),
        (GgmlType::Q4_1, 301, 160),
        (GgmlType::Q5_0, 77, 64),
        (GgmlType::Q8_0, 129, 96),
        (GgmlType::Q4_K, 203, 512),
        (GgmlType::Q6_K, 64, 256),
        (GgmlType::Q5_K, 50, 256),
        (GgmlType::F16, 37, 64),
    ] {
        let (gate_w, up_w) = gate_up(dtype, n_ff, k, &mut rng);
        for mode in [MatmulMode::QuantizedActivations, MatmulMode::Exact] {
            let b = CpuBackend::new(mode);
            for n_tok in [1, 3] {
                let xs: Vec<f32> = (0..n_tok * k).map(|_| 2.0 * rng.normal()).collect();
                let x = b.from_host(&xs, &[n_tok, k]).unwrap();
                for glu in glus {
                    let [gate, up] = b.matmul_many(&x, [&gate_w, &up_w]).unwrap();
                    let want = b.glu(&gate, &up, glu).unwrap();
                    let got = b.matmul_glu(&x, &gate_w, &up_w, glu).unwrap();
                    assert_eq!(got.shape, want.shape, "{dtype} n_ff={n_ff} {mode:?} n_tok={n_tok} {glu:?}");
                    assert_eq!(bits(&got), bits(&want), "{dtype} n_ff={n_ff} {mode:?} n_tok={n_tok} {glu:?}");
                }
            }
        }
    }
}

#[test]
fn matmul_glu_refuses_a_mismatched_width() {
    let mut rng = Rng::new(0x62u64);
    let (gate_w, up_w) = gate_up(GgmlType::Q4_0, 16, 64, &mut rng);
    let b = CpuBackend::new(MatmulMode::QuantizedActivations);
    let x = b.from_host(&[0.5; 32], &[1, 32]).unwrap();
    assert!(b.matmul_glu(&x, &gate_w, &up_w, Glu::Plain(Act::Silu)).is_err());
}
