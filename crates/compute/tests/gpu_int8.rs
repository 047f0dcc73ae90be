//! The int8-activation kernels that compute several products in one dispatch, against the CPU:
//! the multi-weight kernel (q/k/v of one type: `Backend::matmul_many`), the GLU kernel (gate, up
//! and the GLU: `Backend::matmul_glu`) with the int8 blocks of its result read by the down
//! projection, every workgroup shape the tests compile (`Q8Shape::TESTED`), every type with an
//! int8 dot product (the single-weight kernel too), odd row counts and widths of one block past a
//! multiple of 64.
//!
//! References: the CPU product of the activations rounded as the GPU rounds them (per 32 values
//! d = max|x| / 127, round to even), bounded by f32 summation noise, and the exact CPU product,
//! bounded by llama.cpp's tolerance for quantized-activation products (5e-4 normalised MSE).
//! Dispatch counts come from `commands_submitted` (exact on any adapter).
//!
//! Needs the `wgpu` feature; no adapter is a failure unless `DISKFORMER_NO_GPU=1`.
#![cfg_attr(not(feature = "wgpu"), allow(unused))]

#[cfg(not(feature = "wgpu"))]
#[test]
fn gpu_int8_needs_the_wgpu_feature() {
    println!("gpu_int8: compute was built without the wgpu feature; run with --features wgpu");
}

#[cfg(feature = "wgpu")]
mod gpu_common;

#[cfg(feature = "wgpu")]
mod int8 {
    use crate::gpu_common::{gpu, rand_vec, seed, tensor, Report, WeightFile};
    use compute::cpu::{CpuBackend, CpuTensor};
    use compute::quant::{GgmlType, MatmulMode};
    use compute::spec::{Act, Glu};
    use compute::wgpu::{Q8Shape, WgpuBackend, WgpuTensor, WgpuWeight};
    use compute::{Backend, HostWeight};
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    /// f32 summation noise plus a rare value rounding the other way at a tie of round(x / d).
    const ROUNDED_MAX_NMSE: f64 = 1e-6;
    /// llama.cpp's test-backend-ops bound for quantized-activation products.
    const EXACT_MAX_NMSE: f64 = 5e-4;

    const INT8_TYPES: [GgmlType; 12] = [
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
    ];

    /// Weights quantized from uniform values in [-1, 1): `tensors` are (name, type, [rows, k]).
    fn weight_file(tag: &str, rng: &mut StdRng, tensors: &[(String, GgmlType, [usize; 2])]) -> WeightFile {
        let specs: Vec<_> = tensors
            .iter()
            .map(|(name, t, [rows, k])| (name.clone(), *t, vec![*rows, *k], rand_vec(rng, rows * k, 1.0)))
            .collect();
        WeightFile::new(&format!("gpu-int8-{tag}"), &specs)
    }

    fn type_name(t: GgmlType) -> String {
        format!("{t}").to_lowercase()
    }

    /// The activations as the int8 kernels see them (llama.cpp's quantize_row_q8_0 rounding).
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

    fn up(g: &WgpuBackend, t: &CpuTensor) -> WgpuTensor {
        g.from_host(&t.data, &t.shape).expect("upload")
    }

    /// Row counts and width for a type: odd counts, a multiple of 32 rows (the GLU's, whole int8
    /// blocks), and for 32-value types a width of one block past a multiple of 64.
    fn shapes(t: GgmlType) -> ([usize; 3], usize) {
        if t.block_elems() == 32 {
            ([37, 19, 64], 160)
        } else {
            // The GLU result is the down projection's row: whole 256-value blocks.
            ([37, 19, 256], 512)
        }
    }

    /// Commands recorded by `f` (submitted by the `sync` after it).
    fn commands<T>(g: &WgpuBackend, f: impl FnOnce() -> T) -> (T, u64) {
        g.sync();
        let before = g.commands_submitted();
        let out = f();
        g.sync();
        (out, g.commands_submitted() - before)
    }

    /// The GPU with int8 activations, the exact CPU, a seeded generator (printed) and a report;
    /// `None` (said why) when there is no adapter the tests may skip or int8 activations are off.
    fn setup() -> Option<(WgpuBackend, CpuBackend, StdRng, Report)> {
        let g = gpu("gpu_int8")?;
        let g8 = g.with_matmul_mode(MatmulMode::QuantizedActivations);
        if !g8.uses_int8_activations() {
            println!("gpu_int8: not run: DISKFORMER_GPU_F32_ACT=1 keeps f32 activations");
            return None;
        }
        let seed = seed();
        println!("seed: {seed} (DISKFORMER_SEED={seed} repeats this run)");
        let c = CpuBackend::new(MatmulMode::Exact);
        Some((g8, c, StdRng::seed_from_u64(seed), Report { failures: Vec::new(), ran: 0 }))
    }

