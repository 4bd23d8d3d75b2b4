//! One call that turns a path into everything a node needs: model, tokenizer, template.

use std::path::Path;

use candle_core::Device;
use text::{ChatTemplate, Tokenizer};

use crate::error::Result;
use crate::model::Model;
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
    let text = text::load(path)?;
    let model = if path.is_dir() {
        Model::load(path, device)?
    } else {
        Model::from_gguf(&mut WeightSource::open_gguf(path)?, text.config, device)?
    };
    Ok(Loaded {
        model,
        tokenizer: text.tokenizer,
        template: text.template,
    })
}
