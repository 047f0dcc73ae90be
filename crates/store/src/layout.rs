//! Where things live in a store, what a manifest holds, and which names are allowed.
//!
//! ```text
//! <store>/
//!   hub/<owner>/<repo>/<path in repo>       pulled files (+ .partial, .partial.chunks while
//!                                           downloading, + .verified once verified)
//!   local/<name>/<file>                     copies made by `models add --copy`
//!   manifests/<name, percent-encoded>.json  one per model: its files, in part order
//! ```
//! A manifest is written only after every file it lists is verified, so a name in the store
//! always means complete files.

use crate::error::{io_err, Result, StoreError};
use crate::hub::encode_segment;
use std::path::{Path, PathBuf};

/// `$XDG_CACHE_HOME` when set to an absolute path, else `$HOME/.cache`.
pub(crate) fn xdg_cache_home() -> Option<PathBuf> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).filter(|p| p.is_absolute()) {
        return Some(x);
    }
    std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|h| PathBuf::from(h).join(".cache"))
}

/// The store folder when none is given: `$DISKFORMER_STORE`, else `diskformer` in the XDG cache
/// folder (`$XDG_CACHE_HOME/diskformer`, default `~/.cache/diskformer`).
///
/// # Errors
/// [`StoreError::Io`] when neither `DISKFORMER_STORE` nor `HOME` is set.
pub fn default_store_dir() -> Result<PathBuf> {
    if let Some(s) = std::env::var_os("DISKFORMER_STORE").filter(|s| !s.is_empty()) {
        return Ok(PathBuf::from(s));
    }
    xdg_cache_home().map(|c| c.join("diskformer")).ok_or_else(|| StoreError::Io {
        what: "find the cache folder",
        path: PathBuf::from("~/.cache"),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "neither DISKFORMER_STORE nor HOME is set; pass --store DIR",
        ),
    })
}

/// Where a model came from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelSource {
    /// Pulled from a hub.
    Hub {
        /// The endpoint (`https://huggingface.co`).
        endpoint: String,
        /// `owner/repo`.
        repo: String,
        /// The revision asked for (`main`).
        revision: String,
        /// The commit it resolved to, when the hub said.
        commit: Option<String>,
    },
    /// Added from a local file.
    Local {
        /// The file given to `models add` (first part of a split set).
        original: PathBuf,
        /// True: copied into the store; false: the store refers to the original.
        copied: bool,
    },
}

/// One file of a model.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ManifestFile {
    /// Relative to the store folder when inside it, else absolute (a referenced local file).
    pub path: PathBuf,
    /// Its size.
    pub size_bytes: u64,
    /// `sha256:<hex>` or `git-sha1:<hex>` it was verified against; absent for references.
    pub digest: Option<String>,
}

/// A model in the store.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// Its name (`owner/repo:Q4_K_M`, or a short name for local files).
    pub name: String,
    /// Where it came from.
    pub source: ModelSource,
    /// Its files in part order; the first is what `run` opens.
    pub files: Vec<ManifestFile>,
    /// When it was added, seconds since the Unix epoch.
    pub added_unix_s: u64,
}

impl Manifest {
    /// Total size of its files.
    pub fn size_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size_bytes).sum()
    }
}

/// Paths inside one store folder.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub root: PathBuf,
}

impl Layout {
    pub fn manifests_dir(&self) -> PathBuf {
        self.root.join("manifests")
    }

    pub fn manifest_path(&self, name: &str) -> PathBuf {
        self.manifests_dir().join(format!("{}.json", encode_segment(name)))
    }

    /// Where a pulled file goes. `repo_path` must have passed [`check_repo_path`].
    pub fn hub_file(&self, repo: &str, repo_path: &str) -> PathBuf {
        let mut p = self.root.join("hub");
        for seg in repo.split('/').chain(repo_path.split('/')) {
            p.push(seg);
        }
        p
    }

    pub fn local_dir(&self, name: &str) -> PathBuf {
        self.root.join("local").join(encode_segment(name))
    }

    /// The absolute path of a manifest entry.
    pub fn file_path(&self, f: &ManifestFile) -> PathBuf {
        if f.path.is_absolute() {
            f.path.clone()
        } else {
            self.root.join(&f.path)
        }
    }

