//! WGSL sources: one file per op under `shaders/`, quant variants generated from one template by
//! string substitution (`{{QUANT}}` receives a weight type's `dq8`, `{{REDUCE}}` the subgroup or
//! shared-memory reduction).

use super::layout::TypeLayout;
use gguf::GgmlType;

const QUANT_COMMON: &str = include_str!("shaders/quant/common.wgsl");
const MATMUL: &str = include_str!("shaders/matmul.wgsl");
const MATVEC: &str = include_str!("shaders/matvec.wgsl");
const MATVEC_Q8: &str = include_str!("shaders/matvec_q8.wgsl");
const MATMUL_TILED: &str = include_str!("shaders/matmul_tiled.wgsl");
const MATMUL_PARAMS: &str = include_str!("shaders/matmul_params.wgsl");
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
    /// Depthwise causal convolution (recurrent layers).
    SsmConv,
    /// Mamba-2 selective scan.
    SsmScan,
    /// Activations to int8 blocks of 32 for the int8 decode kernel.
    QuantizeQ8,
}

impl Plain {
    /// Every plain kernel (for the parse test).
    #[cfg(test)]
    pub const ALL: [Plain; 14] = [
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
        Plain::SsmConv,
        Plain::SsmScan,
        Plain::QuantizeQ8,
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
            Plain::SsmConv => include_str!("shaders/ssm_conv.wgsl"),
            Plain::SsmScan => include_str!("shaders/ssm_scan.wgsl"),
            Plain::QuantizeQ8 => include_str!("shaders/quantize_q8.wgsl"),
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

const UNROLL4: &str = "    for (; g + 3u * WG < n_groups; g += 4u * WG) {
        let v0 = dq8(rb + (g / gpb) * BW, g % gpb);
        let g1 = g + WG;
        let v1 = dq8(rb + (g1 / gpb) * BW, g1 % gpb);
        let g2 = g + 2u * WG;
        let v2 = dq8(rb + (g2 / gpb) * BW, g2 % gpb);
        let g3 = g + 3u * WG;
        let v3 = dq8(rb + (g3 / gpb) * BW, g3 % gpb);
        for (var t = 0u; t < TOK; t++) {
            if (t0 + t < P.n_tok) {
                let xb = (t0 + t) * P.x_stride + P.x_col0;
                acc[t] += x8dot(v0, xb + g * 8u, g * 8u) + x8dot(v1, xb + g1 * 8u, g1 * 8u)
                    + x8dot(v2, xb + g2 * 8u, g2 * 8u) + x8dot(v3, xb + g3 * 8u, g3 * 8u);
            }
        }
    }";

/// The matrix product for one weight type. `guard_x` bounds-checks activation reads (rows whose
/// length is not a multiple of 8); `subgroups` uses subgroup reductions; `unroll` loads four
/// groups per loop iteration.
pub fn matmul(layout: &TypeLayout, tok: u32, guard_x: bool, subgroups: bool, unroll: bool) -> String {
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
        .replace("{{PARAMS}}", MATMUL_PARAMS)
        .replace("{{QUANT}}", &quant(layout))
        .replace("{{TOK}}", &tok.to_string())
        .replace("{{X_GUARD}}", guard)
        .replace("{{REDUCE}}", reduce)
        .replace("{{SG_ARGS}}", sg_args)
        .replace("{{SG_CALL}}", sg_call)
        .replace("{{UNROLL}}", if unroll { UNROLL4 } else { "" })
}

/// Tokens from which prefill takes the tiled kernel (`matmul_tiled`): below it the 8-token
/// kernel wastes less of a 64-token tile.
pub const TILED_MIN_TOKENS: usize = 9;
/// Weight rows per workgroup of `matmul_tiled`.
pub const TILE_ROWS: usize = 64;
/// Tokens per workgroup of `matmul_tiled`.
pub const TILE_TOKENS: usize = 64;

/// The tiled prefill product for one weight type (`TILE_ROWS` rows x `TILE_TOKENS` tokens per
/// workgroup); `guard_x` bounds-checks activation reads (rows whose length is not a multiple
/// of 8).
pub fn matmul_tiled(layout: &TypeLayout, guard_x: bool) -> String {
    let guard =
        if guard_x { "    if (c < P.k) {\n        return X[i];\n    }\n    return 0.0;" } else { "    return X[i];" };
    MATMUL_TILED.replace("{{PARAMS}}", MATMUL_PARAMS).replace("{{QUANT}}", &quant(layout)).replace("{{X_GUARD}}", guard)
}

/// Rows and invocations of one workgroup of the decode matrix-vector product (`matvec`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatvecShape {
    /// Weight rows per workgroup (the activations are loaded once for all of them).
    pub rows: u32,
    /// Invocations per workgroup (a power of two, at most 256).
    pub wg: u32,
}

