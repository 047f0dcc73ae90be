//! Fused ops of the GPU back end: work that the op-by-op graph spreads over several dispatches
//! done in one, to cut a decode step's dispatch count (each costs host time to record and encode,
//! ~8 us on the H200, and GPU time: launch, drain and barrier, docs/NOTES.md).
//!
//! - [`Backend::rope_attention`] (and `attention`): q and k rotated, k and v written to the cache
//!   and the attention computed in one dispatch (`attention.wgsl`), where the op-by-op path had
//!   two rope table uploads, two ropes, two cache copies and the attention. Up to four tokens
//!   (a decode step) take `attention_decode.wgsl`, built for latency: a workgroup per KV head
//!   (its grouped query heads together) and key slice, subgroups scoring keys with the head's
//!   dims across their lanes, and for a context longer than one slice a second, small dispatch
//!   combining the slices (flash-decoding). `DISKFORMER_ATTN_DECODE=off` keeps `attention.wgsl`
//!   (a workgroup per token and head) for every size, `=WGxKEYS[uUNROLL][rROWS]` picks the shape.
//! - The rope cos/sin table of a step is uploaded once and shared by every layer (they all rotate
//!   the same positions with the same spec), instead of once per `rope` call.
//! - Int8 blocks written in epilogues: a one-token norm and the attention write their output's
//!   int8 blocks too, into the int8 cache (`int8.rs`) as the GLU kernel does, so the products
//!   that read them need no quantize dispatch.
//! - [`Backend::matmul_add`]: the residual added by the product's kernel (its accumulate
//!   option) into the residual's own buffer: no add dispatch.
//! - [`Backend::matmul_many`]: with int8 activations, one dispatch of the multi-weight int8 kernel
//!   for q/k/v (or gate/up) of one type (`int8.rs`); mixed types quantize the shared input once
//!   and run one product each.
//! - [`Backend::matmul_glu`]: gate, up and the GLU in one int8 dispatch that also writes the
//!   result's int8 blocks for the down projection (`int8.rs`).
//!
//! `DISKFORMER_NO_FUSE=1` turns all of it off (the op-by-op graph, one rope table upload per
//! `rope`, no int8 epilogues), so one binary measures both.

use super::shaders::{AttnDecodeKernel, AttnDecodeShape};
use super::{expect_width, grid, lock, OpError, PooledBuffer, Span, WgpuBackend, WgpuCache, WgpuTensor, WgpuWeight};
use crate::backend::{AttnStep, Backend, QkNorm};
use crate::cpu::kernels;
use crate::spec::{AttnCall, AttnSpec, RopeSpec};
use std::sync::Arc;

/// Storage buffers `attention.wgsl` binds (q, new k and v, rope table, sinks, the two cache
/// halves, output, int8 blocks and scales): more than WebGPU's default limit of 8, within every
/// Vulkan, Metal and DX12 adapter's.
const ATTENTION_STORAGE_BUFFERS: u32 = 10;

/// Storage buffers `attention_decode.wgsl` binds: `attention.wgsl`'s and the key slices' partial
/// states.
const DECODE_STORAGE_BUFFERS: u32 = 12;

/// Storage buffers of the decode kernel's q/k-norm variant: the two norms' weights more.
const DECODE_NORM_STORAGE_BUFFERS: u32 = DECODE_STORAGE_BUFFERS + 2;

/// Most query tokens the decode kernel takes (a decode step, or a few speculative tokens); more
/// go through `attention.wgsl`, whose workgroup per (token, head) fills the GPU by itself.
const DECODE_MAX_TOKENS: usize = super::shaders::ATTN_NORM_MAX_TOKENS as usize;

/// Most key slices of one decode step: past it the slices grow, so the combine pass reads few
/// partial states per row however long the context.
const DECODE_MAX_SPLITS: usize = 64;

/// Which attention kernel a call takes. The model path takes `Auto`; tests and `perf_attention`
/// name one, to compare them in one process.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// The decode kernel for up to [`DECODE_MAX_TOKENS`] tokens when it applies (shape from
    /// `DISKFORMER_ATTN_DECODE`, `off` disables it), else `attention.wgsl`.
    Auto,
    /// `attention.wgsl`: a workgroup per (token, head).
    Prefill,
    /// `attention_decode.wgsl` with this shape; `subgroups: false` forces the reduction through
    /// workgroup memory that adapters without subgroups take. An error when it cannot run.
    Decode {
        /// Workgroup size and keys per workgroup.
        shape: AttnDecodeShape,
        /// Subgroup reductions when the adapter has them.
        subgroups: bool,
    },
}

