//! One token through a mixture-of-experts layer's experts in a single parallel region.
//!
//! Why: the products of a decode step's experts are small (Qwen3-30B-A3B's are 0.88 MB each)
//! and a parallel region costs the pool's fork and join: on the H200 host's 16 cores a lone
//! 768 x 2048 Q4_K product ran at 40 GB/s from RAM and 55 from cache where large products reach
//! 96 and 162 (sixteenth session, docs/NOTES.md), i.e. ~10-13 us of each region is overhead.
//! Computing the experts as two regions (every gate and up product, then every down product)
//! also left the threads idle at the first region's end and ran the gating and the
//! quantization of its results on one thread between the two. Here the threads claim the
//! gate/up rows of every expert first and then the down rows, in one region (each thread its
//! own stripe of each expert's rows first, [`OwnedClaims`], then what others left): the
//! thread that finishes an expert's last gate/up rows quantizes its gated row, and a thread
//! that claims down rows of an expert whose row is not ready yet spins until it is.
//!
//! Why the spin cannot deadlock: gate/up rows are all claimed before any down row (a thread
//! turns to the down rows only when the gate/up claims are exhausted), so every gate/up row an
//! expert still waits for has been claimed by a thread that is computing it and waits for
//! nothing. A thread that panics there marks the region aborted, and the spinners return.

use super::{check_shapes, Claims, DecodePart, SharedOut};
use crate::quant::qdot::{quantize_row, ActBuf, ActKind, ActRow};
use crate::quant::simd::{Kernel, Tiles};
use crate::quant::{MatmulMode, QuantError, WeightRows};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

/// Weight bytes of the smallest share a thread claims in the experts' region, a quarter of
/// the other products' [`super::MIN_CLAIM_BYTES`]: the region's tasks ended 17 us apart on the
/// H200's 16 threads with 64 KiB shares (~13 us of work each at the ~5 GB/s a thread streams
/// there), and that spread waits at the join. One claim is one atomic add. With the spinning
/// join below: the split's decode 58.0-59.6 tok/s against 54.8-57.1 (alternating, H200,
/// twentieth session).
const MIN_CLAIM_BYTES: usize = 16 * 1024;

/// `DISKFORMER_EXPERTS_REGION=old`: the region as before the twentieth session (64 KiB
/// shares, rayon's `for_each` join), for A/B runs. Read once.
fn old_region() -> bool {
    static OLD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OLD.get_or_init(|| std::env::var("DISKFORMER_EXPERTS_REGION").is_ok_and(|v| v.trim() == "old"))
}

/// Whether the region's tasks are spawned into rayon's deque (as before the thirty-fifth
/// session) rather than broadcast to the step's polling workers ([`crate::cpu::warm::broadcast`],
/// used whenever the call runs inside a polled step): `DISKFORMER_EXPERTS_REGION=spawn`, or
/// the A/B name `spawned` on B steps.
///
/// Why broadcast: the spawned tasks are stolen one at a time from one deque, and on the H200's
/// 16-core host the region's last task started 11-15 us into a ~100 us call (thirty-fifth
/// session, docs/NOTES.md); a thread that starts late also finds its own rows taken by others.
fn spawned_region() -> bool {
    if crate::ab::is_b("spawned") {
        return true;
    }
    switch_on(&SPAWNED_REGION, || std::env::var("DISKFORMER_EXPERTS_REGION").is_ok_and(|v| v.trim() == "spawn"))
}

