// The split's prefetch (experts/prefetch.rs), recorded after a decode layer's GPU share: of the
// next layer's experts guessed by its router on this layer's input (routed into G by the dispatch
// before this one: weights, then ids from `ids_at`, best first), the first `max_n` that the slot
// table S says are in host memory (`where` 1) go into the down mailbox D at `at`: the count at
// at + 1 and the ids from at + 2, then the call's sequence number at `at`, after a storage
// barrier, as the hand-over's flag is written after its data. The dispatcher reads them once the
// CPU's job of this layer is done and asks the copy queue for those experts.
struct Params {
    ids_at: u32,
    k: u32,
    slots_at: u32,
    at: u32,
    seq: u32,
    max_n: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<storage, read> G: array<u32>;
@group(0) @binding(1) var<storage, read> S: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> D: array<atomic<u32>>;
@group(0) @binding(3) var<uniform> P: Params;

@compute @workgroup_size(1)
fn main() {
    var n = 0u;
    for (var j = 0u; j < P.k && n < P.max_n; j++) {
        let e = G[P.ids_at + j];
        if (S[P.slots_at + e].x == 1u) {
            atomicStore(&D[P.at + 2u + n], e);
            n++;
        }
    }
    atomicStore(&D[P.at + 1u], n);
    storageBarrier();
    atomicStore(&D[P.at], P.seq);
}
