//! A Hugging Face folder's tensors as the engine holds them: vectors (norms, biases) in
//! f32; matrices where they lie in the mapped file, or copied: in f32, or to a GPU in the
//! half-precision type the file stores them in.

use bytes::Bytes;
use candle_core::safetensors::Load;
use candle_core::{DType, Device, Module, Tensor};
use half::{bf16, f16};
use safetensors::tensor::TensorView;

use super::WeightSource;
use crate::dense_matrix::{DenseMatrix, Stored};
use crate::error::{EngineError, Result};

/// How a folder's matrices are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseMatrices {
    /// Copied in f32 at load, bf16 and f16 ones widened: the choice of a CPU that runs no
    /// kernel of ours ([`DenseMatrices::for_device`]; an x86 CPU without AVX2, FMA and F16C,
    /// which the build's target needs anyway), and what `engine-bench --widen-folder`
    /// compares with.
    F32,
    /// Used where they lie in the mapped files, by our kernel ([`DenseMatrix`]), which widens
    /// each weight exactly as it reads it and sums in f32, so it computes the widened
    /// model (to within the order of its sums) from the files' own pages (half the memory
    /// of the widened form for bf16 and f16), shared by every process that maps the files.
    /// The embedding table is used in place too.
    InPlace,
    /// Copied as stored: bf16 and f16 ones in half the memory, and half the bytes a step
    /// reads. A product rounds its activations to the matrix's type, multiplies (cuBLAS
    /// sums in f32) and widens the outputs back to f32, as `transformers` runs a bf16
    /// checkpoint's projections; the rest of the step (norms, attention, the residual
    /// stream) stays in f32.
    AsStored,
}

impl DenseMatrices {
    /// A GPU's matrices as stored: cuBLAS multiplies them at its half-precision rate and a
    /// decode step reads half the bytes. A CPU's in place where it runs our kernel, else
    /// widened: candle's CPU products over bf16 ran 3.6x slower than over f32 at one row
    /// and 1.9x at 16, f16's 1.8x at 16, on a 1536x1536 matrix (`product-bench`'s dense
    /// rows, 2-core AMD EPYC).
    pub fn for_device(device: &Device) -> Self {
        if !device.is_cpu() {
            Self::AsStored
        } else if DenseMatrix::supported() {
            Self::InPlace
        } else {
            Self::F32
        }
    }

    /// The type a matrix stored as `stored` is held in.
    pub fn held(self, stored: DType) -> DType {
        match (self, stored) {
            (Self::AsStored | Self::InPlace, DType::BF16 | DType::F16) => stored,
            _ => DType::F32,
        }
    }
}

/// `xs Wᵀ` for a half-precision `w`: `xs` rounded to its type, the outputs in f32.
pub(super) fn half_product(xs: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let product = candle_core::quantized::QMatMul::Tensor(w.clone());
    product
        .forward(&xs.to_dtype(w.dtype())?)?
        .to_dtype(DType::F32)
}

/// A safetensors tensor as f32, converted from its bytes where they lie: bf16 and f16
/// widened value by value (exact, as candle's `to_dtype` widens them), with no copy in the
/// stored type between.
fn widened(view: &TensorView<'_>, device: &Device) -> candle_core::Result<Tensor> {
    let widen = |to_f32: fn([u8; 2]) -> f32| -> Vec<f32> {
        let pairs = view.data().chunks_exact(2);
        pairs.map(|b| to_f32([b[0], b[1]])).collect()
    };
    match DType::try_from(view.dtype())? {
        DType::BF16 => Tensor::from_vec(
            widen(|b| bf16::from_le_bytes(b).to_f32()),
            view.shape(),
            device,
        ),
        DType::F16 => Tensor::from_vec(
            widen(|b| f16::from_le_bytes(b).to_f32()),
            view.shape(),
            device,
        ),
        _ => view.load(device)?.to_dtype(DType::F32),
    }
}

impl WeightSource {
    /// A folder's tensor `name`: a matrix held as `held` says, anything else in f32.
    pub(super) fn folder_tensor(
        &mut self,
        name: &str,
        held: DenseMatrices,
        device: &Device,
    ) -> Result<Tensor> {
        let Self::SafeTensors {
            path, files, read, ..
        } = self
        else {
            unreachable!("folder_tensor is only called for a folder");
        };
        read.insert(name.to_string());
        let bad = |reason: String| EngineError::invalid_model(path.as_path(), reason);
        let view = files
            .view(name)
            .ok_or_else(|| bad(format!("missing tensor {name}")))?;
        let stored = DType::try_from(view.dtype()).map_err(|e| bad(format!("{name}: {e}")))?;
        let tensor = if view.shape().len() == 2 && held.held(stored) != DType::F32 {
            view.load(device)
        } else {
            widened(&view, device)
        };
        tensor.map_err(|e| bad(format!("{name}: {e}")))
    }

    /// A folder's matrix `name`, which must have shape `shape`, held as the source's
    /// [`DenseMatrices`] say.
    pub(super) fn folder_matrix(
        &mut self,
        name: &str,
        shape: [usize; 2],
        device: &Device,
    ) -> Result<Tensor> {
        let Self::SafeTensors { matrices, .. } = self else {
            unreachable!("folder_matrix is only called for a folder");
        };
        let held = *matrices;
        let t = self.folder_tensor(name, held, device)?;
        self.shaped(name, t, &shape)
    }

