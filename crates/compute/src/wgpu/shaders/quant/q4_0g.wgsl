// Q4_0 grouped (layout.rs): one block of 256 values is eight Q4_0 blocks, words [d0 | d1] [d2 | d3]
// [d4 | d5] [d6 | d7] (the eight f16 scales), then the 16 quant bytes of Q4_0 block 0 (4 words),
// of block 1, ... of block 7. Within a Q4_0 block as in q4_0.wgsl: byte i of its quants holds value
// i (low nibble) and i + 16 (high). Group j (0..32) is group j % 4 of Q4_0 block j / 4.
const BV: u32 = 256u;
const BW: u32 = 36u;

fn dq8(b: u32, j: u32) -> V8 {
    let s = j / 4u;
    let d = unpack2x16float(W[b + s / 2u])[s % 2u];
    let w = b + 4u + 4u * s + (j & 1u) * 2u;
    let sh = ((j >> 1u) & 1u) * 4u;
    let q0 = (W[w] >> sh) & 0x0f0f0f0fu;
    let q1 = (W[w + 1u] >> sh) & 0x0f0f0f0fu;
    return V8(d * (ubytes4(q0) - 8.0), d * (ubytes4(q1) - 8.0));
}

// The dot product of the 8 values of group j with (xa, xc), whose sum is xsum, as q4_0.wgsl's.
fn dot8(b: u32, j: u32, xa: vec4<f32>, xc: vec4<f32>, xsum: f32) -> f32 {
    let s = j / 4u;
    let d = unpack2x16float(W[b + s / 2u])[s % 2u];
    let w = b + 4u + 4u * s + (j & 1u) * 2u;
    let sh = ((j >> 1u) & 1u) * 4u;
    let biased = dot(nib4(W[w] >> sh), xa) + dot(nib4(W[w + 1u] >> sh), xc);
    return d * (16.0 * biased - 24.0 * xsum);
}
