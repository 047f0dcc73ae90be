// IQ4_XS: words [d | scales_h][scales_l][qs 128 bytes]; 8 sub-blocks of 32 values laid out as
// IQ4_NL, each with a 6-bit scale (low 4 bits in scales_l, high 2 in scales_h) offset by 32.
const BV: u32 = 256u;
const BW: u32 = 34u;

var<private> KV: array<f32, 16> = array<f32, 16>(-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);

fn kv4(q: u32) -> vec4<f32> {
    return vec4<f32>(KV[q & 0xfu], KV[(q >> 8u) & 0xfu], KV[(q >> 16u) & 0xfu], KV[(q >> 24u) & 0xfu]);
}

fn dq8(b: u32, j: u32) -> V8 {
    let w0 = W[b];
    let d = f16lo(w0);
    let ib = j / 4u;
    let low = (W[b + 1u] >> (ib * 4u)) & 0xfu;
    let high = ((w0 >> 16u) >> (2u * ib)) & 3u;
    let dl = d * (f32(low | (high << 4u)) - 32.0);
    let w = b + 2u + ib * 4u + (j & 1u) * 2u;
    let sh = ((j & 3u) >> 1u) * 4u;
    return V8(dl * kv4(W[w] >> sh), dl * kv4(W[w + 1u] >> sh));
}
