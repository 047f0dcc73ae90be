//! [`plan`]: every back end answers "ok, with an estimate" or "no, because", and the fastest
//! answer that is ok wins.
//!
//! # The memory model
//! From the GGUF header ([`WeightFacts`]): weight bytes (as stored for the CPU, which uses them in
//! place from the memory map; as repacked for the GPU), the KV cache (f32: per layer
//! `n_head_kv * (key_length + value_length) * 4` bytes per position, MLA's latent instead for
//! deepseek2, nothing for recurrent layers, whose state is counted apart), and scratch for a
//! prompt batch of [`N_BATCH`] tokens.
//!
//! # The speed model
//! Generating a token reads every active weight once plus the KV cache so far, and decoding is
//! bound by memory bandwidth, so `tok/s = bandwidth / bytes read per token`, with the KV cache
//! counted at half the context. The bandwidths come from [`crate::probe`] (measured, or the
//! table of measured devices); each estimate says which. With no bandwidth known the estimate
//! has no speed, and such back ends rank after those with one. The GPU expert tier reads its
//! missed experts (uniform routing) from host memory at the GPU's host read rate and the rest at
//! its bandwidth. Every figure is a bound: GPU decode reaches a fraction of it.

use crate::describe::{ModelDescription, Task, WeightFacts};
use crate::probe::{GpuInfo, Machine, Source};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Tokens of one prompt batch, for the scratch estimate.
pub const N_BATCH: u64 = 512;
/// Runtime overhead on the host beyond weights, cache and scratch (code, tokenizer, buffers).
pub const HOST_OVERHEAD_BYTES: u64 = 64 << 20;
/// Context length used when the caller gives none and the model's is longer (as
/// `models::LoadOptions` with `n_ctx` 0).
pub const DEFAULT_MAX_CTX: u64 = 4096;

/// The back ends the planner weighs, in the order it lists them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// Everything on the CPU, weights used in place from the memory map.
    Cpu,
    /// Everything resident on one GPU.
    Gpu,
    /// Dense weights on the GPU, routed experts paged in from RAM and disk on demand.
    GpuPaged,
    /// Dense layers on the GPU, routed experts computed by the CPU from RAM.
    Hybrid,
}

impl BackendKind {
    /// Every kind, in listing order.
    pub const ALL: [BackendKind; 4] = [BackendKind::Cpu, BackendKind::Gpu, BackendKind::GpuPaged, BackendKind::Hybrid];

    /// The JSON and CLI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Gpu => "gpu",
            BackendKind::GpuPaged => "gpu_paged",
            BackendKind::Hybrid => "hybrid",
        }
    }
}

/// Why a back end cannot run a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    /// The files are in a format, or hold a tensor type, the back end cannot read.
    Format,
    /// The model computes something other than what was asked (or than text generation).
    Task,
    /// The architecture is not implemented, or the back end does not apply to this model.
    Model,
    /// No usable GPU (none found, or the build has no GPU back end).
    Gpu,
    /// The GPU lacks f16 support the back end needs (the current kernels need none).
    F16,
    /// The GPU memory budget is too small; `need_bytes` says how much would do.
    Budget,
    /// The RAM budget is too small; `need_bytes` says how much would do.
    Ram,
    /// Not enough free disk.
    Disk,
    /// The back end is not implemented yet.
    Unimplemented,
}

impl Code {
    /// The JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Format => "format",
            Code::Task => "task",
            Code::Model => "model",
            Code::Gpu => "gpu",
            Code::F16 => "f16",
            Code::Budget => "budget",
            Code::Ram => "ram",
            Code::Disk => "disk",
            Code::Unimplemented => "unimplemented",
        }
    }
}

/// What a back end would use and how fast it would go.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// GPU memory: weights, KV cache, recurrent state and scratch held there.
    pub gpu_bytes: u64,
    /// RAM beyond the page cache's own use: weights the CPU computes with, cache, scratch.
    pub ram_bytes: u64,
    /// Bytes read from disk per generated token (0 when everything stays resident).
    pub disk_bytes: u64,
    /// Bytes read from memory per generated token (the speed model's numerator).
    pub bytes_per_token: u64,
    /// Of those, bytes the GPU reads from host memory per token (the GPU expert tier's misses,
    /// over the host link); 0 for the other back ends.
    #[serde(default)]
    pub host_bytes_per_token: u64,
    /// The rate of those host reads in bytes per second ([`GpuInfo::host_read_bytes_per_s`]).
    #[serde(default)]
    pub host_read_bytes_per_s: Option<f64>,
    /// The CPU back end with its experts paged from disk (a mixture of experts larger than the
    /// RAM budget): the RAM expert cache's budget, the `--ram-budget` that runs it as planned;
    /// `null` when the weights are used in place.
    #[serde(default)]
    pub expert_cache_bytes: Option<u64>,
    /// The disk's read rate in bytes per second ([`crate::DiskInfo::read_bytes_per_s`]) for a
    /// plan that reads experts from disk (`disk_bytes` > 0); the speed counts those reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_read_bytes_per_s: Option<f64>,
    /// Estimated generation speed; `None` when no bandwidth is known for the device.
    pub tok_per_sec: Option<f64>,
    /// The bandwidth used, in bytes per second.
    pub bandwidth_bytes_per_s: Option<f64>,
    /// Where that bandwidth comes from.
    pub bandwidth_source: Option<Source>,
}

