// out[i, :] = dequantized row ids[i] of a weight chunk holding rows row0..row0+n_rows; ids outside
// the chunk are left to the dispatch of the chunk that holds them. One invocation per 8 values.
// Template parameter (see shaders.rs): QUANT.
struct Params {
    k: u32,
    n_rows: u32,
    n_ids: u32,
    row_words: u32,
    row0: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> W: array<u32>;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

{{QUANT}}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let n_groups = (P.k + 7u) / 8u;
    let idx = gid.x + gid.y * nwg.x * 64u;
    if (idx >= n_groups * P.n_ids) {
        return;
    }
    let i = idx / n_groups;
    let g = idx % n_groups;
    let id = ids[i];
    if (id < P.row0 || id >= P.row0 + P.n_rows) {
        return;
    }
    let gpb = BV / 8u;
    let v = dq8((id - P.row0) * P.row_words + (g / gpb) * BW, g % gpb);
    let vals = array<f32, 8>(v.a.x, v.a.y, v.a.z, v.a.w, v.b.x, v.b.y, v.b.z, v.b.w);
    for (var c = 0u; c < 8u; c++) {
        let col = g * 8u + c;
        if (col < P.k) {
            Y[i * P.k + col] = vals[c];
        }
    }
}
