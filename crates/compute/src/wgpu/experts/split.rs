//! The split miss mode ([`MissPolicy::Split`]): a decode layer's misses divided between the GPU,
//! which reads its share from the host tier over the link as [`MissPolicy::Host`] does, and the
//! CPU, which computes the rest from the store's copy at the same time.
//!
//! Why: under uniform routing a 4 GB pool of Qwen3-30B-A3B misses ~80% of its selections, and
//! the GPU reads misses over the link at ~35-39 GB/s of its ~50 (measured on the H200), so that
//! decode is bound by the link, while the CPU reads its own memory at a similar rate. Both at
//! once add the two rates. The price is one round trip per layer (the ids and the hidden state
//! read back), paid by a layer whose experts all hit too. The first version (twelfth session)
//! lost to `Host` on the H200: the GPU idled from the router's end until the host had read the
//! ids, decided and submitted its share. This one (fourteenth session) beat it by 10-23% under
//! uniform routing and 9-11% under skewed routing on two leases of the H200's 16-core host, and
//! lost 6% / tied on a third whose CPU ran slow (docs/PAGING.md); it is the default from 8
//! threads (`pager::placement::split_misses_by_default`: +14-23% at 8 on two leases).
//!
//! How it runs, per decode layer:
//! 1. The copies of the routing and the hidden state into the readback buffer are submitted with
//!    the layer's attention, and at once after them, in a second submit, the GPU's share: a
//!    one-workgroup kernel (`moe_split_partition.wgsl`) rewrites the ids with the CPU's pairs
//!    replaced by `SKIP`, and the per-pair kernels leave those out. The GPU starts its misses
//!    while the ids travel to the host.
//! 2. The host reads the ids back, finds the CPU's experts by the same rule ([`cpu_misses`]: the
//!    two must agree exactly, so it is integer arithmetic on the ids, the slot table both see and
//!    the share in 256ths) and starts them as a rayon job.
//! 3. The model records the next layer meanwhile; the add of the CPU's sum reads a buffer that
//!    the next submit fills first ([`Deferred`]): that submit is encoded before the host waits
//!    for the job (and no early submit cuts it while a result is pending), the waiting thread
//!    runs pool tasks, and a failed job's error comes back from the next readback.
//!    `DISKFORMER_SPLIT_SYNC=1` waits for the CPU within the layer instead (A/B);
//!    `DISKFORMER_SPLIT_HOST_PARTITION=1` partitions on the host after the readback (the first
//!    version, A/B). Ids routed on the host (past the GPU router's limits) take that path too.
//!
//! On a Vulkan GPU (not a CPU adapter; `DISKFORMER_SPLIT_MAILBOX=0` never), steps 1-3 go
//! through two host-mapped mailboxes instead ([`SplitMailboxes`], `wgpu/mailbox.rs`), and the
//! host waits for nothing: it records a kernel that writes the routing and the hidden state into
//! host memory and then a flag, the GPU's share, a marker of that share's end, and a kernel that
//! waits on the GPU for the flag the CPU writes after its sum and then adds it (submitted with
//! the next layer's attention); then it hands the layer to the [`Dispatcher`], a pool task that
//! polls the flag, decides the CPU's experts, computes them and writes the sum and its flag,
//! and goes on recording the next layer. What the dispatcher found (the ids, for the statistics
//! and the pool's replacements) comes back to the host at a later layer (`take_decided`). The
//! share moves by whether the GPU's share was done (its marker) when the CPU's was, toward the
//! GPU done first in most layers (`dispatched_gpu_first`). The pool's
//! workers poll through such a step (`Backend::step_feeds_thread_pool`), so the dispatcher and
//! the job's parallel regions are taken within microseconds rather than when a parked worker
//! wakes (see `ExpertTier::split_mailbox`).
//!
//! How the share is found (the readback path): when the CPU's sum is taken, the host polls
//! whether the GPU's queue is empty. If it is, the CPU was the longer of the two and its share shrinks, otherwise it
//! grows, by [`SHARE_STEP`]; a share that rounds to no CPU expert grows too (no join would
//! measure it). It settles where both finish together, whatever the two memories' rates and the
//! hit rate are, with no cost model to calibrate. `DISKFORMER_SPLIT_SHARE` fixes it (A/B).

use super::super::moe::{self, PairTable, SKIP};
use super::{host_expert_ffn, lock, ExpertTier, HostBiases, SlotMats, TierState, NO_SLOT};
use crate::backend::{Backend, Experts, HostExpert, Routing};
use crate::cpu::experts_one_token;
use crate::error::OpError;
use crate::spec::{MoeSpec, RouteSpec};
use crate::wgpu::mailbox::{Mailbox, Toward};
use crate::wgpu::transfer::raw_buffer;
use crate::wgpu::{le_f32s, le_u32s, trace, Deferred, JoinSeen, WgpuBackend, WgpuTensor, WgpuWeight};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The CPU's share of the misses before anything is measured.
pub(super) const SHARE_START: f64 = 0.5;

/// How much the share moves after each layer. Qwen3-30B-A3B has 48 MoE layers with ~6 misses
/// each at 4 GB: one decode step moves the share by up to ~1, so it finds its level within the
/// first steps, and a step of 0.02 is a third of one expert's worth of a layer.
pub(super) const SHARE_STEP: f64 = 0.02;

/// The CPU's share as a trace mark (marks are names, not numbers): which quarter it is in.
fn share_bucket(share: f64) -> &'static str {
    match share {
        s if s < 0.25 => "share 0-25%",
        s if s < 0.5 => "share 25-50%",
        s if s < 0.75 => "share 50-75%",
        _ => "share 75-100%",
    }
}

/// The share as the partition kernel takes it: 256ths, rounded (0.02 moves it by 5).
fn share_in_256ths(share: f64) -> u32 {
    (share.clamp(0.0, 1.0) * 256.0).round() as u32
}

/// The experts the CPU computes of a layer's routed `ids` (ascending): of the distinct experts
/// that miss, the `(n_miss * share_q + 128) / 256` with the fewest pairs, ties to the lower id.
/// `moe_split_partition.wgsl` applies the same rule on the GPU, which skips exactly these.
pub(super) fn cpu_misses(ids: &[u32], is_miss: impl Fn(u32) -> bool, share_q: u32) -> Vec<u32> {
    let mut keyed: Vec<(usize, u32)> = Vec::new();
    for (q, &e) in ids.iter().enumerate() {
        if is_miss(e) && !ids[..q].contains(&e) {
            keyed.push((ids.iter().filter(|&&f| f == e).count(), e));
        }
    }
    keyed.sort_unstable();
    let n_cpu = (keyed.len() * share_q as usize + 128) / 256;
    let mut cpu: Vec<u32> = keyed[..n_cpu].iter().map(|&(_, e)| e).collect();
    cpu.sort_unstable();
    cpu
}

/// The mailboxes' kernels: the routing and hidden state to the host, the CPU's sum back.
const MAILBOX_SIGNAL: &str = include_str!("../shaders/mailbox_signal.wgsl");
const MAILBOX_WAIT_ADD: &str = include_str!("../shaders/mailbox_wait_add.wgsl");

/// `mailbox_wait_add.wgsl`, with the residual add and the norm after it (`norm`: its `//N `
/// lines; the uniform then after the six more buffers).
pub(in crate::wgpu) fn wait_add_source(norm: bool) -> String {
    let src = MAILBOX_WAIT_ADD.replace("{{P_BINDING}}", if norm { "10" } else { "4" });
    if norm {
        src.replace("//N\n", "\n").replace("//N ", "").replace("{{Q8_BLOCK}}", crate::wgpu::shaders::Q8_BLOCK)
    } else {
        src
    }
}

/// The look-ahead's kernel: the next layer's guessed GPU experts read into the L2 cache while
/// the GPU waits for the CPU's sum.
const TOUCH: &str = include_str!("../shaders/moe_split_touch.wgsl");

/// Workgroups of [`TOUCH`]: each round reads 32 bytes per invocation, 512 KiB in all, enough
/// reads in flight to fill the link (~50 GB/s at ~2 us a round trip needs ~100 KB).
const TOUCH_GROUPS: u32 = 64;

/// A layer's router as the model routed with it ([`Backend::router_route`]), kept to guess that
/// layer's experts from the layer before's input ([`WgpuBackend::touch_next_layer`]).
pub(in crate::wgpu) struct GuessRouter {
    router: WgpuWeight,
    spec: RouteSpec,
}

/// The layer of a router weight named as GGUF names them (`blk.N.ffn_gate_inp.weight`).
fn router_layer(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.strip_suffix(".ffn_gate_inp.weight")?.parse().ok()
}

impl ExpertTier {
    /// Keeps a layer's router for the split's look-ahead the first time the model routes with
    /// it (a router the routing kernel cannot take is kept too: the guess then makes nothing).
    pub(in crate::wgpu) fn note_router(&self, router: &WgpuWeight, spec: &RouteSpec) {
        if self.opts.miss != super::MissPolicy::Split
            || !(self.split_touch || self.prefetch.is_some() || read_ahead_guess_on_gpu())
        {
            return;
        }
        let Some(layer) = router_layer(&router.name) else { return };
        let mut st = lock(&self.state);
        if st.guess_routers.len() <= layer {
            st.guess_routers.resize(layer + 1, None);
        }
        if st.guess_routers[layer].is_none() {
            st.guess_routers[layer] = Some(Arc::new(GuessRouter { router: router.clone(), spec: spec.clone() }));
        }
    }
}

/// The pipeline key of [`wait_add_source`]'s variant.
fn wait_add_key(norm: bool) -> &'static str {
    if norm {
        "mailbox_wait_add_norm"
    } else {
        "mailbox_wait_add"
    }
}

/// Calls in flight at once through the mailboxes: a slot's data is written again two calls
/// later, when the GPU has added it (the next call's flag comes after that add in queue order)
/// and the dispatcher has read it (before it ran the call's CPU job).
const MAILBOX_SLOTS: usize = 2;
/// Words of the down mailbox: the flags at 0..MAILBOX_SLOTS, the sequence number of a wait
/// that ran out of polls, whether each slot's wait had to poll, each slot's call once the GPU
/// had computed its share; the data from `MAILBOX_DATA`.
const DOWN_TIMEOUT: usize = 2;
const DOWN_WAITED: usize = 4;
const DOWN_GPU_DONE: usize = 8;
/// Each slot's guess of the next layer's experts, for the prefetch (`prefetch.rs`) or the
/// dispatcher's read-ahead ([`Dispatcher::read_ahead`]), written by the routing kernel's guess
/// variant or `moe_split_prefetch_pick.wgsl`: the call's sequence number, the count, the ids
/// (up to `GUESS_WORDS - 2`: a top k of up to 14 whole).
pub(super) const DOWN_GUESS: usize = 16;
pub(super) const GUESS_WORDS: usize = 16;
const MAILBOX_DATA: usize = 64;

/// Deferred layers' replacements (see [`WgpuBackend::settle_dispatcher`]) a split call makes
/// besides its own: two, so a step's ~13 are made by its seventh layer while each call's host
/// time (~175 us, ~80 more per replacement's layer) stays inside the ~310 us of a layer.
const DEFERRED_REFILLS_PER_CALL: usize = 2;

/// How long the host waits for the GPU's flag before it reports the GPU stuck.
const HOST_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Polls of the GPU's wait for the CPU's sum before it gives up (`DISKFORMER_SPLIT_SPIN_LIMIT`):
/// ~2^26, several seconds of polling on the H200, far past any CPU job, and a bound on a GPU
/// left waiting by a host that died.
fn split_wait_spin_limit() -> u32 {
    static LIMIT: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("DISKFORMER_SPLIT_SPIN_LIMIT").ok().and_then(|v| v.parse().ok()).unwrap_or(1 << 26)
    })
}

/// Where a dispatched layer's GPU share runs: the pool's matrices, their biases, the slot table
/// and the layer's row of it, the CPU's share in 256ths.
pub(super) struct DispatchedPlace<'a> {
    pub(super) fused: &'a moe::FusedMats<'a>,
    pub(super) gpu_biases: [Option<&'a WgpuTensor>; 3],
    pub(super) table: &'a wgpu::Buffer,
    pub(super) slots_at: u32,
    pub(super) share_q: u32,
}

/// A layer handed to the [`Dispatcher`]: its place in the mailboxes and what its CPU job needs
/// once the GPU's flag says the routing and the hidden state are there.
struct Handoff {
    seq: u32,
    slot: usize,
    data_at: usize,
    up: Arc<Mailbox>,
    down: Arc<Mailbox>,
    layer: usize,
    n: usize,
    n_embd: usize,
    k: usize,
    /// Which of the layer's experts missed the pool when its share was recorded (the table
    /// the GPU's partition reads, in queue order).
    missed: Vec<bool>,
    share_q: u32,
    adapt: bool,
    store: Arc<dyn crate::backend::ExpertStore>,
    biases: Arc<HostBiases>,
    spec: MoeSpec,
    mode: crate::quant::MatmulMode,
    shared: Arc<SplitShared>,
    failed: Arc<std::sync::Mutex<Option<OpError>>>,
    /// The prefetch (`prefetch.rs`) where the tier has one, and whether this call recorded the
    /// guess of the next layer's experts it announces from.
    prefetch: Option<Arc<super::prefetch::Prefetch>>,
    guessed: bool,
    /// Whether this call's routing kernel also wrote the next layer's guessed misses, ranked,
    /// to its slot's guess area for the read-ahead ([`WgpuBackend::guess_next_on_gpu`]).
    gpu_guess: bool,
}

/// What the dispatcher found of a layer, for the host's bookkeeping (`take_decided`).
struct Decided {
    layer: usize,
    ids: Vec<u32>,
    missed: Vec<bool>,
    n_misses: usize,
    n_cpu: usize,
}

/// The split's layers handed over through the mailboxes, and the one pool task at a time that
/// takes them in order: it polls a layer's flag, decides the CPU's experts by the rule the
/// GPU's partition applied ([`cpu_misses`]), computes them on its own worker (their parallel
/// regions on the others) and writes the sum and its flag, which the GPU's add waits for.
///
/// Why a task and not the host: the host used to poll each layer's flag itself and record the
/// next layer only after starting the CPU's job, so its own ~150-190 us of recording and
/// submitting per layer stood between the CPU's end and the next layer's attention on the H200
/// about as often as the CPU's job did. Handing the wait to a worker lets the host record ahead.
#[derive(Default)]
pub(super) struct Dispatcher {
    /// Layers not yet taken, and whether a task is taking them (one lock for both, so that a
    /// layer pushed just as the task finds the queue empty still gets a task).
    queue: std::sync::Mutex<(std::collections::VecDeque<Handoff>, bool)>,
    /// What the task found of the layers it took, oldest first, until the host takes it in.
    decided: std::sync::Mutex<Vec<Decided>>,
    /// The last decode layer's input row, which the next layer's experts are guessed from
    /// ([`Dispatcher::read_ahead`]), and its layer.
    last_input: std::sync::Mutex<Option<(usize, Vec<f32>)>>,
    /// The last decode call whose routing kernel guessed the next layer for the read-ahead:
    /// `(the layer guessed, the call's slot, its sequence number)`.
    gpu_guess: std::sync::Mutex<Option<(usize, usize, u32)>>,
    /// The last call whose hand-over the task saw: the GPU has run every command recorded
    /// before that call's hand-over (the replacements on the copy queue wait for it).
    seen: std::sync::atomic::AtomicU32,
}

