//! `olmoe`: OLMoE.
//!
//! Reference: transformers `OlmoeForCausalLM`; llama.cpp `src/models/olmoe.cpp` at 0c1e570.
//! The llama-layout MoE decoder of [`crate::qwen3moe`] with two differences:
//! - the q and k RMS norms run over the whole projection (`attn_q_norm` of `n_head * head_dim`
//!   values, `attn_k_norm` of `n_head_kv * head_dim`), not per head; the shared attention
//!   block tells the two apart by the norm's length;
//! - routing is softmax over all experts then top-k, with the k weights used as they are
//!   (`norm_topk_prob: false`).
//!
//! The expert size is `feed_forward_length` (the converter writes no
//! `expert_feed_forward_length`). Checked by the `olmoe` fixture.

use crate::error::Result;
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::qwen3moe::{DecoderSpec, MoeDecoder};
use compute::spec::{Gating, RouteSpec};
use compute::Backend;

/// Loads an OLMoE model.
///
/// # Errors
/// As [`MoeDecoder::load`].
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<MoeDecoder<B>> {
    let md = ld.model.metadata();
    let n_ff_exp = match md.u32_opt(&hp.key("expert_feed_forward_length"))? {
        Some(n) => n as usize,
        None => hp.feed_forward_length[0],
    };
    let spec = DecoderSpec {
        neox: true,
        ffn_norm: "ffn_norm",
        leading_dense: 0,
        n_ff_exp,
        n_ff_shared: None,
        route: RouteSpec {
            k: hp.expert_used_count,
            gating: Gating::Softmax,
            has_selection_bias: false,
            groups: None,
            normalize: false,
            scale: 1.0,
        },
        n_layer: hp.block_count,
    };
    MoeDecoder::load(ld, hp, &spec)
}
