//! GPU time per kernel (`DISKFORMER_GPU_PROFILE=2`): a timestamp before every dispatch and one
//! at the end of every compute pass, resolved after each submit, summed per pipeline.
//!
//! Why: the host profile (`DISKFORMER_GPU_PROFILE=1`) shows that a decode step waits on the GPU,
//! not where the GPU's time goes; with hundreds of small dependent dispatches per token, what
//! matters is which kernels are slow for their size. The interval between the timestamp written
//! before dispatch `i` and the next one is dispatch `i`'s time including the barrier wgpu puts
//! before the following dispatch, which is what the step pays for it.
//!
//! The cost: every submit waits for its timestamps, so the GPU no longer overlaps the host's
//! recording of the next part. Kernel times stay meaningful; tokens per second in this mode do
//! not. Needs `TIMESTAMP_QUERY_INSIDE_PASSES` (Vulkan and DX12 adapters offer it; lavapipe too).

use std::collections::HashMap;
use std::sync::Mutex;

use super::lock;

/// Timestamps written per submit at most; dispatches past it in one submit go untimed (a decode
/// step submits every 48 dispatches by default, a prefill chunk rarely more than a few hundred).
const CAPACITY: u32 = 4096;

/// The query set, its buffers and the sums per pipeline.
#[derive(Debug)]
pub(super) struct GpuTimer {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    period_ns: f64,
    /// Pipeline key by the address of its `ComputePipeline` (what a dispatch carries).
    names: Mutex<HashMap<usize, String>>,
    /// Per pipeline key: dispatches timed and their nanoseconds.
    totals: Mutex<HashMap<String, (u64, f64)>>,
}

/// The timestamps of one submit being recorded: `labels[i]` is the pipeline whose dispatch starts
/// at timestamp `i`, `None` for the end of a pass (the interval after it, copies and pass
/// changes, is not attributed).
#[derive(Default)]
pub(super) struct Stamps {
    labels: Vec<Option<usize>>,
}

impl GpuTimer {
    /// The features the timer needs.
    pub(super) fn features() -> wgpu::Features {
        wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES
    }

    pub(super) fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> GpuTimer {
        let bytes = u64::from(CAPACITY) * 8;
        GpuTimer {
            set: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("gpu timer"),
                ty: wgpu::QueryType::Timestamp,
                count: CAPACITY,
            }),
            resolve: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("gpu timer resolve"),
                size: bytes,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            readback: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("gpu timer readback"),
                size: bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            period_ns: f64::from(queue.get_timestamp_period()),
            names: Mutex::new(HashMap::new()),
            totals: Mutex::new(HashMap::new()),
        }
    }

    /// Remembers a pipeline's key for the report.
    pub(super) fn name_pipeline(&self, pipeline: &wgpu::ComputePipeline, key: &str) {
        lock(&self.names).insert(std::ptr::from_ref(pipeline) as usize, key.to_string());
    }

    /// Writes the timestamp that starts `pipeline_id`'s dispatch (`None`: the end of a pass).
    pub(super) fn stamp(&self, pass: &mut wgpu::ComputePass<'_>, stamps: &mut Stamps, pipeline_id: Option<usize>) {
        let index = stamps.labels.len() as u32;
        if index < CAPACITY {
            pass.write_timestamp(&self.set, index);
            stamps.labels.push(pipeline_id);
        }
    }

    /// Records the resolve of this submit's timestamps into the readback buffer.
    pub(super) fn resolve(&self, enc: &mut wgpu::CommandEncoder, stamps: &Stamps) {
        let n = stamps.labels.len() as u32;
        if n > 1 {
            enc.resolve_query_set(&self.set, 0..n, &self.resolve, 0);
            enc.copy_buffer_to_buffer(&self.resolve, 0, &self.readback, 0, u64::from(n) * 8);
        }
    }

    /// After the submit: waits for it, reads the timestamps and adds each dispatch's interval to
    /// its pipeline's sum. A failed wait or map drops this submit's times (the profile is a
    /// diagnostic; the op that needs the GPU reports the device's state itself).
    pub(super) fn collect(&self, device: &wgpu::Device, stamps: Stamps) {
        let n = stamps.labels.len();
        if n < 2 {
            return;
        }
        let size = n as u64 * 8;
        let (tx, rx) = std::sync::mpsc::channel();
        self.readback.slice(..size).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        if device.poll(wgpu::PollType::wait_indefinitely()).is_err() || !matches!(rx.recv(), Ok(Ok(()))) {
            return;
        }
        let ticks: Vec<u64> = match self.readback.slice(..size).get_mapped_range() {
            Ok(view) => view.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect(),
            Err(_) => Vec::new(),
        };
        self.readback.unmap();
        let names = lock(&self.names);
        let mut totals = lock(&self.totals);
        for (i, label) in stamps.labels.iter().enumerate().take(ticks.len().saturating_sub(1)) {
            let Some(id) = label else { continue };
            let ns = ticks[i + 1].saturating_sub(ticks[i]) as f64 * self.period_ns;
            let name = names.get(id).cloned().unwrap_or_else(|| "?".to_string());
            let e = totals.entry(name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += ns;
        }
    }

    /// One line per pipeline, most GPU time first: dispatches, total ms, us per dispatch and the
    /// share of the timed total.
    pub(super) fn report(&self) -> String {
        let totals = lock(&self.totals);
        let mut rows: Vec<(&String, &(u64, f64))> = totals.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let all_ns: f64 = rows.iter().map(|r| r.1 .1).sum();
        let mut out = format!("gpu time per kernel (DISKFORMER_GPU_PROFILE=2): {:.3} ms timed in all", all_ns / 1e6);
        for (name, (count, ns)) in rows {
            out.push_str(&format!(
                "\n  {:>9.3} ms {:>5.1}% {:>8} x {:>8.2} us  {name}",
                ns / 1e6,
                100.0 * ns / all_ns.max(1.0),
                count,
                ns / 1e3 / (*count).max(1) as f64
            ));
        }
        out
    }
}
