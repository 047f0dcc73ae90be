//! `diskformer plan`: which back end runs a model here, and why every other would not.

use anyhow::Context;
use plan::{format_bytes, parse_bytes, Plan, PlanOptions, ProbeOptions, Task};

/// Parses a byte size for clap (`4G`, `512M`, `2.5GiB`).
pub fn size_arg(s: &str) -> Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

/// The budget flags, shared with the commands that load a model.
#[derive(clap::Args, Clone, Debug)]
pub struct BudgetArgs {
    /// GPU memory to use at most (default: the GPU's free memory, when known), e.g. 4G; the
    /// flag `run` and `bench` take (`--budget` is the same).
    #[arg(long = "gpu-budget", visible_alias = "budget", value_parser = size_arg)]
    pub budget: Option<u64>,
    /// RAM to use at most (default: available RAM), e.g. 8G.
    #[arg(long, value_parser = size_arg)]
    pub ram_budget: Option<u64>,
    /// Context length to plan for (0: the model's, capped at 4096).
    #[arg(short = 'c', long, default_value_t = 0)]
    pub ctx_size: u64,
    /// GPU adapter index (`diskformer probe` lists them).
    #[arg(long)]
    pub gpu: Option<usize>,
}

impl BudgetArgs {
    /// As planner options.
    pub fn options(&self) -> PlanOptions {
        PlanOptions {
            budget_bytes: self.budget,
            ram_budget_bytes: self.ram_budget,
            task: None,
            n_ctx: self.ctx_size,
            gpu_index: self.gpu,
        }
    }
}

/// Arguments of `diskformer plan`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: super::load::ModelName,
    #[command(flatten)]
    pub budgets: BudgetArgs,
    /// The task wanted (text-generation, embedding, text-classification).
    #[arg(long)]
    pub task: Option<String>,
    /// Skip measuring bandwidths; use the table of measured devices instead.
    #[arg(long)]
    pub no_measure: bool,
    /// Plan for the machine a `diskformer probe --json` wrote (another machine, or this one
    /// measured once) instead of probing this one.
    #[arg(long, value_name = "PROBE_JSON")]
    pub machine: Option<std::path::PathBuf>,
    /// Print JSON (the stable form of docs/PLAN.md).
    #[arg(long)]
    pub json: bool,
}

/// The readable table.
pub fn print_table(p: &Plan) {
    println!("model {} ({}), context {}", p.model.display(), p.architecture.as_deref().unwrap_or("unknown"), p.n_ctx);
    let budget = |b: &plan::Budget| {
        b.bytes.map_or(format!("unknown ({})", b.source), |v| format!("{} ({})", format_bytes(v), b.source))
    };
    println!("budgets: gpu {}, ram {}", budget(&p.gpu_budget), budget(&p.ram_budget));
    println!();
    println!("  {:<10} {:<14} {:>10} {:>10} {:>9}  device / reason", "back end", "verdict", "gpu", "ram", "tok/s");
    for b in &p.backends {
        let mark = if Some(b.backend) == p.chosen { "*" } else { " " };
        match (&b.estimate, &b.refusal) {
            (Some(e), _) => println!(
                "{mark} {:<10} {:<14} {:>10} {:>10} {:>9}  {}{}",
                b.backend.as_str(),
                match (mark, b.backend) {
                    ("*", _) => "ok, chosen",
                    // Without a speed it is not chosen automatically: it runs when asked for.
                    (_, plan::BackendKind::GpuPaged) if e.tok_per_sec.is_none() => "ok, on request",
                    _ => "ok, slower",
                },
                format_bytes(e.gpu_bytes),
                format_bytes(e.ram_bytes),
                e.tok_per_sec.map_or("?".to_string(), |s| format!("{s:.1}")),
                b.device.as_deref().unwrap_or(""),
                match (e.bandwidth_source, e.host_read_bytes_per_s) {
                    (Some(s), Some(h)) if e.host_bytes_per_token > 0 => format!(
                        " (bandwidth {}; misses {} per token from host memory at {:.1} GB/s)",
                        s.as_str(),
                        format_bytes(e.host_bytes_per_token),
                        h / 1e9
                    ),
                    (Some(s), _) => format!(" (bandwidth {})", s.as_str()),
                    (None, _) => String::new(),
                } + &match (e.expert_cache_bytes, e.disk_bytes) {
                    // The GPU tier with a RAM budget below its host copy: the rest from disk.
                    (None, d) if d > 0 => format!(
                        "; {} per token from disk{}",
                        format_bytes(d),
                        e.disk_read_bytes_per_s
                            .map_or(" (no disk rate: no speed)".to_string(), |r| format!(" at {:.2} GB/s", r / 1e9))
                    ),
                    _ => String::new(),
                } + &e.expert_cache_bytes.map_or(String::new(), |c| {
                    format!(
                        "; experts paged from disk through a {} cache (--ram-budget {}M), {} per token read{}",
                        format_bytes(c),
                        c >> 20,
                        format_bytes(e.disk_bytes),
                        e.disk_read_bytes_per_s
                            .map_or(" (no disk rate: no speed)".to_string(), |r| format!(" at {:.2} GB/s", r / 1e9))
                    )
                }),
            ),
            (None, Some(r)) => println!(
                "{mark} {:<10} {:<14} {:>10} {:>10} {:>9}  {}",
                b.backend.as_str(),
                format!("no: {}", r.code.as_str()),
                "",
                "",
                "",
                match r.need_bytes {
                    Some(n) => format!("{} (needs {})", r.reason, format_bytes(n)),
                    None => r.reason.clone(),
                }
            ),
            (None, None) => {}
        }
    }
    if let Some(hint) = p.gpu_tier_hint() {
        println!("note: {hint}");
    }
    for a in &p.assumptions {
        println!("assumed: {a}");
    }
    println!("speed model: {}", p.speed_model);
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    let mut opts = args.budgets.options();
    opts.task = match args.task.as_deref() {
        None => None,
        Some("text-generation") => Some(Task::TextGeneration),
        Some("embedding") => Some(Task::Embedding),
        Some("text-classification") => Some(Task::TextClassification),
        Some(other) => anyhow::bail!("unknown task {other:?}; one of text-generation, embedding, text-classification"),
    };
    let desc = plan::describe(&store::resolve_model(args.model.name(), None)?)?;
    let dir = desc.gguf.as_deref().and_then(|g| g.parent()).unwrap_or(&desc.path).to_path_buf();
    let machine = match &args.machine {
        Some(file) => {
            let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{}: not the JSON of `diskformer probe --json`", file.display()))?
        }
        None => plan::probe(&ProbeOptions {
            disk_paths: vec![dir],
            measure_bandwidth: !args.no_measure,
            disk_rate_beyond_ram: plan::disk_rate_beyond_ram(&desc, &opts),
        }),
    };
    let p = plan::plan_with(&desc, &machine, &opts);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print_table(&p);
    }
    Ok(())
}
