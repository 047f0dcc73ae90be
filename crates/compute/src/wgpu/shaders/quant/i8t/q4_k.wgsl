// Q4_K (ggml's layout, quant/q4_k.wgsl) for the int8 tiled kernel: sub-block j of the row at word
// rb is sub-block j % 8 of the 256-value block j / 8 ([d | dmin], 12 bytes of 6-bit scales and
// mins, then 32 bytes per pair of sub-blocks: the first in the low nibbles); weights
// d * sc * q - dmin * m, as i8/q4_k_v4.wgsl.
fn sub_block(rb: u32, j: u32) -> SubBlock {
    let b = rb + (j / 8u) * 36u;
    let s = j % 8u;
    let bsh = 8u * (s % 4u);
    let a0 = (W[b + 1u] >> bsh) & 0xffu;
    let a1 = (W[b + 2u] >> bsh) & 0xffu;
    let a2 = (W[b + 3u] >> bsh) & 0xffu;
    let lo = s < 4u;
    let sc = select((a2 & 15u) | ((a0 >> 6u) << 4u), a0 & 63u, lo);
    let m = select((a2 >> 4u) | ((a1 >> 6u) << 4u), a1 & 63u, lo);
    let dm = unpack2x16float(W[b]);
    let w = b + 4u + 8u * (s / 2u);
    let sh = 4u * (s % 2u);
    var o: SubBlock;
    for (var i = 0u; i < 8u; i++) {
        o.q[i] = (W[w + i] >> sh) & 0x0f0f0f0fu;
    }
    o.dm = vec2<f32>(dm.x * f32(sc), dm.y * f32(m));
    return o;
}
