//! A timeline of the host's side of GPU work (`DISKFORMER_TRACE=FILE`): named marks with their
//! time and MoE layer, written as tab-separated lines (microseconds since the first mark,
//! thread, layer or `-`, mark) by [`write_trace`], which `diskformer bench` calls at its end;
//! FILE.start beside it holds the first mark's wall-clock time (Unix seconds) and each
//! thread number's kernel thread id.
//!
//! Why: the split miss mode's decode step is ~48 short chains of host waits, submits and CPU
//! jobs (docs/PAGING.md), and the per-phase sums of `--stats` cannot say which of them lie on
//! the critical path or what the step spends outside its layers. A mark costs a clock read and
//! a push under a lock; without the variable nothing is recorded.

use std::io::Write;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Marks kept at most (a few hundred decode steps of Qwen3-30B-A3B); later ones are dropped.
const MAX_MARKS: usize = 1 << 20;

struct Mark {
    at_ns: u64,
    thread: u64,
    layer: Option<u32>,
    what: &'static str,
}

struct Trace {
    path: std::path::PathBuf,
    start: Instant,
    /// `start` as seconds since the Unix epoch.
    start_unix_s: f64,
    /// Each marking thread's number and kernel thread id.
    threads: Mutex<Vec<(u64, i64)>>,
    marks: Mutex<Vec<Mark>>,
}

fn trace() -> Option<&'static Trace> {
    static TRACE: OnceLock<Option<Trace>> = OnceLock::new();
    TRACE
        .get_or_init(|| {
            let path = std::env::var_os("DISKFORMER_TRACE").filter(|p| !p.is_empty())?;
            let start_unix_s =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            Some(Trace {
                path: path.into(),
                start: Instant::now(),
                start_unix_s,
                threads: Mutex::new(Vec::new()),
                marks: Mutex::new(Vec::new()),
            })
        })
        .as_ref()
}

/// The kernel's id of this thread (its /proc/PID/task entry); 0 where there is none.
fn os_thread_id() -> i64 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid takes no arguments and cannot fail.
        i64::from(unsafe { libc::gettid() })
    }
    #[cfg(not(target_os = "linux"))]
    {
        0
    }
}

/// A small number per thread for the file (the order in which threads first marked).
fn thread_number() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    thread_local! {
        static NUMBER: u64 = {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Some(t) = trace() {
                t.threads.lock().unwrap_or_else(|e| e.into_inner()).push((n, os_thread_id()));
            }
            n
        };
    }
    NUMBER.with(|n| *n)
}

/// Records `what` now, for `layer` when given; nothing unless `DISKFORMER_TRACE` is set.
pub fn mark(what: &'static str, layer: Option<usize>) {
    let Some(t) = trace() else { return };
    let at_ns = t.start.elapsed().as_nanos() as u64;
    let thread = thread_number();
    let mut marks = t.marks.lock().unwrap_or_else(|e| e.into_inner());
    if marks.len() < MAX_MARKS {
        marks.push(Mark { at_ns, thread, layer: layer.map(|l| l as u32), what });
    }
}

/// Writes the marks so far to the file `DISKFORMER_TRACE` names and forgets them; `None`
/// when the variable is not set.
///
/// # Errors
/// The file cannot be written.
pub fn write_trace() -> Option<std::io::Result<std::path::PathBuf>> {
    let t = trace()?;
    let marks = std::mem::take(&mut *t.marks.lock().unwrap_or_else(|e| e.into_inner()));
    let write = || -> std::io::Result<std::path::PathBuf> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&t.path)?);
        writeln!(f, "us\tthread\tlayer\tmark")?;
        for m in &marks {
            let layer = m.layer.map_or_else(|| "-".to_string(), |l| l.to_string());
            writeln!(f, "{:.1}\t{}\t{layer}\t{}", m.at_ns as f64 / 1e3, m.thread, m.what)?;
        }
        f.flush()?;
        // The first mark's wall-clock time, for lining the marks up with samplers outside the
        // process (/proc, nvidia-smi).
        let mut side = t.path.clone().into_os_string();
        side.push(".start");
        let mut start = format!("{:.6}\n", t.start_unix_s);
        for (n, tid) in t.threads.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            start.push_str(&format!("thread {n} tid {tid}\n"));
        }
        std::fs::write(side, start)?;
        Ok(t.path.clone())
    };
    Some(write())
}
