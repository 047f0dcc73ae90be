//! AVX-512 (F, BW, VL, VNNI) decode kernels: eight weight rows against one token for Q4_0,
//! Q4_1, Q8_0, Q4_K and Q6_K, the types of the common Q4_0 / Q4_1 / Q8_0 / Q4_K_M files.
//!
//! The integer work uses 512-bit registers and the VNNI dot products: `vpdpbusd` (unsigned
//! bytes times signed bytes, four products added into an i32 lane, no saturation) for the
//! 32-value types, `vpdpwssd` (the `madd` + `add` of the AVX2 k-quant kernels in one) for
//! Q4_K and Q6_K. `vpdpbusd` wants one unsigned operand: Q4_0 nibbles are unsigned already
//! (the `8 * sum(x)` offset comes off the exact block sum, as in AVX2; Q4_1's min term is
//! AVX2's), and Q8_0 weights are
//! made unsigned by flipping their sign bit (`w + 128`), with `128 * sum(x)` taken off the
//! same way (AVX-512 has no `vpsignb` for the AVX2 `|w|`, `sign(x, w)` trick).
//!
//! Bits: every (row, block) pair's integer sum is exact, and the floats are then the AVX2
//! kernels' own operations in the same order (`avx2_tiles::add_block`, the same FMAs for the
//! k-quants), so each output equals the AVX2 decode kernel's and therefore the AVX2 prefill
//! tiles' bit for bit. That is what lets `Kernel::Avx512` use the AVX2 prefill tiles and
//! single-row dots unchanged.

use std::arch::x86_64::*;

use super::super::qdot::ActRow;
use super::avx2::pair_broadcast_index;
use super::avx2_ktiles::{f16_lanes, group_sums, q4_k_heads8, within_lanes};
use super::avx2_tiles::{add_block, block_bytes, f16_firsts8, prefetch_for, prefetch_next_rows, Q4_0, Q4_1, Q8_0};

/// True when the CPU has everything these kernels (and the AVX2 ones they fall back to) use.
pub(in crate::quant) fn detected() -> bool {
    super::avx2::detected()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// Eight vectors of four blocks' i32 partial sums (128-bit lane `k` = block `k`, four lanes
/// each) to four vectors of eight row sums, one per block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fold_rows_by_lane(v: &[__m512i; 8]) -> [__m512i; 2] {
    let pair = |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    let quad = |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    // Per 128-bit lane k: [r0 r1 r2 r3] and [r4 r5 r6 r7] of the lane's four partial sums.
    let low = quad(pair(v[0], v[1]), pair(v[2], v[3]));
    let high = quad(pair(v[4], v[5]), pair(v[6], v[7]));
    // [lane 0 rows 0..8 | lane 1 rows 0..8] and the same for lanes 2 and 3.
    [
        _mm512_permutex2var_epi64(low, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), high),
        _mm512_permutex2var_epi64(low, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), high),
    ]
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn low_half(v: __m512i) -> __m256i {
    _mm512_castsi512_si256(v)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn high_half(v: __m512i) -> __m256i {
    _mm512_extracti64x4_epi64::<1>(v)
}

/// `sum(u * x)` (u the unsigned nibble levels) of eight Q4_0 or Q4_1 rows with `N` (1..=4)
/// consecutive blocks at byte `at`, against the activations of blocks `ib..ib + N`: one vector
/// of eight row sums per block (those past `N` are zero). `N` is a constant so that the full
/// steps carry no per-lane test. Each row's blocks go one per 128-bit lane, low nibbles (values
/// 0..16) against `x_lo`, high ones against `x_hi`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn nibble_sums<const T: u8, const N: usize>(
    rows: &[*const u8; 8],
    at: usize,
    x: &ActRow<'_>,
    ib: usize,
) -> [__m256i; 4] {
    let xq = x.qs.as_ptr().add(32 * ib);
    let n = N;
    let (x0, x1) = if N == 4 {
        (_mm512_loadu_si512(xq as *const _), _mm512_loadu_si512(xq.add(64) as *const _))
    } else {
        // Masked-off bytes are neither read nor able to fault: the row may end at block ib + n.
        let bytes = |from: usize| -> u64 {
            let len = (32 * n).saturating_sub(from).min(64);
            if len == 64 {
                u64::MAX
            } else {
                (1u64 << len) - 1
            }
        };
        (_mm512_maskz_loadu_epi8(bytes(0), xq), _mm512_maskz_loadu_epi8(bytes(64), xq.add(64)))
    };
    // Blocks' first halves in lanes 0..4, then their second halves.
    let x_lo = _mm512_shuffle_i64x2::<0b10_00_10_00>(x0, x1);
    let x_hi = _mm512_shuffle_i64x2::<0b11_01_11_01>(x0, x1);
    let m4 = _mm512_set1_epi8(0x0F);
    let bb = block_bytes(T);
    let quants = if T == Q4_1 { 4 } else { 2 };
    // Loops, not `array::from_fn`: its closure was compiled out of line, with the vectors
    // passed through memory (the Q4_0 kernel at half the AVX2 one's speed).
    let mut v = [_mm512_setzero_si512(); 8];
    for (r, v) in v.iter_mut().enumerate() {
        let lane = |j: usize| {
            if j < n {
                _mm_loadu_si128(rows[r].add(at + j * bb + quants) as *const __m128i)
            } else {
                _mm_setzero_si128()
            }
        };
        let q01 = _mm256_set_m128i(lane(1), lane(0));
        let q23 = _mm256_set_m128i(lane(3), lane(2));
        let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q01), q23);
        let lo = _mm512_and_si512(q, m4);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
        *v = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x_lo), hi, x_hi);
    }
    let [b01, b23] = fold_rows_by_lane(&v);
    [low_half(b01), high_half(b01), low_half(b23), high_half(b23)]
}

