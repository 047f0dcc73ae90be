//! AVX2 kernels (with FMA and F16C) for the quantized-activation dot products.
//!
//! Each weight block is unpacked in registers to 32 bytes of integer levels; the products with
//! the activation quants are summed by `maddubs` (u8 x i8 -> i16 pairs; signed weights go through
//! the `sign` trick) and `madd` (i16 pairs -> i32, multiplied by the sub-block scale on the way
//! for k-quants), as in llama.cpp's ggml-cpu/arch/x86/quants.c. No i16 sum can saturate: the
//! largest is 2 * 128 * 127 (Q8_0 weights).

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::super::iq4::{iq4_xs_scale, KVALUES_IQ4NL};
use super::super::k_quants::q3_k_scales;
use super::super::mxfp4::{e8m0_to_f32_half, KVALUES_MXFP4};
use super::super::qdot::ActRow;
use super::super::{float, k_quants, legacy};
use super::{SimdDequantize, SimdDot, SimdDot4};

pub(in crate::quant) fn detected() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

macro_rules! avx2_dequantizers {
    ($($name:ident => $path:path),* $(,)?) => {
        $(
            /// The portable dequantizer compiled for AVX2 (same operations, so the same bits).
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $name(src: &[u8], dst: &mut [f32]) {
                $path(src, dst)
            }
        )*
    };
}

avx2_dequantizers! {
    deq_bf16 => float::dequantize_bf16,
    deq_q4_0 => legacy::dequantize_q4_0,
    deq_q4_1 => legacy::dequantize_q4_1,
    deq_q5_0 => legacy::dequantize_q5_0,
    deq_q5_1 => legacy::dequantize_q5_1,
    deq_q8_0 => legacy::dequantize_q8_0,
    deq_q4_k => k_quants::dequantize_q4_k,
    deq_q5_k => k_quants::dequantize_q5_k,
    deq_q6_k => k_quants::dequantize_q6_k,
}

/// One 32-value block of a table type: the table values picked by the 32 nibbles at `qs` (byte
/// `j` gives value `j` from its low nibble and value `j + 16` from its high one), times `d`,
/// stored at `y[0..32]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lookup_block32(table: __m128i, qs: *const u8, d: f32, y: *mut f32) {
    let q = _mm_loadu_si128(qs as *const __m128i);
    let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, _mm_set1_epi8(0x0F)));
    let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)));
    let dv = _mm256_set1_ps(d);
    for (half, v) in [(0usize, lo), (16, hi)] {
        let a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        let b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
        // `d * value`, one rounding, as the portable decoder (products commute exactly).
        _mm256_storeu_ps(y.add(half), _mm256_mul_ps(dv, a));
        _mm256_storeu_ps(y.add(half + 8), _mm256_mul_ps(dv, b));
    }
}

/// The low eight bytes of `v`, as signed integers, converted to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn levels8_f32(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

/// Q2_K in ggml's block order: value `128n + 32j + l` is bits `2j..` of byte `32n + l`, scale
/// and min of its 16-value group; `dl * q - ml` (multiply, then subtract: the portable order).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn deq_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(84).zip(dst.chunks_exact_mut(256)) {
        let (d, dmin) = (f16_at(b.as_ptr().add(80)), f16_at(b.as_ptr().add(82)));
        let y = y.as_mut_ptr();
        for n in 0..2 {
            for j in 0..4 {
                for half in 0..2 {
                    let sc = b[8 * n + 2 * j + half];
                    let dl = _mm256_set1_ps(d * (sc & 0xF) as f32);
                    let ml = _mm256_set1_ps(dmin * (sc >> 4) as f32);
                    let q = _mm_loadu_si128(b.as_ptr().add(16 + 32 * n + 16 * half) as *const __m128i);
                    let lv = _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(2 * j as i32)), _mm_set1_epi8(3));
                    let out = y.add(128 * n + 32 * j + 16 * half);
                    for (k, v) in [lv, _mm_srli_si128(lv, 8)].into_iter().enumerate() {
                        let value = _mm256_sub_ps(_mm256_mul_ps(dl, levels8_f32(v)), ml);
                        _mm256_storeu_ps(out.add(8 * k), value);
                    }
                }
            }
        }
    }
}

