//! Op parameters as data. Architecture differences live here (a rope variant, a gating function),
//! never as `if arch == ...` inside an op.

/// Element-wise activation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    /// x * sigmoid(x).
    Silu,
    /// Exact GELU, x * Phi(x) (erf form).
    Gelu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// max(x, 0).
    Relu,
}

/// How a gated FFN combines its gate and up projections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// act(gate) * up.
    Plain(Act),
    /// gpt-oss: gate clamped to (-inf, limit], up to [-limit, limit];
    /// out = gate * sigmoid(alpha * gate) * (up + 1). transformers' GptOssExperts.
    SwiGluOai {
        /// Sigmoid sharpness (1.702).
        alpha: f32,
        /// Clamp limit (7.0).
        limit: f32,
    },
}

impl Glu {
    /// The activation an expert without a gate projection applies to its up projection (models
    /// whose experts have no gate; gpt-oss's gated form falls back to SiLU).
    pub fn ungated_act(self) -> Act {
        match self {
            Glu::Plain(a) => a,
            Glu::SwiGluOai { .. } => Act::Silu,
        }
    }
}

/// YaRN context extension (arXiv 2309.00071), as transformers' `_compute_yarn_parameters`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// Context scaling factor (`rope_scaling.factor`).
    pub factor: f32,
    /// Training context length.
    pub original_context: u32,
    /// High-frequency boundary in rotations (`beta_fast`, 32).
    pub beta_fast: f32,
    /// Low-frequency boundary in rotations (`beta_slow`, 1).
    pub beta_slow: f32,
    /// Round the correction range to whole dims (llama.cpp always does; transformers only when
    /// `truncate` is true, which gpt-oss sets to false).
    pub truncate: bool,
    /// Multiplier of cos and sin (`0.1 ln(factor) + 1` unless the model says otherwise).
    pub attn_factor: f32,
}

/// Rotary position embedding of the first `n_rot` dims of every head.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    /// Dims per head.
    pub head_dim: usize,
    /// Dims rotated (partial rotary rotates fewer than `head_dim`).
    pub n_rot: usize,
    /// Frequency base (theta).
    pub base: f32,
    /// Pairs (i, i + n_rot/2) (NeoX / rotate_half) rather than adjacent pairs (2i, 2i+1)
    /// (ggml's NORM mode, which llama GGUFs use because the converter permutes q and k).
    pub neox: bool,
    /// Per-frequency divisors (`rope_freqs.weight`, llama 3 scaling), `n_rot / 2` of them.
    pub freq_factors: Option<Vec<f32>>,
    /// Linear position scaling (positions multiplied by this).
    pub position_scale: f32,
    /// YaRN, when the model uses it.
    pub yarn: Option<Yarn>,
}

impl RopeSpec {
    /// The shape checks of a rope call on a tensor of `rows` x `width` values (`shape` for the
    /// error) with `n_positions` positions: one position per row, whole heads, `n_rot` within a
    /// head. Shared by the back ends.
    pub(crate) fn check_call(
        &self,
        rows: usize,
        width: usize,
        shape: &[usize],
        n_positions: usize,
    ) -> Result<(), crate::OpError> {
        if n_positions != rows
            || self.head_dim == 0
            || !width.is_multiple_of(self.head_dim)
            || self.n_rot > self.head_dim
        {
            return Err(crate::OpError::ShapeMismatch {
                op: "rope",
                expected: format!("[{n_positions} positions, heads * {}] with n_rot {}", self.head_dim, self.n_rot),
                got: shape.to_vec(),
            });
        }
        Ok(())
    }

    /// Plain rope over whole heads.
    pub fn new(head_dim: usize, base: f32, neox: bool) -> RopeSpec {
        RopeSpec { head_dim, n_rot: head_dim, base, neox, freq_factors: None, position_scale: 1.0, yarn: None }
    }
}

/// Scaled dot-product attention over a KV cache.
#[derive(Clone, Debug, PartialEq)]
pub struct AttnSpec {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_head_kv: usize,
    /// Dims of a query/key head.
    pub head_dim_k: usize,
    /// Dims of a value head.
    pub head_dim_v: usize,
    /// Multiplier of q·k (usually 1/sqrt(head_dim_k)).
    pub scale: f32,
    /// Sliding window: a query at position p sees keys at positions > p - window.
    pub window: Option<usize>,
    /// Logit soft-cap: scores become cap * tanh(scores / cap).
    pub softcap: Option<f32>,
}

