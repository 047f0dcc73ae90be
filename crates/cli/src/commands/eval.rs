//! `diskformer eval`: logits and greedy ids for given token ids, as the fixtures' llama.cpp
//! references were made (one batch for the prompt, then one token at a time).

use crate::commands::load::{load, ModelArgs};
use compute::quant::MatmulMode;
use models::refcheck::greedy;
use models::Outputs;

/// Arguments of `diskformer eval`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt token ids, comma separated (`1,2,3`).
    #[arg(long, value_delimiter = ',', required = true)]
    ids: Vec<u32>,
    /// Greedy ids to generate after the prompt.
    #[arg(long, default_value_t = 16)]
    n_gen: usize,
    /// Print `{"last_logits": [...], "greedy": [...]}`.
    #[arg(long)]
    json: bool,
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    let mut m = load(&args.model, MatmulMode::Exact, false)?;
    let n_vocab = m.runner.hparams().n_vocab;
    if let Some(bad) = args.ids.iter().find(|&&id| id as usize >= n_vocab) {
        anyhow::bail!("token id {bad} is outside the vocabulary of {n_vocab}");
    }
    let logits = m.runner.eval(&args.ids, Outputs::Last)?;
    let last = &logits[logits.len() - n_vocab..];
    let ids = if args.n_gen > 0 { greedy(m.runner.as_mut(), &args.ids, args.n_gen)? } else { Vec::new() };
    if args.json {
        let out = serde_json::json!({ "last_logits": last, "greedy": ids });
        println!("{out}");
    } else {
        let top = models::sampling::argmax(last);
        println!("top token {top} (logit {:.4}); greedy: {:?}", last[top as usize], ids);
    }
    crate::commands::load::report_stats(&args.model, &m);
    Ok(())
}
