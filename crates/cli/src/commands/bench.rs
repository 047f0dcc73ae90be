//! `diskformer bench`: prompt-processing and generation speed, measured as llama-bench does
//! (tools/llama-bench/llama-bench.cpp at llama.cpp 0c1e570), so the two print comparable figures.
//!
//! - ppN: a prompt of N random token ids (BOS first when the model adds one) evaluated in one
//!   batch on an empty context; tokens/s = N / time.
//! - tgN: N single-token steps on an empty context, each feeding a random id (no sampling,
//!   like llama-bench's `test_gen`); tokens/s = N / time.
//! - `-d D` first fills the context with D random tokens (untimed), as llama-bench's `-d`.
//! - One untimed warmup per test (the whole prompt for pp; for tg one token as llama-bench, then
//!   more until 0.5 s have passed: [`tg_warmup`] says why), then `-r` repetitions, each on a
//!   cleared context; mean ± sample standard deviation of the per-run tokens/s.

use crate::commands::load::{load, Loaded, MatmulFlag, ModelArgs};
use compute::quant::MatmulMode;
use models::Outputs;
use std::time::Instant;

/// `DISKFORMER_BENCH_PAUSE_MS`: a pause after the tg warmup and after each timed repetition, for
/// diagnosis only (llama-bench has none).
fn pause_between_reps() -> Option<std::time::Duration> {
    let ms: u64 = std::env::var("DISKFORMER_BENCH_PAUSE_MS").ok()?.trim().parse().ok()?;
    (ms > 0).then(|| std::time::Duration::from_millis(ms))
}

/// How long the tg test's warmup decodes at least: `DISKFORMER_BENCH_WARMUP_MS`, default 500
/// (0: one token, exactly as llama-bench).
///
/// Why longer than llama-bench's one token: after the load, or any pause, the H200's SM clock
/// sits at ~400 MHz and comes back to 1980 only 200-280 ms after work resumes (nvidia-smi
/// sampled beside `bench` with pauses, thirty-eighth session); a decode step of many small
/// dependent kernels took ~26 ms until then against ~13 after, so the first repetition carried
/// a start-up curve the others did not. llama.cpp's repetitions showed none. The warmup's aim
/// is llama-bench's: the repetitions measure the steady decode.
fn tg_warmup() -> std::time::Duration {
    let ms = std::env::var("DISKFORMER_BENCH_WARMUP_MS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(500);
    std::time::Duration::from_millis(ms)
}

/// `DISKFORMER_BENCH_STEPS=1`: each timed tg repetition's step times on standard error, for
/// diagnosing a warm-up curve inside a repetition (llama-bench prints none).
fn print_step_times() -> bool {
    std::env::var("DISKFORMER_BENCH_STEPS").is_ok_and(|v| v.trim() == "1")
}

/// Arguments of `diskformer bench`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens of the pp test (0: skip it).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    n_prompt: usize,
    /// Generated tokens of the tg test (0: skip it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n_gen: usize,
    /// Tokens already in the context before each test (untimed).
    #[arg(short = 'd', long = "n-depth", default_value_t = 0)]
    n_depth: usize,
    /// Repetitions of each test, after an untimed warm-up (the whole prompt for pp; for tg one
    /// token, then more until 0.5 s have passed, so that a GPU's clock has ramped up:
    /// DISKFORMER_BENCH_WARMUP_MS sets that time, 0 for one token as llama-bench).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    reps: usize,
    /// Seed of the random token ids.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON line instead of the table.
    #[arg(long)]
    json: bool,
}

/// Token ids from a small generator (xorshift64*), so runs are repeatable.
struct Ids {
    state: u64,
    n_vocab: u32,
}

impl Ids {
    fn next(&mut self) -> u32 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        (self.state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32 % self.n_vocab
    }

    fn take(&mut self, n: usize, first: Option<u32>) -> Vec<u32> {
        (0..n).map(|i| if i == 0 { first.unwrap_or_else(|| self.next()) } else { self.next() }).collect()
    }
}

