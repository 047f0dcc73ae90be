//! Guesses of a layer's experts from the previous layer's input: the layer's router applied to
//! the input of the layer before it. The residual stream changes little over one layer, so the
//! guess holds most of what the layer will select (97.9% of guessed experts were selected on the
//! synthetic Qwen3-30B-A3B, fifteenth session), where the layer's previous selection, the
//! prefetch's earlier prediction, shares about a fifth of it under uniform routing.
//!
//! The routers are kept in Q8_0 (8-bit weights, a scale per 32): a guess is computed on the
//! calling thread before each MoE layer, and the f32 router (1 MB per layer of Qwen3-30B-A3B)
//! read from RAM took longer than the layer's slack; a quarter of the bytes and the SIMD Q8_0
//! product do not. A guess only orders the experts, so the rounding matters only between
//! near-equal logits. A selection bias or group limit (DeepSeek-V3) is left out: a guess.

use compute::quant::{self, Kernel};
use gguf::{GgmlType, GgufModel};

/// Rows of input past which no guess is made: a prompt batch touches most of a layer's experts
/// anyway, and a guess per row (~25 us for Qwen3-30B-A3B's router) would slow its prefill.
pub(crate) const GUESS_ROWS_MAX: usize = 4;

/// One router `[n_expert, n_embd]` in Q8_0.
struct Router {
    q8: Vec<u8>,
    n_out: usize,
    n_embd: usize,
}

impl Router {
    /// `None` when `n_embd` is not whole Q8_0 blocks or the weights are not whole rows.
    fn new(w: &[f32], n_embd: usize) -> Option<Router> {
        let t = GgmlType::Q8_0;
        if n_embd == 0 || !n_embd.is_multiple_of(t.block_elems()) || !w.len().is_multiple_of(n_embd) {
            return None;
        }
        let mut q8 = vec![0u8; w.len() / t.block_elems() * t.block_bytes()];
        quant::quantize(t, w, &mut q8).ok()?;
        Some(Router { q8, n_out: w.len() / n_embd, n_embd })
    }

    /// The logits of one row `x` (`n_embd` values), approximately. With `on_pool` false on this
    /// thread, in pieces of rows small enough that the product does not go to the thread pool
    /// (where the experts of the layer being computed may be running); else in one product,
    /// which the pool shares (for a caller whose pool is idle: ~68 us a guess of Qwen3-30B-A3B
    /// in pieces on the H200's host, twenty-fifth session).
    fn logits(&self, x: &[f32], on_pool: bool) -> Vec<f32> {
        /// Below `compute::quant`'s threshold for running a product on the pool.
        const SERIAL_VALUES: usize = 1 << 15;
        let t = GgmlType::Q8_0;
        let row_bytes = self.n_embd / t.block_elems() * t.block_bytes();
        let rows = if on_pool { self.n_out } else { (SERIAL_VALUES / self.n_embd).max(1) };
        let mut y = vec![0f32; self.n_out];
        for (w, y) in self.q8.chunks(rows * row_bytes).zip(y.chunks_mut(rows)) {
            if quant::matmul_quantized(t, w, y.len(), self.n_embd, x, y, Kernel::best()).is_err() {
                y.iter_mut().for_each(|v| *v = 0.0);
            }
        }
        y
    }
}

/// Every MoE layer's router, for guesses.
pub(crate) struct Guesses {
    routers: Vec<Option<Router>>,
}

impl Guesses {
    /// The routers (`blk.N.ffn_gate_inp.weight`) of the layers that have experts (`has_experts`,
    /// by layer), read and quantized once. Layers whose router is missing or of another shape
    /// than `[n_embd, n_expert]` get no guesses.
    pub(crate) fn from_model(model: &GgufModel, has_experts: &[bool]) -> Guesses {
        let routers = has_experts
            .iter()
            .enumerate()
            .map(|(layer, &has)| {
                let t = model.tensor_opt(&format!("blk.{layer}.ffn_gate_inp.weight")).filter(|_| has)?;
                let [k, n_out] = *t.shape() else { return None };
                let mut w = vec![0f32; (k * n_out) as usize];
                quant::dequantize(t.dtype(), t.data, &mut w).ok()?;
                Router::new(&w, k as usize)
            })
            .collect();
        Guesses { routers }
    }

    /// Bytes the routers take (counted against the RAM budget).
    pub(crate) fn bytes(&self) -> u64 {
        self.routers.iter().flatten().map(|r| r.q8.len() as u64).sum()
    }

    /// The experts `layer`'s router ranks highest for the rows of `x` (`[n, n_embd]`): each
    /// row's top `k` by logit (ties to the lower id), their union in row order, at most `cap`.
    /// Empty when the layer has no router here, `x` is not whole rows of its width, or it has
    /// more than [`GUESS_ROWS_MAX`] rows. `on_pool`: whether the product may use the thread pool
    /// ([`Router::logits`]).
    pub(crate) fn guess(&self, layer: usize, x: &[f32], k: usize, cap: usize, on_pool: bool) -> Vec<u32> {
        let Some(r) = self.routers.get(layer).and_then(|r| r.as_ref()) else { return Vec::new() };
        if x.is_empty() || !x.len().is_multiple_of(r.n_embd) || x.len() / r.n_embd > GUESS_ROWS_MAX {
            return Vec::new();
        }
        let mut out: Vec<u32> = Vec::new();
        for row in x.chunks_exact(r.n_embd) {
            let logits = r.logits(row, on_pool);
            let mut order: Vec<u32> = (0..logits.len() as u32).collect();
            order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
            for e in order.into_iter().take(k) {
                if out.len() >= cap {
                    return out;
                }
                if !out.contains(&e) {
                    out.push(e);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Q8_0 router's top k is the f32 router's where the logits are apart.
    #[test]
    fn guesses_are_the_f32_routers_top_k() {
        let n_embd = 64;
        let n_expert = 16;
        let w: Vec<f32> = (0..n_expert * n_embd).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let xs: Vec<f32> = (0..2 * n_embd).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
        let g = Guesses { routers: vec![None, Router::new(&w, n_embd)] };
        for (t, x) in xs.chunks(n_embd).enumerate() {
            let exact: Vec<f32> = w.chunks(n_embd).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect();
            let mut order: Vec<usize> = (0..n_expert).collect();
            order.sort_by(|&a, &b| exact[b].total_cmp(&exact[a]));
            let got = g.guess(1, x, 4, 16, t % 2 == 1);
            let scale = exact.iter().fold(0f32, |m, &v| m.max(v.abs()));
            // Every guessed expert is within the rounding of the f32 top 4's fourth logit.
            for &e in &got {
                assert!(
                    exact[e as usize] >= exact[order[3]] - 0.02 * scale,
                    "row {t}: {got:?} against {order:?} ({exact:?})"
                );
            }
            assert_eq!(got.len(), 4);
        }
        // Two rows: the union, capped.
        assert_eq!(g.guess(1, &xs, 4, 5, false).len(), 5);
        // Past the row limit, no router, or a width that is not the router's: no guess.
        assert!(g.guess(1, &xs.repeat(GUESS_ROWS_MAX), 4, 16, false).is_empty());
        assert!(g.guess(0, &xs, 4, 16, false).is_empty());
        assert!(g.guess(1, &xs[..10], 4, 16, false).is_empty());
        // Widths of no whole Q8_0 blocks get no router.
        assert!(Router::new(&[0.0; 4], 2).is_none());
    }
}
