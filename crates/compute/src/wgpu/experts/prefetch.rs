//! The split's prefetch on the copy queue: the next layer's likely GPU misses copied from the
//! host tier into staging slots of the pool while the GPU runs the chain between two layers.
//!
//! Why: per decode layer the split (split.rs) spends its experts' phase reading the misses from
//! host RAM (the CPU's share) and over the link (the GPU's), at about the RAM's rate for both
//! together, and then ~80-100 us of the chain (the add of the CPU's sum, the next attention, the
//! routing, the hand-over: small dependent kernels) during which the RAM and the link idle.
//! Copies on wgpu's one queue could not use that idle time: they run in line with the chain
//! (fifteenth session), and a kernel reading ahead ran during the experts' phase instead
//! (`DISKFORMER_SPLIT_TOUCH`, 2.4% slower). The copy engines, on a queue of their own
//! (`wgpu/transfer.rs`), run beside the chain.
//!
//! How, per decode layer L (one token):
//! 1. L's routing kernel (its `//G` variant, `fuse_route_guess`) also takes L+1's router on L's
//!    input and, after the hand-over's flag, its top k (the guess `touch_next_layer` used: ~95%
//!    of such guesses are selected), and writes the first [`Prefetch::per_call`] guessed experts
//!    the slot table puts in host memory into the down mailbox with L's sequence number. Where
//!    that kernel cannot take it (or `DISKFORMER_SPLIT_PREFETCH_FUSE=0`) the host records the
//!    router and `moe_split_prefetch_pick.wgsl` right after L's hand-over
//!    (`DISKFORMER_SPLIT_PREFETCH_GUESS=share`: after its GPU share).
//! 2. The dispatcher, once L's CPU job is done and before L's sum's flag: reads them, picks each
//!    a staging slot (the pool's last slots of L+1's region, reserved, two sets used by
//!    alternate calls), announces them for call L+1 in the up mailbox (id, the staging slot's
//!    words, the tag's word and value) and, after the flag, submits the copies and then the tags
//!    on the copy queue.
//! 3. L+1's partition (`moe_split_partition.wgsl`, prefetch variant) reads the announcement
//!    after its wait for L's flag: announced misses are the GPU's (never the CPU's: the host's
//!    rule excludes them too, [`super::split::cpu_misses`] on the rest).
//!    The partition also writes the layer's table row for the per-pair kernels with each
//!    announced miss whose tag landed pointing at its staging slot; one not landed is read from
//!    host memory as before. With `DISKFORMER_SPLIT_PREFETCH_PASSES=2`,
//!    `moe_split_prefetch_patch.wgsl` writes that row instead, after a first pass of the per-pair
//!    kernels over the other pairs, and the announced ones go in a second pass (their copies then
//!    have longer to land).
//!    The copy thus only ever replaces where the GPU reads the same bytes from.
//!
//! Measured on the H200 (twenty-seventh session, docs/PAGING.md): the copies land (two passes:
//! 1496 of 1498 by the second pass, 75% done by the next hand-over), but steps with the
//! prefetch were slower than steps without in one process (skew 0.3 ~7%, uniform ~3%): the
//! guess, the patch and the second pass are dispatches on the GPU's share, whose end moved past
//! the CPU's more often (the GPU first in 63.5% of layers against ~78%), and what one expert a
//! layer saves does not pay for them. The twenty-eighth session took those dispatches out (the
//! guess in the routing kernel, the patch in the partition) and it stayed as slow (skew 9%,
//! uniform 6%); its parts (`DISKFORMER_SPLIT_PREFETCH_TRIAL`, [`Trial`]) put the cost in giving
//! the GPU the announced misses at all (~7% with no copy made), which the landed copies barely
//! reduce. Hence off by default.
//!
//! A set of staging slots is written again two calls later, after the dispatcher saw the next
//! call's hand-over, which the GPU writes after the earlier call's kernels ran (queue order).
//! Tags are values of one counter, never reused, so a tag left by an earlier copy never matches.
//!
//! `DISKFORMER_SPLIT_PREFETCH=N` experts a layer (default 0: off, measured slower on the H200; at most [`PREFETCH_MAX`]);
//! A/B name `prefetch` (odd decode steps announce nothing).

use super::split::DOWN_GUESS;
use super::{lock, SlotMats};
use crate::wgpu::mailbox::Mailbox;
use crate::wgpu::transfer::{raw_buffer, CopyRegion, TransferQueue};
use ash::vk;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The most experts a layer's announcement holds (the partition kernel's `PF_MAX`).
pub(super) const PREFETCH_MAX: usize = 4;

