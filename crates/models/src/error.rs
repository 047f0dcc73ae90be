use compute::OpError;
use gguf::GgufError;

/// Loading or running a model failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The file could not be read or lacks a key or tensor.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// An op refused its inputs.
    #[error(transparent)]
    Op(#[from] OpError),
    /// `general.architecture` names an architecture diskformer does not implement.
    #[error("architecture {arch:?} is not supported; supported: {supported}")]
    UnsupportedArchitecture {
        /// The architecture string of the file.
        arch: String,
        /// The list of supported ones.
        supported: String,
    },
    /// A required tensor is absent.
    #[error("tensor {name:?} is missing")]
    MissingTensor {
        /// Its name.
        name: String,
    },
    /// A tensor whose shape does not match the hyper-parameters.
    #[error("tensor {name:?} has shape {got:?}, expected {expected:?} (PyTorch order)")]
    TensorShape {
        /// Its name.
        name: String,
        /// Expected shape.
        expected: Vec<usize>,
        /// Shape in the file.
        got: Vec<usize>,
    },
    /// Hyper-parameters that make no sense together.
    #[error("bad hyper-parameters: {why}")]
    Hparams {
        /// What is wrong.
        why: String,
    },
    /// A request the model cannot serve (empty prompt, context too long).
    #[error("{why}")]
    Request {
        /// What is wrong.
        why: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
