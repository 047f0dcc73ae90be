// Q5_K against int8 activations, one 32-value sub-block j (0..8) of a 256-value block: words
// [d | dmin][scales 3 words][qh 8 words][qs 32 words]. As Q4_K (i8/q4_k.wgsl) plus a fifth bit:
// bit j of qh[l] for value l of the sub-block. y = d * sc * q - dmin * m.
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let w = b + 12u + 8u * (j / 2u);
    let sh = vec4<u32>(4u * (j % 2u));
    let m4 = vec4<u32>(0x0f0f0f0fu);
    let hb = vec4<u32>(j);
    let m1 = vec4<u32>(0x01010101u);
    let h0 = ((vec4<u32>(W[b + 4u], W[b + 5u], W[b + 6u], W[b + 7u]) >> hb) & m1) << vec4<u32>(4u);
    let h1 = ((vec4<u32>(W[b + 8u], W[b + 9u], W[b + 10u], W[b + 11u]) >> hb) & m1) << vec4<u32>(4u);
    let q0 = ((vec4<u32>(W[w], W[w + 1u], W[w + 2u], W[w + 3u]) >> sh) & m4) | h0;
    let q1 = ((vec4<u32>(W[w + 4u], W[w + 5u], W[w + 6u], W[w + 7u]) >> sh) & m4) | h1;
    let s = dot4I8Packed(q0.x, x0.x) + dot4I8Packed(q0.y, x0.y) + dot4I8Packed(q0.z, x0.z) + dot4I8Packed(q0.w, x0.w)
        + dot4I8Packed(q1.x, x1.x) + dot4I8Packed(q1.y, x1.y) + dot4I8Packed(q1.z, x1.z) + dot4I8Packed(q1.w, x1.w);
    // Scale and min as ggml's get_scale_min_k4 (see i8/q4_k.wgsl).
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
