// Decode MoE, second half, with int8 activations: the down products of every expert a token picked,
// weighted by the router and summed, in one dispatch:
//   Y[t, r] = Σ_j w[t, j] · (down_e[r] · h[p] + bd[e, r])   over p = t * k_top + j, e = entry(p).x,
// h[p] read as the int8 blocks moe_gate_up_q8.wgsl wrote (HQ packed bytes, HD per block d and
// d * sum).
//
// Why the experts are spread over the lanes: a row of the down matrix is short (n_ff = 768 is 24
// blocks of 32), so a workgroup that walked the k experts one after another (moe_down.wgsl) kept
// few loads in flight. Here a slot's lanes take the row's k * NB_H (expert, block) items in one
// loop, every load independent; the router weight is applied per item, the sum over experts and
// blocks is one reduction. Each output is written once, in a fixed order: deterministic, no atomics.
//
// Shape: WG invocations in SLOTS = WG / TPR row slots of TPR lanes, ROWS rows per slot in
// registers: RPW = SLOTS * ROWS output rows per workgroup. Grid x: row groups, y: tokens.
// Template parameters (moe.rs): PARAMS (moe_down_params.wgsl, shared with the f32 kernel), QUANT
// (quant/common.wgsl, the down type's dot32 over W and its host-tier copy dot32_h over WH), QBV /
// QBW (its block values and words), NB_H (n_ff / 32), K_TOP (experts per token, the same as
// P.k_top), WG, TPR, ROWS, SERIAL, MAX_K, SKIP, TABLE_FIELD, TABLE (the table bindings from 6),
// P_BINDING, SG_ARGS, REDUCE, ITEM_BODY (adds item q to acc, reading WH for a pair whose expert is
// in host memory when the tier's slot table is bound). Pairs whose entry is SKIP (computed on the
// CPU) are left out.
{{PARAMS}}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> HQ: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> HD: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> RW: array<f32>;
@group(0) @binding(4) var<storage, read> BD: array<f32>;
@group(0) @binding(5) var<storage, read_write> Y: array<f32>;
@group(0) @binding({{P_BINDING}}) var<uniform> P: Params;

{{QUANT}}

{{TABLE}}

const WG: u32 = {{WG}}u;
const TPR: u32 = {{TPR}}u;
const SLOTS: u32 = WG / TPR;
const ROWS: u32 = {{ROWS}}u;
const RPW: u32 = SLOTS * ROWS;
const NB_H: u32 = {{NB_H}}u;
const K_TOP: u32 = {{K_TOP}}u;
// (expert, block) items of a row.
const ITEMS: u32 = K_TOP * NB_H;
const MAX_K: u32 = {{MAX_K}}u;
const SKIP: u32 = {{SKIP}};
const SERIAL: u32 = {{SERIAL}}u;

// Workgroup memory is written before it is read, so the pipeline skips WGSL's zeroing: ents, ws
// and hosts for j < k_top before the first barrier (only those are read); red for every index the
// reduction reads.
var<workgroup> ents: array<vec4<u32>, MAX_K>;
var<workgroup> ws: array<f32, MAX_K>;
var<workgroup> hosts: array<u32, MAX_K>;
var<workgroup> red: array<f32, {{RED_LEN}}>;
var<workgroup> tot: array<f32, {{RPW}}>;

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
    // Uniform per workgroup, so the barriers below are reached by all or none.
    let tok = wid.y;
    let wrow0 = wid.x * RPW;
    if (tok >= P.n_tok || wrow0 >= P.n_embd) {
        return;
    }
    let p0 = tok * P.k_top;
    for (var j = lid; j < P.k_top; j += WG) {
        ents[j] = entry(p0 + j);
        ws[j] = RW[P.weights_at + p0 + j];
        hosts[j] = {{IN_HOST}};
    }
    workgroupBarrier();
    let slot = lid / TPR;
    let lane = lid % TPR;
    let row0 = wrow0 + slot * ROWS;
    var rb: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        rb[r] = min(row0 + r, P.n_embd - 1u) * P.rw_d;
    }
    var acc: array<f32, ROWS>;
    // A trip count the compiler knows (K_TOP is the pipeline's), so it may unroll and issue the
    // loads of several items at once.
    for (var i = 0u; i < ITEMS / TPR; i++) {
        let q = lane + i * TPR;
{{ITEM_BODY}}
    }
    if (lane < ITEMS % TPR) {
        let q = (ITEMS / TPR) * TPR + lane;
{{ITEM_BODY}}
    }
{{REDUCE}}
    if (lid < RPW && wrow0 + lid < P.n_embd) {
        let row = wrow0 + lid;
        var s = tot[lid];
        if (P.has_bias == 1u) {
            for (var j = 0u; j < P.k_top; j++) {
                let e = ents[j].x;
                if (e != SKIP) {
                    s += ws[j] * BD[e * P.n_embd + row];
                }
            }
        }
        Y[tok * P.n_embd + row] = s;
    }
}
