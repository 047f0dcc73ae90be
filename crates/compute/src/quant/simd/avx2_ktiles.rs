//! AVX2 multi-row decode kernels for Q4_K and Q6_K (the k-quants of the common Q4_K_M files):
//! eight weight rows against one token, reading the GGUF super-blocks as stored, with Q8_K
//! activations (their prefill tiles are in `avx2_lanes`).
//!
//! A super-block's integer work per (row, token) is the single-row kernel's (`avx2.rs`:
//! `maddubs` of levels with activation quants, `madd` with the sub-block scales); what the
//! multi-row form saves is everything around it: the activation quants and their block sums
//! are loaded and paired once for all rows, the per-pair integer totals of eight pairs are
//! folded into one vector, and the floats (one conversion and one FMA per eight pairs) are done
//! for eight pairs at once. Q4_K's first 16 bytes per super-block (`d`, `dmin` and the packed
//! 6-bit scales and mins) are loaded for the eight rows together and transposed to one row per
//! i32 lane ([`q4_k_heads8`]): the scales and mins are unpacked by a dozen vector operations for
//! all eight rows instead of about twenty scalar ones and four lane inserts per row, the min
//! term is four `madd` for all rows with no fold, and `d`, `dmin` need no gather.
//!
//! Bits: every (row, token) pair computes, super-block by super-block, exact integers `s` (and
//! for Q4_K the min sum `m`), then `acc = fma(float(s), d_w * d_x, acc)` (Q4_K: also `acc_m =
//! fma(float(m), dmin_w * d_x, acc_m)`, result `acc - acc_m`). Lanes never mix, so a pair's
//! result does not depend on which kernel or tile position computed it: prefill equals decode
//! bit for bit. Q6_K levels are taken unsigned (0..64) and `32 * sum(scale * bsum)` comes off
//! the exact integer total.
//!
//! Speed (Zen 4 EPYC, 2 vCPUs, one thread, `quant_speed`'s `decode_matmul_against_streaming_read`,
//! 131072 x 2048 rows, 144 MiB Q4_K / 210 MiB Q6_K; streaming read 20-30 GB/s): the weights are
//! prefetched into L2 rather than L1 (`prefetch_next_rows::<_MM_HINT_T1>`), Q4_K 9.6-11 -> 13-17
//! GB/s and Q6_K 8-10 -> 17-21 GB/s (the same kernels over 9-13 MiB that stay in L3 run at 20-22 GB/s,
//! so the large matrices were stalled on memory, not arithmetic). T2 measured as T1, NTA and no
//! prefetch slower than T0. The eight-row Q4_K head decode then took Q4_K's arithmetic from
//! 20.5 to 23.4 GB/s on L1-resident rows and the 131072 x 2048 matmul from 0.74-0.75 to
//! 0.74-0.83 of the streaming read (32768 x 8192: 0.67-0.85 to 0.91-1.07).
//!
//! Tried and dropped: a Q4_K kernel with one row per i32 lane throughout (16-byte halves of rows
//! `p` and `p + 4` in one register, 4 x 4 transposes, broadcast activations, one `madd` per
//! sub-block for all eight rows): 27 against 21 GB/s on L1-resident rows, but no faster, often
//! slower, from DRAM (its loads touch the eight rows in 16-byte pieces; spreading its prefetches
//! over the step, prefetching further ahead or per row did not recover it). Likewise unrolling
//! the eight-row loop below: 5% faster on L1-resident rows, but 0.58-0.74 of the streaming read
//! against 0.67-1.00 from DRAM; both issue the eight rows' loads together, where the rolled loop
//! reads them row after row. A stack table of the rows' scales read by broadcasts (instead of
//! `vpermd` + `pshufb`) was slower everywhere.

use std::arch::x86_64::*;

use super::super::qdot::ActRow;
use super::avx2::pair_broadcast_index;
use super::avx2_tiles::{f16_firsts8, prefetch_next_rows};

/// Q4_K: 144-byte super-blocks (`d`, `dmin`, 12 bytes of 6-bit scales and mins, 128 of nibbles).
pub(in crate::quant) const Q4_K: u8 = 0;
/// Q6_K: 210-byte super-blocks (128 bytes of low nibbles, 64 of high bit pairs, 16 i8 scales, `d`).
pub(in crate::quant) const Q6_K: u8 = 1;

const fn block_bytes(t: u8) -> usize {
    match t {
        Q4_K => 144,
        _ => 210,
    }
}

/// The activation quants of super-block `ib` of `N` tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn token_quants<const N: usize>(xs: &[ActRow<'_>; N], ib: usize) -> [*const i8; N] {
    std::array::from_fn(|t| xs[t].qs.as_ptr().add(256 * ib))
}

/// Load the 32 activation quants at `p + at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x32(p: *const i8, at: usize) -> __m256i {
    _mm256_loadu_si256(p.add(at) as *const __m256i)
}

