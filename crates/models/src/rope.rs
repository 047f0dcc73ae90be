//! The rope variant a model's metadata describes.

use crate::error::Result;
use crate::hparams::Hparams;
use crate::loader::Loader;
use compute::spec::{RopeSpec, Yarn};
use compute::Backend;
use gguf::Metadata;

/// Rope of `hp.rope_dimension_count` dims of `head_dim`-wide heads with `base`, plus what the
/// metadata says about scaling: `rope.scaling.type` linear (positions divided by the factor) or
/// yarn, and `rope_freqs.weight` frequency factors (llama 3).
pub fn rope_spec<B: Backend>(
    ld: &Loader<'_, B>,
    md: &Metadata,
    hp: &Hparams,
    head_dim: usize,
    base: f32,
    neox: bool,
) -> Result<RopeSpec> {
    let mut spec = RopeSpec::new(head_dim, base, neox);
    spec.n_rot = hp.rope_dimension_count.min(head_dim);
    let kind = md.str_opt(&hp.key("rope.scaling.type"))?.unwrap_or("none");
    let factor = md.f32_opt(&hp.key("rope.scaling.factor"))?.filter(|f| *f > 0.0);
    match (kind, factor) {
        ("linear", Some(f)) => spec.position_scale = 1.0 / f,
        ("yarn", Some(f)) => {
            let original_context =
                md.u32_opt(&hp.key("rope.scaling.original_context_length"))?.unwrap_or(hp.context_length as u32);
            let attn_factor = match md.f32_opt(&hp.key("rope.scaling.attn_factor"))? {
                Some(a) => a,
                None => 0.1 * f.ln() + 1.0,
            };
            spec.yarn = Some(Yarn {
                factor: f,
                original_context,
                beta_fast: md.f32_opt(&hp.key("rope.scaling.yarn_beta_fast"))?.unwrap_or(32.0),
                beta_slow: md.f32_opt(&hp.key("rope.scaling.yarn_beta_slow"))?.unwrap_or(1.0),
                truncate: true,
                attn_factor,
            });
        }
        _ => {}
    }
    if let Some(ff) = ld.host_opt(gguf::names::ROPE_FREQS) {
        let v = ff.to_f32().map_err(|e| compute::OpError::Weight { name: ff.name.clone(), why: e.to_string() })?;
        spec.freq_factors = Some(v);
    }
    Ok(spec)
}
