// The split's hand-off to the host through a mailbox (wgpu/mailbox.rs, experts/split.rs): one
// workgroup copies the routing (weights, then ids) and the hidden state into the host-visible
// mailbox D, then writes the call's sequence number into its flag, which the host polls.
// Every write into D is an atomic store and the flag comes after a storage barrier, so a host
// that sees the flag sees the data (checked on the H200 by `perf_mailbox`).
struct Params {
    route_words: u32,
    x_words: u32,
    data_at: u32,
    flag_at: u32,
    seq: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read> R: array<u32>;
@group(0) @binding(1) var<storage, read> X: array<u32>;
@group(0) @binding(2) var<storage, read_write> D: array<atomic<u32>>;
@group(0) @binding(3) var<uniform> P: Params;

const WG: u32 = 256u;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) lid: u32) {
    for (var i = lid; i < P.route_words; i += WG) {
        atomicStore(&D[P.data_at + i], R[i]);
    }
    let x_at = P.data_at + P.route_words;
    for (var i = lid; i < P.x_words; i += WG) {
        atomicStore(&D[x_at + i], X[i]);
    }
    storageBarrier();
    if (lid == 0u) {
        atomicStore(&D[P.flag_at], P.seq);
    }
}
