//! `lfm2moe`: Liquid LFM2-MoE. LFM2's conv/attention hybrid (see [`crate::lfm2`]) whose
//! feed-forward part is a mixture of experts from layer `leading_dense_block_count` on.
//!
//! Reference: transformers `Lfm2MoeForCausalLM`. Routing: sigmoid of the router logits, top-k
//! chosen on sigmoid + `exp_probs_b` (the expert bias shifts the choice, not the weights),
//! weights renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`). No shared
//! expert. The differences are data read by [`crate::lfm2::load`]; this file only names the
//! architecture. Checked by the `lfm2_moe` fixture (first layer dense, then 8 experts top-2).

use crate::error::Result;
use crate::hparams::Hparams;
use crate::lfm2::Lfm2;
use crate::loader::Loader;
use compute::Backend;

/// Loads an lfm2moe model (an [`Lfm2`] whose later layers are MoE).
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Lfm2<B>> {
    crate::lfm2::load(ld, hp)
}
