//! Experts paged from disk into a bounded host cache, so a mixture-of-experts model runs in less
//! RAM than its experts take.
//!
//! [`Pager`] implements compute's [`ExpertStore`]: a back end given one
//! (`CpuBackend::with_expert_store`) asks it for the experts each `moe_ffn` call routes to, and
//! the model files never learn that their experts are not resident. Dense weights stay memory
//! mapped; the expert tensors (`blk.N.ffn_{gate,up,down}_exps.weight`) are never touched through
//! the map but read with `pread` into a slab of equal slots, one slot holding one expert's gate,
//! up and down matrices of one layer.
//!
//! ```no_run
//! use std::sync::Arc;
//! use compute::cpu::CpuBackend;
//! use pager::{CachePolicy, Pager, PagerOptions};
//!
//! let model = Arc::new(gguf::GgufModel::open("qwen3-30b-a3b.gguf")?);
//! let pager = Arc::new(Pager::open(&model, &PagerOptions::new(8 << 30, CachePolicy::Lfu))?);
//! let backend = CpuBackend::default().with_expert_store(pager.clone());
//! // models::load_on(backend, &model, &opts) ... then:
//! println!("{}", pager.format_stats());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Design choices:
//! - **A hard budget.** Every byte the pager keeps (slab, index, per-call scratch) is counted
//!   against [`PagerOptions::ram_budget_bytes`] before anything is allocated; the slab is one
//!   allocation made once. A call that routes to more experts than the budget holds is served
//!   in consecutive groups (the store lends a group, the back end computes it, the next group
//!   evicts), so even a one-slot budget computes every model correctly.
//! - **Same order as resident.** Experts are lent in the order asked for (ascending ids), so a
//!   paged run adds the same terms in the same order as a resident one: bit-identical logits.
//! - **Policies.** LRU evicts the slot used longest ago; LFU keeps a per-expert score that decays
//!   by [`LFU_DECAY`] each time its layer runs and gains 1 each time the router selects the
//!   expert, hit or miss, and evicts the lowest score (ties: least recent).
//! - **Reads in flight.** The misses of one group are read by several threads at once (an SSD
//!   needs queue depth to reach its bandwidth); a prefill batch reads each expert it touches
//!   once, since `moe_ffn` groups tokens by expert before asking.
//! - **Prefetch** ([`PagerOptions::prefetch`]). While layer L computes, a background thread reads
//!   the experts layer L+1 is likely to pick into slots of the same slab: those its router ranks
//!   highest for layer L's input, which the back end passes on ([`ExpertStore::note_input`];
//!   `guess.rs`), else those it picked on its previous call, most popular first by LFU score.
//!   The routers are kept in 8 bits, counted against the budget like the slots. A call that
//!   finds its expert still loading waits for that read instead of issuing another. The lock is
//!   not held while a group computes, so the reads overlap the arithmetic.
//! - **`O_DIRECT`** ([`PagerOptions::direct_io`]). Slots are 4 KiB aligned with a 4 KiB margin
//!   per matrix, so every read can be an aligned `O_DIRECT` read that bypasses the page cache:
//!   the budget then bounds all the memory expert bytes take, not only the process heap. A
//!   filesystem that refuses `O_DIRECT` (tmpfs, some overlays) falls back to buffered reads and
//!   [`Pager::direct_io_refused`] says why.
#![deny(missing_docs)]

mod error;
mod guess;
pub mod placement;
mod read_rate;
mod slab;

pub use error::PagerError;
pub use placement::{DeviceSizes, GpuPlacement, StoredSizes, MIN_SLOTS_PER_TOP_K};
pub use read_rate::{measure_read_rate, ReadRateOptions};

use compute::{ExpertStore, HostExpert, HostMatrix, OpError};
use gguf::{GgmlType, GgufModel};
use guess::Guesses;
use slab::{Slab, ALIGN};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Which cached expert a miss evicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachePolicy {
    /// Least recently used.
    Lru,
    /// Least frequently selected, with decay ([`LFU_DECAY`]).
    Lfu,
}

/// Factor by which every LFU score of a layer shrinks each time that layer runs: a selection
/// counts for about ten calls of its layer (1 / (1 − 0.9)).
pub const LFU_DECAY: f32 = 0.9;

/// How a [`Pager`] is sized and behaves.
#[derive(Clone, Debug)]
pub struct PagerOptions {
    /// Bytes of host memory the pager may hold, all bookkeeping included.
    pub ram_budget_bytes: u64,
    /// Eviction policy.
    pub policy: CachePolicy,
    /// Most expert reads in flight at once.
    pub read_threads: usize,
    /// Read the next layer's likely experts in the background while a layer computes.
    pub prefetch: bool,
    /// Read experts with `O_DIRECT` (bypassing the page cache) where the filesystem allows it.
    pub direct_io: bool,
}

impl PagerOptions {
    /// A budget and policy with eight reads in flight, no prefetch, buffered reads.
    pub fn new(ram_budget_bytes: u64, policy: CachePolicy) -> PagerOptions {
        PagerOptions { ram_budget_bytes, policy, read_threads: 8, prefetch: false, direct_io: false }
    }
}

/// Counters of one layer since the pager opened (or since [`Pager::reset_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Experts the router selected (distinct per call).
    pub selections: u64,
    /// Selections found in the cache (prefetched ones included).
    pub hits: u64,
    /// Selections read from disk by the call that needed them.
    pub misses: u64,
    /// Cached experts dropped to make room.
    pub evictions: u64,
    /// Bytes read from the model file(s), prefetch included.
    pub bytes_read: u64,
    /// Experts computed on the CPU from the host copy.
    pub cpu_computed: u64,
    /// Experts read ahead by the prefetcher.
    pub prefetched: u64,
    /// Selections served by a prefetched expert before anything else used it.
    pub prefetch_hits: u64,
}

impl LayerStats {
    fn add(&mut self, o: &LayerStats) {
        self.selections += o.selections;
        self.hits += o.hits;
        self.misses += o.misses;
        self.evictions += o.evictions;
        self.bytes_read += o.bytes_read;
        self.cpu_computed += o.cpu_computed;
        self.prefetched += o.prefetched;
        self.prefetch_hits += o.prefetch_hits;
    }
}

/// One stacked expert tensor: where expert `e`'s matrix starts in which file.
#[derive(Clone, Debug)]
struct Matrix {
    name: String,
    file: usize,
    offset: u64,
    bytes_per_expert: usize,
    dtype: GgmlType,
    n_out: usize,
    k: usize,
}

