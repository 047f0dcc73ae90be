//! `deepseek2`: DeepSeek-V2 and DeepSeek-V3 (and their lite variants).
//!
//! Reference: transformers `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM`; llama.cpp
//! `src/models/deepseek2.cpp` and the `LLM_ARCH_DEEPSEEK2` parts of `src/llama-model.cpp` and
//! `src/llama-context.cpp` at 0c1e570. Differences from llama:
//! - **Multi-head latent attention (MLA).** q comes from a low-rank pair `attn_q_a` →
//!   `attn_q_a_norm` → `attn_q_b` (or one `attn_q` in lite models without `q_lora_rank`); each
//!   head's q is `nope` dims without position then `rope` dims with it. Keys and values come from
//!   one compressed vector per token: `attn_kv_a_mqa` gives `kv_lora_rank` latent dims plus
//!   `rope` dims of a key part shared by every head; the latent is RMS-normed
//!   (`attn_kv_a_norm`) and expanded per head into the key's nope part and the value.
//!   Current converters store that expansion split as `attn_k_b` (`[n_head, kv_lora, nope]`,
//!   transposed) and `attn_v_b` (`[n_head, v, kv_lora]`). Like llama.cpp we then absorb them:
//!   q_nope is multiplied by `attn_k_b` into latent space, attention runs as one-KV-head
//!   attention over the cached `[latent, k_rope]` rows (values = the latent), and the output
//!   of each head is expanded by `attn_v_b`. The cache holds `kv_lora + rope` (keys) and
//!   `kv_lora` (values) floats per position instead of `n_head * (nope + rope + v)`. Older
//!   files store one `attn_kv_b` (`[n_head * (nope + v), kv_lora]`); those are expanded
//!   before attention (plain multi-head attention), as llama.cpp does for them.
//! - Rope on adjacent pairs (ggml's NORM mode): DeepSeek-V2's complex rotation and
//!   DeepSeek-V3's `rope_interleave` both rotate pairs (2i, 2i + 1).
//! - Attention scale 1/sqrt(nope + rope), times mscale² under YaRN, where mscale =
//!   1 + `rope.scaling.yarn_log_multiplier` · ln(factor) (= 0.1 · mscale_all_dim · ln(factor),
//!   transformers' `yarn_get_mscale`); rope's own cos/sin factor is then 1 (transformers:
//!   mscale / mscale_all_dim; llama.cpp's DeepSeek special case). Files without the multiplier
//!   get llama.cpp's default 0.1 · ln(factor) + 1 on rope and that factor squared on the scale.
//! - The first `leading_dense_block_count` layers have a dense FFN; the others a mixture of
//!   experts plus `expert_shared_count` shared experts (one `_shexp` FFN). Routing from
//!   `expert_gating_func`: softmax (V2, greedy top-k) or sigmoid with a selection bias
//!   (`exp_probs_b`, V3's e_score_correction_bias) and grouped top-k (`expert_group_count`
//!   groups scored by their two best experts, `expert_group_used_count` kept); weights
//!   renormalised when `expert_weights_norm`, times `expert_weights_scale`.
//!
//! One departure a reader may meet: transformers' DeepSeek-V2 `group_limited_greedy` scores a
//! group by its best expert, llama.cpp by its best two; we follow llama.cpp (the fixtures use
//! one group there, where both agree). Checked by the `deepseek_v2` (softmax, q_lora 32, two
//! shared experts) and `deepseek_v3` (sigmoid + bias, 2 groups top-1, scale 2.5) fixtures.

use crate::arch::{output_rows, positions, Architecture, Outputs};
use crate::blocks::{Ffn, FfnOrMoe, Moe};
use crate::error::{ModelError, Result};
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::rope::rope_spec;
use crate::state::{LayerState, State};
use compute::spec::{Act, AttnSpec, Gating, Glu, MoeSpec, RopeSpec, RouteSpec};
use compute::Backend;
use gguf::names::{blk, OUTPUT_NORM, TOKEN_EMBD};