impl MatvecShape {
    /// The shapes `matvec` is compiled for in tests (every one must parse and agree with the CPU).
    pub const TESTED: [MatvecShape; 4] = [
        MatvecShape { rows: 1, wg: 64 },
        MatvecShape { rows: 2, wg: 128 },
        MatvecShape { rows: 4, wg: 64 },
        MatvecShape { rows: 8, wg: 256 },
    ];
}

const REDUCE_ROWS_SUBGROUP: &str = "    for (var r = 0u; r < ROWS; r++) {
        let s = subgroupAdd(acc[r]);
        if (sg_lane == 0u) {
            red[r * n_sg + sg_id] = s;
        }
    }
    workgroupBarrier();
    if (lid < ROWS && row0 + lid < P.n_rows) {
        var s = 0.0;
        for (var i = 0u; i < n_sg; i++) {
            s += red[lid * n_sg + i];
        }
        store_y(P.out_col0 + row0 + lid, s);
    }";

const REDUCE_ROWS_SHARED: &str = "    for (var r = 0u; r < ROWS; r++) {
        red[r * WG + lid] = acc[r];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            for (var r = 0u; r < ROWS; r++) {
                red[r * WG + lid] += red[r * WG + lid + s];
            }
        }
        workgroupBarrier();
    }
    if (lid < ROWS && row0 + lid < P.n_rows) {
        store_y(P.out_col0 + row0 + lid, red[lid * WG]);
    }";

/// The decode matrix-vector product for one weight type (one token, `k` a multiple of 8).
pub fn matvec(layout: &TypeLayout, shape: MatvecShape, subgroups: bool) -> String {
    let (reduce, sg_args) = if subgroups {
        (
            REDUCE_ROWS_SUBGROUP,
            "@builtin(subgroup_id) sg_id: u32,\n    @builtin(subgroup_invocation_id) sg_lane: u32,\n    @builtin(num_subgroups) n_sg: u32,",
        )
    } else {
        (REDUCE_ROWS_SHARED, "")
    };
    // Types without their own `dot8` (scale folded out of the inner loop) get it from `dq8`.
    let dot8 = if layout.shader.contains("fn dot8(") {
        ""
    } else {
        "fn dot8(b: u32, j: u32, xa: vec4<f32>, xc: vec4<f32>, xsum: f32) -> f32 {
    let v = dq8(b, j);
    return dot(v.a, xa) + dot(v.b, xc);
}"
    };
    MATVEC
        .replace("{{PARAMS}}", MATMUL_PARAMS)
        .replace("{{QUANT}}", &format!("{}\n{dot8}", quant(layout)))
        .replace("{{WG}}", &shape.wg.to_string())
        .replace("{{ROWS}}", &shape.rows.to_string())
        .replace("{{RED_LEN}}", &(shape.rows * shape.wg).to_string())
        .replace("{{REDUCE_ROWS}}", reduce)
        .replace("{{SG_ARGS}}", sg_args)
}

