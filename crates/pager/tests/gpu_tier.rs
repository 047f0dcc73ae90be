//! The GPU expert tier (`WgpuBackend::with_expert_store`) on the MoE fixtures, on whatever adapter
//! wgpu finds (Mesa's lavapipe in CI): experts come from the pager's RAM tier, which reads them
//! from the file.
//!
//! Per case:
//! - a budget placed by `GpuPlacement::plan_on(.., WgpuSizes)` at exactly the planner's floor
//!   (3 × top-k slots): the run passes the reference check (`models::refcheck`: llama.cpp /
//!   transformers logits and greedy ids, the tolerances the GPU fixtures use); on a fresh device
//!   its greedy ids equal the resident CPU run's and the device memory its allocator holds
//!   (every block taken from the driver: dense weights, KV cache, pool, staging, scratch and
//!   the blocks' unused ends) stays within the budget;
//! - one slot, uploads only: every decode step evicts, greedy ids equal the resident CPU run's;
//! - one slot, misses computed on the CPU (the pool never changes), and the automatic choice:
//!   greedy ids equal the resident CPU run's;
//! - misses read by the GPU from the host tier (`MissPolicy::Host`: no wait per layer, the pool
//!   refilled between steps): at the floor budget (with the slot table's reserve) greedy ids
//!   equal the resident CPU run's and the device memory (the allocator's blocks less the host
//!   tier's buffers, which live in host memory) stays within the budget; with one slot every decode
//!   step from the second on evicts (when it starts, with the previous step's misses) and
//!   greedy ids equal the CPU's.
//!
//! Runs one variant per MoE architecture of the full ../shared set when present, else of the
//! compact committed subset: q4_k_m where there is one (mixed Q4_K / Q6_K experts exercise the
//! slot padding), else q4_0.
//! No adapter is a failure unless `DISKFORMER_NO_GPU=1`. Needs `--features gpu`.

#[cfg(not(feature = "gpu"))]
#[test]
fn gpu_tier_needs_the_gpu_feature() {
    println!("gpu_tier: pager was built without the gpu feature; run with --features gpu (CI uses --all-features)");
}

#[cfg(feature = "gpu")]
mod on_gpu {
    use compute::wgpu::{ExpertTierOptions, MissPolicy, SlotPolicy, WgpuBackend, WgpuOptions};
    use gguf::GgufModel;
    use models::refcheck::{argmax, check_with, fixture_root, format_row, gguf_arch, list_cases};
    use models::{load, load_on, LoadOptions, Outputs, Runner, SUPPORTED_ARCHITECTURES};
    use pager::placement::{activation_scratch_bytes, WgpuSizes};
    use pager::{CachePolicy, GpuPlacement, MappedExperts, Pager, PagerOptions};
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    /// Decode steps compared with the resident run.
    const N_STEPS: usize = 5;
    /// Context of the runs (small: the KV cache is part of the budget).
    const N_CTX: usize = 64;

    fn gpu() -> Option<WgpuBackend> {
        let index = std::env::var("DISKFORMER_GPU").ok().and_then(|v| v.parse().ok());
        match WgpuBackend::new(WgpuOptions { adapter_index: index, prefer_discrete: true }) {
            Ok(b) => Some(b),
            Err(e) if std::env::var("DISKFORMER_NO_GPU").is_ok_and(|v| v == "1") => {
                println!("gpu tier: not run: DISKFORMER_NO_GPU=1 and no adapter ({e})");
                None
            }
            Err(e) => panic!("{e}\n(set DISKFORMER_NO_GPU=1 only on a machine that has no GPU or software Vulkan)"),
        }
    }

    /// Device memory a back end holds (all blocks its allocator took from the driver, the
    /// unused ends included: what the budget must cover), and the part of it in buffers.
    fn device_memory(b: &WgpuBackend) -> (u64, u64) {
        let in_buffers = b.device_buffer_bytes();
        let reserved = b.device_reserved_bytes().expect("a Vulkan adapter reports its allocator's blocks");
        assert!(reserved >= in_buffers, "the allocator holds {reserved} B, less than its buffers' {in_buffers} B");
        (reserved, in_buffers)
    }

