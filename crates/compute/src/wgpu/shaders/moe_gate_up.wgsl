// Decode MoE, first half: the gate and up products of every (token, expert) pair of a step in one
// dispatch, the gated activation applied on the way out:
//   H[p, r] = glu(gate_e[r] · x_t + bg[e, r], up_e[r] · x_t + bu[e, r])   (ungated: act(up ...))
// for pair p = t * k_top + j, expert e = entry(p).x. A workgroup computes ROWS rows of both matrices
// for one pair; grid x: row groups, y: pairs.
//
// Why per pair and not per expert: at decode each expert serves one token, so there is nothing to
// share between pairs, and one dispatch for all of them replaces the per-expert gather, two
// products, bias adds and GLU (about five dispatches per expert before).
// Where the matrices are: entry(p) = [expert id, gate word, up word, down word], the first word of
// the expert's matrices in W (gate) and WU (up): a slot of the GPU expert pool or an expert's block
// of a resident stacked weight. The table comes in the parameters (routing on the host), or is made
// from the expert ids the GPU router left in T (binding 6 then; TABLE declares it) and the
// stacks' words per expert (stride_*). A pair whose expert the CPU computes has the entry SKIP.
// Template parameters (moe.rs): PARAMS (moe_gate_up_params.wgsl, shared with the int8 kernel),
// QUANT_G / QUANT_U (the weight types' dq8/dot8 over W and over WU, names suffixed _u), WG, ROWS,
// NV (= 2 * ROWS), GATED, SKIP, TABLE_FIELD, TABLE, P_BINDING, SG_ARGS, REDUCE, ACT, PRODUCTS (acc
// from products(), or, with the tier's slot table, from products_h() for a pair whose expert is
// read from host memory), PRODUCTS_H (that copy). Needs n_embd a multiple of 8.
{{PARAMS}}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> WU: array<u32>;
@group(0) @binding(2) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> BG: array<f32>;
@group(0) @binding(4) var<storage, read> BU: array<f32>;
@group(0) @binding(5) var<storage, read_write> H: array<f32>;
@group(0) @binding({{P_BINDING}}) var<uniform> P: Params;

{{QUANT_G}}

{{QUANT_U}}

{{ACT}}

{{TABLE}}

const WG: u32 = {{WG}}u;
const ROWS: u32 = {{ROWS}}u;
const NV: u32 = {{NV}}u;
const GATED: bool = {{GATED}};
const SKIP: u32 = {{SKIP}};

var<workgroup> red: array<f32, {{RED_LEN}}>;
var<workgroup> tot: array<f32, {{NV}}>;

// This invocation's share of the gate rows (acc[0..ROWS]) and up rows (acc[ROWS..NV]) of pair
// entry `ent` for rows row0.. (rows past the end repeat the last row: computed, never written).
// A function so that the host tier's copy (products_h, reading WH) is the same code.
fn products(ent: vec4<u32>, xb: u32, row0: u32, lid: u32) -> array<f32, NV> {
    let n_groups = P.n_embd / 8u;
    var rg: array<u32, ROWS>;
    var ru: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        let row = min(row0 + r, P.n_ff - 1u);
        rg[r] = ent.y + row * P.rw_g;
        ru[r] = ent.z + row * P.rw_u;
    }
    var acc: array<f32, NV>;
    for (var g = lid; g < n_groups; g += WG) {
        let xa = X[xb + 2u * g];
        let xc = X[xb + 2u * g + 1u];
        let xsum = dot(xa, vec4<f32>(1.0)) + dot(xc, vec4<f32>(1.0));
        if (GATED) {
            let bo = (g / (BV / 8u)) * BW;
            let j = g % (BV / 8u);
            for (var r = 0u; r < ROWS; r++) {
                acc[r] += dot8(rg[r] + bo, j, xa, xc, xsum);
            }
        }
        let bou = (g / (BV_u / 8u)) * BW_u;
        let ju = g % (BV_u / 8u);
        for (var r = 0u; r < ROWS; r++) {
            acc[ROWS + r] += dot8_u(ru[r] + bou, ju, xa, xc, xsum);
        }
    }
    return acc;
}

{{PRODUCTS_H}}

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
    // Uniform per workgroup, so the barriers below are reached by all or none.
    let pair = wid.y;
    let row0 = wid.x * ROWS;
    if (pair >= P.n_pairs || row0 >= P.n_ff) {
        return;
    }
    let ent = entry(pair);
    if (ent.x == SKIP) {
        return;
    }
    let xb = (pair / P.k_top) * (P.n_embd / 4u);
{{PRODUCTS}}
{{REDUCE}}
    if (lid < ROWS && row0 + lid < P.n_ff) {
        let row = row0 + lid;
        let bias_at = ent.x * P.n_ff + row;
        var u = tot[ROWS + lid];
        if (P.has_up_bias == 1u) {
            u += BU[bias_at];
        }
        var h: f32;
        if (GATED) {
            var gv = tot[lid];
            if (P.has_gate_bias == 1u) {
                gv += BG[bias_at];
            }
            h = glu_act(gv, u, P.op, P.alpha, P.limit);
        } else {
            h = act(u, P.op);
        }
        H[pair * P.n_ff + row] = h;
    }
}
