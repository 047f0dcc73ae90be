//! GPU placement: whether a model's dense weights, its KV cache, the back end's scratch and an
//! expert pool fit in a GPU memory budget, and how many expert slots the pool gets.
//!
//! The pool is counted in slots (one expert's gate, up and down matrices of one layer, as stored).
//! Below [`MIN_SLOTS_PER_TOP_K`] × top-k slots a cache thrashes within a single token (each layer
//! needs top-k slots at once, and the next layers' experts evict them before they are reused), so
//! it is slower than no cache: such a budget is refused with the numbers, as
//! [`PagerError::GpuBudgetTooSmall`]. No GPU is needed to plan.
//!
//! Sizes are counted as a back end holds them ([`DeviceSizes`]): [`GpuPlacement::plan`] counts
//! bytes as stored in the file, [`GpuPlacement::plan_on`] with [`WgpuSizes`] (feature `gpu`) as
//! compute's wgpu back end lays them out (blocks padded to 4-byte fields, small vectors in
//! power-of-two pooled buffers, one spare row per expert matrix in a slot), which is what its
//! expert tier (`WgpuBackend::with_expert_store`) allocates.

use crate::{index_layers, PagerError};
use gguf::{GgmlType, GgufModel};

/// The smallest expert pool, in multiples of the model's top-k (experts used per token).
pub const MIN_SLOTS_PER_TOP_K: usize = 3;

/// How many bytes a back end's copy of a tensor takes in device memory.
pub trait DeviceSizes {
    /// Bytes of a dense tensor of `dtype`, `shape` (GGUF order, ne0 first) and `stored_bytes`
    /// in the file.
    fn tensor_bytes(&self, dtype: GgmlType, shape: &[u64], stored_bytes: u64) -> u64;
    /// Bytes of a slot holding one expert whose matrices are `(dtype, n_out, k)` (gate if any,
    /// up, down), or `None` when the back end cannot hold one.
    fn slot_bytes(&self, matrices: &[(GgmlType, usize, usize)]) -> Option<u64>;
    /// Bytes the back end holds whatever the model (counted as scratch).
    fn fixed_bytes(&self) -> u64 {
        0
    }
}

/// Sizes as stored in the file (what [`GpuPlacement::plan`] counts).
#[derive(Clone, Copy, Debug, Default)]
pub struct StoredSizes;

impl DeviceSizes for StoredSizes {
    fn tensor_bytes(&self, _: GgmlType, _: &[u64], stored_bytes: u64) -> u64 {
        stored_bytes
    }
    fn slot_bytes(&self, matrices: &[(GgmlType, usize, usize)]) -> Option<u64> {
        matrices
            .iter()
            .map(|&(t, n_out, k)| {
                (k % t.block_elems() == 0).then(|| (n_out * k / t.block_elems() * t.block_bytes()) as u64)
            })
            .sum()
    }
}

/// Sizes as compute's wgpu back end holds them (see the module docs).
#[cfg(feature = "gpu")]
#[derive(Clone, Copy, Debug, Default)]
pub struct WgpuSizes;

#[cfg(feature = "gpu")]
impl DeviceSizes for WgpuSizes {
    fn tensor_bytes(&self, dtype: GgmlType, shape: &[u64], stored_bytes: u64) -> u64 {
        let k = shape.first().copied().unwrap_or(1) as usize;
        let n_rows = (shape.iter().product::<u64>() as usize) / k.max(1);
        let as_weight = compute::wgpu::weight_bytes(dtype, n_rows, k).unwrap_or(stored_bytes).max(16);
        // Vectors and small tensors (norms, biases) may be loaded as f32 activations, which
        // live in power-of-two pooled buffers: count the larger of the two.
        let values = shape.iter().product::<u64>();
        if shape.len() == 1 || values <= 1 << 18 {
            as_weight.max((4 * values).next_power_of_two().max(16))
        } else {
            as_weight
        }
    }
    fn slot_bytes(&self, matrices: &[(GgmlType, usize, usize)]) -> Option<u64> {
        compute::wgpu::expert_slot_bytes(matrices)
    }
    fn fixed_bytes(&self) -> u64 {
        compute::wgpu::backend_fixed_bytes()
    }
}

