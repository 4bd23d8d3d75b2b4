//! One call that turns a path into everything a node needs: model, tokenizer, template.

use std::path::Path;

use candle_core::Device;

use crate::chat_template::ChatTemplate;
use crate::error::Result;
use crate::model::Model;
use crate::tokenizer::Tokenizer;
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
    if path.is_dir() {
        return Ok(Loaded {
            model: Model::load(path, device)?,
            tokenizer: Tokenizer::from_file(&path.join("tokenizer.json"))?,
            template: ChatTemplate::from_hf_folder(path)?,
        });
    }
    let mut src = WeightSource::open_gguf(path)?;
    let content = src.gguf_content().expect("opened as GGUF");
    let tokenizer = Tokenizer::from_gguf(content, path)?;
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
        Some(source) => Some(ChatTemplate::new(
            source,
            &token("tokenizer.ggml.bos_token_id"),
            &token("tokenizer.ggml.eos_token_id"),
        )?),
        None => None,
    };
    let model = Model::from_gguf(&mut src, path, device)?;
    Ok(Loaded {
        model,
        tokenizer,
        template,
    })
}
