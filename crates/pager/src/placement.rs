//! GPU placement: whether a model's dense weights, its KV cache, the back end's scratch and an
//! expert pool fit in a GPU memory budget, and how many expert slots the pool gets.
//!
//! The pool is counted in slots (one expert's gate, up and down matrices of one layer, as stored).
//! Below [`MIN_SLOTS_PER_TOP_K`] × top-k slots a cache thrashes within a single token (each layer
//! needs top-k slots at once, and the next layers' experts evict them before they are reused), so
//! it is slower than no cache: such a budget is refused with the numbers, as
//! [`PagerError::GpuBudgetTooSmall`]. No GPU is needed to plan; the GPU tier that uses the plan
//! is not written yet (docs/PAGING.md).

use crate::{index_layers, PagerError};
use gguf::GgufModel;

/// The smallest expert pool, in multiples of the model's top-k (experts used per token).
pub const MIN_SLOTS_PER_TOP_K: usize = 3;

/// Where a model's bytes go within a GPU budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuPlacement {
    /// The budget given.
    pub budget_bytes: u64,
    /// Every tensor that is not a routed expert (attention, norms, embeddings, routers, shared
    /// experts, dense FFNs).
    pub dense_bytes: u64,
    /// The KV cache (given by the caller, who knows the context length and cache type).
    pub kv_bytes: u64,
    /// The back end's scratch (given by the caller).
    pub scratch_bytes: u64,
    /// Bytes of one slot: the largest expert of any layer.
    pub slot_bytes: u64,
    /// Slots the pool gets (at most one per expert of the model).
    pub n_slots: usize,
    /// The floor: [`MIN_SLOTS_PER_TOP_K`] × top-k.
    pub min_slots: usize,
    /// Experts used per token (`ARCH.expert_used_count`).
    pub top_k: usize,
    /// Experts in the model, all layers.
    pub n_experts_total: usize,
}

impl GpuPlacement {
    /// Plans `model` into `gpu_budget_bytes`, with `kv_bytes` of KV cache and `scratch_bytes` of
    /// scratch beside the dense weights; the rest, in whole slots, is the expert pool.
    ///
    /// # Errors
    /// [`PagerError::NoExperts`], [`PagerError::BadExpertTensor`] as [`crate::Pager::open`];
    /// [`PagerError::MissingTopK`] without `ARCH.expert_used_count`;
    /// [`PagerError::GpuBudgetTooSmall`] when the fixed part and the floor of the pool do not fit.
    pub fn plan(
        model: &GgufModel,
        gpu_budget_bytes: u64,
        kv_bytes: u64,
        scratch_bytes: u64,
    ) -> Result<GpuPlacement, PagerError> {
        let model_name = model.path().display().to_string();
        let layers = index_layers(model)?;
        let present = || layers.iter().flatten();
        let expert_bytes_total: u64 = present().map(|l| (l.expert_bytes() * l.n_expert) as u64).sum();
        let slot_bytes = present().map(|l| l.expert_bytes() as u64).max().unwrap_or(0);
        let n_experts_total: usize = present().map(|l| l.n_expert).sum();
        let key = format!("{}.expert_used_count", model.architecture().unwrap_or("general"));
        let top_k = model
            .metadata()
            .u32(&key)
            .map_err(|_| PagerError::MissingTopK { model: model_name.clone(), key: key.clone() })?
            as usize;
        let dense_bytes = model.tensor_bytes_total() - expert_bytes_total;
        let min_slots = (MIN_SLOTS_PER_TOP_K * top_k).min(n_experts_total);
        let fixed_bytes = dense_bytes + kv_bytes + scratch_bytes;
        let min_pool_bytes = min_slots as u64 * slot_bytes;
        let room = gpu_budget_bytes.saturating_sub(fixed_bytes);
        let n_slots = ((room / slot_bytes.max(1)) as usize).min(n_experts_total);
        if fixed_bytes > gpu_budget_bytes || n_slots < min_slots {
            return Err(PagerError::GpuBudgetTooSmall {
                model: model_name,
                budget_bytes: gpu_budget_bytes,
                fixed_bytes,
                min_pool_bytes,
                needed_bytes: fixed_bytes + min_pool_bytes,
            });
        }
        Ok(GpuPlacement {
            budget_bytes: gpu_budget_bytes,
            dense_bytes,
            kv_bytes,
            scratch_bytes,
            slot_bytes,
            n_slots,
            min_slots,
            top_k,
            n_experts_total,
        })
    }

    /// Bytes of the expert pool.
    pub fn pool_bytes(&self) -> u64 {
        self.n_slots as u64 * self.slot_bytes
    }

    /// Bytes placed in all: never above the budget.
    pub fn total_bytes(&self) -> u64 {
        self.dense_bytes + self.kv_bytes + self.scratch_bytes + self.pool_bytes()
    }
}