impl Matrix {
    /// Bytes this matrix takes in a slot: its size rounded up to [`ALIGN`], plus one [`ALIGN`]
    /// for the part of the first page before it (an aligned read starts there).
    fn region_bytes(&self) -> usize {
        self.bytes_per_expert.div_ceil(ALIGN) * ALIGN + ALIGN
    }

    /// File offset of expert `id`'s matrix.
    fn expert_offset(&self, id: u32) -> u64 {
        self.offset + id as u64 * self.bytes_per_expert as u64
    }
}

#[derive(Clone, Debug)]
struct LayerExperts {
    n_expert: usize,
    gate: Option<Matrix>,
    up: Matrix,
    down: Matrix,
}

impl LayerExperts {
    fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        self.gate.iter().chain([&self.up, &self.down])
    }
    /// Bytes of one expert in the file.
    fn expert_bytes(&self) -> usize {
        self.matrices().map(|m| m.bytes_per_expert).sum()
    }
    /// Bytes of one expert in a slot (aligned regions).
    fn slot_bytes(&self) -> usize {
        self.matrices().map(Matrix::region_bytes).sum()
    }
}

const NO_SLOT: u32 = u32::MAX;

/// Who owns what, policy state and counters; the slab itself is outside the lock (see
/// [`Slab`]): a slot's bytes are written only by whoever marked it `loading`, and read only
/// while it is pinned and not loading.
struct Cache {
    /// Per slot: (layer, expert) held, or `None` when free.
    owner: Vec<Option<(u32, u32)>>,
    /// Per slot: tick of its last use.
    last_use: Vec<u64>,
    /// Per slot: how many groups being computed use it (never evicted while > 0).
    pinned: Vec<u32>,
    /// Per slot: a read into it is in flight (never evicted, lent only once done).
    loading: Vec<bool>,
    /// Per slot: read by the prefetcher and not used since.
    prefetched: Vec<bool>,
    /// Per slot: where, from its start, each matrix's bytes begin (depends on the expert's
    /// file offset within its first page).
    heads: Vec<[u16; 3]>,
    /// Free slots (a stack).
    free: Vec<u32>,
    /// Per layer, per expert: the slot holding it or `NO_SLOT`.
    slot_of: Vec<Vec<u32>>,
    /// Per layer, per expert: LFU score.
    score: Vec<Vec<f32>>,
    /// Per layer: the experts its previous call selected (the prefetch's prediction without a
    /// guess).
    last_ids: Vec<Vec<u32>>,
    /// Per layer: the experts its router ranks highest for the previous layer's input, from the
    /// latest [`ExpertStore::note_input`] (the prefetch's prediction; empty: none).
    guess_ids: Vec<Vec<u32>>,
    tick: u64,
    stats: Vec<LayerStats>,
}

/// The state the calling threads and the prefetch thread share.
struct Shared {
    model_name: String,
    /// Per file: path, handle used for reads, whether that handle is `O_DIRECT`.
    files: Vec<(PathBuf, File, bool)>,
    layers: Vec<Option<LayerExperts>>,
    slot_bytes: usize,
    n_slots: usize,
    policy: CachePolicy,
    read_threads: usize,
    slab: Slab,
    cache: Mutex<Cache>,
    /// Signalled when a read completes or a slot is unpinned.
    changed: Condvar,
}

/// A bounded host cache of experts read from the model's GGUF file(s); see the crate docs.
pub struct Pager {
    shared: Arc<Shared>,
    budget_bytes: u64,
    accounted_bytes: u64,
    direct_io_refused: Option<String>,
    prefetch: Option<Prefetcher>,
    /// With prefetch: every MoE layer's router, to guess the next layer's experts.
    guesses: Option<Guesses>,
}

/// The background reader and the channel that feeds it (dropping the sender stops it).
struct Prefetcher {
    requests: Option<Sender<(usize, Vec<u32>)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        drop(self.requests.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.shared;
        write!(
            f,
            "Pager({}, {} slots of {} B, budget {} B, {:?}, prefetch {}, direct I/O {})",
            s.model_name,
            s.n_slots,
            s.slot_bytes,
            self.budget_bytes,
            s.policy,
            self.prefetch.is_some(),
            self.direct_io()
        )
    }
}

/// Bytes the per-call scratch (group lists, read lists, prefetch requests) may take per expert
/// of a layer.
const SCRATCH_BYTES_PER_EXPERT: usize = 200;

/// `O_DIRECT` from the kernel's uapi headers (fcntl.h), which differ by architecture.
#[cfg(any(target_arch = "aarch64", target_arch = "arm"))]
const O_DIRECT: i32 = 0o200000;
#[cfg(not(any(target_arch = "aarch64", target_arch = "arm")))]
const O_DIRECT: i32 = 0o40000;

/// Opens `path` for `O_DIRECT` reads and proves one aligned read works, or says why not.
fn open_direct(path: &std::path::Path) -> Result<File, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(O_DIRECT).open(path).map_err(|e| e.to_string())?;
    let probe = Slab::new(ALIGN).map_err(|e| e.to_string())?;
    // SAFETY: the probe slab is ours alone, nothing else can see it.
    let buf = unsafe { probe.bytes_mut(0, ALIGN) };
    f.read_at(buf, 0).map_err(|e| format!("an aligned read failed: {e}"))?;
    Ok(f)
}

