// Bandwidth baseline for --perf: every invocation reads 16-byte words in a grid-stride loop and
// folds them, and each workgroup writes one word so the reads cannot be optimised away. `at` is
// the first word read (windows of a larger buffer; 0 for the whole).
struct Params {
    n_vec4: u32,
    at: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> A: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> Y: array<u32>;
@group(0) @binding(2) var<uniform> P: Params;

var<workgroup> red: array<u32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let stride = nwg.x * 256u;
    var acc = vec4<u32>(0u);
    for (var i = gid.x; i < P.n_vec4; i += stride) {
        acc ^= A[P.at + i];
    }
    red[lid] = acc.x ^ acc.y ^ acc.z ^ acc.w;
    workgroupBarrier();
    if (lid == 0u) {
        var r = 0u;
        for (var i = 0u; i < 256u; i++) {
            r ^= red[i];
        }
        Y[wid.x] = r;
    }
}
