//! WGSL sources: one file per op under `shaders/`, quant variants generated from one template by
//! string substitution (`{{QUANT}}` receives a weight type's `dq8`, `{{REDUCE}}` the subgroup or
//! shared-memory reduction).

use super::layout::TypeLayout;
use gguf::GgmlType;

const QUANT_COMMON: &str = include_str!("shaders/quant/common.wgsl");
/// The int8 dot32 files' helpers, once per int8 kernel.
pub(super) const I8_COMMON: &str = include_str!("shaders/quant/i8/common.wgsl");
const MATMUL: &str = include_str!("shaders/matmul.wgsl");
const MATVEC: &str = include_str!("shaders/matvec.wgsl");
const MATVEC_Q8: &str = include_str!("shaders/matvec_q8.wgsl");
const MATMUL_TILED: &str = include_str!("shaders/matmul_tiled.wgsl");
const MATMUL_TILED_Q8: &str = include_str!("shaders/matmul_tiled_q8.wgsl");
const MATMUL_PARAMS: &str = include_str!("shaders/matmul_params.wgsl");
const GET_ROWS: &str = include_str!("shaders/get_rows.wgsl");
const REDUCE_SHARED: &str = include_str!("shaders/reduce_shared.wgsl");
const REDUCE_SUBGROUP: &str = include_str!("shaders/reduce_subgroup.wgsl");
const ACT: &str = include_str!("shaders/act.wgsl");
pub(super) const Q8_BLOCK: &str = include_str!("shaders/q8_block.wgsl");
/// The rope pair helpers both attention kernels rotate q and k with.
const ROPE_PAIR: &str = include_str!("shaders/rope_pair.wgsl");
/// The GLU kernels' epilogue: a workgroup's rows to int8 blocks (dense and MoE).
pub(super) const Q8_ROWS: &str = include_str!("shaders/q8_rows.wgsl");

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
    /// Rope, KV-cache write and flash attention over the cache in one pass.
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

    /// Whether every read of the kernel's workgroup memory follows a write of that element by
    /// the same workgroup (argued in the shader's comment), so the pipeline may skip WGSL's zeroing
    /// of it at every workgroup start. Kernels without workgroup memory: true (nothing to zero).
    pub fn workgroup_memory_written_first(self) -> bool {
        match self {
            Plain::Norm | Plain::Attention => true,
            Plain::Binary
            | Plain::Unary
            | Plain::Glu
            | Plain::Rope
            | Plain::CopyCols
            | Plain::GatherRows
            | Plain::ScatterAdd
            | Plain::SsmConv
            | Plain::QuantizeQ8 => true,
            Plain::Argmax | Plain::Stream | Plain::SsmScan => false,
        }
    }

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
            .replace("{{Q8_BLOCK}}", Q8_BLOCK)
            .replace("{{ROPE_PAIR}}", ROPE_PAIR)
            .replace("{{REDUCE_SHARED}}", REDUCE_SHARED)
            .replace("{{NORM_PARAMS}}", NORM_PARAMS)
    }
}

/// The norm kernels' parameters (`norm_io.wgsl`).
pub(super) const NORM_PARAMS: &str = include_str!("shaders/norm_io.wgsl");
/// The bindings of the vec4 norm kernels (`norm_io_vec4.wgsl`).
pub(super) const NORM_IO_VEC4: &str = include_str!("shaders/norm_io_vec4.wgsl");

/// Entry-point arguments and `reduce_sum` call arguments of a kernel reducing through subgroups.
pub(super) const SG_ARGS: &str =
    "@builtin(subgroup_id) sg_id: u32,\n    @builtin(subgroup_invocation_id) sg_lane: u32,\n    @builtin(num_subgroups) n_sg: u32,";
pub(super) const SG_CALL: &str = ", sg_id, sg_lane, n_sg";

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
    let (reduce, sg_args, sg_call) =
        if subgroups { (REDUCE_SUBGROUP, SG_ARGS, SG_CALL) } else { (REDUCE_SHARED, "", "") };
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

/// The int8 tiled prefill kernel's `sub_block` (`shaders/quant/i8t/`) for weights of layout `l`:
/// grouped Q4_0 and ggml's Q4_K, the benchmarks' types; `None` for the others, which keep the
/// f32 tiled kernel.
pub fn sub_block_source(l: &TypeLayout) -> Option<&'static str> {
    match (l.dtype, l.regrouped) {
        (GgmlType::Q4_0, true) => Some(include_str!("shaders/quant/i8t/q4_0g.wgsl")),
        (GgmlType::Q4_K, false) => Some(include_str!("shaders/quant/i8t/q4_k.wgsl")),
        _ => None,
    }
}

/// The int8 tiled prefill kernel (`matmul_tiled_q8.wgsl`) for weights of layout `l`; `None`
/// without a [`sub_block_source`].
pub fn matmul_tiled_q8(l: &TypeLayout) -> Option<String> {
    let sub = sub_block_source(l)?;
    Some(MATMUL_TILED_Q8.replace("{{PARAMS}}", MATMUL_PARAMS).replace("{{SUB_BLOCK}}", sub))
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
/// FFN matrices), Q5_K_M's Q5_K, the other legacy block types (Q4_1, Q5_0, Q5_1, Q8_0), Q2_K and
/// Q3_K, and the IQ4 types (IQ4_NL, IQ4_XS: the codebook turned into signed bytes in registers).
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
        GgmlType::Q2_K => include_str!("shaders/quant/i8/q2_k.wgsl"),
        GgmlType::Q3_K => include_str!("shaders/quant/i8/q3_k.wgsl"),
        GgmlType::IQ4_NL => include_str!("shaders/quant/i8/iq4_nl.wgsl"),
        GgmlType::IQ4_XS => include_str!("shaders/quant/i8/iq4_xs.wgsl"),
        _ => return None,
    })
}

