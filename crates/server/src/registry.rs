//! [`Registry`]: the models the server knows, loaded on demand and unloaded least recently
//! used first, with per-model memory figures (estimated from metadata and the planner before
//! loading, measured after) and events for `/models/sse`.
//!
//! A model's name is only ever a key of this table, built by listing the models folder: a
//! request can name a model but never a path, so nothing outside the folder is reachable.

use crate::devices::{self, DeviceMemory, DeviceMemorySource};
use crate::engine::{resident_bytes, EngineOptions, Loaded};
use crate::error::{ApiError, ErrorKind};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{broadcast, Notify};

/// The smallest context a model is allowed to run with: its `min` memory is for this.
pub const MIN_CTX: u64 = 512;

/// Router settings.
#[derive(Clone, Debug)]
pub struct RouterOptions {
    /// Loaded models at most (0: no limit).
    pub models_max: usize,
    /// Bytes to keep free on each device when loading.
    pub margin_bytes: u64,
    /// Load models named by requests (else only `?autoload=true` or preloaded ones serve).
    pub autoload: bool,
}

impl Default for RouterOptions {
    fn default() -> Self {
        RouterOptions { models_max: 0, margin_bytes: 0, autoload: true }
    }
}

/// Memory of one configuration on one device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceBytes {
    /// [`devices::CPU`] or [`devices::gpu_key`].
    pub device: String,
    /// The device's total bytes when measured (`None`: the OS does not say).
    pub total: Option<u64>,
    /// Its free bytes when measured (`None`: the OS does not say).
    pub free: Option<u64>,
    /// Weights placed there.
    pub model: u64,
    /// KV cache and recurrent state.
    pub context: u64,
    /// Scratch, logits and runtime.
    pub compute: u64,
}

impl DeviceBytes {
    fn json(&self) -> Value {
        let n = |v: Option<u64>| v.map_or(json!("unknown"), |b| json!(b));
        json!({"device": self.device, "total": n(self.total), "free": n(self.free),
               "model": self.model, "context": self.context, "compute": self.compute})
    }

    /// Bytes this configuration needs on the device.
    pub fn need(&self) -> u64 {
        self.model + self.context + self.compute
    }

    fn measured_on(mut self, snapshot: &[DeviceMemory]) -> DeviceBytes {
        let m = snapshot.iter().find(|m| m.device == self.device);
        self.total = m.and_then(|m| m.total_bytes);
        self.free = m.and_then(|m| m.free_bytes);
        self
    }
}

/// Whether `need` plus `margin_bytes` fits on every device it uses, counting each device's
/// free memory in `snapshot` plus the bytes `freed` there by unloading. A device whose free
/// memory is unknown cannot be checked and is taken to fit (the planner decides at load).
pub fn fits_everywhere(
    need: &[DeviceBytes],
    snapshot: &[DeviceMemory],
    freed: &BTreeMap<String, u64>,
    margin_bytes: u64,
) -> bool {
    need.iter().all(|d| match snapshot.iter().find(|m| m.device == d.device).and_then(|m| m.free_bytes) {
        None => true,
        Some(free) => d.need() + margin_bytes <= free + freed.get(&d.device).copied().unwrap_or(0),
    })
}

/// How many of `idle` (least recently used first; each with the bytes unloading it frees per
/// device) to unload before loading a model that needs `need`: while `n_loaded` reaches
/// `models_max` (0: no limit), or while `need` plus the margin does not fit on every device.
pub fn count_unloads(
    idle: &[BTreeMap<String, u64>],
    mut n_loaded: usize,
    models_max: usize,
    need: &[DeviceBytes],
    snapshot: &[DeviceMemory],
    margin_bytes: u64,
) -> usize {
    let mut freed: BTreeMap<String, u64> = BTreeMap::new();
    for (i, frees) in idle.iter().enumerate() {
        let over_count = models_max > 0 && n_loaded >= models_max;
        let over_memory = margin_bytes > 0 && !fits_everywhere(need, snapshot, &freed, margin_bytes);
        if !over_count && !over_memory {
            return i;
        }
        for (d, b) in frees {
            *freed.entry(d.clone()).or_default() += b;
        }
        n_loaded -= 1;
    }
    idle.len()
}

