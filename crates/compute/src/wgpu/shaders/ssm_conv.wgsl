// Depthwise causal convolution over a rolling window (Mamba's conv1d, LFM2's short conv). With
// xx = the k - 1 rows of the state followed by the n rows of x: mode 0 writes
// Y[t, c] = sum_j W[c, j] * xx[t + j, c]; mode 1 writes the last k - 1 rows of xx (the next state)
// to Y. Separate dispatches, so no invocation reads a row another one writes.
struct Params {
    n_tok: u32,
    channels: u32,
    k: u32,
    mode: u32,
}

@group(0) @binding(0) var<storage, read> S: array<f32>;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> Wt: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<uniform> P: Params;

fn xx(r: u32, c: u32) -> f32 {
    if (r + 1u < P.k) {
        return S[r * P.channels + c];
    }
    return X[(r + 1u - P.k) * P.channels + c];
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    var rows = P.n_tok;
    if (P.mode == 1u) {
        rows = P.k - 1u;
    }
    if (i >= rows * P.channels) {
        return;
    }
    let r = i / P.channels;
    let c = i % P.channels;
    if (P.mode == 1u) {
        Y[i] = xx(P.n_tok + r, c);
        return;
    }
    var acc = 0.0;
    for (var j = 0u; j < P.k; j++) {
        acc += Wt[c * P.k + j] * xx(r + j, c);
    }
    Y[i] = acc;
}
