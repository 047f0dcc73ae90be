//! The fast attention path: KV cache storage in f32 or f16 and a fused per-head kernel (scores,
//! softmax and the weighted sum of values in one pass over a head's cached rows), with AVX2
//! dot products and f16 conversion (F16C) when the CPU has them.
//!
//! [`super::kernels::attend_one`] stays the reference: on an f32 cache this path differs from it
//! only by the order of the additions inside a dot product; on an f16 cache it equals the
//! reference run on keys and values rounded to f16 (llama.cpp's default cache type), up to the
//! same reordering.

use crate::spec::AttnSpec;
use half::f16;
use std::cell::RefCell;

/// Element type of the attention KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvType {
    /// 32-bit floats: the exact reference.
    #[default]
    F32,
    /// IEEE half floats (round to nearest even), as llama.cpp's default `-ctk f16 -ctv f16`:
    /// half the memory and bandwidth of F32.
    F16,
}

impl KvType {
    /// Bytes per cached value.
    pub fn size_bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }
}

/// Keys and values of one layer, `n_ctx` rows each.
#[derive(Clone, Debug)]
pub(crate) enum KvRows {
    F32 { k: Vec<f32>, v: Vec<f32> },
    F16 { k: Vec<u16>, v: Vec<u16> },
}

impl KvRows {
    pub(crate) fn new(kv_type: KvType, k_len: usize, v_len: usize) -> KvRows {
        match kv_type {
            KvType::F32 => KvRows::F32 { k: vec![0.0; k_len], v: vec![0.0; v_len] },
            KvType::F16 => KvRows::F16 { k: vec![0; k_len], v: vec![0; v_len] },
        }
    }

    pub(crate) fn kv_type(&self) -> KvType {
        match self {
            KvRows::F32 { .. } => KvType::F32,
            KvRows::F16 { .. } => KvType::F16,
        }
    }

    pub(crate) fn n_values(&self) -> usize {
        match self {
            KvRows::F32 { k, v } => k.len() + v.len(),
            KvRows::F16 { k, v } => k.len() + v.len(),
        }
    }

    /// Stores `k` at key offset `k_at` and `v` at value offset `v_at` (in values).
    pub(crate) fn write(&mut self, k_at: usize, k_src: &[f32], v_at: usize, v_src: &[f32]) {
        match self {
            KvRows::F32 { k, v } => {
                k[k_at..k_at + k_src.len()].copy_from_slice(k_src);
                v[v_at..v_at + v_src.len()].copy_from_slice(v_src);
            }
            KvRows::F16 { k, v } => {
                let simd = Simd::detect();
                to_f16(simd, k_src, &mut k[k_at..k_at + k_src.len()]);
                to_f16(simd, v_src, &mut v[v_at..v_at + v_src.len()]);
            }
        }
    }
}

/// Which instruction set the kernels use, decided once per op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Simd {
    /// AVX2 + FMA + F16C.
    // Only x86-64 builds pick it; elsewhere it is matched but never made.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    /// Plain Rust (what the compiler vectorises for the build target).
    Portable,
}

impl Simd {
    pub(crate) fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            return Simd::Avx2;
        }
        Simd::Portable
    }
}

/// A cached element type the kernels read.
pub(crate) trait KvElem: Copy + Send + Sync {
    /// True for f16 bits (`u16`), false for f32: how the AVX2 passes load eight values.
    // Only the x86-64 passes read it.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const HALF: bool;
    /// `q · k`.
    fn dot(simd: Simd, q: &[f32], k: &[Self]) -> f32;
    /// `out += p * v`.
    fn axpy(simd: Simd, out: &mut [f32], p: f32, v: &[Self]);
}

impl KvElem for f32 {
    const HALF: bool = false;
    fn dot(simd: Simd, q: &[f32], k: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx2 {
            // SAFETY: `Simd::Avx2` is only produced after detecting AVX2, FMA and F16C.
            return unsafe { avx2::dot_f32(q, k) };
        }
        let _ = simd;
        q.iter().zip(k).map(|(a, b)| a * b).sum()
    }

