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
    quiet_vulkan_device_select();
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

/// Mesa's implicit Vulkan layer `VK_LAYER_MESA_device_select` (installed with mesa-vulkan-drivers)
/// opens a Wayland and an X11 connection to find the display's GPU and, on a headless machine,
/// prints "error: XDG_RUNTIME_DIR is invalid or not set in the environment." several times on
/// every run that looks for a GPU. We list and choose adapters ourselves (`probe`, `--gpu`), so
/// the layer has nothing to do for us: `NODEVICE_SELECT=1` turns it into a pass-through, unless
/// the user set the variable.
fn quiet_vulkan_device_select() {
    if std::env::var_os("NODEVICE_SELECT").is_none() {
        // Safe: called first thing in `main`, before any thread exists that could read the
        // environment concurrently (set_var is only racy against other threads' getenv).
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_args(argv: &[&str]) -> Result<commands::plan::Args, clap::Error> {
        let mut all = vec!["diskformer", "plan"];
        all.extend_from_slice(argv);
        match Cli::try_parse_from(all)?.command {
            Command::Plan(a) => Ok(a),
            _ => unreachable!("parsed the plan subcommand"),
        }
    }

    /// `plan` (and `describe`, which shares the argument) takes the model first or with `-m`,
    /// as `run` and `bench` do, and its GPU budget as `--gpu-budget` (or `--budget`); no model
    /// or two models are errors.
    #[test]
    fn plan_takes_the_model_either_way_and_the_gpu_budget_by_its_run_name() {
        for argv in [&["m.gguf"][..], &["-m", "m.gguf"], &["--model", "m.gguf"]] {
            assert_eq!(plan_args(argv).unwrap().model.name(), "m.gguf", "{argv:?}");
        }
        for flag in ["--gpu-budget", "--budget"] {
            let a = plan_args(&["m.gguf", flag, "4G"]).unwrap();
            assert_eq!(a.budgets.budget, Some(4 << 30), "{flag}");
        }
        assert!(plan_args(&[]).is_err());
        assert!(plan_args(&["a.gguf", "-m", "b.gguf"]).is_err());
        let describe = Cli::try_parse_from(["diskformer", "describe", "-m", "m.gguf"]).unwrap();
        assert!(matches!(describe.command, Command::Describe(ref a) if a.model.name() == "m.gguf"));
    }
}
