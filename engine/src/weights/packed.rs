//! A GGUF load's K-quant, Q8_0 and Q4_1 matrices mapped from a pack ([`crate::pack`]) where
//! it has them, and a pack written for the next load where it did not. Each matrix goes
//! under the names of the tensors it was made from (`+` between stacked ones, `[e]` for
//! expert `e` of a mixture's tensor), so a load that finds it there reads none of those
//! tensors.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::QTensor;
use candle_core::Device;

use super::{quantized_linear, stack_quantized, Linear, Stacked, Weight, WeightSource};
use crate::error::{EngineError, Result};
use crate::pack::{self, Mapped, PackError, PackedMatrix, SourceId};

/// What a load did with its pack.
#[derive(Debug)]
pub struct PackReport {
    pub path: PathBuf,
    /// Matrices mapped from the pack.
    pub mapped: usize,
    /// Matrices repacked from the model file, which the pack did not have.
    pub built: usize,
    /// Why the pack found was not used, where there was one.
    pub refused: Option<PackError>,
    /// Why a new pack could not be written, where one was.
    pub unwritten: Option<PackError>,
}

impl PackReport {
    /// Says what the load did with its pack: a warning where it could not use or write one.
    pub fn log(&self) {
        let pack = self.path.display();
        if let Some(reason) = &self.refused {
            tracing::warn!(%pack, %reason, "the weight pack does not fit the model; rebuilding it");
        }
        match &self.unwritten {
            Some(reason) => tracing::warn!(%pack, %reason, "could not write the weight pack"),
            None if self.built > 0 => {
                tracing::info!(%pack, matrices = self.built, "wrote the weight pack")
            }
            None => tracing::info!(%pack, matrices = self.mapped, "mapped the weight pack"),
        }
    }
}

/// A load's use of its pack: the pack mapped, where one matched the model file, and every
/// matrix of ours the load took from it or built.
pub struct PackSession {
    path: PathBuf,
    source: SourceId,
    mapped: Option<Mapped>,
    refused: Option<PackError>,
    matrices: Vec<(String, PackedMatrix)>,
    built: usize,
}

impl PackSession {
    fn open(dir: &Path, model: &Path) -> Result<Self> {
        let path = pack::path_for(dir, model);
        let source = SourceId::of(model).map_err(|e| EngineError::io(model, e))?;
        let (mapped, refused) = match Mapped::open(&path, source) {
            Ok(mapped) => (Some(mapped), None),
            Err(PackError::Missing) => (None, None),
            Err(e) => (None, Some(e)),
        };
        Ok(Self {
            path,
            source,
            mapped,
            refused,
            matrices: Vec::new(),
            built: 0,
        })
    }

    /// Writes a pack of every matrix the load had if it built any, and says what it did.
    fn finish(self) -> PackReport {
        let unwritten = if self.built > 0 {
            pack::write(&self.path, self.source, &self.matrices).err()
        } else {
            None
        };
        PackReport {
            path: self.path,
            mapped: self.matrices.len() - self.built,
            built: self.built,
            refused: self.refused,
            unwritten,
        }
    }
}

/// A mixture expert's stacked gate and up projections and its down projection.
pub(crate) struct ExpertWeights {
    pub(crate) gate_up: Stacked,
    pub(crate) down: Linear,
}

impl WeightSource {
    /// Maps our kernels' matrices of this GGUF file from its pack in `dir` where the pack has
    /// them, and has [`WeightSource::finish_pack`] write one where it does not.
    pub fn use_pack(&mut self, dir: &Path) -> Result<()> {
        if let Self::Gguf { path, pack, .. } = self {
            *pack = Some(Box::new(PackSession::open(dir, path)?));
        }
        Ok(())
    }

    /// Ends the load's use of its pack (writing one if the load built matrices it lacked):
    /// `None` where the load used none.
    pub fn finish_pack(&mut self) -> Option<PackReport> {
        match self {
            Self::Gguf { pack, .. } => pack.take().map(|s| s.finish()),
            Self::SafeTensors { .. } => None,
        }
    }

    /// The `[rows, cols]` matrix under `key` in the pack, marking `names` (the tensors it
    /// was made from) read.
    pub(super) fn packed(
        &mut self,
        key: &str,
        names: &[&str],
        rows_cols: (usize, usize),
    ) -> Option<Weight> {
        let m = self.mapped()?.matrix(key, rows_cols)?;
        self.took(vec![(key.to_string(), m.clone())], names);
        Some(m.into())
    }

