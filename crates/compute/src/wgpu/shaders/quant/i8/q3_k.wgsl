// Q3_K against int8 activations, one 32-value sub-block j (0..8) of a 256-value block: words
// [hmask 8 words][qs 16 words][scales 3 words][d | pad]. Low 2 bits as Q2_K (qs byte
// 32 (j / 4) + l at shift 2 (j % 4)); bit j of hmask byte l set means +0, clear means -4, so
// q = low + 4 h - 4 in -4..3, made a signed byte in place ((v + 124) ^ 128 per byte, no carries
// since v < 8). The halves have 6-bit scales 2j and 2j + 1 offset by 32: low 4 bits in scales
// bytes 0..8 (low nibble for scales 0..8, high for 8..16), high 2 bits in bytes 8..12.
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let w = b + 8u + 8u * (j / 4u);
    let sh = vec4<u32>(2u * (j % 4u));
    let hb = vec4<u32>(j);
    let m2 = vec4<u32>(0x03030303u);
    let m1 = vec4<u32>(0x01010101u);
    let l0 = (vec4<u32>(W[w], W[w + 1u], W[w + 2u], W[w + 3u]) >> sh) & m2;
    let l1 = (vec4<u32>(W[w + 4u], W[w + 5u], W[w + 6u], W[w + 7u]) >> sh) & m2;
    let h0 = ((vec4<u32>(W[b], W[b + 1u], W[b + 2u], W[b + 3u]) >> hb) & m1) << vec4<u32>(2u);
    let h1 = ((vec4<u32>(W[b + 4u], W[b + 5u], W[b + 6u], W[b + 7u]) >> hb) & m1) << vec4<u32>(2u);
    let q0 = ((l0 | h0) + vec4<u32>(0x7c7c7c7cu)) ^ vec4<u32>(0x80808080u);
    let q1 = ((l1 | h1) + vec4<u32>(0x7c7c7c7cu)) ^ vec4<u32>(0x80808080u);
    let s0 = dot4I8Packed(q0.x, x0.x) + dot4I8Packed(q0.y, x0.y) + dot4I8Packed(q0.z, x0.z) + dot4I8Packed(q0.w, x0.w);
    let s1 = dot4I8Packed(q1.x, x1.x) + dot4I8Packed(q1.y, x1.y) + dot4I8Packed(q1.z, x1.z) + dot4I8Packed(q1.w, x1.w);
    // Scales 2j and 2j + 1: low nibbles from bytes (2j) % 8 and the next (one word), high bits
    // from byte 8 + (2j) % 4 and the next of word b + 26, at shift 2 ((2j) / 4).
    let is0 = 2u * j;
    let lsh = 8u * (is0 % 4u);
    let sw = W[b + 24u + (is0 % 8u) / 4u];
    let nsh = select(4u, 0u, j < 4u);
    let low0 = ((sw >> lsh) >> nsh) & 15u;
    let low1 = ((sw >> (lsh + 8u)) >> nsh) & 15u;
    let hw = W[b + 26u] >> (2u * (is0 / 4u));
    let high0 = (hw >> lsh) & 3u;
    let high1 = (hw >> (lsh + 8u)) & 3u;
    let ls0 = i32(low0 | (high0 << 4u)) - 32;
    let ls1 = i32(low1 | (high1 << 4u)) - 32;
    return f16lo(W[b + 27u]) * xds.x * f32(ls0 * s0 + ls1 * s1);
}
