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

use super::float::{f16_at, f16_bytes};

pub(crate) const QK_K: usize = 256;

/// Scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block (`get_scale_min_k4`).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The 16 signed 6-bit scales of a Q3_K block, still offset by 32 (0..64). Scale `i` has its
/// low 4 bits in nibble `i / 8` of byte `i % 8` and its high 2 bits at bit `2 * (i / 4)` of byte
/// `8 + i % 4`; unpacked four at a time in u32 words as ggml's `dequantize_row_q3_K` does.
#[inline(always)]
pub(crate) fn q3_k_scales(s: &[u8]) -> [u8; 16] {
    const LOW: u32 = 0x0f0f_0f0f;
    const HIGH: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let words = [
        (a0 & LOW) | ((tmp & HIGH) << 4),
        (a1 & LOW) | (((tmp >> 2) & HIGH) << 4),
        ((a0 >> 4) & LOW) | (((tmp >> 4) & HIGH) << 4),
        ((a1 >> 4) & LOW) | (((tmp >> 6) & HIGH) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

#[inline(always)]
pub(crate) fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(84).zip(dst.chunks_exact_mut(QK_K)) {
        let scales = &b[0..16];
        let d = f16_at(&b[80..]);
        let dmin = f16_at(&b[82..]);
        // Value 128n + 32j + l is bits 2j.. of byte 32n + l; its sub-block (of 16) is 8n + 2j + l/16.
        for (n, (q, y)) in b[16..80].chunks_exact(32).zip(y.chunks_exact_mut(128)).enumerate() {
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                for (half, y) in y.chunks_exact_mut(16).enumerate() {
                    let sc = scales[8 * n + 2 * j + half];
                    let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
                    for (l, v) in y.iter_mut().enumerate() {
                        *v = dl * ((q[16 * half + l] >> (2 * j)) & 3) as f32 - ml;
                    }
                }
            }
        }
    }
}

#[inline(always)]
pub(crate) fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(110).zip(dst.chunks_exact_mut(QK_K)) {
        let hmask = &b[0..32];
        let scales = q3_k_scales(&b[96..108]);
        let d = f16_at(&b[108..]);
        // As Q2_K for the low bits; the high bit of value 128n + 32j + l is bit 4n + j of hmask[l].
        for (n, (q, y)) in b[32..96].chunks_exact(32).zip(y.chunks_exact_mut(128)).enumerate() {
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                let bit = 1u8 << (4 * n + j);
                for (half, y) in y.chunks_exact_mut(16).enumerate() {
                    let dl = d * (scales[8 * n + 2 * j + half] as i32 - 32) as f32;
                    for (l, v) in y.iter_mut().enumerate() {
                        let i = 16 * half + l;
                        let low = ((q[i] >> (2 * j)) & 3) as i32;
                        let minus = if hmask[i] & bit != 0 { 0 } else { 4 };
                        *v = dl * (low - minus) as f32;
                    }
                }
            }
        }
    }
}

#[inline(always)]
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

#[inline(always)]
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

#[inline(always)]
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

#[inline(always)]
pub(crate) fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(292).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (v, &q) in y.iter_mut().zip(&b[4..260]) {
            *v = d * q as i8 as f32;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reference quantizers: ggml's `quantize_row_q*_K_ref` (what llama-quantize writes without an
// importance matrix). Every f32 expression keeps C's evaluation order (`w*x*l` is `(w*x)*l`,
// `w*l*l` is `(w*l)*l` with `l` converted to float first) so the searches take the same branches.
// ---------------------------------------------------------------------------------------------

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below it quantizes to zero.
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

/// `nearest_int`: round to nearest, ties to even, by the 1.5 * 2^23 trick (valid for |v| < 2^22,
/// which every caller guarantees; outside it returns the same garbage as ggml).
#[inline(always)]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let val = v + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The value of largest magnitude (first on ties) and that magnitude.
#[inline(always)]
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    (max, amax)
}

