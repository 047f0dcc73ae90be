// y[t, col0 + r] = sum_c x[t, x_col0 + c] * W[row0 + r, c] for rows r of one weight chunk and up to TOK
// tokens per workgroup. One workgroup per output row streams the row once and dots it with each
// token of its tile, so decode (one token) reads the weights exactly once.
// Template parameters (see shaders.rs): PARAMS, QUANT (a weight type's BV, BW, dq8), TOK, X_GUARD, REDUCE,
// UNROLL (a first loop taking four groups per iteration, so four independent loads are in flight).
{{PARAMS}}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

{{QUANT}}

const WG: u32 = 64u;
const TOK: u32 = {{TOK}}u;

var<workgroup> red: array<f32, 256>;

fn xat(i: u32, c: u32) -> f32 {
{{X_GUARD}}
}

fn x8dot(v: V8, xb: u32, c: u32) -> f32 {
    let xa = vec4<f32>(xat(xb, c), xat(xb + 1u, c + 1u), xat(xb + 2u, c + 2u), xat(xb + 3u, c + 3u));
    let xc = vec4<f32>(xat(xb + 4u, c + 4u), xat(xb + 5u, c + 5u), xat(xb + 6u, c + 6u), xat(xb + 7u, c + 7u));
    return dot(v.a, xa) + dot(v.b, xc);
}

{{REDUCE}}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= P.n_rows) {
        return;
    }
    let t0 = wid.z * TOK;
    let n_groups = (P.k + 7u) / 8u;
    let gpb = BV / 8u;
    let rb = (P.w_row0 + row) * P.row_words;
    var acc: array<f32, TOK>;
    var g = lid;
{{UNROLL}}
    for (; g < n_groups; g += WG) {
        let v = dq8(rb + (g / gpb) * BW, g % gpb);
        let c = g * 8u;
        for (var t = 0u; t < TOK; t++) {
            if (t0 + t < P.n_tok) {
                acc[t] += x8dot(v, (t0 + t) * P.x_stride + P.x_col0 + c, c);
            }
        }
    }
    for (var t = 0u; t < TOK; t++) {
        let s = reduce_sum(acc[t], lid{{SG_CALL}});
        if (lid == 0u && t0 + t < P.n_tok) {
            store_y((t0 + t) * P.out_stride + P.out_col0 + row, s);
        }
    }
}
