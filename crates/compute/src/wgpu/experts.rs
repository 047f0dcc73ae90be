//! The GPU expert tier: a mixture-of-experts model whose experts do not all fit in GPU memory
//! keeps a pool of expert slots there and fetches the rest from an [`ExpertStore`] (the pager's
//! RAM tier, which reads from disk) when the router picks them.
//!
//! [`WgpuBackend::with_expert_store`] turns it on. From then on `weight()` does not upload the
//! stacked expert tensors (`blk.N.ffn_{gate,up,down}_exps.weight`), and `moe_ffn` works per
//! layer:
//! - experts the router picked that hold a slot are computed in place (the matrix product reads
//!   the slot's rows of the pool buffer);
//! - every other picked expert is a miss: its host bytes come from the store and it is either
//!   uploaded into a victim slot and computed there, or computed on the CPU from the host copy
//!   (on a readback of the layer's activations) and the result added on the GPU
//!   ([`MissPolicy`]).
//!
//! Design choices and their reasons:
//! - **Slots.** A slot holds one expert's gate, up and down matrices of one layer, repacked in the
//!   GPU layout ([`TypeLayout::repack`]'s), each matrix starting on a whole row of its own type
//!   so the product kernel addresses it as rows of the pool buffer. Its size is
//!   [`expert_slot_bytes`]; the number of slots comes from the caller's placement plan
//!   (`pager::GpuPlacement`), which counts dense weights, KV cache and scratch first.
//! - **Uploads through a ring of staging buffers** (`MAP_WRITE | COPY_SRC`), each mapped while the
//!   CPU fills it and re-mapped with `map_async` as soon as its copies are submitted, so a buffer
//!   is ready again when the ring comes back to it. The misses of one layer are written into one
//!   staging buffer and copied with `copy_buffer_to_buffer` in one submit. `queue.write_buffer`
//!   is never used: on the H200 it ran at 1.4-3.5 GB/s against 48 GB/s for staging copies.
//! - **Order.** A layer's hits are recorded first, then its uploaded misses in batches: a batch
//!   takes victims among the slots this call is not about to compute, so an expert the call
//!   still needs is never evicted, and a call that touches more experts than slots works in
//!   batches. Commands run in recording order, so overwriting a slot that an earlier-recorded
//!   product reads is safe.
//! - **Hybrid.** Under [`MissPolicy::Auto`] a miss is computed on the CPU when that is measured
//!   to be cheaper than uploading it: upload bandwidth is measured when the tier is built, the
//!   CPU's time per expert and token on the first expert it computes, and an upload's cost is
//!   shared by the uses a slot has had so far (selections per upload). Without that sharing the
//!   H200 run computed 383 misses per token on the CPU and the pool never filled (0.2% hits).

use super::host_import::PendingImport;
use super::layout::TypeLayout;
use super::mailbox::{MappedHostBuffer, Toward};
use super::moe::{self, RouteView};
use super::shaders::Plain;
use super::{lock, Cmd, Span, WeightChunk, WgpuBackend, WgpuTensor, WgpuWeight};
use crate::backend::{Backend, ExpertStore, Experts, HostExpert, HostMatrix};
use crate::cpu::{experts_one_token, kernels, ExpertBiases};
use crate::error::OpError;
use crate::quant::{self, MatmulMode};
use crate::spec::MoeSpec;
use crate::ExpertTierStats;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod admission;
mod prefetch;
mod split;

/// What happens to an expert the router picked that holds no GPU slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissPolicy {
    /// Upload it into a slot (evicting another) and compute it there.
    Upload,
    /// Compute it on the CPU from the host copy. The pool's free slots are filled (uploads
    /// that evict nothing); once full, it never changes.
    Cpu,
    /// Whichever is cheaper by measured costs (upload bandwidth, CPU time per expert and token).
    Auto,
    /// Read by the GPU's kernels straight from host memory: the tier keeps a copy of every
    /// expert in host-visible, non-device-local buffers (the zero-copy host tier, bounded by
    /// [`ExpertTierOptions::host_budget_bytes`]), so a decode step never waits for its ids; the
    /// pool is refilled from that copy between steps, from the ids each step leaves in a log
    /// read back once per step.
    Host,
    /// As [`MissPolicy::Host`], and each decode layer's misses divided between the GPU (read
    /// from the host copy) and the CPU (computed from the store's copy at the same time), the
    /// CPU's share balanced by which of the two finishes first (see the `split` module). Costs
    /// a readback of the ids and the hidden state per layer.
    Split,
}

/// Which slot an upload evicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotPolicy {
    /// The slot used longest ago.
    Lru,
    /// The expert least often selected, with scores decaying by [`LFU_DECAY`] each time its
    /// layer runs (the pager's rule); ties go to the least recent.
    Lfu,
}

/// Factor by which the LFU scores of a layer shrink each time the layer runs: a memory of
/// about 1 / (1 − decay) = 100 calls (decode tokens, or prefill batches).
///
/// Why that long: at top 8 of 128 an expert's score is a count of rare events, and telling an
/// expert picked by 15% of tokens from one picked by 5% takes dozens of tokens. With 0.9 (ten
/// calls, the pager's rule and this tier's until the thirty-third session) the skewed synthetic
/// Qwen3-30B-A3B at 4G on the H200 held a hit rate of 42.0-44.9% where 0.99 held 43.2-46.6%
/// (`--stats`' hindsight line: a fixed pool of the run's most selected experts, 50.6-51.6%),
/// and uniform routing did not change (20.8% / 21.0%; decode 72.9-74.5 against 73.7 tok/s).
/// `DISKFORMER_LFU_DECAY` sets it for experiments.
pub const LFU_DECAY: f32 = 0.99;

/// Under [`MissPolicy::Host`] with LFU: a missed expert replaces a pooled one between steps
/// only if its score, less the selection that missed, exceeds the pooled expert's by this many
/// selections, to start with: the replacements' measured yield then moves it (`admission`: up
/// when they do not pay for their copies, as under uniform routing). A replacement costs one
/// copy of the expert over PCIe, and a hit saves one read of it over PCIe; an LFU score is
/// about the selections of the next 1 / (1 − [`LFU_DECAY`]) calls (the margin was set with ten,
/// and still counts selections), so the replacement pays when
/// it brings at least one more hit than it evicts. Without the margin, uniform routing (where the last selection says nothing of the next) replaced
/// ~235 experts per token on Qwen3-30B-A3B at a 4 GB budget for a hit rate no better than a
/// pool filled once: 24.5 tok/s on the H200, against 32.7 with no refills at all and 35.2 with
/// 32 per step (the pool filling up, few replacements). With the margin: 32.5 tok/s uniform and
/// 41.3 with `--routing-skew 0.3` (was 31.1: popular experts are no longer pushed out); margins
/// of 0.5, 2 and 4 were each worse for the skewed file, 2 ~5% better for the uniform one.
pub const HOST_REPLACE_MARGIN: f32 = 1.0;

/// Staging buffers in the upload ring.
pub const STAGING_BUFFERS: usize = 3;

/// Experts one staging buffer holds by default: a decode step's misses of one layer (top-k is
/// at most 8 in the models supported) fit in one submit.
pub const STAGING_EXPERTS: u64 = 8;

/// How the tier is sized and behaves.
#[derive(Clone, Debug)]
pub struct ExpertTierOptions {
    /// Slots in the GPU pool.
    pub n_slots: usize,
    /// Bytes of one slot ([`expert_slot_bytes`] of the largest layer's expert).
    pub slot_bytes: u64,
    /// Bytes of each of the [`STAGING_BUFFERS`] staging buffers (at least one slot).
    pub staging_bytes: u64,
    /// What a miss does.
    pub miss: MissPolicy,
    /// Which slot an upload evicts.
    pub policy: SlotPolicy,
    /// How the CPU computes the experts it is given.
    pub cpu_matmul: MatmulMode,
    /// At most this many slots per pool buffer (`None`: as many as the storage-binding limit
    /// allows). Tests lower it to exercise pools of several buffers on a small GPU.
    pub max_slots_per_buffer: Option<usize>,
    /// Under [`MissPolicy::Host`], the most bytes the host tier may take (`--ram-budget`): a
    /// layer whose copy would pass it is an error, never an overrun.
    pub host_budget_bytes: Option<u64>,
    /// Under a host tier ([`MissPolicy::Host`], [`MissPolicy::Split`]): pool slots each layer's
    /// experts take as soon as the layer's host copy is made (its first call), copied from that
    /// copy on the GPU (0: the pool starts empty and fills with misses as they come). The
    /// caller sets it to the pool's slots over the model's MoE layers.
    pub prefill_per_layer: usize,
    /// How a host tier's copies are made ([`HostFill::from_env`] by default).
    pub host_fill: HostFill,
}

/// How the host tier's copies are made, where the device allows; each falls back to the next
/// where it does not (not Vulkan, no import extension).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostFill {
    /// Anonymous memory the fill's threads map and write, then lent to the GPU (host_import.rs):
    /// the driver only pins it.
    Import,
    /// Host memory the driver makes (`vkAllocateMemory`, ~4 GB/s on the H200), written through
    /// its mapping.
    Mapped,
    /// wgpu's host-visible buffers, written through the staging ring and the GPU's copies.
    Staged,
}

impl HostFill {
    /// `DISKFORMER_HOST_FILL=import|mapped|staged` (comparisons on a device), else `Import`.
    pub fn from_env() -> HostFill {
        match std::env::var("DISKFORMER_HOST_FILL").ok().as_deref().map(str::trim) {
            Some("mapped") => HostFill::Mapped,
            Some("staged") => HostFill::Staged,
            _ => HostFill::Import,
        }
    }

    /// The word the `--stats` line uses.
    pub fn name(self) -> &'static str {
        match self {
            HostFill::Import => "imported",
            HostFill::Mapped => "driver-allocated",
            HostFill::Staged => "staged",
        }
    }
}

impl ExpertTierOptions {
    /// `n_slots` slots of `slot_bytes`, staging for [`STAGING_EXPERTS`] experts per buffer, LFU,
    /// automatic miss handling, exact CPU products.
    pub fn new(n_slots: usize, slot_bytes: u64) -> ExpertTierOptions {
        ExpertTierOptions {
            n_slots,
            slot_bytes,
            staging_bytes: default_staging_bytes(slot_bytes),
            miss: MissPolicy::Auto,
            policy: SlotPolicy::Lfu,
            cpu_matmul: MatmulMode::Exact,
            max_slots_per_buffer: None,
            host_budget_bytes: None,
            prefill_per_layer: 0,
            host_fill: HostFill::from_env(),
        }
    }

    /// Bytes of all staging buffers.
    pub fn staging_total_bytes(&self) -> u64 {
        STAGING_BUFFERS as u64 * self.staging_bytes
    }
}

/// The default size of one staging buffer for slots of `slot_bytes`.
pub fn default_staging_bytes(slot_bytes: u64) -> u64 {
    (STAGING_EXPERTS * slot_bytes).next_multiple_of(256).max(256)
}

/// Bytes the back end holds whatever the model: the persistent parameter ring, the
/// placeholder buffer bound where an op has no optional input, the allocator's slack
/// ([`super::ALLOCATOR_SLACK_BYTES`]: device memory reserved in blocks but not in buffers) and
/// the staging piece a weight upload holds while loading (host-visible memory, which is device
/// memory on a GPU with resizable BAR). A placement counts them beside the activations (on a
/// tiny model they are most of the scratch).
pub fn backend_fixed_bytes() -> u64 {
    super::PARAMS_RING_BYTES + 16 + super::ALLOCATOR_SLACK_BYTES + super::WEIGHT_UPLOAD_PIECE_BYTES
}

/// GPU bytes to reserve for the slot table of [`MissPolicy::Host`] on a model of
/// `n_experts_total` experts (all layers): 16 bytes per expert, in a buffer that doubles as
/// layers appear, and the earlier ones may live on in cached bind groups (their sizes add up to
/// less than the last): four times the table.
pub fn host_tier_table_reserve_bytes(n_experts_total: usize) -> u64 {
    4 * 16 * n_experts_total as u64 + 1024
}

/// Bytes a weight of `n_rows` rows of `k` values of `dtype` takes on the GPU (the repacked
/// layout), or `None` when the GPU has no kernel for the type.
pub fn weight_bytes(dtype: gguf::GgmlType, n_rows: usize, k: usize) -> Option<u64> {
    let l = TypeLayout::for_weight(dtype, k)?;
    Some((4 * n_rows * l.row_words(k)) as u64)
}

/// Bytes of a slot holding one expert whose matrices (`(dtype, n_out, k)`: gate if any, up,
/// down) are repacked for the GPU: each matrix may need up to one row of padding so that it
/// starts on a whole row of its type. `None` when a type has no GPU kernel.
pub fn expert_slot_bytes(matrices: &[(gguf::GgmlType, usize, usize)]) -> Option<u64> {
    let mut words = 0;
    for &(dtype, n_out, k) in matrices {
        let l = TypeLayout::for_weight(dtype, k)?;
        words += (n_out + 1) * l.row_words(k);
    }
    Some(4 * words as u64)
}

/// Host time around the tier's MoE layers, summed over calls. Always on (a few clock reads per
/// layer): the H200 run showed ~220 us per MoE layer between the GPU's pieces of work at 97%
/// pool hits, and `--stats` prints where it goes, per decode step.
#[derive(Clone, Copy, Debug, Default)]
struct TierProfile {
    /// `moe_ffn` calls through the tier.
    calls: u64,
    /// Steps: a call whose layer is not above the previous call's starts one.
    steps: u64,
    /// Submitting everything recorded before the id readback (encoding included).
    readback_submit_secs: f64,
    /// Blocked until the ids are mapped (the GPU finishing the work before them, the map).
    readback_wait_secs: f64,
    /// Id readbacks.
    readbacks: u64,
    /// Hits and misses, policy scores, the CPU-or-upload choice, hits recorded.
    decide_secs: f64,
    /// Reading the activations back for the CPU's experts (a second sync).
    cpu_readback_secs: f64,
    /// The CPU's expert FFNs (thread-pool time; overlaps the fills).
    cpu_secs: f64,
    /// Writing misses into staging buffers, waiting for one to be mapped included.
    fill_secs: f64,
    /// The store's call as a whole (its lookups and disk reads, the CPU experts and the fills,
    /// overlapped).
    store_secs: f64,
    /// Copies submitted, kernels recorded, the CPU's sum added.
    record_secs: f64,
    /// Making the host tier's copies ([`MissPolicy::Host`], once per layer; not in `decide`).
    host_fill_secs: f64,
    /// [`MissPolicy::Split`]: layers split, those whose GPU part was done when the CPU's was,
    /// their misses and the experts the CPU computed of them.
    split_layers: u64,
    /// Of them, those whose ids and CPU sum went through the mailboxes (`split::SplitMailboxes`).
    split_mailbox_layers: u64,
    /// Of those, the ones that read the next layer's guessed experts ahead
    /// (`split::touch_next_layer`).
    split_touches: u64,
    /// The dispatcher's read-ahead of the CPU's guessed experts (`split::Dispatcher::read_ahead`):
    /// bytes read, experts guessed, those the CPU then computed.
    read_ahead_bytes: u64,
    read_ahead_experts: u64,
    read_ahead_right: u64,
    read_ahead_guess_secs: f64,
    read_ahead_secs: f64,
    /// Layers whose read-ahead took the routing kernel's guess (`split::Dispatcher::guess_from_gpu`).
    read_ahead_gpu_guesses: u64,
    split_gpu_first: u64,
    split_misses: u64,
    split_cpu_experts: u64,
    split_joins: u64,
    /// The CPU jobs' time queued before a worker took them, and the host's waits at the joins.
    split_queued_secs: f64,
    split_join_wait_secs: f64,
    /// From the CPU jobs' ends (or the joins' starts, when later) to the joins taking their
    /// results, and from the joins' ends to their submits' returns (the GPU waits through both).
    split_noticed_secs: f64,
    submit_after_join_secs: f64,
    /// The host tier's replacement margin at the last refill, and the yield it was moved by.
    replace_margin: f32,
    replace_yield: Option<f32>,
}

impl TierProfile {
    /// Per-step microseconds of each phase, one line, for `--stats`.
    fn report(&self) -> String {
        let per = |s: f64| 1e6 * s / self.steps.max(1) as f64;
        format!(
            "tier host time per step ({} steps, {:.1} MoE calls and {:.1} id readbacks each), us: readback submit {:.0}, \
             readback wait {:.0}, decide {:.0}, cpu readback {:.0}, store {:.0} (of which cpu experts {:.0}, staging fill {:.0}, \
             overlapped), record+submit {:.0}; total {:.0}{}\n",
            self.steps,
            self.calls as f64 / self.steps.max(1) as f64,
            self.readbacks as f64 / self.steps.max(1) as f64,
            per(self.readback_submit_secs),
            per(self.readback_wait_secs),
            per(self.decide_secs),
            per(self.cpu_readback_secs),
            per(self.store_secs),
            per(self.cpu_secs),
            per(self.fill_secs),
            per(self.record_secs),
            per(self.readback_submit_secs
                + self.readback_wait_secs
                + self.decide_secs
                + self.cpu_readback_secs
                + self.store_secs
                + self.record_secs),
            if self.host_fill_secs > 0.0 {
                format!("; host tier filled in {:.2} s (once)", self.host_fill_secs)
            } else {
                String::new()
            },
        ) + &if self.replace_margin > 0.0 {
            format!(
                "replacements between steps: LFU margin {:.2} at the last step{}\n",
                self.replace_margin,
                self.replace_yield.map_or_else(
                    || " (too few replacements to measure their yield)".to_string(),
                    |y| format!(", moved by their yield of {y:.2} net hits per replacement")
                ),
            )
        } else {
            String::new()
        } + &if self.split_layers > 0 {
            let shares = format!(
                "split: the CPU computed {:.1}% of {:.1} misses per step, the GPU{} in {:.1}% of {} layers ({} of {} layers \
                 through the mailboxes",
                100.0 * self.split_cpu_experts as f64 / self.split_misses.max(1) as f64,
                self.split_misses as f64 / self.steps.max(1) as f64,
                if self.split_mailbox_layers > 0 {
                    "'s share was done before the CPU's"
                } else {
                    " was done when its sum was taken"
                },
                100.0 * self.split_gpu_first as f64 / self.split_joins.max(1) as f64,
                self.split_joins,
                self.split_mailbox_layers,
                self.split_layers,
            );
            if self.split_mailbox_layers > 0 {
                format!(
                    "{shares}, {} reading the next layer's guess ahead); per step, us: the CPU's dispatcher waiting for the \
                     GPU's hand-overs {:.0}, from a hand-over to its CPU job's start {:.0}{}\n",
                    self.split_touches,
                    per(self.split_join_wait_secs),
                    per(self.split_queued_secs),
                    if self.read_ahead_experts > 0 {
                        format!(
                            "; the CPU read {:.1} MiB of guessed experts ahead per step in {:.0} us ({:.1} GB/s), {:.1} \
                             experts, {:.0}% of them then its own ({:.1} layers guessed by the GPU's routing, the rest on \
                             the CPU in {:.0} us)",
                            self.read_ahead_bytes as f64 / 1048576.0 / self.steps.max(1) as f64,
                            per(self.read_ahead_secs),
                            self.read_ahead_bytes as f64 / self.read_ahead_secs.max(1e-9) / 1e9,
                            self.read_ahead_experts as f64 / self.steps.max(1) as f64,
                            100.0 * self.read_ahead_right as f64 / self.read_ahead_experts as f64,
                            self.read_ahead_gpu_guesses as f64 / self.steps.max(1) as f64,
                            per(self.read_ahead_guess_secs),
                        )
                    } else {
                        String::new()
                    },
                )
            } else {
                format!(
                    "{shares}); per step, us: CPU jobs queued {:.0}, host waiting at the joins {:.0}, results taken {:.0} \
                     after they were there, submits returning {:.0} after the joins\n",
                    per(self.split_queued_secs),
                    per(self.split_join_wait_secs),
                    per(self.split_noticed_secs),
                    per(self.submit_after_join_secs),
                )
            }
        } else {
            String::new()
        }
    }
}

