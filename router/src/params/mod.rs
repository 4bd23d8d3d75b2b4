//! Typed requests (`crate::api`) to validated parameters. Each check names the parameter it
//! rejects, as the OpenAI error object's `param`.

mod chat;
mod completion;
#[cfg(test)]
mod extension_tests;
mod structured;
#[cfg(test)]
mod structured_tests;
#[cfg(test)]
mod tests;

pub use chat::{chat, Chat, ToolChoice};
pub use completion::{completion, Completion, Prompt};
use structured::external_ref;
pub use structured::{forced_call, Constrained};

use serde_json::Value;

use proto::limits::{MAX_LOGIT_BIAS, MAX_SEQUENCES, MAX_STOP_TOKEN_IDS};
use proto::v1::LogitBias;

use crate::api::json::JsonBudget;
use crate::api::{Obj, Param, Sampling, Stop, StreamOptions};
use crate::error::RouterError;

/// Most characters of message content (the seeds' 4 MB).
pub const MAX_CONTENT_CHARS: usize = 4 * 1024 * 1024;

/// Most messages of a chat (OpenAI's limit): each is checked, copied and templated.
pub const MAX_MESSAGES: usize = 2048;

/// Most tools of a chat (OpenAI's limit): each goes into the prompt, and a forced call
/// compiles one grammar alternative per tool.
pub const MAX_TOOLS: usize = 128;

/// `metadata` as OpenAI bounds it: at most 16 pairs, keys of at most 64 characters, string
/// values of at most 512.
pub const MAX_METADATA_PAIRS: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

/// Most characters of the other harmless strings (`service_tier`, `prompt_cache_key`,
/// `safety_identifier`).
const MAX_HARMLESS_CHARS: usize = 512;

/// Parameters both endpoints share.
#[derive(Debug, Clone)]
pub struct Common {
    pub model: String,
    pub stream: bool,
    pub sampling: proto::v1::SamplingParams,
    pub max_tokens: Option<u64>,
    /// `stream_options.include_usage`: a last chunk with the usage and no choices.
    pub include_usage: bool,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// `stop_token_ids` that are int32 and inside the vocabulary.
    pub stop_token_ids: Vec<u32>,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    /// Choices returned.
    pub n: usize,
    /// Sequences generated, of which the n best (by cumulative logprob) are returned; with
    /// beam search, the beam width.
    pub best_of: usize,
    /// Beam search instead of sampling.
    pub beam: bool,
    /// No stop token or stop string ends a choice before it has this many tokens.
    pub min_tokens: usize,
    /// What the output must match (structured outputs), not yet checked against the
    /// vocabulary; `sampling.grammar` is set once it is, on the blocking pool.
    pub grammar: Option<Constrained>,
}

