//! test-backend-ops for diskformer: every op of the `Backend` set run on the wgpu back end and on
//! the CPU reference from one printed seed (`DISKFORMER_SEED` repeats a run), compared by
//! normalised MSE, Σ(gpu − cpu)² / Σcpu². The default bound is 1e-7 (llama.cpp's
//! test-backend-ops default): both sides compute in f32 on identically dequantized weights, so
//! only the summation order differs. Each case prints `op(vars) wgpu: OK` or `FAIL nmse=...`.
//!
//! No adapter is a failure, unless `DISKFORMER_NO_GPU=1` says the machine has none. CI runs this
//! on Mesa's lavapipe (software Vulkan), so shapes are small but cover tails, odd widths and
//! every weight type. `DISKFORMER_PERF=1` with `--ignored perf` times the decode matrix-vector
//! product against a streaming read (bench/gpu.sh).
//!
//! Needs the `wgpu` feature (`cargo test --all-features` or `-p compute --features wgpu`);
//! without it one test says so.
#![cfg_attr(not(feature = "wgpu"), allow(unused))]

#[cfg(not(feature = "wgpu"))]
#[test]
fn backend_ops_need_the_wgpu_feature() {
    println!(
        "backend_ops: compute was built without the wgpu feature; run with --features wgpu (CI uses --all-features)"
    );
}

#[cfg(feature = "wgpu")]
mod gpu_common;

#[cfg(feature = "wgpu")]
mod gpu_ops {
    use crate::gpu_common::{gpu, rand_vec, seed, tensor, Report, WeightFile};
    use compute::cpu::{CpuBackend, CpuTensor};
    use compute::quant::{GgmlType, MatmulMode};
    use compute::spec::{Act, AttnSpec, Gating, Glu, MoeSpec, RopeSpec, RouteSpec, Yarn};
    use compute::wgpu::{AttnDecodeShape, AttnKernel, MatvecShape, NormKernel, Q8Shape, WgpuBackend};
    use compute::{AttnStep, Backend, Experts};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const DEFAULT_MAX_NMSE: f64 = 1e-7;