    /// The path to record for a file: relative when inside the store.
    pub fn record_path(&self, p: &Path) -> PathBuf {
        p.strip_prefix(&self.root).map(Path::to_path_buf).unwrap_or_else(|_| p.to_path_buf())
    }

    pub fn read_manifest(&self, path: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(path).map_err(io_err("read", path))?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| StoreError::BadManifest { path: path.to_path_buf(), why: e.to_string() })?;
        if m.files.is_empty() {
            return Err(StoreError::BadManifest { path: path.to_path_buf(), why: "it lists no file".into() });
        }
        Ok(m)
    }

    /// Writes a manifest atomically (temporary file, fsync, rename).
    pub fn write_manifest(&self, m: &Manifest) -> Result<()> {
        let dir = self.manifests_dir();
        std::fs::create_dir_all(&dir).map_err(io_err("create directory", &dir))?;
        let path = self.manifest_path(&m.name);
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(m)
            .map_err(|e| StoreError::BadManifest { path: path.clone(), why: e.to_string() })?;
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp).map_err(io_err("create", &tmp))?;
            f.write_all(text.as_bytes()).map_err(io_err("write", &tmp))?;
            f.sync_all().map_err(io_err("sync", &tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(io_err("rename", &tmp))
    }

    /// Every manifest, by name; unreadable ones come back as errors beside the good ones.
    pub fn all_manifests(&self) -> (Vec<Manifest>, Vec<(PathBuf, StoreError)>) {
        let dir = self.manifests_dir();
        let mut good = Vec::new();
        let mut bad = Vec::new();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return (good, bad),
            Err(e) => {
                bad.push((dir.clone(), StoreError::Io { what: "read directory", path: dir, source: e }));
                return (good, bad);
            }
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            match self.read_manifest(&p) {
                Ok(m) => good.push(m),
                Err(err) => bad.push((p, err)),
            }
        }
        good.sort_by(|a, b| a.name.cmp(&b.name));
        (good, bad)
    }
}

/// Checks a store name: `NAME`, `OWNER/NAME` or either with `:TAG`; each part letters, digits,
/// `-`, `_`, `.`, not starting with `.`.
///
/// # Errors
/// [`StoreError::BadName`].
pub fn check_name(name: &str) -> Result<()> {
    let bad = |why: &str| Err(StoreError::BadName { name: name.to_string(), why: why.to_string() });
    let (base, tag) = match name.split_once(':') {
        Some((b, t)) => (b, Some(t)),
        None => (name, None),
    };
    let parts: Vec<&str> = base.split('/').collect();
    if parts.len() > 2 {
        return bad("at most one '/' (OWNER/NAME)");
    }
    for p in parts.iter().copied().chain(tag) {
        if p.is_empty() {
            return bad("an empty part");
        }
        if p.starts_with('.') {
            return bad("a part starts with '.'");
        }
        if !p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) {
            return bad("only letters, digits, '-', '_' and '.' are allowed (plus one '/' and one ':')");
        }
    }
    Ok(())
}

/// Checks a path from a hub listing before it becomes a path on disk: relative, no `.` or `..`
/// segment, no empty segment, no backslash or NUL.
pub(crate) fn check_repo_path(url: &str, p: &str) -> Result<()> {
    let ok = !p.is_empty()
        && !p.contains('\\')
        && !p.contains('\0')
        && p.split('/').all(|s| !s.is_empty() && s != "." && s != "..");
    if ok {
        Ok(())
    } else {
        Err(StoreError::BadResponse { url: url.to_string(), why: format!("unsafe file path {p:?}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_paths() {
        for good in ["qwen3", "Qwen/Qwen3-0.6B-GGUF:Q4_K_M", "my.model:v1"] {
            check_name(good).unwrap();
        }
        for bad in ["", "a/b/c", ".hidden", "a:b:c", "a b", "a/:x", "../x"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        for bad in ["../x.gguf", "a//b.gguf", "/abs.gguf", "a/./b", "a\\b"] {
            assert!(check_repo_path("u", bad).is_err(), "{bad:?}");
        }
        let l = Layout { root: PathBuf::from("/s") };
        assert_eq!(l.manifest_path("o/r:Q8_0"), PathBuf::from("/s/manifests/o%2Fr%3AQ8_0.json"));
        assert_eq!(l.hub_file("o/r", "Q8_0/m.gguf"), PathBuf::from("/s/hub/o/r/Q8_0/m.gguf"));
    }
}
