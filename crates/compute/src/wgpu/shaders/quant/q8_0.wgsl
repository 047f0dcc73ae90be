// Q8_0: words [d | pad][qs 32 signed bytes]. y = q * d.
const BV: u32 = 32u;
const BW: u32 = 9u;

fn dq8(b: u32, j: u32) -> V8 {
    let d = f16lo(W[b]);
    let w = b + 1u + j * 2u;
    return V8(sbytes4(W[w]) * d, sbytes4(W[w + 1u]) * d);
}
