//! `lfm2`: Liquid LFM2, a hybrid of gated short-convolution layers and attention layers
//! (and, through [`crate::lfm2moe`], its mixture-of-experts variant).
//!
//! Reference: transformers `Lfm2ForCausalLM` / `Lfm2MoeForCausalLM`. Differences from llama:
//! - a layer's mixer is attention where `attention.head_count_kv` is non-zero, else a short
//!   convolution (`Lfm2ShortConv`): `in_proj` gives B, C and x; `y = out_proj(C ⊙ conv(B ⊙ x))`
//!   with a depthwise causal conv of `shortconv.l_cache` taps (3), no activation. The last
//!   `l_cache - 1` inputs of the conv are the layer's recurrent state;
//! - attention has per-head q/k RMS norms and rotate-half rope;
//! - the final norm is stored as `token_embd_norm` (HF's `embedding_norm`, applied after the
//!   last layer); the output is tied to the embedding;
//! - lfm2moe: layers from `leading_dense_block_count` on are MoE with sigmoid routing, an expert
//!   selection bias (`exp_probs_b`), renormalised top-k weights. transformers divides by
//!   `sum + 1e-6`, llama.cpp and this file by the sum: a relative 1e-6 on the weights.
//!
//! Checked by the `lfm2` and `lfm2_moe` fixtures (4 layers: conv, conv, attention, conv).

use crate::arch::{output_rows, positions, Architecture, Outputs};
use crate::blocks::{Attention, Ffn, FfnOrMoe, Moe};
use crate::error::{ModelError, Result};
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::rope::rope_spec;
use crate::state::{LayerState, State};
use compute::spec::{Act, AttnSpec, Gating, Glu, MoeSpec, RouteSpec};
use compute::Backend;
use gguf::names::{blk, TOKEN_EMBD};

/// The final norm's GGUF name in LFM2 files.
const TOKEN_EMBD_NORM: &str = "token_embd_norm.weight";

/// A gated short convolution (`Lfm2ShortConv`).
pub struct ShortConv<B: Backend> {
    in_proj: B::Weight,
    conv: B::Tensor,
    conv_bias: Option<B::Tensor>,
    out_proj: B::Weight,
    n_embd: usize,
    l_cache: usize,
}

impl<B: Backend> ShortConv<B> {
    /// Loads `blk.{il}.shortconv.{in_proj,conv,out_proj}` for a kernel of `l_cache` taps.
    pub fn load(ld: &Loader<'_, B>, il: usize, n_embd: usize, l_cache: usize) -> Result<ShortConv<B>> {
        Ok(ShortConv {
            in_proj: ld.weight(&blk(il, "shortconv.in_proj.weight"), &[3 * n_embd, n_embd])?,
            conv: ld.vector(&blk(il, "shortconv.conv.weight"), &[n_embd, l_cache])?,
            conv_bias: ld.vector_opt(&blk(il, "shortconv.conv.bias"), &[n_embd])?,
            out_proj: ld.weight(&blk(il, "shortconv.out_proj.weight"), &[n_embd, n_embd])?,
            n_embd,
            l_cache,
        })
    }

    /// A zero conv window `[l_cache - 1, n_embd]` (the state before the first token).
    pub fn new_state(&self, b: &B) -> Result<B::Tensor> {
        let shape = [self.l_cache - 1, self.n_embd];
        Ok(b.from_host(&vec![0.0; shape[0] * shape[1]], &shape)?)
    }

    /// The block's output for `x` (`[n, n_embd]`), advancing the conv window `state`.
    pub fn forward(&self, b: &B, x: &B::Tensor, state: &mut B::Tensor) -> Result<B::Tensor> {
        let e = self.n_embd;
        let bcx = b.matmul(x, &self.in_proj)?; // [n, 3 * n_embd]: B, C, x
        let (gate_in, gate_out, xs) =
            (b.slice_cols(&bcx, 0, e)?, b.slice_cols(&bcx, e, e)?, b.slice_cols(&bcx, 2 * e, e)?);
        let h = b.mul(&gate_in, &xs)?;
        let mut h = b.ssm_conv(&h, state, &self.conv)?; // [n, n_embd]
        if let Some(bias) = &self.conv_bias {
            h = b.add(&h, bias)?;
        }
        let y = b.mul(&gate_out, &h)?;
        Ok(b.matmul(&y, &self.out_proj)?)
    }
}

enum Mixer<B: Backend> {
    Attention(Attention<B>),
    Conv(ShortConv<B>),
}

struct Layer<B: Backend> {
    operator_norm: B::Tensor,
    mixer: Mixer<B>,
    ffn_norm: B::Tensor,
    ffn: FfnOrMoe<B>,
}

/// A loaded LFM2 or LFM2-MoE model.
pub struct Lfm2<B: Backend> {
    hp: Hparams,
    tok_embd: B::Weight,
    layers: Vec<Layer<B>>,
    output_norm: B::Tensor,
    output: B::Weight,
}