/// Why a back end was refused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Refusal {
    /// The reason's class.
    pub code: Code,
    /// The reason, in words, with the fix when there is one.
    pub reason: String,
    /// Bytes (of the budget the code names) with which it would run, where more memory would help.
    pub need_bytes: Option<u64>,
}

/// One back end's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BackendPlan {
    /// The back end.
    pub backend: BackendKind,
    /// The device it would run on (`cpu`, or the GPU's index and name).
    pub device: Option<String>,
    /// `Some` when it can run the model.
    pub estimate: Option<Estimate>,
    /// `Some` when it cannot.
    pub refusal: Option<Refusal>,
}

impl BackendPlan {
    /// Whether this back end can run the model.
    pub fn is_ok(&self) -> bool {
        self.estimate.is_some()
    }
}

/// A budget and where its value came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Budget {
    /// Bytes, when known.
    pub bytes: Option<u64>,
    /// `given` (the caller's), `device` (free device memory), `available` (available RAM), or
    /// `unknown`.
    pub source: String,
}

/// What [`crate::plan`] decides. The JSON form is documented in docs/PLAN.md and stable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The model file planned for.
    pub model: PathBuf,
    /// Its architecture.
    pub architecture: Option<String>,
    /// Context length the estimates are for.
    pub n_ctx: u64,
    /// The fastest back end that is ok, if any.
    pub chosen: Option<BackendKind>,
    /// Every back end's answer, in [`BackendKind::ALL`] order.
    pub backends: Vec<BackendPlan>,
    /// The GPU memory budget.
    pub gpu_budget: Budget,
    /// The RAM budget.
    pub ram_budget: Budget,
    /// How speeds were estimated.
    pub speed_model: String,
    /// Assumptions made for lack of information (unknown GPU memory, unknown RAM).
    pub assumptions: Vec<String>,
}

/// What to plan for.
#[derive(Clone, Debug, Default)]
pub struct PlanOptions {
    /// GPU memory budget (default: the device's free memory, when known).
    pub budget_bytes: Option<u64>,
    /// RAM budget (default: available RAM).
    pub ram_budget_bytes: Option<u64>,
    /// The task the caller wants (default: the model's own, which must be text generation).
    pub task: Option<Task>,
    /// Context length (0: the model's, capped at [`DEFAULT_MAX_CTX`]).
    pub n_ctx: u64,
    /// GPU adapter index (default: a discrete GPU first, a software renderer last).
    pub gpu_index: Option<usize>,
}

/// GPU memory the back end holds whatever the model: its fixed buffers and the allocator's
/// unused block ends, which a budget must cover too.
fn gpu_fixed_bytes() -> u64 {
    #[cfg(feature = "gpu")]
    return compute::wgpu::backend_fixed_bytes();
    #[cfg(not(feature = "gpu"))]
    return 0;
}

/// GPU bytes the expert tier holds beside the pool (`diskformer run --gpu-budget` counts them in
/// its scratch): the staging buffers misses are uploaded through, and the slot table of the
/// default miss mode (host) for every expert of the model.
fn tier_fixed_bytes(slot_bytes: u64, n_experts_total: u64) -> u64 {
    #[cfg(feature = "gpu")]
    return compute::wgpu::ExpertTierOptions::new(1, slot_bytes).staging_total_bytes()
        + compute::wgpu::host_tier_table_reserve_bytes(n_experts_total as usize);
    #[cfg(not(feature = "gpu"))]
    return {
        let _ = (slot_bytes, n_experts_total);
        0
    };
}

/// Memory a configuration needs, by place.
struct Needs {
    kv_bytes: u64,
    scratch_bytes: u64,
}

fn needs(w: &WeightFacts, n_ctx: u64) -> Needs {
    let kv_bytes = w.kv_bytes_per_position * n_ctx + w.recurrent_state_bytes;
    // Activations of one batch (residual, norms, q/k/v/o, FFN gate/up/down) and the last
    // position's logits twice (device and host copies).
    let scratch_bytes = 4 * N_BATCH * (6 * w.n_embd as u64 + 3 * w.max_ffn as u64) + 2 * 4 * w.n_vocab as u64;
    Needs { kv_bytes, scratch_bytes }
}

