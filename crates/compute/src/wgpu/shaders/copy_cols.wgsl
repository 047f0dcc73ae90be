// Y[r, dst_col0 + c] = X[r, src_col0 + c] for c < n_cols: slicing and concatenating columns.
struct Params {
    n_rows: u32,
    n_cols: u32,
    src_width: u32,
    src_col0: u32,
    dst_width: u32,
    dst_col0: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read_write> Y: array<f32>;
@group(0) @binding(2) var<uniform> P: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    if (i >= P.n_rows * P.n_cols) {
        return;
    }
    let r = i / P.n_cols;
    let c = i % P.n_cols;
    Y[r * P.dst_width + P.dst_col0 + c] = X[r * P.src_width + P.src_col0 + c];
}
