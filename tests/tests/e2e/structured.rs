//! Structured outputs on the bundled SmolLM2 through PD: `response_format` json_schema,
//! `guided_regex` and `guided_choice`. At temperature 1 a 135M model left alone writes
//! valid JSON rarely; every one of 50 seeded runs per grammar must be valid here, so the
//! masks alone carry it. Colocated gives the same tokens as PD for the same seed.

use std::sync::Arc;

use e2e::{person_schema, scrape, smollm2, Cluster, Mode};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::task::JoinSet;

const RUNS: u64 = 50;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Person {
    name: String,
    age: i64,
    role: Role,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Role {
    Admin,
    User,
    Guest,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Todo {
    items: Vec<Item>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Item {
    id: i64,
    done: bool,
}

fn todo_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "items": {
                "type": "array", "minItems": 1, "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "done": {"type": "boolean"}
                    },
                    "required": ["id", "done"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["items"],
        "additionalProperties": false
    })
}

fn chat_body(content: &str, schema: Value, seed: u64) -> Value {
    json!({
        "model": "test",
        "messages": [{"role": "user", "content": content}],
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 160,
        "response_format": {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": true}}
    })
}

fn completion_body(extra: Value, seed: u64) -> Value {
    let mut body = json!({
        "model": "test",
        "prompt": "My favourite thing is",
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 40
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// The output text and finish reason of a response of either endpoint.
fn output(v: &Value) -> (String, String) {
    let c = &v["choices"][0];
    let text = c["message"]["content"]
        .as_str()
        .or(c["text"].as_str())
        .unwrap_or_else(|| panic!("no text in {v}"));
    (
        text.to_string(),
        c["finish_reason"].as_str().unwrap().into(),
    )
}

/// Every body of `bodies` through `c` at once; the outputs in order.
async fn run_all(
    c: &Arc<Cluster>,
    path: &'static str,
    bodies: Vec<Value>,
) -> Vec<(String, String)> {
    let mut set = JoinSet::new();
    for (i, body) in bodies.into_iter().enumerate() {
        let c = Arc::clone(c);
        set.spawn(async move {
            let (status, v) = c.post(path, &body).await;
            assert_eq!(status, 200, "{v}");
            (i, output(&v))
        });
    }
    let mut out = set.join_all().await;
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, o)| o).collect()
}

#[tokio::test]
async fn fifty_seeded_runs_per_grammar_all_match_it() {
    let c = Arc::new(Cluster::start(Mode::Pd, &smollm2(), &[]).await);

    let people: Vec<Value> = (0..RUNS)
        .map(|s| chat_body("Describe a person.", person_schema(), s))
        .collect();
    let mut names = std::collections::HashSet::new();
    for (text, finish) in run_all(&c, "/v1/chat/completions", people).await {
        assert_eq!(finish, "stop", "{text}");
        let p: Person = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!((1..=20).contains(&p.name.chars().count()), "{text}");
        assert!((0..=120).contains(&p.age), "{text}");
        let _ = p.role;
        names.insert(p.name);
    }
    assert!(
        names.len() > 5,
        "seeded runs at temperature 1 differ: {names:?}"
    );

    let todos: Vec<Value> = (0..RUNS)
        .map(|s| chat_body("List my tasks.", todo_schema(), s))
        .collect();
    for (text, finish) in run_all(&c, "/v1/chat/completions", todos).await {
        assert_eq!(finish, "stop", "{text}");
        let t: Todo = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!((1..=3).contains(&t.items.len()), "{text}");
        for item in &t.items {
            assert!((1..=999).contains(&item.id), "{text}");
            let _ = item.done;
        }
    }

    let rx = "[A-Z][a-z]{2,8} [0-9]{1,3}";
    let regexes: Vec<Value> = (0..RUNS)
        .map(|s| completion_body(json!({"guided_regex": rx}), s))
        .collect();
    for (text, finish) in run_all(&c, "/v1/completions", regexes).await {
        assert_eq!(finish, "stop", "{text}");
        let (word, number) = text.split_once(' ').unwrap_or_else(|| panic!("{text:?}"));
        let mut chars = word.chars();
        assert!(
            chars.next().is_some_and(|c| c.is_ascii_uppercase()),
            "{text:?}"
        );
        assert!((2..=8).contains(&chars.clone().count()), "{text:?}");
        assert!(chars.all(|c| c.is_ascii_lowercase()), "{text:?}");
        assert!((1..=3).contains(&number.len()), "{text:?}");
        assert!(number.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
    }

    let colours = ["red", "green", "blue", "dark purple"];
    let choices: Vec<Value> = (0..RUNS)
        .map(|s| completion_body(json!({"guided_choice": colours}), s))
        .collect();
    let mut seen = std::collections::HashSet::new();
    for (text, finish) in run_all(&c, "/v1/completions", choices).await {
        assert_eq!(finish, "stop", "{text}");
        assert!(colours.contains(&text.as_str()), "{text:?}");
        seen.insert(text);
    }
    assert!(seen.len() > 1, "{seen:?}");
}

/// The same seeded grammar requests through PD and colocated, streamed and not: the same
/// text everywhere (the prefill node masks the first token, the decode node the rest).
#[tokio::test]
async fn pd_and_colocated_give_the_same_constrained_tokens() {
    let model = smollm2();
    let pd = Cluster::start(Mode::Pd, &model, &[]).await;
    let colo = Cluster::start(Mode::Colocated, &model, &[]).await;
    let bodies = [
        chat_body("Describe a person.", person_schema(), 11),
        chat_body("List my tasks.", todo_schema(), 12),
        completion_body(json!({"guided_regex": "[a-z]+( [a-z]+){2}"}), 13),
        completion_body(
            json!({"response_format": {"type": "json_object"},
            "max_tokens": 60}),
            14,
        ),
    ];
    for body in bodies {
        let path = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (s1, a) = pd.post(path, &body).await;
        let (s2, b) = colo.post(path, &body).await;
        assert_eq!((s1, s2), (200, 200), "{a}\n{b}");
        assert_eq!(output(&a), output(&b), "{body}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (s3, data) = pd.post_sse(path, &streamed).await;
        assert_eq!(s3, 200);
        let chunks = e2e::sse_chunks(&data);
        let text: String = chunks
            .iter()
            .filter_map(|c| {
                let choice = &c["choices"][0];
                choice["delta"]["content"]
                    .as_str()
                    .or(choice["text"].as_str())
            })
            .collect();
        assert_eq!(text, output(&a).0, "{body}");
    }
}

/// A grammar that cannot be used is a 400 in OpenAI's shape, naming the parameter and
/// what is wrong; nothing reaches a worker.
#[tokio::test]
async fn a_bad_grammar_is_a_400_naming_the_parameter() {
    let c = Cluster::start(Mode::Pd, &smollm2(), &[]).await;
    for (extra, param, says) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "strict": true, "schema": {"type": "array", "uniqueItems": true}}}}),
            "response_format",
            "uniqueItems",
        ),
        (
            json!({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}),
            "guided_json",
            "nope",
        ),
        (
            json!({"guided_regex": "(a"}),
            "guided_regex",
            "guided_regex",
        ),
        (json!({"guided_choice": []}), "guided_choice", "non-empty"),
    ] {
        let (status, v) = c
            .post("/v1/completions", &completion_body(extra.clone(), 1))
            .await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{extra}: {message}");
    }
    let served = |page: String| -> f64 {
        page.lines()
            .filter(|l| l.starts_with("prefill_requests_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let prefill = c.prefill.as_deref().unwrap();
    assert_eq!(served(e2e::scrape(prefill).await), 0.0);
    let (status, v) = c
        .post(
            "/v1/completions",
            &completion_body(json!({"guided_regex": "(a|b)+"}), 1),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(served(e2e::scrape(prefill).await), 1.0);
}

/// A grammar that costs far more per token than its share of a step (a 64 KiB `const`
/// masks in about 25 ms, where its share beside one plain request is a few percent of a
/// step) is put off to later steps while a plain request shares the node, and gives the
/// same tokens as alone: sampling does not depend on when. The plain request is long
/// enough to share the node with the whole grammar request on any machine. Its own time is
/// a benchmark's to judge (`grammar-neighbours`); here, that the costly grammar was
/// deferred and nothing changed.
#[tokio::test]
async fn a_costly_grammar_is_put_off_without_changing_its_tokens() {
    let c = Arc::new(Cluster::start(Mode::Pd, &smollm2(), &[]).await);
    let costly = completion_body(
        json!({"guided_json": {"const": "x".repeat(64 << 10)}, "max_tokens": 24}),
        21,
    );
    let plain = completion_body(json!({"max_tokens": 256, "ignore_eos": true}), 22);
    let alone = run_all(&c, "/v1/completions", vec![costly.clone()]).await;
    let before = e2e::metric(
        &scrape(&c.decode).await,
        "decode_grammar_deferred_total",
        "",
    );
    assert_eq!(
        before,
        Some(0.0),
        "alone on the node, a grammar never waits"
    );
    let mixed = run_all(&c, "/v1/completions", vec![costly, plain]).await;
    assert_eq!(mixed[0], alone[0]);
    assert_eq!(mixed[1].1, "length");
    let after = e2e::metric(
        &scrape(&c.decode).await,
        "decode_grammar_deferred_total",
        "",
    );
    assert!(after > Some(0.0), "{after:?}");
}
