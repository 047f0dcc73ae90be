// Decode MoE, first half, with int8 activations: the gate and up products of every (token, expert)
// pair of a step in one dispatch, the gated activation applied, and the result written as the
// int8 blocks the down kernel (moe_down_q8.wgsl) reads:
//   h[p, r] = glu(gate_e[r] · x_t + bg[e, r], up_e[r] · x_t + bu[e, r])   (ungated: act(up ...))
// for pair p = t * k_top + j, expert e = entry(p).x; HQ/HD hold h[p] in blocks of 32 (packed
// signed bytes; per block d and d * sum of the bytes), rounded as quantize_q8.wgsl rounds.
//
// Why int8: the f32 kernel (moe_gate_up.wgsl) turns every 4-bit weight into a float (about six
// instructions a value) and reached ~300 GB/s on the H200; the weight types' dot32 (quant/i8/)
// multiplies four values per dot4I8Packed and applies scales once per 32 values, the scheme of the
// dense int8 kernel (matvec_q8.wgsl, ~2 TB/s there).
// Why the workgroup quantizes x itself: x is the FFN norm's output, whose int8 blocks the norm
// writes, but the router's f32 product reads x after that, and the int8 cache takes any later
// binding of x as a possible write; a separate quantize dispatch costs a dependent dispatch
// (~3 us on the H200), re-quantizing 2048 values per workgroup from L2 costs less than that.
// Why the int8 output: the down kernel then reads 1/4 of the bytes and needs no quantize dispatch;
// a workgroup covers whole 32-row blocks (RPW a multiple of 32, checked by the caller).
//
// Shape: WG invocations in SLOTS = WG / TPR row slots of TPR invocations; a slot holds ROWS rows of
// gate and up in registers (they share the activation loads): RPW = SLOTS * ROWS rows per
// workgroup. Grid x: row groups, y: pairs.
// Template parameters (moe.rs): PARAMS (moe_gate_up_params.wgsl, shared with the f32 kernel), QUANT
// (quant/common.wgsl and the gate type's dot32 over W, the up type's as dot32_u over WU, with the
// host tier's copies dot32_h / dot32_uh over WH), QBV_G / QBW_G / QBV_U / QBW_U (block values and
// words of the gate and up types), NB_X (n_embd / 32), WG, TPR, ROWS, GATED, SKIP, TABLE_FIELD,
// TABLE, P_BINDING, ACT, Q8_ROWS (q8_rows.wgsl: the epilogue h to int8 blocks), PRODUCTS (acc from
// products(), or from products_h() for a pair whose expert is read from host memory), PRODUCTS_H
// (that copy), REDUCE, BLOCK (one activation block q's gate and up terms, substituted before the
// host copy is made).
{{PARAMS}}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> WU: array<u32>;
@group(0) @binding(2) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> BG: array<f32>;
@group(0) @binding(4) var<storage, read> BU: array<f32>;
@group(0) @binding(5) var<storage, read_write> HQ: array<u32>;
@group(0) @binding(6) var<storage, read_write> HD: array<vec2<f32>>;
@group(0) @binding({{P_BINDING}}) var<uniform> P: Params;

{{QUANT}}

{{ACT}}

{{Q8_ROWS}}

{{TABLE}}

const WG: u32 = {{WG}}u;
const TPR: u32 = {{TPR}}u;
const SLOTS: u32 = WG / TPR;
const ROWS: u32 = {{ROWS}}u;
const RPW: u32 = SLOTS * ROWS;
const NB_X: u32 = {{NB_X}}u;
const GATED: bool = {{GATED}};
const SKIP: u32 = {{SKIP}};
// Partial sums per row a lane adds one after another after the tree steps (min(TPR, 8)).
const SERIAL: u32 = {{SERIAL}}u;

// Workgroup memory is written before it is read, so the pipeline skips WGSL's zeroing: xq/xd are
// written for every block < NB_X before the first barrier and only those are read; red is written
// for every index the reduction then reads (each slot's TPR sums per row, or each subgroup's sum),
// and |h| for 0..RPW before the epilogue reads it; qv[0..RPW] is written before its barrier.
var<workgroup> xq: array<vec4<u32>, {{XQ_LEN}}>;
var<workgroup> xd: array<vec2<f32>, {{NB_X}}>;
var<workgroup> red: array<f32, {{RED_LEN}}>;
var<workgroup> tot: array<f32, {{TOT_LEN}}>;
var<workgroup> qv: array<i32, {{RPW}}>;

