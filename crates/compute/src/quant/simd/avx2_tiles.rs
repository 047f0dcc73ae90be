//! AVX2 multi-row decode kernels for the 32-value types whose decode dominates the common
//! models (Q4_0, Q4_1, Q5_0, Q8_0): eight weight rows against one token, read from the GGUF
//! block layout as stored (their prefill tiles are in `avx2_lanes`).
//!
//! The single-row kernels of `avx2.rs` pay a float conversion, a scale product and an FMA per
//! (row, token, block), and a sign fix-up per product for signed levels. Here the levels of
//! Q4_0/Q5_0 stay unsigned (`q = u - 8` or `u - 16`) and the offset comes off the exact integer
//! block sum as `8 * sum(x)` (the activation block sums exist for Q4_1 already); the integer
//! sums of all (row, token) pairs of a block are folded horizontally into one vector before a
//! single conversion and FMA per eight pairs.
//!
//! Bits: every (row, token) pair computes, block by block, the exact integer sum `s`, then
//! `acc = fma(float(s), d_w * d_x, acc)` (and for Q4_1 `acc_m = fma(float(sum_x), m_w * d_x,
//! acc_m)`, result `acc + acc_m`). Lanes never mix, so a pair's result does not depend on which
//! kernel, tile position or neighbours computed it: prefill equals decode bit for bit.

use std::arch::x86_64::*;

use super::super::qdot::ActRow;

/// Q4_0: unsigned nibbles, level = u - 8.
pub(in crate::quant) const Q4_0: u8 = 0;
/// Q4_1: unsigned nibbles, `w = d * u + m`.
pub(in crate::quant) const Q4_1: u8 = 1;
/// Q5_0: nibble plus fifth bit, level = u - 16.
pub(in crate::quant) const Q5_0: u8 = 2;
/// Q8_0: signed bytes.
pub(in crate::quant) const Q8_0: u8 = 4;

pub(in crate::quant) const fn block_bytes(t: u8) -> usize {
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

const fn has_min(t: u8) -> bool {
    t == Q4_1
}

const fn signed(t: u8) -> bool {
    t == Q8_0
}

/// The 32 levels of the block at `b`: unsigned for Q4_0/Q4_1/Q5_0, signed bytes for Q8_0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn levels<const T: u8>(b: *const u8) -> __m256i {
    // The 16 bytes in both 128-bit lanes, the upper lane shifted right by 4: low nibbles then
    // high nibbles after one mask (a load-broadcast and one shift, no lane insert).
    let nibbles = |p: *const u8| {
        let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
        let shifted = _mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
        _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
    };
    match T {
        Q4_0 => nibbles(b.add(2)),
        Q4_1 => nibbles(b.add(4)),
        Q5_0 => {
            // Bit j of the 32-bit word at b + 2 is the fifth bit of value j.
            let bits = (b.add(2) as *const u32).read_unaligned();
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(bits as i32),
                _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0),
            );
            let others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
            _mm256_or_si256(nibbles(b.add(6)), _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
        }
        _ => _mm256_loadu_si256(b.add(2) as *const __m256i),
    }
}

/// `sum(w * x)` of one block pair in eight i32 lanes. `u` is what `levels` gave (for signed
/// levels, `|w|` is passed as `u` and `w` as `w`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair_sums<const T: u8>(u: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let x = if signed(T) { _mm256_sign_epi8(x, w) } else { x };
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
}

/// The two f16 values at `p[i] + offset` and `p[i] + offset + 2` of eight rows, as eight f32
/// lanes each (a block's `d` and, for Q4_1, `m`): one 32-bit load per row, then a byte
/// shuffle and a lane permute separate the two.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_pairs8(p: &[*const u8; 8], offset: usize) -> (__m256, __m256) {
    let word = |i: usize| (p[i].add(offset) as *const i32).read_unaligned();
    let lo = _mm_insert_epi32(
        _mm_insert_epi32(_mm_insert_epi32(_mm_cvtsi32_si128(word(0)), word(1), 1), word(2), 2),
        word(3),
        3,
    );
    let hi = _mm_insert_epi32(
        _mm_insert_epi32(_mm_insert_epi32(_mm_cvtsi32_si128(word(4)), word(5), 1), word(6), 2),
        word(7),
        3,
    );
    // Per 128-bit lane: [first halves of the four words | second halves].
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
    );
    let halves = _mm256_shuffle_epi8(_mm256_set_m128i(hi, lo), split);
    let ordered = _mm256_permute4x64_epi64(halves, 0b11_01_10_00);
    (_mm256_cvtph_ps(_mm256_castsi256_si128(ordered)), _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1)))
}

