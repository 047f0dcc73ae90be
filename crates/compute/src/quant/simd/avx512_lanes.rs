//! AVX-512 prefill tiles: four weight rows by sixteen tokens (two [`TokenOctet`]s), one token
//! per 32-bit lane of a 512-bit register, for Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K.
//!
//! The layout is `avx2_lanes`'s (four consecutive values of one row broadcast to every lane,
//! against four values of each token), with the two octets side by side in one register and
//! `vpdpbusd` doing the `maddubs`, the i16 adds and the `madd` of the AVX2 tile in one
//! instruction: unsigned levels (Q8_0: `w + 128`, `128 * sum(x)` taken off) times signed
//! activations, four products into each token's i32 lane. The k-quants' sub-block scales
//! multiply the exact sub-block sums in i32 (`vpmulld`); mins and the Q6_K offset are
//! `vpdpwssd` of the activation sums with the scale.
//!
//! Bits: the integers are the exact block (super-block) sums of `avx2_lanes`, and the floats
//! are its operations on each octet's eight lanes in the same order, so every output equals
//! the AVX2 tile's and the decode kernels' bit for bit. The last odd octet of a prefill uses
//! the AVX2 one-octet tile. Q4_0 and Q4_K have a taller tile besides, four rows by four
//! octets ([`tile4_q4_0`], [`tile4_q4_k`]), which the prefill driver takes while four octets
//! are left.

use std::arch::x86_64::*;

use super::super::qdot::TokenOctet;
use super::avx2_lanes::{f16_at, halves, TILE_ROWS};
use super::avx2_tiles::{block_bytes, Q4_0, Q4_1, Q5_0, Q8_0};

/// Values `4 g .. 4 g + 4` of a 16-value half (in every 128-bit lane) in every 32-bit lane.
macro_rules! group {
    ($half:expr, $g:literal) => {
        _mm512_shuffle_epi32::<{ $g * 0x55 }>($half)
    };
}

/// The 32 bytes at `a` and at `b` (octet 0's and octet 1's) as one register.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn join_at(a: *const u8, b: *const u8) -> __m512i {
    let lo = _mm256_loadu_si256(a as *const __m256i);
    let hi = _mm256_loadu_si256(b as *const __m256i);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// `acc = fma(float(s), d_w * dx, acc)` in all sixteen lanes: per lane the AVX2 tile's float
/// operations (done on both octets at once, in one register).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn add_scaled(acc: &mut __m512, s: __m512i, dw: f32, dx: __m512) {
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(_mm512_set1_ps(dw), dx), *acc);
}

/// The two octets' activation scales of block `ib` as one register.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn scales_dx(xs: &[TokenOctet<'_>; 2], ib: usize) -> __m512 {
    _mm512_castsi512_ps(join_at(xs[0].d.as_ptr().add(8 * ib) as *const u8, xs[1].d.as_ptr().add(8 * ib) as *const u8))
}

/// Sixteen lanes to `out[0]` (octet 0) and `out[1]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn store16(out: &mut [[f32; 8]; 2], v: __m512) {
    _mm512_storeu_ps(out.as_mut_ptr() as *mut f32, v);
}

/// [`add_scaled`] on sixteen float sums kept in memory (the four-octet tiles' accumulators).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn add_scaled_at(acc: &mut [f32; 16], s: __m512i, dw: f32, dx: __m512) {
    let mut v = _mm512_loadu_ps(acc.as_ptr());
    add_scaled(&mut v, s, dw, dx);
    _mm512_storeu_ps(acc.as_mut_ptr(), v);
}

/// A four-octet tile's output from its sums, `value(r, p)` being row `r`'s sixteen lanes of
/// octets `2 p` and `2 p + 1`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn quad_out(value: impl Fn(usize, usize) -> __m512) -> [[[f32; 8]; 4]; TILE_ROWS] {
    let mut out = [[[0.0f32; 8]; 4]; TILE_ROWS];
    for (r, row) in out.iter_mut().enumerate() {
        for p in 0..2 {
            let pair: &mut [[f32; 8]; 2] = (&mut row[2 * p..2 * p + 2]).try_into().unwrap();
            store16(pair, value(r, p));
        }
    }
    out
}

