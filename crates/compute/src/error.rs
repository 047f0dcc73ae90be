/// An op refused its inputs. Variants name the op and carry the shapes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpError {
    /// Inputs whose shapes do not fit together.
    #[error("{op}: shape mismatch: expected {expected}, got {got:?}")]
    ShapeMismatch {
        /// The op.
        op: &'static str,
        /// What it needs, in words.
        expected: String,
        /// What it got.
        got: Vec<usize>,
    },
    /// A weight the back end cannot use.
    #[error("weight {name:?}: {why}")]
    Weight {
        /// Tensor name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// A quantized type without a kernel.
    #[error("{op}: {source}")]
    Quant {
        /// The op.
        op: &'static str,
        /// The quant error.
        #[source]
        source: crate::quant::QuantError,
    },
    /// A position past the cache's capacity.
    #[error("context full: position {pos} + {n_tokens} tokens exceeds the context of {n_ctx}; raise --ctx-size")]
    ContextFull {
        /// First position written.
        pos: usize,
        /// Tokens written.
        n_tokens: usize,
        /// Capacity.
        n_ctx: usize,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    BadTokenId {
        /// The id.
        id: u32,
        /// The vocabulary size.
        n_vocab: usize,
    },
    /// The op is not implemented on this back end.
    #[error("{op} is not supported on {backend}: {why}")]
    Unsupported {
        /// The op.
        op: &'static str,
        /// The back end.
        backend: &'static str,
        /// Why.
        why: String,
    },
}

impl OpError {
    /// `from_host`'s check, the same on every back end: `data` holds exactly the values `shape`
    /// counts.
    pub(crate) fn check_host_values(data: &[f32], shape: &[usize]) -> Result<(), OpError> {
        let want = shape.iter().product::<usize>();
        if want == data.len() {
            return Ok(());
        }
        Err(OpError::ShapeMismatch { op: "from_host", expected: format!("{want} values"), got: vec![data.len()] })
    }
}
