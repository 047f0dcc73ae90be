// Q4_1: words [d | m][qs 16 bytes], nibbles as Q4_0. y = d * q + m.
const BV: u32 = 32u;
const BW: u32 = 5u;

fn dq8(b: u32, j: u32) -> V8 {
    let d = f16lo(W[b]);
    let m = f16hi(W[b]);
    let w = b + 1u + (j & 1u) * 2u;
    let sh = (j >> 1u) * 4u;
    let q0 = (W[w] >> sh) & 0x0f0f0f0fu;
    let q1 = (W[w + 1u] >> sh) & 0x0f0f0f0fu;
    return V8(d * ubytes4(q0) + m, d * ubytes4(q1) + m);
}
