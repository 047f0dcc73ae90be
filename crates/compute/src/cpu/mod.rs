//! The CPU back end: f32 activations in `Vec`s, weights used in place from the memory map.
//!
//! Each op's arithmetic lives in [`kernels`] as a plain function over slices, written to be
//! obviously correct (it is the reference every other back end is tested against); heavy ops run
//! in parallel with rayon. Matrix products go through [`crate::quant::matmul`], either exact (f32
//! math on dequantized weights: what the fixtures' `dequant_f32` references compute) or with
//! activations quantized to Q8 the way llama.cpp does ([`MatmulMode::QuantizedActivations`]).

mod attention;
pub mod cache_fill;
mod experts;
mod gelu;
pub mod kernels;
pub mod pin;
mod pool;
pub mod warm;

pub use attention::KvType;

use crate::backend::{Backend, ExpertStore, Experts, HostExpert, HostMatrix, Routing, SsmDims, SsmScan};
use crate::error::OpError;
use crate::quant::{self, MatmulMode};
use crate::spec::{Act, AttnCall, AttnSpec, Glu, MoeSpec, RopeSpec, RouteSpec};
use crate::weight::HostWeight;
use attention::{KvElem, KvRows, Rows, Simd};
pub use experts::{experts_one_token, ExpertBiases};
use rayon::prelude::*;
use std::cell::RefCell;
use std::sync::Arc;

/// An f32 tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: Vec<f32>,
}

impl Drop for CpuTensor {
    fn drop(&mut self) {
        pool::give_back(std::mem::take(&mut self.data), std::mem::take(&mut self.shape));
    }
}

impl CpuTensor {
    /// A tensor of pooled buffers (see [`pool`]): `data` must hold the product of `dims`.
    fn pooled(dims: &[usize], data: Vec<f32>) -> CpuTensor {
        debug_assert_eq!(dims.iter().product::<usize>(), data.len());
        CpuTensor { shape: pool::shape(dims), data }
    }
    fn width(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    fn rows(&self) -> usize {
        self.data.len() / self.width().max(1)
    }
}

/// One layer's KV cache: `n_ctx` rows of keys and values, in f32 or f16 ([`KvType`]).
#[derive(Clone, Debug)]
pub struct CpuCache {
    rows: KvRows,
    k_width: usize,
    v_width: usize,
    n_ctx: usize,
}

impl CpuCache {
    /// Capacity in positions.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.rows.n_values() * self.rows.kv_type().size_bytes()
    }
    /// Element type of the cached keys and values.
    pub fn kv_type(&self) -> KvType {
        self.rows.kv_type()
    }
}

/// The CPU back end.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    mode: MatmulMode,
    kv_type: KvType,
    /// Where `moe_ffn` finds expert matrices when set (a pager); else the stacked weights.
    expert_store: Option<Arc<dyn ExpertStore>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new(MatmulMode::Exact)
    }
}

impl CpuBackend {
    /// A back end computing matrix products in `mode`.
    pub fn new(mode: MatmulMode) -> CpuBackend {
        CpuBackend { mode, kv_type: KvType::default(), expert_store: None }
    }

    /// This back end with KV caches of `kv_type` (caches made afterwards by `new_cache`).
    pub fn with_kv_type(mut self, kv_type: KvType) -> CpuBackend {
        self.kv_type = kv_type;
        self
    }

    /// Element type of the KV caches this back end makes.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// This back end with its experts taken from `store` (paged from disk under a memory
    /// budget) instead of the model's stacked expert weights.
    pub fn with_expert_store(mut self, store: Arc<dyn ExpertStore>) -> CpuBackend {
        self.expert_store = Some(store);
        self
    }

    /// The expert store `moe_ffn` asks, if any.
    pub fn expert_store(&self) -> Option<&Arc<dyn ExpertStore>> {
        self.expert_store.as_ref()
    }

    /// The matrix-product mode.
    pub fn mode(&self) -> MatmulMode {
        self.mode
    }

    fn binary(
        &self,
        op: &'static str,
        a: &CpuTensor,
        b: &CpuTensor,
        f: impl Fn(f32, f32) -> f32 + Sync,
    ) -> Result<CpuTensor, OpError> {
        let w = a.width();
        let parallel = a.data.len() >= PAR_CHEAP_ELEMS;
        if b.data.len() == a.data.len() {
            Ok(CpuTensor::pooled(&a.shape, zip_map(&a.data, &b.data, parallel, f)))
        } else if b.data.len() == w {
            let data = if parallel {
                let mut data = pool::zeros(a.data.len());
                data.par_chunks_mut(w.max(1))
                    .zip(a.data.par_chunks(w.max(1)))
                    .with_min_len(PAR_CHUNK / w.max(1) + 1)
                    .for_each(|(o, row)| {
                        o.iter_mut().zip(row.iter().zip(&b.data)).for_each(|(o, (&x, &y))| *o = f(x, y))
                    });
                data
            } else {
                let mut data = pool::values(a.data.len());
                for row in a.data.chunks(w.max(1)) {
                    data.extend(row.iter().zip(&b.data).map(|(&x, &y)| f(x, y)));
                }
                data
            };
            Ok(CpuTensor::pooled(&a.shape, data))
        } else {
            Err(OpError::ShapeMismatch {
                op,
                expected: format!("b of shape {:?} or one row of {w}", a.shape),
                got: b.shape.clone(),
            })
        }
    }

