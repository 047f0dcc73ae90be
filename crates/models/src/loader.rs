//! Reading tensors by GGUF name and checking their shapes against the hyper-parameters.

use crate::error::{ModelError, Result};
use compute::{Backend, HostWeight};
use gguf::GgufModel;
use std::sync::Arc;

/// Hands a model file its tensors, made usable by the back end, with shapes checked.
pub struct Loader<'a, B: Backend> {
    /// The back end.
    pub b: &'a B,
    /// The open model.
    pub model: &'a Arc<GgufModel>,
}

impl<'a, B: Backend> Loader<'a, B> {
    /// The host view of a tensor, or `None` when absent.
    pub fn host_opt(&self, name: &str) -> Option<HostWeight> {
        HostWeight::from_model(self.model, name)
    }

    fn host(&self, name: &str, shape: &[usize]) -> Result<HostWeight> {
        let w = self.host_opt(name).ok_or_else(|| ModelError::MissingTensor { name: name.to_string() })?;
        check_shape(&w, shape)?;
        Ok(w)
    }

    /// A matrix `[n_out, k]` (or stacked experts `[n_expert, n_out, k]`).
    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<B::Weight> {
        Ok(self.b.weight(&self.host(name, shape)?)?)
    }

    /// A matrix, or `None` when the file has no tensor of that name.
    pub fn weight_opt(&self, name: &str, shape: &[usize]) -> Result<Option<B::Weight>> {
        if self.model.tensor_opt(name).is_none() {
            return Ok(None);
        }
        self.weight(name, shape).map(Some)
    }

    /// A small tensor (norm weight, bias) as f32.
    pub fn vector(&self, name: &str, shape: &[usize]) -> Result<B::Tensor> {
        let w = self.host(name, shape)?;
        Ok(self.b.weight_f32(&w, shape)?)
    }

    /// A small tensor, or `None` when absent.
    pub fn vector_opt(&self, name: &str, shape: &[usize]) -> Result<Option<B::Tensor>> {
        if self.model.tensor_opt(name).is_none() {
            return Ok(None);
        }
        self.vector(name, shape).map(Some)
    }

    /// The output projection `[n_vocab, n_embd]`: `output.weight`, or the token embedding when the
    /// model ties them (no `output.weight` in the file).
    pub fn output_or_tied(&self, n_vocab: usize, n_embd: usize) -> Result<B::Weight> {
        match self.weight_opt(gguf::names::OUTPUT, &[n_vocab, n_embd])? {
            Some(w) => Ok(w),
            None => self.weight(gguf::names::TOKEN_EMBD, &[n_vocab, n_embd]),
        }
    }

    /// True when the file has a tensor of this name.
    pub fn has(&self, name: &str) -> bool {
        self.model.tensor_opt(name).is_some()
    }
}

fn check_shape(w: &HostWeight, shape: &[usize]) -> Result<()> {
    // A 1-D parameter may be stored as [n] or [1, n]; compare without leading ones.
    let strip = |s: &[usize]| -> Vec<usize> {
        let first = s.iter().position(|&d| d != 1).unwrap_or(s.len().saturating_sub(1));
        s[first..].to_vec()
    };
    if strip(&w.shape) != strip(shape) {
        return Err(ModelError::TensorShape { name: w.name.clone(), expected: shape.to_vec(), got: w.shape.clone() });
    }
    Ok(())
}
