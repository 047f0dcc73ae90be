//! Tensor and metadata names as llama.cpp writes them (`src/llama-arch.cpp`), in one place so
//! loaders use them verbatim.

/// `blk.{layer}.{suffix}`: the name of a per-layer tensor.
pub fn blk(layer: usize, suffix: &str) -> String {
    format!("blk.{layer}.{suffix}")
}

/// `{arch}.{key}`: an architecture-scoped metadata key.
pub fn arch_key(arch: &str, key: &str) -> String {
    format!("{arch}.{key}")
}

/// Token embedding table.
pub const TOKEN_EMBD: &str = "token_embd.weight";
/// Final norm weight.
pub const OUTPUT_NORM: &str = "output_norm.weight";
/// Final norm bias.
pub const OUTPUT_NORM_BIAS: &str = "output_norm.bias";
/// Output projection (absent when tied to the embedding).
pub const OUTPUT: &str = "output.weight";
/// Rope frequency factors (llama 3 style scaling).
pub const ROPE_FREQS: &str = "rope_freqs.weight";
