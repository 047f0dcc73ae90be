//! What one dispatch costs apart from its work (issue 5): a decode step is ~500 small dispatches
//! that mostly depend on each other, and the step's GPU time is far above what its kernels read.
//! [`WgpuBackend::perf_dispatch`] times batches of dispatches under the conditions that might
//! cost: a barrier between dispatches (each writes the buffer the previous wrote) or none (each
//! writes its own), one compute pass per dispatch or one for all, workgroup memory zeroed by the
//! pipeline (WGSL's rule, wgpu's default) or not, and two real kernels of the step.
//!
//! Sixth session: every chain is also timed with a timestamp before each dispatch (what the GPU
//! profile, `DISKFORMER_GPU_PROFILE=2`, does) next to the same chain without any timestamp
//! inside it, so the profile's own cost per dispatch shows; an empty kernel with and without a
//! barrier; the decode norm (weight and int8 blocks) in `norm.wgsl` and in `norm_reg.wgsl`'s
//! shapes; and each small kernel after a 9 MB streaming read (the decode's order: a small kernel
//! waits for a product's last workgroups), attributed per kernel as the profile does.
//!
//! It opens a second device on the back end's adapter with the timestamp features when the
//! adapter has them, so the GPU's own time per dispatch is measured next to the wall time of the
//! batch (submit to completion); the back end's device, and so every other measurement, stays as
//! it is. Bind groups are made before the timing: only the recording (reported apart), the
//! submit and the GPU's work are in the numbers.

use super::shaders::Plain;
use super::{adapters, instance, OpError, WgpuBackend};
use std::sync::Arc;

/// A 64-value update by one workgroup: the smallest kernel that writes memory.
const TINY: &str = "
@group(0) @binding(0) var<storage, read_write> B: array<f32>;
@group(0) @binding(1) var<uniform> P: vec4<u32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32) {
    if (lid < P.x) {
        B[lid] = B[lid] * 0.5 + 1.0;
    }
}
";

/// A kernel with 8 KiB of workgroup memory (a reduction's scratch), each workgroup writing all of
/// it before a barrier and reading it after: zeroing it first changes no result, so the timing
/// difference between the two compilations is the cost of the zeroing.
const SHARED: &str = "
@group(0) @binding(0) var<storage, read_write> B: array<f32>;
@group(0) @binding(1) var<uniform> P: vec4<u32>;

var<workgroup> scratch: array<f32, 2048>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    for (var i = lid; i < 2048u; i += 256u) {
        scratch[i] = f32(i + wid.x);
    }
    workgroupBarrier();
    let at = wid.x * 256u + lid;
    if (at < P.x) {
        B[at] = B[at] * 0.5 + scratch[(lid * 8u + 1u) % 2048u];
    }
}
";

/// A kernel that does nothing and binds nothing: what launching a dispatch costs when nothing
/// orders it after the previous one.
const EMPTY: &str = "
@compute @workgroup_size(64)
fn main() {
}
";

/// A kernel that does nothing but binds a buffer for writing (written only when P.y == 12345,
/// never here), so wgpu orders it after the previous dispatch with a barrier: the barrier's cost
/// without any work.
const EMPTY_BARRIER: &str = "
@group(0) @binding(0) var<storage, read_write> B: array<f32>;
@group(0) @binding(1) var<uniform> P: vec4<u32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32) {
    if (P.y == 12345u && lid == 0u) {
        B[0] = 1.0;
    }
}
";

/// One line of [`WgpuBackend::perf_dispatch`].
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct DispatchCost {
    /// What was dispatched and how (the timing mode in brackets).
    pub case: String,
    /// Dispatches in the timed batch.
    pub n_dispatches: usize,
    /// Host seconds per dispatch to record the batch and finish its command buffer.
    pub encode_secs: f64,
    /// Seconds per dispatch from submit to the batch's completion seen by the host.
    pub wall_secs: f64,
    /// GPU seconds per dispatch between the first pass's start (or the first timestamp) and the
    /// last pass's end (`None` when the adapter has no timestamp queries).
    pub gpu_secs: Option<f64>,
    /// With a timestamp before every dispatch (what `DISKFORMER_GPU_PROFILE=2` does): GPU
    /// seconds per dispatch of each kernel of the batch, from its timestamp to the next one, as
    /// the profile attributes them. Empty in the other modes.
    pub per_kernel: Vec<(String, f64)>,
}

/// How a batch is recorded and timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timing {
    /// One compute pass, timestamps at its start and end only (no query inside the chain).
    OnePass,
    /// One compute pass per dispatch, timestamps at the first's start and the last's end.
    PassPerDispatch,
    /// One compute pass, a timestamp before every dispatch and one after the last (the GPU
    /// profile's way); needs `TIMESTAMP_QUERY_INSIDE_PASSES`.
    StampEach,
}

impl Timing {
    fn label(self) -> &'static str {
        match self {
            Timing::OnePass => "one pass, no timestamp inside",
            Timing::PassPerDispatch => "a pass per dispatch",
            Timing::StampEach => "one pass, a timestamp before every dispatch as DISKFORMER_GPU_PROFILE=2",
        }
    }
}

/// One dispatch of a batch: the pipeline, its bindings, the workgroup count, and the index of
/// its kernel's name in the case's list (for the per-kernel times).
struct Item<'a> {
    pipeline: &'a wgpu::ComputePipeline,
    bind_group: Option<&'a wgpu::BindGroup>,
    groups: u32,
    kernel: usize,
}

