//! Dot products against 8-bit quantized activations, the way llama.cpp's `ggml_vec_dot_*_q8_*`
//! compute them: the activation row is quantized once (Q8_0-style blocks of 32 for the 32-value
//! weight types, Q8_K blocks of 256 for k-quants and IQ4_XS), then each weight block contributes
//! `d_w * d_x * sum(q_w * q_x)` (minus `m_w * d_x * sum(q_x)` for types with a min) with the sum
//! in integers.
//!
//! This file is the portable version: plain integer loops, one per type family, written for
//! clarity. `simd/` holds the vectorised kernels; they compute the same integer sums and differ
//! from these only in the order the per-block floats are added.

use gguf::GgmlType;
use rayon::prelude::*;

use super::float::{f16_at, round_f16};
use super::iq4::{iq4_xs_scale, KVALUES_IQ4NL};
use super::k_quants::{q3_k_scales, quantize_block_q8_k, scale_min_k4, QK_K};
use super::legacy::QK;
use super::mxfp4::{e8m0_to_f32_half, KVALUES_MXFP4};

/// Which activation quantization a weight type's dot product consumes.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ActKind {
    /// Blocks of 32: f16-rounded scale, 32 quants, and the sum of the quants (Q8_0 / Q8_1).
    Q8_0,
    /// Blocks of 256: f32 scale, 256 quants, 16 sums of 16 quants (Q8_K).
    Q8_K,
}

impl ActKind {
    pub(crate) fn for_weights(dtype: GgmlType) -> Option<ActKind> {
        use GgmlType::*;
        match dtype {
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4_NL | MXFP4 => Some(ActKind::Q8_0),
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS => Some(ActKind::Q8_K),
            _ => None,
        }
    }

    pub(crate) fn block_elems(self) -> usize {
        match self {
            ActKind::Q8_0 => QK,
            ActKind::Q8_K => QK_K,
        }
    }

    /// Sums stored per block.
    pub(crate) fn sums_per_block(self) -> usize {
        match self {
            ActKind::Q8_0 => 1,
            ActKind::Q8_K => QK_K / 16,
        }
    }
}

/// One quantized activation row: `d[b]` per block, `qs` per value, `sums` per block (Q8_0) or
/// per 16 values (Q8_K).
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub d: &'a [f32],
    pub qs: &'a [i8],
    pub sums: &'a [i16],
}

/// Activations of eight tokens laid out for the one-token-per-lane tile kernels
/// (`simd/avx2_lanes.rs`, `simd/neon_tiles.rs`): every four consecutive values of a row sit
/// side by side for the eight tokens, so one 32-byte load gives four values of each token.
#[derive(Clone, Copy)]
// Only the AVX2 and NEON tile kernels read the fields; other targets build the value and never
// use it.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(crate) struct TokenOctet<'a> {
    /// `qs[32 * (v / 4) + 4 * t + v % 4]`: value `v` of token `t` (`8 * k` bytes).
    pub qs: &'a [i8],
    /// `d[8 * ib + t]`: token `t`'s scale of block `ib`.
    pub d: &'a [f32],
    /// Q8_0-style blocks: `sums[8 * ib + t]`, token `t`'s quant sum of block `ib` (empty for
    /// Q8_K).
    pub sums: &'a [i32],
    /// Q8_K blocks: `bsums[16 * (8 * ib + p) + 2 * t + h]`, token `t`'s sum of the 16 quants
    /// `16 * (2 p + h)..` of block `ib`, so one load gives a pair of 16-value sums per token
    /// (empty for Q8_0).
    pub bsums: &'a [i16],
}

impl TokenOctet<'_> {
    /// Panics unless the octet holds `nb` Q8_0 blocks of its eight tokens (and their quant sums
    /// when `sums`): the tile kernels read them through raw pointers.
    pub fn assert_q8_0_blocks(&self, nb: usize, sums: bool) {
        assert!(
            self.qs.len() >= nb * 256 && self.d.len() >= nb * 8 && (!sums || self.sums.len() >= nb * 8),
            "activation octet too short"
        );
    }

    /// Panics unless the octet holds `nb` Q8_K blocks of its eight tokens (and their 16-value
    /// sums when `bsums`): the tile kernels read them through raw pointers.
    pub fn assert_q8_k_blocks(&self, nb: usize, bsums: bool) {
        assert!(
            self.qs.len() >= nb * 2048 && self.d.len() >= nb * 8 && (!bsums || self.bsums.len() >= nb * 128),
            "activation octet too short"
        );
    }
}

