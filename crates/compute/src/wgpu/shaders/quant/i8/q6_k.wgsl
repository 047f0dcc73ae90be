// Q6_K against int8 activations, one 32-value sub-block j (0..8) of a 256-value block: words
// [ql 32 words][qh 16 words][scales 4 words of signed bytes][d | pad]. Sub-block j is quarter
// Q = j % 4 of half h = j / 4: value l (0..32) takes nibble Q / 2 of ql[64h + 32 (Q % 2) + l], bits
// 2Q..2Q+2 of qh[32h + l], and scale sc[8h + 2Q + l / 16]. y = d * sc * (q - 32): q - 32 is made a
// signed byte in place ((q + 96) ^ 128 per byte, no carries since q < 64), so the offset needs no
// activation sum (the two halves of the sub-block have different scales; i8sub32 in common.wgsl).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let h = j / 4u;
    let quarter = j % 4u;
    let w = b + 16u * h + 8u * (quarter % 2u);
    let sh = vec4<u32>(4u * (quarter / 2u));
    let hw = b + 32u + 8u * h;
    let hsh = vec4<u32>(2u * quarter);
    let m4 = vec4<u32>(0x0f0f0f0fu);
    let m2 = vec4<u32>(0x03030303u);
    let l0 = (vec4<u32>(W[w], W[w + 1u], W[w + 2u], W[w + 3u]) >> sh) & m4;
    let l1 = (vec4<u32>(W[w + 4u], W[w + 5u], W[w + 6u], W[w + 7u]) >> sh) & m4;
    let h0 = ((vec4<u32>(W[hw], W[hw + 1u], W[hw + 2u], W[hw + 3u]) >> hsh) & m2) << vec4<u32>(4u);
    let h1 = ((vec4<u32>(W[hw + 4u], W[hw + 5u], W[hw + 6u], W[hw + 7u]) >> hsh) & m2) << vec4<u32>(4u);
    let q0 = i8sub32(l0 | h0);
    let q1 = i8sub32(l1 | h1);
    let s0 = dot4I8Packed(q0.x, x0.x) + dot4I8Packed(q0.y, x0.y) + dot4I8Packed(q0.z, x0.z) + dot4I8Packed(q0.w, x0.w);
    let s1 = dot4I8Packed(q1.x, x1.x) + dot4I8Packed(q1.y, x1.y) + dot4I8Packed(q1.z, x1.z) + dot4I8Packed(q1.w, x1.w);
    // Scales 8h + 2Q and 8h + 2Q + 1: bytes 2 (Q % 2) and 2 (Q % 2) + 1 of scales word 2h + Q / 2.
    let scw = W[b + 48u + 2u * h + quarter / 2u];
    let ssh = 16u * (quarter % 2u);
    let sc0 = bitcast<i32>(scw << (24u - ssh)) >> 24u;
    let sc1 = bitcast<i32>(scw << (16u - ssh)) >> 24u;
    return f16lo(W[b + 52u]) * xds.x * f32(sc0 * s0 + sc1 * s1);
}