#[derive(Clone, Debug)]
enum MemStatus {
    Unmeasured,
    Measuring,
    Measured { min: Vec<DeviceBytes>, max: Vec<DeviceBytes> },
    Failed(String),
}

enum State {
    Unloaded,
    Loading(Arc<Notify>),
    Loaded(Arc<Loaded>),
    Failed(String),
}

struct Entry {
    path: PathBuf,
    /// This model's loading and serving options.
    engine: EngineOptions,
    state: State,
    last_used: Instant,
    memory: MemStatus,
    effective: Option<u64>,
}

/// The table of models.
pub struct Registry {
    entries: Mutex<BTreeMap<String, Entry>>,
    router: RouterOptions,
    events: broadcast::Sender<String>,
    devices: Arc<dyn DeviceMemorySource>,
    load_lock: tokio::sync::Mutex<()>,
}

/// The GGUF models in `dir`: single files and the first part of split sets, named by file
/// stem (a split set by its name without the `-00001-of-0000N` suffix).
///
/// # Errors
/// The folder cannot be read.
pub fn scan_dir(dir: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        let Some(file) = p.file_name().and_then(|f| f.to_str()) else { continue };
        let Some(stem) = file.strip_suffix(".gguf") else { continue };
        if !p.is_file() {
            continue;
        }
        let name = match stem.rfind("-of-") {
            Some(i) if stem.len() >= 15 && stem[i - 6..i].starts_with('-') => {
                if !stem[i - 5..i].chars().all(|c| c.is_ascii_digit()) {
                    stem.to_string()
                } else if &stem[i - 5..i] != "00001" {
                    continue;
                } else {
                    stem[..i - 6].to_string()
                }
            }
            _ => stem.to_string(),
        };
        out.push((name, p));
    }
    out.sort();
    Ok(out)
}

/// The GPU index in a planner device string (`gpu 0: NAME`).
fn gpu_index(device: Option<&str>) -> Option<usize> {
    device?.strip_prefix("gpu ")?.split(':').next()?.trim().parse().ok()
}