/// What one timed batch gave.
struct Run {
    encode_secs: f64,
    wall_secs: f64,
    gpu_secs: Option<f64>,
    /// Per kernel index: (dispatches, GPU seconds) from per-dispatch timestamps.
    per_kernel: Vec<(usize, f64)>,
}

/// A device of its own with timestamp queries (and subgroups) when offered.
struct Probe {
    device: wgpu::Device,
    queue: wgpu::Queue,
    timestamps: Option<Timestamps>,
    /// Timestamps may be written between dispatches inside a pass.
    inside_passes: bool,
    subgroups: bool,
    max_wg: u32,
}

struct Timestamps {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// Timestamps the set holds.
    capacity: u32,
    /// Nanoseconds per timestamp tick.
    period_ns: f64,
}

/// Most timestamps one query set may hold (wgpu's limit).
const MAX_QUERIES: u32 = 4096;

fn failed(why: String) -> OpError {
    OpError::Unsupported { op: "perf_dispatch", backend: "wgpu", why }
}

/// `DISKFORMER_PROBE=a,norm_reg`: only the cases whose label contains one of the parts (all when
/// unset), so one kernel's variants can be compared alone.
fn case_filter() -> Vec<String> {
    std::env::var("DISKFORMER_PROBE")
        .map(|v| v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect())
        .unwrap_or_default()
}