/// `sum(w * x)` of eight Q8_0 rows with the two blocks at `at` and `at + 34` (activations of
/// blocks `ib`, `ib + 1`), one vector of eight row sums per block: `(w + 128)` as unsigned
/// bytes against `x`, less `128 * sum(x)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_sums2(rows: &[*const u8; 8], at: usize, x: &ActRow<'_>, ib: usize) -> [__m256i; 2] {
    let xq = _mm512_loadu_si512(x.qs.as_ptr().add(32 * ib) as *const _);
    let flip = _mm512_set1_epi8(-128);
    let bb = block_bytes(Q8_0);
    let mut v = [_mm512_setzero_si512(); 8];
    for (r, v) in v.iter_mut().enumerate() {
        let first = _mm256_loadu_si256(rows[r].add(at + 2) as *const __m256i);
        let second = _mm256_loadu_si256(rows[r].add(at + bb + 2) as *const __m256i);
        let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second);
        *v = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(w, flip), xq);
    }
    // Lane k of the fold holds half of block k / 2: add the two halves of each block.
    let [b01, b23] = fold_rows_by_lane(&v);
    let first = _mm256_add_epi32(low_half(b01), high_half(b01));
    let second = _mm256_add_epi32(low_half(b23), high_half(b23));
    let offset = |i: usize| _mm256_set1_epi32(128 * *x.sums.get_unchecked(i) as i32);
    [_mm256_sub_epi32(first, offset(ib)), _mm256_sub_epi32(second, offset(ib + 1))]
}

/// As [`q8_0_sums2`] for one block (the last of an odd count), the second block's lanes zero.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_sums1(rows: &[*const u8; 8], at: usize, x: &ActRow<'_>, ib: usize) -> __m256i {
    let xq = _mm512_zextsi256_si512(_mm256_loadu_si256(x.qs.as_ptr().add(32 * ib) as *const __m256i));
    let flip = _mm512_set1_epi8(-128);
    let mut v = [_mm512_setzero_si512(); 8];
    for (r, v) in v.iter_mut().enumerate() {
        let w = _mm512_castsi256_si512(_mm256_loadu_si256(rows[r].add(at + 2) as *const __m256i));
        // The upper half of `xq` is zero, so whatever the upper half of `w` holds adds nothing.
        *v = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(w, flip), xq);
    }
    let [b01, _] = fold_rows_by_lane(&v);
    let s = _mm256_add_epi32(low_half(b01), high_half(b01));
    _mm256_sub_epi32(s, _mm256_set1_epi32(128 * *x.sums.get_unchecked(ib) as i32))
}

