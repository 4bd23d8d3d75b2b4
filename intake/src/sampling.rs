//! A request's sampling settings and grammar from the contract's messages, checked where
//! both nodes take them.

use proto::v1;

use proto::limits::{GrammarPast, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS};

/// Sampling settings a node refuses, whoever sent them.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("{0} logit_bias entries, the limit is {MAX_LOGIT_BIAS}")]
    TooManyBiases(usize),
    #[error("logit_bias names token {token}, outside the vocabulary of {vocab}")]
    BiasToken { token: u32, vocab: usize },
    #[error("the logit_bias of token {token} must be in [-100, 100], got {bias}")]
    BiasValue { token: u32, bias: f32 },
    #[error("logit_bias names token {0} twice")]
    BiasTwice(u32),
    #[error("{0} stop token ids, the limit is {MAX_STOP_TOKEN_IDS}")]
    TooManyStopIds(usize),
    #[error(transparent)]
    GrammarPast(#[from] GrammarPast),
    #[error("the grammar names no kind (json_schema, regex or choice)")]
    NoGrammar,
    #[error("the grammar's JSON schema is not JSON: {0}")]
    SchemaText(String),
    #[error("grammar: {0}")]
    Grammar(String),
    #[error("a grammar cannot constrain a beam search")]
    GrammarWithBeams,
    #[error("this model's vocabulary cannot be constrained by a grammar: {0}")]
    NoVocab(String),
}

/// A request's grammar from its wire form; compiled by the node that samples with it.
pub fn grammar_from_proto(g: &v1::Grammar) -> Result<engine::grammar::Grammar, SamplingError> {
    use engine::grammar::Grammar;
    use v1::grammar::Kind;
    let kind = g.kind.as_ref().ok_or(SamplingError::NoGrammar)?;
    proto::limits::check_grammar(g)?;
    Ok(match kind {
        Kind::JsonSchema(s) => Grammar::JsonSchema {
            schema: serde_json::from_str(&s.schema)
                .map_err(|e| SamplingError::SchemaText(e.to_string()))?,
            strict: s.strict,
        },
        Kind::Regex(rx) => Grammar::Regex(rx.clone()),
        Kind::Choice(c) => Grammar::Choice(c.choices.clone()),
    })
}

