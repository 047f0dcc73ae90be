// y = glu(gate, up): op 1..4 act(gate) * up (codes as act.wgsl); op 5 gpt-oss SwiGLU: gate clamped
// to (-inf, limit], up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate).
struct Params {
    n: u32,
    op: u32,
    alpha: f32,
    limit: f32,
}

@group(0) @binding(0) var<storage, read> G: array<f32>;
@group(0) @binding(1) var<storage, read> U: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

{{ACT}}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= P.n) {
        return;
    }
    Y[i] = glu_act(G[i], U[i], P.op, P.alpha, P.limit);
}