/// Dot products of eight Q4_0, Q4_1 or Q8_0 rows (`rows[i]`, `nb` blocks each) with one Q8_0 row.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C must be available ([`detected`]); every `rows[i]`
/// must point at `nb` blocks of `T`; `x` must hold at least `nb` blocks (checked).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn rows8<const T: u8>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    assert!(T == Q4_0 || T == Q4_1 || T == Q8_0, "AVX-512 rows8 is for Q4_0, Q4_1 and Q8_0");
    assert!(x.qs.len() >= nb * 32 && x.d.len() >= nb && x.sums.len() >= nb, "activation row too short");
    let bb = block_bytes(T);
    let row_bytes = nb * bb;
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm256_setzero_ps();
    let mut ib = 0;
    if T == Q4_0 || T == Q4_1 {
        while ib < nb {
            let n = (nb - ib).min(4);
            let at = ib * bb;
            prefetch_next_rows::<_MM_HINT_T0>(rows, row_bytes, at, n * bb);
            let sums = match n {
                4 => nibble_sums::<T, 4>(rows, at, &x, ib),
                3 => nibble_sums::<T, 3>(rows, at, &x, ib),
                2 => nibble_sums::<T, 2>(rows, at, &x, ib),
                _ => nibble_sums::<T, 1>(rows, at, &x, ib),
            };
            for (j, &s) in sums.iter().enumerate().take(n) {
                add_block::<T>(s, rows, at + j * bb, &x, ib + j, &mut acc, &mut acc_m);
            }
            ib += n;
        }
    } else {
        while ib + 2 <= nb {
            let at = ib * bb;
            prefetch_for::<T>(rows, row_bytes, at, 2 * bb);
            let [first, second] = q8_0_sums2(rows, at, &x, ib);
            // The `128 * sum(x)` is already off; Q8_0 has no level offset in `add_block`.
            add_block::<T>(first, rows, at, &x, ib, &mut acc, &mut acc_m);
            add_block::<T>(second, rows, at + bb, &x, ib + 1, &mut acc, &mut acc_m);
            ib += 2;
        }
        if ib < nb {
            let at = ib * bb;
            prefetch_for::<T>(rows, row_bytes, at, bb);
            add_block::<T>(q8_0_sums1(rows, at, &x, ib), rows, at, &x, ib, &mut acc, &mut acc_m);
        }
    }
    if T == Q4_1 {
        acc = _mm256_add_ps(acc, acc_m);
    }
    let mut out = [0.0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), acc);
    out
}

/// Four vectors of two rows' eight i32 lanes each (`[row 2k | row 2k+1]`) to the eight row
/// sums in order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fold_row_pairs(p: &[__m512i; 4]) -> __m256i {
    let pair = |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    let quad = |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    // 128-bit lanes 0 and 1: partial sums of rows [0 2 4 6], lanes 2 and 3: of rows [1 3 5 7].
    let u = quad(pair(p[0], p[1]), pair(p[2], p[3]));
    let v = _mm512_add_epi32(u, _mm512_shuffle_i64x2::<0b10_11_00_01>(u, u));
    let even = _mm512_castsi512_si128(v);
    let odd = _mm512_extracti32x4_epi32::<2>(v);
    _mm256_set_m128i(_mm_unpackhi_epi32(even, odd), _mm_unpacklo_epi32(even, odd))
}

/// Two 256-bit halves as one register.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Q4_K: 144-byte super-blocks (as `avx2_ktiles::Q4_K`).
pub(in crate::quant) const Q4_K: u8 = 0;
/// Q6_K: 210-byte super-blocks.
pub(in crate::quant) const Q6_K: u8 = 1;

const fn k_block_bytes(t: u8) -> usize {
    match t {
        Q4_K => 144,
        _ => 210,
    }
}

