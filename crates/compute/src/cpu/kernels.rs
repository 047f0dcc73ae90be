//! The arithmetic of each op on plain slices: the reference implementation.
//!
//! Written for clarity first; the formulas follow transformers (the fixtures' f32 reference),
//! and the comments name the place where a model family differs.

use crate::spec::{Act, AttnSpec, Gating, Glu, RopeSpec, RouteSpec};

/// One activation value.
pub fn act(x: f32, act: Act) -> f32 {
    match act {
        Act::Silu => x / (1.0 + (-x).exp()),
        Act::Gelu => 0.5 * x * (1.0 + libm::erff(x / std::f32::consts::SQRT_2)),
        Act::GeluTanh => {
            let c = (2.0f32 / std::f32::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }
        Act::Relu => x.max(0.0),
    }
}

/// One gated value from a gate and an up value.
pub fn glu(g: f32, u: f32, glu: Glu) -> f32 {
    match glu {
        Glu::Plain(a) => act(g, a) * u,
        Glu::SwiGluOai { alpha, limit } => {
            // transformers GptOssExperts: gate.clamp(max=limit), up.clamp(-limit, limit),
            // glu = gate * sigmoid(gate * alpha), out = (up + 1) * glu.
            let g = g.min(limit);
            let u = u.clamp(-limit, limit);
            let s = g / (1.0 + (-g * alpha).exp());
            (u + 1.0) * s
        }
    }
}

/// RMS norm of one row in place: x / sqrt(mean(x²) + eps) * w.
pub fn rms_norm(row: &mut [f32], weight: Option<&[f32]>, eps: f32) {
    let ss: f64 = row.iter().map(|&x| (x as f64) * (x as f64)).sum();
    let inv = 1.0 / ((ss / row.len() as f64) as f32 + eps).sqrt();
    match weight {
        Some(w) => row.iter_mut().zip(w).for_each(|(x, &w)| *x = *x * inv * w),
        None => row.iter_mut().for_each(|x| *x *= inv),
    }
}

/// Layer norm of one row in place.
pub fn layer_norm(row: &mut [f32], weight: Option<&[f32]>, bias: Option<&[f32]>, eps: f32) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = row.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for (i, x) in row.iter_mut().enumerate() {
        let mut y = ((*x as f64 - mean) * inv) as f32;
        if let Some(w) = weight {
            y *= w[i];
        }
        if let Some(b) = bias {
            y += b[i];
        }
        *x = y;
    }
}

/// Inverse frequencies and the cos/sin multiplier of a rope variant.
pub struct RopeTable {
    inv_freq: Vec<f64>,
    mscale: f64,
    position_scale: f64,
}

