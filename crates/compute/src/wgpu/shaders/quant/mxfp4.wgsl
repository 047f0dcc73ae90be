// MXFP4: words [e | pad][qs 16 bytes], nibbles as Q4_0 index E2M1 values doubled; the scale is
// half the E8M0 value (2^(e - 128)), built from bits as ggml does.
const BV: u32 = 32u;
const BW: u32 = 5u;

var<private> KV: array<f32, 16> = array<f32, 16>(0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0);

fn kv4(q: u32) -> vec4<f32> {
    return vec4<f32>(KV[q & 0xfu], KV[(q >> 8u) & 0xfu], KV[(q >> 16u) & 0xfu], KV[(q >> 24u) & 0xfu]);
}

fn dq8(b: u32, j: u32) -> V8 {
    let e = W[b] & 0xffu;
    var bits = (e - 1u) << 23u;
    if (e < 2u) {
        bits = 0x00200000u << e;
    }
    let d = bitcast<f32>(bits);
    let w = b + 1u + (j & 1u) * 2u;
    let sh = (j >> 1u) * 4u;
    return V8(kv4(W[w] >> sh) * d, kv4(W[w + 1u] >> sh) * d);
}
