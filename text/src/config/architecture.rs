//! The architectures the engine runs, named once: read from a `config.json`'s
//! `model_type` (or its class) and from a GGUF file's `general.architecture`.

use std::fmt;

/// An architecture the engine runs, whichever file it comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    Llama,
    Mistral,
    Mixtral,
    Qwen2,
    Qwen2Moe,
    Qwen3,
    Qwen3Moe,
    Gemma2,
    Gemma3,
    Phi3,
}

impl Architecture {
    /// Every one, for the messages that list them.
    pub const ALL: [Architecture; 10] = [
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Llama,
        Architecture::Mistral,
        Architecture::Mixtral,
        Architecture::Phi3,
        Architecture::Qwen2,
        Architecture::Qwen2Moe,
        Architecture::Qwen3,
        Architecture::Qwen3Moe,
    ];

    /// transformers' `model_type` of its text model.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen2Moe => "qwen2_moe",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3_text",
            Architecture::Phi3 => "phi3",
        }
    }

    /// transformers' causal-LM class of it.
    fn class(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen2Moe => "Qwen2MoeForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
            Architecture::Gemma2 => "Gemma2ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
            Architecture::Phi3 => "Phi3ForCausalLM",
        }
    }

    /// A config's architecture from its `model_type`, or, when it has none, from its first
    /// `architectures` class; `None` for one the engine does not run.
    pub fn from_hf(model_type: &str, class: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|a| a.model_type() == model_type || (model_type.is_empty() && a.class() == class))
    }

    /// The `general.architecture` llama.cpp's converter writes for it, which also prefixes
    /// its metadata keys: Mistral's and Mixtral's files are `llama` files.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Architecture::Llama | Architecture::Mistral | Architecture::Mixtral => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen2Moe => "qwen2moe",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Moe => "qwen3moe",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3",
            Architecture::Phi3 => "phi3",
        }
    }

    /// A GGUF file's architecture from its `general.architecture`; a `llama` file is
    /// [`Architecture::Llama`] whatever model it was converted from.
    pub fn from_gguf(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Architecture::Llama),
            _ => Self::ALL.into_iter().find(|a| a.gguf_name() == name),
        }
    }

    /// Gemma 2 or Gemma 3.
    pub fn is_gemma(self) -> bool {
        matches!(self, Architecture::Gemma2 | Architecture::Gemma3)
    }
}

impl fmt::Display for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.model_type())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_is_found_by_its_names() {
        for a in Architecture::ALL {
            assert_eq!(Architecture::from_hf(a.model_type(), ""), Some(a));
            assert_eq!(Architecture::from_hf("", a.class()), Some(a));
            let from_file = Architecture::from_gguf(a.gguf_name()).unwrap();
            assert_eq!(from_file.gguf_name(), a.gguf_name());
        }
        assert_eq!(Architecture::from_gguf("llama"), Some(Architecture::Llama));
        assert_eq!(Architecture::from_hf("gemma3", ""), None);
        assert_eq!(Architecture::from_hf("", "GPT2LMHeadModel"), None);
        assert_eq!(
            Architecture::from_hf("qwen2", "LlamaForCausalLM"),
            Some(Architecture::Qwen2)
        );
        assert_eq!(Architecture::from_gguf("mistral3"), None);
    }
}
