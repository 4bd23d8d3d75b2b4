//! Workers that die or stop under requests: a prefill node killed mid-prompt (retried on
//! another), a decode node killed mid-stream with stream migration off (an error event) or
//! mid-way through a unary request (finished elsewhere), a prompt held at a busy prefill
//! node, and a stopped decode node (without migration its streams end; new requests avoid
//! it). Streams that move are in `migration.rs`.

use std::time::Duration;

use e2e::{
    metric, poll_until, scrape, sse_chunks, tiny_model, wait_metric, workers_in, Fleet, Role,
    SseStream,
};
use serde_json::json;

use super::cluster::*;

/// A prompt of at least `tokens` tokens of the tiny model, counted with its tokenizer.
pub(crate) fn long_prompt(tokens: usize) -> String {
    let tk = text::Tokenizer::from_file(&tiny_model().join("tokenizer.json"))
        .expect("the tiny model's tokenizer");
    let mut prompt = String::new();
    let mut sentence = 0;
    while tk.encode(&prompt).expect("encoding").len() < tokens {
        prompt.push_str(&format!("Sentence {sentence} of a long prompt. "));
        sentence += 1;
    }
    prompt
}

#[tokio::test(flavor = "multi_thread")]
async fn kill9_prefill_is_retried() {
    // 4-token chunks make a long prompt take hundreds of steps, long enough to kill its
    // prefill node mid-way; without a prefix cache the healthy run below leaves nothing
    // that would shorten the second one.
    let prefill_args = with(WORKER, &["--chunk-tokens", "4", "--prefix-cache-mb", "0"]);
    // The decode node would free a broken transfer at the latest after --kv-timeout-ms.
    let decode_args = with(WORKER, &["--kv-timeout-ms", "5000"]);
    let f = start_fleet(&[], 2, &prefill_args, 1, &decode_args).await;
    let body = json!({"model": "test", "prompt": long_prompt(1500), "max_tokens": 8,
        "temperature": 0, "ignore_eos": true});
    let expected = text_of(&f, &body).await;

    let url = format!("{}/v1/completions", f.url);
    let sent = body.clone();
    let pending = tokio::spawn(async move { e2e::post(&url, &sent).await });
    let busy = poll_until(SEE, || async {
        for (i, w) in f.prefill.iter().enumerate() {
            let page = scrape(&w.addr).await;
            if metric(&page, "prefill_running_prompts", "") == Some(1.0) {
                return Some(i);
            }
        }
        None
    })
    .await
    .unwrap_or_else(|| panic!("no prefill node took the prompt; logs:\n{}", f.logs()));
    f.prefill[busy].proc.signal("KILL");

    let (status, v) = pending.await.expect("the request task");
    assert_eq!(status, 200, "{v}\nlogs:\n{}", f.logs());
    assert_eq!(v["choices"][0]["text"], expected.as_str(), "{v}");
    let page = f.router_metrics().await;
    let retries = metric(&page, "router_retries_total", "").unwrap_or(0.0);
    assert!(retries >= 1.0, "the request was not retried:\n{page}");
    let failures = metric(
        &page,
        "router_attempt_failures_total",
        "{culprit=\"prefill\"}",
    )
    .unwrap_or(0.0);
    assert!(
        failures >= 1.0,
        "no failure put on the prefill node:\n{page}"
    );

    let survivor = &f.prefill[1 - busy];
    assert!(prefills_completed(survivor).await >= 1.0);
    prefill_holds_nothing(survivor).await;
    decode_holds_nothing(&f.decode[0]).await;
    // The killed node's lease expires and the router forgets it.
    f.wait_registration(&f.prefill[busy], false, SEE).await;
    f.wait_workers(Role::Prefill, "ready", 1, SEE).await;
}

/// A long generation, so that a stream is still running when its decode node is hit.
const LONG_STREAM: usize = 1900;

/// Opens a long stream and reads its first chunks; returns the chunks so far, the rest of
/// the stream, and which decode node runs it.
async fn stream_in_flight(f: &Fleet) -> (Vec<String>, SseStream, usize) {
    let url = format!("{}/v1/completions", f.url);
    let (status, mut stream) = SseStream::open(&url, &request(0, 2, LONG_STREAM, true)).await;
    assert_eq!(status, 200);
    let mut data = Vec::new();
    for _ in 0..3 {
        data.push(stream.next_data().await.expect("a first chunk"));
    }
    let mut serving = Vec::new();
    for (i, w) in f.decode.iter().enumerate() {
        if w.metric("decode_running_sequences", "").await == 1.0 {
            serving.push(i);
        }
    }
    let &[serving] = serving.as_slice() else {
        panic!("decode nodes running the stream: {serving:?} (it ended before the fault?)");
    };
    (data, stream, serving)
}

