//! Tool calls: parsing them out of the model's own output format, holding text back while a
//! call may be starting (streaming), and deferred tools (`defer_loading`) that stay out of the
//! prompt until a `tool_reference` in a tool result brings them in.
//!
//! Formats read: Hermes/Qwen `<tool_call>{"name": .., "arguments": ..}</tool_call>` (one per
//! block, or a JSON list in one block, as SmolLM2 writes them), and a bare JSON object or list of
//! `{"name", "arguments"|"parameters"}` making up the whole answer (Llama 3 style). Only names
//! of tools the request declared are taken as calls; anything else stays text.

use crate::error::ApiError;
use serde_json::{json, Value};
use std::collections::BTreeSet;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A parsed tool call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// A fresh id (`call_...`).
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments (a JSON object).
    pub arguments: Value,
}

fn fresh_id(prefix: &str, i: usize) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{prefix}{:x}{i}", nanos & 0xffff_ffff_ffff)
}

/// Calls in one JSON value (object or list of objects) whose names are declared.
fn calls_in(v: &Value, names: &BTreeSet<String>) -> Option<Vec<(String, Value)>> {
    let one = |o: &Value| -> Option<(String, Value)> {
        let name = o.get("name")?.as_str()?;
        if !names.contains(name) {
            return None;
        }
        let args = o.get("arguments").or_else(|| o.get("parameters")).cloned().unwrap_or_else(|| json!({}));
        // Some models write the arguments as a JSON string.
        let args = match args {
            Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
            a => a,
        };
        Some((name.to_string(), args))
    };
    match v {
        Value::Array(items) if !items.is_empty() => items.iter().map(one).collect(),
        Value::Object(_) => one(v).map(|c| vec![c]),
        _ => None,
    }
}

/// Splits an answer into text and tool calls. `None` when it holds no call to a declared tool.
pub fn parse_tool_calls(text: &str, names: &BTreeSet<String>) -> Option<(String, Vec<ToolCall>)> {
    let mut calls = Vec::new();
    let mut outside = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        outside.push_str(&rest[..start]);
        let body_start = start + OPEN.len();
        let (body, after) = match rest[body_start..].find(CLOSE) {
            Some(end) => (&rest[body_start..body_start + end], &rest[body_start + end + CLOSE.len()..]),
            None => (&rest[body_start..], ""),
        };
        match serde_json::from_str::<Value>(body.trim()).ok().and_then(|v| calls_in(&v, names)) {
            Some(c) => calls.extend(c),
            None => return None,
        }
        rest = after;
    }
    outside.push_str(rest);
    if calls.is_empty() {
        let v: Value = serde_json::from_str(text.trim()).ok()?;
        calls = calls_in(&v, names)?;
        outside.clear();
    }
    let calls = calls
        .into_iter()
        .enumerate()
        .map(|(i, (name, arguments))| ToolCall { id: fresh_id("call_", i), name, arguments })
        .collect();
    Some((outside.trim().to_string(), calls))
}

/// Streams answer text while holding back what may be a tool call, so a call is never sent
/// as text first. With no tools declared it passes everything through.
#[derive(Debug, Default)]
pub struct ToolFilter {
    names: BTreeSet<String>,
    held: String,
    /// Whether the answer began with JSON (a bare call may follow): hold everything.
    hold_all: bool,
    started: bool,
}

impl ToolFilter {
    /// A filter for the declared tool names.
    pub fn new(names: BTreeSet<String>) -> ToolFilter {
        ToolFilter { names, ..Default::default() }
    }

    /// Adds text; returns what can be sent now.
    pub fn push(&mut self, text: &str) -> String {
        if self.names.is_empty() {
            return text.to_string();
        }
        self.held.push_str(text);
        if !self.started {
            let t = self.held.trim_start();
            if t.is_empty() {
                return String::new();
            }
            self.started = true;
            self.hold_all = t.starts_with('{') || t.starts_with('[');
        }
        if self.hold_all {
            return String::new();
        }
        // Send everything before a (possible) `<tool_call>`.
        let cut = match self.held.find(OPEN) {
            Some(i) => i,
            None => {
                let n = (1..OPEN.len()).rev().find(|&n| self.held.ends_with(&OPEN[..n])).unwrap_or(0);
                self.held.len() - n
            }
        };
        let rest = self.held.split_off(cut);
        std::mem::replace(&mut self.held, rest)
    }