/// One Q4_K super-block of two rows (`a` in the low half, `b` in the high half) with one
/// token, so that each half's eight i32 lanes sum to that row's `sum_j scale_j * dot(levels_j,
/// x_j)`. `scales` holds, in every 128-bit lane of a half, that row's eight scales as bytes 0..8
/// (from [`q4_k_heads8`], see [`rows8_k`]).
///
/// Not `PACKED`: the AVX2 kernel's `maddubs` of levels and activations and `madd` with the
/// sub-block scales (here one `vpdpwssd`). `PACKED`: one multiply fewer per 32 bytes, each
/// sub-block's levels against the activations by `vpdpbusd` (four products to an i32, at most
/// `4 * 15 * 128` in size, so they pack to i16 without saturating), the two sub-blocks of a
/// 32-byte chunk packed into one register and multiplied by their scales in one `vpdpwssd`. The
/// same integers either way, so the same bits.
///
/// Measured, packed against not (fortieth session, `quant_speed`, Q4_K 768 x 2048 in L2 and 768
/// x 65536 from RAM, one thread): Zen 4 24.0-24.3 -> 26.8-28.2 GB/s and 19.2-20.0 -> 22.0-23.3;
/// the H200 host's Xeon 14.3-14.4 -> 13.1-13.5 and 11.2-12.5 -> 13.3-15.0, on every core at once
/// 9.0-15.0 -> 10.4-19.1 (in L2). In the split's decode there, in one process (`ab-steps.sh`):
/// B/A 1.0016 against the control's 1.0010, no difference.
///
/// # Safety
/// The features of [`rows8_k`] must be available; `a` and `b` must start whole Q4_K
/// super-blocks and `xq` their 256 activation quants.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_k_pair<const PACKED: bool>(a: *const u8, b: *const u8, xq: *const i8, scales: __m512i) -> __m512i {
    let m4 = _mm512_set1_epi8(0x0F);
    // Byte `j` zero-extended to every i16 lane (0x80 zeroes the high byte).
    let scale = |j: i16| _mm512_shuffle_epi8(scales, _mm512_set1_epi16(j | 0x80 << 8));
    // Words 0..4 of every 128-bit lane: scale byte `j`, words 4..8: byte `j + 1`, zero-extended.
    let scale_pair = |j: u8| {
        let w = |b: u8| i16::from_le_bytes([b, 0x80]);
        let (lo, hi) = (w(j), w(j + 1));
        _mm512_shuffle_epi8(scales, _mm512_broadcast_i32x4(_mm_setr_epi16(lo, lo, lo, lo, hi, hi, hi, hi)))
    };
    let mut sumi = _mm512_setzero_si512();
    for c in 0..4 {
        let q = join(
            _mm256_loadu_si256(a.add(16 + 32 * c) as *const __m256i),
            _mm256_loadu_si256(b.add(16 + 32 * c) as *const __m256i),
        );
        let lo = _mm512_and_si512(q, m4);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
        let x_lo = _mm512_broadcast_i64x4(_mm256_loadu_si256(xq.add(64 * c) as *const __m256i));
        let x_hi = _mm512_broadcast_i64x4(_mm256_loadu_si256(xq.add(64 * c + 32) as *const __m256i));
        if PACKED {
            let t_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x_lo);
            let t_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, x_hi);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_packs_epi32(t_lo, t_hi), scale_pair(2 * c as u8));
        } else {
            let (s_lo, s_hi) = (scale(2 * c as i16), scale(2 * c as i16 + 1));
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(lo, x_lo), s_lo);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(hi, x_hi), s_hi);
        }
    }
    sumi
}

