//! The server on a fixture model, over real sockets, with a raw HTTP/1.1 client: routes,
//! streaming, errors, the bounded queue, cancellation on disconnect and the API key.
//!
//! The model is the qwen3 fixture (random weights) with a ChatML template written in, so
//! texts are arbitrary; the tests check protocol shapes and token accounting, which do not
//! depend on what the model says. Expected token counts come from the fixture's own
//! tokenizer through the `tokenizer` crate, which is tested against llama.cpp's ids.

use gguf::{GgufModel, GgufWriter, Value as GValue};
use serde_json::{json, Value};
use server::devices::{DeviceMemory, DeviceMemorySource, FixedDevices};
use server::engine::EngineOptions;
use server::registry::RouterOptions;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t.function.name }}: {{ t.function.description }}\n{% endfor %}<|im_end|>\n{% endif %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn fixture() -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let full = repo.join("../shared/fixtures/qwen3/model-q4_0.gguf");
    if full.exists() {
        eprintln!("fixtures: full set ({})", full.display());
        full
    } else {
        eprintln!("fixtures: compact subset (tests/fixtures)");
        repo.join("tests/fixtures/qwen3/model-q4_0.gguf")
    }
}

/// The fixture with a chat template.
fn chat_model(dir: &Path, name: &str) -> PathBuf {
    let m = GgufModel::open(fixture()).unwrap();
    let mut w = GgufWriter::new();
    w.set_all(m.metadata());
    w.set("tokenizer.chat_template", GValue::String(CHATML.into()));
    for t in m.tensors() {
        w.add_tensor(t.name(), t.dtype(), t.shape()).unwrap();
    }
    let dst = dir.join(format!("{name}.gguf"));
    let mut sink = w.create(&dst).unwrap();
    for t in m.tensors() {
        sink.write_data(t.data).unwrap();
    }
    sink.finish().unwrap();
    dst
}

struct Server {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn start(names: &[&str], preload: bool, engine: EngineOptions, router: RouterOptions, api_key: Option<&str>) -> Server {
    start_with_devices(names, preload, engine, router, api_key, None)
}

/// As `start`, with the router's device memory from `devices` when given.
fn start_with_devices(
    names: &[&str],
    preload: bool,
    engine: EngineOptions,
    router: RouterOptions,
    api_key: Option<&str>,
    devices: Option<Arc<dyn DeviceMemorySource>>,
) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let models: Vec<(String, PathBuf)> = names.iter().map(|n| (n.to_string(), chat_model(dir.path(), n))).collect();
    let config = server::Config {
        addr: "127.0.0.1:0".parse().unwrap(),
        preload: if preload { names.iter().map(|s| s.to_string()).collect() } else { vec![] },
        models,
        engine: EngineOptions {
            backend: Some(server::BackendKind::Cpu),
            read_ahead: false,
            n_ctx: if engine.n_ctx == 0 { 256 } else { engine.n_ctx },
            ..engine
        },
        router,
        model_options: Default::default(),
        api_key: api_key.map(str::to_string),
    };
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let shutdown = async move {
                let _ = stop_rx.await;
            };
            match devices {
                Some(d) => server::serve_with_devices(config, d, move |a| addr_tx.send(a).unwrap(), shutdown).await,
                None => server::serve(config, move |a| addr_tx.send(a).unwrap(), shutdown).await,
            }
            .unwrap();
        });
    });
    let addr = addr_rx.recv_timeout(Duration::from_secs(120)).expect("server started");
    Server { addr, _dir: dir, _stop: stop_tx }
}

fn one_model() -> Server {
    start(&["tiny"], true, EngineOptions::default(), RouterOptions::default(), None)
}

/// A raw HTTP/1.1 request; returns (status, headers, body).
fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a response head");
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_string() };
    (status, head.to_string(), body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn post(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, _, b) = request(addr, "POST", path, &[], Some(&body));
    (status, serde_json::from_str(&b).unwrap_or_else(|e| panic!("not JSON ({e}): {b}")))
}

