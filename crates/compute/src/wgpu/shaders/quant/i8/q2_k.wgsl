// Q2_K against int8 activations, one 32-value sub-block j (0..8) of a 256-value block: words
// [scales 4 words][qs 16 words][d | dmin]. Value l of sub-block j is 2 bits of qs byte
// 32 (j / 4) + l at shift 2 (j % 4); its two 16-value halves have scale bytes 2j and 2j + 1 (scale
// in the low nibble, min in the high one). y = d * sc * q - dmin * m, so each half needs the sum of
// its own activations: dot4I8Packed with ones gives it (the block's sum covers both halves).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let w = b + 4u + 8u * (j / 4u);
    let sh = vec4<u32>(2u * (j % 4u));
    let m2 = vec4<u32>(0x03030303u);
    let q0 = (vec4<u32>(W[w], W[w + 1u], W[w + 2u], W[w + 3u]) >> sh) & m2;
    let q1 = (vec4<u32>(W[w + 4u], W[w + 5u], W[w + 6u], W[w + 7u]) >> sh) & m2;
    let s0 = dot4I8Packed(q0.x, x0.x) + dot4I8Packed(q0.y, x0.y) + dot4I8Packed(q0.z, x0.z) + dot4I8Packed(q0.w, x0.w);
    let s1 = dot4I8Packed(q1.x, x1.x) + dot4I8Packed(q1.y, x1.y) + dot4I8Packed(q1.z, x1.z) + dot4I8Packed(q1.w, x1.w);
    let ones = 0x01010101u;
    let t0 = dot4I8Packed(ones, x0.x) + dot4I8Packed(ones, x0.y) + dot4I8Packed(ones, x0.z) + dot4I8Packed(ones, x0.w);
    let t1 = dot4I8Packed(ones, x1.x) + dot4I8Packed(ones, x1.y) + dot4I8Packed(ones, x1.z) + dot4I8Packed(ones, x1.w);
    let ssh = 16u * (j % 2u);
    let scw = W[b + j / 2u] >> ssh;
    let sc0 = i32(scw & 15u);
    let m0 = i32((scw >> 4u) & 15u);
    let sc1 = i32((scw >> 8u) & 15u);
    let m1 = i32((scw >> 12u) & 15u);
    let dm = unpack2x16float(W[b + 20u]);
    return xds.x * (dm.x * f32(sc0 * s0 + sc1 * s1) - dm.y * f32(m0 * t0 + m1 * t1));
}
