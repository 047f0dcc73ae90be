//! aarch64 NEON multi-row kernels for Q4_0, Q4_1, Q5_0, Q8_0 (Q8_0-style activations), Q4_K and
//! Q6_K (Q8_K activations): decode as eight weight rows against one token, prefill as four rows
//! by sixteen tokens in the token-octet layout of [`TokenOctet`], the weights read from the GGUF
//! blocks as stored.
//!
//! Decode: the activation quants of a block are loaded once for the eight rows; each row's
//! block sum comes out as four i32 lanes, and the eight rows' lanes are folded by three rounds
//! of pairwise adds (`addp`) into two vectors of eight exact block sums, so the scales of eight
//! rows are converted (one vectorised f16 widening) and applied with one multiply per four
//! rows. Prefill: a vector of activations holds four consecutive values of four tokens, and
//! `sdot v.4s, x.16b, w.4b[i]` (the by-element dot product) multiplies each token's four values
//! by four weights picked from a register in place, no broadcast or shuffle; each load of
//! activations serves the four rows of the tile, each unpacked weight register sixteen tokens.
//!
//! Two builds of every kernel: with the dot-product extension (`sdot`, Armv8.2 and later:
//! Cortex-A55/A76+, Neoverse, Apple) when `is_aarch64_feature_detected!("dotprod")` says so,
//! written as inline assembly because the intrinsics are not stable, and without it, by
//! widening multiply-accumulates (`smull`/`smlal` into i16 lanes, `sadalp`/`saddlp` into i32)
//! that sum as many products in i16 as the level ranges allow. Both give the same integers.
//!
//! Bits: per (row, token) the exact integer block sums of `neon.rs` (levels kept unsigned where
//! that is cheaper, the offset taken off exactly as `8 * sum(x)` or `16 * sum(x)`; Q6_K's as
//! `32 * sum(scale * bsum)` in decode), then the single-row kernel's float operations in its
//! order, per lane: `acc += (d_w * d_x) * float(s)` (Q4_1: `+ (m_w * d_x) * float(sum(x))`
//! first added to that term), Q4_K `acc += d_x * (d_w * float(s) - dmin_w * float(m))`, Q6_K
//! `acc += (d_x * d_w) * float(s)`, no fused multiply-add. Lanes never mix, so a tile, the
//! decode kernel and `neon.rs`'s single-row kernel give each output the same bits, and tiled and
//! untiled matmuls are interchangeable.
//!
//! Integer ranges (activation quants are within -127..=127, as both quantizers produce): the
//! widening path sums in an i16 lane four products of levels up to 63 in magnitude (4 * 63 *
//! 127 = 32004; Q4 levels <= 15, Q5_0 <= 31, Q6_K -32..=31) and two of Q8_0's (2 * 128 * 127 =
//! 32512) before widening.
//!
//! Safety: the helpers below are `unsafe` because they read through raw pointers; what makes
//! those reads valid is the entry points' contract (every row pointer starts `nb` whole blocks;
//! the activation lengths are asserted at the top of each kernel before any read).

// The tile loops index accumulators `[row][octet][half]`, weights `[row][half]` and pointer
// offsets with the same counters; iterators over one of them would hide the layout.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;
use std::arch::asm;

use gguf::GgmlType;

use super::super::float::f16_at;
use super::super::qdot::{ActRow, TokenOctet};
use super::neon::nibbles;
use super::{OctetTileKernel, RowsKernel};

/// `[e(0), e(1), ..]` for the listed indices, written out: the closures that
/// `std::array::from_fn` and `array::map` call were at times left as out-of-line calls in the
/// hot loops (the Q6_K tile's four rows' unpacking became four calls per 32 values after an
/// unrelated change elsewhere in the file: 447 -> 555 guest instructions per row and token).
macro_rules! unrolled {
    ([$($n:literal),*], |$i:ident| $e:expr) => {
        [$({
            let $i: usize = $n;
            $e
        }),*]
    };
}

/// Q4_0: unsigned nibbles, level = u - 8.
const Q4_0: u8 = 0;
/// Q4_1: unsigned nibbles, `w = d * u + m`.
const Q4_1: u8 = 1;
/// Q5_0: nibble plus fifth bit, level = u - 16.
const Q5_0: u8 = 2;
/// Q8_0: signed bytes.
const Q8_0: u8 = 3;
/// Q4_K: 144-byte super-blocks (`d`, `dmin`, 12 bytes of 6-bit scales and mins, 128 of nibbles).
const Q4_K: u8 = 4;
/// Q6_K: 210-byte super-blocks (128 bytes of low nibbles, 64 of high bit pairs, 16 i8 scales, `d`).
const Q6_K: u8 = 5;

/// The decode kernel, the two-octet and the one-octet prefill tile of `dtype`, built with `sdot`
/// when the CPU has the dot-product extension; `None` for types without tiles.
pub(super) fn kernels(dtype: GgmlType) -> Option<(RowsKernel, OctetTileKernel<2>, OctetTileKernel<1>)> {
    kernels_built(dtype, std::arch::is_aarch64_feature_detected!("dotprod"))
}

/// As [`kernels`], the `sdot` build when `sdot` (which the CPU must then have).
fn kernels_built(dtype: GgmlType, sdot: bool) -> Option<(RowsKernel, OctetTileKernel<2>, OctetTileKernel<1>)> {
    macro_rules! pick {
        ($t:expr) => {
            if sdot {
                (
                    rows8_sdot::<{ $t }> as RowsKernel,
                    tile_sdot::<{ $t }, 2> as OctetTileKernel<2>,
                    tile_sdot::<{ $t }, 1> as OctetTileKernel<1>,
                )
            } else {
                (
                    rows8_mull::<{ $t }> as RowsKernel,
                    tile_mull::<{ $t }, 2> as OctetTileKernel<2>,
                    tile_mull::<{ $t }, 1> as OctetTileKernel<1>,
                )
            }
        };
    }
    Some(match dtype {
        GgmlType::Q4_0 => pick!(Q4_0),
        GgmlType::Q4_1 => pick!(Q4_1),
        GgmlType::Q5_0 => pick!(Q5_0),
        GgmlType::Q8_0 => pick!(Q8_0),
        GgmlType::Q4_K => pick!(Q4_K),
        GgmlType::Q6_K => pick!(Q6_K),
        _ => return None,
    })
}

