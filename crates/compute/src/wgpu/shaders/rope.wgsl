// Rotary embedding of x [n_tokens, n_heads * head_dim]; cos/sin [n_tokens, n_rot / 2] come from
// the host (computed as the CPU reference does: f64 trigonometry of f32 angles), so the GPU only
// rotates. Pairs (i, i + n_rot/2) when neox, else (2i, 2i + 1); dims past n_rot pass through.
struct Params {
    n_tok: u32,
    width: u32,
    head_dim: u32,
    n_rot: u32,
    neox: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> CS: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= P.n_tok * P.width) {
        return;
    }
    let t = i / P.width;
    let d = (i % P.width) % P.head_dim;
    let head0 = i - d;
    let half = P.n_rot / 2u;
    if (d >= P.n_rot) {
        Y[i] = X[i];
        return;
    }
    var f: u32;
    var a: u32;
    var b: u32;
    if (P.neox == 1u) {
        f = d % half;
        a = head0 + f;
        b = a + half;
    } else {
        f = d / 2u;
        a = head0 + 2u * f;
        b = a + 1u;
    }
    let c = CS[(t * half + f) * 2u];
    let s = CS[(t * half + f) * 2u + 1u];
    let x0 = X[a];
    let x1 = X[b];
    if (i == a) {
        Y[i] = x0 * c - x1 * s;
    } else {
        Y[i] = x0 * s + x1 * c;
    }
}
