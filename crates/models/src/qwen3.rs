//! `qwen3`: Qwen3 dense. A llama block with per-head RMS norms on q and k (before rope),
//! rotate-half rope, and often tied embeddings.
//!
//! Reference: transformers `Qwen3ForCausalLM`. The q/k norms (`attn_{q,k}_norm`) are read by the
//! shared attention block; a tied model has no `output.weight`. Checked by the `qwen3` fixture.

use crate::error::Result;
use crate::hparams::Hparams;
use crate::llama::Llama;
use crate::loader::Loader;
use compute::Backend;

/// Loads a qwen3 model (a [`Llama`] with NeoX rope; q/k norms come with the weights).
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Llama<B>> {
    Llama::load(ld, hp, true)
}
