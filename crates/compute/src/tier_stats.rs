//! [`ExpertTierStats`]: the GPU expert tier's counters, outside the `wgpu` module so that callers
//! built without it (the planner's sessions, the server's `/metrics`) can name them.

/// Counters of one layer of the GPU expert tier since it was built (or reset), or their sum over
/// layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertTierStats {
    /// Experts the router selected (distinct per call).
    pub selections: u64,
    /// Selections found in a GPU slot.
    pub hits: u64,
    /// Selections not in a slot (uploaded or computed on the CPU).
    pub misses: u64,
    /// Misses uploaded into a slot.
    pub uploads: u64,
    /// Bytes copied from staging into the pool.
    pub bytes_uploaded: u64,
    /// Misses computed on the CPU.
    pub cpu_computed: u64,
    /// Slots whose expert an upload replaced.
    pub evictions: u64,
    /// Misses the GPU read from the host tier (the `Host` miss policy).
    pub host_reads: u64,
    /// Uploads that were refills between steps from the host tier (the rest of `uploads`
    /// served misses of the call itself: a prefill's, or every miss outside the host tier).
    pub refills: u64,
    /// Experts copied into the pool from the host tier at the layer's first call, before any
    /// miss asked for them (`ExpertTierOptions::prefill_per_layer`; not among `uploads`).
    pub prefilled: u64,
}

impl ExpertTierStats {
    /// Adds another layer's counters.
    pub fn add(&mut self, o: &ExpertTierStats) {
        self.selections += o.selections;
        self.hits += o.hits;
        self.misses += o.misses;
        self.uploads += o.uploads;
        self.bytes_uploaded += o.bytes_uploaded;
        self.cpu_computed += o.cpu_computed;
        self.evictions += o.evictions;
        self.host_reads += o.host_reads;
        self.refills += o.refills;
        self.prefilled += o.prefilled;
    }
}