/// Mean and sample standard deviation (0 for fewer than two samples).
fn mean_std(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.reps == 0 {
        anyhow::bail!("-r must be at least 1");
    }
    if args.n_prompt == 0 && args.n_gen == 0 {
        anyhow::bail!("nothing to measure: -p and -n are both 0");
    }
    let mut margs = args.model.clone();
    let needed = args.n_depth + args.n_prompt.max(args.n_gen);
    if margs.ctx_size == 0 {
        margs.ctx_size = needed;
    } else if margs.ctx_size < needed {
        anyhow::bail!("context {} is smaller than -d + max(-p, -n) = {needed}", margs.ctx_size);
    }
    let matmul_default = MatmulMode::QuantizedActivations;
    let matmul = match margs.matmul {
        Some(MatmulFlag::Exact) => "exact",
        Some(MatmulFlag::Q8) | None => "q8",
    };
    let mut m = load(&margs, matmul_default, false)?;
    let n_vocab = m.runner.hparams().n_vocab as u32;
    let bos = if m.tokenizer.add_bos() { m.tokenizer.bos() } else { None };
    let mut ids = Ids { state: args.seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1, n_vocab };
    let threads = rayon::current_num_threads();

    let mut pp = Vec::new();
    if args.n_prompt > 0 {
        for rep in 0..=args.reps {
            fill(&mut m, &mut ids, args.n_depth, bos)?;
            let prompt = ids.take(args.n_prompt, if args.n_depth == 0 { bos } else { None });
            let t0 = Instant::now();
            m.runner.eval(&prompt, Outputs::Last)?;
            let secs = t0.elapsed().as_secs_f64();
            if rep > 0 {
                pp.push(args.n_prompt as f64 / secs);
            }
        }
    }
    let mut tg = Vec::new();
    // Decode steps' seconds by parity, for `DISKFORMER_AB` (compute::ab).
    let mut ab_steps: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    // Tokens the tg warmup decoded (the stats count them with the repetitions').
    let mut warmup_tokens = 0usize;
    // The first decode step after the load (and after the prompt test, if any).
    let mut first_token_secs = 0.0;
    if args.n_gen > 0 {
        // The warmup (rep 0): one token, as llama-bench's, then more (passes of up to n_gen
        // tokens, each on a cleared context) until `tg_warmup` has passed since that token (the
        // first token after the load alone took over 0.5 s on the H200: `tg_first_token_s`).
        let mut warm_until = None;
        let mut rep = 0;
        while rep <= args.reps {
            let warmup_pass = rep == 0;
            fill(&mut m, &mut ids, args.n_depth, bos)?;
            let n = args.n_gen;
            let mut token = if args.n_depth == 0 { bos.unwrap_or_else(|| ids.next()) } else { ids.next() };
            // One logits buffer for the run, as a generation loop keeps (`Runner::eval_into`).
            let mut logits = Vec::new();
            // Each timed step's seconds, kept only when they will be printed.
            let mut step_secs = Vec::new();
            let keep_steps = rep > 0 && print_step_times();
            let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let t0 = Instant::now();
            for step in 0..n {
                compute::ab::set_step(step as u64);
                compute::trace::mark("bench step", None);
                let t = Instant::now();
                m.runner.eval_into(&[token], Outputs::Last, &mut logits)?;
                if warmup_pass {
                    warmup_tokens += 1;
                    let until = *warm_until.get_or_insert_with(|| {
                        first_token_secs = t.elapsed().as_secs_f64();
                        Instant::now() + tg_warmup()
                    });
                    if Instant::now() >= until {
                        break;
                    }
                }
                if rep > 0 {
                    let secs = t.elapsed().as_secs_f64();
                    ab_steps[step % 2].push(secs);
                    if keep_steps {
                        step_secs.push(secs);
                    }
                }
                token = ids.next();
            }
            let secs = t0.elapsed().as_secs_f64();
            if keep_steps {
                let at = started.as_secs_f64();
                let ms: Vec<String> = step_secs.iter().map(|s| format!("{:.1}", s * 1e3)).collect();
                eprintln!("tg repetition {rep} (from unix time {at:.3} s), step times in ms: {}", ms.join(" "));
            }
            if rep > 0 {
                tg.push(n as f64 / secs);
            } else if warm_until.is_some_and(|until| Instant::now() < until) {
                continue;
            }
            rep += 1;
            if let Some(pause) = pause_between_reps() {
                // Tells a slow start that follows idle time from one that follows the load
                // (docs/PAGING.md): each timed repetition begins after this much idle time.
                std::thread::sleep(pause);
            }
        }
    }

    let ab = compute::ab::active().map(|name| {
        eprintln!("{}", ab_summary(name, &ab_steps));
        let [a, b] = [&ab_steps[0], &ab_steps[1]].map(|v| v.iter().sum::<f64>() / v.len().max(1) as f64);
        serde_json::json!({"name": name, "a_step_s": a, "b_step_s": b, "steps_each": ab_steps[1].len()})
    });
    let md = m.file.metadata();
    let arch = m.runner.hparams().arch.clone();
    let name = md.str_opt("general.name").ok().flatten().unwrap_or("").to_string();
    let size_bytes = m.file.tensor_bytes_total();
    let n_params: u64 = m.file.tensors().map(|t| t.shape().iter().product::<u64>()).sum();
    // What llama-bench's model column says: the file type (Q4_K_M), else the dominant tensor type.
    let dtype = store::quant_of(&m.file).unwrap_or_default();
    let (pp_mean, pp_std) = if pp.is_empty() { (0.0, 0.0) } else { mean_std(&pp) };
    let (tg_mean, tg_std) = if tg.is_empty() { (0.0, 0.0) } else { mean_std(&tg) };
    if args.json {
        let j = serde_json::json!({
            "pp_tok_s": pp_mean,
            "pp_std": pp_std,
            "tg_tok_s": tg_mean,
            "tg_std": tg_std,
            "n_prompt": args.n_prompt,
            "n_gen": args.n_gen,
            "n_depth": args.n_depth,
            "reps": args.reps,
            "threads": threads,
            "matmul": matmul,
            "backend": m.runner.backend_name(),
            "model": args.model.model.display().to_string(),
            "arch": arch,
            "name": name,
            "type": dtype,
            "size_bytes": size_bytes,
            "n_params": n_params,
            "pp_samples": pp,
            "tg_samples": tg,
            "tg_warmup_tokens": warmup_tokens,
            "tg_first_token_s": first_token_secs,
            "ram_budget_bytes": margs.ram_budget,
            "ab": ab,
        });
        println!("{j}");
        crate::commands::load::report_stats(&margs, &m);
        print_experts_timing();
        write_trace();
        return Ok(());
    }
    let depth = if args.n_depth > 0 { format!(" @ d{}", args.n_depth) } else { String::new() };
    let model = format!("{arch} {dtype}");
    let size = format!("{:.2} GiB", size_bytes as f64 / (1u64 << 30) as f64);
    let params = format!("{:.2} B", n_params as f64 / 1e9);
    let backend = format!("{} ({matmul})", m.runner.backend_name());
    println!(
        "| {:30} | {:>10} | {:>10} | {:10} | {:>7} | {:>14} | {:>20} |",
        "model", "size", "params", "backend", "threads", "test", "t/s"
    );
    println!("| {:-<30} | {:->10} | {:->10} | {:-<10} | {:->7} | {:->14} | {:->20} |", "", "", "", "", "", "", "");
    for (test, n, mean, std) in [("pp", args.n_prompt, pp_mean, pp_std), ("tg", args.n_gen, tg_mean, tg_std)] {
        if n > 0 {
            let t = format!("{test}{n}{depth}");
            let ts = format!("{mean:.2} ± {std:.2}");
            println!("| {model:30} | {size:>10} | {params:>10} | {backend:10} | {threads:>7} | {t:>14} | {ts:>20} |");
        }
    }
    crate::commands::load::report_stats(&margs, &m);
    // DISKFORMER_GPU_PROFILE=1: the host's time around the GPU, which the back end would print
    // only when dropped (caches inside it keep it alive to the end of the process).
    #[cfg(feature = "gpu")]
    for line in compute::wgpu::profile_reports() {
        eprintln!("{line}");
    }
    print_experts_timing();
    write_trace();
    Ok(())
}