/// The shape of the int8 decode kernel (`matvec_q8.wgsl`): `wg` invocations in row slots of `tpr`
/// invocations, each slot holding `rows` rows in registers (a workgroup covers
/// `rows * wg / tpr` rows), `unroll` activation blocks (or pairs of adjacent blocks) per loop
/// iteration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Q8Shape {
    /// Rows per slot (they share the activation loads).
    pub rows: u32,
    /// Invocations per workgroup (a power of two, 32..=256).
    pub wg: u32,
    /// Invocations per row slot (a power of two dividing `wg`; `wg`: every invocation on the same
    /// rows, reduced through subgroups when available).
    pub tpr: u32,
    /// Activation blocks per loop iteration (1, 2 or 4).
    pub unroll: u32,
    /// Each invocation takes two adjacent activation blocks where it would take one (`unroll`
    /// pairs per iteration): the two sub-blocks of a weight block it meets load their block's
    /// header from the same address, Q4_K's two their quant bytes too (low and high nibbles), so
    /// the compiler may merge those loads (else the second hits the cache); grouped Q4_0's two are
    /// 32 contiguous bytes. Whether the driver merges them is not checked.
    pub pairs: bool,
    /// 16-byte weight loads (`quant/i8/*_v4.wgsl`) for the layouts whose repacked blocks start on
    /// 16-byte boundaries (Q4_K, Q5_K, grouped Q4_0); others ignore it.
    pub vec4: bool,
    /// Row slots are the device's subgroups (`tpr` is ignored), reduced by `subgroupAdd` with no
    /// barrier, and the grid is capped ([`Q8Shape::dispatch_groups`]): each subgroup loops over
    /// row slots on its own until the rows run out. Why: the classic shapes end every workgroup
    /// with a barrier and a reduction through workgroup memory, and launch one workgroup per
    /// 1-4 rows (32768 for the benchmark's matrix), so an SM's subgroups start and stop
    /// together instead of keeping loads in flight. Plain and multi-weight products only (the
    /// GLU's epilogue quantizes whole 32-row blocks per workgroup); needs subgroups.
    pub persistent: bool,
}

impl Q8Shape {
    /// Rows a grid unit covers: a workgroup's rows, or for a persistent shape one row slot's
    /// (the parameters' group counts are then counted in row slots).
    pub fn rows_per_group(self) -> u32 {
        if self.persistent {
            self.rows
        } else {
            self.rows * (self.wg / self.tpr)
        }
    }

    /// Workgroups to dispatch for `units` grid units ([`rows_per_group`](Self::rows_per_group)
    /// rows each): one per unit, or for a persistent shape enough for one row slot per subgroup
    /// (counted with 32 invocations each) up to [`PERSISTENT_GROUPS`] workgroups; every
    /// subgroup loops over the rest.
    pub fn dispatch_groups(self, units: usize) -> usize {
        if self.persistent {
            units.div_ceil((self.wg / 32).max(1) as usize).clamp(1, persistent_groups())
        } else {
            units
        }
    }

    /// Whether the kernel can be built with this shape.
    pub fn is_valid(self) -> bool {
        (1..=8).contains(&self.rows)
            && self.wg.is_power_of_two()
            && (32..=256).contains(&self.wg)
            && self.tpr.is_power_of_two()
            && self.tpr <= self.wg
            && matches!(self.unroll, 1 | 2 | 4)
            && !(self.persistent && self.pairs)
    }

    /// `ROWSxWG[tTPR][uUNROLL][p][s][v]`, e.g. `2x64` (every invocation on the same rows, one
    /// block per iteration), `1x256t8u2pv` (`p`: pairs of adjacent blocks) or `1x256u2sv` (`s`:
    /// persistent subgroup row slots); `None` when malformed or invalid.
    pub fn parse(s: &str) -> Option<Q8Shape> {
        let (s, vec4) = match s.strip_suffix('v') {
            Some(rest) => (rest, true),
            None => (s, false),
        };
        let (s, persistent) = match s.strip_suffix('s') {
            Some(rest) => (rest, true),
            None => (s, false),
        };
        let (s, pairs) = match s.strip_suffix('p') {
            Some(rest) => (rest, true),
            None => (s, false),
        };
        let (rows, rest) = s.split_once('x')?;
        let (rest, unroll) = match rest.split_once('u') {
            Some((r, u)) => (r, u.parse().ok()?),
            None => (rest, 1),
        };
        let (wg, tpr) = match rest.split_once('t') {
            Some((w, t)) => (w.parse().ok()?, Some(t.parse().ok()?)),
            None => (rest.parse().ok()?, None),
        };
        let shape = Q8Shape { rows: rows.parse().ok()?, wg, tpr: tpr.unwrap_or(wg), unroll, pairs, vec4, persistent };
        shape.is_valid().then_some(shape)
    }

    /// The shapes the int8 kernel is compiled for in tests (every one must parse and agree with
    /// the CPU): the classic ones and the row-slot ones with and without unrolling.
    pub const TESTED: [Q8Shape; 10] = [
        Q8Shape::classic(1, 64, 64, 1, false, false),
        Q8Shape::classic(2, 128, 128, 2, false, true),
        Q8Shape::classic(4, 64, 64, 4, false, false),
        Q8Shape::classic(1, 256, 8, 1, false, true),
        Q8Shape::classic(2, 128, 16, 2, false, false),
        Q8Shape::classic(1, 32, 4, 4, false, true),
        Q8Shape::classic(2, 64, 64, 2, true, true),
        Q8Shape::classic(1, 256, 8, 1, true, false),
        Q8Shape { persistent: true, ..Q8Shape::classic(1, 256, 256, 2, false, true) },
        Q8Shape { persistent: true, ..Q8Shape::classic(2, 64, 64, 1, false, false) },
    ];

    /// A shape that is not persistent.
    pub const fn classic(rows: u32, wg: u32, tpr: u32, unroll: u32, pairs: bool, vec4: bool) -> Q8Shape {
        Q8Shape { rows, wg, tpr, unroll, pairs, vec4, persistent: false }
    }
}

impl From<MatvecShape> for Q8Shape {
    fn from(s: MatvecShape) -> Q8Shape {
        Q8Shape::classic(s.rows, s.wg, s.wg, 1, false, false)
    }
}

impl std::fmt::Display for Q8Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.rows, self.wg)?;
        if self.tpr != self.wg {
            write!(f, "t{}", self.tpr)?;
        }
        if self.unroll != 1 {
            write!(f, "u{}", self.unroll)?;
        }
        if self.pairs {
            write!(f, "p")?;
        }
        if self.persistent {
            write!(f, "s")?;
        }
        if self.vec4 {
            write!(f, "v")?;
        }
        Ok(())
    }
}

/// The most workgroups a persistent int8 kernel launches (`DISKFORMER_Q8_PERSIST_GROUPS`, for
/// comparisons on the device; default 1056, 8 per SM of an H200's 132, as many subgroups of 256
/// invocations as it keeps resident).
pub fn persistent_groups() -> usize {
    static GROUPS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *GROUPS.get_or_init(|| {
        std::env::var("DISKFORMER_Q8_PERSIST_GROUPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(1056)
    })
}

/// What one int8 kernel computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Q8Kind {
    /// Products of 1..=3 weights of one type and width against the same activations, their
    /// workgroups one after another in the grid, each into its own output.
    Weights(u32),
    /// gate and up paired: glu(gate, up) per row, optionally with the result's int8 blocks.
    Glu,
}