/// Eight weight rows against one activation row, with `sdot`.
///
/// # Safety
/// The CPU must have the dot-product extension; every `rows[i]` must point at `nb` blocks of
/// `T`; `x` must hold at least `nb` blocks (checked).
#[target_feature(enable = "dotprod")]
unsafe fn rows8_sdot<const T: u8>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    rows8::<T, true>(rows, nb, x)
}

/// As [`rows8_sdot`], with widening multiply-accumulates (any aarch64 CPU).
///
/// # Safety
/// Every `rows[i]` must point at `nb` blocks of `T`; `x` must hold at least `nb` blocks
/// (checked).
unsafe fn rows8_mull<const T: u8>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    rows8::<T, false>(rows, nb, x)
}

/// Four weight rows against `N` octets of tokens, with `sdot`: `out[r][o][t]`.
///
/// # Safety
/// The CPU must have the dot-product extension; every `rows[i]` must point at `nb` blocks of
/// `T`; every octet must hold at least `nb` blocks (checked).
#[target_feature(enable = "dotprod")]
unsafe fn tile_sdot<const T: u8, const N: usize>(
    rows: &[*const u8; 4],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; 4] {
    tile::<T, true, N>(rows, nb, xs)
}

/// As [`tile_sdot`], with widening multiply-accumulates (any aarch64 CPU).
///
/// # Safety
/// Every `rows[i]` must point at `nb` blocks of `T`; every octet must hold at least `nb`
/// blocks (checked).
unsafe fn tile_mull<const T: u8, const N: usize>(
    rows: &[*const u8; 4],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; 4] {
    tile::<T, false, N>(rows, nb, xs)
}

#[inline(always)]
unsafe fn rows8<const T: u8, const DOT: bool>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    match T {
        Q4_K => rows8_q4_k::<DOT>(rows, nb, x),
        Q6_K => rows8_q6_k::<DOT>(rows, nb, x),
        _ => rows8_32::<T, DOT>(rows, nb, x),
    }
}

#[inline(always)]
unsafe fn tile<const T: u8, const DOT: bool, const N: usize>(
    rows: &[*const u8; 4],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; 4] {
    match T {
        Q4_K => tile_q4_k::<DOT, N>(rows, nb, xs),
        Q6_K => tile_q6_k::<DOT, N>(rows, nb, xs),
        _ => tile32::<T, DOT, N>(rows, nb, xs),
    }
}

const fn block_bytes(t: u8) -> usize {
    match t {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        _ => 34,
    }
}

/// What is subtracted from the unsigned levels (0 for Q4_1, whose min is separate, and Q8_0).
const fn level_offset(t: u8) -> i32 {
    match t {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    }
}

/// `acc + ` the four sums of four products of `a` and `b` (`sdot`).
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: register-only instruction; the caller's CPU has the dot-product extension.
    unsafe {
        asm!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags));
    }
    acc
}

/// `acc + ` per 32-bit lane `i` the sum of the four products of `x`'s bytes `4i..4i + 4` with
/// bytes `4L..4L + 4` of `w` (`sdot` by element).
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn sdot_lane<const L: i32>(mut acc: int32x4_t, x: int8x16_t, w: int8x16_t) -> int32x4_t {
    // SAFETY: as in `sdot`.
    unsafe {
        asm!("sdot {acc:v}.4s, {x:v}.16b, {w:v}.4b[{l}]", acc = inout(vreg) acc, x = in(vreg) x, w = in(vreg) w,
            l = const L, options(pure, nomem, nostack, preserves_flags));
    }
    acc
}

/// The dot product of 16 levels and 16 activations as four i32 lanes whose sum is exact (two
/// products per i16 lane before widening without `sdot`).
#[inline(always)]
unsafe fn dot16<const DOT: bool>(w: int8x16_t, x: int8x16_t) -> int32x4_t {
    if DOT {
        sdot(vdupq_n_s32(0), w, x)
    } else {
        vpaddlq_s16(vmlal_high_s8(vmull_s8(vget_low_s8(w), vget_low_s8(x)), w, x))
    }
}

/// As [`dot16`] for 32 values (`w0`, `w1` with `x0`, `x1`); `wide` for Q8_0's levels, otherwise
/// |level| <= 63 and four products share an i16 lane.
#[inline(always)]
unsafe fn dot32<const DOT: bool>(w0: int8x16_t, w1: int8x16_t, x0: int8x16_t, x1: int8x16_t, wide: bool) -> int32x4_t {
    if DOT {
        sdot(sdot(vdupq_n_s32(0), w0, x0), w1, x1)
    } else if wide {
        vaddq_s32(dot16::<false>(w0, x0), dot16::<false>(w1, x1))
    } else {
        let p = vmlal_high_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)), w0, x0);
        vpaddlq_s16(vmlal_high_s8(vmlal_s8(p, vget_low_s8(w1), vget_low_s8(x1)), w1, x1))
    }
}