    const ALL_TYPES: [GgmlType; 16] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
        GgmlType::MXFP4,
    ];

    fn type_name(t: GgmlType) -> String {
        format!("{t}").to_lowercase()
    }

    /// Collects verdicts; the test fails at the end if any case failed.
    fn up(g: &WgpuBackend, t: &CpuTensor) -> compute::wgpu::WgpuTensor {
        g.from_host(&t.data, &t.shape).expect("upload")
    }

    fn host(
        g: &WgpuBackend,
        t: Result<compute::wgpu::WgpuTensor, compute::OpError>,
    ) -> Result<Vec<f32>, compute::OpError> {
        t.and_then(|t| g.to_host(&t))
    }

    /// `to_host_into` gives `to_host`'s values, replacing what the buffer held (longer and
    /// shorter tensors in turn, up to a vocabulary's logits, which are copied out in pieces on
    /// the thread pool) and keeping its memory once it is large enough.
    #[test]
    fn to_host_into_replaces_the_values_and_keeps_the_memory() {
        let Some(g) = gpu("to_host_into") else { return };
        let mut rng = StdRng::seed_from_u64(seed());
        let mut out = vec![f32::NAN; 3];
        let mut kept = None;
        for n in [1000, 17, 151_936, 151_936, 1000, 160_000, 5] {
            let values = rand_vec(&mut rng, n, 1.0);
            let t = g.from_host(&values, &[n]).expect("upload");
            g.to_host_into(&t, &mut out).expect("to_host_into");
            assert_eq!(out, g.to_host(&t).expect("to_host"), "{n} values");
            assert_eq!(out, values, "{n} values");
            if n == 160_000 {
                kept = Some(out.as_ptr());
            } else if let Some(p) = kept {
                assert_eq!(out.as_ptr(), p, "a shorter read reallocated the buffer");
            }
        }
    }

    /// The decode kernel's q/k-norm variant (`AttnStep::qk_norm`) against the CPU's per-head
    /// norms followed by its attention: every decode shape and the workgroup-memory fallback,
    /// the model path's choice (`rope_attention`), GQA 1, 4 and 8, odd head dims, partial and
    /// neox rotation, NoPE with a window and soft-cap, sinks, 1 to 4 tokens per step at contexts
    /// past several key slices (the combine pass); a 70-token prefill in between takes the norms
    /// apart on both sides, as the model does.
    #[test]
    fn attention_qk_norm_matches_cpu() {
        let Some((g, c, mut rng, mut r)) = gpu_case("attention qk norm") else { return };
        let rng = &mut rng;
        let shape = |s: &str| AttnDecodeShape::parse(s).expect("valid shape");
        let variants: [(&str, Option<AttnKernel>); 5] = [
            ("model path", None),
            ("decode 128x16r1", Some(AttnKernel::Decode { shape: shape("128x16r1"), subgroups: true })),
            ("decode 128x32u1r1", Some(AttnKernel::Decode { shape: shape("128x32u1r1"), subgroups: true })),
            ("decode 64x16u2r2", Some(AttnKernel::Decode { shape: shape("64x16u2r2"), subgroups: true })),
            ("decode 128x16 no subgroups", Some(AttnKernel::Decode { shape: shape("128x16"), subgroups: false })),
        ];
        let spec = attn_spec;
        let cases: Vec<(&str, AttnSpec, Option<RopeSpec>, bool)> = vec![
            ("gqa 32/4 hd 128, neox rope", spec(32, 4, 128, 128, None, None), Some(RopeSpec::new(128, 1e6, true))),
            ("mha 3 hd 40, norm rope", spec(3, 3, 40, 40, None, None), Some(RopeSpec::new(40, 10000.0, false))),
            ("gqa 8/1 hd 32, window 37, softcap 30, NoPE", spec(8, 1, 32, 32, Some(37), Some(30.0)), None),
            (
                "gqa 4/2 hd 48/24, neox n_rot 32",
                spec(4, 2, 48, 24, None, None),
                Some(RopeSpec { n_rot: 32, ..RopeSpec::new(48, 10000.0, true) }),
            ),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, (name, spec, rope))| (name, spec, rope, i == 3))
        .collect();
        let eps = 1e-6;
        for (name, spec, rope, with_sinks) in cases {
            let hd = spec.head_dim_k;
            let n_ctx = 100;
            let (kw, vw) = (spec.n_head_kv * hd, spec.n_head_kv * spec.head_dim_v);
            // Weights away from 1 and of both signs, so a norm left out or misplaced shows.
            let (wq, wk) = (tensor(rng, &[hd], 1.5), tensor(rng, &[hd], 1.5));
            let (gwq, gwk) = (up(&g, &wq), up(&g, &wk));
            let mut cc = c.new_cache(n_ctx, kw, vw).unwrap();
            let mut gcs: Vec<_> = variants.iter().map(|_| g.new_cache(n_ctx, kw, vw).unwrap()).collect();
            let mut pos0 = 0;
            for n in [1usize, 2, 70, 1, 3, 4, 1] {
                let positions: Vec<u32> = (pos0 as u32..(pos0 + n) as u32).collect();
                // Rows of uneven scale: the norm changes them by different factors.
                let q = tensor(rng, &[n, spec.n_head * hd], 4.0);
                let k = tensor(rng, &[n, kw], 0.5);
                let v = tensor(rng, &[n, vw], 2.0);
                let sinks = tensor(rng, &[spec.n_head], 2.0);
                let per_head = |t: &CpuTensor, w: &CpuTensor| {
                    let rows = c.from_host(&t.data, &[t.data.len() / hd, hd]).unwrap();
                    c.rms_norm(&rows, Some(w), eps).unwrap().data.clone()
                };
                let (qn, kn) = (per_head(&q, &wq), per_head(&k, &wk));
                let (cq, ck) = (c.from_host(&qn, &q.shape).unwrap(), c.from_host(&kn, &k.shape).unwrap());
                let step =
                    attn_step([&cq, &ck, &v], pos0, &positions, rope.as_ref(), &spec, with_sinks.then_some(&sinks));
                let want = c.rope_attention(&step, &mut cc).unwrap();
                // A prefill takes the norms apart, as the model does past the decode kernel.
                let decode = n <= 4;
                let (gq, gk) = if decode { (up(&g, &q), up(&g, &k)) } else { (up(&g, &cq), up(&g, &ck)) };
                let (gv, gsinks) = (up(&g, &v), up(&g, &sinks));
                let gstep = AttnStep {
                    qk_norm: decode.then_some(compute::QkNorm { q: &gwq, k: &gwk, eps }),
                    ..attn_step([&gq, &gk, &gv], pos0, &positions, rope.as_ref(), &spec, with_sinks.then_some(&gsinks))
                };
                if decode {
                    r.exact(&format!("attention_norms_qk({name}, n={n})"), Ok(g.attention_norms_qk(n, &spec)), &true);
                }
                for ((label, kernel), gc) in variants.iter().zip(gcs.iter_mut()) {
                    let got = match (kernel, decode) {
                        (None, _) => g.rope_attention(&gstep, gc),
                        (Some(_), false) => g.rope_attention_with(&gstep, gc, AttnKernel::Prefill),
                        (Some(kernel), true) => g.rope_attention_with(&gstep, gc, *kernel),
                    };
                    r.check(
                        &format!("attention with q/k norms, {label} ({name}, pos0={pos0}, n={n})"),
                        host(&g, got),
                        &want.data,
                        DEFAULT_MAX_NMSE,
                    );
                }
                pos0 += n;
            }
        }
        // Past the decode kernel the norms are refused, not skipped.
        r.exact("attention_norms_qk(5 tokens)", Ok(g.attention_norms_qk(5, &spec(2, 1, 32, 32, None, None))), &false);
        r.finish();
    }

    /// `router_route` (for one token the GPU's product and routing in one dispatch, whose last
    /// workgroup routes) against the CPU's product then routing: ids equal, weights within the
    /// default bound; softmax, softmax after the top k, sigmoid with a selection bias and groups;
    /// expert counts that are not a multiple of the kernel's 4 rows per workgroup; several tokens
    /// (the product and the routing apart). The one-token call records one command less than the
    /// product and the routing apart.
    #[test]
    fn router_route_matches_cpu() {
        let Some((g, c, mut rng, mut r)) = gpu_case("router_route") else { return };
        let rng = &mut rng;
        let route = |k: usize, gating: Gating, groups: Option<(usize, usize)>, normalize: bool, scale: f32| RouteSpec {
            k,
            gating,
            has_selection_bias: groups.is_some(),
            groups,
            normalize,
            scale,
        };
        let cases = [
            ("softmax k=8 of 128, 256 wide", 128usize, 256usize, route(8, Gating::Softmax, None, true, 1.0)),
            ("softmax after top-k k=4 of 60, 64 wide", 60, 64, route(4, Gating::SoftmaxAfterTopK, None, false, 1.0)),
            (
                "sigmoid, bias, groups 8/4, k=6 of 64, 2048 wide",
                64,
                2048,
                route(6, Gating::Sigmoid, Some((8, 4)), true, 2.5),
            ),
            ("softmax k=2 of 7, 32 wide", 7, 32, route(2, Gating::Softmax, None, true, 1.0)),
        ];
        for (name, n_expert, n_embd, spec) in cases {
            let values = rand_vec(rng, n_expert * n_embd, 0.5);
            let file = WeightFile::new("router", &[("router".into(), GgmlType::F32, vec![n_expert, n_embd], values)]);
            let (cw, gw) = (c.weight(&file.get("router")).unwrap(), g.weight(&file.get("router")).unwrap());
            let bias = tensor(rng, &[n_expert], 0.5);
            let gbias = up(&g, &bias);
            let has_bias = spec.has_selection_bias;
            for n in [1usize, 3] {
                let x = tensor(rng, &[n, n_embd], 1.0);
                let want = c.router_route(&x, &cw, has_bias.then_some(&bias), &spec).unwrap();
                let gx = up(&g, &x);
                g.to_host(&gx).unwrap();
                let before = g.commands_submitted();
                let got = g.router_route(&gx, &gw, has_bias.then_some(&gbias), &spec);
                let got = got.and_then(|got| Ok((g.routing_ids(&got)?, g.to_host(&got.weights)?)));
                let fused_commands = g.commands_submitted() - before;
                match got {
                    Ok((ids, weights)) => {
                        r.exact(&format!("router_route({name}, n={n}) ids"), Ok(ids), &want.ids);
                        let case = format!("router_route({name}, n={n}) weights");
                        r.check(&case, Ok(weights), &want.weights.data, DEFAULT_MAX_NMSE);
                    }
                    Err(e) => r.check(&format!("router_route({name}, n={n})"), Err(e), &[], 0.0),
                }
                if n == 1 {
                    let before = g.commands_submitted();
                    let apart = g.matmul(&gx, &gw).and_then(|l| g.route(&l, has_bias.then_some(&gbias), &spec));
                    let apart = apart.and_then(|a| Ok((g.routing_ids(&a)?, g.to_host(&a.weights)?)));
                    let apart_commands = g.commands_submitted() - before;
                    let counts = apart.map(|_| (fused_commands + 1, apart_commands));
                    r.exact(
                        &format!("router_route({name}) one command less than apart"),
                        counts.map(|(a, _)| a),
                        &apart_commands,
                    );
                }
            }
        }
        r.finish();
    }

    /// Attention heads, head dims (keys, values), the usual 1/sqrt(head dim) scale, a sliding
    /// window and a soft-cap.
    fn attn_spec(
        n_head: usize,
        n_head_kv: usize,
        hdk: usize,
        hdv: usize,
        window: Option<usize>,
        softcap: Option<f32>,
    ) -> AttnSpec {
        AttnSpec {
            n_head,
            n_head_kv,
            head_dim_k: hdk,
            head_dim_v: hdv,
            scale: 1.0 / (hdk as f32).sqrt(),
            window,
            softcap,
        }
    }

    /// An attention step of `[q, k, v]` with no q/k norms inside.
    fn attn_step<'a, B: Backend>(
        [q, k, v]: [&'a B::Tensor; 3],
        pos0: usize,
        positions: &'a [u32],
        rope: Option<&'a RopeSpec>,
        spec: &'a AttnSpec,
        sinks: Option<&'a B::Tensor>,
    ) -> AttnStep<'a, B> {
        AttnStep { q, k, v, pos0, positions, rope, spec, sinks, qk_norm: None }
    }

    /// A test's GPU back end (`None`: no adapter, said), the CPU reference, its random
    /// numbers from the printed seed and an empty report.
    fn gpu_case(name: &str) -> Option<(WgpuBackend, CpuBackend, StdRng, Report)> {
        let g = gpu(name)?;
        let seed = seed();
        println!("seed: {seed} (DISKFORMER_SEED={seed} repeats this run)");
        let report = Report { failures: Vec::new(), ran: 0 };
        Some((g, CpuBackend::new(MatmulMode::Exact), StdRng::seed_from_u64(seed), report))
    }

    #[test]
    fn backend_ops_match_cpu() {
        let Some((g, c, mut rng, mut r)) = gpu_case("backend_ops") else { return };

        matmul_cases(&g, &c, &mut rng, &mut r);
        elementwise_cases(&g, &c, &mut rng, &mut r);
        norm_rope_cases(&g, &c, &mut rng, &mut r);
        norm_kernel_cases(&g, &c, &mut rng, &mut r);
        shape_cases(&g, &c, &mut rng, &mut r);
        attention_cases(&g, &c, &mut rng, &mut r);
        attention_decode_cases(&g, &c, &mut rng, &mut r);
        fused_cases(&g, &c, &mut rng, &mut r);
        int8_cases(&g, &c, &mut rng, &mut r);
        epilogue_q8_cases(&g, &c, &mut rng, &mut r);
        attention_q8_cases(&g, &c, &mut rng, &mut r);
        tiled_cases(&g, &c, &mut rng, &mut r);
        moe_cases(&g, &c, &mut rng, &mut r);
        recurrent_cases(&g, &c, &mut rng, &mut r);
        r.finish();
    }

    fn matmul_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        // (n_out, k): odd row counts; k of two K-quant blocks; float types also get k with a tail
        // that is not a multiple of the 8-value group.
        let mut tensors = Vec::new();
        let mut cases = Vec::new();
        for t in ALL_TYPES {
            let mut shapes = vec![(37usize, 512usize)];
            if t.block_elems() == 32 {
                shapes.push((19, 96));
            }
            if t.block_elems() == 1 {
                shapes.push((13, 67));
            }
            for (n_out, k) in shapes {
                let name = format!("{}_{n_out}x{k}", type_name(t));
                tensors.push((name.clone(), t, vec![n_out, k], rand_vec(rng, n_out * k, 1.0)));
                cases.push((name, t, n_out, k));
            }
        }
        let file = WeightFile::new("matmul", &tensors);
        for (name, t, n_out, k) in cases {
            let hw = file.get(&name);
            let cw = c.weight(&hw).expect("cpu weight");
            let gw = match g.weight(&hw) {
                Ok(w) => w,
                Err(e) => {
                    r.check(&format!("weight({}, {n_out}x{k})", type_name(t)), Err(e), &[], 0.0);
                    continue;
                }
            };
            for n in [1usize, 5, 9] {
                let x = tensor(rng, &[n, k], 1.0);
                let want = c.matmul(&x, &cw).expect("cpu matmul");
                let got = host(g, g.matmul(&up(g, &x), &gw));
                r.check(&format!("matmul({}, {n_out}x{k}, n={n})", type_name(t)), got, &want.data, DEFAULT_MAX_NMSE);
                // y0 + x · Wᵀ through the accumulate option (one token: the decode kernel).
                let y0 = tensor(rng, &[n, n_out], 1.0);
                let want_acc = c.add(&want, &y0).expect("cpu add");
                let gy = up(g, &y0);
                let got = g.matvec_accumulate_into(&up(g, &x), &gw, &gy).and_then(|()| g.to_host(&gy));
                let case = format!("matvec_accumulate_into({}, {n_out}x{k}, n={n})", type_name(t));
                r.check(&case, got, &want_acc.data, DEFAULT_MAX_NMSE);
                if n == 1 && k % 8 == 0 {
                    for shape in MatvecShape::TESTED {
                        let got = host(g, g.matvec_with_shape(&up(g, &x), &gw, shape));
                        let case = format!("matvec({}, {n_out}x{k}, {}x{})", type_name(t), shape.rows, shape.wg);
                        r.check(&case, got, &want.data, DEFAULT_MAX_NMSE);
                    }
                }
            }
            let ids: Vec<u32> = (0..7).map(|_| rng.random_range(0..n_out as u32)).collect();
            let want = c.get_rows(&cw, &ids).expect("cpu get_rows");
            let got = host(g, g.get_rows(&gw, &ids));
            r.check(
                &format!("get_rows({}, {n_out}x{k}, ids={})", type_name(t), ids.len()),
                got,
                &want.data,
                DEFAULT_MAX_NMSE,
            );
        }
    }

    fn elementwise_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let a = tensor(rng, &[7, 131], 3.0);
        let b = tensor(rng, &[7, 131], 3.0);
        let row = tensor(rng, &[131], 3.0);
        let (ga, gb, grow) = (up(g, &a), up(g, &b), up(g, &row));
        r.check("add([7, 131])", host(g, g.add(&ga, &gb)), &c.add(&a, &b).unwrap().data, DEFAULT_MAX_NMSE);
        r.check("add([7, 131], row)", host(g, g.add(&ga, &grow)), &c.add(&a, &row).unwrap().data, DEFAULT_MAX_NMSE);
        r.check("mul([7, 131])", host(g, g.mul(&ga, &gb)), &c.mul(&a, &b).unwrap().data, DEFAULT_MAX_NMSE);
        r.check("mul([7, 131], row)", host(g, g.mul(&ga, &grow)), &c.mul(&a, &row).unwrap().data, DEFAULT_MAX_NMSE);
        r.check(
            "scale([7, 131], 0.37)",
            host(g, g.scale(&ga, 0.37)),
            &c.scale(&a, 0.37).unwrap().data,
            DEFAULT_MAX_NMSE,
        );
        // Activations over a wide range (|x| up to 12) so the tails of tanh/erf/exp are exercised.
        let wide = tensor(rng, &[5, 203], 12.0);
        let gwide = up(g, &wide);
        for act in [Act::Silu, Act::Gelu, Act::GeluTanh, Act::Relu] {
            r.check(
                &format!("act({act:?}, [5, 203])"),
                host(g, g.act(&gwide, act)),
                &c.act(&wide, act).unwrap().data,
                DEFAULT_MAX_NMSE,
            );
        }
        for glu in [
            Glu::Plain(Act::Silu),
            Glu::Plain(Act::GeluTanh),
            Glu::Plain(Act::Gelu),
            Glu::SwiGluOai { alpha: 1.702, limit: 7.0 },
        ] {
            let gate = tensor(rng, &[5, 203], 10.0);
            let upv = tensor(rng, &[5, 203], 10.0);
            r.check(
                &format!("glu({glu:?}, [5, 203])"),
                host(g, g.glu(&up(g, &gate), &up(g, &upv), glu)),
                &c.glu(&gate, &upv, glu).unwrap().data,
                DEFAULT_MAX_NMSE,
            );
        }
        let logits = tensor(rng, &[6, 1000], 5.0);
        let want = c.argmax_rows(&logits).unwrap();
        r.exact("argmax_rows([6, 1000])", g.argmax_rows(&up(g, &logits)), &want);
    }

    fn norm_rope_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        for width in [64usize, 333, 2048] {
            let x = tensor(rng, &[3, width], 4.0);
            let w = tensor(rng, &[width], 1.0);
            let b = tensor(rng, &[width], 1.0);
            let (gx, gw, gb) = (up(g, &x), up(g, &w), up(g, &b));
            r.check(
                &format!("rms_norm([3, {width}], weight)"),
                host(g, g.rms_norm(&gx, Some(&gw), 1e-6)),
                &c.rms_norm(&x, Some(&w), 1e-6).unwrap().data,
                DEFAULT_MAX_NMSE,
            );
            r.check(
                &format!("rms_norm([3, {width}])"),
                host(g, g.rms_norm(&gx, None, 1e-5)),
                &c.rms_norm(&x, None, 1e-5).unwrap().data,
                DEFAULT_MAX_NMSE,
            );
            r.check(
                &format!("layer_norm([3, {width}], weight, bias)"),
                host(g, g.layer_norm(&gx, Some(&gw), Some(&gb), 1e-5)),
                &c.layer_norm(&x, Some(&w), Some(&b), 1e-5).unwrap().data,
                DEFAULT_MAX_NMSE,
            );
        }
        // Two norms in one op (a decode step's per-head q and k norms): the same bits as each
        // norm alone on this back end, and the CPU's values; 333 (not whole vec4) and a missing
        // weight take the two-norm fallback.
        for (width, rows_a, rows_b, weighted) in
            [(128usize, 32usize, 4usize, true), (64, 1, 7, true), (333, 3, 2, true), (128, 4, 2, false)]
        {
            let (xa, xb) = (tensor(rng, &[rows_a, width], 4.0), tensor(rng, &[rows_b, width], 4.0));
            let (wa, wb) = (tensor(rng, &[width], 1.0), tensor(rng, &[width], 1.0));
            let (gxa, gxb, gwa, gwb) = (up(g, &xa), up(g, &xb), up(g, &wa), up(g, &wb));
            let (ga, gb) = if weighted { (Some(&gwa), Some(&gwb)) } else { (None, None) };
            let (ya, yb) = g.rms_norm_pair(&gxa, ga, &gxb, gb, 1e-6).expect("rms_norm_pair");
            let (ya, yb) = (g.to_host(&ya).unwrap(), g.to_host(&yb).unwrap());
            let alone_a = g.to_host(&g.rms_norm(&gxa, ga, 1e-6).unwrap()).unwrap();
            let alone_b = g.to_host(&g.rms_norm(&gxb, gb, 1e-6).unwrap()).unwrap();
            let name = format!("rms_norm_pair([{rows_a}, {width}], [{rows_b}, {width}], weighted {weighted})");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            r.exact(&format!("{name}: first, as alone"), Ok(bits(&ya)), &bits(&alone_a));
            r.exact(&format!("{name}: second, as alone"), Ok(bits(&yb)), &bits(&alone_b));
            let (ca, cb) = if weighted { (Some(&wa), Some(&wb)) } else { (None, None) };
            r.check(&format!("{name}: first"), Ok(ya), &c.rms_norm(&xa, ca, 1e-6).unwrap().data, DEFAULT_MAX_NMSE);
            r.check(&format!("{name}: second"), Ok(yb), &c.rms_norm(&xb, cb, 1e-6).unwrap().data, DEFAULT_MAX_NMSE);
        }
        let yarn = Yarn {
            factor: 4.0,
            original_context: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: false,
            attn_factor: 1.1386,
        };
        let specs: Vec<(&str, RopeSpec)> = vec![
            ("norm", RopeSpec::new(64, 10000.0, false)),
            ("neox", RopeSpec::new(64, 1_000_000.0, true)),
            ("neox partial n_rot=32", RopeSpec { n_rot: 32, ..RopeSpec::new(80, 10000.0, true) }),
            (
                "norm freq_factors",
                RopeSpec {
                    freq_factors: Some((0..32).map(|i| 1.0 + i as f32 * 0.25).collect()),
                    ..RopeSpec::new(64, 500000.0, false)
                },
            ),
            ("neox yarn", RopeSpec { yarn: Some(yarn), ..RopeSpec::new(64, 150000.0, true) }),
            ("neox position_scale", RopeSpec { position_scale: 0.25, ..RopeSpec::new(64, 10000.0, true) }),
        ];
        for (name, spec) in specs {
            let n_heads = 3;
            let x = tensor(rng, &[4, n_heads * spec.head_dim], 2.0);
            let positions: Vec<u32> = vec![0, 17, 1023, 40000];
            r.check(
                &format!("rope({name}, heads={n_heads}, head_dim={}, pos up to 40000)", spec.head_dim),
                host(g, g.rope(&up(g, &x), &positions, &spec)),
                &c.rope(&x, &positions, &spec).unwrap().data,
                DEFAULT_MAX_NMSE,
            );
        }
    }

    /// Every norm kernel against the CPU: `norm.wgsl` and `norm_reg.wgsl` at several workgroup
    /// sizes, and `norm_split.wgsl` (one-row RMS norms: a workgroup per block), through subgroups
    /// (when the device has them) and through workgroup memory only (the fallback, run on every
    /// device); RMS and layer norm with weight (and bias); rows whose vec4 count is not a
    /// multiple of the workgroup (tails), several rows per call. Where the rows are
    /// whole 32-value blocks, the int8 blocks each kernel writes (block maxima and sums by
    /// subgroup shuffles or through workgroup memory) must equal bit for bit those `quantize_q8`
    /// makes from the kernel's own result, row by row.
    fn norm_kernel_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let g8 = g.clone().with_matmul_mode(MatmulMode::QuantizedActivations);
        let mut kernels = vec![NormKernel::Loop];
        for wg in [32u32, 64, 256, 1024] {
            kernels.push(NormKernel::Registers { wg, subgroups: false });
            if g.uses_subgroups() {
                kernels.push(NormKernel::Registers { wg, subgroups: true });
            }
        }
        kernels.push(NormKernel::Split { subgroups: false });
        if g.uses_subgroups() {
            kernels.push(NormKernel::Split { subgroups: true });
        }
        for (rows, width) in
            [(1usize, 4096usize), (3, 96), (2, 4128), (1, 8224), (2, 64), (3, 1028), (1, 96), (1, 2080)]
        {
            let x = tensor(rng, &[rows, width], 4.0);
            let w = tensor(rng, &[width], 1.0);
            let b = tensor(rng, &[width], 1.0);
            let (gx, gw, gb) = (up(g, &x), up(g, &w), up(g, &b));
            let q8 = width.is_multiple_of(32);
            for &kernel in &kernels {
                if let NormKernel::Registers { wg, .. } = kernel {
                    // norm_reg holds at most 16 vec4 per invocation.
                    if (width / 4).div_ceil(wg as usize) > 16 {
                        continue;
                    }
                }
                for layer in [false, true] {
                    if matches!(kernel, NormKernel::Split { .. }) && (layer || rows > 1 || !q8) {
                        // One-row RMS norms only; the refusal is checked below.
                        continue;
                    }
                    let op = if layer { "layer_norm" } else { "rms_norm" };
                    let case =
                        format!("{op}([{rows}, {width}], weight{}) {kernel:?}", if layer { ", bias" } else { "" });
                    let want = if layer {
                        c.layer_norm(&x, Some(&w), Some(&b), 1e-5).unwrap()
                    } else {
                        c.rms_norm(&x, Some(&w), 1e-6).unwrap()
                    };
                    let eps = if layer { 1e-5 } else { 1e-6 };
                    let got = g.norm_with_kernel(&gx, Some(&gw), layer.then_some(&gb), eps, layer, kernel, q8);
                    let (y, blocks) = match got {
                        Ok(t) => t,
                        Err(e) => {
                            r.check(&case, Err(e), &[], 0.0);
                            continue;
                        }
                    };
                    let y_host = match g.to_host(&y) {
                        Ok(v) => v,
                        Err(e) => {
                            r.check(&case, Err(e), &[], 0.0);
                            continue;
                        }
                    };
                    r.check(&case, Ok(y_host.clone()), &want.data, DEFAULT_MAX_NMSE);
                    let Some(blocks) = blocks else { continue };
                    // Each row's blocks from quantize_q8 of a fresh upload of the kernel's result.
                    let expected = (0..rows).try_fold((Vec::new(), Vec::new()), |(mut qs, mut ds), row| {
                        let yr = g8.from_host(&y_host[row * width..(row + 1) * width], &[1, width])?;
                        let q = g8.quantize_activations(&yr)?.expect("int8 activations on for one row of whole blocks");
                        let (q_row, d_row) = g8.q8_act_to_host(&q)?;
                        qs.extend(q_row);
                        ds.extend(d_row.iter().map(|d| d.to_bits()));
                        Ok::<_, compute::OpError>((qs, ds))
                    });
                    let got =
                        g.q8_act_to_host(&blocks).map(|(q, d)| (q, d.iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
                    let first_difference = |(a, b): (Vec<u32>, Vec<u32>), (c, d): &(Vec<u32>, Vec<u32>)| {
                        let bytes = a.iter().zip(c).position(|(x, y)| x != y).map(|i| format!("packed word {i}"));
                        let scales = b.iter().zip(d).position(|(x, y)| x != y).map(|i| format!("block {i} scale/sum"));
                        let sizes = (a.len() != c.len() || b.len() != d.len()).then(|| "sizes".to_string());
                        bytes.or(scales).or(sizes)
                    };
                    match expected {
                        Ok(expected) => r.exact(
                            &format!("{case} int8 blocks == quantize_q8 of its result (first difference)"),
                            got.map(|g| first_difference(g, &expected)),
                            &None,
                        ),
                        Err(e) => r.check(&format!("{case} quantize_q8 reference"), Err(e), &[], 0.0),
                    }
                }
            }
        }
        // norm_split refuses what it cannot take, with an error rather than a wrong result.
        let x = up(g, &tensor(rng, &[2, 64], 1.0));
        let refused = g.norm_with_kernel(&x, None, None, 1e-6, false, NormKernel::Split { subgroups: false }, false);
        r.exact("norm_split of two rows refused", Ok(refused.is_err()), &true);
    }

    fn shape_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let x = tensor(rng, &[9, 45], 1.0);
        let y = tensor(rng, &[9, 7], 1.0);
        let (gx, gy) = (up(g, &x), up(g, &y));
        r.check(
            "slice_rows([9, 45], 2..7)",
            host(g, g.slice_rows(&gx, 2, 5)),
            &c.slice_rows(&x, 2, 5).unwrap().data,
            DEFAULT_MAX_NMSE,
        );
        r.check(
            "slice_cols([9, 45], 13..35)",
            host(g, g.slice_cols(&gx, 13, 22)),
            &c.slice_cols(&x, 13, 22).unwrap().data,
            DEFAULT_MAX_NMSE,
        );
        r.check(
            "concat_cols([9, 45], [9, 7], [9, 45])",
            host(g, g.concat_cols(&[&gx, &gy, &gx])),
            &c.concat_cols(&[&x, &y, &x]).unwrap().data,
            DEFAULT_MAX_NMSE,
        );
        let reshaped = g.reshape(up(g, &x), &[45, 9]).map(|t| g.shape(&t).to_vec());
        r.exact("reshape([9, 45] -> [45, 9])", reshaped, &vec![45, 9]);
    }

    fn attention_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let specs: Vec<(&str, AttnSpec, bool)> = vec![
            (
                "gqa 4/2 hd 64",
                AttnSpec {
                    n_head: 4,
                    n_head_kv: 2,
                    head_dim_k: 64,
                    head_dim_v: 64,
                    scale: 0.125,
                    window: None,
                    softcap: None,
                },
                false,
            ),
            (
                "mha 3 hd 40",
                AttnSpec {
                    n_head: 3,
                    n_head_kv: 3,
                    head_dim_k: 40,
                    head_dim_v: 40,
                    scale: 0.158,
                    window: None,
                    softcap: None,
                },
                false,
            ),
            (
                "window 5 softcap 50",
                AttnSpec {
                    n_head: 4,
                    n_head_kv: 1,
                    head_dim_k: 32,
                    head_dim_v: 32,
                    scale: 0.18,
                    window: Some(5),
                    softcap: Some(50.0),
                },
                false,
            ),
            (
                "sinks hd_k 48 hd_v 24",
                AttnSpec {
                    n_head: 4,
                    n_head_kv: 2,
                    head_dim_k: 48,
                    head_dim_v: 24,
                    scale: 0.144,
                    window: None,
                    softcap: None,
                },
                true,
            ),
            (
                "hd 256 gqa 8/1",
                AttnSpec {
                    n_head: 8,
                    n_head_kv: 1,
                    head_dim_k: 256,
                    head_dim_v: 256,
                    scale: 0.0625,
                    window: None,
                    softcap: None,
                },
                false,
            ),
        ];
        for (name, spec, with_sinks) in specs {
            let n_ctx = 160;
            let kw = spec.n_head_kv * spec.head_dim_k;
            let vw = spec.n_head_kv * spec.head_dim_v;
            let mut cc = c.new_cache(n_ctx, kw, vw).unwrap();
            let mut gc = g.new_cache(n_ctx, kw, vw).unwrap();
            let sinks = tensor(rng, &[spec.n_head], 2.0);
            let gsinks = up(g, &sinks);
            // A prefill of 70 tokens (past one 64-key tile), then three single-token decode steps.
            let mut pos = 0;
            for n in [70usize, 1, 1, 1] {
                let q = tensor(rng, &[n, spec.n_head * spec.head_dim_k], 2.0);
                let k = tensor(rng, &[n, kw], 2.0);
                let v = tensor(rng, &[n, vw], 2.0);
                let want = c.attention(&q, &k, &v, &mut cc, pos, &spec, with_sinks.then_some(&sinks)).unwrap();
                let got =
                    g.attention(&up(g, &q), &up(g, &k), &up(g, &v), &mut gc, pos, &spec, with_sinks.then_some(&gsinks));
                r.check(&format!("attention({name}, pos0={pos}, n={n})"), host(g, got), &want.data, DEFAULT_MAX_NMSE);
                pos += n;
            }
        }
    }

    /// The decode attention kernel (`attention_decode.wgsl`) against the CPU: every variant on
    /// its own cache fed the same steps (its cache writes are read by its later steps), GQA ratios
    /// 1, 4 and 8, odd head dims, a sliding window crossing key slices, soft-cap, sinks, partial
    /// and neox rotation, NoPE, 1 to 4 tokens per step at contexts from 1 to past several slices
    /// of 16 and 64 keys (the combine pass), subgroup reductions and the workgroup-memory
    /// fallback; a 70-token prefill in between goes through `attention.wgsl` in every variant.
    fn attention_decode_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let shape = |s: &str| AttnDecodeShape::parse(s).expect("valid shape");
        let variants = [
            ("decode 128x64", AttnKernel::Decode { shape: shape("128x64"), subgroups: true }),
            ("decode 64x16u2r2", AttnKernel::Decode { shape: shape("64x16u2r2"), subgroups: true }),
            // The two shapes the model path takes by default (short and long contexts).
            ("decode 128x16r1", AttnKernel::Decode { shape: shape("128x16r1"), subgroups: true }),
            ("decode 128x32u1r1", AttnKernel::Decode { shape: shape("128x32u1r1"), subgroups: true }),
            ("decode 128x16 no subgroups", AttnKernel::Decode { shape: shape("128x16"), subgroups: false }),
        ];
        let spec = attn_spec;
        let cases: Vec<(&str, AttnSpec, Option<RopeSpec>, bool)> = vec![
            ("mha 3 hd 40, norm rope", spec(3, 3, 40, 40, None, None), Some(RopeSpec::new(40, 10000.0, false)), false),
            ("gqa 8/2 hd 64, neox rope", spec(8, 2, 64, 64, None, None), Some(RopeSpec::new(64, 1e6, true)), false),
            ("gqa 8/1 hd 32, window 37, softcap 30, NoPE", spec(8, 1, 32, 32, Some(37), Some(30.0)), None, false),
            (
                "gqa 4/2 hd 48/24, sinks, neox n_rot 32",
                spec(4, 2, 48, 24, None, None),
                Some(RopeSpec { n_rot: 32, ..RopeSpec::new(48, 10000.0, true) }),
                true,
            ),
            (
                "gqa 16/2 hd 128, norm rope",
                spec(16, 2, 128, 128, None, None),
                Some(RopeSpec::new(128, 5e5, false)),
                false,
            ),
        ];
        for (name, spec, rope, with_sinks) in cases {
            let n_ctx = 100;
            let (kw, vw) = (spec.n_head_kv * spec.head_dim_k, spec.n_head_kv * spec.head_dim_v);
            let mut cc = c.new_cache(n_ctx, kw, vw).unwrap();
            let mut gcs: Vec<_> = variants.iter().map(|_| g.new_cache(n_ctx, kw, vw).unwrap()).collect();
            let mut pos0 = 0;
            for n in [1usize, 2, 70, 1, 3, 4, 1] {
                let positions: Vec<u32> = (pos0 as u32..(pos0 + n) as u32).collect();
                let q = tensor(rng, &[n, spec.n_head * spec.head_dim_k], 2.0);
                let k = tensor(rng, &[n, kw], 2.0);
                let v = tensor(rng, &[n, vw], 2.0);
                let sinks = tensor(rng, &[spec.n_head], 2.0);
                let step = AttnStep {
                    q: &q,
                    k: &k,
                    v: &v,
                    pos0,
                    positions: &positions,
                    rope: rope.as_ref(),
                    spec: &spec,
                    sinks: with_sinks.then_some(&sinks),
                    qk_norm: None,
                };
                let want = c.rope_attention(&step, &mut cc).unwrap();
                let (gq, gk, gv, gsinks) = (up(g, &q), up(g, &k), up(g, &v), up(g, &sinks));
                let gstep = AttnStep {
                    q: &gq,
                    k: &gk,
                    v: &gv,
                    pos0,
                    positions: &positions,
                    rope: rope.as_ref(),
                    spec: &spec,
                    sinks: with_sinks.then_some(&gsinks),
                    qk_norm: None,
                };
                for ((label, kernel), gc) in variants.iter().zip(gcs.iter_mut()) {
                    // More tokens than a decode step: the prefill kernel, in every variant.
                    let kernel = if n > 4 { AttnKernel::Prefill } else { *kernel };
                    let got = host(g, g.rope_attention_with(&gstep, gc, kernel));
                    r.check(
                        &format!("attention {label} ({name}, pos0={pos0}, n={n})"),
                        got,
                        &want.data,
                        DEFAULT_MAX_NMSE,
                    );
                }
                pos0 += n;
            }
        }
    }

    /// The fused ops against the CPU's default composition of the plain ops.
    fn fused_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        // rope_attention: two layers per step with different rope specs at the same positions (the
        // step's cos/sin table is shared per spec, never across specs), a prefill past one key
        // tile, then single-token steps; norm and neox pairs, partial rotation, NoPE, sinks.
        let gqa = AttnSpec {
            n_head: 4,
            n_head_kv: 2,
            head_dim_k: 64,
            head_dim_v: 64,
            scale: 0.125,
            window: None,
            softcap: None,
        };
        let sinks_spec = AttnSpec {
            n_head: 4,
            n_head_kv: 2,
            head_dim_k: 48,
            head_dim_v: 24,
            scale: 0.144,
            window: Some(9),
            softcap: None,
        };
        let layers: Vec<(&str, AttnSpec, Option<RopeSpec>, bool)> = vec![
            ("norm rope, gqa 4/2 hd 64", gqa.clone(), Some(RopeSpec::new(64, 10000.0, false)), false),
            ("neox rope, gqa 4/2 hd 64", gqa.clone(), Some(RopeSpec::new(64, 1_000_000.0, true)), false),
            (
                "neox n_rot 32 of 48, window 9, sinks",
                sinks_spec,
                Some(RopeSpec { n_rot: 32, ..RopeSpec::new(48, 10000.0, true) }),
                true,
            ),
            ("NoPE, gqa 4/2 hd 64", gqa, None, false),
        ];
        for pair in layers.chunks(2) {
            let n_ctx = 100;
            let mut caches: Vec<_> = pair
                .iter()
                .map(|(_, spec, _, _)| {
                    let (kw, vw) = (spec.n_head_kv * spec.head_dim_k, spec.n_head_kv * spec.head_dim_v);
                    (c.new_cache(n_ctx, kw, vw).unwrap(), g.new_cache(n_ctx, kw, vw).unwrap())
                })
                .collect();
            let mut pos0 = 0;
            for n in [70usize, 1, 1, 5, 1] {
                let positions: Vec<u32> = (pos0 as u32..(pos0 + n) as u32).collect();
                for ((name, spec, rope, with_sinks), (cc, gc)) in pair.iter().zip(caches.iter_mut()) {
                    let q = tensor(rng, &[n, spec.n_head * spec.head_dim_k], 2.0);
                    let k = tensor(rng, &[n, spec.n_head_kv * spec.head_dim_k], 2.0);
                    let v = tensor(rng, &[n, spec.n_head_kv * spec.head_dim_v], 2.0);
                    let sinks = tensor(rng, &[spec.n_head], 2.0);
                    let (gq, gk, gv, gsinks) = (up(g, &q), up(g, &k), up(g, &v), up(g, &sinks));
                    let want = c
                        .rope_attention(
                            &AttnStep {
                                q: &q,
                                k: &k,
                                v: &v,
                                pos0,
                                positions: &positions,
                                rope: rope.as_ref(),
                                spec,
                                sinks: with_sinks.then_some(&sinks),
                                qk_norm: None,
                            },
                            cc,
                        )
                        .unwrap();
                    let step = AttnStep {
                        q: &gq,
                        k: &gk,
                        v: &gv,
                        pos0,
                        positions: &positions,
                        rope: rope.as_ref(),
                        spec,
                        sinks: with_sinks.then_some(&gsinks),
                        qk_norm: None,
                    };
                    let got = host(g, g.rope_attention(&step, gc));
                    r.check(&format!("rope_attention({name}, pos0={pos0}, n={n})"), got, &want.data, DEFAULT_MAX_NMSE);
                }
                pos0 += n;
            }
        }
        // A step past the cache is refused, not written out of bounds.
        let spec =
            AttnSpec { n_head: 2, n_head_kv: 1, head_dim_k: 8, head_dim_v: 8, scale: 0.3, window: None, softcap: None };
        let mut gc = g.new_cache(4, 8, 8).unwrap();
        let (q, kv) = (up(g, &tensor(rng, &[2, 16], 1.0)), up(g, &tensor(rng, &[2, 8], 1.0)));
        let rope = RopeSpec::new(8, 10000.0, false);
        let step = AttnStep {
            q: &q,
            k: &kv,
            v: &kv,
            pos0: 3,
            positions: &[3, 4],
            rope: Some(&rope),
            spec: &spec,
            sinks: None,
            qk_norm: None,
        };
        let refused = matches!(g.rope_attention(&step, &mut gc), Err(compute::OpError::ContextFull { .. }));
        r.exact("rope_attention(past the cache) refused", Ok(refused), &true);

        // matmul_add: the residual added by the product's kernel, one token (decode kernel) and
        // several (general kernel), a k that is not a multiple of 8.
        let shapes = [(GgmlType::Q4_0, 37usize, 512usize), (GgmlType::Q6_K, 19, 256), (GgmlType::F16, 13, 67)];
        let tensors: Vec<_> = shapes
            .iter()
            .map(|&(t, n_out, k)| (format!("add_{}", type_name(t)), t, vec![n_out, k], rand_vec(rng, n_out * k, 1.0)))
            .collect();
        let file = WeightFile::new("matmul_add", &tensors);
        for (t, n_out, k) in shapes {
            let hw = file.get(&format!("add_{}", type_name(t)));
            let (cw, gw) = (c.weight(&hw).unwrap(), g.weight(&hw).unwrap());
            for n in [1usize, 5] {
                let x = tensor(rng, &[n, k], 1.0);
                let residual = tensor(rng, &[n, n_out], 3.0);
                let want = c.matmul_add(&x, &cw, residual.clone()).unwrap();
                let got = host(g, g.matmul_add(&up(g, &x), &gw, up(g, &residual)));
                r.check(
                    &format!("matmul_add({}, {n_out}x{k}, n={n})", type_name(t)),
                    got,
                    &want.data,
                    DEFAULT_MAX_NMSE,
                );
            }
            let wrong = up(g, &tensor(rng, &[1, n_out + 1], 1.0));
            let refused = g.matmul_add(&up(g, &tensor(rng, &[1, k], 1.0)), &gw, wrong).is_err();
            r.exact(&format!("matmul_add({}, residual of the wrong width) refused", type_name(t)), Ok(refused), &true);
        }

        // matmul_many in QuantizedActivations mode: one quantization for the products the int8
        // kernel takes (Q4_0, Q6_K), the f32 kernel for the one it does not (F16); several
        // tokens take the exact kernels.
        let g8 = g.clone().with_matmul_mode(MatmulMode::QuantizedActivations);
        let int8 = g8.uses_int8_activations();
        let shapes = [(GgmlType::Q4_0, 37usize), (GgmlType::Q6_K, 19), (GgmlType::F16, 13)];
        let k = 512;
        let tensors: Vec<_> = shapes
            .iter()
            .map(|&(t, n_out)| (format!("many_{}", type_name(t)), t, vec![n_out, k], rand_vec(rng, n_out * k, 1.0)))
            .collect();
        let file = WeightFile::new("matmul_many", &tensors);
        let ws: Vec<_> = shapes
            .iter()
            .map(|&(t, _)| {
                let hw = file.get(&format!("many_{}", type_name(t)));
                (t, c.weight(&hw).unwrap(), g.weight(&hw).unwrap())
            })
            .collect();
        for n in [1usize, 3] {
            let x = tensor(rng, &[n, k], 1.0);
            let ys = match g8.matmul_many(&up(g, &x), [&ws[0].2, &ws[1].2, &ws[2].2]) {
                Ok(ys) => ys,
                Err(e) => {
                    r.check(&format!("matmul_many int8 mode(n={n})"), Err(e), &[], 0.0);
                    continue;
                }
            };
            for ((t, cw, _), y) in ws.iter().zip(&ys) {
                let got = g.to_host(y);
                let takes_int8 = int8 && n == 1 && *t != GgmlType::F16;
                let (xs, bound) =
                    if takes_int8 { (q8_rounded(&x), INT8_ROUNDED_MAX_NMSE) } else { (x.clone(), DEFAULT_MAX_NMSE) };
                let want = c.matmul(&xs, cw).unwrap();
                let case = format!("matmul_many int8 mode({}, n={n}, int8 kernel: {takes_int8})", type_name(*t));
                r.check(&case, got, &want.data, bound);
            }
        }
    }

    fn moe_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let route_specs: Vec<(&str, RouteSpec, bool)> = vec![
            (
                "softmax k=2 norm",
                RouteSpec {
                    k: 2,
                    gating: Gating::Softmax,
                    has_selection_bias: false,
                    groups: None,
                    normalize: true,
                    scale: 1.0,
                },
                false,
            ),
            (
                "softmax_after_topk k=4",
                RouteSpec {
                    k: 4,
                    gating: Gating::SoftmaxAfterTopK,
                    has_selection_bias: false,
                    groups: None,
                    normalize: false,
                    scale: 1.0,
                },
                false,
            ),
            (
                "sigmoid bias groups 4/2 k=3 scale 2.5",
                RouteSpec {
                    k: 3,
                    gating: Gating::Sigmoid,
                    has_selection_bias: true,
                    groups: Some((4, 2)),
                    normalize: true,
                    scale: 2.5,
                },
                true,
            ),
        ];
        for (name, spec, with_bias) in route_specs {
            let logits = tensor(rng, &[5, 16], 3.0);
            let bias = tensor(rng, &[16], 0.5);
            let want = c.route(&logits, with_bias.then_some(&bias), &spec).unwrap();
            let gbias = up(g, &bias);
            match g.route(&up(g, &logits), with_bias.then_some(&gbias), &spec) {
                Ok(got) => {
                    r.exact(&format!("route({name}) ids"), Ok(got.ids.clone()), &want.ids);
                    r.check(
                        &format!("route({name}) weights"),
                        g.to_host(&got.weights),
                        &want.weights.data,
                        DEFAULT_MAX_NMSE,
                    );
                }
                Err(e) => r.check(&format!("route({name})"), Err(e), &[], 0.0),
            }
        }

        // Expert FFNs: ids distinct per token, every expert used over the batch, repeats across
        // tokens (what real top-k produces), on two weight types, with and without biases.
        let (n_expert, n_ff, n_embd, k, n_tok) = (8usize, 256usize, 256usize, 2usize, 5usize);
        for (t, glu, biases) in [
            (GgmlType::Q4_K, Glu::Plain(Act::Silu), false),
            (GgmlType::Q8_0, Glu::SwiGluOai { alpha: 1.702, limit: 7.0 }, true),
        ] {
            let tname = type_name(t);
            let tensors = vec![
                (
                    format!("gate_{tname}"),
                    t,
                    vec![n_expert, n_ff, n_embd],
                    rand_vec(rng, n_expert * n_ff * n_embd, 1.0),
                ),
                (format!("up_{tname}"), t, vec![n_expert, n_ff, n_embd], rand_vec(rng, n_expert * n_ff * n_embd, 1.0)),
                (
                    format!("down_{tname}"),
                    t,
                    vec![n_expert, n_embd, n_ff],
                    rand_vec(rng, n_expert * n_embd * n_ff, 1.0),
                ),
            ];
            let file = WeightFile::new(&format!("backend-ops-moe-{tname}"), &tensors);
            let (hg, hu, hd) = (
                file.get(&format!("gate_{tname}")),
                file.get(&format!("up_{tname}")),
                file.get(&format!("down_{tname}")),
            );
            let gb = tensor(rng, &[n_expert, n_ff], 0.5);
            let ub = tensor(rng, &[n_expert, n_ff], 0.5);
            let db = tensor(rng, &[n_expert, n_embd], 0.5);
            let mut ids = Vec::new();
            let mut order: Vec<u32> = (0..n_expert as u32).collect();
            for tok in 0..n_tok {
                order.rotate_left(3);
                let first = order[tok % n_expert];
                let second = order[(tok + 1 + tok % 3) % n_expert];
                ids.extend([first, if second == first { (first + 1) % n_expert as u32 } else { second }]);
            }
            for e in 0..n_expert as u32 {
                if !ids.contains(&e) {
                    ids[(e as usize * 3) % (n_tok * k)] = e;
                }
            }
            // Re-establish distinct ids per token after the coverage patch.
            for tok in 0..n_tok {
                if ids[tok * k] == ids[tok * k + 1] {
                    ids[tok * k + 1] = (ids[tok * k] + 1) % n_expert as u32;
                }
            }
            let weights = tensor(rng, &[n_tok, k], 1.0);
            let x = tensor(rng, &[n_tok, n_embd], 1.0);
            let spec = MoeSpec { n_expert, n_ff, glu };
            let cexp = Experts::<CpuBackend> {
                layer: 0,
                gate: Some(c.weight(&hg).unwrap()),
                up: c.weight(&hu).unwrap(),
                down: c.weight(&hd).unwrap(),
                gate_bias: biases.then(|| gb.clone()),
                up_bias: biases.then(|| ub.clone()),
                down_bias: biases.then(|| db.clone()),
            };
            let crouting = compute::Routing::<CpuBackend> { ids: ids.clone(), weights: weights.clone(), k };
            let want = c.moe_ffn(&x, &crouting, &cexp, &spec).unwrap();
            let gexp = (|| -> Result<Experts<WgpuBackend>, compute::OpError> {
                Ok(Experts {
                    layer: 0,
                    gate: Some(g.weight(&hg)?),
                    up: g.weight(&hu)?,
                    down: g.weight(&hd)?,
                    gate_bias: biases.then(|| up(g, &gb)),
                    up_bias: biases.then(|| up(g, &ub)),
                    down_bias: biases.then(|| up(g, &db)),
                })
            })();
            let case = format!("moe_ffn({tname}, experts={n_expert}, k={k}, tokens={n_tok}, {glu:?}, biases={biases})");
            let got = gexp.and_then(|e| {
                let routing = compute::Routing::<WgpuBackend> { ids: ids.clone(), weights: up(g, &weights), k };
                host(g, g.moe_ffn(&up(g, &x), &routing, &e, &spec))
            });
            r.check(&case, got, &want.data, DEFAULT_MAX_NMSE);
        }
    }

    fn recurrent_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        // Convolution state carried over a prefill then two decode steps; the state must match too.
        let (channels, k) = (37usize, 4usize);
        let weight = tensor(rng, &[channels, k], 1.0);
        let gweight = up(g, &weight);
        let mut cstate = tensor(rng, &[k - 1, channels], 1.0);
        let mut gstate = up(g, &cstate);
        for n in [5usize, 1, 1] {
            let x = tensor(rng, &[n, channels], 1.0);
            let want = c.ssm_conv(&x, &mut cstate, &weight).unwrap();
            let got = host(g, g.ssm_conv(&up(g, &x), &mut gstate, &gweight));
            r.check(&format!("ssm_conv(channels={channels}, k={k}, n={n})"), got, &want.data, DEFAULT_MAX_NMSE);
            r.check(
                &format!("ssm_conv state(channels={channels}, k={k}, n={n})"),
                g.to_host(&gstate),
                &cstate.data,
                DEFAULT_MAX_NMSE,
            );
        }
        let (n_head, head_dim, d_state, n_group) = (4usize, 8usize, 16usize, 2usize);
        let a = CpuTensor {
            shape: vec![n_head],
            data: rand_vec(rng, n_head, 1.0).iter().map(|v| -(v.abs() + 0.1)).collect(),
        };
        let d = tensor(rng, &[n_head], 1.0);
        let dt_bias = tensor(rng, &[n_head], 1.0);
        let (ga, gd, gbias) = (up(g, &a), up(g, &d), up(g, &dt_bias));
        let mut cstate = tensor(rng, &[n_head, head_dim, d_state], 0.5);
        let mut gstate = up(g, &cstate);
        for n in [6usize, 1, 1] {
            let x = tensor(rng, &[n, n_head * head_dim], 1.0);
            let dt = tensor(rng, &[n, n_head], 2.0);
            let b = tensor(rng, &[n, n_group * d_state], 1.0);
            let cm = tensor(rng, &[n, n_group * d_state], 1.0);
            let inputs = compute::SsmScan::<CpuBackend> {
                x: &x,
                dt: &dt,
                b: &b,
                c: &cm,
                a: &a,
                d: Some(&d),
                dt_bias: Some(&dt_bias),
                n_group,
            };
            let want = c.ssm_scan(&inputs, &mut cstate).unwrap();
            let (gx, gdt, gb, gc) = (up(g, &x), up(g, &dt), up(g, &b), up(g, &cm));
            let ginputs = compute::SsmScan::<WgpuBackend> {
                x: &gx,
                dt: &gdt,
                b: &gb,
                c: &gc,
                a: &ga,
                d: Some(&gd),
                dt_bias: Some(&gbias),
                n_group,
            };
            let got = host(g, g.ssm_scan(&ginputs, &mut gstate));
            let case =
                format!("ssm_scan(heads={n_head}, head_dim={head_dim}, d_state={d_state}, groups={n_group}, n={n})");
            r.check(&case, got, &want.data, DEFAULT_MAX_NMSE);
            r.check(&format!("{case} state"), g.to_host(&gstate), &cstate.data, DEFAULT_MAX_NMSE);
        }
        // Per-head products (DeepSeek MLA's absorbed projections).
        let (heads, n_out, kk) = (3usize, 16usize, 64usize);
        let file = WeightFile::new(
            "per-head",
            &[("per_head".into(), GgmlType::Q8_0, vec![heads, n_out, kk], rand_vec(rng, heads * n_out * kk, 1.0))],
        );
        let hw = file.get("per_head");
        let x = tensor(rng, &[5, heads * kk], 1.0);
        let want = c.matmul_per_head(&x, &c.weight(&hw).unwrap()).unwrap();
        let got = g.weight(&hw).and_then(|w| host(g, g.matmul_per_head(&up(g, &x), &w)));
        r.check(&format!("matmul_per_head(q8_0, heads={heads}, {n_out}x{kk}, n=5)"), got, &want.data, DEFAULT_MAX_NMSE);
    }

    /// Bound for products with int8 activations against the exact product: llama.cpp's own for its
    /// quantized-activation matrix products (test-backend-ops, `test_mul_mat::max_nmse_err`,
    /// 5e-4). Rounding 32 values to 127 steps of max|x| gives a relative error near 1e-5 in
    /// normalised MSE on these uniform activations, so a wrong block, scale or offset (errors of
    /// order 1) cannot pass.
    const INT8_MAX_NMSE: f64 = 5e-4;

    /// Bound against the CPU product of the activations rounded as the GPU rounds them: f32
    /// summation noise (1e-7, the default) plus one value that rounds the other way at a tie of
    /// round(x / d), which moves the result by about 4e-7 here.
    const INT8_ROUNDED_MAX_NMSE: f64 = 1e-6;

    /// Bound for a product of activations the GPU computed itself (its f32 rounding differs
    /// from the CPU reference's, so more values than one may round to the other int8 step).
    const X_CHANGED_MAX_NMSE: f64 = 1e-4;

    /// The activations as the int8 kernels see them: per 32 values d = max|x| / 127,
    /// q = round(x * (1 / d)) to even (WGSL's `round`), value q * d (llama.cpp's quantize_row_q8_0
    /// scheme).
    fn q8_rounded(x: &CpuTensor) -> CpuTensor {
        let mut data = x.data.clone();
        for b in data.chunks_mut(32) {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for v in b.iter_mut() {
                *v = (*v * inv).round_ties_even() * d;
            }
        }
        CpuTensor { shape: x.shape.clone(), data }
    }

    /// The int8-activation decode kernel (`matvec_q8`) of every type it covers: odd row counts,
    /// k of one 32-value block past a multiple of 64 for the 32-value types (not a multiple of
    /// 256), every tested workgroup shape, the automatic path of a back end in
    /// `QuantizedActivations` mode with and without accumulation, one quantization shared by two
    /// products into column offsets of one output, and per-head products (row spans of a stacked
    /// weight against column offsets of the activations).
    fn int8_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let g8 = g.clone().with_matmul_mode(MatmulMode::QuantizedActivations);
        println!("int8 activations in QuantizedActivations mode: {}", g8.uses_int8_activations());
        // With DISKFORMER_GPU_F32_ACT=1 the automatic path stays exact.
        let auto_bound = if g8.uses_int8_activations() { INT8_ROUNDED_MAX_NMSE } else { DEFAULT_MAX_NMSE };
        let types = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ];
        let mut tensors = Vec::new();
        let mut cases = Vec::new();
        for t in types {
            let mut shapes = vec![(37usize, 512usize), (1, 256)];
            if t.block_elems() == 32 {
                shapes.push((19, 96));
                shapes.push((33, 160));
            }
            for (n_out, k) in shapes {
                let name = format!("i8_{}_{n_out}x{k}", type_name(t));
                tensors.push((name.clone(), t, vec![n_out, k], rand_vec(rng, n_out * k, 1.0)));
                cases.push((name, t, n_out, k));
            }
        }
        let file = WeightFile::new("int8", &tensors);
        for (name, t, n_out, k) in cases {
            let hw = file.get(&name);
            let cw = c.weight(&hw).expect("cpu weight");
            let gw = match g.weight(&hw) {
                Ok(w) => w,
                Err(e) => {
                    r.check(&format!("weight({}, {n_out}x{k})", type_name(t)), Err(e), &[], 0.0);
                    continue;
                }
            };
            let tn = type_name(t);
            let x = tensor(rng, &[1, k], 1.0);
            let exact = c.matmul(&x, &cw).expect("cpu matmul");
            let rounded = c.matmul(&q8_rounded(&x), &cw).expect("cpu matmul");
            for shape in MatvecShape::TESTED {
                let got = host(g, g.matvec_q8_with_shape(&up(g, &x), &gw, shape));
                let case = format!("matvec_q8({tn}, {n_out}x{k}, {}x{})", shape.rows, shape.wg);
                match got {
                    Ok(v) => {
                        // Over one row the normalised MSE is one value's squared relative error,
                        // unbounded when the exact value is near 0: the rounded check covers it.
                        if n_out > 1 {
                            r.check(&format!("{case} vs exact"), Ok(v.clone()), &exact.data, INT8_MAX_NMSE);
                        }
                        r.check(&format!("{case} vs rounded x"), Ok(v), &rounded.data, INT8_ROUNDED_MAX_NMSE);
                    }
                    Err(e) => r.check(&case, Err(e), &[], 0.0),
                }
            }
            let gx = up(g, &x);
            let want = if g8.uses_int8_activations() { &rounded } else { &exact };
            r.check(
                &format!("matmul int8 mode({tn}, {n_out}x{k})"),
                host(g, g8.matmul(&gx, &gw)),
                &want.data,
                auto_bound,
            );
            let y0 = tensor(rng, &[1, n_out], 1.0);
            let want_acc = c.add(want, &y0).expect("cpu add");
            let gy = up(g, &y0);
            let got = g8.matvec_accumulate_into(&gx, &gw, &gy).and_then(|()| g.to_host(&gy));
            r.check(&format!("matvec_accumulate_into int8 mode({tn}, {n_out}x{k})"), got, &want_acc.data, auto_bound);
            // One quantization, two products side by side in one output (the fused q/k/v shape).
            let both = g.from_host(&vec![0f32; 2 * n_out], &[1, 2 * n_out]).expect("upload");
            let got = g8.quantize_activations(&gx).and_then(|xq| {
                g8.matvec_q8_into(&gx, xq.as_ref(), &gw, &both, 0, false)?;
                g8.matvec_q8_into(&gx, xq.as_ref(), &gw, &both, n_out, false)?;
                g.to_host(&both)
            });
            let want_both = [want.data.as_slice(), want.data.as_slice()].concat();
            r.check(&format!("matvec_q8_into x2 int8 mode({tn}, {n_out}x{k})"), got, &want_both, auto_bound);
        }
        // The automatic path reuses the last quantization of the same activations (q, k, v) while
        // nothing was submitted in between: three products of one x, then x changed in place
        // (accumulated into), then x dropped and its pooled buffer handed to new activations, all
        // recorded before one readback. Each product must see the values of its moment.
        if g8.uses_int8_activations() {
            let (n_out, k) = (37usize, 256usize);
            let file = WeightFile::new(
                "int8-reuse",
                &[
                    ("w".into(), GgmlType::Q4_0, vec![n_out, k], rand_vec(rng, n_out * k, 1.0)),
                    ("into_x".into(), GgmlType::F32, vec![k, 32], rand_vec(rng, k * 32, 1.0)),
                ],
            );
            let (hw, hf) = (file.get("w"), file.get("into_x"));
            let (cw, cf) = (c.weight(&hw).expect("cpu weight"), c.weight(&hf).expect("cpu weight"));
            let (gw, gf) = (g.weight(&hw).expect("gpu weight"), g.weight(&hf).expect("gpu weight"));
            let x = tensor(rng, &[1, k], 1.0);
            let z = tensor(rng, &[1, 32], 1.0);
            let x2 = c.add(&x, &c.matmul(&z, &cf).expect("cpu matmul")).expect("cpu add");
            let x3 = tensor(rng, &[1, k], 1.0);
            let gz = up(g, &z);
            let gx = up(g, &x);
            let recorded = (|| {
                let mut ys = Vec::new();
                for _ in 0..3 {
                    ys.push(g8.matmul(&gx, &gw)?);
                }
                g.matvec_accumulate_into(&gz, &gf, &gx)?;
                ys.push(g8.matmul(&gx, &gw)?);
                drop(gx);
                let gx3 = up(g, &x3);
                ys.push(g8.matmul(&gx3, &gw)?);
                Ok::<_, compute::OpError>(ys)
            })();
            let wants = [&x, &x, &x, &x2, &x3].map(|x| c.matmul(&q8_rounded(x), &cw).expect("cpu matmul"));
            let names =
                ["product 0", "product 1", "product 2", "x changed in place", "buffer handed to new activations"];
            match recorded {
                Ok(ys) => {
                    for (i, ((y, want), name)) in ys.iter().zip(&wants).zip(names).enumerate() {
                        let case = format!("int8 quantization reused, {name}");
                        // x changed in place: the GPU's x + z F differs from the CPU's by f32
                        // summation order, so several of its 256 values may round to the other
                        // int8 step (one such run measured 1.3e-6). A stale quantization (x's
                        // instead of x + z F, where z F is ~10x larger) is off by order 1.
                        let bound = if i == 3 { X_CHANGED_MAX_NMSE } else { INT8_ROUNDED_MAX_NMSE };
                        r.check(&case, g.to_host(y), &want.data, bound);
                    }
                }
                Err(e) => r.check("int8 quantization reused", Err(e), &[], 0.0),
            }
        }
        // Row spans and column offsets: head h reads columns h*kk.. of x and rows h*n_out.. of w.
        for t in [GgmlType::Q8_0, GgmlType::Q4_0] {
            let (heads, n_out, kk) = (3usize, 17usize, 64usize);
            let name = format!("i8_per_head_{}", type_name(t));
            let file = WeightFile::new(
                &name,
                &[(name.clone(), t, vec![heads, n_out, kk], rand_vec(rng, heads * n_out * kk, 1.0))],
            );
            let hw = file.get(&name);
            let cw = c.weight(&hw).expect("cpu weight");
            let x = tensor(rng, &[1, heads * kk], 1.0);
            let want = c.matmul_per_head(&q8_rounded(&x), &cw).expect("cpu matmul_per_head");
            let want = if g8.uses_int8_activations() { want } else { c.matmul_per_head(&x, &cw).expect("cpu") };
            let got = g8.weight(&hw).and_then(|w| host(g, g8.matmul_per_head(&up(g, &x), &w)));
            let case = format!("matmul_per_head int8 mode({}, heads={heads}, {n_out}x{kk})", type_name(t));
            r.check(&case, got, &want.data, auto_bound);
        }
    }

    /// Norms that write their int8 blocks in their epilogue (decode, int8 activations on): the
    /// norm's values against the CPU; the products of its result (a single product, q/k/v-style
    /// `matmul_many`, an accumulating one) bit-identical to the same products of a fresh upload of
    /// those values (which quantizes them with `quantize_q8`), and within the int8 bound of the
    /// CPU product of the rounded values; and a norm result accumulated into (`matmul_add`) no
    /// longer served from its stale blocks. Widths: 3 blocks, 9, and 257 (more blocks than the
    /// norm's 256 invocations).
    fn epilogue_q8_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let g8 = g.clone().with_matmul_mode(MatmulMode::QuantizedActivations);
        let int8 = g8.uses_int8_activations();
        let bound = if int8 { INT8_ROUNDED_MAX_NMSE } else { DEFAULT_MAX_NMSE };
        let round = |x: &CpuTensor| if int8 { q8_rounded(x) } else { x.clone() };
        for k in [96usize, 288, 8224] {
            let n_out = 5usize;
            let tensors = vec![
                ("a".to_string(), GgmlType::Q4_0, vec![n_out, k], rand_vec(rng, n_out * k, 1.0)),
                ("b".to_string(), GgmlType::Q8_0, vec![n_out + 2, k], rand_vec(rng, (n_out + 2) * k, 1.0)),
                ("sq".to_string(), GgmlType::Q8_0, vec![k, 64], rand_vec(rng, k * 64, 1.0)),
            ];
            let file = WeightFile::new(&format!("backend-ops-epilogue-q8-{k}"), &tensors);
            let (ha, hb, hsq) = (file.get("a"), file.get("b"), file.get("sq"));
            let (ca, cb, csq) = (c.weight(&ha).unwrap(), c.weight(&hb).unwrap(), c.weight(&hsq).unwrap());
            let (ga, gb, gsq) = match (g.weight(&ha), g.weight(&hb), g.weight(&hsq)) {
                (Ok(a), Ok(b), Ok(sq)) => (a, b, sq),
                (a, b, sq) => {
                    let e = [a.err(), b.err(), sq.err()].into_iter().flatten().next().expect("one failed");
                    r.check(&format!("epilogue q8 weights (k={k})"), Err(e), &[], 0.0);
                    continue;
                }
            };
            let x = tensor(rng, &[1, k], 1.0);
            let nw = tensor(rng, &[k], 1.0);
            let nb = tensor(rng, &[k], 0.5);
            let gnw = up(g, &nw);
            let gnb = up(g, &nb);
            for layer in [false, true] {
                let op = if layer { "layer_norm" } else { "rms_norm" };
                let want_y = if layer {
                    c.layer_norm(&x, Some(&nw), Some(&nb), 1e-5).unwrap()
                } else {
                    c.rms_norm(&x, Some(&nw), 1e-5).unwrap()
                };
                let gy = if layer {
                    g8.layer_norm(&up(g, &x), Some(&gnw), Some(&gnb), 1e-5)
                } else {
                    g8.rms_norm(&up(g, &x), Some(&gnw), 1e-5)
                };
                let gy = match gy {
                    Ok(t) => t,
                    Err(e) => {
                        r.check(&format!("{op} with int8 epilogue (k={k})"), Err(e), &[], 0.0);
                        continue;
                    }
                };
                let y_host = g.to_host(&gy).expect("readback");
                r.check(
                    &format!("{op} with int8 epilogue (k={k})"),
                    Ok(y_host.clone()),
                    &want_y.data,
                    DEFAULT_MAX_NMSE,
                );
                let fresh = up(g, &CpuTensor { shape: vec![1, k], data: y_host.clone() });
                let y_rounded = round(&CpuTensor { shape: vec![1, k], data: y_host.clone() });
                // One product.
                let got = host(g, g8.matmul(&gy, &ga));
                let same = host(g, g8.matmul(&fresh, &ga));
                r.exact(
                    &format!("{op} int8 epilogue -> matmul(q4_0) == fresh quantization (k={k})"),
                    host(g, g8.matmul(&gy, &ga)),
                    &same.unwrap_or_default(),
                );
                r.check(
                    &format!("{op} int8 epilogue -> matmul(q4_0) vs cpu (k={k})"),
                    got,
                    &c.matmul(&y_rounded, &ca).unwrap().data,
                    bound,
                );
                // Two products of one input (q/k/v).
                let got =
                    g8.matmul_many(&gy, [&ga, &gb]).and_then(|[p, q]| Ok([g.to_host(&p)?, g.to_host(&q)?].concat()));
                let same =
                    g8.matmul_many(&fresh, [&ga, &gb]).and_then(|[p, q]| Ok([g.to_host(&p)?, g.to_host(&q)?].concat()));
                let (pa, pb) = (c.matmul(&y_rounded, &ca).unwrap(), c.matmul(&y_rounded, &cb).unwrap());
                let want = [pa.data.as_slice(), pb.data.as_slice()].concat();
                if let Ok(v) = &got {
                    let case = format!("{op} int8 epilogue -> matmul_many(q4_0, q8_0) vs cpu (k={k})");
                    r.check(&case, Ok(v.clone()), &want, bound);
                }
                r.exact(
                    &format!("{op} int8 epilogue -> matmul_many(q4_0, q8_0) == fresh quantization (k={k})"),
                    got,
                    &same.unwrap_or_default(),
                );
                // Accumulating product (the residual connection).
                let res = tensor(rng, &[1, n_out], 1.0);
                let got = host(g, g8.matmul_add(&gy, &ga, up(g, &res)));
                let want = c.add(&res, &c.matmul(&y_rounded, &ca).unwrap()).unwrap();
                r.check(&format!("{op} int8 epilogue -> matmul_add(q4_0) vs cpu (k={k})"), got, &want.data, bound);
                // The norm's result accumulated into: its blocks are stale and must not be used.
                let z = tensor(rng, &[1, 64], 1.0);
                let changed = g8.matmul_add(&up(g, &z), &gsq, gy).and_then(|t| host(g, g8.matmul(&t, &ga)));
                let y2 = c
                    .add(&CpuTensor { shape: vec![1, k], data: y_host }, &c.matmul(&round(&z), &csq).unwrap())
                    .unwrap();
                let want = c.matmul(&round(&y2), &ca).unwrap();
                r.check(
                    &format!("{op} int8 epilogue, result accumulated into, then matmul (k={k})"),
                    changed,
                    &want.data,
                    bound,
                );
            }
        }
    }

    /// The attention kernel writing its output's int8 blocks (decode, int8 activations on, head
    /// size a multiple of 32), read by the output projection: bit-identical to the product of a
    /// fresh upload of the attention's values, within the int8 bound of the CPU; and a head size
    /// of 24 (blocks would straddle heads: no epilogue) checked the same way. The model path's
    /// kernel and the decode kernel split into slices of 16 keys (its combine pass writes the
    /// blocks) each run on their own cache; steps of more than 4 tokens take the prefill kernel.
    fn attention_q8_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let g8 = g.clone().with_matmul_mode(MatmulMode::QuantizedActivations);
        // One token's product takes int8 activations (the rounded values), several the exact ones.
        let int8 = g8.uses_int8_activations();
        let split = AttnKernel::Decode { shape: AttnDecodeShape::parse("64x16").expect("valid"), subgroups: true };
        for (hd, neox) in [(64usize, false), (24, true)] {
            let spec = AttnSpec {
                n_head: 4,
                n_head_kv: 2,
                head_dim_k: hd,
                head_dim_v: hd,
                scale: 0.125,
                window: None,
                softcap: None,
            };
            let (qw, kw) = (spec.n_head * hd, spec.n_head_kv * hd);
            let name = format!("o_{hd}");
            let file =
                WeightFile::new(&name, &[(name.clone(), GgmlType::Q8_0, vec![19, qw], rand_vec(rng, 19 * qw, 1.0))]);
            let hw = file.get(&name);
            let (cw, gw) = (c.weight(&hw).unwrap(), g.weight(&hw).unwrap());
            let rope = RopeSpec::new(hd, 10000.0, neox);
            let n_ctx = 48;
            let mut cc = c.new_cache(n_ctx, kw, kw).unwrap();
            let mut gcs = [g.new_cache(n_ctx, kw, kw).unwrap(), g.new_cache(n_ctx, kw, kw).unwrap()];
            for (pos0, n) in [(0usize, 3usize), (3, 1), (4, 1), (5, 30), (35, 1), (36, 1)] {
                let positions: Vec<u32> = (pos0 as u32..(pos0 + n) as u32).collect();
                let (q, k, v) = (tensor(rng, &[n, qw], 2.0), tensor(rng, &[n, kw], 2.0), tensor(rng, &[n, kw], 2.0));
                let step = AttnStep {
                    q: &q,
                    k: &k,
                    v: &v,
                    pos0,
                    positions: &positions,
                    rope: Some(&rope),
                    spec: &spec,
                    sinks: None,
                    qk_norm: None,
                };
                let want_a = c.rope_attention(&step, &mut cc).unwrap();
                let (gq, gk, gv) = (up(g, &q), up(g, &k), up(g, &v));
                let gstep = AttnStep {
                    q: &gq,
                    k: &gk,
                    v: &gv,
                    pos0,
                    positions: &positions,
                    rope: Some(&rope),
                    spec: &spec,
                    sinks: None,
                    qk_norm: None,
                };
                for ((label, kernel), gc) in
                    [("", None), (" split 16 keys", Some(split))].into_iter().zip(gcs.iter_mut())
                {
                    let case = format!("rope_attention{label} int8 mode (hd {hd}, pos0={pos0}, n={n})");
                    let a = match kernel {
                        Some(k) if n <= 4 => g8.rope_attention_with(&gstep, gc, k),
                        Some(_) => g8.rope_attention_with(&gstep, gc, AttnKernel::Prefill),
                        None => g8.rope_attention(&gstep, gc),
                    };
                    let a = match a {
                        Ok(a) => a,
                        Err(e) => {
                            r.check(&case, Err(e), &[], 0.0);
                            continue;
                        }
                    };
                    let a_host = g.to_host(&a).expect("readback");
                    r.check(&case, Ok(a_host.clone()), &want_a.data, DEFAULT_MAX_NMSE);
                    let got = host(g, g8.matmul(&a, &gw));
                    let fresh = up(g, &CpuTensor { shape: vec![n, qw], data: a_host.clone() });
                    r.exact(
                        &format!("{case} -> matmul(q8_0) == fresh quantization"),
                        host(g, g8.matmul(&a, &gw)),
                        &host(g, g8.matmul(&fresh, &gw)).unwrap_or_default(),
                    );
                    let a_cpu = CpuTensor { shape: vec![n, qw], data: a_host };
                    let (xs, bound) = if n == 1 && int8 {
                        (q8_rounded(&a_cpu), INT8_ROUNDED_MAX_NMSE)
                    } else {
                        (a_cpu, DEFAULT_MAX_NMSE)
                    };
                    let want = c.matmul(&xs, &cw).unwrap();
                    r.check(&format!("{case} -> matmul(q8_0) vs cpu"), got, &want.data, bound);
                }
            }
        }
    }

    /// The tiled prefill kernel (`matmul_tiled`, from 9 tokens) of every type: row counts past one
    /// 64-row tile and odd, 9 tokens (the threshold) and 70 (a full 64-token tile and a partial
    /// one), k of 32-value blocks not a multiple of 256 and, for float types, not a multiple of
    /// the 8-value group; accumulation, and per-head products (row spans against column offsets
    /// of many tokens). The 8-token kernel on the same inputs is checked alongside.
    fn tiled_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let mut tensors = Vec::new();
        let mut cases = Vec::new();
        for t in ALL_TYPES {
            let mut shapes = vec![(131usize, 256usize)];
            if t.block_elems() == 32 {
                shapes.push((37, 96));
            }
            if t.block_elems() == 1 {
                shapes.push((13, 67));
            }
            for (n_out, k) in shapes {
                let name = format!("tiled_{}_{n_out}x{k}", type_name(t));
                tensors.push((name.clone(), t, vec![n_out, k], rand_vec(rng, n_out * k, 1.0)));
                cases.push((name, t, n_out, k));
            }
        }
        let file = WeightFile::new("tiled", &tensors);
        for (name, t, n_out, k) in cases {
            let hw = file.get(&name);
            let cw = c.weight(&hw).expect("cpu weight");
            let gw = match g.weight(&hw) {
                Ok(w) => w,
                Err(e) => {
                    r.check(&format!("weight({}, {n_out}x{k})", type_name(t)), Err(e), &[], 0.0);
                    continue;
                }
            };
            for n in [9usize, 70] {
                let x = tensor(rng, &[n, k], 1.0);
                let want = c.matmul(&x, &cw).expect("cpu matmul");
                let gx = up(g, &x);
                let case = format!("({}, {n_out}x{k}, n={n})", type_name(t));
                r.check(&format!("matmul tiled{case}"), host(g, g.matmul(&gx, &gw)), &want.data, DEFAULT_MAX_NMSE);
                let got = host(g, g.matmul_untiled(&gx, &gw));
                r.check(&format!("matmul untiled{case}"), got, &want.data, DEFAULT_MAX_NMSE);
                if n == 70 {
                    let y0 = tensor(rng, &[n, n_out], 1.0);
                    let want_acc = c.add(&want, &y0).expect("cpu add");
                    let gy = up(g, &y0);
                    let got = g.matvec_accumulate_into(&gx, &gw, &gy).and_then(|()| g.to_host(&gy));
                    r.check(&format!("matvec_accumulate_into tiled{case}"), got, &want_acc.data, DEFAULT_MAX_NMSE);
                }
            }
        }
        let (heads, n_out, kk) = (3usize, 70usize, 64usize);
        let file = WeightFile::new(
            "tiled-per-head",
            &[(
                "per_head".into(),
                GgmlType::Q4_K,
                vec![heads, n_out, kk * 4],
                rand_vec(rng, heads * n_out * kk * 4, 1.0),
            )],
        );
        let hw = file.get("per_head");
        let x = tensor(rng, &[70, heads * kk * 4], 1.0);
        let want = c.matmul_per_head(&x, &c.weight(&hw).unwrap()).unwrap();
        let got = g.weight(&hw).and_then(|w| host(g, g.matmul_per_head(&up(g, &x), &w)));
        r.check(
            &format!("matmul_per_head tiled(q4_k, heads={heads}, {n_out}x{}, n=70)", kk * 4),
            got,
            &want.data,
            DEFAULT_MAX_NMSE,
        );
    }

    /// What one dispatch costs apart from its work (issue 5), one line per condition: wall time
    /// per dispatch over a batch (submit to completion) and, where the adapter has timestamp
    /// queries, GPU time per dispatch; each chain without a timestamp inside it and with one
    /// before every dispatch (as `DISKFORMER_GPU_PROFILE=2`), so the profile's own cost shows.
    /// `--ignored perf_dispatch` runs only this; `DISKFORMER_PROBE=norm,k)` picks cases by label.
    fn dispatch_costs(g: &WgpuBackend) {
        // DISKFORMER_PROBE_N: shorter chains for a quick run on a software adapter.
        let n_dispatches = std::env::var("DISKFORMER_PROBE_N").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
        for c in g.perf_dispatch(n_dispatches).expect("dispatch probe") {
            let gpu = match c.gpu_secs {
                Some(s) => format!("{:.2} us GPU", s * 1e6),
                None => "no timestamp queries".to_string(),
            };
            println!(
                "dispatch cost [{}]: {:.2} us wall, {gpu} per dispatch ({:.2} us host recording)",
                c.case,
                c.wall_secs * 1e6,
                c.encode_secs * 1e6
            );
            for (kernel, secs) in &c.per_kernel {
                println!("    as the GPU profile attributes it: {kernel} {:.2} us per dispatch", secs * 1e6);
            }
        }
    }

    /// What a host round trip costs (issue 6): one tiny op on a 4096-value row (a hidden state)
    /// and its result read back, as a hybrid step would do to hand a layer's input to the CPU.
    /// Misses computed on the CPU *beside* the GPU need two of these per MoE layer (48 layers in
    /// Qwen3-30B-A3B), so their median says whether that design can pay at all. Prints the
    /// median, 90th percentile and minimum over 300 trips after 20 untimed ones.
    #[test]
    #[ignore = "measurement, not a check: bench/gpu.sh runs it on a real GPU"]
    fn perf_roundtrip() {
        let Some(g) = gpu("perf_roundtrip") else { return };
        let x = g.from_host(&vec![1.0f32; 4096], &[1, 4096]).expect("upload");
        let mut trips = Vec::new();
        for i in 0..320 {
            let t = std::time::Instant::now();
            let y = g.scale(&x, 0.5).expect("scale");
            let back = g.to_host(&y).expect("read back");
            assert_eq!(back[4095], 0.5);
            if i >= 20 {
                trips.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        trips.sort_by(f64::total_cmp);
        let at = |q: f64| trips[((trips.len() - 1) as f64 * q) as usize];
        println!(
            "host round trip (one op on 4096 values, read back): median {:.1} us, p90 {:.1} us, min {:.1} us",
            at(0.5),
            at(0.9),
            trips[0]
        );
    }

    /// Where a host round trip's time goes, by phase and by how the host learns the GPU is
    /// done (`WgpuBackend::perf_round_trip_parts`); medians over 300 trips of each case.
    #[test]
    #[ignore = "measurement, not a check: run on a real GPU"]
    fn perf_round_trip_parts() {
        let Some(g) = gpu("perf_round_trip_parts") else { return };
        for c in g.perf_round_trip_parts(300).expect("round trip probe") {
            println!(
                "round trip [{}]: encode {:.1} us, submit {:.1}, to done {:.1}, read {:.1}; total median {:.1} us (p10 {:.1}, p90 {:.1})",
                c.case,
                c.encode_secs * 1e6,
                c.submit_secs * 1e6,
                c.done_secs * 1e6,
                c.read_secs * 1e6,
                c.total_secs * 1e6,
                c.total_p10_secs * 1e6,
                c.total_p90_secs * 1e6
            );
        }
    }

    /// Host-mapped mailboxes carry data both ways while the GPU runs (`mailbox.rs`): 200 round
    /// trips through polled memory, inside one kernel and as chains of dispatches, none timing
    /// out and none seeing the other side's data older than its flag. Prints the round times.
    /// On a GPU only: run on the device (`--exact gpu_ops::mailbox_round_trips`).
    #[test]
    fn mailbox_round_trips() {
        let Some(g) = gpu("mailbox_round_trips") else { return };
        if g.adapter().device_type == "Cpu" {
            // lavapipe fails the third case (the split does not use mailboxes there).
            println!("mailbox_round_trips: skipped on a CPU adapter ({})", g.adapter().name);
            return;
        }
        let lines = g.perf_mailbox(200).expect("mailbox probe");
        for l in &lines {
            println!("mailbox [{l}]");
        }
        assert_eq!(lines.len(), 3, "a case stopped: {lines:#?}");
        for l in &lines {
            assert!(
                l.contains("200 rounds")
                    && l.contains("timed out at round 0,")
                    && l.contains("stale data 0x, host saw stale data 0x"),
                "{l}"
            );
        }
    }

    #[test]
    #[ignore = "measurement, not a check: bench/gpu.sh runs it on a real GPU"]
    fn perf_dispatch() {
        let Some(g) = gpu("backend_ops") else { return };
        dispatch_costs(&g);
    }

    /// One replayed layer's attention weights and its two block norms (`q{l}`, `k{l}`, `v{l}`,
    /// `o{l}` of the test file; norm weights drawn from `rng`), as the perf replays use them.
    struct ReplayAttention {
        q: compute::wgpu::WgpuWeight,
        k: compute::wgpu::WgpuWeight,
        v: compute::wgpu::WgpuWeight,
        o: compute::wgpu::WgpuWeight,
        attn_norm: compute::wgpu::WgpuTensor,
        ffn_norm: compute::wgpu::WgpuTensor,
    }

    impl ReplayAttention {
        fn load(
            g: &WgpuBackend,
            w: &dyn Fn(&str) -> compute::wgpu::WgpuWeight,
            l: usize,
            d: usize,
            rng: &mut StdRng,
        ) -> ReplayAttention {
            ReplayAttention {
                q: w(&format!("q{l}")),
                k: w(&format!("k{l}")),
                v: w(&format!("v{l}")),
                o: w(&format!("o{l}")),
                attn_norm: g.from_host(&rand_vec(rng, d, 1.0), &[d]).unwrap(),
                ffn_norm: g.from_host(&rand_vec(rng, d, 1.0), &[d]).unwrap(),
            }
        }
    }
    /// The products of an 8B decode layer where a token meets them (issue 5: alone they read
    /// Q4_0 at ~66% of the stream, in a token the o-proj and down projection averaged 19 us).
    /// First each plain decode shape alone, a chain of the same product (o-proj 4096 x 4096,
    /// down 4096 x 14336) in several workgroup shapes; then a token replayed: 32 layers cycling
    /// over 4 layers' weights (123 MB each in Q4_0, so nothing stays in L2), each layer's
    /// dispatches as a dense decode records them (norm with int8 blocks, q/k/v in one dispatch,
    /// a quantize of q standing in for the attention, o-proj adding into the residual, norm,
    /// gate/up + GLU with int8 blocks, down adding into the residual), wall time per token and
    /// per layer. Run it twice: as is, and with DISKFORMER_GPU_PROFILE=2, which prints each
    /// kernel's GPU time in the token's sequence when the back end drops (the per-layer wall
    /// time of the two runs gives the profile's own cost). The back end's shapes follow the
    /// environment (DISKFORMER_MATVEC_Q8, DISKFORMER_MATVEC_Q8_WIDE for the down projection,
    /// DISKFORMER_GLU_Q8, DISKFORMER_NORM); DISKFORMER_PERF_TYPE=q4_k (q6_k, q8_0) changes the
    /// weight type.
    #[test]
    #[ignore = "measurement, not a check: bench/gpu.sh runs it on a real GPU"]
    fn perf_layer() {
        let Some(g) = gpu("perf_layer") else { return };
        let g = g.with_matmul_mode(MatmulMode::QuantizedActivations);
        let t = match std::env::var("DISKFORMER_PERF_TYPE").ok().as_deref() {
            Some("q4_k") => GgmlType::Q4_K,
            Some("q6_k") => GgmlType::Q6_K,
            Some("q8_0") => GgmlType::Q8_0,
            _ => GgmlType::Q4_0,
        };
        let tn = type_name(t);
        let (d, ff, kv) = (4096usize, 14336usize, 1024usize);
        const N_DISTINCT: usize = 4;
        const N_LAYERS: usize = 32;
        let mut tensors = Vec::new();
        for l in 0..N_DISTINCT {
            for (name, rows, k) in
                [("q", d, d), ("k", kv, d), ("v", kv, d), ("o", d, d), ("gate", ff, d), ("up", ff, d), ("down", d, ff)]
            {
                tensors.push((format!("{name}{l}"), t, vec![rows, k], Vec::new()));
            }
        }
        let file = WeightFile::new(&format!("backend-ops-perf-layer-{tn}"), &tensors);
        let w = |name: &str| g.weight(&file.get(name)).expect("upload");
        let mut rng = StdRng::seed_from_u64(5);
        let bytes = |rows: usize, k: usize| (rows * k / t.block_elems() * t.block_bytes()) as f64;

        // Alone: a chain of one product in each shape (x quantized once, outside the timing; the
        // same matrix each time).
        let x = g.from_host(&rand_vec(&mut rng, ff, 1.0), &[1, ff]).unwrap();
        let x_d = g.from_host(&rand_vec(&mut rng, d, 1.0), &[1, d]).unwrap();
        for (name, rows, k) in [("o0", d, d), ("down0", d, ff)] {
            let wt = w(name);
            let xx = if k == d { &x_d } else { &x };
            for v in [
                "2x64",
                "1x64",
                "4x64",
                "8x64",
                "1x128",
                "2x128",
                "1x256",
                "2x64u2",
                "4x64u2",
                "1x128u2",
                "2x256t32",
                "2x64v",
                "2x64u2v",
                "1x128u2v",
                "1x256t32u2v",
                "2x64u2pv",
                "1x256t16u2pv",
                "1x64v",
                "1x32v",
            ] {
                let shape = Q8Shape::parse(v).expect("valid shape");
                if let Some(secs) = g.perf_matvec_q8(xx, &wt, shape, 200).expect("matvec_q8") {
                    println!(
                        "alone {tn} {rows}x{k} [matvec_q8 {shape}]: {:.2} us, {:.1} GB/s of GGUF bytes",
                        secs * 1e6,
                        bytes(rows, k) / secs / 1e9
                    );
                }
            }
        }

        // Alone but cold: the same chain cycling over the 4 layers' matrices (37 MB of o-proj,
        // 132 MB of down: the o-proj chain alone above may run from the 50 MB L2), in the back
        // end's shapes (DISKFORMER_MATVEC_Q8, DISKFORMER_MATVEC_Q8_WIDE).
        for (name, rows, k) in [("o", d, d), ("down", d, ff)] {
            let ws: Vec<_> = (0..N_DISTINCT).map(|l| w(&format!("{name}{l}"))).collect();
            let xx = if k == d { &x_d } else { &x };
            let xq = g.quantize_activations(xx).expect("quantize");
            let y = g.from_host(&vec![0f32; rows], &[1, rows]).unwrap();
            let reps = 200;
            let chain = || {
                for i in 0..reps {
                    g.matvec_q8_into(xx, xq.as_ref(), &ws[i % N_DISTINCT], &y, 0, false).expect("matvec_q8_into");
                }
                g.sync();
            };
            chain();
            let mut times: Vec<f64> = (0..5)
                .map(|_| {
                    let t0 = std::time::Instant::now();
                    chain();
                    t0.elapsed().as_secs_f64() / reps as f64
                })
                .collect();
            times.sort_by(f64::total_cmp);
            println!(
                "alone, cycling {N_DISTINCT} matrices {tn} {rows}x{k} [back end's shape]: {:.2} us, {:.1} GB/s of GGUF bytes",
                times[2] * 1e6,
                bytes(rows, k) / times[2] / 1e9
            );
        }

        struct Layer {
            a: ReplayAttention,
            gate: compute::wgpu::WgpuWeight,
            up: compute::wgpu::WgpuWeight,
            down: compute::wgpu::WgpuWeight,
        }
        let layers: Vec<Layer> = (0..N_DISTINCT)
            .map(|l| Layer {
                a: ReplayAttention::load(&g, &w, l, d, &mut rng),
                gate: w(&format!("gate{l}")),
                up: w(&format!("up{l}")),
                down: w(&format!("down{l}")),
            })
            .collect();
        let x0 = rand_vec(&mut rng, d, 1.0);
        let token = || -> Result<(), compute::OpError> {
            let mut res = g.from_host(&x0, &[1, d])?;
            for l in 0..N_LAYERS {
                let w = &layers[l % N_DISTINCT];
                let h = g.rms_norm(&res, Some(&w.a.attn_norm), 1e-5)?;
                let [q, _k, _v] = g.matmul_many(&h, [&w.a.q, &w.a.k, &w.a.v])?;
                res = g.matmul_add(&q, &w.a.o, res)?;
                let h = g.rms_norm(&res, Some(&w.a.ffn_norm), 1e-5)?;
                let a = g.matmul_glu(&h, &w.gate, &w.up, Glu::Plain(Act::Silu))?;
                res = g.matmul_add(&a, &w.down, res)?;
            }
            g.sync();
            Ok(())
        };
        let warm = std::time::Instant::now();
        while warm.elapsed().as_secs_f64() < 1.0 {
            token().expect("token");
        }
        let commands0 = g.commands_submitted();
        let mut times: Vec<f64> = (0..7)
            .map(|_| {
                let t0 = std::time::Instant::now();
                token().expect("token");
                t0.elapsed().as_secs_f64()
            })
            .collect();
        let per_token = (g.commands_submitted() - commands0) as f64 / times.len() as f64;
        times.sort_by(f64::total_cmp);
        let secs = times[times.len() / 2];
        let layer_bytes = bytes(d + 2 * kv + d, d) + bytes(2 * ff, d) + bytes(d, ff);
        println!(
            "token replay {tn}: {N_LAYERS} layers (4 distinct, {:.0} MB each): {:.3} ms per token, {:.1} us per layer, {per_token:.0} commands per token, {:.1} GB/s of weights (wall, including host recording; profile {})",
            layer_bytes / 1e6,
            secs * 1e3,
            secs * 1e6 / N_LAYERS as f64,
            layer_bytes * N_LAYERS as f64 / secs / 1e9,
            std::env::var("DISKFORMER_GPU_PROFILE").unwrap_or_else(|_| "off".into())
        );
    }

    /// A decode layer of Qwen3-30B-A3B up to its routing, replayed (issue 6: under the split miss
    /// mode the host waits for each MoE layer's ids, and the seventeenth session's trace put the
    /// readback's submit to the ids on the host at ~118 us per layer on the H200, of which the
    /// trip is ~25): the attention norm, q/k/v in one product (Q4_K), the per-head q/k norms,
    /// rope and decode attention at position 255 of a 256-position cache, the o-proj adding into
    /// the residual, the FFN norm, the f32 router, the routing. 48 layers cycling over 4 weight
    /// sets; wall time per layer when each layer's routing is read back (the split's chain) and
    /// when only the token's end is (the sections' GPU time back to back).
    #[test]
    #[ignore = "measurement, not a check: run on a real GPU"]
    fn perf_moe_attention_section() {
        let Some(g) = gpu("perf_moe_attention_section") else { return };
        let g = g.with_matmul_mode(MatmulMode::QuantizedActivations);
        let (d, n_head, n_kv, hd, n_expert) = (2048usize, 32usize, 4usize, 128usize, 128usize);
        const N_DISTINCT: usize = 4;
        const N_LAYERS: usize = 48;
        const CTX: usize = 256;
        let mut rng = StdRng::seed_from_u64(7);
        let mut tensors = Vec::new();
        for l in 0..N_DISTINCT {
            for (name, rows, k) in
                [("q", n_head * hd, d), ("k", n_kv * hd, d), ("v", n_kv * hd, d), ("o", d, n_head * hd)]
            {
                tensors.push((format!("{name}{l}"), GgmlType::Q4_K, vec![rows, k], Vec::new()));
            }
            tensors.push((
                format!("router{l}"),
                GgmlType::F32,
                vec![n_expert, d],
                rand_vec(&mut rng, n_expert * d, 0.05),
            ));
        }
        let file = WeightFile::new("backend-ops-perf-moe-attention", &tensors);
        let w = |name: &str| g.weight(&file.get(name)).expect("upload");
        struct Layer {
            a: ReplayAttention,
            router: compute::wgpu::WgpuWeight,
            q_norm: compute::wgpu::WgpuTensor,
            k_norm: compute::wgpu::WgpuTensor,
        }
        let layers: Vec<Layer> = (0..N_DISTINCT)
            .map(|l| Layer {
                a: ReplayAttention::load(&g, &w, l, d, &mut rng),
                router: w(&format!("router{l}")),
                q_norm: g.from_host(&rand_vec(&mut rng, hd, 1.0), &[hd]).unwrap(),
                k_norm: g.from_host(&rand_vec(&mut rng, hd, 1.0), &[hd]).unwrap(),
            })
            .collect();
        let mut caches: Vec<_> =
            (0..N_LAYERS).map(|_| g.new_cache(CTX, n_kv * hd, n_kv * hd).expect("cache")).collect();
        let spec = AttnSpec {
            n_head,
            n_head_kv: n_kv,
            head_dim_k: hd,
            head_dim_v: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            softcap: None,
        };
        let rope = RopeSpec {
            head_dim: hd,
            n_rot: hd,
            base: 1e6,
            neox: true,
            freq_factors: None,
            position_scale: 1.0,
            yarn: None,
        };
        let route = RouteSpec {
            k: 8,
            gating: Gating::Softmax,
            has_selection_bias: false,
            groups: None,
            normalize: true,
            scale: 1.0,
        };
        let x0 = rand_vec(&mut rng, d, 1.0);
        let pos = CTX - 1;
        let positions = [pos as u32];
        // Ops left out, for a differential measurement of each one's share of the section
        // (`SECTION_SKIP=attn_norm,qk_norm,attention,o,ffn_norm,router,route`, or `each`: the
        // whole section, then without each op in turn, alternating over rounds).
        #[derive(Clone, Copy, Default)]
        struct Skip {
            attn_norm: bool,
            qk_norm: bool,
            attention: bool,
            o: bool,
            ffn_norm: bool,
            router: bool,
            route: bool,
        }
        let mut token = |read_each_layer: bool, skip: Skip| -> Result<(), compute::OpError> {
            let mut res = g.from_host(&x0, &[1, d])?;
            for (l, cache) in caches.iter_mut().enumerate() {
                let lw = &layers[l % N_DISTINCT];
                let normed = (!skip.attn_norm).then(|| g.rms_norm(&res, Some(&lw.a.attn_norm), 1e-6)).transpose()?;
                let h = normed.as_ref().unwrap_or(&res);
                let [q, k, v] = g.matmul_many(h, [&lw.a.q, &lw.a.k, &lw.a.v])?;
                let per_head = |t: compute::wgpu::WgpuTensor, heads: usize, norm| -> Result<_, compute::OpError> {
                    if skip.qk_norm {
                        return Ok(t);
                    }
                    let t = g.reshape(t, &[heads, hd])?;
                    let t = g.rms_norm(&t, Some(norm), 1e-6)?;
                    g.reshape(t, &[1, heads * hd])
                };
                let q = per_head(q, n_head, &lw.q_norm)?;
                let k = per_head(k, n_kv, &lw.k_norm)?;
                let step = AttnStep {
                    q: &q,
                    k: &k,
                    v: &v,
                    pos0: pos,
                    positions: &positions,
                    rope: Some(&rope),
                    spec: &spec,
                    sinks: None,
                    qk_norm: None,
                };
                let a = if skip.attention { q } else { g.rope_attention(&step, cache)? };
                if !skip.o {
                    res = g.matmul_add(&a, &lw.a.o, res)?;
                }
                let normed = (!skip.ffn_norm).then(|| g.rms_norm(&res, Some(&lw.a.ffn_norm), 1e-6)).transpose()?;
                let h = normed.as_ref().unwrap_or(&res);
                if skip.router {
                    if read_each_layer {
                        std::hint::black_box(g.to_host(h)?);
                    }
                    continue;
                }
                let logits = g.matmul(h, &lw.router)?;
                let read = if skip.route { logits } else { g.route(&logits, None, &route)?.weights };
                if read_each_layer {
                    std::hint::black_box(g.to_host(&read)?);
                }
            }
            std::hint::black_box(g.to_host(&res)?);
            Ok(())
        };
        let names = ["attn_norm", "qk_norm", "attention", "o", "ffn_norm", "router", "route"];
        let skip_of = |list: &str| {
            let mut s = Skip::default();
            for name in list.split(',').map(str::trim) {
                match name {
                    "attn_norm" => s.attn_norm = true,
                    "qk_norm" => s.qk_norm = true,
                    "attention" => s.attention = true,
                    "o" => s.o = true,
                    "ffn_norm" => s.ffn_norm = true,
                    "router" => s.router = true,
                    "route" => s.route = true,
                    "" => {}
                    other => panic!("SECTION_SKIP: no op {other} (ops: {names:?})"),
                }
            }
            s
        };
        let requested = std::env::var("SECTION_SKIP").unwrap_or_default();
        let variants: Vec<String> = if requested.trim() == "each" {
            std::iter::once(String::new()).chain(names.iter().map(|n| n.to_string())).collect()
        } else {
            vec![requested.clone()]
        };
        let rounds = if variants.len() > 1 { 3 } else { 2 };
        let mut results: Vec<Vec<[f64; 2]>> = vec![Vec::new(); variants.len()];
        for _ in 0..rounds {
            for (vi, variant) in variants.iter().enumerate() {
                let skip = skip_of(variant);
                let mut pair = [0.0; 2];
                for (slot, read_each_layer) in [true, false].into_iter().enumerate() {
                    let warm = std::time::Instant::now();
                    while warm.elapsed().as_secs_f64() < 0.3 {
                        token(read_each_layer, skip).expect("token");
                    }
                    let mut times: Vec<f64> = (0..7)
                        .map(|_| {
                            let t0 = std::time::Instant::now();
                            token(read_each_layer, skip).expect("token");
                            t0.elapsed().as_secs_f64()
                        })
                        .collect();
                    times.sort_by(f64::total_cmp);
                    pair[slot] = times[times.len() / 2] * 1e6 / N_LAYERS as f64;
                }
                results[vi].push(pair);
            }
        }
        for (variant, runs) in variants.iter().zip(&results) {
            let label = if variant.is_empty() { "the whole section".to_string() } else { format!("without {variant}") };
            let fmt = |slot: usize| runs.iter().map(|p| format!("{:.1}", p[slot])).collect::<Vec<_>>().join(" / ");
            println!(
                "Qwen3-30B-A3B attention section to the routing, {N_LAYERS} layers at position {pos}, {label}: us per layer with each layer's routing read back (the split's chain) {}; back to back (one read per token) {}",
                fmt(0),
                fmt(1)
            );
        }
    }

    /// The GPU's reads of host memory by size: a window of a 1 GiB host buffer per dispatch, a
    /// different window each time, from one expert of Qwen3-30B-A3B Q4_K (2.66 MB) to 256 MiB.
    /// Whether the host tier's MoE kernels (~35-39 GB/s over a link the 256 MiB stream reads at
    /// ~50) lose to the size of a layer's misses or to their own code.
    #[test]
    #[ignore = "measurement, not a check: run on a real GPU"]
    fn perf_host_windows() {
        let Some(g) = gpu("perf_host_windows") else { return };
        let total = (1u64 << 30).min(g.max_binding_bytes()) & !0xffff;
        for window in [2_662_400u64, 5_324_800, 11_182_080, 16_773_120, 67_108_864, 268_435_456] {
            let w = window & !15;
            match g.perf_stream_host_windows(total, w, 20) {
                Ok(secs) => println!(
                    "host read window {:.2} MB of {} MiB: {:.1} us, {:.1} GB/s",
                    w as f64 / 1e6,
                    total >> 20,
                    secs * 1e6,
                    w as f64 / secs / 1e9
                ),
                Err(e) => println!("host read window {w}: {e}"),
            }
        }
        // The same window every time: whether the GPU's L2 (50 MB on the H200) keeps host memory
        // it has read, so a second read of a layer's bytes would not cross the link again.
        for window in [5_324_800u64, 16_773_120] {
            match g.perf_stream_host_windows(window, window, 20) {
                Ok(secs) => println!(
                    "host read of the same {:.2} MB each time: {:.1} us, {:.1} GB/s",
                    window as f64 / 1e6,
                    secs * 1e6,
                    window as f64 / secs / 1e9
                ),
                Err(e) => println!("host read of the same {window} bytes: {e}"),
            }
        }
    }

    /// Decode matrix-vector bandwidth against a streaming read of the same size, in GB/s, and
    /// the per-dispatch costs of `perf_dispatch`.
    #[test]
    #[ignore = "measurement, not a check: bench/gpu.sh runs it on a real GPU"]
    fn perf() {
        let Some(g) = gpu("backend_ops") else { return };
        dispatch_costs(&g);
        let stream_bytes: u64 = (1u64 << 30).min(g.max_binding_bytes());
        let t_stream = g.perf_stream(stream_bytes, 20).expect("stream");
        println!(
            "stream read {} MiB: {:.3} ms, {:.1} GB/s",
            stream_bytes >> 20,
            t_stream * 1e3,
            stream_bytes as f64 / t_stream / 1e9
        );
        let mut rng = StdRng::seed_from_u64(7);
        // DISKFORMER_PERF_ROWS: another row count (229376 rows make a ~1.06 GB Q4_0 or Q4_K
        // matrix, the size of the 1 GiB stream, where neither kernel's start and tail count).
        let n_out = std::env::var("DISKFORMER_PERF_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(32768usize);
        let k = 8192usize;
        // Q6_K: the output matrix (and some FFN matrices) of every Q4_K_M file.
        // DISKFORMER_PERF_TYPES=q4_0,q4_k: only these types' matrix-vector lines.
        let only: Option<Vec<String>> =
            std::env::var("DISKFORMER_PERF_TYPES").ok().map(|v| v.split(',').map(str::to_string).collect());
        let q8_shapes: Vec<String> = match std::env::var("DISKFORMER_PERF_SHAPES") {
            Ok(v) => v.split(',').map(str::to_string).collect(),
            Err(_) => Q8_PERF_SHAPES.iter().map(|s| s.to_string()).collect(),
        };
        for t in [GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q6_K, GgmlType::F16] {
            if only.as_ref().is_some_and(|o| !o.contains(&type_name(t))) {
                continue;
            }
            let tensors = vec![(format!("w_{}", type_name(t)), t, vec![n_out, k], Vec::new())];
            let file = WeightFile::new(&format!("backend-ops-perf-{}", type_name(t)), &tensors);
            let w = g.weight(&file.get(&tensors[0].0)).expect("upload");
            let x = g.from_host(&rand_vec(&mut rng, k, 1.0), &[1, k]).unwrap();
            let stored = (n_out * k / t.block_elems() * t.block_bytes()) as f64;
            // The stream read of the same bytes: a dispatch's start and tail weigh more on the
            // 151 MB of a Q4_0 matrix than on the 1 GiB baseline, so both shares are printed.
            let same_bytes = (stored as u64).div_ceil(16) * 16;
            let t_same = g.perf_stream(same_bytes, 50).expect("stream");
            println!(
                "stream read {:.1} MB (the {} matrix's bytes): {:.3} ms, {:.1} GB/s",
                same_bytes as f64 / 1e6,
                type_name(t),
                t_same * 1e3,
                same_bytes as f64 / t_same / 1e9
            );
            let mut shapes: Vec<Option<MatvecShape>> = vec![None];
            for rows in [1, 2, 4, 8] {
                for wg in [64, 128, 256] {
                    shapes.push(Some(MatvecShape { rows, wg }));
                }
            }
            let mut timings = Vec::new();
            for shape in shapes {
                let secs = g.perf_matvec(&x, &w, shape, 50).expect("matvec");
                let kernel = match shape {
                    Some(s) => format!("matvec {}x{}", s.rows, s.wg),
                    None => "matmul (general)".to_string(),
                };
                timings.push((kernel, secs));
            }
            // The int8-activation kernel (activations quantized once, outside the timing: its
            // cost per token is the `quantize_q8` line below), every variant (Q8Shape::parse:
            // ROWSxWG, tTPR invocations per row slot, uUNROLL blocks per iteration; each is
            // selectable with DISKFORMER_MATVEC_Q8). DISKFORMER_PERF_SHAPES=a,b,... replaces the list.
            for v in &q8_shapes {
                let shape = Q8Shape::parse(v).expect("valid shape");
                if let Some(secs) = g.perf_matvec_q8(&x, &w, shape, 50).expect("matvec_q8") {
                    timings.push((format!("matvec_q8 {shape}"), secs));
                }
            }
            for (kernel, secs) in timings {
                println!(
                    "matvec {} {n_out}x{k} [{kernel}]: {:.3} ms, {:.1} GB/s of GGUF bytes ({:.1} GB/s of repacked bytes, {:.0}% of the stream read, {:.0}% of its bytes' stream)",
                    type_name(t),
                    secs * 1e3,
                    stored / secs / 1e9,
                    w.size_bytes() as f64 / secs / 1e9,
                    100.0 * stored / secs / (stream_bytes as f64 / t_stream),
                    100.0 * t_same / secs
                );
            }
        }
        // Prefill: a 512-token batch through a 14336 x 4096 matrix (an 8B model's FFN up), the
        // tiled kernel against the 8-token one.
        let (n_out, k, n_tok) = (14336usize, 4096usize, 512usize);
        let x = g.from_host(&rand_vec(&mut rng, n_tok * k, 1.0), &[n_tok, k]).unwrap();
        for t in [GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::F16] {
            if only.as_ref().is_some_and(|o| !o.contains(&type_name(t))) {
                continue;
            }
            let tensors = vec![(format!("p_{}", type_name(t)), t, vec![n_out, k], Vec::new())];
            let file = WeightFile::new(&format!("backend-ops-perf-prefill-{}", type_name(t)), &tensors);
            let w = g.weight(&file.get(&tensors[0].0)).expect("upload");
            for tiled in [true, false] {
                let secs = g.perf_prefill(&x, &w, tiled, 5).expect("prefill");
                println!(
                    "prefill {} {n_out}x{k} x {n_tok} tokens [{}]: {:.3} ms, {:.0} GFLOP/s",
                    type_name(t),
                    if tiled { "matmul_tiled 64x64" } else { "matmul 8 tokens" },
                    secs * 1e3,
                    2.0 * (n_out * k * n_tok) as f64 / secs / 1e9
                );
            }
        }
        for k in [4096usize, 14336] {
            let x = g.from_host(&rand_vec(&mut rng, k, 1.0), &[1, k]).unwrap();
            let secs = g.perf_quantize_q8(&x, 50).expect("quantize");
            println!("quantize_q8 1x{k}: {:.1} us", secs * 1e6);
        }
        perf_groups(&g, &mut rng);
    }

    /// Decode attention per call (one token, rope and the int8 epilogue as in the model's decode
    /// step), the prefill kernel (`old`, what decode took before the decode kernel) against
    /// the decode kernel's shapes (`WGxKEYS[uUNROLL]`, each selectable in the model with
    /// DISKFORMER_ATTN_DECODE; `auto` is the default the model takes), at contexts 1 to 8192:
    /// an 8B model's 32 query / 8 KV heads and Qwen3-30B-A3B's 32 / 4, head dim 128.
    /// DISKFORMER_ATTN_PERF_SHAPES=a,b,... replaces the list of shapes. Prints us per call and the
    /// bandwidth of the f32 KV rows read.
    #[test]
    #[ignore = "measurement, not a check: run on a real GPU (docs/NOTES.md)"]
    fn perf_attention() {
        let Some(g) = gpu("backend_ops") else { return };
        let g = g.with_matmul_mode(MatmulMode::QuantizedActivations);
        let shapes: Vec<String> = match std::env::var("DISKFORMER_ATTN_PERF_SHAPES") {
            Ok(v) => v.split(',').map(str::to_string).collect(),
            Err(_) => ATTN_PERF_SHAPES.iter().map(|s| s.to_string()).collect(),
        };
        let mut kernels = vec![("old".to_string(), AttnKernel::Prefill), ("auto".to_string(), AttnKernel::Auto)];
        for s in &shapes {
            match AttnDecodeShape::parse(s) {
                Some(shape) => kernels.push((s.clone(), AttnKernel::Decode { shape, subgroups: true })),
                None => println!("perf_attention: shape {s:?} is not WGxKEYS[uUNROLL]: skipped"),
            }
        }
        kernels.push((
            "128x64 no subgroups".to_string(),
            AttnKernel::Decode { shape: AttnDecodeShape::parse("128x64").unwrap(), subgroups: false },
        ));
        for (model, n_head, n_head_kv) in [("8B", 32usize, 8usize), ("Qwen3-30B-A3B", 32, 4)] {
            let hd = 128;
            let spec = AttnSpec {
                n_head,
                n_head_kv,
                head_dim_k: hd,
                head_dim_v: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window: None,
                softcap: None,
            };
            let rope = RopeSpec::new(hd, 500000.0, model != "8B");
            for n_keys in [1usize, 128, 512, 2048, 8192] {
                let kv_bytes = (2 * n_keys * n_head_kv * hd * 4) as f64;
                for (label, kernel) in &kernels {
                    match g.perf_attention(&spec, Some(&rope), n_keys, 1, *kernel, 50) {
                        Ok(secs) => println!(
                            "attention {model} ({n_head}/{n_head_kv} heads x {hd}) ctx {n_keys} [{label}]: {:.2} us, {:.0} GB/s of KV",
                            secs * 1e6,
                            kv_bytes / secs / 1e9
                        ),
                        Err(e) => println!("attention {model} ctx {n_keys} [{label}]: not run: {e}"),
                    }
                }
            }
        }
    }

    /// Decode attention shapes `perf_attention` times by default.
    const ATTN_PERF_SHAPES: [&str; 22] = [
        "128x64",
        "128x64u2",
        "128x64u8",
        "128x32",
        "128x128",
        "256x64",
        "256x64u8",
        "256x128",
        "256x256u8",
        "64x32",
        "64x64u2",
        "512x256",
        "512x512u8",
        "1024x512u8",
        "1024x1024u8",
        "1024x512u8r4",
        "256x64r4",
        "128x64r2",
        "128x16r1",
        "128x32r1",
        "128x32u1r1",
        "64x16u1r1",
    ];

    /// Variants of the int8 decode kernel the perf test times (classic shapes, row slots,
    /// unrolled loops, pairs of adjacent blocks per invocation (`p`), 16-byte loads for Q4_K/Q5_K
    /// and grouped Q4_0 and Q4_K: `v` is the same kernel as without it for the other types).
    /// The last ones are for the grouped layouts' short loops (an 8192-value row is 256 blocks,
    /// 4 per invocation of a 64-wide row): 32-wide rows, a 64-wide row slot of 256; then the
    /// persistent subgroup row slots (`s`).
    const Q8_PERF_SHAPES: [&str; 59] = [
        "1x64",
        "2x64",
        "4x64",
        "1x128",
        "2x128",
        "1x64u2",
        "2x64u2",
        "2x128u2",
        "1x64u4",
        "2x64u4",
        "4x64u2",
        "2x128u4",
        "1x256t8",
        "1x256t16",
        "2x256t16",
        "1x256t32",
        "2x256t32u2",
        "1x256t8u2",
        "1x256t16u2",
        "1x256t32u4",
        "1x64v",
        "2x64u2v",
        "2x64u4v",
        "1x256t8v",
        "1x256t16u2v",
        "4x64u2v",
        "2x64v",
        "1x64u4v",
        "1x128u2v",
        "2x128u2v",
        "2x128u4v",
        "4x64u4v",
        "1x256t16u4v",
        "1x256t32u2v",
        "1x256t32u4v",
        "2x256t32u2v",
        "2x64p",
        "2x64pv",
        "2x64u2pv",
        "1x64u2pv",
        "1x128u2pv",
        "4x64u2pv",
        "1x256t16pv",
        "1x256t16u2pv",
        "1x256t32u2pv",
        "1x32v",
        "2x32v",
        "1x32u2v",
        "1x128v",
        "1x256t64v",
        "1x256t32v",
        "1x256sv",
        "1x256u2sv",
        "1x256u4sv",
        "2x256u2sv",
        "4x256u2sv",
        "1x128u2sv",
        "1x64u4sv",
        "2x64u2sv",
    ];

    /// The perf test would stop at the first shape that does not parse, on the device.
    #[test]
    fn perf_shapes_parse() {
        for v in Q8_PERF_SHAPES {
            assert!(Q8Shape::parse(v).is_some(), "{v}");
        }
    }

    /// One 8B decode layer's grouped products with int8 activations, each timed with its
    /// quantization: q/k/v (4096, 1024, 1024 rows x 4096) in one multi-weight dispatch against
    /// three, and gate/up (14336 rows x 4096) with the GLU in one dispatch (which also writes the
    /// int8 blocks for the down projection) against two products, the glu kernel and a
    /// quantization; the GLU kernel in every shape that quantizes its result
    /// (DISKFORMER_GLU_Q8 picks it).
    fn perf_groups(g: &WgpuBackend, rng: &mut StdRng) {
        let g = g.clone().with_matmul_mode(MatmulMode::QuantizedActivations);
        let k = 4096usize;
        let x = g.from_host(&rand_vec(rng, k, 1.0), &[1, k]).unwrap();
        let only: Option<Vec<String>> =
            std::env::var("DISKFORMER_PERF_TYPES").ok().map(|v| v.split(',').map(str::to_string).collect());
        for t in [GgmlType::Q4_0, GgmlType::Q4_K] {
            let tn = type_name(t);
            if only.as_ref().is_some_and(|o| !o.contains(&tn)) {
                continue;
            }
            let tensors: Vec<_> = [("q", 4096usize), ("k", 1024), ("v", 1024), ("gate", 14336), ("up", 14336)]
                .iter()
                .map(|&(n, rows)| (format!("{n}_{tn}"), t, vec![rows, k], Vec::new()))
                .collect();
            let file = WeightFile::new(&format!("backend-ops-perf-groups-{tn}"), &tensors);
            let ws: Vec<_> = tensors.iter().map(|(n, ..)| g.weight(&file.get(n)).expect("upload")).collect();
            let qkv = [&ws[0], &ws[1], &ws[2]];
            let qkv_bytes = (6144 * k / t.block_elems() * t.block_bytes()) as f64;
            // The separate products take the default shape (DISKFORMER_MATVEC_Q8, else 2x64).
            let fused_shapes = ["1x64", "2x64", "2x64u2", "1x256t8", "2x64u2v", "1x256t8v", "1x64v", "1x64u2v"]
                .map(|v| Q8Shape::parse(v).expect("valid"));
            let runs = std::iter::once(("3 dispatches".to_string(), None))
                .chain(fused_shapes.map(|s| (format!("1 dispatch {s}"), Some(s))));
            for (label, fused) in runs {
                let secs = g.perf_group_q8(&x, &qkv, None, fused, 50).expect("qkv");
                println!(
                    "group {tn} q/k/v 6144x{k} [{label}, with quantize_q8]: {:.1} us, {:.1} GB/s",
                    secs * 1e6,
                    qkv_bytes / secs / 1e9
                );
            }
            let gu = [&ws[3], &ws[4]];
            let gu_bytes = (2 * 14336 * k / t.block_elems() * t.block_bytes()) as f64;
            let silu = Glu::Plain(Act::Silu);
            let secs = g.perf_group_q8(&x, &gu, Some(silu), None, 50).expect("gate/up");
            println!(
                "group {tn} gate/up+glu 2x14336x{k} [gate, up, glu, quantize_q8 + quantize_q8 of x]: {:.1} us, {:.1} GB/s",
                secs * 1e6,
                gu_bytes / secs / 1e9
            );
            for v in [
                "1x256t8",
                "2x128t8",
                "1x128t4",
                "4x64t8",
                "2x256t16",
                "1x256t8u2",
                "2x128t8u2",
                "1x64t2",
                "1x256t8u2v",
                "1x256t8v",
                "2x128t8u2v",
                "1x256t16u2v",
                "1x256t8pv",
                "2x128t8pv",
                "2x256t16v",
                "1x256t16v",
            ] {
                let shape = Q8Shape::parse(v).expect("valid");
                let secs = g.perf_group_q8(&x, &gu, Some(silu), Some(shape), 50).expect("glu");
                println!(
                    "group {tn} gate/up+glu 2x14336x{k} [1 dispatch {shape} + quantize_q8 of x]: {:.1} us, {:.1} GB/s",
                    secs * 1e6,
                    gu_bytes / secs / 1e9
                );
            }
        }
    }
}