/// One Q6_K super-block of two rows with one token, as `avx2_ktiles`'s `q6_k_block`: levels
/// taken unsigned (0..64), `32 * sum(scale * bsum)` off the start value. Not `PACKED`: each 32
/// values take `maddubs` and `vpdpwssd` with their two sixteen-value sub-blocks' scales.
/// `PACKED`: one multiply fewer per 64 values, as [`q4_k_pair`]'s: each 32 values' levels
/// against the activations by `vpdpbusd` (four products, at most `4 * 63 * 128` in size: they
/// pack to i16 without saturating), two such groups' sums packed into one register and
/// multiplied by their sub-blocks' scales in one `vpdpwssd`. The same integers either way, so
/// the same bits.
///
/// # Safety
/// The features of [`rows8_k`] must be available; `a` and `b` must start whole Q6_K
/// super-blocks and `xq` their 256 activation quants.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6_k_pair<const PACKED: bool>(a: *const u8, b: *const u8, xq: *const i8, bsums: __m256i) -> __m512i {
    let (m4, m3) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
    let scales16_a = _mm256_cvtepi8_epi16(_mm_loadu_si128(a.add(192) as *const __m128i));
    let scales16_b = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
    // |scale| <= 128 and |bsum| <= 16 * 127: each madd lane and its times 32 fit i32.
    let start =
        |s: __m256i| _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(s, bsums), 5));
    let mut sumi = join(start(scales16_a), start(scales16_b));
    // For the packed sums of groups `g0` and `g1` (32 values each: the first 16 take the half's
    // scale 2 g, the next 16 scale 2 g + 1), the scales laid as `vpackssdw` lays the sums: in
    // each 128-bit lane `l`, words 0..4 scale 2 g0 + l, words 4..8 scale 2 g1 + l.
    let pair_index = |g0: usize, g1: usize| {
        let w = |j: usize| (2 * j as i16) | ((2 * j as i16 + 1) << 8);
        let (p, q, r, t) = (w(2 * g0), w(2 * g1), w(2 * g0 + 1), w(2 * g1 + 1));
        _mm512_broadcast_i64x4(_mm256_setr_epi16(p, p, p, p, q, q, q, q, r, r, r, r, t, t, t, t))
    };
    for half in 0..2 {
        let half_scales = if half == 0 {
            join(
                _mm256_permute2x128_si256(scales16_a, scales16_a, 0x00),
                _mm256_permute2x128_si256(scales16_b, scales16_b, 0x00),
            )
        } else {
            join(
                _mm256_permute2x128_si256(scales16_a, scales16_a, 0x11),
                _mm256_permute2x128_si256(scales16_b, scales16_b, 0x11),
            )
        };
        let load2 = |offset: usize| {
            join(
                _mm256_loadu_si256(a.add(offset) as *const __m256i),
                _mm256_loadu_si256(b.add(offset) as *const __m256i),
            )
        };
        let ql0 = load2(64 * half);
        let ql1 = load2(64 * half + 32);
        let qh = load2(128 + 32 * half);
        let groups = [
            _mm512_or_si512(_mm512_and_si512(ql0, m4), _mm512_slli_epi16::<4>(_mm512_and_si512(qh, m3))),
            _mm512_or_si512(
                _mm512_and_si512(ql1, m4),
                _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srli_epi16::<2>(qh), m3)),
            ),
            _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql0), m4),
                _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srli_epi16::<4>(qh), m3)),
            ),
            _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql1), m4),
                _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srli_epi16::<6>(qh), m3)),
            ),
        ];
        let x = |gi: usize| _mm512_broadcast_i64x4(_mm256_loadu_si256(xq.add(128 * half + 32 * gi) as *const __m256i));
        if PACKED {
            let dot = |gi: usize| _mm512_dpbusd_epi32(_mm512_setzero_si512(), groups[gi], x(gi));
            for (g0, g1) in [(0, 1), (2, 3)] {
                let s = _mm512_shuffle_epi8(half_scales, pair_index(g0, g1));
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_packs_epi32(dot(g0), dot(g1)), s);
            }
        } else {
            for (gi, lv) in groups.into_iter().enumerate() {
                // Lanes 0..8 of each row (values 0..16) take scale 2 gi of this half, 8..16 the next.
                let s = _mm512_shuffle_epi8(half_scales, _mm512_broadcast_i64x4(pair_broadcast_index(2 * gi)));
                sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(lv, x(gi)), s);
            }
        }
    }
    sumi
}

/// The exact `sum_j min_j * (bsum 2j + bsum 2j+1)` of eight Q4_K rows, row `r` in lane `r`,
/// from [`q4_k_heads8`]'s mins and the token's [`group_sums`]: two `j` per `madd`, no fold (as
/// in `avx2_ktiles::rows8`).
///
/// # Safety
/// The features of [`rows8_k`] must be available.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_k_min_sums8(mins_lo: __m256i, mins_hi: __m256i, groups: __m128i) -> __m256i {
    let mut g = [0i32; 4];
    _mm_storeu_si128(g.as_mut_ptr() as *mut __m128i, groups);
    [(mins_lo, 0u8), (mins_lo, 1), (mins_hi, 0), (mins_hi, 1)].into_iter().enumerate().fold(
        _mm256_setzero_si256(),
        |m, (q, (v, h))| {
            let pair = _mm256_shuffle_epi8(v, within_lanes([2 * h, 0x80, 2 * h + 1, 0x80]));
            _mm256_add_epi32(m, _mm256_madd_epi16(pair, _mm256_set1_epi32(g[q])))
        },
    )
}

/// Dot products of eight Q4_K or Q6_K rows (`rows[i]`, `nb` super-blocks each) with one Q8_K
/// row, two rows per 512-bit register.
///
/// The next group of eight rows is prefetched into L2, as in `avx2_ktiles::rows8` (see its
/// notes): on Zen 4 (2 vCPUs, one thread, `DISKFORMER_AVX512_DECODE=1`, `quant_speed`'s
/// 131072 x 2048 matmul, streaming read 22-26 GB/s) that took Q4_K from 8.8-10.5 to 11.6-14.7
/// GB/s and Q6_K from 8.9-9.3 to 17.0-18.7 GB/s against the L1 (`T0`) prefetch. Q4_K's
/// super-block heads (`d`, `dmin`, packed scales and mins) of the eight rows are then decoded
/// together, one row per lane, by `avx2_ktiles`'s [`q4_k_heads8`] instead of per row in scalar
/// code: one `vpermd` per row pair gives [`q4_k_pair`] its two rows' scales, the min term is
/// four `madd` with no fold, `d` and `dmin` need no gather. Same setting: Q4_K 11.9-13.6 ->
/// 18.2-19.7 GB/s (9 MiB that stay in L3: 13.0-21.0 -> 24.8-24.9 GB/s). Not measured on Intel.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C must be available ([`detected`]); every `rows[i]`
/// must point at `nb` super-blocks of `T`; `x` must hold at least `nb` blocks (checked).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn rows8_k<const T: u8>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    // SAFETY: the caller's promise, passed on.
    unsafe { rows8_k_with::<T, true, true>(rows, nb, x) }
}

