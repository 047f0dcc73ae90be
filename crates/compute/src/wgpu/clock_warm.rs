//! Raises a GPU's clocks while the host makes the last of the expert tier's host copies.
//!
//! Why: the first call of a paged model copies every expert into the host tier, ~5-6 s of CPU
//! work for Qwen3-30B-A3B Q4_K (16 GB), during which the GPU does a little copying every ~110
//! ms. On the H200 (thirtieth session, nvidia-smi every 10-20 ms beside a trace) the driver
//! lets the SM clock fall from 1980 MHz to its idle 345 MHz over ~3 s of that, and raises it
//! again only after ~250-300 ms of a busy GPU: the first 6-11 decode steps after the load ran at
//! ~25-30 ms each, against 7 ms (all experts on the GPU) and 12-14 ms (a 4 GB budget) once the
//! clock was up, in every configuration tried. A 1.5 s pause before them changed nothing, and a
//! 1 s pause between later repetitions did not bring it back: it is the load's idle GPU, paid
//! once, in a fresh process's first ~0.3 s of decoding. A light kernel kept running through the
//! whole fill (32 workgroups, the GPU ~30% busy) did not hold the clock up: it fell all the same.
//!
//! How: for the last [`LEAD`] of the fill (its pace measured per layer), a thread keeps the
//! whole GPU busy with a spinning kernel, half a millisecond a dispatch so the fill's own copies
//! wait little behind it, and stops at the next step's start (the expert tier drops it) or
//! [`LINGER`] after the last layer's copy kicked it. That is under a second of full load once
//! per model load, spent while the host works. It only runs on a real GPU (not a CPU adapter
//! such as lavapipe, where it would take cores from the fill, unless `DISKFORMER_CLOCK_WARM=1`),
//! and `DISKFORMER_CLOCK_WARM=0` turns it off.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Workgroups of the spinning kernel: every multiprocessor of a large GPU several times over
/// (a light load does not move the clock, see above).
const WORKGROUPS: u32 = 8192;

/// How long before the fill's end the warmer starts: the ~250-300 ms the H200's clock took to
/// rise under a busy GPU, and some.
pub(super) const LEAD: Duration = Duration::from_millis(400);

/// How long one dispatch should spin: short, so that the fill's own copies wait little behind
/// it.
const TARGET: Duration = Duration::from_micros(500);

/// How long the warmer runs on after its last kick (longer than a layer's copy takes).
const LINGER: Duration = Duration::from_millis(500);

/// The kernel's starting loop count, before the first dispatch is timed.
const FIRST_ITERS: u32 = 1 << 12;

const SHADER: &str = r"
@group(0) @binding(0) var<storage, read_write> state: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    // state[0] is the loop count; the rest keeps each lane's result so the loop is not dropped.
    let iters = state[0];
    var x = g.x | 1u;
    for (var i = 0u; i < iters; i++) {
        x = x * 1664525u + 1013904223u;
    }
    if (x == 0u) {
        state[1u + g.x] = x;
    }
}
";

/// `DISKFORMER_CLOCK_WARM`: `0` never, `1` on any adapter (a CPU one too, to try the path),
/// unset on a real GPU only. Read once.
fn setting() -> Option<bool> {
    static SET: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *SET.get_or_init(|| std::env::var("DISKFORMER_CLOCK_WARM").ok().map(|v| v.trim() != "0"))
}

