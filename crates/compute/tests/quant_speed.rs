//! Decode matmul speed against this machine's streaming read, in one process (run on demand):
//! `cargo test --release -p compute --test quant_speed -- --ignored --nocapture`
//! with `QUANT_SPEED=TYPE:N_OUT:K[,...]` (default: Llama-1B-shaped Q4_0, Q4_K and Q8_0
//! matrices of about 256 MiB, larger than any cache).
//!
//! Each round times a plain AVX2 read of the weight bytes and one-token `matmul_quantized`
//! over them, alternating, and keeps each one's best round. Time is this thread's CPU time
//! (`CLOCK_THREAD_CPUTIME_ID`), not wall time, so other processes on a busy machine
//! slow neither side by being scheduled in between; they still share caches and memory. The
//! figure to read is the ratio: how close the kernel comes to reading the weights once.
//!
//! `prefill_matmul_speed` times many-token products the same way (multiply-adds per second of
//! CPU time on one thread).

use compute::quant::{self, GgmlType, Kernel};

mod quant_common;
use quant_common::{random_rows, Rng};

fn parse_type(name: &str) -> GgmlType {
    gguf::ALL_TYPES.into_iter().find(|t| t.name() == name).unwrap_or_else(|| panic!("unknown type {name}"))
}

/// This thread's CPU time in nanoseconds (`CLOCK_THREAD_CPUTIME_ID`). Not schedstat's run time:
/// some VMs update that only at scheduler ticks (every 4 ms on the twenty-fourth session's
/// EPYC VM), which rounded every kernel's time to whole ticks.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration, and
    // CLOCK_THREAD_CPUTIME_ID is a clock every Linux kernel since 2.6.12 has.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Reads every byte of `w` once (32 bytes per load), so the optimiser cannot drop the loop.
fn stream_read(w: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        return unsafe { stream_read_avx2(w) };
    }
    w.chunks(8).map(|c| c.iter().fold(0u64, |a, &b| a.rotate_left(1) ^ b as u64)).fold(0, |a, b| a ^ b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_read_avx2(w: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    let chunks = w.len() / 128;
    for c in 0..chunks {
        for (j, a) in acc.iter_mut().enumerate() {
            let v = _mm256_loadu_si256(w.as_ptr().add(128 * c + 32 * j) as *const __m256i);
            *a = _mm256_xor_si256(*a, v);
        }
    }
    let x = _mm256_xor_si256(_mm256_xor_si256(acc[0], acc[1]), _mm256_xor_si256(acc[2], acc[3]));
    let mut lanes = [0u64; 4];
    _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, x);
    lanes.iter().fold(0, |a, b| a ^ b)
}

