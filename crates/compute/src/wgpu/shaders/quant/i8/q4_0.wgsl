// Q4_0 against int8 activations: words [d | pad][qs 4 words]; byte i of qs holds value i (low
// nibble) and i + 16 (high), so the low nibbles meet x words 0..3 and the high ones x words 4..7.
// sum d * (q - 8) * dx * qx = d * (dx * sum(q * qx) - 8 * dx * sum(qx)): the offset costs one
// multiply-add per block through the activation block's sum (xds.y).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let q = vec4<u32>(W[b + 1u], W[b + 2u], W[b + 3u], W[b + 4u]);
    let lo = q & vec4<u32>(0x0f0f0f0fu);
    let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu);
    let s = dot4I8Packed(lo.x, x0.x) + dot4I8Packed(lo.y, x0.y) + dot4I8Packed(lo.z, x0.z) + dot4I8Packed(lo.w, x0.w)
        + dot4I8Packed(hi.x, x1.x) + dot4I8Packed(hi.y, x1.y) + dot4I8Packed(hi.z, x1.z) + dot4I8Packed(hi.w, x1.w);
    return f16lo(W[b]) * (xds.x * f32(s) - 8.0 * xds.y);
}