/// Words of one call's announcement area in the up mailbox, from [`UP_PREFETCH`]: the sequence
/// number, the layer's first table entry, the count, then six words per expert.
const AREA_WORDS: usize = 32;
/// First word of slot 0's announcement area in the up mailbox (words 16..80 are free: the
/// flags take the first few, the data starts at `MAILBOX_DATA`).
pub(super) const UP_PREFETCH: usize = 16;

/// Words of the tag buffer before the tags: the partition's counts of announced misses found
/// landed ([`STAT_LANDED`]) and not ([`STAT_LATE`]).
pub(super) const STAT_LANDED: usize = 0;
pub(super) const STAT_LATE: usize = 1;
const TAGS_AT: usize = 4;

/// The up mailbox's word where call `seq`'s announcement starts (by its slot, as its data).
pub(super) fn area_at(seq: u32, slots: usize) -> usize {
    UP_PREFETCH + (seq as usize % slots) * AREA_WORDS
}

/// Experts a layer from `DISKFORMER_SPLIT_PREFETCH` (default 0, off: measured slower on the H200, docs/PAGING.md).
pub(super) fn per_call_from_env() -> usize {
    std::env::var("DISKFORMER_SPLIT_PREFETCH").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0).min(PREFETCH_MAX)
}

/// Whether the guess goes into the layer's routing kernel (default) or into dispatches of its own
/// (`DISKFORMER_SPLIT_PREFETCH_FUSE=0`).
pub(super) fn fuse_from_env() -> bool {
    static FUSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FUSE.get_or_init(|| std::env::var("DISKFORMER_SPLIT_PREFETCH_FUSE").map_or(true, |v| v.trim() != "0"))
}

/// Parts of the prefetch left out, to measure what each costs (`DISKFORMER_SPLIT_PREFETCH_TRIAL`:
/// `guess`, the guess alone, nothing announced; `nocopy`, announced but never copied, so every
/// announced miss is read over the link by the GPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Trial {
    Whole,
    GuessOnly,
    NoCopies,
}

pub(super) fn trial_from_env() -> Trial {
    static TRIAL: std::sync::OnceLock<Trial> = std::sync::OnceLock::new();
    *TRIAL.get_or_init(|| match std::env::var("DISKFORMER_SPLIT_PREFETCH_TRIAL").as_deref().map(str::trim) {
        Ok("guess") => Trial::GuessOnly,
        Ok("nocopy") => Trial::NoCopies,
        _ => Trial::Whole,
    })
}

/// One announced expert: its id, the staging slot's matrices, its tag's word and value.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    pub(super) expert: u32,
    pub(super) staging: SlotMats,
    pub(super) tag_word: u32,
    pub(super) tag: u32,
}

/// The words of an announcement for call `seq` of the layer whose table row starts at
/// `slots_at`, as `moe_split_partition.wgsl`'s prefetch variant reads them.
pub(super) fn announcement(seq: u32, slots_at: u32, entries: &[Entry]) -> Vec<u32> {
    let mut words = vec![seq, slots_at, entries.len() as u32];
    for e in entries {
        let s = &e.staging;
        words.extend([e.expert, s.gate.map_or(0, |g| g.word0 as u32), s.up.word0 as u32, s.down.word0 as u32]);
        words.extend([e.tag_word, e.tag]);
    }
    debug_assert!(words.len() <= AREA_WORDS);
    words
}

/// Where the guess is recorded (`true`: before the partition; `DISKFORMER_SPLIT_PREFETCH_GUESS=share`:
/// after the GPU's share) and whether the announced misses take a second pass of the per-pair
/// kernels (`DISKFORMER_SPLIT_PREFETCH_PASSES=2`) or the one pass reads them where the patch
/// kernel found them right after the partition (the default).
pub(super) fn shape_from_env() -> (bool, bool) {
    static SHAPE: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();
    *SHAPE.get_or_init(|| {
        let early = std::env::var("DISKFORMER_SPLIT_PREFETCH_GUESS").map_or(true, |v| v.trim() != "share");
        let two = std::env::var("DISKFORMER_SPLIT_PREFETCH_PASSES").is_ok_and(|v| v.trim() == "2");
        (early, two)
    })
}

/// Where one layer's prefetches come from and go: its host copy, its region's pool buffer and
/// that region's staging slots.
struct LayerCopy {
    host: vk::Buffer,
    pool: vk::Buffer,
    /// Each expert's matrices in the host copy.
    host_mats: Vec<SlotMats>,
    /// Per set (a call's sequence number's parity), per place: the staging slot's matrices and
    /// its tag's word in the tag buffer.
    staging: [Vec<(SlotMats, u32)>; 2],
    /// The layer's first entry of the slot table.
    slots_at: u32,
}