/// Q3_K in ggml's block order: low 2 bits as Q2_K, minus 4 where bit `4n + j` of `hmask[l]` is
/// clear; `dl * q`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn deq_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(110).zip(dst.chunks_exact_mut(256)) {
        let scales = k_quants::q3_k_scales(&b[96..108]);
        let d = f16_at(b.as_ptr().add(108));
        let y = y.as_mut_ptr();
        for n in 0..2 {
            for j in 0..4 {
                let bit = _mm_set1_epi8((1u8 << (4 * n + j)) as i8);
                for half in 0..2 {
                    let dl = _mm256_set1_ps(d * (scales[8 * n + 2 * j + half] as i32 - 32) as f32);
                    let q = _mm_loadu_si128(b.as_ptr().add(32 + 32 * n + 16 * half) as *const __m128i);
                    let low = _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(2 * j as i32)), _mm_set1_epi8(3));
                    let hm = _mm_loadu_si128(b.as_ptr().add(16 * half) as *const __m128i);
                    let set = _mm_cmpeq_epi8(_mm_and_si128(hm, bit), bit);
                    let minus = _mm_andnot_si128(set, _mm_set1_epi8(4));
                    let lv = _mm_sub_epi8(low, minus);
                    let out = y.add(128 * n + 32 * j + 16 * half);
                    for (k, v) in [lv, _mm_srli_si128(lv, 8)].into_iter().enumerate() {
                        _mm256_storeu_ps(out.add(8 * k), _mm256_mul_ps(dl, levels8_f32(v)));
                    }
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn deq_iq4_nl(src: &[u8], dst: &mut [f32]) {
    let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
        lookup_block32(table, b.as_ptr().add(2), f16_at(b.as_ptr()), y.as_mut_ptr());
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn deq_mxfp4(src: &[u8], dst: &mut [f32]) {
    let table = _mm_loadu_si128(KVALUES_MXFP4.as_ptr() as *const __m128i);
    for (b, y) in src.chunks_exact(17).zip(dst.chunks_exact_mut(32)) {
        lookup_block32(table, b.as_ptr().add(1), e8m0_to_f32_half(b[0]), y.as_mut_ptr());
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn deq_iq4_xs(src: &[u8], dst: &mut [f32]) {
    let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
    for (b, y) in src.chunks_exact(136).zip(dst.chunks_exact_mut(256)) {
        let d = f16_at(b.as_ptr());
        let scales_h = u16::from_le_bytes([b[2], b[3]]);
        for ib in 0..8 {
            let dl = d * (iq4_xs_scale(ib, scales_h, &b[4..8]) - 32) as f32;
            lookup_block32(table, b.as_ptr().add(8 + 16 * ib), dl, y.as_mut_ptr().add(32 * ib));
        }
    }
}

/// F16 rows with F16C, 8 values at a time. F16C quiets signalling NaNs, so any group holding a
/// NaN is converted on the bits instead: the result is exactly the portable one.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn deq_f16(src: &[u8], dst: &mut [f32]) {
    let n = dst.len().min(src.len() / 2);
    let groups = n / 8;
    for g in 0..groups {
        let h = _mm_loadu_si128(src.as_ptr().add(16 * g) as *const __m128i);
        let magnitude = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
        let nan = _mm_cmpgt_epi16(magnitude, _mm_set1_epi16(0x7c00));
        if _mm_movemask_epi8(nan) == 0 {
            _mm256_storeu_ps(dst.as_mut_ptr().add(8 * g), _mm256_cvtph_ps(h));
        } else {
            float::dequantize_f16(&src[16 * g..16 * g + 16], &mut dst[8 * g..8 * g + 8]);
        }
    }
    float::dequantize_f16(&src[16 * groups..2 * n], &mut dst[8 * groups..n]);
}

/// An AVX2 build of the row dequantizer of `dtype`.
pub(in crate::quant) fn dequantizer(dtype: GgmlType) -> Option<SimdDequantize> {
    use GgmlType::*;
    Some(match dtype {
        F16 => deq_f16,
        BF16 => deq_bf16,
        Q4_0 => deq_q4_0,
        Q4_1 => deq_q4_1,
        Q5_0 => deq_q5_0,
        Q5_1 => deq_q5_1,
        Q8_0 => deq_q8_0,
        Q2_K => deq_q2_k,
        Q3_K => deq_q3_k,
        Q4_K => deq_q4_k,
        Q5_K => deq_q5_k,
        Q6_K => deq_q6_k,
        IQ4_NL => deq_iq4_nl,
        IQ4_XS => deq_iq4_xs,
        MXFP4 => deq_mxfp4,
        _ => return None,
    })
}

/// The four-row kernel of `dtype`, for prefill: the weight row is unpacked once per block for
/// four tokens. Each token's result is bit-identical to [`kernel`]'s.
pub(super) fn kernel4(dtype: GgmlType) -> Option<SimdDot4> {
    use GgmlType::*;
    Some(match dtype {
        Q4_0 => dot4_blocks32::<{ self::Q4_0 }>,
        Q4_1 => dot4_blocks32::<{ self::Q4_1 }>,
        Q5_0 => dot4_blocks32::<{ self::Q5_0 }>,
        Q5_1 => dot4_blocks32::<{ self::Q5_1 }>,
        Q8_0 => dot4_blocks32::<{ self::Q8_0 }>,
        IQ4_NL => dot4_blocks32::<{ self::IQ4_NL }>,
        MXFP4 => dot4_blocks32::<{ self::MXFP4 }>,
        Q4_K => dot4_q4_k,
        Q5_K => dot4_q5_k,
        Q6_K => dot4_q6_k,
        Q2_K => dot4_q2_k,
        Q3_K => dot4_q3_k,
        IQ4_XS => dot4_iq4_xs,
        _ => return None,
    })
}

pub(super) fn kernel(dtype: GgmlType) -> Option<SimdDot> {
    use GgmlType::*;
    Some(match dtype {
        Q4_0 => dot1_blocks32::<{ self::Q4_0 }>,
        Q4_1 => dot1_blocks32::<{ self::Q4_1 }>,
        Q5_0 => dot1_blocks32::<{ self::Q5_0 }>,
        Q5_1 => dot1_blocks32::<{ self::Q5_1 }>,
        Q8_0 => dot1_blocks32::<{ self::Q8_0 }>,
        IQ4_NL => dot1_blocks32::<{ self::IQ4_NL }>,
        MXFP4 => dot1_blocks32::<{ self::MXFP4 }>,
        Q2_K => dot_q2_k,
        Q3_K => dot_q3_k,
        Q4_K => dot_q4_k,
        Q5_K => dot_q5_k,
        Q6_K => dot_q6_k,
        IQ4_XS => dot_iq4_xs,
        _ => return None,
    })
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_f32x8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load256(p: *const i8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// Unsigned u8 levels times signed i8 quants, pairs summed to i16 then multiplied by `scale`
/// (per i16 lane) and summed to i32. Signed levels go in as `|w|` with `x * sign(w)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn madd_u8_i8(w: __m256i, x: __m256i, scale: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scale)
}

/// The 32 nibbles of 16 bytes in ggml's order: low nibbles (values 0..16), then high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let q = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// 32 bits (little-endian at `p`) to 32 bytes: 0xFF where the bit is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    let bits = (p as *const u32).read_unaligned();
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0),
    );
    // Each byte keeps all bits but its own: OR gives 0xFF exactly when its own bit is set.
    let others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1))
}

