//! [`Registry`]: the models the server knows, loaded on demand and unloaded least recently
//! used first, with per-model memory figures (estimated from metadata and the planner before
//! loading, measured after) and events for `/models/sse`.
//!
//! A model's name is only ever a key of this table, built by listing the models folder: a
//! request can name a model but never a path, so nothing outside the folder is reachable.

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
#[derive(Clone, Debug, Default)]
struct DeviceBytes {
    device: String,
    total: u64,
    free: u64,
    model: u64,
    context: u64,
    compute: u64,
}

impl DeviceBytes {
    fn json(&self) -> Value {
        json!({"device": self.device, "total": self.total, "free": self.free,
               "model": self.model, "context": self.context, "compute": self.compute})
    }
    fn need(&self) -> u64 {
        self.model + self.context + self.compute
    }
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
    state: State,
    last_used: Instant,
    memory: MemStatus,
    effective: Option<u64>,
}

/// The table of models.
pub struct Registry {
    entries: Mutex<BTreeMap<String, Entry>>,
    engine: EngineOptions,
    router: RouterOptions,
    events: broadcast::Sender<String>,
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

fn available_ram() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let get = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (get("MemTotal:"), get("MemAvailable:"))
}

/// `min` (context [`MIN_CTX`]) and `max` (the configured context) memory from the model's
/// metadata and the planner, without loading it.
fn estimate(path: &Path, engine: &EngineOptions) -> Result<(Vec<DeviceBytes>, Vec<DeviceBytes>), String> {
    let desc = plan::describe(path).map_err(|e| e.to_string())?;
    let w = desc.weights.as_ref().ok_or("no weight facts in the description")?;
    let machine = plan::probe(&plan::ProbeOptions { disk_paths: vec![], measure_bandwidth: false });
    let (total, free) = available_ram();
    let at = |n_ctx: u64| -> Result<Vec<DeviceBytes>, String> {
        let p = plan::plan_with(&desc, &machine, &plan::PlanOptions { n_ctx, ..Default::default() });
        let chosen = p.pick(engine.backend).map_err(|e| e.to_string())?;
        let est = chosen.estimate.as_ref().ok_or("no estimate")?;
        let context = w.kv_bytes_per_position * p.n_ctx + w.recurrent_state_bytes;
        let (device, bytes) = match chosen.backend {
            plan::BackendKind::Cpu => ("cpu".to_string(), est.ram_bytes),
            _ => (chosen.device.clone().unwrap_or_else(|| "gpu".into()), est.gpu_bytes),
        };
        let model = w.tensor_bytes.min(bytes.saturating_sub(context));
        let compute = bytes.saturating_sub(model + context);
        Ok(vec![DeviceBytes { device, total, free, model, context, compute }])
    };
    let max_ctx = if engine.n_ctx == 0 { plan::DEFAULT_MAX_CTX } else { engine.n_ctx };
    Ok((at(MIN_CTX.min(max_ctx))?, at(engine.n_ctx)?))
}

impl Registry {
    /// A registry of `models` (name, path).
    pub fn new(models: Vec<(String, PathBuf)>, engine: EngineOptions, router: RouterOptions) -> Arc<Registry> {
        let now = Instant::now();
        let entries = models
            .into_iter()
            .map(|(n, path)| {
                (
                    n,
                    Entry {
                        path,
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
            engine,
            router,
            events,
            load_lock: tokio::sync::Mutex::new(()),
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

    /// Computes every model's memory figures in the background (blocking threads).
    pub fn measure_all(self: &Arc<Self>) {
        let this = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            for name in this.names() {
                let path = {
                    let mut g = this.lock();
                    let Some(e) = g.get_mut(&name) else { continue };
                    e.memory = MemStatus::Measuring;
                    e.path.clone()
                };
                let m = match estimate(&path, &this.engine) {
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

    fn model_json_locked(name: &str, e: &Entry) -> Value {
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
                let effective = e.effective.map(|b| {
                    let mut d = max.first().cloned().unwrap_or_default();
                    d.free = available_ram().1;
                    let fixed = d.context + d.compute;
                    d.model = b.saturating_sub(fixed);
                    d.json()
                });
                json!({"status": "measured", "min": list(min), "max": list(max),
                       "effective": effective.map(|e| vec![e])})
            }
        };
        json!({"id": name, "object": "model", "path": e.path.file_name().and_then(|f| f.to_str()),
               "status": {"value": status}, "in_flight": in_flight, "memory": memory})
    }

    /// One model's state and memory as `/models` lists it.
    pub fn model_json(&self, name: &str) -> Value {
        self.lock().get(name).map_or(Value::Null, |e| Self::model_json_locked(name, e))
    }

    /// Every model, as `/models` lists them.
    pub fn models_json(&self) -> Value {
        let g = self.lock();
        json!({"object": "list", "data": g.iter().map(|(n, e)| Self::model_json_locked(n, e)).collect::<Vec<_>>()})
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
        let path = self.lock().get(&name).map(|e| e.path.clone());
        let Some(path) = path else { return };
        self.emit("load", json!({"model": name, "status": "loading"}));
        let engine = self.engine.clone();
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
    /// in free memory. A model serving a request is never picked; when none is idle, the
    /// load goes ahead and its own planner decides.
    fn victims(&self, name: &str) -> Vec<(String, Arc<Loaded>)> {
        let mut g = self.lock();
        let need = match g.get(name).map(|e| &e.memory) {
            Some(MemStatus::Measured { min, .. }) => min.iter().map(DeviceBytes::need).max().unwrap_or(0),
            _ => 0,
        };
        let mut idle: Vec<(Instant, String)> = g
            .iter()
            .filter_map(|(n, e)| match &e.state {
                State::Loaded(l) if Arc::strong_count(l) == 1 => Some((e.last_used, n.clone())),
                _ => None,
            })
            .collect();
        idle.sort();
        let mut n_loaded = g.values().filter(|e| matches!(e.state, State::Loaded(_))).count();
        let mut freed = 0u64;
        let mut out = Vec::new();
        for (_, n) in idle {
            let over_count = self.router.models_max > 0 && n_loaded >= self.router.models_max;
            let free = available_ram().1 + freed;
            let over_memory = self.router.margin_bytes > 0 && need + self.router.margin_bytes > free;
            if !over_count && !over_memory {
                break;
            }
            if let Some(e) = g.get_mut(&n) {
                if let State::Loaded(l) = std::mem::replace(&mut e.state, State::Unloaded) {
                    freed += e.effective.unwrap_or(0);
                    out.push((n, l));
                    n_loaded -= 1;
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
