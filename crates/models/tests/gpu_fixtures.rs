//! Every implemented fixture architecture and variant on the wgpu back end: the same reference
//! checks as tests/fixtures.rs (f32 against transformers at every position, f16/quantized
//! against llama.cpp on the dequantized file), plus greedy ids identical to the CPU back end's.
//!
//! No adapter is a failure, unless `DISKFORMER_NO_GPU=1` says the machine has none (CI runs this
//! on Mesa's lavapipe). The variants run are f32 and q8_0 of the full set (lavapipe is slow), every one of the compact subset; `DISKFORMER_GPU_VARIANTS=all` runs every variant, `=f32,q4_k_m` a list.
//!
//! Needs the `gpu` feature (`cargo test --all-features`); without it one test says so.

#[cfg(not(feature = "gpu"))]
#[test]
fn gpu_fixtures_need_the_gpu_feature() {
    println!(
        "gpu_fixtures: models was built without the gpu feature; run with --features gpu (CI uses --all-features)"
    );
}

#[cfg(feature = "gpu")]
mod on_gpu {
    use compute::wgpu::{WgpuBackend, WgpuOptions};
    use models::refcheck::{check_with, fixture_root, format_row, gguf_arch, greedy, list_cases};
    use models::{load, load_on, LoadOptions, SUPPORTED_ARCHITECTURES};
    use std::path::Path;
    use std::sync::Arc;

    fn gpu() -> Option<WgpuBackend> {
        let index = std::env::var("DISKFORMER_GPU").ok().and_then(|v| v.parse().ok());
        match WgpuBackend::new(WgpuOptions { adapter_index: index, prefer_discrete: true }) {
            Ok(b) => {
                println!("adapter: {} ({}, {})", b.adapter().name, b.adapter().api, b.adapter().device_type);
                Some(b)
            }
            Err(e) if std::env::var("DISKFORMER_NO_GPU").is_ok_and(|v| v == "1") => {
                println!("gpu fixtures: not run: DISKFORMER_NO_GPU=1 and no adapter ({e})");
                None
            }
            Err(e) => panic!("{e}\n(set DISKFORMER_NO_GPU=1 only on a machine that has no GPU or software Vulkan)"),
        }
    }

    #[test]
    fn gpu_fixtures_match_references_and_cpu() {
        let Some(gpu) = gpu() else { return };
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let (root, full) = fixture_root(&repo);
        println!(
            "fixture set: {} ({})",
            root.display(),
            if full { "full shared set" } else { "compact committed subset" }
        );
        let only: Option<Vec<String>> = match std::env::var("DISKFORMER_GPU_VARIANTS").as_deref() {
            Ok("all") => None,
            Ok(list) => Some(list.split(',').map(str::to_string).collect()),
            // The compact committed subset has one small variant per arch: run it whole.
            Err(_) if !full => None,
            Err(_) => Some(vec!["f32".to_string(), "q8_0".to_string()]),
        };
        match &only {
            Some(o) => println!("variants: {o:?} (DISKFORMER_GPU_VARIANTS=all runs every variant)"),
            None => println!("variants: all"),
        }

        let cases = list_cases(&root).expect("fixtures readable");
        assert!(!cases.is_empty(), "no fixtures found under {}", root.display());
        let opts = LoadOptions::default();
        let mut failures = Vec::new();
        let mut ran = 0;
        for (arch, variant) in cases {
            let ga = gguf_arch(&root, &arch).expect("ref.json readable");
            if !SUPPORTED_ARCHITECTURES.contains(&ga.as_str()) || only.as_ref().is_some_and(|o| !o.contains(&variant)) {
                continue;
            }
            ran += 1;
            let r = check_with(&root, &arch, &variant, |m| load_on(gpu.clone(), m, &opts));
            println!("{} (wgpu)", format_row(&r));
            if !r.pass {
                failures.push(format_row(&r));
            }
            // Greedy ids against the CPU back end on the same file.
            match greedy_pair(&gpu, &root.join(&arch), &variant, &opts) {
                Ok((g, c)) if g == c => println!("| {arch} | {variant} | greedy wgpu == cpu ({} ids) | ok |", g.len()),
                Ok((g, c)) => {
                    let row = format!("| {arch} | {variant} | greedy wgpu {g:?} != cpu {c:?} | FAIL |");
                    println!("{row}");
                    failures.push(row);
                }
                Err(e) => {
                    let row = format!("| {arch} | {variant} | greedy: ERROR {e} |");
                    println!("{row}");
                    failures.push(row);
                }
            }
        }
        println!("{ran} cases ran on wgpu");
        assert!(ran > 0, "no fixture case ran");
        assert!(failures.is_empty(), "failing fixtures on wgpu:\n{}", failures.join("\n"));
    }

