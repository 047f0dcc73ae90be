//! describe and plan over the fixture models, on machines built by hand so that budgets and
//! bandwidths make each back end win or be refused for the right reason, with the right need.
//!
//! Expected numbers come from the fixtures' own description (shared/fixtures/README.md: layers,
//! heads, head size) and from Python's `gguf` reader (tensor bytes, parameter counts):
//! ```python
//! r = gguf.GGUFReader(path)
//! sum(t.n_bytes for t in r.tensors); sum(t.n_elements for t in r.tensors)
//! # GPU layout (compute::wgpu::layout): block fields padded to 4 bytes, f32 rows in groups of 8
//! rep = {'Q4_0': (32, 20), 'Q6_K': (256, 212), 'Q8_0': (32, 36), 'F32': (8, 32)}
//! sum(ceil(t.shape[0] / rep[T][0]) * rep[T][1] * t.n_elements // t.shape[0] for t in r.tensors)
//! ```

mod common;

use plan::{
    describe, plan_with, BackendKind, Code, CpuInfo, Format, GpuInfo, Machine, MemoryInfo, PlanOptions, Source,
    SourceKind, Task,
};

const GIB: u64 = 1 << 30;
#[cfg(feature = "gpu")]
const MIB: u64 = 1 << 20;

/// llama fixture (q4_0): 256 hidden, 2 layers, 4 heads of 64, 2 KV heads.
const LLAMA_TENSOR_BYTES: u64 = 849_920;
const LLAMA_PARAMS: u64 = 1_443_072;
/// Its GPU copy: 15 Q4_0 matrices whose rows are whole 256-value groups (40960 blocks in the
/// grouped layout, 18 bytes each as in the file), the Q6_K output (512 blocks of 210 bytes, 212
/// with the trailing scale padded to 4 bytes) and 5 KiB of f32 norms.
#[cfg_attr(not(feature = "gpu"), allow(dead_code))]
const LLAMA_GPU_BYTES: u64 = 40_960 * 18 + 512 * 212 + 5 * 1024;
const LLAMA_KV_PER_POS: u64 = 2 * 2 * (64 + 64) * 4;
/// qwen3_moe fixture (q4_0): 128 hidden, 2 layers, 2 KV heads of 64, 8 experts, top-2.
const MOE_PARAMS: u64 = 1_903_488;
const MOE_EXPERT_PARAMS: u64 = 1_572_864;
const MOE_EXPERT_BYTES: u64 = 884_736;
const MOE_KV_PER_POS: u64 = 2 * 2 * (64 + 64) * 4;

fn cpu() -> CpuInfo {
    CpuInfo {
        model: Some("test cpu".into()),
        arch: "x86_64".into(),
        simd: vec![],
        cores_logical: 8,
        cores_physical: Some(4),
    }
}

/// A machine with `ram` bytes available read at `ram_bw`, and optionally one GPU.
fn machine(ram: u64, ram_bw: f64, gpu: Option<(&str, u64, f64)>) -> Machine {
    Machine {
        gpus: gpu
            .into_iter()
            .map(|(device_type, mem, bw)| GpuInfo {
                index: 0,
                name: format!("test {device_type}"),
                api: "Vulkan".into(),
                device_type: device_type.into(),
                driver: String::new(),
                shader_f16: true,
                subgroups: true,
                max_storage_binding_bytes: GIB,
                memory_bytes: Some(mem),
                memory_free_bytes: Some(mem),
                memory_source: Some("test".into()),
                bandwidth_bytes_per_s: Some(bw),
                bandwidth_source: Some(Source::Given),
                host_read_bytes_per_s: None,
                host_read_source: None,
            })
            .collect(),
        gpu_compiled: cfg!(feature = "gpu"),
        cpu: cpu(),
        memory: MemoryInfo {
            total_bytes: Some(ram),
            available_bytes: Some(ram),
            cgroup_limit_bytes: None,
            bandwidth_bytes_per_s: Some(ram_bw),
            bandwidth_source: Some(Source::Given),
        },
        disks: vec![],
    }
}

fn opts(n_ctx: u64) -> PlanOptions {
    PlanOptions { n_ctx, ..PlanOptions::default() }
}

