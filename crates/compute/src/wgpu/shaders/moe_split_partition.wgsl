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
// it asked the copy queue to bring into staging slots of the pool (the area at pf_at: the call's
// sequence number, the layer's first table entry, the count, then per expert its id, its
// matrices' first words in the staging slot, the word of its tag in TAGS and the tag's value).
// Those experts are the GPU's whatever happens to the copies: they are no candidates for the CPU
// (the host's rule excludes the same ones). The kernel writes the layer's table row into S2 for
// the per-pair kernels, with each announced expert that misses and whose tag reads its value
// (the copy landed) pointing to its staging slot (`where` 0); one whose copy has not landed is
// read from host memory as any miss (the same bytes). TAGS[stat_at] and [stat_at + 1] count the
// announced misses found landed and not.
struct Params {
    n_pairs: u32,
    ids_at: u32,
    slots_at: u32,
    share_q: u32,
//F     pf_at: u32,
//F     seq: u32,
//F     row: u32,
//F     stat_at: u32,
}

@group(0) @binding(0) var<storage, read> IDS: array<u32>;
@group(0) @binding(1) var<storage, read> S: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> OUT: array<u32>;
//F @group(0) @binding(3) var<storage, read_write> UPM: array<atomic<u32>>;
//F @group(0) @binding(4) var<storage, read_write> TAGS: array<atomic<u32>>;
//F @group(0) @binding(5) var<storage, read_write> S2: array<vec4<u32>>;
@group(0) @binding({{P_BINDING}}) var<uniform> P: Params;

const WG: u32 = 64u;
const MAX_PAIRS: u32 = {{MAX_PAIRS}}u;
const SKIP: u32 = {{SKIP}}u;
const NONE: u32 = 0xffffffffu;

var<workgroup> key: array<u32, MAX_PAIRS>;
// The announced experts (ids), how many, and for each the table entry the per-pair kernels get
// (its staging slot once landed, else its own entry; `where` NONE: a pool hit, left alone).
const PF_MAX: u32 = {{PF_MAX}}u;
var<workgroup> pf_n: u32;
var<workgroup> pf_e: array<u32, PF_MAX>;
var<workgroup> pf_entry: array<vec4<u32>, PF_MAX>;

// Whether expert e was announced for the copy queue (always false without the prefetch lines).
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
//F         let at = P.pf_at;
//F         if (atomicLoad(&UPM[at]) == P.seq && atomicLoad(&UPM[at + 1u]) == P.slots_at) {
//F             n = min(atomicLoad(&UPM[at + 2u]), PF_MAX);
//F         }
//F         for (var j = 0u; j < n; j++) {
//F             let b = at + 3u + 6u * j;
//F             let e = atomicLoad(&UPM[b]);
//F             pf_e[j] = e;
//F             pf_entry[j] = vec4<u32>(NONE, 0u, 0u, 0u);
//F             if (S[P.slots_at + e].x == 1u) {
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
        if (S[P.slots_at + e].x == 1u && !announced(e)) {
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