/// SSE `data:` payloads (and `event:` names) of a body.
fn sse(body: &str) -> Vec<(Option<String>, String)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .filter_map(|e| {
            let mut name = None;
            let mut data = None;
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ").or_else(|| line.strip_prefix("event:")) {
                    name = Some(n.trim().to_string());
                }
                if let Some(d) = line.strip_prefix("data: ").or_else(|| line.strip_prefix("data:")) {
                    data = Some(d.to_string());
                }
            }
            data.map(|d| (name, d))
        })
        .collect()
}

fn fixture_tokens(text: &str) -> usize {
    let m = GgufModel::open(fixture()).unwrap();
    let t = tokenizer::Tokenizer::from_gguf(m.metadata()).unwrap();
    t.encode(text, true, true).unwrap().len()
}

#[test]
fn health_models_and_chat() {
    let s = one_model();
    let (st, _, b) = request(s.addr, "GET", "/health", &[], None);
    assert_eq!(st, 200, "{b}");
    let (st, _, b) = request(s.addr, "GET", "/v1/models", &[], None);
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["data"][0]["id"], "tiny");

    let req = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5,
                     "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 42});
    let (st, v) = post(s.addr, "/v1/chat/completions", req.clone());
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let prompt = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(v["usage"]["prompt_tokens"], fixture_tokens(prompt));
    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=5).contains(&n));
    if n == 5 {
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }
    // The same seed gives the same text.
    let (_, v2) = post(s.addr, "/v1/chat/completions", req);
    assert_eq!(v["choices"][0]["message"]["content"], v2["choices"][0]["message"]["content"]);

    let (st, c) = post(
        s.addr,
        "/v1/chat/completions/input_tokens",
        json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}]}),
    );
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["input_tokens"], fixture_tokens(prompt));
    let (st, c) = post(
        s.addr,
        "/v1/messages/count_tokens",
        json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}]}),
    );
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["input_tokens"], fixture_tokens(prompt));

    let (st, v) = post(
        s.addr,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "Once upon", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    let m = request(s.addr, "GET", "/metrics", &[], None).2;
    assert!(m.contains("diskformer_tokens_generated_total"), "{m}");
}

#[test]
fn streaming_is_well_formed() {
    let s = one_model();
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": true,
                      "stream_options": {"include_usage": true}, "temperature": 0});
    let (st, head, b) = request(s.addr, "POST", "/v1/chat/completions", &[], Some(&body));
    assert_eq!(st, 200);
    assert!(head.to_ascii_lowercase().contains("text/event-stream"), "{head}");
    let events = sse(&b);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(&e.1).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let finish: Vec<&Value> = chunks.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 4);

    let body = json!({"model": "tiny", "max_tokens": 3, "stream": true, "temperature": 0,
                      "messages": [{"role": "user", "content": "Hi"}]});
    let (st, _, b) = request(s.addr, "POST", "/v1/messages", &[], Some(&body));
    assert_eq!(st, 200);
    let names: Vec<String> = sse(&b).into_iter().filter_map(|e| e.0).collect();
    assert_eq!(names.first().map(String::as_str), Some("message_start"));
    assert_eq!(names.last().map(String::as_str), Some("message_stop"));
    assert!(names.contains(&"message_delta".to_string()));
    let starts = names.iter().filter(|n| *n == "content_block_start").count();
    let stops = names.iter().filter(|n| *n == "content_block_stop").count();
    assert_eq!(starts, stops);

    let (st, v) = post(
        s.addr,
        "/v1/messages",
        json!({"model": "tiny", "max_tokens": 2, "temperature": 0,
        "system": "Be short.", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["usage"]["output_tokens"], 2);
}

#[test]
fn errors_use_the_envelopes() {
    let s = one_model();
    let (st, v) = post(s.addr, "/v1/chat/completions", json!({"model": "tiny", "messages": [], "frobnicate": 1}));
    assert_eq!(st, 400);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("frobnicate"), "{v}");
    let (st, v) =
        post(s.addr, "/v1/chat/completions", json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}));
    assert_eq!(st, 404, "{v}");
    let (st, v) = post(
        s.addr,
        "/v1/chat/completions",
        json!({"model": "tiny", "n": 2, "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(st, 400);
    assert_eq!(v["error"]["param"], "n");
    let (st, v) =
        post(s.addr, "/v1/messages", json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}));
    assert_eq!(st, 400);
    assert_eq!(v["type"], "error");
    assert!(v["error"]["message"].as_str().unwrap().contains("max_tokens"));
    let (st, v) =
        post(s.addr, "/v1/messages", json!({"model": "tiny", "max_tokens": 1, "bogus": true, "messages": []}));
    assert_eq!(st, 400);
    assert_eq!(v["error"]["type"], "invalid_request_error");
}

