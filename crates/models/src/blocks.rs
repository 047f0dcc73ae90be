//! Building blocks shared by the architecture files (llama.cpp's `build_attn`, `build_ffn`,
//! `build_moe_ffn`): each holds its weights, loads them by GGUF name and runs one forward.
//! What differs between architectures is passed as data (specs, optional tensors).

use crate::error::Result;
use crate::loader::Loader;
use compute::spec::{AttnSpec, Glu, MoeSpec, RopeSpec, RouteSpec};
use compute::{AttnStep, Backend, Experts, QkNorm};
use gguf::names::blk;

/// Attention weights of one layer: projections, optional biases and q/k norms, optional sinks.
pub struct Attention<B: Backend> {
    q: B::Weight,
    k: B::Weight,
    v: B::Weight,
    o: B::Weight,
    q_bias: Option<B::Tensor>,
    k_bias: Option<B::Tensor>,
    v_bias: Option<B::Tensor>,
    o_bias: Option<B::Tensor>,
    q_norm: Option<B::Tensor>,
    k_norm: Option<B::Tensor>,
    sinks: Option<B::Tensor>,
    /// Head counts, dims, scale, window.
    pub spec: AttnSpec,
    /// Rotary embedding (`None` for NoPE layers).
    pub rope: Option<RopeSpec>,
    norm_eps: f32,
}

impl<B: Backend> Attention<B> {
    /// Loads `blk.{il}.attn_{q,k,v,output}` with their optional `.bias`, `attn_{q,k}_norm` and
    /// `attn_sinks`. A q/k norm weight of `head_dim` values is applied per head, one of the
    /// full projection width over the whole projection (OLMoE).
    pub fn load(
        ld: &Loader<'_, B>,
        il: usize,
        n_embd: usize,
        spec: AttnSpec,
        rope: Option<RopeSpec>,
        norm_eps: f32,
    ) -> Result<Attention<B>> {
        let (qw, kw, vw) =
            (spec.n_head * spec.head_dim_k, spec.n_head_kv * spec.head_dim_k, spec.n_head_kv * spec.head_dim_v);
        let ow = spec.n_head * spec.head_dim_v;
        let norm = |name: &str, per_head: usize, full: usize| -> Result<Option<B::Tensor>> {
            let n = blk(il, name);
            match ld.host_opt(&n) {
                None => Ok(None),
                Some(h) if h.shape.iter().product::<usize>() == full && full != per_head => {
                    ld.vector(&n, &[full]).map(Some)
                }
                Some(_) => ld.vector(&n, &[per_head]).map(Some),
            }
        };
        Ok(Attention {
            q: ld.weight(&blk(il, "attn_q.weight"), &[qw, n_embd])?,
            k: ld.weight(&blk(il, "attn_k.weight"), &[kw, n_embd])?,
            v: ld.weight(&blk(il, "attn_v.weight"), &[vw, n_embd])?,
            o: ld.weight(&blk(il, "attn_output.weight"), &[n_embd, ow])?,
            q_bias: ld.vector_opt(&blk(il, "attn_q.bias"), &[qw])?,
            k_bias: ld.vector_opt(&blk(il, "attn_k.bias"), &[kw])?,
            v_bias: ld.vector_opt(&blk(il, "attn_v.bias"), &[vw])?,
            o_bias: ld.vector_opt(&blk(il, "attn_output.bias"), &[n_embd])?,
            q_norm: norm("attn_q_norm.weight", spec.head_dim_k, qw)?,
            k_norm: norm("attn_k_norm.weight", spec.head_dim_k, kw)?,
            sinks: ld.vector_opt(&blk(il, "attn_sinks.weight"), &[spec.n_head])?,
            spec,
            rope,
            norm_eps,
        })
    }

    /// Bytes of KV cache per position.
    pub fn cache_widths(&self) -> (usize, usize) {
        (self.spec.n_head_kv * self.spec.head_dim_k, self.spec.n_head_kv * self.spec.head_dim_v)
    }