#[test]
fn describe_reads_the_fixture_headers() {
    let d = describe(&common::fixture("llama")).unwrap();
    assert_eq!(d.source, SourceKind::GgufFile);
    assert_eq!(d.formats, vec![Format::Gguf]);
    assert_eq!(d.architecture.as_deref(), Some("llama"));
    assert_eq!(d.task, Task::TextGeneration);
    assert_eq!(d.params_total, Some(LLAMA_PARAMS));
    assert_eq!(d.params_active, Some(LLAMA_PARAMS));
    let types: Vec<(&str, usize, u64)> =
        d.quant_types.iter().map(|q| (q.dtype.as_str(), q.n_tensors, q.size_bytes)).collect();
    assert_eq!(types, vec![("F32", 5, 5120), ("Q4_0", 15, 737_280), ("Q6_K", 1, 107_520)]);
    assert_eq!(d.files.len(), 1);
    assert_eq!(d.files[0].size_bytes, std::fs::metadata(common::fixture("llama")).unwrap().len());
    assert!(!d.chat_template && d.thinking.is_none());
    let w = d.weights.as_ref().unwrap();
    assert_eq!((w.tensor_bytes, w.expert_bytes, w.kv_bytes_per_position), (LLAMA_TENSOR_BYTES, 0, LLAMA_KV_PER_POS));
    assert!(d.readers.iter().find(|r| r.backend == "cpu").unwrap().can_read);

    let m = describe(&common::fixture("qwen3_moe")).unwrap();
    assert_eq!(m.params_total, Some(MOE_PARAMS));
    assert_eq!(m.params_active, Some(MOE_PARAMS - MOE_EXPERT_PARAMS + MOE_EXPERT_PARAMS * 2 / 8));
    let w = m.weights.as_ref().unwrap();
    assert_eq!(
        (w.expert_bytes, w.expert_count, w.expert_used_count, w.kv_bytes_per_position),
        (MOE_EXPERT_BYTES, 8, 2, MOE_KV_PER_POS)
    );
    assert!(m.tags.contains(&"moe".to_string()));
}

#[test]
fn describe_finds_the_template_and_think_markers() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("chat.gguf");
    common::write_chat_fixture(&common::fixture("qwen3"), &p, common::CHATML_THINK, &[]);
    let d = describe(&p).unwrap();
    assert!(d.chat_template);
    let t = d.thinking.unwrap();
    assert_eq!(
        (t.open.as_str(), t.open_id, t.close.as_str(), t.close_id, t.in_template),
        ("<think>", 5, "</think>", 6, true)
    );
    assert!(d.tags.contains(&"thinking".to_string()) && d.tags.contains(&"chat".to_string()));
}

#[test]
fn cpu_wins_on_a_machine_without_gpu() {
    let d = describe(&common::fixture("llama")).unwrap();
    let p = plan_with(&d, &machine(8 * GIB, 20e9, None), &opts(256));
    assert_eq!(p.chosen, Some(BackendKind::Cpu));
    let cpu = p.backend(BackendKind::Cpu).estimate.clone().unwrap();
    assert_eq!(cpu.gpu_bytes, 0);
    assert!(cpu.ram_bytes > LLAMA_TENSOR_BYTES + LLAMA_KV_PER_POS * 256);
    // Dense: every weight, plus the KV cache at half the context, per token.
    assert_eq!(cpu.bytes_per_token, LLAMA_TENSOR_BYTES + LLAMA_KV_PER_POS * 128);
    assert_eq!(cpu.tok_per_sec, Some(20e9 / cpu.bytes_per_token as f64));
    let gpu = p.backend(BackendKind::Gpu).refusal.clone().unwrap();
    assert_eq!(gpu.code, Code::Gpu);
    for k in [BackendKind::GpuPaged, BackendKind::Hybrid] {
        assert_eq!(
            p.backend(k).refusal.as_ref().unwrap().code,
            Code::Model,
            "{k:?}: a dense model has no experts to page"
        );
    }
    assert!(p.summary_line().starts_with("plan: cpu"), "{}", p.summary_line());
}

