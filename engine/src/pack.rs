//! Pack files: a GGUF model's K-quant, Q8_0 and Q4_1 matrices (Q5_0 ones as the Q8_0 they
//! become at load) as our kernels lay them out ([`crate::kquant::format`], [`crate::q8`],
//! [`crate::q4`]),
//! written once beside nothing else and memory-mapped by every later load.
//!
//! The kernels read eight rows' blocks interleaved, not the file's rows, so the
//! file's blocks cannot be used in place: every load repacked them into private memory
//! (half of a 30B-A3B load's time), and a prefill and a decode node on one host each held
//! their own copy. A pack holds the repacked bytes, so a load maps them instead: the
//! matrices are page cache, shared by every process on the host that maps the same pack,
//! and nothing is repacked.
//!
//! A pack names the model file it was made from (its length and modification time) and
//! the layout version of its bytes; one that does not match, or does not parse, is
//! rebuilt, never trusted. A pack is written under a temporary name and renamed into
//! place, so a mapped pack is never written again.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::kquant::{KMatrix, PartShape};
use crate::q4::Q41Matrix;
use crate::q8::Q80Matrix;

/// The first bytes of every pack.
const MAGIC: &[u8; 8] = b"TANDEMPK";
/// The version of the layouts a pack's bytes are in: raise it with any change to
/// [`crate::kquant::format`] or [`Q80Matrix`]'s layout, so older packs are rebuilt rather
/// than misread. 2: Q8_0 matrices. 3: Q4_1 matrices.
pub const LAYOUT_VERSION: u32 = 3;
/// Where the data starts, and each matrix within it, is a multiple of this.
const ALIGN: u64 = 4096;
/// Bytes before the header: the magic, the layout version and the header's length.
const PREAMBLE: usize = 8 + 4 + 8;

/// A matrix's bytes built at load, as one `Bytes` like those a pack maps: held as the `Vec`
/// of its widest values so that they are aligned for reading in place, as [`ALIGN`] aligns
/// a mapped matrix.
pub(crate) fn aligned_bytes<T: bytemuck::Pod + Send + Sync>(values: Vec<T>) -> Bytes {
    Bytes::from_owner(Aligned(values))
}

struct Aligned<T>(Vec<T>);

impl<T: bytemuck::Pod> AsRef<[u8]> for Aligned<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// Why a pack was not used.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("no pack yet")]
    Missing,
    #[error("cannot read or write the pack: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a pack file")]
    NotAPack,
    #[error("packed in layout {found}, this build reads {LAYOUT_VERSION}")]
    Layout { found: u32 },
    #[error("made from another version of the model file")]
    Stale,
    #[error("damaged: {0}")]
    Damaged(String),
}

/// The model file a pack was made from, as far as its metadata tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceId {
    len: u64,
    modified_secs: u64,
    modified_nanos: u32,
}

impl SourceId {
    /// The identity of the model file at `path`.
    pub fn of(path: &Path) -> std::io::Result<Self> {
        let meta = std::fs::metadata(path)?;
        let modified = meta
            .modified()?
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Ok(Self {
            len: meta.len(),
            modified_secs: modified.as_secs(),
            modified_nanos: modified.subsec_nanos(),
        })
    }
}

/// A pack's header: what it was made from and where each matrix lies after the header.
#[derive(Debug, Serialize, Deserialize)]
struct Header {
    source: SourceId,
    matrices: Vec<Entry>,
    /// Its own length in the file, as the preamble gives it (not stored in the JSON).
    #[serde(skip)]
    len: u64,
}

/// One matrix of a pack, under the key its loader gave it (the names of the tensors it
/// was made from).
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    key: String,
    shape: Shape,
    /// From the start of the data.
    offset: u64,
    len: u64,
}

/// What a matrix's bytes hold: what its kernel needs besides them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Shape {
    KQuant { cols: usize, parts: Vec<PartShape> },
    Q8_0 { rows: usize, cols: usize },
    Q4_1 { rows: usize, cols: usize },
}

