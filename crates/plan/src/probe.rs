//! [`probe`]: the machine as the planner sees it: GPUs, CPU, RAM, free disk, bandwidths.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where a bandwidth figure comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Measured on this machine by this probe.
    Measured,
    /// Taken from the table of bandwidths measured on known devices ([`BANDWIDTH_TABLE`]).
    Table,
    /// Given by the caller (tests, `--bandwidth` style overrides).
    Given,
}

impl Source {
    /// The JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Measured => "measured",
            Source::Table => "table",
            Source::Given => "given",
        }
    }
}

/// One GPU adapter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Index for `--gpu N` (wgpu's enumeration order).
    pub index: usize,
    /// Device name.
    pub name: String,
    /// Graphics API (`Vulkan`, `Metal`, `Dx12`).
    pub api: String,
    /// `DiscreteGpu`, `IntegratedGpu`, `VirtualGpu`, `Cpu` (a software renderer), `Other`.
    pub device_type: String,
    /// Driver name and version.
    pub driver: String,
    /// Whether shaders can use f16.
    pub shader_f16: bool,
    /// Whether subgroup operations are offered.
    pub subgroups: bool,
    /// Largest storage-buffer binding (weights larger than this are split).
    pub max_storage_binding_bytes: u64,
    /// Device memory, when knowable (nvidia-smi, amdgpu sysfs, or system RAM for software and
    /// integrated devices, which share it).
    pub memory_bytes: Option<u64>,
    /// Free device memory, when knowable.
    pub memory_free_bytes: Option<u64>,
    /// How the memory figures were found.
    pub memory_source: Option<String>,
    /// Device-memory read bandwidth in bytes per second.
    pub bandwidth_bytes_per_s: Option<f64>,
    /// Where that figure comes from.
    pub bandwidth_source: Option<Source>,
    /// Rate at which the GPU's kernels read host memory, in bytes per second: over PCIe on a
    /// discrete GPU, the link the GPU expert tier's misses cross; a software or integrated
    /// device reads the same memory as its own.
    #[serde(default)]
    pub host_read_bytes_per_s: Option<f64>,
    /// Where that figure comes from.
    #[serde(default)]
    pub host_read_source: Option<Source>,
}

/// The CPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CpuInfo {
    /// Model name (`/proc/cpuinfo`).
    pub model: Option<String>,
    /// Instruction-set architecture (`x86_64`, `aarch64`).
    pub arch: String,
    /// SIMD features detected at run time (`avx2`, `fma`, `avx512f`, `neon`, `dotprod`, ...).
    pub simd: Vec<String>,
    /// Logical cores available to this process.
    pub cores_logical: usize,
    /// Physical cores, when `/proc/cpuinfo` says.
    pub cores_physical: Option<usize>,
}

/// Main memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryInfo {
    /// Installed RAM (`MemTotal`), or the cgroup limit when lower.
    pub total_bytes: Option<u64>,
    /// RAM that can be used without swapping (`MemAvailable`, capped by the cgroup's room).
    pub available_bytes: Option<u64>,
    /// The cgroup (container) memory limit, when one is set.
    pub cgroup_limit_bytes: Option<u64>,
    /// Read bandwidth in bytes per second.
    pub bandwidth_bytes_per_s: Option<f64>,
    /// Where that figure comes from.
    pub bandwidth_source: Option<Source>,
}

/// Free space of the file system holding a path, and how fast it reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiskInfo {
    /// The path asked about.
    pub path: PathBuf,
    /// Bytes an unprivileged user may still write.
    pub free_bytes: u64,
    /// Size of the file system.
    pub total_bytes: u64,
    /// Bytes per second of the pager's kind of reads (`O_DIRECT`, 2 MiB at random offsets,
    /// eight in flight: `pager::measure_read_rate`) from the largest file of at least
    /// [`READ_RATE_MIN_FILE_BYTES`] at the path (the path itself when it is a file), when the
    /// probe measures; `None` when it does not, no such file is there, or the file system
    /// refuses `O_DIRECT`. The planner's speed for plans that read experts from disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bytes_per_s: Option<f64>,
}

