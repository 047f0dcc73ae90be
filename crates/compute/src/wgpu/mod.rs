//! The GPU back end: the op set of [`Backend`] as WGSL compute kernels run through wgpu
//! (Vulkan, Metal, DX12).
//!
//! [`WgpuBackend`] keeps activations ([`WgpuTensor`]), weights ([`WgpuWeight`]) and KV caches
//! ([`WgpuCache`]) in GPU buffers. Ops do not run when called: each one appends a dispatch to a
//! pending list, and the list is recorded into one command encoder and submitted only when the
//! host needs data (`to_host`, `argmax_rows`, `route`). A decode step is therefore one submit and
//! one readback (the sampled token, or the logits when asked).
//!
//! Design choices and their reasons:
//! - Weights are repacked at upload so every block field is 4-byte aligned ([`layout`]): WGSL
//!   reads storage as 32-bit words. Each weight type contributes one `dq8` function (8 values of
//!   a block) to a shared matrix-product template, so 16 types share one kernel ([`shaders`]).
//! - Weights larger than the storage-binding limit (128 MiB by default, 2 GiB or more on large
//!   GPUs) are split by rows into chunks; stacked experts split on expert boundaries.
//! - Scratch buffers come from a pool keyed by power-of-two size and go back to it when a tensor
//!   drops. Reusing a buffer while earlier pending commands still read it is safe because the
//!   commands run in recording order; uploads are recorded as copies in that same order.
//!   `DISKFORMER_NO_POOL=1` turns reuse off to chase aliasing bugs.
//! - Subgroup reductions are used when the adapter has `SUBGROUP` (`DISKFORMER_NO_SUBGROUPS=1`
//!   forces the shared-memory fallback); `SHADER_F16` is requested and reported, but the kernels
//!   decode f16 with `unpack2x16float`, which needs no extension and keeps f32 arithmetic
//!   (the CPU reference's).
//! - The matrix product loads four weight groups per loop iteration so more loads are in flight
//!   (`DISKFORMER_NO_UNROLL=1` turns it off, for comparison in `--perf`).
//! - One-token products can take int8 activations (llama.cpp's scheme, [`int8`]): with
//!   [`WgpuBackend::with_matmul_mode`]`(QuantizedActivations)` the activations are quantized
//!   to blocks of 32 bytes once and Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights are
//!   multiplied with `dot4I8Packed`; `DISKFORMER_GPU_F32_ACT=1` forces f32 activations.
//! - Routing (`route`) runs on the GPU (`moe_route.wgsl`). A resident model's decode step keeps
//!   the expert ids there for the per-pair MoE kernels (no readback); the expert tier and prefill
//!   read the k ids and weights back (one small readback), to find misses or group by expert.
//!
//! # When to use which back end
//! The CPU back end is the reference and needs no device; this one is for machines with a GPU.
//! Tests compare the two op by op (`tests/backend_ops.rs`) and model by model.

mod dispatch_probe;
mod experts;
mod fused;
mod gpu_timer;
mod host_import;
mod int8;
pub mod layout;
mod mailbox;
mod moe;
mod norm;
mod shaders;
mod transfer;
use crate::trace;

pub use crate::ExpertTierStats;
pub use experts::{
    backend_fixed_bytes, default_staging_bytes, expert_slot_bytes, host_tier_table_reserve_bytes, weight_bytes,
    ExpertTierOptions, HostFill, MissPolicy, SlotPolicy, STAGING_BUFFERS,
};

use crate::backend::{AttnStep, Backend, Experts, Routing, SsmDims, SsmScan};
use crate::cpu::kernels;
use crate::error::OpError;
use crate::spec::{Act, AttnSpec, Glu, MoeSpec, RopeSpec, RouteSpec};
pub use crate::trace::write_trace;
use crate::weight::HostWeight;
#[doc(hidden)]
pub use dispatch_probe::{DispatchCost, RoundTripParts};
pub use fused::AttnKernel;
pub use int8::Q8Act;
use layout::TypeLayout;
#[doc(hidden)]
pub use norm::NormKernel;
use shaders::Plain;
pub use shaders::{AttnDecodeShape, MatvecShape, Q8Shape};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Why the GPU back end could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No adapter was found.
    #[error("no GPU adapter found (Vulkan, Metal or DX12); install a driver (lavapipe: mesa-vulkan-drivers) or use --device cpu")]
    NoAdapter,
    /// `--gpu N` past the adapters found.
    #[error("GPU adapter {index} requested but only {n_adapters} found; `diskformer devices` lists them")]
    BadAdapterIndex {
        /// The index asked for.
        index: usize,
        /// Adapters found.
        n_adapters: usize,
    },
    /// The adapter refused a device.
    #[error("GPU adapter {adapter:?} refused a device: {why}")]
    RequestDevice {
        /// Adapter name.
        adapter: String,
        /// The driver's reason.
        why: String,
    },
}

/// How to pick the adapter.
#[derive(Clone, Debug, Default)]
pub struct WgpuOptions {
    /// Index into [`list_adapters`] (`--gpu N`); `None` picks by preference.
    pub adapter_index: Option<usize>,
    /// Prefer a discrete GPU over an integrated one, and both over a software rasteriser.
    pub prefer_discrete: bool,
}

/// One adapter as [`list_adapters`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterSummary {
    /// Position in the list (`--gpu N`).
    pub index: usize,
    /// Device name (`NVIDIA H200`, `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub name: String,
    /// Graphics API (`Vulkan`).
    pub api: String,
    /// `DiscreteGpu`, `IntegratedGpu`, `Cpu`, ...
    pub device_type: String,
    /// Driver name and version.
    pub driver: String,
    /// Whether the adapter offers f16 in shaders.
    pub shader_f16: bool,
    /// Whether the adapter offers subgroup operations.
    pub subgroups: bool,
    /// Largest storage-buffer binding in bytes.
    pub max_storage_binding_bytes: u64,
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::PRIMARY;
    wgpu::Instance::new(desc)
}

fn adapters(inst: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    pollster::block_on(inst.enumerate_adapters(wgpu::Backends::PRIMARY))
}

fn summary(index: usize, a: &wgpu::Adapter) -> AdapterSummary {
    let info = a.get_info();
    let f = a.features();
    AdapterSummary {
        index,
        name: info.name,
        api: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info).trim().to_string(),
        shader_f16: f.contains(wgpu::Features::SHADER_F16),
        subgroups: f.contains(wgpu::Features::SUBGROUP),
        max_storage_binding_bytes: a.limits().max_storage_buffer_binding_size,
    }
}

/// Every adapter wgpu finds, in the order `--gpu N` indexes.
pub fn list_adapters() -> Vec<AdapterSummary> {
    adapters(&instance()).iter().enumerate().map(|(i, a)| summary(i, a)).collect()
}

fn preference(t: wgpu::DeviceType, prefer_discrete: bool) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu if prefer_discrete => 0,
        wgpu::DeviceType::DiscreteGpu | wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// A pooled GPU buffer; goes back to its pool on drop.
struct PooledBuffer {
    buffer: wgpu::Buffer,
    ctx: Arc<Ctx>,
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        self.ctx.release(self.buffer.clone());
    }
}

/// An f32 activation tensor in a GPU buffer.
pub struct WgpuTensor {
    buf: PooledBuffer,
    shape: Vec<usize>,
}

impl WgpuTensor {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }
    fn width(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    fn rows(&self) -> usize {
        self.len() / self.width().max(1)
    }
}

impl std::fmt::Debug for WgpuTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WgpuTensor({:?})", self.shape)
    }
}

/// Rows `row0..row0 + n_rows` of a weight in one buffer.
#[derive(Clone)]
struct WeightChunk {
    buffer: wgpu::Buffer,
    row0: usize,
    n_rows: usize,
}

/// A weight uploaded in the repacked layout, split into chunks that fit one binding. A clone
/// shares the GPU buffers.
#[derive(Clone)]
pub struct WgpuWeight {
    chunks: Vec<WeightChunk>,
    layout: TypeLayout,
    k: usize,
    n_rows: usize,
    shape: Vec<usize>,
    name: String,
    /// A table kept in host memory (`crate::weight::input_embedding_on_host`): no chunks; only
    /// `get_rows` reads it, on the host.
    host: Option<HostWeight>,
}

impl WgpuWeight {
    /// Bytes held on the GPU.
    pub fn size_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.buffer.size()).sum()
    }
    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The GGUF tensor name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// One attention layer's KV cache in GPU memory (f32 rows).
pub struct WgpuCache {
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    k_width: usize,
    v_width: usize,
    n_ctx: usize,
}

impl WgpuCache {
    /// Capacity in positions.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    /// Bytes held.
    pub fn size_bytes(&self) -> u64 {
        self.k.size() + self.v.size()
    }
}

enum Cmd {
    Dispatch {
        pipeline: Arc<wgpu::ComputePipeline>,
        buffers: Vec<wgpu::Buffer>,
        params_at: u64,
        params_len: u64,
        groups: [u32; 3],
    },
    Copy {
        src: wgpu::Buffer,
        src_at: u64,
        dst: wgpu::Buffer,
        dst_at: u64,
        size: u64,
    },
}

#[derive(Default)]
struct Pending {
    cmds: Vec<Cmd>,
    params: Vec<u8>,
    /// Where the next flush's parameters start in the ring (reset at each step boundary, so
    /// the same step layout gets the same offsets).
    params_base: u64,
    bind_groups: HashMap<BindKey, wgpu::BindGroup>,
    /// Early submits since the host last waited for a result ([`Ctx::submit_threshold`]).
    early_submits: u32,
    /// CPU results the recorded commands read, still being computed (see [`Deferred`]).
    deferred: Vec<Deferred>,
    /// The last one-row RMS norm recorded, for a router that takes its input raw and norms it
    /// itself (`WgpuBackend::take_norm_for_router`); valid while its dispatch is the last
    /// command.
    norm_mark: Option<NormMark>,
    /// The index of a norm moved after the routing kernel that took its input
    /// (`fuse_route_signal` then finds that kernel just before it).
    norm_after_route: Option<usize>,
    /// Flushes so far: a command taken out of the list and put back after one needs its
    /// parameters written again (`params` starts over at each flush).
    flushes: u64,
}

/// A one-row RMS norm's input, weight, output and epsilon, as `norm_dispatch` recorded it.
#[derive(Clone)]
pub(super) struct NormMark {
    pub(super) x: wgpu::Buffer,
    pub(super) weight: wgpu::Buffer,
    pub(super) y: wgpu::Buffer,
    pub(super) eps: f32,
}

/// A buffer the recorded commands read whose contents the CPU is still computing: the host
/// goes on recording while it does, and the next submit waits for the result and writes it
/// first (`queue.write_buffer`, which takes effect before that submit's commands). The expert
/// tier's split miss mode computes a layer's CPU experts this way while the model records the
/// next layer.
pub(crate) struct Deferred {
    /// Where the result goes (`COPY_DST`), from byte 0.
    pub(crate) buffer: wgpu::Buffer,
    /// The result, or the error that replaces it, and when the computation ended.
    pub(crate) result: std::sync::mpsc::Receiver<(Result<Vec<f32>, OpError>, std::time::Instant)>,
    /// Called once the result is in, with what the join saw.
    pub(crate) on_join: Box<dyn FnOnce(JoinSeen) + Send>,
}

/// What the host saw when it joined a [`Deferred`] result.
#[derive(Clone, Copy, Debug)]
pub(crate) struct JoinSeen {
    /// Whether the GPU had finished everything submitted before the result by then.
    pub(crate) gpu_done: bool,
    /// How long the host waited for the result.
    pub(crate) waited: std::time::Duration,
    /// How long the join took once the result was there (from the later of the computation's
    /// end and the join's start).
    pub(crate) taken_after: std::time::Duration,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pending({} commands, {} deferred)", self.cmds.len(), self.deferred.len())
    }
}

impl Pending {
    /// The host is about to wait for a result: the next step starts at the ring's start again
    /// (so its dispatches find the same bind groups) and with a short first submit.
    fn host_waits(&mut self) {
        self.params_base = 0;
        self.early_submits = 0;
    }
}

/// Little-endian f32 words of bytes read back (a `Vec<u8>` need not be 4-aligned: no cast).
fn le_f32s(bytes: &[u8]) -> Vec<f32> {
    le_words(bytes, f32::from_le_bytes)
}