    #[test]
    fn multi_weight_and_glu_kernels_match_cpu() {
        let Some((g8, c, mut rng, mut r)) = setup() else { return };
        for t in INT8_TYPES {
            type_cases(&g8, &c, t, shapes(t), &mut rng, &mut r);
        }
        // Q4_0 rows of whole 256-value groups take the grouped GPU layout (layout.rs), with its
        // own dot products (4-byte and 16-byte loads).
        type_cases(&g8, &c, GgmlType::Q4_0, ([37, 19, 256], 512), &mut rng, &mut r);
        mixed_cases(&g8, &c, &mut rng, &mut r);
        r.finish();
    }

    /// Prefill products (from `TILED_MIN_TOKENS` tokens) with int8 activations: the int8 tiled
    /// kernel for grouped Q4_0 and ggml's Q4_K layouts (`matmul_tiled_q8.wgsl`), the f32 tiled
    /// kernel for the others (Q6_K here, and the layouts scripts/test.sh's second pass selects); token and row counts past a tile, the accumulating product, and the
    /// per-head products (a column window of x per head), against the CPU product of x rounded as
    /// the GPU rounds it (of x itself for the f32 kernel).
    #[test]
    fn prefill_products_match_cpu() {
        let Some((g8, c, mut rng, mut r)) = setup() else { return };
        for (t, rows, k, n_tok) in [
            (GgmlType::Q4_0, 100, 512, 37),
            (GgmlType::Q4_0, 64, 256, 70),
            (GgmlType::Q4_K, 100, 768, 37),
            (GgmlType::Q4_K, 130, 256, 9),
            (GgmlType::Q6_K, 70, 256, 37),
        ] {
            let tn = type_name(t);
            let file = weight_file(&format!("prefill-{tn}-{rows}-{k}"), &mut rng, &[(format!("w_{tn}"), t, [rows, k])]);
            let (cw, gw) = (file.get(&format!("w_{tn}")), g8.weight(&file.get(&format!("w_{tn}"))).expect("upload"));
            let x = tensor(&mut rng, &[n_tok, k], 1.0);
            // The f32 tiled kernel (Q6_K, and the other layouts DISKFORMER_Q4_0_LAYOUT /
            // DISKFORMER_Q4_K_LAYOUT select) reads x as it is.
            let xr = if g8.takes_int8_prefill(&gw) { q8_rounded(&x) } else { x.clone() };
            // With the default layouts (and nothing switching the kernel off) Q4_0 and Q4_K must
            // take the int8 kernel, Q6_K never.
            let defaults = [
                "DISKFORMER_Q4_0_LAYOUT",
                "DISKFORMER_Q4_K_LAYOUT",
                "DISKFORMER_NO_INT8_PREFILL",
                "DISKFORMER_NO_TILED",
            ]
            .iter()
            .all(|v| std::env::var(v).is_err());
            if defaults || t == GgmlType::Q6_K {
                let case = format!("prefill {tn}: the int8 tiled kernel applies");
                r.exact(&case, Ok(g8.takes_int8_prefill(&gw)), &(t != GgmlType::Q6_K));
            }
            let gx = up(&g8, &x);
            let want = c.matmul(&xr, &cw).expect("cpu");
            let case = format!("prefill matmul({tn}, {rows}x{k}, {n_tok} tokens)");
            r.check(&case, g8.matmul(&gx, &gw).and_then(|y| g8.to_host(&y)), &want.data, ROUNDED_MAX_NMSE);
            let res = tensor(&mut rng, &[n_tok, rows], 1.0);
            let want_add: Vec<f32> = res.data.iter().zip(&want.data).map(|(a, b)| a + b).collect();
            let got = g8.matmul_add(&gx, &gw, up(&g8, &res)).and_then(|y| g8.to_host(&y));
            r.check(&format!("{case} + residual"), got, &want_add, ROUNDED_MAX_NMSE);
        }
        // Per-head products: x [n, 2 * k], w [2, n_out, k] (DeepSeek's absorbed MLA).
        for t in [GgmlType::Q4_0, GgmlType::Q4_K] {
            let tn = type_name(t);
            let (n_head, n_out, k, n_tok) = (2usize, 40usize, 256usize, 21usize);
            let specs =
                vec![(format!("h_{tn}"), t, vec![n_head, n_out, k], rand_vec(&mut rng, n_head * n_out * k, 1.0))];
            let file = WeightFile::new(&format!("gpu-int8-prefill-heads-{tn}"), &specs);
            let (cw, gw) = (file.get(&specs[0].0), g8.weight(&file.get(&specs[0].0)).expect("upload"));
            let x = tensor(&mut rng, &[n_tok, n_head * k], 1.0);
            let xr = if g8.takes_int8_prefill(&gw) { q8_rounded(&x) } else { x.clone() };
            let want = c.matmul_per_head(&xr, &cw).expect("cpu");
            let got = g8.matmul_per_head(&up(&g8, &x), &gw).and_then(|y| g8.to_host(&y));
            r.check(
                &format!("prefill matmul_per_head({tn}, {n_head}x{n_out}x{k}, {n_tok} tokens)"),
                got,
                &want.data,
                ROUNDED_MAX_NMSE,
            );
        }
        r.finish();
    }

