// Decode matrix-vector product: y[out_col0 + r] = sum_c x[x_col0 + c] * W[w_row0 + row0 + r, c] for
// ROWS consecutive rows per workgroup and one token.
//
// Why several rows per workgroup: each invocation loads its 8 activations once per group (two
// 16-byte loads) and dots them with ROWS weight rows, so the activation reads (served by the cache)
// are a fraction of the weight reads (from memory) instead of twice their bytes, and the cost of the
// closing reduction is shared by ROWS rows. Neighbouring invocations read neighbouring groups, so
// every load of a subgroup is one contiguous span of the row.
// Template parameters (see shaders.rs): PARAMS, QUANT (a weight type's BV, BW, dq8 and dot8), WG, ROWS,
// REDUCE_ROWS.
// Needs k a multiple of 8 and x_col0 a multiple of 4 (the caller falls back to matmul.wgsl).
{{PARAMS}}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

{{QUANT}}

const WG: u32 = {{WG}}u;
const ROWS: u32 = {{ROWS}}u;

// Written before read, so the pipeline skips WGSL's zeroing of workgroup memory: the closing
// reduction (shaders.rs, REDUCE_ROWS_*) writes red[r * n_sg + sg_id] from each subgroup's first
// lane, or red[r * WG + lid] from every invocation, before the barrier after which it reads only
// those elements.
var<workgroup> red: array<f32, {{RED_LEN}}>;

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
    // Uniform per workgroup, so the barriers below are reached by all or none.
    let row0 = (wid.x + wid.y * nwg.x) * ROWS;
    if (row0 >= P.n_rows) {
        return;
    }
    let n_groups = P.k / 8u;
    let gpb = BV / 8u;
    let xb = P.x_col0 / 4u;
    // Rows past the end repeat the last row: computed, never written.
    var rb: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        rb[r] = (P.w_row0 + min(row0 + r, P.n_rows - 1u)) * P.row_words;
    }
    var acc: array<f32, ROWS>;
    for (var g = lid; g < n_groups; g += WG) {
        let xa = X[xb + 2u * g];
        let xc = X[xb + 2u * g + 1u];
        let xsum = dot(xa, vec4<f32>(1.0)) + dot(xc, vec4<f32>(1.0));
        let bo = (g / gpb) * BW;
        let j = g % gpb;
        for (var r = 0u; r < ROWS; r++) {
            acc[r] += dot8(rb[r] + bo, j, xa, xc, xsum);
        }
    }
{{REDUCE_ROWS}}
}