    /// Attention of `x` (`[n, n_embd]`) up to the output projection: `[n, n_head * head_dim_v]`.
    fn attend(&self, b: &B, x: &B::Tensor, cache: &mut B::Cache, pos0: usize, positions: &[u32]) -> Result<B::Tensor> {
        let n = positions.len();
        let [q, k, v] = b.matmul_many(x, [&self.q, &self.k, &self.v])?;
        let with_bias = |y: B::Tensor, bias: &Option<B::Tensor>| -> Result<B::Tensor> {
            Ok(match bias {
                Some(bb) => b.add(&y, bb)?,
                None => y,
            })
        };
        let q = with_bias(q, &self.q_bias)?;
        let k = with_bias(k, &self.k_bias)?;
        let v = with_bias(v, &self.v_bias)?;
        // Per-head norms of both go into the attention where the back end norms each head as
        // it loads it (one dispatch less a layer on the GPU's decode path).
        let inside = self.per_head_qk_norms(b).filter(|_| b.attention_norms_qk(n, &self.spec));
        let (q, k) = match inside {
            Some(_) => (q, k),
            None => self.qk_norms(b, q, k, n)?,
        };
        let step = AttnStep {
            q: &q,
            k: &k,
            v: &v,
            pos0,
            positions,
            rope: self.rope.as_ref(),
            spec: &self.spec,
            sinks: self.sinks.as_ref(),
            qk_norm: inside.map(|(q, k)| QkNorm { q, k, eps: self.norm_eps }),
        };
        Ok(b.rope_attention(&step, cache)?)
    }

    /// Self-attention of `x` (`[n, n_embd]`) at positions `pos0..`, updating `cache`.
    pub fn forward(
        &self,
        b: &B,
        x: &B::Tensor,
        cache: &mut B::Cache,
        pos0: usize,
        positions: &[u32],
    ) -> Result<B::Tensor> {
        let a = self.attend(b, x, cache, pos0, positions)?;
        let y = b.matmul(&a, &self.o)?;
        Ok(match &self.o_bias {
            Some(bb) => b.add(&y, bb)?,
            None => y,
        })
    }

    /// `residual + forward(x, ..)`: the residual connection around the attention, added by the
    /// output projection itself when it has no bias ([`Backend::matmul_add`]).
    pub fn forward_residual(
        &self,
        b: &B,
        x: &B::Tensor,
        residual: B::Tensor,
        cache: &mut B::Cache,
        pos0: usize,
        positions: &[u32],
    ) -> Result<B::Tensor> {
        let a = self.attend(b, x, cache, pos0, positions)?;
        match &self.o_bias {
            None => Ok(b.matmul_add(&a, &self.o, residual)?),
            Some(bb) => Ok(b.add(&residual, &b.add(&b.matmul(&a, &self.o)?, bb)?)?),
        }
    }

    /// The q and k norms: per head in one op when both are per head ([`Backend::rms_norm_pair`]:
    /// one GPU dispatch), else each as [`Self::qk_norm`].
    fn qk_norms(&self, b: &B, q: B::Tensor, k: B::Tensor, n: usize) -> Result<(B::Tensor, B::Tensor)> {
        let hd = self.spec.head_dim_k;
        if let Some((wq, wk)) = self.per_head_qk_norms(b) {
            let (n_q, n_k) = (self.spec.n_head, self.spec.n_head_kv);
            let q = b.reshape(q, &[n * n_q, hd])?;
            let k = b.reshape(k, &[n * n_k, hd])?;
            let (q, k) = b.rms_norm_pair(&q, Some(wq), &k, Some(wk), self.norm_eps)?;
            return Ok((b.reshape(q, &[n, n_q * hd])?, b.reshape(k, &[n, n_k * hd])?));
        }
        Ok((
            self.qk_norm(b, q, self.q_norm.as_ref(), self.spec.n_head, n)?,
            self.qk_norm(b, k, self.k_norm.as_ref(), self.spec.n_head_kv, n)?,
        ))
    }