/// `acc +` four tokens' sums over sixteen values: `x[g]` holds values `4g..4g + 4` of tokens
/// 0..4 (four bytes per token), `w` the sixteen weights of one row; lane `t` gets
/// `sum_g sum_i w[4g + i] * x[g][4t + i]`. `wide` as for [`dot32`].
#[inline(always)]
unsafe fn dot_lanes<const DOT: bool>(acc: int32x4_t, x: &[int8x16_t; 4], w: int8x16_t, wide: bool) -> int32x4_t {
    if DOT {
        let acc = sdot_lane::<0>(acc, x[0], w);
        let acc = sdot_lane::<1>(acc, x[1], w);
        let acc = sdot_lane::<2>(acc, x[2], w);
        sdot_lane::<3>(acc, x[3], w)
    } else {
        // Each group's four weights in every 32-bit lane, products per byte in i16 lanes (two
        // tokens per half), then pairs of lanes added into i32 and pairs of those per token.
        let w32 = vreinterpretq_s32_s8(w);
        let b = [
            vreinterpretq_s8_s32(vdupq_laneq_s32::<0>(w32)),
            vreinterpretq_s8_s32(vdupq_laneq_s32::<1>(w32)),
            vreinterpretq_s8_s32(vdupq_laneq_s32::<2>(w32)),
            vreinterpretq_s8_s32(vdupq_laneq_s32::<3>(w32)),
        ];
        let lo2 = |g: usize| {
            vmlal_s8(vmull_s8(vget_low_s8(x[g]), vget_low_s8(b[g])), vget_low_s8(x[g + 1]), vget_low_s8(b[g + 1]))
        };
        let hi2 = |g: usize| vmlal_high_s8(vmull_high_s8(x[g], b[g]), x[g + 1], b[g + 1]);
        let (lo, hi) = if wide {
            (vpadalq_s16(vpaddlq_s16(lo2(0)), lo2(2)), vpadalq_s16(vpaddlq_s16(hi2(0)), hi2(2)))
        } else {
            let lo =
                vmlal_s8(vmlal_s8(lo2(0), vget_low_s8(x[2]), vget_low_s8(b[2])), vget_low_s8(x[3]), vget_low_s8(b[3]));
            let hi = vmlal_high_s8(vmlal_high_s8(hi2(0), x[2], b[2]), x[3], b[3]);
            (vpaddlq_s16(lo), vpaddlq_s16(hi))
        };
        vaddq_s32(acc, vpaddq_s32(lo, hi))
    }
}

/// Eight rows' four-lane partial sums to two vectors of the rows' totals, rows 0..4 and 4..8.
#[inline(always)]
unsafe fn fold8(p: &[int32x4_t; 8]) -> [int32x4_t; 2] {
    let q = |i: usize| vpaddq_s32(vpaddq_s32(p[i], p[i + 1]), vpaddq_s32(p[i + 2], p[i + 3]));
    [q(0), q(4)]
}

/// Four f16 values to f32 exactly as `float::f16_to_f32` does (NaN payloads and signalling bits
/// kept, which `fcvtl` would quiet): sign and the 15 other bits moved to their f32 places, the
/// exponent rebased by a multiply by 2^112 (exact for normal and subnormal values), infinities
/// and NaNs given the all-ones exponent.
#[inline(always)]
unsafe fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let h = vmovl_u16(h);
    let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
    let em = vshlq_n_u32::<13>(vandq_u32(h, vdupq_n_u32(0x7fff)));
    let finite = vreinterpretq_u32_f32(vmulq_f32(vreinterpretq_f32_u32(em), vdupq_n_f32(f32::from_bits(0x7780_0000))));
    let special = vceqq_u32(vandq_u32(h, vdupq_n_u32(0x7c00)), vdupq_n_u32(0x7c00));
    let inf_nan = vorrq_u32(em, vdupq_n_u32(0x7f80_0000));
    vreinterpretq_f32_u32(vorrq_u32(sign, vbslq_u32(special, inf_nan, finite)))
}

/// [`f16x4_to_f32`] of eight values, lanes 0..4 and 4..8.
#[inline(always)]
unsafe fn f16x8_to_f32(h: uint16x8_t) -> [float32x4_t; 2] {
    [f16x4_to_f32(vget_low_u16(h)), f16x4_to_f32(vget_high_u16(h))]
}

/// The little-endian u16 at `p`, which need not be aligned.
#[inline(always)]
unsafe fn u16_at(p: *const u8) -> u16 {
    u16::from_le((p as *const u16).read_unaligned())
}

/// The f16 at `rows[i] + at` of eight rows as f32, rows 0..4 and 4..8.
#[inline(always)]
unsafe fn f16x8(rows: &[*const u8; 8], at: usize) -> [float32x4_t; 2] {
    let h: [u16; 8] = unrolled!([0, 1, 2, 3, 4, 5, 6, 7], |i| u16_at(rows[i].add(at)));
    f16x8_to_f32(vld1q_u16(h.as_ptr()))
}

/// The two f16 at `rows[i] + at` and `rows[i] + at + 2` of eight rows (a Q4_1 block's `d` and
/// `m`) as f32: one 32-bit load per row, the halves separated by one unzip each.
#[inline(always)]
unsafe fn f16_pairs8(rows: &[*const u8; 8], at: usize) -> ([float32x4_t; 2], [float32x4_t; 2]) {
    let words: [u32; 8] =
        unrolled!([0, 1, 2, 3, 4, 5, 6, 7], |i| u32::from_le((rows[i].add(at) as *const u32).read_unaligned()));
    let lo = vreinterpretq_u16_u32(vld1q_u32(words.as_ptr()));
    let hi = vreinterpretq_u16_u32(vld1q_u32(words.as_ptr().add(4)));
    (f16x8_to_f32(vuzp1q_u16(lo, hi)), f16x8_to_f32(vuzp2q_u16(lo, hi)))
}

/// The f16 at `p` as f32 (`float::f16_at`).
#[inline(always)]
unsafe fn f16_ptr(p: *const u8) -> f32 {
    f16_at(std::slice::from_raw_parts(p, 2))
}

/// The 32 levels of the block at `b` (values 0..16, 16..32): unsigned for Q4_0/Q4_1/Q5_0,
/// signed bytes for Q8_0.
#[inline(always)]
unsafe fn levels<const T: u8>(b: *const u8) -> [int8x16_t; 2] {
    let (lo, hi) = match T {
        Q4_0 => nibbles(b.add(2)),
        Q4_1 => nibbles(b.add(4)),
        Q5_0 => {
            // Bit j of the u32 at b + 2 is value j's fifth bit: its four bytes spread one per
            // eight lanes by a table lookup, then each lane tests its own bit.
            const SPREAD: [[u8; 16]; 2] =
                [[0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]];
            const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
            let word = vreinterpretq_u8_u32(vdupq_n_u32(u32::from_le((b.add(2) as *const u32).read_unaligned())));
            let fifth = |i: usize| {
                let spread = vqtbl1q_u8(word, vld1q_u8(SPREAD[i].as_ptr()));
                vandq_u8(vtstq_u8(spread, vld1q_u8(BIT.as_ptr())), vdupq_n_u8(0x10))
            };
            let (lo, hi) = nibbles(b.add(6));
            (vorrq_u8(lo, fifth(0)), vorrq_u8(hi, fifth(1)))
        }
        _ => return [vld1q_s8(b.add(2) as *const i8), vld1q_s8(b.add(18) as *const i8)],
    };
    [vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)]
}