/// Whether a measuring probe also times the disks ([`ProbeOptions::disk_rate_beyond_ram`]): a
/// model larger than the RAM available (or of unknown size, or with the RAM unknown) may be paged.
fn wants_disk_rate(beyond_ram: Option<u64>, available_ram: Option<u64>) -> bool {
    beyond_ram.is_none_or(|bytes| available_ram.is_none_or(|ram| bytes > ram))
}

/// Smallest file the disk read rate is measured on: random reads over a smaller one stay in
/// the device's own cache.
pub const READ_RATE_MIN_FILE_BYTES: u64 = 256 << 20;

/// The largest regular file of at least [`READ_RATE_MIN_FILE_BYTES`] at `path` (itself, or
/// directly inside it).
fn largest_file(path: &Path) -> Option<PathBuf> {
    let size = |p: &Path| std::fs::metadata(p).ok().filter(|m| m.is_file()).map(|m| m.len());
    if size(path).is_some() {
        return size(path).filter(|&n| n >= READ_RATE_MIN_FILE_BYTES).map(|_| path.to_path_buf());
    }
    std::fs::read_dir(path)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| size(&p).map(|n| (n, p)))
        .filter(|(n, _)| *n >= READ_RATE_MIN_FILE_BYTES)
        .max_by_key(|(n, _)| *n)
        .map(|(_, p)| p)
}

/// What [`probe`] reports. The JSON form is documented in docs/PLAN.md and stable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// GPU adapters (empty when none, or when built without the `gpu` feature).
    pub gpus: Vec<GpuInfo>,
    /// Whether this build can use GPUs at all.
    pub gpu_compiled: bool,
    /// The CPU.
    pub cpu: CpuInfo,
    /// Main memory.
    pub memory: MemoryInfo,
    /// Free disk where models are stored.
    pub disks: Vec<DiskInfo>,
}

/// What [`probe`] looks at.
#[derive(Clone, Debug, Default)]
pub struct ProbeOptions {
    /// Paths whose file systems' free space to report (model folders, the store).
    pub disk_paths: Vec<PathBuf>,
    /// Measure RAM and GPU read bandwidths and the disks' read rates (about a second in all);
    /// otherwise take the bandwidths from [`BANDWIDTH_TABLE`] when the device is listed there
    /// (disks have no table: no rate).
    pub measure_bandwidth: bool,
    /// When measuring: measure the disks' read rate only if this many bytes (the model being
    /// planned) exceed the RAM available, so a model that fits (and is never paged) does not
    /// wait for it; `None`: always. Callers with a RAM budget below the model pass `None`.
    pub disk_rate_beyond_ram: Option<u64>,
}

/// Read bandwidths measured on known devices with this crate's own measurement (the one
/// `probe --measure` runs), used when a probe does not measure: (device-name substring, bytes
/// per second, where and how it was measured). A match is by substring of the GPU name or CPU
/// model; see docs/PLAN.md.
pub const BANDWIDTH_TABLE: &[(&str, f64, &str)] = &[(
    "NVIDIA H200",
    3.68e12,
    "H200 141 GB (driver 580.159.04, Vulkan): 3.68 and 3.88 TB/s in two runs of the 1 GiB stream \
     read of `probe --measure` (2026-11-30); the lower is kept",
)];

/// Host-memory read rates of GPU kernels measured on known devices (`probe --measure`'s stream
/// read from a host buffer, `compute::wgpu::WgpuBackend::perf_stream_host`): (device-name
/// substring, bytes per second, where and how it was measured), used when a probe does not
/// measure. See docs/PLAN.md.
pub const HOST_READ_TABLE: &[(&str, f64, &str)] = &[(
    "NVIDIA H200",
    50.4e9,
    "H200 141 GB (driver 580.159.04, Vulkan, PCIe host): 50.4-50.9 GB/s in three probes of the 256 MiB \
     host-buffer stream read of `probe --measure` (2026-12-01); the lowest is kept",
)];

