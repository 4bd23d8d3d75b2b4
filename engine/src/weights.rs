//! Reading tensors by name from a Hugging Face safetensors folder or a GGUF file.
//!
//! Both sources hand out `Linear` layers: dense for safetensors (f32, bf16 and f16 used
//! where they lie in the mapped files, or a GPU's copied as stored:
//! [`DenseMatrices`]), and GGML block-quantized for GGUF, so that Q4/Q8 weights stay
//! quantized in memory.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use serde::Deserialize;

use crate::dense_matrix::{DenseMatrix, Stored};
use crate::embedding::Embedding;
use crate::error::{EngineError, Result};
use crate::kquant::KMatrix;
use crate::pack::PackedMatrix;
use crate::q4::Q41Matrix;
use crate::q8::Q80Matrix;

mod dense;
mod in_place;
mod kernels;
mod mapped;
mod packed;

pub use dense::DenseMatrices;

use kernels::{joined_bias, quantized_weight, stack_joined};
pub use kernels::{quantized_linear, stack_quantized};

pub use packed::PackReport;

/// A projection's weight: candle's (dense or block-quantized), or one of our kernels.
#[derive(Debug, Clone)]
enum Weight {
    Candle(QMatMul),
    Q41(Arc<Q41Matrix>),
    Q80(Arc<Q80Matrix>),
    K(Arc<KMatrix>),
    /// A folder's bf16 or f16 matrix, as stored ([`DenseMatrices::AsStored`]).
    Half(Tensor),
    /// A folder's or GGUF file's bf16, f16 or f32 matrix where it lies in the mapped file
    /// ([`DenseMatrices::InPlace`], `WeightSource::gguf_mapped_matrix`).
    Mapped(Arc<DenseMatrix>),
}

impl From<PackedMatrix> for Weight {
    fn from(m: PackedMatrix) -> Self {
        match m {
            PackedMatrix::K(m) => Self::K(m),
            PackedMatrix::Q80(m) => Self::Q80(m),
            PackedMatrix::Q41(m) => Self::Q41(m),
        }
    }
}

/// A `y = x Wᵀ + b` projection, dense or quantized.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
}

impl Linear {
    /// Applies the projection to `(rows, in_features)` activations.
    pub fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let ys = match &self.weight {
            Weight::Candle(w) => w.forward(xs)?,
            Weight::Q41(w) => apply_ours(xs, |x, n| w.matmul(x, n))?,
            Weight::Q80(w) => apply_ours(xs, |x, n| w.matmul(x, n))?,
            Weight::K(w) => apply_ours(xs, |x, n| w.matmul(x, n))?,
            Weight::Half(w) => dense::half_product(xs, w)?,
            Weight::Mapped(w) => apply_ours(xs, |x, n| w.matmul(x, n))?,
        };
        Ok(match &self.bias {
            Some(b) => ys.broadcast_add(b)?,
            None => ys,
        })
    }

    /// The K-quant matrix of a projection without a bias, where our kernel holds it.
    pub(crate) fn k_matrix(&self) -> Option<&Arc<KMatrix>> {
        match (&self.weight, &self.bias) {
            (Weight::K(m), None) => Some(m),
            _ => None,
        }
    }

    /// Whether the weight is used where it lies in a mapped file.
    pub(crate) fn in_place(&self) -> bool {
        matches!(self.weight, Weight::Mapped(_))
    }

    /// A projection of `weight` without a bias.
    fn unbiased(weight: Weight) -> Self {
        Self { weight, bias: None }
    }

    /// A projection of a dense `[out, in]` weight, without a bias: an f32 one multiplied
    /// in f32, a bf16 or f16 one in its own type.
    pub fn dense(weight: Tensor) -> Self {
        let weight = match weight.dtype() {
            DType::BF16 | DType::F16 => Weight::Half(weight),
            _ => Weight::Candle(QMatMul::Tensor(weight)),
        };
        Self::unbiased(weight)
    }

    /// Bytes a forward pass reads from this layer's weights (and bias).
    pub fn weight_bytes(&self) -> usize {
        let dense = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let w = match &self.weight {
            Weight::Candle(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) | Weight::Half(t) => {
                dense(t)
            }
            Weight::Q41(q) => q.bytes(),
            Weight::Q80(q) => q.bytes(),
            Weight::K(q) => q.bytes(),
            Weight::Mapped(m) => m.bytes(),
        };
        w + self.bias.as_ref().map_or(0, dense)
    }
}

/// Projections of the same input, such as q, k and v. Where our kernels hold all of them
/// they are stacked into one matrix at load, so a step quantizes the input once and hands
/// the workers one product instead of one per projection; every output row is computed
/// exactly as it would be alone.
#[derive(Debug, Clone)]
pub struct Stacked {
    joined: Option<Linear>,
    parts: Vec<Linear>,
    widths: Vec<usize>,
}

