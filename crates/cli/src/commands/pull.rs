//! `diskformer pull`.

use indicatif::{ProgressBar, ProgressStyle};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

/// Arguments of `diskformer pull`.
#[derive(clap::Args)]
pub struct Args {
    /// The repo on the hub: OWNER/NAME, or OWNER/NAME:QUANT.
    repo: String,
    /// A file of the repo (a name ending in .gguf, or with a '/') or a quant name (Q4_K_M).
    /// A split part brings its whole set. Default: the repo's only GGUF, else its Q4_K_M.
    file_or_quant: Option<String>,
    /// Branch, tag or commit to pull from.
    #[arg(long, default_value = "main")]
    revision: String,
    /// The store folder (default: $DISKFORMER_STORE, else $XDG_CACHE_HOME/diskformer or
    /// ~/.cache/diskformer). The hub is $HF_ENDPOINT (default https://huggingface.co); a
    /// token comes from $HF_TOKEN or the huggingface-cli login file.
    #[arg(long, env = "DISKFORMER_STORE")]
    store: Option<PathBuf>,
    /// Ranged requests in flight at once for one file.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    connections: u32,
    /// Chunk size in KiB: the unit of each request and of resume after a kill.
    #[arg(long, default_value_t = 32 * 1024, value_parser = clap::value_parser!(u64).range(1..))]
    chunk_kib: u64,
    /// Attempts per chunk (without progress) before giving up; the partial is kept.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..))]
    attempts: u32,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    let store = match &args.store {
        Some(d) => store::Store::open(d),
        None => store::Store::open_default()?,
    };
    let hub = store::Hub::from_env()?;
    let req = store::PullRequest {
        repo: args.repo.clone(),
        want: store::Want::parse(args.file_or_quant.as_deref()),
        revision: args.revision.clone(),
    };
    let opts = store::DownloadOptions {
        connections: args.connections as usize,
        chunk_bytes: args.chunk_kib * 1024,
        max_attempts: args.attempts,
        retry_backoff: Duration::from_secs(1),
    };
    let bars = Bars { quiet: args.quiet, current: Mutex::new(None) };
    let out = store.pull(&hub, &req, &opts, &bars)?;
    println!(
        "{}: {} file{}, {} ({} downloaded, {} already there)\n{}",
        out.name,
        out.files.len(),
        if out.files.len() == 1 { "" } else { "s" },
        human_bytes(out.size_bytes),
        out.n_downloaded,
        out.files.len() - out.n_downloaded,
        out.files[0].display()
    );
    Ok(())
}

/// A progress bar per file: bytes, speed, time left. Hidden when stderr is not a terminal;
/// notes (retries, damaged chunks) are printed either way.
struct Bars {
    quiet: bool,
    current: Mutex<Option<ProgressBar>>,
}

impl Bars {
    fn note(&self, msg: &str) {
        match &*self.current.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(pb) if !pb.is_hidden() => pb.println(msg),
            _ => eprintln!("{msg}"),
        }
    }
}

impl store::PullObserver for Bars {
    fn file_started(&self, repo_path: &str, size_bytes: u64, resumed_bytes: u64) {
        if resumed_bytes > 0 {
            eprintln!(
                "{repo_path}: resuming, {} of {} already fetched (re-verifying them)",
                human_bytes(resumed_bytes),
                human_bytes(size_bytes)
            );
        }
        if self.quiet {
            return;
        }
        let pb = ProgressBar::new(size_bytes).with_message(repo_path.to_string());
        pb.set_style(
            ProgressStyle::with_template(
                "{msg:.bold} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        pb.set_position(resumed_bytes);
        pb.reset_eta();
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(pb);
    }

    fn bytes_downloaded(&self, n_bytes: u64) -> ControlFlow<()> {
        if let Some(pb) = &*self.current.lock().unwrap_or_else(|p| p.into_inner()) {
            pb.inc(n_bytes);
        }
        ControlFlow::Continue(())
    }

    fn chunk_corrupted(&self, repo_path: &str, chunk_index: usize, offset: u64, len: u64) {
        self.note(&format!(
            "{repo_path}: chunk {chunk_index} (bytes {offset}..{}) of the partial file reads back wrong; fetching it again",
            offset + len
        ));
    }

    fn retrying(&self, repo_path: &str, attempt: u32, reason: &str, wait: Duration) {
        self.note(&format!("{repo_path}: {reason}; retry {attempt} in {:.1} s", wait.as_secs_f64()));
    }

    fn file_finished(&self, repo_path: &str, downloaded: bool) {
        if let Some(pb) = self.current.lock().unwrap_or_else(|p| p.into_inner()).take() {
            pb.finish_and_clear();
        }
        if downloaded {
            eprintln!("{repo_path}: verified");
        } else {
            eprintln!("{repo_path}: already in the store, verified");
        }
    }
}

/// `1.5 GiB`, `300 MiB`, `12 KiB`, `42 B`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
