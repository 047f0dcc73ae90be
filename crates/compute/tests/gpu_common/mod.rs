//! What the GPU op tests share (backend_ops.rs, gpu_int8.rs, gpu_tier_moe.rs): the adapter, the
//! seed, the error measure, random inputs, weights in a temporary file and the case report.

// Each test binary uses a part of these.
#![allow(dead_code)]

use compute::cpu::CpuTensor;
use compute::quant::{self, GgmlType};
use compute::wgpu::{WgpuBackend, WgpuOptions};
use compute::HostWeight;
use gguf::{GgufModel, GgufWriter};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;

/// The GPU back end, or `None` when `DISKFORMER_NO_GPU=1` declares the machine has none.
pub fn gpu(test: &str) -> Option<WgpuBackend> {
    let no_gpu = std::env::var("DISKFORMER_NO_GPU").is_ok_and(|v| v == "1");
    let index = std::env::var("DISKFORMER_GPU").ok().and_then(|v| v.parse().ok());
    match WgpuBackend::new(WgpuOptions { adapter_index: index, prefer_discrete: true }) {
        Ok(b) => {
            let a = b.adapter();
            println!(
                "adapter: {} ({}, {}, driver {}), subgroups used: {}, shader_f16: {}, max storage binding {} MiB",
                a.name,
                a.api,
                a.device_type,
                a.driver,
                b.uses_subgroups(),
                a.shader_f16,
                b.max_binding_bytes() >> 20
            );
            Some(b)
        }
        Err(e) if no_gpu => {
            println!("{test}: not run: DISKFORMER_NO_GPU=1 and no adapter ({e})");
            None
        }
        Err(e) => panic!("{e}\n(set DISKFORMER_NO_GPU=1 only on a machine that has no GPU or software Vulkan)"),
    }
}

pub fn seed() -> u64 {
    std::env::var("DISKFORMER_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    })
}

pub fn nmse(gpu: &[f32], cpu: &[f32]) -> f64 {
    if gpu.len() != cpu.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&a, &b) in gpu.iter().zip(cpu) {
        if !a.is_finite() {
            return f64::INFINITY;
        }
        num += (a as f64 - b as f64).powi(2);
        den += (b as f64).powi(2);
    }
    num / den.max(1e-30)
}

pub fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale).collect()
}

pub fn tensor(rng: &mut StdRng, shape: &[usize], scale: f32) -> CpuTensor {
    CpuTensor { shape: shape.to_vec(), data: rand_vec(rng, shape.iter().product(), scale) }
}

/// Weights written to a temporary GGUF file (the only way to a `HostWeight`), removed on drop.
pub struct WeightFile {
    model: Arc<GgufModel>,
    path: PathBuf,
}

impl Drop for WeightFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One tensor of a [`WeightFile`]: name, type, shape outermost first, and the f32 values to
/// quantize (empty: random bytes, which time like real weights and skip the slow quantizers).
pub type WeightSpec = (String, GgmlType, Vec<usize>, Vec<f32>);

impl WeightFile {
    /// `tag` makes the file's name unique within the process.
    pub fn new(tag: &str, tensors: &[WeightSpec]) -> WeightFile {
        let mut w = GgufWriter::new();
        for (name, t, shape, _) in tensors {
            let ne: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            w.add_tensor(name, *t, &ne).expect("declare tensor");
        }
        let path = std::env::temp_dir().join(format!("diskformer-{tag}-{}.gguf", std::process::id()));
        let mut sink = w.create(&path).expect("create weight file");
        let mut rng = StdRng::seed_from_u64(11);
        for (_, t, shape, values) in tensors {
            let n: usize = shape.iter().product();
            let mut bytes = vec![0u8; n / t.block_elems() * t.block_bytes()];
            if values.is_empty() {
                rng.fill(&mut bytes[..]);
            } else {
                quant::quantize(*t, values, &mut bytes).expect("quantize");
            }
            sink.write_data(&bytes).expect("write");
        }
        sink.finish().expect("finish");
        WeightFile { model: Arc::new(GgufModel::open(&path).expect("open weight file")), path }
    }

    /// The tensor `name`, which the file must hold.
    pub fn get(&self, name: &str) -> HostWeight {
        self.find(name).unwrap_or_else(|| panic!("tensor {name} not in the weight file"))
    }

    /// The tensor `name`, if the file holds it.
    pub fn find(&self, name: &str) -> Option<HostWeight> {
        HostWeight::from_model(&self.model, name)
    }
}

/// Cases run and failed; `finish` fails the test if any failed (after printing every case).
pub struct Report {
    pub failures: Vec<String>,
    pub ran: usize,
}

impl Report {
    pub fn check(&mut self, case: &str, gpu: Result<Vec<f32>, compute::OpError>, cpu: &[f32], max_nmse: f64) {
        self.ran += 1;
        match gpu {
            Ok(g) => {
                let e = nmse(&g, cpu);
                if e <= max_nmse {
                    println!("{case} wgpu: OK");
                } else {
                    println!("{case} wgpu: FAIL nmse={e:.3e} (bound {max_nmse:.0e})");
                    self.failures.push(format!("{case}: nmse {e:.3e}"));
                }
            }
            Err(e) => {
                println!("{case} wgpu: FAIL error: {e}");
                self.failures.push(format!("{case}: {e}"));
            }
        }
    }

    pub fn exact<T: PartialEq + std::fmt::Debug>(&mut self, case: &str, gpu: Result<T, compute::OpError>, cpu: &T) {
        self.ran += 1;
        match gpu {
            Ok(g) if &g == cpu => println!("{case} wgpu: OK"),
            Ok(g) => {
                println!("{case} wgpu: FAIL got {g:?}, cpu {cpu:?}");
                self.failures.push(format!("{case}: differs"));
            }
            Err(e) => {
                println!("{case} wgpu: FAIL error: {e}");
                self.failures.push(format!("{case}: {e}"));
            }
        }
    }

    pub fn finish(self) {
        println!("{} cases, {} failed", self.ran, self.failures.len());
        assert!(self.failures.is_empty(), "failing cases:\n{}", self.failures.join("\n"));
    }
}