/// [`le_f32s`] into `out`, replacing what it held and keeping its memory.
fn le_f32s_into(bytes: &[u8], out: &mut Vec<f32>) {
    let n = bytes.len() / 4;
    if cfg!(target_endian = "little") {
        // A mapped range starts on a page, so the cast takes it; a copy otherwise.
        if let Ok(words) = bytemuck::try_cast_slice::<u8, f32>(&bytes[..4 * n]) {
            // A generation loop reads the same length every step: no zeroing pass then.
            out.resize(n, 0.0);
            copy_on_pool(words, out);
            return;
        }
    }
    out.clear();
    out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
}

/// `dst.copy_from_slice(src)`, in pieces on the thread pool when large.
///
/// Why: a decode step's logits (608 KB for Qwen3's vocabulary) come from memory the GPU wrote,
/// not in any cache, and one core copies at its own share of the RAM's rate: ~80 us on the
/// H200's host (the thirty-third session's trace, "to_host" to "to_host copied"), on the
/// critical path between one token and the next step. Split over the pool's threads (polling
/// during a step) it takes a fraction of that.
fn copy_on_pool(src: &[f32], dst: &mut [f32]) {
    use rayon::prelude::*;
    /// Values per piece (64 KiB): big enough that a task's overhead is small beside its copy.
    const PIECE: usize = 16 * 1024;
    if src.len() <= 4 * PIECE || rayon::current_num_threads() < 2 {
        dst.copy_from_slice(src);
        return;
    }
    dst.par_chunks_mut(PIECE).zip(src.par_chunks(PIECE)).for_each(|(d, s)| d.copy_from_slice(s));
}

/// Little-endian u32 words of bytes read back.
fn le_u32s(bytes: &[u8]) -> Vec<u32> {
    le_words(bytes, u32::from_le_bytes)
}

/// Four-byte little-endian values of `bytes` (a trailing partial word is dropped). On a
/// little-endian host the bytes are the values, and one copy does it.
fn le_words<T: bytemuck::Pod + Default>(bytes: &[u8], from_le: fn([u8; 4]) -> T) -> Vec<T> {
    let n = bytes.len() / 4;
    let mut out = vec![T::default(); n];
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(&bytes[..4 * n]);
    } else {
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = from_le([b[0], b[1], b[2], b[3]]);
        }
    }
    out
}

/// A bind group is reusable when the pipeline, the buffers and the parameter slot repeat.
#[derive(PartialEq, Eq, Hash)]
struct BindKey {
    /// Address of the pipeline in the pipeline cache (which keeps it alive).
    pipeline: usize,
    buffers: Vec<wgpu::Buffer>,
    params_at: u64,
    params_len: u64,
}

/// Size of the persistent parameter ring (4096 dispatches at the usual 256-byte alignment).
const PARAMS_RING_BYTES: u64 = 1 << 20;

/// The largest staging piece a weight upload holds at once (see `upload_weight_bytes`).
const WEIGHT_UPLOAD_PIECE_BYTES: u64 = 32 << 20;

/// The smallest shared memory block the device's allocator takes from the driver.
const ALLOCATOR_MIN_BLOCK_BYTES: u64 = 4 << 20;

/// The largest shared memory block: buffers above it get a block of their own, of their size.
const ALLOCATOR_MAX_BLOCK_BYTES: u64 = 16 << 20;

/// Device memory the allocator may hold beyond the buffers in it: the unused end of the last
/// shared block of each memory type a run uses (device-local buffers, upload staging and
/// readback buffers).
pub const ALLOCATOR_SLACK_BYTES: u64 = 3 * ALLOCATOR_MAX_BLOCK_BYTES;
/// Bind groups kept; past it the cache starts over (they hold their buffers alive).
const BIND_GROUP_CACHE_MAX: usize = 8192;

/// Shared state of a back end and its clones.
struct Ctx {
    device: wgpu::Device,
    queue: wgpu::Queue,
    /// A queue for copies beside the compute queue (transfer.rs), where the device has one.
    transfer: Option<Arc<transfer::TransferQueue>>,
    /// Importing host memory the process filled (host_import.rs), where the device can.
    host_import: Option<Arc<host_import::HostImport>>,
    adapter: AdapterSummary,
    subgroups: bool,
    unroll: bool,
    /// Prefill products of `shaders::TILED_MIN_TOKENS` tokens or more take the tiled kernel
    /// (DISKFORMER_NO_TILED=1 keeps the 8-token one, for comparison).
    tiled: bool,
    /// The decode kernel's workgroup shape; `None` (DISKFORMER_NO_MATVEC=1) sends one-token
    /// products through the general `matmul` kernel.
    matvec: Option<MatvecShape>,
    /// The int8 decode kernels' workgroup shapes (DISKFORMER_MATVEC_Q8, DISKFORMER_GLU_Q8).
    matvec_q8: int8::Q8Config,
    /// DISKFORMER_GPU_F32_ACT=1: f32 activations even where int8 ones were asked for.
    force_f32_act: bool,
    /// The last int8 quantization of the automatic path (reused by the next product of the
    /// same activations).
    q8_cache: Mutex<int8::Q8Cache>,
    max_binding: u64,
    max_buffer: u64,
    params_align: usize,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
    pending: Mutex<Pending>,
    /// The error of a [`Deferred`] computation, returned by the next readback (every result
    /// the caller sees comes through one, so none is taken from a buffer the CPU failed to fill).
    /// Shared with the split's CPU jobs under its mailboxes, which fill the GPU's input
    /// themselves (experts/split.rs).
    deferred_error: Arc<Mutex<Option<OpError>>>,
    pool: Mutex<HashMap<u64, Vec<wgpu::Buffer>>>,
    pooling: bool,
    dummy: wgpu::Buffer,
    /// The routing kernel's router variant counts its finished workgroups here (one word, set
    /// back to 0 by the last; zeroed at creation). Its dispatches are ordered by the buffer.
    route_done: wgpu::Buffer,
    params_ring: wgpu::Buffer,
    /// Dispatches per early submit (see [`SUBMIT_EVERY`]).
    submit_every: usize,
    /// `read_back` polls in a loop instead of blocking in the driver (see
    /// [`WgpuBackend::read_mapped`]; `DISKFORMER_READBACK_BLOCK=1` blocks, as the expert tier's
    /// readbacks do with it). Measured on the H200 (ninth session, same lease, alternating): a
    /// one-op round trip 89-102 us blocking, 57-60 us polling; 8B decode +6% (Q4_0) and +4% (Q4_K).
    spin_readback: bool,
    /// Dispatches in the first early submit after a host wait (see [`SUBMIT_FIRST`]).
    submit_first: usize,
    /// Host-side time per phase when DISKFORMER_GPU_PROFILE=1 (printed when the back end drops).
    profile: Option<Arc<Mutex<HostProfile>>>,
    /// The largest `MAP_READ` staging buffer of `read_back`, kept for the next readback.
    readback_staging: Mutex<Option<wgpu::Buffer>>,
    /// GPU time per kernel when DISKFORMER_GPU_PROFILE=2 and the adapter has timestamps.
    timer: Option<Arc<gpu_timer::GpuTimer>>,
    /// The current step's rope cos/sin tables (shared by the layers).
    rope_tables: Mutex<fused::RopeTables>,
    /// Head dims (`hdk << 32 | hdv`) whose decode attention pipelines were all created ahead of
    /// their first use ([`fused`]'s `prepare_decode_pipelines`); `u64::MAX` before any.
    decode_pipelines_ready: std::sync::atomic::AtomicU64,
    /// Fused ops on (`DISKFORMER_NO_FUSE=1` runs the op-by-op graph, for comparison).
    fuse: bool,
    /// DISKFORMER_WG_ZERO: zero workgroup memory in every kernel (`Some(true)`), in none
    /// (`Some(false)`), or in those that read before writing (`None`, [`Ctx::pipeline_with`]).
    zero_workgroup: Option<bool>,
    /// Commands (dispatches and copies) submitted so far, for [`WgpuBackend::commands_submitted`].
    commands_submitted: std::sync::atomic::AtomicU64,
    /// Time from the end of a submit's joins of [`Deferred`] results to its return, summed.
    submit_after_join_nanos: std::sync::atomic::AtomicU64,
    /// Bind groups created so far (cache misses), for [`WgpuBackend::bind_groups_created`].
    bind_groups_created: std::sync::atomic::AtomicU64,
    /// Which norm kernel a width takes (`DISKFORMER_NORM`, [`norm`]).
    norm_choice: norm::NormChoice,
    /// One-row RMS norms take `norm_split.wgsl` (`DISKFORMER_NORM_SPLIT=0`: `norm_reg`).
    norm_split: bool,
}

/// Where the host's time goes around the GPU (DISKFORMER_GPU_PROFILE=1): a decode step is
/// recording (the op calls), encoding (bind groups and the command buffer, in `flush_locked`)
/// and waiting for results; the GPU only overlaps the part recorded after an early submit.
#[derive(Default, Debug)]
struct HostProfile {
    submits: u64,
    dispatches: u64,
    encode_secs: f64,
    wait_secs: f64,
    readbacks: u64,
    /// Printed by [`profile_reports`] already (the back end's drop then stays quiet).
    reported: bool,
    /// The GPU time per kernel, reported beside the host's (DISKFORMER_GPU_PROFILE=2).
    timer: Option<Arc<gpu_timer::GpuTimer>>,
}

impl HostProfile {
    fn report(&self) -> String {
        let host = format!(
            "gpu profile: {} submits, {} dispatches, {:.3} s encoding ({:.1} us per dispatch), {:.3} s waiting in {} readbacks",
            self.submits,
            self.dispatches,
            self.encode_secs,
            1e6 * self.encode_secs / self.dispatches.max(1) as f64,
            self.wait_secs,
            self.readbacks
        );
        match &self.timer {
            Some(t) => format!("{host}\n{}", t.report()),
            None => host,
        }
    }
}

/// Every back end's profile (DISKFORMER_GPU_PROFILE=1), so a process can print them before it
/// exits: a back end whose buffers outlive the process's last use of it (tensors cached inside
/// the back end hold it alive) never reaches `Drop`.
static PROFILES: Mutex<Vec<std::sync::Weak<Mutex<HostProfile>>>> = Mutex::new(Vec::new());

/// The host profile line of every live back end (empty unless DISKFORMER_GPU_PROFILE=1), each
/// given once: the CLI's `bench` prints them at its end.
pub fn profile_reports() -> Vec<String> {
    lock(&PROFILES)
        .drain(..)
        .filter_map(|w| w.upgrade())
        .map(|p| {
            let mut p = lock(&p);
            p.reported = true;
            p.report()
        })
        .collect()
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            {
                let p = lock(p);
                if !p.reported {
                    eprintln!("{}", p.report());
                }
            }
            // Forget back ends gone before this one (this one's entry goes with its Arc).
            lock(&PROFILES).retain(|w| w.strong_count() > 0);
        }
    }
}

/// Dispatches recorded before they are submitted without waiting for a readback, so the GPU
/// starts on a step's first layers while the host still records the rest
/// (DISKFORMER_SUBMIT_EVERY overrides it; 0: submit only when the host needs a result).
const SUBMIT_EVERY: usize = 48;

/// The first early submit after the host waited for a result takes this many dispatches, the
/// next twice as many, and so on up to [`SUBMIT_EVERY`] (DISKFORMER_SUBMIT_FIRST overrides it;
/// 0: every early submit takes `SUBMIT_EVERY`).
///
/// Why: a decode step starts with an idle GPU (the host has just read the previous token back),
/// which with a fixed 48 waited for 48 dispatches' recording (~0.2 ms at 4 us per dispatch on
/// the H200). Measured there (ninth session): no change in 8B decode with a quiet host, +1-5%
/// with the host busy (compiling on 14 of 16 cores), where recording is slower.
const SUBMIT_FIRST: usize = 4;

