//! [`PlanError`]: every way describing, planning, loading or running can fail, each with a code.

use std::path::PathBuf;

/// Why a call of this crate failed. [`PlanError::code`] gives a stable short code for programs
/// (the CLI prints `error[code]: message`, the server maps codes to HTTP statuses).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The chosen back end needs more memory than the budget allows.
    #[error("{what} budget too small: need {} but the budget is {}; {fix}", crate::bytes::format_bytes(*need_bytes), crate::bytes::format_bytes(*budget_bytes))]
    BudgetTooSmall {
        /// Which budget (`gpu`, `ram`, `disk`).
        what: &'static str,
        /// Bytes the back end needs.
        need_bytes: u64,
        /// Bytes the budget allows.
        budget_bytes: u64,
        /// How to make it fit.
        fix: String,
    },
    /// `general.architecture` is not one diskformer runs.
    #[error("architecture {arch:?} is not supported; supported: {supported}")]
    UnsupportedArchitecture {
        /// The architecture of the model.
        arch: String,
        /// The supported ones.
        supported: String,
    },
    /// A file that cannot be read as what it claims to be.
    #[error("{}: {why}", path.display())]
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The GGUF reader refused a file (it names the file).
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    /// No device of the kind asked for.
    #[error("no device: {why}")]
    NoDevice {
        /// What is missing, and the fix.
        why: String,
    },
    /// No back end can run the model on this machine within the budgets.
    #[error("no back end can run {model}: {reasons}")]
    NoBackend {
        /// The model's path.
        model: String,
        /// Each back end's reason, `name: reason; ...`.
        reasons: String,
    },
    /// A path that is not a model (no GGUF, no config.json).
    #[error("{}: {why}", path.display())]
    NotAModel {
        /// The path given.
        path: PathBuf,
        /// What was found instead.
        why: String,
    },
    /// A byte size that does not parse (`4G`, `512M`, `2.5GiB` do).
    #[error("bad byte size {text:?}: {why} (examples: 4G, 512M, 2.5GiB, 1000000)")]
    BadSize {
        /// The text given.
        text: String,
        /// What is wrong.
        why: String,
    },
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] models::ModelError),
    /// The tokenizer could not be built or could not encode.
    #[error(transparent)]
    Tokenizer(#[from] tokenizer::TokenizerError),
    /// The chat template failed to render.
    #[error(transparent)]
    Template(#[from] tokenizer::TemplateError),
    /// A request the session cannot serve (no chat template, prompt longer than the context).
    #[error("{why}")]
    Request {
        /// What is wrong, and the fix.
        why: String,
    },
    /// An operating-system error on a path.
    #[error("{}: {what}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The session's engine thread is gone (it panicked, or the session was dropped).
    #[error("the session's engine thread has stopped")]
    SessionClosed,
    /// The expert cache or the GPU expert tier's placement refused the model (a GPU budget too
    /// small carries the bytes needed: [`pager::PagerError::GpuBudgetTooSmall`]).
    #[error(transparent)]
    Pager(#[from] pager::PagerError),
    /// The GPU back end could not build the expert tier.
    #[error("{model}: the GPU expert tier: {why}")]
    GpuTier {
        /// The model file.
        model: String,
        /// What the back end said.
        why: String,
    },
}

impl PlanError {
    /// A stable short code: `budget`, `architecture`, `bad_file`, `no_device`, `no_backend`,
    /// `not_a_model`, `bad_size`, `model`, `tokenizer`, `template`, `request`, `io`, `closed`,
    /// `pager` (a GPU budget too small for the expert tier: `budget`), `gpu_tier`.
    pub fn code(&self) -> &'static str {
        match self {
            PlanError::BudgetTooSmall { .. } => "budget",
            PlanError::UnsupportedArchitecture { .. } => "architecture",
            PlanError::BadFile { .. } | PlanError::Gguf(_) => "bad_file",
            PlanError::NoDevice { .. } => "no_device",
            PlanError::NoBackend { .. } => "no_backend",
            PlanError::NotAModel { .. } => "not_a_model",
            PlanError::BadSize { .. } => "bad_size",
            PlanError::Model(models::ModelError::UnsupportedArchitecture { .. }) => "architecture",
            PlanError::Model(_) => "model",
            PlanError::Tokenizer(_) => "tokenizer",
            PlanError::Template(_) => "template",
            PlanError::Request { .. } => "request",
            PlanError::Io { .. } => "io",
            PlanError::SessionClosed => "closed",
            PlanError::Pager(pager::PagerError::GpuBudgetTooSmall { .. }) => "budget",
            PlanError::Pager(_) => "pager",
            PlanError::GpuTier { .. } => "gpu_tier",
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = PlanError> = std::result::Result<T, E>;
