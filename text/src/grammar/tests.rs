//! Grammars against the bundled model's real vocabulary (`models/`, fetched by
//! `scripts/fetch-models.sh`): random walks through each mask must always end in text the
//! grammar accepts.

use std::path::PathBuf;
use std::sync::OnceLock;

use serde_json::{json, Value};

use super::*;

struct Model {
    tokenizer: Tokenizer,
    eos: Vec<u32>,
    vocab: Vocab,
}

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = std::env::var_os("TANDEM_MODELS")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"))
            .join("smollm2-135m-instruct-q4_1.gguf");
        let text = crate::load(&path).expect("the bundled model (scripts/fetch-models.sh)");
        let eos = text.config.eos_token_ids.clone();
        let vocab = Vocab::new(&text.tokenizer, &eos).expect("vocabulary");
        Model {
            tokenizer: text.tokenizer,
            eos,
            vocab,
        }
    })
}

/// A sequence that takes, at each step, a token drawn uniformly from the mask (seeded),
/// until an end-of-sequence token or the grammar's end: the text and whether it ended.
fn walk(grammar: &Grammar, seed: u64) -> (String, bool) {
    let m = model();
    let mut c = m.vocab.compile(grammar, &m.eos).expect("compiles");
    let mut rng = Rng(seed);
    let mut out = Vec::new();
    for _ in 0..200 {
        if c.finished() {
            break;
        }
        let mask = c.mask().expect("mask");
        let allowed: Vec<u32> = (0..m.tokenizer.vocab_size() as u32)
            .filter(|&t| mask.allows(t))
            .collect();
        assert!(!allowed.is_empty(), "a mask always allows something");
        let t = allowed[(rng.next() % allowed.len() as u64) as usize];
        if m.eos.contains(&t) {
            return (m.tokenizer.decode(&out, true).unwrap(), true);
        }
        c.advance(&[t]).expect("a token of the mask is accepted");
        out.push(t);
    }
    (m.tokenizer.decode(&out, true).unwrap(), c.finished())
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn schema(schema: Value) -> Grammar {
    Grammar::JsonSchema {
        schema,
        strict: true,
    }
}

#[test]
fn every_walk_through_a_schema_is_a_valid_document() {
    let g = schema(json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    }));
    for seed in 0..20 {
        let (text, ended) = walk(&g, seed);
        assert!(ended, "seed {seed}: {text:?} did not end");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 3, "{text}");
        assert!(o["name"].as_str().unwrap().chars().count() <= 12, "{text}");
        assert!((0..=120).contains(&o["age"].as_i64().unwrap()), "{text}");
        let tags = o["tags"].as_array().unwrap();
        assert!(tags.len() <= 3, "{text}");
        assert!(tags
            .iter()
            .all(|t| ["a", "b", "c"].contains(&t.as_str().unwrap())));
        assert!(!text.contains('\n'), "compact JSON only: {text:?}");
    }
}

#[test]
fn a_schema_cannot_choose_its_own_whitespace() {
    let g = schema(json!({
        "type": "array",
        "items": {"type": "boolean"},
        "maxItems": 4,
        "x-guidance": {"whitespace_flexible": true, "item_separator": "\n\n"}
    }));
    for seed in 0..10 {
        let (text, ended) = walk(&g, seed);
        assert!(ended, "{text:?}");
        assert!(!text.contains('\n'), "{text:?}");
        serde_json::from_str::<Vec<bool>>(&text).unwrap();
    }
}

#[test]
fn every_walk_through_a_regex_matches_it_whole() {
    let rx = "[a-z]{3}-[0-9]{2,4}";
    let full = fancy_regex::Regex::new(&format!("^(?:{rx})$")).unwrap();
    for seed in 0..20 {
        let (text, ended) = walk(&Grammar::Regex(rx.into()), seed);
        assert!(ended && full.is_match(&text).unwrap(), "{text:?}");
    }
}

#[test]
fn every_walk_through_a_choice_is_one_of_them() {
    let choices = vec![
        "yes".to_string(),
        "no".into(),
        "maybe so".into(),
        "\"quoted\"".into(),
    ];
    let mut seen = std::collections::HashSet::new();
    for seed in 0..40 {
        let (text, ended) = walk(&Grammar::Choice(choices.clone()), seed);
        assert!(ended && choices.contains(&text), "{text:?}");
        seen.insert(text);
    }
    assert!(seen.len() > 1, "the walks took only {seen:?}");
}

