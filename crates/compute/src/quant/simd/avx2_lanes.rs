//! AVX2 prefill tiles with one token per 32-bit lane (Q4_0, Q4_1, Q5_0 and Q8_0 with Q8_0-style
//! activations, Q4_K and Q6_K with Q8_K ones): four weight rows by sixteen tokens (two octets),
//! the weights read from the GGUF blocks as stored and the activations in the token-octet
//! layout of [`TokenOctet`].
//!
//! Why lanes per token: the 4 x 4 tiles of `avx2_tiles` produce, per (row, token, block), a
//! vector of partial sums that needs horizontal adds to become one number (twelve `phadd` per
//! 4 x 4 block, three micro-ops each on Zen 3), plus a `madd` per `maddubs`. Here a vector of
//! activations holds four consecutive values of each of eight tokens, and the weight side is
//! the same four values of one row broadcast to every lane (`pshufd` of the 16-value half of
//! the block broadcast to both 128-bit lanes): every `maddubs` adds to the eight tokens' own
//! lanes, the i16 partial sums of a whole block are added without overflow, and one `madd`
//! turns them into the eight tokens' exact block sums. No horizontal add at all, and each
//! shuffled weight group serves two octets. Q8_0's signed levels need a `sign` per `maddubs`
//! and an i32 step after each (two products can reach 2 * 128 * 127), and still gain: 40 -> 48
//! GMAC/s on one thread against the 4 x 4 tile it replaced (`quant_speed`'s
//! `prefill_matmul_speed`, Q8_0 2048 x 2048 and 8192 x 2048 by 128 tokens, three alternating
//! rounds each).
//!
//! Bits: per (row, token) and block, the exact integer sum `s` (minus `8 * sum(x)` or
//! `16 * sum(x)` for Q4_0/Q5_0, whose levels are kept unsigned), then
//! `acc = fma(float(s), d_w * d_x, acc)` (Q4_1: `acc_m = fma(float(sum(x)), m_w * d_x, acc_m)`,
//! result `acc + acc_m`): the operations of `avx2_tiles::rows8`, so prefill equals decode bit
//! for bit.

use std::arch::x86_64::*;

use super::super::qdot::TokenOctet;
use super::avx2::{broadcast_i16_index, scales_mins_k4};
use super::avx2_tiles::{block_bytes, levels, Q4_0, Q4_1, Q5_0, Q8_0};

/// Weight rows per tile.
pub(in crate::quant) const TILE_ROWS: usize = 4;

/// The f16 at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// A block's unsigned levels as two vectors that each hold one 16-value half in both 128-bit
/// lanes (values 0..16, values 16..32), so `pshufd` can give any four consecutive values to all
/// eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn halves<const T: u8>(b: *const u8) -> [__m256i; 2] {
    let nibbles = |p: *const u8| {
        let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
        let m4 = _mm256_set1_epi8(0x0F);
        [_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4)]
    };
    match T {
        Q4_0 => nibbles(b.add(2)),
        Q4_1 => nibbles(b.add(4)),
        _ => {
            let l = levels::<Q5_0>(b);
            [_mm256_permute2x128_si256(l, l, 0x00), _mm256_permute2x128_si256(l, l, 0x11)]
        }
    }
}

/// Values `4 g .. 4 g + 4` of a half (g in 0..4) in every 32-bit lane.
macro_rules! group {
    ($half:expr, $g:literal) => {
        _mm256_shuffle_epi32::<{ $g * 0x55 }>($half)
    };
}

