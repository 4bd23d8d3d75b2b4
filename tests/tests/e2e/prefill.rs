//! The prefill node under load: a prompt sharing a prefix with an earlier one reuses its KV
//! (fewer prefill seconds, the same tokens), and a long prompt computed in chunks lets a
//! short one that arrives behind it finish first.

use std::time::{Duration, Instant};

use e2e::{metric, scrape, smollm2, wait_metric, Cluster, Mode};
use serde_json::{json, Value};

/// A chat turn on top of a long shared system prompt.
fn turn(question: &str) -> Value {
    let system = "You are the support assistant of a cluster that serves language models. \
        It splits inference into a prefill pool and a decode pool. "
        .repeat(12);
    json!({"model": "test", "temperature": 0, "max_tokens": 12,
        "messages": [{"role": "system", "content": system},
            {"role": "user", "content": question}]})
}

fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap()
}

#[tokio::test]
async fn a_shared_prefix_is_reused_and_gives_the_same_tokens() {
    let cached = Cluster::start(Mode::Pd, &smollm2(), &[]).await;
    let uncached =
        Cluster::start_with(Mode::Pd, &smollm2(), &[], &["--prefix-cache-mb", "0"]).await;
    let (_, first) = cached
        .post("/v1/chat/completions", &turn("What is a prefill pool?"))
        .await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second = turn("What is a decode pool?");
    let (status, hit) = cached.post("/v1/chat/completions", &second).await;
    assert_eq!(status, 200, "{hit}");
    let (_, miss) = uncached.post("/v1/chat/completions", &second).await;
    let reused = hit["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = hit["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        reused >= prompt / 2 && reused.is_multiple_of(16),
        "{reused} of {prompt}: {hit}"
    );
    assert_eq!(miss["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(content(&hit), content(&miss), "the cache changes no token");
    let (t_hit, t_miss) = (
        hit["prefill_time"].as_f64().unwrap(),
        miss["prefill_time"].as_f64().unwrap(),
    );
    assert!(
        t_hit < t_miss,
        "prefill_time with the cache {t_hit} ms, without {t_miss} ms"
    );
    let page = scrape(cached.prefill.as_deref().unwrap()).await;
    assert_eq!(
        metric(&page, "prefill_prefix_cache_hits_total", ""),
        Some(1.0),
        "{page}"
    );
    assert_eq!(
        metric(&page, "prefill_cached_tokens_total", ""),
        Some(reused as f64)
    );
    assert!(metric(&page, "prefill_prefix_cache_bytes", "").unwrap() > 0.0);
}

/// The `cached_tokens` of `turn(question)` sent with API key `key`.
async fn cached_with_key(c: &Cluster, key: &str, question: &str) -> u64 {
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", c.url))
        .bearer_auth(key)
        .json(&turn(question))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn one_api_key_cannot_see_another_key_s_prompts_in_the_prefix_cache() {
    let c = Cluster::start(Mode::Pd, &smollm2(), &["--api-keys", "key-a,key-b"]).await;
    assert_eq!(
        cached_with_key(&c, "key-a", "What is a prefill pool?").await,
        0
    );
    // key-b sends the same system prompt: it computes it all, as if key-a had sent nothing.
    assert_eq!(
        cached_with_key(&c, "key-b", "What is a decode pool?").await,
        0
    );
    // Each key reuses its own.
    assert!(cached_with_key(&c, "key-a", "What is a router?").await > 0);
    assert!(cached_with_key(&c, "key-b", "What is a router?").await > 0);
}

/// A short prompt sent behind a long one: its answer, when each answer came back, and
/// what the prefill node had computed of both when the short one's came back.
struct Behind {
    short: Value,
    short_done: Instant,
    long_done: Instant,
    /// Prompt tokens the prefill node computed from the long prompt's start to the short
    /// prompt's answer.
    computed_by_short_done: u64,
    long_prompt_tokens: u64,
}

/// Sends a long prompt (about 600 tokens) to a cluster whose prefill node computes it in
/// chunks of 32, and once the node runs it, a short one.
async fn short_behind_long(prefill_args: &[&str]) -> Behind {
    let mut args = vec!["--chunk-tokens", "32", "--prefix-cache-mb", "0"];
    args.extend(prefill_args);
    let c = Cluster::start_with(Mode::Pd, &smollm2(), &[], &args).await;
    let p = c.prefill.clone().unwrap();
    let computed = || async { metric(&scrape(&p).await, "prefill_prompt_tokens_total", "") };
    let before = computed().await.unwrap_or(0.0);
    let long = json!({"model": "test", "max_tokens": 1, "temperature": 0,
        "prompt": "The prefill node computes long prompts in chunks. ".repeat(60)});
    let short = json!({"model": "test", "max_tokens": 1, "temperature": 0,
        "prompt": "Hello"});
    let url = format!("{}/v1/completions", c.url);
    let long_url = url.clone();
    let long_task = tokio::spawn(async move {
        let r = e2e::post(&long_url, &long).await;
        (r, Instant::now())
    });
    wait_metric(
        &p,
        "prefill_running_prompts",
        "",
        1.0,
        Duration::from_secs(20),
    )
    .await;
    let (status, v) = e2e::post(&url, &short).await;
    let short_done = Instant::now();
    let by_short_done = computed()
        .await
        .expect("the prefill node counts its tokens");
    assert_eq!(status, 200, "{v}");
    let ((status, long_v), long_done) = long_task.await.unwrap();
    assert_eq!(status, 200, "{long_v}");
    Behind {
        short: v,
        short_done,
        long_done,
        computed_by_short_done: (by_short_done - before) as u64,
        long_prompt_tokens: long_v["usage"]["prompt_tokens"].as_u64().unwrap(),
    }
}

#[tokio::test]
async fn a_short_prompt_behind_a_long_one_joins_its_chunks_and_finishes_first() {
    let b = short_behind_long(&[]).await;
    assert!(
        b.short_done < b.long_done,
        "the short prompt waited for the whole long one"
    );
    assert_eq!(
        b.short["usage"]["batch_size"][0], 2,
        "the short prompt shared a step with the long one's chunk: {}",
        b.short
    );
}

#[tokio::test]
async fn prompts_past_the_active_token_bound_wait_without_a_cache() {
    // The long prompt runs alone past --max-active-tokens 100; the short one waits for it
    // instead of taking a cache beside it.
    // Whether the long answer or the short one comes back first is a race after both
    // prompts are computed (the long one's cache moves to the decode node while the short
    // one runs): what holds is that the long prompt was computed whole first.
    let b = short_behind_long(&["--max-active-tokens", "100"]).await;
    assert!(
        b.computed_by_short_done > b.long_prompt_tokens,
        "the short prompt started beside the long one: {} of its {} tokens and the short \
         one's computed",
        b.computed_by_short_done,
        b.long_prompt_tokens
    );
    assert_eq!(
        b.short["usage"]["batch_size"][0], 1,
        "it ran alone: {}",
        b.short
    );
}
