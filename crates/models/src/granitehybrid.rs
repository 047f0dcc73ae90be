//! `granitehybrid`: IBM Granite 4.0 hybrid models (Mamba-2 and attention layers, mixture of
//! experts with a shared expert). Also runs `granitemoe` (see [`crate::granitemoe`]), which is
//! the same block without Mamba layers.
//!
//! Reference: transformers `GraniteMoeHybridForCausalLM` (and `GraniteMoeForCausalLM`).
//! Differences from llama:
//! - Granite multipliers: the embedding is scaled by `embedding_scale`, each block's output by
//!   `residual_scale` before the residual add, the logits divided by `logit_scale`, and the
//!   attention scale is `attention.scale` instead of 1/sqrt(head_dim);
//! - a layer's mixer is attention where `attention.head_count_kv` is non-zero, else a Mamba-2
//!   block ([`Mamba2`]);
//! - hybrid attention layers use no rope unless `rope.scaling.finetuned` is true (llama.cpp's
//!   reading; the converter writes NoPE for every hybrid model, fixtures README note 5);
//!   granitemoe always ropes (adjacent pairs: the converter permutes q and k as for llama);
//! - routing: top-k of the router logits, softmax over the k chosen; plus a shared expert
//!   (`ffn_*_shexp`, `expert_shared_feed_forward_length`) added to the routed output.
//! - Mamba-2 details: A = -exp(A_log) is stored as `ssm_a`; dt = softplus(dt + dt_bias);
//!   transformers also clamps dt to `time_step_limit`, which is (0, inf) in every Granite 4
//!   config (a no-op) and which GGUF does not store, so there is no clamp here.
//!
//! Checked by the `granitemoehybrid` fixture (mamba, mamba, attention, mamba; 8 SSM heads,
//! d_state 16, 1 group) and the `granitemoe` fixture.

use crate::arch::{output_rows, positions, Architecture, Outputs};
use crate::blocks::{Attention, Ffn, FfnOrMoe, Moe};
use crate::error::{ModelError, Result};
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::rope::rope_spec;
use crate::state::{LayerState, State};
use compute::spec::{Act, AttnSpec, Gating, Glu, MoeSpec, RouteSpec};
use compute::{Backend, SsmScan};
use gguf::names::{blk, OUTPUT_NORM, TOKEN_EMBD};

/// Sizes of a Mamba-2 block, from the `ssm.*` metadata keys.
#[derive(Clone, Copy, Debug)]
pub struct SsmDims {
    /// `ssm.inner_size`: width of x, z and y.
    pub d_inner: usize,
    /// `ssm.state_size`: state values per x value.
    pub d_state: usize,
    /// `ssm.group_count`: groups sharing B and C.
    pub n_group: usize,
    /// `ssm.time_step_rank`: SSM heads (one dt, A, D per head).
    pub n_head: usize,
    /// `ssm.conv_kernel`: conv taps.
    pub d_conv: usize,
}

impl SsmDims {
    /// Reads the `ssm.*` keys and checks that they divide as Mamba-2 needs.
    ///
    /// # Errors
    /// A missing key, or sizes that do not divide.
    pub fn read(md: &gguf::Metadata, hp: &Hparams) -> Result<SsmDims> {
        let get = |tail: &str| -> Result<usize> { Ok(md.u32(&hp.key(tail))? as usize) };
        let dims = SsmDims {
            d_inner: get("ssm.inner_size")?,
            d_state: get("ssm.state_size")?,
            n_group: get("ssm.group_count")?,
            n_head: get("ssm.time_step_rank")?,
            d_conv: get("ssm.conv_kernel")?,
        };
        // `n / d * d == n`: divisibility without `%` (clippy wants `is_multiple_of`, newer than
        // the workspace's rust-version).
        let divides = |d: usize, n: usize| d != 0 && n / d * d == n;
        if !divides(dims.n_head, dims.d_inner) || !divides(dims.n_group, dims.n_head) || dims.d_conv < 2 {
            return Err(ModelError::Hparams { why: format!("mamba-2 sizes do not fit together: {dims:?}") });
        }
        Ok(dims)
    }

    /// Channels of the conv: x, B and C.
    pub fn conv_dim(&self) -> usize {
        self.d_inner + 2 * self.n_group * self.d_state
    }
}