impl Probe {
    fn open(adapter_index: usize) -> Result<Probe, OpError> {
        let list = adapters(&instance());
        let adapter = list.get(adapter_index).ok_or_else(|| failed(format!("adapter {adapter_index} is gone")))?;
        let wanted =
            wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES | wgpu::Features::SUBGROUP;
        let features = adapter.features() & wanted;
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("dispatch probe"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| failed(format!("device refused: {e}")))?;
        let timestamps = features.contains(wgpu::Features::TIMESTAMP_QUERY).then(|| {
            let capacity = MAX_QUERIES;
            Timestamps {
                set: device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("probe timestamps"),
                    ty: wgpu::QueryType::Timestamp,
                    count: capacity,
                }),
                resolve: device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("probe resolve"),
                    size: 8 * u64::from(capacity),
                    usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                }),
                readback: device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("probe readback"),
                    size: 8 * u64::from(capacity),
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                }),
                capacity,
                period_ns: f64::from(queue.get_timestamp_period()),
            }
        });
        Ok(Probe {
            device,
            queue,
            timestamps,
            inside_passes: features.contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            max_wg: limits.max_compute_invocations_per_workgroup.min(limits.max_compute_workgroup_size_x),
        })
    }

    fn pipeline(&self, label: &str, source: &str, zero_init: bool) -> wgpu::ComputePipeline {
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &[],
                zero_initialize_workgroup_memory: zero_init,
            },
            cache: None,
        })
    }

    fn storage(&self, size_bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("probe storage"),
            size: size_bytes.max(16),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    }

    fn uniform(&self, words: &[u32]) -> wgpu::Buffer {
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("probe params"),
            size: (4 * words.len() as u64).next_multiple_of(16),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.queue.write_buffer(&buf, 0, bytemuck::cast_slice(words));
        buf
    }

    fn bind(&self, pipeline: &wgpu::ComputePipeline, buffers: &[&wgpu::Buffer]) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        })
    }

    /// Whether `timing` can be measured here, and for how many dispatches.
    fn supports(&self, timing: Timing, n_dispatches: usize) -> bool {
        match timing {
            Timing::OnePass | Timing::PassPerDispatch => true,
            Timing::StampEach => {
                self.inside_passes && self.timestamps.as_ref().is_some_and(|t| n_dispatches < t.capacity as usize)
            }
        }
    }

    /// Records, submits and waits for one batch.
    fn run_once(&self, items: &[Item<'_>], timing: Timing, n_kernels: usize) -> Result<Run, OpError> {
        let recording = std::time::Instant::now();
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("probe") });
        let stamps = self.timestamps.as_ref();
        let n_passes = if timing == Timing::PassPerDispatch { items.len() } else { 1 };
        let per_pass = items.len().div_ceil(n_passes);
        let n_stamps = match timing {
            Timing::StampEach => items.len() as u32 + 1,
            _ => 2,
        };
        for (p, chunk) in items.chunks(per_pass).enumerate() {
            let first_or_last = p == 0 || p + 1 == n_passes;
            let timestamp_writes = stamps.filter(|_| first_or_last && timing != Timing::StampEach).map(|t| {
                wgpu::ComputePassTimestampWrites {
                    query_set: &t.set,
                    beginning_of_pass_write_index: (p == 0).then_some(0),
                    end_of_pass_write_index: (p + 1 == n_passes).then_some(1),
                }
            });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes });
            for (i, item) in chunk.iter().enumerate() {
                pass.set_pipeline(item.pipeline);
                if let Some(bg) = item.bind_group {
                    pass.set_bind_group(0, bg, &[]);
                }
                if let (Timing::StampEach, Some(t)) = (timing, stamps) {
                    pass.write_timestamp(&t.set, (p * per_pass + i) as u32);
                }
                pass.dispatch_workgroups(item.groups, 1, 1);
            }
            if let (Timing::StampEach, Some(t)) = (timing, stamps) {
                pass.write_timestamp(&t.set, items.len() as u32);
            }
        }
        if let Some(t) = stamps {
            enc.resolve_query_set(&t.set, 0..n_stamps, &t.resolve, 0);
            enc.copy_buffer_to_buffer(&t.resolve, 0, &t.readback, 0, 8 * u64::from(n_stamps));
        }
        let cmd = enc.finish();
        let encode_secs = recording.elapsed().as_secs_f64();
        let running = std::time::Instant::now();
        self.queue.submit([cmd]);
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| failed(format!("device lost while waiting: {e}")))?;
        let wall_secs = running.elapsed().as_secs_f64();
        let mut run = Run { encode_secs, wall_secs, gpu_secs: None, per_kernel: vec![(0, 0.0); n_kernels] };
        let Some(t) = stamps else { return Ok(run) };
        let size = 8 * u64::from(n_stamps);
        let (tx, rx) = std::sync::mpsc::channel();
        t.readback.slice(..size).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| failed(format!("device lost while mapping: {e}")))?;
        match rx.recv() {
            Ok(Ok(())) => {}
            other => return Err(failed(format!("timestamp readback failed: {other:?}"))),
        }
        let ticks: Vec<u64> = t
            .readback
            .slice(..size)
            .get_mapped_range()
            .map(|view| bytemuck::cast_slice::<u8, u64>(&view).to_vec())
            .map_err(|e| failed(format!("timestamp readback failed: {e:?}")))?;
        t.readback.unmap();
        let secs = |a: u64, b: u64| b.wrapping_sub(a) as f64 * t.period_ns * 1e-9;
        let last = ticks.len() - 1;
        run.gpu_secs = Some(secs(ticks[0], ticks[last]));
        if timing == Timing::StampEach {
            for (i, item) in items.iter().enumerate() {
                let e = &mut run.per_kernel[item.kernel];
                e.0 += 1;
                e.1 += secs(ticks[i], ticks[i + 1]);
            }
        }
        Ok(run)
    }

    /// Median over five batches after a quarter second of the same work (clocks ramp up).
    fn measure(&self, case: &str, names: &[&str], items: &[Item<'_>], timing: Timing) -> Result<DispatchCost, OpError> {
        let warm = std::time::Instant::now();
        while warm.elapsed().as_secs_f64() < 0.25 {
            self.run_once(items, timing, names.len())?;
        }
        let mut runs = Vec::with_capacity(5);
        for _ in 0..5 {
            runs.push(self.run_once(items, timing, names.len())?);
        }
        let median = |mut v: Vec<f64>| -> f64 {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let n = items.len() as f64;
        let gpu = runs.iter().map(|r| r.gpu_secs).collect::<Option<Vec<f64>>>();
        let per_kernel = if timing == Timing::StampEach {
            names
                .iter()
                .enumerate()
                .filter(|(k, _)| runs[0].per_kernel[*k].0 > 0)
                .map(|(k, name)| {
                    let count = runs[0].per_kernel[k].0 as f64;
                    (name.to_string(), median(runs.iter().map(|r| r.per_kernel[k].1 / count).collect()))
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok(DispatchCost {
            case: format!("{case} [{}]", timing.label()),
            n_dispatches: items.len(),
            encode_secs: median(runs.iter().map(|r| r.encode_secs).collect()) / n,
            wall_secs: median(runs.iter().map(|r| r.wall_secs).collect()) / n,
            gpu_secs: gpu.map(|g| median(g) / n),
            per_kernel,
        })
    }
}

/// A labelled batch and the timings it is measured with.
struct Case<'a> {
    label: String,
    names: Vec<&'static str>,
    items: Vec<Item<'a>>,
    timings: &'static [Timing],
}

/// The timings of a chain: without any timestamp inside it, and with one before every dispatch
/// (so the GPU profile's own cost shows as the difference).
const BOTH: &[Timing] = &[Timing::OnePass, Timing::StampEach];

impl WgpuBackend {
    /// Time per dispatch of `n_dispatches`-long batches under each condition a decode step
    /// creates (module documentation), on a second device of this back end's adapter; each chain
    /// without timestamps inside it and with one before every dispatch (the GPU profile's way).
    /// `DISKFORMER_PROBE` (comma-separated parts of case labels) picks cases.
    ///
    /// # Errors
    /// The adapter refuses a second device, or the device is lost.
    #[doc(hidden)]
    pub fn perf_dispatch(&self, n_dispatches: usize) -> Result<Vec<DispatchCost>, OpError> {
        let probe = Probe::open(self.ctx.adapter.index)?;
        let n = n_dispatches.clamp(2, MAX_QUERIES as usize - 2);
        let one = |pipeline, bind_group, groups| Item { pipeline, bind_group, groups, kernel: 0 };
        let mut cases: Vec<Case> = Vec::new();

        let tiny = probe.pipeline("probe tiny", TINY, true);
        let tiny_params = probe.uniform(&[64, 0, 0, 0]);
        let shared_buf = probe.storage(256);
        let same = probe.bind(&tiny, &[&shared_buf, &tiny_params]);
        let own: Vec<wgpu::Buffer> = (0..n).map(|_| probe.storage(256)).collect();
        let own_groups: Vec<wgpu::BindGroup> = own.iter().map(|b| probe.bind(&tiny, &[b, &tiny_params])).collect();
        let dependent = || (0..n).map(|_| one(&tiny, Some(&same), 1)).collect::<Vec<_>>();
        let independent = || own_groups.iter().map(|bg| one(&tiny, Some(bg), 1)).collect::<Vec<_>>();
        cases.push(Case {
            label: format!("a) dependent: {n} x tiny kernel (1 workgroup), each writing the same buffer"),
            names: vec!["tiny"],
            items: dependent(),
            timings: BOTH,
        });
        cases.push(Case {
            label: format!("b) independent: {n} x tiny kernel, each writing its own buffer"),
            names: vec!["tiny"],
            items: independent(),
            timings: BOTH,
        });
        cases.push(Case {
            label: format!("c) dependent: {n} x tiny kernel"),
            names: vec!["tiny"],
            items: dependent(),
            timings: &[Timing::PassPerDispatch],
        });
        cases.push(Case {
            label: format!("c) independent: {n} x tiny kernel"),
            names: vec!["tiny"],
            items: independent(),
            timings: &[Timing::PassPerDispatch],
        });

        let empty = probe.pipeline("probe empty", EMPTY, false);
        cases.push(Case {
            label: format!("g) {n} x empty kernel binding nothing (launch, no barrier)"),
            names: vec!["empty"],
            items: (0..n).map(|_| one(&empty, None, 1)).collect(),
            timings: BOTH,
        });
        let empty_barrier = probe.pipeline("probe empty barrier", EMPTY_BARRIER, false);
        let empty_bg = probe.bind(&empty_barrier, &[&shared_buf, &tiny_params]);
        cases.push(Case {
            label: format!("h) dependent: {n} x empty kernel binding a buffer for writing (a barrier, no work)"),
            names: vec!["empty+barrier"],
            items: (0..n).map(|_| one(&empty_barrier, Some(&empty_bg), 1)).collect(),
            timings: BOTH,
        });

        let n_workgroups = 128u32;
        let shared_out = probe.storage(4 * 256 * u64::from(n_workgroups));
        let shared_params = probe.uniform(&[256 * n_workgroups, 0, 0, 0]);
        let shared_pipes: Vec<(bool, wgpu::ComputePipeline)> =
            [true, false].map(|z| (z, probe.pipeline("probe shared", SHARED, z))).into();
        let shared_bgs: Vec<wgpu::BindGroup> =
            shared_pipes.iter().map(|(_, p)| probe.bind(p, &[&shared_out, &shared_params])).collect();
        for ((zero_init, pipe), bg) in shared_pipes.iter().zip(&shared_bgs) {
            cases.push(Case {
                label: format!(
                    "d) dependent: {n} x 8 KiB-workgroup-memory kernel ({n_workgroups} workgroups), zero_initialize_workgroup_memory {zero_init}"
                ),
                names: vec!["shared"],
                items: (0..n).map(|_| one(pipe, Some(bg), n_workgroups)).collect(),
                timings: &[Timing::OnePass],
            });
        }

        let width = 4096u32;
        let n_blocks = width / 32;
        let x = probe.storage(4 * u64::from(width));
        let norm_w = probe.storage(4 * u64::from(width));
        let qs = probe.storage(u64::from(width));
        let ds = probe.storage(8 * u64::from(n_blocks));
        let q_params = probe.uniform(&[n_blocks, 0, 0, 0]);
        let quantize = probe.pipeline("probe quantize_q8", &Plain::QuantizeQ8.source(), false);
        let quantize_bg = probe.bind(&quantize, &[&x, &qs, &ds, &q_params]);
        cases.push(Case {
            label: format!("e) dependent: {n} x quantize_q8 of {width} values (quantize_q8.wgsl)"),
            names: vec!["quantize_q8"],
            items: (0..n).map(|_| one(&quantize, Some(&quantize_bg), n_blocks.div_ceil(64))).collect(),
            timings: BOTH,
        });

        // The RMS norm of one 4096-wide row, the first dispatch of every layer: norm.wgsl without
        // weight or int8 blocks (as the fifth session measured it) and as a decode runs it (weight
        // and int8 blocks), then norm_reg.wgsl in several shapes.
        let y = probe.storage(4 * u64::from(width));
        let dummy = probe.storage(16);
        let params = |w: bool, q8: bool| probe.uniform(&[width, 1, 0, 1e-5f32.to_bits(), w as u32, 0, q8 as u32, 0]);
        let (plain_params, decode_params) = (params(false, false), params(true, true));
        let old_norm = probe.pipeline("probe norm", &Plain::Norm.source(), false);
        let old_plain_bg = probe.bind(&old_norm, &[&x, &dummy, &dummy, &y, &y, &y, &plain_params]);
        let old_decode_bg = probe.bind(&old_norm, &[&x, &norm_w, &dummy, &y, &qs, &ds, &decode_params]);
        cases.push(Case {
            label: format!("f) dependent: {n} x rms_norm of 1x{width} (norm.wgsl), no weight, no int8 blocks"),
            names: vec!["norm.wgsl"],
            items: (0..n).map(|_| one(&old_norm, Some(&old_plain_bg), 1)).collect(),
            timings: BOTH,
        });
        cases.push(Case {
            label: format!("f) dependent: {n} x rms_norm of 1x{width} (norm.wgsl), weight and int8 blocks (decode)"),
            names: vec!["norm.wgsl q8"],
            items: (0..n).map(|_| one(&old_norm, Some(&old_decode_bg), 1)).collect(),
            timings: BOTH,
        });
        let mut reg_variants: Vec<(super::norm::NormShape, bool, bool)> = Vec::new();
        let auto = super::norm::NormShape::for_width(width as usize, probe.max_wg, super::norm::NormChoice::Auto);
        for wg in [256u32, 1024, 128, 512] {
            let shape = super::norm::NormShape { wg, nv: (width / 4).div_ceil(wg) };
            if wg > probe.max_wg {
                continue;
            }
            if probe.subgroups {
                reg_variants.push((shape, true, true));
            }
            if Some(shape) == auto {
                reg_variants.push((shape, false, true));
                if probe.subgroups {
                    reg_variants.push((shape, true, false));
                }
            }
        }
        let reg_pipes: Vec<wgpu::ComputePipeline> = reg_variants
            .iter()
            .map(|(shape, sg, _)| probe.pipeline("probe norm_reg", &shape.source(*sg), false))
            .collect();
        let reg_bgs: Vec<wgpu::BindGroup> = reg_variants
            .iter()
            .zip(&reg_pipes)
            .map(|((_, _, q8), pipe)| {
                if *q8 {
                    probe.bind(pipe, &[&x, &norm_w, &dummy, &y, &qs, &ds, &decode_params])
                } else {
                    probe.bind(pipe, &[&x, &norm_w, &dummy, &y, &y, &y, &params(true, false)])
                }
            })
            .collect();
        for (((shape, sg, q8), pipe), bg) in reg_variants.iter().zip(&reg_pipes).zip(&reg_bgs) {
            let what = if *q8 { "weight and int8 blocks (decode)" } else { "weight, no int8 blocks" };
            let reduce = if *sg { "subgroups" } else { "workgroup memory only" };
            cases.push(Case {
                label: format!(
                    "j) dependent: {n} x rms_norm of 1x{width} (norm_reg.wgsl {}x{} vec4, {reduce}), {what}",
                    shape.wg, shape.nv
                ),
                names: vec!["norm_reg"],
                items: (0..n).map(|_| one(pipe, Some(bg), 1)).collect(),
                timings: BOTH,
            });
        }

        // In context: each small kernel after a 9.4 MB streaming read (an 8B model's o-proj in
        // Q4_0), as in a decode, where the small kernel waits for the big one's last workgroups.
        let stream_bytes = 9_437_184u64;
        let stream_src = probe.storage(stream_bytes);
        let stream_groups = 132 * 16;
        let stream_out = probe.storage(4 * u64::from(stream_groups));
        let stream_params = probe.uniform(&[(stream_bytes / 16) as u32, 0, 0, 0]);
        let stream = probe.pipeline("probe stream", &Plain::Stream.source(), true);
        let stream_bg = probe.bind(&stream, &[&stream_src, &stream_out, &stream_params]);
        let big = || Item { pipeline: &stream, bind_group: Some(&stream_bg), groups: stream_groups, kernel: 0 };
        cases.push(Case {
            label: format!("k) dependent: {n} x streaming read of {} MB", stream_bytes >> 20),
            names: vec!["stream 9 MB"],
            items: (0..n).map(|_| big()).collect(),
            timings: BOTH,
        });
        let mut small: Vec<(&'static str, &wgpu::ComputePipeline, Option<&wgpu::BindGroup>, u32)> = vec![
            ("empty+barrier", &empty_barrier, Some(&empty_bg), 1),
            ("tiny", &tiny, Some(&same), 1),
            ("quantize_q8", &quantize, Some(&quantize_bg), n_blocks.div_ceil(64)),
            ("norm.wgsl q8", &old_norm, Some(&old_decode_bg), 1),
        ];
        if let Some(k) = reg_variants.iter().position(|(s, sg, q8)| Some(*s) == auto && *sg == probe.subgroups && *q8) {
            small.push(("norm_reg q8", &reg_pipes[k], Some(&reg_bgs[k]), 1));
        }
        for (name, pipe, bg, groups) in small {
            let items =
                (0..n / 2).flat_map(|_| [big(), Item { pipeline: pipe, bind_group: bg, groups, kernel: 1 }]).collect();
            cases.push(Case {
                label: format!("k) dependent: {} x (streaming read of {} MB, then {name})", n / 2, stream_bytes >> 20),
                names: vec!["stream 9 MB", name],
                items,
                timings: BOTH,
            });
        }

        let filter = case_filter();
        let mut out = Vec::new();
        for case in &cases {
            if !filter.is_empty() && !filter.iter().any(|f| case.label.contains(f.as_str())) {
                continue;
            }
            for &timing in case.timings {
                if probe.supports(timing, case.items.len()) {
                    out.push(probe.measure(&case.label, &case.names, &case.items, timing)?);
                }
            }
        }
        Ok(out)
    }
}

/// One way of making a host round trip, timed in phases by [`WgpuBackend::perf_round_trip_parts`]:
/// medians over the trips, in seconds.
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct RoundTripParts {
    /// What the trip does.
    pub case: String,
    /// Recording the commands and finishing the command buffer.
    pub encode_secs: f64,
    /// The `submit` call itself.
    pub submit_secs: f64,
    /// From the submit's return to the host seeing the work done (the map's callback, or the
    /// queue's work-done callback, whichever the case waits for first).
    pub done_secs: f64,
    /// After that: mapping the readback buffer (when not already part of `done_secs`), copying
    /// its bytes out and unmapping.
    pub read_secs: f64,
    /// The whole trip, and its 10th and 90th percentiles.
    pub total_secs: f64,
    pub total_p10_secs: f64,
    pub total_p90_secs: f64,
}

/// How a round trip learns that the GPU is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Done {
    /// The readback buffer's `map_async` callback, polling in a loop (the back end's way).
    MapSpin,
    /// The same, blocking in the driver (`DISKFORMER_READBACK_BLOCK=1`).
    MapBlock,
    /// `on_submitted_work_done`'s callback, polling in a loop; the buffer mapped after.
    WorkDoneSpin,
}

impl WgpuBackend {
    /// Where a host round trip's time goes (issue 6: one per MoE layer under the split miss
    /// mode, ~55 us bare on the H200 where the layer's attention section adds ~30): `trips`
    /// trips of each case on a second device of this back end's adapter, each a tiny kernel
    /// writing an 8 KiB hidden state, its copy into a `MAP_READ` buffer and the read, timed in
    /// phases; plus a trip with no kernel (an empty command buffer: submit and completion
    /// alone).
    ///
    /// # Errors
    /// The adapter refuses a second device, or the device is lost.
    #[doc(hidden)]
    pub fn perf_round_trip_parts(&self, trips: usize) -> Result<Vec<RoundTripParts>, OpError> {
        use std::sync::atomic::{AtomicU8, Ordering};
        use std::time::Instant;
        let probe = Probe::open(self.ctx.adapter.index)?;
        const BYTES: u64 = 8192;
        let tiny = probe.pipeline("probe tiny", TINY, true);
        let params = probe.uniform(&[64, 0, 0, 0]);
        let state = probe.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("probe state"),
            size: BYTES,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = probe.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("probe round trip"),
            size: BYTES,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let bind = probe.bind(&tiny, &[&state, &params]);
        let lost = |e: wgpu::PollError| failed(format!("device lost while waiting: {e}"));
        let spin_until = |flag: &AtomicU8| -> Result<(), OpError> {
            while flag.load(Ordering::Acquire) == 0 {
                probe.device.poll(wgpu::PollType::Poll).map_err(lost)?;
                std::hint::spin_loop();
            }
            Ok(())
        };
        let cases: [(&str, bool, Done); 4] = [
            ("kernel + copy, map callback, spinning (the back end's readback)", true, Done::MapSpin),
            ("kernel + copy, map callback, blocking", true, Done::MapBlock),
            ("kernel + copy, work-done callback spinning, then map", true, Done::WorkDoneSpin),
            ("empty command buffer, work-done callback spinning", false, Done::WorkDoneSpin),
        ];
        let mut out = Vec::new();
        for (label, with_kernel, done) in cases {
            let mut phases: Vec<[f64; 5]> = Vec::with_capacity(trips);
            for trip in 0..trips + 20 {
                let t0 = Instant::now();
                let mut enc = probe.device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
                if with_kernel {
                    {
                        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
                        pass.set_pipeline(&tiny);
                        pass.set_bind_group(0, &bind, &[]);
                        pass.dispatch_workgroups(1, 1, 1);
                    }
                    enc.copy_buffer_to_buffer(&state, 0, &readback, 0, BYTES);
                }
                let cmd = enc.finish();
                let t1 = Instant::now();
                probe.queue.submit([cmd]);
                let t2 = Instant::now();
                let work_done = Arc::new(AtomicU8::new(0));
                let mapped = Arc::new(AtomicU8::new(0));
                let map = |mapped: &Arc<AtomicU8>| {
                    let flag = mapped.clone();
                    readback.slice(..).map_async(wgpu::MapMode::Read, move |r| {
                        flag.store(if r.is_ok() { 1 } else { 2 }, Ordering::Release);
                    });
                };
                match done {
                    Done::MapSpin => {
                        if with_kernel {
                            map(&mapped);
                            spin_until(&mapped)?;
                        }
                    }
                    Done::MapBlock => {
                        map(&mapped);
                        probe.device.poll(wgpu::PollType::wait_indefinitely()).map_err(lost)?;
                    }
                    Done::WorkDoneSpin => {
                        let flag = work_done.clone();
                        probe.queue.on_submitted_work_done(move || flag.store(1, Ordering::Release));
                        spin_until(&work_done)?;
                    }
                }
                let t3 = Instant::now();
                if with_kernel {
                    if done == Done::WorkDoneSpin {
                        map(&mapped);
                        spin_until(&mapped)?;
                    }
                    if mapped.load(Ordering::Acquire) != 1 {
                        return Err(failed("round trip mapping failed".into()));
                    }
                    let view = readback.slice(..).get_mapped_range().map_err(|e| failed(format!("{e:?}")))?;
                    std::hint::black_box(view.to_vec());
                    drop(view);
                    readback.unmap();
                }
                let t4 = Instant::now();
                if trip >= 20 {
                    let s = |a: Instant, b: Instant| (b - a).as_secs_f64();
                    phases.push([s(t0, t1), s(t1, t2), s(t2, t3), s(t3, t4), s(t0, t4)]);
                }
            }
            let median = |i: usize| {
                let mut v: Vec<f64> = phases.iter().map(|p| p[i]).collect();
                v.sort_by(f64::total_cmp);
                (v[v.len() / 2], v[v.len() / 10], v[v.len() * 9 / 10])
            };
            let total = median(4);
            out.push(RoundTripParts {
                case: label.to_string(),
                encode_secs: median(0).0,
                submit_secs: median(1).0,
                done_secs: median(2).0,
                read_secs: median(3).0,
                total_secs: total.0,
                total_p10_secs: total.1,
                total_p90_secs: total.2,
            });
        }
        Ok(out)
    }
}

/// `perf_mailbox`'s kernels. The host writes words 16..80 of U and then its word 0 (round i);
/// the GPU checks those words, writes words 16..80 of D and then D's word 0. D's word 1 records
/// a round whose wait ran out of spins, word 2 counts rounds that saw stale data. U lies in the
/// GPU's memory (mailbox.rs: the H200 never saw a second host write to system memory that it
/// had read once), D in system memory.
const MAILBOX_PING_PONG: &str = "
@group(0) @binding(0) var<storage, read_write> U: array<atomic<u32>>;
@group(0) @binding(1) var<storage, read_write> D: array<atomic<u32>>;
@group(0) @binding(2) var<uniform> P: vec4<u32>;

@compute @workgroup_size(1)
fn main() {
    for (var i = 1u; i <= P.x; i++) {
        var spins = 0u;
        loop {
            if (atomicLoad(&U[0]) == i) { break; }
            spins += 1u;
            if (spins >= P.y) { atomicStore(&D[1], i); return; }
        }
        var bad = 0u;
        for (var w = 16u; w < 80u; w++) {
            if (atomicLoad(&U[w]) != i) { bad += 1u; }
        }
        if (bad > 0u) { atomicAdd(&D[2], 1u); }
        for (var w = 16u; w < 80u; w++) {
            atomicStore(&D[w], i);
        }
        atomicStore(&D[0], i);
    }
}
";

/// A chain's wait: round `C[0] + 1` starts when the host's U[0] says so (one invocation spins,
/// the workgroup then checks the host's data).
const MAILBOX_WAIT: &str = "
@group(0) @binding(0) var<storage, read_write> U: array<atomic<u32>>;
@group(0) @binding(1) var<storage, read_write> D: array<atomic<u32>>;
@group(0) @binding(2) var<storage, read_write> C: array<u32>;
@group(0) @binding(3) var<uniform> P: vec4<u32>;

var<workgroup> timed_out: u32;
var<workgroup> round: u32;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32) {
    // One invocation reads the round and shares it (all must wait for the same one).
    if (lid == 0u) {
        round = select(C[0] + 1u, P.z, P.z != 0u);
    }
    workgroupBarrier();
    let want = round;
    if (lid == 0u) {
        timed_out = 0u;
        var spins = 0u;
        loop {
            if (atomicLoad(&U[0]) == want) { break; }
            spins += 1u;
            if (spins >= P.y) { atomicStore(&D[1], want); timed_out = 1u; break; }
        }
    }
    // A storage barrier (not only workgroupBarrier, which orders workgroup memory alone):
    // without it the compiler may read the data before the flag was seen (lavapipe did).
    storageBarrier();
    workgroupBarrier();
    if (timed_out == 0u && atomicLoad(&U[16u + lid]) != want) {
        atomicAdd(&D[2], 1u);
    }
    workgroupBarrier();
    if (lid == 0u) {
        C[0] = want;
    }
}
";

/// A chain's signal: the round's data (D's words 16..80) by 64 invocations, then its flag (D[0]).
const MAILBOX_SIGNAL: &str = "
@group(0) @binding(0) var<storage, read_write> D: array<atomic<u32>>;
@group(0) @binding(1) var<storage, read_write> C: array<u32>;
@group(0) @binding(2) var<uniform> P: vec4<u32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32) {
    let v = select(C[0], P.z, P.z != 0u);
    atomicStore(&D[16u + lid], v);
    storageBarrier();
    if (lid == 0u) {
        atomicStore(&D[0], v);
    }
}
";