/// Bytes one generated token reads: dense weights, the used experts' share, KV at half context.
fn bytes_per_token(w: &WeightFacts, weight_bytes: u64, expert_bytes: u64, n_ctx: u64) -> u64 {
    let active_experts =
        if w.expert_count > 0 { expert_bytes * w.expert_used_count as u64 / w.expert_count as u64 } else { 0 };
    weight_bytes - expert_bytes + active_experts + w.kv_bytes_per_position * n_ctx / 2 + w.recurrent_state_bytes
}

fn speed(bytes_per_token: u64, bw: Option<f64>) -> Option<f64> {
    bw.map(|b| b / bytes_per_token.max(1) as f64)
}

fn refuse(
    backend: BackendKind,
    device: Option<String>,
    code: Code,
    reason: String,
    need_bytes: Option<u64>,
) -> BackendPlan {
    BackendPlan { backend, device, estimate: None, refusal: Some(Refusal { code, reason, need_bytes }) }
}

/// Picks the GPU a plan uses: the one asked for, else by kind (discrete first).
fn pick_gpu(machine: &Machine, index: Option<usize>) -> Option<&GpuInfo> {
    let rank = |t: &str| match t {
        "DiscreteGpu" => 0,
        "IntegratedGpu" => 1,
        "VirtualGpu" => 2,
        "Cpu" => 4,
        _ => 3,
    };
    match index {
        Some(i) => machine.gpus.iter().find(|g| g.index == i),
        None => machine.gpus.iter().min_by_key(|g| (rank(&g.device_type), g.index)),
    }
}

/// Plans `desc` on `machine`: each back end's verdict and the fastest that is ok. Pure: the
/// same description, machine and options give the same plan (tests build machines by hand).
pub fn plan_with(desc: &ModelDescription, machine: &Machine, opts: &PlanOptions) -> Plan {
    let model = desc.gguf.clone().unwrap_or_else(|| desc.path.clone());
    let n_ctx = match opts.n_ctx {
        0 => desc.context_length.unwrap_or(DEFAULT_MAX_CTX).clamp(1, DEFAULT_MAX_CTX),
        n => n,
    };
    let mut assumptions = Vec::new();
    let ram_budget = match (opts.ram_budget_bytes, machine.memory.available_bytes) {
        (Some(b), _) => Budget { bytes: Some(b), source: "given".into() },
        (None, Some(b)) => Budget { bytes: Some(b), source: "available".into() },
        (None, None) => {
            assumptions.push("available RAM is unknown; the RAM budget is not checked (give --ram-budget)".into());
            Budget { bytes: None, source: "unknown".into() }
        }
    };
    let gpu = pick_gpu(machine, opts.gpu_index);
    let gpu_budget = match (opts.budget_bytes, gpu.and_then(|g| g.memory_free_bytes.or(g.memory_bytes))) {
        (Some(b), _) => Budget { bytes: Some(b), source: "given".into() },
        (None, Some(b)) => Budget { bytes: Some(b), source: "device".into() },
        (None, None) => {
            if gpu.is_some() {
                assumptions.push("the GPU's memory is unknown; the GPU budget is not checked (give --budget)".into());
            }
            Budget { bytes: None, source: "unknown".into() }
        }
    };
    let ctx = Ctx {
        desc,
        machine,
        opts,
        n_ctx,
        gpu,
        ram_budget: ram_budget.bytes,
        gpu_budget: gpu_budget.bytes,
        tier_budget: tier_budget(&gpu_budget),
    };
    let backends: Vec<BackendPlan> = BackendKind::ALL.iter().map(|&k| ctx.judge(k)).collect();
    // The GPU expert tier competes when it has a speed (a host read rate is known); the caller
    // starts it with `Plan::gpu_tier_budget`.
    let chosen = backends
        .iter()
        .enumerate()
        .filter(|(_, b)| {
            b.is_ok()
                && (b.backend != BackendKind::GpuPaged || b.estimate.as_ref().is_some_and(|e| e.tok_per_sec.is_some()))
        })
        .max_by(|(ia, a), (ib, b)| {
            let sa = a.estimate.as_ref().and_then(|e| e.tok_per_sec).unwrap_or(-1.0);
            let sb = b.estimate.as_ref().and_then(|e| e.tok_per_sec).unwrap_or(-1.0);
            // Faster wins; on a tie the earlier in listing order.
            sa.total_cmp(&sb).then(ib.cmp(ia))
        })
        .map(|(_, b)| b.backend);
    Plan {
        model,
        architecture: desc.architecture.clone(),
        n_ctx,
        chosen,
        backends,
        gpu_budget,
        ram_budget,
        speed_model: "tok/s = memory read bandwidth / bytes read per token (active weights + KV cache at half the context); \
                      bandwidth measured by probe, or from the table of measured devices, as each estimate's bandwidth_source says; \
                      gpu_paged: its missed experts (uniform routing) read at the GPU's host read rate, the rest at its bandwidth; \
                      experts read from disk add their time at the probe's disk read rate (none measured: no speed). \
                      A bound, which GPU decode reaches a fraction of (H200, Qwen3-30B-A3B Q4_K at a 4 GiB budget: 34 tok/s of 57 with every miss read over the link, \
                      with the default split 61.5 uniform and 72.6 at skew 0.3 in the twenty-fourth session's paged.sh (leases vary ~10%), whose CPU share this model leaves out); \
                      paged from disk on the CPU an estimate (this 2-core VM, OLMoE-1B-7B Q4_0 at a 2 GiB RAM budget: 2.0 estimated, 2.23 measured)"
            .into(),
        assumptions,
    }
}

