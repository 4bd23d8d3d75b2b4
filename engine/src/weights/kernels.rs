//! Which of our kernels multiplies a GGML type, and building its matrix from the file's
//! blocks: alone, or stacked with the other projections of one input.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Tensor};

use super::{Linear, Stacked, Weight};
use crate::error::Result;
use crate::kquant::{KFormat, KMatrix, KPart};
use crate::q4::Q41Matrix;
use crate::q8::{q5_0_as_q8_0, Q80Matrix};

/// Quantized projections of one input, with their biases and output widths, all with
/// `cols` inputs: stacked into one of our matrices when they all can be.
pub fn stack_quantized(
    qs: Vec<QTensor>,
    biases: Vec<Option<Tensor>>,
    widths: Vec<usize>,
    cols: usize,
    device: &Device,
) -> Result<Stacked> {
    let joined = joined_bias(&biases)?;
    stack_joined(qs, biases, joined, widths, cols, device)
}

/// [`stack_quantized`], given the biases' [`joined_bias`].
pub(super) fn stack_joined(
    qs: Vec<QTensor>,
    biases: Vec<Option<Tensor>>,
    joined: Option<Option<Tensor>>,
    widths: Vec<usize>,
    cols: usize,
    device: &Device,
) -> Result<Stacked> {
    let kernel = our_kernel(qs[0].dtype(), device)
        .filter(|&k| qs.iter().all(|q| our_kernel(q.dtype(), device) == Some(k)));
    if let (Some(kernel), Some(bias)) = (kernel, joined) {
        let weight = kernel.build(&qs, cols)?;
        return Ok(Stacked::joined(Linear { weight, bias }, widths));
    }
    let parts = qs
        .into_iter()
        .zip(biases)
        .zip(&widths)
        .map(|((q, bias), &rows)| {
            Ok(Linear {
                weight: quantized_weight(q, (rows, cols), device)?,
                bias,
            })
        })
        .collect::<Result<_>>()?;
    Ok(Stacked {
        joined: None,
        parts,
        widths,
    })
}

/// The bias of projections stacked into one matrix: theirs one after another, or none
/// where none has one; `None` where only some have one, as a zero bias for the others
/// would turn -0.0 into 0.0, so those are kept apart.
pub(super) fn joined_bias(biases: &[Option<Tensor>]) -> Result<Option<Option<Tensor>>> {
    if biases.iter().all(Option::is_none) {
        return Ok(Some(None));
    }
    let all: Option<Vec<Tensor>> = biases.iter().cloned().collect();
    Ok(match all {
        Some(all) => Some(Some(Tensor::cat(&all, 0)?)),
        None => None,
    })
}

/// A projection of quantized weights `[out, in]`, without a bias.
pub fn quantized_linear(q: QTensor, out_in: (usize, usize), device: &Device) -> Result<Linear> {
    Ok(Linear {
        weight: quantized_weight(q, out_in, device)?,
        bias: None,
    })
}

/// Which of our kernels multiplies a GGML type: candle multiplies Q4_1 with scalar code,
/// Q8_0 one output at a time, Q5_0 with no vector code, and the K-quants one output at a
/// time with the activations quantized again for each projection; ours give llama.cpp's
/// values faster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OurKernel {
    Q41,
    /// Q8_0, and Q5_0 converted to it exactly at load.
    Q80,
    /// Q4_K, Q5_K and Q6_K, which may be stacked together.
    K,
}

/// Our kernel for GGML data of `dtype` on `device`, where there is one.
fn our_kernel(dtype: GgmlDType, device: &Device) -> Option<OurKernel> {
    if !device.is_cpu() {
        return None;
    }
    match dtype {
        GgmlDType::Q4_1 => Some(OurKernel::Q41),
        GgmlDType::Q8_0 | GgmlDType::Q5_0 if Q80Matrix::supported() => Some(OurKernel::Q80),
        _ => KFormat::of(dtype).map(|_| OurKernel::K),
    }
}

impl OurKernel {
    /// The matrices `qs`, each `[rows, cols]` of a type this kernel takes, one under the
    /// other as one weight.
    fn build(self, qs: &[QTensor], cols: usize) -> Result<Weight> {
        let data = qs
            .iter()
            .map(QTensor::data)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let rows: usize = qs.iter().map(|q| q.shape().dims()[0]).sum();
        Ok(match self {
            Self::Q41 => Weight::Q41(Arc::new(Q41Matrix::from_ggml(data.concat(), rows, cols)?)),
            Self::Q80 => {
                let q8: Vec<Cow<'_, [u8]>> = qs
                    .iter()
                    .zip(data)
                    .map(|(q, bytes)| match q.dtype() {
                        GgmlDType::Q5_0 => Cow::Owned(q5_0_as_q8_0(&bytes)),
                        _ => bytes,
                    })
                    .collect();
                Weight::Q80(Arc::new(Q80Matrix::from_ggml(&q8.concat(), rows, cols)?))
            }
            Self::K => {
                let parts: Vec<KPart<'_>> = qs
                    .iter()
                    .zip(&data)
                    .map(|(q, bytes)| KPart {
                        format: KFormat::of(q.dtype()).expect("a K-quant type"),
                        bytes,
                        rows: q.shape().dims()[0],
                    })
                    .collect();
                Weight::K(Arc::new(KMatrix::stack(&parts, cols)?))
            }
        })
    }
}

/// A block-quantized weight: ours where we have a kernel for its type, else candle's.
pub(super) fn quantized_weight(
    q: QTensor,
    out_in: (usize, usize),
    device: &Device,
) -> Result<Weight> {
    match our_kernel(q.dtype(), device) {
        Some(kernel) => kernel.build(&[q], out_in.1),
        None => Ok(Weight::Candle(QMatMul::from_arc(Arc::new(q))?)),
    }
}
