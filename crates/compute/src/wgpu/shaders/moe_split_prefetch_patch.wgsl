// The split's prefetch (experts/prefetch.rs): where the second pass of the per-pair kernels
// reads the announced experts from. Recorded after the first pass, so that the copies have had
// the chain and that pass to land. Writes the layer's row of the slot table S into S2, with each
// announced expert that misses and whose tag in TAGS reads its value (the copy landed) pointing
// to its staging slot (`where` 0, its words from the announcement); one whose copy has not
// landed keeps its entry (host memory: the same bytes). The announcement is read from the up
// mailbox UPM at pf_at as the partition reads it (the call's number, the layer's first table
// entry, the count, then per expert: id, gate, up and down words in the pool, the tag's word and
// value). TAGS[stat_at] and [stat_at + 1] count the announced misses found landed and not.
struct Params {
    slots_at: u32,
    pf_at: u32,
    seq: u32,
    row: u32,
    stat_at: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> S: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> UPM: array<atomic<u32>>;
@group(0) @binding(2) var<storage, read_write> TAGS: array<atomic<u32>>;
@group(0) @binding(3) var<storage, read_write> S2: array<vec4<u32>>;
@group(0) @binding(4) var<uniform> P: Params;

const WG: u32 = 64u;
const PF_MAX: u32 = {{PF_MAX}}u;
const NONE: u32 = 0xffffffffu;
var<workgroup> pf_n: u32;
var<workgroup> pf_e: array<u32, PF_MAX>;
// Each announced expert's entry for S2 (`where` NONE: keep the table's).
var<workgroup> pf_entry: array<vec4<u32>, PF_MAX>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    if (lid == 0u) {
        var n = 0u;
        if (atomicLoad(&UPM[P.pf_at]) == P.seq && atomicLoad(&UPM[P.pf_at + 1u]) == P.slots_at) {
            n = min(atomicLoad(&UPM[P.pf_at + 2u]), PF_MAX);
        }
        for (var j = 0u; j < n; j++) {
            let b = P.pf_at + 3u + 6u * j;
            let e = atomicLoad(&UPM[b]);
            pf_e[j] = e;
            pf_entry[j] = vec4<u32>(NONE, 0u, 0u, 0u);
            if (S[P.slots_at + e].x == 1u) {
                if (atomicLoad(&TAGS[atomicLoad(&UPM[b + 4u])]) == atomicLoad(&UPM[b + 5u])) {
                    pf_entry[j] = vec4<u32>(0u, atomicLoad(&UPM[b + 1u]), atomicLoad(&UPM[b + 2u]), atomicLoad(&UPM[b + 3u]));
                    atomicAdd(&TAGS[P.stat_at], 1u);
                } else {
                    atomicAdd(&TAGS[P.stat_at + 1u], 1u);
                }
            }
        }
        pf_n = n;
    }
    workgroupBarrier();
    for (var i = lid; i < P.row; i += WG) {
        var ent = S[P.slots_at + i];
        for (var j = 0u; j < pf_n; j++) {
            if (pf_e[j] == i && pf_entry[j].x == 0u) {
                ent = pf_entry[j];
            }
        }
        S2[i] = ent;
    }
}
