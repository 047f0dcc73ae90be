// The split miss mode's partition of a decode layer's misses between the GPU and the CPU, made on
// the GPU so that the GPU's share starts right after the router, without waiting for the host.
// The host reads the ids back meanwhile and applies the same rule (`split::cpu_misses`) to find
// the CPU's share: both must agree exactly, so the rule is integer arithmetic on what both see
// (the ids, the layer's slot table, the share in 1/256).
//
// The rule: the layer's misses are its distinct experts whose table entry says host memory
// (`where` 1). Each has the key (its pairs' count, its id), distinct per expert. With n_miss
// misses, the CPU takes the n_cpu = (n_miss * share_q + 128) / 256 smallest keys (the experts
// with the fewest tokens, which cost the CPU least against the GPU's per-pair kernels); their
// pairs are written SKIP, which the per-pair kernels leave out. Every other pair keeps its id.
//
// One workgroup: WG invocations stride over the pairs (at most MAX_PAIRS). Phase 1 writes each
// pair's key into workgroup memory (NONE for a pool hit or a repeat of an earlier pair's expert);
// phase 2 counts the misses and ranks each pair's expert among them.
//
// The prefetch variant (lines starting `//F `, experts/prefetch.rs): the host announced in the
// up mailbox UPM, before the flag the previous layer's add waited for, the experts of this call
// it asked the copy queue to bring into staging slots (the area at pf_at: the call's sequence
// number, the layer's first table entry, the count, then six words per expert, its id first).
// Announced misses are the GPU's whatever happens to the copies: no candidates for the CPU (the
// host's rule excludes the same ones). With `two_pass`, they are left out of OUT too: their
// pairs go to OUT2 (every other pair SKIP there), which a second pass of the per-pair kernels
// computes after the first, when the copies have had longer to land; without, OUT keeps them and
// the one pass reads them from the table row this kernel writes into S2 when `row` is not 0 (as
// `moe_split_prefetch_patch.wgsl` writes it in a dispatch of its own, which the second pass still
// uses): the layer's row of S, with each announced miss whose tag in TAGS reads its value (the
// copy landed) pointing at its staging slot, and TAGS[stat_at], [stat_at + 1] counting the
// announced misses found landed and not.
struct Params {
    n_pairs: u32,
    ids_at: u32,
    slots_at: u32,
    share_q: u32,
//F     pf_at: u32,
//F     seq: u32,
//F     two_pass: u32,
//F     row: u32,
//F     stat_at: u32,
//F     _p1: u32,
//F     _p2: u32,
//F     _p3: u32,
}

@group(0) @binding(0) var<storage, read> IDS: array<u32>;
@group(0) @binding(1) var<storage, read> S: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> OUT: array<u32>;
//F @group(0) @binding(3) var<storage, read_write> UPM: array<atomic<u32>>;
//F @group(0) @binding(4) var<storage, read_write> OUT2: array<u32>;
//F @group(0) @binding(5) var<storage, read_write> TAGS: array<atomic<u32>>;
//F @group(0) @binding(6) var<storage, read_write> S2: array<vec4<u32>>;
@group(0) @binding({{P_BINDING}}) var<uniform> P: Params;

const WG: u32 = 64u;
const MAX_PAIRS: u32 = {{MAX_PAIRS}}u;
const SKIP: u32 = {{SKIP}}u;
const NONE: u32 = 0xffffffffu;

var<workgroup> key: array<u32, MAX_PAIRS>;
// The announced experts, and how many (none without the prefetch lines).
const PF_MAX: u32 = {{PF_MAX}}u;
var<workgroup> pf_n: u32;
var<workgroup> pf_e: array<u32, PF_MAX>;
//F // Each announced expert's entry for S2 (`where` NONE: keep the table's).
//F var<workgroup> pf_entry: array<vec4<u32>, PF_MAX>;

fn announced(e: u32) -> bool {
    for (var j = 0u; j < pf_n; j++) {
        if (pf_e[j] == e) {
            return true;
        }
    }
    return false;
}

fn miss_key(q: u32) -> u32 {
    let e = IDS[P.ids_at + q];
    if (S[P.slots_at + e].x != 1u || announced(e)) {
        return NONE;
    }
    var count = 0u;
    for (var r = 0u; r < P.n_pairs; r++) {
        if (IDS[P.ids_at + r] == e) {
            if (r < q) {
                return NONE;
            }
            count++;
        }
    }
    // Ids are below 65536 (the router's limit is far lower), counts below MAX_PAIRS.
    return (count << 16u) | e;
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    if (lid == 0u) {
        var n = 0u;
//F         if (atomicLoad(&UPM[P.pf_at]) == P.seq && atomicLoad(&UPM[P.pf_at + 1u]) == P.slots_at) {
//F             n = min(atomicLoad(&UPM[P.pf_at + 2u]), PF_MAX);
//F         }
//F         for (var j = 0u; j < n; j++) {
//F             let b = P.pf_at + 3u + 6u * j;
//F             let e = atomicLoad(&UPM[b]);
//F             pf_e[j] = e;
//F             pf_entry[j] = vec4<u32>(NONE, 0u, 0u, 0u);
//F             if (P.row != 0u && S[P.slots_at + e].x == 1u) {
//F                 if (atomicLoad(&TAGS[atomicLoad(&UPM[b + 4u])]) == atomicLoad(&UPM[b + 5u])) {
//F                     pf_entry[j] = vec4<u32>(0u, atomicLoad(&UPM[b + 1u]), atomicLoad(&UPM[b + 2u]), atomicLoad(&UPM[b + 3u]));
//F                     atomicAdd(&TAGS[P.stat_at], 1u);
//F                 } else {
//F                     atomicAdd(&TAGS[P.stat_at + 1u], 1u);
//F                 }
//F             }
//F         }
        pf_n = n;
    }
    workgroupBarrier();
//F     for (var i = lid; i < P.row; i += WG) {
//F         var ent = S[P.slots_at + i];
//F         for (var j = 0u; j < pf_n; j++) {
//F             if (pf_e[j] == i && pf_entry[j].x == 0u) {
//F                 ent = pf_entry[j];
//F             }
//F         }
//F         S2[i] = ent;
//F     }
    for (var q = lid; q < P.n_pairs; q += WG) {
        key[q] = miss_key(q);
    }
    workgroupBarrier();
    var n_miss = 0u;
    for (var q = 0u; q < P.n_pairs; q++) {
        n_miss += u32(key[q] != NONE);
    }
    let n_cpu = (n_miss * P.share_q + 128u) / 256u;
    for (var p = lid; p < P.n_pairs; p += WG) {
        let e = IDS[P.ids_at + p];
        var out = e;
        var late = S[P.slots_at + e].x == 1u && announced(e);
//F         OUT2[p] = select(SKIP, e, late);
//F         if (late && P.two_pass == 0u) {
//F             // Computed in the one pass: never the CPU's, never SKIP.
//F             OUT[p] = e;
//F             continue;
//F         }
        if (late) {
            out = SKIP;
        } else if (S[P.slots_at + e].x == 1u) {
            // This expert's key, found at its first pair.
            var own = NONE;
            for (var q = 0u; q < P.n_pairs; q++) {
                if (key[q] != NONE && (key[q] & 0xffffu) == e) {
                    own = key[q];
                }
            }
            var rank = 0u;
            for (var q = 0u; q < P.n_pairs; q++) {
                rank += u32(key[q] < own);
            }
            if (rank < n_cpu) {
                out = SKIP;
            }
        }
        OUT[p] = out;
    }
}
