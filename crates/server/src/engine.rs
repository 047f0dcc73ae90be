//! [`Loaded`]: one model's sessions (slots), its tokenizer and template, and generation runs
//! that stream [`Event`]s to async handlers from a blocking thread.

use crate::error::{ApiError, ErrorKind};
use crate::metrics::Metrics;
use plan::{ChunkKind, GenerateOptions, Input, Session, StopReason};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokenizer::{ChatOptions, ChatTemplate, Tokenizer};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// How models are loaded and served.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Context length (0: the model's, capped by the planner).
    pub n_ctx: u64,
    /// Sessions per model: requests served at once.
    pub parallel: usize,
    /// Requests admitted per model (running and waiting); beyond it requests get 503.
    pub queue_max: usize,
    /// Back end (`None`: the planner's choice).
    pub backend: Option<plan::BackendKind>,
    /// Read the weights into the page cache before serving.
    pub read_ahead: bool,
    /// A chat template (Jinja source) replacing the models' own.
    pub chat_template: Option<String>,
    /// Page a mixture-of-experts model's experts from disk through a host cache of at most
    /// this many bytes, shared by the model's sessions (`None`: experts mapped in place).
    pub ram_budget_bytes: Option<u64>,
    /// Which cached expert a miss evicts (with a RAM budget).
    pub cache_policy: pager::CachePolicy,
    /// With a RAM budget: read the next layer's likely experts in the background.
    pub prefetch: bool,
    /// With a RAM budget: read experts with `O_DIRECT` where the filesystem allows it.
    pub direct_io: bool,
    /// Print the expert cache's per-layer statistics to stderr when the model is unloaded
    /// (or the server stops).
    pub stats: bool,
    /// Run a mixture-of-experts model on the GPU expert tier within this many bytes of GPU
    /// memory (dense weights, KV cache, scratch and a pool of expert slots; `plan::gpu_tier`, as
    /// `diskformer run --gpu-budget`), its misses served from a host copy or, with
    /// `ram_budget_bytes`, through a RAM cache of that size. One session per model (the budget
    /// is the model's, not each session's).
    pub gpu_budget_bytes: Option<u64>,
    /// On the GPU expert tier: how an expert without a slot is served (`None`: the tier's
    /// default, the host copy when every expert fits in RAM).
    pub moe_miss: Option<plan::TierMiss>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            n_ctx: 0,
            parallel: 1,
            queue_max: 16,
            backend: None,
            read_ahead: true,
            chat_template: None,
            ram_budget_bytes: None,
            // `diskformer run`'s default.
            cache_policy: pager::CachePolicy::Lfu,
            prefetch: false,
            direct_io: false,
            stats: false,
            gpu_budget_bytes: None,
            moe_miss: None,
        }
    }
}

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The planner or the model loader refused it.
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    /// The expert cache could not be opened (no experts, budget too small, I/O).
    #[error("{model}: the expert cache: {source}")]
    Pager {
        /// The GGUF.
        model: String,
        /// The pager's error.
        source: pager::PagerError,
    },
}

/// A loaded model.
pub struct Loaded {
    /// The model's name in requests.
    pub name: String,
    /// The GGUF.
    pub path: PathBuf,
    sessions: Vec<Session>,
    active: Vec<AtomicUsize>,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    bos_text: Option<String>,
    /// Context length of each session.
    pub n_ctx: usize,
    /// The back end's name.
    pub backend_name: &'static str,
    admit: Arc<Semaphore>,
    queue_max: usize,
    /// Resident memory the load added (bytes), measured around it.
    pub effective_bytes: u64,
    /// How long loading took.
    pub load_ms: f64,
    /// An embedding model's runner (then `sessions` is empty: the planner serves generation
    /// only); `Ok(None)`: a generative model; `Err`: a pooling type that is not served, with
    /// the reason (the model is still served for generation).
    embedding: Result<Option<crate::embed::Embedder>, String>,
    /// The expert cache every session shares, when experts are paged.
    pager: Option<Arc<pager::Pager>>,
    /// Print the expert cache's statistics when dropped.
    print_stats: bool,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        if let (true, Some(p)) = (self.print_stats, &self.pager) {
            eprint!("model {}: {}", self.name, p.format_stats());
        }
        if let (true, Some(stats)) = (self.print_stats, self.sessions.first().and_then(|s| s.expert_tier_stats())) {
            eprint!("model {}: {stats}", self.name);
        }
    }
}

