//! Two settings in one process, alternating by decode step (`DISKFORMER_AB=NAME`): the setting
//! that `NAME` switches is on for odd steps ("B") and off for even ones ("A"), and
//! `diskformer bench` prints each arm's time per token.
//!
//! Why: on the H200 leases two processes of the same binary and settings decode 5-10% apart
//! (the twenty-first session measured 61.2 then 51.1 tok/s back to back), so changes worth a few
//! percent do not separate in alternating processes. Alternating steps inside one process puts
//! both arms on the same lease state, page cache and GPU pool, step by step.
//!
//! Names in use: `park` (a GPU step's pool workers park instead of polling, `models::arch`),
//! `map` (a huge-page copy's store lends from the file map instead, `pager`), `alloc` (the
//! experts' region allocates its buffers instead of reusing them), `signal` (the split's hand-over
//! in a dispatch of its own instead of fused into the routing kernel), `qknorm` (the per-head q
//! and k norms in two dispatches instead of one), `qkfuse` (the per-head q and k norms in a
//! dispatch of their own instead of inside the decode attention), `router` (the MoE router's
//! product in a dispatch of its own before the routing kernel instead of inside it), `submit`
//! (no short early submits at a step's start: every early submit waits for `SUBMIT_EVERY`
//! dispatches, as `DISKFORMER_SUBMIT_FIRST=0`), `attnsplit` (the decode attention over at most 64
//! keys in slices of 16 and a combine pass instead of one slice), `addnorm` (the split's wait for
//! the CPU's sum, the residual add and the next norm in three dispatches instead of one),
//! `gpufirst` (the split's share settling where the GPU's is done first in half the layers,
//! not 80%), `touch` (no look-ahead: the next layer's guessed GPU experts not read into the
//! GPU's L2 cache during the wait for the CPU's sum; the split's share is common to both arms,
//! so this A/B shows the cache's effect at one balance, not the rebalancing it allows),
//! `ffnnorm` (the FFN norm in its own dispatch before the MoE router's kernel instead of inside
//! it, with the norm's dispatch after it), `ahead` (the split's dispatcher does not read the
//! CPU's guessed experts of the next layer into its caches while it waits for the hand-over),
//! `pace` (every split call records all of its layers' pool replacements, no
//! `DISKFORMER_SPLIT_REFILLS_PER_CALL` limit), `shared` (the CPU experts' region hands out
//! rows in shares taken in turn instead of each thread's own range first,
//! `quant::set_owned_claims`), `spawned` and `pollspawn` (the experts' region and the step's
//! pollers spawned into rayon's deque), `cpuguess` (the read-ahead guesses the next layer's
//! experts on the CPU instead of taking the routing kernel's guess), `prodspawn` (the CPU's
//! one-token products spawn their region's tasks instead of broadcasting it to the step's
//! pollers), `contig` (the CPU experts' threads own one contiguous range of all the experts'
//! rows, read ahead and computed, instead of a stripe of each expert), `longidle` (the step's
//! pollers give up after 20 ms without work instead of `cpu::warm::MAX_IDLE`), `ralines` (the
//! split's read-ahead loads each line instead of prefetching it into the L2), `ranks` (the CPU
//! experts' owned rows and the read-ahead shared over every pool thread, the step's driver
//! included, instead of the threads a poller's region runs on: `cpu::warm::RegionRanks`),
//! `lastpf` (the CPU's eight-row kernels prefetch the rows after a claim's last group, another
//! thread's, as they do after every other group), `kmadd` (the AVX-512 Q4_K and Q6_K decode
//! kernels multiply each sub-block's levels and activations to i16 pairs and those by the
//! scales, instead of packing the sub-blocks' i32 sums and multiplying them by the scales once),
//! `outsidestep` (a polled step called from outside the thread pool runs its scope from there
//! instead of entering the pool first: its worker's own poller then runs nested inside the
//! step's first wait for a task).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

static STEP: AtomicU64 = AtomicU64::new(0);

/// The setting `DISKFORMER_AB` names, if any (read once).
pub fn active() -> Option<&'static str> {
    static NAME: OnceLock<Option<String>> = OnceLock::new();
    NAME.get_or_init(|| std::env::var("DISKFORMER_AB").ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty()))
        .as_deref()
}

/// Sets the step now running (the caller's decode loop counts them).
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

/// True when `DISKFORMER_AB` is `name` and the step now running is odd: the B arm.
pub fn is_b(name: &str) -> bool {
    active() == Some(name) && STEP.load(Ordering::Relaxed) % 2 == 1
}
