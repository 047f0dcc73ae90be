// BF16: 8 values per group, two per word (low half first); an f32 is the bf16 bits shifted up.
const BV: u32 = 8u;
const BW: u32 = 4u;

fn bf2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

fn dq8(b: u32, j: u32) -> V8 {
    return V8(vec4<f32>(bf2(W[b]), bf2(W[b + 1u])), vec4<f32>(bf2(W[b + 2u]), bf2(W[b + 3u])));
}