impl WgpuBackend {
    /// Whether host-mapped mailboxes (`mailbox.rs`) carry data both ways while the GPU runs, and
    /// how fast: `rounds` host-GPU round trips through memory polling, (1) inside one kernel,
    /// (2) as a chain of dispatches (wait, a tiny kernel, signal) submitted at once, (3) the
    /// same chain with each round's command buffer submitted while the GPU waits in the round
    /// before (how the split would use it). Each line: the case, the median and 90th
    /// percentile per round, rounds that timed out or saw stale data. On a second device of
    /// this back end's adapter.
    ///
    /// # Errors
    /// Not Vulkan, no host-coherent memory, or the device is lost.
    #[doc(hidden)]
    pub fn perf_mailbox(&self, rounds: usize) -> Result<Vec<String>, OpError> {
        use super::mailbox::{Mailbox, Toward};
        use std::time::{Duration, Instant};
        let probe = Probe::open(self.ctx.adapter.index)?;
        let new = |toward| {
            Mailbox::new(&probe.device, 256, toward)
                .map_err(failed)?
                .ok_or_else(|| failed("no Vulkan device or no host-coherent memory for a mailbox".into()))
        };
        let (up, down) = (new(Toward::Gpu)?, new(Toward::Host)?);
        // ~0.3-1 s of polling over PCIe on the H200, less on a CPU adapter: a GPU that never sees
        // the host's flag stops waiting by itself.
        const SPIN_LIMIT: u32 = 1 << 18;
        let timeout = Duration::from_secs(1);
        let lost = |e: wgpu::PollError| failed(format!("device lost: {e}"));
        let mut out = Vec::new();
        let summary = |label: &str, mut secs: Vec<f64>, down: &Mailbox, host_stale: usize| -> String {
            secs.sort_by(f64::total_cmp);
            let at = |q: f64| secs.get(((secs.len() as f64 * q) as usize).min(secs.len().saturating_sub(1))).copied();
            let us = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.2}", v * 1e6));
            format!(
                "{label}: {} rounds, median {} us, p90 {} us; GPU timed out at round {}, GPU saw stale data {}x, host saw stale data {host_stale}x",
                secs.len(),
                us(at(0.5)),
                us(at(0.9)),
                down.load(1),
                down.load(2),
            )
        };
        let reset = || {
            up.write(0, &[0; 256]);
            down.write(0, &[0; 256]);
        };
        // The host's side of round i: data, flag, then the GPU's answer and its data.
        let round = |i: u32, stale: &mut usize| -> Result<f64, OpError> {
            let t = Instant::now();
            up.write(16, &[i; 64]);
            up.store(0, i);
            down.wait_for(0, i, timeout).map_err(|seen| {
                failed(format!("round {i}: the GPU's flag stayed at {seen} (timed out at {})", down.load(1)))
            })?;
            let secs = t.elapsed().as_secs_f64();
            let mut got = [0u32; 64];
            down.read(16, &mut got);
            if got.iter().any(|&g| g != i) {
                *stale += 1;
            }
            Ok(secs)
        };

