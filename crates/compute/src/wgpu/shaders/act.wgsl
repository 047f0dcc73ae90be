// Activations shared by unary.wgsl, glu.wgsl and the kernels that apply a GLU on the way out
// (codes: 1 silu, 2 gelu erf, 3 gelu tanh, 4 relu; GLU code 5: gpt-oss SwiGLU).

// erf by Abramowitz-Stegun 7.1.26 is too coarse (1.5e-7 absolute); this is the single precision
// rational approximation of Numerical Recipes' erfc (fractional error below 1.2e-7).
fn erf_approx(x: f32) -> f32 {
    let z = abs(x);
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t * exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
        t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
        t * (-0.82215223 + t * 0.17087277)))))))));
    return select(r - 1.0, 1.0 - r, x >= 0.0);
}

fn act(x: f32, op: u32) -> f32 {
    switch op {
        case 1u: {
            return x / (1.0 + exp(-x));
        }
        case 2u: {
            return 0.5 * x * (1.0 + erf_approx(x * 0.70710678118654752));
        }
        case 3u: {
            let c = 0.79788456080286536;
            // tanh of a large argument overflows exp inside some drivers' tanh; |u| > 15 is ±1 in f32 anyway.
            return 0.5 * x * (1.0 + tanh(clamp(c * (x + 0.044715 * x * x * x), -15.0, 15.0)));
        }
        default: {
            return max(x, 0.0);
        }
    }
}

// glu(gate, up) for GLU code op: 1..4 act(gate) * up; 5 gpt-oss SwiGLU, gate clamped to
// (-inf, limit], up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate).
fn glu_act(gv: f32, uv: f32, op: u32, alpha: f32, limit: f32) -> f32 {
    if (op == 5u) {
        let gc = min(gv, limit);
        let uc = clamp(uv, -limit, limit);
        return (uc + 1.0) * (gc / (1.0 + exp(-gc * alpha)));
    }
    return act(gv, op) * uv;
}