/// Sampling and stopping of one request.
#[derive(Clone, Debug)]
pub struct GenOptions {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Sampling parameters.
    pub sampling: models::sampling::SamplingParams,
    /// Strings that end the answer (not included in it).
    pub stop: Vec<String>,
}

/// Why a generation ended, as the APIs say it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-generation token or a stop string.
    Stop,
    /// A stop string matched (Anthropic reports it apart).
    StopSequence,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// The client went away.
    Cancelled,
}

/// The end of a generation.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Why it ended.
    pub reason: FinishReason,
    /// The stop string that matched.
    pub stop_sequence: Option<String>,
    /// Prompt tokens.
    pub n_prompt: usize,
    /// Of those, taken from the KV cache.
    pub n_cached: usize,
    /// Tokens generated.
    pub n_generated: usize,
}

/// What a running generation sends.
#[derive(Debug)]
pub enum Event {
    /// Answer text.
    Text(String),
    /// Reasoning text.
    Reasoning(String),
    /// The end.
    Done(Outcome),
    /// A failure; nothing follows.
    Failed(ApiError),
}

/// Aborts the generation when dropped: a handler or stream dropped because the client
/// disconnected stops its generation, queued or running.
pub struct AbortOnDrop(Option<plan::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

/// A started generation: its events, and the guard that cancels it.
pub struct Running {
    /// Events, in order; the channel closes after `Done` or `Failed`.
    pub rx: mpsc::Receiver<Event>,
    /// Cancels the generation on drop.
    pub guard: AbortOnDrop,
}

/// Resident set size of this process, from /proc (0 where unavailable).
pub fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4096)
}

