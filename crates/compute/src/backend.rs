//! The op set: what a back end must compute. Models are written against [`Backend`] and never
//! ask which back end they run on.
//!
//! Conventions: activations are f32, row-major, shape `[n_tokens, width]` (PyTorch order, the
//! reverse of ggml's); a weight matrix has shape `[n_out, k]` and `matmul` computes
//! `x · Wᵀ`. Every op checks its shapes and returns [`OpError`] instead of panicking.

use crate::error::OpError;
use crate::spec::{Act, AttnSpec, Glu, MoeSpec, RopeSpec, RouteSpec};
use crate::weight::HostWeight;

/// Expert weights of one MoE layer: stacked `[n_expert, n_out, k]` matrices and optional
/// per-expert biases `[n_expert, n_out]`.
pub struct Experts<B: Backend> {
    /// Layer index (the key under which a pager caches these experts).
    pub layer: usize,
    /// Gate projections `[n_expert, n_ff, n_embd]` (absent for non-gated experts).
    pub gate: Option<B::Weight>,
    /// Up projections `[n_expert, n_ff, n_embd]`.
    pub up: B::Weight,
    /// Down projections `[n_expert, n_embd, n_ff]`.
    pub down: B::Weight,
    /// Gate biases `[n_expert, n_ff]`.
    pub gate_bias: Option<B::Tensor>,
    /// Up biases `[n_expert, n_ff]`.
    pub up_bias: Option<B::Tensor>,
    /// Down biases `[n_expert, n_embd]`.
    pub down_bias: Option<B::Tensor>,
}

/// One expert matrix `[n_out, k]` in its stored type, as bytes in host memory.
#[derive(Clone, Copy, Debug)]
pub struct HostMatrix<'a> {
    /// Stored element type.
    pub dtype: gguf::GgmlType,
    /// The matrix's bytes (`n_out` rows of `k` elements).
    pub bytes: &'a [u8],
    /// Rows.
    pub n_out: usize,
    /// Row length in elements.
    pub k: usize,
}

/// One expert's matrices in host memory, lent by an [`ExpertStore`] for one computation.
#[derive(Clone, Copy, Debug)]
pub struct HostExpert<'a> {
    /// Expert index within its layer.
    pub id: u32,
    /// Gate projection `[n_ff, n_embd]` (absent for non-gated experts).
    pub gate: Option<HostMatrix<'a>>,
    /// Up projection `[n_ff, n_embd]`.
    pub up: HostMatrix<'a>,
    /// Down projection `[n_embd, n_ff]`.
    pub down: HostMatrix<'a>,
}

/// Where a back end finds expert matrices when they are not resident: a cache that reads them
/// from disk under a memory budget (crates/pager). A back end given a store asks it at every
/// `moe_ffn` instead of using [`Experts`]' stacked weights, so model files never learn whether
/// their experts are resident or paged; biases stay in [`Experts`] (they are small).
pub trait ExpertStore: Send + Sync + std::fmt::Debug {
    /// Makes experts `ids` (distinct) of `layer` available in host memory and calls `compute`
    /// with them, in the order of `ids`, in one or more consecutive groups: a store whose budget
    /// holds fewer experts than `ids` lends them a group at a time. The experts stay in place
    /// until `compute` returns; its error is passed through.
    ///
    /// # Errors
    /// The store cannot read an expert (I/O, unknown layer or id), or `compute` failed.
    fn with_host_experts(
        &self,
        layer: usize,
        ids: &[u32],
        compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
    ) -> Result<(), OpError>;