    fn matmul_host(&self, x: &[f32], w: &HostMatrix<'_>, y: &mut [f32]) -> Result<(), OpError> {
        quant::matmul(w.dtype, w.bytes, w.n_out, w.k, x, y, self.mode)
            .map_err(|source| OpError::Quant { op: "matmul", source })
    }

    /// One expert's FFN over the rows `xs` (`[m, n_embd]`) of the tokens `toks` (token index,
    /// routing weight), added into `out` (`[n, n_embd]`) scaled by each token's weight.
    fn expert_ffn(
        &self,
        xs: &[f32],
        toks: &[(usize, f32)],
        ex: &HostExpert<'_>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let (m, e, ff) = (toks.len(), ex.id as usize, spec.n_ff);
        let n_embd = ex.down.n_out;
        let bias_row =
            |b: &Option<CpuTensor>, width: usize| b.as_ref().map(|b| b.data[e * width..(e + 1) * width].to_vec());
        let mut up = vec![0f32; m * ff];
        self.matmul_host(xs, &ex.up, &mut up)?;
        if let Some(b) = bias_row(&experts.up_bias, ff) {
            up.chunks_mut(ff).for_each(|r| r.iter_mut().zip(&b).for_each(|(x, y)| *x += y));
        }
        let h: Vec<f32> = match &ex.gate {
            Some(g) => {
                let mut gate = vec![0f32; m * ff];
                self.matmul_host(xs, g, &mut gate)?;
                if let Some(b) = bias_row(&experts.gate_bias, ff) {
                    gate.chunks_mut(ff).for_each(|r| r.iter_mut().zip(&b).for_each(|(x, y)| *x += y));
                }
                gate.iter().zip(&up).map(|(&g, &u)| kernels::glu(g, u, spec.glu)).collect()
            }
            None => {
                let act = spec.glu.ungated_act();
                up.iter().map(|&u| kernels::act(u, act)).collect()
            }
        };
        let mut down = vec![0f32; m * n_embd];
        self.matmul_host(&h, &ex.down, &mut down)?;
        let down_bias = bias_row(&experts.down_bias, n_embd);
        for (r, &(t, w)) in toks.iter().enumerate() {
            let o = &mut out[t * n_embd..(t + 1) * n_embd];
            for (c, ov) in o.iter_mut().enumerate() {
                let b = down_bias.as_ref().map_or(0.0, |b| b[c]);
                *ov += w * (down[r * n_embd + c] + b);
            }
        }
        Ok(())
    }

