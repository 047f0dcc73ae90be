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
//! With `DISKFORMER_SPLIT_MAILBOX=1` on a Vulkan GPU, steps 1-3 go through two host-mapped
//! mailboxes instead ([`SplitMailboxes`], `wgpu/mailbox.rs`): a kernel writes the routing and
//! the hidden state into host memory and then a flag the host polls (no readback's round trip),
//! and the add of the CPU's sum is a kernel that waits on the GPU for the flag the CPU job
//! writes after its sum, so the next layer is submitted before the job ends (no submit after
//! it). The share then moves by whether that kernel had to wait. Off by default until the
//! CPU jobs' pickup is reliable (see `ExpertTier::split_mailbox`).
//!
//! How the share is found: when the CPU's sum is taken, the host polls whether the GPU's queue
//! is empty. If it is, the CPU was the longer of the two and its share shrinks, otherwise it
//! grows, by [`SHARE_STEP`]; a share that rounds to no CPU expert grows too (no join would
//! measure it). It settles where both finish together, whatever the two memories' rates and the
//! hit rate are, with no cost model to calibrate. `DISKFORMER_SPLIT_SHARE` fixes it (A/B).

use super::super::moe::{self, PairTable, SKIP};
use super::{host_expert_ffn, lock, ExpertTier, HostBiases, SlotMats, TierState, NO_SLOT};
use crate::backend::{Backend, Experts, HostExpert, Routing};
use crate::cpu::experts_one_token;
use crate::error::OpError;
use crate::spec::MoeSpec;
use crate::wgpu::mailbox::{Mailbox, Toward};
use crate::wgpu::{le_f32s, le_u32s, trace, Deferred, JoinSeen, WgpuBackend, WgpuTensor};
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

/// Calls in flight at once through the mailboxes: a slot's data is written again two calls
/// later, when the GPU has added it (the next call's flag comes after that add in queue order)
/// and the host has read it (before it spawned the call's CPU job).
const MAILBOX_SLOTS: usize = 2;
/// Words of the down mailbox: the flags at 0..MAILBOX_SLOTS, the sequence number of a wait
/// that ran out of polls, whether each slot's wait had to poll; the data from `MAILBOX_DATA`.
const DOWN_TIMEOUT: usize = 2;
const DOWN_WAITED: usize = 4;
const MAILBOX_DATA: usize = 64;

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

/// The split's two mailboxes (`wgpu/mailbox.rs`): down (system memory) carries a layer's
/// routing and hidden state to the host, written by `mailbox_signal.wgsl`; up (the GPU's
/// memory through the BAR) carries the CPU's sum back, added by `mailbox_wait_add.wgsl`, which
/// waits for it on the GPU. A layer then costs no readback's round trip and no submit after the
/// CPU's work: the next layer is submitted while the CPU computes (docs/PAGING.md).
pub(in crate::wgpu) struct SplitMailboxes {
    up: Arc<Mailbox>,
    down: Mailbox,
    /// Words of one slot's data.
    slot_words: usize,
    /// The last call's sequence number (flags start at 0, so calls count from 1).
    seq: u32,
    /// The slot whose wait kernel's "had to poll" word the next call reads.
    unread_wait: Option<usize>,
}

/// One call's place in the mailboxes.
struct MailboxCall {
    seq: u32,
    slot: usize,
    /// First word of the slot's data (the same in both mailboxes).
    data_at: usize,
}

