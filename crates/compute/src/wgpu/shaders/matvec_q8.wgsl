// Int8 decode matrix-vector product: y[out_col0 + r] (+)= sum_c x[x_col0 + c] * W[w_row0 + row0 + r, c]
// with x quantized to int8 blocks of 32 (quantize_q8.wgsl) and the weights' integer values
// multiplied four at a time by dot4I8Packed (one dp4a-class instruction where the device has
// integer dot products; naga emulates it elsewhere). Scales, offsets and mins are applied once per
// 32 values in f32, so the inner loop has no int-to-float conversion per value.
//
// Why: the f32-activation kernel (matvec.wgsl) spends ~6 instructions per 4-bit weight value
// turning it into a float, and each invocation's iteration moves only 4 bytes of Q4_0 weights; here
// an iteration covers 32 values (18 bytes of Q4_0, 34 of Q8_0) in ~40 instructions.
// Template parameters (see shaders.rs): PARAMS, QUANT (a weight type's BV, BW and dot32 from
// quant/i8/), WG, ROWS, RED_LEN, REDUCE_ROWS, SG_ARGS.
// Needs k and x_col0 multiples of 32 (the caller falls back to matvec.wgsl).
{{PARAMS}}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> XQ: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> XD: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

{{QUANT}}

const WG: u32 = {{WG}}u;
const ROWS: u32 = {{ROWS}}u;

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
    let n_blocks = P.k / 32u;
    let spb = BV / 32u;
    let xb = P.x_col0 / 32u;
    // Rows past the end repeat the last row: computed, never written.
    var rb: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        rb[r] = (P.w_row0 + min(row0 + r, P.n_rows - 1u)) * P.row_words;
    }
    var acc: array<f32, ROWS>;
    for (var q = lid; q < n_blocks; q += WG) {
        let x0 = XQ[2u * (xb + q)];
        let x1 = XQ[2u * (xb + q) + 1u];
        let xds = XD[xb + q];
        let bo = (q / spb) * BW;
        let j = q % spb;
        for (var r = 0u; r < ROWS; r++) {
            acc[r] += dot32(rb[r] + bo, j, x0, x1, xds);
        }
    }
{{REDUCE_ROWS}}
}
