//! The grammars a node compiles: on the blocking pool in turns of its own, and once per
//! distinct grammar. A retry, a moved stream or another request with the same grammar
//! starts from the grammar already compiled, so what a client pays for one compile it
//! cannot make a node pay again by resending it.

use std::collections::hash_map::RandomState;
use std::num::NonZeroUsize;
use std::sync::{Mutex, PoisonError};

use engine::grammar::{Compiled, Constraint, Vocab};
use lru::LruCache;
use prost::Message;
use proto::v1;

use crate::sampling::{grammar_from_proto, SamplingError};

/// Compiled grammars a node keeps, least recently used first out.
pub const GRAMMAR_CACHE_ENTRIES: usize = 256;
/// Bytes the kept grammars may hold: their wire text and their lexers as they are now
/// (a lexer grows as its sequences mask; see `engine::grammar::PARSER_LIMITS`).
pub const GRAMMAR_CACHE_BYTES: usize = 64 << 20;

/// What a node compiles request grammars with: the model's vocabulary (or why it cannot be
/// used: the node still serves, and refuses only the requests that carry a grammar), turns
/// on the blocking pool, one per CPU, since compiling a grammar can take longer than a
/// thread serving connections may be held, and the grammars compiled so far.
pub struct Grammars {
    vocab: Result<Vocab, String>,
    turns: runtime::Turns,
    cache: Mutex<Cache>,
}

/// How the kept grammars have served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Grammars compiled.
    pub compiles: u64,
    /// Constraints started from a kept grammar.
    pub hits: u64,
    /// Grammars kept now.
    pub entries: usize,
}

struct Cache {
    /// By the grammar's wire encoding, hashed with a random key: a client cannot choose
    /// grammars that collide.
    kept: LruCache<Vec<u8>, Compiled, RandomState>,
    max_bytes: usize,
    stats: CacheStats,
}

impl Cache {
    fn bytes(&self) -> usize {
        self.kept
            .iter()
            .map(|(k, c)| k.len() + c.lexer_bytes())
            .sum()
    }

    /// Keeps `compiled`, then lets the least recently used go until the rest fit.
    fn keep(&mut self, key: Vec<u8>, compiled: Compiled) {
        self.kept.put(key, compiled);
        while self.bytes() > self.max_bytes && self.kept.pop_lru().is_some() {}
        self.stats.entries = self.kept.len();
    }
}

impl Grammars {
    /// The grammars of `loaded`'s vocabulary.
    pub fn of(loaded: &engine::Loaded) -> Self {
        let eos = &loaded.model.config().eos_token_ids;
        let vocab = Vocab::new(&loaded.tokenizer, eos).map_err(|e| {
            tracing::warn!(error = %e, "requests with a grammar will be refused");
            e.to_string()
        });
        Self::new(vocab, GRAMMAR_CACHE_ENTRIES, GRAMMAR_CACHE_BYTES)
    }

    /// Grammars of `vocab` (or why there is none), keeping at most `entries` compiled ones
    /// in `max_bytes`.
    pub fn new(vocab: Result<Vocab, String>, entries: usize, max_bytes: usize) -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let entries = NonZeroUsize::new(entries).unwrap_or(NonZeroUsize::MIN);
        Self {
            vocab,
            turns: runtime::Turns::new(cpus),
            cache: Mutex::new(Cache {
                kept: LruCache::with_hasher(entries, RandomState::new()),
                max_bytes,
                stats: CacheStats::default(),
            }),
        }
    }

    /// How the kept grammars have served so far.
    pub fn stats(&self) -> CacheStats {
        self.cache().stats
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        // The cache holds no invariant a panic elsewhere could break halfway.
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The constraint a request's sequences start from, for a request that ends on
    /// `stops`: from the grammar kept, or compiled on the blocking pool in a turn of this
    /// node's; `None` without a grammar.
    pub async fn constraint(
        &self,
        g: Option<v1::Grammar>,
        stops: &[u32],
        beam: bool,
    ) -> Result<Option<Constraint>, SamplingError> {
        let Some(g) = g else {
            return Ok(None);
        };
        if beam {
            return Err(SamplingError::GrammarWithBeams);
        }
        let vocab = self
            .vocab
            .as_ref()
            .map_err(|e| SamplingError::NoVocab(e.clone()))?
            .clone();
        // Checked before a turn is waited for: a grammar past the limits costs no compile.
        let grammar = grammar_from_proto(&g)?;
        let key = g.encode_to_vec();
        {
            let mut cache = self.cache();
            if let Some(c) = cache.kept.get(&key).map(|c| c.start(stops)) {
                cache.stats.hits += 1;
                return Ok(Some(c));
            }
        }
        let compiled = self
            .turns
            .run(move || vocab.parse(&grammar))
            .await
            .map_err(|e| SamplingError::Grammar(format!("compiling: {e}")))?
            .map_err(|e| SamplingError::Grammar(e.to_string()))?;
        let constraint = compiled.start(stops);
        let mut cache = self.cache();
        cache.stats.compiles += 1;
        cache.keep(key, compiled);
        Ok(Some(constraint))
    }
}

#[cfg(test)]
mod tests;
