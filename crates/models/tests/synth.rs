//! Synthetic models: every architecture's tensor list loads, runs to finite logits, and the file
//! holds exactly the regenerated rows; writing is chunked (bounded memory).

use compute::quant::{self, MatmulMode};
use gguf::{GgmlType, GgufModel};
use models::synth::{SynthOptions, SynthPlan, SynthShape, BOS_ID, EOS_ID, SHAPES, SYNTH_ARCHITECTURES};
use models::{load, LoadOptions, Outputs, SUPPORTED_ARCHITECTURES};
use std::io::Write;
use std::sync::Arc;

fn write_tmp(plan: &SynthPlan, dir: &tempdir::Dir, file: &str) -> std::path::PathBuf {
    let path = dir.path().join(file);
    plan.write_file(&path, &mut |_| {}).unwrap();
    path
}

/// A temporary directory removed on drop (no extra dependency for one helper).
mod tempdir {
    pub struct Dir(std::path::PathBuf);
    impl Dir {
        pub fn new(tag: &str) -> Dir {
            let p = std::env::temp_dir().join(format!("diskformer-synth-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
        pub fn path(&self) -> &std::path::Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Every architecture: the file opens, every tensor's bytes are the quantized regenerated rows,
/// and where the registry has the architecture, a prompt and 8 greedy steps give finite,
/// non-constant logits.
#[test]
fn every_architecture_writes_loads_and_runs() {
    let dir = tempdir::Dir::new("arch");
    let mut rows = Vec::new();
    for &arch in SYNTH_ARCHITECTURES {
        for (dtype, exact_quantization) in [(GgmlType::Q8_0, false), (GgmlType::Q4_K, false), (GgmlType::Q4_K, true)] {
            let shape = SynthShape::minimal(arch).unwrap();
            let opts = SynthOptions { dtype, seed: 11, routing_skew: 0.3, chunk_bytes: 4096, exact_quantization };
            let plan = SynthPlan::new(&shape, &opts, "test").unwrap();
            let path = write_tmp(&plan, &dir, &format!("{arch}-{dtype}-{exact_quantization}.gguf"));
            let model = Arc::new(GgufModel::open(&path).unwrap());
            assert_eq!(model.architecture().unwrap(), arch);
            assert_eq!(model.n_tensors(), plan.tensors.len());

            // Determinism: the stored bytes are the regenerated rows; with exact quantization
            // (or for a type without direct blocks) quantize(regenerated values).
            for t in &plan.tensors {
                assert_eq!(t.is_direct(), !exact_quantization && t.dtype == dtype, "{arch} {}", t.name);
                let view = model.tensor(&t.name).unwrap();
                assert_eq!(view.dtype(), t.dtype, "{arch} {}", t.name);
                assert_eq!(view.shape(), &t.shape[..], "{arch} {}", t.name);
                let mut values = vec![0f32; t.row_len()];
                let mut encoded = vec![0u8; t.row_bytes()];
                for (r, stored) in view.data.chunks_exact(t.row_bytes()).enumerate() {
                    if t.is_direct() {
                        t.encode_row(r as u64, &mut encoded).unwrap();
                    } else {
                        t.row_values(r as u64, &mut values);
                        quant::quantize(t.dtype, &values, &mut encoded).unwrap();
                    }
                    assert!(encoded == stored, "{arch} {dtype}: {} row {r} differs from its regeneration", t.name);
                }
            }

            let status = if SUPPORTED_ARCHITECTURES.contains(&arch) {
                let mut runner = load(&model, &LoadOptions { n_ctx: 64, matmul: MatmulMode::Exact }).unwrap();
                let n_vocab = shape.n_vocab;
                let prompt = [BOS_ID, 72, 105, 32, 116, 104, 101, 114, 101];
                let logits = runner.eval(&prompt, Outputs::Last).unwrap();
                assert_eq!(logits.len(), n_vocab);
                let mut next = argmax(&logits);
                let mut seen = vec![next];
                for step in 0..8 {
                    let l = runner.eval(&[next], Outputs::Last).unwrap();
                    assert!(l.iter().all(|x| x.is_finite()), "{arch} {dtype}: non-finite logits at step {step}");
                    let mean = l.iter().sum::<f32>() / l.len() as f32;
                    let std = (l.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / l.len() as f32).sqrt();
                    assert!(std > 0.05 && std < 50.0, "{arch} {dtype}: logit std {std} at step {step}");
                    next = argmax(&l);
                    seen.push(next);
                }
                let distinct: std::collections::HashSet<u32> = seen.iter().copied().collect();
                assert!(distinct.len() > 1, "{arch} {dtype}: greedy decoding repeats one token {seen:?}");
                format!("loaded, greedy {seen:?}")
            } else {
                format!("not in the registry yet ({}): file and bytes checked only", SUPPORTED_ARCHITECTURES.join(","))
            };
            let law = if exact_quantization { "exact" } else { "direct" };
            rows.push(format!("{arch:10} {dtype:5} {law:6} {:>8} bytes  {status}", plan.tensor_bytes()));
        }
    }
    for r in rows {
        println!("{r}");
    }
}

/// Values follow the documented laws: matrices N(0, 1/fan_in), gains around 1, and the router
/// row of rank r has standard deviation r^-S / sqrt(n_embd).
#[test]
fn values_follow_the_documented_distributions() {
    let shape = SynthShape::minimal("qwen3moe").unwrap();
    let skew = 0.5;
    let plan = SynthPlan::new(
        &shape,
        &SynthOptions { dtype: GgmlType::F32, seed: 3, routing_skew: skew, ..SynthOptions::default() },
        "t",
    )
    .unwrap();
    let stats = |t: &models::synth::SynthTensor, rows: std::ops::Range<u64>| {
        let mut v = vec![0f32; t.row_len()];
        let (mut s, mut s2, mut n) = (0f64, 0f64, 0f64);
        for r in rows {
            t.row_values(r, &mut v);
            for &x in &v {
                s += x as f64;
                s2 += (x as f64) * (x as f64);
                n += 1.0;
            }
        }
        let mean = s / n;
        (mean, (s2 / n - mean * mean).sqrt())
    };
    // ffn_down_exps rows have n_ff_exp = 256 values and write into the residual stream: std
    // 1/sqrt(256 * 2 * n_layer). ffn_up_exps rows have n_embd = 256 values: std 1/16.
    let down = plan.tensor("blk.0.ffn_down_exps.weight").unwrap();
    let (mean, std) = stats(down, 0..down.n_rows());
    let want = 1.0 / (256.0 * 2.0 * shape.n_layer as f64).sqrt();
    assert!(mean.abs() < 0.002, "mean {mean}");
    assert!((std - want).abs() < 0.02 * want, "std {std}, want {want}");
    let up = plan.tensor("blk.0.ffn_up_exps.weight").unwrap();
    let (mean, std) = stats(up, 0..up.n_rows());
    assert!(mean.abs() < 0.002, "mean {mean}");
    assert!((std - 1.0 / 16.0).abs() < 0.001, "std {std}");
    // The untied embedding is N(0, 1): unit RMS per token.
    let embd = plan.tensor("token_embd.weight").unwrap();
    let (mean, std) = stats(embd, 0..64);
    assert!(mean.abs() < 0.02 && (std - 1.0).abs() < 0.03, "embedding mean {mean} std {std}");
    let norm = plan.tensor("blk.1.attn_norm.weight").unwrap();
    let (mean, std) = stats(norm, 0..1);
    assert!((mean - 1.0).abs() < 0.01 && (std - 0.02).abs() < 0.01, "gain mean {mean} std {std}");
    // Router: over the experts, std * sqrt(n_embd) sorted descending is 1, 2^-S, 3^-S, ...
    let router = plan.tensor("blk.0.ffn_gate_inp.weight").unwrap();
    assert_eq!(router.dtype, GgmlType::F32);
    let mut stds: Vec<f64> = (0..router.n_rows()).map(|e| stats(router, e..e + 1).1 * 16.0).collect();
    stds.sort_by(|a, b| b.partial_cmp(a).unwrap());
    for (i, s) in stds.iter().enumerate() {
        let want = ((i + 1) as f64).powf(-skew as f64);
        // 256 samples per row: the sample std is within ~3 * want / sqrt(512) of the truth.
        assert!((s - want).abs() < 0.15 * want, "rank {}: std {s}, want {want}", i + 1);
    }
}

/// Direct blocks decode to the documented law: for every type with direct blocks, a matrix's
/// values have mean 0 and the standard deviation of N(0, 1/fan_in) (fan_in times 2 n_layer for
/// the down projections, which write into the residual stream), every value is finite and within
/// 4 standard deviations, and the codes are spread (not one repeated value).
#[test]
fn direct_blocks_decode_to_the_matrix_law() {
    let mut shape = SynthShape::minimal("qwen3moe").unwrap();
    shape.apply_params("n_embd=512,n_ff_exp=256").unwrap();
    for dtype in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K] {
        let plan = SynthPlan::new(&shape, &SynthOptions { dtype, seed: 9, ..SynthOptions::default() }, "t").unwrap();
        for name in ["blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight", "blk.0.attn_q.weight"] {
            let t = plan.tensor(name).unwrap();
            assert!(t.is_direct(), "{dtype} {name}");
            let residual = if name.contains("ffn_down") { 2 * shape.n_layer } else { 1 };
            let want_std = 1.0 / ((t.row_len() * residual) as f64).sqrt();
            let (mut bytes, mut values) = (vec![0u8; t.row_bytes()], vec![0f32; t.row_len()]);
            let (mut s, mut s2, mut n, mut max_abs) = (0f64, 0f64, 0f64, 0f64);
            let mut distinct = std::collections::HashSet::new();
            for r in 0..t.n_rows().min(256) {
                t.encode_row(r, &mut bytes).unwrap();
                quant::dequantize(dtype, &bytes, &mut values).unwrap();
                for &v in &values {
                    assert!(v.is_finite(), "{dtype} {name} row {r}: {v}");
                    let v = v as f64;
                    (s, s2, n, max_abs) = (s + v, s2 + v * v, n + 1.0, max_abs.max(v.abs()));
                    distinct.insert(v.to_bits());
                }
            }
            let mean = s / n;
            let std = (s2 / n - mean * mean).sqrt();
            println!("{dtype:5} {name:28} mean {mean:+.2e} std {std:.4e} (want {want_std:.4e}) max {max_abs:.3e} distinct {}", distinct.len());
            assert!(mean.abs() < 0.02 * want_std, "{dtype} {name}: mean {mean}");
            assert!((std / want_std - 1.0).abs() < 0.02, "{dtype} {name}: std {std}, want {want_std}");
            assert!(max_abs < 4.0 * want_std, "{dtype} {name}: |value| up to {max_abs}");
            assert!(distinct.len() >= 15, "{dtype} {name}: {} distinct values", distinct.len());
        }
    }
}

/// The same seed gives the same file whatever the chunk size and thread count; another seed
/// gives another file.
#[test]
fn output_does_not_depend_on_chunking_or_threads() {
    let shape = SynthShape::minimal("llama").unwrap();
    let bytes = |chunk_bytes: usize, threads: usize, seed: u64| -> Vec<u8> {
        let plan = SynthPlan::new(
            &shape,
            &SynthOptions { dtype: GgmlType::Q4_0, seed, chunk_bytes, ..SynthOptions::default() },
            "t",
        )
        .unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let mut sink = plan.writer().unwrap().start(Vec::new()).unwrap();
            plan.write(&mut sink, &mut |_| {}).unwrap();
            sink.finish().unwrap()
        })
    };
    let a = bytes(1 << 20, 2, 5);
    assert_eq!(a, bytes(100, 1, 5));
    assert_ne!(a, bytes(1 << 20, 2, 6));
}

/// Records the largest single write, to show the writer never hands over more than a chunk.
struct MaxWrite {
    max: usize,
    total: u64,
}

impl Write for MaxWrite {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.max = self.max.max(buf.len());
        self.total += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Memory stays bounded: a ~200 MB model is handed to the sink in writes no larger than one
/// chunk (the header aside), and the process's peak RSS grows by far less than the file.
#[test]
fn writing_is_chunked_and_memory_bounded() {
    // 8 layers of 1024 x 6144 x 3 FFN matrices + attention, Q8_0: about 190 MB.
    let mut shape = SynthShape::minimal("llama").unwrap();
    shape.apply_params("n_layer=8,n_embd=1024,n_head=16,n_head_kv=4,n_ff=6144,n_vocab=4096").unwrap();
    let chunk_bytes = 1 << 20;
    let plan = SynthPlan::new(
        &shape,
        &SynthOptions { dtype: GgmlType::Q8_0, seed: 1, chunk_bytes, ..SynthOptions::default() },
        "t",
    )
    .unwrap();
    let total = plan.tensor_bytes();
    assert!(total > 190_000_000, "model is {total} bytes");
    let hwm_before = peak_rss_bytes();
    let w = plan.writer().unwrap();
    let header = {
        let mut h = MaxWrite { max: 0, total: 0 };
        let sink = w.start(&mut h).unwrap();
        drop(sink);
        h.total as usize
    };
    let mut sink = w.start(MaxWrite { max: 0, total: 0 }).unwrap();
    let mut progressed = 0u64;
    plan.write(&mut sink, &mut |n| progressed += n).unwrap();
    let out = sink.finish().unwrap();
    assert_eq!(progressed, total);
    let largest_row = plan.tensors.iter().map(|t| t.row_bytes()).max().unwrap();
    assert!(out.max <= header.max(chunk_bytes.max(largest_row)), "a write of {} bytes (chunk {chunk_bytes})", out.max);
    match (hwm_before, peak_rss_bytes()) {
        (Some(before), Some(after)) => {
            println!("peak RSS {} MB -> {} MB while writing {} MB", before >> 20, after >> 20, total >> 20);
            // Other tests run in parallel threads of this process, so allow for them; the
            // point is that the model (200 MB) is never resident.
            assert!(after - before < 120 << 20, "peak RSS grew by {} MB", (after - before) >> 20);
        }
        _ => println!("no /proc/self/status VmHWM: peak RSS not checked (chunk sizes were)"),
    }
}

fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The embedded vocabulary is a working byte-level tokenizer: text encodes to its bytes after BOS
/// and decodes back.
#[test]
fn tokenizer_is_byte_level() {
    let dir = tempdir::Dir::new("tok");
    let shape = SynthShape::minimal("llama").unwrap();
    let plan = SynthPlan::new(&shape, &SynthOptions::default(), "t").unwrap();
    let path = write_tmp(&plan, &dir, "tok.gguf");
    let model = GgufModel::open(&path).unwrap();
    let tok = tokenizer::Tokenizer::from_gguf(model.metadata()).unwrap();
    assert_eq!(tok.n_vocab(), shape.n_vocab);
    assert_eq!(tok.bos(), Some(BOS_ID));
    assert_eq!(tok.eos(), Some(EOS_ID));
    let text = "Hé there\n";
    let ids = tok.encode(text, true, true).unwrap();
    let want: Vec<u32> = std::iter::once(BOS_ID).chain(text.bytes().map(u32::from)).collect();
    assert_eq!(ids, want);
    assert_eq!(tok.decode(&ids[1..]), text);
    assert_eq!(tok.decode(&[300]), "[t300]");
}

/// Every named shape validates and has the parameter count of the model it mimics.
#[test]
fn named_shapes_have_their_models_sizes() {
    // Parameter counts from the models' cards (total, including embeddings), to 3%; ours
    // omit Llama 3's rope_freqs and DeepSeek-V3's multi-token-prediction layer.
    let want: &[(&str, f64)] = &[
        ("dense-1b", 1.24e9),
        ("dense-8b", 8.03e9),
        ("qwen3-30b-a3b", 30.5e9),
        ("qwen3-235b-a22b", 235e9),
        ("gpt-oss-20b", 20.9e9),
        ("gpt-oss-120b", 116.8e9),
        ("mixtral-8x7b", 46.7e9),
        ("olmoe-1b-7b", 6.9e9),
        ("deepseek-v3", 671e9),
    ];
    assert_eq!(want.len(), SHAPES.len());
    for &(name, params) in want {
        let shape = SynthShape::named(name).unwrap();
        let plan = SynthPlan::new(&shape, &SynthOptions::default(), name).unwrap();
        let got = plan.n_params() as f64;
        println!("{name:16} {:>7.2} B params, {:>8.1} GB in Q8_0", got / 1e9, plan.tensor_bytes() as f64 / 1e9);
        assert!((got / params - 1.0).abs() < 0.03, "{name}: {got:.3e} params, the real model has {params:.3e}");
    }
}

#[test]
fn bad_input_is_an_error() {
    assert!(SynthShape::named("dense-2b").is_err());
    assert!(SynthShape::minimal("mamba").is_err());
    let mut s = SynthShape::minimal("llama").unwrap();
    assert!(s.apply_params("n_layers=3").is_err());
    assert!(s.apply_params("n_layer=x").is_err());
    assert!(s.apply_params("n_layer").is_err());
    s.apply_params("n_head=5").unwrap();
    assert!(SynthPlan::new(&s, &SynthOptions::default(), "t").is_err());
    let s = SynthShape::minimal("llama").unwrap();
    assert!(SynthPlan::new(&s, &SynthOptions { dtype: GgmlType::IQ2_XXS, ..SynthOptions::default() }, "t").is_err());
    assert!(SynthPlan::new(&s, &SynthOptions { routing_skew: -1.0, ..SynthOptions::default() }, "t").is_err());
}
