//! The inference engine shared by the prefill and decode nodes: model, KV cache, kernels and
//! sampling. The text side (tokenizer, chat template) is the `text` crate's. No networking
//! lives here.

mod act_quant;
mod ahead;
mod attention;
pub mod beam;
mod cpu_rows;
pub mod dense_matrix;
pub mod device;
pub mod embedding;
pub mod error;
pub mod footprint;
pub mod fuzz;
pub mod generate;
pub mod gguf_export;
pub mod kquant;
pub mod kv_cache;
pub mod loader;
mod logprobs;
pub mod model;
pub mod pack;
pub mod progress;
pub mod q4;
pub mod q8;
mod rms_norm;
mod room;
mod rope;
pub mod sampling;
mod split;
mod swiglu;
pub mod testmodel;
mod vexp;
pub mod weights;

pub use device::DeviceChoice;
pub use error::{EngineError, Result};
pub use footprint::{KvReserve, KvRoom};
pub use kv_cache::{
    KvAssembler, KvChunk, KvDtype, KvLayout, SeqCache, Staged, Stager, UnknownKvDtype, KV_DTYPE,
};
pub use loader::{load, load_reporting, load_within, LoadOptions, Loaded, ModelArgs};
pub use model::{Model, SeqInput};
pub use progress::LoadStep;
pub use sampling::{Sampled, SamplingParams};
/// Structured outputs' grammars and token masks, which sampling applies.
pub use text::grammar;