    /// One variant per MoE architecture: q4_k_m when present, else q4_0, else the first listed.
    fn moe_cases() -> (PathBuf, Vec<(String, String, PathBuf)>) {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let (root, full) = fixture_root(&repo);
        println!(
            "fixture set: {} ({})",
            root.display(),
            if full { "full shared set" } else { "compact committed subset" }
        );
        let mut by_arch: Vec<(String, Vec<String>)> = Vec::new();
        for (arch, v) in list_cases(&root).expect("fixtures readable") {
            match by_arch.iter_mut().find(|(a, _)| *a == arch) {
                Some((_, vs)) => vs.push(v),
                None => by_arch.push((arch, vec![v])),
            }
        }
        let mut out = Vec::new();
        for (arch, variants) in by_arch {
            let ga = gguf_arch(&root, &arch).expect("ref.json readable");
            if !SUPPORTED_ARCHITECTURES.contains(&ga.as_str()) {
                continue;
            }
            let v = ["q4_k_m", "q4_0"]
                .iter()
                .find(|p| variants.iter().any(|v| v == *p))
                .map_or_else(|| variants[0].clone(), |p| p.to_string());
            let path = root.join(&arch).join(format!("model-{v}.gguf"));
            let Ok(model) = GgufModel::open(&path) else { continue };
            if model.tensors().any(|t| t.name().ends_with("ffn_up_exps.weight")) {
                out.push((arch, v, path));
            }
        }
        (root, out)
    }

    fn opts() -> LoadOptions {
        LoadOptions { n_ctx: N_CTX, ..LoadOptions::default() }
    }

    /// `device` (a clone: same device and pipelines) with a tier of `n_slots` over a two-slot RAM
    /// tier.
    fn tiered(
        device: &WgpuBackend,
        model: &Arc<GgufModel>,
        n_slots: usize,
        slot_bytes: u64,
        miss: MissPolicy,
    ) -> WgpuBackend {
        // The split runs without a RAM budget, over the model's map, as `plan::tier` wires it.
        let store: Arc<dyn compute::ExpertStore> = if miss == MissPolicy::Split {
            Arc::new(MappedExperts::open(model).expect("experts indexed"))
        } else {
            let ram = Pager::budget_for_slots(model, 2).expect("experts indexed");
            Arc::new(Pager::open(model, &PagerOptions::new(ram, CachePolicy::Lru)).expect("pager opens"))
        };
        let policy = if n_slots == 1 { SlotPolicy::Lru } else { SlotPolicy::Lfu };
        let topts = ExpertTierOptions { miss, policy, ..ExpertTierOptions::new(n_slots, slot_bytes) };
        device.clone().with_expert_store(store, topts).expect("tier builds")
    }

    /// Greedy decoding, asserting after each decode step from `from` on that the tier (when
    /// given) evicted. The host tier refills its pool with a step's misses when the next step
    /// starts, so its first decode step evicts only if the prompt left misses.
    fn greedy_ids(runner: &mut dyn Runner, prompt: &[u32], tier: Option<(&WgpuBackend, usize)>) -> Vec<u32> {
        let n_vocab = runner.hparams().n_vocab;
        let mut logits = runner.eval(prompt, Outputs::Last).expect("prompt evaluates");
        let mut ids = Vec::new();
        for step in 0..N_STEPS {
            let id = argmax(&logits[logits.len() - n_vocab..]);
            ids.push(id);
            let tier = tier.filter(|&(_, from)| step >= from).map(|t| t.0);
            let before = tier.map(|t| t.expert_tier_total().unwrap_or_default().evictions);
            logits = runner.eval(&[id], Outputs::Last).expect("step evaluates");
            if let (Some(t), Some(before)) = (tier, before) {
                let after = t.expert_tier_total().unwrap_or_default().evictions;
                assert!(after > before, "decode step {step} evicted nothing");
            }
        }
        ids.push(argmax(&logits[logits.len() - n_vocab..]));
        ids
    }