/// A Mamba-2 mixer (transformers `GraniteMoeHybridMambaLayer`): `in_proj` gives z, xBC and dt;
/// xBC goes through a causal conv (+ bias, SiLU); the selective scan maps x with B, C, dt to y;
/// `y · silu(z)` is RMS-normed per group, weighted, and projected back by `out_proj`.
pub struct Mamba2<B: Backend> {
    in_proj: B::Weight,
    conv: B::Tensor,
    conv_bias: Option<B::Tensor>,
    dt_bias: B::Tensor,
    a: B::Tensor,
    d: B::Tensor,
    norm: B::Tensor,
    out_proj: B::Weight,
    dims: SsmDims,
    eps: f32,
}

impl<B: Backend> Mamba2<B> {
    /// Loads `blk.{il}.ssm_{in,conv1d,dt,a,d,norm,out}`. `ssm_a` holds A = -exp(A_log) (the
    /// converter's rewrite), stored `[n_head, 1]` like `ssm_d`; `ssm_norm` is `[n_group,
    /// d_inner / n_group]`.
    pub fn load(ld: &Loader<'_, B>, il: usize, n_embd: usize, dims: SsmDims, eps: f32) -> Result<Mamba2<B>> {
        let b = ld.b;
        let d_in_proj = 2 * dims.d_inner + 2 * dims.n_group * dims.d_state + dims.n_head;
        let per_head = |name: &str| -> Result<B::Tensor> {
            let t = ld.vector(&blk(il, name), &[dims.n_head, 1])?;
            Ok(b.reshape(t, &[dims.n_head])?)
        };
        let norm = ld.vector(&blk(il, "ssm_norm.weight"), &[dims.n_group, dims.d_inner / dims.n_group])?;
        Ok(Mamba2 {
            in_proj: ld.weight(&blk(il, "ssm_in.weight"), &[d_in_proj, n_embd])?,
            conv: ld.vector(&blk(il, "ssm_conv1d.weight"), &[dims.conv_dim(), dims.d_conv])?,
            conv_bias: ld.vector_opt(&blk(il, "ssm_conv1d.bias"), &[dims.conv_dim()])?,
            dt_bias: ld.vector(&blk(il, "ssm_dt.bias"), &[dims.n_head])?,
            a: per_head("ssm_a")?,
            d: per_head("ssm_d")?,
            norm: b.reshape(norm, &[dims.d_inner])?,
            out_proj: ld.weight(&blk(il, "ssm_out.weight"), &[n_embd, dims.d_inner])?,
            dims,
            eps,
        })
    }

    /// Zero states: the conv window `[d_conv - 1, conv_dim]` and the SSM state
    /// `[n_head, head_dim, d_state]`.
    pub fn new_state(&self, b: &B) -> Result<Vec<B::Tensor>> {
        let d = self.dims;
        let zeros = |shape: &[usize]| b.from_host(&vec![0.0; shape.iter().product()], shape);
        Ok(vec![zeros(&[d.d_conv - 1, d.conv_dim()])?, zeros(&[d.n_head, d.d_inner / d.n_head, d.d_state])?])
    }