impl Stacked {
    /// Each projection of `(rows, in_features)` activations, in the order they were named.
    pub fn forward(&self, xs: &Tensor) -> Result<Vec<Tensor>> {
        let Some(joined) = &self.joined else {
            return self.parts.iter().map(|p| p.forward(xs)).collect();
        };
        let ys = joined.forward(xs)?;
        let mut at = 0;
        self.widths
            .iter()
            .map(|&w| {
                at += w;
                Ok(ys.narrow(1, at - w, w)?)
            })
            .collect()
    }

    /// Projections stacked into `joined`, their outputs `widths` wide.
    pub(crate) fn joined(joined: Linear, widths: Vec<usize>) -> Self {
        Self {
            joined: Some(joined),
            parts: Vec::new(),
            widths,
        }
    }

    /// The one K-quant matrix all the projections were stacked into, where there is one.
    pub(crate) fn k_matrix(&self) -> Option<&Arc<KMatrix>> {
        self.joined.as_ref().and_then(Linear::k_matrix)
    }

    /// Bytes a forward pass reads from the weights (and biases).
    pub fn weight_bytes(&self) -> usize {
        self.joined
            .iter()
            .chain(&self.parts)
            .map(Linear::weight_bytes)
            .sum()
    }
}

/// One of our kernels applied to `(rows, in_features)` activations: `[rows, out]`.
fn apply_ours(xs: &Tensor, matmul: impl Fn(&[f32], usize) -> Vec<f32>) -> Result<Tensor> {
    let (n, _) = xs.dims2()?;
    let out = with_f32_rows(xs, |x| matmul(x, n))?;
    let cols = out.len() / n.max(1);
    Ok(Tensor::from_vec(out, (n, cols), xs.device())?)
}

/// `f` of `(rows, in_features)` activations as one row-major f32 slice, read in place
/// where they are contiguous f32 on the CPU (copying a 512-token prompt's rows out for
/// each product was a tenth of its prefill).
pub(crate) fn with_f32_rows<T>(xs: &Tensor, f: impl FnOnce(&[f32]) -> T) -> Result<T> {
    {
        let (storage, layout) = xs.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            if xs.dtype() == DType::F32 {
                return Ok(f(&cpu.as_slice::<f32>()?[start..end]));
            }
        }
    }
    Ok(f(&xs.flatten_all()?.to_vec1::<f32>()?))
}

/// Tensors by name, from either file format, with the names read so far: a tensor the
/// model never reads is one the engine does not implement ([`WeightSource::unread`]).
pub enum WeightSource {
    SafeTensors {
        path: PathBuf,
        /// The folder's files, mapped: each tensor is used where it lies or converted from
        /// its pages when the model reads it, so no other copy of the file is ever held.
        files: mapped::MappedFolder,
        read: HashSet<String>,
        /// How its matrices are held.
        matrices: DenseMatrices,
    },
    Gguf {
        path: PathBuf,
        content: gguf_file::Content,
        reader: BufReader<File>,
        /// The whole file, mapped, for the blocks used where they lie (the embedding
        /// table); the rest is read, so that its pages are not counted as this process's.
        map: Bytes,
        read: HashSet<String>,
        /// The pack its K-quant matrices are mapped from and kept in, where the load uses one.
        pack: Option<Box<packed::PackSession>>,
    },
}

/// A GGUF file opened for its weights, and its tensors as the header lists them (what
/// the memory check reads before any weight).
pub struct ListedGguf {
    pub source: WeightSource,
    pub tensors: Vec<crate::footprint::TensorHeader>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

/// The safetensors files of a Hugging Face folder: `model.safetensors`, or the shards
/// `model.safetensors.index.json` names.
pub(crate) fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    if single.exists() {
        return Ok(vec![single]);
    }
    if !index.exists() {
        return Err(EngineError::invalid_model(
            dir,
            "no model.safetensors or model.safetensors.index.json",
        ));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| EngineError::io(&index, e))?;
    let idx: ShardIndex = serde_json::from_str(&text)
        .map_err(|e| EngineError::invalid_model(&index, e.to_string()))?;
    let mut shards: Vec<String> = idx.weight_map.into_values().collect();
    shards.sort();
    shards.dedup();
    Ok(shards.into_iter().map(|s| dir.join(s)).collect())
}

impl WeightSource {
    /// Maps `model.safetensors` or the shards named by `model.safetensors.index.json`;
    /// tensors are read by name, matrices held as `matrices` say.
    pub fn open_hf_folder(dir: &Path, matrices: DenseMatrices) -> Result<Self> {
        let paths = safetensors_files(dir)?;
        let in_place = matrices == DenseMatrices::InPlace;
        let files = mapped::MappedFolder::open(dir, &paths, in_place)?;
        Ok(Self::SafeTensors {
            path: dir.to_path_buf(),
            files,
            read: HashSet::new(),
            matrices,
        })
    }