/// A weight type's `dot32` against int8 activations (`shaders/quant/i8/`), for the types the int8
/// decode kernel covers: the formats of the 8B benchmarks (Q4_0, Q4_K with its Q6_K output and
/// FFN matrices), Q5_K_M's Q5_K, and the other legacy block types (Q4_1, Q5_0, Q5_1, Q8_0).
pub fn dot32_source(dtype: GgmlType) -> Option<&'static str> {
    Some(match dtype {
        GgmlType::Q4_0 => include_str!("shaders/quant/i8/q4_0.wgsl"),
        GgmlType::Q4_1 => include_str!("shaders/quant/i8/q4_1.wgsl"),
        GgmlType::Q5_0 => include_str!("shaders/quant/i8/q5_0.wgsl"),
        GgmlType::Q5_1 => include_str!("shaders/quant/i8/q5_1.wgsl"),
        GgmlType::Q8_0 => include_str!("shaders/quant/i8/q8_0.wgsl"),
        GgmlType::Q4_K => include_str!("shaders/quant/i8/q4_k.wgsl"),
        GgmlType::Q5_K => include_str!("shaders/quant/i8/q5_k.wgsl"),
        GgmlType::Q6_K => include_str!("shaders/quant/i8/q6_k.wgsl"),
        _ => return None,
    })
}

/// The int8-activation decode matrix-vector product for one weight type (`None` when the type has
/// no `dot32`): the f32 kernel's workgroup shape and closing reduction, 32 values per invocation
/// and iteration.
pub fn matvec_q8(layout: &TypeLayout, shape: MatvecShape, subgroups: bool) -> Option<String> {
    let dot32 = dot32_source(layout.dtype)?;
    let (reduce, sg_args) = if subgroups {
        (
            REDUCE_ROWS_SUBGROUP,
            "@builtin(subgroup_id) sg_id: u32,\n    @builtin(subgroup_invocation_id) sg_lane: u32,\n    @builtin(num_subgroups) n_sg: u32,",
        )
    } else {
        (REDUCE_ROWS_SHARED, "")
    };
    Some(
        MATVEC_Q8
            .replace("{{PARAMS}}", MATMUL_PARAMS)
            .replace("{{QUANT}}", &format!("{}\n{dot32}", quant(layout)))
            .replace("{{WG}}", &shape.wg.to_string())
            .replace("{{ROWS}}", &shape.rows.to_string())
            .replace("{{RED_LEN}}", &(shape.rows * shape.wg).to_string())
            .replace("{{REDUCE_ROWS}}", reduce)
            .replace("{{SG_ARGS}}", sg_args),
    )
}

/// Row lookup (embeddings) for one weight type.
pub fn get_rows(layout: &TypeLayout) -> String {
    GET_ROWS.replace("{{QUANT}}", &quant(layout))
}

#[cfg(test)]
mod tests {
    use super::*;

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
                        for unroll in [false, true] {
                            let name =
                                format!("matmul {} tok {tok} guard {guard} subgroups {sg} unroll {unroll}", l.name);
                            parse(&name, &matmul(&l, tok, guard, sg, unroll));
                        }
                    }
                }
            }
            for shape in MatvecShape::TESTED {
                for sg in [false, true] {
                    parse(&format!("matvec {} {shape:?} subgroups {sg}", l.name), &matvec(&l, shape, sg));
                    if let Some(src) = matvec_q8(&l, shape, sg) {
                        parse(&format!("matvec_q8 {} {shape:?} subgroups {sg}", l.name), &src);
                    }
                }
            }
            for guard in [false, true] {
                parse(&format!("matmul_tiled {} guard {guard}", l.name), &matmul_tiled(&l, guard));
            }
            parse(&format!("get_rows {}", l.name), &get_rows(&l));
        }
    }

    #[test]
    fn tiled_kernel_tile_matches_the_dispatch() {
        assert!(MATMUL_TILED.contains(&format!("const TR: u32 = {TILE_ROWS}u;")));
        assert!(MATMUL_TILED.contains(&format!("const TT: u32 = {TILE_TOKENS}u;")));
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