/// Looks the machine over.
///
/// # Examples
/// ```no_run
/// let machine = plan::probe(&plan::ProbeOptions::default());
/// println!("{} logical cores", machine.cpu.cores_logical);
/// ```
pub fn probe(opts: &ProbeOptions) -> Machine {
    let mut cpu = cpu_info();
    let mut memory = memory_info();
    if opts.measure_bandwidth {
        memory.bandwidth_bytes_per_s = Some(measure_ram_bandwidth());
        memory.bandwidth_source = Some(Source::Measured);
    } else if let Some(bw) = cpu.model.as_deref().and_then(table_bandwidth) {
        memory.bandwidth_bytes_per_s = Some(bw);
        memory.bandwidth_source = Some(Source::Table);
    }
    cpu.simd.sort();
    let gpus = gpus(&memory, opts.measure_bandwidth);
    let wants_disk_rate = wants_disk_rate(opts.disk_rate_beyond_ram, memory.available_bytes);
    let disks = opts
        .disk_paths
        .iter()
        .filter_map(|p| {
            let (free_bytes, total_bytes) = disk_space(p)?;
            let read_bytes_per_s = (opts.measure_bandwidth && wants_disk_rate)
                .then(|| largest_file(p))
                .flatten()
                .and_then(|f| pager::measure_read_rate(&f, &pager::ReadRateOptions::default()).ok());
            Some(DiskInfo { path: p.clone(), free_bytes, total_bytes, read_bytes_per_s })
        })
        .collect();
    Machine { gpus, gpu_compiled: cfg!(feature = "gpu"), cpu, memory, disks }
}

fn table_bandwidth(name: &str) -> Option<f64> {
    BANDWIDTH_TABLE.iter().find(|(pat, _, _)| name.contains(pat)).map(|(_, bw, _)| *bw)
}

#[cfg(feature = "gpu")]
fn table_host_read(name: &str) -> Option<f64> {
    HOST_READ_TABLE.iter().find(|(pat, _, _)| name.contains(pat)).map(|(_, bw, _)| *bw)
}

fn cpu_info() -> CpuInfo {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |line: &str, key: &str| -> Option<String> {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    };
    let model = cpuinfo.lines().find_map(|l| field(l, "model name").or_else(|| field(l, "Model")));
    // Physical cores: distinct (physical id, core id) pairs, one block per logical CPU.
    let mut cores = std::collections::BTreeSet::new();
    for block in cpuinfo.split("\n\n") {
        let phys = block.lines().find_map(|l| field(l, "physical id"));
        let core = block.lines().find_map(|l| field(l, "core id"));
        if let (Some(p), Some(c)) = (phys, core) {
            cores.insert((p, c));
        }
    }
    CpuInfo {
        model,
        arch: std::env::consts::ARCH.to_string(),
        simd: simd_features(),
        cores_logical: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cores_physical: (!cores.is_empty()).then_some(cores.len()),
    }
}

#[cfg(target_arch = "x86_64")]
fn simd_features() -> Vec<String> {
    let mut out = Vec::new();
    macro_rules! check {
        ($($f:tt),*) => { $( if std::arch::is_x86_feature_detected!($f) { out.push($f.to_string()); } )* };
    }
    check!(
        "sse4.2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512vnni",
        "avx512bf16",
        "avxvnni"
    );
    out
}

#[cfg(target_arch = "aarch64")]
fn simd_features() -> Vec<String> {
    let mut out = Vec::new();
    macro_rules! check {
        ($($f:tt),*) => { $( if std::arch::is_aarch64_feature_detected!($f) { out.push($f.to_string()); } )* };
    }
    check!("neon", "dotprod", "i8mm", "fp16", "sve", "sve2");
    out
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn simd_features() -> Vec<String> {
    Vec::new()
}

fn meminfo_bytes(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key) && l[key.len()..].starts_with(':'))?;
    let kb: u64 = line[key.len() + 1..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn memory_info() -> MemoryInfo {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mut total = meminfo_bytes(&text, "MemTotal");
    let mut available = meminfo_bytes(&text, "MemAvailable");
    // cgroup v2: a container's limit (`max` when unlimited, which does not parse) and usage.
    let limit = read_u64("/sys/fs/cgroup/memory.max");
    if let Some(limit) = limit {
        let used = read_u64("/sys/fs/cgroup/memory.current").unwrap_or(0);
        total = Some(total.map_or(limit, |t| t.min(limit)));
        let room = limit.saturating_sub(used);
        available = Some(available.map_or(room, |a| a.min(room)));
    }
    MemoryInfo {
        total_bytes: total,
        available_bytes: available,
        cgroup_limit_bytes: limit,
        bandwidth_bytes_per_s: None,
        bandwidth_source: None,
    }
}

/// Read bandwidth of main memory: the best of three parallel sums over 256 MiB, so caches
/// cannot hold it and every core pulls its share.
fn measure_ram_bandwidth() -> f64 {
    use rayon::prelude::*;
    const BYTES: usize = 256 << 20;
    let data: Vec<u64> = vec![1; BYTES / 8];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let sum: u64 = data.par_chunks(1 << 16).map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x))).sum();
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    BYTES as f64 / best.max(1e-9)
}

