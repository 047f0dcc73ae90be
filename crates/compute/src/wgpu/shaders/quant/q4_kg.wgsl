// Q4_K grouped (layout.rs, TypeLayout::q4_k_grouped): words [d | dmin], then the scales' and mins'
// bit fields (word 1: low four bits of scale s at bit 4s; word 2: the same of the mins; word 3: the
// high two bits of scale s at bit 2s, of min s at bit 16 + 2s), then sub-block s's 16 quant bytes
// at word 4 + 4s, in Q4_0's order (byte i: value i low nibble, i + 16 high). Group j (0..32) is
// group j % 4 of sub-block j / 4. y = d * sc * q - dmin * m.
const BV: u32 = 256u;
const BW: u32 = 36u;

// Scale and min of sub-block s of the block at word b.
fn scale_min_kg(b: u32, s: u32) -> vec2<f32> {
    let hi = W[b + 3u];
    let sc = extractBits(W[b + 1u], 4u * s, 4u) | (extractBits(hi, 2u * s, 2u) << 4u);
    let m = extractBits(W[b + 2u], 4u * s, 4u) | (extractBits(hi, 16u + 2u * s, 2u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

fn dq8(b: u32, j: u32) -> V8 {
    let s = j / 4u;
    let dm = unpack2x16float(W[b]);
    let sm = scale_min_kg(b, s);
    let dl = dm.x * sm.x;
    let ml = dm.y * sm.y;
    let w = b + 4u + 4u * s + (j & 1u) * 2u;
    let sh = ((j >> 1u) & 1u) * 4u;
    let q0 = (W[w] >> sh) & 0x0f0f0f0fu;
    let q1 = (W[w + 1u] >> sh) & 0x0f0f0f0fu;
    return V8(dl * ubytes4(q0) - ml, dl * ubytes4(q1) - ml);
}

// The dot product of the 8 values of group j with (xa, xc), whose sum is xsum: scale and min
// applied once per group, as q4_k.wgsl's.
fn dot8(b: u32, j: u32, xa: vec4<f32>, xc: vec4<f32>, xsum: f32) -> f32 {
    let s = j / 4u;
    let dm = unpack2x16float(W[b]);
    let sm = scale_min_kg(b, s);
    let w = b + 4u + 4u * s + (j & 1u) * 2u;
    let sh = ((j >> 1u) & 1u) * 4u;
    let biased = dot(nib4(W[w] >> sh), xa) + dot(nib4(W[w + 1u] >> sh), xc);
    return dm.x * sm.x * 16.0 * (biased - xsum) - dm.y * sm.y * xsum;
}
