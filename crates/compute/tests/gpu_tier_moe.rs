//! The GPU's decode MoE kernels (per (token, expert) pair: gate/up/GLU in one dispatch, down with
//! the router-weighted sum in another) against the CPU back end on random inputs, backend_ops
//! style (normalised MSE, Σ(gpu − cpu)² / Σcpu²), for resident stacked experts and for the GPU
//! expert tier's slot pool: odd widths, mixed gate/up/down types, ungated experts, biases,
//! gpt-oss's SwiGLU, tokens 1 to 4 (the per-pair kernels) and 6 (the grouped prefill path);
//! the tier with its pool cut into several buffers, with misses uploaded, computed on the CPU
//! (their pairs skipped by the kernels), chosen automatically, or read by the GPU from the host
//! tier (the pool refilled between steps), and with the router on the GPU.
//!
//! No adapter is a failure, unless `DISKFORMER_NO_GPU=1` says the machine has none. Needs the
//! `wgpu` feature (`cargo test -p compute --features wgpu --test gpu_tier_moe`).
#![cfg_attr(not(feature = "wgpu"), allow(unused))]

#[cfg(not(feature = "wgpu"))]
#[test]
fn gpu_tier_moe_needs_the_wgpu_feature() {
    println!("gpu_tier_moe: compute was built without the wgpu feature; run with --features wgpu");
}

#[cfg(feature = "wgpu")]
mod gpu_common;

#[cfg(feature = "wgpu")]
mod gpu {
    use crate::gpu_common::{gpu, rand_vec, seed, tensor, Report, WeightFile};
    use compute::cpu::{CpuBackend, CpuTensor};
    use compute::quant::{GgmlType, MatmulMode};
    use compute::spec::{Act, Gating, Glu, MoeSpec, RouteSpec};
    use compute::wgpu::{ExpertTierOptions, HostFill, MissPolicy, SlotPolicy, WgpuBackend, WgpuTensor};
    use compute::{Backend, ExpertStore, Experts, HostExpert, HostMatrix, HostWeight, OpError, Routing};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;

    /// Both sides compute in f32 from identically dequantized weights; only the order of the
    /// sums differs (the bound of llama.cpp's test-backend-ops, as backend_ops.rs uses).
    const MAX_NMSE: f64 = 1e-7;

    /// The int8-activation kernels against the exact CPU product: llama.cpp's test-backend-ops
    /// bound for quantized-activation products (x and h are each rounded to int8 blocks).
    const INT8_MAX_NMSE: f64 = 5e-4;

    /// One case: expert count, widths, types (gate `None`: ungated), activation, biases.
    #[derive(Clone, Copy, Debug)]
    struct Case {
        n_expert: usize,
        n_embd: usize,
        n_ff: usize,
        gate: Option<GgmlType>,
        up: GgmlType,
        down: GgmlType,
        glu: Glu,
        biases: bool,
        k: usize,
    }

    /// A layer's stacked experts (`gate` only when the case has one) quantized from uniform
    /// values in [-1, 1).
    fn expert_file(tag: &str, c: &Case, rng: &mut StdRng) -> WeightFile {
        let mut tensors = vec![
            ("up", c.up, vec![c.n_expert, c.n_ff, c.n_embd]),
            ("down", c.down, vec![c.n_expert, c.n_embd, c.n_ff]),
        ];
        if let Some(g) = c.gate {
            tensors.push(("gate", g, vec![c.n_expert, c.n_ff, c.n_embd]));
        }
        let specs: Vec<_> = tensors
            .into_iter()
            .map(|(name, t, shape)| {
                let n = shape.iter().product();
                (name.to_string(), t, shape, rand_vec(rng, n, 1.0))
            })
            .collect();
        WeightFile::new(&format!("gpu-tier-moe-{tag}"), &specs)
    }

    /// Lends experts of every layer from one file's stacked tensors (each layer the same
    /// weights), in the order asked, two at a time so the tier sees several groups.
    #[derive(Debug)]
    struct FileStore {
        gate: Option<HostWeight>,
        up: HostWeight,
        down: HostWeight,
        n_expert: usize,
    }

    impl FileStore {
        /// The experts of the file `build` made for `case`.
        fn of(case: &Case, b: &Built) -> FileStore {
            FileStore {
                gate: b.file.find("gate"),
                up: b.file.find("up").unwrap(),
                down: b.file.find("down").unwrap(),
                n_expert: case.n_expert,
            }
        }