/// The f16 value at `p[i] + offset` of eight rows as eight f32 lanes (a Q4_0 block's `d`),
/// packed four to a 64-bit integer register and converted once. When only one value per row is
/// needed this keeps the work off the vector ports, which the decode kernel saturates: the
/// lane inserts of [`f16_pairs8`] cost a vector micro-op each (llvm-mca, Zen 3: the two-block
/// Q4_0 kernel 39.5 -> 30.2 cycles per step). With two values per row (Q4_1) the shift-and-or
/// packing costs more than the inserts and [`f16_pairs8`] stays the better one.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_firsts8(p: &[*const u8; 8], offset: usize) -> __m256 {
    let h = |i: usize| (p[i].add(offset) as *const u16).read_unaligned() as u64;
    let lo = h(0) | h(1) << 16 | h(2) << 32 | h(3) << 48;
    let hi = h(4) | h(5) << 16 | h(6) << 32 | h(7) << 48;
    _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64))
}

/// Asks for the weight bytes the next call will read, a share per step: the next group of
/// eight rows starts right after `rows[7]` (rows are consecutive in the matrix, `row_bytes`
/// each), and a step that reads bytes `at..at + len` of each of the eight rows prefetches
/// bytes `8 at..8 (at + len)` of the next group, so the whole group arrives over one call. The
/// hardware prefetchers do not cover eight interleaved row streams of a few cache lines each
/// (1152 bytes per Q4_0 row of 2048 values): with this, one thread's one-token matmul over such
/// rows went from about 0.35 to 0.6-0.8 of a plain streaming read of the same bytes
/// (tests/quant_speed.rs; Q4_0 5.9 -> 12-13 GB/s, Q4_K 5.3 -> 13-15 GB/s), where rows of 32768
/// values had 0.74 without it. Prefetching two groups ahead measured the same. A prefetch
/// never faults, so the last group's look past the end of the matrix is harmless.
///
/// `HINT` is the cache level: `_MM_HINT_T0` (L1) for Q4_0, Q4_1 and Q5_0, `_MM_HINT_T1` (L2)
/// for the k-quants and Q8_0 (`avx2_ktiles`' module notes and [`prefetch_for`] have the
/// measurements): a k-quant step asks for 18 or 27 lines at once; into L1 they likely queue
/// behind its few miss buffers, while the L2-to-L1 step left for the loads is short enough for
/// out-of-order execution to hide.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn prefetch_next_rows<const HINT: i32>(
    rows: &[*const u8; 8],
    row_bytes: usize,
    at: usize,
    len: usize,
) {
    let from = rows[7].wrapping_add(row_bytes + 8 * at);
    for offset in (0..8 * len).step_by(64) {
        _mm_prefetch::<HINT>(from.wrapping_add(offset) as *const i8);
    }
}

/// [`prefetch_next_rows`] for a `rows8` kernel of type `T`, into L2 (`T1`, as the k-quant
/// kernels do) for Q8_0 and into L1 for the others. Measured on the 2-vCPU Zen 4 VM, one
/// thread, `quant_speed` Q8_0 131072x2048, old and new builds alternated (three runs each) on a
/// busy host (load 3.9-4.0): AVX2 `rows8` 12.6-17.1 -> 17.5-23.4 GB/s (matmul/read 0.50-0.65 ->
/// 0.82-0.87), AVX-512 `rows8` 9.3-10.7 -> 18.0-22.0 GB/s (0.38-0.42 -> 0.83-0.86). Q4_0 came
/// out no faster with `T1` (AVX2 matmul/read 0.42-0.64 -> 0.45-0.54, AVX-512 0.58-0.70 ->
/// 0.61-0.63; an earlier measurement had 0.69-0.80 -> 0.63-0.65 for AVX2), so it keeps `T0`.
/// Unmeasured on Intel.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn prefetch_for<const T: u8>(rows: &[*const u8; 8], row_bytes: usize, at: usize, len: usize) {
    if T == Q8_0 {
        prefetch_next_rows::<_MM_HINT_T1>(rows, row_bytes, at, len);
    } else {
        prefetch_next_rows::<_MM_HINT_T0>(rows, row_bytes, at, len);
    }
}