/// A readback submitted by [`WgpuBackend::queue_tier_readback`] and not yet waited for.
pub(super) struct QueuedReadback {
    rb: wgpu::Buffer,
    starts: Vec<u64>,
    lens: Vec<u64>,
    total: u64,
    started: Instant,
    submitted: Instant,
}

/// One matrix in a slot: its type, shape and first word within the pool buffer.
#[derive(Clone, Copy, Debug)]
struct Placed {
    layout: TypeLayout,
    n_out: usize,
    k: usize,
    word0: usize,
}

/// The matrices of the expert a slot holds.
#[derive(Clone, Copy, Debug)]
struct SlotMats {
    gate: Option<Placed>,
    up: Placed,
    down: Placed,
}

const STAGING_READY: u8 = 0;
const STAGING_PENDING: u8 = 1;
const STAGING_FAILED: u8 = 2;

/// One buffer of the upload ring and whether it is mapped (ready to fill).
struct Staging {
    buffer: wgpu::Buffer,
    state: Arc<AtomicU8>,
}

/// Who holds which slot, policy state, the CPU cost measured, counters.
struct TierState {
    owner: Vec<Option<(u32, u32)>>,
    mats: Vec<Option<SlotMats>>,
    last_use: Vec<u64>,
    /// Per layer, per expert: the slot holding it (`u32::MAX`: none). Grown on first use.
    slot_of: Vec<Vec<u32>>,
    /// Per layer, per expert: LFU score.
    score: Vec<Vec<f32>>,
    /// Per layer, per expert: the calls that selected it since the load (for the `--stats`
    /// hindsight line: how far the policy's hit rate is from the best fixed pool of this run).
    selected_count: Vec<Vec<u64>>,
    tick: u64,
    stats: Vec<ExpertTierStats>,
    /// The ring buffer the next upload batch uses.
    next_staging: usize,
    /// Seconds the CPU took per expert and token (an exponential average), once measured.
    cpu_secs_per_expert_token: Option<f64>,
    /// Per layer, the pool buffer (region) its experts live in, given on first use.
    region_of: Vec<Option<usize>>,
    /// The previous call's layer (a call at or below it starts a step, for the profile).
    last_layer: Option<usize>,
    /// Layers given to each region so far.
    region_layers: Vec<usize>,
    /// The host tier ([`MissPolicy::Host`]) and its bookkeeping.
    host: HostTierState,
    /// Under [`MissPolicy::Split`], each layer's expert biases on the host (read once).
    split_biases: Vec<Option<Arc<HostBiases>>>,
    /// The split's mailboxes (`split::SplitMailboxes`), made on its first call that can use
    /// them; `mailbox_unavailable` once the device had none to give (not Vulkan).
    split_mailboxes: Option<split::SplitMailboxes>,
    mailbox_unavailable: bool,
    /// Under [`MissPolicy::Split`], each layer's router as the model routed with it, for the
    /// guess of its experts one layer early (`split::touch_next_layer`).
    guess_routers: Vec<Option<Arc<split::GuessRouter>>>,
    /// Where the look-ahead's kernel counts what it read (`moe_split_touch.wgsl`'s OUT).
    touch_out: Option<wgpu::Buffer>,
    /// Per slot: a replacement's copy into it is on the copy queue (`ExpertTier::copy_refills`):
    /// no victim until it is done and the table points to it.
    copying: Vec<bool>,
    /// Those replacements, oldest first.
    pending_copies: Vec<PendingCopy>,
}

/// A pool replacement on the copy queue (`ExpertTier::copy_refills`): the slot is the expert's,
/// the table still reads it from host memory until the copy is done.
struct PendingCopy {
    slot: usize,
    layer: usize,
    expert: usize,
    /// The expert's matrices in the slot and in the layer's host copy.
    mats: SlotMats,
    host_mats: SlotMats,
    /// The split call whose submission evicted the slot's expert (its table rows written then):
    /// the copy waits until the GPU has handed over a later call, so no kernel reads the old
    /// expert from the slot any more.
    after_seq: u32,
    /// The copy queue's ring place once submitted.
    ring: Option<usize>,
}

/// One layer's experts in the host tier: a buffer in host memory and where each expert's
/// matrices are in it.
struct HostLayer {
    buffer: wgpu::Buffer,
    mats: Vec<SlotMats>,
    /// How it was made. A [`HostFill::Staged`] buffer came from wgpu's allocator
    /// ([`host_tier_buffer`]), which then counts it among its blocks; the others are raw
    /// Vulkan memory.
    fill: HostFill,
}

/// Where a layer's host copy is written ([`WgpuBackend::host_tier_target`]).
enum HostTarget {
    Import(Box<PendingImport>),
    /// Pages the previous layer's call wrote ahead, with the experts' placements.
    Written(Box<PendingImport>, Vec<SlotMats>),
    Mapped(MappedHostBuffer),
    Staged,
}

impl HostTierState {
    /// Bytes of its buffers that wgpu's allocator made (see
    /// [`WgpuBackend::expert_host_tier_allocator_bytes`]).
    fn allocator_bytes(&self) -> u64 {
        let layers: u64 =
            self.layers.iter().flatten().filter(|h| h.fill == HostFill::Staged).map(|h| h.buffer.size()).sum();
        layers + self.log.as_ref().map_or(0, |l| l.size())
    }
}

/// Table entry `where` of an expert in a pool slot and of one read from host memory.
const IN_POOL: u32 = 0;
const IN_HOST: u32 = 1;

/// The zero-copy host tier's state (see [`MissPolicy::Host`]).
#[derive(Default)]
struct HostTierState {
    /// Per layer, its experts' copy (made on the layer's first call).
    layers: Vec<Option<HostLayer>>,
    /// Bytes of those buffers and of the id log.
    bytes: u64,
    /// Experts per layer in the slot table (the first layer's count; every layer has it).
    row: usize,
    /// The slot table's host copy: `[where, gate word, up word, down word]` per layer and
    /// expert, words of the pool buffer (`IN_POOL`) or of the layer's host buffer (`IN_HOST`).
    table: Vec<[u32; 4]>,
    /// Its GPU copy, which the per-pair kernels read.
    table_gpu: Option<wgpu::Buffer>,
    /// The host copy changed since the GPU copy was written.
    table_dirty: bool,
    /// The id log: each decode call copies its ids here; read back once per step.
    log: Option<wgpu::Buffer>,
    /// Logged calls: (layer, ids, byte offset in the log).
    log_entries: Vec<(usize, usize, u64)>,
    /// Bytes of the log in use.
    log_used: u64,
    /// Misses (layer, expert) seen since the last refill, in order.
    pending_misses: Vec<(u32, u32)>,
    /// Under [`MissPolicy::Split`], layers whose replacements wait for a later split call: the
    /// ones the dispatcher finished after the host's last split call of a step, taken in at the
    /// next step's start ([`WgpuBackend::settle_dispatcher`]), where their copies and
    /// submissions would sit between the step's first layer and its GPU.
    deferred_refills: std::collections::VecDeque<usize>,
    /// Experts copied into the pool in this step (at most `refill_max`).
    refills_this_step: usize,
    /// The split call now recording, when its replacements go to the copy queue
    /// (`ExpertTier::copy_refills`; set by `split::take_decided`).
    copy_seq: Option<u32>,
    /// Replacements the split call now recording may still make (`None`, no limit, outside
    /// [`WgpuBackend::take_decided`]; see [`ExpertTier::split_refills_per_call`]).
    call_refills_left: Option<usize>,
    /// Under LFU, the margin a miss's score must exceed a pooled expert's by to replace it,
    /// and what the replacements earned (`None` until the first refill sets it up).
    admission: Option<admission::Admission>,
    /// The next layer's pages, written while this layer's were imported (see
    /// [`WgpuBackend::ensure_host_layer`]).
    ahead: Option<WrittenAhead>,
}

/// A layer's host copy written into pages not yet imported.
struct WrittenAhead {
    layer: usize,
    pending: Box<PendingImport>,
    mats: Vec<SlotMats>,
}

const NO_SLOT: u32 = u32::MAX;

/// The pool, the staging ring and the store behind a [`WgpuBackend`]'s paged experts.
pub(super) struct ExpertTier {
    /// Under [`MissPolicy::Split`] with a copy queue, the next layer's likely misses copied into
    /// reserved slots beside the chain between layers (`prefetch.rs`); `None` otherwise.
    prefetch: Option<Arc<prefetch::Prefetch>>,
    /// Under [`MissPolicy::Split`] through the mailboxes with a copy queue and
    /// `DISKFORMER_SPLIT_COPY_REFILLS=1`: the pool's replacements copied there instead of on the
    /// compute queue, where each (~55 us over the link) sat between a layer's GPU share and its
    /// wait for the CPU's sum and, two or three at a time, outlasted the CPU's job (twenty-sixth
    /// session: the chain 161.7 us on those layers against 89.2). A/B name `copyq` (the B arm's
    /// replacements go on the compute queue). Off by default: on the H200 (twenty-seventh
    /// session) it made more replacements and hits but no measurable speed difference.
    copy_refills: Option<Arc<super::transfer::TransferQueue>>,
    store: Arc<dyn ExpertStore>,
    opts: ExpertTierOptions,
    slot_words: usize,
    slots_per_buffer: usize,
    pool: Vec<wgpu::Buffer>,
    /// The slots of each pool buffer. A layer's experts all live in one buffer, so the per-pair
    /// kernels bind one weight buffer whatever the pool's size (see `TierState::region`).
    regions: Vec<std::ops::Range<usize>>,
    staging: Vec<Staging>,
    upload_bytes_per_s: f64,
    state: Mutex<TierState>,
    /// A persistent `MAP_READ` buffer for the routing's readback (one per MoE layer and token):
    /// a buffer made for each readback costs an allocation every time.
    readback: Mutex<Option<wgpu::Buffer>>,
    /// Where the host's time goes (see [`TierProfile`]).
    profile: Mutex<TierProfile>,
    /// Wait for the id readback by polling the device in a loop (default) instead of a blocking
    /// wait: a futex wake-up is slow in a VM, and the wait is short (DISKFORMER_READBACK_BLOCK=1
    /// blocks, for comparison).
    spin_readback: bool,
    /// Under [`MissPolicy::Host`], the most experts copied into the pool between two steps
    /// (DISKFORMER_HOST_REFILL_MAX, for experiments; unbounded by default): each refill is a
    /// PCIe copy on the GPU's timeline, while a miss left in host memory is read over PCIe
    /// each time it is picked.
    refill_max: usize,
    /// [`LFU_DECAY`], or `DISKFORMER_LFU_DECAY` (for experiments).
    lfu_decay: f32,
    /// Under [`MissPolicy::Split`], the CPU's share and what its joins saw.
    split: Arc<split::SplitShared>,
    /// The task that takes the split's layers handed over through the mailboxes.
    dispatcher: Arc<split::Dispatcher>,
    /// `DISKFORMER_SPLIT_SHARE`: a fixed share instead (for A/B runs).
    split_fixed: Option<f64>,
    /// `DISKFORMER_SPLIT_SYNC=1`: wait for the CPU's share within its layer instead of while
    /// the next layer is recorded (for A/B runs).
    split_sync: bool,
    /// `DISKFORMER_SPLIT_HOST_PARTITION=1`: the host partitions the misses after its readback
    /// and submits the GPU's share then (the split's first version, for A/B).
    split_host_partition: bool,
    /// Hand the ids to the CPU and its sum back through the mailboxes (`split::SplitMailboxes`,
    /// `split::Dispatcher`) instead of submissions and readbacks, where the device allows
    /// (`DISKFORMER_SPLIT_MAILBOX=0`: never, for A/B runs). On the H200 with the pool's workers
    /// polling, 53-60 tok/s uniform against 45-49 without in one lease's alternating rounds
    /// (docs/PAGING.md, "Mailboxes").
    split_mailbox: bool,
    /// Whether the split's pool replacements are made between steps as under
    /// [`MissPolicy::Host`] (`DISKFORMER_SPLIT_LAYER_REFILL=0`, for A/B runs) instead of per
    /// layer (`refill_layer`), which took the copies out of the step's tail: 55.9-59.7 tok/s
    /// against 54.9-60.2 on the H200 (three alternating rounds; the CPU's share 70-72% against
    /// 65-67%).
    split_step_refill: bool,
    /// Under [`MissPolicy::Split`], a step's start defers the replacements of the layers the
    /// dispatcher finished after the previous step's last split call to the step's split calls
    /// ([`WgpuBackend::settle_dispatcher`]); `DISKFORMER_SPLIT_DEFER_REFILLS=0` makes them at
    /// the step's start, as before (A/B runs).
    split_defer_refills: bool,
    /// Under [`MissPolicy::Split`] through the mailboxes, the most pool replacements one split
    /// call records (`DISKFORMER_SPLIT_REFILLS_PER_CALL`, default 1; 0: no limit). Why: a
    /// replacement is a ~55 us copy over the link on the GPU's queue, recorded after the
    /// layer's share and before its wait for the CPU's sum, meant to fill the GPU's idle time
    /// while the CPU computes. One fits there; two or three did not: on the H200 (twenty-sixth
    /// session, skew 0.3) the layers whose call submitted replacements took 161.7 us from the
    /// CPU job's end to the next layer's ids against 89.2 for the others, a quarter of the layers
    /// and ~0.9 ms a step. A layer over the limit waits in the deferred queue for a later call.
    split_refills_per_call: usize,
    /// Under [`MissPolicy::Split`] through the mailboxes, read the next layer's guessed GPU
    /// experts into the GPU's L2 cache while the GPU waits for the CPU's sum
    /// (`split::touch_next_layer`). Off unless `DISKFORMER_SPLIT_TOUCH=1`: measured 2.4% slower
    /// on the H200 (docs/BENCHMARKS.md, twenty-fourth session): the GPU took more of the misses,
    /// but the wait for the CPU's sum grew by more (the touch reads share the RAM with the
    /// CPU's job, and its workgroups stop only when they see the flag).
    split_touch: bool,
    /// Under [`MissPolicy::Host`] with LFU, how many selections more than the slot's expert a
    /// missed expert's score must show to replace it to start with ([`HOST_REPLACE_MARGIN`]),
    /// moved by the replacements' measured yield ([`admission`]) unless
    /// DISKFORMER_HOST_REPLACE_MARGIN fixes it (`replace_margin_fixed`, for experiments).
    replace_margin: f32,
    replace_margin_fixed: Option<f32>,
}

impl Drop for ExpertTier {
    /// The copy queue's work reads the host copies and writes the pool: it must end before they
    /// are freed (wgpu waits only for its own queue).
    fn drop(&mut self) {
        if let Some(p) = &self.prefetch {
            p.wait_idle();
        }
        if let Some(q) = &self.copy_refills {
            q.wait_idle();
        }
    }
}

impl std::fmt::Debug for ExpertTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExpertTier({} slots of {} B, {:?})", self.opts.n_slots, self.opts.slot_bytes, self.opts.miss)
    }
}

impl ExpertTier {
    fn pool_bytes(&self) -> u64 {
        self.pool.iter().map(|b| b.size()).sum()
    }

    /// Buffer and first word of slot `s`.
    fn slot_base(&self, s: usize) -> (usize, usize) {
        (s / self.slots_per_buffer, (s % self.slots_per_buffer) * self.slot_words)
    }

    /// Where an expert with these matrices goes in slot `s`: each matrix on a whole row of its
    /// type, in gate, up, down order.
    fn place(&self, s: usize, ex: &HostExpert<'_>) -> Result<SlotMats, OpError> {
        self.place_at(self.slot_base(s).1, ex)
    }

    /// [`ExpertTier::place`] for a slot starting at word `base` of its buffer.
    fn place_at(&self, base: usize, ex: &HostExpert<'_>) -> Result<SlotMats, OpError> {
        let mut at = base;
        let mut put = |m: &HostMatrix<'_>, what: &str| -> Result<Placed, OpError> {
            let layout = TypeLayout::for_weight(m.dtype, m.k).ok_or_else(|| OpError::Weight {
                name: format!("expert {} {what}", ex.id),
                why: format!("type {} has no GPU kernel", m.dtype),
            })?;
            let rw = layout.row_words(m.k);
            let word0 = at.next_multiple_of(rw.max(1));
            at = word0 + m.n_out * rw;
            Ok(Placed { layout, n_out: m.n_out, k: m.k, word0 })
        };
        let gate = ex.gate.as_ref().map(|g| put(g, "gate")).transpose()?;
        let up = put(&ex.up, "up")?;
        let down = put(&ex.down, "down")?;
        if at > base + self.slot_words {
            return Err(OpError::Weight {
                name: format!("expert {}", ex.id),
                why: format!(
                    "needs {} bytes on the GPU but a slot has {} (the placement was sized for another model)",
                    4 * (at - base),
                    self.opts.slot_bytes
                ),
            });
        }
        Ok(SlotMats { gate, up, down })
    }
}

