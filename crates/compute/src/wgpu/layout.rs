//! Weight layouts on the GPU: each GGUF block repacked so that every field starts on a 4-byte
//! boundary, because WGSL reads storage buffers as 32-bit words (u8 and f16 storage access need
//! extensions). Repacking only inserts padding after fields whose size is not a multiple of four
//! (Q4_0's 2-byte scale, Q6_K's trailing scale), so a block's bytes keep their order and the
//! shaders (`shaders/quant/<type>.wgsl`) read the same fields ggml's block structs name.
//!
//! Float types have no blocks; they are cut into groups of 8 values, rows padded with zeros to
//! a whole number of groups, so every type reaches the kernels as "groups of 8 values".

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
}

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
        Some(TypeLayout { dtype, block_values, fields, shader, name })
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
            let mut at = b * block_words * 4;
            let mut from = 0;
            for &f in self.fields {
                words[at..at + f].copy_from_slice(&block[from..from + f]);
                from += f;
                at += f.div_ceil(4) * 4;
            }
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
}
