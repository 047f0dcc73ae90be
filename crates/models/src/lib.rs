//! Model architectures, one file each, written against the [`compute::Backend`] op set.
//!
//! A model file (`llama.rs`, `gemma3.rs`, ...) reads top to bottom: a doc comment naming the
//! reference implementation and how it differs from llama, a `load` that takes hyper-parameters
//! from `{arch}.*` metadata and tensors by GGUF name, and a `forward` that reads like the block
//! diagram. Shared pieces (attention, dense FFN, mixture of experts) live in [`blocks`]; the only
//! `match` on the architecture string is [`load`] in this file.
//!
//! Routing is an explicit step in every MoE model: `route` yields (expert ids, weights) per
//! token and `moe_ffn` takes them, so where an expert lives (GPU slot, host cache, disk) is
//! decided behind the op, never in a model file.
//!
//! # Examples
//! ```no_run
//! use models::{load, LoadOptions, Outputs};
//! let model = std::sync::Arc::new(gguf::GgufModel::open("model.gguf")?);
//! let mut runner = load(&model, &LoadOptions::default())?;
//! let logits = runner.eval(&[1, 2, 3], Outputs::Last)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

mod arch;
pub mod blocks;
mod error;
mod hparams;
mod loader;
pub mod refcheck;
mod rope;
pub mod sampling;
mod state;
pub mod synth;

pub mod bert;
pub mod deepseek2;
pub mod gemma3;
pub mod glm4moe;
pub mod gptoss;
pub mod granitehybrid;
pub mod granitemoe;
pub mod lfm2;
pub mod lfm2moe;
pub mod llama;
pub mod olmoe;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3moe;

pub use arch::{output_rows, positions, Architecture, Outputs, Runner, Session};
pub use error::{ModelError, Result};
pub use hparams::Hparams;
pub use loader::Loader;
pub use rope::rope_spec;
pub use state::{Checkpoint, LayerState, State};

use compute::cpu::CpuBackend;
use compute::quant::MatmulMode;
use compute::Backend;
use gguf::GgufModel;
use std::sync::Arc;

/// Architecture strings (`general.architecture`) this crate runs.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "gemma3",
    "qwen3moe",
    "olmoe",
    "deepseek2",
    "glm4moe",
    "gpt-oss",
    "granitemoe",
    "granitehybrid",
    "lfm2",
    "lfm2moe",
    "bert",
    "nomic-bert",
];

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Context length in positions (0: the model's trained context, capped at 4096).
    pub n_ctx: usize,
    /// CPU matrix-product mode.
    pub matmul: MatmulMode,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { n_ctx: 0, matmul: MatmulMode::Exact }
    }
}

/// Builds the architecture of `model` on back end `b` and wraps it in a [`Session`].
///
/// # Errors
/// [`ModelError::UnsupportedArchitecture`], missing keys or tensors, bad shapes.
pub fn load_on<B: Backend + 'static>(b: B, model: &Arc<GgufModel>, opts: &LoadOptions) -> Result<Box<dyn Runner>> {
    let hp = Hparams::read(model)?;
    let n_ctx = match opts.n_ctx {
        0 => hp.context_length.clamp(1, 4096),
        n => n,
    };
    let ld = Loader { b: &b, model };
    let arch = hp.arch.clone();
    let runner: Box<dyn Runner> = match arch.as_str() {
        "llama" => Box::new(Session::new(b.clone(), llama::Llama::load(&ld, hp, false)?, n_ctx)?),
        "qwen2" => Box::new(Session::new(b.clone(), qwen2::load(&ld, hp)?, n_ctx)?),
        "qwen3" => Box::new(Session::new(b.clone(), qwen3::load(&ld, hp)?, n_ctx)?),
        "gemma3" => Box::new(Session::new(b.clone(), gemma3::load(&ld, hp)?, n_ctx)?),
        "qwen3moe" => Box::new(Session::new(b.clone(), qwen3moe::load(&ld, hp)?, n_ctx)?),
        "olmoe" => Box::new(Session::new(b.clone(), olmoe::load(&ld, hp)?, n_ctx)?),
        "deepseek2" => Box::new(Session::new(b.clone(), deepseek2::load(&ld, hp)?, n_ctx)?),
        "glm4moe" => Box::new(Session::new(b.clone(), glm4moe::load(&ld, hp)?, n_ctx)?),
        "gpt-oss" => Box::new(Session::new(b.clone(), gptoss::load(&ld, hp)?, n_ctx)?),
        "granitemoe" => Box::new(Session::new(b.clone(), granitemoe::load(&ld, hp)?, n_ctx)?),
        "granitehybrid" => Box::new(Session::new(b.clone(), granitehybrid::load(&ld, hp)?, n_ctx)?),
        "lfm2" => Box::new(Session::new(b.clone(), lfm2::load(&ld, hp)?, n_ctx)?),
        "lfm2moe" => Box::new(Session::new(b.clone(), lfm2moe::load(&ld, hp)?, n_ctx)?),
        "bert" | "nomic-bert" => Box::new(Session::new(b.clone(), bert::load(&ld, hp)?, n_ctx)?),
        _ => {
            return Err(ModelError::UnsupportedArchitecture { arch, supported: SUPPORTED_ARCHITECTURES.join(", ") });
        }
    };
    Ok(runner)
}

/// Loads `model` on the CPU back end.
///
/// # Errors
/// As [`load_on`].
pub fn load(model: &Arc<GgufModel>, opts: &LoadOptions) -> Result<Box<dyn Runner>> {
    load_on(CpuBackend::new(opts.matmul), model, opts)
}
