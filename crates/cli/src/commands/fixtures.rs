//! `diskformer fixtures`: checks every fixture architecture and variant against the references
//! and prints the table recorded in docs/FIXTURES.md.

use models::refcheck::{check, fixture_root, format_row, gguf_arch, list_cases};
use models::{LoadOptions, SUPPORTED_ARCHITECTURES};
use std::path::PathBuf;

/// Arguments of `diskformer fixtures`.
#[derive(clap::Args)]
pub struct Args {
    /// Fixture directory (default: ../shared/fixtures beside the repository, else tests/fixtures).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Only these fixture directories (e.g. `llama,qwen3_moe`).
    #[arg(long, value_delimiter = ',')]
    arch: Vec<String>,
}

/// Runs the command; fails when any supported case fails.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (root, full) = match args.dir {
        Some(d) => (d, true),
        None => fixture_root(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")),
    };
    println!("fixture set: {} ({})\n", root.display(), if full { "full" } else { "compact subset" });
    println!("| fixture | variant | compared with | max_abs | rel_l2 | greedy | verdict |");
    println!("|---|---|---|---|---|---|---|");
    let (mut failed, mut skipped) = (0, Vec::new());
    for (arch, variant) in list_cases(&root)? {
        if !args.arch.is_empty() && !args.arch.contains(&arch) {
            continue;
        }
        let ga = gguf_arch(&root, &arch)?;
        if !SUPPORTED_ARCHITECTURES.contains(&ga.as_str()) {
            if !skipped.contains(&ga) {
                skipped.push(ga);
            }
            continue;
        }
        let r = check(&root, &arch, &variant, &LoadOptions::default());
        if !r.pass {
            failed += 1;
        }
        println!("{}", format_row(&r));
    }
    if !skipped.is_empty() {
        println!("\nnot implemented yet: {}", skipped.join(", "));
    }
    if failed > 0 {
        anyhow::bail!("{failed} fixture cases failed");
    }
    Ok(())
}
