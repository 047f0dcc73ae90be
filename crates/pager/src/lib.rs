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
#![deny(missing_docs)]

mod error;

pub use error::PagerError;

use compute::{ExpertStore, HostExpert, HostMatrix, OpError};
use gguf::{GgmlType, GgufModel};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

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
}

impl PagerOptions {
    /// A budget and policy with eight reads in flight.
    pub fn new(ram_budget_bytes: u64, policy: CachePolicy) -> PagerOptions {
        PagerOptions { ram_budget_bytes, policy, read_threads: 8 }
    }
}

/// Counters of one layer since the pager opened (or since [`Pager::reset_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Experts the router selected (distinct per call).
    pub selections: u64,
    /// Selections found in the cache.
    pub hits: u64,
    /// Selections read from disk.
    pub misses: u64,
    /// Cached experts dropped to make room.
    pub evictions: u64,
    /// Bytes read from the model file(s).
    pub bytes_read: u64,
    /// Experts computed on the CPU from the host copy.
    pub cpu_computed: u64,
}

impl LayerStats {
    fn add(&mut self, o: &LayerStats) {
        self.selections += o.selections;
        self.hits += o.hits;
        self.misses += o.misses;
        self.evictions += o.evictions;
        self.bytes_read += o.bytes_read;
        self.cpu_computed += o.cpu_computed;
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
    fn expert_bytes(&self) -> usize {
        self.matrices().map(|m| m.bytes_per_expert).sum()
    }
}

const NO_SLOT: u32 = u32::MAX;

/// The mutable part: slab, who owns each slot, policy state, counters.
struct Cache {
    slab: Vec<u8>,
    /// Per slot: (layer, expert) held, or `None` when free.
    owner: Vec<Option<(u32, u32)>>,
    /// Per slot: tick of its last use.
    last_use: Vec<u64>,
    /// Per slot: lent to the group being computed.
    pinned: Vec<bool>,
    /// Free slots (a stack).
    free: Vec<u32>,
    /// Per layer, per expert: the slot holding it or `NO_SLOT`.
    slot_of: Vec<Vec<u32>>,
    /// Per layer, per expert: LFU score.
    score: Vec<Vec<f32>>,
    tick: u64,
    stats: Vec<LayerStats>,
}

/// A bounded host cache of experts read from the model's GGUF file(s); see the crate docs.
pub struct Pager {
    model_name: String,
    files: Vec<(PathBuf, File)>,
    layers: Vec<Option<LayerExperts>>,
    slot_bytes: usize,
    n_slots: usize,
    budget_bytes: u64,
    accounted_bytes: u64,
    policy: CachePolicy,
    read_threads: usize,
    cache: Mutex<Cache>,
}

impl std::fmt::Debug for Pager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Pager({}, {} slots of {} B, budget {} B, {:?})",
            self.model_name, self.n_slots, self.slot_bytes, self.budget_bytes, self.policy
        )
    }
}

/// Bytes the per-call scratch (group lists, read lists) may take per expert of a layer.
const SCRATCH_BYTES_PER_EXPERT: usize = 160;

