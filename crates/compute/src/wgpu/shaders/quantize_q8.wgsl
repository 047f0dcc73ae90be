// Activations to int8 blocks for the int8 decode kernel (matvec_q8.wgsl): each run of 32 values of
// a row becomes one block (q8_block.wgsl).
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

{{Q8_BLOCK}}

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
    for (var i = 0u; i < 8u; i++) {
        v[i] = X[blk * 8u + i];
    }
    q8_block(v, blk);
}
