//! Real chat templates render exactly as Python's `transformers` renders them, and real
//! tokenizers give the same ids. Expected strings come from `scripts/oracle_*.py`.

use crate::common;

use std::path::Path;

use serde_json::Value;
use text::{ChatInput, ChatTemplate, Tokenizer};

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}; run scripts/fetch-models.sh", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn input(case: &Value) -> ChatInput {
    ChatInput {
        messages: case["messages"].clone(),
        tools: Some(case["tools"].clone()).filter(|t| !t.is_null()),
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
        kwargs: case["kwargs"].as_object().cloned().unwrap_or_default(),
    }
}

/// Renders every case of a fixture with `template` and compares to Python's output.
fn check_cases(name: &str, template: &ChatTemplate, fixture: &Value) {
    let cases = fixture["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for (i, case) in cases.iter().enumerate() {
        let got = template
            .render(&input(case))
            .unwrap_or_else(|e| panic!("{name} case {i}: {e}"));
        assert_eq!(got, case["rendered"].as_str().unwrap(), "{name} case {i}");
    }
}

fn check_ids(name: &str, tok: &Tokenizer, cases: &Value) {
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(tok.encode(text).unwrap(), want, "{name}: {text:?}");
    }
}

/// Qwen3 and DeepSeek-V3, loaded from their folders the way a served model is.
#[test]
fn qwen3_and_deepseek_v3_templates_and_tokenizers_match_transformers() {
    for name in ["qwen3", "deepseek_v3"] {
        let dir = common::models_dir().join(name);
        let fixture = read_json(&common::fixture(&format!("templates/{name}.json")));
        let template = ChatTemplate::from_hf_folder(&dir)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .unwrap_or_else(|| panic!("{name}: no chat template in {}", dir.display()));
        check_cases(name, &template, &fixture);
        let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        check_ids(name, &tok, &fixture["token_ids"]);
    }
}