/// How one decode attention call is dispatched.
struct DecodePlan {
    kernel: AttnDecodeKernel,
    /// Workgroups per KV head over its query rows.
    n_rowgroups: usize,
    /// First key any row sees (a sliding window's start for the first token).
    key_lo: usize,
    /// Keys per workgroup.
    split_keys: usize,
    /// Key slices (workgroups per row group); more than one adds the combine pass.
    n_split: usize,
}

/// What `DISKFORMER_ATTN_DECODE` asks of the decode kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DecodeChoice {
    /// `off` (or `0`): `attention.wgsl` at every size.
    Off,
    /// `WGxKEYS[uUNROLL][rROWS]` (e.g. `256x128u2`): that shape at every context.
    Fixed(AttnDecodeShape),
    /// Unset (or malformed): [`default_decode_shape`] by context length.
    ByContext,
}

fn decode_choice() -> DecodeChoice {
    static CHOICE: std::sync::OnceLock<DecodeChoice> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var("DISKFORMER_ATTN_DECODE") {
        Ok(v) if v == "off" || v == "0" => DecodeChoice::Off,
        Ok(v) => AttnDecodeShape::parse(&v).map_or(DecodeChoice::ByContext, DecodeChoice::Fixed),
        Err(_) => DecodeChoice::ByContext,
    })
}

/// The decode kernel's shape for a step that sees `n_keys` keys, chosen from the H200 grid of
/// the seventh session (docs/NOTES.md; 18 shapes x contexts 1 to 8192, 32 query heads over 8 and
/// over 4 KV heads, head dim 128): one query row per workgroup at every context (a KV head's
/// query heads in separate workgroups read its keys again, from L2, but the workgroups are 4-8x
/// more: with 8 rows, Qwen3-30B-A3B's step was 4 workgroups at a short context and took 66 us
/// where one row takes 25); 16 keys per workgroup and 4 keys per loop iteration up to 256 keys
/// (ctx 128: 31 us against 88 for the former 128x64), past that 32 keys and one key per
/// iteration (fewer registers: ctx 2048 105 us against 118 with 4, 8192 220 against 249).
/// End to end the short-context shape took the 8B decode from 156 to 205 tok/s and Qwen3-30B-A3B
/// from 80 to 145 in the same run.
///
/// Up to [`DECODE_ONE_SLICE_KEYS`] keys take one slice of them all: no combine pass, one
/// dependent dispatch less on a decode step's chain at the short contexts where a slice's loop
/// is short anyway (except on odd decode steps under `DISKFORMER_AB=attnsplit`).
fn default_decode_shape(n_keys: usize) -> AttnDecodeShape {
    if n_keys <= DECODE_ONE_SLICE_KEYS && !crate::ab::is_b("attnsplit") {
        AttnDecodeShape { wg: 128, split_keys: DECODE_ONE_SLICE_KEYS as u32, unroll: 4, max_rows: 1 }
    } else if n_keys <= 256 {
        AttnDecodeShape { wg: 128, split_keys: 16, unroll: 4, max_rows: 1 }
    } else {
        AttnDecodeShape { wg: 128, split_keys: 32, unroll: 1, max_rows: 1 }
    }
}

/// Most keys the default decode shape takes in one slice (see [`default_decode_shape`]).
const DECODE_ONE_SLICE_KEYS: usize = 64;

/// Tables kept for one step's positions: enough for models that alternate two rope specs (local
/// and global layers) with room to spare; past it the oldest goes.
const ROPE_TABLES_KEPT: usize = 4;

/// The rope cos/sin tables of the current step, keyed by what they were computed from.
#[derive(Default)]
pub(super) struct RopeTables {
    entries: Vec<(RopeSpec, Vec<u32>, Arc<PooledBuffer>)>,
}

/// cos, sin pairs `[positions, n_rot / 2]` as the CPU reference computes them.
fn cos_sin_table(positions: &[u32], spec: &RopeSpec) -> Vec<f32> {
    let table = kernels::RopeTable::new(spec);
    let half = spec.n_rot / 2;
    let mut cs = Vec::with_capacity(positions.len() * half * 2);
    for &p in positions {
        let (c, s) = table.cos_sin(p);
        for i in 0..half {
            cs.push(c[i]);
            cs.push(s[i]);
        }
    }
    cs
}

