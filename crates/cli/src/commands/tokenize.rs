//! `diskformer tokenize`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;

/// Arguments of `diskformer tokenize`.
#[derive(clap::Args)]
pub struct Args {
    /// The GGUF model whose vocabulary to use.
    #[arg(short, long)]
    model: PathBuf,
    /// Print `{"ids": [...]}` instead of one id per line.
    #[arg(long)]
    json: bool,
    /// Do not add BOS/EOS even where the model asks for them.
    #[arg(long)]
    no_add_special: bool,
    /// Treat special-token text (`<|im_start|>`) as plain text.
    #[arg(long)]
    no_parse_special: bool,
    /// The text to tokenize.
    text: String,
}

/// Runs the command: the ids llama-tokenize prints for the same flags.
pub fn run(args: Args) -> anyhow::Result<()> {
    let model = gguf::GgufModel::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?;
    let tokenizer = tokenizer::Tokenizer::from_gguf(model.metadata())
        .with_context(|| format!("reading the tokenizer of {}", args.model.display()))?;
    let ids = tokenizer.encode(&args.text, !args.no_add_special, !args.no_parse_special)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::json!({ "ids": ids }))?;
    } else {
        for id in ids {
            writeln!(out, "{id}")?;
        }
    }
    Ok(())
}
