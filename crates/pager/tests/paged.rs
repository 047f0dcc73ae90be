//! Paged experts on every MoE fixture: with a RAM budget of one slot (LRU) and of three slots
//! (LFU), so that every decode step evicts, the CPU back end must still match the references
//! (transformers / llama.cpp, through `models::refcheck`) with equal greedy ids, and give logits
//! bit-identical to the resident run at every step. Runs the full ../shared/fixtures set when
//! present, else the compact committed subset, and says which.

use compute::cpu::CpuBackend;
use compute::ExpertStore;
use gguf::GgufModel;
use models::refcheck::{argmax, check_with, fixture_root, format_row, list_cases};
use models::{load_on, LoadOptions, Outputs, Runner, SUPPORTED_ARCHITECTURES};
use pager::{CachePolicy, Pager, PagerOptions};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Decode steps compared bit for bit with the resident run.
const N_STEPS: usize = 6;

fn moe_cases() -> (PathBuf, Vec<(String, String, PathBuf)>) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (root, full) = fixture_root(&repo);
    println!("fixture set: {} ({})", root.display(), if full { "full shared set" } else { "compact committed subset" });
    let mut out = Vec::new();
    for (arch, variant) in list_cases(&root).expect("fixtures readable") {
        let gguf_arch = models::refcheck::gguf_arch(&root, &arch).expect("ref.json readable");
        if !SUPPORTED_ARCHITECTURES.contains(&gguf_arch.as_str()) {
            continue;
        }
        let path = root.join(&arch).join(format!("model-{variant}.gguf"));
        let Ok(model) = GgufModel::open(&path) else { continue };
        if model.tensors().any(|t| t.name().ends_with("ffn_up_exps.weight")) {
            out.push((arch, variant, path));
        }
    }
    (root, out)
}

fn paged_runner(model: &Arc<GgufModel>, n_slots: usize, policy: CachePolicy) -> (Box<dyn Runner>, Arc<Pager>) {
    let budget = Pager::budget_for_slots(model, n_slots).expect("experts indexed");
    let pager = Arc::new(Pager::open(model, &PagerOptions::new(budget, policy)).expect("pager opens"));
    assert_eq!(pager.n_slots(), n_slots, "budget_for_slots({n_slots}) gives {n_slots} slots");
    assert!(pager.accounted_bytes() <= budget);
    let b = CpuBackend::default().with_expert_store(pager.clone());
    (load_on(b, model, &LoadOptions::default()).expect("model loads"), pager)
}

#[test]
fn paged_experts_match_references_on_every_moe_fixture() {
    let (root, cases) = moe_cases();
    assert!(!cases.is_empty(), "no MoE fixtures under {}", root.display());
    let mut failures = Vec::new();
    for (arch, variant, _) in &cases {
        for (n_slots, policy) in [(1, CachePolicy::Lru), (3, CachePolicy::Lfu)] {
            let pager_seen: Mutex<Option<Arc<Pager>>> = Mutex::new(None);
            let r = check_with(&root, arch, variant, |model| {
                let (runner, pager) = paged_runner(model, n_slots, policy);
                *pager_seen.lock().unwrap() = Some(pager);
                Ok(runner)
            });
            let stats = pager_seen.lock().unwrap().as_ref().map(|p| p.total_stats()).unwrap_or_default();
            println!(
                "{} [{n_slots} slot(s), {policy:?}: {} misses, {} evictions]",
                format_row(&r),
                stats.misses,
                stats.evictions
            );
            if !r.pass || stats.evictions == 0 {
                failures.push(format!("{} with {n_slots} slot(s) {policy:?}", format_row(&r)));
            }
        }
    }
    println!("{} MoE cases ran, two budgets each", cases.len());
    assert!(failures.is_empty(), "paged runs failing:\n{}", failures.join("\n"));
}

/// Greedy decoding that records every step's logits, checking after each decode step that the
/// pager (when given) evicted something during it.
fn greedy_logits(runner: &mut dyn Runner, prompt: &[u32], pager: Option<&Pager>) -> Vec<Vec<f32>> {
    let n_vocab = runner.hparams().n_vocab;
    let mut logits = runner.eval(prompt, Outputs::Last).expect("prompt evaluates");
    let mut all = vec![logits.clone()];
    for step in 0..N_STEPS {
        let before = pager.map(|p| p.total_stats().evictions);
        let id = argmax(&logits[logits.len() - n_vocab..]);
        logits = runner.eval(&[id], Outputs::Last).expect("step evaluates");
        if let (Some(p), Some(before)) = (pager, before) {
            assert!(p.total_stats().evictions > before, "decode step {step} evicted nothing");
        }
        all.push(logits.clone());
    }
    all
}

