// Q4_0 grouped (quant/q4_0g.wgsl) against int8 activations: sub-block j (0..8) of the 256-value
// block at word b is Q4_0 block j, its scale the half j % 2 of word b + j / 2, its quants words
// b + 4 + 4j.. (16-byte aligned; this variant reads them as 4-byte words, for kernels binding W as
// words). Arithmetic as i8/q4_0.wgsl.
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let w = b + 4u + 4u * j;
    let q = vec4<u32>(W[w], W[w + 1u], W[w + 2u], W[w + 3u]);
    let s = dot_nib32(q, x0, x1);
    let d = unpack2x16float(W[b + j / 2u])[j % 2u];
    return d * (xds.x * f32(s) - 8.0 * xds.y);
}