/// The partition kernel's source, sized for the per-pair kernels' most pairs.
fn partition_source() -> String {
    include_str!("../shaders/moe_split_partition.wgsl")
        .replace("{{MAX_PAIRS}}", &moe::MAX_HOST_PAIRS.to_string())
        .replace("{{SKIP}}", &SKIP.to_string())
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
        self.joins.fetch_add(1, Ordering::Relaxed);
        self.noticed_nanos.fetch_add(seen.taken_after.as_nanos() as u64, Ordering::Relaxed);
        self.gpu_first.fetch_add(seen.gpu_done as u64, Ordering::Relaxed);
        self.join_wait_nanos.fetch_add(seen.waited.as_nanos() as u64, Ordering::Relaxed);
        if adapt {
            self.step_share(if seen.gpu_done { -SHARE_STEP } else { SHARE_STEP });
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
        let queued =
            match &mailbox {
                Some(call) => {
                    let mb = st.split_mailboxes.as_ref().expect("made by split_mailbox_call");
                    self.dispatch(
                        self.ctx.pipeline_with("mailbox_signal", || MAILBOX_SIGNAL.to_string(), true),
                        &[&routing.weights.buf.buffer, &x.buf.buffer, mb.down.buffer()],
                        &[
                            route_words as u32,
                            (n * n_embd) as u32,
                            call.data_at as u32,
                            call.slot as u32,
                            call.seq,
                            0,
                            0,
                            0,
                        ],
                        [1, 1, 1],
                    );
                    // Not submitted yet: the GPU's share goes in the same submission (the host
                    // sees the flag when it is written, not when the submission is done), one
                    // submit per layer instead of two (~20-45 us of the host's time each).
                    None
                }
                None => Some(self.queue_tier_readback(
                    tier,
                    &[(&routing.weights.buf.buffer, weight_bytes), (&x.buf.buffer, x_bytes)],
                )),
            };
        trace::mark("readback queued", Some(layer));
        let y_gpu = if partitioned_on_gpu {
            let gpu_ids = self.alloc_bytes("moe split ids", 4 * nk as u64)?;
            self.dispatch(
                // Workgroup memory written before it is read (the shader's phase 1).
                self.ctx.pipeline_with("moe_split_partition", partition_source, true),
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
        let (weights, ids, xs) = match (queued, &mailbox) {
            (Some(queued), _) => {
                let parts = self.finish_tier_readback(tier, queued, true)?;
                let ids = if gpu_routed { le_u32s(&parts[0][4 * nk..]) } else { routing.ids.clone() };
                (le_f32s(&parts[0][..4 * nk]), ids, le_f32s(&parts[1]))
            }
            (None, Some(call)) => {
                let mb = st.split_mailboxes.as_ref().expect("made by split_mailbox_call");
                let words = self.split_mailbox_receive(tier, mb, call, route_words + n * n_embd)?;
                st.split_mailboxes.as_mut().expect("made by split_mailbox_call").unread_wait = None;
                let f32s = |w: &[u32]| w.iter().map(|&b| f32::from_bits(b)).collect::<Vec<f32>>();
                (f32s(&words[..nk]), words[nk..2 * nk].to_vec(), f32s(&words[route_words..]))
            }
            (None, None) => unreachable!("a readback is queued unless a mailbox call is"),
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
            if let Some(call) = &mailbox {
                // The sum goes up through the mailbox, and the kernel that adds it waits for it
                // on the GPU: recorded now, submitted with the next layer before the CPU is done.
                let mb = st.split_mailboxes.as_mut().expect("made by split_mailbox_call");
                let up = mb.up.clone();
                let failed = self.ctx.deferred_error.clone();
                let (data_at, flag_at, seq) = (call.data_at, call.slot, call.seq);
                trace::mark("spawn", Some(layer));
                rayon::spawn(move || {
                    match job.run_timed(spawned, &queued, &secs) {
                        Ok(sum) => up.write(data_at, &sum.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()),
                        Err(e) => {
                            // The GPU is waiting for the flag whatever happened: it adds zeros,
                            // and the next readback (or split call) returns the error.
                            up.write(data_at, &vec![0; job.xs.len()]);
                            lock(&failed).get_or_insert(e);
                        }
                    }
                    up.store(flag_at, seq);
                });
                // The layer's replacements run on the GPU while the CPU computes (before the add).
                self.refill_layer(tier, st, layer)?;
                let mb = st.split_mailboxes.as_mut().expect("made by split_mailbox_call");
                let out = self.alloc("moe split sum", &[n, n_embd])?;
                let spin_limit = split_wait_spin_limit();
                self.dispatch(
                    self.ctx.pipeline_with("mailbox_wait_add", || MAILBOX_WAIT_ADD.to_string(), true),
                    &[mb.up.buffer(), &y.buf.buffer, &out.buf.buffer, mb.down.buffer()],
                    &[
                        flag_at as u32,
                        data_at as u32,
                        (n * n_embd) as u32,
                        seq,
                        spin_limit,
                        DOWN_TIMEOUT as u32,
                        (DOWN_WAITED + call.slot) as u32,
                        0,
                    ],
                    [(n * n_embd).div_ceil(2048).clamp(1, 64) as u32, 1, 1],
                );
                mb.unread_wait = Some(call.slot);
                trace::mark("split end", Some(layer));
                self.split_profile(tier, t_read, t_decided, t_submitted, n_misses, n_cpu);
                lock(&tier.profile).split_mailbox_layers += 1;
                return Ok(out);
            }
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
                Some(SplitMailboxes { up: Arc::new(up), down, slot_words: words, seq: 0, unread_wait: None });
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

    /// Waits for the call's flag in the down mailbox and reads its `words` of data; also reads
    /// whether the previous call's wait had to poll, which moves the CPU's share as a join does.
    fn split_mailbox_receive(
        &self,
        tier: &ExpertTier,
        mb: &SplitMailboxes,
        call: &MailboxCall,
        words: usize,
    ) -> Result<Vec<u32>, OpError> {
        let t0 = Instant::now();
        let mut polls = 0u32;
        while mb.down.load(call.slot) != call.seq {
            // The previous call's CPU job went into this thread's queue: run it here if no
            // worker took it yet (they may sleep; the GPU waits for it before handing this
            // call over).
            if rayon::yield_local().is_none() {
                std::hint::spin_loop();
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(1024) {
                if t0.elapsed() > HOST_WAIT {
                    return Err(OpError::Unsupported {
                        op: "moe_ffn (split)",
                        backend: "wgpu",
                        why: format!(
                            "the GPU did not hand over call {} in {:?} (its flag says {})",
                            call.seq,
                            HOST_WAIT,
                            mb.down.load(call.slot)
                        ),
                    });
                }
                // Now and then, other workers' queues too.
                rayon::yield_now();
            }
        }
        let mut words_out = vec![0u32; words];
        mb.down.read(call.data_at, &mut words_out);
        {
            let mut prof = lock(&tier.profile);
            prof.readback_wait_secs += t0.elapsed().as_secs_f64();
            prof.readbacks += 1;
        }
        if let Some(prev) = mb.unread_wait {
            // The previous call's add ran before this call's hand-over (queue order).
            let gpu_waited = mb.down.load(DOWN_WAITED + prev) == 1;
            let adapt = tier.split_fixed.is_none();
            tier.split.joined(
                JoinSeen {
                    gpu_done: gpu_waited,
                    waited: std::time::Duration::ZERO,
                    taken_after: std::time::Duration::ZERO,
                },
                adapt,
            );
        }
        Ok(words_out)
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

    #[test]
    fn share_rounds_to_256ths_within_bounds() {
        assert_eq!(share_in_256ths(0.5), 128);
        assert_eq!(share_in_256ths(0.02), 5);
        assert_eq!(share_in_256ths(-1.0), 0);
        assert_eq!(share_in_256ths(2.0), 256);
    }

    /// The partition kernel parses and validates (naga) at the per-pair kernels' pair limit.
    #[test]
    fn partition_kernel_validates() {
        crate::wgpu::shaders::tests::parse("moe_split_partition", &partition_source());
    }
}
