// Q4_0 grouped against int8 activations with 16-byte loads (W bound as array<vec4<u32>>; a
// 144-byte block starts on a 16-byte boundary): one load for Q4_0 block j's quants, one for the
// eight scales (the same 16 bytes for the eight lanes of a block, served by the cache), where
// i8/q4_0.wgsl issues five 4-byte loads per 18 bytes of weights. Arithmetic as i8/q4_0.wgsl (b is
// the block's first word).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let v = b / 4u;
    let q = W[v + 1u + j];
    let s = dot_nib32(q, x0, x1);
    let d = unpack2x16float(W[v][j / 2u])[j % 2u];
    return d * (xds.x * f32(s) - 8.0 * xds.y);
}