/// A Q4_0, Q4_1 or Q5_0 tile of four rows by two octets: `out[r][o][t]` is row `rows[r]` times
/// token `t` of octet `xs[o]`.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C must be available; every `rows[i]` must point at
/// `nb` blocks of `T`; every octet must hold at least `nb` blocks (checked).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile<const T: u8>(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; 2],
) -> [[[f32; 8]; 2]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_0_blocks(nb, true));
    let offset_shift = match T {
        Q4_0 => 3,
        Q5_0 => 4,
        _ => 0,
    };
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    let mut acc_m = [_mm512_setzero_ps(); TILE_ROWS];
    let m4 = _mm512_set1_epi8(0x0F);
    for ib in 0..nb {
        let (x0, x1) = (xs[0].qs.as_ptr().add(256 * ib) as *const u8, xs[1].qs.as_ptr().add(256 * ib) as *const u8);
        let mut x = [_mm512_setzero_si512(); 8];
        for (v, x) in x.iter_mut().enumerate() {
            *x = join_at(x0.add(32 * v), x1.add(32 * v));
        }
        let dx = scales_dx(xs, ib);
        let sums = join_at(xs[0].sums.as_ptr().add(8 * ib) as *const u8, xs[1].sums.as_ptr().add(8 * ib) as *const u8);
        // The level offset (8 or 16) times each token's block sum, taken off at the start.
        let start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_sll_epi32(sums, _mm_cvtsi32_si128(offset_shift)));
        let at = ib * block_bytes(T);
        for r in 0..TILE_ROWS {
            let b = rows[r].add(at);
            let (h0, h1) = if T == Q5_0 {
                let [h0, h1] = halves::<T>(b);
                (_mm512_broadcast_i64x4(h0), _mm512_broadcast_i64x4(h1))
            } else {
                // The 16 nibble bytes in every 128-bit lane (a broadcast load), then masked.
                let q = _mm512_broadcast_i32x4(_mm_loadu_si128(b.add(if T == Q4_1 { 4 } else { 2 }) as *const __m128i));
                (_mm512_and_si512(q, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4))
            };
            let mut s = if offset_shift != 0 { start } else { _mm512_setzero_si512() };
            s = _mm512_dpbusd_epi32(s, group!(h0, 0), x[0]);
            s = _mm512_dpbusd_epi32(s, group!(h0, 1), x[1]);
            s = _mm512_dpbusd_epi32(s, group!(h0, 2), x[2]);
            s = _mm512_dpbusd_epi32(s, group!(h0, 3), x[3]);
            s = _mm512_dpbusd_epi32(s, group!(h1, 0), x[4]);
            s = _mm512_dpbusd_epi32(s, group!(h1, 1), x[5]);
            s = _mm512_dpbusd_epi32(s, group!(h1, 2), x[6]);
            s = _mm512_dpbusd_epi32(s, group!(h1, 3), x[7]);
            add_scaled(&mut acc[r], s, f16_at(b), dx);
            if T == Q4_1 {
                add_scaled(&mut acc_m[r], sums, f16_at(b.add(2)), dx);
            }
        }
    }
    let mut out = [[[0.0f32; 8]; 2]; TILE_ROWS];
    for r in 0..TILE_ROWS {
        let v = if T == Q4_1 { _mm512_add_ps(acc[r], acc_m[r]) } else { acc[r] };
        store16(&mut out[r], v);
    }
    out
}

/// A Q8_0 tile of four rows by two octets: weights made unsigned (`w + 128`), the
/// `128 * sum(x)` taken off each token's exact block sum.
///
/// # Safety
/// As [`tile`], for Q8_0 rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile_q8_0(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; 2],
) -> [[[f32; 8]; 2]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_0_blocks(nb, true));
    let flip = _mm512_set1_epi8(-128);
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    for ib in 0..nb {
        let (x0, x1) = (xs[0].qs.as_ptr().add(256 * ib) as *const u8, xs[1].qs.as_ptr().add(256 * ib) as *const u8);
        let mut x = [_mm512_setzero_si512(); 8];
        for (v, x) in x.iter_mut().enumerate() {
            *x = join_at(x0.add(32 * v), x1.add(32 * v));
        }
        let dx = scales_dx(xs, ib);
        let sums512 =
            join_at(xs[0].sums.as_ptr().add(8 * ib) as *const u8, xs[1].sums.as_ptr().add(8 * ib) as *const u8);
        let offset = _mm512_slli_epi32::<7>(sums512);
        let at = ib * block_bytes(Q8_0);
        for r in 0..TILE_ROWS {
            let b = rows[r].add(at);
            let mut s = _mm512_sub_epi32(_mm512_setzero_si512(), offset);
            for (g, x) in x.iter().enumerate() {
                let w = _mm512_set1_epi32((b.add(2 + 4 * g) as *const i32).read_unaligned());
                s = _mm512_dpbusd_epi32(s, _mm512_xor_si512(w, flip), *x);
            }
            add_scaled(&mut acc[r], s, f16_at(b), dx);
        }
    }
    let mut out = [[[0.0f32; 8]; 2]; TILE_ROWS];
    for r in 0..TILE_ROWS {
        store16(&mut out[r], acc[r]);
    }
    out
}

