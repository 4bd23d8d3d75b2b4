//! Stop strings, stop_token_ids, min_tokens and logprobs, honoured under PD: the router matches stop
//! strings on the text, P reports the first token's logprobs and D the rest.

use candle_core::Device;
use e2e::{tiny_model, Cluster, Mode};
use serde_json::{json, Value};

const PROMPT: &str = "The router speaks the OpenAI chat completions API.";

fn completion(extra: Value) -> Value {
    let mut body = json!({"model": "test", "prompt": PROMPT, "max_tokens": 24,
        "temperature": 0, "ignore_eos": true});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn text(v: &Value) -> &str {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
}

/// Concatenated text of a streamed completion, and its last chunk.
fn joined(data: &[String]) -> (String, Value) {
    let chunks = e2e::sse_chunks(data);
    let text = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    (text, chunks.last().unwrap().clone())
}

#[tokio::test]
async fn stop_strings_end_the_text_streamed_and_not() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let (_, full) = c.post("/v1/completions", &completion(json!({}))).await;
    let full = text(&full).to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 16, "{full:?}");
    // A stop string from the middle of the greedy output: it spans token boundaries.
    let stop: String = chars[8..13].iter().collect();
    let before = &full[..full.find(&stop).unwrap()];
    for include in [false, true] {
        let body = completion(
            json!({"stop": [stop, "never appears"], "include_stop_str_in_output": include}),
        );
        let (status, v) = c.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{v}");
        let expected = if include {
            format!("{before}{stop}")
        } else {
            before.to_string()
        };
        assert_eq!(text(&v), expected, "include={include}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["choices"][0]["stop_reason"], stop.as_str());
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 24);

        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (_, data) = c.post_sse("/v1/completions", &streamed).await;
        let (joined, last) = joined(&data);
        assert_eq!(joined, expected, "streamed, include={include}");
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert_eq!(last["choices"][0]["stop_reason"], stop.as_str());
        assert_eq!(
            last["usage"]["completion_tokens"],
            v["usage"]["completion_tokens"]
        );
    }
}

/// 001 and 002 (MindIE) allow one stop string of up to 32768 characters ("string类型长度
/// 范围为1~32768"); it is matched as the text grows, at the cost of the bytes each token adds.
#[tokio::test]
async fn one_stop_string_may_have_32768_characters() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let (_, full) = c.post("/v1/completions", &completion(json!({}))).await;
    let full = text(&full).to_string();
    let head: String = full.chars().take(4).collect();
    let long = format!("{head}{}", "z".repeat(32768 - 4));
    let (status, v) = c
        .post("/v1/completions", &completion(json!({"stop": long})))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        text(&v),
        full,
        "a stop string that never completes holds nothing back"
    );
    let (status, v) = c
        .post(
            "/v1/completions",
            &completion(json!({"stop": "z".repeat(32769)})),
        )
        .await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("stop")),
        "{v}"
    );
}