impl WgpuBackend {
    /// The cos/sin table (`[positions, n_rot / 2]` pairs) of `positions` under `spec`, computed on
    /// the host exactly as the CPU reference computes it (GPU trigonometry of large angles is not
    /// accurate enough) and uploaded once per step.
    pub(super) fn rope_table(&self, positions: &[u32], spec: &RopeSpec) -> Result<Arc<PooledBuffer>, OpError> {
        if !self.ctx.fuse {
            return Ok(Arc::new(self.upload("rope table", bytemuck::cast_slice(&cos_sin_table(positions, spec)))?));
        }
        let mut tables = lock(&self.ctx.rope_tables);
        // The previous step's tables go back to the pool before this step's upload takes a
        // buffer, so each step's table lands in the same buffer (its bind groups stay cached).
        tables.entries.retain(|(_, p, _)| p == positions);
        if let Some((_, _, buf)) = tables.entries.iter().find(|(s, _, _)| s == spec) {
            return Ok(buf.clone());
        }
        if tables.entries.len() >= ROPE_TABLES_KEPT {
            tables.entries.remove(0);
        }
        let buf = Arc::new(self.upload("rope table", bytemuck::cast_slice(&cos_sin_table(positions, spec)))?);
        tables.entries.push((spec.clone(), positions.to_vec(), buf.clone()));
        Ok(buf)
    }

    /// The shape checks of `rope`: one position per row, whole heads, `n_rot` within a head.
    pub(super) fn check_rope(x: &WgpuTensor, positions: &[u32], spec: &RopeSpec) -> Result<(), OpError> {
        spec.check_call(x.rows(), x.width(), &x.shape, positions.len())
    }

    /// The shape checks of `attention`.
    #[allow(clippy::too_many_arguments)] // attention's own parameters, checked together
    pub(super) fn check_attention(
        q: &WgpuTensor,
        k: &WgpuTensor,
        v: &WgpuTensor,
        cache: &WgpuCache,
        pos0: usize,
        spec: &AttnSpec,
        sinks: Option<&WgpuTensor>,
    ) -> Result<(), OpError> {
        let n = q.rows();
        expect_width("attention q", q, spec.n_head * spec.head_dim_k)?;
        expect_width("attention k", k, cache.k_width)?;
        expect_width("attention v", v, cache.v_width)?;
        spec.check_call(&AttnCall {
            n,
            k_rows: k.rows(),
            v_rows: v.rows(),
            cache_k_width: cache.k_width,
            cache_v_width: cache.v_width,
            n_ctx: cache.n_ctx,
            pos0,
            sinks: sinks.map(|s| &s.shape[..]),
            // The attention kernel keeps a head's values in a fixed-size array.
            max_head_dim: Some(512),
        })
    }

    /// One attention step (`attention.wgsl`, or for a few tokens `attention_decode.wgsl`): q and
    /// k rotated when `rope` (the spec and the tokens' positions) is given, k and v written to
    /// cache rows `pos0..pos0 + n`, attention over rows `0..pos0 + n`, and, when the output
    /// projection will take int8 activations (one token, whole 32-value blocks per head), the
    /// output's int8 blocks. The shapes are checked by the caller.
    #[allow(clippy::too_many_arguments)] // attention's own parameters and the rotation
    pub(super) fn attention_step(
        &self,
        q: &WgpuTensor,
        k: &WgpuTensor,
        v: &WgpuTensor,
        cache: &WgpuCache,
        pos0: usize,
        spec: &AttnSpec,
        sinks: Option<&WgpuTensor>,
        rope: Option<(&RopeSpec, &[u32])>,
    ) -> Result<WgpuTensor, OpError> {
        self.attention_with(q, k, v, cache, pos0, spec, sinks, rope, AttnKernel::Auto, None)
    }