    #[test]
    fn gpu_tier_matches_references_and_cpu_within_budget() {
        if gpu().is_none() {
            return;
        }
        let (root, cases) = moe_cases();
        assert!(!cases.is_empty(), "no MoE fixtures under {}", root.display());
        let prompt = [1u32, 17, 42, 7, 99];
        let mut failures = Vec::new();
        for (arch, variant, path) in &cases {
            let model = Arc::new(GgufModel::open(path).expect("opens"));
            let facts = plan::describe(path).expect("describes").weights.expect("weight facts");
            let kv = facts.kv_bytes_per_position * N_CTX as u64 + facts.recurrent_state_bytes;
            // Scratch: activations for a prompt batch, plus the staging ring (sized from the slot).
            let floor = GpuPlacement::plan_on(&model, u64::MAX / 4, kv, 0, &WgpuSizes).expect("plans");
            let staging = ExpertTierOptions::new(1, floor.slot_bytes).staging_total_bytes();
            let scratch = activation_scratch_bytes(&model, 64) + staging;
            // `floor.scratch_bytes` is the back end's fixed buffers (the plan adds them to any scratch).
            let at_floor =
                floor.dense_bytes + kv + scratch + floor.scratch_bytes + floor.min_slots as u64 * floor.slot_bytes;
            let placed = GpuPlacement::plan_on(&model, at_floor, kv, scratch, &WgpuSizes).expect("the floor fits");
            assert_eq!(placed.n_slots, placed.min_slots, "{arch}: a floor budget gives the floor");
            assert!(GpuPlacement::plan_on(&model, at_floor - 1, kv, scratch, &WgpuSizes).is_err());

            // 1. The floor budget: the reference check.
            let r = check_with(&root, arch, variant, |m| {
                let device = gpu().expect("adapter found above");
                load_on(tiered(&device, m, placed.n_slots, placed.slot_bytes, MissPolicy::Upload), m, &opts())
            });
            println!("{} [GPU tier at the floor: {} slots]", format_row(&r), placed.n_slots);
            if !r.pass {
                failures.push(format!("{arch} {variant}: floor budget: {}", format_row(&r)));
            }

            // 2. The floor budget again on a fresh device, so that its memory counts this run
            // alone: greedy ids equal the resident CPU run's, device memory within the budget
            // while the model is loaded.
            let mut resident = load(&model, &opts()).expect("loads on the CPU");
            let want = greedy_ids(resident.as_mut(), &prompt, None);
            let device = gpu().expect("adapter found above");
            let b = tiered(&device, &model, placed.n_slots, placed.slot_bytes, MissPolicy::Upload);
            let mut runner = load_on(b.clone(), &model, &opts()).expect("loads on the tier");
            // Right after the load, before any step submits: staging copies of the weights
            // still alive would show here (wgpu kept one per weight until the next submit).
            let (after_load, _) = device_memory(&b);
            if after_load > at_floor {
                failures.push(format!(
                    "{arch} {variant}: device memory after loading {after_load} B against a budget of {at_floor} B"
                ));
            }
            let got = greedy_ids(runner.as_mut(), &prompt, None);
            b.sync();
            let (used, in_buffers) = device_memory(&b);
            let t = b.expert_tier_total().unwrap_or_default();
            println!(
                "{arch} {variant} floor {} slots: {} hits, {} uploads, {} evictions; device memory {used} B ({in_buffers} B in buffers) of budget {at_floor} B; ids {}",
                placed.n_slots,
                t.hits,
                t.uploads,
                t.evictions,
                if got == want { "== cpu" } else { "DIFFER" }
            );
            if got != want {
                failures.push(format!("{arch} {variant} floor: greedy {got:?} != cpu {want:?}"));
            }
            if used == 0 || used > at_floor {
                failures.push(format!("{arch} {variant}: device memory {used} B against a budget of {at_floor} B"));
            }
            drop(runner);
            drop(b);

            // 3. The host tier at its floor budget (the slot table's reserve added to scratch),
            // on a fresh device.
            let host_scratch = scratch + compute::wgpu::host_tier_table_reserve_bytes(floor.n_experts_total);
            let host_budget =
                floor.dense_bytes + kv + host_scratch + floor.scratch_bytes + floor.min_slots as u64 * floor.slot_bytes;
            let hplaced = GpuPlacement::plan_on(&model, host_budget, kv, host_scratch, &WgpuSizes).expect("fits");
            let device = gpu().expect("adapter found above");
            let b = tiered(&device, &model, hplaced.n_slots, hplaced.slot_bytes, MissPolicy::Host);
            let mut runner = load_on(b.clone(), &model, &opts()).expect("loads on the tier");
            let got = greedy_ids(runner.as_mut(), &prompt, None);
            b.sync();
            let host_bytes = b.expert_host_tier_bytes().unwrap_or(0);
            // Host buffers wgpu's allocator made (the id log) are in its count; the mapped copies are not.
            let used = device_memory(&b).0.saturating_sub(b.expert_host_tier_allocator_bytes().unwrap_or(0));
            let t = b.expert_tier_total().unwrap_or_default();
            println!(
                "{arch} {variant} host tier, floor {} slots: {} hits, {} host reads, {} uploads, {} evictions; device memory {used} B of budget {host_budget} B, host tier {host_bytes} B; ids {}",
                hplaced.n_slots,
                t.hits,
                t.host_reads,
                t.uploads,
                t.evictions,
                if got == want { "== cpu" } else { "DIFFER" }
            );
            if got != want {
                failures.push(format!("{arch} {variant} host tier floor: greedy {got:?} != cpu {want:?}"));
            }
            if used == 0 || used > host_budget || host_bytes == 0 {
                failures.push(format!(
                    "{arch} {variant}: host tier: device memory {used} B against a budget of {host_budget} B (host {host_bytes} B)"
                ));
            }
            drop(runner);
            drop(b);

            // 4-8. One slot: uploads (evicting every step), CPU, automatic, host tier and split (evicting
            // every step too, between steps).
            for miss in [MissPolicy::Upload, MissPolicy::Cpu, MissPolicy::Auto, MissPolicy::Host, MissPolicy::Split] {
                let b = tiered(&device, &model, 1, placed.slot_bytes, miss);
                let mut runner = load_on(b.clone(), &model, &opts()).expect("loads on the tier");
                let evicts_from = match miss {
                    MissPolicy::Upload => Some(0),
                    MissPolicy::Host | MissPolicy::Split => Some(1),
                    _ => None,
                };
                let got = greedy_ids(runner.as_mut(), &prompt, evicts_from.map(|from| (&b, from)));
                let t = b.expert_tier_total().unwrap_or_default();
                println!(
                    "{arch} {variant} 1 slot {miss:?}: {} selections, {} hits, {} uploads, {} cpu, {} evictions: ids {}",
                    t.selections,
                    t.hits,
                    t.uploads,
                    t.cpu_computed,
                    t.evictions,
                    if got == want { "== cpu" } else { "DIFFER" }
                );
                assert_eq!(t.hits + t.misses, t.selections, "{arch}: every selection is a hit or a miss");
                match miss {
                    // A prefill's misses take the upload path; a decode step's are read from host
                    // memory, and refilled between steps.
                    MissPolicy::Host => assert_eq!(
                        t.host_reads + t.uploads - t.refills,
                        t.misses,
                        "{arch}: every miss is read from host memory or uploaded by a prefill"
                    ),
                    MissPolicy::Split => assert_eq!(
                        t.host_reads + t.cpu_computed + t.uploads - t.refills,
                        t.misses,
                        "{arch}: every miss is read from host memory, computed on the CPU or uploaded by a prefill"
                    ),
                    _ => assert_eq!(t.uploads + t.cpu_computed, t.misses, "{arch}: every miss is uploaded or computed"),
                }
                match miss {
                    MissPolicy::Upload => assert_eq!(t.cpu_computed, 0),
                    MissPolicy::Cpu => {
                        assert_eq!((t.uploads, t.evictions), (1, 0), "{arch}: the free slot is filled, nothing evicted")
                    }
                    MissPolicy::Auto => assert!(t.cpu_computed > 0, "{arch}: the CPU cost is measured on first use"),
                    MissPolicy::Host => assert_eq!(t.cpu_computed, 0),
                    MissPolicy::Split => assert!(t.cpu_computed > 0, "{arch}: the CPU computes a share of the misses"),
                }
                if got != want {
                    failures.push(format!("{arch} {variant} 1 slot {miss:?}: greedy {got:?} != cpu {want:?}"));
                }
            }
        }
        println!("{} MoE cases ran on the GPU tier", cases.len());
        assert!(failures.is_empty(), "GPU tier failures:\n{}", failures.join("\n"));
    }
}