        fn matrix<'a>(w: &'a HostWeight, e: usize, n_expert: usize) -> HostMatrix<'a> {
            let per = w.bytes().len() / n_expert;
            HostMatrix { dtype: w.dtype, bytes: &w.bytes()[e * per..(e + 1) * per], n_out: w.shape[1], k: w.shape[2] }
        }
    }

    impl ExpertStore for FileStore {
        fn with_host_experts(
            &self,
            _layer: usize,
            ids: &[u32],
            compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
        ) -> Result<(), OpError> {
            for group in ids.chunks(2) {
                let experts: Vec<HostExpert<'_>> = group
                    .iter()
                    .map(|&id| HostExpert {
                        id,
                        gate: self.gate.as_ref().map(|g| Self::matrix(g, id as usize, self.n_expert)),
                        up: Self::matrix(&self.up, id as usize, self.n_expert),
                        down: Self::matrix(&self.down, id as usize, self.n_expert),
                    })
                    .collect();
                compute(&experts)?;
            }
            Ok(())
        }
    }

    /// Distinct random ids per token.
    fn random_ids(rng: &mut StdRng, n_tok: usize, k: usize, n_expert: usize) -> Vec<u32> {
        let mut ids = Vec::new();
        for _ in 0..n_tok {
            let mut row: Vec<u32> = Vec::new();
            while row.len() < k {
                let e = rng.random_range(0..n_expert as u32);
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            ids.extend(row);
        }
        ids
    }

    fn cases() -> Vec<Case> {
        use GgmlType::*;
        vec![
            // Odd widths (9 and 7 groups of 8), float weights.
            Case {
                n_expert: 5,
                n_embd: 72,
                n_ff: 56,
                gate: Some(F16),
                up: F16,
                down: F32,
                glu: Glu::Plain(Act::Silu),
                biases: true,
                k: 3,
            },
            // A Q4_K_M-like mix: gate and up of different types, Q6_K down.
            Case {
                n_expert: 6,
                n_embd: 256,
                n_ff: 256,
                gate: Some(Q4_K),
                up: Q5_0,
                down: Q6_K,
                glu: Glu::Plain(Act::Silu),
                biases: false,
                k: 4,
            },
            // gpt-oss's SwiGLU with biases, widths of 3 and 5 blocks.
            Case {
                n_expert: 7,
                n_embd: 96,
                n_ff: 160,
                gate: Some(Q8_0),
                up: Q8_0,
                down: Q4_0,
                glu: Glu::SwiGluOai { alpha: 1.702, limit: 7.0 },
                biases: true,
                k: 2,
            },
            // Q4_0 throughout, rows of whole 256-value groups (the grouped GPU layout).
            Case {
                n_expert: 4,
                n_embd: 256,
                n_ff: 512,
                gate: Some(Q4_0),
                up: Q4_0,
                down: Q4_0,
                glu: Glu::Plain(Act::Silu),
                biases: false,
                k: 2,
            },
            // Ungated experts.
            Case {
                n_expert: 4,
                n_embd: 64,
                n_ff: 96,
                gate: None,
                up: Q4_1,
                down: Q8_0,
                glu: Glu::Plain(Act::Gelu),
                biases: true,
                k: 2,
            },
        ]
    }

    /// The int8 kernels' cases: the f32 cases (the float one falls back to the f32 kernels,
    /// the others take the int8 ones: whole 32-value blocks) and a Qwen3-MoE-like layer in Q4_K,
    /// top 8, rows over several workgroups of both kernels.
    fn int8_cases() -> Vec<Case> {
        let mut c = cases();
        c.push(Case {
            n_expert: 16,
            n_embd: 512,
            n_ff: 256,
            gate: Some(GgmlType::Q4_K),
            up: GgmlType::Q4_K,
            down: GgmlType::Q4_K,
            glu: Glu::Plain(Act::Silu),
            biases: false,
            k: 8,
        });
        c
    }

    struct Built {
        file: WeightFile,
        cpu: Experts<CpuBackend>,
        biases: [Option<CpuTensor>; 3],
        spec: MoeSpec,
    }

    /// Bytes of a pool slot for one of `case`'s experts.
    fn slot_bytes_of(case: &Case) -> u64 {
        let mut mats = vec![(case.up, case.n_ff, case.n_embd), (case.down, case.n_embd, case.n_ff)];
        mats.extend(case.gate.map(|t| (t, case.n_ff, case.n_embd)));
        compute::wgpu::expert_slot_bytes(&mats).unwrap()
    }

    fn build(c: &CpuBackend, case: &Case, tag: &str, rng: &mut StdRng) -> Built {
        let file = expert_file(tag, case, rng);
        let (ne, ff, ne_embd) = (case.n_expert, case.n_ff, case.n_embd);
        let biases = [
            (case.biases && case.gate.is_some()).then(|| tensor(rng, &[ne, ff], 0.5)),
            case.biases.then(|| tensor(rng, &[ne, ff], 0.5)),
            case.biases.then(|| tensor(rng, &[ne, ne_embd], 0.5)),
        ];
        let cpu = Experts::<CpuBackend> {
            layer: 0,
            gate: file.find("gate").map(|g| c.weight(&g).unwrap()),
            up: c.weight(&file.find("up").unwrap()).unwrap(),
            down: c.weight(&file.find("down").unwrap()).unwrap(),
            gate_bias: biases[0].clone(),
            up_bias: biases[1].clone(),
            down_bias: biases[2].clone(),
        };
        Built { file, cpu, biases, spec: MoeSpec { n_expert: ne, n_ff: ff, glu: case.glu } }
    }

    /// The second kernel case's layer for a test tagged `tag`: the CPU back end, the case, its
    /// weights, a pool slot's bytes and a store lending its experts.
    fn second_case(tag: &str, rng: &mut StdRng) -> (CpuBackend, Case, Built, u64, Arc<FileStore>) {
        let c = CpuBackend::new(MatmulMode::Exact);
        let case = cases()[1];
        let b = build(&c, &case, tag, rng);
        let slot_bytes = slot_bytes_of(&case);
        let store = Arc::new(FileStore::of(&case, &b));
        (c, case, b, slot_bytes, store)
    }

    /// One token's input and routing weights for experts `ids`, and the CPU's output for them
    /// (the reference).
    fn one_token(c: &CpuBackend, case: &Case, b: &Built, ids: &[u32], rng: &mut StdRng) -> [CpuTensor; 3] {
        let x = tensor(rng, &[1, case.n_embd], 1.0);
        let weights = tensor(rng, &[1, case.k], 1.0);
        let routing = Routing::<CpuBackend> { ids: ids.to_vec(), weights: weights.clone(), k: case.k };
        let want = c.moe_ffn(&x, &routing, &b.cpu, &b.spec).unwrap();
        [x, weights, want]
    }

    fn gpu_experts(g: &WgpuBackend, b: &Built, layer: usize) -> Result<Experts<WgpuBackend>, OpError> {
        let up = |t: &Option<CpuTensor>| t.as_ref().map(|t| g.from_host(&t.data, &t.shape)).transpose();
        Ok(Experts {
            layer,
            gate: b.file.find("gate").map(|w| g.weight(&w)).transpose()?,
            up: g.weight(&b.file.find("up").unwrap())?,
            down: g.weight(&b.file.find("down").unwrap())?,
            gate_bias: up(&b.biases[0])?,
            up_bias: up(&b.biases[1])?,
            down_bias: up(&b.biases[2])?,
        })
    }

    fn run_gpu(
        g: &WgpuBackend,
        e: &Experts<WgpuBackend>,
        x: &CpuTensor,
        ids: &[u32],
        weights: &CpuTensor,
        k: usize,
        spec: &MoeSpec,
    ) -> Result<Vec<f32>, OpError> {
        let routing =
            Routing::<WgpuBackend> { ids: ids.to_vec(), weights: g.from_host(&weights.data, &weights.shape)?, k };
        let y: WgpuTensor = g.moe_ffn(&g.from_host(&x.data, &x.shape)?, &routing, e, spec)?;
        g.to_host(&y)
    }

    /// `moe_ffn` on ids the GPU router leaves on the GPU (softmax over `logits`, top `k`,
    /// normalised): the output and the routing read back, for the CPU's reference.
    fn run_gpu_routed(
        g: &WgpuBackend,
        e: &Experts<WgpuBackend>,
        x: &CpuTensor,
        logits: &CpuTensor,
        k: usize,
        spec: &MoeSpec,
    ) -> Result<(Vec<f32>, Routing<CpuBackend>), OpError> {
        let route = RouteSpec {
            k,
            gating: Gating::Softmax,
            has_selection_bias: false,
            groups: None,
            normalize: true,
            scale: 1.0,
        };
        // The input uploaded before the routing, as in a model's layer (the norm before the
        // router): the route is then the last command recorded before `moe_ffn`, which the
        // split fuses its hand-over into (`fuse_route_signal`; an upload between them kept this
        // test off that path).
        let xg = g.from_host(&x.data, &x.shape)?;
        let routing = g.route(&g.from_host(&logits.data, &logits.shape)?, None, &route)?;
        let y: WgpuTensor = g.moe_ffn(&xg, &routing, e, spec)?;
        let weights = CpuTensor { shape: vec![x.shape[0], k], data: g.to_host(&routing.weights)? };
        Ok((g.to_host(&y)?, Routing { ids: g.routing_ids(&routing)?, weights, k }))
    }

    #[test]
    fn moe_kernels_match_cpu_resident() {
        let Some(g) = gpu("gpu_tier_moe") else { return };
        resident_cases(&g, &cases(), "resident", MAX_NMSE);
    }

    /// The int8-activation kernels (`MatmulMode::QuantizedActivations`, what `run` and `bench`
    /// use) on resident experts, the ids from the host and from the GPU router; float types and
    /// widths that are not whole 32-value blocks fall back to the f32 kernels.
    #[test]
    fn moe_int8_kernels_match_cpu_resident() {
        let Some(g) = gpu("gpu_tier_moe") else { return };
        let g = g.with_matmul_mode(MatmulMode::QuantizedActivations);
        resident_cases(&g, &int8_cases(), "int8 resident", INT8_MAX_NMSE);
        // A prefill batch: the grouped path gives each expert its tokens, past one dispatch's 64
        // pairs for the 4-expert case (about 70 tokens each).
        let batch: Vec<Case> = int8_cases().into_iter().filter(|c| c.n_expert <= 6).collect();
        resident_tokens(&g, &batch, "int8 prefill", INT8_MAX_NMSE, &[140]);
        // Routed on the GPU: the kernels read the ids where the router left them.
        let seed = seed();
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        let c = CpuBackend::new(MatmulMode::Exact);
        let mut r = Report { failures: Vec::new(), ran: 0 };
        for (i, case) in int8_cases().iter().enumerate() {
            let b = build(&c, case, &format!("int8-routed{i}"), &mut rng);
            let ge = gpu_experts(&g, &b, 0).expect("experts on the GPU");
            for n_tok in [1usize, 3] {
                let x = tensor(&mut rng, &[n_tok, case.n_embd], 1.0);
                let logits = tensor(&mut rng, &[n_tok, case.n_expert], 3.0);
                // The GPU's output and its routing, which the CPU reference then takes.
                let got = run_gpu_routed(&g, &ge, &x, &logits, case.k, &b.spec);
                let case_name = format!("int8 gpu-routed {case:?} tokens={n_tok}");
                match got {
                    Ok((y, routing)) => {
                        let want = c.moe_ffn(&x, &routing, &b.cpu, &b.spec).unwrap();
                        r.check(&case_name, Ok(y), &want.data, INT8_MAX_NMSE);
                    }
                    Err(e) => r.check(&case_name, Err(e), &[], INT8_MAX_NMSE),
                }
            }
        }
        r.finish();
    }

    fn resident_cases(g: &WgpuBackend, cases: &[Case], what: &str, bound: f64) {
        resident_tokens(g, cases, what, bound, &[1, 2, 4, 6]);
    }

    fn resident_tokens(g: &WgpuBackend, cases: &[Case], what: &str, bound: f64, n_toks: &[usize]) {
        let seed = seed();
        println!("seed: {seed} (DISKFORMER_SEED={seed} repeats this run)");
        let mut rng = StdRng::seed_from_u64(seed);
        let c = CpuBackend::new(MatmulMode::Exact);
        let mut r = Report { failures: Vec::new(), ran: 0 };
        for (i, case) in cases.iter().enumerate() {
            let b = build(&c, case, &format!("{}{i}", what.replace(' ', "-")), &mut rng);
            let ge = gpu_experts(g, &b, 0).expect("experts on the GPU");
            for &n_tok in n_toks {
                let x = tensor(&mut rng, &[n_tok, case.n_embd], 1.0);
                let ids = random_ids(&mut rng, n_tok, case.k, case.n_expert);
                let weights = tensor(&mut rng, &[n_tok, case.k], 1.0);
                let routing = Routing::<CpuBackend> { ids: ids.clone(), weights: weights.clone(), k: case.k };
                let want = c.moe_ffn(&x, &routing, &b.cpu, &b.spec).unwrap();
                let got = run_gpu(g, &ge, &x, &ids, &weights, case.k, &b.spec);
                r.check(&format!("{what} {case:?} tokens={n_tok}"), got, &want.data, bound);
            }
        }
        r.finish();
    }

    #[test]
    fn moe_kernels_match_cpu_through_the_tier() {
        let Some(g0) = gpu("gpu_tier_moe") else { return };
        tier_cases(&g0, &cases(), "tier", MAX_NMSE);
    }

    /// The int8-activation kernels through the tier: pool slots, and (host tier) the kernels'
    /// copies that read host memory.
    #[test]
    fn moe_int8_kernels_match_cpu_through_the_tier() {
        let Some(g0) = gpu("gpu_tier_moe") else { return };
        tier_cases(&g0.with_matmul_mode(MatmulMode::QuantizedActivations), &int8_cases(), "int8 tier", INT8_MAX_NMSE);
    }

    fn tier_cases(g0: &WgpuBackend, cases: &[Case], what: &str, bound: f64) {
        let seed = seed();
        println!("seed: {seed} (DISKFORMER_SEED={seed} repeats this run)");
        let mut rng = StdRng::seed_from_u64(seed);
        let c = CpuBackend::new(MatmulMode::Exact);
        let mut r = Report { failures: Vec::new(), ran: 0 };
        for (i, case) in cases.iter().enumerate() {
            let b = build(&c, case, &format!("{}{i}", what.replace(' ', "-")), &mut rng);
            let store = Arc::new(FileStore::of(case, &b));
            let slot_bytes = slot_bytes_of(case);
            // Two pool buffers of k + 1 slots: three layers share them, so every step evicts.
            for miss in [MissPolicy::Upload, MissPolicy::Cpu, MissPolicy::Auto, MissPolicy::Host, MissPolicy::Split] {
                let opts = ExpertTierOptions {
                    miss,
                    policy: SlotPolicy::Lru,
                    max_slots_per_buffer: Some(case.k + 1),
                    ..ExpertTierOptions::new(2 * (case.k + 1), slot_bytes)
                };
                let g = match g0.clone().with_expert_store(store.clone(), opts) {
                    Ok(g) => g,
                    Err(e) => {
                        r.check(&format!("{what} {case:?} {miss:?}"), Err(e), &[], bound);
                        continue;
                    }
                };
                let layers: Vec<_> = (0..3).map(|l| gpu_experts(&g, &b, l).expect("experts on the GPU")).collect();
                // Steps 4 and 5 are routed on the GPU (the ids stay there: the split partitions
                // its misses on the GPU then, `moe_split_partition.wgsl`, and the host must find
                // the same CPU share).
                for step in 0..6 {
                    for (l, ge) in layers.iter().enumerate() {
                        let n_tok = [1usize, 1, 3, 6, 1, 2][step];
                        let x = tensor(&mut rng, &[n_tok, case.n_embd], 1.0);
                        let name = format!("{what} {case:?} {miss:?} step {step} layer {l} tokens={n_tok}");
                        if step >= 4 {
                            let logits = tensor(&mut rng, &[n_tok, case.n_expert], 3.0);
                            match run_gpu_routed(&g, ge, &x, &logits, case.k, &b.spec) {
                                Ok((y, routing)) => {
                                    let want = c.moe_ffn(&x, &routing, &b.cpu, &b.spec).unwrap();
                                    r.check(&name, Ok(y), &want.data, bound);
                                }
                                Err(e) => r.check(&name, Err(e), &[], bound),
                            }
                            continue;
                        }
                        let ids = random_ids(&mut rng, n_tok, case.k, case.n_expert);
                        let weights = tensor(&mut rng, &[n_tok, case.k], 1.0);
                        let routing = Routing::<CpuBackend> { ids: ids.clone(), weights: weights.clone(), k: case.k };
                        let want = c.moe_ffn(&x, &routing, &b.cpu, &b.spec).unwrap();
                        let got = run_gpu(&g, ge, &x, &ids, &weights, case.k, &b.spec);
                        r.check(&name, got, &want.data, bound);
                    }
                }
                let total = g.expert_tier_total().unwrap();
                println!("  {miss:?}: {total:?}");
                // Every miss is served once: uploaded or computed on the CPU, or (host tier) read
                // by the GPU from host memory (its refill into the pool coming between steps),
                // or uploaded by a prefill batch.
                // Only upload and host must evict: auto picks by costs measured on this machine,
                // and a fast CPU may serve every miss without filling the pool.
                let served = match miss {
                    // Decode misses read from host memory, prefill misses uploaded.
                    MissPolicy::Host => total.host_reads + total.uploads - total.refills,
                    // Decode misses read from host memory or computed on the CPU.
                    MissPolicy::Split => total.host_reads + total.cpu_computed + total.uploads - total.refills,
                    _ => total.uploads + total.cpu_computed,
                };
                if served != total.misses {
                    r.failures.push(format!("{what} {case:?} {miss:?}: misses not all served ({total:?})"));
                }
                if matches!(miss, MissPolicy::Upload | MissPolicy::Host | MissPolicy::Split) && total.evictions == 0 {
                    r.failures.push(format!("{what} {case:?} {miss:?}: no eviction ({total:?})"));
                }
            }
        }
        r.finish();
    }

    /// A host tier with `prefill_per_layer` fills the pool at each layer's first call: that
    /// call's picks among the prefilled experts are already hits (none without the prefill),
    /// and the output is the CPU's.
    #[test]
    fn a_prefilled_pool_hits_from_the_first_call() {
        let Some(g0) = gpu("gpu_tier_moe") else { return };
        let mut rng = StdRng::seed_from_u64(seed());
        let (c, case, b, slot_bytes, store) = second_case("prefill", &mut rng);
        // Half the layer's experts prefilled (ids below `half`: no history yet), the picks
        // spanning both halves.
        let half = case.n_expert / 2;
        let ids: Vec<u32> = (0..case.k as u32).map(|j| if j % 2 == 0 { j / 2 } else { half as u32 + j / 2 }).collect();
        let (in_pool, out) = (ids.iter().filter(|&&e| (e as usize) < half).count() as u64, ids.len() as u64);
        let [x, weights, want] = one_token(&c, &case, &b, &ids, &mut rng);
        let mut r = Report { failures: Vec::new(), ran: 0 };
        for (prefill, hits) in [(half, in_pool), (0, 0)] {
            let opts = ExpertTierOptions {
                miss: MissPolicy::Host,
                prefill_per_layer: prefill,
                ..ExpertTierOptions::new(case.n_expert, slot_bytes)
            };
            let g = g0.clone().with_expert_store(store.clone(), opts).expect("tier");
            let e = gpu_experts(&g, &b, 0).expect("experts on the GPU");
            let got = run_gpu(&g, &e, &x, &ids, &weights, case.k, &b.spec);
            r.check(&format!("prefill {prefill}"), got, &want.data, MAX_NMSE);
            let total = g.expert_tier_total().unwrap();
            assert_eq!((total.hits, total.selections), (hits, out), "prefill {prefill}: {total:?}");
            assert_eq!(total.prefilled, prefill as u64, "prefill {prefill}: the pool's share copied at once");
            assert_eq!(total.uploads, 0, "prefill {prefill}: the prefill is not among the uploads");
        }
        r.finish();
    }

    /// A prompt's batch ranks the pool by how many of its tokens chose each expert: a batch of
    /// 32 tokens, each choosing one of four popular experts and one of twelve others, then
    /// decode tokens choosing two of the popular four. The batch's last uploads leave the
    /// others in the pool's four slots, but its LFU scores rank the popular experts far above
    /// them, so each decode miss on one replaces an other at the next step, and from the
    /// fourth decode token on every pick is pooled. (Scored one per call, as before, the batch
    /// left all sixteen alike: 1 hit in the 12 picks of six decode tokens.) The outputs are
    /// the CPU's throughout.
    #[test]
    fn a_prompt_batch_ranks_the_pool_by_its_tokens() {
        let Some(g0) = gpu("gpu_tier_moe") else { return };
        let mut rng = StdRng::seed_from_u64(seed());
        let c = CpuBackend::new(MatmulMode::Exact);
        let case = Case { n_expert: 16, k: 2, ..cases()[1] };
        let b = build(&c, &case, "prompt batch", &mut rng);
        let store = Arc::new(FileStore::of(&case, &b));
        let (n_popular, n_slots) = (4u32, 4);
        let opts = ExpertTierOptions {
            miss: MissPolicy::Host,
            policy: SlotPolicy::Lfu,
            ..ExpertTierOptions::new(n_slots, slot_bytes_of(&case))
        };
        let g = g0.with_expert_store(store, opts).expect("tier");
        let e = gpu_experts(&g, &b, 0).expect("experts on the GPU");
        let mut r = Report { failures: Vec::new(), ran: 0 };
        let mut run = |name: String, ids: Vec<u32>, n_tok: usize, rng: &mut StdRng| -> u64 {
            let x = tensor(rng, &[n_tok, case.n_embd], 1.0);
            let weights = tensor(rng, &[n_tok, case.k], 1.0);
            let routing = Routing::<CpuBackend> { ids: ids.clone(), weights: weights.clone(), k: case.k };
            let want = c.moe_ffn(&x, &routing, &b.cpu, &b.spec).unwrap();
            r.check(&name, run_gpu(&g, &e, &x, &ids, &weights, case.k, &b.spec), &want.data, MAX_NMSE);
            g.expert_tier_total().unwrap().hits
        };
        let prompt: Vec<u32> = (0..32u32).flat_map(|t| [t % n_popular, n_popular + t % 12]).collect();
        let mut hits = vec![run("prompt".into(), prompt, 32, &mut rng)];
        for t in 0..6 {
            hits.push(run(format!("decode {t}"), vec![t % n_popular, (t + 1) % n_popular], 1, &mut rng));
        }
        r.finish();
        let per_token: Vec<u64> = hits.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(
            per_token[3..].iter().all(|&h| h == 2) && per_token.iter().sum::<u64>() >= 6,
            "decode hits per token {per_token:?}: want both picks pooled from the fourth token on ({:?})",
            g.expert_tier_total()
        );
    }

    /// A layer's host copy, made each way ([`HostFill`]: imported pages the fill wrote, the
    /// driver's mapped memory, wgpu's buffers through the staging ring), computes what the CPU
    /// does; the tier counts it, wgpu's allocator holds only the id log beside a staged copy,
    /// and a RAM budget one byte short of the copy is an error naming the numbers.
    #[test]
    fn host_copies_however_made_within_the_ram_budget() {
        let Some(g0) = gpu("gpu_tier_moe") else { return };
        let mut rng = StdRng::seed_from_u64(seed());
        let (c, case, b, slot_bytes, store) = second_case("host fill", &mut rng);
        let per_layer = case.n_expert as u64 * slot_bytes;
        let ids: Vec<u32> = (0..case.k as u32).collect();
        let [x, weights, want] = one_token(&c, &case, &b, &ids, &mut rng);
        // On Vulkan every way is offered (lavapipe and NVIDIA both import host memory); other
        // APIs have only wgpu's own buffers.
        let vulkan = g0.adapter().api == "Vulkan";
        for fill in [HostFill::Import, HostFill::Mapped, HostFill::Staged] {
            let mut r = Report { failures: Vec::new(), ran: 0 };
            let opts = |budget| ExpertTierOptions {
                miss: MissPolicy::Host,
                host_budget_bytes: budget,
                host_fill: fill,
                ..ExpertTierOptions::new(case.n_expert, slot_bytes)
            };
            let g = g0.clone().with_expert_store(store.clone(), opts(Some(per_layer + (64 << 10)))).expect("tier");
            let e = gpu_experts(&g, &b, 0).expect("experts on the GPU");
            let got = run_gpu(&g, &e, &x, &ids, &weights, case.k, &b.spec);
            r.check(&format!("host copy, {fill:?}"), got, &want.data, MAX_NMSE);
            let made = if vulkan { fill } else { HostFill::Staged };
            assert_eq!(g.expert_host_tier_fills(), vec![Some(made)], "the layer's copy, asked {fill:?}");
            // The tier counts the copy and the id log; wgpu's allocator's figures hold only
            // wgpu's own buffers: the log, and a staged copy (its size rounded up).
            let log = g.expert_host_tier_bytes().unwrap() - per_layer;
            assert!(log < 64 << 10, "{log} bytes of id log ({fill:?})");
            let allocator = g.expert_host_tier_allocator_bytes().unwrap();
            let copy_in_allocator = allocator - log;
            match made {
                HostFill::Staged => assert!((per_layer..per_layer + 256).contains(&copy_in_allocator), "{allocator}"),
                _ => assert_eq!(copy_in_allocator, 0, "the copy is outside wgpu's allocator ({fill:?})"),
            }
            r.finish();

            let g = g0.clone().with_expert_store(store.clone(), opts(Some(per_layer - 1))).expect("tier");
            let e = gpu_experts(&g, &b, 0).expect("experts on the GPU");
            let err = run_gpu(&g, &e, &x, &ids, &weights, case.k, &b.spec).expect_err("a budget short of one layer");
            let why = err.to_string();
            assert!(why.contains(&format!("{}", per_layer - 1)) && why.contains(&format!("{per_layer}")), "{why}");
        }
    }

    /// Commands one decode token's MoE layer submits after the router's product: the routing
    /// kernel and the two per-pair kernels on resident experts (no readback, no upload); the
    /// tier adds the readback of the ids and weights when every expert is a hit, the tier
    /// reading misses from host memory the copy of the ids into its log (no wait). Before the
    /// per-pair kernels: ~6 dispatches and 2 uploads per selected expert plus the routing's
    /// readback and upload (~40 at top-8).
    #[test]
    fn decode_commands_per_moe_layer() {
        let Some(g0) = gpu("gpu_tier_moe") else { return };
        let mut rng = StdRng::seed_from_u64(seed());
        let c = CpuBackend::new(MatmulMode::Exact);
        let case = cases()[1];
        let b = build(&c, &case, "commands", &mut rng);
        let spec = RouteSpec {
            k: case.k,
            gating: Gating::Softmax,
            has_selection_bias: false,
            groups: None,
            normalize: true,
            scale: 1.0,
        };
        let slot_bytes = slot_bytes_of(&case);
        let store = Arc::new(FileStore::of(&case, &b));
        let opts = ExpertTierOptions { miss: MissPolicy::Upload, ..ExpertTierOptions::new(case.n_expert, slot_bytes) };
        let tiered = g0.clone().with_expert_store(store.clone(), opts.clone()).expect("tier");
        let host =
            g0.clone().with_expert_store(store, ExpertTierOptions { miss: MissPolicy::Host, ..opts }).expect("tier");
        for (name, g, most) in
            [("resident", &g0, 3u64), ("tier, all hits", &tiered, 4), ("tier reading host memory, all hits", &host, 4)]
        {
            let e = gpu_experts(g, &b, 0).expect("experts on the GPU");
            let x = tensor(&mut rng, &[1, case.n_embd], 1.0);
            let logits = tensor(&mut rng, &[1, case.n_expert], 3.0);
            let (gx, gl) = (g.from_host(&x.data, &x.shape).unwrap(), g.from_host(&logits.data, &logits.shape).unwrap());
            let step = || -> Result<(), OpError> {
                let routing = g.route(&gl, None, &spec)?;
                let y: WgpuTensor = g.moe_ffn(&gx, &routing, &e, &b.spec)?;
                g.sync();
                drop(y);
                Ok(())
            };
            // The first step fills the tier's pool (the host tier's between the first and the
            // second); the third is all hits.
            step().expect("first step");
            step().expect("second step");
            let before = g.commands_submitted();
            step().expect("third step");
            let n = g.commands_submitted() - before;
            println!("{name}: {n} commands per decode MoE layer after the router's product");
            assert!(n <= most, "{name}: {n} commands, expected at most {most}");
        }
    }

    /// Under the split miss mode the CPU's share is computed while the host records on: when
    /// the store fails it (here: every read but the host copy's fill), the next readback returns
    /// the store's error instead of a result missing those experts.
    #[test]
    fn a_failed_cpu_share_is_an_error_not_a_result() {
        #[derive(Debug)]
        struct FailingStore(FileStore);
        impl ExpertStore for FailingStore {
            fn with_host_experts(
                &self,
                layer: usize,
                ids: &[u32],
                compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
            ) -> Result<(), OpError> {
                if ids.len() < self.0.n_expert {
                    return Err(OpError::Unsupported {
                        op: "test store",
                        backend: "cpu",
                        why: "disk unplugged".into(),
                    });
                }
                self.0.with_host_experts(layer, ids, compute)
            }
        }
        let Some(g0) = gpu("gpu_tier_moe") else { return };
        let mut rng = StdRng::seed_from_u64(seed());
        let c = CpuBackend::new(MatmulMode::QuantizedActivations);
        let case = cases()[1];
        let b = build(&c, &case, "failing", &mut rng);
        let slot_bytes = slot_bytes_of(&case);
        let store = Arc::new(FailingStore(FileStore::of(&case, &b)));
        let opts = ExpertTierOptions { miss: MissPolicy::Split, ..ExpertTierOptions::new(1, slot_bytes) };
        let g = g0.with_matmul_mode(MatmulMode::QuantizedActivations).with_expert_store(store, opts).expect("tier");
        let e = gpu_experts(&g, &b, 0).expect("experts on the GPU");
        let x = tensor(&mut rng, &[1, case.n_embd], 1.0);
        let ids = random_ids(&mut rng, 1, case.k, case.n_expert);
        let weights = tensor(&mut rng, &[1, case.k], 1.0);
        // The pool is empty: every pick misses, and the CPU takes half of them.
        let got = run_gpu(&g, &e, &x, &ids, &weights, case.k, &b.spec);
        match got {
            Err(e) => assert!(e.to_string().contains("disk unplugged"), "{e}"),
            Ok(v) => panic!("a result ({} values) where the CPU's experts failed", v.len()),
        }
        assert!(g.expert_tier_total().unwrap().cpu_computed > 0, "the CPU was given a share");

        // Routed on the GPU, a decode call's split goes through the mailboxes on a Vulkan GPU
        // unless DISKFORMER_SPLIT_MAILBOX=0 (not lavapipe, see split.rs), where the GPU waits for
        // the CPU's sum instead of the host joining the job: the failed job still releases the
        // GPU, and the readback of the output returns its error. Elsewhere the same call takes
        // the readback path, with the same outcome.
        let logits = tensor(&mut rng, &[1, case.n_expert], 3.0);
        let before = g.split_mailbox_layers();
        match run_gpu_routed(&g, &e, &x, &logits, case.k, &b.spec) {
            Err(e) => assert!(e.to_string().contains("disk unplugged"), "{e}"),
            Ok((v, _)) => panic!("a result ({} values) where the CPU's experts failed (GPU-routed)", v.len()),
        }
        let mailboxes = std::env::var("DISKFORMER_SPLIT_MAILBOX").map_or(true, |v| v.trim() != "0");
        if mailboxes && g.adapter().api == "Vulkan" && g.adapter().device_type != "Cpu" {
            assert_eq!(g.split_mailbox_layers(), before + 1, "the GPU-routed call went through the mailboxes");
        }
        // And the next call runs: nothing is left waiting.
        let ok_store_ids = random_ids(&mut rng, 1, case.k, case.n_expert);
        let _ = run_gpu(&g, &e, &x, &ok_store_ids, &weights, case.k, &b.spec);
    }

    /// The router on the GPU against the CPU's, on every gating, with and without the
    /// selection bias and groups; with ids compared exactly.
    #[test]
    fn route_matches_cpu() {
        let Some(g) = gpu("gpu_tier_moe") else { return };
        let seed = seed();
        println!("seed: {seed} (DISKFORMER_SEED={seed} repeats this run)");
        let mut rng = StdRng::seed_from_u64(seed);
        let c = CpuBackend::new(MatmulMode::Exact);
        let mut r = Report { failures: Vec::new(), ran: 0 };
        let specs = [
            (
                RouteSpec {
                    k: 8,
                    gating: Gating::Softmax,
                    has_selection_bias: false,
                    groups: None,
                    normalize: true,
                    scale: 1.0,
                },
                128,
                false,
            ),
            (
                RouteSpec {
                    k: 2,
                    gating: Gating::Softmax,
                    has_selection_bias: false,
                    groups: None,
                    normalize: false,
                    scale: 1.0,
                },
                8,
                false,
            ),
            (
                RouteSpec {
                    k: 4,
                    gating: Gating::SoftmaxAfterTopK,
                    has_selection_bias: false,
                    groups: None,
                    normalize: false,
                    scale: 1.0,
                },
                32,
                false,
            ),
            (
                RouteSpec {
                    k: 6,
                    gating: Gating::Sigmoid,
                    has_selection_bias: true,
                    groups: None,
                    normalize: true,
                    scale: 2.5,
                },
                60,
                true,
            ),
            (
                RouteSpec {
                    k: 8,
                    gating: Gating::Sigmoid,
                    has_selection_bias: true,
                    groups: Some((8, 4)),
                    normalize: true,
                    scale: 2.5,
                },
                256,
                true,
            ),
            (
                RouteSpec {
                    k: 3,
                    gating: Gating::Softmax,
                    has_selection_bias: false,
                    groups: None,
                    normalize: true,
                    scale: 1.0,
                },
                37,
                false,
            ),
        ];
        for (spec, n_expert, with_bias) in specs {
            for n_tok in [1usize, 3] {
                let logits = tensor(&mut rng, &[n_tok, n_expert], 3.0);
                let bias = tensor(&mut rng, &[n_expert], 0.5);
                let want = c.route(&logits, with_bias.then_some(&bias), &spec).unwrap();
                let got = (|| -> Result<(Vec<u32>, Vec<f32>), OpError> {
                    let gb = g.from_host(&bias.data, &bias.shape)?;
                    let gr = g.route(&g.from_host(&logits.data, &logits.shape)?, with_bias.then_some(&gb), &spec)?;
                    Ok((g.routing_ids(&gr)?, g.to_host(&gr.weights)?))
                })();
                let case = format!("route {spec:?} experts={n_expert} tokens={n_tok}");
                match &got {
                    Ok((ids, _)) if ids != &want.ids => {
                        println!("{case} ids: FAIL got {ids:?}, cpu {:?}", want.ids);
                        r.failures.push(format!("{case}: ids differ"));
                    }
                    _ => {}
                }
                r.check(&case, got.map(|g| g.1), &want.weights.data, MAX_NMSE);
            }
        }
        r.finish();
    }
}
