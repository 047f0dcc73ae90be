//! Anthropic-compatible routes: `/v1/messages` (streaming events as Anthropic sends them,
//! `tool_use`/`tool_result`, thinking) and `/v1/messages/count_tokens`.

use crate::engine::{Event, FinishReason, GenOptions, Outcome, Running};
use crate::error::{parse_body, AnthropicError, ApiError};
use crate::openai::{prepare_chat, sampling_params};
use crate::tools::{ToolCall, ToolFilter};
use crate::{sse_response, AppState, ModelQuery, SseSink};
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

/// A Messages request. Unknown fields are refused.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct MessagesRequest {
    model: String,
    messages: Vec<Value>,
    max_tokens: Option<usize>,
    system: Option<Value>,
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    stream: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    metadata: Option<Value>,
    thinking: Option<Value>,
}

fn text_of_blocks(v: &Value, where_: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => crate::openai::join_text_parts(blocks, where_, "block"),
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::invalid_param(where_, "content must be a string or a list of blocks")),
    }
}

/// Anthropic messages (and system) as OpenAI-form messages: `tool_use` blocks become
/// `tool_calls`, `tool_result` blocks become `tool` messages (keeping `tool_reference` blocks,
/// which bring deferred tools in), `thinking` blocks become `reasoning_content`.
pub fn to_openai_messages(system: Option<&Value>, messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = system {
        out.push(json!({"role": "system", "content": text_of_blocks(s, "system")?}));
    }
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if role != "user" && role != "assistant" {
            return Err(ApiError::invalid_param(
                &format!("messages[{i}].role"),
                format!("role {role:?}: user or assistant"),
            ));
        }
        let content = m.get("content").cloned().unwrap_or(Value::Null);
        let Value::Array(blocks) = content else {
            out.push(json!({"role": role, "content": text_of_blocks(&content, &format!("messages[{i}].content"))?}));
            continue;
        };
        let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("messages[{i}].content[{j}]");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
                Some("thinking") => reasoning.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or("")),
                Some("redacted_thinking") => {}
                Some("tool_use") if role == "assistant" => calls.push(json!({
                    "id": b.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {"name": b.get("name").cloned().unwrap_or(Value::Null),
                                 "arguments": b.get("input").cloned().unwrap_or(json!({}))},
                })),
                Some("tool_result") if role == "user" => {
                    let c = b.get("content").cloned().unwrap_or(Value::Null);
                    let refs: Vec<Value> = match &c {
                        Value::Array(a) => a
                            .iter()
                            .filter(|x| x.get("type").and_then(Value::as_str) == Some("tool_reference"))
                            .cloned()
                            .collect(),
                        _ => Vec::new(),
                    };
                    let mut parts = vec![json!({"type": "text", "text": text_of_blocks(&c, &at)?})];
                    parts.extend(refs);
                    out.push(
                        json!({"role": "tool", "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Value::Null),
                                    "content": parts}),
                    );
                }
                other => return Err(ApiError::invalid_param(&at, format!("block type {other:?} is not supported"))),
            }
        }
        if !text.is_empty() || !calls.is_empty() || !reasoning.is_empty() {
            let mut msg = json!({"role": role, "content": text});
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls);
            }
            if !reasoning.is_empty() {
                msg["reasoning_content"] = Value::String(reasoning);
            }
            out.push(msg);
        }
    }
    Ok(out)
}

/// Anthropic tools (`name`, `description`, `input_schema`, `defer_loading`) in OpenAI's form.
fn to_openai_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let name = t
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::invalid_param(&format!("tools[{i}].name"), "missing"))?;
            if let Some(ty) = t.get("type").and_then(Value::as_str).filter(|ty| *ty != "custom") {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].type"),
                    format!("server tool type {ty:?} is not supported; declare client tools"),
                ));
            }
            let mut f = json!({"name": name, "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))});
            if let Some(d) = t.get("description") {
                f["description"] = d.clone();
            }
            Ok(json!({"type": "function", "function": f, "defer_loading": t.get("defer_loading").cloned().unwrap_or(json!(false))}))
        })
        .collect()
}

