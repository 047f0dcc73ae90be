//! Int8 activations for the decode matrix-vector product (llama.cpp's "mmvq" scheme).
//!
//! One token's activations are quantized once into blocks of 32 signed bytes with an f32 scale
//! and the block's sum ([`Q8Act`], `shaders/quantize_q8.wgsl`); the int8 kernel
//! (`shaders/matvec_q8.wgsl`) multiplies them with a weight type's integer values four at a time
//! through `dot4I8Packed` and applies the weight's scales, offsets and mins once per 32 values.
//!
//! Why: on the H200 the f32-activation kernel read Q4_0 at 26% and Q4_K at 16% of the streaming
//! bandwidth while F16 reached 93%: it converted every 4-bit value to a float (about six
//! instructions each) and an invocation's iteration moved only 4 bytes of weights. Here an
//! iteration covers 32 values in about 40 instructions.
//!
//! The result differs from the exact product by the activation rounding (relative error of a
//! dot product around 1e-2.5 for uniform activations); llama.cpp's test-backend-ops accepts
//! 5e-4 normalised MSE for its quantized-activation matrix products, and so do our tests. The
//! mode follows [`MatmulMode`]: [`WgpuBackend::with_matmul_mode`] with
//! [`MatmulMode::QuantizedActivations`] turns it on (what `diskformer run` and `bench` ask for
//! by default, like the CPU back end), [`MatmulMode::Exact`] (the default of a new back end, and
//! `eval`'s) keeps f32 activations; `DISKFORMER_GPU_F32_ACT=1` forces f32 activations whatever
//! was asked, for comparisons.

use super::layout::TypeLayout;
use super::shaders::{self, Plain, Q8Kind, Q8Shape};
use super::{expect_width, grid, lock, Cmd, Pending, PooledBuffer, Span, WgpuBackend, WgpuTensor, WgpuWeight, STORAGE};
use crate::error::OpError;
use crate::quant::MatmulMode;
use crate::spec::Glu;
use gguf::GgmlType;

/// Values per activation block (one scale and one sum each).
const BLOCK: usize = 32;

/// One or more rows of activations quantized to int8 blocks of 32 on the GPU: packed signed
/// bytes and per block (scale, scale x sum of the bytes). Made by
/// [`WgpuBackend::quantize_activations`] and read by [`WgpuBackend::matvec_q8_into`], so that
/// several products reading the same activations (q/k/v, gate/up) quantize them once.
pub struct Q8Act {
    // Visible to the other wgpu modules so that fused kernels (a norm or a GLU that quantizes its
    // output in its epilogue) can build one without a separate quantize dispatch.
    pub(super) qs: PooledBuffer,
    pub(super) ds: PooledBuffer,
    pub(super) n_tok: usize,
    pub(super) width: usize,
}

impl Q8Act {
    /// Rows (tokens).
    pub fn n_tok(&self) -> usize {
        self.n_tok
    }

    /// Values per row.
    pub fn width(&self) -> usize {
        self.width
    }
}

impl std::fmt::Debug for Q8Act {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Q8Act([{}, {}])", self.n_tok, self.width)
    }
}

/// The last activations quantized by the automatic int8 path (or by a kernel that writes the int8
/// blocks of its own output, like the GLU kernel), so that products reading the same activations
/// one after another (q, k and v; gate and up; the down projection after the GLU) quantize them
/// once even when the caller does not use [`WgpuBackend::quantize_activations`]: a dispatch saved
/// is several microseconds.
///
/// The entry is valid while the dispatch that wrote the blocks is still in the pending list at
/// `marker - 1` (binding the activations and the pair) and no command recorded after it binds the
/// activations' buffer (every write to a buffer is a recorded dispatch or copy, including the
/// upload into a buffer the pool handed out again). A submit empties the list and so invalidates
/// it. The int8 buffers are the cache's own, two pairs: a kernel that reads one activation's
/// blocks may write another's in the same dispatch (the GLU reads its input's and writes its
/// result's), and one buffer cannot be bound for reading and writing at once. Kernels that read
/// no blocks write pair 0, the others the pair they do not read, so every decode step uses the
/// same buffers in the same places (its bind groups stay cached). Rewriting a pair is safe
/// because commands run in recording order.
#[derive(Default)]
pub(super) struct Q8Cache {
    pairs: [Option<(wgpu::Buffer, wgpu::Buffer)>; 2],
    /// The pair the last `q8_target` handed out.
    last_target: usize,
    entry: Option<Q8Entry>,
}

struct Q8Entry {
    x: wgpu::Buffer,
    width: usize,
    qs: wgpu::Buffer,
    ds: wgpu::Buffer,
    marker: usize,
}

impl Q8Cache {
    /// The int8 blocks of `x` (`width` values per row) when the entry is still valid.
    fn lookup(&self, x: &wgpu::Buffer, width: usize, pending: &Pending) -> Option<(wgpu::Buffer, wgpu::Buffer)> {
        let e = self.entry.as_ref()?;
        if &e.x != x || e.width != width {
            return None;
        }
        let written_here = match pending.cmds.get(e.marker.wrapping_sub(1)) {
            Some(Cmd::Dispatch { buffers, .. }) => {
                buffers.contains(x) && buffers.contains(&e.qs) && buffers.contains(&e.ds)
            }
            _ => false,
        };
        let untouched = || {
            pending.cmds[e.marker..].iter().all(|c| match c {
                Cmd::Dispatch { buffers, .. } => !buffers.contains(x),
                Cmd::Copy { dst, .. } => dst != x,
            })
        };
        (written_here && untouched()).then(|| (e.qs.clone(), e.ds.clone()))
    }
}

