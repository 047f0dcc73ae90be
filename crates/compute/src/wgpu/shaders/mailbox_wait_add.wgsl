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
// The add-norm variant (lines starting `//N `, `split::wait_add_source(true)`; one workgroup):
// the residual R added too, the sum written to SUM, and its RMS norm (weight NW) to H with the
// int8 blocks the next products read (QS/DS, when q8 is set): the next layer's residual add and
// attention norm, two dependent dispatches less on the chain from the CPU's sum to its ids.
struct Params {
    flag_at: u32,
    data_at: u32,
    n: u32,
    seq: u32,
    spin_limit: u32,
    timeout_at: u32,
    waited_at: u32,
    // The add-norm variant's epsilon and whether it writes int8 blocks.
    eps: f32,
    q8: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<storage, read_write> U: array<atomic<u32>>;
@group(0) @binding(1) var<storage, read> Y: array<f32>;
@group(0) @binding(2) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(3) var<storage, read_write> D: array<atomic<u32>>;
//N @group(0) @binding(4) var<storage, read> R: array<f32>;
//N @group(0) @binding(5) var<storage, read_write> SUM: array<f32>;
//N @group(0) @binding(6) var<storage, read_write> H: array<f32>;
//N @group(0) @binding(7) var<storage, read> NW: array<f32>;
//N @group(0) @binding(8) var<storage, read_write> QS: array<u32>;
//N @group(0) @binding(9) var<storage, read_write> DS: array<vec2<f32>>;
@group(0) @binding({{P_BINDING}}) var<uniform> P: Params;

const WG: u32 = 256u;
//N // The sums of squares reduced by a tree (each invocation writes its slot before the first
//N // barrier; the tree reads slots written before the barrier it follows).
//N var<workgroup> red: array<f32, WG>;
//N
//N {{Q8_BLOCK}}

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
    var ss = 0.0;
    for (var i = wid.x * WG + lid; i < P.n; i += nwg.x * WG) {
        let y = Y[i] + bitcast<f32>(atomicLoad(&U[P.data_at + i]));
        OUT[i] = y;
//N     let x = R[i] + y;
//N     SUM[i] = x;
//N     ss += x * x;
    }
//N red[lid] = ss;
//N workgroupBarrier();
//N for (var half = WG / 2u; half > 0u; half = half / 2u) {
//N     if (lid < half) {
//N         red[lid] += red[lid + half];
//N     }
//N     workgroupBarrier();
//N }
//N let inv = inverseSqrt(red[0] / f32(P.n) + P.eps);
//N // Each invocation normalizes the values it summed (its own writes to SUM).
//N for (var i = lid; i < P.n; i += WG) {
//N     H[i] = SUM[i] * inv * NW[i];
//N }
//N if (P.q8 == 1u) {
//N     // Blocks of values other invocations wrote.
//N     storageBarrier();
//N     workgroupBarrier();
//N     for (var b = lid; b < P.n / 32u; b += WG) {
//N         var v: array<vec4<f32>, 8>;
//N         for (var e = 0u; e < 8u; e++) {
//N             let at = b * 32u + 4u * e;
//N             v[e] = vec4<f32>(H[at], H[at + 1u], H[at + 2u], H[at + 3u]);
//N         }
//N         q8_block(v, b);
//N     }
//N }
}
