//! `diskformer`: run, inspect, plan, serve and fetch GGUF models.
//!
//! Each subcommand lives in `commands/<name>.rs` with its clap `Args` and a `run` function; this
//! file only dispatches. Errors print as one line (with their causes) and exit non-zero.

mod commands;

use clap::{Parser, Subcommand};

/// Run large language models from GGUF files, on the machine you have.
#[derive(Parser)]
#[command(name = "diskformer", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, or chat, streaming tokens as they come.
    Run(commands::run::Args),
    /// Logits at the last prompt position and greedy ids, for given token ids.
    Eval(commands::eval::Args),
    /// Check every fixture architecture against the reference logits and print the table.
    Fixtures(commands::fixtures::Args),
    /// Print the token ids of a text, as llama-tokenize does.
    Tokenize(commands::tokenize::Args),
    /// Download a GGUF model from a Hugging Face-compatible hub into the store (resumable, verified).
    Pull(commands::pull::Args),
    /// List, add or remove the models of the store.
    Models(commands::models::Args),
    /// Write a GGUF with random weights in the shape of a real model (any size, streamed).
    Synth(commands::synth::Args),
    /// Prompt-processing and generation speed, as llama-bench measures them.
    Bench(commands::bench::Args),
    /// What a model is: formats, architecture, parameters, tensor types, which back ends read it.
    Describe(commands::describe::Args),
    /// The machine: GPUs, CPU and SIMD, RAM, free disk, memory bandwidths.
    Probe(commands::probe::Args),
    /// Which back end runs a model here, within budgets, and why every other would not.
    Plan(commands::plan::Args),
    /// Serve models over OpenAI- and Anthropic-compatible HTTP APIs.
    Serve(commands::serve::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => commands::run::run(a),
        Command::Eval(a) => commands::eval::run(a),
        Command::Fixtures(a) => commands::fixtures::run(a),
        Command::Tokenize(a) => commands::tokenize::run(a),
        Command::Pull(a) => commands::pull::run(a),
        Command::Models(a) => commands::models::run(a),
        Command::Synth(a) => commands::synth::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Describe(a) => commands::describe::run(a),
        Command::Probe(a) => commands::probe::run(a),
        Command::Plan(a) => commands::plan::run(a),
        Command::Serve(a) => commands::serve::run(a),
    };
    if let Err(e) = result {
        commands::report_error(&e);
        std::process::exit(1);
    }
}
