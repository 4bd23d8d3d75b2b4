//! Structured-output parameters: which grammar each form gives, and the 400s, each naming
//! the parameter. Compiling against a real vocabulary uses the bundled model's tokenizer
//! (`models/`, fetched by `scripts/fetch-models.sh`).

use std::sync::OnceLock;

use serde_json::{json, Value};
use text::grammar::{Grammar, Vocab};

use super::*;
use crate::api::Obj;

fn common(extra: Value) -> Result<Common, RouterError> {
    let mut o: Obj = json!({"model": "m"}).as_object().unwrap().clone();
    o.extend(extra.as_object().unwrap().clone());
    super::common(
        &crate::api::from_object(o)?,
        1000,
        StopLimits::PROVIDER,
        &crate::api::json::JsonBudget::new(crate::api::json::JsonLimits::for_prompts(0)),
    )
}

fn grammar(extra: Value) -> Option<Grammar> {
    common(extra).unwrap().grammar.map(|c| c.grammar)
}

/// The parameter and message of a refusal.
fn refused(r: Result<impl std::fmt::Debug, RouterError>) -> (&'static str, String) {
    match r {
        Err(RouterError::InvalidParam { param, message }) => (param, message),
        other => panic!("expected a 400, got {other:?}"),
    }
}

fn vocab() -> &'static Result<Vocab, String> {
    static VOCAB: OnceLock<Result<Vocab, String>> = OnceLock::new();
    VOCAB.get_or_init(|| {
        let text = crate::testing::bundled();
        Vocab::new(&text.tokenizer, &text.config.eos_token_ids).map_err(|e| e.to_string())
    })
}

#[test]
fn each_form_gives_its_grammar() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    assert_eq!(
        grammar(json!({"response_format": {"type": "json_object"}})),
        Some(Grammar::JsonSchema {
            schema: json!({"type": "object"}),
            strict: true
        })
    );
    assert_eq!(
        grammar(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "thing", "schema": schema, "strict": true,
                "description": "ignored"}}})),
        Some(Grammar::JsonSchema {
            schema: schema.clone(),
            strict: true
        })
    );
    assert_eq!(
        grammar(json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "any"}}})),
        Some(Grammar::JsonSchema {
            schema: json!({}),
            strict: false
        }),
        "no schema: any JSON value, as OpenAI reads it"
    );
    let as_text = schema.to_string();
    for g in [
        json!({"guided_json": schema}),
        json!({"guided_json": as_text}),
    ] {
        assert_eq!(
            grammar(g),
            Some(Grammar::JsonSchema {
                schema: schema.clone(),
                strict: false
            })
        );
    }
    assert_eq!(
        grammar(json!({"guided_regex": "[0-9]+"})),
        Some(Grammar::Regex("[0-9]+".into()))
    );
    assert_eq!(
        grammar(json!({"guided_choice": ["a", "b"]})),
        Some(Grammar::Choice(vec!["a".into(), "b".into()]))
    );
    assert_eq!(grammar(json!({"response_format": {"type": "text"}})), None);
    assert_eq!(grammar(json!({"response_format": null})), None);
}

#[test]
fn malformed_forms_are_refused_by_name() {
    for (extra, param, says) in [
        (
            json!({"response_format": "json"}),
            "response_format",
            "object",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format",
            "xml",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format",
            "json_schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}),
            "response_format",
            "name",
        ),
        (
            json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "n", "schema": {}, "strcit": true}}}),
            "response_format",
            "strcit",
        ),
        (
            json!({"guided_json": "{not json"}),
            "guided_json",
            "not JSON",
        ),
        (json!({"guided_json": 5}), "guided_json", "got a number"),
        (json!({"guided_json": "[1]"}), "guided_json", "got an array"),
        (json!({"guided_regex": 7}), "guided_regex", "string"),
        (json!({"guided_choice": []}), "guided_choice", "non-empty"),
        (
            json!({"guided_choice": ["a", 1]}),
            "guided_choice",
            "strings",
        ),
        (
            json!({"guided_regex": "a", "guided_choice": ["a"]}),
            "guided_choice",
            "send one",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "use_beam_search": true}),
            "response_format",
            "use_beam_search",
        ),
        (
            json!({"guided_json": {"$ref": "https://example.com/s.json"}}),
            "guided_json",
            "never fetches",
        ),
    ] {
        let (p, message) = refused(common(extra.clone()));
        assert_eq!(p, param, "{extra}");
        assert!(message.contains(says), "{extra}: {message}");
    }
}

#[test]
fn a_grammar_that_does_not_compile_is_a_400_saying_why() {
    let check = |extra: Value| {
        let c = common(extra).unwrap().grammar.unwrap();
        c.checked(vocab())
    };
    let (p, m) = refused(check(json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "n", "strict": true,
            "schema": {"type": "array", "uniqueItems": true}}}})));
    assert_eq!(p, "response_format");
    assert!(m.contains("uniqueItems"), "{m}");
    let (p, m) = refused(check(json!({"guided_json": {"type": "wat"}})));
    assert_eq!(p, "guided_json");
    assert!(m.contains("wat"), "{m}");
    let (p, _) = refused(check(json!({"guided_regex": "(unclosed"})));
    assert_eq!(p, "guided_regex");
    let ok = check(json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "n", "strict": false,
            "schema": {"type": "array", "uniqueItems": true}}}}));
    assert!(ok.is_ok(), "not strict: what cannot be enforced is ignored");
    let none: Result<Vocab, String> = Err("no end-of-sequence token".into());
    let c = common(json!({"guided_regex": "a"}))
        .unwrap()
        .grammar
        .unwrap();
    let (p, m) = refused(c.checked(&none));
    assert_eq!(p, "guided_regex");
    assert!(m.contains("not supported for this model"), "{m}");
}