impl Loaded {
    /// Loads `path` with `opts.parallel` sessions. Blocking: call from a blocking thread.
    ///
    /// # Errors
    /// The planner's and loader's errors.
    pub fn load(name: &str, path: &Path, opts: &EngineOptions) -> Result<Loaded, LoadError> {
        let t0 = Instant::now();
        let rss0 = resident_bytes();
        let file = gguf::GgufModel::open(path).map_err(plan::PlanError::from)?;
        let pooling = crate::embed::Pooling::of(file.metadata());
        let tokenizer = Tokenizer::from_gguf(file.metadata()).map_err(plan::PlanError::from)?;
        let bos_text = tokenizer.bos().and_then(|b| tokenizer.token_text(b)).map(str::to_string);
        let template = match &opts.chat_template {
            Some(src) => {
                let eos = tokenizer.eos().and_then(|e| tokenizer.token_text(e)).unwrap_or("");
                Some(ChatTemplate::new(src, bos_text.as_deref().unwrap_or(""), eos).map_err(plan::PlanError::from)?)
            }
            None => ChatTemplate::from_gguf(file.metadata()).map_err(plan::PlanError::from)?,
        };
        drop(file);
        let mut sessions = Vec::new();
        if let Ok(Some(pooling)) = pooling {
            let e = crate::embed::Embedder::load(path, opts.n_ctx as usize, pooling)?;
            return Ok(Loaded {
                name: name.to_string(),
                path: path.to_path_buf(),
                sessions,
                active: Vec::new(),
                tokenizer,
                template,
                bos_text,
                n_ctx: e.n_ctx,
                backend_name: "cpu",
                admit: Arc::new(Semaphore::new(opts.queue_max.max(1))),
                queue_max: opts.queue_max.max(1),
                effective_bytes: resident_bytes().saturating_sub(rss0),
                load_ms: t0.elapsed().as_secs_f64() * 1e3,
                embedding: Ok(Some(e)),
                pager: None,
                print_stats: false,
            });
        }
        if opts.gpu_budget_bytes.is_some() && opts.parallel > 1 {
            return Err(plan::PlanError::Request {
                why: format!(
                    "a GPU budget is the model's: the GPU expert tier serves one session, not {} (set parallel = 1 for it)",
                    opts.parallel
                ),
            }
            .into());
        }
        let pager = match opts.ram_budget_bytes {
            // The GPU expert tier opens its own RAM cache when it needs one.
            _ if opts.gpu_budget_bytes.is_some() => None,
            None => None,
            Some(budget) => {
                let file = Arc::new(gguf::GgufModel::open(path).map_err(plan::PlanError::from)?);
                let popts = pager::PagerOptions {
                    prefetch: opts.prefetch,
                    direct_io: opts.direct_io,
                    ..pager::PagerOptions::new(budget, opts.cache_policy)
                };
                let pager = pager::Pager::open(&file, &popts)
                    .map_err(|source| LoadError::Pager { model: path.display().to_string(), source })?;
                if let Some(why) = pager.direct_io_refused() {
                    tracing::warn!("model {name}: {why}");
                }
                Some(Arc::new(pager))
            }
        };
        for i in 0..opts.parallel.max(1) {
            let lo = plan::LoadOptions {
                backend: opts.backend,
                plan: plan::PlanOptions { n_ctx: opts.n_ctx, ..Default::default() },
                measure_bandwidth: false,
                // Reading every page ahead would pull all the experts in, which paging avoids.
                read_ahead: opts.read_ahead && i == 0 && pager.is_none() && opts.gpu_budget_bytes.is_none(),
                expert_store: pager.clone().map(|p| p as Arc<dyn compute::ExpertStore>),
                gpu_tier: opts.gpu_budget_bytes.map(|budget_bytes| plan::GpuTierOptions {
                    budget_bytes,
                    ram_budget_bytes: opts.ram_budget_bytes,
                    miss: opts.moe_miss,
                    cache_policy: opts.cache_policy,
                    prefetch: opts.prefetch,
                    direct_io: opts.direct_io,
                    gpu_index: None,
                    matmul: plan::MatmulMode::QuantizedActivations,
                }),
                paging: plan::PagingOptions {
                    miss: opts.moe_miss,
                    cache_policy: opts.cache_policy,
                    prefetch: opts.prefetch,
                    direct_io: opts.direct_io,
                },
                ..Default::default()
            };
            let session = plan::load(path, lo)?;
            if let Some(line) = &session.info().gpu_tier {
                tracing::info!("model {name}: {line}");
            }
            // The planner put the model on the GPU expert tier with the device's memory as its
            // budget, or paged its experts through a cache of the available RAM: a second
            // session would ask for that memory again.
            let info = session.info();
            let planned_cache = info.backend == plan::BackendKind::GpuPaged || info.expert_cache_bytes.is_some();
            sessions.push(session);
            if planned_cache && opts.parallel > 1 {
                tracing::warn!(
                    "model {name}: its experts are paged by the plan (GPU tier or RAM cache), one session serves it, not {}",
                    opts.parallel
                );
                break;
            }
        }
        let info = sessions[0].info();
        let (n_ctx, backend_name) = (info.n_ctx, info.backend_name);
        let active = sessions.iter().map(|_| AtomicUsize::new(0)).collect();
        Ok(Loaded {
            name: name.to_string(),
            path: path.to_path_buf(),
            sessions,
            active,
            tokenizer,
            template,
            bos_text,
            n_ctx,
            backend_name,
            admit: Arc::new(Semaphore::new(opts.queue_max.max(1))),
            queue_max: opts.queue_max.max(1),
            effective_bytes: resident_bytes().saturating_sub(rss0),
            load_ms: t0.elapsed().as_secs_f64() * 1e3,
            embedding: pooling.map(|_| None),
            pager,
            print_stats: opts.stats,
        })
    }

    /// The expert cache, when experts are paged.
    pub fn pager(&self) -> Option<&pager::Pager> {
        self.pager.as_deref()
    }

    /// Sessions serving the model (requests it runs at once; 1 for an embedding model).
    pub fn n_sessions(&self) -> usize {
        self.sessions.len().max(1)
    }

    /// The GPU expert tier's counters, when the model runs on it (one session per such model).
    pub fn expert_tier_totals(&self) -> Option<plan::ExpertTierStats> {
        self.sessions.first().and_then(|s| s.expert_tier_totals())
    }

