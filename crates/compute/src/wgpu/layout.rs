//! Weight layouts on the GPU: each GGUF block repacked so that every field starts on a 4-byte
//! boundary, because WGSL reads storage buffers as 32-bit words (u8 and f16 storage access need
//! extensions). Repacking only inserts padding after fields whose size is not a multiple of four
//! (Q4_0's 2-byte scale, Q6_K's trailing scale), so a block's bytes keep their order and the
//! shaders (`shaders/quant/<type>.wgsl`) read the same fields ggml's block structs name.
//!
//! Float types have no blocks; they are cut into groups of 8 values, rows padded with zeros to
//! a whole number of groups, so every type reaches the kernels as "groups of 8 values".
//!
//! Q4_0 rows of a multiple of 256 values take a grouped layout instead ([`TypeLayout::for_weight`]):
//! eight GGUF blocks become one 144-byte GPU block, their eight f16 scales first (16 bytes), then
//! their eight 16-byte quant arrays. Padding the 2-byte scale of each 18-byte block (the layout
//! above) reads 20 bytes per 32 values and leaves the quants on 4-byte boundaries only; grouped,
//! a row is read at 18 bytes per 32 values and every quant array, like the scales, is one 16-byte
//! load (`shaders/quant/i8/q4_0g_v4.wgsl`). Kernels see it as a 256-value block type, as Q4_K.

use gguf::GgmlType;

/// How one weight type sits in GPU memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeLayout {
    /// The GGUF type.
    pub dtype: GgmlType,
    /// Values per (padded) block; 8 for float types.
    pub block_values: usize,
    /// Field sizes of one stored block in bytes, in file order (float types: one field).
    pub fields: &'static [usize],
    /// Shader source of the type's `dq8` (dequantize 8 values of a block).
    pub shader: &'static str,
    /// Short name used in pipeline keys and test output (`q4_k`).
    pub name: &'static str,
    /// GGUF blocks gathered into one GPU block (1: each block repacked on its own; 8: Q4_0's
    /// grouped layout, `fields` then being the group's scales and quants).
    pub group: usize,
}

/// Q4_0 blocks per grouped GPU block.
const Q4_0_GROUP: usize = 8;

impl TypeLayout {
    /// The layout of `dtype`, or `None` when the GPU has no kernel for it.
    pub fn of(dtype: GgmlType) -> Option<TypeLayout> {
        use GgmlType::*;
        let (block_values, fields, shader, name): (usize, &'static [usize], &'static str, &'static str) = match dtype {
            F32 => (8, &[32], include_str!("shaders/quant/f32.wgsl"), "f32"),
            F16 => (8, &[16], include_str!("shaders/quant/f16.wgsl"), "f16"),
            BF16 => (8, &[16], include_str!("shaders/quant/bf16.wgsl"), "bf16"),
            Q4_0 => (32, &[2, 16], include_str!("shaders/quant/q4_0.wgsl"), "q4_0"),
            Q4_1 => (32, &[4, 16], include_str!("shaders/quant/q4_1.wgsl"), "q4_1"),
            Q5_0 => (32, &[2, 4, 16], include_str!("shaders/quant/q5_0.wgsl"), "q5_0"),
            Q5_1 => (32, &[4, 4, 16], include_str!("shaders/quant/q5_1.wgsl"), "q5_1"),
            Q8_0 => (32, &[2, 32], include_str!("shaders/quant/q8_0.wgsl"), "q8_0"),
            Q2_K => (256, &[16, 64, 4], include_str!("shaders/quant/q2_k.wgsl"), "q2_k"),
            Q3_K => (256, &[32, 64, 12, 2], include_str!("shaders/quant/q3_k.wgsl"), "q3_k"),
            Q4_K => (256, &[4, 12, 128], include_str!("shaders/quant/q4_k.wgsl"), "q4_k"),
            Q5_K => (256, &[4, 12, 32, 128], include_str!("shaders/quant/q5_k.wgsl"), "q5_k"),
            Q6_K => (256, &[128, 64, 16, 2], include_str!("shaders/quant/q6_k.wgsl"), "q6_k"),
            IQ4_NL => (32, &[2, 16], include_str!("shaders/quant/iq4_nl.wgsl"), "iq4_nl"),
            IQ4_XS => (256, &[4, 4, 128], include_str!("shaders/quant/iq4_xs.wgsl"), "iq4_xs"),
            MXFP4 => (32, &[1, 16], include_str!("shaders/quant/mxfp4.wgsl"), "mxfp4"),
            _ => return None,
        };
        Some(TypeLayout { dtype, block_values, fields, shader, name, group: 1 })
    }

