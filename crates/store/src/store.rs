//! The store: pull, list, add, remove, resolve.

use crate::describe::{architecture_of, quant_of};
use crate::download::{self, already_verified, DownloadOptions, PullObserver, Source, Target};
use crate::error::{io_err, Result, StoreError};
use crate::hub::{Digest, FileMeta, Hub, RepoId};
use crate::layout::{check_name, check_repo_path, default_store_dir, Layout, Manifest, ManifestFile, ModelSource};
use crate::select::{select, Selection, Want};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A model store folder. Creating one does no I/O; folders appear when first written.
#[derive(Clone, Debug)]
pub struct Store {
    layout: Layout,
}

/// What to pull.
#[derive(Clone, Debug)]
pub struct PullRequest {
    /// `owner/repo`, or `owner/repo:QUANT` when `want` is [`Want::Default`].
    pub repo: String,
    /// A file, a quant, or nothing.
    pub want: Want,
    /// Branch, tag or commit (`main`).
    pub revision: String,
}

/// The result of a pull.
#[derive(Clone, Debug)]
pub struct PullOutcome {
    /// The model's store name (`owner/repo:Q4_K_M`).
    pub name: String,
    /// Its files in part order.
    pub files: Vec<PathBuf>,
    /// Total size.
    pub size_bytes: u64,
    /// How many files were fetched (the others were already in the store, verified).
    pub n_downloaded: usize,
}

/// One model as `models list` shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelInfo {
    /// Store name.
    pub name: String,
    /// Files, in part order.
    pub files: Vec<PathBuf>,
    /// Total size.
    pub size_bytes: u64,
    /// Quant (`general.file_type`, else the dominant tensor type).
    pub quant: Option<String>,
    /// `general.architecture`.
    pub architecture: Option<String>,
    /// Where it came from.
    pub source: ModelSource,
}

/// `models list`: the models, and what could not be read (listed after, not fatal).
#[derive(Debug, Default)]
pub struct Listing {
    /// The readable models, by name.
    pub models: Vec<ModelInfo>,
    /// Each problem: the model name (or manifest path) and the error.
    pub problems: Vec<(String, StoreError)>,
}

/// How `models add` brings a file in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddMode {
    /// Copy into the store (verified copy, survives the original being moved or deleted).
    Copy,
    /// Record the original's path (no space used; breaks if the original moves).
    Reference,
}

/// What `models rm` did.
#[derive(Clone, Debug)]
pub struct Removed {
    /// The model's name.
    pub name: String,
    /// Files deleted (a referenced local file, or one another model shares, is kept).
    pub deleted: Vec<PathBuf>,
    /// Bytes freed.
    pub freed_bytes: u64,
}