/// A 16-entry i8 table in both 128-bit lanes, for `shuffle_epi8` lookups.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn table16(values: &[i8; 16]) -> __m256i {
    let t = _mm_loadu_si128(values.as_ptr() as *const __m128i);
    _mm256_set_m128i(t, t)
}

// The 32-value types, one monomorphised loop each (a const parameter rather than closures, so
// every helper inlines into the AVX2 function).
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;
const IQ4_NL: u8 = 5;
const MXFP4: u8 = 6;

const fn block_bytes32(t: u8) -> usize {
    match t {
        Q4_0 | IQ4_NL => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        Q8_0 => 34,
        _ => 17,
    }
}

/// Levels are unsigned (0..32) for the types with a min, signed otherwise.
const fn has_min(t: u8) -> bool {
    matches!(t, Q4_1 | Q5_1)
}

/// The 32 levels of the block at `b`; `table` is the lookup table of IQ4_NL/MXFP4.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn levels32<const T: u8>(b: *const u8, table: __m256i) -> __m256i {
    match T {
        Q4_0 => _mm256_sub_epi8(nibbles32(b.add(2)), _mm256_set1_epi8(8)),
        Q4_1 => nibbles32(b.add(4)),
        Q5_0 => {
            // level = nibble + 16 * bit - 16: where the bit is clear, setting 0xF0 subtracts 16.
            let clear = _mm256_andnot_si256(bytes_from_bits_32(b.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
            _mm256_or_si256(nibbles32(b.add(6)), clear)
        }
        Q5_1 => {
            _mm256_or_si256(nibbles32(b.add(8)), _mm256_and_si256(bytes_from_bits_32(b.add(4)), _mm256_set1_epi8(0x10)))
        }
        Q8_0 => load256(b.add(2) as *const i8),
        IQ4_NL => _mm256_shuffle_epi8(table, nibbles32(b.add(2))),
        _ => _mm256_shuffle_epi8(table, nibbles32(b.add(1))),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale32<const T: u8>(b: *const u8) -> f32 {
    if T == MXFP4 {
        e8m0_to_f32_half(*b)
    } else {
        f16_at(b)
    }
}

/// One block's integer sums with `N` activation rows, times `d_w * d_x`, added to `acc[i]`,
/// and the min terms to `acc_min[i]`. The weight block is unpacked once for all rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block32<const T: u8, const N: usize>(
    w: &[u8],
    xs: &[ActRow<'_>; N],
    ib: usize,
    table: __m256i,
    acc: &mut [__m256; N],
    acc_min: &mut [f32; N],
) {
    let b = w.as_ptr().add(ib * block_bytes32(T));
    let lv = levels32::<T>(b, table);
    // Signed levels go through `|w| * (x * sign(w))`; |w| is shared by the rows.
    let lv_u = if has_min(T) { lv } else { _mm256_sign_epi8(lv, lv) };
    let d = scale32::<T>(b);
    let ones = _mm256_set1_epi16(1);
    for i in 0..N {
        let x = &xs[i];
        let xq = load256(x.qs.as_ptr().add(ib * 32));
        let xq = if has_min(T) { xq } else { _mm256_sign_epi8(xq, lv) };
        let sumi = madd_u8_i8(lv_u, xq, ones);
        let dx = *x.d.get_unchecked(ib);
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), acc[i]);
        if has_min(T) {
            acc_min[i] += f16_at(b.add(2)) * dx * *x.sums.get_unchecked(ib) as f32;
        }
    }
}

/// `N` dot products of one row of a 32-value type; each row's result is bit-identical to the
/// `N = 1` call (same operations in the same order per row).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_blocks32<const T: u8, const N: usize>(w: &[u8], xs: &[ActRow<'_>; N]) -> [f32; N] {
    let nb = w.len() / block_bytes32(T);
    for x in xs {
        assert!(x.qs.len() >= nb * 32 && x.d.len() >= nb && x.sums.len() >= nb, "activation row too short");
    }
    let table = table16(if T == MXFP4 { &KVALUES_MXFP4 } else { &KVALUES_IQ4NL });
    // Two independent accumulators so consecutive blocks do not wait on each other's FMA.
    let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); N], [_mm256_setzero_ps(); N]);
    let (mut min0, mut min1) = ([0.0f32; N], [0.0f32; N]);
    let mut ib = 0;
    while ib + 1 < nb {
        block32::<T, N>(w, xs, ib, table, &mut acc0, &mut min0);
        block32::<T, N>(w, xs, ib + 1, table, &mut acc1, &mut min1);
        ib += 2;
    }
    if ib < nb {
        block32::<T, N>(w, xs, ib, table, &mut acc0, &mut min0);
    }
    let mut out = [0.0f32; N];
    for i in 0..N {
        out[i] = hsum_f32x8(_mm256_add_ps(acc0[i], acc1[i])) + (min0[i] + min1[i]);
    }
    out
}