/// A Q4_K tile of four rows by two octets (Q8_K activations): per 32-value sub-block the
/// eight `vpdpbusd` give each token's exact sum, times the sub-block scale in i32; the min term
/// is a `vpdpwssd` of the token's pair of 16-value sums with the min. Same integers `s` and `m`
/// as `avx2_lanes::tile_q4_k`, same floats.
///
/// # Safety
/// As [`tile`], for Q4_K rows and Q8_K octets.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile_q4_k(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; 2],
) -> [[[f32; 8]; 2]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_k_blocks(nb, true));
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    let mut acc_m = [_mm512_setzero_ps(); TILE_ROWS];
    for ib in 0..nb {
        let (x0, x1) = (xs[0].qs.as_ptr().add(2048 * ib) as *const u8, xs[1].qs.as_ptr().add(2048 * ib) as *const u8);
        let (b0, b1) =
            (xs[0].bsums.as_ptr().add(128 * ib) as *const u8, xs[1].bsums.as_ptr().add(128 * ib) as *const u8);
        let dx = scales_dx(xs, ib);
        for r in 0..TILE_ROWS {
            let b = rows[r].add(144 * ib);
            let mut scales_mins = [0i16; 16];
            _mm256_storeu_si256(scales_mins.as_mut_ptr() as *mut __m256i, super::avx2::scales_mins_k4(b.add(4)));
            let mut s = _mm512_setzero_si512();
            let mut m = _mm512_setzero_si512();
            for c in 0..4 {
                let q = [
                    _mm512_broadcast_i32x4(_mm_loadu_si128(b.add(16 + 32 * c) as *const __m128i)),
                    _mm512_broadcast_i32x4(_mm_loadu_si128(b.add(32 + 32 * c) as *const __m128i)),
                ];
                for i in 0..2 {
                    // Sub-block 2c is the low nibbles of the chunk's 32 bytes, 2c + 1 the high ones.
                    let (h0, h1) = if i == 0 {
                        (_mm512_and_si512(q[0], m4), _mm512_and_si512(q[1], m4))
                    } else {
                        (
                            _mm512_and_si512(_mm512_srli_epi16::<4>(q[0]), m4),
                            _mm512_and_si512(_mm512_srli_epi16::<4>(q[1]), m4),
                        )
                    };
                    let j = 2 * c + i;
                    let xv = |g: usize| join_at(x0.add(32 * (8 * j + g)), x1.add(32 * (8 * j + g)));
                    let mut sj = _mm512_setzero_si512();
                    sj = _mm512_dpbusd_epi32(sj, group!(h0, 0), xv(0));
                    sj = _mm512_dpbusd_epi32(sj, group!(h0, 1), xv(1));
                    sj = _mm512_dpbusd_epi32(sj, group!(h0, 2), xv(2));
                    sj = _mm512_dpbusd_epi32(sj, group!(h0, 3), xv(3));
                    sj = _mm512_dpbusd_epi32(sj, group!(h1, 0), xv(4));
                    sj = _mm512_dpbusd_epi32(sj, group!(h1, 1), xv(5));
                    sj = _mm512_dpbusd_epi32(sj, group!(h1, 2), xv(6));
                    sj = _mm512_dpbusd_epi32(sj, group!(h1, 3), xv(7));
                    s = _mm512_add_epi32(s, _mm512_mullo_epi32(sj, _mm512_set1_epi32(scales_mins[j] as i32)));
                    let pair = join_at(b0.add(32 * j), b1.add(32 * j));
                    m = _mm512_dpwssd_epi32(m, pair, _mm512_set1_epi16(scales_mins[8 + j]));
                }
            }
            add_scaled(&mut acc[r], s, f16_at(b), dx);
            add_scaled(&mut acc_m[r], m, f16_at(b.add(2)), dx);
        }
    }
    let mut out = [[[0.0f32; 8]; 2]; TILE_ROWS];
    for r in 0..TILE_ROWS {
        store16(&mut out[r], _mm512_sub_ps(acc[r], acc_m[r]));
    }
    out
}