/// vLLM's min_tokens: no stop string ends a choice within its first min_tokens tokens, and
/// the text is not held back or cut for one found there.
#[tokio::test]
async fn stop_strings_wait_for_min_tokens() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let (_, full) = c.post("/v1/completions", &completion(json!({}))).await;
    let full = text(&full).to_string();
    let stop: String = full.chars().skip(8).take(5).collect();
    let body = completion(json!({"stop": [stop], "min_tokens": 24}));
    let (status, v) = c.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(text(&v), full);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, data) = c.post_sse("/v1/completions", &streamed).await;
    let (joined, last) = joined(&data);
    assert_eq!(joined, full);
    assert_eq!(last["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn stop_token_ids_end_generation_under_pd() {
    let model = tiny_model();
    let loaded = engine::load(&model, &Device::Cpu).unwrap();
    let ids = loaded.tokenizer.encode(PROMPT).unwrap();
    let mut cache = loaded.model.new_cache().unwrap();
    let params = engine::SamplingParams::default();
    let out =
        engine::generate::generate(&loaded.model, &mut cache, &ids, &params, 24, &[]).unwrap();
    let tokens: Vec<u32> = out.iter().map(|s| s.token).collect();
    // The first token D makes that did not appear before it.
    let k = (1..tokens.len())
        .find(|&i| !tokens[..i].contains(&tokens[i]))
        .expect("a fresh token");
    let c = Cluster::start(Mode::Pd, &model, &[]).await;
    let (status, v) = c
        .post(
            "/v1/completions",
            &completion(json!({"stop_token_ids": [tokens[k]]})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["usage"]["completion_tokens"],
        k + 1,
        "the stop token counts"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], tokens[k]);
    assert_eq!(
        text(&v),
        loaded.tokenizer.decode(&tokens[..k], true).unwrap()
    );
    // Seed 000: "By default, the output does not contain the token ID in the list for
    // stopping inference"; include_stop_str_in_output keeps it.
    let (_, kept) = c
        .post(
            "/v1/completions",
            &completion(json!({"stop_token_ids": [tokens[k]], "include_stop_str_in_output": true})),
        )
        .await;
    assert_eq!(
        text(&kept),
        loaded.tokenizer.decode(&tokens[..=k], true).unwrap()
    );
    assert_eq!(kept["choices"][0]["stop_reason"], tokens[k]);
}

fn completion_logprobs(v: &Value) -> (Vec<f64>, Vec<Value>, Vec<u64>) {
    let lp = &v["choices"][0]["logprobs"];
    let f = |k: &str| {
        lp[k]
            .as_array()
            .unwrap_or_else(|| panic!("{k}: {v}"))
            .clone()
    };
    (
        f("token_logprobs")
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect(),
        f("top_logprobs"),
        f("text_offset")
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect(),
    )
}

#[tokio::test]
async fn completion_logprobs_match_between_pd_and_colocated() {
    let model = tiny_model();
    let pd = Cluster::start(Mode::Pd, &model, &[]).await;
    let colo = Cluster::start(Mode::Colocated, &model, &[]).await;
    let body = completion(json!({"logprobs": 2, "max_tokens": 8}));
    let (_, a) = pd.post("/v1/completions", &body).await;
    let (_, b) = colo.post("/v1/completions", &body).await;
    let (lp_a, top_a, off_a) = completion_logprobs(&a);
    let (lp_b, _, _) = completion_logprobs(&b);
    assert_eq!(lp_a.len(), 8, "{a}");
    assert_eq!(
        a["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        8
    );
    for (x, y) in lp_a.iter().zip(&lp_b) {
        assert!((x - y).abs() < 1e-5, "PD {lp_a:?} vs colocated {lp_b:?}");
    }
    assert_eq!(off_a[0], 0);
    assert!(off_a.windows(2).all(|w| w[0] <= w[1]), "{off_a:?}");
    for (lp, top) in lp_a.iter().zip(&top_a) {
        assert!(*lp <= 0.0);
        let top = top.as_object().unwrap();
        assert!(
            (1..=3).contains(&top.len()),
            "two alternatives plus the sampled token: {top:?}"
        );
        // Greedy: the sampled token is the most likely one.
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((best - lp).abs() < 1e-6, "{lp} vs {top:?}");
    }
}

#[tokio::test]
async fn chat_top_logprobs_streamed_and_not() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let body = json!({"model": "test", "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        "top_logprobs": 3, "messages": [{"role": "user", "content": "hello"}]});
    let (status, v) = c.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len(), 6);
    for e in &content {
        assert!(e["token"].is_string() && e["logprob"].as_f64().unwrap() <= 0.0);
        assert!(e["bytes"].is_array());
        let top: Vec<f64> = e["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect();
        assert_eq!(top.len(), 3);
        assert!(top.windows(2).all(|w| w[0] >= w[1]), "best first: {top:?}");
        assert_eq!(
            top[0],
            e["logprob"].as_f64().unwrap(),
            "greedy picks the best"
        );
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, data) = c.post_sse("/v1/chat/completions", &streamed).await;
    let chunks = e2e::sse_chunks(&data);
    let streamed_entries: Vec<Value> = chunks[..chunks.len() - 1]
        .iter()
        .map(|ch| {
            let c = ch["choices"][0]["logprobs"]["content"].as_array().unwrap();
            assert_eq!(c.len(), 1, "one entry per token chunk");
            c[0].clone()
        })
        .collect();
    assert_eq!(streamed_entries, content);
}

fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i);
            c["text"].as_str().unwrap().to_string()
        })
        .collect()
}

#[tokio::test]
async fn n_sequences_from_one_transferred_kv() {
    let model = tiny_model();
    let pd = Cluster::start(Mode::Pd, &model, &[]).await;
    let colo = Cluster::start(Mode::Colocated, &model, &[]).await;
    let body = completion(json!({"n": 3, "temperature": 0.9, "seed": 5, "max_tokens": 12}));
    let (status, a) = pd.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{a}");
    let (_, b) = colo.post("/v1/completions", &body).await;
    assert_eq!(
        texts(&a),
        texts(&b),
        "PD and colocated make the same three sequences"
    );
    assert_eq!(
        a["usage"]["completion_tokens"], 36,
        "usage counts every sequence"
    );
    // Each sequence is what one process makes with that choice's seed.
    let loaded = engine::load(&model, &Device::Cpu).unwrap();
    let ids = loaded.tokenizer.encode(PROMPT).unwrap();
    for (i, text) in texts(&a).iter().enumerate() {
        let params = engine::SamplingParams {
            temperature: 0.9,
            seed: 5,
            ..Default::default()
        }
        .for_choice(i);
        let mut cache = loaded.model.new_cache().unwrap();
        let out =
            engine::generate::generate(&loaded.model, &mut cache, &ids, &params, 12, &[]).unwrap();
        let tokens: Vec<u32> = out.iter().map(|s| s.token).collect();
        assert_eq!(
            text,
            &loaded.tokenizer.decode(&tokens, true).unwrap(),
            "choice {i}"
        );
    }
    let distinct: std::collections::HashSet<_> = texts(&a).into_iter().collect();
    assert!(distinct.len() > 1, "different seeds, different sequences");
}

