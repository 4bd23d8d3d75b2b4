//! The token embedding table. A step reads one row of it per token, so a GGUF file's table
//! stays in the blocks the file stores and only the rows a step gathers are dequantized:
//! widened to f32 whole it was the largest thing a model held (a 7B Qwen2.5's 152k × 3584
//! table is 2.2 GB in f32 against 0.31 GB in Q4_K).

use bytes::Bytes;
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::error::{EngineError, Result};

/// A `[vocab, hidden]` table.
pub enum Embedding {
    /// A Hugging Face folder's, in f32 or as stored ([`crate::weights::DenseMatrices`]).
    Dense(Tensor),
    /// A GGUF file's, as stored: a row of `width` values in `row_bytes` bytes, read where
    /// they lie in the mapped file.
    Blocks {
        dtype: GgmlDType,
        width: usize,
        row_bytes: usize,
        bytes: Bytes,
    },
}

impl Embedding {
    /// A GGUF tensor kept in its own type.
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        let (vocab, width) = q.shape().dims2()?;
        Self::from_blocks(
            q.dtype(),
            (vocab, width),
            Bytes::from(q.data()?.into_owned()),
        )
    }

    /// A `[vocab, width]` table of `dtype` blocks, `bytes` exactly: refused unless each row
    /// is whole blocks, so that a row starts where its index says.
    pub fn from_blocks(
        dtype: GgmlDType,
        (vocab, width): (usize, usize),
        bytes: Bytes,
    ) -> Result<Self> {
        let row_bytes = width / dtype.block_size() * dtype.type_size();
        if !width.is_multiple_of(dtype.block_size())
            || vocab.checked_mul(row_bytes) != Some(bytes.len())
        {
            return Err(EngineError::InvalidInput(format!(
                "{} bytes of {dtype:?} are not a [{vocab}, {width}] table of whole-block rows",
                bytes.len()
            )));
        }
        Ok(Self::Blocks {
            dtype,
            width,
            row_bytes,
            bytes,
        })
    }

    /// The rows of `ids`, in f32, `[ids.len(), hidden]`. The caller has checked every id
    /// against the vocabulary.
    pub fn lookup(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        match self {
            Self::Dense(table) => {
                let ids = Tensor::new(ids, device)?;
                Ok(table.index_select(&ids, 0)?.to_dtype(DType::F32)?)
            }
            Self::Blocks {
                dtype,
                width,
                row_bytes,
                bytes,
            } => {
                let mut rows = Vec::with_capacity(ids.len() * row_bytes);
                for &id in ids {
                    let at = id as usize * row_bytes;
                    rows.extend_from_slice(&bytes[at..at + row_bytes]);
                }
                let q = qtensor_from_ggml(*dtype, &rows, vec![ids.len(), *width], device)?;
                Ok(q.dequantize(device)?)
            }
        }
    }

    /// The bytes the table holds.
    pub fn resident_bytes(&self) -> usize {
        match self {
            Self::Dense(table) => table.elem_count() * table.dtype().size_in_bytes(),
            Self::Blocks { bytes, .. } => bytes.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;

    /// Every stored type a GGUF embedding comes in gives, row by row, what dequantizing the
    /// whole table gives.
    #[test]
    fn gathered_rows_equal_the_whole_tables_rows() {
        let device = Device::Cpu;
        let (vocab, width) = (7, 512);
        let values: Vec<f32> = (0..vocab * width)
            .map(|i| ((i * 7919) % 1013) as f32 / 500.0 - 1.0)
            .collect();
        let dense = Tensor::from_vec(values, (vocab, width), &device).unwrap();
        let ids = [6u32, 0, 3, 3, 1];
        for dtype in [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::Q8_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let q = QTensor::quantize(&dense, dtype).unwrap();
            let whole = q.dequantize(&device).unwrap();
            let table = Embedding::from_qtensor(&q).unwrap();
            assert_eq!(
                table.resident_bytes(),
                vocab * width / dtype.block_size() * dtype.type_size()
            );
            let got = table.lookup(&ids, &device).unwrap();
            let want = whole
                .index_select(&Tensor::new(&ids[..], &device).unwrap(), 0)
                .unwrap();
            let (got, want) = (
                got.to_vec2::<f32>().unwrap(),
                want.to_vec2::<f32>().unwrap(),
            );
            assert_eq!(got, want, "{dtype:?}");
        }
    }
}
