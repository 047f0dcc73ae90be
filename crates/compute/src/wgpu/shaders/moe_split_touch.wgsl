// The split's look-ahead (experts/split.rs, `touch_next_layer`). While the GPU waits for the
// CPU's sum of layer L (in most layers its own share ends first), the link to host memory idles.
// This kernel reads the host-memory copies of the experts that layer L+1 is guessed to give the
// GPU, so that their lines sit in the GPU's L2 cache when L+1's per-pair kernels read them over
// PCIe: the guess is L+1's router applied to L's input, routed by the dispatch before this one
// into G (the weights, then the ids at `ids_at`). It only reads: nothing it touches changes a
// result, a wrong guess costs only link time that was idle.
//
// Which experts: those of the guess the slot table S says are in host memory (`where` 1). The
// partition kernel gives the CPU the misses with the smallest keys (fewest pairs, then the
// lowest id) and the GPU the rest; with one token every count is 1, so the GPU's come from the
// highest id down, and this kernel touches them in that order, all workgroups moving through
// the list together (the GPU's likely share first, should the flag cut it short).
//
// When it stops: at the end of the list, or as soon as the CPU's flag is up (U[flag_at] ==
// seq; checked before every round of reads), so the wait after it starts at most one round of
// reads late. One load per 32-byte sector (the unit the L2 fills), STRIDE words apart. OUT
// receives the words loaded (OUT[0]) and their XOR (OUT[1]), which keeps the loads from being
// optimized away and lets a test check which words were read.
struct Params {
    flag_at: u32,
    seq: u32,
    ids_at: u32,
    k: u32,
    slots_at: u32,
    gate_words: u32,
    up_words: u32,
    down_words: u32,
}

@group(0) @binding(0) var<storage, read_write> U: array<atomic<u32>>;
@group(0) @binding(1) var<storage, read> G: array<u32>;
@group(0) @binding(2) var<storage, read> S: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> WH: array<u32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<atomic<u32>>;
@group(0) @binding(5) var<uniform> P: Params;

const WG: u32 = 256u;
const STRIDE: u32 = 8u;
// The most experts per token of the models supported (the routing kernel's limit is lower).
const MAX_K: u32 = 32u;

// Whether the flag is up, as workgroup invocation 0 read it this round.
var<workgroup> flag_up: u32;
// The words to read, as invocation 0 counted them (every invocation counts the same; shared so
// that the loop with its barriers is uniform by construction).
var<workgroup> total_words: u32;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    // The guessed experts in host memory, highest id first (the ids of one token are distinct).
    var list: array<u32, MAX_K>;
    var n = 0u;
    for (var j = 0u; j < min(P.k, MAX_K); j++) {
        let e = G[P.ids_at + j];
        if (S[P.slots_at + e].x == 1u) {
            var i = n;
            while (i > 0u && list[i - 1u] < e) {
                list[i] = list[i - 1u];
                i--;
            }
            list[i] = e;
            n++;
        }
    }
    let per = P.gate_words + P.up_words + P.down_words;
    if (lid == 0u) {
        total_words = n * per;
    }
    let total = workgroupUniformLoad(&total_words);
    let round_words = nwg.x * WG * STRIDE;
    var acc = 0u;
    var loaded = 0u;
    for (var base = 0u; base < total; base += round_words) {
        if (lid == 0u) {
            flag_up = u32(atomicLoad(&U[P.flag_at]) == P.seq);
        }
        if (workgroupUniformLoad(&flag_up) != 0u) {
            break;
        }
        let v = base + (wid.x * WG + lid) * STRIDE;
        if (v < total) {
            let s = S[P.slots_at + list[v / per]];
            let o = v % per;
            var at = s.w + o - P.gate_words - P.up_words;
            if (o < P.gate_words) {
                at = s.y + o;
            } else if (o < P.gate_words + P.up_words) {
                at = s.z + o - P.gate_words;
            }
            acc ^= WH[at];
            loaded++;
        }
        // Invocation 0 writes the flag again only after every invocation has read it.
        workgroupBarrier();
    }
    if (loaded > 0u) {
        atomicAdd(&OUT[0], loaded);
        atomicXor(&OUT[1], acc);
    }
}
