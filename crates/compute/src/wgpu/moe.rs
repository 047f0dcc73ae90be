//! The decode MoE kernels: every (token, expert) pair of a step in two dispatches, whatever k is.
//!
//! `moe_gate_up.wgsl` computes the gate and up rows of all pairs and applies the gated activation;
//! `moe_down.wgsl` computes the down rows, weights them by the router and sums each token's experts
//! in one workgroup (deterministic, no atomics, no zero-fill). Before, each selected expert cost a
//! gather, two products, bias adds, a GLU, a down product and a scatter-add (about seven dispatches,
//! ~40 per MoE layer of a top-8 model), at ~8 us of host time each on the H200.
//!
//! Where an expert's matrices are is a table of one `[expert, gate word, up word, down word]`
//! entry per pair: words of the buffers bound as the gate, up and down weights (a slot of the
//! expert pool, or the expert's block of a resident stacked weight). When the host routed, the table
//! travels in the dispatch parameters ([`PairTable::Host`]); when the GPU routed a resident model,
//! the kernels read the ids its router wrote beside the weights and compute the entries from the
//! stacks' words per expert ([`PairTable::Gpu`]): the host never sees the ids.
//!
//! Design choices and their reasons:
//! - The weight types' `dq8`/`dot8` read a buffer named `W`; the gate/up kernel needs two weight
//!   buffers (a resident model keeps gate and up in separate tensors, possibly of different types),
//!   so the up type's code is a second copy with its names renamed (`W` to `WU`, each declared name
//!   suffixed `_u`): no per-load branch, and any pair of types.
//! - Per pair, not per expert: at decode an expert serves one token, so grouping saves nothing.
//!   Prefill (many tokens per expert) keeps the grouped per-expert path, which reads each expert's
//!   weights once per batch.
//! - A pair whose expert the CPU computes (the tier's hybrid misses) has the entry `SKIP`: its
//!   workgroups return at once and the down kernel leaves it out of the sum.
//! - With int8 activations (`MatmulMode::QuantizedActivations`) the pairs go through
//!   `moe_gate_up_q8.wgsl` / `moe_down_q8.wgsl` instead ([`MoeQ8Shape`]): the weight types' int8
//!   `dot32`, x quantized inside each gate/up workgroup, h passed to down as int8 blocks, and
//!   down's (expert, block) items spread over a row slot's lanes. The f32 kernels (about 300 and
//!   175 GB/s on the H200) stay for exact mode, float weights and widths that are not whole
//!   32-value blocks. A prefill's per-expert calls (`expert_pairs_q8` in experts.rs) use them too,
//!   each token a pair of weight 1.

use super::layout::TypeLayout;
use super::shaders::I8_COMMON;
use super::{act_code, grid, WgpuBackend, WgpuTensor};
use crate::backend::Routing;
use crate::error::OpError;
use crate::spec::{Gating, MoeSpec, RouteSpec};

const QUANT_COMMON: &str = include_str!("shaders/quant/common.wgsl");
const GATE_UP: &str = include_str!("shaders/moe_gate_up.wgsl");
const DOWN: &str = include_str!("shaders/moe_down.wgsl");
const ACT: &str = include_str!("shaders/act.wgsl");
const ROUTE: &str = include_str!("shaders/moe_route.wgsl");

/// The routing kernel (`moe_route.wgsl`), with the router's product of the one token in it
/// (`router`: the shader's `//R ` lines), the FFN norm of its input in that (`norm`, with
/// `router`: `//F `) and the split's hand-over (`signal`: `//S `, and `//X ` or with the norm
/// `//Y `).
pub(super) fn route_source(router: bool, signal: bool, norm: bool) -> String {
    route_source_with(router, signal, norm, false)
}

/// [`route_source`], or with `guess` its guess variant (`//G ` lines: the next layer's router
/// and the prefetch's pick; only with the router and the hand-over): the next router GW and the
/// slot table GS bound after D.
pub(super) fn route_source_with(router: bool, signal: bool, norm: bool, guess: bool) -> String {
    let norm = norm && router;
    let guess = guess && router && signal;
    // Bindings: L, B, OUT; the router's W, XR, CNT; the norm's NW; the hand-over's X (not with
    // the norm, which writes the row it norms) and D; then the uniform, which the back end binds
    // after the buffers.
    let x_binding = 3 + if router { 3 } else { 0 } + usize::from(norm);
    let d_binding = x_binding + usize::from(!norm);
    let p_binding = match (signal, guess) {
        (true, true) => d_binding + 3,
        (true, false) => d_binding + 1,
        (false, _) => x_binding,
    };
    let (l_decl, entry, logit) = if router {
        (
            "@group(0) @binding(0) var<storage, read_write> L: array<atomic<u32>>;",
            "    router_rows(wid.x + wid.y * nwg.x, nwg.x * nwg.y, lid);\n    if (workgroupUniformLoad(&is_last) == 0u) {\n        return;\n    }\n    let t = 0u;",
            "bitcast<f32>(atomicLoad(&L[base + e]))",
        )
    } else {
        (
            "@group(0) @binding(0) var<storage, read> L: array<f32>;",
            "    let t = wid.x + wid.y * nwg.x;\n    if (t >= P.n_tok) {\n        return;\n    }",
            "L[base + e]",
        )
    };
    let mut src = ROUTE
        .replace("{{L_DECL}}", l_decl)
        .replace("{{ROUTE_ENTRY}}", entry)
        .replace("{{LOGIT}}", logit)
        .replace("{{ROUTER_X}}", if norm { "XR[i] * inv_rms * NW[i]" } else { "XR[i]" })
        .replace("{{X_BINDING}}", &x_binding.to_string())
        .replace("{{D_BINDING}}", &d_binding.to_string())
        .replace("{{GW_BINDING}}", &(d_binding + 1).to_string())
        .replace("{{GS_BINDING}}", &(d_binding + 2).to_string())
        .replace("{{ROUTER_ROWS}}", if guess { "2u * P.n_expert" } else { "P.n_expert" })
        .replace("{{P_BINDING}}", &p_binding.to_string());
    for (mark, on) in [
        ("//R", router),
        ("//F", norm),
        ("//S", signal),
        ("//X", signal && !norm),
        ("//Y", signal && norm),
        ("//G", guess),
    ] {
        if on {
            src = src.replace(&format!("{mark} "), "").replace(&format!("{mark}\n"), "\n");
        }
    }
    src
}

/// The pipeline key of [`route_source`]'s variant.
fn route_key(router: bool, signal: bool, norm: bool) -> &'static str {
    match (router, signal, norm && router) {
        (false, false, _) => "moe_route",
        (false, true, _) => "moe_route_signal",
        (true, false, false) => "moe_router_route",
        (true, true, false) => "moe_router_route_signal",
        (true, false, true) => "moe_norm_router_route",
        (true, true, true) => "moe_norm_router_route_signal",
    }
}

/// The pending routing kernel's dispatch, as [`WgpuBackend::amend_pending_route`] lends it.
struct PendingRoute<'a> {
    pipeline: &'a mut std::sync::Arc<wgpu::ComputePipeline>,
    buffers: &'a mut Vec<wgpu::Buffer>,
    /// Its `Params` words, little-endian.
    params: &'a mut [u8],
    groups: &'a mut [u32; 3],
}

impl PendingRoute<'_> {
    fn word(&self, i: usize) -> u32 {
        u32::from_le_bytes(self.params[4 * i..4 * i + 4].try_into().expect("4 bytes"))
    }

    /// Writes `values` from word `first` on.
    fn set_words(&mut self, first: usize, values: &[u32]) {
        for (i, v) in values.iter().enumerate() {
            self.params[4 * (first + i)..4 * (first + i + 1)].copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// The pipeline key of [`route_source_with`]'s guess variant.
fn route_guess_key(norm: bool) -> &'static str {
    if norm {
        "moe_norm_router_route_signal_guess"
    } else {
        "moe_router_route_signal_guess"
    }
}

/// Where the routing kernel is among the pending commands: the last one, or the one before the
/// norm whose input it took (`take_norm_for_router`).
fn pending_route_at(cmds: &[super::Cmd], norm_after_route: Option<usize>) -> Option<usize> {
    match cmds.len().checked_sub(1)? {
        last if norm_after_route == Some(last) && last > 0 => Some(last - 1),
        last => Some(last),
    }
}

/// Router rows per workgroup of the router variant (its `RPW`).
const ROUTER_ROWS_PER_GROUP: usize = 4;

/// Words of the routing kernel's `Params`.
const ROUTE_PARAM_WORDS: usize = 24;
const GATE_UP_Q8: &str = include_str!("shaders/moe_gate_up_q8.wgsl");
const DOWN_Q8: &str = include_str!("shaders/moe_down_q8.wgsl");
/// The parameters the f32 and int8 kernels of each half share (`{{PARAMS}}` in their templates;
/// `moe_pairs` writes their words).
const GATE_UP_PARAMS: &str = include_str!("shaders/moe_gate_up_params.wgsl");
const DOWN_PARAMS: &str = include_str!("shaders/moe_down_params.wgsl");

/// Experts per layer, experts per token and groups up to which `moe_route.wgsl` routes (its
/// shared arrays); past them the host routes.
const ROUTE_MAX_EXPERTS: usize = 512;
const ROUTE_MAX_K: usize = 16;
const ROUTE_MAX_GROUPS: usize = 256;

/// A routing's ids on the host and its weights on the GPU: what the grouped and tiered paths
/// read (the ids of a GPU-routed [`Routing`] read back first).
pub(super) struct RouteView<'a> {
    /// Expert ids `[n_tokens, k]`.
    pub(super) ids: &'a [u32],
    /// Weights `[n_tokens, k]`.
    pub(super) weights: &'a WgpuTensor,
    /// Experts per token.
    pub(super) k: usize,
}

/// Pairs (tokens x k) the host-built table holds: the parameters carry it as a uniform array.
pub(super) const MAX_HOST_PAIRS: usize = 64;

/// Tokens up to which `moe_ffn` takes the per-pair kernels; more go through the grouped path.
pub(super) const MAX_FUSED_TOKENS: usize = 4;

