//! `glm4moe`: GLM-4.5 / GLM-4.6 mixture of experts.
//!
//! Reference: transformers `Glm4MoeForCausalLM`; llama.cpp `src/models/glm4-moe.cpp` at
//! 0c1e570. The llama-layout MoE decoder of [`crate::qwen3moe`] with:
//! - partial rotary: rotate-half rope over the first `rope.dimension_count` dims of each head
//!   (half of them in the released models), the rest passed through;
//! - q, k and v biases, and per-head q/k RMS norms (when `attn_{q,k}_norm` are present);
//! - the pre-FFN norm stored as `post_attention_norm` (transformers' post_attention_layernorm);
//! - the first `leading_dense_block_count` layers dense, the others routed experts plus a shared
//!   expert of `expert_shared_count` experts' width;
//! - DeepSeek-V3 routing from the `expert_*` keys ([`crate::deepseek2::route_spec`]): sigmoid
//!   scores, `exp_probs_b` shifting only the choice, weights renormalised, times
//!   `expert_weights_scale` (2.5);
//! - the last `nextn_predict_layers` blocks of a file are next-token-prediction (MTP) layers
//!   for speculative decoding; like llama.cpp we do not run them.
//!
//! Checked by the `glm4_moe` fixture (partial rotary 0.5, one dense layer, scale 2.5).

use crate::deepseek2::route_spec;
use crate::error::{ModelError, Result};
use crate::hparams::Hparams;
use crate::loader::Loader;
use crate::qwen3moe::{DecoderSpec, MoeDecoder};
use compute::spec::Gating;
use compute::Backend;
use gguf::names::blk;

/// Loads a GLM-4-MoE model.
///
/// # Errors
/// More next-token-prediction layers than blocks, a missing `expert_feed_forward_length`, and
/// as [`MoeDecoder::load`].
pub fn load<B: Backend>(ld: &Loader<'_, B>, hp: Hparams) -> Result<MoeDecoder<B>> {
    let md = ld.model.metadata();
    let nextn = md.u32_opt(&hp.key("nextn_predict_layers"))?.unwrap_or(0) as usize;
    let n_layer = hp.block_count.checked_sub(nextn).ok_or_else(|| ModelError::Hparams {
        why: format!("{} next-token-prediction layers in a model of {} blocks", nextn, hp.block_count),
    })?;
    let n_ff_exp = md.u32(&hp.key("expert_feed_forward_length"))? as usize;
    let n_shared = md.u32_opt(&hp.key("expert_shared_count"))?.unwrap_or(0) as usize;
    let has_bias = (0..n_layer).any(|il| ld.has(&blk(il, "exp_probs_b.bias")));
    let spec = DecoderSpec {
        neox: true,
        ffn_norm: "post_attention_norm",
        leading_dense: md.u32_opt(&hp.key("leading_dense_block_count"))?.unwrap_or(0) as usize,
        n_ff_exp,
        n_ff_shared: (n_shared > 0).then_some(n_ff_exp * n_shared),
        route: route_spec(md, &hp, Gating::Sigmoid, has_bias)?,
        n_layer,
    };
    MoeDecoder::load(ld, hp, &spec)
}

#[cfg(test)]
mod tests {
    //! GLM-4.5 files end with next-token-prediction blocks that inference must skip. The
    //! `glm4_moe` fixture has none, so this test appends one (a copy of the last block plus an
    //! `nextn.eh_proj`, `block_count` + 1, `nextn_predict_layers` 1): the logits must stay the
    //! transformers logits of the fixture.

    use crate::deepseek2::tests::{fixture_dir, ids, read_json, rewrite, rows, TensorData};
    use crate::refcheck::{compare, F32_MAX_ABS, F32_REL_L2};
    use crate::{load, LoadOptions, Outputs};
    use gguf::{GgmlType, GgufModel, Value};

    #[test]
    fn next_token_prediction_layers_are_skipped() {
        let Some(dir) = fixture_dir("glm4_moe") else { return };
        let src = GgufModel::open(dir.join("model-f32.gguf")).unwrap();
        let n_block = src.metadata().u32("glm4moe.block_count").unwrap() as usize;
        let n_embd = src.metadata().u32("glm4moe.embedding_length").unwrap() as u64;
        let last = format!("blk.{}.", n_block - 1);
        let extra = format!("blk.{n_block}.");
        let mut tensors: Vec<TensorData> =
            src.tensors().map(|t| (t.info.name.clone(), t.info.dtype, t.info.shape.clone(), t.data.to_vec())).collect();
        let copies: Vec<TensorData> = tensors
            .iter()
            .filter(|t| t.0.starts_with(&last))
            .map(|(name, dtype, shape, bytes)| (name.replacen(&last, &extra, 1), *dtype, shape.clone(), bytes.clone()))
            .collect();
        tensors.extend(copies);
        let eh_proj: Vec<u8> = (0..2 * n_embd * n_embd).flat_map(|i| ((i % 7) as f32 * 0.01).to_le_bytes()).collect();
        tensors.push((format!("{extra}nextn.eh_proj.weight"), GgmlType::F32, vec![2 * n_embd, n_embd], eh_proj));
        let keys = [
            ("glm4moe.block_count".to_string(), Value::U32(n_block as u32 + 1)),
            ("glm4moe.nextn_predict_layers".to_string(), Value::U32(1)),
        ];
        let with_mtp = rewrite(&src, |_| false, &keys, &tensors, "glm4moe-nextn");

        let reference = read_json(&dir.join("ref.json"));
        let mut runner = load(&with_mtp, &LoadOptions::default()).unwrap();
        let logits = runner.eval(&ids(&reference["prompt"]["ids"]), Outputs::All).unwrap();
        let (max_abs, rel) = compare(&logits, &rows(&reference["hf"]["logits"]));
        println!("glm4_moe with one nextn block vs transformers: max_abs {max_abs:.1e} rel_l2 {rel:.1e}");
        assert!(max_abs <= F32_MAX_ABS && rel <= F32_REL_L2, "max_abs {max_abs} rel_l2 {rel}");
    }
}
