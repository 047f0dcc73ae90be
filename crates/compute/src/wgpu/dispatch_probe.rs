//! What one dispatch costs apart from its work (issue 5): a decode step is ~500 small dispatches
//! that mostly depend on each other, and the step's GPU time is far above what its kernels read.
//! [`WgpuBackend::perf_dispatch`] times batches of dispatches under the conditions that might
//! cost: a barrier between dispatches (each writes the buffer the previous wrote) or none (each
//! writes its own), one compute pass per dispatch or one for all, workgroup memory zeroed by the
//! pipeline (WGSL's rule, wgpu's default) or not, and two real kernels of the step.
//!
//! It opens a second device on the back end's adapter with the timestamp features when the
//! adapter has them, so the GPU's own time per dispatch is measured next to the wall time of the
//! batch (submit to completion); the back end's device, and so every other measurement, stays as
//! it is. Bind groups are made before the timing: only the recording (reported apart), the
//! submit and the GPU's work are in the numbers.

use super::shaders::Plain;
use super::{adapters, instance, OpError, WgpuBackend};

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

/// One line of [`WgpuBackend::perf_dispatch`].
#[doc(hidden)]
#[derive(Clone, Debug)]
pub struct DispatchCost {
    /// What was dispatched and how.
    pub case: String,
    /// Dispatches in the timed batch.
    pub n_dispatches: usize,
    /// Host seconds per dispatch to record the batch and finish its command buffer.
    pub encode_secs: f64,
    /// Seconds per dispatch from submit to the batch's completion seen by the host.
    pub wall_secs: f64,
    /// GPU seconds per dispatch between the first pass's start and the last pass's end
    /// (`None` when the adapter has no timestamp queries).
    pub gpu_secs: Option<f64>,
}

/// One dispatch of a batch: the pipeline, its bindings, the workgroup count.
struct Item<'a> {
    pipeline: &'a wgpu::ComputePipeline,
    bind_group: &'a wgpu::BindGroup,
    groups: u32,
}

/// A device of its own with timestamp queries when offered.
struct Probe {
    device: wgpu::Device,
    queue: wgpu::Queue,
    timestamps: Option<Timestamps>,
}

struct Timestamps {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// Nanoseconds per timestamp tick.
    period_ns: f64,
}

fn failed(why: String) -> OpError {
    OpError::Unsupported { op: "perf_dispatch", backend: "wgpu", why }
}

impl Probe {
    fn open(adapter_index: usize) -> Result<Probe, OpError> {
        let list = adapters(&instance());
        let adapter = list.get(adapter_index).ok_or_else(|| failed(format!("adapter {adapter_index} is gone")))?;
        let wanted = wgpu::Features::TIMESTAMP_QUERY;
        let features = adapter.features() & wanted;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("dispatch probe"),
            required_features: features,
            required_limits: adapter.limits(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| failed(format!("device refused: {e}")))?;
        let timestamps = features.contains(wanted).then(|| Timestamps {
            set: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("probe timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: 2,
            }),
            resolve: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("probe resolve"),
                size: 16,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            readback: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("probe readback"),
                size: 16,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            period_ns: f64::from(queue.get_timestamp_period()),
        });
        Ok(Probe { device, queue, timestamps })
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

