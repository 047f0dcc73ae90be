//! Vectorised quantized-activation dot products, picked at run time.
//!
//! One binary runs everywhere: on x86-64 the AVX2 kernels are used when the CPU reports AVX2,
//! FMA and F16C (`is_x86_feature_detected!`), on aarch64 the NEON kernels (NEON is baseline
//! there), otherwise the portable integer loops of `qdot`. Every kernel computes the same
//! integer block sums as the portable one; only the order in which per-block floats are added
//! differs, so results agree to float rounding.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "aarch64")]
mod neon;

use gguf::GgmlType;

use super::qdot::{dot_portable, ActRow};

/// An implementation of the quantized-activation dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust integer loops; available everywhere.
    Portable,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// aarch64 NEON (with the dot-product extension when present).
    Neon,
}

impl Kernel {
    /// The fastest kernel this CPU supports.
    pub fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if avx2::detected() {
            return Kernel::Avx2;
        }
        #[cfg(target_arch = "aarch64")]
        return Kernel::Neon;
        #[allow(unreachable_code)]
        Kernel::Portable
    }

    /// Every kernel this CPU can run, portable first.
    pub fn available() -> Vec<Kernel> {
        let mut out = vec![Kernel::Portable];
        if Kernel::best() != Kernel::Portable {
            out.push(Kernel::best());
        }
        out
    }

    /// True when this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        Kernel::available().contains(&self)
    }
}

/// A vectorised kernel: `w` is whole blocks of the weight type, `x` the matching activations.
type SimdDot = unsafe fn(&[u8], ActRow<'_>) -> f32;

/// The dot product of one weight type, resolved once per matmul.
#[derive(Clone, Copy)]
pub(crate) struct QDot {
    dtype: GgmlType,
    /// Set only when the CPU supports the kernel's instructions (checked in `new`).
    simd: Option<SimdDot>,
}

impl QDot {
    /// The dot product of `dtype` with `kernel`; falls back to portable where the kernel has no
    /// version for the type or the CPU lacks its instructions.
    pub(crate) fn new(dtype: GgmlType, kernel: Kernel) -> QDot {
        let simd = if kernel.is_available() { simd_kernel(dtype, kernel) } else { None };
        QDot { dtype, simd }
    }

    #[inline]
    pub(crate) fn dot(&self, w: &[u8], x: ActRow<'_>) -> f32 {
        match self.simd {
            // SAFETY: `simd` is only set when `Kernel::is_available` confirmed the CPU has the
            // kernel's instructions; the kernels check their slice lengths themselves.
            Some(f) => unsafe { f(w, x) },
            None => dot_portable(self.dtype, w, x),
        }
    }
}

#[allow(unused_variables)]
fn simd_kernel(dtype: GgmlType, kernel: Kernel) -> Option<SimdDot> {
    match kernel {
        Kernel::Portable => None,
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => avx2::kernel(dtype),
        #[cfg(target_arch = "aarch64")]
        Kernel::Neon => neon::kernel(dtype),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}
