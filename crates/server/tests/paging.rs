//! A mixture-of-experts model served with its experts paged through a small RAM budget
//! (`--ram-budget`, here per model as a presets file gives it) answers the same greedy
//! completion as the same model with its experts mapped, and `/metrics` shows the pager's
//! counters for it.
//!
//! The budget holds one expert, fewer than one token routes to, so every step evicts: the
//! paged path is exercised, not merely opened. Paged and resident add the same terms in the
//! same order (the pager's design), so the texts must be equal, not merely close.

mod common;

use serde_json::{json, Value};
use server::engine::EngineOptions;
use server::registry::RouterOptions;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn moe_fixture() -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let full = repo.join("../shared/fixtures/qwen3_moe/model-q4_0.gguf");
    if full.exists() {
        eprintln!("fixtures: full set ({})", full.display());
        full
    } else {
        eprintln!("fixtures: compact subset (tests/fixtures)");
        repo.join("tests/fixtures/qwen3_moe/model-q4_0.gguf")
    }
}

fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a response head");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, rest.to_string())
}

/// A server of the models `names` (each the file `path`) on `backend`, with per-model options
/// from the presets text `presets`, preloading the first `preload`; and those options.
fn start_with_presets(
    path: &Path,
    names: &[&str],
    backend: server::BackendKind,
    presets: &str,
    preload: usize,
) -> (common::TestServer, BTreeMap<String, EngineOptions>) {
    start_with_presets_then(path, names, backend, presets, preload, |_| {})
}

/// [`start_with_presets`], `edit` changing the per-model options before the server starts
/// (for options no presets key sets).
fn start_with_presets_then(
    path: &Path,
    names: &[&str],
    backend: server::BackendKind,
    presets: &str,
    preload: usize,
    edit: impl FnOnce(&mut BTreeMap<String, EngineOptions>),
) -> (common::TestServer, BTreeMap<String, EngineOptions>) {
    let models: Vec<(String, PathBuf)> = names.iter().map(|n| (n.to_string(), path.to_path_buf())).collect();
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let engine = EngineOptions { backend: Some(backend), read_ahead: false, n_ctx: 128, ..Default::default() };
    let mut model_options: BTreeMap<String, EngineOptions> =
        server::presets::resolve(presets, &engine, &names).unwrap();
    edit(&mut model_options);
    let config = server::Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        models,
        preload: names[..preload].to_vec(),
        engine,
        model_options: model_options.clone(),
        router: RouterOptions::default(),
        api_key: None,
    };
    (common::start(config), model_options)
}

/// The value of the metric line starting with `prefix` (name and labels).
fn metric(text: &str, prefix: &str) -> Option<u64> {
    text.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
}