#[test]
fn stop_strings_end_the_answer() {
    let s = one_model();
    let req = |stop: Value| json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell"}], "max_tokens": 12, "temperature": 0, "stop": stop});
    let (_, free) = post(s.addr, "/v1/chat/completions", req(json!([])));
    let text = free["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    // Stop at the third character of the free answer (when it has one): the answer is cut before it.
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 3 && !chars[2].is_whitespace() {
        let stop = chars[2].to_string();
        let cut = &text[..text.find(&stop).unwrap()];
        let (_, v) = post(s.addr, "/v1/chat/completions", req(json!(stop)));
        assert_eq!(v["choices"][0]["message"]["content"], cut);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    } else {
        eprintln!("answer {text:?} too short to pick a stop string");
    }
}

#[test]
fn deferred_tools_enter_the_prompt_on_reference() {
    let s = one_model();
    let tool = |name: &str, defer: bool| {
        json!({"type": "function", "defer_loading": defer,
        "function": {"name": name, "description": format!("does {name}"), "parameters": {"type": "object"}}})
    };
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let count = |tools: Value, msgs: &Value| {
        let (st, v) = post(
            s.addr,
            "/v1/chat/completions/input_tokens",
            json!({"model": "tiny", "messages": msgs, "tools": tools}),
        );
        assert_eq!(st, 200, "{v}");
        v["input_tokens"].as_u64().unwrap()
    };
    let plain = count(json!([tool("alpha", false)]), &msgs);
    let with_deferred = count(json!([tool("alpha", false), tool("beta", true)]), &msgs);
    assert_eq!(plain, with_deferred, "a deferred tool stays out of the prompt");
    let both = count(json!([tool("alpha", false), tool("beta", false)]), &msgs);
    assert!(both > plain);
    let referenced = json!([{"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "alpha", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}, {"type": "tool_reference", "tool_name": "beta"}]}]);
    let a = count(json!([tool("alpha", false), tool("beta", true)]), &referenced);
    let b = count(json!([tool("alpha", false), tool("beta", false)]), &referenced);
    assert_eq!(a, b, "a referenced deferred tool is shown like any other");
    // Anthropic form.
    let atool = |name: &str, defer: bool| json!({"name": name, "description": format!("does {name}"), "input_schema": {"type": "object"}, "defer_loading": defer});
    let (_, v1) = post(
        s.addr,
        "/v1/messages/count_tokens",
        json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [atool("alpha", false), atool("beta", true)]}),
    );
    assert_eq!(v1["input_tokens"].as_u64().unwrap(), plain);
}

#[test]
fn a_full_queue_answers_503_and_disconnects_cancel() {
    let s = start(
        &["tiny"],
        true,
        EngineOptions { queue_max: 1, n_ctx: 2048, ..Default::default() },
        RouterOptions::default(),
        None,
    );
    // A long streaming request holds the only slot; the client reads the first bytes and leaves.
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Go"}], "max_tokens": 2000, "stream": true, "temperature": 0, "stop": []}).to_string();
    let mut c = TcpStream::connect(s.addr).unwrap();
    write!(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 512];
    let n = c.read(&mut buf).unwrap();
    assert!(n > 0);
    let (st, v) = post(
        s.addr,
        "/v1/chat/completions",
        json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    );
    assert_eq!(st, 503, "{v}");
    assert_eq!(v["error"]["code"], "overloaded");
    drop(c);
    // The disconnected generation is cancelled and frees the slot well before 200 tokens.
    let t0 = std::time::Instant::now();
    loop {
        let (st, _) = post(
            s.addr,
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        );
        if st == 200 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "the slot was not freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let m = request(s.addr, "GET", "/metrics", &[], None).2;
    assert!(m.contains("diskformer_requests_cancelled_total 1"), "{m}");
    let generated: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("diskformer_tokens_generated_total "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(generated < 2000, "the cancelled stream ran to the end ({generated} tokens)");
}

#[test]
fn the_api_key_guards_all_but_health() {
    let s = start(&["tiny"], true, EngineOptions::default(), RouterOptions::default(), Some("sekret"));
    assert_eq!(request(s.addr, "GET", "/health", &[], None).0, 200);
    assert_eq!(request(s.addr, "GET", "/v1/models", &[], None).0, 401);
    assert_eq!(request(s.addr, "GET", "/v1/models", &[("Authorization", "Bearer wrong")], None).0, 401);
    assert_eq!(request(s.addr, "GET", "/v1/models", &[("Authorization", "Bearer sekret")], None).0, 200);
    assert_eq!(request(s.addr, "GET", "/models", &[("x-api-key", "sekret")], None).0, 200);
}

#[test]
fn the_router_unloads_the_idle_model_first() {
    let s = start(
        &["a", "b"],
        false,
        EngineOptions::default(),
        RouterOptions { models_max: 1, ..Default::default() },
        None,
    );
    let (st, _, b) = request(s.addr, "GET", "/models", &[], None);
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["data"][0]["status"]["value"], "unloaded");
    let mut events = TcpStream::connect(s.addr).unwrap();
    write!(events, "GET /models/sse HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    events.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The handler subscribes before it answers: once the response head is here, no event can be
    // missed (under load the chats below could otherwise finish before the subscription).
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while !seen.contains("\r\n\r\n") {
        let n = events.read(&mut buf).expect("the event stream's head");
        assert!(n > 0, "events ended: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let chat = |m: &str| {
        post(
            s.addr,
            "/v1/chat/completions",
            json!({"model": m, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        )
    };
    assert_eq!(chat("a").0, 200);
    assert_eq!(chat("b").0, 200);
    while !(seen.contains("event: unload") && seen.matches("event: load").count() >= 2) {
        let n = events.read(&mut buf).expect("model events");
        assert!(n > 0, "events ended: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(seen.contains("\"model\":\"a\""), "{seen}");
    // A request holds nothing once its answer is out: the permit, the session slot and the
    // handle on the model (the router's idleness test) are released before the last event
    // reaches the handler, so a client's next request can never find them taken.
    for _ in 0..5 {
        assert_eq!(chat("b").0, 200);
        let v: Value = serde_json::from_str(&request(s.addr, "GET", "/models", &[], None).2).unwrap();
        assert_eq!(v["data"][1]["in_flight"], 0, "{v}");
    }
    let v: Value = serde_json::from_str(&request(s.addr, "GET", "/models", &[], None).2).unwrap();
    let state = |i: usize| v["data"][i]["status"]["value"].as_str().unwrap().to_string();
    assert_eq!((state(0), state(1)), ("unloaded".to_string(), "loaded".to_string()), "{v}");
    let mem = &v["data"][1]["memory"];
    assert_eq!(mem["status"], "measured", "{v}");
    assert!(mem["min"][0]["context"].as_u64().unwrap() <= mem["max"][0]["context"].as_u64().unwrap());
    assert!(mem["max"][0]["model"].as_u64().unwrap() > 0);
    assert!(mem["effective"].is_array());
    // A model name is a key, never a path.
    assert_eq!(chat("../a").0, 404);
    // autoload=false refuses an unloaded model.
    let (st, _) = post(
        s.addr,
        "/v1/chat/completions?autoload=false",
        json!({"model": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    );
    assert_eq!(st, 503);
}

#[test]
fn a_busy_model_is_never_unloaded() {
    let engine = EngineOptions { n_ctx: 2048, ..Default::default() };
    let s = start(&["a", "b"], false, engine, RouterOptions { models_max: 1, ..Default::default() }, None);
    // A long stream on `a`, whose client reads the first bytes and keeps the connection.
    let body = json!({"model": "a", "messages": [{"role": "user", "content": "Go"}], "max_tokens": 2000, "stream": true, "temperature": 0}).to_string();
    let mut c = TcpStream::connect(s.addr).unwrap();
    write!(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 256];
    assert!(c.read(&mut buf).unwrap() > 0);
    let (st, v) = post(
        s.addr,
        "/v1/chat/completions",
        json!({"model": "b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    );
    assert_eq!(st, 200, "{v}");
    let v: Value = serde_json::from_str(&request(s.addr, "GET", "/models", &[], None).2).unwrap();
    assert_eq!(v["data"][0]["status"]["value"], "loaded", "the busy model stays: {v}");
    assert_eq!(v["data"][1]["status"]["value"], "loaded", "{v}");
    drop(c);
}

#[test]
fn the_margin_is_checked_on_each_device_the_source_reports() {
    let memory = |cpu_free: u64| {
        vec![
            DeviceMemory {
                device: "cpu".into(),
                name: "RAM".into(),
                total_bytes: Some(cpu_free * 2),
                free_bytes: Some(cpu_free),
                source: "test".into(),
            },
            DeviceMemory {
                device: "gpu0".into(),
                name: "an integrated GPU".into(),
                total_bytes: None,
                free_bytes: None,
                source: "unknown".into(),
            },
        ]
    };
    let margin: u64 = 1 << 20;
    let fake = FixedDevices::new(memory(u64::MAX / 4));
    let s = start_with_devices(
        &["a", "b"],
        false,
        EngineOptions::default(),
        RouterOptions { margin_bytes: margin, ..Default::default() },
        None,
        Some(Arc::new(fake.clone())),
    );
    let models = || -> Value { serde_json::from_str(&request(s.addr, "GET", "/models", &[], None).2).unwrap() };
    let t0 = std::time::Instant::now();
    let need_b = loop {
        let v = models();
        if v["data"].as_array().unwrap().iter().all(|m| m["memory"]["status"] == "measured") {
            let min = &v["data"][1]["memory"]["min"][0];
            assert_eq!(min["device"], "cpu", "{v}");
            break min["model"].as_u64().unwrap() + min["context"].as_u64().unwrap() + min["compute"].as_u64().unwrap();
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "memory never measured: {v}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let v = models();
    assert_eq!(v["devices"][1]["free"], "unknown", "{v}");
    assert_eq!(v["devices"][0]["free"], u64::MAX / 4, "{v}");
    let chat = |m: &str| {
        post(
            s.addr,
            "/v1/chat/completions",
            json!({"model": m, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        )
        .0
    };
    // Plenty of RAM: both stay loaded.
    assert_eq!(chat("a"), 200);
    assert_eq!(chat("b"), 200);
    let state = |v: &Value, i: usize| v["data"][i]["status"]["value"].as_str().unwrap().to_string();
    let v = models();
    assert_eq!((state(&v, 0), state(&v, 1)), ("loaded".into(), "loaded".into()), "{v}");
    // One byte short of b's min plus the margin: loading b again unloads idle a first.
    // The finished request's relay thread lets go of the model just after the answer is sent.
    let t0 = std::time::Instant::now();
    while !request(s.addr, "POST", "/models/b/unload", &[], None).2.contains("true") {
        assert!(t0.elapsed() < Duration::from_secs(30), "idle b was never unloaded");
        std::thread::sleep(Duration::from_millis(20));
    }
    fake.set(memory(need_b + margin - 1));
    assert_eq!(chat("b"), 200);
    let v = models();
    assert_eq!((state(&v, 0), state(&v, 1)), ("unloaded".into(), "loaded".into()), "{v}");
    // Exactly enough: a loads beside b.
    let v = models();
    let min_a = &v["data"][0]["memory"]["min"][0];
    let need_a =
        min_a["model"].as_u64().unwrap() + min_a["context"].as_u64().unwrap() + min_a["compute"].as_u64().unwrap();
    fake.set(memory(need_a + margin));
    assert_eq!(chat("a"), 200);
    let v = models();
    assert_eq!((state(&v, 0), state(&v, 1)), ("loaded".into(), "loaded".into()), "{v}");
}