    fn axpy(simd: Simd, out: &mut [f32], p: f32, v: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx2 {
            // SAFETY: as in `dot`.
            return unsafe { avx2::axpy_f32(out, p, v) };
        }
        let _ = simd;
        out.iter_mut().zip(v).for_each(|(o, &v)| *o += p * v);
    }
}

impl KvElem for u16 {
    const HALF: bool = true;
    fn dot(simd: Simd, q: &[f32], k: &[u16]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx2 {
            // SAFETY: as for f32.
            return unsafe { avx2::dot_f16(q, k) };
        }
        let _ = simd;
        q.iter().zip(k).map(|(a, &b)| a * f16::from_bits(b).to_f32()).sum()
    }

    fn axpy(simd: Simd, out: &mut [f32], p: f32, v: &[u16]) {
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx2 {
            // SAFETY: as for f32.
            return unsafe { avx2::axpy_f16(out, p, v) };
        }
        let _ = simd;
        out.iter_mut().zip(v).for_each(|(o, &v)| *o += p * f16::from_bits(v).to_f32());
    }
}

/// Rounds `src` to f16 bits (nearest even, as `half` and F16C's `_mm256_cvtps_ph` both do).
pub(crate) fn to_f16(simd: Simd, src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2 {
        // SAFETY: as for the dot products.
        return unsafe { avx2::to_f16(src, dst) };
    }
    let _ = simd;
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f16::from_f32(s).to_bits());
}

thread_local! {
    /// Scores of the head being computed: one per attended position.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One layer's cache as the kernel reads it.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a, T> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub k_width: usize,
    pub v_width: usize,
}

