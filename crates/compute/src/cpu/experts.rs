//! A mixture-of-experts layer's experts for one token on the CPU: every expert's gate and up
//! products in one parallel region, then every down product in one.
//!
//! Why one region for all the experts: a decode step of Qwen3-30B-A3B computes ~380 experts of
//! three matrices each. One parallel region per matrix (each ~0.9 MB, split over 16 threads)
//! paid the pool's fork and join ~1150 times per token: on the H200 host's 16 cores the
//! experts ran at ~24 GB/s (0.10 ms per expert) where the memory gives llama.cpp twice that.
//! With two regions per layer the threads stream the layer's experts back to back. The GPU
//! expert tier computes its CPU share with the same function.

use crate::backend::{HostExpert, HostMatrix};
use crate::cpu::kernels;
use crate::error::OpError;
use crate::quant::{self, MatmulMode, WeightRows};
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
    let mut gate = vec![0f32; n * ff];
    let mut up = vec![0f32; n * ff];
    {
        let mut ws = Vec::with_capacity(2 * n);
        let mut ys: Vec<&mut [f32]> = Vec::with_capacity(2 * n);
        for ((ex, _), (g, u)) in experts.iter().zip(gate.chunks_mut(ff).zip(up.chunks_mut(ff))) {
            if let Some(gm) = &ex.gate {
                ws.push(rows(gm));
                ys.push(g);
            }
            ws.push(rows(&ex.up));
            ys.push(u);
        }
        let xs = vec![x; ws.len()];
        quant::matmul_each(&ws, n_embd, &xs, &mut ys, mode).map_err(quant_err)?;
    }
    let mut h = vec![0f32; n * ff];
    for (i, (ex, _)) in experts.iter().enumerate() {
        let e = ex.id as usize;
        let (g, u, hi) = (&mut gate[i * ff..(i + 1) * ff], &mut up[i * ff..(i + 1) * ff], &mut h[i * ff..(i + 1) * ff]);
        if let Some(b) = bias_row(biases.up, e, ff)? {
            u.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
        if ex.gate.is_some() {
            if let Some(b) = bias_row(biases.gate, e, ff)? {
                g.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
            hi.iter_mut().zip(g.iter().zip(u.iter())).for_each(|(h, (&g, &u))| *h = kernels::glu(g, u, spec.glu));
        } else {
            let act = spec.glu.ungated_act();
            hi.iter_mut().zip(u.iter()).for_each(|(h, &u)| *h = kernels::act(u, act));
        }
    }
    let mut down = vec![0f32; n * n_embd];
    {
        let ws: Vec<WeightRows<'_>> = experts.iter().map(|(ex, _)| rows(&ex.down)).collect();
        let xs: Vec<&[f32]> = h.chunks(ff).collect();
        let mut ys: Vec<&mut [f32]> = down.chunks_mut(n_embd).collect();
        quant::matmul_each(&ws, ff, &xs, &mut ys, mode).map_err(quant_err)?;
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