/// A Q6_K tile of four rows by two octets (Q8_K activations): levels unsigned (0..64), per
/// 16-value sub-block four `vpdpbusd` and a product with the scale in i32, `32 * sum(scale *
/// bsum)` off the start (`vpdpwssd`). Same integers as `avx2_lanes::tile_q6_k`, same floats.
///
/// # Safety
/// As [`tile`], for Q6_K rows and Q8_K octets.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile_q6_k(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; 2],
) -> [[[f32; 8]; 2]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_k_blocks(nb, true));
    let (m4, m3) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    for ib in 0..nb {
        let (x0, x1) = (xs[0].qs.as_ptr().add(2048 * ib) as *const u8, xs[1].qs.as_ptr().add(2048 * ib) as *const u8);
        let (b0, b1) =
            (xs[0].bsums.as_ptr().add(128 * ib) as *const u8, xs[1].bsums.as_ptr().add(128 * ib) as *const u8);
        let dx = scales_dx(xs, ib);
        for r in 0..TILE_ROWS {
            let b = rows[r].add(210 * ib);
            let scales = b.add(192) as *const i8;
            // |scale| <= 128, |bsum| <= 16 * 127: the sum over 16 sub-blocks and times 32 fit i32.
            let mut offset = _mm512_setzero_si512();
            for p in 0..8 {
                let (lo, hi) = (*scales.add(2 * p) as i16 as u16 as u32, *scales.add(2 * p + 1) as i16 as u16 as u32);
                let pair = _mm512_set1_epi32((lo | hi << 16) as i32);
                offset = _mm512_dpwssd_epi32(offset, join_at(b0.add(32 * p), b1.add(32 * p)), pair);
            }
            let mut s = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<5>(offset));
            for half in 0..2 {
                let ql0 = _mm256_loadu_si256(b.add(64 * half) as *const __m256i);
                let ql1 = _mm256_loadu_si256(b.add(64 * half + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(b.add(128 + 32 * half) as *const __m256i);
                // Values 32 gi .. 32 gi + 32 of this half, in order (as the AVX2 tile).
                let levels = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m3))),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), m3)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), m3)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), m3)),
                    ),
                ];
                for (gi, lv) in levels.into_iter().enumerate() {
                    for hh in 0..2 {
                        let h = if hh == 0 {
                            _mm512_broadcast_i32x4(_mm256_castsi256_si128(lv))
                        } else {
                            _mm512_broadcast_i32x4(_mm256_extracti128_si256::<1>(lv))
                        };
                        let v0 = 32 * half + 8 * gi + 4 * hh;
                        let xv = |g: usize| join_at(x0.add(32 * (v0 + g)), x1.add(32 * (v0 + g)));
                        let mut sj = _mm512_setzero_si512();
                        sj = _mm512_dpbusd_epi32(sj, group!(h, 0), xv(0));
                        sj = _mm512_dpbusd_epi32(sj, group!(h, 1), xv(1));
                        sj = _mm512_dpbusd_epi32(sj, group!(h, 2), xv(2));
                        sj = _mm512_dpbusd_epi32(sj, group!(h, 3), xv(3));
                        let scale = *scales.add(8 * half + 2 * gi + hh) as i32;
                        s = _mm512_add_epi32(s, _mm512_mullo_epi32(sj, _mm512_set1_epi32(scale)));
                    }
                }
            }
            add_scaled(&mut acc[r], s, f16_at(b.add(208)), dx);
        }
    }
    let mut out = [[[0.0f32; 8]; 2]; TILE_ROWS];
    for r in 0..TILE_ROWS {
        store16(&mut out[r], acc[r]);
    }
    out
}

