// Row normalisation with the row in registers: one workgroup of WG invocations per row, each
// holding NV vec4 of it (vec4 index p + j * WG, so every load instruction of a subgroup reads
// consecutive 16-byte words), loaded once together with the weight and bias, so the kernel is
// one round trip to memory for its inputs and one for its outputs. Same modes and outputs as
// norm.wgsl (which stays for widths that are not whole vec4 or wider than WG * NV * 4):
// mode 0 RMS norm, mode 1 layer norm, times the weight (has_w), plus the bias (has_b), and with
// q8 = 1 the row's int8 blocks (as q8_block.wgsl makes them from Y, bit for bit), made from the
// registers: a block is 8 consecutive vec4, held by 8 consecutive positions for the same j.
//
// Why: norm.wgsl (a tree reduction through workgroup memory, then the int8 blocks re-read from Y
// after a storage barrier, one invocation per block with 32 scalar loads) took 23 us per decode
// norm on the H200 where a dependent dispatch costs 3.
//
// SG = 1 (the device has subgroups): sums by subgroupAdd with one workgroup-memory step across
// subgroups; when the subgroups are full and at least 8 wide, positions follow subgroup lanes
// (p = sg_id * sg_size + sg_lane), so a block's 8 holders are lanes 8k..8k+7 of one subgroup and
// its maximum and integer sum take three subgroupShuffleXor steps each, no barrier. Otherwise
// (SG = 0, or narrow or partial subgroups) p = local index and both go through workgroup memory.
// Needs width % 4 == 0 (and width % 32 == 0 for q8), WG a power of two >= 8.
{{NORM_PARAMS}}

{{NORM_IO_VEC4}}

const WG: u32 = {{WG}}u;
const NV: u32 = {{NV}}u;

// Written before read (the pipeline skips WGSL's zeroing): each reduction writes red[k * WG + i]
// for the slots it then reads (its own k, so the two reductions of a layer norm need no barrier
// between them); blk[p] is written by every position before the barrier after which the block's
// 8 entries are read, and not rewritten until a barrier after those reads; lanes_ok is written
// by invocation 0 before workgroupUniformLoad reads it.
var<workgroup> red: array<f32, {{RED_LEN}}>;
var<workgroup> blk: array<f32, WG>;
var<workgroup> lanes_ok: u32;

{{REDUCE}}

fn max4(v: vec4<f32>) -> f32 {
    let a = abs(v);
    return max(max(a.x, a.y), max(a.z, a.w));
}

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARGS}}
) {
    let row = wid.x + wid.y * nwg.x;
    // Uniform per workgroup, so every barrier below is reached by all or none.
    if (row >= P.n_rows) {
        return;
    }
    {{LANES}}
    let shuffles = workgroupUniformLoad(&lanes_ok) == 1u;
    var p = lid;
    {{POSITION}}
    let nv4 = P.width / 4u;
    let base = row * nv4;
    var v: array<vec4<f32>, NV>;
    var wv: array<vec4<f32>, NV>;
    var bv: array<vec4<f32>, NV>;
    var s = vec4<f32>(0.0);
    for (var j = 0u; j < NV; j++) {
        let i = p + j * WG;
        v[j] = vec4<f32>(0.0);
        wv[j] = vec4<f32>(1.0);
        bv[j] = vec4<f32>(0.0);
        if (i < nv4) {
            v[j] = X[base + i];
            if (P.has_w == 1u) {
                wv[j] = Wt[i];
            }
            if (P.has_b == 1u) {
                bv[j] = Bs[i];
            }
        }
        s += v[j];
    }
    let n = f32(P.width);
    var mean = 0.0;
    if (P.mode == 1u) {
        mean = reduce_sum(s.x + s.y + s.z + s.w, 1u, lid{{SG_CALL}}) / n;
    }
    var ss = 0.0;
    for (var j = 0u; j < NV; j++) {
        if (p + j * WG < nv4) {
            let d = v[j] - mean;
            ss += dot(d, d);
        }
    }
    let inv = 1.0 / sqrt(reduce_sum(ss, 0u, lid{{SG_CALL}}) / n + P.eps);
    for (var j = 0u; j < NV; j++) {
        let i = p + j * WG;
        var y = (v[j] - mean) * inv;
        if (P.has_w == 1u) {
            y *= wv[j];
        }
        if (P.has_b == 1u) {
            y += bv[j];
        }
        v[j] = y;
        if (i < nv4) {
            Y[base + i] = y;
        }
    }
    if (P.q8 == 1u) {
        for (var j = 0u; j < NV; j++) {
            let i = p + j * WG;
            // Positions past the row hold zeros: they never raise a block's maximum, and their
            // blocks (whole, since the row is) are not written.
            let y = select(vec4<f32>(0.0), v[j], i < nv4);
            var amax = max4(y);
            if (shuffles) {
                {{SHUFFLE_MAX}}
            } else {
                blk[p] = amax;
                workgroupBarrier();
                let b0 = p & ~7u;
                for (var t = 0u; t < 8u; t++) {
                    amax = max(amax, blk[b0 + t]);
                }
                workgroupBarrier();
            }
            let d = amax / 127.0;
            let dinv = select(0.0, 1.0 / d, d > 0.0);
            let q = vec4<i32>(round(y * dinv));
            var qsum = q.x + q.y + q.z + q.w;
            if (shuffles) {
                {{SHUFFLE_SUM}}
            } else {
                // |qsum| <= 32 * 127: exact in f32.
                blk[p] = f32(qsum);
                workgroupBarrier();
                if (p % 8u == 0u) {
                    var t_sum = 0.0;
                    for (var t = 0u; t < 8u; t++) {
                        t_sum += blk[p + t];
                    }
                    qsum = i32(t_sum);
                }
                workgroupBarrier();
            }
            if (i < nv4) {
                QS[base + i] = pack4xI8(q);
                if (p % 8u == 0u) {
                    DS[(base + i) / 8u] = vec2<f32>(d, d * f32(qsum));
                }
            }
        }
    }
}