/// The activation block `q` of the loop and the weight block offset / sub-block it meets.
const Q8_LOAD: &str = "            let x0{S} = XQ[2u * (P.xb0 + q{S})];
            let x1{S} = XQ[2u * (P.xb0 + q{S}) + 1u];
            let xd{S} = XD[P.xb0 + q{S}];
            let bo{S} = (q{S} / (QBV{I} / 32u)) * QBW{I};
            let j{S} = q{S} % (QBV{I} / 32u);
";

/// The main loop over activation blocks, `unroll` per iteration (their loads issued together,
/// then the arithmetic), then one at a time; `{ACC}` adds block `{S}` to the accumulators. With
/// `pairs`, `unroll` pairs of adjacent blocks per iteration, then a pair at a time.
fn q8_loop(unroll: u32, pairs: bool, acc: &str) -> String {
    let one = |sfx: &str| Q8_LOAD.replace("{S}", sfx);
    let add = |sfx: &str| acc.replace("{S}", sfx);
    if pairs {
        let sfx = ["a", "b", "c", "d", "e", "f", "g", "h"];
        let u = unroll as usize;
        // Invocation `lane` takes blocks 2 lane and 2 lane + 1, then the same 2 TPR further on.
        let mut s = String::from("        var q = 2u * lane;\n");
        s += &format!("        for (; q + {}u * TPR + 1u < n_blocks; q += {}u * TPR) {{\n", 2 * (u - 1), 2 * u);
        for i in 0..u {
            s += &format!("            let q{} = q + {}u * TPR;\n", sfx[2 * i], 2 * i);
            s += &format!("            let q{} = q{} + 1u;\n", sfx[2 * i + 1], sfx[2 * i]);
        }
        for x in sfx.iter().take(2 * u) {
            s += &one(x);
        }
        for x in sfx.iter().take(2 * u) {
            s += &add(x);
        }
        s += "        }\n";
        // What is left: fewer than `unroll` pairs, the last possibly a single block.
        s += "        for (; q < n_blocks; q += 2u * TPR) {\n            let qa = q;\n";
        s += &one("a");
        s += &add("a");
        s += "            if (q + 1u < n_blocks) {\n                let qb = q + 1u;\n";
        s += &one("b");
        s += &add("b");
        s += "            }\n        }\n";
        return s;
    }
    let sfx = ["a", "b", "c", "d"];
    let mut s = String::from("        var q = lane;\n");
    if unroll > 1 {
        let u = unroll as usize;
        s += &format!("        for (; q + {}u * TPR < n_blocks; q += {unroll}u * TPR) {{\n", unroll - 1);
        for (i, x) in sfx.iter().take(u).enumerate() {
            s += &format!("            let q{x} = q + {i}u * TPR;\n");
        }
        for x in sfx.iter().take(u) {
            s += &one(x);
        }
        for x in sfx.iter().take(u) {
            s += &add(x);
        }
        s += "        }\n";
    }
    s += "        for (; q < n_blocks; q += TPR) {\n            let qa = q;\n";
    s += &one("a");
    s += &add("a");
    s += "        }\n";
    s
}

/// Stores `s` at `{Y}[o]`, or adds it (P.accumulate).
const Q8_STORE: &str =
    "if (P.accumulate != 0u) {\n                {Y}[o] += s;\n            } else {\n                {Y}[o] = s;\n            }";

/// One weight's part of a plain int8 kernel: `{G}` its workgroup index, `{N}` its row count,
/// `{DOT}` its dot product, `{Y}` its output, `{WR}` / `{OC}` its first row and output column.
fn q8_weight_body(shape: Q8Shape, subgroups: bool) -> String {
    let mut s = String::from(
        "        let n_rows = {N};
        let wrow0 = ({G}) * RPW;
        let row0 = wrow0 + slot * ROWS;
        // Rows past the end repeat the last row: computed, never written.
        var rb: array<u32, ROWS>;
        for (var r = 0u; r < ROWS; r++) {
            rb[r] = ({WR} + min(row0 + r, n_rows - 1u)) * (P.k / QBV{I}) * QBW{I};
        }
        var acc: array<f32, ROWS>;
",
    );
    s += &q8_loop(
        shape.unroll,
        shape.pairs,
        "            for (var r = 0u; r < ROWS; r++) {\n                acc[r] += {DOT}(rb[r] + bo{S}, j{S}, x0{S}, x1{S}, xd{S});\n            }\n",
    );
    let store = Q8_STORE;
    if shape.persistent {
        // The slot is this subgroup: its sum is final, lane 0 writes it; no barrier.
        s += &format!(
            "        for (var r = 0u; r < ROWS; r++) {{
            let s = subgroupAdd(acc[r]);
            if (sg_lane == 0u && row0 + r < n_rows) {{
                let o = {{OC}} + row0 + r;
                {store}
            }}
        }}
"
        );
        // The blocks of a row are strided over the subgroup's lanes.
        return s.replace("TPR", "sg_size");
    }
    if shape.tpr != shape.wg {
        // Row slots: every slot's partial sums side by side, one invocation per row adds its TPR.
        s += &format!(
            "        for (var r = 0u; r < ROWS; r++) {{
            red[(slot * ROWS + r) * TPR + lane] = acc[r];
        }}
        workgroupBarrier();
        if (lid < RPW && wrow0 + lid < n_rows) {{
            var s = 0.0;
            for (var i = 0u; i < TPR; i++) {{
                s += red[lid * TPR + i];
            }}
            let o = {{OC}} + wrow0 + lid;
            {store}
        }}
"
        );
    } else if subgroups {
        s += &format!(
            "        for (var r = 0u; r < ROWS; r++) {{
            let s = subgroupAdd(acc[r]);
            if (sg_lane == 0u) {{
                red[r * n_sg + sg_id] = s;
            }}
        }}
        workgroupBarrier();
        if (lid < ROWS && row0 + lid < n_rows) {{
            var s = 0.0;
            for (var i = 0u; i < n_sg; i++) {{
                s += red[lid * n_sg + i];
            }}
            let o = {{OC}} + row0 + lid;
            {store}
        }}
"
        );
    } else {
        s += &format!(
            "        for (var r = 0u; r < ROWS; r++) {{
            red[r * WG + lid] = acc[r];
        }}
        workgroupBarrier();
        for (var h = WG / 2u; h > 0u; h >>= 1u) {{
            if (lid < h) {{
                for (var r = 0u; r < ROWS; r++) {{
                    red[r * WG + lid] += red[r * WG + lid + h];
                }}
            }}
            workgroupBarrier();
        }}
        if (lid < ROWS && row0 + lid < n_rows) {{
            let s = red[lid * WG];
            let o = {{OC}} + row0 + lid;
            {store}
        }}
"
        );
    }
    s
}

