//! The generated tiny model against Hugging Face `transformers` on the same folder: chat
//! rendering, token ids, first-step logits and 32 greedy tokens per prompt.
//! `engine/tests/fixtures/tiny_reference.json` comes from `scripts/oracle_generated.py`;
//! if the generator changes, rerun that script (see scripts/README.md).

use serde_json::Value;
use text::ChatInput;

use crate::common;

#[test]
fn tiny_model_matches_transformers_token_for_token() {
    matches_reference(&common::tiny_model_dir(), "tiny_reference.json");
}

/// The same model turned Qwen3 (`engine::testmodel::into_qwen3`: per-head q/k RMSNorm, no
/// q/k/v biases) against transformers' Qwen3ForCausalLM, `tiny_qwen3_reference.json`.
#[test]
fn tiny_qwen3_matches_transformers_token_for_token() {
    matches_reference(&common::tiny_qwen3_dir(), "tiny_qwen3_reference.json");
}

/// The same model turned Mistral (`engine::testmodel::into_mistral`: no biases, every
/// layer attending to the last 16 positions) against transformers' MistralForCausalLM,
/// `tiny_mistral_reference.json`. Every prompt is longer than the window, and the greedy
/// tokens run further past it one step at a time.
#[test]
fn tiny_mistral_with_a_sliding_window_matches_transformers_token_for_token() {
    matches_reference(&common::tiny_mistral_dir(), "tiny_mistral_reference.json");
}

/// The same model turned Llama 3.1 (`engine::testmodel::into_llama3`: no biases, Llama 3's
/// RoPE scaling past a context of 64) against transformers' LlamaForCausalLM,
/// `tiny_llama3_reference.json`.
#[test]
fn tiny_llama3_matches_transformers_token_for_token() {
    matches_reference(&common::tiny_llama3_dir(), "tiny_llama3_reference.json");
}

/// The tiny model turned Qwen3-MoE against transformers' Qwen3MoeForCausalLM,
/// `tiny_qwen3_moe_reference.json`: every layer a mixture of 8 experts, 2 per token.
#[test]
fn tiny_qwen3_moe_matches_transformers_token_for_token() {
    matches_reference(
        &common::tiny_qwen3_moe_dir(),
        "tiny_qwen3_moe_reference.json",
    );
}

/// The tiny model turned Mixtral against transformers' MixtralForCausalLM,
/// `tiny_mixtral_reference.json`.
#[test]
fn tiny_mixtral_matches_transformers_token_for_token() {
    matches_reference(&common::tiny_mixtral_dir(), "tiny_mixtral_reference.json");
}

/// The tiny model turned Qwen2-MoE against transformers' Qwen2MoeForCausalLM,
/// `tiny_qwen2_moe_reference.json`: unnormalized routing and a gated shared expert.
#[test]
fn tiny_qwen2_moe_matches_transformers_token_for_token() {
    matches_reference(
        &common::tiny_qwen2_moe_dir(),
        "tiny_qwen2_moe_reference.json",
    );
}

/// The tiny model turned Gemma 2 against transformers' Gemma2ForCausalLM,
/// `tiny_gemma2_reference.json`: scaled embeddings, Gemma's four norms a layer (weights
/// offset from 1), GeLU, a sliding layer then a global one, `query_pre_attn_scalar`,
/// attention scores and logits soft-capped.
#[test]
fn tiny_gemma2_matches_transformers_token_for_token() {
    matches_reference(&common::tiny_gemma2_dir(), "tiny_gemma2_reference.json");
}

/// The tiny model turned Gemma 3 against transformers' Gemma3ForCausalLM,
/// `tiny_gemma3_reference.json`: Gemma 2's layers without the attention cap, q/k norms,
/// five sliding layers rotated by a base of 1e4 to a global one by 1e6 scaled by 8.
#[test]
fn tiny_gemma3_matches_transformers_token_for_token() {
    matches_reference(&common::tiny_gemma3_dir(), "tiny_gemma3_reference.json");
}

/// The tiny model turned Phi-3 against transformers' Phi3ForCausalLM,
/// `tiny_phi3_reference.json`: q/k/v and gate/up each one matrix, three quarters of each
/// head rotated, LongRoPE's long factors (every prompt is past its original context).
#[test]
fn tiny_phi3_matches_transformers_token_for_token() {
    matches_reference(&common::tiny_phi3_dir(), "tiny_phi3_reference.json");
}

fn matches_reference(dir: &std::path::Path, fixture: &str) {
    let fx: Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture(fixture)).unwrap()).unwrap();
    let loaded = engine::load(dir, &common::device()).unwrap();
    let template = loaded
        .template
        .as_ref()
        .expect("generated models carry a template");
    let prompts = fx["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 6);
    for p in prompts {
        let name = p["name"].as_str().unwrap();
        let text = p["prompt"].as_str().unwrap();
        if let Some(messages) = p.get("messages") {
            let rendered = template
                .render(&ChatInput {
                    messages: messages.clone(),
                    tools: Some(p["tools"].clone()).filter(|t| !t.is_null()),
                    add_generation_prompt: true,
                    kwargs: p["kwargs"].as_object().cloned().unwrap_or_default(),
                })
                .unwrap();
            assert_eq!(rendered, text, "{name}: chat rendering");
        }
        let want_ids: Vec<u32> = serde_json::from_value(p["prompt_ids"].clone()).unwrap();
        let ids = loaded.tokenizer.encode(text).unwrap();
        assert_eq!(ids, want_ids, "{name}: prompt ids");

        let logits = loaded.model.logits_for(&ids).unwrap();
        common::assert_top5(name, &logits, &p["first_step_top5"]);
        let want: Vec<u32> = serde_json::from_value(p["generated_ids"].clone()).unwrap();
        let got = common::greedy(&loaded.model, &ids, want.len());
        assert_eq!(got, want, "{name}: greedy tokens");
        assert_eq!(
            loaded.tokenizer.decode(&got, false).unwrap(),
            p["generated_text"].as_str().unwrap(),
            "{name}: decoded text"
        );
    }
}