    /// Q4_0's grouped layout (eight blocks per GPU block, see the module docs), for rows of a
    /// multiple of 256 values.
    pub fn q4_0_grouped() -> TypeLayout {
        TypeLayout {
            dtype: GgmlType::Q4_0,
            block_values: 32 * Q4_0_GROUP,
            fields: &[2 * Q4_0_GROUP, 16 * Q4_0_GROUP],
            shader: include_str!("shaders/quant/q4_0g.wgsl"),
            name: "q4_0g",
            group: Q4_0_GROUP,
        }
    }

    /// The layout a weight of `dtype` with rows of `k` values takes on the GPU: Q4_0's grouped
    /// layout where rows are whole groups (`DISKFORMER_Q4_0_LAYOUT=blocks` keeps every Q4_0
    /// weight in per-block layout, for comparisons), else [`TypeLayout::of`]. Every upload and
    /// placement of a weight asks here, so a matrix and its copies (expert slots, the host tier)
    /// agree.
    pub fn for_weight(dtype: GgmlType, k: usize) -> Option<TypeLayout> {
        static BLOCKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let blocks = *BLOCKS.get_or_init(|| std::env::var("DISKFORMER_Q4_0_LAYOUT").is_ok_and(|v| v == "blocks"));
        if dtype == GgmlType::Q4_0 && !blocks && k.is_multiple_of(32 * Q4_0_GROUP) {
            return Some(TypeLayout::q4_0_grouped());
        }
        TypeLayout::of(dtype)
    }

    /// Whether a stored block's bytes are its GPU block's bytes (every field whole words, not
    /// grouped), so uploads may copy rows as they are.
    pub fn copies_verbatim(&self) -> bool {
        self.group == 1 && self.fields.iter().all(|f| f % 4 == 0)
    }

    /// Writes one stored block (`src`, `block_bytes()` long, as in the file) into `dst`
    /// (`4 * block_words()` bytes) in the GPU layout, zeroing the padding.
    pub fn repack_block(&self, src: &[u8], dst: &mut [u8]) {
        if self.group > 1 {
            // Grouped Q4_0: block i's scale to bytes 2i.., its quants to 16 + 16i.. .
            let (scales, quants) = dst.split_at_mut(2 * self.group);
            for (i, b) in src.chunks_exact(18).enumerate() {
                scales[2 * i..2 * i + 2].copy_from_slice(&b[..2]);
                quants[16 * i..16 * i + 16].copy_from_slice(&b[2..]);
            }
            return;
        }
        let mut at = 0;
        let mut from = 0;
        for &f in self.fields {
            dst[at..at + f].copy_from_slice(&src[from..from + f]);
            dst[at + f..at + f.div_ceil(4) * 4].fill(0);
            from += f;
            at += f.div_ceil(4) * 4;
        }
    }