struct Ctx<'a> {
    desc: &'a ModelDescription,
    machine: &'a Machine,
    opts: &'a PlanOptions,
    n_ctx: u64,
    gpu: Option<&'a GpuInfo>,
    ram_budget: Option<u64>,
    gpu_budget: Option<u64>,
    /// The GPU expert tier's budget ([`tier_budget`]).
    tier_budget: Option<u64>,
}

/// GPU memory the expert tier plans with: the budget given, or the device's free memory less a
/// margin (a twentieth, at least 512 MiB) for the driver's own context and other programs: the
/// tier fills whatever it is given with expert slots, where the resident back end takes only
/// what the model needs.
fn tier_budget(b: &Budget) -> Option<u64> {
    let bytes = b.bytes?;
    Some(match b.source.as_str() {
        "device" => bytes - (bytes / 20).max(512 << 20).min(bytes),
        _ => bytes,
    })
}

impl<'a> Ctx<'a> {
    /// The first problem every back end shares: the task, the format, the architecture.
    fn common(&self, backend: BackendKind) -> Option<(Code, String)> {
        let d = self.desc;
        if let Some(want) = self.opts.task {
            if want != d.task {
                return Some((
                    Code::Task,
                    format!("{} was asked for but the model does {}", want.as_str(), d.task.as_str()),
                ));
            }
        }
        if d.task != Task::TextGeneration {
            return Some((
                Code::Task,
                format!("the model does {}; diskformer runs text generation only", d.task.as_str()),
            ));
        }
        if d.gguf.is_none() {
            let found: Vec<&str> = d.formats.iter().map(|f| f.as_str()).collect();
            return Some((
                Code::Format,
                format!("no GGUF file (found {}); convert it with llama.cpp's convert_hf_to_gguf.py", found.join(", ")),
            ));
        }
        let reader = d.readers.iter().find(|r| r.backend == backend.as_str());
        match reader {
            Some(r) if !r.can_read => Some((r.code.unwrap_or(Code::Model), r.reason.clone().unwrap_or_default())),
            Some(_) => None,
            None => Some((Code::Model, "the description has no verdict for this back end".into())),
        }
    }

    fn judge(&self, backend: BackendKind) -> BackendPlan {
        let device = match backend {
            BackendKind::Cpu => {
                Some(format!("cpu: {}", self.machine.cpu.model.as_deref().unwrap_or(&self.machine.cpu.arch)))
            }
            _ => self.gpu.map(|g| format!("gpu {}: {}", g.index, g.name)),
        };
        if let Some((code, reason)) = self.common(backend) {
            return refuse(backend, device, code, reason, None);
        }
        let Some(w) = self.desc.weights.as_ref() else {
            return refuse(backend, device, Code::Format, "the GGUF header lacks the model's dimensions".into(), None);
        };
        let n = needs(w, self.n_ctx);
        match backend {
            BackendKind::Cpu => self.judge_cpu(w, &n, device),
            BackendKind::Gpu => self.judge_gpu(w, &n, device),
            BackendKind::GpuPaged => self.judge_gpu_paged(w, &n, device),
            // `common` refuses it through the readers (no back end of its own, or no experts).
            BackendKind::Hybrid => {
                refuse(backend, device, Code::Unimplemented, "not a back end of its own".into(), None)
            }
        }
    }

    fn check_ram(&self, backend: BackendKind, device: &Option<String>, need: u64, what: &str) -> Option<BackendPlan> {
        let budget = self.ram_budget?;
        (need > budget).then(|| {
            refuse(
                backend,
                device.clone(),
                Code::Ram,
                format!(
                    "{what} need {} of RAM but the budget is {}; raise --ram-budget to at least {}",
                    crate::format_bytes(need),
                    crate::format_bytes(budget),
                    crate::format_bytes(need)
                ),
                Some(need),
            )
        })
    }

    /// The disk read rate the probe measured (the first disk with one: the model's, as
    /// `plan` and `run` probe only its folder).
    fn disk_read_rate(&self) -> Option<f64> {
        self.machine.disks.iter().find_map(|d| d.read_bytes_per_s)
    }