impl Dispatcher {
    fn push(self: &Arc<Self>, h: Handoff) {
        let mut q = lock(&self.queue);
        q.0.push_back(h);
        if !q.1 {
            q.1 = true;
            let me = self.clone();
            rayon::spawn(move || me.run());
        }
    }

    /// Whether every layer handed over has been taken.
    fn idle(&self) -> bool {
        let q = lock(&self.queue);
        q.0.is_empty() && !q.1
    }

    fn run(&self) {
        loop {
            let h = {
                let mut q = lock(&self.queue);
                match q.0.pop_front() {
                    Some(h) => h,
                    None => {
                        q.1 = false;
                        return;
                    }
                }
            };
            self.take(h);
        }
    }

    /// One layer: its flag, the CPU's experts, the sum and its flag. Whatever fails, the GPU's
    /// add gets a flag (with zeros) so that it does not wait for its spin limit, and the error
    /// goes where the host's next split call or readback returns it.
    fn take(&self, h: Handoff) {
        let release = |h: &Handoff, e: Option<OpError>| {
            if let Some(e) = e {
                lock(&h.failed).get_or_insert(e);
            }
            h.up.write(h.data_at, &vec![0; h.n * h.n_embd]);
            h.up.store(h.slot, h.seq);
        };
        let t_poll = Instant::now();
        let guessed = if h.down.load(h.slot) != h.seq { self.read_ahead(&h, read_ahead_threads()) } else { Vec::new() };
        let mut polls = 0u32;
        while h.down.load(h.slot) != h.seq {
            std::hint::spin_loop();
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(1024) {
                if t_poll.elapsed() > HOST_WAIT {
                    let why = format!(
                        "the GPU did not hand over call {} in {HOST_WAIT:?} (its flag says {})",
                        h.seq,
                        h.down.load(h.slot)
                    );
                    release(&h, Some(OpError::Unsupported { op: "moe_ffn (split)", backend: "wgpu", why }));
                    return;
                }
                std::thread::yield_now();
            }
        }
        let seen = Instant::now();
        self.seen.store(h.seq, Ordering::Release);
        h.shared.join_wait_nanos.fetch_add((seen - t_poll).as_nanos() as u64, Ordering::Relaxed);
        trace::mark("ids", Some(h.layer));
        let nk = h.n * h.k;
        let mut words = vec![0u32; 2 * nk + h.n * h.n_embd];
        h.down.read(h.data_at, &mut words);
        let ids = words[nk..2 * nk].to_vec();
        if let Some(&bad) = ids.iter().find(|&&e| e as usize >= h.missed.len()) {
            let e = OpError::ShapeMismatch {
                op: "moe_ffn (split)",
                expected: format!("{nk} expert ids < {}", h.missed.len()),
                got: vec![bad as usize],
            };
            release(&h, Some(e));
            return;
        }
        let is_miss = |e: u32| h.missed[e as usize];
        // Experts announced for the copy queue are the GPU's (the partition's prefetch variant
        // excludes the same ones).
        let announced = h.prefetch.as_ref().map(|p| p.announced_for(&h.up, h.seq, h.layer)).unwrap_or_default();
        let cpu = cpu_misses(&ids, |e| is_miss(e) && !announced.contains(&e), h.share_q);
        let xs: Vec<f32> = words[2 * nk..].iter().map(|&b| f32::from_bits(b)).collect();
        if h.n == 1 && read_ahead_threads() > 0 {
            *lock(&self.last_input) = Some((h.layer, xs.clone()));
            *lock(&self.gpu_guess) = h.gpu_guess.then_some((h.layer + 1, h.slot, h.seq));
        }
        if !guessed.is_empty() {
            let right = guessed.iter().filter(|e| cpu.contains(e)).count();
            h.shared.read_ahead_experts.fetch_add(guessed.len() as u64, Ordering::Relaxed);
            h.shared.read_ahead_right.fetch_add(right as u64, Ordering::Relaxed);
        }
        let n_misses = {
            let mut used = ids.clone();
            used.sort_unstable();
            used.dedup();
            used.iter().filter(|&&e| is_miss(e)).count()
        };
        let n_cpu = cpu.len();
        // Before the sum's flag: the host, once it has read the step's output, finds every
        // layer here.
        lock(&self.decided).push(Decided {
            layer: h.layer,
            ids: ids.clone(),
            missed: h.missed.clone(),
            n_misses,
            n_cpu,
        });
        if cpu.is_empty() {
            let copies = self.announce_next(&h);
            release(&h, None);
            self.submit_copies(&h, copies);
            if n_misses > 0 && h.adapt {
                // No join will measure the balance: the share grows until one does (as on the
                // readback path).
                h.shared.step_share(SHARE_STEP);
            }
            return;
        }
        let weights: Vec<f32> = words[..nk].iter().map(|&b| f32::from_bits(b)).collect();
        let job = CpuJob {
            store: h.store.clone(),
            layer: h.layer,
            experts: cpu,
            ids,
            weights,
            xs,
            k: h.k,
            biases: h.biases.clone(),
            spec: h.spec,
            mode: h.mode,
        };
        match job.run_timed(seen, &h.shared.queued_nanos, &h.shared.cpu_nanos) {
            Ok(sum) => {
                // Whether the GPU's share was done before the CPU's: the balance, as a join
                // measures it on the readback path.
                let gpu_done = h.down.load(DOWN_GPU_DONE + h.slot) == h.seq;
                trace::mark(if gpu_done { "gpu first" } else { "gpu last" }, Some(h.layer));
                trace::mark(share_bucket(h.shared.share()), Some(h.layer));
                h.up.write(h.data_at, &sum.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
                let copies = self.announce_next(&h);
                h.up.store(h.slot, h.seq);
                self.submit_copies(&h, copies);
                h.shared.joined_toward(
                    JoinSeen { gpu_done, waited: std::time::Duration::ZERO, taken_after: std::time::Duration::ZERO },
                    h.adapt,
                    dispatched_gpu_first(),
                );
            }
            Err(e) => release(&h, Some(e)),
        }
    }

    /// The prefetch's announcement for the call after `h` (`prefetch.rs`), made before `h`'s flag.
    fn announce_next(&self, h: &Handoff) -> Option<super::prefetch::Copies> {
        let p = h.prefetch.as_ref().filter(|_| h.guessed)?;
        p.announce_next(&h.down, &h.up, MAILBOX_SLOTS, h.seq, h.layer)
    }

    /// Submits an announcement's copies, after `h`'s flag: the chain to the next layer starts first.
    fn submit_copies(&self, h: &Handoff, copies: Option<super::prefetch::Copies>) {
        if let (Some(p), Some(c)) = (&h.prefetch, copies) {
            p.submit(&c);
            trace::mark("prefetch", Some(h.layer + 1));
        }
    }

    /// While the GPU has not yet handed layer `h` over: guesses its experts from the previous
    /// decode layer's input ([`ExpertStore::guess_experts`]), picks the CPU's of them by the
    /// partition's rule ([`cpu_misses`] with the layer's table and share) and reads their host
    /// copies into the CPU's caches until the hand-over's flag is up
    /// ([`ExpertStore::read_ahead`]). Returns the experts it picked (empty: none read).
    ///
    /// Why: from a CPU job's end to the next hand-over (~100 us a layer on the H200: the add,
    /// the next attention, the router) the CPU waits and the RAM idles, while the job after it
    /// was thought bound by that RAM (the experts' phase read 810 MiB a token at 4 GB, near the
    /// RAM's rate, twenty-fourth session). What the wait reads ahead the job should find in the
    /// cache. Reads only: results cannot change.
    ///
    /// Measured on the H200 (twenty-fifth session, lines spread over whichever threads came,
    /// most workers asleep) it changed nothing: on 8 threads, with the guesses on
    /// the pool (32 us a layer), it read 135 MiB a step (2.8 MB a layer, ~22% of the CPU's
    /// expert bytes) of experts 94% of which the CPU then computed, and steps with it were as
    /// fast as steps without (`ab-steps.sh ahead`: 0.9834 against the control's 0.9827; with
    /// `DISKFORMER_READ_AHEAD_DEMOTE=1` 0.9816 against 0.9839). So the CPU's job is not bound by
    /// the RAM alone at 16 threads (its kernels' rate is the next suspect). With every worker
    /// reading, the host thread, which records and submits the next layers meanwhile, found no
    /// core (its time a step went from 5.6 to 8.9 ms): hence at most the threads asked for.
    /// Since the thirty-fifth session each thread reads its own rows of the job
    /// (`ExpertStore::read_ahead` through `cache_fill::read_owned_into_cache`) and every worker
    /// polls: ~5% faster steps, on by default ([`read_ahead_threads`]).
    /// A/B name `ahead` (the B arm does not read ahead).
    fn read_ahead(&self, h: &Handoff, threads: usize) -> Vec<u32> {
        if h.n != 1 || threads == 0 || crate::ab::is_b("ahead") {
            return Vec::new();
        }
        let last_input = lock(&self.last_input).take();
        let guess = match self.guess_from_gpu(h) {
            Some(guess) => {
                h.shared.read_ahead_gpu_guesses.fetch_add(1, Ordering::Relaxed);
                guess
            }
            None => {
                let Some((layer, x)) = last_input else { return Vec::new() };
                if layer >= h.layer {
                    // The previous step's last layer: too far from this one to guess it.
                    return Vec::new();
                }
                let t_guess = Instant::now();
                let guess = h.store.guess_experts(h.layer, &x, h.k);
                h.shared.read_ahead_guess_nanos.fetch_add(t_guess.elapsed().as_nanos() as u64, Ordering::Relaxed);
                guess
            }
        };
        let is_miss = |e: u32| h.missed.get(e as usize).copied().unwrap_or(false);
        let cpu = cpu_misses(&guess, is_miss, h.share_q);
        if !cpu.is_empty() {
            let t_read = Instant::now();
            let bytes = h.store.read_ahead(h.layer, &cpu, threads, &|| h.down.load(h.slot) == h.seq);
            h.shared.read_ahead_nanos.fetch_add(t_read.elapsed().as_nanos() as u64, Ordering::Relaxed);
            h.shared.read_ahead_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        cpu
    }

    /// Layer `h`'s guessed misses as the previous call's routing kernel ranked them (its guess
    /// variant, [`WgpuBackend::guess_next_on_gpu`]), or `None` where that call made no guess for
    /// this layer or its guess is not in the mailbox (then the read-ahead guesses on the CPU).
    ///
    /// Why from the GPU: the guess on the pool took ~42 us of the ~80 us between a CPU job's end
    /// and the next hand-over on the H200 (thirty-fifth session), and the read-ahead could only
    /// start after it. The routing kernel of the layer before computes the same guess (the next
    /// router on the same input) as a second set of workgroups, ~170 us before it is needed, so
    /// the pollers start reading when the job before ends.
    fn guess_from_gpu(&self, h: &Handoff) -> Option<Vec<u32>> {
        let (layer, slot, seq) = lock(&self.gpu_guess).take()?;
        if layer != h.layer {
            return None;
        }
        let at = DOWN_GUESS + slot * GUESS_WORDS;
        // The kernel writes the ids and count before the sequence number.
        if h.down.load(at) != seq {
            return None;
        }
        let mut words = [0u32; GUESS_WORDS - 1];
        h.down.read(at + 1, &mut words);
        let count = (words[0] as usize).min(GUESS_WORDS - 2);
        Some(words[1..=count].iter().copied().filter(|&e| (e as usize) < h.missed.len()).collect())
    }
}

/// Whether a decode call's routing kernel also guesses the next layer's experts for the
/// read-ahead: on with the read-ahead unless `DISKFORMER_SPLIT_READ_AHEAD_GUESS=cpu` (the A/B
/// name `cpuguess` guesses on the CPU on B steps). Read once.
///
/// Why on by default since the thirty-seventh session (H200, `ab-steps.sh cpuguess`, N=64, two
/// rounds): steps guessing on the CPU ran at 0.986 and 0.979 of the steps taking the GPU's guess
/// (uniform routing; control 1.009 both rounds) and 0.991, 1.013 (skewed; control 0.995, 1.015).
/// `--stats`: 46.4 of 48 layers a step took the GPU's guess, the read-ahead read 291 MiB a step
/// against 197 (it starts when the job before ends, not after a ~42 us guess), the CPU's guessing
/// went from 2.1 ms a step to 0.76. Greedy ids were the same with either guess and without the
/// read-ahead (the qwen3_moe fixture split at two budgets; the synthetic 30B).
fn read_ahead_guess_on_gpu() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        read_ahead_threads() > 0
            && std::env::var("DISKFORMER_SPLIT_READ_AHEAD_GUESS").map_or(true, |v| v.trim() != "cpu")
    })
}

/// Threads of [`Dispatcher::read_ahead`]: `DISKFORMER_SPLIT_READ_AHEAD` (0: off), else every
/// worker (read once). Inside a polled step every free poller reads its own rows whatever the
/// number; the number bounds only the fallback outside one.
///
/// Why on by default since the thirty-fifth session: with every worker polling (the pollers
/// had been spawned so that most slept) and each thread reading the rows it then computes, the
/// steps without it ran at 0.943-0.960 of the steps with it (uniform) and 0.946-0.949 (skewed),
/// against the control's 0.985-1.107 and 1.000-1.010 (`ab-steps.sh ahead`, H200).
fn read_ahead_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var("DISKFORMER_SPLIT_READ_AHEAD").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(usize::MAX)
    })
}

/// Through the mailboxes, the fraction of layers whose GPU share should be done before the CPU's
/// (`DISKFORMER_SPLIT_GPU_FIRST`, 0.05-0.95; default 0.8). Not 0.5: the GPU's share and the
/// CPU's jobs read the same RAM, so moving misses between them hardly changes how long the two
/// take together, but a GPU share that ends after the CPU's job delays the next layer's
/// attention by its remainder. With the share settling at 0.5 (nineteenth session, calls 5-6)
/// the chain from a CPU job's end to the next layer's ids read ~145 us against 81-104 where the
/// CPU took more (the eighteenth session's host-polled mailboxes, 68% of the misses). Measured
/// in the twentieth session (alternating, one lease): 57.35 tok/s against 0.5's 54.21 uniform,
/// 68.92 against 65.83 skewed; 0.9 was no faster than 0.8 on another lease. Those were
/// separate processes (5-10% apart on one lease); on odd decode steps under
/// `DISKFORMER_AB=gpufirst` the target is 0.5, for the in-process A/B (the share moves up to
/// ~0.25 within a step's 48 joins, so each arm's steps drift toward their own balance): 1.0174
/// against the control's 1.0186 in the twenty-fourth session, inside that lease's noise.
fn dispatched_gpu_first() -> f64 {
    static TARGET: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    if crate::ab::is_b("gpufirst") {
        return 0.5;
    }
    *TARGET.get_or_init(|| {
        std::env::var("DISKFORMER_SPLIT_GPU_FIRST")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|v| v.is_finite())
            .map_or(0.8, |v| v.clamp(0.05, 0.95))
    })
}

