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

/// Which cached expert a miss evicts.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum CachePolicyFlag {
    /// Least recently used.
    Lru,
    /// Least frequently selected, with decay.
    Lfu,
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
    /// Page a mixture-of-experts model's experts from disk through a host cache of at most this
    /// many bytes (e.g. 8G) instead of mapping them: for models larger than RAM.
    #[arg(long, value_parser = parse_size)]
    pub ram_budget: Option<u64>,
    /// Which cached expert a miss evicts (with --ram-budget).
    #[arg(long, value_enum, default_value_t = CachePolicyFlag::Lfu)]
    pub cache_policy: CachePolicyFlag,
    /// Print per-layer expert-cache statistics (hits, misses, bytes read) to stderr when done.
    #[arg(long)]
    pub stats: bool,
}

fn parse_size(text: &str) -> Result<u64, String> {
    plan::parse_bytes(text).map_err(|e| e.to_string())
}

/// A loaded model with its tokenizer.
pub struct Loaded {
    /// The open file(s).
    pub file: Arc<GgufModel>,
    /// The model and its sequence state.
    pub runner: Box<dyn Runner>,
    /// The vocabulary.
    pub tokenizer: tokenizer::Tokenizer,
    /// The expert cache, when experts are paged (`--ram-budget`).
    pub pager: Option<Arc<pager::Pager>>,
}

/// Prints the expert cache's per-layer statistics to stderr when `--stats` asked for them.
pub fn report_stats(args: &ModelArgs, m: &Loaded) {
    if !args.stats {
        return;
    }
    match &m.pager {
        Some(p) => eprint!("{}", p.format_stats()),
        None => eprintln!("expert cache: none (experts used in place from the memory map; --ram-budget pages them)"),
    }
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
    let opts = LoadOptions { n_ctx: args.ctx_size, matmul };
    let (runner, pager) = match args.ram_budget {
        None => {
            (models::load(&file, &opts).with_context(|| format!("{}: loading the model", args.model.display()))?, None)
        }
        Some(budget) => {
            let policy = match args.cache_policy {
                CachePolicyFlag::Lru => pager::CachePolicy::Lru,
                CachePolicyFlag::Lfu => pager::CachePolicy::Lfu,
            };
            let p = Arc::new(pager::Pager::open(&file, &pager::PagerOptions::new(budget, policy))?);
            let b = compute::cpu::CpuBackend::new(matmul).with_expert_store(p.clone());
            let runner = models::load_on(b, &file, &opts)
                .with_context(|| format!("{}: loading the model", args.model.display()))?;
            (runner, Some(p))
        }
    };
    Ok(Loaded { file, runner, tokenizer, pager })
}
