//! `qwen2`: Qwen2 and Qwen2.5. A llama block with q/k/v biases and rotate-half rope.
//!
//! Reference: transformers `Qwen2ForCausalLM`. The biases are optional tensors that the shared
//! attention block already reads, so this file only picks the rope layout.

use crate::error::Result;
use crate::hparams::Hparams;
use crate::llama::Llama;
use crate::loader::Loader;
use compute::Backend;

/// Loads a qwen2 model (a [`Llama`] with NeoX rope).
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Llama<B>> {
    Llama::load(ld, hp, true)
}