impl RopeTable {
    /// Precomputes the frequencies of `spec` (YaRN as transformers' `_compute_yarn_parameters`).
    pub fn new(spec: &RopeSpec) -> RopeTable {
        let dim = spec.n_rot;
        let half = dim / 2;
        let base = spec.base as f64;
        let mut inv_freq: Vec<f64> = (0..half).map(|i| 1.0 / base.powf((2 * i) as f64 / dim as f64)).collect();
        let mut mscale = 1.0;
        if let Some(y) = &spec.yarn {
            let factor = y.factor as f64;
            let corr_dim = |rot: f64| {
                (dim as f64 * (y.original_context as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
            };
            let (mut low, mut high) = (corr_dim(y.beta_fast as f64), corr_dim(y.beta_slow as f64));
            if y.truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let mut high = high.min(dim as f64 - 1.0);
            if low == high {
                high += 0.001;
            }
            for (i, f) in inv_freq.iter_mut().enumerate() {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                let interp = *f / factor;
                *f = interp * (1.0 - extrapolation) + *f * extrapolation;
            }
            mscale = y.attn_factor as f64;
        }
        if let Some(ff) = &spec.freq_factors {
            for (f, &d) in inv_freq.iter_mut().zip(ff) {
                *f /= d as f64;
            }
        }
        RopeTable { inv_freq, mscale, position_scale: spec.position_scale as f64 }
    }

    /// cos and sin of every frequency at a position.
    pub fn cos_sin(&self, pos: u32) -> (Vec<f32>, Vec<f32>) {
        let mut cos = vec![0f32; self.n_freq()];
        let mut sin = vec![0f32; self.n_freq()];
        self.cos_sin_into(pos, &mut cos, &mut sin);
        (cos, sin)
    }

    /// Number of frequencies (`n_rot / 2`).
    pub fn n_freq(&self) -> usize {
        self.inv_freq.len()
    }

    /// [`RopeTable::cos_sin`] written into `cos` and `sin` (`n_freq` values each).
    pub fn cos_sin_into(&self, pos: u32, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f64 * self.position_scale;
        for ((&f, c), s) in self.inv_freq.iter().zip(cos).zip(sin) {
            // transformers computes the angle in f32; doing the same keeps long positions
            // (where the rounding of p * f matters) on its side.
            let a = (p as f32 * f as f32) as f64;
            *c = (a.cos() * self.mscale) as f32;
            *s = (a.sin() * self.mscale) as f32;
        }
    }
}

/// Rotates the first `n_rot` dims of one head.
pub fn rope_head(head: &mut [f32], cos: &[f32], sin: &[f32], n_rot: usize, neox: bool) {
    let half = n_rot / 2;
    for i in 0..half {
        let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * cos[i] - x1 * sin[i];
        head[b] = x0 * sin[i] + x1 * cos[i];
    }
}

/// Cached keys and values as flat rows.
#[derive(Clone, Copy)]
pub struct CacheView<'a> {
    /// Keys, `k_width` per position.
    pub k: &'a [f32],
    /// Values, `v_width` per position.
    pub v: &'a [f32],
    /// Key row width.
    pub k_width: usize,
    /// Value row width.
    pub v_width: usize,
}

/// Attention of one query head at position `pos` over the cache, into `out` (`head_dim_v`).
pub fn attend_one(
    q: &[f32],
    cache: CacheView<'_>,
    head: usize,
    pos: usize,
    spec: &AttnSpec,
    sink: Option<f32>,
    out: &mut [f32],
) {
    let kv_head = head / (spec.n_head / spec.n_head_kv);
    let lo = match spec.window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    };
    let mut scores = Vec::with_capacity(pos + 1 - lo);
    for j in lo..=pos {
        let kj = &cache.k[j * cache.k_width + kv_head * spec.head_dim_k..][..spec.head_dim_k];
        let mut s = q.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>() * spec.scale;
        if let Some(cap) = spec.softcap {
            s = cap * (s / cap).tanh();
        }
        scores.push(s);
    }
    let mut max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if let Some(s) = sink {
        max = max.max(s);
    }
    let mut denom = sink.map_or(0.0, |s| (s - max).exp());
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        denom += *s;
    }
    out.iter_mut().for_each(|o| *o = 0.0);
    for (idx, j) in (lo..=pos).enumerate() {
        let p = scores[idx] / denom;
        let vj = &cache.v[j * cache.v_width + kv_head * spec.head_dim_v..][..spec.head_dim_v];
        out.iter_mut().zip(vj).for_each(|(o, &v)| *o += p * v);
    }
}

/// Routes one token: writes `k` expert ids (best first; lowest id on ties) and their weights.
pub fn route_token(logits: &[f32], bias: Option<&[f32]>, spec: &RouteSpec, ids: &mut [u32], weights: &mut [f32]) {
    let n = logits.len();
    let probs: Vec<f32> = match spec.gating {
        Gating::Softmax => {
            let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|&l| (l - m).exp()).collect();
            let s: f32 = e.iter().sum();
            e.iter().map(|x| x / s).collect()
        }
        Gating::SoftmaxAfterTopK => logits.to_vec(),
        Gating::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    let mut select: Vec<f32> = match bias {
        Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
        None => probs.clone(),
    };
    if let Some((n_group, topk_group)) = spec.groups {
        // DeepSeek-V3: a group's score is the sum of its two best selection scores; experts
        // outside the best `topk_group` groups cannot be chosen.
        let per = n / n_group;
        let mut group_scores: Vec<(usize, f32)> = (0..n_group)
            .map(|g| {
                let mut s: Vec<f32> = select[g * per..(g + 1) * per].to_vec();
                s.sort_by(|a, b| b.total_cmp(a));
                (g, s.iter().take(2).sum())
            })
            .collect();
        group_scores.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for &(g, _) in &group_scores[topk_group.min(n_group)..] {
            select[g * per..(g + 1) * per].iter_mut().for_each(|s| *s = f32::NEG_INFINITY);
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| select[b].total_cmp(&select[a]).then(a.cmp(&b)));
    for (j, &e) in order[..spec.k].iter().enumerate() {
        ids[j] = e as u32;
        weights[j] = probs[e];
    }
    if spec.gating == Gating::SoftmaxAfterTopK {
        let m = weights.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        weights.iter_mut().for_each(|w| *w = (*w - m).exp());
        let s: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= s);
    }
    if spec.normalize {
        let s: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= s);
    }
    weights.iter_mut().for_each(|w| *w *= spec.scale);
}