impl Pager {
    /// Indexes the expert tensors of `model` and sizes the cache to `opts.ram_budget_bytes`.
    ///
    /// # Errors
    /// [`PagerError::NoExperts`] when the model has no stacked experts,
    /// [`PagerError::BadExpertTensor`] for experts whose shapes disagree,
    /// [`PagerError::BudgetTooSmall`] (with the bytes needed) when not even one slot fits,
    /// [`PagerError::Io`] when a file cannot be opened or the slab cannot be allocated.
    pub fn open(model: &Arc<GgufModel>, opts: &PagerOptions) -> Result<Pager, PagerError> {
        let model_name = model.path().display().to_string();
        let layers = index_layers(model)?;
        let Sizes { slot_bytes, index_bytes, per_slot_bytes, all_experts } = sizes(&layers);
        // DISKFORMER_PREFETCH_GUESS=0: the previous selection only (the first predictor, for A/B).
        let guess = std::env::var("DISKFORMER_PREFETCH_GUESS").map_or(true, |v| v != "0");
        let guesses = (opts.prefetch && guess).then(|| {
            let has_experts: Vec<bool> = layers.iter().map(|l| l.is_some()).collect();
            Guesses::from_model(model, &has_experts)
        });
        // The routers kept for the guesses count as bookkeeping.
        let index_bytes = index_bytes + guesses.as_ref().map_or(0, Guesses::bytes);
        let too_small = || PagerError::BudgetTooSmall {
            model: model_name.clone(),
            budget_bytes: opts.ram_budget_bytes,
            slot_bytes: slot_bytes as u64,
            index_bytes,
            needed_bytes: index_bytes + slot_bytes as u64 + per_slot_bytes,
        };
        let room = opts.ram_budget_bytes.checked_sub(index_bytes).ok_or_else(too_small)?;
        // More slots than experts would never be used.
        let n_slots = ((room / (slot_bytes as u64 + per_slot_bytes)) as usize).min(all_experts);
        if n_slots == 0 {
            return Err(too_small());
        }
        let mut direct_io_refused = None;
        let mut files = Vec::new();
        for f in model.files() {
            let p = f.path().to_path_buf();
            let direct = if opts.direct_io {
                match open_direct(&p) {
                    Ok(h) => Some(h),
                    Err(why) => {
                        direct_io_refused = Some(format!(
                            "O_DIRECT refused for {} ({why}): reading through the page cache",
                            p.display()
                        ));
                        None
                    }
                }
            } else {
                None
            };
            let entry = match direct {
                Some(h) => (p, h, true),
                None => {
                    let h = File::open(&p).map_err(|source| PagerError::Io { path: p.clone(), source })?;
                    (p, h, false)
                }
            };
            files.push(entry);
        }
        let accounted_bytes = index_bytes + n_slots as u64 * (slot_bytes as u64 + per_slot_bytes);
        let cache = Cache {
            owner: vec![None; n_slots],
            last_use: vec![0; n_slots],
            pinned: vec![0; n_slots],
            loading: vec![false; n_slots],
            prefetched: vec![false; n_slots],
            heads: vec![[0; 3]; n_slots],
            free: (0..n_slots as u32).rev().collect(),
            slot_of: layers.iter().map(|l| vec![NO_SLOT; l.as_ref().map_or(0, |l| l.n_expert)]).collect(),
            score: layers.iter().map(|l| vec![0.0; l.as_ref().map_or(0, |l| l.n_expert)]).collect(),
            last_ids: layers.iter().map(|l| Vec::with_capacity(l.as_ref().map_or(0, |l| l.n_expert))).collect(),
            guess_ids: vec![Vec::new(); layers.len()],
            tick: 0,
            stats: vec![LayerStats::default(); layers.len()],
        };
        // Last, so that no temporary above is alive beside it.
        let slab = Slab::new(n_slots * slot_bytes)
            .map_err(|source| PagerError::Io { path: PathBuf::from("(expert slab)"), source })?;
        let shared = Arc::new(Shared {
            model_name,
            files,
            layers,
            slot_bytes,
            n_slots,
            policy: opts.policy,
            read_threads: opts.read_threads.max(1),
            slab,
            cache: Mutex::new(cache),
            changed: Condvar::new(),
        });
        let prefetch = opts.prefetch.then(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            let worker = shared.clone();
            let thread = std::thread::Builder::new()
                .name("expert-prefetch".into())
                .spawn(move || prefetch_loop(&worker, &rx))
                .ok();
            Prefetcher { requests: thread.as_ref().map(|_| tx), thread }
        });
        Ok(Pager { shared, budget_bytes: opts.ram_budget_bytes, accounted_bytes, direct_io_refused, prefetch, guesses })
    }

    /// The smallest RAM budget whose cache holds `n_slots` experts of `model` (without prefetch,
    /// whose routers take a little more).
    ///
    /// # Errors
    /// As [`Pager::open`] for a model without (valid) experts.
    pub fn budget_for_slots(model: &GgufModel, n_slots: usize) -> Result<u64, PagerError> {
        let s = sizes(&index_layers(model)?);
        Ok(s.index_bytes + n_slots as u64 * (s.slot_bytes as u64 + s.per_slot_bytes))
    }

    /// Bytes of one slot (gate, up and down of the largest expert of any layer, each in an
    /// aligned region).
    pub fn slot_bytes(&self) -> usize {
        self.shared.slot_bytes
    }

    /// Experts the cache holds at once.
    pub fn n_slots(&self) -> usize {
        self.shared.n_slots
    }

    /// The budget it was opened with.
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// Bytes counted against the budget (slab, index and scratch reserve); never above it.
    pub fn accounted_bytes(&self) -> u64 {
        self.accounted_bytes
    }

    /// Total bytes of every expert of every layer (what a resident run would map).
    pub fn expert_bytes_total(&self) -> u64 {
        self.shared.layers.iter().flatten().map(|l| (l.expert_bytes() * l.n_expert) as u64).sum()
    }

    /// The eviction policy.
    pub fn policy(&self) -> CachePolicy {
        self.shared.policy
    }

    /// True when every file is read with `O_DIRECT`.
    pub fn direct_io(&self) -> bool {
        self.shared.files.iter().all(|f| f.2)
    }

    /// Why `O_DIRECT` was asked for but not used (the filesystem refused it), if so.
    pub fn direct_io_refused(&self) -> Option<&str> {
        self.direct_io_refused.as_deref()
    }

    /// True when a background thread prefetches the next layer's experts.
    pub fn prefetches(&self) -> bool {
        self.prefetch.is_some()
    }

    /// Per-layer counters, indexed by layer (layers without experts stay zero).
    pub fn stats(&self) -> Vec<LayerStats> {
        self.shared.lock().stats.clone()
    }

    /// The counters of every layer added up.
    pub fn total_stats(&self) -> LayerStats {
        let mut t = LayerStats::default();
        self.shared.lock().stats.iter().for_each(|s| t.add(s));
        t
    }

    /// Sets every counter to zero (the cache keeps its contents).
    pub fn reset_stats(&self) {
        self.shared.lock().stats.iter_mut().for_each(|s| *s = LayerStats::default());
    }

    /// A table of the per-layer counters and their total, for `--stats`.
    pub fn format_stats(&self) -> String {
        let stats = self.stats();
        let s = &self.shared;
        let mut out = format!(
            "expert cache: {} slots of {:.2} MiB ({:?}, prefetch {}, {} reads), {} of budget {} used, experts total {}\n",
            s.n_slots,
            s.slot_bytes as f64 / (1u64 << 20) as f64,
            s.policy,
            if self.prefetches() { "on" } else { "off" },
            if self.direct_io() { "O_DIRECT" } else { "buffered" },
            error::gib(self.accounted_bytes),
            error::gib(self.budget_bytes),
            error::gib(self.expert_bytes_total()),
        );
        out.push_str(
            "layer  selected      hits    misses  evicted  read MiB  cpu experts  prefetched  pf hits  hit rate\n",
        );
        let row = |name: String, s: &LayerStats| {
            format!(
                "{name:>5} {:>9} {:>9} {:>9} {:>8} {:>9.1} {:>12} {:>11} {:>8} {:>8.1}%\n",
                s.selections,
                s.hits,
                s.misses,
                s.evictions,
                s.bytes_read as f64 / (1u64 << 20) as f64,
                s.cpu_computed,
                s.prefetched,
                s.prefetch_hits,
                100.0 * s.hits as f64 / s.selections.max(1) as f64
            )
        };
        let mut total = LayerStats::default();
        for (il, st) in stats.iter().enumerate() {
            if s.layers[il].is_some() {
                out.push_str(&row(il.to_string(), st));
                total.add(st);
            }
        }
        out.push_str(&row("all".into(), &total));
        out
    }

    /// Asks the prefetcher for the experts the layer after `layer` will likely use.
    fn request_prefetch(&self, c: &Cache, layer: usize) {
        let Some(tx) = self.prefetch.as_ref().and_then(|p| p.requests.as_ref()) else { return };
        let s = &self.shared;
        let Some(next) = s.next_moe_layer(layer) else { return };
        // Never more than a quarter of the cache: the rest holds what the layers in between use.
        // The router's guess when the back end gave this layer's input, best first; else the
        // next layer's previous selection, the most popular first.
        let guessed = !c.guess_ids[next].is_empty();
        let predicted = if guessed { &c.guess_ids[next] } else { &c.last_ids[next] };
        let cap = (s.n_slots / 4).min(predicted.len());
        if cap == 0 {
            return;
        }
        let mut want: Vec<u32> =
            predicted.iter().copied().filter(|&e| c.slot_of[next][e as usize] == NO_SLOT).collect();
        if s.policy == CachePolicy::Lfu && !guessed {
            want.sort_by(|&a, &b| c.score[next][b as usize].total_cmp(&c.score[next][a as usize]));
        }
        want.truncate(cap);
        if !want.is_empty() {
            // A closed channel means the thread is gone: prefetch is only a hint.
            let _ = tx.send((next, want));
        }
    }
}