/// An announcement the dispatcher made for a later call: the GPU's partition of that call reads
/// the same experts from the up mailbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Announced {
    /// The up mailbox it was written to (by address: a grown mailbox restarts the numbers).
    pub(super) mailbox: usize,
    pub(super) seq: u32,
    pub(super) layer: usize,
    pub(super) experts: Vec<u32>,
}

/// The copies an announcement asks for, submitted after the announcing call's flag.
pub(super) struct Copies {
    host: vk::Buffer,
    pool: vk::Buffer,
    regions: Vec<CopyRegion>,
    tags: Vec<(u64, u32)>,
}

/// The prefetch's state (see the module docs), shared by the host (which registers layers)
/// and the dispatcher (which announces and submits).
pub(super) struct Prefetch {
    transfer: Arc<TransferQueue>,
    /// The tags (and the partition's counts), read and written atomically by kernels.
    pub(super) tags: wgpu::Buffer,
    tags_raw: vk::Buffer,
    /// Experts a layer at most.
    pub(super) per_call: usize,
    /// The pool's reserved slots per region: `2 * per_call` slots from each region's `Range::end`.
    reserved: Vec<std::ops::Range<usize>>,
    layers: Mutex<Vec<Option<Arc<LayerCopy>>>>,
    /// The dispatcher's last announcement, for the call it was made for.
    pub(super) announced: Mutex<Option<Announced>>,
    next_tag: AtomicU32,
    /// Experts announced, and announcements whose copies the queue did not take (ring busy).
    pub(super) issued: AtomicU64,
    pub(super) refused: AtomicU64,
    /// The last submission's place in the copy queue's ring, and how many submissions had run
    /// by the next call's hand-over (when the dispatcher takes it: the partition's time).
    last: Mutex<Option<usize>>,
    pub(super) done_by_hand_over: AtomicU64,
}

impl std::fmt::Debug for Prefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetch").field("per_call", &self.per_call).finish()
    }
}

impl Prefetch {
    /// The prefetch for a pool of `regions`, whose last `2 * per_call` slots each it takes
    /// (the caller shrinks the regions by as much); `None` when a region is too small for that
    /// to leave most of it to the cache (fewer than 16 slots per reserved one), or the tag
    /// buffer is not a Vulkan buffer.
    pub(super) fn new(
        device: &wgpu::Device,
        transfer: Arc<TransferQueue>,
        regions: &[std::ops::Range<usize>],
        per_call: usize,
    ) -> Option<Prefetch> {
        let per_region = 2 * per_call;
        if per_call == 0 || regions.iter().any(|r| r.len() < 16 * per_region) {
            return None;
        }
        let tags = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("expert prefetch tags"),
            size: (4 * (TAGS_AT + regions.len() * per_region) as u64).next_multiple_of(256),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let tags_raw = raw_buffer(&tags)?;
        let reserved = regions.iter().map(|r| r.end - per_region..r.end).collect();
        Some(Prefetch {
            transfer,
            tags,
            tags_raw,
            per_call,
            reserved,
            layers: Mutex::new(Vec::new()),
            announced: Mutex::new(None),
            next_tag: AtomicU32::new(1),
            issued: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            last: Mutex::new(None),
            done_by_hand_over: AtomicU64::new(0),
        })
    }

    /// The reserved slots of each region (see [`Self::new`]).
    pub(super) fn reserved(&self) -> &[std::ops::Range<usize>] {
        &self.reserved
    }

    /// Whether `layer` can be prefetched for (registered by [`Self::register`]).
    pub(super) fn has_layer(&self, layer: usize) -> bool {
        lock(&self.layers).get(layer).is_some_and(|l| l.is_some())
    }