/// Decode for the 32-value types.
#[inline(always)]
unsafe fn rows8_32<const T: u8, const DOT: bool>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    assert!(x.qs.len() >= nb * 32 && x.d.len() >= nb && x.sums.len() >= nb, "activation row too short");
    let mut acc = [vdupq_n_f32(0.0); 2];
    for ib in 0..nb {
        let at = ib * block_bytes(T);
        let xq = x.qs.as_ptr().add(32 * ib);
        let (x0, x1) = (vld1q_s8(xq), vld1q_s8(xq.add(16)));
        let per_row: [int32x4_t; 8] = unrolled!([0, 1, 2, 3, 4, 5, 6, 7], |r| {
            let [w0, w1] = levels::<T>(rows[r].add(at));
            dot32::<DOT>(w0, w1, x0, x1, T == Q8_0)
        });
        let mut s = fold8(&per_row);
        let sx = *x.sums.get_unchecked(ib) as i32;
        if level_offset(T) != 0 {
            let offset = vdupq_n_s32(level_offset(T) * sx);
            s = [vsubq_s32(s[0], offset), vsubq_s32(s[1], offset)];
        }
        let dx = vdupq_n_f32(*x.d.get_unchecked(ib));
        let (dw, mw) = if T == Q4_1 { f16_pairs8(rows, at) } else { (f16x8(rows, at), [vdupq_n_f32(0.0); 2]) };
        for h in 0..2 {
            let mut t = vmulq_f32(vmulq_f32(dw[h], dx), vcvtq_f32_s32(s[h]));
            if T == Q4_1 {
                t = vaddq_f32(t, vmulq_f32(vmulq_f32(mw[h], dx), vdupq_n_f32(sx as f32)));
            }
            acc[h] = vaddq_f32(acc[h], t);
        }
    }
    let mut out = [0.0f32; 8];
    vst1q_f32(out.as_mut_ptr(), acc[0]);
    vst1q_f32(out.as_mut_ptr().add(4), acc[1]);
    out
}

/// Prefill for the 32-value types. Per octet half (four tokens) the four rows' sums are
/// completed and applied before the next, so only four integer accumulators are live.
#[inline(always)]
unsafe fn tile32<const T: u8, const DOT: bool, const N: usize>(
    rows: &[*const u8; 4],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; 4] {
    xs.iter().for_each(|x| x.assert_q8_0_blocks(nb, true));
    let mut acc = [[[vdupq_n_f32(0.0); 2]; N]; 4];
    for ib in 0..nb {
        let at = ib * block_bytes(T);
        let w: [[int8x16_t; 2]; 4] = unrolled!([0, 1, 2, 3], |r| levels::<T>(rows[r].add(at)));
        let dw: [float32x4_t; 4] = unrolled!([0, 1, 2, 3], |r| vdupq_n_f32(f16_ptr(rows[r].add(at))));
        let mw: [float32x4_t; 4] =
            unrolled!([0, 1, 2, 3], |r| if T == Q4_1 { vdupq_n_f32(f16_ptr(rows[r].add(at + 2))) } else { dw[r] });
        for (o, x) in xs.iter().enumerate() {
            for th in 0..2 {
                // Value groups 0..4 then 4..8 of tokens 4 th..4 th + 4.
                let xq = x.qs.as_ptr().add(256 * ib + 16 * th);
                let mut s = [vdupq_n_s32(0); 4];
                for half in 0..2 {
                    let xv: [int8x16_t; 4] = unrolled!([0, 1, 2, 3], |g| vld1q_s8(xq.add(32 * (4 * half + g))));
                    for r in 0..4 {
                        s[r] = dot_lanes::<DOT>(s[r], &xv, w[r][half], T == Q8_0);
                    }
                }
                let dx = vld1q_f32(x.d.as_ptr().add(8 * ib + 4 * th));
                let sx = vld1q_s32(x.sums.as_ptr().add(8 * ib + 4 * th));
                for r in 0..4 {
                    let si = if level_offset(T) != 0 { vmlsq_n_s32(s[r], sx, level_offset(T)) } else { s[r] };
                    let mut t = vmulq_f32(vmulq_f32(dw[r], dx), vcvtq_f32_s32(si));
                    if T == Q4_1 {
                        t = vaddq_f32(t, vmulq_f32(vmulq_f32(mw[r], dx), vcvtq_f32_s32(sx)));
                    }
                    acc[r][o][th] = vaddq_f32(acc[r][o][th], t);
                }
            }
        }
    }
    store_tile(&acc)
}

#[inline(always)]
unsafe fn store_tile<const N: usize>(acc: &[[[float32x4_t; 2]; N]; 4]) -> [[[f32; 8]; N]; 4] {
    let mut out = [[[0.0f32; 8]; N]; 4];
    for r in 0..4 {
        for o in 0..N {
            vst1q_f32(out[r][o].as_mut_ptr(), acc[r][o][0]);
            vst1q_f32(out[r][o].as_mut_ptr().add(4), acc[r][o][1]);
        }
    }
    out
}

/// A Q4_K super-block's eight 6-bit scales and eight mins (`k_quants::scale_min_k4`), unpacked
/// from the 12 bytes at `p` four at a time in u32 words as ggml's `utmp` rearrangement does:
/// byte `j` of the first word is value `j`.
#[inline(always)]
unsafe fn scales_mins_k4(p: *const u8) -> ([u32; 2], [u32; 2]) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le((p.add(4 * i) as *const u32).read_unaligned());
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let scales = [u0 & LOW6, (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4)];
    let mins = [u1 & LOW6, ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4)];
    (scales, mins)
}

/// Two u32 words of four unsigned bytes each as two vectors of four i32 lanes.
#[inline(always)]
unsafe fn widen_bytes(words: [u32; 2]) -> [int32x4_t; 2] {
    let h = vmovl_u8(vcreate_u8(words[0] as u64 | (words[1] as u64) << 32));
    [vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(h))), vreinterpretq_s32_u32(vmovl_high_u16(h))]
}