impl Pager {
    /// Indexes the expert tensors of `model` and sizes the cache to `opts.ram_budget_bytes`.
    ///
    /// # Errors
    /// [`PagerError::NoExperts`] when the model has no stacked experts,
    /// [`PagerError::BadExpertTensor`] for experts whose shapes disagree,
    /// [`PagerError::BudgetTooSmall`] (with the bytes needed) when not even one slot fits,
    /// [`PagerError::Io`] when a file cannot be opened.
    pub fn open(model: &Arc<GgufModel>, opts: &PagerOptions) -> Result<Pager, PagerError> {
        let model_name = model.path().display().to_string();
        let layers = index_layers(model)?;
        let Sizes { slot_bytes, index_bytes, per_slot_bytes, all_experts } = sizes(&layers);
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
        let files = model
            .files()
            .iter()
            .map(|f| {
                let p = f.path().to_path_buf();
                File::open(&p).map(|h| (p.clone(), h)).map_err(|source| PagerError::Io { path: p, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let accounted_bytes = index_bytes + n_slots as u64 * (slot_bytes as u64 + per_slot_bytes);
        let cache = Cache {
            owner: vec![None; n_slots],
            last_use: vec![0; n_slots],
            pinned: vec![false; n_slots],
            free: (0..n_slots as u32).rev().collect(),
            slot_of: layers.iter().map(|l| vec![NO_SLOT; l.as_ref().map_or(0, |l| l.n_expert)]).collect(),
            score: layers.iter().map(|l| vec![0.0; l.as_ref().map_or(0, |l| l.n_expert)]).collect(),
            tick: 0,
            stats: vec![LayerStats::default(); layers.len()],
            // Last, so that no temporary above is alive beside it.
            slab: vec![0u8; n_slots * slot_bytes],
        };
        Ok(Pager {
            model_name,
            files,
            layers,
            slot_bytes,
            n_slots,
            budget_bytes: opts.ram_budget_bytes,
            accounted_bytes,
            policy: opts.policy,
            read_threads: opts.read_threads.max(1),
            cache: Mutex::new(cache),
        })
    }

    /// The smallest RAM budget whose cache holds `n_slots` experts of `model`.
    ///
    /// # Errors
    /// As [`Pager::open`] for a model without (valid) experts.
    pub fn budget_for_slots(model: &GgufModel, n_slots: usize) -> Result<u64, PagerError> {
        let s = sizes(&index_layers(model)?);
        Ok(s.index_bytes + n_slots as u64 * (s.slot_bytes as u64 + s.per_slot_bytes))
    }

    /// Bytes of one slot (gate, up and down of the largest expert of any layer).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Experts the cache holds at once.
    pub fn n_slots(&self) -> usize {
        self.n_slots
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
        self.layers.iter().flatten().map(|l| (l.expert_bytes() * l.n_expert) as u64).sum()
    }

    /// The eviction policy.
    pub fn policy(&self) -> CachePolicy {
        self.policy
    }

    /// Per-layer counters, indexed by layer (layers without experts stay zero).
    pub fn stats(&self) -> Vec<LayerStats> {
        self.lock().stats.clone()
    }

    /// The counters of every layer added up.
    pub fn total_stats(&self) -> LayerStats {
        let mut t = LayerStats::default();
        self.lock().stats.iter().for_each(|s| t.add(s));
        t
    }

    /// Sets every counter to zero (the cache keeps its contents).
    pub fn reset_stats(&self) {
        self.lock().stats.iter_mut().for_each(|s| *s = LayerStats::default());
    }

    /// A table of the per-layer counters and their total, for `--stats`.
    pub fn format_stats(&self) -> String {
        let stats = self.stats();
        let mut out = format!(
            "expert cache: {} slots of {:.2} MiB ({:?}), {} of budget {} used, experts total {}\n",
            self.n_slots,
            self.slot_bytes as f64 / (1u64 << 20) as f64,
            self.policy,
            error::gib(self.accounted_bytes),
            error::gib(self.budget_bytes),
            error::gib(self.expert_bytes_total()),
        );
        out.push_str("layer  selected      hits    misses  evicted  read MiB  cpu experts  hit rate\n");
        let row = |name: String, s: &LayerStats| {
            format!(
                "{name:>5} {:>9} {:>9} {:>9} {:>8} {:>9.1} {:>12} {:>8.1}%\n",
                s.selections,
                s.hits,
                s.misses,
                s.evictions,
                s.bytes_read as f64 / (1u64 << 20) as f64,
                s.cpu_computed,
                100.0 * s.hits as f64 / s.selections.max(1) as f64
            )
        };
        let mut total = LayerStats::default();
        for (il, s) in stats.iter().enumerate() {
            if self.layers[il].is_some() {
                out.push_str(&row(il.to_string(), s));
                total.add(s);
            }
        }
        out.push_str(&row("all".into(), &total));
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        // A panic while computing a group leaves the cache consistent (pins are only hints
        // for eviction), so a poisoned lock is still usable.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The slot a miss goes to: a free one, else the unpinned one the policy ranks lowest.
    fn victim(&self, c: &mut Cache) -> Option<usize> {
        if let Some(s) = c.free.pop() {
            return Some(s as usize);
        }
        let mut best: Option<(usize, f32, u64)> = None;
        for s in 0..self.n_slots {
            if c.pinned[s] {
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

    /// Reads the experts `misses` (expert id, slot) of `layer` into their slots, several at once.
    fn read(&self, slab: &mut [u8], le: &LayerExperts, misses: &[(u32, usize)]) -> Result<(), OpError> {
        let mut targets: Vec<(u32, &mut [u8])> = Vec::with_capacity(misses.len());
        for (s, chunk) in slab.chunks_mut(self.slot_bytes).enumerate() {
            if let Some(&(id, _)) = misses.iter().find(|m| m.1 == s) {
                targets.push((id, chunk));
            }
        }
        let read_one = |id: u32, dst: &mut [u8]| -> Result<(), OpError> {
            let mut at = 0;
            for m in le.matrices() {
                let n = m.bytes_per_expert;
                let (path, f) = &self.files[m.file];
                f.read_exact_at(&mut dst[at..at + n], m.offset + id as u64 * n as u64).map_err(|e| {
                    OpError::Weight {
                        name: m.name.clone(),
                        why: format!("reading expert {id} from {}: {e}", path.display()),
                    }
                })?;
                at += n;
            }
            Ok(())
        };
        let n_threads = self.read_threads.min(targets.len());
        if n_threads <= 1 {
            return targets.into_iter().try_for_each(|(id, dst)| read_one(id, dst));
        }
        let mut per_thread: Vec<Vec<(u32, &mut [u8])>> = (0..n_threads).map(|_| Vec::new()).collect();
        for (i, t) in targets.into_iter().enumerate() {
            per_thread[i % n_threads].push(t);
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = per_thread
                .into_iter()
                .map(|work| scope.spawn(|| work.into_iter().try_for_each(|(id, dst)| read_one(id, dst))))
                .collect();
            handles.into_iter().try_for_each(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(OpError::Weight { name: "experts".into(), why: "a read thread panicked".into() })
                })
            })
        })
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
    let slot_bytes = present().map(|l| l.expert_bytes()).max().unwrap_or(0);
    let max_experts = present().map(|l| l.n_expert).max().unwrap_or(0);
    let all_experts: usize = present().map(|l| l.n_expert).sum();
    // Bookkeeping, counted before allocating: per-layer tables, per-slot state, the index of
    // layers and the scratch one call needs.
    let index_bytes = (all_experts * (size_of::<u32>() + size_of::<f32>())
        + layers.len()
            * (size_of::<Option<LayerExperts>>() + 3 * 64 + 2 * size_of::<Vec<u32>>() + size_of::<LayerStats>())
        + max_experts * SCRATCH_BYTES_PER_EXPERT) as u64;
    let per_slot_bytes =
        (size_of::<Option<(u32, u32)>>() + size_of::<u64>() + size_of::<bool>() + size_of::<u32>()) as u64;
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

impl ExpertStore for Pager {
    fn with_host_experts(
        &self,
        layer: usize,
        ids: &[u32],
        compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
    ) -> Result<(), OpError> {
        let le = self.layers.get(layer).and_then(|l| l.as_ref()).ok_or_else(|| OpError::Weight {
            name: format!("blk.{layer}.ffn_up_exps.weight"),
            why: format!("{} has no experts in layer {layer}", self.model_name),
        })?;
        if let Some(&bad) = ids.iter().find(|&&e| e as usize >= le.n_expert) {
            return Err(OpError::ShapeMismatch {
                op: "pager",
                expected: format!("expert ids < {}", le.n_expert),
                got: vec![bad as usize],
            });
        }
        let mut guard = self.lock();
        let c = &mut *guard;
        c.tick += 1;
        let tick = c.tick;
        c.stats[layer].selections += ids.len() as u64;
        if self.policy == CachePolicy::Lfu {
            c.score[layer].iter_mut().for_each(|s| *s *= LFU_DECAY);
            ids.iter().for_each(|&e| c.score[layer][e as usize] += 1.0);
        }
        let mut i = 0;
        while i < ids.len() {
            let mut group: Vec<(u32, usize)> = Vec::with_capacity(ids.len() - i);
            let mut misses: Vec<(u32, usize)> = Vec::new();
            while i < ids.len() {
                let id = ids[i];
                let held = c.slot_of[layer][id as usize];
                let slot = if held != NO_SLOT {
                    c.stats[layer].hits += 1;
                    held as usize
                } else {
                    let Some(v) = self.victim(c) else { break };
                    if let Some((ol, oe)) = c.owner[v].take() {
                        c.slot_of[ol as usize][oe as usize] = NO_SLOT;
                        c.stats[layer].evictions += 1;
                    }
                    c.owner[v] = Some((layer as u32, id));
                    c.slot_of[layer][id as usize] = v as u32;
                    misses.push((id, v));
                    v
                };
                c.pinned[slot] = true;
                c.last_use[slot] = tick;
                group.push((id, slot));
                i += 1;
            }
            if let Err(e) = self.read(&mut c.slab, le, &misses) {
                for &(id, s) in &misses {
                    c.owner[s] = None;
                    c.slot_of[layer][id as usize] = NO_SLOT;
                    c.free.push(s as u32);
                }
                group.iter().for_each(|&(_, s)| c.pinned[s] = false);
                return Err(e);
            }
            let st = &mut c.stats[layer];
            st.misses += misses.len() as u64;
            st.bytes_read += (misses.len() * le.expert_bytes()) as u64;
            let lent: Vec<HostExpert<'_>> = group
                .iter()
                .map(|&(id, s)| {
                    let slot = &c.slab[s * self.slot_bytes..(s + 1) * self.slot_bytes];
                    let mut at = 0;
                    let mut take = |m: &Matrix| {
                        let bytes = &slot[at..at + m.bytes_per_expert];
                        at += m.bytes_per_expert;
                        HostMatrix { dtype: m.dtype, bytes, n_out: m.n_out, k: m.k }
                    };
                    let gate = le.gate.as_ref().map(&mut take);
                    let up = take(&le.up);
                    let down = take(&le.down);
                    HostExpert { id, gate, up, down }
                })
                .collect();
            let r = compute(&lent);
            drop(lent);
            group.iter().for_each(|&(_, s)| c.pinned[s] = false);
            r?;
            c.stats[layer].cpu_computed += group.len() as u64;
        }
        Ok(())
    }
}
