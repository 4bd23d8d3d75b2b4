//! Property fuzzing of request parsing and validation, in process: JSON bodies mutated from
//! the documents' examples, random bytes, deep nesting, huge numbers and Unicode edge cases,
//! each checked against the validator directly and through a real router over HTTP (with no
//! workers, so an accepted request ends as a 503 right after validation).
//!
//! Properties: nothing panics or goes unanswered; every refusal is a 4xx whose error object
//! names a parameter of the body (or, for bodies that are not a JSON object, the body);
//! every accepted request's parameters lie in the documented ranges and are the values
//! sent. It runs for `TANDEM_FUZZ_SECS` (20 by default) from `TANDEM_FUZZ_SEED` (else the
//! clock), printed first so that a failure reproduces.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::{Duration, Instant};

mod bodies;

use bodies::request;
use clap::Parser;
use engine::fuzz::{settings as fuzz_settings, Rng};
use router::api::chat::ChatRequest;
use router::api::completions::CompletionRequest;
use router::api::json::{JsonBudget, JsonLimits};
use router::api::Obj;
use router::error::RouterError;
use router::params::{self, MAX_CONTENT_CHARS};
use serde_json::{json, Map, Value};

/// The model name the fuzzed router serves.
const MODEL: &str = "test";
/// The router's body limit here: small, so that 413 is reached too.
const MAX_BODY_BYTES: usize = 256 << 10;
/// Keys a refusal may name although the body lacks them: the required ones.
const REQUIRED: [&str; 3] = ["model", "messages", "prompt"];

/// What the validator alone makes of a body.
#[derive(Debug)]
enum Verdict {
    /// Not a JSON object: a 400 that names no parameter.
    NotAnObject,
    /// A 400 naming this parameter.
    Refused(String),
    /// A well-formed request for another model.
    OtherModel,
    /// Valid: what the router does next (render, tokenize, dispatch) decides the answer.
    Accepted,
}

/// Calls the validator as the handler does and checks every property of its answer.
fn validate(path: &str, bytes: &[u8], vocab: usize) -> Verdict {
    let json = JsonBudget::new(JsonLimits::for_prompts(2048));
    let o = match json.object(bytes) {
        Ok(o) => o,
        Err(e) => {
            assert!(
                matches!(
                    e,
                    RouterError::InvalidJson(_) | RouterError::BodyTooComplex(_)
                ),
                "a body that is not an object gave {e:?}"
            );
            assert!(
                e.to_string().starts_with("the request body"),
                "the refusal does not say it is about the body: {e}"
            );
            return Verdict::NotAnObject;
        }
    };
    let refused = |e: RouterError| -> Verdict {
        match e {
            RouterError::InvalidParam { param, message } => {
                assert!(
                    o.contains_key(param) || REQUIRED.contains(&param),
                    "the refusal names {param:?}, which the body does not have: {message}"
                );
                assert!(!message.is_empty(), "{param} refused with no message");
                Verdict::Refused(param.to_string())
            }
            RouterError::UnknownParam(name) => {
                let nested =
                    name.starts_with("stream_options.") && o.contains_key("stream_options");
                assert!(
                    o.contains_key(&name) || nested || name.ends_with('…'),
                    "an unknown field {name:?} the body does not have"
                );
                Verdict::Refused(name)
            }
            // JSON text inside the body (a schema, a call's arguments) past its limits.
            RouterError::BodyTooComplex(_) => Verdict::NotAnObject,
            other => panic!("a refusal that names no parameter: {other:?}"),
        }
    };
    let (chat, completion) = if path.contains("chat") {
        let r = ChatRequest::from_object(o.clone()).expect("any object is a request");
        if let Err(e) = params::known_fields(&r.extra, "") {
            return refused(e);
        }
        (Some(r), None)
    } else {
        let r = CompletionRequest::from_object(o.clone()).expect("any object is a request");
        if let Err(e) = params::known_fields(&r.extra, "") {
            return refused(e);
        }
        (None, Some(r))
    };
    let sampling = match (&chat, &completion) {
        (Some(r), _) => &r.sampling,
        (_, Some(r)) => &r.sampling,
        _ => unreachable!("one of the two"),
    };
    // The limits of the router below, which speaks the OpenAI error format: MindIE's.
    let common = match params::common(sampling, vocab, params::StopLimits::MINDIE, &json) {
        Ok(c) => c,
        Err(e) => return refused(e),
    };
    check_common(&o, &common, vocab);
    if common.model != MODEL {
        return Verdict::OtherModel;
    }
    if let Some(r) = &chat {
        match params::chat(r.clone(), &json) {
            Ok(c) => {
                let messages = c.input.messages.as_array().expect("messages are a list");
                assert!(!messages.is_empty(), "a chat with no messages accepted");
                let chars: usize = messages
                    .iter()
                    .filter_map(|m| m["content"].as_str())
                    .map(|s| s.chars().count())
                    .sum();
                assert!(chars <= MAX_CONTENT_CHARS, "{chars} characters accepted");
                assert!(c.logprobs.is_none_or(|k| k <= 20), "{:?}", c.logprobs);
            }
            Err(e) => return refused(e),
        }
    } else if let Some(r) = &completion {
        match params::completion(r, vocab) {
            Ok(c) => {
                match &c.prompt {
                    params::Prompt::Text(t) => {
                        assert!(!t.is_empty(), "an empty prompt accepted");
                        assert!(t.chars().count() <= MAX_CONTENT_CHARS);
                    }
                    params::Prompt::Tokens(ids) => {
                        assert!(!ids.is_empty(), "an empty prompt accepted");
                        assert!(ids.iter().all(|&t| (t as usize) < vocab), "{ids:?}");
                    }
                }
                assert!(c.logprobs.is_none_or(|k| k <= 5), "{:?}", c.logprobs);
            }
            Err(e) => return refused(e),
        }
    }
    Verdict::Accepted
}