impl Shared {
    /// The first layer after `layer` that has experts (what a prefetch reads for).
    fn next_moe_layer(&self, layer: usize) -> Option<usize> {
        (layer + 1..self.layers.len()).find(|&l| self.layers[l].is_some())
    }

    fn lock(&self) -> MutexGuard<'_, Cache> {
        // A panic while computing a group leaves the cache consistent (pins are only hints
        // for eviction), so a poisoned lock is still usable.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Cache>) -> MutexGuard<'a, Cache> {
        self.changed.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// The slot a read goes to: a free one, else the unpinned, settled one the policy ranks
    /// lowest.
    fn victim(&self, c: &mut Cache) -> Option<usize> {
        while let Some(s) = c.free.pop() {
            // A slot freed by a failed read ahead may still be pinned by a group about to
            // report that failure: it is reused only once unpinned (it is not in `free` then,
            // but free of an owner, so the scan below finds it).
            if c.pinned[s as usize] == 0 {
                return Some(s as usize);
            }
        }
        let mut best: Option<(usize, f32, u64)> = None;
        for s in 0..self.n_slots {
            if c.pinned[s] > 0 || c.loading[s] {
                continue;
            }
            let score = match (self.policy, c.owner[s]) {
                (CachePolicy::Lfu, Some((l, e))) => c.score[l as usize][e as usize],
                _ => 0.0,
            };
            let lu = c.last_use[s];
            if best.is_none_or(|(_, bs, bl)| score < bs || (score == bs && lu < bl)) {
                best = Some((s, score, lu));
            }
        }
        best.map(|b| b.0)
    }

    /// Claims slot `v` for expert `id` of `layer` (evicting its owner) and marks it loading.
    fn claim(&self, c: &mut Cache, v: usize, layer: usize, id: u32, le: &LayerExperts) {
        if let Some((ol, oe)) = c.owner[v].take() {
            c.slot_of[ol as usize][oe as usize] = NO_SLOT;
            c.stats[layer].evictions += 1;
        }
        c.owner[v] = Some((layer as u32, id));
        c.slot_of[layer][id as usize] = v as u32;
        c.loading[v] = true;
        c.prefetched[v] = false;
        let mut heads = [0u16; 3];
        for (h, m) in heads.iter_mut().zip(le.matrices()) {
            *h = self.head(m, id) as u16;
        }
        c.heads[v] = heads;
    }

    /// Undoes [`Shared::claim`] after a failed read.
    fn unclaim(&self, c: &mut Cache, v: usize, layer: usize, id: u32) {
        c.owner[v] = None;
        c.slot_of[layer][id as usize] = NO_SLOT;
        c.loading[v] = false;
        c.free.push(v as u32);
    }

    /// Where expert `id`'s matrix `m` starts within its slot region: its offset within its
    /// first page when reads are aligned, else 0.
    fn head(&self, m: &Matrix, id: u32) -> usize {
        if self.files[m.file].2 {
            (m.expert_offset(id) % ALIGN as u64) as usize
        } else {
            0
        }
    }

    /// Reads expert `id` of `le` into slot `slot` (whose `heads` are set).
    ///
    /// # Safety
    /// The caller marked `slot` loading under the lock: no one else reads or writes it.
    unsafe fn read_slot(&self, le: &LayerExperts, id: u32, slot: usize) -> Result<(), OpError> {
        let mut at = slot * self.slot_bytes;
        for m in le.matrices() {
            let (path, f, direct) = &self.files[m.file];
            let region = m.region_bytes();
            // SAFETY: the region lies inside `slot`, which the caller holds exclusively.
            let dst = unsafe { self.slab.bytes_mut(at, region) };
            let off = m.expert_offset(id);
            let (file_at, want, need) = if *direct {
                let head = (off % ALIGN as u64) as usize;
                let want = (head + m.bytes_per_expert).div_ceil(ALIGN) * ALIGN;
                (off - head as u64, want, head + m.bytes_per_expert)
            } else {
                (off, m.bytes_per_expert, m.bytes_per_expert)
            };
            read_at_least(f, &mut dst[..want], file_at, need).map_err(|e| OpError::Weight {
                name: m.name.clone(),
                why: format!("reading expert {id} from {}: {e}", path.display()),
            })?;
            at += region;
        }
        Ok(())
    }

