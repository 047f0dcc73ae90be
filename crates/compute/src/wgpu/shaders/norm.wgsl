// Row normalisation, one workgroup per row of `width` values.
// mode 0: RMS norm x / sqrt(mean(x^2) + eps); mode 1: layer norm (x - mean) / sqrt(var + eps).
// Then times the weight (has_w) and plus the bias (has_b).
// q8 = 1: the row is also written as int8 blocks for the int8 decode kernel, exactly as
// quantize_q8.wgsl makes them from Y (q8_block.wgsl, read back from Y after a storage barrier), so
// the products after a norm need no quantize dispatch of their own. Needs width % 32 == 0.
{{NORM_PARAMS}}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> Wt: array<f32>;
@group(0) @binding(2) var<storage, read> Bs: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<storage, read_write> QS: array<u32>;
@group(0) @binding(5) var<storage, read_write> DS: array<vec2<f32>>;
@group(0) @binding(6) var<uniform> P: Params;

const WG: u32 = 256u;
// Written before read (so the pipeline skips WGSL's zeroing, Plain::workgroup_memory_written_first):
// every invocation writes red[lid] at the start of reduce_sum (all 256 call it; the only early
// return depends on the workgroup alone), and reads come after the barrier that follows.
var<workgroup> red: array<f32, 256>;

{{REDUCE_SHARED}}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= P.n_rows) {
        return;
    }
    let base = row * P.width;
    let n = f32(P.width);
    var mean = 0.0;
    if (P.mode == 1u) {
        var s = 0.0;
        for (var i = lid; i < P.width; i += WG) {
            s += X[base + i];
        }
        mean = reduce_sum(s, lid) / n;
    }
    var ss = 0.0;
    for (var i = lid; i < P.width; i += WG) {
        let d = X[base + i] - mean;
        ss += d * d;
    }
    let inv = 1.0 / sqrt(reduce_sum(ss, lid) / n + P.eps);
    for (var i = lid; i < P.width; i += WG) {
        var y = (X[base + i] - mean) * inv;
        if (P.has_w == 1u) {
            y *= Wt[i];
        }
        if (P.has_b == 1u) {
            y += Bs[i];
        }
        Y[base + i] = y;
    }
    if (P.q8 == 1u) {
        // Other invocations' Y values of this row: visible after the barrier (one workgroup).
        storageBarrier();
        let n_blocks = P.width / 32u;
        for (var b = lid; b < n_blocks; b += WG) {
            quantize_block(row * n_blocks + b);
        }
    }
}

// Block `blk` of Y (32 values) to int8.
fn quantize_block(blk: u32) {
    var v: array<vec4<f32>, 8>;
    for (var i = 0u; i < 8u; i++) {
        let at = blk * 32u + i * 4u;
        v[i] = vec4<f32>(Y[at], Y[at + 1u], Y[at + 2u], Y[at + 3u]);
    }
    q8_block(v, blk);
}

{{Q8_BLOCK}}