/// The sampling settings a node runs from the ones the router sent, with the request's stop
/// tokens (which `min_tokens` holds back), for a model of `vocab` tokens. Checked here, where
/// both nodes take them, so that no peer's message makes a step cost more or a logit NaN.
pub fn sampling_from_proto(
    p: &v1::SamplingParams,
    stop_ids: &[u32],
    vocab: usize,
) -> Result<engine::SamplingParams, SamplingError> {
    if !(0.0..=1.0).contains(&p.min_p) {
        return Err(SamplingError::MinP(p.min_p));
    }
    if stop_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(SamplingError::TooManyStopIds(stop_ids.len()));
    }
    if p.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(SamplingError::TooManyBiases(p.logit_bias.len()));
    }
    let mut logit_bias = Vec::with_capacity(p.logit_bias.len());
    for b in &p.logit_bias {
        if b.token as usize >= vocab {
            return Err(SamplingError::BiasToken {
                token: b.token,
                vocab,
            });
        }
        if !(-100.0..=100.0).contains(&b.bias) {
            return Err(SamplingError::BiasValue {
                token: b.token,
                bias: b.bias,
            });
        }
        logit_bias.push((b.token, b.bias));
    }
    logit_bias.sort_unstable_by_key(|&(t, _)| t);
    if let Some(w) = logit_bias.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(SamplingError::BiasTwice(w[0].0));
    }
    let mut held: Vec<u32> = if p.min_tokens > 0 {
        stop_ids
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect()
    } else {
        Vec::new()
    };
    held.sort_unstable();
    held.dedup();
    Ok(engine::SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: p.top_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed,
        min_p: p.min_p,
        logit_bias,
        min_tokens: p.min_tokens as usize,
        held,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_params_keep_every_field() {
        let wire = v1::SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            presence_penalty: -0.5,
            frequency_penalty: 0.25,
            seed: u64::MAX,
            min_p: 0.05,
            logit_bias: vec![
                v1::LogitBias {
                    token: 9,
                    bias: -100.0,
                },
                v1::LogitBias {
                    token: 3,
                    bias: 2.5,
                },
            ],
            min_tokens: 4,
            grammar: None,
        };
        let p = sampling_from_proto(&wire, &[2, 0, 2, 50], 10).unwrap();
        assert_eq!(
            p,
            engine::SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                repetition_penalty: 1.1,
                presence_penalty: -0.5,
                frequency_penalty: 0.25,
                seed: u64::MAX,
                min_p: 0.05,
                logit_bias: vec![(3, 2.5), (9, -100.0)],
                min_tokens: 4,
                held: vec![0, 2],
            }
        );
    }

    #[test]
    fn sampling_that_could_cost_or_break_a_step_is_refused() {
        let bias = |token, bias| v1::LogitBias { token, bias };
        let with = |f: &dyn Fn(&mut v1::SamplingParams)| {
            let mut p = v1::SamplingParams::default();
            f(&mut p);
            sampling_from_proto(&p, &[], 10)
        };
        assert!(matches!(
            with(&|p| p.min_p = f32::NAN),
            Err(SamplingError::MinP(_))
        ));
        assert_eq!(with(&|p| p.min_p = 1.5), Err(SamplingError::MinP(1.5)));
        assert_eq!(
            with(&|p| p.logit_bias = vec![bias(10, 1.0)]),
            Err(SamplingError::BiasToken {
                token: 10,
                vocab: 10
            })
        );
        assert!(matches!(
            with(&|p| p.logit_bias = vec![bias(1, f32::NAN)]),
            Err(SamplingError::BiasValue { token: 1, .. })
        ));
        assert_eq!(
            with(&|p| p.logit_bias = vec![bias(1, 1.0), bias(1, 2.0)]),
            Err(SamplingError::BiasTwice(1))
        );
        assert_eq!(
            with(&|p| p.logit_bias = vec![bias(1, 1.0); MAX_LOGIT_BIAS + 1]),
            Err(SamplingError::TooManyBiases(MAX_LOGIT_BIAS + 1))
        );
        assert!(
            with(&|p| p.min_tokens = 3).unwrap().held.is_empty(),
            "no stop tokens, nothing held"
        );
        let stops = vec![1; MAX_STOP_TOKEN_IDS + 1];
        assert_eq!(
            sampling_from_proto(&v1::SamplingParams::default(), &stops, 10),
            Err(SamplingError::TooManyStopIds(MAX_STOP_TOKEN_IDS + 1))
        );
        assert!(
            sampling_from_proto(&v1::SamplingParams::default(), &stops[1..], 10).is_ok(),
            "{MAX_STOP_TOKEN_IDS} stop ids are within the limit"
        );
    }

    #[test]
    fn grammars_past_their_limits_are_refused_before_they_compile() {
        use proto::limits::{MAX_GRAMMAR_BYTES, MAX_GUIDED_CHOICES};
        use v1::grammar::Kind;
        let choice = |n: usize, len: usize| v1::Grammar {
            kind: Some(Kind::Choice(v1::Choices {
                choices: vec!["x".repeat(len); n],
            })),
        };
        assert_eq!(
            grammar_from_proto(&choice(MAX_GUIDED_CHOICES + 1, 1)).unwrap_err(),
            SamplingError::GrammarPast(GrammarPast::Choices(MAX_GUIDED_CHOICES + 1))
        );
        assert!(grammar_from_proto(&choice(MAX_GUIDED_CHOICES, 1)).is_ok());
        assert_eq!(
            grammar_from_proto(&choice(2, MAX_GRAMMAR_BYTES / 2 + 1)).unwrap_err(),
            SamplingError::GrammarPast(GrammarPast::Bytes(MAX_GRAMMAR_BYTES + 2))
        );
        let regex = v1::Grammar {
            kind: Some(Kind::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1))),
        };
        assert_eq!(
            grammar_from_proto(&regex).unwrap_err(),
            SamplingError::GrammarPast(GrammarPast::Bytes(MAX_GRAMMAR_BYTES + 1))
        );
    }

    #[test]
    fn grammars_without_a_kind_or_valid_schema_text_are_refused() {
        use v1::grammar::Kind;
        assert_eq!(
            grammar_from_proto(&v1::Grammar { kind: None }).unwrap_err(),
            SamplingError::NoGrammar
        );
        let bad = v1::Grammar {
            kind: Some(Kind::JsonSchema(v1::JsonSchema {
                schema: "{\"type\":".into(),
                strict: false,
            })),
        };
        assert!(matches!(
            grammar_from_proto(&bad),
            Err(SamplingError::SchemaText(_))
        ));
    }
}