/// `mask & [four bytes at p]` in every 32-bit lane: one `vpandd` with a broadcast memory
/// operand. Written as asm because the optimiser, given the intrinsics, either moved the `and`
/// ahead of the broadcast (a scalar `and`, then a `vpbroadcastd` from a register, which takes a
/// shuffle port) or kept the broadcast of the low-nibble pass in a register for the high-nibble
/// pass, spilling 32 of them to the stack per chunk.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn and_broadcast(p: *const u8, mask: __m512i) -> __m512i {
    let w: __m512i;
    // SAFETY: the caller guarantees four readable bytes at `p` (no alignment needed); the
    // instruction only reads them and writes `w`.
    unsafe {
        std::arch::asm!(
            "vpandd {w}, {mask}, dword ptr [{p}]{{1to16}}",
            w = lateout(zmm_reg) w,
            mask = in(zmm_reg) mask,
            p = in(reg) p,
            options(readonly, nostack, preserves_flags)
        );
    }
    w
}

/// A Q4_K tile of four rows by four octets (32 tokens, two registers per row): each weight
/// broadcast feeds two `vpdpbusd` and each pair of activation loads four rows, half the
/// nibble work per product of [`tile_q4_k`] and no `pshufd`. The four weight bytes of a group
/// come from memory by an embedded broadcast and are masked in place: `0x0F` gives sub-block
/// `2c`'s levels, `0xF0` sub-block `2c + 1`'s times 16, which the low sub-blocks match by taking
/// `16 * scale`; the super-block sum is then `16 s`, shifted back exactly (every term is a
/// multiple of 16). `|16 s| <= 16 * 8 * 63 * 32 * 15 * 128 < 2^29`, so nothing wraps. The
/// integers `s` and `m` are [`tile_q4_k`]'s and the floats its per-lane operations, so the
/// bits are the AVX2 tile's.
///
/// # Safety
/// As [`tile`], for Q4_K rows and four Q8_K octets.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile4_q4_k(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; 4],
) -> [[[f32; 8]; 4]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_k_blocks(nb, true));
    let masks = [_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0xF0u8 as i8)];
    // The float sums live in memory, `[row][pair]` (lanes 0..8 octet 2 pair, 8..16 octet
    // 2 pair + 1), read and written once per super-block: kept in registers they pushed the
    // sub-block sums, used 64 times as often, onto the stack.
    let mut acc = [[[0.0f32; 16]; 2]; TILE_ROWS];
    let mut acc_m = [[[0.0f32; 16]; 2]; TILE_ROWS];
    for ib in 0..nb {
        let xq: [*const u8; 4] = std::array::from_fn(|o| xs[o].qs.as_ptr().add(2048 * ib) as *const u8);
        let bs: [*const u8; 4] = std::array::from_fn(|o| xs[o].bsums.as_ptr().add(128 * ib) as *const u8);
        let b: [*const u8; TILE_ROWS] = std::array::from_fn(|r| rows[r].add(144 * ib));
        let mut scales_mins = [[0i16; 16]; TILE_ROWS];
        let mut scales = [[0i32; 8]; TILE_ROWS];
        for r in 0..TILE_ROWS {
            _mm256_storeu_si256(scales_mins[r].as_mut_ptr() as *mut __m256i, super::avx2::scales_mins_k4(b[r].add(4)));
            for j in 0..8 {
                let scale = scales_mins[r][j] as i32;
                scales[r][j] = if j % 2 == 0 { 16 * scale } else { scale };
            }
        }
        let mut s = [[_mm512_setzero_si512(); 2]; TILE_ROWS];
        // One sub-block per pass of a loop the optimiser keeps rolled: unrolled, it
        // interleaved the two nibble passes of a chunk and spilled half the operands.
        for j in 0..8 {
            {
                let (c, mask) = (j / 2, masks[j % 2]);
                let mut sj = [[_mm512_setzero_si512(); 2]; TILE_ROWS];
                for g in 0..8 {
                    let v = 32 * (8 * j + g);
                    let x = [join_at(xq[0].add(v), xq[1].add(v)), join_at(xq[2].add(v), xq[3].add(v))];
                    for r in 0..TILE_ROWS {
                        let w = and_broadcast(b[r].add(16 + 32 * c + 4 * g), mask);
                        sj[r][0] = _mm512_dpbusd_epi32(sj[r][0], w, x[0]);
                        sj[r][1] = _mm512_dpbusd_epi32(sj[r][1], w, x[1]);
                    }
                }
                for r in 0..TILE_ROWS {
                    let scale = _mm512_set1_epi32(scales[r][j]);
                    for p in 0..2 {
                        s[r][p] = _mm512_add_epi32(s[r][p], _mm512_mullo_epi32(sj[r][p], scale));
                    }
                }
            }
        }
        let dx = [scales_dx(&[xs[0], xs[1]], ib), scales_dx(&[xs[2], xs[3]], ib)];
        for r in 0..TILE_ROWS {
            let (dw, dmin) = (f16_at(b[r]), f16_at(b[r].add(2)));
            for p in 0..2 {
                let mut m = _mm512_setzero_si512();
                for j in 0..8 {
                    let pair = join_at(bs[2 * p].add(32 * j), bs[2 * p + 1].add(32 * j));
                    m = _mm512_dpwssd_epi32(m, pair, _mm512_set1_epi16(scales_mins[r][8 + j]));
                }
                add_scaled_at(&mut acc[r][p], _mm512_srai_epi32::<4>(s[r][p]), dw, dx[p]);
                add_scaled_at(&mut acc_m[r][p], m, dmin, dx[p]);
            }
        }
    }
    quad_out(|r, p| _mm512_sub_ps(_mm512_loadu_ps(acc[r][p].as_ptr()), _mm512_loadu_ps(acc_m[r][p].as_ptr())))
}

