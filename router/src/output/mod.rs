//! One request's output as it grows: each sequence's decoded text, cut at stop strings and
//! split by the chat parser into content, reasoning and tool calls; its logprobs; and the
//! per-token figures the usage reports. `render` shows it as the API's responses and
//! stream chunks.

mod echo;
mod render;
#[cfg(test)]
mod tests;

pub(crate) use echo::Echo;

use std::sync::Arc;
use std::time::Instant;

use proto::v1::FinishReason;
use runtime::prom::Observe;
use text::structured::Parser;
use text::tools::{ToolCall, ToolFormat};
use tokio::sync::watch;

use crate::access::Access;
use crate::api::StopReason;
use crate::dispatch::{EndedChoices, Piece, TokenStat};
use crate::error::RouterError;
use crate::keys::QuotaHold;
use crate::metrics::Metrics;
use crate::params;
use crate::placement::Placement;
use crate::stops::{Progress, Scan, StopStrings};

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

impl Kind {
    pub(crate) fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::Completion => "completions",
        }
    }
}

/// Per-token figures the usage reports, over every sequence.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) completion_tokens: usize,
    pub(crate) batch_size: Vec<u32>,
    pub(crate) queue_wait_us: Vec<u64>,
    pub(crate) prefill_ms: f64,
    pub(crate) decode_ms: Vec<f64>,
    pub(crate) cached_tokens: u32,
    /// Where the prompt was computed, from the first token.
    pub(crate) placement: Option<Placement>,
}

impl Tally {
    /// Counts one token's figures.
    fn count(&mut self, t: &TokenStat) {
        self.completion_tokens += 1;
        self.batch_size.push(t.batch_size);
        self.queue_wait_us.push(t.queue_wait_us);
        if t.from_prefill {
            self.prefill_ms = t.step_ms;
            self.cached_tokens = t.cached_tokens;
            self.placement = Some(t.placement);
        } else {
            self.decode_ms.push(ms(t.step_ms));
        }
    }
}

/// Milliseconds to three decimals.
pub(crate) fn ms(x: f64) -> f64 {
    (x * 1e3).round() / 1e3
}

/// A token as logprobs show it: its text (OpenAI's `bytes:\xNN...` when it is only part
/// of a character) and its bytes.
#[derive(Debug, Clone)]
pub(crate) struct Shown {
    pub(crate) text: String,
    pub(crate) bytes: Vec<u8>,
}

/// One token's logprob and alternatives, with its text and where that text starts.
#[derive(Debug, Clone)]
pub(crate) struct LogprobEntry {
    pub(crate) token: Shown,
    pub(crate) logprob: f32,
    pub(crate) top: Vec<(Shown, f32)>,
    /// Characters of output before this token's text.
    pub(crate) offset: usize,
}

/// What one token (or the end) of a choice let out to the client.
#[derive(Debug, Default)]
pub(crate) struct Released {
    pub(crate) content: String,
    pub(crate) reasoning: String,
    /// The new calls, as indices into the choice's `calls`.
    pub(crate) calls: std::ops::Range<usize>,
}

/// One sequence's output as it grows.
pub(crate) struct ChoiceOut {
    pub(crate) decoder: text::IncrementalDecoder,
    /// Decoded text; past a matched stop string it is cut where the output ends.
    pub(crate) text: String,
    pub(crate) text_chars: usize,
    /// Bytes of `text` already released to the client.
    pub(crate) sent: usize,
    /// Splits released chat text into reasoning, content and tool calls.
    pub(crate) parser: Option<Parser>,
    /// Released text that is content (all of it without a parser).
    pub(crate) content: String,
    pub(crate) reasoning: String,
    /// Tool calls with their ids.
    pub(crate) calls: Vec<(String, ToolCall)>,
    pub(crate) stop_reason: Option<StopReason>,
    /// Tokens appended so far.
    pub(crate) tokens: usize,
    /// How far the text is into each stop string.
    pub(crate) progress: Progress,
    /// When the last token arrived.
    pub(crate) last_at: Option<Instant>,
    /// A stop string ended the output: its later tokens are ignored.
    pub(crate) stopped: bool,
    pub(crate) finish: Option<FinishReason>,
    /// Sum of its tokens' logprobs: how best_of ranks sequences.
    pub(crate) cumulative_logprob: f64,
    pub(crate) entries: Vec<LogprobEntry>,
}

