//! Parsing one GGUF file: header, metadata, tensor infos, validation, memory-mapped data.

use crate::dtype::GgmlType;
use crate::error::{GgufError, Result};
use crate::value::{Metadata, Value, ValueType};
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The little-endian `u32` of the bytes "GGUF".
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;

/// Where one tensor is and what it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Name as stored (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions in GGUF order: `shape[0]` (ne0) is the row length.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: GgmlType,
    /// Offset of the first byte relative to the data section.
    pub offset: u64,
    /// Size in bytes.
    pub size_bytes: u64,
}

impl TensorInfo {
    /// Number of values.
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Number of rows: the product of every dimension but the first.
    pub fn n_rows(&self) -> u64 {
        self.shape.iter().skip(1).product()
    }
    /// Row length (ne0).
    pub fn row_len(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }
}

/// One open GGUF file: parsed header plus a read-only memory map of the whole file.
///
/// Tensor bytes are borrowed from the map, so opening a 100 GB file reads only its header; the
/// operating system pages data in as it is touched.
pub struct GgufFile {
    path: PathBuf,
    /// Format version (2 or 3).
    pub version: u32,
    /// Key-value metadata.
    pub metadata: Metadata,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    /// `general.alignment` (or the default 32).
    pub alignment: u64,
    map: Mmap,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and validates a file. Errors name the file.
    ///
    /// # Errors
    /// Any [`GgufError`] about the header, wrapped in [`GgufError::InFile`].
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        Self::open_inner(path).map_err(|e| e.in_file(path))
    }

    fn open_inner(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|source| GgufError::Io { what: "open", source })?;
        // SAFETY: the map is read-only and private to this process. Another process truncating
        // or rewriting the file while it is mapped would make reads fault or change; like every
        // engine that maps model files (llama.cpp included) we accept that, and the store never
        // rewrites a file under its final name.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| GgufError::Io { what: "mmap", source })?;
        #[cfg(unix)]
        let _ = map.advise(memmap2::Advice::Random);
        let header = parse_header(&map)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            data_offset: header.data_offset,
            alignment: header.alignment,
            map,
        })
    }

    /// The path this file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's length in bytes.
    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    /// The whole file's bytes (the memory map).
    pub fn raw_bytes(&self) -> &[u8] {
        &self.map
    }

    /// Maps the file's pages in `offset..offset + len` into this process now
    /// (`MADV_POPULATE_READ`, Linux 5.14+), reading from disk what the page cache lacks.
    ///
    /// Why: a page of a file mapping is entered into the process's page tables at its first
    /// touch, through a minor fault (16 pages at a time, by the kernel's fault-around); a
    /// reader that touches gigabytes of experts in random order pays those faults inside its
    /// timed work, on every thread at once.
    ///
    /// # Errors
    /// The range is outside the file, the kernel refused the advice (older than 5.14), or a
    /// read failed; elsewhere than Linux, `Unsupported`.
    pub fn populate(&self, offset: u64, len: u64) -> std::io::Result<()> {
        let end = offset.checked_add(len).filter(|&e| e <= self.file_len());
        if end.is_none() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("range {offset}+{len} is outside the file's {} bytes", self.file_len()),
            ));
        }
        #[cfg(target_os = "linux")]
        return self.map.advise_range(memmap2::Advice::PopulateRead, offset as usize, len as usize);
        #[cfg(not(target_os = "linux"))]
        Err(std::io::ErrorKind::Unsupported.into())
    }

    /// The bytes of a tensor, borrowed from the memory map.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        // Bounds were validated at open.
        &self.map[start..start + info.size_bytes as usize]
    }
}