/// Quantized activations of several rows, stored back to back.
#[derive(Default)]
pub(crate) struct ActBuf {
    pub d: Vec<f32>,
    pub qs: Vec<i8>,
    pub sums: Vec<i16>,
    /// Quants regrouped by eight tokens (`build_octets`), [`TokenOctet::qs`] per octet.
    pub octet_qs: Vec<i8>,
    /// Scales regrouped by eight tokens, `[octet][block][token]`.
    pub octet_d: Vec<f32>,
    /// Block sums regrouped as `octet_d` (Q8_0-style blocks).
    pub octet_sums: Vec<i32>,
    /// 16-value sums regrouped as [`TokenOctet::bsums`] (Q8_K blocks).
    pub octet_bsums: Vec<i16>,
}

impl ActBuf {
    /// Quantizes `n_rows = x.len() / k` rows of `k` values (whole blocks of `kind`), reusing
    /// the buffers; rows are quantized in parallel when there are many (prefill).
    /// [`ActBuf::quantize`] of one row (`k = x.len()`) on this thread, without a parallel
    /// iterator's setup: the experts' region quantizes its token's row for every call (48 per
    /// decode step of Qwen3-30B-A3B).
    pub(crate) fn quantize_one(&mut self, kind: ActKind, x: &[f32]) {
        let n_blocks = x.len() / kind.block_elems();
        self.d.resize(n_blocks, 0.0);
        self.qs.resize(x.len(), 0);
        self.sums.resize(n_blocks * kind.sums_per_block(), 0);
        quantize_row(kind, x, &mut self.d, &mut self.qs, &mut self.sums);
    }

    pub(crate) fn quantize(&mut self, kind: ActKind, x: &[f32], k: usize) {
        let be = kind.block_elems();
        let n_blocks = x.len() / be;
        let (nb_row, sums_row) = (k / be, k / be * kind.sums_per_block());
        self.d.resize(n_blocks, 0.0);
        self.qs.resize(x.len(), 0);
        self.sums.resize(n_blocks * kind.sums_per_block(), 0);
        let rows = x
            .par_chunks(k)
            .zip(self.d.par_chunks_mut(nb_row))
            .zip(self.qs.par_chunks_mut(k))
            .zip(self.sums.par_chunks_mut(sums_row));
        // About 64 KiB of activations per task; a single decode row stays on this thread.
        let min_rows = (16 * 1024 / k).max(1);
        rows.with_min_len(min_rows).for_each(|(((x, d), qs), sums)| quantize_row(kind, x, d, qs, sums));
    }

