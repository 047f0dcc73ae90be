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
//!
//! Q4_K blocks may be regrouped in place ([`TypeLayout::q4_k_grouped`], 144 bytes as in the file):
//! GGUF stores a pair of 32-value sub-blocks in 32 bytes (the first sub-block in the low nibbles,
//! the second in the high ones), so an int8 kernel taking one sub-block per invocation loads 32
//! bytes and uses half of each, and decodes a 6-bit scale and min spread over three bytes with a
//! branch on the sub-block index. Regrouped, each sub-block's quants are 16 contiguous bytes in
//! Q4_0's order (byte i: value i in the low nibble, i + 16 in the high one), one 16-byte load
//! against the same activation block as grouped Q4_0; the eight scales and mins are stored as
//! three words of bit fields that `extractBits` reads without a branch. It is not the default
//! (`DISKFORMER_Q4_K_LAYOUT=grouped` selects it): on the H200 (eighth session, one lease,
//! 32768 x 8192 against a 3930 GB/s stream read) its 16-byte-load kernel read 58% of the stream
//! at 1x64v against 63% for ggml's layout, and an 8B Q4_K decode layer replayed 2.5% slower with
//! the default shapes, though its 4-byte-load kernel led at some shapes (q/k/v at 1x64 22.5 us
//! against 26.5, 32768 x 8192 at 2x64 61% against 58%).

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
    /// Whether the fields' bytes are rearranged, not only padded (grouped Q4_0 and Q4_K): the
    /// shaders are the layout's own, not the type's.
    pub regrouped: bool,
}

/// Q4_0 blocks per grouped GPU block.
const Q4_0_GROUP: usize = 8;

/// Whether the environment variable `name` asks for the per-block layout (`blocks`).
fn per_block(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "blocks")
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
        Some(TypeLayout { dtype, block_values, fields, shader, name, group: 1, regrouped: false })
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
            regrouped: true,
        }
    }

    /// Q4_K's grouped layout (see the module docs): 144 bytes per 256 values as in the file, the
    /// words [d | dmin], then the scales' and mins' bit fields (word 1: the low four bits of the
    /// eight scales, scale j at bit 4j; word 2: the same of the mins; word 3: the high two bits
    /// of scale j at bit 2j, of min j at bit 16 + 2j), then sub-block j's 16 quant bytes at byte
    /// 16 + 16j.
    pub fn q4_k_grouped() -> TypeLayout {
        TypeLayout {
            dtype: GgmlType::Q4_K,
            block_values: 256,
            fields: &[4, 12, 128],
            shader: include_str!("shaders/quant/q4_kg.wgsl"),
            name: "q4_kg",
            group: 1,
            regrouped: true,
        }
    }

    /// The layout a weight of `dtype` with rows of `k` values takes on the GPU: Q4_0's grouped
    /// layout where rows are whole groups (`DISKFORMER_Q4_0_LAYOUT=blocks` keeps the per-block
    /// layout), Q4_K's grouped layout when `DISKFORMER_Q4_K_LAYOUT=grouped` (both for
    /// comparisons), else [`TypeLayout::of`]. Every upload and placement of a weight asks here,
    /// so a matrix and its copies (expert slots, the host tier) agree.
    pub fn for_weight(dtype: GgmlType, k: usize) -> Option<TypeLayout> {
        static ENV: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();
        let (q4_0_blocks, q4_k_grouped) = *ENV.get_or_init(|| {
            (per_block("DISKFORMER_Q4_0_LAYOUT"), std::env::var("DISKFORMER_Q4_K_LAYOUT").is_ok_and(|v| v == "grouped"))
        });
        if dtype == GgmlType::Q4_0 && !q4_0_blocks && k.is_multiple_of(32 * Q4_0_GROUP) {
            return Some(TypeLayout::q4_0_grouped());
        }
        if dtype == GgmlType::Q4_K && q4_k_grouped {
            return Some(TypeLayout::q4_k_grouped());
        }
        TypeLayout::of(dtype)
    }

    /// Whether a stored block's bytes are its GPU block's bytes (every field whole words, not
    /// regrouped), so uploads may copy rows as they are.
    pub fn copies_verbatim(&self) -> bool {
        !self.regrouped && self.fields.iter().all(|f| f % 4 == 0)
    }

    /// Writes one stored block (`src`, `block_bytes()` long, as in the file) into `dst`
    /// (`4 * block_words()` bytes) in the GPU layout, zeroing the padding.
    pub fn repack_block(&self, src: &[u8], dst: &mut [u8]) {
        if self.regrouped && self.dtype == GgmlType::Q4_K {
            repack_q4_k_block(src, dst);
            return;
        }
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
        self.repack_blocks(src, bytemuck::cast_slice_mut(&mut out));
        out
    }

    /// [`TypeLayout::repack_block`] over whole blocks: `src` as in the file, `dst` the GPU
    /// blocks (`4 * block_words()` bytes each, as many as `src` holds), on the thread pool in
    /// pieces of 64 KiB or so: uploads repack every grouped weight, an expert's matrices (under
    /// 1 MB each in Qwen3-30B-A3B) on each upload into a slot, and one core repacks grouped
    /// Q4_K at ~4.5 GB/s here (grouped Q4_0 ~7.5, a copy ~10).
    pub fn repack_blocks(&self, src: &[u8], dst: &mut [u8]) {
        use rayon::prelude::*;
        let (sb, db) = (self.block_bytes(), 4 * self.block_words());
        let n = src.len() / sb;
        let per_piece = ((64 << 10) / sb).max(1);
        let (src, dst) = (&src[..n * sb], &mut dst[..n * db]);
        let piece = |(s, d): (&[u8], &mut [u8])| {
            for (block, out) in s.chunks_exact(sb).zip(d.chunks_exact_mut(db)) {
                self.repack_block(block, out);
            }
        };
        if n > per_piece {
            src.par_chunks(per_piece * sb).zip(dst.par_chunks_mut(per_piece * db)).for_each(piece);
        } else {
            piece((src, dst));
        }
    }
}