    fn mapped(&self) -> Option<&Mapped> {
        match self {
            Self::Gguf { pack: Some(s), .. } => s.mapped.as_ref(),
            _ => None,
        }
    }

    /// Records `matrices` as taken from the pack, and `names` as read.
    fn took(&mut self, matrices: Vec<(String, PackedMatrix)>, names: &[&str]) {
        if let Self::Gguf {
            pack: Some(s),
            read,
            ..
        } = self
        {
            s.matrices.extend(matrices);
            read.extend(names.iter().map(|n| n.to_string()));
        }
    }

    /// Keeps `weight`, built from the tensors `key` names, for the pack, where a pack
    /// holds its kind.
    pub(super) fn keep_packed(&mut self, key: String, weight: &Weight) {
        let matrix = match weight {
            Weight::K(m) => PackedMatrix::K(Arc::clone(m)),
            Weight::Q80(m) => PackedMatrix::Q80(Arc::clone(m)),
            Weight::Q41(m) => PackedMatrix::Q41(Arc::clone(m)),
            Weight::Candle(_) | Weight::Half(_) | Weight::Mapped(_) => return,
        };
        if let Self::Gguf { pack: Some(s), .. } = self {
            s.matrices.push((key, matrix));
            s.built += 1;
        }
    }

    /// The experts of GGUF tensors `[experts, out, in]` named `gate`, `up` and `down`, as
    /// llama.cpp's converter stacks a mixture's experts: `(inter, hidden)` each gate and up,
    /// `(hidden, inter)` each down.
    pub(crate) fn gguf_experts(
        &mut self,
        [gate, up, down]: [&str; 3],
        experts: usize,
        (inter, h): (usize, usize),
        device: &Device,
    ) -> Result<Vec<ExpertWeights>> {
        let keys = |e: usize| (format!("{gate}[{e}]+{up}[{e}]"), format!("{down}[{e}]"));
        if let Some(all) = self.packed_experts(&keys, [gate, up, down], experts, (inter, h)) {
            return Ok(all);
        }
        let gates = self.expert_slices(gate, experts, (inter, h), device)?;
        let ups = self.expert_slices(up, experts, (inter, h), device)?;
        let downs = self.expert_slices(down, experts, (h, inter), device)?;
        let mut all = Vec::with_capacity(experts);
        for (e, ((gate, up), down)) in gates.into_iter().zip(ups).zip(downs).enumerate() {
            let widths = vec![inter, inter];
            let gate_up = stack_quantized(vec![gate, up], vec![None, None], widths, h, device)?;
            let down = quantized_linear(down, (h, inter), device)?;
            let (gate_up_key, down_key) = keys(e);
            if let Some(joined) = &gate_up.joined {
                self.keep_packed(gate_up_key, &joined.weight);
            }
            self.keep_packed(down_key, &down.weight);
            all.push(ExpertWeights { gate_up, down });
        }
        Ok(all)
    }

    /// Every expert from the pack, where it has them all.
    fn packed_experts(
        &mut self,
        keys: &dyn Fn(usize) -> (String, String),
        names: [&str; 3],
        experts: usize,
        (inter, h): (usize, usize),
    ) -> Option<Vec<ExpertWeights>> {
        let mapped = self.mapped()?;
        let mut taken = Vec::with_capacity(2 * experts);
        let mut all = Vec::with_capacity(experts);
        for e in 0..experts {
            let (gate_up_key, down_key) = keys(e);
            let gate_up = mapped.matrix(&gate_up_key, (2 * inter, h))?;
            let down = mapped.matrix(&down_key, (h, inter))?;
            taken.push((gate_up_key, gate_up.clone()));
            taken.push((down_key, down.clone()));
            let (gate_up, down) = (
                Linear::unbiased(gate_up.into()),
                Linear::unbiased(down.into()),
            );
            all.push(ExpertWeights {
                gate_up: Stacked::joined(gate_up, vec![inter, inter]),
                down,
            });
        }
        self.took(taken, &names);
        Some(all)
    }

