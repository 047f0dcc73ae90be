// The MoE gate/up kernels' parameters (moe_gate_up.wgsl, moe_gate_up_q8.wgsl; moe.rs writes the words).
struct Params {
    n_embd: u32,
    n_ff: u32,
    rw_g: u32,
    rw_u: u32,
    n_pairs: u32,
    k_top: u32,
    op: u32,
    has_gate_bias: u32,
    alpha: f32,
    limit: f32,
    has_up_bias: u32,
    table_at: u32,
    stride_g: u32,
    stride_u: u32,
    stride_d: u32,
    slots_at: u32,
{{TABLE_FIELD}}
}
