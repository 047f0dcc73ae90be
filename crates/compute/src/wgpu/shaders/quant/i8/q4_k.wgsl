// Q4_K against int8 activations, one 32-value sub-block j (0..8) of a 256-value block: words
// [d | dmin][scales 3 words][qs 32 words]; sub-block j is bytes 32 (j / 2).. of qs, low nibbles for
// even j, high for odd, with the 6-bit scale and min of ggml's get_scale_min_k4.
// sum (d * sc * q - dmin * m) * dx * qx = d * sc * dx * sum(q * qx) - dmin * m * dx * sum(qx).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let w = b + 4u + 8u * (j / 2u);
    let sh = vec4<u32>(4u * (j % 2u));
    let m4 = vec4<u32>(0x0f0f0f0fu);
    let q0 = (vec4<u32>(W[w], W[w + 1u], W[w + 2u], W[w + 3u]) >> sh) & m4;
    let q1 = (vec4<u32>(W[w + 4u], W[w + 5u], W[w + 6u], W[w + 7u]) >> sh) & m4;
    let s = dot4I8Packed(q0.x, x0.x) + dot4I8Packed(q0.y, x0.y) + dot4I8Packed(q0.z, x0.z) + dot4I8Packed(q0.w, x0.w)
        + dot4I8Packed(q1.x, x1.x) + dot4I8Packed(q1.y, x1.y) + dot4I8Packed(q1.z, x1.z) + dot4I8Packed(q1.w, x1.w);
    // Scales words: bytes 0..3 (s0), 4..7 (s1), 8..11 (s2). For j < 4: sc = s0[j] & 63,
    // m = s1[j] & 63; else sc = (s2[j-4] & 15) | (s0[j-4] >> 6) << 4, m = (s2[j-4] >> 4) | (s1[j-4] >> 6) << 4.
    let s0 = W[b + 1u];
    let s1 = W[b + 2u];
    let s2 = W[b + 3u];
    let bsh = 8u * (j % 4u);
    let a0 = (s0 >> bsh) & 0xffu;
    let a1 = (s1 >> bsh) & 0xffu;
    let a2 = (s2 >> bsh) & 0xffu;
    let lo = j < 4u;
    let sc = select((a2 & 15u) | ((a0 >> 6u) << 4u), a0 & 63u, lo);
    let m = select((a2 >> 4u) | ((a1 >> 6u) << 4u), a1 & 63u, lo);
    let dm = unpack2x16float(W[b]);
    return dm.x * f32(sc) * xds.x * f32(s) - dm.y * f32(m) * xds.y;
}