/// The hits a pool that never changed would have had over the selections counted in `counts`
/// (per layer, per expert), holding in each region the experts of that region's layers selected
/// most often: the best any policy without foresight of the order could approach, for a routing
/// that does not drift. `None` before any layer has a region.
fn hindsight_hits(counts: &[Vec<u64>], region_of: &[Option<usize>], regions: &[std::ops::Range<usize>]) -> Option<u64> {
    let mut per_region: Vec<Vec<u64>> = vec![Vec::new(); regions.len()];
    for (layer, c) in counts.iter().enumerate() {
        let Some(Some(r)) = region_of.get(layer) else { continue };
        per_region.get_mut(*r)?.extend_from_slice(c);
    }
    let mut any = false;
    let mut hits = 0;
    for (mut c, slots) in per_region.into_iter().zip(regions.iter().map(|r| r.len())) {
        any |= !c.is_empty();
        c.sort_unstable_by(|a, b| b.cmp(a));
        hits += c.iter().take(slots).sum::<u64>();
    }
    any.then_some(hits)
}

impl TierState {
    /// An empty pool of `n_slots` slots: no layer seen yet.
    fn new(n_slots: usize) -> TierState {
        TierState {
            owner: vec![None; n_slots],
            mats: vec![None; n_slots],
            last_use: vec![0; n_slots],
            slot_of: Vec::new(),
            score: Vec::new(),
            selected_count: Vec::new(),
            tick: 0,
            stats: Vec::new(),
            next_staging: 0,
            cpu_secs_per_expert_token: None,
            region_of: Vec::new(),
            region_layers: Vec::new(),
            last_layer: None,
            host: HostTierState::default(),
            split_biases: Vec::new(),
            split_mailboxes: None,
            mailbox_unavailable: false,
            guess_routers: Vec::new(),
            touch_out: None,
            copying: vec![false; n_slots],
            pending_copies: Vec::new(),
        }
    }

    /// `layer`'s call of one token selected the distinct experts `used`: their counts since the
    /// load, and under LFU (`lfu_decay` given) the layer's scores decayed and theirs raised by
    /// one.
    fn note_selected(&mut self, layer: usize, used: &[u32], lfu_decay: Option<f32>) {
        self.note_selected_by(layer, used.iter().map(|&e| (e, 1)), 1, lfu_decay);
    }

    /// `layer`'s call of `n_tokens` tokens selected each expert of `chosen` (`(expert, tokens
    /// that chose it)`, distinct experts): their counts since the load (one per call), and
    /// under LFU the scores of [`crate::lfu::note_call`] (a batch weighed by its tokens, so a
    /// prompt ranks the pool by its routing).
    fn note_selected_by(
        &mut self,
        layer: usize,
        chosen: impl Iterator<Item = (u32, u32)> + Clone,
        n_tokens: usize,
        lfu_decay: Option<f32>,
    ) {
        if let Some(decay) = lfu_decay {
            crate::lfu::note_call(&mut self.score[layer], chosen.clone(), n_tokens, decay);
        }
        chosen.for_each(|(e, _)| self.selected_count[layer][e as usize] += 1);
    }

    fn ensure_layer(&mut self, layer: usize, n_expert: usize) {
        if self.slot_of.len() <= layer {
            self.slot_of.resize_with(layer + 1, Vec::new);
            self.score.resize_with(layer + 1, Vec::new);
            self.selected_count.resize_with(layer + 1, Vec::new);
            self.stats.resize(layer + 1, ExpertTierStats::default());
        }
        if self.slot_of[layer].len() < n_expert {
            self.slot_of[layer].resize(n_expert, NO_SLOT);
            self.score[layer].resize(n_expert, 0.0);
            self.selected_count[layer].resize(n_expert, 0);
        }
    }

    /// The pool buffer of `layer`'s experts: on first use, the region with the most slots per
    /// layer already given to it (round robin over equal buffers). Partitioning costs little hit
    /// rate (every layer selects the same number of experts per token) and lets the per-pair
    /// kernels bind a single buffer.
    fn region(&mut self, layer: usize, regions: &[std::ops::Range<usize>]) -> usize {
        if self.region_of.len() <= layer {
            self.region_of.resize(layer + 1, None);
        }
        if let Some(r) = self.region_of[layer] {
            return r;
        }
        self.region_layers.resize(regions.len(), 0);
        let r = (0..regions.len())
            .max_by(|&a, &b| {
                let room = |r: usize| regions[r].len() as f64 / (self.region_layers[r] + 1) as f64;
                room(a).total_cmp(&room(b)).then(b.cmp(&a))
            })
            .unwrap_or(0);
        self.region_layers[r] += 1;
        self.region_of[layer] = Some(r);
        r
    }

    /// The slot an upload takes within `range`: a free one, else the policy's lowest among those
    /// not `busy`.
    fn victim(&self, policy: SlotPolicy, busy: &[bool], range: std::ops::Range<usize>) -> Option<usize> {
        let busy = |s: usize| busy[s] || self.copying.get(s).copied().unwrap_or(false);
        if let Some(s) = range.clone().find(|&s| self.owner[s].is_none() && !busy(s)) {
            return Some(s);
        }
        let mut best: Option<(usize, f32, u64)> = None;
        for s in range {
            let (owner, is_busy) = (&self.owner[s], busy(s));
            if is_busy {
                continue;
            }
            let score = match (policy, owner) {
                (SlotPolicy::Lfu, Some((l, e))) => self.score[*l as usize][*e as usize],
                _ => 0.0,
            };
            let lu = self.last_use[s];
            if best.is_none_or(|(_, bs, bl)| score < bs || (score == bs && lu < bl)) {
                best = Some((s, score, lu));
            }
        }
        best.map(|b| b.0)
    }
}

/// One expert's matrices as the product kernel sees them: a weight and the row where the
/// expert's matrix starts in it.
pub(super) struct ExpertMats<'a> {
    pub(super) gate: Option<(&'a WgpuWeight, usize)>,
    pub(super) up: (&'a WgpuWeight, usize),
    pub(super) down: (&'a WgpuWeight, usize),
}

/// A view of `rows` of a pool buffer as a weight, and the row its matrix starts at.
fn slot_weight(buffer: &wgpu::Buffer, p: &Placed) -> (WgpuWeight, usize) {
    let row0 = p.word0 / p.layout.row_words(p.k).max(1);
    let n_rows = row0 + p.n_out;
    let w = WgpuWeight {
        chunks: vec![WeightChunk { buffer: buffer.clone(), row0: 0, n_rows }],
        layout: p.layout,
        k: p.k,
        n_rows,
        shape: vec![p.n_out, p.k],
        name: "expert slot".into(),
        host: None,
    };
    (w, row0)
}

/// Whether rows of `k` values of this type have the same bytes on the GPU as in the file.
fn repacks_in_place(l: &TypeLayout, k: usize) -> bool {
    if l.is_float() {
        k * l.block_bytes() / 8 == 4 * l.row_words(k)
    } else {
        l.copies_verbatim()
    }
}

/// Writes `src` (`n_rows` stored rows of `k` values) into `dst` in the GPU layout, as
/// [`TypeLayout::repack`] does but without an intermediate vector; padding is zeroed (the
/// staging buffer is reused, and the kernels read whole words).
fn repack_into(l: &TypeLayout, src: &[u8], n_rows: usize, k: usize, dst: &mut [u8]) {
    let row_bytes_gpu = 4 * l.row_words(k);
    if l.is_float() {
        let row_bytes = k * l.block_bytes() / 8;
        if row_bytes == row_bytes_gpu {
            dst[..src.len()].copy_from_slice(src);
            return;
        }
        for (r, row) in src.chunks_exact(row_bytes.max(1)).enumerate().take(n_rows) {
            let d = &mut dst[r * row_bytes_gpu..(r + 1) * row_bytes_gpu];
            d[..row_bytes].copy_from_slice(row);
            d[row_bytes..].fill(0);
        }
        return;
    }
    if l.copies_verbatim() {
        dst[..src.len()].copy_from_slice(src);
        return;
    }
    // On the thread pool: a prefill batch uploads most experts of a layer, and grouped Q4_K
    // (the 30B benchmark's experts) repacks at ~4.5 GB/s on one core.
    l.repack_blocks(src, dst);
}

/// `dst.copy_from_slice(src)` on the thread pool in 256 KiB pieces when large: filling a mapped
/// staging buffer (write-combined memory on a discrete GPU) from the page cache or the pager's
/// slab is a CPU copy that one core does at a fraction of the PCIe bandwidth.
fn copy_parallel(dst: wgpu::WriteOnly<'_, [u8]>, src: &[u8]) {
    use rayon::prelude::*;
    const PIECE: usize = 256 << 10;
    debug_assert_eq!(dst.len(), src.len());
    // Whole pieces go to the pool (a `WriteOnly` of a sized piece may cross threads; one of a
    // slice may not), the tail is copied here.
    let (pieces, mut tail) = dst.into_chunks::<PIECE>();
    let (whole, rest) = src.split_at(src.len() / PIECE * PIECE);
    let pieces: Vec<wgpu::WriteOnly<'_, [u8; PIECE]>> = pieces.into_iter().collect();
    pieces.into_par_iter().zip(whole.par_chunks(PIECE)).for_each(|(d, s)| {
        let mut d: wgpu::WriteOnly<'_, [u8]> = d.into();
        d.copy_from_slice(s);
    });
    tail.copy_from_slice(rest);
}

/// Host copies of a layer's expert biases (only read when the CPU computes an expert).
struct HostBiases {
    gate: Option<Vec<f32>>,
    up: Option<Vec<f32>>,
    down: Option<Vec<f32>>,
}

impl HostBiases {
    fn slices(&self) -> ExpertBiases<'_> {
        ExpertBiases { gate: self.gate.as_deref(), up: self.up.as_deref(), down: self.down.as_deref() }
    }
}

/// One expert's FFN on the CPU over tokens `toks` (token, routing weight) of the layer input `x`
/// (`[n, n_embd]`), added into `out` (`[n, n_embd]`) scaled by each token's weight: the CPU back
/// end's arithmetic.
fn host_expert_ffn(
    mode: MatmulMode,
    x: &[f32],
    toks: &[(usize, f32)],
    ex: &HostExpert<'_>,
    biases: &HostBiases,
    spec: &MoeSpec,
    out: &mut [f32],
) -> Result<(), OpError> {
    let (m, e, ff) = (toks.len(), ex.id as usize, spec.n_ff);
    let n_embd = ex.down.n_out;
    // The expert's tokens' rows, one after another: its products' input.
    let xs: Vec<f32> = toks.iter().flat_map(|&(t, _)| x[t * n_embd..(t + 1) * n_embd].iter().copied()).collect();
    let xs = xs.as_slice();
    let mm = |x: &[f32], w: &HostMatrix<'_>, y: &mut [f32]| {
        quant::matmul(w.dtype, w.bytes, w.n_out, w.k, x, y, mode)
            .map_err(|source| OpError::Quant { op: "moe_ffn (cpu expert)", source })
    };
    let add_bias = |v: &mut [f32], b: &Option<Vec<f32>>, width: usize| {
        if let Some(b) = b {
            let row = &b[e * width..(e + 1) * width];
            v.chunks_mut(width).for_each(|r| r.iter_mut().zip(row).for_each(|(x, y)| *x += y));
        }
    };
    let mut up = vec![0f32; m * ff];
    mm(xs, &ex.up, &mut up)?;
    add_bias(&mut up, &biases.up, ff);
    let h: Vec<f32> = match &ex.gate {
        Some(g) => {
            let mut gate = vec![0f32; m * ff];
            mm(xs, g, &mut gate)?;
            add_bias(&mut gate, &biases.gate, ff);
            gate.iter().zip(&up).map(|(&g, &u)| kernels::glu(g, u, spec.glu)).collect()
        }
        None => {
            let act = spec.glu.ungated_act();
            up.iter().map(|&u| kernels::act(u, act)).collect()
        }
    };
    let mut down = vec![0f32; m * n_embd];
    mm(&h, &ex.down, &mut down)?;
    add_bias(&mut down, &biases.down, n_embd);
    for (r, &(t, w)) in toks.iter().enumerate() {
        let o = &mut out[t * n_embd..(t + 1) * n_embd];
        o.iter_mut().zip(&down[r * n_embd..(r + 1) * n_embd]).for_each(|(o, d)| *o += w * d);
    }
    Ok(())
}

/// Uploads written into the current staging buffer and not yet submitted.
struct Batch {
    /// (expert id, slot) of the experts whose copies are in the buffer.
    experts: Vec<(u32, usize)>,
    /// Copies staging → pool or host tier: (staging offset, destination, its offset, bytes).
    copies: Vec<(u64, wgpu::Buffer, u64, u64)>,
    /// Bytes written into the staging buffer.
    used_bytes: u64,
}

