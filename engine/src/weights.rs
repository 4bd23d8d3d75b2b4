//! Reading tensors by name from a Hugging Face safetensors folder or a GGUF file.
//!
//! Both sources hand out `Linear` layers: dense f32 for safetensors, and GGML block-quantized
//! for GGUF, so that Q4/Q8 weights stay quantized in memory.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use serde::Deserialize;

use crate::error::{EngineError, Result};
use crate::q4::Q41Matrix;
use crate::q8::Q80Matrix;

/// A projection's weight: candle's (dense or block-quantized), or one of our kernels.
#[derive(Debug, Clone)]
enum Weight {
    Candle(QMatMul),
    Q41(Arc<Q41Matrix>),
    Q80(Arc<Q80Matrix>),
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
            Weight::Q41(w) => ours(xs, |x, n| w.matmul(x, n))?,
            Weight::Q80(w) => ours(xs, |x, n| w.matmul(x, n))?,
        };
        Ok(match &self.bias {
            Some(b) => ys.broadcast_add(b)?,
            None => ys,
        })
    }

    /// Bytes a forward pass reads from this layer's weights (and bias).
    pub fn weight_bytes(&self) -> usize {
        let dense = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let w = match &self.weight {
            Weight::Candle(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => dense(t),
            Weight::Q41(q) => q.bytes(),
            Weight::Q80(q) => q.bytes(),
        };
        w + self.bias.as_ref().map_or(0, dense)
    }
}

/// One of our kernels applied to `(rows, in_features)` activations.
fn ours(xs: &Tensor, matmul: impl Fn(&[f32], usize) -> Vec<f32>) -> Result<Tensor> {
    let (n, _) = xs.dims2()?;
    let x: Vec<f32> = xs.flatten_all()?.to_vec1()?;
    let out = matmul(&x, n);
    let cols = out.len() / n.max(1);
    Ok(Tensor::from_vec(out, (n, cols), xs.device())?)
}

/// Tensors by name, from either file format.
pub enum WeightSource {
    SafeTensors {
        path: PathBuf,
        tensors: HashMap<String, Tensor>,
    },
    Gguf {
        path: PathBuf,
        content: gguf_file::Content,
        reader: BufReader<File>,
    },
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl WeightSource {
    /// Loads `model.safetensors` or the shards named by `model.safetensors.index.json`.
    pub fn open_hf_folder(dir: &Path, device: &Device) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| EngineError::io(&index, e))?;
            let idx: ShardIndex = serde_json::from_str(&text)
                .map_err(|e| EngineError::invalid_model(&index, e.to_string()))?;
            let mut shards: Vec<String> = idx.weight_map.into_values().collect();
            shards.sort();
            shards.dedup();
            shards.into_iter().map(|s| dir.join(s)).collect()
        } else {
            return Err(EngineError::invalid_model(
                dir,
                "no model.safetensors or model.safetensors.index.json",
            ));
        };
        let mut tensors = HashMap::new();
        for file in &files {
            let loaded = candle_core::safetensors::load(file, device)
                .map_err(|e| EngineError::invalid_model(file, e.to_string()))?;
            tensors.extend(loaded);
        }
        Ok(Self::SafeTensors {
            path: dir.to_path_buf(),
            tensors,
        })
    }

    /// Opens a GGUF file; tensors are read lazily by name.
    pub fn open_gguf(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
        let mut reader = BufReader::new(file);
        let content = gguf_file::Content::read(&mut reader)
            .map_err(|e| EngineError::invalid_model(path, e.to_string()))?;
        Ok(Self::Gguf {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    /// The GGUF header (metadata and tensor index), for GGUF sources.
    pub fn gguf_content(&self) -> Option<&gguf_file::Content> {
        match self {
            Self::Gguf { content, .. } => Some(content),
            Self::SafeTensors { .. } => None,
        }
    }

    fn path(&self) -> &Path {
        match self {
            Self::SafeTensors { path, .. } | Self::Gguf { path, .. } => path,
        }
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        match self {
            Self::SafeTensors { tensors, .. } => tensors.contains_key(name),
            Self::Gguf { content, .. } => content.tensor_infos.contains_key(name),
        }
    }

    fn qtensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        match self {
            Self::Gguf {
                path,
                content,
                reader,
            } => content
                .tensor(reader, name, device)
                .map_err(|e| EngineError::invalid_model(path.as_path(), format!("{name}: {e}"))),
            Self::SafeTensors { .. } => unreachable!("qtensor is only called for GGUF"),
        }
    }

    /// A tensor converted to f32, whatever its stored type.
    pub fn dense(&mut self, name: &str, device: &Device) -> Result<Tensor> {
        match self {
            Self::SafeTensors { path, tensors } => {
                let t = tensors.get(name).ok_or_else(|| {
                    EngineError::invalid_model(path.as_path(), format!("missing tensor {name}"))
                })?;
                Ok(t.to_dtype(DType::F32)?)
            }
            Self::Gguf { .. } => Ok(self.qtensor(name, device)?.dequantize(device)?),
        }
    }

    /// A tensor whose shape must be `shape`.
    pub fn dense_shaped(&mut self, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
        let t = self.dense(name, device)?;
        if t.dims() != shape {
            return Err(EngineError::invalid_model(
                self.path(),
                format!("{name} has shape {:?}, expected {shape:?}", t.dims()),
            ));
        }
        Ok(t)
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
            Self::SafeTensors { .. } => Weight::Candle(QMatMul::Tensor(self.dense_shaped(
                name,
                &[out_in.0, out_in.1],
                device,
            )?)),
            Self::Gguf { .. } => {
                let q = self.qtensor(name, device)?;
                if q.shape().dims() != [out_in.0, out_in.1] {
                    return Err(EngineError::invalid_model(
                        self.path(),
                        format!("{name} has shape {:?}, expected {out_in:?}", q.shape()),
                    ));
                }
                // candle multiplies Q4_1 with scalar code and Q8_0 one output at a time;
                // ours give the same values faster.
                if q.dtype() == GgmlDType::Q4_1 && device.is_cpu() {
                    let bytes = q.data()?.into_owned();
                    Weight::Q41(Arc::new(Q41Matrix::from_ggml(bytes, out_in.0, out_in.1)?))
                } else if q.dtype() == GgmlDType::Q8_0 && device.is_cpu() && Q80Matrix::supported()
                {
                    let m = Q80Matrix::from_ggml(&q.data()?, out_in.0, out_in.1)?;
                    Weight::Q80(Arc::new(m))
                } else {
                    Weight::Candle(QMatMul::from_arc(Arc::new(q))?)
                }
            }
        };
        let bias = match bias {
            Some(b) if self.contains(b) => Some(self.dense_shaped(b, &[out_in.0], device)?),
            _ => None,
        };
        Ok(Linear { weight, bias })
    }
}
