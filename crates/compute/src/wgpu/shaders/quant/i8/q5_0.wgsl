// Q5_0 against int8 activations: words [d | pad][qh][qs 4 words]. Nibbles as Q4_0 (low nibbles
// values 0..16, high ones 16..32); bit v of qh is value v's fifth bit. y = d * (q - 16), so
// sum y * dx * qx = d * (dx * sum(q * qx) - 16 * dx * sum(qx)).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let qh = W[b + 1u];
    let q = vec4<u32>(W[b + 2u], W[b + 3u], W[b + 4u], W[b + 5u]);
    let lo = (q & vec4<u32>(0x0f0f0f0fu))
        | vec4<u32>(spread4(qh), spread4(qh >> 4u), spread4(qh >> 8u), spread4(qh >> 12u));
    let hi = ((q >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu))
        | vec4<u32>(spread4(qh >> 16u), spread4(qh >> 20u), spread4(qh >> 24u), spread4(qh >> 28u));
    let s = dot4I8Packed(lo.x, x0.x) + dot4I8Packed(lo.y, x0.y) + dot4I8Packed(lo.z, x0.z) + dot4I8Packed(lo.w, x0.w)
        + dot4I8Packed(hi.x, x1.x) + dot4I8Packed(hi.y, x1.y) + dot4I8Packed(hi.z, x1.z) + dot4I8Packed(hi.w, x1.w);
    return f16lo(W[b]) * (xds.x * f32(s) - 16.0 * xds.y);
}
