//! The validation's unit tests, on bodies as clients send them.

use serde_json::{json, Value};

use super::chat::{MEDIA_PARTS, TEMPLATE_VARIABLES};
use super::structured::REF_KEYWORDS;
use super::*;
use crate::api::chat::ChatRequest;
use crate::api::completions::CompletionRequest;
use crate::api::Obj;

/// The checks of [`super::common`], on a body.
fn common(o: &Obj, vocab_size: usize) -> Result<Common, RouterError> {
    super::common(
        &crate::api::from_object(o.clone())?,
        vocab_size,
        StopLimits::PROVIDER,
        &crate::api::json::JsonBudget::new(crate::api::json::JsonLimits::for_prompts(0)),
    )
}

/// The checks of [`super::chat`], on a body.
fn chat(o: &Obj) -> Result<Chat, RouterError> {
    super::chat(
        ChatRequest::from_object(o.clone())?,
        &crate::api::json::JsonBudget::new(crate::api::json::JsonLimits::for_prompts(0)),
    )
}

/// The checks of [`super::completion`], on a body.
fn completion(o: &Obj) -> Result<Completion, RouterError> {
    super::completion(&CompletionRequest::from_object(o.clone())?, 1000)
}

fn obj(v: Value) -> Obj {
    v.as_object().unwrap().clone()
}

#[test]
fn random_values_differ_within_and_across_threads() {
    let mine: std::collections::HashSet<u64> = (0..10_000).map(|_| random_u64()).collect();
    assert_eq!(mine.len(), 10_000, "a thread repeated a value");
    let theirs: Vec<u64> = std::thread::spawn(|| (0..100).map(|_| random_u64()).collect())
        .join()
        .unwrap();
    assert!(
        theirs.iter().all(|v| !mine.contains(v)),
        "two threads' generators overlap: seeded alike"
    );
}