    /// [`attention_step`](Self::attention_step) with the kernel chosen by `kernel`, and the
    /// per-head q and k norms done by the decode kernel when `qk_norm` is given (an error when
    /// the decode kernel does not take the call: [`Backend::attention_norms_qk`] says when).
    #[allow(clippy::too_many_arguments)] // attention's own parameters, the rotation, the norms and the kernel
    fn attention_with(
        &self,
        q: &WgpuTensor,
        k: &WgpuTensor,
        v: &WgpuTensor,
        cache: &WgpuCache,
        pos0: usize,
        spec: &AttnSpec,
        sinks: Option<&WgpuTensor>,
        rope: Option<(&RopeSpec, &[u32])>,
        kernel: AttnKernel,
        qk_norm: Option<QkNorm<'_, WgpuBackend>>,
    ) -> Result<WgpuTensor, OpError> {
        let n_storage = self.ctx.device.limits().max_storage_buffers_per_shader_stage;
        if n_storage < ATTENTION_STORAGE_BUFFERS {
            return Err(OpError::Unsupported {
                op: "attention",
                backend: "wgpu",
                why: format!(
                    "the attention kernel binds {ATTENTION_STORAGE_BUFFERS} storage buffers; this adapter allows {n_storage}"
                ),
            });
        }
        let n = q.rows();
        let normed = qk_norm.is_some();
        let plan = match kernel {
            AttnKernel::Auto => match decode_choice() {
                DecodeChoice::Off => None,
                DecodeChoice::Fixed(shape) => self.decode_plan(n, pos0, spec, shape, true, normed),
                DecodeChoice::ByContext => {
                    self.prepare_decode_pipelines(spec, normed);
                    let n_keys = pos0 + n - spec.window.map_or(0, |w| (pos0 + 1).saturating_sub(w));
                    self.decode_plan(n, pos0, spec, default_decode_shape(n_keys), true, normed)
                }
            },
            AttnKernel::Prefill => None,
            AttnKernel::Decode { shape, subgroups } => {
                Some(self.decode_plan(n, pos0, spec, shape, subgroups, normed).ok_or_else(|| OpError::Unsupported {
                    op: "attention",
                    backend: "wgpu",
                    why: format!(
                        "the decode attention kernel takes at most {DECODE_MAX_TOKENS} tokens, head dims that are multiples of 4 and {DECODE_STORAGE_BUFFERS} storage buffers (got {n} tokens, head dims {}/{})",
                        spec.head_dim_k, spec.head_dim_v
                    ),
                })?)
            }
        };
        if let (Some(norms), None) = (qk_norm, &plan) {
            return Err(OpError::Unsupported {
                op: "rope_attention",
                backend: "wgpu",
                why: format!(
                    "q and k norms (eps {}) inside an attention of {n} tokens that the decode kernel does not take",
                    norms.eps
                ),
            });
        }
        if let Some(norms) = qk_norm {
            expect_width("attention q norm", norms.q, spec.head_dim_k)?;
            expect_width("attention k norm", norms.k, spec.head_dim_k)?;
        }
        let y = self.alloc("attention", &[n, spec.n_head * spec.head_dim_v])?;
        let table = match rope {
            Some((r, positions)) => Some(self.rope_table(positions, r)?),
            None => None,
        };
        // Each workgroup quantizes its head's values: whole blocks only if a head is.
        let q8 = self.q8_epilogue_target(&y, spec.head_dim_v.is_multiple_of(32));
        // Without int8 output the kernel writes no blocks; `y` fills their bindings (the dummy is
        // bound read-only, and one buffer may not be both read-only and writable in a dispatch).
        let (qs, ds) = q8.as_ref().map_or((&y.buf.buffer, &y.buf.buffer), |(q, d)| (q, d));
        let dummy = &self.ctx.dummy;
        let (rope_on, rope_head_dim, n_rot, neox) =
            rope.map_or((0, 0, 0, 0), |(r, _)| (1, r.head_dim, r.n_rot, r.neox as u32));
        let table_buf = table.as_ref().map_or(dummy, |t| &t.buffer);
        let sinks_buf = sinks.map_or(dummy, |s| &s.buf.buffer);
        // What both kernels bind first (the decode kernel adds its partial states after them).
        let common_buffers = [
            &q.buf.buffer,
            &k.buf.buffer,
            &v.buf.buffer,
            table_buf,
            sinks_buf,
            &cache.k,
            &cache.v,
            &y.buf.buffer,
            qs,
            ds,
        ];
        if let Some(plan) = plan {
            let split = plan.n_split > 1;
            let rows_total = n * spec.n_head;
            // The slices' partial states, for the combine pass.
            let parts = if split {
                Some((
                    self.alloc_bytes("attention partials", 4 * (plan.n_split * rows_total * spec.head_dim_v) as u64)?,
                    self.alloc_bytes("attention partial max/sum", 8 * (plan.n_split * rows_total) as u64)?,
                ))
            } else {
                None
            };
            let (pacc, pml) = parts.as_ref().map_or((&y.buf.buffer, &y.buf.buffer), |(a, m)| (&a.buffer, &m.buffer));
            let kernel = plan.kernel;
            let mut buffers = common_buffers.to_vec();
            buffers.extend([pacc, pml]);
            if let Some(norms) = qk_norm {
                buffers.extend([&norms.q.buf.buffer, &norms.k.buf.buffer]);
            }
            self.dispatch(
                self.ctx.pipeline_with(&kernel.key(), || super::shaders::attention_decode(&kernel), true),
                &buffers,
                &[
                    n as u32,
                    spec.n_head as u32,
                    spec.n_head_kv as u32,
                    pos0 as u32,
                    spec.window.unwrap_or(0) as u32,
                    sinks.is_some() as u32,
                    spec.scale.to_bits(),
                    spec.softcap.unwrap_or(0.0).to_bits(),
                    rope_on,
                    rope_head_dim as u32,
                    n_rot as u32,
                    neox,
                    q8.is_some() as u32,
                    plan.n_split as u32,
                    plan.split_keys as u32,
                    plan.n_rowgroups as u32,
                    plan.key_lo as u32,
                    qk_norm.map_or(0, |norms| norms.eps.to_bits()),
                    0,
                    0,
                ],
                [(spec.n_head_kv * plan.n_rowgroups) as u32, plan.n_split as u32, 1],
            );
            if split {
                let hdv = spec.head_dim_v as u32;
                self.dispatch(
                    self.combine_pipeline(hdv),
                    &[pacc, pml, sinks_buf, &y.buf.buffer, qs, ds],
                    &[
                        rows_total as u32,
                        spec.n_head as u32,
                        plan.n_split as u32,
                        sinks.is_some() as u32,
                        q8.is_some() as u32,
                        0,
                        0,
                        0,
                    ],
                    grid(rows_total),
                );
            }
        } else {
            self.dispatch(
                self.plain(super::Plain::Attention),
                &common_buffers,
                &[
                    n as u32,
                    spec.n_head as u32,
                    spec.n_head_kv as u32,
                    spec.head_dim_k as u32,
                    spec.head_dim_v as u32,
                    pos0 as u32,
                    spec.window.unwrap_or(0) as u32,
                    sinks.is_some() as u32,
                    spec.scale.to_bits(),
                    spec.softcap.unwrap_or(0.0).to_bits(),
                    rope_on,
                    rope_head_dim as u32,
                    n_rot as u32,
                    neox,
                    q8.is_some() as u32,
                    0,
                ],
                grid(n * spec.n_head),
            );
        }
        if q8.is_some() {
            self.q8_register(&y.buf.buffer, y.width());
        }
        Ok(y)
    }

