//! aarch64 NEON kernels for the quantized-activation dot products (NEON is baseline on
//! aarch64, so no detection is needed).
//!
//! Levels are unpacked 16 at a time into `int8x16_t`; `vmull_s8` widens the products to i16
//! (at most 128 * 128, no overflow) and pairwise adds bring them to i32. Sub-block sums are then
//! scaled in scalar code exactly as the portable kernel does, so the integer results are the
//! same; only the float accumulation order differs.

use std::arch::aarch64::*;

use gguf::GgmlType;

use super::super::float::f16_at;
use super::super::iq4::{iq4_xs_scale, KVALUES_IQ4NL};
use super::super::k_quants::{q3_k_scales, scale_min_k4};
use super::super::mxfp4::{e8m0_to_f32_half, KVALUES_MXFP4};
use super::super::qdot::ActRow;
use super::SimdDot;

pub(super) fn kernel(dtype: GgmlType) -> Option<SimdDot> {
    use GgmlType::*;
    Some(match dtype {
        Q4_0 => dot_q4_0,
        Q4_1 => dot_q4_1,
        Q5_0 => dot_q5_0,
        Q5_1 => dot_q5_1,
        Q8_0 => dot_q8_0,
        IQ4_NL => dot_iq4_nl,
        MXFP4 => dot_mxfp4,
        Q2_K => dot_q2_k,
        Q3_K => dot_q3_k,
        Q4_K => dot_q4_k,
        Q5_K => dot_q5_k,
        Q6_K => dot_q6_k,
        IQ4_XS => dot_iq4_xs,
        _ => return None,
    })
}

/// Sum of the 16 products of two i8 vectors.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dot16(a: int8x16_t, b: int8x16_t) -> i32 {
    let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    let hi = vmull_high_s8(a, b);
    vaddvq_s32(vaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)))
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn load_x(x: &[i8], at: usize) -> int8x16_t {
    vld1q_s8(x.as_ptr().add(at))
}

/// Low and high nibbles of 16 bytes: values 0..16 and 16..32 of a 32-value block.
#[inline]
#[target_feature(enable = "neon")]
pub(super) unsafe fn nibbles(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    let q = vld1q_u8(p);
    (vandq_u8(q, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(q))
}

/// 0x10 in each byte whose bit is set in `bits` (16 bits: two bytes, little-endian).
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fifth_bits(b0: u8, b1: u8) -> uint8x16_t {
    const MASKS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bytes = vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1));
    vandq_u8(vtstq_u8(bytes, vld1q_u8(MASKS.as_ptr())), vdupq_n_u8(0x10))
}

/// The shared loop of the 32-value types: `levels(block)` gives the two halves of the levels,
/// `scales(block)` gives `(d, m)`; `m` is used only for the types that have one (`has_min`), so
/// each block adds `(d * d_x) * s` (plus `(m * d_x) * sum(x)`), the float operations of the
/// multi-row kernels in `neon_tiles`, which give the same bits.
#[inline(always)]
unsafe fn dot_blocks32(
    w: &[u8],
    x: ActRow<'_>,
    block_bytes: usize,
    has_min: bool,
    levels: impl Fn(*const u8) -> (int8x16_t, int8x16_t),
    scales: impl Fn(*const u8) -> (f32, f32),
) -> f32 {
    let nb = w.len() / block_bytes;
    assert!(x.qs.len() >= nb * 32 && x.d.len() >= nb && x.sums.len() >= nb, "activation row too short");
    let mut acc = 0.0f32;
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * block_bytes);
        let (l0, l1) = levels(b);
        let sumi = dot16(l0, load_x(x.qs, ib * 32)) + dot16(l1, load_x(x.qs, ib * 32 + 16));
        let (d, m) = scales(b);
        let mut t = d * x.d[ib] * sumi as f32;
        if has_min {
            t += m * x.d[ib] * x.sums[ib] as f32;
        }
        acc += t;
    }
    acc
}

unsafe fn block_f16(b: *const u8, at: usize) -> f32 {
    f16_at(std::slice::from_raw_parts(b.add(at), 2))
}

#[target_feature(enable = "neon")]
unsafe fn dot_q4_0(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_blocks32(
        w,
        x,
        18,
        false,
        |b| {
            let (lo, hi) = nibbles(b.add(2));
            let eight = vdupq_n_s8(8);
            (vsubq_s8(vreinterpretq_s8_u8(lo), eight), vsubq_s8(vreinterpretq_s8_u8(hi), eight))
        },
        |b| (block_f16(b, 0), 0.0),
    )
}

#[target_feature(enable = "neon")]
unsafe fn dot_q4_1(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_blocks32(
        w,
        x,
        20,
        true,
        |b| {
            let (lo, hi) = nibbles(b.add(4));
            (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi))
        },
        |b| (block_f16(b, 0), block_f16(b, 2)),
    )
}

