//! A model step on the thread pool with the other workers kept polling for work until it ends.
//!
//! Why: rayon parks a worker that found nothing to do after a few dozen `sched_yield`s, and a
//! decode step has about a hundred parallel regions (four products and an attention per layer)
//! separated by short serial stretches (norms, activation quantization, the last share of a
//! region). On the dev box, a 2-vCPU Firecracker VM, `diskformer bench` of synth 1B Q4_0
//! (`-p 16 -n 64 -t 2`) decoded at 35-36 tok/s while the box was idle and at 38.5-40 tok/s
//! while compilers kept both vCPUs busy at a lower priority, with llama.cpp, whose threads spin
//! between ops, at 31-33 both ways; a perf profile of the idle run had each worker off the CPU
//! 9-13% of the time. Our reading: on an idle VM a parked worker's vCPU halts, and waking it for
//! the next region costs far more than a wake-up on bare metal. Keeping the workers polling for
//! the length of a step is what ggml's thread pool does. (Not yet measured: this change itself
//! on an idle box; the box stayed busy while it was made. `DISKFORMER_CPU_POLL=0` switches it
//! off for that A/B.)
//!
//! How: [`run_step`] runs the step on a pool worker (as `rayon::scope` did before) and spawns one
//! poller per other worker. A poller takes jobs with [`rayon::yield_now`] (its own deque, then
//! stealing), so it runs the step's parallel tasks exactly as an awake rayon worker would, and
//! returns when the step is over. Two guards keep it from blocking anything: a poller never runs
//! on the step's own thread or inside another poller (it returns at once), and it gives up after
//! [`MAX_IDLE`] without work, so a poller that a worker picked up while waiting inside a job
//! holds that job back only while the pool has other work for it, plus at most that long (the
//! thread then parks the usual way).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a poller waits without finding work before it gives up. Decode's serial stretches
/// last microseconds to tens of microseconds; this only bounds the rare case of a poller
/// picked up by a thread that is waiting inside a job.
const MAX_IDLE: Duration = Duration::from_millis(2);

/// Empty polls between clock reads and `sched_yield`s: the yield lets another process have the
/// core on a busy machine without parking the thread.
const POLLS_PER_CHECK: u32 = 256;

thread_local! {
    /// True while this thread runs a poller (a nested one returns at once).
    static POLLING: Cell<bool> = const { Cell::new(false) };
}

/// Sets the flag when dropped, so the pollers stop even if the step panics.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// False when the environment sets `DISKFORMER_CPU_POLL=0`: then [`run_step`] lets idle workers
/// park as rayon does (for A/B runs, or a machine shared with other work where the polling
/// cores are wanted elsewhere). Read once.
fn polling_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("DISKFORMER_CPU_POLL").map_or(true, |v| v.trim() != "0"))
}

/// Runs `step` on a worker of the current rayon pool while the pool's other workers poll for its
/// parallel tasks instead of parking between them; returns `step`'s value.
///
/// With one thread, or with polling switched off (`DISKFORMER_CPU_POLL=0`), it is
/// `rayon::scope` around `step`. Called from inside a pool worker, the step runs on that
/// worker.
pub fn run_step<R: Send>(step: impl FnOnce() -> R + Send) -> R {
    let n_threads = rayon::current_num_threads();
    if n_threads < 2 || !polling_enabled() {
        return rayon::scope(|_| step());
    }
    let done = AtomicBool::new(false);
    crate::trace::mark("step begins", None);
    let out = rayon::scope(|s| {
        let driver = rayon::current_thread_index();
        let done = &done;
        for _ in 1..n_threads {
            s.spawn(move |_| poll_until(done, driver));
        }
        crate::trace::mark("pollers spawned", None);
        let _stop = StopOnDrop(done);
        step()
    });
    crate::trace::mark("pollers joined", None);
    out
}

/// Takes pool jobs until `done` is set or nothing came for [`MAX_IDLE`].
fn poll_until(done: &AtomicBool, driver: Option<usize>) {
    if rayon::current_thread_index() == driver || POLLING.with(Cell::get) {
        return;
    }
    POLLING.with(|p| p.set(true));
    let mut idle_since: Option<Instant> = None;
    let mut empty_polls = 0u32;
    while !done.load(Ordering::Acquire) {
        if let Some(rayon::Yield::Executed) = rayon::yield_now() {
            idle_since = None;
            empty_polls = 0;
            continue;
        }
        empty_polls += 1;
        if empty_polls.is_multiple_of(POLLS_PER_CHECK) {
            let now = Instant::now();
            if now.duration_since(*idle_since.get_or_insert(now)) > MAX_IDLE {
                break;
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    POLLING.with(|p| p.set(false));
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::sync::atomic::AtomicUsize;

    fn pool(n: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap()
    }

    /// Nested parallel work inside a step gives the serial result on pools of 1 to 4 threads,
    /// and steps follow one another (each one's pollers end).
    #[test]
    fn nested_parallel_work_completes() {
        for n in 1..=4 {
            let p = pool(n);
            for round in 0..20u64 {
                let got: u64 = p.install(|| {
                    run_step(|| {
                        (0..64u64)
                            .into_par_iter()
                            .map(|i| (0..2000u64).into_par_iter().map(|j| (i * j + round) % 7).sum::<u64>() + i)
                            .sum()
                    })
                });
                let want: u64 = (0..64u64).map(|i| (0..2000u64).map(|j| (i * j + round) % 7).sum::<u64>() + i).sum();
                assert_eq!(got, want, "{n} threads, round {round}");
            }
        }
    }

    /// The other workers take the step's tasks: on 2 and 3 threads, tasks that wait for each
    /// other (up to 10 s) all meet, so they ran at the same time on different threads.
    #[test]
    fn other_workers_run_tasks_of_the_step() {
        for n in 2..=3 {
            let p = pool(n);
            let arrived = AtomicUsize::new(0);
            let met = p.install(|| {
                run_step(|| {
                    (0..n).into_par_iter().all(|_| {
                        arrived.fetch_add(1, Ordering::AcqRel);
                        let t0 = Instant::now();
                        while arrived.load(Ordering::Acquire) < n {
                            if t0.elapsed() > Duration::from_secs(10) {
                                return false;
                            }
                            std::hint::spin_loop();
                        }
                        true
                    })
                })
            });
            assert!(met, "{n} threads: only {} of {n} tasks ran at once", arrived.load(Ordering::Acquire));
        }
    }

    /// A step that panics still ends its pollers, and the panic reaches the caller.
    #[test]
    fn a_panicking_step_stops_the_pollers() {
        let p = pool(3);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.install(|| run_step(|| -> u32 { panic!("step failed") }))
        }));
        assert!(result.is_err());
        // The pool is usable afterwards (pollers did not keep its workers).
        let ran = AtomicUsize::new(0);
        p.install(|| {
            run_step(|| {
                (0..100).into_par_iter().for_each(|_| {
                    ran.fetch_add(1, Ordering::Relaxed);
                })
            })
        });
        assert_eq!(ran.load(Ordering::Relaxed), 100);
    }
}