unsafe fn dot1_blocks32<const T: u8>(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_blocks32::<T, 1>(w, &[x])[0]
}

unsafe fn dot4_blocks32<const T: u8>(w: &[u8], xs: &[ActRow<'_>; 4]) -> [f32; 4] {
    dot_blocks32::<T, 4>(w, xs)
}

/// A scale vector for one 32-value group made of two 16-value sub-blocks: `lo` for the first
/// eight i16 lanes (values 0..16), `hi` for the rest.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales_2x16(lo: i32, hi: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
}

/// `(n_superblocks, activation checks)` for the 256-value types.
#[inline(always)]
fn superblocks(w: &[u8], block_bytes: usize, x: &ActRow<'_>) -> usize {
    let nb = w.len() / block_bytes;
    assert!(x.qs.len() >= nb * 256 && x.d.len() >= nb && x.sums.len() >= nb * 16, "activation row too short");
    nb
}

unsafe fn dot_q2_k(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_q2_k_n::<1>(w, &[x])[0]
}

unsafe fn dot4_q2_k(w: &[u8], xs: &[ActRow<'_>; 4]) -> [f32; 4] {
    dot_q2_k_n::<4>(w, xs)
}

/// Q2_K with `N` activation rows; the weights are unpacked once.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q2_k_n<const N: usize>(w: &[u8], xs: &[ActRow<'_>; N]) -> [f32; N] {
    let mut nb = 0;
    for x in xs {
        nb = superblocks(w, 84, x);
    }
    let m3 = _mm256_set1_epi8(3);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut acc_min = [0.0f32; N];
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * 84);
        let sc = std::slice::from_raw_parts(b, 16);
        let mut sumi = [_mm256_setzero_si256(); N];
        for n in 0..2 {
            let q = _mm256_loadu_si256(b.add(16 + 32 * n) as *const __m256i);
            for j in 0..4 {
                let lv = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * j as i32)), m3);
                let g = 8 * n + 2 * j;
                let s = scales_2x16((sc[g] & 0xF) as i32, (sc[g + 1] & 0xF) as i32);
                for i in 0..N {
                    let xv = load256(xs[i].qs.as_ptr().add(ib * 256 + 128 * n + 32 * j));
                    sumi[i] = _mm256_add_epi32(sumi[i], madd_u8_i8(lv, xv, s));
                }
            }
        }
        let (d, dmin) = (f16_at(b.add(80)), f16_at(b.add(82)));
        for i in 0..N {
            let x = &xs[i];
            let bsums = &x.sums[ib * 16..ib * 16 + 16];
            let mut summ = 0i32;
            for g in 0..16 {
                summ += (sc[g] >> 4) as i32 * bsums[g] as i32;
            }
            let dx = x.d[ib];
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[i]), acc[i]);
            acc_min[i] += dmin * dx * summ as f32;
        }
    }
    let mut out = [0.0f32; N];
    for i in 0..N {
        out[i] = hsum_f32x8(acc[i]) - acc_min[i];
    }
    out
}

