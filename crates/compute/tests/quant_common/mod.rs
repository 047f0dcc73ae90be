//! Shared helpers of the quant tests: a seeded generator and random but valid encoded blocks.
#![allow(dead_code)]

use compute::quant::GgmlType;
use half::f16;

/// Every type `compute::quant` decodes.
pub const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// xorshift64* with a Box-Muller normal: deterministic, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.uniform() as f64).max(1e-12);
        let u2 = self.uniform() as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        for b in out {
            *b = self.next_u64() as u8;
        }
    }
}

fn put_f16(b: &mut [u8], v: f32) {
    b[..2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// `n_rows` rows of `k` values of `dtype`: random quants with scales of a sane magnitude
/// (so products stay finite and of weight-like size).
pub fn random_rows(dtype: GgmlType, n_rows: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    use GgmlType::*;
    let n_blocks = n_rows * k / dtype.block_elems();
    let bb = dtype.block_bytes();
    let mut out = vec![0u8; n_blocks * bb];
    rng.fill_bytes(&mut out);
    for b in out.chunks_exact_mut(bb) {
        let scale = 0.002 + 0.02 * rng.uniform();
        match dtype {
            F32 => b.copy_from_slice(&rng.normal().to_le_bytes()),
            F16 => put_f16(b, rng.normal()),
            BF16 => b.copy_from_slice(&((rng.normal().to_bits() >> 16) as u16).to_le_bytes()),
            Q4_0 | Q5_0 | Q8_0 | IQ4_NL => put_f16(b, scale * if rng.uniform() < 0.5 { -1.0 } else { 1.0 }),
            Q4_1 | Q5_1 => {
                put_f16(b, scale);
                put_f16(&mut b[2..], -8.0 * scale * rng.uniform());
            }
            Q2_K => {
                put_f16(&mut b[80..], scale);
                put_f16(&mut b[82..], scale * 0.5);
            }
            Q3_K => put_f16(&mut b[108..], scale * 0.1),
            Q4_K | Q5_K => {
                put_f16(b, scale * 0.1);
                put_f16(&mut b[2..], scale * 0.05);
            }
            Q6_K => put_f16(&mut b[208..], scale * 0.01),
            Q8_K => b[..4].copy_from_slice(&(scale * 0.05).to_le_bytes()),
            IQ4_XS => put_f16(b, scale * 0.05),
            MXFP4 => b[0] = 115 + (rng.next_u64() % 10) as u8,
            other => panic!("no random blocks for {other}"),
        }
    }
    out
}

/// The committed reference file (see testdata/quant/README.md).
pub fn refs_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/quant/refs.gguf")
}

/// `../shared/fixtures` as seen from the repository root, if present.
pub fn fixtures_dir() -> Option<std::path::PathBuf> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures");
    dir.is_dir().then_some(dir)
}

pub fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// Bit-exact comparison (NaNs compare by bits too); returns a description of the first
/// mismatches, if any.
pub fn bit_mismatches(got: &[f32], want: &[f32]) -> Option<String> {
    assert_eq!(got.len(), want.len());
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i].to_bits() != want[i].to_bits()).collect();
    if bad.is_empty() {
        return None;
    }
    let shown: Vec<String> = bad
        .iter()
        .take(5)
        .map(|&i| {
            format!(
                "[{i}] got {:e} ({:#010x}) want {:e} ({:#010x})",
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits()
            )
        })
        .collect();
    Some(format!("{} of {} differ: {}", bad.len(), got.len(), shown.join(", ")))
}

/// test-quantize-fns' synthetic data: `0.1 + 2 * cos(i + offset)`.
pub fn ggml_test_data(offset: f32, n: usize) -> Vec<f32> {
    (0..n).map(|i| 0.1 + 2.0 * (i as f32 + offset).cos()).collect()
}

/// test-quantize-fns' `array_rmse`: sqrt(sum of squared differences) / n (sic).
pub fn ggml_array_rmse(a: &[f32], b: &[f32]) -> f32 {
    let sum: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    (sum.sqrt() as f32) / a.len() as f32
}