    /// The q and k norms' weights when both are per head (`[head_dim_k]`).
    fn per_head_qk_norms<'w>(&'w self, b: &B) -> Option<(&'w B::Tensor, &'w B::Tensor)> {
        let per_head = |w: &&B::Tensor| b.shape(w).iter().product::<usize>() == self.spec.head_dim_k;
        Some((self.q_norm.as_ref().filter(per_head)?, self.k_norm.as_ref().filter(per_head)?))
    }

    fn qk_norm(&self, b: &B, t: B::Tensor, w: Option<&B::Tensor>, heads: usize, n: usize) -> Result<B::Tensor> {
        let Some(w) = w else { return Ok(t) };
        let hd = self.spec.head_dim_k;
        if b.shape(w).iter().product::<usize>() == hd {
            let t = b.reshape(t, &[n * heads, hd])?;
            let t = b.rms_norm(&t, Some(w), self.norm_eps)?;
            Ok(b.reshape(t, &[n, heads * hd])?)
        } else {
            Ok(b.rms_norm(&t, Some(w), self.norm_eps)?)
        }
    }
}

/// A dense feed-forward block: `down(glu(gate(x), up(x)))`, or `down(act(up(x)))` without a gate.
pub struct Ffn<B: Backend> {
    gate: Option<B::Weight>,
    up: B::Weight,
    down: B::Weight,
    gate_bias: Option<B::Tensor>,
    up_bias: Option<B::Tensor>,
    down_bias: Option<B::Tensor>,
    glu: Glu,
}

impl<B: Backend> Ffn<B> {
    /// Loads `blk.{il}.ffn_{gate,up,down}{suffix}.weight` (suffix "" for the dense FFN,
    /// "_shexp" for a shared expert) and their optional biases.
    pub fn load(ld: &Loader<'_, B>, il: usize, suffix: &str, n_embd: usize, n_ff: usize, glu: Glu) -> Result<Ffn<B>> {
        let name = |p: &str, kind: &str| blk(il, &format!("ffn_{p}{suffix}.{kind}"));
        Ok(Ffn {
            gate: ld.weight_opt(&name("gate", "weight"), &[n_ff, n_embd])?,
            up: ld.weight(&name("up", "weight"), &[n_ff, n_embd])?,
            down: ld.weight(&name("down", "weight"), &[n_embd, n_ff])?,
            gate_bias: ld.vector_opt(&name("gate", "bias"), &[n_ff])?,
            up_bias: ld.vector_opt(&name("up", "bias"), &[n_ff])?,
            down_bias: ld.vector_opt(&name("down", "bias"), &[n_embd])?,
            glu,
        })
    }

    /// The block's output for `x` (`[n, n_embd]`).
    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let y = b.matmul(&self.hidden(b, x)?, &self.down)?;
        Ok(match &self.down_bias {
            Some(bb) => b.add(&y, bb)?,
            None => y,
        })
    }

    /// `residual + forward(x)`: the residual connection around the block, added by the down
    /// projection itself when it has no bias ([`Backend::matmul_add`]).
    pub fn forward_residual(&self, b: &B, x: &B::Tensor, residual: B::Tensor) -> Result<B::Tensor> {
        let h = self.hidden(b, x)?;
        match &self.down_bias {
            None => Ok(b.matmul_add(&h, &self.down, residual)?),
            Some(bb) => Ok(b.add(&residual, &b.add(&b.matmul(&h, &self.down)?, bb)?)?),
        }
    }

    /// The activations the down projection reads: `glu(gate(x), up(x))` or `act(up(x))`.
    fn hidden(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let with_bias = |y: B::Tensor, bias: &Option<B::Tensor>| -> Result<B::Tensor> {
            Ok(match bias {
                Some(bb) => b.add(&y, bb)?,
                None => y,
            })
        };
        let h = match &self.gate {
            Some(g) if self.gate_bias.is_none() && self.up_bias.is_none() => b.matmul_glu(x, g, &self.up, self.glu)?,
            Some(g) => {
                let [gate, up] = b.matmul_many(x, [g, &self.up])?;
                let up = with_bias(up, &self.up_bias)?;
                let gate = with_bias(gate, &self.gate_bias)?;
                b.glu(&gate, &up, self.glu)?
            }
            None => {
                let up = with_bias(b.matmul(x, &self.up)?, &self.up_bias)?;
                match self.glu {
                    Glu::Plain(a) => b.act(&up, a)?,
                    Glu::SwiGluOai { .. } => b.act(&up, compute::spec::Act::Silu)?,
                }
            }
        };
        Ok(h)
    }
}