/// How router logits become expert weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gating {
    /// Softmax over all experts, then top-k.
    Softmax,
    /// Top-k of the logits, then softmax over the k chosen (gpt-oss, mixtral-style).
    SoftmaxAfterTopK,
    /// Sigmoid of each logit.
    Sigmoid,
}

/// Expert routing: which experts each token uses and with what weight.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteSpec {
    /// Experts per token.
    pub k: usize,
    /// Probability function.
    pub gating: Gating,
    /// Whether `selection_bias` (DeepSeek-V3's e_score_correction_bias) is present: it shifts
    /// which experts are chosen but not their weights. The bias itself is passed to `route`.
    pub has_selection_bias: bool,
    /// Grouped selection (DeepSeek-V3): experts in `n_group` groups, only the best `topk_group`
    /// groups (by the sum of their top-2 scores) compete.
    pub groups: Option<(usize, usize)>,
    /// Divide the chosen weights by their sum.
    pub normalize: bool,
    /// Multiply the final weights (routed_scaling_factor).
    pub scale: f32,
}

/// Expert FFN shape and activation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSpec {
    /// Number of experts in the layer.
    pub n_expert: usize,
    /// Hidden size of one expert.
    pub n_ff: usize,
    /// Gate/up combination.
    pub glu: Glu,
}

/// What one attention call brings besides q's width, which each back end checks on its own
/// tensor type: the rows of k and v, the cache's widths and length, the sinks' shape.
pub(crate) struct AttnCall<'a> {
    /// Query rows (tokens).
    pub n: usize,
    pub k_rows: usize,
    pub v_rows: usize,
    pub cache_k_width: usize,
    pub cache_v_width: usize,
    pub n_ctx: usize,
    pub pos0: usize,
    /// Shape of the sinks tensor, when given.
    pub sinks: Option<&'a [usize]>,
    /// Largest head size the back end's kernel holds (`None`: any).
    pub max_head_dim: Option<usize>,
}

impl AttnSpec {
    /// Checks an attention call against this spec: the cache's widths are the spec's, k and v
    /// have a row per query, heads group evenly, the call fits the cache, one sink per head.
    /// Shared by the back ends so that they refuse the same calls with the same errors.
    pub(crate) fn check_call(&self, c: &AttnCall<'_>) -> Result<(), crate::OpError> {
        let too_wide = c.max_head_dim.is_some_and(|m| self.head_dim_k > m || self.head_dim_v > m);
        if c.cache_k_width != self.n_head_kv * self.head_dim_k
            || c.cache_v_width != self.n_head_kv * self.head_dim_v
            || c.k_rows != c.n
            || c.v_rows != c.n
            || self.n_head_kv == 0
            || self.head_dim_v == 0
            || !self.n_head.is_multiple_of(self.n_head_kv)
            || too_wide
        {
            return Err(crate::OpError::ShapeMismatch {
                op: "attention",
                expected: format!(
                    "{} rows of k [{}] and v [{}], n_head {} divisible by n_head_kv {}{}",
                    c.n,
                    self.n_head_kv * self.head_dim_k,
                    self.n_head_kv * self.head_dim_v,
                    self.n_head,
                    self.n_head_kv,
                    c.max_head_dim.map_or(String::new(), |m| format!(", head dims up to {m}"))
                ),
                got: vec![c.k_rows, c.cache_k_width, c.v_rows, c.cache_v_width],
            });
        }
        if c.pos0 + c.n > c.n_ctx {
            return Err(crate::OpError::ContextFull { pos: c.pos0, n_tokens: c.n, n_ctx: c.n_ctx });
        }
        match c.sinks {
            Some(shape) if shape.iter().product::<usize>() != self.n_head => Err(crate::OpError::ShapeMismatch {
                op: "attention sinks",
                expected: format!("[{}]", self.n_head),
                got: shape.to_vec(),
            }),
            _ => Ok(()),
        }
    }
}