/// The table entry of a pair that the GPU leaves out (the CPU computes that expert).
pub(super) const SKIP: u32 = u32::MAX;

/// Where the per-pair table comes from.
pub(super) enum PairTable<'a> {
    /// Built on the host, one `[expert, gate word, up word, down word]` per pair (t-major).
    Host(Vec<[u32; 4]>),
    /// The expert ids the GPU router wrote into `buffer` from its word `at` on (t-major), and
    /// the words per expert of the resident stacks (gate, up, down): pair p's entry is
    /// `[e, e * strides[0], e * strides[1], e * strides[2]]`.
    Gpu {
        /// The buffer holding the ids.
        buffer: &'a wgpu::Buffer,
        /// Word of the first id.
        at: u32,
        /// Words per expert of the gate, up and down stacks.
        strides: [u32; 3],
    },
    /// The expert ids in `ids` from word `at` on (t-major), each looked up in the expert tier's
    /// table `slots` from entry `slots_at` on: `[where, gate word, up word, down word]` per
    /// expert of the layer, `where` 1 when the expert is read from host memory
    /// ([`FusedMats::host`]), 0 when it holds a slot of the pool.
    Slots {
        /// The buffer holding the ids.
        ids: &'a wgpu::Buffer,
        /// Word of the first id.
        at: u32,
        /// The tier's table of `vec4<u32>` entries.
        slots: &'a wgpu::Buffer,
        /// Entry of the layer's expert 0.
        slots_at: u32,
    },
}

/// Which table code a kernel is built with (see [`PairTable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TableKind {
    /// In the parameters.
    Host,
    /// From GPU-routed ids and stack strides.
    Gpu,
    /// From GPU-routed ids and the tier's slot table, with a host-memory copy of the products.
    Slots,
}

impl PairTable<'_> {
    fn kind(&self) -> TableKind {
        match self {
            PairTable::Host(_) => TableKind::Host,
            PairTable::Gpu { .. } => TableKind::Gpu,
            PairTable::Slots { .. } => TableKind::Slots,
        }
    }
}

/// The buffers and types of a layer's expert matrices, as the kernels bind them.
pub(super) struct FusedMats<'a> {
    /// Gate weights (absent for ungated experts).
    pub(super) gate: Option<(&'a wgpu::Buffer, TypeLayout)>,
    /// Up weights.
    pub(super) up: (&'a wgpu::Buffer, TypeLayout),
    /// Down weights.
    pub(super) down: (&'a wgpu::Buffer, TypeLayout),
    /// The host-memory buffer holding the layer's experts, same types (with [`PairTable::Slots`]).
    pub(super) host: Option<&'a wgpu::Buffer>,
}

/// Rows per workgroup and invocations of both kernels: `DISKFORMER_MOE_MATVEC=ROWSxWG` for
/// experiments, else one row per 64 invocations (the decode matvec's best in whole-model runs).
fn kernel_shape() -> (u32, u32) {
    std::env::var("DISKFORMER_MOE_MATVEC")
        .ok()
        .and_then(|v| {
            let (rows, wg) = v.split_once('x')?;
            let (rows, wg): (u32, u32) = (rows.parse().ok()?, wg.parse().ok()?);
            ((1..=8).contains(&rows) && wg.is_power_of_two() && (32..=256).contains(&wg)).then_some((rows, wg))
        })
        .unwrap_or((1, 64))
}

/// `src` with every identifier of `names` (whole words only) given `suffix`, and `W` renamed
/// to `w_name`.
fn rename(src: &str, names: &[String], suffix: &str, w_name: &str) -> String {
    let mut out = String::with_capacity(src.len() + 256);
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word == "W" {
            out.push_str(w_name);
        } else if names.iter().any(|n| n == word) {
            out.push_str(word);
            out.push_str(suffix);
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in src.chars() {
        if c.is_ascii_alphanumeric() || c == '_' || (!word.is_empty() && c.is_ascii_digit()) {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// Names declared at module scope (`fn`, `const`, `struct`, `alias`, `var`) in WGSL source.
fn declared_names(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in src.lines() {
        let mut line = line.trim_start();
        // `var<private> NAME`: the address space is not the name.
        if let Some(rest) = line.strip_prefix("var<").and_then(|r| r.split_once('>')) {
            line = rest.1;
        }
        for kw in ["fn ", "const ", "struct ", "alias ", " "] {
            if let Some(rest) = line.strip_prefix(kw) {
                let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                if !name.is_empty() && !names.contains(&name) {
                    names.push(name);
                }
            }
        }
    }
    names
}

/// A weight type's helpers (`dq8`, and `dot8` made from it when the type has none), reading `W`;
/// with `suffix`, a copy whose names carry it and which reads `w_name` instead.
fn quant_code(layout: &TypeLayout, suffix: Option<(&str, &str)>) -> String {
    let dot8 = if layout.shader.contains("fn dot8(") {
        ""
    } else {
        "fn dot8(b: u32, j: u32, xa: vec4<f32>, xc: vec4<f32>, xsum: f32) -> f32 {
    let v = dq8(b, j);
    return dot(v.a, xa) + dot(v.b, xc);
}"
    };
    let src = format!("{QUANT_COMMON}\n{}\n{dot8}\n", layout.shader);
    match suffix {
        None => src,
        Some((suffix, w_name)) => rename(&src, &declared_names(&src), suffix, w_name),
    }
}

const REDUCE_SUBGROUP: &str = "    for (var r = 0u; r < NV; r++) {
        let s = subgroupAdd(acc[r]);
        if (sg_lane == 0u) {
            red[r * WG + sg_id] = s;
        }
    }
    workgroupBarrier();
    if (lid < NV) {
        var s = 0.0;
        for (var i = 0u; i < n_sg; i++) {
            s += red[lid * WG + i];
        }
        tot[lid] = s;
    }
    workgroupBarrier();";

const REDUCE_SHARED: &str = "    for (var r = 0u; r < NV; r++) {
        red[r * WG + lid] = acc[r];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            for (var r = 0u; r < NV; r++) {
                red[r * WG + lid] += red[r * WG + lid + s];
            }
        }
        workgroupBarrier();
    }
    if (lid < NV) {
        tot[lid] = red[lid * WG];
    }
    workgroupBarrier();";

const SG_ARGS: &str =
    "@builtin(subgroup_id) sg_id: u32,\n    @builtin(subgroup_invocation_id) sg_lane: u32,\n    @builtin(num_subgroups) n_sg: u32,";

/// The parts of a kernel that depend on where its table comes from: the params field, the
/// table bindings (from `t_binding`, the first after the kernel's own) with `entry()` and
/// `in_host()`, and the uniform's binding index.
fn table_parts(kind: TableKind, t_binding: u32) -> (String, String, u32) {
    match kind {
        TableKind::Gpu => (
            String::new(),
            format!(
                "@group(0) @binding({t_binding}) var<storage, read> T: array<u32>;\n\
                 fn entry(p: u32) -> vec4<u32> {{\n    let e = T[P.table_at + p];\n    \
                 return vec4<u32>(e, e * P.stride_g, e * P.stride_u, e * P.stride_d);\n}}"
            ),
            t_binding + 1,
        ),
        TableKind::Slots => (
            String::new(),
            format!(
                "@group(0) @binding({t_binding}) var<storage, read> T: array<u32>;\n\
                 @group(0) @binding({}) var<storage, read> S: array<vec4<u32>>;\n\
                 @group(0) @binding({}) var<storage, read> WH: array<u32>;\n\
                 fn entry(p: u32) -> vec4<u32> {{\n    let e = T[P.table_at + p];\n    \
                 if (e == {SKIP}u) {{\n        return vec4<u32>(e, 0u, 0u, 0u);\n    }}\n    \
                 let s = S[P.slots_at + e];\n    return vec4<u32>(e, s.y, s.z, s.w);\n}}\n\
                 fn in_host(p: u32) -> bool {{\n    let e = T[P.table_at + p];\n    \
                 return e != {SKIP}u && S[P.slots_at + e].x == 1u;\n}}",
                t_binding + 1,
                t_binding + 2
            ),
            t_binding + 3,
        ),
        TableKind::Host => (
            format!("    table: array<vec4<u32>, {MAX_HOST_PAIRS}>,"),
            "fn entry(p: u32) -> vec4<u32> {\n    return P.table[p];\n}".into(),
            t_binding,
        ),
    }
}

/// The function `name` of a kernel template (from `fn name(` to its closing brace at the start
/// of a line), renamed `name_h` and calling `dot8_h`/`dot8_uh` (the host-memory copies of the
/// weight types' code) instead of `dot8`/`dot8_u`.
fn host_copy(template: &str, name: &str) -> String {
    host_copy_calling(template, name, &[("dot8_u(", "dot8_uh("), ("dot8(", "dot8_h(")])
}

/// The function `name` of a kernel template renamed `name_h`, with the calls in `calls`
/// (`(from, to)`, applied in order) replaced.
fn host_copy_calling(template: &str, name: &str, calls: &[(&str, &str)]) -> String {
    let start = template.find(&format!("fn {name}(")).expect("the kernel template defines the function");
    let len = template[start..].find("\n}\n").expect("the function ends with a brace at the start of a line") + 2;
    let mut f = template[start..start + len].replace(&format!("fn {name}("), &format!("fn {name}_h("));
    for (from, to) in calls {
        f = f.replace(from, to);
    }
    f
}

/// Common template substitutions of both kernels.
fn finish(src: &str, (rows, wg): (u32, u32), nv: u32, subgroups: bool, kind: TableKind, t_binding: u32) -> String {
    let (field, table, p_binding) = table_parts(kind, t_binding);
    src.replace("{{TABLE_FIELD}}", &field)
        .replace("{{TABLE}}", &table)
        .replace("{{P_BINDING}}", &p_binding.to_string())
        .replace("{{WG}}", &wg.to_string())
        .replace("{{ROWS}}", &rows.to_string())
        .replace("{{NV}}", &nv.to_string())
        .replace("{{RED_LEN}}", &(nv * wg).to_string())
        .replace("{{REDUCE}}", if subgroups { REDUCE_SUBGROUP } else { REDUCE_SHARED })
        .replace("{{SG_ARGS}}", if subgroups { SG_ARGS } else { "" })
        .replace("{{SKIP}}", &format!("{SKIP}u"))
}

/// The gate/up kernel for these weight types (`gate` `None`: ungated experts).
pub(super) fn gate_up_source(
    gate: Option<&TypeLayout>,
    up: &TypeLayout,
    shape: (u32, u32),
    subgroups: bool,
    kind: TableKind,
) -> String {
    let gate_code = gate.unwrap_or(up);
    let (products, products_h) = if kind == TableKind::Slots {
        (
            "    var acc: array<f32, NV>;\n    if (in_host(pair)) {\n        acc = products_h(ent, xb, row0, lid);\n    } \
             else {\n        acc = products(ent, xb, row0, lid);\n    }"
                .to_string(),
            format!(
                "{}\n{}\n{}",
                quant_code(gate_code, Some(("_h", "WH"))),
                quant_code(up, Some(("_uh", "WH"))),
                host_copy(GATE_UP, "products")
            ),
        )
    } else {
        ("    var acc = products(ent, xb, row0, lid);".to_string(), String::new())
    };
    let src = GATE_UP
        .replace("{{PARAMS}}", GATE_UP_PARAMS)
        .replace("{{QUANT_G}}", &quant_code(gate_code, None))
        .replace("{{QUANT_U}}", &quant_code(up, Some(("_u", "WU"))))
        .replace("{{ACT}}", ACT)
        .replace("{{PRODUCTS_H}}", &products_h)
        .replace("{{PRODUCTS}}", &products)
        .replace("{{GATED}}", if gate.is_some() { "true" } else { "false" });
    finish(&src, shape, 2 * shape.0, subgroups, kind, 6)
}

/// The down kernel for this weight type.
pub(super) fn down_source(down: &TypeLayout, shape: (u32, u32), subgroups: bool, kind: TableKind) -> String {
    let (rows, rows_h) = if kind == TableKind::Slots {
        (
            "        if (in_host(pair)) {\n            acc = down_rows_h(acc, ent, w, hb, row0, lid);\n        } else {\n            \
             acc = down_rows(acc, ent, w, hb, row0, lid);\n        }"
                .to_string(),
            format!("{}\n{}", quant_code(down, Some(("_h", "WH"))), host_copy(DOWN, "down_rows")),
        )
    } else {
        ("        acc = down_rows(acc, ent, w, hb, row0, lid);".to_string(), String::new())
    };
    let src = DOWN
        .replace("{{PARAMS}}", DOWN_PARAMS)
        .replace("{{QUANT}}", &quant_code(down, None))
        .replace("{{DOWN_ROWS_H}}", &rows_h)
        .replace("{{DOWN_ROWS}}", &rows);
    finish(&src, shape, shape.0, subgroups, kind, 5)
}

/// The workgroup shape of an int8 MoE kernel: `wg` invocations in row slots of `tpr` lanes, each
/// slot holding `rows` rows in registers (a workgroup covers `rows * wg / tpr` rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MoeQ8Shape {
    /// Rows per slot.
    pub(super) rows: u32,
    /// Invocations per workgroup.
    pub(super) wg: u32,
    /// Lanes per row slot.
    pub(super) tpr: u32,
}

impl MoeQ8Shape {
    /// Rows a workgroup covers.
    pub(super) fn rows_per_group(self) -> u32 {
        self.rows * (self.wg / self.tpr)
    }

    /// Whether the kernels can be built with it: rows 1..=8, `wg` a power of two in 32..=256,
    /// `tpr` a power of two from `rows` to `wg` (so a workgroup's rows are at most its
    /// invocations, one per row in the epilogue).
    fn is_valid(self) -> bool {
        (1..=8).contains(&self.rows)
            && self.wg.is_power_of_two()
            && (32..=256).contains(&self.wg)
            && self.tpr.is_power_of_two()
            && self.tpr <= self.wg
            && self.rows <= self.tpr
    }

    /// `ROWSxWG[tTPR]` (`tpr` defaults to `wg`), e.g. `1x256t8`; `None` when malformed or invalid.
    pub(super) fn parse(s: &str) -> Option<MoeQ8Shape> {
        let (rows, rest) = s.split_once('x')?;
        let (wg, tpr) = match rest.split_once('t') {
            Some((w, t)) => (w.parse().ok()?, t.parse().ok()?),
            None => {
                let w = rest.parse().ok()?;
                (w, w)
            }
        };
        let shape = MoeQ8Shape { rows: rows.parse().ok()?, wg, tpr };
        shape.is_valid().then_some(shape)
    }

    /// Partial sums per row that one invocation adds in the end, after the tree steps halved
    /// the TPR down to this many.
    fn serial(self) -> u32 {
        self.tpr.min(8)
    }
}

impl std::fmt::Display for MoeQ8Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.rows, self.wg)?;
        if self.tpr != self.wg {
            write!(f, "t{}", self.tpr)?;
        }
        Ok(())
    }
}

