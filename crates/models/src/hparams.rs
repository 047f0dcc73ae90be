//! Hyper-parameters from `{arch}.*` metadata keys, named after the key's tail.

use crate::error::{ModelError, Result};
use gguf::GgufModel;

/// Hyper-parameters shared by the transformer architectures. Per-architecture extras are read by
/// the architecture's own file with [`Hparams::key`].
#[derive(Clone, Debug)]
pub struct Hparams {
    /// `general.architecture`.
    pub arch: String,
    /// `block_count`.
    pub block_count: usize,
    /// `embedding_length`.
    pub embedding_length: usize,
    /// `feed_forward_length`, per layer (0 where a layer has none).
    pub feed_forward_length: Vec<usize>,
    /// `attention.head_count`, per layer.
    pub head_count: Vec<usize>,
    /// `attention.head_count_kv`, per layer (0 for layers without attention).
    pub head_count_kv: Vec<usize>,
    /// `attention.key_length` (defaults to embedding / heads).
    pub key_length: usize,
    /// `attention.value_length` (defaults to key_length).
    pub value_length: usize,
    /// `attention.layer_norm_rms_epsilon` (or `layer_norm_epsilon`).
    pub rms_eps: f32,
    /// `rope.freq_base` (10000 when absent).
    pub rope_freq_base: f32,
    /// `rope.dimension_count` (defaults to key_length).
    pub rope_dimension_count: usize,
    /// `context_length`.
    pub context_length: usize,
    /// `expert_count` (0 for dense models).
    pub expert_count: usize,
    /// `expert_used_count`.
    pub expert_used_count: usize,
    /// Rows of the embedding table.
    pub n_vocab: usize,
}

impl Hparams {
    /// Reads the common keys of `model`'s architecture.
    ///
    /// # Errors
    /// A missing required key (`block_count`, `embedding_length`, `attention.head_count`) or a
    /// key of the wrong type, naming it.
    pub fn read(model: &GgufModel) -> Result<Hparams> {
        let md = model.metadata();
        let arch = model.architecture()?.to_string();
        let k = |tail: &str| format!("{arch}.{tail}");
        let in_file = |e: gguf::GgufError| ModelError::Gguf(e.in_file(model.path()));
        let block_count = md.u32(&k("block_count")).map_err(in_file)? as usize;
        let embedding_length = md.u32(&k("embedding_length")).map_err(in_file)? as usize;
        let per_layer = |tail: &str, default: Option<u32>| -> Result<Vec<usize>> {
            match md.u32_per_layer_opt(&k(tail), block_count).map_err(in_file)? {
                Some(v) => Ok(v.into_iter().map(|x| x as usize).collect()),
                None => match default {
                    Some(d) => Ok(vec![d as usize; block_count]),
                    None => Err(ModelError::Gguf(gguf::GgufError::MissingKey { key: k(tail) }.in_file(model.path()))),
                },
            }
        };
        let head_count = per_layer("attention.head_count", None)?;
        let head_count_kv = per_layer("attention.head_count_kv", Some(head_count[0] as u32))?;
        let feed_forward_length = per_layer("feed_forward_length", Some(0))?;
        let max_heads = head_count.iter().copied().max().unwrap_or(0);
        if max_heads == 0 {
            return Err(ModelError::Hparams { why: format!("{} is zero", k("attention.head_count")) });
        }
        let key_length = md
            .u32_opt(&k("attention.key_length"))
            .map_err(in_file)?
            .map(|x| x as usize)
            .unwrap_or(embedding_length / max_heads);
        let value_length =
            md.u32_opt(&k("attention.value_length")).map_err(in_file)?.map(|x| x as usize).unwrap_or(key_length);
        let rms_eps = match md.f32_opt(&k("attention.layer_norm_rms_epsilon")).map_err(in_file)? {
            Some(e) => e,
            None => md.f32_opt(&k("attention.layer_norm_epsilon")).map_err(in_file)?.unwrap_or(1e-5),
        };
        let n_vocab = match model.tensor_opt(gguf::names::TOKEN_EMBD) {
            Some(t) => t.shape().get(1).copied().unwrap_or(0) as usize,
            None => md.u32_opt(&k("vocab_size")).map_err(in_file)?.unwrap_or(0) as usize,
        };
        Ok(Hparams {
            block_count,
            embedding_length,
            feed_forward_length,
            head_count,
            head_count_kv,
            key_length,
            value_length,
            rms_eps,
            rope_freq_base: md.f32_opt(&k("rope.freq_base")).map_err(in_file)?.unwrap_or(10000.0),
            rope_dimension_count: md
                .u32_opt(&k("rope.dimension_count"))
                .map_err(in_file)?
                .map(|x| x as usize)
                .unwrap_or(key_length),
            context_length: md.u32_opt(&k("context_length")).map_err(in_file)?.unwrap_or(2048) as usize,
            expert_count: md.u32_opt(&k("expert_count")).map_err(in_file)?.unwrap_or(0) as usize,
            expert_used_count: md.u32_opt(&k("expert_used_count")).map_err(in_file)?.unwrap_or(0) as usize,
            n_vocab,
            arch,
        })
    }

    /// The metadata key `{arch}.{tail}`.
    pub fn key(&self, tail: &str) -> String {
        format!("{}.{tail}", self.arch)
    }
}