#[test]
fn the_end_of_sequence_is_allowed_only_where_the_grammar_may_end() {
    let m = model();
    let mut c = m
        .vocab
        .compile(
            &Grammar::Choice(vec!["yes".into(), "yes sir".into()]),
            &m.eos,
        )
        .unwrap();
    let eos = m.eos[0];
    assert!(!c.mask().unwrap().allows(eos), "nothing written yet");
    c.advance(&m.tokenizer.encode("yes").unwrap()).unwrap();
    let mask = c.mask().unwrap();
    assert!(mask.allows(eos), "\"yes\" is complete");
    assert!(!c.finished(), "\"yes sir\" may follow");
    c.advance(&m.tokenizer.encode(" sir").unwrap()).unwrap();
    let mask = c.mask().unwrap();
    let allowed: Vec<u32> = (0..m.tokenizer.vocab_size() as u32)
        .filter(|&t| mask.allows(t))
        .collect();
    assert!(allowed.iter().all(|t| m.eos.contains(t)), "{allowed:?}");
    let mut logits = vec![0.0f32; m.tokenizer.vocab_size() + 64];
    mask.apply(&mut logits);
    assert_eq!(logits[eos as usize], 0.0);
    assert!(logits[m.tokenizer.vocab_size()..]
        .iter()
        .all(|x| x.is_infinite()));
}

#[test]
fn a_token_outside_the_mask_fails_the_constraint() {
    let m = model();
    let mut c = m
        .vocab
        .compile(&Grammar::Regex("[0-9]+".into()), &m.eos)
        .unwrap();
    let letter = m.tokenizer.encode("a").unwrap();
    assert!(!c.mask().unwrap().allows(letter[0]));
    assert!(matches!(c.advance(&letter), Err(GrammarError::Failed(_))));
}

#[test]
fn bad_grammars_say_what_is_wrong() {
    let v = &model().vocab;
    let err = |g: Grammar| v.compile(&g, &[]).map(|_| ()).unwrap_err().to_string();
    assert!(err(schema(json!({"type": "wat"}))).contains("wat"));
    assert!(err(schema(json!("a string"))).contains("object or a boolean"));
    assert!(err(schema(json!({"$ref": "#/$defs/missing"}))).contains("missing"));
    assert!(!err(Grammar::Regex("(unclosed".into())).is_empty());
    assert!(err(Grammar::Choice(vec![])).contains("empty"));
}

#[test]
fn strict_schemas_refuse_keywords_that_cannot_be_enforced() {
    let v = &model().vocab;
    let unique = json!({"type": "array", "items": {"type": "integer"}, "uniqueItems": true});
    let e = v
        .compile(&schema(unique.clone()), &[])
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("uniqueItems"), "{e}");
    let lenient = Grammar::JsonSchema {
        schema: unique,
        strict: false,
    };
    assert!(v.compile(&lenient, &[]).is_ok());
}

#[test]
fn without_stop_tokens_the_end_is_offered_only_when_nothing_else_is() {
    let m = model();
    let eos = m.eos[0];
    let digits = Grammar::Regex("[0-9]{1,3}".into());
    let mut c = m.vocab.compile(&digits, &[]).unwrap();
    c.advance(&m.tokenizer.encode("7").unwrap()).unwrap();
    assert!(
        !c.mask().unwrap().allows(eos),
        "ignore_eos: more digits may follow"
    );
    let mut stops = m.vocab.compile(&digits, &m.eos).unwrap();
    stops.advance(&m.tokenizer.encode("7").unwrap()).unwrap();
    assert!(stops.mask().unwrap().allows(eos));
    let mut last = m
        .vocab
        .compile(&Grammar::Choice(vec!["ab".into(), "abc".into()]), &[])
        .unwrap();
    last.advance(&m.tokenizer.encode("ab").unwrap()).unwrap();
    assert!(
        !last.mask().unwrap().allows(eos),
        "\"abc\" may still follow"
    );
    let mut done = m
        .vocab
        .compile(&Grammar::Choice(vec!["ab".into()]), &[])
        .unwrap();
    done.advance(&m.tokenizer.encode("ab").unwrap()).unwrap();
    assert!(done.finished());
    assert!(
        done.mask().unwrap().allows(eos),
        "the end is all that is left"
    );
}