/// The GLU kernel's body: gate (W) and up (W1) rows of the same index, glu into Y, then the
/// result's int8 blocks into QS/DS when P.quantize is set (as quantize_q8.wgsl computes them, so
/// the down projection sees the same values as after a separate quantization).
fn q8_glu_body(shape: Q8Shape) -> String {
    let mut s = String::from(
        "    let n_rows = P.n_rows0;
    let wrow0 = g * RPW;
    let row0 = wrow0 + slot * ROWS;
    var rb: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        rb[r] = min(row0 + r, n_rows - 1u) * (P.k / QBV0) * QBW0;
    }
    var ag: array<f32, ROWS>;
    var au: array<f32, ROWS>;
    {
",
    );
    s += &q8_loop(
        shape.unroll,
        shape.pairs,
        "            for (var r = 0u; r < ROWS; r++) {\n                ag[r] += dot32(rb[r] + bo{S}, j{S}, x0{S}, x1{S}, xd{S});\n                au[r] += dot32_1(rb[r] + bo{S}, j{S}, x0{S}, x1{S}, xd{S});\n            }\n",
    );
    s += "    }
    for (var r = 0u; r < ROWS; r++) {
        red[(slot * ROWS + r) * TPR + lane] = ag[r];
        red[(RPW + slot * ROWS + r) * TPR + lane] = au[r];
    }
    workgroupBarrier();
    var h = 0.0;
    if (lid < RPW) {
        var sg = 0.0;
        var su = 0.0;
        for (var i = 0u; i < TPR; i++) {
            sg += red[lid * TPR + i];
            su += red[(RPW + lid) * TPR + i];
        }
        h = glu_act(sg, su, P.glu_op, P.alpha, P.limit);
        if (wrow0 + lid < n_rows) {
            Y[wrow0 + lid] = h;
        }
    }
    if (P.quantize != 0u) {
        // The partial sums are read; red now holds |h| for the block maxima.
        let d = q8_rows(h, lid);
        if (lid < RPW / 4u && wrow0 + 4u * lid < n_rows) {
            QS[wrow0 / 4u + lid] = q8_rows_word(lid);
        }
        if (lid < RPW && lid % 32u == 0u && wrow0 + lid < n_rows) {
            DS[(wrow0 + lid) / 32u] = vec2<f32>(d, d * f32(q8_rows_sum(lid)));
        }
    }
";
    s
}

/// The `dot32` of weights in layout `l`: the type's ([`dot32_source`]), or the grouped Q4_0 and
/// Q4_K layouts' own.
pub fn dot32_layout_source(l: &TypeLayout) -> Option<&'static str> {
    if l.regrouped {
        return match l.dtype {
            GgmlType::Q4_0 => Some(include_str!("shaders/quant/i8/q4_0g.wgsl")),
            GgmlType::Q4_K => Some(include_str!("shaders/quant/i8/q4_kg.wgsl")),
            _ => None,
        };
    }
    dot32_source(l.dtype)
}

/// A weight type's `dot32` reading weight `i`'s binding (`W`, `W1`, `W2`) as `dot32`, `dot32_1`, ...
fn dot32_for(src: &str, i: u32) -> String {
    if i == 0 {
        src.to_string()
    } else {
        src.replace("W[", &format!("W{i}[")).replace("fn dot32(", &format!("fn dot32_{i}("))
    }
}

/// A layout's `dot32` with 16-byte weight loads (`W` bound as `array<vec4<u32>>`), for the
/// layouts whose repacked blocks are whole 16-byte units (Q4_K, Q5_K, grouped Q4_0 and Q4_K).
pub fn dot32_v4_source(l: &TypeLayout) -> Option<&'static str> {
    if l.regrouped {
        return match l.dtype {
            GgmlType::Q4_0 => Some(include_str!("shaders/quant/i8/q4_0g_v4.wgsl")),
            GgmlType::Q4_K => Some(include_str!("shaders/quant/i8/q4_kg_v4.wgsl")),
            _ => None,
        };
    }
    Some(match l.dtype {
        GgmlType::Q4_K => include_str!("shaders/quant/i8/q4_k_v4.wgsl"),
        GgmlType::Q5_K => include_str!("shaders/quant/i8/q5_k_v4.wgsl"),
        _ => return None,
    })
}

/// `src` without the top-level function `name` (its braces matched).
fn without_fn(src: &str, name: &str) -> String {
    let Some(start) = src.find(&format!("fn {name}(")) else { return src.to_string() };
    let Some(open) = src[start..].find('{').map(|i| start + i) else { return src.to_string() };
    match matching_brace(src, open) {
        Some(close) => format!("{}{}", &src[..start], &src[close + 1..]),
        None => src.to_string(),
    }
}