/// Shapes of the int8 gate/up and down kernels: `DISKFORMER_MOE_Q8_GATE_UP` and
/// `DISKFORMER_MOE_Q8_DOWN` (`ROWSxWG[tTPR]`) for experiments on the device, else for gate/up 32
/// rows per 256-invocation workgroup in 8 slots of 4 rows, 32 lanes a row (`4x256t32`: whole
/// 32-row blocks of h per workgroup, which its epilogue quantizes), and 2 rows per 64 lanes for
/// down (the dense plain products' default). A gate/up shape whose rows are not whole 32-row
/// blocks is ignored.
///
/// Why `4x256t32` (eleventh session, H200, Qwen3-30B-A3B Q4_K, profiled decode): resident
/// gate/up 44.0 us against 62.3 for the former `1x256t8` (8 lanes a row, each lane's loop 8
/// blocks long with few loads in flight), and over host memory at `--gpu-budget 4G` 287 us
/// against 328 (tok/s 34.4/34.3 against 30.8/33.6 in two alternating rounds); `8x256t64` read
/// host memory a little faster (282 us) but took 65.5 us resident. Down measured 143-166 us at
/// 4G whatever its shape (`1x64`, `2x64`, `4x64`, `2x128`, `1x256t8`).
/// When a token has few down items (`k × n_ff / 32`: one expert per token in a prefill's
/// per-expert calls, 24 items of a 768-wide row), 64 lanes per row would idle: below 128 items
/// the down kernel takes the gate/up shape (8 lanes a row) instead.
fn q8_shapes(down_items: usize) -> (MoeQ8Shape, MoeQ8Shape) {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| MoeQ8Shape::parse(&v));
    let narrow = MoeQ8Shape { rows: 1, wg: 256, tpr: 8 };
    let slots_of_four = MoeQ8Shape { rows: 4, wg: 256, tpr: 32 };
    let gate_up =
        env("DISKFORMER_MOE_Q8_GATE_UP").filter(|s| s.rows_per_group().is_multiple_of(32)).unwrap_or(slots_of_four);
    let wide = MoeQ8Shape { rows: 2, wg: 64, tpr: 64 };
    let down = env("DISKFORMER_MOE_Q8_DOWN").unwrap_or(if down_items < 128 { narrow } else { wide });
    (gate_up, down)
}

/// Most experts per token of the int8 down kernel (its workgroup copy of the pairs' entries).
const Q8_MAX_K: usize = 64;

/// A weight type's int8 `dot32` reading `w_name` instead of `W`, named `dot32{suffix}`, after its
/// block constants `QBV{consts}` / `QBW{consts}` (`consts` `None`: none); `None` when the type has
/// no int8 kernel.
fn dot32_code(layout: &TypeLayout, suffix: &str, w_name: &str, consts: Option<&str>) -> Option<String> {
    let src = super::shaders::dot32_layout_source(layout)?;
    let f = src.replace("W[", &format!("{w_name}[")).replace("fn dot32(", &format!("fn dot32{suffix}("));
    Some(match consts {
        Some(c) => format!(
            "const QBV{c}: u32 = {}u;\nconst QBW{c}: u32 = {}u;\n{f}",
            layout.block_values,
            layout.block_words()
        ),
        None => f,
    })
}

/// The reduction of the int8 kernels' row slots: `acc[r]` (r < `nv`) of slot `slot`, lane `lane`
/// goes to `tot[index(r)]` (`n_tot` entries): each slot's TPR partial sums side by side, halved by
/// a tree down to SERIAL per row, which one invocation per row adds.
fn slot_reduce(nv: &str, index: &str, n_tot: &str) -> String {
    format!(
        "    for (var r = 0u; r < {nv}; r++) {{
        red[({index}) * TPR + lane] = acc[r];
    }}
    workgroupBarrier();
    for (var h = TPR / 2u; h >= SERIAL; h >>= 1u) {{
        if (lane < h) {{
            for (var r = 0u; r < {nv}; r++) {{
                let i = ({index}) * TPR + lane;
                red[i] += red[i + h];
            }}
        }}
        workgroupBarrier();
    }}
    for (var i = lid; i < {n_tot}; i += WG) {{
        var s = 0.0;
        for (var c = 0u; c < SERIAL; c++) {{
            s += red[i * TPR + c];
        }}
        tot[i] = s;
    }}
    workgroupBarrier();"
    )
}

/// One activation block `q`'s gate and up terms in `moe_gate_up_q8.wgsl`'s `products`.
const GATE_UP_Q8_BLOCK: &str = "        let x0 = xq[2u * q];
        let x1 = xq[2u * q + 1u];
        let d = xd[q];
        if (GATED) {
            let bo = (q / (QBV_G / 32u)) * QBW_G;
            let j = q % (QBV_G / 32u);
            for (var r = 0u; r < ROWS; r++) {
                acc[r] += dot32(rg[r] + bo, j, x0, x1, d);
            }
        }
        let bou = (q / (QBV_U / 32u)) * QBW_U;
        let ju = q % (QBV_U / 32u);
        for (var r = 0u; r < ROWS; r++) {
            acc[ROWS + r] += dot32_u(ru[r] + bou, ju, x0, x1, d);
        }";

