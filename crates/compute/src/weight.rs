//! Where a weight's bytes live: a tensor of an open GGUF model, shared by `Arc`.

use gguf::{GgmlType, GgufModel};
use std::sync::Arc;

/// A weight matrix (or stack of expert matrices) in its stored type, borrowed from a model's
/// memory map. Cloning is cheap. `shape` is PyTorch order: `[n_out, k]` for a matrix,
/// `[n_expert, n_out, k]` for stacked experts (ggml order reversed).
#[derive(Clone)]
pub struct HostWeight {
    model: Arc<GgufModel>,
    file: usize,
    start: usize,
    len: usize,
    /// Stored element type.
    pub dtype: GgmlType,
    /// Dimensions, outermost first; the last is the row length.
    pub shape: Vec<usize>,
    /// Tensor name (for errors and names in stats).
    pub name: String,
}

impl std::fmt::Debug for HostWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostWeight({} {} {:?})", self.name, self.dtype, self.shape)
    }
}

/// Whether a GPU back end with an expert tier keeps `model`'s input embedding (`token_embd`) in
/// host memory, reading the rows a step needs there, instead of in device memory: when the model
/// has an output projection of its own (a tied one is the embedding, which the output product
/// reads whole every token), unless `DISKFORMER_EMBED_ON_GPU=1`. A decode step reads one row of
/// the table (8 KB for Qwen3-30B-A3B) and the table is ~175 MB in Q4_K there: 65 more expert
/// slots under a 4 GB budget. llama.cpp keeps its input embedding on the host too. The GPU
/// placement (`pager::placement`) and the wgpu back end's `weight` both follow this rule, so the
/// bytes planned are the bytes held.
pub fn input_embedding_on_host(model: &GgufModel) -> bool {
    model.tensor_opt(gguf::names::OUTPUT).is_some()
        && model.tensor_opt(gguf::names::TOKEN_EMBD).is_some()
        && !std::env::var("DISKFORMER_EMBED_ON_GPU").is_ok_and(|v| v.trim() == "1")
}

impl HostWeight {
    /// The model this weight belongs to.
    pub fn model(&self) -> &Arc<GgufModel> {
        &self.model
    }

    /// The tensor `name` of `model`, or `None` when absent.
    pub fn from_model(model: &Arc<GgufModel>, name: &str) -> Option<HostWeight> {
        let (fi, info) = model.tensor_location(name)?;
        let f = &model.files()[fi];
        Some(HostWeight {
            model: model.clone(),
            file: fi,
            start: (f.data_offset + info.offset) as usize,
            len: info.size_bytes as usize,
            dtype: info.dtype,
            shape: info.shape.iter().rev().map(|&d| d as usize).collect(),
            name: name.to_string(),
        })
    }

    /// The stored bytes, borrowed from the memory map (bounds were validated when the file was
    /// opened).
    pub fn bytes(&self) -> &[u8] {
        &self.model.files()[self.file].raw_bytes()[self.start..self.start + self.len]
    }

    /// Row length (the last dimension).
    pub fn row_len(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }

    /// Number of rows (product of every dimension but the last).
    pub fn n_rows(&self) -> usize {
        self.shape[..self.shape.len().saturating_sub(1)].iter().product()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.len / self.n_rows().max(1)
    }

    /// Rows `start..end` (of the flattened rows) as a weight of its own, e.g. one expert of a
    /// stack or the key half of a fused projection.
    pub fn rows(&self, start: usize, end: usize, shape: Vec<usize>) -> HostWeight {
        let rb = self.row_bytes();
        HostWeight {
            model: self.model.clone(),
            file: self.file,
            start: self.start + start * rb,
            len: (end - start) * rb,
            dtype: self.dtype,
            shape,
            name: self.name.clone(),
        }
    }

    /// The whole weight dequantized to f32.
    ///
    /// # Errors
    /// The type has no dequantizer.
    pub fn to_f32(&self) -> Result<Vec<f32>, crate::quant::QuantError> {
        let mut out = vec![0f32; self.n_rows() * self.row_len()];
        crate::quant::dequantize(self.dtype, self.bytes(), &mut out)?;
        Ok(out)
    }
}
