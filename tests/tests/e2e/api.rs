//! The seeds' example requests get responses in the seeds' shapes.

use e2e::{metric, scrape, tiny_model, Cluster, Mode};
use serde_json::{json, Value};

/// Checks a non-streamed chat or text completion field by field; returns the text.
pub fn check_response(v: &Value, object: &str, model: &str) -> String {
    assert!(v["id"].as_str().is_some_and(|s| !s.is_empty()), "id: {v}");
    assert_eq!(v["object"], object, "{v}");
    assert!(
        v["created"].as_u64().is_some_and(|t| t > 1_700_000_000),
        "created: {v}"
    );
    assert_eq!(v["model"], model);
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 1);
    let c = &choices[0];
    assert_eq!(c["index"], 0);
    let finish = c["finish_reason"].as_str().expect("finish_reason");
    assert!(finish == "stop" || finish == "length", "{finish}");
    let text = if object == "chat.completion" {
        assert_eq!(c["message"]["role"], "assistant");
        assert!(c["message"]["tool_calls"].is_array());
        assert!(c["logprobs"].is_null());
        c["message"]["content"]
            .as_str()
            .expect("content")
            .to_string()
    } else {
        assert!(c["stop_reason"].is_null());
        c["text"].as_str().expect("text").to_string()
    };
    let completion = check_usage(&v["usage"]);
    assert!(
        v["prefill_time"].as_f64().is_some_and(|t| t > 0.0),
        "prefill_time: {v}"
    );
    let decode = v["decode_time_arr"].as_array().expect("decode_time_arr");
    assert_eq!(
        decode.len(),
        completion - 1,
        "one decode time per decode step: {v}"
    );
    assert!(decode.iter().all(|t| t.as_f64().is_some_and(|t| t > 0.0)));
    text
}

/// Checks a usage object; returns completion_tokens.
pub fn check_usage(u: &Value) -> usize {
    let prompt = u["prompt_tokens"].as_u64().expect("prompt_tokens") as usize;
    let completion = u["completion_tokens"].as_u64().expect("completion_tokens") as usize;
    assert!(prompt > 0 && completion > 0, "{u}");
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some((prompt + completion) as u64)
    );
    // The prefix cache reuses whole blocks of 16 tokens of an earlier prompt.
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens") as usize;
    assert!(cached < prompt && cached.is_multiple_of(16), "{u}");
    for key in ["batch_size", "queue_wait_time"] {
        let a = u[key].as_array().unwrap_or_else(|| panic!("{key}: {u}"));
        assert_eq!(a.len(), completion, "{key} has one entry per token: {u}");
        assert!(a.iter().all(Value::is_u64), "{key}: {u}");
    }
    assert!(u["batch_size"]
        .as_array()
        .unwrap()
        .iter()
        .all(|b| b.as_u64() >= Some(1)));
    completion
}

#[tokio::test]
async fn streamed_chat_has_the_seeds_chunks() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    // 000's single-turn example.
    let mut body = e2e::seed_requests().remove(0).1;
    assert!(body["messages"].is_array(), "{body}");
    body["model"] = json!(c.model_name);
    body["stream"] = json!(true);
    body["ignore_eos"] = json!(true);
    body["stop_token_ids"] = json!([]);
    let (status, data) = c.post_sse("/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    let chunks = e2e::sse_chunks(&data);
    let (last, tokens) = chunks.split_last().unwrap();
    assert_eq!(tokens.len(), 20, "one chunk per token, then the last chunk");
    let id = &chunks[0]["id"];
    for ch in tokens {
        assert_eq!(&ch["id"], id);
        assert_eq!(ch["object"], "chat.completion.chunk");
        assert_eq!(ch["model"], c.model_name.as_str());
        assert!(ch["created"].is_u64());
        let choice = &ch["choices"][0];
        assert_eq!(choice["index"], 0);
        assert_eq!(choice["delta"]["role"], "assistant");
        assert!(choice["delta"]["content"].is_string());
        assert!(choice["finish_reason"].is_null());
        assert!(ch.get("usage").is_none());
    }
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(
        last.get("full_text").is_none(),
        "full_text only with fullTextEnabled"
    );
    assert_eq!(check_usage(&last["usage"]), 20);
}