impl WgpuBackend {
    /// This back end with a mixture-of-experts model's experts paged through a GPU pool of
    /// `opts.n_slots` slots, misses fetched from `store` (see the module docs). Call it before
    /// loading the model: `weight()` then leaves stacked expert tensors on the host.
    ///
    /// # Errors
    /// [`OpError::Unsupported`] when a slot or a staging buffer exceeds the adapter's limits,
    /// or the upload-bandwidth probe fails.
    pub fn with_expert_store(
        mut self,
        store: Arc<dyn ExpertStore>,
        opts: ExpertTierOptions,
    ) -> Result<WgpuBackend, OpError> {
        let unsupported = |why: String| OpError::Unsupported { op: "with_expert_store", backend: "wgpu", why };
        let slot_bytes = opts.slot_bytes.next_multiple_of(4);
        let max_binding = self.ctx.max_binding;
        if opts.n_slots == 0 || slot_bytes == 0 || slot_bytes > max_binding {
            return Err(unsupported(format!(
                "{} slots of {slot_bytes} bytes: need at least one slot of at most the storage binding limit {max_binding}",
                opts.n_slots
            )));
        }
        let staging_bytes = opts.staging_bytes.max(slot_bytes).next_multiple_of(256);
        if staging_bytes > self.ctx.max_buffer {
            return Err(unsupported(format!(
                "staging buffer of {staging_bytes} bytes exceeds the buffer limit {}",
                self.ctx.max_buffer
            )));
        }
        let slots_per_buffer = ((max_binding / slot_bytes) as usize)
            .min(opts.n_slots)
            .min(opts.max_slots_per_buffer.unwrap_or(usize::MAX));
        if slots_per_buffer == 0 {
            return Err(unsupported("max_slots_per_buffer is 0".into()));
        }
        if matches!(opts.miss, MissPolicy::Host | MissPolicy::Split)
            && !self.ctx.device.features().contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS)
        {
            return Err(unsupported(format!(
                "misses read from host memory need storage buffers in host memory (MAPPABLE_PRIMARY_BUFFERS), which {} does not offer",
                self.ctx.adapter.name
            )));
        }
        let device = &self.ctx.device;
        let mut pool = Vec::new();
        let mut left = opts.n_slots;
        while left > 0 {
            let n = left.min(slots_per_buffer);
            pool.push(device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("expert pool"),
                size: n as u64 * slot_bytes,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
            left -= n;
        }
        let staging: Vec<Staging> = (0..STAGING_BUFFERS)
            .map(|_| Staging {
                buffer: device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("expert staging"),
                    size: staging_bytes,
                    usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                }),
                state: Arc::new(AtomicU8::new(STAGING_READY)),
            })
            .collect();
        let n_slots = opts.n_slots;
        let replace_margin_fixed: Option<f32> =
            std::env::var("DISKFORMER_HOST_REPLACE_MARGIN").ok().and_then(|v| v.parse().ok());
        let mut regions: Vec<std::ops::Range<usize>> =
            (0..pool.len()).map(|b| b * slots_per_buffer..((b + 1) * slots_per_buffer).min(n_slots)).collect();
        // The prefetch's staging slots come off each region's end: the cache never uses them.
        let prefetch = match (&self.ctx.transfer, opts.miss) {
            (Some(t), MissPolicy::Split) => {
                prefetch::Prefetch::new(device, t.clone(), &regions, prefetch::per_call_from_env()).map(Arc::new)
            }
            _ => None,
        };
        if let Some(p) = &prefetch {
            for (r, reserved) in regions.iter_mut().zip(p.reserved()) {
                r.end = reserved.start;
            }
        }
        let copy_refills = match (&self.ctx.transfer, opts.miss) {
            (Some(t), MissPolicy::Split) if super::env_flag("DISKFORMER_SPLIT_COPY_REFILLS") => Some(t.clone()),
            _ => None,
        };
        let mut tier = ExpertTier {
            prefetch,
            copy_refills,
            store,
            opts: ExpertTierOptions {
                slot_bytes,
                staging_bytes,
                prefill_per_layer: if super::env_off("DISKFORMER_POOL_PREFILL") { 0 } else { opts.prefill_per_layer },
                ..opts
            },
            slot_words: (slot_bytes / 4) as usize,
            slots_per_buffer,
            pool,
            regions,
            staging,
            upload_bytes_per_s: 0.0,
            readback: Mutex::new(None),
            profile: Mutex::new(TierProfile::default()),
            spin_readback: !super::env_flag("DISKFORMER_READBACK_BLOCK"),
            replace_margin: replace_margin_fixed.unwrap_or(HOST_REPLACE_MARGIN),
            replace_margin_fixed,
            split: Arc::default(),
            dispatcher: Arc::default(),
            split_fixed: std::env::var("DISKFORMER_SPLIT_SHARE").ok().and_then(|v| v.parse().ok()),
            split_sync: super::env_flag("DISKFORMER_SPLIT_SYNC"),
            split_host_partition: super::env_flag("DISKFORMER_SPLIT_HOST_PARTITION"),
            split_mailbox: !super::env_off("DISKFORMER_SPLIT_MAILBOX"),
            split_step_refill: super::env_off("DISKFORMER_SPLIT_LAYER_REFILL"),
            split_defer_refills: !super::env_off("DISKFORMER_SPLIT_DEFER_REFILLS"),
            split_refills_per_call: match std::env::var("DISKFORMER_SPLIT_REFILLS_PER_CALL")
                .ok()
                .and_then(|v| v.trim().parse().ok())
            {
                Some(0) => usize::MAX,
                Some(n) => n,
                None => 1,
            },
            split_touch: super::env_flag("DISKFORMER_SPLIT_TOUCH"),
            lfu_decay: std::env::var("DISKFORMER_LFU_DECAY")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .filter(|d: &f32| (0.0..1.0).contains(d))
                .unwrap_or(LFU_DECAY),
            refill_max: std::env::var("DISKFORMER_HOST_REFILL_MAX")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(usize::MAX),
            state: Mutex::new(TierState::new(n_slots)),
        };
        tier.upload_bytes_per_s = self.measure_upload(&tier)?;
        self.experts = Some(Arc::new(tier));
        Ok(self)
    }

    /// Bytes per second of a staging upload (fill the mapped buffer on the thread pool, copy it
    /// into the pool, wait), the best of three.
    fn measure_upload(&self, tier: &ExpertTier) -> Result<f64, OpError> {
        let bytes = tier.opts.staging_bytes.min(tier.pool[0].size()) & !255;
        let mut best = f64::INFINITY;
        for i in 0..3 {
            let st = &tier.staging[i % STAGING_BUFFERS];
            self.wait_staging(st)?;
            let src = vec![i as u8; bytes as usize];
            let t = Instant::now();
            copy_parallel(
                st.buffer.get_mapped_range_mut(0..bytes).map_err(|e| self.map_error("staging", e))?.slice(..),
                &src,
            );
            st.buffer.unmap();
            {
                let mut p = lock(&self.ctx.pending);
                p.cmds.push(Cmd::Copy {
                    src: st.buffer.clone(),
                    src_at: 0,
                    dst: tier.pool[0].clone(),
                    dst_at: 0,
                    size: bytes,
                });
                self.ctx.flush_locked(&mut p);
            }
            self.remap_staging(st);
            self.wait_staging(st)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(bytes as f64 / best.max(1e-9))
    }

    fn map_error(&self, what: &str, e: impl std::fmt::Debug) -> OpError {
        OpError::Unsupported { op: "moe_ffn", backend: "wgpu", why: format!("mapping the {what} buffer failed: {e:?}") }
    }

    /// Asks for `st` to be mapped again once the GPU is done with its copies.
    fn remap_staging(&self, st: &Staging) {
        st.state.store(STAGING_PENDING, Ordering::SeqCst);
        let state = st.state.clone();
        st.buffer.map_async(wgpu::MapMode::Write, .., move |r| {
            state.store(if r.is_ok() { STAGING_READY } else { STAGING_FAILED }, Ordering::SeqCst);
        });
    }

    /// Blocks until `st` is mapped.
    fn wait_staging(&self, st: &Staging) -> Result<(), OpError> {
        let mut waited = false;
        loop {
            match st.state.load(Ordering::SeqCst) {
                STAGING_READY => {
                    if waited {
                        super::trace::mark("staging ready", None);
                    }
                    return Ok(());
                }
                STAGING_FAILED => return Err(self.map_error("staging", "map_async reported an error")),
                _ => {
                    if !std::mem::replace(&mut waited, true) {
                        super::trace::mark("staging wait", None);
                    }
                    self.ctx.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| OpError::Unsupported {
                        op: "moe_ffn",
                        backend: "wgpu",
                        why: format!("device lost while waiting for a staging buffer: {e}"),
                    })?;
                }
            }
        }
    }

    /// The first `n_bytes` of `src` on the host, through the tier's persistent readback buffer
    /// (submitting everything pending and waiting for it, as `read_back`).
    pub(super) fn read_back_tier(
        &self,
        tier: &ExpertTier,
        src: &wgpu::Buffer,
        n_bytes: u64,
    ) -> Result<Vec<u8>, OpError> {
        Ok(self.read_back_tier_parts(tier, &[(src, n_bytes)], true)?.pop().unwrap_or_default())
    }

    /// The first bytes of several buffers, `(buffer, n_bytes)` each, in one submit and one wait
    /// through the tier's readback buffer; the profile counts it as the routing's readback
    /// (`routing`) or as the CPU experts' activations.
    pub(super) fn read_back_tier_parts(
        &self,
        tier: &ExpertTier,
        parts: &[(&wgpu::Buffer, u64)],
        routing: bool,
    ) -> Result<Vec<Vec<u8>>, OpError> {
        let queued = self.queue_tier_readback(tier, parts);
        self.finish_tier_readback(tier, queued, routing)
    }

    /// The first half of [`WgpuBackend::read_back_tier_parts`]: the copies into the tier's
    /// readback buffer, submitted with everything recorded before them. Work recorded and
    /// submitted after this runs on the GPU while the host waits in
    /// [`WgpuBackend::finish_tier_readback`] (the mapping waits for this submit only).
    pub(super) fn queue_tier_readback(&self, tier: &ExpertTier, parts: &[(&wgpu::Buffer, u64)]) -> QueuedReadback {
        // Copies start and end on 4-byte boundaries (wgpu's copy alignment).
        let starts: Vec<u64> = parts
            .iter()
            .scan(0u64, |at, &(_, n)| {
                let start = *at;
                *at += n.next_multiple_of(4);
                Some(start)
            })
            .collect();
        let total = parts.iter().map(|&(_, n)| n.next_multiple_of(4)).sum::<u64>().max(4);
        let mut held = lock(&tier.readback);
        let rb = match held.as_ref() {
            Some(b) if b.size() >= total => b.clone(),
            _ => {
                let b = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("routing readback"),
                    size: total.next_power_of_two().max(256),
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                *held = Some(b.clone());
                b
            }
        };
        let started = Instant::now();
        {
            let mut p = lock(&self.ctx.pending);
            for (&(src, n), &at) in parts.iter().zip(&starts) {
                if n > 0 {
                    let size = n.next_multiple_of(4);
                    p.cmds.push(Cmd::Copy { src: src.clone(), src_at: 0, dst: rb.clone(), dst_at: at, size });
                }
            }
            self.ctx.flush_locked(&mut p);
            // The host waits for this result, as after `read_back`.
            p.host_waits();
        }
        let lens = parts.iter().map(|&(_, n)| n).collect();
        QueuedReadback { rb, starts, lens, total, started, submitted: Instant::now() }
    }

    /// Waits for a [`QueuedReadback`] and returns its parts' bytes.
    pub(super) fn finish_tier_readback(
        &self,
        tier: &ExpertTier,
        q: QueuedReadback,
        routing: bool,
    ) -> Result<Vec<Vec<u8>>, OpError> {
        let used = q.lens.last().map_or(0, |&n| q.starts[q.starts.len() - 1] + n);
        let waiting = Instant::now();
        let out = self.read_mapped("route", &q.rb, q.total, used, tier.spin_readback, <[u8]>::to_vec);
        let mut prof = lock(&tier.profile);
        if routing {
            prof.readback_submit_secs += (q.submitted - q.started).as_secs_f64();
            prof.readback_wait_secs += waiting.elapsed().as_secs_f64();
            prof.readbacks += 1;
        } else {
            prof.cpu_readback_secs += (q.submitted - q.started).as_secs_f64() + waiting.elapsed().as_secs_f64();
        }
        drop(prof);
        let bytes = out?;
        Ok(q.lens.iter().zip(&q.starts).map(|(&n, &at)| bytes[at as usize..(at + n) as usize].to_vec()).collect())
    }

    /// Whether this back end pages experts through a GPU pool.
    pub fn has_expert_tier(&self) -> bool {
        self.experts.is_some()
    }

    /// Per-layer counters of the GPU expert tier, indexed by layer (`None` without a tier).
    /// Under [`MissPolicy::Host`] the last step's selections are counted first (its id log is
    /// read back; a failed readback leaves them out).
    pub fn expert_tier_stats(&self) -> Option<Vec<ExpertTierStats>> {
        self.experts.as_ref().map(|t| {
            let mut st = lock(&t.state);
            let _ = self.drain_log(t, &mut st);
            // The split's dispatched layers counted so far (all of them once the output of
            // their step was read).
            let _ = self.take_decided(t, &mut st, false);
            st.stats.clone()
        })
    }

    /// The counters of every layer added up (`None` without a tier).
    pub fn expert_tier_total(&self) -> Option<ExpertTierStats> {
        let stats = self.expert_tier_stats()?;
        let mut t = ExpertTierStats::default();
        stats.iter().for_each(|s| t.add(s));
        Some(t)
    }

    /// Split layers whose ids and CPU sum went through the mailboxes (`split::SplitMailboxes`)
    /// since the profile was last reset (tests: that a Vulkan device takes that path).
    #[doc(hidden)]
    pub fn split_mailbox_layers(&self) -> u64 {
        self.experts.as_ref().map_or(0, |t| lock(&t.profile).split_mailbox_layers)
    }

    /// Sets the tier's counters and host-time profile to zero (the pool keeps its contents).
    pub fn reset_expert_tier_stats(&self) {
        if let Some(t) = &self.experts {
            let mut st = lock(&t.state);
            let _ = self.drain_log(t, &mut st);
            st.stats.iter_mut().for_each(|s| *s = ExpertTierStats::default());
            *lock(&t.profile) = TierProfile::default();
        }
    }

    /// Bytes of the expert pool and of the staging ring (`None` without a tier).
    pub fn expert_tier_bytes(&self) -> Option<(u64, u64)> {
        self.experts.as_ref().map(|t| (t.pool_bytes(), t.staging.iter().map(|s| s.buffer.size()).sum()))
    }

    /// Upload bandwidth measured when the tier was built, in bytes per second.
    pub fn expert_upload_bytes_per_s(&self) -> Option<f64> {
        self.experts.as_ref().map(|t| t.upload_bytes_per_s)
    }

    /// Device memory held in buffers right now, as wgpu counts it; 0 unless wgpu was built
    /// with its `counters` feature (the tests enable it to check the GPU budget).
    pub fn device_buffer_bytes(&self) -> u64 {
        self.ctx.device.get_internal_counters().hal.buffer_memory.read().max(0) as u64
    }

    /// Memory the device's allocator holds right now: every block it took from the driver,
    /// the unused parts included (what a budget must cover; `nvidia-smi` adds the driver's own
    /// context). All memory types together: on a GPU with resizable BAR the upload staging is
    /// device memory too, readback buffers are host memory. `None` where the back end keeps no
    /// allocator (not Vulkan, DX12 or Metal).
    pub fn device_reserved_bytes(&self) -> Option<u64> {
        self.ctx.device.generate_allocator_report().map(|r| r.total_reserved_bytes)
    }

    /// A table of the tier's per-layer counters and their total, for `--stats`.
    pub fn format_expert_tier_stats(&self) -> Option<String> {
        let t = self.experts.as_ref()?;
        let mut st = lock(&t.state);
        let _ = self.drain_log(t, &mut st);
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let mut out = format!(
            "GPU expert tier: {} slots of {:.2} MiB ({:.1} MiB pool, {:?}, misses {:?}), staging {} x {:.1} MiB, upload {:.2} GB/s measured{}\n",
            t.opts.n_slots,
            mib(t.opts.slot_bytes),
            mib(t.pool_bytes()),
            t.opts.policy,
            t.opts.miss,
            STAGING_BUFFERS,
            mib(t.opts.staging_bytes),
            t.upload_bytes_per_s / 1e9,
            st.cpu_secs_per_expert_token
                .map_or(String::new(), |s| format!(", CPU {:.3} ms per expert and token", s * 1e3)),
        );
        if let Some(reserved) = self.device_reserved_bytes() {
            // The host tier's buffers from wgpu's allocator are its blocks too, in system RAM:
            // shown apart.
            let host = if t.reads_host() { st.host.allocator_bytes() } else { 0 };
            out.push_str(&format!(
                "memory held by the GPU allocator: {:.1} MiB besides the host tier's {:.1} MiB (the driver's context is extra)\n",
                mib(reserved.saturating_sub(host)),
                mib(host)
            ));
        }
        if t.reads_host() {
            let fills: Vec<&str> = [HostFill::Import, HostFill::Mapped, HostFill::Staged]
                .into_iter()
                .filter(|f| st.host.layers.iter().flatten().any(|h| h.fill == *f))
                .map(HostFill::name)
                .collect();
            out.push_str(&format!(
                "host tier: {:.1} MiB in host memory ({} layers, {}), read by the GPU on a miss; {} experts copied into the pool at the layers' first calls\n",
                mib(st.host.bytes),
                st.host.layers.iter().flatten().count(),
                fills.join(" and "),
                st.stats.iter().map(|s| s.prefilled).sum::<u64>()
            ));
        }
        out.push_str(
            "layer  selected      hits    misses   uploads  upload MiB  cpu experts  evicted  host reads  hit rate\n",
        );
        let row = |name: String, s: &ExpertTierStats| {
            format!(
                "{name:>5} {:>9} {:>9} {:>9} {:>9} {:>11.1} {:>12} {:>8} {:>11} {:>8.1}%\n",
                s.selections,
                s.hits,
                s.misses,
                s.uploads,
                mib(s.bytes_uploaded),
                s.cpu_computed,
                s.evictions,
                s.host_reads,
                100.0 * s.hits as f64 / s.selections.max(1) as f64
            )
        };
        let mut total = ExpertTierStats::default();
        for (il, s) in st.stats.iter().enumerate() {
            if s.selections > 0 {
                out.push_str(&row(il.to_string(), s));
                total.add(s);
            }
        }
        out.push_str(&row("all".into(), &total));
        if let Some(best) = hindsight_hits(&st.selected_count, &st.region_of, &t.regions) {
            out.push_str(&format!(
                "hindsight: a fixed pool of each region's most selected experts of this run would have hit {:.1}% (the policy: {:.1}%)\n",
                100.0 * best as f64 / total.selections.max(1) as f64,
                100.0 * total.hits as f64 / total.selections.max(1) as f64
            ));
        }
        out.push_str(&lock(&t.profile).report());
        if let Some(p) = &t.prefetch {
            // The partition's counts of announced misses whose copies had landed, and not.
            let counts = self.read_back_tier(t, &p.tags, 8).ok().map(|b| {
                let word = |i: usize| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
                (word(prefetch::STAT_LANDED), word(prefetch::STAT_LATE))
            });
            out.push_str(&format!(
                "prefetch on the copy queue: {} experts announced, {} announcements refused (ring busy), {} copies done by the next hand-over; misses among them landed by the second pass {}, late {}\n",
                p.issued.load(std::sync::atomic::Ordering::Relaxed),
                p.refused.load(std::sync::atomic::Ordering::Relaxed),
                p.done_by_hand_over.load(std::sync::atomic::Ordering::Relaxed),
                counts.map_or("?".into(), |c| c.0.to_string()),
                counts.map_or("?".into(), |c| c.1.to_string()),
            ));
        }
        Some(out)
    }

    /// One expert's FFN over the tokens `toks` (token, index into the routing weights) on the
    /// GPU, scatter-added into `out`.
    #[allow(clippy::too_many_arguments)] // the op's inputs, the expert and where it lives
    pub(super) fn expert_on_gpu(
        &self,
        x: &WgpuTensor,
        e: usize,
        toks: &[(u32, u32)],
        mats: &ExpertMats<'_>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
        routing: &RouteView<'_>,
        out: &WgpuTensor,
    ) -> Result<(), OpError> {
        if self.expert_pairs_q8(x, e, toks, mats, experts, spec, routing, out)? {
            return Ok(());
        }
        let n_embd = x.width();
        let ff = spec.n_ff;
        let m = toks.len();
        let rows: Vec<u32> = toks.iter().map(|&(t, _)| t).collect();
        let map: Vec<u32> = toks.iter().flat_map(|&(t, w)| [t, w]).collect();
        let rows_b = self.upload("moe rows", bytemuck::cast_slice(&rows))?;
        let xs = self.alloc("moe gather", &[m, n_embd])?;
        self.dispatch(
            self.plain(Plain::GatherRows),
            &[&x.buf.buffer, &rows_b.buffer, &xs.buf.buffer],
            &[m as u32, n_embd as u32, 0, 0],
            super::grid((m * n_embd).div_ceil(256)),
        );
        let up = self.alloc("moe up", &[m, ff])?;
        self.matmul_into(&xs, mats.up.0, &up, Span::rows(mats.up.1, ff))?;
        let up = match &experts.up_bias {
            Some(b) => self.binary("moe up bias", &up, b, 0, Some(e))?,
            None => up,
        };
        let h = match (&mats.gate, &experts.gate) {
            (Some((g, g_row0)), Some(_)) => {
                let gate = self.alloc("moe gate", &[m, ff])?;
                self.matmul_into(&xs, g, &gate, Span::rows(*g_row0, ff))?;
                let gate = match &experts.gate_bias {
                    Some(b) => self.binary("moe gate bias", &gate, b, 0, Some(e))?,
                    None => gate,
                };
                self.glu(&gate, &up, spec.glu)?
            }
            (None, None) => {
                let a = spec.glu.ungated_act();
                self.act(&up, a)?
            }
            _ => {
                return Err(OpError::ShapeMismatch {
                    op: "moe_ffn gate",
                    expected: format!("a gate matrix for expert {e} exactly when the layer has gates"),
                    got: vec![mats.gate.is_some() as usize, experts.gate.is_some() as usize],
                })
            }
        };
        let down = self.alloc("moe down", &[m, n_embd])?;
        self.matmul_into(&h, mats.down.0, &down, Span::rows(mats.down.1, n_embd))?;
        let map_b = self.upload("moe map", bytemuck::cast_slice(&map))?;
        let bias = experts.down_bias.as_ref().map_or(&self.ctx.dummy, |b| &b.buf.buffer);
        self.dispatch(
            self.plain(Plain::ScatterAdd),
            &[&down.buf.buffer, &map_b.buffer, &routing.weights.buf.buffer, bias, &out.buf.buffer],
            &[m as u32, n_embd as u32, experts.down_bias.is_some() as u32, (e * n_embd) as u32],
            super::grid((m * n_embd).div_ceil(256)),
        );
        Ok(())
    }

    /// [`expert_on_gpu`](Self::expert_on_gpu) through the int8 per-pair kernels (`moe.rs`), each
    /// of the expert's tokens a pair with weight 1 (the scatter-add applies the router's weight
    /// and the down bias), up to [`moe::MAX_HOST_PAIRS`] tokens per dispatch; `false` (nothing
    /// recorded) when they do not apply: int8 activations off, a type or width they do not take,
    /// or a matrix not in one buffer.
    ///
    /// Why: a prefill batch gives an expert a few dozen tokens, and the general product kernels
    /// made few workgroups of them (the tiled kernel: 64 rows x 64 tokens each, 12 workgroups for
    /// a 768-row expert on the H200's 132 units, 262 us per product in the fifth session's
    /// profile). Per pair, a 768-row gate/up is 24 row groups per token and the expert's weights
    /// come from L2 after the first token; four dispatches per expert instead of six.
    #[allow(clippy::too_many_arguments)] // expert_on_gpu's inputs
    fn expert_pairs_q8(
        &self,
        x: &WgpuTensor,
        e: usize,
        toks: &[(u32, u32)],
        mats: &ExpertMats<'_>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
        routing: &RouteView<'_>,
        out: &WgpuTensor,
    ) -> Result<bool, OpError> {
        let n_embd = x.width();
        let ff = spec.n_ff;
        // Each matrix one buffer from its row 0, addressed by the word of its first row.
        fn whole((w, row0): (&WgpuWeight, usize), k: usize) -> Option<(&wgpu::Buffer, TypeLayout, u32)> {
            match &w.chunks[..] {
                [c] if c.row0 == 0 && w.k == k => Some((&c.buffer, w.layout, (row0 * w.layout.row_words(k)) as u32)),
                _ => None,
            }
        }
        let gate = match mats.gate {
            Some(g) => match whole(g, n_embd) {
                Some(g) => Some(g),
                None => return Ok(false),
            },
            None => None,
        };
        let (Some(up), Some(down)) = (whole(mats.up, n_embd), whole(mats.down, ff)) else { return Ok(false) };
        let fused =
            moe::FusedMats { gate: gate.map(|g| (g.0, g.1)), up: (up.0, up.1), down: (down.0, down.1), host: None };
        if toks.is_empty() || !self.moe_q8_applies(n_embd, ff, 1, &fused) {
            return Ok(false);
        }
        let entry = [e as u32, gate.map_or(0, |g| g.2), up.2, down.2];
        let biases = [experts.gate_bias.as_ref(), experts.up_bias.as_ref(), None];
        let bias = experts.down_bias.as_ref().map_or(&self.ctx.dummy, |b| &b.buf.buffer);
        for part in toks.chunks(moe::MAX_HOST_PAIRS) {
            let m = part.len();
            let rows: Vec<u32> = part.iter().map(|&(t, _)| t).collect();
            // The scatter-add's (token, weight index) pairs, then the pairs' weights of 1 for the
            // kernels: one upload (each makes a buffer).
            let mut map: Vec<u32> = part.iter().flat_map(|&(t, w)| [t, w]).collect();
            map.extend(std::iter::repeat_n(1f32.to_bits(), m));
            let rows_b = self.upload("moe rows", bytemuck::cast_slice(&rows))?;
            let map_b = self.upload("moe map", bytemuck::cast_slice(&map))?;
            let xs = self.alloc("moe gather", &[m, n_embd])?;
            self.dispatch(
                self.plain(Plain::GatherRows),
                &[&x.buf.buffer, &rows_b.buffer, &xs.buf.buffer],
                &[m as u32, n_embd as u32, 0, 0],
                super::grid((m * n_embd).div_ceil(256)),
            );
            let table = moe::PairTable::Host(vec![entry; m]);
            let y = self.moe_pairs(&xs, 1, &table, (&map_b.buffer, 2 * m as u32), &fused, biases, spec)?;
            self.dispatch(
                self.plain(Plain::ScatterAdd),
                &[&y.buf.buffer, &map_b.buffer, &routing.weights.buf.buffer, bias, &out.buf.buffer],
                &[m as u32, n_embd as u32, experts.down_bias.is_some() as u32, (e * n_embd) as u32],
                super::grid((m * n_embd).div_ceil(256)),
            );
        }
        Ok(true)
    }

    /// `moe_ffn` through the expert tier: hits in place, misses uploaded or computed on the CPU
    /// (see the module docs). `by_expert[e]` lists (token, routing index) of expert e.
    ///
    /// A decode step whose GPU experts all fit the layer's pool buffer at once is computed by
    /// the per-pair kernels (two dispatches) after its uploads; otherwise each expert is its own
    /// set of dispatches, hits first, misses as their uploads land.
    pub(super) fn moe_ffn_tiered(
        &self,
        tier: &ExpertTier,
        x: &WgpuTensor,
        routing: &RouteView<'_>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
        by_expert: &[Vec<(u32, u32)>],
    ) -> Result<WgpuTensor, OpError> {
        self.moe_ffn_tiered_counted(tier, x, routing, experts, spec, by_expert, true)
    }

    /// [`Self::moe_ffn_tiered`]; `count_step` false when the caller counted the call's step.
    #[allow(clippy::too_many_arguments)] // moe_ffn_tiered's inputs and the flag
    fn moe_ffn_tiered_counted(
        &self,
        tier: &ExpertTier,
        x: &WgpuTensor,
        routing: &RouteView<'_>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
        by_expert: &[Vec<(u32, u32)>],
        count_step: bool,
    ) -> Result<WgpuTensor, OpError> {
        let t_start = Instant::now();
        let layer = experts.layer;
        let n = x.rows();
        let n_embd = x.width();
        let mut st = lock(&tier.state);
        let st = &mut *st;
        st.ensure_layer(layer, spec.n_expert);
        let range = tier.regions[st.region(layer, &tier.regions)].clone();
        st.tick += 1;
        let tick = st.tick;
        if count_step && st.last_layer.is_none_or(|l| layer <= l) {
            lock(&tier.profile).steps += 1;
        }
        st.last_layer = Some(layer);
        let used: Vec<u32> = (0..spec.n_expert as u32).filter(|&e| !by_expert[e as usize].is_empty()).collect();
        let chosen = used.iter().map(|&e| (e, by_expert[e as usize].len() as u32));
        st.note_selected_by(layer, chosen, n, (tier.opts.policy == SlotPolicy::Lfu).then_some(tier.lfu_decay));
        let (hits, misses): (Vec<u32>, Vec<u32>) =
            used.iter().partition(|&&e| st.slot_of[layer][e as usize] != NO_SLOT);
        {
            let s = &mut st.stats[layer];
            s.selections += used.len() as u64;
            s.hits += hits.len() as u64;
            s.misses += misses.len() as u64;
        }
        let on_cpu = self.choose_cpu_misses(tier, st, &misses, by_expert, spec.n_expert, &range);
        let n_gpu = hits.len() + misses.iter().filter(|&&e| !on_cpu[e as usize]).count();
        let pairs = moe::pairs_fit(n, routing.k, n_embd, spec.n_ff) && n_gpu <= range.len();
        // The grouped path adds each expert into `out` as it goes; the per-pair kernels write
        // their own output at the end.
        let out = if pairs { None } else { Some(self.from_host(&vec![0f32; n * n_embd], &[n, n_embd])?) };
        let mut busy = vec![false; tier.opts.n_slots];
        for &e in &hits {
            let slot = st.slot_of[layer][e as usize] as usize;
            st.last_use[slot] = tick;
            match &out {
                // Computed at the end: no upload of this call may take its slot.
                None => busy[slot] = true,
                Some(out) => self.expert_from_slot(
                    tier,
                    st,
                    slot,
                    x,
                    e as usize,
                    &by_expert[e as usize],
                    experts,
                    spec,
                    routing,
                    out,
                )?,
            }
        }
        let t_decided = Instant::now();
        let any_cpu = misses.iter().any(|&e| on_cpu[e as usize]);
        let mut host = if any_cpu {
            // One wait for both (each readback is a round trip of the whole queue).
            let parts = self.read_back_tier_parts(
                tier,
                &[(&x.buf.buffer, 4 * x.len() as u64), (&routing.weights.buf.buffer, 4 * routing.weights.len() as u64)],
                false,
            )?;
            let (x_host, w_host) = (super::le_f32s(&parts[0]), super::le_f32s(&parts[1]));
            let bias = |b: &Option<WgpuTensor>| b.as_ref().map(|b| self.to_host(b)).transpose();
            let biases = HostBiases {
                gate: bias(&experts.gate_bias)?,
                up: bias(&experts.up_bias)?,
                down: bias(&experts.down_bias)?,
            };
            Some((x_host, w_host, biases, vec![0f32; n * n_embd]))
        } else {
            None
        };
        let t_store = Instant::now();
        let out_ref = out.as_ref();
        let mut batch = Batch { experts: Vec::new(), copies: Vec::new(), used_bytes: 0 };
        // Repacked bytes of types whose GPU layout differs from the file's (the mapped view is
        // write-only, so they are assembled here and copied once).
        let mut scratch: Vec<u8> = Vec::new();
        let (mut cpu_secs, mut fill_secs) = (0.0f64, 0.0f64);
        let matmul_mode = tier.opts.cpu_matmul;
        let compute = &mut |group: &[HostExpert<'_>]| -> Result<(), OpError> {
            for ex in group {
                let e = ex.id as usize;
                if e >= by_expert.len() {
                    return Err(OpError::ShapeMismatch {
                        op: "moe_ffn store",
                        expected: format!("expert ids < {}", spec.n_expert),
                        got: vec![e],
                    });
                }
                if (ex.up.n_out, ex.up.k, ex.down.n_out, ex.down.k) != (spec.n_ff, n_embd, n_embd, spec.n_ff) {
                    return Err(OpError::ShapeMismatch {
                        op: "moe_ffn store",
                        expected: format!("up [{}, {n_embd}], down [{n_embd}, {}]", spec.n_ff, spec.n_ff),
                        got: vec![ex.up.n_out, ex.up.k, ex.down.n_out, ex.down.k],
                    });
                }
            }
            let (cpu_group, gpu_group): (Vec<&HostExpert<'_>>, Vec<&HostExpert<'_>>) =
                group.iter().partition(|ex| on_cpu[ex.id as usize]);
            // The CPU's experts and the uploads' staging fills run at once (both on the thread
            // pool): the layer waits for the longer of the two, not their sum.
            let mut cpu_work = || -> Result<Vec<f64>, OpError> {
                let Some((x_host, w_host, biases, cpu_out)) = host.as_mut() else { return Ok(Vec::new()) };
                if n == 1 && !cpu_group.is_empty() {
                    // Every expert's products in one parallel region (decode).
                    let weighted: Vec<(HostExpert<'_>, f32)> = cpu_group
                        .iter()
                        .map(|ex| (**ex, by_expert[ex.id as usize].first().map_or(0.0, |&(_, w)| w_host[w as usize])))
                        .collect();
                    let t0 = Instant::now();
                    experts_one_token(matmul_mode, x_host, &weighted, biases.slices(), spec, cpu_out)?;
                    let each = t0.elapsed().as_secs_f64() / cpu_group.len() as f64;
                    return Ok(vec![each; cpu_group.len()]);
                }
                let mut per_token = Vec::with_capacity(cpu_group.len());
                for ex in &cpu_group {
                    let toks = &by_expert[ex.id as usize];
                    let tw: Vec<(usize, f32)> = toks.iter().map(|&(t, w)| (t as usize, w_host[w as usize])).collect();
                    let t0 = Instant::now();
                    host_expert_ffn(matmul_mode, x_host, &tw, ex, biases, spec, cpu_out)?;
                    per_token.push(t0.elapsed().as_secs_f64() / toks.len().max(1) as f64);
                }
                Ok(per_token)
            };
            let mut upload_work = || -> Result<(), OpError> {
                for ex in &gpu_group {
                    self.stage_upload(
                        tier,
                        st,
                        ex,
                        layer,
                        tick,
                        &range,
                        &mut batch,
                        &mut busy,
                        &mut scratch,
                        x,
                        by_expert,
                        experts,
                        spec,
                        routing,
                        out_ref,
                    )?;
                }
                Ok(())
            };
            let t0 = Instant::now();
            let (cpu_res, up_res, up_secs) = if cpu_group.is_empty() || gpu_group.is_empty() {
                let up = upload_work();
                let up_secs = t0.elapsed().as_secs_f64();
                (cpu_work(), up, up_secs)
            } else {
                let (c, (u, s)) = rayon::join(cpu_work, || {
                    let t = Instant::now();
                    let u = upload_work();
                    (u, t.elapsed().as_secs_f64())
                });
                (c, u, s)
            };
            up_res?;
            let per_token = cpu_res?;
            fill_secs += up_secs;
            for p in per_token {
                cpu_secs += p;
                st.cpu_secs_per_expert_token = Some(st.cpu_secs_per_expert_token.map_or(p, |old| 0.8 * old + 0.2 * p));
                st.stats[layer].cpu_computed += 1;
            }
            Ok(())
        };
        if !misses.is_empty() {
            // The store (the pager, for a model larger than RAM) ranks its RAM slots by the
            // call's tokens as this tier ranks its pool.
            let tokens: Vec<u32> = misses.iter().map(|&e| by_expert[e as usize].len() as u32).collect();
            tier.store.with_host_experts_of_tokens(layer, &misses, &tokens, n, compute)?;
        }
        let t_record = Instant::now();
        self.finish_batch(tier, st, &mut batch, &mut busy, x, by_expert, experts, spec, routing, out_ref)?;
        let y = match out {
            Some(out) => out,
            None => self.tier_pairs(tier, st, x, routing, experts, spec, &on_cpu)?,
        };
        let y = match host {
            Some((_, _, _, cpu_out)) => self.add(&y, &self.from_host(&cpu_out, &[n, n_embd])?)?,
            None => y,
        };
        let mut prof = lock(&tier.profile);
        prof.calls += 1;
        prof.decide_secs += (t_decided - t_start).as_secs_f64();
        prof.store_secs += (t_record - t_store).as_secs_f64();
        prof.cpu_secs += cpu_secs;
        prof.fill_secs += fill_secs;
        prof.record_secs += t_record.elapsed().as_secs_f64();
        Ok(y)
    }

    /// Which of this call's misses the CPU computes (indexed by expert id). `Auto`: an expert
    /// goes to the CPU when its measured CPU time is below its upload's share (an upload serves
    /// this call and every later hit on its slot, so its cost is divided by the selections per
    /// upload seen so far: high while the pool holds what the router picks, near 1 when it
    /// thrashes; before any upload it is the selection count, so a cold pool fills first). Then,
    /// since the CPU's experts and the uploads run at once, uploads move to the CPU while that
    /// shortens the longer of the two.
    fn choose_cpu_misses(
        &self,
        tier: &ExpertTier,
        st: &TierState,
        misses: &[u32],
        by_expert: &[Vec<(u32, u32)>],
        n_expert: usize,
        range: &std::ops::Range<usize>,
    ) -> Vec<bool> {
        let mut on_cpu = vec![false; n_expert];
        let upload_secs = tier.opts.slot_bytes as f64 / tier.upload_bytes_per_s.max(1.0);
        let (selections, uploads) =
            st.stats.iter().fold((0u64, 0u64), |(sel, up), s| (sel + s.selections, up + s.uploads));
        let uses_per_upload = (selections as f64 / uploads.max(1) as f64).max(1.0);
        match tier.opts.miss {
            MissPolicy::Upload | MissPolicy::Host | MissPolicy::Split => return on_cpu,
            MissPolicy::Cpu => {
                // Free slots are filled all the same (an upload that evicts nothing): a pool
                // left empty would make the budget's GPU memory serve no hit at all.
                let mut free = range.clone().filter(|&s| st.owner[s].is_none()).count();
                for &e in misses {
                    if free > 0 {
                        free -= 1;
                    } else {
                        on_cpu[e as usize] = true;
                    }
                }
                return on_cpu;
            }
            MissPolicy::Auto => {}
        }
        let Some(per_token) = st.cpu_secs_per_expert_token else {
            // Measured on first use: the first miss goes to the CPU.
            if let Some(&e) = misses.first() {
                on_cpu[e as usize] = true;
            }
            return on_cpu;
        };
        let cpu_cost = |e: u32| per_token * by_expert[e as usize].len() as f64;
        let (mut cpu_total, mut up_total) = (0.0, 0.0);
        let mut uploaded = Vec::new();
        for &e in misses {
            if cpu_cost(e) * uses_per_upload < upload_secs {
                on_cpu[e as usize] = true;
                cpu_total += cpu_cost(e);
            } else {
                up_total += upload_secs;
                uploaded.push(e);
            }
        }
        // Cheapest on the CPU first.
        uploaded.sort_by(|&a, &b| cpu_cost(a).total_cmp(&cpu_cost(b)));
        for e in uploaded {
            if cpu_total + cpu_cost(e) >= up_total - upload_secs || super::env_flag("DISKFORMER_NO_MISS_SPLIT") {
                break;
            }
            on_cpu[e as usize] = true;
            cpu_total += cpu_cost(e);
            up_total -= upload_secs;
        }
        on_cpu
    }

    /// Writes one missed expert into the current staging buffer and gives it a victim slot
    /// among those this call does not still need (submitting the batch first when no slot is
    /// free or the staging buffer is full).
    #[allow(clippy::too_many_arguments)] // moe_ffn's inputs, the tier's state and the batch
    fn stage_upload(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        ex: &HostExpert<'_>,
        layer: usize,
        tick: u64,
        range: &std::ops::Range<usize>,
        batch: &mut Batch,
        busy: &mut [bool],
        scratch: &mut Vec<u8>,
        x: &WgpuTensor,
        by_expert: &[Vec<(u32, u32)>],
        experts: &Experts<Self>,
        spec: &MoeSpec,
        routing: &RouteView<'_>,
        out: Option<&WgpuTensor>,
    ) -> Result<(), OpError> {
        let e = ex.id as usize;
        let slot = match st.victim(tier.opts.policy, busy, range.clone()) {
            Some(s) => s,
            None => {
                self.finish_batch(tier, st, batch, busy, x, by_expert, experts, spec, routing, out)?;
                st.victim(tier.opts.policy, busy, range.clone()).ok_or_else(|| OpError::Unsupported {
                    op: "moe_ffn",
                    backend: "wgpu",
                    why: "no GPU expert slot is free".into(),
                })?
            }
        };
        let mats = tier.place(slot, ex)?;
        let expert_gpu_bytes: u64 = [mats.gate, Some(mats.up), Some(mats.down)]
            .iter()
            .flatten()
            .map(|p| (4 * p.n_out * p.layout.row_words(p.k)) as u64)
            .sum();
        if batch.used_bytes + expert_gpu_bytes > tier.opts.staging_bytes {
            self.finish_batch(tier, st, batch, busy, x, by_expert, experts, spec, routing, out)?;
        }
        if let Some((ol, oe)) = st.owner[slot].take() {
            st.slot_of[ol as usize][oe as usize] = NO_SLOT;
            st.stats[layer].evictions += 1;
        }
        st.owner[slot] = Some((layer as u32, ex.id));
        st.slot_of[layer][e] = slot as u32;
        st.mats[slot] = Some(mats);
        st.last_use[slot] = tick;
        busy[slot] = true;
        let (buf, _) = tier.slot_base(slot);
        match st.host.layers.get(layer).and_then(|h| h.as_ref()) {
            // The host tier (a prefill's misses) holds the expert in GPU-visible host memory
            // already: one DMA copy per matrix, as the refills between steps, where the staging
            // path read the store and filled a staging buffer on the CPU first (its 4-5 GB/s
            // memcpy into write-combined memory, against PCIe's tens of GB/s).
            Some(h) => {
                let from = h.mats[e];
                for (src, dst) in
                    [(from.gate, mats.gate), (Some(from.up), Some(mats.up)), (Some(from.down), Some(mats.down))]
                {
                    let (Some(src), Some(dst)) = (src, dst) else { continue };
                    let size = (4 * src.n_out * src.layout.row_words(src.k)) as u64;
                    self.copy(&h.buffer, 4 * src.word0 as u64, &tier.pool[buf], 4 * dst.word0 as u64, size);
                }
            }
            None => self.stage_matrices(tier, st, ex, &mats, &tier.pool[buf], batch, scratch)?,
        }
        let s = &mut st.stats[layer];
        s.uploads += 1;
        s.bytes_uploaded += expert_gpu_bytes;
        batch.experts.push((ex.id, slot));
        Ok(())
    }

    /// The per-pair kernels over the experts of this call that hold a slot (all of them but
    /// those `on_cpu`, which the table skips). Every one is in the layer's pool buffer.
    #[allow(clippy::too_many_arguments)] // moe_ffn's inputs, the tier and its state, the CPU's share
    fn tier_pairs(
        &self,
        tier: &ExpertTier,
        st: &TierState,
        x: &WgpuTensor,
        routing: &RouteView<'_>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
        on_cpu: &[bool],
    ) -> Result<WgpuTensor, OpError> {
        let layer = experts.layer;
        let mut table = Vec::with_capacity(routing.ids.len());
        let mut placed: Option<(SlotMats, usize)> = None;
        for &e in routing.ids {
            if on_cpu[e as usize] {
                table.push([moe::SKIP, 0, 0, 0]);
                continue;
            }
            let slot = st.slot_of[layer][e as usize];
            let mats =
                (slot != NO_SLOT).then(|| st.mats[slot as usize]).flatten().ok_or_else(|| OpError::Unsupported {
                    op: "moe_ffn",
                    backend: "wgpu",
                    why: format!("expert {e} of layer {layer} was to be in a GPU slot but is not"),
                })?;
            table.push([e, mats.gate.map_or(0, |g| g.word0 as u32), mats.up.word0 as u32, mats.down.word0 as u32]);
            placed.get_or_insert((mats, tier.slot_base(slot as usize).0));
        }
        let n = x.rows();
        let Some((mats, buf)) = placed else {
            // Every expert on the CPU: the GPU part is zero.
            return self.from_host(&vec![0f32; n * x.width()], &[n, x.width()]);
        };
        let pool = &tier.pool[buf];
        let fused = moe::FusedMats {
            gate: mats.gate.map(|g| (pool, g.layout)),
            up: (pool, mats.up.layout),
            down: (pool, mats.down.layout),
            host: None,
        };
        let biases = [experts.gate_bias.as_ref(), experts.up_bias.as_ref(), experts.down_bias.as_ref()];
        self.moe_pairs(
            x,
            routing.k,
            &moe::PairTable::Host(table),
            (&routing.weights.buf.buffer, 0),
            &fused,
            biases,
            spec,
        )
    }

    /// Writes the matrices of `ex` into the current staging buffer (from `batch.used_bytes` on,
    /// which must leave room for them) in the GPU layout, and adds their copies to `dst` at
    /// the words `mats` gives.
    #[allow(clippy::too_many_arguments)]
    fn stage_matrices(
        &self,
        tier: &ExpertTier,
        st: &TierState,
        ex: &HostExpert<'_>,
        mats: &SlotMats,
        dst: &wgpu::Buffer,
        batch: &mut Batch,
        scratch: &mut Vec<u8>,
    ) -> Result<(), OpError> {
        let staging = &tier.staging[st.next_staging];
        if batch.used_bytes == 0 {
            self.wait_staging(staging)?;
        }
        for (p, m) in [(mats.gate, ex.gate), (Some(mats.up), Some(ex.up)), (Some(mats.down), Some(ex.down))] {
            let (Some(p), Some(m)) = (p, m) else { continue };
            let size = (4 * p.n_out * p.layout.row_words(p.k)) as u64;
            let at = batch.used_bytes;
            {
                let mut view =
                    staging.buffer.get_mapped_range_mut(at..at + size).map_err(|e| self.map_error("staging", e))?;
                if repacks_in_place(&p.layout, m.k) {
                    copy_parallel(view.slice(..), m.bytes);
                } else {
                    scratch.resize(size as usize, 0);
                    repack_into(&p.layout, m.bytes, m.n_out, m.k, scratch);
                    copy_parallel(view.slice(..), scratch);
                }
            }
            batch.copies.push((at, dst.clone(), 4 * p.word0 as u64, size));
            // Mapped ranges start on 8 bytes; copies on 4.
            batch.used_bytes = (at + size).next_multiple_of(8);
        }
        Ok(())
    }

    /// Submits the batch's copies from its staging buffer, re-maps that buffer for later, and
    /// records the products of the batch's experts from their slots into `out` (with `None`, the
    /// per-pair kernels compute them later: their slots stay busy).
    #[allow(clippy::too_many_arguments)]
    fn finish_batch(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        batch: &mut Batch,
        busy: &mut [bool],
        x: &WgpuTensor,
        by_expert: &[Vec<(u32, u32)>],
        experts: &Experts<Self>,
        spec: &MoeSpec,
        routing: &RouteView<'_>,
        out: Option<&WgpuTensor>,
    ) -> Result<(), OpError> {
        // Copies from the host tier are recorded as they are made: a batch may have experts and
        // no staged copies.
        if batch.copies.is_empty() && batch.experts.is_empty() {
            return Ok(());
        }
        self.submit_staged(tier, st, batch);
        for (id, slot) in std::mem::take(&mut batch.experts) {
            let Some(out) = out else { continue };
            self.expert_from_slot(
                tier,
                st,
                slot,
                x,
                id as usize,
                &by_expert[id as usize],
                experts,
                spec,
                routing,
                out,
            )?;
            busy[slot] = false;
        }
        Ok(())
    }

    /// Records expert `e`'s FFN reading its matrices from `slot`.
    #[allow(clippy::too_many_arguments)]
    fn expert_from_slot(
        &self,
        tier: &ExpertTier,
        st: &TierState,
        slot: usize,
        x: &WgpuTensor,
        e: usize,
        toks: &[(u32, u32)],
        experts: &Experts<Self>,
        spec: &MoeSpec,
        routing: &RouteView<'_>,
        out: &WgpuTensor,
    ) -> Result<(), OpError> {
        let mats = st.mats[slot].ok_or_else(|| OpError::Unsupported {
            op: "moe_ffn",
            backend: "wgpu",
            why: format!("expert slot {slot} is marked held but has no matrices"),
        })?;
        let (buf, _) = tier.slot_base(slot);
        let buffer = &tier.pool[buf];
        let gate = mats.gate.map(|p| slot_weight(buffer, &p));
        let up = slot_weight(buffer, &mats.up);
        let down = slot_weight(buffer, &mats.down);
        let m = ExpertMats { gate: gate.as_ref().map(|(w, r)| (w, *r)), up: (&up.0, up.1), down: (&down.0, down.1) };
        self.expert_on_gpu(x, e, toks, &m, experts, spec, routing, out)
    }
}