unsafe fn dot_q3_k(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_q3_k_n::<1>(w, &[x])[0]
}

unsafe fn dot4_q3_k(w: &[u8], xs: &[ActRow<'_>; 4]) -> [f32; 4] {
    dot_q3_k_n::<4>(w, xs)
}

/// Q3_K with `N` activation rows; the weights are unpacked once.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q3_k_n<const N: usize>(w: &[u8], xs: &[ActRow<'_>; N]) -> [f32; N] {
    let mut nb = 0;
    for x in xs {
        nb = superblocks(w, 110, x);
    }
    let (m3, m1) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let mut acc = [_mm256_setzero_ps(); N];
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * 110);
        let scales = q3_k_scales(std::slice::from_raw_parts(b.add(96), 12));
        let mut sc = [0i32; 16];
        for g in 0..16 {
            sc[g] = scales[g] as i32 - 32;
        }
        let hm = _mm256_loadu_si256(b as *const __m256i);
        let mut sumi = [_mm256_setzero_si256(); N];
        for n in 0..2 {
            let q = _mm256_loadu_si256(b.add(32 + 32 * n) as *const __m256i);
            for j in 0..4 {
                let shift = _mm_cvtsi32_si128(2 * j as i32);
                let low = _mm256_and_si256(_mm256_srl_epi16(q, shift), m3);
                let hbit = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128((4 * n + j) as i32)), m1);
                let lv = _mm256_or_si256(low, _mm256_slli_epi16(hbit, 2));
                let g = 8 * n + 2 * j;
                let s = scales_2x16(sc[g], sc[g + 1]);
                for i in 0..N {
                    let xv = load256(xs[i].qs.as_ptr().add(ib * 256 + 128 * n + 32 * j));
                    sumi[i] = _mm256_add_epi32(sumi[i], madd_u8_i8(lv, xv, s));
                }
            }
        }
        let d = f16_at(b.add(108));
        for i in 0..N {
            let x = &xs[i];
            // Levels are stored +4 (0..8) above; take 4 * sum(x) back out per sub-block.
            let bsums = &x.sums[ib * 16..ib * 16 + 16];
            let mut offset = 0i32;
            for g in 0..16 {
                offset += sc[g] * 4 * bsums[g] as i32;
            }
            let total = _mm256_sub_epi32(sumi[i], _mm256_setr_epi32(offset, 0, 0, 0, 0, 0, 0, 0));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[ib]), _mm256_cvtepi32_ps(total), acc[i]);
        }
    }
    let mut out = [0.0f32; N];
    for i in 0..N {
        out[i] = hsum_f32x8(acc[i]);
    }
    out
}