fn rejected_param(v: Value) -> &'static str {
    match common(&obj(v), 1000) {
        Err(RouterError::InvalidParam { param, .. }) => param,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn ranges_are_the_seeds_ranges() {
    assert_eq!(
        rejected_param(json!({"model": "m", "temperature": 2.01})),
        "temperature"
    );
    assert_eq!(
        rejected_param(json!({"model": "m", "temperature": -0.1})),
        "temperature"
    );
    assert_eq!(rejected_param(json!({"model": "m", "top_p": 0.0})), "top_p");
    assert_eq!(rejected_param(json!({"model": "m", "top_p": 1.5})), "top_p");
    assert_eq!(rejected_param(json!({"model": "m", "top_k": -2})), "top_k");
    assert_eq!(
        rejected_param(json!({"model": "m", "repetition_penalty": 0})),
        "repetition_penalty"
    );
    assert_eq!(
        rejected_param(json!({"model": "m", "presence_penalty": 2.5})),
        "presence_penalty"
    );
    assert_eq!(
        rejected_param(json!({"model": "m", "max_tokens": 0})),
        "max_tokens"
    );
    assert_eq!(
        rejected_param(json!({"model": "m", "max_tokens": 2147483648u64})),
        "max_tokens"
    );
    assert_eq!(
        rejected_param(json!({"model": "m", "max_tokens": 1.5})),
        "max_tokens"
    );
    assert_eq!(rejected_param(json!({"model": "m", "seed": -1})), "seed");
    assert_eq!(
        rejected_param(json!({"model": "m", "stream": "yes"})),
        "stream"
    );
    assert_eq!(rejected_param(json!({"temperature": 1})), "model");
}

/// Every numeric parameter: values just inside its range pass, just outside get a 400
/// that names it.
#[test]
fn boundary_table() {
    let table: &[(&str, &[Value], &[Value])] = &[
        (
            "temperature",
            &[json!(0), json!(2.0), json!(null)],
            &[json!(-1e-9), json!(2.000001)],
        ),
        (
            "top_p",
            &[json!(1e-6 + 1e-12), json!(1)],
            &[json!(1e-6), json!(1.0000001)],
        ),
        (
            "top_k",
            &[json!(-1), json!(0), json!(1), json!(2147483647)],
            &[json!(-2), json!(2147483648u64)],
        ),
        (
            "seed",
            &[json!(0), json!(u64::MAX)],
            &[json!(-1), json!(1.5)],
        ),
        (
            "presence_penalty",
            &[json!(-2), json!(2)],
            &[json!(-2.0001), json!(2.0001)],
        ),
        (
            "frequency_penalty",
            &[json!(-2), json!(2)],
            &[json!(-2.0001), json!(2.0001)],
        ),
        (
            "repetition_penalty",
            &[json!(1e-9), json!(2)],
            &[json!(0), json!(2.0001)],
        ),
        (
            "max_tokens",
            &[json!(1), json!(2147483647)],
            &[json!(0), json!(2147483648u64)],
        ),
        (
            "stream",
            &[json!(true), json!(false)],
            &[json!(1), json!("true")],
        ),
        ("ignore_eos", &[json!(true)], &[json!("no")]),
        ("skip_special_tokens", &[json!(false)], &[json!(0)]),
        ("include_stop_str_in_output", &[json!(true)], &[json!([])]),
    ];
    for (param, inside, outside) in table {
        let with = |v: &Value| {
            let mut body = obj(json!({"model": "m"}));
            body.insert(param.to_string(), v.clone());
            body
        };
        for v in *inside {
            assert!(common(&with(v), 1000).is_ok(), "{param} = {v} must pass");
        }
        for v in *outside {
            assert_eq!(
                rejected_param(Value::Object(with(v))),
                *param,
                "{param} = {v}"
            );
        }
    }
    let chat_lp = |v: Value| {
        chat(&obj(
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": v}),
        ))
    };
    assert!(chat_lp(json!(0)).is_ok() && chat_lp(json!(20)).is_ok());
    assert!(chat_lp(json!(-1)).is_err() && chat_lp(json!(21)).is_err());
    let cmpl_lp = |v: Value| completion(&obj(json!({"prompt": "x", "logprobs": v})));
    assert!(cmpl_lp(json!(0)).is_ok() && cmpl_lp(json!(5)).is_ok());
    assert!(cmpl_lp(json!(-1)).is_err() && cmpl_lp(json!(6)).is_err());
}

#[test]
fn edges_and_nulls_are_accepted() {
    let c = common(
        &obj(
            json!({"model": "m", "temperature": 2, "top_p": 1, "top_k": 5000,
            "seed": u64::MAX, "max_tokens": 2147483647, "presence_penalty": -2,
            "repetition_penalty": 2, "n": null, "best_of": 1, "stop": [],
            "top_logprobs": null, "stop_token_ids": [2, 13, 4294967296u64, "x"]}),
        ),
        1000,
    )
    .unwrap();
    assert_eq!(
        c.sampling.top_k, 1000,
        "top_k at or above the vocabulary is the vocabulary"
    );
    assert_eq!(c.sampling.seed, u64::MAX);
    assert_eq!(c.stop_token_ids, vec![2, 13], "non-int32 ids are ignored");
    assert_eq!(c.max_tokens, Some(2147483647));
}

#[test]
fn n_best_of_and_beam_search_rules() {
    assert_eq!(
        rejected_param(json!({"model": "m", "n": 2, "temperature": 0})),
        "n"
    );
    assert_eq!(rejected_param(json!({"model": "m", "n": 129})), "n");
    assert_eq!(
        rejected_param(json!({"model": "m", "n": 3, "best_of": 2})),
        "best_of"
    );
    assert_eq!(
        rejected_param(json!({"model": "m", "stream": true, "n": 2, "best_of": 3})),
        "best_of"
    );
    assert_eq!(
        rejected_param(json!({"model": "m", "stream": true, "best_of": 2})),
        "best_of"
    );
    let ok = common(&obj(json!({"model": "m", "n": 2, "best_of": 4})), 1000).unwrap();
    assert_eq!((ok.n, ok.best_of), (2, 4));
    let ok = common(&obj(json!({"model": "m", "stream": true, "n": 3})), 1000).unwrap();
    assert_eq!((ok.n, ok.best_of), (3, 3));
    // Beam search: 002's example as written; best_of is not checked against n, and
    // the beam is as wide as the larger.
    let ok = common(
        &obj(
            json!({"model": "m", "prompt": "who are you", "temperature": 1,
            "max_tokens": 5, "use_beam_search": true, "ignore_eos": true, "n": 2,
            "best_of": 2, "stream": true, "logprobs": 2}),
        ),
        1000,
    )
    .unwrap();
    assert!(ok.beam);
    assert_eq!((ok.n, ok.best_of), (2, 2));
    let ok = common(
        &obj(json!({"model": "m", "use_beam_search": true, "n": 3, "best_of": 1, "stream": true})),
        1000,
    )
    .unwrap();
    assert_eq!((ok.n, ok.best_of), (3, 3));
    let ok = common(
        &obj(json!({"model": "m", "use_beam_search": true, "best_of": 4, "temperature": 0})),
        1000,
    )
    .unwrap();
    assert_eq!((ok.n, ok.best_of), (1, 4));
    for with in [json!({"stop": "x"}), json!({"stop_token_ids": [2]})] {
        let mut body = obj(json!({"model": "m", "use_beam_search": true}));
        body.extend(obj(with));
        assert_eq!(rejected_param(Value::Object(body)), "use_beam_search");
    }
    assert_eq!(
        rejected_param(json!({"model": "m", "use_beam_search": "yes"})),
        "use_beam_search"
    );
}

#[test]
fn stop_strings_have_the_seeds_limits() {
    let stops = |v: Value| common(&obj(json!({"model": "m", "stop": v})), 1000);
    assert_eq!(stops(json!("x")).unwrap().stop, vec!["x"]);
    assert!(
        stops(json!([])).unwrap().stop.is_empty(),
        "an empty list means null"
    );
    assert!(stops(json!(vec!["a"; 1024])).is_ok());
    assert!(stops(json!(vec!["a"; 1025])).is_err());
    assert!(stops(json!(["x".repeat(1024)])).is_ok());
    assert!(stops(json!(["x".repeat(1025)])).is_err());
    assert!(stops(json!([""])).is_err());
    assert!(
        stops(json!(vec!["x".repeat(1000); 33])).is_err(),
        "32768 characters in all"
    );
    assert!(stops(json!([1])).is_err());
    // MindIE's (001, 002): "string类型长度范围为1~32768", and a list's elements 32768 in all.
    let mindie = |v: Value| {
        super::common(
            &crate::api::from_object(obj(json!({"model": "m", "stop": v}))).unwrap(),
            1000,
            StopLimits::MINDIE,
            &crate::api::json::JsonBudget::new(crate::api::json::JsonLimits::for_prompts(0)),
        )
    };
    assert!(mindie(json!("x".repeat(32768))).is_ok());
    assert!(mindie(json!(["x".repeat(32768)])).is_ok());
    assert!(mindie(json!(vec!["a"; 2000])).is_ok());
    assert!(mindie(json!("x".repeat(32769))).is_err());
    assert!(mindie(json!(vec!["x".repeat(1000); 33])).is_err());
    assert!(mindie(json!([""])).is_err());
}

#[test]
fn top_logprobs_turns_logprobs_on() {
    let lp = |v: Value| {
        let mut o = obj(json!({"messages": [{"role": "user", "content": "hi"}]}));
        o.extend(obj(v));
        chat(&o).map(|c| c.logprobs)
    };
    assert_eq!(lp(json!({})).unwrap(), None);
    assert_eq!(lp(json!({"top_logprobs": 3})).unwrap(), Some(3));
    assert_eq!(lp(json!({"logprobs": true})).unwrap(), Some(0));
    assert_eq!(
        lp(json!({"logprobs": false, "top_logprobs": null})).unwrap(),
        None
    );
    assert!(lp(json!({"top_logprobs": 21})).is_err());
    assert!(lp(json!({"logprobs": false, "top_logprobs": 2})).is_err());
    let c = |v: Value| completion(&obj(json!({"prompt": "p", "logprobs": v}))).map(|c| c.logprobs);
    assert_eq!(c(json!(5)).unwrap(), Some(5));
    assert!(c(json!(6)).is_err());
}

#[test]
fn media_parts_and_bad_roles_are_named() {
    let bad = |m: Value| match chat(&obj(json!({"messages": m}))) {
        Err(RouterError::InvalidParam { message, .. }) => message,
        other => panic!("expected a rejection, got {other:?}"),
    };
    assert!(bad(
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": "/etc/passwd"}]}])
    )
    .contains("image_url"));
    assert!(bad(json!([{"role": "robot", "content": "hi"}])).contains("role"));
    assert!(bad(json!([{"role": "tool", "content": "42"}])).contains("tool_call_id"));
    let ok = chat(&obj(json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]})))
    .unwrap();
    assert_eq!(ok.input.messages[0]["content"], "ab");
}

