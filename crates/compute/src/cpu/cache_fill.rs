//! Reading memory into the CPU's caches ahead of a job that will read it, on the pool's threads,
//! until told to stop.
//!
//! Why: in the GPU back end's split miss mode (`wgpu/experts/split.rs`) the CPU waits about
//! 100 us a layer for the GPU's hand-over of the next layer (the chain of its attention and
//! router), while the RAM, which the CPU's experts job is bound by, idles. The next layer's
//! experts can be guessed from this layer's input (`ExpertStore::guess_experts`); reading the
//! guessed ones the CPU will compute into its caches during the wait moves part of the job's
//! reads out of the job. The H200's host has 300 MiB of L3, room for a layer's CPU experts
//! (~13 MB of Qwen3-30B-A3B's) many times over. Measured there [`read_into_cache`] made the
//! steps no faster (twenty-fifth session: `split::Dispatcher::read_ahead` has the figures);
//! [`read_owned_into_cache`], each thread its own rows with every worker polling, made them ~5%
//! faster (thirty-fifth session), and the split calls it by default.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Bytes a thread reads between looks at the stop condition: ~1-2 us at one core's read rate,
/// so a stop is seen that soon by every thread.
const CHUNK: usize = 16 << 10;

/// The size of the cache lines read: one 8-byte load per line brings it in.
const LINE: usize = 64;

/// Reads every cache line of `pieces`, in order, on the calling thread and `threads - 1` of
/// the current rayon pool's other workers (at most), until all are read or `stop` returns true
/// (each thread looks before every 16 KiB). Returns the bytes read. Reads only: nothing is
/// written.
///
/// Why not every worker: the caller's process has other threads to run meanwhile (the GPU back
/// end's host thread records and submits the next layers while the split's dispatcher reads
/// ahead); idle pool workers poll and yield their cores to them, workers reading here do not.
pub fn read_into_cache(pieces: &[&[u8]], threads: usize, stop: &(dyn Fn() -> bool + Sync)) -> u64 {
    let chunks: Vec<&[u8]> = pieces.iter().flat_map(|p| p.chunks(CHUNK)).collect();
    if chunks.is_empty() {
        return 0;
    }
    let demote = demote_enabled();
    let next = AtomicUsize::new(0);
    let read = AtomicU64::new(0);
    let work = || {
        let mut sum = 0u64;
        let mut bytes = 0u64;
        loop {
            if stop() {
                break;
            }
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(chunk) = chunks.get(i) else { break };
            for line in chunk.chunks(LINE) {
                let mut word = [0u8; 8];
                let n = line.len().min(8);
                word[..n].copy_from_slice(&line[..n]);
                sum = sum.wrapping_add(u64::from_ne_bytes(word));
                if demote {
                    demote_line(line.as_ptr());
                }
            }
            bytes += chunk.len() as u64;
        }
        // The loads must happen: their values go somewhere the compiler cannot see through.
        std::hint::black_box(sum);
        read.fetch_add(bytes, Ordering::Relaxed);
    };
    let helpers = rayon::current_num_threads().min(threads).saturating_sub(1).min(chunks.len() - 1);
    rayon::scope(|s| {
        for _ in 0..helpers {
            s.spawn(|_| work());
        }
        work();
    });
    read.into_inner()
}

/// Reads each thread's own rows of `experts` (`n_ff` hidden rows each) into that thread's
/// caches, on every worker of the running polled step that is free now
/// ([`super::warm::broadcast`]), until all are read or `stop` returns true: the rows
/// [`crate::quant::owned_bytes`] names, the ones the thread computes first in the experts'
/// region that follows ([`crate::quant::experts_one_token`]). Returns the bytes read, or `None`
/// (nothing read) outside a polled step.
///
/// Why owned rows: [`read_into_cache`] spread the lines over whichever threads came, so the
/// job found most of them in another core's L2, slower than RAM on the H200's host (twenty-fifth
/// session). Why a broadcast: every poller reads at once, none has to be woken or stolen into.
pub fn read_owned_into_cache(
    experts: &[crate::quant::ExpertRows<'_>],
    n_ff: usize,
    stop: &(dyn Fn() -> bool + Sync),
) -> Option<u64> {
    let ranks = super::warm::RegionRanks::for_region();
    let n_threads = ranks.count();
    let read = AtomicU64::new(0);
    let body = || {
        let me = ranks.current();
        let mut sum = 0u64;
        let mut bytes = 0u64;
        let order = touch_order();
        'pieces: for piece in crate::quant::owned_bytes(experts, n_ff, me, n_threads) {
            for chunk in piece.chunks(CHUNK) {
                if stop() {
                    break 'pieces;
                }
                sum = sum.wrapping_add(touch(chunk, order));
                bytes += chunk.len() as u64;
            }
        }
        std::hint::black_box(sum);
        read.fetch_add(bytes, Ordering::Relaxed);
        READ_AHEAD_BYTES.with(|b| b.set(bytes));
    };
    super::warm::broadcast(&body).then(|| read.into_inner())
}

