//! Vectorised quantized-activation dot products, picked at run time.
//!
//! One binary runs everywhere: on x86-64 the AVX-512 kernels when the CPU reports AVX-512
//! F/BW/VL/VNNI besides AVX2 (they cover decode and prefill tiles of Q4_0, Q4_1, Q8_0, Q4_K and
//! Q6_K, prefill of Q5_0, and use the AVX2 kernels for everything else), the AVX2 kernels when it reports AVX2, FMA and F16C
//! (`is_x86_feature_detected!`); `DISKFORMER_CPU_KERNEL=portable|avx2|avx512` picks a lower
//! one for comparisons. On aarch64 the NEON kernels (NEON is baseline
//! there), otherwise the portable integer loops of `qdot`. Every kernel computes the same
//! integer block sums as the portable one; only the order in which per-block floats are added
//! differs, so results agree to float rounding.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_ktiles;
#[cfg(target_arch = "x86_64")]
mod avx2_lanes;
#[cfg(target_arch = "x86_64")]
mod avx2_tiles;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_lanes;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "aarch64")]
mod neon_tiles;

use gguf::GgmlType;

use super::qdot::{dot_portable, ActRow, TokenOctet};

/// An implementation of the quantized-activation dot products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust integer loops; available everywhere.
    Portable,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// aarch64 NEON (with the dot-product extension when present).
    Neon,
    /// x86-64 AVX-512 F/BW/VL/VNNI (plus everything `Avx2` needs): its own decode kernels for
    /// Q4_0, Q4_1, Q8_0, Q4_K and Q6_K and prefill tiles for those and Q5_0, the AVX2 ones
    /// otherwise, with the same bits.
    Avx512,
}