/// The eight 32-value group sums of a Q8_K block (pairs of its 16 sums) as i16 lanes: exact,
/// |sum| <= 32 * 127.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group_sums(x: &ActRow<'_>, ib: usize) -> __m128i {
    let b = _mm256_loadu_si256(x.sums.as_ptr().add(16 * ib) as *const __m256i);
    _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1))
}

/// Dword `k` of each of four vectors in four lanes, per 128-bit half: the 4 x 4 transposes of
/// `v[0..4]`'s low halves and of their high halves (`out[k]` holds dword `k` of `v[0..4]` in
/// its low half and dword `4 + k` in its high half, vector `p`'s in lane `p` of each half).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose4x4_halves(v: [__m256i; 4]) -> [__m256i; 4] {
    let (a, b) = (_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
    let (c, d) = (_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
    [_mm256_unpacklo_epi64(a, c), _mm256_unpackhi_epi64(a, c), _mm256_unpacklo_epi64(b, d), _mm256_unpackhi_epi64(b, d)]
}

/// `pshufb` indices that apply the byte pattern `b` (indices 0..4, or 0x80 for zero) to each
/// 32-bit lane on its own.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn within_lanes(b: [u8; 4]) -> __m256i {
    let at = |lane: u8| {
        let pick = |i: usize| if b[i] & 0x80 != 0 { 0x80 } else { b[i] + 4 * lane };
        i32::from_le_bytes([pick(0), pick(1), pick(2), pick(3)])
    };
    let (l0, l1, l2, l3) = (at(0), at(1), at(2), at(3));
    _mm256_setr_epi32(l0, l1, l2, l3, l0, l1, l2, l3)
}

/// Eight lanes of f16 pairs to (first halves, second halves) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_lanes(v: __m256i) -> (__m256, __m256) {
    // Per 128-bit lane: [first halves of the four words | second halves].
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
    );
    let ordered = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0b11_01_10_00);
    (_mm256_cvtph_ps(_mm256_castsi256_si128(ordered)), _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1)))
}

/// The first 16 bytes of eight rows' Q4_K super-blocks at `at`, decoded with row `r` in i32
/// lane `r`: (`d` and `dmin` as an f16 pair, scales 0..4, scales 4..8, mins 0..4, mins 4..8 as
/// bytes): `scales_mins_k4` for eight rows at once, in vector registers.
///
/// # Safety
/// AVX2 must be available and every `rows[r] + at` must start a whole Q4_K super-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_k_heads8(rows: &[*const u8; 8], at: usize) -> [__m256i; 5] {
    let head = transpose4x4_halves(std::array::from_fn(|p| {
        _mm256_loadu2_m128i(rows[p + 4].add(at) as *const __m128i, rows[p].add(at) as *const __m128i)
    }));
    let (u0, u1, u2) = (head[1], head[2], head[3]);
    let (low6, low4, bits45) = (_mm256_set1_epi8(0x3F), _mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    // 32-bit shifts by 2 move bits 6 and 7 of each byte to bits 4 and 5 of the same byte.
    let scales_hi = _mm256_or_si256(_mm256_and_si256(u2, low4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), bits45));
    let mins_hi = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi32(u2, 4), low4),
        _mm256_and_si256(_mm256_srli_epi32(u1, 2), bits45),
    );
    [head[0], _mm256_and_si256(u0, low6), scales_hi, _mm256_and_si256(u1, low6), mins_hi]
}

/// One Q4_K row's super-block at `b` with one token: eight i32 lanes whose sum is
/// `sum_j scale_j * dot(levels_j, x_j)`; `scales[h]` holds the row's scales `4 h .. 4 h + 4`
/// as bytes in every i32 lane.
///
/// # Safety
/// AVX2 must be available; `b` must start a whole Q4_K super-block and `xq` its 256 activation
/// quants.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_row(b: *const u8, xq: *const i8, scales: [__m256i; 2]) -> __m256i {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut sumi = _mm256_setzero_si256();
    for c in 0..4 {
        let q = _mm256_loadu_si256(b.add(16 + 32 * c) as *const __m256i);
        let lo = _mm256_and_si256(q, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        let j = 2 * (c as u8 % 2);
        let s_lo = _mm256_shuffle_epi8(scales[c / 2], within_lanes([j, 0x80, j, 0x80]));
        let s_hi = _mm256_shuffle_epi8(scales[c / 2], within_lanes([j + 1, 0x80, j + 1, 0x80]));
        let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x32(xq, 64 * c)), s_lo);
        let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x32(xq, 64 * c + 32)), s_hi);
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
    }
    sumi
}

