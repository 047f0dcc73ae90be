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
    let config = server::Config {
        addr: SocketAddr::new(args.host, args.port),
        models,
        preload,
        engine: server::engine::EngineOptions {
            n_ctx: args.ctx_size,
            parallel: args.parallel.max(1),
            queue_max: args.queue.max(1),
            backend,
            read_ahead: !args.no_read_ahead,
            chat_template: match &args.chat_template_file {
                Some(p) => Some(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?),
                None => None,
            },
        },
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