    fn judge_cpu(&self, w: &WeightFacts, n: &Needs, device: Option<String>) -> BackendPlan {
        let ram = w.tensor_bytes + n.kv_bytes + n.scratch_bytes + HOST_OVERHEAD_BYTES;
        if let Some(refusal) = self.check_ram(BackendKind::Cpu, &device, ram, "weights, KV cache and scratch") {
            return self.judge_cpu_paged(w, n, device).unwrap_or(refusal);
        }
        let bpt = bytes_per_token(w, w.tensor_bytes, w.expert_bytes, self.n_ctx);
        let mem = &self.machine.memory;
        BackendPlan {
            backend: BackendKind::Cpu,
            device,
            estimate: Some(Estimate {
                gpu_bytes: 0,
                ram_bytes: ram,
                disk_bytes: 0,
                bytes_per_token: bpt,
                host_bytes_per_token: 0,
                host_read_bytes_per_s: None,
                expert_cache_bytes: None,
                disk_read_bytes_per_s: None,
                tok_per_sec: speed(bpt, mem.bandwidth_bytes_per_s),
                bandwidth_bytes_per_s: mem.bandwidth_bytes_per_s,
                bandwidth_source: mem.bandwidth_source,
            }),
            refusal: None,
        }
    }

    /// A mixture of experts whose weights exceed the RAM budget on the CPU back end with its
    /// experts paged from disk (`--ram-budget`): dense weights used in place, KV cache, scratch
    /// and an expert cache of at least `MIN_SLOTS_PER_TOP_K` x top-k slots (below that a token's
    /// own layers evict each other), the rest of the budget the cache's. `None` for a dense model
    /// or a description without the cache's sizes (the caller's refusal stands); a refusal with
    /// the paged need (far below the whole model's) when even that does not fit. Misses are read
    /// from disk under uniform routing; the speed adds their time at the disk's measured rate
    /// to the memory's (none without a measured disk rate).
    fn judge_cpu_paged(&self, w: &WeightFacts, n: &Needs, device: Option<String>) -> Option<BackendPlan> {
        let (index, slot) = (w.ram_cache_index_bytes?, w.ram_slot_bytes?);
        let budget = self.ram_budget?;
        if w.expert_count == 0 || slot == 0 {
            return None;
        }
        let kind = BackendKind::Cpu;
        let n_total = (w.expert_count * w.n_layers) as u64;
        let fixed = w.tensor_bytes - w.expert_bytes + n.kv_bytes + n.scratch_bytes + HOST_OVERHEAD_BYTES;
        let floor_slots = ((pager::MIN_SLOTS_PER_TOP_K * w.expert_used_count.max(1)) as u64).min(n_total);
        let need = fixed + index + floor_slots * slot;
        if need > budget {
            let reason = format!(
                "weights, KV cache and scratch need {} of RAM, or with the experts paged from disk {} (dense \
                 weights, KV cache and scratch {}, an expert cache of {} slots of {}), but the budget is {}; raise \
                 --ram-budget to at least {}",
                crate::format_bytes(fixed + w.expert_bytes),
                crate::format_bytes(need),
                crate::format_bytes(fixed),
                floor_slots,
                crate::format_bytes(slot),
                crate::format_bytes(budget),
                crate::format_bytes(need)
            );
            return Some(refuse(kind, device, Code::Ram, reason, Some(need)));
        }
        let slots = ((budget - fixed - index) / slot).min(n_total);
        let cache = index + slots * slot;
        let active = w.expert_bytes * w.expert_used_count as u64 / w.expert_count as u64;
        let disk_per_token = (active as f64 * (1.0 - slots as f64 / n_total as f64)) as u64;
        let mem = &self.machine.memory;
        let bpt = bytes_per_token(w, w.tensor_bytes, w.expert_bytes, self.n_ctx);
        let disk_rate = self.disk_read_rate();
        // The pager reads a layer's misses before it computes them (no overlap without
        // `--prefetch`): the memory's time and the disk's add up.
        let tok_per_sec = match (mem.bandwidth_bytes_per_s, disk_rate) {
            (Some(bw), Some(disk)) if bw > 0.0 && disk > 0.0 => {
                Some(1.0 / (bpt as f64 / bw + disk_per_token as f64 / disk))
            }
            _ => None,
        };
        Some(BackendPlan {
            backend: kind,
            device,
            estimate: Some(Estimate {
                gpu_bytes: 0,
                ram_bytes: fixed + cache,
                disk_bytes: disk_per_token,
                bytes_per_token: bpt,
                host_bytes_per_token: 0,
                host_read_bytes_per_s: None,
                expert_cache_bytes: Some(cache),
                disk_read_bytes_per_s: disk_rate,
                tok_per_sec,
                bandwidth_bytes_per_s: mem.bandwidth_bytes_per_s,
                bandwidth_source: mem.bandwidth_source,
            }),
            refusal: None,
        })
    }

