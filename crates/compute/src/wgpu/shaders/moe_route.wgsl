// MoE routing on the GPU, one workgroup per token, as the CPU's `route_token`: probabilities
// (softmax, sigmoid, or the raw logits when the softmax comes after the top-k), selection scores
// (plus the selection bias), DeepSeek-V3's group limit (a group's score is the sum of its two best
// selection scores; only the best topk_group groups compete), the top k by score (ties to the
// lower index), then the weights: their softmax (after top-k), normalisation, scale.
// Output, in one buffer: k weights per token (f32 bits) from word 0, k ids per token from word
// ids_at. The weights part is the routing tensor; the ids are read back when the host needs them
// (to find the pool's misses, or to group a prefill batch by expert) and read in place by the
// per-pair MoE kernels otherwise.
// Masked experts score -FLT_MAX (the CPU uses -inf: the same order, finite numbers only in WGSL
// constants).
// Why ranks: the top k are the experts whose rank (the number of experts that beat them, ties to
// the lower index: a strict total order) is below k, so each invocation ranks its own experts
// against all n in workgroup memory and the chosen ones write themselves into place: two barriers
// where k rounds of a workgroup arg-max took ~9 each (31 us per call on the H200, top 8 of 128).
// The maximum and the softmax sum are read by every invocation, four experts at a time, instead
// of a tree of barriers.
// Workgroup memory is written before it is read, so the pipeline skips WGSL's zeroing (~1 us
// for these 8 KiB on the H200): prob, ex and sel for e < n, gscore and gkeep for the n_group
// groups, chosen for every rank before the first barrier.
// Limits (the caller routes on the host beyond them): n_expert <= MAX_E, k <= MAX_K, n_group <= WG.
// The split's hand-over variant (lines starting `//S `, uncommented by `route_signal_source`;
// one token, one workgroup): the routing and the hidden state X also go into the host-visible
// mailbox D, then the call's sequence number into its flag, as mailbox_signal.wgsl does in a
// dispatch of its own (one dependent dispatch less on the chain from the CPU's sum to the next
// layer's ids; `DISKFORMER_SPLIT_SIGNAL=apart` keeps them apart).
// The router variant (lines starting `//R `, `route_source(true, _)`; one token): the router's
// product of the one token too, rather than in a dispatch of its own before this one. RPW rows a
// workgroup (TPR invocations a row, a tree through workgroup memory), the logits stored as
// atomics, then each workgroup counts itself done on CNT; the last one (which sees every other's
// count, so their logits) routes as above and sets CNT back to 0 for the next call. One
// dependent dispatch less per MoE layer (`DISKFORMER_ROUTER_ROUTE=apart` keeps them apart).
// The norm variant of it (lines starting `//F `, `route_source(true, _, true)`): XR is the raw
// residual and NW the FFN norm's weight; every workgroup takes the RMS norm of XR itself (as
// norm_reg.wgsl: 1 / sqrt(mean of squares + eps), then (x * inv) * w) before its rows, and the
// hand-over writes the normed row. The norm's own dispatch, still needed by the GPU's experts,
// then runs after this one (`WgpuBackend::take_norm_for_router`), off the chain from the CPU's
// sum to the ids (`DISKFORMER_ROUTER_NORM=apart` keeps them in order). With the hand-over, its
// `//Y ` lines replace the `//X ` ones (no X: the normed row is written from XR).
// The guess variant (lines starting `//G `, with the router and the hand-over; the split's
// prefetch, experts/prefetch.rs): the next layer's router GW on the same (normed) row too, in as
// many workgroups again (their logits after this layer's in L), and after the hand-over's flag the
// last workgroup ranks them (top k by logit: softmax and sigmoid keep the order; the caller takes
// this variant only without a selection bias or groups) and writes into D at g_at the first g_max
// of them, best first, that the slot table GS puts in host memory (`where` 1, from entry
// g_slots_at): their count at g_at + 1, the ids from g_at + 2, then the call's sequence number at
// g_at after a storage barrier. That is what `moe_split_prefetch_pick.wgsl` writes after a
// routing of its own: two dependent dispatches less on the GPU's share.
// WGSL's atomics are relaxed and its barriers workgroup-scoped, so "sees the count, so the
// logits" is not promised by its memory model; it holds where atomics are performed in the
// device's coherent cache in order with the storage barrier before the count (NVIDIA's L2,
// lavapipe's CPU memory), which the op test (`router_route_matches_cpu`) and the H200's greedy
// text check. An adapter where it failed would route on stale logits: keep the op test on it.
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
    // The hand-over variant's: words of X, where the routing and X go in D, the flag's word, and
    // the sequence number it takes.
    x_words: u32,
    data_at: u32,
    flag_at: u32,
    seq: u32,
    // The router variant's: the router's input width, and a router row's stride in vec4s; the
    // norm variant's epsilon.
    k_in: u32,
    w_row4: u32,
    eps: f32,
    _r1: u32,
    // The guess variant's: where its words go in D, the next layer's first table entry, the most
    // experts it names.
    g_at: u32,
    g_slots_at: u32,
    g_max: u32,
    _g1: u32,
}

