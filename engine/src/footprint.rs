//! The memory a model takes before its weights are read: what the loader will hold for each
//! tensor, from the files' headers alone, plus the KV memory its node reserves, against the
//! memory the machine (or its container) has. A node refuses to start a model that cannot
//! fit, with the numbers, instead of being killed for memory halfway through loading it or
//! under its first full batch.

use std::io::Read;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::Device;
use serde::Deserialize;

use crate::dense_matrix::DenseMatrix;
use crate::error::{EngineError, Result};
use crate::kquant::format::QK_K;
use crate::kquant::KFormat;
use crate::kv_cache::{KvDtype, KvLayout};
use crate::q8::Q80Matrix;
use crate::weights::DenseMatrices;
use text::ModelConfig;

/// Where a model's weights come from, which decides the form the loader holds them in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFile {
    Gguf,
    /// A Hugging Face folder, its matrices held as given.
    Folder(DenseMatrices),
}

/// The KV memory a node reserves beside the weights: a fixed amount and a number of
/// positions of the model's cache (each counted at its bytes for every layer's K and V in
/// the element type the caches hold).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvReserve {
    pub bytes: u64,
    pub positions: u64,
    /// The element type the node's caches hold.
    pub dtype: KvDtype,
}

/// How much KV memory a node reserves, without its caches' element type: what the node's
/// own flags size, the type then coming from its `kv_cache_dtype` flag
/// ([`crate::ModelArgs::load`]), so that the reserve is counted in the type the caches are
/// made in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvRoom {
    pub bytes: u64,
    pub positions: u64,
}

impl KvRoom {
    /// This room in caches of `dtype`.
    pub fn of(self, dtype: KvDtype) -> KvReserve {
        KvReserve {
            bytes: self.bytes,
            positions: self.positions,
            dtype,
        }
    }
}

impl KvReserve {
    /// The reserve in bytes for a model of `layout`.
    pub fn bytes_for(&self, layout: &KvLayout) -> u64 {
        let per_position = layout.bytes_per_position() as u64;
        self.bytes
            .saturating_add(self.positions.saturating_mul(per_position))
    }
}

/// One tensor of a model file, as its header describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorHeader {
    pub name: String,
    pub elements: u64,
    /// Bytes in the file.
    pub stored: u64,
    pub dims: usize,
    /// GGUF's block type; `None` for safetensors.
    pub ggml: Option<GgmlDType>,
}

/// The most memory loading a model's weights takes at once: what the loader holds once it
/// is done ([`held_weight_bytes`]) and, for a GGUF mixture of experts, what it holds only
/// while it splits the experts ([`expert_transient_bytes`]).
pub fn peak_weight_bytes(tensors: &[TensorHeader], file: WeightFile) -> u64 {
    let transient = match file {
        WeightFile::Gguf => expert_transient_bytes(tensors),
        WeightFile::Folder(_) => 0,
    };
    held_weight_bytes(tensors, file) + transient
}

/// A GGUF mixture's experts are one tensor `[experts, out, in]` each for gate, up and down
/// of a layer: each is read whole, then split into one matrix per expert (a copy), and where
/// our kernels take the type (Q4_1, Q8_0, the K-quants) each expert is converted once more from its
/// slice. So while a layer loads, beside what is held, there are at most its split slices
/// of our kernels' types and one whole tensor being split.
pub fn expert_transient_bytes(tensors: &[TensorHeader]) -> u64 {
    let experts = || tensors.iter().filter(|t| t.dims == 3);
    let whole = experts().map(|t| t.stored).max().unwrap_or(0);
    let mut by_layer: std::collections::HashMap<&str, u64> = Default::default();
    let ours = |t: &&TensorHeader| {
        t.ggml.is_some_and(|d| {
            matches!(d, GgmlDType::Q4_1 | GgmlDType::Q8_0) || KFormat::of(d).is_some()
        })
    };
    for t in experts().filter(ours) {
        let layer = t
            .name
            .split_once(".ffn_")
            .map_or(t.name.as_str(), |(l, _)| l);
        *by_layer.entry(layer).or_default() += t.stored;
    }
    whole + by_layer.into_values().max().unwrap_or(0)
}

