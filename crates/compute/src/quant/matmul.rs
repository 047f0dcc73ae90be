//! The parallel matrix product `y[t][o] = sum_k x[t][k] * W[o][k]` over encoded weight rows.
//!
//! Work is split over blocks of output rows (rayon). Each task dequantizes its rows once into
//! thread-local scratch and then takes every token's dot product against them, so a weight row
//! is read once per call whatever the token count, and nothing is allocated per row.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};

use gguf::GgmlType;
use rayon::prelude::*;

use super::qdot::{ActBuf, ActKind, ActRow, TokenOctet};
use super::simd::{Kernel, QDot, RowDequantizer, Tiles};
use super::{check_encoded, dequantizer, QuantError};

mod experts;
pub use experts::{
    experts_one_token, owned_bytes, set_owned_claims, set_spawned_region, timing as experts_timing, ExpertGating,
    ExpertRows,
};

/// How [`matmul`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulMode {
    /// f32 arithmetic on exactly dequantized weights, fixed summation order: the reference.
    #[default]
    Exact,
    /// llama.cpp's scheme: activations quantized to Q8_0 (or Q8_K for k-quants) on the fly and
    /// integer dot products per block. Faster; differs from `Exact` by the activation rounding.
    QuantizedActivations,
}

/// f32 lanes of the reference dot product. The sum is defined lane-wise (lane `i` adds the
/// products at positions `i mod LANES`), then the lanes are folded in halves, then the tail is
/// added, so a SIMD build with any register width up to `LANES` computes the same bits. 32
/// lanes are four independent 256-bit accumulators: enough to hide the latency of the adds.
const LANES: usize = 32;

#[inline(always)]
fn dot_f32_lanes(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (xa, xb) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] += xa[i] * xb[i];
        }
    }
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    let mut sum = acc[0];
    for (xa, xb) in ca.remainder().iter().zip(cb.remainder()) {
        sum += xa * xb;
    }
    sum
}

/// [`dot_f32_lanes`] with explicit 256-bit registers (LLVM's auto-vectoriser only managed two
/// lanes at a time on the array form). Lanes 0..32 are four registers; every add and multiply
/// is the portable one in the same order (mul then add, no FMA), so the bits are identical.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let n_chunks = n / LANES;
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    for c in 0..n_chunks {
        for (j, lane) in acc.iter_mut().enumerate() {
            let at = c * LANES + 8 * j;
            let prod = _mm256_mul_ps(_mm256_loadu_ps(pa.add(at)), _mm256_loadu_ps(pb.add(at)));
            *lane = _mm256_add_ps(*lane, prod);
        }
    }
    // Fold halves: lanes i += i + 16, i += i + 8, i += i + 4, i += i + 2, i += i + 1.
    let v0 = _mm256_add_ps(acc[0], acc[2]);
    let v1 = _mm256_add_ps(acc[1], acc[3]);
    let v = _mm256_add_ps(v0, v1);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    let mut sum = _mm_cvtss_f32(s1);
    for i in n_chunks * LANES..n {
        sum += *pa.add(i) * *pb.add(i);
    }
    sum
}

/// The reference f32 dot product of the first `min(a.len(), b.len())` values.
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above; the kernel reads only indices below
        // min(a.len(), b.len()).
        return unsafe { dot_f32_avx2(a, b) };
    }
    dot_f32_lanes(a, b)
}

/// Output rows per task: enough tasks to balance threads, few enough to amortise scheduling,
/// and a block of dequantized rows small enough to stay in L2 (`ROW_BLOCK_VALUES`).
const ROW_BLOCK_VALUES: usize = 64 * 1024;
const MAX_ROWS_PER_TASK: usize = 16;
/// Products below this count run on the calling thread: rayon's overhead would dominate.
const SERIAL_WORK: usize = 1 << 16;