/// A switch kept in `state` ([`OWNED_UNSET`], [`OWNED_ON`] or [`OWNED_OFF`]): its setter's
/// choice, else `from_env` read once and kept.
fn switch_on(state: &AtomicU8, from_env: impl FnOnce() -> bool) -> bool {
    match state.load(Ordering::Relaxed) {
        OWNED_UNSET => {
            let on = from_env();
            let _ = state.compare_exchange(
                OWNED_UNSET,
                if on { OWNED_ON } else { OWNED_OFF },
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            on
        }
        v => v == OWNED_ON,
    }
}

/// [`spawned_region`]'s state, as [`OWNED_CLAIMS`]'s.
static SPAWNED_REGION: AtomicU8 = AtomicU8::new(OWNED_UNSET);

/// Sets whether later regions spawn their tasks into rayon's deque even inside a polled step
/// (`true`) or broadcast them to its pollers (`false`, the default), overriding
/// `DISKFORMER_EXPERTS_REGION=spawn`; the perf test `cpu_experts_cache` compares both.
pub fn set_spawned_region(on: bool) {
    SPAWNED_REGION.store(if on { OWNED_ON } else { OWNED_OFF }, Ordering::Relaxed);
}

/// Whether the region gives each thread of the pool its own rows ([`OwnedClaims`]) rather than
/// shares taken in turn from one counter: [`OWNED_UNSET`] until first read (then the
/// environment's `DISKFORMER_EXPERTS_CLAIMS`), or [`set_owned_claims`]'s choice.
static OWNED_CLAIMS: AtomicU8 = AtomicU8::new(OWNED_UNSET);
const OWNED_UNSET: u8 = 0;
const OWNED_ON: u8 = 1;
const OWNED_OFF: u8 = 2;

/// Sets whether later regions give each pool thread a fixed range of each phase's rows (its own
/// first, then the rows other threads left), overriding `DISKFORMER_EXPERTS_CLAIMS`. On by
/// default; the perf test `cpu_experts_cache` compares both.
pub fn set_owned_claims(on: bool) {
    OWNED_CLAIMS.store(if on { OWNED_ON } else { OWNED_OFF }, Ordering::Relaxed);
}

/// Owned rows unless `DISKFORMER_EXPERTS_CLAIMS=shared` (or [`set_owned_claims`]) says
/// otherwise, or the A/B `shared` switches them off on this step.
///
/// Why owned by default: each thread then streams a contiguous range of each matrix, and the
/// same thread takes the same rows call after call. On the H200's 16-core host a call of
/// three Qwen3-30B-A3B experts from RAM took 82.7 us against 87.4 with shares taken in turn
/// (four experts 107.2 against 110.6), and the split's uniform decode ran 2.3% faster in one
/// process's A/B (thirty-fourth session, docs/NOTES.md). Rows the thread read just before
/// (its own caches) made almost no difference there (81.4 us): the products, not the RAM,
/// bound a call.
fn owned_claims() -> bool {
    if crate::ab::is_b("shared") {
        return false;
    }
    switch_on(&OWNED_CLAIMS, || std::env::var("DISKFORMER_EXPERTS_CLAIMS").map_or(true, |v| v.trim() != "shared"))
}

/// Whether a thread's own rows are its stripe of every expert (the default) rather than one
/// contiguous range of the phase's rows of all experts together (`DISKFORMER_EXPERTS_ROWS=contiguous`,
/// or the A/B name `contig` on B steps).
///
/// Why stripes: the split's read-ahead reads each thread's own rows of the experts it guessed
/// ([`owned_bytes`]), and the job then computes its own rows of the experts it was given. With
/// one contiguous range over all experts, a thread's rows depend on every expert before them
/// and on their count: one guessed expert that the job does not have, or a share that moved by
/// one expert between the guess and the job (the share moves at every join), shifts every
/// thread's range after it, so most of the lines read ahead sit in another core's L2, which
/// serves them slower than RAM (seventeenth session). With stripes a thread's rows of an
/// expert are the same whichever experts come with it: only the wrong guesses are wasted.
fn striped_rows() -> bool {
    static STRIPED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !crate::ab::is_b("contig")
        && *STRIPED.get_or_init(|| std::env::var("DISKFORMER_EXPERTS_ROWS").map_or(true, |v| v.trim() != "contiguous"))
}

/// An atomic on a cache line of its own: each thread's claim counter is written by that thread
/// mostly, and sixteen of them in one or two lines made every claim move a line between cores.
#[repr(align(128))]
struct PaddedCounter(AtomicUsize);

/// One phase's rows of `n_experts` experts (`span` rows each, multiples of eight, one expert
/// after the other) given out to the threads: each thread has its own rows, which it takes
/// first, in chunks; then it takes what other threads left.
///
/// A thread's own rows are `n_pieces` pieces, piece `i` being rows `i * piece_span + lo ..
/// i * piece_span + hi` of its `(lo, hi)`: striped ([`striped_rows`]), a piece per expert and
/// `(lo, hi)` the thread's stripe of an expert's rows; contiguous, one piece over the whole
/// phase. Either way a chunk never crosses a piece's end.
///
/// Thieves take from the front of another thread's rows, as the owner does. Taking from the
/// back instead (the rows the split's read-ahead, stopped by the hand-over, most likely left in
/// RAM rather than in the owner's L2) measured no different on the H200 (thirty-seventh
/// session: B/A 1.0132 against the control's 1.0060-1.0103 uniform, 1.0043 against 1.0040
/// skewed). (The job test's calls on rows their owners had just read ran slower than from RAM
/// with either; that was the test's pollers giving up, not stealing: NOTES, thirty-seventh
/// session.)
struct OwnedClaims {
    ranges: Vec<(usize, usize)>,
    n_pieces: usize,
    piece_span: usize,
    /// Per thread, how many of its rows (counted over its pieces in order) are taken.
    next: Vec<PaddedCounter>,
    /// Rows a claim takes in the contiguous layout (a quarter of a range); striped, a claim
    /// takes a whole piece.
    chunk: usize,
}

impl OwnedClaims {
    fn new(n_experts: usize, span: usize, n_threads: usize) -> OwnedClaims {
        OwnedClaims::laid_out(n_experts, span, n_threads, striped_rows())
    }

    fn laid_out(n_experts: usize, span: usize, n_threads: usize, striped: bool) -> OwnedClaims {
        let (n_pieces, piece_span, ranges) = owned_pieces(n_experts, span, n_threads, striped);
        let per = ranges.first().map_or(8, |r| r.1 - r.0);
        OwnedClaims {
            next: ranges.iter().map(|_| PaddedCounter(AtomicUsize::new(0))).collect(),
            ranges,
            n_pieces,
            piece_span,
            chunk: (per / 4).next_multiple_of(8).max(8),
        }
    }

    /// The next share for thread `me` (its own rows first).
    fn claim(&self, me: usize) -> Option<(usize, usize)> {
        let n = self.ranges.len();
        for r in (0..n).map(|i| (me + i) % n) {
            let (lo, hi) = self.ranges[r];
            let len = hi - lo;
            let total = len * self.n_pieces;
            // A range already taken costs a load, not a contended add.
            if len == 0 || self.next[r].0.load(Ordering::Relaxed) >= total {
                continue;
            }
            // Striped, a claim is one whole piece of this thread's: none crosses a piece's end.
            let chunk = if self.n_pieces == 1 { self.chunk } else { len };
            let taken = self.next[r].0.fetch_add(chunk, Ordering::Relaxed);
            if taken < total {
                let (piece, at) = (taken / len, taken % len);
                let base = piece * self.piece_span + lo;
                return Some((base + at, base + (at + chunk).min(len)));
            }
        }
        None
    }
}

/// The rows each of `n_threads` threads owns in a phase of `n_experts` experts of `span` rows
/// (a multiple of eight): `(n_pieces, piece_span, ranges)` as [`OwnedClaims`] keeps them.
fn owned_pieces(n_experts: usize, span: usize, n_threads: usize, striped: bool) -> (usize, usize, Vec<(usize, usize)>) {
    if striped {
        (n_experts, span, owned_ranges(span, n_threads))
    } else {
        (1, n_experts * span, owned_ranges(n_experts * span, n_threads))
    }
}

/// The range of rows `0..n_rows` that thread `t` of `n_threads` owns: equal ranges of whole
/// groups of eight, the last ones possibly empty.
fn owned_ranges(n_rows: usize, n_threads: usize) -> Vec<(usize, usize)> {
    let n_threads = n_threads.max(1);
    let per = n_rows.div_ceil(n_threads).next_multiple_of(8);
    (0..n_threads).map(|t| ((t * per).min(n_rows), ((t + 1) * per).min(n_rows))).collect()
}

/// The weight bytes thread `thread` of `n_threads` computes first in [`experts_one_token`] with
/// owned claims, for `experts` of `n_ff` hidden rows: what that thread would read ahead (the
/// perf test `cpu_experts_cache` reads them so: from RAM it saved 21-27% of a call on the H200's
/// host, thirty-seventh session). In the order the thread computes them: its gate and up rows
/// of each expert, then its down rows.
pub fn owned_bytes<'a>(experts: &[ExpertRows<'a>], n_ff: usize, thread: usize, n_threads: usize) -> Vec<&'a [u8]> {
    owned_bytes_laid_out(experts, n_ff, thread, n_threads, striped_rows())
}

fn owned_bytes_laid_out<'a>(
    experts: &[ExpertRows<'a>],
    n_ff: usize,
    thread: usize,
    n_threads: usize,
    striped: bool,
) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let Some(k) = experts.first().map(|e| e.down.n_out) else { return out };
    let rows_of = |w: &WeightRows<'a>, lo: usize, hi: usize, out: &mut Vec<&'a [u8]>| {
        let row_bytes = w.bytes.len() / w.n_out.max(1);
        let (lo, hi) = (lo.min(w.n_out), hi.min(w.n_out));
        if lo < hi {
            out.push(&w.bytes[lo * row_bytes..hi * row_bytes]);
        }
    };
    let thread = thread.min(n_threads.max(1) - 1);
    for phase_in in [true, false] {
        let span = if phase_in { n_ff } else { k }.next_multiple_of(8);
        let (n_pieces, piece_span, ranges) = owned_pieces(experts.len(), span, n_threads, striped);
        let (a, b) = ranges[thread];
        for piece in 0..n_pieces {
            let (a, b) = (piece * piece_span + a, piece * piece_span + b);
            for (i, e) in experts.iter().enumerate() {
                let (lo, hi) = (a.max(i * span), b.min((i + 1) * span));
                if lo >= hi {
                    continue;
                }
                let (lo, hi) = (lo - i * span, hi - i * span);
                if phase_in {
                    if let Some(g) = &e.gate {
                        rows_of(g, lo, hi, &mut out);
                    }
                    rows_of(&e.up, lo, hi, &mut out);
                } else {
                    rows_of(&e.down, lo, hi, &mut out);
                }
            }
        }
    }
    out
}

/// Polls of an expert's ready flag before the waiting thread yields its core (a few
/// microseconds: an expert's last gate/up rows normally land within that).
const SPINS_BEFORE_YIELD: u32 = 4096;

/// One expert's matrices: `gate` and `up` `[n_ff, k]` (no gate: an ungated expert), `down`
/// `[k, n_ff]`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertRows<'a> {
    /// The gate projection, if the expert is gated.
    pub gate: Option<WeightRows<'a>>,
    /// The up projection.
    pub up: WeightRows<'a>,
    /// The down projection.
    pub down: WeightRows<'a>,
}