/// `min` (context [`MIN_CTX`]) and `max` (the configured context) memory per device from the
/// model's metadata and the planner, without loading it: on the back end the load will use
/// (the configured one, else the planner's choice at the configured context). A model whose
/// experts are paged counts its dense weights and the expert cache's budget in RAM.
fn estimate(
    path: &Path,
    engine: &EngineOptions,
    snapshot: &[DeviceMemory],
) -> Result<(Vec<DeviceBytes>, Vec<DeviceBytes>), String> {
    let desc = plan::describe(path).map_err(|e| e.to_string())?;
    let w = desc.weights.as_ref().ok_or("no weight facts in the description")?;
    let machine =
        plan::probe(&plan::ProbeOptions { disk_paths: vec![], measure_bandwidth: false, ..Default::default() });
    // Experts paged for the CPU (a RAM budget without a GPU budget); the GPU expert tier's
    // estimate has its own host side.
    let paged = engine.ram_budget_bytes.filter(|_| engine.gpu_budget_bytes.is_none());
    let plan_at = |n_ctx: u64| {
        // The planner counts every expert resident; the pager's budget bounds them instead.
        let ram_budget_bytes = paged.map(|_| u64::MAX).or(engine.ram_budget_bytes);
        let budget_bytes = engine.gpu_budget_bytes;
        plan::plan_with(
            &desc,
            &machine,
            &plan::PlanOptions { n_ctx, ram_budget_bytes, budget_bytes, ..Default::default() },
        )
    };
    let want = match (engine.gpu_budget_bytes, paged) {
        (Some(_), _) => Some(plan::BackendKind::GpuPaged),
        (None, Some(_)) => Some(plan::BackendKind::Cpu),
        (None, None) => engine.backend,
    };
    let max_plan = plan_at(engine.n_ctx);
    let kind = max_plan.pick(want).map_err(|e| e.to_string())?.backend;
    let at = |p: &plan::Plan| -> Result<Vec<DeviceBytes>, String> {
        let chosen = p.pick(Some(kind)).map_err(|e| e.to_string())?;
        let est = chosen.estimate.as_ref().ok_or("no estimate")?;
        let context = w.kv_bytes_per_position * p.n_ctx + w.recurrent_state_bytes;
        let list = match chosen.backend {
            plan::BackendKind::Cpu => {
                let model = w.tensor_bytes.min(est.ram_bytes.saturating_sub(context));
                let compute = est.ram_bytes.saturating_sub(model + context);
                let model = match paged {
                    Some(budget) => model.saturating_sub(w.expert_bytes) + budget,
                    None => model,
                };
                vec![DeviceBytes { device: devices::CPU.into(), model, context, compute, ..Default::default() }]
            }
            _ => {
                let device = gpu_index(chosen.device.as_deref()).map_or_else(|| "gpu".to_string(), devices::gpu_key);
                let weights = w.gpu_tensor_bytes.unwrap_or(w.tensor_bytes);
                let model = weights.min(est.gpu_bytes.saturating_sub(context));
                let compute = est.gpu_bytes.saturating_sub(model + context);
                vec![
                    DeviceBytes { device: devices::CPU.into(), compute: est.ram_bytes, ..Default::default() },
                    DeviceBytes { device, model, context, compute, ..Default::default() },
                ]
            }
        };
        Ok(list.into_iter().map(|d| d.measured_on(snapshot)).collect())
    };
    let max_ctx = if engine.n_ctx == 0 { plan::DEFAULT_MAX_CTX } else { engine.n_ctx };
    Ok((at(&plan_at(MIN_CTX.min(max_ctx)))?, at(&max_plan)?))
}

impl Registry {
    /// A registry of `models` (name, path), each loaded with `engine`.
    pub fn new(models: Vec<(String, PathBuf)>, engine: EngineOptions, router: RouterOptions) -> Arc<Registry> {
        Registry::with_model_options(models, engine, BTreeMap::new(), router)
    }

    /// A registry of `models` (name, path), each loaded with its entry of `per_model` or else
    /// with `engine`.
    pub fn with_model_options(
        models: Vec<(String, PathBuf)>,
        engine: EngineOptions,
        per_model: BTreeMap<String, EngineOptions>,
        router: RouterOptions,
    ) -> Arc<Registry> {
        Registry::with_devices(models, engine, per_model, router, Arc::new(devices::OsDevices::new()))
    }

