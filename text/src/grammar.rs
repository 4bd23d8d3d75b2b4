//! Structured outputs: a grammar (a JSON schema, a regular expression or a list of choices)
//! turned into the set of tokens a sequence may take next, through llguidance.
//!
//! A [`Vocab`] is built once per process from the model's tokenizer. The router compiles
//! each request's grammar with it only to refuse a bad one with a 400; the node that samples
//! a token keeps a [`Constraint`] per sequence, asks it for the [`TokenMask`] of the next
//! token and feeds it the token taken. A constraint built from the same grammar and fed the
//! same tokens gives the same masks on any node, so a prefill node can mask a sequence's
//! first token and a decode node continue it, and a moved stream resume it.

use std::sync::Arc;

use llguidance::api::{GrammarWithLexer, ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory, TokenParser};
use serde_json::Value;

use crate::Tokenizer;

/// What a sequence's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// A JSON document valid against this JSON schema. With `strict`, every keyword of the
    /// schema must be enforceable, or it is refused; without, keywords llguidance cannot
    /// enforce are ignored (OpenAI's `strict: false` promises no more).
    JsonSchema { schema: Value, strict: bool },
    /// Text the whole of which this regular expression (Rust `regex` syntax) matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

/// Why a grammar could not be used.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The grammar itself is wrong (a bad schema, regex or choice list); the message says
    /// what, in llguidance's words.
    #[error("{0}")]
    Invalid(String),
    /// A constraint failed while generating (a token outside its mask was fed to it).
    #[error("grammar constraint failed: {0}")]
    Failed(String),
}

/// What one grammar may cost, set here rather than left to llguidance's defaults, since a
/// grammar is a stranger's input. Measured on SmolLM2's vocabulary (49,152 tokens) on the
/// development machine: a 16 KiB `const` masks a token in about 6 ms, a 128-way regex in
/// under 1 ms, the schemas of the tests in under 1 ms; the first mask of a grammar costs
/// about five times its later ones.
pub const PARSER_LIMITS: ParserLimits = ParserLimits {
    // Earley items in one row: the grammar's branching at one point of the text.
    max_items_in_row: 2_000,
    // Building the lexer's regular expressions at compile time (about 50k a millisecond):
    // a compile gives up after about 20-70 ms of lexer work.
    initial_lexer_fuel: 1_000_000,
    // Lexer work for one token's mask; past it the mask fails and so does the request.
    step_lexer_fuel: 100_000,
    // Earley items created for one token's mask.
    step_max_items: 50_000,
    // Lexer states a grammar may build, lazily, over its life: 1-2 KiB each for the
    // grammars of the tests, but a state holds what is left of a long literal, so a 64 KiB
    // `const` grows its lexer by about 650 KiB a token. MAX_LEXER_BYTES is the bound.
    max_lexer_states: 20_000,
    // Symbols in the grammar's productions; a grammar's text is at most
    // `proto::limits::MAX_GRAMMAR_BYTES` (128 KiB) before it gets here.
    max_grammar_size: 200_000,
    // Large lexemes are run against the vocabulary once, at compile time, within the
    // initial fuel, so that every mask after is cheaper.
    precompute_large_lexemes: true,
    // An error names what went wrong, not the grammar and tokens so far: it goes back to
    // the client, and a grammar can be 128 KiB.
    verbose_errors: false,
};

/// Bytes one grammar's lexer may hold (it grows as its sequences mask, and all the
/// sequences of a grammar share it): past it, the next mask fails, and with it the request,
/// as the request's fault. Checked after every mask, so it is passed by at most one mask's
/// growth.
pub const MAX_LEXER_BYTES: usize = 64 << 20;

/// The JSON the model writes: one space after `,` and `:` and no other whitespace, so that
/// a small model at a high temperature cannot spend its token budget on blank lines.
fn json_options(strict: bool) -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        whitespace_flexible: false,
        lenient: !strict,
        ..JsonCompileOptions::default()
    }
}

