//! The seeds' usage rules: completion_tokens is P's first token plus D's tokens, so a
//! request limited by maxIterTimes gets maxIterTimes + 1; an explicit smaller max_tokens is
//! never exceeded; per-token arrays have one entry per token, decode_time_arr one per step.

use e2e::{tiny_model, Cluster, Mode};
use serde_json::{json, Value};

fn counts(v: &Value) -> (u64, usize, usize, usize) {
    let u = &v["usage"];
    (
        u["completion_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("{v}")),
        u["batch_size"].as_array().unwrap().len(),
        u["queue_wait_time"].as_array().unwrap().len(),
        v["decode_time_arr"].as_array().unwrap().len(),
    )
}

async fn ask(c: &Cluster, max_tokens: Option<u64>) -> Value {
    let mut body = json!({"model": "test", "prompt": "Tandem serves models", "ignore_eos": true,
        "temperature": 0});
    if let Some(m) = max_tokens {
        body["max_tokens"] = json!(m);
    }
    let (status, v) = c.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    v
}

#[tokio::test]
async fn pd_completion_tokens_follow_max_iter_times_plus_one() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &["--max-iter-times", "6"]).await;
    // Limited by maxIterTimes: D makes 6, plus P's first.
    assert_eq!(counts(&ask(&c, None).await), (7, 7, 7, 6));
    assert_eq!(counts(&ask(&c, Some(50)).await), (7, 7, 7, 6));
    // An explicit max_tokens up to maxIterTimes is never exceeded.
    assert_eq!(counts(&ask(&c, Some(6)).await), (6, 6, 6, 5));
    assert_eq!(counts(&ask(&c, Some(3)).await), (3, 3, 3, 2));
    let one = ask(&c, Some(1)).await;
    assert_eq!(counts(&one), (1, 1, 1, 0));
    assert_eq!(one["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn colocated_completion_tokens_stop_at_max_iter_times() {
    let c = Cluster::start(Mode::Colocated, &tiny_model(), &["--maxIterTimes", "6"]).await;
    assert_eq!(counts(&ask(&c, None).await), (6, 6, 6, 5));
    assert_eq!(counts(&ask(&c, Some(4)).await), (4, 4, 4, 3));
}

#[tokio::test]
async fn max_seq_len_caps_prompt_and_output() {
    let c = Cluster::start(Mode::Pd, &tiny_model(), &["--max-seq-len", "12"]).await;
    let v = ask(&c, Some(100)).await;
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        12 - prompt
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    let long = "Tandem serves models ".repeat(10);
    let (status, err) = c
        .post("/v1/completions", &json!({"model": "test", "prompt": long}))
        .await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "prompt");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit is 11"),
        "{err}"
    );
}
