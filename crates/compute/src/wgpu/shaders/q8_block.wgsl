// 32 values (8 vec4) to int8 block `blk` of QS / DS, as the int8 decode kernel (matvec_q8.wgsl)
// reads them: 32 signed bytes q = round(v / d) with d = max|v| / 127 (llama.cpp's Q8_0/Q8_1
// rounding), packed four to a word in QS, and (d, d * sum(q)) in DS. The sum lets a weight type
// with an offset or a minimum (Q4_0's -8, Q4_1's and Q4_K's mins) apply it once per block.
// Shared by quantize_q8.wgsl and the kernels that quantize their output in their epilogue (norm,
// attention), so every producer of a block computes it identically.
fn q8_block(values: array<vec4<f32>, 8>, blk: u32) {
    var v = values;
    var amax = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        amax = max(amax, abs(v[i]));
    }
    let d = max(max(amax.x, amax.y), max(amax.z, amax.w)) / 127.0;
    let inv = select(0.0, 1.0 / d, d > 0.0);
    var qsum = vec4<i32>(0);
    for (var i = 0u; i < 8u; i++) {
        let q = vec4<i32>(round(v[i] * inv));
        qsum += q;
        QS[blk * 8u + i] = pack4xI8(q);
    }
    DS[blk] = vec2<f32>(d, d * f32(qsum.x + qsum.y + qsum.z + qsum.w));
}