    /// The GPU to plan on and the model's repacked GPU bytes (all tensors, routed experts), or
    /// the refusal's code and reason: the build has no GPU back end, the machine no adapter, or
    /// a tensor type has no GPU kernel.
    fn gpu_and_bytes(&self, w: &WeightFacts) -> Result<(&'a GpuInfo, u64, u64), (Code, String)> {
        if !self.machine.gpu_compiled {
            return Err((Code::Gpu, "this build has no GPU back end (built without the `gpu` feature)".into()));
        }
        let gpu = self.gpu.ok_or_else(|| {
            let why = match self.opts.gpu_index {
                Some(i) => format!("GPU {i} asked for but {} found", self.machine.gpus.len()),
                None => {
                    "no GPU adapter found (Vulkan, Metal or DX12); install a driver (lavapipe: mesa-vulkan-drivers)"
                        .into()
                }
            };
            (Code::Gpu, why)
        })?;
        match (w.gpu_tensor_bytes, w.gpu_expert_bytes) {
            (Some(weights), Some(experts)) => Ok((gpu, weights, experts)),
            _ => Err((Code::Format, "a tensor type has no GPU kernel".into())),
        }
    }

    /// The GPU expert tier (`--gpu-budget`): dense weights, KV cache, scratch and a pool of
    /// expert slots in GPU memory, every expert in a host copy (or paged from disk through
    /// `--ram-budget`). The pool's floor is `MIN_SLOTS_PER_TOP_K` x top-k slots; a slot is one
    /// expert of the layer with the largest, as the tier lays it out.
    ///
    /// Speed: a token reads its dense weights, KV cache and pooled experts from GPU memory and
    /// its missed experts from host memory (the default miss mode's kernels read the host copy
    /// over the link), so `1 / tok/s = (bytes - missed) / GPU bandwidth + missed / host read
    /// rate`, with routing taken as uniform (the hardest case for a cache: a selection hits with
    /// the pool's share of the experts). Misses from disk (a RAM budget below the host copy) add
    /// their time at the disk's measured rate. Without a host read rate, or disk reads without a
    /// disk rate, no speed.
    fn judge_gpu_paged(&self, w: &WeightFacts, n: &Needs, device: Option<String>) -> BackendPlan {
        let kind = BackendKind::GpuPaged;
        let (gpu, weights, experts) = match self.gpu_and_bytes(w) {
            Ok(facts) => facts,
            Err((code, why)) => return refuse(kind, device, code, why, None),
        };
        let n_slots_total = (w.expert_count * w.n_layers).max(1) as u64;
        // The tier's own slot where the description has it (descriptions written before it
        // existed: the average over layers, a little under).
        let slot = w.gpu_slot_bytes.unwrap_or_else(|| experts.div_ceil(n_slots_total));
        // The tier's own scratch estimate where the description has it (it counts the widest
        // width, which for Qwen3-style attention is the heads', not the hidden width).
        let scratch = w.gpu_scratch_bytes.unwrap_or(n.scratch_bytes);
        let base = weights - experts + n.kv_bytes + scratch + gpu_fixed_bytes() + tier_fixed_bytes(slot, n_slots_total);
        let floor = (pager::MIN_SLOTS_PER_TOP_K * w.expert_used_count.max(1)) as u64 * slot;
        let need = base + floor;
        let budget = self.tier_budget.unwrap_or(u64::MAX);
        if need > budget {
            let reason = format!(
                "dense weights, KV cache and scratch need {} of GPU memory and the expert pool at least {} more \
                 ({} slots of {}), but the budget is {}; raise the GPU budget (`run --gpu-budget`) to at least {}",
                crate::format_bytes(base),
                crate::format_bytes(floor),
                pager::MIN_SLOTS_PER_TOP_K * w.expert_used_count.max(1),
                crate::format_bytes(slot),
                crate::format_bytes(budget),
                crate::format_bytes(need),
            );
            return refuse(kind, device, Code::Budget, reason, Some(need));
        }
        let slots = ((budget - base) / slot.max(1)).min(n_slots_total);
        // The host copy of every expert when the RAM budget holds it (the tier's default), else
        // the pager's cache at the RAM budget with the rest read from disk.
        let host_copy = experts + n.scratch_bytes + HOST_OVERHEAD_BYTES;
        let (ram, disk_per_token) = match self.ram_budget {
            Some(r) if host_copy > r => {
                // Uniform routing, the hardest case: a selection misses both tiers with the
                // share of experts neither holds.
                let held = (slots * slot).saturating_add(r.saturating_sub(n.scratch_bytes + HOST_OVERHEAD_BYTES));
                let missing = experts.saturating_sub(held) as f64 / experts.max(1) as f64;
                let active = (w.expert_used_count * w.n_layers) as u64 * slot;
                (r, (active as f64 * missing) as u64)
            }
            _ => (host_copy, 0),
        };
        let bpt = bytes_per_token(w, weights, experts, self.n_ctx);
        let active = experts * w.expert_used_count as u64 / w.expert_count.max(1) as u64;
        let hit = slots as f64 / n_slots_total as f64;
        let missed = (active as f64 * (1.0 - hit)) as u64;
        let disk_rate = self.disk_read_rate().filter(|_| disk_per_token > 0);
        let tok_per_sec = match (gpu.bandwidth_bytes_per_s, gpu.host_read_bytes_per_s, disk_rate) {
            (Some(device), Some(host), disk) if device > 0.0 && host > 0.0 => {
                let gpu_secs = (bpt - missed) as f64 / device + missed as f64 / host;
                match disk {
                    _ if disk_per_token == 0 => Some(1.0 / gpu_secs),
                    Some(d) if d > 0.0 => Some(1.0 / (gpu_secs + disk_per_token as f64 / d)),
                    _ => None,
                }
            }
            _ => None,
        };
        BackendPlan {
            backend: kind,
            device,
            estimate: Some(Estimate {
                gpu_bytes: base + slots * slot,
                ram_bytes: ram,
                disk_bytes: disk_per_token,
                bytes_per_token: bpt,
                host_bytes_per_token: missed,
                host_read_bytes_per_s: gpu.host_read_bytes_per_s,
                expert_cache_bytes: None,
                disk_read_bytes_per_s: disk_rate,
                tok_per_sec,
                bandwidth_bytes_per_s: gpu.bandwidth_bytes_per_s,
                bandwidth_source: gpu.bandwidth_source,
            }),
            refusal: None,
        }
    }

