// One attention step in one dispatch: rotary embedding of the new queries and keys, their keys and
// values written to the KV cache, causal attention over the cache, and optionally the output's int8
// blocks for the output projection (what took a rope/cache-write dispatch, the attention and a
// quantize dispatch).
//
// Flash style: one workgroup per (query token, head) walks the visible keys in tiles of 64,
// keeping a running max and denominator (online softmax) so no score matrix is stored. Each
// invocation scores one key of a tile, then owns dims lid, lid + 64, ... of the value
// accumulator. Sliding window: keys at positions > pos - window. Optional logit soft-cap and one
// sink logit per head (gpt-oss) that joins the denominator only.
//
// The new tokens' keys and values (cache rows pos0..pos0 + n_tok) are read from KN and VN, not
// from the cache: other workgroups write those rows in this same dispatch, with no ordering
// between workgroups. Each (token, kv head) row is written once, by the workgroup of the first
// query head of its group. Rotation (rope = 1) is rope.wgsl's, term for term: cos/sin
// [n_tokens, n_rot / 2] from the host, pairs (i, i + n_rot/2) when neox else (2i, 2i + 1), dims
// past n_rot passed through.
struct Params {
    n_tok: u32,
    n_head: u32,
    n_head_kv: u32,
    hdk: u32,
    hdv: u32,
    pos0: u32,
    window: u32,
    has_sinks: u32,
    scale: f32,
    softcap: f32,
    rope: u32,
    rope_head_dim: u32,
    n_rot: u32,
    neox: u32,
    q8: u32,
    _p0: u32,
}

@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> KN: array<f32>;
@group(0) @binding(2) var<storage, read> VN: array<f32>;
@group(0) @binding(3) var<storage, read> CS: array<f32>;
@group(0) @binding(4) var<storage, read> S: array<f32>;
@group(0) @binding(5) var<storage, read_write> KC: array<f32>;
@group(0) @binding(6) var<storage, read_write> VC: array<f32>;
@group(0) @binding(7) var<storage, read_write> Y: array<f32>;
@group(0) @binding(8) var<storage, read_write> QS: array<u32>;
@group(0) @binding(9) var<storage, read_write> DS: array<vec2<f32>>;
@group(0) @binding(10) var<uniform> P: Params;

const WG: u32 = 64u;
const MAXD: u32 = 8u;
const NEG: f32 = -3.4028235e38;

// Written before read (so the pipeline skips WGSL's zeroing, Plain::workgroup_memory_written_first):
// qs[d] is read for d < hdk after the barrier that follows its write, and in the epilogue for
// d < hdv after the barrier that follows that write; ps[lid] is written by all 64 invocations
// before reduce's barriers and read for jj < 64; reduce writes red[lid] for every lid first.
// The query of this workgroup, then (after the key loop) its output for the int8 epilogue.
var<workgroup> qs: array<f32, 512>;
var<workgroup> ps: array<f32, 64>;
var<workgroup> red: array<f32, 64>;

fn reduce(v: f32, lid: u32, is_max: bool) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            if (is_max) {
                red[lid] = max(red[lid], red[lid + s]);
            } else {
                red[lid] += red[lid + s];
            }
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

{{ROPE_PAIR}}

// Query value `at` of token t, rotated.
fn q_at(at: u32, t: u32) -> f32 {
    let p = rope_pair(at, P.n_head * P.hdk, t);
    if (p.w == 2u) {
        return Q[at];
    }
    return turn(Q[p.x], Q[p.y], p);
}

// New key value `at` of token t, rotated.
fn kn_at(at: u32, t: u32) -> f32 {
    let p = rope_pair(at, P.n_head_kv * P.hdk, t);
    if (p.w == 2u) {
        return KN[at];
    }
    return turn(KN[p.x], KN[p.y], p);
}

