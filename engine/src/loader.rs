//! One call that turns a path into everything a node needs: model, tokenizer, template.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::Device;

use crate::chat_template::ChatTemplate;
use crate::config::ModelConfig;
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

/// What the router needs of a model: everything but the weights.
pub struct TextModel {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// `None` when the model ships no chat template.
    pub template: Option<ChatTemplate>,
}

/// Loads a Hugging Face folder or a GGUF file.
pub fn load(path: &Path, device: &Device) -> Result<Loaded> {
    if path.is_dir() {
        let (tokenizer, template) = hf_text(path)?;
        return Ok(Loaded {
            model: Model::load(path, device)?,
            tokenizer,
            template,
        });
    }
    let mut src = WeightSource::open_gguf(path)?;
    let content = src.gguf_content().expect("opened as GGUF");
    let (tokenizer, template) = gguf_text(content, path)?;
    let model = Model::from_gguf(&mut src, path, device)?;
    Ok(Loaded {
        model,
        tokenizer,
        template,
    })
}

/// Loads the config, tokenizer and template of a Hugging Face folder or GGUF file, without
/// reading any weights.
pub fn load_text(path: &Path) -> Result<TextModel> {
    if path.is_dir() {
        let (tokenizer, template) = hf_text(path)?;
        return Ok(TextModel {
            config: ModelConfig::from_hf_file(&path.join("config.json"))?,
            tokenizer,
            template,
        });
    }
    let src = WeightSource::open_gguf(path)?;
    let content = src.gguf_content().expect("opened as GGUF");
    let (tokenizer, template) = gguf_text(content, path)?;
    Ok(TextModel {
        config: ModelConfig::from_gguf(content, path)?,
        tokenizer,
        template,
    })
}

fn hf_text(dir: &Path) -> Result<(Tokenizer, Option<ChatTemplate>)> {
    Ok((
        Tokenizer::from_file(&dir.join("tokenizer.json"))?,
        ChatTemplate::from_hf_folder(dir)?,
    ))
}

fn gguf_text(
    content: &gguf_file::Content,
    path: &Path,
) -> Result<(Tokenizer, Option<ChatTemplate>)> {
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
    Ok((tokenizer, template))
}