/// Reads the rest of a stream whose decode node failed; panics unless it ends within `SEE`
/// with an error event and no finish_reason.
async fn ends_with_error(f: &Fleet, mut data: Vec<String>, mut stream: SseStream) {
    let rest = tokio::time::timeout(SEE, stream.rest()).await;
    data.extend(rest.unwrap_or_else(|_| {
        panic!(
            "the stream did not end {SEE:?} after its decode node failed; logs:\n{}",
            f.logs()
        )
    }));
    let chunks = sse_chunks(&data);
    let last = chunks.last().unwrap();
    assert!(
        last["error"].is_object(),
        "no error event at the end: {last}"
    );
    assert!(
        chunks
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()),
        "a cut stream claims to have finished: {data:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kill9_decode_mid_stream_without_migration_ends_it_with_an_error() {
    let router = with(LONG_ROUTER, &["--stream-migration", "false"]);
    let f = start_fleet(&router, 1, WORKER, 2, WORKER).await;
    let probe = request(1, 2, 16, false);
    let expected = text_of(&f, &probe).await;

    let (data, stream, serving) = stream_in_flight(&f).await;
    f.decode[serving].proc.signal("KILL");
    ends_with_error(&f, data, stream).await;

    // The other decode node serves what comes next.
    let other = &f.decode[1 - serving];
    let before = decodes_admitted(other).await;
    assert_eq!(text_of(&f, &probe).await, expected);
    assert_eq!(decodes_admitted(other).await, before + 1.0);
    prefill_holds_nothing(&f.prefill[0]).await;
}

/// In the provider's error format a cut stream ends the seeds' way (001: on an error during
/// execution "响应输出为空，err_msg非空" with finish_reason stop): each open choice ends with
/// no output and err_msg, then comes the 003 error body. With fullTextEnabled, whose chunks
/// repeat the whole text so far, that chunk is still empty.
#[tokio::test(flavor = "multi_thread")]
async fn a_cut_stream_ends_with_err_msg_in_the_provider_format() {
    let router = with(
        LONG_ROUTER,
        &["--error-format", "provider", "--full-text-enabled"],
    );
    let f = start_fleet(&router, 1, WORKER, 1, WORKER).await;
    let (mut data, mut stream, serving) = stream_in_flight(&f).await;
    f.decode[serving].proc.signal("KILL");
    data.extend(
        tokio::time::timeout(SEE, stream.rest())
            .await
            .unwrap_or_else(|_| panic!("the stream did not end; logs:\n{}", f.logs())),
    );
    let chunks = sse_chunks(&data);
    let [.., ended, last] = chunks.as_slice() else {
        panic!("too few chunks: {data:?}");
    };
    assert_eq!(last["code"], 9999, "{last}");
    assert!(last["result"].is_null(), "{last}");
    assert_eq!(ended["choices"][0]["finish_reason"], "stop", "{ended}");
    assert_eq!(ended["choices"][0]["text"], "", "{ended}");
    assert!(
        ended["err_msg"].as_str().is_some_and(|m| !m.is_empty()),
        "{ended}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kill9_decode_mid_unary_request_starts_it_again_elsewhere() {
    let f = start_fleet(LONG_ROUTER, 1, WORKER, 2, WORKER).await;
    let body = request(0, 2, LONG_STREAM, false);
    let expected = text_of(&f, &body).await;
    let retries = |page: &str| {
        page.lines()
            .find_map(|l| l.strip_prefix("router_retries_total "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let retried_before = retries(&f.router_metrics().await);

    let url = f.url.clone();
    let pending =
        tokio::spawn(async move { e2e::post(&format!("{url}/v1/completions"), &body).await });
    // Wait (bounded) until one decode node runs the request, then kill that one.
    let serving = e2e::poll_until(SEE, || async {
        for (i, w) in f.decode.iter().enumerate() {
            if w.metric("decode_running_sequences", "").await == 1.0 {
                return Some(i);
            }
        }
        None
    })
    .await
    .unwrap_or_else(|| panic!("no decode node ran the request; logs:\n{}", f.logs()));
    f.decode[serving].proc.signal("KILL");

    let (status, v) = tokio::time::timeout(SEE * 3, pending)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the request hung after its decode node died; logs:\n{}",
                f.logs()
            )
        })
        .expect("the client task");
    assert_eq!(status, 200, "{v}\nlogs:\n{}", f.logs());
    // The same tokens as before the fault, all of them, and counted once.
    assert_eq!(v["choices"][0]["text"], expected, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], LONG_STREAM, "{v}");
    assert_eq!(retries(&f.router_metrics().await), retried_before + 1.0);
    assert!(decodes_admitted(&f.decode[1 - serving]).await >= 1.0);
    prefill_holds_nothing(&f.prefill[0]).await;
    decode_holds_nothing(&f.decode[1 - serving]).await;
}

