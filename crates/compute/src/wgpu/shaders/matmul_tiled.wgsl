// Prefill matrix product, tiled: y[t, out_col0 + r] (+)= sum_c x[t, x_col0 + c] * W[w_row0 + r, c] for
// a tile of TR = 64 weight rows x TT = 64 tokens per workgroup.
//
// Why: matmul.wgsl streams every weight row once per 8 tokens, so a 512-token prompt reads (and
// dequantizes) the weights 64 times and spends its time on it. Here each step of 32 values of k
// dequantizes the tile's weights once into workgroup memory (one 8-value group per invocation),
// loads the tokens' activations next to them, and every invocation then accumulates a 4 x 4
// block of outputs (4 rows x 4 tokens) from vec4 reads of both tiles: 16 multiply-adds per two
// workgroup-memory reads. Accumulation stays in f32.
// Template parameters (see shaders.rs): PARAMS, QUANT (a weight type's BV, BW, dq8), X_GUARD.
{{PARAMS}}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

{{QUANT}}

const TR: u32 = 64u;
const TT: u32 = 64u;
// Groups of 8 values per step: KC = 32 values.
const GS: u32 = 4u;
const KC: u32 = 32u;

// k-major tiles, four rows (tokens) per vec4: ws[kk * TR / 4 + r / 4][r % 4] is W[row0 + r, k0 + kk].
var<workgroup> ws: array<vec4<f32>, 512>;
var<workgroup> xs: array<vec4<f32>, 512>;

fn xat(i: u32, c: u32) -> f32 {
{{X_GUARD}}
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // Uniform per workgroup, so the barriers below are reached by all or none.
    let row0 = (wid.x + wid.y * nwg.x) * TR;
    if (row0 >= P.n_rows) {
        return;
    }
    let t0 = wid.z * TT;
    let n_groups = (P.k + 7u) / 8u;
    let gpb = BV / 8u;
    // Loading role: row (and token) lr of the tile, group lg of the step. Rows and tokens past
    // the end repeat the last one: computed, never written.
    let lr = lid / GS;
    let lg = lid % GS;
    let rb = (P.w_row0 + min(row0 + lr, P.n_rows - 1u)) * P.row_words;
    let xb = min(t0 + lr, P.n_tok - 1u) * P.x_stride + P.x_col0;
    let slot = lr / 4u;
    let lane = lr % 4u;
    // Computing role: rows 4 cr.. and tokens 4 ct.. of the tile.
    let cr = lid % 16u;
    let ct = lid / 16u;
    var acc: array<vec4<f32>, 4>;
    for (var g0 = 0u; g0 < n_groups; g0 += GS) {
        let g = g0 + lg;
        var v = V8(vec4<f32>(0.0), vec4<f32>(0.0));
        var xa = vec4<f32>(0.0);
        var xc = vec4<f32>(0.0);
        if (g < n_groups) {
            v = dq8(rb + (g / gpb) * BW, g % gpb);
            let c = g * 8u;
            let i = xb + c;
            xa = vec4<f32>(xat(i, c), xat(i + 1u, c + 1u), xat(i + 2u, c + 2u), xat(i + 3u, c + 3u));
            xc = vec4<f32>(xat(i + 4u, c + 4u), xat(i + 5u, c + 5u), xat(i + 6u, c + 6u), xat(i + 7u, c + 7u));
        }
        let kb = lg * 8u * (TR / 4u) + slot;
        for (var e = 0u; e < 4u; e++) {
            ws[kb + e * (TR / 4u)][lane] = v.a[e];
            ws[kb + (e + 4u) * (TR / 4u)][lane] = v.b[e];
            xs[kb + e * (TT / 4u)][lane] = xa[e];
            xs[kb + (e + 4u) * (TT / 4u)][lane] = xc[e];
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KC; kk++) {
            let a = ws[kk * (TR / 4u) + cr];
            let b = xs[kk * (TT / 4u) + ct];
            acc[0] += a * b.x;
            acc[1] += a * b.y;
            acc[2] += a * b.z;
            acc[3] += a * b.w;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let t = t0 + 4u * ct + i;
        if (t < P.n_tok) {
            for (var j = 0u; j < 4u; j++) {
                let r = row0 + 4u * cr + j;
                if (r < P.n_rows) {
                    store_y(t * P.out_stride + P.out_col0 + r, acc[i][j]);
                }
            }
        }
    }
}
