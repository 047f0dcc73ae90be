// The norm kernels' parameters (norm.wgsl, norm_reg.wgsl, norm_split.wgsl take the same, so
// norm.rs records any of them with one function): mode 0 RMS norm, 1 layer norm; has_w / has_b
// a weight / bias; q8 = 1 the int8 blocks of the result too.
struct Params {
    width: u32,
    n_rows: u32,
    mode: u32,
    eps: f32,
    has_w: u32,
    has_b: u32,
    q8: u32,
    _p1: u32,
}