        // (1) One kernel.
        reset();
        let pp = probe.pipeline("mailbox ping-pong", MAILBOX_PING_PONG, true);
        let params = probe.uniform(&[rounds as u32, SPIN_LIMIT, 0, 0]);
        let bind = probe.bind(&pp, &[up.buffer(), down.buffer(), &params]);
        let mut enc = probe.device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            pass.set_pipeline(&pp);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(1, 1, 1);
        }
        probe.queue.submit([enc.finish()]);
        // Every round after one submission: their times, stale reads, the first failure.
        let all_rounds = || {
            let (mut secs, mut stale) = (Vec::new(), 0);
            for i in 1..=rounds as u32 {
                match round(i, &mut stale) {
                    Ok(s) => secs.push(s),
                    Err(e) => return (secs, stale, Some(e)),
                }
            }
            (secs, stale, None)
        };
        let (secs, stale, failure) = all_rounds();
        probe.device.poll(wgpu::PollType::wait_indefinitely()).map_err(lost)?;
        out.push(summary("one kernel, ping-pong", secs, &down, stale));
        if let Some(e) = failure {
            out.push(format!("  stopped: {e}"));
        }
        // As it goes: a device that hangs in a later case still shows this one.
        eprintln!("mailbox probe: {}", out.join(" / "));

        // (2) and (3): chains of dispatches.
        let wait = probe.pipeline("mailbox wait", MAILBOX_WAIT, true);
        let signal = probe.pipeline("mailbox signal", MAILBOX_SIGNAL, true);
        let tiny = probe.pipeline("probe tiny", TINY, true);
        let tiny_params = probe.uniform(&[64, 0, 0, 0]);
        let state = probe.storage(8192);
        let bind_tiny = probe.bind(&tiny, &[&state, &tiny_params]);
        for per_round_submit in [false, true] {
            reset();
            let counter = probe.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("mailbox round"),
                size: 16,
                usage: wgpu::BufferUsages::STORAGE,
                // wgpu zeroes a buffer before its first use.
                mapped_at_creation: false,
            });
            // One submission: the rounds count on the GPU (C); one per round: each names its
            // round in its parameters, as the split's kernels do.
            let binds = |round: u32| {
                let p = probe.uniform(&[rounds as u32, SPIN_LIMIT, round, 0]);
                (
                    probe.bind(&wait, &[up.buffer(), down.buffer(), &counter, &p]),
                    probe.bind(&signal, &[down.buffer(), &counter, &p]),
                )
            };
            let record = |n: usize, round: u32| {
                let (bind_wait, bind_signal) = binds(round);
                let mut enc = probe.device.create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
                {
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
                    for _ in 0..n {
                        for (p, b) in [(&wait, &bind_wait), (&tiny, &bind_tiny), (&signal, &bind_signal)] {
                            pass.set_pipeline(p);
                            pass.set_bind_group(0, b, &[]);
                            pass.dispatch_workgroups(1, 1, 1);
                        }
                    }
                }
                enc.finish()
            };
            let (secs, stale, failure) = if per_round_submit {
                let (mut secs, mut stale) = (Vec::new(), 0);
                let mut failure = None;
                let mut cmds: Vec<wgpu::CommandBuffer> = (1..=rounds as u32).map(|i| record(1, i)).collect();
                cmds.reverse();
                let mut next = cmds.pop();
                for i in 1..=rounds as u32 {
                    // Round i's buffer went in before; round i + 1's goes in while the GPU waits.
                    if i == 1 {
                        probe.queue.submit(next.take());
                        next = cmds.pop();
                    }
                    let t = Instant::now();
                    if let Some(c) = next.take() {
                        probe.queue.submit([c]);
                        next = cmds.pop();
                    }
                    match round(i, &mut stale) {
                        // The submit counts: the host pays it within the round.
                        Ok(_) => secs.push(t.elapsed().as_secs_f64()),
                        Err(e) => {
                            failure = Some(e);
                            break;
                        }
                    }
                }
                (secs, stale, failure)
            } else {
                probe.queue.submit([record(rounds, 0)]);
                all_rounds()
            };
            // A failed round leaves the GPU waiting: release every later round.
            if failure.is_some() {
                up.store(0, u32::MAX);
            }
            probe.device.poll(wgpu::PollType::wait_indefinitely()).map_err(lost)?;
            let label = if per_round_submit {
                "chain wait/tiny/signal, each round submitted while the GPU waits in the one before"
            } else {
                "chain wait/tiny/signal, all rounds in one submission"
            };
            out.push(summary(label, secs, &down, stale));
            if let Some(e) = failure {
                out.push(format!("  stopped: {e}"));
            }
            eprintln!("mailbox probe: {}", out.join(" / "));
        }
        Ok(out)
    }
}
