use std::path::PathBuf;

/// What went wrong reading or writing a GGUF file. Every variant names the key, tensor or offset
/// and the numbers involved; [`GgufError::InFile`] adds the file's path once, at the outermost layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The error happened in this file.
    #[error("{}: {source}", path.display())]
    InFile {
        /// The file being read or written.
        path: PathBuf,
        /// What went wrong there.
        #[source]
        source: Box<GgufError>,
    },
    /// An operating-system error (open, mmap, write).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// A version other than 2 or 3.
    #[error("unsupported GGUF version {version}: diskformer reads versions 2 and 3")]
    UnsupportedVersion {
        /// The version in the header.
        version: u32,
    },
    /// The header ends before a field that it promises.
    #[error("truncated header: {what} at byte {offset} needs {need} bytes, the file has {file_len}")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        need: u64,
        /// The file's length.
        file_len: u64,
    },
    /// A metadata value type id outside 0..=12.
    #[error("metadata key {key:?}: unknown value type {type_id}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The type id found.
        type_id: u32,
    },
    /// A string that is not UTF-8.
    #[error("{what}: string at byte {offset} is not valid UTF-8")]
    BadString {
        /// Which string.
        what: String,
        /// Where it starts.
        offset: u64,
    },
    /// The same key twice.
    #[error("metadata key {key:?} appears twice")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// A required key is absent.
    #[error("metadata key {key:?} is missing")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A key holds a value of another type than the reader needs.
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// What the reader wanted.
        expected: &'static str,
        /// What the file has.
        found: String,
    },
    /// `general.alignment` is zero or not a power of two.
    #[error("general.alignment is {alignment}: it must be a power of two")]
    BadAlignment {
        /// The value found.
        alignment: u64,
    },
    /// A tensor type id ggml does not define.
    #[error("tensor {tensor:?}: unknown tensor type id {type_id}")]
    UnknownTensorType {
        /// The tensor.
        tensor: String,
        /// The type id.
        type_id: u32,
    },
    /// A tensor with a bad shape: too many dimensions, a zero, an overflowing product, or a row
    /// that is not a whole number of blocks.
    #[error("tensor {tensor:?}: bad shape {shape:?}: {why}")]
    BadShape {
        /// The tensor.
        tensor: String,
        /// Its dimensions, ne0 first.
        shape: Vec<u64>,
        /// What is wrong.
        why: String,
    },
    /// A tensor whose data lies (partly) past the end of the file.
    #[error("tensor {tensor:?}: data at bytes {start}..{end} runs past the end of the file ({file_len} bytes)")]
    DataPastEnd {
        /// The tensor.
        tensor: String,
        /// First byte (absolute).
        start: u64,
        /// One past the last byte (absolute).
        end: u64,
        /// The file's length.
        file_len: u64,
    },
    /// A tensor offset that is not a multiple of the alignment.
    #[error("tensor {tensor:?}: data offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        /// The tensor.
        tensor: String,
        /// Its offset relative to the data section.
        offset: u64,
        /// `general.alignment`.
        alignment: u64,
    },
    /// Two tensors whose bytes overlap.
    #[error("tensors {first:?} (bytes {first_start}..{first_end}) and {second:?} (from byte {second_start}) overlap")]
    OverlappingTensors {
        /// The tensor that starts first.
        first: String,
        /// Its start (relative to the data section).
        first_start: u64,
        /// Its end.
        first_end: u64,
        /// The tensor that starts inside it.
        second: String,
        /// Its start.
        second_start: u64,
    },
    /// The same tensor name twice (in one file or across a split set).
    #[error("tensor {tensor:?} appears twice")]
    DuplicateTensor {
        /// The name.
        tensor: String,
    },
    /// A tensor that a reader asked for by name is absent.
    #[error("tensor {tensor:?} is missing")]
    MissingTensor {
        /// The name.
        tensor: String,
    },
    /// A split set that is incomplete or inconsistent.
    #[error("split set: {why}")]
    BadSplit {
        /// What is wrong.
        why: String,
    },
    /// A writer was used wrongly (sizes that do not match the declared tensor).
    #[error("writer: {why}")]
    Writer {
        /// What is wrong.
        why: String,
    },
}

impl GgufError {
    /// Wraps this error with the path of the file it happened in (once: an error that already
    /// names a file is returned as is).
    pub fn in_file(self, path: impl Into<PathBuf>) -> GgufError {
        match self {
            e @ GgufError::InFile { .. } => e,
            e => GgufError::InFile { path: path.into(), source: Box::new(e) },
        }
    }

    /// The innermost error, without the file layer.
    pub fn kind(&self) -> &GgufError {
        match self {
            GgufError::InFile { source, .. } => source.kind(),
            e => e,
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
