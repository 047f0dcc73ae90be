// Decode attention (a few query tokens) built for latency: rope of the new queries and keys, their
// cache rows written, causal attention over the cache, and the output (or, split over several
// workgroups, a partial softmax state per row for attention_combine.wgsl).
//
// The prefill kernel (attention.wgsl) gives each (token, head) a workgroup whose invocations
// each score a whole key: a serial dot product per key and two six-barrier reductions per tile of
// 64 keys, 32 workgroups for a decode step. Here:
// - One workgroup serves ROWS query rows (rows = (token, query head) of one KV head: grouped-query
//   heads read each key and value once) over one slice of the keys (split-K, flash-decoding:
//   workgroups = KV heads x row groups x key slices, so a long context fills the GPU).
// - A lane group (a subgroup, or in the fallback LANES invocations reduced through workgroup
//   memory) scores a key: lane l holds the vec4 chunks l, l + gsize, ... of the head, one load
//   per chunk, the products summed across the group (subgroupAdd). Each group takes UNROLL
//   consecutive keys per iteration, all loads issued before any sum, and keeps its own online
//   softmax state (max, denominator, accumulator chunks); no barrier in the key loop.
// - The groups' states merge once at the end through workgroup memory.
//
// Keys at positions >= pos0 (this step's) come from KN/VN, not the cache: other workgroups write
// those rows in this same dispatch, unordered with respect to this one. Each (token, KV head)
// row is written once, by the workgroup of row group 0 and key slice 0. Rotation (rope = 1) is
// rope.wgsl's, term for term (cos/sin table from the host; norm or neox pairs; dims past n_rot
// pass through). Sliding window: keys at positions > pos - window. Optional soft-cap, and one
// sink logit per head that joins the denominator only (applied where the output is final).
//
// The q/k-norm variant (lines starting `//N `, uncommented by shaders::attention_decode): the
// per-head RMS norms of the queries and the new keys (Qwen3's q_norm and k_norm) happen here, as
// each value is loaded: the workgroup first sums the squares of its rows' query heads and of its
// KV head's new keys (a tree through workgroup memory) into their 1/rms, then every load of Q or
// KN is scaled by it and by the norm's weight. One dispatch less per layer than a norm before the
// attention; each workgroup reads its heads once more (a few hundred bytes).
//
// Template constants: WG invocations, ROWS rows, HDK/HDV head dims (multiples of 4), CK/CV vec4
// chunks per lane (ceil(HD/4 / smallest group)), UNROLL keys per iteration, MAXG groups at most.
struct Params {
    n_tok: u32,
    n_head: u32,
    n_head_kv: u32,
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
    n_split: u32,
    split_keys: u32,
    n_rowgroups: u32,
    key_lo: u32,
    // The q/k-norm variant's epsilon.
    norm_eps: f32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> Q: array<f32>;
@group(0) @binding(1) var<storage, read> KN: array<f32>;
@group(0) @binding(2) var<storage, read> VN: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> CS: array<f32>;
@group(0) @binding(4) var<storage, read> S: array<f32>;
@group(0) @binding(5) var<storage, read_write> KC: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> VC: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> Y: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> QS: array<u32>;
@group(0) @binding(9) var<storage, read_write> DS: array<vec2<f32>>;
@group(0) @binding(10) var<storage, read_write> PACC: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read_write> PML: array<vec2<f32>>;
//N @group(0) @binding(12) var<storage, read> WQN: array<f32>;
//N @group(0) @binding(13) var<storage, read> WKN: array<f32>;
@group(0) @binding({{P_BINDING}}) var<uniform> P: Params;

const WG: u32 = {{WG}}u;
const ROWS: u32 = {{ROWS}}u;
const HDK: u32 = {{HDK}}u;
const HDV: u32 = {{HDV}}u;
const HDK4: u32 = HDK / 4u;
const HDV4: u32 = HDV / 4u;
const CK: u32 = {{CK}}u;
const CV: u32 = {{CV}}u;
const UNROLL: u32 = {{UNROLL}}u;
const MAXG: u32 = {{MAXG}}u;
const NSUM: u32 = UNROLL * ROWS;
// int8 blocks of a value head (the epilogue runs only when HDV is a multiple of 32), at least 1
// so the divisions below stay defined when it is not.
const HDV_BLOCKS: u32 = {{HDV_BLOCKS}}u;
const NEG: f32 = -3.4028235e38;

// Written before read (the pipeline skips WGSL's zeroing, Plain::workgroup_memory_written_first's
// argument): sh_m/sh_l[g * ROWS + r] are written by lane 0 of group g for every r before the
// barrier after which groups g < ngrp are read; group 0 (whose lanes cover every chunk, since
// gsize * CV >= HDV4) assigns every sh_acc element of every row before the next barrier, later
// groups add after further barriers, and the output phase reads after the last one; sh_ngrp is
// written by invocation 0 before workgroupUniformLoad; group_sum's array (fallback) is written
// by each invocation for its own slots before its first barrier.
var<workgroup> sh_m: array<f32, MAXG * ROWS>;
var<workgroup> sh_l: array<f32, MAXG * ROWS>;
var<workgroup> sh_acc: array<vec4<f32>, ROWS * HDV4>;
var<workgroup> sh_ngrp: u32;
// The q/k-norm variant's 1/rms of rows r < ROWS (query heads) and of new keys t (at ROWS + t),
// and the sums of squares being reduced (each invocation writes its own slot of every vector
// before the first barrier; the tree reads slots written before the barrier it follows).
//N const MAXT: u32 = 4u;
//N var<workgroup> sh_inv: array<f32, ROWS + MAXT>;
//N var<workgroup> sh_sq: array<f32, (ROWS + MAXT) * WG>;

// 1/rms of row r's query head and of new key t (1 without the norms).
fn q_inv(r: u32) -> f32 {
    var v = 1.0;
//N     v = sh_inv[r];
    return v;
}

fn k_inv(t: u32) -> f32 {
    var v = 1.0;
//N     v = sh_inv[ROWS + t];
    return v;
}

// Query value i (an index into Q) as the attention sees it: normed by its head's `inv` and the
// weight of its dim in the q/k-norm variant, else as stored. Likewise a new key's.
fn q_val(i: u32, inv: f32) -> f32 {
    var x = Q[i];
//N     x = x * inv * WQN[i % HDK];
    return x;
}

fn kn_val(i: u32, inv: f32) -> f32 {
    var x = KN[i];
//N     x = x * inv * WKN[i % HDK];
    return x;
}

{{ROPE_PAIR}}

// Query value `at` of token t, (normed by `inv`, see q_val, and) rotated.
fn q_at(at: u32, t: u32, inv: f32) -> f32 {
    let p = rope_pair(at, P.n_head * HDK, t);
    if (p.w == 2u) {
        return q_val(at, inv);
    }
    return turn(q_val(p.x, inv), q_val(p.y, inv), p);
}

// New key value `at` of token t, (normed and) rotated.
fn kn_at(at: u32, t: u32, inv: f32) -> f32 {
    let p = rope_pair(at, P.n_head_kv * HDK, t);
    if (p.w == 2u) {
        return kn_val(at, inv);
    }
    return turn(kn_val(p.x, inv), kn_val(p.y, inv), p);
}

// Four rotated values of a query or new-key row from `at` (a multiple of 4).
fn q4_at(at: u32, t: u32, inv: f32) -> vec4<f32> {
    return vec4<f32>(q_at(at, t, inv), q_at(at + 1u, t, inv), q_at(at + 2u, t, inv), q_at(at + 3u, t, inv));
}

fn kn4_at(at: u32, t: u32) -> vec4<f32> {
    let inv = k_inv(t);
    return vec4<f32>(kn_at(at, t, inv), kn_at(at + 1u, t, inv), kn_at(at + 2u, t, inv), kn_at(at + 3u, t, inv));
}

{{GROUP_SUM}}

{{Q8_BLOCK}}

@compute @workgroup_size({{WG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{GROUP_ARGS}}
) {
    {{GROUP_IDS}}
    let kvh = wid.x / P.n_rowgroups;
    let rg = wid.x % P.n_rowgroups;
    let split = wid.y;
    let group = P.n_head / P.n_head_kv;
    let n_rows = group * P.n_tok;
    let kw = P.n_head_kv * HDK;
    let vw = P.n_head_kv * HDV;
    let pos_last = P.pos0 + P.n_tok - 1u;

//N     // The heads' sums of squares: vector v < ROWS is row v's query head, ROWS + t this KV
//N     // head's new key t; each invocation sums its dims, then a tree over the workgroup.
//N     for (var v = 0u; v < ROWS + MAXT; v++) {
//N         var s = 0.0;
//N         for (var d = lid; d < HDK; d += WG) {
//N             var x = 0.0;
//N             if (v < ROWS) {
//N                 let rho = rg * ROWS + v;
//N                 if (rho < n_rows) {
//N                     let h = kvh * group + rho % group;
//N                     x = Q[((rho / group) * P.n_head + h) * HDK + d];
//N                 }
//N             } else if (v - ROWS < P.n_tok) {
//N                 x = KN[(v - ROWS) * kw + kvh * HDK + d];
//N             }
//N             s += x * x;
//N         }
//N         sh_sq[v * WG + lid] = s;
//N     }
//N     workgroupBarrier();
//N     for (var half = WG / 2u; half > 0u; half = half / 2u) {
//N         if (lid < half) {
//N             for (var v = 0u; v < ROWS + MAXT; v++) {
//N                 sh_sq[v * WG + lid] += sh_sq[v * WG + lid + half];
//N             }
//N         }
//N         workgroupBarrier();
//N     }
//N     if (lid < ROWS + MAXT) {
//N         sh_inv[lid] = inverseSqrt(sh_sq[lid * WG] / f32(HDK) + P.norm_eps);
//N     }
//N     workgroupBarrier();

    // The rows' queries (rotated) go to registers in the first iteration of the key loop, after
    // its key and value loads are issued, so both wait on memory together. Chunk i of a lane
    // holds dims 4 * (lane + gsize * i).
    var qv: array<vec4<f32>, ROWS * CK>;
    // Visible key range of each row: [row_lo, row_hi]; an inactive row sees none.
    var row_lo: array<u32, ROWS>;
    var row_hi: array<u32, ROWS>;
    var row_active: array<bool, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        let rho = rg * ROWS + r;
        row_active[r] = rho < n_rows;
        let pos = P.pos0 + min(rho / group, P.n_tok - 1u);
        row_hi[r] = pos;
        row_lo[r] = 0u;
        if (P.window > 0u && pos + 1u > P.window) {
            row_lo[r] = pos + 1u - P.window;
        }
    }

    // This workgroup's keys.
    let k_lo = P.key_lo + split * P.split_keys;
    let k_end = min(k_lo + P.split_keys, pos_last + 1u);
    var m: array<f32, ROWS>;
    var l: array<f32, ROWS>;
    var acc: array<vec4<f32>, ROWS * CV>;
    for (var r = 0u; r < ROWS; r++) {
        m[r] = NEG;
        l[r] = 0.0;
    }
    for (var x = 0u; x < ROWS * CV; x++) {
        acc[x] = vec4<f32>(0.0);
    }
    let per_iter = ngrp * UNROLL;
    let n_iter = (k_end - min(k_lo, k_end) + per_iter - 1u) / per_iter;
    for (var it = 0u; it < n_iter; it++) {
        let jb = k_lo + (it * ngrp + grp) * UNROLL;
        // Every load of the iteration first: keys and values of UNROLL keys.
        var kk: array<vec4<f32>, UNROLL * CK>;
        var vv: array<vec4<f32>, UNROLL * CV>;
        for (var u = 0u; u < UNROLL; u++) {
            let j = jb + u;
            for (var i = 0u; i < CK; i++) {
                let c = lane + gsize * i;
                var kx = vec4<f32>(0.0);
                if (j < k_end && c < HDK4) {
                    if (j < P.pos0) {
                        kx = KC[(j * kw + kvh * HDK) / 4u + c];
                    } else {
                        let t = j - P.pos0;
                        kx = kn4_at(t * kw + kvh * HDK + 4u * c, t);
                    }
                }
                kk[u * CK + i] = kx;
            }
            for (var i = 0u; i < CV; i++) {
                let c = lane + gsize * i;
                var vx = vec4<f32>(0.0);
                if (j < k_end && c < HDV4) {
                    if (j < P.pos0) {
                        vx = VC[(j * vw + kvh * HDV) / 4u + c];
                    } else {
                        vx = VN[((j - P.pos0) * vw + kvh * HDV) / 4u + c];
                    }
                }
                vv[u * CV + i] = vx;
            }
        }
        if (it == 0u) {
            for (var r = 0u; r < ROWS; r++) {
                let rho = rg * ROWS + r;
                let t = min(rho / group, P.n_tok - 1u);
                let h = kvh * group + rho % group;
                for (var i = 0u; i < CK; i++) {
                    let c = lane + gsize * i;
                    var v = vec4<f32>(0.0);
                    if (row_active[r] && c < HDK4) {
                        v = q4_at(t * P.n_head * HDK + h * HDK + 4u * c, t, q_inv(r));
                    }
                    qv[r * CK + i] = v;
                }
            }
        }
        var part: array<f32, NSUM>;
        for (var u = 0u; u < UNROLL; u++) {
            for (var r = 0u; r < ROWS; r++) {
                var d = 0.0;
                for (var i = 0u; i < CK; i++) {
                    d += dot(qv[r * CK + i], kk[u * CK + i]);
                }
                part[u * ROWS + r] = d;
            }
        }
        let sums = group_sum(part, lid);
        for (var r = 0u; r < ROWS; r++) {
            var s: array<f32, UNROLL>;
            var mx = NEG;
            for (var u = 0u; u < UNROLL; u++) {
                let j = jb + u;
                var sc = NEG;
                if (row_active[r] && j < k_end && j >= row_lo[r] && j <= row_hi[r]) {
                    sc = sums[u * ROWS + r] * P.scale;
                    if (P.softcap > 0.0) {
                        sc = P.softcap * tanh(clamp(sc / P.softcap, -15.0, 15.0));
                    }
                }
                s[u] = sc;
                mx = max(mx, sc);
            }
            let m_new = max(m[r], mx);
            let corr = exp(m[r] - m_new);
            var psum = 0.0;
            var pv: array<f32, UNROLL>;
            for (var u = 0u; u < UNROLL; u++) {
                var p = 0.0;
                if (s[u] > NEG) {
                    p = exp(s[u] - m_new);
                }
                pv[u] = p;
                psum += p;
            }
            l[r] = l[r] * corr + psum;
            m[r] = m_new;
            for (var i = 0u; i < CV; i++) {
                var a = acc[r * CV + i] * corr;
                for (var u = 0u; u < UNROLL; u++) {
                    a += pv[u] * vv[u * CV + i];
                }
                acc[r * CV + i] = a;
            }
        }
    }

    // Merge the groups: the workgroup's max per row, each group's accumulator scaled to it and
    // summed into sh_acc one group after another.
    if (lane == 0u) {
        for (var r = 0u; r < ROWS; r++) {
            sh_m[grp * ROWS + r] = m[r];
            sh_l[grp * ROWS + r] = l[r];
        }
    }
    if (lid == 0u) {
        sh_ngrp = ngrp;
    }
    let ng = workgroupUniformLoad(&sh_ngrp);
    var big_m: array<f32, ROWS>;
    var big_l: array<f32, ROWS>;
    for (var r = 0u; r < ROWS; r++) {
        var mm = NEG;
        for (var g = 0u; g < ng; g++) {
            mm = max(mm, sh_m[g * ROWS + r]);
        }
        var ll = 0.0;
        for (var g = 0u; g < ng; g++) {
            ll += sh_l[g * ROWS + r] * exp(sh_m[g * ROWS + r] - mm);
        }
        big_m[r] = mm;
        big_l[r] = ll;
    }
    for (var g = 0u; g < MAXG; g++) {
        if (g < ng && grp == g) {
            for (var r = 0u; r < ROWS; r++) {
                let f = exp(m[r] - big_m[r]);
                for (var i = 0u; i < CV; i++) {
                    let c = lane + gsize * i;
                    if (c < HDV4) {
                        var a = acc[r * CV + i] * f;
                        if (g > 0u) {
                            a += sh_acc[r * HDV4 + c];
                        }
                        sh_acc[r * HDV4 + c] = a;
                    }
                }
            }
        }
        workgroupBarrier();
        if (g + 1u >= ng) {
            break;
        }
    }

    // Output: the final rows (one key slice), or this slice's partial state.
    let direct = P.n_split == 1u;
    for (var x = lid; x < ROWS * HDV4; x += WG) {
        let r = x / HDV4;
        let c = x % HDV4;
        let rho = rg * ROWS + r;
        if (rho < n_rows) {
            let t = rho / group;
            let h = kvh * group + rho % group;
            let row = t * P.n_head + h;
            if (direct) {
                var mm = big_m[r];
                var ll = big_l[r];
                var corr = 1.0;
                if (P.has_sinks == 1u) {
                    let sk = S[h];
                    let m_new = max(mm, sk);
                    corr = exp(mm - m_new);
                    ll = ll * corr + exp(sk - m_new);
                }
                let y = sh_acc[x] * corr / ll;
                Y[row * HDV4 + c] = y;
                sh_acc[x] = y;
            } else {
                let at = split * P.n_tok * P.n_head + row;
                PACC[at * HDV4 + c] = sh_acc[x];
                if (c == 0u) {
                    PML[at] = vec2<f32>(big_m[r], big_l[r]);
                }
            }
        }
    }
    if (P.q8 == 1u && P.n_split == 1u) {
        // A head's HDV values (a multiple of 32) are whole blocks of the output row.
        workgroupBarrier();
        for (var b = lid; b < ROWS * (HDV / 32u); b += WG) {
            let r = b / HDV_BLOCKS;
            let blk = b % HDV_BLOCKS;
            let rho = rg * ROWS + r;
            if (rho < n_rows) {
                let t = rho / group;
                let h = kvh * group + rho % group;
                var v: array<vec4<f32>, 8>;
                for (var e = 0u; e < 8u; e++) {
                    v[e] = sh_acc[r * HDV4 + blk * 8u + e];
                }
                q8_block(v, ((t * P.n_head + h) * HDV) / 32u + blk);
            }
        }
    }
    // This step's keys and values to the cache, once per KV head. Last, so the stores (which
    // wait for their KN loads) do not hold up the key loop; no workgroup reads these rows from
    // the cache in this dispatch.
    if (rg == 0u && split == 0u) {
        for (var x = lid; x < P.n_tok * HDK4; x += WG) {
            let t = x / HDK4;
            let c = x % HDK4;
            KC[((P.pos0 + t) * kw + kvh * HDK) / 4u + c] = kn4_at(t * kw + kvh * HDK + 4u * c, t);
        }
        for (var x = lid; x < P.n_tok * HDV4; x += WG) {
            let t = x / HDV4;
            let c = x % HDV4;
            VC[((P.pos0 + t) * vw + kvh * HDV) / 4u + c] = VN[(t * vw + kvh * HDV) / 4u + c];
        }
    }
}