#[test]
fn paged_logits_are_bit_identical_to_resident_and_every_step_evicts() {
    let (_, cases) = moe_cases();
    assert!(!cases.is_empty());
    let prompt = [1u32, 17, 42, 7, 99];
    for (arch, variant, path) in &cases {
        let model = Arc::new(GgufModel::open(path).expect("opens"));
        let mut resident = load_on(CpuBackend::default(), &model, &LoadOptions::default()).expect("loads");
        let want = greedy_logits(resident.as_mut(), &prompt, None);
        for (n_slots, policy) in [(1, CachePolicy::Lru), (2, CachePolicy::Lfu)] {
            let (mut runner, pager) = paged_runner(&model, n_slots, policy);
            // One slot against k ≥ 2 experts per token evicts at every step by construction; two
            // slots may keep a step's experts (tiny fixtures repeat them), so only count there.
            let got = greedy_logits(runner.as_mut(), &prompt, (n_slots == 1).then_some(&*pager));
            for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{arch} {variant} {n_slots} slot(s) {policy:?}: logits differ at step {step}");
            }
            let t = pager.total_stats();
            assert_eq!(t.hits + t.misses, t.selections, "{arch} {variant}: every selection is a hit or a miss");
            assert_eq!(t.cpu_computed, t.selections, "{arch} {variant}: every selected expert is computed");
            assert!(t.evictions > 0, "{arch} {variant}: {n_slots} slot(s) {policy:?} never evicted");
        }
        println!("{arch} {variant}: paged logits bit-identical to resident over {N_STEPS} steps");
    }
}