    /// The `experts` matrices `[out, in]` of a GGUF tensor `[experts, out, in]`, each
    /// sliced out of the file's blocks as they are.
    fn expert_slices(
        &mut self,
        name: &str,
        experts: usize,
        out_in: (usize, usize),
        device: &Device,
    ) -> Result<Vec<QTensor>> {
        let q = self.qtensor(name, device)?;
        let want = [experts, out_in.0, out_in.1];
        if q.shape().dims() != want {
            return Err(EngineError::invalid_model(
                self.path(),
                format!("{name} has shape {:?}, expected {want:?}", q.shape()),
            ));
        }
        let data = q.data()?;
        let per_expert = data.len() / experts;
        data.chunks_exact(per_expert)
            .map(|bytes| {
                let dims = vec![out_in.0, out_in.1];
                Ok(qtensor_from_ggml(q.dtype(), bytes, dims, device)?)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{gguf_file, GgmlDType};
    use candle_core::Tensor;

    use super::*;

    const EXPERTS: usize = 3;
    const H: usize = 256;
    const INTER: usize = 512;
    const NAMES: [&str; 3] = [
        "blk.0.ffn_gate_exps.weight",
        "blk.0.ffn_up_exps.weight",
        "blk.0.ffn_down_exps.weight",
    ];
    const Q: &str = "blk.0.attn_q.weight";
    const K: &str = "blk.0.attn_k.weight";
    const O: &str = "blk.0.attn_output.weight";

    fn quantized(dims: &[usize], dtype: GgmlDType) -> QTensor {
        let w = Tensor::randn(0f32, 1.0, dims, &Device::Cpu).unwrap();
        QTensor::quantize(&w, dtype).unwrap()
    }

    /// A GGUF file of one layer's experts (gate and up Q4_K, down Q6_K), a q and k, and an
    /// output projection in Q4_1.
    fn write_gguf(path: &Path) {
        let tensors = [
            (NAMES[0], quantized(&[EXPERTS, INTER, H], GgmlDType::Q4K)),
            (NAMES[1], quantized(&[EXPERTS, INTER, H], GgmlDType::Q4K)),
            (NAMES[2], quantized(&[EXPERTS, H, INTER], GgmlDType::Q6K)),
            (Q, quantized(&[H, H], GgmlDType::Q4K)),
            (K, quantized(&[16, H], GgmlDType::Q6K)),
            (O, quantized(&[H, H], GgmlDType::Q4_1)),
        ];
        let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
        let mut file = std::fs::File::create(path).unwrap();
        gguf_file::write(&mut file, &[], &refs).unwrap();
    }

    /// Each expert's gate/up outputs for the rows `x` and down outputs for `wide`, and q,
    /// k's and o's for `x`.
    fn outputs(src: &mut WeightSource, x: &Tensor, wide: &Tensor) -> Vec<Vec<u32>> {
        let dev = Device::Cpu;
        let experts = src.gguf_experts(NAMES, EXPERTS, (INTER, H), &dev).unwrap();
        let stacked = src
            .stacked(&[(Q, None, H), (K, None, 16)], H, &dev)
            .unwrap();
        let o = src.linear(O, None, (H, H), &dev).unwrap();
        let mut all = Vec::new();
        let mut push = |t: &Tensor| {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            all.push(v.iter().map(|f| f.to_bits()).collect());
        };
        for w in &experts {
            w.gate_up.forward(x).unwrap().iter().for_each(&mut push);
            push(&w.down.forward(wide).unwrap());
        }
        stacked.forward(x).unwrap().iter().for_each(&mut push);
        push(&o.forward(x).unwrap());
        all
    }

    #[test]
    fn experts_stacked_projections_and_q4_1_come_from_the_pack_as_they_were_built() {
        let dir = std::env::temp_dir().join(format!("tandem-packed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("experts.gguf");
        write_gguf(&model);
        let x = Tensor::randn(0f32, 1.0, (2, H), &Device::Cpu).unwrap();
        let wide = Tensor::randn(0f32, 1.0, (2, INTER), &Device::Cpu).unwrap();
        let run = |pack: bool| {
            let mut src = WeightSource::open_gguf(&model).unwrap();
            if pack {
                src.use_pack(&dir).unwrap();
            }
            let out = outputs(&mut src, &x, &wide);
            assert!(src.unread().is_empty(), "{:?}", src.unread());
            (out, src.finish_pack())
        };
        let (plain, none) = run(false);
        assert!(none.is_none());
        let (first, report) = run(true);
        let report = report.unwrap();
        assert_eq!((report.mapped, report.built), (0, 2 * EXPERTS + 2));
        assert!(report.refused.is_none() && report.unwritten.is_none());
        let (second, report) = run(true);
        let report = report.unwrap();
        assert_eq!((report.mapped, report.built), (2 * EXPERTS + 2, 0));
        assert_eq!(first, plain);
        assert_eq!(second, plain);
    }
}