/// The 32 levels (0..16) of Q4_K sub-block `j` of the super-block at `b`: the low nibbles of
/// bytes `16 + 32 (j / 2)..` for even `j`, the high ones for odd.
///
/// The nibble is picked by a shift by a register (`ushl` by 0 or -4), not a branch on `j`: where
/// the compiler keeps the sub-block loop rolled, a choice between two results became a blend of
/// both (five instructions per register instead of two).
#[inline(always)]
unsafe fn q4_k_levels(b: *const u8, j: usize) -> [int8x16_t; 2] {
    let p = b.add(16 + 32 * (j / 2));
    let shift = vdupq_n_s8(-4 * (j % 2) as i8);
    unrolled!([0, 1], |i| vreinterpretq_s8_u8(vandq_u8(vshlq_u8(vld1q_u8(p.add(16 * i)), shift), vdupq_n_u8(0x0F))))
}

/// Decode for Q4_K: per row, eight sub-block sums folded into two vectors and weighted by the
/// scales; the min term from the token's 32-value activation sums (pairs of its 16 sums).
#[inline(always)]
unsafe fn rows8_q4_k<const DOT: bool>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    assert!(x.qs.len() >= nb * 256 && x.d.len() >= nb && x.sums.len() >= nb * 16, "activation row too short");
    let mut acc = [vdupq_n_f32(0.0); 2];
    for ib in 0..nb {
        let at = 144 * ib;
        let xq = x.qs.as_ptr().add(256 * ib);
        let xv: [int8x16_t; 16] =
            unrolled!([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], |i| vld1q_s8(xq.add(16 * i)));
        let bs = x.sums.as_ptr().add(16 * ib);
        let pairs = [vpaddlq_s16(vld1q_s16(bs)), vpaddlq_s16(vld1q_s16(bs.add(8)))];
        let mut sumi = [vdupq_n_s32(0); 8];
        let mut summ = [vdupq_n_s32(0); 8];
        for r in 0..8 {
            let b = rows[r].add(at);
            let (sc, mn) = scales_mins_k4(b.add(4));
            let (sc, mn) = (widen_bytes(sc), widen_bytes(mn));
            let dots: [int32x4_t; 8] = unrolled!([0, 1, 2, 3, 4, 5, 6, 7], |j| {
                let [w0, w1] = q4_k_levels(b, j);
                dot32::<DOT>(w0, w1, xv[2 * j], xv[2 * j + 1], false)
            });
            let sub = fold8(&dots);
            sumi[r] = vmlaq_s32(vmulq_s32(sub[0], sc[0]), sub[1], sc[1]);
            summ[r] = vmlaq_s32(vmulq_s32(pairs[0], mn[0]), pairs[1], mn[1]);
        }
        let (si, sm) = (fold8(&sumi), fold8(&summ));
        let (dw, dmin) = f16_pairs8(rows, at);
        let dx = vdupq_n_f32(*x.d.get_unchecked(ib));
        for h in 0..2 {
            let v = vsubq_f32(vmulq_f32(dw[h], vcvtq_f32_s32(si[h])), vmulq_f32(dmin[h], vcvtq_f32_s32(sm[h])));
            acc[h] = vaddq_f32(acc[h], vmulq_f32(dx, v));
        }
    }
    let mut out = [0.0f32; 8];
    vst1q_f32(out.as_mut_ptr(), acc[0]);
    vst1q_f32(out.as_mut_ptr().add(4), acc[1]);
    out
}

/// Prefill for Q4_K. Per sub-block the four rows' levels are unpacked once and used for every
/// token; each four-token group's sum is scaled into its accumulator right away.
#[inline(always)]
unsafe fn tile_q4_k<const DOT: bool, const N: usize>(
    rows: &[*const u8; 4],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; 4] {
    xs.iter().for_each(|x| x.assert_q8_k_blocks(nb, true));
    let mut acc = [[[vdupq_n_f32(0.0); 2]; N]; 4];
    for ib in 0..nb {
        let b: [*const u8; 4] = unrolled!([0, 1, 2, 3], |r| rows[r].add(144 * ib));
        let packed: [([u32; 2], [u32; 2]); 4] = unrolled!([0, 1, 2, 3], |r| scales_mins_k4(b[r].add(4)));
        let scale = |r: usize, j: usize| ((packed[r].0[j / 4] >> (8 * (j % 4))) & 0xFF) as i32;
        let min = |r: usize, j: usize| ((packed[r].1[j / 4] >> (8 * (j % 4))) & 0xFF) as i32;
        let mut si = [[[vdupq_n_s32(0); 2]; N]; 4];
        for j in 0..8 {
            let w: [[int8x16_t; 2]; 4] = unrolled!([0, 1, 2, 3], |r| q4_k_levels(b[r], j));
            for (o, x) in xs.iter().enumerate() {
                for th in 0..2 {
                    let xq = x.qs.as_ptr().add(2048 * ib + 256 * j + 16 * th);
                    let xv: [[int8x16_t; 4]; 2] =
                        unrolled!([0, 1], |h| unrolled!([0, 1, 2, 3], |g| vld1q_s8(xq.add(32 * (4 * h + g)))));
                    for r in 0..4 {
                        let t = dot_lanes::<DOT>(vdupq_n_s32(0), &xv[0], w[r][0], false);
                        let t = dot_lanes::<DOT>(t, &xv[1], w[r][1], false);
                        si[r][o][th] = vmlaq_n_s32(si[r][o][th], t, scale(r, j));
                    }
                }
            }
        }
        for (o, x) in xs.iter().enumerate() {
            for th in 0..2 {
                // Sub-block j's activation sums of tokens 4 th..4 th + 4: pairs of 16-value sums.
                let bs = x.bsums.as_ptr().add(128 * ib + 8 * th);
                let mut sm = [vdupq_n_s32(0); 4];
                for j in 0..8 {
                    let pair = vpaddlq_s16(vld1q_s16(bs.add(16 * j)));
                    for (r, m) in sm.iter_mut().enumerate() {
                        *m = vmlaq_n_s32(*m, pair, min(r, j));
                    }
                }
                let dx = vld1q_f32(x.d.as_ptr().add(8 * ib + 4 * th));
                for r in 0..4 {
                    let (dw, dmin) = (vdupq_n_f32(f16_ptr(b[r])), vdupq_n_f32(f16_ptr(b[r].add(2))));
                    let v =
                        vsubq_f32(vmulq_f32(dw, vcvtq_f32_s32(si[r][o][th])), vmulq_f32(dmin, vcvtq_f32_s32(sm[r])));
                    acc[r][o][th] = vaddq_f32(acc[r][o][th], vmulq_f32(dx, v));
                }
            }
        }
    }
    store_tile(&acc)
}

