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

/// Element type of the CPU back end's attention KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvTypeFlag {
    /// Half floats (llama.cpp's default): half the memory and bandwidth.
    F16,
    /// 32-bit floats: the exact reference.
    F32,
}

/// Which back end computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceFlag {
    /// The CPU back end.
    Cpu,
    /// The wgpu back end (Vulkan, Metal, DX12).
    Gpu,
    /// The GPU when one is usable, else the CPU.
    Auto,
}

/// Flags of every command that loads a model.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// The GGUF model: a path (any part of a split set) or a store name (`owner/repo:Q4_K_M`).
    #[arg(short, long)]
    pub model: PathBuf,
    /// The model store to look names up in (default: $DISKFORMER_STORE, else the XDG cache).
    #[arg(long, env = "DISKFORMER_STORE")]
    pub store: Option<PathBuf>,
    /// Context length in tokens (0: the model's, capped at 4096).
    #[arg(short = 'c', long, default_value_t = 0)]
    pub ctx_size: usize,
    /// CPU threads (0: one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Which back end computes (default: the planner's choice, printed in one line).
    #[arg(long, value_enum)]
    pub device: Option<DeviceFlag>,
    /// Which GPU (an index into `diskformer probe`'s list) for --device gpu.
    #[arg(long)]
    pub gpu: Option<usize>,
    /// How the CPU computes matrix products (default: q8 for run and bench, exact for eval).
    #[arg(long, value_enum)]
    pub matmul: Option<MatmulFlag>,
    /// Element type of the CPU KV cache: f16 is llama.cpp's default and halves the cache's memory
    /// and bandwidth; f32 (the default) keeps the fixtures' tolerances, which f16 misses
    /// (rel-L2 2-9e-4 against bounds of 1e-4; gemma3 greedy differs after 7 tokens).
    #[arg(long, value_enum, default_value_t = KvTypeFlag::F32)]
    pub kv_type: KvTypeFlag,
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
    /// With --ram-budget: read the next layer's likely experts in the background.
    #[arg(long)]
    pub prefetch: bool,
    /// With --ram-budget: read experts with O_DIRECT, bypassing the page cache (falls back to
    /// buffered reads, with a note, where the filesystem refuses).
    #[arg(long)]
    pub direct_io: bool,
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

/// The CPU back end for `matmul` with the KV cache type of `--kv-type`.
pub fn cpu_backend(args: &ModelArgs, matmul: MatmulMode) -> compute::cpu::CpuBackend {
    let kv_type = match args.kv_type {
        KvTypeFlag::F16 => compute::cpu::KvType::F16,
        KvTypeFlag::F32 => compute::cpu::KvType::F32,
    };
    compute::cpu::CpuBackend::new(matmul).with_kv_type(kv_type)
}

/// Sets the CPU thread count once for the process.
pub fn set_threads(threads: usize) -> anyhow::Result<()> {
    if threads > 0 {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("setting the thread count")?;
    }
    Ok(())
}

/// Asks the planner which back end runs the model fastest within the machine's memory, prints
/// its one-line plan, and maps the choice to a device (CPU when the planner refuses everything:
/// loading then reports the precise error).
fn planned_device(args: &ModelArgs, path: &std::path::Path) -> DeviceFlag {
    let opts = plan::PlanOptions { n_ctx: args.ctx_size as u64, ..Default::default() };
    match plan::plan(path, &opts) {
        Ok(p) => {
            eprintln!("{}", p.summary_line());
            match p.chosen {
                Some(plan::BackendKind::Gpu) if cfg!(feature = "gpu") => DeviceFlag::Gpu,
                _ => DeviceFlag::Cpu,
            }
        }
        Err(e) => {
            eprintln!("plan: {e}; running on the CPU");
            DeviceFlag::Cpu
        }
    }
}

/// The file a model argument names: the path itself when it exists, else a store model.
pub fn resolve(args: &ModelArgs) -> anyhow::Result<PathBuf> {
    let arg = args.model.to_string_lossy();
    Ok(store::resolve_model(&arg, args.store.as_deref())?)
}