/// The int8 kernels' shapes: the plain products' (`DISKFORMER_MATVEC_Q8=ROWSxWG[tTPR][uUNROLL][p][v]`,
/// see [`Q8Shape::parse`]) and the GLU kernel's (`DISKFORMER_GLU_Q8`, whose workgroups must
/// cover whole 32-row blocks to quantize their result; other shapes leave the quantization to
/// the down projection).
/// Without the variables each layout takes its own shapes ([`Q8Config::plain_for`],
/// [`Q8Config::many_for`], [`Q8Config::glu_for`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Q8Config {
    /// `DISKFORMER_MATVEC_Q8`, else 2x64 (the shape of the layouts without 16-byte loads).
    pub(super) plain: Q8Shape,
    /// `DISKFORMER_GLU_Q8`, else 1x256t8 (the shape of the layouts not measured otherwise).
    pub(super) glu: Q8Shape,
    /// The plain products of rows at least [`WIDE_K`] long (an FFN's down projection), when
    /// `DISKFORMER_MATVEC_Q8_WIDE` sets a shape of their own (for comparisons on the device).
    pub(super) wide: Option<Q8Shape>,
    /// The multi-weight products' shape (q/k/v), when `DISKFORMER_MANY_Q8` sets one (else
    /// `DISKFORMER_MATVEC_Q8`'s, else the layouts' own).
    pub(super) many: Option<Q8Shape>,
    /// Whether the device's subgroups are used (persistent shapes need them).
    pub(super) subgroups: bool,
    /// Whether `DISKFORMER_MATVEC_Q8` / `DISKFORMER_GLU_Q8` set `plain` / `glu` (then every
    /// layout takes them).
    plain_set: bool,
    glu_set: bool,
}

/// Row length from which `DISKFORMER_MATVEC_Q8_WIDE` applies (the down projection of every
/// dense model from 8B up; an 8B model's 4096-long q/k/v/o rows stay below it).
pub(super) const WIDE_K: usize = 8192;

/// The int8 kernels' default shapes per layout, from one H200 run (seventh session, the
/// `perf` test at commit ba77316, 32768 x 8192 products against a 3930 GB/s stream read, and its
/// 8B-layer groups with their quantization):
/// - plain products: 1 row per 64 invocations with 16-byte loads (`1x64v`) for the layouts that
///   have them: grouped Q4_0 2999 GB/s (76% of the stream) against 2630 for 2x64, Q4_K 2520
///   against 2192 (Q5_K, not measured, follows Q4_K). Others keep 2x64 (fourth session: Q4_0
///   2662 vs 2537 for 1x64, Q6_K 2665 vs 2534, Q8_0 3503 vs 3578);
/// - q/k/v in one dispatch (6144 x 4096): grouped Q4_0 `2x64u2v` 20.3 us against 23.3 for 2x64,
///   Q4_K `1x64` 22.5 against 29.5; others (and mixed types) 2x64;
/// - gate/up with the GLU (2 x 14336 x 4096): grouped Q4_0 `1x256t8u2` 41.2 us against 44.4 for
///   1x256t8, Q4_K `1x256t8v` 47.2 against 60.2; others 1x256t8.
///
/// Thirteenth session (H200, /work/results/s13): grouped Q4_0's q/k/v take the persistent
/// `1x256sv` where the device has subgroups (13.7 against 14.4 us per 8B layer, profiled; the 8B
/// Q4_0 decode ahead of the old defaults in all six pairs of two calls, with it for q/k/v or for
/// every product, each pair's default run first). Q4_K's plain products stay `1x64v`: `2x64v`
/// read 3% more in two calls and 6% less in a third.
mod default_shape {
    use super::Q8Shape;

    const fn shape(rows: u32, wg: u32, tpr: u32, unroll: u32, vec4: bool) -> Q8Shape {
        Q8Shape::classic(rows, wg, tpr, unroll, false, vec4)
    }
    pub(super) const PLAIN: Q8Shape = shape(2, 64, 64, 1, false);
    pub(super) const PLAIN_V4: Q8Shape = shape(1, 64, 64, 1, true);
    pub(super) const MANY_Q4_0G: Q8Shape = shape(2, 64, 64, 2, true);
    pub(super) const MANY_Q4_0G_PERSISTENT: Q8Shape = Q8Shape { persistent: true, ..shape(1, 256, 256, 1, true) };
    pub(super) const MANY_Q4_K: Q8Shape = shape(1, 64, 64, 1, false);
    pub(super) const GLU: Q8Shape = shape(1, 256, 8, 1, false);
    pub(super) const GLU_Q4_0G: Q8Shape = shape(1, 256, 8, 2, false);
    pub(super) const GLU_Q4_K: Q8Shape = shape(1, 256, 8, 1, true);
}

impl Q8Config {
    /// The plain products' shape for weights of layout `l` with rows of `k` values.
    pub(super) fn plain_for(&self, l: &TypeLayout, k: usize) -> Q8Shape {
        match self.wide {
            Some(wide) if k >= WIDE_K => wide,
            _ if self.plain_set => self.plain,
            _ if shaders::dot32_v4_source(l).is_some() => default_shape::PLAIN_V4,
            _ => default_shape::PLAIN,
        }
    }