/// One Q4_K block (144 bytes as in the file) into the grouped layout ([`TypeLayout::q4_k_grouped`]).
fn repack_q4_k_block(src: &[u8], dst: &mut [u8]) {
    dst[..4].copy_from_slice(&src[..4]);
    // ggml's get_scale_min_k4: sub-blocks 0..4 in the low six bits of bytes 0..4 (scales) and
    // 4..8 (mins); 4..8 in the nibbles of bytes 8..12 and the top two bits of bytes 0..8.
    let q = &src[4..16];
    let (mut lo_sc, mut lo_m, mut hi) = (0u32, 0u32, 0u32);
    for j in 0..4 {
        let (a, b, c) = (u32::from(q[j]), u32::from(q[j + 4]), u32::from(q[j + 8]));
        // Sub-block j: a & 63, b & 63; sub-block j + 4: (c & 15) | (a >> 6) << 4, (c >> 4) | (b >> 6) << 4.
        lo_sc |= (a & 15) << (4 * j) | (c & 15) << (4 * j + 16);
        lo_m |= (b & 15) << (4 * j) | (c >> 4) << (4 * j + 16);
        hi |= ((a >> 4) & 3) << (2 * j)
            | (a >> 6) << (2 * j + 8)
            | ((b >> 4) & 3) << (2 * j + 16)
            | (b >> 6) << (2 * j + 24);
    }
    dst[4..8].copy_from_slice(&lo_sc.to_le_bytes());
    dst[8..12].copy_from_slice(&lo_m.to_le_bytes());
    dst[12..16].copy_from_slice(&hi.to_le_bytes());
    // Sub-blocks 2c and 2c + 1 are the low and high nibbles of the 32 bytes qs[32c..]: value i of
    // either is in byte i, and goes to byte i % 16 of its 16 bytes, low nibble for i < 16. Eight
    // bytes at a time (the masks keep nibbles within their bytes).
    const LO: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    for (c, pair) in src[16..144].chunks_exact(32).enumerate() {
        let (even, odd) = dst[16 + 32 * c..48 + 32 * c].split_at_mut(16);
        for h in 0..2 {
            let a = word(&pair[8 * h..8 * h + 8]);
            let b = word(&pair[16 + 8 * h..24 + 8 * h]);
            even[8 * h..8 * h + 8].copy_from_slice(&((a & LO) | ((b & LO) << 4)).to_le_bytes());
            odd[8 * h..8 * h + 8].copy_from_slice(&(((a >> 4) & LO) | (b & !LO)).to_le_bytes());
        }
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
    }

    #[test]
    fn q4_k_takes_the_grouped_layout_when_asked() {
        let grouped = std::env::var("DISKFORMER_Q4_K_LAYOUT").is_ok_and(|v| v == "grouped");
        let l = TypeLayout::for_weight(GgmlType::Q4_K, 4096).unwrap();
        assert_eq!(l.name, if grouped { "q4_kg" } else { "q4_k" });
        // Same bytes as the file: the GPU budget counts the same.
        assert_eq!(l.row_words(4096), TypeLayout::of(GgmlType::Q4_K).unwrap().row_words(4096));
        assert!(!TypeLayout::q4_k_grouped().copies_verbatim());
    }

    /// The grouped Q4_K block read as the layout's docs describe it gives the values the CPU's
    /// Q4_K dequantization gives for the file's block.
    #[test]
    fn grouped_q4_k_holds_the_file_block_values() {
        let l = TypeLayout::q4_k_grouped();
        assert_eq!((l.block_bytes(), l.block_words()), (144, 36));
        let mut state = 0x2545f491u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as u8
        };
        // One block, then 3 rows of 64 blocks, then 4 rows of 512 (past the parallel repack's
        // piece size, so pieces must land at their blocks).
        for (n_rows, k) in [(1, 256), (3, 64 * 256), (4, 512 * 256)] {
            let n_blocks = n_rows * k / 256;
            let mut src = vec![0u8; 144 * n_blocks];
            src.iter_mut().for_each(|b| *b = next());
            for block in src.chunks_exact_mut(144) {
                // d = 1.5, dmin = 0.25 (f16), so every value is finite.
                block[..4].copy_from_slice(&[0x00, 0x3e, 0x00, 0x34]);
            }
            let mut want = vec![0f32; 256 * n_blocks];
            crate::quant::dequantize(GgmlType::Q4_K, &src, &mut want).unwrap();
            let all = l.repack(&src, n_rows, k);
            assert_eq!(all.len(), 36 * n_blocks);
            for (b, words) in all.chunks_exact(36).enumerate() {
                let bytes: &[u8] = bytemuck::cast_slice(words);
                assert_eq!(&bytes[..4], &src[144 * b..144 * b + 4]);
                let (d, dmin) = (1.5f32, 0.25f32);
                for j in 0..8 {
                    let sc = (words[1] >> (4 * j)) & 15 | ((words[3] >> (2 * j)) & 3) << 4;
                    let m = (words[2] >> (4 * j)) & 15 | ((words[3] >> (16 + 2 * j)) & 3) << 4;
                    for i in 0..32 {
                        let byte = bytes[16 + 16 * j + i % 16];
                        let q = if i < 16 { byte & 15 } else { byte >> 4 };
                        let got = d * sc as f32 * q as f32 - dmin * m as f32;
                        assert_eq!(got, want[256 * b + 32 * j + i], "block {b} sub-block {j} value {i}");
                    }
                }
            }
        }
    }
}