    /// Reads `(id, slot)` pairs, several at once.
    ///
    /// # Safety
    /// As [`Shared::read_slot`] for every slot.
    unsafe fn read_many(&self, le: &LayerExperts, reads: &[(u32, usize)]) -> Result<(), OpError> {
        let n_threads = self.read_threads.min(reads.len());
        if n_threads <= 1 {
            // SAFETY: forwarded from the caller.
            return reads.iter().try_for_each(|&(id, s)| unsafe { self.read_slot(le, id, s) });
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..n_threads)
                .map(|t| {
                    scope.spawn(move || {
                        reads.iter().skip(t).step_by(n_threads).try_for_each(|&(id, s)| {
                            // SAFETY: forwarded from the caller; each pair goes to one thread.
                            unsafe { self.read_slot(le, id, s) }
                        })
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(OpError::Weight { name: "experts".into(), why: "a read thread panicked".into() })
                })
            })
        })
    }

    /// The matrices of expert `id` held in `slot`, borrowed from the slab.
    ///
    /// # Safety
    /// `slot` is pinned and not loading for as long as the result lives.
    unsafe fn lend(&self, le: &LayerExperts, id: u32, slot: usize, heads: [u16; 3]) -> HostExpert<'_> {
        let mut at = slot * self.slot_bytes;
        let mut heads = heads.into_iter();
        let mut take = |m: &Matrix| {
            let head = heads.next().unwrap_or(0) as usize;
            // SAFETY: pinned and settled: nobody writes this slot meanwhile.
            let bytes = unsafe { self.slab.bytes(at + head, m.bytes_per_expert) };
            at += m.region_bytes();
            HostMatrix { dtype: m.dtype, bytes, n_out: m.n_out, k: m.k }
        };
        let gate = le.gate.as_ref().map(&mut take);
        let up = take(&le.up);
        let down = take(&le.down);
        HostExpert { id, gate, up, down }
    }
}

/// Reads into `buf` from `offset` until at least `need` bytes came (an aligned read may run past
/// the end of the file and come back short).
fn read_at_least(f: &File, buf: &mut [u8], offset: u64, need: usize) -> std::io::Result<()> {
    let mut got = 0;
    while got < need {
        match f.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("file ends {got} bytes after offset {offset}, {need} needed"),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The prefetch thread: for each request (the latest one only, when several queued up), claims
/// slots for the experts not cached yet and reads them.
fn prefetch_loop(s: &Shared, rx: &Receiver<(usize, Vec<u32>)>) {
    while let Ok(mut req) = rx.recv() {
        while let Ok(newer) = rx.try_recv() {
            req = newer;
        }
        let (layer, ids) = req;
        let Some(le) = s.layers.get(layer).and_then(|l| l.as_ref()) else { continue };
        let mut reads = Vec::with_capacity(ids.len());
        {
            let mut c = s.lock();
            for id in ids {
                if c.slot_of[layer][id as usize] != NO_SLOT {
                    continue;
                }
                let Some(v) = s.victim(&mut c) else { break };
                s.claim(&mut c, v, layer, id, le);
                reads.push((id, v));
            }
        }
        if reads.is_empty() {
            continue;
        }
        // SAFETY: every slot in `reads` was marked loading by this thread above.
        let result = unsafe { s.read_many(le, &reads) };
        let mut c = s.lock();
        for &(id, v) in &reads {
            if result.is_ok() {
                c.loading[v] = false;
                c.prefetched[v] = true;
            } else {
                // A failed read ahead is dropped; the call that needs the expert reads it again
                // and reports the error.
                s.unclaim(&mut c, v, layer, id);
            }
        }
        if result.is_ok() {
            c.stats[layer].prefetched += reads.len() as u64;
            c.stats[layer].bytes_read += (reads.len() * le.expert_bytes()) as u64;
        }
        drop(c);
        s.changed.notify_all();
    }
}

/// The expert tensors of every layer (`None` for layers without experts).
fn index_layers(model: &GgufModel) -> Result<Vec<Option<LayerExperts>>, PagerError> {
    let mut layers: Vec<Option<LayerExperts>> = Vec::new();
    let n_layers = model
        .tensors()
        .filter_map(|t| t.name().strip_prefix("blk.")?.split('.').next()?.parse::<usize>().ok())
        .max()
        .map_or(0, |l| l + 1);
    for il in 0..n_layers {
        let name = |p: &str| format!("blk.{il}.ffn_{p}_exps.weight");
        let Some(up) = matrix(model, &name("up"))? else {
            layers.push(None);
            continue;
        };
        let down = matrix(model, &name("down"))?.ok_or_else(|| PagerError::BadExpertTensor {
            name: name("down"),
            why: "missing beside ffn_up_exps".into(),
        })?;
        let gate = matrix(model, &name("gate"))?;
        let n_expert = up.1;
        for m in gate.iter().chain([&down]) {
            if m.1 != n_expert {
                return Err(PagerError::BadExpertTensor {
                    name: m.0.name.clone(),
                    why: format!("{} experts, but ffn_up_exps has {n_expert}", m.1),
                });
            }
        }
        layers.push(Some(LayerExperts { n_expert, gate: gate.map(|g| g.0), up: up.0, down: down.0 }));
    }
    if layers.iter().all(|l| l.is_none()) {
        return Err(PagerError::NoExperts { model: model.path().display().to_string() });
    }
    Ok(layers)
}

/// What a cache of a given number of slots costs.
struct Sizes {
    slot_bytes: usize,
    index_bytes: u64,
    per_slot_bytes: u64,
    all_experts: usize,
}

fn sizes(layers: &[Option<LayerExperts>]) -> Sizes {
    let present = || layers.iter().flatten();
    let slot_bytes = present().map(|l| l.slot_bytes()).max().unwrap_or(0);
    let max_experts = present().map(|l| l.n_expert).max().unwrap_or(0);
    let all_experts: usize = present().map(|l| l.n_expert).sum();
    // Bookkeeping, counted before allocating: per-layer tables (slot, score, last selection per
    // expert), per-slot state, the index of layers and the scratch one call needs.
    let index_bytes = (all_experts * (2 * size_of::<u32>() + size_of::<f32>())
        + layers.len()
            * (size_of::<Option<LayerExperts>>() + 3 * 64 + 3 * size_of::<Vec<u32>>() + size_of::<LayerStats>())
        + size_of::<Shared>()
        + max_experts * SCRATCH_BYTES_PER_EXPERT) as u64;
    let per_slot_bytes = (size_of::<Option<(u32, u32)>>()
        + size_of::<u64>()
        + 2 * size_of::<u32>()
        + 2 * size_of::<bool>()
        + size_of::<[u16; 3]>()) as u64;
    Sizes { slot_bytes, index_bytes, per_slot_bytes, all_experts }
}

/// Expert tensor `name` of `model` split into experts: the matrix and the expert count.
fn matrix(model: &GgufModel, name: &str) -> Result<Option<(Matrix, usize)>, PagerError> {
    let Some((fi, info)) = model.tensor_location(name) else { return Ok(None) };
    let bad = |why: String| PagerError::BadExpertTensor { name: name.to_string(), why };
    // GGUF order: ne0 = k (row length), ne1 = n_out, ne2 = experts.
    let [k, n_out, n_expert] = info.shape[..] else {
        return Err(bad(format!("shape {:?} is not [k, n_out, n_expert]", info.shape)));
    };
    if n_expert == 0 || info.size_bytes % n_expert != 0 {
        return Err(bad(format!("{} bytes do not split into {n_expert} experts", info.size_bytes)));
    }
    let f = &model.files()[fi];
    Ok(Some((
        Matrix {
            name: name.to_string(),
            file: fi,
            offset: f.data_offset + info.offset,
            bytes_per_expert: (info.size_bytes / n_expert) as usize,
            dtype: info.dtype,
            n_out: n_out as usize,
            k: k as usize,
        },
        n_expert as usize,
    )))
}

/// The experts of `layer`, after checking that the layer has experts and every id is one of them
/// (both expert stores answer a back end's request through this).
fn layer_experts<'a>(
    layers: &'a [Option<LayerExperts>],
    layer: usize,
    ids: &[u32],
    op: &'static str,
    model: &dyn std::fmt::Display,
) -> Result<&'a LayerExperts, OpError> {
    let le = layers.get(layer).and_then(|l| l.as_ref()).ok_or_else(|| OpError::Weight {
        name: format!("blk.{layer}.ffn_up_exps.weight"),
        why: format!("{model} has no experts in layer {layer}"),
    })?;
    if let Some(&bad) = ids.iter().find(|&&e| e as usize >= le.n_expert) {
        return Err(OpError::ShapeMismatch {
            op,
            expected: format!("expert ids < {}", le.n_expert),
            got: vec![bad as usize],
        });
    }
    Ok(le)
}

