//! The quantized-activation kernels (llama.cpp-style Q8_0/Q8_K activations): every available
//! vectorised kernel against the portable one on random valid blocks and odd shapes, tiling
//! checks for prefill, and the dot-product error bounds of ggml's test-quantize-fns.

mod quant_common;

use compute::quant::{self, GgmlType, Kernel, MatmulMode, QuantError};
use quant_common::{ggml_test_data, random_rows, Rng};

/// Types with an 8-bit activation scheme.
const QUANTIZED: &[GgmlType] = &[
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
];

fn run(dtype: GgmlType, w: &[u8], n_out: usize, k: usize, x: &[f32], kernel: Kernel) -> Vec<f32> {
    let mut y = vec![f32::NAN; x.len() / k * n_out];
    quant::matmul_quantized(dtype, w, n_out, k, x, &mut y, kernel).unwrap();
    y
}

#[test]
fn every_kernel_matches_the_portable_one() {
    let kernels = Kernel::available();
    println!("kernels on this CPU: {kernels:?} (best {:?})", Kernel::best());
    let mut rng = Rng::new(0xC0FFEE);
    for &dtype in QUANTIZED {
        let be = dtype.block_elems();
        // Odd row counts, one to many blocks per row, decode and prefill token counts.
        // 13, 29 and 7 rows leave partial groups of the eight-row and four-row kernels; 2 and 19
        // tokens partial token quads; the last two are enough work to split across threads.
        for (n_out, blocks, n_tok) in [(1, 1, 1), (13, 3, 1), (29, 9, 2), (7, 2, 19), (300, 9, 1), (70, 18, 5)] {
            let k = be * blocks;
            let w = random_rows(dtype, n_out, k, &mut rng);
            let x: Vec<f32> = (0..n_tok * k).map(|_| rng.normal()).collect();
            let reference = run(dtype, &w, n_out, k, &x, Kernel::Portable);
            // Bound the float reordering by the size of the terms: |w| |x| summed in f64.
            let mut deq = vec![0f32; n_out * k];
            quant::dequantize(dtype, &w, &mut deq).unwrap();
            for &kernel in &kernels {
                let got = run(dtype, &w, n_out, k, &x, kernel);
                for t in 0..n_tok {
                    for o in 0..n_out {
                        let scale: f64 = (0..k).map(|i| (deq[o * k + i] as f64 * x[t * k + i] as f64).abs()).sum();
                        let (g, r) = (got[t * n_out + o], reference[t * n_out + o]);
                        assert!(
                            ((g - r) as f64).abs() <= 1e-5 * scale + 1e-30,
                            "{dtype} {kernel:?} n_out={n_out} k={k} t={t} o={o}: {g} vs portable {r} (terms {scale})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn prefill_tiles_give_the_same_bits_as_one_token_at_a_time() {
    let mut rng = Rng::new(0xBEEF);
    for &dtype in &[
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::MXFP4,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::IQ4_XS,
    ] {
        // Token counts around the tile widths (4 tokens; 16 as two octets of 8, a last lone
        // octet, partial octets) with row counts that leave partial groups of four and eight.
        for (n_out, k, n_tok) in [(45, 512, 37), (13, 256, 16), (6, 512, 9), (5, 256, 8), (11, 256, 24), (3, 256, 2)] {
            let w = random_rows(dtype, n_out, k, &mut rng);
            let x: Vec<f32> = (0..n_tok * k).map(|_| rng.normal()).collect();
            let mut batch = vec![0f32; n_tok * n_out];
            quant::matmul(dtype, &w, n_out, k, &x, &mut batch, MatmulMode::QuantizedActivations).unwrap();
            for t in 0..n_tok {
                let mut one = vec![0f32; n_out];
                let xt = &x[t * k..(t + 1) * k];
                quant::matmul(dtype, &w, n_out, k, xt, &mut one, MatmulMode::QuantizedActivations).unwrap();
                for o in 0..n_out {
                    assert_eq!(batch[t * n_out + o].to_bits(), one[o].to_bits(), "{dtype} n_tok={n_tok} t={t} o={o}");
                }
            }
        }
    }
}

/// The 32-value types with odd and even block counts per row: the decode kernel takes Q4_0 and
/// Q4_1 blocks two at a time with a last lone block, the prefill tiles one at a time; both must
/// give each output the same bits.
#[test]
fn decode_block_pairs_and_a_lone_last_block_match_prefill_bits() {
    let mut rng = Rng::new(0x0DDB10C);
    for &dtype in &[GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0] {
        for (n_out, blocks, n_tok) in [(9, 1, 3), (17, 3, 9), (8, 2, 2), (23, 65, 5), (16, 64, 16)] {
            let k = 32 * blocks;
            let w = random_rows(dtype, n_out, k, &mut rng);
            let x: Vec<f32> = (0..n_tok * k).map(|_| rng.normal()).collect();
            let mut batch = vec![0f32; n_tok * n_out];
            quant::matmul(dtype, &w, n_out, k, &x, &mut batch, MatmulMode::QuantizedActivations).unwrap();
            for t in 0..n_tok {
                let mut one = vec![0f32; n_out];
                let xt = &x[t * k..(t + 1) * k];
                quant::matmul(dtype, &w, n_out, k, xt, &mut one, MatmulMode::QuantizedActivations).unwrap();
                for o in 0..n_out {
                    assert_eq!(
                        batch[t * n_out + o].to_bits(),
                        one[o].to_bits(),
                        "{dtype} blocks={blocks} n_tok={n_tok} t={t} o={o}"
                    );
                }
            }
        }
    }
}

/// ggml tests/test-quantize-fns.cpp: weights `0.1 + 2 cos(i)` quantized with the reference
/// quantizer, activations `0.1 + 2 cos(i + 1)` quantized on the fly, 4096 values;
/// `|vec_dot - f32 dot| / 4096` below MAX_DOT_PRODUCT_ERROR (0.02), _LOWBIT (0.04) for Q2_K,
/// _FP4 (0.03) for MXFP4.
#[test]
fn dot_product_error_within_test_quantize_fns_bounds() {
    let n = 4096;
    let w_f32 = ggml_test_data(0.0, n);
    let x = ggml_test_data(1.0, n);
    let reference: f64 = w_f32.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
    for &dtype in QUANTIZED {
        let bound = match dtype {
            GgmlType::Q2_K => 0.04,
            GgmlType::MXFP4 => 0.03,
            _ => 0.02,
        };
        let mut w = vec![0u8; dtype.row_bytes(n as u64).unwrap() as usize];
        quant::quantize(dtype, &w_f32, &mut w).unwrap();
        for kernel in Kernel::available() {
            let got = run(dtype, &w, 1, n, &x, kernel)[0] as f64;
            let err = (got - reference).abs() / n as f64;
            println!("{dtype} {kernel:?}: dot product error {err:.6} (bound {bound})");
            assert!(err < bound, "{dtype} {kernel:?}: dot product error {err} >= {bound}");
        }
    }
}

#[test]
fn float_types_have_no_quantized_activation_path() {
    let err = quant::matmul_quantized(GgmlType::F16, &[0u8; 64], 1, 32, &[0f32; 32], &mut [0f32; 1], Kernel::Portable)
        .unwrap_err();
    assert_eq!(err, QuantError::Unsupported { dtype: GgmlType::F16, op: "matmul_quantized" });
    // ...but matmul in that mode computes them exactly.
    let w: Vec<u8> = (0..32).flat_map(|i| half::f16::from_f32(i as f32).to_le_bytes()).collect();
    let x = vec![1f32; 32];
    let mut y = [0f32; 1];
    quant::matmul(GgmlType::F16, &w, 1, 32, &x, &mut y, MatmulMode::QuantizedActivations).unwrap();
    assert_eq!(y[0], (0..32).sum::<i32>() as f32);
}

/// `matmul_many` gives every output the bits of its own `matmul`: fused decode (one token,
/// tiled types sharing an activation scheme, one to four weights, odd row counts, on a
/// two-thread pool) and the fallbacks (prefill, mixed activation schemes, untiled types, the
/// exact mode).
#[test]
fn matmul_many_equals_separate_matmuls() {
    use GgmlType::*;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let mut rng = Rng::new(0xFACE);
    let cases: &[(&[GgmlType], usize)] = &[
        (&[Q4_0, Q4_1, Q8_0], 512),
        (&[Q4_K, Q4_K], 512),
        (&[Q6_K, Q4_K, Q6_K, Q4_K], 256),
        (&[Q5_0], 160),
        (&[Q4_0, Q4_K], 512),
        (&[Q5_K, Q4_K], 256),
        (&[Q4_0, Q4_0, Q4_0, Q4_0, Q4_0], 64),
    ];
    let row_counts = [13, 300, 29, 7, 64];
    for &(types, k) in cases {
        let weights: Vec<(GgmlType, usize, Vec<u8>)> = types
            .iter()
            .zip(row_counts.iter().cycle())
            .map(|(&dtype, &n_out)| (dtype, n_out, random_rows(dtype, n_out, k, &mut rng)))
            .collect();
        for n_tok in [1, 5] {
            for mode in [MatmulMode::QuantizedActivations, MatmulMode::Exact] {
                let x: Vec<f32> = (0..n_tok * k).map(|_| rng.normal()).collect();
                let rows: Vec<quant::WeightRows<'_>> = weights
                    .iter()
                    .map(|(dtype, n_out, bytes)| quant::WeightRows { dtype: *dtype, bytes, n_out: *n_out })
                    .collect();
                let mut fused: Vec<Vec<f32>> = weights.iter().map(|w| vec![f32::NAN; n_tok * w.1]).collect();
                let mut outs: Vec<&mut [f32]> = fused.iter_mut().map(|y| y.as_mut_slice()).collect();
                pool.install(|| quant::matmul_many(&rows, k, &x, &mut outs, mode)).unwrap();
                for (i, (dtype, n_out, bytes)) in weights.iter().enumerate() {
                    let mut want = vec![0f32; n_tok * n_out];
                    pool.install(|| quant::matmul(*dtype, bytes, *n_out, k, &x, &mut want, mode)).unwrap();
                    let same = fused[i].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{types:?} weight {i} ({dtype}) n_tok={n_tok} {mode:?}");
                }
            }
        }
    }
    let w = random_rows(Q4_0, 8, 32, &mut rng);
    let rows = [quant::WeightRows { dtype: Q4_0, bytes: &w, n_out: 8 }];
    let err = quant::matmul_many(&rows, 32, &[0.5; 32], &mut [], MatmulMode::QuantizedActivations).unwrap_err();
    assert_eq!(err, QuantError::ShapeMismatch { op: "matmul_many", what: "outputs", expected: 1, got: 0 });
}

/// The AVX-512 kernel set gives the AVX2 one's bits for every type, decode and prefill: its
/// decode kernels (Q4_0, Q8_0, Q4_K, Q6_K) do the AVX2 kernels' float operations on the same
/// exact integer sums, and the rest is AVX2's. Block counts 1..=9 leave every tail of the
/// four-block Q4_0 and two-block Q8_0 steps; row counts partial groups of eight; 33, 45 and 64
/// tokens the four-octet Q4_0 and Q4_K tiles followed by one, two or four more octets.
#[test]
fn avx512_gives_the_avx2_bits() {
    if !Kernel::available().contains(&Kernel::Avx512) {
        println!("no AVX-512 F/BW/VL/VNNI on this CPU: nothing to compare");
        return;
    }
    let mut rng = Rng::new(0xA512);
    for &dtype in QUANTIZED {
        for blocks in 1..=9 {
            for (n_out, n_tok) in [(8, 1), (21, 1), (67, 1), (13, 5), (9, 17), (7, 33), (5, 45), (6, 64)] {
                let k = dtype.block_elems() * blocks;
                let w = random_rows(dtype, n_out, k, &mut rng);
                let x: Vec<f32> = (0..n_tok * k).map(|_| rng.normal()).collect();
                let want = run(dtype, &w, n_out, k, &x, Kernel::Avx2);
                let got = run(dtype, &w, n_out, k, &x, Kernel::Avx512);
                for i in 0..want.len() {
                    assert_eq!(
                        got[i].to_bits(),
                        want[i].to_bits(),
                        "{dtype} n_out={n_out} blocks={blocks} n_tok={n_tok} output {i}: {} vs AVX2 {}",
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }
}