/// The split's two mailboxes (`wgpu/mailbox.rs`): down (system memory) carries a layer's
/// routing and hidden state to the host, written by `mailbox_signal.wgsl`; up (the GPU's
/// memory through the BAR) carries the CPU's sum back, added by `mailbox_wait_add.wgsl`, which
/// waits for it on the GPU. A layer then costs no readback's round trip and no submit after the
/// CPU's work: the next layer is submitted while the CPU computes (docs/PAGING.md).
pub(in crate::wgpu) struct SplitMailboxes {
    up: Arc<Mailbox>,
    down: Arc<Mailbox>,
    /// Words of one slot's data.
    slot_words: usize,
    /// The last call's sequence number (flags start at 0, so calls count from 1).
    seq: u32,
}

/// One call's place in the mailboxes.
struct MailboxCall {
    seq: u32,
    slot: usize,
    /// First word of the slot's data (the same in both mailboxes).
    data_at: usize,
}

/// The partition kernel's source, sized for the per-pair kernels' most pairs; `prefetch`: its
/// variant that reads the prefetch's announcement and writes the per-pair kernels' table (its
/// `//F ` lines, `prefetch.rs`).
fn partition_source(prefetch: bool) -> String {
    let src = include_str!("../shaders/moe_split_partition.wgsl")
        .replace("{{MAX_PAIRS}}", &moe::MAX_HOST_PAIRS.to_string())
        .replace("{{SKIP}}", &SKIP.to_string())
        .replace("{{PF_MAX}}", &super::prefetch::PREFETCH_MAX.to_string());
    if prefetch {
        src.replace("{{P_BINDING}}", "7").replace("//F ", "")
    } else {
        src.replace("{{P_BINDING}}", "3")
    }
}

/// The prefetch's guess kernel (`prefetch.rs`).
const PREFETCH_PICK: &str = include_str!("../shaders/moe_split_prefetch_pick.wgsl");

/// The prefetch's table for the second pass (`prefetch.rs`).
fn prefetch_patch_source() -> String {
    include_str!("../shaders/moe_split_prefetch_patch.wgsl")
        .replace("{{PF_MAX}}", &super::prefetch::PREFETCH_MAX.to_string())
}

/// The split's state shared with the joins of its CPU work (which run inside a submit, where
/// the tier's state may be locked).
#[derive(Debug)]
pub(super) struct SplitShared {
    /// The CPU's share of a layer's misses, as `f64` bits.
    share_bits: AtomicU64,
    /// Joins, and those that found the GPU done.
    pub(super) joins: Arc<AtomicU64>,
    pub(super) gpu_first: Arc<AtomicU64>,
    /// The CPU jobs' time, summed.
    pub(super) cpu_nanos: Arc<AtomicU64>,
    /// The CPU jobs' time from their spawn to their start (a worker taking them), summed.
    pub(super) queued_nanos: Arc<AtomicU64>,
    /// The host's time waiting for the CPU's results at the joins, summed.
    pub(super) join_wait_nanos: Arc<AtomicU64>,
    /// From a CPU job's end (or the join's start, when later) to the join taking its result.
    pub(super) noticed_nanos: Arc<AtomicU64>,
    /// The dispatcher's read-ahead ([`Dispatcher::read_ahead`]): bytes read, experts guessed
    /// for the CPU, and those of them the CPU then computed.
    pub(super) read_ahead_bytes: Arc<AtomicU64>,
    pub(super) read_ahead_experts: Arc<AtomicU64>,
    pub(super) read_ahead_right: Arc<AtomicU64>,
    /// The guesses' time, summed.
    pub(super) read_ahead_guess_nanos: Arc<AtomicU64>,
    /// The reading's time (from its start to the last thread's stop), summed.
    pub(super) read_ahead_nanos: Arc<AtomicU64>,
    /// Layers whose read-ahead took the guess the routing kernel made.
    pub(super) read_ahead_gpu_guesses: Arc<AtomicU64>,
}

impl Default for SplitShared {
    fn default() -> SplitShared {
        SplitShared {
            share_bits: AtomicU64::new(SHARE_START.to_bits()),
            joins: Arc::default(),
            gpu_first: Arc::default(),
            cpu_nanos: Arc::default(),
            queued_nanos: Arc::default(),
            join_wait_nanos: Arc::default(),
            noticed_nanos: Arc::default(),
            read_ahead_bytes: Arc::default(),
            read_ahead_experts: Arc::default(),
            read_ahead_right: Arc::default(),
            read_ahead_guess_nanos: Arc::default(),
            read_ahead_nanos: Arc::default(),
            read_ahead_gpu_guesses: Arc::default(),
        }
    }
}

impl SplitShared {
    pub(super) fn share(&self) -> f64 {
        f64::from_bits(self.share_bits.load(Ordering::Relaxed))
    }

    /// A CPU result was taken: the GPU done by then means the CPU was the longer of the two
    /// (its share shrinks), else the GPU was (it grows); `adapt` false leaves it.
    fn joined(&self, seen: JoinSeen, adapt: bool) {
        self.joined_toward(seen, adapt, 0.5);
    }

    /// [`Self::joined`] with the share settling where the GPU was done first in a fraction
    /// `gpu_first` of the joins: it shrinks by `SHARE_STEP * (1 - gpu_first) / gpu_first` when the
    /// GPU was done, grows by `SHARE_STEP` when it was not (0.5: the same step both ways).
    fn joined_toward(&self, seen: JoinSeen, adapt: bool, gpu_first: f64) {
        self.joins.fetch_add(1, Ordering::Relaxed);
        self.noticed_nanos.fetch_add(seen.taken_after.as_nanos() as u64, Ordering::Relaxed);
        self.gpu_first.fetch_add(seen.gpu_done as u64, Ordering::Relaxed);
        self.join_wait_nanos.fetch_add(seen.waited.as_nanos() as u64, Ordering::Relaxed);
        if adapt {
            let shrink = SHARE_STEP * (1.0 - gpu_first) / gpu_first;
            self.step_share(if seen.gpu_done { -shrink } else { SHARE_STEP });
        }
    }

    fn step_share(&self, step: f64) {
        let share = (self.share() + step).clamp(0.0, 1.0);
        self.share_bits.store(share.to_bits(), Ordering::Relaxed);
    }
}

/// The CPU's part of one split layer, owned, so that it runs while the caller goes on.
struct CpuJob {
    store: Arc<dyn crate::backend::ExpertStore>,
    layer: usize,
    /// The experts it computes (ascending), and the call's ids, weights and rows.
    experts: Vec<u32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
    xs: Vec<f32>,
    k: usize,
    biases: Arc<HostBiases>,
    spec: MoeSpec,
    mode: crate::quant::MatmulMode,
}

impl CpuJob {
    /// [`Self::run`] on a worker, its time from `spawned` to its start added to `queued` and
    /// its running time to `secs` (the profile's counters), marked in the trace.
    fn run_timed(&self, spawned: Instant, queued: &AtomicU64, secs: &AtomicU64) -> Result<Vec<f32>, OpError> {
        trace::mark("job start", Some(self.layer));
        let started = Instant::now();
        queued.fetch_add((started - spawned).as_nanos() as u64, Ordering::Relaxed);
        let out = self.run();
        secs.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        trace::mark("job end", Some(self.layer));
        out
    }

    /// The sum of its experts' outputs, `[n, n_embd]`, each added in ascending id order.
    fn run(&self) -> Result<Vec<f32>, OpError> {
        let (k, nk) = (self.k, self.ids.len());
        let n = nk / k.max(1);
        let n_embd = self.xs.len() / n.max(1);
        let mut sum = vec![0f32; n * n_embd];
        let one = |ex: &HostExpert<'_>| -> Result<Vec<f32>, OpError> {
            let toks: Vec<(usize, f32)> =
                (0..nk).filter(|&p| self.ids[p] == ex.id).map(|p| (p / k, self.weights[p])).collect();
            let mut out = vec![0f32; n * n_embd];
            host_expert_ffn(self.mode, &self.xs, &toks, ex, &self.biases, &self.spec, &mut out)?;
            Ok(out)
        };
        self.store.with_host_experts(self.layer, &self.experts, &mut |group: &[HostExpert<'_>]| {
            if n == 1 {
                // Every expert's products in one parallel region (decode).
                let weighted: Vec<(HostExpert<'_>, f32)> = group
                    .iter()
                    .map(|ex| (*ex, self.ids.iter().position(|&i| i == ex.id).map_or(0.0, |p| self.weights[p])))
                    .collect();
                return experts_one_token(self.mode, &self.xs, &weighted, self.biases.slices(), &self.spec, &mut sum);
            }
            // Experts at once (each product also splits its rows over the threads), summed in
            // the group's order: the same bits whatever thread ran which.
            let outs: Vec<Result<Vec<f32>, OpError>> = group.par_iter().map(one).collect();
            for out in outs {
                sum.iter_mut().zip(out?).for_each(|(o, v)| *o += v);
            }
            Ok(())
        })?;
        Ok(sum)
    }
}

/// Where a layer's experts are for the per-pair kernels: the pool region's buffer, the layer's
/// host copy and its matrices' layout, the slot table.
pub(super) struct LayerPlace<'a> {
    pub(super) pool: &'a wgpu::Buffer,
    pub(super) host: &'a wgpu::Buffer,
    pub(super) mats: SlotMats,
    pub(super) table: &'a wgpu::Buffer,
}

impl WgpuBackend {
    /// The pipeline of [`wait_add_source`]'s variant (created once).
    fn wait_add_pipeline(&self, norm: bool) -> std::sync::Arc<wgpu::ComputePipeline> {
        // Workgroup memory written before it is read (argued in the shader): no zeroing.
        self.ctx.pipeline_with(wait_add_key(norm), || wait_add_source(norm), true)
    }

    /// [`Backend::add_rms_norm`] where `b` is the sum the split's `mailbox_wait_add.wgsl` writes
    /// and its dispatch (one token) is the last pending command: that kernel, as one workgroup, also
    /// adds `a` and norms the sum, writing the sum, the normed row and, for int8 products, its
    /// blocks (the shader's `//N` variant): three dependent dispatches become one. `None`,
    /// changing nothing, otherwise (and on odd decode steps under `DISKFORMER_AB=addnorm`, or
    /// with `DISKFORMER_ADD_NORM=apart`).
    pub(in crate::wgpu) fn fuse_wait_add_norm(
        &self,
        a: &WgpuTensor,
        b: &WgpuTensor,
        weight: Option<&WgpuTensor>,
        eps: f32,
    ) -> Result<Option<(WgpuTensor, WgpuTensor)>, OpError> {
        static APART: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let apart = *APART.get_or_init(|| std::env::var("DISKFORMER_ADD_NORM").is_ok_and(|v| v.trim() == "apart"));
        let Some(w) = weight else { return Ok(None) };
        if apart
            || crate::ab::is_b("addnorm")
            || !self.ctx.fuse
            || a.shape != b.shape
            || a.rows() != 1
            || w.len() != a.width()
        {
            return Ok(None);
        }
        // Only a back end that has recorded the wait can have it pending.
        let Some(plain) = self.ctx.pipeline_made(wait_add_key(false)) else { return Ok(None) };
        // The wait's bindings, when it is the last pending command.
        let wait_bindings = |p: &super::super::Pending| match p.cmds.last() {
            Some(super::super::Cmd::Dispatch { pipeline, buffers, params_len, .. })
                if std::sync::Arc::ptr_eq(pipeline, &plain)
                    && buffers.get(2) == Some(&b.buf.buffer)
                    && *params_len >= 48 =>
            {
                Some(buffers.clone())
            }
            _ => None,
        };
        // The new outputs must not be buffers the wait already binds: the GPU's share `Y`, freed
        // by the split once recorded, is back in the pool while the wait still reads it, and one
        // dispatch may not read and write one buffer (wgpu refuses it). Such a buffer is set aside
        // until both are allocated.
        let Some(bound) = wait_bindings(&lock(&self.ctx.pending)) else { return Ok(None) };
        let mut set_aside = Vec::new();
        let mut fresh = |label: &'static str| -> Result<WgpuTensor, OpError> {
            loop {
                let t = self.alloc(label, &a.shape)?;
                if !bound.contains(&t.buf.buffer) {
                    return Ok(t);
                }
                set_aside.push(t);
            }
        };
        let sum = fresh("add_rms_norm sum")?;
        let h = fresh("add_rms_norm")?;
        drop(set_aside);
        // Blocks only where a norm would write them (one token of whole blocks, int8 products);
        // otherwise `h` fills their bindings (see `norm_dispatch`).
        let q8 = self.q8_epilogue_target(&h, true);
        let (qs, ds) = q8.clone().unwrap_or_else(|| (h.buf.buffer.clone(), h.buf.buffer.clone()));
        let fused = self.wait_add_pipeline(true);
        {
            let mut p = lock(&self.ctx.pending);
            if wait_bindings(&p).is_none() {
                return Ok(None);
            }
            let super::super::Pending { cmds, params, .. } = &mut *p;
            let Some(super::super::Cmd::Dispatch { pipeline, buffers, params_at, groups, .. }) = cmds.last_mut() else {
                return Ok(None);
            };
            // One workgroup norms the whole row (the plain kernel may spread a wide row).
            *groups = [1, 1, 1];
            let at = *params_at as usize;
            params[at + 28..at + 32].copy_from_slice(&eps.to_bits().to_le_bytes());
            params[at + 32..at + 36].copy_from_slice(&(q8.is_some() as u32).to_le_bytes());
            *pipeline = fused;
            buffers.extend([
                a.buf.buffer.clone(),
                sum.buf.buffer.clone(),
                h.buf.buffer.clone(),
                w.buf.buffer.clone(),
                qs,
                ds,
            ]);
        }
        if q8.is_some() {
            self.q8_register(&h.buf.buffer, h.width());
        }
        Ok(Some((sum, h)))
    }
}

