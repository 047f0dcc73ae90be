//! A mixture-of-experts layer's experts for one token on the CPU, all of them in one parallel
//! region ([`quant::experts_one_token`]; two regions where it declines).
//!
//! Why one region for all the experts: a decode step of Qwen3-30B-A3B computes ~380 experts of
//! three matrices each. One parallel region per matrix (each ~0.9 MB, split over 16 threads)
//! paid the pool's fork and join ~1150 times per token: on the H200 host's 16 cores the
//! experts ran at ~24 GB/s (0.10 ms per expert) where the memory gives llama.cpp twice that.
//! With two regions per layer (gate/up, then down) the threads streamed the layer's experts
//! back to back; one region also drops the second fork and join and the gating and
//! quantization between them on one thread. The GPU expert tier computes its CPU share with
//! the same function.

use crate::backend::{HostExpert, HostMatrix};
use crate::cpu::kernels;
use crate::error::OpError;
use crate::quant::{self, ExpertGating, ExpertRows, MatmulMode, QuantError, WeightRows};
use crate::spec::MoeSpec;

/// A layer's expert biases, each `[n_expert, width]` row-major; `None`: no such bias.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExpertBiases<'a> {
    /// Gate biases, `[n_expert, n_ff]`.
    pub gate: Option<&'a [f32]>,
    /// Up biases, `[n_expert, n_ff]`.
    pub up: Option<&'a [f32]>,
    /// Down biases, `[n_expert, n_embd]`.
    pub down: Option<&'a [f32]>,
}

fn rows<'a>(m: &HostMatrix<'a>) -> WeightRows<'a> {
    WeightRows { dtype: m.dtype, bytes: m.bytes, n_out: m.n_out }
}

/// Expert `e`'s row of a `[n_expert, width]` bias, or an error naming the sizes.
fn bias_row(b: Option<&[f32]>, e: usize, width: usize) -> Result<Option<&[f32]>, OpError> {
    let Some(b) = b else { return Ok(None) };
    b.get(e * width..(e + 1) * width).map(Some).ok_or_else(|| OpError::ShapeMismatch {
        op: "moe_ffn bias",
        expected: format!("a row of {width} values for expert {e}"),
        got: vec![b.len()],
    })
}