/// The routing the `{arch}.expert_*` keys describe (DeepSeek-style MoE, also GLM-4-MoE):
/// `expert_gating_func` (1 softmax, 2 sigmoid, 3 softmax over the chosen k; `absent` when the
/// key is missing), `expert_group_count` / `expert_group_used_count`, `expert_weights_norm`,
/// `expert_weights_scale`. `has_selection_bias` says whether the layers carry `exp_probs_b`.
///
/// # Errors
/// An unknown gating function, a key of the wrong type.
pub fn route_spec(md: &gguf::Metadata, hp: &Hparams, absent: Gating, has_selection_bias: bool) -> Result<RouteSpec> {
    let gating = match md.u32_opt(&hp.key("expert_gating_func"))? {
        None | Some(0) => absent,
        Some(1) => Gating::Softmax,
        Some(2) => Gating::Sigmoid,
        Some(3) => Gating::SoftmaxAfterTopK,
        Some(other) => {
            return Err(ModelError::Hparams {
                why: format!("{} = {other} is not a known gating function (1..3)", hp.key("expert_gating_func")),
            });
        }
    };
    let n_group = md.u32_opt(&hp.key("expert_group_count"))?.unwrap_or(1) as usize;
    let topk_group = md.u32_opt(&hp.key("expert_group_used_count"))?.unwrap_or(n_group as u32) as usize;
    let uneven_groups = n_group > 1 && hp.expert_count / n_group * n_group != hp.expert_count;
    if n_group > 1 && (uneven_groups || topk_group == 0 || topk_group > n_group) {
        return Err(ModelError::Hparams {
            why: format!("{} experts in {n_group} groups with {topk_group} used groups", hp.expert_count),
        });
    }
    Ok(RouteSpec {
        k: hp.expert_used_count,
        gating,
        has_selection_bias,
        groups: if n_group > 1 { Some((n_group, topk_group)) } else { None },
        normalize: md.bool_opt(&hp.key("expert_weights_norm"))?.unwrap_or(false),
        scale: md.f32_opt(&hp.key("expert_weights_scale"))?.filter(|s| *s != 0.0).unwrap_or(1.0),
    })
}

/// Head sizes of multi-head latent attention.
#[derive(Clone, Copy, Debug)]
struct MlaDims {
    n_head: usize,
    /// Query/key dims without position.
    nope: usize,
    /// Query/key dims with rope (the key part shared by all heads).
    rope: usize,
    /// Value dims per head.
    v: usize,
    /// Latent (compressed key/value) dims.
    kv_lora: usize,
}

/// How q is produced.
enum Query<B: Backend> {
    /// `attn_q_a` → RMS norm → `attn_q_b`.
    LowRank { a: B::Weight, a_norm: B::Tensor, b: B::Weight },
    /// One `attn_q` (lite models).
    Full(B::Weight),
}

/// How the latent becomes per-head keys and values.
enum KvUp<B: Backend> {
    /// `attn_k_b` `[n_head, kv_lora, nope]` and `attn_v_b` `[n_head, v, kv_lora]`, absorbed
    /// into q and the attention output; the cache holds latents.
    Absorbed { k_b: B::Weight, v_b: B::Weight },
    /// `attn_kv_b` `[n_head * (nope + v), kv_lora]` (older files), expanded before attention.
    Expanded { kv_b: B::Weight },
}

/// One layer's multi-head latent attention.
struct Mla<B: Backend> {
    q: Query<B>,
    kv_a_mqa: B::Weight,
    kv_a_norm: B::Tensor,
    up: KvUp<B>,
    o: B::Weight,
    dims: MlaDims,
    spec: AttnSpec,
    rope: RopeSpec,
    eps: f32,
}

/// What [`Mla::load`] needs besides the layer index.
struct MlaConfig {
    n_embd: usize,
    dims: MlaDims,
    /// `attention.q_lora_rank` (absent or 0 in lite models, which have one `attn_q`).
    q_lora: Option<usize>,
    /// Multiplier of q·k (1/sqrt(nope + rope), times the YaRN mscale²).
    scale: f32,
    rope: RopeSpec,
    eps: f32,
}

