//! Memory of the devices models are placed on, for the router's fit check: RAM from
//! /proc/meminfo, NVIDIA GPUs from `nvidia-smi`, AMD GPUs from amdgpu's sysfs files, and
//! `unknown` for devices whose memory the OS does not tell (integrated GPUs, software
//! renderers, other vendors) rather than an invented number.
//!
//! The router asks a [`DeviceMemorySource`], so tests inject fixed figures instead of the
//! machine's.

use serde_json::{json, Value};
use std::path::Path;

/// The key of the CPU's memory (RAM) in device lists.
pub const CPU: &str = "cpu";

/// The key of GPU `index` (the planner's and `--gpu N`'s adapter index) in device lists.
pub fn gpu_key(index: usize) -> String {
    format!("gpu{index}")
}

/// One device's memory now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// [`CPU`] or [`gpu_key`].
    pub device: String,
    /// What it is (CPU model or adapter name).
    pub name: String,
    /// Total bytes (`None`: unknown).
    pub total_bytes: Option<u64>,
    /// Free bytes (`None`: unknown).
    pub free_bytes: Option<u64>,
    /// Where the figures come from.
    pub source: String,
}

impl DeviceMemory {
    /// As `/models` shows it: numbers, or `"unknown"`.
    pub fn json(&self) -> Value {
        let n = |v: Option<u64>| v.map_or(json!("unknown"), |b| json!(b));
        json!({"device": self.device, "name": self.name, "total": n(self.total_bytes),
               "free": n(self.free_bytes), "source": self.source})
    }
}

/// Where the router reads device memory.
pub trait DeviceMemorySource: Send + Sync {
    /// Every device's memory now, RAM ([`CPU`]) first.
    fn snapshot(&self) -> Vec<DeviceMemory>;
}

/// A GPU adapter the back end can use.
#[derive(Clone, Debug)]
struct Adapter {
    index: usize,
    name: String,
    device_type: String,
}

/// The machine's devices: the adapters the GPU back end lists (when built with it, through
/// the planner's probe), with their memory read from the OS at each snapshot.
pub struct OsDevices {
    adapters: Vec<Adapter>,
    sysfs_drm: std::path::PathBuf,
}

impl OsDevices {
    /// Lists the adapters once (enumerating them is slow; memory is read at each snapshot).
    pub fn new() -> OsDevices {
        let machine =
            plan::probe(&plan::ProbeOptions { disk_paths: vec![], measure_bandwidth: false, ..Default::default() });
        let adapters = machine
            .gpus
            .into_iter()
            .map(|g| Adapter { index: g.index, name: g.name, device_type: g.device_type })
            .collect();
        OsDevices { adapters, sysfs_drm: "/sys/class/drm".into() }
    }
}

impl Default for OsDevices {
    fn default() -> Self {
        OsDevices::new()
    }
}

impl DeviceMemorySource for OsDevices {
    fn snapshot(&self) -> Vec<DeviceMemory> {
        let (total, free) = ram();
        let mut out = vec![DeviceMemory {
            device: CPU.into(),
            name: "RAM".into(),
            total_bytes: total,
            free_bytes: free,
            source: "/proc/meminfo MemTotal, MemAvailable".into(),
        }];
        let nvidia = if self.adapters.iter().any(|a| is_nvidia(&a.name)) { nvidia_smi() } else { Vec::new() };
        let amd = if self.adapters.iter().any(|a| is_amd(&a.name)) { amd_sysfs(&self.sysfs_drm) } else { Vec::new() };
        let (mut next_nvidia, mut next_amd) = (0, 0);
        for a in &self.adapters {
            // Discrete GPUs of one vendor are listed by nvidia-smi and sysfs in PCI order, as
            // Vulkan enumerates them on one host.
            let found = if a.device_type != "DiscreteGpu" {
                None
            } else if is_nvidia(&a.name) {
                next_nvidia += 1;
                nvidia.get(next_nvidia - 1).map(|&(t, u)| (t, t.saturating_sub(u), "nvidia-smi"))
            } else if is_amd(&a.name) {
                next_amd += 1;
                amd.get(next_amd - 1).map(|&(t, u)| (t, t.saturating_sub(u), "amdgpu sysfs mem_info_vram"))
            } else {
                None
            };
            out.push(DeviceMemory {
                device: gpu_key(a.index),
                name: a.name.clone(),
                total_bytes: found.map(|f| f.0),
                free_bytes: found.map(|f| f.1),
                source: found.map_or_else(
                    || format!("unknown ({}: the OS does not report its memory)", a.device_type),
                    |f| f.2.to_string(),
                ),
            });
        }
        out
    }
}