/// Scratch that compute's wgpu back end may hold for activations while running batches of
/// `n_batch` tokens: 8 rows of the widest hidden width (embedding, FFN, attention) and one of
/// the vocabulary per token, doubled because the pool rounds buffers up to powers of two.
/// The vocabulary-sized matrices (embeddings, output) count once, in the vocabulary row: as a
/// hidden width they made a 512-token batch of a Qwen3-30B-A3B 5.6 GB (8 rows of 151936
/// values per token), and refused a 4 GB budget a prefill that needs a fraction of it.
/// An estimate: the tier's test measures device memory against the budget it is part of.
pub fn activation_scratch_bytes(model: &GgufModel, n_batch: usize) -> u64 {
    let mut widest = 0u64;
    let mut n_vocab = 0u64;
    for t in model.tensors() {
        let shape = t.shape();
        if t.name() == "token_embd.weight" && shape.len() == 2 {
            n_vocab = shape[1];
        }
    }
    for t in model.tensors() {
        let shape = t.shape();
        let vocab_sized = n_vocab > 0 && shape.contains(&n_vocab);
        if shape.len() >= 2 && !t.name().contains("_exps.") && !vocab_sized {
            widest = widest.max(shape[0]).max(shape[1]);
        }
    }
    for t in model.tensors().filter(|t| t.name().contains("_exps.") && t.shape().len() == 3) {
        widest = widest.max(t.shape()[0]).max(t.shape()[1]);
    }
    2 * 4 * n_batch as u64 * (8 * widest + n_vocab)
}

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
    /// The back end's scratch: the caller's, plus the back end's fixed buffers
    /// ([`DeviceSizes::fixed_bytes`]).
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
    /// Layers with routed experts.
    pub n_expert_layers: usize,
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
        GpuPlacement::plan_on(model, gpu_budget_bytes, kv_bytes, scratch_bytes, &StoredSizes)
    }

    /// As [`GpuPlacement::plan`], with dense weights and slots counted as `sizes` says a back
    /// end holds them.
    ///
    /// # Errors
    /// As [`GpuPlacement::plan`]; [`PagerError::BadExpertTensor`] also when `sizes` cannot hold
    /// an expert's type.
    pub fn plan_on(
        model: &GgufModel,
        gpu_budget_bytes: u64,
        kv_bytes: u64,
        scratch_bytes: u64,
        sizes: &dyn DeviceSizes,
    ) -> Result<GpuPlacement, PagerError> {
        let model_name = model.path().display().to_string();
        let layers = index_layers(model)?;
        let present = || layers.iter().flatten();
        let mut slot_bytes = 0;
        for l in present() {
            let mats: Vec<(GgmlType, usize, usize)> = l.matrices().map(|m| (m.dtype, m.n_out, m.k)).collect();
            let b = sizes.slot_bytes(&mats).ok_or_else(|| PagerError::BadExpertTensor {
                name: l.up.name.clone(),
                why: format!(
                    "the back end cannot hold experts of types {:?}",
                    mats.iter().map(|m| m.0).collect::<Vec<_>>()
                ),
            })?;
            slot_bytes = slot_bytes.max(b);
        }
        let n_experts_total: usize = present().map(|l| l.n_expert).sum();
        let n_expert_layers = present().count();
        let key = format!("{}.expert_used_count", model.architecture().unwrap_or("general"));
        let top_k = model
            .metadata()
            .u32(&key)
            .map_err(|_| PagerError::MissingTopK { model: model_name.clone(), key: key.clone() })?
            as usize;
        // The input embedding stays in host memory where the back end keeps it there.
        let embedding_on_host = compute::input_embedding_on_host(model);
        let dense_bytes: u64 = model
            .tensors()
            .filter(|t| !is_routed_expert(t.name(), t.shape()))
            .filter(|t| !(embedding_on_host && t.name() == gguf::names::TOKEN_EMBD))
            .map(|t| sizes.tensor_bytes(t.dtype(), t.shape(), t.info.size_bytes))
            .sum();
        let min_slots = (MIN_SLOTS_PER_TOP_K * top_k).min(n_experts_total);
        let scratch_bytes = scratch_bytes + sizes.fixed_bytes();
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
            n_expert_layers,
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

/// Whether a tensor is a routed expert stack (`blk.N.ffn_{gate,up,down}_exps.weight`, 3-D), the
/// tensors the pager indexes.
fn is_routed_expert(name: &str, shape: &[u64]) -> bool {
    shape.len() == 3
        && name.starts_with("blk.")
        && ["ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"].iter().any(|s| name.ends_with(s))
}

/// RAM the host tier leaves free when no RAM budget bounds it: at least this, and at least an
/// eighth of the available RAM ([`default_miss`]).
pub const HOST_TIER_MIN_FREE_BYTES: u64 = 2 << 30;

/// CPU threads from which a host tier's misses are split between the GPU and the CPU by
/// default ([`split_misses_by_default`]).
///
/// Why 8: on the H200's 16-core host the split decoded Qwen3-30B-A3B at 4G faster than the host
/// tier alone with 16 threads (10-23% under uniform routing, 9-11% skewed, fourteenth session;
/// 24-25% in the fifteenth) and with 8 (+14% and +23% on two leases, fifteenth session), and
/// barely with 4 (+7%, +3%: a CPU share of about a third, which one round trip per MoE layer
/// eats most of). One lease of the fourteenth session, whose CPU ran slow, had it 6% slower at
/// 16. Below 8 threads the host tier stays the default (docs/BENCHMARKS.md).
pub const SPLIT_MIN_THREADS: usize = 8;

/// Whether a host tier's misses are split between the GPU and the CPU (`split`) rather than all
/// read by the GPU (`host`) when the user did not choose: with at least [`SPLIT_MIN_THREADS`]
/// CPU threads.
pub fn split_misses_by_default(cpu_threads: usize) -> bool {
    cpu_threads >= SPLIT_MIN_THREADS
}

/// What a GPU tier's misses do when the user did not choose (`--moe-miss` absent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissDefault {
    /// Whether the host tier serves them: a copy of every expert in host memory, read by the
    /// GPU's kernels in place (no wait per layer). Otherwise misses are uploaded into the pool or
    /// computed on the CPU, whichever the measured costs favour.
    pub host: bool,
    /// Why, with the numbers (printed by `--stats`).
    pub reason: String,
}

