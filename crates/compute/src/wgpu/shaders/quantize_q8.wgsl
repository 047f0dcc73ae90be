// Activations to int8 blocks for the int8 decode kernel (matvec_q8.wgsl): each run of 32 values of
// a row becomes 32 signed bytes q = round(x / d) with d = max|x| / 127 (llama.cpp's Q8_0/Q8_1
// rounding), packed four to a word in QS, and (d, d * sum(q)) in DS. The sum lets a weight type
// with an offset or a minimum (Q4_0's -8, Q4_1's and Q4_K's mins) apply it once per block.
// One invocation per block: the kernel reads each activation once and is a few microseconds
// against the matrix products that read the blocks.
struct QParams {
    n_blocks: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> QS: array<u32>;
@group(0) @binding(2) var<storage, read_write> DS: array<vec2<f32>>;
@group(0) @binding(3) var<uniform> P: QParams;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let blk = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (blk >= P.n_blocks) {
        return;
    }
    var v: array<vec4<f32>, 8>;
    var amax = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        v[i] = X[blk * 8u + i];
        amax = max(amax, abs(v[i]));
    }
    let d = max(max(amax.x, amax.y), max(amax.z, amax.w)) / 127.0;
    let inv = select(0.0, 1.0 / d, d > 0.0);
    var qsum = vec4<i32>(0);
    for (var i = 0u; i < 8u; i++) {
        let q = vec4<i32>(round(v[i] * inv));
        qsum += q;
        QS[blk * 8u + i] = pack4xI8(q);
    }
    DS[blk] = vec2<f32>(d, d * f32(qsum.x + qsum.y + qsum.z + qsum.w));
}
