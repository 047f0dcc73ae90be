//! The JSON of describe, probe and plan is a contract (docs/PLAN.md): these are its field names.
//! A failure here means the documented form changed; update docs/PLAN.md with it, and only add.

mod common;

use serde_json::Value;

fn keys(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v.as_object().expect("an object").keys().cloned().collect();
    k.sort();
    k
}

fn sorted(names: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

#[test]
fn describe_json_has_the_documented_fields() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("chat.gguf");
    common::write_chat_fixture(&common::fixture("qwen3"), &p, common::CHATML_THINK, &[]);
    let v = serde_json::to_value(plan::describe(&p).unwrap()).unwrap();
    assert_eq!(
        keys(&v),
        sorted(&[
            "path",
            "source",
            "formats",
            "architecture",
            "hf_architecture",
            "task",
            "tags",
            "files",
            "total_size_bytes",
            "gguf",
            "gguf_variants",
            "quant_types",
            "params_total",
            "params_active",
            "context_length",
            "chat_template",
            "thinking",
            "readers",
            "weights",
        ])
    );
    assert_eq!(v["source"], "gguf_file");
    assert_eq!(v["formats"], serde_json::json!(["gguf"]));
    assert_eq!(v["task"], "text-generation");
    assert_eq!(keys(&v["files"][0]), sorted(&["path", "size_bytes", "format"]));
    assert_eq!(keys(&v["quant_types"][0]), sorted(&["dtype", "n_tensors", "size_bytes"]));
    assert_eq!(keys(&v["thinking"]), sorted(&["open", "open_id", "close", "close_id", "in_template"]));
    assert_eq!(keys(&v["readers"][0]), sorted(&["backend", "can_read", "code", "reason"]));
    let backends: Vec<&str> = v["readers"].as_array().unwrap().iter().map(|r| r["backend"].as_str().unwrap()).collect();
    assert_eq!(backends, ["cpu", "gpu", "gpu_paged", "hybrid"]);
    assert_eq!(
        keys(&v["weights"]),
        sorted(&[
            "tensor_bytes",
            "expert_bytes",
            "dense_bytes",
            "gpu_tensor_bytes",
            "gpu_expert_bytes",
            "expert_count",
            "expert_used_count",
            "n_layers",
            "n_embd",
            "n_vocab",
            "max_ffn",
            "kv_bytes_per_position",
            "recurrent_state_bytes",
            "gpu_scratch_bytes",
            "gpu_slot_bytes",
            "ram_cache_index_bytes",
            "ram_slot_bytes",
        ])
    );
}

#[test]
fn probe_json_has_the_documented_fields() {
    let m = plan::probe(&plan::ProbeOptions {
        disk_paths: vec![".".into()],
        measure_bandwidth: false,
        ..Default::default()
    });
    let v = serde_json::to_value(&m).unwrap();
    assert_eq!(keys(&v), sorted(&["gpus", "gpu_compiled", "cpu", "memory", "disks"]));
    assert_eq!(keys(&v["cpu"]), sorted(&["model", "arch", "simd", "cores_logical", "cores_physical"]));
    assert_eq!(
        keys(&v["memory"]),
        sorted(&["total_bytes", "available_bytes", "cgroup_limit_bytes", "bandwidth_bytes_per_s", "bandwidth_source"])
    );
    assert_eq!(keys(&v["disks"][0]), sorted(&["path", "free_bytes", "total_bytes"]));
    let gpu = plan::GpuInfo {
        index: 0,
        name: "x".into(),
        api: "Vulkan".into(),
        device_type: "Cpu".into(),
        driver: String::new(),
        shader_f16: false,
        subgroups: false,
        max_storage_binding_bytes: 1,
        memory_bytes: None,
        memory_free_bytes: None,
        memory_source: None,
        bandwidth_bytes_per_s: Some(1.0),
        bandwidth_source: Some(plan::Source::Measured),
        host_read_bytes_per_s: Some(1.0),
        host_read_source: Some(plan::Source::Measured),
    };
    let g = serde_json::to_value(&gpu).unwrap();
    assert_eq!(
        keys(&g),
        sorted(&[
            "index",
            "name",
            "api",
            "device_type",
            "driver",
            "shader_f16",
            "subgroups",
            "max_storage_binding_bytes",
            "memory_bytes",
            "memory_free_bytes",
            "memory_source",
            "bandwidth_bytes_per_s",
            "bandwidth_source",
            "host_read_bytes_per_s",
            "host_read_source",
        ])
    );
    assert_eq!(g["bandwidth_source"], "measured");
    let back: plan::Machine = serde_json::from_value(v).unwrap();
    assert_eq!(back, m, "the JSON reads back");
}