#[test]
fn ram_budget_refuses_the_cpu_with_the_bytes_it_needs() {
    let d = describe(&common::fixture("llama")).unwrap();
    let p = plan_with(&d, &machine(1 << 20, 20e9, None), &opts(256));
    assert_eq!(p.chosen, None);
    let r = p.backend(BackendKind::Cpu).refusal.clone().unwrap();
    assert_eq!(r.code, Code::Ram);
    let need = r.need_bytes.unwrap();
    assert!(need > LLAMA_TENSOR_BYTES);
    assert_eq!(p.pick(None).unwrap_err().code(), "no_backend");
    assert_eq!(p.pick(Some(BackendKind::Cpu)).unwrap_err().code(), "budget");
    // The need is exact: that budget runs, one byte less does not. A --ram-budget overrides
    // what the machine has.
    let at =
        |b: u64| plan_with(&d, &machine(1 << 20, 20e9, None), &PlanOptions { ram_budget_bytes: Some(b), ..opts(256) });
    assert_eq!(at(need).chosen, Some(BackendKind::Cpu));
    assert_eq!(at(need - 1).backend(BackendKind::Cpu).refusal.as_ref().unwrap().code, Code::Ram);
}

#[cfg(feature = "gpu")]
#[test]
fn gpu_wins_when_the_model_fits_and_the_gpu_is_faster() {
    let d = describe(&common::fixture("llama")).unwrap();
    assert_eq!(d.weights.as_ref().unwrap().gpu_tensor_bytes, Some(LLAMA_GPU_BYTES));
    let p = plan_with(&d, &machine(8 * GIB, 20e9, Some(("DiscreteGpu", 4 * GIB, 500e9))), &opts(256));
    assert_eq!(p.chosen, Some(BackendKind::Gpu), "{}", p.reasons());
    let gpu = p.backend(BackendKind::Gpu).estimate.clone().unwrap();
    assert!(gpu.gpu_bytes > LLAMA_GPU_BYTES + LLAMA_KV_PER_POS * 256);
    assert_eq!(gpu.bytes_per_token, LLAMA_GPU_BYTES + LLAMA_KV_PER_POS * 128);
    assert!(p.backend(BackendKind::Cpu).is_ok(), "the CPU could run it too, slower");
    assert_eq!(p.gpu_budget.source, "device");
}

#[cfg(feature = "gpu")]
#[test]
fn a_slow_gpu_loses_to_the_cpu() {
    // A software renderer (lavapipe) reads memory slower than the CPU back end does.
    let d = describe(&common::fixture("llama")).unwrap();
    let p = plan_with(&d, &machine(8 * GIB, 20e9, Some(("Cpu", 8 * GIB, 5e9))), &opts(256));
    assert_eq!(p.chosen, Some(BackendKind::Cpu));
    assert!(p.backend(BackendKind::Gpu).is_ok());
}

#[cfg(feature = "gpu")]
#[test]
fn gpu_budget_refuses_with_the_bytes_it_needs() {
    let d = describe(&common::fixture("llama")).unwrap();
    let m = machine(8 * GIB, 20e9, Some(("DiscreteGpu", 4 * GIB, 500e9)));
    let with_budget = |b: u64| plan_with(&d, &m, &PlanOptions { budget_bytes: Some(b), ..opts(256) });
    let p = with_budget(LLAMA_GPU_BYTES);
    eprintln!("{}", serde_json::to_string(p.backend(BackendKind::Gpu)).unwrap());
    let r = p.backend(BackendKind::Gpu).refusal.clone().unwrap();
    assert_eq!(r.code, Code::Budget, "weights alone fill the budget; the cache does not fit");
    let need = r.need_bytes.unwrap();
    assert!(need > LLAMA_GPU_BYTES + LLAMA_KV_PER_POS * 256);
    assert_eq!(p.chosen, Some(BackendKind::Cpu), "the CPU takes over");
    assert_eq!(p.gpu_budget.source, "given");
    match p.pick(Some(BackendKind::Gpu)).unwrap_err() {
        plan::PlanError::BudgetTooSmall { what, need_bytes, budget_bytes, .. } => {
            assert_eq!((what, need_bytes, budget_bytes), ("gpu", need, LLAMA_GPU_BYTES))
        }
        e => panic!("{e}"),
    }
    assert_eq!(with_budget(need).chosen, Some(BackendKind::Gpu));
    assert_eq!(with_budget(need - 1).backend(BackendKind::Gpu).refusal.as_ref().unwrap().code, Code::Budget);
    // A longer context needs more.
    let long = plan_with(&d, &m, &PlanOptions { budget_bytes: Some(need), ..opts(4096) });
    let r = long.backend(BackendKind::Gpu).refusal.clone().unwrap();
    assert_eq!(r.need_bytes.unwrap() - need, LLAMA_KV_PER_POS * (4096 - 256));
}

