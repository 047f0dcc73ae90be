//! The original 32-value block types: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.
//!
//! Layouts (ggml/src/ggml-common.h): `block_q4_0 { f16 d; u8 qs[16] }`, `block_q4_1 { f16 d; f16 m;
//! u8 qs[16] }`, `block_q5_0 { f16 d; u8 qh[4]; u8 qs[16] }`, `block_q5_1 { f16 d; f16 m; u8 qh[4];
//! u8 qs[16] }`, `block_q8_0 { f16 d; i8 qs[32] }`. In the 4- and 5-bit types byte `j` of `qs` holds
//! value `j` in its low nibble and value `j + 16` in its high nibble; bit `j` of the little-endian
//! u32 `qh` is the fifth bit of value `j`.
//!
//! Dequantization computes exactly what `dequantize_row_*` and gguf-py compute, in the same f32
//! operation order (`d * q`, `d * q + m`). Quantization follows gguf-py's `quantize_blocks`, which
//! gguf-py documents as matching ggml's `quantize_row_*_ref`.

use super::float::{f16_at, f16_bytes};

pub(crate) const QK: usize = 32;

#[inline(always)]
pub(crate) fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b);
        let qs = &b[2..18];
        for j in 0..16 {
            y[j] = d * ((qs[j] & 0xF) as i32 - 8) as f32;
            y[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
        }
    }
}

#[inline(always)]
pub(crate) fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(20).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b);
        let m = f16_at(&b[2..]);
        let qs = &b[4..20];
        for j in 0..16 {
            y[j] = d * (qs[j] & 0xF) as f32 + m;
            y[j + 16] = d * (qs[j] >> 4) as f32 + m;
        }
    }
}

#[inline(always)]
pub(crate) fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(22).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        for j in 0..16 {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            y[j] = d * (((qs[j] & 0xF) as u32 | h0) as i32 - 16) as f32;
            y[j + 16] = d * (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32;
        }
    }
}

#[inline(always)]
pub(crate) fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(24).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b);
        let m = f16_at(&b[2..]);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..24];
        for j in 0..16 {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            y[j] = d * ((qs[j] & 0xF) as u32 | h0) as f32 + m;
            y[j + 16] = d * ((qs[j] >> 4) as u32 | h1) as f32 + m;
        }
    }
}

#[inline(always)]
pub(crate) fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(34).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b);
        for (v, &q) in y.iter_mut().zip(&b[2..34]) {
            *v = q as i8 as f32 * d;
        }
    }
}

/// The value of largest magnitude, the first one on ties (numpy `argmax` of `abs`, ggml's
/// `amax < fabsf(v)` scan).
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        min = min.min(v);
        max = max.max(v);
    }
    (min, max)
}

fn inverse_or_zero(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Truncation toward zero then clamp, as gguf-py's `np.trunc(..).astype(uint8).clip(0, max)`
/// (the values reaching it are never negative).
#[inline(always)]
fn trunc_clamp(v: f32, max: i32) -> u8 {
    (v.trunc() as i32).clamp(0, max) as u8
}

pub(crate) fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(18)) {
        let d = signed_absmax(x) / -8.0;
        let id = inverse_or_zero(d);
        b[..2].copy_from_slice(&f16_bytes(d));
        for j in 0..16 {
            let q0 = trunc_clamp(x[j] * id + 8.5, 15);
            let q1 = trunc_clamp(x[j + 16] * id + 8.5, 15);
            b[2 + j] = q0 | (q1 << 4);
        }
    }
}

pub(crate) fn quantize_q4_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(20)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse_or_zero(d);
        b[..2].copy_from_slice(&f16_bytes(d));
        b[2..4].copy_from_slice(&f16_bytes(min));
        for j in 0..16 {
            let q0 = trunc_clamp((x[j] - min) * id + 0.5, 15);
            let q1 = trunc_clamp((x[j + 16] - min) * id + 0.5, 15);
            b[4 + j] = q0 | (q1 << 4);
        }
    }
}

fn pack_q5(q: &[u8; QK], qh: &mut [u8], qs: &mut [u8]) {
    let mut h = 0u32;
    for (j, &v) in q.iter().enumerate() {
        h |= ((v as u32 >> 4) & 1) << j;
    }
    qh.copy_from_slice(&h.to_le_bytes());
    for j in 0..16 {
        qs[j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4);
    }
}

pub(crate) fn quantize_q5_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(22)) {
        let d = signed_absmax(x) / -16.0;
        let id = inverse_or_zero(d);
        b[..2].copy_from_slice(&f16_bytes(d));
        let mut q = [0u8; QK];
        for (qv, &v) in q.iter_mut().zip(x) {
            *qv = trunc_clamp(v * id + 16.5, 31);
        }
        let (qh, qs) = b[2..].split_at_mut(4);
        pack_q5(&q, qh, qs);
    }
}

pub(crate) fn quantize_q5_1(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(24)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse_or_zero(d);
        b[..2].copy_from_slice(&f16_bytes(d));
        b[2..4].copy_from_slice(&f16_bytes(min));
        let mut q = [0u8; QK];
        for (qv, &v) in q.iter_mut().zip(x) {
            *qv = trunc_clamp((v - min) * id + 0.5, 31);
        }
        let (qh, qs) = b[4..].split_at_mut(4);
        pack_q5(&q, qh, qs);
    }
}

/// One Q8_0 block: the f32 scale before f16 rounding and the 32 signed quants.
#[inline(always)]
pub(crate) fn quantize_block_q8_0(x: &[f32], qs: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse_or_zero(d);
    for (q, &v) in qs.iter_mut().zip(x) {
        // f32::round rounds half away from zero, like C's roundf and gguf-py's np_roundf.
        *q = (v * id).round() as i8;
    }
    d
}

pub(crate) fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(34)) {
        let mut qs = [0i8; QK];
        let d = quantize_block_q8_0(x, &mut qs);
        b[..2].copy_from_slice(&f16_bytes(d));
        for (o, q) in b[2..].iter_mut().zip(qs) {
            *o = q as u8;
        }
    }
}