    /// [`ExpertStore::with_host_experts`] for a call of `n_tokens` tokens in which `tokens[i]`
    /// of them chose `ids[i]`: a store that ranks experts by use weighs a batch by its tokens
    /// ([`crate::lfu::note_call`]). The default ignores the counts.
    ///
    /// # Errors
    /// As [`ExpertStore::with_host_experts`].
    fn with_host_experts_of_tokens(
        &self,
        layer: usize,
        ids: &[u32],
        tokens: &[u32],
        n_tokens: usize,
        compute: &mut dyn FnMut(&[HostExpert<'_>]) -> Result<(), OpError>,
    ) -> Result<(), OpError> {
        let _ = (tokens, n_tokens);
        self.with_host_experts(layer, ids, compute)
    }

    /// Called before [`ExpertStore::with_host_experts`] of a `moe_ffn` with its input rows `x`
    /// (`[n, n_embd]`) and experts per token `k`: a store that reads ahead may guess the next
    /// layer's experts from it (that layer's router on this input). A hint: the default ignores
    /// it.
    fn note_input(&self, _layer: usize, _x: &[f32], _k: usize) {}

    /// A guess of the experts `layer`'s router selects, from rows `x` (`[n, n_embd]`) that are
    /// not its own input but an earlier layer's (the residual stream changes little over a
    /// layer): each row's top `k`, their union in row order. Empty where the store keeps no
    /// routers for guessing (the default) or has none for `layer`.
    fn guess_experts(&self, _layer: usize, _x: &[f32], _k: usize) -> Vec<u32> {
        Vec::new()
    }

    /// Reads the host copies of experts `ids` of `layer` into the CPU's caches, ahead of a job
    /// that will compute them ([`crate::cpu::cache_fill::read_into_cache`] on up to `threads`
    /// threads), until `stop` returns true. Only experts already in host memory are read (no
    /// I/O); a hint: the default does nothing. Returns the bytes read.
    fn read_ahead(&self, _layer: usize, _ids: &[u32], _threads: usize, _stop: &(dyn Fn() -> bool + Sync)) -> u64 {
        0
    }
}

/// Routing result: for each token, `k` expert ids and their weights.
pub struct Routing<B: Backend> {
    /// Expert ids `[n_tokens, k]`.
    pub ids: Vec<u32>,
    /// Weights `[n_tokens, k]`.
    pub weights: B::Tensor,
    /// Experts per token.
    pub k: usize,
}

/// Inputs of one Mamba-2 selective scan ([`Backend::ssm_scan`]) over `n` tokens of one sequence.
/// `n_head` is the length of `a`; `head_dim` = width of `x` / `n_head`; `d_state` = width of
/// `b` / `n_group`. Heads `h` use group `h / (n_head / n_group)` of `b` and `c`.
pub struct SsmScan<'a, B: Backend> {
    /// Inputs `[n, n_head * head_dim]`.
    pub x: &'a B::Tensor,
    /// Raw time steps `[n, n_head]`: the op adds `dt_bias` and applies softplus.
    pub dt: &'a B::Tensor,
    /// Input projections B `[n, n_group * d_state]`.
    pub b: &'a B::Tensor,
    /// Output projections C `[n, n_group * d_state]`.
    pub c: &'a B::Tensor,
    /// Decay rates A `[n_head]`, already negative (-exp(A_log), as GGUF stores `ssm_a`).
    pub a: &'a B::Tensor,
    /// Skip weights D `[n_head]` (y += D * x).
    pub d: Option<&'a B::Tensor>,
    /// Time-step bias `[n_head]`.
    pub dt_bias: Option<&'a B::Tensor>,
    /// Groups sharing B and C (divides `n_head`).
    pub n_group: usize,
}

/// What [`SsmScan::check`] finds of a scan's shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsmDims {
    /// Tokens.
    pub n: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub d_state: usize,
}

