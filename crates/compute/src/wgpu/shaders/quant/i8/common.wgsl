// Helpers of the int8 dot32 files, included once in every kernel that takes them (shaders.rs
// matvec_q8_types, moe.rs's int8 kernels): the dot32 files define dot32 alone, since a
// multi-weight kernel renames each weight's copy.

// The integer dot product of 32 4-bit values in Q4_0's order (q: 16 bytes, byte i holding value i
// in its low nibble and value i + 16 in its high one) with int8 activations x0 (values 0..16) and
// x1 (values 16..32), four values per dot4I8Packed (grouped Q4_0 and Q4_K).
fn dot_nib32(q: vec4<u32>, x0: vec4<u32>, x1: vec4<u32>) -> i32 {
    let lo = q & vec4<u32>(0x0f0f0f0fu);
    let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0f0f0f0fu);
    return dot4I8Packed(lo.x, x0.x) + dot4I8Packed(lo.y, x0.y) + dot4I8Packed(lo.z, x0.z) + dot4I8Packed(lo.w, x0.w)
        + dot4I8Packed(hi.x, x1.x) + dot4I8Packed(hi.y, x1.y) + dot4I8Packed(hi.z, x1.z) + dot4I8Packed(hi.w, x1.w);
}