/// Under LFU a prompt's batch weighs each expert by the tokens that chose it
/// (`with_host_experts_of_tokens`, as the CPU back end calls it), so the slots favour its
/// popular experts afterwards. Four slots, a batch over a layer's eight experts in id order
/// (its last group leaves 4-7 in the slots, loaded together), 4 and 5 chosen by most of its
/// tokens; then a decode call of 0 and 1, which must evict two of the four, and one of 4 and 5.
/// Weighed by tokens, 6 and 7 go and the last call finds both; one point per expert
/// (`with_host_experts`) left the four alike, and the evictions went by slot order instead (the
/// last call found none on this code).
#[test]
fn a_prompt_batch_ranks_the_ram_slots_by_its_tokens() {
    let (_, cases) = moe_cases();
    let (model, n_expert) = cases
        .iter()
        .find_map(|(_, _, path)| {
            let model = Arc::new(GgufModel::open(path).ok()?);
            let n_expert = *model.tensors().find(|t| t.name() == "blk.0.ffn_up_exps.weight")?.shape().last()? as usize;
            (n_expert == 8).then_some((model, n_expert))
        })
        .expect("a MoE fixture with 8 experts in layer 0");
    let all: Vec<u32> = (0..n_expert as u32).collect();
    let popular = [4u32, 5];
    let tokens: Vec<u32> = all.iter().map(|e| if popular.contains(e) { 40 } else { 1 }).collect();
    let mut found = Vec::new();
    for weighed in [true, false] {
        let budget = Pager::budget_for_slots(&model, 4).expect("experts indexed");
        let pager = Pager::open(&model, &PagerOptions::new(budget, CachePolicy::Lfu)).expect("pager opens");
        assert_eq!(pager.n_slots(), 4);
        let mut ignore = |_: &[compute::HostExpert<'_>]| Ok(());
        if weighed {
            pager.with_host_experts_of_tokens(0, &all, &tokens, 48, &mut ignore).expect("prompt");
        } else {
            pager.with_host_experts(0, &all, &mut ignore).expect("prompt");
        }
        pager.with_host_experts(0, &[0, 1], &mut ignore).expect("decode");
        let before = pager.total_stats().hits;
        pager.with_host_experts(0, &popular, &mut ignore).expect("decode");
        found.push(pager.total_stats().hits - before);
    }
    println!("popular experts found after a cold decode call: weighed {}, one point each {}", found[0], found[1]);
    assert_eq!(found[0], 2, "weighed by tokens, the batch's popular experts outlast the cold ones");
}

#[test]
fn a_budget_below_one_slot_is_a_typed_error_with_the_numbers() {
    let (_, cases) = moe_cases();
    let model = Arc::new(GgufModel::open(&cases[0].2).expect("opens"));
    let one = Pager::budget_for_slots(&model, 1).expect("indexed");
    match Pager::open(&model, &PagerOptions::new(one - 1, CachePolicy::Lru)) {
        Err(pager::PagerError::BudgetTooSmall { budget_bytes, needed_bytes, slot_bytes, .. }) => {
            assert_eq!(budget_bytes, one - 1);
            assert_eq!(needed_bytes, one);
            assert!(slot_bytes > 0);
        }
        other => panic!("expected BudgetTooSmall, got {other:?}"),
    }
    let dense = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama/model-q4_0.gguf");
    let dense = Arc::new(GgufModel::open(&dense).expect("llama fixture opens"));
    assert!(matches!(
        Pager::open(&dense, &PagerOptions::new(1 << 30, CachePolicy::Lru)),
        Err(pager::PagerError::NoExperts { .. })
    ));
}

/// Prefetch (a background thread reading the next layer's likely experts into the same slab) and
/// `O_DIRECT` reads (aligned slots) change where and when bytes are read, never the arithmetic:
/// logits stay bit-identical to the resident run, every selection is a hit or a miss, and the
/// prefetcher did read ahead.
#[test]
fn prefetch_and_direct_io_keep_logits_bit_identical() {
    let (_, cases) = moe_cases();
    assert!(!cases.is_empty());
    let prompt = [1u32, 17, 42, 7, 99];
    let mut prefetched_total = 0;
    for (arch, variant, path) in &cases {
        let model = Arc::new(GgufModel::open(path).expect("opens"));
        let mut resident = load_on(CpuBackend::default(), &model, &LoadOptions::default()).expect("loads");
        let want = greedy_logits(resident.as_mut(), &prompt, None);
        for (n_slots, policy, direct_io) in
            [(8, CachePolicy::Lru, true), (12, CachePolicy::Lfu, true), (8, CachePolicy::Lfu, false)]
        {
            let budget = Pager::budget_for_slots(&model, n_slots).expect("experts indexed");
            let opts = PagerOptions { prefetch: true, direct_io, ..PagerOptions::new(budget, policy) };
            let pager = Arc::new(Pager::open(&model, &opts).expect("pager opens"));
            assert!(pager.prefetches());
            assert!(pager.accounted_bytes() <= budget);
            if direct_io {
                match pager.direct_io_refused() {
                    None => assert!(pager.direct_io(), "O_DIRECT neither used nor refused"),
                    Some(why) => println!("{arch} {variant}: {why}"),
                }
            }
            let b = CpuBackend::default().with_expert_store(pager.clone());
            let mut runner = load_on(b, &model, &LoadOptions::default()).expect("model loads");
            let got = greedy_logits(runner.as_mut(), &prompt, None);
            for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                let same = g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{arch} {variant} {n_slots} slots {policy:?} prefetch, direct {direct_io}: step {step}");
            }
            let t = pager.total_stats();
            assert_eq!(t.hits + t.misses, t.selections, "{arch} {variant}: every selection is a hit or a miss");
            assert!(t.prefetch_hits <= t.prefetched && t.prefetch_hits <= t.hits);
            prefetched_total += t.prefetched;
            println!(
                "{arch} {variant}: {n_slots} slots {policy:?} direct {}: {} selections, {} hits ({} prefetched, {} of them used)",
                pager.direct_io(),
                t.selections,
                t.hits,
                t.prefetched,
                t.prefetch_hits
            );
        }
    }
    assert!(prefetched_total > 0, "the prefetcher never read ahead");
}

