// IQ4_NL against int8 activations: words [d | pad][qs 4 words], nibbles as Q4_0 (low nibbles
// values 0..16, high ones 16..32) indexing the non-linear codebook, whose entries are signed bytes
// (iq4_kq4 in common.wgsl). y = d * kv[q], so sum y * dx * qx = d * dx * sum(kv[q] * qx).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let q = vec4<u32>(W[b + 1u], W[b + 2u], W[b + 3u], W[b + 4u]);
    let s = dot4I8Packed(iq4_kq4(q.x), x0.x) + dot4I8Packed(iq4_kq4(q.y), x0.y) + dot4I8Packed(iq4_kq4(q.z), x0.z)
        + dot4I8Packed(iq4_kq4(q.w), x0.w) + dot4I8Packed(iq4_kq4(q.x >> 4u), x1.x)
        + dot4I8Packed(iq4_kq4(q.y >> 4u), x1.y) + dot4I8Packed(iq4_kq4(q.z >> 4u), x1.z)
        + dot4I8Packed(iq4_kq4(q.w >> 4u), x1.w);
    return f16lo(W[b]) * xds.x * f32(s);
}