/// The documented ranges (README, "Request parameters"), and the values sent kept as sent.
fn check_common(o: &Obj, c: &params::Common, vocab: usize) {
    let s = &c.sampling;
    let sent = |key: &str| o.get(key).filter(|v| !v.is_null());
    assert!(
        (0.0..=2.0).contains(&s.temperature),
        "temperature {}",
        s.temperature
    );
    assert!(s.top_p > 1e-6 && s.top_p <= 1.0, "top_p {}", s.top_p);
    assert!(s.top_k as usize <= vocab, "top_k {}", s.top_k);
    for (name, x) in [
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
    ] {
        assert!((-2.0..=2.0).contains(&x), "{name} {x}");
    }
    assert!(
        s.repetition_penalty > 0.0 && s.repetition_penalty <= 2.0,
        "repetition_penalty {}",
        s.repetition_penalty
    );
    if let Some(t) = sent("temperature").and_then(Value::as_f64) {
        assert_eq!(s.temperature, t as f32, "temperature changed");
    }
    if let Some(seed) = sent("seed") {
        assert_eq!(Some(s.seed), seed.as_u64(), "seed changed");
    }
    if let Some(m) = c.max_tokens {
        assert!((1..=2147483647).contains(&m), "max_tokens {m}");
        assert_eq!(sent("max_tokens").and_then(Value::as_u64), Some(m));
    }
    assert!((1..=128).contains(&c.n), "n {}", c.n);
    assert!((1..=128).contains(&c.best_of), "best_of {}", c.best_of);
    if c.beam {
        assert!(c.best_of >= c.n, "a beam narrower than n");
        assert!(
            c.stop.is_empty() && c.stop_token_ids.is_empty(),
            "stops with beams"
        );
        if c.n > 1 {
            assert!(s.temperature > 0.0, "n > 1 at temperature 0");
        }
    } else {
        assert!(c.best_of >= c.n, "best_of {} below n {}", c.best_of, c.n);
        if c.best_of > 1 {
            assert!(s.temperature > 0.0, "several samples at temperature 0");
        }
        if c.stream {
            assert_eq!(c.best_of, c.n, "streamed with best_of != n");
        }
    }
    let chars: Vec<usize> = c.stop.iter().map(|s| s.chars().count()).collect();
    assert!(chars.iter().all(|&n| n >= 1), "{chars:?}");
    assert!(
        chars.iter().sum::<usize>() <= 32768,
        "stop strings too long"
    );
    assert!(
        c.stop_token_ids.iter().all(|&t| (t as usize) < vocab),
        "{:?}",
        c.stop_token_ids
    );
}

