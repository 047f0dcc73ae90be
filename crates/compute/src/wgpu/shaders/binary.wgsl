// y = a op b, where b has a's length or is one row broadcast over a's rows (b_len = row width).
// b starts at element b_off (one expert's bias row of a stacked bias). op 0: add, 1: mul.
struct Params {
    n: u32,
    b_len: u32,
    op: u32,
    b_off: u32,
}

@group(0) @binding(0) var<storage, read> A: array<f32>;
@group(0) @binding(1) var<storage, read> B: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= P.n) {
        return;
    }
    let b = B[P.b_off + i % P.b_len];
    if (P.op == 0u) {
        Y[i] = A[i] + b;
    } else {
        Y[i] = A[i] * b;
    }
}