impl Pager {
    /// [`ExpertStore::with_host_experts`], the LFU scores raised by `tokens` (per id, of
    /// `n_tokens`) where the caller counted them, else by one each.
    fn lend_for(
        &self,
        layer: usize,
        ids: &[u32],
        tokens: Option<(&[u32], usize)>,
        compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
    ) -> Result<(), OpError> {
        let s = &*self.shared;
        let le = layer_experts(&s.layers, layer, ids, "pager", &s.model_name)?;
        let mut c = s.lock();
        c.tick += 1;
        let tick = c.tick;
        c.stats[layer].selections += ids.len() as u64;
        if s.policy == CachePolicy::Lfu {
            match tokens.filter(|(t, _)| t.len() == ids.len()) {
                Some((t, n)) => compute::lfu::note_call(
                    &mut c.score[layer],
                    ids.iter().copied().zip(t.iter().copied()),
                    n,
                    LFU_DECAY,
                ),
                None => compute::lfu::note_call(&mut c.score[layer], ids.iter().map(|&e| (e, 1)), 1, LFU_DECAY),
            }
        }
        let mut prefetch_asked = false;
        let mut i = 0;
        while i < ids.len() {
            let mut group: Vec<(u32, usize)> = Vec::with_capacity(ids.len() - i);
            let mut misses: Vec<(u32, usize)> = Vec::new();
            while i < ids.len() {
                let id = ids[i];
                let held = c.slot_of[layer][id as usize];
                let slot = if held != NO_SLOT {
                    let held = held as usize;
                    c.stats[layer].hits += 1;
                    if std::mem::take(&mut c.prefetched[held]) {
                        c.stats[layer].prefetch_hits += 1;
                    }
                    held
                } else {
                    let Some(v) = s.victim(&mut c) else { break };
                    s.claim(&mut c, v, layer, id, le);
                    misses.push((id, v));
                    v
                };
                c.pinned[slot] += 1;
                c.last_use[slot] = tick;
                group.push((id, slot));
                i += 1;
            }
            if group.is_empty() {
                // Every slot is pinned by other calls or loading: wait for one to settle.
                c = s.wait(c);
                continue;
            }
            if !misses.is_empty() {
                drop(c);
                // SAFETY: every miss slot was claimed (marked loading) by this call above.
                let result = unsafe { s.read_many(le, &misses) };
                c = s.lock();
                for &(id, v) in &misses {
                    if result.is_ok() {
                        c.loading[v] = false;
                    } else {
                        s.unclaim(&mut c, v, layer, id);
                    }
                }
                s.changed.notify_all();
                if let Err(e) = result {
                    group.iter().for_each(|&(_, v)| c.pinned[v] -= 1);
                    return Err(e);
                }
                let st = &mut c.stats[layer];
                st.misses += misses.len() as u64;
                st.bytes_read += (misses.len() * le.expert_bytes()) as u64;
            }
            // Hits on experts the prefetcher is still reading wait for that read.
            while group.iter().any(|&(_, v)| c.loading[v]) {
                c = s.wait(c);
            }
            // A failed read ahead gives its slot up; the expert is then not where the group
            // expected it.
            if let Some(&(id, _)) = group.iter().find(|&&(id, v)| c.owner[v] != Some((layer as u32, id))) {
                group.iter().for_each(|&(_, v)| c.pinned[v] -= 1);
                s.changed.notify_all();
                return Err(OpError::Weight {
                    name: format!("blk.{layer}.ffn_up_exps.weight"),
                    why: format!("reading expert {id} ahead from {} failed", s.model_name),
                });
            }
            if !prefetch_asked {
                prefetch_asked = true;
                self.request_prefetch(&c, layer);
            }
            let heads: Vec<[u16; 3]> = group.iter().map(|&(_, v)| c.heads[v]).collect();
            drop(c);
            let lent: Vec<HostExpert<'_>> = group
                .iter()
                .zip(heads)
                // SAFETY: each slot is pinned and settled until the unpin below.
                .map(|(&(id, v), h)| unsafe { s.lend(le, id, v, h) })
                .collect();
            let r = compute(&lent);
            drop(lent);
            c = s.lock();
            group.iter().for_each(|&(_, v)| c.pinned[v] -= 1);
            s.changed.notify_all();
            r?;
            c.stats[layer].cpu_computed += group.len() as u64;
        }
        c.last_ids[layer].clear();
        c.last_ids[layer].extend_from_slice(ids);
        Ok(())
    }
}