/// Bytes of the id log when first made (grown when a step logs more).
const LOG_MIN_BYTES: u64 = 16 << 10;

impl ExpertTier {
    /// Whether the CPU computes misses during a step ([`MissPolicy::Cpu`], [`MissPolicy::Auto`],
    /// [`MissPolicy::Split`]).
    pub(super) fn computes_on_cpu(&self) -> bool {
        matches!(self.opts.miss, MissPolicy::Cpu | MissPolicy::Auto | MissPolicy::Split)
    }

    /// Whether misses are read from the host tier ([`MissPolicy::Host`], [`MissPolicy::Split`]).
    pub(super) fn reads_host(&self) -> bool {
        matches!(self.opts.miss, MissPolicy::Host | MissPolicy::Split)
    }

    /// The placement [`ExpertTier::place_at`] gives matrices of the same types and shapes as
    /// `like`, for a slot starting at word `base`.
    fn place_like(&self, base: usize, like: &SlotMats) -> SlotMats {
        let mut at = base;
        let mut put = |p: &Placed| {
            let rw = p.layout.row_words(p.k);
            let word0 = at.next_multiple_of(rw.max(1));
            at = word0 + p.n_out * rw;
            Placed { word0, ..*p }
        };
        let gate = like.gate.as_ref().map(&mut put);
        let up = put(&like.up);
        let down = put(&like.down);
        SlotMats { gate, up, down }
    }
}