    /// One type: the multi-weight kernel for 2 and 3 weights and the GLU kernel with every
    /// tested shape, then the `Backend` entries with their dispatch counts.
    fn type_cases(
        g: &WgpuBackend,
        c: &CpuBackend,
        t: GgmlType,
        (rows, k): ([usize; 3], usize),
        rng: &mut StdRng,
        r: &mut Report,
    ) {
        let tn = type_name(t);
        let names = ["w0", "w1", "w2", "gate", "up", "down"];
        let dims = [[rows[0], k], [rows[1], k], [rows[2], k], [rows[2], k], [rows[2], k], [37, rows[2]]];
        let tensors: Vec<_> = names.iter().zip(dims).map(|(n, d)| (n.to_string(), t, d)).collect();
        let file = weight_file(&format!("{tn}-{k}"), rng, &tensors);
        let hw: Vec<HostWeight> = names.iter().map(|n| file.get(n)).collect();
        let cw: Vec<_> = hw.iter().map(|w| c.weight(w).expect("cpu weight")).collect();
        let gw: Vec<WgpuWeight> = match hw.iter().map(|w| g.weight(w)).collect() {
            Ok(w) => w,
            Err(e) => return r.check(&format!("weights({tn})"), Err(e), &[], 0.0),
        };
        let x = tensor(rng, &[1, k], 1.0);
        let xr = q8_rounded(&x);
        let gx = up(g, &x);
        let exact: Vec<_> = cw.iter().take(3).map(|w| c.matmul(&x, w).expect("cpu")).collect();
        let rounded: Vec<_> = cw.iter().take(3).map(|w| c.matmul(&xr, w).expect("cpu")).collect();
        let glus = [
            ("silu", Glu::Plain(Act::Silu)),
            ("gelu_tanh", Glu::Plain(Act::GeluTanh)),
            ("swiglu_oai", Glu::SwiGluOai { alpha: 1.702, limit: 7.0 }),
        ];
        // Every shape for the benchmarks' types, a classic and a row-slot one for the others (each
        // shape is a pipeline per type, and lavapipe compiles each in LLVM).
        let all_shapes = [GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q6_K].contains(&t);
        let mut shapes = if all_shapes {
            Q8Shape::TESTED.to_vec()
        } else {
            vec![Q8Shape::TESTED[1], Q8Shape::TESTED[3], Q8Shape::TESTED[8]]
        };
        // Persistent shapes need subgroups; a device without them must refuse them.
        shapes.retain(|s| !s.persistent || g.uses_subgroups());
        if !g.uses_subgroups() {
            let refused = g.matvec_q8_with_shape(&gx, &gw[0], Q8Shape::TESTED[8]).is_err();
            r.exact(&format!("matvec_q8({tn}, persistent) refused without subgroups"), Ok(refused), &true);
        }
        for shape in shapes {
            let case = format!("matvec_q8({tn}, {}x{k}, {shape})", rows[0]);
            match g.matvec_q8_with_shape(&gx, &gw[0], shape).and_then(|y| g.to_host(&y)) {
                Ok(v) => {
                    r.check(&format!("{case} vs exact"), Ok(v.clone()), &exact[0].data, EXACT_MAX_NMSE);
                    r.check(&format!("{case} vs rounded x"), Ok(v), &rounded[0].data, ROUNDED_MAX_NMSE);
                }
                Err(e) => r.check(&case, Err(e), &[], 0.0),
            }
            for n in [2usize, 3] {
                let ws: Vec<&WgpuWeight> = gw.iter().take(n).collect();
                let case = format!("matmul_many_q8({tn}, {n} weights {rows:?}x{k}, {shape})");
                match g.matmul_many_q8_with_shape(&gx, &ws, shape) {
                    Ok(ys) => {
                        for (i, y) in ys.iter().enumerate() {
                            let got = g.to_host(y);
                            if let Ok(v) = &got {
                                r.check(
                                    &format!("{case} w{i} vs exact"),
                                    Ok(v.clone()),
                                    &exact[i].data,
                                    EXACT_MAX_NMSE,
                                );
                            }
                            r.check(&format!("{case} w{i} vs rounded x"), got, &rounded[i].data, ROUNDED_MAX_NMSE);
                        }
                    }
                    Err(e) => r.check(&case, Err(e), &[], 0.0),
                }
            }
            for (gn, glu) in glus {
                if shape.persistent {
                    // The GLU kernel has no persistent form: its epilogue quantizes whole blocks.
                    let case = format!("matmul_glu_q8({tn}, {gn}, {shape}) refused");
                    let refused = g.matmul_glu_q8_with_shape(&gx, &gw[3], &gw[4], glu, shape).is_err();
                    r.exact(&case, Ok(refused), &true);
                    continue;
                }
                let want = glu_ref(c, &xr, &cw[3], &cw[4], glu);
                let case = format!("matmul_glu_q8({tn}, {gn}, {}x{k}, {shape})", rows[2]);
                let got = g.matmul_glu_q8_with_shape(&gx, &gw[3], &gw[4], glu, shape).and_then(|h| g.to_host(&h));
                r.check(&case, got, &want.data, ROUNDED_MAX_NMSE);
            }
        }
        // The back end's entries: q/k/v in one dispatch after one quantization.
        let (ys, n_cmds) = commands(g, || g.matmul_many(&gx, [&gw[0], &gw[1], &gw[2]]));
        r.exact(&format!("matmul_many({tn}, 3 weights) commands"), Ok(n_cmds), &2);
        match ys {
            Ok(ys) => {
                for (i, y) in ys.iter().enumerate() {
                    let case = format!("matmul_many({tn}, 3 weights) w{i}");
                    r.check(&case, g.to_host(y), &rounded[i].data, ROUNDED_MAX_NMSE);
                }
            }
            Err(e) => r.check(&format!("matmul_many({tn}, 3 weights)"), Err(e), &[], 0.0),
        }
        // gate/up/GLU then the down projection: quantize x, the GLU kernel (which writes the int8
        // blocks of its result), the down product reading them: three commands where the op-by-op
        // graph records six (quantize, gate, up, glu, quantize, down).
        let glu = Glu::Plain(Act::Silu);
        let h_ref = glu_ref(c, &xr, &cw[3], &cw[4], glu);
        let h_exact = glu_ref(c, &x, &cw[3], &cw[4], glu);
        let down_exact = c.matmul(&h_exact, &cw[5]).expect("cpu");
        let (out, n_cmds) = commands(g, || {
            let h = g.matmul_glu(&gx, &gw[3], &gw[4], glu)?;
            let y = g.matmul(&h, &gw[5])?;
            Ok::<_, compute::OpError>((h, y))
        });
        r.exact(&format!("matmul_glu + down({tn}) commands"), Ok(n_cmds), &3);
        match out {
            Ok((h, y)) => {
                let h_got = g.to_host(&h);
                let down_ref = down_of_rounded(c, &h_got, &h_ref, &cw[5]);
                r.check(&format!("matmul_glu({tn})"), h_got, &h_ref.data, ROUNDED_MAX_NMSE);
                let got = g.to_host(&y);
                if let Ok(v) = &got {
                    r.check(
                        &format!("down after matmul_glu({tn}) vs exact"),
                        Ok(v.clone()),
                        &down_exact.data,
                        4.0 * EXACT_MAX_NMSE,
                    );
                }
                r.check(&format!("down after matmul_glu({tn}) vs rounded h"), got, &down_ref.data, ROUNDED_MAX_NMSE);
            }
            Err(e) => r.check(&format!("matmul_glu + down({tn})"), Err(e), &[], 0.0),
        }
    }

