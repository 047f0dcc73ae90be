//! The CPU back end's fast paths against the plain reference kernels of `compute::cpu::kernels`
//! on random inputs: odd sizes and tails, sizes on both sides of the threading thresholds,
//! repeated calls (pooled buffers, cached rope angles), and f16 KV caches against the reference
//! run on keys and values rounded to f16.

use compute::cpu::{kernels, CpuBackend, CpuTensor, KvType};
use compute::quant::MatmulMode;
use compute::spec::{Act, AttnSpec, Glu, RopeSpec, Yarn};
use compute::Backend;
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn tensor(b: &CpuBackend, rng: &mut StdRng, shape: &[usize], scale: f32) -> CpuTensor {
    let n = shape.iter().product();
    b.from_host(&rand_vec(rng, n, scale), shape).unwrap()
}

/// Largest |got - want| / (1 + |want|) over the pairs.
fn max_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    got.iter().zip(want).map(|(g, w)| (g - w).abs() / (1.0 + w.abs())).fold(0.0, f32::max)
}

#[test]
fn element_wise_ops_match_the_scalar_formulas_below_and_above_the_thread_thresholds() {
    let b = CpuBackend::new(MatmulMode::Exact);
    let mut rng = StdRng::seed_from_u64(7);
    // 1 x 577 (decode, serial), 37 x 4099 (prefill, split over threads, ragged last chunk).
    for (rows, width) in [(1, 577), (3, 5), (37, 4099)] {
        let x = tensor(&b, &mut rng, &[rows, width], 4.0);
        let y = tensor(&b, &mut rng, &[rows, width], 4.0);
        let row = tensor(&b, &mut rng, &[width], 2.0);
        let want: Vec<f32> = x.data.iter().zip(&y.data).map(|(a, c)| a + c).collect();
        assert_eq!(b.add(&x, &y).unwrap().data, want, "add {rows}x{width}");
        let want: Vec<f32> = x.data.iter().enumerate().map(|(i, a)| a * row.data[i % width]).collect();
        assert_eq!(b.mul(&x, &row).unwrap().data, want, "mul broadcast {rows}x{width}");
        let want: Vec<f32> = x.data.iter().enumerate().map(|(i, a)| a + row.data[i % width]).collect();
        assert_eq!(b.add(&x, &row).unwrap().data, want, "add broadcast {rows}x{width}");
        let want: Vec<f32> = x.data.iter().map(|a| a * 0.37).collect();
        assert_eq!(b.scale(&x, 0.37).unwrap().data, want, "scale {rows}x{width}");
        for act in [Act::Silu, Act::Gelu, Act::GeluTanh, Act::Relu] {
            let want: Vec<f32> = x.data.iter().map(|&a| kernels::act(a, act)).collect();
            assert_eq!(b.act(&x, act).unwrap().data, want, "{act:?} {rows}x{width}");
        }
        for glu in [Glu::Plain(Act::Silu), Glu::Plain(Act::GeluTanh), Glu::SwiGluOai { alpha: 1.702, limit: 7.0 }] {
            let want: Vec<f32> = x.data.iter().zip(&y.data).map(|(&g, &u)| kernels::glu(g, u, glu)).collect();
            let got = b.glu(&x, &y, glu).unwrap().data.clone();
            if glu == Glu::Plain(Act::GeluTanh) {
                // Vectorised as a logistic with a polynomial exp (cpu/gelu.rs, where its error
                // against f64 is tested): a few units of rounding, not the same bits.
                let err = max_err(&got, &want);
                assert!(err < 1e-5, "{glu:?} {rows}x{width}: error {err}");
            } else {
                assert_eq!(got, want, "{glu:?} {rows}x{width}");
            }
        }
        let mut want = x.data.clone();
        want.chunks_mut(width).for_each(|r| kernels::rms_norm(r, Some(&row.data), 1e-6));
        assert_eq!(b.rms_norm(&x, Some(&row), 1e-6).unwrap().data, want, "rms_norm {rows}x{width}");
        let mut want = x.data.clone();
        want.chunks_mut(width).for_each(|r| kernels::layer_norm(r, Some(&row.data), Some(&row.data), 1e-5));
        assert_eq!(b.layer_norm(&x, Some(&row), Some(&row), 1e-5).unwrap().data, want, "layer_norm {rows}x{width}");
    }
}