impl<B: Backend> Mla<B> {
    fn load(ld: &Loader<'_, B>, il: usize, cfg: &MlaConfig) -> Result<Self> {
        let d = cfg.dims;
        let (h, n_embd) = (d.n_head, cfg.n_embd);
        let q_width = h * (d.nope + d.rope);
        let q = if ld.has(&blk(il, "attn_q_a.weight")) {
            let q_lora = cfg.q_lora.ok_or_else(|| ModelError::Hparams {
                why: format!("layer {il} has attn_q_a but the file gives no attention.q_lora_rank"),
            })?;
            Query::LowRank {
                a: ld.weight(&blk(il, "attn_q_a.weight"), &[q_lora, n_embd])?,
                a_norm: ld.vector(&blk(il, "attn_q_a_norm.weight"), &[q_lora])?,
                b: ld.weight(&blk(il, "attn_q_b.weight"), &[q_width, q_lora])?,
            }
        } else {
            Query::Full(ld.weight(&blk(il, "attn_q.weight"), &[q_width, n_embd])?)
        };
        let (up, spec) = if ld.has(&blk(il, "attn_kv_b.weight")) {
            let up =
                KvUp::Expanded { kv_b: ld.weight(&blk(il, "attn_kv_b.weight"), &[h * (d.nope + d.v), d.kv_lora])? };
            let spec = AttnSpec {
                n_head: h,
                n_head_kv: h,
                head_dim_k: d.nope + d.rope,
                head_dim_v: d.v,
                scale: cfg.scale,
                window: None,
                softcap: None,
            };
            (up, spec)
        } else {
            let up = KvUp::Absorbed {
                k_b: ld.weight(&blk(il, "attn_k_b.weight"), &[h, d.kv_lora, d.nope])?,
                v_b: ld.weight(&blk(il, "attn_v_b.weight"), &[h, d.v, d.kv_lora])?,
            };
            // One key/value "head" holding the latent: grouped-query attention with one group.
            let spec = AttnSpec {
                n_head: h,
                n_head_kv: 1,
                head_dim_k: d.kv_lora + d.rope,
                head_dim_v: d.kv_lora,
                scale: cfg.scale,
                window: None,
                softcap: None,
            };
            (up, spec)
        };
        Ok(Mla {
            q,
            kv_a_mqa: ld.weight(&blk(il, "attn_kv_a_mqa.weight"), &[d.kv_lora + d.rope, n_embd])?,
            kv_a_norm: ld.vector(&blk(il, "attn_kv_a_norm.weight"), &[d.kv_lora])?,
            up,
            o: ld.weight(&blk(il, "attn_output.weight"), &[n_embd, h * d.v])?,
            dims: d,
            spec,
            rope: cfg.rope.clone(),
            eps: cfg.eps,
        })
    }

    /// Key and value widths of this layer's cache.
    fn cache_widths(&self) -> (usize, usize) {
        (self.spec.n_head_kv * self.spec.head_dim_k, self.spec.n_head_kv * self.spec.head_dim_v)
    }

