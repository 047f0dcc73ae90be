//! The tokenizer against llama.cpp's recorded ids (shared fixtures "Tokenizer fixtures", copied to
//! testdata/ with their provenance in testdata/README.md).
//!
//! Trained vocabularies (byte-level BPE, pre-tokenizers "gpt-2" and "qwen2") run from the committed
//! vocab-only GGUFs. The two real models (SmolLM2-135M-Instruct, Gemma 3 270M) are fetched by
//! scripts/get-models.sh into models/ (or $DISKFORMER_MODELS_DIR); without them these tests fail
//! unless DISKFORMER_SKIP_REAL_MODELS=1.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizer::{StreamDecoder, Tokenizer};

fn testdata(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata").join(name)
}

fn load_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn load_tokenizer(path: &Path) -> Tokenizer {
    let model = gguf::GgufModel::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(model.metadata()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect()
}

/// Checks every case in every mode; returns the number of checks. Panics listing all mismatches.
fn check_cases(tok: &Tokenizer, fixture: &Value, label: &str) -> usize {
    assert_eq!(tok.n_vocab() as u64, fixture["n_vocab"].as_u64().unwrap(), "{label}: n_vocab");
    assert_eq!(tok.bos().map(u64::from), fixture["bos"].as_u64(), "{label}: bos");
    assert_eq!(tok.eos().map(u64::from), fixture["eos"].as_u64(), "{label}: eos");
    assert_eq!(tok.add_bos(), fixture["add_bos"].as_bool().unwrap(), "{label}: add_bos");
    assert_eq!(tok.add_eos(), fixture["add_eos"].as_bool().unwrap(), "{label}: add_eos");
    let mut failures = Vec::new();
    let mut n_checks = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(hex_bytes(case["hex"].as_str().unwrap()), text.as_bytes(), "{label}: case text");
        let expected = &case["llama_cpp"];
        for (mode, add_special, parse_special) in
            [("plain", false, false), ("parse_special", false, true), ("add_special_parse_special", true, true)]
        {
            let got = tok.encode(text, add_special, parse_special).unwrap();
            let want = ids(&expected[mode]);
            n_checks += 1;
            if got != want {
                failures.push(format!("{label} {mode} {text:?}:\n   got {got:?}\n  want {want:?}"));
            }
        }
        for (id, hex) in expected["pieces_hex"].as_object().unwrap() {
            let id: u32 = id.parse().unwrap();
            n_checks += 1;
            let got = tok.token_to_piece(id, true);
            if got != hex_bytes(hex.as_str().unwrap()) {
                failures.push(format!("{label} piece {id}: got {got:?} want {hex}"));
            }
        }
        // Streaming the plain ids gives the text of llama.cpp's pieces.
        let plain = ids(&expected["plain"]);
        let pieces: Vec<u8> =
            plain.iter().flat_map(|id| hex_bytes(expected["pieces_hex"][id.to_string()].as_str().unwrap())).collect();
        let mut stream = StreamDecoder::new(tok, true);
        let mut streamed = String::new();
        for &id in &plain {
            let delta = stream.push(id);
            streamed.push_str(&delta);
        }
        streamed.push_str(&stream.finish());
        n_checks += 1;
        if streamed != String::from_utf8_lossy(&pieces) {
            failures.push(format!("{label} stream {text:?}: got {streamed:?}"));
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    n_checks
}

#[test]
fn trained_gpt2_matches_llama_cpp() {
    let tok = load_tokenizer(&testdata("tok-gpt2.gguf"));
    let n = check_cases(&tok, &load_json(&testdata("trained-gpt2.json")), "trained-gpt2");
    println!("trained-gpt2: {n} checks passed");
}

#[test]
fn trained_qwen2_matches_llama_cpp() {
    let tok = load_tokenizer(&testdata("tok-qwen2.gguf"));
    let n = check_cases(&tok, &load_json(&testdata("trained-qwen2.json")), "trained-qwen2");
    println!("trained-qwen2: {n} checks passed");
}

/// Where scripts/get-models.sh puts the real models.
fn models_dir() -> PathBuf {
    match std::env::var_os("DISKFORMER_MODELS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"),
    }
}

/// The real model file, or `None` (with a note) when DISKFORMER_SKIP_REAL_MODELS=1 and it is absent.
fn real_model(file: &str) -> Option<PathBuf> {
    let path = models_dir().join(file);
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("DISKFORMER_SKIP_REAL_MODELS").as_deref() == Ok("1") {
        println!("SKIPPED: {} is absent and DISKFORMER_SKIP_REAL_MODELS=1", path.display());
        return None;
    }
    panic!(
        "{} is missing: run scripts/get-models.sh (or set DISKFORMER_MODELS_DIR; \
         DISKFORMER_SKIP_REAL_MODELS=1 skips these tests)",
        path.display()
    );
}

#[test]
fn smollm2_matches_llama_cpp() {
    let Some(path) = real_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let tok = load_tokenizer(&path);
    let fixture = load_json(&testdata("smollm2-135m-instruct-q4_1.json"));
    let mut n = check_cases(&tok, &fixture, "smollm2");
    for result in fixture["generation"]["results"].as_array().unwrap() {
        let prompt = String::from_utf8(hex_bytes(result["prompt_hex"].as_str().unwrap())).unwrap();
        assert_eq!(tok.encode(&prompt, true, true).unwrap(), ids(&result["prompt_ids"]), "prompt {prompt:?}");
        n += 1;
    }
    // End of generation: EOS/EOT and the text-detected ones (llama.cpp `special_eog_ids`).
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let im_start = tok.token_id("<|im_start|>").unwrap();
    assert!(tok.is_eog(im_end) && tok.is_eog(0) && !tok.is_eog(im_start));
    println!("smollm2: {n} checks passed");
}

#[test]
fn gemma3_matches_llama_cpp() {
    let Some(path) = real_model("gemma-3-270m-q4_k_m.gguf") else { return };
    let tok = load_tokenizer(&path);
    let fixture = load_json(&testdata("gemma3-270m-q4_k_m.json"));
    let mut n = check_cases(&tok, &fixture, "gemma3");
    for result in fixture["generation"]["results"].as_array().unwrap() {
        let prompt = String::from_utf8(hex_bytes(result["prompt_hex"].as_str().unwrap())).unwrap();
        assert_eq!(tok.encode(&prompt, true, true).unwrap(), ids(&result["prompt_ids"]), "prompt {prompt:?}");
        n += 1;
    }
    let end_of_turn = tok.token_id("<end_of_turn>").unwrap();
    assert!(tok.is_eog(end_of_turn) && tok.is_eog(tok.eos().unwrap()) && !tok.is_eog(tok.bos().unwrap()));
    println!("gemma3: {n} checks passed");
}
