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
    /// Least frequently selected, with decay (selections count on a miss too).
    Lfu,
}

/// What the GPU expert tier does with a picked expert that holds no GPU slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MoeMissFlag {
    /// Upload it into a slot (evicting another) and compute it there.
    Upload,
    /// Compute it on the CPU from the host copy (free GPU slots are still filled, never evicted).
    Cpu,
    /// Whichever is cheaper by measured costs (upload bandwidth, CPU time per expert).
    Auto,
    /// Read by the GPU from a copy of every expert in host memory (bounded by --ram-budget):
    /// no wait per layer; the GPU's slots are refilled between tokens.
    Host,
    /// As host, and each layer's misses divided between the GPU and the CPU, computing at
    /// once (a readback per layer; the CPU's share follows which of the two finishes first).
    Split,
}

impl MoeMissFlag {
    /// The planner's name for it.
    pub fn tier_miss(self) -> plan::TierMiss {
        match self {
            MoeMissFlag::Upload => plan::TierMiss::Upload,
            MoeMissFlag::Cpu => plan::TierMiss::Cpu,
            MoeMissFlag::Auto => plan::TierMiss::Auto,
            MoeMissFlag::Host => plan::TierMiss::Host,
            MoeMissFlag::Split => plan::TierMiss::Split,
        }
    }
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

/// The model of a command that reads only its headers (`plan`, `describe`): given as the
/// first argument or, as the commands that load a model take it, with `-m` / `--model`.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelName {
    /// The model: a GGUF file, any part of a split set, a folder in the Hugging Face layout, or
    /// a model of the store (`owner/repo:Q4_K_M`).
    #[arg(value_name = "MODEL", required_unless_present = "model", conflicts_with = "model")]
    positional: Option<String>,
    /// The model, as `run` and `bench` take it (instead of the first argument).
    #[arg(short, long, value_name = "MODEL")]
    model: Option<String>,
}

impl ModelName {
    /// The name given, whichever way.
    pub fn name(&self) -> &str {
        // clap requires exactly one of the two.
        self.positional.as_deref().or(self.model.as_deref()).unwrap_or_default()
    }
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
    /// Which cached expert a miss evicts, in the RAM cache (--ram-budget) and in the GPU's expert
    /// slots (--gpu-budget).
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
    /// Page a mixture-of-experts model's experts through a pool of GPU slots so that the GPU
    /// holds at most this many bytes (dense weights, KV cache, scratch and the pool; e.g. 4G).
    /// Implies --device gpu; misses come from --ram-budget's cache when given, else the memory map.
    #[arg(long, value_parser = parse_size)]
    pub gpu_budget: Option<u64>,
    /// With --gpu-budget: what a picked expert that is not on the GPU does. Default: host when a
    /// host copy of every expert fits --ram-budget (or, without one, the available RAM with a
    /// margin), split instead with 8 or more threads, else auto; --stats says which and why.
    #[arg(long, value_enum)]
    pub moe_miss: Option<MoeMissFlag>,
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
    /// The GPU expert tier's statistics table, when experts are paged on the GPU (`--gpu-budget`).
    pub gpu_tier_stats: Option<Box<dyn Fn() -> String>>,
}