    /// The multi-weight kernel's shape for weights of layouts `ls` (q/k/v).
    pub(super) fn many_for(&self, ls: &[TypeLayout]) -> Q8Shape {
        if let Some(many) = self.many {
            return many;
        }
        if self.plain_set {
            return self.plain;
        }
        match ls.first() {
            Some(l) if ls.iter().any(|m| m != l) => default_shape::PLAIN,
            Some(l) if l.group > 1 && self.subgroups => default_shape::MANY_Q4_0G_PERSISTENT,
            Some(l) if l.group > 1 => default_shape::MANY_Q4_0G,
            Some(l) if l.dtype == GgmlType::Q4_K => default_shape::MANY_Q4_K,
            _ => default_shape::PLAIN,
        }
    }

    /// The GLU kernel's shape for gate and up of layout `l`.
    pub(super) fn glu_for(&self, l: &TypeLayout) -> Q8Shape {
        if self.glu_set {
            return self.glu;
        }
        if l.group > 1 {
            default_shape::GLU_Q4_0G
        } else if l.dtype == GgmlType::Q4_K {
            default_shape::GLU_Q4_K
        } else {
            default_shape::GLU
        }
    }
}

/// [`Q8Config`] from the environment; layouts take their own shapes where it sets none.
/// A persistent shape is taken only with `subgroups`, and never for the GLU kernel.
pub(super) fn default_q8_config(subgroups: bool) -> Q8Config {
    let env =
        |name: &str| std::env::var(name).ok().and_then(|v| Q8Shape::parse(&v)).filter(|s| !s.persistent || subgroups);
    let (plain, glu) = (env("DISKFORMER_MATVEC_Q8"), env("DISKFORMER_GLU_Q8").filter(|s| !s.persistent));
    let many = env("DISKFORMER_MANY_Q8");
    Q8Config {
        plain: plain.unwrap_or(default_shape::PLAIN),
        glu: glu.unwrap_or(default_shape::GLU),
        wide: env("DISKFORMER_MATVEC_Q8_WIDE"),
        many,
        subgroups,
        plain_set: plain.is_some(),
        glu_set: glu.is_some(),
    }
}

/// Whether prefill products may take the int8 tiled kernel (`DISKFORMER_NO_INT8_PREFILL=1` keeps
/// the f32 one, for comparisons).
fn int8_prefill_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("DISKFORMER_NO_INT8_PREFILL").map_or(true, |v| v.is_empty() || v == "0"))
}

/// Words of the int8 kernels' parameters (matvec_q8.wgsl's `Params`).
#[derive(Default)]
struct Q8Params {
    k: u32,
    xb0: u32,
    accumulate: u32,
    n_rows: [u32; 3],
    groups: [u32; 3],
    w_row0: u32,
    out_col0: u32,
    glu: (u32, f32, f32),
    quantize: bool,
}

impl Q8Params {
    fn words(&self) -> [u32; 16] {
        [
            self.k,
            self.xb0,
            self.accumulate,
            self.n_rows[0],
            self.n_rows[1],
            self.n_rows[2],
            self.groups[0],
            self.groups[1],
            self.groups[2],
            self.w_row0,
            self.out_col0,
            self.glu.0,
            self.glu.1.to_bits(),
            self.glu.2.to_bits(),
            self.quantize as u32,
            0,
        ]
    }
}

impl WgpuBackend {
    /// This back end with the activation precision of `mode` for one-token products:
    /// [`MatmulMode::QuantizedActivations`] uses the int8 kernel for the types it covers (Q4_0,
    /// Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), [`MatmulMode::Exact`]
    /// the f32 kernel.
    /// `DISKFORMER_GPU_F32_ACT=1` keeps f32 whatever `mode` says.
    pub fn with_matmul_mode(mut self, mode: MatmulMode) -> WgpuBackend {
        self.int8_act = mode == MatmulMode::QuantizedActivations && !self.ctx.force_f32_act;
        self
    }

    /// Whether one-token products of the covered types use int8 activations.
    pub fn uses_int8_activations(&self) -> bool {
        self.int8_act
    }

    /// Whether the int8 kernel computes `x[:, x_col0..x_col0 + w.k] · Wᵀ` for one token of `x`.
    fn int8_applies(&self, x: &WgpuTensor, w: &WgpuWeight, x_col0: usize) -> bool {
        self.int8_act
            && self.ctx.matvec.is_some()
            && x.rows() == 1
            && x.width().is_multiple_of(BLOCK)
            && x_col0.is_multiple_of(BLOCK)
            && w.k.is_multiple_of(BLOCK)
            && shaders::dot32_source(w.layout.dtype).is_some()
    }

    /// Quantizes `x` (rows of a multiple of 32 values) to int8 blocks for
    /// [`matvec_q8_into`](Self::matvec_q8_into); `None` when int8 activations are off or `x` does
    /// not qualify (more than one token, or a width that is not whole blocks), in which case the
    /// products take `x` itself.
    ///
    /// # Errors
    /// [`OpError::Unsupported`] when the buffers exceed the binding limit.
    pub fn quantize_activations(&self, x: &WgpuTensor) -> Result<Option<Q8Act>, OpError> {
        if !self.int8_act || self.ctx.matvec.is_none() || x.rows() != 1 || !x.width().is_multiple_of(BLOCK) {
            return Ok(None);
        }
        self.quantize_q8(x).map(Some)
    }

    /// Quantizes every row of `x` (width a multiple of 32).
    fn quantize_q8(&self, x: &WgpuTensor) -> Result<Q8Act, OpError> {
        let n_blocks = x.len() / BLOCK;
        let qs = self.alloc_bytes("quantize_q8 qs", x.len() as u64)?;
        let ds = self.alloc_bytes("quantize_q8 ds", 8 * n_blocks as u64)?;
        self.dispatch(
            self.plain(Plain::QuantizeQ8),
            &[&x.buf.buffer, &qs.buffer, &ds.buffer],
            &[n_blocks as u32, 0, 0, 0],
            grid(n_blocks.div_ceil(64)),
        );
        Ok(Q8Act { qs, ds, n_tok: x.rows(), width: x.width() })
    }

