//! `llama`: Llama 1-3 and Mistral, and Mixtral (mixture of experts stored under the same
//! architecture string: a layer with `ffn_gate_inp` is MoE).
//!
//! Reference: transformers `LlamaForCausalLM` / `MixtralForCausalLM`. The GGUF converter permutes
//! q and k so that rope rotates adjacent pairs (ggml's NORM mode), not HF's rotate_half halves.
//! Mixtral routing: softmax over all experts, top-k, renormalised (`norm_topk_prob`).
//! Checked by the `llama` and `mixtral` fixtures.

use crate::arch::{output_rows, positions, Architecture, Outputs};
use crate::blocks::{Attention, Ffn, FfnOrMoe, Moe};
use crate::error::Result;
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::rope::rope_spec;
use crate::state::{LayerState, State};
use compute::spec::{Act, AttnSpec, Gating, Glu, MoeSpec, RouteSpec};
use compute::Backend;
use gguf::names::{blk, OUTPUT_NORM, TOKEN_EMBD};

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    attn: Attention<B>,
    ffn_norm: B::Tensor,
    ffn: FfnOrMoe<B>,
}

/// A loaded llama-family model.
pub struct Llama<B: Backend> {
    hp: Hparams,
    tok_embd: B::Weight,
    layers: Vec<Layer<B>>,
    output_norm: B::Tensor,
    output: B::Weight,
}

impl<B: Backend> Llama<B> {
    /// Loads the weights. `neox` selects rotate-half rope (qwen2 reuses this file with it).
    pub fn load(ld: &Loader<'_, B>, hp: Hparams, neox: bool) -> Result<Self> {
        let md = ld.model.metadata();
        let n_embd = hp.embedding_length;
        let hd = hp.key_length;
        let rope = rope_spec(ld, md, &hp, hd, hp.rope_freq_base, neox)?;
        let mut layers = Vec::with_capacity(hp.block_count);
        for il in 0..hp.block_count {
            let spec = AttnSpec {
                n_head: hp.head_count[il],
                n_head_kv: hp.head_count_kv[il],
                head_dim_k: hd,
                head_dim_v: hp.value_length,
                scale: 1.0 / (hd as f32).sqrt(),
                window: None,
                softcap: None,
            };
            let ffn = if ld.has(&blk(il, "ffn_gate_inp.weight")) {
                let n_ff = match hp.feed_forward_length[il] {
                    0 => md.u32(&hp.key("expert_feed_forward_length"))? as usize,
                    n => n,
                };
                FfnOrMoe::Moe(Moe::load(
                    ld,
                    il,
                    n_embd,
                    MoeSpec { n_expert: hp.expert_count, n_ff, glu: Glu::Plain(Act::Silu) },
                    RouteSpec {
                        k: hp.expert_used_count,
                        gating: Gating::Softmax,
                        has_selection_bias: false,
                        groups: None,
                        normalize: true,
                        scale: 1.0,
                    },
                    None,
                )?)
            } else {
                FfnOrMoe::Dense(Ffn::load(ld, il, "", n_embd, hp.feed_forward_length[il], Glu::Plain(Act::Silu))?)
            };
            layers.push(Layer {
                attn_norm: ld.vector(&blk(il, "attn_norm.weight"), &[n_embd])?,
                attn: Attention::load(ld, il, n_embd, spec, Some(rope.clone()), hp.rms_eps)?,
                ffn_norm: ld.vector(&blk(il, "ffn_norm.weight"), &[n_embd])?,
                ffn,
            });
        }
        let n_vocab = hp.n_vocab;
        let output = ld.output_or_tied(n_vocab, n_embd)?;
        Ok(Llama {
            tok_embd: ld.weight(TOKEN_EMBD, &[n_vocab, n_embd])?,
            output_norm: ld.vector(OUTPUT_NORM, &[n_embd])?,
            output,
            layers,
            hp,
        })
    }
}

impl<B: Backend> Architecture<B> for Llama<B> {
    fn hparams(&self) -> &Hparams {
        &self.hp
    }

    fn new_state(&self, b: &B, n_ctx: usize) -> Result<State<B>> {
        State::kv_caches(b, n_ctx, self.layers.iter().map(|l| l.attn.cache_widths()))
    }

    fn forward(&self, b: &B, state: &mut State<B>, ids: &[u32], outputs: Outputs) -> Result<B::Tensor> {
        let x = self.final_hidden(b, state, ids, outputs)?;
        Ok(b.matmul(&x, &self.output)?) // [rows, n_vocab]
    }

    fn forward_hidden(&self, b: &B, state: &mut State<B>, ids: &[u32]) -> Result<B::Tensor> {
        self.final_hidden(b, state, ids, Outputs::All)
    }
}

impl<B: Backend> Llama<B> {
    /// The blocks and the final norm: hidden states `[rows, n_embd]` of the rows `outputs` asks for.
    fn final_hidden(&self, b: &B, state: &mut State<B>, ids: &[u32], outputs: Outputs) -> Result<B::Tensor> {
        let n = ids.len();
        let pos = positions(state.n_past, n);
        let mut x = b.get_rows(&self.tok_embd, ids)?; // [n, n_embd]
        for (layer, st) in self.layers.iter().zip(state.layers.iter_mut()) {
            let LayerState::Attention(cache) = st else { unreachable!("llama layers all have attention") };
            let h = b.rms_norm(&x, Some(&layer.attn_norm), self.hp.rms_eps)?;
            x = layer.attn.forward_residual(b, &h, x, cache, state.n_past, &pos)?;
            let h = b.rms_norm(&x, Some(&layer.ffn_norm), self.hp.rms_eps)?;
            x = layer.ffn.forward_residual(b, &h, x)?;
        }
        state.n_past += n;
        let x = output_rows(b, &x, n, outputs)?;
        Ok(b.rms_norm(&x, Some(&self.output_norm), self.hp.rms_eps)?)
    }
}
