// IQ4_NL: words [d | pad][qs 16 bytes], nibbles as Q4_0 index the non-linear table.
const BV: u32 = 32u;
const BW: u32 = 5u;

var<private> KV: array<f32, 16> = array<f32, 16>(-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);

fn kv4(q: u32) -> vec4<f32> {
    return vec4<f32>(KV[q & 0xfu], KV[(q >> 8u) & 0xfu], KV[(q >> 16u) & 0xfu], KV[(q >> 24u) & 0xfu]);
}

fn dq8(b: u32, j: u32) -> V8 {
    let d = f16lo(W[b]);
    let w = b + 1u + (j & 1u) * 2u;
    let sh = (j >> 1u) * 4u;
    return V8(d * kv4(W[w] >> sh), d * kv4(W[w + 1u] >> sh));
}