thread_local! {
    /// The bytes this thread read in the last [`read_owned_into_cache`], until the experts'
    /// region takes them ([`take_read_ahead_bytes`]): its timing says how fast the rows read
    /// ahead were computed against the rest.
    static READ_AHEAD_BYTES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The bytes this thread read ahead since the last call, which resets them.
pub(crate) fn take_read_ahead_bytes() -> u64 {
    READ_AHEAD_BYTES.with(|b| b.replace(0))
}

/// How [`read_owned_into_cache`] reads a chunk's lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TouchOrder {
    /// A PREFETCHT1 per line (to the L2, where the job's kernels look), no loads: the default.
    Prefetch,
    /// One load per line, in address order.
    Lines,
    /// One load per line, the chunk's four 4 KiB quarters interleaved (line i of each quarter,
    /// then line i + 1): four streams at once for the L2's streamer, which stops at each 4 KiB
    /// page.
    Pages,
}

/// `DISKFORMER_READ_AHEAD_LOOP=prefetch|lines|pages` (read once; default `prefetch` on x86-64,
/// `lines` elsewhere), or on B steps of the A/B name `ralines` one load per line.
///
/// Why PREFETCHT1: a load per line keeps at most the core's ~16 line fill buffers of misses in
/// flight, and the loop issues the next only as they retire. On the H200's host (thirty-ninth
/// session, uniform decode, 15 threads reading during the ~90 us waits) the read-ahead issued
/// 338-361 MiB a step at 94-103 GB/s with loads, 473-490 MiB at 141-147 GB/s with PREFETCHT1
/// (those figures count lines asked for, not lines arrived: above the RAM's ~134 GB/s),
/// 409-414 with PREFETCHT0, 445-450 with PREFETCHT2; interleaved pages read 458-493 with
/// PREFETCHT1 and no more than in order with loads. Steps with PREFETCHT1 against loads in one
/// process (`ab-steps.sh`): B/A 1.0154, 1.0190, then 1.0192, 1.0134, 1.0030 (control 1.0141,
/// 0.9995, 1.0181), then 1.0236, 1.0006, 0.9867 (control 0.9984, 0.9881, 0.9928): about 1%
/// faster, near the noise.
fn touch_order() -> TouchOrder {
    static ORDER: std::sync::OnceLock<TouchOrder> = std::sync::OnceLock::new();
    if crate::ab::is_b("ralines") {
        return TouchOrder::Lines;
    }
    *ORDER.get_or_init(|| match std::env::var("DISKFORMER_READ_AHEAD_LOOP").as_deref().map(str::trim) {
        Ok("lines") => TouchOrder::Lines,
        Ok("pages") => TouchOrder::Pages,
        // Only x86-64 has the prefetch here (`prefetch_l2`); elsewhere a hint would read nothing.
        _ if cfg!(target_arch = "x86_64") => TouchOrder::Prefetch,
        _ => TouchOrder::Lines,
    })
}

/// Brings every line of `chunk` into this core's caches in `order`; returns a sum of bytes
/// read (zero for prefetches), for the caller to keep from the optimiser.
fn touch(chunk: &[u8], order: TouchOrder) -> u64 {
    let mut sum = 0u64;
    match order {
        TouchOrder::Prefetch => {
            for line in chunk.chunks(LINE) {
                prefetch_l2(line.as_ptr());
            }
        }
        TouchOrder::Lines => {
            for line in chunk.chunks(LINE) {
                sum = sum.wrapping_add(line[0] as u64);
            }
        }
        TouchOrder::Pages => {
            const QUARTER: usize = CHUNK / 4;
            let quarters: Vec<&[u8]> = chunk.chunks(QUARTER).collect();
            for at in (0..QUARTER).step_by(LINE) {
                for q in &quarters {
                    if let Some(&b) = q.get(at) {
                        sum = sum.wrapping_add(b as u64);
                    }
                }
            }
        }
    }
    sum
}

/// A hint to bring the line holding `p` into the L2 (PREFETCHT1); elsewhere nothing.
#[inline]
fn prefetch_l2(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT1 is a hint: it reads no architectural state and raises no fault for any
    // address (and `p` points into a live slice besides).
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::hint::black_box(p);
}

/// Whether lines read are also demoted to the shared last-level cache
/// (`DISKFORMER_READ_AHEAD_DEMOTE=1`, where the CPU has CLDEMOTE; read once).
///
/// Why it might matter: on Intel's server cores since Skylake-SP the L3 is not inclusive, so a
/// line one core reads fills that core's L2 (2 MB on the H200's host) and reaches the L3 only
/// when evicted; the job that then computes the expert spreads its rows over every core, and
/// the others find the line in a neighbour's L2 rather than in the L3 they all share.
/// CLDEMOTE (Sapphire Rapids on) pushes it to the L3 at once. Measured on the H200's host:
/// no faster either way (the read-ahead itself was not).
fn demote_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DISKFORMER_READ_AHEAD_DEMOTE").is_ok_and(|v| v.trim() == "1") && has_cldemote())
}

