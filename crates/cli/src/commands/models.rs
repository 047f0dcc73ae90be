//! `diskformer models list | rm | add`.

use super::pull::human_bytes;
use std::path::PathBuf;

/// Arguments of `diskformer models`.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: ModelsCommand,
    /// The store folder (default: $DISKFORMER_STORE, else $XDG_CACHE_HOME/diskformer or
    /// ~/.cache/diskformer).
    #[arg(long, env = "DISKFORMER_STORE", global = true)]
    store: Option<PathBuf>,
}

#[derive(clap::Subcommand)]
enum ModelsCommand {
    /// List the models in the store: name, architecture, quant, size, files.
    List {
        /// Print JSON: {"models": [...], "problems": [...]}.
        #[arg(long)]
        json: bool,
    },
    /// Remove a model and the files only it uses.
    Rm {
        /// Its store name (as `models list` shows it).
        name: String,
    },
    /// Add a local GGUF file (any part of a split set brings the whole set).
    Add {
        /// The file.
        file: PathBuf,
        /// The store name (default: the file's stem).
        #[arg(long)]
        name: Option<String>,
        /// Copy the file into the store instead of referring to it where it is.
        #[arg(long)]
        copy: bool,
    },
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    let store = match &args.store {
        Some(d) => store::Store::open(d),
        None => store::Store::open_default()?,
    };
    match args.command {
        ModelsCommand::List { json } => list(&store, json),
        ModelsCommand::Rm { name } => {
            let r = store.remove(&name)?;
            println!("removed {}: {} file(s), {} freed", r.name, r.deleted.len(), human_bytes(r.freed_bytes));
            Ok(())
        }
        ModelsCommand::Add { file, name, copy } => {
            let mode = if copy { store::AddMode::Copy } else { store::AddMode::Reference };
            let m = store.add_local(&file, name.as_deref(), mode)?;
            println!(
                "added {}: {} file(s), {}{}",
                m.name,
                m.files.len(),
                human_bytes(m.size_bytes()),
                if copy { " (copied, verified)" } else { " (referenced in place)" }
            );
            Ok(())
        }
    }
}

fn list(store: &store::Store, json: bool) -> anyhow::Result<()> {
    let listing = store.list();
    if json {
        let problems: Vec<serde_json::Value> =
            listing.problems.iter().map(|(n, e)| serde_json::json!({"name": n, "error": e.to_string()})).collect();
        let out = serde_json::json!({"models": listing.models, "problems": problems});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let name_w = listing.models.iter().map(|m| m.name.len()).max().unwrap_or(4).max(4);
        println!("{:name_w$}  {:12}  {:10}  {:>10}  FILES", "NAME", "ARCH", "QUANT", "SIZE");
        for m in &listing.models {
            println!(
                "{:name_w$}  {:12}  {:10}  {:>10}  {}",
                m.name,
                m.architecture.as_deref().unwrap_or("-"),
                m.quant.as_deref().unwrap_or("-"),
                human_bytes(m.size_bytes),
                m.files.len()
            );
        }
        if listing.models.is_empty() && listing.problems.is_empty() {
            println!("(the store at {} is empty)", store.root().display());
        }
    }
    for (name, e) in &listing.problems {
        eprintln!("error: {name}: {e}");
    }
    if !listing.problems.is_empty() {
        anyhow::bail!("{} model(s) of the store could not be read (listed above)", listing.problems.len());
    }
    Ok(())
}
