//! Robustness: bodies mutated from the documents' example requests (wrong types, values far
//! out of range, keys dropped, broken JSON, stray bytes) sent to both endpoints. Every one
//! is answered: 200 with a well-formed body, or a 4xx with an error object; never a 5xx, a
//! hang (the request timeout would turn one into a 504) or a dead router.

use std::time::Duration;

use e2e::{seed_requests, tiny_model, Cluster, Mode};
use engine::fuzz::Rng;
use serde_json::{json, Map, Value};

const KEYS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "ignore_eos",
    "best_of",
    "n",
    "logprobs",
    "top_logprobs",
    "use_beam_search",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
];

/// A value of a random type, from the edges of each.
fn value(rng: &mut Rng, depth: usize) -> Value {
    let kind = rng.below(if depth > 2 { 4 } else { 7 });
    match kind {
        0 => Value::Null,
        1 => json!(rng.below(2) == 1),
        2 => rng
            .pick(&[
                json!(0),
                json!(1),
                json!(-1),
                json!(2),
                json!(128),
                json!(129),
                json!(2147483647),
                json!(2147483648u64),
                json!(i64::MIN),
                json!(u64::MAX),
                json!(0.5),
                json!(-0.000001),
                json!(1e308),
                json!(-1e308),
                json!(1e-300),
            ])
            .clone(),
        3 => rng
            .pick(&[
                json!(""),
                json!("x"),
                json!("none"),
                json!("auto"),
                json!("required"),
                json!("function"),
                json!("user"),
                json!("\u{0}"),
                json!("你好🌍"),
                json!("<tool_call>"),
                json!("a".repeat(5000)),
            ])
            .clone(),
        4 | 5 => {
            let len = rng.below(4);
            Value::Array((0..len).map(|_| value(rng, depth + 1)).collect())
        }
        _ => {
            let mut m = Map::new();
            for _ in 0..rng.below(4) {
                let key = *rng.pick(&[
                    "role",
                    "content",
                    "type",
                    "function",
                    "name",
                    "text",
                    "tool_calls",
                    "tool_call_id",
                    "arguments",
                    "enable_thinking",
                ]);
                m.insert(key.into(), value(rng, depth + 1));
            }
            Value::Object(m)
        }
    }
}

/// One mutation of `body`.
fn mutate(rng: &mut Rng, body: &mut Value) {
    let o = body.as_object_mut().expect("a request is an object");
    match rng.below(5) {
        0 => {
            o.insert((*rng.pick(KEYS)).into(), value(rng, 0));
        }
        1 => {
            let key = *rng.pick(KEYS);
            o.remove(key);
        }
        2 => {
            // Inside a message: a field replaced, or a message replaced.
            if let Some(Value::Array(ms)) = o.get_mut("messages") {
                if !ms.is_empty() {
                    let i = rng.below(ms.len());
                    if rng.below(2) == 0 {
                        ms[i] = value(rng, 1);
                    } else if let Value::Object(m) = &mut ms[i] {
                        let key = *rng.pick(&["role", "content", "tool_calls", "tool_call_id"]);
                        m.insert(key.into(), value(rng, 1));
                    }
                }
            }
        }
        3 => {
            // An unknown field (a 400 naming it) or one on the harmless list (ignored).
            let key = if rng.below(2) == 0 {
                format!("unknown_{}", rng.below(100))
            } else {
                (*rng.pick(&["metadata", "store", "service_tier", "safety_identifier"])).into()
            };
            o.insert(key, value(rng, 0));
        }
        _ => {
            // A stream-sized request sent whole, or a big n with beams.
            o.insert("stream".into(), json!(rng.below(2) == 1));
            o.insert("n".into(), json!(1 + rng.below(4)));
        }
    }
}

/// The body's bytes, sometimes broken: cut short, a byte flipped, or not UTF-8.
fn bytes(rng: &mut Rng, body: &Value) -> Vec<u8> {
    let mut b = serde_json::to_vec(body).unwrap();
    match rng.below(12) {
        0 => b.truncate(rng.below(b.len())),
        1 => {
            let i = rng.below(b.len());
            b[i] ^= 1 << rng.below(8);
        }
        2 => b.insert(rng.below(b.len()), 0xff),
        _ => {}
    }
    b
}

#[tokio::test]
async fn mutated_and_malformed_bodies_never_get_a_5xx() {
    // Few tokens per request keep the valid ones quick; a hang past 20 s shows as a 504.
    let c = Cluster::start(
        Mode::Pd,
        &tiny_model(),
        &["--max-iter-times", "4", "--request-timeout-ms", "20000"],
    )
    .await;
    let seeds: Vec<Value> = seed_requests()
        .into_iter()
        .map(|(_, mut b)| {
            b["model"] = json!(c.model_name);
            b
        })
        .collect();
    let client = reqwest::Client::new();
    let mut rng = Rng(0x7A4D_E11A_5EED_0001);
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for case in 0..400 {
        let mut body = rng.pick(&seeds).clone();
        for _ in 0..1 + rng.below(3) {
            mutate(&mut rng, &mut body);
        }
        let raw = bytes(&mut rng, &body);
        let path = if rng.below(4) == 0 {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let resp = client
            .post(format!("{}{path}", c.url))
            .header("content-type", "application/json")
            .body(raw.clone())
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "case {case}: no answer ({e}) to {}",
                    String::from_utf8_lossy(&raw)
                )
            });
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("the whole body arrives");
        *statuses.entry(status).or_default() += 1;
        let shown = String::from_utf8_lossy(&raw);
        assert!(
            status < 500,
            "case {case}: {status} for {path} {shown}\n{text}\n{}",
            c.logs()
        );
        if status == 200 {
            let ok = text.starts_with("data: ") && text.trim_end().ends_with("data: [DONE]")
                || serde_json::from_str::<Value>(&text).is_ok_and(|v| v["choices"].is_array());
            assert!(
                ok,
                "case {case}: a 200 that is neither SSE nor a completion: {text}"
            );
        } else {
            let v: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("case {case}: {status} body is not JSON ({e}): {text}"));
            assert!(v["error"]["message"].is_string(), "case {case}: {text}");
        }
    }
    eprintln!("statuses: {statuses:?}");
    // The mutations must reach both sides of validation, or the test proves little.
    assert!(statuses.get(&200).is_some_and(|&n| n >= 40), "{statuses:?}");
    assert!(
        statuses.get(&400).is_some_and(|&n| n >= 100),
        "{statuses:?}"
    );
    let (status, _) = c
        .post(
            "/v1/completions",
            &json!({"model": c.model_name, "prompt": "still here"}),
        )
        .await;
    assert_eq!(status, 200, "the router still serves after the fuzzing");
}
