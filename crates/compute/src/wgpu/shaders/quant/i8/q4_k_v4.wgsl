// Q4_K against int8 activations with 16-byte loads (W bound as array<vec4<u32>>; a 144-byte block
// starts on a 16-byte boundary): one load for the header [d | dmin][scales 3 words], two for the
// sub-block's quants, where i8/q4_k.wgsl issues twelve 4-byte loads. Same arithmetic as
// i8/q4_k.wgsl (b is the block's first word).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let v = b / 4u;
    let hdr = W[v];
    let w = v + 1u + 2u * (j / 2u);
    let sh = vec4<u32>(4u * (j % 2u));
    let m4 = vec4<u32>(0x0f0f0f0fu);
    let q0 = (W[w] >> sh) & m4;
    let q1 = (W[w + 1u] >> sh) & m4;
    let s = dot4I8Packed(q0.x, x0.x) + dot4I8Packed(q0.y, x0.y) + dot4I8Packed(q0.z, x0.z) + dot4I8Packed(q0.w, x0.w)
        + dot4I8Packed(q1.x, x1.x) + dot4I8Packed(q1.y, x1.y) + dot4I8Packed(q1.z, x1.z) + dot4I8Packed(q1.w, x1.w);
    let bsh = 8u * (j % 4u);
    let a0 = (hdr.y >> bsh) & 0xffu;
    let a1 = (hdr.z >> bsh) & 0xffu;
    let a2 = (hdr.w >> bsh) & 0xffu;
    let lo = j < 4u;
    let sc = select((a2 & 15u) | ((a0 >> 6u) << 4u), a0 & 63u, lo);
    let m = select((a2 >> 4u) | ((a1 >> 6u) << 4u), a1 & 63u, lo);
    let dm = unpack2x16float(hdr.x);
    return dm.x * f32(sc) * xds.x * f32(s) - dm.y * f32(m) * xds.y;
}