#[cfg(feature = "gpu")]
#[test]
fn the_gpu_expert_tier_fits_a_budget_from_its_floor_up() {
    let d = describe(&common::fixture("qwen3_moe")).unwrap();
    let w = d.weights.clone().unwrap();
    let m = machine(8 * GIB, 20e9, Some(("DiscreteGpu", 4 * GIB, 500e9)));
    let with = |gpu: u64, ram: Option<u64>| {
        plan_with(&d, &m, &PlanOptions { budget_bytes: Some(gpu), ram_budget_bytes: ram, ..opts(256) })
    };
    // A budget below the dense part refuses, naming what it needs: the floor of the pool.
    let r = with(1 << 20, None).backend(BackendKind::GpuPaged).refusal.clone().unwrap();
    assert_eq!(r.code, Code::Budget);
    let need = r.need_bytes.unwrap();
    let dense = w.gpu_tensor_bytes.unwrap() - w.gpu_expert_bytes.unwrap();
    assert!(need > dense, "the need counts the dense weights and a pool");
    assert!(r.reason.contains("expert pool"), "{}", r.reason);
    assert_eq!(with(need - 1, None).backend(BackendKind::GpuPaged).refusal.as_ref().unwrap().code, Code::Budget);
    // At the floor it plans, within the budget; it estimates memory but no speed (this GPU's
    // host read rate is unknown), so the resident GPU, which fits too, stays the choice.
    let p = with(need, None);
    let e = p.backend(BackendKind::GpuPaged).estimate.clone().expect("fits at the floor");
    assert!(e.gpu_bytes <= need);
    assert_eq!(e.tok_per_sec, None);
    assert_eq!(e.disk_bytes, 0, "the host copy of every expert fits the RAM");
    assert!(e.ram_bytes >= w.gpu_expert_bytes.unwrap());
    // A RAM budget smaller than the experts: the rest is read from disk per token.
    let small_ram = with(need, Some(w.gpu_expert_bytes.unwrap() / 2));
    let e = small_ram.backend(BackendKind::GpuPaged).estimate.clone().expect("still fits the GPU");
    assert!(e.disk_bytes > 0);
    // With the link's and the disk's rates known, the disk's reads add their time.
    let mut m = m.clone();
    m.gpus[0].host_read_bytes_per_s = Some(40e9);
    m.disks = vec![plan::DiskInfo { path: ".".into(), free_bytes: 1, total_bytes: 1, read_bytes_per_s: Some(1e9) }];
    let opts =
        PlanOptions { budget_bytes: Some(need), ram_budget_bytes: Some(w.gpu_expert_bytes.unwrap() / 2), ..opts(256) };
    let e = plan_with(&d, &m, &opts).backend(BackendKind::GpuPaged).estimate.clone().unwrap();
    let gpu_secs = (e.bytes_per_token - e.host_bytes_per_token) as f64 / 500e9 + e.host_bytes_per_token as f64 / 40e9;
    let want = 1.0 / (gpu_secs + e.disk_bytes as f64 / 1e9);
    let got = e.tok_per_sec.expect("a speed with every rate known");
    assert!((got - want).abs() <= 1e-9 * want, "{got} tok/s, want {want}");
    assert_eq!(e.disk_read_bytes_per_s, Some(1e9));
}

#[cfg(feature = "gpu")]
#[test]
fn a_moe_model_too_large_for_the_gpu_gets_the_tier_flag_as_a_hint() {
    // The fixture has too few experts for a pool to be smaller than all of them (with the tier's
    // staging buffers its need is above the resident one).
    let d = many_experts();
    let m = machine(8 * GIB, 20e9, Some(("DiscreteGpu", 4 * GIB, 500e9)));
    let with = |gpu: u64| plan_with(&d, &m, &PlanOptions { budget_bytes: Some(gpu), ..opts(256) });
    let tiny = with(1 << 20);
    let resident_need = tiny.backend(BackendKind::Gpu).refusal.as_ref().unwrap().need_bytes.unwrap();
    let tier_need = tiny.backend(BackendKind::GpuPaged).refusal.as_ref().unwrap().need_bytes.unwrap();
    assert!(tier_need < resident_need, "the pool's floor is below every expert: {tier_need} vs {resident_need}");
    assert_eq!(tiny.gpu_tier_hint(), None, "neither fits: no hint");
    // Between the two: the resident GPU is refused for its budget, the tier fits.
    let p = with(tier_need);
    assert_eq!(p.chosen, Some(BackendKind::Cpu));
    let hint = p.gpu_tier_hint().expect("the tier fits where the model does not");
    let flag = format!("--gpu-budget {}M", tier_need >> 20);
    assert!(hint.contains(&flag), "{hint}");
    assert!(plan::parse_bytes(&format!("{}M", tier_need >> 20)).unwrap() <= tier_need, "the flag stays within it");
    // The whole model fits: the GPU is chosen and nothing is hinted.
    let p = with(resident_need);
    assert_eq!(p.chosen, Some(BackendKind::Gpu));
    assert_eq!(p.gpu_tier_hint(), None);
}

