//! `bert`: BERT encoders (all-MiniLM, bge, e5, gte and the other sentence-transformers models that
//! llama.cpp converts as `bert`), for embeddings.
//!
//! Reference: transformers `BertModel`, and llama.cpp's `llm_build_bert`. Differences from the
//! decoder files:
//! - an encoder: attention is unmasked (every token sees every token of the text) and keeps no
//!   cache, so a text is one forward pass from position 0 and the model has no logits;
//! - learned absolute position embeddings and token-type embeddings (type 0, "sentence A", as
//!   llama.cpp uses) added to the token embedding, then a layer norm;
//! - post-norm layers: `x = LN(x + attn(x))`, `x = LN(x + ffn(x))`, with biases everywhere and an
//!   exact (erf) GELU FFN without a gate;
//! - q/k/v as three matrices or one fused `attn_qkv` (older conversions).
//!
//! Checked by the `bert` fixture (crates/models/tests/data/bert: hidden states of transformers and
//! embeddings of transformers and llama.cpp).

use crate::arch::{Architecture, Outputs};
use crate::blocks::Ffn;
use crate::error::{ModelError, Result};
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::state::State;
use compute::spec::{Act, AttnSpec, Glu};
use compute::Backend;
use gguf::names::{blk, TOKEN_EMBD};

/// q, k and v projections: separate, or one fused matrix whose output columns are q | k | v.
enum Qkv<B: Backend> {
    Separate { q: B::Weight, k: B::Weight, v: B::Weight, q_bias: B::Tensor, k_bias: B::Tensor, v_bias: B::Tensor },
    Fused { qkv: B::Weight, bias: B::Tensor },
}

struct Layer<B: Backend> {
    qkv: Qkv<B>,
    o: B::Weight,
    o_bias: B::Tensor,
    attn_out_norm: (B::Tensor, B::Tensor),
    ffn: Ffn<B>,
    layer_out_norm: (B::Tensor, B::Tensor),
}

/// A loaded BERT encoder.
pub struct Bert<B: Backend> {
    hp: Hparams,
    tok_embd: B::Weight,
    /// Row 0 of `token_types` (absent in some conversions: no type embedding).
    type_embd: Option<B::Tensor>,
    pos_embd: B::Weight,
    /// Positions the position table has (the longest text).
    n_pos: usize,
    embd_norm: (B::Tensor, B::Tensor),
    layers: Vec<Layer<B>>,
    spec: AttnSpec,
}

/// Loads a BERT model.
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Bert<B>> {
    let n_embd = hp.embedding_length;
    let n_head = hp.head_count[0];
    if !n_embd.is_multiple_of(n_head) {
        return Err(ModelError::Hparams {
            why: format!("embedding length {n_embd} is not a multiple of {n_head} heads"),
        });
    }
    let head_dim = n_embd / n_head;
    let norm = |name: &str| -> Result<(B::Tensor, B::Tensor)> {
        Ok((ld.vector(&format!("{name}.weight"), &[n_embd])?, ld.vector(&format!("{name}.bias"), &[n_embd])?))
    };
    let n_pos = ld
        .model
        .tensor_opt("position_embd.weight")
        .and_then(|t| t.shape().get(1).copied())
        .ok_or_else(|| ModelError::Hparams { why: "bert: no position_embd.weight".into() })? as usize;
    let type_embd = match ld.has("token_types.weight") {
        true => {
            let n_types =
                ld.model.tensor_opt("token_types.weight").and_then(|t| t.shape().get(1).copied()).unwrap_or(1);
            let table = ld.weight("token_types.weight", &[n_types as usize, n_embd])?;
            Some(ld.b.get_rows(&table, &[0])?)
        }
        false => None,
    };
    let mut layers = Vec::with_capacity(hp.block_count);
    for il in 0..hp.block_count {
        let n_ff = hp.feed_forward_length[il];
        let qkv = if ld.has(&blk(il, "attn_qkv.weight")) {
            Qkv::Fused {
                qkv: ld.weight(&blk(il, "attn_qkv.weight"), &[3 * n_embd, n_embd])?,
                bias: ld.vector(&blk(il, "attn_qkv.bias"), &[3 * n_embd])?,
            }
        } else {
            let w = |p: &str| ld.weight(&blk(il, &format!("attn_{p}.weight")), &[n_embd, n_embd]);
            let bias = |p: &str| ld.vector(&blk(il, &format!("attn_{p}.bias")), &[n_embd]);
            Qkv::Separate {
                q: w("q")?,
                k: w("k")?,
                v: w("v")?,
                q_bias: bias("q")?,
                k_bias: bias("k")?,
                v_bias: bias("v")?,
            }
        };
        layers.push(Layer {
            qkv,
            o: ld.weight(&blk(il, "attn_output.weight"), &[n_embd, n_embd])?,
            o_bias: ld.vector(&blk(il, "attn_output.bias"), &[n_embd])?,
            attn_out_norm: norm(&blk(il, "attn_output_norm"))?,
            ffn: Ffn::load(ld, il, "", n_embd, n_ff, Glu::Plain(Act::Gelu))?,
            layer_out_norm: norm(&blk(il, "layer_output_norm"))?,
        });
    }
    Ok(Bert {
        tok_embd: ld.weight(TOKEN_EMBD, &[hp.n_vocab, n_embd])?,
        type_embd,
        pos_embd: ld.weight("position_embd.weight", &[n_pos, n_embd])?,
        n_pos,
        embd_norm: norm("token_embd_norm")?,
        layers,
        spec: AttnSpec {
            n_head,
            n_head_kv: n_head,
            head_dim_k: head_dim,
            head_dim_v: head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            softcap: None,
        },
        hp,
    })
}

