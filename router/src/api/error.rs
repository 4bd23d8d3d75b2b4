//! Error bodies, in the two formats `--error-format` chooses between.

use serde::Serialize;

/// An error as the client sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ErrorBody {
    /// OpenAI's `{"error": {"message", "type", "param", "code"}}`.
    Openai { error: ErrorObject },
    /// The hosted provider's (seed 003): `{"code", "result": null, "message"}`.
    Provider {
        code: u32,
        result: Option<()>,
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request parameter at fault, if one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ErrorBody {
    /// The body as JSON text, for an SSE error event.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an error body serializes")
    }
}