/// Attention of one query head at position `pos` over `rows`, into `out` (`head_dim_v`): the
/// same formula as [`super::kernels::attend_one`] (window, soft-cap, sink), computed in three passes
/// over a per-thread score buffer: dot products, exponentials, weighted values.
// Eight inputs, each needed: the query, the cache, which head and position, the spec, the
// sink, the instruction set and the output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_head<T: KvElem>(
    simd: Simd,
    q: &[f32],
    rows: Rows<'_, T>,
    head: usize,
    pos: usize,
    spec: &AttnSpec,
    sink: Option<f32>,
    out: &mut [f32],
) {
    let kv_head = head / (spec.n_head / spec.n_head_kv);
    let lo = match spec.window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    };
    let (hd_k, hd_v) = (spec.head_dim_k, spec.head_dim_v);
    SCORES.with(|scores| {
        let mut scores = scores.borrow_mut();
        scores.clear();
        // Room for the whole context at once, so that decode does not reallocate each time
        // the context passes a power of two.
        scores.reserve(rows.k.len() / rows.k_width.max(1));
        let mut max = f32::NEG_INFINITY;
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx2 && hd_k.is_multiple_of(16) {
            scores.resize(pos + 1 - lo, 0.0);
            // SAFETY: `Simd::Avx2` is only produced after detecting AVX2, FMA and F16C; rows
            // lo..=pos of the cache hold a key at `kv_head * hd_k` (the caller's contract, which
            // the slicing of the portable loop below checks).
            unsafe { avx2::dots(q, rows.k, rows.k_width, kv_head * hd_k, lo, &mut scores) };
        } else {
            for j in lo..=pos {
                let kj = &rows.k[j * rows.k_width + kv_head * hd_k..][..hd_k];
                scores.push(T::dot(simd, q, kj));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        for j in lo..=pos {
            let kj = &rows.k[j * rows.k_width + kv_head * hd_k..][..hd_k];
            scores.push(T::dot(simd, q, kj));
        }
        if let Some(cap) = spec.softcap {
            for s in scores.iter_mut() {
                *s *= spec.scale;
                *s = cap * (*s / cap).tanh();
                max = max.max(*s);
            }
        } else {
            let done = scale_max_vectorised(simd, &mut scores, spec.scale, &mut max);
            for s in scores[done..].iter_mut() {
                *s *= spec.scale;
                max = max.max(*s);
            }
        }
        if let Some(s) = sink {
            max = max.max(s);
        }
        let mut denom = sink.map_or(0.0, |s| (s - max).exp());
        let (sum, done) = exp_sub_vectorised(simd, &mut scores, max);
        denom += sum;
        for s in scores[done..].iter_mut() {
            *s = (*s - max).exp();
            denom += *s;
        }
        let inv = 1.0 / denom;
        out.iter_mut().for_each(|o| *o = 0.0);
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx2 && hd_v.is_multiple_of(64) && out.len() == hd_v {
            // Bounds as for the keys: the last row read is `pos`.
            assert!(pos * rows.v_width + kv_head * hd_v + hd_v <= rows.v.len(), "value cache too short");
            // SAFETY: as for the dot products; every row lo..=pos holds `hd_v` values at
            // `kv_head * hd_v` (asserted just above for the last one).
            unsafe { avx2::weighted_sum(rows.v, rows.v_width, kv_head * hd_v, lo, &scores, inv, out) };
            return;
        }
        for (idx, j) in (lo..=pos).enumerate() {
            let vj = &rows.v[j * rows.v_width + kv_head * hd_v..][..hd_v];
            T::axpy(simd, out, scores[idx] * inv, vj);
        }
    });
}

/// `s *= scale` for the leading scores the vector unit takes, `max` raised to their largest;
/// how many were done (none without AVX2). With `f32::max` in the scalar loop, every step
/// waited on the last and nothing vectorised: 4% of a 1B model's 512-token prefill.
#[allow(unused_variables)]
fn scale_max_vectorised(simd: Simd, scores: &mut [f32], scale: f32, max: &mut f32) -> usize {
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2 {
        // SAFETY: `Simd::Avx2` is only produced after detecting AVX2, FMA and F16C.
        let (m, done) = unsafe { avx2::scale_max(scores, scale) };
        *max = max.max(m);
        return done;
    }
    0
}

/// `s = exp(s - max)` for the leading scores the vector unit takes: their sum and count
/// (nothing without AVX2).
#[allow(unused_variables)]
fn exp_sub_vectorised(simd: Simd, scores: &mut [f32], max: f32) -> (f32, usize) {
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx2 {
        // SAFETY: `Simd::Avx2` is only produced after detecting AVX2, FMA and F16C.
        return unsafe { avx2::exp_sub(scores, max) };
    }
    (0.0, 0)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::KvElem;
    use std::arch::x86_64::*;

    /// Eight cached values at `p` as f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<T: KvElem>(p: *const T) -> __m256 {
        if T::HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            _mm256_loadu_ps(p as *const f32)
        }
    }

    /// `scores[i] = q · k_(lo + i)` for every score, where key `j` is the `q.len()` values at
    /// `j * width + offset` of `k`: for each key exactly the operations of [`dot_f32`] /
    /// [`dot_f16`] (two accumulators over sixteen values, then the same horizontal sum), inlined
    /// and two keys at a time. `q.len()` must be a multiple of 16. Called once per query head,
    /// this replaced a call per key, which with its dispatch cost about as much as the 64-value
    /// dot product itself (4-8% of a 1B model's decode at contexts of 128-256).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; keys `lo..lo + scores.len()` must lie inside `k`
    /// (checked).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dots<T: KvElem>(
        q: &[f32],
        k: &[T],
        width: usize,
        offset: usize,
        lo: usize,
        scores: &mut [f32],
    ) {
        let n = q.len();
        debug_assert!(n.is_multiple_of(16));
        let n_keys = scores.len();
        if n_keys == 0 {
            return;
        }
        assert!((lo + n_keys - 1) * width + offset + n <= k.len(), "key cache too short");
        let (pq, pk) = (q.as_ptr(), k.as_ptr().add(lo * width + offset));
        let ps = scores.as_mut_ptr();
        // SAFETY (all loads): key j's values are inside `k` (asserted above), q has n values.
        let mut j = 0;
        while j + 2 <= n_keys {
            let (k0, k1) = (pk.add(j * width), pk.add((j + 1) * width));
            let (mut a0, mut a1, mut b0, mut b1) =
                (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
            for i in (0..n).step_by(16) {
                let (q0, q1) = (_mm256_loadu_ps(pq.add(i)), _mm256_loadu_ps(pq.add(i + 8)));
                a0 = _mm256_fmadd_ps(q0, load8(k0.add(i)), a0);
                a1 = _mm256_fmadd_ps(q1, load8(k0.add(i + 8)), a1);
                b0 = _mm256_fmadd_ps(q0, load8(k1.add(i)), b0);
                b1 = _mm256_fmadd_ps(q1, load8(k1.add(i + 8)), b1);
            }
            *ps.add(j) = hsum(_mm256_add_ps(a0, a1));
            *ps.add(j + 1) = hsum(_mm256_add_ps(b0, b1));
            j += 2;
        }
        if j < n_keys {
            let k0 = pk.add(j * width);
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for i in (0..n).step_by(16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(i)), load8(k0.add(i)), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(i + 8)), load8(k0.add(i + 8)), a1);
            }
            *ps.add(j) = hsum(_mm256_add_ps(a0, a1));
        }
    }

    /// `out = sum_i (scores[i] * inv) * v_(lo + i)` with value row `j` at `j * width + offset`
    /// of `v`: per output value the fused multiply-adds of [`axpy_f32`] / [`axpy_f16`] in the
    /// same order, with the output held in eight registers (64 values) across all rows instead
    /// of loaded and stored once per row. `out.len()` must be a multiple of 64 and start at
    /// zero.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; rows `lo..lo + scores.len()` must hold
    /// `out.len()` values at `offset` inside `v`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weighted_sum<T: KvElem>(
        v: &[T],
        width: usize,
        offset: usize,
        lo: usize,
        scores: &[f32],
        inv: f32,
        out: &mut [f32],
    ) {
        let pv = v.as_ptr().add(lo * width + offset);
        for c in (0..out.len()).step_by(64) {
            let po = out.as_mut_ptr().add(c);
            let mut acc: [__m256; 8] = std::array::from_fn(|r| _mm256_loadu_ps(po.add(8 * r)));
            for (idx, &s) in scores.iter().enumerate() {
                let p = _mm256_set1_ps(s * inv);
                let row = pv.add(idx * width + c);
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(p, load8(row.add(8 * r)), *a);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(po.add(8 * r), *a);
            }
        }
    }

    /// `s = exp(s - max)` for the whole groups of eight of `scores` (the softmax numerators,
    /// with the polynomial exp of the tanh-GELU: a scalar `expf` per score was 5% of a Gemma 3
    /// 270M prefill of 512 tokens); returns their sum and how many were done.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn exp_sub(scores: &mut [f32], max: f32) -> (f32, usize) {
        let n = scores.len() / 8 * 8;
        let p = scores.as_mut_ptr();
        let m = _mm256_set1_ps(max);
        let mut sum = _mm256_setzero_ps();
        // SAFETY (loads and stores): every index is below n <= scores.len().
        for i in (0..n).step_by(8) {
            let e = super::super::gelu::avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m));
            _mm256_storeu_ps(p.add(i), e);
            sum = _mm256_add_ps(sum, e);
        }
        (hsum(sum), n)
    }

    /// `s *= scale` for the whole groups of eight of `scores` (the same products as the
    /// scalar loop) and their maximum (`-inf` for none), with how many were done. `maxps`
    /// returns its second operand when the first is NaN, so a NaN score is skipped as
    /// `f32::max` skips it; the maximum does not depend on the order (but for the sign of a
    /// zero, which `s - max` does not see).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scale_max(scores: &mut [f32], scale: f32) -> (f32, usize) {
        let n = scores.len() / 8 * 8;
        let p = scores.as_mut_ptr();
        let sc = _mm256_set1_ps(scale);
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        // SAFETY (loads and stores): every index is below n <= scores.len().
        for i in (0..n).step_by(8) {
            let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), sc);
            _mm256_storeu_ps(p.add(i), v);
            m = _mm256_max_ps(v, m);
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        (lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)), n)
    }

    /// Sum of the 8 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
        _mm_cvtss_f32(s1)
    }

    /// `q · k` over `min(q.len(), k.len())` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f32(q: &[f32], k: &[f32]) -> f32 {
        let n = q.len().min(k.len());
        let (pq, pk) = (q.as_ptr(), k.as_ptr());
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        // SAFETY (all loads): every index read is below n.
        while i + 16 <= n {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(i)), _mm256_loadu_ps(pk.add(i)), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(i + 8)), _mm256_loadu_ps(pk.add(i + 8)), a1);
            i += 16;
        }
        if i + 8 <= n {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(i)), _mm256_loadu_ps(pk.add(i)), a0);
            i += 8;
        }
        let mut sum = hsum(_mm256_add_ps(a0, a1));
        while i < n {
            sum += *pq.add(i) * *pk.add(i);
            i += 1;
        }
        sum
    }

    /// `q · k` with `k` in f16 bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(q: &[f32], k: &[u16]) -> f32 {
        let n = q.len().min(k.len());
        let (pq, pk) = (q.as_ptr(), k.as_ptr());
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        // SAFETY (all loads): every index read is below n; 8 u16 are 128 bits.
        while i + 16 <= n {
            let k0 = _mm256_cvtph_ps(_mm_loadu_si128(pk.add(i) as *const __m128i));
            let k1 = _mm256_cvtph_ps(_mm_loadu_si128(pk.add(i + 8) as *const __m128i));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(i)), k0, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(i + 8)), k1, a1);
            i += 16;
        }
        if i + 8 <= n {
            let k0 = _mm256_cvtph_ps(_mm_loadu_si128(pk.add(i) as *const __m128i));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(pq.add(i)), k0, a0);
            i += 8;
        }
        let mut sum = hsum(_mm256_add_ps(a0, a1));
        while i < n {
            sum += *pq.add(i) * half::f16::from_bits(*pk.add(i)).to_f32();
            i += 1;
        }
        sum
    }

    /// `out += p * v` over `min(out.len(), v.len())` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_f32(out: &mut [f32], p: f32, v: &[f32]) {
        let n = out.len().min(v.len());
        let (po, pv) = (out.as_mut_ptr(), v.as_ptr());
        let pp = _mm256_set1_ps(p);
        let mut i = 0;
        // SAFETY (all loads and stores): every index is below n.
        while i + 8 <= n {
            let o = _mm256_fmadd_ps(pp, _mm256_loadu_ps(pv.add(i)), _mm256_loadu_ps(po.add(i)));
            _mm256_storeu_ps(po.add(i), o);
            i += 8;
        }
        while i < n {
            *po.add(i) += p * *pv.add(i);
            i += 1;
        }
    }

    /// `out += p * v` with `v` in f16 bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy_f16(out: &mut [f32], p: f32, v: &[u16]) {
        let n = out.len().min(v.len());
        let (po, pv) = (out.as_mut_ptr(), v.as_ptr());
        let pp = _mm256_set1_ps(p);
        let mut i = 0;
        // SAFETY (all loads and stores): every index is below n.
        while i + 8 <= n {
            let vv = _mm256_cvtph_ps(_mm_loadu_si128(pv.add(i) as *const __m128i));
            let o = _mm256_fmadd_ps(pp, vv, _mm256_loadu_ps(po.add(i)));
            _mm256_storeu_ps(po.add(i), o);
            i += 8;
        }
        while i < n {
            *po.add(i) += p * half::f16::from_bits(*pv.add(i)).to_f32();
            i += 1;
        }
    }

    /// f32 to f16 bits, round to nearest even, over `min(src.len(), dst.len())` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn to_f16(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        // SAFETY (all loads and stores): every index is below n.
        while i + 8 <= n {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(ps.add(i)));
            _mm_storeu_si128(pd.add(i) as *mut __m128i, h);
            i += 8;
        }
        while i < n {
            *pd.add(i) = half::f16::from_f32(*ps.add(i)).to_bits();
            i += 1;
        }
    }
}