/// A Q4_0 tile of four rows by four octets (32 tokens), as [`tile4_q4_k`]: each weight group
/// is one broadcast `vpandd` feeding two `vpdpbusd`, the low nibbles (values `4 g..4 g + 4`)
/// masked by `0x0F` and the high ones (values `16 + 4 g..`) by `0xF0`, so the high sum comes
/// out times 16 and is shifted back exactly. The integer per block is [`tile`]'s, `sum(u * x) -
/// 8 sum(x)`, and the floats its per-lane operations, so the bits are the AVX2 tile's.
///
/// # Safety
/// As [`tile`], for Q4_0 rows and four octets.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile4_q4_0(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; 4],
) -> [[[f32; 8]; 4]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_0_blocks(nb, true));
    let (lo, hi) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0xF0u8 as i8));
    let bb = block_bytes(Q4_0);
    // `[row][pair]` as in `tile4_q4_k`, in memory for the same reason.
    let mut acc = [[[0.0f32; 16]; 2]; TILE_ROWS];
    for ib in 0..nb {
        let xq: [*const u8; 4] = std::array::from_fn(|o| xs[o].qs.as_ptr().add(256 * ib) as *const u8);
        let b: [*const u8; TILE_ROWS] = std::array::from_fn(|r| rows[r].add(bb * ib));
        let pair_at = |p: usize, v: usize| join_at(xq[2 * p].add(32 * v), xq[2 * p + 1].add(32 * v));
        // The level offset: 8 times each token's block sum, off the low sum's start.
        let start: [__m512i; 2] = std::array::from_fn(|p| {
            let sums = join_at(
                xs[2 * p].sums.as_ptr().add(8 * ib) as *const u8,
                xs[2 * p + 1].sums.as_ptr().add(8 * ib) as *const u8,
            );
            _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<3>(sums))
        });
        let mut s_lo = [start; TILE_ROWS];
        let mut s_hi = [[_mm512_setzero_si512(); 2]; TILE_ROWS];
        for g in 0..4 {
            let x_lo = [pair_at(0, g), pair_at(1, g)];
            let x_hi = [pair_at(0, 4 + g), pair_at(1, 4 + g)];
            for r in 0..TILE_ROWS {
                let w = and_broadcast(b[r].add(2 + 4 * g), lo);
                s_lo[r][0] = _mm512_dpbusd_epi32(s_lo[r][0], w, x_lo[0]);
                s_lo[r][1] = _mm512_dpbusd_epi32(s_lo[r][1], w, x_lo[1]);
                let w = and_broadcast(b[r].add(2 + 4 * g), hi);
                s_hi[r][0] = _mm512_dpbusd_epi32(s_hi[r][0], w, x_hi[0]);
                s_hi[r][1] = _mm512_dpbusd_epi32(s_hi[r][1], w, x_hi[1]);
            }
        }
        let dx: [__m512; 2] = std::array::from_fn(|p| scales_dx(&[xs[2 * p], xs[2 * p + 1]], ib));
        for r in 0..TILE_ROWS {
            let dw = f16_at(b[r]);
            for p in 0..2 {
                let s = _mm512_add_epi32(s_lo[r][p], _mm512_srai_epi32::<4>(s_hi[r][p]));
                add_scaled_at(&mut acc[r][p], s, dw, dx[p]);
            }
        }
    }
    quad_out(|r, p| _mm512_loadu_ps(acc[r][p].as_ptr()))
}