    /// `y[:, y_col0..y_col0 + n_rows] (+)= x · Wᵀ` for one weight of a group that reads the same
    /// activations: through the int8 kernel from `xq` when it applies to `w` (see
    /// [`quantize_activations`](Self::quantize_activations)), else through the f32 kernels from
    /// `x`. `accumulate` adds to `y` instead of replacing it.
    ///
    /// # Errors
    /// [`OpError::ShapeMismatch`] when `x` (and `xq`) are not `w.k` wide or `y` has too few
    /// columns.
    pub fn matvec_q8_into(
        &self,
        x: &WgpuTensor,
        xq: Option<&Q8Act>,
        w: &WgpuWeight,
        y: &WgpuTensor,
        y_col0: usize,
        accumulate: bool,
    ) -> Result<(), OpError> {
        expect_width("matvec_q8_into x", x, w.k)?;
        if y.rows() != x.rows() || y.width() < y_col0 + w.n_rows {
            return Err(OpError::ShapeMismatch {
                op: "matvec_q8_into y",
                expected: format!("[{}, at least {}]", x.rows(), y_col0 + w.n_rows),
                got: y.shape.clone(),
            });
        }
        let r = Span { x_col0: 0, w_row0: 0, n_rows: w.n_rows, y_col0 };
        match xq {
            Some(q) if self.int8_applies(x, w, 0) => {
                if q.width != x.width() || q.n_tok != x.rows() {
                    return Err(OpError::ShapeMismatch {
                        op: "matvec_q8_into xq",
                        expected: format!("[{}, {}] (x quantized)", x.rows(), x.width()),
                        got: vec![q.n_tok, q.width],
                    });
                }
                self.matvec_q8_span(
                    &q.qs.buffer,
                    &q.ds.buffer,
                    q.width,
                    w,
                    y,
                    r,
                    self.ctx.matvec_q8.plain_for(&w.layout, w.k),
                    accumulate,
                );
                Ok(())
            }
            _ => self.product_f32(x, w, y, r, accumulate),
        }
    }

    /// The int8 path of `product_into` when it applies (quantizing `x`, or reusing its last
    /// quantization, see [`Q8Cache`]); `false` when the caller must take the f32 kernels.
    pub(super) fn try_int8_product(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        y: &WgpuTensor,
        r: Span,
        accumulate: bool,
    ) -> Result<bool, OpError> {
        if !self.int8_applies(x, w, r.x_col0) {
            return Ok(false);
        }
        let (qs, ds) = self.q8_blocks(x);
        let shape = self.ctx.matvec_q8.plain_for(&w.layout, w.k);
        self.matvec_q8_span(&qs, &ds, x.width(), w, y, r, shape, accumulate);
        Ok(true)
    }

    /// Whether prefill products of `w` take the int8 tiled kernel (int8 activations and the tiled
    /// kernel on, a layout with a `sub_block`, whole 32-value blocks); tests choose their
    /// reference by it (the layout depends on `DISKFORMER_Q4_0_LAYOUT` / `DISKFORMER_Q4_K_LAYOUT`).
    #[doc(hidden)]
    pub fn takes_int8_prefill(&self, w: &WgpuWeight) -> bool {
        self.int8_act
            && self.ctx.tiled
            && int8_prefill_allowed()
            && w.k.is_multiple_of(BLOCK)
            && shaders::sub_block_source(&w.layout).is_some()
    }

    /// `y[:, cols] (+)= x · Wᵀ` for a prefill batch (from `shaders::TILED_MIN_TOKENS` tokens)
    /// through the int8 tiled kernel (`matmul_tiled_q8.wgsl`), `x` quantized to int8 blocks in
    /// pool buffers (not the decode's cache, whose buffers would keep a long prompt's size);
    /// `false` when it does not apply ([`takes_int8_prefill`](Self::takes_int8_prefill) says no,
    /// fewer tokens, or a width or column window that is not whole blocks): the f32 tiled kernel.
    pub(super) fn try_int8_prefill(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        y: &WgpuTensor,
        r: Span,
        accumulate: bool,
    ) -> Result<bool, OpError> {
        let applies = self.takes_int8_prefill(w)
            && x.rows() >= shaders::TILED_MIN_TOKENS
            && x.width().is_multiple_of(BLOCK)
            && r.x_col0.is_multiple_of(BLOCK);
        if !applies {
            return Ok(false);
        }
        let q = self.quantize_q8(x)?;
        let l = w.layout;
        let key = format!("matmul_tiled_q8 {}", l.name);
        // Every tile element is written before the barrier after which it is read
        // (matmul_tiled_q8.wgsl): no zeroing.
        let pipe =
            self.ctx.pipeline_with(&key, || shaders::matmul_tiled_q8(&l).expect("the layout has a sub_block"), true);
        let tile = (shaders::TILE_ROWS, shaders::TILE_TOKENS);
        self.dispatch_per_chunk(pipe, w, r, tile, &[&q.qs.buffer, &q.ds.buffer], x.rows(), x.width(), y, accumulate);
        Ok(true)
    }