impl ChoiceOut {
    pub(crate) fn new(skip_special: bool, parser: Option<Parser>) -> Self {
        Self {
            decoder: text::IncrementalDecoder::new(skip_special),
            text: String::new(),
            text_chars: 0,
            sent: 0,
            parser,
            content: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
            stop_reason: None,
            tokens: 0,
            progress: Progress::default(),
            last_at: None,
            stopped: false,
            finish: None,
            cumulative_logprob: 0.0,
            entries: Vec::new(),
        }
    }

    /// Adds the text of a token, or (`token` false) what the decoder still held at the end,
    /// and looks for a stop string in it.
    pub(crate) fn append(&mut self, piece: &str, stops: &StopStrings, token: bool) {
        let old = self.text.len();
        self.text.push_str(piece);
        self.text_chars += piece.chars().count();
        self.tokens += usize::from(token);
        // Within min_tokens a stop string ends nothing.
        let counts = self.tokens >= stops.min_tokens();
        if let Scan::Stop { end, which } = stops.scan(&mut self.progress, &self.text, old, counts) {
            self.text.truncate(end);
            self.text_chars = self.text.chars().count();
            self.stop_reason = Some(StopReason::Text(stops.get(which).to_string()));
            self.stopped = true;
        }
    }

    /// Lets out the text now free to go (`all` at the end of the output), through the
    /// parser when there is one.
    pub(crate) fn release(&mut self, stops: &StopStrings, all: bool) -> Released {
        let upto = if all || self.stopped {
            self.text.len()
        } else {
            self.text.len() - stops.held(&self.progress)
        };
        let upto = upto.max(self.sent);
        let text = &self.text[self.sent..upto];
        self.sent = upto;
        let Some(parser) = &mut self.parser else {
            self.content.push_str(text);
            return Released {
                content: text.to_string(),
                ..Released::default()
            };
        };
        let mut d = parser.feed(text);
        if all {
            let end = parser.finish();
            d.reasoning.push_str(&end.reasoning);
            d.content.push_str(&end.content);
            d.calls.extend(end.calls);
        }
        self.content.push_str(&d.content);
        self.reasoning.push_str(&d.reasoning);
        let first = self.calls.len();
        let format = parser.format();
        self.calls
            .extend(d.calls.into_iter().map(|c| (call_id(format), c)));
        Released {
            content: d.content,
            reasoning: d.reasoning,
            calls: first..self.calls.len(),
        }
    }
}

/// A tool call id as OpenAI writes them, or as the model's template takes them back
/// (nine letters and digits for Mistral's).
pub(crate) fn call_id(format: Option<ToolFormat>) -> String {
    if format.is_some_and(ToolFormat::nine_char_ids) {
        return text::tools::base62_id(params::random_u64());
    }
    format!(
        "call_{:016x}{:08x}",
        params::random_u64(),
        params::random_u64() as u32
    )
}

/// How a request's sequences end: by token, and by the text they decode to.
#[derive(Debug, Clone)]
pub(crate) struct Stopping {
    /// Every id that ends generation (EOS unless ignored, and stop_token_ids).
    pub(crate) ids: Vec<u32>,
    /// The request's own stop_token_ids, reported as `stop_reason`.
    pub(crate) user_ids: Vec<u32>,
    pub(crate) strings: StopStrings,
}

/// What a request asked its output to be: everything about the output that the request
/// decides.
#[derive(Clone)]
pub(crate) struct OutputSpec {
    pub(crate) kind: Kind,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) prompt_tokens: usize,
    pub(crate) stopping: Stopping,
    /// Whether the request asked for logprobs.
    pub(crate) logprobs: bool,
    /// Choices returned (the best n of the sequences when best_of > n).
    pub(crate) n: usize,
    /// Sequences the workers report, one `ChoiceOut` each.
    pub(crate) sequences: usize,
    pub(crate) skip_special_tokens: bool,
    /// Special tokens shown even with `skip_special_tokens`: the markers of the parser's
    /// tool-call format.
    pub(crate) kept_specials: Arc<[u32]>,
    /// The chat parser each choice's text goes through, if the request needs one.
    pub(crate) parser: Option<Parser>,
    /// `stream_options.include_usage`: the stream ends with a usage chunk.
    pub(crate) include_usage: bool,
    /// `echo`: the prompt, shown before each choice's output.
    pub(crate) echo: Option<Echo>,
    /// Choices ended by a stop string while others go on (bit i: choice i), for the
    /// decode node to stop decoding (`GenRequest::ended`); none where that cannot happen.
    pub(crate) ended: Option<Arc<watch::Sender<EndedChoices>>>,
}