    /// The down product's reference, `q8(h) · Dᵀ`, for the `h` the GPU's GLU kernel computed
    /// (`h_ref`'s where it failed). The down kernel reads the int8 blocks of that h, so its
    /// reference rounds it: rounding the CPU's h instead flips a value that sits on a rounding
    /// boundary whenever the adapter's f32 sums differ in the last bit (CI's lavapipe did, nmse
    /// 5.7e-6 against 1e-6); the GLU's own tolerance is checked apart.
    fn down_of_rounded(
        c: &CpuBackend,
        h_got: &Result<Vec<f32>, compute::OpError>,
        h_ref: &CpuTensor,
        down: &HostWeight,
    ) -> CpuTensor {
        let h = match h_got {
            Ok(v) => CpuTensor { shape: h_ref.shape.clone(), data: v.clone() },
            Err(_) => h_ref.clone(),
        };
        c.matmul(&q8_rounded(&h), down).expect("cpu")
    }

    /// glu(x · Gᵀ, x · Uᵀ) on the CPU.
    fn glu_ref(c: &CpuBackend, x: &CpuTensor, gate: &HostWeight, upw: &HostWeight, glu: Glu) -> CpuTensor {
        let gv = c.matmul(x, gate).expect("cpu");
        let uv = c.matmul(x, upw).expect("cpu");
        c.glu(&gv, &uv, glu).expect("cpu")
    }

