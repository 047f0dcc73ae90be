// Rope inside the attention kernels (attention.wgsl, attention_decode.wgsl: their ROPE_PAIR
// template value), which rotate q and k as they read them; needs the kernel's P.rope,
// P.rope_head_dim, P.n_rot, P.neox and the cos/sin table CS.

// For element `at` of rows of `width` values (token t) that the rotation changes: the indices of
// its pair (x, y), the pair's cos/sin index (z) and whether `at` is the pair's first element (w).
// w = 2: not rotated (rope off, or a dim past n_rot).
fn rope_pair(at: u32, width: u32, t: u32) -> vec4<u32> {
    let d = (at % width) % P.rope_head_dim;
    if (P.rope == 0u || d >= P.n_rot) {
        return vec4<u32>(at, at, 0u, 2u);
    }
    let head0 = at - d;
    let half = P.n_rot / 2u;
    var f = d / 2u;
    var i0 = 2u * f;
    var i1 = 2u * f + 1u;
    if (P.neox == 1u) {
        f = d % half;
        i0 = f;
        i1 = f + half;
    }
    return vec4<u32>(head0 + i0, head0 + i1, (t * half + f) * 2u, select(0u, 1u, d == i0));
}

fn turn(x0: f32, x1: f32, p: vec4<u32>) -> f32 {
    let c = CS[p.z];
    let s = CS[p.z + 1u];
    if (p.w == 1u) {
        return x0 * c - x1 * s;
    }
    return x0 * s + x1 * c;
}
