//! `GET /v1/models`.

use serde::Serialize;

/// The models served: one.
#[derive(Debug, Serialize)]
pub struct ModelList<'a> {
    pub object: &'static str,
    pub data: Vec<Model<'a>>,
}

#[derive(Debug, Serialize)]
pub struct Model<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// vLLM's field: the most prompt + output tokens.
    pub max_model_len: usize,
}