#[test]
fn paged_experts_answer_like_mapped_ones_and_metrics_count_the_cache() {
    let path = moe_fixture();
    let file = Arc::new(gguf::GgufModel::open(&path).unwrap());
    let budget = pager::Pager::budget_for_slots(&file, 1).unwrap();
    let top_k = file.metadata().u32("qwen3moe.expert_used_count").unwrap();
    assert!(top_k > 1, "the budget must hold fewer experts than a token uses (top-k {top_k})");
    let presets = format!(
        "[paged]\nram-budget = {budget}\ncache-policy = lru\n[paged-gpu]\nram-budget = {budget}\ndevice = gpu\n"
    );
    let (server, model_options) =
        start_with_presets(&path, &["mapped", "paged", "paged-gpu"], server::BackendKind::Cpu, &presets, 2);
    assert_eq!(model_options["paged"].ram_budget_bytes, Some(budget));
    assert_eq!(model_options["mapped"].ram_budget_bytes, None);
    let addr = server.addr;

    let complete = |model: &str| -> (String, Value) {
        let body = json!({"model": model, "prompt": "The quick brown fox jumps over the la",
                          "max_tokens": 16, "temperature": 0.0});
        let (status, text) = request(addr, "POST", "/v1/completions", Some(&body));
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        (v["choices"][0]["text"].as_str().unwrap().to_string(), v["usage"].clone())
    };
    let (mapped, mapped_usage) = complete("mapped");
    let (paged, paged_usage) = complete("paged");
    assert_eq!(mapped_usage["completion_tokens"], 16, "{mapped_usage}");
    assert_eq!(paged, mapped, "paged experts changed the greedy completion");
    assert_eq!(paged_usage, mapped_usage);

    let (status, m) = request(addr, "GET", "/metrics", None);
    assert_eq!(status, 200);
    let misses =
        metric(&m, "diskformer_expert_cache_misses_total{model=\"paged\"}").expect("misses of the paged model");
    let hits = metric(&m, "diskformer_expert_cache_hits_total{model=\"paged\"}").expect("hits of the paged model");
    let read = metric(&m, "diskformer_expert_cache_read_bytes_total{model=\"paged\"}").expect("bytes read");
    let evictions = metric(&m, "diskformer_expert_cache_evictions_total{model=\"paged\"}").expect("evictions");
    let selections = metric(&m, "diskformer_expert_cache_selections_total{model=\"paged\"}").expect("selections");
    // 24 prompt tokens + 16 generated, each layer routing top-k distinct experts per call.
    assert!(misses > 0 && evictions > 0, "{m}");
    assert_eq!(hits + misses, selections, "{m}");
    let slot_expert_bytes = read / misses;
    assert!(slot_expert_bytes > 0 && read.is_multiple_of(misses), "bytes read {read} over {misses} misses");
    assert!(
        !m.contains("diskformer_expert_cache_misses_total{model=\"mapped\"}"),
        "a mapped model has no expert cache: {m}"
    );
    let (_, models) = request(addr, "GET", "/models", None);
    let v: Value = serde_json::from_str(&models).unwrap();
    let paged_entry = v["data"].as_array().unwrap().iter().find(|e| e["id"] == "paged").unwrap().clone();
    assert_eq!(paged_entry["expert_cache"]["budget_bytes"], budget, "{paged_entry}");
    // Paged experts run on the CPU back end: asking for the GPU with a budget is refused with
    // the reason, not served on the CPU behind the user's back.
    let body = json!({"model": "paged-gpu", "prompt": "x", "max_tokens": 1});
    let (status, text) = request(addr, "POST", "/v1/completions", Some(&body));
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("paged experts (an expert store) run on the CPU back end"), "{text}");
}