/// The int8 gate/up kernel (`moe_gate_up_q8.wgsl`) for these weight types and `n_embd` (a
/// multiple of 32); `None` when a type has no int8 kernel.
pub(super) fn gate_up_q8_source(
    gate: Option<&TypeLayout>,
    up: &TypeLayout,
    n_embd: usize,
    shape: MoeQ8Shape,
    kind: TableKind,
) -> Option<String> {
    let g = gate.unwrap_or(up);
    let template = GATE_UP_Q8.replace("{{BLOCK}}", GATE_UP_Q8_BLOCK).replace("{{PARAMS}}", GATE_UP_PARAMS);
    let mut quant = format!(
        "{QUANT_COMMON}\n{I8_COMMON}\n{}\n{}\n",
        dot32_code(g, "", "W", Some("_G"))?,
        dot32_code(up, "_u", "WU", Some("_U"))?
    );
    let (products, products_h) = if kind == TableKind::Slots {
        quant += &format!("{}\n{}\n", dot32_code(g, "_h", "WH", None)?, dot32_code(up, "_uh", "WH", None)?);
        (
            "    var acc: array<f32, {{NV}}>;\n    if (in_host(pair)) {\n        acc = products_h(ent, row0, lane);\n    } \
             else {\n        acc = products(ent, row0, lane);\n    }"
                .to_string(),
            host_copy_calling(&template, "products", &[("dot32_u(", "dot32_uh("), ("dot32(", "dot32_h(")]),
        )
    } else {
        ("    var acc = products(ent, row0, lane);".to_string(), String::new())
    };
    let nb_x = n_embd / 32;
    let rpw = shape.rows_per_group();
    let (field, table, p_binding) = table_parts(kind, 7);
    Some(
        template
            .replace("{{QUANT}}", &quant)
            .replace("{{ACT}}", ACT)
            .replace("{{Q8_ROWS}}", super::shaders::Q8_ROWS)
            .replace("{{PRODUCTS_H}}", &products_h)
            .replace("{{PRODUCTS}}", &products)
            .replace("{{REDUCE}}", &slot_reduce("2u * ROWS", "(r / ROWS) * RPW + slot * ROWS + r % ROWS", "2u * RPW"))
            .replace("{{GATED}}", if gate.is_some() { "true" } else { "false" })
            .replace("{{TABLE_FIELD}}", &field)
            .replace("{{TABLE}}", &table)
            .replace("{{P_BINDING}}", &p_binding.to_string())
            .replace("{{WG}}", &shape.wg.to_string())
            .replace("{{TPR}}", &shape.tpr.to_string())
            .replace("{{ROWS}}", &shape.rows.to_string())
            .replace("{{SERIAL}}", &shape.serial().to_string())
            .replace("{{NB_X}}", &nb_x.to_string())
            .replace("{{XQ_LEN}}", &(2 * nb_x).to_string())
            .replace("{{NV}}", &(2 * shape.rows).to_string())
            .replace("{{RED_LEN}}", &(2 * shape.rows * shape.wg).to_string())
            .replace("{{TOT_LEN}}", &(2 * rpw).to_string())
            .replace("{{RPW}}", &rpw.to_string())
            .replace("{{SG_ARGS}}", "")
            .replace("{{SKIP}}", &format!("{SKIP}u")),
    )
}

/// Item `q` (expert `q / NB_H`, block `q % NB_H`) of a row in `moe_down_q8.wgsl`; `{{ITEM}}` adds
/// its terms to `acc`.
const DOWN_Q8_ITEM: &str = "        let j = q / NB_H;
        let b = q % NB_H;
        let ent = ents[j];
        if (ent.x != SKIP) {
            let hb = (p0 + j) * NB_H + b;
            let x0 = HQ[2u * hb];
            let x1 = HQ[2u * hb + 1u];
            let d = HD[hb];
            let w = ws[j];
            let base = ent.w + (b / (QBV / 32u)) * QBW;
            let jj = b % (QBV / 32u);
{{ITEM}}
        }";

/// The int8 down kernel (`moe_down_q8.wgsl`) for this weight type and `n_ff` (a multiple of 32);
/// `None` when the type has no int8 kernel.
pub(super) fn down_q8_source(
    down: &TypeLayout,
    n_ff: usize,
    k_top: usize,
    shape: MoeQ8Shape,
    subgroups: bool,
    kind: TableKind,
) -> Option<String> {
    let mut quant = format!("{QUANT_COMMON}\n{I8_COMMON}\n{}\n", dot32_code(down, "", "W", Some(""))?);
    let add = |f: &str| {
        format!(
            "            for (var r = 0u; r < ROWS; r++) {{\n                acc[r] += w * {f}(base + rb[r], jj, x0, x1, d);\n            }}"
        )
    };
    let (item, in_host) = if kind == TableKind::Slots {
        quant += &dot32_code(down, "_h", "WH", None)?;
        (
            format!(
                "            if (hosts[j] == 1u) {{\n{}\n            }} else {{\n{}\n            }}",
                add("dot32_h"),
                add("dot32")
            ),
            "select(0u, 1u, in_host(p0 + j))",
        )
    } else {
        (add("dot32"), "0u")
    };
    // One slot of subgroup-reduced lanes, or slots reduced through workgroup memory.
    let (reduce, sg_args, red_len) = if subgroups && shape.tpr == shape.wg {
        (
            // REDUCE_SUBGROUP over the ROWS sums of one slot.
            REDUCE_SUBGROUP.replace("NV", "ROWS"),
            SG_ARGS,
            shape.rows * shape.wg,
        )
    } else {
        (slot_reduce("ROWS", "slot * ROWS + r", "RPW"), "", shape.rows * shape.wg)
    };
    let (field, table, p_binding) = table_parts(kind, 6);
    Some(
        DOWN_Q8
            .replace("{{PARAMS}}", DOWN_PARAMS)
            .replace("{{QUANT}}", &quant)
            .replace("{{ITEM_BODY}}", &DOWN_Q8_ITEM.replace("{{ITEM}}", &item))
            .replace("{{K_TOP}}", &k_top.to_string())
            .replace("{{IN_HOST}}", in_host)
            .replace("{{REDUCE}}", &reduce)
            .replace("{{SG_ARGS}}", sg_args)
            .replace("{{TABLE_FIELD}}", &field)
            .replace("{{TABLE}}", &table)
            .replace("{{P_BINDING}}", &p_binding.to_string())
            .replace("{{WG}}", &shape.wg.to_string())
            .replace("{{TPR}}", &shape.tpr.to_string())
            .replace("{{ROWS}}", &shape.rows.to_string())
            .replace("{{SERIAL}}", &shape.serial().to_string())
            .replace("{{NB_H}}", &(n_ff / 32).to_string())
            .replace("{{MAX_K}}", &Q8_MAX_K.to_string())
            .replace("{{RED_LEN}}", &red_len.to_string())
            .replace("{{RPW}}", &shape.rows_per_group().to_string())
            .replace("{{SKIP}}", &format!("{SKIP}u")),
    )
}

