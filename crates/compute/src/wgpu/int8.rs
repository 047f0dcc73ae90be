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

use super::shaders::{self, Plain};
use super::{
    expect_width, grid, lock, Cmd, MatvecShape, PooledBuffer, Span, WgpuBackend, WgpuTensor, WgpuWeight, STORAGE,
};
use crate::error::OpError;
use crate::quant::MatmulMode;

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

/// The last activations quantized by the automatic int8 path, so that products reading the same
/// activations one after another (q, k and v; gate and up) quantize them once even when the
/// caller does not use [`WgpuBackend::quantize_activations`]: a dispatch saved is several
/// microseconds of host time.
///
/// The entry is valid while the quantizing dispatch is still in the pending list at `marker - 1`
/// and no command recorded after it binds the activations' buffer (every write to a buffer is a
/// recorded dispatch or copy, including the upload into a buffer the pool handed out again). A
/// submit empties the list and so invalidates it. The int8 buffers are the cache's own and are
/// rewritten by the next quantization, which is safe because commands run in recording order.
#[derive(Default)]
pub(super) struct Q8Cache {
    qs: Option<wgpu::Buffer>,
    ds: Option<wgpu::Buffer>,
    x: Option<wgpu::Buffer>,
    width: usize,
    marker: usize,
}

/// The int8 kernel's shape: `DISKFORMER_MATVEC_Q8=ROWSxWG` for experiments, else 1 row per
/// 64-invocation workgroup (the f32 kernel's measured best; the perf test sweeps both).
pub(super) fn default_q8_shape() -> MatvecShape {
    std::env::var("DISKFORMER_MATVEC_Q8")
        .ok()
        .and_then(|v| {
            let (rows, wg) = v.split_once('x')?;
            let shape = MatvecShape { rows: rows.parse().ok()?, wg: wg.parse().ok()? };
            (shape.rows >= 1 && shape.rows <= 16 && shape.wg.is_power_of_two() && (32..=256).contains(&shape.wg))
                .then_some(shape)
        })
        .unwrap_or(MatvecShape { rows: 1, wg: 64 })
}