/// Free and total bytes of the file system holding `path`.
fn disk_space(path: &Path) -> Option<(u64, u64)> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `c` is a NUL-terminated path and `st` points to writable memory of the size
        // statvfs fills; we read it only when the call reports success.
        let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
        if rc != 0 {
            return None;
        }
        // SAFETY: statvfs returned 0, so it initialised `st`.
        let st = unsafe { st.assume_init() };
        // The field types differ between platforms (u32 on some), hence the casts.
        #[allow(clippy::unnecessary_cast)]
        let frsize = st.f_frsize as u64;
        #[allow(clippy::unnecessary_cast)]
        let (free, total) = (st.f_bavail as u64 * frsize, st.f_blocks as u64 * frsize);
        Some((free, total))
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

#[cfg(feature = "gpu")]
fn gpus(memory: &MemoryInfo, measure: bool) -> Vec<GpuInfo> {
    let adapters = compute::wgpu::list_adapters();
    let nvidia = nvidia_smi_memory();
    let mut nvidia_next = 0;
    adapters
        .into_iter()
        .map(|a| {
            let mut g = GpuInfo {
                index: a.index,
                name: a.name,
                api: a.api,
                device_type: a.device_type,
                driver: a.driver,
                shader_f16: a.shader_f16,
                subgroups: a.subgroups,
                max_storage_binding_bytes: a.max_storage_binding_bytes,
                memory_bytes: None,
                memory_free_bytes: None,
                memory_source: None,
                bandwidth_bytes_per_s: None,
                bandwidth_source: None,
                host_read_bytes_per_s: None,
                host_read_source: None,
            };
            let shares_ram = g.device_type == "Cpu" || g.device_type == "IntegratedGpu";
            if shares_ram {
                g.memory_bytes = memory.total_bytes;
                g.memory_free_bytes = memory.available_bytes;
                g.memory_source = Some("system RAM (the device shares it)".into());
            } else if g.name.contains("NVIDIA") {
                // nvidia-smi lists GPUs in PCI order, as Vulkan enumerates them on one host.
                if let Some(&(total, free)) = nvidia.get(nvidia_next) {
                    g.memory_bytes = Some(total);
                    g.memory_free_bytes = Some(free);
                    g.memory_source = Some("nvidia-smi".into());
                }
                nvidia_next += 1;
            }
            if measure {
                if let Some(bw) = measure_gpu_bandwidth(g.index, &g.device_type) {
                    g.bandwidth_bytes_per_s = Some(bw);
                    g.bandwidth_source = Some(Source::Measured);
                }
            } else if let Some(bw) = table_bandwidth(&g.name) {
                g.bandwidth_bytes_per_s = Some(bw);
                g.bandwidth_source = Some(Source::Table);
            }
            if shares_ram {
                // Host memory is the device's own memory.
                g.host_read_bytes_per_s = g.bandwidth_bytes_per_s;
                g.host_read_source = g.bandwidth_source;
            } else if measure {
                if let Some(bw) = measure_gpu_host_read(g.index) {
                    g.host_read_bytes_per_s = Some(bw);
                    g.host_read_source = Some(Source::Measured);
                }
            } else if let Some(bw) = table_host_read(&g.name) {
                g.host_read_bytes_per_s = Some(bw);
                g.host_read_source = Some(Source::Table);
            }
            g
        })
        .collect()
}

