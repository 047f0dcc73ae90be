//! `glm4moe`: GLM-4.5 / GLM-4.6 mixture of experts.
//!
//! Reference: transformers `Glm4MoeForCausalLM`; llama.cpp `src/models/glm4-moe.cpp` at
//! 0c1e570. The llama-layout MoE decoder of [`crate::qwen3moe`] with:
//! - partial rotary: rotate-half rope over the first `rope.dimension_count` dims of each head
//!   (half of them in the released models), the rest passed through;
//! - q, k and v biases, and per-head q/k RMS norms (when `attn_{q,k}_norm` are present);
//! - the pre-FFN norm stored as `post_attention_norm` (transformers' post_attention_layernorm);
//! - the first `leading_dense_block_count` layers dense, the others routed experts plus a shared
//!   expert of `expert_shared_count` experts' width;
//! - DeepSeek-V3 routing from the `expert_*` keys ([`crate::deepseek2::route_spec`]): sigmoid
//!   scores, `exp_probs_b` shifting only the choice, weights renormalised, times
//!   `expert_weights_scale` (2.5);
//! - the last `nextn_predict_layers` blocks of a file are next-token-prediction (MTP) layers
//!   for speculative decoding; like llama.cpp we do not run them.
//!
//! Checked by the `glm4_moe` fixture (partial rotary 0.5, one dense layer, scale 2.5).

use crate::deepseek2::route_spec;
use crate::error::{ModelError, Result};
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::qwen3moe::{DecoderSpec, MoeDecoder};
use compute::spec::Gating;
use compute::Backend;
use gguf::names::blk;

/// Loads a GLM-4-MoE model.
///
/// # Errors
/// More next-token-prediction layers than blocks, a missing `expert_feed_forward_length`, and
/// as [`MoeDecoder::load`].
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<MoeDecoder<B>> {
    let md = ld.model.metadata();
    let nextn = md.u32_opt(&hp.key("nextn_predict_layers"))?.unwrap_or(0) as usize;
    let n_layer = hp.block_count.checked_sub(nextn).ok_or_else(|| ModelError::Hparams {
        why: format!("{} next-token-prediction layers in a model of {} blocks", nextn, hp.block_count),
    })?;
    let n_ff_exp = md.u32(&hp.key("expert_feed_forward_length"))? as usize;
    let n_shared = md.u32_opt(&hp.key("expert_shared_count"))?.unwrap_or(0) as usize;
    let has_bias = (0..n_layer).any(|il| ld.has(&blk(il, "exp_probs_b.bias")));
    let spec = DecoderSpec {
        neox: true,
        ffn_norm: "post_attention_norm",
        leading_dense: md.u32_opt(&hp.key("leading_dense_block_count"))?.unwrap_or(0) as usize,
        n_ff_exp,
        n_ff_shared: (n_shared > 0).then_some(n_ff_exp * n_shared),
        route: route_spec(md, &hp, Gating::Sigmoid, has_bias)?,
        n_layer,
    };
    MoeDecoder::load(ld, hp, &spec)
}
