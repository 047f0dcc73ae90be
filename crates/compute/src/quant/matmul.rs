//! The parallel matrix product `y[t][o] = sum_k x[t][k] * W[o][k]` over encoded weight rows.
//!
//! Work is split over blocks of output rows (rayon). Each task dequantizes its rows once into
//! thread-local scratch and then takes every token's dot product against them, so a weight row
//! is read once per call whatever the token count, and nothing is allocated per row.

use std::cell::RefCell;

use gguf::GgmlType;
use rayon::prelude::*;

use super::{check_encoded, dequantizer, QuantError};

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
/// added, so a SIMD build with any register width up to `LANES` computes the same bits.
const LANES: usize = 16;

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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    // Same code, compiled with 256-bit registers. No FMA: Rust never contracts mul+add, so
    // the result is bit-identical to the portable build.
    dot_f32_lanes(a, b)
}

/// The reference f32 dot product of the first `min(a.len(), b.len())` values.
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
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
/// # Errors
/// [`QuantError::Unsupported`] for a type without a decoder, [`QuantError::NotWholeBlocks`]
/// when `k` is not a multiple of the block size, [`QuantError::SizeMismatch`] when `w` is not
/// `n_out` encoded rows, [`QuantError::ShapeMismatch`] when `x` is not whole rows of `k` or `y`
/// not `n_tok x n_out`.
pub fn matmul(
    dtype: GgmlType,
    w: &[u8],
    n_out: usize,
    k: usize,
    x: &[f32],
    y: &mut [f32],
    mode: MatmulMode,
) -> Result<(), QuantError> {
    let dequantize_row = dequantizer(dtype).ok_or(QuantError::Unsupported {
        dtype,
        op: "matmul",
    })?;
    let block_elems = dtype.block_elems();
    if !k.is_multiple_of(block_elems) {
        return Err(QuantError::NotWholeBlocks {
            dtype,
            n_values: k,
            block_elems,
        });
    }
    let row_bytes = k / block_elems * dtype.block_bytes();
    let w_values = n_out.saturating_mul(k);
    check_encoded(dtype, w_values, w.len())?;
    // With k == 0 the token count comes from y alone (every output is an empty sum).
    let n_tok = match (k, n_out) {
        (0, 0) => 0,
        (0, _) => y.len() / n_out,
        _ => x.len() / k,
    };
    if x.len() != n_tok * k {
        return Err(QuantError::RaggedRows {
            op: "matmul",
            what: "x",
            row_len: k,
            got: x.len(),
        });
    }
    if y.len() != n_tok * n_out {
        return Err(QuantError::ShapeMismatch {
            op: "matmul",
            what: "y",
            expected: n_tok * n_out,
            got: y.len(),
        });
    }
    if k == 0 {
        y.fill(0.0);
        return Ok(());
    }
    if n_tok == 0 || n_out == 0 {
        return Ok(());
    }
    // The quantized-activation kernels are not in yet: both modes compute the reference.
    let _ = mode;

    let rows_per_task = (ROW_BLOCK_VALUES / k.max(1)).clamp(1, MAX_ROWS_PER_TASK);
    let n_tasks = n_out.div_ceil(rows_per_task);
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
            dequantize_row(&w[o_start * row_bytes..o_end * row_bytes], rows);
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
    if n_out * k * n_tok < SERIAL_WORK || n_tasks == 1 {
        (0..n_tasks).for_each(task);
    } else {
        (0..n_tasks).into_par_iter().for_each(task);
    }
    Ok(())
}
