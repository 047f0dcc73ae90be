// Prefill matrix product with int8 activations, tiled: y[t, out_col0 + r] (+)= sum_c x[t, x_col0 + c]
// * W[w_row0 + r, c] for a tile of TR = 64 weight rows x TT = 64 tokens per workgroup, x read as
// the int8 blocks of quantize_q8.wgsl (per 32 values: 8 words of bytes, d and d * sum).
//
// Why: the f32 tiled kernel (matmul_tiled.wgsl) makes 16 multiply-adds per two vec4 reads of
// workgroup memory and one instruction per multiply-add. Here a step of 32 values of k is, per
// (row, token), 8 dot4I8Packed of a word of the row's quants against a word of the token's
// bytes: an invocation's 4 rows x 4 tokens take 128 of them (512 multiply-adds) per 16 vec4
// reads of the tiles, and the scales are applied once per 32 values in f32. The same scheme as
// the int8 decode kernel (matvec_q8.wgsl) and llama.cpp's mmq; the CPU's int8 products round x
// the same way.
//
// A weight type provides `sub_block(rb, j)`: sub-block j (32 values) of the row whose first word
// is rb, as 8 words of unsigned bytes q (value i in byte i % 4 of word i / 4) and (dw, mw) such
// that the weights are dw * q - mw. Then sum_i w_i x_i = dw * dx * sum_i q_i xq_i - mw * (dx *
// sum_i xq_i), and quantize_q8 stores (dx, dx * sum_i xq_i) per block.
// Template parameters (see shaders.rs): PARAMS, SUB_BLOCK (the type's sub_block).
{{PARAMS}}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> XQ: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> XD: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

struct SubBlock {
    q: array<u32, 8>,
    dm: vec2<f32>,
}

{{SUB_BLOCK}}

const TR: u32 = 64u;
const TT: u32 = 64u;
// Sub-blocks of 32 values per step.
const SB: u32 = 2u;

// Tiles, four rows (tokens) per vec4: wq[(s * 8 + w) * 16 + r / 4][r % 4] is word w of step
// sub-block s of tile row r; wd / wm its dw / mw at [s * 16 + r / 4][r % 4]; xq, xd (dx) and xs
// (dx * sum) the same for tokens.
var<workgroup> wq: array<vec4<u32>, 256>;
var<workgroup> wd: array<vec4<f32>, 32>;
var<workgroup> wm: array<vec4<f32>, 32>;
var<workgroup> xq: array<vec4<u32>, 256>;
var<workgroup> xd: array<vec4<f32>, 32>;
var<workgroup> xs: array<vec4<f32>, 32>;

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
    let n_sub = P.k / 32u;
    // Loading role: invocations 0..127 a (row, sub-block) of the weight tile, 128..255 a (token,
    // sub-block) of the activation tile. Rows and tokens past the end repeat the last one:
    // computed, never written.
    let unit = lid % 128u;
    let lr = unit % 64u;
    let ls = unit / 64u;
    let slot = (ls * 8u) * 16u + lr / 4u;
    let lane = lr % 4u;
    let rb = (P.w_row0 + min(row0 + lr, P.n_rows - 1u)) * P.row_words;
    // The token's first activation block: x_stride and x_col0 are whole blocks.
    let xb = min(t0 + lr, P.n_tok - 1u) * (P.x_stride / 32u) + P.x_col0 / 32u;
    // Computing role: rows 4 cr.. and tokens 4 ct.. of the tile.
    let cr = lid % 16u;
    let ct = lid / 16u;
    var acc: array<vec4<f32>, 4>;
    for (var j0 = 0u; j0 < n_sub; j0 += SB) {
        let j = j0 + ls;
        if (lid < 128u) {
            var sbk: SubBlock;
            if (j < n_sub) {
                sbk = sub_block(rb, j);
            }
            wq[slot][lane] = sbk.q[0];
            wq[slot + 16u][lane] = sbk.q[1];
            wq[slot + 32u][lane] = sbk.q[2];
            wq[slot + 48u][lane] = sbk.q[3];
            wq[slot + 64u][lane] = sbk.q[4];
            wq[slot + 80u][lane] = sbk.q[5];
            wq[slot + 96u][lane] = sbk.q[6];
            wq[slot + 112u][lane] = sbk.q[7];
            wd[ls * 16u + lr / 4u][lane] = sbk.dm.x;
            wm[ls * 16u + lr / 4u][lane] = sbk.dm.y;
        } else {
            var a = vec4<u32>(0u);
            var c = vec4<u32>(0u);
            var d = vec2<f32>(0.0);
            if (j < n_sub) {
                a = XQ[2u * (xb + j)];
                c = XQ[2u * (xb + j) + 1u];
                d = XD[xb + j];
            }
            xq[slot][lane] = a.x;
            xq[slot + 16u][lane] = a.y;
            xq[slot + 32u][lane] = a.z;
            xq[slot + 48u][lane] = a.w;
            xq[slot + 64u][lane] = c.x;
            xq[slot + 80u][lane] = c.y;
            xq[slot + 96u][lane] = c.z;
            xq[slot + 112u][lane] = c.w;
            xd[ls * 16u + lr / 4u][lane] = d.x;
            xs[ls * 16u + lr / 4u][lane] = d.y;
        }
        workgroupBarrier();
        for (var s = 0u; s < SB; s++) {
            // Written out per token (no index into a private array or a vector's component by a
            // loop variable), so the sums stay in registers, as the f32 kernel's accumulators.
            var i0 = vec4<i32>(0);
            var i1 = vec4<i32>(0);
            var i2 = vec4<i32>(0);
            var i3 = vec4<i32>(0);
            for (var w = 0u; w < 8u; w++) {
                let a = wq[(s * 8u + w) * 16u + cr];
                let b = xq[(s * 8u + w) * 16u + ct];
                i0 += vec4<i32>(dot4I8Packed(a.x, b.x), dot4I8Packed(a.y, b.x), dot4I8Packed(a.z, b.x), dot4I8Packed(a.w, b.x));
                i1 += vec4<i32>(dot4I8Packed(a.x, b.y), dot4I8Packed(a.y, b.y), dot4I8Packed(a.z, b.y), dot4I8Packed(a.w, b.y));
                i2 += vec4<i32>(dot4I8Packed(a.x, b.z), dot4I8Packed(a.y, b.z), dot4I8Packed(a.z, b.z), dot4I8Packed(a.w, b.z));
                i3 += vec4<i32>(dot4I8Packed(a.x, b.w), dot4I8Packed(a.y, b.w), dot4I8Packed(a.z, b.w), dot4I8Packed(a.w, b.w));
            }
            let dw = wd[s * 16u + cr];
            let mw = wm[s * 16u + cr];
            let dx = xd[s * 16u + ct];
            let sx = xs[s * 16u + ct];
            acc[0] += dw * dx.x * vec4<f32>(i0) - mw * sx.x;
            acc[1] += dw * dx.y * vec4<f32>(i1) - mw * sx.y;
            acc[2] += dw * dx.z * vec4<f32>(i2) - mw * sx.z;
            acc[3] += dw * dx.w * vec4<f32>(i3) - mw * sx.w;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let t = t0 + 4u * ct + i;
        if (t < P.n_tok) {
            for (var r = 0u; r < 4u; r++) {
                let row = row0 + 4u * cr + r;
                if (row < P.n_rows) {
                    store_y(t * P.out_stride + P.out_col0 + row, acc[i][r]);
                }
            }
        }
    }
}
