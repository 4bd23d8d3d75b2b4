//! Real chat templates render exactly as Python's `transformers` renders them, and real
//! tokenizers give the same ids. Expected strings come from `scripts/oracle_*.py`.

use crate::common;

use std::path::Path;

use serde_json::Value;
use text::tools::ToolFormat;
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

/// Today's date as a template's `strftime_now` writes it.
fn today() -> String {
    let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}", "", "").unwrap();
    t.render(&ChatInput::default()).unwrap()
}

/// Llama 3.1/3.2/3.3, Mistral Nemo and Small 3.2, Gemma 2 and 3 and Phi-3.5-mini: the
/// models' own templates render every case as transformers does (through the path the
/// router takes for a template that teaches tools, `text::tools::render`), and each
/// teaches the tool format the router reads its calls in. The fixture's day, where a
/// template writes the date, stands for today's.
#[test]
fn family_templates_render_as_transformers_does() {
    let families = [
        "llama3_1",
        "llama3_2",
        "llama3_3",
        "mistral_nemo",
        "mistral_small_3_2",
        "gemma2",
        "gemma3",
        "phi3_5",
    ];
    for name in families {
        let fixture = read_json(&common::fixture(&format!("templates/{name}.json")));
        let token = |k: &str| fixture[k].as_str().unwrap().to_string();
        let template = ChatTemplate::new(
            fixture["template"].as_str().unwrap(),
            &token("bos_token"),
            &token("eos_token"),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let format = ToolFormat::detect(template.source()).map(|f| format!("{f:?}"));
        assert_eq!(format.as_deref(), fixture["format"].as_str(), "{name}");
        for (i, case) in fixture["cases"].as_array().unwrap().iter().enumerate() {
            let (before, got, after) = (
                today(),
                text::tools::render(&template, &input(case)),
                today(),
            );
            let got = got.unwrap_or_else(|e| panic!("{name} case {i}: {e}"));
            let want = case["rendered"].as_str().unwrap();
            let on = |day: &str| want.replace(fixture["day"].as_str().unwrap(), day);
            assert!(
                got == on(&before) || got == on(&after),
                "{name} case {i}:\n{got}\n---\n{}",
                on(&before)
            );
        }
    }
}
