//! `gemma3`: Gemma 3 text models.
//!
//! Reference: transformers `Gemma3ForCausalLM` (`Gemma3TextModel`). Differences from llama:
//! - the embedding is scaled by sqrt(n_embd);
//! - RMS norms compute x * (1 + w); the GGUF converter already stores 1 + w, so plain norms here;
//! - four norms per layer: pre and post attention, pre and post FFN;
//! - per-head q/k RMS norms; GELU-tanh gated FFN;
//! - sliding-window layers with a local rope base (`rope.freq_base_swa`, 10k) and full layers
//!   with the global base (and linear rope scaling where the model has it). Which layers slide:
//!   `attention.sliding_window_pattern` when present, else llama.cpp's default of every 6th layer
//!   being full (layers 5, 11, ...);
//! - attention scale 1/sqrt(query_pre_attn_scalar) = 1/sqrt(key_length) (what llama.cpp uses);
//! - tied output embedding.
//!
//! Checked by the `gemma3` fixture (6 layers, window 8) and the real Gemma 3 270M.

use crate::arch::{output_rows, positions, Architecture, Outputs};
use crate::blocks::{Attention, Ffn};
use crate::error::Result;
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::rope::rope_spec;
use crate::state::{LayerState, State};
use compute::spec::{Act, AttnSpec, Glu};
use compute::Backend;
use gguf::names::{blk, OUTPUT_NORM, TOKEN_EMBD};
use gguf::Value;

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    attn: Attention<B>,
    post_attn_norm: B::Tensor,
    ffn_norm: B::Tensor,
    ffn: Ffn<B>,
    post_ffn_norm: B::Tensor,
}

/// A loaded Gemma 3 model.
pub struct Gemma3<B: Backend> {
    hp: Hparams,
    tok_embd: B::Weight,
    layers: Vec<Layer<B>>,
    output_norm: B::Tensor,
    output: B::Weight,
    embd_scale: f32,
}

/// Which layers use the sliding window: the per-layer pattern from the metadata (a bool array,
/// or an integer period whose last layer is full), else a period of 6.
fn sliding_layers(md: &gguf::Metadata, hp: &Hparams) -> Result<Vec<bool>> {
    let n = hp.block_count;
    let period = match md.get(&hp.key("attention.sliding_window_pattern")) {
        Some(Value::Array(_, items)) if items.len() == n => {
            return Ok(items.iter().map(|v| matches!(v, Value::Bool(true))).collect());
        }
        Some(_) => md.u32(&hp.key("attention.sliding_window_pattern"))? as usize,
        None => 6,
    };
    Ok((0..n).map(|il| period == 0 || (il % period) < period - 1).collect())
}

/// Loads the weights.
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Gemma3<B>> {
    let md = ld.model.metadata();
    let n_embd = hp.embedding_length;
    let hd = hp.key_length;
    let window = md.u32_opt(&hp.key("attention.sliding_window"))?.map(|w| w as usize);
    let local_base = md.f32_opt(&hp.key("rope.freq_base_swa"))?.unwrap_or(10000.0);
    let global_rope = rope_spec(ld, md, &hp, hd, hp.rope_freq_base, true)?;
    let mut local_rope = global_rope.clone();
    // Local layers use neither the global base nor its scaling.
    local_rope.base = local_base;
    local_rope.position_scale = 1.0;
    local_rope.yarn = None;
    let sliding = sliding_layers(md, &hp)?;
    let mut layers = Vec::with_capacity(hp.block_count);
    for (il, &slides) in sliding.iter().enumerate() {
        let is_local = slides && window.is_some();
        let spec = AttnSpec {
            n_head: hp.head_count[il],
            n_head_kv: hp.head_count_kv[il],
            head_dim_k: hd,
            head_dim_v: hp.value_length,
            scale: 1.0 / (hd as f32).sqrt(),
            window: if is_local { window } else { None },
            softcap: None,
        };
        let rope = if is_local { local_rope.clone() } else { global_rope.clone() };
        layers.push(Layer {
            attn_norm: ld.vector(&blk(il, "attn_norm.weight"), &[n_embd])?,
            attn: Attention::load(ld, il, n_embd, spec, Some(rope), hp.rms_eps)?,
            post_attn_norm: ld.vector(&blk(il, "post_attention_norm.weight"), &[n_embd])?,
            ffn_norm: ld.vector(&blk(il, "ffn_norm.weight"), &[n_embd])?,
            ffn: Ffn::load(ld, il, "", n_embd, hp.feed_forward_length[il], Glu::Plain(Act::GeluTanh))?,
            post_ffn_norm: ld.vector(&blk(il, "post_ffw_norm.weight"), &[n_embd])?,
        });
    }
    let n_vocab = hp.n_vocab;
    let output = ld.output_or_tied(n_vocab, n_embd)?;
    Ok(Gemma3 {
        tok_embd: ld.weight(TOKEN_EMBD, &[n_vocab, n_embd])?,
        output_norm: ld.vector(OUTPUT_NORM, &[n_embd])?,
        output,
        layers,
        embd_scale: (n_embd as f32).sqrt(),
        hp,
    })
}

impl<B: Backend> Architecture<B> for Gemma3<B> {
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
        x = b.scale(&x, self.embd_scale)?;
        for (layer, st) in self.layers.iter().zip(state.layers.iter_mut()) {
            let LayerState::Attention(cache) = st else { unreachable!("gemma3 layers all have attention") };
            let h = b.rms_norm(&x, Some(&layer.attn_norm), eps)?;
            let a = layer.attn.forward(b, &h, cache, state.n_past, &pos)?;
            let a = b.rms_norm(&a, Some(&layer.post_attn_norm), eps)?;
            x = b.add(&x, &a)?;
            let h = b.rms_norm(&x, Some(&layer.ffn_norm), eps)?;
            let f = layer.ffn.forward(b, &h)?;
            let f = b.rms_norm(&f, Some(&layer.post_ffn_norm), eps)?;
            x = b.add(&x, &f)?;
        }
        state.n_past += n;
        let x = output_rows(b, &x, n, outputs)?;
        let x = b.rms_norm(&x, Some(&self.output_norm), eps)?;
        Ok(b.matmul(&x, &self.output)?) // [rows, n_vocab]
    }
}
