//! Streamed text: valid UTF-8 in every chunk, the same text as the non-streamed answer,
//! the seeds' fullTextEnabled shape, and both kinds served at once by a router on one
//! thread.

use e2e::{smollm2, tiny_model, Cluster, Mode};
use serde_json::{json, Value};

fn content(ch: &Value) -> &str {
    ch["choices"][0]["delta"]["content"]
        .as_str()
        .expect("delta.content")
}

#[tokio::test]
async fn streamed_chinese_is_valid_utf8_and_equals_the_whole_text() {
    let c = Cluster::start(Mode::Pd, &smollm2(), &[]).await;
    let mut body = json!({"model": "test", "prompt": "北京是中国的首都，也是", "max_tokens": 40,
        "temperature": 0, "ignore_eos": true});
    let (status, whole) = c.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    let whole = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(
        whole.chars().any(|ch| ch.len_utf8() == 3),
        "the model should continue in Chinese for this test to mean anything: {whole:?}"
    );
    body["stream"] = json!(true);
    let (status, data) = c.post_sse("/v1/completions", &body).await;
    assert_eq!(status, 200);
    let texts: Vec<String> = e2e::sse_chunks(&data)
        .iter()
        .map(|ch| ch["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(texts.concat(), whole);
    // Only the last chunk may end in U+FFFD: a length cut inside a character shows as
    // the full decode shows it.
    let (_, before_last) = texts.split_last().unwrap();
    assert!(
        before_last.iter().all(|t| !t.contains('\u{FFFD}')),
        "a chunk split a character: {texts:?}"
    );
}

#[tokio::test]
async fn full_text_enabled_streams_cumulative_content_and_full_text() {
    let c = Cluster::start(Mode::Pd, &smollm2(), &["--fullTextEnabled"]).await;
    let mut body = json!({"model": "test", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]});
    let (status, whole) = c.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{whole}");
    let whole = whole["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    body["stream"] = json!(true);
    let (_, data) = c.post_sse("/v1/chat/completions", &body).await;
    let chunks = e2e::sse_chunks(&data);
    let (last, tokens) = chunks.split_last().unwrap();
    for pair in tokens.windows(2) {
        assert!(
            content(&pair[1]).starts_with(content(&pair[0])),
            "content is cumulative: {:?} then {:?}",
            content(&pair[0]),
            content(&pair[1])
        );
    }
    assert_eq!(last["full_text"].as_str(), Some(whole.as_str()));
    assert_eq!(content(last), whole);
    assert!(last["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    assert!(last["choices"][0]["finish_reason"].is_string());
}

#[tokio::test]
async fn a_router_on_one_thread_serves_concurrent_unary_and_streamed_requests() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &["--threads", "1"]).await;
    let body = json!({"model": "test", "max_tokens": 16, "temperature": 0, "ignore_eos": true,
        "messages": [{"role": "user", "content": "Count with me."}]});
    let url = format!("{}/v1/chat/completions", c.url);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let unary: Vec<_> = (0..3)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            tokio::spawn(async move { e2e::post(&url, &body).await })
        })
        .collect();
    let streams: Vec<_> = (0..3)
        .map(|_| {
            let (url, body) = (url.clone(), streamed.clone());
            tokio::spawn(async move { e2e::post_sse(&url, &body).await })
        })
        .collect();
    let mut texts = Vec::new();
    for u in unary {
        let (status, answer) = u.await.unwrap();
        assert_eq!(status, 200, "{answer}");
        texts.push(
            answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    for s in streams {
        let (status, data) = s.await.unwrap();
        assert_eq!(status, 200, "{data:?}");
        texts.push(e2e::chat_stream_content(&e2e::sse_chunks(&data)));
    }
    assert!(!texts[0].is_empty());
    assert!(texts.iter().all(|t| *t == texts[0]), "{texts:?}");
    let page = c.router_metrics().await;
    assert_eq!(
        e2e::metric(&page, "process_threads", ""),
        Some(1.0),
        "one thread serves everything:\n{page}"
    );
}