    /// Mixed types in one multi-weight dispatch, and what the fused entries do when one kernel
    /// cannot serve all weights: a type without an int8 kernel (one quantization, one product
    /// each), gate and up of different lengths, a GLU result that is not
    /// whole 32-value blocks (no int8 blocks written: the down projection quantizes it), several
    /// tokens (exact kernels); and the cached blocks of a GLU result while other activations are
    /// quantized in between, everything recorded before one readback.
    fn mixed_cases(g: &WgpuBackend, c: &CpuBackend, rng: &mut StdRng, r: &mut Report) {
        let k = 256;
        let tensors = vec![
            ("q".to_string(), GgmlType::Q4_0, [37, k]),
            ("k".to_string(), GgmlType::Q6_K, [19, k]),
            ("v".to_string(), GgmlType::Q4_0, [19, k]),
            ("v16".to_string(), GgmlType::F16, [19, k]),
            ("gate".to_string(), GgmlType::Q4_K, [37, k]),
            ("up".to_string(), GgmlType::Q4_K, [37, k]),
            ("up64".to_string(), GgmlType::Q4_K, [64, k]),
            ("gate64".to_string(), GgmlType::Q4_K, [64, k]),
            ("down".to_string(), GgmlType::Q8_0, [29, 64]),
        ];
        let file = weight_file("mixed", rng, &tensors);
        let get = |n: &str| {
            let h = file.get(n);
            (c.weight(&h).expect("cpu weight"), g.weight(&h).expect("gpu weight"))
        };
        let [(cq, gq), (ck, gk), (cv, gv), (cv16, gv16), (cg, gg), (cu, gu), (cu64, gu64), (cg64, gg64), (cd, gd)] =
            ["q", "k", "v", "v16", "gate", "up", "up64", "gate64", "down"].map(get);
        let x = tensor(rng, &[1, k], 1.0);
        let xr = q8_rounded(&x);
        let gx = up(g, &x);

        // Mixed int8 types (a Q4_K_M file's v is often Q6_K): still one dispatch, every shape.
        let (ys, n_cmds) = commands(g, || g.matmul_many(&gx, [&gq, &gk, &gv]));
        r.exact("matmul_many(q4_0, q6_k, q4_0) commands", Ok(n_cmds), &2);
        let wants = [&cq, &ck, &cv].map(|w| c.matmul(&xr, w).expect("cpu"));
        match ys {
            Ok(ys) => {
                for ((y, want), name) in ys.iter().zip(&wants).zip(["q", "k", "v"]) {
                    r.check(&format!("matmul_many(mixed types) {name}"), g.to_host(y), &want.data, ROUNDED_MAX_NMSE);
                }
            }
            Err(e) => r.check("matmul_many(mixed types)", Err(e), &[], 0.0),
        }
        for shape in Q8Shape::TESTED.into_iter().filter(|s| !s.persistent || g.uses_subgroups()) {
            match g.matmul_many_q8_with_shape(&gx, &[&gk, &gq, &gv], shape) {
                Ok(ys) => {
                    for ((y, want), name) in ys.iter().zip([&wants[1], &wants[0], &wants[2]]).zip(["k", "q", "v"]) {
                        let case = format!("matmul_many_q8(q6_k, q4_0, q4_0, {shape}) {name}");
                        r.check(&case, g.to_host(y), &want.data, ROUNDED_MAX_NMSE);
                    }
                }
                Err(e) => r.check(&format!("matmul_many_q8(mixed types, {shape})"), Err(e), &[], 0.0),
            }
        }
        // A type without an int8 kernel: one quantization for the two that have one, f32 for F16.
        let (ys, n_cmds) = commands(g, || g.matmul_many(&gx, [&gq, &gv16, &gv]));
        r.exact("matmul_many(q4_0, f16, q4_0) commands", Ok(n_cmds), &4);
        match ys {
            Ok(ys) => {
                let want16 = c.matmul(&x, &cv16).expect("cpu");
                r.check("matmul_many(q4_0, f16, q4_0) q", g.to_host(&ys[0]), &wants[0].data, ROUNDED_MAX_NMSE);
                r.check("matmul_many(q4_0, f16, q4_0) f16", g.to_host(&ys[1]), &want16.data, 1e-7);
                r.check("matmul_many(q4_0, f16, q4_0) v", g.to_host(&ys[2]), &wants[2].data, ROUNDED_MAX_NMSE);
            }
            Err(e) => r.check("matmul_many(q4_0, f16, q4_0)", Err(e), &[], 0.0),
        }

        let glu = Glu::Plain(Act::Silu);
        let refused = g.matmul_glu(&gx, &gg, &gu64, glu).is_err();
        r.exact("matmul_glu(gate 37 rows, up 64) refused", Ok(refused), &true);

        // 37 rows: the GLU kernel runs but writes no int8 blocks; the down projection quantizes.
        let x37 = tensor(rng, &[1, k], 1.0);
        let want_h = glu_ref(c, &q8_rounded(&x37), &cg, &cu, glu);
        let got = g.matmul_glu(&up(g, &x37), &gg, &gu, glu).and_then(|h| g.to_host(&h));
        r.check("matmul_glu(q4_k, 37 rows)", got, &want_h.data, ROUNDED_MAX_NMSE);

        // Several tokens: the exact kernels and the glu kernel.
        let x3 = tensor(rng, &[3, k], 1.0);
        let want = glu_ref(c, &x3, &cg, &cu, glu);
        let got = g.matmul_glu(&up(g, &x3), &gg, &gu, glu).and_then(|h| g.to_host(&h));
        r.check("matmul_glu(q4_k, 3 tokens, exact)", got, &want.data, 1e-7);

        // Recorded before one readback: h = glu(x2); another activation's products (its own
        // quantization into the other pair); h's down projection (h's cached blocks); a second
        // GLU whose input blocks are h's pair's neighbour; its down projection.
        let x2 = tensor(rng, &[1, k], 1.0);
        let x4 = tensor(rng, &[1, k], 1.0);
        let h_refs = [&x2, &x4].map(|x| glu_ref(c, &q8_rounded(x), &cg64, &cu64, glu));
        let recorded = (|| {
            let (gx2, gx4) = (up(g, &x2), up(g, &x4));
            let h = g.matmul_glu(&gx2, &gg64, &gu64, glu)?;
            let other = g.matmul(&gx4, &gq)?;
            let down_h = g.matmul(&h, &gd)?;
            let h2 = g.matmul_glu(&gx4, &gg64, &gu64, glu)?;
            let down_h2 = g.matmul(&h2, &gd)?;
            Ok::<_, compute::OpError>([other, down_h, down_h2, h, h2])
        })();
        match recorded {
            Ok([other, down_h, down_h2, h, h2]) => {
                let want = c.matmul(&q8_rounded(&x4), &cq).expect("cpu");
                r.check("cached GLU blocks, other activations", g.to_host(&other), &want.data, ROUNDED_MAX_NMSE);
                // Each down product against the rounding of the h its GLU kernel computed
                // (`down_of_rounded`).
                for ((y, h, h_ref), name) in
                    [(down_h, h, &h_refs[0]), (down_h2, h2, &h_refs[1])].into_iter().zip(["h", "h2"])
                {
                    let h_got = g.to_host(&h);
                    let want = down_of_rounded(c, &h_got, h_ref, &cd);
                    r.check(&format!("cached GLU blocks, {name}"), h_got, &h_ref.data, ROUNDED_MAX_NMSE);
                    r.check(&format!("cached GLU blocks, down({name})"), g.to_host(&y), &want.data, ROUNDED_MAX_NMSE);
                }
            }
            Err(e) => r.check("cached GLU blocks", Err(e), &[], 0.0),
        }
    }
}
