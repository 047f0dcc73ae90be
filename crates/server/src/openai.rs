//! OpenAI-compatible routes: `/v1/chat/completions` (and its `/input_tokens`),
//! `/v1/completions`, `/v1/models`, `/v1/embeddings`.

use crate::engine::{Event, FinishReason, GenOptions, Loaded, Outcome, Running};
use crate::error::{parse_body, ApiError};
use crate::tools::{active_tools, referenced_tools, ToolCall, ToolFilter};
use crate::{sse_response, unix_now, AppState, ModelQuery, SseSink};
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeSet;

/// `stop`: one string or a list.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl StopField {
    fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Sampling fields shared by chat and completions (inlined in each request: serde's
/// `deny_unknown_fields` does not work through `flatten`).
#[derive(Debug, Clone, Default)]
struct Sampling {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    seed: Option<u64>,
    repeat_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
}

/// Sampling parameters from request fields; defaults are llama-server's.
pub fn sampling_params(
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    seed: Option<u64>,
) -> Result<models::sampling::SamplingParams, ApiError> {
    let mut p = models::sampling::SamplingParams::default();
    if let Some(t) = temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::invalid_param("temperature", format!("temperature {t} is outside [0, 2]")));
        }
        p.temperature = t;
    }
    if let Some(v) = top_p {
        if !(0.0..=1.0).contains(&v) || v == 0.0 {
            return Err(ApiError::invalid_param("top_p", format!("top_p {v} is outside (0, 1]")));
        }
        p.top_p = v;
    }
    if let Some(k) = top_k {
        p.top_k = k;
    }
    if let Some(m) = min_p {
        if !(0.0..=1.0).contains(&m) {
            return Err(ApiError::invalid_param("min_p", format!("min_p {m} is outside [0, 1]")));
        }
        p.min_p = m;
    }
    p.seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    });
    Ok(p)
}

macro_rules! sampling_of {
    ($r:expr) => {
        Sampling {
            temperature: $r.temperature,
            top_p: $r.top_p,
            top_k: $r.top_k,
            min_p: $r.min_p,
            seed: $r.seed,
            repeat_penalty: $r.repeat_penalty,
            presence_penalty: $r.presence_penalty,
            frequency_penalty: $r.frequency_penalty,
        }
    };
}

impl Sampling {
    fn params(&self) -> Result<models::sampling::SamplingParams, ApiError> {
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if v.is_some_and(|x| x != 0.0) {
                return Err(ApiError::invalid_param(name, format!("{name} is not supported (use repeat_penalty)")));
            }
        }
        let mut p = sampling_params(self.temperature, self.top_p, self.top_k, self.min_p, self.seed)?;
        if let Some(r) = self.repeat_penalty {
            p.repeat_penalty = r;
        }
        Ok(p)
    }
}

/// A chat completion request. Unknown fields are refused.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    model: String,
    messages: Vec<Value>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    seed: Option<u64>,
    repeat_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    stop: Option<StopField>,
    n: Option<u32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    user: Option<String>,
    logprobs: Option<bool>,
    response_format: Option<Value>,
    reasoning_effort: Option<String>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// What a chat request renders to.
pub struct Prepared {
    /// The rendered prompt.
    pub rendered: String,
    /// Names of tools whose calls are parsed.
    pub tool_names: BTreeSet<String>,
}

/// Text parts (OpenAI's content parts, Anthropic's blocks: `what`) joined; `tool_reference`
/// parts dropped (they act through the tools); any other type is an error naming it.
pub(crate) fn join_text_parts(parts: &[Value], where_: &str, what: &str) -> Result<String, ApiError> {
    let mut s = String::new();
    for p in parts {
        match p.get("type").and_then(Value::as_str) {
            Some("text") => s.push_str(p.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("tool_reference") => {}
            other => {
                return Err(ApiError::invalid_param(
                    where_,
                    format!("{what} type {other:?} is not supported here (text only)"),
                ))
            }
        }
    }
    Ok(s)
}

/// Content parts joined to text ([`join_text_parts`]).
fn text_of_content(content: &Value, where_: &str) -> Result<Value, ApiError> {
    match content {
        Value::Array(parts) => Ok(Value::String(join_text_parts(parts, where_, "content part")?)),
        other => Ok(other.clone()),
    }
}

/// Messages as the template reads them: text content, tool call arguments as objects.
pub fn normalize_messages(messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let mut m = m.clone();
        let obj = m
            .as_object_mut()
            .ok_or_else(|| ApiError::invalid_param(&format!("messages[{i}]"), "a message must be an object"))?;
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::invalid_param(&format!("messages[{i}].role"), "missing or not a string"));
        }
        if let Some(c) = obj.get("content") {
            let c = text_of_content(c, &format!("messages[{i}].content"))?;
            obj.insert("content".into(), c);
        }
        if let Some(Value::Array(calls)) = obj.get_mut("tool_calls") {
            for c in calls {
                if let Some(f) = c.get_mut("function") {
                    if let Some(Value::String(s)) = f.get("arguments") {
                        if let Ok(v) = serde_json::from_str::<Value>(s) {
                            f["arguments"] = v;
                        }
                    }
                }
            }
        }
        out.push(m);
    }
    Ok(out)
}