/// One HTTP/1.1 exchange on a fresh connection: the status and the body, or why none came.
fn post(addr: &str, path: &str, body: &[u8], content_type: bool) -> Result<(u16, Value), String> {
    let mut sock = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    // A hang shows as a failure, not a stuck test.
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    let ct = if content_type {
        "Content-Type: application/json\r\n"
    } else {
        ""
    };
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\n{ct}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes())
        .and_then(|()| sock.write_all(body))
        .map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    sock.read_to_end(&mut raw)
        .map_err(|e| format!("read: {e} after {} bytes", raw.len()))?;
    let text = String::from_utf8_lossy(&raw);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|s| s.get(..3))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line in {text:?}"))?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let json = serde_json::from_str(body).map_err(|e| format!("{status}: body {body:?}: {e}"))?;
    Ok((status, json))
}

/// Checks the router's answer against the validator's verdict.
fn check_answer(verdict: &Verdict, body_len: usize, status: u16, v: &Value) {
    let param = v["error"]["param"].as_str();
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        !message.is_empty(),
        "{status} without an error message: {v}"
    );
    if body_len > MAX_BODY_BYTES {
        assert_eq!(status, 413, "a body of {body_len} bytes: {v}");
        return;
    }
    match verdict {
        Verdict::NotAnObject => {
            // 413 for JSON past the body's limits on values and nesting.
            assert!(status == 400 || status == 413, "{v}");
            assert_eq!(param, None, "{v}");
            assert!(message.starts_with("the request body"), "{v}");
        }
        Verdict::Refused(p) => {
            assert_eq!(status, 400, "{v}");
            assert_eq!(param, Some(p.as_str()), "{v}");
        }
        Verdict::OtherModel => {
            assert_eq!(status, 404, "{v}");
            assert_eq!(param, Some("model"), "{v}");
        }
        Verdict::Accepted => match status {
            // Past validation: no worker to take it (the decode node is picked first).
            503 => assert!(message.contains("no decode worker is ready"), "{v}"),
            // The template, the tokenizer or the prompt's length refused it, or its grammar
            // did not compile (or a forced tool call met another grammar).
            400 => assert!(
                matches!(
                    param,
                    Some(
                        "messages"
                            | "prompt"
                            | "tools"
                            | "tool_choice"
                            | "response_format"
                            | "guided_json"
                            | "guided_regex"
                            | "guided_choice"
                    )
                ),
                "{v}"
            ),
            _ => panic!("an accepted request answered {status}: {v}"),
        },
    }
}

fn seed_bodies() -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/seed_requests.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let all: Vec<Value> = serde_json::from_str(&text).expect("the fixture is JSON");
    all.into_iter().map(|r| r["body"].clone()).collect()
}