impl Grammar {
    fn top_level(&self) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self {
            Grammar::JsonSchema { schema, strict } => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(GrammarError::Invalid(
                        "a JSON schema must be an object or a boolean".into(),
                    ));
                }
                let mut schema = schema.clone();
                if let Value::Object(m) = &mut schema {
                    // The schema's own compile options would override ours (whitespace,
                    // leniency): the server's are the only ones.
                    m.remove("x-guidance");
                }
                let mut g = GrammarWithLexer::from_json_schema(schema);
                if let Some(s) = g.json_schema.as_mut().filter(|s| s.is_object()) {
                    json_options(*strict).apply_to(s);
                }
                g.name = Some("json_schema".into());
                TopLevelGrammar::from_grammar(g)
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Choice(choices) => {
                if choices.is_empty() {
                    return Err(GrammarError::Invalid("the list of choices is empty".into()));
                }
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::to_string(c).expect("a string serializes"))
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
        })
    }
}

/// The model's vocabulary as llguidance sees it: each token's bytes, special tokens marked
/// so that no grammar text can produce them, and the end-of-sequence tokens that a finished
/// grammar allows.
struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}

/// A model's vocabulary, ready to compile grammars against: built once, shared.
#[derive(Clone)]
pub struct Vocab {
    factory: Arc<ParserFactory>,
    eos: Arc<[u32]>,
    max_lexer_bytes: usize,
}

impl std::fmt::Debug for Vocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocab").finish_non_exhaustive()
    }
}

impl Vocab {
    /// The vocabulary of `tokenizer`, whose sequences end with any of `eos` (the model's
    /// end-of-sequence tokens; at least one).
    pub fn new(tokenizer: &Tokenizer, eos: &[u32]) -> Result<Self, GrammarError> {
        let size = tokenizer.vocab_size();
        let Some(&first_eos) = eos
            .first()
            .filter(|_| eos.iter().all(|&t| (t as usize) < size))
        else {
            return Err(GrammarError::Invalid(format!(
                "end-of-sequence tokens {eos:?} are not inside the vocabulary of {size}"
            )));
        };
        let special = tokenizer.inner().get_added_tokens_decoder();
        let words: Vec<Vec<u8>> = (0..size as u32)
            .map(|id| match special.get(&id) {
                Some(t) if t.special => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(t.content.as_bytes());
                    w
                }
                _ => tokenizer.token_bytes(id).unwrap_or_default(),
            })
            .collect();
        let info = TokRxInfo::new(size as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: Arc<dyn TokenizerEnv + Sync> = Arc::new(Env {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = PARSER_LIMITS;
        Ok(Self {
            factory: Arc::new(factory),
            eos: eos.into(),
            max_lexer_bytes: MAX_LEXER_BYTES,
        })
    }

    /// The same vocabulary, whose grammars' lexers may hold at most `bytes` (default
    /// [`MAX_LEXER_BYTES`]).
    pub fn with_max_lexer_bytes(mut self, bytes: usize) -> Self {
        self.max_lexer_bytes = bytes;
        self
    }

    /// The constraint of `grammar` before any output, for a request that ends on `stops`
    /// (its stop tokens), or what is wrong with the grammar: [`Vocab::parse`] then
    /// [`Compiled::start`].
    pub fn compile(&self, grammar: &Grammar, stops: &[u32]) -> Result<Constraint, GrammarError> {
        Ok(self.parse(grammar)?.start(stops))
    }

    /// `grammar` compiled against this vocabulary, or what is wrong with it.
    pub fn parse(&self, grammar: &Grammar) -> Result<Compiled, GrammarError> {
        let top = grammar.top_level()?;
        // A grammar is a stranger's input: a panic in the compiler fails this grammar only.
        let parser = llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(top)
        }))
        .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        // A clone shares the lexer the matcher builds as it masks: it measures its size.
        let lexer = parser.clone();
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(GrammarError::Invalid(e)),
            None => Ok(Compiled {
                matcher,
                lexer,
                eos: self.eos.clone(),
                max_lexer_bytes: self.max_lexer_bytes,
            }),
        }
    }
}

/// A compiled grammar, before any output: what every sequence that uses it starts from.
/// Its constraints share its lexer, which grows as they mask (up to
/// [`PARSER_LIMITS`]' `max_lexer_states`).
#[derive(Clone)]
pub struct Compiled {
    matcher: Matcher,
    lexer: TokenParser,
    eos: Arc<[u32]>,
    max_lexer_bytes: usize,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiled").finish_non_exhaustive()
    }
}