    /// The pooling of an embedding model (`None` for a generative one).
    pub fn pooling(&self) -> Option<crate::embed::Pooling> {
        self.embedding.as_ref().ok().and_then(|e| e.as_ref().map(|e| e.pooling))
    }

    /// Embeds each input (text, or token ids) with the model's pooling, L2-normalized; returns
    /// the vectors and the tokens evaluated. Admitted by the same bounded queue as generation;
    /// runs on a blocking thread.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the blocking computation to finish and be discarded; its
    /// queue permit is released when it ends.
    ///
    /// # Errors
    /// A generative model; a full queue (503); tokens outside the vocabulary; an input longer
    /// than the context.
    pub async fn embed(
        self: &Arc<Self>,
        inputs: crate::openai::EmbeddingInput,
        metrics: &Metrics,
    ) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
        match &self.embedding {
            Ok(Some(_)) => {}
            Ok(None) => {
                return Err(ApiError::invalid_param(
                    "model",
                    format!(
                        "model {} is a text-generation model (its metadata has no pooling_type); \
                         /v1/embeddings needs an embedding model",
                        self.name
                    ),
                ))
            }
            Err(why) => return Err(ApiError::invalid_param("model", format!("model {}: {why}", self.name))),
        }
        let permit = self.admit.clone().try_acquire_owned().map_err(|_| {
            metrics.rejected.fetch_add(1, Ordering::Relaxed);
            ApiError::new(
                ErrorKind::Overloaded,
                format!("model {} is busy: {} requests are queued or running; retry later", self.name, self.queue_max),
            )
        })?;
        let n_vocab = self.tokenizer.n_vocab();
        let ids: Vec<Vec<u32>> = match inputs {
            crate::openai::EmbeddingInput::One(t) => vec![self.tokenizer.encode(&t, true, true)?],
            crate::openai::EmbeddingInput::Many(ts) => {
                ts.iter().map(|t| self.tokenizer.encode(t, true, true)).collect::<Result<_, _>>()?
            }
            crate::openai::EmbeddingInput::Tokens(ids) => vec![ids],
            crate::openai::EmbeddingInput::ManyTokens(list) => list,
        };
        if ids.is_empty() {
            return Err(ApiError::invalid_param("input", "input is an empty list"));
        }
        if let Some(&bad) = ids.iter().flatten().find(|&&id| id as usize >= n_vocab) {
            return Err(ApiError::invalid_param(
                "input",
                format!("token id {bad} is outside the vocabulary of {n_vocab} tokens"),
            ));
        }
        let n_tokens = ids.iter().map(Vec::len).sum();
        let this = Arc::clone(self);
        let vectors = tokio::task::spawn_blocking(move || {
            let _permit: OwnedSemaphorePermit = permit;
            match &this.embedding {
                Ok(Some(embedder)) => embedder.embed(&ids),
                _ => Err(ApiError::new(ErrorKind::Internal, "the embedding runner went away")),
            }
        })
        .await
        .map_err(|e| ApiError::new(ErrorKind::Internal, format!("the embedding thread failed: {e}")))??;
        metrics.prompt_tokens.fetch_add(n_tokens as u64, Ordering::Relaxed);
        Ok((vectors, n_tokens))
    }

    /// Requests admitted now (running or waiting).
    pub fn in_flight(&self) -> usize {
        self.queue_max - self.admit.available_permits()
    }

    /// Whether the model has a chat template.
    pub fn has_template(&self) -> bool {
        self.template.is_some()
    }

    /// Renders a conversation (OpenAI-form JSON messages) with tools for generation.
    ///
    /// # Errors
    /// No chat template; the template failing.
    pub fn render_chat(
        &self,
        messages: &[Value],
        tools: Option<Value>,
        thinking: Option<bool>,
    ) -> Result<String, ApiError> {
        let t = self.template.as_ref().ok_or_else(|| {
            ApiError::invalid(format!(
                "model {} has no chat template (tokenizer.chat_template); use /v1/completions with a prompt",
                self.name
            ))
        })?;
        if let (Some(Value::Array(list)), false) = (&tools, t.reads_tools()) {
            let messages = crate::tools::describe_tools_in_system(messages, list);
            let opts = ChatOptions { add_generation_prompt: true, enable_thinking: thinking, ..Default::default() };
            return Ok(t.render_json(&messages, &opts)?);
        }
        let opts = ChatOptions { add_generation_prompt: true, enable_thinking: thinking, tools, ..Default::default() };
        Ok(t.render_json(messages, &opts)?)
    }

    /// The text as the engine encodes a raw prompt: a BOS the template wrote is dropped when
    /// the tokenizer adds its own, so it is not doubled.
    fn prompt_text(&self, rendered: String) -> String {
        match &self.bos_text {
            Some(b) if !b.is_empty() && self.tokenizer.add_bos() && rendered.starts_with(b.as_str()) => {
                rendered[b.len()..].to_string()
            }
            _ => rendered,
        }
    }

    /// Tokens the engine will evaluate for `rendered`.
    ///
    /// # Errors
    /// The tokenizer failing.
    pub fn count_tokens(&self, rendered: &str) -> Result<usize, ApiError> {
        Ok(self.tokenizer.encode(&self.prompt_text(rendered.to_string()), true, true)?.len())
    }

    /// Admits a request (or refuses it with 503 when the queue is full) and starts its
    /// generation on the least busy session. The engine runs on the session's thread and a
    /// blocking thread relays its chunks; nothing here computes on async workers.
    ///
    /// # Errors
    /// [`ErrorKind::Overloaded`] when `queue_max` requests are admitted already; a prompt that
    /// does not fit the context.
    pub fn start(
        self: &Arc<Self>,
        rendered: String,
        opts: GenOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Running, ApiError> {
        if self.sessions.is_empty() {
            return Err(ApiError::invalid_param(
                "model",
                format!("model {} is an embedding model: use /v1/embeddings", self.name),
            ));
        }
        let permit = self.admit.clone().try_acquire_owned().map_err(|_| {
            metrics.rejected.fetch_add(1, Ordering::Relaxed);
            ApiError::new(
                ErrorKind::Overloaded,
                format!("model {} is busy: {} requests are queued or running; retry later", self.name, self.queue_max),
            )
        })?;
        let text = self.prompt_text(rendered);
        let n_prompt = self.tokenizer.encode(&text, true, true)?.len();
        if n_prompt + 1 > self.n_ctx {
            return Err(ApiError::invalid(format!(
                "the prompt has {n_prompt} tokens but the context holds {}; shorten it",
                self.n_ctx
            )));
        }
        let slot = (0..self.sessions.len()).min_by_key(|&i| self.active[i].load(Ordering::Relaxed)).unwrap_or(0);
        self.active[slot].fetch_add(1, Ordering::Relaxed);
        let gopts = GenerateOptions { max_tokens: opts.max_tokens, sampling: opts.sampling.clone(), thinking: None };
        let generation = self.sessions[slot].generate(Input::Prompt(text), gopts);
        let guard = AbortOnDrop(Some(generation.abort_handle()));
        let (tx, rx) = mpsc::channel(64);
        let this = Arc::clone(self);
        metrics.requests.fetch_add(1, Ordering::Relaxed);
        tokio::task::spawn_blocking(move || {
            let last = relay(generation, &opts.stop, &tx, &metrics);
            // The slot, the admission permit and this handle on the model go before the last
            // event: a client that sends its next request as soon as it has the answer finds a
            // permit free and the model idle (the router may unload it for another), where
            // releasing them after raced with that request.
            this.active[slot].fetch_sub(1, Ordering::Relaxed);
            drop::<OwnedSemaphorePermit>(permit);
            drop(this);
            let _ = tx.blocking_send(last);
        });
        Ok(Running { rx, guard })
    }
}