    /// The end: the held text (when it is no call) and the calls.
    pub fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        match parse_tool_calls(&held, &self.names) {
            Some((text, calls)) => (text, calls),
            None => (held, Vec::new()),
        }
    }
}

/// Names in `tool_reference` blocks anywhere in the messages' content (tool results).
pub fn referenced_tools(messages: &[Value]) -> BTreeSet<String> {
    fn walk(v: &Value, out: &mut BTreeSet<String>) {
        match v {
            Value::Object(o) => {
                if o.get("type").and_then(Value::as_str) == Some("tool_reference") {
                    if let Some(n) = o.get("tool_name").or_else(|| o.get("name")).and_then(Value::as_str) {
                        out.insert(n.to_string());
                    }
                }
                o.values().for_each(|x| walk(x, out));
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = BTreeSet::new();
    messages.iter().for_each(|m| walk(m, &mut out));
    out
}

/// Tools in OpenAI's form (`{"type": "function", "function": {...}}`, `defer_loading` on the
/// tool or its function) reduced to those the prompt shows: every tool not deferred, and the
/// deferred ones some `tool_reference` names. Returns them without `defer_loading`, plus the
/// names of every declared tool (calls to any may be parsed once it is shown).
///
/// # Errors
/// A tool without a function name; a `tool_reference` to a tool the request does not declare.
pub fn active_tools(
    tools: &[Value],
    referenced: &BTreeSet<String>,
) -> Result<(Vec<Value>, BTreeSet<String>), ApiError> {
    let mut shown = Vec::new();
    let mut names = BTreeSet::new();
    let mut declared = BTreeSet::new();
    for (i, t) in tools.iter().enumerate() {
        let ty = t.get("type").and_then(Value::as_str).unwrap_or("function");
        if ty != "function" {
            return Err(ApiError::invalid_param(
                &format!("tools[{i}].type"),
                format!("tool type {ty:?} is not supported; only \"function\" tools are"),
            ));
        }
        let f = t.get("function").ok_or_else(|| ApiError::invalid_param(&format!("tools[{i}].function"), "missing"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid_param(&format!("tools[{i}].function.name"), "missing"))?;
        declared.insert(name.to_string());
        let deferred =
            [t.get("defer_loading"), f.get("defer_loading")].into_iter().flatten().any(|d| d == &json!(true));
        if deferred && !referenced.contains(name) {
            continue;
        }
        let mut f = f.clone();
        if let Some(o) = f.as_object_mut() {
            o.remove("defer_loading");
        }
        names.insert(name.to_string());
        shown.push(json!({"type": "function", "function": f}));
    }
    if let Some(unknown) = referenced.iter().find(|r| !declared.contains(*r)) {
        return Err(ApiError::invalid(format!(
            "a tool_reference names {unknown:?}, which is not among the request's tools"
        )));
    }
    Ok((shown, names))
}

/// Messages for a template that does not read `tools`: the tool definitions go into the system
/// message (a new one when there is none) with the call format [`parse_tool_calls`] reads, and
/// earlier assistant calls become `<tool_call>` text, so the model sees its own past calls.
/// Without this such templates would drop the tools silently.
pub fn describe_tools_in_system(messages: &[Value], tools: &[Value]) -> Vec<Value> {
    let defs: Vec<String> = tools.iter().map(|t| t.get("function").unwrap_or(t).to_string()).collect();
    let description = format!(
        "You may call these tools, given as JSON schemas:\n{}\nTo call one, answer with \
         {OPEN}{{\"name\": <tool name>, \"arguments\": <arguments object>}}{CLOSE} \
         (one block per call) and nothing else; the results come back in `tool` messages.",
        defs.join("\n")
    );
    let mut out: Vec<Value> = messages
        .iter()
        .map(|m| {
            let Some(calls) = m.get("tool_calls").and_then(Value::as_array) else { return m.clone() };
            let mut text = m.get("content").and_then(Value::as_str).unwrap_or("").to_string();
            for c in calls {
                let f = c.get("function").unwrap_or(c);
                let call = json!({"name": f.get("name"), "arguments": f.get("arguments")});
                text.push_str(&format!("{OPEN}{call}{CLOSE}"));
            }
            let mut m = m.clone();
            if let Some(o) = m.as_object_mut() {
                o.remove("tool_calls");
                o.insert("content".into(), Value::String(text));
            }
            m
        })
        .collect();
    match out.first_mut() {
        Some(first) if first.get("role").and_then(Value::as_str) == Some("system") => {
            let own = first.get("content").and_then(Value::as_str).unwrap_or("");
            first["content"] =
                Value::String(if own.is_empty() { description } else { format!("{own}\n\n{description}") });
        }
        _ => out.insert(0, json!({"role": "system", "content": description})),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_described_in_the_system_message_for_templates_without_tools() {
        let tools = vec![json!({"type": "function", "function": {"name": "a", "parameters": {}}})];
        let msgs = vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "a", "arguments": {"x": 1}}}]}),
        ];
        let out = describe_tools_in_system(&msgs, &tools);
        assert_eq!(out.len(), 3);
        assert_eq!(out[0]["role"], "system");
        assert!(out[0]["content"].as_str().unwrap().contains(r#"{"name":"a","parameters":{}}"#));
        let past = out[2]["content"].as_str().unwrap();
        assert_eq!(past, r#"<tool_call>{"name":"a","arguments":{"x":1}}</tool_call>"#);
        // The call written back is one the parser reads.
        let names = BTreeSet::from(["a".to_string()]);
        assert_eq!(parse_tool_calls(past, &names).unwrap().1[0].arguments, json!({"x": 1}));
        let with_system = describe_tools_in_system(&[json!({"role": "system", "content": "Be brief."})], &tools);
        assert!(with_system[0]["content"].as_str().unwrap().starts_with("Be brief.\n\n"));
    }

    fn names(n: &[&str]) -> BTreeSet<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn hermes_blocks_are_parsed() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (rest, calls) = parse_tool_calls(text, &names(&["get_weather"])).unwrap();
        assert_eq!(rest, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, json!({"city": "Paris"}));
    }

    #[test]
    fn smollm_lists_and_bare_json_are_parsed() {
        let text = "<tool_call>[{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}]</tool_call>";
        let (_, calls) = parse_tool_calls(text, &names(&["a", "b"])).unwrap();
        assert_eq!(calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(calls[1].arguments, json!({"x": 1}));
        let (_, calls) = parse_tool_calls("{\"name\": \"a\", \"parameters\": {\"q\": 2}}", &names(&["a"])).unwrap();
        assert_eq!(calls[0].arguments, json!({"q": 2}));
    }

    #[test]
    fn undeclared_names_and_plain_text_are_not_calls() {
        assert!(
            parse_tool_calls("<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>", &names(&["a"])).is_none()
        );
        assert!(parse_tool_calls("hello", &names(&["a"])).is_none());
    }

    #[test]
    fn the_filter_holds_back_a_starting_call() {
        let mut f = ToolFilter::new(names(&["a"]));
        assert_eq!(f.push("Sure. <tool"), "Sure. ");
        assert_eq!(f.push("_call>{\"name\": \"a\", \"arguments\": {}}"), "");
        assert_eq!(f.push("</tool_call>"), "");
        let (text, calls) = f.finish();
        assert_eq!(text, "");
        assert_eq!(calls.len(), 1);
        let mut g = ToolFilter::new(names(&["a"]));
        assert_eq!(g.push("<to"), "");
        assert_eq!(g.push("day"), "<today");
    }

    #[test]
    fn deferred_tools_wait_for_a_reference() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "a", "parameters": {}}}),
            json!({"type": "function", "defer_loading": true, "function": {"name": "b", "parameters": {}}}),
        ];
        let (shown, _) = active_tools(&tools, &BTreeSet::new()).unwrap();
        assert_eq!(shown.len(), 1);
        let msgs = vec![json!({"role": "tool", "content": [{"type": "tool_reference", "tool_name": "b"}]})];
        let (shown, names) = active_tools(&tools, &referenced_tools(&msgs)).unwrap();
        assert_eq!(shown.len(), 2);
        assert!(names.contains("b"));
        assert!(shown[1].get("defer_loading").is_none());
        let bad = vec![json!({"role": "tool", "content": [{"type": "tool_reference", "tool_name": "zz"}]})];
        assert!(active_tools(&tools, &referenced_tools(&bad)).is_err());
    }
}