#[test]
fn plan_json_has_the_documented_fields() {
    let d = plan::describe(&common::fixture("qwen3_moe")).unwrap();
    let m = plan::probe(&plan::ProbeOptions::default());
    let p = plan::plan_with(&d, &m, &plan::PlanOptions::default());
    let v = serde_json::to_value(&p).unwrap();
    assert_eq!(
        keys(&v),
        sorted(&[
            "model",
            "architecture",
            "n_ctx",
            "chosen",
            "backends",
            "gpu_budget",
            "ram_budget",
            "speed_model",
            "assumptions"
        ])
    );
    assert_eq!(keys(&v["gpu_budget"]), sorted(&["bytes", "source"]));
    let b = &v["backends"];
    let names: Vec<&str> = b.as_array().unwrap().iter().map(|x| x["backend"].as_str().unwrap()).collect();
    assert_eq!(names, ["cpu", "gpu", "gpu_paged", "hybrid"]);
    for x in b.as_array().unwrap() {
        assert_eq!(keys(x), sorted(&["backend", "device", "estimate", "refusal"]));
    }
    assert_eq!(
        keys(&b[0]["estimate"]),
        sorted(&[
            "gpu_bytes",
            "ram_bytes",
            "disk_bytes",
            "bytes_per_token",
            "host_bytes_per_token",
            "host_read_bytes_per_s",
            "expert_cache_bytes",
            "tok_per_sec",
            "bandwidth_bytes_per_s",
            "bandwidth_source"
        ])
    );
    assert_eq!(keys(&b[3]["refusal"]), sorted(&["code", "reason", "need_bytes"]));
    assert_eq!(b[3]["refusal"]["code"], "unimplemented");
    let back: plan::Plan = serde_json::from_value(v).unwrap();
    assert_eq!(back, p, "the JSON reads back");
}

/// `cargo test -p plan --features gpu --test json -- --ignored --nocapture` prints this
/// machine as `diskformer probe --json` does, with measured bandwidths (how the rows of
/// `plan::BANDWIDTH_TABLE` were made).
#[test]
#[ignore = "measures bandwidths for about a second; run with --ignored to print this machine"]
fn print_this_machine_measured() {
    let m = plan::probe(&plan::ProbeOptions {
        disk_paths: vec![".".into()],
        measure_bandwidth: true,
        ..Default::default()
    });
    println!("{}", serde_json::to_string_pretty(&m).unwrap());
    assert!(m.memory.bandwidth_bytes_per_s.is_some_and(|b| b > 0.0));
}

/// `cargo test -p plan --features gpu --test json -- --ignored --nocapture` also prints what
/// `diskformer describe --json` and `diskformer plan --json` say about SmolLM2 here (the
/// examples of docs/PLAN.md).
#[test]
#[ignore = "prints examples; needs models/SmolLM2-135M-Instruct.Q4_1.gguf"]
fn print_smollm2_description_and_plan() {
    let Some(model) = common::smollm2() else {
        eprintln!("SKIPPED: SmolLM2-135M-Instruct not in models/ (scripts/get-models.sh)");
        return;
    };
    let d = plan::describe(&model).unwrap();
    println!("{}", serde_json::to_string_pretty(&d).unwrap());
    let m = plan::probe(&plan::ProbeOptions {
        disk_paths: vec![".".into()],
        measure_bandwidth: true,
        ..Default::default()
    });
    let p = plan::plan_with(&d, &m, &plan::PlanOptions { budget_bytes: Some(64 << 20), ..Default::default() });
    println!("{}", serde_json::to_string_pretty(&p).unwrap());
    println!("{}", p.summary_line());
}
