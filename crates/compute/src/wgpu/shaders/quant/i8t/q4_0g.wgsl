// Grouped Q4_0 (quant/q4_0g.wgsl's layout) for the int8 tiled kernel: sub-block j of the row at
// word rb is Q4_0 block j % 8 of the 256-value block j / 8; weights d * (q - 8).
fn sub_block(rb: u32, j: u32) -> SubBlock {
    let b = rb + (j / 8u) * 36u;
    let s = j % 8u;
    let d = unpack2x16float(W[b + s / 2u])[s % 2u];
    let w = b + 4u + 4u * s;
    var o: SubBlock;
    for (var i = 0u; i < 4u; i++) {
        let q = W[w + i];
        o.q[i] = q & 0x0f0f0f0fu;
        o.q[i + 4u] = (q >> 4u) & 0x0f0f0f0fu;
    }
    o.dm = vec2<f32>(d, 8.0 * d);
    return o;
}
