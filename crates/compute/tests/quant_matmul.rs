//! `matmul` in exact mode against per-row `dot` and an f64 sum of the dequantized weights, on
//! random but valid blocks of every supported type, with odd shapes.

mod quant_common;

use compute::quant::{self, GgmlType, MatmulMode, QuantError};
use quant_common::{random_rows, Rng, SUPPORTED};

fn check_exact(dtype: GgmlType, n_out: usize, k: usize, n_tok: usize, rng: &mut Rng) {
    let w = random_rows(dtype, n_out, k, rng);
    let x: Vec<f32> = (0..n_tok * k).map(|_| rng.normal()).collect();
    let mut y = vec![f32::NAN; n_tok * n_out];
    quant::matmul(dtype, &w, n_out, k, &x, &mut y, MatmulMode::Exact).unwrap();

    let row_bytes = w.len() / n_out;
    let mut deq = vec![0f32; k];
    for o in 0..n_out {
        let row = &w[o * row_bytes..(o + 1) * row_bytes];
        quant::dequantize(dtype, row, &mut deq).unwrap();
        for t in 0..n_tok {
            let xt = &x[t * k..(t + 1) * k];
            let got = y[t * n_out + o];
            let by_dot = quant::dot(dtype, row, xt).unwrap();
            assert_eq!(got.to_bits(), by_dot.to_bits(), "{dtype} o={o} t={t}: matmul {got} != dot {by_dot}");
            let exact: f64 = deq.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
            let scale: f64 = deq.iter().zip(xt).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            assert!(
                (got as f64 - exact).abs() <= 1e-5 * scale + 1e-30,
                "{dtype} o={o} t={t}: {got} vs f64 {exact} (sum |terms| {scale})"
            );
        }
    }
}

#[test]
fn matmul_exact_matches_dot_and_f64_for_every_type() {
    let mut rng = Rng::new(0x5eed_0001);
    for &dtype in SUPPORTED {
        let be = dtype.block_elems().max(32);
        // Odd row counts (not a multiple of the task size), several blocks per row, 1 and 3 tokens.
        for (n_out, blocks, n_tok) in [(1, 1, 1), (37, 3, 1), (19, 2, 3), (70, 5, 2)] {
            check_exact(dtype, n_out, be * blocks, n_tok, &mut rng);
        }
    }
}

#[test]
fn matmul_exact_large_runs_parallel_and_matches_dot() {
    let mut rng = Rng::new(0x5eed_0002);
    check_exact(GgmlType::Q4_K, 301, 1024, 2, &mut rng);
    check_exact(GgmlType::Q8_0, 513, 2048, 1, &mut rng);
}

#[test]
fn quantized_activations_mode_is_close_to_exact() {
    let mut rng = Rng::new(0x5eed_0003);
    for &dtype in SUPPORTED {
        let k = dtype.block_elems().max(32) * 4;
        let (n_out, n_tok) = (23, 3);
        let w = random_rows(dtype, n_out, k, &mut rng);
        let x: Vec<f32> = (0..n_tok * k).map(|_| rng.normal()).collect();
        let mut exact = vec![0f32; n_tok * n_out];
        let mut fast = vec![0f32; n_tok * n_out];
        quant::matmul(dtype, &w, n_out, k, &x, &mut exact, MatmulMode::Exact).unwrap();
        quant::matmul(dtype, &w, n_out, k, &x, &mut fast, MatmulMode::QuantizedActivations).unwrap();
        let norm: f64 = exact.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
        let err: f64 = exact.iter().zip(&fast).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
        // 8-bit activations: relative error of the output well under 1% (llama.cpp's
        // test-backend-ops accepts nmse 5e-4, i.e. ~2% relative L2, for quantized matmuls).
        assert!(err <= 0.01 * norm + 1e-6, "{dtype}: |fast - exact| = {err}, |exact| = {norm}");
    }
}

