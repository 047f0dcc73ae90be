//! Writing GGUF files, streamed: the header first, then tensor data in chunks, so a writer of a
//! 40 GB synthetic model never holds more than one chunk in memory.

use crate::dtype::GgmlType;
use crate::error::{GgufError, Result};
use crate::reader::{align_up, tensor_size, TensorInfo, DEFAULT_ALIGNMENT, MAGIC};
use crate::value::{Metadata, Value};
use std::io::{BufWriter, Write};
use std::path::Path;

/// Collects metadata and tensor declarations, then writes a version-3 file.
///
/// # Examples
/// ```
/// use gguf::{GgufWriter, GgmlType, Value, GgufModel};
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("tiny.gguf");
/// let mut w = GgufWriter::new();
/// w.set("general.architecture", Value::String("llama".into()));
/// w.add_tensor("x", GgmlType::F32, &[2, 2]).unwrap();
/// let mut out = w.create(&path).unwrap();
/// let data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
/// out.write_data(&data).unwrap();
/// out.finish().unwrap();
/// let m = GgufModel::open(&path).unwrap();
/// assert_eq!(m.tensor("x").unwrap().data, &data[..]);
/// ```
#[derive(Clone, Debug)]
pub struct GgufWriter {
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    next_offset: u64,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty writer with the default alignment (32).
    pub fn new() -> GgufWriter {
        GgufWriter { metadata: Metadata::default(), tensors: Vec::new(), alignment: DEFAULT_ALIGNMENT, next_offset: 0 }
    }

    /// Sets a metadata key (replacing an earlier value). `general.alignment` also changes the
    /// alignment used for tensors declared afterwards.
    pub fn set(&mut self, key: &str, value: Value) {
        if key == "general.alignment" {
            if let Some(a) = value.as_i128().filter(|a| *a > 0 && (*a as u64).is_power_of_two()) {
                self.alignment = a as u64;
            }
        }
        self.metadata.set(key, value);
    }

    /// Copies every key of `md` (for tools that rewrite a file).
    pub fn set_all(&mut self, md: &Metadata) {
        for (k, v) in md.iter() {
            self.set(k, v.clone());
        }
    }

    /// Declares a tensor; data must later be written in declaration order.
    ///
    /// # Errors
    /// A bad shape (zero, overflow, partial block) or a duplicate name.
    pub fn add_tensor(&mut self, name: &str, dtype: GgmlType, shape: &[u64]) -> Result<()> {
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::DuplicateTensor { tensor: name.to_string() });
        }
        if shape.is_empty() || shape.len() > crate::reader::MAX_DIMS {
            return Err(GgufError::BadShape {
                tensor: name.to_string(),
                shape: shape.to_vec(),
                why: "expected 1 to 4 dimensions".into(),
            });
        }
        let size_bytes = tensor_size(name, shape, dtype)?;
        let offset = align_up(self.next_offset, self.alignment);
        self.next_offset = offset + size_bytes;
        self.tensors.push(TensorInfo { name: name.to_string(), shape: shape.to_vec(), dtype, offset, size_bytes });
        Ok(())
    }

    /// The tensors declared so far.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Writes the header to `path` and returns a sink for the tensor data.
    ///
    /// # Errors
    /// I/O errors, naming the file.
    pub fn create(&self, path: impl AsRef<Path>) -> Result<TensorDataSink<BufWriter<std::fs::File>>> {
        let path = path.as_ref();
        let f = std::fs::File::create(path).map_err(|source| GgufError::Io { what: "create", source }.in_file(path))?;
        self.start(BufWriter::with_capacity(1 << 20, f)).map_err(|e| e.in_file(path))
    }

    /// Writes the header to any writer and returns a sink for the tensor data.
    pub fn start<W: Write>(&self, mut w: W) -> Result<TensorDataSink<W>> {
        let io = |source| GgufError::Io { what: "write", source };
        let mut header = Vec::new();
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in self.metadata.iter() {
            put_str(&mut header, k);
            header.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut header, v);
        }
        for t in &self.tensors {
            put_str(&mut header, &t.name);
            header.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for d in &t.shape {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.dtype.id().to_le_bytes());
            header.extend_from_slice(&t.offset.to_le_bytes());
        }
        let padded = align_up(header.len() as u64, self.alignment) as usize;
        header.resize(padded, 0);
        w.write_all(&header).map_err(io)?;
        Ok(TensorDataSink { w, tensors: self.tensors.clone(), current: 0, written_in_current: 0, position: 0 })
    }
}

/// Receives tensor data after the header, in declaration order, in chunks of any size.
pub struct TensorDataSink<W: Write> {
    w: W,
    tensors: Vec<TensorInfo>,
    current: usize,
    written_in_current: u64,
    position: u64,
}

impl<W: Write> TensorDataSink<W> {
    /// Appends bytes to the current tensor, moving on (with padding) when it is complete.
    ///
    /// # Errors
    /// More bytes than the declared tensors hold, or an I/O error.
    pub fn write_data(&mut self, mut bytes: &[u8]) -> Result<()> {
        let io = |source| GgufError::Io { what: "write", source };
        while !bytes.is_empty() {
            let Some(t) = self.tensors.get(self.current) else {
                return Err(GgufError::Writer { why: format!("{} bytes past the last tensor", bytes.len()) });
            };
            if self.written_in_current == 0 && self.position < t.offset {
                let pad = vec![0u8; (t.offset - self.position) as usize];
                self.w.write_all(&pad).map_err(io)?;
                self.position = t.offset;
            }
            let room = t.size_bytes - self.written_in_current;
            let n = room.min(bytes.len() as u64) as usize;
            self.w.write_all(&bytes[..n]).map_err(io)?;
            self.written_in_current += n as u64;
            self.position += n as u64;
            bytes = &bytes[n..];
            if self.written_in_current == t.size_bytes {
                self.current += 1;
                self.written_in_current = 0;
            }
        }
        Ok(())
    }

    /// Name and size of the tensor the next bytes belong to, or `None` when all are written.
    pub fn current_tensor(&self) -> Option<&TensorInfo> {
        self.tensors.get(self.current)
    }

    /// Checks that every tensor got all its bytes and flushes.
    pub fn finish(mut self) -> Result<W> {
        if let Some(t) = self.tensors.get(self.current) {
            return Err(GgufError::Writer {
                why: format!(
                    "tensor {:?} got {} of its {} bytes ({} tensors left)",
                    t.name,
                    self.written_in_current,
                    t.size_bytes,
                    self.tensors.len() - self.current
                ),
            });
        }
        self.w.flush().map_err(|source| GgufError::Io { what: "flush", source })?;
        Ok(self.w)
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(t, items) => {
            out.extend_from_slice(&(*t as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_value(out, it);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}