impl WgpuBackend {
    /// `moe_ffn` of a decode call (few tokens) under [`MissPolicy::Split`], the tier's state
    /// locked by the caller (see the module docs).
    #[allow(clippy::too_many_arguments)] // moe_ffn's inputs, the tier, its state and the layer's place
    pub(super) fn moe_split_pairs(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        x: &WgpuTensor,
        routing: &Routing<Self>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
        place: LayerPlace<'_>,
    ) -> Result<WgpuTensor, OpError> {
        let layer = experts.layer;
        trace::mark("split", Some(layer));
        let (n, n_embd, k) = (x.rows(), x.width(), routing.k);
        let nk = n * k;
        let x_bytes = 4 * (n * n_embd) as u64;
        let share = tier.split_fixed.unwrap_or_else(|| tier.split.share());
        let share_q = share_in_256ths(share);
        let m0 = place.mats;
        let fused = moe::FusedMats {
            gate: m0.gate.map(|g| (place.pool, g.layout)),
            up: (place.pool, m0.up.layout),
            down: (place.pool, m0.down.layout),
            host: Some(place.host),
        };
        let gpu_biases = [experts.gate_bias.as_ref(), experts.up_bias.as_ref(), experts.down_bias.as_ref()];
        let slots_at = (layer * st.host.row) as u32;
        // One wait for the routing and the hidden state. A GPU router leaves its ids after the
        // weights in the same buffer; a host router's are already here.
        let gpu_routed = routing.ids.is_empty();
        let weight_bytes = if gpu_routed { 8 } else { 4 } * nk as u64;
        // With the ids on the GPU, the GPU partitions the misses itself and its share is
        // submitted before the host waits: it runs while the ids travel and the host decides.
        let partitioned_on_gpu = gpu_routed && !tier.split_host_partition;
        let route_words = (weight_bytes / 4) as usize;
        let mailbox = if partitioned_on_gpu && tier.split_mailbox && !tier.split_sync {
            self.split_mailbox_call(st, route_words + n * n_embd)?
        } else {
            None
        };
        if let Some(call) = mailbox {
            let biases = self.split_host_biases(st, experts)?;
            let call_place = DispatchedPlace { fused: &fused, gpu_biases, table: place.table, slots_at, share_q };
            return self.split_through_mailboxes(tier, st, call, x, routing, experts, spec, call_place, biases);
        }
        let queued =
            self.queue_tier_readback(tier, &[(&routing.weights.buf.buffer, weight_bytes), (&x.buf.buffer, x_bytes)]);
        trace::mark("readback queued", Some(layer));
        let y_gpu = if partitioned_on_gpu {
            let gpu_ids = self.alloc_bytes("moe split ids", 4 * nk as u64)?;
            self.dispatch(
                // Workgroup memory written before it is read (the shader's phase 1).
                self.ctx.pipeline_with("moe_split_partition", || partition_source(false), true),
                &[&routing.weights.buf.buffer, place.table, &gpu_ids.buffer],
                &[nk as u32, nk as u32, slots_at, share_q],
                [1, 1, 1],
            );
            let table = PairTable::Slots { ids: &gpu_ids.buffer, at: 0, slots: place.table, slots_at };
            let y = self.moe_pairs(x, k, &table, (&routing.weights.buf.buffer, 0), &fused, gpu_biases, spec)?;
            let mut p = lock(&self.ctx.pending);
            self.ctx.flush_locked(&mut p);
            Some(y)
        } else {
            None
        };
        trace::mark("gpu share submitted", Some(layer));
        let (weights, ids, xs) = {
            let parts = self.finish_tier_readback(tier, queued, true)?;
            let ids = if gpu_routed { le_u32s(&parts[0][4 * nk..]) } else { routing.ids.clone() };
            (le_f32s(&parts[0][..4 * nk]), ids, le_f32s(&parts[1]))
        };
        trace::mark("ids", Some(layer));
        if let Some(&bad) = ids.iter().find(|&&e| e as usize >= spec.n_expert) {
            return Err(OpError::ShapeMismatch {
                op: "moe_ffn (split)",
                expected: format!("{nk} expert ids < {}", spec.n_expert),
                got: vec![bad as usize],
            });
        }
        let t_read = Instant::now();
        let biases = self.split_host_biases(st, experts)?;

        // The same rule as the GPU's partition kernel, on the same table: the CPU's experts.
        let is_miss = |e: u32| st.slot_of[layer][e as usize] == NO_SLOT;
        let n_misses = {
            let mut used = ids.clone();
            used.sort_unstable();
            used.dedup();
            used.iter().filter(|&&e| is_miss(e)).count()
        };
        let cpu = cpu_misses(&ids, is_miss, share_q);
        let n_cpu = cpu.len();
        self.note_selections(tier, st, layer, &ids);
        {
            let s = &mut st.stats[layer];
            s.host_reads -= n_cpu as u64;
            s.cpu_computed += n_cpu as u64;
        }
        let t_decided = Instant::now();

        let y = match y_gpu {
            Some(y) => y,
            None => {
                // The GPU's pairs: the CPU's marked SKIP, which the kernels leave out.
                let gpu_ids: Vec<u32> =
                    ids.iter().map(|&e| if cpu.binary_search(&e).is_ok() { SKIP } else { e }).collect();
                let ids_buf = self.upload("moe ids", bytemuck::cast_slice(&gpu_ids))?;
                let table = PairTable::Slots { ids: &ids_buf.buffer, at: 0, slots: place.table, slots_at };
                let y = self.moe_pairs(x, k, &table, (&routing.weights.buf.buffer, 0), &fused, gpu_biases, spec)?;
                // Submitted now, so the GPU works while the CPU does.
                let mut p = lock(&self.ctx.pending);
                self.ctx.flush_locked(&mut p);
                y
            }
        };
        let t_submitted = Instant::now();
        let y = if cpu.is_empty() {
            self.refill_layer(tier, st, layer)?;
            if n_misses > 0 && tier.split_fixed.is_none() {
                // The share rounds to no expert for the CPU: no join will measure the balance,
                // so it grows until one does (else a share near 0 would stay there for good).
                tier.split.step_share(SHARE_STEP);
            }
            y
        } else {
            // The CPU's sum goes into a buffer that the add reads; the model records the next
            // layer meanwhile, and the next submit waits for the sum (`Deferred`).
            let job = CpuJob {
                store: tier.store.clone(),
                layer,
                experts: cpu.clone(),
                ids: ids.clone(),
                weights,
                xs,
                k,
                biases,
                spec: *spec,
                mode: tier.opts.cpu_matmul,
            };
            let spawned = Instant::now();
            let (secs, queued) = (tier.split.cpu_nanos.clone(), tier.split.queued_nanos.clone());
            let cpu_sum = self.alloc("moe cpu experts", &[n, n_embd])?;
            let (send, result) = std::sync::mpsc::channel();
            trace::mark("spawn", Some(layer));
            rayon::spawn(move || {
                let out = job.run_timed(spawned, &queued, &secs);
                // The receiver is gone only if the back end was dropped: nothing to tell.
                let _ = send.send((out, Instant::now()));
            });
            // Before the deferred add (a submit would wait for the job then).
            self.refill_layer(tier, st, layer)?;
            let shared = tier.split.clone();
            let adapt = tier.split_fixed.is_none() && n_misses > 0;
            lock(&self.ctx.pending).deferred.push(Deferred {
                buffer: cpu_sum.buf.buffer.clone(),
                result,
                on_join: Box::new(move |seen| shared.joined(seen, adapt)),
            });
            let y = self.add(&y, &cpu_sum)?;
            if tier.split_sync {
                // Wait for the CPU here (before the next layer is recorded), for comparison.
                let mut p = lock(&self.ctx.pending);
                self.ctx.flush_locked(&mut p);
            }
            y
        };

        trace::mark("split end", Some(layer));
        self.split_profile(tier, t_read, t_decided, t_submitted, n_misses, n_cpu);
        Ok(y)
    }

    /// The call's times and counts into the tier's profile.
    fn split_profile(
        &self,
        tier: &ExpertTier,
        t_read: Instant,
        t_decided: Instant,
        t_submitted: Instant,
        n_misses: usize,
        n_cpu: usize,
    ) {
        let mut prof = lock(&tier.profile);
        prof.calls += 1;
        // The readback's submit and wait are counted by `read_back_tier_parts`.
        prof.decide_secs += (t_decided - t_read).as_secs_f64();
        prof.record_secs += t_decided.elapsed().as_secs_f64();
        prof.store_secs += (t_submitted - t_decided).as_secs_f64();
        prof.cpu_secs = tier.split.cpu_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
        prof.split_layers += 1;
        prof.split_gpu_first = tier.split.gpu_first.load(Ordering::Relaxed);
        prof.split_joins = tier.split.joins.load(Ordering::Relaxed);
        prof.split_queued_secs = tier.split.queued_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
        prof.split_join_wait_secs = tier.split.join_wait_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
        prof.split_noticed_secs = tier.split.noticed_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
        prof.submit_after_join_secs = self.ctx.submit_after_join_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
        prof.split_misses += n_misses as u64;
        prof.split_cpu_experts += n_cpu as u64;
    }

    /// The mailboxes' place for a call whose data is `words` long, making (or growing) them on
    /// first use; `None` where the device has none (not Vulkan) or the pool has one thread (the
    /// GPU's wait would then depend on a job only this thread could run). Returns a CPU job's
    /// error from an earlier call, and reports a GPU that gave up waiting.
    fn split_mailbox_call(&self, st: &mut TierState, words: usize) -> Result<Option<MailboxCall>, OpError> {
        if let Some(e) = lock(&self.ctx.deferred_error).take() {
            return Err(e);
        }
        if let Some(e) = self.split_failed_take(st) {
            return Err(e);
        }
        if self.ctx.adapter.device_type == "Cpu" {
            // lavapipe: a kernel polling a word the host writes from a later submission's
            // point of view went on before the host's write (`perf_mailbox`, all 200 rounds
            // of its third case on this VM's Mesa 22.3), and a spinning kernel would take a
            // core from the CPU's own share anyway.
            st.mailbox_unavailable = true;
        }
        if st.mailbox_unavailable || rayon::current_num_threads() < 2 {
            return Ok(None);
        }
        if st.split_mailboxes.as_ref().is_none_or(|m| m.slot_words < words) {
            let total = MAILBOX_DATA + MAILBOX_SLOTS * words;
            let make = |toward| {
                Mailbox::new(&self.ctx.device, total, toward).map_err(|why| OpError::Unsupported {
                    op: "moe_ffn (split mailbox)",
                    backend: "wgpu",
                    why,
                })
            };
            let (Some(up), Some(down)) = (make(Toward::Gpu)?, make(Toward::Host)?) else {
                st.mailbox_unavailable = true;
                return Ok(None);
            };
            // Earlier calls' kernels and jobs hold the old ones until they are done; the new
            // ones start from sequence number 0, and every earlier wait was recorded before.
            st.split_mailboxes =
                Some(SplitMailboxes { up: Arc::new(up), down: Arc::new(down), slot_words: words, seq: 0 });
        }
        let mb = st.split_mailboxes.as_mut().expect("made above");
        mb.seq = mb.seq.wrapping_add(1).max(1);
        let slot = mb.seq as usize % MAILBOX_SLOTS;
        Ok(Some(MailboxCall { seq: mb.seq, slot, data_at: MAILBOX_DATA + slot * mb.slot_words }))
    }

    /// A CPU job's error from an earlier call, or the GPU having given up waiting for one.
    fn split_failed_take(&self, st: &TierState) -> Option<OpError> {
        let tier_failed = st.split_mailboxes.as_ref().map(|m| m.down.load(DOWN_TIMEOUT)).filter(|&s| s != 0);
        if let Some(seq) = tier_failed {
            return Some(OpError::Unsupported {
                op: "moe_ffn (split)",
                backend: "wgpu",
                why: format!(
                    "the GPU stopped waiting for the CPU's experts of call {seq} after {} polls (DISKFORMER_SPLIT_SPIN_LIMIT)",
                    split_wait_spin_limit()
                ),
            });
        }
        None
    }

