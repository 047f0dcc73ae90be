//! compute::quant against whole fixture files (../shared/fixtures): every tensor of several
//! GGUFs dequantized and compared with the sha256 of gguf-py's numpy dequantization
//! (testdata/quant/fixture_digests.tsv), and every quantized tensor of every fixture
//! re-quantized from model-f32.gguf and compared byte for byte with llama-quantize's output.
//! Without ../shared the compact committed subset (testdata/quant/refs.gguf) runs instead.

mod quant_common;

use std::collections::BTreeMap;

use compute::quant::{self, GgmlType};
use gguf::GgufModel;
use quant_common::{bit_mismatches, f32_values, fixtures_dir, refs_path};
use sha2::{Digest, Sha256};

fn digest_of(values: &[f32]) -> String {
    let mut h = Sha256::new();
    for v in values {
        h.update(v.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The committed subset: fixture rows and their numpy dequantization.
fn run_compact_dequantize() {
    let model = GgufModel::open(refs_path()).unwrap();
    let mut n = 0;
    for t in model.tensors() {
        let Some(base) = t.info.name.strip_suffix(".q").filter(|b| b.starts_with("fx.")) else {
            continue;
        };
        let want = f32_values(model.tensor(&format!("{base}.deq")).unwrap().data);
        let mut got = vec![0f32; want.len()];
        quant::dequantize(t.info.dtype, t.data, &mut got).unwrap();
        if let Some(msg) = bit_mismatches(&got, &want) {
            panic!("{base}: {msg}");
        }
        n += 1;
    }
    assert!(n >= 9, "refs.gguf has {n} fixture samples, expected 9");
    println!("ran the compact set: {n} fixture samples from testdata/quant/refs.gguf");
}

#[test]
fn fixture_tensors_dequantize_like_gguf_py() {
    let Some(dir) = fixtures_dir() else {
        println!("../shared/fixtures not found: full set skipped");
        run_compact_dequantize();
        return;
    };
    let table = include_str!("../testdata/quant/fixture_digests.tsv");
    let mut by_file: BTreeMap<&str, Vec<(&str, &str, usize, &str)>> = BTreeMap::new();
    for line in table.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split('\t').collect();
        by_file.entry(f[0]).or_default().push((f[1], f[2], f[3].parse().unwrap(), f[4]));
    }
    let mut n_tensors = 0;
    for (file, rows) in &by_file {
        let model = GgufModel::open(dir.join(file)).unwrap();
        for &(name, ty, n_values, want) in rows {
            let t = model.tensor(name).unwrap();
            assert_eq!(t.info.dtype.name(), ty, "{file} {name}");
            let mut got = vec![0f32; n_values];
            quant::dequantize(t.info.dtype, t.data, &mut got).unwrap();
            assert_eq!(digest_of(&got), want, "{file} {name} ({ty}): dequantization differs from gguf-py");
            n_tensors += 1;
        }
    }
    println!("ran the full set: {n_tensors} tensors of {} fixture files match gguf-py bit for bit", by_file.len());
}

#[test]
fn fixture_tensors_requantize_like_llama_quantize() {
    let Some(dir) = fixtures_dir() else {
        println!("../shared/fixtures not found: full set skipped (compact set: quant_refs.rs)");
        return;
    };
    let mut per_type: BTreeMap<GgmlType, (usize, usize)> = BTreeMap::new();
    let mut archs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model-f32.gguf").is_file())
        .collect();
    archs.sort();
    for arch in &archs {
        let f32_model = GgufModel::open(arch.join("model-f32.gguf")).unwrap();
        for variant in ["q8_0", "q4_0", "q4_1", "q4_k_m", "q5_k_m", "q6_k"] {
            let path = arch.join(format!("model-{variant}.gguf"));
            if !path.is_file() {
                continue;
            }
            let model = GgufModel::open(&path).unwrap();
            for t in model.tensors() {
                let dtype = t.info.dtype;
                if !dtype.is_quantized() {
                    continue;
                }
                let src = f32_model.tensor(&t.info.name).unwrap();
                assert_eq!(src.info.dtype, GgmlType::F32, "{} in model-f32.gguf", t.info.name);
                let x = f32_values(src.data);
                let mut got = vec![0u8; t.data.len()];
                quant::quantize(dtype, &x, &mut got).unwrap();
                let bb = dtype.block_bytes();
                let bad = got.chunks(bb).zip(t.data.chunks(bb)).filter(|(a, b)| a != b).count();
                assert_eq!(
                    bad,
                    0,
                    "{}: {} ({dtype}): {bad} blocks differ from llama-quantize",
                    path.display(),
                    t.info.name
                );
                let e = per_type.entry(dtype).or_default();
                e.0 += 1;
                e.1 += t.data.len() / bb;
            }
        }
    }
    let summary: Vec<String> = per_type.iter().map(|(t, (n, b))| format!("{t}: {n} tensors/{b} blocks")).collect();
    println!("ran the full set over {} archs: {}", archs.len(), summary.join(", "));
    assert!(per_type.len() >= 8, "expected 8 quantized types in the fixtures, saw {summary:?}");
}
