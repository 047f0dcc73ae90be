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