    /// Creates every pipeline the default decode attention may take for these head dims (the
    /// short- and long-context shapes and the combine pass) the first time a model's attention
    /// runs, so none is compiled in the middle of a generation: on the H200 the first
    /// 128-token run of a process decoded at ~175 tok/s against ~230 for the next, about the
    /// 0.2 s the driver takes to compile one of them when the context first needs it.
    fn prepare_decode_pipelines(&self, spec: &AttnSpec, qk_norm: bool) {
        use std::sync::atomic::Ordering;
        let dims = ((qk_norm as u64) << 63) | ((spec.head_dim_k as u64) << 32) | spec.head_dim_v as u64;
        if self.ctx.decode_pipelines_ready.swap(dims, Ordering::Relaxed) == dims {
            return;
        }
        for n_keys in [1, DECODE_MAX_SPLITS * 64] {
            // A plan for one token at a context of `n_keys`: its kernel is the shape that
            // context takes. None: the decode kernel never runs for this spec.
            let Some(plan) = self.decode_plan(1, n_keys - 1, spec, default_decode_shape(n_keys), true, qk_norm) else {
                return;
            };
            let kernel = plan.kernel;
            self.ctx.pipeline_with(&kernel.key(), || super::shaders::attention_decode(&kernel), true);
        }
        self.combine_pipeline(spec.head_dim_v as u32);
    }

    /// The combine pass of a split decode attention over value heads of `hdv` dims.
    fn combine_pipeline(&self, hdv: u32) -> Arc<wgpu::ComputePipeline> {
        self.ctx.pipeline_with(&format!("AttentionCombine hdv{hdv}"), || super::shaders::attention_combine(hdv), true)
    }