/// What the server gives every output: the tokenizer that shows its tokens, the served
/// model's name, whether fullText is on, and the metrics it reports to.
#[derive(Clone)]
pub(crate) struct Render {
    pub(crate) text: Arc<text::TextModel>,
    pub(crate) model: Arc<str>,
    pub(crate) full_text: bool,
    pub(crate) metrics: Arc<Metrics>,
}

/// One request's output: one `ChoiceOut` per generated sequence.
pub(crate) struct Output {
    pub(crate) spec: OutputSpec,
    render: Render,
    pub(crate) choices: Vec<ChoiceOut>,
    pub(crate) tally: Tally,
    /// When the first token arrived.
    first_at: Instant,
    /// What the request holds of its API key's quota, charged for the tokens it used.
    hold: Option<QuotaHold>,
    /// The request's access-log line, told the tokens it used.
    pub(crate) access: Option<Access>,
}

impl Drop for Output {
    /// Records every token the request used, also when the client left early; the hold,
    /// dropped next, charges them and gives back the rest.
    fn drop(&mut self) {
        if let Some(hold) = &mut self.hold {
            hold.used((self.spec.prompt_tokens + self.tally.completion_tokens) as u64);
        }
        if let Some(a) = &self.access {
            a.update(|f| {
                f.prompt_tokens = self.spec.prompt_tokens;
                f.completion_tokens = self.tally.completion_tokens;
            });
        }
    }
}

impl Output {
    /// The output of `spec` as its first token arrives, charged to `hold`.
    pub(crate) fn new(spec: OutputSpec, render: Render, hold: Option<QuotaHold>) -> Self {
        let choices = Self::fresh_choices(&spec);
        Self {
            spec,
            render,
            choices,
            tally: Tally::default(),
            first_at: Instant::now(),
            hold,
            access: None,
        }
    }

    fn fresh_choices(spec: &OutputSpec) -> Vec<ChoiceOut> {
        (0..spec.sequences)
            .map(|_| {
                let mut c = ChoiceOut::new(spec.skip_special_tokens, spec.parser.clone());
                c.decoder = c.decoder.keeping(spec.kept_specials.clone());
                if let Some(e) = &spec.echo {
                    c.content.clone_from(&e.text);
                }
                c
            })
            .collect()
    }

    /// Starts the output again, before a new attempt starts (which must not see the choices
    /// the failed one ended early): the key pays for the answer it gets, not for the attempt
    /// that failed, so the tokens counted so far are dropped and the hold stays.
    pub(crate) fn restart(&mut self) {
        self.choices = Self::fresh_choices(&self.spec);
        self.tally = Tally::default();
        if let Some(echo) = &mut self.spec.echo {
            echo.scored = None;
        }
        if let Some(ended) = &self.spec.ended {
            ended.send_replace(EndedChoices::default());
        }
    }

    /// Notes that the first token of a restarted attempt has arrived.
    pub(crate) fn first_token_now(&mut self) {
        self.first_at = Instant::now();
    }

    /// Whether the stream ends with a usage chunk.
    pub(crate) fn include_usage(&self) -> bool {
        self.spec.include_usage
    }

    pub(crate) fn shown(&self, id: u32) -> Shown {
        let bytes = self
            .render
            .text
            .tokenizer
            .token_bytes(id)
            .unwrap_or_default();
        let text = match std::str::from_utf8(&bytes) {
            Ok(s) => s.to_string(),
            Err(_) => bytes.iter().fold(String::from("bytes:"), |mut s, b| {
                s.push_str(&format!("\\x{b:02x}"));
                s
            }),
        };
        Shown { text, bytes }
    }

    pub(crate) fn choice_mut(&mut self, choice: u32) -> Result<&mut ChoiceOut, RouterError> {
        self.choices
            .get_mut(choice as usize)
            .ok_or_else(|| RouterError::Internal(format!("a token for unknown choice {choice}")))
    }