/// The qwen3_moe fixture with 64 times as many experts of the same size: a real MoE's
/// proportions (the fixture's 8 experts are too few for a pool smaller than all of them).
#[cfg(feature = "gpu")]
fn many_experts() -> plan::ModelDescription {
    let mut d = describe(&common::fixture("qwen3_moe")).unwrap();
    let w = d.weights.as_mut().unwrap();
    const MORE: u64 = 64;
    w.expert_count *= MORE as usize;
    w.tensor_bytes += (MORE - 1) * w.expert_bytes;
    w.expert_bytes *= MORE;
    let gpu_experts = w.gpu_expert_bytes.unwrap();
    *w.gpu_tensor_bytes.as_mut().unwrap() += (MORE - 1) * gpu_experts;
    w.gpu_expert_bytes = Some(MORE * gpu_experts);
    d
}

/// With the GPU's host read rate known the tier has a speed: a token reads its missed experts
/// (uniform routing: the share of experts the pool does not hold) at the host rate and the rest
/// at the GPU's; it is chosen when that beats the CPU, and not when the link is slower than the
/// CPU's own memory. A budget from the device's free memory leaves the driver a margin.
#[cfg(feature = "gpu")]
#[test]
fn the_gpu_expert_tier_is_chosen_when_its_host_reads_beat_the_cpu() {
    let d = many_experts();
    let w = d.weights.clone().unwrap();
    let with_link = |host_read: f64| {
        let mut m = machine(8 * GIB, 20e9, Some(("DiscreteGpu", 4 * GIB, 500e9)));
        m.gpus[0].host_read_bytes_per_s = Some(host_read);
        m.gpus[0].host_read_source = Some(Source::Given);
        m
    };
    let m = with_link(50e9);
    let tiny = plan_with(&d, &m, &PlanOptions { budget_bytes: Some(1 << 20), ..opts(256) });
    let floor = tiny.backend(BackendKind::GpuPaged).refusal.as_ref().unwrap().need_bytes.unwrap();
    let p = plan_with(&d, &m, &PlanOptions { budget_bytes: Some(floor), ..opts(256) });
    assert_eq!(p.backend(BackendKind::Gpu).refusal.as_ref().map(|r| r.code), Some(Code::Budget));
    let e = p.backend(BackendKind::GpuPaged).estimate.clone().expect("fits at its floor");
    // At the floor the pool holds 3 x top-k of the model's experts.
    let n_experts = (w.expert_count * w.n_layers) as f64;
    let held = (3 * w.expert_used_count) as f64 / n_experts;
    let active = (w.gpu_expert_bytes.unwrap() * w.expert_used_count as u64 / w.expert_count as u64) as f64;
    let want_missed = active * (1.0 - held);
    assert!((e.host_bytes_per_token as f64 - want_missed).abs() <= 1.0, "{} vs {want_missed}", e.host_bytes_per_token);
    assert_eq!(e.host_read_bytes_per_s, Some(50e9));
    let tok = e.tok_per_sec.expect("a speed with a host read rate");
    let secs = (e.bytes_per_token - e.host_bytes_per_token) as f64 / 500e9 + e.host_bytes_per_token as f64 / 50e9;
    assert!((tok - 1.0 / secs).abs() < 1e-6 * tok, "{tok} vs {}", 1.0 / secs);
    let cpu = p.backend(BackendKind::Cpu).estimate.as_ref().and_then(|e| e.tok_per_sec).unwrap();
    assert!(tok > cpu, "the link (50 GB/s) beats the CPU's RAM (20 GB/s): {tok} vs {cpu}");
    assert_eq!(p.chosen, Some(BackendKind::GpuPaged));
    assert_eq!(p.gpu_tier_budget(), Some(floor), "a given budget is the tier's");
    assert_eq!(p.gpu_tier_hint(), None, "the tier starts by itself: no hint");
    assert!(p.summary_line().starts_with("plan: gpu_paged"), "{}", p.summary_line());
    // A link slower than the CPU's memory: the CPU runs it, and the flag is hinted.
    let slow = plan_with(&d, &with_link(5e9), &PlanOptions { budget_bytes: Some(floor), ..opts(256) });
    assert_eq!(slow.chosen, Some(BackendKind::Cpu));
    assert!(slow.gpu_tier_hint().is_some());
    // No budget given: the device's free memory less a twentieth, at least 512 MiB.
    let free = plan_with(&d, &m, &opts(256));
    assert_eq!(free.gpu_budget.source, "device");
    assert_eq!(free.gpu_tier_budget(), Some(4 * GIB - 512 * MIB));
}