    /// How the decode kernel would run `n` tokens at `pos0` with `shape` (`subgroups`: when the
    /// adapter has them and the workgroup holds whole subgroups); `None` when it cannot (too many
    /// tokens, head dims not multiples of 4, the adapter's limits; with `qk_norm`, the q/k-norm
    /// variant's: a power-of-two workgroup and two more storage buffers).
    fn decode_plan(
        &self,
        n: usize,
        pos0: usize,
        spec: &AttnSpec,
        shape: AttnDecodeShape,
        subgroups: bool,
        qk_norm: bool,
    ) -> Option<DecodePlan> {
        let norm_limits = self.ctx.device.limits().max_storage_buffers_per_shader_stage >= DECODE_NORM_STORAGE_BUFFERS
            && shape.wg.is_power_of_two();
        if qk_norm && !norm_limits {
            return None;
        }
        let (hdk, hdv) = (spec.head_dim_k, spec.head_dim_v);
        let limits = self.ctx.device.limits();
        if n == 0
            || n > DECODE_MAX_TOKENS
            || !hdk.is_multiple_of(4)
            || !hdv.is_multiple_of(4)
            || spec.n_head_kv == 0
            || !spec.n_head.is_multiple_of(spec.n_head_kv)
            || limits.max_storage_buffers_per_shader_stage < DECODE_STORAGE_BUFFERS
            || shape.wg > limits.max_compute_invocations_per_workgroup
            || shape.wg > limits.max_compute_workgroup_size_x
        {
            return None;
        }
        let subgroup_min = if subgroups && self.ctx.subgroups {
            let info = self.ctx.device.adapter_info();
            // Lanes map to head chunks by subgroup size: every subgroup must be whole.
            let whole = info.subgroup_max_size <= shape.wg && shape.wg.is_multiple_of(info.subgroup_max_size);
            whole.then_some(info.subgroup_min_size.max(4))
        } else {
            None
        };
        let group = spec.n_head / spec.n_head_kv;
        let mut kernel = AttnDecodeKernel {
            wg: shape.wg,
            rows: 1,
            hdk: hdk as u32,
            hdv: hdv as u32,
            unroll: if subgroup_min.is_some() { shape.unroll } else { 1 },
            subgroup_min,
            qk_norm,
        };
        // Registers: a lane holds ROWS x (CK + CV) chunks of queries and accumulators.
        let rows_cap = (16 / kernel.ck().max(kernel.cv())).clamp(1, shape.max_rows);
        kernel.rows = ((group * n).next_power_of_two() as u32).min(rows_cap);
        while kernel.workgroup_bytes() > limits.max_compute_workgroup_storage_size && kernel.rows > 1 {
            kernel.rows /= 2;
        }
        if kernel.workgroup_bytes() > limits.max_compute_workgroup_storage_size {
            return None;
        }
        let n_rowgroups = (group * n).div_ceil(kernel.rows as usize);
        let key_lo = spec.window.map_or(0, |w| (pos0 + 1).saturating_sub(w));
        let n_keys = pos0 + n - key_lo;
        let split_keys = (shape.split_keys as usize).max(n_keys.div_ceil(DECODE_MAX_SPLITS).next_multiple_of(16));
        let n_split = n_keys.div_ceil(split_keys);
        if spec.n_head_kv * n_rowgroups > 65535 {
            return None;
        }
        Some(DecodePlan { kernel, n_rowgroups, key_lo, split_keys, n_split })
    }

