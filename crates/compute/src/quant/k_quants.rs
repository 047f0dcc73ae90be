//! The 256-value "k-quant" super-block types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K.
//!
//! Layouts (ggml/src/ggml-common.h, QK_K = 256):
//! - `block_q2_K { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }`: 16 sub-blocks of 16, 4-bit scale
//!   and 4-bit min per sub-block, 2-bit quants.
//! - `block_q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`: 16 sub-blocks of 16, 6-bit
//!   signed scales (offset 32), 2 low bits in `qs`, the high bit in `hmask` (set means no -4).
//! - `block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`: 8 sub-blocks of 32, 6-bit scale
//!   and min packed by `get_scale_min_k4`.
//! - `block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }`: as Q4_K plus a fifth bit.
//! - `block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`: 16 sub-blocks of 16, 6-bit quants
//!   offset by 32.
//! - `block_q8_K { f32 d; i8 qs[256]; i16 bsums[16] }`: the activation type of the k-quant dot products.
//!
//! Dequantization is `dequantize_row_q*_K` with its f32 operation order (`(d * sc) * q - (dmin * m)`).

use super::float::f16_at;

pub(crate) const QK_K: usize = 256;

/// Scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block (`get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 16 signed 6-bit scales of a Q3_K block, still offset by 32 (0..64).
#[inline(always)]
pub(crate) fn q3_k_scales(s: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = if i < 8 { s[i] & 0xF } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = low | (high << 4);
    }
    out
}

pub(crate) fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(84).zip(dst.chunks_exact_mut(QK_K)) {
        let scales = &b[0..16];
        let qs = &b[16..80];
        let d = f16_at(&b[80..]);
        let dmin = f16_at(&b[82..]);
        // Value i lives in byte 32*(i/128) + i%32, at bit shift 2*((i/32)%4); its sub-block is i/16.
        for (i, v) in y.iter_mut().enumerate() {
            let sc = scales[i / 16];
            let dl = d * (sc & 0xF) as f32;
            let ml = dmin * (sc >> 4) as f32;
            let q = (qs[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3;
            *v = dl * q as f32 - ml;
        }
    }
}

pub(crate) fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(110).zip(dst.chunks_exact_mut(QK_K)) {
        let hmask = &b[0..32];
        let qs = &b[32..96];
        let scales = q3_k_scales(&b[96..108]);
        let d = f16_at(&b[108..]);
        for (i, v) in y.iter_mut().enumerate() {
            let dl = d * (scales[i / 16] as i32 - 32) as f32;
            let low = (qs[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3;
            let high_set = hmask[i % 32] & (1 << (i / 32)) != 0;
            let q = low as i32 - if high_set { 0 } else { 4 };
            *v = dl * q as f32;
        }
    }
}

pub(crate) fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(144).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b);
        let dmin = f16_at(&b[2..]);
        let scales = &b[4..16];
        let qs = &b[16..144];
        for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
            let (sc1, m1) = scale_min_k4(2 * chunk, scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
            let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0xF) as f32 - min1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
            }
        }
    }
}

pub(crate) fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(176).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b);
        let dmin = f16_at(&b[2..]);
        let scales = &b[4..16];
        let qh = &b[16..48];
        let qs = &b[48..176];
        for (chunk, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
            let (sc1, m1) = scale_min_k4(2 * chunk, scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
            let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
            let (u1, u2) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
            for l in 0..32 {
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((q[l] & 0xF) + h1) as f32 - min1;
                y[l + 32] = d2 * ((q[l] >> 4) + h2) as f32 - min2;
            }
        }
    }
}

pub(crate) fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(210).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(&b[208..]);
        for half in 0..2 {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let sc = &b[192 + 8 * half..192 + 8 * half + 8];
            let y = &mut y[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * sc[is] as i8 as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
            }
        }
    }
}

pub(crate) fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(292).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (v, &q) in y.iter_mut().zip(&b[4..260]) {
            *v = d * q as i8 as f32;
        }
    }
}