    /// The mixer's output for `x` (`[n, n_embd]`), advancing the conv window and SSM state.
    pub fn forward(
        &self,
        b: &B,
        x: &B::Tensor,
        conv_state: &mut B::Tensor,
        ssm_state: &mut B::Tensor,
    ) -> Result<B::Tensor> {
        let d = self.dims;
        let n = b.shape(x)[0];
        let (conv_dim, bc_width) = (d.conv_dim(), d.n_group * d.d_state);
        let zxbcdt = b.matmul(x, &self.in_proj)?; // [n, d_inner + conv_dim + n_head]
        let z = b.slice_cols(&zxbcdt, 0, d.d_inner)?;
        let xbc = b.slice_cols(&zxbcdt, d.d_inner, conv_dim)?;
        let dt = b.slice_cols(&zxbcdt, d.d_inner + conv_dim, d.n_head)?; // [n, n_head]
        let mut xbc = b.ssm_conv(&xbc, conv_state, &self.conv)?; // [n, conv_dim]
        if let Some(bias) = &self.conv_bias {
            xbc = b.add(&xbc, bias)?;
        }
        let xbc = b.act(&xbc, Act::Silu)?;
        let xs = b.slice_cols(&xbc, 0, d.d_inner)?;
        let bm = b.slice_cols(&xbc, d.d_inner, bc_width)?;
        let cm = b.slice_cols(&xbc, d.d_inner + bc_width, bc_width)?;
        let scan = SsmScan {
            x: &xs,
            dt: &dt,
            b: &bm,
            c: &cm,
            a: &self.a,
            d: Some(&self.d),
            dt_bias: Some(&self.dt_bias),
            n_group: d.n_group,
        };
        let y = b.ssm_scan(&scan, ssm_state)?; // [n, d_inner]
                                               // Gated RMS norm (GraniteMoeHybridRMSNormGated, gate applied before the norm), per group.
        let y = b.mul(&y, &b.act(&z, Act::Silu)?)?;
        let group = d.d_inner / d.n_group;
        let y = b.reshape(y, &[n * d.n_group, group])?;
        let y = b.rms_norm(&y, None, self.eps)?;
        let y = b.reshape(y, &[n, d.d_inner])?;
        let y = b.mul(&y, &self.norm)?;
        Ok(b.matmul(&y, &self.out_proj)?) // [n, n_embd]
    }
}

enum Mixer<B: Backend> {
    Attention(Attention<B>),
    Mamba(Mamba2<B>),
}

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    mixer: Mixer<B>,
    ffn_norm: B::Tensor,
    ffn: FfnOrMoe<B>,
}

/// A loaded Granite MoE or Granite hybrid model.
pub struct Granite<B: Backend> {
    hp: Hparams,
    tok_embd: B::Weight,
    layers: Vec<Layer<B>>,
    output_norm: B::Tensor,
    output: B::Weight,
    embedding_scale: f32,
    residual_scale: f32,
    logit_scale: f32,
}

/// A Granite multiplier key, 1 when absent or zero (llama.cpp treats 0 as "not set").
fn multiplier(md: &gguf::Metadata, hp: &Hparams, tail: &str) -> Result<f32> {
    Ok(md.f32_opt(&hp.key(tail))?.filter(|v| *v != 0.0).unwrap_or(1.0))
}

/// Whether attention layers rope: granitemoe always; granitehybrid only with
/// `rope.scaling.finetuned` true.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnPositions {
    /// Rope on every attention layer.
    Rope,
    /// No rope unless `rope.scaling.finetuned` is true.
    NopeUnlessFinetuned,
}

/// Loads a granitehybrid model.
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<Granite<B>> {
    load_granite(ld, hp, AttnPositions::NopeUnlessFinetuned)
}

