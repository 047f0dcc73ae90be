// Y[r, :] = X[rows[r], :]: the tokens routed to one expert, gathered into a dense batch.
struct Params {
    n: u32,
    width: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read> rows: array<u32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= P.n * P.width) {
        return;
    }
    let r = i / P.width;
    let c = i % P.width;
    Y[i] = X[rows[r] * P.width + c];
}