    /// Counts a token and returns what it releases for its choice (nothing while a
    /// character is split or the text could still become a stop string or markup), or
    /// `None` when that choice has already ended.
    pub(crate) fn push(&mut self, t: &TokenStat) -> Result<Option<Released>, RouterError> {
        if self.choice_mut(t.choice)?.finish.is_some() {
            return Ok(None);
        }
        self.tally.count(t);
        let entry = self.spec.logprobs.then(|| LogprobEntry {
            token: self.shown(t.id),
            logprob: t.logprob,
            top: t.top.iter().map(|&(id, lp)| (self.shown(id), lp)).collect(),
            offset: 0,
        });
        let user_stop = self.spec.stopping.user_ids.contains(&t.id);
        let piece = self.text_of(t)?;
        let stops = &self.spec.stopping.strings;
        // Offsets count the echoed prompt too: they index the choice's text as shown.
        let echoed = self.spec.echo.as_ref().map_or(0, |e| e.chars);
        let choice = &mut self.choices[t.choice as usize];
        let now = Instant::now();
        if let Some(last) = choice.last_at.replace(now) {
            self.render.metrics.itl.observe(now - last);
        }
        choice.cumulative_logprob += f64::from(t.logprob);
        if let Some(mut e) = entry {
            e.offset = echoed + choice.text_chars;
            choice.entries.push(e);
        }
        if user_stop {
            choice.stop_reason = Some(StopReason::Token(t.id));
        }
        choice.append(&piece, stops, true);
        let mut part = choice.release(stops, false);
        if let Some(echo) = self.spec.echo.as_ref().filter(|_| choice.tokens == 1) {
            // A stream shows the prompt with the choice's first token.
            part.content.insert_str(0, &echo.text);
        }
        Ok(Some(part))
    }

    /// The text `t` adds to its choice. A stop token ends the output and is not part of its
    /// text, unless it is one of the request's stop_token_ids and include_stop_str_in_output
    /// asks to keep it (seed 000: "By default, the output does not contain the token ID in
    /// the list for stopping inference"; include_stop_str_in_output is ignored "if stop or
    /// stop_token_ids is not passed").
    fn text_of(&mut self, t: &TokenStat) -> Result<String, RouterError> {
        let stopping = &self.spec.stopping;
        let user_stop = stopping.user_ids.contains(&t.id);
        if stopping.ids.contains(&t.id) && !(user_stop && stopping.strings.include()) {
            return Ok(String::new());
        }
        let tokenizer = &self.render.text.tokenizer;
        let choice = &mut self.choices[t.choice as usize];
        Ok(choice
            .decoder
            .push(tokenizer, t.id)
            .map_err(|e| RouterError::Internal(e.to_string()))?
            .unwrap_or_default())
    }

    /// Ends a choice: returns what it still held back.
    pub(crate) fn finish(
        &mut self,
        choice: u32,
        reason: FinishReason,
    ) -> Result<Released, RouterError> {
        let tokenizer = &self.render.text.tokenizer;
        let stops = &self.spec.stopping.strings;
        let c = self.choices.get_mut(choice as usize).ok_or_else(|| {
            RouterError::Internal(format!("a finish for unknown choice {choice}"))
        })?;
        if !c.stopped {
            let rest = c
                .decoder
                .flush(tokenizer)
                .map_err(|e| RouterError::Internal(e.to_string()))?
                .unwrap_or_default();
            c.append(&rest, stops, false);
        }
        c.finish = Some(if c.stopped {
            FinishReason::Stop
        } else {
            reason
        });
        let cut_short = c.stopped;
        let rest = c.release(stops, true);
        if self.all_finished() {
            self.record();
        } else if let Some(ended) = self.spec.ended.as_ref().filter(|_| cut_short) {
            // The decode node would go on decoding it for the other choices' sake.
            ended.send_modify(|m| *m = m.with(choice));
        }
        Ok(rest)
    }

    /// The choice `piece` ends, and why, when that choice is still open: a worker's finish,
    /// or a token whose text matched a stop string.
    pub(crate) fn ending(&self, piece: &Piece) -> Result<Option<(u32, FinishReason)>, RouterError> {
        let (choice, reason, is_finish) = match piece {
            Piece::Prompt(_) => return Ok(None),
            Piece::Token(t) => (t.choice, FinishReason::Stop, false),
            Piece::Finish { choice, reason } => (*choice, *reason, true),
        };
        let c = self
            .choices
            .get(choice as usize)
            .ok_or_else(|| RouterError::Internal(format!("a piece for unknown choice {choice}")))?;
        let ends = c.finish.is_none() && (is_finish || c.stopped);
        Ok(ends.then_some((choice, reason)))
    }

    pub(crate) fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    pub(crate) fn record(&self) {
        let m = &self.render.metrics;
        m.tokens(self.spec.prompt_tokens, self.tally.completion_tokens);
        let per_choice = self.tally.completion_tokens as f64 / self.choices.len().max(1) as f64;
        if per_choice > 1.0 {
            m.tpot
                .observe(self.first_at.elapsed().div_f64(per_choice - 1.0));
        }
    }
}