/// OpenAI-form messages, tools, tool choice and thinking of a Messages request.
type Converted = (Vec<Value>, Option<Vec<Value>>, Option<Value>, Option<bool>);

impl MessagesRequest {
    /// OpenAI-form messages, tools, tool choice and thinking.
    fn convert(&self) -> Result<Converted, ApiError> {
        let messages = to_openai_messages(self.system.as_ref(), &self.messages)?;
        let tools = self.tools.as_deref().map(to_openai_tools).transpose()?;
        let choice = match &self.tool_choice {
            None => None,
            Some(c) => match c.get("type").and_then(Value::as_str) {
                Some("auto") => Some(json!("auto")),
                Some("none") => Some(json!("none")),
                _ => {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("tool_choice {c} is not supported: only auto and none (nothing forces a call)"),
                    ))
                }
            },
        };
        let thinking = match &self.thinking {
            None => None,
            Some(t) => match t.get("type").and_then(Value::as_str) {
                Some("enabled") => Some(true),
                Some("disabled") => Some(false),
                _ => return Err(ApiError::invalid_param("thinking", "type must be enabled or disabled")),
            },
        };
        let _ = &self.metadata;
        Ok((messages, tools, choice, thinking))
    }
}

fn stop_reason(o: &Outcome, tool_use: bool) -> &'static str {
    match o.reason {
        _ if tool_use => "tool_use",
        FinishReason::StopSequence => "stop_sequence",
        FinishReason::Length => "max_tokens",
        FinishReason::Stop | FinishReason::Cancelled => "end_turn",
    }
}

fn message_id() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("msg_{nanos:x}")
}

fn tool_use_id(c: &ToolCall) -> String {
    c.id.replacen("call_", "toolu_", 1)
}

/// `POST /v1/messages`.
///
/// # Cancel safety
/// Dropping the future (client gone) drops the running generation's guard, which aborts it.
pub async fn messages(
    State(state): State<AppState>,
    Query(q): Query<ModelQuery>,
    body: Bytes,
) -> Result<Response, AnthropicError> {
    let req: MessagesRequest = parse_body(&body)?;
    let max_tokens =
        req.max_tokens.ok_or_else(|| ApiError::invalid_param("max_tokens", "max_tokens: field required"))?;
    let (messages, tools, choice, thinking) = req.convert()?;
    let model = state.registry.get(&req.model, q.autoload).await?;
    let prep = prepare_chat(&model, &messages, tools.as_deref(), choice.as_ref(), thinking)?;
    let opts = GenOptions {
        max_tokens,
        sampling: sampling_params(req.temperature, req.top_p, req.top_k, None, None)?,
        stop: req.stop_sequences.clone().unwrap_or_default(),
    };
    let running = model.start(prep.rendered, opts, state.metrics.clone())?;
    let id = message_id();
    let name = model.name.clone();
    if req.stream {
        return Ok(sse_response(move |sink| stream_messages(running, sink, id, name, prep.tool_names)));
    }
    let c = running.collect().await?;
    let o = c.outcome.expect("collect returns an outcome");
    let mut filter = ToolFilter::new(prep.tool_names);
    let mut text = filter.push(&c.text);
    let (rest, calls) = filter.finish();
    text.push_str(&rest);
    let mut content = Vec::new();
    if !c.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": c.reasoning, "signature": ""}));
    }
    if !text.is_empty() || calls.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in &calls {
        content.push(json!({"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": call.arguments}));
    }
    Ok(Json(json!({
        "id": id, "type": "message", "role": "assistant", "model": name, "content": content,
        "stop_reason": stop_reason(&o, !calls.is_empty()), "stop_sequence": o.stop_sequence,
        "usage": {"input_tokens": o.n_prompt, "output_tokens": o.n_generated, "cache_read_input_tokens": o.n_cached},
    }))
    .into_response())
}

/// Where the streamed content blocks stand.
#[derive(PartialEq, Clone, Copy)]
enum Block {
    None,
    Thinking,
    Text,
}

