//! What one request may carry across the contracts: each limit bounds work or memory that a
//! request's *meaning* buys (per step, per sequence, per compile), so the router answers
//! 400 past it, and every node refuses past it whoever sent it.

/// The most sequences one request generates (`n`, `best_of`, a beam's width; the seeds'
/// limit): each holds a KV cache of its own and a batch slot every step. The router keeps a
/// bit for each in a `u128`.
pub const MAX_SEQUENCES: usize = 128;

/// The most alternatives reported with each token (`top_logprobs`, the seeds' limit): each
/// is an entry of every token's answer.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The most `SamplingParams.logit_bias` entries: applying them costs every step of every
/// sequence.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// The most stop token ids a request carries (the client's `stop_token_ids` and the model's
/// end tokens, without repeats): each is checked against every sequence's every token, and
/// each sequence keeps its own copy.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

/// The most options of a `guided_choice`: each becomes an alternative of the grammar.
pub const MAX_GUIDED_CHOICES: usize = 1024;

/// The most bytes of a grammar's text (a JSON schema as JSON, a regular expression, or a
/// choice list's strings together): what a compile costs grows with it.
pub const MAX_GRAMMAR_BYTES: usize = 128 << 10;

/// A grammar past its limits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarPast {
    #[error("a choice among {0} options, the limit is {MAX_GUIDED_CHOICES}")]
    Choices(usize),
    #[error("the grammar's text is {0} bytes, the limit is {MAX_GRAMMAR_BYTES}")]
    Bytes(usize),
}

/// Checks `g` against the grammar limits, before anything compiles it.
pub fn check_grammar(g: &crate::v1::Grammar) -> Result<(), GrammarPast> {
    use crate::v1::grammar::Kind;
    let bytes = match &g.kind {
        None => 0,
        Some(Kind::JsonSchema(s)) => s.schema.len(),
        Some(Kind::Regex(rx)) => rx.len(),
        Some(Kind::Choice(c)) if c.choices.len() > MAX_GUIDED_CHOICES => {
            return Err(GrammarPast::Choices(c.choices.len()))
        }
        Some(Kind::Choice(c)) => c.choices.iter().map(String::len).sum(),
    };
    if bytes > MAX_GRAMMAR_BYTES {
        return Err(GrammarPast::Bytes(bytes));
    }
    Ok(())
}