    /// Attention of `x` (`[n, n_embd]`) at `positions` (starting at `pos0`), updating `cache`.
    fn forward(&self, b: &B, x: &B::Tensor, cache: &mut B::Cache, pos0: usize, positions: &[u32]) -> Result<B::Tensor> {
        let d = self.dims;
        let (n, h) = (positions.len(), d.n_head);
        let q = match &self.q {
            Query::LowRank { a, a_norm, b: qb } => {
                let q = b.matmul(x, a)?; // [n, q_lora]
                let q = b.rms_norm(&q, Some(a_norm), self.eps)?;
                b.matmul(&q, qb)?
            }
            Query::Full(w) => b.matmul(x, w)?,
        }; // [n, n_head * (nope + rope)]
        let q = b.reshape(q, &[n * h, d.nope + d.rope])?;
        let q_nope = b.slice_cols(&q, 0, d.nope)?; // [n * n_head, nope]
        let q_pe = b.reshape(b.slice_cols(&q, d.nope, d.rope)?, &[n, h * d.rope])?;
        let q_pe = b.reshape(b.rope(&q_pe, positions, &self.rope)?, &[n * h, d.rope])?; // [n * n_head, rope]

        let kv_cmpr_pe = b.matmul(x, &self.kv_a_mqa)?; // [n, kv_lora + rope]
        let kv_cmpr = b.slice_cols(&kv_cmpr_pe, 0, d.kv_lora)?;
        let kv_cmpr = b.rms_norm(&kv_cmpr, Some(&self.kv_a_norm), self.eps)?; // [n, kv_lora]
        let k_pe = b.rope(&b.slice_cols(&kv_cmpr_pe, d.kv_lora, d.rope)?, positions, &self.rope)?; // [n, rope]

        let out = match &self.up {
            KvUp::Absorbed { k_b, v_b } => {
                let q_nope = b.reshape(q_nope, &[n, h * d.nope])?;
                let q_absorbed = b.matmul_per_head(&q_nope, k_b)?; // [n, n_head * kv_lora]
                let q_absorbed = b.reshape(q_absorbed, &[n * h, d.kv_lora])?;
                let q = b.concat_cols(&[&q_absorbed, &q_pe])?; // [n * n_head, kv_lora + rope]
                let q = b.reshape(q, &[n, h * (d.kv_lora + d.rope)])?;
                let k = b.concat_cols(&[&kv_cmpr, &k_pe])?; // [n, kv_lora + rope]
                let latent = b.attention(&q, &k, &kv_cmpr, cache, pos0, &self.spec, None)?; // [n, n_head * kv_lora]
                b.matmul_per_head(&latent, v_b)? // [n, n_head * v]
            }
            KvUp::Expanded { kv_b } => {
                let kv = b.reshape(b.matmul(&kv_cmpr, kv_b)?, &[n * h, d.nope + d.v])?;
                let k_nope = b.slice_cols(&kv, 0, d.nope)?; // [n * n_head, nope]
                let v = b.reshape(b.slice_cols(&kv, d.nope, d.v)?, &[n, h * d.v])?;
                let k_pe_per_head = vec![&k_pe; h];
                let k_pe = b.reshape(b.concat_cols(&k_pe_per_head)?, &[n * h, d.rope])?;
                let k = b.reshape(b.concat_cols(&[&k_nope, &k_pe])?, &[n, h * (d.nope + d.rope)])?;
                let q = b.reshape(b.concat_cols(&[&q_nope, &q_pe])?, &[n, h * (d.nope + d.rope)])?;
                b.attention(&q, &k, &v, cache, pos0, &self.spec, None)? // [n, n_head * v]
            }
        };
        Ok(b.matmul(&out, &self.o)?) // [n, n_embd]
    }
}

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    attn: Mla<B>,
    ffn_norm: B::Tensor,
    ffn: FfnOrMoe<B>,
}

/// A loaded DeepSeek-V2/V3 model.
pub struct Deepseek2<B: Backend> {
    hp: Hparams,
    tok_embd: B::Weight,
    layers: Vec<Layer<B>>,
    output_norm: B::Tensor,
    output: B::Weight,
}

/// The attention scale and rope of MLA under the metadata's rope scaling (see the module doc).
fn scaled_rope<B: Backend>(ld: &Loader<'_, B>, hp: &Hparams, qk_head: usize) -> Result<(f32, RopeSpec)> {
    let md = ld.model.metadata();
    let mut rope = rope_spec(ld, md, hp, hp.rope_dimension_count, hp.rope_freq_base, false)?;
    let log_mul = md.f32_opt(&hp.key("rope.scaling.yarn_log_multiplier"))?.unwrap_or(0.0);
    let mut mscale = 1.0f32;
    if let Some(y) = rope.yarn.as_mut() {
        if log_mul != 0.0 {
            y.attn_factor = 1.0;
        }
        mscale = y.attn_factor * (1.0 + log_mul * y.factor.ln());
    }
    Ok((mscale * mscale / (qk_head as f32).sqrt(), rope))
}

