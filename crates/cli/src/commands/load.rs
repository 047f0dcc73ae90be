//! Flags and loading shared by the commands that run a model.

use anyhow::Context;
use compute::quant::MatmulMode;
use gguf::GgufModel;
use models::{LoadOptions, Runner};
use std::path::PathBuf;
use std::sync::Arc;

/// How matrix products are computed on the CPU.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum MatmulFlag {
    /// f32 arithmetic on dequantized weights: the exact reference.
    Exact,
    /// Activations quantized to Q8 blocks as llama.cpp does: faster, within its tolerance.
    Q8,
}

/// Flags of every command that loads a model.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// The GGUF model (any part of a split set).
    #[arg(short, long)]
    pub model: PathBuf,
    /// Context length in tokens (0: the model's, capped at 4096).
    #[arg(short = 'c', long, default_value_t = 0)]
    pub ctx_size: usize,
    /// CPU threads (0: one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// How the CPU computes matrix products (default: q8 for run and bench, exact for eval).
    #[arg(long, value_enum)]
    pub matmul: Option<MatmulFlag>,
}

/// A loaded model with its tokenizer.
pub struct Loaded {
    /// The open file(s).
    pub file: Arc<GgufModel>,
    /// The model and its sequence state.
    pub runner: Box<dyn Runner>,
    /// The vocabulary.
    pub tokenizer: tokenizer::Tokenizer,
}

/// Sets the CPU thread count once for the process.
pub fn set_threads(threads: usize) -> anyhow::Result<()> {
    if threads > 0 {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("setting the thread count")?;
    }
    Ok(())
}

/// Opens, validates and loads the model `args` names; `matmul_default` applies when the user
/// gave no `--matmul`.
pub fn load(args: &ModelArgs, matmul_default: MatmulMode) -> anyhow::Result<Loaded> {
    set_threads(args.threads)?;
    let file = Arc::new(GgufModel::open(&args.model)?);
    let tokenizer = tokenizer::Tokenizer::from_gguf(file.metadata())
        .with_context(|| format!("{}: reading the tokenizer", args.model.display()))?;
    let matmul = match args.matmul {
        None => matmul_default,
        Some(MatmulFlag::Exact) => MatmulMode::Exact,
        Some(MatmulFlag::Q8) => MatmulMode::QuantizedActivations,
    };
    let runner = models::load(&file, &LoadOptions { n_ctx: args.ctx_size, matmul })
        .with_context(|| format!("{}: loading the model", args.model.display()))?;
    Ok(Loaded { file, runner, tokenizer })
}