#[test]
fn pooled_outputs_never_show_values_of_earlier_tensors() {
    // Tensors of shrinking and growing sizes created and dropped in turn: each output must hold
    // exactly its own values whatever buffer it reuses.
    let b = CpuBackend::new(MatmulMode::Exact);
    let mut rng = StdRng::seed_from_u64(11);
    for round in 0..20 {
        let rows = 1 + (round * 7) % 13;
        let width = 3 + (round * 29) % 61;
        let x = tensor(&b, &mut rng, &[rows, width], 1.0);
        let cols = b.slice_cols(&x, 1, width - 2).unwrap();
        let want: Vec<f32> = x.data.chunks(width).flat_map(|r| r[1..width - 1].to_vec()).collect();
        assert_eq!(cols.data, want, "slice_cols round {round}");
        assert_eq!(cols.shape, vec![rows, width - 2]);
        let cat = b.concat_cols(&[&cols, &x]).unwrap();
        assert_eq!(cat.shape, vec![rows, 2 * width - 2]);
        for (r, out) in cat.data.chunks(2 * width - 2).enumerate() {
            assert_eq!(&out[..width - 2], &cols.data[r * (width - 2)..(r + 1) * (width - 2)]);
            assert_eq!(&out[width - 2..], &x.data[r * width..(r + 1) * width]);
        }
        let last = b.slice_rows(&x, rows - 1, 1).unwrap();
        assert_eq!(last.data, x.data[(rows - 1) * width..].to_vec());
        let r = b.reshape(cat, &[rows * (2 * width - 2)]).unwrap();
        assert_eq!(r.shape, vec![rows * (2 * width - 2)]);
    }
}

fn rope_reference(x: &[f32], width: usize, positions: &[u32], spec: &RopeSpec) -> Vec<f32> {
    let table = kernels::RopeTable::new(spec);
    let mut out = x.to_vec();
    for (row, &p) in out.chunks_mut(width).zip(positions) {
        let (cos, sin) = table.cos_sin(p);
        for head in row.chunks_mut(spec.head_dim) {
            kernels::rope_head(head, &cos, &sin, spec.n_rot, spec.neox);
        }
    }
    out
}

#[test]
fn rope_matches_the_reference_across_alternating_variants_and_positions() {
    // Cached angles must follow every change of spec and positions: alternate two variants
    // (gemma3's local and global layers), repeat positions, then move on, then prefill.
    let b = CpuBackend::new(MatmulMode::Exact);
    let mut rng = StdRng::seed_from_u64(3);
    let plain = RopeSpec::new(18, 10000.0, false);
    let neox_partial = RopeSpec { n_rot: 10, ..RopeSpec::new(18, 1e6, true) };
    let yarn = RopeSpec {
        yarn: Some(Yarn {
            factor: 8.0,
            original_context: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attn_factor: 1.2,
        }),
        freq_factors: Some((0..9).map(|i| 1.0 + i as f32 * 0.5).collect()),
        ..RopeSpec::new(18, 500000.0, false)
    };
    let calls: Vec<(Vec<u32>, &RopeSpec)> = vec![
        (vec![0], &plain),
        (vec![0], &neox_partial),
        (vec![0], &plain),
        (vec![1], &plain),
        (vec![1], &neox_partial),
        (vec![1], &yarn),
        (vec![2], &yarn),
        (vec![2], &plain),
        ((5..42).collect(), &plain),
        ((5..42).collect(), &neox_partial),
        ((3000..5000).step_by(3).collect(), &yarn),
        (vec![7], &neox_partial),
    ];
    for (positions, spec) in calls {
        let width = 5 * 18;
        let x = tensor(&b, &mut rng, &[positions.len(), width], 2.0);
        let got = b.rope(&x, &positions, spec).unwrap();
        let want = rope_reference(&x.data, width, &positions, spec);
        assert_eq!(got.data, want, "rope {spec:?} at {} positions from {}", positions.len(), positions[0]);
    }
}

/// Reference attention: `kernels::attend_one` over every (token, head), on a cache holding
/// `k_all` / `v_all` (the rows written so far, f16-rounded for an f16 cache).
fn attention_reference(
    q: &[f32],
    k_all: &[f32],
    v_all: &[f32],
    spec: &AttnSpec,
    pos0: usize,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let (kw, vw) = (spec.n_head_kv * spec.head_dim_k, spec.n_head_kv * spec.head_dim_v);
    let qw = spec.n_head * spec.head_dim_k;
    let n = q.len() / qw;
    let mut out = vec![0f32; n * spec.n_head * spec.head_dim_v];
    for (idx, o) in out.chunks_mut(spec.head_dim_v).enumerate() {
        let (i, h) = (idx / spec.n_head, idx % spec.n_head);
        let view = kernels::CacheView { k: k_all, v: v_all, k_width: kw, v_width: vw };
        let qh = &q[i * qw + h * spec.head_dim_k..][..spec.head_dim_k];
        kernels::attend_one(qh, view, h, pos0 + i, spec, sinks.map(|s| s[h]), o);
    }
    out
}

