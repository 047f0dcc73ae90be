//! GPU placement without a GPU: on committed MoE fixtures, the planner's dense bytes (without the
//! input embedding where the model has its own output projection), slot size and floor are the
//! sums read here from the tensor list and metadata; a budget of exactly the
//! dense weights, KV cache, scratch and 3 × top-k slots plans that floor, one byte less is the
//! typed error with the numbers, and a large budget holds every expert.

use gguf::GgufModel;
use pager::{GpuPlacement, PagerError, MIN_SLOTS_PER_TOP_K};
use std::path::Path;

#[test]
fn placement_floor_and_refusal_on_moe_fixtures() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    println!("fixture set: committed subset under {} (qwen3_moe, mixtral, olmoe)", root.display());
    for arch in ["qwen3_moe", "mixtral", "olmoe"] {
        let path = root.join(arch).join("model-q4_0.gguf");
        let model = GgufModel::open(&path).expect("fixture opens");
        // What the planner must find, summed independently from the tensor list.
        let mut expert_bytes_total = 0u64;
        let mut slot_bytes = 0u64;
        let mut n_experts_total = 0usize;
        for il in 0.. {
            let name = |p: &str| format!("blk.{il}.ffn_{p}_exps.weight");
            let Some(up) = model.tensor_opt(&name("up")) else { break };
            let n_expert = up.shape()[2] as usize;
            let layer_bytes: u64 = ["gate", "up", "down"]
                .iter()
                .filter_map(|p| model.tensor_opt(&name(p)))
                .map(|t| t.info.size_bytes)
                .sum();
            expert_bytes_total += layer_bytes;
            slot_bytes = slot_bytes.max(layer_bytes / n_expert as u64);
            n_experts_total += n_expert;
        }
        // A model with an output projection of its own keeps its input embedding on the host
        // (`compute::input_embedding_on_host`): not part of the GPU's dense weights.
        let embedding_bytes = match (model.tensor_opt("output.weight"), model.tensor_opt("token_embd.weight")) {
            (Some(_), Some(t)) => t.info.size_bytes,
            _ => 0,
        };
        let dense_bytes = model.tensor_bytes_total() - expert_bytes_total - embedding_bytes;
        let arch_name = model.architecture().unwrap().to_string();
        let top_k = model.metadata().u32(&format!("{arch_name}.expert_used_count")).unwrap() as usize;
        let min_slots = (MIN_SLOTS_PER_TOP_K * top_k).min(n_experts_total);
        let (kv, scratch) = (1_000_000u64, 250_000u64);
        let exact = dense_bytes + kv + scratch + min_slots as u64 * slot_bytes;

        let p = GpuPlacement::plan(&model, exact, kv, scratch).expect("the floor fits");
        assert_eq!((p.dense_bytes, p.slot_bytes, p.top_k), (dense_bytes, slot_bytes, top_k), "{arch}");
        assert_eq!((p.n_slots, p.min_slots), (min_slots, min_slots), "{arch}");
        assert!(p.total_bytes() <= exact);

        match GpuPlacement::plan(&model, exact - 1, kv, scratch) {
            Err(e @ PagerError::GpuBudgetTooSmall { .. }) => {
                let msg = e.to_string();
                let PagerError::GpuBudgetTooSmall { budget_bytes, fixed_bytes, min_pool_bytes, needed_bytes, .. } = e
                else {
                    unreachable!()
                };
                assert_eq!(budget_bytes, exact - 1);
                assert_eq!(fixed_bytes, dense_bytes + kv + scratch);
                assert_eq!(min_pool_bytes, min_slots as u64 * slot_bytes);
                assert_eq!(needed_bytes, exact);
                // Fixtures are between 0.01 and 10 MB: quoted in MB.
                for b in [exact - 1, fixed_bytes, min_pool_bytes] {
                    assert!((10_000..10_000_000).contains(&b), "{arch}: {b} B is not in the MB range");
                }
                let want = format!(
                    "GPU budget {:.2} MB is too small for {}: dense weights and KV cache need {:.2} MB, and the expert cache at least {:.2} MB more",
                    (exact - 1) as f64 / 1e6,
                    path.display(),
                    fixed_bytes as f64 / 1e6,
                    min_pool_bytes as f64 / 1e6
                );
                assert_eq!(msg, want);
                println!("{arch}: {msg}");
            }
            other => panic!("{arch}: expected GpuBudgetTooSmall, got {other:?}"),
        }

        let big = GpuPlacement::plan(&model, u64::MAX / 2, kv, scratch).expect("fits");
        assert_eq!(big.n_slots, n_experts_total, "{arch}: a large budget holds every expert once");
        println!(
            "{arch}: dense {dense_bytes} B (input embedding on the host: {embedding_bytes} B), slot {slot_bytes} B, top-k {top_k}, floor {min_slots} slots, {n_experts_total} experts"
        );
    }
}