/// Bytes at the end of `text` that could begin a stop string (held back until known).
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut keep = 0;
    for s in stops {
        for n in (1..s.len().min(text.len() + 1)).rev() {
            if text.is_char_boundary(text.len() - n) && s.is_char_boundary(n) && text.ends_with(&s[..n]) {
                keep = keep.max(n);
                break;
            }
        }
    }
    keep
}

/// The earliest stop string in `text`: (byte offset, the string).
fn find_stop<'a>(text: &str, stops: &'a [String]) -> Option<(usize, &'a String)> {
    stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str()).map(|i| (i, s))).min_by_key(|p| p.0)
}

/// Reads the engine's chunks (blocking) and sends the text and reasoning events; ends the
/// generation early on a stop string or when the receiver is gone. Returns the last event
/// (`Done` or `Failed`), which the caller sends once it has released what the request held.
fn relay(mut generation: plan::Generation, stops: &[String], tx: &mpsc::Sender<Event>, metrics: &Metrics) -> Event {
    let abort = generation.abort_handle();
    let mut pending = String::new();
    let mut stop_hit: Option<String> = None;
    let mut gone = false;
    for chunk in generation.by_ref() {
        let event = match chunk.kind {
            ChunkKind::Reasoning => Event::Reasoning(chunk.text),
            ChunkKind::Text => {
                pending.push_str(&chunk.text);
                if let Some((at, s)) = find_stop(&pending, stops) {
                    pending.truncate(at);
                    stop_hit = Some(s.clone());
                    abort.abort();
                    Event::Text(std::mem::take(&mut pending))
                } else {
                    let emit = pending.len() - held_back(&pending, stops);
                    let rest = pending.split_off(emit);
                    Event::Text(std::mem::replace(&mut pending, rest))
                }
            }
        };
        let empty = matches!(&event, Event::Text(t) | Event::Reasoning(t) if t.is_empty());
        if !empty && tx.blocking_send(event).is_err() {
            gone = true;
            abort.abort();
        }
        if stop_hit.is_some() || gone {
            break;
        }
    }
    if !pending.is_empty() && stop_hit.is_none() && !gone {
        let _ = tx.blocking_send(Event::Text(pending));
    }
    match generation.finish() {
        Ok(f) => {
            metrics.record(&f);
            let reason = match (&stop_hit, f.stop) {
                (Some(_), _) => FinishReason::StopSequence,
                (None, StopReason::EndOfGeneration) => FinishReason::Stop,
                (None, StopReason::MaxTokens | StopReason::ContextFull) => FinishReason::Length,
                (None, StopReason::Aborted) => FinishReason::Cancelled,
            };
            if reason == FinishReason::Cancelled {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            Event::Done(Outcome {
                reason,
                stop_sequence: stop_hit,
                n_prompt: f.n_prompt_tokens,
                n_cached: f.n_cached_tokens,
                n_generated: f.n_generated,
            })
        }
        Err(e) => Event::Failed(e.into()),
    }
}

/// A whole generation, collected.
#[derive(Debug, Default)]
pub struct Collected {
    /// Answer text.
    pub text: String,
    /// Reasoning text.
    pub reasoning: String,
    /// The end.
    pub outcome: Option<Outcome>,
}

impl Running {
    /// Collects every event.
    ///
    /// # Cancel safety
    /// Dropping this future drops `self`, whose guard aborts the generation: a client that
    /// disconnects during a non-streaming request stops its generation.
    ///
    /// # Errors
    /// The engine's failure.
    pub async fn collect(mut self) -> Result<Collected, ApiError> {
        let mut c = Collected::default();
        while let Some(e) = self.rx.recv().await {
            match e {
                Event::Text(t) => c.text.push_str(&t),
                Event::Reasoning(t) => c.reasoning.push_str(&t),
                Event::Done(o) => c.outcome = Some(o),
                Event::Failed(e) => return Err(e),
            }
        }
        if c.outcome.is_none() {
            return Err(ApiError::new(ErrorKind::Internal, "the generation ended without an outcome"));
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_prefixes_are_held_back() {
        let stops = vec!["</s>".to_string(), "END".to_string()];
        assert_eq!(held_back("hello </", &stops), 2);
        assert_eq!(held_back("hello E", &stops), 1);
        assert_eq!(held_back("hello", &stops), 0);
        assert_eq!(find_stop("a END b </s>", &stops).map(|p| p.0), Some(2));
    }
}
