//! Pool threads pinned to cores: by default when the pool has one thread per core the process
//! may use; `DISKFORMER_PIN_THREADS=1` always, `=0` never.
//!
//! Why: the split's read-ahead reads each pool thread's own rows of the next layer's experts
//! into that thread's caches, and the job computes them on the same thread a few tens of
//! microseconds later; the OS may move a thread to another core in between (16 spinning
//! workers on 16 cores and the process's other threads), leaving the rows in the first core's
//! L2. Pinning worker `i` to the `i`-th core rules that out. Measured on the H200's host
//! (thirty-ninth session, uniform decode at 4G, alternating processes, unpinned then pinned,
//! tok/s): 74.4 -> 79.1, 73.4 -> 72.8, 73.9 -> 76.2, 59.1 -> 69.4, 67.0 -> 70.0. Only where the
//! pool covers every core: a smaller pool pinned to the first cores would crowd them while
//! others idle.

/// Whether a pool of `n_threads` should be pinned: `DISKFORMER_PIN_THREADS=1` yes, `=0` no,
/// otherwise when `n_threads` (more than one) equals the number of cores this process may run on.
pub fn wanted(n_threads: usize) -> bool {
    match std::env::var("DISKFORMER_PIN_THREADS").as_deref().map(str::trim) {
        Ok("1") => true,
        Ok("0") => false,
        _ => n_threads > 1 && allowed_cpus().len() == n_threads,
    }
}

/// The CPUs this process may run on (empty where that cannot be asked).
fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `set` is a plain bit set the call only writes; pid 0 is the calling thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Vec::new();
            }
            (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
        }
    }
    #[cfg(not(target_os = "linux"))]
    Vec::new()
}

/// How many threads [`pin_current_thread`] has pinned in this process (for `--stats`).
pub fn pinned_threads() -> usize {
    PINNED.load(std::sync::atomic::Ordering::Relaxed)
}

static PINNED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Pins the calling thread to the `index`-th CPU (modulo their count) of the set the process may
/// run on. Returns whether it did; a failure (not Linux, a call refused) leaves the thread as it
/// was.
pub fn pin_current_thread(index: usize) -> bool {
    let allowed = allowed_cpus();
    if allowed.is_empty() {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        let cpu = allowed[index % allowed.len()];
        // SAFETY: `one` is a plain bit set the calls only write and read in place; pid 0 is
        // the calling thread.
        unsafe {
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            let pinned = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) == 0;
            if pinned {
                PINNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            pinned
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = index;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On Linux a thread pinned by index runs on exactly one of the CPUs it was allowed, the
    /// index taken modulo their count.
    #[test]
    fn a_pinned_thread_runs_on_one_allowed_cpu() {
        let allowed = allowed_cpus();
        if !cfg!(target_os = "linux") || allowed.is_empty() {
            return;
        }
        let index = allowed.len() + 1;
        let (pinned, after) = std::thread::spawn(move || (pin_current_thread(index), allowed_cpus())).join().unwrap();
        if !pinned {
            // A sandbox may refuse the call; the pool then runs unpinned, as before.
            println!("sched_setaffinity refused here: nothing to check");
            assert_eq!(after, allowed, "a refused pin left the thread's CPUs as they were");
            return;
        }
        assert_eq!(after, vec![allowed[index % allowed.len()]]);
    }
}