/// Every field through which a request could name a file or a URL is refused with a
/// 400 naming it; the router reads and fetches nothing for a request.
#[test]
fn nothing_in_a_request_names_a_file_or_url() {
    let url = "http://169.254.169.254/latest/meta-data/";
    for kind in MEDIA_PARTS {
        let part = json!({"type": kind, *kind: {"url": url}});
        match chat(&obj(
            json!({"messages": [{"role": "user", "content": [part]}]}),
        )) {
            Err(RouterError::InvalidParam { param, message }) => {
                assert_eq!(param, "messages");
                assert!(message.contains(kind), "{kind}: {message}");
            }
            other => panic!("{kind}: expected a rejection, got {other:?}"),
        }
    }
    for (extra, param) in [
        (json!({"chat_template": "/etc/passwd"}), "chat_template"),
        (
            json!({"web_search_options": {"search_context_size": "low"}}),
            "web_search_options",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema":
                {"name": "x", "schema": {"$ref": "file:///etc/passwd"}}}}),
            "response_format",
        ),
        (json!({"response_format": "text"}), "response_format"),
    ] {
        let mut body = obj(json!({"model": "m"}));
        body.extend(obj(extra.clone()));
        assert_eq!(rejected_param(Value::Object(body)), param, "{extra}");
    }
    let text = obj(json!({"model": "m", "response_format": {"type": "text"}}));
    assert!(
        common(&text, 1000).is_ok(),
        "text is what is produced anyway"
    );

    let with_tool = |schema: Value| {
        chat(&obj(
            json!({"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}),
        ))
    };
    for r in [url, "../../etc/passwd", "defs.json#/a", "/etc/passwd"] {
        for keyword in REF_KEYWORDS {
            let schema = json!({"type": "object",
                "properties": {"a": {"items": [{keyword: r}]}}});
            match with_tool(schema) {
                Err(RouterError::InvalidParam { param, message }) => {
                    assert_eq!(param, "tools");
                    assert!(message.contains(r), "{message}");
                }
                other => panic!("{keyword} {r}: expected a rejection, got {other:?}"),
            }
        }
    }
    let local = json!({"type": "object", "$defs": {"p": {"type": "string"}},
        "properties": {"$ref": {"$ref": "#/$defs/p"}}});
    assert!(
        with_tool(local).is_ok(),
        "references inside the schema, and a property named $ref, are fine"
    );

    for var in TEMPLATE_VARIABLES {
        let body = json!({"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {var: [{"role": "user", "content":
                [{"type": "image_url", "image_url": {"url": url}}]}]}});
        match chat(&obj(body)) {
            Err(RouterError::InvalidParam { param, message }) => {
                assert_eq!(param, "chat_template_kwargs");
                assert!(message.contains(var), "{message}");
            }
            other => panic!("{var}: expected a rejection, got {other:?}"),
        }
    }
}