    fn judge_gpu(&self, w: &WeightFacts, n: &Needs, device: Option<String>) -> BackendPlan {
        let kind = BackendKind::Gpu;
        let (gpu, weights, experts) = match self.gpu_and_bytes(w) {
            Ok(facts) => facts,
            Err((code, why)) => return refuse(kind, device, code, why, None),
        };
        // The same activation estimate as the GPU expert tier's (same back end, same batches).
        let need = weights + n.kv_bytes + w.gpu_scratch_bytes.unwrap_or(n.scratch_bytes) + gpu_fixed_bytes();
        if let Some(budget) = self.gpu_budget {
            if need > budget {
                let reason = format!(
                    "weights ({}), KV cache ({}) and scratch need {} of GPU memory but the budget is {}; raise --gpu-budget to at least {}{}",
                    crate::format_bytes(weights),
                    crate::format_bytes(n.kv_bytes),
                    crate::format_bytes(need),
                    crate::format_bytes(budget),
                    crate::format_bytes(need),
                    if self.opts.n_ctx == 0 { "" } else { " or lower the context" },
                );
                return refuse(kind, device, Code::Budget, reason, Some(need));
            }
        }
        // The host keeps the logits and the memory map the weights are uploaded from, whose
        // pages the kernel can drop once uploaded.
        let ram = n.scratch_bytes + HOST_OVERHEAD_BYTES;
        if let Some(refusal) = self.check_ram(kind, &device, ram, "logits and runtime") {
            return refusal;
        }
        let bpt = bytes_per_token(w, weights, experts, self.n_ctx);
        BackendPlan {
            backend: kind,
            device,
            estimate: Some(Estimate {
                gpu_bytes: need,
                ram_bytes: ram,
                disk_bytes: 0,
                bytes_per_token: bpt,
                host_bytes_per_token: 0,
                host_read_bytes_per_s: None,
                expert_cache_bytes: None,
                disk_read_bytes_per_s: None,
                tok_per_sec: speed(bpt, gpu.bandwidth_bytes_per_s),
                bandwidth_bytes_per_s: gpu.bandwidth_bytes_per_s,
                bandwidth_source: gpu.bandwidth_source,
            }),
            refusal: None,
        }
    }
}

impl Plan {
    /// The GPU budget the expert tier was planned with (the `--gpu-budget` that runs it as
    /// planned): the budget given, or the device's free memory less a margin.
    pub fn gpu_tier_budget(&self) -> Option<u64> {
        tier_budget(&self.gpu_budget)
    }

    /// The chosen back end's answer.
    pub fn chosen_plan(&self) -> Option<&BackendPlan> {
        self.chosen.and_then(|c| self.backends.iter().find(|b| b.backend == c))
    }

    /// One back end's answer.
    pub fn backend(&self, kind: BackendKind) -> &BackendPlan {
        // `plan_with` lists every kind.
        self.backends.iter().find(|b| b.backend == kind).unwrap_or(&self.backends[0])
    }