    /// The experts `group` of a one-token call through [`experts_one_token`], each with its
    /// routing weight from `by_expert`, added into `out`.
    fn experts_one_token(
        &self,
        x: &[f32],
        group: &[HostExpert<'_>],
        by_expert: &[Vec<(usize, f32)>],
        experts: &Experts<Self>,
        spec: &MoeSpec,
        out: &mut [f32],
    ) -> Result<(), OpError> {
        let weighted = group
            .iter()
            .map(|ex| match by_expert.get(ex.id as usize).and_then(|toks| toks.first()) {
                Some(&(_, w)) => Ok((*ex, w)),
                None => Err(OpError::ShapeMismatch {
                    op: "moe_ffn store",
                    expected: format!("experts the router picked (< {})", spec.n_expert),
                    got: vec![ex.id as usize],
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        fn data(b: &Option<CpuTensor>) -> Option<&[f32]> {
            b.as_ref().map(|b| &b.data[..])
        }
        let biases =
            ExpertBiases { gate: data(&experts.gate_bias), up: data(&experts.up_bias), down: data(&experts.down_bias) };
        experts_one_token(self.mode, x, &weighted, biases, spec, out)
    }

    fn matmul_raw(&self, x: &[f32], n_tok: usize, w: &HostWeight, y: &mut [f32]) -> Result<(), OpError> {
        {
            let _ = n_tok;
            quant::matmul(w.dtype, w.bytes(), w.n_rows(), w.row_len(), x, y, self.mode)
        }
        .map_err(|source| OpError::Quant { op: "matmul", source })
    }
}

/// Element counts from which element-wise ops split their work over the thread pool. Below
/// them, handing work to a second thread costs more than it saves; the thresholds differ by
/// the cost of one element: an add or multiply, an exponential (activations), a row op.
const PAR_CHEAP_ELEMS: usize = 1 << 17;
const PAR_EXP_ELEMS: usize = 1 << 14;
const PAR_ROW_ELEMS: usize = 1 << 15;
/// Elements per task of a parallel element-wise op.
const PAR_CHUNK: usize = 1 << 12;

/// `f` of every value of `src`, into a pooled vector.
fn map(src: &[f32], parallel: bool, f: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    if parallel {
        let mut out = pool::zeros(src.len());
        out.par_chunks_mut(PAR_CHUNK)
            .zip(src.par_chunks(PAR_CHUNK))
            .for_each(|(o, s)| o.iter_mut().zip(s).for_each(|(o, &x)| *o = f(x)));
        out
    } else {
        let mut out = pool::values(src.len());
        out.extend(src.iter().map(|&x| f(x)));
        out
    }
}

/// `f(a[i], b[i])` for every i, into a pooled vector (`a` and `b` have the same length).
fn zip_map(a: &[f32], b: &[f32], parallel: bool, f: impl Fn(f32, f32) -> f32 + Sync) -> Vec<f32> {
    if parallel {
        let mut out = pool::zeros(a.len());
        out.par_chunks_mut(PAR_CHUNK)
            .zip(a.par_chunks(PAR_CHUNK).zip(b.par_chunks(PAR_CHUNK)))
            .for_each(|(o, (a, b))| o.iter_mut().zip(a.iter().zip(b)).for_each(|(o, (&x, &y))| *o = f(x, y)));
        out
    } else {
        let mut out = pool::values(a.len());
        out.extend(a.iter().zip(b).map(|(&x, &y)| f(x, y)));
        out
    }
}

/// `out[i] = glu(gate[i], up[i])` for the common length: the vectorised tanh-GELU for Gemma's
/// gating (groups of eight from the start of the slices, so chunks starting at multiples of
/// eight give the bits of one call), the reference formula for every other.
fn glu_into(gate: &[f32], up: &[f32], out: &mut [f32], glu: Glu) {
    if glu == Glu::Plain(Act::GeluTanh) {
        gelu::gelu_tanh_glu(gate, up, out);
    } else {
        out.iter_mut().zip(gate.iter().zip(up)).for_each(|(o, (&g, &u))| *o = kernels::glu(g, u, glu));
    }
}

/// cos and sin of one rope variant at the positions of its latest call: every layer of a step
/// rotates q and k at the same positions, so the angles are computed once per step, not per
/// op and row.
struct RopeAngles {
    spec: RopeSpec,
    table: kernels::RopeTable,
    positions: Vec<u32>,
    /// `[positions, n_freq]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// Rope variants remembered per thread (gemma3 alternates two: local and global layers).
const ROPE_VARIANTS: usize = 4;

thread_local! {
    static ROPE_ANGLES: RefCell<Vec<RopeAngles>> = const { RefCell::new(Vec::new()) };
}

/// Calls `f(cos, sin, n_freq)` with the angles of `spec` at `positions`, computing them only
/// when this thread's last call for `spec` had other positions.
fn with_rope_angles<R>(spec: &RopeSpec, positions: &[u32], f: impl FnOnce(&[f32], &[f32], usize) -> R) -> R {
    // The entry is taken out while `f` runs, so a nested call on this thread (a rayon job
    // stolen while `f` waits) finds the cell free.
    let cached = ROPE_ANGLES.with(|c| {
        let mut c = c.borrow_mut();
        c.iter().position(|a| a.spec == *spec).map(|i| c.swap_remove(i))
    });
    let mut a = cached.unwrap_or_else(|| RopeAngles {
        spec: spec.clone(),
        table: kernels::RopeTable::new(spec),
        positions: Vec::new(),
        cos: Vec::new(),
        sin: Vec::new(),
    });
    let n_freq = a.table.n_freq();
    if a.positions != positions {
        a.positions.clear();
        a.positions.extend_from_slice(positions);
        a.cos.resize(positions.len() * n_freq, 0.0);
        a.sin.resize(positions.len() * n_freq, 0.0);
        for ((&p, cos), sin) in
            positions.iter().zip(a.cos.chunks_mut(n_freq.max(1))).zip(a.sin.chunks_mut(n_freq.max(1)))
        {
            a.table.cos_sin_into(p, cos, sin);
        }
    }
    let result = f(&a.cos, &a.sin, n_freq);
    ROPE_ANGLES.with(|c| {
        let mut c = c.borrow_mut();
        if c.len() >= ROPE_VARIANTS {
            c.remove(0);
        }
        c.push(a);
    });
    result
}

/// Multiply-adds below which attention runs on the calling thread.
const PAR_ATTENTION_WORK: usize = 1 << 18;

/// Every (token, head) of `q` attended over `rows`; `out` is `[n, n_head * head_dim_v]`.
// Each input is needed; the tasks share them all.
#[allow(clippy::too_many_arguments)]
fn attend_all<T: KvElem>(
    simd: Simd,
    q: &CpuTensor,
    rows: Rows<'_, T>,
    pos0: usize,
    spec: &AttnSpec,
    sinks: Option<&[f32]>,
    out: &mut [f32],
    parallel: bool,
) {
    let q_width = q.width();
    let task = |(idx, o): (usize, &mut [f32])| {
        let (i, h) = (idx / spec.n_head, idx % spec.n_head);
        let qh = &q.data[i * q_width + h * spec.head_dim_k..][..spec.head_dim_k];
        attention::attend_head(simd, qh, rows, h, pos0 + i, spec, sinks.map(|s| s[h]), o);
    };
    if parallel {
        out.par_chunks_mut(spec.head_dim_v).enumerate().for_each(task);
    } else {
        out.chunks_mut(spec.head_dim_v).enumerate().for_each(task);
    }
}

fn expect_2d(op: &'static str, t: &CpuTensor, width: usize) -> Result<(), OpError> {
    if t.width() != width || !t.data.len().is_multiple_of(width.max(1)) {
        return Err(OpError::ShapeMismatch { op, expected: format!("[n, {width}]"), got: t.shape.clone() });
    }
    Ok(())
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = HostWeight;
    type Cache = CpuCache;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn step_feeds_thread_pool(&self) -> bool {
        true
    }

    fn from_host(&self, data: &[f32], shape: &[usize]) -> Result<CpuTensor, OpError> {
        OpError::check_host_values(data, shape)?;
        Ok(CpuTensor::pooled(shape, pool::copy_of(data)))
    }

    fn to_host(&self, t: &CpuTensor) -> Result<Vec<f32>, OpError> {
        Ok(t.data.clone())
    }

    fn to_host_into(&self, t: &CpuTensor, out: &mut Vec<f32>) -> Result<(), OpError> {
        out.clear();
        out.extend_from_slice(&t.data);
        Ok(())
    }

    fn shape<'a>(&self, t: &'a CpuTensor) -> &'a [usize] {
        &t.shape
    }

    fn reshape(&self, mut t: CpuTensor, shape: &[usize]) -> Result<CpuTensor, OpError> {
        if shape.iter().product::<usize>() != t.data.len() {
            return Err(OpError::ShapeMismatch {
                op: "reshape",
                expected: format!("{:?} ({} values)", shape, shape.iter().product::<usize>()),
                got: t.shape.clone(),
            });
        }
        t.shape.clear();
        t.shape.extend_from_slice(shape);
        Ok(t)
    }

    fn weight(&self, w: &HostWeight) -> Result<HostWeight, OpError> {
        if !quant::is_supported(w.dtype) {
            return Err(OpError::Weight { name: w.name.clone(), why: format!("type {} has no CPU kernel", w.dtype) });
        }
        Ok(w.clone())
    }

    fn get_rows(&self, table: &HostWeight, ids: &[u32]) -> Result<CpuTensor, OpError> {
        let width = table.row_len();
        let n_rows = table.n_rows();
        let rb = table.row_bytes();
        let bytes = table.bytes();
        let mut data = pool::zeros(ids.len() * width);
        for (&id, out) in ids.iter().zip(data.chunks_mut(width)) {
            let i = id as usize;
            if i >= n_rows {
                return Err(OpError::BadTokenId { id, n_vocab: n_rows });
            }
            quant::dequantize(table.dtype, &bytes[i * rb..(i + 1) * rb], out)
                .map_err(|source| OpError::Quant { op: "get_rows", source })?;
        }
        Ok(CpuTensor::pooled(&[ids.len(), width], data))
    }

    fn matmul(&self, x: &CpuTensor, w: &HostWeight) -> Result<CpuTensor, OpError> {
        let k = w.row_len();
        expect_2d("matmul", x, k)?;
        let n = x.rows();
        let n_out = w.n_rows();
        let mut y = pool::zeros(n * n_out);
        self.matmul_raw(&x.data, n, w, &mut y)?;
        Ok(CpuTensor::pooled(&[n, n_out], y))
    }

    fn matmul_many<const N: usize>(&self, x: &CpuTensor, ws: [&HostWeight; N]) -> Result<[CpuTensor; N], OpError> {
        for w in ws {
            expect_2d("matmul_many", x, w.row_len())?;
        }
        let (n, k) = (x.rows(), x.width());
        let mut ys: [Vec<f32>; N] = std::array::from_fn(|i| pool::zeros(n * ws[i].n_rows()));
        let weights = ws.map(|w| quant::WeightRows { dtype: w.dtype, bytes: w.bytes(), n_out: w.n_rows() });
        let mut outs = ys.each_mut().map(|y| y.as_mut_slice());
        quant::matmul_many(&weights, k, &x.data, &mut outs, self.mode)
            .map_err(|source| OpError::Quant { op: "matmul", source })?;
        let mut i = 0;
        Ok(ys.map(|y| {
            let t = CpuTensor::pooled(&[n, ws[i].n_rows()], y);
            i += 1;
            t
        }))
    }

    fn add(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor, OpError> {
        self.binary("add", a, b, |x, y| x + y)
    }

    fn mul(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor, OpError> {
        self.binary("mul", a, b, |x, y| x * y)
    }

    fn scale(&self, a: &CpuTensor, s: f32) -> Result<CpuTensor, OpError> {
        let parallel = a.data.len() >= PAR_CHEAP_ELEMS;
        Ok(CpuTensor::pooled(&a.shape, map(&a.data, parallel, |x| x * s)))
    }

    fn act(&self, a: &CpuTensor, act: Act) -> Result<CpuTensor, OpError> {
        let parallel = a.data.len() >= PAR_EXP_ELEMS;
        Ok(CpuTensor::pooled(&a.shape, map(&a.data, parallel, |x| kernels::act(x, act))))
    }

    fn glu(&self, gate: &CpuTensor, up: &CpuTensor, glu: Glu) -> Result<CpuTensor, OpError> {
        if gate.shape != up.shape {
            return Err(OpError::ShapeMismatch {
                op: "glu",
                expected: format!("{:?}", gate.shape),
                got: up.shape.clone(),
            });
        }
        let mut out = pool::zeros(gate.data.len());
        if gate.data.len() >= PAR_EXP_ELEMS {
            out.par_chunks_mut(PAR_CHUNK)
                .zip(gate.data.par_chunks(PAR_CHUNK).zip(up.data.par_chunks(PAR_CHUNK)))
                .for_each(|(o, (g, u))| glu_into(g, u, o, glu));
        } else {
            glu_into(&gate.data, &up.data, &mut out, glu);
        }
        Ok(CpuTensor::pooled(&gate.shape, out))
    }

    fn matmul_glu(
        &self,
        x: &CpuTensor,
        gate_w: &HostWeight,
        up_w: &HostWeight,
        glu: Glu,
    ) -> Result<CpuTensor, OpError> {
        expect_2d("matmul_glu", x, gate_w.row_len())?;
        expect_2d("matmul_glu", x, up_w.row_len())?;
        let n_ff = gate_w.n_rows();
        if x.rows() == 1 && up_w.n_rows() == n_ff {
            // Decode: both products and the gating in one parallel region (each task gates the
            // rows it computed), the same bits as the products and `glu` one after the other.
            fn weights(w: &HostWeight) -> quant::WeightRows<'_> {
                quant::WeightRows { dtype: w.dtype, bytes: w.bytes(), n_out: w.n_rows() }
            }
            // Tensors, so that the products' buffers return to the pool when dropped.
            let mut gate = CpuTensor::pooled(&[1, n_ff], pool::zeros(n_ff));
            let mut up = CpuTensor::pooled(&[1, n_ff], pool::zeros(n_ff));
            let mut out = pool::zeros(n_ff);
            let fused = quant::matmul_gated(
                weights(gate_w),
                weights(up_w),
                x.width(),
                &x.data,
                &mut gate.data,
                &mut up.data,
                &mut out,
                self.mode,
                &|g, u, o| glu_into(g, u, o, glu),
            )
            .map_err(|source| OpError::Quant { op: "matmul_glu", source })?;
            if fused {
                return Ok(CpuTensor::pooled(&[1, n_ff], out));
            }
            pool::give_back(out, Vec::new());
        }
        let [gate, up] = self.matmul_many(x, [gate_w, up_w])?;
        self.glu(&gate, &up, glu)
    }

    fn rms_norm(&self, x: &CpuTensor, weight: Option<&CpuTensor>, eps: f32) -> Result<CpuTensor, OpError> {
        let w = x.width();
        if let Some(wt) = weight {
            if wt.data.len() != w {
                return Err(OpError::ShapeMismatch {
                    op: "rms_norm",
                    expected: format!("weight of {w}"),
                    got: wt.shape.clone(),
                });
            }
        }
        let mut data = pool::copy_of(&x.data);
        let norm = |row: &mut [f32]| kernels::rms_norm(row, weight.map(|t| &t.data[..]), eps);
        if data.len() >= PAR_ROW_ELEMS {
            data.par_chunks_mut(w.max(1)).for_each(norm);
        } else {
            data.chunks_mut(w.max(1)).for_each(norm);
        }
        Ok(CpuTensor::pooled(&x.shape, data))
    }

    fn layer_norm(
        &self,
        x: &CpuTensor,
        weight: Option<&CpuTensor>,
        bias: Option<&CpuTensor>,
        eps: f32,
    ) -> Result<CpuTensor, OpError> {
        let w = x.width();
        for t in [weight, bias].into_iter().flatten() {
            if t.data.len() != w {
                return Err(OpError::ShapeMismatch {
                    op: "layer_norm",
                    expected: format!("weight of {w}"),
                    got: t.shape.clone(),
                });
            }
        }
        let mut data = pool::copy_of(&x.data);
        let norm =
            |row: &mut [f32]| kernels::layer_norm(row, weight.map(|t| &t.data[..]), bias.map(|t| &t.data[..]), eps);
        if data.len() >= PAR_ROW_ELEMS {
            data.par_chunks_mut(w.max(1)).for_each(norm);
        } else {
            data.chunks_mut(w.max(1)).for_each(norm);
        }
        Ok(CpuTensor::pooled(&x.shape, data))
    }

    fn rope(&self, x: &CpuTensor, positions: &[u32], spec: &RopeSpec) -> Result<CpuTensor, OpError> {
        let w = x.width();
        spec.check_call(x.rows(), w, &x.shape, positions.len())?;
        let mut data = pool::copy_of(&x.data);
        with_rope_angles(spec, positions, |cos, sin, n_freq| {
            let rotate = |(t, row): (usize, &mut [f32])| {
                let (cos, sin) = (&cos[t * n_freq..(t + 1) * n_freq], &sin[t * n_freq..(t + 1) * n_freq]);
                for head in row.chunks_mut(spec.head_dim) {
                    kernels::rope_head(head, cos, sin, spec.n_rot, spec.neox);
                }
            };
            if data.len() >= PAR_ROW_ELEMS {
                data.par_chunks_mut(w.max(1)).enumerate().for_each(rotate);
            } else {
                data.chunks_mut(w.max(1)).enumerate().for_each(rotate);
            }
        });
        Ok(CpuTensor::pooled(&x.shape, data))
    }

    fn slice_rows(&self, x: &CpuTensor, start: usize, len: usize) -> Result<CpuTensor, OpError> {
        let w = x.width();
        if start + len > x.rows() {
            return Err(OpError::ShapeMismatch {
                op: "slice_rows",
                expected: format!("at least {} rows", start + len),
                got: x.shape.clone(),
            });
        }
        Ok(CpuTensor::pooled(&[len, w], pool::copy_of(&x.data[start * w..(start + len) * w])))
    }

    fn slice_cols(&self, x: &CpuTensor, start: usize, len: usize) -> Result<CpuTensor, OpError> {
        let w = x.width();
        if start + len > w {
            return Err(OpError::ShapeMismatch {
                op: "slice_cols",
                expected: format!("at least {} columns", start + len),
                got: x.shape.clone(),
            });
        }
        let mut data = pool::values(x.rows() * len);
        for r in x.data.chunks(w.max(1)) {
            data.extend_from_slice(&r[start..start + len]);
        }
        Ok(CpuTensor::pooled(&[x.rows(), len], data))
    }

    fn concat_cols(&self, parts: &[&CpuTensor]) -> Result<CpuTensor, OpError> {
        let rows = parts.first().map(|p| p.rows()).unwrap_or(0);
        if let Some(bad) = parts.iter().find(|p| p.rows() != rows) {
            return Err(OpError::ShapeMismatch {
                op: "concat_cols",
                expected: format!("{rows} rows"),
                got: bad.shape.clone(),
            });
        }
        let width: usize = parts.iter().map(|p| p.width()).sum();
        let mut data = pool::values(rows * width);
        for r in 0..rows {
            for p in parts {
                let w = p.width();
                data.extend_from_slice(&p.data[r * w..(r + 1) * w]);
            }
        }
        Ok(CpuTensor::pooled(&[rows, width], data))
    }

    fn new_cache(&self, n_ctx: usize, k_width: usize, v_width: usize) -> Result<CpuCache, OpError> {
        Ok(CpuCache { rows: KvRows::new(self.kv_type, n_ctx * k_width, n_ctx * v_width), k_width, v_width, n_ctx })
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        cache: &mut CpuCache,
        pos0: usize,
        spec: &AttnSpec,
        sinks: Option<&CpuTensor>,
    ) -> Result<CpuTensor, OpError> {
        let n = q.rows();
        expect_2d("attention q", q, spec.n_head * spec.head_dim_k)?;
        expect_2d("attention k", k, cache.k_width)?;
        expect_2d("attention v", v, cache.v_width)?;
        spec.check_call(&AttnCall {
            n,
            k_rows: k.rows(),
            v_rows: v.rows(),
            cache_k_width: cache.k_width,
            cache_v_width: cache.v_width,
            n_ctx: cache.n_ctx,
            pos0,
            sinks: sinks.map(|s| &s.shape[..]),
            max_head_dim: None,
        })?;
        let (kw, vw) = (cache.k_width, cache.v_width);
        cache.rows.write(pos0 * kw, &k.data, pos0 * vw, &v.data);
        let mut out = pool::zeros(n * spec.n_head * spec.head_dim_v);
        let simd = Simd::detect();
        // Multiply-adds of the whole op: below the threshold, waking the pool costs more than
        // the second thread saves.
        let work = n * spec.n_head * (pos0 + n) * (spec.head_dim_k + spec.head_dim_v);
        let parallel = work >= PAR_ATTENTION_WORK;
        let sinks = sinks.map(|s| &s.data[..]);
        match &cache.rows {
            KvRows::F32 { k, v } => {
                attend_all(simd, q, Rows { k, v, k_width: kw, v_width: vw }, pos0, spec, sinks, &mut out, parallel)
            }
            KvRows::F16 { k, v } => {
                attend_all(simd, q, Rows { k, v, k_width: kw, v_width: vw }, pos0, spec, sinks, &mut out, parallel)
            }
        }
        Ok(CpuTensor::pooled(&[n, spec.n_head * spec.head_dim_v], out))
    }

    fn route(
        &self,
        logits: &CpuTensor,
        selection_bias: Option<&CpuTensor>,
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
        if let Some(b) = selection_bias {
            if b.data.len() != n_expert {
                return Err(OpError::ShapeMismatch {
                    op: "route bias",
                    expected: format!("[{n_expert}]"),
                    got: b.shape.clone(),
                });
            }
        }
        let n = logits.rows();
        let mut ids = vec![0u32; n * spec.k];
        let mut weights = vec![0f32; n * spec.k];
        for t in 0..n {
            kernels::route_token(
                &logits.data[t * n_expert..(t + 1) * n_expert],
                selection_bias.map(|b| &b.data[..]),
                spec,
                &mut ids[t * spec.k..(t + 1) * spec.k],
                &mut weights[t * spec.k..(t + 1) * spec.k],
            );
        }
        Ok(Routing { ids, weights: CpuTensor { shape: vec![n, spec.k], data: weights }, k: spec.k })
    }

    fn moe_ffn(
        &self,
        x: &CpuTensor,
        routing: &Routing<Self>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
    ) -> Result<CpuTensor, OpError> {
        let n_embd = x.width();
        let n = x.rows();
        let k = routing.k;
        if routing.ids.len() != n * k
            || experts.up.n_rows() != spec.n_expert * spec.n_ff
            || experts.up.row_len() != n_embd
        {
            return Err(OpError::ShapeMismatch {
                op: "moe_ffn",
                expected: format!("{n} tokens x {k} ids, up [{}, {}, {n_embd}]", spec.n_expert, spec.n_ff),
                got: experts.up.shape.clone(),
            });
        }
        // Group the tokens of each expert so that a prefill batch streams each expert's weights once.
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); spec.n_expert];
        for t in 0..n {
            for j in 0..k {
                let e = routing.ids[t * k + j] as usize;
                if e >= spec.n_expert {
                    return Err(OpError::ShapeMismatch {
                        op: "moe_ffn ids",
                        expected: format!("ids < {}", spec.n_expert),
                        got: vec![e],
                    });
                }
                by_expert[e].push((t, routing.weights.data[t * k + j]));
            }
        }
        let mut out = vec![0f32; n * n_embd];
        let rows_of = |toks: &[(usize, f32)]| -> Vec<f32> {
            toks.iter().flat_map(|&(t, _)| x.data[t * n_embd..(t + 1) * n_embd].iter().copied()).collect()
        };
        // Experts in ascending id order on both paths, so paged and resident runs add the same
        // terms in the same order and give bit-identical outputs.
        let used: Vec<u32> = (0..spec.n_expert as u32).filter(|&e| !by_expert[e as usize].is_empty()).collect();
        match &self.expert_store {
            Some(store) => {
                store.note_input(experts.layer, &x.data, k);
                let tokens: Vec<u32> = used.iter().map(|&e| by_expert[e as usize].len() as u32).collect();
                store.with_host_experts_of_tokens(
                    experts.layer,
                    &used,
                    &tokens,
                    n,
                    &mut |group: &[HostExpert<'_>]| {
                        if n == 1 {
                            return self.experts_one_token(&x.data, group, &by_expert, experts, spec, &mut out);
                        }
                        for ex in group {
                            let toks = by_expert.get(ex.id as usize).ok_or_else(|| OpError::ShapeMismatch {
                                op: "moe_ffn store",
                                expected: format!("expert ids < {}", spec.n_expert),
                                got: vec![ex.id as usize],
                            })?;
                            let expected = (spec.n_ff, n_embd);
                            if (ex.up.n_out, ex.up.k) != expected || (ex.down.n_out, ex.down.k) != (n_embd, spec.n_ff) {
                                return Err(OpError::ShapeMismatch {
                                    op: "moe_ffn store",
                                    expected: format!("up [{}, {n_embd}], down [{n_embd}, {}]", spec.n_ff, spec.n_ff),
                                    got: vec![ex.up.n_out, ex.up.k, ex.down.n_out, ex.down.k],
                                });
                            }
                            self.expert_ffn(&rows_of(toks), toks, ex, experts, spec, &mut out)?;
                        }
                        Ok(())
                    },
                )?;
            }
            None => {
                let ff = spec.n_ff;
                fn host(w: &HostWeight) -> HostMatrix<'_> {
                    HostMatrix { dtype: w.dtype, bytes: w.bytes(), n_out: w.shape[0], k: w.row_len() }
                }
                let mut one_token = Vec::new();
                for &e in &used {
                    let e = e as usize;
                    let toks = &by_expert[e];
                    let matrix =
                        |w: &HostWeight, rows: usize| w.rows(e * rows, (e + 1) * rows, vec![rows, w.row_len()]);
                    let (gate, up, down) = (
                        experts.gate.as_ref().map(|g| matrix(g, ff)),
                        matrix(&experts.up, ff),
                        matrix(&experts.down, n_embd),
                    );
                    if n == 1 {
                        one_token.push((gate, up, down));
                        continue;
                    }
                    let ex =
                        HostExpert { id: e as u32, gate: gate.as_ref().map(host), up: host(&up), down: host(&down) };
                    self.expert_ffn(&rows_of(toks), toks, &ex, experts, spec, &mut out)?;
                }
                if n == 1 {
                    let group: Vec<HostExpert<'_>> = used
                        .iter()
                        .zip(&one_token)
                        .map(|(&e, (gate, up, down))| HostExpert {
                            id: e,
                            gate: gate.as_ref().map(host),
                            up: host(up),
                            down: host(down),
                        })
                        .collect();
                    self.experts_one_token(&x.data, &group, &by_expert, experts, spec, &mut out)?;
                }
            }
        }
        Ok(CpuTensor { shape: vec![n, n_embd], data: out })
    }

    fn ssm_conv(&self, x: &CpuTensor, state: &mut CpuTensor, weight: &CpuTensor) -> Result<CpuTensor, OpError> {
        let channels = x.width();
        let k = state.rows() + 1;
        if state.width() != channels || weight.data.len() != channels * k || weight.width() != k {
            return Err(OpError::ShapeMismatch {
                op: "ssm_conv",
                expected: format!("state [k - 1, {channels}] and weight [{channels}, k] with the same k"),
                got: [state.shape.clone(), weight.shape.clone()].concat(),
            });
        }
        let n = x.rows();
        let mut xx = Vec::with_capacity((k - 1 + n) * channels);
        xx.extend_from_slice(&state.data);
        xx.extend_from_slice(&x.data);
        let mut out = vec![0f32; n * channels];
        kernels::ssm_conv(&xx, &weight.data, k, &mut out);
        state.data.copy_from_slice(&xx[n * channels..]);
        Ok(CpuTensor { shape: vec![n, channels], data: out })
    }

    fn ssm_scan(&self, inputs: &SsmScan<'_, Self>, state: &mut CpuTensor) -> Result<CpuTensor, OpError> {
        let SsmDims { n, n_head, head_dim, d_state } = inputs.check(self, state)?;
        let params = kernels::ScanParams {
            a: &inputs.a.data,
            d: inputs.d.map(|t| &t.data[..]),
            dt_bias: inputs.dt_bias.map(|t| &t.data[..]),
            n_group: inputs.n_group,
            head_dim,
            d_state,
        };
        let width = n_head * head_dim;
        let mut y = vec![0f32; n * width];
        let seq = kernels::ScanSeq { x: &inputs.x.data, dt: &inputs.dt.data, b: &inputs.b.data, c: &inputs.c.data };
        // Tokens depend on each other through the state, heads do not: one task per head runs
        // all the tokens, into its own `[n, head_dim]` block, interleaved afterwards.
        let per_head: Vec<Vec<f32>> = state
            .data
            .par_chunks_mut(head_dim * d_state)
            .enumerate()
            .map(|(h, s)| {
                let mut yh = vec![0f32; n * head_dim];
                kernels::ssm_scan_head(s, h, seq, &params, &mut yh);
                yh
            })
            .collect();
        for (h, yh) in per_head.iter().enumerate() {
            for (row, part) in y.chunks_mut(width).zip(yh.chunks(head_dim)) {
                row[h * head_dim..(h + 1) * head_dim].copy_from_slice(part);
            }
        }
        Ok(CpuTensor { shape: vec![n, width], data: y })
    }

    fn matmul_per_head(&self, x: &CpuTensor, w: &HostWeight) -> Result<CpuTensor, OpError> {
        let [n_head, n_out, k] = w.shape[..] else {
            return Err(OpError::ShapeMismatch {
                op: "matmul_per_head",
                expected: "a weight [n_head, n_out, k]".into(),
                got: w.shape.clone(),
            });
        };
        expect_2d("matmul_per_head", x, n_head * k)?;
        let n = x.rows();
        let out_width = n_head * n_out;
        let mut out = vec![0f32; n * out_width];
        for h in 0..n_head {
            let xs = kernels::gather_cols(&x.data, n_head * k, h * k, k);
            let wh = w.rows(h * n_out, (h + 1) * n_out, vec![n_out, k]);
            let mut y = vec![0f32; n * n_out];
            self.matmul_raw(&xs, n, &wh, &mut y)?;
            kernels::scatter_cols(&y, &mut out, out_width, h * n_out, n_out);
        }
        Ok(CpuTensor { shape: vec![n, out_width], data: out })
    }
}

#[cfg(test)]
mod matmul_per_head_tests {
    use super::*;
    use gguf::{GgmlType, GgufModel, GgufWriter, Value};
    use std::sync::Arc;

    /// A weight `[n_head, n_out, k]` of f32 values written to a GGUF file and mapped back.
    fn f32_weight(name: &str, shape: [usize; 3], values: &[f32]) -> HostWeight {
        let path = std::env::temp_dir().join(format!("diskformer-per-head-{}-{name}.gguf", std::process::id()));
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String("test".into()));
        w.add_tensor(name, GgmlType::F32, &[shape[2] as u64, shape[1] as u64, shape[0] as u64]).unwrap();
        let mut out = w.create(&path).unwrap();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        out.write_data(&bytes).unwrap();
        out.finish().unwrap();
        let model = Arc::new(GgufModel::open(&path).unwrap());
        let hw = HostWeight::from_model(&model, name).unwrap();
        std::fs::remove_file(&path).ok();
        hw
    }

    #[test]
    fn matches_a_separate_product_per_head() {
        let (n, n_head, n_out, k) = (3, 4, 5, 6);
        let wv: Vec<f32> = (0..n_head * n_out * k).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let xv: Vec<f32> = (0..n * n_head * k).map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0).collect();
        let w = f32_weight("w", [n_head, n_out, k], &wv);
        let b = CpuBackend::default();
        let x = b.from_host(&xv, &[n, n_head * k]).unwrap();
        let y = b.matmul_per_head(&x, &w).unwrap();
        assert_eq!(y.shape, vec![n, n_head * n_out]);
        // y[t][h*n_out + o] = sum_j x[t][h*k + j] * w[h][o][j], summed in f64 here.
        for t in 0..n {
            for h in 0..n_head {
                for o in 0..n_out {
                    let expected: f64 = (0..k)
                        .map(|j| xv[t * n_head * k + h * k + j] as f64 * wv[(h * n_out + o) * k + j] as f64)
                        .sum();
                    let got = y.data[t * n_head * n_out + h * n_out + o] as f64;
                    assert!((got - expected).abs() < 1e-5, "t {t} h {h} o {o}: {got} vs {expected}");
                }
            }
        }
    }

    #[test]
    fn rejects_mismatched_widths() {
        let w = f32_weight("w_bad", [2, 3, 4], &[0.5; 24]);
        let b = CpuBackend::default();
        let x = b.from_host(&[1.0; 14], &[2, 7]).unwrap();
        assert!(matches!(b.matmul_per_head(&x, &w), Err(OpError::ShapeMismatch { .. })));
    }
}