/// Relays a generation as Anthropic's events: `message_start`, then per content block
/// `content_block_start`/`content_block_delta`.../`content_block_stop`, then `message_delta`
/// and `message_stop`.
///
/// # Cancel safety
/// Runs as its own task; it returns when the client is gone (`sink` closed), dropping `running`,
/// whose guard aborts the generation.
async fn stream_messages(
    mut running: Running,
    mut sink: SseSink,
    id: String,
    model: String,
    tool_names: std::collections::BTreeSet<String>,
) {
    let start = json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
        "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": 0, "output_tokens": 0}}});
    if !sink.send(Some("message_start"), start).await || !sink.send(Some("ping"), json!({"type": "ping"})).await {
        return;
    }
    let mut filter = ToolFilter::new(tool_names);
    let (mut block, mut index) = (Block::None, 0usize);
    // Opens a block of `kind` (closing the open one) and sends the delta.
    async fn delta(sink: &mut SseSink, block: &mut Block, index: &mut usize, kind: Block, text: String) -> bool {
        if *block != kind {
            if *block != Block::None {
                if !sink.send(Some("content_block_stop"), json!({"type": "content_block_stop", "index": *index})).await
                {
                    return false;
                }
                *index += 1;
            }
            let cb = match kind {
                Block::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "text", "text": ""}),
            };
            if !sink
                .send(
                    Some("content_block_start"),
                    json!({"type": "content_block_start", "index": *index, "content_block": cb}),
                )
                .await
            {
                return false;
            }
            *block = kind;
        }
        let d = match kind {
            Block::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            _ => json!({"type": "text_delta", "text": text}),
        };
        sink.send(Some("content_block_delta"), json!({"type": "content_block_delta", "index": *index, "delta": d}))
            .await
    }
    while let Some(ev) = sink.next_event(&mut running).await {
        let ok = match ev {
            Event::Reasoning(t) => delta(&mut sink, &mut block, &mut index, Block::Thinking, t).await,
            Event::Text(t) => {
                let t = filter.push(&t);
                t.is_empty() || delta(&mut sink, &mut block, &mut index, Block::Text, t).await
            }
            Event::Failed(e) => {
                let _ = sink.send(Some("error"), e.anthropic_body()).await;
                return;
            }
            Event::Done(o) => {
                let (rest, calls) = filter.finish();
                if !rest.is_empty() && !delta(&mut sink, &mut block, &mut index, Block::Text, rest).await {
                    return;
                }
                if block != Block::None {
                    if !sink
                        .send(Some("content_block_stop"), json!({"type": "content_block_stop", "index": index}))
                        .await
                    {
                        return;
                    }
                    index += 1;
                }
                for call in &calls {
                    let cb = json!({"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}});
                    let d = json!({"type": "input_json_delta", "partial_json": call.arguments.to_string()});
                    if !sink
                        .send(
                            Some("content_block_start"),
                            json!({"type": "content_block_start", "index": index, "content_block": cb}),
                        )
                        .await
                        || !sink
                            .send(
                                Some("content_block_delta"),
                                json!({"type": "content_block_delta", "index": index, "delta": d}),
                            )
                            .await
                        || !sink
                            .send(Some("content_block_stop"), json!({"type": "content_block_stop", "index": index}))
                            .await
                    {
                        return;
                    }
                    index += 1;
                }
                let md = json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(&o, !calls.is_empty()), "stop_sequence": o.stop_sequence},
                    "usage": {"input_tokens": o.n_prompt, "output_tokens": o.n_generated}});
                if sink.send(Some("message_delta"), md).await {
                    let _ = sink.send(Some("message_stop"), json!({"type": "message_stop"})).await;
                }
                return;
            }
        };
        if !ok {
            return;
        }
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`.
pub async fn count_tokens(
    State(state): State<AppState>,
    Query(q): Query<ModelQuery>,
    body: Bytes,
) -> Result<Json<Value>, AnthropicError> {
    let req: MessagesRequest = parse_body(&body)?;
    let (messages, tools, choice, thinking) = req.convert()?;
    let model = state.registry.get(&req.model, q.autoload).await?;
    let prep = prepare_chat(&model, &messages, tools.as_deref(), choice.as_ref(), thinking)?;
    Ok(Json(json!({"input_tokens": model.count_tokens(&prep.rendered)?})))
}