    /// One line for logs and `diskformer run`: what was chosen, with what, how fast.
    pub fn summary_line(&self) -> String {
        match self.chosen_plan() {
            Some(b) => {
                let e = b.estimate.as_ref();
                let speed =
                    e.and_then(|e| e.tok_per_sec).map_or("speed unknown".to_string(), |s| format!("~{s:.0} tok/s"));
                let others: Vec<String> = self
                    .backends
                    .iter()
                    .filter(|o| o.backend != b.backend)
                    .map(|o| match &o.refusal {
                        Some(r) => format!("{} no ({})", o.backend.as_str(), r.code.as_str()),
                        // Without a speed it is not chosen automatically: it runs when asked for.
                        None if o.backend == BackendKind::GpuPaged
                            && o.estimate.as_ref().is_none_or(|e| e.tok_per_sec.is_none()) =>
                        {
                            format!("{} on request", o.backend.as_str())
                        }
                        None => format!("{} slower", o.backend.as_str()),
                    })
                    .collect();
                format!(
                    "plan: {} on {} (gpu {}, ram {}, {}, ctx {}); {}",
                    b.backend.as_str(),
                    b.device.as_deref().unwrap_or("?"),
                    crate::format_bytes(e.map_or(0, |e| e.gpu_bytes)),
                    crate::format_bytes(e.map_or(0, |e| e.ram_bytes)),
                    speed,
                    self.n_ctx,
                    others.join(", ")
                )
            }
            None => format!("plan: nothing can run {}: {}", self.model.display(), self.reasons()),
        }
    }

    /// When the resident GPU back end was refused for its budget but the GPU expert tier fits
    /// it and was not chosen (no host read rate known, or slower than the choice), the flag that
    /// runs the tier, in words; `None` otherwise. `run` prints it beside the plan's line, so a
    /// user whose MoE model outgrows the GPU learns that its dense part and an expert cache
    /// still fit there.
    pub fn gpu_tier_hint(&self) -> Option<String> {
        if matches!(self.chosen, Some(BackendKind::Gpu | BackendKind::GpuPaged)) {
            return None;
        }
        let resident = self.backend(BackendKind::Gpu).refusal.as_ref()?;
        let tier = self.backend(BackendKind::GpuPaged).estimate.as_ref()?;
        let budget = self.gpu_budget.bytes?;
        (resident.code == Code::Budget).then(|| {
            format!(
                "the GPU cannot hold this whole model ({} needed, {} budget), but its dense part and an expert \
                 cache fit: `--gpu-budget {}` runs it on the GPU expert tier ({} of GPU memory, experts read from \
                 host memory on a miss)",
                resident.need_bytes.map_or("more".to_string(), crate::format_bytes),
                crate::format_bytes(budget),
                budget_flag(budget),
                crate::format_bytes(tier.gpu_bytes),
            )
        })
    }

    /// Every refusal as `backend: reason; ...`.
    pub fn reasons(&self) -> String {
        self.backends
            .iter()
            .filter_map(|b| {
                b.refusal.as_ref().map(|r| format!("{}: {} [{}]", b.backend.as_str(), r.reason, r.code.as_str()))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The back end to run: `want`, or the chosen one when `want` is `None`.
    ///
    /// # Errors
    /// When `want` was refused: [`crate::PlanError::BudgetTooSmall`] for a budget or RAM
    /// refusal (with the bytes needed), [`crate::PlanError::UnsupportedArchitecture`],
    /// [`crate::PlanError::NoDevice`], or [`crate::PlanError::NoBackend`] with the reason.
    /// When nothing was chosen: [`crate::PlanError::NoBackend`] listing every reason.
    pub fn pick(&self, want: Option<BackendKind>) -> crate::Result<&BackendPlan> {
        use crate::PlanError;
        let Some(kind) = want.or(self.chosen) else {
            return Err(PlanError::NoBackend { model: self.model.display().to_string(), reasons: self.reasons() });
        };
        let b = self.backend(kind);
        let Some(r) = &b.refusal else { return Ok(b) };
        Err(match (r.code, r.need_bytes) {
            (Code::Budget, Some(need)) => PlanError::BudgetTooSmall {
                what: "gpu",
                need_bytes: need,
                budget_bytes: self.gpu_budget.bytes.unwrap_or(0),
                fix: format!("raise --gpu-budget to at least {}", crate::format_bytes(need)),
            },
            (Code::Ram, Some(need)) => PlanError::BudgetTooSmall {
                what: "ram",
                need_bytes: need,
                budget_bytes: self.ram_budget.bytes.unwrap_or(0),
                fix: format!("raise --ram-budget to at least {}", crate::format_bytes(need)),
            },
            (Code::Gpu, _) => PlanError::NoDevice { why: r.reason.clone() },
            (Code::Model, _) if r.reason.starts_with("architecture") => PlanError::UnsupportedArchitecture {
                arch: self.architecture.clone().unwrap_or_default(),
                supported: models::SUPPORTED_ARCHITECTURES.join(", "),
            },
            _ => PlanError::NoBackend {
                model: self.model.display().to_string(),
                reasons: format!("{}: {}", kind.as_str(), r.reason),
            },
        })
    }
}

/// A byte count as a `--gpu-budget` value that does not exceed it: whole MiB, written `NNNM`.
fn budget_flag(bytes: u64) -> String {
    format!("{}M", bytes >> 20)
}