/// Renders messages with tools (after `tool_choice` and deferral) on `model`.
pub fn prepare_chat(
    model: &Loaded,
    messages: &[Value],
    tools: Option<&[Value]>,
    tool_choice: Option<&Value>,
    thinking: Option<bool>,
) -> Result<Prepared, ApiError> {
    let choice = match tool_choice {
        None => "auto",
        Some(Value::String(s)) if s == "auto" || s == "none" => s.as_str(),
        Some(other) => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!("tool_choice {other} is not supported: only \"auto\" and \"none\" (nothing forces a call)"),
            ))
        }
    };
    let referenced = referenced_tools(messages);
    let (shown, names) = match tools {
        Some(t) if !t.is_empty() && choice != "none" => active_tools(t, &referenced)?,
        Some(t) => {
            active_tools(t, &referenced)?;
            (Vec::new(), BTreeSet::new())
        }
        None => (Vec::new(), BTreeSet::new()),
    };
    let messages = normalize_messages(messages)?;
    let tools_value = (!shown.is_empty()).then(|| Value::Array(shown));
    let rendered = model.render_chat(&messages, tools_value, thinking)?;
    Ok(Prepared { rendered, tool_names: names })
}

impl ChatRequest {
    fn validate(&self) -> Result<Option<bool>, ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid_param("n", "n must be 1: one choice per request"));
        }
        if self.logprobs == Some(true) {
            return Err(ApiError::invalid_param("logprobs", "logprobs are not supported"));
        }
        if let Some(rf) = &self.response_format {
            if rf.get("type").and_then(Value::as_str) != Some("text") {
                return Err(ApiError::invalid_param("response_format", "only {\"type\": \"text\"} is supported"));
            }
        }
        if self.parallel_tool_calls == Some(false) {
            return Err(ApiError::invalid_param(
                "parallel_tool_calls",
                "false is not supported (calls are not limited)",
            ));
        }
        let _ = &self.user;
        let mut thinking = match self.reasoning_effort.as_deref() {
            None => None,
            Some("none") => Some(false),
            Some("minimal" | "low" | "medium" | "high") => Some(true),
            Some(other) => return Err(ApiError::invalid_param("reasoning_effort", format!("unknown value {other:?}"))),
        };
        if let Some(k) = &self.chat_template_kwargs {
            for (key, v) in k {
                match (key.as_str(), v) {
                    ("enable_thinking", Value::Bool(b)) => thinking = Some(*b),
                    _ => {
                        return Err(ApiError::invalid_param(
                            "chat_template_kwargs",
                            format!("only enable_thinking (a boolean) is supported, got {key:?}"),
                        ))
                    }
                }
            }
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid_param("messages", "at least one message is needed"));
        }
        Ok(thinking)
    }
}

fn finish_reason_str(o: &Outcome, tool_calls: bool) -> &'static str {
    match o.reason {
        _ if tool_calls => "tool_calls",
        FinishReason::Stop | FinishReason::StopSequence | FinishReason::Cancelled => "stop",
        FinishReason::Length => "length",
    }
}

fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.n_prompt,
        "completion_tokens": o.n_generated,
        "total_tokens": o.n_prompt + o.n_generated,
        "prompt_tokens_details": {"cached_tokens": o.n_cached},
    })
}

fn tool_calls_json(calls: &[ToolCall]) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"index": i, "id": c.id, "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments.to_string()}})
            })
            .collect(),
    )
}

fn request_id(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}{nanos:x}")
}

/// `POST /v1/chat/completions`.
///
/// # Cancel safety
/// Dropping the future (client gone) drops the running generation's guard, which aborts it.
pub async fn chat_completions(
    State(state): State<AppState>,
    Query(q): Query<ModelQuery>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(&body)?;
    let thinking = req.validate()?;
    let model = state.registry.get(&req.model, q.autoload).await?;
    let prep = prepare_chat(&model, &req.messages, req.tools.as_deref(), req.tool_choice.as_ref(), thinking)?;
    let max_tokens = req.max_completion_tokens.or(req.max_tokens).unwrap_or(model.n_ctx);
    let opts = GenOptions {
        max_tokens,
        sampling: sampling_of!(req).params()?,
        stop: req.stop.clone().map(StopField::into_vec).unwrap_or_default(),
    };
    let running = model.start(prep.rendered, opts, state.metrics.clone())?;
    let id = request_id("chatcmpl-");
    let name = model.name.clone();
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        return Ok(sse_response(move |sink| stream_chat(running, sink, id, name, prep.tool_names, include_usage)));
    }
    let c = running.collect().await?;
    let o = c.outcome.expect("collect returns an outcome");
    let mut filter = ToolFilter::new(prep.tool_names);
    let mut text = filter.push(&c.text);
    let (rest, calls) = filter.finish();
    text.push_str(&rest);
    let mut message = json!({"role": "assistant", "content": if text.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(text) }});
    if !c.reasoning.is_empty() {
        message["reasoning_content"] = Value::String(c.reasoning);
    }
    if !calls.is_empty() {
        message["tool_calls"] = tool_calls_json(&calls);
    }
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": unix_now(), "model": name,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason_str(&o, !calls.is_empty()), "logprobs": null}],
        "usage": usage(&o),
    }))
    .into_response())
}