/// The integer sums of eight rows of Q4_0 or Q4_1 (unsigned nibble levels) with two
/// consecutive blocks at `at` and `at + block_bytes`: `x_lo` holds the activations of values
/// 0..16 of the first block then of the second, `x_hi` those of values 16..32.
///
/// Each row's two blocks go into one register (first block in the low 128-bit lane), so one
/// mask gives the low nibbles (values 0..16) of both and one shift and mask the high ones; the
/// two `maddubs` add up to 16 lanes per row, eight per block, of four products each. The
/// horizontal tree then reduces the eight rows' vectors for both blocks at once: half the
/// horizontal adds per block of the one-block kernel, which were its most expensive
/// instructions (three micro-ops each on one port of Zen 3; llvm-mca: 19.6 -> 15 cycles per
/// block of eight rows). Overflow: a lane of four products is at most 4 * 15 * 127 = 7620,
/// two rounds of adds give 16 products (30480) in i16, and the last round is a `madd` into i32.
/// Returns `sum(u * x)` per row for the first block and for the second, in i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_pair_sums<const T: u8>(
    rows: &[*const u8; 8],
    at: usize,
    x_lo: __m256i,
    x_hi: __m256i,
) -> (__m256i, __m256i) {
    let m4 = _mm256_set1_epi8(0x0F);
    let quants = if T == Q4_1 { 4 } else { 2 };
    let v: [__m256i; 8] = std::array::from_fn(|r| {
        let first = rows[r].add(at + quants) as *const __m128i;
        let second = rows[r].add(at + block_bytes(T) + quants) as *const __m128i;
        let q = _mm256_loadu2_m128i(second, first);
        let lo = _mm256_and_si256(q, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi))
    });
    let h01 = _mm256_hadd_epi16(v[0], v[1]);
    let h23 = _mm256_hadd_epi16(v[2], v[3]);
    let h45 = _mm256_hadd_epi16(v[4], v[5]);
    let h67 = _mm256_hadd_epi16(v[6], v[7]);
    // Per block (128-bit lane): [r0 r0 r1 r1 r2 r2 r3 r3] and the same for rows 4..8.
    let ones = _mm256_set1_epi16(1);
    let a = _mm256_madd_epi16(_mm256_hadd_epi16(h01, h23), ones);
    let b = _mm256_madd_epi16(_mm256_hadd_epi16(h45, h67), ones);
    // a = [r0..r3 of the first block | r0..r3 of the second], b the same for rows 4..8.
    (_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31))
}

/// Adds one block's exact integer sums `s` (eight rows, `sum(u * x)`) to the accumulators:
/// the level offset comes off as `offset * sum(x)`, then `acc = fma(float(s), d_w * d_x, acc)`
/// (and for Q4_1 the min term into `acc_m`), the same operations whichever kernel computed `s`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn add_block<const T: u8>(
    mut s: __m256i,
    rows: &[*const u8; 8],
    at: usize,
    x: &ActRow<'_>,
    ib: usize,
    acc: &mut __m256,
    acc_m: &mut __m256,
) {
    let sx = *x.sums.get_unchecked(ib) as i32;
    if level_offset(T) != 0 {
        s = _mm256_sub_epi32(s, _mm256_set1_epi32(level_offset(T) * sx));
    }
    let dx = _mm256_set1_ps(*x.d.get_unchecked(ib));
    if has_min(T) {
        let (dw, mw) = f16_pairs8(rows, at);
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), *acc);
        *acc_m = _mm256_fmadd_ps(_mm256_set1_ps(sx as f32), _mm256_mul_ps(mw, dx), *acc_m);
    } else {
        let dw = f16_firsts8(rows, at);
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), *acc);
    }
}