{{L_DECL}}
@group(0) @binding(1) var<storage, read> B: array<f32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<u32>;
// The router variant's weights (rows of w_row4 vec4s), input and done-count; the hand-over
// variant's X and D after them. The back end binds the uniform after the buffers, so P's binding
// is the number of buffers (`route_source`).
//R @group(0) @binding(3) var<storage, read> W: array<vec4<f32>>;
//R @group(0) @binding(4) var<storage, read> XR: array<vec4<f32>>;
//R @group(0) @binding(5) var<storage, read_write> CNT: array<atomic<u32>>;
//F @group(0) @binding(6) var<storage, read> NW: array<vec4<f32>>;
//X @group(0) @binding({{X_BINDING}}) var<storage, read> X: array<u32>;
//S @group(0) @binding({{D_BINDING}}) var<storage, read_write> D: array<atomic<u32>>;
//G @group(0) @binding({{GW_BINDING}}) var<storage, read> GW: array<vec4<f32>>;
//G @group(0) @binding({{GS_BINDING}}) var<storage, read> GS: array<vec4<u32>>;
@group(0) @binding({{P_BINDING}}) var<uniform> P: Params;

const WG: u32 = 256u;
const MAX_E: u32 = 512u;
const MAX_K: u32 = 16u;
// Gating codes (RouteSpec's Gating).
const SOFTMAX: u32 = 0u;
const SOFTMAX_AFTER_TOPK: u32 = 1u;
const SIGMOID: u32 = 2u;

// prob: the logits, then (each invocation rewriting its own experts') the probabilities.
var<workgroup> prob: array<f32, MAX_E>;
var<workgroup> ex: array<f32, MAX_E>;
var<workgroup> sel: array<f32, MAX_E>;
var<workgroup> gscore: array<f32, WG>;
var<workgroup> gkeep: array<u32, WG>;
var<workgroup> chosen: array<u32, MAX_K>;