/// Relays a chat generation as `chat.completion.chunk` events.
///
/// # Cancel safety
/// Runs as its own task; it returns when the client is gone (`sink` closed), dropping `running`,
/// whose guard aborts the generation.
async fn stream_chat(
    mut running: Running,
    mut sink: SseSink,
    id: String,
    model: String,
    tool_names: BTreeSet<String>,
    include_usage: bool,
) {
    let created = unix_now();
    let chunk = |delta: Value, finish: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]})
    };
    if !sink.send(None, chunk(json!({"role": "assistant", "content": ""}), Value::Null)).await {
        return;
    }
    let mut filter = ToolFilter::new(tool_names);
    while let Some(ev) = sink.next_event(&mut running).await {
        let delta = match ev {
            Event::Text(t) => {
                let t = filter.push(&t);
                if t.is_empty() {
                    continue;
                }
                json!({"content": t})
            }
            Event::Reasoning(t) => json!({"reasoning_content": t}),
            Event::Failed(e) => {
                let _ = sink.send(None, e.openai_body()).await;
                return;
            }
            Event::Done(o) => {
                let (rest, calls) = filter.finish();
                if !rest.is_empty() && !sink.send(None, chunk(json!({"content": rest}), Value::Null)).await {
                    return;
                }
                if !calls.is_empty()
                    && !sink.send(None, chunk(json!({"tool_calls": tool_calls_json(&calls)}), Value::Null)).await
                {
                    return;
                }
                if !sink.send(None, chunk(json!({}), json!(finish_reason_str(&o, !calls.is_empty())))).await {
                    return;
                }
                let u = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [], "usage": usage(&o)});
                end_stream(&mut sink, include_usage.then_some(u)).await;
                return;
            }
        };
        if !sink.send(None, chunk(delta, Value::Null)).await {
            return;
        }
    }
}

/// The end of an OpenAI stream: the usage chunk when the client asked for one, then `[DONE]`
/// (unless the client is gone).
async fn end_stream(sink: &mut SseSink, usage_chunk: Option<Value>) {
    if let Some(u) = usage_chunk {
        if !sink.send(None, u).await {
            return;
        }
    }
    sink.done().await;
}

/// `POST /v1/chat/completions/input_tokens`: the prompt tokens a chat request would evaluate.
pub async fn chat_input_tokens(
    State(state): State<AppState>,
    Query(q): Query<ModelQuery>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let req: ChatRequest = parse_body(&body)?;
    let thinking = req.validate()?;
    let model = state.registry.get(&req.model, q.autoload).await?;
    let prep = prepare_chat(&model, &req.messages, req.tools.as_deref(), req.tool_choice.as_ref(), thinking)?;
    let n = model.count_tokens(&prep.rendered)?;
    Ok(Json(json!({"object": "chat.completion.input_tokens", "input_tokens": n})))
}

/// A text completion request. Unknown fields are refused.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    model: String,
    prompt: Value,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    seed: Option<u64>,
    repeat_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    stop: Option<StopField>,
    n: Option<u32>,
    best_of: Option<u32>,
    echo: Option<bool>,
    logprobs: Option<Value>,
    suffix: Option<String>,
    user: Option<String>,
}