impl<B: Backend> SsmScan<'_, B> {
    /// The scan's dimensions, after checking every input and `state` `[n_head, head_dim,
    /// d_state]` against them (one check for every back end, so that each rejects the same
    /// shapes with the same error).
    ///
    /// # Errors
    /// [`OpError::ShapeMismatch`] naming the first input whose shape does not fit.
    pub fn check(&self, backend: &B, state: &B::Tensor) -> Result<SsmDims, OpError> {
        let shape = |t: &B::Tensor| backend.shape(t).to_vec();
        // As the back ends' tensors count them: the last dimension is the width (1 for a
        // scalar), the rest rows.
        let len = |t: &B::Tensor| backend.shape(t).iter().product::<usize>();
        let width = |t: &B::Tensor| backend.shape(t).last().copied().unwrap_or(1);
        let rows = |t: &B::Tensor| len(t) / width(t).max(1);
        let bad = |expected: String, got: Vec<usize>| OpError::ShapeMismatch { op: "ssm_scan", expected, got };
        let n_head = len(self.a);
        let n = rows(self.x);
        // `n / d * d == n`: divisibility without `%` (clippy wants `is_multiple_of`, newer than
        // the workspace's rust-version).
        let divides = |d: usize, n: usize| d != 0 && n / d * d == n;
        if !divides(self.n_group, n_head) || !divides(n_head, width(self.x)) {
            return Err(bad(
                format!("x [n, {n_head} heads * head_dim] and {} groups dividing the heads", self.n_group),
                shape(self.x),
            ));
        }
        let head_dim = width(self.x) / n_head;
        let group_width = width(self.b);
        if !divides(self.n_group, group_width) || width(self.c) != group_width {
            return Err(bad(format!("b and c [n, {} groups * d_state]", self.n_group), shape(self.c)));
        }
        let d_state = group_width / self.n_group;
        for (t, w) in [(self.dt, n_head), (self.b, group_width), (self.c, group_width)] {
            if rows(t) != n || width(t) != w {
                return Err(bad(format!("[{n}, {w}]"), shape(t)));
            }
        }
        for t in [self.d, self.dt_bias].into_iter().flatten() {
            if len(t) != n_head {
                return Err(bad(format!("[{n_head}]"), shape(t)));
            }
        }
        if len(state) != n_head * head_dim * d_state {
            return Err(bad(format!("state [{n_head}, {head_dim}, {d_state}]"), shape(state)));
        }
        Ok(SsmDims { n, n_head, head_dim, d_state })
    }
}

/// One attention step before rotary embedding, for [`Backend::rope_attention`]: the layer's
/// projections of `n` tokens at positions `pos0..pos0 + n`.
pub struct AttnStep<'a, B: Backend> {
    /// Queries `[n, n_head * head_dim_k]`, not yet rotated.
    pub q: &'a B::Tensor,
    /// Keys `[n, n_head_kv * head_dim_k]`, not yet rotated.
    pub k: &'a B::Tensor,
    /// Values `[n, n_head_kv * head_dim_v]`.
    pub v: &'a B::Tensor,
    /// Cache position of the first token.
    pub pos0: usize,
    /// Rotary position of each token (`n` of them).
    pub positions: &'a [u32],
    /// Rotary embedding of q and k (`None`: NoPE layer).
    pub rope: Option<&'a RopeSpec>,
    /// Heads, dims, scale, window, soft-cap.
    pub spec: &'a AttnSpec,
    /// One extra softmax logit per head (`[n_head]`, gpt-oss).
    pub sinks: Option<&'a B::Tensor>,
    /// Per-head RMS norms of q and k before the rotation (Qwen3's `attn_q_norm`/`attn_k_norm`),
    /// done inside the attention by a back end whose [`Backend::attention_norms_qk`] says so;
    /// `None` when the caller normed them already (or the layer has none).
    pub qk_norm: Option<QkNorm<'a, B>>,
}

/// The per-head q and k norms an [`AttnStep`] carries into the attention: `x * w / rms(x)` over
/// each head's `head_dim_k` values, as [`Backend::rms_norm`] of rows of one head.
pub struct QkNorm<'a, B: Backend> {
    /// The q norm's weight (`[head_dim_k]`).
    pub q: &'a B::Tensor,
    /// The k norm's weight (`[head_dim_k]`).
    pub k: &'a B::Tensor,
    /// The norms' epsilon.
    pub eps: f32,
}

impl<B: Backend> Clone for QkNorm<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for QkNorm<'_, B> {}

/// A compute back end. `Tensor` holds f32 activations; `Weight` a matrix in its stored type;
/// `Cache` one layer's attention KV cache.
pub trait Backend: Send + Sync + Sized + Clone {
    /// An f32 activation tensor.
    type Tensor: Send + Sync;
    /// A weight matrix (possibly quantized) as this back end keeps it.
    type Weight: Send + Sync;
    /// One attention layer's KV cache.
    type Cache: Send + Sync;

    /// A short name ("cpu", "wgpu").
    fn name(&self) -> &'static str;

    /// Whether a model step's work reaches the host's thread pool often enough that its idle
    /// workers should poll for it through the step instead of parking between jobs
    /// (`cpu::warm::run_step` says why parking costs): the CPU back end's every op, a GPU's
    /// expert tier whose misses the CPU computes while the GPU waits. False by default: a back
    /// end that only waits on its device would have the polling threads burn cores for nothing.
    fn step_feeds_thread_pool(&self) -> bool {
        false
    }