/// A mixture-of-experts block: router, routing, expert FFN, optional shared expert.
pub struct Moe<B: Backend> {
    router: B::Weight,
    router_bias: Option<B::Tensor>,
    selection_bias: Option<B::Tensor>,
    experts: Experts<B>,
    shared: Option<Ffn<B>>,
    /// How logits become (ids, weights).
    pub route: RouteSpec,
    /// Expert count, size and activation.
    pub spec: MoeSpec,
}

impl<B: Backend> Moe<B> {
    /// Loads `blk.{il}.ffn_gate_inp` (router), `exp_probs_b.bias` (selection bias),
    /// `ffn_{gate,up,down}_exps` (stacked experts) with optional biases, and
    /// `ffn_{gate,up,down}_shexp` (shared expert of `n_ff_shared`, when given and present).
    pub fn load(
        ld: &Loader<'_, B>,
        il: usize,
        n_embd: usize,
        spec: MoeSpec,
        route: RouteSpec,
        n_ff_shared: Option<usize>,
    ) -> Result<Moe<B>> {
        let (ne, ff) = (spec.n_expert, spec.n_ff);
        let shared = match n_ff_shared {
            Some(nfs) if ld.has(&blk(il, "ffn_up_shexp.weight")) => {
                Some(Ffn::load(ld, il, "_shexp", n_embd, nfs, spec.glu)?)
            }
            _ => None,
        };
        Ok(Moe {
            router: ld.weight(&blk(il, "ffn_gate_inp.weight"), &[ne, n_embd])?,
            router_bias: ld.vector_opt(&blk(il, "ffn_gate_inp.bias"), &[ne])?,
            selection_bias: ld.vector_opt(&blk(il, "exp_probs_b.bias"), &[ne])?,
            experts: Experts {
                layer: il,
                gate: ld.weight_opt(&blk(il, "ffn_gate_exps.weight"), &[ne, ff, n_embd])?,
                up: ld.weight(&blk(il, "ffn_up_exps.weight"), &[ne, ff, n_embd])?,
                down: ld.weight(&blk(il, "ffn_down_exps.weight"), &[ne, n_embd, ff])?,
                gate_bias: ld.vector_opt(&blk(il, "ffn_gate_exps.bias"), &[ne, ff])?,
                up_bias: ld.vector_opt(&blk(il, "ffn_up_exps.bias"), &[ne, ff])?,
                down_bias: ld.vector_opt(&blk(il, "ffn_down_exps.bias"), &[ne, n_embd])?,
            },
            shared,
            route,
            spec,
        })
    }

    /// Routed experts (plus the shared expert) for `x` (`[n, n_embd]`).
    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        let routing = match &self.router_bias {
            // The router's product and the routing in one op (one GPU dispatch for a token).
            None => b.router_route(x, &self.router, self.selection_bias.as_ref(), &self.route)?,
            Some(rb) => {
                let logits = b.add(&b.matmul(x, &self.router)?, rb)?; // [n, n_expert]
                b.route(&logits, self.selection_bias.as_ref(), &self.route)?
            }
        }; // ids, weights: [n, k]
        let y = b.moe_ffn(x, &routing, &self.experts, &self.spec)?;
        match &self.shared {
            Some(s) => Ok(b.add(&y, &s.forward(b, x)?)?),
            None => Ok(y),
        }
    }
}

/// A layer's feed-forward part: dense or mixture of experts.
pub enum FfnOrMoe<B: Backend> {
    /// Dense.
    Dense(Ffn<B>),
    /// Mixture of experts.
    Moe(Moe<B>),
}

impl<B: Backend> FfnOrMoe<B> {
    /// Runs whichever it is.
    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        match self {
            FfnOrMoe::Dense(f) => f.forward(b, x),
            FfnOrMoe::Moe(m) => m.forward(b, x),
        }
    }

    /// `residual + forward(x)` (the dense block adds in its down projection).
    pub fn forward_residual(&self, b: &B, x: &B::Tensor, residual: B::Tensor) -> Result<B::Tensor> {
        match self {
            FfnOrMoe::Dense(f) => f.forward_residual(b, x, residual),
            FfnOrMoe::Moe(m) => Ok(b.add(&residual, &m.forward(b, x)?)?),
        }
    }
}