/// Fields accepted and ignored, because none changes the answer: OpenAI's bookkeeping
/// (`metadata`, `store`: nothing is stored here), its routing and abuse-tracking hints
/// (`service_tier`, `prompt_cache_key`, `safety_identifier`). Any other field this server does
/// not know is refused: dropping it would be a wrong answer the client cannot see.
pub const HARMLESS_FIELDS: [&str; 5] = [
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

/// The most characters of an unknown field's name that its error repeats.
const NAME_SHOWN: usize = 64;

/// Refuses the first field of `extra` (the fields a request struct does not declare) that
/// is not harmless, named under `prefix` (`""` at the top, `"stream_options."` inside it),
/// and a harmless one past its bounds: ignored is not free, since it is parsed and held.
pub fn known_fields(extra: &Obj, prefix: &str) -> Result<(), RouterError> {
    let allowed = |k: &str| prefix.is_empty() && HARMLESS_FIELDS.contains(&k);
    if let Some(k) = extra.keys().find(|k| !allowed(k)) {
        let mut name: String = k.chars().take(NAME_SHOWN).collect();
        if name.len() < k.len() {
            name.push('…');
        }
        return Err(RouterError::UnknownParam(format!("{prefix}{name}")));
    }
    extra.iter().try_for_each(|(k, v)| harmless(k, v))
}

/// A harmless field within its bounds: `metadata` as OpenAI bounds it, `store` a boolean,
/// the others strings of at most 512 characters.
fn harmless(key: &str, v: &Value) -> Result<(), RouterError> {
    let param = HARMLESS_FIELDS
        .into_iter()
        .find(|&h| h == key)
        .expect("only harmless fields are checked");
    let chars = |s: &str, max: usize| s.chars().count() <= max;
    let fits = match (param, v) {
        (_, Value::Null) | ("store", Value::Bool(_)) => true,
        ("metadata", Value::Object(m)) => {
            m.len() <= MAX_METADATA_PAIRS
                && m.iter().all(|(k, v)| {
                    chars(k, MAX_METADATA_KEY)
                        && v.as_str().is_some_and(|v| chars(v, MAX_METADATA_VALUE))
                })
        }
        ("metadata" | "store", _) => false,
        (_, Value::String(s)) => chars(s, MAX_HARMLESS_CHARS),
        _ => false,
    };
    if fits {
        return Ok(());
    }
    Err(RouterError::param(
        param,
        match param {
            "metadata" => format!(
                "metadata must be an object of at most {MAX_METADATA_PAIRS} pairs, keys of at \
                 most {MAX_METADATA_KEY} characters and string values of at most \
                 {MAX_METADATA_VALUE}"
            ),
            "store" => "store must be a boolean".into(),
            _ => format!("{param} must be a string of at most {MAX_HARMLESS_CHARS} characters"),
        },
    ))
}

/// Refuses the fields for which other servers read a file or fetch a URL (a template, a
/// web search, a schema): ignoring them would leave a client believing they were used.
fn no_fetching_fields(s: &Sampling) -> Result<(), RouterError> {
    if s.chat_template.present() {
        return Err(RouterError::param(
            "chat_template",
            "chat_template is not accepted: prompts are rendered with the model's own chat \
             template, never one from a request",
        ));
    }
    if s.web_search_options.present() {
        return Err(RouterError::param(
            "web_search_options",
            "web search is not supported: the router opens no connection for a request",
        ));
    }
    Ok(())
}

/// The limits on `stop` of the documents a router speaks by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopLimits {
    /// Most stop strings.
    pub strings: usize,
    /// Most characters of one stop string.
    pub chars: usize,
    /// Most characters over all of them.
    pub total: usize,
}

impl StopLimits {
    /// MindIE's (001, 002): each string at least one character, 32768 in all, so one
    /// string may have all of them.
    pub const MINDIE: Self = Self {
        strings: 32768,
        chars: 32768,
        total: 32768,
    };
    /// The hosted provider's (003): at most 1024 strings of 1 to 1024 characters, 32768 in
    /// all. What a router speaking its error format (`--error-format provider`) takes.
    pub const PROVIDER: Self = Self {
        strings: 1024,
        chars: 1024,
        total: 32768,
    };
}

/// `stop`: a string or a list of strings, within `limits`; an empty list means none.
fn stop_strings(stop: &Param<Stop>, limits: StopLimits) -> Result<Vec<String>, RouterError> {
    let bad = |m: String| RouterError::param("stop", m);
    let stops: Vec<String> = match stop {
        Param::Absent | Param::Null => return Ok(Vec::new()),
        Param::Valid(Stop::One(s)) => vec![s.clone()],
        Param::Valid(Stop::Many(items)) => items.clone(),
        Param::Invalid => return Err(bad("stop must be a string or a list of strings".into())),
    };
    if stops.len() > limits.strings {
        return Err(bad(format!(
            "stop has {} strings, the limit is {}",
            stops.len(),
            limits.strings
        )));
    }
    let mut total = 0;
    for s in &stops {
        let n = s.chars().count();
        if n == 0 || n > limits.chars {
            return Err(bad(format!(
                "each stop string must have 1 to {} characters, got {n}",
                limits.chars
            )));
        }
        total += n;
    }
    if total > limits.total {
        return Err(bad(format!(
            "stop strings hold {total} characters, the limit is {}",
            limits.total
        )));
    }
    Ok(stops)
}

