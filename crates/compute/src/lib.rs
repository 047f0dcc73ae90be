//! Tensors, the op set every model is written against, quantized tensor types, and back ends.
#![deny(missing_docs)]

pub mod quant;