    // ---- data movement ----
    /// A tensor from host values.
    #[allow(clippy::wrong_self_convention)] // a method of the back end that makes a tensor, not a conversion of self
    fn from_host(&self, data: &[f32], shape: &[usize]) -> Result<Self::Tensor, OpError>;
    /// Host copy of a tensor's values.
    fn to_host(&self, t: &Self::Tensor) -> Result<Vec<f32>, OpError>;

    /// [`Backend::to_host`] into `out`, its memory reused (resized to the tensor's length): a
    /// decode loop reading logits every step keeps one buffer instead of a fresh one whose
    /// pages the copy faults in at every step (110-180 us of a 1 MB readback's ~160-245 on the
    /// dev box, twentieth session). The default allocates, as `to_host` does.
    ///
    /// # Errors
    /// As [`Backend::to_host`].
    fn to_host_into(&self, t: &Self::Tensor, out: &mut Vec<f32>) -> Result<(), OpError> {
        *out = self.to_host(t)?;
        Ok(())
    }
    /// A tensor's shape.
    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];
    /// The same values under another shape with the same element count.
    fn reshape(&self, t: Self::Tensor, shape: &[usize]) -> Result<Self::Tensor, OpError>;
    /// Makes a weight usable by this back end (the CPU borrows the memory map; a GPU uploads).
    fn weight(&self, w: &HostWeight) -> Result<Self::Weight, OpError>;
    /// A small weight (norm, bias) dequantized to an f32 tensor of the given shape.
    fn weight_f32(&self, w: &HostWeight, shape: &[usize]) -> Result<Self::Tensor, OpError> {
        let v = w.to_f32().map_err(|e| OpError::Weight { name: w.name.clone(), why: e.to_string() })?;
        self.from_host(&v, shape)
    }

    // ---- linear algebra ----
    /// Rows of an embedding table `[n_vocab, n_embd]` for `ids`: `[ids.len(), n_embd]`.
    fn get_rows(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor, OpError>;
    /// `x [n, k] · Wᵀ` with `W [n_out, k]`: `[n, n_out]`.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor, OpError>;
    /// `matmul(x, w)` for each of `ws` (weights read by the same activations: a layer's q/k/v
    /// or gate/up projections), each output as `matmul` gives it. A back end may compute them
    /// together (the CPU: one parallel region and one activation quantization per decode
    /// token); by default each is its own `matmul`.
    fn matmul_many<const N: usize>(
        &self,
        x: &Self::Tensor,
        ws: [&Self::Weight; N],
    ) -> Result<[Self::Tensor; N], OpError> {
        let mut out = Vec::with_capacity(N);
        for w in ws {
            out.push(self.matmul(x, w)?);
        }
        out.try_into().map_err(|v: Vec<Self::Tensor>| OpError::ShapeMismatch {
            op: "matmul_many",
            expected: format!("{N} outputs"),
            got: vec![v.len()],
        })
    }

    /// `glu(x · gate_wᵀ, x · up_wᵀ)`: a gated feed-forward block's hidden activations (without
    /// biases; a block with biases adds them between the products and the GLU itself). One op so
    /// that a back end can compute both products and the gating in one pass over `x` (the GPU:
    /// one dispatch instead of two products and a GLU, and no `[n, n_ff]` intermediates). By
    /// default `matmul_many` then `glu`, exactly.
    fn matmul_glu(
        &self,
        x: &Self::Tensor,
        gate_w: &Self::Weight,
        up_w: &Self::Weight,
        glu: Glu,
    ) -> Result<Self::Tensor, OpError> {
        let [gate, up] = self.matmul_many(x, [gate_w, up_w])?;
        self.glu(&gate, &up, glu)
    }

    /// `residual + x · Wᵀ` (a residual connection after an output projection), consuming
    /// `residual` so that a back end can add into its storage (the GPU: the product's kernel
    /// accumulates, no separate add). By default `add(residual, matmul(x, w))`.
    fn matmul_add(&self, x: &Self::Tensor, w: &Self::Weight, residual: Self::Tensor) -> Result<Self::Tensor, OpError> {
        let y = self.matmul(x, w)?;
        self.add(&residual, &y)
    }

    // ---- element-wise ----
    /// a + b (same shape, or b one row broadcast over a's rows).
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, OpError>;
    /// a * b (same shape, or b one row broadcast over a's rows).
    fn mul(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, OpError>;
    /// a * s.
    fn scale(&self, a: &Self::Tensor, s: f32) -> Result<Self::Tensor, OpError>;
    /// act(a).
    fn act(&self, a: &Self::Tensor, act: Act) -> Result<Self::Tensor, OpError>;
    /// Gated combination of `gate` and `up` (same shapes).
    fn glu(&self, gate: &Self::Tensor, up: &Self::Tensor, glu: Glu) -> Result<Self::Tensor, OpError>;

    // ---- normalisation and position ----
    /// RMS norm over the last dim of `x`, times `weight` (`[last dim]`) when given.
    fn rms_norm(&self, x: &Self::Tensor, weight: Option<&Self::Tensor>, eps: f32) -> Result<Self::Tensor, OpError>;
    /// `(a + b, rms_norm(a + b, weight))`: a residual connection and the norm after it, which a
    /// back end may do in one pass (the GPU's split: inside the kernel that adds the CPU's
    /// experts, one dispatch for three). By default exactly those two ops.
    fn add_rms_norm(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        weight: Option<&Self::Tensor>,
        eps: f32,
    ) -> Result<(Self::Tensor, Self::Tensor), OpError> {
        add_then_rms_norm(self, a, b, weight, eps)
    }
    /// `(rms_norm(a, wa), rms_norm(b, wb))` for rows of one width: two norms a back end may do in
    /// one pass (a decode step's per-head q and k norms: one GPU dispatch instead of two).
    fn rms_norm_pair(
        &self,
        a: &Self::Tensor,
        wa: Option<&Self::Tensor>,
        b: &Self::Tensor,
        wb: Option<&Self::Tensor>,
        eps: f32,
    ) -> Result<(Self::Tensor, Self::Tensor), OpError> {
        Ok((self.rms_norm(a, wa, eps)?, self.rms_norm(b, wb, eps)?))
    }
    /// Layer norm over the last dim with optional weight and bias.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        weight: Option<&Self::Tensor>,
        bias: Option<&Self::Tensor>,
        eps: f32,
    ) -> Result<Self::Tensor, OpError>;
    /// Rotary embedding of `x [n_tokens, n_heads * head_dim]` at `positions` (one per token).
    fn rope(&self, x: &Self::Tensor, positions: &[u32], spec: &RopeSpec) -> Result<Self::Tensor, OpError>;

    // ---- reshaping ----
    /// Rows `start..start+len` of a 2-D tensor.
    fn slice_rows(&self, x: &Self::Tensor, start: usize, len: usize) -> Result<Self::Tensor, OpError>;
    /// Columns `start..start+len` of a 2-D tensor.
    fn slice_cols(&self, x: &Self::Tensor, start: usize, len: usize) -> Result<Self::Tensor, OpError>;
    /// Concatenation of 2-D tensors along columns.
    fn concat_cols(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor, OpError>;

    // ---- attention ----
    /// An empty KV cache for `n_ctx` positions of `k_width` key and `v_width` value columns.
    fn new_cache(&self, n_ctx: usize, k_width: usize, v_width: usize) -> Result<Self::Cache, OpError>;
    /// Writes `k`, `v` (`[n, width]`) at positions `pos0..pos0+n` of `cache`, then attends `q`
    /// (`[n, n_head * head_dim_k]`, query i at position `pos0 + i`) causally over positions
    /// `0..=pos0+i`; `sinks` (`[n_head]`) adds one extra logit per head to the softmax
    /// (gpt-oss). Returns `[n, n_head * head_dim_v]`.
    // Eight parameters: q, k, v, cache, position and spec are each needed; folding them into a
    // struct is planned with the next change to this op (docs/NOTES.md).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        cache: &mut Self::Cache,
        pos0: usize,
        spec: &AttnSpec,
        sinks: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor, OpError>;

    /// Rotary embedding of `step.q` and `step.k`, then [`Backend::attention`]: the part of an
    /// attention layer between its projections. One op so that a back end can rotate and write
    /// the cache in one pass (the GPU: one dispatch instead of two ropes and two cache copies);
    /// by default it is exactly those ops.
    fn rope_attention(&self, step: &AttnStep<'_, Self>, cache: &mut Self::Cache) -> Result<Self::Tensor, OpError> {
        let AttnStep { q, k, v, pos0, positions, rope, spec, sinks, qk_norm } = *step;
        if qk_norm.is_some() {
            return Err(OpError::Unsupported {
                op: "rope_attention",
                backend: self.name(),
                why: "q and k norms inside the attention (ask `attention_norms_qk` first)".into(),
            });
        }
        match rope {
            Some(r) => {
                let q = self.rope(q, positions, r)?;
                let k = self.rope(k, positions, r)?;
                self.attention(&q, &k, v, cache, pos0, spec, sinks)
            }
            None => self.attention(q, k, v, cache, pos0, spec, sinks),
        }
    }

    /// Whether [`Backend::rope_attention`] of `n_tokens` tokens with `spec` takes the per-head q
    /// and k norms itself ([`AttnStep::qk_norm`]): the GPU's decode kernel norms each head as it
    /// loads it, one dispatch less per layer than a norm before it. By default no: the caller
    /// norms q and k first.
    fn attention_norms_qk(&self, n_tokens: usize, spec: &AttnSpec) -> bool {
        let _ = (n_tokens, spec);
        false
    }

    /// Attention of `q` (`[n, n_head * head_dim_k]`) over `k` and `v` (`[n, n_head_kv * head_dim]`)
    /// of the same `n` tokens with no mask and no cache: every token sees every token, as in
    /// BERT-style encoders. `spec.softcap` applies; a sliding window is refused.
    ///
    /// By default computed on the host: only encoders use it, once per text, and they run on
    /// the CPU (a GPU back end pays one round trip per layer).
    fn attention_unmasked(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        spec: &AttnSpec,
    ) -> Result<Self::Tensor, OpError> {
        let n = self.shape(q).first().copied().unwrap_or(0);
        let (qw, kw, vw) =
            (spec.n_head * spec.head_dim_k, spec.n_head_kv * spec.head_dim_k, spec.n_head_kv * spec.head_dim_v);
        let shapes_ok = self.shape(q) == [n, qw]
            && self.shape(k) == [n, kw]
            && self.shape(v) == [n, vw]
            && spec.n_head_kv > 0
            && spec.n_head.is_multiple_of(spec.n_head_kv)
            && spec.window.is_none();
        if !shapes_ok {
            return Err(OpError::ShapeMismatch {
                op: "attention_unmasked",
                expected: format!(
                    "q [{n}, {qw}], k [{n}, {kw}], v [{n}, {vw}], n_head {} a multiple of n_head_kv {}, no window",
                    spec.n_head, spec.n_head_kv
                ),
                got: [self.shape(q), self.shape(k), self.shape(v)].concat(),
            });
        }
        let out = unmasked_attention_host(&self.to_host(q)?, &self.to_host(k)?, &self.to_host(v)?, n, spec);
        self.from_host(&out, &[n, spec.n_head * spec.head_dim_v])
    }

    // ---- mixture of experts ----
    /// [`Backend::route`] of the router's logits `x · routerᵀ` (`x` `[n, n_embd]`, `router`
    /// `[n_expert, n_embd]`, no router bias): the product and the routing, which a back end may
    /// do in one pass (the GPU, one token: one dispatch whose last workgroup routes). By default
    /// exactly those two ops.
    fn router_route(
        &self,
        x: &Self::Tensor,
        router: &Self::Weight,
        selection_bias: Option<&Self::Tensor>,
        spec: &RouteSpec,
    ) -> Result<Routing<Self>, OpError> {
        route_router_logits(self, x, router, selection_bias, spec)
    }
    /// Routing from router logits `[n, n_expert]`; `selection_bias` (`[n_expert]`) shifts only
    /// the choice.
    fn route(
        &self,
        logits: &Self::Tensor,
        selection_bias: Option<&Self::Tensor>,
        spec: &RouteSpec,
    ) -> Result<Routing<Self>, OpError>;
    /// Σ_j w_tj · down_e(glu(gate_e(x_t), up_e(x_t))) over the routed experts e = ids[t][j].
    fn moe_ffn(
        &self,
        x: &Self::Tensor,
        routing: &Routing<Self>,
        experts: &Experts<Self>,
        spec: &MoeSpec,
    ) -> Result<Self::Tensor, OpError>;

    // ---- output ----
    /// Index of the largest value of each row (lowest index on ties).
    fn argmax_rows(&self, x: &Self::Tensor) -> Result<Vec<u32>, OpError> {
        let shape = self.shape(x).to_vec();
        let w = *shape.last().unwrap_or(&1);
        let v = self.to_host(x)?;
        Ok(v.chunks(w.max(1))
            .map(|r| {
                let mut best = 0;
                for (i, &x) in r.iter().enumerate() {
                    if x > r[best] {
                        best = i;
                    }
                }
                best as u32
            })
            .collect())
    }

    // ---- recurrent layers (appended: conv / SSM state) ----
    /// Depthwise causal convolution over a rolling window (Mamba's conv1d, LFM2's short conv):
    /// with `xx` = the `k - 1` rows of `state` followed by the rows of `x` (`[n, channels]`),
    /// `out[t][c] = Σ_j weight[c][j] · xx[t + j][c]` (`weight` `[channels, k]`, PyTorch's
    /// `Conv1d(groups=channels)` weight squeezed). Returns `[n, channels]` and leaves the last
    /// `k - 1` rows of `xx` in `state` (`[k - 1, channels]`). No bias, no activation.
    fn ssm_conv(
        &self,
        x: &Self::Tensor,
        state: &mut Self::Tensor,
        weight: &Self::Tensor,
    ) -> Result<Self::Tensor, OpError> {
        let _ = (x, state, weight);
        Err(OpError::Unsupported {
            op: "ssm_conv",
            backend: self.name(),
            why: "not implemented on this back end".into(),
        })
    }
    /// Mamba-2 selective scan of `n` tokens, token by token from `state`
    /// (`[n_head, head_dim, d_state]`, updated in place): per head h and token t,
    /// `dt = softplus(dt_t[h] + dt_bias[h])`, `S = S · exp(dt · a[h]) + dt · x_t[h] ⊗ B_t[g]`,
    /// `y_t[h] = S · C_t[g] + d[h] · x_t[h]`. Returns y `[n, n_head * head_dim]`.
    fn ssm_scan(&self, inputs: &SsmScan<'_, Self>, state: &mut Self::Tensor) -> Result<Self::Tensor, OpError> {
        let _ = (inputs, state);
        Err(OpError::Unsupported {
            op: "ssm_scan",
            backend: self.name(),
            why: "not implemented on this back end".into(),
        })
    }

    // ---- per-head products (appended: DeepSeek MLA) ----
    /// Per-head matrix products: `x` (`[n, n_head * k]`) is split into `n_head` column blocks
    /// and block h is multiplied by `w[h]` (`w` `[n_head, n_out, k]`, `x_h · w[h]ᵀ`), giving
    /// `[n, n_head * n_out]` with head h's result in columns `h * n_out..(h + 1) * n_out`.
    /// DeepSeek's multi-head latent attention absorbs its key and value up-projections this way
    /// (ggml's 3-D `mul_mat` over `attn_k_b` / `attn_v_b`).
    fn matmul_per_head(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor, OpError> {
        let _ = (x, w);
        Err(OpError::Unsupported {
            op: "matmul_per_head",
            backend: self.name(),
            why: "not implemented on this back end".into(),
        })
    }
}

/// [`Backend::attention_unmasked`] on host rows (shapes checked by the caller): per head, softmax
/// over all `n` keys, accumulated in f64 so the result does not depend on the summation order.
fn unmasked_attention_host(q: &[f32], k: &[f32], v: &[f32], n: usize, spec: &AttnSpec) -> Vec<f32> {
    let (dk, dv) = (spec.head_dim_k, spec.head_dim_v);
    let (qw, kw, vw) = (spec.n_head * dk, spec.n_head_kv * dk, spec.n_head_kv * dv);
    let group = spec.n_head / spec.n_head_kv;
    let mut out = vec![0f32; n * spec.n_head * dv];
    let mut scores = vec![0f64; n];
    for h in 0..spec.n_head {
        let kvh = h / group;
        for i in 0..n {
            let qi = &q[i * qw + h * dk..][..dk];
            for (j, s) in scores.iter_mut().enumerate() {
                let kj = &k[j * kw + kvh * dk..][..dk];
                let dot: f64 = qi.iter().zip(kj).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                let x = dot * f64::from(spec.scale);
                *s = match spec.softcap {
                    Some(cap) => f64::from(cap) * (x / f64::from(cap)).tanh(),
                    None => x,
                };
            }
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut total = 0f64;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                total += *s;
            }
            let oi = &mut out[(i * spec.n_head + h) * dv..][..dv];
            for (d, o) in oi.iter_mut().enumerate() {
                let acc: f64 = scores.iter().enumerate().map(|(j, &p)| p * f64::from(v[j * vw + kvh * dv + d])).sum();
                *o = (acc / total) as f32;
            }
        }
    }
    out
}

/// [`Backend::add_rms_norm`] as its two ops: the default, and a fusing back end's fallback.
pub(crate) fn add_then_rms_norm<B: Backend>(
    b: &B,
    x: &B::Tensor,
    y: &B::Tensor,
    weight: Option<&B::Tensor>,
    eps: f32,
) -> Result<(B::Tensor, B::Tensor), OpError> {
    let sum = b.add(x, y)?;
    let normed = b.rms_norm(&sum, weight, eps)?;
    Ok((sum, normed))
}

/// [`Backend::router_route`] as its two ops: the default, and a fusing back end's fallback.
pub(crate) fn route_router_logits<B: Backend>(
    b: &B,
    x: &B::Tensor,
    router: &B::Weight,
    selection_bias: Option<&B::Tensor>,
    spec: &RouteSpec,
) -> Result<Routing<B>, OpError> {
    let logits = b.matmul(x, router)?;
    b.route(&logits, selection_bias, spec)
}

#[cfg(test)]
mod tests {
    use super::{SsmDims, SsmScan};
    use crate::cpu::{CpuBackend, CpuTensor};
    use crate::error::OpError;
    use crate::quant::MatmulMode;

    fn zeros(shape: &[usize]) -> CpuTensor {
        CpuTensor { shape: shape.to_vec(), data: vec![0.0; shape.iter().product()] }
    }

    /// The scan's shape check: the dimensions of a consistent set, and for each input made
    /// inconsistent in turn, an error naming that input's shape.
    #[test]
    fn ssm_check_finds_the_dimensions_and_names_the_wrong_input() {
        let cpu = CpuBackend::new(MatmulMode::Exact);
        let (n, n_head, head_dim, d_state, n_group) = (3, 4, 8, 16, 2);
        let x = zeros(&[n, n_head * head_dim]);
        let dt = zeros(&[n, n_head]);
        let bc = zeros(&[n, n_group * d_state]);
        let a = zeros(&[n_head]);
        let state = zeros(&[n_head, head_dim, d_state]);
        let scan = |x, dt, b, c, a, d| SsmScan::<CpuBackend> { x, dt, b, c, a, d, dt_bias: None, n_group };
        let dims = scan(&x, &dt, &bc, &bc, &a, None).check(&cpu, &state).unwrap();
        assert_eq!(dims, SsmDims { n, n_head, head_dim, d_state });

        let got = |r: Result<SsmDims, OpError>| match r {
            Err(OpError::ShapeMismatch { got, .. }) => got,
            other => panic!("expected a shape mismatch, got {other:?}"),
        };
        let x_odd = zeros(&[n, n_head * head_dim + 1]);
        assert_eq!(got(scan(&x_odd, &dt, &bc, &bc, &a, None).check(&cpu, &state)), x_odd.shape);
        let dt_short = zeros(&[n - 1, n_head]);
        assert_eq!(got(scan(&x, &dt_short, &bc, &bc, &a, None).check(&cpu, &state)), dt_short.shape);
        let c_narrow = zeros(&[n, n_group * d_state - 2]);
        assert_eq!(got(scan(&x, &dt, &bc, &c_narrow, &a, None).check(&cpu, &state)), c_narrow.shape);
        let d_long = zeros(&[n_head + 1]);
        assert_eq!(got(scan(&x, &dt, &bc, &bc, &a, Some(&d_long)).check(&cpu, &state)), d_long.shape);
        let state_small = zeros(&[n_head, head_dim, d_state - 1]);
        assert_eq!(got(scan(&x, &dt, &bc, &bc, &a, None).check(&cpu, &state_small)), state_small.shape);
    }
}
