// Mamba-2 selective scan, token by token (transformers' mamba2 recurrent update). One workgroup
// per (head h, value i) owns the state row S[h, i, :] (d_state values, up to 4 per invocation,
// kept in registers); per token: dt = softplus(dt_raw + dt_bias[h]), S = S * exp(dt * a[h]) +
// dt * B[g] * x, y = S . C[g] + d[h] * x. ADB holds a, d and dt_bias, n_head values each.
struct Params {
    n_tok: u32,
    n_head: u32,
    head_dim: u32,
    d_state: u32,
    n_group: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> DT: array<f32>;
@group(0) @binding(2) var<storage, read> Bm: array<f32>;
@group(0) @binding(3) var<storage, read> Cm: array<f32>;
@group(0) @binding(4) var<storage, read> ADB: array<f32>;
@group(0) @binding(5) var<storage, read_write> St: array<f32>;
@group(0) @binding(6) var<storage, read_write> Y: array<f32>;
@group(0) @binding(7) var<uniform> P: Params;

const WG: u32 = 64u;
const MAXS: u32 = 4u;
var<workgroup> red: array<f32, 64>;

{{REDUCE_SHARED}}

fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    return log(1.0 + exp(x));
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= P.n_head * P.head_dim) {
        return;
    }
    let h = idx / P.head_dim;
    let i = idx % P.head_dim;
    let g = h / (P.n_head / P.n_group);
    let ds = P.d_state;
    let bc_width = P.n_group * ds;
    let a = ADB[h];
    let skip = ADB[P.n_head + h];
    let bias = ADB[2u * P.n_head + h];
    let sb = idx * ds;
    var s: array<f32, MAXS>;
    for (var r = 0u; r < MAXS; r++) {
        let j = lid + r * WG;
        if (j < ds) {
            s[r] = St[sb + j];
        }
    }
    let width = P.n_head * P.head_dim;
    for (var t = 0u; t < P.n_tok; t++) {
        let dt = softplus(DT[t * P.n_head + h] + bias);
        let decay = exp(dt * a);
        let xi = X[t * width + h * P.head_dim + i];
        var acc = 0.0;
        for (var r = 0u; r < MAXS; r++) {
            let j = lid + r * WG;
            if (j < ds) {
                let bj = Bm[t * bc_width + g * ds + j];
                s[r] = s[r] * decay + dt * bj * xi;
                acc += s[r] * Cm[t * bc_width + g * ds + j];
            }
        }
        let y = reduce_sum(acc, lid);
        if (lid == 0u) {
            Y[t * width + h * P.head_dim + i] = y + skip * xi;
        }
    }
    for (var r = 0u; r < MAXS; r++) {
        let j = lid + r * WG;
        if (j < ds) {
            St[sb + j] = s[r];
        }
    }
}