thread_local! {
    static ROW_BLOCK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `y` with interior writes from several tasks, each to its own output rows.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint indices (each owns a distinct set of output rows `o`, and
// writes only `y[t * n_out + o]` for those), and the borrow of `y` outlives the parallel loop.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Through a method, so closures capture the whole `Sync` wrapper, not the raw field.
    fn at(self, index: usize) -> *mut f32 {
        self.0.wrapping_add(index)
    }
}

/// `y[t][o] = sum_k x[t][k] * W[o][k]` for `n_tok = x.len() / k` tokens.
///
/// `w` holds `n_out` rows of `k` values encoded as `dtype`; `x` is `n_tok x k` row-major f32;
/// `y` is `n_tok x n_out` row-major and is overwritten. Runs on rayon's pool.
///
/// In [`MatmulMode::QuantizedActivations`] the block-quantized types use
/// [`matmul_quantized`] with [`Kernel::best`]; F32, F16 and BF16 weights, which have no 8-bit
/// activation scheme here, compute exactly in both modes.
///
/// # Errors
/// [`QuantError::Unsupported`] for a type without a decoder, [`QuantError::NotWholeBlocks`]
/// when `k` is not a multiple of the block size, [`QuantError::SizeMismatch`] when `w` is not
/// `n_out` encoded rows, [`QuantError::RaggedRows`] when `x` is not whole rows of `k`,
/// [`QuantError::ShapeMismatch`] when `y` is not `n_tok x n_out`.
pub fn matmul(
    dtype: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &[f32],
    y: &mut [f32],
    mode: MatmulMode,
) -> Result<(), QuantError> {
    if mode == MatmulMode::QuantizedActivations && ActKind::for_weights(dtype).is_some() {
        return matmul_quantized(dtype, w, n_out, k, x, y, Kernel::best());
    }
    let portable = dequantizer(dtype).ok_or(QuantError::Unsupported { dtype, op: "matmul" })?;
    let dequantize_row = RowDequantizer::new(dtype, portable);
    let Some(shape) = check_shapes(dtype, w, n_out, k, x, y)? else {
        return Ok(());
    };
    let rows_per_task = (ROW_BLOCK_VALUES / k).clamp(1, MAX_ROWS_PER_TASK);
    let out = SharedOut(y.as_mut_ptr());
    let task = |task_index: usize| {
        let o_start = task_index * rows_per_task;
        let o_end = (o_start + rows_per_task).min(n_out);
        let n_rows = o_end - o_start;
        ROW_BLOCK.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            if scratch.len() < n_rows * k {
                scratch.resize(n_rows * k, 0.0);
            }
            let rows = &mut scratch[..n_rows * k];
            dequantize_row.run(&w[o_start * shape.row_bytes..o_end * shape.row_bytes], rows);
            for (t, xt) in x.chunks_exact(k).enumerate() {
                for (r, row) in rows.chunks_exact(k).enumerate() {
                    let value = dot_f32(row, xt);
                    // SAFETY: `t < n_tok` and `o_start + r < n_out`, so the index is inside `y`
                    // (len n_tok * n_out); this task alone owns rows o_start..o_end.
                    unsafe { *out.at(t * n_out + o_start + r) = value };
                }
            }
        });
    };
    run_tasks(n_out.div_ceil(rows_per_task), n_out * k * shape.n_tok, task);
    Ok(())
}

/// Tokens per tile of the quantized path: the activations of a tile (about `k` bytes each) stay
/// in L2 while a block of weight rows (in L1/L2) is applied to all of them.
const TOKENS_PER_TILE: usize = 16;

/// [`matmul`] with llama.cpp-style 8-bit activations, computed by the given kernel.
///
/// The activation rows are quantized once (Q8_0-style blocks for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
/// IQ4_NL and MXFP4 weights; Q8_K blocks for Q2_K..Q6_K and IQ4_XS), then every weight row is
/// dotted with every token by integer block sums. A kernel the CPU lacks falls back to
/// [`Kernel::Portable`]. Decode (one token) splits output rows across threads; prefill applies
/// each block of weight rows to tiles of tokens so a row is fetched from memory once per call.
/// On AVX2, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K use multi-row kernels (eight rows per step in
/// decode; in prefill four rows by sixteen tokens, one token per lane) that give each output
/// the same bits either way. The activation buffers are kept per thread, so repeated calls do not allocate.
///
/// # Errors
/// As [`matmul`]; also [`QuantError::Unsupported`] for types without an 8-bit activation scheme
/// (F32, F16, BF16, Q8_K).
pub fn matmul_quantized(
    dtype: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &[f32],
    y: &mut [f32],
    kernel: Kernel,
) -> Result<(), QuantError> {
    let kind = ActKind::for_weights(dtype).ok_or(QuantError::Unsupported { dtype, op: "matmul_quantized" })?;
    let Some(shape) = check_shapes(dtype, w, n_out, k, x, y)? else {
        return Ok(());
    };
    let n_tok = shape.n_tok;
    // The activation buffers are reused across calls on this thread; taken out of the cell so
    // a nested call (a task stolen while this one waits) gets its own.
    let mut act = ACT_BUF.with(|cell| cell.take());
    act.quantize(kind, x, k);
    if let Some(tiles) = Tiles::new(dtype, kernel) {
        matmul_tiled(tiles, kind, &mut act, w, n_out, k, n_tok, shape.row_bytes, y);
    } else {
        matmul_rows(dtype, kind, kernel, &act, w, n_out, k, n_tok, shape.row_bytes, y);
    }
    ACT_BUF.with(|cell| cell.replace(act));
    Ok(())
}

thread_local! {
    static ACT_BUF: RefCell<ActBuf> = RefCell::new(ActBuf::default());
}