    /// Records, submits and waits for one batch: (encode, wall, GPU) seconds for the whole batch.
    fn run_once(&self, items: &[Item<'_>], pass_per_dispatch: bool) -> Result<(f64, f64, Option<f64>), OpError> {
        let recording = std::time::Instant::now();
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("probe") });
        let n_passes = if pass_per_dispatch { items.len() } else { 1 };
        let per_pass = items.len().div_ceil(n_passes);
        for (p, chunk) in items.chunks(per_pass).enumerate() {
            let first_or_last = p == 0 || p + 1 == n_passes;
            let timestamp_writes =
                self.timestamps.as_ref().filter(|_| first_or_last).map(|t| wgpu::ComputePassTimestampWrites {
                    query_set: &t.set,
                    beginning_of_pass_write_index: (p == 0).then_some(0),
                    end_of_pass_write_index: (p + 1 == n_passes).then_some(1),
                });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes });
            for item in chunk {
                pass.set_pipeline(item.pipeline);
                pass.set_bind_group(0, item.bind_group, &[]);
                pass.dispatch_workgroups(item.groups, 1, 1);
            }
        }
        if let Some(t) = &self.timestamps {
            enc.resolve_query_set(&t.set, 0..2, &t.resolve, 0);
            enc.copy_buffer_to_buffer(&t.resolve, 0, &t.readback, 0, 16);
        }
        let cmd = enc.finish();
        let encode_secs = recording.elapsed().as_secs_f64();
        let running = std::time::Instant::now();
        self.queue.submit([cmd]);
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| failed(format!("device lost while waiting: {e}")))?;
        let wall_secs = running.elapsed().as_secs_f64();
        let gpu_secs = match &self.timestamps {
            None => None,
            Some(t) => {
                let (tx, rx) = std::sync::mpsc::channel();
                t.readback.slice(..).map_async(wgpu::MapMode::Read, move |r| {
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
                    .slice(..)
                    .get_mapped_range()
                    .map(|view| bytemuck::cast_slice::<u8, u64>(&view).to_vec())
                    .map_err(|e| failed(format!("timestamp readback failed: {e:?}")))?;
                t.readback.unmap();
                Some(ticks[1].wrapping_sub(ticks[0]) as f64 * t.period_ns * 1e-9)
            }
        };
        Ok((encode_secs, wall_secs, gpu_secs))
    }

    /// Median over five batches after a quarter second of the same work (clocks ramp up).
    fn measure(&self, case: String, items: &[Item<'_>], pass_per_dispatch: bool) -> Result<DispatchCost, OpError> {
        let warm = std::time::Instant::now();
        while warm.elapsed().as_secs_f64() < 0.25 {
            self.run_once(items, pass_per_dispatch)?;
        }
        let mut runs = Vec::with_capacity(5);
        for _ in 0..5 {
            runs.push(self.run_once(items, pass_per_dispatch)?);
        }
        let median = |mut v: Vec<f64>| -> f64 {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let n = items.len() as f64;
        let gpu = runs.iter().map(|r| r.2).collect::<Option<Vec<f64>>>();
        Ok(DispatchCost {
            case,
            n_dispatches: items.len(),
            encode_secs: median(runs.iter().map(|r| r.0).collect()) / n,
            wall_secs: median(runs.iter().map(|r| r.1).collect()) / n,
            gpu_secs: gpu.map(|g| median(g) / n),
        })
    }
}

impl WgpuBackend {
    /// Time per dispatch of `n_dispatches`-long batches under each condition a decode step
    /// creates (module documentation), on a second device of this back end's adapter.
    ///
    /// # Errors
    /// The adapter refuses a second device, or the device is lost.
    #[doc(hidden)]
    pub fn perf_dispatch(&self, n_dispatches: usize) -> Result<Vec<DispatchCost>, OpError> {
        let probe = Probe::open(self.ctx.adapter.index)?;
        let n = n_dispatches.max(1);
        let mut out = Vec::new();

        let tiny = probe.pipeline("probe tiny", TINY, true);
        let tiny_params = probe.uniform(&[64, 0, 0, 0]);
        let shared_buf = probe.storage(256);
        let same = probe.bind(&tiny, &[&shared_buf, &tiny_params]);
        let dependent: Vec<Item> = (0..n).map(|_| Item { pipeline: &tiny, bind_group: &same, groups: 1 }).collect();
        out.push(probe.measure(
            format!("a) dependent: {n} x tiny kernel (1 workgroup), each writing the same buffer, one pass"),
            &dependent,
            false,
        )?);
        let own: Vec<wgpu::Buffer> = (0..n).map(|_| probe.storage(256)).collect();
        let own_groups: Vec<wgpu::BindGroup> = own.iter().map(|b| probe.bind(&tiny, &[b, &tiny_params])).collect();
        let independent: Vec<Item> =
            own_groups.iter().map(|bg| Item { pipeline: &tiny, bind_group: bg, groups: 1 }).collect();
        out.push(probe.measure(
            format!("b) independent: {n} x tiny kernel, each writing its own buffer, one pass"),
            &independent,
            false,
        )?);
        out.push(probe.measure(
            format!("c) dependent, one compute pass per dispatch: {n} x tiny kernel"),
            &dependent,
            true,
        )?);
        out.push(probe.measure(
            format!("c) independent, one compute pass per dispatch: {n} x tiny kernel"),
            &independent,
            true,
        )?);

        let n_workgroups = 128u32;
        let shared_out = probe.storage(4 * 256 * u64::from(n_workgroups));
        let shared_params = probe.uniform(&[256 * n_workgroups, 0, 0, 0]);
        for zero_init in [true, false] {
            let pipe = probe.pipeline("probe shared", SHARED, zero_init);
            let bg = probe.bind(&pipe, &[&shared_out, &shared_params]);
            let items: Vec<Item> =
                (0..n).map(|_| Item { pipeline: &pipe, bind_group: &bg, groups: n_workgroups }).collect();
            out.push(probe.measure(
                format!(
                    "d) dependent: {n} x 8 KiB-workgroup-memory kernel ({n_workgroups} workgroups), zero_initialize_workgroup_memory {zero_init}"
                ),
                &items,
                false,
            )?);
        }

        let width = 4096u32;
        let n_blocks = width / 32;
        let x = probe.storage(4 * u64::from(width));
        let qs = probe.storage(u64::from(width));
        let ds = probe.storage(8 * u64::from(n_blocks));
        let q_params = probe.uniform(&[n_blocks, 0, 0, 0]);
        for zero_init in [true, false] {
            let pipe = probe.pipeline("probe quantize_q8", &Plain::QuantizeQ8.source(), zero_init);
            let bg = probe.bind(&pipe, &[&x, &qs, &ds, &q_params]);
            let items: Vec<Item> =
                (0..n).map(|_| Item { pipeline: &pipe, bind_group: &bg, groups: n_blocks.div_ceil(64) }).collect();
            out.push(probe.measure(
                format!("e) dependent: {n} x quantize_q8 of {width} values (quantize_q8.wgsl), zero_init {zero_init}"),
                &items,
                false,
            )?);
        }

        // The RMS norm of one 4096-wide row: one 256-invocation workgroup with a 1 KiB
        // reduction scratch, the first dispatch of every layer.
        let y = probe.storage(4 * u64::from(width));
        let norm_params = probe.uniform(&[width, 1, 0, 1e-5f32.to_bits(), 0, 0, 0, 0]);
        let dummy = probe.storage(16);
        for zero_init in [true, false] {
            let pipe = probe.pipeline("probe norm", &Plain::Norm.source(), zero_init);
            let bg = probe.bind(&pipe, &[&x, &dummy, &dummy, &y, &y, &y, &norm_params]);
            let items: Vec<Item> = (0..n).map(|_| Item { pipeline: &pipe, bind_group: &bg, groups: 1 }).collect();
            out.push(probe.measure(
                format!("f) dependent: {n} x rms_norm of 1x{width} (norm.wgsl), zero_init {zero_init}"),
                &items,
                false,
            )?);
        }
        Ok(out)
    }
}