    /// The int8 blocks of `x` (one token, whole blocks): the cached ones while still valid, else
    /// a quantization recorded now into the cache's next pair and cached.
    pub(super) fn q8_blocks(&self, x: &WgpuTensor) -> (wgpu::Buffer, wgpu::Buffer) {
        let xb = &x.buf.buffer;
        let cached = {
            let cache = lock(&self.ctx.q8_cache);
            let pending = lock(&self.ctx.pending);
            cache.lookup(xb, x.width(), &pending)
        };
        if let Some(pair) = cached {
            return pair;
        }
        let (qs, ds) = self.q8_target(x.len());
        let n_blocks = x.len() / BLOCK;
        self.dispatch(
            self.plain(Plain::QuantizeQ8),
            &[xb, &qs, &ds],
            &[n_blocks as u32, 0, 0, 0],
            grid(n_blocks.div_ceil(64)),
        );
        self.q8_register(xb, x.width());
        (qs, ds)
    }

    /// The pair of buffers (packed bytes, per-block (d, d * sum)) into which the next dispatch
    /// that quantizes `n_values` activations should write, for a kernel that reads no int8
    /// blocks (a quantization, a norm's epilogue). Call [`q8_register`](Self::q8_register) right
    /// after recording that dispatch.
    pub(super) fn q8_target(&self, n_values: usize) -> (wgpu::Buffer, wgpu::Buffer) {
        self.q8_target_pair(n_values, 0)
    }

    /// [`q8_target`](Self::q8_target) for a kernel that reads the int8 blocks in `reading_qs`:
    /// the other pair.
    pub(super) fn q8_target_avoiding(
        &self,
        n_values: usize,
        reading_qs: &wgpu::Buffer,
    ) -> (wgpu::Buffer, wgpu::Buffer) {
        let first_read = lock(&self.ctx.q8_cache).pairs[0].as_ref().is_some_and(|(q, _)| q == reading_qs);
        self.q8_target_pair(n_values, first_read as usize)
    }