/// The index of the `}` that closes the `{` at byte `open` of `src` (`None` when unbalanced).
fn matching_brace(src: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in src[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// The int8-activation decode kernel for weights of the types `layouts` (weight i's type is
/// `layouts[i]`; `None` when one has no `dot32` or `layouts` is shorter than `kind` needs).
/// Multi-weight kernels need `shape` and the weights' row counts to fit the grid layout the
/// caller computes with [`Q8Shape::rows_per_group`]; the GLU kernel (one type) quantizes its
/// result only with whole 32-row blocks per workgroup. 16-byte loads (`shape.vec4`) apply when
/// every weight is of one type that has them.
pub fn matvec_q8_types(layouts: &[TypeLayout], shape: Q8Shape, kind: Q8Kind, subgroups: bool) -> Option<String> {
    if shape.persistent && (!subgroups || kind == Q8Kind::Glu) {
        return None;
    }
    let n_w = match kind {
        Q8Kind::Weights(n) => n.clamp(1, 3),
        Q8Kind::Glu => 2,
    };
    let layouts = layouts.get(..n_w as usize)?;
    let layout = &layouts[0];
    let one_type = layouts.iter().all(|l| l == layout);
    let v4 = if shape.vec4 && one_type { dot32_v4_source(layout) } else { None };
    let mut dots = Vec::new();
    for (i, l) in layouts.iter().enumerate() {
        let src = match v4 {
            Some(src) => src,
            None => dot32_layout_source(l)?,
        };
        dots.push(format!(
            "const QBV{i}: u32 = {}u;\nconst QBW{i}: u32 = {}u;\n{}",
            l.block_values,
            l.block_words(),
            dot32_for(src, i as u32)
        ));
    }
    let dots = dots.join("\n");
    // With 16-byte loads the weights are vec4 words: the type's `dq8` and the byte helper, which
    // read `W` as words, are left out (the int8 kernel uses neither).
    let (warr, quant_src) = if v4.is_some() {
        ("array<vec4<u32>>", format!("{}\n{I8_COMMON}", without_fn(QUANT_COMMON, "wbyte")))
    } else {
        ("array<u32>", format!("{}\n{I8_COMMON}", quant(layout)))
    };
    let wname = |i: u32| if i == 0 { "W".to_string() } else { format!("W{i}") };
    let yname = |i: u32| if i == 0 { "Y".to_string() } else { format!("Y{i}") };
    let mut bindings = String::new();
    let mut b = 2;
    let mut bind = |decl: String| {
        bindings += &format!("@group(0) @binding({b}) {decl}\n");
        b += 1;
    };
    let body = match kind {
        Q8Kind::Weights(_) => {
            for i in 0..n_w {
                bind(format!("var<storage, read> {}: {warr};", wname(i)));
                bind(format!("var<storage, read_write> {}: array<f32>;", yname(i)));
            }
            let part = q8_weight_body(shape, subgroups);
            let group_starts = ["0u", "P.groups1", "P.groups2", "P.groups_end"];
            let n_rows = ["P.n_rows0", "P.n_rows1", "P.n_rows2"];
            let mut body = String::new();
            for i in 0..n_w as usize {
                let code = part
                    .replace("{I}", &i.to_string())
                    .replace("{N}", n_rows[i])
                    .replace("{G}", &format!("g - {}", group_starts[i]))
                    .replace("{DOT}", ["dot32", "dot32_1", "dot32_2"][i])
                    .replace("{Y}", &yname(i as u32))
                    .replace("{WR}", if i == 0 { "P.w_row0" } else { "0u" })
                    .replace("{OC}", if i == 0 { "P.out_col0" } else { "0u" });
                // The weight a workgroup serves is uniform over it (it depends on the workgroup id).
                let cond =
                    if i + 1 == n_w as usize { String::new() } else { format!("if (g < {}) ", group_starts[i + 1]) };
                let open = if i == 0 { format!("    {cond}{{\n") } else { format!(" else {cond}{{\n") };
                body += &open;
                body += &code;
                body += "    }";
            }
            body + "\n"
        }
        Q8Kind::Glu => {
            bind(format!("var<storage, read> W: {warr};"));
            bind(format!("var<storage, read> W1: {warr};"));
            bind("var<storage, read_write> Y: array<f32>;".into());
            bind("var<storage, read_write> QS: array<u32>;".into());
            bind("var<storage, read_write> DS: array<vec2<f32>>;".into());
            q8_glu_body(shape).replace("{I}", "0")
        }
    };
    bind("var<uniform> P: Params;".into());
    let sg_wide = subgroups && shape.tpr == shape.wg && kind != Q8Kind::Glu;
    let sg_args = if shape.persistent {
        "@builtin(subgroup_id) sg_id: u32,\n    @builtin(subgroup_invocation_id) sg_lane: u32,\n    @builtin(num_subgroups) n_sg: u32,\n    @builtin(subgroup_size) sg_size: u32,"
    } else if sg_wide {
        "@builtin(subgroup_id) sg_id: u32,\n    @builtin(subgroup_invocation_id) sg_lane: u32,\n    @builtin(num_subgroups) n_sg: u32,"
    } else {
        ""
    };
    let entry = if shape.persistent {
        format!(
            "    // A grid unit is a row slot, served by one subgroup at a time; nothing below waits for
    // another subgroup, so each leaves when its slots run out.
    let n_blocks = P.k / 32u;
    let slot = 0u;
    let lane = sg_lane;
    let n_slots = nwg.x * nwg.y * n_sg;
    for (var g = (wid.x + wid.y * nwg.x) * n_sg + sg_id; g < P.groups_end; g += n_slots) {{
{}    }}
",
            body.lines().map(|l| format!("    {l}\n")).collect::<String>()
        )
    } else {
        format!(
            "    // Uniform per workgroup, so the barriers below are reached by all or none.
    let g = wid.x + wid.y * nwg.x;
    if (g >= P.groups_end) {{
        return;
    }}
    let n_blocks = P.k / 32u;
    let slot = lid / TPR;
    let lane = lid % TPR;
{body}"
        )
    };
    // A persistent kernel's slot is one subgroup: one slot per workgroup as the template counts.
    let tpr = if shape.persistent { shape.wg } else { shape.tpr };
    let n_red = if kind == Q8Kind::Glu { 2 } else { 1 };
    let act = if kind == Q8Kind::Glu { format!("{ACT}\n{Q8_ROWS}") } else { String::new() };
    Some(
        MATVEC_Q8
            .replace("{{BINDINGS}}", &bindings)
            .replace("{{QUANT}}", &format!("{quant_src}\n{dots}"))
            .replace("{{ACT}}", &act)
            .replace("{{WG}}", &shape.wg.to_string())
            .replace("{{TPR}}", &tpr.to_string())
            .replace("{{ROWS}}", &shape.rows.to_string())
            .replace("{{RED_LEN}}", &(n_red * shape.rows * shape.wg).max(32).to_string())
            .replace("{{SG_ARGS}}", sg_args)
            .replace("{{ENTRY}}", &entry),
    )
}

/// The decode attention kernel's shape (`attention_decode.wgsl`): `wg` invocations per workgroup,
/// at least `split_keys` keys per workgroup (a longer context is split over several workgroups
/// and combined by a second dispatch), `unroll` keys per subgroup and loop iteration, at most
/// `max_rows` query rows per workgroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnDecodeShape {
    /// Invocations per workgroup (64..=1024, a power of two).
    pub wg: u32,
    /// Keys per workgroup before the context is split (a multiple of 16, at least 16).
    pub split_keys: u32,
    /// Keys a subgroup scores per loop iteration, their loads issued together (1, 2, 4 or 8;
    /// the fallback without subgroups takes 1).
    pub unroll: u32,
    /// Most query rows (token, head) a workgroup serves (1, 2, 4 or 8): fewer spread a KV
    /// head's query heads over more workgroups, each reading the keys again.
    pub max_rows: u32,
}

impl AttnDecodeShape {
    /// `WGxKEYS` with optional `uUNROLL` (default 4) and `rROWS` (default 8), e.g. `128x64`,
    /// `256x128u2` or `1024x512u8r4`; `None` when malformed or out of range.
    pub fn parse(s: &str) -> Option<AttnDecodeShape> {
        let (wg, rest) = s.split_once('x')?;
        let (rest, max_rows) = match rest.split_once('r') {
            Some((a, r)) => (a, r.parse().ok()?),
            None => (rest, 8),
        };
        let (keys, unroll) = match rest.split_once('u') {
            Some((k, u)) => (k, u.parse().ok()?),
            None => (rest, 4),
        };
        let shape = AttnDecodeShape { wg: wg.parse().ok()?, split_keys: keys.parse().ok()?, unroll, max_rows };
        let ok = shape.wg.is_power_of_two()
            && (64..=1024).contains(&shape.wg)
            && shape.split_keys >= 16
            && shape.split_keys.is_multiple_of(16)
            && [1, 2, 4, 8].contains(&shape.unroll)
            && [1, 2, 4, 8].contains(&shape.max_rows);
        ok.then_some(shape)
    }
}

impl std::fmt::Display for AttnDecodeShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.wg, self.split_keys)?;
        if self.unroll != 4 {
            write!(f, "u{}", self.unroll)?;
        }
        if self.max_rows != 8 {
            write!(f, "r{}", self.max_rows)?;
        }
        Ok(())
    }
}

