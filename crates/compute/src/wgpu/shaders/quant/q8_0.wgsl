// Q8_0: words [d | pad][qs 32 signed bytes]. y = q * d.
const BV: u32 = 32u;
const BW: u32 = 9u;

fn dq8(b: u32, j: u32) -> V8 {
    let d = f16lo(W[b]);
    let w = b + 1u + j * 2u;
    return V8(sbytes4(W[w]) * d, sbytes4(W[w + 1u]) * d);
}

// The dot product of the 8 values of group j with (xa, xc) (the decode kernel's inner loop): the
// scale applied once per group instead of per value.
fn dot8(b: u32, j: u32, xa: vec4<f32>, xc: vec4<f32>, xsum: f32) -> f32 {
    let w = b + 1u + j * 2u;
    return f16lo(W[b]) * (dot(sbytes4(W[w]), xa) + dot(sbytes4(W[w + 1u]), xc));
}