    /// Whether rows are cut into 8-value groups rather than GGUF blocks.
    pub fn is_float(&self) -> bool {
        matches!(self.dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }

    /// Stored bytes of one block (or of one 8-value group for float types).
    pub fn block_bytes(&self) -> usize {
        self.fields.iter().sum()
    }

    /// 32-bit words of one repacked block.
    pub fn block_words(&self) -> usize {
        self.fields.iter().map(|f| f.div_ceil(4)).sum()
    }

    /// Words of one repacked row of `k` values.
    pub fn row_words(&self, k: usize) -> usize {
        k.div_ceil(self.block_values) * self.block_words()
    }

    /// Repacks `n_rows` stored rows of `k` values each (`src`, as in the GGUF file) into
    /// `row_words(k)` words per row.
    ///
    /// # Panics
    /// When `src` is not `n_rows` rows of the stored size (callers check sizes first).
    pub fn repack(&self, src: &[u8], n_rows: usize, k: usize) -> Vec<u32> {
        let row_words = self.row_words(k);
        let mut out = vec![0u32; n_rows * row_words];
        if self.is_float() {
            let elem = self.block_bytes() / 8;
            let row_bytes = k * elem;
            assert_eq!(src.len(), n_rows * row_bytes, "float weight of {n_rows} rows of {k}");
            for (r, row) in src.chunks_exact(row_bytes.max(1)).enumerate().take(n_rows) {
                let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out[r * row_words..(r + 1) * row_words]);
                dst[..row_bytes].copy_from_slice(row);
            }
            return out;
        }
        let block_bytes = self.block_bytes();
        let n_blocks = n_rows * (k / self.block_values);
        assert_eq!(src.len(), n_blocks * block_bytes, "{} weight of {n_rows} rows of {k}", self.name);
        let words: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        let block_words = self.block_words();
        for (b, block) in src.chunks_exact(block_bytes).enumerate() {
            self.repack_block(block, &mut words[b * block_words * 4..(b + 1) * block_words * 4]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_sizes_add_up_to_ggml_block_sizes() {
        use GgmlType::*;
        for t in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4] {
            let l = TypeLayout::of(t).unwrap();
            assert_eq!(l.block_bytes(), t.block_bytes(), "{t}");
            assert_eq!(l.block_values, t.block_elems(), "{t}");
        }
    }

    #[test]
    fn repack_pads_fields_to_words() {
        let l = TypeLayout::of(GgmlType::Q4_0).unwrap();
        let block: Vec<u8> = (0..18).collect();
        let words = l.repack(&block, 1, 32);
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        assert_eq!(&bytes[..2], &[0, 1]);
        assert_eq!(&bytes[2..4], &[0, 0]);
        assert_eq!(&bytes[4..20], &block[2..18]);
    }

    #[test]
    fn grouped_q4_0_puts_scales_first_then_quants() {
        let l = TypeLayout::q4_0_grouped();
        assert_eq!((l.block_bytes(), l.block_words()), (8 * 18, 36));
        // Two rows of 512 values: 32 stored blocks, block i's bytes all 1 + i.
        let src: Vec<u8> = (0..32u8).flat_map(|i| [1 + i; 18]).collect();
        let words = l.repack(&src, 2, 512);
        assert_eq!(words.len(), 2 * 2 * 36);
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        for (g, group) in bytes.chunks_exact(144).enumerate() {
            for i in 0..8 {
                let v = 1 + (8 * g + i) as u8;
                assert_eq!(&group[2 * i..2 * i + 2], &[v; 2], "scale of block {i} of group {g}");
                assert_eq!(&group[16 + 16 * i..32 + 16 * i], &[v; 16], "quants of block {i} of group {g}");
            }
        }
    }

    #[test]
    fn q4_0_rows_of_whole_groups_take_the_grouped_layout() {
        let blocks = std::env::var("DISKFORMER_Q4_0_LAYOUT").is_ok_and(|v| v == "blocks");
        let name = |k| TypeLayout::for_weight(GgmlType::Q4_0, k).unwrap().name;
        assert_eq!(name(4096), if blocks { "q4_0" } else { "q4_0g" });
        assert_eq!(name(4096 + 32), "q4_0");
        assert_eq!(TypeLayout::for_weight(GgmlType::Q4_K, 4096).unwrap().name, "q4_k");
    }
}