/// What a node that continues a sequence relies on (the decode node after the prefill
/// node's first token, a moved stream's next node): a state rebuilt from the tokens so far
/// in one call masks exactly as the state that took them one mask at a time.
#[test]
fn a_state_rebuilt_from_the_tokens_so_far_masks_as_the_one_that_grew() {
    let m = model();
    let g = Grammar::Regex("[a-z ]+".into());
    for seed in 0..20 {
        let mut grown = m.vocab.compile(&g, &[]).unwrap();
        let mut rng = Rng(seed);
        let mut tokens = Vec::new();
        for step in 0..60 {
            let mask = grown.mask().unwrap();
            if step % 7 == 3 {
                let mut rebuilt = m.vocab.compile(&g, &[]).unwrap();
                rebuilt.advance(&tokens).unwrap();
                let again = rebuilt.mask().unwrap();
                let differ: Vec<u32> = (0..m.tokenizer.vocab_size() as u32)
                    .filter(|&t| mask.allows(t) != again.allows(t))
                    .take(5)
                    .collect();
                assert!(differ.is_empty(), "seed {seed} step {step}: {differ:?}");
            }
            let allowed: Vec<u32> = (0..m.tokenizer.vocab_size() as u32)
                .filter(|&t| mask.allows(t))
                .collect();
            let t = allowed[(rng.next() % allowed.len() as u64) as usize];
            grown.advance(&[t]).unwrap();
            tokens.push(t);
        }
    }
}

#[test]
fn a_failed_constraint_does_not_echo_the_grammar_back() {
    let m = model();
    let long = format!("[0-9]+({})?", "x".repeat(4096));
    let mut c = m.vocab.compile(&Grammar::Regex(long), &m.eos).unwrap();
    let letter = m.tokenizer.encode("a").unwrap();
    let err = c.advance(&letter).unwrap_err().to_string();
    assert!(err.len() < 512, "{} bytes: {err:.200}", err.len());
}

#[test]
fn the_constraints_of_one_grammar_share_its_lexer() {
    let m = model();
    let compiled = m.vocab.parse(&Grammar::Regex("[a-z]{1,9}".into())).unwrap();
    let before = compiled.lexer_bytes();
    let mut c = compiled.start(&m.eos);
    for text in ["ab", "cd"] {
        c.mask().unwrap();
        c.advance(&m.tokenizer.encode(text).unwrap()).unwrap();
    }
    assert!(compiled.lexer_bytes() > before, "{before}");
    assert!(
        !compiled.start(&m.eos).mask().unwrap().allows(m.eos[0]),
        "a fresh start is unmoved by another's tokens"
    );
}

#[test]
fn a_grammar_whose_lexer_outgrows_its_bytes_fails() {
    let m = model();
    // A state of this lexer holds what is left of the literal: it grows to about 21 MiB
    // in its first tokens' masks, past a limit of 8 MiB.
    let vocab = m.vocab.clone().with_max_lexer_bytes(8 << 20);
    let compiled = vocab
        .parse(&schema(json!({"const": "x".repeat(64 << 10)})))
        .unwrap();
    let mut c = compiled.start(&m.eos);
    let failed = (0..64).find_map(|_| {
        let mask = match c.mask() {
            Ok(mask) => mask,
            Err(e) => return Some(e),
        };
        let t = (0..m.tokenizer.vocab_size() as u32)
            .find(|&t| mask.allows(t) && !m.eos.contains(&t))
            .expect("the const goes on");
        c.advance(&[t]).err()
    });
    let err = failed
        .unwrap_or_else(|| panic!("the lexer stayed at {} bytes", compiled.lexer_bytes()))
        .to_string();
    assert!(err.contains("the limit is 8 MiB"), "{err}");
    // The default leaves it be.
    let mut c = m
        .vocab
        .compile(&schema(json!({"const": "x".repeat(64 << 10)})), &m.eos)
        .unwrap();
    for _ in 0..64 {
        let mask = c.mask().unwrap();
        let t = (0..m.tokenizer.vocab_size() as u32)
            .find(|&t| mask.allows(t) && !m.eos.contains(&t))
            .unwrap();
        c.advance(&[t]).unwrap();
    }
}
