//! The node's grammars against the bundled model's vocabulary (`models/`, fetched by
//! `scripts/fetch-models.sh`).

use std::path::PathBuf;

use engine::grammar::{Grammar, Vocab};
use proto::v1::grammar::Kind;

use super::*;

fn vocab() -> (Vocab, Vec<u32>) {
    let path = std::env::var_os("TANDEM_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"))
        .join("smollm2-135m-instruct-q4_1.gguf");
    let text = text::load(&path).expect("the bundled model (scripts/fetch-models.sh)");
    let eos = text.config.eos_token_ids.clone();
    (Vocab::new(&text.tokenizer, &eos).expect("vocabulary"), eos)
}

fn regex(rx: &str) -> Option<v1::Grammar> {
    Some(v1::Grammar {
        kind: Some(Kind::Regex(rx.into())),
    })
}

#[tokio::test]
async fn a_grammar_is_compiled_once_for_every_request_that_sends_it() {
    let (vocab, eos) = vocab();
    let grammars = Grammars::new(Ok(vocab.clone()), 8, GRAMMAR_CACHE_BYTES);
    let mut kept = Vec::new();
    for stops in [&eos[..], &[], &eos[..]] {
        let c = grammars.constraint(regex("[0-9]{2,4}"), stops, false).await;
        kept.push(c.unwrap().expect("a constraint"));
    }
    let stats = grammars.stats();
    assert_eq!((stats.compiles, stats.hits, stats.entries), (1, 2, 1));
    // Each starts where a fresh compile does, with its own request's stops.
    for (c, stops) in kept.iter_mut().zip([&eos[..], &[], &eos[..]]) {
        let mut fresh = vocab
            .compile(&Grammar::Regex("[0-9]{2,4}".into()), stops)
            .unwrap();
        let (kept, fresh) = (c.mask().unwrap(), fresh.mask().unwrap());
        for t in 0..49_152 {
            assert_eq!(kept.allows(t), fresh.allows(t), "{t}");
        }
    }
}

#[tokio::test]
async fn kept_grammars_stay_within_their_entries_and_bytes() {
    let (vocab, eos) = vocab();
    let few = Grammars::new(Ok(vocab.clone()), 2, GRAMMAR_CACHE_BYTES);
    for rx in ["a+", "b+", "c+", "a+"] {
        few.constraint(regex(rx), &eos, false).await.unwrap();
    }
    let stats = few.stats();
    assert_eq!((stats.compiles, stats.hits, stats.entries), (4, 0, 2));
    let small = Grammars::new(Ok(vocab), 8, 64);
    for _ in 0..2 {
        small.constraint(regex("a+"), &eos, false).await.unwrap();
    }
    let stats = small.stats();
    assert_eq!(
        (stats.compiles, stats.entries),
        (2, 0),
        "a grammar past the bytes is not kept"
    );
}

#[tokio::test]
async fn grammars_a_node_cannot_use_are_refused() {
    let none = Grammars::new(Err("no end token".into()), 8, GRAMMAR_CACHE_BYTES);
    assert!(none.constraint(None, &[], true).await.unwrap().is_none());
    assert_eq!(
        none.constraint(regex("a+"), &[], true).await.unwrap_err(),
        SamplingError::GrammarWithBeams
    );
    assert_eq!(
        none.constraint(regex("a+"), &[], false).await.unwrap_err(),
        SamplingError::NoVocab("no end token".into())
    );
}
