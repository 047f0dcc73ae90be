//! Shared by the plan crate's tests: where the fixtures are, and a writer of fixture copies with
//! a chat template and think markers.
#![allow(dead_code)]

use gguf::{GgufModel, GgufWriter, Value, ValueType};
use std::path::{Path, PathBuf};

/// The fixture root: `../shared/fixtures` (full set) when it exists, else the compact subset in
/// `tests/fixtures`. Prints which.
pub fn fixtures() -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let full = repo.join("../shared/fixtures");
    if full.join("llama").exists() {
        eprintln!("fixtures: full set ({})", full.display());
        full
    } else {
        eprintln!("fixtures: compact subset (tests/fixtures)");
        repo.join("tests/fixtures")
    }
}

/// `<root>/<dir>/model-q4_0.gguf`.
pub fn fixture(dir: &str) -> PathBuf {
    fixtures().join(dir).join("model-q4_0.gguf")
}

/// The real SmolLM2-135M-Instruct in models/ (scripts/get-models.sh), when present.
pub fn smollm2() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

/// A ChatML template in the style of Qwen3's: `enable_thinking=false` writes an empty
/// reasoning block after the generation prompt, so the model answers directly.
pub const CHATML_THINK: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}";

/// Token ids the thinking fixture renames to `<think>` and `</think>`: ids 5 and 6 are the
/// control tokens `<|user|>` and `<|observation|>` of the fixtures' trained vocabulary, which
/// no merge and no test prompt uses.
pub const OPEN_ID: u32 = 5;
/// See [`OPEN_ID`].
pub const CLOSE_ID: u32 = 6;

/// Copies the GGUF `src` to `dst` with `template` as its chat template, ids 5 and 6 renamed to
/// `<think>`/`</think>`, and the embedding and output rows of each pair in `swaps` exchanged.
/// Exchanging rows a and b relabels the vocabulary: the copy computes exactly what the
/// original does, with ids a and b trading places wherever they are generated (as long as
/// neither is in the prompt). That makes a model with random weights emit the think markers at
/// chosen steps.
pub fn write_chat_fixture(src: &Path, dst: &Path, template: &str, swaps: &[(u32, u32)]) {
    let m = GgufModel::open(src).unwrap();
    let mut w = GgufWriter::new();
    w.set_all(m.metadata());
    w.set("tokenizer.chat_template", Value::String(template.into()));
    let mut tokens: Vec<Value> = match m.metadata().get("tokenizer.ggml.tokens") {
        Some(Value::Array(_, v)) => v.clone(),
        other => panic!("fixture has no token list: {other:?}"),
    };
    tokens[OPEN_ID as usize] = Value::String("<think>".into());
    tokens[CLOSE_ID as usize] = Value::String("</think>".into());
    w.set("tokenizer.ggml.tokens", Value::Array(ValueType::String, tokens));
    for t in m.tensors() {
        w.add_tensor(t.name(), t.dtype(), t.shape()).unwrap();
    }
    let mut sink = w.create(dst).unwrap();
    for t in m.tensors() {
        let mut data = t.data.to_vec();
        if t.name() == gguf::names::TOKEN_EMBD || t.name() == gguf::names::OUTPUT {
            let row = t.dtype().row_bytes(t.shape()[0]).unwrap() as usize;
            for &(a, b) in swaps {
                let (a, b) = (a.min(b) as usize, a.max(b) as usize);
                let (lo, hi) = data.split_at_mut(b * row);
                lo[a * row..(a + 1) * row].swap_with_slice(&mut hi[..row]);
            }
        }
        sink.write_data(&data).unwrap();
    }
    sink.finish().unwrap();
}
