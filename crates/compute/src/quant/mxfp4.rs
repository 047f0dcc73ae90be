//! MXFP4 (OCP microscaling FP4): 32 E2M1 values sharing one E8M0 power-of-two scale.
//!
//! Layout (ggml/src/ggml-common.h): `block_mxfp4 { u8 e; u8 qs[16] }`, nibble order as Q4_0.
//! ggml stores the E2M1 values doubled as integers (`kvalues_mxfp4`) and halves the scale instead
//! (`GGML_E8M0_TO_FP32_HALF`, ggml/src/ggml-impl.h), so every product is exact.

/// `kvalues_mxfp4`: E2M1 values times two.
pub(crate) const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// 2^(e - 128): half the E8M0 scale, built from bits (subnormal for e < 2).
#[inline(always)]
pub(crate) fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { (e as u32 - 1) << 23 };
    f32::from_bits(bits)
}

#[inline(always)]
pub(crate) fn dequantize_mxfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(17).zip(dst.chunks_exact_mut(32)) {
        let d = e8m0_to_f32_half(b[0]);
        let qs = &b[1..17];
        for j in 0..16 {
            y[j] = KVALUES_MXFP4[(qs[j] & 0xF) as usize] as f32 * d;
            y[j + 16] = KVALUES_MXFP4[(qs[j] >> 4) as usize] as f32 * d;
        }
    }
}

/// `quantize_row_mxfp4_ref`: the shared exponent is floor(log2(amax)) - 2, so the largest value
/// maps near the top of E2M1's range (6 = 1.5 * 2^2); each value takes the nearest grid point,
/// the first one on ties.
pub(crate) fn quantize_mxfp4(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(17)) {
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0) as u8 } else { 0 };
        let d = e8m0_to_f32_half(e);
        b[0] = e;
        let nearest = |v: f32| -> u8 {
            let mut best = 0usize;
            let mut best_err = (KVALUES_MXFP4[0] as f32 * d - v).abs();
            for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
                let err = (k as f32 * d - v).abs();
                if err < best_err {
                    best = i;
                    best_err = err;
                }
            }
            best as u8
        };
        for j in 0..16 {
            b[1 + j] = nearest(x[j]) | (nearest(x[j + 16]) << 4);
        }
    }
}