/// Copies `bytes` into a buffer created with `mapped_at_creation` and unmaps it.
///
/// # Panics
/// When the buffer is not mapped or smaller than `bytes`: both are bugs of this module (every
/// caller creates the buffer mapped, at least as large, the line before).
fn write_mapped(buffer: &wgpu::Buffer, bytes: &[u8]) {
    {
        let mut view = buffer.slice(..).get_mapped_range_mut().expect("buffer created mapped");
        view.slice(..bytes.len()).copy_from_slice(bytes);
    }
    buffer.unmap();
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means another thread panicked mid-op; the data (lists of buffers) stays
    // consistent, so carry on.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

const STORAGE: wgpu::BufferUsages =
    wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

impl Ctx {
    /// Dispatches that trigger the next early submit, `early_submits` of them made since the
    /// host last waited: [`SUBMIT_FIRST`] doubling up to [`SUBMIT_EVERY`].
    fn submit_threshold(&self, early_submits: u32) -> usize {
        if self.submit_first == 0 || crate::ab::is_b("submit") {
            return self.submit_every;
        }
        self.submit_first.saturating_mul(1 << early_submits.min(20)).min(self.submit_every)
    }

    fn release(&self, b: wgpu::Buffer) {
        if self.pooling {
            lock(&self.pool).entry(b.size()).or_default().push(b);
        }
    }

    /// The pipeline made under `key`, if one was: for recognizing a pending dispatch without
    /// compiling a kernel the back end may never run.
    fn pipeline_made(&self, key: &str) -> Option<Arc<wgpu::ComputePipeline>> {
        lock(&self.pipelines).get(key).cloned()
    }

    fn pipeline(&self, key: &str, source: impl FnOnce() -> String) -> Arc<wgpu::ComputePipeline> {
        self.pipeline_with(key, source, false)
    }

    /// [`pipeline`](Self::pipeline) of a kernel that may skip the zeroing of its workgroup
    /// memory when `written_first` (every read of workgroup memory follows a write of the same
    /// element by the same workgroup, argued in the shader): WGSL zeroes it at the start of every
    /// workgroup, a cost per workgroup that such a kernel does not need. DISKFORMER_WG_ZERO=1
    /// zeroes for every kernel (WGSL's rule, for comparison), =0 for none (an experiment: the other
    /// kernels are not argued).
    fn pipeline_with(
        &self,
        key: &str,
        source: impl FnOnce() -> String,
        written_first: bool,
    ) -> Arc<wgpu::ComputePipeline> {
        let mut p = lock(&self.pipelines);
        if let Some(x) = p.get(key) {
            return x.clone();
        }
        // Marks around each compile, so a trace says what a step's first run spends on them.
        crate::trace::mark("pipeline compile", None);
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(key),
            source: wgpu::ShaderSource::Wgsl(source().into()),
        });
        let pipe = Arc::new(self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(key),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &[],
                zero_initialize_workgroup_memory: self.zero_workgroup.unwrap_or(!written_first),
            },
            cache: None,
        }));
        if let Some(t) = &self.timer {
            t.name_pipeline(&pipe, key);
        }
        crate::trace::mark("pipeline made", None);
        p.insert(key.to_string(), pipe.clone());
        pipe
    }

    /// Waits for a [`Deferred`] result and writes it into its buffer (zeros after an error,
    /// which the next readback returns).
    fn join_deferred(&self, d: Deferred) {
        // A pool worker waiting here runs the pool's tasks meanwhile (the CPU job's own, most
        // likely) instead of blocking: one more core for the job it waits for.
        let waiting = std::time::Instant::now();
        let (result, ended) = loop {
            match d.result.try_recv() {
                Ok(r) => break r,
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        std::hint::spin_loop();
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    let lost = OpError::Unsupported {
                        op: "deferred cpu result",
                        backend: "wgpu",
                        why: "the computation ended without a result".into(),
                    };
                    break (Err(lost), std::time::Instant::now());
                }
            }
        };
        match result {
            Ok(values) => self.queue.write_buffer(&d.buffer, 0, bytemuck::cast_slice(&values)),
            Err(e) => {
                lock(&self.deferred_error).get_or_insert(e);
            }
        }
        // Runs the callbacks of finished work, so the hook sees whether the GPU is done.
        let gpu_done = self.device.poll(wgpu::PollType::Poll).is_ok_and(|s| s.is_queue_empty());
        let waited = waiting.elapsed();
        // From the later of the result's end and the join's start: what the join itself added.
        let taken_after = ended.elapsed().min(waited);
        (d.on_join)(JoinSeen { gpu_done, waited, taken_after });
    }

    fn flush_locked(&self, pending: &mut Pending) {
        if pending.cmds.is_empty() {
            return;
        }
        pending.norm_mark = None;
        pending.norm_after_route = None;
        pending.flushes += 1;
        trace::mark("flush", None);
        let started = self.profile.as_ref().map(|_| std::time::Instant::now());
        let n_cmds = pending.cmds.len() as u64;
        self.commands_submitted.fetch_add(n_cmds, std::sync::atomic::Ordering::Relaxed);
        // Parameters go to the persistent ring when they fit, so that a decode step, which
        // repeats the previous step's dispatches at the same ring offsets, finds its bind groups
        // in the cache instead of creating ~500 of them. `write_buffer` is ordered after the
        // reads of earlier submissions, so rewriting the ring is safe.
        let n_params = pending.params.len() as u64;
        if pending.params_base + n_params > PARAMS_RING_BYTES {
            pending.params_base = 0;
        }
        let in_ring = n_params <= PARAMS_RING_BYTES && self.pooling;
        let (params_buf, base) = if in_ring {
            self.queue.write_buffer(&self.params_ring, pending.params_base, &pending.params);
            let base = pending.params_base;
            pending.params_base = (base + n_params).next_multiple_of(self.params_align as u64);
            (self.params_ring.clone(), base)
        } else {
            let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("params"),
                size: (pending.params.len().max(256) as u64).next_multiple_of(256),
                usage: wgpu::BufferUsages::UNIFORM,
                mapped_at_creation: true,
            });
            write_mapped(&buf, &pending.params);
            (buf, 0)
        };
        if pending.bind_groups.len() > BIND_GROUP_CACHE_MAX {
            pending.bind_groups.clear();
        }
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") });
        let mut stamps = gpu_timer::Stamps::default();
        let cmds = std::mem::take(&mut pending.cmds);
        pending.params.clear();
        let mut i = 0;
        while i < cmds.len() {
            match &cmds[i] {
                Cmd::Copy { src, src_at, dst, dst_at, size } => {
                    enc.copy_buffer_to_buffer(src, *src_at, dst, *dst_at, *size);
                    i += 1;
                }
                Cmd::Dispatch { .. } => {
                    let mut pass =
                        enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
                    // Consecutive dispatches of one kernel (q/k/v, gate/up) set it once.
                    let mut pipeline_set = None;
                    while let Some(Cmd::Dispatch { pipeline, buffers, params_at, params_len, groups }) = cmds.get(i) {
                        let params_at = base + params_at;
                        let pipeline_id = Arc::as_ptr(pipeline) as usize;
                        let create = || {
                            self.bind_groups_created.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            trace::mark("bind group made", None);
                            let layout = pipeline.get_bind_group_layout(0);
                            let mut entries: Vec<wgpu::BindGroupEntry> = buffers
                                .iter()
                                .enumerate()
                                .map(|(b, buf)| wgpu::BindGroupEntry {
                                    binding: b as u32,
                                    resource: buf.as_entire_binding(),
                                })
                                .collect();
                            entries.push(wgpu::BindGroupEntry {
                                binding: buffers.len() as u32,
                                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                    buffer: &params_buf,
                                    offset: params_at,
                                    size: wgpu::BufferSize::new(*params_len),
                                }),
                            });
                            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                                label: None,
                                layout: &layout,
                                entries: &entries,
                            })
                        };
                        let bg = if in_ring {
                            let key = BindKey {
                                pipeline: pipeline_id,
                                buffers: buffers.clone(),
                                params_at,
                                params_len: *params_len,
                            };
                            pending.bind_groups.entry(key).or_insert_with(create).clone()
                        } else {
                            create()
                        };
                        if pipeline_set != Some(pipeline_id) {
                            pass.set_pipeline(pipeline);
                            pipeline_set = Some(pipeline_id);
                        }
                        pass.set_bind_group(0, &bg, &[]);
                        if let Some(t) = &self.timer {
                            t.stamp(&mut pass, &mut stamps, Some(pipeline_id));
                        }
                        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                        i += 1;
                    }
                    if let Some(t) = &self.timer {
                        t.stamp(&mut pass, &mut stamps, None);
                    }
                }
            }
        }
        if let Some(t) = &self.timer {
            t.resolve(&mut enc, &stamps);
        }
        let commands = enc.finish();
        trace::mark("encoded", None);
        // The CPU results this submit reads are waited for only now, with its commands encoded:
        // their `write_buffer`s still land before them (wgpu runs a submit's pending writes
        // first), and the encoding overlapped the CPU's work.
        let joins = std::mem::take(&mut pending.deferred);
        let joined_any = !joins.is_empty();
        for d in joins {
            self.join_deferred(d);
        }
        let joined = joined_any.then(std::time::Instant::now);
        if joined_any {
            trace::mark("joined", None);
        }
        self.queue.submit([commands]);
        trace::mark("submitted", None);
        if let Some(t) = joined {
            // What the GPU waits for after the CPU's result, besides the result itself.
            let nanos = t.elapsed().as_nanos() as u64;
            self.submit_after_join_nanos.fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(t) = &self.timer {
            t.collect(&self.device, stamps);
        }
        if let (Some(p), Some(t)) = (&self.profile, started) {
            let mut p = lock(p);
            p.submits += 1;
            p.dispatches += n_cmds;
            p.encode_secs += t.elapsed().as_secs_f64();
        }
    }
}

/// The largest readback staging buffer kept for reuse (a decode step's logits: 0.6 MB for
/// Qwen3's vocabulary, 1 MB for Gemma 3's); a prompt's full logits are read through a buffer
/// made for them and freed after, as before, so no large host allocation outlives its use.
const READBACK_KEEP_MAX: u64 = 4 << 20;

/// The GPU back end. Cloning shares the device, queue, pipelines and pool.
#[derive(Clone)]
pub struct WgpuBackend {
    ctx: Arc<Ctx>,
    /// The GPU expert tier, when experts are paged ([`WgpuBackend::with_expert_store`]).
    experts: Option<Arc<experts::ExpertTier>>,
    /// One-token products of the types the int8 kernel covers quantize their activations
    /// ([`WgpuBackend::with_matmul_mode`]).
    int8_act: bool,
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WgpuBackend({})", self.ctx.adapter.name)
    }
}

/// The decode kernel's shape: `DISKFORMER_MATVEC=ROWSxWG` (e.g. `4x128`) for experiments, else
/// the default measured best on the H200 (docs/BENCHMARKS.md).
fn default_matvec_shape() -> MatvecShape {
    let parsed = std::env::var("DISKFORMER_MATVEC").ok().and_then(|v| {
        let (rows, wg) = v.split_once('x')?;
        let shape = MatvecShape { rows: rows.parse().ok()?, wg: wg.parse().ok()? };
        (shape.rows >= 1 && shape.rows <= 16 && shape.wg.is_power_of_two() && (32..=256).contains(&shape.wg))
            .then_some(shape)
    });
    // One row per 64-invocation workgroup: within 2% of the best shape on a 32768 x 8192 weight,
    // and the best in whole-model decode (8B Q4_0: 86.0 tok/s against 82.9 for 4x128), where the
    // 1024-row K/V products need many workgroups to fill the GPU.
    parsed.unwrap_or(MatvecShape { rows: 1, wg: 64 })
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Whether the environment switches a default-on path off (`NAME=0`).
fn env_off(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v.trim() == "0")
}

/// Workgroup counts for `n` groups: x up to 65535, the rest in y.
fn grid(n: usize) -> [u32; 3] {
    let n = n.max(1);
    let x = n.min(65535);
    [x as u32, n.div_ceil(65535) as u32, 1]
}

