//! GGUF model files: read them memory-mapped, present split sets as one model, write new ones.
//!
//! GGUF (ggml's file format, `ggml/src/gguf.cpp` at llama.cpp 0c1e570) is a header of typed
//! key-value metadata and tensor infos followed by an aligned data section. [`GgufModel::open`]
//! parses and validates the header of every part and maps the files; tensor bytes are borrowed
//! straight from the map ([`TensorView::data`]), so loading copies nothing and a model larger than
//! RAM can be opened.
//!
//! Validation happens once, at open: every tensor's bytes lie inside its file, tensors do not
//! overlap, shapes have no zero dimension, no overflowing product and whole quantization blocks,
//! types are known. After that, access is infallible but for missing names.
//!
//! # Examples
//! ```no_run
//! let model = gguf::GgufModel::open("model.gguf")?;
//! let n_layer = model.metadata().u32("llama.block_count")?;
//! let emb = model.tensor("token_embd.weight")?;
//! println!("{n_layer} layers, embedding {:?} {}", emb.shape(), emb.dtype());
//! # Ok::<(), gguf::GgufError>(())
//! ```
#![deny(missing_docs)]

mod dtype;
mod error;
mod model;
pub mod names;
mod reader;
mod value;
mod writer;

pub use dtype::{GgmlType, ALL_TYPES};
pub use error::{GgufError, Result};
pub use model::{
    split_name_parts, split_path, GgufModel, TensorView, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT,
};
pub use reader::{tensor_size, GgufFile, TensorInfo, DEFAULT_ALIGNMENT, MAX_DIMS};
pub use value::{Metadata, Value, ValueType};
pub use writer::{GgufWriter, TensorDataSink};