#[test]
fn tools_and_tool_choice_are_checked() {
    let weather = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object"}}}]);
    let ask = |extra: Value| {
        let mut o = obj(json!({"messages": [{"role": "user", "content": "hi"}]}));
        o.extend(obj(extra));
        chat(&o)
    };
    let param = |extra: Value| match ask(extra) {
        Err(RouterError::InvalidParam { param, message }) => (param, message),
        other => panic!("expected a rejection, got {other:?}"),
    };
    let ok = ask(json!({"tools": weather})).unwrap();
    assert_eq!(
        ok.tool_choice,
        ToolChoice::Auto,
        "auto is the default with tools"
    );
    assert_eq!(ok.input.tools, Some(weather.clone()));
    let none = ask(json!({"tools": weather, "tool_choice": "none"})).unwrap();
    assert_eq!(
        (none.tool_choice, none.input.tools),
        (ToolChoice::None, None)
    );
    let empty = ask(json!({"tools": [], "tool_choice": "auto"})).unwrap();
    assert_eq!(
        (empty.tool_choice, empty.input.tools),
        (ToolChoice::None, None)
    );
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    assert_eq!(
        ask(json!({"tools": weather, "tool_choice": named}))
            .unwrap()
            .tool_choice,
        ToolChoice::Named("get_weather".into())
    );
    assert_eq!(
        ask(json!({"tools": weather, "tool_choice": "required"}))
            .unwrap()
            .tool_choice,
        ToolChoice::Required
    );
    for (bad, param_name, says) in [
        (json!({"tools": {}}), "tools", "list"),
        (
            json!({"tools": [{"type": "retrieval"}]}),
            "tools",
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "function"}]}),
            "tools",
            "tools[0].function",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
            "tools",
            "name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            "tools",
            "parameters",
        ),
        (
            json!({"tool_choice": "required"}),
            "tool_choice",
            "requires tools",
        ),
        (
            json!({"tool_choice": named}),
            "tool_choice",
            "requires tools",
        ),
        (
            json!({"tools": weather, "tool_choice": "always"}),
            "tool_choice",
            "always",
        ),
        (
            json!({"tools": weather, "tool_choice": {"type": "function", "function": {"name": "other"}}}),
            "tool_choice",
            "not in tools",
        ),
        (
            json!({"chat_template_kwargs": {"enable_thinking": "yes"}}),
            "chat_template_kwargs",
            "enable_thinking",
        ),
    ] {
        let (p, m) = param(bad.clone());
        assert_eq!(p, param_name, "{bad}");
        assert!(m.contains(says), "{bad}: {m}");
    }
}