impl ExpertStore for Pager {
    fn note_input(&self, layer: usize, x: &[f32], k: usize) {
        let Some(g) = &self.guesses else { return };
        let s = &self.shared;
        let Some(next) = s.next_moe_layer(layer) else { return };
        // Computed before the lock: the prefetch thread and other callers need it meanwhile.
        let ids = g.guess(next, x, k, s.n_slots / 4, false);
        s.lock().guess_ids[next] = ids;
    }

    fn with_host_experts(
        &self,
        layer: usize,
        ids: &[u32],
        compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
    ) -> Result<(), OpError> {
        self.lend_for(layer, ids, None, compute)
    }

    fn with_host_experts_of_tokens(
        &self,
        layer: usize,
        ids: &[u32],
        tokens: &[u32],
        n_tokens: usize,
        compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
    ) -> Result<(), OpError> {
        self.lend_for(layer, ids, Some((tokens, n_tokens)), compute)
    }
}

/// Experts lent straight from the model's memory map: the store behind the GPU expert tier when
/// no RAM budget is given, so the kernel's page cache is the host tier. Nothing is counted; every
/// call lends all the experts asked for in one group. How the CPU's reads reach the pages is
/// [`MappedAccess`].
pub struct MappedExperts {
    model: Arc<GgufModel>,
    layers: Vec<Option<LayerExperts>>,
    access: MappedAccess,
    /// Per layer, with [`MappedAccess::HugeCopy`]: its stacked matrices copied (gate, up, down).
    copies: Vec<Option<LayerCopy>>,
    /// The routers for [`ExpertStore::guess_experts`], made at the first guess: only the GPU's
    /// split miss mode asks for guesses, and a CPU run should not pay their ~0.3 MB a layer.
    guesses: std::sync::OnceLock<Guesses>,
}

/// How a [`MappedExperts`] store's experts reach the CPU that computes them.
///
/// Why not always the plain map: the split miss mode's CPU reads ~12 MB of experts per layer on
/// 16 threads, in random order over the whole model. Through the file's map each 4 KiB page is
/// a TLB entry, and each page not yet touched by this process a minor fault on first use (16
/// pages at a time); a copy in anonymous memory can sit in 2 MiB pages instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MappedAccess {
    /// The file's map, pages entered at first touch.
    Map,
    /// The file's map, every expert page entered into the page tables at open
    /// (`MADV_POPULATE_READ`).
    Populate,
    /// A copy of every expert in anonymous memory advised to transparent huge pages
    /// (`MADV_HUGEPAGE`): the experts' bytes again in RAM, beside the page cache's (which the
    /// kernel may drop).
    HugeCopy,
}

impl MappedAccess {
    /// The access `DISKFORMER_MAPPED_EXPERTS` names (`map`, `populate`, `huge`), else `Map`
    /// (an unknown name says so on standard error).
    pub fn from_env() -> MappedAccess {
        match std::env::var("DISKFORMER_MAPPED_EXPERTS").as_deref().map(str::trim) {
            Ok("populate") => MappedAccess::Populate,
            Ok("huge") => MappedAccess::HugeCopy,
            Ok("map") | Err(_) => MappedAccess::Map,
            Ok(other) => {
                eprintln!("DISKFORMER_MAPPED_EXPERTS={other}: not map, populate or huge; using map");
                MappedAccess::Map
            }
        }
    }
}

/// One layer's stacked expert matrices, copied.
struct LayerCopy {
    gate: Option<memmap2::Mmap>,
    up: memmap2::Mmap,
    down: memmap2::Mmap,
}

impl std::fmt::Debug for MappedExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedExperts({}, {:?})", self.model.path().display(), self.access)
    }
}

impl MappedExperts {
    /// Indexes the expert tensors of `model`, with the access `DISKFORMER_MAPPED_EXPERTS` names.
    ///
    /// # Errors
    /// As [`MappedExperts::open_with`].
    pub fn open(model: &Arc<GgufModel>) -> Result<MappedExperts, PagerError> {
        MappedExperts::open_with(model, MappedAccess::from_env())
    }

