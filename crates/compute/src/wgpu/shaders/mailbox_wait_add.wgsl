// The split's return from the host through a mailbox (wgpu/mailbox.rs, experts/split.rs): the
// GPU's share of a layer's experts `Y` plus the CPU's sum, which the host writes into the
// mailbox U and then flags with the call's sequence number. One invocation of each workgroup
// polls the flag (submitted before the CPU is done, the kernel waits in the queue's order, so
// the next layer needs no submit after the CPU's work); then the workgroup adds.
// U lies in the GPU's memory seen through the BAR: the GPU's L2 would keep a stale copy of
// system memory it has read once. Its words are read as atomics (not through the L1).
// The poll is bounded: past `spin_limit` polls the kernel records the sequence number in D's
// `timeout_at` word (the host reports it) and adds whatever is there. Workgroup 0 also records
// in D's `waited_at` word whether it had to poll more than once, which tells the host which
// side was the longer (the split's share follows it).
struct Params {
    flag_at: u32,
    data_at: u32,
    n: u32,
    seq: u32,
    spin_limit: u32,
    timeout_at: u32,
    waited_at: u32,
    _p0: u32,
}

@group(0) @binding(0) var<storage, read_write> U: array<atomic<u32>>;
@group(0) @binding(1) var<storage, read> Y: array<f32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(3) var<storage, read_write> D: array<atomic<u32>>;
@group(0) @binding(4) var<uniform> P: Params;

const WG: u32 = 256u;

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    if (lid == 0u) {
        var polls = 0u;
        loop {
            polls += 1u;
            if (atomicLoad(&U[P.flag_at]) == P.seq) { break; }
            if (polls >= P.spin_limit) {
                atomicStore(&D[P.timeout_at], P.seq);
                break;
            }
        }
        if (wid.x == 0u) {
            atomicStore(&D[P.waited_at], select(0u, 1u, polls > 1u));
        }
    }
    // A storage barrier, not only workgroupBarrier (which orders workgroup memory alone):
    // without it the compiler may read U's data before the flag was seen.
    storageBarrier();
    for (var i = wid.x * WG + lid; i < P.n; i += nwg.x * WG) {
        OUT[i] = Y[i] + bitcast<f32>(atomicLoad(&U[P.data_at + i]));
    }
}