/// `POST /v1/completions`.
///
/// # Cancel safety
/// As [`chat_completions`].
pub async fn completions(
    State(state): State<AppState>,
    Query(q): Query<ModelQuery>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(&body)?;
    let prompt = match &req.prompt {
        Value::String(s) => s.clone(),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or("").to_string(),
        _ => return Err(ApiError::invalid_param("prompt", "prompt must be a string (or a list of one string)")),
    };
    if req.n.is_some_and(|n| n != 1) || req.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid_param("n", "n and best_of must be 1"));
    }
    if req.echo == Some(true) {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    if req.logprobs.as_ref().is_some_and(|l| !l.is_null()) {
        return Err(ApiError::invalid_param("logprobs", "logprobs are not supported"));
    }
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "suffix (fill-in-the-middle) is not supported"));
    }
    let _ = &req.user;
    let model = state.registry.get(&req.model, q.autoload).await?;
    let opts = GenOptions {
        max_tokens: req.max_tokens.unwrap_or(16),
        sampling: sampling_of!(req).params()?,
        stop: req.stop.clone().map(StopField::into_vec).unwrap_or_default(),
    };
    let running = model.start(prompt, opts, state.metrics.clone())?;
    let id = request_id("cmpl-");
    let name = model.name.clone();
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        return Ok(sse_response(move |sink| stream_completion(running, sink, id, name, include_usage)));
    }
    let c = running.collect().await?;
    let o = c.outcome.expect("collect returns an outcome");
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": unix_now(), "model": name,
        "choices": [{"index": 0, "text": c.text, "logprobs": null, "finish_reason": finish_reason_str(&o, false)}],
        "usage": usage(&o),
    }))
    .into_response())
}

/// Relays a completion as `text_completion` chunks.
///
/// # Cancel safety
/// As [`stream_chat`].
async fn stream_completion(mut running: Running, mut sink: SseSink, id: String, model: String, include_usage: bool) {
    let created = unix_now();
    let chunk = |text: &str, finish: Value| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}]})
    };
    while let Some(ev) = sink.next_event(&mut running).await {
        let ok = match ev {
            Event::Text(t) => sink.send(None, chunk(&t, Value::Null)).await,
            Event::Reasoning(_) => true,
            Event::Failed(e) => {
                let _ = sink.send(None, e.openai_body()).await;
                return;
            }
            Event::Done(o) => {
                if !sink.send(None, chunk("", json!(finish_reason_str(&o, false)))).await {
                    return;
                }
                let u = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": usage(&o)});
                end_stream(&mut sink, include_usage.then_some(u)).await;
                return;
            }
        };
        if !ok {
            return;
        }
    }
}

/// `GET /v1/models`.
pub async fn list_models(State(state): State<AppState>) -> Json<Value> {
    let data: Vec<Value> = state
        .registry
        .names()
        .into_iter()
        .map(|n| json!({"id": n, "object": "model", "created": 0, "owned_by": "diskformer"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `input` of an embeddings request: a text, texts, token ids, or lists of token ids.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum EmbeddingInput {
    /// One text.
    One(String),
    /// Several texts.
    Many(Vec<String>),
    /// One pre-tokenized input.
    Tokens(Vec<u32>),
    /// Several pre-tokenized inputs.
    ManyTokens(Vec<Vec<u32>>),
}

/// An embeddings request. Unknown fields are refused.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    model: String,
    input: EmbeddingInput,
    encoding_format: Option<String>,
    dimensions: Option<usize>,
    #[allow(dead_code)] // accepted as OpenAI does; not used
    user: Option<String>,
}

/// `POST /v1/embeddings`: for embedding models (metadata with `{arch}.pooling_type`), the
/// pooled, L2-normalized final hidden state of each input; generative models are refused with
/// a clear error rather than returning hidden states as if they were embeddings.
///
/// # Cancel safety
/// Dropping the future (client gone) leaves the blocking computation to finish and be discarded.
pub async fn embeddings(
    State(state): State<AppState>,
    Query(q): Query<ModelQuery>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let req: EmbeddingRequest = parse_body(&body)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid_param(
                "encoding_format",
                format!("encoding_format {other:?} is not supported (float or base64)"),
            ))
        }
    };
    let model = state.registry.get(&req.model, q.autoload).await?;
    let (vectors, n_tokens) = model.embed(req.input, &state.metrics).await?;
    if let Some(d) = req.dimensions {
        let n = vectors[0].len();
        if d != n {
            return Err(ApiError::invalid_param(
                "dimensions",
                format!("model {} gives {n} dimensions; {d} were asked (truncation is not offered)", model.name),
            ));
        }
    }
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                Value::String(crate::embed::base64(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list", "data": data, "model": model.name,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    })))
}

#[cfg(test)]
mod tests {
    use super::join_text_parts;
    use serde_json::json;

    /// Both APIs' text parts: joined in order, tool references dropped, any other type an error
    /// naming it and the field.
    #[test]
    fn text_parts_join_and_other_types_are_named() {
        let parts = json!([
            {"type": "text", "text": "one "},
            {"type": "tool_reference", "tool_name": "search"},
            {"type": "text", "text": "two"}
        ]);
        assert_eq!(join_text_parts(parts.as_array().unwrap(), "messages[0].content", "block").unwrap(), "one two");
        let image = json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]);
        let e = join_text_parts(image.as_array().unwrap(), "messages[1].content", "content part").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].content"));
        assert!(e.message.contains("content part type Some(\"image_url\")"), "{}", e.message);
    }
}