/// The memory a model's weights take once loaded, from its tensors' headers, as
/// `crate::weights` holds them:
/// - a Hugging Face folder's files are mapped: vectors in f32, matrices in f32 or, where
///   the file stores them in bf16 or f16 and they are held as stored or used in place, in
///   their two bytes a value ([`DenseMatrices`]). Matrices used in place are the mapped
///   pages themselves, which a step reads, so they count as held as a copy does;
/// - a GGUF file is read a tensor at a time: vectors dequantized to f32; the embedding
///   table as stored (a step dequantizes the rows it gathers); Q4_1 matrices in our
///   kernel's form (f32 scales and minimums, 24 bytes a block of 32 against the file's 20);
///   K-quant matrices in theirs (Q4_K and Q5_K 4 bytes more per 256 weights than the file,
///   Q6_K as stored; a matrix's last rows are padded to a group of eight, at most seven
///   rows more, which is not counted); Q5_0 as Q8_0 (34 bytes a block against 22) where
///   our Q8_0 kernel runs; F16, BF16 and F32 matrices as stored where our kernel uses them
///   in the mapped file, else as f32 (candle's); other types as stored. With no
///   `output.weight`, the head is the embedding table again, in its matrix form (the
///   table's own pages, for F16, BF16 and F32 used in place).
///
/// The rotation tables and the activations of a step come on top, small beside these.
pub fn held_weight_bytes(tensors: &[TensorHeader], file: WeightFile) -> u64 {
    if let WeightFile::Folder(matrices) = file {
        let half = |t: &TensorHeader| t.dims == 2 && t.stored == 2 * t.elements;
        let as_stored = matrices != DenseMatrices::F32;
        let held = |t: &TensorHeader| match as_stored && half(t) {
            true => t.stored,
            false => 4 * t.elements,
        };
        return tensors.iter().map(held).sum();
    }
    let tied = !tensors.iter().any(|t| t.name == "output.weight");
    let in_place = DenseMatrix::supported();
    let dense = |t: &TensorHeader| {
        matches!(
            t.ggml,
            Some(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
        )
    };
    tensors
        .iter()
        .map(|t| {
            let matrix = |t: &TensorHeader| match t.ggml {
                Some(GgmlDType::Q4_1) => t.elements / 2 + t.elements / 32 * 8,
                Some(d) if KFormat::of(d).is_some() => {
                    let format = KFormat::of(d).expect("a K-quant type");
                    t.elements / QK_K as u64 * format.held_bytes() as u64
                }
                Some(GgmlDType::Q5_0) if Q80Matrix::supported() => t.elements / 32 * 34,
                Some(_) if dense(t) && in_place => t.stored,
                Some(_) if dense(t) => 4 * t.elements,
                _ => t.stored,
            };
            match (t.dims, t.name.as_str()) {
                // A tied head used in place is the table's own pages.
                (_, "token_embd.weight") if tied && !(dense(t) && in_place) => t.stored + matrix(t),
                (_, "token_embd.weight") => t.stored,
                // Read into the rotation tables and dropped.
                (
                    _,
                    "rope_freqs.weight" | "rope_factors_long.weight" | "rope_factors_short.weight",
                ) => 0,
                (1, _) => 4 * t.elements,
                _ => matrix(t),
            }
        })
        .sum()
}

/// The tensors of a Hugging Face folder or a GGUF file, from the headers alone.
pub fn read_headers(path: &Path) -> Result<Vec<TensorHeader>> {
    if path.is_dir() {
        return safetensors_headers(path);
    }
    let mut file = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
    let content = gguf_file::Content::read(&mut file)
        .map_err(|e| EngineError::invalid_model(path, e.to_string()))?;
    Ok(gguf_headers(&content))
}

/// The tensors of a GGUF file whose header is read.
pub fn gguf_headers(content: &gguf_file::Content) -> Vec<TensorHeader> {
    content
        .tensor_infos
        .iter()
        .map(|(name, info)| {
            let elements = info.shape.elem_count() as u64;
            let dtype = info.ggml_dtype;
            TensorHeader {
                name: name.clone(),
                elements,
                stored: elements / dtype.block_size() as u64 * dtype.type_size() as u64,
                dims: info.shape.rank(),
                ggml: Some(dtype),
            }
        })
        .collect()
}

/// One entry of a safetensors header.
#[derive(Deserialize)]
struct Entry {
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// The tensors of `model.safetensors` or of the shards its index names.
fn safetensors_headers(dir: &Path) -> Result<Vec<TensorHeader>> {
    let mut out = Vec::new();
    for file in crate::weights::safetensors_files(dir)? {
        for (name, e) in safetensors_header(&file)? {
            out.push(TensorHeader {
                name,
                elements: e.shape.iter().product(),
                stored: e.data_offsets[1].saturating_sub(e.data_offsets[0]),
                dims: e.shape.len(),
                ggml: None,
            });
        }
    }
    Ok(out)
}

/// The largest safetensors header read: the format's own limit is 100 MB.
const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

/// A safetensors file's header: an 8-byte little-endian length, then that much JSON.
fn safetensors_header(path: &Path) -> Result<Vec<(String, Entry)>> {
    let bad = |reason: String| EngineError::invalid_model(path, reason);
    let mut file = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|e| EngineError::io(path, e))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_SAFETENSORS_HEADER {
        return Err(bad(format!("safetensors header of {len} bytes")));
    }
    let mut json = vec![0u8; len as usize];
    file.read_exact(&mut json)
        .map_err(|e| EngineError::io(path, e))?;
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&json).map_err(|e| bad(e.to_string()))?;
    map.into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, v)| {
            let e: Entry = serde_json::from_value(v).map_err(|e| bad(format!("{name}: {e}")))?;
            Ok((name, e))
        })
        .collect()
}