    /// Seconds per attention step of `n_tok` tokens over a context of `n_keys` keys (the new
    /// ones included) through `kernel` (for `--ignored perf_attention`): the model path's
    /// step, with the rotation when `rope` is given and the int8 epilogue when this back end
    /// takes int8 activations.
    #[doc(hidden)]
    pub fn perf_attention(
        &self,
        spec: &AttnSpec,
        rope: Option<&RopeSpec>,
        n_keys: usize,
        n_tok: usize,
        kernel: AttnKernel,
        reps: usize,
    ) -> Result<f64, OpError> {
        let n_tok = n_tok.clamp(1, n_keys.max(1));
        let pos0 = n_keys - n_tok;
        let (qw, kw, vw) =
            (spec.n_head * spec.head_dim_k, spec.n_head_kv * spec.head_dim_k, spec.n_head_kv * spec.head_dim_v);
        let cache = self.new_cache(n_keys, kw, vw)?;
        // Values in [-1, 1) from a fixed sequence: the timing does not depend on them.
        let values = |n: usize, seed: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / 8_388_608.0 - 1.0)
                .collect()
        };
        let q = self.from_host(&values(n_tok * qw, 1), &[n_tok, qw])?;
        let k = self.from_host(&values(n_tok * kw, 2), &[n_tok, kw])?;
        let v = self.from_host(&values(n_tok * vw, 3), &[n_tok, vw])?;
        let positions: Vec<u32> = (pos0 as u32..(pos0 + n_tok) as u32).collect();
        Self::check_attention(&q, &k, &v, &cache, pos0, spec, None)?;
        self.time_reps(reps, || {
            self.attention_with(&q, &k, &v, &cache, pos0, spec, None, rope.map(|r| (r, &positions[..])), kernel, None)
                .map(drop)
        })
    }

    /// [`Backend::rope_attention`] through `kernel` (tests compare every kernel, the decode
    /// kernel's fallback without subgroups included, with the CPU).
    #[doc(hidden)]
    pub fn rope_attention_with(
        &self,
        step: &AttnStep<'_, WgpuBackend>,
        cache: &mut WgpuCache,
        kernel: AttnKernel,
    ) -> Result<WgpuTensor, OpError> {
        let AttnStep { q, k, v, pos0, positions, rope, spec, sinks, qk_norm } = *step;
        Self::check_attention(q, k, v, cache, pos0, spec, sinks)?;
        if let Some(r) = rope {
            Self::check_rope(q, positions, r)?;
            Self::check_rope(k, positions, r)?;
        }
        self.attention_with(q, k, v, cache, pos0, spec, sinks, rope.map(|r| (r, positions)), kernel, qk_norm)
    }

    /// [`Backend::attention_norms_qk`]: the decode kernel's q/k-norm variant takes `n_tokens`
    /// tokens of `spec` (fused ops on, the rotation in the attention, the decode kernel on and
    /// its plan possible), except on odd decode steps under `DISKFORMER_AB=qkfuse` (the norms
    /// then go through `rms_norm_pair`, for the in-process A/B) and never under
    /// `DISKFORMER_QK_NORM=apart` (a whole run's greedy text against the fused one's).
    pub(super) fn attention_takes_qk_norm(&self, n_tokens: usize, spec: &AttnSpec) -> bool {
        static APART: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *APART.get_or_init(|| std::env::var("DISKFORMER_QK_NORM").is_ok_and(|v| v.trim() == "apart")) {
            return false;
        }
        let shape = match decode_choice() {
            DecodeChoice::Off => return false,
            DecodeChoice::Fixed(shape) => shape,
            // Both context lengths' shapes have the same workgroup, so the same limits.
            DecodeChoice::ByContext => default_decode_shape(1),
        };
        self.ctx.fuse
            && n_tokens <= rope_in_attention_max_tokens()
            && !crate::ab::is_b("qkfuse")
            && self.decode_plan(n_tokens, 0, spec, shape, true, true).is_some()
    }

    /// [`Backend::rope_attention`] in one dispatch ([`attention_step`](Self::attention_step)).
    pub(super) fn rope_attention_fused(
        &self,
        step: &AttnStep<'_, WgpuBackend>,
        cache: &mut WgpuCache,
    ) -> Result<WgpuTensor, OpError> {
        let AttnStep { q, k, v, pos0, positions, rope, spec, sinks, qk_norm } = *step;
        // The kernel rotates a new key each time a query head reads it, which is free for the few
        // tokens of a decode step but, in a prefill, multiplies the rotation by the number of
        // query tokens that see each key (H200, 8B: prefill 1016 -> 715 tok/s with it): more
        // tokens than this rotate once, in their own dispatches, first.
        if !self.ctx.fuse || q.rows() > rope_in_attention_max_tokens() {
            if qk_norm.is_some() {
                return Err(OpError::Unsupported {
                    op: "rope_attention",
                    backend: "wgpu",
                    why: format!(
                        "q and k norms inside an attention of {} tokens (fused ops off or too many tokens)",
                        q.rows()
                    ),
                });
            }
            return match rope {
                Some(r) => {
                    let (q, k) = (self.rope(q, positions, r)?, self.rope(k, positions, r)?);
                    self.attention(&q, &k, v, cache, pos0, spec, sinks)
                }
                None => self.attention(q, k, v, cache, pos0, spec, sinks),
            };
        }
        Self::check_attention(q, k, v, cache, pos0, spec, sinks)?;
        if let Some(r) = rope {
            Self::check_rope(q, positions, r)?;
            Self::check_rope(k, positions, r)?;
        }
        self.attention_with(q, k, v, cache, pos0, spec, sinks, rope.map(|r| (r, positions)), AttnKernel::Auto, qk_norm)
    }
}

