//! `diskformer tokenize`.

use std::path::PathBuf;

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

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    let _ = (&args.model, args.json, args.no_add_special, args.no_parse_special, &args.text);
    anyhow::bail!("tokenize is not wired yet")
}