/// A matrix a pack holds, in the layout its kernel reads.
#[derive(Debug, Clone)]
pub enum PackedMatrix {
    K(Arc<KMatrix>),
    Q80(Arc<Q80Matrix>),
    Q41(Arc<Q41Matrix>),
}

impl PackedMatrix {
    fn shape(&self) -> Shape {
        match self {
            Self::K(m) => Shape::KQuant {
                cols: m.cols(),
                parts: m.shape().to_vec(),
            },
            Self::Q80(m) => Shape::Q8_0 {
                rows: m.rows(),
                cols: m.cols(),
            },
            Self::Q41(m) => Shape::Q4_1 {
                rows: m.rows(),
                cols: m.cols(),
            },
        }
    }

    /// Its bytes, as a pack stores them.
    pub fn data(&self) -> &[u8] {
        match self {
            Self::K(m) => m.data(),
            Self::Q80(m) => m.data(),
            Self::Q41(m) => m.data(),
        }
    }

    /// Its outputs and inputs.
    pub fn rows_cols(&self) -> (usize, usize) {
        match self {
            Self::K(m) => (m.rows(), m.cols()),
            Self::Q80(m) => (m.rows(), m.cols()),
            Self::Q41(m) => (m.rows(), m.cols()),
        }
    }

    /// `x Wᵀ` for `x` of `[n, cols]` (row-major): `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        match self {
            Self::K(m) => m.matmul(x, n),
            Self::Q80(m) => m.matmul(x, n),
            Self::Q41(m) => m.matmul(x, n),
        }
    }
}

/// The pack file for the model at `model` in `dir`: named for the model file's name and
/// its full path, so that two models of one name keep two packs.
pub fn path_for(dir: &Path, model: &Path) -> PathBuf {
    let full = std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf());
    let digest = Sha256::digest(full.as_os_str().as_encoded_bytes());
    let tag: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let name = model
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    dir.join(format!("{name}.{tag}.tpack"))
}

/// A pack mapped into memory, its matrices by key.
pub struct Mapped {
    data: Bytes,
    entries: HashMap<String, Entry>,
}

impl Mapped {
    /// Maps the pack at `path`, made from the model file `source` is the identity of.
    pub fn open(path: &Path, source: SourceId) -> Result<Self, PackError> {
        let file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(PackError::Missing),
            Err(e) => return Err(e.into()),
        };
        // SAFETY: a mapping is undefined behaviour if the file changes while mapped. A
        // pack is only ever written under a name of its own and renamed into place
        // ([`write`]), so the file mapped here is never written again.
        let peek = unsafe { memmap2::Mmap::map(&file)? };
        let header = parse(&peek, source)?;
        drop(peek);
        // Mapped again to read every page in now, so that the first request does not
        // fault them in, and only once the pack is known to fit: a stale one is not read.
        // SAFETY: as above, the file is never written again.
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file)? };
        if map.len() < PREAMBLE || header_len(&map) != header.len {
            return Err(PackError::Damaged(
                "the pack changed while it was opened".into(),
            ));
        }
        let start = data_start(header.len).expect("parse checked the header's length");
        let data = Bytes::from_owner(map).slice(start as usize..);
        let mut entries = HashMap::with_capacity(header.matrices.len());
        for entry in header.matrices {
            let end = entry.offset.checked_add(entry.len);
            if end.is_none_or(|end| end > data.len() as u64) {
                return Err(PackError::Damaged(format!(
                    "{} lies past the end",
                    entry.key
                )));
            }
            entries.insert(entry.key.clone(), entry);
        }
        Ok(Self { data, entries })
    }

    /// The `[rows, cols]` matrix under `key`, its bytes those of the mapping, where the
    /// pack holds one of that shape whose shape makes exactly its bytes.
    pub fn matrix(&self, key: &str, rows_cols: (usize, usize)) -> Option<PackedMatrix> {
        let entry = self.entries.get(key)?;
        let at = entry.offset as usize;
        let bytes = self.data.slice(at..at + entry.len as usize);
        let m = match &entry.shape {
            Shape::KQuant { cols, parts } => PackedMatrix::K(Arc::new(
                KMatrix::from_packed(parts.clone(), *cols, bytes).ok()?,
            )),
            &Shape::Q8_0 { rows, cols } => {
                PackedMatrix::Q80(Arc::new(Q80Matrix::from_packed(rows, cols, bytes).ok()?))
            }
            &Shape::Q4_1 { rows, cols } => {
                PackedMatrix::Q41(Arc::new(Q41Matrix::from_packed(rows, cols, bytes).ok()?))
            }
        };
        (m.rows_cols() == rows_cols).then_some(m)
    }
}

