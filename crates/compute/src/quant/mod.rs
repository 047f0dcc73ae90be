//! Quantized tensor types: dequantization, dot products, quantization and matrix products.
//!
//! Every GGUF tensor type the engine reads has an exact scalar reference here, bit for bit what
//! ggml's `dequantize_row_*` (ggml/src/ggml-quants.c) and gguf-py's numpy `gguf.quants.dequantize`
//! produce: same block layouts (ggml/src/ggml-common.h), same f32 operations in the same order.
//! Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
//! IQ4_NL, IQ4_XS and MXFP4.
//!
//! Quantizers ([`quantize`]) are ggml's `quantize_row_*_ref`, the ones `llama-quantize` uses
//! without an importance matrix: on the fixtures they reproduce llama-quantize's bytes exactly.
//!
//! Main entry points: [`dequantize`], [`dot`], [`quantize`], [`matmul`] and
//! [`matmul_quantized`]. Files hold one type family each (`float`, `legacy` for the 32-value
//! types, `k_quants`, `iq4`, `mxfp4`); `matmul` holds the parallel matrix product, `qdot` the
//! activation quantization and portable integer dot products, `simd` the vectorised kernels
//! (AVX2 picked at run time on x86-64, NEON on aarch64).
//!
//! # When to use which matmul mode
//! [`MatmulMode::Exact`] dequantizes each weight row and takes f32 dot products with a fixed
//! summation order: the reference, reproducible across machines and thread counts (the AVX2
//! build computes the same bits as the portable one). [`MatmulMode::QuantizedActivations`] is
//! the llama.cpp-style fast path: activations are quantized to 8 bits (Q8_0 or Q8_K blocks)
//! and blocks are summed in integers, several times faster for decode; it is what llama.cpp
//! computes, not what a float reference computes (relative error around 1e-3 on random data,
//! within test-quantize-fns' dot-product bounds). F32/F16/BF16 weights are exact in both modes.

mod float;
mod iq4;
mod k_quants;
mod legacy;
mod matmul;
mod mxfp4;
mod qdot;
mod simd;

pub use gguf::GgmlType;
pub use matmul::{
    experts_one_token, experts_timing, matmul, matmul_each, matmul_gated, matmul_many, matmul_quantized, owned_bytes,
    set_owned_claims, set_spawned_region, ExpertGating, ExpertRows, GateCombine, MatmulMode, WeightRows, MAX_FUSED,
};
pub use simd::Kernel;

use std::cell::RefCell;

/// What went wrong in a quantization routine. Every variant names the type and the numbers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The type has no implementation here (for `quantize`: no quantizer).
    #[error("tensor type {dtype} is not supported by {op}")]
    Unsupported {
        /// The requested type.
        dtype: GgmlType,
        /// The operation asked for (`dequantize`, `dot`, `quantize`, `matmul`).
        op: &'static str,
    },
    /// A value count that does not fill whole blocks of the type.
    #[error("{n_values} values of {dtype} are not a whole number of {block_elems}-value blocks")]
    NotWholeBlocks {
        /// The type.
        dtype: GgmlType,
        /// The value count given.
        n_values: usize,
        /// Values per block of the type.
        block_elems: usize,
    },
    /// Encoded data whose byte length does not match the value count.
    #[error("{n_values} values of {dtype} take {expected_bytes} bytes, got {got_bytes}")]
    SizeMismatch {
        /// The type.
        dtype: GgmlType,
        /// The value count.
        n_values: usize,
        /// Bytes the values take in this type.
        expected_bytes: usize,
        /// Bytes given.
        got_bytes: usize,
    },
    /// An f32 operand that is not a whole number of rows.
    #[error("{op}: {what} has {got} values, not a whole number of rows of {row_len}")]
    RaggedRows {
        /// The operation (`matmul`).
        op: &'static str,
        /// Which operand.
        what: &'static str,
        /// Values per row.
        row_len: usize,
        /// Values given.
        got: usize,
    },
    /// An f32 operand of the wrong length.
    #[error("{op}: {what} has {got} values, expected {expected}")]
    ShapeMismatch {
        /// The operation (`dot`, `matmul`).
        op: &'static str,
        /// Which operand.
        what: &'static str,
        /// Values expected from the other operands.
        expected: usize,
        /// Values given.
        got: usize,
    },
}

type DequantizeFn = fn(&[u8], &mut [f32]);
type QuantizeFn = fn(&[f32], &mut [u8]);

