// y = f(a): op 0 scale by s, 1 silu, 2 gelu (erf), 3 gelu (tanh), 4 relu.
struct Params {
    n: u32,
    op: u32,
    s: f32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> A: array<f32>;
@group(0) @binding(1) var<storage, read_write> Y: array<f32>;
@group(0) @binding(2) var<uniform> P: Params;

{{ACT}}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= P.n) {
        return;
    }
    if (P.op == 0u) {
        Y[i] = A[i] * P.s;
    } else {
        Y[i] = act(A[i], P.op);
    }
}
