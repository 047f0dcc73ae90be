//! Times `Tokenizer::encode` on a text file: `cargo run --release -p tokenizer --example encode_file
//! -- MODEL.gguf TEXT_FILE [--no-parse-special]`. Prints tokens, seconds and MB/s.

use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        return Err("usage: encode_file MODEL.gguf TEXT_FILE [--no-parse-special]".into());
    }
    let parse_special = !args.iter().any(|a| a == "--no-parse-special");
    let model = gguf::GgufModel::open(&args[1])?;
    let start = Instant::now();
    let tokenizer = tokenizer::Tokenizer::from_gguf(model.metadata())?;
    let load_secs = start.elapsed().as_secs_f64();
    let text = std::fs::read_to_string(&args[2])?;
    let start = Instant::now();
    let ids = tokenizer.encode(&text, true, parse_special)?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "load {load_secs:.3} s; {} bytes -> {} tokens in {secs:.3} s ({:.1} MB/s)",
        text.len(),
        ids.len(),
        text.len() as f64 / secs / 1e6
    );
    Ok(())
}
