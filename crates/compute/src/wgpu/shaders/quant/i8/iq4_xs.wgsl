// IQ4_XS against int8 activations, one 32-value sub-block j (0..8) of a 256-value block: words
// [d | scales_h][scales_l][qs 32 words]; sub-block j is qs words 4j..4j+4 laid out as IQ4_NL, with
// the 6-bit scale (low 4 bits at bit 4j of scales_l, high 2 at bit 2j of scales_h) offset by 32.
// y = d * (ls - 32) * kv[q].
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let w0 = W[b];
    let low = (W[b + 1u] >> (4u * j)) & 0xfu;
    let high = ((w0 >> 16u) >> (2u * j)) & 3u;
    let ls = i32(low | (high << 4u)) - 32;
    let w = b + 2u + 4u * j;
    let q = vec4<u32>(W[w], W[w + 1u], W[w + 2u], W[w + 3u]);
    let s = dot4I8Packed(iq4_kq4(q.x), x0.x) + dot4I8Packed(iq4_kq4(q.y), x0.y) + dot4I8Packed(iq4_kq4(q.z), x0.z)
        + dot4I8Packed(iq4_kq4(q.w), x0.w) + dot4I8Packed(iq4_kq4(q.x >> 4u), x1.x)
        + dot4I8Packed(iq4_kq4(q.y >> 4u), x1.y) + dot4I8Packed(iq4_kq4(q.z >> 4u), x1.z)
        + dot4I8Packed(iq4_kq4(q.w >> 4u), x1.w);
    return f16lo(w0) * f32(ls) * xds.x * f32(s);
}