/// [`matmul_quantized`] with the multi-row kernels: eight rows per call for one token, tiles of
/// four rows by sixteen tokens ([`matmul_octets`]) otherwise. Rows past `n_out` and tokens past
/// `n_tok` in a last partial group repeat the last one and are not stored.
#[allow(clippy::too_many_arguments)]
fn matmul_tiled(
    tiles: Tiles,
    kind: ActKind,
    act: &mut ActBuf,
    w: &[u8],
    n_out: usize,
    k: usize,
    n_tok: usize,
    row_bytes: usize,
    y: &mut [f32],
) {
    let nb = k / kind.block_elems();
    let out = SharedOut(y.as_mut_ptr());
    if n_tok == 1 {
        let part = DecodePart::new(tiles, w, n_out, row_bytes, out);
        decode_tiled(&[part], nb, act.row(kind, 0, k), k);
        return;
    }
    act.build_octets(kind, n_tok, k);
    matmul_octets(tiles, kind, act, w, n_out, k, n_tok, row_bytes, out);
}

/// Weight bytes of the rows one prefill task applies to every token octet: they stay in L2
/// (512 KiB per core on the EPYC this was tuned on) beside an octet of activations (`8 k`
/// bytes) while the task walks the octets, so weights are fetched from memory once per call
/// and activations from L3 once per panel.
const PANEL_BYTES: usize = 192 * 1024;

/// The prefill of [`matmul_tiled`] for kernels with octet tiles: each task owns a panel of
/// whole groups of four rows and applies it to every octet of tokens in turn.
#[allow(clippy::too_many_arguments)]
fn matmul_octets(
    tiles: Tiles,
    kind: ActKind,
    act: &ActBuf,
    w: &[u8],
    n_out: usize,
    k: usize,
    n_tok: usize,
    row_bytes: usize,
    out: SharedOut,
) {
    let nb = k / kind.block_elems();
    let row_at = |o: usize| w[o.min(n_out - 1) * row_bytes..].as_ptr();
    let n_threads = rayon::current_num_threads().max(1);
    let panel_rows = (PANEL_BYTES / row_bytes / 4 * 4).max(4);
    let rows_per_task = n_out.div_ceil(4 * n_threads).next_multiple_of(4).clamp(4, panel_rows);
    let n_octets = n_tok.div_ceil(8);
    let task = |task_index: usize| {
        let o_start = task_index * rows_per_task;
        let o_end = (o_start + rows_per_task).min(n_out);
        let mut oct = 0;
        while oct < n_octets {
            // Four octets at a time where the kernel set has a taller tile, the rest by two.
            let step = if tiles.has_quad() && n_octets - oct >= 4 { 4 } else { (n_octets - oct).min(2) };
            let quad: [TokenOctet<'_>; 4] = std::array::from_fn(|i| act.octet(kind, (oct + i).min(n_octets - 1), k));
            let n_here = (n_tok - 8 * oct).min(8 * step);
            for o0 in (o_start..o_end).step_by(4) {
                let rows = std::array::from_fn(|i| row_at(o0 + i));
                // SAFETY: every pointer is the start of a row of `nb` blocks inside `w`
                // (checked by `check_shapes`; rows past the end repeat the last one).
                let values = unsafe {
                    if step == 4 {
                        tiles.tile_quad(&rows, nb, &quad)
                    } else {
                        let v = tiles.tile_octets(&rows, nb, &quad[..step]);
                        v.map(|[a, b]| [a, b, [0.0; 8], [0.0; 8]])
                    }
                };
                // Token by token, so the (up to) four rows' values of a token go to adjacent
                // outputs: row by row, each store hit another line of `y`.
                let n_rows = (o_end - o0).min(4);
                for t in 0..n_here {
                    for (r, row_values) in values.iter().enumerate().take(n_rows) {
                        // SAFETY: `8 oct + t < n_tok` and `o0 + r < n_out`: inside `y`; this
                        // task alone owns rows o_start..o_end.
                        unsafe { *out.at((8 * oct + t) * n_out + o0 + r) = row_values[t / 8][t % 8] };
                    }
                }
            }
            oct += step;
        }
    };
    run_tasks(n_out.div_ceil(rows_per_task), n_out * k * n_tok, task);
}

/// One weight matrix of a one-token tiled product: its rows, kernels and output.
#[derive(Clone, Copy)]
struct DecodePart<'a> {
    tiles: Tiles,
    w: &'a [u8],
    n_out: usize,
    row_bytes: usize,
    out: SharedOut,
}