/// softplus(x) = ln(1 + eˣ), returning x itself above 20 as PyTorch's `F.softplus` does
/// (threshold 20), which the Mamba-2 time step goes through.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Depthwise causal convolution of a window: `xx` holds `k - 1 + n` rows of `channels`
/// values (the carried state, then the new rows), `weight` is `[channels, k]`; writes `n` rows
/// into `out`: `out[t][c] = Σ_j weight[c][j] · xx[t + j][c]`.
pub fn ssm_conv(xx: &[f32], weight: &[f32], k: usize, out: &mut [f32]) {
    let channels = weight.len() / k;
    for (t, row) in out.chunks_mut(channels).enumerate() {
        for (c, o) in row.iter_mut().enumerate() {
            *o = (0..k).map(|j| weight[c * k + j] * xx[(t + j) * channels + c]).sum();
        }
    }
}

/// The inputs of a selective scan over `n` tokens, row-major: `x` `[n, n_head * head_dim]`,
/// raw `dt` `[n, n_head]`, `b` and `c` `[n, n_group * d_state]`.
#[derive(Clone, Copy)]
pub struct ScanSeq<'a> {
    /// Inputs.
    pub x: &'a [f32],
    /// Raw time steps (before bias and softplus).
    pub dt: &'a [f32],
    /// Input projections B.
    pub b: &'a [f32],
    /// Output projections C.
    pub c: &'a [f32],
}

/// Per-layer constants of the selective scan.
#[derive(Clone, Copy)]
pub struct ScanParams<'a> {
    /// Decay rates `[n_head]` (negative).
    pub a: &'a [f32],
    /// Skip weights `[n_head]`.
    pub d: Option<&'a [f32]>,
    /// Time-step bias `[n_head]`.
    pub dt_bias: Option<&'a [f32]>,
    /// Groups sharing B and C.
    pub n_group: usize,
    /// Values per head.
    pub head_dim: usize,
    /// State size per value.
    pub d_state: usize,
}

/// Runs head `h` of the selective scan over every token of `seq`: advances the head's state
/// (`[head_dim, d_state]`) token by token and writes its outputs into `y` (`[n, head_dim]`).
/// The per-token update is transformers' `mamba2_selective_state_update` (the recurrent form;
/// its chunked prefill form computes the same sums in another order). Heads are independent,
/// so a caller may run them in parallel.
pub fn ssm_scan_head(state: &mut [f32], h: usize, seq: ScanSeq<'_>, p: &ScanParams<'_>, y: &mut [f32]) {
    let n_head = p.a.len();
    let g = h / (n_head / p.n_group);
    let (hd, ds) = (p.head_dim, p.d_state);
    let bc_width = p.n_group * ds;
    let skip = p.d.map_or(0.0, |d| d[h]);
    for (t, yt) in y.chunks_mut(hd).enumerate() {
        let dt = softplus(seq.dt[t * n_head + h] + p.dt_bias.map_or(0.0, |b| b[h]));
        let decay = (dt * p.a[h]).exp();
        let b = &seq.b[t * bc_width + g * ds..][..ds];
        let c = &seq.c[t * bc_width + g * ds..][..ds];
        let x = &seq.x[(t * n_head + h) * hd..][..hd];
        for (i, (yi, &xi)) in yt.iter_mut().zip(x).enumerate() {
            let s = &mut state[i * ds..(i + 1) * ds];
            let mut acc = 0f32;
            for j in 0..ds {
                s[j] = s[j] * decay + dt * b[j] * xi;
                acc += s[j] * c[j];
            }
            *yi = acc + skip * xi;
        }
    }
}

/// Columns `start..start + len` of every row of a row-major matrix `width` wide, packed into
/// rows of `len` (one head's block of a multi-head activation).
pub fn gather_cols(x: &[f32], width: usize, start: usize, len: usize) -> Vec<f32> {
    x.chunks(width).flat_map(|row| row[start..start + len].iter().copied()).collect()
}

/// Writes rows of `len` values (`src`) into columns `start..start + len` of `out`, a row-major
/// matrix `width` wide: the inverse of [`gather_cols`].
pub fn scatter_cols(src: &[f32], out: &mut [f32], width: usize, start: usize, len: usize) {
    for (row, part) in out.chunks_mut(width).zip(src.chunks(len)) {
        row[start..start + len].copy_from_slice(part);
    }
}

#[cfg(test)]
mod recurrent_tests {
    use super::*;