/// `make_qx_quants(n, nmax, x, L, rmse_type = 1, qw = NULL)`: symmetric quants in
/// `-nmax..nmax` (stored offset by `nmax`), scale fitted by weighted least squares over 19
/// candidate scales.
fn make_qx_quants(nmax: i32, x: &[f32], levels: &mut [u8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let fit = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let store = |iscale: f32, levels: &mut [u8]| {
        for (o, &v) in levels.iter_mut().zip(x) {
            *o = (nmax + nearest_int(iscale * v).clamp(-nmax, nmax - 1)) as u8;
        }
    };
    let iscale = -(nmax as f32) / max;
    store(iscale, levels);
    let (sumlx, suml2) = fit(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            store(iscale, levels);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants(n, nmax, x, L, do_rmse = true)`: symmetric quants refined one value at a
/// time (at most five sweeps) to maximise `sumlx^2 / suml2` with weights `x^2`.
fn make_q3_quants(nmax: i32, x: &[f32], levels: &mut [u8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut l_signed = [0i32; 16];
    let l_signed = &mut l_signed[..x.len()];
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (ls, &v) in l_signed.iter_mut().zip(x) {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *ls = l;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let li = l_signed[i] as f32;
            let mut slx = sumlx - w * v * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l_signed[i] {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_signed[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for (o, &l) in levels.iter_mut().zip(l_signed.iter()) {
        *o = (l + nmax) as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Parameters of `make_qkx2_quants`' scale search.
struct AffineSearch {
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
}

/// `make_qkx2_quants`: affine quants `scale * l - min` with `l` in `0..=nmax`, searching
/// `nstep + 1` candidate scales and refitting scale and min by weighted least squares.
/// Returns `(scale, min)` with `min >= 0` meaning the offset subtracted.
fn make_qkx2_quants(p: &AffineSearch, x: &[f32], weights: &[f32], levels: &mut [u8]) -> (f32, f32) {
    let n = x.len();
    let nmax = p.nmax;
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels.fill(0);
        return (0.0, -min);
    }
    let error = |d: f32| if p.use_mad { d.abs() } else { d * d };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        levels[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * error(diff);
    }
    if p.nstep < 1 {
        return (scale, -min);
    }
    let mut aux = [0u8; 32];
    for is in 0..=p.nstep {
        iscale = (p.rmin + p.rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let (w, lf) = (weights[i], l as f32);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * error(diff);
            }
            if cur_error < best_error {
                levels.copy_from_slice(&aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Packs 256 2-bit values the way Q2_K and Q3_K store them: byte `32 * (i / 128) + i % 32`,
/// bit shift `2 * ((i / 32) % 4)`.
fn pack_2bit(levels: &[u8; QK_K], qs: &mut [u8]) {
    for j in (0..QK_K).step_by(128) {
        for l in 0..32 {
            qs[j / 4 + l] =
                levels[j + l] | (levels[j + l + 32] << 2) | (levels[j + l + 64] << 4) | (levels[j + l + 96] << 6);
        }
    }
}

pub(crate) fn quantize_q2_k(src: &[f32], dst: &mut [u8]) {
    const Q4SCALE: f32 = 15.0;
    let search = AffineSearch { nmax: 3, rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: true };
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(84)) {
        let mut levels = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            let mut weights = [0f32; 16];
            for (w, &v) in weights.iter_mut().zip(xs) {
                *w = v.abs();
            }
            let (scale, min) = make_qkx2_quants(&search, xs, &weights, &mut levels[16 * j..16 * j + 16]);
            scales[j] = scale;
            mins[j] = min;
            if scale > max_scale {
                max_scale = scale;
            }
            if min > max_min {
                max_min = min;
            }
        }
        let (sc, rest) = b.split_at_mut(16);
        let (qs, dd) = rest.split_at_mut(64);
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for j in 0..16 {
                sc[j] = nearest_int(iscale * scales[j]) as u8;
            }
            dd[0..2].copy_from_slice(&f16_bytes(max_scale / Q4SCALE));
        } else {
            sc.fill(0);
            dd[0..2].copy_from_slice(&f16_bytes(0.0));
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for j in 0..16 {
                sc[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
            }
            dd[2..4].copy_from_slice(&f16_bytes(max_min / Q4SCALE));
        } else {
            dd[2..4].copy_from_slice(&f16_bytes(0.0));
        }
        let d_all = f16_at(&dd[0..2]);
        let dmin_all = f16_at(&dd[2..4]);
        for j in 0..16 {
            let d = d_all * (sc[j] & 0xF) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin_all * (sc[j] >> 4) as f32;
            for ii in 0..16 {
                let l = nearest_int((x[16 * j + ii] + dm) / d);
                levels[16 * j + ii] = l.clamp(0, 3) as u8;
            }
        }
        pack_2bit(&levels, qs);
    }
}

pub(crate) fn quantize_q3_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(110)) {
        let mut levels = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
        for j in 0..16 {
            scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut levels[16 * j..16 * j + 16]);
            let scale = scales[j].abs();
            if scale > amax {
                amax = scale;
                max_scale = scales[j];
            }
        }
        let (hmask, rest) = b.split_at_mut(32);
        let (qs, rest) = rest.split_at_mut(64);
        let (sc, dd) = rest.split_at_mut(12);
        sc.fill(0);
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for j in 0..16 {
                // ggml stores nearest_int's result in an int8_t before clamping.
                let l = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) as i32 + 32;
                if j < 8 {
                    sc[j] = (l & 0xF) as u8;
                } else {
                    sc[j - 8] |= ((l & 0xF) << 4) as u8;
                }
                sc[j % 4 + 8] |= ((l >> 4) << (2 * (j / 4))) as u8;
            }
            dd.copy_from_slice(&f16_bytes(1.0 / iscale));
        } else {
            dd.copy_from_slice(&f16_bytes(0.0));
        }
        let d_all = f16_at(dd);
        let decoded = q3_k_scales(sc);
        for j in 0..16 {
            let d = d_all * (decoded[j] as i32 - 32) as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let l = nearest_int(x[16 * j + ii] / d).clamp(-4, 3);
                levels[16 * j + ii] = (l + 4) as u8;
            }
        }
        hmask.fill(0);
        for (j, l) in levels.iter_mut().enumerate() {
            if *l > 3 {
                hmask[j % 32] |= 1 << (j / 32);
                *l -= 4;
            }
        }
        pack_2bit(&levels, qs);
    }
}

/// Packs the eight 6-bit scales and mins of a Q4_K/Q5_K block (inverse of [`scale_min_k4`]).
fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8], sc: &mut [u8]) {
    for j in 0..8 {
        if j < 4 {
            sc[j] = ls[j];
            sc[j + 4] = lm[j];
        } else {
            sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            sc[j - 4] |= (ls[j] >> 4) << 6;
            sc[j] |= (lm[j] >> 4) << 6;
        }
    }
}

/// The shared part of Q4_K and Q5_K: 8 sub-blocks of 32 fitted by `make_qkx2_quants`, 6-bit
/// scales and mins, then requantized against the stored scales. Writes d, dmin and scales
/// (bytes 0..16) and returns the levels (0..=nmax).
fn quantize_k_affine(x: &[f32], search: &AffineSearch, head: &mut [u8]) -> [u8; QK_K] {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (scale, min) = make_qkx2_quants(search, xs, &weights, &mut levels[32 * j..32 * j + 32]);
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        // ggml assigns nearest_int's result to a uint8_t (wrapping) before MIN(63, ..).
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    head[0..2].copy_from_slice(&f16_bytes(max_scale / 63.0));
    head[2..4].copy_from_slice(&f16_bytes(max_min / 63.0));
    pack_scale_min_k4(&ls, &lm, &mut head[4..16]);
    let d_all = f16_at(&head[0..2]);
    let dmin_all = f16_at(&head[2..4]);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &head[4..16]);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for ii in 0..32 {
            let l = nearest_int((x[32 * j + ii] + dm) / d);
            levels[32 * j + ii] = l.clamp(0, search.nmax) as u8;
        }
    }
    levels
}

pub(crate) fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    let search = AffineSearch { nmax: 15, rmin: -1.0, rdelta: 0.1, nstep: 20, use_mad: false };
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(144)) {
        let (head, qs) = b.split_at_mut(16);
        let levels = quantize_k_affine(x, &search, head);
        for (chunk, q) in qs.chunks_exact_mut(32).enumerate() {
            for l in 0..32 {
                q[l] = levels[64 * chunk + l] | (levels[64 * chunk + l + 32] << 4);
            }
        }
    }
}

pub(crate) fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    let search = AffineSearch { nmax: 31, rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: false };
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(176)) {
        let (head, rest) = b.split_at_mut(16);
        let (qh, ql) = rest.split_at_mut(32);
        let levels = quantize_k_affine(x, &search, head);
        qh.fill(0);
        for (chunk, q) in ql.chunks_exact_mut(32).enumerate() {
            let (m1, m2) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
            for j in 0..32 {
                let mut l1 = levels[64 * chunk + j];
                if l1 > 15 {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                let mut l2 = levels[64 * chunk + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                q[j] = l1 | (l2 << 4);
            }
        }
    }
}

pub(crate) fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(210)) {
        let mut levels = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
        for ib in 0..16 {
            let scale = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut levels[16 * ib..16 * ib + 16]);
            scales[ib] = scale;
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            b.fill(0);
            continue;
        }
        let iscale = -128.0 / max_scale;
        b[208..210].copy_from_slice(&f16_bytes(1.0 / iscale));
        for ib in 0..16 {
            b[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
        }
        let d_all = f16_at(&b[208..210]);
        for j in 0..16 {
            let d = d_all * b[192 + j] as i8 as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let l = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
                levels[16 * j + ii] = (l + 32) as u8;
            }
        }
        let (ql, rest) = b.split_at_mut(128);
        let qh = &mut rest[..64];
        for (half, (ql, qh)) in ql.chunks_exact_mut(64).zip(qh.chunks_exact_mut(32)).enumerate() {
            let lv = &levels[128 * half..128 * half + 128];
            for l in 0..32 {
                ql[l] = (lv[l] & 0xF) | ((lv[l + 64] & 0xF) << 4);
                ql[l + 32] = (lv[l + 32] & 0xF) | ((lv[l + 96] & 0xF) << 4);
                qh[l] = (lv[l] >> 4) | ((lv[l + 32] >> 4) << 2) | ((lv[l + 64] >> 4) << 4) | ((lv[l + 96] >> 4) << 6);
            }
        }
    }
}

/// One Q8_K block (`quantize_row_q8_K_ref`): scale `max / -127` from the signed absmax, quants
/// clamped to 127, and the 16 sums of 16 quants that the k-quant dot products use for mins.
/// Returns `d`.
#[inline(always)]
pub(crate) fn quantize_block_q8_k(x: &[f32], qs: &mut [i8], bsums: &mut [i16]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax == 0.0 {
        qs.fill(0);
        bsums.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (s, q) in bsums.iter_mut().zip(qs.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
    1.0 / iscale
}

pub(crate) fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(292)) {
        let mut qs = [0i8; QK_K];
        let mut bsums = [0i16; 16];
        let d = quantize_block_q8_k(x, &mut qs, &mut bsums);
        b[0..4].copy_from_slice(&d.to_le_bytes());
        for (o, q) in b[4..260].iter_mut().zip(qs) {
            *o = q as u8;
        }
        for (o, s) in b[260..292].chunks_exact_mut(2).zip(bsums) {
            o.copy_from_slice(&s.to_le_bytes());
        }
    }
}