/// Loads a DeepSeek-V2/V3 model.
///
/// # Errors
/// Missing keys (`attention.kv_lora_rank`, `expert_feed_forward_length` when there are MoE
/// layers) or tensors, shapes that disagree with the hyper-parameters.
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Deepseek2<B>> {
    let md = ld.model.metadata();
    let n_embd = hp.embedding_length;
    // MLA files give the per-head sizes after expansion under *_mla keys (their key_length and
    // value_length describe the absorbed one-head form); older files under the plain keys.
    let (qk_head, v_head) =
        match (md.u32_opt(&hp.key("attention.key_length_mla"))?, md.u32_opt(&hp.key("attention.value_length_mla"))?) {
            (Some(k), Some(v)) if k > 0 && v > 0 => (k as usize, v as usize),
            _ => (hp.key_length, hp.value_length),
        };
    let rope_dim = hp.rope_dimension_count;
    if rope_dim == 0 || rope_dim % 2 == 1 || rope_dim >= qk_head {
        return Err(ModelError::Hparams {
            why: format!("rope dims {rope_dim} must be even and below the head's {qk_head}"),
        });
    }
    let kv_lora = md.u32(&hp.key("attention.kv_lora_rank"))? as usize;
    let q_lora = md.u32_opt(&hp.key("attention.q_lora_rank"))?.filter(|&r| r > 0).map(|r| r as usize);
    let (scale, rope) = scaled_rope(ld, &hp, qk_head)?;
    let leading_dense = md.u32_opt(&hp.key("leading_dense_block_count"))?.unwrap_or(0) as usize;
    let glu = Glu::Plain(Act::Silu);
    let has_bias = (0..hp.block_count).any(|il| ld.has(&blk(il, "exp_probs_b.bias")));
    // DeepSeek-V2 files predate `expert_gating_func`: softmax (llama.cpp does the same).
    let route = route_spec(md, &hp, Gating::Softmax, has_bias)?;
    let mut layers = Vec::with_capacity(hp.block_count);
    for il in 0..hp.block_count {
        let cfg = MlaConfig {
            n_embd,
            dims: MlaDims { n_head: hp.head_count[il], nope: qk_head - rope_dim, rope: rope_dim, v: v_head, kv_lora },
            q_lora,
            scale,
            rope: rope.clone(),
            eps: hp.rms_eps,
        };
        let ffn = if il < leading_dense {
            FfnOrMoe::Dense(Ffn::load(ld, il, "", n_embd, hp.feed_forward_length[il], glu)?)
        } else {
            let n_ff_exp = md.u32(&hp.key("expert_feed_forward_length"))? as usize;
            let n_shared = md.u32_opt(&hp.key("expert_shared_count"))?.unwrap_or(0) as usize;
            let moe = MoeSpec { n_expert: hp.expert_count, n_ff: n_ff_exp, glu };
            let shared = (n_shared > 0).then_some(n_ff_exp * n_shared);
            FfnOrMoe::Moe(Moe::load(ld, il, n_embd, moe, route.clone(), shared)?)
        };
        layers.push(Layer {
            attn_norm: ld.vector(&blk(il, "attn_norm.weight"), &[n_embd])?,
            attn: Mla::load(ld, il, &cfg)?,
            ffn_norm: ld.vector(&blk(il, "ffn_norm.weight"), &[n_embd])?,
            ffn,
        });
    }
    let n_vocab = hp.n_vocab;
    let output = ld.output_or_tied(n_vocab, n_embd)?;
    Ok(Deepseek2 {
        tok_embd: ld.weight(TOKEN_EMBD, &[n_vocab, n_embd])?,
        output_norm: ld.vector(OUTPUT_NORM, &[n_embd])?,
        output,
        layers,
        hp,
    })
}

impl<B: Backend> Architecture<B> for Deepseek2<B> {
    fn hparams(&self) -> &Hparams {
        &self.hp
    }

    fn new_state(&self, b: &B, n_ctx: usize) -> Result<State<B>> {
        State::kv_caches(b, n_ctx, self.layers.iter().map(|l| l.attn.cache_widths()))
    }