impl WgpuBackend {
    /// Σ_j w_tj · down_e(glu(gate_e(x_t), up_e(x_t))) for the `n_tok` tokens of `x` and their `k`
    /// experts each, in two dispatches: the per-pair kernels of this module. `weights` holds the
    /// routing weights (t-major) from its f32 element `weights_at` on; `table` says where each
    /// pair's matrices are in `mats`' buffers.
    #[allow(clippy::too_many_arguments)] // the op's inputs, the table and where the weights are
    pub(super) fn moe_pairs(
        &self,
        x: &WgpuTensor,
        k: usize,
        table: &PairTable<'_>,
        weights: (&wgpu::Buffer, u32),
        mats: &FusedMats<'_>,
        biases: [Option<&WgpuTensor>; 3],
        spec: &MoeSpec,
    ) -> Result<WgpuTensor, OpError> {
        let n_tok = x.rows();
        let n_embd = x.width();
        let ff = spec.n_ff;
        let n_pairs = n_tok * k;
        if let PairTable::Host(t) = table {
            if t.len() != n_pairs || n_pairs > MAX_HOST_PAIRS {
                return Err(OpError::ShapeMismatch {
                    op: "moe_ffn pairs",
                    expected: format!("{n_pairs} table entries, at most {MAX_HOST_PAIRS}"),
                    got: vec![t.len()],
                });
            }
        }
        let shape = kernel_shape();
        let sg = self.ctx.subgroups;
        let kind = table.kind();
        // Buffers bound after each kernel's own: the ids, then the slot table and the host copy.
        let (table_bufs, table_at, strides, slots_at): (Vec<&wgpu::Buffer>, u32, [u32; 3], u32) = match table {
            PairTable::Gpu { buffer, at, strides } => (vec![*buffer], *at, *strides, 0),
            PairTable::Slots { ids, at, slots, slots_at } => {
                let host = mats.host.ok_or_else(|| OpError::Unsupported {
                    op: "moe_ffn pairs",
                    backend: "wgpu",
                    why: "a slot table without the host-memory buffer of the layer's experts".into(),
                })?;
                (vec![*ids, *slots, host], *at, [0; 3], *slots_at)
            }
            PairTable::Host(_) => (Vec::new(), 0, [0; 3], 0),
        };
        let table_words: Vec<u32> = match table {
            PairTable::Host(t) => {
                let mut w: Vec<u32> = t.iter().flatten().copied().collect();
                w.resize(4 * MAX_HOST_PAIRS, 0);
                w
            }
            PairTable::Gpu { .. } | PairTable::Slots { .. } => Vec::new(),
        };
        let (gl, ul, dl) = (mats.gate.map(|g| g.1), mats.up.1, mats.down.1);
        let (op, alpha, limit) = match mats.gate {
            Some(_) => Self::glu_code(spec.glu),
            None => (act_code(spec.glu.ungated_act()), 0.0, 0.0),
        };
        let [gate_bias, up_bias, down_bias] = biases;
        let dummy = &self.ctx.dummy;
        let mut words = vec![
            n_embd as u32,
            ff as u32,
            gl.map_or(0, |l| l.row_words(n_embd)) as u32,
            ul.row_words(n_embd) as u32,
            n_pairs as u32,
            k as u32,
            op,
            gate_bias.is_some() as u32,
            alpha.to_bits(),
            limit.to_bits(),
            up_bias.is_some() as u32,
            table_at,
            strides[0],
            strides[1],
            strides[2],
            slots_at,
        ];
        words.extend_from_slice(&table_words);
        let down_words = {
            let mut w = vec![
                ff as u32,
                n_embd as u32,
                dl.row_words(ff) as u32,
                n_tok as u32,
                k as u32,
                down_bias.is_some() as u32,
                table_at,
                weights.1,
                strides[0],
                strides[1],
                strides[2],
                slots_at,
            ];
            w.extend_from_slice(&table_words);
            w
        };
        if let Some((gs, ds)) = self.moe_q8_shapes(n_embd, ff, k, mats) {
            // int8 activations: h travels as int8 blocks from the gate/up kernel to the down kernel.
            let key = format!(
                "moe_gate_up_q8 {} {} {gs} sg{sg} {kind:?} x{n_embd}",
                gl.map_or("ungated", |l| l.name),
                ul.name
            );
            let pipe = self.ctx.pipeline_with(
                &key,
                || gate_up_q8_source(gl.as_ref(), &ul, n_embd, gs, kind).expect("moe_q8_shapes checked the types"),
                true,
            );
            let hq = self.alloc_bytes("moe hq", (n_pairs * ff) as u64)?;
            let hd = self.alloc_bytes("moe hd", (8 * n_pairs * (ff / 32)) as u64)?;
            let mut bufs: Vec<&wgpu::Buffer> = vec![
                mats.gate.map_or(mats.up.0, |g| g.0),
                mats.up.0,
                &x.buf.buffer,
                gate_bias.map_or(dummy, |b| &b.buf.buffer),
                up_bias.map_or(dummy, |b| &b.buf.buffer),
                &hq.buffer,
                &hd.buffer,
            ];
            bufs.extend(&table_bufs);
            let rpw = gs.rows_per_group() as usize;
            self.dispatch(pipe, &bufs, &words, [ff.div_ceil(rpw) as u32, n_pairs as u32, 1]);

            let key = format!("moe_down_q8 {} {ds} sg{sg} {kind:?} f{ff} k{k}", dl.name);
            let pipe = self.ctx.pipeline_with(
                &key,
                || down_q8_source(&dl, ff, k, ds, sg, kind).expect("moe_q8_shapes checked the type"),
                true,
            );
            let y = self.alloc("moe out", &[n_tok, n_embd])?;
            let mut bufs: Vec<&wgpu::Buffer> = vec![
                mats.down.0,
                &hq.buffer,
                &hd.buffer,
                weights.0,
                down_bias.map_or(dummy, |b| &b.buf.buffer),
                &y.buf.buffer,
            ];
            bufs.extend(&table_bufs);
            let rpw = ds.rows_per_group() as usize;
            self.dispatch(pipe, &bufs, &down_words, [n_embd.div_ceil(rpw) as u32, n_tok as u32, 1]);
            return Ok(y);
        }
        let key = format!(
            "moe_gate_up {} {} {}x{} sg{sg} {kind:?}",
            gl.map_or("ungated", |l| l.name),
            ul.name,
            shape.0,
            shape.1
        );
        let pipe = self.ctx.pipeline(&key, || gate_up_source(gl.as_ref(), &ul, shape, sg, kind));
        let h = self.alloc("moe h", &[n_pairs, ff])?;
        let mut bufs: Vec<&wgpu::Buffer> = vec![
            mats.gate.map_or(mats.up.0, |g| g.0),
            mats.up.0,
            &x.buf.buffer,
            gate_bias.map_or(dummy, |b| &b.buf.buffer),
            up_bias.map_or(dummy, |b| &b.buf.buffer),
            &h.buf.buffer,
        ];
        bufs.extend(&table_bufs);
        self.dispatch(pipe, &bufs, &words, [ff.div_ceil(shape.0 as usize) as u32, n_pairs as u32, 1]);

        let key = format!("moe_down {} {}x{} sg{sg} {kind:?}", dl.name, shape.0, shape.1);
        let pipe = self.ctx.pipeline(&key, || down_source(&dl, shape, sg, kind));
        let y = self.alloc("moe out", &[n_tok, n_embd])?;
        let mut bufs: Vec<&wgpu::Buffer> =
            vec![mats.down.0, &h.buf.buffer, weights.0, down_bias.map_or(dummy, |b| &b.buf.buffer), &y.buf.buffer];
        bufs.extend(&table_bufs);
        self.dispatch(pipe, &bufs, &down_words, [n_embd.div_ceil(shape.0 as usize) as u32, n_tok as u32, 1]);
        Ok(y)
    }
}

impl WgpuBackend {
    /// The shapes of the int8 MoE kernels when they serve this call: int8 activations are on
    /// ([`MatmulMode::QuantizedActivations`](crate::quant::MatmulMode)), `DISKFORMER_MOE_F32` is
    /// not set, every weight type has an int8 dot product, both widths are whole 32-value blocks,
    /// `k` fits the down kernel's table and the kernels' workgroup memory fits the device.
    /// Whether the int8 kernels serve a call of `k` experts per token on these matrices.
    pub(super) fn moe_q8_applies(&self, n_embd: usize, n_ff: usize, k: usize, mats: &FusedMats<'_>) -> bool {
        self.moe_q8_shapes(n_embd, n_ff, k, mats).is_some()
    }

    fn moe_q8_shapes(
        &self,
        n_embd: usize,
        n_ff: usize,
        k: usize,
        mats: &FusedMats<'_>,
    ) -> Option<(MoeQ8Shape, MoeQ8Shape)> {
        let types_ok = [mats.gate.map_or(mats.up.1, |g| g.1), mats.up.1, mats.down.1]
            .iter()
            .all(|l| super::shaders::dot32_source(l.dtype).is_some());
        if !self.int8_act
            || super::env_flag("DISKFORMER_MOE_F32")
            || !types_ok
            || !n_embd.is_multiple_of(32)
            || !n_ff.is_multiple_of(32)
            || k > Q8_MAX_K
        {
            return None;
        }
        let (gs, ds) = q8_shapes(k * n_ff / 32);
        // Workgroup bytes: x's blocks (n_embd + n_embd / 4), partial sums, totals and h's
        // integers; the pairs' entries, weights and flags, partial sums, totals.
        let (g_rpw, d_rpw) = (gs.rows_per_group() as usize, ds.rows_per_group() as usize);
        let gate_up_bytes = n_embd + n_embd / 4 + 4 * (2 * (gs.rows * gs.wg) as usize + 2 * g_rpw + g_rpw);
        let down_bytes = Q8_MAX_K * 24 + 4 * ((ds.rows * ds.wg) as usize + d_rpw);
        let limit = self.ctx.device.limits().max_compute_workgroup_storage_size as usize;
        (gate_up_bytes <= limit && down_bytes <= limit).then_some((gs, ds))
    }
}

impl WgpuBackend {
    /// Makes the pending dispatch of the routing kernel that wrote `routing` (one token, the
    /// last command recorded; the router's product in it or not) also hand the routing and `x`
    /// over through the mailbox `mailbox` (`moe_route.wgsl`'s hand-over variant): the words
    /// `mailbox_signal.wgsl` would take. False, changing nothing, when that dispatch is not the
    /// last pending command (an early submit took it, or something came between) or routes more
    /// than one token, or with `DISKFORMER_SPLIT_SIGNAL=apart`.
    pub(super) fn fuse_route_signal(
        &self,
        routing: &wgpu::Buffer,
        x: &wgpu::Buffer,
        mailbox: &wgpu::Buffer,
        [x_words, data_at, flag_at, seq]: [u32; 4],
    ) -> bool {
        static APART: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *APART.get_or_init(|| std::env::var("DISKFORMER_SPLIT_SIGNAL").is_ok_and(|v| v.trim() == "apart"))
            || crate::ab::is_b("signal")
        {
            return false;
        }
        self.amend_pending_route(|mut r| {
            // Which routing kernel wrote `routing`: the plain one (one workgroup), the router
            // variant (its workgroups over the router's rows) or that with the norm in it.
            let kind = [(false, false), (true, false), (true, true)].into_iter().find(|&(router, norm)| {
                let made = self.ctx.pipeline_made(route_key(router, false, norm));
                made.is_some_and(|kernel| std::sync::Arc::ptr_eq(r.pipeline, &kernel))
            });
            let Some((router, norm)) = kind else { return false };
            let one_group = *r.groups == [1, 1, 1];
            if r.buffers.get(2) != Some(routing) || (!router && !one_group) || r.word(1) != 1 {
                return false;
            }
            r.set_words(12, &[x_words, data_at, flag_at, seq]);
            *r.pipeline = self.route_pipeline(router, true, norm);
            if !norm {
                // The norm variant writes the row it norms instead of reading `x`.
                r.buffers.push(x.clone());
            }
            r.buffers.push(mailbox.clone());
            true
        })
    }