#[test]
fn assistant_tool_calls_reach_the_template_as_objects() {
    let history = |args: Value| {
        chat(&obj(json!({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]})))
    };
    let c = history(json!("{\"location\": \"Paris\"}")).unwrap();
    assert_eq!(
        c.input.messages[1]["tool_calls"][0]["function"]["arguments"],
        json!({"location": "Paris"})
    );
    assert!(history(json!({"location": "Paris"})).is_ok());
    assert!(history(json!("not json")).is_err());
    let on_user = chat(&obj(json!({"messages": [
        {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}
    ]})));
    assert!(on_user.is_err());
}

/// Every list a client sends has a cap checked before the work it buys.
#[test]
fn lists_past_their_caps_are_refused_naming_the_parameter() {
    use proto::limits::{MAX_GRAMMAR_BYTES, MAX_GUIDED_CHOICES, MAX_STOP_TOKEN_IDS};
    let ids = |n: usize| json!(vec![1; n]);
    assert_eq!(
        rejected_param(json!({"model": "m", "stop_token_ids": ids(MAX_STOP_TOKEN_IDS + 1)})),
        "stop_token_ids"
    );
    assert!(common(
        &obj(json!({"model": "m", "stop_token_ids": ids(MAX_STOP_TOKEN_IDS)})),
        1000
    )
    .is_ok());
    let user = json!({"role": "user", "content": "hi"});
    let refused = |body: Value| match chat(&obj(body)) {
        Err(RouterError::InvalidParam { param, .. }) => param,
        other => panic!("expected a rejection, got {other:?}"),
    };
    assert_eq!(
        refused(json!({"messages": vec![user.clone(); MAX_MESSAGES + 1]})),
        "messages"
    );
    assert!(chat(&obj(json!({"messages": vec![user.clone(); MAX_MESSAGES]}))).is_ok());
    let tool = json!({"type": "function", "function": {"name": "f"}});
    assert_eq!(
        refused(json!({"messages": [user.clone()], "tools": vec![tool.clone(); MAX_TOOLS + 1]})),
        "tools"
    );
    assert!(chat(&obj(
        json!({"messages": [user], "tools": vec![tool; MAX_TOOLS]})
    ))
    .is_ok());
    let wire = |extra: Value| {
        let mut o = obj(json!({"model": "m"}));
        o.extend(obj(extra));
        common(&o, 1000).unwrap().grammar.unwrap().wire()
    };
    let choices = |n: usize, len: usize| json!({"guided_choice": vec!["x".repeat(len); n]});
    assert!(wire(choices(MAX_GUIDED_CHOICES, 1)).is_ok());
    for past in [
        choices(MAX_GUIDED_CHOICES + 1, 1),
        choices(2, MAX_GRAMMAR_BYTES / 2 + 1),
        json!({"guided_regex": "a".repeat(MAX_GRAMMAR_BYTES + 1)}),
    ] {
        assert!(
            matches!(wire(past.clone()), Err(RouterError::InvalidParam { .. })),
            "{past:.80}"
        );
    }
}

/// Fields accepted and ignored are still bounded: they are parsed and held.
#[test]
fn harmless_fields_are_bounded_as_openai_bounds_them() {
    let with = |extra: Value| {
        let mut o = obj(json!({"model": "m", "prompt": "p"}));
        o.extend(obj(extra));
        let r = CompletionRequest::from_object(o).unwrap();
        known_fields(&r.extra, "")
    };
    let pairs = |n: usize| {
        let m: serde_json::Map<String, Value> =
            (0..n).map(|i| (format!("k{i}"), json!("v"))).collect();
        json!({"metadata": m})
    };
    assert!(with(pairs(MAX_METADATA_PAIRS)).is_ok());
    assert!(
        with(json!({"store": true, "service_tier": "auto", "safety_identifier": "u1"})).is_ok()
    );
    for past in [
        pairs(MAX_METADATA_PAIRS + 1),
        json!({"metadata": {"k": 1}}),
        json!({"metadata": {"k".repeat(65): "v"}}),
        json!({"metadata": {"k": "v".repeat(513)}}),
        json!({"metadata": [0, 0]}),
        json!({"store": "yes"}),
        json!({"service_tier": "x".repeat(513)}),
        json!({"prompt_cache_key": [1]}),
    ] {
        assert!(
            matches!(with(past.clone()), Err(RouterError::InvalidParam { .. })),
            "{past:.80}"
        );
    }
}