    fn forward(&self, b: &B, state: &mut State<B>, ids: &[u32], outputs: Outputs) -> Result<B::Tensor> {
        let n = ids.len();
        let pos = positions(state.n_past, n);
        let eps = self.hp.rms_eps;
        let mut x = b.get_rows(&self.tok_embd, ids)?; // [n, n_embd]
        for (layer, st) in self.layers.iter().zip(state.layers.iter_mut()) {
            let LayerState::Attention(cache) = st else { unreachable!("every deepseek2 layer has attention") };
            let h = b.rms_norm(&x, Some(&layer.attn_norm), eps)?; // attn_norm
            let a = layer.attn.forward(b, &h, cache, state.n_past, &pos)?;
            x = b.add(&x, &a)?; // ffn_inp
            let h = b.rms_norm(&x, Some(&layer.ffn_norm), eps)?; // ffn_norm
            let f = layer.ffn.forward(b, &h)?; // dense, or router -> route -> moe_ffn + shared expert
            x = b.add(&x, &f)?; // l_out
        }
        state.n_past += n;
        let x = output_rows(b, &x, n, outputs)?;
        let x = b.rms_norm(&x, Some(&self.output_norm), eps)?;
        Ok(b.matmul(&x, &self.output)?) // [rows, n_vocab]
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Two layouts no fixture covers, each checked against transformers:
    //! - files from older converters store the latent expansion as one `attn_kv_b`: the
    //!   `deepseek_v2` f32 fixture is rewritten with `attn_k_b` and `attn_v_b` merged back
    //!   (exactly the inverse of the converter's split) and the `*_mla` keys removed, and the
    //!   expanded (non-absorbed) path must give the fixture's transformers logits;
    //! - YaRN rope scaling with DeepSeek's mscale: the `deepseek_v3` f32 fixture gets the keys
    //!   llama.cpp's converter writes for it, and must give the logits transformers computed
    //!   with the same weights and scaling (`tests/data/deepseek2_yarn`, made by its
    //!   make_ref.py);
    //! - lite models without `q_lora_rank` (one `attn_q`): the `deepseek_v2` f32 fixture with its
    //!   low-rank q replaced by generated `attn_q` weights, against transformers on the same
    //!   weights (`tests/data/deepseek2_lite`).

    use crate::refcheck::{compare, fixture_root, greedy, F32_MAX_ABS, F32_REL_L2};
    use crate::{load, LoadOptions, Outputs};
    use gguf::{GgmlType, GgufModel, GgufWriter, Value};
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    /// A tensor to write: name, type, GGUF shape (ne0 first), bytes.
    pub(crate) type TensorData = (String, GgmlType, Vec<u64>, Vec<u8>);

    fn f32s(bytes: &[u8]) -> Vec<f32> {
        bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// The fixture directory `name`, or `None` (printed) when this fixture set lacks its f32 file.
    pub(crate) fn fixture_dir(name: &str) -> Option<PathBuf> {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let (root, full) = fixture_root(&repo);
        println!(
            "fixture set: {} ({})",
            root.display(),
            if full { "full shared set" } else { "compact committed subset" }
        );
        let dir = root.join(name);
        if dir.join("model-f32.gguf").exists() {
            Some(dir)
        } else {
            println!("{name} f32 is not in this fixture set: check NOT run");
            None
        }
    }

    /// Writes `src`'s metadata (without the keys `drop_key` selects, plus `keys`) and `tensors`
    /// to a temporary file and opens it.
    pub(crate) fn rewrite(
        src: &GgufModel,
        drop_key: impl Fn(&str) -> bool,
        keys: &[(String, Value)],
        tensors: &[TensorData],
        tag: &str,
    ) -> Arc<GgufModel> {
        let mut w = GgufWriter::new();
        for (k, val) in src.metadata().iter() {
            if !drop_key(k) {
                w.set(k, val.clone());
            }
        }
        for (k, val) in keys {
            w.set(k, val.clone());
        }
        for (name, dtype, shape, _) in tensors {
            w.add_tensor(name, *dtype, shape).unwrap();
        }
        let path = std::env::temp_dir().join(format!("diskformer-deepseek2-{tag}-{}.gguf", std::process::id()));
        let mut sink = w.create(&path).unwrap();
        for (_, _, _, bytes) in tensors {
            sink.write_data(bytes).unwrap();
        }
        sink.finish().unwrap();
        let model = Arc::new(GgufModel::open(&path).unwrap());
        std::fs::remove_file(&path).ok();
        model
    }

    pub(crate) fn read_json(path: &Path) -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    pub(crate) fn ids(v: &serde_json::Value) -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    }

    pub(crate) fn rows(v: &serde_json::Value) -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
            .collect()
    }