    /// Regroups rows quantized as `kind` (`n_tok` tokens of `k` values) by eight tokens for
    /// [`ActBuf::octet`]; a last partial octet repeats its last token. Octets are built in
    /// parallel (a prefill's activations are a few MiB).
    pub(crate) fn build_octets(&mut self, kind: ActKind, n_tok: usize, k: usize) {
        let nb = k / kind.block_elems();
        let n_octets = n_tok.div_ceil(8);
        let (n_sums, n_bsums) = match kind {
            ActKind::Q8_0 => (8 * nb, 0),
            ActKind::Q8_K => (0, 8 * nb * 16),
        };
        self.octet_qs.resize(n_octets * 8 * k, 0);
        self.octet_d.resize(n_octets * 8 * nb, 0.0);
        self.octet_sums.resize(n_octets * n_sums, 0);
        self.octet_bsums.resize(n_octets * n_bsums, 0);
        let (qs, d, sums) = (&self.qs, &self.d, &self.sums);
        let fill = |o: usize, oq: &mut [i8], od: &mut [f32], os: &mut [i32], ob: &mut [i16]| {
            for t in 0..8 {
                let tok = (8 * o + t).min(n_tok - 1);
                for (group, four) in qs[tok * k..(tok + 1) * k].chunks_exact(4).enumerate() {
                    oq[32 * group + 4 * t..32 * group + 4 * t + 4].copy_from_slice(four);
                }
                for ib in 0..nb {
                    od[8 * ib + t] = d[tok * nb + ib];
                    match kind {
                        ActKind::Q8_0 => os[8 * ib + t] = sums[tok * nb + ib] as i32,
                        ActKind::Q8_K => {
                            for p in 0..8 {
                                let at = 16 * (8 * ib + p) + 2 * t;
                                let from = (tok * nb + ib) * 16 + 2 * p;
                                ob[at..at + 2].copy_from_slice(&sums[from..from + 2]);
                            }
                        }
                    }
                }
            }
        };
        // Only one kind of sums exists per call; the other is an empty slice.
        match kind {
            ActKind::Q8_0 => self
                .octet_qs
                .par_chunks_mut(8 * k)
                .zip(self.octet_d.par_chunks_mut(8 * nb))
                .zip(self.octet_sums.par_chunks_mut(n_sums))
                .enumerate()
                .for_each(|(o, ((oq, od), os))| fill(o, oq, od, os, &mut [])),
            ActKind::Q8_K => self
                .octet_qs
                .par_chunks_mut(8 * k)
                .zip(self.octet_d.par_chunks_mut(8 * nb))
                .zip(self.octet_bsums.par_chunks_mut(n_bsums))
                .enumerate()
                .for_each(|(o, ((oq, od), ob))| fill(o, oq, od, &mut [], ob)),
        }
    }

    /// Tokens `8 o .. 8 o + 8` (the last one repeated past `n_tok`) after `build_octets`.
    pub(crate) fn octet(&self, kind: ActKind, o: usize, k: usize) -> TokenOctet<'_> {
        let nb = k / kind.block_elems();
        let (n_sums, n_bsums) = match kind {
            ActKind::Q8_0 => (8 * nb, 0),
            ActKind::Q8_K => (0, 8 * nb * 16),
        };
        TokenOctet {
            qs: &self.octet_qs[o * 8 * k..(o + 1) * 8 * k],
            d: &self.octet_d[o * 8 * nb..(o + 1) * 8 * nb],
            sums: &self.octet_sums[o * n_sums..(o + 1) * n_sums],
            bsums: &self.octet_bsums[o * n_bsums..(o + 1) * n_bsums],
        }
    }

    pub(crate) fn row(&self, kind: ActKind, t: usize, k: usize) -> ActRow<'_> {
        let nb = k / kind.block_elems();
        let spb = kind.sums_per_block();
        ActRow {
            d: &self.d[t * nb..(t + 1) * nb],
            qs: &self.qs[t * k..(t + 1) * k],
            sums: &self.sums[t * nb * spb..(t + 1) * nb * spb],
        }
    }
}

pub(crate) fn quantize_row(kind: ActKind, x: &[f32], d: &mut [f32], qs: &mut [i8], sums: &mut [i16]) {
    match kind {
        ActKind::Q8_0 => {
            if super::simd::quantize_row_q8_0(x, d, qs, sums) {
                return;
            }
            for (((xb, qb), d), s) in x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).zip(d.iter_mut()).zip(sums) {
                *d = quantize_act_q8_0(xb, qb, s);
            }
        }
        ActKind::Q8_K => {
            if super::simd::quantize_row_q8_k(x, d, qs, sums) {
                return;
            }
            for (((xb, qb), d), s) in
                x.chunks_exact(QK_K).zip(qs.chunks_exact_mut(QK_K)).zip(d.iter_mut()).zip(sums.chunks_exact_mut(16))
            {
                *d = quantize_block_q8_k(xb, qb, s);
            }
        }
    }
}

/// llama.cpp's `quantize_row_q8_0`/`q8_1`: `d = amax / 127` stored as f16 (the dot products use
/// the rounded value), quants `round(x * 127 / amax)`, and their sum for the types with a min.
#[inline(always)]
fn quantize_act_q8_0(x: &[f32], qs: &mut [i8], sum: &mut i16) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut s = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
        s += *q as i32;
    }
    *sum = s as i16;
    round_f16(d)
}

/// A 32-value weight block as signed integer levels with `w = d * level + m`.
struct Block32 {
    levels: [i8; QK],
    d: f32,
    m: f32,
}