/// Token ids, each an integer below `vocab`; else a 400 naming `param` that says `what` must
/// be such integers.
pub fn token_ids(
    values: &[Value],
    vocab: usize,
    param: &'static str,
    what: &str,
) -> Result<Vec<u32>, RouterError> {
    values
        .iter()
        .map(|id| {
            id.as_u64()
                .filter(|&t| t < vocab as u64)
                .map(|t| t as u32)
                .ok_or_else(|| {
                    RouterError::param(
                        param,
                        format!("{what} must be integers in [0, {vocab}), got {id}"),
                    )
                })
        })
        .collect()
}

/// An integer in `lo..=hi`, or `None` when absent or null.
fn int_in(
    p: &Param<i128>,
    key: &'static str,
    lo: i128,
    hi: i128,
) -> Result<Option<usize>, RouterError> {
    match p.value(key)?.copied() {
        None => Ok(None),
        Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as usize)),
        Some(x) => Err(RouterError::param(
            key,
            format!("{key} must be in [{lo}, {hi}], got {x}"),
        )),
    }
}

/// A boolean parameter with its default.
fn boolean(p: &Param<bool>, key: &'static str, default: bool) -> Result<bool, RouterError> {
    Ok(p.value(key)?.copied().unwrap_or(default))
}

/// A float in a range; `lo_open`/`hi_open` exclude that end.
fn ranged(
    p: &Param<f64>,
    key: &'static str,
    default: f64,
    (lo, lo_open): (f64, bool),
    (hi, hi_open): (f64, bool),
) -> Result<f64, RouterError> {
    let Some(&sent) = p.value(key)? else {
        return Ok(default);
    };
    // The engine samples in f32: the range holds for the value it will use, or 1e-310
    // would pass an open 0 and reach it as 0 (a repetition penalty dividing by 0, or a
    // temperature of 0 that makes n samples one greedy answer).
    let x = f64::from(sent as f32);
    let above = if lo_open { x > lo } else { x >= lo };
    let below = if hi_open { x < hi } else { x <= hi };
    if above && below {
        Ok(x)
    } else {
        let (l, r) = (
            if lo_open { "(" } else { "[" },
            if hi_open { ")" } else { "]" },
        );
        Err(RouterError::param(
            key,
            format!("{key} must be in {l}{lo}, {hi}{r}, got {sent}"),
        ))
    }
}

/// `max_tokens` or `max_completion_tokens`: (0, 2147483647].
fn token_budget(p: &Param<i128>, key: &'static str) -> Result<Option<u64>, RouterError> {
    match p.value(key)?.copied() {
        None => Ok(None),
        Some(m) if m > 0 && m <= i32::MAX as i128 => Ok(Some(m as u64)),
        Some(m) => Err(RouterError::param(
            key,
            format!("{key} must be in (0, 2147483647], got {m}"),
        )),
    }
}

/// `stream_options`, which OpenAI allows only on a stream: whether to end it with a usage
/// chunk.
fn stream_options(p: &Param<StreamOptions>, stream: bool) -> Result<bool, RouterError> {
    let bad = |m: &str| RouterError::param("stream_options", m);
    match p {
        Param::Absent | Param::Null => Ok(false),
        Param::Invalid => Err(bad("stream_options must be an object")),
        Param::Valid(_) if !stream => {
            Err(bad("stream_options is only allowed when stream is true"))
        }
        Param::Valid(o) => {
            known_fields(&o.extra, "stream_options.")?;
            match o.include_usage {
                Param::Absent | Param::Null => Ok(false),
                Param::Valid(b) => Ok(b),
                Param::Invalid => Err(bad("stream_options.include_usage must be a boolean")),
            }
        }
    }
}