unsafe fn dot_q4_k(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_q45_k::<false, 1>(w, &[x])[0]
}

unsafe fn dot_q5_k(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_q45_k::<true, 1>(w, &[x])[0]
}

unsafe fn dot4_q4_k(w: &[u8], xs: &[ActRow<'_>; 4]) -> [f32; 4] {
    dot_q45_k::<false, 4>(w, xs)
}

unsafe fn dot4_q5_k(w: &[u8], xs: &[ActRow<'_>; 4]) -> [f32; 4] {
    dot_q45_k::<true, 4>(w, xs)
}

/// The 12 packed 6-bit scales and mins of a Q4_K/Q5_K super-block as 16 i16 lanes: scales
/// 0..8 in the low 128 bits, mins 0..8 in the high ones (ggml's `utmp` rearrangement of
/// `ggml_vec_dot_q4_K_q8_K`, the same values as `scale_min_k4`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scales_mins_k4(packed: *const u8) -> __m256i {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| (packed.add(4 * i) as *const u32).read_unaligned();
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let scales_lo = u0 & LOW6;
    let scales_hi = (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4);
    let mins_lo = u1 & LOW6;
    let mins_hi = ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4);
    _mm256_cvtepu8_epi16(_mm_setr_epi32(scales_lo as i32, scales_hi as i32, mins_lo as i32, mins_hi as i32))
}

/// Shuffle indices giving lane `j` (0..8) of a 128-bit half to the low eight i16 lanes and lane
/// `j + 1` to the high eight (a 32-value group of two 16-value sub-blocks, as `scales_2x16`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pair_broadcast_index(j: usize) -> __m256i {
    let lane = |j: usize| (2 * j as i16) | ((2 * j as i16 + 1) << 8);
    _mm256_set_m128i(_mm_set1_epi16(lane(j + 1)), _mm_set1_epi16(lane(j)))
}