    /// The split's prefetch guess (`moe_route.wgsl`'s `//G ` lines) fused into the pending
    /// routing kernel that [`Self::fuse_route_signal`] gave the hand-over: `next_router` (the next
    /// layer's, of the same shape) on the same row in as many workgroups again, and after the
    /// flag the first `g_max` of its top k that the slot table `table` puts in host memory
    /// (from entry `g_slots_at`) written to `mailbox` at `g_at`, as
    /// `moe_split_prefetch_pick.wgsl` writes them. `false` (nothing changed) where the pending
    /// command is not that kernel, the routing has a selection bias or groups (the guess ranks
    /// logits), or the routers differ in shape.
    pub(super) fn fuse_route_guess(
        &self,
        routing: &wgpu::Buffer,
        next_router: &super::WgpuWeight,
        table: &wgpu::Buffer,
        mailbox: &wgpu::Buffer,
        [g_at, g_slots_at, g_max]: [u32; 3],
    ) -> bool {
        // Ten storage buffers: the signal variant's eight, the next router and the table.
        if next_router.layout.dtype != gguf::GgmlType::F32
            || next_router.chunks.len() != 1
            || self.ctx.device.limits().max_storage_buffers_per_shader_stage < 10
        {
            return false;
        }
        let n_expert = next_router.n_rows;
        let Ok(logits) = self.alloc_bytes("router logits and guess", 8 * n_expert as u64) else { return false };
        self.amend_pending_route(|mut r| {
            let norm = [false, true].into_iter().find(|&norm| {
                let made = self.ctx.pipeline_made(route_key(true, true, norm));
                made.is_some_and(|kernel| std::sync::Arc::ptr_eq(r.pipeline, &kernel))
            });
            let Some(norm) = norm else { return false };
            if r.buffers.get(2) != Some(routing) || r.buffers.last() != Some(mailbox) {
                return false;
            }
            let same_shape = r.word(0) as usize == n_expert
                && n_expert.is_multiple_of(ROUTER_ROWS_PER_GROUP)
                && r.word(16) as usize == next_router.k
                && r.word(17) as usize == next_router.layout.row_words(next_router.k) / 4;
            // No selection bias, no groups: the guess ranks the logits as the routing ranks its
            // scores.
            if !same_shape || r.word(4) != 0 || r.word(5) != 0 || r.groups[1] != 1 || r.groups[2] != 1 {
                return false;
            }
            let Some(doubled) = r.groups[0].checked_mul(2).filter(|&g| g <= 65535) else { return false };
            r.set_words(20, &[g_at, g_slots_at, g_max]);
            r.groups[0] = doubled;
            r.buffers[0] = logits.buffer.clone();
            r.buffers.push(next_router.chunks[0].buffer.clone());
            r.buffers.push(table.clone());
            *r.pipeline =
                self.ctx.pipeline_with(route_guess_key(norm), || route_source_with(true, true, norm, true), true);
            true
        })
    }

    /// Runs `amend` on the pending routing kernel's dispatch ([`pending_route_at`]) with its
    /// parameter words; `false` when the pending commands end otherwise or its parameters are
    /// not the routing kernel's size.
    fn amend_pending_route(&self, amend: impl FnOnce(PendingRoute<'_>) -> bool) -> bool {
        let mut p = super::lock(&self.ctx.pending);
        let super::Pending { cmds, params, norm_after_route, .. } = &mut *p;
        let Some(route_at) = pending_route_at(cmds, *norm_after_route) else { return false };
        let Some(super::Cmd::Dispatch { pipeline, buffers, params_at, params_len, groups }) = cmds.get_mut(route_at)
        else {
            return false;
        };
        let (at, len) = (*params_at as usize, *params_len as usize);
        if len < ROUTE_PARAM_WORDS * 4 || params.len() < at + len {
            return false;
        }
        amend(PendingRoute { pipeline, buffers, params: &mut params[at..at + len], groups })
    }

    /// The pipeline of [`route_source`]'s variant (created once).
    fn route_pipeline(&self, router: bool, signal: bool, norm: bool) -> std::sync::Arc<wgpu::ComputePipeline> {
        // Workgroup memory written before it is read (argued in the shader): no zeroing.
        self.ctx.pipeline_with(route_key(router, signal, norm), || route_source(router, signal, norm), true)
    }

    /// The routing kernel's parameter words (`moe_route.wgsl`'s `Params`): the hand-over's and
    /// the router's left 0, for `fuse_route_signal` and the router variant to set.
    fn route_words(n_expert: usize, n: usize, spec: &RouteSpec, has_bias: bool) -> [u32; ROUTE_PARAM_WORDS] {
        let gating = match spec.gating {
            Gating::Softmax => 0u32,
            Gating::SoftmaxAfterTopK => 1,
            Gating::Sigmoid => 2,
        };
        let (n_group, topk_group) = spec.groups.unwrap_or((0, 0));
        let mut w = [0u32; ROUTE_PARAM_WORDS];
        w[..10].copy_from_slice(&[
            n_expert as u32,
            n as u32,
            spec.k as u32,
            gating,
            has_bias as u32,
            n_group as u32,
            topk_group as u32,
            spec.normalize as u32,
            spec.scale.to_bits(),
            (n * spec.k) as u32,
        ]);
        w
    }

    /// Whether the routing kernel takes `n_expert` experts under `spec` (its shared arrays);
    /// past them the host routes.
    fn route_fits(n_expert: usize, spec: &RouteSpec) -> bool {
        let groups_fit =
            spec.groups.is_none_or(|(g, top)| g > 0 && g <= ROUTE_MAX_GROUPS && n_expert.is_multiple_of(g) && top <= g);
        n_expert <= ROUTE_MAX_EXPERTS
            && spec.k <= ROUTE_MAX_K
            && groups_fit
            && !super::env_flag("DISKFORMER_HOST_ROUTE")
    }

    /// Routes on the GPU (`moe_route.wgsl`): one buffer holds the `[n, k]` weights (the returned
    /// tensor) and after them the ids. With `ids_on_gpu` the ids stay there and `Routing::ids`
    /// is empty (the per-pair kernels read them in place, [`WgpuBackend::routing_ids`] reads
    /// them back); otherwise weights and ids come back in one small readback. `None` when the
    /// spec is past the kernel's limits.
    pub(super) fn route_gpu(
        &self,
        logits: &WgpuTensor,
        bias: Option<&WgpuTensor>,
        spec: &RouteSpec,
        ids_on_gpu: bool,
    ) -> Result<Option<Routing<Self>>, OpError> {
        let n_expert = logits.width();
        let n = logits.rows();
        if !Self::route_fits(n_expert, spec) {
            return Ok(None);
        }
        let out = self.alloc_bytes("route", 8 * (n * spec.k) as u64)?;
        self.dispatch(
            self.route_pipeline(false, false, false),
            &[&logits.buf.buffer, bias.map_or(&self.ctx.dummy, |b| &b.buf.buffer), &out.buffer],
            &Self::route_words(n_expert, n, spec, bias.is_some()),
            grid(n),
        );
        self.routing_from(out, n, spec.k, ids_on_gpu).map(Some)
    }

    /// The routing in `out` (`[n, k]` weights, then the ids), its ids read back unless
    /// `ids_on_gpu`.
    fn routing_from(
        &self,
        out: super::PooledBuffer,
        n: usize,
        k: usize,
        ids_on_gpu: bool,
    ) -> Result<Routing<Self>, OpError> {
        let routing = Routing { ids: Vec::new(), weights: WgpuTensor { buf: out, shape: vec![n, k] }, k };
        if ids_on_gpu {
            return Ok(routing);
        }
        let ids = self.routing_ids(&routing)?;
        Ok(Routing { ids, ..routing })
    }

    /// [`Backend::router_route`] of one token in one dispatch (`moe_route.wgsl`'s router
    /// variant: the router's rows spread over workgroups, the last to finish routes): an f32
    /// router in one buffer, input rows of whole vec4s, within the routing kernel's limits,
    /// fused ops on; `None` otherwise (and on odd decode steps under `DISKFORMER_AB=router`, or
    /// with `DISKFORMER_ROUTER_ROUTE=apart`), for the product and the routing apart. With
    /// `norm` (the RMS norm that wrote `x`, taken out of the pending commands), the kernel reads
    /// the norm's input and weight and norms it itself (its `//F` variant).
    pub(super) fn router_route_gpu(
        &self,
        x: &WgpuTensor,
        router: &super::WgpuWeight,
        bias: Option<&WgpuTensor>,
        spec: &RouteSpec,
        ids_on_gpu: bool,
        norm: Option<&super::NormMark>,
    ) -> Result<Option<Routing<Self>>, OpError> {
        static APART: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let apart = *APART.get_or_init(|| std::env::var("DISKFORMER_ROUTER_ROUTE").is_ok_and(|v| v.trim() == "apart"));
        let n_expert = router.n_rows;
        let fits = self.ctx.fuse
            && !apart
            && !crate::ab::is_b("router")
            && x.rows() == 1
            && router.layout.dtype == gguf::GgmlType::F32
            && router.chunks.len() == 1
            && router.k.is_multiple_of(4)
            && spec.k >= 1
            && spec.k <= n_expert
            && bias.is_none_or(|b| b.len() == n_expert)
            && Self::route_fits(n_expert, spec);
        if !fits {
            return Ok(None);
        }
        super::expect_width("router_route x", x, router.k)?;
        let logits = self.alloc_bytes("router logits", 4 * n_expert as u64)?;
        let out = self.alloc_bytes("route", 8 * spec.k as u64)?;
        let mut words = Self::route_words(n_expert, 1, spec, bias.is_some());
        words[16] = router.k as u32;
        words[17] = (router.layout.row_words(router.k) / 4) as u32;
        words[18] = norm.map_or(0, |m| m.eps.to_bits());
        let bias = bias.map_or(&self.ctx.dummy, |b| &b.buf.buffer);
        let (input, router_w, done) =
            (norm.map_or(&x.buf.buffer, |m| &m.x), &router.chunks[0].buffer, &self.ctx.route_done);
        let mut buffers = vec![&logits.buffer, bias, &out.buffer, router_w, input, done];
        buffers.extend(norm.map(|m| &m.weight));
        self.dispatch(
            self.route_pipeline(true, false, norm.is_some()),
            &buffers,
            &words,
            grid(n_expert.div_ceil(ROUTER_ROWS_PER_GROUP)),
        );
        self.routing_from(out, 1, spec.k, ids_on_gpu).map(Some)
    }

    /// The expert ids `[n_tokens, k]` of a routing: its `ids`, or, when the GPU router left them
    /// on the GPU (`ids` empty), read back from beside the weights.
    ///
    /// # Errors
    /// The readback failed (device lost).
    pub fn routing_ids(&self, r: &Routing<Self>) -> Result<Vec<u32>, OpError> {
        let nk = r.weights.len();
        if !r.ids.is_empty() || nk == 0 {
            return Ok(r.ids.clone());
        }
        let bytes = match &self.experts {
            Some(tier) => self.read_back_tier(tier, &r.weights.buf.buffer, 8 * nk as u64)?,
            None => self.read_back(&r.weights.buf.buffer, 8 * nk as u64)?,
        };
        Ok(super::le_u32s(&bytes[4 * nk..]))
    }
}

/// Whether the per-pair kernels take a call of `n_tok` tokens and `k` experts each with these
/// sizes: few tokens, and rows of whole 8-value groups (the kernels read x and H as `vec4`s).
pub(super) fn pairs_fit(n_tok: usize, k: usize, n_embd: usize, n_ff: usize) -> bool {
    n_tok <= MAX_FUSED_TOKENS
        && n_tok * k <= MAX_HOST_PAIRS
        && n_embd.is_multiple_of(8)
        && n_ff.is_multiple_of(8)
        && !super::env_flag("DISKFORMER_NO_MOE_PAIRS")
}

#[cfg(test)]
mod tests {
    use super::super::shaders::tests::parse;
    use super::*;
    use gguf::GgmlType;