    /// GPU commands (dispatches and copies) of one decode token per dense llama layer: the
    /// difference between a 2-layer and a 4-layer synthetic model (so the embedding, output and
    /// readback do not count), against the budget of the fused graph. Exact mode: attention norm,
    /// q, k, v, attention (rope, cache write and attention in one), o (+residual), FFN norm, gate,
    /// up, glu, down (+residual): 11. Int8 activations: attention norm (writing its int8 blocks),
    /// q/k/v in one, attention (writing the output's blocks), o (+residual), FFN norm (blocks),
    /// gate/up/GLU in one (blocks), down (+residual): 7, no quantize dispatch. Greedy ids of the
    /// 4-layer model on the GPU (exact mode) must equal the CPU's.
    #[test]
    fn decode_commands_per_dense_layer() {
        use compute::quant::MatmulMode;
        use models::synth::{SynthOptions, SynthPlan, SynthShape};
        use models::Outputs;
        let Some(gpu) = gpu() else { return };
        let int8 = gpu.clone().with_matmul_mode(MatmulMode::QuantizedActivations).uses_int8_activations();
        let dir = std::env::temp_dir().join(format!("diskformer-gpu-commands-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let opts = LoadOptions::default();
        // [mode][model]: commands of one decode step.
        let mut per_token = [[0u64; 2]; 2];
        let mut bind_group_misses = Vec::new();
        for (mi, n_layer) in [2usize, 4].into_iter().enumerate() {
            let mut shape = SynthShape::minimal("llama").expect("llama synth shape");
            shape.apply_params(&format!("n_layer={n_layer}")).expect("n_layer");
            let plan = SynthPlan::new(
                &shape,
                &SynthOptions { dtype: gguf::GgmlType::Q4_0, seed: 5, ..SynthOptions::default() },
                "commands",
            )
            .expect("synth plan");
            let path = dir.join(format!("llama-{n_layer}.gguf"));
            plan.write_file(&path, &mut |_| {}).expect("write synth model");
            let model = Arc::new(gguf::GgufModel::open(&path).expect("open synth model"));
            for (bi, mode) in [MatmulMode::Exact, MatmulMode::QuantizedActivations].into_iter().enumerate() {
                // A back end of its own: the rope tables of an earlier model at the same
                // positions would spare this one an upload.
                let b =
                    WgpuBackend::new(WgpuOptions { adapter_index: gpu.adapter().index.into(), prefer_discrete: true })
                        .expect("second back end on the same adapter")
                        .with_matmul_mode(mode);
                let mut g = load_on(b.clone(), &model, &opts).expect("load on gpu");
                let prompt = [1u32, 17, 33, 250, 9];
                g.eval(&prompt, Outputs::Last).expect("prefill");
                g.eval(&[42], Outputs::Last).expect("first decode step");
                let before = b.commands_submitted();
                g.eval(&[43], Outputs::Last).expect("decode step");
                per_token[bi][mi] = b.commands_submitted() - before;
                // Steady state: a step repeats the previous one's buffers and parameter offsets,
                // so every bind group comes from the cache.
                let created = b.bind_groups_created();
                for id in [44, 45, 46] {
                    g.eval(&[id], Outputs::Last).expect("decode step");
                }
                let misses = b.bind_groups_created() - created;
                println!("{n_layer} layers, {mode:?}: {misses} bind groups created in 3 steady decode steps");
                if misses > 0 {
                    bind_group_misses.push(format!("{n_layer} layers, {mode:?}: {misses} bind groups created"));
                }
                if n_layer == 4 && bi == 0 {
                    let mut c = load(&model, &opts).expect("load on cpu");
                    let gi = greedy(g.as_mut(), &prompt, 6).expect("greedy gpu");
                    let ci = greedy(c.as_mut(), &prompt, 6).expect("greedy cpu");
                    assert_eq!(gi, ci, "greedy ids of the 4-layer synthetic llama: wgpu vs cpu");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        let budgets = [("exact", 11.0), ("int8 activations", if int8 { 7.0 } else { 11.0 })];
        let mut over = Vec::new();
        for ((mode, budget), counts) in budgets.into_iter().zip(per_token) {
            let per_layer = (counts[1] - counts[0]) as f64 / 2.0;
            println!(
                "decode commands ({mode}): {} per token with 2 layers, {} with 4: {per_layer} per dense layer",
                counts[0], counts[1]
            );
            if per_layer > budget {
                over.push(format!("{mode}: {per_layer} GPU commands per dense layer, over the budget {budget}"));
            }
        }
        assert!(over.is_empty(), "{}", over.join("\n"));
        assert!(bind_group_misses.is_empty(), "steady decode steps: {}", bind_group_misses.join("; "));
    }

    /// Host work of decode steps, for `valgrind --tool=callgrind --toggle-collect='*decode_steps*'`
    /// (instruction counts are reproducible on a busy machine, timings are not): a 4-layer
    /// synthetic llama, prefill, two warm-up steps, then `DISKFORMER_HOST_STEPS` (default 8) decode
    /// steps; a run with 0 steps gives the rest to subtract. Compare `DISKFORMER_NO_FUSE=1` with the
    /// default; `DISKFORMER_PROFILE_INT8=1` uses int8 activations.
    #[test]
    #[ignore]
    fn decode_host_work() {
        use compute::quant::MatmulMode;
        use models::synth::{SynthOptions, SynthPlan, SynthShape};
        use models::Outputs;
        let Some(gpu) = gpu() else { return };
        let mode = match std::env::var("DISKFORMER_PROFILE_INT8").as_deref() {
            Ok("1") => MatmulMode::QuantizedActivations,
            _ => MatmulMode::Exact,
        };
        let gpu = gpu.with_matmul_mode(mode);
        let path = std::env::temp_dir().join(format!("diskformer-gpu-host-work-{}.gguf", std::process::id()));
        let mut shape = SynthShape::minimal("llama").expect("llama synth shape");
        shape.apply_params("n_layer=4").expect("n_layer");
        let plan = SynthPlan::new(
            &shape,
            &SynthOptions { dtype: gguf::GgmlType::Q4_0, seed: 5, ..SynthOptions::default() },
            "host-work",
        )
        .expect("synth plan");
        plan.write_file(&path, &mut |_| {}).expect("write synth model");
        let model = Arc::new(gguf::GgufModel::open(&path).expect("open synth model"));
        let mut g = load_on(gpu.clone(), &model, &LoadOptions::default()).expect("load on gpu");
        g.eval(&[1, 17, 33, 250, 9], Outputs::Last).expect("prefill");
        // Two steps first, so every pipeline exists and the bind groups are cached as in a long run.
        decode_steps(g.as_mut(), 2);
        let n_steps = std::env::var("DISKFORMER_HOST_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
        let before = gpu.commands_submitted();
        decode_steps(g.as_mut(), n_steps);
        println!("{} commands in {n_steps} decode steps ({mode:?})", gpu.commands_submitted() - before);
        let _ = std::fs::remove_file(&path);
    }

    #[inline(never)]
    fn decode_steps(g: &mut dyn models::Runner, n: usize) {
        for i in 0..n {
            std::hint::black_box(g.eval(&[40 + i as u32], models::Outputs::Last).expect("decode step"));
        }
    }

    /// Greedy continuations of the fixture prompt on the GPU and on the CPU.
    fn greedy_pair(
        gpu: &WgpuBackend,
        dir: &Path,
        variant: &str,
        opts: &LoadOptions,
    ) -> Result<(Vec<u32>, Vec<u32>), String> {
        let r: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("ref.json"))
                .map_err(|e| e.to_string())?
                .replace("Infinity", "1e308")
                .replace("NaN", "null"),
        )
        .map_err(|e| e.to_string())?;
        let file = dir.join(r["llama_cpp"][variant]["file"].as_str().ok_or("ref.json names no file")?);
        let prompt: Vec<u32> = r["prompt"]["ids"]
            .as_array()
            .ok_or("no prompt ids")?
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect();
        let model = Arc::new(gguf::GgufModel::open(&file).map_err(|e| e.to_string())?);
        let n = 8;
        let mut g = load_on(gpu.clone(), &model, opts).map_err(|e| e.to_string())?;
        let mut c = load(&model, opts).map_err(|e| e.to_string())?;
        let gi = greedy(g.as_mut(), &prompt, n).map_err(|e| e.to_string())?;
        let ci = greedy(c.as_mut(), &prompt, n).map_err(|e| e.to_string())?;
        Ok((gi, ci))
    }
}
