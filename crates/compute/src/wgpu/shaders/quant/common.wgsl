// Helpers shared by every weight type. The weight buffer `W` is bound as array<u32>: blocks were
// repacked at upload so that each field starts on a 4-byte boundary (see layout.rs).
struct V8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

// The four bytes of a word as unsigned values.
fn ubytes4(q: u32) -> vec4<f32> {
    return vec4<f32>(f32(q & 0xffu), f32((q >> 8u) & 0xffu), f32((q >> 16u) & 0xffu), f32(q >> 24u));
}

// The four bytes of a word as signed values.
fn sbytes4(q: u32) -> vec4<f32> {
    return vec4<f32>(
        f32(bitcast<i32>(q << 24u) >> 24u),
        f32(bitcast<i32>(q << 16u) >> 24u),
        f32(bitcast<i32>(q << 8u) >> 24u),
        f32(bitcast<i32>(q) >> 24u),
    );
}

// Byte `i` (0..) of the block starting at word `b`.
fn wbyte(b: u32, i: u32) -> u32 {
    return (W[b + i / 4u] >> ((i % 4u) * 8u)) & 0xffu;
}

fn f16lo(w: u32) -> f32 {
    return unpack2x16float(w).x;
}

fn f16hi(w: u32) -> f32 {
    return unpack2x16float(w).y;
}

// Four bits (one per value) moved to bit 4 of each byte: the fifth bit of 5-bit quants.
fn spread4(bits: u32) -> u32 {
    return ((bits & 1u) << 4u) | ((bits & 2u) << 11u) | ((bits & 4u) << 18u) | ((bits & 8u) << 25u);
}

// Four nibbles (the low four bits of each byte of q; higher bits are ignored) as 1 + n / 16, made by
// placing each nibble in the top mantissa bits of 1.0: two integer operations per value where an
// int-to-float conversion runs at a quarter of the FMA rate on many GPUs. A dot product with these
// values is turned back into one with n by `16 * (dot - sum of x)`.
fn nib4(q: u32) -> vec4<f32> {
    let one = 0x3f800000u;
    let top = 0x00780000u;
    return bitcast<vec4<f32>>(vec4<u32>(
        ((q << 19u) & top) | one,
        ((q << 11u) & top) | one,
        ((q << 3u) & top) | one,
        ((q >> 5u) & top) | one,
    ));
}

// Four 6-bit values (bytes of q, each below 64) minus 32 as signed bytes: (q + 96) ^ 128 per byte,
// no carries between bytes (Q6_K's int8 dot product).
fn i8sub32(q: vec4<u32>) -> vec4<u32> {
    return (q + vec4<u32>(0x60606060u)) ^ vec4<u32>(0x80808080u);
}

// The IQ4_NL / IQ4_XS codebook as signed bytes, four per word (entries 0..4, 4..8, 8..12, 12..16).
const IQ4_KQ0: u32 = 0xbfad9881u;
const IQ4_KQ1: u32 = 0xf6eaddcfu;
const IQ4_KQ2: u32 = 0x26190d01u;
const IQ4_KQ3: u32 = 0x71594535u;

// The low nibble of each byte of q through the IQ4 codebook, as four packed signed bytes for
// dot4I8Packed: the entry's word picked by two selects (no dynamically indexed array, which GPUs
// keep in slow local memory), the byte by a shift.
fn iq4_kq4(q: u32) -> u32 {
    let n = vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(15u);
    let upper_half = (n & vec4<u32>(4u)) != vec4<u32>(0u);
    let lo = select(vec4<u32>(IQ4_KQ0), vec4<u32>(IQ4_KQ1), upper_half);
    let hi = select(vec4<u32>(IQ4_KQ2), vec4<u32>(IQ4_KQ3), upper_half);
    let v = (select(lo, hi, n >= vec4<u32>(8u)) >> ((n & vec4<u32>(3u)) * 8u)) & vec4<u32>(0xffu);
    return v.x | (v.y << 8u) | (v.z << 16u) | (v.w << 24u);
}