/// The header's length, from pack bytes `map` of at least [`PREAMBLE`] bytes.
fn header_len(map: &[u8]) -> u64 {
    u64::from_le_bytes(map[12..PREAMBLE].try_into().expect("eight bytes"))
}

/// Where the data of a pack whose header is `header_len` bytes starts; `None` for a
/// length no file has.
fn data_start(header_len: u64) -> Option<u64> {
    (PREAMBLE as u64)
        .checked_add(header_len)?
        .checked_next_multiple_of(ALIGN)
}

/// The header of pack bytes `map`, refused unless it is a pack of this layout made from
/// `source` whose data is all there.
fn parse(map: &[u8], source: SourceId) -> Result<Header, PackError> {
    if map.len() < PREAMBLE || &map[..8] != MAGIC {
        return Err(PackError::NotAPack);
    }
    let found = u32::from_le_bytes(map[8..12].try_into().expect("four bytes"));
    if found != LAYOUT_VERSION {
        return Err(PackError::Layout { found });
    }
    let len = header_len(map);
    if data_start(len).is_none_or(|start| start > map.len() as u64) {
        return Err(PackError::Damaged("the header runs past the end".into()));
    }
    let mut header: Header = serde_json::from_slice(&map[PREAMBLE..PREAMBLE + len as usize])
        .map_err(|e| PackError::Damaged(e.to_string()))?;
    header.len = len;
    if header.source != source {
        return Err(PackError::Stale);
    }
    Ok(header)
}

/// Writes `matrices` (each under its key) as the pack at `path` of the model file
/// `source` is the identity of: under a temporary name first, then renamed over any pack
/// there, so a process mapping the old one keeps reading the old file. The folder is made
/// if it is not there, as a cache's first use finds it.
pub fn write(
    path: &Path,
    source: SourceId,
    matrices: &[(String, PackedMatrix)],
) -> Result<(), PackError> {
    let mut offset = 0u64;
    let entries: Vec<Entry> = matrices
        .iter()
        .map(|(key, m)| {
            let entry = Entry {
                key: key.clone(),
                shape: m.shape(),
                offset,
                len: m.data().len() as u64,
            };
            offset = (offset + entry.len).next_multiple_of(ALIGN);
            entry
        })
        .collect();
    let header = serde_json::to_vec(&Header {
        source,
        matrices: entries,
        len: 0,
    })
    .map_err(|e| PackError::Damaged(e.to_string()))?;
    // A name no other writer has: workers in containers on one host often share a pid.
    let nanos = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tpack.{}-{nanos}.tmp", std::process::id()));
    let written = write_file(&tmp, &header, matrices);
    match written.and_then(|()| Ok(std::fs::rename(&tmp, path)?)) {
        Ok(()) => Ok(()),
        Err(e) => {
            // Best effort: the write already failed, and a stray temporary file is all
            // there is to tidy.
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

fn write_file(
    path: &Path,
    header: &[u8],
    matrices: &[(String, PackedMatrix)],
) -> Result<(), PackError> {
    // Never a file another writer has open: a name taken is an error, not shared.
    let mut out = BufWriter::new(File::options().write(true).create_new(true).open(path)?);
    out.write_all(MAGIC)?;
    out.write_all(&LAYOUT_VERSION.to_le_bytes())?;
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(header)?;
    let mut at = (PREAMBLE + header.len()) as u64;
    for (_, m) in matrices {
        let to = at.next_multiple_of(ALIGN);
        out.write_all(&vec![0; (to - at) as usize])?;
        out.write_all(m.data())?;
        at = to + m.data().len() as u64;
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests;
