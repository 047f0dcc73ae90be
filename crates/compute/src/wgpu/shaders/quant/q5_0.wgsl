// Q5_0: words [d | pad][qh][qs 16 bytes]. Nibbles as Q4_0; bit v of qh is value v's fifth bit.
// y = d * (q - 16).
const BV: u32 = 32u;
const BW: u32 = 6u;

fn dq8(b: u32, j: u32) -> V8 {
    let d = f16lo(W[b]);
    let hb = (W[b + 1u] >> (j * 8u)) & 0xffu;
    let w = b + 2u + (j & 1u) * 2u;
    let sh = (j >> 1u) * 4u;
    let q0 = ((W[w] >> sh) & 0x0f0f0f0fu) | spread4(hb & 0xfu);
    let q1 = ((W[w + 1u] >> sh) & 0x0f0f0f0fu) | spread4(hb >> 4u);
    return V8(d * (ubytes4(q0) - 16.0), d * (ubytes4(q1) - 16.0));
}
