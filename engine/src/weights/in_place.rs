//! A GGUF file's blocks used where they lie in its mapping: the token embedding table,
//! whose rows a step gathers and dequantizes as stored, and f16, bf16 and f32 matrices,
//! which our kernel multiplies as stored, are never copied out, so they are page cache
//! that every process serving the file shares.

use bytes::Bytes;
use candle_core::quantized::GgmlDType;
use candle_core::Device;

use super::WeightSource;
use crate::dense_matrix::{DenseMatrix, Stored};
use crate::embedding::Embedding;
use crate::error::{EngineError, Result};

impl WeightSource {
    /// The GGUF tensor `name`, which must be `[vocab, hidden]`, as the embedding table over
    /// its bytes in the mapped file.
    pub(super) fn embedding_in_place(
        &mut self,
        name: &str,
        (vocab, hidden): (usize, usize),
    ) -> Result<Embedding> {
        let (dtype, bytes) = self.gguf_bytes(name, [vocab, hidden])?;
        let table = Embedding::from_blocks(dtype, (vocab, hidden), bytes)
            .map_err(|e| EngineError::invalid_model(self.path(), format!("{name}: {e}")))?;
        Ok(table)
    }

    /// The GGUF matrix `name`, which must be `[rows, cols]`, where it lies in the mapped
    /// file, if the file stores it in f16, bf16 or f32 and the CPU on `device` runs our
    /// kernel for it; `None` otherwise (candle would copy it in f32 at load).
    pub(super) fn gguf_mapped_matrix(
        &mut self,
        name: &str,
        shape: [usize; 2],
        device: &Device,
    ) -> Result<Option<DenseMatrix>> {
        let Some(stored) = self.gguf_mapped_type(name, device) else {
            return Ok(None);
        };
        let (_, bytes) = self.gguf_bytes(name, shape)?;
        self.in_place_matrix(name, stored, shape, bytes).map(Some)
    }

    /// How the GGUF tensor `name` is stored, where it is an f16, bf16 or f32 one that our
    /// kernel multiplies where it lies on `device`.
    pub(super) fn gguf_mapped_type(&self, name: &str, device: &Device) -> Option<Stored> {
        let Self::Gguf { content, .. } = self else {
            return None;
        };
        if !device.is_cpu() || !DenseMatrix::supported() {
            return None;
        }
        Stored::of_ggml(content.tensor_infos.get(name)?.ggml_dtype)
    }