/// The default for a model whose host tier would take `host_bytes`: the host tier when it fits
/// `ram_budget_bytes` (a budget stays a hard limit: the tier is then bounded by it), or, with no
/// budget, when it fits `available_bytes` ([`available_ram_bytes`]) leaving
/// [`HOST_TIER_MIN_FREE_BYTES`] or an eighth of it free, whichever is more; otherwise the
/// upload path.
pub fn default_miss(host_bytes: u64, ram_budget_bytes: Option<u64>, available_bytes: Option<u64>) -> MissDefault {
    let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
    let what = format!("a host copy of every expert takes {}", gb(host_bytes));
    match (ram_budget_bytes, available_bytes) {
        (Some(budget), _) if host_bytes <= budget => {
            MissDefault { host: true, reason: format!("{what}, within --ram-budget {}", gb(budget)) }
        }
        (Some(budget), _) => MissDefault {
            host: false,
            reason: format!("{what}, more than --ram-budget {}: misses uploaded or computed on the CPU", gb(budget)),
        },
        (None, Some(avail)) => {
            let keep = HOST_TIER_MIN_FREE_BYTES.max(avail / 8);
            let room = avail.saturating_sub(keep);
            MissDefault {
                host: host_bytes <= room,
                reason: if host_bytes <= room {
                    format!("{what}, within the {} of RAM available less {} kept free", gb(avail), gb(keep))
                } else {
                    format!(
                        "{what}, more than the {} of RAM available less {} kept free: misses uploaded or computed on the CPU",
                        gb(avail),
                        gb(keep)
                    )
                },
            }
        }
        (None, None) => MissDefault {
            host: false,
            reason: format!("{what}, and the available RAM is unknown: misses uploaded or computed on the CPU"),
        },
    }
}

/// RAM this process can still take without swapping: `MemAvailable` from `/proc/meminfo`, capped
/// by the room under a cgroup v2 memory limit; `None` where neither can be read (not Linux).
pub fn available_ram_bytes() -> Option<u64> {
    let kib = |text: &str, key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|k| k * 1024)
    };
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let available = read("/proc/meminfo").and_then(|t| kib(&t, "MemAvailable:"));
    // `max` (no limit) does not parse.
    let limit = read("/sys/fs/cgroup/memory.max").and_then(|t| t.trim().parse::<u64>().ok());
    let room = limit.map(|l| {
        let used = read("/sys/fs/cgroup/memory.current").and_then(|t| t.trim().parse::<u64>().ok()).unwrap_or(0);
        l.saturating_sub(used)
    });
    match (available, room) {
        (Some(a), Some(r)) => Some(a.min(r)),
        (a, r) => a.or(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn host_tier_is_the_default_only_where_it_fits() {
        // A budget is a hard limit, whatever RAM is free.
        assert!(default_miss(16 * GIB, Some(16 * GIB), Some(GIB)).host);
        let over = default_miss(16 * GIB + 1, Some(16 * GIB), Some(1000 * GIB));
        assert!(!over.host);
        assert!(over.reason.contains("more than --ram-budget 17.18 GB"), "{}", over.reason);
        // No budget: the available RAM less max(2 GiB, 1/8) kept free.
        assert!(default_miss(112 * GIB, None, Some(128 * GIB)).host);
        assert!(!default_miss(112 * GIB + 1, None, Some(128 * GIB)).host);
        assert!(default_miss(6 * GIB, None, Some(8 * GIB)).host);
        let small = default_miss(6 * GIB + 1, None, Some(8 * GIB));
        assert!(!small.host);
        assert!(small.reason.contains("8.59 GB of RAM available less 2.15 GB kept free"), "{}", small.reason);
        assert!(!default_miss(1, None, None).host);
    }

    #[test]
    fn split_is_the_default_from_eight_threads() {
        assert!(!split_misses_by_default(2));
        assert!(!split_misses_by_default(7));
        assert!(split_misses_by_default(8));
        assert!(split_misses_by_default(16));
    }

    #[test]
    fn available_ram_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            let a = available_ram_bytes().expect("MemAvailable on Linux");
            assert!(a > 0);
        }
    }
}
