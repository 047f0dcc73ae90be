//! The non-linear 4-bit types IQ4_NL (32-value blocks) and IQ4_XS (256-value super-blocks).
//!
//! Both map a 4-bit index through the fixed table `kvalues_iq4nl` (ggml/src/ggml-common.h).
//! Layouts: `block_iq4_nl { f16 d; u8 qs[16] }` (nibble order as Q4_0: byte `j` holds values `j`
//! and `j + 16`); `block_iq4_xs { f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128] }`: eight
//! sub-blocks of 32, each with a 6-bit scale offset by 32 (low 4 bits in `scales_l`, nibble
//! `ib % 2` of byte `ib / 2`; high 2 bits at bit `2 * ib` of `scales_h`).

use super::float::f16_at;
use super::k_quants::QK_K;

/// `kvalues_iq4nl`.
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

pub(crate) fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b);
        let qs = &b[2..18];
        for j in 0..16 {
            y[j] = d * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
            y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
        }
    }
}

/// Sub-block scale `ib` (0..8) of an IQ4_XS block, still offset by 32.
#[inline(always)]
pub(crate) fn iq4_xs_scale(ib: usize, scales_h: u16, scales_l: &[u8]) -> i32 {
    let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
    let high = ((scales_h >> (2 * ib)) & 3) as u8;
    (low | (high << 4)) as i32
}

pub(crate) fn dequantize_iq4_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(136).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b);
        let scales_h = u16::from_le_bytes([b[2], b[3]]);
        let scales_l = &b[4..8];
        for (ib, (qs, y)) in b[8..136]
            .chunks_exact(16)
            .zip(y.chunks_exact_mut(32))
            .enumerate()
        {
            let dl = d * (iq4_xs_scale(ib, scales_h, scales_l) - 32) as f32;
            for j in 0..16 {
                y[j] = dl * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
                y[j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
            }
        }
    }
}
