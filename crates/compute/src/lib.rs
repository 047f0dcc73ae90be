//! Tensors, the op set every model is written against, quantized tensor types, and back ends.
//!
//! [`Backend`] is the seam: a model file calls `b.matmul(&x, &w)`, `b.attention(..)`,
//! `b.moe_ffn(..)` and never learns whether a CPU or a GPU computed them, or where an expert
//! lived. [`cpu::CpuBackend`] computes every op in plain f32 (the exact reference, with weights
//! used in place from the memory map) or with llama.cpp-style quantized activations.
//! [`quant`] holds the tensor types: dequantization, dot products and quantizers.
#![deny(missing_docs)]

pub mod ab;
mod backend;
pub mod cpu;
mod error;
pub mod lfu;
pub mod quant;
pub mod spec;
mod tier_stats;
pub mod trace;
mod weight;
#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use backend::{AttnStep, Backend, ExpertStore, Experts, HostExpert, HostMatrix, QkNorm, Routing, SsmScan};
pub use error::OpError;
pub use tier_stats::ExpertTierStats;
pub use weight::{input_embedding_on_host, HostWeight};

/// Values in [-1, 1) from a fixed xorshift sequence: the unit tests' random inputs, the same on
/// every run and machine.
#[cfg(test)]
pub(crate) fn test_uniform() -> impl FnMut() -> f32 {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}