/// The exact block sums `sum_j level_j * x_j` of one weight block (its `halves`) with `N`
/// octets of tokens, as eight i32 lanes per octet; `xq[o]` points at octet `o`'s 256 bytes of
/// the block. Each weight group is shuffled once for all octets.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sums<const T: u8, const N: usize>(h: [__m256i; 2], xq: [*const i8; N]) -> [__m256i; N] {
    let x = |o: usize, v: usize| _mm256_loadu_si256(xq[o].add(32 * v) as *const __m256i);
    let ones = _mm256_set1_epi16(1);
    let groups = |v: __m256i| [group!(v, 0), group!(v, 1), group!(v, 2), group!(v, 3)];
    // Per octet, the i16 sum of the four products of half `i`'s groups.
    let half_sums = |i: usize, w: [__m256i; 4]| -> [__m256i; N] {
        std::array::from_fn(|o| {
            let p: [__m256i; 4] = std::array::from_fn(|g| _mm256_maddubs_epi16(w[g], x(o, 4 * i + g)));
            _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]))
        })
    };
    match T {
        // Levels <= 15, |x| <= 127: a maddubs lane is at most 3810 in magnitude, eight fit i16.
        Q4_0 | Q4_1 => {
            let (lo, hi) = (half_sums(0, groups(h[0])), half_sums(1, groups(h[1])));
            std::array::from_fn(|o| _mm256_madd_epi16(_mm256_add_epi16(lo[o], hi[o]), ones))
        }
        // Q5_0: levels <= 31, a lane is at most 7874, four fit i16.
        _ => {
            let (lo, hi) = (half_sums(0, groups(h[0])), half_sums(1, groups(h[1])));
            std::array::from_fn(|o| _mm256_add_epi32(_mm256_madd_epi16(lo[o], ones), _mm256_madd_epi16(hi[o], ones)))
        }
    }
}

/// What is subtracted from the unsigned levels' block sums, per unit of `sum(x)`.
const fn level_offset(t: u8) -> i32 {
    match t {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    }
}

/// A tile of dot products: `out[r][o][t]` is weight row `rows[r]` times token `t` of octet
/// `xs[o]`. Two octets (16 tokens) share each shuffled weight group; one is for a last odd
/// octet.
///
/// # Safety
/// AVX2, FMA and F16C must be available; every `rows[i]` must point at `nb` blocks of `T`;
/// every octet must hold at least `nb` blocks (checked).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile<const T: u8, const N: usize>(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_0_blocks(nb, true));
    let mut acc = [[_mm256_setzero_ps(); N]; TILE_ROWS];
    let mut acc_m = [[_mm256_setzero_ps(); N]; TILE_ROWS];
    for ib in 0..nb {
        let xq: [*const i8; N] = std::array::from_fn(|o| xs[o].qs.as_ptr().add(256 * ib));
        let dx: [__m256; N] = std::array::from_fn(|o| _mm256_loadu_ps(xs[o].d.as_ptr().add(8 * ib)));
        let sums: [__m256i; N] =
            std::array::from_fn(|o| _mm256_loadu_si256(xs[o].sums.as_ptr().add(8 * ib) as *const __m256i));
        let at = ib * block_bytes(T);
        for r in 0..TILE_ROWS {
            let b = rows[r].add(at);
            let s = block_sums::<T, N>(halves::<T>(b), xq);
            let dw = _mm256_set1_ps(f16_at(b));
            for o in 0..N {
                let s = if level_offset(T) != 0 {
                    _mm256_sub_epi32(s[o], _mm256_mullo_epi32(sums[o], _mm256_set1_epi32(level_offset(T))))
                } else {
                    s[o]
                };
                acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx[o]), acc[r][o]);
            }
            if T == Q4_1 {
                let mw = _mm256_set1_ps(f16_at(b.add(2)));
                for o in 0..N {
                    acc_m[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[o]), _mm256_mul_ps(mw, dx[o]), acc_m[r][o]);
                }
            }
        }
    }
    let mut out = [[[0.0f32; 8]; N]; TILE_ROWS];
    for r in 0..TILE_ROWS {
        for o in 0..N {
            let v = if T == Q4_1 { _mm256_add_ps(acc[r][o], acc_m[r][o]) } else { acc[r][o] };
            _mm256_storeu_ps(out[r][o].as_mut_ptr(), v);
        }
    }
    out
}

