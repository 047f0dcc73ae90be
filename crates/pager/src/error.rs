//! Errors of opening and running a pager.

use std::path::PathBuf;

/// Why a pager could not be built or could not read an expert.
#[derive(Debug, thiserror::Error)]
pub enum PagerError {
    /// The RAM budget cannot hold even one expert (plus the pager's index).
    #[error(
        "RAM budget {budget} is too small for {model}: one expert slot takes {slot} and the cache index {index}, \
         so the expert cache needs at least {needed}",
        budget = gib(*budget_bytes), slot = gib(*slot_bytes), index = gib(*index_bytes), needed = gib(*needed_bytes)
    )]
    BudgetTooSmall {
        /// The model file.
        model: String,
        /// The budget given.
        budget_bytes: u64,
        /// Bytes of one slot (gate, up and down of the largest expert).
        slot_bytes: u64,
        /// Bytes of the cache's bookkeeping.
        index_bytes: u64,
        /// The smallest budget that works (one slot plus the bookkeeping).
        needed_bytes: u64,
    },
    /// A GPU budget that cannot hold the dense weights, KV cache and scratch plus the smallest
    /// useful expert pool ([`crate::placement::MIN_SLOTS_PER_TOP_K`] × top-k slots).
    #[error(
        "GPU budget {budget} is too small for {model}: dense weights and KV cache need {fixed}, and the expert \
         cache at least {pool} more",
        budget = gb(*budget_bytes), fixed = gb(*fixed_bytes), pool = gb(*min_pool_bytes)
    )]
    GpuBudgetTooSmall {
        /// The model file.
        model: String,
        /// The budget given.
        budget_bytes: u64,
        /// Dense weights, KV cache and scratch.
        fixed_bytes: u64,
        /// The smallest expert pool.
        min_pool_bytes: u64,
        /// The smallest budget that works (`fixed_bytes + min_pool_bytes`).
        needed_bytes: u64,
    },
    /// The model's metadata does not say how many experts a token uses.
    #[error("{model} has no {key}: the number of experts per token is needed to size the expert cache")]
    MissingTopK {
        /// The model file.
        model: String,
        /// The metadata key looked up.
        key: String,
    },
    /// The model has no stacked expert tensors (`blk.N.ffn_up_exps.weight`).
    #[error(
        "{model} has no expert tensors (blk.N.ffn_up_exps.weight): it is not a mixture of experts, nothing to page"
    )]
    NoExperts {
        /// The model file.
        model: String,
    },
    /// An expert tensor whose shape or size does not split into experts.
    #[error("expert tensor {name}: {why}")]
    BadExpertTensor {
        /// Tensor name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// A model file could not be opened for reading.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// Bytes in the binary units the flags read (`8G` is 8 GiB), exact below one MiB.
pub(crate) fn gib(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{b} B"),
    }
}

/// Bytes in decimal units, as GPU memory is usually quoted (`2.50 GB`); MB below 0.01 GB and
/// bytes below 0.01 MB, so that small models do not read as zero.
pub(crate) fn gb(bytes: u64) -> String {
    match bytes {
        b if b >= 10_000_000 => format!("{:.2} GB", b as f64 / 1e9),
        b if b >= 10_000 => format!("{:.2} MB", b as f64 / 1e6),
        b => format!("{b} B"),
    }
}