/// A parsed header (everything before the data section).
pub(crate) struct Header {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub data_offset: u64,
    pub alignment: u64,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8]> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n > remaining {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                need: n,
                file_len: self.bytes.len() as u64,
            });
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, || what.to_string())?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        self.arr::<4>(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        self.arr::<8>(what).map(u64::from_le_bytes)
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let start = self.pos as u64;
        let s = self.take(len, || format!("{what} ({len} bytes)"))?;
        String::from_utf8(s.to_vec()).map_err(|_| GgufError::BadString { what: what.to_string(), offset: start })
    }
    fn value(&mut self, t: ValueType, key: &str) -> Result<Value> {
        let w = || format!("value of {key:?}");
        Ok(match t {
            ValueType::U8 => Value::U8(self.arr::<1>(&w())?[0]),
            ValueType::I8 => Value::I8(self.arr::<1>(&w())?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.arr(&w())?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.arr(&w())?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.arr(&w())?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.arr(&w())?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.arr(&w())?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.arr(&w())?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.arr(&w())?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.arr(&w())?)),
            ValueType::Bool => {
                let b = self.arr::<1>(&w())?[0];
                Value::Bool(b != 0)
            }
            ValueType::String => Value::String(self.string(&w())?),
            ValueType::Array => {
                let type_id = self.u32(&w())?;
                let elem = ValueType::from_id(type_id)
                    .ok_or_else(|| GgufError::UnknownValueType { key: key.to_string(), type_id })?;
                let n = self.u64(&w())?;
                // Refuse lengths the rest of the file cannot hold before allocating for them.
                let remaining = (self.bytes.len() - self.pos) as u64;
                if n.saturating_mul(elem.min_bytes()) > remaining {
                    return Err(GgufError::Truncated {
                        what: format!("array {key:?} of {n} {elem:?} values"),
                        offset: self.pos as u64,
                        need: n.saturating_mul(elem.min_bytes()),
                        file_len: self.bytes.len() as u64,
                    });
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, key)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

pub(crate) fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Parses and validates the header of a whole file held in `bytes`.
pub(crate) fn parse_header(bytes: &[u8]) -> Result<Header> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic = c.arr::<4>("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    let mut metadata = Metadata::default();
    for i in 0..n_kv {
        let key = c.string(&format!("key of metadata entry {i}"))?;
        let type_id = c.u32(&format!("type of {key:?}"))?;
        let t = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType { key: key.clone(), type_id })?;
        let v = c.value(t, &key)?;
        metadata.insert(key, v)?;
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_i128() {
            Some(a) if a > 0 && (a as u64).is_power_of_two() => a as u64,
            Some(a) => return Err(GgufError::BadAlignment { alignment: a.max(0) as u64 }),
            None => {
                return Err(GgufError::WrongType {
                    key: "general.alignment".into(),
                    expected: "u32",
                    found: v.type_name(),
                })
            }
        },
    };
    // Each tensor info takes at least 8 (name len) + 4 + 4 + 8 bytes.
    let remaining = (bytes.len() - c.pos) as u64;
    if n_tensors.saturating_mul(24) > remaining {
        return Err(GgufError::Truncated {
            what: format!("{n_tensors} tensor infos"),
            offset: c.pos as u64,
            need: n_tensors.saturating_mul(24),
            file_len: bytes.len() as u64,
        });
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = c.string(&format!("name of tensor {i}"))?;
        let n_dims = c.u32(&format!("dimension count of {name:?}"))? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::BadShape {
                tensor: name,
                shape: vec![],
                why: format!("{n_dims} dimensions, expected 1 to {MAX_DIMS}"),
            });
        }
        let mut shape = Vec::with_capacity(n_dims);
        for d in 0..n_dims {
            shape.push(c.u64(&format!("dimension {d} of {name:?}"))?);
        }
        let type_id = c.u32(&format!("type of {name:?}"))?;
        let dtype =
            GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType { tensor: name.clone(), type_id })?;
        let offset = c.u64(&format!("offset of {name:?}"))?;
        let size_bytes = tensor_size(&name, &shape, dtype)?;
        tensors.push(TensorInfo { name, shape, dtype, offset, size_bytes });
    }
    let data_offset = align_up(c.pos as u64, alignment);
    validate_tensors(&tensors, data_offset, alignment, bytes.len() as u64)?;
    Ok(Header { version, metadata, tensors, data_offset, alignment })
}

/// Size in bytes of a tensor, checking the shape (no zero dimension, no overflow, whole blocks).
pub fn tensor_size(name: &str, shape: &[u64], dtype: GgmlType) -> Result<u64> {
    let bad = |why: String| GgufError::BadShape { tensor: name.to_string(), shape: shape.to_vec(), why };
    if shape.contains(&0) {
        return Err(bad("a dimension is zero".into()));
    }
    let mut n: u64 = 1;
    for &d in shape {
        n = n.checked_mul(d).ok_or_else(|| bad("the element count overflows 64 bits".into()))?;
    }
    if n > i64::MAX as u64 {
        return Err(bad("the element count exceeds ggml's int64 limit".into()));
    }
    let row = dtype.row_bytes(shape[0]).ok_or_else(|| {
        bad(format!("row length {} is not a multiple of the {dtype} block of {}", shape[0], dtype.block_elems()))
    })?;
    row.checked_mul(n / shape[0]).ok_or_else(|| bad("the byte size overflows 64 bits".into()))
}

fn validate_tensors(tensors: &[TensorInfo], data_offset: u64, alignment: u64, file_len: u64) -> Result<()> {
    let mut seen = std::collections::HashSet::with_capacity(tensors.len());
    for t in tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(GgufError::DuplicateTensor { tensor: t.name.clone() });
        }
        if t.offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor { tensor: t.name.clone(), offset: t.offset, alignment });
        }
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.size_bytes));
        match (start, end) {
            (Some(_), Some(e)) if e <= file_len => {}
            _ => {
                return Err(GgufError::DataPastEnd {
                    tensor: t.name.clone(),
                    start: data_offset.saturating_add(t.offset),
                    end: data_offset.saturating_add(t.offset).saturating_add(t.size_bytes),
                    file_len,
                })
            }
        }
    }
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        if w[0].offset + w[0].size_bytes > w[1].offset {
            return Err(GgufError::OverlappingTensors {
                first: w[0].name.clone(),
                first_start: w[0].offset,
                first_end: w[0].offset + w[0].size_bytes,
                second: w[1].name.clone(),
                second_start: w[1].offset,
            });
        }
    }
    Ok(())
}