    /// The GGUF tensor `name`'s type and bytes in the mapped file, counted as read: refused
    /// unless its shape is `shape` and its bytes lie within the file.
    fn gguf_bytes(&mut self, name: &str, shape: [usize; 2]) -> Result<(GgmlDType, Bytes)> {
        let Self::Gguf {
            path,
            content,
            map,
            read,
            ..
        } = self
        else {
            unreachable!("gguf_bytes is only called for GGUF");
        };
        let bad = |reason: String| EngineError::invalid_model(path.as_path(), reason);
        let info = content
            .tensor_infos
            .get(name)
            .ok_or_else(|| bad(format!("missing tensor {name}")))?;
        if info.shape.dims() != shape {
            let dims = info.shape.dims();
            return Err(bad(format!(
                "{name} has shape {dims:?}, expected {shape:?}"
            )));
        }
        let dtype = info.ggml_dtype;
        let values = (shape[0] * shape[1] / dtype.block_size()) as u64;
        let len = values * dtype.type_size() as u64;
        let file = &*map;
        let start = content.tensor_data_offset.checked_add(info.offset);
        let range = start.and_then(|s| Some(s..s.checked_add(len)?));
        let range = range
            .filter(|r| r.end <= file.len() as u64)
            .ok_or_else(|| bad(format!("{name} lies past the end of the file")))?;
        let bytes = file.slice(range.start as usize..range.end as usize);
        read.insert(name.to_string());
        Ok((dtype, bytes))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::*;

    const VOCAB: usize = 8;
    const HIDDEN: usize = 64;

    fn write_gguf(path: &Path, table: &QTensor) {
        let mut file = std::fs::File::create(path).unwrap();
        gguf_file::write(&mut file, &[], &[("token_embd.weight", table)]).unwrap();
    }

    #[test]
    fn the_table_in_the_mapped_file_gives_the_rows_a_copy_gives() {
        let dir = std::env::temp_dir().join(format!("tandem-in-place-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("embd.gguf");
        let dense = Tensor::randn(0f32, 1.0, (VOCAB, HIDDEN), &Device::Cpu).unwrap();
        let table = QTensor::quantize(&dense, GgmlDType::Q8_0).unwrap();
        write_gguf(&path, &table);
        let mut src = WeightSource::open_gguf(&path).unwrap();
        let mapped = src
            .embedding_in_place("token_embd.weight", (VOCAB, HIDDEN))
            .unwrap();
        assert!(src.unread().is_empty());
        let copied = Embedding::from_qtensor(&table).unwrap();
        let ids = [7, 0, 3];
        let rows = |e: &Embedding| {
            let t = e.lookup(&ids, &Device::Cpu).unwrap();
            t.to_vec2::<f32>().unwrap()
        };
        assert_eq!(rows(&mapped), rows(&copied));
        let wrong = src.embedding_in_place("token_embd.weight", (VOCAB, 2 * HIDDEN));
        assert!(matches!(wrong, Err(EngineError::InvalidModel { .. })));

        // The file cut inside the table: refused by name, never read past its end.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
        let mut src = WeightSource::open_gguf(&path).unwrap();
        let cut = src.embedding_in_place("token_embd.weight", (VOCAB, HIDDEN));
        assert!(
            matches!(cut, Err(EngineError::InvalidModel { reason, .. }) if reason.contains("past the end"))
        );
    }

    #[test]
    fn a_table_whose_rows_are_not_whole_blocks_is_refused() {
        let bytes = bytes::Bytes::from(vec![0u8; 34 * 3]);
        // Three Q8_0 blocks of 32 values: not three rows of 48.
        assert!(Embedding::from_blocks(GgmlDType::Q8_0, (2, 48), bytes.clone()).is_err());
        assert!(Embedding::from_blocks(GgmlDType::Q8_0, (3, 32), bytes.clone()).is_ok());
        assert!(Embedding::from_blocks(GgmlDType::Q8_0, (4, 32), bytes).is_err());
    }

    /// A GGUF file's F32, F16 and BF16 matrices are used where they lie in the mapping, by
    /// our kernel, and compute what candle's copy of them does (to within the order of f32
    /// sums); a Q8_0 one is not.
    #[test]
    fn dense_gguf_matrices_are_used_where_they_lie() {
        if crate::dense_matrix::tests::skip() {
            return;
        }
        let dev = Device::Cpu;
        let dir =
            std::env::temp_dir().join(format!("tandem-in-place-dense-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dense = Tensor::randn(0f32, 1.0, (VOCAB, HIDDEN), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (3, HIDDEN), &dev).unwrap();
        for (dtype, in_place) in [
            (GgmlDType::F32, true),
            (GgmlDType::F16, true),
            (GgmlDType::BF16, true),
            (GgmlDType::Q8_0, false),
        ] {
            let path = dir.join(format!("{dtype:?}.gguf"));
            let q = QTensor::quantize(&dense, dtype).unwrap();
            let mut file = std::fs::File::create(&path).unwrap();
            gguf_file::write(&mut file, &[], &[("blk.0.attn_q.weight", &q)]).unwrap();
            let mut src = WeightSource::open_gguf(&path).unwrap();
            let linear = src
                .linear("blk.0.attn_q.weight", None, (VOCAB, HIDDEN), &dev)
                .unwrap();
            assert_eq!(linear.in_place(), in_place, "{dtype:?}");
            if !in_place {
                continue;
            }
            let want = x.matmul(&q.dequantize(&dev).unwrap().t().unwrap()).unwrap();
            let got = linear.forward(&x).unwrap();
            let gap = (want - got).unwrap().abs().unwrap().max_all().unwrap();
            let gap = gap.to_scalar::<f32>().unwrap();
            assert!(gap < 1e-3, "{dtype:?}: {gap}");
        }
    }
}