#[test]
fn attention_matches_the_reference_on_f32_and_f16_caches() {
    let mut rng = StdRng::seed_from_u64(5);
    let specs = [
        // GQA, a head size with an 8-wide tail and no 16-wide block.
        AttnSpec { n_head: 6, n_head_kv: 2, head_dim_k: 13, head_dim_v: 13, scale: 0.3, window: None, softcap: None },
        // Head sizes of real models, sliding window and soft-cap (gemma).
        AttnSpec {
            n_head: 4,
            n_head_kv: 1,
            head_dim_k: 64,
            head_dim_v: 64,
            scale: 0.125,
            window: Some(5),
            softcap: Some(30.0),
        },
        // Different key and value widths (DeepSeek MLA), odd, above 16.
        AttnSpec { n_head: 3, n_head_kv: 3, head_dim_k: 37, head_dim_v: 21, scale: 0.2, window: None, softcap: None },
        // Big enough to run over threads in prefill.
        AttnSpec {
            n_head: 16,
            n_head_kv: 4,
            head_dim_k: 128,
            head_dim_v: 128,
            scale: 0.088,
            window: None,
            softcap: None,
        },
    ];
    for (si, spec) in specs.iter().enumerate() {
        for kv_type in [KvType::F32, KvType::F16] {
            for with_sinks in [false, true] {
                let b = CpuBackend::new(MatmulMode::Exact).with_kv_type(kv_type);
                let (kw, vw) = (spec.n_head_kv * spec.head_dim_k, spec.n_head_kv * spec.head_dim_v);
                let n_ctx = 80;
                let mut cache = b.new_cache(n_ctx, kw, vw).unwrap();
                assert_eq!(cache.kv_type(), kv_type);
                assert_eq!(cache.size_bytes(), n_ctx * (kw + vw) * if kv_type == KvType::F16 { 2 } else { 4 });
                let sinks = with_sinks.then(|| tensor(&b, &mut rng, &[spec.n_head], 2.0));
                let (mut k_all, mut v_all) = (Vec::new(), Vec::new());
                let mut pos0 = 0;
                // A prefill of 67 tokens, then single-token decode steps.
                for n in [67, 1, 1, 1] {
                    let q = tensor(&b, &mut rng, &[n, spec.n_head * spec.head_dim_k], 1.5);
                    let k = tensor(&b, &mut rng, &[n, kw], 1.5);
                    let v = tensor(&b, &mut rng, &[n, vw], 1.5);
                    let round = |x: &[f32]| -> Vec<f32> {
                        match kv_type {
                            KvType::F32 => x.to_vec(),
                            KvType::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
                        }
                    };
                    k_all.extend(round(&k.data));
                    v_all.extend(round(&v.data));
                    let got = b.attention(&q, &k, &v, &mut cache, pos0, spec, sinks.as_ref()).unwrap();
                    let want =
                        attention_reference(&q.data, &k_all, &v_all, spec, pos0, sinks.as_ref().map(|s| &s.data[..]));
                    let err = max_err(&got.data, &want);
                    assert!(err < 2e-5, "spec {si} {kv_type:?} sinks {with_sinks} pos0 {pos0} n {n}: error {err}");
                    pos0 += n;
                }
            }
        }
    }
}

#[test]
fn attention_refuses_a_full_context_and_bad_shapes() {
    let b = CpuBackend::new(MatmulMode::Exact).with_kv_type(KvType::F16);
    let spec =
        AttnSpec { n_head: 2, n_head_kv: 1, head_dim_k: 4, head_dim_v: 4, scale: 0.5, window: None, softcap: None };
    let mut cache = b.new_cache(2, 4, 4).unwrap();
    let q = b.from_host(&[0.1; 3 * 8], &[3, 8]).unwrap();
    let kv = b.from_host(&[0.2; 3 * 4], &[3, 4]).unwrap();
    let err = b.attention(&q, &kv, &kv, &mut cache, 0, &spec, None).unwrap_err();
    assert!(matches!(err, compute::OpError::ContextFull { n_ctx: 2, n_tokens: 3, .. }), "{err}");
    let bad_k = b.from_host(&[0.2; 3 * 5], &[3, 5]).unwrap();
    let err = b.attention(&q, &bad_k, &kv, &mut cache, 0, &spec, None).unwrap_err();
    assert!(matches!(err, compute::OpError::ShapeMismatch { .. }), "{err}");
}
