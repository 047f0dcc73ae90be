//! Every implemented architecture and variant of the reference fixtures, on the CPU in exact
//! mode: f32 against transformers at every position, f16/quantized against llama.cpp on the
//! dequantized file, greedy ids equal. Runs the full ../shared/fixtures set when present, else
//! the compact subset committed in tests/fixtures, and says which.

use models::refcheck::{check, fixture_root, format_row, list_cases};
use models::{LoadOptions, SUPPORTED_ARCHITECTURES};
use std::path::Path;

#[test]
fn fixtures_match_references() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (root, full) = fixture_root(&repo);
    println!("fixture set: {} ({})", root.display(), if full { "full shared set" } else { "compact committed subset" });
    let cases = list_cases(&root).expect("fixtures readable");
    assert!(!cases.is_empty(), "no fixtures found under {}", root.display());
    let mut failures = Vec::new();
    let mut ran = 0;
    for (arch, variant) in cases {
        let gguf_arch = models::refcheck::gguf_arch(&root, &arch).expect("ref.json readable");
        if !SUPPORTED_ARCHITECTURES.contains(&gguf_arch.as_str()) {
            continue;
        }
        // A directory whose GGUF architecture is supported must pass (mixtral is `llama`).
        let r = check(&root, &arch, &variant, &LoadOptions::default());
        println!("{}", format_row(&r));
        ran += 1;
        if !r.pass {
            failures.push(format_row(&r));
        }
    }
    println!("{ran} cases ran");
    assert!(failures.is_empty(), "failing fixtures:\n{}", failures.join("\n"));
}