// This slot lane's share of the gate rows (acc[0..ROWS]) and up rows (acc[ROWS..2 ROWS]) of pair
// entry `ent` for rows row0.. (rows past the end repeat the last row: computed, never written).
// A function so that the host tier's copy (products_h, reading WH) is the same code.
fn products(ent: vec4<u32>, row0: u32, lane: u32) -> array<f32, {{NV}}> {
    var rg: array<u32, ROWS>;
    var ru: array<u32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        let row = min(row0 + r, P.n_ff - 1u);
        rg[r] = ent.y + row * P.rw_g;
        ru[r] = ent.z + row * P.rw_u;
    }
    var acc: array<f32, {{NV}}>;
    // A trip count the compiler knows (every lane has NB_X / TPR blocks, the first NB_X % TPR
    // lanes one more), so it may unroll and issue the weight loads of several blocks at once.
    for (var i = 0u; i < NB_X / TPR; i++) {
        let q = lane + i * TPR;
{{BLOCK}}
    }
    if (lane < NB_X % TPR) {
        let q = (NB_X / TPR) * TPR + lane;
{{BLOCK}}
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
    let wrow0 = wid.x * RPW;
    if (pair >= P.n_pairs || wrow0 >= P.n_ff) {
        return;
    }
    let ent = entry(pair);
    if (ent.x == SKIP) {
        return;
    }
    // x of the pair's token to int8 blocks, as quantize_q8.wgsl computes them.
    let xb = (pair / P.k_top) * (P.n_embd / 4u);
    for (var b = lid; b < NB_X; b += WG) {
        var v: array<vec4<f32>, 8>;
        var amax = vec4<f32>(0.0);
        for (var i = 0u; i < 8u; i++) {
            v[i] = X[xb + 8u * b + i];
            amax = max(amax, abs(v[i]));
        }
        let d = max(max(amax.x, amax.y), max(amax.z, amax.w)) / 127.0;
        let inv = select(0.0, 1.0 / d, d > 0.0);
        var qsum = vec4<i32>(0);
        var words: array<u32, 8>;
        for (var i = 0u; i < 8u; i++) {
            let q = vec4<i32>(round(v[i] * inv));
            qsum += q;
            words[i] = pack4xI8(q);
        }
        xq[2u * b] = vec4<u32>(words[0], words[1], words[2], words[3]);
        xq[2u * b + 1u] = vec4<u32>(words[4], words[5], words[6], words[7]);
        xd[b] = vec2<f32>(d, d * f32(qsum.x + qsum.y + qsum.z + qsum.w));
    }
    workgroupBarrier();
    let slot = lid / TPR;
    let lane = lid % TPR;
    let row0 = wrow0 + slot * ROWS;
{{PRODUCTS}}
{{REDUCE}}
    // tot[i]: gate of row wrow0 + i (i < RPW), up of row wrow0 + i - RPW.
    var h = 0.0;
    let row = wrow0 + lid;
    if (lid < RPW && row < P.n_ff) {
        let bias_at = ent.x * P.n_ff + row;
        var u = tot[RPW + lid];
        if (P.has_up_bias == 1u) {
            u += BU[bias_at];
        }
        if (GATED) {
            var gv = tot[lid];
            if (P.has_gate_bias == 1u) {
                gv += BG[bias_at];
            }
            h = glu_act(gv, u, P.op, P.alpha, P.limit);
        } else {
            h = act(u, P.op);
        }
    }
    // h to int8 blocks of 32 rows (RPW and n_ff are multiples of 32: a block is all in or all
    // out); red's partial sums are read by now.
    let d = q8_rows(h, lid);
    let hq0 = pair * (P.n_ff / 4u) + wrow0 / 4u;
    if (lid < RPW / 4u && wrow0 + 4u * lid < P.n_ff) {
        HQ[hq0 + lid] = q8_rows_word(lid);
    }
    if (lid < RPW && lid % 32u == 0u && row < P.n_ff) {
        HD[pair * (P.n_ff / 32u) + row / 32u] = vec2<f32>(d, d * f32(q8_rows_sum(lid)));
    }
}