/// A Q8_0 tile: `out[r][o][t]` is weight row `rows[r]` times token `t` of octet `xs[o]`.
///
/// Signed levels times signed activations: each group of four weights is broadcast to every
/// lane once per row and made non-negative (`sign(w, w)`), the activations take the weights'
/// signs (`sign(x, w)`), so one `maddubs` gives exact pair sums (at most 2 * 128 * 127, which
/// fits i16) and one `madd` widens them to i32 before the next group is added. The integers
/// are the block sums of `avx2_tiles::rows8`, and the floats follow it (`acc = fma(float(s),
/// d_w * d_x, acc)`), so prefill equals decode bit for bit.
///
/// # Safety
/// AVX2, FMA and F16C must be available; every `rows[i]` must point at `nb` Q8_0 blocks; every
/// octet must hold at least `nb` blocks (checked).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile_q8_0<const N: usize>(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_0_blocks(nb, false));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); N]; TILE_ROWS];
    for ib in 0..nb {
        let xq: [*const i8; N] = std::array::from_fn(|o| xs[o].qs.as_ptr().add(256 * ib));
        let dx: [__m256; N] = std::array::from_fn(|o| _mm256_loadu_ps(xs[o].d.as_ptr().add(8 * ib)));
        let at = ib * block_bytes(Q8_0);
        for r in 0..TILE_ROWS {
            let b = rows[r].add(at);
            let mut s = [_mm256_setzero_si256(); N];
            for g in 0..8 {
                let w = _mm256_set1_epi32((b.add(2 + 4 * g) as *const i32).read_unaligned());
                let w_abs = _mm256_sign_epi8(w, w);
                for o in 0..N {
                    let x = _mm256_loadu_si256(xq[o].add(32 * g) as *const __m256i);
                    let p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
                    s[o] = _mm256_add_epi32(s[o], _mm256_madd_epi16(p, ones));
                }
            }
            let dw = _mm256_set1_ps(f16_at(b));
            for o in 0..N {
                acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[o]), _mm256_mul_ps(dw, dx[o]), acc[r][o]);
            }
        }
    }
    let mut out = [[[0.0f32; 8]; N]; TILE_ROWS];
    for r in 0..TILE_ROWS {
        for o in 0..N {
            _mm256_storeu_ps(out[r][o].as_mut_ptr(), acc[r][o]);
        }
    }
    out
}

