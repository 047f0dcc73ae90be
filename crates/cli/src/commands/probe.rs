//! `diskformer probe`: the machine as the planner sees it.

use plan::{format_bytes, Machine, ProbeOptions};
use std::path::PathBuf;

/// Arguments of `diskformer probe`.
#[derive(clap::Args)]
pub struct Args {
    /// Folders whose free disk to report (default: the current folder and the model store).
    #[arg(long = "disk")]
    pub disks: Vec<PathBuf>,
    /// Skip measuring RAM and GPU bandwidths (about a second); use the table of measured
    /// devices instead.
    #[arg(long)]
    pub no_measure: bool,
    /// Print JSON (the stable form of docs/PLAN.md).
    #[arg(long)]
    pub json: bool,
}

fn rate(bw: Option<f64>, source: Option<plan::Source>) -> String {
    match (bw, source) {
        (Some(b), Some(s)) => format!("{:.1} GB/s ({})", b / 1e9, s.as_str()),
        _ => "unknown".into(),
    }
}

/// The readable form.
pub fn print_text(m: &Machine) {
    let c = &m.cpu;
    println!(
        "cpu     {} ({}), {} logical cores{}",
        c.model.as_deref().unwrap_or("unknown"),
        c.arch,
        c.cores_logical,
        c.cores_physical.map_or(String::new(), |p| format!(", {p} physical"))
    );
    println!("simd    {}", if c.simd.is_empty() { "none detected".into() } else { c.simd.join(" ") });
    let mem = &m.memory;
    let b = |o: Option<u64>| o.map_or("unknown".to_string(), format_bytes);
    println!(
        "ram     {} total, {} available{}, read {}",
        b(mem.total_bytes),
        b(mem.available_bytes),
        mem.cgroup_limit_bytes.map_or(String::new(), |l| format!(" (cgroup limit {})", format_bytes(l))),
        rate(mem.bandwidth_bytes_per_s, mem.bandwidth_source)
    );
    for d in &m.disks {
        println!(
            "disk    {}: {} free of {}{}",
            d.path.display(),
            format_bytes(d.free_bytes),
            format_bytes(d.total_bytes),
            d.read_bytes_per_s
                .map_or(String::new(), |r| format!(", reads {:.2} GB/s (O_DIRECT, 2 MiB at random)", r / 1e9))
        );
    }
    if !m.gpu_compiled {
        println!("gpu     this build has no GPU back end (built without the `gpu` feature)");
    } else if m.gpus.is_empty() {
        println!("gpu     none found (Vulkan, Metal or DX12)");
    }
    for g in &m.gpus {
        println!("gpu {}   {} [{} {}] driver {}", g.index, g.name, g.api, g.device_type, g.driver);
        println!(
            "        memory {} ({} free{}), f16 {}, subgroups {}, max binding {}, read {}, host memory read {}",
            b(g.memory_bytes),
            b(g.memory_free_bytes),
            g.memory_source.as_ref().map_or(String::new(), |s| format!(", from {s}")),
            if g.shader_f16 { "yes" } else { "no" },
            if g.subgroups { "yes" } else { "no" },
            format_bytes(g.max_storage_binding_bytes),
            rate(g.bandwidth_bytes_per_s, g.bandwidth_source),
            rate(g.host_read_bytes_per_s, g.host_read_source)
        );
    }
}

/// Runs the command.
pub fn run(args: Args) -> anyhow::Result<()> {
    let disk_paths = if args.disks.is_empty() {
        let mut v = vec![PathBuf::from(".")];
        // The store may not exist yet; its parent's file system is where it would go.
        if let Ok(store) = store::default_store_dir() {
            v.extend(store.ancestors().find(|p| p.exists()).map(|p| p.to_path_buf()));
        }
        v
    } else {
        args.disks
    };
    let m = plan::probe(&ProbeOptions { disk_paths, measure_bandwidth: !args.no_measure, ..Default::default() });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&m)?);
    } else {
        print_text(&m);
    }
    Ok(())
}
