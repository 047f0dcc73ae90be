// Q5_1: words [d | m][qh][qs 16 bytes], bits as Q5_0. y = d * q + m.
const BV: u32 = 32u;
const BW: u32 = 6u;

fn dq8(b: u32, j: u32) -> V8 {
    let d = f16lo(W[b]);
    let m = f16hi(W[b]);
    let hb = (W[b + 1u] >> (j * 8u)) & 0xffu;
    let w = b + 2u + (j & 1u) * 2u;
    let sh = (j >> 1u) * 4u;
    let q0 = ((W[w] >> sh) & 0x0f0f0f0fu) | spread4(hb & 0xfu);
    let q1 = ((W[w + 1u] >> sh) & 0x0f0f0f0fu) | spread4(hb >> 4u);
    return V8(d * ubytes4(q0) + m, d * ubytes4(q1) + m);
}