    /// As [`Registry::with_model_options`], with device memory read from `devices` (tests give
    /// fixed figures).
    pub fn with_devices(
        models: Vec<(String, PathBuf)>,
        engine: EngineOptions,
        per_model: BTreeMap<String, EngineOptions>,
        router: RouterOptions,
        devices: Arc<dyn DeviceMemorySource>,
    ) -> Arc<Registry> {
        let now = Instant::now();
        let entries = models
            .into_iter()
            .map(|(n, path)| {
                let engine = per_model.get(&n).cloned().unwrap_or_else(|| engine.clone());
                (
                    n,
                    Entry {
                        path,
                        engine,
                        state: State::Unloaded,
                        last_used: now,
                        memory: MemStatus::Unmeasured,
                        effective: None,
                    },
                )
            })
            .collect();
        let (events, _) = broadcast::channel(256);
        Arc::new(Registry {
            entries: Mutex::new(entries),
            router,
            events,
            load_lock: tokio::sync::Mutex::new(()),
            devices,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn emit(&self, event: &str, data: Value) {
        let _ = self.events.send(json!({"event": event, "data": data}).to_string());
    }

    /// Events (`load`, `unload`, `model_memory`) as JSON strings.
    pub fn subscribe(&self) -> broadcast::Receiver<String> {
        self.events.subscribe()
    }

    /// Model names.
    pub fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Loaded models and their in-flight requests.
    pub fn in_flight(&self) -> Vec<(String, usize)> {
        self.lock()
            .iter()
            .filter_map(|(n, e)| match &e.state {
                State::Loaded(l) => Some((n.clone(), l.in_flight())),
                _ => None,
            })
            .collect()
    }

    /// Loaded models whose experts are paged, with their expert cache's counters summed over
    /// layers.
    pub fn expert_caches(&self) -> Vec<(String, pager::LayerStats)> {
        self.lock()
            .iter()
            .filter_map(|(n, e)| match &e.state {
                State::Loaded(l) => l.pager().map(|p| (n.clone(), p.total_stats())),
                _ => None,
            })
            .collect()
    }

    /// Every loaded model on the GPU expert tier, with its counters.
    pub fn expert_tiers(&self) -> Vec<(String, plan::ExpertTierStats)> {
        self.lock()
            .iter()
            .filter_map(|(n, e)| match &e.state {
                State::Loaded(l) => l.expert_tier_totals().map(|t| (n.clone(), t)),
                _ => None,
            })
            .collect()
    }

    /// Computes every model's memory figures in the background (blocking threads).
    pub fn measure_all(self: &Arc<Self>) {
        let this = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            for name in this.names() {
                let (path, engine) = {
                    let mut g = this.lock();
                    let Some(e) = g.get_mut(&name) else { continue };
                    e.memory = MemStatus::Measuring;
                    (e.path.clone(), e.engine.clone())
                };
                let snapshot = this.devices.snapshot();
                let m = match estimate(&path, &engine, &snapshot) {
                    Ok((min, max)) => MemStatus::Measured { min, max },
                    Err(why) => MemStatus::Failed(why),
                };
                if let Some(e) = this.lock().get_mut(&name) {
                    e.memory = m;
                }
                let v = this.model_json(&name);
                this.emit("model_memory", v);
            }
        });
    }

    fn model_json_locked(name: &str, e: &Entry, snapshot: &[DeviceMemory]) -> Value {
        let (status, in_flight) = match &e.state {
            State::Unloaded => ("unloaded".to_string(), 0),
            State::Loading(_) => ("loading".to_string(), 0),
            State::Loaded(l) => ("loaded".to_string(), l.in_flight()),
            State::Failed(why) => (format!("failed: {why}"), 0),
        };
        let list = |v: &[DeviceBytes]| Value::Array(v.iter().map(DeviceBytes::json).collect());
        let memory = match &e.memory {
            MemStatus::Unmeasured => json!({"status": "unmeasured"}),
            MemStatus::Measuring => json!({"status": "measuring"}),
            MemStatus::Failed(why) => json!({"status": "failed", "error": why}),
            MemStatus::Measured { min, max } => {
                // The measured figure is resident RAM; other devices keep the estimate.
                let effective = e.effective.map(|b| {
                    let now: Vec<DeviceBytes> = max
                        .iter()
                        .map(|d| {
                            let mut d = d.clone().measured_on(snapshot);
                            if d.device == devices::CPU {
                                d.model = b.saturating_sub(d.context + d.compute);
                            }
                            d
                        })
                        .collect();
                    list(&now)
                });
                json!({"status": "measured", "min": list(min), "max": list(max), "effective": effective})
            }
        };
        let expert_cache = match &e.state {
            State::Loaded(l) => l.pager().map(|p| {
                let t = p.total_stats();
                json!({"budget_bytes": p.budget_bytes(), "accounted_bytes": p.accounted_bytes(),
                       "slots": p.n_slots(), "slot_bytes": p.slot_bytes(),
                       "policy": format!("{:?}", p.policy()).to_lowercase(), "prefetch": p.prefetches(),
                       "direct_io": p.direct_io(), "selections": t.selections, "hits": t.hits,
                       "misses": t.misses, "evictions": t.evictions, "bytes_read": t.bytes_read})
            }),
            _ => None,
        };
        let sessions = match &e.state {
            State::Loaded(l) => Some(l.n_sessions()),
            _ => None,
        };
        json!({"id": name, "object": "model", "path": e.path.file_name().and_then(|f| f.to_str()),
               "status": {"value": status}, "in_flight": in_flight, "sessions": sessions, "memory": memory,
               "expert_cache": expert_cache})
    }

    /// One model's state and memory as `/models` lists it.
    pub fn model_json(&self, name: &str) -> Value {
        let snapshot = self.devices.snapshot();
        self.lock().get(name).map_or(Value::Null, |e| Self::model_json_locked(name, e, &snapshot))
    }

    /// Every model, as `/models` lists them.
    pub fn models_json(&self) -> Value {
        let snapshot = self.devices.snapshot();
        let g = self.lock();
        let data: Vec<Value> = g.iter().map(|(n, e)| Self::model_json_locked(n, e, &snapshot)).collect();
        json!({"object": "list", "data": data, "devices": snapshot.iter().map(DeviceMemory::json).collect::<Vec<_>>()})
    }

    /// The loaded model `name`, loading it when needed (and allowed).
    ///
    /// # Cancel safety
    /// A load, once started, runs to the end on its own task; dropping this future only stops
    /// waiting for it.
    ///
    /// # Errors
    /// Unknown model (404); not loaded with autoload off, or its load failed (503).
    pub async fn get(self: &Arc<Self>, name: &str, autoload: Option<bool>) -> Result<Arc<Loaded>, ApiError> {
        let autoload = autoload.unwrap_or(self.router.autoload);
        loop {
            let wait = {
                let mut g = self.lock();
                let e = g.get_mut(name).ok_or_else(|| {
                    ApiError::new(
                        ErrorKind::NotFound,
                        format!("model {name:?} is not known; GET /v1/models lists them"),
                    )
                })?;
                match &e.state {
                    State::Loaded(l) => {
                        e.last_used = Instant::now();
                        return Ok(Arc::clone(l));
                    }
                    State::Loading(n) => {
                        let n = Arc::clone(n);
                        let mut fut = Box::pin(n.notified_owned());
                        fut.as_mut().enable();
                        fut
                    }
                    State::Unloaded | State::Failed(_) if !autoload => {
                        return Err(ApiError::new(
                            ErrorKind::Unavailable,
                            format!("model {name} is not loaded and autoload is off (add ?autoload=true)"),
                        ))
                    }
                    State::Unloaded | State::Failed(_) => {
                        let n = Arc::new(Notify::new());
                        e.state = State::Loading(Arc::clone(&n));
                        let mut fut = Box::pin(n.clone().notified_owned());
                        fut.as_mut().enable();
                        let this = Arc::clone(self);
                        let name = name.to_string();
                        tokio::spawn(async move { this.load(name, n).await });
                        fut
                    }
                }
            };
            wait.await;
            let g = self.lock();
            if let Some(Entry { state: State::Failed(why), .. }) = g.get(name) {
                return Err(ApiError::new(ErrorKind::Unavailable, format!("model {name} failed to load: {why}")));
            }
        }
    }

    /// Loads `name` (one load at a time, so the measured memory is its own), after unloading
    /// idle models least recently used first until the count and memory limits allow it.
    async fn load(self: Arc<Self>, name: String, done: Arc<Notify>) {
        let _one = self.load_lock.lock().await;
        let victims = self.victims(&name);
        for (v, loaded) in victims {
            // Dropping a session joins its engine thread: off the async workers.
            let _ = tokio::task::spawn_blocking(move || drop(loaded)).await;
            self.emit("unload", json!({"model": v}));
        }
        let found = self.lock().get(&name).map(|e| (e.path.clone(), e.engine.clone()));
        let Some((path, engine)) = found else { return };
        self.emit("load", json!({"model": name, "status": "loading"}));
        let n2 = name.clone();
        let r = tokio::task::spawn_blocking(move || Loaded::load(&n2, &path, &engine)).await;
        let state = match r {
            Ok(Ok(l)) => {
                let eff = l.effective_bytes;
                if let Some(e) = self.lock().get_mut(&name) {
                    e.effective = Some(eff);
                }
                State::Loaded(Arc::new(l))
            }
            Ok(Err(e)) => State::Failed(e.to_string()),
            Err(e) => State::Failed(format!("the loading thread failed: {e}")),
        };
        let status = match &state {
            State::Loaded(_) => "loaded".to_string(),
            State::Failed(w) => format!("failed: {w}"),
            _ => String::new(),
        };
        if let Some(e) = self.lock().get_mut(&name) {
            e.state = state;
            e.last_used = Instant::now();
        }
        self.emit("load", json!({"model": name, "status": status, "resident_bytes": resident_bytes()}));
        let v = self.model_json(&name);
        self.emit("model_memory", v);
        done.notify_waiters();
    }

    /// Idle loaded models to unload before loading `name`, least recently used first: while
    /// the count limit is reached, or while `name`'s `min` memory plus the margin does not fit
    /// on every device it uses ([`count_unloads`]). A model serving a request is never picked;
    /// when none is idle, the load goes ahead and its own planner decides.
    fn victims(&self, name: &str) -> Vec<(String, Arc<Loaded>)> {
        // Read before locking: nvidia-smi takes tens of milliseconds.
        let snapshot = self.devices.snapshot();
        let mut g = self.lock();
        let need = match g.get(name).map(|e| &e.memory) {
            Some(MemStatus::Measured { min, .. }) => min.clone(),
            _ => Vec::new(),
        };
        let mut idle: Vec<(Instant, String)> = g
            .iter()
            .filter_map(|(n, e)| match &e.state {
                State::Loaded(l) if Arc::strong_count(l) == 1 => Some((e.last_used, n.clone())),
                _ => None,
            })
            .collect();
        idle.sort();
        // What unloading each frees per device: the measured resident bytes in RAM, the
        // estimate elsewhere.
        let frees: Vec<BTreeMap<String, u64>> = idle
            .iter()
            .map(|(_, n)| {
                let e = &g[n];
                let mut f: BTreeMap<String, u64> = match &e.memory {
                    MemStatus::Measured { max, .. } => max.iter().map(|d| (d.device.clone(), d.need())).collect(),
                    _ => BTreeMap::new(),
                };
                if let Some(b) = e.effective {
                    f.insert(devices::CPU.into(), b);
                }
                f
            })
            .collect();
        let n_loaded = g.values().filter(|e| matches!(e.state, State::Loaded(_))).count();
        let n = count_unloads(&frees, n_loaded, self.router.models_max, &need, &snapshot, self.router.margin_bytes);
        let mut out = Vec::new();
        for (_, v) in idle.into_iter().take(n) {
            if let Some(e) = g.get_mut(&v) {
                if let State::Loaded(l) = std::mem::replace(&mut e.state, State::Unloaded) {
                    out.push((v, l));
                }
            }
        }
        out
    }

    /// Unloads `name` if it is idle. Returns whether it was unloaded.
    pub async fn unload(&self, name: &str) -> bool {
        let l = {
            let mut g = self.lock();
            match g.get_mut(name) {
                Some(e) if matches!(&e.state, State::Loaded(l) if Arc::strong_count(l) == 1) => {
                    match std::mem::replace(&mut e.state, State::Unloaded) {
                        State::Loaded(l) => l,
                        _ => return false,
                    }
                }
                _ => return false,
            }
        };
        let _ = tokio::task::spawn_blocking(move || drop(l)).await;
        self.emit("unload", json!({"model": name}));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn dev(device: &str, free: Option<u64>) -> DeviceMemory {
        DeviceMemory {
            device: device.into(),
            name: device.into(),
            total_bytes: free.map(|f| f * 2),
            free_bytes: free,
            source: "test".into(),
        }
    }

    fn on(device: &str, model: u64) -> DeviceBytes {
        DeviceBytes { device: device.into(), model, context: GIB / 2, compute: GIB / 2, ..Default::default() }
    }

    fn frees(list: &[(&str, u64)]) -> BTreeMap<String, u64> {
        list.iter().map(|(d, b)| (d.to_string(), *b)).collect()
    }

    #[test]
    fn unloads_until_min_fits_on_every_device_with_the_margin() {
        // RAM has room; the GPU has 3 GiB free and the new model needs 6 GiB there + 1 margin.
        let snapshot = vec![dev("cpu", Some(64 * GIB)), dev("gpu0", Some(3 * GIB))];
        let need = vec![on("cpu", 0), on("gpu0", 5 * GIB)];
        let idle = vec![
            frees(&[("cpu", GIB)]),                    // a CPU model: frees nothing on the GPU
            frees(&[("cpu", GIB), ("gpu0", 2 * GIB)]), // 5 GiB free then: still short
            frees(&[("cpu", GIB), ("gpu0", 2 * GIB)]), // 7 GiB free: fits with the margin
            frees(&[("gpu0", 8 * GIB)]),
        ];
        assert_eq!(count_unloads(&idle, 4, 0, &need, &snapshot, GIB), 3);
        // No margin asked: memory is not checked, nothing is unloaded.
        assert_eq!(count_unloads(&idle, 4, 0, &need, &snapshot, 0), 0);
        // Enough GPU memory already: nothing to unload.
        let roomy = vec![dev("cpu", Some(64 * GIB)), dev("gpu0", Some(40 * GIB))];
        assert_eq!(count_unloads(&idle, 4, 0, &need, &roomy, GIB), 0);
        // Short on RAM too: the first model that frees enough of both.
        let tight = vec![dev("cpu", Some(GIB)), dev("gpu0", Some(3 * GIB))];
        let need_both = vec![on("cpu", 2 * GIB), on("gpu0", 5 * GIB)];
        assert_eq!(count_unloads(&idle, 4, 0, &need_both, &tight, GIB), 3);
    }

    #[test]
    fn never_fitting_unloads_every_idle_model_and_the_count_limit_still_applies() {
        let snapshot = vec![dev("cpu", Some(GIB))];
        let idle = vec![frees(&[("cpu", GIB)]), frees(&[("cpu", GIB)])];
        assert_eq!(count_unloads(&idle, 2, 0, &[on("cpu", 100 * GIB)], &snapshot, GIB), 2);
        // Fits in memory, but two of at most two are loaded: one goes.
        let roomy = vec![dev("cpu", Some(64 * GIB))];
        assert_eq!(count_unloads(&idle, 2, 2, &[on("cpu", GIB)], &roomy, GIB), 1);
        assert_eq!(count_unloads(&idle, 1, 2, &[on("cpu", GIB)], &roomy, GIB), 0);
    }

    #[test]
    fn a_device_of_unknown_memory_is_not_checked() {
        let snapshot = vec![dev("cpu", Some(64 * GIB)), dev("gpu0", None)];
        let idle = vec![frees(&[("gpu0", 8 * GIB)])];
        assert_eq!(count_unloads(&idle, 1, 0, &[on("gpu0", 80 * GIB)], &snapshot, GIB), 0);
        // A device the snapshot does not list at all is unknown too.
        assert_eq!(count_unloads(&idle, 1, 0, &[on("gpu1", 80 * GIB)], &snapshot, GIB), 0);
    }

    #[test]
    fn gpu_index_is_read_from_the_planner_device_string() {
        assert_eq!(gpu_index(Some("gpu 3: NVIDIA H200")), Some(3));
        assert_eq!(gpu_index(Some("cpu: AMD EPYC")), None);
        assert_eq!(gpu_index(None), None);
    }
}