/// [`rows8_k`] with the super-blocks by [`q4_k_pair`] and [`q6_k_pair`] not packed (two
/// multiplies per 32 values), for comparison (the A/B name `kmadd`). Same bits.
///
/// # Safety
/// As [`rows8_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn rows8_k_madd<const T: u8>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    // SAFETY: the caller's promise, passed on.
    unsafe { rows8_k_with::<T, true, false>(rows, nb, x) }
}

/// [`rows8_k_madd`] without the prefetch of the next eight rows. Same bits.
///
/// # Safety
/// As [`rows8_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn rows8_k_madd_last<const T: u8>(
    rows: &[*const u8; 8],
    nb: usize,
    x: ActRow<'_>,
) -> [f32; 8] {
    // SAFETY: the caller's promise, passed on.
    unsafe { rows8_k_with::<T, false, false>(rows, nb, x) }
}

/// [`rows8_k`] without the prefetch of the next eight rows (a claim's last group: those rows
/// are another thread's). Same bits.
///
/// # Safety
/// As [`rows8_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn rows8_k_last<const T: u8>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    // SAFETY: the caller's promise, passed on.
    unsafe { rows8_k_with::<T, false, true>(rows, nb, x) }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows8_k_with<const T: u8, const NEXT: bool, const PACKED: bool>(
    rows: &[*const u8; 8],
    nb: usize,
    x: ActRow<'_>,
) -> [f32; 8] {
    assert!(x.qs.len() >= nb * 256 && x.d.len() >= nb && x.sums.len() >= nb * 16, "activation row too short");
    let bb = k_block_bytes(T);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm256_setzero_ps();
    for ib in 0..nb {
        let at = ib * bb;
        if NEXT {
            prefetch_next_rows::<_MM_HINT_T1>(rows, nb * bb, at, bb);
        }
        let xq = x.qs.as_ptr().add(256 * ib);
        let dx = _mm256_set1_ps(*x.d.get_unchecked(ib));
        if T == Q4_K {
            let [d_dmin, scales_lo, scales_hi, mins_lo, mins_hi] = q4_k_heads8(rows, at);
            // Dwords 0..8: scales 0..4 of row r in dword r, 8..16: scales 4..8.
            let scales = join(scales_lo, scales_hi);
            let mut p = [_mm512_setzero_si512(); 4];
            for (k, p) in p.iter_mut().enumerate() {
                // Every 128-bit lane of half h gets [scales 0..4, scales 4..8] of row 2k + h.
                let (a, b) = (2 * k as i32, 2 * k as i32 + 1);
                let idx =
                    _mm512_setr_epi32(a, a + 8, a, a + 8, a, a + 8, a, a + 8, b, b + 8, b, b + 8, b, b + 8, b, b + 8);
                let pair_scales = _mm512_permutexvar_epi32(idx, scales);
                *p = q4_k_pair::<PACKED>(rows[2 * k].add(at), rows[2 * k + 1].add(at), xq, pair_scales);
            }
            let s = fold_row_pairs(&p);
            let mins = q4_k_min_sums8(mins_lo, mins_hi, group_sums(&x, ib));
            let (dw, dmin) = f16_lanes(d_dmin);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc);
            acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), acc_m);
        } else {
            let bsums = _mm256_loadu_si256(x.sums.as_ptr().add(16 * ib) as *const __m256i);
            let mut p = [_mm512_setzero_si512(); 4];
            for (k, p) in p.iter_mut().enumerate() {
                *p = q6_k_pair::<PACKED>(rows[2 * k].add(at), rows[2 * k + 1].add(at), xq, bsums);
            }
            let dw = f16_firsts8(rows, at + 208);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_row_pairs(&p)), _mm256_mul_ps(dw, dx), acc);
        }
    }
    if T == Q4_K {
        acc = _mm256_sub_ps(acc, acc_m);
    }
    let mut out = [0.0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), acc);
    out
}