/// A Q4_K tile (Q8_K activations): `out[r][o][t]` is weight row `rows[r]` times token `t` of
/// octet `xs[o]`.
///
/// Per 32-value sub-block, the eight `maddubs` of a token's lanes add up in i16 (levels <= 15,
/// as for Q4_0) and one `madd` with the sub-block scale in every i16 lane gives each token's
/// scaled sum; the min term is one `madd` per sub-block of the pair of 16-value sums with the
/// sub-block min. The integers are those of `avx2_ktiles` (`s` and `m` per super-block), so the
/// floats are too: `acc = fma(float(s), d_w * d_x, acc)`, `acc_m = fma(float(m), dmin_w * d_x,
/// acc_m)`, result `acc - acc_m`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; every `rows[i]` must point at `nb` Q4_K super-blocks;
/// every octet must hold at least `nb` Q8_K blocks (checked).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile_q4_k<const N: usize>(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_k_blocks(nb, true));
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); N]; TILE_ROWS];
    let mut acc_m = [[_mm256_setzero_ps(); N]; TILE_ROWS];
    for ib in 0..nb {
        let xq: [*const i8; N] = std::array::from_fn(|o| xs[o].qs.as_ptr().add(2048 * ib));
        let bs: [*const i16; N] = std::array::from_fn(|o| xs[o].bsums.as_ptr().add(128 * ib));
        let x = |o: usize, v: usize| _mm256_loadu_si256(xq[o].add(32 * v) as *const __m256i);
        let dx: [__m256; N] = std::array::from_fn(|o| _mm256_loadu_ps(xs[o].d.as_ptr().add(8 * ib)));
        for r in 0..TILE_ROWS {
            let b = rows[r].add(144 * ib);
            let scales_mins = scales_mins_k4(b.add(4));
            let scales = _mm256_permute2x128_si256(scales_mins, scales_mins, 0x00);
            let mins = _mm256_permute2x128_si256(scales_mins, scales_mins, 0x11);
            let mut s = [_mm256_setzero_si256(); N];
            let mut m = [_mm256_setzero_si256(); N];
            for c in 0..4 {
                let q = [0, 16]
                    .map(|h| _mm256_broadcastsi128_si256(_mm_loadu_si128(b.add(16 + 32 * c + h) as *const __m128i)));
                // Sub-block 2c is the low nibbles of the chunk's 32 bytes, 2c + 1 the high ones.
                let sub =
                    [q.map(|v| _mm256_and_si256(v, m4)), q.map(|v| _mm256_and_si256(_mm256_srli_epi16(v, 4), m4))];
                for (i, halves) in sub.into_iter().enumerate() {
                    let j = 2 * c + i;
                    let w = [
                        group!(halves[0], 0),
                        group!(halves[0], 1),
                        group!(halves[0], 2),
                        group!(halves[0], 3),
                        group!(halves[1], 0),
                        group!(halves[1], 1),
                        group!(halves[1], 2),
                        group!(halves[1], 3),
                    ];
                    let scale = _mm256_shuffle_epi8(scales, broadcast_i16_index(j));
                    let min = _mm256_shuffle_epi8(mins, broadcast_i16_index(j));
                    for o in 0..N {
                        let p: [__m256i; 8] = std::array::from_fn(|g| _mm256_maddubs_epi16(w[g], x(o, 8 * j + g)));
                        let sum = _mm256_add_epi16(
                            _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])),
                            _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])),
                        );
                        s[o] = _mm256_add_epi32(s[o], _mm256_madd_epi16(sum, scale));
                        let pair = _mm256_loadu_si256(bs[o].add(16 * j) as *const __m256i);
                        m[o] = _mm256_add_epi32(m[o], _mm256_madd_epi16(pair, min));
                    }
                }
            }
            let (dw, dmin) = (_mm256_set1_ps(f16_at(b)), _mm256_set1_ps(f16_at(b.add(2))));
            for o in 0..N {
                acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[o]), _mm256_mul_ps(dw, dx[o]), acc[r][o]);
                acc_m[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m[o]), _mm256_mul_ps(dmin, dx[o]), acc_m[r][o]);
            }
        }
    }
    let mut out = [[[0.0f32; 8]; N]; TILE_ROWS];
    for r in 0..TILE_ROWS {
        for o in 0..N {
            _mm256_storeu_ps(out[r][o].as_mut_ptr(), _mm256_sub_ps(acc[r][o], acc_m[r][o]));
        }
    }
    out
}

