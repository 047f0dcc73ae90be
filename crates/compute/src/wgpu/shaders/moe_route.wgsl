// MoE routing on the GPU, one workgroup per token, as the CPU's `route_token`: probabilities
// (softmax, sigmoid, or the raw logits when the softmax comes after the top-k), selection scores
// (plus the selection bias), DeepSeek-V3's group limit (a group's score is the sum of its two best
// selection scores; only the best topk_group groups compete), the top k by score (ties to the
// lower index), then the weights: their softmax (after top-k), normalisation, scale.
// Output, in one buffer: k weights per token (f32 bits) from word 0, k ids per token from word
// ids_at. The weights part is the routing tensor; the ids are read back when the host needs them
// (to find the pool's misses, or to group a prefill batch by expert) and read in place by the
// per-pair MoE kernels otherwise.
// Masked experts and empty candidates score -FLT_MAX (the CPU uses -inf: the same order, finite
// numbers only in WGSL constants).
// Limits (the caller routes on the host beyond them): n_expert <= MAX_E, k <= MAX_K, n_group <= WG.
struct Params {
    n_expert: u32,
    n_tok: u32,
    k: u32,
    gating: u32,
    has_bias: u32,
    n_group: u32,
    topk_group: u32,
    normalize: u32,
    scale: f32,
    ids_at: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> L: array<f32>;
@group(0) @binding(1) var<storage, read> B: array<f32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<u32>;
@group(0) @binding(3) var<uniform> P: Params;

const WG: u32 = 256u;
const MAX_E: u32 = 512u;
const MAX_K: u32 = 16u;
// Gating codes (RouteSpec's Gating).
const SOFTMAX: u32 = 0u;
const SOFTMAX_AFTER_TOPK: u32 = 1u;
const SIGMOID: u32 = 2u;

var<workgroup> prob: array<f32, MAX_E>;
var<workgroup> sel: array<f32, MAX_E>;
var<workgroup> taken: array<u32, MAX_E>;
var<workgroup> rv: array<f32, WG>;
var<workgroup> ri: array<u32, WG>;
var<workgroup> gscore: array<f32, WG>;
var<workgroup> gkeep: array<u32, WG>;
var<workgroup> chosen: array<u32, MAX_K>;

fn reduce_max(v: f32, lid: u32) -> f32 {
    rv[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            rv[lid] = max(rv[lid], rv[lid + s]);
        }
        workgroupBarrier();
    }
    let r = rv[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(v: f32, lid: u32) -> f32 {
    rv[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            rv[lid] += rv[lid + s];
        }
        workgroupBarrier();
    }
    let r = rv[0];
    workgroupBarrier();
    return r;
}

// Whether (v, i) ranks before (bv, bi): higher score, ties to the lower index.
fn better(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    return v > bv || (v == bv && i < bi);
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let t = wid.x + wid.y * nwg.x;
    if (t >= P.n_tok) {
        return;
    }
    let n = P.n_expert;
    let base = t * n;
    var m = -3.4028235e38;
    for (var e = lid; e < n; e += WG) {
        m = max(m, L[base + e]);
    }
    m = reduce_max(m, lid);
    var part = 0.0;
    for (var e = lid; e < n; e += WG) {
        let l = L[base + e];
        var p = l;
        if (P.gating == SOFTMAX) {
            p = exp(l - m);
        } else if (P.gating == SIGMOID) {
            p = 1.0 / (1.0 + exp(-l));
        }
        prob[e] = p;
        part += p;
        taken[e] = 0u;
    }
    if (P.gating == SOFTMAX) {
        let s = reduce_sum(part, lid);
        for (var e = lid; e < n; e += WG) {
            prob[e] = prob[e] / s;
        }
    }
    for (var e = lid; e < n; e += WG) {
        var v = prob[e];
        if (P.has_bias == 1u) {
            v += B[e];
        }
        sel[e] = v;
    }
    workgroupBarrier();
    if (P.n_group > 0u) {
        let per = n / P.n_group;
        if (lid < P.n_group) {
            var b1 = -3.4028235e38;
            var b2 = -3.4028235e38;
            for (var e = lid * per; e < (lid + 1u) * per; e++) {
                let v = sel[e];
                if (v > b1) {
                    b2 = b1;
                    b1 = v;
                } else if (v > b2) {
                    b2 = v;
                }
            }
            gscore[lid] = b1 + b2;
        }
        workgroupBarrier();
        if (lid < P.n_group) {
            var rank = 0u;
            for (var h = 0u; h < P.n_group; h++) {
                if (better(gscore[h], h, gscore[lid], lid)) {
                    rank++;
                }
            }
            gkeep[lid] = select(0u, 1u, rank < P.topk_group);
        }
        workgroupBarrier();
        for (var e = lid; e < n; e += WG) {
            if (gkeep[e / per] == 0u) {
                sel[e] = -3.4028235e38;
            }
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < P.k; j++) {
        var bv = -3.4028235e38;
        var bi = 0xffffffffu;
        for (var e = lid; e < n; e += WG) {
            if (taken[e] == 0u && better(sel[e], e, bv, bi)) {
                bv = sel[e];
                bi = e;
            }
        }
        rv[lid] = bv;
        ri[lid] = bi;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (lid < s && better(rv[lid + s], ri[lid + s], rv[lid], ri[lid])) {
                rv[lid] = rv[lid + s];
                ri[lid] = ri[lid + s];
            }
            workgroupBarrier();
        }
        if (lid == 0u) {
            chosen[j] = ri[0];
            taken[ri[0]] = 1u;
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        var w: array<f32, MAX_K>;
        for (var j = 0u; j < P.k; j++) {
            w[j] = prob[chosen[j]];
        }
        if (P.gating == SOFTMAX_AFTER_TOPK) {
            var wm = -3.4028235e38;
            for (var j = 0u; j < P.k; j++) {
                wm = max(wm, w[j]);
            }
            var s = 0.0;
            for (var j = 0u; j < P.k; j++) {
                w[j] = exp(w[j] - wm);
                s += w[j];
            }
            for (var j = 0u; j < P.k; j++) {
                w[j] /= s;
            }
        }
        if (P.normalize == 1u) {
            var s = 0.0;
            for (var j = 0u; j < P.k; j++) {
                s += w[j];
            }
            for (var j = 0u; j < P.k; j++) {
                w[j] /= s;
            }
        }
        for (var j = 0u; j < P.k; j++) {
            OUT[t * P.k + j] = bitcast<u32>(w[j] * P.scale);
            OUT[P.ids_at + t * P.k + j] = chosen[j];
        }
    }
}