/// Rewrites the slot table's host copy from the pool's owners (after the upload path changed
/// the pool): an expert in a slot is read there, every other from the host tier.
fn sync_table_with_pool(st: &mut TierState) {
    let row = st.host.row;
    for (l, h) in st.host.layers.iter().enumerate() {
        let Some(h) = h else { continue };
        for (e, hm) in h.mats.iter().enumerate() {
            let slot = st.slot_of.get(l).and_then(|v| v.get(e)).copied().unwrap_or(NO_SLOT);
            st.host.table[l * row + e] = match st.mats.get(slot as usize).copied().flatten() {
                Some(m) if slot != NO_SLOT => table_entry(IN_POOL, &m),
                _ => table_entry(IN_HOST, hm),
            };
        }
    }
    st.host.table_dirty = true;
}

/// A table entry: where the expert is and its matrices' first words there.
fn table_entry(place: u32, m: &SlotMats) -> [u32; 4] {
    [place, m.gate.map_or(0, |g| g.word0 as u32), m.up.word0 as u32, m.down.word0 as u32]
}

/// The copies, in bytes, that move an expert's matrices from where `from` places them to where
/// `to` does (the host copy and a pool slot share the layout).
fn copy_regions(from: &SlotMats, to: &SlotMats) -> Vec<super::transfer::CopyRegion> {
    [(from.gate, to.gate), (Some(from.up), Some(to.up)), (Some(from.down), Some(to.down))]
        .into_iter()
        .filter_map(|(f, t)| Some((f?, t?)))
        .map(|(f, t)| super::transfer::CopyRegion {
            src_offset: 4 * f.word0 as u64,
            dst_offset: 4 * t.word0 as u64,
            size: (4 * f.n_out * f.layout.row_words(f.k)) as u64,
        })
        .collect()
}

/// Bytes of a slot's matrices as stored (without alignment padding).
fn mats_bytes(m: &SlotMats) -> u64 {
    [m.gate, Some(m.up), Some(m.down)].iter().flatten().map(|p| (4 * p.n_out * p.layout.row_words(p.k)) as u64).sum()
}

impl WgpuBackend {
    /// `moe_ffn` under [`MissPolicy::Host`]. A decode step (few tokens) is the per-pair kernels
    /// with the slot table: each pair's expert is read from its pool slot or from the host
    /// tier, whichever the table says; the ids stay on the GPU (copied into the log, read back
    /// once per step) so nothing waits; the pool changes between steps ([`Self::refill_pool`]).
    /// A prefill batch reads its ids back and takes the upload path (misses uploaded into victim
    /// slots, each read once per batch), the table following the pool afterwards.
    pub(super) fn moe_ffn_host_tier(
        &self,
        tier: &ExpertTier,
        x: &WgpuTensor,
        routing: &crate::backend::Routing<Self>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
    ) -> Result<WgpuTensor, OpError> {
        let t_start = Instant::now();
        let layer = experts.layer;
        let (n, n_embd, k) = (x.rows(), x.width(), routing.k);
        let mut guard = lock(&tier.state);
        let st = &mut *guard;
        st.ensure_layer(layer, spec.n_expert);
        let region = st.region(layer, &tier.regions);
        if st.last_layer.is_none_or(|l| layer <= l) {
            super::trace::mark("step", Some(layer));
            lock(&tier.profile).steps += 1;
            self.refill_pool(tier, st)?;
            super::trace::mark("refilled", Some(layer));
        }
        st.last_layer = Some(layer);
        let t_fill = Instant::now();
        self.ensure_host_layer(tier, st, layer, spec.n_expert)?;
        let fill_secs = t_fill.elapsed().as_secs_f64();
        self.write_slot_table(st)?;
        let (host_buf, m0) = st
            .host
            .layers
            .get(layer)
            .and_then(|h| h.as_ref())
            .and_then(|h| Some((h.buffer.clone(), *h.mats.first()?)))
            .ok_or_else(|| OpError::Unsupported {
                op: "moe_ffn",
                backend: "wgpu",
                why: format!("layer {layer} has no host copy of its experts"),
            })?;
        let t_decided = Instant::now();
        let biases = [experts.gate_bias.as_ref(), experts.up_bias.as_ref(), experts.down_bias.as_ref()];
        let y = if moe::pairs_fit(n, k, n_embd, spec.n_ff) && tier.opts.miss == MissPolicy::Split {
            let table = st.host.table_gpu.clone().ok_or_else(|| OpError::Unsupported {
                op: "moe_ffn",
                backend: "wgpu",
                why: "the expert tier's slot table was not written".into(),
            })?;
            let place = split::LayerPlace { pool: &tier.pool[region], host: &host_buf, mats: m0, table: &table };
            let y = self.moe_split_pairs(tier, st, x, routing, experts, spec, place)?;
            lock(&tier.profile).host_fill_secs += fill_secs;
            return Ok(y);
        } else if moe::pairs_fit(n, k, n_embd, spec.n_ff) {
            let ids_uploaded;
            let (ids_buf, at) = if routing.ids.is_empty() {
                self.log_ids(tier, st, layer, &routing.weights.buf.buffer, n * k)?;
                (&routing.weights.buf.buffer, (n * k) as u32)
            } else {
                self.note_selections(tier, st, layer, &routing.ids);
                ids_uploaded = self.upload("moe ids", bytemuck::cast_slice(&routing.ids))?;
                (&ids_uploaded.buffer, 0)
            };
            let pool = &tier.pool[region];
            let fused = moe::FusedMats {
                gate: m0.gate.map(|g| (pool, g.layout)),
                up: (pool, m0.up.layout),
                down: (pool, m0.down.layout),
                host: Some(&host_buf),
            };
            let table_gpu = st.host.table_gpu.clone().ok_or_else(|| OpError::Unsupported {
                op: "moe_ffn",
                backend: "wgpu",
                why: "the expert tier's slot table was not written".into(),
            })?;
            let table =
                moe::PairTable::Slots { ids: ids_buf, at, slots: &table_gpu, slots_at: (layer * st.host.row) as u32 };
            self.moe_pairs(x, k, &table, (&routing.weights.buf.buffer, 0), &fused, biases, spec)?
        } else {
            // A prefill batch touches most experts, each for many tokens: reading them over PCIe
            // (the product kernel may pass over a weight once per 8 tokens) costs more than one
            // upload each, so the batch takes the upload path (its misses from the store,
            // uploaded into victim slots), and the table follows the pool afterwards.
            drop(guard);
            let ids = self.routing_ids(routing)?;
            let view = RouteView { ids: &ids, weights: &routing.weights, k };
            let mut by_expert: Vec<Vec<(u32, u32)>> = vec![Vec::new(); spec.n_expert];
            for (i, &e) in ids.iter().enumerate() {
                by_expert[e as usize].push(((i / k) as u32, i as u32));
            }
            let y = self.moe_ffn_tiered_counted(tier, x, &view, experts, spec, &by_expert, false)?;
            lock(&tier.profile).host_fill_secs += fill_secs;
            let mut guard = lock(&tier.state);
            sync_table_with_pool(&mut guard);
            return Ok(y);
        };
        let mut prof = lock(&tier.profile);
        prof.calls += 1;
        prof.decide_secs += (t_decided - t_start).as_secs_f64() - fill_secs;
        prof.host_fill_secs += fill_secs;
        prof.record_secs += t_decided.elapsed().as_secs_f64();
        Ok(y)
    }

    /// Counts one call's selections (`ids`, any order, repeats allowed) of `layer`: policy
    /// scores, hits and misses as the pool stood during the call; misses wait for the refill.
    fn note_selections(&self, tier: &ExpertTier, st: &mut TierState, layer: usize, ids: &[u32]) {
        self.note_selections_seen(tier, st, layer, ids, None);
    }

    /// [`Self::note_selections`] with each expert's hit or miss as `missed` says (the pool as
    /// the call's kernels saw it, when the selections are counted later), else as the pool is.
    fn note_selections_seen(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        layer: usize,
        ids: &[u32],
        missed: Option<&[bool]>,
    ) {
        st.tick += 1;
        let tick = st.tick;
        let mut used = ids.to_vec();
        used.sort_unstable();
        used.dedup();
        st.note_selected(layer, &used, (tier.opts.policy == SlotPolicy::Lfu).then_some(tier.lfu_decay));
        st.stats[layer].selections += used.len() as u64;
        for e in used {
            let slot = st.slot_of[layer][e as usize];
            let is_miss = missed.map_or(slot == NO_SLOT, |m| m[e as usize]);
            if let Some(a) = st.host.admission.as_mut() {
                a.selected(layer, e as usize, !is_miss);
            }
            match slot {
                _ if is_miss => {
                    st.stats[layer].misses += 1;
                    st.stats[layer].host_reads += 1;
                    st.host.pending_misses.push((layer as u32, e));
                }
                NO_SLOT => st.stats[layer].hits += 1,
                s => {
                    st.stats[layer].hits += 1;
                    st.last_use[s as usize] = tick;
                }
            }
        }
    }