/// A Q6_K tile (Q8_K activations): `out[r][o][t]` is weight row `rows[r]` times token `t` of
/// octet `xs[o]`.
///
/// Levels are taken unsigned (0..64) as in `avx2_ktiles`: two `maddubs` of a token's lanes add
/// up in i16 (a lane is at most 2 * 63 * 127), and one `madd` with the 16-value sub-block's
/// scale per pair gives each token's scaled sum; `32 * sum(scale * bsum)` comes off exactly
/// (one `madd` per pair of sub-blocks with the pair of 16-value sums). Same integers as the
/// decode kernel, so `acc = fma(float(s), d_w * d_x, acc)` gives the same bits.
///
/// # Safety
/// AVX2, FMA and F16C must be available; every `rows[i]` must point at `nb` Q6_K super-blocks;
/// every octet must hold at least `nb` Q8_K blocks (checked).
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::quant) unsafe fn tile_q6_k<const N: usize>(
    rows: &[*const u8; TILE_ROWS],
    nb: usize,
    xs: &[TokenOctet<'_>; N],
) -> [[[f32; 8]; N]; TILE_ROWS] {
    xs.iter().for_each(|x| x.assert_q8_k_blocks(nb, true));
    let (m4, m3) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    let mut acc = [[_mm256_setzero_ps(); N]; TILE_ROWS];
    for ib in 0..nb {
        let xq: [*const i8; N] = std::array::from_fn(|o| xs[o].qs.as_ptr().add(2048 * ib));
        let bs: [*const i16; N] = std::array::from_fn(|o| xs[o].bsums.as_ptr().add(128 * ib));
        let x = |o: usize, v: usize| _mm256_loadu_si256(xq[o].add(32 * v) as *const __m256i);
        let dx: [__m256; N] = std::array::from_fn(|o| _mm256_loadu_ps(xs[o].d.as_ptr().add(8 * ib)));
        for r in 0..TILE_ROWS {
            let b = rows[r].add(210 * ib);
            let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
            // Sub-block scales 0..8 and 8..16, each in both 128-bit lanes.
            let scales_by_half = [
                _mm256_permute2x128_si256(scales16, scales16, 0x00),
                _mm256_permute2x128_si256(scales16, scales16, 0x11),
            ];
            // |scale| <= 128, |bsum| <= 16 * 127: a madd lane, eight of them and times 32 fit i32.
            let mut s: [__m256i; N] = std::array::from_fn(|o| {
                let mut offset = _mm256_setzero_si256();
                for p in 0..8 {
                    let pair = _mm256_shuffle_epi8(scales_by_half[p / 4], i32_broadcast_index(p % 4));
                    let bsums = _mm256_loadu_si256(bs[o].add(16 * p) as *const __m256i);
                    offset = _mm256_add_epi32(offset, _mm256_madd_epi16(bsums, pair));
                }
                _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5))
            });
            for (half, half_scales) in scales_by_half.into_iter().enumerate() {
                let ql0 = _mm256_loadu_si256(b.add(64 * half) as *const __m256i);
                let ql1 = _mm256_loadu_si256(b.add(64 * half + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(b.add(128 + 32 * half) as *const __m256i);
                let high = |shift: i32| {
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), m3), 4)
                };
                // Values 32 gi .. 32 gi + 32 of this half, in order.
                let levels = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), high(0)),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), high(2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), high(4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), high(6)),
                ];
                for (gi, lv) in levels.into_iter().enumerate() {
                    let halves = [_mm256_permute2x128_si256(lv, lv, 0x00), _mm256_permute2x128_si256(lv, lv, 0x11)];
                    for (hh, h) in halves.into_iter().enumerate() {
                        let w = [group!(h, 0), group!(h, 1), group!(h, 2), group!(h, 3)];
                        let scale = _mm256_shuffle_epi8(half_scales, broadcast_i16_index(2 * gi + hh));
                        let v0 = 32 * half + 8 * gi + 4 * hh;
                        for (o, s) in s.iter_mut().enumerate() {
                            let p: [__m256i; 4] = std::array::from_fn(|g| _mm256_maddubs_epi16(w[g], x(o, v0 + g)));
                            let a = _mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), scale);
                            let c = _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), scale);
                            *s = _mm256_add_epi32(*s, _mm256_add_epi32(a, c));
                        }
                    }
                }
            }
            let dw = _mm256_set1_ps(f16_at(b.add(208)));
            for o in 0..N {
                acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[o]), _mm256_mul_ps(dw, dx[o]), acc[r][o]);
            }
        }
    }
    let mut out = [[[0.0f32; 8]; N]; TILE_ROWS];
    for r in 0..TILE_ROWS {
        for o in 0..N {
            _mm256_storeu_ps(out[r][o].as_mut_ptr(), acc[r][o]);
        }
    }
    out
}

/// Shuffle indices that broadcast 32-bit lane `p` (0..4) of a 128-bit half to all four lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i32_broadcast_index(p: usize) -> __m256i {
    let b = 4 * p as i32;
    _mm256_set1_epi32(b | ((b + 1) << 8) | ((b + 2) << 16) | ((b + 3) << 24))
}
