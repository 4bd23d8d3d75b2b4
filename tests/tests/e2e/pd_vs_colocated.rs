//! Correctness first: a request through router → P → D gives exactly the tokens of the
//! colocated worker and of one in-process engine, for the same seed. This test stays.

use candle_core::Device;
use e2e::{smollm2, tiny_model, Cluster, Mode};
use serde_json::{json, Value};

/// What one process makes of `prompt`: the engine's plain generation loop.
fn one_process(
    model: &std::path::Path,
    prompt: &str,
    params: &engine::SamplingParams,
    n: usize,
) -> String {
    let loaded = engine::load(model, &Device::Cpu).expect("loading the model");
    let ids = loaded.tokenizer.encode(prompt).unwrap();
    let mut cache = loaded.model.new_cache().unwrap();
    let out = engine::generate::generate(&loaded.model, &mut cache, &ids, params, n, &[]).unwrap();
    let tokens: Vec<u32> = out.iter().map(|s| s.token).collect();
    loaded.tokenizer.decode(&tokens, true).unwrap()
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .or(v["choices"][0]["message"]["content"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

#[tokio::test]
async fn pd_equals_colocated_equals_one_process() {
    let model = tiny_model();
    // Small transfer messages (every layer's K/V crosses in several), and the prompt
    // computed in chunks of 4 tokens, 6 tokens a step: chunked prefill gives the same
    // tokens as one pass.
    let pd = Cluster::start_with(
        Mode::Pd,
        &model,
        &[],
        &[
            "--transfer-chunk-bytes",
            "256",
            "--chunk-tokens",
            "4",
            "--step-tokens",
            "6",
        ],
    )
    .await;
    let colo = Cluster::start(Mode::Colocated, &model, &[]).await;
    let prompt = "The router speaks the OpenAI chat completions API.";
    let cases = [
        (json!({"temperature": 0}), engine::SamplingParams::default()),
        (
            json!({"temperature": 0.8, "seed": 42}),
            engine::SamplingParams {
                temperature: 0.8,
                seed: 42,
                ..Default::default()
            },
        ),
        (
            json!({"temperature": 1.2, "top_k": 20, "top_p": 0.9, "seed": 18446744073709551615u64,
                   "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5}),
            engine::SamplingParams {
                temperature: 1.2,
                top_k: 20,
                top_p: 0.9,
                seed: u64::MAX,
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                frequency_penalty: 0.5,
            },
        ),
    ];
    for (sampling, params) in cases {
        let mut body =
            json!({"model": "test", "prompt": prompt, "max_tokens": 24, "ignore_eos": true});
        body.as_object_mut()
            .unwrap()
            .extend(sampling.as_object().unwrap().clone());
        let (s1, a) = pd.post("/v1/completions", &body).await;
        let (s2, b) = colo.post("/v1/completions", &body).await;
        assert_eq!((s1, s2), (200, 200), "{a}\n{b}");
        let expected = one_process(&model, prompt, &params, 24);
        assert_eq!(text_of(&a), expected, "PD against one process, {sampling}");
        assert_eq!(
            text_of(&b),
            expected,
            "colocated against one process, {sampling}"
        );
        assert_eq!(a["usage"]["completion_tokens"], 24);
        assert_eq!(b["usage"]["completion_tokens"], 24);
    }
}

#[tokio::test]
async fn pd_equals_colocated_on_smollm2_chat() {
    let model = smollm2();
    let pd = Cluster::start(Mode::Pd, &model, &[]).await;
    let colo = Cluster::start(Mode::Colocated, &model, &[]).await;
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 0.8, "seed": 1234}),
    ] {
        let mut body = json!({"model": "test", "max_tokens": 32,
            "messages": [{"role": "user", "content": "Write one sentence about the sea."}]});
        body.as_object_mut()
            .unwrap()
            .extend(sampling.as_object().unwrap().clone());
        let (s1, a) = pd.post("/v1/chat/completions", &body).await;
        let (s2, b) = colo.post("/v1/chat/completions", &body).await;
        assert_eq!((s1, s2), (200, 200), "{a}\n{b}");
        assert!(!text_of(&a).is_empty());
        assert_eq!(text_of(&a), text_of(&b), "{sampling}");
        assert_eq!(
            a["usage"]["completion_tokens"],
            b["usage"]["completion_tokens"]
        );
        assert_eq!(
            a["choices"][0]["finish_reason"],
            b["choices"][0]["finish_reason"]
        );
    }
}
