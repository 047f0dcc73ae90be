// Decode MoE, second half: the down products of every expert a token picked, weighted by the router
// and summed, in one dispatch:
//   Y[t, r] = Σ_j w[t, j] · (down_e[r] · H[p] + bd[e, r])   over p = t * k_top + j, e = entry(p).x.
// A workgroup computes ROWS output rows of one token and loops over its k_top experts itself, so each
// output is written once, in a fixed order: deterministic, no atomics, no zero-fill. Grid x: row
// groups, y: tokens.
// Template parameters (moe.rs): PARAMS (moe_down_params.wgsl, shared with the int8 kernel), QUANT
// (the down type's dq8/dot8 over W), WG, ROWS, NV (= ROWS), SKIP, TABLE_FIELD, TABLE (with the
// table binding T, 5, when the GPU routed), P_BINDING, SG_ARGS, REDUCE, DOWN_ROWS (acc from
// down_rows(), or, with the tier's slot table, from down_rows_h() for a pair whose expert is read
// from host memory), DOWN_ROWS_H (that copy). Pairs whose entry is SKIP (computed on the CPU) are
// left out. Needs n_ff a multiple of 8.
{{PARAMS}}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> H: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> RW: array<f32>;
@group(0) @binding(3) var<storage, read> BD: array<f32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding({{P_BINDING}}) var<uniform> P: Params;

{{QUANT}}

{{TABLE}}

const WG: u32 = {{WG}}u;
const ROWS: u32 = {{ROWS}}u;
const NV: u32 = {{NV}}u;
const SKIP: u32 = {{SKIP}};

var<workgroup> red: array<f32, {{RED_LEN}}>;
var<workgroup> tot: array<f32, {{NV}}>;

// acc plus this invocation's share of w · down rows row0.. of pair entry `ent` over H from hb
// (rows past the end repeat the last row: computed, never written). A function so that the host
// tier's copy (down_rows_h, reading WH) is the same code.
fn down_rows(acc_in: array<f32, NV>, ent: vec4<u32>, w: f32, hb: u32, row0: u32, lid: u32) -> array<f32, NV> {
    var acc = acc_in;
    let n_groups = P.n_ff / 8u;
    let gpb = BV / 8u;
    var rb: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        rb[r] = ent.w + min(row0 + r, P.n_embd - 1u) * P.rw_d;
    }
    for (var g = lid; g < n_groups; g += WG) {
        let xa = H[hb + 2u * g];
        let xc = H[hb + 2u * g + 1u];
        let xsum = dot(xa, vec4<f32>(1.0)) + dot(xc, vec4<f32>(1.0));
        let bo = (g / gpb) * BW;
        let jj = g % gpb;
        for (var r = 0u; r < ROWS; r++) {
            acc[r] += w * dot8(rb[r] + bo, jj, xa, xc, xsum);
        }
    }
    return acc;
}

{{DOWN_ROWS_H}}

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
    let tok = wid.y;
    let row0 = wid.x * ROWS;
    if (tok >= P.n_tok || row0 >= P.n_embd) {
        return;
    }
    var acc: array<f32, NV>;
    for (var j = 0u; j < P.k_top; j++) {
        let pair = tok * P.k_top + j;
        let ent = entry(pair);
        if (ent.x == SKIP) {
            continue;
        }
        let w = RW[P.weights_at + pair];
        let hb = pair * (P.n_ff / 4u);
{{DOWN_ROWS}}
    }
{{REDUCE}}
    if (lid < ROWS && row0 + lid < P.n_embd) {
        let row = row0 + lid;
        var s = tot[lid];
        if (P.has_bias == 1u) {
            for (var j = 0u; j < P.k_top; j++) {
                let pair = tok * P.k_top + j;
                let e = entry(pair).x;
                if (e != SKIP) {
                    s += RW[P.weights_at + pair] * BD[e * P.n_embd + row];
                }
            }
        }
        Y[tok * P.n_embd + row] = s;
    }
}