#[cfg(target_arch = "x86_64")]
fn has_cldemote() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 0 reports the highest leaf; CLDEMOTE is leaf 7's ECX bit 25.
    __cpuid(0).eax >= 7 && __cpuid_count(7, 0).ecx & (1 << 25) != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn has_cldemote() -> bool {
    false
}

/// CLDEMOTE of the line at `p`.
#[cfg(target_arch = "x86_64")]
#[inline]
fn demote_line(p: *const u8) {
    // SAFETY: CLDEMOTE (0F 1C /0, written as bytes for assemblers that lack the mnemonic) is a
    // hint: it moves the line holding `p`, if cached, toward the last-level cache; it reads and
    // writes no memory, raises no fault, and is a reserved NOP on CPUs without it. `p` points
    // into a live slice; RAX holds it only for the instruction.
    unsafe {
        std::arch::asm!(".byte 0x0f, 0x1c, 0x00", in("rax") p, options(nostack, preserves_flags, readonly));
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn demote_line(_p: *const u8) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// In a polled step the threads that join read, between them, no more than the experts'
    /// bytes, each thread only its own rows (so two threads never read one byte: the total is
    /// at most the whole); outside a step nothing is read.
    #[test]
    fn owned_rows_read_in_a_step_only() {
        use crate::quant::{ExpertRows, GgmlType, WeightRows};
        // Q4_K rows of 256 values: 144 bytes. Two experts of 64 hidden rows, k = 256.
        fn w(bytes: &[u8], n_out: usize) -> WeightRows<'_> {
            WeightRows { dtype: GgmlType::Q4_K, bytes, n_out }
        }
        let (gate, up, down) = (vec![1u8; 64 * 144], vec![2u8; 64 * 144], vec![3u8; 256 * 144]);
        let experts = [ExpertRows { gate: Some(w(&gate, 64)), up: w(&up, 64), down: w(&down, 256) }; 2];
        let whole = 2 * (gate.len() + up.len() + down.len()) as u64;
        assert_eq!(read_owned_into_cache(&experts, 64, &|| false), None);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let got = pool.install(|| crate::cpu::warm::run_step(|| read_owned_into_cache(&experts, 64, &|| false)));
        let got = got.expect("a polled step broadcasts");
        assert!(got > 0 && got <= whole, "read {got} of {whole} bytes");
        let stopped = pool.install(|| crate::cpu::warm::run_step(|| read_owned_into_cache(&experts, 64, &|| true)));
        assert_eq!(stopped, Some(0));
        // Each thread keeps what it read for the experts' region to take, once: the driver
        // (the publisher here, so one of the 3 ranked threads) its own rows.
        let (mine, again, own) = pool.install(|| {
            crate::cpu::warm::run_step(|| {
                read_owned_into_cache(&experts, 64, &|| false);
                let ranks = crate::cpu::warm::RegionRanks::here();
                assert_eq!(ranks.count(), 3);
                let own: usize =
                    crate::quant::owned_bytes(&experts, 64, ranks.current(), 3).iter().map(|p| p.len()).sum();
                (take_read_ahead_bytes(), take_read_ahead_bytes(), own as u64)
            })
        });
        assert!(own > 0);
        assert_eq!((mine, again), (own, 0));
    }

    #[test]
    fn reads_every_byte_of_every_piece_when_not_stopped() {
        let a = vec![1u8; 100_000];
        let b = vec![2u8; 3];
        assert_eq!(read_into_cache(&[&a, &[], &b], 4, &|| false), 100_003);
        assert_eq!(read_into_cache(&[], 4, &|| false), 0);
    }

    /// The demote's bytes run on this CPU (a hint, or a reserved NOP where it has none) and
    /// change nothing.
    #[test]
    fn demoting_a_line_leaves_its_bytes() {
        let a: Vec<u8> = (0..4 * LINE).map(|i| i as u8).collect();
        for line in a.chunks(LINE) {
            demote_line(line.as_ptr());
        }
        assert!(a.iter().enumerate().all(|(i, &v)| v == i as u8));
    }

    #[test]
    fn reads_nothing_once_stopped_and_stops_partway() {
        let a = vec![0u8; 64 * CHUNK];
        assert_eq!(read_into_cache(&[&a], 4, &|| true), 0);
        // Stopped after the fourth look: at most the chunks taken by then (one per thread's
        // look before the stop) are read, never all of them.
        let looks = AtomicUsize::new(0);
        let stopped = AtomicBool::new(false);
        let stop = || {
            if looks.fetch_add(1, Ordering::Relaxed) >= 4 {
                stopped.store(true, Ordering::Relaxed);
            }
            stopped.load(Ordering::Relaxed)
        };
        let read = read_into_cache(&[&a], 4, &stop);
        assert!(read <= 4 * CHUNK as u64, "{read} bytes read after the stop");
        assert_eq!(read % CHUNK as u64, 0);
    }
}
