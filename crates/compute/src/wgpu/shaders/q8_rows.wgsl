// A workgroup's RPW output rows (one value h per invocation lid < RPW, RPW a multiple of 32) to int8
// blocks of 32 rows, as quantize_q8.wgsl rounds them (q8_block.wgsl: d = max|h| / 127,
// q = round(h / d)): the GLU kernels' epilogue, which writes the down projection's input so it
// needs no quantize dispatch. Uses the kernel's workgroup arrays red (at least RPW floats, free by
// then) and qv (RPW ints); call from uniform control flow (barriers).

// qv[lid] = q of h and the returned d of its block, for every invocation lid < RPW (0 elsewhere).
fn q8_rows(h: f32, lid: u32) -> f32 {
    workgroupBarrier();
    if (lid < RPW) {
        red[lid] = abs(h);
    }
    workgroupBarrier();
    var d = 0.0;
    if (lid < RPW) {
        let b0 = lid - lid % 32u;
        var amax = 0.0;
        for (var i = 0u; i < 32u; i++) {
            amax = max(amax, red[b0 + i]);
        }
        d = amax / 127.0;
        let inv = select(0.0, 1.0 / d, d > 0.0);
        qv[lid] = i32(round(h * inv));
    }
    workgroupBarrier();
    return d;
}

// Word w of the packed rows: the bytes of qv[4w..4w + 4].
fn q8_rows_word(w: u32) -> u32 {
    return pack4xI8(vec4<i32>(qv[4u * w], qv[4u * w + 1u], qv[4u * w + 2u], qv[4u * w + 3u]));
}

// The sum of the block of qv starting at b0 (a multiple of 32).
fn q8_rows_sum(b0: u32) -> i32 {
    var qsum = 0;
    for (var i = 0u; i < 32u; i++) {
        qsum += qv[b0 + i];
    }
    return qsum;
}
