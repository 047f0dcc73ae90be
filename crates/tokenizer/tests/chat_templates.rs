//! Chat templates rendered like HF transformers renders them: scenarios and expected outputs in
//! testdata/chat/refs.json, produced by scripts/gen_chat_refs.py with transformers 5.24.0.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizer::{ChatMessage, ChatOptions, ChatTemplate, TemplateError};

fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/chat")
}

fn refs() -> Vec<Value> {
    let text = std::fs::read_to_string(chat_dir().join("refs.json")).unwrap();
    let refs: Value = serde_json::from_str(&text).unwrap();
    refs["scenarios"].as_array().unwrap().clone()
}

fn template_of(scenario: &Value) -> ChatTemplate {
    let source = std::fs::read_to_string(chat_dir().join(scenario["template"].as_str().unwrap())).unwrap();
    ChatTemplate::new(&source, scenario["bos_token"].as_str().unwrap(), scenario["eos_token"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", scenario["name"]))
}

fn options_of(scenario: &Value) -> ChatOptions {
    ChatOptions {
        add_generation_prompt: scenario["add_generation_prompt"].as_bool().unwrap(),
        enable_thinking: scenario.get("enable_thinking").and_then(Value::as_bool),
        tools: scenario.get("tools").cloned(),
        extra: scenario
            .get("extra")
            .and_then(Value::as_object)
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default(),
    }
}

#[test]
fn renders_like_transformers() {
    let scenarios = refs();
    let mut failures = Vec::new();
    for scenario in &scenarios {
        let name = scenario["name"].as_str().unwrap();
        let template = template_of(scenario);
        let messages = scenario["messages"].as_array().unwrap();
        let got = template.render_json(messages, &options_of(scenario));
        match (got, scenario.get("expected"), scenario.get("expected_error")) {
            (Ok(text), Some(want), _) if want.as_str() == Some(text.as_str()) => {}
            (Err(TemplateError::Render(e)), None, Some(want)) if e.to_string().contains(want.as_str().unwrap()) => {}
            (got, want, want_error) => {
                failures.push(format!("{name}:\n   got {got:?}\n  want {want:?} / error {want_error:?}"))
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("{} chat template scenarios match transformers", scenarios.len());
}

#[test]
fn typed_messages_render_like_json() {
    let scenario = refs().into_iter().find(|s| s["name"] == "thinking_history").unwrap();
    let messages = vec![
        ChatMessage::new("user", "2+2?"),
        ChatMessage::new("assistant", "<think>\nsimple sum\n</think>\n\n4"),
        ChatMessage::new("user", "times 3?"),
        ChatMessage { reasoning_content: Some("\n4*3 = 12\n".into()), ..ChatMessage::new("assistant", "12") },
    ];
    let got = template_of(&scenario).render(&messages, &options_of(&scenario)).unwrap();
    assert_eq!(got, scenario["expected"].as_str().unwrap());
}

#[test]
fn message_without_role_is_an_error() {
    let scenario = refs().into_iter().next().unwrap();
    let err = template_of(&scenario).render_json(&[serde_json::json!({"content": "x"})], &ChatOptions::default());
    assert!(matches!(err, Err(TemplateError::BadMessage { index: 0 })), "{err:?}");
}

#[test]
fn smollm2_gguf_template_is_the_committed_one() {
    let path = match std::env::var_os("DISKFORMER_MODELS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"),
    }
    .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.is_file() {
        if std::env::var("DISKFORMER_SKIP_REAL_MODELS").as_deref() == Ok("1") {
            println!("SKIPPED: {} is absent and DISKFORMER_SKIP_REAL_MODELS=1", path.display());
            return;
        }
        panic!("{} is missing: run scripts/get-models.sh (DISKFORMER_SKIP_REAL_MODELS=1 skips)", path.display());
    }
    let model = gguf::GgufModel::open(&path).unwrap();
    let md = model.metadata();
    let committed = std::fs::read_to_string(chat_dir().join("smollm2.jinja")).unwrap();
    assert_eq!(md.str("tokenizer.chat_template").unwrap(), committed);
    let template = ChatTemplate::from_gguf(md).unwrap().expect("SmolLM2 has a chat template");
    let scenario = refs().into_iter().find(|s| s["name"] == "smollm2_single_user_generation_prompt").unwrap();
    let got = template.render_json(scenario["messages"].as_array().unwrap(), &options_of(&scenario)).unwrap();
    assert_eq!(got, scenario["expected"].as_str().unwrap());
}