/// The element-wise step between an expert's gate/up products and its down product:
/// `(expert, first_row, gate_rows, up_rows, out_rows)`, called on ranges of rows (each starting
/// at a multiple of eight) whose union is `0..n_ff`; `gate_rows` is empty for an ungated expert.
pub type ExpertGating<'a> = dyn Fn(usize, usize, &[f32], &[f32], &mut [f32]) + Sync + 'a;

/// A gated row of each expert, quantized for the down products by the thread that finishes the
/// expert's gate/up rows.
struct GatedActs {
    kind: ActKind,
    n_ff: usize,
    d: *mut f32,
    qs: *mut i8,
    sums: *mut i16,
}
// SAFETY: row `e` is written by exactly one thread (the one whose count completes expert `e`),
// before `ready[e]` is released, and read only after it is acquired; the vectors behind the
// pointers outlive the parallel region.
unsafe impl Send for GatedActs {}
// SAFETY: as above.
unsafe impl Sync for GatedActs {}

impl GatedActs {
    fn per_row(&self) -> (usize, usize, usize) {
        let nb = self.n_ff / self.kind.block_elems();
        (nb, self.n_ff, nb * self.kind.sums_per_block())
    }

    /// # Safety
    /// Called once for row `e`, by the thread that completed it, with no reader yet.
    unsafe fn quantize(&self, e: usize, h: &[f32]) {
        let (nb, k, ns) = self.per_row();
        // SAFETY: row `e` lies inside the vectors (sized for every expert) and no other thread
        // touches it now (the caller's contract).
        let (d, qs, sums) = unsafe {
            (
                std::slice::from_raw_parts_mut(self.d.add(e * nb), nb),
                std::slice::from_raw_parts_mut(self.qs.add(e * k), k),
                std::slice::from_raw_parts_mut(self.sums.add(e * ns), ns),
            )
        };
        quantize_row(self.kind, h, d, qs, sums);
    }

    /// # Safety
    /// Row `e` must have been quantized, and its `ready` flag acquired, by the caller.
    unsafe fn row(&self, e: usize) -> ActRow<'_> {
        let (nb, k, ns) = self.per_row();
        // SAFETY: as in `quantize`; the row is complete and no longer written.
        unsafe {
            ActRow {
                d: std::slice::from_raw_parts(self.d.add(e * nb), nb),
                qs: std::slice::from_raw_parts(self.qs.add(e * k), k),
                sums: std::slice::from_raw_parts(self.sums.add(e * ns), ns),
            }
        }
    }
}

/// Adds one to the count when dropped: a spawned task of the region has ended (returned or
/// unwound).
struct CountOnDrop<'a>(&'a AtomicUsize);

impl Drop for CountOnDrop<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// Marks the region aborted if the thread unwinds while holding gate/up rows, so no thread
/// spins forever on an expert that will not complete.
struct AbortOnUnwind<'a>(&'a AtomicBool);

impl Drop for AbortOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

/// A matrix of the region, its shape checked against an input `xs` and output `ys` of the
/// lengths the region uses.
fn part<'w>(
    w: WeightRows<'w>,
    out: SharedOut,
    k: usize,
    xs: &[f32],
    ys: &mut [f32],
    kernel: Kernel,
) -> Result<DecodePart<'w>, QuantError> {
    let expected = ys.len();
    let Some(shape) = check_shapes(w.dtype, w.bytes, w.n_out, k, xs, ys)? else {
        return Err(QuantError::ShapeMismatch { op: "experts_one_token", what: "rows", expected, got: 0 });
    };
    let Some(tiles) = Tiles::new(w.dtype, kernel) else {
        return Err(QuantError::Unsupported { op: "experts_one_token", dtype: w.dtype });
    };
    Ok(DecodePart::new(tiles, w.bytes, w.n_out, shape.row_bytes, out))
}

