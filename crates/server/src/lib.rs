//! `diskformer serve`: an OpenAI- and Anthropic-compatible HTTP server over [`plan::Session`],
//! with a router that loads models on demand and unloads idle ones least recently used first.
//!
//! Main types: [`Config`] and [`serve`] (bind and run), [`app`] (the axum router, for tests),
//! [`registry::Registry`] (models, loading, memory), [`engine::Loaded`] (one model's sessions,
//! tokenizer and template), [`error::ApiError`] (errors and their statuses).
//!
//! # Design
//! Compute never runs on async workers: each model's sessions run on their own engine threads
//! (`plan::Session`) and a blocking thread per request relays chunks into a channel the async
//! handler reads. Every request is admitted by a per-model semaphore of `queue_max` permits:
//! when none is left the answer is 503 at once, so the queue is bounded. Every handler and
//! stream holds its generation's abort guard, so a client that disconnects (its future or
//! body stream is dropped) stops its generation, queued or running. Requests are parsed from
//! bytes with `deny_unknown_fields`, so an unsupported field is a 400 naming it, never ignored.
#![deny(missing_docs)]

pub mod anthropic;
pub mod devices;
pub mod embed;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod presets;
pub mod registry;
pub mod tools;

/// Which cached expert a miss evicts, for paged experts.
pub use pager::CachePolicy;
/// The back ends a model can be served on (from the planner).
pub use plan::BackendKind;