/// The memory a process here may use, and where that bound comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct MachineMemory {
    pub bytes: u64,
    pub source: &'static str,
}

/// The least of the container's memory limit (cgroup v2 `memory.max`, or v1's
/// `memory.limit_in_bytes`) and the machine's `MemTotal`; `None` when none can be read.
pub fn machine_memory() -> Option<MachineMemory> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let limits = [
        (
            read("/sys/fs/cgroup/memory.max").and_then(|s| cgroup_limit(&s)),
            "the cgroup's memory.max",
        ),
        (
            read("/sys/fs/cgroup/memory/memory.limit_in_bytes").and_then(|s| cgroup_limit(&s)),
            "the cgroup's memory.limit_in_bytes",
        ),
        (
            read("/proc/meminfo").and_then(|s| mem_total(&s)),
            "MemTotal in /proc/meminfo",
        ),
    ];
    limits
        .into_iter()
        .filter_map(|(bytes, source)| bytes.map(|bytes| MachineMemory { bytes, source }))
        .min_by_key(|m| m.bytes)
}

/// A cgroup limit file's bytes; `None` for no limit (`max`, or v1's huge sentinel).
fn cgroup_limit(text: &str) -> Option<u64> {
    text.trim().parse::<u64>().ok().filter(|&b| b < 1 << 60)
}

/// `MemTotal` of `/proc/meminfo`, in bytes.
fn mem_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a model whose weights and KV reserve together exceed the machine's memory.
pub fn check_fits(
    path: &Path,
    weights: u64,
    kv: u64,
    machine: &MachineMemory,
) -> std::result::Result<(), EngineError> {
    let total = weights.saturating_add(kv);
    if total <= machine.bytes {
        return Ok(());
    }
    Err(EngineError::OutOfMemory {
        path: path.to_path_buf(),
        weights,
        kv,
        machine: machine.bytes,
        source_of_limit: machine.source,
    })
}

/// Bytes in GiB (MiB below one GiB) with two decimals, for messages.
pub fn size(bytes: u64) -> String {
    if bytes < 1 << 30 {
        format!("{:.2} MiB", bytes as f64 / f64::from(1 << 20))
    } else {
        format!("{:.2} GiB", bytes as f64 / f64::from(1 << 30))
    }
}

/// Whether `cfg`'s reserve and the weights at `path` fit this machine and `device`; the
/// check [`crate::load_within`] runs before it reads any weight.
pub fn check_model(
    path: &Path,
    file: WeightFile,
    cfg: &ModelConfig,
    reserve: KvReserve,
    device: &Device,
) -> Result<()> {
    check_headers(path, file, &read_headers(path)?, cfg, reserve, device)
}

/// [`check_model`] for the tensors `headers` of the model at `path`, already read. On the
/// CPU the weights and the KV reserve share the machine's memory. On a GPU the weights
/// pass through the machine's memory as they load and are held on the GPU with the KV
/// caches, so each memory is checked for what it takes.
pub fn check_headers(
    path: &Path,
    file: WeightFile,
    headers: &[TensorHeader],
    cfg: &ModelConfig,
    reserve: KvReserve,
    device: &Device,
) -> Result<()> {
    let weights = peak_weight_bytes(headers, file);
    let kv = reserve.bytes_for(&KvLayout::for_model(cfg, reserve.dtype));
    let on_host = if device.is_cpu() { kv } else { 0 };
    if let Some(machine) = machine_memory() {
        check_fits(path, weights, on_host, &machine)?;
    }
    match gpu_memory(device)? {
        Some(gpu) => check_fits(path, held_weight_bytes(headers, file), kv, &gpu),
        None => Ok(()),
    }
}

/// The memory free on `device` where it is a GPU: what its weights and caches can take.
/// candle's buffers and cuBLAS's workspace come on top.
#[cfg(feature = "cuda")]
fn gpu_memory(device: &Device) -> Result<Option<MachineMemory>> {
    use candle_core::cuda_backend::cudarc::driver::result::mem_get_info;
    let Device::Cuda(gpu) = device else {
        return Ok(None);
    };
    let unreadable = |e: &dyn std::fmt::Display| EngineError::DeviceUnavailable {
        device: format!("{:?}", device.location()),
        reason: format!("its free memory cannot be read: {e}"),
    };
    let stream = gpu.cuda_stream();
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| unreadable(&e))?;
    let (free, _total) = mem_get_info().map_err(|e| unreadable(&e))?;
    Ok(Some(MachineMemory {
        bytes: free as u64,
        source: "the GPU's free memory",
    }))
}

/// Without the `cuda` feature no device but the CPU opens.
#[cfg(not(feature = "cuda"))]
fn gpu_memory(_device: &Device) -> Result<Option<MachineMemory>> {
    Ok(None)
}

#[cfg(test)]
mod tests;
