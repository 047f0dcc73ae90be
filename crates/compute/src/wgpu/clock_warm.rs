//! Keeps a GPU's clocks up while the host fills the expert tier on the first call.
//!
//! Why: the first call of a paged model copies every expert into the host tier, ~6 s of CPU
//! work for Qwen3-30B-A3B Q4_K (16 GB), during which the GPU does a little copying every ~125
//! ms. On the H200 (thirtieth session, nvidia-smi every 10 ms beside a trace) the driver lets
//! the SM clock fall from 1980 MHz to its idle 345 MHz in ~3 s of that, and takes ~250-300 ms
//! of busy decoding to raise it again: the first 7-11 decode steps after the load ran at
//! ~25-30 ms each, against 7 ms (all experts on the GPU) and 12-14 ms (4 GB budget) once the
//! clock was up, in every configuration tried (a 1.5 s pause before them changed nothing; a 1 s
//! pause between repetitions later did not bring it back). A small kernel kept running while
//! the host works costs the user nothing the GPU was doing, and the first tokens then come at
//! the speed of the later ones.
//!
//! How: a thread submits a spinning kernel on a few workgroups (a light load: what the clock
//! governor is shown is a busy GPU, not a hot one), waits for it, and submits the next, until
//! [`ClockWarmer`] is dropped (the expert tier drops it at the next step's start) or
//! [`LINGER`] passes without a [`ClockWarmer::kick`] (the fill kicks it at each layer), so that
//! a fill followed by no further call does not leave it running. It only runs on a real GPU (not a CPU adapter such as lavapipe,
//! where it would take a core from the fill) and `DISKFORMER_CLOCK_WARM=0` turns it off.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Workgroups of the spinning kernel: enough that the GPU reads as busy, few enough that it
/// neither draws much power nor holds back the copies queued beside it.
const WORKGROUPS: u32 = 32;

/// How long one dispatch should spin: short, so that the fill's own copies wait at most this
/// long behind it.
const TARGET: Duration = Duration::from_micros(500);

/// How long the warmer runs on after its last kick.
const LINGER: Duration = Duration::from_secs(1);

/// The kernel's starting loop count, before the first dispatch is timed.
const FIRST_ITERS: u32 = 1 << 14;

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

/// False when the environment sets `DISKFORMER_CLOCK_WARM=0`. Read once.
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DISKFORMER_CLOCK_WARM").map_or(true, |v| v.trim() != "0"))
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
    /// `DISKFORMER_CLOCK_WARM=0`; `None` then, or when the thread cannot be made.
    pub(super) fn start(device: &wgpu::Device, queue: &wgpu::Queue, device_type: &str) -> Option<ClockWarmer> {
        if device_type == "Cpu" || !enabled() {
            return None;
        }
        Self::start_on(device, queue, LINGER)
    }

    /// Starts the thread on any adapter, running until dropped or `linger` past the last kick.
    fn start_on(device: &wgpu::Device, queue: &wgpu::Queue, linger: Duration) -> Option<ClockWarmer> {
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
            size: 4 * (1 + u64::from(WORKGROUPS) * 64),
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
                        pass.dispatch_workgroups(WORKGROUPS, 1, 1);
                    }
                    let t0 = Instant::now();
                    let index = queue.submit([enc.finish()]);
                    let waited = device.poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None });
                    if waited.is_err() {
                        // A lost device: the model's own calls report it.
                        return;
                    }
                    // The wait includes whatever the fill queued ahead of the kernel, so the
                    // count only grows while the kernel alone is shorter than the target.
                    let took = t0.elapsed();
                    count.fetch_add(1, Ordering::Relaxed);
                    iters = if took < TARGET / 2 { iters.saturating_mul(2).min(1 << 24) } else { iters };
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
        let warmer = ClockWarmer::start_on(&device, &queue, Duration::from_secs(30)).expect("thread");
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
        let warmer = ClockWarmer::start_on(&device, &queue, Duration::from_millis(300)).expect("thread");
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