    /// Indexes the expert tensors of `model` and prepares `access` (populating the map's pages
    /// or copying the experts, on all cores).
    ///
    /// # Errors
    /// [`PagerError::NoExperts`] and [`PagerError::BadExpertTensor`] as [`Pager::open`];
    /// [`PagerError::Io`] when populating or allocating the copy failed.
    pub fn open_with(model: &Arc<GgufModel>, access: MappedAccess) -> Result<MappedExperts, PagerError> {
        let layers = index_layers(model)?;
        // Each stacked matrix with its length in bytes (all of its layer's experts).
        let matrices: Vec<(&Matrix, usize)> = layers
            .iter()
            .flatten()
            .flat_map(|l| l.matrices().map(move |m| (m, m.bytes_per_expert * l.n_expert)))
            .collect();
        let io = |source: std::io::Error| PagerError::Io { path: model.path().to_path_buf(), source };
        let mut copies = Vec::new();
        match access {
            MappedAccess::Map => {}
            MappedAccess::Populate => {
                let files = model.files();
                let pieces: Vec<(usize, u64, u64)> = matrices
                    .iter()
                    .flat_map(|&(m, len)| {
                        let len = len as u64;
                        (0..len)
                            .step_by(COPY_PIECE)
                            .map(move |at| (m.file, m.offset + at, (len - at).min(COPY_PIECE as u64)))
                    })
                    .collect();
                on_all_cores(pieces, |(file, at, len)| files[file].populate(at, len)).map_err(io)?;
            }
            MappedAccess::HugeCopy => {
                let files = model.files();
                let mut maps = Vec::with_capacity(matrices.len());
                for &(_, len) in &matrices {
                    let map = memmap2::MmapMut::map_anon(len.max(1)).map_err(io)?;
                    #[cfg(target_os = "linux")]
                    // Refused where the kernel has no transparent huge pages: 4 KiB pages then.
                    let _ = map.advise(memmap2::Advice::HugePage);
                    maps.push(map);
                }
                let mut pieces = Vec::new();
                for (map, &(m, len)) in maps.iter_mut().zip(&matrices) {
                    let at = m.offset as usize;
                    let src = &files[m.file].raw_bytes()[at..at + len];
                    pieces.extend(map.chunks_mut(COPY_PIECE).zip(src.chunks(COPY_PIECE)));
                }
                on_all_cores(pieces, |(dst, src)| {
                    dst[..src.len()].copy_from_slice(src);
                    Ok(())
                })
                .map_err(io)?;
                let mut maps = maps
                    .into_iter()
                    .map(|m| m.make_read_only())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(io)?
                    .into_iter();
                for l in &layers {
                    copies.push(l.as_ref().map(|l| LayerCopy {
                        gate: l.gate.as_ref().and_then(|_| maps.next()),
                        up: maps.next().expect("one copy per matrix"),
                        down: maps.next().expect("one copy per matrix"),
                    }));
                }
            }
        }
        Ok(MappedExperts { model: model.clone(), layers, access, copies, guesses: std::sync::OnceLock::new() })
    }

    /// How this store's experts reach the CPU.
    pub fn access(&self) -> MappedAccess {
        self.access
    }
}

/// Bytes one thread populates or copies at a time.
const COPY_PIECE: usize = 8 << 20;

/// Runs `work` on every item, spread over the machine's cores; the first error, if any.
fn on_all_cores<T: Send>(items: Vec<T>, work: impl Fn(T) -> std::io::Result<()> + Sync) -> std::io::Result<()> {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get()).min(items.len().max(1));
    let queue = std::sync::Mutex::new(items.into_iter());
    let first_error = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let Some(item) = queue.lock().unwrap_or_else(|e| e.into_inner()).next() else { break };
                if let Err(e) = work(item) {
                    first_error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                    break;
                }
            });
        }
    });
    first_error.into_inner().unwrap_or_else(|e| e.into_inner()).map_or(Ok(()), Err)
}

impl MappedExperts {
    /// Experts `ids` of `layer` as the CPU reads them: slices of the copy or of the file's map.
    fn lend(&self, layer: usize, ids: &[u32]) -> Result<Vec<HostExpert<'_>>, OpError> {
        let le = layer_experts(&self.layers, layer, ids, "mapped experts", &self.model.path().display())?;
        let files = self.model.files();
        let copy = self.copies.get(layer).and_then(|c| c.as_ref()).filter(|_| !compute::ab::is_b("map"));
        fn take<'a>(
            files: &'a [gguf::GgufFile],
            m: &Matrix,
            copied: Option<&'a memmap2::Mmap>,
            id: u32,
        ) -> HostMatrix<'a> {
            // Offsets and sizes were checked against the file when it was opened; a copy holds
            // the whole stacked tensor.
            let bytes = match copied {
                Some(c) => &c[id as usize * m.bytes_per_expert..(id as usize + 1) * m.bytes_per_expert],
                None => {
                    let at = m.expert_offset(id) as usize;
                    &files[m.file].raw_bytes()[at..at + m.bytes_per_expert]
                }
            };
            HostMatrix { dtype: m.dtype, bytes, n_out: m.n_out, k: m.k }
        }
        Ok(ids
            .iter()
            .map(|&id| HostExpert {
                id,
                gate: le.gate.as_ref().map(|g| take(files, g, copy.and_then(|c| c.gate.as_ref()), id)),
                up: take(files, &le.up, copy.map(|c| &c.up), id),
                down: take(files, &le.down, copy.map(|c| &c.down), id),
            })
            .collect())
    }
}

impl ExpertStore for MappedExperts {
    fn with_host_experts(
        &self,
        layer: usize,
        ids: &[u32],
        compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
    ) -> Result<(), OpError> {
        compute(&self.lend(layer, ids)?)
    }

    fn guess_experts(&self, layer: usize, x: &[f32], k: usize) -> Vec<u32> {
        let guesses = self.guesses.get_or_init(|| {
            let has_experts: Vec<bool> = self.layers.iter().map(Option::is_some).collect();
            Guesses::from_model(&self.model, &has_experts)
        });
        // The split's dispatcher guesses while the pool waits with it.
        guesses.guess(layer, x, k, usize::MAX, true)
    }

    fn read_ahead(&self, layer: usize, ids: &[u32], threads: usize, stop: &(dyn Fn() -> bool + Sync)) -> u64 {
        let Ok(lent) = self.lend(layer, ids) else { return 0 };
        // Each pool thread its own rows, where the step's pollers can be reached (the job's
        // threads then compute what they read); else the lines over `threads` threads.
        let rows: Vec<compute::quant::ExpertRows<'_>> = lent
            .iter()
            .map(|ex| {
                fn w<'a>(m: &HostMatrix<'a>) -> compute::quant::WeightRows<'a> {
                    compute::quant::WeightRows { dtype: m.dtype, bytes: m.bytes, n_out: m.n_out }
                }
                compute::quant::ExpertRows { gate: ex.gate.as_ref().map(w), up: w(&ex.up), down: w(&ex.down) }
            })
            .collect();
        if let Some(first) = lent.first() {
            if let Some(bytes) = compute::cpu::cache_fill::read_owned_into_cache(&rows, first.up.n_out, stop) {
                return bytes;
            }
        }
        // In the order the CPU's job reads them: every expert's gate and up products, then the
        // downs (`compute::cpu::experts_one_token`).
        let mut pieces: Vec<&[u8]> = Vec::with_capacity(3 * lent.len());
        for ex in &lent {
            pieces.extend(ex.gate.as_ref().map(|g| g.bytes));
            pieces.push(ex.up.bytes);
        }
        pieces.extend(lent.iter().map(|ex| ex.down.bytes));
        compute::cpu::cache_fill::read_into_cache(&pieces, threads, stop)
    }
}
