//! How fast the CPU computes a decode layer's experts from RAM against from its last-level
//! cache (run on demand):
//! `cargo test --release -p compute --test cpu_experts_cache -- --ignored --nocapture`
//! with `CPU_EXPERTS=N_EXPERT_POOL:N_PER_CALL` (default `1200:3`: Qwen3-30B-A3B's expert shape
//! in Q4_K, 2.66 MB each, a pool of 3.2 GB, and three experts per call, the split miss mode's
//! CPU share at a 4 GB GPU budget). The default was `160:3` (425 MB) until the thirty-seventh
//! session, which found that the 300 MB L3 of the H200's host kept enough of such a pool that
//! its "ram" calls were partly served from the L3 (five experts 150.2 us against 162.3 with a
//! pool of 1200, and rows read ahead by their owners saved 12% against 27%).
//!
//! Why: the split miss mode's CPU idles while the GPU computes a layer's attention (~100 us on
//! the H200), and the next layer's router applied to this layer's input guesses most of the
//! experts the next layer will select (97.9% of the guesses on the synthetic Qwen3-30B-A3B).
//! Reading the CPU's guessed share into the cache in that time pays only if the products run
//! faster from the cache than from RAM. Three timings, each the best of its rounds: `ram`
//! (every call takes experts not used for a pool's worth of calls), `cache` (the same experts
//! again, just used), `touched` (experts not used for a pool's worth, read once by all threads
//! just before the call, the read timed apart).
//!
//! Measured (fifteenth session, docs/NOTES.md): on the H200's 16-core host ram 197 us
//! (40.3 GB/s), cache 164 us (48.6 GB/s), touched 183 us after a 121 us read; 8 threads 256 /
//! 223 / 253 us. The products are bound by the cores more than by RAM, so reading ahead saves
//! ~8% of a job for a read that costs more than the attention's idle time: not built.
//! Seventeenth session, the one-region experts (same host): three experts ram 125.2 us, cache
//! 109.2, touched 138.0 after a 124.7 us read; four 212.8 / 166.3 / 205.1 after 199.9. Lines
//! another core read sit in its L2 and come slower than from RAM; the split's read ahead built
//! on that (91% of its guesses right) lost 3% uniform and tied skewed: reverted (NOTES.md).
//! Thirty-fourth session, owned rows (each thread its own range of every matrix first, so a
//! read ahead lands in the caches of the thread that computes it): three experts ram 82.7 us,
//! touched 81.4 after a 67.2 us read by their owners, shares taken in turn ram 87.4; four
//! 107.2 / 104.3 / 110.6. A read ahead into the right core's caches saves ~2%: the products
//! bound a call, not the RAM. Owned rows themselves are 3-5% faster: now the default.
//! Thirty-seventh session, a pool of 1200 (really from RAM): rows read by their owners first
//! cut five experts from 162.3 to 118.9 us outside a polled step (H200 host); on the dev box,
//! inside one, 291.7 to 188.3 us on 2 threads, but only in runs where no poller gave up: one
//! that did (2 ms without work) left the step refusing broadcasts, the reads included. So the
//! polled section now reports each read's reach and the pollers that gave up, and runs the
//! spawned calls in a step of their own.

use compute::cpu::{experts_one_token, ExpertBiases};
use compute::quant::{owned_bytes, set_owned_claims, set_spawned_region, ExpertRows, GgmlType, MatmulMode, WeightRows};
use compute::spec::{Act, Glu, MoeSpec};
use compute::{HostExpert, HostMatrix};
use rayon::prelude::*;
use std::time::Instant;

mod quant_common;
use quant_common::{random_rows, Rng};

const N_EMBD: usize = 2048;
const N_FF: usize = 768;

struct Expert {
    gate: Vec<u8>,
    up: Vec<u8>,
    down: Vec<u8>,
}

impl Expert {
    fn host(&self, id: u32) -> HostExpert<'_> {
        fn m(bytes: &[u8], n_out: usize, k: usize) -> HostMatrix<'_> {
            HostMatrix { dtype: GgmlType::Q4_K, bytes, n_out, k }
        }
        HostExpert {
            id,
            gate: Some(m(&self.gate, N_FF, N_EMBD)),
            up: m(&self.up, N_FF, N_EMBD),
            down: m(&self.down, N_EMBD, N_FF),
        }
    }

    fn rows(&self) -> ExpertRows<'_> {
        fn w(bytes: &[u8], n_out: usize) -> WeightRows<'_> {
            WeightRows { dtype: GgmlType::Q4_K, bytes, n_out }
        }
        ExpertRows { gate: Some(w(&self.gate, N_FF)), up: w(&self.up, N_FF), down: w(&self.down, N_EMBD) }
    }

    /// Reads every 64-byte line once over the pool's threads (as a prefetch would).
    fn touch(&self) -> u64 {
        [&self.gate, &self.up, &self.down]
            .par_iter()
            .flat_map(|m| m.par_chunks(64 * 1024))
            .map(|chunk| chunk.iter().step_by(64).map(|&b| b as u64).sum::<u64>())
            .sum()
    }
}

