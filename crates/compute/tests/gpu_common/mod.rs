//! What the GPU op tests share (backend_ops.rs, gpu_tier_moe.rs): the adapter, the seed, the
//! error measure, random inputs and the case report.

// Each test binary uses a part of these.
#![allow(dead_code)]

use compute::cpu::CpuTensor;
use compute::wgpu::{WgpuBackend, WgpuOptions};
use rand::rngs::StdRng;
use rand::Rng;

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
