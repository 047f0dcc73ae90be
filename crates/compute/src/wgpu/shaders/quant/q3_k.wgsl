// Q3_K: words [hmask 32 bytes][qs 64 bytes][scales 12 bytes][d | pad]. Low 2 bits as Q2_K; bit
// i / 32 of hmask[i % 32] set means +0, clear means -4; 16 6-bit scales offset by 32.
const BV: u32 = 256u;
const BW: u32 = 28u;

fn dq8(b: u32, j: u32) -> V8 {
    let d = f16lo(W[b + 27u]);
    let is = j / 2u;
    var low: u32;
    if (is < 8u) {
        low = wbyte(b + 24u, is) & 0xfu;
    } else {
        low = wbyte(b + 24u, is - 8u) >> 4u;
    }
    let high = (wbyte(b + 24u, 8u + is % 4u) >> (2u * (is / 4u))) & 3u;
    let dl = d * (f32(low | (high << 4u)) - 32.0);
    let w = b + 8u + 8u * (j / 16u) + 2u * (j % 4u);
    let sh = 2u * ((j / 4u) % 4u);
    let hw = b + 2u * (j % 4u);
    let hsh = j / 4u;
    let q0 = ubytes4((W[w] >> sh) & 0x03030303u) + 4.0 * ubytes4((W[hw] >> hsh) & 0x01010101u) - 4.0;
    let q1 = ubytes4((W[w + 1u] >> sh) & 0x03030303u) + 4.0 * ubytes4((W[hw + 1u] >> hsh) & 0x01010101u) - 4.0;
    return V8(dl * q0, dl * q1);
}