    /// A decode layer through the mailboxes: its hand-over, the GPU's share and a marker of that
    /// share's end are recorded and submitted, the add of the CPU's sum (a kernel that waits for
    /// it on the GPU) recorded to go with the next layer, and the layer goes to the dispatcher
    /// ([`Dispatcher`]),
    /// which takes it when the GPU's flag is up, decides the CPU's experts, computes them and
    /// writes the sum. The host returns at once and records the next layer while the GPU
    /// computes this one's attention: it waits for nothing here. What the dispatcher found of
    /// earlier layers (their ids, for the statistics and the pool's replacements) is taken in
    /// after this layer's share is recorded, so the replacements' copies run while the GPU
    /// waits for the CPU, not ahead of the hand-over.
    #[allow(clippy::too_many_arguments)] // moe_ffn's inputs, the tier, its state and the call's place
    fn split_through_mailboxes(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        call: MailboxCall,
        x: &WgpuTensor,
        routing: &Routing<Self>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
        place: DispatchedPlace<'_>,
        biases: Arc<HostBiases>,
    ) -> Result<WgpuTensor, OpError> {
        let layer = experts.layer;
        let (n, n_embd, k) = (x.rows(), x.width(), routing.k);
        let nk = n * k;
        let route_words = 2 * nk;
        let t_start = Instant::now();
        let (up, down) = {
            let mb = st.split_mailboxes.as_ref().expect("made by split_mailbox_call");
            (mb.up.clone(), mb.down.clone())
        };
        let signal = self.ctx.pipeline_with("mailbox_signal", || MAILBOX_SIGNAL.to_string(), true);
        let hand_over = [(n * n_embd) as u32, call.data_at as u32, call.slot as u32, call.seq];
        let fused_signal = self.fuse_route_signal(&routing.weights.buf.buffer, &x.buf.buffer, down.buffer(), hand_over);
        if !fused_signal {
            self.dispatch(
                signal.clone(),
                &[&routing.weights.buf.buffer, &x.buf.buffer, down.buffer()],
                &[route_words as u32, (n * n_embd) as u32, call.data_at as u32, call.slot as u32, call.seq, 0, 0, 0],
                [1, 1, 1],
            );
        }
        // The GPU's share, by the same rule the dispatcher applies to the same table (taken now,
        // in queue order with the table's updates).
        let missed: Vec<bool> = st.slot_of[layer].iter().map(|&s| s == NO_SLOT).collect();
        let gpu_ids = self.alloc_bytes("moe split ids", 4 * nk as u64)?;
        let prefetch = tier.prefetch.clone().filter(|_| n == 1);
        let (guess_early, two_pass) = super::prefetch::shape_from_env();
        // The next layer's guess first, so that the dispatcher finds it by the CPU job's end
        // (`DISKFORMER_SPLIT_PREFETCH_GUESS=share`: after the GPU's share instead).
        let mut guessed = match &prefetch {
            Some(pf) if guess_early => {
                let fuse_into = Some(&routing.weights.buf.buffer).filter(|_| fused_signal);
                self.prefetch_guess_next(tier, pf, st, layer, x, &down, &call, fuse_into)?
            }
            _ => false,
        };
        let gpu_guess = prefetch.is_none()
            && n == 1
            && fused_signal
            && self.guess_next_on_gpu(st, layer, &routing.weights.buf.buffer, &down, &call);
        let pairs = |ids: &wgpu::Buffer, slots: &wgpu::Buffer, slots_at: u32| {
            let table = PairTable::Slots { ids, at: 0, slots, slots_at };
            self.moe_pairs(x, k, &table, (&routing.weights.buf.buffer, 0), place.fused, place.gpu_biases, spec)
        };
        let y = match &prefetch {
            None => {
                self.dispatch(
                    // Workgroup memory written before it is read (the shader's phase 1).
                    self.ctx.pipeline_with("moe_split_partition", || partition_source(false), true),
                    &[&routing.weights.buf.buffer, place.table, &gpu_ids.buffer],
                    &[nk as u32, nk as u32, place.slots_at, place.share_q],
                    [1, 1, 1],
                );
                pairs(&gpu_ids.buffer, place.table, place.slots_at)?
            }
            Some(pf) => {
                let late_ids = self.alloc_bytes("moe split late ids", 4 * nk as u64)?;
                let area = super::prefetch::area_at(call.seq, MAILBOX_SLOTS) as u32;
                let row = st.host.row;
                let slots = self.alloc_bytes("moe split late slots", 16 * row as u64)?;
                // One pass: the partition writes the table row the per-pair kernels read (the
                // patch kernel's work, no dispatch of its own).
                let patch_row = if two_pass { 0 } else { row as u32 };
                self.dispatch(
                    // Workgroup memory written before it is read (the shader's first phase).
                    self.ctx.pipeline_with("moe_split_partition_prefetch", || partition_source(true), true),
                    &[
                        &routing.weights.buf.buffer,
                        place.table,
                        &gpu_ids.buffer,
                        up.buffer(),
                        &late_ids.buffer,
                        &pf.tags,
                        &slots.buffer,
                    ],
                    &[
                        nk as u32,
                        nk as u32,
                        place.slots_at,
                        place.share_q,
                        area,
                        call.seq,
                        u32::from(two_pass),
                        patch_row,
                        super::prefetch::STAT_LANDED as u32,
                        0,
                        0,
                        0,
                    ],
                    [1, 1, 1],
                );
                let patch = || {
                    self.dispatch(
                        // Workgroup memory written before it is read (invocation 0, before the barrier).
                        self.ctx.pipeline_with("moe_split_prefetch_patch", prefetch_patch_source, true),
                        &[place.table, up.buffer(), &pf.tags, &slots.buffer],
                        &[place.slots_at, area, call.seq, row as u32, super::prefetch::STAT_LANDED as u32, 0, 0, 0],
                        [1, 1, 1],
                    );
                };
                if two_pass {
                    // The announced misses after the rest, from where the patch finds them then.
                    let first = pairs(&gpu_ids.buffer, place.table, place.slots_at)?;
                    patch();
                    let late = pairs(&late_ids.buffer, &slots.buffer, 0)?;
                    self.add(&first, &late)?
                } else {
                    pairs(&gpu_ids.buffer, &slots.buffer, 0)?
                }
            }
        };
        if let Some(pf) = prefetch.as_ref().filter(|_| !guess_early) {
            guessed = self.prefetch_guess_next(tier, pf, st, layer, x, &down, &call, None)?;
        }
        // The share's end marked for the dispatcher, which balances the CPU's share by it: the
        // marker reads `y`, so it runs after every kernel that wrote it.
        self.dispatch(
            signal,
            &[&routing.weights.buf.buffer, &y.buf.buffer, down.buffer()],
            &[0, 0, 0, (DOWN_GPU_DONE + call.slot) as u32, call.seq, 0, 0, 0],
            [1, 1, 1],
        );
        // Submitted now: the GPU computes its share while the hand-over travels.
        {
            let mut p = lock(&self.ctx.pending);
            self.ctx.flush_locked(&mut p);
        }
        // Earlier layers' replacements, in their own submission after this share (the flush in
        // `refill_layer`): their copies run while the GPU waits for the CPU.
        self.take_decided(tier, st, false)?;
        self.touch_next_layer(tier, st, layer, x, &up, &call)?;
        let out = self.alloc("moe split sum", &[n, n_embd])?;
        self.dispatch(
            self.wait_add_pipeline(false),
            &[up.buffer(), &y.buf.buffer, &out.buf.buffer, down.buffer()],
            &[
                call.slot as u32,
                call.data_at as u32,
                (n * n_embd) as u32,
                call.seq,
                split_wait_spin_limit(),
                DOWN_TIMEOUT as u32,
                (DOWN_WAITED + call.slot) as u32,
                // The add-norm variant's words (`fuse_wait_add_norm` sets them).
                0,
                0,
                0,
                0,
                0,
            ],
            [(n * n_embd).div_ceil(2048).clamp(1, 64) as u32, 1, 1],
        );
        // The add stays in the pending commands, submitted with the next layer's attention: the
        // GPU goes from the CPU's sum to that attention within one submission. (Call 5 of the
        // nineteenth session ended each layer's submission with its add instead; the
        // dispatcher's wait for the next flag read 7.0-7.8 ms per step there, 6.8-7.4 this way
        // on another lease: not separable.)
        let t_submitted = Instant::now();
        tier.dispatcher.push(Handoff {
            seq: call.seq,
            slot: call.slot,
            data_at: call.data_at,
            up,
            down,
            layer,
            n,
            n_embd,
            k,
            missed,
            share_q: place.share_q,
            adapt: tier.split_fixed.is_none(),
            store: tier.store.clone(),
            biases,
            spec: *spec,
            mode: tier.opts.cpu_matmul,
            shared: tier.split.clone(),
            failed: self.ctx.deferred_error.clone(),
            prefetch,
            guessed,
            gpu_guess,
        });
        trace::mark("split end", Some(layer));
        let mut prof = lock(&tier.profile);
        prof.calls += 1;
        prof.record_secs += (t_submitted - t_start).as_secs_f64();
        prof.split_layers += 1;
        prof.split_mailbox_layers += 1;
        Ok(out)
    }

    /// The read-ahead's guess of the next layer's misses ([`Dispatcher::guess_from_gpu`]) fused
    /// into this layer's pending routing kernel (`routing`, which carries the hand-over): the
    /// next layer's router on the same row, and after the flag the top k of its logits that the
    /// slot table puts in host memory, ranked, to the call's guess area. `false` (nothing
    /// recorded) where it is off ([`read_ahead_guess_on_gpu`], A/B `cpuguess` on B steps), for
    /// the last layer or one whose router or host copy is not there yet, or where the routing
    /// kernel cannot take it (`fuse_route_guess`).
    fn guess_next_on_gpu(
        &self,
        st: &TierState,
        layer: usize,
        routing: &wgpu::Buffer,
        down: &Mailbox,
        call: &MailboxCall,
    ) -> bool {
        if !read_ahead_guess_on_gpu() || crate::ab::is_b("cpuguess") {
            return false;
        }
        let next = layer + 1;
        let Some(guess_router) = st.guess_routers.get(next).cloned().flatten() else { return false };
        let Some(table) = st.host.table_gpu.clone() else { return false };
        if st.host.layers.get(next).is_none_or(|h| h.is_none()) {
            return false;
        }
        let words =
            [(DOWN_GUESS + call.slot * GUESS_WORDS) as u32, (next * st.host.row) as u32, (GUESS_WORDS - 2) as u32];
        let fused = self.fuse_route_guess(routing, &guess_router.router, &table, down.buffer(), words);
        if fused {
            trace::mark("guess", Some(next));
        }
        fused
    }

    /// The prefetch's guess (`prefetch.rs`): the next layer's router on this layer's input `x`,
    /// routed, and `moe_split_prefetch_pick.wgsl`, which writes the guessed experts in host
    /// memory into the down mailbox for the dispatcher. With `fuse_into` (the routing buffer of
    /// this layer's pending routing kernel, which carries the hand-over), both go into that
    /// kernel instead (`fuse_route_guess`: no dispatch of their own; `DISKFORMER_SPLIT_PREFETCH_FUSE=0`
    /// keeps them apart). Registers the next layer with the prefetch on its first guess. `false`
    /// (nothing recorded) for the last layer, a layer whose host copy or router is not there yet,
    /// or a router the routing kernel cannot take.
    #[allow(clippy::too_many_arguments)] // the split call's place and the prefetch
    fn prefetch_guess_next(
        &self,
        tier: &ExpertTier,
        pf: &super::prefetch::Prefetch,
        st: &mut TierState,
        layer: usize,
        x: &WgpuTensor,
        down: &Mailbox,
        call: &MailboxCall,
        fuse_into: Option<&wgpu::Buffer>,
    ) -> Result<bool, OpError> {
        if crate::ab::is_b("prefetch") {
            return Ok(false);
        }
        let next = layer + 1;
        let Some(guess_router) = st.guess_routers.get(next).cloned().flatten() else { return Ok(false) };
        let row = st.host.row;
        if !pf.has_layer(next) {
            let Some(host) = st.host.layers.get(next).and_then(|h| h.as_ref()) else { return Ok(false) };
            let Some(&like) = host.mats.first() else { return Ok(false) };
            let (host_buffer, host_mats) = (host.buffer.clone(), host.mats.clone());
            let region = st.region(next, &tier.regions);
            let place = |slot: usize| tier.place_like(tier.slot_base(slot).1, &like);
            pf.register(next, &host_buffer, host_mats, region, &tier.pool[region], place, (next * row) as u32);
            if !pf.has_layer(next) {
                return Ok(false);
            }
        }
        let Some(table) = st.host.table_gpu.clone() else { return Ok(false) };
        let spec = &guess_router.spec;
        let guess_at = (DOWN_GUESS + call.slot * GUESS_WORDS) as u32;
        if let Some(routing) = fuse_into.filter(|_| super::prefetch::fuse_from_env()) {
            let words = [guess_at, (next * row) as u32, pf.per_call as u32];
            if self.fuse_route_guess(routing, &guess_router.router, &table, down.buffer(), words) {
                trace::mark("guess", Some(next));
                return Ok(true);
            }
        }
        let Some(guess) = self.router_route_gpu(x, &guess_router.router, None, spec, true, None)? else {
            return Ok(false);
        };
        self.dispatch(
            self.ctx.pipeline_with("moe_split_prefetch_pick", || PREFETCH_PICK.to_string(), true),
            &[&guess.weights.buf.buffer, &table, down.buffer()],
            &[spec.k as u32, spec.k as u32, (next * row) as u32, guess_at, call.seq, pf.per_call as u32, 0, 0],
            [1, 1, 1],
        );
        trace::mark("guess", Some(next));
        Ok(true)
    }

