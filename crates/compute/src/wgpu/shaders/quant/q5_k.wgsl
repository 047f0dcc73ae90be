// Q5_K: words [d | dmin][scales 12 bytes][qh 32 bytes][qs 128 bytes]. As Q4_K plus a fifth bit:
// bit (j / 4) of qh[l] for value l of its 32-value run. y = d * sc * q - dmin * m.
const BV: u32 = 256u;
const BW: u32 = 44u;

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
    let is = j / 4u;
    let sm = scale_min_k4(b + 1u, is);
    let dl = f16lo(dm) * sm.x;
    let ml = f16hi(dm) * sm.y;
    let w = b + 12u + 8u * (j / 8u) + 2u * (j % 4u);
    let sh = 4u * ((j % 8u) / 4u);
    let hw = b + 4u + 2u * (j % 4u);
    let q0 = ((W[w] >> sh) & 0x0f0f0f0fu) | (((W[hw] >> is) & 0x01010101u) << 4u);
    let q1 = ((W[w + 1u] >> sh) & 0x0f0f0f0fu) | (((W[hw + 1u] >> is) & 0x01010101u) << 4u);
    return V8(dl * ubytes4(q0) - ml, dl * ubytes4(q1) - ml);
}