/// Shuffle indices that broadcast i16 lane `j` (0..8) of a 128-bit half to all eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn broadcast_i16_index(j: usize) -> __m256i {
    let pair = (2 * j as i16) | ((2 * j as i16 + 1) << 8);
    _mm256_set1_epi16(pair)
}

/// The exact integer `sum_j mins[j] * (bsums[2j] + bsums[2j + 1])` of one Q8_K block, where
/// `mins` holds eight i16 values and `bsums` points at its 16 i16 sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn min_sum_k4(mins: __m128i, bsums: *const i16) -> i32 {
    let b = _mm256_loadu_si256(bsums as *const __m256i);
    // |bsum| <= 16 * 128, so a pair sum fits i16, and mins (<= 63) times that fits i32.
    let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    hsum_i32x4(_mm_madd_epi16(mins, pairs))
}

/// The sum of four i32 lanes (exact, wrapping).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32x4(v: __m128i) -> i32 {
    let v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    let v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0b01));
    _mm_cvtsi128_si32(v)
}

/// Q4_K (`FIVE_BITS = false`) or Q5_K with `N` activation rows; the weights are unpacked once.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q45_k<const FIVE_BITS: bool, const N: usize>(w: &[u8], xs: &[ActRow<'_>; N]) -> [f32; N] {
    let block_bytes = if FIVE_BITS { 176 } else { 144 };
    let qs_at = if FIVE_BITS { 48 } else { 16 };
    let mut nb = 0;
    for x in xs {
        nb = superblocks(w, block_bytes, x);
    }
    let (m4, m1) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(1));
    let mut acc = [_mm256_setzero_ps(); N];
    let mut acc_min = [0.0f32; N];
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * block_bytes);
        let scales_mins = scales_mins_k4(b.add(4));
        let scales = _mm256_permute2x128_si256(scales_mins, scales_mins, 0x00);
        let mins = _mm256_extracti128_si256(scales_mins, 1);
        let hm = if FIVE_BITS { _mm256_loadu_si256(b.add(16) as *const __m256i) } else { _mm256_setzero_si256() };
        let mut sumi = [_mm256_setzero_si256(); N];
        for c in 0..4 {
            let q = _mm256_loadu_si256(b.add(qs_at + 32 * c) as *const __m256i);
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if FIVE_BITS {
                let b_lo = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(2 * c as i32)), m1);
                let b_hi = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(2 * c as i32 + 1)), m1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(b_lo, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(b_hi, 4));
            }
            let s_lo = _mm256_shuffle_epi8(scales, broadcast_i16_index(2 * c));
            let s_hi = _mm256_shuffle_epi8(scales, broadcast_i16_index(2 * c + 1));
            for i in 0..N {
                let xq = xs[i].qs.as_ptr().add(ib * 256);
                sumi[i] = _mm256_add_epi32(sumi[i], madd_u8_i8(lo, load256(xq.add(64 * c)), s_lo));
                sumi[i] = _mm256_add_epi32(sumi[i], madd_u8_i8(hi, load256(xq.add(64 * c + 32)), s_hi));
            }
        }
        let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
        for i in 0..N {
            let x = &xs[i];
            let summ = min_sum_k4(mins, x.sums.as_ptr().add(ib * 16));
            let dx = *x.d.get_unchecked(ib);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[i]), acc[i]);
            acc_min[i] += dmin * dx * summ as f32;
        }
    }
    let mut out = [0.0f32; N];
    for i in 0..N {
        out[i] = hsum_f32x8(acc[i]) - acc_min[i];
    }
    out
}

unsafe fn dot_q6_k(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_q6_k_n::<1>(w, &[x])[0]
}