impl Compiled {
    /// The constraint before any output, for a request that ends on `stops`.
    ///
    /// The grammar's end is offered through the end-of-sequence tokens among `stops` only:
    /// with `ignore_eos` none of them is a stop, and the sequence goes on while its grammar
    /// can, until its budget or a grammar that allows nothing more ends it.
    pub fn start(&self, stops: &[u32]) -> Constraint {
        Constraint {
            matcher: self.matcher.clone(),
            lexer: self.lexer.clone(),
            max_lexer_bytes: self.max_lexer_bytes,
            hidden_ends: self
                .eos
                .iter()
                .copied()
                .filter(|t| !stops.contains(t))
                .collect(),
        }
    }

    /// Bytes its lexer holds now (it grows as its constraints mask).
    pub fn lexer_bytes(&self) -> usize {
        self.lexer.parser.lexer_stats().num_bytes
    }
}

/// One sequence's place in its grammar.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// Measures the lexer the matcher shares with the grammar's other constraints.
    lexer: TokenParser,
    max_lexer_bytes: usize,
    /// End-of-sequence tokens that are not the request's stop tokens (`ignore_eos`).
    hidden_ends: Arc<[u32]>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.finished())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// The tokens the sequence may take next: the ones that keep its text a prefix of some
    /// text the grammar accepts, and once it is complete the end-of-sequence tokens that
    /// are stop tokens (see [`Vocab::compile`]).
    pub fn mask(&mut self) -> Result<TokenMask, GrammarError> {
        let mut m = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Failed(e.to_string()))?;
        let bytes = self.lexer.parser.lexer_stats().num_bytes;
        if bytes > self.max_lexer_bytes {
            return Err(GrammarError::Failed(format!(
                "the grammar's lexer holds {} MiB, the limit is {} MiB",
                bytes >> 20,
                self.max_lexer_bytes >> 20
            )));
        }
        let hidden = self
            .hidden_ends
            .iter()
            .filter(|&&t| m.is_allowed(t))
            .count();
        // When the end is all the grammar allows, it stays: the sequence has no other token.
        if hidden > 0 && hidden < m.num_set() {
            self.hidden_ends.iter().for_each(|&t| m.disallow_token(t));
        }
        Ok(TokenMask(m))
    }

    /// Moves past `tokens`, the sequence's next tokens.
    pub fn advance(&mut self, tokens: &[u32]) -> Result<(), GrammarError> {
        self.matcher
            .consume_tokens(tokens)
            .map_err(|e| GrammarError::Failed(e.to_string()))
    }

    /// The grammar is complete and allows nothing more: the sequence ends here.
    pub fn finished(&self) -> bool {
        !self.matcher.is_error() && self.matcher.is_stopped()
    }
}

/// The set of tokens a constrained sequence may take next.
#[derive(Debug, Clone)]
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Whether token `id` is in the set; ids past the tokenizer's vocabulary (the padding
    /// rows of a model's output) never are.
    pub fn allows(&self, id: u32) -> bool {
        (id as usize) < self.0.len() && self.0.is_allowed(id)
    }

    /// The set of `ids` among a vocabulary of `size` tokens (ids past it are left out).
    pub fn of(ids: &[u32], size: usize) -> Self {
        let mut v = SimpleVob::alloc(size);
        ids.iter()
            .filter(|&&t| (t as usize) < size)
            .for_each(|&t| v.allow_token(t));
        Self(v)
    }

    /// Sets every logit outside the set to minus infinity.
    pub fn apply(&self, logits: &mut [f32]) {
        for (id, x) in logits.iter_mut().enumerate() {
            if !self.allows(id as u32) {
                *x = f32::NEG_INFINITY;
            }
        }
    }

    /// One flag a token of `flags`' vocabulary: 1 where the set allows it, else 0 (a mask
    /// a device applies as [`TokenMask::apply`] does).
    pub fn write_flags(&self, flags: &mut [u8]) {
        flags.fill(0);
        self.0.iter_set_entries(|id| {
            if let Some(f) = flags.get_mut(id) {
                *f = 1;
            }
        });
    }
}

/// Two masks are equal when they allow the same tokens of the same vocabulary.
impl PartialEq for TokenMask {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len() && self.0.as_slice() == other.0.as_slice()
    }
}

#[cfg(test)]
mod tests;