    /// The split's look-ahead, recorded between a decode layer's GPU share and its wait for the
    /// CPU's sum: the next layer's router applied to this layer's input `x` guesses its experts
    /// (the residual stream changes little over one layer: 97.9% of such guesses were right on
    /// the synthetic Qwen3-30B-A3B, `pager::guess`), and `moe_split_touch.wgsl` reads the host
    /// copies of those the next layer's partition would give the GPU until the CPU's flag is up.
    /// Why: in most layers the GPU's share ends first (`dispatched_gpu_first`) and the link idles
    /// while the GPU waits; lines read then sit in the GPU's L2 cache when the next layer's
    /// per-pair kernels read them, so its share takes less of the link and the RAM the CPU's
    /// job reads, and the balance moves misses from the CPU to the GPU. Reads only: results do
    /// not depend on it. Nothing is recorded for a layer with no router noted after it (the
    /// last, or the first step), a router the routing kernel cannot take, several tokens, without
    /// `DISKFORMER_SPLIT_TOUCH=1` (off by default: measured slower), or on odd decode steps under
    /// `DISKFORMER_AB=touch`.
    fn touch_next_layer(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        layer: usize,
        x: &WgpuTensor,
        up: &Mailbox,
        call: &MailboxCall,
    ) -> Result<(), OpError> {
        if !tier.split_touch || x.rows() != 1 || crate::ab::is_b("touch") {
            return Ok(());
        }
        let next = layer + 1;
        let Some(guess_router) = st.guess_routers.get(next).cloned().flatten() else { return Ok(()) };
        let Some((host, mats)) =
            st.host.layers.get(next).and_then(|h| h.as_ref()).and_then(|h| Some((h.buffer.clone(), *h.mats.first()?)))
        else {
            return Ok(());
        };
        let Some(table) = st.host.table_gpu.clone() else { return Ok(()) };
        let spec = &guess_router.spec;
        let Some(guess) = self.router_route_gpu(x, &guess_router.router, None, spec, true, None)? else {
            return Ok(());
        };
        let out = st
            .touch_out
            .get_or_insert_with(|| {
                self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("split look-ahead counts"),
                    size: 16,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                })
            })
            .clone();
        let words = |p: &super::Placed| (p.n_out * p.layout.row_words(p.k)) as u32;
        self.dispatch(
            // Workgroup memory written before it is read (invocation 0, before the barriers).
            self.ctx.pipeline_with("moe_split_touch", || TOUCH.to_string(), true),
            &[up.buffer(), &guess.weights.buf.buffer, &table, &host, &out],
            &[
                call.slot as u32,
                call.seq,
                spec.k as u32,
                spec.k as u32,
                (next * st.host.row) as u32,
                mats.gate.as_ref().map_or(0, words),
                words(&mats.up),
                words(&mats.down),
            ],
            [TOUCH_GROUPS, 1, 1],
        );
        trace::mark("touch", Some(next));
        lock(&tier.profile).split_touches += 1;
        Ok(())
    }

    /// Takes in what the dispatcher found of the layers it has taken since the last call: their
    /// selections counted, the CPU's experts in the statistics, and each layer's pool
    /// replacements made ([`Self::record_layer_refill`]), with up to
    /// [`DEFERRED_REFILLS_PER_CALL`] of the layers a step's start deferred; all of them in one
    /// submission. At a step's start (`at_step_start`) the replacements are deferred instead.
    /// At most `ExpertTier::split_refills_per_call` replacements a call (the rest of the layer
    /// whose replacements reach the limit are dropped: they come again at their next miss); the
    /// layers after it wait in the deferred queue.
    pub(super) fn take_decided(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        at_step_start: bool,
    ) -> Result<(), OpError> {
        let decided = std::mem::take(&mut *lock(&tier.dispatcher.decided));
        // Replacements on the copy queue (`ExpertTier::copy_refills`): those the GPU is past
        // submitted, those done put in the table. At a step's start the GPU has run everything.
        let last_call = st.split_mailboxes.as_ref().map(|m| m.seq);
        let gpu_past = if at_step_start { last_call } else { Some(tier.dispatcher.seen.load(Ordering::Acquire)) };
        let mut recorded = match gpu_past {
            Some(past) => self.advance_copies(tier, st, past)?,
            None => false,
        };
        st.host.copy_seq = if tier.copy_refills.is_some() && !crate::ab::is_b("copyq") {
            last_call.filter(|_| !at_step_start)
        } else {
            None
        };
        // The call's limit on replacements (`ExpertTier::split_refills_per_call`; none when they
        // go to the copy queue); the A/B arm `pace` records every layer's as before.
        st.host.call_refills_left = (!at_step_start
            && !crate::ab::is_b("pace")
            && tier.split_refills_per_call != usize::MAX
            && st.host.copy_seq.is_none())
        .then_some(tier.split_refills_per_call);
        for d in decided {
            self.note_selections_seen(tier, st, d.layer, &d.ids, Some(&d.missed));
            let s = &mut st.stats[d.layer];
            s.host_reads -= d.n_cpu as u64;
            s.cpu_computed += d.n_cpu as u64;
            {
                let mut prof = lock(&tier.profile);
                prof.split_misses += d.n_misses as u64;
                prof.split_cpu_experts += d.n_cpu as u64;
                prof.cpu_secs = tier.split.cpu_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
                prof.split_gpu_first = tier.split.gpu_first.load(Ordering::Relaxed);
                prof.split_joins = tier.split.joins.load(Ordering::Relaxed);
                prof.split_queued_secs = tier.split.queued_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
                prof.split_join_wait_secs = tier.split.join_wait_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
                prof.read_ahead_bytes = tier.split.read_ahead_bytes.load(Ordering::Relaxed);
                prof.read_ahead_experts = tier.split.read_ahead_experts.load(Ordering::Relaxed);
                prof.read_ahead_right = tier.split.read_ahead_right.load(Ordering::Relaxed);
                prof.read_ahead_guess_secs = tier.split.read_ahead_guess_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
                prof.read_ahead_secs = tier.split.read_ahead_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
                prof.read_ahead_gpu_guesses = tier.split.read_ahead_gpu_guesses.load(Ordering::Relaxed);
            }
            if at_step_start || st.host.call_refills_left == Some(0) {
                // Once per layer: a later call takes in all of the layer's misses then.
                if !st.host.deferred_refills.contains(&d.layer) {
                    st.host.deferred_refills.push_back(d.layer);
                }
            } else {
                recorded |= self.record_layer_refill(tier, st, d.layer)?;
            }
        }
        if !at_step_start {
            for _ in 0..DEFERRED_REFILLS_PER_CALL {
                if st.host.call_refills_left == Some(0) {
                    break;
                }
                let Some(layer) = st.host.deferred_refills.pop_front() else { break };
                recorded |= self.record_layer_refill(tier, st, layer)?;
            }
        }
        st.host.call_refills_left = None;
        st.host.copy_seq = None;
        if recorded {
            let mut p = lock(&self.ctx.pending);
            self.ctx.flush_locked(&mut p);
        }
        Ok(())
    }

    /// The replacements on the copy queue (`ExpertTier::copy_refills`) moved on: each whose
    /// eviction the GPU has run (it handed over a call after the one that recorded it, `past`) is
    /// submitted; each whose copy is done is put in the slot table, whose changed rows are
    /// recorded. True when it recorded a table write.
    fn advance_copies(&self, tier: &ExpertTier, st: &mut TierState, past: u32) -> Result<bool, OpError> {
        let Some(queue) = tier.copy_refills.clone() else { return Ok(false) };
        if st.pending_copies.is_empty() {
            return Ok(false);
        }
        let row = st.host.row;
        let mut changed: Option<(usize, usize)> = None;
        let mut kept = Vec::new();
        for mut c in std::mem::take(&mut st.pending_copies) {
            match c.ring {
                None => {
                    if (past.wrapping_sub(c.after_seq) as i32) >= 1 {
                        let host =
                            st.host.layers.get(c.layer).and_then(|h| h.as_ref()).and_then(|h| raw_buffer(&h.buffer));
                        let pool = raw_buffer(&tier.pool[tier.slot_base(c.slot).0]);
                        if let (Some(host), Some(pool)) = (host, pool) {
                            let regions = super::copy_regions(&c.host_mats, &c.mats);
                            c.ring = queue.copy_then_tag(host, pool, &regions, pool, &[]);
                        }
                    }
                    kept.push(c);
                }
                Some(i) if queue.done(i) => {
                    st.copying[c.slot] = false;
                    let (l, e) = (c.layer, c.expert);
                    if st.slot_of[l][e] == NO_SLOT && st.owner[c.slot] == Some((l as u32, e as u32)) {
                        st.slot_of[l][e] = c.slot as u32;
                        st.host.table[l * row + e] = super::table_entry(super::IN_POOL, &c.mats);
                        let at = l * row + e;
                        changed = Some(changed.map_or((at, at), |(lo, hi)| (lo.min(at), hi.max(at))));
                    } else if st.owner[c.slot] == Some((l as u32, e as u32)) {
                        // Placed elsewhere meanwhile (a prefill's uploads): the slot is free.
                        st.owner[c.slot] = None;
                    }
                }
                Some(_) => kept.push(c),
            }
        }
        st.pending_copies = kept;
        let Some((lo, hi)) = changed else { return Ok(false) };
        if st.host.table_dirty {
            self.write_slot_table(st)?;
        } else if let Some(table) = st.host.table_gpu.clone() {
            let bytes: &[u8] = bytemuck::cast_slice(&st.host.table[lo..=hi]);
            let staged = self.upload("expert slot table rows", bytes)?;
            self.copy(&staged.buffer, 0, &table, 16 * lo as u64, bytes.len() as u64);
        }
        Ok(true)
    }

    /// Between steps: waits until the dispatcher has taken every layer handed to it (the host
    /// has read the step's output, so the GPU has written every flag), then takes in what it
    /// found, its replacements deferred to the step's split calls. A layer it could not take
    /// (the GPU gave no flag in [`HOST_WAIT`]) left its error.
    ///
    /// Why deferred: the host runs ~13 layers ahead of the GPU, so at a step's end the
    /// dispatcher holds the last ~13 layers' findings. Their replacements made here took
    /// ~0.8 ms of host time on the H200 (a submission per layer) while the GPU, waiting for the
    /// step's first layer, idled (twentieth session's trace); a few per split call fit in the
    /// host's lead instead.
    pub(super) fn settle_dispatcher(&self, tier: &ExpertTier, st: &mut TierState) -> Result<(), OpError> {
        let t0 = Instant::now();
        while !tier.dispatcher.idle() {
            if t0.elapsed() > HOST_WAIT + std::time::Duration::from_secs(1) {
                return Err(OpError::Unsupported {
                    op: "moe_ffn (split)",
                    backend: "wgpu",
                    why: format!("the split's dispatcher still had layers after {HOST_WAIT:?}"),
                });
            }
            if rayon::yield_now().is_none() {
                std::thread::yield_now();
            }
        }
        self.take_decided(tier, st, tier.split_defer_refills)?;
        if let Some(e) = lock(&self.ctx.deferred_error).take() {
            return Err(e);
        }
        Ok(())
    }

    /// The layer's expert biases on the host, read back on its first split call.
    fn split_host_biases(&self, st: &mut TierState, experts: &Experts<Self>) -> Result<Arc<HostBiases>, OpError> {
        let layer = experts.layer;
        if let Some(Some(b)) = st.split_biases.get(layer) {
            return Ok(b.clone());
        }
        let bias = |b: &Option<WgpuTensor>| b.as_ref().map(|b| self.to_host(b)).transpose();
        let b = Arc::new(HostBiases {
            gate: bias(&experts.gate_bias)?,
            up: bias(&experts.up_bias)?,
            down: bias(&experts.down_bias)?,
        });
        if st.split_biases.len() <= layer {
            st.split_biases.resize(layer + 1, None);
        }
        st.split_biases[layer] = Some(b.clone());
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `add_rms_norm` after the split's `mailbox_wait_add` (the last pending command) fuses into
    /// it, and writes what the ops apart would: the wait's own sum (the GPU's share plus the
    /// CPU's from the mailbox), the residual added, the norm of that within f32 rounding of the
    /// host's, and int8 blocks equal to a quantization of the normed row; a width that is not
    /// whole blocks writes none, and a width past one workgroup's 256 values still normalizes the
    /// whole row. Run on any adapter (lavapipe in CI, where the split never uses mailboxes: the
    /// mailboxes here are plain storage buffers written before the dispatch).
    #[test]
    fn fused_wait_add_norm_writes_what_the_ops_apart_write() {
        use crate::backend::Backend;
        let Ok(g) = WgpuBackend::new(crate::wgpu::WgpuOptions { adapter_index: None, prefer_discrete: true }) else {
            eprintln!("no GPU adapter: skipped");
            return;
        };
        let g = g.with_matmul_mode(crate::quant::MatmulMode::QuantizedActivations);
        let mut next = crate::test_uniform();
        for width in [2048usize, 96, 40] {
            let mut v = |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| scale * next()).collect() };
            let (rv, yv, uv, wv) = (v(width, 3.0), v(width, 1.0), v(width, 1.0), v(width, 1.5));
            let (r, y, w) = (
                g.from_host(&rv, &[1, width]).unwrap(),
                g.from_host(&yv, &[1, width]).unwrap(),
                g.from_host(&wv, &[width]).unwrap(),
            );
            let (flag_at, data_at, seq) = (1usize, 16usize, 5u32);
            let mut up_words = vec![0u32; data_at + width];
            up_words[flag_at] = seq;
            for (i, x) in uv.iter().enumerate() {
                up_words[data_at + i] = x.to_bits();
            }
            let up = g.upload("test up mailbox", bytemuck::cast_slice(&up_words)).unwrap();
            let down = g.alloc_bytes("test down mailbox", 64).unwrap();
            let out = g.alloc("test wait_add", &[1, width]).unwrap();
            // The uploads submitted first: the wait is then the only pending command, as in a
            // decode step (the split submits the GPU's share before recording it).
            g.to_host(&w).unwrap();
            g.dispatch(
                g.wait_add_pipeline(false),
                &[&up.buffer, &y.buf.buffer, &out.buf.buffer, &down.buffer],
                &[flag_at as u32, data_at as u32, width as u32, seq, 1000, 2, 4, 0, 0, 0, 0, 0],
                [width.div_ceil(2048) as u32, 1, 1],
            );
            // As the split does: the GPU's share freed once recorded (its buffer back in the
            // pool, where the fused outputs would find it).
            drop(y);
            let eps = 1e-6f32;
            let (sum, h) = g.add_rms_norm(&r, &out, Some(&w), eps).unwrap();
            let fused = g.wait_add_pipeline(true);
            let last_is_fused = matches!(lock(&g.ctx.pending).cmds.last(),
                Some(crate::wgpu::Cmd::Dispatch { pipeline, .. }) if std::sync::Arc::ptr_eq(pipeline, &fused));
            assert!(last_is_fused, "width {width}: the add and the norm must fuse into the wait");
            let whole_blocks = width % 32 == 0;
            let blocks = whole_blocks.then(|| g.q8_blocks(&h));
            let (out_v, sum_v, h_v) = (g.to_host(&out).unwrap(), g.to_host(&sum).unwrap(), g.to_host(&h).unwrap());
            let want_out: Vec<f32> = yv.iter().zip(&uv).map(|(a, b)| a + b).collect();
            assert_eq!(out_v, want_out, "width {width}: the wait's own sum");
            let want_sum: Vec<f32> = rv.iter().zip(&want_out).map(|(a, b)| a + b).collect();
            assert_eq!(sum_v, want_sum, "width {width}: the residual added");
            let ms = want_sum.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>() / width as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            for (i, (&got, (&x, &wt))) in h_v.iter().zip(want_sum.iter().zip(&wv)).enumerate() {
                let want = x as f64 * inv * wt as f64;
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "width {width}: h[{i}] {got} vs {want}"
                );
            }
            if let Some((qs, ds)) = blocks {
                let n_blocks = width / 32;
                let read = |b: &wgpu::Buffer, bytes: usize| g.read_back(b, bytes as u64).unwrap();
                let (got_qs, got_ds) = (read(&qs, width), read(&ds, 8 * n_blocks));
                let again = g.from_host(&h_v, &[1, width]).unwrap();
                let want = g.quantize_activations(&again).unwrap().expect("int8 activations on");
                assert_eq!(got_qs, read(&want.qs.buffer, width), "width {width}: int8 values");
                assert_eq!(got_ds, read(&want.ds.buffer, 8 * n_blocks), "width {width}: block scales");
            }
        }
    }

    /// The rule worked by hand: distinct misses keyed by (pairs, id), the smallest
    /// `(n_miss * share_q + 128) / 256` to the CPU.
    #[test]
    fn cpu_takes_the_misses_with_fewest_pairs_then_lowest_ids() {
        let miss_all = |_: u32| true;
        // Four distinct ids, 3 misses (5 hits): half of 3 rounds to 2, the two lowest ids.
        assert_eq!(cpu_misses(&[5, 3, 9, 1], |e| e != 5, 128), vec![1, 3]);
        // Expert 7 has two pairs: it comes last whatever its id.
        assert_eq!(cpu_misses(&[7, 7, 2, 4], miss_all, 128), vec![2, 4]);
        assert_eq!(cpu_misses(&[7, 7, 2, 4], miss_all, 256), vec![2, 4, 7]);
        assert_eq!(cpu_misses(&[7, 7, 2, 4], miss_all, 100), vec![2]);
        assert!(cpu_misses(&[7, 7, 2, 4], miss_all, 0).is_empty());
        // No misses, nothing to share.
        assert!(cpu_misses(&[1, 2], |_| false, 256).is_empty());
    }

    /// The share's rule toward a fraction of joins with the GPU done first: joins at exactly
    /// that fraction leave the share where it was, more GPU-first joins shrink it, fewer grow it;
    /// 0.5 is the symmetric step.
    #[test]
    fn share_settles_where_the_gpu_is_first_in_the_target_fraction() {
        let after = |target: f64, gpu_first_every: usize, of: usize| {
            let s = SplitShared::default();
            for i in 0..100 {
                let gpu_done = i % of < gpu_first_every;
                let seen =
                    JoinSeen { gpu_done, waited: std::time::Duration::ZERO, taken_after: std::time::Duration::ZERO };
                s.joined_toward(seen, true, target);
            }
            assert_eq!(s.joins.load(Ordering::Relaxed), 100);
            s.share() - SHARE_START
        };
        assert!(after(0.8, 4, 5).abs() < 1e-9, "{}", after(0.8, 4, 5));
        assert!(after(0.8, 9, 10) < -0.01, "{}", after(0.8, 9, 10));
        assert!(after(0.8, 1, 2) > 0.1, "{}", after(0.8, 1, 2));
        assert!(after(0.5, 1, 2).abs() < 1e-9);
        // With the symmetric step, 60 GPU-first joins of 100 shrink it by 20 steps.
        assert!((after(0.5, 3, 5) + 20.0 * SHARE_STEP).abs() < 1e-9, "{}", after(0.5, 3, 5));
    }

    #[test]
    fn share_rounds_to_256ths_within_bounds() {
        assert_eq!(share_in_256ths(0.5), 128);
        assert_eq!(share_in_256ths(0.02), 5);
        assert_eq!(share_in_256ths(-1.0), 0);
        assert_eq!(share_in_256ths(2.0), 256);
    }

    /// f32 experts of one layer (gate and up `[n_ff, n_embd]`, down `[n_embd, n_ff]`), failing
    /// every read of the layers in `fail_layers` as a disk would.
    #[derive(Debug)]
    struct F32Store {
        n_embd: usize,
        n_ff: usize,
        gate: Vec<Vec<f32>>,
        up: Vec<Vec<f32>>,
        down: Vec<Vec<f32>>,
        fail_layers: Vec<usize>,
    }

    impl crate::backend::ExpertStore for F32Store {
        fn with_host_experts(
            &self,
            layer: usize,
            ids: &[u32],
            compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
        ) -> Result<(), OpError> {
            if self.fail_layers.contains(&layer) {
                return Err(OpError::Unsupported { op: "store", backend: "test", why: "disk unplugged".into() });
            }
            fn m(v: &[f32], n_out: usize, k: usize) -> crate::backend::HostMatrix<'_> {
                crate::backend::HostMatrix { dtype: gguf::GgmlType::F32, bytes: bytemuck::cast_slice(v), n_out, k }
            }
            let (n_embd, n_ff) = (self.n_embd, self.n_ff);
            let experts: Vec<HostExpert<'_>> = ids
                .iter()
                .map(|&e| {
                    let e_ = e as usize;
                    HostExpert {
                        id: e,
                        gate: Some(m(&self.gate[e_], n_ff, n_embd)),
                        up: m(&self.up[e_], n_ff, n_embd),
                        down: m(&self.down[e_], n_embd, n_ff),
                    }
                })
                .collect();
            compute(&experts)
        }
    }

    /// The dispatcher against a thread playing the GPU, through mailboxes in host memory: the
    /// GPU hands over a call's routing and hidden state, then (as its queue would) waits for
    /// the CPU's sum before handing over the next. Each sum must be the CPU's experts (the
    /// partition rule on the misses of the call's snapshot) computed by hand in f32; a call
    /// whose store fails or whose ids are out of range must still get its flag, with zeros, and
    /// leave its error; the share's rule must count the GPU's marker; every call that got its
    /// ids must come back for the host's bookkeeping, in order.
    #[test]
    fn dispatcher_answers_each_hand_over_in_order() {
        let (n_embd, n_ff, n_expert, k) = (32usize, 16usize, 8usize, 4usize);
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mat = |rnd: &mut dyn FnMut() -> f32, n: usize| (0..n).map(|_| rnd()).collect::<Vec<f32>>();
        let store = Arc::new(F32Store {
            n_embd,
            n_ff,
            gate: (0..n_expert).map(|_| mat(&mut rnd, n_ff * n_embd)).collect(),
            up: (0..n_expert).map(|_| mat(&mut rnd, n_ff * n_embd)).collect(),
            down: (0..n_expert).map(|_| mat(&mut rnd, n_embd * n_ff)).collect(),
            fail_layers: vec![3],
        });
        // The reference: silu(gate · x) * (up · x), then down, weighted, summed, in f64.
        let expert_out = |e: usize, x: &[f32]| -> Vec<f64> {
            let dot = |row: &[f32], v: &[f64]| row.iter().zip(v).map(|(&a, &b)| a as f64 * b).sum::<f64>();
            let xd: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let h: Vec<f64> = (0..n_ff)
                .map(|r| {
                    let g = dot(&store.gate[e][r * n_embd..(r + 1) * n_embd], &xd);
                    let u = dot(&store.up[e][r * n_embd..(r + 1) * n_embd], &xd);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            (0..n_embd).map(|r| dot(&store.down[e][r * n_ff..(r + 1) * n_ff], &h)).collect()
        };

        struct Call {
            layer: usize,
            ids: Vec<u32>,
            weights: Vec<f32>,
            x: Vec<f32>,
            missed: Vec<bool>,
            share_q: u32,
            gpu_done_first: bool,
            failed: Arc<std::sync::Mutex<Option<OpError>>>,
        }
        // Layers 0..6: layer 3's store fails, layer 5 names expert 99 of 8, layer 4 gives the
        // CPU no share; odd layers' GPU shares are done before the CPU's.
        let calls: Vec<Call> = (0..6)
            .map(|layer| {
                let mut ids: Vec<u32> = vec![(layer % n_expert) as u32, 2, 5, 7];
                if layer == 5 {
                    ids[1] = 99;
                }
                Call {
                    layer,
                    ids,
                    weights: (0..k).map(|_| rnd() + 0.6).collect(),
                    x: mat(&mut rnd, n_embd),
                    missed: (0..n_expert).map(|e| e % 3 != layer % 3).collect(),
                    share_q: if layer == 4 { 0 } else { 128 + 40 * (layer as u32 % 3) },
                    gpu_done_first: layer % 2 == 1,
                    failed: Arc::default(),
                }
            })
            .collect();

        let words = 2 * k + n_embd;
        let up = Arc::new(Mailbox::in_host_memory(MAILBOX_DATA + MAILBOX_SLOTS * words));
        let down = Arc::new(Mailbox::in_host_memory(MAILBOX_DATA + MAILBOX_SLOTS * words));
        let shared = Arc::new(SplitShared::default());
        let dispatcher = Arc::new(Dispatcher::default());
        let biases = Arc::new(HostBiases { gate: None, up: None, down: None });
        let spec = MoeSpec { n_expert, n_ff, glu: crate::spec::Glu::Plain(crate::spec::Act::Silu) };
        let place = |c: usize| {
            let seq = c as u32 + 1;
            let slot = seq as usize % MAILBOX_SLOTS;
            (seq, slot, MAILBOX_DATA + slot * words)
        };
        // Handed over before the GPU has written anything: the dispatcher waits for each flag.
        for (c, call) in calls.iter().enumerate() {
            let (seq, slot, data_at) = place(c);
            dispatcher.push(Handoff {
                seq,
                slot,
                data_at,
                up: up.clone(),
                down: down.clone(),
                layer: call.layer,
                n: 1,
                n_embd,
                k,
                missed: call.missed.clone(),
                share_q: call.share_q,
                adapt: false,
                store: store.clone(),
                biases: biases.clone(),
                spec,
                mode: crate::quant::MatmulMode::Exact,
                shared: shared.clone(),
                failed: call.failed.clone(),
                prefetch: None,
                guessed: false,
                gpu_guess: false,
            });
        }
        // The GPU: a call's hand-over only after the previous call's sum (queue order).
        let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
            s.spawn(|| {
                let mut sums = Vec::new();
                for (c, call) in calls.iter().enumerate() {
                    let (seq, slot, data_at) = place(c);
                    let mut data: Vec<u32> = call.weights.iter().map(|w| w.to_bits()).collect();
                    data.extend(&call.ids);
                    data.extend(call.x.iter().map(|v| v.to_bits()));
                    down.write(data_at, &data);
                    if call.gpu_done_first {
                        down.store(DOWN_GPU_DONE + slot, seq);
                    }
                    down.store(slot, seq);
                    up.wait_for(slot, seq, std::time::Duration::from_secs(30)).expect("the CPU's flag within 30 s");
                    let mut sum = vec![0u32; n_embd];
                    up.read(data_at, &mut sum);
                    sums.push(sum.iter().map(|&b| f32::from_bits(b)).collect());
                }
                sums
            })
            .join()
            .expect("the GPU's thread")
        });

        let t0 = Instant::now();
        while !dispatcher.idle() {
            assert!(t0.elapsed().as_secs() < 30, "the dispatcher still busy after every flag");
            std::thread::yield_now();
        }
        let mut want_joins = 0;
        let mut want_gpu_first = 0;
        for (c, call) in calls.iter().enumerate() {
            let got = &sums[c];
            let err = lock(&call.failed).take();
            match call.layer {
                3 | 5 => {
                    assert!(got.iter().all(|&v| v == 0.0), "layer {}: zeros after a failure, got {got:?}", call.layer);
                    let e = err.unwrap_or_else(|| panic!("layer {}: no error left", call.layer)).to_string();
                    let expect = if call.layer == 3 { "disk unplugged" } else { "99" };
                    assert!(e.contains(expect), "layer {}: {e}", call.layer);
                }
                _ => {
                    assert!(err.is_none(), "layer {}: {err:?}", call.layer);
                    let cpu = cpu_misses(&call.ids, |e| call.missed[e as usize], call.share_q);
                    if call.layer == 4 {
                        assert!(cpu.is_empty());
                    }
                    let mut want = vec![0f64; n_embd];
                    for &e in &cpu {
                        let w = call.weights[call.ids.iter().position(|&i| i == e).unwrap()] as f64;
                        for (o, v) in want.iter_mut().zip(expert_out(e as usize, &call.x)) {
                            *o += w * v;
                        }
                    }
                    for (r, (&g, &w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                            "layer {} row {r}: {g} vs {w}",
                            call.layer
                        );
                    }
                    if !cpu.is_empty() {
                        want_joins += 1;
                        want_gpu_first += call.gpu_done_first as u64;
                    }
                }
            }
        }
        assert_eq!(shared.joins.load(Ordering::Relaxed), want_joins, "a join per CPU job");
        assert_eq!(shared.gpu_first.load(Ordering::Relaxed), want_gpu_first, "the GPU's marker read at each join");
        let decided = std::mem::take(&mut *lock(&dispatcher.decided));
        let layers: Vec<usize> = decided.iter().map(|d| d.layer).collect();
        assert_eq!(layers, vec![0, 1, 2, 3, 4], "every call with valid ids, in order (not layer 5's)");
        for d in &decided {
            let call = &calls[d.layer];
            assert_eq!(d.ids, call.ids);
            assert_eq!(d.n_cpu, cpu_misses(&call.ids, |e| call.missed[e as usize], call.share_q).len());
        }
    }

    /// The partition kernel parses and validates (naga) at the per-pair kernels' pair limit.
    #[test]
    fn partition_kernel_validates() {
        crate::wgpu::shaders::tests::parse("moe_split_partition", &partition_source(false));
        crate::wgpu::shaders::tests::parse("moe_split_partition_prefetch", &partition_source(true));
        crate::wgpu::shaders::tests::parse("moe_split_prefetch_pick", PREFETCH_PICK);
        crate::wgpu::shaders::tests::parse("moe_split_prefetch_patch", &prefetch_patch_source());
    }

    /// The partition's prefetch variant and the patch (`prefetch.rs`): the experts announced for
    /// this call (in the words `prefetch::announcement` writes) are the GPU's, so the CPU's share
    /// is taken from the other misses by the host's rule (`cpu_misses` with them excluded); with
    /// two passes their pairs leave the first pass's ids for the second pass's (an announced pool
    /// hit stays in the first), with one they stay in the first. The patch (with one pass, the
    /// partition itself) points an announced miss whose tag holds its value at its staging slot
    /// in the per-pair kernels' table, keeps one whose tag does not at its own entry (host
    /// memory), and counts one landed and one late. An announcement for another call (sequence number) or
    /// another layer (first table entry) is ignored by both.
    #[test]
    fn announced_misses_go_to_the_second_pass_and_landed_ones_to_staging() {
        use super::super::prefetch::{announcement, Entry, STAT_LANDED, STAT_LATE};
        let Ok(g) = WgpuBackend::new(crate::wgpu::WgpuOptions { adapter_index: None, prefer_discrete: true }) else {
            eprintln!("no GPU adapter: skipped");
            return;
        };
        let (row, slots_at) = (16usize, 16usize);
        let pooled = [2u32, 9];
        let mut table = vec![[7u32, 1, 2, 3]; slots_at];
        for e in 0..row as u32 {
            table.push([u32::from(!pooled.contains(&e)), 100 + e, 200 + e, 300 + e]);
        }
        let ids = [3u32, 9, 12, 5, 7, 2, 14, 0];
        let share_q = 128u32;
        let layout = crate::wgpu::layout::TypeLayout::for_weight(gguf::GgmlType::Q8_0, 32).unwrap();
        let placed = |word0: usize| super::super::Placed { layout, n_out: 1, k: 32, word0 };
        let staging = |w: usize| SlotMats { gate: Some(placed(w)), up: placed(w + 100), down: placed(w + 200) };
        let entries = [
            Entry { expert: 12, staging: staging(1000), tag_word: 4, tag: 77 },
            Entry { expert: 5, staging: staging(2000), tag_word: 5, tag: 78 },
            Entry { expert: 9, staging: staging(3000), tag_word: 6, tag: 79 },
        ];
        // Tags: 12's copy landed, 5's did not, 9's landed (but 9 is in the pool).
        let tags_now = [0u32, 0, 0, 0, 77, 3, 79, 0];
        let (pf_at, seq) = (20usize, 11u32);
        let upload = |label, words: &[u32]| g.upload(label, bytemuck::cast_slice(words)).unwrap();
        let (ids_buf, s_buf) = (upload("test ids", &ids), upload("test slot table", table.as_flattened()));
        for (announced_seq, announced_at, used, two_pass) in [
            (seq, slots_at as u32, true, 1u32),
            (seq, slots_at as u32, true, 0),
            (seq - 1, slots_at as u32, false, 1),
            (seq, 0, false, 1),
        ] {
            let mut upm = vec![0u32; 64];
            let words = announcement(announced_seq, announced_at, &entries);
            upm[pf_at..pf_at + words.len()].copy_from_slice(&words);
            let (upm, tags) = (upload("test up mailbox", &upm), upload("test tags", &tags_now));
            let (out, late) = (upload("test ids out", &[0; 8]), upload("test late ids", &[0; 8]));
            let s2 = upload("test pair table", &[0; 4 * 16]);
            // One pass: the partition writes the table row itself; two: the patch kernel does.
            let patch_row = if two_pass == 1 { 0 } else { row as u32 };
            g.dispatch(
                g.ctx.pipeline_with("moe_split_partition_prefetch", || partition_source(true), true),
                &[&ids_buf.buffer, &s_buf.buffer, &out.buffer, &upm.buffer, &late.buffer, &tags.buffer, &s2.buffer],
                &[8, 0, slots_at as u32, share_q, pf_at as u32, seq, two_pass, patch_row, STAT_LANDED as u32, 0, 0, 0],
                [1, 1, 1],
            );
            if two_pass == 1 {
                g.dispatch(
                    g.ctx.pipeline_with("moe_split_prefetch_patch", prefetch_patch_source, true),
                    &[&s_buf.buffer, &upm.buffer, &tags.buffer, &s2.buffer],
                    &[slots_at as u32, pf_at as u32, seq, row as u32, STAT_LANDED as u32, 0, 0, 0],
                    [1, 1, 1],
                );
            }
            let announced: Vec<u32> = if used { vec![12, 5, 9] } else { Vec::new() };
            let is_miss = |e: u32| !pooled.contains(&e);
            let cpu = cpu_misses(&ids, |e| is_miss(e) && !announced.contains(&e), share_q);
            assert_eq!(cpu, if used { vec![0, 3] } else { vec![0, 3, 5] }, "the host's rule");
            let second = |e: u32| is_miss(e) && announced.contains(&e);
            // One pass (`two_pass` 0): the announced misses stay in the first pass's ids.
            let want_first: Vec<u32> =
                ids.iter().map(|&e| if cpu.contains(&e) || (second(e) && two_pass == 1) { SKIP } else { e }).collect();
            let want_second: Vec<u32> = ids.iter().map(|&e| if second(e) { e } else { SKIP }).collect();
            assert_eq!(le_u32s(&g.read_back(&out.buffer, 32).unwrap()), want_first, "first pass, announced {used}");
            assert_eq!(le_u32s(&g.read_back(&late.buffer, 32).unwrap()), want_second, "second pass, announced {used}");
            let mut want_s2: Vec<u32> = table[slots_at..].as_flattened().to_vec();
            if used {
                want_s2[4 * 12..4 * 13].copy_from_slice(&[0, 1000, 1100, 1200]);
            }
            assert_eq!(le_u32s(&g.read_back(&s2.buffer, 256).unwrap()), want_s2, "second table, announced {used}");
            let counts = le_u32s(&g.read_back(&tags.buffer, 32).unwrap());
            let want = if used { [1, 1] } else { [0, 0] };
            assert_eq!([counts[STAT_LANDED], counts[STAT_LATE]], want, "landed and late, announced {used}");
        }
    }

    /// The prefetch's pick writes the first guessed experts the table puts in host memory, best
    /// first and at most `max_n`, their count, and then the call's number.
    #[test]
    fn pick_writes_the_first_guessed_host_experts_then_the_flag() {
        let Ok(g) = WgpuBackend::new(crate::wgpu::WgpuOptions { adapter_index: None, prefer_discrete: true }) else {
            eprintln!("no GPU adapter: skipped");
            return;
        };
        let (row, slots_at, k) = (16usize, 16usize, 8usize);
        let mut table = vec![[1u32, 0, 0, 0]; slots_at];
        for e in 0..row as u32 {
            table.push([u32::from(e != 9 && e != 3), 0, 0, 0]);
        }
        let mut guess = vec![0u32; k];
        guess.extend([3u32, 9, 12, 5, 7, 2, 14, 0]);
        let upload = |label, words: &[u32]| g.upload(label, bytemuck::cast_slice(words)).unwrap();
        let (g_buf, s_buf) = (upload("test guess", &guess), upload("test slot table", table.as_flattened()));
        for max_n in [2u32, 4] {
            let down = upload("test down mailbox", &[0; 32]);
            g.dispatch(
                g.ctx.pipeline_with("moe_split_prefetch_pick", || PREFETCH_PICK.to_string(), true),
                &[&g_buf.buffer, &s_buf.buffer, &down.buffer],
                &[k as u32, k as u32, slots_at as u32, 16, 5, max_n, 0, 0],
                [1, 1, 1],
            );
            let got = le_u32s(&g.read_back(&down.buffer, 128).unwrap());
            let want: &[u32] = if max_n == 2 { &[5, 2, 12, 5] } else { &[5, 4, 12, 5, 7, 2] };
            assert_eq!(&got[16..16 + want.len()], want, "max {max_n}");
        }
    }

    /// The look-ahead kernel reads exactly the guessed experts the slot table places in host
    /// memory (the pooled one and the unguessed ones not at all), one word in eight of each of
    /// their three matrices taken end to end, over several rounds and workgroups; and nothing
    /// once the CPU's flag is up. What it read is checked by count and by the XOR of the words,
    /// worked out here from the table. Run on any adapter (lavapipe in CI).
    #[test]
    fn touch_reads_the_guessed_host_experts_until_the_flag() {
        let Ok(g) = WgpuBackend::new(crate::wgpu::WgpuOptions { adapter_index: None, prefer_discrete: true }) else {
            eprintln!("no GPU adapter: skipped");
            return;
        };
        let (n_expert, k) = (16usize, 4usize);
        let (gate_words, up_words, down_words) = (1000usize, 1000usize, 1500usize);
        let per = gate_words + up_words + down_words;
        let mut next = crate::test_uniform();
        let wh: Vec<u32> = (0..n_expert * per + 64).map(|_| next().to_bits()).collect();
        // The layer's entries start at `slots_at`; the entries before it belong to another layer.
        let slots_at = 16usize;
        let pooled = 9u32;
        let mut table = vec![[7u32, 0, 0, 0]; slots_at];
        for e in 0..n_expert {
            // Each expert's matrices placed out of order in the host buffer, as words.
            let base = (n_expert - 1 - e) * per + 3;
            let host = u32::from(e as u32 != pooled);
            table.push([host, (base + up_words) as u32, base as u32, (base + up_words + gate_words) as u32]);
        }
        let ids = [3u32, pooled, 12, 5];
        let mut guess = vec![0u32; k];
        guess.extend_from_slice(&ids);
        let want = {
            let mut list: Vec<u32> = ids.iter().copied().filter(|&e| e != pooled).collect();
            list.sort_unstable_by(|a, b| b.cmp(a));
            let mut count = 0u32;
            let mut xor = 0u32;
            for v in (0..list.len() * per).step_by(8) {
                let t = table[slots_at + list[v / per] as usize];
                let o = v % per;
                let at = if o < gate_words {
                    t[1] as usize + o
                } else if o < gate_words + up_words {
                    t[2] as usize + o - gate_words
                } else {
                    t[3] as usize + o - gate_words - up_words
                };
                count += 1;
                xor ^= wh[at];
            }
            [count, xor]
        };
        let (flag_at, seq) = (1usize, 7u32);
        let upload = |label, words: &[u32]| g.upload(label, bytemuck::cast_slice(words)).unwrap();
        let (wh_buf, g_buf) = (upload("test host experts", &wh), upload("test guess", &guess));
        let s_buf = upload("test slot table", table.as_flattened());
        for (flag, groups) in [(0u32, 1u32), (0, 3), (seq, 2)] {
            let mut up = vec![0u32; 4];
            up[flag_at] = flag;
            let up = upload("test up mailbox", &up);
            let out = upload("test touch counts", &[0, 0, 0, 0]);
            g.dispatch(
                g.ctx.pipeline_with("moe_split_touch", || TOUCH.to_string(), true),
                &[&up.buffer, &g_buf.buffer, &s_buf.buffer, &wh_buf.buffer, &out.buffer],
                &[
                    flag_at as u32,
                    seq,
                    k as u32,
                    k as u32,
                    slots_at as u32,
                    gate_words as u32,
                    up_words as u32,
                    down_words as u32,
                ],
                [groups, 1, 1],
            );
            let got = le_u32s(&g.read_back(&out.buffer, 8).unwrap());
            let want = if flag == seq { [0, 0] } else { want };
            assert_eq!(got, want, "flag {flag}, {groups} workgroups: words read and their XOR");
        }
    }

    /// A store that guesses fixed experts and, asked to read ahead, records what it was asked
    /// and polls `stop` until it says so (or 10 s pass).
    #[derive(Debug, Default)]
    struct GuessingStore {
        guess: Vec<u32>,
        guessed_from: std::sync::Mutex<Vec<(usize, Vec<f32>)>>,
        read: std::sync::Mutex<Vec<(usize, Vec<u32>, bool)>>,
    }

    impl crate::backend::ExpertStore for GuessingStore {
        fn with_host_experts(
            &self,
            _layer: usize,
            _ids: &[u32],
            _compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
        ) -> Result<(), OpError> {
            unreachable!("read_ahead computes nothing")
        }

        fn guess_experts(&self, layer: usize, x: &[f32], _k: usize) -> Vec<u32> {
            lock(&self.guessed_from).push((layer, x.to_vec()));
            self.guess.clone()
        }

        fn read_ahead(&self, layer: usize, ids: &[u32], _threads: usize, stop: &(dyn Fn() -> bool + Sync)) -> u64 {
            let t0 = Instant::now();
            while !stop() && t0.elapsed().as_secs() < 10 {
                std::thread::yield_now();
            }
            lock(&self.read).push((layer, ids.to_vec(), stop()));
            1000
        }
    }

    /// Call 7 (slot 1) of decode layer `layer` for the read-ahead tests: 8 values a row, 16
    /// experts, top 4, the CPU's share 171/256; 3 hits (the pool holds every third expert), of
    /// the store's guess 9, 12 and 6 miss.
    fn read_ahead_handoff(
        layer: usize,
        down: &Arc<Mailbox>,
        store: &Arc<GuessingStore>,
        shared: &Arc<SplitShared>,
    ) -> Handoff {
        let n_expert = 16;
        Handoff {
            seq: 7,
            slot: 1,
            data_at: MAILBOX_DATA,
            up: Arc::new(Mailbox::in_host_memory(MAILBOX_DATA + MAILBOX_SLOTS * 64)),
            down: down.clone(),
            layer,
            n: 1,
            n_embd: 8,
            k: 4,
            missed: (0..n_expert).map(|e| e % 3 != 0 || e == 12 || e == 6 || e == 9).collect(),
            share_q: 171,
            adapt: false,
            store: store.clone(),
            biases: Arc::new(HostBiases { gate: None, up: None, down: None }),
            spec: MoeSpec { n_expert, n_ff: 4, glu: crate::spec::Glu::Plain(crate::spec::Act::Silu) },
            mode: crate::quant::MatmulMode::Exact,
            shared: shared.clone(),
            failed: Arc::default(),
            prefetch: None,
            guessed: false,
            gpu_guess: false,
        }
    }

    /// The read-ahead tests' store (guessing experts 9, 3, 12, 6), down mailbox and shared state.
    fn read_ahead_fixture() -> (Arc<GuessingStore>, Arc<Mailbox>, Arc<SplitShared>) {
        let store = Arc::new(GuessingStore { guess: vec![9, 3, 12, 6], ..Default::default() });
        let down = Arc::new(Mailbox::in_host_memory(MAILBOX_DATA + MAILBOX_SLOTS * 64));
        (store, down, Arc::new(SplitShared::default()))
    }

    /// While a layer's hand-over is not there, the dispatcher guesses its experts from the
    /// previous layer's input, reads ahead the CPU's of them (the partition's rule on the
    /// layer's table and share) and stops at the hand-over's flag; it guesses nothing from a
    /// later layer's input (the previous step's) or without an input.
    #[test]
    fn read_ahead_reads_the_cpus_guessed_experts_until_the_hand_over() {
        let n_embd = 8usize;
        let (store, down, shared) = read_ahead_fixture();
        let handoff = |layer: usize| read_ahead_handoff(layer, &down, &store, &shared);
        let dispatcher = Dispatcher::default();
        let x: Vec<f32> = (0..n_embd).map(|i| i as f32 * 0.25).collect();

        // No input kept yet: nothing guessed.
        assert!(dispatcher.read_ahead(&handoff(5), 2).is_empty());
        // The previous step's last layer: nothing guessed.
        *lock(&dispatcher.last_input) = Some((5, x.clone()));
        assert!(dispatcher.read_ahead(&handoff(5), 2).is_empty());
        assert!(lock(&store.guessed_from).is_empty());

        *lock(&dispatcher.last_input) = Some((4, x.clone()));
        let h = handoff(5);
        let picked = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(30));
                down.store(1, 7);
            });
            dispatcher.read_ahead(&h, 2)
        });
        // Of the misses 6, 9, 12 the CPU takes round(3 * 171 / 256) = 2: the lowest ids.
        assert_eq!(picked, vec![6, 9]);
        assert_eq!(picked, cpu_misses(&store.guess, |e| h.missed[e as usize], 171));
        assert_eq!(*lock(&store.guessed_from), vec![(5, x)]);
        assert_eq!(*lock(&store.read), vec![(5, vec![6, 9], true)], "read ahead until the flag");
        assert_eq!(shared.read_ahead_bytes.load(Ordering::Relaxed), 1000);
        // The input is used once; no threads, no read.
        assert!(lock(&dispatcher.last_input).is_none());
        *lock(&dispatcher.last_input) = Some((4, vec![0.0; n_embd]));
        assert!(dispatcher.read_ahead(&h, 0).is_empty());
        assert_eq!(lock(&store.guessed_from).len(), 1);
    }

    /// Where the previous call's routing kernel guessed this layer (its guess area holds the
    /// call's number), the read-ahead takes that guess and does not guess on the CPU; where the
    /// area holds another call's number, or the guess was for another layer, it guesses on the
    /// CPU from the kept input as before.
    #[test]
    fn read_ahead_takes_the_routing_kernels_guess_when_it_is_there() {
        let n_embd = 8usize;
        let (store, down, shared) = read_ahead_fixture();
        let h = read_ahead_handoff(5, &down, &store, &shared);
        // Call 6 (slot 0) guessed layer 5's misses 14, 10, 13, 2 (as the kernel writes them:
        // the ids and count, then the number); an id past the layer's experts is dropped.
        let at = DOWN_GUESS;
        down.write(at + 1, &[5, 14, 10, 13, 2, 99]);
        down.store(at, 6);
        down.store(1, 7);
        let dispatcher = Dispatcher::default();
        let x: Vec<f32> = vec![0.5; n_embd];
        *lock(&dispatcher.last_input) = Some((4, x.clone()));
        *lock(&dispatcher.gpu_guess) = Some((5, 0, 6));
        // Of the guessed misses 2, 10, 13, 14 the CPU takes round(4 * 171 / 256) = 3.
        assert_eq!(dispatcher.read_ahead(&h, 2), vec![2, 10, 13]);
        assert!(lock(&store.guessed_from).is_empty(), "no guess on the CPU");
        assert_eq!(shared.read_ahead_gpu_guesses.load(Ordering::Relaxed), 1);
        assert!(lock(&dispatcher.gpu_guess).is_none(), "a guess is taken once");

        // A stale area (call 4's number) or another layer's guess: the CPU's guess.
        for (guess, area_seq) in [((5, 0, 6), 4), ((6, 0, 6), 6)] {
            down.store(at, area_seq);
            *lock(&dispatcher.last_input) = Some((4, x.clone()));
            *lock(&dispatcher.gpu_guess) = Some(guess);
            assert_eq!(dispatcher.read_ahead(&h, 2), vec![6, 9], "guess {guess:?}, area of call {area_seq}");
        }
        assert_eq!(lock(&store.guessed_from).len(), 2);
        assert_eq!(shared.read_ahead_gpu_guesses.load(Ordering::Relaxed), 1);
    }
}