/// `DISKFORMER_TRACE=FILE`: the host's timeline of GPU work, written at the end of either output
/// (table or `--json`).
fn write_trace() {
    #[cfg(feature = "gpu")]
    match compute::wgpu::write_trace() {
        Some(Ok(path)) => eprintln!("trace written to {}", path.display()),
        Some(Err(e)) => eprintln!("warning: the trace (DISKFORMER_TRACE) was not written: {e}"),
        None => {}
    }
}

/// `DISKFORMER_EXPERTS_TIMING=1`: where the CPU's expert jobs spent their time, on stderr.
fn print_experts_timing() {
    if compute::quant::experts_timing::enabled() {
        eprintln!("cpu experts: {}", compute::quant::experts_timing::summary(&compute::quant::experts_timing::take()));
    }
}

/// Clears the context, then fills it with `n_depth` random tokens (untimed), as llama-bench's `-d`.
fn fill(m: &mut Loaded, ids: &mut Ids, n_depth: usize, bos: Option<u32>) -> anyhow::Result<()> {
    m.runner.reset()?;
    if n_depth > 0 {
        let d = ids.take(n_depth, bos);
        m.runner.eval(&d, Outputs::Last)?;
    }
    Ok(())
}

/// Each arm's decode steps of a `DISKFORMER_AB` run (A: even steps, B: odd): mean and median
/// milliseconds, and B's speed over A's by the means.
fn ab_summary(name: &str, steps: &[Vec<f64>; 2]) -> String {
    let stats = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        let mean = s.iter().sum::<f64>() / s.len().max(1) as f64;
        (mean * 1e3, s.get(s.len() / 2).copied().unwrap_or(0.0) * 1e3, s.len())
    };
    let (a, b) = (stats(&steps[0]), stats(&steps[1]));
    format!(
        "A/B DISKFORMER_AB={name}: A (even steps, off) mean {:.3} ms median {:.3} ({} steps); B (odd steps, on) mean {:.3} ms median {:.3} ({} steps); B/A speed {:.4}",
        a.0,
        a.1,
        a.2,
        b.0,
        b.1,
        b.2,
        if b.0 > 0.0 { a.0 / b.0 } else { 0.0 }
    )
}