    /// Registers `layer`: its host copy (`host`, with each expert's matrices `host_mats`), its
    /// region `region` whose pool buffer is `pool`, the staging slots' matrices (`place(slot)`
    /// for a reserved slot), its first table entry. Does nothing if a buffer is not Vulkan's.
    #[allow(clippy::too_many_arguments)] // the layer's place, as the tier knows it
    pub(super) fn register(
        &self,
        layer: usize,
        host: &wgpu::Buffer,
        host_mats: Vec<SlotMats>,
        region: usize,
        pool: &wgpu::Buffer,
        place: impl Fn(usize) -> SlotMats,
        slots_at: u32,
    ) {
        let (Some(host), Some(pool)) = (raw_buffer(host), raw_buffer(pool)) else { return };
        let Some(reserved) = self.reserved.get(region) else { return };
        let per_region = 2 * self.per_call;
        let set = |parity: usize| -> Vec<(SlotMats, u32)> {
            (0..self.per_call)
                .map(|j| {
                    let slot = reserved.start + parity * self.per_call + j;
                    (place(slot), (TAGS_AT + region * per_region + parity * self.per_call + j) as u32)
                })
                .collect()
        };
        let copy = LayerCopy { host, pool, host_mats, staging: [set(0), set(1)], slots_at };
        let mut layers = lock(&self.layers);
        if layers.len() <= layer {
            layers.resize(layer + 1, None);
        }
        layers[layer] = Some(Arc::new(copy));
    }

    /// The experts announced for call `seq` of `layer` through `up` (empty when none were).
    pub(super) fn announced_for(&self, up: &Mailbox, seq: u32, layer: usize) -> Vec<u32> {
        if let Some(i) = lock(&self.last).take() {
            if self.transfer.done(i) {
                self.done_by_hand_over.fetch_add(1, Ordering::Relaxed);
            }
        }
        let mailbox = up as *const Mailbox as usize;
        match &*lock(&self.announced) {
            Some(a) if a.mailbox == mailbox && a.seq == seq && a.layer == layer => a.experts.clone(),
            _ => Vec::new(),
        }
    }

    /// For the call after `seq` (which will be layer `layer + 1`): reads the guess the pick
    /// kernel left in `down` for `seq`, announces up to [`Self::per_call`] of its experts in `up`
    /// (before the caller writes `seq`'s flag) and returns the copies to submit after it. `None`
    /// (nothing announced) when the guess is not there, the next layer is not registered, or on
    /// odd decode steps under `DISKFORMER_AB=prefetch`.
    pub(super) fn announce_next(
        &self,
        down: &Mailbox,
        up: &Mailbox,
        slots: usize,
        seq: u32,
        layer: usize,
    ) -> Option<Copies> {
        if crate::ab::is_b("prefetch") || trial_from_env() == Trial::GuessOnly {
            return None;
        }
        let guess_at = DOWN_GUESS + (seq as usize % slots) * super::split::GUESS_WORDS;
        if down.load(guess_at) != seq {
            return None;
        }
        let n = (down.load(guess_at + 1) as usize).min(self.per_call);
        if n == 0 {
            return None;
        }
        let mut ids = vec![0u32; n];
        down.read(guess_at + 2, &mut ids);
        let next = layer + 1;
        let copy = lock(&self.layers).get(next).cloned().flatten()?;
        if ids.iter().any(|&e| e as usize >= copy.host_mats.len()) {
            return None;
        }
        let next_seq = seq.wrapping_add(1).max(1);
        let set = &copy.staging[next_seq as usize % 2];
        let mut entries = Vec::with_capacity(n);
        let mut regions = Vec::with_capacity(3 * n);
        for (j, &e) in ids.iter().enumerate() {
            let (to, tag_word) = set[j];
            let from = copy.host_mats[e as usize];
            let tag = self.next_tag.fetch_add(1, Ordering::Relaxed).max(1);
            entries.push(Entry { expert: e, staging: to, tag_word, tag });
            regions.extend(super::copy_regions(&from, &to));
        }
        let words = announcement(next_seq, copy.slots_at, &entries);
        let tags = entries.iter().map(|en| (4 * en.tag_word as u64, en.tag)).collect();
        up.write(area_at(next_seq, slots), &words);
        *lock(&self.announced) =
            Some(Announced { mailbox: up as *const Mailbox as usize, seq: next_seq, layer: next, experts: ids });
        self.issued.fetch_add(n as u64, Ordering::Relaxed);
        Some(Copies { host: copy.host, pool: copy.pool, regions, tags })
    }

    /// Submits an announcement's copies and tags on the copy queue; counts a refusal.
    pub(super) fn submit(&self, c: &Copies) {
        if trial_from_env() == Trial::NoCopies {
            return;
        }
        match self.transfer.copy_then_tag(c.host, c.pool, &c.regions, self.tags_raw, &c.tags) {
            Some(i) => *lock(&self.last) = Some(i),
            None => {
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Waits until every copy submitted has run (before the pool or a host copy is freed).
    pub(super) fn wait_idle(&self) {
        self.transfer.wait_idle();
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.wait_idle();
    }
}
