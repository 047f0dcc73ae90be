//! `diskformer synth`: write a GGUF of any architecture and size with random weights, streamed
//! to disk chunk by chunk (see `models::synth` for the value laws and the routing skew).

use anyhow::{bail, Context};
use gguf::GgmlType;
use indicatif::{ProgressBar, ProgressStyle};
use models::synth::{SynthOptions, SynthPlan, SynthShape, PARAM_KEYS, SHAPES, SYNTH_ARCHITECTURES};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `diskformer synth`.
#[derive(clap::Args)]
pub struct Args {
    /// Architecture (`general.architecture`); optional with --shape, which implies it.
    #[arg(long)]
    arch: Option<String>,
    /// A named shape of a real model (see --list).
    #[arg(long)]
    shape: Option<String>,
    /// Hyper-parameters `k=v,k=v`, applied over --shape (or over a small default of --arch).
    #[arg(long, default_value = "")]
    params: String,
    /// Type of the weight matrices (Q4_0, Q4_K, Q8_0, F16, ...); norms and routers stay F32.
    #[arg(long = "type", default_value = "Q8_0")]
    dtype: String,
    /// Output file.
    #[arg(long, short)]
    out: Option<PathBuf>,
    /// Skew expert popularity: the router row of the rank-r expert is scaled by r^-S.
    #[arg(long, default_value_t = 0.0)]
    routing_skew: f32,
    /// Seed of every weight.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Vocabulary size (overrides the shape's).
    #[arg(long)]
    vocab: Option<usize>,
    /// Quantize Gaussian f32 rows with the reference quantizer instead of drawing Q8_0/Q4_0/Q4_K
    /// blocks directly (exact but 30-100x slower; see `models::synth`).
    #[arg(long)]
    exact_quantization: bool,
    /// CPU threads (0: one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// Print the named shapes and parameter keys, then exit.
    #[arg(long)]
    list: bool,
}

fn list() -> anyhow::Result<()> {
    println!("{:16} {:10} {:>9} {:>10}  mimics", "shape", "arch", "params", "Q4_0 GB");
    for &(name, arch, what) in SHAPES {
        let plan = SynthPlan::new(
            &SynthShape::named(name)?,
            &SynthOptions { dtype: GgmlType::Q4_0, ..SynthOptions::default() },
            name,
        )?;
        println!(
            "{name:16} {arch:10} {:>8.2}B {:>10.1}  {what}",
            plan.n_params() as f64 / 1e9,
            plan.tensor_bytes() as f64 / 1e9
        );
    }
    println!("\narchitectures: {}", SYNTH_ARCHITECTURES.join(", "));
    println!("--params keys: {}", PARAM_KEYS.join(", "));
    Ok(())
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.list {
        return list();
    }
    if args.threads > 0 {
        rayon::ThreadPoolBuilder::new().num_threads(args.threads).build_global().context("setting the thread count")?;
    }
    let (mut shape, name) = match (&args.shape, &args.arch) {
        (Some(s), arch) => {
            let shape = SynthShape::named(s)?;
            if let Some(a) = arch.as_deref().filter(|a| *a != shape.arch) {
                bail!("--shape {s} is a {} model, not --arch {a}", shape.arch);
            }
            (shape, s.clone())
        }
        (None, Some(a)) => (SynthShape::minimal(a)?, format!("{a} custom")),
        (None, None) => bail!("give --shape NAME or --arch ARCH (see --list)"),
    };
    shape.apply_params(&args.params)?;
    if let Some(v) = args.vocab {
        shape.n_vocab = v;
    }
    let dtype =
        GgmlType::from_name(&args.dtype).with_context(|| format!("--type {:?} is not a ggml type name", args.dtype))?;
    let Some(out) = &args.out else { bail!("give --out FILE") };
    let plan = SynthPlan::new(
        &shape,
        &SynthOptions {
            dtype,
            seed: args.seed,
            routing_skew: args.routing_skew,
            exact_quantization: args.exact_quantization,
            ..SynthOptions::default()
        },
        &name,
    )?;
    let total = plan.tensor_bytes();
    eprintln!(
        "synth: {name} ({}), {} tensors, {:.3} B params, {:.2} GiB of {dtype} data -> {}",
        shape.arch,
        plan.tensors.len(),
        plan.n_params() as f64 / 1e9,
        total as f64 / (1u64 << 30) as f64,
        out.display()
    );
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .context("progress bar template")?,
    );
    let t0 = Instant::now();
    plan.write_file(out, &mut |n| bar.inc(n))?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("synth: wrote {} in {secs:.1} s ({:.0} MB/s)", out.display(), total as f64 / 1e6 / secs.max(1e-9));
    Ok(())
}