/// The decode node's `--kv-timeout-ms` in `prompt_held_at_prefill_outlasts_the_kv_timeout`.
const SHORT_KV_TIMEOUT: Duration = Duration::from_millis(500);

#[tokio::test(flavor = "multi_thread")]
async fn prompt_held_at_prefill_outlasts_the_kv_timeout() {
    // A prompt can wait in a busy prefill node's queue for longer than the decode node
    // waits for a KV cache. Here the prefill node is paused instead (SIGSTOP, the only
    // way to hold a prompt there for a set time), for 3x the decode node's KV timeout but
    // less than the connection's keepalive allows. The lease outlasts the pause.
    let kv_timeout = SHORT_KV_TIMEOUT.as_millis().to_string();
    let decode_args = with(WORKER, &["--kv-timeout-ms", &kv_timeout]);
    let prefill_args = ["--lease-ttl-s", "120", "--drain-grace-s", "10"];
    let f = start_fleet(&[], 1, &prefill_args, 1, &decode_args).await;
    let body = request(0, 2, 12, false);
    let expected = text_of(&f, &body).await;

    f.prefill[0].proc.signal("STOP");
    let url = f.url.clone();
    let pending =
        tokio::spawn(async move { e2e::post(&format!("{url}/v1/completions"), &body).await });
    f.wait_router("the request in flight", SEE, |page| {
        page.lines()
            .find_map(|l| l.strip_prefix("router_requests_in_flight "))
            .and_then(|v| v.parse::<f64>().ok())
            == Some(1.0)
    })
    .await;
    // The Generate call went out with the prompt, not after it: the decode node already
    // waits for the cache.
    wait_metric(&f.decode[0].addr, "decode_awaited_transfers", "", 1.0, SEE).await;
    // The fault's length, not a synchronisation: the decode node's timeout must pass while
    // the prompt is held.
    tokio::time::sleep(SHORT_KV_TIMEOUT * 3).await;
    assert_eq!(
        f.decode[0].metric("decode_awaited_transfers", "").await,
        1.0,
        "the decode node gave up on the held prompt's cache; logs:\n{}",
        f.logs()
    );
    f.prefill[0].proc.signal("CONT");

    let (status, v) = tokio::time::timeout(SEE, pending)
        .await
        .unwrap_or_else(|_| panic!("the held request never ended; logs:\n{}", f.logs()))
        .expect("the client task");
    assert_eq!(status, 200, "{v}\nlogs:\n{}", f.logs());
    assert_eq!(v["choices"][0]["text"], expected, "{v}");
    prefill_holds_nothing(&f.prefill[0]).await;
    decode_holds_nothing(&f.decode[0]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stopped_decode_mid_stream_without_migration_ends_the_stream() {
    // The lease outlasts the test: only the connection's pings can notice the pause.
    let decode_args = ["--lease-ttl-s", "120", "--drain-grace-s", "10"];
    let router = with(LONG_ROUTER, &["--stream-migration", "false"]);
    let f = start_fleet(&router, 1, WORKER, 2, &decode_args).await;
    let (data, stream, serving) = stream_in_flight(&f).await;
    f.decode[serving].proc.signal("STOP");
    ends_with_error(&f, data, stream).await;
    // Woken up, the node finds its caller gone and frees the sequence's blocks.
    f.decode[serving].proc.signal("CONT");
    decode_holds_nothing(&f.decode[serving]).await;
    prefill_holds_nothing(&f.prefill[0]).await;
}

#[tokio::test]
async fn stopped_decode_is_avoided() {
    // A lease that outlasts the test: the router must avoid the stopped node because it
    // does not answer, not because its key expired.
    let decode_args = ["--lease-ttl-s", "120", "--drain-grace-s", "10"];
    let f = start_fleet(&[], 1, WORKER, 2, &decode_args).await;
    let req = request(0, 2, 12, false);
    let expected = text_of(&f, &req).await;

    f.decode[1].proc.signal("STOP");
    f.wait_router("the stopped decode node out of rotation", SEE, |page| {
        let count = |state| workers_in(page, Role::Decode, state).unwrap_or(0.0);
        count("ready") == 1.0 && count("unhealthy") + count("open") >= 1.0
    })
    .await;
    let before = decodes_admitted(&f.decode[0]).await;
    let served = tokio::time::timeout(SEE, async {
        for _ in 0..6 {
            assert_eq!(text_of(&f, &req).await, expected);
        }
    })
    .await;
    if served.is_err() {
        panic!(
            "requests hung with a stopped decode node; logs:\n{}",
            f.logs()
        );
    }
    assert_eq!(decodes_admitted(&f.decode[0]).await, before + 6.0);

    f.decode[1].proc.signal("CONT");
    f.wait_workers(Role::Decode, "ready", 2, SEE).await;
}
