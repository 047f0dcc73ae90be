//! `diskformer run`: generate text from a prompt (or chat), streamed as it is produced.

use crate::commands::load::{load, Loaded, ModelArgs};
use compute::quant::MatmulMode;
use models::sampling::{Sampler, SamplingParams};
use models::Outputs;
use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

/// Arguments of `diskformer run`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (with --chat: the first user message; without -p, --chat reads messages from
    /// standard input, one per line).
    #[arg(short, long)]
    prompt: Option<String>,
    /// Tokens to generate at most (per reply with --chat).
    #[arg(short = 'n', long, default_value_t = 256)]
    n_predict: usize,
    /// Format the prompt with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message for --chat.
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// Sampling flags (llama.cpp's names and defaults).
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k (0: off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1: off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0: off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed (the same seed gives the same text).
    #[arg(short = 's', long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// As sampler parameters.
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        }
    }
}

/// Counts of one generation.
struct Stats {
    n_prompt: usize,
    prompt_ms: f64,
    n_gen: usize,
    gen_ms: f64,
}

/// Feeds `prompt` (after what the runner already holds), then samples until an end-of-generation
/// token or `n_predict` tokens, writing text as it becomes valid UTF-8.
fn generate(
    m: &mut Loaded,
    prompt: &[u32],
    n_predict: usize,
    sampler: &mut Sampler,
    history: &mut Vec<u32>,
) -> anyhow::Result<Stats> {
    let n_vocab = m.runner.hparams().n_vocab;
    let free = m.runner.n_ctx() - m.runner.n_past();
    if prompt.len() >= free {
        anyhow::bail!("the prompt has {} tokens but only {free} of the context remain; raise --ctx-size", prompt.len());
    }
    let t0 = Instant::now();
    let mut logits = m.runner.eval(prompt, Outputs::Last)?;
    let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;
    history.extend_from_slice(prompt);
    let mut out = std::io::stdout().lock();
    let mut decoder = tokenizer::StreamDecoder::new(&m.tokenizer, false);
    let t1 = Instant::now();
    let mut n_gen = 0;
    let limit = n_predict.min(m.runner.n_ctx() - m.runner.n_past());
    while n_gen < limit {
        let id = sampler.sample(&logits[logits.len() - n_vocab..], history);
        n_gen += 1;
        history.push(id);
        if m.tokenizer.is_eog(id) {
            break;
        }
        write!(out, "{}", decoder.push(id))?;
        out.flush()?;
        if n_gen == limit {
            break;
        }
        m.runner.eval_into(&[id], Outputs::Last, &mut logits)?;
    }
    write!(out, "{}", decoder.finish())?;
    out.flush()?;
    Ok(Stats { n_prompt: prompt.len(), prompt_ms, n_gen, gen_ms: t1.elapsed().as_secs_f64() * 1e3 })
}

fn print_stats(s: &Stats) {
    let rate = |n: usize, ms: f64| if ms > 0.0 { n as f64 / (ms / 1e3) } else { 0.0 };
    eprintln!(
        "\n[prompt {} tokens, {:.1} tok/s | generation {} tokens, {:.1} tok/s]",
        s.n_prompt,
        rate(s.n_prompt, s.prompt_ms),
        s.n_gen,
        rate(s.n_gen, s.gen_ms)
    );
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    let mut m = load(&args.model, MatmulMode::QuantizedActivations, true)?;
    let mut sampler = Sampler::new(args.sampling.params());
    let mut history = Vec::new();
    if !args.chat {
        let text = args.prompt.as_deref().unwrap_or("");
        let ids = m.tokenizer.encode(text, true, true)?;
        if ids.is_empty() {
            anyhow::bail!("the prompt is empty and the model adds no BOS token; give -p TEXT");
        }
        print!("{text}");
        let stats = generate(&mut m, &ids, args.n_predict, &mut sampler, &mut history)?;
        print_stats(&stats);
        crate::commands::load::report_stats(&args.model, &m);
        return Ok(());
    }
    let template = tokenizer::ChatTemplate::from_gguf(m.file.metadata())?.ok_or_else(|| {
        anyhow::anyhow!(
            "{}: the model has no chat template (tokenizer.chat_template); run without --chat",
            args.model.model.display()
        )
    })?;
    let mut messages: Vec<tokenizer::ChatMessage> = Vec::new();
    if let Some(s) = &args.system {
        messages.push(tokenizer::ChatMessage::new("system", s));
    }
    let interactive = args.prompt.is_none();
    let mut pending = args.prompt.clone();
    let stdin = std::io::stdin();
    let mut rendered_so_far = String::new();
    loop {
        let user = match pending.take() {
            Some(p) => p,
            None if interactive => {
                if stdin.is_terminal() {
                    eprint!("\n> ");
                }
                let mut line = String::new();
                if stdin.lock().read_line(&mut line)? == 0 {
                    break;
                }
                let line = line.trim_end_matches(['\r', '\n']).to_string();
                if line.is_empty() {
                    continue;
                }
                line
            }
            None => break,
        };
        messages.push(tokenizer::ChatMessage::new("user", &user));
        let opts = tokenizer::ChatOptions { add_generation_prompt: true, ..Default::default() };
        let rendered = template.render(&messages, &opts)?;
        // Feed only what the KV cache does not hold yet: the rendered conversation grows at the end.
        let new_text = rendered.strip_prefix(&rendered_so_far).unwrap_or(&rendered).to_string();
        if !rendered.starts_with(&rendered_so_far) {
            m.runner.reset()?;
            history.clear();
        }
        let ids = m.tokenizer.encode(&new_text, m.runner.n_past() == 0, true)?;
        let start = history.len();
        let stats = generate(&mut m, &ids, args.n_predict, &mut sampler, &mut history)?;
        let reply_ids: Vec<u32> =
            history[start + ids.len()..].iter().copied().filter(|&id| !m.tokenizer.is_eog(id)).collect();
        let reply = m.tokenizer.decode(&reply_ids);
        messages.push(tokenizer::ChatMessage::new("assistant", &reply));
        print_stats(&stats);
        // What the template renders for the history up to and including this reply; the next
        // turn's rendering starts with it when the template is append-only.
        rendered_so_far = format!("{rendered}{}", m.tokenizer.decode(&history[start + ids.len()..]));
        if !interactive {
            break;
        }
    }
    crate::commands::load::report_stats(&args.model, &m);
    Ok(())
}
