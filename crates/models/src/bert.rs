//! `bert` and `nomic-bert`: BERT encoders (all-MiniLM, bge, e5, gte and the other
//! sentence-transformers models llama.cpp converts as `bert`; nomic-embed-text as `nomic-bert`),
//! for embeddings.
//!
//! Reference: transformers `BertModel`, and llama.cpp's BERT graph (src/models/bert.cpp, which
//! builds both). Differences from the decoder files:
//! - an encoder: attention is unmasked (every token sees every token of the text) and keeps no
//!   cache, so a text is one forward pass from position 0 and the model has no logits;
//! - learned absolute position embeddings and token-type embeddings (type 0, "sentence A", as
//!   llama.cpp uses) added to the token embedding, then a layer norm;
//! - post-norm layers: `x = LN(x + attn(x))`, `x = LN(x + ffn(x))`, with biases everywhere and an
//!   exact (erf) GELU FFN without a gate;
//! - q/k/v as three matrices or one fused `attn_qkv` (older conversions, nomic-bert), biases
//!   where the file has them.
//!
//! `nomic-bert` differs in two places: NeoX rope on q and k instead of position embeddings, and
//! a SwiGLU FFN (`ffn_gate`; llama.cpp ignores FFN biases there, and the converter writes none).
//!
//! Checked by the `bert` fixture (crates/models/tests/data/bert: hidden states of transformers and
//! embeddings of transformers and llama.cpp) and the `nomic_bert` fixture (embeddings of
//! llama.cpp).

use crate::arch::{Architecture, Outputs};
use crate::blocks::Ffn;
use crate::error::{ModelError, Result};
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::rope::rope_spec;
use crate::state::State;
use compute::spec::{Act, AttnSpec, Glu, RopeSpec};
use compute::Backend;
use gguf::names::{blk, TOKEN_EMBD};

/// q, k and v projections: separate, or one fused matrix whose output columns are q | k | v.
enum Qkv<B: Backend> {
    Separate { q: B::Weight, k: B::Weight, v: B::Weight, biases: Option<[B::Tensor; 3]> },
    Fused { qkv: B::Weight, bias: Option<B::Tensor> },
}

/// How token positions enter: learned absolute embeddings (`bert`) or rope on q and k
/// (`nomic-bert`).
enum Positions<B: Backend> {
    Learned(B::Weight),
    Rope(RopeSpec),
}

struct Layer<B: Backend> {
    qkv: Qkv<B>,
    o: B::Weight,
    o_bias: Option<B::Tensor>,
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
    positions: Positions<B>,
    /// The longest text: the position table's rows, or the trained context with rope.
    n_pos: usize,
    embd_norm: (B::Tensor, B::Tensor),
    layers: Vec<Layer<B>>,
    spec: AttnSpec,
}