    /// Copies `n_ids` ids (after the `n_ids` routing weights in `src`) into the id log.
    fn log_ids(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        layer: usize,
        src: &wgpu::Buffer,
        n_ids: usize,
    ) -> Result<(), OpError> {
        let bytes = 4 * n_ids as u64;
        let room = st.host.log.as_ref().map_or(0, |l| l.size());
        if st.host.log_used + bytes > room {
            // Full (a step of more calls than the log was made for): read what it has, and
            // make a larger one if one call's ids still do not fit.
            self.drain_log(tier, st)?;
            if bytes > room {
                let size = (2 * room).max(LOG_MIN_BYTES).max(bytes.next_power_of_two());
                let log = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("expert id log"),
                    size,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                st.host.bytes = st.host.bytes - room + size;
                st.host.log = Some(log);
            }
        }
        let log = st.host.log.clone().ok_or_else(|| OpError::Unsupported {
            op: "moe_ffn",
            backend: "wgpu",
            why: "no id log".into(),
        })?;
        let at = st.host.log_used;
        self.copy(src, bytes, &log, at, bytes);
        st.host.log_entries.push((layer, n_ids, at));
        st.host.log_used = at + bytes;
        Ok(())
    }

    /// Reads the id log back (submitting what is pending; the GPU is normally done with the
    /// step already, the host having read its token) and counts its selections.
    fn drain_log(&self, tier: &ExpertTier, st: &mut TierState) -> Result<(), OpError> {
        if st.host.log_entries.is_empty() {
            return Ok(());
        }
        let Some(log) = st.host.log.clone() else { return Ok(()) };
        let t0 = Instant::now();
        {
            let mut p = lock(&self.ctx.pending);
            self.ctx.flush_locked(&mut p);
        }
        let t1 = Instant::now();
        let used = st.host.log_used;
        let words = self.read_mapped("route", &log, log.size(), used, true, super::le_u32s)?;
        for (layer, n_ids, at) in std::mem::take(&mut st.host.log_entries) {
            let w0 = (at / 4) as usize;
            let ids = words[w0..w0 + n_ids].to_vec();
            self.note_selections(tier, st, layer, &ids);
        }
        st.host.log_used = 0;
        let mut prof = lock(&tier.profile);
        prof.readback_submit_secs += (t1 - t0).as_secs_f64();
        prof.readback_wait_secs += t1.elapsed().as_secs_f64();
        prof.readbacks += 1;
        Ok(())
    }

    /// Between steps: counts the previous step's selections, then copies its misses from the
    /// host tier into pool slots (a GPU copy, ordered before this step's kernels) where the
    /// policy says they are worth more than the slot's expert (LFU: a higher score; LRU:
    /// always), and updates the slot table. Under [`MissPolicy::Split`] the copies are made per
    /// layer instead, at its split call ([`Self::refill_layer`]), unless
    /// `DISKFORMER_SPLIT_LAYER_REFILL=0`.
    fn refill_pool(&self, tier: &ExpertTier, st: &mut TierState) -> Result<(), OpError> {
        self.settle_dispatcher(tier, st)?;
        self.drain_log(tier, st)?;
        let adapt = tier.replace_margin_fixed.is_none();
        let admission = st.host.admission.get_or_insert_with(|| admission::Admission::new(tier.replace_margin, adapt));
        admission.start_step();
        if tier.opts.policy == SlotPolicy::Lfu {
            let mut prof = lock(&tier.profile);
            prof.replace_margin = admission.margin();
            prof.replace_yield = admission.yield_per_replacement();
        }
        st.host.refills_this_step = 0;
        // No split call's limit carried over (one that returned early with an error).
        st.host.call_refills_left = None;
        if tier.opts.miss == MissPolicy::Split && !tier.split_step_refill {
            return Ok(());
        }
        let misses = std::mem::take(&mut st.host.pending_misses);
        self.replace_misses(tier, st, misses).map(|_| ())
    }

    /// Under [`MissPolicy::Split`] (unless `DISKFORMER_SPLIT_LAYER_REFILL=0`), after a layer's
    /// CPU job started: the replacements of the layer's misses (as [`Self::refill_pool`] makes them for the whole step under
    /// [`MissPolicy::Host`]), their copies and the slot table's changed rows submitted at once,
    /// so that the GPU makes them while the CPU computes, not before the next step's first
    /// layer (where ~20 copies of 2.5 MiB over the link held its ids back by ~0.8 ms on the
    /// H200). Each later layer's partition and the host's (`cpu_misses`) read the new table
    /// alike: both come after this in the queue and on the host.
    fn refill_layer(&self, tier: &ExpertTier, st: &mut TierState, layer: usize) -> Result<(), OpError> {
        if self.record_layer_refill(tier, st, layer)? {
            let mut p = lock(&self.ctx.pending);
            self.ctx.flush_locked(&mut p);
        }
        Ok(())
    }

    /// [`Self::refill_layer`] without its submission: records `layer`'s replacements and the
    /// slot table's changed rows; true when it recorded any.
    fn record_layer_refill(&self, tier: &ExpertTier, st: &mut TierState, layer: usize) -> Result<bool, OpError> {
        if tier.split_step_refill {
            return Ok(false);
        }
        let mut mine = Vec::new();
        st.host.pending_misses.retain(|&(l, e)| {
            let of_layer = l as usize == layer;
            if of_layer {
                mine.push((l, e));
            }
            !of_layer
        });
        if mine.is_empty() {
            return Ok(false);
        }
        let was_dirty = st.host.table_dirty;
        let Some((lo, hi)) = self.replace_misses(tier, st, mine)? else { return Ok(false) };
        if was_dirty {
            self.write_slot_table(st)?;
        } else if let Some(table) = st.host.table_gpu.clone() {
            let bytes: &[u8] = bytemuck::cast_slice(&st.host.table[lo..=hi]);
            let staged = self.upload("expert slot table rows", bytes)?;
            self.copy(&staged.buffer, 0, &table, 16 * lo as u64, bytes.len() as u64);
            st.host.table_dirty = false;
        }
        Ok(true)
    }

    /// Copies `misses` from the host tier into pool slots where the policy says they are worth
    /// more than the slot's expert, in falling score order (LFU), updating the slot table's
    /// host copy; the range of table entries changed, if any.
    fn replace_misses(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        mut misses: Vec<(u32, u32)>,
    ) -> Result<Option<(usize, usize)>, OpError> {
        misses.sort_unstable();
        misses.dedup();
        if tier.opts.policy == SlotPolicy::Lfu {
            // The most popular first, so that a full pool takes the best of them.
            misses
                .sort_by(|a, b| st.score[b.0 as usize][b.1 as usize].total_cmp(&st.score[a.0 as usize][a.1 as usize]));
        }
        let adapt = tier.replace_margin_fixed.is_none();
        let admission = st.host.admission.get_or_insert_with(|| admission::Admission::new(tier.replace_margin, adapt));
        let margin = admission.margin();
        let busy = vec![false; tier.opts.n_slots];
        let tick = st.tick;
        let mut changed: Option<(usize, usize)> = None;
        let mut touch = |entry: usize| {
            changed = Some(changed.map_or((entry, entry), |(lo, hi)| (lo.min(entry), hi.max(entry))));
        };
        // Regions where no later miss can replace anything: under LFU the misses come in falling
        // score order and a region's lowest score only rises as it takes them, so once one miss
        // does not beat a region's victim, none after it will (each victim search scans the
        // region, ~1200 slots at 4 GB: searching for every miss of a step took ~0.8 ms).
        let mut closed = vec![false; tier.regions.len()];
        for (layer, e) in misses {
            let (l, e) = (layer as usize, e as usize);
            if st.slot_of[l][e] != NO_SLOT || st.pending_copies.iter().any(|c| c.layer == l && c.expert == e) {
                continue;
            }
            if st.host.refills_this_step >= tier.refill_max || st.host.call_refills_left == Some(0) {
                break;
            }
            let Some(host_mats) = st.host.layers.get(l).and_then(|h| h.as_ref()).map(|h| h.mats[e]) else { continue };
            let region = st.region(l, &tier.regions);
            if closed[region] {
                continue;
            }
            let Some(slot) = st.victim(tier.opts.policy, &busy, tier.regions[region].clone()) else { continue };
            if let (SlotPolicy::Lfu, Some((ol, oe))) = (tier.opts.policy, st.owner[slot]) {
                // The score counts the selection that missed; without it, it is what the
                // expert's history says about its next calls. See `HOST_REPLACE_MARGIN`.
                if st.score[l][e] - 1.0 < st.score[ol as usize][oe as usize] + margin {
                    closed[region] = true;
                    continue;
                }
            }
            if let Some(a) = st.host.admission.as_mut() {
                a.copied(l, e, st.owner[slot].map(|(ol, oe)| (ol as usize, oe as usize)));
            }
            if let Some((ol, oe)) = st.owner[slot].take() {
                let (ol, oe) = (ol as usize, oe as usize);
                st.slot_of[ol][oe] = NO_SLOT;
                st.stats[l].evictions += 1;
                if let Some(h) = st.host.layers.get(ol).and_then(|h| h.as_ref()) {
                    st.host.table[ol * st.host.row + oe] = table_entry(IN_HOST, &h.mats[oe]);
                    touch(ol * st.host.row + oe);
                }
            }
            let (buf, base) = tier.slot_base(slot);
            let slot_mats = tier.place_like(base, &host_mats);
            let host_buf = st.host.layers[l].as_ref().map(|h| h.buffer.clone()).ok_or_else(|| {
                OpError::Unsupported { op: "moe_ffn", backend: "wgpu", why: format!("layer {l} has no host copy") }
            })?;
            st.owner[slot] = Some((layer, e as u32));
            st.mats[slot] = Some(slot_mats);
            st.last_use[slot] = tick;
            if let Some(after_seq) = st.host.copy_seq {
                // On the copy queue once the GPU is past this call; the table follows when done
                // (`split::advance_copies`).
                st.copying[slot] = true;
                st.pending_copies.push(PendingCopy {
                    slot,
                    layer: l,
                    expert: e,
                    mats: slot_mats,
                    host_mats,
                    after_seq,
                    ring: None,
                });
            } else {
                for r in copy_regions(&host_mats, &slot_mats) {
                    self.copy(&host_buf, r.src_offset, &tier.pool[buf], r.dst_offset, r.size);
                }
                st.slot_of[l][e] = slot as u32;
                st.host.table[l * st.host.row + e] = table_entry(IN_POOL, &slot_mats);
                touch(l * st.host.row + e);
                st.host.table_dirty = true;
            }
            st.host.refills_this_step += 1;
            if let Some(left) = &mut st.host.call_refills_left {
                *left = left.saturating_sub(1);
            }
            let s = &mut st.stats[l];
            s.uploads += 1;
            s.refills += 1;
            s.bytes_uploaded += mats_bytes(&slot_mats);
        }
        Ok(changed)
    }

