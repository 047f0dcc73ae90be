// Causal attention over the KV cache, flash style: one workgroup per (query token, head) walks the
// visible keys in tiles of 64, keeping a running max and denominator (online softmax) so no score
// matrix is stored. Each invocation scores one key of a tile, then owns dims lid, lid + 64, ...
// of the value accumulator. Sliding window: keys at positions > pos - window. Optional logit
// soft-cap and one sink logit per head (gpt-oss) that joins the denominator only.
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
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> K: array<f32>;
@group(0) @binding(2) var<storage, read> V: array<f32>;
@group(0) @binding(3) var<storage, read> S: array<f32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding(5) var<uniform> P: Params;

const WG: u32 = 64u;
const MAXD: u32 = 8u;
const NEG: f32 = -3.4028235e38;

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

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= P.n_tok * P.n_head) {
        return;
    }
    let i = idx / P.n_head;
    let h = idx % P.n_head;
    let kvh = h / (P.n_head / P.n_head_kv);
    let k_width = P.n_head_kv * P.hdk;
    let v_width = P.n_head_kv * P.hdv;
    let pos = P.pos0 + i;
    var lo = 0u;
    if (P.window > 0u && pos + 1u > P.window) {
        lo = pos + 1u - P.window;
    }
    let qb = i * P.n_head * P.hdk + h * P.hdk;
    for (var d = lid; d < P.hdk; d += WG) {
        qs[d] = Q[qb + d];
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
            let kb = j * k_width + kvh * P.hdk;
            var dot_qk = 0.0;
            for (var d = 0u; d < P.hdk; d++) {
                dot_qk += qs[d] * K[kb + d];
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
        for (var r = 0u; r < MAXD; r++) {
            let d = lid + r * WG;
            if (d < P.hdv) {
                var a = acc[r] * corr;
                let vb = j0 * v_width + kvh * P.hdv + d;
                for (var jj = 0u; jj < n_valid; jj++) {
                    a += ps[jj] * V[vb + jj * v_width];
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
            Y[ob + d] = acc[r] / l;
        }
    }
}