/// Q5_0/Q5_1 levels: nibble + 16 * bit, minus `offset`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn levels_q5(qh: *const u8, qs: *const u8, offset: i8) -> (int8x16_t, int8x16_t) {
    let (lo, hi) = nibbles(qs);
    let lo = vorrq_u8(lo, fifth_bits(*qh, *qh.add(1)));
    let hi = vorrq_u8(hi, fifth_bits(*qh.add(2), *qh.add(3)));
    let off = vdupq_n_s8(offset);
    (vsubq_s8(vreinterpretq_s8_u8(lo), off), vsubq_s8(vreinterpretq_s8_u8(hi), off))
}

#[target_feature(enable = "neon")]
unsafe fn dot_q5_0(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_blocks32(w, x, 22, false, |b| levels_q5(b.add(2), b.add(6), 16), |b| (block_f16(b, 0), 0.0))
}

#[target_feature(enable = "neon")]
unsafe fn dot_q5_1(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_blocks32(w, x, 24, true, |b| levels_q5(b.add(4), b.add(8), 0), |b| (block_f16(b, 0), block_f16(b, 2)))
}

#[target_feature(enable = "neon")]
unsafe fn dot_q8_0(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_blocks32(
        w,
        x,
        34,
        false,
        |b| (vld1q_s8(b.add(2) as *const i8), vld1q_s8(b.add(18) as *const i8)),
        |b| (block_f16(b, 0), 0.0),
    )
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn lookup(table: &[i8; 16], p: *const u8) -> (int8x16_t, int8x16_t) {
    let t = vld1q_s8(table.as_ptr());
    let (lo, hi) = nibbles(p);
    (vqtbl1q_s8(t, lo), vqtbl1q_s8(t, hi))
}

#[target_feature(enable = "neon")]
unsafe fn dot_iq4_nl(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_blocks32(w, x, 18, false, |b| lookup(&KVALUES_IQ4NL, b.add(2)), |b| (block_f16(b, 0), 0.0))
}

#[target_feature(enable = "neon")]
unsafe fn dot_mxfp4(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_blocks32(w, x, 17, false, |b| lookup(&KVALUES_MXFP4, b.add(1)), |b| (e8m0_to_f32_half(*b), 0.0))
}

/// `(n_superblocks)` after checking the activation row covers them.
#[inline(always)]
fn superblocks(w: &[u8], block_bytes: usize, x: &ActRow<'_>) -> usize {
    let nb = w.len() / block_bytes;
    assert!(x.qs.len() >= nb * 256 && x.d.len() >= nb && x.sums.len() >= nb * 16, "activation row too short");
    nb
}

/// The 16 sums of 16 products of a super-block whose levels `levels(g)` yields per group.
#[inline(always)]
unsafe fn group_sums(xq: &[i8], levels: impl Fn(usize) -> int8x16_t) -> [i32; 16] {
    let mut s = [0i32; 16];
    for (g, v) in s.iter_mut().enumerate() {
        *v = dot16(levels(g), load_x(xq, 16 * g));
    }
    s
}

/// 2-bit fields of Q2_K/Q3_K for group `g` (values 16g..16g+16): byte `32*(g/8) + 16*(g%2) + l`,
/// shift `2 * ((g/2) % 4)`.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn two_bits(qs: *const u8, g: usize) -> uint8x16_t {
    let q = vld1q_u8(qs.add(32 * (g / 8) + 16 * (g % 2)));
    let shifted = vshlq_u8(q, vdupq_n_s8(-(2 * ((g / 2) % 4) as i8)));
    vandq_u8(shifted, vdupq_n_u8(3))
}

#[target_feature(enable = "neon")]
unsafe fn dot_q2_k(w: &[u8], x: ActRow<'_>) -> f32 {
    let nb = superblocks(w, 84, &x);
    let mut acc = 0.0f32;
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * 84);
        let sc = std::slice::from_raw_parts(b, 16);
        let xq = &x.qs[ib * 256..ib * 256 + 256];
        let bsums = &x.sums[ib * 16..ib * 16 + 16];
        let sums = group_sums(xq, |g| vreinterpretq_s8_u8(two_bits(b.add(16), g)));
        let (mut sumi, mut summ) = (0i32, 0i32);
        for g in 0..16 {
            sumi += (sc[g] & 0xF) as i32 * sums[g];
            summ += (sc[g] >> 4) as i32 * bsums[g] as i32;
        }
        acc += x.d[ib] * (block_f16(b, 80) * sumi as f32 - block_f16(b, 82) * summ as f32);
    }
    acc
}

#[target_feature(enable = "neon")]
unsafe fn dot_q3_k(w: &[u8], x: ActRow<'_>) -> f32 {
    let nb = superblocks(w, 110, &x);
    let mut acc = 0.0f32;
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * 110);
        let scales = q3_k_scales(std::slice::from_raw_parts(b.add(96), 12));
        let xq = &x.qs[ib * 256..ib * 256 + 256];
        let sums = group_sums(xq, |g| {
            // High bit of value i: bit i/32 of hmask[i % 32]; set means level = low, else low - 4.
            let hm = vld1q_u8(b.add(16 * (g % 2)));
            let bit = vtstq_u8(hm, vdupq_n_u8(1 << (g / 2)));
            let minus4 = vbicq_u8(vdupq_n_u8(4), bit);
            vsubq_s8(vreinterpretq_s8_u8(two_bits(b.add(32), g)), vreinterpretq_s8_u8(minus4))
        });
        let mut sumi = 0i32;
        for g in 0..16 {
            sumi += (scales[g] as i32 - 32) * sums[g];
        }
        acc += x.d[ib] * block_f16(b, 108) * sumi as f32;
    }
    acc
}

