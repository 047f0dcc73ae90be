//! Errors of the tokenizer crate.

/// Why a tokenizer could not be built or could not encode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A metadata key was missing or had the wrong type.
    #[error("tokenizer metadata: {0}")]
    Gguf(#[from] gguf::GgufError),
    /// `tokenizer.ggml.model` names a tokenizer we do not implement.
    #[error("unsupported tokenizer model '{model}' (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")]
    UnsupportedModel {
        /// The value of `tokenizer.ggml.model`.
        model: String,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer we do not know.
    #[error("unknown pre-tokenizer type '{pre}' in tokenizer.ggml.pre")]
    UnknownPreTokenizer {
        /// The value of `tokenizer.ggml.pre`.
        pre: String,
    },
    /// A per-token array is shorter than the token list.
    #[error("{key} has {got} entries but the vocabulary has {n_vocab} tokens")]
    ArrayTooShort {
        /// The metadata key.
        key: &'static str,
        /// Its number of entries.
        got: usize,
        /// Number of tokens in `tokenizer.ggml.tokens`.
        n_vocab: usize,
    },
    /// Two ids have the same token text.
    #[error("duplicate token in vocabulary: {text:?} has ids {first} and {second}")]
    DuplicateToken {
        /// The token text.
        text: String,
        /// The first id.
        first: u32,
        /// The second id.
        second: u32,
    },
    /// The model asks for BOS/EOS to be added but has no such token.
    #[error("{flag_key} is true, but {id_key} is not set")]
    MissingSpecialToken {
        /// The `add_*_token` key.
        flag_key: &'static str,
        /// The key of the id.
        id_key: &'static str,
    },
    /// A WordPiece (BERT) vocabulary without a separator id to close a text with.
    #[error(
        "a WordPiece vocabulary needs a separator token: tokenizer.ggml.seperator_token_id is not set \
         and the default id 102 is outside the {n_vocab}-token vocabulary"
    )]
    MissingSeparator {
        /// Tokens in the vocabulary.
        n_vocab: usize,
    },
    /// A pre-tokenizer regex does not compile.
    #[error("pre-tokenizer regex {regex:?} does not compile: {reason}")]
    BadRegex {
        /// The regex as llama.cpp writes it.
        regex: String,
        /// The compiler's message.
        reason: String,
    },
    /// A pre-tokenizer regex failed while matching (backtracking limit).
    #[error("pre-tokenizer regex failed on the input: {reason}")]
    RegexFailed {
        /// The matcher's message.
        reason: String,
    },
    /// The vocabulary is empty.
    #[error("tokenizer.ggml.tokens is empty")]
    EmptyVocabulary,
}

/// Why a chat template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// `tokenizer.chat_template` has the wrong type.
    #[error("chat template metadata: {0}")]
    Gguf(#[from] gguf::GgufError),
    /// The template does not parse.
    #[error("chat template does not compile: {0:#}")]
    Compile(minijinja::Error),
    /// Rendering failed, including a `raise_exception(...)` from the template itself.
    #[error("chat template failed to render: {0:#}")]
    Render(minijinja::Error),
    /// A message could not be converted to a template value.
    #[error("chat message {index} is not a JSON object with a string 'role'")]
    BadMessage {
        /// The position of the message.
        index: usize,
    },
}