/// The row dequantizer of a type: whole blocks in, `block_elems` values per block out.
fn dequantizer(dtype: GgmlType) -> Option<DequantizeFn> {
    use GgmlType::*;
    Some(match dtype {
        F32 => float::dequantize_f32,
        F16 => float::dequantize_f16,
        BF16 => float::dequantize_bf16,
        Q4_0 => legacy::dequantize_q4_0,
        Q4_1 => legacy::dequantize_q4_1,
        Q5_0 => legacy::dequantize_q5_0,
        Q5_1 => legacy::dequantize_q5_1,
        Q8_0 => legacy::dequantize_q8_0,
        Q2_K => k_quants::dequantize_q2_k,
        Q3_K => k_quants::dequantize_q3_k,
        Q4_K => k_quants::dequantize_q4_k,
        Q5_K => k_quants::dequantize_q5_k,
        Q6_K => k_quants::dequantize_q6_k,
        Q8_K => k_quants::dequantize_q8_k,
        IQ4_NL => iq4::dequantize_iq4_nl,
        IQ4_XS => iq4::dequantize_iq4_xs,
        MXFP4 => mxfp4::dequantize_mxfp4,
        _ => return None,
    })
}

fn quantizer(dtype: GgmlType) -> Option<QuantizeFn> {
    use GgmlType::*;
    Some(match dtype {
        F32 => float::quantize_f32,
        F16 => float::quantize_f16,
        BF16 => float::quantize_bf16,
        Q4_0 => legacy::quantize_q4_0,
        Q4_1 => legacy::quantize_q4_1,
        Q5_0 => legacy::quantize_q5_0,
        Q5_1 => legacy::quantize_q5_1,
        Q8_0 => legacy::quantize_q8_0,
        Q2_K => k_quants::quantize_q2_k,
        Q3_K => k_quants::quantize_q3_k,
        Q4_K => k_quants::quantize_q4_k,
        Q5_K => k_quants::quantize_q5_k,
        Q6_K => k_quants::quantize_q6_k,
        Q8_K => k_quants::quantize_q8_k,
        IQ4_NL => iq4::quantize_iq4_nl,
        IQ4_XS => iq4::quantize_iq4_xs,
        MXFP4 => mxfp4::quantize_mxfp4,
        _ => return None,
    })
}

/// True when [`dequantize`], [`dot`] and [`matmul`] accept `dtype`.
pub fn is_supported(dtype: GgmlType) -> bool {
    dequantizer(dtype).is_some()
}

/// True when [`quantize`] can produce `dtype`.
pub fn can_quantize(dtype: GgmlType) -> bool {
    quantizer(dtype).is_some()
}

/// Checks that `n_bytes` encode exactly `n_values` values of `dtype` in whole blocks.
fn check_encoded(dtype: GgmlType, n_values: usize, n_bytes: usize) -> Result<(), QuantError> {
    let block_elems = dtype.block_elems();
    if !n_values.is_multiple_of(block_elems) {
        return Err(QuantError::NotWholeBlocks { dtype, n_values, block_elems });
    }
    let expected_bytes = n_values / block_elems * dtype.block_bytes();
    if n_bytes != expected_bytes {
        return Err(QuantError::SizeMismatch { dtype, n_values, expected_bytes, got_bytes: n_bytes });
    }
    Ok(())
}

/// Decodes `dst.len()` values of `dtype` from `src`.
///
/// # Errors
/// [`QuantError::Unsupported`] for a type without a decoder, [`QuantError::NotWholeBlocks`] when
/// `dst.len()` is not a multiple of the block size, [`QuantError::SizeMismatch`] when `src` is not
/// exactly the encoded size of `dst.len()` values.
pub fn dequantize(dtype: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let f = dequantizer(dtype).ok_or(QuantError::Unsupported { dtype, op: "dequantize" })?;
    check_encoded(dtype, dst.len(), src.len())?;
    f(src, dst);
    Ok(())
}

/// Encodes `src` as `dtype` into `dst`, with ggml's reference (`quantize_row_*_ref`) rounding.
///
/// # Errors
/// As [`dequantize`], with `src.len()` as the value count.
pub fn quantize(dtype: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    let f = quantizer(dtype).ok_or(QuantError::Unsupported { dtype, op: "quantize" })?;
    check_encoded(dtype, src.len(), dst.len())?;
    f(src, dst);
    Ok(())
}

thread_local! {
    /// The dequantized row of [`dot`]; grown on demand, kept for the thread's life.
    static DOT_ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The dot product of one encoded row with `x`: exactly `dot_f32(dequantize(row), x)`, the f32
/// dot product with the fixed summation order of [`matmul`]'s exact mode.
///
/// # Errors
/// As [`dequantize`], with `x.len()` as the value count of `row`.
pub fn dot(dtype: GgmlType, row: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    let f = dequantizer(dtype).ok_or(QuantError::Unsupported { dtype, op: "dot" })?;
    check_encoded(dtype, x.len(), row.len())?;
    Ok(DOT_ROW.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        if scratch.len() < x.len() {
            scratch.resize(x.len(), 0.0);
        }
        let w = &mut scratch[..x.len()];
        f(row, w);
        matmul::dot_f32(w, x)
    }))
}