/// The planner's slot is the GPU expert tier's: the pool's floor it reports is the one
/// `run --gpu-budget` asks for (the tier's placement, which refuses a zero budget with the
/// smallest pool it needs).
#[cfg(feature = "gpu")]
#[test]
fn the_planned_slot_is_the_tiers_slot() {
    let path = common::fixture("qwen3_moe");
    let w = describe(&path).unwrap().weights.unwrap();
    let model = gguf::GgufModel::open(&path).unwrap();
    let err = pager::placement::GpuPlacement::plan_on(&model, 0, 0, 0, &pager::placement::WgpuSizes).unwrap_err();
    let pager::PagerError::GpuBudgetTooSmall { min_pool_bytes, .. } = err else { panic!("{err}") };
    let floor_slots = (pager::MIN_SLOTS_PER_TOP_K * w.expert_used_count) as u64;
    assert_eq!(w.gpu_slot_bytes.map(|s| s * floor_slots), Some(min_pool_bytes));
    // The average over experts and layers, which the planner used before, is below it.
    let average = w.gpu_expert_bytes.unwrap() / (w.expert_count * w.n_layers) as u64;
    assert!(average < w.gpu_slot_bytes.unwrap(), "{average} vs {:?}", w.gpu_slot_bytes);
}

#[cfg(not(feature = "gpu"))]
#[test]
fn gpu_tests_need_the_gpu_feature() {
    eprintln!("SKIPPED: the gpu planner tests need `--features gpu` (CI runs --all-features)");
    let d = describe(&common::fixture("llama")).unwrap();
    let p = plan_with(&d, &machine(8 * GIB, 20e9, Some(("DiscreteGpu", 4 * GIB, 500e9))), &opts(256));
    assert_eq!(p.backend(BackendKind::Gpu).refusal.as_ref().unwrap().code, Code::Gpu);
}

#[test]
fn moe_models_page_on_a_gpu_and_hybrid_is_not_a_back_end() {
    let d = describe(&common::fixture("qwen3_moe")).unwrap();
    let p = plan_with(&d, &machine(8 * GIB, 20e9, None), &opts(256));
    // No GPU on this machine (or none in the build): the GPU expert tier is refused for it.
    assert_eq!(p.backend(BackendKind::GpuPaged).refusal.as_ref().unwrap().code, Code::Gpu);
    let r = p.backend(BackendKind::Hybrid).refusal.clone().unwrap();
    assert_eq!(r.code, Code::Unimplemented);
    assert!(r.reason.contains("gpu_paged"), "{}", r.reason);
    // The CPU reads only the used experts' share per token.
    let e = p.backend(BackendKind::Cpu).estimate.clone().unwrap();
    let w = d.weights.unwrap();
    assert_eq!(e.bytes_per_token, w.tensor_bytes - MOE_EXPERT_BYTES + MOE_EXPERT_BYTES * 2 / 8 + MOE_KV_PER_POS * 128);
}

/// A minimal GGUF of architecture `arch` with an embedding table.
fn tiny_gguf(path: &std::path::Path, arch: &str) {
    use gguf::{GgmlType, GgufWriter, Value};
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String(arch.into()));
    w.set(&format!("{arch}.block_count"), Value::U32(1));
    w.set(&format!("{arch}.embedding_length"), Value::U32(8));
    w.set(&format!("{arch}.attention.head_count"), Value::U32(2));
    w.set(&format!("{arch}.context_length"), Value::U32(64));
    w.add_tensor("token_embd.weight", GgmlType::F32, &[8, 16]).unwrap();
    let mut sink = w.create(path).unwrap();
    sink.write_data(&[0u8; 8 * 16 * 4]).unwrap();
    sink.finish().unwrap();
}