    /// A deterministic pseudo-random sequence in [-1, 1).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn softplus_matches_torch_values() {
        // torch.nn.functional.softplus(torch.tensor([-3., 0., 1.5, 25.])) in float32.
        let expected = [0.048587352f32, std::f32::consts::LN_2, 1.7014133, 25.0];
        for (x, e) in [-3.0f32, 0.0, 1.5, 25.0].iter().zip(expected) {
            assert!((softplus(*x) - e).abs() < 1e-6, "softplus({x}) = {} != {e}", softplus(*x));
        }
    }

    #[test]
    fn ssm_conv_matches_zero_padded_convolution_split_in_two_calls() {
        // Reference: PyTorch's Conv1d(groups=channels, padding=k-1)[..., :n] over the whole
        // sequence, written as a direct sum over zero-padded inputs.
        let (channels, k, n) = (3, 4, 7);
        let x = values(n * channels, 1);
        let w = values(channels * k, 2);
        let mut expected = vec![0f32; n * channels];
        for t in 0..n {
            for c in 0..channels {
                for j in 0..k {
                    // Tap j reads input position t + j - (k - 1).
                    if let Some(src) = (t + j).checked_sub(k - 1) {
                        expected[t * channels + c] += w[c * k + j] * x[src * channels + c];
                    }
                }
            }
        }
        // Two calls (3 tokens, then 4) carrying the window, as decoding does.
        let mut state = vec![0f32; (k - 1) * channels];
        let mut got = Vec::new();
        for (start, len) in [(0, 3), (3, 4)] {
            let mut xx = state.clone();
            xx.extend_from_slice(&x[start * channels..(start + len) * channels]);
            let mut out = vec![0f32; len * channels];
            ssm_conv(&xx, &w, k, &mut out);
            state = xx[len * channels..].to_vec();
            got.extend(out);
        }
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() < 1e-6, "{g} != {e}");
        }
    }

    #[test]
    fn ssm_scan_matches_the_quadratic_attention_form() {
        // Reference: the state-space-duality form of Mamba-2 (transformers' chunked scan within
        // one chunk): y_t = Σ_{s≤t} (C_t·B_s) · exp(A Σ_{r=s+1..t} dt_r) · dt_s · x_s + D x_t,
        // computed without any state.
        let (n_head, n_group, hd, ds, n) = (4, 2, 3, 5, 6);
        let a: Vec<f32> = values(n_head, 3).iter().map(|v| -(v.abs() + 0.1)).collect();
        let d = values(n_head, 4);
        let dt_bias = values(n_head, 5);
        let x = values(n * n_head * hd, 6);
        let dt = values(n * n_head, 7);
        let b = values(n * n_group * ds, 8);
        let c = values(n * n_group * ds, 9);
        let sp = |t: usize, h: usize| softplus(dt[t * n_head + h] + dt_bias[h]);
        let mut expected = vec![0f32; n * n_head * hd];
        for t in 0..n {
            for h in 0..n_head {
                let g = h / (n_head / n_group);
                for i in 0..hd {
                    let mut y = d[h] * x[(t * n_head + h) * hd + i];
                    for s in 0..=t {
                        let cb: f32 =
                            (0..ds).map(|j| c[(t * n_group + g) * ds + j] * b[(s * n_group + g) * ds + j]).sum();
                        let decay = (a[h] * ((s + 1)..=t).map(|r| sp(r, h)).sum::<f32>()).exp();
                        y += cb * decay * sp(s, h) * x[(s * n_head + h) * hd + i];
                    }
                    expected[(t * n_head + h) * hd + i] = y;
                }
            }
        }
        let p = ScanParams { a: &a, d: Some(&d), dt_bias: Some(&dt_bias), n_group, head_dim: hd, d_state: ds };
        // Two calls (2 tokens, then 4) carrying the state, as prefill then decoding does.
        let mut state = vec![0f32; n_head * hd * ds];
        for (start, len) in [(0, 2), (2, 4)] {
            let seq = ScanSeq {
                x: &x[start * n_head * hd..(start + len) * n_head * hd],
                dt: &dt[start * n_head..(start + len) * n_head],
                b: &b[start * n_group * ds..(start + len) * n_group * ds],
                c: &c[start * n_group * ds..(start + len) * n_group * ds],
            };
            for h in 0..n_head {
                let mut y = vec![0f32; len * hd];
                ssm_scan_head(&mut state[h * hd * ds..(h + 1) * hd * ds], h, seq, &p, &mut y);
                for (k, (g, e)) in y.chunks(hd).zip(expected[start * n_head * hd..].chunks(n_head * hd)).enumerate() {
                    for (i, (g, e)) in g.iter().zip(&e[h * hd..(h + 1) * hd]).enumerate() {
                        assert!((g - e).abs() < 1e-5, "token {} head {h} value {i}: {g} != {e}", start + k);
                    }
                }
            }
        }
    }
}