fn now_unix_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl Store {
    /// The store in `root`.
    pub fn open(root: impl Into<PathBuf>) -> Store {
        Store { layout: Layout { root: root.into() } }
    }

    /// The store in [`default_store_dir`].
    ///
    /// # Errors
    /// As [`default_store_dir`].
    pub fn open_default() -> Result<Store> {
        Ok(Store::open(default_store_dir()?))
    }

    /// The folder.
    pub fn root(&self) -> &Path {
        &self.layout.root
    }

    /// Pulls `req` from `hub` into the store and records it under `owner/repo:TAG`.
    ///
    /// Every file's size and digest are asked for before any byte is fetched, so a missing
    /// part or a refused token shows at once; each file is then downloaded with
    /// `opts.connections` ranged requests, verified, and renamed into place. Files already
    /// in the store and verified against the same digest are not fetched again.
    ///
    /// # Errors
    /// Any [`StoreError`] of the hub or the download; see the crate docs for which keep the
    /// partial file.
    pub fn pull(
        &self,
        hub: &Hub,
        req: &PullRequest,
        opts: &DownloadOptions,
        obs: &dyn PullObserver,
    ) -> Result<PullOutcome> {
        // `owner/repo:QUANT`, but not the colon of `https://`.
        let tag_split = req.repo.rsplit_once(':').filter(|(_, q)| !q.contains('/'));
        let (repo_str, want) = match (&req.want, tag_split) {
            (Want::Default, Some((r, q))) => (r.to_string(), Want::parse(Some(q))),
            _ => (req.repo.clone(), req.want.clone()),
        };
        let repo = RepoId::from_user(&repo_str)?;
        let revision = req.revision.as_str();
        let (listing, Selection { paths, tag }) = match &want {
            Want::File(_) => (None, select(repo.as_str(), revision, &[], &want)?),
            _ => {
                let files = hub.list_files(&repo, revision)?;
                let sel = select(repo.as_str(), revision, &files, &want)?;
                (Some(files), sel)
            }
        };
        let name = format!("{repo}:{tag}");
        check_name(&name)?;

        let mut metas: Vec<FileMeta> = Vec::with_capacity(paths.len());
        for p in &paths {
            check_repo_path(&hub.resolve_url(&repo, revision, p), p)?;
            let mut meta = hub.file_meta(&repo, revision, p)?;
            if let Some(listed) = listing.as_ref().and_then(|l| l.iter().find(|f| &f.path == p)) {
                if listed.size_bytes != meta.size_bytes {
                    return Err(StoreError::SizeMismatch {
                        file: p.clone(),
                        expected_bytes: listed.size_bytes,
                        actual_bytes: meta.size_bytes,
                        source_desc: "the HEAD of its resolve URL (the listing said otherwise)".into(),
                    });
                }
                match (&listed.sha256, &meta.digest) {
                    (Some(l), Digest::Sha256(h)) if l != h => {
                        return Err(StoreError::BadResponse {
                            url: hub.resolve_url(&repo, revision, p),
                            why: format!("the listing gives sha256 {l} but the file's ETag says {h}"),
                        })
                    }
                    (Some(l), Digest::GitSha1(_)) => meta.digest = Digest::Sha256(l.clone()),
                    _ => {}
                }
            }
            metas.push(meta);
        }

        // Fail before the first byte when the whole set cannot fit.
        let dests: Vec<PathBuf> = paths.iter().map(|p| self.layout.hub_file(repo.as_str(), p)).collect();
        let need_bytes: u64 = metas
            .iter()
            .zip(&dests)
            .filter(|(m, d)| !already_verified(d, &m.digest, m.size_bytes))
            .map(|(m, d)| m.size_bytes.saturating_sub(download::journaled_bytes(d, m.size_bytes, &m.digest)))
            .sum();
        let dir = dests[0].parent().unwrap_or(self.root()).to_path_buf();
        std::fs::create_dir_all(&dir).map_err(io_err("create directory", &dir))?;
        if let Some(available_bytes) = download::available_space(&dir) {
            if available_bytes < need_bytes {
                return Err(StoreError::DiskFull { dir, need_bytes, available_bytes });
            }
        }

        let mut n_downloaded = 0;
        for (meta, dest) in metas.iter().zip(&dests) {
            let refresh = || hub.file_meta(&repo, revision, &meta.path).map(|m| m.download_url);
            let src = Source { hub, url: Mutex::new(meta.download_url.clone()), refresh: &refresh };
            let t = Target { repo_path: &meta.path, dest, size_bytes: meta.size_bytes, digest: &meta.digest };
            if download::download(&t, &src, opts, obs)? {
                n_downloaded += 1;
            }
        }

        let manifest = Manifest {
            name: name.clone(),
            source: ModelSource::Hub {
                endpoint: hub.endpoint().to_string(),
                repo: repo.to_string(),
                revision: revision.to_string(),
                commit: metas[0].commit.clone(),
            },
            files: metas
                .iter()
                .zip(&dests)
                .map(|(m, d)| ManifestFile {
                    path: self.layout.record_path(d),
                    size_bytes: m.size_bytes,
                    digest: Some(format!("{}:{}", m.digest.algorithm(), m.digest.hex())),
                })
                .collect(),
            added_unix_s: now_unix_s(),
        };
        self.layout.write_manifest(&manifest)?;
        Ok(PullOutcome { name, size_bytes: manifest.size_bytes(), files: dests, n_downloaded })
    }

    /// Every model with its architecture and quant (read from the first file's header).
    /// A model whose manifest or files cannot be read goes to `problems`; the rest still list.
    pub fn list(&self) -> Listing {
        let (manifests, bad) = self.layout.all_manifests();
        let mut out = Listing::default();
        for (p, e) in bad {
            out.problems.push((p.display().to_string(), e));
        }
        for m in manifests {
            let files: Vec<PathBuf> = m.files.iter().map(|f| self.layout.file_path(f)).collect();
            match self.check_files(&m).and_then(|_| {
                gguf::GgufModel::open(&files[0])
                    .map_err(|source| StoreError::NotGguf { path: files[0].clone(), source })
            }) {
                Ok(model) => out.models.push(ModelInfo {
                    name: m.name.clone(),
                    size_bytes: m.size_bytes(),
                    quant: quant_of(&model),
                    architecture: architecture_of(&model),
                    source: m.source.clone(),
                    files,
                }),
                Err(e) => out.problems.push((m.name.clone(), e)),
            }
        }
        out
    }

    /// Checks that every file of a manifest exists with its recorded size.
    fn check_files(&self, m: &Manifest) -> Result<()> {
        for f in &m.files {
            let p = self.layout.file_path(f);
            let reason = match std::fs::metadata(&p) {
                Ok(md) if md.len() == f.size_bytes => continue,
                Ok(md) => format!("{} bytes instead of {}", md.len(), f.size_bytes),
                Err(e) => e.to_string(),
            };
            return Err(StoreError::MissingFile { name: m.name.clone(), path: p, reason });
        }
        Ok(())
    }

    /// The manifest `arg` names: its exact name, or a shorter form that fits one model only
    /// (`owner/repo` for `owner/repo:TAG`, `repo:TAG`, `repo`).
    ///
    /// # Errors
    /// [`StoreError::ModelNotFound`] (listing what the store has), [`StoreError::AmbiguousName`].
    pub fn find(&self, arg: &str) -> Result<Manifest> {
        let (manifests, _) = self.layout.all_manifests();
        if let Some(m) = manifests.iter().find(|m| m.name == arg) {
            return Ok(m.clone());
        }
        let short = |name: &str| name.rsplit_once('/').map(|(_, t)| t.to_string()).unwrap_or_else(|| name.to_string());
        let untagged = |name: &str| name.split(':').next().unwrap_or(name).to_string();
        let fits = |m: &&Manifest| {
            let n = m.name.as_str();
            untagged(n) == arg || short(n) == arg || untagged(&short(n)) == arg || n.eq_ignore_ascii_case(arg)
        };
        let hits: Vec<&Manifest> = manifests.iter().filter(fits).collect();
        match hits.as_slice() {
            [one] => Ok((*one).clone()),
            [] => Err(StoreError::ModelNotFound {
                name: arg.to_string(),
                store: self.root().to_path_buf(),
                known: if manifests.is_empty() {
                    ": it is empty".to_string()
                } else {
                    format!(" has {}", manifests.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", "))
                },
            }),
            many => Err(StoreError::AmbiguousName {
                name: arg.to_string(),
                candidates: many.iter().map(|m| m.name.clone()).collect(),
            }),
        }
    }

    /// The file to open for `arg`: `arg` itself when it is an existing path, else the first
    /// file of the store model it names (checked to exist with its recorded size).
    ///
    /// # Errors
    /// As [`Store::find`], plus [`StoreError::MissingFile`].
    pub fn resolve(&self, arg: &str) -> Result<PathBuf> {
        if Path::new(arg).exists() {
            return Ok(PathBuf::from(arg));
        }
        let m = self.find(arg)?;
        self.check_files(&m)?;
        Ok(self.layout.file_path(&m.files[0]))
    }

    /// Removes a model: its manifest, and its files that live in the store and that no other
    /// model lists (with their partial and record files); empty folders go too.
    ///
    /// # Errors
    /// As [`Store::find`], and I/O errors.
    pub fn remove(&self, name: &str) -> Result<Removed> {
        let m = self.find(name)?;
        let (all, _) = self.layout.all_manifests();
        let shared: std::collections::HashSet<PathBuf> = all
            .iter()
            .filter(|o| o.name != m.name)
            .flat_map(|o| o.files.iter().map(|f| self.layout.file_path(f)))
            .collect();
        let manifest_path = self.layout.manifest_path(&m.name);
        std::fs::remove_file(&manifest_path).map_err(io_err("remove", &manifest_path))?;
        let mut deleted = Vec::new();
        let mut freed_bytes = 0;
        for f in &m.files {
            let p = self.layout.file_path(f);
            if !p.starts_with(self.root()) || shared.contains(&p) {
                continue;
            }
            for extra in [download::verified_path(&p), download::partial_path(&p), download::journal_path(&p)] {
                let _ = std::fs::remove_file(extra);
            }
            match std::fs::remove_file(&p) {
                Ok(()) => {
                    freed_bytes += f.size_bytes;
                    deleted.push(p.clone());
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(StoreError::Io { what: "remove", path: p, source: e }),
            }
            let mut dir = p.parent();
            while let Some(d) = dir {
                if d == self.root() || !d.starts_with(self.root()) || std::fs::remove_dir(d).is_err() {
                    break;
                }
                dir = d.parent();
            }
        }
        Ok(Removed { name: m.name, deleted, freed_bytes })
    }

    /// Adds a local GGUF (a split set whole, from any of its parts) under `name` (default:
    /// the file's stem, or the split set's prefix). The file must open as a valid GGUF.
    ///
    /// # Errors
    /// [`StoreError::NotGguf`], [`StoreError::NameTaken`], [`StoreError::BadName`],
    /// [`StoreError::DiskFull`], I/O errors.
    pub fn add_local(&self, path: &Path, name: Option<&str>, mode: AddMode) -> Result<Manifest> {
        let model =
            gguf::GgufModel::open(path).map_err(|source| StoreError::NotGguf { path: path.to_path_buf(), source })?;
        let parts: Vec<PathBuf> = model.files().iter().map(|f| f.path().to_path_buf()).collect();
        drop(model);
        let name = match name {
            Some(n) => n.to_string(),
            None => crate::select::stem_tag(&parts[0].to_string_lossy()),
        };
        check_name(&name)?;
        if self.layout.manifest_path(&name).exists() {
            return Err(StoreError::NameTaken { name });
        }
        let mut files = Vec::with_capacity(parts.len());
        match mode {
            AddMode::Reference => {
                for p in &parts {
                    let abs = std::fs::canonicalize(p).map_err(io_err("resolve", p))?;
                    let size_bytes = std::fs::metadata(&abs).map_err(io_err("stat", &abs))?.len();
                    files.push(ManifestFile { path: abs, size_bytes, digest: None });
                }
            }
            AddMode::Copy => {
                let dir = self.layout.local_dir(&name);
                std::fs::create_dir_all(&dir).map_err(io_err("create directory", &dir))?;
                let need_bytes: u64 = parts.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
                if let Some(available_bytes) = download::available_space(&dir) {
                    if available_bytes < need_bytes {
                        return Err(StoreError::DiskFull { dir, need_bytes, available_bytes });
                    }
                }
                for p in &parts {
                    let dest = dir.join(p.file_name().unwrap_or_default());
                    let (size_bytes, sha) = copy_verified(p, &dest)?;
                    files.push(ManifestFile {
                        path: self.layout.record_path(&dest),
                        size_bytes,
                        digest: Some(format!("sha256:{sha}")),
                    });
                }
            }
        }
        let manifest = Manifest {
            name,
            source: ModelSource::Local {
                original: std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
                copied: mode == AddMode::Copy,
            },
            files,
            added_unix_s: now_unix_s(),
        };
        self.layout.write_manifest(&manifest)?;
        Ok(manifest)
    }
}

