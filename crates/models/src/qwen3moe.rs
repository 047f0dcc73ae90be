//! `qwen3moe`: Qwen3-MoE, and the llama-layout MoE decoder that `olmoe` and `glm4moe` reuse.
//!
//! Reference: transformers `Qwen3MoeForCausalLM`; llama.cpp `src/models/qwen3moe.cpp` at
//! 0c1e570. A llama block (pre-norm attention, pre-norm FFN, residuals) with per-head q/k RMS
//! norms, rotate-half (NeoX) rope, and a mixture of experts in every layer: softmax over all
//! experts, top-k, weights renormalised. llama.cpp hard-codes the renormalisation and has no
//! dense (`mlp_only_layers`) layers for this architecture (fixtures README, note 6); so do we.
//! The expert size is `expert_feed_forward_length` (`feed_forward_length` is the dense size
//! the config also carries). Checked by the `qwen3_moe` fixture.
//!
//! [`MoeDecoder`] is that block with the differences between the llama-layout MoE decoders as
//! data ([`DecoderSpec`]): which norm feeds the FFN, how many leading layers are dense, the
//! routing, an optional shared expert, and how many layers run.

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

/// What distinguishes one llama-layout MoE decoder from another.
#[derive(Clone, Debug)]
pub struct DecoderSpec {
    /// Rotate-half rope (true for every user so far; llama GGUFs use adjacent pairs).
    pub neox: bool,
    /// Name of the pre-FFN norm tensor (`ffn_norm`; GLM calls it `post_attention_norm`).
    pub ffn_norm: &'static str,
    /// Leading layers with a dense FFN of `feed_forward_length` (`leading_dense_block_count`).
    pub leading_dense: usize,
    /// Hidden size of one routed expert.
    pub n_ff_exp: usize,
    /// Hidden size of the shared expert, when the model has one.
    pub n_ff_shared: Option<usize>,
    /// Expert routing of the MoE layers.
    pub route: RouteSpec,
    /// Layers that run (GLM-4-MoE files carry next-token-prediction layers after these).
    pub n_layer: usize,
}

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    attn: Attention<B>,
    ffn_norm: B::Tensor,
    ffn: FfnOrMoe<B>,
}

/// A loaded llama-layout MoE decoder.
pub struct MoeDecoder<B: Backend> {
    hp: Hparams,
    tok_embd: B::Weight,
    layers: Vec<Layer<B>>,
    output_norm: B::Tensor,
    output: B::Weight,
}

impl<B: Backend> MoeDecoder<B> {
    /// Loads the weights the spec describes.
    ///
    /// # Errors
    /// Missing tensors or keys, shapes that disagree with the hyper-parameters.
    pub fn load(ld: &Loader<'_, B>, hp: Hparams, spec: &DecoderSpec) -> Result<Self> {
        let md = ld.model.metadata();
        let n_embd = hp.embedding_length;
        let hd = hp.key_length;
        let rope = rope_spec(ld, md, &hp, hd, hp.rope_freq_base, spec.neox)?;
        let glu = Glu::Plain(Act::Silu);
        let mut layers = Vec::with_capacity(spec.n_layer);
        for il in 0..spec.n_layer {
            let attn_spec = AttnSpec {
                n_head: hp.head_count[il],
                n_head_kv: hp.head_count_kv[il],
                head_dim_k: hd,
                head_dim_v: hp.value_length,
                scale: 1.0 / (hd as f32).sqrt(),
                window: None,
                softcap: None,
            };
            let ffn = if il < spec.leading_dense {
                FfnOrMoe::Dense(Ffn::load(ld, il, "", n_embd, hp.feed_forward_length[il], glu)?)
            } else {
                let moe = MoeSpec { n_expert: hp.expert_count, n_ff: spec.n_ff_exp, glu };
                FfnOrMoe::Moe(Moe::load(ld, il, n_embd, moe, spec.route.clone(), spec.n_ff_shared)?)
            };
            layers.push(Layer {
                attn_norm: ld.vector(&blk(il, "attn_norm.weight"), &[n_embd])?,
                attn: Attention::load(ld, il, n_embd, attn_spec, Some(rope.clone()), hp.rms_eps)?,
                ffn_norm: ld.vector(&blk(il, &format!("{}.weight", spec.ffn_norm)), &[n_embd])?,
                ffn,
            });
        }
        let n_vocab = hp.n_vocab;
        let output = ld.output_or_tied(n_vocab, n_embd)?;
        Ok(MoeDecoder {
            tok_embd: ld.weight(TOKEN_EMBD, &[n_vocab, n_embd])?,
            output_norm: ld.vector(OUTPUT_NORM, &[n_embd])?,
            output,
            layers,
            hp,
        })
    }
}

impl<B: Backend> Architecture<B> for MoeDecoder<B> {
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
                                                      // A MoE block's output waits to be added to the residual by the next layer's norm
                                                      // (`add_rms_norm`: on the GPU's split one kernel adds the CPU's experts, the residual and
                                                      // norms); a dense block adds its own (the output projection's accumulate).
        let mut moe_out: Option<B::Tensor> = None;
        for (layer, st) in self.layers.iter().zip(state.layers.iter_mut()) {
            let LayerState::Attention(cache) = st else { unreachable!("every decoder layer has attention") };
            let h = match moe_out.take() {
                Some(y) => {
                    let (sum, h) = b.add_rms_norm(&x, &y, Some(&layer.attn_norm), eps)?; // l_out, attn_norm
                    x = sum;
                    h
                }
                None => b.rms_norm(&x, Some(&layer.attn_norm), eps)?, // attn_norm
            };
            x = layer.attn.forward_residual(b, &h, x, cache, state.n_past, &pos)?; // ffn_inp
            let h = b.rms_norm(&x, Some(&layer.ffn_norm), eps)?; // ffn_norm
            match &layer.ffn {
                FfnOrMoe::Moe(m) => moe_out = Some(m.forward(b, &h)?), // router -> route -> moe_ffn (+ shared)
                FfnOrMoe::Dense(_) => x = layer.ffn.forward_residual(b, &h, x)?, // l_out
            }
        }
        if let Some(y) = moe_out {
            x = b.add(&x, &y)?; // the last layer's l_out
        }
        state.n_past += n;
        let x = output_rows(b, &x, n, outputs)?;
        let x = b.rms_norm(&x, Some(&self.output_norm), eps)?;
        Ok(b.matmul(&x, &self.output)?) // [rows, n_vocab]
    }
}

/// Loads a qwen3moe model.
///
/// # Errors
/// A missing `expert_feed_forward_length`, tensors or shapes as [`MoeDecoder::load`].
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<MoeDecoder<B>> {
    let md = ld.model.metadata();
    let spec = DecoderSpec {
        neox: true,
        ffn_norm: "ffn_norm",
        leading_dense: 0,
        n_ff_exp: md.u32(&hp.key("expert_feed_forward_length"))? as usize,
        n_ff_shared: None,
        route: RouteSpec {
            k: hp.expert_used_count,
            gating: Gating::Softmax,
            has_selection_bias: false,
            groups: None,
            normalize: true,
            scale: 1.0,
        },
        n_layer: hp.block_count,
    };
    MoeDecoder::load(ld, hp, &spec)
}