/// Prints the expert cache's per-layer statistics to stderr when `--stats` asked for them.
pub fn report_stats(args: &ModelArgs, m: &Loaded) {
    if !args.stats {
        return;
    }
    if let Some(p) = &m.pager {
        eprint!("{}", p.format_stats());
    }
    if let Some(tier) = &m.gpu_tier_stats {
        eprint!("{}", tier());
    }
    if m.pager.is_none() && m.gpu_tier_stats.is_none() {
        eprintln!("expert cache: none (experts used in place from the memory map; --ram-budget pages them)");
    }
    // A poller that gives up sleeps for the rest of its step, out of the step's broadcast
    // regions (the CPU experts' jobs, the read-ahead): fewer threads on each, and spawned tasks
    // once half of them are gone.
    let polls = compute::cpu::warm::poll_stats();
    let pinned = match compute::cpu::pin::pinned_threads() {
        0 => "threads not pinned".to_string(),
        n => format!("{n} threads pinned to cores"),
    };
    eprintln!(
        "CPU pool: {pinned}; {} step pollers gave up over the run (nothing to run for {} ms), in {} of {} polled steps \
         ({} with half or more gone, their later regions spawned; the first give-up {} us into its step on average)",
        polls.pollers_gave_up,
        compute::cpu::warm::MAX_IDLE.as_millis(),
        polls.steps_losing_pollers,
        polls.steps,
        polls.steps_losing_broadcasts,
        polls.first_give_up_mean_us
    );
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
/// A pool with a thread per core also has thread `i` pinned to the `i`-th core
/// (`compute::cpu::pin`, which says why; `DISKFORMER_PIN_THREADS=0` leaves them free).
pub fn set_threads(threads: usize) -> anyhow::Result<()> {
    let n = if threads > 0 { threads } else { std::thread::available_parallelism().map_or(1, |n| n.get()) };
    let pin = compute::cpu::pin::wanted(n);
    if threads > 0 || pin {
        let mut pool = rayon::ThreadPoolBuilder::new().num_threads(threads);
        if pin {
            pool = pool.start_handler(|i| {
                compute::cpu::pin::pin_current_thread(i);
            });
        }
        pool.build_global().context("setting the thread count")?;
    }
    Ok(())
}

/// What the planner chose for `run`: the device, and the budgets of the expert tiers it plans.
struct Planned {
    device: DeviceFlag,
    /// The GPU expert tier's budget (a model larger than the GPU whose dense part and an expert
    /// cache fit there).
    gpu_budget: Option<u64>,
    /// The RAM expert cache's budget (a mixture of experts larger than the RAM, on the CPU).
    ram_budget: Option<u64>,
}

impl Planned {
    fn on(device: DeviceFlag) -> Planned {
        Planned { device, gpu_budget: None, ram_budget: None }
    }
}

/// Asks the planner which back end runs the model fastest within the machine's memory, prints
/// its one-line plan, and maps the choice to a device (CPU when the planner refuses everything:
/// loading then reports the precise error), with the budgets of the expert tiers it planned.
fn planned_device(args: &ModelArgs, path: &std::path::Path) -> Planned {
    let opts = plan::PlanOptions { n_ctx: args.ctx_size as u64, ..Default::default() };
    match plan::plan(path, &opts) {
        Ok(p) => {
            eprintln!("{}", p.summary_line());
            if let Some(hint) = p.gpu_tier_hint() {
                eprintln!("note: {hint}");
            }
            match p.chosen {
                Some(plan::BackendKind::Gpu) if cfg!(feature = "gpu") => Planned::on(DeviceFlag::Gpu),
                Some(plan::BackendKind::GpuPaged) if cfg!(feature = "gpu") => {
                    Planned { gpu_budget: p.gpu_tier_budget(), ..Planned::on(DeviceFlag::Gpu) }
                }
                _ => Planned {
                    ram_budget: p.chosen_plan().and_then(|b| b.estimate.as_ref()).and_then(|e| e.expert_cache_bytes),
                    ..Planned::on(DeviceFlag::Cpu)
                },
            }
        }
        Err(e) => {
            eprintln!("plan: {e}; running on the CPU");
            Planned::on(DeviceFlag::Cpu)
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
    let planned = match (args.device, args.ram_budget) {
        _ if args.gpu_budget.is_some() => Planned::on(DeviceFlag::Gpu),
        (Some(d), _) => Planned::on(d),
        // Experts paged into RAM alone run on the CPU back end; no plan to ask for.
        (None, Some(_)) => Planned::on(DeviceFlag::Cpu),
        (None, None) if ask_planner => planned_device(args, &path),
        (None, None) => Planned::on(DeviceFlag::Cpu),
    };
    let device = planned.device;
    let gpu_budget = args.gpu_budget.or(planned.gpu_budget);
    let ram_budget = args.ram_budget.or(planned.ram_budget);
    let opts = LoadOptions { n_ctx: args.ctx_size, matmul };
    if matches!(args.device, Some(DeviceFlag::Cpu)) && args.gpu_budget.is_some() {
        anyhow::bail!("--gpu-budget pages experts into GPU memory; it cannot run with --device cpu");
    }
    let mut gpu_tier_stats = None;
    let (runner, pager) = match ram_budget {
        _ if gpu_budget.is_some() => {
            let budget = gpu_budget.unwrap_or(0);
            let (runner, pager, stats) = load_gpu_tier(args, budget, &file, &path, &opts)
                .with_context(|| format!("{}: loading the model on the GPU expert tier", args.model.display()))?;
            gpu_tier_stats = Some(stats);
            (runner, pager)
        }
        None => (
            load_runner(args, device, &file, &opts)
                .with_context(|| format!("{}: loading the model", args.model.display()))?,
            None,
        ),
        Some(_) if device != DeviceFlag::Cpu => {
            anyhow::bail!("--ram-budget alone pages experts for the CPU back end; use it with --device cpu, or add --gpu-budget for the GPU")
        }
        Some(budget) => {
            if args.ram_budget.is_none() {
                eprintln!(
                    "note: the model is larger than the RAM: its experts are paged from disk through a {} cache \
                     (as --ram-budget {}M)",
                    plan::format_bytes(budget),
                    budget >> 20
                );
            }
            let p = open_pager(args, budget, &file)?;
            let b = cpu_backend(args, matmul).with_expert_store(p.clone());
            let runner = models::load_on(b, &file, &opts)
                .with_context(|| format!("{}: loading the model", args.model.display()))?;
            (runner, Some(p))
        }
    };
    Ok(Loaded { file, runner, tokenizer, pager, gpu_tier_stats })
}

/// The expert cache `--ram-budget` asks for, if it does.
fn open_pager(args: &ModelArgs, budget: u64, file: &Arc<GgufModel>) -> anyhow::Result<Arc<pager::Pager>> {
    let policy = match args.cache_policy {
        CachePolicyFlag::Lru => pager::CachePolicy::Lru,
        CachePolicyFlag::Lfu => pager::CachePolicy::Lfu,
    };
    let popts = pager::PagerOptions {
        prefetch: args.prefetch,
        direct_io: args.direct_io,
        ..pager::PagerOptions::new(budget, policy)
    };
    let p = Arc::new(pager::Pager::open(file, &popts)?);
    if let Some(why) = p.direct_io_refused() {
        eprintln!("note: {why}");
    }
    Ok(p)
}

/// Types of the runner, the RAM tier and the tier's statistics table.
type TierLoad = (Box<dyn Runner>, Option<Arc<pager::Pager>>, Box<dyn Fn() -> String>);

/// `--gpu-budget`: places dense weights, KV cache and scratch within the budget, gives the rest
/// to a pool of expert slots, and loads the model on a GPU back end whose misses come from the
/// host copy, the RAM tier (`--ram-budget`) or the memory map ([`plan::gpu_tier`], which the
/// server's `--gpu-budget` shares).
#[cfg(feature = "gpu")]
fn load_gpu_tier(
    args: &ModelArgs,
    budget_bytes: u64,
    file: &Arc<GgufModel>,
    path: &std::path::Path,
    opts: &LoadOptions,
) -> anyhow::Result<TierLoad> {
    let desc = plan::describe(path)?;
    let n_ctx = match opts.n_ctx {
        0 => desc.context_length.unwrap_or(4096).clamp(1, 4096),
        n => n as u64,
    };
    let tier = plan::gpu_tier(
        file,
        n_ctx,
        &plan::GpuTierOptions {
            budget_bytes,
            ram_budget_bytes: args.ram_budget,
            miss: args.moe_miss.map(MoeMissFlag::tier_miss),
            cache_policy: match args.cache_policy {
                CachePolicyFlag::Lru => pager::CachePolicy::Lru,
                CachePolicyFlag::Lfu => pager::CachePolicy::Lfu,
            },
            prefetch: args.prefetch,
            direct_io: args.direct_io,
            gpu_index: args.gpu,
            matmul: opts.matmul,
        },
    )?;
    eprintln!("{}", tier.placement_line);
    if let Some(why) = tier.pager.as_ref().and_then(|p| p.direct_io_refused()) {
        eprintln!("note: {why}");
    }
    let runner = models::load_on(tier.backend.clone(), file, opts)?;
    let (b, miss_line) = (tier.backend, tier.miss_line);
    Ok((
        runner,
        tier.pager,
        Box::new(move || format!("{miss_line}\n{}", b.format_expert_tier_stats().unwrap_or_default())),
    ))
}

#[cfg(not(feature = "gpu"))]
fn load_gpu_tier(
    _args: &ModelArgs,
    _budget_bytes: u64,
    _file: &Arc<GgufModel>,
    _path: &std::path::Path,
    _opts: &LoadOptions,
) -> anyhow::Result<TierLoad> {
    anyhow::bail!("--gpu-budget needs a diskformer built with the gpu feature")
}

#[cfg(feature = "gpu")]
fn load_runner(
    args: &ModelArgs,
    device: DeviceFlag,
    file: &Arc<GgufModel>,
    opts: &LoadOptions,
) -> anyhow::Result<Box<dyn Runner>> {
    use compute::wgpu::{WgpuBackend, WgpuOptions};
    // --matmul (exact / q8) picks f32 or int8 activations on the GPU as it does on the CPU.
    let gpu = || {
        WgpuBackend::new(WgpuOptions { adapter_index: args.gpu, prefer_discrete: true })
            .map(|b| b.with_matmul_mode(opts.matmul))
    };
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
