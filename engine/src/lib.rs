//! The inference engine shared by the prefill and decode nodes: model, KV cache, tokenizer,
//! chat template and sampling. No networking lives here.

mod act_quant;
mod attention;
pub mod beam;
pub mod chat_template;
pub mod config;
mod encode;
pub mod error;
pub mod fuzz;
pub mod generate;
pub mod gguf_export;
pub mod kv_cache;
pub mod loader;
mod masked_softmax;
pub mod model;
pub mod q4;
pub mod q8;
pub mod sampling;
mod split;
mod swiglu;
pub mod testmodel;
pub mod tokenizer;
pub mod weights;

pub use chat_template::{py_json, ChatInput, ChatTemplate};
pub use config::ModelConfig;
pub use error::{EngineError, Result};
pub use kv_cache::{KvAssembler, KvChunk, KvLayout, SeqCache};
pub use loader::{load, load_text, Loaded, TextModel};
pub use model::{Model, SeqInput};
pub use sampling::{Sampled, SamplingParams};
pub use tokenizer::{IncrementalDecoder, Tokenizer};

/// The engine's version: caches are exchanged only between workers of the same one.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