/// One Q6_K super-block at `b` with `N` tokens: per token, eight i32 lanes whose sum is
/// `sum_g scale_g * dot(levels_g, x_g)` with signed levels (stored + 32; `32 * scale_g *
/// bsum_g` is taken off exactly).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_block<const N: usize>(
    b: *const u8,
    xq: &[*const i8; N],
    xs: &[ActRow<'_>; N],
    ib: usize,
) -> [__m256i; N] {
    let (m4, m3) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
    let mut sumi: [__m256i; N] = std::array::from_fn(|t| {
        // |scale| <= 128 and |bsum| <= 16 * 127: each madd lane and its times 32 fit i32.
        let bsums = _mm256_loadu_si256(xs[t].sums.as_ptr().add(16 * ib) as *const __m256i);
        _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(scales16, bsums), 5))
    });
    let scales_by_half =
        [_mm256_permute2x128_si256(scales16, scales16, 0x00), _mm256_permute2x128_si256(scales16, scales16, 0x11)];
    for (half, half_scales) in scales_by_half.into_iter().enumerate() {
        let ql0 = _mm256_loadu_si256(b.add(64 * half) as *const __m256i);
        let ql1 = _mm256_loadu_si256(b.add(64 * half + 32) as *const __m256i);
        let qh = _mm256_loadu_si256(b.add(128 + 32 * half) as *const __m256i);
        let high =
            |shift: i32| _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), m3), 4);
        let groups = [
            _mm256_or_si256(_mm256_and_si256(ql0, m4), high(0)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), high(2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), high(4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), high(6)),
        ];
        for (gi, lv) in groups.into_iter().enumerate() {
            // Lanes 0..8 (values 0..16) take scale 2 gi of this half, lanes 8..16 the next.
            let s = _mm256_shuffle_epi8(half_scales, pair_broadcast_index(2 * gi));
            for t in 0..N {
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(lv, x32(xq[t], 128 * half + 32 * gi)), s);
                sumi[t] = _mm256_add_epi32(sumi[t], p);
            }
        }
    }
    sumi
}

/// Eight vectors of eight i32 lanes to one vector of their eight lane sums, in order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fold8(p: &[__m256i; 8]) -> __m256i {
    // [r0 r1 r2 r3 | r0 r1 r2 r3] (sums of low and high halves), then the halves added.
    let h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    let h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20), _mm256_permute2x128_si256(h0123, h4567, 0x31))
}

/// Dot products of eight weight rows (`rows[i]`, `nb` super-blocks each) with one Q8_K row.
///
/// # Safety
/// AVX2, FMA and F16C must be available; every `rows[i]` must point at `nb` super-blocks of
/// `T`; `x` must hold at least `nb` blocks (checked).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn rows8<const T: u8>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    assert!(x.qs.len() >= nb * 256 && x.d.len() >= nb && x.sums.len() >= nb * 16, "activation row too short");
    let xs = [x];
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm256_setzero_ps();
    for ib in 0..nb {
        let at = ib * block_bytes(T);
        prefetch_next_rows::<_MM_HINT_T1>(rows, nb * block_bytes(T), at, block_bytes(T));
        let xq = token_quants(&xs, ib);
        let dx = _mm256_set1_ps(*x.d.get_unchecked(ib));
        if T == Q4_K {
            let [d_dmin, scales_lo, scales_hi, mins_lo, mins_hi] = q4_k_heads8(rows, at);
            let p: [__m256i; 8] = std::array::from_fn(|r| {
                // Row r's scales in every lane (within_lanes then reads lane 0's bytes alike).
                let idx = _mm256_set1_epi32(r as i32);
                let scales = [_mm256_permutevar8x32_epi32(scales_lo, idx), _mm256_permutevar8x32_epi32(scales_hi, idx)];
                q4_k_row(rows[r].add(at), xq[0], scales)
            });
            let s = fold8(&p);
            // sum_j min_j * (bsum 2j + bsum 2j+1), two j per madd, row r in lane r.
            let mut g = [0i32; 4];
            _mm_storeu_si128(g.as_mut_ptr() as *mut __m128i, group_sums(&x, ib));
            let mins = [(mins_lo, 0u8), (mins_lo, 1), (mins_hi, 0), (mins_hi, 1)].into_iter().enumerate().fold(
                _mm256_setzero_si256(),
                |m, (q, (v, h))| {
                    let pair = _mm256_shuffle_epi8(v, within_lanes([2 * h, 0x80, 2 * h + 1, 0x80]));
                    _mm256_add_epi32(m, _mm256_madd_epi16(pair, _mm256_set1_epi32(g[q])))
                },
            );
            let (dw, dmin) = f16_lanes(d_dmin);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc);
            acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), acc_m);
        } else {
            let mut p = [_mm256_setzero_si256(); 8];
            for r in 0..8 {
                [p[r]] = q6_k_block::<1>(rows[r].add(at), &xq, &xs, ib);
            }
            let dw = f16_firsts8(rows, at + 208);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold8(&p)), _mm256_mul_ps(dw, dx), acc);
        }
    }
    if T == Q4_K {
        acc = _mm256_sub_ps(acc, acc_m);
    }
    let mut out = [0.0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), acc);
    out
}