impl Kernel {
    /// The fastest kernel this CPU supports, or the one `DISKFORMER_CPU_KERNEL` names
    /// (`portable`, `avx2`, `avx512`, `neon`) when the CPU can run it. Decided once per process.
    pub fn best() -> Kernel {
        static BEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let fastest = Kernel::fastest();
            let Ok(name) = std::env::var("DISKFORMER_CPU_KERNEL") else { return fastest };
            match Kernel::from_name(name.trim()) {
                Some(kernel) if kernel.is_available() => kernel,
                _ => {
                    eprintln!("DISKFORMER_CPU_KERNEL={name}: not a kernel this CPU runs; using {fastest:?}");
                    fastest
                }
            }
        })
    }

    fn fastest() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if avx512::detected() {
            return Kernel::Avx512;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2::detected() {
            return Kernel::Avx2;
        }
        #[cfg(target_arch = "aarch64")]
        return Kernel::Neon;
        #[allow(unreachable_code)]
        Kernel::Portable
    }

    fn from_name(name: &str) -> Option<Kernel> {
        Some(match name.to_ascii_lowercase().as_str() {
            "portable" => Kernel::Portable,
            "avx2" => Kernel::Avx2,
            "avx512" => Kernel::Avx512,
            "neon" => Kernel::Neon,
            _ => return None,
        })
    }

    /// Every kernel this CPU can run, portable first.
    pub fn available() -> Vec<Kernel> {
        [Kernel::Portable, Kernel::Avx2, Kernel::Avx512, Kernel::Neon]
            .into_iter()
            .filter(|k| k.is_available())
            .collect()
    }

    /// True when this CPU can run the kernel. Asked once per matmul, so it allocates nothing
    /// (unlike [`Kernel::available`]).
    pub fn is_available(self) -> bool {
        match self {
            Kernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::detected(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => avx512::detected(),
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// Quantizes a row of activations to Q8_0-style blocks with the AVX2 quantizer when the CPU has
/// it (same bits as `qdot`'s portable loop for finite values); false when it must be done by the
/// portable loop.
#[allow(unused_variables)]
pub(crate) fn quantize_row_q8_0(x: &[f32], d: &mut [f32], qs: &mut [i8], sums: &mut [i16]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if avx2::detected() {
        // SAFETY: AVX2, FMA and F16C were confirmed just above.
        unsafe { avx2_tiles::quantize_row_q8_0(x, d, qs, sums, super::float::round_f16) };
        return true;
    }
    false
}

/// As [`quantize_row_q8_0`] for Q8_K blocks (k-quant and IQ4_XS weights).
#[allow(unused_variables)]
pub(crate) fn quantize_row_q8_k(x: &[f32], d: &mut [f32], qs: &mut [i8], sums: &mut [i16]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if avx2::detected() {
        // SAFETY: AVX2, FMA and F16C were confirmed just above; Rust code runs with the
        // default MXCSR rounding mode.
        unsafe { avx2_tiles::quantize_row_q8_k(x, d, qs, sums) };
        return true;
    }
    false
}

/// A vectorised row dequantizer (same results as the portable one).
type SimdDequantize = unsafe fn(&[u8], &mut [f32]);

/// The row dequantizer of `dtype` for exact matmuls: the portable function, or its AVX2 build
/// when the CPU has AVX2 (bit-identical: the same f32 operations, vectorised).
#[derive(Clone, Copy)]
pub(crate) struct RowDequantizer {
    portable: fn(&[u8], &mut [f32]),
    /// Set only when the CPU supports AVX2, FMA and F16C (checked in `new`).
    simd: Option<SimdDequantize>,
}

impl RowDequantizer {
    pub(crate) fn new(dtype: GgmlType, portable: fn(&[u8], &mut [f32])) -> RowDequantizer {
        #[cfg(target_arch = "x86_64")]
        if avx2::detected() {
            return RowDequantizer { portable, simd: avx2::dequantizer(dtype) };
        }
        let _ = dtype;
        RowDequantizer { portable, simd: None }
    }

    #[inline]
    pub(crate) fn run(&self, src: &[u8], dst: &mut [f32]) {
        match self.simd {
            // SAFETY: `simd` is only set after `avx2::detected()` confirmed AVX2, FMA and F16C.
            Some(f) => unsafe { f(src, dst) },
            None => (self.portable)(src, dst),
        }
    }
}

/// Eight weight rows (pointers to `nb` blocks each) against one activation row.
type RowsKernel = unsafe fn(&[*const u8; 8], usize, ActRow<'_>) -> [f32; 8];
/// Four weight rows against `N` octets of tokens (32-value types): `out[row][octet][token]`.
type OctetTileKernel<const N: usize> = unsafe fn(&[*const u8; 4], usize, &[TokenOctet<'_>; N]) -> [[[f32; 8]; N]; 4];

/// Whether the AVX-512 decode kernels (eight rows against one token) of `dtype` beat the AVX2
/// ones on this CPU; the prefill tiles are AVX-512's either way. The two give the same bits (see
/// `avx512`), so this only moves speed. `DISKFORMER_AVX512_DECODE=1|0` overrides for every type.
///
/// Not on AMD Zen 4 (family 0x19), which runs a 512-bit instruction as two 256-bit halves, except
/// for the k-quants: on a 2-core EPYC of that family, 1B decode measured 30-31 tok/s with the
/// AVX-512 kernels against 35-41 with AVX2's for Q4_0 (one thread 18.3 against 26.8), while its
/// AVX-512 prefill tiles were 15-80% ahead. Q4_K read 25-27 against 28-29 then; since the k-quant
/// kernels unpack eight rows' heads in vectors and pack their sub-block sums
/// ([`avx512::rows8_k`]), a 1B decode there reads, AVX-512 against AVX2 (fortieth session, 2
/// threads, alternating processes on a noisy host): Q4_K 43.1-46.2 against 38.0-40.8 tok/s; Q6_K
/// 28.8, 22.8, 25.0, 28.7, 20.8, 19.4 against 23.7, 19.8, 20.6, 26.8, 25.6, 17.2 (one thread on
/// a 768 x 2048 matrix in L2: 28.6-31.1 GB/s against 16.3-24.0).
#[cfg(target_arch = "x86_64")]
fn avx512_decode_pays(dtype: GgmlType) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    static ZEN4: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| match std::env::var("DISKFORMER_AVX512_DECODE").as_deref().map(str::trim) {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    });
    forced.unwrap_or_else(|| matches!(dtype, GgmlType::Q4_K | GgmlType::Q6_K) || !*ZEN4.get_or_init(is_amd_zen4))
}

/// The AVX-512 Q4_K and Q6_K decode with their sub-block sums packed ([`avx512::rows8_k`]),
/// except on B steps of the A/B name `kmadd` or under `DISKFORMER_K_PACKED=0` (the kernels that
/// multiply each sub-block twice, for comparison on other CPUs).
#[cfg(target_arch = "x86_64")]
fn k_packed() -> bool {
    static PACKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PACKED.get_or_init(|| std::env::var("DISKFORMER_K_PACKED").map_or(true, |v| v.trim() != "0"))
        && !crate::ab::is_b("kmadd")
}

/// AMD family 0x19 (Zen 3 and Zen 4; of those only Zen 4 has AVX-512) by CPUID.
#[cfg(target_arch = "x86_64")]
fn is_amd_zen4() -> bool {
    use std::arch::x86_64::__cpuid;
    // SAFETY: CPUID exists on every x86-64 CPU; leaves 0 and 1 are always valid. (The function
    // is safe in newer Rust; the block keeps older compilers happy.)
    #[allow(unused_unsafe)]
    let (vendor, signature) = unsafe {
        let v = __cpuid(0);
        ([v.ebx.to_le_bytes(), v.edx.to_le_bytes(), v.ecx.to_le_bytes()].concat(), __cpuid(1).eax)
    };
    let base_family = (signature >> 8) & 0xf;
    let family = if base_family == 0xf { base_family + ((signature >> 20) & 0xff) } else { base_family };
    vendor == b"AuthenticAMD" && family == 0x19
}

/// A prefill tile's kernels: sixteen tokens per call, one per lane ([`TokenOctet`]), and eight
/// for a last odd octet.
#[derive(Clone, Copy)]
// Only x86-64 and aarch64 have tiles; other targets name the type but never make one.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
struct TileKernel(OctetTileKernel<2>, OctetTileKernel<1>);

/// Multi-row kernels of one weight type (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K on AVX2 and NEON):
/// decode as eight rows per call, prefill as four rows by sixteen tokens. Both give each (row,
/// token) the same bits.
#[derive(Clone, Copy)]
pub(crate) struct Tiles {
    rows8: RowsKernel,
    /// `rows8` without its prefetch of the next eight rows, for a claim's last group (whose
    /// next rows are another thread's), where the kernel has that variant.
    rows8_last: Option<RowsKernel>,
    tile: TileKernel,
    /// Four rows by four octets (32 tokens), where a type gains from the taller tile (AVX-512
    /// Q4_0 and Q4_K); same bits as two two-octet tiles.
    quad: Option<OctetTileKernel<4>>,
}

impl Tiles {
    /// The tile kernels of `dtype` for `kernel`, when they exist and the CPU can run them.
    #[allow(unused_variables)]
    pub(crate) fn new(dtype: GgmlType, kernel: Kernel) -> Option<Tiles> {
        #[cfg(target_arch = "x86_64")]
        if kernel == Kernel::Avx512 && kernel.is_available() {
            // Decode of Q4_0, Q4_1, Q8_0, Q4_K and Q6_K and two-octet prefill tiles of those
            // and Q5_0 on AVX-512; the rest (Q5_0 decode, the one-octet tiles) AVX2's, with the
            // same bits (see `avx512`).
            use avx2_tiles as t;
            use avx512_lanes as l;
            let avx2 = Tiles::new(dtype, Kernel::Avx2)?;
            let TileKernel(_, one) = avx2.tile;
            let (mut rows8, two): (RowsKernel, OctetTileKernel<2>) = match dtype {
                GgmlType::Q4_0 => (avx512::rows8::<{ t::Q4_0 }>, l::tile::<{ t::Q4_0 }>),
                GgmlType::Q4_1 => (avx512::rows8::<{ t::Q4_1 }>, l::tile::<{ t::Q4_1 }>),
                GgmlType::Q5_0 => (avx2.rows8, l::tile::<{ t::Q5_0 }>),
                GgmlType::Q8_0 => (avx512::rows8::<{ t::Q8_0 }>, l::tile_q8_0),
                GgmlType::Q4_K if !k_packed() => (avx512::rows8_k_madd::<{ avx512::Q4_K }>, l::tile_q4_k),
                GgmlType::Q4_K => (avx512::rows8_k::<{ avx512::Q4_K }>, l::tile_q4_k),
                GgmlType::Q6_K if !k_packed() => (avx512::rows8_k_madd::<{ avx512::Q6_K }>, l::tile_q6_k),
                GgmlType::Q6_K => (avx512::rows8_k::<{ avx512::Q6_K }>, l::tile_q6_k),
                _ => return Some(avx2),
            };
            if !avx512_decode_pays(dtype) {
                rows8 = avx2.rows8;
            }
            let quad = match dtype {
                GgmlType::Q4_0 => Some(l::tile4_q4_0 as OctetTileKernel<4>),
                GgmlType::Q4_K => Some(l::tile4_q4_k as OctetTileKernel<4>),
                _ => None,
            };
            let rows8_last = match (dtype, k_packed()) {
                _ if !avx512_decode_pays(dtype) => None,
                (GgmlType::Q4_K, true) => Some(avx512::rows8_k_last::<{ avx512::Q4_K }> as RowsKernel),
                (GgmlType::Q4_K, false) => Some(avx512::rows8_k_madd_last::<{ avx512::Q4_K }> as RowsKernel),
                (GgmlType::Q6_K, true) => Some(avx512::rows8_k_last::<{ avx512::Q6_K }> as RowsKernel),
                (GgmlType::Q6_K, false) => Some(avx512::rows8_k_madd_last::<{ avx512::Q6_K }> as RowsKernel),
                _ => None,
            };
            return Some(Tiles { rows8, rows8_last, tile: TileKernel(two, one), quad });
        }
        #[cfg(target_arch = "x86_64")]
        if kernel == Kernel::Avx2 && kernel.is_available() {
            use avx2_ktiles as k;
            use avx2_lanes as l;
            use avx2_tiles as t;
            return Some(match dtype {
                GgmlType::Q4_0 => Tiles {
                    rows8: t::rows8::<{ t::Q4_0 }>,
                    rows8_last: None,
                    tile: TileKernel(l::tile::<{ t::Q4_0 }, 2>, l::tile::<{ t::Q4_0 }, 1>),
                    quad: None,
                },
                GgmlType::Q4_1 => Tiles {
                    rows8: t::rows8::<{ t::Q4_1 }>,
                    rows8_last: None,
                    tile: TileKernel(l::tile::<{ t::Q4_1 }, 2>, l::tile::<{ t::Q4_1 }, 1>),
                    quad: None,
                },
                GgmlType::Q5_0 => Tiles {
                    rows8: t::rows8::<{ t::Q5_0 }>,
                    rows8_last: None,
                    tile: TileKernel(l::tile::<{ t::Q5_0 }, 2>, l::tile::<{ t::Q5_0 }, 1>),
                    quad: None,
                },
                GgmlType::Q8_0 => Tiles {
                    rows8: t::rows8::<{ t::Q8_0 }>,
                    rows8_last: None,
                    tile: TileKernel(l::tile_q8_0::<2>, l::tile_q8_0::<1>),
                    quad: None,
                },
                GgmlType::Q4_K => Tiles {
                    rows8: k::rows8::<{ k::Q4_K }>,
                    rows8_last: None,
                    tile: TileKernel(l::tile_q4_k::<2>, l::tile_q4_k::<1>),
                    quad: None,
                },
                GgmlType::Q6_K => Tiles {
                    rows8: k::rows8::<{ k::Q6_K }>,
                    rows8_last: None,
                    tile: TileKernel(l::tile_q6_k::<2>, l::tile_q6_k::<1>),
                    quad: None,
                },
                _ => return None,
            });
        }
        #[cfg(target_arch = "aarch64")]
        if kernel == Kernel::Neon && kernel.is_available() {
            let (rows8, two, one) = neon_tiles::kernels(dtype)?;
            return Some(Tiles { rows8, rows8_last: None, tile: TileKernel(two, one), quad: None });
        }
        None
    }

    /// A tile of four rows by one or two octets of tokens (`xs.len()`): `out[r][o][t]` is row
    /// `rows[r]` times token `t` of `xs[o]` (`out[r][1]` is not written for one octet).
    ///
    /// # Safety
    /// As [`Tiles::rows8`]; `ActBuf::build_octets` must have laid out the tokens.
    #[inline]
    pub(crate) unsafe fn tile_octets(
        &self,
        rows: &[*const u8; 4],
        nb: usize,
        xs: &[TokenOctet<'_>],
    ) -> [[[f32; 8]; 2]; 4] {
        let TileKernel(two, one) = self.tile;
        match xs {
            // SAFETY: as in `rows8`.
            [a, b] => unsafe { two(rows, nb, &[*a, *b]) },
            [a] => {
                // SAFETY: as in `rows8`.
                let values = unsafe { one(rows, nb, &[*a]) };
                values.map(|[v]| [v, [0.0; 8]])
            }
            _ => unreachable!("an octet tile takes one or two octets"),
        }
    }

    /// True when [`Tiles::tile_quad`] has a kernel of its own.
    #[inline]
    pub(crate) fn has_quad(&self) -> bool {
        self.quad.is_some()
    }

    /// A tile of four rows by four octets: `out[r][o][t]` is row `rows[r]` times token `t` of
    /// `xs[o]`, with the bits of two [`Tiles::tile_octets`] calls (which it makes when the type
    /// has no four-octet kernel).
    ///
    /// # Safety
    /// As [`Tiles::tile_octets`].
    #[inline]
    pub(crate) unsafe fn tile_quad(
        &self,
        rows: &[*const u8; 4],
        nb: usize,
        xs: &[TokenOctet<'_>; 4],
    ) -> [[[f32; 8]; 4]; 4] {
        if let Some(quad) = self.quad {
            // SAFETY: as in `rows8`.
            return unsafe { quad(rows, nb, xs) };
        }
        // SAFETY: as in `rows8`.
        let (a, b) = unsafe { (self.tile_octets(rows, nb, &xs[..2]), self.tile_octets(rows, nb, &xs[2..])) };
        std::array::from_fn(|r| [a[r][0], a[r][1], b[r][0], b[r][1]])
    }

    /// Eight rows' dot products with `x`.
    ///
    /// # Safety
    /// Every `rows[i]` must point at `nb` whole blocks of the type `new` was given.
    #[inline]
    pub(crate) unsafe fn rows8(&self, rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
        // SAFETY: `new` set the kernel only after confirming the CPU features; the caller
        // guarantees the rows; the kernel checks the activation lengths.
        unsafe { (self.rows8)(rows, nb, x) }
    }

    /// [`Tiles::rows8`] for the last group of rows a thread claimed: no prefetch of the rows
    /// after them, which another thread computes (its own caches are where they should go).
    /// Same bits as `rows8`. The A/B name `lastpf` keeps the prefetch on B steps.
    ///
    /// # Safety
    /// As [`Tiles::rows8`].
    #[inline]
    pub(crate) unsafe fn rows8_last(&self, rows: &[*const u8; 8], nb: usize, x: ActRow<'_>) -> [f32; 8] {
        let kernel = match self.rows8_last {
            Some(k) if !crate::ab::is_b("lastpf") => k,
            _ => self.rows8,
        };
        // SAFETY: as in `rows8`.
        unsafe { kernel(rows, nb, x) }
    }
}

/// A vectorised kernel for four activation rows at once.
type SimdDot4 = unsafe fn(&[u8], &[ActRow<'_>; 4]) -> [f32; 4];

/// A vectorised kernel: `w` is whole blocks of the weight type, `x` the matching activations.
type SimdDot = unsafe fn(&[u8], ActRow<'_>) -> f32;

/// The dot product of one weight type, resolved once per matmul.
#[derive(Clone, Copy)]
pub(crate) struct QDot {
    dtype: GgmlType,
    /// Set only when the CPU supports the kernel's instructions (checked in `new`).
    simd: Option<SimdDot>,
    /// As `simd`, for four rows; its results equal four `simd` calls bit for bit.
    simd4: Option<SimdDot4>,
}

impl QDot {
    /// The dot product of `dtype` with `kernel`; falls back to portable where the kernel has no
    /// version for the type or the CPU lacks its instructions.
    pub(crate) fn new(dtype: GgmlType, kernel: Kernel) -> QDot {
        let available = kernel.is_available();
        let simd = if available { simd_kernel(dtype, kernel) } else { None };
        let simd4 = if available { simd_kernel4(dtype, kernel) } else { None };
        QDot { dtype, simd, simd4 }
    }

    /// Four dot products of one weight row, each equal to [`QDot::dot`] of that row.
    #[inline]
    pub(crate) fn dot4(&self, w: &[u8], xs: &[ActRow<'_>; 4]) -> [f32; 4] {
        match self.simd4 {
            // SAFETY: as for `dot`: set only after the CPU features were confirmed.
            Some(f) => unsafe { f(w, xs) },
            None => [self.dot(w, xs[0]), self.dot(w, xs[1]), self.dot(w, xs[2]), self.dot(w, xs[3])],
        }
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
fn simd_kernel4(dtype: GgmlType, kernel: Kernel) -> Option<SimdDot4> {
    match kernel {
        // AVX-512 has no single-row kernels of its own: the AVX2 ones (its CPUs have AVX2).
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 | Kernel::Avx512 => avx2::kernel4(dtype),
        _ => None,
    }
}

#[allow(unused_variables)]
fn simd_kernel(dtype: GgmlType, kernel: Kernel) -> Option<SimdDot> {
    match kernel {
        Kernel::Portable => None,
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 | Kernel::Avx512 => avx2::kernel(dtype),
        #[cfg(target_arch = "aarch64")]
        Kernel::Neon => neon::kernel(dtype),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorised dequantizers against the portable ones on every f16 bit pattern and on
    /// random bytes (any bytes are valid blocks for these decoders).
    #[test]
    fn row_dequantizers_match_portable_bits() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        };
        for dtype in gguf::ALL_TYPES {
            let Some(portable) = super::super::dequantizer(dtype) else { continue };
            let n_blocks = if dtype.is_quantized() { 37 } else { 601 };
            let src: Vec<u8> = if dtype == GgmlType::F16 {
                (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect()
            } else {
                (0..n_blocks * dtype.block_bytes()).map(|_| next()).collect()
            };
            let n = src.len() / dtype.block_bytes() * dtype.block_elems();
            let mut want = vec![0f32; n];
            let mut got = vec![1f32; n];
            portable(&src, &mut want);
            RowDequantizer::new(dtype, portable).run(&src, &mut got);
            for i in 0..n {
                assert_eq!(got[i].to_bits(), want[i].to_bits(), "{dtype} value {i}");
            }
        }
    }
}
