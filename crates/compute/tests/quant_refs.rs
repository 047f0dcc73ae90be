//! compute::quant against committed references (testdata/quant/refs.gguf, made by
//! scripts/gen_quant_refs.py from gguf-py, numpy and the fixture files): dequantization bit for
//! bit, quantization byte for byte, and round-trip error bounds from ggml's test-quantize-fns
//! where no reference quantizer exists. Needs nothing outside the repository.

mod quant_common;

use compute::quant::{self, GgmlType, QuantError};
use gguf::GgufModel;
use quant_common::{bit_mismatches, f32_values, ggml_array_rmse, ggml_test_data, refs_path, SUPPORTED};

fn refs() -> GgufModel {
    GgufModel::open(refs_path()).expect("testdata/quant/refs.gguf (regenerate with scripts/gen_quant_refs.py)")
}

/// Every `<prefix>.<TYPE>.q` tensor of the reference file, with its type name.
fn cases(model: &GgufModel, prefix: &str) -> Vec<(String, GgmlType)> {
    let mut out: Vec<(String, GgmlType)> = model
        .tensors()
        .filter_map(|t| {
            let name = &t.info.name;
            let ty = name.strip_prefix(prefix)?.strip_prefix('.')?.strip_suffix(".q")?;
            Some((ty.to_string(), t.info.dtype))
        })
        .collect();
    out.sort();
    out
}

#[test]
fn dequantize_matches_gguf_py_bit_for_bit() {
    let model = refs();
    let mut checked = Vec::new();
    for prefix in ["fx", "syn"] {
        for (ty, dtype) in cases(&model, prefix) {
            let q = model.tensor(&format!("{prefix}.{ty}.q")).unwrap();
            let want = f32_values(model.tensor(&format!("{prefix}.{ty}.deq")).unwrap().data);
            let mut got = vec![0f32; want.len()];
            quant::dequantize(dtype, q.data, &mut got).unwrap();
            if let Some(msg) = bit_mismatches(&got, &want) {
                panic!("{prefix}.{ty}: {msg}");
            }
            checked.push(format!("{prefix}.{ty}"));
        }
    }
    println!("bit-exact: {}", checked.join(" "));
    for &dtype in SUPPORTED {
        assert!(
            checked.iter().any(|c| c.ends_with(&format!(".{}", dtype.name()))),
            "no dequantization reference for {dtype}"
        );
    }
}

#[test]
fn quantize_matches_llama_quantize_on_fixture_rows() {
    // fx.<TYPE>.q was written by llama-quantize (no imatrix) from fx.<TYPE>.src, which is
    // ggml's quantize_row_*_ref: the bytes must agree exactly.
    let model = refs();
    for (ty, dtype) in cases(&model, "fx") {
        let src = f32_values(model.tensor(&format!("fx.{ty}.src")).unwrap().data);
        let want = model.tensor(&format!("fx.{ty}.q")).unwrap().data;
        let mut got = vec![0u8; want.len()];
        quant::quantize(dtype, &src, &mut got).unwrap();
        let bb = dtype.block_bytes();
        let bad = got.chunks(bb).zip(want.chunks(bb)).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "fx.{ty}: {bad} of {} blocks differ from llama-quantize", want.len() / bb);
    }
}

#[test]
fn quantize_matches_gguf_py() {
    let model = refs();
    let types = cases(&model, "gp");
    assert!(types.len() >= 7, "expected gguf-py quantize references, got {types:?}");
    for (ty, dtype) in types {
        let src = f32_values(model.tensor(&format!("gp.{ty}.src")).unwrap().data);
        let want = model.tensor(&format!("gp.{ty}.q")).unwrap().data;
        let mut got = vec![0u8; want.len()];
        quant::quantize(dtype, &src, &mut got).unwrap();
        let bb = dtype.block_bytes();
        for (i, (g, w)) in got.chunks(bb).zip(want.chunks(bb)).enumerate() {
            assert_eq!(g, w, "gp.{ty}: block {i} differs from gguf-py");
        }
    }
}