/// `down_out[i] = down_i · gating(gate_i · x, up_i · x)` for one token `x` (`[k]`) and the
/// experts `experts` (`down_out` is `[experts.len(), k]` row-major), in one parallel region;
/// each output has the bits of computing the expert's three products with [`super::matmul`]
/// one after the other.
///
/// Returns `Ok(false)`, computing nothing, unless the mode is
/// [`MatmulMode::QuantizedActivations`] and every matrix has a multi-row kernel, the gate and
/// up matrices one activation scheme and the down matrices one (the caller then runs the
/// products one region at a time).
///
/// # Errors
/// As [`super::matmul`] for a matrix whose bytes or shape do not match; a `down_out` that is
/// not `experts.len() * k` values.
pub fn experts_one_token(
    experts: &[ExpertRows<'_>],
    n_ff: usize,
    x: &[f32],
    gating: &ExpertGating<'_>,
    down_out: &mut [f32],
    mode: MatmulMode,
) -> Result<bool, QuantError> {
    let call_start = std::time::Instant::now();
    let (k, n) = (x.len(), experts.len());
    let kernel = Kernel::best();
    let Some(first) = experts.first() else { return Ok(true) };
    let (Some(kind_in), Some(kind_mid)) =
        (ActKind::for_weights(first.up.dtype), ActKind::for_weights(first.down.dtype))
    else {
        return Ok(false);
    };
    let tiled = |w: &WeightRows<'_>, kind: ActKind| {
        ActKind::for_weights(w.dtype) == Some(kind) && Tiles::new(w.dtype, kernel).is_some()
    };
    if mode != MatmulMode::QuantizedActivations
        || k == 0
        || n_ff == 0
        || !experts
            .iter()
            .all(|e| e.gate.is_none_or(|g| tiled(&g, kind_in)) && tiled(&e.up, kind_in) && tiled(&e.down, kind_mid))
    {
        return Ok(false);
    }
    if down_out.len() != n * k {
        return Err(QuantError::ShapeMismatch {
            op: "experts_one_token",
            what: "down_out",
            expected: n * k,
            got: down_out.len(),
        });
    }
    let (nb_in, nb_mid) = (k / kind_in.block_elems(), n_ff / kind_mid.block_elems());
    let has_gate = experts.iter().any(|e| e.gate.is_some());
    let mut scratch = Scratch::take();
    let Scratch { gate, up, gated, probe_in, probe_out, probe_down, mid_d, mid_qs, mid_sums, act_in, done, ready } =
        &mut *scratch;
    let gate = grown(gate, if has_gate { n * n_ff } else { 0 });
    let up = grown(up, n * n_ff);
    let gated = grown(gated, n * n_ff);
    let h_probe = grown(probe_in, n_ff);
    // Shapes checked up front (with stand-in slices of the right lengths), so the region
    // itself cannot fail.
    let mut parts_in: Vec<(Option<DecodePart<'_>>, DecodePart<'_>)> = Vec::with_capacity(n);
    let mut parts_down: Vec<DecodePart<'_>> = Vec::with_capacity(n);
    let (gate_out, up_out, down_ptr) =
        (SharedOut(gate.as_mut_ptr()), SharedOut(up.as_mut_ptr()), SharedOut(down_out.as_mut_ptr()));
    let mut row_bytes_in = 0;
    let (probe_out, probe_down) = (grown(probe_out, n_ff), grown(probe_down, k));
    let allocated = std::time::Instant::now();
    for (i, e) in experts.iter().enumerate() {
        let g = match e.gate {
            Some(g) => Some(part(g, SharedOut(gate_out.at(i * n_ff)), k, x, probe_out, kernel)?),
            None => None,
        };
        let u = part(e.up, SharedOut(up_out.at(i * n_ff)), k, x, probe_out, kernel)?;
        row_bytes_in = row_bytes_in.max(u.row_bytes + g.map_or(0, |g| g.row_bytes));
        parts_in.push((g, u));
        parts_down.push(part(e.down, SharedOut(down_ptr.at(i * k)), n_ff, h_probe, probe_down, kernel)?);
    }
    let row_bytes_down = parts_down.iter().map(|p| p.row_bytes).max().unwrap_or(1);
    let checked = std::time::Instant::now();

    act_in.quantize_one(kind_in, x);
    let x_row = act_in.row(kind_in, 0, k);
    let quantized = std::time::Instant::now();
    let acts = GatedActs {
        kind: kind_mid,
        n_ff,
        d: grown(mid_d, n * nb_mid).as_mut_ptr(),
        qs: grown(mid_qs, n * n_ff).as_mut_ptr(),
        sums: grown(mid_sums, n * nb_mid * kind_mid.sums_per_block()).as_mut_ptr(),
    };
    let gated_out = SharedOut(gated.as_mut_ptr());
    let (done, ready) = (&grown(done, n)[..], &grown(ready, n)[..]);
    done.iter().for_each(|d| d.store(0, Ordering::Relaxed));
    ready.iter().for_each(|r| r.store(false, Ordering::Relaxed));
    let aborted = AtomicBool::new(false);

    // Each expert's rows padded to whole groups of eight, one after the other.
    let span_in = n_ff.next_multiple_of(8);
    let span_down = k.next_multiple_of(8);
    let n_threads = rayon::current_num_threads().max(1);
    let old_region = old_region();
    let min_claim = if old_region { super::MIN_CLAIM_BYTES } else { MIN_CLAIM_BYTES };
    let claims_in = Claims::with_min_bytes(n * span_in, row_bytes_in, n_threads, min_claim);
    let claims_down = Claims::with_min_bytes(n * span_down, row_bytes_down, n_threads, min_claim);
    let owned = owned_claims() && !old_region;
    // The threads the region will run on, ranked as the split's read-ahead ranks them
    // (`RegionRanks`: without a polled step's driver when a poller publishes it).
    let ranks = crate::cpu::warm::RegionRanks::for_region();
    let (owned_in, owned_down) = if owned {
        let n_ranked = ranks.count();
        (Some(OwnedClaims::new(n, span_in, n_ranked)), Some(OwnedClaims::new(n, span_down, n_ranked)))
    } else {
        (None, None)
    };
    let me = || ranks.current();
    let claim_in = |me: usize| match &owned_in {
        Some(c) => c.claim(me),
        None => claims_in.claim(),
    };
    let claim_down = |me: usize| match &owned_down {
        Some(c) => c.claim(me),
        None => claims_down.claim(),
    };

    let timed = timing::enabled();
    let region_start = std::time::Instant::now();
    let gate_up_rows = |start: usize, end: usize| {
        let _guard = AbortOnUnwind(&aborted);
        for i in start / span_in..end.div_ceil(span_in) {
            let (lo, hi) = (start.max(i * span_in) - i * span_in, (end - i * span_in).min(span_in));
            let (g, u) = &parts_in[i];
            if let Some(g) = g {
                g.run(lo, hi, nb_in, x_row);
            }
            u.run(lo, hi, nb_in, x_row);
            let (lo, hi) = (lo.min(n_ff), hi.min(n_ff));
            if lo < hi {
                let at = i * n_ff + lo;
                // SAFETY: rows lo..hi of expert i's gate, up and gated rows belong to this
                // claim alone (claims are disjoint), their products above are written, and the
                // vectors outlive the region.
                let (gs, us, hs) = unsafe {
                    (
                        if g.is_some() { std::slice::from_raw_parts(gate_out.at(at), hi - lo) } else { &[][..] },
                        std::slice::from_raw_parts(up_out.at(at), hi - lo),
                        std::slice::from_raw_parts_mut(gated_out.at(at), hi - lo),
                    )
                };
                gating(i, lo, gs, us, hs);
            }
            // AcqRel: the thread that completes the count sees every other claim's gated rows.
            if hi > lo && done[i].fetch_add(hi - lo, Ordering::AcqRel) + (hi - lo) == n_ff {
                // SAFETY: the gated row of expert i is complete (the count says so) and no
                // thread reads its quantized row before `ready[i]`.
                unsafe {
                    let h = std::slice::from_raw_parts(gated_out.at(i * n_ff), n_ff);
                    acts.quantize(i, h);
                }
                ready[i].store(true, Ordering::Release);
            }
        }
    };
    let down_rows = |start: usize, end: usize, waited: &mut u64| {
        for i in start / span_down..end.div_ceil(span_down) {
            let mut spins = 0u32;
            let wait_start = (timed && !ready[i].load(Ordering::Acquire)).then(std::time::Instant::now);
            while !ready[i].load(Ordering::Acquire) {
                if aborted.load(Ordering::Acquire) {
                    return;
                }
                // A producer the OS has descheduled (more runnable threads than cores) gets
                // the core back instead of waiting out this thread's time slice.
                spins += 1;
                if spins > SPINS_BEFORE_YIELD {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            if let Some(t) = wait_start {
                *waited += t.elapsed().as_nanos() as u64;
            }
            let (lo, hi) = (start.max(i * span_down) - i * span_down, (end - i * span_down).min(span_down));
            // SAFETY: `ready[i]` was acquired just above.
            let mid = unsafe { acts.row(i) };
            parts_down[i].run(lo, hi, nb_mid, mid);
        }
    };
    let work = n * n_ff * k * 3;
    let serial = n_threads == 1 || work < super::SERIAL_WORK;
    let n_timed = match (timed, serial) {
        (false, _) => 0,
        (true, true) => 1,
        (true, false) => n_threads,
    };
    let task_timings: Vec<std::sync::Mutex<timing::TaskTiming>> = (0..n_timed).map(|_| Default::default()).collect();
    let worker = |task: usize| {
        let mut t = timing::TaskTiming::default();
        let since = |at: std::time::Instant| at.saturating_duration_since(region_start).as_nanos() as u64;
        // What this thread read ahead of the call (the split's read-ahead), taken whether timed
        // or not so that a later call does not find it.
        let ahead = crate::cpu::cache_fill::take_read_ahead_bytes();
        if timed {
            t.start = since(std::time::Instant::now());
            t.ahead_bytes = ahead;
        }
        // Counts a claim's bytes and notes when those computed reach what was read ahead (the
        // rows read ahead are the thread's own, in the order it computes them).
        let count = |t: &mut timing::TaskTiming, bytes: u64| {
            if timed {
                t.bytes += bytes;
                if t.ahead_done == 0 && t.ahead_bytes > 0 && t.bytes >= t.ahead_bytes {
                    t.ahead_done = since(std::time::Instant::now());
                }
            }
        };
        let me = me();
        while let Some((start, end)) = claim_in(me) {
            gate_up_rows(start, end);
            t.claims += 1;
            count(&mut t, ((end - start) * row_bytes_in) as u64);
        }
        if timed {
            t.gate_up_done = since(std::time::Instant::now());
        }
        while let Some((start, end)) = claim_down(me) {
            down_rows(start, end, &mut t.waited);
            t.claims += 1;
            count(&mut t, ((end - start) * row_bytes_down) as u64);
        }
        if timed {
            t.end = since(std::time::Instant::now());
            if let Some(slot) = task_timings.get(task) {
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = t;
            }
        }
    };
    // Tasks that ran (a broadcast region's pollers come as they are free).
    let mut n_ran = n_threads;
    let next_task = AtomicUsize::new(0);
    if serial {
        worker(0);
        n_ran = 1;
    } else if old_region {
        (0..n_threads).into_par_iter().for_each(worker);
    } else if !spawned_region() && crate::cpu::warm::broadcast(&|| worker(next_task.fetch_add(1, Ordering::Relaxed))) {
        n_ran = next_task.load(Ordering::Relaxed).min(n_threads);
    } else {
        // This thread takes task 0 and then spins, never parks, until the others have ended:
        // a parked thread's wake-up after the last task was part of the ~7-8 us from the last
        // task's end to the region's end that the split's jobs showed on the H200 (twentieth
        // session). A task still in this thread's deque (no thief came) runs here.
        let ended = AtomicUsize::new(0);
        rayon::scope(|s| {
            for task in 1..n_threads {
                let (worker, ended) = (&worker, &ended);
                s.spawn(move |_| {
                    // Counted even if the task unwinds: the spin below ends, and the scope then
                    // passes the panic on.
                    let _count = CountOnDrop(ended);
                    worker(task);
                });
            }
            worker(0);
            while ended.load(Ordering::Acquire) < n_threads - 1 {
                if rayon::yield_local() != Some(rayon::Yield::Executed) {
                    std::hint::spin_loop();
                }
            }
        });
    }
    if timed {
        let tasks =
            task_timings.into_iter().take(n_ran).map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner())).collect();
        timing::record([call_start, allocated, checked, quantized, region_start], tasks);
    }
    drop((parts_in, parts_down));
    scratch.give_back();
    Ok(true)
}

