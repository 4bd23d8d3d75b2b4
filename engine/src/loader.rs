//! One call that turns a path into everything a node needs: model, tokenizer, template.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::Device;

use crate::chat_template::ChatTemplate;
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// A model with the tokenizer and chat template that came with it.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// `None` when the model ships no chat template.
    pub template: Option<ChatTemplate>,
}

/// Loads a Hugging Face folder or a GGUF file.
pub fn load(path: &Path, device: &Device) -> Result<Loaded> {
    let model = Model::load(path, device)?;
    let (tokenizer, template) = if path.is_dir() {
        (
            Tokenizer::from_file(&path.join("tokenizer.json"))?,
            ChatTemplate::from_hf_folder(path)?,
        )
    } else {
        let mut file = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| EngineError::invalid_model(path, e.to_string()))?;
        let tokenizer = Tokenizer::from_gguf(&content, path)?;
        let token = |key: &str| {
            content
                .metadata
                .get(key)
                .and_then(|v| v.to_u64().ok())
                .and_then(|id| tokenizer.id_token(id as u32))
                .unwrap_or_default()
        };
        let template = match content
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
        {
            Some(src) => Some(ChatTemplate::new(
                src,
                &token("tokenizer.ggml.bos_token_id"),
                &token("tokenizer.ggml.eos_token_id"),
            )?),
            None => None,
        };
        (tokenizer, template)
    };
    Ok(Loaded {
        model,
        tokenizer,
        template,
    })
}
