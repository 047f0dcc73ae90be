//! Fused ops of the GPU back end: work that the op-by-op graph spreads over several dispatches
//! done in one, to cut a decode step's dispatch count (each costs host time to record and encode,
//! ~8 us on the H200, and GPU time: launch, drain and barrier, docs/NOTES.md).
//!
//! - [`Backend::rope_attention`] (and `attention`): q and k rotated, k and v written to the cache
//!   and the attention computed in one dispatch (`attention.wgsl`), where the op-by-op path had
//!   two rope table uploads, two ropes, two cache copies and the attention.
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

use super::{expect_width, grid, lock, OpError, PooledBuffer, Span, WgpuBackend, WgpuCache, WgpuTensor, WgpuWeight};
use crate::backend::{AttnStep, Backend};
use crate::cpu::kernels;
use crate::spec::{AttnCall, AttnSpec, RopeSpec};
use std::sync::Arc;

/// Storage buffers `attention.wgsl` binds (q, new k and v, rope table, sinks, the two cache
/// halves, output, int8 blocks and scales): more than WebGPU's default limit of 8, within every
/// Vulkan, Metal and DX12 adapter's.
const ATTENTION_STORAGE_BUFFERS: u32 = 10;

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

    /// One attention step in one dispatch (`attention.wgsl`): q and k rotated when `rope` (the
    /// spec and the tokens' positions) is given, k and v written to cache rows `pos0..pos0 + n`,
    /// attention over rows `0..pos0 + n`, and, when the output projection will take int8
    /// activations (one token, whole 32-value blocks per head), the output's int8 blocks. The
    /// shapes are checked by the caller.
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
        self.dispatch(
            self.plain(super::Plain::Attention),
            &[
                &q.buf.buffer,
                &k.buf.buffer,
                &v.buf.buffer,
                table.as_ref().map_or(dummy, |t| &t.buffer),
                sinks.map_or(dummy, |s| &s.buf.buffer),
                &cache.k,
                &cache.v,
                &y.buf.buffer,
                qs,
                ds,
            ],
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
        if q8.is_some() {
            self.q8_register(&y.buf.buffer, y.width());
        }
        Ok(y)
    }

    /// [`Backend::rope_attention`] in one dispatch ([`attention_step`](Self::attention_step)).
    pub(super) fn rope_attention_fused(
        &self,
        step: &AttnStep<'_, WgpuBackend>,
        cache: &mut WgpuCache,
    ) -> Result<WgpuTensor, OpError> {
        let AttnStep { q, k, v, pos0, positions, rope, spec, sinks } = *step;
        // The kernel rotates a new key each time a query head reads it, which is free for the few
        // tokens of a decode step but, in a prefill, multiplies the rotation by the number of
        // query tokens that see each key (H200, 8B: prefill 1016 -> 715 tok/s with it): more
        // tokens than this rotate once, in their own dispatches, first.
        if !self.ctx.fuse || q.rows() > rope_in_attention_max_tokens() {
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
        self.attention_step(q, k, v, cache, pos0, spec, sinks, rope.map(|r| (r, positions)))
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
            if let Some(ys) = self.matmul_many_q8(x, &ws, self.ctx.matvec_q8.plain)? {
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