/// Dot products of eight weight rows (`rows[i]`, `nb` blocks each) with one activation row.
///
/// Q4_0 variants measured and not kept (2-vCPU Zen 4 VM, one thread, the kernel copied into a
/// scratch harness with old and new alternated each repetition; paired median speed ratios,
/// new/old). The kernel runs at the same ~27.5 GB/s from L1 (8 rows of 4096 values) as from L2
/// or L3, about 36 cycles per two-block step at the ~3.5 GHz a dependent-add loop measured, so
/// it is compute-bound in cache. Upper bounds by deleting work (wrong results): no block scales
/// at all 1.13-1.16 (best-of ratio), `vphaddw` replaced by `vpaddw` 1.14-1.16, no
/// `vcvtph2ps` 1.02, no prefetch 1.03 at 0.3 MiB but 0.95 at 1.2 MiB. Bit-identical variants:
/// - scales: two `vpgatherdd` a step 0.75; all sixteen by `vpinsrw` from memory 0.987-0.991;
///   rows 0..4 packed in an integer register and rows 4..8 by `vpinsrw` 1.003-1.05 in cache
///   but no better from RAM (the harness 0.92-1.13 as the compiler scheduled the loop;
///   quant_speed 229376x2048 in the crate, four alternations, 14.6-19.2 GB/s against
///   17.0-21.5, the next four 14.6-19.9 against 12.2-17.8); packing by partial-register moves
///   (`asm!`, seven instructions per four scales instead of ten) 1.00. Fewer integer
///   instructions did not help.
/// - rows `i` and `i + 4` sharing a register per block (activation halves by broadcast, no
///   cross-lane permutes) 0.997 in cache and 0.79-0.91 from RAM, also with the split scales
///   above (1.02-1.04 in cache, 0.80-0.91 from RAM).
/// - `vpmulhuw` by 4096 instead of `vpsrlw` for the high nibbles 0.999; a memory `vpblendd` of
///   two overlapping 32-byte loads instead of `vinserti128` 0.976-0.982; `vpmaddwd` plus
///   `vpackssdw` instead of the first `vphaddw` level 1.00.
/// - `prefetchnta` for the next group: the harness from RAM 1.01-1.05, quant_speed mixed, and
///   1B Q4_0 decode (two threads, 11 alternated pairs) 28.45 against 29.4 tok/s.
///
/// # Safety
/// AVX2, FMA and F16C must be available; every `rows[i]` must point at `nb` blocks of `T`;
/// `x` must hold at least `nb` blocks (checked).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn rows8<const T: u8>(rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
    assert!(x.qs.len() >= nb * 32 && x.d.len() >= nb && x.sums.len() >= nb, "activation row too short");
    let row_bytes = nb * block_bytes(T);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm256_setzero_ps();
    let mut ib = 0;
    if T == Q4_0 || T == Q4_1 {
        while ib + 2 <= nb {
            let at = ib * block_bytes(T);
            prefetch_next_rows::<_MM_HINT_T0>(rows, row_bytes, at, 2 * block_bytes(T));
            let x0 = _mm256_loadu_si256(x.qs.as_ptr().add(32 * ib) as *const __m256i);
            let x1 = _mm256_loadu_si256(x.qs.as_ptr().add(32 * ib + 32) as *const __m256i);
            let (x_lo, x_hi) = (_mm256_permute2x128_si256(x0, x1, 0x20), _mm256_permute2x128_si256(x0, x1, 0x31));
            let (first, second) = nibble_pair_sums::<T>(rows, at, x_lo, x_hi);
            add_block::<T>(first, rows, at, &x, ib, &mut acc, &mut acc_m);
            add_block::<T>(second, rows, at + block_bytes(T), &x, ib + 1, &mut acc, &mut acc_m);
            ib += 2;
        }
    }
    // Q5_0 and Q8_0 block by block, and the last block of an odd count of Q4_0/Q4_1 blocks.
    for ib in ib..nb {
        let at = ib * block_bytes(T);
        prefetch_for::<T>(rows, row_bytes, at, block_bytes(T));
        let xq = _mm256_loadu_si256(x.qs.as_ptr().add(32 * ib) as *const __m256i);
        let s = if T == Q4_0 || T == Q4_1 {
            // Levels <= 15: a maddubs lane is at most 3810 in magnitude, so the eight lanes of a
            // row's 128-bit half add up in i16 (30480): three rounds of i16 horizontal adds give
            // [r0 .. r7] per half, without the eight madds of the i32 fold below.
            let m: [__m256i; 8] = std::array::from_fn(|r| _mm256_maddubs_epi16(levels::<T>(rows[r].add(at)), xq));
            let h01 = _mm256_hadd_epi16(m[0], m[1]);
            let h23 = _mm256_hadd_epi16(m[2], m[3]);
            let h45 = _mm256_hadd_epi16(m[4], m[5]);
            let h67 = _mm256_hadd_epi16(m[6], m[7]);
            let h = _mm256_hadd_epi16(_mm256_hadd_epi16(h01, h23), _mm256_hadd_epi16(h45, h67));
            _mm256_add_epi32(
                _mm256_cvtepi16_epi32(_mm256_castsi256_si128(h)),
                _mm256_cvtepi16_epi32(_mm256_extracti128_si256(h, 1)),
            )
        } else {
            let mut p = [_mm256_setzero_si256(); 8];
            for r in 0..8 {
                let w = levels::<T>(rows[r].add(at));
                let u = if signed(T) { _mm256_sign_epi8(w, w) } else { w };
                p[r] = pair_sums::<T>(u, w, xq);
            }
            // Fold to [r0 r1 r2 r3 | r0 r1 r2 r3] (low and high halves of each row), then add
            // the halves.
            let h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            let h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
            _mm256_add_epi32(
                _mm256_permute2x128_si256(h0123, h4567, 0x20),
                _mm256_permute2x128_si256(h0123, h4567, 0x31),
            )
        };
        add_block::<T>(s, rows, at, &x, ib, &mut acc, &mut acc_m);
    }
    if has_min(T) {
        acc = _mm256_add_ps(acc, acc_m);
    }
    let mut out = [0.0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), acc);
    out
}

