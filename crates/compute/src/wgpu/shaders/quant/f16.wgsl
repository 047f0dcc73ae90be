// F16: 8 values per group, two per word (low half first); rows padded with zeros to 8 values.
const BV: u32 = 8u;
const BW: u32 = 4u;

fn dq8(b: u32, j: u32) -> V8 {
    return V8(
        vec4<f32>(unpack2x16float(W[b]), unpack2x16float(W[b + 1u])),
        vec4<f32>(unpack2x16float(W[b + 2u]), unpack2x16float(W[b + 3u])),
    );
}
