//! What the router's unit tests share: the bundled model's tokenizer and template
//! (`models/`, fetched by `scripts/fetch-models.sh`), loaded once per test binary.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// The bundled SmolLM2's text side, as the router loads it.
pub(crate) fn bundled() -> Arc<text::TextModel> {
    static TEXT: OnceLock<Arc<text::TextModel>> = OnceLock::new();
    Arc::clone(TEXT.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models/smollm2-135m-instruct-q4_1.gguf");
        Arc::new(text::load(&path).expect("the bundled model (scripts/fetch-models.sh)"))
    }))
}