/// The buffers of one [`experts_one_token`] call, kept by each calling thread for its next call.
///
/// Why: a decode step of Qwen3-30B-A3B makes 48 calls, each on the critical path, and a dozen
/// fresh buffers of ~60 KB in all took 6.4 us of a call's ~12 us setup on the H200 host
/// (twenty-first session), before the region and again when freed after it (glibc gave a
/// decode step's freed logits back to the kernel, which faulted them in anew each step:
/// twentieth session); allocating them per call again read ~3% slower in one process's A/B
/// (`DISKFORMER_AB=alloc`). Every buffer is written
/// before it is read in a call (the region computes every row), so a reused one needs no
/// clearing; only the completion flags are reset.
#[derive(Default)]
struct Scratch {
    gate: Vec<f32>,
    up: Vec<f32>,
    gated: Vec<f32>,
    /// Stand-ins of the right lengths for the shape checks (never read or written).
    probe_in: Vec<f32>,
    probe_out: Vec<f32>,
    probe_down: Vec<f32>,
    mid_d: Vec<f32>,
    mid_qs: Vec<i8>,
    mid_sums: Vec<i16>,
    act_in: ActBuf,
    done: Vec<AtomicUsize>,
    ready: Vec<AtomicBool>,
}

thread_local! {
    /// This thread's scratch between calls; `None` while a call holds it (a nested call on the
    /// same thread, from a task of the region, makes its own).
    static SCRATCH: std::cell::Cell<Option<Box<Scratch>>> = const { std::cell::Cell::new(None) };
}

impl Scratch {
    fn take() -> Box<Scratch> {
        if crate::ab::is_b("alloc") {
            return Box::default();
        }
        SCRATCH.with(|s| s.take()).unwrap_or_default()
    }

    fn give_back(self: Box<Scratch>) {
        SCRATCH.with(|s| s.set(Some(self)));
    }
}

/// The first `len` items of `v`, grown (with default values) when shorter; longer vectors keep
/// their tail, unused.
fn grown<T: Default>(v: &mut Vec<T>, len: usize) -> &mut [T] {
    if v.len() < len {
        v.resize_with(len, T::default);
    }
    &mut v[..len]
}

/// Where a one-token experts region's time goes, per call, when switched on
/// ([`timing::enable`]); for the perf test `cpu_experts_cache`, which prints it.
///
/// Why: on the H200 host four experts took 142 us on 16 threads from RAM where one thread
/// streams them at 9.3 GB/s (twentieth session): twice what the bytes need. These figures say
/// whether the rest is the fork, the threads' imbalance, the down rows' waits or the join.
pub mod timing {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    use std::time::Instant;

    static ENABLED: AtomicBool = AtomicBool::new(false);
    static CALLS: Mutex<Vec<CallTiming>> = Mutex::new(Vec::new());