//R const RPW: u32 = 4u;
//R const TPR: u32 = WG / RPW;
//R var<workgroup> red: array<f32, WG>;
//R var<workgroup> is_last: u32;
//F var<private> inv_rms: f32;
//R
//R // Workgroup g's RPW logits of the token, stored as atomics, then its done-count: is_last
//R // says whether it was the last of the n_groups workgroups (red and is_last are written
//R // before they are read, the tree reading slots written before the barrier it follows).
//R fn router_rows(g: u32, n_groups: u32, lid: u32) {
//F     // The norm's 1 / rms, the same in every invocation (red reused by the rows after).
//F     var ss = 0.0;
//F     for (var i = lid; i < P.k_in / 4u; i += WG) {
//F         let v = XR[i];
//F         ss += dot(v, v);
//F     }
//F     red[lid] = ss;
//F     workgroupBarrier();
//F     for (var half = WG / 2u; half > 0u; half = half / 2u) {
//F         if (lid < half) {
//F             red[lid] += red[lid + half];
//F         }
//F         workgroupBarrier();
//F     }
//F     inv_rms = 1.0 / sqrt(red[0] / f32(P.k_in) + P.eps);
//F     workgroupBarrier();
//R     let row = g * RPW + lid / TPR;
//R     var s = 0.0;
//R     if (row < P.n_expert) {
//R         for (var i = lid % TPR; i < P.k_in / 4u; i += TPR) {
//R             s += dot(W[row * P.w_row4 + i], {{ROUTER_X}});
//R         }
//R     }
//G     // The guess's rows follow (a workgroup's rows are all of one router: n_expert is a
//G     // multiple of RPW where this variant runs).
//G     else if (row < 2u * P.n_expert) {
//G         let grow = row - P.n_expert;
//G         for (var i = lid % TPR; i < P.k_in / 4u; i += TPR) {
//G             s += dot(GW[grow * P.w_row4 + i], {{ROUTER_X}});
//G         }
//G     }
//R     red[lid] = s;
//R     workgroupBarrier();
//R     for (var half = TPR / 2u; half > 0u; half = half / 2u) {
//R         if (lid % TPR < half) {
//R             red[lid] += red[lid + half];
//R         }
//R         workgroupBarrier();
//R     }
//R     if (lid % TPR == 0u && row < {{ROUTER_ROWS}}) {
//R         atomicStore(&L[row], bitcast<u32>(red[lid]));
//R     }
//R     storageBarrier();
//R     if (lid == 0u) {
//R         let done = atomicAdd(&CNT[0], 1u) + 1u;
//R         is_last = select(0u, 1u, done == n_groups);
//R         if (done == n_groups) {
//R             atomicStore(&CNT[0], 0u);
//R         }
//R     }
//R }

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
{{ROUTE_ENTRY}}
    let n = P.n_expert;
    let base = t * n;
    for (var e = lid; e < n; e += WG) {
        prob[e] = {{LOGIT}};
    }
    // Every rank below k is taken exactly once when the scores are ordered (finite); a NaN
    // score could leave one untaken, which then names expert 0 rather than stale memory.
    if (lid < MAX_K) {
        chosen[lid] = 0u;
    }
    workgroupBarrier();
    // The softmax's maximum and sum, the same in every invocation.
    // Four at a time: independent loads and four chains instead of one.
    var s = 1.0;
    if (P.gating == SOFTMAX) {
        var m4 = vec4<f32>(-3.4028235e38);
        var e = 0u;
        for (; e + 4u <= n; e += 4u) {
            m4 = max(m4, vec4<f32>(prob[e], prob[e + 1u], prob[e + 2u], prob[e + 3u]));
        }
        var m = max(max(m4.x, m4.y), max(m4.z, m4.w));
        for (; e < n; e++) {
            m = max(m, prob[e]);
        }
        for (var o = lid; o < n; o += WG) {
            ex[o] = exp(prob[o] - m);
        }
        workgroupBarrier();
        var s4 = vec4<f32>(0.0);
        e = 0u;
        for (; e + 4u <= n; e += 4u) {
            s4 += vec4<f32>(ex[e], ex[e + 1u], ex[e + 2u], ex[e + 3u]);
        }
        s = (s4.x + s4.y) + (s4.z + s4.w);
        for (; e < n; e++) {
            s += ex[e];
        }
    }
    for (var e = lid; e < n; e += WG) {
        var p = prob[e];
        if (P.gating == SOFTMAX) {
            p = ex[e] / s;
        } else if (P.gating == SIGMOID) {
            p = 1.0 / (1.0 + exp(-p));
        }
        prob[e] = p;
        var v = p;
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
    for (var e = lid; e < n; e += WG) {
        let v = sel[e];
        let v4 = vec4<f32>(v);
        var r4 = vec4<u32>(0u);
        var o = 0u;
        for (; o + 4u <= n; o += 4u) {
            let s4 = vec4<f32>(sel[o], sel[o + 1u], sel[o + 2u], sel[o + 3u]);
            let i4 = vec4<u32>(o) + vec4<u32>(0u, 1u, 2u, 3u);
            // better(s4[i], i4[i], v, e), lane-wise.
            let beats = (s4 > v4) | ((s4 == v4) & (i4 < vec4<u32>(e)));
            r4 += select(vec4<u32>(0u), vec4<u32>(1u), beats);
        }
        var rank = (r4.x + r4.y) + (r4.z + r4.w);
        for (; o < n; o++) {
            if (better(sel[o], o, v, e)) {
                rank++;
            }
        }
        if (rank < P.k) {
            chosen[rank] = e;
        }
    }
    workgroupBarrier();
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
            var ws = 0.0;
            for (var j = 0u; j < P.k; j++) {
                w[j] = exp(w[j] - wm);
                ws += w[j];
            }
            for (var j = 0u; j < P.k; j++) {
                w[j] /= ws;
            }
        }
        if (P.normalize == 1u) {
            var ws = 0.0;
            for (var j = 0u; j < P.k; j++) {
                ws += w[j];
            }
            for (var j = 0u; j < P.k; j++) {
                w[j] /= ws;
            }
        }
        for (var j = 0u; j < P.k; j++) {
            OUT[t * P.k + j] = bitcast<u32>(w[j] * P.scale);
            OUT[P.ids_at + t * P.k + j] = chosen[j];
//S         atomicStore(&D[P.data_at + j], bitcast<u32>(w[j] * P.scale));
//S         atomicStore(&D[P.data_at + P.ids_at + j], chosen[j]);
        }
    }
//S // The routing (above) and X in place, then the flag: a host that sees it sees them.
//S let x_at = P.data_at + 2u * P.ids_at;
//S for (var i = lid; i < P.x_words; i += WG) {
//X     atomicStore(&D[x_at + i], X[i]);
//Y     atomicStore(&D[x_at + i], bitcast<u32>(XR[i / 4u][i % 4u] * inv_rms * NW[i / 4u][i % 4u]));
//S }
//S storageBarrier();
//S if (lid == 0u) {
//S     atomicStore(&D[P.flag_at], P.seq);
//S }
//G // The guess, off the CPU's path (its flag is up): ranks as above, over the logits alone.
//G for (var e = lid; e < n; e += WG) {
//G     sel[e] = bitcast<f32>(atomicLoad(&L[n + e]));
//G }
//G workgroupBarrier();
//G for (var e = lid; e < n; e += WG) {
//G     let v = sel[e];
//G     var rank = 0u;
//G     for (var o = 0u; o < n; o++) {
//G         rank += u32(better(sel[o], o, v, e));
//G     }
//G     if (rank < P.k) {
//G         chosen[rank] = e;
//G     }
//G }
//G workgroupBarrier();
//G if (lid == 0u) {
//G     var m = 0u;
//G     for (var j = 0u; j < P.k && m < P.g_max; j++) {
//G         let e = chosen[j];
//G         if (GS[P.g_slots_at + e].x == 1u) {
//G             atomicStore(&D[P.g_at + 2u + m], e);
//G             m++;
//G         }
//G     }
//G     atomicStore(&D[P.g_at + 1u], m);
//G }
//G storageBarrier();
//G if (lid == 0u) {
//G     atomicStore(&D[P.g_at], P.seq);
//G }
}
