// Q4_K grouped (quant/q4_kg.wgsl) against int8 activations: sub-block j (0..8) of the 256-value
// block at word b has its 16 quant bytes at words b + 4 + 4j.. in Q4_0's order (low nibbles values
// 0..16, high 16..32), its scale and min in the bit fields of words b + 1..b + 4 (this variant
// reads 4-byte words, for kernels binding W as words).
// sum (d * sc * q - dmin * m) * dx * qx = d * dx * sc * sum(q * qx) - dmin * m * dx * sum(qx).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let w = b + 4u + 4u * j;
    let q = vec4<u32>(W[w], W[w + 1u], W[w + 2u], W[w + 3u]);
    let s = dot_nib32(q, x0, x1);
    let h = W[b + 3u];
    let sc = extractBits(W[b + 1u], 4u * j, 4u) | (extractBits(h, 2u * j, 2u) << 4u);
    let m = extractBits(W[b + 2u], 4u * j, 4u) | (extractBits(h, 16u + 2u * j, 2u) << 4u);
    let dm = unpack2x16float(W[b]);
    return dm.x * xds.x * f32(i32(sc) * s) - dm.y * f32(m) * xds.y;
}