    /// Opens a GGUF file; tensors are read lazily by name.
    pub fn open_gguf(path: &Path) -> Result<Self> {
        Ok(Self::open_gguf_listed(path)?.source)
    }

    /// [`WeightSource::open_gguf`], with the file's tensors as its header lists them.
    pub fn open_gguf_listed(path: &Path) -> Result<ListedGguf> {
        let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
        // SAFETY: the mapping is undefined behaviour if the file changes while mapped. A
        // model file is not written while a node serves it (a file replaced by renaming
        // another over it leaves this mapping as it was); a file cut short in place would
        // fault the reads past its new end, as it would llama.cpp's mapping.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?;
        let mut reader = BufReader::new(file);
        let content = gguf_file::Content::read(&mut reader)
            .map_err(|e| EngineError::invalid_model(path, e.to_string()))?;
        let tensors = crate::footprint::gguf_headers(&content);
        let source = Self::Gguf {
            path: path.to_path_buf(),
            content,
            reader,
            map: Bytes::from_owner(map),
            read: HashSet::new(),
            pack: None,
        };
        Ok(ListedGguf { source, tensors })
    }

    /// The folder or file the weights come from.
    pub fn path(&self) -> &Path {
        match self {
            Self::SafeTensors { path, .. } | Self::Gguf { path, .. } => path,
        }
    }

    /// The tensors of the file that nothing has read, by name.
    pub fn unread(&self) -> Vec<String> {
        let all: Vec<String> = match self {
            Self::SafeTensors { files, .. } => files.names().cloned().collect(),
            Self::Gguf { content, .. } => content.tensor_infos.keys().cloned().collect(),
        };
        let read = match self {
            Self::SafeTensors { read, .. } | Self::Gguf { read, .. } => read,
        };
        let mut names: Vec<String> = all.into_iter().filter(|n| !read.contains(n)).collect();
        names.sort_unstable();
        names
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        match self {
            Self::SafeTensors { files, .. } => files.contains(name),
            Self::Gguf { content, .. } => content.tensor_infos.contains_key(name),
        }
    }