/// Lanes of a key-scoring group in the decode attention without subgroups (a reduction through
/// workgroup memory stands in for `subgroupAdd`).
pub const ATTN_FALLBACK_LANES: u32 = 32;

/// Template values of one decode attention pipeline (`attention_decode.wgsl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnDecodeKernel {
    /// Invocations per workgroup.
    pub wg: u32,
    /// Query rows per workgroup.
    pub rows: u32,
    /// Key head dim (a multiple of 4).
    pub hdk: u32,
    /// Value head dim (a multiple of 4).
    pub hdv: u32,
    /// Keys per group per loop iteration.
    pub unroll: u32,
    /// `Some(smallest subgroup size)`: groups are subgroups; `None`: groups of
    /// [`ATTN_FALLBACK_LANES`] reduced through workgroup memory.
    pub subgroup_min: Option<u32>,
    /// The per-head q and k norms done in the kernel (its `//N` variant; two more storage
    /// buffers, and the workgroup size must be a power of two).
    pub qk_norm: bool,
}

impl AttnDecodeKernel {
    /// Fewest lanes a group can have.
    pub fn min_lanes(&self) -> u32 {
        self.subgroup_min.unwrap_or(ATTN_FALLBACK_LANES)
    }
    /// Most groups in a workgroup.
    pub fn max_groups(&self) -> u32 {
        (self.wg / self.min_lanes()).max(1)
    }
    /// vec4 chunks of a key head per lane.
    pub fn ck(&self) -> u32 {
        (self.hdk / 4).div_ceil(self.min_lanes())
    }
    /// vec4 chunks of a value head per lane.
    pub fn cv(&self) -> u32 {
        (self.hdv / 4).div_ceil(self.min_lanes())
    }
    /// Workgroup memory the kernel declares, in bytes.
    pub fn workgroup_bytes(&self) -> u32 {
        let merge = 2 * 4 * self.max_groups() * self.rows + 4 * self.rows * self.hdv + 4;
        let fallback = if self.subgroup_min.is_none() { 4 * self.unroll * self.rows * self.wg } else { 0 };
        // sh_inv and sh_red over ROWS + MAXT vectors.
        let norms = if self.qk_norm { 4 * (self.rows + ATTN_NORM_MAX_TOKENS) * (self.wg + 1) } else { 0 };
        merge + fallback + norms
    }
    /// The pipeline's cache key (the timer reports kernels by it).
    pub fn key(&self) -> String {
        format!(
            "AttentionDecode wg{} rows{} hd{}/{} u{} {}{}",
            self.wg,
            self.rows,
            self.hdk,
            self.hdv,
            self.unroll,
            if self.subgroup_min.is_some() { "subgroups" } else { "shared" },
            if self.qk_norm { " qk-norm" } else { "" }
        )
    }
}

/// Most new tokens whose keys the decode kernel's q/k-norm variant norms (its `MAXT`; the
/// decode kernel takes at most this many tokens).
pub const ATTN_NORM_MAX_TOKENS: u32 = 4;

const ATTN_GROUP_SUM_SUBGROUP: &str = "fn group_sum(v: array<f32, NSUM>, lid: u32) -> array<f32, NSUM> {
    var o: array<f32, NSUM>;
    for (var x = 0u; x < NSUM; x++) {
        o[x] = subgroupAdd(v[x]);
    }
    return o;
}";

const ATTN_GROUP_SUM_SHARED: &str = "const LANES: u32 = {{LANES}}u;
var<workgroup> sh_red: array<f32, NSUM * WG>;

// Sums over the LANES invocations of each group (a tree in workgroup memory); called by every
// invocation of the workgroup the same number of times (its barriers).
fn group_sum(v: array<f32, NSUM>, lid: u32) -> array<f32, NSUM> {
    for (var x = 0u; x < NSUM; x++) {
        sh_red[x * WG + lid] = v[x];
    }
    workgroupBarrier();
    for (var off = LANES / 2u; off > 0u; off >>= 1u) {
        if (lid % LANES < off) {
            for (var x = 0u; x < NSUM; x++) {
                sh_red[x * WG + lid] += sh_red[x * WG + lid + off];
            }
        }
        workgroupBarrier();
    }
    var o: array<f32, NSUM>;
    let base = lid - lid % LANES;
    for (var x = 0u; x < NSUM; x++) {
        o[x] = sh_red[x * WG + base];
    }
    workgroupBarrier();
    return o;
}";

/// The decode attention kernel for `k`.
pub fn attention_decode(k: &AttnDecodeKernel) -> String {
    let (group_sum, args, ids) = match k.subgroup_min {
        Some(_) => (
            ATTN_GROUP_SUM_SUBGROUP.to_string(),
            "@builtin(subgroup_id) sg_id: u32,\n    @builtin(subgroup_invocation_id) sg_lane: u32,\n    @builtin(subgroup_size) sg_size: u32,\n    @builtin(num_subgroups) n_sg: u32,",
            "let lane = sg_lane;\n    let gsize = sg_size;\n    let grp = sg_id;\n    let ngrp = n_sg;",
        ),
        None => (
            ATTN_GROUP_SUM_SHARED.replace("{{LANES}}", &ATTN_FALLBACK_LANES.to_string()),
            "",
            "let lane = lid % LANES;\n    let gsize = LANES;\n    let grp = lid / LANES;\n    let ngrp = WG / LANES;",
        ),
    };
    let mut src = include_str!("shaders/attention_decode.wgsl").to_string();
    if k.qk_norm {
        src = src.replace("//N ", "");
    }
    let src = src
        .replace("{{P_BINDING}}", if k.qk_norm { "14" } else { "12" })
        .replace("{{GROUP_SUM}}", &group_sum)
        .replace("{{GROUP_ARGS}}", args)
        .replace("{{GROUP_IDS}}", ids)
        .replace("{{Q8_BLOCK}}", Q8_BLOCK)
        .replace("{{ROPE_PAIR}}", ROPE_PAIR)
        .replace("{{WG}}", &k.wg.to_string())
        .replace("{{ROWS}}", &k.rows.to_string())
        .replace("{{HDK}}", &k.hdk.to_string())
        .replace("{{HDV}}", &k.hdv.to_string())
        .replace("{{CK}}", &k.ck().to_string())
        .replace("{{CV}}", &k.cv().to_string())
        .replace("{{UNROLL}}", &k.unroll.to_string())
        .replace("{{MAXG}}", &k.max_groups().to_string())
        .replace("{{HDV_BLOCKS}}", &(k.hdv / 32).max(1).to_string());
    if !attn_unroll_allowed() {
        return src;
    }
    let (rows, ck, cv) = (k.rows, k.ck(), k.cv());
    let bounds = [
        ("ROWS", rows),
        ("UNROLL", k.unroll),
        ("CK", ck),
        ("CV", cv),
        ("ROWS * CK", rows * ck),
        ("ROWS * CV", rows * cv),
    ];
    unroll_const_loops(&src, &bounds, 4 * src.len())
}

