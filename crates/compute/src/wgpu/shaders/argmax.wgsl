// Index of the largest value of each row (lowest index on ties), one workgroup per row.
struct Params {
    width: u32,
    n_rows: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> X: array<f32>;
@group(0) @binding(1) var<storage, read_write> Y: array<u32>;
@group(0) @binding(2) var<uniform> P: Params;

const WG: u32 = 256u;
var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= P.n_rows) {
        return;
    }
    let base = row * P.width;
    var bv = -3.4028235e38;
    var bi = 0xffffffffu;
    for (var i = lid; i < P.width; i += WG) {
        let v = X[base + i];
        if (v > bv || bi == 0xffffffffu) {
            bv = v;
            bi = i;
        }
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            let ov = best_v[lid + s];
            let oi = best_i[lid + s];
            let mine = best_i[lid];
            if (oi != 0xffffffffu && (mine == 0xffffffffu || ov > best_v[lid] || (ov == best_v[lid] && oi < mine))) {
                best_v[lid] = ov;
                best_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        Y[row] = best_i[0];
    }
}