impl<B: Backend> Architecture<B> for Bert<B> {
    fn hparams(&self) -> &Hparams {
        &self.hp
    }

    /// An encoder keeps no state between calls: no layer has a cache.
    fn new_state(&self, _b: &B, n_ctx: usize) -> Result<State<B>> {
        Ok(State { layers: Vec::new(), n_past: 0, n_ctx: n_ctx.min(self.n_pos) })
    }

    fn forward(&self, _b: &B, _state: &mut State<B>, _ids: &[u32], _outputs: Outputs) -> Result<B::Tensor> {
        Err(ModelError::Request {
            why: "bert is an encoder (an embedding model): it gives hidden states for embeddings, not logits".into(),
        })
    }

    fn forward_hidden(&self, b: &B, state: &mut State<B>, ids: &[u32]) -> Result<B::Tensor> {
        let n = ids.len();
        if state.n_past != 0 {
            return Err(ModelError::Request {
                why: format!(
                    "bert sees a whole text in one pass from position 0; {} positions are already fed",
                    state.n_past
                ),
            });
        }
        if n == 0 || n > self.n_pos {
            return Err(ModelError::Request {
                why: format!("bert takes 1 to {} tokens per text (its position table); got {n}", self.n_pos),
            });
        }
        let eps = self.hp.rms_eps;
        let n_embd = self.hp.embedding_length;
        let positions: Vec<u32> = (0..n as u32).collect();
        let mut x = b.add(&b.get_rows(&self.tok_embd, ids)?, &b.get_rows(&self.pos_embd, &positions)?)?;
        if let Some(t) = &self.type_embd {
            x = b.add(&x, t)?;
        }
        x = b.layer_norm(&x, Some(&self.embd_norm.0), Some(&self.embd_norm.1), eps)?;
        for layer in &self.layers {
            let (q, k, v) = match &layer.qkv {
                Qkv::Separate { q, k, v, q_bias, k_bias, v_bias } => {
                    let [q, k, v] = b.matmul_many(&x, [q, k, v])?;
                    (b.add(&q, q_bias)?, b.add(&k, k_bias)?, b.add(&v, v_bias)?)
                }
                Qkv::Fused { qkv, bias } => {
                    let t = b.add(&b.matmul(&x, qkv)?, bias)?;
                    (
                        b.slice_cols(&t, 0, n_embd)?,
                        b.slice_cols(&t, n_embd, n_embd)?,
                        b.slice_cols(&t, 2 * n_embd, n_embd)?,
                    )
                }
            };
            let a = b.attention_unmasked(&q, &k, &v, &self.spec)?;
            let a = b.add(&b.matmul(&a, &layer.o)?, &layer.o_bias)?;
            x = b.layer_norm(&b.add(&x, &a)?, Some(&layer.attn_out_norm.0), Some(&layer.attn_out_norm.1), eps)?;
            let f = layer.ffn.forward(b, &x)?;
            x = b.layer_norm(&b.add(&x, &f)?, Some(&layer.layer_out_norm.0), Some(&layer.layer_out_norm.1), eps)?;
        }
        // The next text starts again at position 0.
        state.n_past = 0;
        Ok(x)
    }
}