/// Copies `src` to `dest` through `dest.partial`, hashing on the way; then reads the copy back
/// and checks it hashes the same before it takes its final name.
fn copy_verified(src: &Path, dest: &Path) -> Result<(u64, String)> {
    use sha2::Digest as _;
    let partial = download::partial_path(dest);
    let mut input = std::fs::File::open(src).map_err(io_err("open", src))?;
    let mut out = std::fs::File::create(&partial).map_err(io_err("create", &partial))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = input.read(&mut buf).map_err(io_err("read", src))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| {
            if crate::error::is_disk_full(&e) {
                let dir = dest.parent().unwrap_or(Path::new(".")).to_path_buf();
                StoreError::DiskFull {
                    need_bytes: 0,
                    available_bytes: download::available_space(&dir).unwrap_or(0),
                    dir,
                }
            } else {
                StoreError::Io { what: "write", path: partial.clone(), source: e }
            }
        })?;
        size += n as u64;
    }
    out.sync_all().map_err(io_err("sync", &partial))?;
    drop(out);
    let sha = download::hex(&h.finalize());
    let digest = Digest::Sha256(sha.clone());
    let copied = download::hash_file(&partial, &digest)?;
    if copied != sha {
        let _ = std::fs::remove_file(&partial);
        return Err(StoreError::ChecksumMismatch {
            file: dest.display().to_string(),
            algorithm: "sha256",
            expected: sha,
            actual: copied,
        });
    }
    std::fs::rename(&partial, dest).map_err(io_err("rename", &partial))?;
    download::record_verified(dest, &digest, size)?;
    Ok((size, sha))
}