    /// The routing kernel parses and validates (naga) plain and with the hand-over fused in,
    /// and the variant differs only by its `//S ` lines.
    #[test]
    fn route_kernels_validate() {
        let variants = [
            (false, false, false, 3),
            (false, true, false, 5),
            (true, false, false, 6),
            (true, true, false, 8),
            (true, false, true, 7),
            (true, true, true, 8),
        ];
        for (router, signal, norm, p_binding) in variants {
            let (src, key) = (route_source(router, signal, norm), route_key(router, signal, norm));
            parse(key, &src);
            assert!(src.contains(&format!("@binding({p_binding}) var<uniform> P")), "{key}");
            let live = |code: &str| src.lines().any(|l| l.trim_start().starts_with(code));
            assert_eq!(live("atomicStore(&D[P.flag_at], P.seq)"), signal, "{key}");
            assert_eq!(live("fn router_rows"), router, "{key}");
            assert_eq!(live("inv_rms = 1.0 / sqrt"), norm, "{key}");
            assert_eq!(live("atomicStore(&D[x_at + i], X[i])"), signal && !norm, "{key}");
        }
        // The hand-over's X and D come after the router's three buffers; with the norm, its
        // weight and then D alone.
        assert!(route_source(true, true, false).contains("@binding(7) var<storage, read_write> D"));
        assert!(route_source(true, true, true).contains("@binding(7) var<storage, read_write> D"));
        assert!(route_source(true, true, true).contains("@binding(6) var<storage, read> NW"));
        // The guess variant: the next router and the slot table after D, the uniform after them.
        for norm in [false, true] {
            let src = route_source_with(true, true, norm, true);
            parse(route_guess_key(norm), &src);
            for binding in [
                "@binding(8) var<storage, read> GW",
                "@binding(9) var<storage, read> GS",
                "@binding(10) var<uniform> P",
            ] {
                assert!(src.contains(binding), "{}: {binding}", route_guess_key(norm));
            }
            let live = |code: &str| src.lines().any(|l| l.trim_start().starts_with(code));
            assert!(live("atomicStore(&D[P.g_at], P.seq)") && live("atomicStore(&D[P.flag_at], P.seq)"));
        }
        // Nothing of it elsewhere.
        assert!(!route_source(true, true, true).lines().any(|l| l.trim_start().starts_with("atomicStore(&D[P.g_at]")));
    }

    /// A mailbox of `words` words the kernels write and the test reads back.
    fn test_mailbox(g: &WgpuBackend, words: usize) -> wgpu::Buffer {
        g.ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("test mailbox"),
            size: 4 * words as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// A random f32 router `[n_expert, n_embd]` on the GPU (the GPU's f32 layout is the rows as
    /// they are), for the router variants.
    fn f32_router(
        g: &WgpuBackend,
        n_expert: usize,
        n_embd: usize,
        next: &mut impl FnMut() -> f32,
    ) -> super::super::WgpuWeight {
        let values: Vec<f32> = (0..n_expert * n_embd).map(|_| 0.2 * next()).collect();
        router_from_rows(g, n_expert, n_embd, &values)
    }

    /// The f32 router of these rows on the GPU.
    fn router_from_rows(g: &WgpuBackend, n_expert: usize, n_embd: usize, values: &[f32]) -> super::super::WgpuWeight {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        super::super::WgpuWeight {
            chunks: vec![super::super::WeightChunk {
                buffer: g.upload_weight_bytes("router", bytes.len() as u64, bytes).unwrap(),
                row0: 0,
                n_rows: n_expert,
            }],
            layout: TypeLayout::of(GgmlType::F32).unwrap(),
            k: n_embd,
            n_rows: n_expert,
            shape: vec![n_expert, n_embd],
            name: "router".into(),
            host: None,
        }
    }

    /// The routing kernel with the hand-over fused in writes what the routing kernel and
    /// `mailbox_signal.wgsl` write apart: the same routing buffer, and in the mailbox the
    /// weights, the ids, the hidden state and the flag at the words the dispatcher reads. Run on
    /// any adapter (lavapipe in CI, where the split itself never uses mailboxes): the mailboxes
    /// here are plain storage buffers, read once the dispatches are done.
    #[test]
    fn fused_hand_over_writes_what_the_signal_kernel_writes() {
        use crate::backend::Backend;
        let Ok(g) = WgpuBackend::new(super::super::WgpuOptions { adapter_index: None, prefer_discrete: true }) else {
            eprintln!("no GPU adapter: skipped");
            return;
        };
        let (n_expert, k, n_embd) = (128usize, 8usize, 256usize);
        let mut next = crate::test_uniform();
        let logits: Vec<f32> = (0..n_expert).map(|_| 4.0 * next()).collect();
        let xv: Vec<f32> = (0..n_embd).map(|_| next()).collect();
        let logits = g.from_host(&logits, &[1, n_expert]).unwrap();
        let x = g.from_host(&xv, &[1, n_embd]).unwrap();
        let spec = RouteSpec {
            k,
            gating: Gating::Softmax,
            has_selection_bias: false,
            groups: None,
            normalize: true,
            scale: 1.5,
        };
        let (data_at, flag_at, seq) = (8u32, 3u32, 77u32);
        let words = data_at as usize + 2 * k + n_embd;
        let mailbox = || test_mailbox(&g, words);
        // A router of f32 rows for the router variant (the GPU's f32 layout is the rows as
        // they are): its logits are recomputed in the kernel, the same in both runs.
        let router_w = f32_router(&g, n_expert, n_embd, &mut next);
        for with_router in [false, true] {
            let route = || match with_router {
                false => g.route_gpu(&logits, None, &spec, true).unwrap().expect("routed on the GPU"),
                true => {
                    g.router_route_gpu(&x, &router_w, None, &spec, true, None).unwrap().expect("routed with the router")
                }
            };
            let (apart, fused) = (mailbox(), mailbox());
            let r_apart = route();
            let signal =
                g.ctx.pipeline_with("mailbox_signal", || include_str!("shaders/mailbox_signal.wgsl").to_string(), true);
            g.dispatch(
                signal,
                &[&r_apart.weights.buf.buffer, &x.buf.buffer, &apart],
                &[2 * k as u32, n_embd as u32, data_at, flag_at, seq, 0, 0, 0],
                [1, 1, 1],
            );
            let r_fused = route();
            assert!(
                g.fuse_route_signal(
                    &r_fused.weights.buf.buffer,
                    &x.buf.buffer,
                    &fused,
                    [n_embd as u32, data_at, flag_at, seq]
                ),
                "the route's dispatch was the last pending command: it must fuse"
            );
            let read = |b: &wgpu::Buffer, bytes: usize| super::super::le_u32s(&g.read_back(b, bytes as u64).unwrap());
            let (want, got) = (read(&apart, 4 * words), read(&fused, 4 * words));
            assert_eq!(got, want, "mailbox words (flag at {flag_at}, data from {data_at})");
            assert_eq!(got[flag_at as usize], seq);
            let x_bits: Vec<u32> = xv.iter().map(|v| v.to_bits()).collect();
            assert_eq!(&got[data_at as usize + 2 * k..], &x_bits[..], "the hidden state in the mailbox");
            assert_eq!(
                read(&r_fused.weights.buf.buffer, 8 * k),
                read(&r_apart.weights.buf.buffer, 8 * k),
                "the routing buffer, fused or not"
            );
            assert!(got[data_at as usize + k..data_at as usize + 2 * k].iter().all(|&id| (id as usize) < n_expert));
        }
    }

    /// A router given the output of a pending one-row RMS norm takes the norm's input and
    /// weight and norms it itself (the `//F` variant), the norm's dispatch moved after it: the
    /// ids equal those of the router on the norm's output, the weights within rounding, the
    /// norm's output unchanged; the hand-over fused in then writes the normed row into the
    /// mailbox. Run on any adapter (lavapipe in CI).
    #[test]
    fn norm_in_the_router_writes_what_the_norm_then_the_router_write() {
        use crate::backend::Backend;
        let Ok(g) = WgpuBackend::new(super::super::WgpuOptions { adapter_index: None, prefer_discrete: true }) else {
            eprintln!("no GPU adapter: skipped");
            return;
        };
        let mut next = crate::test_uniform();
        for (n_expert, k, n_embd) in [(128usize, 8usize, 256usize), (60, 4, 2048), (7, 2, 32)] {
            let xv: Vec<f32> = (0..n_embd).map(|_| 3.0 * next()).collect();
            let wv: Vec<f32> = (0..n_embd).map(|_| 1.0 + next()).collect();
            let (x, nw) = (g.from_host(&xv, &[1, n_embd]).unwrap(), g.from_host(&wv, &[n_embd]).unwrap());
            let spec = RouteSpec {
                k,
                gating: Gating::Softmax,
                has_selection_bias: false,
                groups: None,
                normalize: true,
                scale: 1.0,
            };
            let router_w = f32_router(&g, n_expert, n_embd, &mut next);
            let eps = 1e-6f32;
            let case = format!("{k} of {n_expert}, {n_embd} wide");
            // Apart: the norm submitted and done before the router reads its output.
            let h_apart = g.rms_norm(&x, Some(&nw), eps).unwrap();
            let want_h = g.to_host(&h_apart).unwrap();
            let apart = g.router_route_gpu(&h_apart, &router_w, None, &spec, true, None).unwrap().expect("routed");
            let (want_ids, want_w) = (g.routing_ids(&apart).unwrap(), g.to_host(&apart.weights).unwrap());
            let (data_at, flag_at, seq) = (8u32, 3u32, 9u32);
            let words = data_at as usize + 2 * k + n_embd;
            // The guess's words after the hand-over's.
            let (g_at, g_max, g_slots_at) = (words, 3usize, 5usize);
            let mailbox = test_mailbox(&g, words + 2 + g_max);
            // For the prefetch's guess, fused in below (made first: an upload is a command): the
            // next layer's router and a slot table with every expert but multiples of three in
            // host memory (`where` 1).
            let rows: Vec<f32> = (0..n_expert * n_embd).map(|_| 0.2 * next()).collect();
            let next_router = router_from_rows(&g, n_expert, n_embd, &rows);
            let in_host = |e: usize| !e.is_multiple_of(3);
            let mut table = vec![[0u32; 4]; g_slots_at];
            table.extend((0..n_expert).map(|e| [u32::from(in_host(e)), 0, 0, 0]));
            let table = g.upload("test slot table", bytemuck::cast_slice(table.as_flattened())).unwrap();
            // Folded: the norm pending when the router comes.
            let h = g.rms_norm(&x, Some(&nw), eps).unwrap();
            let routed = Backend::router_route(&g, &h, &router_w, None, &spec).unwrap();
            assert!(g.ctx.pipeline_made(route_key(true, false, true)).is_some(), "{case}: the norm variant ran");
            {
                let p = super::super::lock(&g.ctx.pending);
                let n = p.cmds.len();
                assert_eq!(p.norm_after_route, Some(n - 1), "{case}: the norm moved after the routing kernel");
                assert!(
                    matches!(&p.cmds[n - 1], crate::wgpu::Cmd::Dispatch { buffers, .. } if buffers.get(3) == Some(&h.buf.buffer)),
                    "{case}: the last command is the norm writing h"
                );
            }
            assert!(
                g.fuse_route_signal(
                    &routed.weights.buf.buffer,
                    &h.buf.buffer,
                    &mailbox,
                    [n_embd as u32, data_at, flag_at, seq]
                ),
                "{case}: the hand-over fuses into the routing kernel before the moved norm"
            );
            // The guess fused in too: the next router on the same normed row, its top k's first
            // `g_max` in host memory written after the flag; where the rows do not split into
            // whole workgroups of the router variant, nothing is fused.
            let guess_words = [g_at as u32, g_slots_at as u32, g_max as u32];
            let guessed =
                g.fuse_route_guess(&routed.weights.buf.buffer, &next_router, &table.buffer, &mailbox, guess_words);
            assert_eq!(guessed, n_expert.is_multiple_of(4), "{case}: the guess fuses where the rows allow");
            assert_eq!(g.to_host(&h).unwrap(), want_h, "{case}: the norm's output, moved or not");
            assert_eq!(g.routing_ids(&routed).unwrap(), want_ids, "{case}: ids");
            let got_w = g.to_host(&routed.weights).unwrap();
            for (j, (a, b)) in got_w.iter().zip(&want_w).enumerate() {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1e-3), "{case}: weight {j}: {a} vs {b}");
            }
            let got = super::super::le_u32s(&g.read_back(&mailbox, 4 * (words + 2 + g_max) as u64).unwrap());
            assert_eq!(got[flag_at as usize], seq, "{case}: flag");
            assert_eq!(
                &got[data_at as usize + k..data_at as usize + 2 * k],
                &want_ids[..],
                "{case}: ids in the mailbox"
            );
            for (i, (&bits, &want)) in got[data_at as usize + 2 * k..words].iter().zip(&want_h).enumerate() {
                let v = f32::from_bits(bits);
                assert!((v - want).abs() <= 1e-5 * want.abs().max(1e-3), "{case}: normed row [{i}] {v} vs {want}");
            }
            if guessed {
                // The host's ranking of the next router's logits on the normed row.
                let logits: Vec<f64> = rows
                    .chunks(n_embd)
                    .map(|r| r.iter().zip(&want_h).map(|(&w, &x)| f64::from(w) * f64::from(x)).sum())
                    .collect();
                let mut order: Vec<usize> = (0..n_expert).collect();
                order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
                let want: Vec<u32> =
                    order[..k].iter().filter(|&&e| in_host(e)).take(g_max).map(|&e| e as u32).collect();
                assert_eq!(got[g_at], seq, "{case}: the guess's flag");
                assert_eq!(got[g_at + 1] as usize, want.len(), "{case}: the guess's count");
                assert_eq!(
                    &got[g_at + 2..g_at + 2 + want.len()],
                    &want[..],
                    "{case}: the guessed host experts, best first"
                );
            }
        }
    }