impl<'a> DecodePart<'a> {
    fn new(tiles: Tiles, w: &'a [u8], n_out: usize, row_bytes: usize, out: SharedOut) -> DecodePart<'a> {
        DecodePart { tiles, w, n_out, row_bytes, out }
    }

    /// Rows `start..end` of this matrix times `x`, eight at a time.
    fn run(&self, start: usize, end: usize, nb: usize, x: ActRow<'_>) {
        let (n_out, row_bytes) = (self.n_out, self.row_bytes);
        let row_at = |o: usize| self.w[o.min(n_out - 1) * row_bytes..].as_ptr();
        let o_end = end.min(n_out);
        for o0 in (start..o_end).step_by(8) {
            let rows = std::array::from_fn(|i| row_at(o0 + i));
            // SAFETY: every pointer is the start of a row of `row_bytes = nb` blocks inside `w`
            // (checked by `check_shapes`).
            let values = unsafe {
                if o0 + 8 >= o_end {
                    self.tiles.rows8_last(&rows, nb, x)
                } else {
                    self.tiles.rows8(&rows, nb, x)
                }
            };
            for (i, &v) in values.iter().enumerate().take(o_end - o0) {
                // SAFETY: `o0 + i < n_out`, token 0: inside this part's output; the caller
                // owns rows start..end.
                unsafe { *self.out.at(o0 + i) = v };
            }
        }
    }
}

/// Weight bytes of the smallest share of a one-token product a thread claims: the last shares
/// of a product are this small, so the threads finish within a few microseconds of each other.
pub(super) const MIN_CLAIM_BYTES: usize = 64 * 1024;

/// Hands out the rows `0..n_rows` of a one-token product in shares of decreasing size (guided
/// self-scheduling): each claim takes `1 / (2 n_threads)` of what is left, at least `min_rows`,
/// in whole groups of eight rows. The first shares are long contiguous streams, the last ones
/// short, so no thread waits long for another at the end: with a fixed split into a few tasks
/// per thread (before), the end of a region waited for up to a whole task, about 75-150 us for
/// a 1B model's FFN products, several times per layer.
struct Claims {
    next: AtomicUsize,
    n_rows: usize,
    min_rows: usize,
    divisor: usize,
}

impl Claims {
    fn new(n_rows: usize, row_bytes: usize, n_threads: usize) -> Claims {
        Claims::with_min_bytes(n_rows, row_bytes, n_threads, MIN_CLAIM_BYTES)
    }

    /// [`Claims::new`] with the smallest share `min_bytes` of weights instead of
    /// [`MIN_CLAIM_BYTES`].
    fn with_min_bytes(n_rows: usize, row_bytes: usize, n_threads: usize, min_bytes: usize) -> Claims {
        let min_rows = (min_bytes / row_bytes.max(1)).next_multiple_of(8).max(8);
        Claims { next: AtomicUsize::new(0), n_rows, min_rows, divisor: 2 * n_threads.max(1) }
    }

    /// The next share `start..end`, or `None` when every row is taken.
    fn claim(&self) -> Option<(usize, usize)> {
        let mut start = self.next.load(Ordering::Relaxed);
        loop {
            if start >= self.n_rows {
                return None;
            }
            let left = self.n_rows - start;
            let len = (left / self.divisor).max(self.min_rows).next_multiple_of(8).min(left);
            match self.next.compare_exchange_weak(start, start + len, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some((start, start + len)),
                Err(now) => start = now,
            }
        }
    }
}

/// Runs `f(start, end)` over shares of `0..n_rows` ([`Claims`]) on every thread of the pool,
/// or over the whole range on this thread when the product is small (`work < SERIAL_WORK`
/// multiply-adds) or the pool has one thread.
///
/// Inside a polled step the region goes to the step's pollers through
/// [`crate::cpu::warm::broadcast`] (each takes claims until none is left) rather than as tasks
/// spawned into this thread's deque, which the other workers steal one at a time: the split's
/// CPU experts, the first region moved so, saw their region's last thread start 1.7-4.3 us in
/// instead of 3.5-14.6 on the H200's 16-core host (thirty-fifth session). Outside a step, or
/// with another region published, it spawns tasks as before; so does
/// `DISKFORMER_PRODUCTS_REGION=spawn`, or the A/B name `prodspawn` on B steps.
fn run_claims(n_rows: usize, row_bytes: usize, work: usize, f: impl Fn(usize, usize) + Sync + Send) {
    let n_threads = rayon::current_num_threads().max(1);
    if work < SERIAL_WORK || n_threads == 1 {
        f(0, n_rows);
        return;
    }
    let claims = Claims::new(n_rows, row_bytes, n_threads);
    let take_claims = || {
        while let Some((start, end)) = claims.claim() {
            f(start, end);
        }
    };
    if !spawned_products() && crate::cpu::warm::broadcast(&take_claims) {
        return;
    }
    (0..n_threads).into_par_iter().for_each(|_| take_claims());
}

/// Whether [`run_claims`] spawns its tasks even inside a polled step:
/// `DISKFORMER_PRODUCTS_REGION=spawn` (read once), or the A/B name `prodspawn` on B steps.
fn spawned_products() -> bool {
    static SPAWN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::ab::is_b("prodspawn")
        || *SPAWN.get_or_init(|| std::env::var("DISKFORMER_PRODUCTS_REGION").is_ok_and(|v| v.trim() == "spawn"))
}

/// One token through several tiled matrices in one parallel region: their rows one after the
/// other form one range, shared out by [`run_claims`].
fn decode_tiled(parts: &[DecodePart<'_>], nb: usize, x: ActRow<'_>, k: usize) {
    decode_parts(parts, nb, k, |_| x);
}

/// [`decode_tiled`] with part `i` multiplying the activations `x_of(i)` (all of `nb` blocks).
fn decode_parts<'x>(parts: &[DecodePart<'_>], nb: usize, k: usize, x_of: impl Fn(usize) -> ActRow<'x> + Sync) {
    // Each part's rows start at a multiple of eight in the joint range, so a share in whole
    // groups of eight never splits one of the kernel's groups.
    let span = |p: &DecodePart<'_>| p.n_out.next_multiple_of(8);
    let n_rows = parts.iter().map(span).sum();
    let work = parts.iter().map(|p| p.n_out * k).sum();
    let row_bytes = parts.iter().map(|p| p.row_bytes).max().unwrap_or(1);
    run_claims(n_rows, row_bytes, work, |start, end| {
        // A walk over the parts (a decode product has a few, a MoE layer tens): no allocation
        // on the decode path.
        let mut at = 0;
        for (i, p) in parts.iter().enumerate() {
            let (lo, hi) = (start.max(at), end.min(at + span(p)));
            if lo < hi {
                p.run(lo - at, hi - at, nb, x_of(i));
            }
            at += span(p);
            if at >= end {
                break;
            }
        }
    });
}