/// Loads a `bert` or `nomic-bert` model.
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Bert<B>> {
    let n_embd = hp.embedding_length;
    let n_head = hp.head_count[0];
    if !n_embd.is_multiple_of(n_head) {
        return Err(ModelError::Hparams {
            why: format!("embedding length {n_embd} is not a multiple of {n_head} heads"),
        });
    }
    let head_dim = n_embd / n_head;
    let nomic = hp.arch == "nomic-bert";
    let norm = |name: &str| -> Result<(B::Tensor, B::Tensor)> {
        Ok((ld.vector(&format!("{name}.weight"), &[n_embd])?, ld.vector(&format!("{name}.bias"), &[n_embd])?))
    };
    let (positions, n_pos) = if nomic {
        let md = ld.model.metadata();
        (Positions::Rope(rope_spec(ld, md, &hp, head_dim, hp.rope_freq_base, true)?), hp.context_length)
    } else {
        let n_pos = ld
            .model
            .tensor_opt("position_embd.weight")
            .and_then(|t| t.shape().get(1).copied())
            .ok_or_else(|| ModelError::Hparams { why: "bert: no position_embd.weight".into() })?
            as usize;
        (Positions::Learned(ld.weight("position_embd.weight", &[n_pos, n_embd])?), n_pos)
    };
    let type_embd = if ld.has("token_types.weight") {
        let n_types = ld.model.tensor_opt("token_types.weight").and_then(|t| t.shape().get(1).copied()).unwrap_or(1);
        let table = ld.weight("token_types.weight", &[n_types as usize, n_embd])?;
        Some(ld.b.get_rows(&table, &[0])?)
    } else {
        None
    };
    let mut layers = Vec::with_capacity(hp.block_count);
    for il in 0..hp.block_count {
        let n_ff = hp.feed_forward_length[il];
        let qkv = if ld.has(&blk(il, "attn_qkv.weight")) {
            Qkv::Fused {
                qkv: ld.weight(&blk(il, "attn_qkv.weight"), &[3 * n_embd, n_embd])?,
                bias: ld.vector_opt(&blk(il, "attn_qkv.bias"), &[3 * n_embd])?,
            }
        } else {
            let w = |p: &str| ld.weight(&blk(il, &format!("attn_{p}.weight")), &[n_embd, n_embd]);
            let bias = |p: &str| ld.vector_opt(&blk(il, &format!("attn_{p}.bias")), &[n_embd]);
            let biases = match (bias("q")?, bias("k")?, bias("v")?) {
                (Some(q), Some(k), Some(v)) => Some([q, k, v]),
                _ => None,
            };
            Qkv::Separate { q: w("q")?, k: w("k")?, v: w("v")?, biases }
        };
        // nomic-bert's gated FFN is SwiGLU; BERT's is an ungated exact GELU.
        let glu = if ld.has(&blk(il, "ffn_gate.weight")) { Glu::Plain(Act::Silu) } else { Glu::Plain(Act::Gelu) };
        layers.push(Layer {
            qkv,
            o: ld.weight(&blk(il, "attn_output.weight"), &[n_embd, n_embd])?,
            o_bias: ld.vector_opt(&blk(il, "attn_output.bias"), &[n_embd])?,
            attn_out_norm: norm(&blk(il, "attn_output_norm"))?,
            ffn: Ffn::load(ld, il, "", n_embd, n_ff, glu)?,
            layer_out_norm: norm(&blk(il, "layer_output_norm"))?,
        });
    }
    Ok(Bert {
        tok_embd: ld.weight(TOKEN_EMBD, &[hp.n_vocab, n_embd])?,
        type_embd,
        positions,
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
        Ok(State::new(Vec::new(), n_ctx.min(self.n_pos)))
    }

    fn forward(&self, _b: &B, _state: &mut State<B>, _ids: &[u32], _outputs: Outputs) -> Result<B::Tensor> {
        Err(ModelError::Request {
            why: format!(
                "{} is an encoder (an embedding model): it gives hidden states for embeddings, not logits",
                self.hp.arch
            ),
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
                why: format!("{} takes 1 to {} tokens per text; got {n}", self.hp.arch, self.n_pos),
            });
        }
        let eps = self.hp.rms_eps;
        let n_embd = self.hp.embedding_length;
        let positions: Vec<u32> = (0..n as u32).collect();
        let mut x = b.get_rows(&self.tok_embd, ids)?;
        if let Positions::Learned(table) = &self.positions {
            x = b.add(&x, &b.get_rows(table, &positions)?)?;
        }
        if let Some(t) = &self.type_embd {
            x = b.add(&x, t)?;
        }
        x = b.layer_norm(&x, Some(&self.embd_norm.0), Some(&self.embd_norm.1), eps)?;
        for layer in &self.layers {
            let (mut q, mut k, v) = match &layer.qkv {
                Qkv::Separate { q, k, v, biases } => {
                    let [q, k, v] = b.matmul_many(&x, [q, k, v])?;
                    match biases {
                        Some([qb, kb, vb]) => (b.add(&q, qb)?, b.add(&k, kb)?, b.add(&v, vb)?),
                        None => (q, k, v),
                    }
                }
                Qkv::Fused { qkv, bias } => {
                    let mut t = b.matmul(&x, qkv)?;
                    if let Some(bias) = bias {
                        t = b.add(&t, bias)?;
                    }
                    (
                        b.slice_cols(&t, 0, n_embd)?,
                        b.slice_cols(&t, n_embd, n_embd)?,
                        b.slice_cols(&t, 2 * n_embd, n_embd)?,
                    )
                }
            };
            if let Positions::Rope(spec) = &self.positions {
                q = b.rope(&q, &positions, spec)?;
                k = b.rope(&k, &positions, spec)?;
            }
            let a = b.attention_unmasked(&q, &k, &v, &self.spec)?;
            let mut a = b.matmul(&a, &layer.o)?;
            if let Some(bias) = &layer.o_bias {
                a = b.add(&a, bias)?;
            }
            x = b.layer_norm(&b.add(&x, &a)?, Some(&layer.attn_out_norm.0), Some(&layer.attn_out_norm.1), eps)?;
            let f = layer.ffn.forward(b, &x)?;
            x = b.layer_norm(&b.add(&x, &f)?, Some(&layer.layer_out_norm.0), Some(&layer.layer_out_norm.1), eps)?;
        }
        // The next text starts again at position 0.
        state.n_past = 0;
        Ok(x)
    }
}