    #[test]
    fn every_type_pair_parses_and_validates() {
        use GgmlType::*;
        let types = [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4];
        let layouts = types
            .iter()
            .map(|&t| TypeLayout::of(t).unwrap())
            .chain([TypeLayout::q4_0_grouped(), TypeLayout::q4_k_grouped()]);
        for l in layouts {
            for sg in [false, true] {
                for kind in [TableKind::Host, TableKind::Gpu, TableKind::Slots] {
                    for shape in [(1, 64), (2, 128)] {
                        let what = format!("{} {shape:?} sg {sg} {kind:?}", l.name);
                        parse(&format!("gate_up {what}"), &gate_up_source(Some(&l), &l, shape, sg, kind));
                        parse(&format!("down {what}"), &down_source(&l, shape, sg, kind));
                    }
                }
            }
            // Mixed gate/up types and ungated experts.
            let q6 = TypeLayout::of(Q6_K).unwrap();
            parse(
                &format!("gate_up {} + q6_k", l.name),
                &gate_up_source(Some(&l), &q6, (1, 64), true, TableKind::Host),
            );
            parse(&format!("gate_up ungated {}", l.name), &gate_up_source(None, &l, (1, 64), false, TableKind::Gpu));
            parse(
                &format!("gate_up {} + q6_k slots", l.name),
                &gate_up_source(Some(&l), &q6, (1, 64), true, TableKind::Slots),
            );
            parse(
                &format!("gate_up ungated {} slots", l.name),
                &gate_up_source(None, &l, (1, 64), false, TableKind::Slots),
            );
        }
    }

    #[test]
    fn int8_kernels_parse_and_validate() {
        use GgmlType::*;
        let types = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS];
        let gate_up_shapes = ["1x256t8", "4x256t32", "2x128t8", "4x32t4", "1x64t2"];
        let down_shapes = ["2x64", "2x64", "1x256t8", "4x128t32", "1x32t4"];
        let layouts = types
            .iter()
            .map(|&t| TypeLayout::of(t).unwrap())
            .chain([TypeLayout::q4_0_grouped(), TypeLayout::q4_k_grouped()]);
        for l in layouts {
            let q6 = TypeLayout::of(Q6_K).unwrap();
            for kind in [TableKind::Host, TableKind::Gpu, TableKind::Slots] {
                for (gs, ds) in gate_up_shapes.iter().zip(down_shapes) {
                    let (gs, ds) = (MoeQ8Shape::parse(gs).unwrap(), MoeQ8Shape::parse(ds).unwrap());
                    let what = format!("{} {gs} {ds} {kind:?}", l.name);
                    parse(&format!("gate_up_q8 {what}"), &gate_up_q8_source(Some(&l), &l, 2048, gs, kind).unwrap());
                    parse(&format!("gate_up_q8 ungated {what}"), &gate_up_q8_source(None, &l, 256, gs, kind).unwrap());
                    parse(
                        &format!("gate_up_q8 +q6_k {what}"),
                        &gate_up_q8_source(Some(&l), &q6, 512, gs, kind).unwrap(),
                    );
                    for sg in [false, true] {
                        for k in [1, 3, 8] {
                            parse(
                                &format!("down_q8 {what} sg {sg} k {k}"),
                                &down_q8_source(&l, 768, k, ds, sg, kind).unwrap(),
                            );
                        }
                    }
                }
            }
        }
        assert!(gate_up_q8_source(None, &TypeLayout::of(F16).unwrap(), 256, q8_shapes(8).0, TableKind::Gpu).is_none());
    }

    #[test]
    fn q8_shapes_parse() {
        assert_eq!(MoeQ8Shape::parse("1x256t8"), Some(MoeQ8Shape { rows: 1, wg: 256, tpr: 8 }));
        assert_eq!(MoeQ8Shape::parse("2x64"), Some(MoeQ8Shape { rows: 2, wg: 64, tpr: 64 }));
        for bad in ["", "2x", "x64", "9x64", "2x48", "2x64t3", "4x64t2", "1x512", "2x64t128"] {
            assert_eq!(MoeQ8Shape::parse(bad), None, "{bad}");
        }
        assert_eq!(MoeQ8Shape::parse("2x128t8").unwrap().to_string(), "2x128t8");
        assert_eq!(MoeQ8Shape { rows: 2, wg: 64, tpr: 64 }.to_string(), "2x64");
    }

    #[test]
    fn rename_touches_whole_words_only() {
        let names = vec!["dq8".to_string(), "BW".to_string()];
        let got = rename("fn dq8(b: u32) -> f32 { return W[b + BW] + dq8x(BWx); } // W", &names, "_u", "WU");
        assert_eq!(got, "fn dq8_u(b: u32) -> f32 { return WU[b + BW_u] + dq8x(BWx); } // WU");
        assert_eq!(
            declared_names("const BV: u32 = 1u;\nfn dot8(a: u32)\nstruct V8 {\nvar<private> KV: array<f32, 2>;"),
            ["BV", "dot8", "V8", "KV"]
        );
    }
}
