//! Metadata values and typed access to them.

use crate::error::{GgufError, Result};
use std::collections::BTreeMap;

/// The value type ids of the format (`gguf_type` in ggml/src/gguf.cpp).
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type for an id, or `None` outside 0..=12.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The smallest number of bytes one value of this type takes in a file (used to reject
    /// array lengths that cannot fit before allocating for them).
    pub fn min_bytes(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value.
#[allow(missing_docs)]
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// An array: the element type (kept for empty arrays and for writing back) and the values.
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// This value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// A short description of the type for error messages (`u32`, `array of string`).
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(t, _) => format!("array of {t:?}").to_lowercase(),
            v => format!("{:?}", v.value_type()).to_lowercase(),
        }
    }

    /// The value as a signed integer when it is any integer type.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v as i128,
            Value::I8(v) => v as i128,
            Value::U16(v) => v as i128,
            Value::I16(v) => v as i128,
            Value::U32(v) => v as i128,
            Value::I32(v) => v as i128,
            Value::U64(v) => v as i128,
            Value::I64(v) => v as i128,
            _ => return None,
        })
    }

    /// The value as a float when it is a float or integer type.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    /// The string, when this is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
}

/// The metadata of a GGUF file: keys in file order, with typed getters whose errors name the key.
///
/// Integer getters accept any integer type whose value fits (converters are not consistent about
/// widths: `general.alignment` is u32 in some files, u64 in others); float getters accept floats
/// and integers; everything else must match exactly.
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: BTreeMap<String, usize>,
}

impl Metadata {
    /// Adds a key. Fails when the key is already present.
    pub fn insert(&mut self, key: String, value: Value) -> Result<()> {
        if self.index.contains_key(&key) {
            return Err(GgufError::DuplicateKey { key });
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        Ok(())
    }

    /// Sets a key, replacing any value it had.
    pub fn set(&mut self, key: &str, value: Value) {
        match self.index.get(key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.to_string(), self.entries.len());
                self.entries.push((key.to_string(), value));
            }
        }
    }

    /// The keys and values, in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there are no keys.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value of a key, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// The value of a key, or [`GgufError::MissingKey`].
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType { key: key.to_string(), expected, found: v.type_name() }
    }

    fn int<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let i = v.as_i128().ok_or_else(|| Self::wrong(key, expected, v))?;
                T::try_from(i).map(Some).map_err(|_| GgufError::WrongType {
                    key: key.to_string(),
                    expected,
                    found: format!("{} with value {i} out of range", v.type_name()),
                })
            }
        }
    }

    /// An integer key as u32 (absent: `None`).
    pub fn u32_opt(&self, key: &str) -> Result<Option<u32>> {
        self.int(key, "u32")
    }
    /// An integer key as u32.
    pub fn u32(&self, key: &str) -> Result<u32> {
        self.u32_opt(key)?.ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
    }
    /// An integer key as u64 (absent: `None`).
    pub fn u64_opt(&self, key: &str) -> Result<Option<u64>> {
        self.int(key, "u64")
    }
    /// An integer key as i64 (absent: `None`).
    pub fn i64_opt(&self, key: &str) -> Result<Option<i64>> {
        self.int(key, "i64")
    }
    /// A float key (absent: `None`).
    pub fn f32_opt(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|f| Some(f as f32)).ok_or_else(|| Self::wrong(key, "f32", v)),
        }
    }
    /// A float key.
    pub fn f32(&self, key: &str) -> Result<f32> {
        self.f32_opt(key)?.ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
    }
    /// A bool key (absent: `None`).
    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong(key, "bool", v)),
        }
    }
    /// A string key (absent: `None`).
    pub fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Self::wrong(key, "string", v)),
        }
    }
    /// A string key.
    pub fn str(&self, key: &str) -> Result<&str> {
        self.str_opt(key)?.ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
    }
    /// An array key's elements (absent: `None`).
    pub fn array_opt(&self, key: &str) -> Result<Option<&[Value]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(_, items)) => Ok(Some(items)),
            Some(v) => Err(Self::wrong(key, "array", v)),
        }
    }
    /// An array of strings (absent: `None`).
    pub fn str_array_opt(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(items) = self.array_opt(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .map(|v| v.as_str().ok_or_else(|| Self::wrong(key, "array of string", v)))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
    /// An array of numbers as f32 (absent: `None`).
    pub fn f32_array_opt(&self, key: &str) -> Result<Option<Vec<f32>>> {
        let Some(items) = self.array_opt(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .map(|v| v.as_f64().map(|f| f as f32).ok_or_else(|| Self::wrong(key, "array of number", v)))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
    /// An array of integers as i64 (absent: `None`).
    pub fn i64_array_opt(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(items) = self.array_opt(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .map(|v| {
                v.as_i128().and_then(|i| i64::try_from(i).ok()).ok_or_else(|| Self::wrong(key, "array of integer", v))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
    /// A key that is either one integer or an array of per-layer integers, expanded to `n`
    /// values (llama.cpp allows both for `head_count_kv`, `feed_forward_length`, ...).
    pub fn u32_per_layer_opt(&self, key: &str, n: usize) -> Result<Option<Vec<u32>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(..)) => {
                let v = self.i64_array_opt(key)?.unwrap_or_default();
                if v.len() != n {
                    return Err(GgufError::WrongType {
                        key: key.to_string(),
                        expected: "one value per layer",
                        found: format!("array of {} values for {n} layers", v.len()),
                    });
                }
                v.into_iter()
                    .map(|x| {
                        u32::try_from(x).map_err(|_| GgufError::WrongType {
                            key: key.to_string(),
                            expected: "u32",
                            found: format!("{x}"),
                        })
                    })
                    .collect::<Result<Vec<_>>>()
                    .map(Some)
            }
            Some(_) => Ok(Some(vec![self.u32(key)?; n])),
        }
    }
}