#[cfg(not(feature = "gpu"))]
fn gpus(_memory: &MemoryInfo, _measure: bool) -> Vec<GpuInfo> {
    Vec::new()
}

/// (total, free) bytes per NVIDIA GPU from `nvidia-smi`, empty when it is not installed.
#[cfg(feature = "gpu")]
fn nvidia_smi_memory() -> Vec<(u64, u64)> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=memory.total,memory.free", "--format=csv,noheader,nounits"])
        .output();
    let Ok(out) = out else { return Vec::new() };
    if !out.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (t, f) = l.split_once(',')?;
            Some((t.trim().parse::<u64>().ok()? << 20, f.trim().parse::<u64>().ok()? << 20))
        })
        .collect()
}

/// Streaming read bandwidth of one adapter (compute's `perf_stream` kernel): 1 GiB on real
/// GPUs, 64 MiB on software renderers, which are slow.
#[cfg(feature = "gpu")]
fn measure_gpu_bandwidth(index: usize, device_type: &str) -> Option<f64> {
    let b = compute::wgpu::WgpuBackend::new(compute::wgpu::WgpuOptions {
        adapter_index: Some(index),
        prefer_discrete: false,
    })
    .ok()?;
    let bytes: u64 = if device_type == "Cpu" { 64 << 20 } else { (1u64 << 30).min(b.max_binding_bytes()) };
    let secs = b.perf_stream(bytes, if device_type == "Cpu" { 3 } else { 20 }).ok()?;
    (secs > 0.0).then(|| bytes as f64 / secs)
}

/// Rate at which one adapter's kernels read host memory: the stream kernel over 256 MiB of a
/// host buffer placed as the expert tier's host copy is.
#[cfg(feature = "gpu")]
fn measure_gpu_host_read(index: usize) -> Option<f64> {
    let b = compute::wgpu::WgpuBackend::new(compute::wgpu::WgpuOptions {
        adapter_index: Some(index),
        prefer_discrete: false,
    })
    .ok()?;
    let bytes: u64 = (256u64 << 20).min(b.max_binding_bytes());
    let secs = b.perf_stream_host(bytes, 5).ok()?;
    (secs > 0.0).then(|| bytes as f64 / secs)
}

#[cfg(test)]
mod tests {
    /// The disk is timed only for a model the RAM cannot hold (or when asked unconditionally):
    /// a model that fits is never paged, and `run` should not wait for the measurement.
    #[test]
    fn the_disk_is_timed_only_for_a_model_beyond_the_ram() {
        assert!(wants_disk_rate(None, Some(1 << 30)), "no model given: always");
        assert!(wants_disk_rate(Some(2 << 30), Some(1 << 30)), "larger than the RAM");
        assert!(!wants_disk_rate(Some(1 << 29), Some(1 << 30)), "fits");
        assert!(wants_disk_rate(Some(1 << 29), None), "RAM unknown");
    }

    use super::*;

    #[test]
    fn meminfo_lines_parse_in_kib() {
        let text = "MemTotal:       24684092 kB\nMemFree:  100 kB\nMemAvailable:   20328456 kB\n";
        assert_eq!(meminfo_bytes(text, "MemTotal"), Some(24684092 * 1024));
        assert_eq!(meminfo_bytes(text, "MemAvailable"), Some(20328456 * 1024));
        assert_eq!(meminfo_bytes(text, "Mem"), None);
    }

    #[test]
    fn probe_reports_this_machine() {
        let m = probe(&ProbeOptions {
            disk_paths: vec![PathBuf::from(".")],
            measure_bandwidth: false,
            ..Default::default()
        });
        assert!(m.cpu.cores_logical >= 1);
        assert_eq!(m.cpu.arch, std::env::consts::ARCH);
        #[cfg(target_os = "linux")]
        {
            let total = m.memory.total_bytes.expect("MemTotal on Linux");
            let avail = m.memory.available_bytes.expect("MemAvailable on Linux");
            assert!(avail <= total && total > 0);
            assert_eq!(m.disks.len(), 1);
            assert!(m.disks[0].free_bytes <= m.disks[0].total_bytes && m.disks[0].total_bytes > 0);
        }
    }
}
