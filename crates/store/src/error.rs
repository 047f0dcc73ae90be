//! The store's one error type.

use std::path::PathBuf;

/// Everything that can go wrong pulling, listing, adding, removing or resolving a model.
///
/// Messages are one line, lower case, name the input and the numbers, and end with the fix
/// when there is one. Download errors say whether the partial file was kept (so the same
/// command resumes) or removed (because its bytes cannot be trusted).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The hub (or the host it redirected to) could not be reached at all.
    #[error("cannot reach {url}: {reason}; check the network connection or HF_ENDPOINT")]
    NoNetwork {
        /// The URL that failed.
        url: String,
        /// What the HTTP client said.
        reason: String,
    },
    /// HTTP 404: the repo, revision or file does not exist (or is private and no token was sent).
    #[error("{what} not found (HTTP 404 from {url}){hint}")]
    NotFound {
        /// What was asked for, e.g. `file model.gguf in owner/repo at main`.
        what: String,
        /// The URL that answered 404.
        url: String,
        /// Extra advice, empty or starting with "; ".
        hint: String,
    },
    /// HTTP 401 or 403: the hub refused the request.
    #[error("access to {what} refused (HTTP {status} from {url}); {advice}")]
    Unauthorized {
        /// What was asked for.
        what: String,
        /// 401 or 403.
        status: u16,
        /// The URL that refused.
        url: String,
        /// What to do about it (set HF_TOKEN, accept the licence, ...).
        advice: String,
    },
    /// Another HTTP status the store cannot act on.
    #[error("unexpected HTTP {status} from {url}: {body}")]
    Http {
        /// The status code.
        status: u16,
        /// The URL.
        url: String,
        /// The start of the response body, for the hub's explanation.
        body: String,
    },
    /// The hub answered, but not in a form the store understands (missing size, bad JSON, ...).
    #[error("unexpected answer from {url}: {why}")]
    BadResponse {
        /// The URL.
        url: String,
        /// What was wrong with it.
        why: String,
    },
    /// The server answered a ranged request with the whole file, so chunks cannot be fetched.
    #[error("{url} ignores HTTP Range requests (answered {status} to `Range: bytes={start}-`); a resumable download needs them")]
    RangeNotSupported {
        /// The URL.
        url: String,
        /// The status it answered.
        status: u16,
        /// The first byte asked for.
        start: u64,
    },
    /// The transfer kept failing after retries; the partial file is kept for the next run.
    #[error("download of {file} stopped after {attempts} attempts: {reason}; the partial file {partial} is kept: run the same command again to resume")]
    Interrupted {
        /// The file being fetched (its path in the repo).
        file: String,
        /// How many attempts were made for the failing chunk.
        attempts: u32,
        /// The last failure.
        reason: String,
        /// Where the partial file is.
        partial: PathBuf,
    },
    /// Not enough free space for the bytes still to be fetched.
    #[error("not enough disk space in {dir}: {need_bytes} bytes still to download, {available_bytes} available; free some space or point --store / DISKFORMER_STORE elsewhere (the partial file is kept)")]
    DiskFull {
        /// The directory the file goes to.
        dir: PathBuf,
        /// Bytes still to write.
        need_bytes: u64,
        /// Bytes the file system says are available.
        available_bytes: u64,
    },
    /// The whole file was fetched but its digest is not the one the hub publishes.
    #[error("checksum mismatch for {file}: the hub publishes {algorithm} {expected}, the downloaded bytes hash to {actual}; the partial file was removed, run the command again to download afresh")]
    ChecksumMismatch {
        /// The file (its path in the repo, or a local path).
        file: String,
        /// `sha256` or `git-sha1`.
        algorithm: &'static str,
        /// The published digest (hex).
        expected: String,
        /// The digest of what arrived (hex).
        actual: String,
    },
    /// Two sources disagree on a file's size (listing vs HEAD, HEAD vs Content-Range, file vs manifest).
    #[error("size mismatch for {file}: expected {expected_bytes} bytes, {source_desc} says {actual_bytes}")]
    SizeMismatch {
        /// The file.
        file: String,
        /// What the store expected.
        expected_bytes: u64,
        /// What was found.
        actual_bytes: u64,
        /// Where the other number came from.
        source_desc: String,
    },
    /// The hub published no digest the store can verify the file against.
    #[error("{url} publishes no sha256 (X-Linked-Etag) or git blob id (ETag) for {file}, so it cannot be verified; refusing to store an unverified file")]
    NoChecksum {
        /// The file.
        file: String,
        /// The resolve URL.
        url: String,
    },
    /// A chunk read back from disk kept failing its recorded digest after being fetched again.
    #[error("chunk {chunk_index} (bytes {offset}..{end}) of {partial} still reads back wrong after {attempts} fetches; the disk may be failing")]
    Corruption {
        /// The partial file.
        partial: PathBuf,
        /// The chunk number.
        chunk_index: usize,
        /// First byte of the chunk.
        offset: u64,
        /// One past its last byte.
        end: u64,
        /// How many times it was fetched.
        attempts: u32,
    },
    /// Another process is downloading the same file into the same store.
    #[error("{partial} is being downloaded by another process (it holds the lock); wait for it or stop it")]
    Busy {
        /// The partial file that is locked.
        partial: PathBuf,
    },
    /// The observer asked to stop; the partial file is kept.
    #[error("download cancelled; the partial file is kept: run the same command again to resume")]
    Cancelled,
    /// The repo has no GGUF file.
    #[error("{repo} at {revision} has no .gguf file")]
    NoGguf {
        /// The repo.
        repo: String,
        /// The revision.
        revision: String,
    },
    /// No GGUF of the repo matches the quant asked for.
    #[error("no GGUF in {repo} matches {quant:?}; available: {}", available.join(", "))]
    NoMatchingQuant {
        /// The repo.
        repo: String,
        /// What was asked for.
        quant: String,
        /// The quants (or file names) the repo has.
        available: Vec<String>,
    },
    /// Several GGUF sets match; the user must name one.
    #[error("{repo} has several GGUFs{for_quant}: {}; name the file: diskformer pull {repo} FILE", candidates.join(", "))]
    AmbiguousQuant {
        /// The repo.
        repo: String,
        /// ` matching "Q4_K_M"`, or empty when no quant was given.
        for_quant: String,
        /// The matching files (first part of each set).
        candidates: Vec<String>,
    },
    /// A repo id that is not `owner/name` (or a bare `name`).
    #[error("{repo:?} is not a repo id; expected OWNER/NAME, e.g. Qwen/Qwen3-0.6B-GGUF")]
    BadRepoId {
        /// What was given.
        repo: String,
    },
    /// A model argument that is neither an existing path nor a store name.
    #[error("no file and no store model named {name:?} (store {store}{known}); pull it with `diskformer pull OWNER/REPO QUANT` or give a path")]
    ModelNotFound {
        /// The argument.
        name: String,
        /// The store searched.
        store: PathBuf,
        /// `: has a, b` or `: empty`.
        known: String,
    },
    /// A short store name that fits several models.
    #[error("{name:?} matches several store models: {}; use the full name", candidates.join(", "))]
    AmbiguousName {
        /// The argument.
        name: String,
        /// The full names it fits.
        candidates: Vec<String>,
    },
    /// `models add` with a name already in use.
    #[error("the store already has a model named {name:?}; remove it first (diskformer models rm {name}) or pick another --name")]
    NameTaken {
        /// The name.
        name: String,
    },
    /// A store name with characters the store does not allow.
    #[error("{name:?} is not a valid model name: {why}")]
    BadName {
        /// The name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// A model's manifest lists a file that is gone.
    #[error("model {name:?} lists {path}, which is missing ({reason}); pull or add it again")]
    MissingFile {
        /// The model.
        name: String,
        /// The file.
        path: PathBuf,
        /// Why it counts as missing.
        reason: String,
    },
    /// A manifest that cannot be read.
    #[error("bad manifest {path}: {why}")]
    BadManifest {
        /// The manifest.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A local file given to `models add` that is not a readable GGUF.
    // The reader's errors already name the file.
    #[error("not a usable GGUF model: {source}")]
    NotGguf {
        /// The file.
        path: PathBuf,
        /// The reader's complaint.
        #[source]
        source: gguf::GgufError,
    },
    /// A file-system operation failed.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// The operation (`create`, `write`, `rename`, ...).
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Wraps an `io::Error` with the operation and path, or reports a full disk as such.
pub(crate) fn io_err(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.into();
    move |source| StoreError::Io { what, path, source }
}

/// True when an I/O error means the file system is full (ENOSPC or EDQUOT).
#[cfg(unix)]
pub(crate) fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// True when an I/O error means the file system is full.
#[cfg(not(unix))]
pub(crate) fn is_disk_full(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn a_full_device_reads_as_disk_full() {
        use std::io::Write;
        // /dev/full answers every write with ENOSPC.
        let mut f = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        let e = f.write_all(&[0u8; 4096]).and_then(|_| f.flush()).unwrap_err();
        assert!(super::is_disk_full(&e), "{e}");
        assert!(!super::is_disk_full(&std::io::Error::from(std::io::ErrorKind::PermissionDenied)));
    }
}
