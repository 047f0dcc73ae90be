// One decode row's RMS norm spread over a workgroup per 32-value block: every workgroup sums the
// squares of the whole row (the row is 16 KiB at 4096 values, read from L2 by each), then
// normalises its own block, writes it, and with q8 = 1 its int8 block (as q8_block.wgsl makes
// it). Same bindings and parameters as norm_reg.wgsl (mode 0 only: RMS norm, times the weight,
// plus the bias; one row).
//
// Why: norm_reg.wgsl puts the row in ONE workgroup, so its chain (loads, two reductions, the
// int8 blocks, the stores) runs on one SM while the GPU waits between two large products; on
// the H200 a decode norm cost ~9 us of an 8B layer's ~120 (two per layer; measured by leaving
// them out). Here the chain is one load round, one reduction and one block per workgroup.
//
// SG = 1: the row sum by subgroupAdd and one workgroup-memory step; else a tree through
// workgroup memory. The block's maximum and integer sum go through workgroup memory (8 values).
// Workgroup memory is written before it is read (the pipeline skips zeroing): red by the
// reduction before its barrier, bmax / bsum by invocations lid < 8 before the barriers after
// which they are read.
{{NORM_PARAMS}}

{{NORM_IO_VEC4}}

const WG: u32 = {{WG}}u;

var<workgroup> red: array<f32, {{RED_LEN}}>;
var<workgroup> bmax: array<f32, 8>;
var<workgroup> bsum: array<i32, 8>;

{{REDUCE}}

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
    let blk = wid.x + wid.y * nwg.x;
    // Uniform per workgroup, so every barrier below is reached by all or none.
    if (blk >= P.width / 32u) {
        return;
    }
    let nv4 = P.width / 4u;
    var ss = 0.0;
    for (var i = lid; i < nv4; i += WG) {
        let v = X[i];
        ss += dot(v, v);
    }
    let inv = 1.0 / sqrt(reduce_sum(ss, 0u, lid{{SG_CALL}}) / f32(P.width) + P.eps);
    // The block: 8 vec4, one per invocation lid < 8.
    let i = blk * 8u + min(lid, 7u);
    var y = X[i] * inv;
    if (P.has_w == 1u) {
        y *= Wt[i];
    }
    if (P.has_b == 1u) {
        y += Bs[i];
    }
    if (lid < 8u) {
        Y[i] = y;
        let a = abs(y);
        bmax[lid] = max(max(a.x, a.y), max(a.z, a.w));
    }
    if (P.q8 == 0u) {
        return;
    }
    workgroupBarrier();
    var amax = 0.0;
    for (var t = 0u; t < 8u; t++) {
        amax = max(amax, bmax[t]);
    }
    let d = amax / 127.0;
    let q = vec4<i32>(round(y * select(0.0, 1.0 / d, d > 0.0)));
    if (lid < 8u) {
        QS[i] = pack4xI8(q);
        bsum[lid] = q.x + q.y + q.z + q.w;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var qsum = 0;
        for (var t = 0u; t < 8u; t++) {
            qsum += bsum[t];
        }
        DS[blk] = vec2<f32>(d, d * f32(qsum));
    }
}