#[target_feature(enable = "neon")]
unsafe fn dot_q4_k(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_q45_k(w, x, false)
}

#[target_feature(enable = "neon")]
unsafe fn dot_q5_k(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_q45_k(w, x, true)
}

#[inline(always)]
unsafe fn dot_q45_k(w: &[u8], x: ActRow<'_>, five_bits: bool) -> f32 {
    let block_bytes = if five_bits { 176 } else { 144 };
    let qs_at = if five_bits { 48 } else { 16 };
    let nb = superblocks(w, block_bytes, &x);
    let mut acc = 0.0f32;
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * block_bytes);
        let packed = std::slice::from_raw_parts(b.add(4), 12);
        let xq = &x.qs[ib * 256..ib * 256 + 256];
        let bsums = &x.sums[ib * 16..ib * 16 + 16];
        // Group g (16 values) is half g%2 of sub-block g/2; sub-block j uses the low nibbles of
        // bytes 32*(j/2).. when j is even, the high nibbles when odd.
        let sums = group_sums(xq, |g| {
            let j = g / 2;
            let q = vld1q_u8(b.add(qs_at + 32 * (j / 2) + 16 * (g % 2)));
            let mut v = if j % 2 == 0 { vandq_u8(q, vdupq_n_u8(0x0F)) } else { vshrq_n_u8::<4>(q) };
            if five_bits {
                let hm = vld1q_u8(b.add(16 + 16 * (g % 2)));
                let bit = vtstq_u8(hm, vdupq_n_u8(1 << j));
                v = vorrq_u8(v, vandq_u8(bit, vdupq_n_u8(16)));
            }
            vreinterpretq_s8_u8(v)
        });
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, packed);
            sumi += sc as i32 * (sums[2 * j] + sums[2 * j + 1]);
            summ += m as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
        }
        acc += x.d[ib] * (block_f16(b, 0) * sumi as f32 - block_f16(b, 2) * summ as f32);
    }
    acc
}

#[target_feature(enable = "neon")]
unsafe fn dot_q6_k(w: &[u8], x: ActRow<'_>) -> f32 {
    let nb = superblocks(w, 210, &x);
    let mut acc = 0.0f32;
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * 210);
        let scales = std::slice::from_raw_parts(b.add(192) as *const i8, 16);
        let xq = &x.qs[ib * 256..ib * 256 + 256];
        // Group g: half h = g/8 of the block, quarter r = (g/2)%4 (which nibble/2-bit field),
        // l-range 16*(g%2).. of that half's 32 positions.
        let sums = group_sums(xq, |g| {
            let (h, r, l0) = (g / 8, (g / 2) % 4, 16 * (g % 2));
            let ql = vld1q_u8(b.add(64 * h + 32 * (r % 2) + l0));
            let qh = vld1q_u8(b.add(128 + 32 * h + l0));
            let low = if r < 2 { vandq_u8(ql, vdupq_n_u8(0x0F)) } else { vshrq_n_u8::<4>(ql) };
            let high = vandq_u8(vshlq_u8(qh, vdupq_n_s8(-(2 * r as i8))), vdupq_n_u8(3));
            let v = vorrq_u8(low, vshlq_n_u8::<4>(high));
            vsubq_s8(vreinterpretq_s8_u8(v), vdupq_n_s8(32))
        });
        let mut sumi = 0i32;
        for g in 0..16 {
            sumi += scales[g] as i32 * sums[g];
        }
        acc += x.d[ib] * block_f16(b, 208) * sumi as f32;
    }
    acc
}

#[target_feature(enable = "neon")]
unsafe fn dot_iq4_xs(w: &[u8], x: ActRow<'_>) -> f32 {
    let nb = superblocks(w, 136, &x);
    let mut acc = 0.0f32;
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * 136);
        let scales_h = u16::from_le_bytes([*b.add(2), *b.add(3)]);
        let scales_l = std::slice::from_raw_parts(b.add(4), 4);
        let xq = &x.qs[ib * 256..ib * 256 + 256];
        let mut sumi = 0i32;
        for sb in 0..8 {
            let (l0, l1) = lookup(&KVALUES_IQ4NL, b.add(8 + 16 * sb));
            let s = dot16(l0, load_x(xq, 32 * sb)) + dot16(l1, load_x(xq, 32 * sb + 16));
            sumi += (iq4_xs_scale(sb, scales_h, scales_l) - 32) * s;
        }
        acc += x.d[ib] * block_f16(b, 0) * sumi as f32;
    }
    acc
}