#[inline(always)]
fn nibbles(qs: &[u8], mut f: impl FnMut(u8) -> i8) -> [i8; QK] {
    let mut out = [0i8; QK];
    for j in 0..16 {
        out[j] = f(qs[j] & 0xF);
        out[j + 16] = f(qs[j] >> 4);
    }
    out
}

#[inline(always)]
fn fifth_bits(qh: &[u8], mut levels: [i8; QK], offset: i8) -> [i8; QK] {
    let h = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    for (j, l) in levels.iter_mut().enumerate() {
        *l = *l + (((h >> j) & 1) << 4) as i8 - offset;
    }
    levels
}

fn unpack32(dtype: GgmlType, b: &[u8]) -> Block32 {
    use GgmlType::*;
    match dtype {
        Q4_0 => Block32 { levels: nibbles(&b[2..18], |n| n as i8 - 8), d: f16_at(b), m: 0.0 },
        Q4_1 => Block32 { levels: nibbles(&b[4..20], |n| n as i8), d: f16_at(b), m: f16_at(&b[2..]) },
        Q5_0 => Block32 { levels: fifth_bits(&b[2..6], nibbles(&b[6..22], |n| n as i8), 16), d: f16_at(b), m: 0.0 },
        Q5_1 => Block32 {
            levels: fifth_bits(&b[4..8], nibbles(&b[8..24], |n| n as i8), 0),
            d: f16_at(b),
            m: f16_at(&b[2..]),
        },
        Q8_0 => {
            let mut levels = [0i8; QK];
            for (l, &q) in levels.iter_mut().zip(&b[2..34]) {
                *l = q as i8;
            }
            Block32 { levels, d: f16_at(b), m: 0.0 }
        }
        IQ4_NL => Block32 { levels: nibbles(&b[2..18], |n| KVALUES_IQ4NL[n as usize]), d: f16_at(b), m: 0.0 },
        MXFP4 => {
            Block32 { levels: nibbles(&b[1..17], |n| KVALUES_MXFP4[n as usize]), d: e8m0_to_f32_half(b[0]), m: 0.0 }
        }
        other => unreachable!("{other} is not a 32-value type"),
    }
}

/// A 256-value weight super-block: levels, and per 16 values an integer scale and min, with
/// `w = d * scale * level - dmin * min`.
struct Block256 {
    levels: [i8; QK_K],
    scales: [i32; 16],
    mins: [i32; 16],
    d: f32,
    dmin: f32,
}