/// Opens, validates and loads the model `args` names; `matmul_default` applies when the user
/// gave no `--matmul`.
///
/// Without `--device`, `run` (`ask_planner`) follows the planner's choice; `eval` and `bench` use
/// the CPU so that their output and timing never depend on a probe.
pub fn load(args: &ModelArgs, matmul_default: MatmulMode, ask_planner: bool) -> anyhow::Result<Loaded> {
    set_threads(args.threads)?;
    let path = resolve(args)?;
    let file = Arc::new(GgufModel::open(&path)?);
    let tokenizer = tokenizer::Tokenizer::from_gguf(file.metadata())
        .with_context(|| format!("{}: reading the tokenizer", args.model.display()))?;
    let matmul = match args.matmul {
        None => matmul_default,
        Some(MatmulFlag::Exact) => MatmulMode::Exact,
        Some(MatmulFlag::Q8) => MatmulMode::QuantizedActivations,
    };
    let device = match (args.device, args.ram_budget) {
        (Some(d), _) => d,
        // Paged experts run on the CPU back end today; no plan to ask for.
        (None, Some(_)) => DeviceFlag::Cpu,
        (None, None) if ask_planner => planned_device(args, &path),
        (None, None) => DeviceFlag::Cpu,
    };
    let opts = LoadOptions { n_ctx: args.ctx_size, matmul };
    let (runner, pager) = match args.ram_budget {
        None => (
            load_runner(args, device, &file, &opts)
                .with_context(|| format!("{}: loading the model", args.model.display()))?,
            None,
        ),
        Some(_) if device != DeviceFlag::Cpu => {
            anyhow::bail!("--ram-budget pages experts for the CPU back end; use it with --device cpu")
        }
        Some(budget) => {
            let policy = match args.cache_policy {
                CachePolicyFlag::Lru => pager::CachePolicy::Lru,
                CachePolicyFlag::Lfu => pager::CachePolicy::Lfu,
            };
            let popts = pager::PagerOptions {
                prefetch: args.prefetch,
                direct_io: args.direct_io,
                ..pager::PagerOptions::new(budget, policy)
            };
            let p = Arc::new(pager::Pager::open(&file, &popts)?);
            if let Some(why) = p.direct_io_refused() {
                eprintln!("note: {why}");
            }
            let b = cpu_backend(args, matmul).with_expert_store(p.clone());
            let runner = models::load_on(b, &file, &opts)
                .with_context(|| format!("{}: loading the model", args.model.display()))?;
            (runner, Some(p))
        }
    };
    Ok(Loaded { file, runner, tokenizer, pager })
}

#[cfg(feature = "gpu")]
fn load_runner(
    args: &ModelArgs,
    device: DeviceFlag,
    file: &Arc<GgufModel>,
    opts: &LoadOptions,
) -> anyhow::Result<Box<dyn Runner>> {
    use compute::wgpu::{WgpuBackend, WgpuOptions};
    let gpu = || WgpuBackend::new(WgpuOptions { adapter_index: args.gpu, prefer_discrete: true });
    match device {
        DeviceFlag::Cpu => Ok(models::load_on(cpu_backend(args, opts.matmul), file, opts)?),
        DeviceFlag::Gpu => Ok(models::load_on(gpu()?, file, opts)?),
        DeviceFlag::Auto => match gpu() {
            Ok(b) => Ok(models::load_on(b, file, opts)?),
            Err(e) => {
                eprintln!("no usable GPU ({e}); running on the CPU");
                Ok(models::load_on(cpu_backend(args, opts.matmul), file, opts)?)
            }
        },
    }
}

#[cfg(not(feature = "gpu"))]
fn load_runner(
    args: &ModelArgs,
    device: DeviceFlag,
    file: &Arc<GgufModel>,
    opts: &LoadOptions,
) -> anyhow::Result<Box<dyn Runner>> {
    match device {
        DeviceFlag::Gpu => {
            anyhow::bail!("this diskformer was built without the gpu feature; rebuild with it or use --device cpu")
        }
        DeviceFlag::Cpu | DeviceFlag::Auto => Ok(models::load_on(cpu_backend(args, opts.matmul), file, opts)?),
    }
}
