// Q4_0: words [d | pad][qs 16 bytes]. Byte i of qs holds value i (low nibble) and i + 16 (high).
// Group j (0..4) covers values 8j..8j+8: bytes 8 (j % 2).., nibble j / 2. y = d * (q - 8).
const BV: u32 = 32u;
const BW: u32 = 5u;

fn dq8(b: u32, j: u32) -> V8 {
    let d = f16lo(W[b]);
    let w = b + 1u + (j & 1u) * 2u;
    let sh = (j >> 1u) * 4u;
    let q0 = (W[w] >> sh) & 0x0f0f0f0fu;
    let q1 = (W[w + 1u] >> sh) & 0x0f0f0f0fu;
    return V8(d * (ubytes4(q0) - 8.0), d * (ubytes4(q1) - 8.0));
}

// The dot product of the 8 values of group j with (xa, xc), whose sum is xsum (the decode kernel's
// inner loop): the scale and the -8 offset are applied once per group instead of per value.
fn dot8(b: u32, j: u32, xa: vec4<f32>, xc: vec4<f32>, xsum: f32) -> f32 {
    let d = f16lo(W[b]);
    let w = b + 1u + (j & 1u) * 2u;
    let sh = (j >> 1u) * 4u;
    let biased = dot(nib4(W[w] >> sh), xa) + dot(nib4(W[w + 1u] >> sh), xc);
    return d * (16.0 * biased - 24.0 * xsum);
}
