//! The metadata of a GGUF file: its key-value pairs and the names of its tensors, without the
//! tensor data. The text layer needs the tokenizer, the chat template and the hyper-parameters
//! from a GGUF file; reading them here, rather than through candle's reader, is what lets the
//! router link no candle. The engine reads the weights with candle.
//!
//! The format (GGUF v2 and v3): magic, version, tensor count, key-value count, the key-value
//! pairs, then one record per tensor. Every length is checked against the bytes left in the
//! file before anything is allocated, so a damaged file is an error, never a huge allocation.

use std::collections::{HashMap, HashSet};
use std::io::{BufReader, Read};
use std::path::Path;

use crate::error::{Result, TextError};

const MAGIC: &[u8; 4] = b"GGUF";

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// An unsigned integer of any width (or a bool), widened to 64 bits.
    pub fn to_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::Bool(v) => Some(v.into()),
            _ => None,
        }
    }

    /// A 32-bit signed integer.
    pub fn to_i32(&self) -> Option<i32> {
        match *self {
            Self::I32(v) => Some(v),
            _ => None,
        }
    }

    /// A float of either width.
    pub fn to_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Self::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// A GGUF file's metadata and tensor names.
#[derive(Debug, Default)]
pub struct Metadata {
    pub values: HashMap<String, Value>,
    pub tensors: HashSet<String>,
}

impl Metadata {
    /// Reads the metadata of the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| TextError::io(path, e))?;
        let len = file.metadata().map_err(|e| TextError::io(path, e))?.len();
        let mut r = Reader {
            inner: BufReader::new(file),
            left: len,
        };
        Self::read(&mut r).map_err(|e| match e {
            Fault::Io(e) => TextError::io(path, e),
            Fault::Format(reason) => TextError::invalid_model(path, format!("GGUF: {reason}")),
        })
    }

    /// The value under `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.values.get(key)
    }

    fn read<R: Read>(r: &mut Reader<R>) -> Result<Self, Fault> {
        let mut magic = [0; 4];
        r.bytes(&mut magic)?;
        if &magic != MAGIC {
            return Err(Fault::Format("not a GGUF file".into()));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Fault::Format(format!("version {version} is not supported")));
        }
        let n_tensors = r.u64()?;
        let n_values = r.u64()?;
        let mut meta = Metadata::default();
        for _ in 0..n_values {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty)?;
            meta.values.insert(key, value);
        }
        for _ in 0..n_tensors {
            let name = r.string()?;
            let dims = r.u32()?;
            // Each dimension (u64), then the element type (u32) and the data offset (u64).
            r.skip(u64::from(dims) * 8 + 4 + 8)?;
            meta.tensors.insert(name);
        }
        Ok(meta)
    }
}

enum Fault {
    Io(std::io::Error),
    Format(String),
}

impl From<std::io::Error> for Fault {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e)
    }
}

/// Little-endian reads that know how many bytes the file has left.
struct Reader<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Reader<R> {
    /// Refuses a length the rest of the file cannot hold, before anything is allocated for it.
    fn claim(&mut self, n: u64) -> Result<(), Fault> {
        if n > self.left {
            return Err(Fault::Format(format!(
                "a length of {n} bytes runs past the end of the file"
            )));
        }
        self.left -= n;
        Ok(())
    }

    fn bytes(&mut self, out: &mut [u8]) -> Result<(), Fault> {
        self.claim(out.len() as u64)?;
        self.inner.read_exact(out)?;
        Ok(())
    }

