//! The engine's integration tests, one binary so the build links once.

mod common;
mod folder_matrices;
mod kv_and_batching;
mod llama_cpp;
mod loading;
mod packs;
mod q8_cache;
mod reference;
mod rope;
mod smollm2;
mod step_kernels;
mod templates;