#[tokio::test]
async fn best_of_returns_the_most_likely_sequence() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let all = completion(
        json!({"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 10, "logprobs": 0}),
    );
    let (_, all) = c.post("/v1/completions", &all).await;
    let sums: Vec<f64> = all["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ch| {
            ch["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .sum()
        })
        .collect();
    let best = (0..3).max_by(|&i, &j| sums[i].total_cmp(&sums[j])).unwrap();
    let body =
        completion(json!({"n": 1, "best_of": 3, "temperature": 1.0, "seed": 11, "max_tokens": 10}));
    let (status, v) = c.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(texts(&v), vec![texts(&all)[best].clone()], "sums {sums:?}");
    assert_eq!(
        v["usage"]["completion_tokens"], 30,
        "best_of counts every sequence made"
    );
}

#[tokio::test]
async fn streamed_chat_with_n_two() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let body = json!({"model": "test", "n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 8,
        "ignore_eos": true, "messages": [{"role": "user", "content": "hello"}]});
    let (_, whole) = c.post("/v1/chat/completions", &body).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, data) = c.post_sse("/v1/chat/completions", &streamed).await;
    let chunks = e2e::sse_chunks(&data);
    let mut joined = [String::new(), String::new()];
    let mut finishes = 0;
    for ch in &chunks {
        let choice = &ch["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        joined[i].push_str(choice["delta"]["content"].as_str().unwrap());
        if choice["finish_reason"].is_string() {
            finishes += 1;
        }
    }
    assert_eq!(finishes, 2, "one finish chunk per choice");
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 16);
    for i in 0..2 {
        assert_eq!(
            joined[i],
            whole["choices"][i]["message"]["content"].as_str().unwrap()
        );
    }
}

/// Seed 002's response with n = 2 continues `text_offset` across choices: choice 0's text
/// "? who am I?" has offsets [0, 1, 5, 8, 10] and choice 1's start at 11.
#[tokio::test]
async fn text_offsets_continue_from_one_choice_to_the_next() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let body = completion(json!({"n": 2, "temperature": 1, "seed": 5, "logprobs": 1,
        "max_tokens": 5}));
    let (status, v) = c.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    let first_len = choices[0]["text"].as_str().unwrap().chars().count();
    assert_eq!(choices[0]["logprobs"]["text_offset"][0], 0, "{v}");
    assert_eq!(
        choices[1]["logprobs"]["text_offset"][0].as_u64(),
        Some(first_len as u64),
        "{v}"
    );
}

/// With n = 2, a stop string met in one choice ends that choice on the decode node too
/// (EndSequence) while the other goes on: the node stops paying for tokens nobody sees.
#[tokio::test]
async fn a_choice_ended_by_a_stop_string_stops_decoding() {
    let c = Cluster::start(Mode::Pd, &e2e::smollm2(), &[]).await;
    let body = |stop: Value| {
        json!({"model": c.model_name, "prompt": "Once upon a time", "n": 2, "seed": 7,
            "temperature": 0.8, "max_tokens": 64, "ignore_eos": true, "stop": stop})
    };
    let (status, free) = c.post("/v1/completions", &body(json!(null))).await;
    assert_eq!(status, 200, "{free}");
    let first = free["choices"][0]["text"].as_str().unwrap().to_string();
    let second = free["choices"][1]["text"].as_str().unwrap().to_string();
    // A piece of choice 0's early text that choice 1 never writes.
    let chars: Vec<char> = first.chars().collect();
    let stop = (0..chars.len().saturating_sub(6))
        .map(|i| chars[i..i + 6].iter().collect::<String>())
        .find(|s| !second.contains(s.as_str()) && !s.trim().is_empty())
        .expect("a stop string only choice 0 writes");
    let generated = || async {
        let page = e2e::scrape(&c.decode).await;
        e2e::metric(&page, "decode_generated_tokens_total", "").unwrap_or(0.0)
    };
    let before = generated().await;
    let (status, v) = c.post("/v1/completions", &body(json!([stop]))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["choices"][0]["stop_reason"], stop.as_str(), "{v}");
    assert_eq!(
        v["choices"][1]["text"],
        second.as_str(),
        "the other choice is untouched"
    );
    assert_eq!(v["choices"][1]["finish_reason"], "length", "{v}");
    let decoded = generated().await - before;
    // Without EndSequence the node decodes 2 x 63 tokens (the prefill node samples each
    // choice's first); with it, choice 0 stops a few steps after its stop string.
    assert!(decoded < 100.0, "the decode node made {decoded} tokens");
}