/// `out += Σ_i w_i · down_i(act(gate_i(x) + bg_i, up_i(x) + bu_i)) + bd_i` over the experts
/// `experts` (each with its routing weight `w_i`) of one token `x` (`[n_embd]`), added into `out`
/// in the order given: the same bits as computing the experts one after the other.
///
/// # Errors
/// [`OpError::Quant`] when a matrix's type has no product or its shape is not `[n_ff, n_embd]`
/// (gate, up) / `[n_embd, n_ff]` (down); [`OpError::ShapeMismatch`] for a bias without the
/// expert's row or an `out` that is not `n_embd` values.
pub fn experts_one_token(
    mode: MatmulMode,
    x: &[f32],
    experts: &[(HostExpert<'_>, f32)],
    biases: ExpertBiases<'_>,
    spec: &MoeSpec,
    out: &mut [f32],
) -> Result<(), OpError> {
    let (n_embd, ff, n) = (x.len(), spec.n_ff, experts.len());
    if out.len() != n_embd {
        return Err(OpError::ShapeMismatch {
            op: "moe_ffn",
            expected: format!("an output row of {n_embd} values"),
            got: vec![out.len()],
        });
    }
    let quant_err = |source| OpError::Quant { op: "moe_ffn (experts)", source };
    // Bias rows looked up before any work, so a missing row is an error, not a panic inside
    // the parallel region.
    let mut bias_rows = Vec::with_capacity(n);
    for (ex, _) in experts {
        let e = ex.id as usize;
        bias_rows.push((bias_row(biases.gate, e, ff)?, bias_row(biases.up, e, ff)?));
    }
    let mut down = vec![0f32; n * n_embd];
    let fused: Vec<ExpertRows<'_>> = experts
        .iter()
        .map(|(ex, _)| ExpertRows { gate: ex.gate.as_ref().map(rows), up: rows(&ex.up), down: rows(&ex.down) })
        .collect();
    let gating = |i: usize, first: usize, g: &[f32], u: &[f32], h: &mut [f32]| {
        let (bg, bu) = bias_rows[i];
        let biased = |v: f32, b: Option<&[f32]>, at: usize| b.map_or(v, |b| v + b[first + at]);
        if experts[i].0.gate.is_some() {
            for (at, (h, (&g, &u))) in h.iter_mut().zip(g.iter().zip(u)).enumerate() {
                *h = kernels::glu(biased(g, bg, at), biased(u, bu, at), spec.glu);
            }
        } else {
            let act = spec.glu.ungated_act();
            for (at, (h, &u)) in h.iter_mut().zip(u).enumerate() {
                *h = kernels::act(biased(u, bu, at), act);
            }
        }
    };
    if !one_region_enabled() || !quant::experts_one_token(&fused, ff, x, &gating, &mut down, mode).map_err(quant_err)? {
        experts_in_two_regions(&fused, ff, x, &gating, &mut down, mode).map_err(quant_err)?;
    }
    for (i, &(ref ex, w)) in experts.iter().enumerate() {
        let d = &down[i * n_embd..(i + 1) * n_embd];
        match bias_row(biases.down, ex.id as usize, n_embd)? {
            Some(b) => out.iter_mut().zip(d.iter().zip(b)).for_each(|(o, (&d, &b))| *o += w * (d + b)),
            None => out.iter_mut().zip(d).for_each(|(o, &d)| *o += w * d),
        }
    }
    Ok(())
}

/// False when the environment sets `DISKFORMER_EXPERTS_ONE_REGION=0`: then the experts run
/// in two regions as before the sixteenth session (for A/B runs). Read once.
fn one_region_enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("DISKFORMER_EXPERTS_ONE_REGION").map_or(true, |v| v.trim() != "0"))
}

/// [`quant::experts_one_token`]'s result for the products it does not take (activations in
/// f32, types without multi-row kernels): every gate and up product in one parallel region,
/// the gating on this thread, every down product in a second region.
fn experts_in_two_regions(
    experts: &[ExpertRows<'_>],
    ff: usize,
    x: &[f32],
    gating: &ExpertGating<'_>,
    down: &mut [f32],
    mode: MatmulMode,
) -> Result<(), QuantError> {
    let (n, n_embd) = (experts.len(), x.len());
    let mut gate = vec![0f32; n * ff];
    let mut up = vec![0f32; n * ff];
    {
        let mut ws = Vec::with_capacity(2 * n);
        let mut ys: Vec<&mut [f32]> = Vec::with_capacity(2 * n);
        for (ex, (g, u)) in experts.iter().zip(gate.chunks_mut(ff).zip(up.chunks_mut(ff))) {
            if let Some(gm) = ex.gate {
                ws.push(gm);
                ys.push(g);
            }
            ws.push(ex.up);
            ys.push(u);
        }
        let xs = vec![x; ws.len()];
        quant::matmul_each(&ws, n_embd, &xs, &mut ys, mode)?;
    }
    let mut h = vec![0f32; n * ff];
    for (i, ex) in experts.iter().enumerate() {
        let g = if ex.gate.is_some() { &gate[i * ff..(i + 1) * ff] } else { &[][..] };
        gating(i, 0, g, &up[i * ff..(i + 1) * ff], &mut h[i * ff..(i + 1) * ff]);
    }
    let ws: Vec<WeightRows<'_>> = experts.iter().map(|ex| ex.down).collect();
    let xs: Vec<&[f32]> = h.chunks(ff).collect();
    let mut ys: Vec<&mut [f32]> = down.chunks_mut(n_embd).collect();
    quant::matmul_each(&ws, ff, &xs, &mut ys, mode)
}
