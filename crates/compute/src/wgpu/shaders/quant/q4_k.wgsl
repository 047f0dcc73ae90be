// Q4_K: words [d | dmin][scales 12 bytes][qs 128 bytes]. Four chunks of 64 values: bytes
// 32c..32c+32 hold values 64c.. (low nibble) and 64c+32.. (high); sub-block j / 4 has a 6-bit
// scale and min packed as ggml's get_scale_min_k4. y = d * sc * q - dmin * m.
const BV: u32 = 256u;
const BW: u32 = 36u;

fn scale_min_k4(b: u32, is: u32) -> vec2<f32> {
    if (is < 4u) {
        return vec2<f32>(f32(wbyte(b, is) & 63u), f32(wbyte(b, is + 4u) & 63u));
    }
    let sc = (wbyte(b, is + 4u) & 0xfu) | ((wbyte(b, is - 4u) >> 6u) << 4u);
    let m = (wbyte(b, is + 4u) >> 4u) | ((wbyte(b, is) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

fn dq8(b: u32, j: u32) -> V8 {
    let dm = W[b];
    let sm = scale_min_k4(b + 1u, j / 4u);
    let dl = f16lo(dm) * sm.x;
    let ml = f16hi(dm) * sm.y;
    let w = b + 4u + 8u * (j / 8u) + 2u * (j % 4u);
    let sh = 4u * ((j % 8u) / 4u);
    let q0 = (W[w] >> sh) & 0x0f0f0f0fu;
    let q1 = (W[w + 1u] >> sh) & 0x0f0f0f0fu;
    return V8(dl * ubytes4(q0) - ml, dl * ubytes4(q1) - ml);
}

// The dot product of the 8 values of group j with (xa, xc), whose sum is xsum (the decode kernel's
// inner loop): scale and min applied once per group instead of per value.
fn dot8(b: u32, j: u32, xa: vec4<f32>, xc: vec4<f32>, xsum: f32) -> f32 {
    let dm = W[b];
    let sm = scale_min_k4(b + 1u, j / 4u);
    let w = b + 4u + 8u * (j / 8u) + 2u * (j % 4u);
    let sh = 4u * ((j % 8u) / 4u);
    let biased = dot(nib4(W[w] >> sh), xa) + dot(nib4(W[w + 1u] >> sh), xc);
    return f16lo(dm) * sm.x * 16.0 * (biased - xsum) - f16hi(dm) * sm.y * xsum;
}