/// Whether the decode attention's loops over its template constants are written out
/// (`DISKFORMER_ATTN_UNROLL=0` keeps them as loops, for comparisons).
fn attn_unroll_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("DISKFORMER_ATTN_UNROLL").map_or(true, |v| v != "0"))
}

/// `src` with every loop `for (var X = 0u; X < BOUND; X++) { BODY }` whose BOUND is one of
/// `bounds` (a template constant and its value) written out as that many blocks `{ let X = 0u;
/// BODY }`, ... Why: a private array indexed by a loop variable stays out of registers on the
/// NVIDIA driver unless it unrolls the loop itself, which it does not always do (the int8
/// prefill kernel ran 4x slower so, thirteenth session); written out, every index is a constant.
/// A loop whose body assigns its variable, breaks or continues is kept; so is everything when
/// the result would pass `max_len` bytes (the shader's compile time grows with it).
pub(crate) fn unroll_const_loops(src: &str, bounds: &[(&str, u32)], max_len: usize) -> String {
    let mut out = src.to_string();
    let mut from = 0;
    while let Some(at) = out[from..].find("for (var ").map(|i| from + i) {
        let header_end = match out[at..].find('{') {
            Some(i) => at + i,
            None => break,
        };
        let header = &out[at..header_end];
        let parsed = (|| {
            let rest = header.strip_prefix("for (var ")?;
            let (var, rest) = rest.split_once(" = 0u; ")?;
            let (cond, rest) = rest.split_once("; ")?;
            let bound = cond.strip_prefix(&format!("{var} < "))?;
            (rest.trim_end() == format!("{var}++)")).then_some(())?;
            let n = bounds.iter().find(|(b, _)| *b == bound)?.1;
            Some((var.to_string(), n))
        })();
        // The body: from the brace after the header to its match.
        let close = matching_brace(&out, header_end);
        let (Some((var, n)), Some(close)) = (parsed, close) else {
            from = header_end;
            continue;
        };
        let body = &out[header_end + 1..close];
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        // `var` written (`var =`, `var +=`, `var++`, ...) as a whole word.
        let writes_var = body.match_indices(var.as_str()).any(|(i, _)| {
            let before = body[..i].chars().next_back().is_some_and(ident);
            let after = body[i + var.len()..].trim_start();
            !before
                && !after.starts_with(ident)
                && (after.starts_with("++")
                    || after.starts_with("--")
                    || (after.starts_with('=') && !after.starts_with("=="))
                    || ["+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>="]
                        .iter()
                        .any(|op| after.starts_with(op)))
        });
        if writes_var || body.contains("break") || body.contains("continue") {
            from = header_end;
            continue;
        }
        let copies: String = (0..n).map(|k| format!("{{\nlet {var} = {k}u;{body}}}")).collect::<Vec<_>>().join(" ");
        out = format!("{}{}{}", &out[..at], copies, &out[close + 1..]);
        if out.len() > max_len {
            return src.to_string();
        }
        from = at;
    }
    out
}

/// The combine pass of a split decode attention for value heads of `hdv` dims.
pub fn attention_combine(hdv: u32) -> String {
    include_str!("shaders/attention_combine.wgsl")
        .replace("{{HDV}}", &hdv.to_string())
        .replace("{{Q8_BLOCK}}", Q8_BLOCK)
}