#[test]
fn fuzzed_requests_are_answered_and_refusals_name_their_parameter() {
    let (seed, budget) = fuzz_settings(20);
    eprintln!("request fuzz: TANDEM_FUZZ_SEED={seed:#x} for {budget:?} (TANDEM_FUZZ_SECS)");
    let model = e2e::tiny_model();
    let vocab = text::load(&model)
        .expect("the tiny model's text side")
        .config
        .vocab_size;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("binding a port");
    let addr = listener.local_addr().expect("its address").to_string();
    let limit = MAX_BODY_BYTES.to_string();
    let cfg = router::Config::try_parse_from([
        "tandem-router",
        "--model",
        model.to_str().expect("a UTF-8 path"),
        "--model-name",
        MODEL,
        "--max-body-bytes",
        &limit,
    ])
    .expect("the router's flags");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let ops = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("binding a port");
    let listeners = router::Listeners { api: listener, ops };
    let server = rt.spawn(router::serve(listeners, cfg, async {
        let _ = stopped.await;
    }));

    let seeds = seed_bodies();
    let mut rng = Rng(seed);
    let started = Instant::now();
    let mut tally = std::collections::BTreeMap::<String, usize>::new();
    let mut cases = 0usize;
    while cases < 200 || started.elapsed() < budget {
        let mut case_rng = Rng(rng.next_u64() | 1);
        let (path, bytes) = request(&mut case_rng, &seeds);
        let shown = || {
            let text = String::from_utf8_lossy(&bytes);
            let cut: String = text.chars().take(2000).collect();
            format!(
                "case {cases} (TANDEM_FUZZ_SEED={seed:#x}), {path}, {} bytes: {cut}",
                bytes.len()
            )
        };
        let verdict = catch_unwind(AssertUnwindSafe(|| validate(path, &bytes, vocab)))
            .unwrap_or_else(|_| panic!("the validator failed (above) on {}", shown()));
        let content_type = !case_rng.chance(10);
        let (status, answer) = post(&addr, path, &bytes, content_type).unwrap_or_else(|e| {
            let server_state = if server.is_finished() {
                "the router has stopped"
            } else {
                "the router runs"
            };
            panic!("no answer ({e}; {server_state}) to {}", shown())
        });
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| {
            check_answer(&verdict, bytes.len(), status, &answer)
        })) {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{why}\nverdict {verdict:?} for {}", shown());
        }
        let kind = match &verdict {
            _ if status == 413 => "too large 413".to_string(),
            Verdict::Refused(p) => format!("refused {p}"),
            other => format!("{other:?} {status}"),
        };
        *tally.entry(kind).or_default() += 1;
        cases += 1;
    }
    // Content past the 4 MB limit is too big for the body limit above: the validator alone.
    let mut o = Map::new();
    o.insert("model".into(), json!(MODEL));
    o.insert(
        "messages".into(),
        json!([{"role": "user", "content": "x".repeat(MAX_CONTENT_CHARS + 1)}]),
    );
    let big = serde_json::to_vec(&o).expect("serializes");
    assert!(matches!(
        validate("/v1/chat/completions", &big, vocab),
        Verdict::Refused(p) if p == "messages"
    ));

    let _ = stop.send(());
    let done = rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), server).await });
    assert!(
        matches!(done, Ok(Ok(Ok(())))),
        "the router did not stop cleanly: {done:?}"
    );
    let _ = std::fs::remove_dir_all(&model);
    eprintln!("{cases} requests in {:?}: {tally:#?}", started.elapsed());
    // The run must reach every side of validation, or it proves little.
    let count = |prefix: &str| {
        tally
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, n)| n)
            .sum::<usize>()
    };
    for (side, at_least) in [
        ("Accepted 503", cases / 50),
        ("refused", cases / 5),
        ("NotAnObject", cases / 50),
        ("OtherModel", cases / 200),
        ("too large", cases / 500),
    ] {
        assert!(count(side) >= at_least.max(1), "too few {side}: {tally:#?}");
    }
}

/// Found by the fuzzer: values in range as f64 but 0 as the f32 the engine samples with.
#[test]
fn numbers_that_vanish_in_f32_are_checked_as_the_engine_sees_them() {
    let body = |extra: Value| {
        let mut o = Map::new();
        o.insert("model".into(), json!(MODEL));
        o.extend(extra.as_object().expect("an object").clone());
        o
    };
    let common = |o: Obj| {
        let r = CompletionRequest::from_object(o).expect("any object is a request");
        let json = JsonBudget::new(JsonLimits::for_prompts(2048));
        params::common(&r.sampling, 1000, params::StopLimits::MINDIE, &json)
    };
    let refused = |extra: Value| match common(body(extra.clone())) {
        Err(RouterError::InvalidParam { param, .. }) => param,
        other => panic!("{extra} accepted: {other:?}"),
    };
    assert_eq!(
        refused(json!({"repetition_penalty": f64::MIN_POSITIVE})),
        "repetition_penalty"
    );
    assert_eq!(refused(json!({"temperature": 5e-324, "n": 2})), "n");
    let greedy = common(body(json!({"temperature": 5e-324})))
        .expect("a temperature that is 0 in f32 is a valid 0");
    assert_eq!(greedy.sampling.temperature, 0.0);
}