#[test]
fn unknown_architectures_and_tasks_are_refused_with_their_codes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.gguf");
    tiny_gguf(&p, "nosucharch");
    let d = describe(&p).unwrap();
    let plan = plan_with(&d, &machine(8 * GIB, 20e9, None), &opts(0));
    assert_eq!(plan.n_ctx, 64, "the model's context when shorter than the cap");
    for b in &plan.backends {
        assert_eq!(b.refusal.as_ref().unwrap().code, Code::Model, "{:?}", b.backend);
    }
    assert_eq!(plan.pick(Some(BackendKind::Cpu)).unwrap_err().code(), "architecture");

    let e = dir.path().join("bert.gguf");
    tiny_gguf(&e, "bert");
    let d = describe(&e).unwrap();
    assert_eq!(d.task, Task::Embedding);
    let plan = plan_with(&d, &machine(8 * GIB, 20e9, None), &opts(0));
    assert!(plan.backends.iter().all(|b| b.refusal.as_ref().unwrap().code == Code::Task));

    let d = describe(&common::fixture("llama")).unwrap();
    let plan = plan_with(&d, &machine(8 * GIB, 20e9, None), &PlanOptions { task: Some(Task::Embedding), ..opts(0) });
    assert_eq!(plan.backend(BackendKind::Cpu).refusal.as_ref().unwrap().code, Code::Task);
}

#[test]
fn a_safetensors_folder_is_described_and_refused_for_its_format() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 2048}"#,
    )
    .unwrap();
    // A safetensors file: u64 header length, JSON header, data.
    let header = br#"{"a.weight":{"dtype":"BF16","shape":[4,8],"data_offsets":[0,64]},"b.bias":{"dtype":"F32","shape":[4],"data_offsets":[64,80]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 80]);
    std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
    std::fs::create_dir(dir.path().join("onnx")).unwrap();
    std::fs::write(dir.path().join("onnx/model.onnx"), b"not really").unwrap();
    let d = describe(dir.path()).unwrap();
    assert_eq!(d.source, SourceKind::Folder);
    assert_eq!(d.formats, vec![Format::Safetensors, Format::Onnx]);
    assert_eq!((d.architecture.as_deref(), d.hf_architecture.as_deref()), (Some("llama"), Some("LlamaForCausalLM")));
    assert_eq!((d.task, d.context_length, d.params_total), (Task::TextGeneration, Some(2048), Some(36)));
    assert_eq!(d.files.len(), 3);
    assert_eq!(
        d.total_size_bytes,
        bytes.len() as u64 + 10 + std::fs::metadata(dir.path().join("config.json")).unwrap().len()
    );
    let p = plan_with(&d, &machine(8 * GIB, 20e9, None), &opts(0));
    assert!(p.backends.iter().all(|b| b.refusal.as_ref().unwrap().code == Code::Format));
    assert_eq!(describe(&dir.path().join("onnx")).unwrap().formats, vec![Format::Onnx]);
}

#[test]
fn a_folder_with_gguf_files_plans_its_first_variant() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}"#)
        .unwrap();
    std::fs::copy(common::fixture("qwen3"), dir.path().join("b-q4_0.gguf")).unwrap();
    std::fs::copy(common::fixture("qwen3"), dir.path().join("a-q4_0.gguf")).unwrap();
    let d = describe(dir.path()).unwrap();
    assert_eq!(d.gguf_variants.len(), 2);
    assert_eq!(d.gguf.as_deref(), Some(dir.path().join("a-q4_0.gguf").as_path()));
    assert_eq!(d.architecture.as_deref(), Some("qwen3"));
    let p = plan_with(&d, &machine(8 * GIB, 20e9, None), &opts(0));
    assert_eq!(p.chosen, Some(BackendKind::Cpu));
}

