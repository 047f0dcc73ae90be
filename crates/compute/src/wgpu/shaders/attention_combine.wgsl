// The second half of a split decode attention (attention_decode.wgsl with n_split > 1): each key
// slice left, per output row, its max logit m, denominator l and unnormalised accumulator; one
// workgroup per row rescales them to the largest max and sums them (the flash-decoding combine),
// adds the sink logit, writes the row and, when asked, its int8 blocks.
struct Params {
    n_rows: u32,
    n_head: u32,
    n_split: u32,
    has_sinks: u32,
    q8: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> PACC: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> PML: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> S: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> QS: array<u32>;
@group(0) @binding(5) var<storage, read_write> DS: array<vec2<f32>>;
@group(0) @binding(6) var<uniform> P: Params;

const WG: u32 = 64u;
const HDV: u32 = {{HDV}}u;
const HDV4: u32 = HDV / 4u;
const NEG: f32 = -3.4028235e38;

// Written before read: every element c < HDV4 is written by invocation c % WG before the barrier
// that precedes the epilogue's reads (Plain::workgroup_memory_written_first).
var<workgroup> out: array<vec4<f32>, HDV4>;

{{Q8_BLOCK}}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= P.n_rows) {
        return;
    }
    var mm = NEG;
    for (var s = 0u; s < P.n_split; s++) {
        mm = max(mm, PML[s * P.n_rows + row].x);
    }
    var ll = 0.0;
    for (var s = 0u; s < P.n_split; s++) {
        let ml = PML[s * P.n_rows + row];
        ll += ml.y * exp(ml.x - mm);
    }
    var corr = 1.0;
    if (P.has_sinks == 1u) {
        let sk = S[row % P.n_head];
        let m_new = max(mm, sk);
        corr = exp(mm - m_new);
        ll = ll * corr + exp(sk - m_new);
        mm = m_new;
    }
    for (var c = lid; c < HDV4; c += WG) {
        var a = vec4<f32>(0.0);
        for (var s = 0u; s < P.n_split; s++) {
            let ms = PML[s * P.n_rows + row].x;
            a += PACC[(s * P.n_rows + row) * HDV4 + c] * exp(ms - mm);
        }
        let y = a / ll;
        Y[row * HDV4 + c] = y;
        out[c] = y;
    }
    if (P.q8 == 1u) {
        workgroupBarrier();
        for (var b = lid; b < HDV / 32u; b += WG) {
            var v: array<vec4<f32>, 8>;
            for (var e = 0u; e < 8u; e++) {
                v[e] = out[b * 8u + e];
            }
            q8_block(v, (row * HDV) / 32u + b);
        }
    }
}