/// The running warmer; dropping it stops the thread and waits for its last dispatch.
pub(super) struct ClockWarmer {
    stop: Arc<AtomicBool>,
    /// When the warmer was started, and the nanoseconds after it until which it runs.
    started: Instant,
    until_ns: Arc<AtomicU64>,
    linger: Duration,
    /// Kernels run so far.
    dispatches: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ClockWarmer {
    /// Starts keeping `device` busy, unless it is a CPU adapter (`device_type` "Cpu") or
    /// `DISKFORMER_CLOCK_WARM` says otherwise; `None` then, or when the thread cannot be made.
    pub(super) fn start(device: &wgpu::Device, queue: &wgpu::Queue, device_type: &str) -> Option<ClockWarmer> {
        if !setting().unwrap_or(device_type != "Cpu") {
            return None;
        }
        Self::start_on(device, queue, WORKGROUPS, LINGER)
    }

    /// Starts the thread on any adapter with `workgroups` of 64 lanes, running until dropped or
    /// `linger` past the last kick.
    fn start_on(device: &wgpu::Device, queue: &wgpu::Queue, workgroups: u32, linger: Duration) -> Option<ClockWarmer> {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("clock warm"),
            source: wgpu::ShaderSource::Wgsl(SHADER.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("clock warm"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions::default(),
            cache: None,
        });
        let state = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("clock warm"),
            size: 4 * (1 + u64::from(workgroups) * 64),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("clock warm"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[wgpu::BindGroupEntry { binding: 0, resource: state.as_entire_binding() }],
        });
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let until_ns = Arc::new(AtomicU64::new(linger.as_nanos() as u64));
        let dispatches = Arc::new(AtomicU64::new(0));
        let (device, queue, flag, until, count) =
            (device.clone(), queue.clone(), stop.clone(), until_ns.clone(), dispatches.clone());
        let thread = std::thread::Builder::new()
            .name("gpu-clock-warm".into())
            .spawn(move || {
                let (mut iters, mut written) = (FIRST_ITERS, 0);
                while !flag.load(Ordering::Acquire)
                    && (started.elapsed().as_nanos() as u64) < until.load(Ordering::Relaxed)
                {
                    if iters != written {
                        queue.write_buffer(&state, 0, &iters.to_le_bytes());
                        written = iters;
                    }
                    let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
                    {
                        let mut pass = enc
                            .begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
                        pass.set_pipeline(&pipeline);
                        pass.set_bind_group(0, &bind, &[]);
                        pass.dispatch_workgroups(workgroups, 1, 1);
                    }
                    let t0 = Instant::now();
                    let index = queue.submit([enc.finish()]);
                    let waited = device.poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None });
                    if waited.is_err() {
                        // A lost device: the model's own calls report it.
                        return;
                    }
                    // The wait includes whatever the fill queued ahead of the kernel: a long
                    // one may halve the count needlessly, which only shortens the next kernels.
                    let took = t0.elapsed();
                    count.fetch_add(1, Ordering::Relaxed);
                    if took < TARGET / 2 {
                        iters = iters.saturating_mul(2).min(1 << 24);
                    } else if took > TARGET * 2 {
                        iters = (iters / 2).max(1 << 8);
                    }
                }
            })
            .ok()?;
        Some(ClockWarmer { stop, started, until_ns, linger, dispatches, thread: Some(thread) })
    }

    /// Keeps the warmer running for its linger ([`LINGER`]) from now.
    pub(super) fn kick(&self) {
        let until = (self.started.elapsed() + self.linger).as_nanos() as u64;
        self.until_ns.fetch_max(until, Ordering::Relaxed);
    }

    /// Kernels it has run.
    pub(super) fn dispatches(&self) -> u64 {
        self.dispatches.load(Ordering::Relaxed)
    }

    /// Whether its thread has ended (its linger passed).
    #[cfg(test)]
    fn finished(&self) -> bool {
        self.thread.as_ref().is_none_or(std::thread::JoinHandle::is_finished)
    }
}

impl Drop for ClockWarmer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            // The thread only submits and waits; it cannot panic short of a wgpu bug, which
            // the model's own calls would then meet too.
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device on whatever adapter there is (lavapipe in CI); `None` without one.
    fn device() -> Option<(wgpu::Device, wgpu::Queue)> {
        let adapter = super::super::adapters(&super::super::instance()).into_iter().next()?;
        pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor::default())).ok()
    }

    #[test]
    fn the_warmer_runs_until_dropped_and_stops_by_itself_after_its_linger() {
        let Some((device, queue)) = device() else {
            eprintln!("no wgpu adapter: skipped");
            return;
        };
        let warmer = ClockWarmer::start_on(&device, &queue, 4, Duration::from_secs(30)).expect("thread");
        let t0 = Instant::now();
        while warmer.dispatches() < 3 && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(warmer.dispatches() >= 3, "{} kernels in {:?}", warmer.dispatches(), t0.elapsed());
        assert!(!warmer.finished());
        // Dropping it stops the thread well before the 30 s linger.
        let t1 = Instant::now();
        drop(warmer);
        assert!(t1.elapsed() < Duration::from_secs(10), "{:?}", t1.elapsed());

        // Unkicked, it ends once its linger has passed; a kick holds it a linger longer.
        let warmer = ClockWarmer::start_on(&device, &queue, 4, Duration::from_millis(300)).expect("thread");
        std::thread::sleep(Duration::from_millis(150));
        warmer.kick();
        std::thread::sleep(Duration::from_millis(250));
        assert!(!warmer.finished(), "ended within a linger of the kick");
        let t2 = Instant::now();
        while !warmer.finished() && t2.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(warmer.finished(), "still running {:?} after its linger", t2.elapsed());
    }
}