/// `qdot::quantize_act_q8_0` for a whole row (`x.len() / 32` blocks), vectorised with the
/// same operations: the same amax (`max` ignores NaN in `x` the way `f32::max` does), the same
/// scalar `d`, `id` and f16 rounding, and round-half-away-from-zero done exactly (`trunc`,
/// then one step away from zero where the exact remainder is at least one half), NaN to 0.
/// Results equal the portable ones bit for bit.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn quantize_row_q8_0(
    x: &[f32],
    d: &mut [f32],
    qs: &mut [i8],
    sums: &mut [i16],
    round_f16: fn(f32) -> f32,
) {
    let nb = (x.len() / 32).min(d.len()).min(sums.len()).min(qs.len() / 32);
    let sign_bit = _mm256_set1_ps(-0.0);
    let half = _mm256_set1_ps(0.5);
    let one = _mm256_set1_ps(1.0);
    for ib in 0..nb {
        let p = x.as_ptr().add(32 * ib);
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(p.add(8 * i)));
        // max(|v|, acc): a NaN in v leaves acc, as f32::max does.
        let mut amax8 = _mm256_setzero_ps();
        for vi in v {
            amax8 = _mm256_max_ps(_mm256_andnot_ps(sign_bit, vi), amax8);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let scaled = _mm256_mul_ps(v[i], idv);
            let t = _mm256_round_ps(scaled, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let rem = _mm256_andnot_ps(sign_bit, _mm256_sub_ps(scaled, t));
            let away = _mm256_and_ps(_mm256_cmp_ps(rem, half, _CMP_GE_OQ), one);
            let rounded = _mm256_add_ps(t, _mm256_or_ps(away, _mm256_and_ps(scaled, sign_bit)));
            // NaN (from a NaN or infinite input) becomes 0, as `NaN as i8` does.
            let ordered = _mm256_cmp_ps(scaled, scaled, _CMP_ORD_Q);
            _mm256_cvttps_epi32(_mm256_and_ps(rounded, ordered))
        });
        let total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        let t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32(t2, 0b01)));
        // i32 -> i8 (values are within -127..=127): packs work per 128-bit lane, so the lanes
        // come out as 0 2 4 6 1 3 5 7 (groups of four values) and are put back in order.
        let w01 = _mm256_packs_epi32(q[0], q[1]);
        let w23 = _mm256_packs_epi32(q[2], q[3]);
        let bytes = _mm256_packs_epi16(w01, w23);
        let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(qs.as_mut_ptr().add(32 * ib) as *mut __m256i, ordered);
        *sums.get_unchecked_mut(ib) = sum as i16;
        *d.get_unchecked_mut(ib) = round_f16(amax / 127.0);
    }
}

