//! The engine's integration tests, one binary so the build links once.

mod common;
mod kv_and_batching;
mod loading;
mod reference;
mod smollm2;
mod templates;
