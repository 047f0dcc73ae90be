//! The local model store: pull GGUF models from a Hugging Face-compatible hub, resumably and
//! verified; add local files; list and remove; turn a model argument into a file path.
//!
//! Main types: [`Store`] (a store folder: [`Store::pull`], [`Store::list`],
//! [`Store::add_local`], [`Store::remove`], [`Store::resolve`]), [`Hub`] (the HTTP client for
//! one endpoint), [`DownloadOptions`], [`PullObserver`] (progress callbacks), [`StoreError`].
//! Other crates call [`resolve_model`] so that `run`, `plan` and `serve` take store names as
//! well as paths. The on-disk layout is in `docs/STORE.md`.
//!
//! # Design: a file never has its final name before it is verified
//!
//! A model of 20 to 200 GB arrives over hours and a flaky connection, and a half file that
//! later loads as garbage is worse than no file. So a download goes to `NAME.partial`, in
//! fixed-size chunks fetched by several ranged requests at once, each written at its own
//! offset. A journal beside it (`NAME.partial.chunks`) records a chunk only after its bytes are
//! `fdatasync`ed, with the sha256 of what arrived, so a SIGKILL or power cut at any instant
//! loses at most the chunks in flight. A verifier thread follows the connections, reads each
//! journaled chunk back, checks it, and feeds it to the whole-file sha256 (so the final hash is
//! ready when the last byte lands); a chunk that reads back wrong (a damaged partial) is
//! fetched again. Only when the whole file's sha256 equals the one the hub publishes
//! (`X-Linked-Etag`, or the listing's LFS oid) is it renamed to `NAME`, and only when every
//! file of a model is in place is the model's manifest written.
//!
//! Which errors keep the partial: all but a checksum mismatch of the complete file (whose bytes
//! are wrong in a way no chunk record can locate, so it is removed and the next run starts
//! afresh). Network failures are retried with backoff, resuming inside the chunk.
//!
//! # Examples
//! ```
//! use gguf::{GgmlType, GgufWriter, Value};
//! let dir = tempfile::tempdir().unwrap();
//! let file = dir.path().join("tiny.gguf");
//! let mut w = GgufWriter::new();
//! w.set("general.architecture", Value::String("llama".into()));
//! w.add_tensor("x", GgmlType::F32, &[4]).unwrap();
//! let mut sink = w.create(&file).unwrap();
//! sink.write_data(&[0u8; 16]).unwrap();
//! sink.finish().unwrap();
//!
//! let store = store::Store::open(dir.path().join("store"));
//! store.add_local(&file, Some("tiny"), store::AddMode::Reference)?;
//! let path = store::resolve_model("tiny", Some(store.root()))?;
//! assert_eq!(path, file.canonicalize().unwrap());
//! // A path that exists is returned as it is.
//! assert_eq!(store::resolve_model(file.to_str().unwrap(), Some(store.root()))?, file);
//! # Ok::<(), store::StoreError>(())
//! ```
#![deny(missing_docs)]

mod describe;
mod download;
mod error;
#[cfg(feature = "fake-hub")]
pub mod fake_hub;
mod hub;
mod layout;
mod select;
mod store;

pub use describe::{file_type_name, quant_of};
pub use download::{journal_path, partial_path, verified_path, DownloadOptions, PullObserver, Quiet};
pub use error::{Result, StoreError};
pub use hub::{Digest, FileMeta, Hub, HubConfig, RepoFile, RepoId, DEFAULT_ENDPOINT};
pub use layout::{check_name, default_store_dir, Manifest, ManifestFile, ModelSource};
pub use select::{
    expand_split, path_has_quant, quant_in_name, select, stem_tag, tag_for, Selection, Want, DEFAULT_QUANT,
};
pub use store::{AddMode, Listing, ModelInfo, PullOutcome, PullRequest, Removed, Store};

use std::path::{Path, PathBuf};

/// The GGUF file a model argument means: `arg` itself when it is an existing path, else the
/// first file of the store model it names (`owner/repo:Q4_K_M`, or a shorter form that fits
/// one model). `store_dir` `None` means [`default_store_dir`] (`DISKFORMER_STORE`, else the
/// XDG cache folder).
///
/// This is what `run`, `plan` and `serve` call on their model argument.
///
/// # Errors
/// [`StoreError::ModelNotFound`] (naming the store and what it holds),
/// [`StoreError::AmbiguousName`], [`StoreError::MissingFile`], or the error of
/// [`default_store_dir`].
pub fn resolve_model(arg: &str, store_dir: Option<&Path>) -> Result<PathBuf, StoreError> {
    if Path::new(arg).exists() {
        return Ok(PathBuf::from(arg));
    }
    let store = match store_dir {
        Some(d) => Store::open(d),
        None => Store::open_default()?,
    };
    store.resolve(arg)
}
