// Q4_1 against int8 activations: words [d | m][qs 4 words], nibbles as Q4_0. y = d * q + m, so
// sum y * dx * qx = d * dx * sum(q * qx) + m * dx * sum(qx) (xds.y).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let q = vec4<u32>(W[b + 1u], W[b + 2u], W[b + 3u], W[b + 4u]);
    let lo = q & vec4<u32>(0x0f0f0f0fu);
    let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu);
    let s = dot4I8Packed(lo.x, x0.x) + dot4I8Packed(lo.y, x0.y) + dot4I8Packed(lo.z, x0.z) + dot4I8Packed(lo.w, x0.w)
        + dot4I8Packed(hi.x, x1.x) + dot4I8Packed(hi.y, x1.y) + dot4I8Packed(hi.z, x1.z) + dot4I8Packed(hi.w, x1.w);
    let dm = unpack2x16float(W[b]);
    return dm.x * xds.x * f32(s) + dm.y * xds.y;
}