/// A weight matrix for [`matmul_many`]: `n_out` rows of `dtype`, stored in `bytes`.
#[derive(Debug, Clone, Copy)]
pub struct WeightRows<'a> {
    /// Stored element type.
    pub dtype: GgmlType,
    /// The encoded rows.
    pub bytes: &'a [u8],
    /// Rows (outputs).
    pub n_out: usize,
}

/// Most weights [`matmul_many`] computes in one parallel region.
pub const MAX_FUSED: usize = 4;

/// `ys[i] = x · ws[i]ᵀ` for several weights of row length `k` read by the same activations (a
/// layer's q/k/v or gate/up projections), each output with the same bits as its own
/// [`matmul`].
///
/// One token in [`MatmulMode::QuantizedActivations`], up to [`MAX_FUSED`] weights that all have
/// multi-row kernels and one activation scheme: `x` is quantized once and every weight's rows
/// are split over the threads in one parallel region (a decode step's q/k/v become one region
/// instead of three). Otherwise each weight runs its own [`matmul`].
///
/// # Errors
/// As [`matmul`] for each weight; [`QuantError::ShapeMismatch`] when `ws` and `ys` differ in
/// length.
pub fn matmul_many(
    ws: &[WeightRows<'_>],
    k: usize,
    x: &[f32],
    ys: &mut [&mut [f32]],
    mode: MatmulMode,
) -> Result<(), QuantError> {
    if ws.len() != ys.len() {
        return Err(QuantError::ShapeMismatch {
            op: "matmul_many",
            what: "outputs",
            expected: ws.len(),
            got: ys.len(),
        });
    }
    let kernel = Kernel::best();
    let kind = ws.first().and_then(|w| ActKind::for_weights(w.dtype));
    let fused = mode == MatmulMode::QuantizedActivations
        && x.len() == k
        && ws.len() <= MAX_FUSED
        && kind.is_some()
        && ws.iter().all(|w| ActKind::for_weights(w.dtype) == kind && Tiles::new(w.dtype, kernel).is_some());
    let (Some(kind), true) = (kind, fused) else {
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            matmul(w.dtype, w.bytes, w.n_out, k, x, y, mode)?;
        }
        return Ok(());
    };
    let mut slots: [Option<DecodePart<'_>>; MAX_FUSED] = [None; MAX_FUSED];
    let mut n_parts = 0;
    for (w, y) in ws.iter().zip(ys.iter_mut()) {
        // Nothing to compute for an empty matrix (its output, if any, is already settled).
        let Some(shape) = check_shapes(w.dtype, w.bytes, w.n_out, k, x, y)? else { continue };
        let Some(tiles) = Tiles::new(w.dtype, kernel) else { continue };
        slots[n_parts] = Some(DecodePart::new(tiles, w.bytes, w.n_out, shape.row_bytes, SharedOut(y.as_mut_ptr())));
        n_parts += 1;
    }
    let Some(first) = slots[0] else { return Ok(()) };
    let parts = slots.map(|p| p.unwrap_or(first));
    let mut act = ACT_BUF.with(|cell| cell.take());
    act.quantize(kind, x, k);
    decode_tiled(&parts[..n_parts], k / kind.block_elems(), act.row(kind, 0, k), k);
    ACT_BUF.with(|cell| cell.replace(act));
    Ok(())
}

/// `ys[i] = xs[i] · ws[i]ᵀ` for one token each, every weight with its own activations and row
/// length `k`: a MoE layer's experts at decode (the gate and up products of every expert, then
/// the down products, each expert's from its own hidden row), each output with the same bits as
/// its own [`matmul`].
///
/// In [`MatmulMode::QuantizedActivations`], when every weight has multi-row kernels and one
/// activation scheme, the rows of all the products form one range shared out over the threads
/// in one parallel region: on 16 threads a region costs tens of microseconds to fork and join,
/// which one region per expert matrix (three per expert, ~380 experts per token for
/// Qwen3-30B-A3B) paid about as much as the products themselves. Otherwise each weight runs its
/// own [`matmul`].
///
/// # Errors
/// As [`matmul`] for each weight; [`QuantError::ShapeMismatch`] when `ws`, `xs` and `ys` differ
/// in length.
pub fn matmul_each(
    ws: &[WeightRows<'_>],
    k: usize,
    xs: &[&[f32]],
    ys: &mut [&mut [f32]],
    mode: MatmulMode,
) -> Result<(), QuantError> {
    for (what, got) in [("activations", xs.len()), ("outputs", ys.len())] {
        if got != ws.len() {
            return Err(QuantError::ShapeMismatch { op: "matmul_each", what, expected: ws.len(), got });
        }
    }
    let kernel = Kernel::best();
    let kind = ws.first().and_then(|w| ActKind::for_weights(w.dtype));
    let fused = mode == MatmulMode::QuantizedActivations
        && kind.is_some()
        && xs.iter().all(|x| x.len() == k)
        && ws.iter().all(|w| ActKind::for_weights(w.dtype) == kind && Tiles::new(w.dtype, kernel).is_some());
    let (Some(kind), true) = (kind, fused) else {
        for ((w, x), y) in ws.iter().zip(xs).zip(ys.iter_mut()) {
            matmul(w.dtype, w.bytes, w.n_out, k, x, y, mode)?;
        }
        return Ok(());
    };
    let mut parts = Vec::with_capacity(ws.len());
    let mut acts = Vec::with_capacity(ws.len());
    for ((w, x), y) in ws.iter().zip(xs).zip(ys.iter_mut()) {
        let Some(shape) = check_shapes(w.dtype, w.bytes, w.n_out, k, x, y)? else { continue };
        let Some(tiles) = Tiles::new(w.dtype, kernel) else { continue };
        parts.push(DecodePart::new(tiles, w.bytes, w.n_out, shape.row_bytes, SharedOut(y.as_mut_ptr())));
        let mut act = ActBuf::default();
        act.quantize(kind, x, k);
        acts.push(act);
    }
    let nb = k / kind.block_elems();
    decode_parts(&parts, nb, k, |i| acts[i].row(kind, 0, k));
    Ok(())
}

/// The element-wise step [`matmul_gated`] applies to each range of rows: `(gate, up, out)`.
pub type GateCombine<'a> = dyn Fn(&[f32], &[f32], &mut [f32]) + Sync + 'a;

/// `out = combine(x · gateᵀ, x · upᵀ)` for one token: a gated feed-forward block's two
/// products and its gating in one parallel region.
///
/// Each task computes a range of rows of both products (into `gate_out` and `up_out`, with the
/// bits [`matmul_many`] gives) and then calls `combine(gate, up, out)` on that range, so the
/// gating runs spread over the threads while the products stream, instead of on one thread
/// after them. Ranges start at multiples of eight rows, so an element-wise `combine` that
/// works in groups of eight from the start of its slices gives the bits of one call over the
/// whole rows.
///
/// Returns `Ok(false)`, computing nothing, when the inputs are not one token of quantized
/// activations over two weights of one shape with multi-row kernels (the caller then runs the
/// products and the gating separately).
///
/// # Errors
/// As [`matmul`] for each weight; [`QuantError::ShapeMismatch`] when an output's length is not
/// the weights' row count.
#[allow(clippy::too_many_arguments)]
pub fn matmul_gated(
    gate: WeightRows<'_>,
    up: WeightRows<'_>,
    k: usize,
    x: &[f32],
    gate_out: &mut [f32],
    up_out: &mut [f32],
    out: &mut [f32],
    mode: MatmulMode,
    combine: &GateCombine<'_>,
) -> Result<bool, QuantError> {
    let kernel = Kernel::best();
    let kind = ActKind::for_weights(gate.dtype);
    let (Some(kind), Some(gate_tiles), Some(up_tiles)) =
        (kind, Tiles::new(gate.dtype, kernel), Tiles::new(up.dtype, kernel))
    else {
        return Ok(false);
    };
    if mode != MatmulMode::QuantizedActivations
        || x.len() != k
        || gate.n_out != up.n_out
        || ActKind::for_weights(up.dtype) != Some(kind)
    {
        return Ok(false);
    }
    let n_out = gate.n_out;
    if out.len() != n_out {
        return Err(QuantError::ShapeMismatch { op: "matmul_gated", what: "out", expected: n_out, got: out.len() });
    }
    let Some(gate_shape) = check_shapes(gate.dtype, gate.bytes, n_out, k, x, gate_out)? else {
        // Nothing to multiply: every product is an empty sum (k = 0) or there are no rows.
        check_shapes(up.dtype, up.bytes, n_out, k, x, up_out)?;
        combine(gate_out, up_out, out);
        return Ok(true);
    };
    let Some(up_shape) = check_shapes(up.dtype, up.bytes, n_out, k, x, up_out)? else { return Ok(false) };
    let (g, u, o) = (SharedOut(gate_out.as_mut_ptr()), SharedOut(up_out.as_mut_ptr()), SharedOut(out.as_mut_ptr()));
    let gate_part = DecodePart::new(gate_tiles, gate.bytes, n_out, gate_shape.row_bytes, g);
    let up_part = DecodePart::new(up_tiles, up.bytes, n_out, up_shape.row_bytes, u);
    let mut act = ACT_BUF.with(|cell| cell.take());
    act.quantize(kind, x, k);
    let nb = k / kind.block_elems();
    let xr = act.row(kind, 0, k);
    let share = |start: usize, end: usize| {
        gate_part.run(start, end, nb, xr);
        up_part.run(start, end, nb, xr);
        let len = end.min(n_out) - start;
        // SAFETY: rows start..start + len of the three outputs belong to this share alone
        // (shares are disjoint), their writes above are done, and the borrows of the outputs
        // outlive the parallel loop.
        let (gs, us, os) = unsafe {
            (
                std::slice::from_raw_parts(g.at(start), len),
                std::slice::from_raw_parts(u.at(start), len),
                std::slice::from_raw_parts_mut(o.at(start), len),
            )
        };
        combine(gs, us, os);
    };
    run_claims(n_out, gate_shape.row_bytes + up_shape.row_bytes, 2 * n_out * k, share);
    ACT_BUF.with(|cell| cell.replace(act));
    Ok(true)
}

/// [`matmul_quantized`] one weight row at a time (four tokens per kernel call in prefill).
#[allow(clippy::too_many_arguments)]
fn matmul_rows(
    dtype: GgmlType,
    kind: ActKind,
    kernel: Kernel,
    act: &ActBuf,
    w: &[u8],
    n_out: usize,
    k: usize,
    n_tok: usize,
    row_bytes: usize,
    y: &mut [f32],
) {
    let shape = Shape { row_bytes, n_tok };
    let qdot = QDot::new(dtype, kernel);
    // Rows per task: decode wants a few tasks per thread (balance without paying the pool's
    // hand-off for every handful of rows); prefill wants a block of rows reused across a tile
    // of tokens.
    let rows_per_task = if n_tok == 1 {
        n_out.div_ceil(8 * rayon::current_num_threads().max(1)).max(8)
    } else {
        (ROW_BLOCK_BYTES / shape.row_bytes).clamp(1, MAX_ROWS_PER_TASK)
    };
    let out = SharedOut(y.as_mut_ptr());
    let task = |task_index: usize| {
        let o_start = task_index * rows_per_task;
        let o_end = (o_start + rows_per_task).min(n_out);
        for t0 in (0..n_tok).step_by(TOKENS_PER_TILE) {
            let t1 = (t0 + TOKENS_PER_TILE).min(n_tok);
            for o in o_start..o_end {
                let row = &w[o * shape.row_bytes..(o + 1) * shape.row_bytes];
                let mut t = t0;
                while t + 4 <= t1 {
                    let xs = [
                        act.row(kind, t, k),
                        act.row(kind, t + 1, k),
                        act.row(kind, t + 2, k),
                        act.row(kind, t + 3, k),
                    ];
                    for (i, value) in qdot.dot4(row, &xs).into_iter().enumerate() {
                        // SAFETY: `t + i < n_tok` and `o < n_out`, so the index is inside `y`
                        // (len n_tok * n_out); this task alone owns rows o_start..o_end.
                        unsafe { *out.at((t + i) * n_out + o) = value };
                    }
                    t += 4;
                }
                for t in t..t1 {
                    let value = qdot.dot(row, act.row(kind, t, k));
                    // SAFETY: as above.
                    unsafe { *out.at(t * n_out + o) = value };
                }
            }
        }
    };
    run_tasks(n_out.div_ceil(rows_per_task), n_out * k * n_tok, task);
}

/// Encoded bytes of weight rows per prefill task (fits L2 next to a tile of activations).
const ROW_BLOCK_BYTES: usize = 64 * 1024;

fn run_tasks(n_tasks: usize, work: usize, task: impl Fn(usize) + Sync + Send) {
    if work < SERIAL_WORK || n_tasks == 1 {
        (0..n_tasks).for_each(task);
    } else {
        (0..n_tasks).into_par_iter().for_each(task);
    }
}

struct Shape {
    row_bytes: usize,
    n_tok: usize,
}

/// Validates a matmul's operands. `Ok(None)` means there is nothing to compute (and `y`, if
/// any, has been zeroed for `k == 0`).
fn check_shapes(
    dtype: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<Option<Shape>, QuantError> {
    let block_elems = dtype.block_elems();
    if !k.is_multiple_of(block_elems) {
        return Err(QuantError::NotWholeBlocks { dtype, n_values: k, block_elems });
    }
    let row_bytes = k / block_elems * dtype.block_bytes();
    check_encoded(dtype, n_out.saturating_mul(k), w.len())?;
    // With k == 0 the token count comes from y alone (every output is an empty sum).
    let n_tok = match (k, n_out) {
        (0, 0) => 0,
        (0, _) => y.len() / n_out,
        _ => x.len() / k,
    };
    if x.len() != n_tok * k {
        return Err(QuantError::RaggedRows { op: "matmul", what: "x", row_len: k, got: x.len() });
    }
    if y.len() != n_tok * n_out {
        return Err(QuantError::ShapeMismatch { op: "matmul", what: "y", expected: n_tok * n_out, got: y.len() });
    }
    if k == 0 {
        y.fill(0.0);
        return Ok(None);
    }
    if n_tok == 0 || n_out == 0 {
        return Ok(None);
    }
    Ok(Some(Shape { row_bytes, n_tok }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Claims hand out every row once, in order, in whole groups of eight (a last share may end
    /// at the odd row count), shrinking from `1 / (2 n_threads)` of the rows down to the minimum
    /// share and never below it except for the remainder.
    #[test]
    fn claims_partition_the_rows_in_shrinking_shares() {
        for (n_rows, row_bytes, n_threads) in
            [(8192, 2304, 2), (3072, 1152, 2), (13, 1152, 2), (128_256, 1152, 4), (1, 64, 8)]
        {
            let claims = Claims::new(n_rows, row_bytes, n_threads);
            let min_rows = (MIN_CLAIM_BYTES / row_bytes).next_multiple_of(8).max(8);
            let mut shares = Vec::new();
            while let Some(share) = claims.claim() {
                shares.push(share);
            }
            assert_eq!(shares.first().map(|s| s.0), Some(0), "{n_rows} rows");
            assert_eq!(shares.last().map(|s| s.1), Some(n_rows), "{n_rows} rows");
            for (i, &(start, end)) in shares.iter().enumerate() {
                let len = end - start;
                assert!(start % 8 == 0 && len > 0, "{n_rows} rows: share {start}..{end}");
                if end < n_rows {
                    assert!(len % 8 == 0 && len >= min_rows, "{n_rows} rows: share {start}..{end} (min {min_rows})");
                }
                if i > 0 {
                    let (prev_start, prev_end) = shares[i - 1];
                    assert_eq!(prev_end, start, "{n_rows} rows: gap or overlap");
                    assert!(len <= prev_end - prev_start, "{n_rows} rows: share {i} grew");
                }
            }
            let first = shares[0].1 - shares[0].0;
            let want_first = (n_rows / (2 * n_threads)).max(min_rows).next_multiple_of(8).min(n_rows);
            assert_eq!(first, want_first, "{n_rows} rows, {n_threads} threads");
        }
    }

    /// Inside a polled step (where the region goes to the pollers, `warm::broadcast`) and
    /// outside one, every row is computed exactly once, and a one-token product gives the same
    /// bits either way, on pools of 2 to 4 threads.
    #[test]
    fn a_product_in_a_step_computes_every_row_once() {
        use std::sync::atomic::AtomicU32;
        let (n_out, k) = (1000usize, 2048usize);
        let mut next = crate::test_uniform();
        let wf: Vec<f32> = (0..n_out * k).map(|_| next()).collect();
        let x: Vec<f32> = (0..k).map(|_| next()).collect();
        let t = GgmlType::Q8_0;
        let mut w = vec![0u8; n_out * k / t.block_elems() * t.block_bytes()];
        crate::quant::quantize(t, &wf, &mut w).unwrap();
        let product = || {
            let mut y = vec![0f32; n_out];
            matmul_quantized(t, &w, n_out, k, &x, &mut y, Kernel::best()).unwrap();
            y
        };
        let want = product();
        for n in 2..=4 {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
            for round in 0..20 {
                let counts: Vec<AtomicU32> = (0..n_out).map(|_| AtomicU32::new(0)).collect();
                let got = pool.install(|| {
                    crate::cpu::warm::run_step(|| {
                        run_claims(n_out, 1024, usize::MAX, |start, end| {
                            counts[start..end].iter().for_each(|c| {
                                c.fetch_add(1, Ordering::Relaxed);
                            })
                        });
                        product()
                    })
                });
                assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "{n} threads, round {round}");
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{n} threads, round {round}: other bits in a step");
            }
        }
    }

    /// The AVX2 reference dot product computes the portable one's bits, tails included.
    #[test]
    fn avx2_dot_f32_matches_portable_bits() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            let mut next = crate::test_uniform();
            for n in [0, 1, 7, 31, 32, 33, 64, 100, 4096, 4099] {
                let a: Vec<f32> = (0..n).map(|_| next()).collect();
                let b: Vec<f32> = (0..n).map(|_| next() * 1e3).collect();
                let want = dot_f32_lanes(&a, &b);
                // SAFETY: AVX2 was detected above.
                let got = unsafe { dot_f32_avx2(&a, &b) };
                assert_eq!(got.to_bits(), want.to_bits(), "n={n}: {got} vs {want}");
            }
            return;
        }
        println!("no AVX2 on this CPU: only the portable dot product exists");
    }
}