impl WgpuBackend {
    /// Opens the adapter `opts` picks and creates a device with its full limits, plus
    /// `SUBGROUP` and `SHADER_F16` when offered.
    ///
    /// # Errors
    /// [`GpuError`] when no adapter exists, the index is out of range, or the device is refused.
    pub fn new(opts: WgpuOptions) -> Result<WgpuBackend, GpuError> {
        let inst = instance();
        let list = adapters(&inst);
        if list.is_empty() {
            return Err(GpuError::NoAdapter);
        }
        let (index, adapter) = match opts.adapter_index {
            Some(i) => (i, list.get(i).ok_or(GpuError::BadAdapterIndex { index: i, n_adapters: list.len() })?),
            None => list
                .iter()
                .enumerate()
                .min_by_key(|(i, a)| (preference(a.get_info().device_type, opts.prefer_discrete), *i))
                .ok_or(GpuError::NoAdapter)?,
        };
        let summary = summary(index, adapter);
        let mut features = wgpu::Features::empty();
        let subgroups = summary.subgroups && !env_flag("DISKFORMER_NO_SUBGROUPS");
        if subgroups {
            features |= wgpu::Features::SUBGROUP;
        }
        if summary.shader_f16 {
            features |= wgpu::Features::SHADER_F16;
        }
        // Storage buffers with a map usage: the expert tier's host-memory copy (experts.rs).
        features |= adapter.features() & wgpu::Features::MAPPABLE_PRIMARY_BUFFERS;
        let timed = std::env::var("DISKFORMER_GPU_PROFILE").is_ok_and(|v| v == "2")
            && adapter.features().contains(gpu_timer::GpuTimer::features());
        if timed {
            features |= gpu_timer::GpuTimer::features();
        }
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("diskformer"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            // Small shared blocks: wgpu's `Performance` hint sub-allocates from 128-256 MiB blocks
            // (64-128 MiB for host-visible types, which on a GPU with resizable BAR are device
            // memory too), whose unused ends a budget would have to reserve. Tensors larger
            // than a block get blocks of their own, sized exactly; the placement and the
            // planner count the rest ([`ALLOCATOR_SLACK_BYTES`]).
            memory_hints: wgpu::MemoryHints::Manual {
                suballocated_device_memory_block_size: ALLOCATOR_MIN_BLOCK_BYTES..ALLOCATOR_MAX_BLOCK_BYTES,
            },
            trace: wgpu::Trace::Off,
        };
        // A second queue for copies beside the compute work and the host-import extension
        // where the adapter offers them (transfer.rs); else the device as wgpu opens it.
        let (device, queue, transfer, host_import) = match transfer::open_device(adapter, &desc) {
            Some(o) => (o.device, o.queue, o.transfer.map(Arc::new), o.host_import.map(Arc::new)),
            None => {
                let (device, queue) = pollster::block_on(adapter.request_device(&desc))
                    .map_err(|e| GpuError::RequestDevice { adapter: summary.name.clone(), why: e.to_string() })?;
                (device, queue, None, None)
            }
        };
        let dummy = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dummy"),
            size: 16,
            usage: STORAGE,
            mapped_at_creation: false,
        });
        let route_done = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("route done count"),
            size: 16,
            usage: STORAGE,
            mapped_at_creation: false,
        });
        let params_ring = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params ring"),
            size: PARAMS_RING_BYTES,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let timer = timed.then(|| Arc::new(gpu_timer::GpuTimer::new(&device, &queue)));
        let ctx = Ctx {
            device,
            queue,
            transfer,
            host_import,
            adapter: summary,
            subgroups,
            unroll: !env_flag("DISKFORMER_NO_UNROLL"),
            tiled: !env_flag("DISKFORMER_NO_TILED"),
            matvec: (!env_flag("DISKFORMER_NO_MATVEC")).then(default_matvec_shape),
            matvec_q8: int8::default_q8_config(subgroups),
            force_f32_act: env_flag("DISKFORMER_GPU_F32_ACT"),
            q8_cache: Mutex::new(int8::Q8Cache::default()),
            max_binding: limits.max_storage_buffer_binding_size.min(limits.max_buffer_size) & !255,
            max_buffer: limits.max_buffer_size,
            params_align: (limits.min_uniform_buffer_offset_alignment as usize).max(16),
            pipelines: Mutex::new(HashMap::new()),
            pending: Mutex::new(Pending::default()),
            deferred_error: Arc::default(),
            pool: Mutex::new(HashMap::new()),
            pooling: !env_flag("DISKFORMER_NO_POOL"),
            dummy,
            route_done,
            params_ring,
            submit_every: std::env::var("DISKFORMER_SUBMIT_EVERY")
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(SUBMIT_EVERY, |n: usize| if n == 0 { usize::MAX } else { n }),
            spin_readback: !env_flag("DISKFORMER_READBACK_BLOCK"),
            submit_first: std::env::var("DISKFORMER_SUBMIT_FIRST")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(SUBMIT_FIRST),
            readback_staging: Mutex::new(None),
            profile: env_flag("DISKFORMER_GPU_PROFILE").then(|| {
                let p = Arc::new(Mutex::new(HostProfile { timer: timer.clone(), ..HostProfile::default() }));
                lock(&PROFILES).push(Arc::downgrade(&p));
                p
            }),
            timer,
            rope_tables: Mutex::new(fused::RopeTables::default()),
            decode_pipelines_ready: std::sync::atomic::AtomicU64::new(u64::MAX),
            fuse: !env_flag("DISKFORMER_NO_FUSE"),
            zero_workgroup: std::env::var("DISKFORMER_WG_ZERO").ok().map(|v| v != "0"),
            commands_submitted: std::sync::atomic::AtomicU64::new(0),
            submit_after_join_nanos: std::sync::atomic::AtomicU64::new(0),
            bind_groups_created: std::sync::atomic::AtomicU64::new(0),
            norm_choice: norm::NormChoice::from_env(),
            norm_split: std::env::var("DISKFORMER_NORM_SPLIT").map_or(true, |v| v != "0"),
        };
        Ok(WgpuBackend { ctx: Arc::new(ctx), experts: None, int8_act: false })
    }

    /// The adapter in use.
    pub fn adapter(&self) -> &AdapterSummary {
        &self.ctx.adapter
    }

    /// Whether kernels use subgroup reductions.
    pub fn uses_subgroups(&self) -> bool {
        self.ctx.subgroups
    }

    /// Commands (kernel dispatches and buffer copies) submitted to the GPU since the back end
    /// started: the difference over a decode step is its dispatch count (each costs host time to
    /// record and encode, whatever its size).
    pub fn commands_submitted(&self) -> u64 {
        self.ctx.commands_submitted.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bind groups created since the back end started: a decode step that repeats the previous
    /// one's buffers and parameter offsets finds all of its bind groups cached and creates none
    /// (creating one is the largest host cost of encoding a dispatch).
    pub fn bind_groups_created(&self) -> u64 {
        self.ctx.bind_groups_created.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Largest storage binding in bytes (weights are split to fit it).
    pub fn max_binding_bytes(&self) -> u64 {
        self.ctx.max_binding
    }

    /// Submits every pending op and waits until the GPU has finished them.
    pub fn sync(&self) {
        let mut p = lock(&self.ctx.pending);
        self.ctx.flush_locked(&mut p);
        drop(p);
        let _ = self.ctx.device.poll(wgpu::PollType::wait_indefinitely());
    }

    fn alloc_bytes(&self, op: &'static str, bytes: u64) -> Result<PooledBuffer, OpError> {
        let bytes = bytes.max(16);
        if bytes > self.ctx.max_binding {
            return Err(OpError::Unsupported {
                op,
                backend: "wgpu",
                why: format!(
                    "a {bytes}-byte activation exceeds the adapter's storage binding limit of {} bytes; use fewer tokens per batch",
                    self.ctx.max_binding
                ),
            });
        }
        let size =
            if self.ctx.pooling { bytes.next_power_of_two().min(self.ctx.max_binding.max(bytes)) } else { bytes };
        // The free buffer of this size that sorts last, not the last one freed: which buffer an
        // allocation gets then depends only on which are free, not on the order tensors were
        // dropped (which differs between steps: some drop after the step's readback), so a decode
        // step gets the previous step's buffers and finds its bind groups in the cache.
        let reused = if self.ctx.pooling {
            lock(&self.ctx.pool).get_mut(&size).and_then(|v| {
                let last = (0..v.len()).max_by(|&a, &b| v[a].cmp(&v[b]))?;
                Some(v.swap_remove(last))
            })
        } else {
            None
        };
        let buffer = reused.unwrap_or_else(|| {
            trace::mark("buffer made", None);
            self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(op),
                size,
                usage: STORAGE,
                mapped_at_creation: false,
            })
        });
        Ok(PooledBuffer { buffer, ctx: self.ctx.clone() })
    }

    fn alloc(&self, op: &'static str, shape: &[usize]) -> Result<WgpuTensor, OpError> {
        let n: usize = shape.iter().product();
        Ok(WgpuTensor { buf: self.alloc_bytes(op, 4 * n as u64)?, shape: shape.to_vec() })
    }

    /// Copies host bytes into a pooled buffer, in order with the pending commands.
    fn upload(&self, op: &'static str, bytes: &[u8]) -> Result<PooledBuffer, OpError> {
        let dst = self.alloc_bytes(op, bytes.len() as u64)?;
        if !bytes.is_empty() {
            let size = (bytes.len() as u64).next_multiple_of(4);
            trace::mark("upload", None);
            let staging = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("upload"),
                size,
                usage: wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            });
            trace::mark("upload buffer made", None);
            write_mapped(&staging, bytes);
            lock(&self.ctx.pending).cmds.push(Cmd::Copy {
                src: staging,
                src_at: 0,
                dst: dst.buffer.clone(),
                dst_at: 0,
                size,
            });
            trace::mark("upload queued", None);
        }
        Ok(dst)
    }

    /// A weight buffer of `size` bytes holding `bytes`, written through staging pieces of at
    /// most [`WEIGHT_UPLOAD_PIECE_BYTES`], each copied and released before the next.
    ///
    /// Why not `mapped_at_creation` on the weight itself: wgpu then keeps a staging copy of
    /// every weight until the next submit, which a load does not make, so loading the dense
    /// weights held twice their size (0.91 GB more for Qwen3-30B-A3B, in device memory where
    /// host-visible memory is resizable-BAR VRAM), above any budget.
    fn upload_weight_bytes(&self, label: &str, size: u64, bytes: &[u8]) -> Result<wgpu::Buffer, OpError> {
        let device = &self.ctx.device;
        let buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let lost = |e: wgpu::PollError| OpError::Unsupported {
            op: "weight upload",
            backend: "wgpu",
            why: format!("the device was lost while uploading {label}: {e}"),
        };
        let mut at = 0u64;
        for piece in bytes.chunks(WEIGHT_UPLOAD_PIECE_BYTES as usize) {
            let len = (piece.len() as u64).next_multiple_of(4);
            let staging = device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("weight upload"),
                size: len,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            });
            write_mapped(&staging, piece);
            let mut enc =
                device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("weight upload") });
            enc.copy_buffer_to_buffer(&staging, 0, &buffer, at, len);
            self.ctx.queue.submit([enc.finish()]);
            drop(staging);
            device.poll(wgpu::PollType::wait_indefinitely()).map_err(lost)?;
            at += len;
        }
        Ok(buffer)
    }

    fn copy(&self, src: &wgpu::Buffer, src_at: u64, dst: &wgpu::Buffer, dst_at: u64, size: u64) {
        if size > 0 {
            lock(&self.ctx.pending).cmds.push(Cmd::Copy { src: src.clone(), src_at, dst: dst.clone(), dst_at, size });
        }
    }

    fn dispatch(
        &self,
        pipeline: Arc<wgpu::ComputePipeline>,
        buffers: &[&wgpu::Buffer],
        words: &[u32],
        groups: [u32; 3],
    ) {
        if groups.contains(&0) {
            return;
        }
        let mut p = lock(&self.ctx.pending);
        let at = p.params.len().next_multiple_of(self.ctx.params_align);
        p.params.resize(at, 0);
        p.params.extend_from_slice(bytemuck::cast_slice(words));
        let padded = p.params.len().next_multiple_of(16);
        p.params.resize(padded, 0);
        let params_len = (padded - at) as u64;
        p.cmds.push(Cmd::Dispatch {
            pipeline,
            buffers: buffers.iter().map(|b| (*b).clone()).collect(),
            params_at: at as u64,
            params_len,
            groups,
        });
        // With a CPU result pending (the split's deferred share) an early submit would wait for
        // it and then leave the GPU idle while the host records the rest of the layer: the
        // commands wait for the submit that needs them, encoded before the join (up to the
        // usual batch).
        let threshold =
            if p.deferred.is_empty() { self.ctx.submit_threshold(p.early_submits) } else { self.ctx.submit_every };
        if p.cmds.len() >= threshold {
            self.ctx.flush_locked(&mut p);
            p.early_submits += 1;
        }
    }

    fn plain(&self, k: Plain) -> Arc<wgpu::ComputePipeline> {
        self.ctx.pipeline_with(&format!("{k:?}"), || k.source(), k.workgroup_memory_written_first())
    }

    /// Reads `n_bytes` of a buffer back to the host (submitting everything pending).
    fn read_back(&self, src: &wgpu::Buffer, n_bytes: u64) -> Result<Vec<u8>, OpError> {
        self.read_back_with(src, n_bytes, <[u8]>::to_vec)
    }

    /// [`Self::read_back`], handing the mapped bytes to `read` (which copies out what it needs,
    /// converting on the way: one pass over the mapped memory instead of a copy and a
    /// conversion). The staging buffer is kept for the next readback that fits in it: a decode
    /// step reads its logits through it (608 KB for Qwen3's vocabulary), and a buffer made and
    /// freed per step cost an allocation in the driver each time.
    fn read_back_with<T>(&self, src: &wgpu::Buffer, n_bytes: u64, read: impl FnOnce(&[u8]) -> T) -> Result<T, OpError> {
        let size = n_bytes.next_multiple_of(4).max(4);
        // Taken out of the cache for the duration (another thread's readback makes its own).
        let kept = lock(&self.ctx.readback_staging).take().filter(|b| b.size() >= size);
        let staging = kept.unwrap_or_else(|| {
            self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size: size.next_power_of_two().max(4096),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        {
            let mut p = lock(&self.ctx.pending);
            if n_bytes > 0 {
                p.cmds.push(Cmd::Copy { src: src.clone(), src_at: 0, dst: staging.clone(), dst_at: 0, size });
            }
            self.ctx.flush_locked(&mut p);
            p.host_waits();
        }
        let out = if n_bytes == 0 {
            Ok(read(&[]))
        } else {
            self.read_mapped("to_host", &staging, size, n_bytes, self.ctx.spin_readback, read)
        };
        if out.is_ok() && staging.size() <= READBACK_KEEP_MAX {
            let mut cache = lock(&self.ctx.readback_staging);
            if cache.as_ref().is_none_or(|b| b.size() < staging.size()) {
                *cache = Some(staging);
            }
        }
        out
    }

    /// Maps `buffer[..size]` for reading once the GPU is done with it (the wait counted in the
    /// profile) and copies out its first `n_bytes`; `op` names the op in errors. Every readback
    /// of the back end ends here.
    ///
    /// `spin`: poll the device in a loop instead of blocking in the driver. The callback of
    /// `map_async` runs inside `poll` once the GPU is done, so spinning on `PollType::Poll` sees
    /// it without a futex wake-up (slow in a VM); after a few thousand polls the thread yields, so
    /// a long wait does not starve the thread pool. Every readback spins unless
    /// `DISKFORMER_READBACK_BLOCK=1`.
    ///
    /// `read` gets the first `n_bytes` of the mapped range and copies out what it needs
    /// (`<[u8]>::to_vec` for the bytes).
    fn read_mapped<T>(
        &self,
        op: &'static str,
        buffer: &wgpu::Buffer,
        size: u64,
        n_bytes: u64,
        spin: bool,
        read: impl FnOnce(&[u8]) -> T,
    ) -> Result<T, OpError> {
        const PENDING: u8 = 0;
        const MAPPED: u8 = 1;
        const FAILED: u8 = 2;
        let failed = |why: String| OpError::Unsupported { op, backend: "wgpu", why };
        let waiting = self.ctx.profile.as_ref().map(|_| std::time::Instant::now());
        trace::mark("readback wait", None);
        let state = Arc::new(std::sync::atomic::AtomicU8::new(PENDING));
        let flag = state.clone();
        buffer.slice(..size).map_async(wgpu::MapMode::Read, move |r| {
            flag.store(if r.is_ok() { MAPPED } else { FAILED }, std::sync::atomic::Ordering::Release);
        });
        let lost = |e: wgpu::PollError| failed(format!("device lost while waiting: {e}"));
        if spin {
            let mut polls = 0u32;
            while state.load(std::sync::atomic::Ordering::Acquire) == PENDING {
                self.ctx.device.poll(wgpu::PollType::Poll).map_err(lost)?;
                polls += 1;
                if polls > 2000 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        } else {
            self.ctx.device.poll(wgpu::PollType::wait_indefinitely()).map_err(lost)?;
        }
        trace::mark(op, None);
        if let (Some(p), Some(t)) = (&self.ctx.profile, waiting) {
            let mut p = lock(p);
            p.wait_secs += t.elapsed().as_secs_f64();
            p.readbacks += 1;
        }
        if state.load(std::sync::atomic::Ordering::Acquire) != MAPPED {
            return Err(failed("buffer mapping failed".into()));
        }
        if let Some(e) = lock(&self.ctx.deferred_error).take() {
            buffer.unmap();
            return Err(e);
        }
        let out = buffer
            .slice(..size)
            .get_mapped_range()
            .map(|view| read(&view[..n_bytes as usize]))
            .map_err(|e| failed(format!("buffer mapping failed: {e:?}")));
        buffer.unmap();
        out
    }

    fn unary(&self, a: &WgpuTensor, op: u32, s: f32) -> Result<WgpuTensor, OpError> {
        let y = self.alloc("unary", &a.shape)?;
        let n = a.len();
        self.dispatch(
            self.plain(Plain::Unary),
            &[&a.buf.buffer, &y.buf.buffer],
            &[n as u32, op, s.to_bits(), 0],
            grid(n.div_ceil(256)),
        );
        Ok(y)
    }

    /// `a op b` with `b` of a's shape or one row broadcast; `row_of_b` picks row `r` of a
    /// matrix `b` (an expert's bias) as the broadcast row.
    fn binary(
        &self,
        op_name: &'static str,
        a: &WgpuTensor,
        b: &WgpuTensor,
        op: u32,
        row_of_b: Option<usize>,
    ) -> Result<WgpuTensor, OpError> {
        let w = a.width();
        let (b_len, b_off) = match row_of_b {
            Some(r) if b.width() == w && (r + 1) * w <= b.len() => (w, r * w),
            None if b.len() == a.len() => (a.len(), 0),
            None if b.len() == w => (w, 0),
            _ => {
                return Err(OpError::ShapeMismatch {
                    op: op_name,
                    expected: format!(
                        "b of shape {:?} or one row of {w}{}",
                        a.shape,
                        row_of_b.map_or(String::new(), |r| format!(" (row {r})"))
                    ),
                    got: b.shape.clone(),
                })
            }
        };
        let y = self.alloc(op_name, &a.shape)?;
        let n = a.len();
        self.dispatch(
            self.plain(Plain::Binary),
            &[&a.buf.buffer, &b.buf.buffer, &y.buf.buffer],
            &[n as u32, b_len.max(1) as u32, op, b_off as u32],
            grid(n.div_ceil(256)),
        );
        Ok(y)
    }

    /// `y[:, y_col0 + r] = x[:, x_col0..x_col0 + k] · W[w_row0 + r]ᵀ` for `r < n_rows` (an
    /// expert's or a head's rows of a stack, or the whole matrix).
    fn matmul_into(&self, x: &WgpuTensor, w: &WgpuWeight, y: &WgpuTensor, r: Span) -> Result<(), OpError> {
        self.product_into(x, w, y, r, false)
    }

    /// `matmul_into`, adding to `y` instead of replacing it when `accumulate` is set: the int8
    /// kernel when int8 activations are on and apply ([`int8`]), else the f32 kernels.
    fn product_into(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        y: &WgpuTensor,
        r: Span,
        accumulate: bool,
    ) -> Result<(), OpError> {
        if w.host.is_some() {
            return Err(OpError::Unsupported {
                op: "matmul",
                backend: "wgpu",
                why: format!(
                    "{} is kept in host memory for its rows only (DISKFORMER_EMBED_ON_GPU=1 keeps it on the GPU)",
                    w.name
                ),
            });
        }
        if self.try_int8_product(x, w, y, r, accumulate)? || self.try_int8_prefill(x, w, y, r, accumulate)? {
            return Ok(());
        }
        self.product_f32(x, w, y, r, accumulate)
    }

    /// The f32-activation product: the decode kernel for one token, else the general one.
    fn product_f32(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        y: &WgpuTensor,
        r: Span,
        accumulate: bool,
    ) -> Result<(), OpError> {
        match self.ctx.matvec {
            Some(shape) if x.rows() == 1 && w.k.is_multiple_of(8) && r.x_col0.is_multiple_of(4) => {
                self.matvec_into(x, w, y, r, shape, accumulate);
                Ok(())
            }
            _ => self.matmul_general(x, w, y, r, accumulate),
        }
    }

    /// `y += x · Wᵀ` for `x` [n, k] and `y` [n, n_rows] (any number of tokens; one token takes
    /// the decode kernel): the residual add fused into the product that feeds it, so it costs no
    /// dispatch of its own. `y` must be a different tensor from `x` (one buffer cannot be bound
    /// for reading and writing in one dispatch).
    ///
    /// # Errors
    /// [`OpError::ShapeMismatch`] when `x` is not `k` wide or `y` is not `[x rows, n_rows]`.
    pub fn matvec_accumulate_into(&self, x: &WgpuTensor, w: &WgpuWeight, y: &WgpuTensor) -> Result<(), OpError> {
        expect_width("matvec_accumulate_into x", x, w.k)?;
        if y.width() != w.n_rows || y.rows() != x.rows() {
            return Err(OpError::ShapeMismatch {
                op: "matvec_accumulate_into y",
                expected: format!("[{}, {}]", x.rows(), w.n_rows),
                got: y.shape.clone(),
            });
        }
        self.product_into(x, w, y, Span::whole(w), true)
    }

    /// One token's product through `matvec.wgsl` (`shape.rows` rows per workgroup).
    fn matvec_into(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        y: &WgpuTensor,
        r: Span,
        shape: MatvecShape,
        accumulate: bool,
    ) {
        let Span { x_col0, w_row0, n_rows, y_col0 } = r;
        let k = w.k;
        let l = w.layout;
        let sg = self.ctx.subgroups;
        let key = format!("matvec {} {}x{} sg{sg}", l.name, shape.rows, shape.wg);
        // Workgroup memory is written before it is read (argued in matvec.wgsl): no zeroing.
        let pipe = self.ctx.pipeline_with(&key, || shaders::matvec(&l, shape, sg), true);
        for c in &w.chunks {
            let lo = w_row0.max(c.row0);
            let hi = (w_row0 + n_rows).min(c.row0 + c.n_rows);
            if lo >= hi {
                continue;
            }
            self.dispatch(
                pipe.clone(),
                &[&c.buffer, &x.buf.buffer, &y.buf.buffer],
                &[
                    k as u32,
                    (hi - lo) as u32,
                    1,
                    l.row_words(k) as u32,
                    (lo - c.row0) as u32,
                    y.width() as u32,
                    (y_col0 + lo - w_row0) as u32,
                    x.width() as u32,
                    x_col0 as u32,
                    accumulate as u32,
                    0,
                    0,
                ],
                grid((hi - lo).div_ceil(shape.rows as usize)),
            );
        }
    }

    /// Any number of tokens: the tiled kernel from `shaders::TILED_MIN_TOKENS` tokens (prefill),
    /// else `matmul.wgsl`.
    fn matmul_general(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        y: &WgpuTensor,
        r: Span,
        accumulate: bool,
    ) -> Result<(), OpError> {
        let tiled = self.ctx.tiled && x.rows() >= shaders::TILED_MIN_TOKENS;
        self.matmul_kernel(x, w, y, r, accumulate, tiled);
        Ok(())
    }

    /// `tiled`: `matmul_tiled.wgsl` (64 rows x 64 tokens per workgroup, the weight tile
    /// dequantized once into workgroup memory for all its tokens); else `matmul.wgsl` (one
    /// workgroup per row and 8-token tile, or per row for one token).
    fn matmul_kernel(&self, x: &WgpuTensor, w: &WgpuWeight, y: &WgpuTensor, r: Span, accumulate: bool, tiled: bool) {
        let n_tok = x.rows();
        let guard = !w.k.is_multiple_of(8);
        let l = w.layout;
        let (pipe, rows_per_group, tok) = if tiled {
            let key = format!("matmul_tiled {} guard{guard}", l.name);
            let pipe = self.ctx.pipeline(&key, || shaders::matmul_tiled(&l, guard));
            (pipe, shaders::TILE_ROWS, shaders::TILE_TOKENS)
        } else {
            let tok = if n_tok == 1 { shaders::MATMUL_TILES[0] } else { shaders::MATMUL_TILES[1] };
            let sg = self.ctx.subgroups;
            let unroll = self.ctx.unroll;
            let key = format!("matmul {} tok{tok} guard{guard} sg{sg} unroll{unroll}", l.name);
            (self.ctx.pipeline(&key, || shaders::matmul(&l, tok, guard, sg, unroll)), 1, tok as usize)
        };
        self.dispatch_per_chunk(pipe, w, r, (rows_per_group, tok), &[&x.buf.buffer], n_tok, x.width(), y, accumulate);
    }

    /// Records `pipe` over the rows of span `r` in each of `w`'s chunks (binding windows): a grid
    /// of `tile.0` rows by `tile.1` tokens per workgroup, bound to the chunk, then `inputs`, then
    /// `y`, with `matmul_params.wgsl`'s words (x `x_width` values wide, `n_tok` tokens).
    #[allow(clippy::too_many_arguments)] // the product's operands, its span and its tile
    fn dispatch_per_chunk(
        &self,
        pipe: Arc<wgpu::ComputePipeline>,
        w: &WgpuWeight,
        r: Span,
        tile: (usize, usize),
        inputs: &[&wgpu::Buffer],
        n_tok: usize,
        x_width: usize,
        y: &WgpuTensor,
        accumulate: bool,
    ) {
        let Span { x_col0, w_row0, n_rows, y_col0 } = r;
        for c in &w.chunks {
            let lo = w_row0.max(c.row0);
            let hi = (w_row0 + n_rows).min(c.row0 + c.n_rows);
            if lo >= hi {
                continue;
            }
            let mut g = grid((hi - lo).div_ceil(tile.0));
            g[2] = n_tok.div_ceil(tile.1) as u32;
            let mut buffers = vec![&c.buffer];
            buffers.extend_from_slice(inputs);
            buffers.push(&y.buf.buffer);
            self.dispatch(
                pipe.clone(),
                &buffers,
                &[
                    w.k as u32,
                    (hi - lo) as u32,
                    n_tok as u32,
                    w.layout.row_words(w.k) as u32,
                    (lo - c.row0) as u32,
                    y.width() as u32,
                    (y_col0 + lo - w_row0) as u32,
                    x_width as u32,
                    x_col0 as u32,
                    accumulate as u32,
                    0,
                    0,
                ],
                g,
            );
        }
    }

    fn copy_cols(&self, x: &WgpuTensor, src_col0: usize, n_cols: usize, y: &WgpuTensor, dst_col0: usize) {
        let rows = x.rows();
        self.dispatch(
            self.plain(Plain::CopyCols),
            &[&x.buf.buffer, &y.buf.buffer],
            &[rows as u32, n_cols as u32, x.width() as u32, src_col0 as u32, y.width() as u32, dst_col0 as u32, 0, 0],
            grid((rows * n_cols).div_ceil(256)),
        );
    }

    fn glu_code(glu: Glu) -> (u32, f32, f32) {
        match glu {
            Glu::Plain(a) => (act_code(a), 0.0, 0.0),
            Glu::SwiGluOai { alpha, limit } => (5, alpha, limit),
        }
    }

    /// Median seconds per call of `record` (which records one dispatch): batches of `reps`
    /// calls, each batch one submit, after half a second of the same work so the clocks have
    /// ramped up (an idle GPU starts at a fraction of its clock).
    fn time_reps(&self, reps: usize, record: impl Fn() -> Result<(), OpError>) -> Result<f64, OpError> {
        let batch = || -> Result<f64, OpError> {
            let t = std::time::Instant::now();
            for _ in 0..reps {
                record()?;
            }
            self.sync();
            Ok(t.elapsed().as_secs_f64() / reps as f64)
        };
        let warm = std::time::Instant::now();
        while warm.elapsed().as_secs_f64() < 0.5 {
            batch()?;
        }
        let mut times = [batch()?, batch()?, batch()?, batch()?, batch()?];
        times.sort_by(f64::total_cmp);
        Ok(times[2])
    }

    /// Seconds per streaming read of `bytes` (the bandwidth baseline of `--perf`): every
    /// invocation reads 16-byte words in a grid-stride loop.
    #[doc(hidden)]
    pub fn perf_stream(&self, bytes: u64, reps: usize) -> Result<f64, OpError> {
        let n_vec4 = bytes / 16;
        let src = self.alloc_bytes("stream", n_vec4 * 16)?;
        let n_groups = 132 * 16;
        let out = self.alloc_bytes("stream out", n_groups as u64 * 4)?;
        let pipe = self.plain(Plain::Stream);
        self.time_reps(reps, || {
            self.dispatch(pipe.clone(), &[&src.buffer, &out.buffer], &[n_vec4 as u32, 0, 0, 0], [n_groups, 1, 1]);
            Ok(())
        })
    }

    /// Seconds per matrix-vector product `x · Wᵀ` (for `--perf`).
    #[doc(hidden)]
    /// `shape`: the `matvec` kernel with that workgroup shape; `None`: the general `matmul`
    /// kernel (the one prefill uses), for comparison.
    #[doc(hidden)]
    pub fn perf_matvec(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        shape: Option<MatvecShape>,
        reps: usize,
    ) -> Result<f64, OpError> {
        let y = self.alloc("perf", &[x.rows(), w.n_rows])?;
        match shape {
            Some(shape) => self.time_reps(reps, || {
                self.matvec_into(x, w, &y, Span::whole(w), shape, false);
                Ok(())
            }),
            None => self.time_reps(reps, || self.matmul_general(x, w, &y, Span::whole(w), false)),
        }
    }

    /// Seconds per product `x · Wᵀ` of several tokens through the tiled prefill kernel or the
    /// 8-token one (for `--perf`).
    #[doc(hidden)]
    pub fn perf_prefill(&self, x: &WgpuTensor, w: &WgpuWeight, tiled: bool, reps: usize) -> Result<f64, OpError> {
        let y = self.alloc("perf", &[x.rows(), w.n_rows])?;
        self.time_reps(reps, || {
            self.matmul_kernel(x, w, &y, Span::whole(w), false, tiled);
            Ok(())
        })
    }

    /// `x · Wᵀ` through the 8-token kernel whatever the token count (tests compare it and the
    /// tiled kernel with the CPU).
    #[doc(hidden)]
    pub fn matmul_untiled(&self, x: &WgpuTensor, w: &WgpuWeight) -> Result<WgpuTensor, OpError> {
        expect_width("matmul_untiled", x, w.k)?;
        let y = self.alloc("matmul", &[x.rows(), w.n_rows])?;
        self.matmul_kernel(x, w, &y, Span::whole(w), false, false);
        Ok(y)
    }

    /// One token's `x · Wᵀ` through the `matvec` kernel with `shape` (tests compare every shape
    /// with the CPU).
    #[doc(hidden)]
    pub fn matvec_with_shape(&self, x: &WgpuTensor, w: &WgpuWeight, shape: MatvecShape) -> Result<WgpuTensor, OpError> {
        expect_width("matvec", x, w.k)?;
        if x.rows() != 1 || !w.k.is_multiple_of(8) {
            return Err(OpError::ShapeMismatch {
                op: "matvec",
                expected: format!("one token of a multiple of 8 values (k = {})", w.k),
                got: x.shape.clone(),
            });
        }
        let y = self.alloc("matvec", &[1, w.n_rows])?;
        self.matvec_into(x, w, &y, Span::whole(w), shape, false);
        Ok(y)
    }

    /// The decode kernel's shape in use (`None`: disabled by DISKFORMER_NO_MATVEC=1).
    pub fn matvec_shape(&self) -> Option<MatvecShape> {
        self.ctx.matvec
    }
}

/// Which part of a matrix product `matmul_into` computes: rows `w_row0..w_row0 + n_rows` of the
/// weight (an expert's or a head's slice of a stack) against columns `x_col0..x_col0 + k` of the
/// activations, into columns `y_col0..` of the output.
#[derive(Clone, Copy)]
struct Span {
    x_col0: usize,
    w_row0: usize,
    n_rows: usize,
    y_col0: usize,
}

impl Span {
    fn whole(w: &WgpuWeight) -> Span {
        Span { x_col0: 0, w_row0: 0, n_rows: w.n_rows, y_col0: 0 }
    }
    fn rows(w_row0: usize, n_rows: usize) -> Span {
        Span { x_col0: 0, w_row0, n_rows, y_col0: 0 }
    }
}

fn act_code(a: Act) -> u32 {
    match a {
        Act::Silu => 1,
        Act::Gelu => 2,
        Act::GeluTanh => 3,
        Act::Relu => 4,
    }
}

fn expect_width(op: &'static str, t: &WgpuTensor, width: usize) -> Result<(), OpError> {
    if t.width() != width {
        return Err(OpError::ShapeMismatch { op, expected: format!("[n, {width}]"), got: t.shape.clone() });
    }
    Ok(())
}

impl Backend for WgpuBackend {
    type Tensor = WgpuTensor;
    type Weight = WgpuWeight;
    type Cache = WgpuCache;

    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn step_feeds_thread_pool(&self) -> bool {
        // The split's CPU jobs come once per layer, ~300 us apart on the H200, and the GPU
        // waits for each: with parked workers they queued 670-1250 us per step there, with
        // polling ones 150-290 (docs/BENCHMARKS.md, nineteenth session).
        self.experts.as_ref().is_some_and(|t| t.computes_on_cpu())
    }

    fn from_host(&self, data: &[f32], shape: &[usize]) -> Result<WgpuTensor, OpError> {
        OpError::check_host_values(data, shape)?;
        Ok(WgpuTensor { buf: self.upload("from_host", bytemuck::cast_slice(data))?, shape: shape.to_vec() })
    }

    fn to_host(&self, t: &WgpuTensor) -> Result<Vec<f32>, OpError> {
        let values = self.read_back_with(&t.buf.buffer, 4 * t.len() as u64, le_f32s)?;
        trace::mark("to_host copied", None);
        Ok(values)
    }

    fn to_host_into(&self, t: &WgpuTensor, out: &mut Vec<f32>) -> Result<(), OpError> {
        self.read_back_with(&t.buf.buffer, 4 * t.len() as u64, |bytes| le_f32s_into(bytes, out))?;
        trace::mark("to_host copied", None);
        Ok(())
    }

    fn shape<'a>(&self, t: &'a WgpuTensor) -> &'a [usize] {
        &t.shape
    }

    fn reshape(&self, mut t: WgpuTensor, shape: &[usize]) -> Result<WgpuTensor, OpError> {
        if shape.iter().product::<usize>() != t.len() {
            return Err(OpError::ShapeMismatch {
                op: "reshape",
                expected: format!("{:?} ({} values)", shape, shape.iter().product::<usize>()),
                got: t.shape,
            });
        }
        t.shape = shape.to_vec();
        Ok(t)
    }

    fn weight(&self, w: &HostWeight) -> Result<WgpuWeight, OpError> {
        let k = w.row_len();
        let l = TypeLayout::for_weight(w.dtype, k).ok_or_else(|| OpError::Weight {
            name: w.name.clone(),
            why: format!("type {} has no GPU kernel", w.dtype),
        })?;
        let n_rows = w.n_rows();
        // Paged experts stay on the host: the expert tier uploads them into slots on demand.
        if self.experts.is_some() && w.shape.len() == 3 && w.name.ends_with("_exps.weight") {
            let (shape, name) = (w.shape.clone(), w.name.clone());
            return Ok(WgpuWeight { chunks: Vec::new(), layout: l, k, n_rows, shape, name, host: None });
        }
        // The input embedding under a budget: read a row at a time on the host (see the rule).
        if self.experts.is_some()
            && w.name == gguf::names::TOKEN_EMBD
            && crate::weight::input_embedding_on_host(w.model())
        {
            let (shape, name) = (w.shape.clone(), w.name.clone());
            return Ok(WgpuWeight { chunks: Vec::new(), layout: l, k, n_rows, shape, name, host: Some(w.clone()) });
        }
        if !l.is_float() && !k.is_multiple_of(l.block_values) {
            return Err(OpError::Weight {
                name: w.name.clone(),
                why: format!("row of {k} values is not whole {}-value blocks", l.block_values),
            });
        }
        let stored_row = if l.is_float() { k * l.block_bytes() / 8 } else { k / l.block_values * l.block_bytes() };
        if w.bytes().len() != stored_row * n_rows {
            return Err(OpError::Weight {
                name: w.name.clone(),
                why: format!("{} bytes for {n_rows} rows of {k} {}", w.bytes().len(), w.dtype),
            });
        }
        let row_bytes = 4 * l.row_words(k) as u64;
        // Stacked experts split on expert boundaries so an expert is always inside one chunk.
        let unit = if w.shape.len() == 3 { w.shape[1] } else { 1 };
        let max_rows = (self.ctx.max_binding / row_bytes.max(1)) as usize / unit * unit;
        if max_rows == 0 {
            return Err(OpError::Weight {
                name: w.name.clone(),
                why: format!(
                    "{unit} rows of {row_bytes} bytes exceed the storage binding limit of {} bytes",
                    self.ctx.max_binding
                ),
            });
        }
        let mut chunks = Vec::new();
        let mut row0 = 0;
        let src_rows = w.bytes();
        while row0 < n_rows.max(1) {
            let rows = max_rows.min(n_rows - row0);
            if rows == 0 {
                break;
            }
            let words = l.repack(&src_rows[row0 * stored_row..(row0 + rows) * stored_row], rows, k);
            let size = (words.len() as u64 * 4).max(16);
            if size > self.ctx.max_buffer {
                return Err(OpError::Weight {
                    name: w.name.clone(),
                    why: format!("chunk of {size} bytes exceeds the buffer limit {}", self.ctx.max_buffer),
                });
            }
            let buffer = self.upload_weight_bytes(&w.name, size, bytemuck::cast_slice(&words))?;
            chunks.push(WeightChunk { buffer, row0, n_rows: rows });
            row0 += rows;
        }
        Ok(WgpuWeight { chunks, layout: l, k, n_rows, shape: w.shape.clone(), name: w.name.clone(), host: None })
    }

    fn get_rows(&self, table: &WgpuWeight, ids: &[u32]) -> Result<WgpuTensor, OpError> {
        if let Some(&id) = ids.iter().find(|&&i| i as usize >= table.n_rows) {
            return Err(OpError::BadTokenId { id, n_vocab: table.n_rows });
        }
        trace::mark("get_rows", None);
        if let Some(host) = &table.host {
            // Dequantized here and uploaded: a step's rows are a few KB.
            let (k, rb, bytes) = (table.k, host.row_bytes(), host.bytes());
            let mut rows = vec![0f32; ids.len() * k];
            for (&id, out) in ids.iter().zip(rows.chunks_mut(k)) {
                let i = id as usize;
                crate::quant::dequantize(host.dtype, &bytes[i * rb..(i + 1) * rb], out)
                    .map_err(|source| OpError::Quant { op: "get_rows", source })?;
            }
            trace::mark("get_rows dequantized", None);
            return self.from_host(&rows, &[ids.len(), k]);
        }
        let k = table.k;
        let y = self.alloc("get_rows", &[ids.len(), k])?;
        let idb = self.upload("get_rows ids", bytemuck::cast_slice(ids))?;
        let l = table.layout;
        let pipe = self.ctx.pipeline(&format!("get_rows {}", l.name), || shaders::get_rows(&l));
        for c in &table.chunks {
            self.dispatch(
                pipe.clone(),
                &[&c.buffer, &idb.buffer, &y.buf.buffer],
                &[k as u32, c.n_rows as u32, ids.len() as u32, l.row_words(k) as u32, c.row0 as u32, 0, 0, 0],
                grid((k.div_ceil(8) * ids.len()).div_ceil(64)),
            );
        }
        Ok(y)
    }

    fn matmul(&self, x: &WgpuTensor, w: &WgpuWeight) -> Result<WgpuTensor, OpError> {
        expect_width("matmul", x, w.k)?;
        let y = self.alloc("matmul", &[x.rows(), w.n_rows])?;
        self.matmul_into(x, w, &y, Span::whole(w))?;
        Ok(y)
    }

    fn matmul_many<const N: usize>(&self, x: &WgpuTensor, ws: [&WgpuWeight; N]) -> Result<[WgpuTensor; N], OpError> {
        self.matmul_many_fused(x, ws)
    }

    fn matmul_glu(
        &self,
        x: &WgpuTensor,
        gate_w: &WgpuWeight,
        up_w: &WgpuWeight,
        glu: Glu,
    ) -> Result<WgpuTensor, OpError> {
        self.matmul_glu_fused(x, gate_w, up_w, glu)
    }

    fn matmul_add(&self, x: &WgpuTensor, w: &WgpuWeight, residual: WgpuTensor) -> Result<WgpuTensor, OpError> {
        self.matmul_add_fused(x, w, residual)
    }

    fn add(&self, a: &WgpuTensor, b: &WgpuTensor) -> Result<WgpuTensor, OpError> {
        self.binary("add", a, b, 0, None)
    }

    fn mul(&self, a: &WgpuTensor, b: &WgpuTensor) -> Result<WgpuTensor, OpError> {
        self.binary("mul", a, b, 1, None)
    }

    fn scale(&self, a: &WgpuTensor, s: f32) -> Result<WgpuTensor, OpError> {
        self.unary(a, 0, s)
    }

    fn act(&self, a: &WgpuTensor, act: Act) -> Result<WgpuTensor, OpError> {
        self.unary(a, act_code(act), 0.0)
    }

    fn glu(&self, gate: &WgpuTensor, up: &WgpuTensor, glu: Glu) -> Result<WgpuTensor, OpError> {
        if gate.shape != up.shape {
            return Err(OpError::ShapeMismatch {
                op: "glu",
                expected: format!("{:?}", gate.shape),
                got: up.shape.clone(),
            });
        }
        let y = self.alloc("glu", &gate.shape)?;
        let (op, alpha, limit) = Self::glu_code(glu);
        let n = gate.len();
        self.dispatch(
            self.plain(Plain::Glu),
            &[&gate.buf.buffer, &up.buf.buffer, &y.buf.buffer],
            &[n as u32, op, alpha.to_bits(), limit.to_bits()],
            grid(n.div_ceil(256)),
        );
        Ok(y)
    }

    fn rms_norm(&self, x: &WgpuTensor, weight: Option<&WgpuTensor>, eps: f32) -> Result<WgpuTensor, OpError> {
        self.norm("rms_norm", x, weight, None, eps, 0)
    }

    fn rms_norm_pair(
        &self,
        a: &WgpuTensor,
        wa: Option<&WgpuTensor>,
        b: &WgpuTensor,
        wb: Option<&WgpuTensor>,
        eps: f32,
    ) -> Result<(WgpuTensor, WgpuTensor), OpError> {
        self.norm_pair([(a, wa), (b, wb)], eps)
    }

    fn layer_norm(
        &self,
        x: &WgpuTensor,
        weight: Option<&WgpuTensor>,
        bias: Option<&WgpuTensor>,
        eps: f32,
    ) -> Result<WgpuTensor, OpError> {
        self.norm("layer_norm", x, weight, bias, eps, 1)
    }

    fn rope(&self, x: &WgpuTensor, positions: &[u32], spec: &RopeSpec) -> Result<WgpuTensor, OpError> {
        Self::check_rope(x, positions, spec)?;
        let w = x.width();
        let csb = self.rope_table(positions, spec)?;
        let y = self.alloc("rope", &x.shape)?;
        let n = x.len();
        self.dispatch(
            self.plain(Plain::Rope),
            &[&x.buf.buffer, &csb.buffer, &y.buf.buffer],
            &[x.rows() as u32, w as u32, spec.head_dim as u32, spec.n_rot as u32, spec.neox as u32, 0, 0, 0],
            grid(n.div_ceil(256)),
        );
        Ok(y)
    }

    fn slice_rows(&self, x: &WgpuTensor, start: usize, len: usize) -> Result<WgpuTensor, OpError> {
        let w = x.width();
        if start + len > x.rows() {
            return Err(OpError::ShapeMismatch {
                op: "slice_rows",
                expected: format!("at least {} rows", start + len),
                got: x.shape.clone(),
            });
        }
        let y = self.alloc("slice_rows", &[len, w])?;
        self.copy(&x.buf.buffer, 4 * (start * w) as u64, &y.buf.buffer, 0, 4 * (len * w) as u64);
        Ok(y)
    }

    fn slice_cols(&self, x: &WgpuTensor, start: usize, len: usize) -> Result<WgpuTensor, OpError> {
        if start + len > x.width() {
            return Err(OpError::ShapeMismatch {
                op: "slice_cols",
                expected: format!("at least {} columns", start + len),
                got: x.shape.clone(),
            });
        }
        let y = self.alloc("slice_cols", &[x.rows(), len])?;
        self.copy_cols(x, start, len, &y, 0);
        Ok(y)
    }

    fn concat_cols(&self, parts: &[&WgpuTensor]) -> Result<WgpuTensor, OpError> {
        let rows = parts.first().map(|p| p.rows()).unwrap_or(0);
        if let Some(bad) = parts.iter().find(|p| p.rows() != rows) {
            return Err(OpError::ShapeMismatch {
                op: "concat_cols",
                expected: format!("{rows} rows"),
                got: bad.shape.clone(),
            });
        }
        let width: usize = parts.iter().map(|p| p.width()).sum();
        let y = self.alloc("concat_cols", &[rows, width])?;
        let mut col = 0;
        for p in parts {
            self.copy_cols(p, 0, p.width(), &y, col);
            col += p.width();
        }
        Ok(y)
    }

    fn new_cache(&self, n_ctx: usize, k_width: usize, v_width: usize) -> Result<WgpuCache, OpError> {
        let make = |width: usize, what: &str| -> Result<wgpu::Buffer, OpError> {
            let size = (4 * n_ctx * width) as u64;
            if size > self.ctx.max_binding {
                return Err(OpError::Unsupported {
                    op: "new_cache",
                    backend: "wgpu",
                    why: format!(
                        "{what} cache of {n_ctx} positions x {width} values is {size} bytes, over the storage binding limit of {} bytes; lower --ctx-size",
                        self.ctx.max_binding
                    ),
                });
            }
            Ok(self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(what),
                size: size.max(16),
                usage: STORAGE,
                mapped_at_creation: false,
            }))
        };
        Ok(WgpuCache { k: make(k_width, "key")?, v: make(v_width, "value")?, k_width, v_width, n_ctx })
    }

    fn attention(
        &self,
        q: &WgpuTensor,
        k: &WgpuTensor,
        v: &WgpuTensor,
        cache: &mut WgpuCache,
        pos0: usize,
        spec: &AttnSpec,
        sinks: Option<&WgpuTensor>,
    ) -> Result<WgpuTensor, OpError> {
        Self::check_attention(q, k, v, cache, pos0, spec, sinks)?;
        self.attention_step(q, k, v, cache, pos0, spec, sinks, None)
    }

    fn rope_attention(&self, step: &AttnStep<'_, Self>, cache: &mut WgpuCache) -> Result<WgpuTensor, OpError> {
        self.rope_attention_fused(step, cache)
    }

    fn add_rms_norm(
        &self,
        a: &WgpuTensor,
        b: &WgpuTensor,
        weight: Option<&WgpuTensor>,
        eps: f32,
    ) -> Result<(WgpuTensor, WgpuTensor), OpError> {
        match self.fuse_wait_add_norm(a, b, weight, eps)? {
            Some(fused) => Ok(fused),
            None => crate::backend::add_then_rms_norm(self, a, b, weight, eps),
        }
    }

    fn attention_norms_qk(&self, n_tokens: usize, spec: &AttnSpec) -> bool {
        self.attention_takes_qk_norm(n_tokens, spec)
    }

    fn router_route(
        &self,
        x: &WgpuTensor,
        router: &WgpuWeight,
        selection_bias: Option<&WgpuTensor>,
        spec: &RouteSpec,
    ) -> Result<Routing<Self>, OpError> {
        // The ids stay on the GPU as `route` leaves them for one token.
        let ids_on_gpu = self.experts.as_ref().is_none_or(|t| t.reads_host());
        if let Some(tier) = &self.experts {
            // The split guesses a layer's experts with this router on the layer before.
            tier.note_router(router, spec);
        }
        // The norm that wrote `x`, taken out of the pending commands while the routing kernel
        // that norms its input itself is recorded, then put back after it (only where the ids
        // stay on the GPU: a readback of them would submit the routing alone anyway).
        let held = if ids_on_gpu { self.take_norm_for_router(x) } else { None };
        let routed = self.router_route_gpu(x, router, selection_bias, spec, ids_on_gpu, held.as_ref().map(|h| &h.1));
        if let Some((cmd, _)) = held {
            self.put_norm_back(cmd, matches!(routed, Ok(Some(_))));
        }
        match routed? {
            Some(r) => Ok(r),
            None => crate::backend::route_router_logits(self, x, router, selection_bias, spec),
        }
    }

    fn route(
        &self,
        logits: &WgpuTensor,
        selection_bias: Option<&WgpuTensor>,
        spec: &RouteSpec,
    ) -> Result<Routing<Self>, OpError> {
        let n_expert = logits.width();
        if spec.k == 0 || spec.k > n_expert {
            return Err(OpError::ShapeMismatch {
                op: "route",
                expected: format!("k = {} experts of {n_expert}", spec.k),
                got: logits.shape.clone(),
            });
        }
        if let Some(b) = selection_bias.filter(|b| b.len() != n_expert) {
            return Err(OpError::ShapeMismatch {
                op: "route bias",
                expected: format!("[{n_expert}]"),
                got: b.shape.clone(),
            });
        }
        // On the GPU. The ids come back (one small readback) when the host needs them: to find
        // the expert pool's misses, or to group a prefill batch by expert. A resident model's
        // decode step leaves them on the GPU, where the per-pair MoE kernels read them: no sync.
        // The tier's host-memory mode logs the ids on the GPU and reads them once per step.
        let ids_on_gpu = self.experts.as_ref().is_none_or(|t| t.reads_host()) && logits.rows() <= moe::MAX_FUSED_TOKENS;
        if let Some(r) = self.route_gpu(logits, selection_bias, spec, ids_on_gpu)? {
            return Ok(r);
        }
        // Past the kernel's limits: the CPU reference on the logits read back.
        let bias = selection_bias.map(|b| self.to_host(b)).transpose()?;
        let host = self.to_host(logits)?;
        let n = logits.rows();
        let mut ids = vec![0u32; n * spec.k];
        let mut weights = vec![0f32; n * spec.k];
        for t in 0..n {
            kernels::route_token(
                &host[t * n_expert..(t + 1) * n_expert],
                bias.as_deref(),
                spec,
                &mut ids[t * spec.k..(t + 1) * spec.k],
                &mut weights[t * spec.k..(t + 1) * spec.k],
            );
        }
        Ok(Routing { ids, weights: self.from_host(&weights, &[n, spec.k])?, k: spec.k })
    }

    fn moe_ffn(
        &self,
        x: &WgpuTensor,
        routing: &Routing<Self>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
    ) -> Result<WgpuTensor, OpError> {
        let n_embd = x.width();
        let n = x.rows();
        let k = routing.k;
        let ff = spec.n_ff;
        // The GPU router may have left the ids on the GPU (`routing_ids`).
        let ids_on_gpu = routing.ids.is_empty() && n * k > 0;
        if (!ids_on_gpu && routing.ids.len() != n * k)
            || routing.weights.len() != n * k
            || experts.up.n_rows != spec.n_expert * ff
            || experts.up.k != n_embd
            || experts.down.n_rows != spec.n_expert * n_embd
            || experts.down.k != ff
        {
            return Err(OpError::ShapeMismatch {
                op: "moe_ffn",
                expected: format!(
                    "{n} tokens x {k} ids and weights, up [{}, {ff}, {n_embd}], down [{}, {n_embd}, {ff}]",
                    spec.n_expert, spec.n_expert
                ),
                got: experts.up.shape.clone(),
            });
        }
        if let Some(&e) = routing.ids.iter().find(|&&e| e as usize >= spec.n_expert) {
            return Err(OpError::ShapeMismatch {
                op: "moe_ffn ids",
                expected: format!("ids < {}", spec.n_expert),
                got: vec![e as usize],
            });
        }
        if let Some(tier) = self.experts.as_ref().filter(|t| t.reads_host()) {
            return self.moe_ffn_host_tier(tier, x, routing, experts, spec);
        }
        // Decode on resident experts: every (token, expert) pair in two dispatches, when each
        // stacked matrix is one buffer (a stack over the storage-binding limit is split into
        // chunks, and takes the grouped path).
        fn whole(w: &WgpuWeight) -> Option<(&wgpu::Buffer, TypeLayout)> {
            match &w.chunks[..] {
                [c] if c.row0 == 0 => Some((&c.buffer, w.layout)),
                _ => None,
            }
        }
        let gate = experts.gate.as_ref().map(|g| whole(g).ok_or(())).transpose();
        if let (None, true, Ok(gate), Some(up), Some(down)) =
            (&self.experts, moe::pairs_fit(n, k, n_embd, ff), gate, whole(&experts.up), whole(&experts.down))
        {
            let strides = [
                ff * gate.map_or(0, |g| g.1.row_words(n_embd)),
                ff * up.1.row_words(n_embd),
                n_embd * down.1.row_words(ff),
            ]
            .map(|v| v as u32);
            let table = if ids_on_gpu {
                moe::PairTable::Gpu { buffer: &routing.weights.buf.buffer, at: (n * k) as u32, strides }
            } else {
                moe::PairTable::Host(
                    routing.ids.iter().map(|&e| [e, e * strides[0], e * strides[1], e * strides[2]]).collect(),
                )
            };
            let mats = moe::FusedMats { gate, up, down, host: None };
            let biases = [experts.gate_bias.as_ref(), experts.up_bias.as_ref(), experts.down_bias.as_ref()];
            return self.moe_pairs(x, k, &table, (&routing.weights.buf.buffer, 0), &mats, biases, spec);
        }
        let ids_back;
        let ids: &[u32] = if ids_on_gpu {
            ids_back = self.routing_ids(routing)?;
            &ids_back
        } else {
            &routing.ids
        };
        let view = moe::RouteView { ids, weights: &routing.weights, k };
        let mut by_expert: Vec<Vec<(u32, u32)>> = vec![Vec::new(); spec.n_expert];
        for (i, &e) in ids.iter().enumerate() {
            let e = e as usize;
            if e >= spec.n_expert {
                return Err(OpError::ShapeMismatch {
                    op: "moe_ffn ids",
                    expected: format!("ids < {}", spec.n_expert),
                    got: vec![e],
                });
            }
            by_expert[e].push(((i / k) as u32, i as u32));
        }
        if let Some(tier) = &self.experts {
            return self.moe_ffn_tiered(tier, x, &view, experts, spec, &by_expert);
        }
        let out = self.from_host(&vec![0f32; n * n_embd], &[n, n_embd])?;
        for (e, toks) in by_expert.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let mats = experts::ExpertMats {
                gate: experts.gate.as_ref().map(|g| (g, e * ff)),
                up: (&experts.up, e * ff),
                down: (&experts.down, e * n_embd),
            };
            self.expert_on_gpu(x, e, toks, &mats, experts, spec, &view, &out)?;
        }
        Ok(out)
    }

    fn argmax_rows(&self, x: &WgpuTensor) -> Result<Vec<u32>, OpError> {
        let rows = x.rows();
        let y = self.alloc_bytes("argmax", 4 * rows as u64)?;
        self.dispatch(
            self.plain(Plain::Argmax),
            &[&x.buf.buffer, &y.buffer],
            &[x.width() as u32, rows as u32, 0, 0],
            grid(rows),
        );
        let bytes = self.read_back(&y.buffer, 4 * rows as u64)?;
        Ok(le_u32s(&bytes))
    }

    fn matmul_per_head(&self, x: &WgpuTensor, w: &WgpuWeight) -> Result<WgpuTensor, OpError> {
        let (n_head, n_out) = match w.shape[..] {
            [h, o, _] => (h, o),
            _ => {
                return Err(OpError::ShapeMismatch {
                    op: "matmul_per_head",
                    expected: "w [n_head, n_out, k]".into(),
                    got: w.shape.clone(),
                })
            }
        };
        expect_width("matmul_per_head", x, n_head * w.k)?;
        let y = self.alloc("matmul_per_head", &[x.rows(), n_head * n_out])?;
        for h in 0..n_head {
            self.matmul_into(x, w, &y, Span { x_col0: h * w.k, w_row0: h * n_out, n_rows: n_out, y_col0: h * n_out })?;
        }
        Ok(y)
    }

    fn ssm_conv(&self, x: &WgpuTensor, state: &mut WgpuTensor, weight: &WgpuTensor) -> Result<WgpuTensor, OpError> {
        let channels = x.width();
        let k = state.rows() + 1;
        if state.width() != channels || weight.len() != channels * k || weight.width() != k {
            return Err(OpError::ShapeMismatch {
                op: "ssm_conv",
                expected: format!("state [k - 1, {channels}] and weight [{channels}, k] with the same k"),
                got: [state.shape.clone(), weight.shape.clone()].concat(),
            });
        }
        let n = x.rows();
        let y = self.alloc("ssm_conv", &[n, channels])?;
        let next = self.alloc("ssm_conv state", &state.shape)?;
        let pipe = self.plain(Plain::SsmConv);
        for (mode, out, rows) in [(0u32, &y, n), (1, &next, k - 1)] {
            self.dispatch(
                pipe.clone(),
                &[&state.buf.buffer, &x.buf.buffer, &weight.buf.buffer, &out.buf.buffer],
                &[n as u32, channels as u32, k as u32, mode],
                grid((rows * channels).div_ceil(256)),
            );
        }
        self.copy(&next.buf.buffer, 0, &state.buf.buffer, 0, 4 * ((k - 1) * channels) as u64);
        Ok(y)
    }

    fn ssm_scan(&self, inputs: &SsmScan<'_, Self>, state: &mut WgpuTensor) -> Result<WgpuTensor, OpError> {
        let SsmDims { n, n_head, head_dim, d_state } = inputs.check(self, state)?;
        if d_state > 256 {
            return Err(OpError::ShapeMismatch {
                op: "ssm_scan",
                expected: "d_state up to 256".into(),
                got: inputs.b.shape.to_vec(),
            });
        }
        // a, d and dt_bias side by side in one buffer (absent ones zero): the kernel then needs
        // 7 storage bindings, under the default limit of 8.
        let adb = self.upload("ssm_scan adb", bytemuck::cast_slice(&vec![0f32; 3 * n_head]))?;
        let row = 4 * n_head as u64;
        self.copy(&inputs.a.buf.buffer, 0, &adb.buffer, 0, row);
        if let Some(d) = inputs.d {
            self.copy(&d.buf.buffer, 0, &adb.buffer, row, row);
        }
        if let Some(b) = inputs.dt_bias {
            self.copy(&b.buf.buffer, 0, &adb.buffer, 2 * row, row);
        }
        let y = self.alloc("ssm_scan", &[n, n_head * head_dim])?;
        self.dispatch(
            self.plain(Plain::SsmScan),
            &[
                &inputs.x.buf.buffer,
                &inputs.dt.buf.buffer,
                &inputs.b.buf.buffer,
                &inputs.c.buf.buffer,
                &adb.buffer,
                &state.buf.buffer,
                &y.buf.buffer,
            ],
            &[n as u32, n_head as u32, head_dim as u32, d_state as u32, inputs.n_group as u32, 0, 0, 0],
            grid(n_head * head_dim),
        );
        Ok(y)
    }
}
