//! Unit tests of the parameters OpenAI's current SDKs and vLLM's clients send beyond the
//! seeds': max_completion_tokens, stream_options, user, min_tokens, min_p and logit_bias.

use serde_json::{json, Value};

use super::*;

/// [`super::common`] on `{"model": "m"}` with `extra`, for a vocabulary of 1000.
fn check(extra: Value) -> Result<Common, RouterError> {
    let mut o = json!({"model": "m"}).as_object().unwrap().clone();
    o.extend(extra.as_object().unwrap().clone());
    super::common(
        &crate::api::from_object(o)?,
        1000,
        StopLimits::MINDIE,
        &crate::api::json::JsonBudget::new(crate::api::json::JsonLimits::for_prompts(0)),
    )
}

/// Each body is refused, naming `param` with the message `says`.
fn refused(cases: &[(Value, &str, &str)]) {
    for (extra, param, says) in cases {
        match check(extra.clone()) {
            Err(RouterError::InvalidParam { param: p, message }) => {
                assert_eq!((p, message.as_str()), (*param, *says), "{extra}")
            }
            other => panic!("{extra}: {other:?}"),
        }
    }
}

#[test]
fn max_completion_tokens_is_max_tokens_by_its_current_name() {
    let sent = |extra: Value| check(extra).unwrap().max_tokens;
    assert_eq!(sent(json!({"max_completion_tokens": 7})), Some(7));
    assert_eq!(
        sent(json!({"max_tokens": 7, "max_completion_tokens": 7})),
        Some(7)
    );
    assert_eq!(
        sent(json!({"max_tokens": 7, "max_completion_tokens": null})),
        Some(7)
    );
    for (extra, param) in [
        (
            json!({"max_tokens": 7, "max_completion_tokens": 8}),
            "max_completion_tokens",
        ),
        (json!({"max_completion_tokens": 0}), "max_completion_tokens"),
        (
            json!({"max_completion_tokens": "8"}),
            "max_completion_tokens",
        ),
    ] {
        match check(extra.clone()) {
            Err(RouterError::InvalidParam { param: p, .. }) => assert_eq!(p, param, "{extra}"),
            other => panic!("{extra}: {other:?}"),
        }
    }
}

#[test]
fn stream_options_go_with_a_stream_and_user_is_a_string() {
    let usage = |extra: Value| check(extra).unwrap().include_usage;
    assert!(usage(
        json!({"stream": true, "stream_options": {"include_usage": true}})
    ));
    assert!(!usage(json!({"stream": true, "stream_options": {}})));
    assert!(!usage(json!({"stream": true})));
    assert!(!usage(json!({"user": "someone@example.com"})));
    refused(&[
        (
            json!({"stream_options": {"include_usage": true}}),
            "stream_options",
            "stream_options is only allowed when stream is true",
        ),
        (
            json!({"stream": true, "stream_options": {"include_usage": 1}}),
            "stream_options",
            "stream_options.include_usage must be a boolean",
        ),
        (
            json!({"stream": true, "stream_options": true}),
            "stream_options",
            "stream_options must be an object",
        ),
        (json!({"user": 42}), "user", "user must be a string"),
    ]);
}

#[test]
fn min_tokens_min_p_and_logit_bias_reach_the_sampling_settings() {
    let c = check(json!({"min_tokens": 3, "max_tokens": 3, "min_p": 0.05,
        "logit_bias": {"7": 1.5, "0": -100, "999": 100}}))
    .unwrap();
    assert_eq!(c.min_tokens, 3);
    assert_eq!(c.sampling.min_tokens, 3);
    assert_eq!(c.sampling.min_p, 0.05);
    let biases: Vec<(u32, f32)> = c
        .sampling
        .logit_bias
        .iter()
        .map(|b| (b.token, b.bias))
        .collect();
    assert_eq!(biases, [(0, -100.0), (7, 1.5), (999, 100.0)]);
    let plain = check(json!({"min_tokens": null, "min_p": null, "logit_bias": null})).unwrap();
    assert_eq!(
        (
            plain.min_tokens,
            plain.sampling.min_p,
            plain.sampling.logit_bias.len()
        ),
        (0, 0.0, 0)
    );
    assert_eq!(check(json!({"min_tokens": 9})).unwrap().min_tokens, 9);
}

