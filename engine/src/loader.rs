//! One call that turns a path into everything a node needs: model, tokenizer, template.

use std::path::{Path, PathBuf};

use candle_core::Device;
use text::{ChatTemplate, Tokenizer};

use crate::device::DeviceChoice;
use crate::error::Result;
use crate::footprint::{self, KvReserve, KvRoom, WeightFile};
use crate::kv_cache::KvDtype;
use crate::model::Model;
use crate::progress::LoadStep;
use crate::weights::{DenseMatrices, PackReport, WeightSource};

/// A model with the tokenizer and chat template that came with it.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// `None` when the model ships no chat template.
    pub template: Option<ChatTemplate>,
    /// What the load did with its pack of K-quant weights, where it used one.
    pub pack: Option<PackReport>,
}

/// How a node loads its model.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// The KV memory the node reserves, and the element type its caches hold: with the
    /// weights, it must fit the machine.
    pub reserve: KvReserve,
    /// Where a GGUF model's K-quant matrices are mapped from, and kept for the next load
    /// ([`crate::pack`]); every load repacks them into its own memory without one.
    pub pack_dir: Option<PathBuf>,
    /// How a folder's bf16 and f16 matrices are held; `None` for the device's choice
    /// ([`DenseMatrices::for_device`]).
    pub matrices: Option<DenseMatrices>,
}

/// The flags by which a prefill or a decode node names its model, where it computes and
/// what its KV caches hold: the same on both nodes, so declared once.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Hugging Face model folder or GGUF file, or a Hub name (`org/name[@rev][:QUANT]`)
    /// fetched into the Hugging Face cache first.
    #[arg(long = "model", value_name = "MODEL", env = "TANDEM_MODEL")]
    pub path: PathBuf,
    /// A folder for packs of a GGUF model's K-quant weights as the kernels lay them out:
    /// the first load writes one, later loads map it instead of repacking, and every node
    /// on the host that maps it shares one copy in the page cache (docs/engine.md, "Weight
    /// packs"). Unset, each load repacks into its own memory.
    #[arg(long, env = "TANDEM_WEIGHTS_CACHE")]
    pub weights_cache: Option<PathBuf>,
    /// Where the model, its KV caches and activations live: `cpu`, or `cuda[:N]` in a build
    /// with the `cuda` feature (docs/gpu.md).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: DeviceChoice,
    /// What the KV caches hold: `f16`, or `q8_0` (llama.cpp's Q8_0 blocks, 53% of f16's
    /// bytes to keep, send and read each step; CPU only). Prefill and decode nodes and the
    /// router of one cluster must agree: it pairs only workers whose caches are its own
    /// type (docs/engine.md, "KV cache").
    #[arg(long, env = "TANDEM_KV_CACHE_DTYPE", default_value = "f16")]
    pub kv_cache_dtype: KvDtype,
}

impl ModelArgs {
    /// Opens the device and loads the model onto it, the node reserving `room` of KV
    /// memory in caches of the flags' `kv_cache_dtype`, each step of reading the weights
    /// logged.
    pub fn load(&self, room: KvRoom) -> Result<Loaded> {
        let device = self.device.open()?;
        let options = LoadOptions {
            reserve: room.of(self.kv_cache_dtype),
            pack_dir: self.weights_cache.clone(),
            matrices: None,
        };
        load_reporting(&self.path, &device, &options, &mut crate::progress::log)
    }
}

/// Loads a Hugging Face folder or a GGUF file.
pub fn load(path: &Path, device: &Device) -> Result<Loaded> {
    load_within(path, device, KvReserve::default())
}

/// [`load`], first refusing a model whose weights and the KV memory its node reserves
/// (`reserve`) exceed the machine's memory (`footprint`), before any weight is read.
pub fn load_within(path: &Path, device: &Device, reserve: KvReserve) -> Result<Loaded> {
    let options = LoadOptions {
        reserve,
        ..LoadOptions::default()
    };
    load_reporting(path, device, &options, &mut |_| {})
}

/// [`load_within`] as `options` say, calling `report` after each step of reading the
/// weights.
pub fn load_reporting(
    path: &Path,
    device: &Device,
    options: &LoadOptions,
    report: &mut dyn FnMut(LoadStep),
) -> Result<Loaded> {
    let text = text::load(path)?;
    // Before any weight is read: a cache the model's heads or the device cannot take.
    let kv_dtype = options.reserve.dtype;
    kv_dtype.check(text.config.head_dim, device)?;
    let (mut model, pack) = if path.is_dir() {
        let matrices = options
            .matrices
            .unwrap_or_else(|| DenseMatrices::for_device(device));
        // The safetensors headers alone: opening the folder reads its weights.
        let file = WeightFile::Folder(matrices);
        footprint::check_model(path, file, &text.config, options.reserve, device)?;
        let model = Model::load_reporting(path, text.config, device, matrices, report)?;
        (model, None)
    } else {
        // One read of the GGUF header serves the check and the weights.
        let mut gguf = WeightSource::open_gguf_listed(path)?;
        let (cfg, reserve) = (&text.config, options.reserve);
        footprint::check_headers(path, WeightFile::Gguf, &gguf.tensors, cfg, reserve, device)?;
        if let Some(dir) = &options.pack_dir {
            gguf.source.use_pack(dir)?;
        }
        let model = Model::load_source(text.config, &mut gguf.source, device, report)?;
        let pack = gguf.source.finish_pack();
        if let Some(pack) = &pack {
            pack.log();
        }
        (model, pack)
    };
    model.set_kv_dtype(kv_dtype)?;
    Ok(Loaded {
        model,
        tokenizer: text.tokenizer,
        template: text.template,
        pack,
    })
}
