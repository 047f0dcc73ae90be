//! How fast the disk under a file serves the pager's kind of reads: `O_DIRECT` reads of a few
//! MiB at random aligned offsets, several in flight (the pager reads a layer's misses on up to
//! eight threads). The planner turns it into a speed for plans that read experts from disk.
//!
//! Why `O_DIRECT`: a buffered read of a file in the page cache measures memory, not the disk,
//! and a model being planned was often just read or written. A file system that refuses it
//! (tmpfs, some overlays) gets no figure: the page cache is all there is to measure there.

use crate::open_direct;
use crate::slab::{Slab, ALIGN};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How [`measure_read_rate`] reads.
#[derive(Clone, Copy, Debug)]
pub struct ReadRateOptions {
    /// Bytes per read (rounded up to the 4 KiB alignment `O_DIRECT` needs).
    pub chunk_bytes: usize,
    /// Reads in flight (threads).
    pub threads: usize,
    /// Stop after this long...
    pub max_time: Duration,
    /// ...or after this many bytes, whichever comes first.
    pub max_bytes: u64,
}

impl Default for ReadRateOptions {
    /// 2 MiB reads (an expert matrix of a 30B-class MoE in Q4_K is ~0.9-1.2 MB, in Q8_0 ~1.7),
    /// eight in flight as the pager reads, a quarter of a second or 512 MiB.
    fn default() -> Self {
        ReadRateOptions { chunk_bytes: 2 << 20, threads: 8, max_time: Duration::from_millis(250), max_bytes: 512 << 20 }
    }
}

/// Bytes per second read from `path` with `O_DIRECT` at random aligned offsets (see the module
/// docs), or why there is no figure: the file cannot be opened for `O_DIRECT`, or is smaller
/// than four reads.
///
/// # Errors
/// A message naming the file and the reason.
pub fn measure_read_rate(path: &Path, opts: &ReadRateOptions) -> Result<f64, String> {
    let named = |why: String| format!("{}: {why}", path.display());
    let file = open_direct(path).map_err(|e| named(format!("no O_DIRECT reads ({e})")))?;
    let len = file.metadata().map_err(|e| named(e.to_string()))?.len();
    let chunk = opts.chunk_bytes.max(1).next_multiple_of(ALIGN);
    let n_chunks = len / chunk as u64;
    if n_chunks < 4 {
        return Err(named(format!("{len} bytes, fewer than four reads of {chunk}")));
    }
    let read = AtomicU64::new(0);
    let failure = std::sync::Mutex::new(None);
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..opts.threads.max(1) {
            let (file, read, failure) = (&file, &read, &failure);
            s.spawn(move || {
                let buf = match Slab::new(chunk) {
                    Ok(b) => b,
                    Err(e) => {
                        note(failure, e.to_string());
                        return;
                    }
                };
                // SAFETY: this thread's slab, seen by no one else.
                let bytes = unsafe { buf.bytes_mut(0, chunk) };
                // A different pseudo-random walk per thread (xorshift), so reads do not line up
                // into a sequential stream the device would prefetch.
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                while start.elapsed() < opts.max_time && read.load(Ordering::Relaxed) < opts.max_bytes {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let at = (x % n_chunks) * chunk as u64;
                    match file.read_at(bytes, at) {
                        Ok(n) => {
                            read.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        Err(e) => {
                            note(failure, e.to_string());
                            return;
                        }
                    }
                }
            });
        }
    });
    let secs = start.elapsed().as_secs_f64();
    if let Some(e) = failure.into_inner().ok().flatten() {
        return Err(named(format!("a read failed: {e}")));
    }
    let bytes = read.into_inner();
    if bytes == 0 || secs <= 0.0 {
        return Err(named("nothing was read".into()));
    }
    Ok(bytes as f64 / secs)
}

/// Keeps the first failure of any thread.
fn note(failure: &std::sync::Mutex<Option<String>>, e: String) {
    if let Ok(mut f) = failure.lock() {
        f.get_or_insert(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a file system that takes `O_DIRECT` (the pager's own check), the rate is a positive
    /// figure from whole reads; where it is refused, the error says so. A file of fewer than
    /// four reads is refused with its size.
    #[test]
    fn measures_where_o_direct_works_and_says_why_not_elsewhere() {
        let dir = std::env::temp_dir().join(format!("df-read-rate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("data");
        std::fs::write(&path, vec![7u8; 8 << 20]).unwrap();
        let opts = ReadRateOptions {
            chunk_bytes: 1 << 20,
            threads: 2,
            max_time: Duration::from_millis(50),
            max_bytes: 64 << 20,
        };
        let got = measure_read_rate(&path, &opts);
        match open_direct(&path) {
            Ok(_) => {
                let rate = got.expect("O_DIRECT works here, so the rate is measured");
                assert!(rate.is_finite() && rate > 0.0, "{rate}");
            }
            Err(_) => assert!(got.as_ref().is_err_and(|e| e.contains("O_DIRECT")), "{got:?}"),
        }
        let small = ReadRateOptions { chunk_bytes: 4 << 20, ..opts };
        if open_direct(&path).is_ok() {
            let err = measure_read_rate(&path, &small).unwrap_err();
            assert!(err.contains("8388608 bytes, fewer than four reads of 4194304"), "{err}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