#[test]
fn a_split_set_is_described_as_one_model() {
    use gguf::{GgufWriter, Value};
    let src = gguf::GgufModel::open(common::fixture("llama")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tensors: Vec<_> = src.tensors().collect();
    let half = tensors.len() / 2;
    for (no, part) in [&tensors[..half], &tensors[half..]].iter().enumerate() {
        let mut w = GgufWriter::new();
        if no == 0 {
            w.set_all(src.metadata());
        }
        w.set(gguf::KEY_SPLIT_NO, Value::U16(no as u16));
        w.set(gguf::KEY_SPLIT_COUNT, Value::U16(2));
        w.set(gguf::KEY_SPLIT_TENSORS_COUNT, Value::I32(tensors.len() as i32));
        for t in part.iter() {
            w.add_tensor(t.name(), t.dtype(), t.shape()).unwrap();
        }
        let mut sink = w.create(gguf::split_path(dir.path(), "m", no as u32, 2)).unwrap();
        for t in part.iter() {
            sink.write_data(t.data).unwrap();
        }
        sink.finish().unwrap();
    }
    let d = describe(&gguf::split_path(dir.path(), "m", 1, 2)).unwrap();
    assert_eq!(d.source, SourceKind::GgufSplit);
    assert_eq!(d.files.len(), 2);
    assert_eq!(d.params_total, Some(LLAMA_PARAMS));
    assert_eq!(d.weights.unwrap().tensor_bytes, LLAMA_TENSOR_BYTES);
}

/// A mixture of experts larger than the RAM budget runs on the CPU with its experts paged from
/// disk: the refusal's need is the paged one (dense part, KV cache, scratch and the cache's
/// floor of 3 x top-k slots), far below the whole model's; at that budget the plan gives the
/// cache's budget, which opens a pager of exactly the floor's slots, and the misses' disk bytes.
#[test]
fn a_moe_model_larger_than_the_ram_pages_its_experts_on_the_cpu() {
    let path = common::fixture("qwen3_moe");
    let d = describe(&path).unwrap();
    let w = d.weights.clone().unwrap();
    let at = |ram: u64| plan_with(&d, &machine(ram, 20e9, None), &opts(256));
    // Enough RAM for the whole model: used in place, nothing paged.
    let whole = at(64 * GIB).backend(BackendKind::Cpu).estimate.clone().unwrap();
    assert_eq!((whole.expert_cache_bytes, whole.disk_bytes), (None, 0));
    let r = at(1 << 20).backend(BackendKind::Cpu).refusal.clone().expect("1 MiB holds nothing");
    assert_eq!(r.code, Code::Ram);
    let need = r.need_bytes.unwrap();
    assert!(need < whole.ram_bytes, "the paged need {need} is below the whole model's {}", whole.ram_bytes);
    assert!(r.reason.contains("paged from disk"), "{}", r.reason);
    let p = at(need);
    assert_eq!(p.chosen, Some(BackendKind::Cpu));
    let e = p.backend(BackendKind::Cpu).estimate.clone().unwrap();
    let cache = e.expert_cache_bytes.expect("the experts are paged");
    assert!(e.ram_bytes <= need && e.disk_bytes > 0, "{e:?}");
    let model = std::sync::Arc::new(gguf::GgufModel::open(&path).unwrap());
    let pager = pager::Pager::open(&model, &pager::PagerOptions::new(cache, pager::CachePolicy::Lfu)).unwrap();
    assert_eq!(pager.n_slots(), 3 * w.expert_used_count, "the planned cache is the floor's");
    assert!(pager.accounted_bytes() <= cache);
    assert_eq!(at(need - 1).backend(BackendKind::Cpu).refusal.as_ref().map(|r| r.code), Some(Code::Ram));
    // Speed: none without a disk rate; with one, each token's memory time (20 GB/s) plus its
    // misses' disk time (1 GB/s), below the speed of the same bytes from memory alone.
    assert_eq!((e.tok_per_sec, e.disk_read_bytes_per_s), (None, None));
    let mut m = machine(need, 20e9, None);
    m.disks = vec![plan::DiskInfo {
        path: ".".into(),
        free_bytes: 1 << 40,
        total_bytes: 1 << 40,
        read_bytes_per_s: Some(1e9),
    }];
    let e = plan_with(&d, &m, &opts(256)).backend(BackendKind::Cpu).estimate.clone().unwrap();
    let want = 1.0 / (e.bytes_per_token as f64 / 20e9 + e.disk_bytes as f64 / 1e9);
    let got = e.tok_per_sec.expect("a speed with the disk's rate");
    assert!((got - want).abs() <= 1e-9 * want, "{got} tok/s, want {want}");
    assert!(got < 20e9 / e.bytes_per_token as f64, "{got}");
    assert_eq!(e.disk_read_bytes_per_s, Some(1e9));
}
