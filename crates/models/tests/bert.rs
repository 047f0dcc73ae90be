//! The BERT encoder against transformers' `BertModel` (float32) on the bert fixture
//! (tests/data/bert, made by its make.py): every token's last hidden state, and the mean-pooled
//! L2-normalised embedding, which llama.cpp's llama-server also gives (the two references agree to
//! 5e-6; both are checked).

use std::path::PathBuf;
use std::sync::Arc;

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

#[test]
fn bert_hidden_states_and_embeddings_match_transformers_and_llama_cpp() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/bert");
    let model = Arc::new(gguf::GgufModel::open(dir.join("model-f32.gguf")).expect("bert fixture"));
    let refs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("ref.json")).expect("ref.json")).expect("json");
    let n_embd = refs["n_embd"].as_u64().expect("n_embd") as usize;
    let mut runner = models::load(&model, &models::LoadOptions::default()).expect("load bert");
    assert_eq!(runner.hparams().embedding_length, n_embd);
    let mut worst_hidden = 0f32;
    let mut worst_embedding = 0f32;
    for case in refs["cases"].as_array().expect("cases") {
        let ids: Vec<u32> =
            case["hf_ids"].as_array().expect("ids").iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let hidden = runner.hidden_states(&ids).expect("hidden states");
        let want: Vec<f32> = case["hidden"].as_array().expect("hidden").iter().flat_map(floats).collect();
        assert_eq!(hidden.len(), want.len(), "{}", case["text"]);
        for (&g, &w) in hidden.iter().zip(&want) {
            worst_hidden = worst_hidden.max((g - w).abs());
        }
        // Mean over tokens, then L2 normalisation (sentence-transformers' Pooling + Normalize).
        let mut pooled = vec![0f64; n_embd];
        for row in hidden.chunks_exact(n_embd) {
            pooled.iter_mut().zip(row).for_each(|(p, &x)| *p += f64::from(x));
        }
        let norm = pooled.iter().map(|x| x * x).sum::<f64>().sqrt();
        let pooled: Vec<f32> = pooled.iter().map(|x| (x / norm) as f32).collect();
        for key in ["embedding", "llama_cpp_embedding"] {
            let want = floats(&case[key]);
            for (&g, &w) in pooled.iter().zip(&want) {
                worst_embedding = worst_embedding.max((g - w).abs());
            }
        }
    }
    println!(
        "bert: worst hidden-state difference {worst_hidden:.2e}, worst embedding difference {worst_embedding:.2e}"
    );
    // f32 against f32 with different summation orders: about 1e-6 per hidden value; the two
    // references differ from each other by up to 5e-6 per embedding value.
    assert!(worst_hidden < 1e-5, "hidden states differ by {worst_hidden}");
    assert!(worst_embedding < 2e-5, "embeddings differ by {worst_embedding}");
}

#[test]
fn bert_refuses_logits_and_texts_longer_than_its_position_table() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/bert");
    let model = Arc::new(gguf::GgufModel::open(dir.join("model-f32.gguf")).expect("bert fixture"));
    let mut runner = models::load(&model, &models::LoadOptions::default()).expect("load bert");
    let err = runner.eval(&[2, 3], models::Outputs::Last).expect_err("an encoder has no logits").to_string();
    assert!(err.contains("encoder"), "{err}");
    // The fixture's position table has 64 rows.
    let err = runner.hidden_states(&[5; 65]).expect_err("too long").to_string();
    assert!(err.contains("64"), "{err}");
    // A text after an error, and texts one after another, start at position 0 again.
    let a = runner.hidden_states(&[2, 40, 3]).expect("short text");
    let b = runner.hidden_states(&[2, 40, 3]).expect("same text again");
    assert_eq!(a, b);
}

/// nomic-bert (rope instead of position embeddings, fused qkv without bias, SwiGLU) against
/// llama.cpp's llama-server on the nomic_bert fixture (tests/data/nomic_bert, made by its make.py;
/// transformers has no class for it): WordPiece ids and mean-pooled embeddings, including a
/// 47-token text where rope positions matter.
#[test]
fn nomic_bert_embeddings_match_llama_cpp() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/nomic_bert");
    let model = Arc::new(gguf::GgufModel::open(dir.join("model-f32.gguf")).expect("nomic_bert fixture"));
    let refs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("ref.json")).expect("ref.json")).expect("json");
    let n_embd = refs["n_embd"].as_u64().expect("n_embd") as usize;
    let tok = tokenizer::Tokenizer::from_gguf(model.metadata()).expect("WordPiece vocabulary");
    let mut runner = models::load(&model, &models::LoadOptions::default()).expect("load nomic-bert");
    let mut worst = 0f32;
    for case in refs["cases"].as_array().expect("cases") {
        let text = case["text"].as_str().expect("text");
        let want_ids: Vec<u32> =
            case["llama_cpp_ids"].as_array().expect("ids").iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let ids = tok.encode(text, true, false).expect("encode");
        assert_eq!(ids, want_ids, "{text:?}");
        let hidden = runner.hidden_states(&ids).expect("hidden states");
        let mut pooled = vec![0f64; n_embd];
        for row in hidden.chunks_exact(n_embd) {
            pooled.iter_mut().zip(row).for_each(|(p, &x)| *p += f64::from(x));
        }
        let norm = pooled.iter().map(|x| x * x).sum::<f64>().sqrt();
        let want = floats(&case["llama_cpp_embedding"]);
        let case_worst = pooled.iter().zip(&want).map(|(g, &w)| ((g / norm) as f32 - w).abs()).fold(0f32, f32::max);
        println!("nomic-bert {} tokens: {case_worst:.2e}", ids.len());
        worst = worst.max(case_worst);
    }
    println!("nomic-bert: worst embedding difference {worst:.2e}");
    // Both f32 (llama.cpp with flash attention off, see make.py): measured 2.3e-7.
    assert!(worst < 2e-6, "embeddings differ by {worst}");
}
