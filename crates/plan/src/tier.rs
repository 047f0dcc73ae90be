//! The GPU expert tier (`--gpu-budget`) as `diskformer run` and the server start it: the
//! placement of dense weights, KV cache, scratch and expert slots within the budget, the miss
//! mode, the host copy or RAM cache the misses come from, and the back end built on them.
//! One function for both, so that a budget means the same thing in each (docs/PAGING.md).

#[cfg(feature = "gpu")]
use crate::{PlanError, Result};
use compute::quant::MatmulMode;
#[cfg(feature = "gpu")]
use compute::wgpu::{ExpertTierOptions, MissPolicy, SlotPolicy, WgpuBackend, WgpuOptions};
#[cfg(feature = "gpu")]
use gguf::GgufModel;
#[cfg(feature = "gpu")]
use pager::placement::{activation_scratch_bytes, WgpuSizes};
#[cfg(feature = "gpu")]
use std::sync::Arc;

/// Tokens of one prompt batch the GPU scratch is sized for.
#[cfg(feature = "gpu")]
const BATCH: usize = 512;

/// How the tier serves an expert that holds no GPU slot (`--moe-miss`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierMiss {
    /// Upload it into a slot (evicting another) and compute it there.
    Upload,
    /// Compute it on the CPU from the host copy.
    Cpu,
    /// Whichever is cheaper by measured costs.
    Auto,
    /// Read by the GPU from a copy of every expert in host memory.
    Host,
    /// As `Host`, each layer's misses divided between the GPU and the CPU computing at once.
    Split,
}

/// What the tier is asked for.
#[derive(Clone, Debug)]
pub struct GpuTierOptions {
    /// GPU memory for everything: dense weights, KV cache, scratch and the expert pool.
    pub budget_bytes: u64,
    /// Host memory for experts: bounds the host copy of the `Host` miss mode, or sizes the RAM
    /// cache of the others.
    pub ram_budget_bytes: Option<u64>,
    /// How a miss is served; `None`: the host copy when every expert fits in RAM
    /// ([`pager::placement::default_miss`]), its misses split with the CPU from
    /// [`pager::placement::SPLIT_MIN_THREADS`] threads, else `Auto` through a RAM cache.
    pub miss: Option<TierMiss>,
    /// Which slot (and RAM-cached expert) a miss replaces.
    pub cache_policy: pager::CachePolicy,
    /// RAM cache: read the next layer's likely experts in the background.
    pub prefetch: bool,
    /// RAM cache: read experts with `O_DIRECT`.
    pub direct_io: bool,
    /// Adapter index (`--gpu N`); `None`: a discrete GPU first.
    pub gpu_index: Option<usize>,
    /// Activations of one-token products: int8 or f32.
    pub matmul: MatmulMode,
}

/// A back end with the tier, and what was placed.
#[cfg(feature = "gpu")]
pub struct GpuTier {
    /// The back end; load the model on it (`models::load_on`).
    pub backend: WgpuBackend,
    /// The RAM cache misses are read through, when the miss mode uses one.
    pub pager: Option<Arc<pager::Pager>>,
    /// One line: the budget's split and the measured upload rate.
    pub placement_line: String,
    /// The miss mode and why it was chosen.
    pub miss_line: String,
}