unsafe fn dot4_q6_k(w: &[u8], xs: &[ActRow<'_>; 4]) -> [f32; 4] {
    dot_q6_k_n::<4>(w, xs)
}

/// Q6_K with `N` activation rows; the weights are unpacked once.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k_n<const N: usize>(w: &[u8], xs: &[ActRow<'_>; N]) -> [f32; N] {
    let mut nb = 0;
    for x in xs {
        nb = superblocks(w, 210, x);
    }
    let (m4, m3) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    let mut acc = [_mm256_setzero_ps(); N];
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * 210);
        // The 16 signed scales as i16 lanes: group g's scale is lane g.
        let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
        let scales_by_half =
            [_mm256_permute2x128_si256(scales16, scales16, 0x00), _mm256_permute2x128_si256(scales16, scales16, 0x11)];
        let mut sumi = [_mm256_setzero_si256(); N];
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
                for i in 0..N {
                    let xv = load256(xs[i].qs.as_ptr().add(ib * 256 + 128 * half + 32 * gi));
                    sumi[i] = _mm256_add_epi32(sumi[i], madd_u8_i8(lv, xv, s));
                }
            }
        }
        let d = f16_at(b.add(208));
        for i in 0..N {
            let x = &xs[i];
            // Levels are stored +32 (0..64); take 32 * sum(x) back out per sub-block. Exact:
            // |scale| <= 128 and |bsum| <= 16 * 128, so each madd pair fits i32.
            let bsums = _mm256_loadu_si256(x.sums.as_ptr().add(ib * 16) as *const __m256i);
            let per_pair = _mm256_madd_epi16(scales16, bsums);
            let offset =
                32 * hsum_i32x4(_mm_add_epi32(_mm256_castsi256_si128(per_pair), _mm256_extracti128_si256(per_pair, 1)));
            let total = _mm256_sub_epi32(sumi[i], _mm256_setr_epi32(offset, 0, 0, 0, 0, 0, 0, 0));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[ib]), _mm256_cvtepi32_ps(total), acc[i]);
        }
    }
    let mut out = [0.0f32; N];
    for i in 0..N {
        out[i] = hsum_f32x8(acc[i]);
    }
    out
}

unsafe fn dot_iq4_xs(w: &[u8], x: ActRow<'_>) -> f32 {
    dot_iq4_xs_n::<1>(w, &[x])[0]
}

unsafe fn dot4_iq4_xs(w: &[u8], xs: &[ActRow<'_>; 4]) -> [f32; 4] {
    dot_iq4_xs_n::<4>(w, xs)
}

/// IQ4_XS with `N` activation rows; the weights are unpacked once.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq4_xs_n<const N: usize>(w: &[u8], xs: &[ActRow<'_>; N]) -> [f32; N] {
    let mut nb = 0;
    for x in xs {
        nb = superblocks(w, 136, x);
    }
    let table = table16(&KVALUES_IQ4NL);
    let mut acc = [_mm256_setzero_ps(); N];
    for ib in 0..nb {
        let b = w.as_ptr().add(ib * 136);
        let scales_h = (b.add(2) as *const u16).read_unaligned();
        let scales_l = std::slice::from_raw_parts(b.add(4), 4);
        let mut sumi = [_mm256_setzero_si256(); N];
        for sb in 0..8 {
            let lv = _mm256_shuffle_epi8(table, nibbles32(b.add(8 + 16 * sb)));
            let lv_abs = _mm256_sign_epi8(lv, lv);
            let s = _mm256_set1_epi16((iq4_xs_scale(sb, scales_h, scales_l) - 32) as i16);
            for i in 0..N {
                let xv = load256(xs[i].qs.as_ptr().add(ib * 256 + 32 * sb));
                sumi[i] = _mm256_add_epi32(sumi[i], madd_u8_i8(lv_abs, _mm256_sign_epi8(xv, lv), s));
            }
        }
        let d = f16_at(b);
        for i in 0..N {
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[i].d[ib]), _mm256_cvtepi32_ps(sumi[i]), acc[i]);
        }
    }
    let mut out = [0.0f32; N];
    for i in 0..N {
        out[i] = hsum_f32x8(acc[i]);
    }
    out
}
