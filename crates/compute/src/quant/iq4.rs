//! The non-linear 4-bit types IQ4_NL (32-value blocks) and IQ4_XS (256-value super-blocks).
//!
//! Both map a 4-bit index through the fixed table `kvalues_iq4nl` (ggml/src/ggml-common.h).
//! Layouts: `block_iq4_nl { f16 d; u8 qs[16] }` (nibble order as Q4_0: byte `j` holds values `j`
//! and `j + 16`); `block_iq4_xs { f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128] }`: eight
//! sub-blocks of 32, each with a 6-bit scale offset by 32 (low 4 bits in `scales_l`, nibble
//! `ib % 2` of byte `ib / 2`; high 2 bits at bit `2 * ib` of `scales_h`).

use super::float::{f16_at, f16_bytes};
use super::k_quants::{nearest_int, QK_K};

/// `kvalues_iq4nl`.
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

#[inline(always)]
pub(crate) fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b);
        let qs = &b[2..18];
        for j in 0..16 {
            y[j] = d * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
            y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
        }
    }
}

/// Sub-block scale `ib` (0..8) of an IQ4_XS block, still offset by 32.
#[inline(always)]
pub(crate) fn iq4_xs_scale(ib: usize, scales_h: u16, scales_l: &[u8]) -> i32 {
    let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
    let high = ((scales_h >> (2 * ib)) & 3) as u8;
    (low | (high << 4)) as i32
}

#[inline(always)]
pub(crate) fn dequantize_iq4_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(136).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b);
        let scales_h = u16::from_le_bytes([b[2], b[3]]);
        let scales_l = &b[4..8];
        for (ib, (qs, y)) in b[8..136].chunks_exact(16).zip(y.chunks_exact_mut(32)).enumerate() {
            let dl = d * (iq4_xs_scale(ib, scales_h, scales_l) - 32) as f32;
            for j in 0..16 {
                y[j] = dl * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
                y[j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
            }
        }
    }
}

/// `best_index_int8(16, kvalues_iq4nl, x)`: the index of the nearest table value, the upper
/// one on exact midpoints. Compares `2x` with sums of neighbours so every comparison is exact.
#[inline(always)]
pub(crate) fn best_index_iq4nl(x: f32) -> u8 {
    let x2 = x + x;
    let mut idx = 0usize;
    let mut step = 8;
    while step > 0 {
        let j = idx + step;
        if x2 >= (KVALUES_IQ4NL[j - 1] as i32 + KVALUES_IQ4NL[j] as i32) as f32 {
            idx = j;
        }
        step >>= 1;
    }
    idx as u8
}

/// The per-32-value scale search of ggml's `quantize_row_iq4_nl_impl` (no importance weights,
/// so weights are `x^2`): a first pass at `max / values[0]`, refined over `2 * ntry + 1`
/// candidate scales. Returns the fitted scale and leaves the first pass's indices in `levels`.
fn fit_block(xb: &[f32], ntry: i32, levels: &mut [u8]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in xb {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < super::k_quants::GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let v0 = KVALUES_IQ4NL[0] as f32;
    let d = if ntry > 0 { -max / v0 } else { max / v0 };
    let id = 1.0 / d;
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for (l, &v) in levels.iter_mut().zip(xb) {
        *l = best_index_iq4nl(id * v);
        let q = KVALUES_IQ4NL[*l as usize] as f32;
        let w = v * v;
        sumqx += w * q * v;
        sumq2 += w * q * q;
    }
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -ntry..=ntry {
        let id = (itry + KVALUES_IQ4NL[0] as i32) as f32 / max;
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for &v in xb {
            let q = KVALUES_IQ4NL[best_index_iq4nl(id * v) as usize] as f32;
            let w = v * v;
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

fn pack_nibbles(levels: &[u8], qs: &mut [u8]) {
    for (q32, l32) in qs.chunks_exact_mut(16).zip(levels.chunks_exact(32)) {
        for j in 0..16 {
            q32[j] = l32[j] | (l32[j + 16] << 4);
        }
    }
}

/// `quantize_row_iq4_nl_ref` (`ntry = -1`: no scale search; the first pass's indices stay).
pub(crate) fn quantize_iq4_nl(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(18)) {
        let mut levels = [0u8; 32];
        let d = fit_block(x, -1, &mut levels);
        b[0..2].copy_from_slice(&f16_bytes(d));
        pack_nibbles(&levels, &mut b[2..18]);
    }
}

/// `quantize_row_iq4_xs_ref` (`quantize_iq4_xs` without importance weights, `ntry = 7`).
pub(crate) fn quantize_iq4_xs(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(136)) {
        let mut levels = [0u8; QK_K];
        let mut scales = [0f32; 8];
        let (mut max_scale, mut amax_scale) = (0.0f32, 0.0f32);
        for ib in 0..8 {
            let d = fit_block(&x[32 * ib..32 * ib + 32], 7, &mut levels[32 * ib..32 * ib + 32]);
            scales[ib] = d;
            if d.abs() > amax_scale {
                amax_scale = d.abs();
                max_scale = d;
            }
        }
        let d = -max_scale / 32.0;
        b[0..2].copy_from_slice(&f16_bytes(d));
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut scales_h = 0u16;
        let mut scales_l = [0u8; 4];
        for ib in 0..8 {
            let l = nearest_int(id * scales[ib]).clamp(-32, 31);
            let dl = d * l as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for (o, &v) in levels[32 * ib..32 * ib + 32].iter_mut().zip(&x[32 * ib..32 * ib + 32]) {
                *o = best_index_iq4nl(idl * v);
            }
            let l = (l + 32) as u8;
            scales_l[ib / 2] |= (l & 0xF) << (4 * (ib % 2));
            scales_h |= ((l >> 4) as u16) << (2 * ib);
        }
        b[2..4].copy_from_slice(&scales_h.to_le_bytes());
        b[4..8].copy_from_slice(&scales_l);
        pack_nibbles(&levels, &mut b[8..136]);
    }
}
