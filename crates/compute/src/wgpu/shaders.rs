//! WGSL sources: one file per op under `shaders/`, quant variants generated from one template by
//! string substitution (`{{QUANT}}` receives a weight type's `dq8`, `{{REDUCE}}` the subgroup or
//! shared-memory reduction).

use super::layout::TypeLayout;

const QUANT_COMMON: &str = include_str!("shaders/quant/common.wgsl");
const MATMUL: &str = include_str!("shaders/matmul.wgsl");
const GET_ROWS: &str = include_str!("shaders/get_rows.wgsl");
const REDUCE_SHARED: &str = include_str!("shaders/reduce_shared.wgsl");
const REDUCE_SUBGROUP: &str = include_str!("shaders/reduce_subgroup.wgsl");
const ACT: &str = include_str!("shaders/act.wgsl");

/// A kernel without template parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Plain {
    /// add / mul with row broadcast.
    Binary,
    /// scale and activations.
    Unary,
    /// gated activations.
    Glu,
    /// RMS and layer norm.
    Norm,
    /// Rotary embedding.
    Rope,
    /// Column slice / concatenation.
    CopyCols,
    /// Flash attention over the KV cache.
    Attention,
    /// Row argmax.
    Argmax,
    /// Row gather (MoE token batch).
    GatherRows,
    /// Weighted scatter-add (MoE combine).
    ScatterAdd,
    /// Streaming-read bandwidth baseline.
    Stream,
}

impl Plain {
    /// Every plain kernel (for the parse test).
    #[cfg(test)]
    pub const ALL: [Plain; 11] = [
        Plain::Binary,
        Plain::Unary,
        Plain::Glu,
        Plain::Norm,
        Plain::Rope,
        Plain::CopyCols,
        Plain::Attention,
        Plain::Argmax,
        Plain::GatherRows,
        Plain::ScatterAdd,
        Plain::Stream,
    ];

    /// The WGSL source.
    pub fn source(self) -> String {
        let s = match self {
            Plain::Binary => include_str!("shaders/binary.wgsl"),
            Plain::Unary => include_str!("shaders/unary.wgsl"),
            Plain::Glu => include_str!("shaders/glu.wgsl"),
            Plain::Norm => include_str!("shaders/norm.wgsl"),
            Plain::Rope => include_str!("shaders/rope.wgsl"),
            Plain::CopyCols => include_str!("shaders/copy_cols.wgsl"),
            Plain::Attention => include_str!("shaders/attention.wgsl"),
            Plain::Argmax => include_str!("shaders/argmax.wgsl"),
            Plain::GatherRows => include_str!("shaders/gather_rows.wgsl"),
            Plain::ScatterAdd => include_str!("shaders/scatter_add.wgsl"),
            Plain::Stream => include_str!("shaders/stream.wgsl"),
        };
        s.replace("{{ACT}}", ACT)
    }
}

/// Tokens per workgroup of the matrix product: 1 for decode (a pure matrix-vector product),
/// 8 for prefill (each dequantized weight group is reused for 8 tokens).
pub const MATMUL_TILES: [u32; 2] = [1, 8];

fn quant(layout: &TypeLayout) -> String {
    format!("{QUANT_COMMON}\n{}", layout.shader)
}

/// The matrix product for one weight type. `guard_x` bounds-checks activation reads (rows whose
/// length is not a multiple of 8); `subgroups` uses subgroup reductions.
pub fn matmul(layout: &TypeLayout, tok: u32, guard_x: bool, subgroups: bool) -> String {
    let guard =
        if guard_x { "    if (c < P.k) {\n        return X[i];\n    }\n    return 0.0;" } else { "    return X[i];" };
    // Naga takes subgroup builtins without `enable subgroups;` (which it rejects as not yet
    // implemented); the device's SUBGROUP feature is what allows them.
    let (reduce, sg_args, sg_call) = if subgroups {
        (
            REDUCE_SUBGROUP,
            "@builtin(subgroup_id) sg_id: u32,\n    @builtin(subgroup_invocation_id) sg_lane: u32,\n    @builtin(num_subgroups) n_sg: u32,",
            ", sg_id, sg_lane, n_sg",
        )
    } else {
        (REDUCE_SHARED, "", "")
    };
    MATMUL
        .replace("{{QUANT}}", &quant(layout))
        .replace("{{TOK}}", &tok.to_string())
        .replace("{{X_GUARD}}", guard)
        .replace("{{REDUCE}}", reduce)
        .replace("{{SG_ARGS}}", sg_args)
        .replace("{{SG_CALL}}", sg_call)
}

/// Row lookup (embeddings) for one weight type.
pub fn get_rows(layout: &TypeLayout) -> String {
    GET_ROWS.replace("{{QUANT}}", &quant(layout))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf::GgmlType;

    fn parse(name: &str, src: &str) {
        let module = naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(src)));
        let mut v = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all());
        v.validate(&module).unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(src)));
    }

    #[test]
    fn every_shader_parses_and_validates() {
        for p in Plain::ALL {
            parse(&format!("{p:?}"), &p.source());
        }
        use GgmlType::*;
        for t in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4] {
            let l = TypeLayout::of(t).unwrap();
            for tok in MATMUL_TILES {
                for guard in [false, true] {
                    for sg in [false, true] {
                        parse(
                            &format!("matmul {} tok {tok} guard {guard} subgroups {sg}", l.name),
                            &matmul(&l, tok, guard, sg),
                        );
                    }
                }
            }
            parse(&format!("get_rows {}", l.name), &get_rows(&l));
        }
    }

    #[test]
    fn shader_block_constants_match_layouts() {
        use GgmlType::*;
        for t in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4] {
            let l = TypeLayout::of(t).unwrap();
            let words = if l.is_float() { l.block_bytes().div_ceil(4) } else { l.block_words() };
            assert!(l.shader.contains(&format!("const BW: u32 = {words}u;")), "{}: BW should be {words}", l.name);
            assert!(
                l.shader.contains(&format!("const BV: u32 = {}u;", l.block_values)),
                "{}: BV should be {}",
                l.name,
                l.block_values
            );
        }
    }
}
