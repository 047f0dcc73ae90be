// Q6_K: words [ql 128 bytes][qh 64 bytes][scales 16 signed bytes][d | pad]. Two halves of 128
// values; in a half, quarter Q's value l (0..32) takes the nibble Q / 2 of ql[l + 32 (Q % 2)], bits
// 2Q..2Q+2 of qh[l] and scale sc[l / 16 + 2Q]. y = d * sc * (q - 32).
const BV: u32 = 256u;
const BW: u32 = 53u;

fn dq8(b: u32, j: u32) -> V8 {
    let d = f16lo(W[b + 52u]);
    let h = j / 16u;
    let quarter = (j % 16u) / 4u;
    let l0 = (j % 4u) * 8u;
    let w = b + 16u * h + (l0 + (quarter & 1u) * 32u) / 4u;
    let sh = (quarter / 2u) * 4u;
    let hw = b + 32u + 8u * h + l0 / 4u;
    let hsh = 2u * quarter;
    let sc = f32(bitcast<i32>(wbyte(b + 48u, 8u * h + l0 / 16u + 2u * quarter) << 24u) >> 24u);
    let dl = d * sc;
    let q0 = ((W[w] >> sh) & 0x0f0f0f0fu) | (((W[hw] >> hsh) & 0x03030303u) << 4u);
    let q1 = ((W[w + 1u] >> sh) & 0x0f0f0f0fu) | (((W[hw + 1u] >> hsh) & 0x03030303u) << 4u);
    return V8(dl * (ubytes4(q0) - 32.0), dl * (ubytes4(q1) - 32.0));
}
