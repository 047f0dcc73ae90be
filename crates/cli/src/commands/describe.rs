//! `diskformer describe`: what a model is, from its files' headers.

use plan::{format_bytes, ModelDescription};

/// Arguments of `diskformer describe`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: super::load::ModelName,
    /// Print the description as JSON (the stable form of docs/PLAN.md).
    #[arg(long)]
    pub json: bool,
}

fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1} M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// The readable form.
pub fn print_text(d: &ModelDescription) {
    let opt = |o: Option<u64>, f: fn(u64) -> String| o.map_or("unknown".to_string(), f);
    println!("model         {} ({:?})", d.path.display(), d.source);
    let formats: Vec<&str> = d.formats.iter().map(|f| f.as_str()).collect();
    println!("formats       {}", formats.join(", "));
    println!(
        "architecture  {}{}",
        d.architecture.as_deref().unwrap_or("unknown"),
        d.hf_architecture.as_ref().map_or(String::new(), |a| format!(" ({a})"))
    );
    println!("task          {}", d.task.as_str());
    if !d.tags.is_empty() {
        println!("tags          {}", d.tags.join(", "));
    }
    println!("parameters    {} total, {} active", opt(d.params_total, count), opt(d.params_active, count));
    println!("context       {}", opt(d.context_length, |c| c.to_string()));
    let thinking = match &d.thinking {
        Some(t) => format!(
            "{} ({}) / {} ({}){}",
            t.open,
            t.open_id,
            t.close,
            t.close_id,
            if t.in_template { ", used by the template" } else { "" }
        ),
        None => "none".into(),
    };
    println!("chat template {}", if d.chat_template { "yes" } else { "no" });
    println!("think markers {thinking}");
    let types: Vec<String> = d
        .quant_types
        .iter()
        .map(|q| format!("{} x{} ({})", q.dtype, q.n_tensors, format_bytes(q.size_bytes)))
        .collect();
    println!("tensor types  {}", types.join(", "));
    if let Some(w) = &d.weights {
        println!(
            "weights       {} ({} in routed experts), KV cache {} per position{}",
            format_bytes(w.tensor_bytes),
            format_bytes(w.expert_bytes),
            format_bytes(w.kv_bytes_per_position),
            if w.recurrent_state_bytes > 0 {
                format!(", recurrent state {}", format_bytes(w.recurrent_state_bytes))
            } else {
                String::new()
            }
        );
    }
    println!("files         {} in {} files", format_bytes(d.total_size_bytes), d.files.len());
    for f in d.files.iter().take(20) {
        println!("  {:>10}  {}", format_bytes(f.size_bytes), f.path.display());
    }
    if d.files.len() > 20 {
        println!("  ... {} more", d.files.len() - 20);
    }
    println!("back ends");
    for r in &d.readers {
        match &r.reason {
            None => println!("  {:<10} can read it", r.backend),
            Some(why) => println!("  {:<10} no: {why}", r.backend),
        }
    }
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    let d = plan::describe(&store::resolve_model(args.model.name(), None)?)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print_text(&d);
    }
    Ok(())
}
