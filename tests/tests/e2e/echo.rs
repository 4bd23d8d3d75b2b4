//! `echo` with prompt logprobs, and prompts as token ids, on /v1/completions: the prefill
//! node scores the prompt under PD, the decode node when colocated, and both agree with the
//! engine run directly. What lm-eval's loglikelihood tasks send.

use candle_core::Device;
use e2e::{tiny_model, Cluster, Mode};
use serde_json::{json, Value};

const PROMPT: &str = "The router speaks the OpenAI completions API to every client.";

/// What the engine itself makes of `PROMPT`: its tokens, and each token after the first
/// scored from the positions before it, with 2 alternatives.
fn direct() -> (Vec<u32>, Vec<engine::Sampled>) {
    let loaded = engine::load(&tiny_model(), &Device::Cpu).expect("loading the model");
    let ids = loaded.tokenizer.encode(PROMPT).unwrap();
    let scored = e2e::scored_directly(&loaded, &ids, 2);
    (ids, scored)
}

/// Logprobs equal but for rounding, relative to their size: the tiny model's dense products
/// run through candle's `gemm`, whose sums depend on how many rows a chunk has, and the
/// prefill node scores in chunks of 4.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-4 * b.abs().max(1.0)
}

fn body(prompt: Value, extra: Value) -> Value {
    let mut b = json!({"model": "test", "prompt": prompt, "max_tokens": 3, "temperature": 0,
        "ignore_eos": true});
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

#[tokio::test]
async fn echo_scores_the_prompt_under_pd_and_colocated_as_the_engine_does() {
    let (ids, scored) = direct();
    // Chunks of 4 tokens: the prefill node scores the prompt piece by piece.
    let pd = Cluster::start_with(Mode::Pd, &tiny_model(), &[], &["--chunk-tokens", "4"]).await;
    let colo = Cluster::start(Mode::Colocated, &tiny_model(), &[]).await;
    // The prefix cache holds this prompt after a plain request: echo must not take it.
    let (status, plain) = pd
        .post("/v1/completions", &body(json!(PROMPT), json!({})))
        .await;
    assert_eq!(status, 200, "{plain}");
    let generated = plain["choices"][0]["text"].as_str().unwrap().to_string();
    let echo = json!({"echo": true, "logprobs": 2});
    let mut seen = Vec::new();
    for (mode, c) in [("pd", &pd), ("colocated", &colo)] {
        for prompt in [json!(PROMPT), json!(ids), json!([ids]), json!([PROMPT])] {
            let (status, v) = c
                .post("/v1/completions", &body(prompt.clone(), echo.clone()))
                .await;
            assert_eq!(status, 200, "{mode} {prompt}: {v}");
            let choice = &v["choices"][0];
            assert_eq!(choice["text"], format!("{PROMPT}{generated}"), "{mode}");
            let lp = &choice["logprobs"];
            let tokens = lp["tokens"].as_array().unwrap();
            assert_eq!(tokens.len(), ids.len() + 3, "{mode}: {lp}");
            assert_eq!(lp["token_logprobs"][0], Value::Null);
            assert_eq!(lp["top_logprobs"][0], Value::Null);
            assert_eq!(lp["text_offset"][0], 0);
            for (i, s) in scored.iter().enumerate() {
                let got = lp["token_logprobs"][i + 1].as_f64().unwrap();
                assert!(
                    close(got, f64::from(s.logprob)),
                    "{mode}: token {} scored {got}, the engine {}",
                    i + 1,
                    s.logprob
                );
                let top = lp["top_logprobs"][i + 1].as_object().unwrap();
                assert!(top.len() >= 2, "{mode}: {top:?}");
            }
            // Offsets index the echoed text: the generated part starts after the prompt.
            let gen_offset = lp["text_offset"][ids.len()].as_u64().unwrap() as usize;
            assert_eq!(gen_offset, PROMPT.chars().count(), "{mode}");
            assert_eq!(v["usage"]["prompt_tokens"], ids.len());
            assert_eq!(v["usage"]["completion_tokens"], 3);
            seen.push(lp["token_logprobs"].clone());
        }
    }
    assert!(seen.windows(2).all(|w| {
        let (a, b) = (w[0].as_array().unwrap(), w[1].as_array().unwrap());
        a.iter()
            .zip(b)
            .skip(1)
            .all(|(x, y)| close(x.as_f64().unwrap(), y.as_f64().unwrap()))
    }));

    // Streamed: the prompt comes with each choice's first token, scored.
    let mut streamed = body(json!(PROMPT), echo);
    streamed["stream"] = json!(true);
    let (status, data) = pd.post_sse("/v1/completions", &streamed).await;
    assert_eq!(status, 200);
    let chunks = e2e::sse_chunks(&data);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, format!("{PROMPT}{generated}"));
    let first = &chunks[0]["choices"][0]["logprobs"];
    assert_eq!(first["tokens"].as_array().unwrap().len(), ids.len() + 1);
    assert_eq!(first["token_logprobs"][0], Value::Null);

    // Echo without logprobs: text only, and nothing scored.
    let (_, v) = pd
        .post(
            "/v1/completions",
            &body(json!(PROMPT), json!({"echo": true})),
        )
        .await;
    assert_eq!(v["choices"][0]["text"], format!("{PROMPT}{generated}"));
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
}

#[tokio::test]
async fn token_id_prompts_are_checked() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    for (prompt, says) in [
        (json!([]), "prompt must not be empty"),
        (json!([1, -2]), "prompt token ids must be integers in [0, "),
        (
            json!([1, 99999999]),
            "prompt token ids must be integers in [0, ",
        ),
        (
            json!([[1, 2], [3]]),
            "one prompt per request is served, got 2",
        ),
        (json!(["a", "b"]), "one prompt per request is served, got 2"),
        (json!([1.5]), "prompt token ids must be integers in [0, "),
        (
            json!({"text": "x"}),
            "prompt must be a string, a list of token ids",
        ),
    ] {
        let (status, v) = c
            .post("/v1/completions", &body(prompt.clone(), json!({})))
            .await;
        assert_eq!(status, 400, "{prompt}: {v}");
        assert_eq!(v["error"]["param"], "prompt", "{prompt}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(says), "{prompt}: {message}");
    }
    let (status, v) = c
        .post("/v1/completions", &body(json!(PROMPT), json!({"echo": 1})))
        .await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["param"], "echo");
}
