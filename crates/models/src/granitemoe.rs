//! `granitemoe`: IBM Granite 3 MoE. A Mixtral-like block with Granite's multipliers
//! (`embedding_scale`, `residual_scale`, `logit_scale`, `attention.scale`) and top-k-then-softmax
//! routing.
//!
//! Reference: transformers `GraniteMoeForCausalLM`. It is the hybrid Granite block of
//! [`crate::granitehybrid`] with attention on every layer and rope always on (adjacent-pair rope:
//! the converter permutes q and k as for llama), so this file only picks that. Checked by the
//! `granitemoe` fixture (2 layers, 8 experts top-2).

use crate::error::Result;
use crate::granitehybrid::{load_granite, AttnPositions, Granite};
use crate::hparams::Hparams;
use crate::loader::Loader;
use compute::Backend;

/// Loads a granitemoe model (a [`Granite`] without Mamba layers).
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Granite<B>> {
    load_granite(ld, hp, AttnPositions::Rope)
}
