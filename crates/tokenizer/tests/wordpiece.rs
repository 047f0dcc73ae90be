//! BERT's WordPiece against two references on the BERT fixture (crates/models/tests/data/bert:
//! a vocabulary trained with HF `tokenizers`, converted by llama.cpp's converter): the ids of HF
//! `BertTokenizerFast` and of llama.cpp's `llama-tokenize`, which agree on every case.

use std::path::PathBuf;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/data/bert")
}

#[test]
fn wordpiece_ids_equal_hf_and_llama_cpp() {
    let dir = fixture();
    let model = gguf::GgufModel::open(dir.join("model-f32.gguf")).expect("bert fixture");
    let tok = tokenizer::Tokenizer::from_gguf(model.metadata()).expect("WordPiece vocabulary");
    let refs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("ref.json")).expect("ref.json")).expect("json");
    let cases = refs["cases"].as_array().expect("cases");
    assert!(cases.len() >= 8);
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want: Vec<u32> =
            case["llama_cpp_ids"].as_array().expect("ids").iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let hf: Vec<u32> = case["hf_ids"].as_array().expect("ids").iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(want, hf, "the references disagree on {text:?}");
        let got = tok.encode(text, true, false).expect("encode");
        assert_eq!(got, want, "{text:?}");
    }
}

#[test]
fn wordpiece_without_special_tokens_has_no_cls_or_sep() {
    let model = gguf::GgufModel::open(fixture().join("model-f32.gguf")).expect("bert fixture");
    let tok = tokenizer::Tokenizer::from_gguf(model.metadata()).expect("WordPiece vocabulary");
    let framed = tok.encode("Hello world", true, false).expect("encode");
    let bare = tok.encode("Hello world", false, false).expect("encode");
    assert_eq!(&framed[1..framed.len() - 1], &bare[..]);
    assert_eq!(tok.bos(), Some(framed[0]));
    // Decoding drops the phantom space of word-initial pieces into real spaces.
    assert_eq!(tok.decode(&bare).trim_start(), "hello world");
}
