//! Tokenizers and chat templates read from GGUF metadata, giving llama.cpp's token ids.
//!
//! [`Tokenizer::from_gguf`] builds a tokenizer from `tokenizer.ggml.*`: byte-level BPE (`gpt2`, with
//! the pre-tokenizer named by `tokenizer.ggml.pre`), SentencePiece-style BPE (`llama`, with byte
//! fallback) or BERT's WordPiece (`bert`, for encoder embedding models). [`Tokenizer::encode`] follows llama.cpp's `llama_tokenize` (special-token parsing,
//! BOS/EOS per the model's flags), [`Tokenizer::token_to_piece`] its `llama_token_to_piece`, and
//! [`StreamDecoder`] turns generated ids into valid UTF-8 deltas. [`ChatTemplate`] renders
//! `tokenizer.chat_template` with minijinja the way HF `transformers` renders it with Jinja2.
//!
//! # Examples
//! ```no_run
//! let model = gguf::GgufModel::open("model.gguf")?;
//! let tokenizer = tokenizer::Tokenizer::from_gguf(model.metadata())?;
//! let ids = tokenizer.encode("Hello world", true, true)?;
//! assert_eq!(tokenizer.decode(&ids), "Hello world");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Design
//! The reference is llama.cpp (src/llama-vocab.cpp, src/unicode.cpp at 0c1e570), not HF
//! `tokenizers`: engines are compared by ids and logits against llama.cpp, and the two disagree on
//! edge cases (how special tokens split text, which regex engine splits words). So the BPE core,
//! the hand-written GPT-2/Llama 3 splitters and the "collapsed text" trick for the other regexes are
//! ported rule by rule rather than delegated to the `tokenizers` crate. Encoding memoizes BPE per
//! word within a call, which makes large inputs cheap (most words repeat).

#![deny(missing_docs)]

mod bpe;
mod chat;
mod error;
mod fxhash;
mod pretok;
mod spm;
mod stream;
mod tokenizer;
mod unicode;
mod vocab;
mod wpm;

pub use chat::{ChatMessage, ChatOptions, ChatTemplate};
pub use error::{TemplateError, TokenizerError};
pub use stream::StreamDecoder;
pub use tokenizer::Tokenizer;
