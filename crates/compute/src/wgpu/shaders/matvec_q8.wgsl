// Int8 decode matrix-vector products: y[out_col0 + r] (+)= sum_c x[x_col0 + c] * W[w_row0 + r, c]
// with x quantized to int8 blocks of 32 (quantize_q8.wgsl) and the weights' integer values
// multiplied four at a time by dot4I8Packed (one dp4a-class instruction where the device has
// integer dot products; naga emulates it elsewhere). Scales, offsets and mins are applied once per
// 32 values in f32, so the inner loop has no int-to-float conversion per value.
//
// Why: the f32-activation kernel (matvec.wgsl) spends ~6 instructions per 4-bit weight value
// turning it into a float, and each invocation's iteration moves only 4 bytes of Q4_0 weights; here
// an iteration covers 32 values (18 bytes of Q4_0, 34 of Q8_0) in ~40 instructions.
//
// One template, three uses (shaders.rs fills it):
// - one weight (the plain product; row spans and column offsets for heads and experts);
// - up to three weights of one width against the same activations (q/k/v, of one type or not: a
//   Q4_K_M file's v is often Q6_K): the workgroups of weight 0 come first in the grid, then those
//   of weight 1 (from P.groups1), then weight 2 (from P.groups2); each weight writes its own
//   output. One dispatch instead of three;
// - gate and up paired (GLU): a workgroup computes the same rows of both, writes
//   glu(gate, up) and, when P.quantize is set, the result's own int8 blocks (each workgroup covers
//   whole 32-row blocks), so the down projection needs no quantize dispatch.
//
// Workgroup shape: WG invocations in SLOTS = WG / TPR row slots of TPR invocations each; a slot
// holds ROWS rows in registers (they share the activation loads), so a workgroup covers
// RPW = SLOTS * ROWS rows. TPR = WG is the classic shape (every invocation on the same rows). The
// loop takes UNROLL blocks per iteration (more loads in flight). A persistent shape makes each
// subgroup a row slot that loops over grid units (Q8Shape::persistent in shaders.rs).
// Template parameters (see shaders.rs): QUANT (weight 0's type code, and dot32, dot32_1, dot32_2
// from quant/i8/ for the weights' types reading W, W1, W2, with their block sizes QBV0.. in values
// and QBW0.. in words), BINDINGS, ACT, WG, TPR, ROWS, RED_LEN, SG_ARGS, ENTRY (the grid unit and
// the body).
// Needs k and x_col0 multiples of 32 (the caller falls back to matvec.wgsl).
struct Params {
    // Values per row (a whole number of every weight's blocks: row words are k / QBV * QBW).
    k: u32,
    // First activation block (x_col0 / 32).
    xb0: u32,
    accumulate: u32,
    n_rows0: u32,
    n_rows1: u32,
    n_rows2: u32,
    // First workgroup of weights 1 and 2 in a multi-weight grid, and the grid's end.
    groups1: u32,
    groups2: u32,
    groups_end: u32,
    // Rows w_row0.. of weight 0's buffer, written from column out_col0 of its output.
    w_row0: u32,
    out_col0: u32,
    // GLU: act code (act.wgsl; 5 = gpt-oss SwiGLU), its alpha and limit; quantize != 0 also
    // writes the int8 blocks of the result.
    glu_op: u32,
    alpha: f32,
    limit: f32,
    quantize: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> XQ: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> XD: array<vec2<f32>>;
{{BINDINGS}}

{{QUANT}}

{{ACT}}

const WG: u32 = {{WG}}u;
const TPR: u32 = {{TPR}}u;
const SLOTS: u32 = WG / TPR;
const ROWS: u32 = {{ROWS}}u;
const RPW: u32 = SLOTS * ROWS;

// Written before read, so the pipeline skips WGSL's zeroing of workgroup memory: every reduction
// writes the elements it reads (each slot's TPR partial sums, each subgroup's sum, or the whole
// tree level) before a barrier and reads only those; the GLU epilogue writes red[0..RPW] (|h|) and
// qv[0..RPW] before the barriers after which it reads them, and reads no index past RPW.
var<workgroup> red: array<f32, {{RED_LEN}}>;
var<workgroup> qv: array<i32, RPW>;

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
{{ENTRY}}}