{{Q8_BLOCK}}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= P.n_tok * P.n_head) {
        return;
    }
    let i = idx / P.n_head;
    let h = idx % P.n_head;
    let group = P.n_head / P.n_head_kv;
    let kvh = h / group;
    let q_width = P.n_head * P.hdk;
    let k_width = P.n_head_kv * P.hdk;
    let v_width = P.n_head_kv * P.hdv;
    let pos = P.pos0 + i;
    var lo = 0u;
    if (P.window > 0u && pos + 1u > P.window) {
        lo = pos + 1u - P.window;
    }
    let qb = i * q_width + h * P.hdk;
    for (var d = lid; d < P.hdk; d += WG) {
        qs[d] = q_at(qb + d, i);
    }
    if (h % group == 0u) {
        let kb = i * k_width + kvh * P.hdk;
        for (var d = lid; d < P.hdk; d += WG) {
            KC[pos * k_width + kvh * P.hdk + d] = kn_at(kb + d, i);
        }
        let vb = i * v_width + kvh * P.hdv;
        for (var d = lid; d < P.hdv; d += WG) {
            VC[pos * v_width + kvh * P.hdv + d] = VN[vb + d];
        }
    }
    workgroupBarrier();
    var m = NEG;
    var l = 0.0;
    var acc: array<f32, MAXD>;
    for (var j0 = lo; j0 <= pos; j0 += WG) {
        let j = j0 + lid;
        let valid = j <= pos;
        var s = NEG;
        if (valid) {
            var dot_qk = 0.0;
            if (j < P.pos0) {
                let kb = j * k_width + kvh * P.hdk;
                for (var d = 0u; d < P.hdk; d++) {
                    dot_qk += qs[d] * KC[kb + d];
                }
            } else {
                let t = j - P.pos0;
                let kb = t * k_width + kvh * P.hdk;
                for (var d = 0u; d < P.hdk; d++) {
                    dot_qk += qs[d] * kn_at(kb + d, t);
                }
            }
            s = dot_qk * P.scale;
            if (P.softcap > 0.0) {
                s = P.softcap * tanh(clamp(s / P.softcap, -15.0, 15.0));
            }
        }
        let m_new = max(m, reduce(s, lid, true));
        var p = 0.0;
        if (valid) {
            p = exp(s - m_new);
        }
        ps[lid] = p;
        let corr = exp(m - m_new);
        l = l * corr + reduce(p, lid, false);
        let n_valid = min(WG, pos + 1u - j0);
        // Keys j0 .. j0 + n_cached come from the cache, the rest are this step's.
        let n_cached = min(n_valid, select(0u, P.pos0 - j0, P.pos0 > j0));
        for (var r = 0u; r < MAXD; r++) {
            let d = lid + r * WG;
            if (d < P.hdv) {
                var a = acc[r] * corr;
                let vb = j0 * v_width + kvh * P.hdv + d;
                for (var jj = 0u; jj < n_cached; jj++) {
                    a += ps[jj] * VC[vb + jj * v_width];
                }
                for (var jj = n_cached; jj < n_valid; jj++) {
                    a += ps[jj] * VN[(j0 + jj - P.pos0) * v_width + kvh * P.hdv + d];
                }
                acc[r] = a;
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    if (P.has_sinks == 1u) {
        let sk = S[h];
        let m_new = max(m, sk);
        let corr = exp(m - m_new);
        l = l * corr + exp(sk - m_new);
        for (var r = 0u; r < MAXD; r++) {
            acc[r] *= corr;
        }
    }
    let ob = i * P.n_head * P.hdv + h * P.hdv;
    for (var r = 0u; r < MAXD; r++) {
        let d = lid + r * WG;
        if (d < P.hdv) {
            let y = acc[r] / l;
            Y[ob + d] = y;
            qs[d] = y;
        }
    }
    if (P.q8 == 1u) {
        // The head's hdv values (a multiple of 32) are whole blocks of the output row.
        workgroupBarrier();
        for (var b = lid; b < P.hdv / 32u; b += WG) {
            var v: array<vec4<f32>, 8>;
            for (var e = 0u; e < 8u; e++) {
                let at = b * 32u + e * 4u;
                v[e] = vec4<f32>(qs[at], qs[at + 1u], qs[at + 2u], qs[at + 3u]);
            }
            q8_block(v, ob / 32u + b);
        }
    }
}
