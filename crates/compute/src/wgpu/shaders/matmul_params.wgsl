// The parameters of the matrix products (matmul.wgsl, matvec.wgsl), in the order
// `WgpuBackend::matmul_general` and `matvec_into` write them: rows w_row0.. of a weight chunk of
// row_words words per row, against columns x_col0..x_col0 + k of x, into columns out_col0.. of y;
// with accumulate != 0 the products are added to y instead of replacing it (the residual add of
// the attention output and FFN down projections, without a dispatch of its own).
struct Params {
    k: u32,
    n_rows: u32,
    n_tok: u32,
    row_words: u32,
    w_row0: u32,
    out_stride: u32,
    out_col0: u32,
    x_stride: u32,
    x_col0: u32,
    accumulate: u32,
    _p1: u32,
    _p2: u32,
}

// Writes one output value (Y is declared by the kernel that includes these parameters). The branch
// is uniform over the dispatch.
fn store_y(i: u32, v: f32) {
    if (P.accumulate != 0u) {
        Y[i] += v;
    } else {
        Y[i] = v;
    }
}