/// A model served on the GPU expert tier (`gpu-budget`, per model from a presets file) answers
/// the same greedy completion as the same model resident on the GPU; a budget below the tier's
/// floor is refused with the bytes it needs (503, the loader's error), and so is a GPU budget
/// for several sessions of one model.
#[cfg(feature = "gpu")]
#[test]
fn a_gpu_budget_serves_on_the_expert_tier_like_the_resident_gpu() {
    let path = moe_fixture();
    // The tier's need from the planner (its slot and scratch are the tier's own, for a 512-token
    // batch; the server's context is shorter, so this budget holds the floor).
    let desc = plan::describe(&path).unwrap();
    let tiny = plan::plan_with(
        &desc,
        &plan::probe(&plan::ProbeOptions { disk_paths: vec![], measure_bandwidth: false, ..Default::default() }),
        &plan::PlanOptions { n_ctx: 128, budget_bytes: Some(1), ..Default::default() },
    );
    let Some(need) = tiny.backend(plan::BackendKind::GpuPaged).refusal.as_ref().and_then(|r| r.need_bytes) else {
        panic!(
            "no GPU (lavapipe: mesa-vulkan-drivers) or the tier was not refused for a 1-byte budget: {}",
            tiny.reasons()
        )
    };
    let presets = format!(
        "[tier]\ngpu-budget = {need}\n[tier-small]\ngpu-budget = 1M\n[tier-parallel]\ngpu-budget = {need}\nparallel = 2\n\
         [tier-cpu]\ngpu-budget = {need}\nmoe-miss = cpu\n"
    );
    let names = ["resident", "tier", "tier-small", "tier-parallel", "tier-cpu", "planned"];
    let mut options = None;
    let (server, model_options) =
        start_with_presets_then(&path, &names, server::BackendKind::Gpu, &presets, 0, |model_options| {
            let planned = model_options.get_mut("planned").unwrap();
            planned.backend = Some(plan::BackendKind::GpuPaged);
            planned.parallel = 2;
            options = Some(planned.clone());
        });
    assert_eq!(options.map(|o| o.parallel), Some(2));
    assert_eq!(model_options["tier"].gpu_budget_bytes, Some(need));
    assert_eq!(model_options["tier"].moe_miss, None);
    assert_eq!(model_options["tier-cpu"].moe_miss, Some(plan::TierMiss::Cpu));
    let addr = server.addr;
    let complete = |model: &str| -> (u16, String) {
        let body = json!({"model": model, "prompt": "The quick brown fox jumps over the la",
                          "max_tokens": 12, "temperature": 0.0});
        request(addr, "POST", "/v1/completions", Some(&body))
    };
    let text = |(status, body): (u16, String)| -> String {
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let resident = text(complete("resident"));
    let tier = text(complete("tier"));
    assert_eq!(tier, resident, "the GPU expert tier changed the greedy completion");
    // `/metrics` counts the tier's selections: every one a hit or a miss, each miss served
    // (read from host memory, uploaded or computed on the CPU); the resident model has none.
    let (status, m) = request(addr, "GET", "/metrics", None);
    assert_eq!(status, 200);
    let tier_metric = |what: &str| {
        metric(&m, &format!("diskformer_gpu_tier_{what}_total{{model=\"tier\"}}"))
            .unwrap_or_else(|| panic!("{what} of the tier model: {m}"))
    };
    let (selections, hits, misses) = (tier_metric("selections"), tier_metric("hits"), tier_metric("misses"));
    assert!(selections > 0, "{m}");
    assert_eq!(hits + misses, selections, "{m}");
    let served = tier_metric("host_reads") + tier_metric("cpu_experts") + tier_metric("uploads");
    assert!(served >= misses, "{misses} misses, {served} served: {m}");
    assert!(!m.contains("diskformer_gpu_tier_selections_total{model=\"resident\"}"), "{m}");
    // `moe-miss = cpu`: the misses are computed on the CPU once the pool's free slots are
    // filled, and nothing is evicted (the GPU and CPU products round differently, so the text
    // is not compared).
    let (status, body) = complete("tier-cpu");
    assert_eq!(status, 200, "{body}");
    let (_, m) = request(addr, "GET", "/metrics", None);
    let cpu_metric = |what: &str| {
        metric(&m, &format!("diskformer_gpu_tier_{what}_total{{model=\"tier-cpu\"}}"))
            .unwrap_or_else(|| panic!("{what} of the tier-cpu model: {m}"))
    };
    let (cpu, uploads, misses) = (cpu_metric("cpu_experts"), cpu_metric("uploads"), cpu_metric("misses"));
    assert_eq!(cpu + uploads, misses, "{cpu} CPU experts and {uploads} uploads of {misses} misses: {m}");
    assert_eq!(cpu_metric("evictions"), 0, "{m}");
    // The planner's choice (here asked for by name): the tier with the budget it planned, one
    // session whatever `parallel` says, the same greedy completion.
    let planned = text(complete("planned"));
    assert_eq!(planned, resident, "the planned GPU expert tier changed the greedy completion");
    let (_, m) = request(addr, "GET", "/metrics", None);
    assert!(metric(&m, "diskformer_gpu_tier_selections_total{model=\"planned\"}").is_some_and(|n| n > 0), "{m}");
    let (_, models) = request(addr, "GET", "/models", None);
    let v: Value = serde_json::from_str(&models).unwrap();
    let entry = |id: &str| v["data"].as_array().unwrap().iter().find(|e| e["id"] == id).unwrap().clone();
    assert_eq!(entry("planned")["sessions"], 1, "{}", entry("planned"));
    assert_eq!(entry("tier")["sessions"], 1);
    let (status, body) = complete("tier-small");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("GPU budget") && body.contains("too small"), "{body}");
    let (status, body) = complete("tier-parallel");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("one session"), "{body}");
}