/// This machine's read bandwidth with several threads (run on demand): `READ_BW_THREADS`
/// threads (default 2) each read their share of a `READ_BW_MIB` buffer (default 1024, far
/// larger than any cache) once per round, started together; the best round's wall time, as
/// GB/s. Decode reads every weight once per token, so its weight bytes per second can be set
/// against this figure. The memory bandwidth of a shared (virtual) machine varies with its
/// neighbours: compare figures taken a few seconds apart, alternating.
#[test]
#[ignore = "speed measurement: run with --release --ignored"]
fn read_bandwidth_threads() {
    let env = |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let (n_threads, mib, rounds) = (env("READ_BW_THREADS", 2), env("READ_BW_MIB", 1024), env("QUANT_SPEED_ROUNDS", 7));
    // Written, not only allocated: untouched pages would all read the one zero page.
    let buf: Vec<u8> =
        (0..mib << 20).map(|i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7]).collect();
    let share = buf.len().div_ceil(n_threads).next_multiple_of(128);
    let mut best = f64::MAX;
    let mut sink = 0u64;
    for _ in 0..rounds {
        let start = std::sync::Barrier::new(n_threads + 1);
        let (seconds, x) = std::thread::scope(|scope| {
            let workers: Vec<_> = buf
                .chunks(share)
                .map(|part| {
                    let start = &start;
                    scope.spawn(move || {
                        start.wait();
                        stream_read(part)
                    })
                })
                .collect();
            // Timed from before the release, which waits for every worker to be spawned: a
            // clock read after it could come after the workers had already read their shares.
            let t = std::time::Instant::now();
            start.wait();
            let x = workers.into_iter().map(|w| w.join().unwrap()).fold(0, |a, b| a ^ b);
            (t.elapsed().as_secs_f64(), x)
        });
        best = best.min(seconds);
        sink ^= x;
    }
    println!(
        "read {mib} MiB with {n_threads} threads: {:.1} GB/s (best of {rounds}, checksum {sink:x})",
        buf.len() as f64 / best / 1e9
    );
    drop(buf);
    // `READ_BW_DECODE=TYPE:N_OUT:K[,...]`: one-token products on a pool of as many threads,
    // weight bytes per second of wall time (best round), for the same comparison.
    let Ok(spec) = std::env::var("READ_BW_DECODE") else { return };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(n_threads).build().unwrap();
    let mut rng = Rng::new(11);
    for case in spec.split(',') {
        let parts: Vec<&str> = case.split(':').collect();
        let dtype = parse_type(parts[0]);
        let [n_out, k] = [1, 2].map(|i| parts[i].parse::<usize>().expect("N_OUT:K numbers"));
        let w = random_rows(dtype, n_out, k, &mut rng);
        // Copies of the matrix filling `READ_BW_COPY_MIB` (default 512), used in turn as a
        // model's layers are: each one comes from memory, not from a cache the previous round
        // left it in (a small value keeps one copy in cache instead: the kernel's own speed).
        let fill = env("READ_BW_COPY_MIB", 512) << 20;
        let copies: Vec<Vec<u8>> = (0..fill.div_ceil(w.len()).max(1)).map(|_| w.clone()).collect();
        let x: Vec<f32> = (0..k).map(|_| rng.normal()).collect();
        let mut y = vec![0f32; n_out];
        let mut best = f64::MAX;
        pool.install(|| {
            for _ in 0..rounds {
                let t = std::time::Instant::now();
                for w in &copies {
                    quant::matmul_quantized(dtype, w, n_out, k, &x, &mut y, Kernel::best()).unwrap();
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
        });
        println!(
            "{case} decode with {n_threads} threads, {} copies in turn: {:.1} GB/s (checksum {:.3})",
            copies.len(),
            (copies.len() * w.len()) as f64 / best / 1e9,
            y.iter().map(|&v| v as f64).sum::<f64>()
        );
    }
}

#[test]
#[ignore = "speed measurement: run with --release --ignored"]
fn decode_matmul_against_streaming_read() {
    let spec =
        std::env::var("QUANT_SPEED").unwrap_or_else(|_| "Q4_0:229376:2048,Q4_K:229376:2048,Q8_0:122880:2048".into());
    let rounds: usize = std::env::var("QUANT_SPEED_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(7);
    // Everything runs on the one worker of a one-thread pool: the matmul's parallel loop then
    // stays on the thread whose CPU time is read.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| measure(&spec, rounds));
}

fn measure(spec: &str, rounds: usize) {
    let mut rng = Rng::new(3);
    for case in spec.split(',') {
        let parts: Vec<&str> = case.split(':').collect();
        let dtype = parse_type(parts[0]);
        let [n_out, k] = [1, 2].map(|i| parts[i].parse::<usize>().expect("N_OUT:K numbers"));
        let w = random_rows(dtype, n_out, k, &mut rng);
        let x: Vec<f32> = (0..k).map(|_| rng.normal()).collect();
        let mut y = vec![0f32; n_out];
        let (mut best_read, mut best_matmul) = (u64::MAX, u64::MAX);
        let mut sink = 0u64;
        for _ in 0..rounds {
            let t0 = thread_cpu_ns();
            sink ^= stream_read(&w);
            let t1 = thread_cpu_ns();
            quant::matmul_quantized(dtype, &w, n_out, k, &x, &mut y, Kernel::best()).unwrap();
            let t2 = thread_cpu_ns();
            best_read = best_read.min(t1 - t0);
            best_matmul = best_matmul.min(t2 - t1);
        }
        let gb = w.len() as f64 / 1e9;
        println!(
            "{case}: {:.0} MiB, read {:.2} GB/s, matmul {:.2} GB/s, matmul/read {:.2} (checksum {sink:x} {:.3})",
            w.len() as f64 / (1 << 20) as f64,
            gb / (best_read as f64 * 1e-9),
            gb / (best_matmul as f64 * 1e-9),
            best_read as f64 / best_matmul as f64,
            y.iter().map(|&v| v as f64).sum::<f64>(),
        );
    }
}

/// Decode kernels on every core at once, each thread its own small matrix (run on demand):
/// `QUANT_ALL_CORES=TYPE:N_OUT:K[,...]` (default Qwen3-30B-A3B's expert matrices in Q4_K, which
/// stay in a core's L2), `QUANT_ALL_THREADS` threads (default: every core). Each thread runs
/// one-token products on its own one-thread pool for about 0.3 s, all started together; printed
/// is the per-thread rate (weight bytes per second of its CPU time) of the slowest and fastest
/// thread, and the same thread count's rate alone first.
///
/// Why: the split's CPU job computes ~0.5 MB of experts a thread per layer on the H200's 16
/// cores at ~6 GB/s a thread even when the rows sit in the thread's own caches (thirty-fourth
/// session), where one thread alone computes such rows at three times that on other machines.
/// This tells the cores' all-core rate (clocks, shared L3) apart from the region's overheads.
#[test]
#[ignore = "speed measurement: run with --release --ignored"]
fn decode_kernels_on_every_core() {
    let spec = std::env::var("QUANT_ALL_CORES").unwrap_or_else(|_| "Q4_K:768:2048,Q4_K:2048:768".into());
    let n_threads: usize = std::env::var("QUANT_ALL_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    for case in spec.split(',') {
        let parts: Vec<&str> = case.split(':').collect();
        let dtype = parse_type(parts[0]);
        let [n_out, k] = [1, 2].map(|i| parts[i].parse::<usize>().expect("N_OUT:K numbers"));
        for threads in [1, n_threads] {
            let start = std::sync::Barrier::new(threads);
            let rates: Vec<f64> = std::thread::scope(|scope| {
                let workers: Vec<_> = (0..threads)
                    .map(|t| {
                        let start = &start;
                        scope.spawn(move || {
                            let mut rng = Rng::new(100 + t as u64);
                            let w = random_rows(dtype, n_out, k, &mut rng);
                            let x: Vec<f32> = (0..k).map(|_| rng.normal()).collect();
                            let mut y = vec![0f32; n_out];
                            let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
                            pool.install(|| {
                                let mut one = || {
                                    quant::matmul_quantized(dtype, &w, n_out, k, &x, &mut y, Kernel::best()).unwrap()
                                };
                                one();
                                start.wait();
                                let (t0, wall) = (thread_cpu_ns(), std::time::Instant::now());
                                let mut calls = 0usize;
                                while wall.elapsed().as_secs_f64() < 0.3 {
                                    for _ in 0..16 {
                                        one();
                                    }
                                    calls += 16;
                                }
                                (calls * w.len()) as f64 / (thread_cpu_ns() - t0) as f64
                            })
                        })
                    })
                    .collect();
                workers.into_iter().map(|w| w.join().unwrap()).collect()
            });
            let (lo, hi) = rates.iter().fold((f64::MAX, 0f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
            println!("{case}: {threads} threads each its own matrix: {lo:.2} .. {hi:.2} GB/s a thread");
        }
    }
}

/// Prefill (many-token) matmul speed in multiply-adds per second of this thread's CPU time, on
/// a one-thread pool (run on demand): `QUANT_PREFILL=TYPE:N_OUT:K:N_TOK[,...]` (default: the
/// layer shapes of a Llama-1B-class model in Q4_0 and Q4_K and Gemma 3 270M's in Q4_K, 128
/// tokens). The best of `QUANT_SPEED_ROUNDS` rounds is printed.
#[test]
#[ignore = "speed measurement: run with --release --ignored"]
fn prefill_matmul_speed() {
    let spec = std::env::var("QUANT_PREFILL").unwrap_or_else(|_| {
        "Q4_0:2048:2048:128,Q4_0:8192:2048:128,Q4_0:2048:8192:128,Q4_K:8192:2048:128,Q4_K:2048:640:128".into()
    });
    let rounds: usize = std::env::var("QUANT_SPEED_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| {
        let mut rng = Rng::new(5);
        for case in spec.split(',') {
            let parts: Vec<&str> = case.split(':').collect();
            let dtype = parse_type(parts[0]);
            let [n_out, k, n_tok] = [1, 2, 3].map(|i| parts[i].parse::<usize>().expect("N_OUT:K:N_TOK numbers"));
            let w = random_rows(dtype, n_out, k, &mut rng);
            let x: Vec<f32> = (0..n_tok * k).map(|_| rng.normal()).collect();
            let mut y = vec![0f32; n_tok * n_out];
            // Calls per timing: about 0.2 s of work, well above the scheduler tick at which
            // the CPU time advances.
            let t = std::time::Instant::now();
            quant::matmul_quantized(dtype, &w, n_out, k, &x, &mut y, Kernel::best()).unwrap();
            let calls = (0.2 / t.elapsed().as_secs_f64().max(1e-6)).ceil() as usize;
            let mut best = u64::MAX;
            for _ in 0..rounds {
                let t0 = thread_cpu_ns();
                for _ in 0..calls {
                    quant::matmul_quantized(dtype, &w, n_out, k, &x, &mut y, Kernel::best()).unwrap();
                }
                best = best.min((thread_cpu_ns() - t0) / calls as u64);
            }
            let macs = (n_out * k * n_tok) as f64;
            println!(
                "{case}: {:.1} GMAC/s (checksum {:.3})",
                macs / best as f64,
                y.iter().map(|&v| v as f64).sum::<f64>()
            );
        }
    });
}