    fn skip(&mut self, n: u64) -> Result<(), Fault> {
        self.claim(n)?;
        std::io::copy(&mut (&mut self.inner).take(n), &mut std::io::sink())?;
        Ok(())
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Fault> {
        let mut b = [0; N];
        self.bytes(&mut b)?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, Fault> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, Fault> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String, Fault> {
        let n = self.u64()?;
        self.claim(n)?;
        let mut buf = vec![0; n as usize];
        self.inner.read_exact(&mut buf)?;
        String::from_utf8(buf).map_err(|_| Fault::Format("a string is not UTF-8".into()))
    }

    fn value(&mut self, ty: u32) -> Result<Value, Fault> {
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.array()?)),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                let item = self.u32()?;
                if item == 9 {
                    // llama.cpp refuses them too; no model file has one.
                    return Err(Fault::Format("nested arrays are not supported".into()));
                }
                let n = self.u64()?;
                // Every element takes at least one byte: a count the file cannot hold is
                // refused before the vector is reserved.
                if n > self.left {
                    return Err(Fault::Format(format!(
                        "an array of {n} elements runs past the end of the file"
                    )));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(item)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(Fault::Format(format!("unknown value type {other}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    fn file(values: &[(&str, u32, Vec<u8>)], tensors: &[&str]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((values.len() as u64).to_le_bytes());
        for (key, ty, bytes) in values {
            string(&mut out, key);
            out.extend(ty.to_le_bytes());
            out.extend(bytes);
        }
        for name in tensors {
            string(&mut out, name);
            out.extend(2u32.to_le_bytes());
            out.extend([0; 2 * 8 + 4 + 8]);
        }
        out
    }

    fn parse(bytes: &[u8]) -> Result<Metadata, Fault> {
        Metadata::read(&mut Reader {
            inner: bytes,
            left: bytes.len() as u64,
        })
    }

    #[test]
    fn reads_values_arrays_and_tensor_names() {
        let mut names = Vec::new();
        names.extend(8u32.to_le_bytes());
        names.extend(2u64.to_le_bytes());
        string(&mut names, "a");
        string(&mut names, "bc");
        let mut arch = Vec::new();
        string(&mut arch, "llama");
        let bytes = file(
            &[
                ("general.architecture", 8, arch),
                ("llama.block_count", 4, 30u32.to_le_bytes().to_vec()),
                ("llama.rope.freq_base", 6, 1e4f32.to_le_bytes().to_vec()),
                ("tokenizer.ggml.tokens", 9, names),
            ],
            &["token_embd.weight"],
        );
        let meta = parse(&bytes).map_err(|_| ()).unwrap();
        assert_eq!(
            meta.get("general.architecture").and_then(Value::as_str),
            Some("llama")
        );
        assert_eq!(
            meta.get("llama.block_count").and_then(Value::to_u64),
            Some(30)
        );
        assert_eq!(
            meta.get("llama.rope.freq_base").and_then(Value::to_f64),
            Some(1e4)
        );
        let tokens = meta
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .unwrap();
        assert_eq!(
            tokens,
            [Value::String("a".into()), Value::String("bc".into())]
        );
        assert!(meta.tensors.contains("token_embd.weight"));
    }

    #[test]
    fn a_length_past_the_end_is_refused_before_allocating() {
        let mut huge = Vec::new();
        huge.extend(0u32.to_le_bytes());
        huge.extend(u64::MAX.to_le_bytes());
        let bytes = file(&[("x", 9, huge)], &[]);
        assert!(matches!(parse(&bytes), Err(Fault::Format(m)) if m.contains("past the end")));
        let mut long = b"GGUF".to_vec();
        long.extend(3u32.to_le_bytes());
        long.extend(0u64.to_le_bytes());
        long.extend(1u64.to_le_bytes());
        long.extend((1u64 << 40).to_le_bytes());
        assert!(matches!(parse(&long), Err(Fault::Format(m)) if m.contains("past the end")));
    }

    #[test]
    fn other_files_are_refused() {
        assert!(
            matches!(parse(b"GGML\x03\0\0\0"), Err(Fault::Format(m)) if m == "not a GGUF file")
        );
        let mut v1 = b"GGUF".to_vec();
        v1.extend(1u32.to_le_bytes());
        assert!(matches!(parse(&v1), Err(Fault::Format(m)) if m.contains("version 1")));
    }
}