    fn qtensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        match self {
            Self::Gguf {
                path,
                content,
                reader,
                read,
                ..
            } => {
                read.insert(name.to_string());
                content
                    .tensor(reader, name, device)
                    .map_err(|e| EngineError::invalid_model(path.as_path(), format!("{name}: {e}")))
            }
            Self::SafeTensors { .. } => unreachable!("qtensor is only called for GGUF"),
        }
    }

    /// A tensor converted to f32, whatever its stored type.
    pub fn dense(&mut self, name: &str, device: &Device) -> Result<Tensor> {
        match self {
            Self::SafeTensors { .. } => self.folder_tensor(name, DenseMatrices::F32, device),
            Self::Gguf { .. } => Ok(self.qtensor(name, device)?.dequantize(device)?),
        }
    }

    /// A tensor whose shape must be `shape`.
    pub fn dense_shaped(&mut self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
        let t = self.dense(name, device)?;
        self.shaped(name, t, shape)
    }

    /// `t`, the tensor `name`, if its shape is `shape`.
    fn shaped(&self, name: &str, t: Tensor, shape: &[usize]) -> Result<Tensor> {
        if t.dims() != shape {
            return Err(EngineError::invalid_model(
                self.path(),
                format!("{name} has shape {:?}, expected {shape:?}", t.dims()),
            ));
        }
        Ok(t)
    }

    /// The `[vocab, hidden]` token embedding table: a folder's held as its matrices are, a
    /// GGUF file's as stored ([`Embedding`]).
    pub fn embedding(
        &mut self,
        name: &str,
        vocab_hidden: (usize, usize),
        device: &Device,
    ) -> Result<Embedding> {
        if self.is_gguf() {
            return self.embedding_in_place(name, vocab_hidden);
        }
        let shape = [vocab_hidden.0, vocab_hidden.1];
        match self.folder_in_place(name, shape)? {
            Some((stored, bytes)) => {
                Ok(Embedding::from_blocks(stored.ggml(), vocab_hidden, bytes)?)
            }
            None => Ok(Embedding::Dense(self.folder_matrix(name, shape, device)?)),
        }
    }

    /// A projection `[out, in]`, with its bias when `bias` names one that exists.
    pub fn linear(
        &mut self,
        name: &str,
        bias: Option<&str>,
        out_in: (usize, usize),
        device: &Device,
    ) -> Result<Linear> {
        let weight = match self {
            Self::SafeTensors { .. } => {
                let shape = [out_in.0, out_in.1];
                match self.folder_mapped_matrix(name, shape)? {
                    Some(m) => Weight::Mapped(Arc::new(m)),
                    None => Linear::dense(self.folder_matrix(name, shape, device)?).weight,
                }
            }
            Self::Gguf { .. } => {
                match self.gguf_mapped_matrix(name, [out_in.0, out_in.1], device)? {
                    Some(m) => Weight::Mapped(Arc::new(m)),
                    None => match self.packed(name, &[name], out_in) {
                        Some(weight) => weight,
                        None => {
                            let q = self.qtensor_shaped(name, out_in, device)?;
                            let weight = quantized_weight(q, out_in, device)?;
                            self.keep_packed(name.to_string(), &weight);
                            weight
                        }
                    },
                }
            }
        };
        let bias = self.bias(bias, out_in.0, device)?;
        Ok(Linear { weight, bias })
    }

    /// Projections of one input, `parts` naming each one's weight, bias and outputs, all
    /// with `cols` inputs: stacked into one of our matrices when they all can be.
    pub fn stacked(
        &mut self,
        parts: &[(&str, Option<&str>, usize)],
        cols: usize,
        device: &Device,
    ) -> Result<Stacked> {
        let widths: Vec<usize> = parts.iter().map(|p| p.2).collect();
        let in_place = parts
            .iter()
            .any(|p| self.gguf_mapped_type(p.0, device).is_some());
        if !self.is_gguf() || in_place {
            let parts = parts
                .iter()
                .map(|&(name, bias, rows)| self.linear(name, bias, (rows, cols), device))
                .collect::<Result<_>>()?;
            return Ok(Stacked {
                joined: None,
                parts,
                widths,
            });
        }
        let biases = parts
            .iter()
            .map(|&(_, bias, rows)| self.bias(bias, rows, device))
            .collect::<Result<Vec<_>>>()?;
        let names: Vec<&str> = parts.iter().map(|p| p.0).collect();
        let key = names.join("+");
        let joined = joined_bias(&biases)?;
        if let Some(bias) = &joined {
            if let Some(weight) = self.packed(&key, &names, (widths.iter().sum(), cols)) {
                let bias = bias.clone();
                return Ok(Stacked::joined(Linear { weight, bias }, widths));
            }
        }
        let qs = parts
            .iter()
            .map(|&(name, _, rows)| self.qtensor_shaped(name, (rows, cols), device))
            .collect::<Result<Vec<_>>>()?;
        let stacked = stack_joined(qs, biases, joined, widths, cols, device)?;
        if let Some(joined) = &stacked.joined {
            self.keep_packed(key, &joined.weight);
        }
        Ok(stacked)
    }

    /// Whether the weights come from a GGUF file (else from a Hugging Face folder).
    pub fn is_gguf(&self) -> bool {
        matches!(self, Self::Gguf { .. })
    }

    /// Projections of one input stored as one matrix (Phi-3's `qkv_proj` and
    /// `gate_up_proj`): its rows are the parts' outputs one after another, `widths` each.
    pub fn fused(
        &mut self,
        name: &str,
        widths: &[usize],
        cols: usize,
        device: &Device,
    ) -> Result<Stacked> {
        let rows = widths.iter().sum();
        Ok(Stacked {
            joined: Some(self.linear(name, None, (rows, cols), device)?),
            parts: Vec::new(),
            widths: widths.to_vec(),
        })
    }
}

impl WeightSource {
    /// A GGUF tensor that must have shape `[out, in]`.
    fn qtensor_shaped(
        &mut self,
        name: &str,
        out_in: (usize, usize),
        device: &Device,
    ) -> Result<QTensor> {
        let q = self.qtensor(name, device)?;
        if q.shape().dims() != [out_in.0, out_in.1] {
            return Err(EngineError::invalid_model(
                self.path(),
                format!("{name} has shape {:?}, expected {out_in:?}", q.shape()),
            ));
        }
        Ok(q)
    }

    /// Our kernel's matrix over `bytes`, the tensor `name` used where it lies: refused as
    /// the model's fault where they are not a `shape` matrix of `stored` values.
    fn in_place_matrix(
        &self,
        name: &str,
        stored: Stored,
        [rows, cols]: [usize; 2],
        bytes: Bytes,
    ) -> Result<DenseMatrix> {
        DenseMatrix::new(stored, rows, cols, bytes)
            .map_err(|e| EngineError::invalid_model(self.path(), format!("{name}: {e}")))
    }

    /// The bias named `name` if it exists, as `[rows]`.
    fn bias(&mut self, name: Option<&str>, rows: usize, device: &Device) -> Result<Option<Tensor>> {
        match name {
            Some(b) if self.contains(b) => Ok(Some(self.dense_shaped(b, &[rows], device)?)),
            _ => Ok(None),
        }
    }
}
