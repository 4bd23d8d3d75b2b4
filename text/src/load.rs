//! One call that turns a model path into its text side: hyper-parameters, tokenizer and chat
//! template, without reading any weights.

use std::path::Path;

use crate::chat_template::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::gguf::{Metadata, Value};
use crate::tokenizer::Tokenizer;

/// What the router needs of a model: everything but the weights.
pub struct TextModel {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// `None` when the model ships no chat template.
    pub template: Option<ChatTemplate>,
}

/// Loads the config, tokenizer and template of a Hugging Face folder or GGUF file.
pub fn load(path: &Path) -> Result<TextModel> {
    if path.is_dir() {
        return Ok(TextModel {
            config: ModelConfig::from_hf_file(&path.join("config.json"))?,
            tokenizer: Tokenizer::from_file(&path.join("tokenizer.json"))?,
            template: ChatTemplate::from_hf_folder(path)?,
        });
    }
    let meta = Metadata::open(path)?;
    let tokenizer = Tokenizer::from_gguf(&meta, path)?;
    let token = |key: &str| {
        meta.get(key)
            .and_then(Value::to_u64)
            .and_then(|id| tokenizer.id_token(id as u32))
            .unwrap_or_default()
    };
    let template = match meta.get("tokenizer.chat_template").and_then(Value::as_str) {
        Some(source) => Some(ChatTemplate::new(
            source,
            &token("tokenizer.ggml.bos_token_id"),
            &token("tokenizer.ggml.eos_token_id"),
        )?),
        None => None,
    };
    Ok(TextModel {
        config: ModelConfig::from_gguf(&meta, path)?,
        tokenizer,
        template,
    })
}