use axum::extract::{Path as UrlPath, Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use engine::{EngineOptions, Event, Running};
use error::{ApiError, ErrorKind};
use metrics::Metrics;
use registry::{Registry, RouterOptions};
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Everything `diskformer serve` is started with.
#[derive(Clone, Debug)]
pub struct Config {
    /// Address to bind (127.0.0.1 unless asked otherwise).
    pub addr: SocketAddr,
    /// Models served: (name, path).
    pub models: Vec<(String, PathBuf)>,
    /// Models to load before serving.
    pub preload: Vec<String>,
    /// Loading and serving options.
    pub engine: EngineOptions,
    /// Per-model options replacing `engine` for the models named (from a presets file).
    pub model_options: std::collections::BTreeMap<String, EngineOptions>,
    /// Router options.
    pub router: RouterOptions,
    /// Required on every route but `/health` (`Authorization: Bearer` or `x-api-key`).
    pub api_key: Option<String>,
}

/// Shared by every handler.
#[derive(Clone)]
pub struct AppState {
    /// The models.
    pub registry: Arc<Registry>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    api_key: Option<Arc<str>>,
}

/// `?autoload=false` on a request.
#[derive(Deserialize, Debug, Default)]
pub struct ModelQuery {
    /// Overrides the server's autoload setting for this request.
    pub autoload: Option<bool>,
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The sending end of an SSE response.
pub struct SseSink {
    tx: mpsc::Sender<SseEvent>,
}

impl SseSink {
    /// Sends one event (`name` for Anthropic's `event:` lines). False when the client is gone.
    ///
    /// # Cancel safety
    /// Cancel safe: an event not sent is dropped.
    pub async fn send(&mut self, name: Option<&str>, data: Value) -> bool {
        let mut e = SseEvent::default().data(data.to_string());
        if let Some(n) = name {
            e = e.event(n);
        }
        self.tx.send(e).await.is_ok()
    }

    /// Sends OpenAI's closing `data: [DONE]`.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn done(&mut self) {
        let _ = self.tx.send(SseEvent::default().data("[DONE]")).await;
    }

    /// The next generation event, or `None` when the generation ended or the client is gone.
    ///
    /// # Cancel safety
    /// Cancel safe (both branches are).
    pub async fn next_event(&mut self, running: &mut Running) -> Option<Event> {
        tokio::select! {
            _ = self.tx.closed() => None,
            e = running.rx.recv() => e,
        }
    }
}

/// An SSE response whose events `produce` sends from its own task. The response body reads a
/// channel; when the client disconnects the body is dropped, the channel closes, `produce`
/// sees it and returns, dropping its generation (which aborts it).
pub fn sse_response<F, Fut>(produce: F) -> Response
where
    F: FnOnce(SseSink) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<SseEvent>(32);
    tokio::spawn(produce(SseSink { tx }));
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx)) });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// Checks the API key on every route but `/health`.
async fn auth(State(state): State<AppState>, headers: HeaderMap, req: Request, next: Next) -> Response {
    let Some(key) = state.api_key.as_deref() else { return next.run(req).await };
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    if given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
        return next.run(req).await;
    }
    let e = ApiError::new(
        ErrorKind::Authentication,
        "missing or invalid API key (Authorization: Bearer <key> or x-api-key)",
    );
    if req.uri().path().starts_with("/v1/messages") {
        error::AnthropicError(e).into_response()
    } else {
        e.into_response()
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn metrics_route(State(state): State<AppState>) -> Response {
    let body = state.metrics.render(
        &state.registry.in_flight(),
        &state.registry.expert_caches(),
        &state.registry.expert_tiers(),
        engine::resident_bytes(),
    );
    ([("content-type", "text/plain; version=0.0.4")], body).into_response()
}

async fn models_route(State(state): State<AppState>) -> Json<Value> {
    Json(state.registry.models_json())
}

/// `POST /models/{name}/unload`: unloads an idle model.
async fn unload_route(State(state): State<AppState>, UrlPath(name): UrlPath<String>) -> Result<Json<Value>, ApiError> {
    if !state.registry.names().contains(&name) {
        return Err(ApiError::new(ErrorKind::NotFound, format!("model {name:?} is not known")));
    }
    let unloaded = state.registry.unload(&name).await;
    Ok(Json(json!({"model": name, "unloaded": unloaded})))
}

/// `GET /models/sse`: the registry's events, each as `event: <name>` with JSON data.
async fn models_sse(State(state): State<AppState>) -> Response {
    let mut rx = state.registry.subscribe();
    sse_response(move |mut sink| async move {
        loop {
            let msg = tokio::select! {
                _ = sink.tx.closed() => return,
                m = rx.recv() => m,
            };
            match msg {
                Ok(s) => {
                    let v: Value = serde_json::from_str(&s).unwrap_or(Value::Null);
                    let name = v["event"].as_str().unwrap_or("message").to_string();
                    if !sink.send(Some(&name), v["data"].clone()).await {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(_) => return,
            }
        }
    })
}

async fn not_found() -> ApiError {
    ApiError::new(ErrorKind::NotFound, "no such route")
}

/// The application: every route, with the API-key check.
pub fn app(registry: Arc<Registry>, metrics: Arc<Metrics>, api_key: Option<String>) -> Router {
    let state = AppState { registry, metrics, api_key: api_key.map(Arc::from) };
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_route))
        .route("/models", get(models_route))
        .route("/models/sse", get(models_sse))
        .route("/models/{name}/unload", post(unload_route))
        .route("/v1/models", get(openai::list_models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/chat/completions/input_tokens", post(openai::chat_input_tokens))
        .route("/chat/completions/input_tokens", post(openai::chat_input_tokens))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

/// Binds `config.addr`, starts background memory measurement, loads `preload`, and serves
/// until `shutdown` resolves. Calls `ready` with the bound address once accepting.
///
/// # Errors
/// The address cannot be bound; a preloaded model fails to load.
pub async fn serve(
    config: Config,
    ready: impl FnOnce(SocketAddr),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ApiError> {
    // Listing GPU adapters blocks (a graphics-API instance is made).
    let devices = tokio::task::spawn_blocking(devices::OsDevices::new)
        .await
        .map_err(|e| ApiError::new(ErrorKind::Internal, format!("listing devices failed: {e}")))?;
    serve_with_devices(config, Arc::new(devices), ready, shutdown).await
}

/// As [`serve`], with the router's device memory read from `devices` (tests give fixed
/// figures).
///
/// # Errors
/// As [`serve`].
pub async fn serve_with_devices(
    config: Config,
    devices: Arc<dyn devices::DeviceMemorySource>,
    ready: impl FnOnce(SocketAddr),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ApiError> {
    let registry = Registry::with_devices(
        config.models.clone(),
        config.engine.clone(),
        config.model_options.clone(),
        config.router.clone(),
        devices,
    );
    registry.measure_all();
    for name in &config.preload {
        registry.get(name, Some(true)).await?;
    }
    let metrics = Arc::new(Metrics::default());
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|e| ApiError::new(ErrorKind::Unavailable, format!("cannot bind {}: {e}", config.addr)))?;
    let addr =
        listener.local_addr().map_err(|e| ApiError::new(ErrorKind::Internal, format!("no local address: {e}")))?;
    ready(addr);
    axum::serve(listener, app(registry, metrics, config.api_key))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| ApiError::new(ErrorKind::Internal, format!("server failed: {e}")))
}