    /// `attn_kv_b` `[n_head * (nope + v), kv_lora]` from `attn_k_b` `[n_head, kv_lora, nope]`
    /// and `attn_v_b` `[n_head, v, kv_lora]` (PyTorch order).
    fn merge_kv_b(k_b: &[f32], v_b: &[f32], n_head: usize, kv_lora: usize, nope: usize, v: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n_head * (nope + v) * kv_lora);
        for h in 0..n_head {
            for j in 0..nope {
                out.extend((0..kv_lora).map(|c| k_b[(h * kv_lora + c) * nope + j]));
            }
            for j in 0..v {
                out.extend_from_slice(&v_b[(h * v + j) * kv_lora..(h * v + j + 1) * kv_lora]);
            }
        }
        out
    }

    #[test]
    fn legacy_kv_b_layout_matches_transformers() {
        let Some(dir) = fixture_dir("deepseek_v2") else { return };
        let src = GgufModel::open(dir.join("model-f32.gguf")).unwrap();
        let md = src.metadata();
        let key = |t: &str| format!("deepseek2.{t}");
        let n_head = md.u32(&key("attention.head_count")).unwrap() as usize;
        let kv_lora = md.u32(&key("attention.kv_lora_rank")).unwrap() as usize;
        let qk_head = md.u32(&key("attention.key_length_mla")).unwrap() as usize;
        let v = md.u32(&key("attention.value_length_mla")).unwrap() as usize;
        let nope = qk_head - md.u32(&key("rope.dimension_count")).unwrap() as usize;
        let keys = [
            (key("attention.key_length"), Value::U32(qk_head as u32)),
            (key("attention.value_length"), Value::U32(v as u32)),
            (key("attention.head_count_kv"), Value::U32(n_head as u32)),
        ];
        let mut tensors: Vec<TensorData> = Vec::new();
        for t in src.tensors() {
            let name = t.info.name.clone();
            if name.ends_with("attn_v_b.weight") {
                continue;
            }
            if let Some(prefix) = name.strip_suffix("attn_k_b.weight") {
                assert_eq!(t.info.dtype, GgmlType::F32);
                let v_b = src.tensor(&format!("{prefix}attn_v_b.weight")).unwrap();
                let kv_b = merge_kv_b(&f32s(t.data), &f32s(v_b.data), n_head, kv_lora, nope, v);
                let bytes = kv_b.iter().flat_map(|x| x.to_le_bytes()).collect();
                let shape = vec![kv_lora as u64, (n_head * (nope + v)) as u64];
                tensors.push((format!("{prefix}attn_kv_b.weight"), GgmlType::F32, shape, bytes));
            } else {
                tensors.push((name, t.info.dtype, t.info.shape.clone(), t.data.to_vec()));
            }
        }
        let legacy = rewrite(&src, |k| k.ends_with("_mla"), &keys, &tensors, "legacy");
        assert!(legacy.tensor_opt("blk.0.attn_kv_b.weight").is_some());

        let reference = read_json(&dir.join("ref.json"));
        let mut runner = load(&legacy, &LoadOptions::default()).unwrap();
        let logits = runner.eval(&ids(&reference["prompt"]["ids"]), Outputs::All).unwrap();
        let (max_abs, rel) = compare(&logits, &rows(&reference["hf"]["logits"]));
        println!("legacy attn_kv_b deepseek_v2 vs transformers: max_abs {max_abs:.1e} rel_l2 {rel:.1e}");
        assert!(max_abs <= F32_MAX_ABS && rel <= F32_REL_L2, "max_abs {max_abs} rel_l2 {rel}");
    }

    #[test]
    fn yarn_matches_transformers() {
        let Some(dir) = fixture_dir("deepseek_v3") else { return };
        let reference = read_json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/deepseek2_yarn/ref.json"));
        let src = GgufModel::open(dir.join("model-f32.gguf")).unwrap();
        let keys: Vec<(String, Value)> = reference["gguf_keys"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                let value = match (k.rsplit('.').next().unwrap(), v) {
                    ("type", v) => Value::String(v.as_str().unwrap().to_string()),
                    ("original_context_length", v) => Value::U32(v.as_u64().unwrap() as u32),
                    (_, v) => Value::F32(v.as_f64().unwrap() as f32),
                };
                (k.clone(), value)
            })
            .collect();
        let tensors: Vec<TensorData> =
            src.tensors().map(|t| (t.info.name.clone(), t.info.dtype, t.info.shape.clone(), t.data.to_vec())).collect();
        let scaled = rewrite(&src, |_| false, &keys, &tensors, "yarn");

        let mut runner = load(&scaled, &LoadOptions::default()).unwrap();
        let prompt = ids(&reference["prompt_ids"]);
        let logits = runner.eval(&prompt, Outputs::All).unwrap();
        let (max_abs, rel) = compare(&logits, &rows(&reference["logits"]));
        let expected_greedy = ids(&reference["greedy"]);
        let ours = greedy(runner.as_mut(), &prompt, expected_greedy.len()).unwrap();
        println!("deepseek_v3 under YaRN vs transformers: max_abs {max_abs:.1e} rel_l2 {rel:.1e}, greedy {ours:?}");
        assert!(max_abs <= F32_MAX_ABS && rel <= F32_REL_L2, "max_abs {max_abs} rel_l2 {rel}");
        assert_eq!(ours, expected_greedy);
    }

    /// The generated `attn_q` of the lite check, `[rows, cols]` of `layer`: uniform in
    /// ±1/sqrt(cols) from a multiplicative hash (tests/data/deepseek2_lite/make_ref.py's
    /// `q_weight`, same f64 operations).
    fn lite_q_weight(layer: usize, rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|idx| {
                let i = (layer * rows * cols + idx) as u64;
                let u = (i * 2654435761 % 4294967296) as f64 / 4294967296.0;
                ((u - 0.5) * (2.0 / (cols as f64).sqrt())) as f32
            })
            .collect()
    }

    #[test]
    fn lite_query_matches_transformers() {
        let Some(dir) = fixture_dir("deepseek_v2") else { return };
        let reference = read_json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/deepseek2_lite/ref.json"));
        let src = GgufModel::open(dir.join("model-f32.gguf")).unwrap();
        let md = src.metadata();
        let n_embd = md.u32("deepseek2.embedding_length").unwrap() as usize;
        let q_rows = md.u32("deepseek2.attention.head_count").unwrap() as usize
            * md.u32("deepseek2.attention.key_length_mla").unwrap() as usize;
        let mut tensors: Vec<TensorData> = Vec::new();
        for t in src.tensors() {
            let name = t.info.name.clone();
            if name.contains("attn_q_a") {
                continue;
            }
            if let Some(prefix) = name.strip_suffix("attn_q_b.weight") {
                let layer: usize = prefix.trim_start_matches("blk.").trim_end_matches('.').parse().unwrap();
                let bytes = lite_q_weight(layer, q_rows, n_embd).iter().flat_map(|x| x.to_le_bytes()).collect();
                tensors.push((
                    format!("{prefix}attn_q.weight"),
                    GgmlType::F32,
                    vec![n_embd as u64, q_rows as u64],
                    bytes,
                ));
            } else {
                tensors.push((name, t.info.dtype, t.info.shape.clone(), t.data.to_vec()));
            }
        }
        let lite = rewrite(&src, |k| k.ends_with("q_lora_rank"), &[], &tensors, "lite");
        assert!(lite.tensor_opt("blk.0.attn_q.weight").is_some() && lite.tensor_opt("blk.0.attn_q_a.weight").is_none());

        let mut runner = load(&lite, &LoadOptions::default()).unwrap();
        let prompt = ids(&reference["prompt_ids"]);
        let logits = runner.eval(&prompt, Outputs::All).unwrap();
        let (max_abs, rel) = compare(&logits, &rows(&reference["logits"]));
        let expected_greedy = ids(&reference["greedy"]);
        let ours = greedy(runner.as_mut(), &prompt, expected_greedy.len()).unwrap();
        println!("lite deepseek_v2 (attn_q) vs transformers: max_abs {max_abs:.1e} rel_l2 {rel:.1e}, greedy {ours:?}");
        assert!(max_abs <= F32_MAX_ABS && rel <= F32_REL_L2, "max_abs {max_abs} rel_l2 {rel}");
        assert_eq!(ours, expected_greedy);
    }
}