    fn q8_target_pair(&self, n_values: usize, next: usize) -> (wgpu::Buffer, wgpu::Buffer) {
        let mut cache = lock(&self.ctx.q8_cache);
        cache.last_target = next;
        let (qs_bytes, ds_bytes) = ((n_values as u64).max(16), (8 * (n_values / BLOCK) as u64).max(16));
        let fits = cache.pairs[next].as_ref().is_some_and(|(q, d)| q.size() >= qs_bytes && d.size() >= ds_bytes);
        if !fits {
            let make = |bytes: u64, label: &str| {
                self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: bytes.next_power_of_two(),
                    usage: STORAGE,
                    mapped_at_creation: false,
                })
            };
            cache.pairs[next] = Some((make(qs_bytes, "q8 cache qs"), make(ds_bytes, "q8 cache ds")));
        }
        cache.pairs[next].clone().expect("made above")
    }

    /// Records that the dispatch recorded last wrote the int8 blocks of `x` (`width` values per
    /// row) into the pair [`q8_target`](Self::q8_target) gave, so that the next products of `x`
    /// read them instead of quantizing again.
    pub(super) fn q8_register(&self, x: &wgpu::Buffer, width: usize) {
        let mut cache = lock(&self.ctx.q8_cache);
        let Some((qs, ds)) = cache.pairs[cache.last_target].clone() else { return };
        // An early submit inside `dispatch` empties the list: the marker then points past its
        // end and the entry is never found valid.
        let marker = lock(&self.ctx.pending).cmds.len();
        cache.entry = Some(Q8Entry { x: x.clone(), width, qs, ds, marker });
    }

    /// The dispatch that wrote the cached int8 blocks moved in the pending list, from just
    /// before `from` to just before `to` (a norm put after the routing kernel that took its
    /// input): the entry follows it.
    pub(super) fn q8_marker_moved(&self, from: usize, to: usize) {
        let mut cache = lock(&self.ctx.q8_cache);
        if let Some(e) = cache.entry.as_mut().filter(|e| e.marker == from) {
            e.marker = to;
        }
    }

    /// The pipeline of an int8 kernel for `w`'s type.
    fn q8_pipeline(&self, w: &WgpuWeight, shape: Q8Shape, kind: Q8Kind) -> std::sync::Arc<wgpu::ComputePipeline> {
        self.q8_pipeline_types(&[w], shape, kind)
    }

    /// The pipeline of an int8 kernel for the types of `ws` (weight i's type at index i).
    fn q8_pipeline_types(
        &self,
        ws: &[&WgpuWeight],
        shape: Q8Shape,
        kind: Q8Kind,
    ) -> std::sync::Arc<wgpu::ComputePipeline> {
        let n = match kind {
            Q8Kind::Weights(n) => n as usize,
            Q8Kind::Glu => 2,
        };
        let layouts: Vec<_> = (0..n).map(|i| ws.get(i).unwrap_or(&ws[0]).layout).collect();
        let names: Vec<_> = layouts.iter().map(|l| l.name).collect();
        let sg = self.ctx.subgroups;
        let key = format!("matvec_q8 {} {shape} {kind:?} sg{sg}", names.join("+"));
        // Workgroup memory is written before it is read (argued in matvec_q8.wgsl): no zeroing.
        self.ctx.pipeline_with(
            &key,
            || {
                shaders::matvec_q8_types(&layouts, shape, kind, sg)
                    .expect("callers check that every type has an int8 kernel")
            },
            true,
        )
    }

    /// One token's product through `matvec_q8.wgsl` (the weight type must have a `dot32`).
    #[allow(clippy::too_many_arguments)]
    fn matvec_q8_span(
        &self,
        qs: &wgpu::Buffer,
        ds: &wgpu::Buffer,
        width: usize,
        w: &WgpuWeight,
        y: &WgpuTensor,
        r: Span,
        shape: Q8Shape,
        acc: bool,
    ) {
        let Span { x_col0, w_row0, n_rows, y_col0 } = r;
        let pipe = self.q8_pipeline(w, shape, Q8Kind::Weights(1));
        let rpw = shape.rows_per_group() as usize;
        debug_assert!(x_col0 + w.k <= width);
        for c in &w.chunks {
            let lo = w_row0.max(c.row0);
            let hi = (w_row0 + n_rows).min(c.row0 + c.n_rows);
            if lo >= hi {
                continue;
            }
            let n_groups = (hi - lo).div_ceil(rpw);
            let p = Q8Params {
                k: w.k as u32,
                xb0: (x_col0 / BLOCK) as u32,
                accumulate: acc as u32,
                n_rows: [(hi - lo) as u32, 0, 0],
                groups: [0, 0, n_groups as u32],
                w_row0: (lo - c.row0) as u32,
                out_col0: (y_col0 + lo - w_row0) as u32,
                ..Q8Params::default()
            };
            let n_dispatch = shape.dispatch_groups(n_groups);
            self.dispatch(pipe.clone(), &[qs, ds, &c.buffer, &y.buf.buffer], &p.words(), grid(n_dispatch));
        }
    }

    /// Whether one int8 kernel can serve all of `ws` against `x`: int8 activations apply to each
    /// (so each type has an int8 dot product), they share the width, and each fits one binding.
    fn int8_group_applies(&self, x: &WgpuTensor, ws: &[&WgpuWeight]) -> bool {
        let Some(first) = ws.first() else { return false };
        self.ctx.fuse
            && ws.iter().all(|w| {
                self.int8_applies(x, w, 0) && w.k == first.k && w.k == x.width() && w.chunks.len() == 1 && w.n_rows > 0
            })
    }

    /// `[x · W0ᵀ, x · W1ᵀ, ...]` for up to three weights of one width, of any types with an int8
    /// dot product, in ONE dispatch of the int8 kernel (q/k/v: one dispatch instead of three);
    /// `None` when it does not apply (more than one token, int8 activations off, a type without
    /// an int8 kernel, different widths, a weight split over several bindings), and the caller
    /// takes the products one by one. The shape is [`Q8Config::many_for`] the weights' layouts.
    pub(super) fn matmul_many_q8(
        &self,
        x: &WgpuTensor,
        ws: &[&WgpuWeight],
    ) -> Result<Option<Vec<WgpuTensor>>, OpError> {
        let layouts: Vec<TypeLayout> = ws.iter().map(|w| w.layout).collect();
        self.matmul_many_q8_shape(x, ws, self.ctx.matvec_q8.many_for(&layouts))
    }

    /// [`matmul_many_q8`](Self::matmul_many_q8) in `shape`.
    fn matmul_many_q8_shape(
        &self,
        x: &WgpuTensor,
        ws: &[&WgpuWeight],
        shape: Q8Shape,
    ) -> Result<Option<Vec<WgpuTensor>>, OpError> {
        if !(1..=3).contains(&ws.len()) || !self.int8_group_applies(x, ws) {
            return Ok(None);
        }
        let mut ys = Vec::with_capacity(ws.len());
        for w in ws {
            ys.push(self.alloc("matmul", &[1, w.n_rows])?);
        }
        let (qs, ds) = self.q8_blocks(x);
        let rpw = shape.rows_per_group() as usize;
        // groups[0], groups[1]: first workgroups of weights 1 and 2; groups[2]: the grid's end.
        let mut n_rows = [0u32; 3];
        let mut groups = [0u32; 3];
        let mut end = 0usize;
        for (i, w) in ws.iter().enumerate() {
            n_rows[i] = w.n_rows as u32;
            if i > 0 {
                groups[i - 1] = end as u32;
            }
            end += w.n_rows.div_ceil(rpw);
        }
        groups[2] = end as u32;
        let p = Q8Params { k: x.width() as u32, n_rows, groups, ..Q8Params::default() };
        let mut buffers: Vec<&wgpu::Buffer> = vec![&qs, &ds];
        for (w, y) in ws.iter().zip(&ys) {
            buffers.push(&w.chunks[0].buffer);
            buffers.push(&y.buf.buffer);
        }
        let pipe = self.q8_pipeline_types(ws, shape, Q8Kind::Weights(ws.len() as u32));
        self.dispatch(pipe, &buffers, &p.words(), grid(shape.dispatch_groups(end)));
        Ok(Some(ys))
    }

    /// `glu(x · Gᵀ, x · Uᵀ)` in ONE dispatch of the int8 GLU kernel, which also writes the
    /// result's int8 blocks into the cache (when `shape` covers whole 32-row blocks and the width
    /// is whole blocks), so the down projection that reads it quantizes nothing; `None` when it
    /// does not apply (as [`matmul_many_q8`](Self::matmul_many_q8), plus gate and up of one
    /// shape).
    pub(super) fn matmul_glu_q8(
        &self,
        x: &WgpuTensor,
        gate: &WgpuWeight,
        up: &WgpuWeight,
        glu: Glu,
        shape: Q8Shape,
    ) -> Result<Option<WgpuTensor>, OpError> {
        if gate.n_rows != up.n_rows || shape.persistent || !self.int8_group_applies(x, &[gate, up]) {
            return Ok(None);
        }
        // One type for both (the kernel pairs each gate row with the up row of the same index).
        if gate.layout != up.layout {
            return Ok(None);
        }
        let n = gate.n_rows;
        let h = self.alloc("matmul_glu", &[1, n])?;
        let (qs, ds) = self.q8_blocks(x);
        let rpw = shape.rows_per_group() as usize;
        let quantize = rpw.is_multiple_of(BLOCK) && n.is_multiple_of(BLOCK);
        let (hq, hd) = self.q8_target_avoiding(n, &qs);
        let n_groups = n.div_ceil(rpw);
        let p = Q8Params {
            k: x.width() as u32,
            n_rows: [n as u32, 0, 0],
            groups: [0, 0, n_groups as u32],
            glu: Self::glu_code(glu),
            quantize,
            ..Q8Params::default()
        };
        let pipe = self.q8_pipeline(gate, shape, Q8Kind::Glu);
        self.dispatch(
            pipe,
            &[&qs, &ds, &gate.chunks[0].buffer, &up.chunks[0].buffer, &h.buf.buffer, &hq, &hd],
            &p.words(),
            grid(n_groups),
        );
        if quantize {
            self.q8_register(&h.buf.buffer, n);
        }
        Ok(Some(h))
    }

    /// `Backend::matmul_glu` on the GPU: one int8 dispatch when it applies, else the products
    /// (with one shared quantization) and the `glu` kernel.
    pub(super) fn matmul_glu_fused(
        &self,
        x: &WgpuTensor,
        gate: &WgpuWeight,
        up: &WgpuWeight,
        glu: Glu,
    ) -> Result<WgpuTensor, OpError> {
        expect_width("matmul_glu gate", x, gate.k)?;
        expect_width("matmul_glu up", x, up.k)?;
        if let Some(h) = self.matmul_glu_q8(x, gate, up, glu, self.ctx.matvec_q8.glu_for(&gate.layout))? {
            return Ok(h);
        }
        let [g, u] = self.matmul_many_fused(x, [gate, up])?;
        crate::Backend::glu(self, &g, &u, glu)
    }

    fn check_q8_shape(&self, shape: Q8Shape) -> Result<(), OpError> {
        let why = if !shape.is_valid() {
            format!(
                "workgroup shape {shape:?}: rows 1..=8, wg a power of two in 32..=256, tpr a power of two up to wg, unroll 1, 2 or 4, not persistent with pairs"
            )
        } else if shape.persistent && !self.ctx.subgroups {
            format!("workgroup shape {shape}: a persistent shape needs subgroups, which this device does not offer")
        } else {
            return Ok(());
        };
        Err(OpError::Unsupported { op: "matvec_q8", backend: "wgpu", why })
    }

    /// One token's `x · Wᵀ` through the int8 kernel with `shape` (tests compare every shape with
    /// the CPU); an error when the type or the width has no int8 path.
    #[doc(hidden)]
    pub fn matvec_q8_with_shape(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        shape: impl Into<Q8Shape>,
    ) -> Result<WgpuTensor, OpError> {
        let shape = shape.into();
        expect_width("matvec_q8", x, w.k)?;
        self.check_q8_shape(shape)?;
        if x.rows() != 1 || !w.k.is_multiple_of(BLOCK) || shaders::dot32_source(w.layout.dtype).is_none() {
            return Err(OpError::ShapeMismatch {
                op: "matvec_q8",
                expected: format!("one token of whole 32-value blocks of a type with an int8 kernel (k = {})", w.k),
                got: x.shape.clone(),
            });
        }
        let q = self.quantize_q8(x)?;
        let y = self.alloc("matvec_q8", &[1, w.n_rows])?;
        self.matvec_q8_span(&q.qs.buffer, &q.ds.buffer, q.width, w, &y, Span::whole(w), shape, false);
        Ok(y)
    }

    /// The multi-weight int8 kernel with `shape` (tests compare it with the CPU); an error when it
    /// does not apply (this entry does not fall back, so a test knows which kernel ran).
    #[doc(hidden)]
    pub fn matmul_many_q8_with_shape(
        &self,
        x: &WgpuTensor,
        ws: &[&WgpuWeight],
        shape: Q8Shape,
    ) -> Result<Vec<WgpuTensor>, OpError> {
        self.check_q8_shape(shape)?;
        self.matmul_many_q8_shape(x, ws, shape)?.ok_or_else(|| OpError::Unsupported {
            op: "matmul_many_q8",
            backend: "wgpu",
            why: format!("{} weights: the multi-weight int8 kernel does not apply", ws.len()),
        })
    }

    /// The int8 GLU kernel with `shape` (tests compare it with the CPU); an error when it does not
    /// apply.
    #[doc(hidden)]
    pub fn matmul_glu_q8_with_shape(
        &self,
        x: &WgpuTensor,
        gate: &WgpuWeight,
        up: &WgpuWeight,
        glu: Glu,
        shape: Q8Shape,
    ) -> Result<WgpuTensor, OpError> {
        self.check_q8_shape(shape)?;
        self.matmul_glu_q8(x, gate, up, glu, shape)?.ok_or(OpError::Unsupported {
            op: "matmul_glu_q8",
            backend: "wgpu",
            why: "the int8 GLU kernel does not apply".into(),
        })
    }

    /// Seconds per int8 product `x · Wᵀ` with `shape`, the quantization of `x` done once outside
    /// the timing (for `--perf`); `None` when the type has no int8 kernel.
    #[doc(hidden)]
    pub fn perf_matvec_q8(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        shape: Q8Shape,
        reps: usize,
    ) -> Result<Option<f64>, OpError> {
        if shaders::dot32_source(w.layout.dtype).is_none() || !w.k.is_multiple_of(BLOCK) {
            return Ok(None);
        }
        self.check_q8_shape(shape)?;
        let q = self.quantize_q8(x)?;
        let y = self.alloc("perf", &[x.rows(), w.n_rows])?;
        self.time_reps(reps, || {
            self.matvec_q8_span(&q.qs.buffer, &q.ds.buffer, q.width, w, &y, Span::whole(w), shape, false);
            Ok(())
        })
        .map(Some)
    }

    /// Seconds per group of int8 products of one token `x` (for `--perf`), each repetition with
    /// its own quantization: with `fused = Some(shape)`, one multi-weight dispatch (or, when `glu`
    /// is given, the GLU kernel over `ws[0]` gate and `ws[1]` up) of that shape; with `None`,
    /// what the op-by-op graph records (each product, then the `glu` kernel and the quantization
    /// the down projection needs).
    #[doc(hidden)]
    pub fn perf_group_q8(
        &self,
        x: &WgpuTensor,
        ws: &[&WgpuWeight],
        glu: Option<Glu>,
        fused: Option<Q8Shape>,
        reps: usize,
    ) -> Result<f64, OpError> {
        self.time_reps(reps, || {
            // Every repetition quantizes x, as every decode step does.
            lock(&self.ctx.q8_cache).entry = None;
            match (fused, glu) {
                (Some(shape), Some(glu)) => drop(self.matmul_glu_q8_with_shape(x, ws[0], ws[1], glu, shape)?),
                (Some(shape), None) => drop(self.matmul_many_q8_with_shape(x, ws, shape)?),
                (None, _) => {
                    let (qs, ds) = self.q8_blocks(x);
                    let mut ys = Vec::new();
                    for w in ws {
                        let y = self.alloc("perf", &[1, w.n_rows])?;
                        let plain = self.ctx.matvec_q8.plain_for(&w.layout, w.k);
                        self.matvec_q8_span(&qs, &ds, x.width(), w, &y, Span::whole(w), plain, false);
                        ys.push(y);
                    }
                    if let Some(glu) = glu {
                        let h = crate::Backend::glu(self, &ys[0], &ys[1], glu)?;
                        self.q8_blocks(&h);
                    }
                }
            }
            Ok(())
        })
    }

    /// Seconds per quantization of `x` to int8 blocks (for `--perf`).
    #[doc(hidden)]
    pub fn perf_quantize_q8(&self, x: &WgpuTensor, reps: usize) -> Result<f64, OpError> {
        self.time_reps(reps, || self.quantize_q8(x).map(drop))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shapes the layouts take without the variables are the ones `default_shape`'s doc
    /// names from the H200 run.
    #[test]
    fn layouts_take_their_measured_shapes() {
        let cfg = Q8Config {
            plain: default_shape::PLAIN,
            glu: default_shape::GLU,
            wide: None,
            many: None,
            subgroups: true,
            plain_set: false,
            glu_set: false,
        };
        let of = |t| TypeLayout::of(t).unwrap();
        let (q4_0g, q4_0, q4_k, q6_k) =
            (TypeLayout::q4_0_grouped(), of(GgmlType::Q4_0), of(GgmlType::Q4_K), of(GgmlType::Q6_K));
        let named = |s: Q8Shape| s.to_string();
        assert_eq!(named(cfg.plain_for(&q4_0g, 4096)), "1x64v");
        assert_eq!(named(cfg.plain_for(&q4_k, 14336)), "1x64v");
        assert_eq!(named(cfg.plain_for(&of(GgmlType::Q5_K), 4096)), "1x64v");
        assert_eq!(named(cfg.plain_for(&q4_0, 4096 + 32)), "2x64");
        assert_eq!(named(cfg.plain_for(&q6_k, 4096)), "2x64");
        assert_eq!(named(cfg.many_for(&[q4_0g; 3])), "1x256sv");
        assert_eq!(named(Q8Config { subgroups: false, ..cfg }.many_for(&[q4_0g; 3])), "2x64u2v");
        assert_eq!(named(cfg.many_for(&[q4_k; 3])), "1x64");
        assert_eq!(named(cfg.many_for(&[q4_k, q4_k, q6_k])), "2x64");
        assert_eq!(named(cfg.many_for(&[q6_k; 3])), "2x64");
        assert_eq!(named(cfg.glu_for(&q4_0g)), "1x256t8u2");
        assert_eq!(named(cfg.glu_for(&q4_k)), "1x256t8v");
        assert_eq!(named(cfg.glu_for(&q6_k)), "1x256t8");
        // The GLU defaults cover whole 32-row blocks, so the kernel quantizes its result.
        for l in [q4_0g, q4_0, q4_k, q6_k] {
            assert_eq!(cfg.glu_for(&l).rows_per_group() % 32, 0, "{}", l.name);
        }
        // Set by the environment: every layout takes it.
        let set = Q8Config { plain_set: true, glu_set: true, ..cfg };
        assert_eq!(named(set.plain_for(&q4_0g, 4096)), "2x64");
        assert_eq!(named(set.many_for(&[q4_k; 3])), "2x64");
        assert_eq!(named(set.glu_for(&q4_k)), "1x256t8");
        let wide = Q8Config { wide: Q8Shape::parse("4x64"), ..cfg };
        assert_eq!(named(wide.plain_for(&q4_0g, WIDE_K)), "4x64");
        assert_eq!(named(wide.plain_for(&q4_0g, WIDE_K - 32)), "1x64v");
    }
}
