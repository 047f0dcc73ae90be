//! A model: one GGUF file or a split set (`NAME-00001-of-0000N.gguf`) presented as one.

use crate::dtype::GgmlType;
use crate::error::{GgufError, Result};
use crate::reader::{GgufFile, TensorInfo};
use crate::value::Metadata;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// `split.count`: number of files in a split set (u16).
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// `split.no`: this file's zero-based index in the set (u16).
pub const KEY_SPLIT_NO: &str = "split.no";
/// `split.tensors.count`: tensors in the whole set (i32).
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// A tensor of an open model: its info and its bytes, borrowed from the memory map.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    /// Name, shape (ne0 first), type and offset.
    pub info: &'a TensorInfo,
    /// The raw bytes (`info.size_bytes` of them).
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// The name.
    pub fn name(&self) -> &'a str {
        &self.info.name
    }
    /// Element type.
    pub fn dtype(&self) -> GgmlType {
        self.info.dtype
    }
    /// Dimensions, ne0 (row length) first.
    pub fn shape(&self) -> &'a [u64] {
        &self.info.shape
    }
}

/// One model, possibly split over several files. Metadata comes from the first file (llama.cpp
/// does the same); tensors from every file, each name once.
#[derive(Debug)]
pub struct GgufModel {
    files: Vec<GgufFile>,
    by_name: HashMap<String, (usize, usize)>,
}

/// If `path`'s file name has the form `PREFIX-00001-of-00003.gguf`, returns (PREFIX, count).
pub fn split_name_parts(path: &Path) -> Option<(String, u32)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    if no.len() != 5 || count.len() != 5 {
        return None;
    }
    let _no: u32 = no.parse().ok()?;
    let count: u32 = count.parse().ok()?;
    Some((prefix.to_string(), count))
}

/// The path of split part `no` (zero-based) in the set named by `prefix` (llama.cpp's
/// `llama_split_path`: `PREFIX-%05d-of-%05d.gguf`, one-based).
pub fn split_path(dir: &Path, prefix: &str, no: u32, count: u32) -> PathBuf {
    dir.join(format!("{prefix}-{:05}-of-{:05}.gguf", no + 1, count))
}

impl GgufModel {
    /// Opens a single file, or the whole split set when `path` is any part of one.
    ///
    /// # Errors
    /// Header errors of any file (naming it), a missing part, parts that disagree on the count,
    /// or a tensor that appears in two parts.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufModel> {
        let path = path.as_ref();
        let first = GgufFile::open(path)?;
        let count = first.metadata.u32_opt(KEY_SPLIT_COUNT).map_err(|e| e.in_file(path))?.unwrap_or(1);
        if count <= 1 {
            return Self::from_files(vec![first]);
        }
        let (prefix, name_count) = split_name_parts(path).ok_or_else(|| {
            GgufError::BadSplit {
                why: format!(
                    "the file says it is one of {count} parts, but its name does not follow PREFIX-00001-of-{count:05}.gguf"
                ),
            }
            .in_file(path)
        })?;
        if name_count != count {
            return Err(GgufError::BadSplit {
                why: format!("split.count is {count} but the file name says {name_count} parts"),
            }
            .in_file(path));
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut files = Vec::with_capacity(count as usize);
        for no in 0..count {
            let p = split_path(dir, &prefix, no, count);
            if !p.exists() {
                return Err(GgufError::BadSplit { why: format!("part {} of {count} is missing", no + 1) }.in_file(p));
            }
            let f = GgufFile::open(&p)?;
            let md = &f.metadata;
            let fno = md.u32_opt(KEY_SPLIT_NO).map_err(|e| e.in_file(&p))?;
            let fcount = md.u32_opt(KEY_SPLIT_COUNT).map_err(|e| e.in_file(&p))?;
            if fno != Some(no) || fcount != Some(count) {
                return Err(GgufError::BadSplit {
                    why: format!("expected split.no {no} and split.count {count}, found {fno:?} and {fcount:?}"),
                }
                .in_file(p));
            }
            files.push(f);
        }
        drop(first);
        let model = Self::from_files(files)?;
        if let Some(total) = model.files[0].metadata.i64_opt(KEY_SPLIT_TENSORS_COUNT).map_err(|e| e.in_file(path))? {
            let found = model.by_name.len() as i64;
            if total != found {
                return Err(GgufError::BadSplit {
                    why: format!("split.tensors.count is {total} but the {count} parts hold {found} tensors"),
                }
                .in_file(path));
            }
        }
        Ok(model)
    }

    fn from_files(files: Vec<GgufFile>) -> Result<GgufModel> {
        let mut by_name = HashMap::new();
        for (fi, f) in files.iter().enumerate() {
            for (ti, t) in f.tensors.iter().enumerate() {
                if by_name.insert(t.name.clone(), (fi, ti)).is_some() {
                    return Err(GgufError::DuplicateTensor { tensor: t.name.clone() }.in_file(f.path()));
                }
            }
        }
        Ok(GgufModel { files, by_name })
    }

    /// The metadata (of the first file of a split set).
    pub fn metadata(&self) -> &Metadata {
        &self.files[0].metadata
    }

    /// The files, in part order.
    pub fn files(&self) -> &[GgufFile] {
        &self.files
    }

    /// The path of the first file.
    pub fn path(&self) -> &Path {
        self.files[0].path()
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.metadata().str("general.architecture").map_err(|e| e.in_file(self.path()))
    }

    /// Every tensor, in file order (parts in order).
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.files.iter().flat_map(|f| f.tensors.iter().map(move |t| TensorView { info: t, data: f.tensor_bytes(t) }))
    }

    /// Number of tensors.
    pub fn n_tensors(&self) -> usize {
        self.by_name.len()
    }

    /// A tensor by name, or `None` when the model has no such tensor.
    pub fn tensor_opt(&self, name: &str) -> Option<TensorView<'_>> {
        self.by_name.get(name).map(|&(fi, ti)| {
            let f = &self.files[fi];
            let t = &f.tensors[ti];
            TensorView { info: t, data: f.tensor_bytes(t) }
        })
    }

    /// Which part (index into [`GgufModel::files`]) holds a tensor, and its info (offsets relative to that part's data section).
    pub fn tensor_location(&self, name: &str) -> Option<(usize, &TensorInfo)> {
        self.by_name.get(name).map(|&(fi, ti)| (fi, &self.files[fi].tensors[ti]))
    }

    /// A tensor by name.
    ///
    /// # Errors
    /// [`GgufError::MissingTensor`] (naming the file) when it is absent.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.tensor_opt(name).ok_or_else(|| GgufError::MissingTensor { tensor: name.to_string() }.in_file(self.path()))
    }

    /// Total bytes of tensor data over all parts.
    pub fn tensor_bytes_total(&self) -> u64 {
        self.tensors().map(|t| t.info.size_bytes).sum()
    }
}