/// Builds the GPU expert tier for `file` with `n_ctx` positions of KV cache.
///
/// # Errors
/// [`PlanError::Pager`] when the model has no experts or the budget cannot hold the dense part
/// and the pool's floor (`GpuBudgetTooSmall`, with the bytes needed); [`PlanError::Request`]
/// when the host copy would exceed the RAM budget given with the `Host` miss mode;
/// [`PlanError::GpuTier`] when no adapter or the back end refuses.
#[cfg(feature = "gpu")]
pub fn gpu_tier(file: &Arc<GgufModel>, n_ctx: u64, o: &GpuTierOptions) -> Result<GpuTier> {
    let model = file.path().display().to_string();
    let desc = crate::describe(file.path())?;
    let w = desc.weights.as_ref().ok_or_else(|| PlanError::GpuTier {
        model: model.clone(),
        why: "the planner found no weight facts in the model".into(),
    })?;
    let kv_bytes = w.kv_bytes_per_position * n_ctx + w.recurrent_state_bytes;
    let unbounded = pager::GpuPlacement::plan_on(file, u64::MAX / 4, kv_bytes, 0, &WgpuSizes)?;
    let staging_bytes = ExpertTierOptions::new(1, unbounded.slot_bytes).staging_total_bytes();
    let mut scratch_bytes = activation_scratch_bytes(file, BATCH.min(n_ctx as usize)) + staging_bytes;
    let host_bytes = unbounded.n_experts_total as u64 * unbounded.slot_bytes;
    let (miss, miss_reason) = match o.miss {
        Some(m) => (
            match m {
                TierMiss::Upload => MissPolicy::Upload,
                TierMiss::Cpu => MissPolicy::Cpu,
                TierMiss::Auto => MissPolicy::Auto,
                TierMiss::Host => MissPolicy::Host,
                TierMiss::Split => MissPolicy::Split,
            },
            "chosen by --moe-miss".to_string(),
        ),
        None => {
            let d =
                pager::placement::default_miss(host_bytes, o.ram_budget_bytes, pager::placement::available_ram_bytes());
            // The pool the CPU's share would run on (`-t`).
            let threads = rayon::current_num_threads();
            if !d.host {
                (MissPolicy::Auto, format!("default: {}", d.reason))
            } else if pager::placement::split_misses_by_default(threads) {
                (
                    MissPolicy::Split,
                    format!(
                        "default: {}; split between the GPU and {threads} CPU threads (from {})",
                        d.reason,
                        pager::placement::SPLIT_MIN_THREADS
                    ),
                )
            } else {
                (
                    MissPolicy::Host,
                    format!(
                        "default: {}; the GPU reads them ({threads} CPU threads, split from {})",
                        d.reason,
                        pager::placement::SPLIT_MIN_THREADS
                    ),
                )
            }
        }
    };
    // Both keep a host copy of every expert that the GPU reads.
    let host_tier = matches!(miss, MissPolicy::Host | MissPolicy::Split);
    if host_tier {
        scratch_bytes += compute::wgpu::host_tier_table_reserve_bytes(unbounded.n_experts_total);
    }
    let placed = pager::GpuPlacement::plan_on(file, o.budget_bytes, kv_bytes, scratch_bytes, &WgpuSizes)?;
    // The host tier holds every expert itself (bounded by the RAM budget): no RAM cache beside it.
    if let (true, Some(ram)) = (host_tier, o.ram_budget_bytes) {
        if host_bytes > ram {
            return Err(PlanError::Request {
                why: format!(
                    "the {} miss mode keeps every expert in host memory: {host_bytes} bytes, more than the RAM budget \
                     {ram}; the auto miss mode reads misses through a RAM cache of that size instead",
                    format!("{miss:?}").to_lowercase()
                ),
            });
        }
    }
    let pager = match o.ram_budget_bytes {
        Some(budget) if !host_tier => {
            let popts = pager::PagerOptions {
                prefetch: o.prefetch,
                direct_io: o.direct_io,
                ..pager::PagerOptions::new(budget, o.cache_policy)
            };
            Some(Arc::new(pager::Pager::open(file, &popts)?))
        }
        _ => None,
    };
    let mut access_note = String::new();
    let store: Arc<dyn compute::ExpertStore> = match &pager {
        Some(p) => p.clone(),
        None => {
            let t0 = std::time::Instant::now();
            let mut access = pager::MappedAccess::from_env();
            if access == pager::MappedAccess::HugeCopy && o.ram_budget_bytes.is_some() {
                // The copy would hold every expert a second time, outside the budget's count.
                access_note = "; no huge-page copy of the experts under a RAM budget".to_string();
                access = pager::MappedAccess::Map;
            }
            let mapped = pager::MappedExperts::open_with(file, access)?;
            if mapped.access() != pager::MappedAccess::Map {
                access_note = format!(
                    "; the CPU reads experts {:?} (prepared in {:.2} s)",
                    mapped.access(),
                    t0.elapsed().as_secs_f64()
                );
            }
            Arc::new(mapped)
        }
    };
    let topts = ExpertTierOptions {
        miss,
        host_budget_bytes: if host_tier { o.ram_budget_bytes } else { None },
        policy: match o.cache_policy {
            pager::CachePolicy::Lru => SlotPolicy::Lru,
            pager::CachePolicy::Lfu => SlotPolicy::Lfu,
        },
        cpu_matmul: o.matmul,
        // The pool shared evenly by the layers from their first call, until the policy learns
        // which experts are worth their slots.
        prefill_per_layer: placed.n_slots / placed.n_expert_layers.max(1),
        ..ExpertTierOptions::new(placed.n_slots, placed.slot_bytes)
    };
    let backend_error = |e: &dyn std::fmt::Display| PlanError::GpuTier { model: model.clone(), why: e.to_string() };
    let backend = WgpuBackend::new(WgpuOptions { adapter_index: o.gpu_index, prefer_discrete: true })
        .map_err(|e| backend_error(&e))?
        .with_matmul_mode(o.matmul)
        .with_expert_store(store, topts)
        .map_err(|e| backend_error(&e))?;
    // Decimal units as GPU memory is quoted; MB below 0.1 GB so small models do not read as 0.
    let gb = |x: u64| {
        if x >= 100_000_000 {
            format!("{:.2} GB", x as f64 / 1e9)
        } else {
            format!("{:.2} MB", x as f64 / 1e6)
        }
    };
    let placement_line = format!(
        "GPU placement: budget {} = dense {} + KV {} + scratch {} + {} expert slots of {} ({:.1}% of {} experts); upload {:.1} GB/s measured",
        gb(o.budget_bytes),
        gb(placed.dense_bytes),
        gb(placed.kv_bytes),
        gb(placed.scratch_bytes),
        placed.n_slots,
        gb(placed.slot_bytes),
        100.0 * placed.n_slots as f64 / placed.n_experts_total.max(1) as f64,
        placed.n_experts_total,
        backend.expert_upload_bytes_per_s().unwrap_or(0.0) / 1e9,
    );
    let miss_line = format!("expert misses: {} ({miss_reason}){access_note}", format!("{miss:?}").to_lowercase());
    Ok(GpuTier { backend, pager, placement_line, miss_line })
}
