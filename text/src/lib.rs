//! A model's text side, shared by the router and the engine: the tokenizer, the chat
//! template, the hyper-parameters a model file declares, and the parsers that find
//! reasoning and tool calls in generated text. No tensors: the router links this crate and
//! not candle.

mod alphabet;
pub mod chat_template;
pub mod config;
mod encode;
pub mod error;
pub mod gguf;
pub mod grammar;
mod load;
mod rope;
pub mod specials;
pub mod structured;
pub mod tokenizer;
pub mod tools;

pub use chat_template::{py_json, ChatInput, ChatTemplate};
pub use config::{Activation, Gemma, ModelConfig, MoeConfig, RopeStyle};
pub use error::{Result, TextError};
pub use load::{load, TextModel};
pub use rope::{longrope_uses_long_factors, LayerRopes, Rope, RopeScaling};
pub use tokenizer::{IncrementalDecoder, Tokenizer};

/// The ChatML template, with tools and thinking, that the generated test models carry.
pub const CHATML_TEMPLATE: &str = include_str!("chatml.jinja");
