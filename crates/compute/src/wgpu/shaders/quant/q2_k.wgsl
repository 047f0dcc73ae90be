// Q2_K: words [scales 16 bytes][qs 64 bytes][d | dmin]. Value i: 2 bits of byte 32 (i / 128) + i % 32
// at shift 2 ((i / 32) % 4); sub-block i / 16 has scale (low nibble) and min (high nibble).
// y = d * sc * q - dmin * m.
const BV: u32 = 256u;
const BW: u32 = 21u;

fn dq8(b: u32, j: u32) -> V8 {
    let dm = W[b + 20u];
    let sc = wbyte(b, j / 2u);
    let dl = f16lo(dm) * f32(sc & 0xfu);
    let ml = f16hi(dm) * f32(sc >> 4u);
    let w = b + 4u + 8u * (j / 16u) + 2u * (j % 4u);
    let sh = 2u * ((j / 4u) % 4u);
    let q0 = (W[w] >> sh) & 0x03030303u;
    let q1 = (W[w + 1u] >> sh) & 0x03030303u;
    return V8(dl * ubytes4(q0) - ml, dl * ubytes4(q1) - ml);
}
