//! `Backend::attention_unmasked` (encoders: every token sees every token) against the causal
//! `attention` op, which cpu_ops.rs tests against the reference kernels: a query placed at the
//! last position of a causal pass sees every key, so its output must equal the query's row of the
//! unmasked op. Random inputs, grouped heads, odd head sizes, soft-cap; plus the invariance under
//! a permutation of the tokens and the shape errors.

use compute::cpu::{CpuBackend, CpuTensor};
use compute::quant::MatmulMode;
use compute::spec::AttnSpec;
use compute::Backend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn tensor(b: &CpuBackend, rng: &mut StdRng, shape: &[usize]) -> CpuTensor {
    let n = shape.iter().product();
    b.from_host(&(0..n).map(|_| rng.random_range(-1.5f32..1.5)).collect::<Vec<_>>(), shape).unwrap()
}

fn max_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(g, w)| (g - w).abs() / (1.0 + w.abs())).fold(0.0, f32::max)
}

#[test]
fn each_row_equals_the_causal_op_with_that_query_last() {
    let b = CpuBackend::new(MatmulMode::Exact);
    let mut rng = StdRng::seed_from_u64(11);
    let specs = [
        AttnSpec { n_head: 4, n_head_kv: 4, head_dim_k: 16, head_dim_v: 16, scale: 0.25, window: None, softcap: None },
        AttnSpec { n_head: 6, n_head_kv: 2, head_dim_k: 13, head_dim_v: 7, scale: 0.3, window: None, softcap: None },
        AttnSpec {
            n_head: 2,
            n_head_kv: 1,
            head_dim_k: 33,
            head_dim_v: 33,
            scale: 0.2,
            window: None,
            softcap: Some(5.0),
        },
    ];
    for spec in &specs {
        for n in [1, 2, 9] {
            let (qw, kw, vw) =
                (spec.n_head * spec.head_dim_k, spec.n_head_kv * spec.head_dim_k, spec.n_head_kv * spec.head_dim_v);
            let q = tensor(&b, &mut rng, &[n, qw]);
            let k = tensor(&b, &mut rng, &[n, kw]);
            let v = tensor(&b, &mut rng, &[n, vw]);
            let got = b.attention_unmasked(&q, &k, &v, spec).unwrap();
            assert_eq!(got.shape, [n, spec.n_head * spec.head_dim_v]);
            let ow = spec.n_head * spec.head_dim_v;
            for i in 0..n {
                // Queries: row i of q moved to the last row; the other rows do not matter.
                let mut qd = q.data.clone();
                qd.copy_within(i * qw..(i + 1) * qw, (n - 1) * qw);
                let q_last = b.from_host(&qd, &[n, qw]).unwrap();
                let mut cache = b.new_cache(n, kw, vw).unwrap();
                let causal = b.attention(&q_last, &k, &v, &mut cache, 0, spec, None).unwrap();
                let err = max_err(&got.data[i * ow..(i + 1) * ow], &causal.data[(n - 1) * ow..]);
                assert!(err < 1e-5, "{spec:?} n {n} row {i}: error {err}");
            }
            // Reversing the tokens (q, k and v together) reverses the output rows.
            let rev = |t: &CpuTensor, w: usize| -> CpuTensor {
                let rows: Vec<f32> = t.data.chunks_exact(w).rev().flatten().copied().collect();
                b.from_host(&rows, &[n, w]).unwrap()
            };
            let got_rev = b.attention_unmasked(&rev(&q, qw), &rev(&k, kw), &rev(&v, vw), spec).unwrap();
            let err = max_err(&rev(&got_rev, ow).data, &got.data);
            assert!(err < 1e-6, "{spec:?} n {n}: reversed tokens, error {err}");
        }
    }
}

#[test]
fn bad_shapes_and_windows_are_refused_with_the_shapes() {
    let b = CpuBackend::new(MatmulMode::Exact);
    let spec =
        AttnSpec { n_head: 2, n_head_kv: 1, head_dim_k: 4, head_dim_v: 4, scale: 0.5, window: None, softcap: None };
    let q = b.from_host(&[0.1; 3 * 8], &[3, 8]).unwrap();
    let k = b.from_host(&[0.1; 3 * 4], &[3, 4]).unwrap();
    let v_short = b.from_host(&[0.1; 2 * 4], &[2, 4]).unwrap();
    let err = b.attention_unmasked(&q, &k, &v_short, &spec).unwrap_err().to_string();
    assert!(err.contains("attention_unmasked") && err.contains("v [3, 4]"), "{err}");
    let windowed = AttnSpec { window: Some(2), ..spec };
    let v = b.from_host(&[0.1; 3 * 4], &[3, 4]).unwrap();
    let err = b.attention_unmasked(&q, &k, &v, &windowed).unwrap_err().to_string();
    assert!(err.contains("no window"), "{err}");
}