/// Loads a Granite MoE or hybrid model.
pub fn load_granite<B: Backend>(ld: &Loader<'_, B>, hp: Hparams, positions: AttnPositions) -> Result<Granite<B>> {
    let md = ld.model.metadata();
    let n_embd = hp.embedding_length;
    let hd = hp.key_length;
    let use_rope = match positions {
        AttnPositions::Rope => true,
        AttnPositions::NopeUnlessFinetuned => md.bool_opt(&hp.key("rope.scaling.finetuned"))?.unwrap_or(false),
    };
    let rope = if use_rope { Some(rope_spec(ld, md, &hp, hd, hp.rope_freq_base, false)?) } else { None };
    let attn_scale = md.f32_opt(&hp.key("attention.scale"))?.filter(|s| *s != 0.0).unwrap_or(1.0 / (hd as f32).sqrt());
    let n_ff_shared = md.u32_opt(&hp.key("expert_shared_feed_forward_length"))?.map(|n| n as usize).filter(|&n| n > 0);
    let n_ff_expert = md.u32_opt(&hp.key("expert_feed_forward_length"))?.map(|n| n as usize);
    let has_mamba = hp.head_count_kv.contains(&0);
    let ssm = if has_mamba { Some(SsmDims::read(md, &hp)?) } else { None };
    let mut layers = Vec::with_capacity(hp.block_count);
    for il in 0..hp.block_count {
        let mixer = match ssm {
            Some(dims) if hp.head_count_kv[il] == 0 => Mixer::Mamba(Mamba2::load(ld, il, n_embd, dims, hp.rms_eps)?),
            _ => {
                let spec = AttnSpec {
                    n_head: hp.head_count[il],
                    n_head_kv: hp.head_count_kv[il],
                    head_dim_k: hd,
                    head_dim_v: hp.value_length,
                    scale: attn_scale,
                    window: None,
                    softcap: None,
                };
                Mixer::Attention(Attention::load(ld, il, n_embd, spec, rope.clone(), hp.rms_eps)?)
            }
        };
        let ffn = if ld.has(&blk(il, "ffn_gate_inp.weight")) {
            FfnOrMoe::Moe(Moe::load(
                ld,
                il,
                n_embd,
                MoeSpec {
                    n_expert: hp.expert_count,
                    n_ff: n_ff_expert.unwrap_or(hp.feed_forward_length[il]),
                    glu: Glu::Plain(Act::Silu),
                },
                RouteSpec {
                    k: hp.expert_used_count,
                    gating: Gating::SoftmaxAfterTopK,
                    has_selection_bias: false,
                    groups: None,
                    normalize: false,
                    scale: 1.0,
                },
                n_ff_shared,
            )?)
        } else {
            FfnOrMoe::Dense(Ffn::load(ld, il, "", n_embd, hp.feed_forward_length[il], Glu::Plain(Act::Silu))?)
        };
        layers.push(Layer {
            attn_norm: ld.vector(&blk(il, "attn_norm.weight"), &[n_embd])?,
            mixer,
            ffn_norm: ld.vector(&blk(il, "ffn_norm.weight"), &[n_embd])?,
            ffn,
        });
    }
    let n_vocab = hp.n_vocab;
    let output = ld.output_or_tied(n_vocab, n_embd)?;
    Ok(Granite {
        tok_embd: ld.weight(TOKEN_EMBD, &[n_vocab, n_embd])?,
        output_norm: ld.vector(OUTPUT_NORM, &[n_embd])?,
        output,
        layers,
        embedding_scale: multiplier(md, &hp, "embedding_scale")?,
        residual_scale: multiplier(md, &hp, "residual_scale")?,
        logit_scale: multiplier(md, &hp, "logit_scale")?,
        hp,
    })
}

impl<B: Backend> Architecture<B> for Granite<B> {
    fn hparams(&self) -> &Hparams {
        &self.hp
    }

    fn new_state(&self, b: &B, n_ctx: usize) -> Result<State<B>> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(a) => LayerState::kv_cache(b, n_ctx, a.cache_widths()),
                Mixer::Mamba(m) => Ok(LayerState::Recurrent(m.new_state(b)?)),
            })
            .collect::<Result<_>>()?;
        Ok(State::new(layers, n_ctx))
    }

    fn forward(&self, b: &B, state: &mut State<B>, ids: &[u32], outputs: Outputs) -> Result<B::Tensor> {
        let n = ids.len();
        let pos = positions(state.n_past, n);
        let eps = self.hp.rms_eps;
        let mut x = b.get_rows(&self.tok_embd, ids)?; // [n, n_embd]
        x = b.scale(&x, self.embedding_scale)?;
        for (il, (layer, st)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            let h = b.rms_norm(&x, Some(&layer.attn_norm), eps)?;
            let m = match (&layer.mixer, st) {
                (Mixer::Attention(a), LayerState::Attention(cache)) => a.forward(b, &h, cache, state.n_past, &pos)?,
                (Mixer::Mamba(mamba), LayerState::Recurrent(ts)) if ts.len() == 2 => {
                    let (conv, ssm) = ts.split_at_mut(1);
                    mamba.forward(b, &h, &mut conv[0], &mut ssm[0])?
                }
                _ => {
                    return Err(ModelError::Request {
                        why: format!("layer {il}: sequence state does not match the layer kind"),
                    })
                }
            };
            x = b.add(&x, &b.scale(&m, self.residual_scale)?)?;
            let h = b.rms_norm(&x, Some(&layer.ffn_norm), eps)?;
            let f = layer.ffn.forward(b, &h)?;
            x = b.add(&x, &b.scale(&f, self.residual_scale)?)?;
        }
        state.n_past += n;
        let x = output_rows(b, &x, n, outputs)?;
        let x = b.rms_norm(&x, Some(&self.output_norm), eps)?;
        let logits = b.matmul(&x, &self.output)?; // [rows, n_vocab]
        Ok(b.scale(&logits, 1.0 / self.logit_scale)?)
    }
}