#[tokio::test]
async fn seed_completion_example_streamed_and_not() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    // 002's request fields (beam search, n and logprobs have tests of their own).
    let body = json!({"model": c.model_name, "prompt": "who are you", "temperature": 1,
        "max_tokens": 5, "ignore_eos": true, "stream": false, "seed": 7});
    let (status, v) = c.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let text = check_response(&v, "text_completion", &c.model_name);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, data) = c.post_sse("/v1/completions", &streamed).await;
    assert_eq!(status, 200);
    let chunks = e2e::sse_chunks(&data);
    let mut joined = String::new();
    for ch in &chunks {
        assert_eq!(ch["object"], "text_completion");
        joined.push_str(ch["choices"][0]["text"].as_str().unwrap());
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(check_usage(&last["usage"]), 5);
    assert_eq!(joined, text, "same seed, same text, streamed or not");
}

#[tokio::test]
async fn models_health_and_metrics() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &[]).await;
    let get = |path: &str| reqwest::get(format!("{}{path}", c.url));
    let models: Value = get("/v1/models").await.unwrap().json().await.unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], c.model_name.as_str());
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(get("/health").await.unwrap().status(), 200);
    let ops = |path: &str| reqwest::get(format!("http://{}{path}", c.ops));
    let ready: Value = ops("/health/ready").await.unwrap().json().await.unwrap();
    assert_eq!(ready["ready"], true);
    // What names workers and their states stays off the port clients reach.
    for private in ["/metrics", "/health/ready"] {
        assert_eq!(get(private).await.unwrap().status(), 404, "{private}");
    }
    let body = json!({"model": c.model_name, "prompt": "hello", "max_tokens": 2});
    assert_eq!(c.post("/v1/completions", &body).await.0, 200);
    let metrics = ops("/metrics").await.unwrap().text().await.unwrap();
    assert!(
        !metrics.contains(&c.decode),
        "the router's metrics name a worker's address:\n{metrics}"
    );
    assert!(
        metrics.contains("router_requests_total{endpoint=\"completions\",status=\"200\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("router_completion_tokens_total 2"),
        "{metrics}"
    );
    let prefill = c.prefill.as_ref().expect("a PD cluster has a prefill node");
    let page = scrape(prefill).await;
    let value = |name: &str, labels: &str| {
        metric(&page, name, labels).unwrap_or_else(|| panic!("{name} missing:\n{page}"))
    };
    assert_eq!(
        value("prefill_requests_total", "{outcome=\"completed\"}"),
        1.0
    );
    assert!(value("prefill_transfer_bytes_total", "") > 0.0, "{page}");
    let tail = value("prefill_kv_transfer_tail_duration_seconds_sum", "");
    assert!(tail > 0.0 && tail < 30.0, "transfer tail {tail} s:\n{page}");
    // One observation per prompt in each latency histogram.
    for name in [
        "prefill_queue_wait_duration_seconds_count",
        "prefill_compute_duration_seconds_count",
        "prefill_kv_transfer_tail_duration_seconds_count",
    ] {
        assert_eq!(value(name, ""), 1.0, "{name}:\n{page}");
    }
    assert_eq!(
        value("prefill_kv_transfer_tail_duration_seconds_sum", ""),
        tail
    );
    let page = scrape(&c.decode).await;
    let value =
        |name: &str| metric(&page, name, "").unwrap_or_else(|| panic!("{name} missing:\n{page}"));
    assert_eq!(value("decode_queue_wait_duration_seconds_count"), 1.0);
    assert_eq!(value("decode_kv_transfer_duration_seconds_count"), 1.0);
    // Two tokens: the prefill node's and one decode step.
    assert_eq!(value("decode_step_duration_seconds_count"), 1.0);
    assert_eq!(
        value("decode_step_duration_seconds_count"),
        value("decode_steps_total")
    );
    // Two tokens of one choice: one gap between them.
    assert_eq!(
        metric(&metrics, "router_inter_token_latency_seconds_count", ""),
        Some(1.0),
        "{metrics}"
    );
}
