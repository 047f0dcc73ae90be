// The MoE down kernels' parameters (moe_down.wgsl, moe_down_q8.wgsl; moe.rs writes the words).
struct Params {
    n_ff: u32,
    n_embd: u32,
    rw_d: u32,
    n_tok: u32,
    k_top: u32,
    has_bias: u32,
    table_at: u32,
    weights_at: u32,
    stride_g: u32,
    stride_u: u32,
    stride_d: u32,
    slots_at: u32,
{{TABLE_FIELD}}
}