    /// Writes the slot table's host copy to the GPU when it changed (a copy in recording order,
    /// so kernels recorded before it read the old table and those after it the new one).
    fn write_slot_table(&self, st: &mut TierState) -> Result<(), OpError> {
        if !st.host.table_dirty {
            return Ok(());
        }
        let bytes: &[u8] = bytemuck::cast_slice(&st.host.table);
        let size = bytes.len() as u64;
        if st.host.table_gpu.as_ref().is_none_or(|t| t.size() < size) {
            st.host.table_gpu = Some(self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("expert slot table"),
                size: size.next_power_of_two().max(256),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        let staged = self.upload("expert slot table", bytes)?;
        if let Some(t) = &st.host.table_gpu {
            self.copy(&staged.buffer, 0, t, 0, size);
        }
        st.host.table_dirty = false;
        Ok(())
    }

    /// Makes `layer`'s host copy on its first call: host memory the GPU reads (as the tier's
    /// [`HostFill`] says, where the device allows) filled with every expert of the layer in the
    /// pool's slot layout; the slot table's row of the layer points into it.
    fn ensure_host_layer(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        layer: usize,
        n_expert: usize,
    ) -> Result<(), OpError> {
        if st.host.layers.get(layer).is_some_and(|h| h.is_some()) {
            return Ok(());
        }
        let unsupported = |why: String| OpError::Unsupported { op: "moe_ffn (host tier)", backend: "wgpu", why };
        if st.host.row == 0 {
            st.host.row = n_expert;
        } else if n_expert != st.host.row {
            return Err(unsupported(format!(
                "layer {layer} has {n_expert} experts where the first layer had {}",
                st.host.row
            )));
        }
        let bytes = n_expert as u64 * tier.opts.slot_bytes;
        if bytes > self.ctx.max_binding {
            return Err(unsupported(format!(
                "layer {layer}'s {n_expert} experts take {bytes} bytes, more than the storage binding limit {}",
                self.ctx.max_binding
            )));
        }
        // The fill's parts in a trace: "host buffer made" once the buffer (or the pages to
        // import) is in hand (with the driver's allocation, nearly all of a layer's time on the
        // H200), "host copy staged" once the experts are in it and it is the GPU's (the name
        // kept from the staged fill for trace-summary.py), "host memory imported" between them
        // for an import (the driver pinning the pages).
        super::trace::mark("host copy", Some(layer));
        let target = match st.host.ahead.take().filter(|a| a.layer == layer) {
            Some(a) => HostTarget::Written(a.pending, a.mats),
            None => self.host_tier_target(tier, st, layer, bytes)?,
        };
        let (buffer, mats, fill) = match target {
            HostTarget::Import(mut pending) => {
                super::trace::mark("host buffer made", Some(layer));
                let mats = self.fill_mapped_host_layer(tier, layer, n_expert, pending.bytes_mut())?;
                super::trace::mark("host pages written", Some(layer));
                let buffer = self.import_writing_ahead(tier, st, layer, n_expert, pending)?;
                (buffer, mats, HostFill::Import)
            }
            HostTarget::Written(pending, mats) => {
                super::trace::mark("host buffer made", Some(layer));
                super::trace::mark("host pages written", Some(layer));
                let buffer = self.import_writing_ahead(tier, st, layer, n_expert, pending)?;
                (buffer, mats, HostFill::Import)
            }
            HostTarget::Mapped(mapped) => {
                super::trace::mark("host buffer made", Some(layer));
                let len = mapped.buffer.size() as usize;
                // SAFETY: the mapping is `len` bytes of host memory that lives as long as
                // `mapped`; nothing else reads or writes it until the layer's slot table row
                // points into it, after the fill (the GPU has no work using it yet).
                let whole: &mut [u8] = unsafe { std::slice::from_raw_parts_mut(mapped.ptr.as_ptr(), len) };
                let mats = self.fill_mapped_host_layer(tier, layer, n_expert, whole)?;
                (mapped.buffer, mats, HostFill::Mapped)
            }
            HostTarget::Staged => {
                let buffer = host_tier_buffer(&self.ctx.device, bytes);
                super::trace::mark("host buffer made", Some(layer));
                let mats = self.fill_host_layer_staged(tier, st, layer, n_expert, &buffer)?;
                (buffer, mats, HostFill::Staged)
            }
        };
        let row = st.host.row;
        if st.host.table.len() < (layer + 1) * row {
            st.host.table.resize((layer + 1) * row, [IN_HOST, 0, 0, 0]);
        }
        for (e, m) in mats.iter().enumerate() {
            st.host.table[layer * row + e] = table_entry(IN_HOST, m);
        }
        st.host.table_dirty = true;
        st.host.bytes += bytes;
        if st.host.layers.len() <= layer {
            st.host.layers.resize_with(layer + 1, || None);
        }
        st.host.layers[layer] = Some(HostLayer { buffer, mats, fill });
        super::trace::mark("host copy staged", Some(layer));
        self.prefill_layer(tier, st, layer)
    }

    /// Where `layer`'s copy of `bytes` goes, within the RAM budget: the first of the tier's
    /// [`HostFill`] and those after it that the device offers.
    ///
    /// Not made ahead on other threads: on the H200 (thirty-first session) NVIDIA's driver
    /// made driver-allocated buffers one at a time (~78 ms per 340 MB whether 1, 4 or 8
    /// threads asked) and held the model's own allocations and the fill's submissions behind
    /// them, so the fill took longer (docs/NOTES.md).
    fn host_tier_target(
        &self,
        tier: &ExpertTier,
        st: &TierState,
        layer: usize,
        bytes: u64,
    ) -> Result<HostTarget, OpError> {
        let unsupported = |why: String| OpError::Unsupported { op: "moe_ffn (host tier)", backend: "wgpu", why };
        let held = st.host.bytes;
        if let Some(budget) = tier.opts.host_budget_bytes {
            if held + bytes > budget {
                return Err(unsupported(format!(
                    "the RAM budget of {budget} bytes is too small for the host tier: {held} bytes held, layer {layer} needs {bytes} more"
                )));
            }
        }
        let failed = |why: String| unsupported(format!("layer {layer}'s host copy of {bytes} bytes: {why}"));
        if tier.opts.host_fill == HostFill::Import {
            if let Some(import) = &self.ctx.host_import {
                return PendingImport::new(&self.ctx.device, import, bytes)
                    .map(|p| HostTarget::Import(Box::new(p)))
                    .map_err(failed);
            }
        }
        if tier.opts.host_fill != HostFill::Staged {
            if let Some(mapped) =
                MappedHostBuffer::new(&self.ctx.device, bytes, Toward::Host, "expert host tier").map_err(failed)?
            {
                return Ok(HostTarget::Mapped(mapped));
            }
        }
        Ok(HostTarget::Staged)
    }

    /// Imports `layer`'s written pages and, at the same time on the thread pool, writes the
    /// next layer's into pages of its own ([`HostTierState::ahead`]), where the RAM budget has
    /// room for both: the driver pins one layer (~16 ms for 340 MB on the H200) while the pool
    /// writes the next (~16 ms), which halves the fill. The next layer's write is a guess (the
    /// next layer may have no experts, or its own call may never come); failing, it is dropped.
    fn import_writing_ahead(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        layer: usize,
        n_expert: usize,
        pending: Box<PendingImport>,
    ) -> Result<wgpu::Buffer, OpError> {
        let bytes = n_expert as u64 * tier.opts.slot_bytes;
        let import = self.ctx.host_import.as_ref().expect("pages to import only where the device imports");
        let next = layer + 1;
        let room = tier.opts.host_budget_bytes.is_none_or(|b| st.host.bytes + 2 * bytes <= b);
        // `DISKFORMER_HOST_WRITE_AHEAD=0`: one layer at a time, for comparisons.
        let off = std::env::var("DISKFORMER_HOST_WRITE_AHEAD").is_ok_and(|v| v.trim() == "0");
        let wanted = !off && room && st.host.layers.get(next).is_none_or(|h| h.is_none());
        let (buffer, ahead) = rayon::join(
            || (*pending).finish(import, "expert host tier"),
            || {
                if !wanted {
                    return None;
                }
                let mut pending = PendingImport::new(&self.ctx.device, import, bytes).ok()?;
                let mats = self.fill_mapped_host_layer(tier, next, n_expert, pending.bytes_mut()).ok()?;
                Some(WrittenAhead { layer: next, pending: Box::new(pending), mats })
            },
        );
        st.host.ahead = ahead;
        let buffer = buffer.map_err(|why| OpError::Unsupported {
            op: "moe_ffn (host tier)",
            backend: "wgpu",
            why: format!("layer {layer}'s host copy of {bytes} bytes: {why}"),
        })?;
        super::trace::mark("host memory imported", Some(layer));
        Ok(buffer)
    }

    /// Writes every expert of `layer` into `whole` (the host memory the GPU will read) in the
    /// pool's slot layout, on the thread pool (one job per matrix: the fill is host memory to
    /// host memory, and one core copies and repacks at a fraction of what the machine's memory
    /// does; fresh pages are also faulted in by those threads); returns each expert's placement.
    fn fill_mapped_host_layer(
        &self,
        tier: &ExpertTier,
        layer: usize,
        n_expert: usize,
        whole: &mut [u8],
    ) -> Result<Vec<SlotMats>, OpError> {
        use rayon::prelude::*;
        let unsupported = |why: String| OpError::Unsupported { op: "moe_ffn (host tier)", backend: "wgpu", why };
        let len = whole.len();
        let ids: Vec<u32> = (0..n_expert as u32).collect();
        let mut mats: Vec<Option<SlotMats>> = vec![None; n_expert];
        let slot_words = tier.slot_words;
        tier.store.with_host_experts(layer, &ids, &mut |group: &[HostExpert<'_>]| {
            // (byte offset, bytes on the GPU, placement, source) per matrix, by offset.
            let mut jobs: Vec<(usize, usize, Placed, &HostMatrix<'_>)> = Vec::with_capacity(3 * group.len());
            for ex in group {
                let e = ex.id as usize;
                if e >= n_expert {
                    return Err(unsupported(format!("the store lent expert {e} of a layer of {n_expert}")));
                }
                let m = tier.place_at(e * slot_words, ex)?;
                for (p, hm) in [(m.gate, ex.gate.as_ref()), (Some(m.up), Some(&ex.up)), (Some(m.down), Some(&ex.down))]
                {
                    if let (Some(p), Some(hm)) = (p, hm) {
                        jobs.push((4 * p.word0, 4 * p.n_out * p.layout.row_words(p.k), p, hm));
                    }
                }
                mats[e] = Some(m);
            }
            jobs.sort_by_key(|j| j.0);
            // Disjoint pieces of the mapping, one per matrix (placements never overlap).
            let mut pieces: Vec<(&mut [u8], Placed, &HostMatrix<'_>)> = Vec::with_capacity(jobs.len());
            let mut rest: &mut [u8] = &mut whole[..];
            let mut at = 0usize;
            for (start, size, p, hm) in jobs {
                if start < at || start + size > len {
                    return Err(unsupported(format!(
                        "expert matrix at bytes {start}..{} of a {len}-byte host copy overlaps another or the end",
                        start + size
                    )));
                }
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
                let (piece, tail) = tail.split_at_mut(size);
                pieces.push((piece, p, hm));
                rest = tail;
                at = start + size;
            }
            pieces.into_par_iter().try_for_each(|(dst, p, hm)| {
                if repacks_in_place(&p.layout, hm.k) {
                    if hm.bytes.len() != dst.len() {
                        return Err(unsupported(format!(
                            "an expert matrix of {} bytes where its {}x{} {} placement takes {}",
                            hm.bytes.len(),
                            hm.n_out,
                            hm.k,
                            p.layout.name,
                            dst.len()
                        )));
                    }
                    dst.copy_from_slice(hm.bytes);
                } else {
                    repack_into(&p.layout, hm.bytes, hm.n_out, hm.k, dst);
                }
                Ok(())
            })
        })?;
        every_expert_lent(mats, layer)
    }

    /// The fill where no mapped buffer is offered: every expert of `layer` through the staging
    /// ring into `buffer` (a CPU copy into the ring, then a GPU copy per matrix).
    fn fill_host_layer_staged(
        &self,
        tier: &ExpertTier,
        st: &mut TierState,
        layer: usize,
        n_expert: usize,
        buffer: &wgpu::Buffer,
    ) -> Result<Vec<SlotMats>, OpError> {
        let unsupported = |why: String| OpError::Unsupported { op: "moe_ffn (host tier)", backend: "wgpu", why };
        let ids: Vec<u32> = (0..n_expert as u32).collect();
        let mut mats: Vec<Option<SlotMats>> = vec![None; n_expert];
        let mut batch = Batch { experts: Vec::new(), copies: Vec::new(), used_bytes: 0 };
        let mut scratch = Vec::new();
        let slot_words = tier.slot_words;
        tier.store.with_host_experts(layer, &ids, &mut |group: &[HostExpert<'_>]| {
            for ex in group {
                let e = ex.id as usize;
                if e >= n_expert {
                    return Err(unsupported(format!("the store lent expert {e} of a layer of {n_expert}")));
                }
                let m = tier.place_at(e * slot_words, ex)?;
                if batch.used_bytes + mats_bytes(&m) + 24 > tier.opts.staging_bytes {
                    self.submit_staged(tier, st, &mut batch);
                }
                self.stage_matrices(tier, st, ex, &m, buffer, &mut batch, &mut scratch)?;
                mats[e] = Some(m);
            }
            Ok(())
        })?;
        self.submit_staged(tier, st, &mut batch);
        every_expert_lent(mats, layer)
    }

    /// Right after `layer`'s host copy is made: copies up to
    /// [`ExpertTierOptions::prefill_per_layer`] of its experts from that copy into free slots of
    /// its pool region (GPU copies, at the link's rate: ~70 ms for the 3.3 GB pool of
    /// Qwen3-30B-A3B at 4G on the H200), the most popular first (LFU score, then id: with no
    /// history, the first ids, which says nothing of a model's routing).
    ///
    /// Why: an empty pool fills with misses as they come, at most one copy per split call
    /// (each sits on the chain from the CPU's sum to the next layer's ids), so at 4G it took
    /// ~26 steps to fill and the first decode steps ran at no hits at all (the twenty-eighth
    /// session's trace: steps 1-8 at ~30 ms, ~12 ms once warm). Filling at the first call puts
    /// those copies where the host copy's own (16 GB through staging) already are; the policy
    /// then replaces them as the routing shows which experts are worth more.
    fn prefill_layer(&self, tier: &ExpertTier, st: &mut TierState, layer: usize) -> Result<(), OpError> {
        let want = tier.opts.prefill_per_layer;
        let Some(host) = st.host.layers.get(layer).and_then(|h| h.as_ref()) else { return Ok(()) };
        if want == 0 || tier.regions.is_empty() {
            return Ok(());
        }
        let (host_buf, host_mats) = (host.buffer.clone(), host.mats.clone());
        let region = st.region(layer, &tier.regions);
        let mut free = tier.regions[region].clone().filter(|&s| st.owner[s].is_none() && !st.copying[s]);
        let mut order: Vec<usize> = (0..host_mats.len()).filter(|&e| st.slot_of[layer][e] == NO_SLOT).collect();
        let score = &st.score[layer];
        order.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
        let mut placed = Vec::new();
        for e in order.into_iter().take(want) {
            let Some(slot) = free.next() else { break };
            placed.push((e, slot));
        }
        let row = st.host.row;
        for (e, slot) in placed {
            let (buf, base) = tier.slot_base(slot);
            let slot_mats = tier.place_like(base, &host_mats[e]);
            for r in copy_regions(&host_mats[e], &slot_mats) {
                self.copy(&host_buf, r.src_offset, &tier.pool[buf], r.dst_offset, r.size);
            }
            st.owner[slot] = Some((layer as u32, e as u32));
            st.mats[slot] = Some(slot_mats);
            st.last_use[slot] = st.tick;
            st.slot_of[layer][e] = slot as u32;
            st.host.table[layer * row + e] = table_entry(IN_POOL, &slot_mats);
            // Counted apart: no miss asked for it, and a run's bytes per token should not
            // carry the pool's one-time fill.
            st.stats[layer].prefilled += 1;
        }
        st.host.table_dirty = true;
        Ok(())
    }

    /// Submits the copies of the current staging buffer and moves the ring on.
    fn submit_staged(&self, tier: &ExpertTier, st: &mut TierState, batch: &mut Batch) {
        if batch.copies.is_empty() {
            return;
        }
        let staging = &tier.staging[st.next_staging];
        staging.buffer.unmap();
        {
            let mut p = lock(&self.ctx.pending);
            for (src_at, dst, dst_at, size) in batch.copies.drain(..) {
                p.cmds.push(Cmd::Copy { src: staging.buffer.clone(), src_at, dst, dst_at, size });
            }
            self.ctx.flush_locked(&mut p);
        }
        self.remap_staging(staging);
        st.next_staging = (st.next_staging + 1) % STAGING_BUFFERS;
        batch.used_bytes = 0;
    }

    /// Bytes the host tier holds in host memory (its layers' copies and the id log; `None`
    /// without a tier).
    pub fn expert_host_tier_bytes(&self) -> Option<u64> {
        self.experts.as_ref().map(|t| lock(&t.state).host.bytes)
    }

    /// Of [`Self::expert_host_tier_bytes`], the bytes in buffers of wgpu's allocator, which
    /// counts them in [`Self::device_buffer_bytes`] and [`Self::device_reserved_bytes`] though
    /// they are host memory: the id log, and layers' copies where the device offers no mapped
    /// host buffers (not Vulkan). Subtract these, not the whole tier, from those figures.
    pub fn expert_host_tier_allocator_bytes(&self) -> Option<u64> {
        self.experts.as_ref().map(|t| lock(&t.state).host.allocator_bytes())
    }

    /// How each layer's host copy made so far was made, by layer (`None` where a layer has
    /// none yet; an empty list without a tier).
    pub fn expert_host_tier_fills(&self) -> Vec<Option<HostFill>> {
        self.experts
            .as_ref()
            .map(|t| lock(&t.state).host.layers.iter().map(|h| h.as_ref().map(|h| h.fill)).collect())
            .unwrap_or_default()
    }
}

impl WgpuBackend {
    /// Seconds per streaming read of `bytes` from host memory by a kernel: the stream kernel of
    /// [`perf_stream`](Self::perf_stream) over a buffer placed as the expert tier's host copy is
    /// (`host_tier_buffer`), so over PCIe on a discrete GPU. The rate at which the tier's kernels
    /// can read missed experts (`--moe-miss host`) is at most this; the planner takes it for the
    /// GPU expert tier's speed estimate.
    ///
    /// # Errors
    /// [`OpError::Unsupported`] when the adapter cannot bind host memory as storage
    /// (`MAPPABLE_PRIMARY_BUFFERS`) or `bytes` exceeds the binding limit.
    pub fn perf_stream_host(&self, bytes: u64, reps: usize) -> Result<f64, OpError> {
        if !self.ctx.device.features().contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS) {
            return Err(OpError::Unsupported {
                op: "perf_stream_host",
                backend: "wgpu",
                why: format!("{} cannot bind host memory as storage (MAPPABLE_PRIMARY_BUFFERS)", self.ctx.adapter.name),
            });
        }
        let n_vec4 = bytes / 16;
        if n_vec4 * 16 > self.max_binding_bytes() {
            return Err(OpError::Unsupported {
                op: "perf_stream_host",
                backend: "wgpu",
                why: format!("{bytes} bytes exceed the binding limit of {}", self.max_binding_bytes()),
            });
        }
        let src = host_tier_buffer(&self.ctx.device, n_vec4 * 16);
        let n_groups = 132 * 16;
        let out = self.alloc_bytes("stream out", n_groups as u64 * 4)?;
        let pipe = self.plain(super::shaders::Plain::Stream);
        self.time_reps(reps, || {
            self.dispatch(pipe.clone(), &[&src, &out.buffer], &[n_vec4 as u32, 0, 0, 0], [n_groups, 1, 1]);
            Ok(())
        })
    }
}

impl WgpuBackend {
    /// Seconds per streaming read of a `window` of `bytes` out of a host-memory buffer of `total`
    /// bytes (placed as the host tier's), each repetition a different window in a scattered
    /// order: the size of a MoE layer's misses (a few MB) read over the link in one dispatch, where
    /// [`Self::perf_stream_host`] reads 256 MiB. Windows start at multiples of `window`.
    ///
    /// # Errors
    /// As [`Self::perf_stream_host`]; `window` larger than `total` is refused.
    #[doc(hidden)]
    pub fn perf_stream_host_windows(&self, total: u64, window: u64, reps: usize) -> Result<f64, OpError> {
        let bad = |why: String| OpError::Unsupported { op: "perf_stream_host_windows", backend: "wgpu", why };
        if !self.ctx.device.features().contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS) {
            return Err(bad(format!("{} cannot bind host memory as storage", self.ctx.adapter.name)));
        }
        let n_vec4 = total / 16;
        let w_vec4 = window / 16;
        if n_vec4 * 16 > self.max_binding_bytes() || w_vec4 == 0 || w_vec4 > n_vec4 {
            return Err(bad(format!(
                "a window of {window} bytes in {total} (binding limit {})",
                self.max_binding_bytes()
            )));
        }
        let src = host_tier_buffer(&self.ctx.device, n_vec4 * 16);
        let n_groups = 132 * 16;
        let out = self.alloc_bytes("stream out", n_groups as u64 * 4)?;
        let pipe = self.plain(super::shaders::Plain::Stream);
        let n_windows = (n_vec4 / w_vec4) as usize;
        let next = std::cell::Cell::new(0usize);
        self.time_reps(reps, || {
            // A stride coprime with most window counts, so consecutive reads are far apart.
            let i = next.get();
            next.set(i + 1);
            let at = ((i * 7919) % n_windows) as u64 * w_vec4;
            self.dispatch(pipe.clone(), &[&src, &out.buffer], &[w_vec4 as u32, at as u32, 0, 0], [n_groups, 1, 1]);
            Ok(())
        })
    }
}

/// A host copy's placements once its fill is done: an error naming the first expert the store
/// did not lend (a store must lend every id it is asked for).
fn every_expert_lent(mats: Vec<Option<SlotMats>>, layer: usize) -> Result<Vec<SlotMats>, OpError> {
    mats.into_iter()
        .enumerate()
        .map(|(e, m)| {
            m.ok_or_else(|| OpError::Unsupported {
                op: "moe_ffn (host tier)",
                backend: "wgpu",
                why: format!("the store did not lend expert {e} of layer {layer}"),
            })
        })
        .collect()
}

/// A buffer of `bytes` in host memory that kernels may read (over PCIe on a discrete GPU).
/// wgpu has no memory-location hint, but its Vulkan back end places a buffer by its map
/// usage: `MAP_READ` asks gpu-allocator for `HOST_VISIBLE | HOST_COHERENT | HOST_CACHED`
/// memory (system RAM; `MAP_WRITE` would prefer device-local host-visible memory, ReBAR,
/// which is GPU memory). `MAP_READ` beside `STORAGE` needs `MAPPABLE_PRIMARY_BUFFERS`
/// (requested by [`WgpuBackend::new`] when offered; checked by `with_expert_store`). The
/// buffer is never mapped: it is filled by copies from the staging ring.
fn host_tier_buffer(device: &wgpu::Device, bytes: u64) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("expert host tier"),
        size: bytes.next_multiple_of(256),
        usage: wgpu::BufferUsages::MAP_READ
            | wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf::GgmlType;

    /// Two regions of 2 and 1 slots; layers 0 and 2 share region 0, layer 1 has region 1, layer
    /// 3 none yet (not counted). Region 0 keeps (0, e1) = 9 and (2, e0) = 7; region 1 (1, e2) = 5.
    #[test]
    fn hindsight_keeps_each_regions_most_selected_experts() {
        let counts = vec![vec![1, 9, 0], vec![4, 0, 5], vec![7, 2, 6], vec![100, 100, 100]];
        let region_of = vec![Some(0), Some(1), Some(0), None];
        assert_eq!(hindsight_hits(&counts, &region_of, &[0..2, 2..3]), Some(9 + 7 + 5));
        assert_eq!(hindsight_hits(&counts, &[], &[0..2, 2..3]), None);
    }

    /// A call's selections count once per call whatever its tokens (the hindsight line counts
    /// decode calls), and without LFU only the counts move.
    #[test]
    fn selections_count_once_per_call() {
        let mut st = TierState::new(4);
        st.ensure_layer(0, 3);
        st.note_selected_by(0, [(0, 12), (1, 6)].into_iter(), 12, Some(0.99));
        st.note_selected(0, &[1], Some(0.99));
        assert_eq!(st.selected_count[0], vec![1, 2, 0]);
        let before = st.score[0].clone();
        st.note_selected_by(0, [(2, 3)].into_iter(), 3, None);
        assert_eq!((st.selected_count[0].clone(), &st.score[0]), (vec![1, 2, 1], &before));
    }

    #[test]
    fn repack_into_matches_repack() {
        let of = |t| TypeLayout::of(t).unwrap();
        let q4_0g = TypeLayout::q4_0_grouped();
        for (l, k) in [
            (of(GgmlType::Q4_0), 64),
            (q4_0g, 512),
            (of(GgmlType::Q6_K), 256),
            (of(GgmlType::Q4_K), 256),
            (TypeLayout::q4_k_grouped(), 256),
            (of(GgmlType::F16), 12),
        ] {
            let t = l.name;
            let n_rows = 3;
            let stored = if l.is_float() { k * l.block_bytes() / 8 } else { k / l.block_values * l.block_bytes() };
            let src: Vec<u8> = (0..n_rows * stored).map(|i| (i * 7 + 3) as u8).collect();
            let want = l.repack(&src, n_rows, k);
            // Garbage first: padding must come out zero.
            let mut got = vec![0xAAu8; 4 * want.len()];
            repack_into(&l, &src, n_rows, k, &mut got);
            assert_eq!(got, bytemuck::cast_slice::<u32, u8>(&want), "{t} k {k}");
        }
    }

    #[test]
    fn slot_bytes_leave_room_to_align_each_matrix() {
        // Q4_K rows of 256 are 36 words, Q6_K rows 53: one spare row each.
        let b = expert_slot_bytes(&[(GgmlType::Q4_K, 4, 256), (GgmlType::Q6_K, 2, 256)]).unwrap();
        assert_eq!(b, 4 * (5 * 36 + 3 * 53));
        assert_eq!(expert_slot_bytes(&[(GgmlType::Q8_K, 1, 256)]), None);
    }
}