/// `k_quants::quantize_block_q8_k` for a whole row (`x.len() / 256` blocks), vectorised with
/// the same operations: the value of largest magnitude (first on ties, NaN ignored), the same
/// scalar `iscale = -127 / max`, ggml's `nearest_int` (round half to even, which
/// `cvtps_epi32` does under the default rounding mode), `min(127)`, NaN to 0, and the 16 sums
/// per block. Results equal the portable ones bit for bit.
///
/// # Safety
/// AVX2, FMA and F16C must be available, and the MXCSR rounding mode must be the default.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn quantize_row_q8_k(x: &[f32], d: &mut [f32], qs: &mut [i8], sums: &mut [i16]) {
    let nb = (x.len() / 256).min(d.len()).min(sums.len() / 16).min(qs.len() / 256);
    let sign_bit = _mm256_set1_ps(-0.0);
    for ib in 0..nb {
        let p = x.as_ptr().add(256 * ib);
        let mut amax8 = _mm256_setzero_ps();
        for i in 0..32 {
            amax8 = _mm256_max_ps(_mm256_andnot_ps(sign_bit, _mm256_loadu_ps(p.add(8 * i))), amax8);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
        let qs_out = qs.as_mut_ptr().add(256 * ib);
        let sums_out = sums.as_mut_ptr().add(16 * ib);
        if amax == 0.0 {
            std::ptr::write_bytes(qs_out, 0, 256);
            std::ptr::write_bytes(sums_out, 0, 16);
            *d.get_unchecked_mut(ib) = 0.0;
            continue;
        }
        // The first value whose magnitude is amax gives the sign.
        let amax_v = _mm256_set1_ps(amax);
        let mut max = amax;
        for i in 0..32 {
            let v = _mm256_loadu_ps(p.add(8 * i));
            let hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign_bit, v), amax_v, _CMP_EQ_OQ));
            if hit != 0 {
                max = *p.add(8 * i + hit.trailing_zeros() as usize);
                break;
            }
        }
        let iscale = -127.0 / max;
        let iscale_v = _mm256_set1_ps(iscale);
        let cap = _mm256_set1_epi32(127);
        for g in 0..8 {
            // 32 values: four groups of eight, then packed to bytes and put back in order.
            let q: [__m256i; 4] = std::array::from_fn(|i| {
                let scaled = _mm256_mul_ps(iscale_v, _mm256_loadu_ps(p.add(32 * g + 8 * i)));
                let ordered = _mm256_cmp_ps(scaled, scaled, _CMP_ORD_Q);
                let n = _mm256_cvtps_epi32(_mm256_and_ps(scaled, ordered));
                _mm256_min_epi32(n, cap)
            });
            let w01 = _mm256_packs_epi32(q[0], q[1]);
            let w23 = _mm256_packs_epi32(q[2], q[3]);
            let bytes = _mm256_packs_epi16(w01, w23);
            let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(qs_out.add(32 * g) as *mut __m256i, ordered);
            // Sums of values 32g..32g+16 and 32g+16..32g+32.
            for h in 0..2 {
                let s = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
                let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
                *sums_out.add(2 * g + h) = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0b01))) as i16;
            }
        }
        *d.get_unchecked_mut(ib) = 1.0 / iscale;
    }
}