/// Eight rounds of `calls` calls of `one` (which adds seconds into four sums): the best round's
/// mean of each sum, in microseconds.
fn best_of_rounds(calls: usize, mut one: impl FnMut(&mut [f64; 4])) -> [f64; 4] {
    let mut best = [f64::MAX; 4];
    for _round in 0..8 {
        let mut sums = [0f64; 4];
        for _ in 0..calls {
            one(&mut sums);
        }
        for (b, s) in best.iter_mut().zip(sums) {
            *b = b.min(1e6 * s / calls as f64);
        }
    }
    best
}

#[test]
#[ignore]
fn perf_cpu_experts_from_ram_and_cache() {
    let (pool, per_call) = std::env::var("CPU_EXPERTS")
        .ok()
        .and_then(|v| {
            let (a, b) = v.split_once(':')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((1200usize, 3usize));
    let mut rng = Rng::new(7);
    let experts: Vec<Expert> = (0..pool)
        .map(|_| Expert {
            gate: random_rows(GgmlType::Q4_K, N_FF, N_EMBD, &mut rng),
            up: random_rows(GgmlType::Q4_K, N_FF, N_EMBD, &mut rng),
            down: random_rows(GgmlType::Q4_K, N_EMBD, N_FF, &mut rng),
        })
        .collect();
    let bytes_per_expert = experts[0].gate.len() * 2 + experts[0].down.len();
    let x: Vec<f32> = (0..N_EMBD).map(|_| rng.normal()).collect();
    let spec = MoeSpec { n_expert: pool, n_ff: N_FF, glu: Glu::Plain(Act::Silu) };
    let call = |first: usize| -> f64 {
        let chosen: Vec<(HostExpert<'_>, f32)> =
            (0..per_call).map(|i| (experts[(first + i) % pool].host(i as u32), 0.5)).collect();
        let mut out = vec![0f32; N_EMBD];
        let t = Instant::now();
        experts_one_token(MatmulMode::QuantizedActivations, &x, &chosen, ExpertBiases::default(), &spec, &mut out)
            .expect("experts");
        std::hint::black_box(&out);
        t.elapsed().as_secs_f64()
    };
    let mut next = 0;
    let calls = pool / per_call;
    let [ram, cache, touched, touch] = best_of_rounds(calls, |sums| {
        sums[0] += call(next);
        sums[1] += call(next);
        next = (next + per_call) % pool;
        let t = Instant::now();
        let s: u64 = (0..per_call).map(|i| experts[(next + i) % pool].touch()).sum();
        std::hint::black_box(s);
        sums[3] += t.elapsed().as_secs_f64();
        sums[2] += call(next);
        next = (next + per_call) % pool;
    });
    // Owned rows: each pool thread computes a fixed range of each phase's rows first
    // (`set_owned_claims`), so rows it read ahead are in its own caches. Calls made from a pool
    // worker (as the split's dispatcher makes them); `owned ram` cold, `owned touched` after
    // every thread read its own rows of the call's experts (the read timed apart); beside them
    // the usual shares from RAM, also from a pool worker.
    let in_pool = |first: usize| rayon::scope(|_| call(first));
    let touch_owned = |first: usize| -> f64 {
        let rows: Vec<ExpertRows<'_>> = (0..per_call).map(|i| experts[(first + i) % pool].rows()).collect();
        let t = Instant::now();
        let s: u64 = rayon::broadcast(|ctx| {
            owned_bytes(&rows, N_FF, ctx.index(), ctx.num_threads())
                .iter()
                .map(|b| b.iter().step_by(64).map(|&v| v as u64).sum::<u64>())
                .sum::<u64>()
        })
        .iter()
        .sum();
        std::hint::black_box(s);
        t.elapsed().as_secs_f64()
    };
    let [o_ram, o_touched, o_touch, s_ram] = best_of_rounds(calls, |sums| {
        set_owned_claims(true);
        sums[0] += in_pool(next);
        next = (next + per_call) % pool;
        sums[2] += touch_owned(next);
        sums[1] += in_pool(next);
        next = (next + per_call) % pool;
        set_owned_claims(false);
        sums[3] += in_pool(next);
        next = (next + per_call) % pool;
    });
    println!(
        "from a pool worker: owned rows ram {o_ram:.1} us, touched {o_touched:.1} us after an owned touch of \
         {o_touch:.1} us; shares taken in turn ram {s_ram:.1} us"
    );
    // Where a call's time goes: one more pass from RAM, each call timed inside; then the same
    // from a pool worker while the others poll, as the split's dispatcher calls it
    // (`warm::run_step`): there no call wakes a thread or waits for one to wake it.
    compute::quant::experts_timing::enable();
    for _ in 0..pool / per_call {
        call(next);
        next = (next + per_call) % pool;
    }
    println!(
        "from the test's thread, {}",
        compute::quant::experts_timing::summary(&compute::quant::experts_timing::take())
    );
    let polled = compute::cpu::warm::run_step(|| {
        compute::quant::experts_timing::enable();
        let mut secs = 0.0;
        for _ in 0..pool / per_call {
            secs += call(next);
            next = (next + per_call) % pool;
        }
        (1e6 * secs / (pool / per_call) as f64, compute::quant::experts_timing::take())
    });
    println!(
        "from a pool worker, others polling ({:.1} us a call), {}",
        polled.0,
        compute::quant::experts_timing::summary(&polled.1)
    );
    // Inside a polled step, the region broadcast to the pollers (the default) against its
    // tasks spawned into the deque, each from RAM; and broadcast after every thread that
    // joins a broadcast read its own rows (`touched`, the read timed apart).
    // How many threads ran the last touch (a poller that comes after the publisher's own read
    // has ended misses it, and its rows stay unread).
    let touched_by = std::sync::atomic::AtomicUsize::new(0);
    let touch_broadcast = |first: usize| -> f64 {
        let rows: Vec<ExpertRows<'_>> = (0..per_call).map(|i| experts[(first + i) % pool].rows()).collect();
        // Ranked as the job that follows ranks its threads (the driver left out when a poller
        // publishes), so each thread reads the rows it then computes.
        let ranks = compute::cpu::warm::RegionRanks::for_region();
        let sink = std::sync::atomic::AtomicU64::new(0);
        let ran = std::sync::atomic::AtomicUsize::new(0);
        let t = Instant::now();
        let published = compute::cpu::warm::broadcast(&|| {
            let s: u64 = owned_bytes(&rows, N_FF, ranks.current(), ranks.count())
                .iter()
                .map(|b| b.iter().step_by(64).map(|&v| v as u64).sum::<u64>())
                .sum();
            sink.fetch_add(s, std::sync::atomic::Ordering::Relaxed);
            ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        std::hint::black_box(sink.into_inner());
        let secs = t.elapsed().as_secs_f64();
        touched_by.store(if published { ran.into_inner() } else { 0 }, std::sync::atomic::Ordering::Relaxed);
        secs
    };
    // How many threads each broadcast read reached, over all of them. The spawned calls go in
    // a step of their own: a poller gave up during them on the dev box (2 ms without finding
    // their tasks), after which the step refused every broadcast, the reads included.
    let (mut reached, mut touches) = (0usize, 0usize);
    let given_up_before = compute::cpu::warm::pollers_gave_up();
    let [b_ram, b_touched, b_touch, _] = compute::cpu::warm::run_step(|| {
        best_of_rounds(calls, |sums| {
            sums[0] += call(next);
            next = (next + per_call) % pool;
            sums[2] += touch_broadcast(next);
            reached += touched_by.load(std::sync::atomic::Ordering::Relaxed);
            touches += 1;
            sums[1] += call(next);
            next = (next + per_call) % pool;
        })
    });
    let given_up_broadcast = compute::cpu::warm::pollers_gave_up() - given_up_before;
    let [sp_ram, _, _, _] = compute::cpu::warm::run_step(|| {
        set_spawned_region(true);
        let best = best_of_rounds(calls, |sums| {
            sums[0] += call(next);
            next = (next + per_call) % pool;
        });
        set_spawned_region(false);
        best
    });
    println!(
        "in a polled step: broadcast ram {b_ram:.1} us, touched {b_touched:.1} us after a broadcast touch of \
         {b_touch:.1} us (a touch reached {:.1} of {} threads on average; pollers that gave up: {} in that step, {} \
         in the spawned calls' step); spawned ram {sp_ram:.1} us",
        reached as f64 / touches.max(1) as f64,
        rayon::current_num_threads(),
        given_up_broadcast,
        compute::cpu::warm::pollers_gave_up() - given_up_before - given_up_broadcast,
    );
    let gbs = |us: f64| (per_call * bytes_per_expert) as f64 / us / 1e3;
    println!(
        "{} threads, {per_call} experts of {:.2} MB per call (pool {pool}, {:.0} MB): ram {ram:.1} us ({:.1} GB/s), \
         cache {cache:.1} us ({:.1} GB/s), touched {touched:.1} us ({:.1} GB/s) after a touch of {touch:.1} us",
        rayon::current_num_threads(),
        bytes_per_expert as f64 / 1e6,
        (pool * bytes_per_expert) as f64 / 1e6,
        gbs(ram),
        gbs(cache),
        gbs(touched),
    );
}
