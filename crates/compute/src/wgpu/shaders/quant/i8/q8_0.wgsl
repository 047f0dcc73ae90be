// Q8_0 against int8 activations: words [d | pad][qs 8 words of signed bytes], already the packed
// form dot4I8Packed takes.
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let s = dot4I8Packed(W[b + 1u], x0.x) + dot4I8Packed(W[b + 2u], x0.y) + dot4I8Packed(W[b + 3u], x0.z)
        + dot4I8Packed(W[b + 4u], x0.w) + dot4I8Packed(W[b + 5u], x1.x) + dot4I8Packed(W[b + 6u], x1.y)
        + dot4I8Packed(W[b + 7u], x1.z) + dot4I8Packed(W[b + 8u], x1.w);
    return f16lo(W[b]) * xds.x * f32(s);
}
