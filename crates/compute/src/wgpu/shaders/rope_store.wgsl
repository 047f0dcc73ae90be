// One attention step's rotary embedding and cache write in one pass: q rotated into QO, k rotated
// into the key cache at rows pos0.., v copied into the value cache at rows pos0.. (the work of two
// rope dispatches and two cache copies). The rotation is rope.wgsl's, term for term: cos/sin
// [n_tokens, n_rot / 2] from the host, pairs (i, i + n_rot/2) when neox else (2i, 2i + 1), dims
// past n_rot passed through.
struct Params {
    n_tok: u32,
    q_width: u32,
    k_width: u32,
    v_width: u32,
    head_dim: u32,
    n_rot: u32,
    neox: u32,
    pos0: u32,
}

@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> K: array<f32>;
@group(0) @binding(2) var<storage, read> V: array<f32>;
@group(0) @binding(3) var<storage, read> CS: array<f32>;
@group(0) @binding(4) var<storage, read_write> QO: array<f32>;
@group(0) @binding(5) var<storage, read_write> KC: array<f32>;
@group(0) @binding(6) var<storage, read_write> VC: array<f32>;
@group(0) @binding(7) var<uniform> P: Params;

// For dim d < n_rot of a head: the offsets of its pair within the head and the pair's frequency.
fn pair(d: u32) -> vec3<u32> {
    let half = P.n_rot / 2u;
    if (P.neox == 1u) {
        let f = d % half;
        return vec3<u32>(f, f + half, f);
    }
    let f = d / 2u;
    return vec3<u32>(2u * f, 2u * f + 1u, f);
}

// cos and sin of token t's frequency f.
fn cos_sin(t: u32, f: u32) -> vec2<f32> {
    let at = (t * (P.n_rot / 2u) + f) * 2u;
    return vec2<f32>(CS[at], CS[at + 1u]);
}

fn turn(x0: f32, x1: f32, cs: vec2<f32>, first: bool) -> f32 {
    if (first) {
        return x0 * cs.x - x1 * cs.y;
    }
    return x0 * cs.y + x1 * cs.x;
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    let n_q = P.n_tok * P.q_width;
    let n_k = P.n_tok * P.k_width;
    if (i < n_q) {
        let t = i / P.q_width;
        let d = (i % P.q_width) % P.head_dim;
        if (d >= P.n_rot) {
            QO[i] = Q[i];
            return;
        }
        let head0 = i - d;
        let p = pair(d);
        QO[i] = turn(Q[head0 + p.x], Q[head0 + p.y], cos_sin(t, p.z), d == p.x);
        return;
    }
    let j = i - n_q;
    if (j < n_k) {
        let out = P.pos0 * P.k_width + j;
        let t = j / P.k_width;
        let d = (j % P.k_width) % P.head_dim;
        if (d >= P.n_rot) {
            KC[out] = K[j];
            return;
        }
        let head0 = j - d;
        let p = pair(d);
        KC[out] = turn(K[head0 + p.x], K[head0 + p.y], cos_sin(t, p.z), d == p.x);
        return;
    }
    let m = j - n_k;
    if (m < P.n_tok * P.v_width) {
        VC[P.pos0 * P.v_width + m] = V[m];
    }
}