#[test]
fn min_tokens_min_p_and_logit_bias_are_refused_when_wrong() {
    let many: serde_json::Map<String, Value> = (0..=MAX_LOGIT_BIAS)
        .map(|i| (i.to_string(), json!(1)))
        .collect();
    refused(&[
        (
            json!({"min_tokens": -1}),
            "min_tokens",
            "min_tokens must be in [0, 2147483647], got -1",
        ),
        (
            json!({"min_tokens": "2"}),
            "min_tokens",
            "min_tokens must be an integer",
        ),
        (
            json!({"min_tokens": 5, "max_tokens": 4}),
            "min_tokens",
            "min_tokens (5) must be at most max_tokens (4)",
        ),
        (
            json!({"min_p": 1.5}),
            "min_p",
            "min_p must be in [0, 1], got 1.5",
        ),
        (json!({"min_p": "low"}), "min_p", "min_p must be a number"),
        (
            json!({"logit_bias": [1, 2]}),
            "logit_bias",
            "logit_bias must be an object",
        ),
        (
            json!({"logit_bias": {"hello": 1}}),
            "logit_bias",
            "logit_bias keys must be token ids below 1000, got \"hello\"",
        ),
        (
            json!({"logit_bias": {"1000": 1}}),
            "logit_bias",
            "logit_bias keys must be token ids below 1000, got \"1000\"",
        ),
        (
            json!({"logit_bias": {"5": 101}}),
            "logit_bias",
            "logit_bias values must be numbers in [-100, 100], got 101 for token 5",
        ),
        (
            json!({"logit_bias": {"5": "up"}}),
            "logit_bias",
            "logit_bias values must be numbers in [-100, 100], got \"up\" for token 5",
        ),
        (
            json!({"logit_bias": {"7": 1, "07": 2}}),
            "logit_bias",
            "logit_bias names token 7 twice",
        ),
        (
            json!({"logit_bias": many}),
            "logit_bias",
            "logit_bias has 1025 entries, the limit is 1024",
        ),
        (
            json!({"use_beam_search": true, "n": 2, "temperature": 1, "min_p": 0.1}),
            "use_beam_search",
            "use_beam_search cannot be combined with min_p, min_tokens or logit_bias",
        ),
    ]);
}

#[test]
fn unknown_fields_are_refused_by_name_unless_harmless() {
    let extra = |v: Value| v.as_object().unwrap().clone();
    assert!(known_fields(
        &extra(json!({"metadata": {"a": "b"}, "store": false, "service_tier": "auto"})),
        ""
    )
    .is_ok());
    let named = |v: Value, prefix| match known_fields(&extra(v), prefix) {
        Err(RouterError::UnknownParam(name)) => name,
        other => panic!("{other:?}"),
    };
    assert_eq!(named(json!({"echo": true}), ""), "echo");
    assert_eq!(
        named(json!({"continuous_usage_stats": true}), "stream_options."),
        "stream_options.continuous_usage_stats"
    );
    assert_eq!(
        named(json!({"store": true}), "stream_options."),
        "stream_options.store",
        "harmless only at the top"
    );
    let long = "x".repeat(10_000);
    assert_eq!(
        named(json!({ long: 1 }), ""),
        format!("{}…", "x".repeat(64)),
        "a hostile name is not echoed whole"
    );
    let e = RouterError::UnknownParam("echo".into());
    let body = serde_json::to_value(e.body()).unwrap();
    assert_eq!(body["error"]["param"], "echo");
    assert_eq!(
        body["error"]["message"],
        "Unrecognized request argument supplied: echo"
    );
    assert_eq!(e.http_status(), 400);
}
