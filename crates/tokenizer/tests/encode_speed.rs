//! Encoding speed on about 1 MB of varied text. Release builds need 0.1 s (GPT-2 splitter) to
//! 0.8 s (Gemma's 262k SentencePiece vocabulary) of CPU for it (examples/encode_file.rs measures a
//! file); the bound here is wall time in a test build on shared cores, so it is loose: it catches
//! losing the per-word cache or a quadratic step, not small regressions.

use std::path::Path;
use std::time::Instant;

use tokenizer::Tokenizer;

/// About `n_bytes` of text: fixture strings mixed with pseudo-random words, so that the per-word
/// cache sees both repeats and new words.
// `is_multiple_of` needs Rust 1.87; the workspace supports 1.85.
#[allow(clippy::manual_is_multiple_of)]
fn corpus(n_bytes: usize) -> String {
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/trained-gpt2.json")).unwrap(),
    )
    .unwrap();
    let cases: Vec<String> =
        fixture["cases"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()).collect();
    let mut text = String::with_capacity(n_bytes + 1024);
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let letters = "etaoinshrdlucmfwypvbgkjqxzéü";
    let letters: Vec<char> = letters.chars().collect();
    while text.len() < n_bytes {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if state % 7 == 0 {
            text.push_str(&cases[(state >> 8) as usize % cases.len()]);
            text.push('\n');
            continue;
        }
        let len = 1 + (state >> 20) as usize % 9;
        text.push(' ');
        for i in 0..len {
            text.push(letters[(state >> (i * 5 + 3)) as usize % letters.len()]);
        }
        if state % 11 == 0 {
            text.push_str(", 2024.");
        }
    }
    text
}

fn measure(label: &str, tok: &Tokenizer, text: &str) -> f64 {
    let start = Instant::now();
    let ids = tok.encode(text, true, true).unwrap();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{label}: {} bytes -> {} tokens in {:.3} s ({:.1} MB/s)",
        text.len(),
        ids.len(),
        secs,
        text.len() as f64 / secs / 1e6
    );
    assert!(ids.len() > text.len() / 20, "{label}: suspiciously few tokens");
    secs
}

#[test]
fn encodes_a_megabyte_quickly() {
    let text = corpus(1 << 20);
    for name in ["tok-gpt2.gguf", "tok-qwen2.gguf"] {
        let model = gguf::GgufModel::open(Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata").join(name)).unwrap();
        let tok = Tokenizer::from_gguf(model.metadata()).unwrap();
        let secs = measure(name, &tok, &text);
        assert!(secs < 30.0, "{name}: {secs:.2} s for 1 MB");
    }
    let models = match std::env::var_os("DISKFORMER_MODELS_DIR") {
        Some(dir) => std::path::PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"),
    };
    for name in ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"] {
        let path = models.join(name);
        if !path.is_file() {
            println!("{name}: absent, not measured (scripts/get-models.sh fetches it)");
            continue;
        }
        let model = gguf::GgufModel::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(model.metadata()).unwrap();
        let secs = measure(name, &tok, &text);
        assert!(secs < 30.0, "{name}: {secs:.2} s for 1 MB");
    }
}