    /// A folder's matrix `name` where it lies in the mapped file, where the source's
    /// matrices are used in place and the file stores it in bf16, f16 or f32; `None`
    /// otherwise.
    /// It must have shape `shape`.
    pub(super) fn folder_in_place(
        &mut self,
        name: &str,
        [rows, cols]: [usize; 2],
    ) -> Result<Option<(Stored, Bytes)>> {
        let Self::SafeTensors {
            path,
            files,
            read,
            matrices,
        } = self
        else {
            unreachable!("folder_in_place is only called for a folder");
        };
        let bad = |reason: String| EngineError::invalid_model(path.as_path(), reason);
        let view = files
            .view(name)
            .ok_or_else(|| bad(format!("missing tensor {name}")))?;
        let Some(stored) = Stored::of_safetensors(view.dtype()) else {
            return Ok(None);
        };
        if *matrices != DenseMatrices::InPlace {
            return Ok(None);
        }
        if view.shape() != [rows, cols] {
            let dims = view.shape();
            return Err(bad(format!(
                "{name} has shape {dims:?}, expected [{rows}, {cols}]"
            )));
        }
        read.insert(name.to_string());
        Ok(files.bytes(name).map(|b| (stored, b)))
    }

    /// [`WeightSource::folder_in_place`] as our kernel's matrix.
    pub(super) fn folder_mapped_matrix(
        &mut self,
        name: &str,
        shape: [usize; 2],
    ) -> Result<Option<DenseMatrix>> {
        let Some((stored, bytes)) = self.folder_in_place(name, shape)? else {
            return Ok(None);
        };
        self.in_place_matrix(name, stored, shape, bytes).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use safetensors::Dtype;

    use super::*;

    /// Values with the edges of each type: zeros of both signs, the smallest subnormals,
    /// infinities, a NaN, the largest finite values.
    fn values() -> Vec<f32> {
        let edges = [
            0.0,
            -0.0,
            1e-40,
            -6e-8,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let mut v: Vec<f32> = edges.into();
        v.extend([65504.0, -3.3e38, 1.0, -2.5, 0.1]);
        v.extend((0..52).map(|i| (i as f32 - 26.0) * 0.37));
        v
    }

    #[test]
    fn a_widened_tensor_has_the_bits_candle_converts_it_to() {
        let dev = Device::Cpu;
        let xs = values();
        let stored: [(Dtype, Vec<u8>); 3] = [
            (
                Dtype::BF16,
                xs.iter()
                    .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                    .collect(),
            ),
            (
                Dtype::F16,
                xs.iter()
                    .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                    .collect(),
            ),
            (
                Dtype::F32,
                xs.iter().flat_map(|&x| x.to_le_bytes()).collect(),
            ),
        ];
        for (dtype, bytes) in stored {
            let view = TensorView::new(dtype, vec![8, 8], &bytes).unwrap();
            let ours = widened(&view, &dev).unwrap();
            let candle = view.load(&dev).unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(ours.dims(), [8, 8]);
            let bits = |t: &Tensor| -> Vec<u32> {
                let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                v.iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(bits(&ours), bits(&candle), "{dtype:?}");
        }
    }

    /// An f32 folder's matrices and embedding table are the mapped file's own bytes when
    /// used in place (copies otherwise), and compute what the copies do.
    #[test]
    fn an_f32_folder_is_used_where_it_lies() {
        if crate::dense_matrix::tests::skip() {
            return;
        }
        let dev = Device::Cpu;
        let dir = std::env::temp_dir().join(format!("tandem-dense-f32-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (rows, cols) = (8, 40);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| (i % 23) as f32 / 7.0 - 1.5)
            .collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = || TensorView::new(Dtype::F32, vec![rows, cols], &bytes).unwrap();
        let path = dir.join("model.safetensors");
        safetensors::serialize_to_file([("w", view()), ("table", view())], None, &path).unwrap();
        let x = Tensor::from_vec(values[..2 * cols].to_vec(), (2, cols), &dev).unwrap();
        let mut outputs = Vec::new();
        for (matrices, in_place) in [(DenseMatrices::InPlace, true), (DenseMatrices::F32, false)] {
            let mut src = WeightSource::open_hf_folder(&dir, matrices).unwrap();
            let linear = src.linear("w", None, (rows, cols), &dev).unwrap();
            assert_eq!(linear.in_place(), in_place, "{matrices:?}");
            let table = src.embedding("table", (rows, cols), &dev).unwrap();
            let blocks = matches!(table, crate::embedding::Embedding::Blocks { .. });
            assert_eq!(blocks, in_place, "{matrices:?}");
            let looked_up = table.lookup(&[5, 0], &dev).unwrap();
            let want = [&values[5 * cols..6 * cols], &values[..cols]];
            assert_eq!(looked_up.to_vec2::<f32>().unwrap(), want);
            outputs.push(linear.forward(&x).unwrap().to_vec2::<f32>().unwrap());
        }
        for (a, b) in outputs[0].iter().flatten().zip(outputs[1].iter().flatten()) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} against {b}");
        }
    }
}