fn is_nvidia(name: &str) -> bool {
    name.contains("NVIDIA")
}

fn is_amd(name: &str) -> bool {
    name.contains("AMD") || name.contains("Radeon")
}

/// (total, available) RAM bytes.
fn ram() -> (Option<u64>, Option<u64>) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    (meminfo_bytes(&text, "MemTotal:"), meminfo_bytes(&text, "MemAvailable:"))
}

fn meminfo_bytes(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map(|kib| kib * 1024)
}

/// (total, used) bytes per NVIDIA GPU in index order; empty without `nvidia-smi`.
fn nvidia_smi() -> Vec<(u64, u64)> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=index,memory.total,memory.used", "--format=csv,noheader,nounits"])
        .output();
    match out {
        Ok(o) if o.status.success() => parse_nvidia_smi(&String::from_utf8_lossy(&o.stdout)),
        _ => Vec::new(),
    }
}

/// `index, total MiB, used MiB` lines, sorted by index; malformed lines are skipped.
fn parse_nvidia_smi(text: &str) -> Vec<(u64, u64)> {
    let mut rows: Vec<(u64, u64, u64)> = text
        .lines()
        .filter_map(|l| {
            let mut f = l.split(',').map(|x| x.trim().parse::<u64>().ok());
            Some((f.next()??, f.next()?? << 20, f.next()?? << 20))
        })
        .collect();
    rows.sort();
    rows.into_iter().map(|r| (r.1, r.2)).collect()
}

/// (total, used) VRAM bytes of each amdgpu card under `drm` (`card*/device/mem_info_vram_*`),
/// in card order.
fn amd_sysfs(drm: &Path) -> Vec<(u64, u64)> {
    let Ok(dir) = std::fs::read_dir(drm) else { return Vec::new() };
    let mut cards: Vec<(u32, std::path::PathBuf)> = dir
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let n = name.strip_prefix("card")?.parse::<u32>().ok()?;
            Some((n, e.path()))
        })
        .collect();
    cards.sort();
    let read = |p: &Path| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    cards
        .iter()
        .filter_map(|(_, p)| {
            let dev = p.join("device");
            Some((read(&dev.join("mem_info_vram_total"))?, read(&dev.join("mem_info_vram_used"))?))
        })
        .collect()
}

/// Fixed figures (tests, or a caller that measures elsewhere).
#[derive(Clone, Debug, Default)]
pub struct FixedDevices(pub std::sync::Arc<std::sync::Mutex<Vec<DeviceMemory>>>);

impl FixedDevices {
    /// A source that reports `devices` until [`FixedDevices::set`] changes them.
    pub fn new(devices: Vec<DeviceMemory>) -> FixedDevices {
        FixedDevices(std::sync::Arc::new(std::sync::Mutex::new(devices)))
    }

    /// Replaces the figures.
    pub fn set(&self, devices: Vec<DeviceMemory>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = devices;
    }
}

impl DeviceMemorySource for FixedDevices {
    fn snapshot(&self) -> Vec<DeviceMemory> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvidia_smi_lines_are_mib_in_index_order() {
        // The format nvidia-smi prints for the query above (H200, two GPUs, listed out of order).
        let text = "1, 143771, 1\n0, 143771, 70012\nbad line\n";
        assert_eq!(parse_nvidia_smi(text), vec![(143771 << 20, 70012 << 20), (143771 << 20, 1 << 20)]);
    }

    #[test]
    fn amdgpu_sysfs_files_are_read_per_card() {
        let d = tempfile::tempdir().unwrap();
        for (card, total, used) in [("card1", "17163091968\n", "1073741824\n"), ("card0", "536870912", "0")] {
            let dev = d.path().join(card).join("device");
            std::fs::create_dir_all(&dev).unwrap();
            std::fs::write(dev.join("mem_info_vram_total"), total).unwrap();
            std::fs::write(dev.join("mem_info_vram_used"), used).unwrap();
        }
        // A connector entry and a card without amdgpu's files are not cards with VRAM figures.
        std::fs::create_dir_all(d.path().join("card2-DP-1")).unwrap();
        std::fs::create_dir_all(d.path().join("card3/device")).unwrap();
        assert_eq!(amd_sysfs(d.path()), vec![(536870912, 0), (17163091968, 1073741824)]);
    }

    #[test]
    fn unknown_memory_is_said_not_invented() {
        let m = DeviceMemory {
            device: gpu_key(0),
            name: "llvmpipe".into(),
            total_bytes: None,
            free_bytes: None,
            source: "unknown".into(),
        };
        assert_eq!(m.json()["total"], "unknown");
        assert_eq!(m.json()["free"], "unknown");
    }
}