impl WgpuBackend {
    /// This back end with the activation precision of `mode` for one-token products:
    /// [`MatmulMode::QuantizedActivations`] uses the int8 kernel for the types it covers (Q4_0,
    /// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), [`MatmulMode::Exact`] the f32 kernel.
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
                self.matvec_q8_span(&q.qs.buffer, &q.ds.buffer, q.width, w, y, r, self.ctx.matvec_q8, accumulate);
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
        let mut cache = lock(&self.ctx.q8_cache);
        let xb = &x.buf.buffer;
        let valid = cache.x.as_ref() == Some(xb) && cache.width == x.width() && {
            let pending = lock(&self.ctx.pending);
            let quantized_here = match pending.cmds.get(cache.marker.wrapping_sub(1)) {
                Some(Cmd::Dispatch { buffers, .. }) => {
                    buffers.len() == 3
                        && &buffers[0] == xb
                        && Some(&buffers[1]) == cache.qs.as_ref()
                        && Some(&buffers[2]) == cache.ds.as_ref()
                }
                _ => false,
            };
            quantized_here
                && pending.cmds[cache.marker..].iter().all(|c| match c {
                    Cmd::Dispatch { buffers, .. } => !buffers.contains(xb),
                    Cmd::Copy { dst, .. } => dst != xb,
                })
        };
        if !valid {
            let n_blocks = x.len() / BLOCK;
            let c = &mut *cache;
            let (qs_bytes, ds_bytes) = ((x.len() as u64).max(16), (8 * n_blocks as u64).max(16));
            for (buf, bytes, label) in [(&mut c.qs, qs_bytes, "q8 cache qs"), (&mut c.ds, ds_bytes, "q8 cache ds")] {
                if buf.as_ref().is_none_or(|b| b.size() < bytes) {
                    *buf = Some(self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                        label: Some(label),
                        size: bytes.next_power_of_two(),
                        usage: STORAGE,
                        mapped_at_creation: false,
                    }));
                }
            }
            let (qs, ds) = (cache.qs.clone().expect("made above"), cache.ds.clone().expect("made above"));
            self.dispatch(
                self.plain(Plain::QuantizeQ8),
                &[xb, &qs, &ds],
                &[n_blocks as u32, 0, 0, 0],
                grid(n_blocks.div_ceil(64)),
            );
            // An early submit inside `dispatch` empties the list: the marker then points past
            // its end and the entry is never found valid.
            cache.marker = lock(&self.ctx.pending).cmds.len();
            cache.x = Some(xb.clone());
            cache.width = x.width();
        }
        let (qs, ds) = (cache.qs.clone().expect("set when valid"), cache.ds.clone().expect("set when valid"));
        drop(cache);
        self.matvec_q8_span(&qs, &ds, x.width(), w, y, r, self.ctx.matvec_q8, accumulate);
        Ok(true)
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
        shape: MatvecShape,
        acc: bool,
    ) {
        let Span { x_col0, w_row0, n_rows, y_col0 } = r;
        let k = w.k;
        let l = w.layout;
        let sg = self.ctx.subgroups;
        let key = format!("matvec_q8 {} {}x{} sg{sg}", l.name, shape.rows, shape.wg);
        let pipe = self.ctx.pipeline(&key, || {
            shaders::matvec_q8(&l, shape, sg).expect("callers check that the type has an int8 kernel")
        });
        for c in &w.chunks {
            let lo = w_row0.max(c.row0);
            let hi = (w_row0 + n_rows).min(c.row0 + c.n_rows);
            if lo >= hi {
                continue;
            }
            self.dispatch(
                pipe.clone(),
                &[&c.buffer, qs, ds, &y.buf.buffer],
                &[
                    k as u32,
                    (hi - lo) as u32,
                    1,
                    l.row_words(k) as u32,
                    (lo - c.row0) as u32,
                    y.width() as u32,
                    (y_col0 + lo - w_row0) as u32,
                    (width / BLOCK) as u32,
                    x_col0 as u32,
                    acc as u32,
                    0,
                    0,
                ],
                grid((hi - lo).div_ceil(shape.rows as usize)),
            );
        }
    }

    /// One token's `x · Wᵀ` through the int8 kernel with `shape` (tests compare every shape with
    /// the CPU); an error when the type or the width has no int8 path.
    #[doc(hidden)]
    pub fn matvec_q8_with_shape(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        shape: MatvecShape,
    ) -> Result<WgpuTensor, OpError> {
        expect_width("matvec_q8", x, w.k)?;
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

    /// Seconds per int8 product `x · Wᵀ` with `shape`, the quantization of `x` done once outside
    /// the timing (for `--perf`); `None` when the type has no int8 kernel.
    #[doc(hidden)]
    pub fn perf_matvec_q8(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        shape: MatvecShape,
        reps: usize,
    ) -> Result<Option<f64>, OpError> {
        if shaders::dot32_source(w.layout.dtype).is_none() || !w.k.is_multiple_of(BLOCK) {
            return Ok(None);
        }
        let q = self.quantize_q8(x)?;
        let y = self.alloc("perf", &[x.rows(), w.n_rows])?;
        self.time_reps(reps, || {
            self.matvec_q8_span(&q.qs.buffer, &q.ds.buffer, q.width, w, &y, Span::whole(w), shape, false);
            Ok(())
        })
        .map(Some)
    }

    /// Seconds per quantization of `x` to int8 blocks (for `--perf`).
    #[doc(hidden)]
    pub fn perf_quantize_q8(&self, x: &WgpuTensor, reps: usize) -> Result<f64, OpError> {
        self.time_reps(reps, || self.quantize_q8(x).map(drop))
    }
}
