//! `diskformer serve`: the OpenAI- and Anthropic-compatible HTTP server (crates/server).

use anyhow::{bail, Context};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

/// Which back end runs the models.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum DeviceFlag {
    /// The planner's choice.
    Auto,
    /// CPU.
    Cpu,
    /// GPU (resident).
    Gpu,
}

/// Flags of `diskformer serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// One GGUF model to serve: a path (any part of a split set) or a store name; its name is the file stem.
    #[arg(short, long, conflicts_with = "models_dir")]
    pub model: Option<PathBuf>,
    /// Serve every GGUF (or split set) in this folder, loaded on demand.
    #[arg(long)]
    pub models_dir: Option<PathBuf>,
    /// Loaded models at most; the least recently used idle one is unloaded first (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub models_max: usize,
    /// MiB of memory to keep free when loading a model (idle models are unloaded for it).
    #[arg(long, default_value_t = 0)]
    pub models_memory_margin: u64,
    /// Do not load models named by requests (unless a request asks `?autoload=true`).
    #[arg(long)]
    pub no_models_autoload: bool,
    /// Address to bind. The default keeps the server on this machine.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// API key required on every route but /health.
    #[arg(long, env = "DISKFORMER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Context length per session (0: the model's, capped by the planner).
    #[arg(short = 'c', long, default_value_t = 0)]
    pub ctx_size: u64,
    /// Sessions per model: requests generated at once.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// CPU threads shared by every session (0: one per core).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
    /// Requests admitted per model (running and waiting); more get 503.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// Back end.
    #[arg(long, value_enum, default_value_t = DeviceFlag::Auto)]
    pub device: DeviceFlag,
    /// A chat template file (Jinja) used instead of the models' own.
    #[arg(long)]
    pub chat_template_file: Option<PathBuf>,
    /// Skip reading the weights into the page cache at load.
    #[arg(long)]
    pub no_read_ahead: bool,
    /// Page mixture-of-experts models' experts from disk through a host cache of at most this
    /// many bytes per model (e.g. 8G), shared by its sessions, instead of mapping them.
    #[arg(long, value_parser = parse_size)]
    pub ram_budget: Option<u64>,
    /// Run mixture-of-experts models on the GPU expert tier within this much GPU memory per model
    /// (e.g. 4G): dense weights, KV cache and a pool of expert slots, misses from a host copy of
    /// the experts (or, with --ram-budget, through a RAM cache of that size). As `run
    /// --gpu-budget`; one session per model.
    #[arg(long, value_parser = parse_size)]
    pub gpu_budget: Option<u64>,
    /// With --gpu-budget: how an expert without a GPU slot is served (as `run --moe-miss`;
    /// default: the host copy when every expert fits in RAM, else auto).
    #[arg(long, value_enum)]
    pub moe_miss: Option<crate::commands::load::MoeMissFlag>,
    /// Which cached expert a miss evicts, in the RAM cache (--ram-budget) and in the GPU's expert
    /// slots (--gpu-budget).
    #[arg(long, value_enum, default_value_t = crate::commands::load::CachePolicyFlag::Lfu)]
    pub cache_policy: crate::commands::load::CachePolicyFlag,
    /// With --ram-budget: read the next layer's likely experts in the background.
    #[arg(long)]
    pub prefetch: bool,
    /// With --ram-budget: read experts with O_DIRECT, bypassing the page cache.
    #[arg(long)]
    pub direct_io: bool,
    /// Print each paged model's per-layer expert-cache statistics (the RAM cache's, or the GPU
    /// expert tier's with --gpu-budget) to stderr when it is unloaded or the server stops
    /// (/metrics has the RAM cache's totals either way).
    #[arg(long)]
    pub stats: bool,
    /// Per-model options (INI: a `[*]` section for every model, `[NAME]` for one; keys are
    /// this command's long flag names, e.g. `ram-budget = 8G`); see docs/SERVER.md.
    #[arg(long)]
    pub models_preset: Option<PathBuf>,
}

fn parse_size(text: &str) -> Result<u64, String> {
    plan::parse_bytes(text).map_err(|e| e.to_string())
}

/// Runs the server until Ctrl-C.
pub fn run(args: Args) -> anyhow::Result<()> {
    crate::commands::load::set_threads(args.threads)?;
    let (models, preload) = match (&args.model, &args.models_dir) {
        (Some(arg), _) => {
            // A path, or a store name (`owner/repo:Q4_K_M`).
            let m = &store::resolve_model(&arg.to_string_lossy(), None)?;
            let name = m
                .file_stem()
                .and_then(|s| s.to_str())
                .with_context(|| format!("{}: not a model file name", m.display()))?
                .to_string();
            (vec![(name.clone(), m.clone())], vec![name])
        }
        (None, Some(dir)) => {
            let list = server::registry::scan_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
            if list.is_empty() {
                bail!("{}: no .gguf models in this folder", dir.display());
            }
            (list, Vec::new())
        }
        (None, None) => bail!("give --model FILE or --models-dir DIR"),
    };
    let backend = match args.device {
        DeviceFlag::Auto => None,
        DeviceFlag::Cpu => Some(server::BackendKind::Cpu),
        DeviceFlag::Gpu => Some(server::BackendKind::Gpu),
    };
    let engine = server::engine::EngineOptions {
        n_ctx: args.ctx_size,
        parallel: args.parallel.max(1),
        queue_max: args.queue.max(1),
        backend,
        read_ahead: !args.no_read_ahead,
        chat_template: match &args.chat_template_file {
            Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?),
            None => None,
        },
        ram_budget_bytes: args.ram_budget,
        gpu_budget_bytes: args.gpu_budget,
        moe_miss: args.moe_miss.map(crate::commands::load::MoeMissFlag::tier_miss),
        cache_policy: match args.cache_policy {
            crate::commands::load::CachePolicyFlag::Lru => server::CachePolicy::Lru,
            crate::commands::load::CachePolicyFlag::Lfu => server::CachePolicy::Lfu,
        },
        prefetch: args.prefetch,
        direct_io: args.direct_io,
        stats: args.stats,
    };
    let names: Vec<String> = models.iter().map(|m| m.0.clone()).collect();
    let model_options = match &args.models_preset {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            server::presets::resolve(&text, &engine, &names).with_context(|| format!("{}", p.display()))?
        }
        None => Default::default(),
    };
    let config = server::Config {
        addr: SocketAddr::new(args.host, args.port),
        models,
        preload,
        engine,
        model_options,
        router: server::registry::RouterOptions {
            models_max: args.models_max,
            margin_bytes: args.models_memory_margin << 20,
            autoload: !args.no_models_autoload,
        },
        api_key: args.api_key,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")?;
    rt.block_on(async move {
        let ready = |addr: SocketAddr| {
            // Tests and scripts read this line for the port.
            println!("listening on http://{addr}");
            use std::io::Write as _;
            let _ = std::io::stdout().flush();
        };
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        server::serve(config, ready, shutdown).await
    })?;
    Ok(())
}