/// Most tokens whose rotation the attention kernel does itself (`DISKFORMER_ROPE_IN_ATTENTION_MAX`
/// overrides it, for comparisons; 0 never).
fn rope_in_attention_max_tokens() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("DISKFORMER_ROPE_IN_ATTENTION_MAX").ok().and_then(|v| v.parse().ok()).unwrap_or(4)
    })
}

/// `DISKFORMER_NO_Q8_EPILOGUE=1`: norms and attention write no int8 blocks, the products quantize
/// their activations themselves (for comparisons).
fn q8_epilogues_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("DISKFORMER_NO_Q8_EPILOGUE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

impl WgpuBackend {
    /// The int8 cache's buffers for the blocks of `y` (`[1, width]`), which the kernel about to be
    /// recorded writes in its epilogue, when the products reading `y` would take int8 activations
    /// (one token of whole 32-value blocks, int8 activations on, fused ops on) and `whole_blocks`
    /// (the kernel's own condition) holds; `None`: the kernel writes no blocks. After recording
    /// the kernel, the caller registers them (`q8_register`), and the next int8 products of `y`
    /// read them instead of quantizing (`int8.rs`, the cache's rules).
    pub(super) fn q8_epilogue_target(
        &self,
        y: &WgpuTensor,
        whole_blocks: bool,
    ) -> Option<(wgpu::Buffer, wgpu::Buffer)> {
        let applies = self.ctx.fuse
            && !q8_epilogues_off()
            && whole_blocks
            && self.uses_int8_activations()
            && self.ctx.matvec.is_some()
            && y.rows() == 1
            && y.width().is_multiple_of(32);
        applies.then(|| self.q8_target(y.len()))
    }

    /// Whether the int8 decode kernel takes `x · Wᵀ` (int8 activations on, one token, whole
    /// 32-value blocks, a weight type with an int8 dot product): the condition of the `int8`
    /// module's product, asked before quantizing once for several products.
    fn int8_takes(&self, x: &WgpuTensor, w: &WgpuWeight) -> bool {
        self.uses_int8_activations()
            && self.ctx.matvec.is_some()
            && x.rows() == 1
            && x.width().is_multiple_of(32)
            && w.k.is_multiple_of(32)
            && super::shaders::dot32_source(w.layout.dtype).is_some()
    }

    /// [`Backend::matmul_add`]: the product's kernel adds into the residual's buffer, so the
    /// residual connection costs no dispatch of its own.
    pub(super) fn matmul_add_fused(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        residual: WgpuTensor,
    ) -> Result<WgpuTensor, OpError> {
        if !self.ctx.fuse {
            let y = self.matmul(x, w)?;
            return self.add(&residual, &y);
        }
        self.matvec_accumulate_into(x, w, &residual)?;
        Ok(residual)
    }

    /// [`Backend::matmul_many`]: when int8 activations serve two or more of the products, `x` is
    /// quantized once for all of them (q/k/v: one quantization dispatch instead of three).
    pub(super) fn matmul_many_fused<const N: usize>(
        &self,
        x: &WgpuTensor,
        ws: [&WgpuWeight; N],
    ) -> Result<[WgpuTensor; N], OpError> {
        for w in ws {
            expect_width("matmul_many", x, w.k)?;
        }
        // q/k/v (or gate/up) of one type: one int8 dispatch for all of them.
        if N >= 2 {
            if let Some(ys) = self.matmul_many_q8(x, &ws)? {
                return ys.try_into().map_err(|v: Vec<WgpuTensor>| OpError::ShapeMismatch {
                    op: "matmul_many",
                    expected: format!("{N} outputs"),
                    got: vec![v.len()],
                });
            }
        }
        let n_int8 = if self.ctx.fuse { ws.iter().filter(|w| self.int8_takes(x, w)).count() } else { 0 };
        let xq = if n_int8 >= 2 { self.quantize_activations(x)? } else { None };
        let mut out = Vec::with_capacity(N);
        for w in ws {
            let y = self.alloc("matmul", &[x.rows(), w.n_rows])?;
            match &xq {
                Some(q) => self.matvec_q8_into(x, Some(q), w, &y, 0, false)?,
                None => self.matmul_into(x, w, &y, Span::whole(w))?,
            }
            out.push(y);
        }
        out.try_into().map_err(|v: Vec<WgpuTensor>| OpError::ShapeMismatch {
            op: "matmul_many",
            expected: format!("{N} outputs"),
            got: vec![v.len()],
        })
    }
}