#[test]
fn matmul_rejects_bad_shapes_with_numbers() {
    let w = vec![0u8; 2 * 18];
    let x = vec![0f32; 64];
    let mut y = vec![0f32; 2];
    let err = quant::matmul(GgmlType::Q4_0, &w, 2, 48, &x, &mut y, MatmulMode::Exact).unwrap_err();
    assert_eq!(err, QuantError::NotWholeBlocks { dtype: GgmlType::Q4_0, n_values: 48, block_elems: 32 });
    let err = quant::matmul(GgmlType::Q4_0, &w, 3, 32, &x, &mut y, MatmulMode::Exact).unwrap_err();
    assert_eq!(
        err,
        QuantError::SizeMismatch { dtype: GgmlType::Q4_0, n_values: 96, expected_bytes: 54, got_bytes: 36 }
    );
    let err = quant::matmul(GgmlType::Q4_0, &w, 2, 32, &x[..40], &mut y, MatmulMode::Exact).unwrap_err();
    assert_eq!(err, QuantError::RaggedRows { op: "matmul", what: "x", row_len: 32, got: 40 });
    let err = quant::matmul(GgmlType::Q4_0, &w, 2, 32, &x, &mut y, MatmulMode::Exact).unwrap_err();
    assert_eq!(err, QuantError::ShapeMismatch { op: "matmul", what: "y", expected: 4, got: 2 });
    let err = quant::matmul(GgmlType::IQ2_XXS, &w, 1, 256, &x, &mut y, MatmulMode::Exact).unwrap_err();
    assert_eq!(err, QuantError::Unsupported { dtype: GgmlType::IQ2_XXS, op: "matmul" });
    assert!(err.to_string().contains("IQ2_XXS"), "{err}");
}

/// `matmul_each` (one token per weight, every product's rows in one parallel region) gives each
/// output the bits of its own `matmul`, in both modes, for every type: more weights than
/// `matmul_many` fuses, row counts that are not multiples of eight, one large enough to split
/// over the threads. Outputs start as NaN, so a row no share computed fails.
#[test]
fn matmul_each_gives_each_products_own_bits() {
    let mut rng = Rng::new(0x5eed_0005);
    for &dtype in SUPPORTED {
        let k = dtype.block_elems().max(32) * 8;
        let rows = [1usize, 9, 37, 70, 8, 301, 16];
        let ws: Vec<Vec<u8>> = rows.iter().map(|&n| random_rows(dtype, n, k, &mut rng)).collect();
        let xs: Vec<Vec<f32>> = rows.iter().map(|_| (0..k).map(|_| rng.normal()).collect()).collect();
        for mode in [MatmulMode::QuantizedActivations, MatmulMode::Exact] {
            let weights: Vec<quant::WeightRows<'_>> =
                ws.iter().zip(&rows).map(|(w, &n_out)| quant::WeightRows { dtype, bytes: w, n_out }).collect();
            let mut outs: Vec<Vec<f32>> = rows.iter().map(|&n| vec![f32::NAN; n]).collect();
            {
                let x_refs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
                let mut y_refs: Vec<&mut [f32]> = outs.iter_mut().map(|y| &mut y[..]).collect();
                quant::matmul_each(&weights, k, &x_refs, &mut y_refs, mode).unwrap();
            }
            for (i, ((w, x), got)) in ws.iter().zip(&xs).zip(&outs).enumerate() {
                let mut want = vec![0f32; rows[i]];
                quant::matmul(dtype, w, rows[i], k, x, &mut want, mode).unwrap();
                for (o, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), e.to_bits(), "{dtype} {mode:?} weight {i} row {o}: {g} != {e}");
                }
            }
        }
    }
    // Lengths that disagree are an error naming them.
    let w = random_rows(GgmlType::Q8_0, 2, 32, &mut rng);
    let x = vec![0f32; 32];
    let weights = [quant::WeightRows { dtype: GgmlType::Q8_0, bytes: &w, n_out: 2 }];
    let mut y = [0f32; 2];
    let err = quant::matmul_each(&weights, 32, &[&x, &x], &mut [&mut y[..]], MatmulMode::QuantizedActivations);
    assert!(matches!(err, Err(QuantError::ShapeMismatch { expected: 1, got: 2, .. })), "{err:?}");
}
