// Q4_K grouped against int8 activations with 16-byte loads (W bound as array<vec4<u32>>; a
// 144-byte block starts on a 16-byte boundary): one load for sub-block j's 16 quant bytes, one for
// the header [d | dmin][scale and min bit fields] (the same 16 bytes for the eight lanes of a
// block, served by the cache), where q4_k_v4.wgsl loads a sub-block pair's 32 bytes per sub-block
// and unpacks ggml's 6-bit fields with a branch. Arithmetic as i8/q4_kg.wgsl (b is the block's
// first word).
fn dot32(b: u32, j: u32, x0: vec4<u32>, x1: vec4<u32>, xds: vec2<f32>) -> f32 {
    let v = b / 4u;
    let q = W[v + 1u + j];
    let s = dot_nib32(q, x0, x1);
    let hdr = W[v];
    let sc = extractBits(hdr.y, 4u * j, 4u) | (extractBits(hdr.w, 2u * j, 2u) << 4u);
    let m = extractBits(hdr.z, 4u * j, 4u) | (extractBits(hdr.w, 16u + 2u * j, 2u) << 4u);
    let dm = unpack2x16float(hdr.x);
    return dm.x * xds.x * f32(i32(sc) * s) - dm.y * f32(m) * xds.y;
}
