// Workgroup sum with subgroup operations: one subgroupAdd per subgroup, then the partial sums of
// the subgroups through shared memory. Every invocation gets the sum.
fn reduce_sum(v: f32, lid: u32, sg_id: u32, sg_lane: u32, n_sg: u32) -> f32 {
    let s = subgroupAdd(v);
    if (sg_lane == 0u) {
        red[sg_id] = s;
    }
    workgroupBarrier();
    var r = 0.0;
    for (var i = 0u; i < n_sg; i++) {
        r += red[i];
    }
    workgroupBarrier();
    return r;
}
