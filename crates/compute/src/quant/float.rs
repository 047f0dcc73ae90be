//! Plain float element types: F32, F16 and BF16 (one value per "block").
//!
//! F16 and BF16 widen to f32 exactly. Narrowing follows ggml: F16 rounds to nearest even (what
//! `GGML_FP32_TO_FP16` and numpy's `astype(float16)` do); BF16 is `ggml_compute_fp32_to_bf16`
//! (ggml/src/ggml-impl.h): quiet NaNs, round to nearest even, no flush of subnormals.

use std::sync::OnceLock;

use half::f16;

/// f32 rounded to f16 and back (how ggml stores, then uses, a block scale).
#[inline(always)]
pub(crate) fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// f16 bits to f32, exactly, NaN payloads and signalling bits kept.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        // Zero and subnormals: man * 2^-24 is exact in f32.
        0 => sign | (man as f32 * (1.0 / 16_777_216.0)).to_bits(),
        0x1f => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Reads a little-endian f16 at `b[0..2]` as f32.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// All 65536 f16 values widened, for whole F16 rows (256 KiB, built on first use).
fn f16_table() -> &'static [f32] {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(f16_to_f32).collect())
}

/// The bytes of `v` rounded to f16 (nearest even).
#[inline(always)]
pub(crate) fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

#[inline(always)]
pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

#[inline(always)]
pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    let table = f16_table();
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = table[u16::from_le_bytes([s[0], s[1]]) as usize];
    }
}

/// BF16 is the top half of an f32's bits.
#[inline(always)]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

#[inline(always)]
pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(4).zip(src) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&f16_bytes(*s));
    }
}

/// `ggml_compute_fp32_to_bf16`.
#[inline(always)]
pub(crate) fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        // NaN: keep the sign and payload's top bits, force quiet.
        return ((bits >> 16) | 64) as u16;
    }
    ((bits as u64 + (0x7fff + ((bits >> 16) & 1)) as u64) >> 16) as u16
}

pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (d, s) in dst.chunks_exact_mut(2).zip(src) {
        d.copy_from_slice(&f32_to_bf16(*s).to_le_bytes());
    }
}