fn unpack256(dtype: GgmlType, b: &[u8]) -> Block256 {
    use GgmlType::*;
    let mut out = Block256 { levels: [0; QK_K], scales: [0; 16], mins: [0; 16], d: 0.0, dmin: 0.0 };
    match dtype {
        Q2_K => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            for (i, l) in out.levels.iter_mut().enumerate() {
                *l = ((qs[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3) as i8;
            }
            for ((s, m), &packed) in out.scales.iter_mut().zip(out.mins.iter_mut()).zip(sc) {
                *s = (packed & 0xF) as i32;
                *m = (packed >> 4) as i32;
            }
            out.d = f16_at(&b[80..]);
            out.dmin = f16_at(&b[82..]);
        }
        Q3_K => {
            let (hmask, qs) = (&b[0..32], &b[32..96]);
            for (i, l) in out.levels.iter_mut().enumerate() {
                let low = (qs[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3;
                let high_set = hmask[i % 32] & (1 << (i / 32)) != 0;
                *l = low as i8 - if high_set { 0 } else { 4 };
            }
            for (s, &v) in out.scales.iter_mut().zip(q3_k_scales(&b[96..108]).iter()) {
                *s = v as i32 - 32;
            }
            out.d = f16_at(&b[108..]);
        }
        Q4_K | Q5_K => {
            let qs = if dtype == Q4_K { &b[16..144] } else { &b[48..176] };
            for (i, l) in out.levels.iter_mut().enumerate() {
                let (chunk, high, pos) = (i / 64, (i / 32) % 2 == 1, i % 32);
                let byte = qs[32 * chunk + pos];
                let mut v = if high { byte >> 4 } else { byte & 0xF };
                if dtype == Q5_K && b[16 + pos] & (1 << (i / 32)) != 0 {
                    v += 16;
                }
                *l = v as i8;
            }
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &b[4..16]);
                out.scales[2 * j] = sc as i32;
                out.scales[2 * j + 1] = sc as i32;
                out.mins[2 * j] = m as i32;
                out.mins[2 * j + 1] = m as i32;
            }
            out.d = f16_at(b);
            out.dmin = f16_at(&b[2..]);
        }
        Q6_K => {
            for half in 0..2 {
                let ql = &b[64 * half..64 * half + 64];
                let qh = &b[128 + 32 * half..128 + 32 * half + 32];
                let lv = &mut out.levels[128 * half..128 * half + 128];
                for l in 0..32 {
                    lv[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                    lv[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    lv[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    lv[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                }
            }
            for (s, &v) in out.scales.iter_mut().zip(&b[192..208]) {
                *s = v as i8 as i32;
            }
            out.d = f16_at(&b[208..]);
        }
        IQ4_XS => {
            let scales_h = u16::from_le_bytes([b[2], b[3]]);
            for ib in 0..8 {
                let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
                let lv = &mut out.levels[32 * ib..32 * ib + 32];
                for j in 0..16 {
                    lv[j] = KVALUES_IQ4NL[(qs[j] & 0xF) as usize];
                    lv[j + 16] = KVALUES_IQ4NL[(qs[j] >> 4) as usize];
                }
                let s = iq4_xs_scale(ib, scales_h, &b[4..8]) - 32;
                out.scales[2 * ib] = s;
                out.scales[2 * ib + 1] = s;
            }
            out.d = f16_at(b);
        }
        other => unreachable!("{other} is not a 256-value type"),
    }
    out
}

/// Portable dot product of one encoded weight row with one quantized activation row.
pub(crate) fn dot_portable(dtype: GgmlType, w: &[u8], x: ActRow<'_>) -> f32 {
    let bb = dtype.block_bytes();
    let mut acc = 0.0f32;
    if dtype.block_elems() == QK {
        for (ib, b) in w.chunks_exact(bb).enumerate() {
            let blk = unpack32(dtype, b);
            let xq = &x.qs[ib * QK..(ib + 1) * QK];
            let sumi: i32 = blk.levels.iter().zip(xq).map(|(&a, &b)| a as i32 * b as i32).sum();
            acc += blk.d * x.d[ib] * sumi as f32;
            if blk.m != 0.0 {
                acc += blk.m * x.d[ib] * x.sums[ib] as f32;
            }
        }
    } else {
        for (ib, b) in w.chunks_exact(bb).enumerate() {
            let blk = unpack256(dtype, b);
            let xq = &x.qs[ib * QK_K..(ib + 1) * QK_K];
            let bsums = &x.sums[ib * 16..ib * 16 + 16];
            let (mut sumi, mut summ) = (0i32, 0i32);
            for g in 0..16 {
                let s: i32 = blk.levels[16 * g..16 * g + 16]
                    .iter()
                    .zip(&xq[16 * g..16 * g + 16])
                    .map(|(&a, &b)| a as i32 * b as i32)
                    .sum();
                sumi += blk.scales[g] * s;
                summ += blk.mins[g] * bsums[g] as i32;
            }
            acc += x.d[ib] * (blk.d * sumi as f32 - blk.dmin * summ as f32);
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised Q8_0 activation quantizer (when this CPU has one) against the portable
    /// loop, bit for bit: random rows, rows whose scaled values fall exactly on halves (the
    /// rounding ties), all-zero blocks and blocks with a NaN or an infinity.
    #[test]
    fn vectorised_q8_0_activation_quantizer_matches_portable() {
        let mut next = crate::test_uniform();
        let n_blocks = 9;
        let mut rows: Vec<Vec<f32>> = Vec::new();
        rows.push((0..n_blocks * QK).map(|_| next() * 3.0).collect());
        rows.push((0..n_blocks * QK).map(|_| next() * 1e-3).collect());
        // amax 127 gives id = 1: every k + 0.5 is a tie, on both signs.
        rows.push((0..n_blocks * QK).map(|i| if i % QK == 5 { 127.0 } else { (i % 64) as f32 * 0.5 - 16.0 }).collect());
        let mut special = vec![0.0f32; n_blocks * QK];
        special[QK + 3] = f32::NAN;
        special[QK + 4] = 2.0;
        special[3 * QK] = f32::INFINITY;
        rows.push(special);
        let mut ran_vectorised = false;
        for (r, x) in rows.iter().enumerate() {
            let (mut d_want, mut q_want, mut s_want) = (vec![0f32; n_blocks], vec![0i8; x.len()], vec![0i16; n_blocks]);
            for (((xb, qb), d), s) in
                x.chunks_exact(QK).zip(q_want.chunks_exact_mut(QK)).zip(d_want.iter_mut()).zip(s_want.iter_mut())
            {
                *d = quantize_act_q8_0(xb, qb, s);
            }
            let (mut d_got, mut q_got, mut s_got) = (vec![1f32; n_blocks], vec![1i8; x.len()], vec![1i16; n_blocks]);
            if !super::super::simd::quantize_row_q8_0(x, &mut d_got, &mut q_got, &mut s_got) {
                continue;
            }
            ran_vectorised = true;
            for ib in 0..n_blocks {
                assert_eq!(d_got[ib].to_bits(), d_want[ib].to_bits(), "row {r} block {ib} scale");
                assert_eq!(&q_got[ib * QK..(ib + 1) * QK], &q_want[ib * QK..(ib + 1) * QK], "row {r} block {ib}");
                assert_eq!(s_got[ib], s_want[ib], "row {r} block {ib} sum");
            }
        }
        println!("vectorised Q8_0 quantizer compared: {ran_vectorised}");
    }

    /// As above for the Q8_K quantizer: random rows, ties of magnitude with opposite signs
    /// (the first one gives the sign), exact halves (round half to even), zero blocks, NaN and
    /// infinity.
    #[test]
    fn vectorised_q8_k_activation_quantizer_matches_portable() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let n_blocks = 5;
        let n = n_blocks * QK_K;
        let mut rows: Vec<Vec<f32>> = Vec::new();
        rows.push((0..n).map(|_| next() * 3.0).collect());
        // Magnitude 127 first negative then positive: iscale = 1, so k + 0.5 values are ties.
        rows.push(
            (0..n)
                .map(|i| match i % QK_K {
                    7 => -127.0,
                    200 => 127.0,
                    j => (j % 64) as f32 * 0.5 - 16.0,
                })
                .collect(),
        );
        let mut special = vec![0.0f32; n];
        special[QK_K + 3] = f32::NAN;
        special[QK_K + 4] = -2.0;
        special[3 * QK_K + 9] = f32::INFINITY;
        special[4 * QK_K..].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 100.0) * 1e-3);
        rows.push(special);
        let mut ran_vectorised = false;
        for (r, x) in rows.iter().enumerate() {
            let (mut d_want, mut q_want, mut s_want) = (vec![0f32; n_blocks], vec![0i8; n], vec![0i16; 16 * n_blocks]);
            for (((xb, qb), d), s) in x
                .chunks_exact(QK_K)
                .zip(q_want.chunks_exact_mut(QK_K))
                .zip(d_want.iter_mut())
                .zip(s_want.chunks_exact_mut(16))
            {
                *d = quantize_block_q8_k(xb, qb, s);
            }
            let (mut d_got, mut q_got, mut s_got) = (vec![1f32; n_blocks], vec![1i8; n], vec![1i16; 16 * n_blocks]);
            if !super::super::simd::quantize_row_q8_k(x, &mut d_got, &mut q_got, &mut s_got) {
                continue;
            }
            ran_vectorised = true;
            for ib in 0..n_blocks {
                assert_eq!(d_got[ib].to_bits(), d_want[ib].to_bits(), "row {r} block {ib} scale");
                let range = ib * QK_K..(ib + 1) * QK_K;
                assert_eq!(&q_got[range.clone()], &q_want[range], "row {r} block {ib}");
                assert_eq!(&s_got[16 * ib..16 * ib + 16], &s_want[16 * ib..16 * ib + 16], "row {r} block {ib} sums");
            }
        }
        println!("vectorised Q8_K quantizer compared: {ran_vectorised}");
    }
}
