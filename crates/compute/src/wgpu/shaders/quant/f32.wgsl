// F32: 8 values per group, one word each; rows were padded with zeros to a multiple of 8.
const BV: u32 = 8u;
const BW: u32 = 8u;

fn dq8(b: u32, j: u32) -> V8 {
    return V8(
        vec4<f32>(bitcast<f32>(W[b]), bitcast<f32>(W[b + 1u]), bitcast<f32>(W[b + 2u]), bitcast<f32>(W[b + 3u])),
        vec4<f32>(bitcast<f32>(W[b + 4u]), bitcast<f32>(W[b + 5u]), bitcast<f32>(W[b + 6u]), bitcast<f32>(W[b + 7u])),
    );
}
