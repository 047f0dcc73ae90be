// Y[tok[r], c] += weights[widx[r]] * (D[r, c] + bias[bias_off + c]): one expert's outputs added
// into the tokens that chose it. A token picks an expert at most once, so rows never collide.
struct Params {
    n: u32,
    width: u32,
    has_bias: u32,
    bias_off: u32,
}

@group(0) @binding(0) var<storage, read> D: array<f32>;
@group(0) @binding(1) var<storage, read> map: array<u32>;
@group(0) @binding(2) var<storage, read> weights: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding(5) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= P.n * P.width) {
        return;
    }
    let r = i / P.width;
    let c = i % P.width;
    var v = D[i];
    if (P.has_bias == 1u) {
        v += bias[P.bias_off + c];
    }
    let t = map[2u * r];
    Y[t * P.width + c] += weights[map[2u * r + 1u]] * v;
}