    /// One thread's task in a region, in nanoseconds from the region's start.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct TaskTiming {
        /// The task began.
        pub start: u64,
        /// It found no gate/up rows left.
        pub gate_up_done: u64,
        /// It found no down rows left.
        pub end: u64,
        /// Spent waiting for experts' gated rows.
        pub waited: u64,
        /// Claims taken.
        pub claims: u32,
        /// Weight bytes of its claims (rows times the widest row of their phase).
        pub bytes: u64,
        /// Bytes this thread read ahead before the call (`cpu::cache_fill`).
        pub ahead_bytes: u64,
        /// When the bytes it computed reached `ahead_bytes` (0: never).
        pub ahead_done: u64,
    }

    /// One call, in nanoseconds.
    #[derive(Clone, Debug, Default)]
    pub struct CallTiming {
        /// From the call to the region's start (allocations, the input's quantization).
        pub setup: u64,
        /// Of `setup`: the buffers' allocation (and the type checks before it), the matrices'
        /// shape checks, the token's quantization (the rest is the region's own state).
        pub setup_parts: [u64; 3],
        /// From the region's start to the call's end.
        pub region: u64,
        /// Each task, in the order of their indices.
        pub tasks: Vec<TaskTiming>,
    }

    /// Starts recording every call (and forgets earlier ones).
    pub fn enable() {
        CALLS.lock().unwrap_or_else(|e| e.into_inner()).clear();
        ENABLED.store(true, Ordering::Release);
    }

    /// Stops recording and returns the calls recorded since [`enable`].
    pub fn take() -> Vec<CallTiming> {
        ENABLED.store(false, Ordering::Release);
        std::mem::take(&mut *CALLS.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Recording on: [`enable`] called, or `DISKFORMER_EXPERTS_TIMING=1` in the environment
    /// (read once; `diskformer bench` then prints [`summary`] at its end).
    pub fn enabled() -> bool {
        static FROM_ENV: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        ENABLED.load(Ordering::Relaxed)
            || *FROM_ENV.get_or_init(|| std::env::var("DISKFORMER_EXPERTS_TIMING").is_ok_and(|v| v.trim() == "1"))
    }

    /// Means over `calls`, in microseconds: the setup before the region, the region, when the
    /// first and last task began, when the first and last ran out of gate/up rows and of all
    /// rows, each task's busy time, wait for gated rows and claims, and the join after the last
    /// task's end. Then the median and 90th percentile over the calls of the region, of the
    /// spread of the gate/up ends of the tasks that claimed rows and of the longest wait for
    /// gated rows: a mean that a
    /// few stalled calls make (a thread descheduled while it holds an expert's last rows) reads
    /// apart from a cost every call pays.
    pub fn summary(calls: &[CallTiming]) -> String {
        let n = calls.len().max(1) as f64;
        let us = |v: u64| v as f64 / 1e3;
        let mean = |f: &dyn Fn(&CallTiming) -> f64| calls.iter().map(f).sum::<f64>() / n;
        let min_max = |f: fn(&TaskTiming) -> u64| {
            (
                mean(&|c| us(c.tasks.iter().map(f).min().unwrap_or(0))),
                mean(&|c| us(c.tasks.iter().map(f).max().unwrap_or(0))),
            )
        };
        let per_task = |f: &dyn Fn(&TaskTiming) -> f64| {
            mean(&|c| c.tasks.iter().map(f).sum::<f64>() / c.tasks.len().max(1) as f64)
        };
        let (start_lo, start_hi) = min_max(|t| t.start);
        let (gu_lo, gu_hi) = min_max(|t| t.gate_up_done);
        let (end_lo, end_hi) = min_max(|t| t.end);
        format!(
            "timing over {} calls of {:.1} tasks, us: setup {:.1} (allocations {:.1}, checks {:.1}, quantization {:.1}), region {:.1}; tasks start {start_lo:.1}..{start_hi:.1}, \
             gate/up done {gu_lo:.1}..{gu_hi:.1}, end {end_lo:.1}..{end_hi:.1}; per task busy {:.1}, waiting for \
             gated rows {:.1}, claims {:.1}; join after the last end {:.1}",
            calls.len(),
            mean(&|c| c.tasks.len() as f64),
            mean(&|c| us(c.setup)),
            mean(&|c| us(c.setup_parts[0])),
            mean(&|c| us(c.setup_parts[1])),
            mean(&|c| us(c.setup_parts[2])),
            mean(&|c| us(c.region)),
            per_task(&|t| us(t.end - t.start)),
            per_task(&|t| us(t.waited)),
            per_task(&|t| t.claims as f64),
            mean(&|c| us(c.region) - us(c.tasks.iter().map(|t| t.end).max().unwrap_or(0))),
        ) + &ahead_rates(calls)
            + &format!(
            "; over calls (median / 90th percentile): region {}, gate/up ends' spread {}, longest wait {}",
            percentiles(calls, |c| c.region),
            // Over the tasks that claimed rows: one that started after every row was taken
            // (the split's sixteenth, its thread busy recording) would stand for the spread.
            percentiles(calls, |c| {
                let ends = c.tasks.iter().filter(|t| t.claims > 0).map(|t| t.gate_up_done);
                ends.clone().max().unwrap_or(0) - ends.min().unwrap_or(0)
            }),
            percentiles(calls, |c| c.tasks.iter().map(|t| t.waited).max().unwrap_or(0)),
        )
    }

    /// Over the tasks that read ahead and computed past it: the bytes read ahead a task and the
    /// rate a thread computed them at (from its start to reaching them), and the rate of the
    /// rest (to its end, less its waits for gated rows); empty when no task read ahead.
    fn ahead_rates(calls: &[CallTiming]) -> String {
        let (mut n, mut ahead, mut ahead_ns, mut rest, mut rest_ns) = (0u64, 0u64, 0u64, 0u64, 0u64);
        for t in calls.iter().flat_map(|c| &c.tasks) {
            if t.ahead_done == 0 || t.bytes <= t.ahead_bytes || t.end <= t.ahead_done {
                continue;
            }
            n += 1;
            ahead += t.ahead_bytes;
            ahead_ns += t.ahead_done.saturating_sub(t.start);
            rest += t.bytes - t.ahead_bytes;
            rest_ns += (t.end - t.ahead_done).saturating_sub(t.waited);
        }
        if n == 0 {
            return String::new();
        }
        format!(
            "; {n} tasks read ahead {:.0} KB each: computed at {:.1} GB/s a thread, the rest ({:.0} KB) at {:.1}",
            ahead as f64 / n as f64 / 1e3,
            ahead as f64 / ahead_ns.max(1) as f64,
            rest as f64 / n as f64 / 1e3,
            rest as f64 / rest_ns.max(1) as f64,
        )
    }

    /// `"p50 / p90"` of `f` (nanoseconds) over `calls`, in microseconds.
    fn percentiles(calls: &[CallTiming], f: impl Fn(&CallTiming) -> u64) -> String {
        let mut v: Vec<u64> = calls.iter().map(f).collect();
        v.sort_unstable();
        let at = |q: f64| v.get(((v.len() as f64 - 1.0) * q).round() as usize).map_or(0.0, |&x| x as f64 / 1e3);
        format!("{:.1} / {:.1}", at(0.5), at(0.9))
    }

    /// Records a call: `at` is its start, the end of its allocations, of the matrices' checks,
    /// of the token's quantization, and the region's start.
    pub(super) fn record(at: [Instant; 5], tasks: Vec<TaskTiming>) {
        let ns = |a: Instant, b: Instant| b.saturating_duration_since(a).as_nanos() as u64;
        let [start, allocated, checked, quantized, region_start] = at;
        let call = CallTiming {
            setup: ns(start, region_start),
            setup_parts: [ns(start, allocated), ns(allocated, checked), ns(checked, quantized)],
            region: ns(region_start, Instant::now()),
            tasks,
        };
        CALLS.lock().unwrap_or_else(|e| e.into_inner()).push(call);
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// The rates of the rows read ahead and of the rest, over the tasks that read ahead and
        /// went past it: bytes over time, the rest's time less its waits.
        #[test]
        fn ahead_rates_split_each_task_at_its_read_ahead() {
            let task = |ahead_bytes, ahead_done, bytes, end, waited| TaskTiming {
                start: 100,
                gate_up_done: 0,
                end,
                waited,
                claims: 1,
                bytes,
                ahead_bytes,
                ahead_done,
            };
            let call = CallTiming {
                tasks: vec![
                    // 1000 B in 100 ns (10 GB/s), then 2000 B in 600 - 200 - 100 = 300 ns.
                    task(1000, 200, 3000, 600, 100),
                    // 3000 B in 300 ns, then 1000 B in 100 ns.
                    task(3000, 400, 4000, 500, 0),
                    // Left out: no read-ahead, and one that never got past it.
                    task(0, 0, 5000, 900, 0),
                    task(9000, 0, 5000, 900, 0),
                ],
                ..CallTiming::default()
            };
            assert_eq!(
                ahead_rates(&[call]),
                "; 2 tasks read ahead 2 KB each: computed at 10.0 GB/s a thread, the rest (2 KB) at 7.5"
            );
            assert_eq!(ahead_rates(&[]), "");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{matmul, quantize, GgmlType};

    fn random_matrix(dtype: GgmlType, n_out: usize, k: usize, next: &mut impl FnMut() -> f32) -> Vec<u8> {
        let values: Vec<f32> = (0..n_out * k).map(|_| next()).collect();
        let mut bytes = vec![0u8; n_out * k / dtype.block_elems() * dtype.block_bytes()];
        quantize(dtype, &values, &mut bytes).expect("quantize");
        bytes
    }

    /// An expert's gate (if gated), up and down matrices, encoded.
    type EncodedExpert = (Option<Vec<u8>>, Vec<u8>, Vec<u8>);

    fn silu_glu(_: usize, _: usize, g: &[f32], u: &[f32], h: &mut [f32]) {
        for (h, (&g, &u)) in h.iter_mut().zip(g.iter().zip(u)) {
            *h = g / (1.0 + (-g).exp()) * u;
        }
    }

    /// Each expert's output equals its three products computed one after the other with
    /// `matmul` (its gated row quantized by `matmul` itself), bit for bit: for gated and
    /// ungated experts, Q4_K / Q6_K and Q4_0 / Q8_0 mixes, pools of one to eight threads, and
    /// more threads than rows to share. The pools live through all the cases, so their threads
    /// reuse scratch left by calls of other shapes (larger and smaller, stale values in it).
    #[test]
    fn one_region_matches_the_products_one_by_one() {
        let mut next = crate::test_uniform();
        let pools: Vec<(usize, rayon::ThreadPool)> = [1, 2, 3, 8]
            .into_iter()
            .map(|threads| (threads, rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()))
            .collect();
        let cases = [
            (GgmlType::Q4_K, GgmlType::Q6_K, 512, 256, 3, true),
            (GgmlType::Q4_K, GgmlType::Q4_K, 256, 512, 8, true),
            (GgmlType::Q4_0, GgmlType::Q8_0, 256, 96, 5, true),
            (GgmlType::Q4_0, GgmlType::Q4_0, 128, 64, 2, false),
            (GgmlType::Q4_K, GgmlType::Q4_K, 256, 256, 1, true),
        ];
        for (dtype_in, dtype_down, k, n_ff, n, gated) in cases {
            let mats: Vec<EncodedExpert> = (0..n)
                .map(|_| {
                    let gate = gated.then(|| random_matrix(dtype_in, n_ff, k, &mut next));
                    (gate, random_matrix(dtype_in, n_ff, k, &mut next), random_matrix(dtype_down, k, n_ff, &mut next))
                })
                .collect();
            let x: Vec<f32> = (0..k).map(|_| next()).collect();
            let mode = MatmulMode::QuantizedActivations;
            let mut want = vec![0f32; n * k];
            for ((g, u, d), out) in mats.iter().zip(want.chunks_mut(k)) {
                let mut gv = vec![0f32; n_ff];
                let mut uv = vec![0f32; n_ff];
                if let Some(g) = g {
                    matmul(dtype_in, g, n_ff, k, &x, &mut gv, mode).unwrap();
                }
                matmul(dtype_in, u, n_ff, k, &x, &mut uv, mode).unwrap();
                let mut h = vec![0f32; n_ff];
                if g.is_some() {
                    silu_glu(0, 0, &gv, &uv, &mut h);
                } else {
                    h.copy_from_slice(&uv);
                }
                matmul(dtype_down, d, k, n_ff, &h, out, mode).unwrap();
            }
            let experts: Vec<ExpertRows<'_>> = mats
                .iter()
                .map(|(g, u, d)| ExpertRows {
                    gate: g.as_ref().map(|g| WeightRows { dtype: dtype_in, bytes: g, n_out: n_ff }),
                    up: WeightRows { dtype: dtype_in, bytes: u, n_out: n_ff },
                    down: WeightRows { dtype: dtype_down, bytes: d, n_out: k },
                })
                .collect();
            let gating = |i: usize, first: usize, g: &[f32], u: &[f32], h: &mut [f32]| {
                if g.is_empty() {
                    h.copy_from_slice(u);
                } else {
                    silu_glu(i, first, g, u, h);
                }
            };
            // Both ways of sharing the rows (the switch is global: a test running beside this
            // one may see either, and both must give these bits), each with the region's tasks
            // spawned (a plain pool) and broadcast to a polled step's workers.
            let ways = pools.iter().flat_map(|p| [(p, true), (p, false)]).flat_map(|w| [(w, false), (w, true)]);
            for (((threads, pool), owned), in_step) in ways {
                set_owned_claims(owned);
                let mut got = vec![f32::NAN; n * k];
                let call = || experts_one_token(&experts, n_ff, &x, &gating, &mut got, mode);
                let fused =
                    if in_step { pool.install(|| crate::cpu::warm::run_step(call)) } else { pool.install(call) };
                assert!(fused.unwrap(), "{dtype_in:?}/{dtype_down:?}: the one-region path declined");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{dtype_in:?}/{dtype_down:?} n={n} {threads} threads, owned rows {owned}, in a step {in_step}: \
                         value {i}"
                    );
                }
            }
            set_owned_claims(true);
        }
    }

    /// Owned claims hand out every row exactly once in whole groups of eight, a thread's own
    /// rows before any other, whichever threads ask and in whatever order, in either layout;
    /// `owned_bytes` names the bytes of exactly a thread's own rows.
    #[test]
    fn owned_claims_hand_out_every_row_once_own_rows_first() {
        let cases = [(3, 768, 16), (3, 2048, 16), (5, 768, 16), (4, 96, 3), (1, 8, 4), (0, 768, 2), (7, 1000, 7)];
        for ((n_experts, span, n_threads), striped) in cases.into_iter().flat_map(|c| [(c, true), (c, false)]) {
            let n_rows = n_experts * span;
            let what = format!("{n_experts} experts of {span} rows, {n_threads} threads, striped {striped}");
            let claims = OwnedClaims::laid_out(n_experts, span, n_threads, striped);
            let mut seen = vec![0u8; n_rows];
            let mut order = 0..;
            // Threads ask in a scrambled order; each one's first claims come from its own rows.
            let mut firsts = vec![None; n_threads];
            loop {
                let me = (order.next().unwrap() * 5 + 3) % n_threads;
                // None only once every range is taken (a claim scans them all).
                let Some((start, end)) = claims.claim(me) else { break };
                assert!(start % 8 == 0 && start < end && end <= n_rows, "{what}: {start}..{end}");
                if striped {
                    assert_eq!(start / span, (end - 1) / span, "{what}: {start}..{end} crosses an expert");
                }
                firsts[me].get_or_insert((start, end));
                seen[start..end].iter_mut().for_each(|s| *s += 1);
            }
            assert!(seen.iter().all(|&s| s == 1), "{what}: a row given twice or never");
            let (_, _, ranges) = owned_pieces(n_experts, span, n_threads, striped);
            for (t, first) in firsts.iter().enumerate() {
                let (lo, hi) = ranges[t];
                if let (Some((start, _)), true) = (*first, lo < hi) {
                    assert_eq!(start, lo, "{what}: thread {t} did not start on its own rows");
                }
            }
        }
        // Striped, a thread takes its own stripe of each expert in turn, then another's: two
        // threads, three experts of 16 rows, thread 0 owning rows 0..8 of each.
        let claims = OwnedClaims::laid_out(3, 16, 2, true);
        let own: Vec<_> = (0..3).map(|_| claims.claim(0)).collect();
        assert_eq!(own, [Some((0, 8)), Some((16, 24)), Some((32, 40))], "thread 0's own stripes, in order");
        assert_eq!(claims.claim(1), Some((8, 16)), "thread 1 starts at its own stripe");
        assert_eq!(claims.claim(0), Some((24, 32)), "then a thief takes the next stripe left");
        // Q4_K rows of 256 values are 144 bytes: gate and up 256 rows each, down 512 rows.
        let (k, n_ff) = (512, 256);
        let (gate, up, down) = (vec![1u8; n_ff * 288], vec![2u8; n_ff * 288], vec![3u8; k * 144]);
        fn w(bytes: &[u8], n_out: usize) -> WeightRows<'_> {
            WeightRows { dtype: GgmlType::Q4_K, bytes, n_out }
        }
        let experts = [ExpertRows { gate: Some(w(&gate, n_ff)), up: w(&up, n_ff), down: w(&down, k) }; 3];
        for (n_threads, striped) in [1, 4, 5, 16].into_iter().flat_map(|n| [(n, true), (n, false)]) {
            let total: usize = (0..n_threads)
                .flat_map(|t| owned_bytes_laid_out(&experts, n_ff, t, n_threads, striped))
                .map(<[u8]>::len)
                .sum();
            assert_eq!(total, 3 * (gate.len() + up.len() + down.len()), "{n_threads} threads: each byte once");
        }
    }

    /// Striped, the rows a thread owns of an expert do not depend on the experts beside it, so
    /// a read-ahead of a guess that differs from the job's experts by one still lands every
    /// other expert's rows in the caches of the threads that compute them; contiguous, one
    /// expert fewer before them moves them.
    #[test]
    fn striped_rows_of_an_expert_do_not_depend_on_the_others() {
        let (k, n_ff, n_threads) = (512, 256, 16);
        let mats: Vec<[Vec<u8>; 3]> =
            (0..4u8).map(|e| [vec![e; n_ff * 144], vec![e + 10; n_ff * 144], vec![e + 20; k * 144]]).collect();
        fn w(bytes: &[u8], n_out: usize) -> WeightRows<'_> {
            WeightRows { dtype: GgmlType::Q4_K, bytes, n_out }
        }
        let rows = |ids: &[usize]| -> Vec<ExpertRows<'_>> {
            ids.iter()
                .map(|&e| ExpertRows {
                    gate: Some(w(&mats[e][0], n_ff)),
                    up: w(&mats[e][1], n_ff),
                    down: w(&mats[e][2], k),
                })
                .collect()
        };
        // The bytes a thread owns of expert 3, as (start address, length) within expert 3's matrices.
        let of_expert_3 = |ids: &[usize], thread: usize, striped: bool| -> Vec<(usize, usize)> {
            let experts = rows(ids);
            let bounds: Vec<(usize, usize)> =
                mats[3].iter().map(|m| (m.as_ptr() as usize, m.as_ptr() as usize + m.len())).collect();
            owned_bytes_laid_out(&experts, n_ff, thread, n_threads, striped)
                .into_iter()
                .map(|b| (b.as_ptr() as usize, b.len()))
                .filter(|&(at, _)| bounds.iter().any(|&(lo, hi)| (lo..hi).contains(&at)))
                .collect()
        };
        for thread in [0, 5, 15] {
            assert_eq!(
                of_expert_3(&[0, 1, 3], thread, true),
                of_expert_3(&[0, 3], thread, true),
                "striped: thread {thread}'s rows of expert 3 moved with the experts before it"
            );
        }
        assert!(
            (0..n_threads).any(|t| of_expert_3(&[0, 1, 3], t, false) != of_expert_3(&[0, 3], t, false)),
            "contiguous ranges were expected to move (the case stripes are for)"
        );
    }

    /// A down matrix of the wrong shape and an output of the wrong length are errors naming
    /// the numbers; f32 activations are declined, not computed.
    #[test]
    fn wrong_shapes_are_errors_and_f32_mode_is_declined() {
        let mut next = crate::test_uniform();
        let (k, n_ff) = (256, 256);
        let gate = random_matrix(GgmlType::Q4_K, n_ff, k, &mut next);
        let up = random_matrix(GgmlType::Q4_K, n_ff, k, &mut next);
        let short_down = random_matrix(GgmlType::Q4_K, k - 8 * 32, n_ff, &mut next);
        let x = vec![0.5f32; k];
        fn rows(bytes: &[u8], n_out: usize) -> WeightRows<'_> {
            WeightRows { dtype: GgmlType::Q4_K, bytes, n_out }
        }
        let gating = |_: usize, _: usize, _: &[f32], u: &[f32], h: &mut [f32]| h.copy_from_slice(u);
        let bad = [ExpertRows { gate: Some(rows(&gate, n_ff)), up: rows(&up, n_ff), down: rows(&short_down, k) }];
        let mut out = vec![0f32; k];
        let err = experts_one_token(&bad, n_ff, &x, &gating, &mut out, MatmulMode::QuantizedActivations).unwrap_err();
        assert!(err.to_string().contains("Q4_K"), "{err}");
        let good = [ExpertRows { gate: Some(rows(&gate, n_ff)), up: rows(&up, n_ff), down: rows(&gate, k) }];
        let mut short_out = vec![0f32; k - 1];
        let err =
            experts_one_token(&good, n_ff, &x, &gating, &mut short_out, MatmulMode::QuantizedActivations).unwrap_err();
        assert!(err.to_string().contains(&format!("{k}")), "{err}");
        assert!(!experts_one_token(&good, n_ff, &x, &gating, &mut out, MatmulMode::Exact).unwrap());
    }

    /// A panic in one expert's gating reaches the caller (no thread is left spinning on the
    /// expert or on the region's end), on pools of two to four threads, and the pool still
    /// works after it. A hang fails the test after 60 s.
    #[test]
    fn a_panicking_expert_reaches_the_caller() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            panicking_expert_cases();
            let _ = done.send(());
        });
        finished
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the cases failed (a panic above) or a region with a panicking expert hung for 60 s");
    }

    fn panicking_expert_cases() {
        let mut next = crate::test_uniform();
        let (k, n_ff, n) = (256, 512, 4);
        let mats: Vec<EncodedExpert> = (0..n)
            .map(|_| {
                (
                    Some(random_matrix(GgmlType::Q4_K, n_ff, k, &mut next)),
                    random_matrix(GgmlType::Q4_K, n_ff, k, &mut next),
                    random_matrix(GgmlType::Q4_K, k, n_ff, &mut next),
                )
            })
            .collect();
        fn rows(bytes: &[u8], n_out: usize) -> WeightRows<'_> {
            WeightRows { dtype: GgmlType::Q4_K, bytes, n_out }
        }
        let experts: Vec<ExpertRows<'_>> = mats
            .iter()
            .map(|(g, u, d)| ExpertRows {
                gate: g.as_deref().map(|g| rows(g, n_ff)),
                up: rows(u, n_ff),
                down: rows(d, k),
            })
            .collect();
        let x: Vec<f32> = (0..k).map(|_| next()).collect();
        // Expert 2 fails on the threads other than the caller's (the tasks it spawned), the
        // case where the caller must learn of it from the others.
        let caller = AtomicUsize::new(usize::MAX);
        let failed = AtomicBool::new(false);
        let gating = |i: usize, _: usize, g: &[f32], u: &[f32], h: &mut [f32]| {
            if i == 2 && rayon::current_thread_index() != Some(caller.load(Ordering::Relaxed)) {
                failed.store(true, Ordering::Relaxed);
                panic!("expert 2 fails");
            }
            silu_glu(i, 0, g, u, h);
        };
        for threads in [2, 3, 4] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut out = vec![0f32; n * k];
            failed.store(false, Ordering::Relaxed);
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| {
                    caller.store(rayon::current_thread_index().unwrap_or(usize::MAX), Ordering::Relaxed);
                    experts_one_token(&experts, n_ff, &x, &gating, &mut out, MatmulMode::QuantizedActivations)
                })
            }));
            // When the caller's thread alone computed expert 2 nothing failed: no case to check.
            if failed.load(Ordering::Relaxed) {
                assert!(result.is_err(), "{threads} threads: the panic did not reach the caller");
            }
            let sum: u64 = pool.install(|| (0..1000u64).into_par_iter().sum());
            assert_eq!(sum, 499_500);
        }
    }
}
