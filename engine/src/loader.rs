//! One call that turns a path into everything a node needs: model, tokenizer, template.

use std::path::Path;

use candle_core::Device;
use text::{ChatTemplate, Tokenizer};

use crate::error::Result;
use crate::footprint::{self, KvReserve};
use crate::model::Model;
use crate::progress::LoadStep;
use crate::weights::WeightSource;

/// A model with the tokenizer and chat template that came with it.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// `None` when the model ships no chat template.
    pub template: Option<ChatTemplate>,
}

/// Loads a Hugging Face folder or a GGUF file.
pub fn load(path: &Path, device: &Device) -> Result<Loaded> {
    load_within(path, device, KvReserve::default())
}

/// [`load`], first refusing a model whose weights and the KV memory its node reserves
/// (`reserve`) exceed the machine's memory (`footprint`), before any weight is read.
pub fn load_within(path: &Path, device: &Device, reserve: KvReserve) -> Result<Loaded> {
    load_reporting(path, device, reserve, &mut |_| {})
}

/// [`load_within`], calling `report` after each step of reading the weights.
pub fn load_reporting(
    path: &Path,
    device: &Device,
    reserve: KvReserve,
    report: &mut dyn FnMut(LoadStep),
) -> Result<Loaded> {
    let text = text::load(path)?;
    let model = if path.is_dir() {
        // The safetensors headers alone: opening the folder reads its weights.
        footprint::check_model(path, &text.config, reserve)?;
        Model::load_reporting(path, text.config, device, report)?
    } else {
        // One read of the GGUF header serves the check and the weights.
        let mut gguf = WeightSource::open_gguf_listed(path)?;
        footprint::check_headers(path, &gguf.tensors, &text.config, reserve)?;
        Model::load_source(text.config, &mut gguf.source, device, report)?
    };
    Ok(Loaded {
        model,
        tokenizer: text.tokenizer,
        template: text.template,
    })
}