/// The 32 unsigned levels (0..64) of quarter `q` of half `h` of the Q6_K super-block at `b`
/// (values `128 h + 32 q..`, 16-value groups `8 h + 2 q` and `8 h + 2 q + 1`): low nibbles of
/// `ql[64 h + 32 (q % 2)..]` for q < 2, high ones otherwise, and bits `2 q..2 q + 2` of
/// `qh[32 h..]` on top. Shifts by registers rather than branches on `q`, as in
/// [`q4_k_levels`].
#[inline(always)]
unsafe fn q6_k_levels(b: *const u8, h: usize, q: usize) -> [uint8x16_t; 2] {
    let ql = b.add(64 * h + 32 * (q % 2));
    let qh = b.add(128 + 32 * h);
    let (low_shift, high_shift) = (vdupq_n_s8(-4 * (q / 2) as i8), vdupq_n_s8(-2 * q as i8));
    unrolled!([0, 1], |i| {
        let low = vandq_u8(vshlq_u8(vld1q_u8(ql.add(16 * i)), low_shift), vdupq_n_u8(0x0F));
        let high = vandq_u8(vshlq_u8(vld1q_u8(qh.add(16 * i)), high_shift), vdupq_n_u8(3));
        vorrq_u8(low, vshlq_n_u8::<4>(high))
    })
}

/// The 16 i8 scales of the Q6_K super-block at `b`, as four vectors of four i32 lanes.
#[inline(always)]
unsafe fn q6_k_scales(b: *const u8) -> [int32x4_t; 4] {
    let s = vld1q_s8(b.add(192) as *const i8);
    let (lo, hi) = (vmovl_s8(vget_low_s8(s)), vmovl_high_s8(s));
    [vmovl_s16(vget_low_s16(lo)), vmovl_high_s16(lo), vmovl_s16(vget_low_s16(hi)), vmovl_high_s16(hi)]
}

/// Decode for Q6_K: levels unsigned, per row sixteen group sums folded into four vectors, the
/// offset taken off as `32 * bsum` per group before the scales (exact integers).
#[inline(always)]
unsafe fn rows8_q6_k<const DOT: bool>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    assert!(x.qs.len() >= nb * 256 && x.d.len() >= nb && x.sums.len() >= nb * 16, "activation row too short");
    let mut acc = [vdupq_n_f32(0.0); 2];
    for ib in 0..nb {
        let at = 210 * ib;
        let xq = x.qs.as_ptr().add(256 * ib);
        let xv: [int8x16_t; 16] =
            unrolled!([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], |i| vld1q_s8(xq.add(16 * i)));
        let bs = x.sums.as_ptr().add(16 * ib);
        let (b0, b1) = (vld1q_s16(bs), vld1q_s16(bs.add(8)));
        let offsets = [
            vshlq_n_s32::<5>(vmovl_s16(vget_low_s16(b0))),
            vshlq_n_s32::<5>(vmovl_high_s16(b0)),
            vshlq_n_s32::<5>(vmovl_s16(vget_low_s16(b1))),
            vshlq_n_s32::<5>(vmovl_high_s16(b1)),
        ];
        let mut sumi = [vdupq_n_s32(0); 8];
        for r in 0..8 {
            let b = rows[r].add(at);
            let mut dots = [vdupq_n_s32(0); 16];
            for h in 0..2 {
                for q in 0..4 {
                    let lv = q6_k_levels(b, h, q);
                    for i in 0..2 {
                        let g = 8 * h + 2 * q + i;
                        dots[g] = dot16::<DOT>(vreinterpretq_s8_u8(lv[i]), xv[g]);
                    }
                }
            }
            let lo = fold8(&unrolled!([0, 1, 2, 3, 4, 5, 6, 7], |g| dots[g]));
            let hi = fold8(&unrolled!([0, 1, 2, 3, 4, 5, 6, 7], |g| dots[8 + g]));
            let groups = [lo[0], lo[1], hi[0], hi[1]];
            let sc = q6_k_scales(b);
            let mut s = vmulq_s32(vsubq_s32(groups[0], offsets[0]), sc[0]);
            for k in 1..4 {
                s = vmlaq_s32(s, vsubq_s32(groups[k], offsets[k]), sc[k]);
            }
            sumi[r] = s;
        }
        let si = fold8(&sumi);
        let dw = f16x8(rows, at + 208);
        let dx = vdupq_n_f32(*x.d.get_unchecked(ib));
        for h in 0..2 {
            acc[h] = vaddq_f32(acc[h], vmulq_f32(vmulq_f32(dx, dw[h]), vcvtq_f32_s32(si[h])));
        }
    }
    let mut out = [0.0f32; 8];
    vst1q_f32(out.as_mut_ptr(), acc[0]);
    vst1q_f32(out.as_mut_ptr().add(4), acc[1]);
    out
}