/// `logit_bias`: token ids (JSON object keys are strings) to biases in [-100, 100], sorted
/// by token.
fn logit_bias(p: &Param<Obj>, vocab_size: usize) -> Result<Vec<LogitBias>, RouterError> {
    let bad = |m: String| RouterError::param("logit_bias", m);
    let map = match p {
        Param::Absent | Param::Null => return Ok(Vec::new()),
        Param::Invalid => return Err(bad("logit_bias must be an object".into())),
        Param::Valid(m) => m,
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(bad(format!(
            "logit_bias has {} entries, the limit is {MAX_LOGIT_BIAS}",
            map.len()
        )));
    }
    let mut biases = Vec::with_capacity(map.len());
    for (key, value) in map {
        let token = key
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < vocab_size)
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias keys must be token ids below {vocab_size}, got \"{key}\""
                ))
            })?;
        let bias = value
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                bad(format!(
                    "logit_bias values must be numbers in [-100, 100], got {value} for token {key}"
                ))
            })?;
        biases.push(LogitBias {
            token,
            bias: bias as f32,
        });
    }
    biases.sort_unstable_by_key(|b| b.token);
    // "7" and "07" are two keys of the object and one token.
    if let Some(w) = biases.windows(2).find(|w| w[0].token == w[1].token) {
        return Err(bad(format!("logit_bias names token {} twice", w[0].token)));
    }
    Ok(biases)
}