/// Expert routing of an lfm2moe file: `expert_gating_func` (llama.cpp's numbering: 1 softmax,
/// 2 sigmoid; sigmoid when absent), `expert_weights_norm` (default true),
/// `expert_weights_scale` (default 1).
fn route_spec(md: &gguf::Metadata, hp: &Hparams, has_selection_bias: bool) -> Result<RouteSpec> {
    let gating = match md.u32_opt(&hp.key("expert_gating_func"))? {
        None | Some(2) => Gating::Sigmoid,
        Some(1) => Gating::Softmax,
        Some(other) => {
            return Err(ModelError::Hparams {
                why: format!(
                    "{} = {other} is not a gating this model supports (1 softmax, 2 sigmoid)",
                    hp.key("expert_gating_func")
                ),
            });
        }
    };
    Ok(RouteSpec {
        k: hp.expert_used_count,
        gating,
        has_selection_bias,
        groups: None,
        normalize: md.bool_opt(&hp.key("expert_weights_norm"))?.unwrap_or(true),
        scale: md.f32_opt(&hp.key("expert_weights_scale"))?.unwrap_or(1.0),
    })
}

/// Loads an `lfm2` or `lfm2moe` model.
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Lfm2<B>> {
    let md = ld.model.metadata();
    let n_embd = hp.embedding_length;
    let hd = hp.key_length;
    let l_cache = md.u32(&hp.key("shortconv.l_cache"))? as usize;
    if l_cache < 2 {
        return Err(ModelError::Hparams {
            why: format!("{} = {l_cache}: a short conv needs at least 2 taps", hp.key("shortconv.l_cache")),
        });
    }
    let n_dense = md.u32_opt(&hp.key("leading_dense_block_count"))?.map_or(hp.block_count, |n| n as usize);
    let rope = rope_spec(ld, md, &hp, hd, hp.rope_freq_base, true)?;
    let mut layers = Vec::with_capacity(hp.block_count);
    for il in 0..hp.block_count {
        let mixer = if hp.head_count_kv[il] > 0 {
            let spec = AttnSpec {
                n_head: hp.head_count[il],
                n_head_kv: hp.head_count_kv[il],
                head_dim_k: hd,
                head_dim_v: hp.value_length,
                scale: 1.0 / (hd as f32).sqrt(),
                window: None,
                softcap: None,
            };
            Mixer::Attention(Attention::load(ld, il, n_embd, spec, Some(rope.clone()), hp.rms_eps)?)
        } else {
            Mixer::Conv(ShortConv::load(ld, il, n_embd, l_cache)?)
        };
        let ffn = if il >= n_dense && hp.expert_count > 0 {
            let n_ff = md.u32(&hp.key("expert_feed_forward_length"))? as usize;
            let has_bias = ld.has(&blk(il, "exp_probs_b.bias"));
            FfnOrMoe::Moe(Moe::load(
                ld,
                il,
                n_embd,
                MoeSpec { n_expert: hp.expert_count, n_ff, glu: Glu::Plain(Act::Silu) },
                route_spec(md, &hp, has_bias)?,
                None,
            )?)
        } else {
            FfnOrMoe::Dense(Ffn::load(ld, il, "", n_embd, hp.feed_forward_length[il], Glu::Plain(Act::Silu))?)
        };
        layers.push(Layer {
            operator_norm: ld.vector(&blk(il, "attn_norm.weight"), &[n_embd])?,
            mixer,
            ffn_norm: ld.vector(&blk(il, "ffn_norm.weight"), &[n_embd])?,
            ffn,
        });
    }
    let n_vocab = hp.n_vocab;
    let output = ld.output_or_tied(n_vocab, n_embd)?;
    Ok(Lfm2 {
        tok_embd: ld.weight(TOKEN_EMBD, &[n_vocab, n_embd])?,
        output_norm: ld.vector(TOKEN_EMBD_NORM, &[n_embd])?,
        output,
        layers,
        hp,
    })
}

impl<B: Backend> Architecture<B> for Lfm2<B> {
    fn hparams(&self) -> &Hparams {
        &self.hp
    }

    fn new_state(&self, b: &B, n_ctx: usize) -> Result<State<B>> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(a) => LayerState::kv_cache(b, n_ctx, a.cache_widths()),
                Mixer::Conv(c) => Ok(LayerState::Recurrent(vec![c.new_state(b)?])),
            })
            .collect::<Result<_>>()?;
        Ok(State::new(layers, n_ctx))
    }

    fn forward(&self, b: &B, state: &mut State<B>, ids: &[u32], outputs: Outputs) -> Result<B::Tensor> {
        let n = ids.len();
        let pos = positions(state.n_past, n);
        let eps = self.hp.rms_eps;
        let mut x = b.get_rows(&self.tok_embd, ids)?; // [n, n_embd]
        for (il, (layer, st)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            let h = b.rms_norm(&x, Some(&layer.operator_norm), eps)?;
            let m = match (&layer.mixer, st) {
                (Mixer::Attention(a), LayerState::Attention(cache)) => a.forward(b, &h, cache, state.n_past, &pos)?,
                (Mixer::Conv(c), LayerState::Recurrent(ts)) if ts.len() == 1 => c.forward(b, &h, &mut ts[0])?,
                _ => {
                    return Err(ModelError::Request {
                        why: format!("layer {il}: sequence state does not match the layer kind"),
                    })
                }
            };
            x = b.add(&x, &m)?;
            let h = b.rms_norm(&x, Some(&layer.ffn_norm), eps)?;
            let f = layer.ffn.forward(b, &h)?;
            x = b.add(&x, &f)?;
        }
        state.n_past += n;
        let x = output_rows(b, &x, n, outputs)?;
        let x = b.rms_norm(&x, Some(&self.output_norm), eps)?;
        Ok(b.matmul(&x, &self.output)?) // [rows, n_vocab]
    }
}