/// Prefill for Q6_K, with signed levels (-32..32: one subtraction per unpacked register, cheaper
/// here than an offset per row and token).
#[inline(always)]
unsafe fn tile_q6_k<const DOT: bool, const N: usize>(
    rows: &[*const u8; 4],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; 4] {
    xs.iter().for_each(|x| x.assert_q8_k_blocks(nb, false));
    let mut acc = [[[vdupq_n_f32(0.0); 2]; N]; 4];
    for ib in 0..nb {
        let b: [*const u8; 4] = unrolled!([0, 1, 2, 3], |r| rows[r].add(210 * ib));
        let scale = |r: usize, g: usize| *b[r].add(192 + g) as i8 as i32;
        let mut si = [[[vdupq_n_s32(0); 2]; N]; 4];
        for h in 0..2 {
            for q in 0..4 {
                let w: [[int8x16_t; 2]; 4] = unrolled!([0, 1, 2, 3], |r| {
                    let [l0, l1] = q6_k_levels(b[r], h, q);
                    [
                        vsubq_s8(vreinterpretq_s8_u8(l0), vdupq_n_s8(32)),
                        vsubq_s8(vreinterpretq_s8_u8(l1), vdupq_n_s8(32)),
                    ]
                });
                for (o, x) in xs.iter().enumerate() {
                    for th in 0..2 {
                        let xq = x.qs.as_ptr().add(2048 * ib + 8 * (128 * h + 32 * q) + 16 * th);
                        let xv: [[int8x16_t; 4]; 2] =
                            unrolled!([0, 1], |i| unrolled!([0, 1, 2, 3], |g| vld1q_s8(xq.add(32 * (4 * i + g)))));
                        for r in 0..4 {
                            for i in 0..2 {
                                let t = dot_lanes::<DOT>(vdupq_n_s32(0), &xv[i], w[r][i], false);
                                si[r][o][th] = vmlaq_n_s32(si[r][o][th], t, scale(r, 8 * h + 2 * q + i));
                            }
                        }
                    }
                }
            }
        }
        for (o, x) in xs.iter().enumerate() {
            for th in 0..2 {
                let dx = vld1q_f32(x.d.as_ptr().add(8 * ib + 4 * th));
                for r in 0..4 {
                    let dw = vdupq_n_f32(f16_ptr(b[r].add(208)));
                    acc[r][o][th] = vaddq_f32(acc[r][o][th], vmulq_f32(vmulq_f32(dx, dw), vcvtq_f32_s32(si[r][o][th])));
                }
            }
        }
    }
    store_tile(&acc)
}

#[cfg(test)]
mod tests {
    use gguf::GgmlType;

    use super::super::super::float::f16_to_f32;
    use super::super::super::k_quants::scale_min_k4;
    use super::super::super::qdot::{dot_portable, ActBuf, ActKind};
    use super::super::{Kernel, QDot, TileKernel, Tiles};
    use super::*;