/// Row lookup (embeddings) for one weight type.
pub fn get_rows(layout: &TypeLayout) -> String {
    GET_ROWS.replace("{{QUANT}}", &quant(layout))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Parses and validates WGSL `src` (every capability allowed), panicking with `name` and
    /// naga's message (the shader tests of every kernel builder).
    pub(in crate::wgpu) fn parse(name: &str, src: &str) {
        let module = naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(src)));
        let mut v = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all());
        v.validate(&module).unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(src)));
    }

    #[test]
    fn every_shader_parses_and_validates() {
        for p in Plain::ALL {
            parse(&format!("{p:?}"), &p.source());
        }
        for l in all_layouts() {
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
                }
            }
            // Mixed types: this one with Q6_K and Q4_0 (q/k/v of a Q4_K_M file).
            if dot32_layout_source(&l).is_some() {
                let mixed = [l, TypeLayout::of(GgmlType::Q6_K).unwrap(), TypeLayout::q4_0_grouped()];
                for sg in [false, true] {
                    let src = matvec_q8_types(&mixed, Q8Shape::TESTED[1], Q8Kind::Weights(3), sg).unwrap();
                    parse(&format!("matvec_q8 {} + q6_k + q4_0 subgroups {sg}", l.name), &src);
                }
            }
            for shape in Q8Shape::TESTED {
                for sg in [false, true] {
                    for kind in [Q8Kind::Weights(1), Q8Kind::Weights(2), Q8Kind::Weights(3), Q8Kind::Glu] {
                        if let Some(src) = matvec_q8_types(&[l; 3], shape, kind, sg) {
                            parse(&format!("matvec_q8 {} {shape} {kind:?} subgroups {sg}", l.name), &src);
                        }
                    }
                }
            }
            for guard in [false, true] {
                parse(&format!("matmul_tiled {} guard {guard}", l.name), &matmul_tiled(&l, guard));
            }
            if let Some(src) = matmul_tiled_q8(&l) {
                parse(&format!("matmul_tiled_q8 {}", l.name), &src);
            }
            parse(&format!("get_rows {}", l.name), &get_rows(&l));
        }
        for subgroup_min in [None, Some(8), Some(32)] {
            for (rows, hdk, hdv, unroll) in [(1, 128, 128, 4), (8, 40, 24, 1), (4, 256, 256, 2)] {
                for qk_norm in [false, true] {
                    let k = AttnDecodeKernel { wg: 128, rows, hdk, hdv, unroll, subgroup_min, qk_norm };
                    parse(&k.key(), &attention_decode(&k));
                }
            }
        }
        for hdv in [24, 128, 512] {
            parse(&format!("attention_combine hdv {hdv}"), &attention_combine(hdv));
        }
    }

    #[test]
    fn const_loops_are_written_out() {
        let b = [("N", 3), ("M", 2)];
        let src = "fn f() {\n    for (var i = 0u; i < N; i++) {\n        a[i] += 1.0;\n        for (var j = 0u; j < M; j++) {\n            c[i * M + j] = 0.0;\n        }\n    }\n}";
        let out = unroll_const_loops(src, &b, 10_000);
        assert!(!out.contains("for (var"), "{out}");
        assert_eq!(out.matches("a[i] += 1.0").count(), 3);
        assert_eq!(out.matches("c[i * M + j] = 0.0").count(), 6);
        assert!(out.contains("let i = 2u;") && out.contains("let j = 1u;"));
        parse(
            "written-out loops",
            &format!("var<private> a: array<f32, 3>;\nvar<private> c: array<f32, 6>;\nconst M: u32 = 2u;\n{out}"),
        );
        // Kept: a loop that writes its variable, breaks or continues; an unknown bound; and
        // everything past the length cap.
        for kept in [
            "for (var i = 0u; i < N; i++) {\n    i = 2u;\n}",
            "for (var i = 0u; i < N; i++) {\n    i += 1u;\n}",
            "for (var i = 0u; i < N; i++) {\n    if (a[i] > 0.0) { break; }\n}",
            "for (var i = 0u; i < K; i++) {\n    a[i] = 0.0;\n}",
        ] {
            assert_eq!(unroll_const_loops(kept, &b, 10_000), kept);
        }
        // A name that ends in the variable is not a write of it.
        assert!(!unroll_const_loops("for (var r = 0u; r < N; r++) {\n    corr = a[r];\n}", &b, 10_000).contains("for"));
        assert_eq!(unroll_const_loops(src, &b, src.len()), src);
    }

    /// The default 8B decode shape's kernel has no loop left over its template constants.
    #[test]
    fn decode_attention_loops_are_written_out() {
        let k = AttnDecodeKernel {
            wg: 128,
            rows: 1,
            hdk: 128,
            hdv: 128,
            unroll: 4,
            subgroup_min: Some(32),
            qk_norm: false,
        };
        let src = attention_decode(&k);
        for bound in ["ROWS;", "UNROLL;", "CK;", "CV;"] {
            assert!(!src.contains(&format!("< {bound}")), "a loop over {bound} is left");
        }
        parse("attention_decode written out", &src);
    }

    #[test]
    fn attn_decode_shapes_parse() {
        assert_eq!(
            AttnDecodeShape::parse("128x64"),
            Some(AttnDecodeShape { wg: 128, split_keys: 64, unroll: 4, max_rows: 8 })
        );
        assert_eq!(
            AttnDecodeShape::parse("1024x512u8r2"),
            Some(AttnDecodeShape { wg: 1024, split_keys: 512, unroll: 8, max_rows: 2 })
        );
        assert_eq!(
            AttnDecodeShape::parse("64x16r1"),
            Some(AttnDecodeShape { wg: 64, split_keys: 16, unroll: 4, max_rows: 1 })
        );
        for bad in [
            "",
            "128",
            "128x",
            "x64",
            "96x64",
            "32x64",
            "2048x64",
            "128x8",
            "128x40",
            "128x-16",
            "128x64u3",
            "128x64u",
            "128x64r3",
            "128x64u2r",
        ] {
            assert_eq!(AttnDecodeShape::parse(bad), None, "{bad}");
        }
        for s in [
            AttnDecodeShape { wg: 256, split_keys: 128, unroll: 4, max_rows: 8 },
            AttnDecodeShape { wg: 64, split_keys: 16, unroll: 1, max_rows: 4 },
        ] {
            assert_eq!(AttnDecodeShape::parse(&s.to_string()), Some(s));
        }
    }

    /// Every GPU layout: each type's per-block one and the grouped Q4_0 and Q4_K.
    fn all_layouts() -> Vec<TypeLayout> {
        use GgmlType::*;
        let types = [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4];
        let mut v: Vec<TypeLayout> = types.iter().map(|&t| TypeLayout::of(t).unwrap()).collect();
        v.push(TypeLayout::q4_0_grouped());
        v.push(TypeLayout::q4_k_grouped());
        v
    }

    /// Multi-weight kernels rename `W[` and `fn dot32(` per weight: a dot32 file must hold that
    /// one function and nothing else that would be defined twice.
    #[test]
    fn dot32_files_define_only_dot32() {
        for l in all_layouts() {
            for src in [dot32_layout_source(&l), dot32_v4_source(&l)].into_iter().flatten() {
                assert_eq!(src.matches("fn ").count(), 1, "{}: only dot32", l.name);
                assert!(src.contains("fn dot32("), "{}", l.name);
            }
        }
        assert!(!without_fn(QUANT_COMMON, "wbyte").contains("fn wbyte("));
        assert!(without_fn(QUANT_COMMON, "wbyte").contains("fn f16lo("));
    }

    #[test]
    fn q8_shapes_parse() {
        let p = |rows, wg, tpr, unroll, pairs, vec4| Some(Q8Shape::classic(rows, wg, tpr, unroll, pairs, vec4));
        assert_eq!(Q8Shape::parse("2x64"), p(2, 64, 64, 1, false, false));
        assert_eq!(Q8Shape::parse("2x64u2pv"), p(2, 64, 64, 2, true, true));
        assert_eq!(Q8Shape::parse("1x256t8p"), p(1, 256, 8, 1, true, false));
        assert_eq!(Q8Shape::parse("1x256t8u2"), p(1, 256, 8, 2, false, false));
        assert_eq!(Q8Shape::parse("4x128u4v"), p(4, 128, 128, 4, false, true));
        let persistent = Q8Shape::parse("1x256u2sv").unwrap();
        assert!(persistent.persistent && persistent.vec4 && persistent.unroll == 2);
        assert_eq!(persistent.rows_per_group(), 1);
        assert_eq!(persistent.dispatch_groups(4), 1);
        assert_eq!(persistent.dispatch_groups(32768), persistent_groups());
        assert_eq!(Q8Shape::parse("1x64t8").unwrap().dispatch_groups(32768), 32768);
        for bad in [
            "", "2", "2x", "2x63", "0x64", "1x64t128", "1x64u3", "1x64t3", "9x64", "2x64vp", "2x64pp", "2x64pu2",
            "2x64ps", "2x64vs",
        ] {
            assert_eq!(Q8Shape::parse(bad), None, "{bad}");
        }
        for s in Q8Shape::TESTED {
            assert_eq!(Q8Shape::parse(&s.to_string()), Some(s));
        }
    }

    #[test]
    fn tiled_kernel_tile_matches_the_dispatch() {
        assert!(MATMUL_TILED.contains(&format!("const TR: u32 = {TILE_ROWS}u;")));
        assert!(MATMUL_TILED.contains(&format!("const TT: u32 = {TILE_TOKENS}u;")));
    }

    #[test]
    fn shader_block_constants_match_layouts() {
        for l in all_layouts() {
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