/// ggml tests/test-quantize-fns.cpp: quantize then dequantize `0.1 + 2 cos(i)` (4096 values),
/// `array_rmse` below MAX_QUANTIZATION_TOTAL_ERROR (0.002), _2BITS (0.0075) for Q2_K, _3BITS
/// (0.0040) for Q3_K, _FP4 (0.0030) for MXFP4.
#[test]
fn quantize_round_trip_error_within_test_quantize_fns_bounds() {
    let data = ggml_test_data(0.0, 4096);
    for &dtype in SUPPORTED {
        let bound = match dtype {
            GgmlType::Q2_K => 0.0075,
            GgmlType::Q3_K => 0.0040,
            GgmlType::MXFP4 => 0.0030,
            _ => 0.002,
        };
        let mut q = vec![0u8; dtype.row_bytes(4096).unwrap() as usize];
        quant::quantize(dtype, &data, &mut q).unwrap();
        let mut back = vec![0f32; 4096];
        quant::dequantize(dtype, &q, &mut back).unwrap();
        let err = ggml_array_rmse(&data, &back);
        println!("{dtype}: total quantization error {err:.6} (bound {bound})");
        assert!(err < bound, "{dtype}: total quantization error {err} >= {bound}");
    }
}

#[test]
fn quantize_all_zero_input_gives_zero_output() {
    let zeros = vec![0f32; 512];
    for &dtype in SUPPORTED {
        let mut q = vec![0xAAu8; dtype.row_bytes(512).unwrap() as usize];
        quant::quantize(dtype, &zeros, &mut q).unwrap();
        let mut back = vec![1f32; 512];
        quant::dequantize(dtype, &q, &mut back).unwrap();
        assert!(back.iter().all(|&v| v == 0.0), "{dtype}: zeros came back as {:?}", &back[..4]);
    }
}

#[test]
fn dot_is_the_dot_product_of_the_dequantized_row() {
    let model = refs();
    for prefix in ["fx", "syn"] {
        for (ty, dtype) in cases(&model, prefix) {
            let q = model.tensor(&format!("{prefix}.{ty}.q")).unwrap();
            let deq = f32_values(model.tensor(&format!("{prefix}.{ty}.deq")).unwrap().data);
            if deq.iter().any(|v| !v.is_finite()) {
                continue; // the special-value rows test decoding, not arithmetic
            }
            let k = q.info.shape[0] as usize;
            let row_bytes = q.data.len() / (deq.len() / k);
            let x: Vec<f32> = (0..k).map(|i| ((i * 7 + 3) % 11) as f32 / 11.0 - 0.45).collect();
            for (r, w) in deq.chunks_exact(k).enumerate() {
                let row = &q.data[r * row_bytes..(r + 1) * row_bytes];
                let got = quant::dot(dtype, row, &x).unwrap() as f64;
                let want: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let scale: f64 = w.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                assert!((got - want).abs() <= 1e-6 * scale, "{prefix}.{ty} row {r}: {got} vs {want}");
            }
        }
    }
}

#[test]
fn bad_lengths_are_errors_with_numbers() {
    let mut out = vec![0f32; 48];
    assert_eq!(
        quant::dequantize(GgmlType::Q4_K, &[0u8; 144], &mut out),
        Err(QuantError::NotWholeBlocks { dtype: GgmlType::Q4_K, n_values: 48, block_elems: 256 })
    );
    let mut out = vec![0f32; 256];
    let err = quant::dequantize(GgmlType::Q4_K, &[0u8; 143], &mut out).unwrap_err();
    assert_eq!(
        err,
        QuantError::SizeMismatch { dtype: GgmlType::Q4_K, n_values: 256, expected_bytes: 144, got_bytes: 143 }
    );
    assert_eq!(err.to_string(), "256 values of Q4_K take 144 bytes, got 143");
    assert_eq!(
        quant::dot(GgmlType::Q8_0, &[0u8; 34], &[0f32; 64]),
        Err(QuantError::SizeMismatch { dtype: GgmlType::Q8_0, n_values: 64, expected_bytes: 68, got_bytes: 34 })
    );
    assert_eq!(
        quant::quantize(GgmlType::IQ2_XS, &[0f32; 256], &mut [0u8; 74]),
        Err(QuantError::Unsupported { dtype: GgmlType::IQ2_XS, op: "quantize" })
    );
    assert!(!quant::is_supported(GgmlType::IQ1_S));
    for &dtype in SUPPORTED {
        assert!(quant::is_supported(dtype) && quant::can_quantize(dtype), "{dtype}");
    }
}
