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

impl HostWeight {
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