/// Every way a mapped store reaches its experts lends the file's bytes: the plain map, the
/// populated map and the huge-page copy give each expert's gate, up and down the same bytes,
/// in every layer of every MoE fixture, and each is the tensor's slice in the file.
#[test]
fn mapped_experts_lend_the_files_bytes_in_every_access() {
    use compute::ExpertStore;
    use pager::{MappedAccess, MappedExperts};
    let (_, cases) = moe_cases();
    assert!(!cases.is_empty(), "no MoE fixture found");
    for (arch, variant, path) in cases {
        let model = Arc::new(GgufModel::open(&path).expect("fixture opens"));
        let lend = |access: MappedAccess| -> Vec<Vec<u8>> {
            let store = MappedExperts::open_with(&model, access).expect("store opens");
            assert_eq!(store.access(), access);
            let mut out = Vec::new();
            for layer in 0..64 {
                let name = format!("blk.{layer}.ffn_up_exps.weight");
                let Some((_, info)) = model.tensor_location(&name) else { continue };
                let ids: Vec<u32> = (0..info.shape[2] as u32).rev().collect();
                store
                    .with_host_experts(layer, &ids, &mut |group| {
                        for e in group {
                            for m in e.gate.iter().chain([&e.up, &e.down]) {
                                out.push(m.bytes.to_vec());
                            }
                        }
                        Ok(())
                    })
                    .expect("experts lent");
            }
            out
        };
        let mapped = lend(MappedAccess::Map);
        assert!(!mapped.is_empty(), "{arch} {variant}: no experts lent");
        // The first expert lent (the last id of the first MoE layer) is the end of its tensor.
        let first_moe = (0..64).find(|l| model.tensor_location(&format!("blk.{l}.ffn_up_exps.weight")).is_some());
        let (fi, info) = model
            .tensor_location(&format!("blk.{}.ffn_gate_exps.weight", first_moe.unwrap()))
            .or_else(|| model.tensor_location(&format!("blk.{}.ffn_up_exps.weight", first_moe.unwrap())))
            .expect("tensor");
        let whole = model.files()[fi].tensor_bytes(info);
        assert_eq!(&whole[whole.len() - mapped[0].len()..], &mapped[0][..], "{arch} {variant}: last expert's bytes");
        for access in [MappedAccess::Populate, MappedAccess::HugeCopy] {
            assert!(lend(access) == mapped, "{arch} {variant}: {access:?} lent other bytes than the map");
        }
    }
}

/// A mapped store's guesses are its routers' top k (checked against the router's f32 values
/// in f64, within the Q8_0 rounding the guess works in) and its read-ahead reads exactly the
/// bytes of the experts asked for, or nothing once stopped.
#[test]
fn mapped_experts_guess_the_routers_top_k_and_read_ahead_the_experts_bytes() {
    use compute::ExpertStore;
    use pager::MappedExperts;
    let (_, cases) = moe_cases();
    let mut guessed_layers = 0;
    for (arch, variant, path) in cases {
        let model = Arc::new(GgufModel::open(&path).expect("fixture opens"));
        let store = MappedExperts::open(&model).expect("store opens");
        for layer in 0..64 {
            let Some(router) = model.tensor_opt(&format!("blk.{layer}.ffn_gate_inp.weight")) else { continue };
            let Some((_, up)) = model.tensor_location(&format!("blk.{layer}.ffn_up_exps.weight")) else { continue };
            let n_expert = up.shape[2] as usize;
            let ids: Vec<u32> = vec![0, (n_expert - 1) as u32];
            let per_expert: u64 = ["gate", "up", "down"]
                .iter()
                .filter_map(|m| model.tensor_location(&format!("blk.{layer}.ffn_{m}_exps.weight")))
                .map(|(f, info)| model.files()[f].tensor_bytes(info).len() as u64 / n_expert as u64)
                .sum();
            assert_eq!(store.read_ahead(layer, &ids, 4, &|| false), 2 * per_expert, "{arch} {variant} layer {layer}");
            assert_eq!(store.read_ahead(layer, &ids, 4, &|| true), 0, "{arch} {variant} layer {layer}: stopped");
            // Only f32 routers are checked against values read straight from the file.
            if router.dtype() != gguf::GgmlType::F32 {
                continue;
            }
            let w: Vec<f32> =
                router.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let n_embd = w.len() / n_expert;
            let x: Vec<f32> = (0..n_embd).map(|i| ((i * 7919 % 257) as f32 - 128.0) / 64.0).collect();
            let exact: Vec<f64> =
                w.chunks(n_embd).map(|r| r.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum()).collect();
            let mut order: Vec<usize> = (0..n_expert).collect();
            order.sort_by(|&a, &b| exact[b].total_cmp(&exact[a]));
            let k = 2.min(n_expert);
            let got = store.guess_experts(layer, &x, k);
            assert_eq!(got.len(), k, "{arch} {variant} layer {layer}: {got:?}");
            let scale = exact.iter().fold(0f64, |m, &v| m.max(v.abs()));
            for &e in &got {
                assert!(
                    exact[e as usize] >= exact[order[k - 1]] - 0.02 * scale,
                    "{arch} {variant} layer {layer}: guessed {got:?}, top by f64 {:?}",
                    &order[..k]
                );
            }
            guessed_layers += 1;
        }
    }
    assert!(guessed_layers > 0, "no fixture has an f32 router to check guesses against");
}