    #[test]
    fn f16_widening_matches_the_scalar_one_on_every_pattern() {
        for first in (0..=u16::MAX).step_by(4) {
            let h: [u16; 4] = std::array::from_fn(|i| first + i as u16);
            let mut got = [0f32; 4];
            // SAFETY: NEON is baseline on aarch64; `got` has room for four lanes.
            unsafe { vst1q_f32(got.as_mut_ptr(), f16x4_to_f32(vld1_u16(h.as_ptr()))) };
            for i in 0..4 {
                assert_eq!(got[i].to_bits(), f16_to_f32(h[i]).to_bits(), "f16 {:#06x}", h[i]);
            }
        }
    }

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
        /// A quant in -127..=127, the range of both activation quantizers.
        fn quant(&mut self) -> i8 {
            ((self.next() % 255) as i32 - 127) as i8
        }
    }

    #[test]
    fn k4_scale_unpacking_matches_scale_min_k4() {
        let mut rng = Rng(0x5EED);
        for _ in 0..2000 {
            let q: [u8; 12] = std::array::from_fn(|_| rng.next() as u8);
            // SAFETY: `q` holds the 12 bytes read.
            let (scales, mins) = unsafe { scales_mins_k4(q.as_ptr()) };
            for j in 0..8 {
                let byte = |w: [u32; 2]| (w[j / 4] >> (8 * (j % 4))) as u8;
                assert_eq!((byte(scales), byte(mins)), scale_min_k4(j, &q), "{q:?} j={j}");
            }
        }
    }

    const TYPES: [GgmlType; 6] =
        [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K];

    /// Blocks of `dtype` from random bytes (any bytes are valid levels and packed scales), or
    /// all `fill`, with finite f16 scales written over the scale fields.
    fn weights(dtype: GgmlType, n_rows: usize, nb: usize, rng: &mut Rng, fill: Option<u8>) -> Vec<u8> {
        let bb = dtype.block_bytes();
        let mut w: Vec<u8> = (0..n_rows * nb * bb).map(|_| fill.unwrap_or(rng.next() as u8)).collect();
        for b in w.chunks_exact_mut(bb) {
            let s = (0.002 + 0.02 * rng.uniform()) * if rng.next().is_multiple_of(2) { 1.0 } else { -1.0 };
            let mut put = |at: usize, v: f32| b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            match dtype {
                GgmlType::Q4_1 => {
                    put(0, s.abs());
                    put(2, -8.0 * s.abs() * rng.uniform());
                }
                GgmlType::Q4_K => {
                    put(0, 0.1 * s.abs());
                    put(2, 0.05 * s.abs());
                }
                GgmlType::Q6_K => put(208, 0.01 * s),
                _ => put(0, s),
            }
        }
        w
    }

    /// `n_tok` activation rows of `k` values quantized as `kind`: random quants (or all
    /// `fill`), random scales, exact sums; octets built.
    fn activations(kind: ActKind, n_tok: usize, k: usize, rng: &mut Rng, fill: Option<i8>) -> ActBuf {
        let nb = k / kind.block_elems();
        let qs: Vec<i8> = (0..n_tok * k).map(|_| fill.unwrap_or_else(|| rng.quant())).collect();
        let d = (0..n_tok * nb).map(|_| 0.001 + 0.01 * rng.uniform()).collect();
        let group = kind.block_elems() / kind.sums_per_block();
        let sums = qs.chunks_exact(group).map(|c| c.iter().map(|&q| q as i16).sum()).collect();
        let mut act = ActBuf { d, qs, sums, ..ActBuf::default() };
        act.build_octets(kind, n_tok, k);
        act
    }

    /// Every output of the decode kernel and the prefill tiles against `neon.rs`'s single-row
    /// kernel (the same bits), and that one against the portable kernel and a dequantized f64
    /// product (within float reordering of the terms).
    fn check(dtype: GgmlType, build: &str, tiles: Tiles, w: &[u8], n_out: usize, act: &ActBuf, n_tok: usize) {
        let kind = ActKind::for_weights(dtype).unwrap();
        let be = kind.block_elems();
        let k = act.qs.len() / n_tok;
        let nb = k / be;
        let row_bytes = nb * dtype.block_bytes();
        let single = QDot::new(dtype, Kernel::Neon);
        let mut deq = vec![0f32; n_out * k];
        super::super::super::dequantize(dtype, w, &mut deq).unwrap();
        let row = |o: usize| &w[o * row_bytes..(o + 1) * row_bytes];
        let mut want = vec![vec![0f32; n_out]; n_tok];
        for (t, want_t) in want.iter_mut().enumerate() {
            for (o, want_to) in want_t.iter_mut().enumerate() {
                let x = act.row(kind, t, k);
                let got = single.dot(row(o), x);
                let portable = dot_portable(dtype, row(o), x);
                let terms: Vec<f64> =
                    (0..k).map(|i| deq[o * k + i] as f64 * x.d[i / be] as f64 * x.qs[i] as f64).collect();
                let exact: f64 = terms.iter().sum();
                let bound = 1e-5 * terms.iter().map(|v| v.abs()).sum::<f64>() + 1e-30;
                assert!(((got - portable) as f64).abs() <= bound, "{dtype} t={t} o={o}: {got} vs portable {portable}");
                assert!((got as f64 - exact).abs() <= bound, "{dtype} t={t} o={o}: {got} vs dequantized {exact}");
                *want_to = got;
            }
        }
        let row_at = |o: usize| w[o.min(n_out - 1) * row_bytes..].as_ptr();
        for o0 in (0..n_out).step_by(8) {
            let rows = std::array::from_fn(|i| row_at(o0 + i));
            for (t, want_t) in want.iter().enumerate() {
                // SAFETY: every pointer starts a row of `nb` blocks of `dtype` inside `w`.
                let got = unsafe { tiles.rows8(&rows, nb, act.row(kind, t, k)) };
                for (i, v) in got.iter().enumerate().take(n_out - o0) {
                    let at = format!("{dtype} {build} rows8 nb={nb} t={t} o={}", o0 + i);
                    assert_eq!(v.to_bits(), want_t[o0 + i].to_bits(), "{at}: {v} vs {}", want_t[o0 + i]);
                }
            }
        }
        let n_octets = n_tok.div_ceil(8);
        for oct in (0..n_octets).step_by(2) {
            let pair = [act.octet(kind, oct, k), act.octet(kind, (oct + 1).min(n_octets - 1), k)];
            let xs = &pair[..(n_octets - oct).min(2)];
            for o0 in (0..n_out).step_by(4) {
                let rows = std::array::from_fn(|i| row_at(o0 + i));
                // SAFETY: as above; `build_octets` laid out the tokens.
                let got = unsafe { tiles.tile_octets(&rows, nb, xs) };
                for (r, values) in got.iter().enumerate().take(n_out - o0) {
                    for (i, v) in values.as_flattened().iter().enumerate().take((n_tok - 8 * oct).min(16)) {
                        let (t, o) = (8 * oct + i, o0 + r);
                        let at =
                            format!("{dtype} {build} tile of {} octets nb={nb} n_tok={n_tok} t={t} o={o}", xs.len());
                        assert_eq!(v.to_bits(), want[t][o].to_bits(), "{at}: {v} vs {}", want[t][o]);
                    }
                }
            }
        }
    }

    /// The builds this CPU can run: widening multiply-accumulates always, `sdot` where present.
    fn builds(dtype: GgmlType) -> Vec<(&'static str, Tiles)> {
        let tiles = |sdot: bool| {
            let (rows8, two, one) = kernels_built(dtype, sdot).unwrap();
            Tiles { rows8, rows8_last: None, tile: TileKernel(two, one), quad: None }
        };
        let mut out = vec![("smull", tiles(false))];
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            out.push(("sdot", tiles(true)));
        }
        out
    }

    #[test]
    fn tiles_exist_for_the_six_types_only() {
        for dtype in gguf::ALL_TYPES {
            assert_eq!(Tiles::new(dtype, Kernel::Neon).is_some(), TYPES.contains(&dtype), "{dtype}");
            assert!(Tiles::new(dtype, Kernel::Portable).is_none(), "{dtype}");
        }
    }

    /// Odd row counts (partial groups of eight and four rows), token counts with partial and
    /// lone last octets, one to seven blocks per row, random levels and quants.
    #[test]
    fn tiles_give_the_single_row_bits_on_random_blocks() {
        let mut rng = Rng(0x0DDC0DE);
        println!("dotprod: {}", std::arch::is_aarch64_feature_detected!("dotprod"));
        for dtype in TYPES {
            let kind = ActKind::for_weights(dtype).unwrap();
            for (n_out, nb, n_tok) in
                [(1, 1, 1), (5, 2, 3), (13, 3, 9), (8, 1, 16), (11, 2, 21), (3, 7, 2), (17, 1, 24)]
            {
                let w = weights(dtype, n_out, nb, &mut rng, None);
                let act = activations(kind, n_tok, nb * kind.block_elems(), &mut rng, None);
                for (build, tiles) in builds(dtype) {
                    check(dtype, build, tiles, &w, n_out, &act, n_tok);
                }
            }
        }
    }

    /// The largest levels (all bits set; Q8_0 also -128, and Q6_K's level 0, which is -32)
    /// against quants all 127 or all -127: the i16 partial sums of the widening build at their
    /// bounds.
    #[test]
    fn tiles_give_the_single_row_bits_at_the_integer_extremes() {
        let mut rng = Rng(0xE7E7);
        for dtype in TYPES {
            let kind = ActKind::for_weights(dtype).unwrap();
            for fill in [0xFF, 0x80, 0x00] {
                for q in [127, -127] {
                    let (n_out, nb, n_tok) = (9, 2, 11);
                    let w = weights(dtype, n_out, nb, &mut rng, Some(fill));
                    let act = activations(kind, n_tok, nb * kind.block_elems(), &mut rng, Some(q));
                    for (build, tiles) in builds(dtype) {
                        check(dtype, build, tiles, &w, n_out, &act, n_tok);
                    }
                }
            }
        }
    }
}