/// Checks and reads the parameters both endpoints share. `vocab_size` caps top_k; `stops`
/// are the stop-string limits the router speaks by; JSON text inside the parameters (a
/// schema sent as a string) is parsed within what is left of `json`.
pub fn common(
    o: &Sampling,
    vocab_size: usize,
    stops: StopLimits,
    json: &JsonBudget,
) -> Result<Common, RouterError> {
    let model = match &o.model {
        Param::Valid(s) => s.clone(),
        Param::Null | Param::Invalid => {
            return Err(RouterError::param("model", "model must be a string"))
        }
        Param::Absent => return Err(RouterError::param("model", "model is required")),
    };
    no_fetching_fields(o)?;
    let temperature = ranged(
        &o.temperature,
        "temperature",
        1.0,
        (0.0, false),
        (2.0, false),
    )?;
    let top_p = ranged(&o.top_p, "top_p", 1.0, (1e-6, true), (1.0, false))?;
    let top_k = match o.top_k.value("top_k")?.copied() {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 && k <= i32::MAX as i128 => (k as usize).min(vocab_size) as u32,
        Some(k) => {
            return Err(RouterError::param(
                "top_k",
                format!("top_k must be -1, 0 or in (0, 2147483647], got {k}"),
            ))
        }
    };
    let presence = ranged(
        &o.presence_penalty,
        "presence_penalty",
        0.0,
        (-2.0, false),
        (2.0, false),
    )?;
    let frequency = ranged(
        &o.frequency_penalty,
        "frequency_penalty",
        0.0,
        (-2.0, false),
        (2.0, false),
    )?;
    let repetition = ranged(
        &o.repetition_penalty,
        "repetition_penalty",
        1.0,
        (0.0, true),
        (2.0, false),
    )?;
    let seed = match o.seed.value("seed")?.copied() {
        None => random_u64(),
        Some(s) if (0..=u64::MAX as i128).contains(&s) => s as u64,
        Some(s) => {
            return Err(RouterError::param(
                "seed",
                format!("seed must be in [0, 18446744073709551615], got {s}"),
            ))
        }
    };
    let max_tokens = match (
        token_budget(&o.max_tokens, "max_tokens")?,
        token_budget(&o.max_completion_tokens, "max_completion_tokens")?,
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(RouterError::param(
                "max_completion_tokens",
                format!(
                    "max_completion_tokens ({b}) and max_tokens ({a}) differ; send one of them"
                ),
            ))
        }
        (a, b) => a.or(b),
    };
    let stop_token_ids = match &o.stop_token_ids {
        Param::Absent | Param::Null => Vec::new(),
        Param::Valid(ids) if ids.len() > MAX_STOP_TOKEN_IDS => {
            return Err(RouterError::param(
                "stop_token_ids",
                format!(
                    "stop_token_ids has {} elements, the limit is {MAX_STOP_TOKEN_IDS}",
                    ids.len()
                ),
            ))
        }
        Param::Valid(ids) => ids
            .iter()
            // The seeds: elements that are not int32 are ignored.
            .filter_map(|v| v.as_i64().filter(|&i| i32::try_from(i).is_ok()))
            .filter(|&i| i >= 0 && (i as usize) < vocab_size)
            .map(|i| i as u32)
            .collect(),
        Param::Invalid => {
            return Err(RouterError::param(
                "stop_token_ids",
                "stop_token_ids must be a list of integers",
            ))
        }
    };
    let stream = boolean(&o.stream, "stream", false)?;
    let include_usage = stream_options(&o.stream_options, stream)?;
    if let Param::Invalid = o.user {
        return Err(RouterError::param("user", "user must be a string"));
    }
    let most = MAX_SEQUENCES as i128;
    let n_given = int_in(&o.n, "n", 1, most)?;
    let best_of_given = int_in(&o.best_of, "best_of", 1, most)?;
    let n = n_given.unwrap_or(1);
    let beam = boolean(&o.use_beam_search, "use_beam_search", false)?;
    let best_of = if beam {
        // The seeds: with beam search best_of is not checked; the beam is as wide as the
        // larger of the two.
        best_of_given.unwrap_or(n).max(n)
    } else {
        best_of_given.unwrap_or(n)
    };
    if !beam && best_of < n {
        return Err(RouterError::param(
            "best_of",
            format!("best_of ({best_of}) must be at least n ({n})"),
        ));
    }
    let sampled_several = if beam { n > 1 } else { best_of > 1 };
    if sampled_several && temperature <= 0.0 {
        let param = if n > 1 { "n" } else { "best_of" };
        return Err(RouterError::param(
            param,
            "n or best_of above 1 needs a temperature above 0",
        ));
    }
    // The seeds: streaming needs best_of = n, so best_of alone (above 1) is refused too.
    if !beam && stream && best_of != n {
        return Err(RouterError::param(
            "best_of",
            "when streaming, best_of must equal n (and cannot be set without it)",
        ));
    }
    let stop = stop_strings(&o.stop, stops)?;
    let include_stop_str_in_output = boolean(
        &o.include_stop_str_in_output,
        "include_stop_str_in_output",
        false,
    )?;
    if beam && (!stop.is_empty() || !stop_token_ids.is_empty()) {
        return Err(RouterError::param(
            "use_beam_search",
            "use_beam_search cannot be combined with stop or stop_token_ids",
        ));
    }
    let min_p = ranged(&o.min_p, "min_p", 0.0, (0.0, false), (1.0, false))?;
    let min_tokens = int_in(&o.min_tokens, "min_tokens", 0, i32::MAX as i128)?.unwrap_or(0);
    if let Some(max) = max_tokens.filter(|&m| min_tokens as u64 > m) {
        return Err(RouterError::param(
            "min_tokens",
            format!("min_tokens ({min_tokens}) must be at most max_tokens ({max})"),
        ));
    }
    let logit_bias = logit_bias(&o.logit_bias, vocab_size)?;
    let grammar = structured::grammar(o, json)?;
    if let Some(g) = grammar.as_ref().filter(|_| beam) {
        return Err(RouterError::param(
            g.param,
            format!("{} cannot be combined with use_beam_search", g.param),
        ));
    }
    // The beam search ranks hypotheses by the model's own logprobs; these would need a
    // search of their own.
    if beam && (min_p > 0.0 || min_tokens > 0 || !logit_bias.is_empty()) {
        return Err(RouterError::param(
            "use_beam_search",
            "use_beam_search cannot be combined with min_p, min_tokens or logit_bias",
        ));
    }
    Ok(Common {
        model,
        stream,
        sampling: proto::v1::SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            repetition_penalty: repetition as f32,
            presence_penalty: presence as f32,
            frequency_penalty: frequency as f32,
            seed,
            min_p: min_p as f32,
            logit_bias,
            min_tokens: min_tokens as u32,
            grammar: None,
        },
        max_tokens,
        include_usage,
        ignore_eos: boolean(&o.ignore_eos, "ignore_eos", false)?,
        skip_special_tokens: boolean(&o.skip_special_tokens, "skip_special_tokens", true)?,
        stop_token_ids,
        stop,
        include_stop_str_in_output,
        n,
        best_of,
        beam,
        min_tokens,
        grammar,
    })
}

/// A fresh random u64, for seeds and ids: fastrand's per-thread generator, seeded once per
/// thread. Ids and seeds must differ, not stay secret, and a getrandom call per value cost the
/// router a system call three times per request.
pub fn random_u64() -> u64 {
    fastrand::u64(..)
}
