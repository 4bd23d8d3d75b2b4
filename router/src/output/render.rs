//! An output shown as the API's types (`crate::api`): the non-streamed response, the chunk
//! of each token, the chunk that ends a choice, and the one chunk of a beam search. Each is
//! built from structs that borrow the output and serialized once; a token's chunk writes
//! only its choice after a head serialized once per stream.

use serde::Serialize;
use serde_json::{Map, Value};

use super::{ms, ChoiceOut, Kind, LogprobEntry, Output, Released};
use crate::api::{
    chat, completions, Chunk, Head, PrefillPlacement, PromptTokensDetails, Usage, Whole,
};
use proto::v1::FinishReason;

/// A choice as either endpoint shows it.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum AnyChoice<'a> {
    Message(chat::Choice<'a>),
    Delta(chat::ChunkChoice<'a>),
    Text(completions::Choice<'a>),
}

impl AnyChoice<'_> {
    /// The choice with its text emptied: with fullText the content is the whole text so
    /// far, which a chunk ending on an error must not repeat.
    fn without_output(mut self) -> Self {
        match &mut self {
            AnyChoice::Message(c) => c.message.content = "",
            AnyChoice::Delta(c) => c.delta.content = "",
            AnyChoice::Text(c) => c.text = "",
        }
        self
    }
}

/// The finish_reason a client sees; a choice that called tools and stopped on its own
/// ends with "tool_calls".
fn finish_str(f: FinishReason, called: bool) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ if called => "tool_calls",
        _ => "stop",
    }
}

/// Tool calls as OpenAI shows them; `first` numbers them for stream deltas.
fn tool_calls(
    calls: &[(String, text::tools::ToolCall)],
    first: Option<usize>,
) -> Vec<chat::ToolCall<'_>> {
    calls
        .iter()
        .enumerate()
        .map(|(i, (id, call))| chat::ToolCall {
            id,
            kind: "function",
            function: chat::Function {
                name: &call.name,
                arguments: &call.arguments,
            },
            index: first.map(|first| first + i),
        })
        .collect()
}

impl Output {
    fn usage(&self) -> Usage<'_> {
        let t = &self.tally;
        Usage {
            prompt_tokens: self.spec.prompt_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: t.cached_tokens,
            },
            completion_tokens: t.completion_tokens,
            total_tokens: self.spec.prompt_tokens + t.completion_tokens,
            batch_size: &t.batch_size,
            queue_wait_time: &t.queue_wait_us,
            prefill_placement: t.placement.map(|p| PrefillPlacement {
                node: p.as_str(),
                reason: p.reason(),
            }),
        }
    }

    fn head(&self, chunk: bool) -> Head<'_> {
        Head {
            id: &self.spec.id,
            object: match (self.spec.kind, chunk) {
                (Kind::Chat, false) => "chat.completion",
                (Kind::Chat, true) => "chat.completion.chunk",
                (Kind::Completion, _) => "text_completion",
            },
            created: self.spec.created,
            model: &self.render.model,
        }
    }

    /// Chat logprobs of `entries`, when asked for. Logprobs are f32; they are shown as the
    /// f64 of that f32, as before the API was typed.
    fn chat_logprobs<'a>(&self, entries: &'a [LogprobEntry]) -> Option<chat::Logprobs<'a>> {
        self.spec.logprobs.then(|| chat::Logprobs {
            content: entries
                .iter()
                .map(|e| chat::TokenLogprob {
                    token: &e.token.text,
                    logprob: f64::from(e.logprob),
                    bytes: &e.token.bytes,
                    top_logprobs: e
                        .top
                        .iter()
                        .map(|(t, lp)| chat::TopLogprob {
                            token: &t.text,
                            logprob: f64::from(*lp),
                            bytes: &t.bytes,
                        })
                        .collect(),
                })
                .collect(),
        })
    }

    /// Completion logprobs of `entries`, when asked for, after the echoed prompt's with
    /// `echoed`, their offsets from `base`. As vLLM and OpenAI do, the token itself is
    /// always among the alternatives.
    fn text_logprobs<'a>(
        &'a self,
        entries: &'a [LogprobEntry],
        echoed: bool,
        base: usize,
    ) -> Option<completions::Logprobs<'a>> {
        if !self.spec.logprobs {
            return None;
        }
        let prompt = self
            .spec
            .echo
            .as_ref()
            .filter(|_| echoed)
            .and_then(|e| e.scored.as_ref());
        let (first, scored) = match prompt {
            Some((first, scored)) => (Some(first), scored.as_slice()),
            None => (None, &[][..]),
        };
        let all = || scored.iter().chain(entries);
        let alternatives = |e: &LogprobEntry| {
            let mut m = Map::new();
            for (t, lp) in &e.top {
                m.insert(t.text.clone(), Value::from(f64::from(*lp)));
            }
            m.entry(e.token.text.clone())
                .or_insert(Value::from(f64::from(e.logprob)));
            m
        };
        Some(completions::Logprobs {
            text_offset: first
                .map(|_| base)
                .into_iter()
                .chain(all().map(|e| base + e.offset))
                .collect(),
            token_logprobs: first
                .map(|_| None)
                .into_iter()
                .chain(all().map(|e| Some(f64::from(e.logprob))))
                .collect(),
            tokens: first
                .map(|f| f.text.as_str())
                .into_iter()
                .chain(all().map(|e| e.token.text.as_str()))
                .collect(),
            top_logprobs: first
                .map(|_| None)
                .into_iter()
                .chain(all().map(|e| Some(alternatives(e))))
                .collect(),
        })
    }

    /// The content a choice shows: a chunk's delta, or the whole text so far for the
    /// whole output and with fullText.
    fn content_of<'a>(&self, c: &'a ChoiceOut, part: Option<&'a Released>) -> &'a str {
        match part {
            Some(r) if !self.render.full_text => r.content.as_str(),
            _ => c.content.as_str(),
        }
    }

    /// Choice `index` (as shown) of sequence `c` with the logprobs of `entries`, their text
    /// offsets from `base`: the whole output, or with `part` a chunk's delta (cumulative
    /// content with fullText).
    fn choice<'a>(
        &'a self,
        index: usize,
        c: &'a ChoiceOut,
        part: Option<&'a Released>,
        (entries, base): (&'a [LogprobEntry], usize),
        finish: Option<FinishReason>,
    ) -> AnyChoice<'a> {
        let finish_reason = finish.map(|f| finish_str(f, !c.calls.is_empty()));
        let content = self.content_of(c, part);
        match (self.spec.kind, part) {
            (Kind::Completion, _) => AnyChoice::Text(completions::Choice {
                index,
                text: content,
                // All the choice's entries (the whole output, or a stream's first token):
                // the echoed prompt's come first.
                logprobs: self.text_logprobs(
                    entries,
                    !entries.is_empty() && entries.len() == c.entries.len(),
                    base,
                ),
                stop_reason: finish.and(c.stop_reason.clone()),
                finish_reason,
            }),
            (Kind::Chat, None) => AnyChoice::Message(chat::Choice {
                index,
                message: chat::Message {
                    role: "assistant",
                    // Seed 001 shows a message that only calls tools with `"content": ""`.
                    content,
                    tool_calls: tool_calls(&c.calls, None),
                    reasoning_content: (!c.reasoning.is_empty()).then_some(c.reasoning.as_str()),
                },
                logprobs: self.chat_logprobs(entries),
                finish_reason,
            }),
            (Kind::Chat, Some(r)) => AnyChoice::Delta(chat::ChunkChoice {
                index,
                delta: chat::Delta {
                    role: "assistant",
                    content,
                    reasoning_content: (!r.reasoning.is_empty()).then_some(r.reasoning.as_str()),
                    tool_calls: (!r.calls.is_empty())
                        .then(|| tool_calls(&c.calls[r.calls.clone()], Some(r.calls.start))),
                },
                logprobs: self.chat_logprobs(entries),
                finish_reason,
            }),
        }
    }

    /// What every chunk starts with, up to its choices: `{"id":...,"choices":[`.
    pub(crate) fn chunk_head(&self) -> String {
        let mut head = serde_json::to_string(&self.head(true)).expect("a head serializes");
        head.pop();
        head.push_str(r#","choices":["#);
        head
    }

    /// The chunk for a token of `choice` that released `part`, after `head` (from
    /// `chunk_head`): one choice serialized, no JSON tree built (a streamed request's main
    /// cost in the router).
    pub(crate) fn token_chunk(&self, head: &str, choice: u32, part: &Released) -> String {
        let c = &self.choices[choice as usize];
        let newest = c.entries.len().saturating_sub(1);
        let shown = self.choice(
            choice as usize,
            c,
            Some(part),
            (&c.entries[newest..], 0),
            None,
        );
        let mut out = Vec::with_capacity(head.len() + 128);
        out.extend_from_slice(head.as_bytes());
        serde_json::to_writer(&mut out, &shown).expect("a choice serializes");
        out.extend_from_slice(b"]}");
        String::from_utf8(out).expect("JSON is UTF-8")
    }

    /// A choice's whole text for a last chunk's `full_text`, with fullText enabled.
    fn full_text<'a>(&self, c: &'a ChoiceOut) -> Option<&'a str> {
        self.render.full_text.then_some(c.content.as_str())
    }

    /// The chunk that ends `choice` with what it still held back; the last one to end
    /// also carries the usage.
    pub(crate) fn finish_chunk(&self, choice: u32, rest: &Released) -> String {
        let c = &self.choices[choice as usize];
        let chunk = Chunk {
            head: self.head(true),
            full_text: self.full_text(c),
            usage: self.all_finished().then(|| self.usage()),
            choices: vec![self.choice(choice as usize, c, Some(rest), (&[], 0), c.finish)],
            err_msg: None,
        };
        serde_json::to_string(&chunk).expect("a chunk serializes")
    }

    /// The chunks that end a stream cut by `message` in the provider's format: each choice
    /// still open ends with finish_reason stop, no output (with fullText too), and `err_msg`
    /// (001's rule for an error during execution: "响应输出为空，err_msg非空").
    pub(crate) fn error_chunks(&self, message: &str) -> Vec<String> {
        let empty = Released::default();
        self.choices
            .iter()
            .enumerate()
            .filter(|(_, c)| c.finish.is_none())
            .map(|(i, c)| {
                let chunk = Chunk {
                    head: self.head(true),
                    full_text: None,
                    usage: None,
                    choices: vec![self
                        .choice(i, c, Some(&empty), (&[], 0), Some(FinishReason::Stop))
                        .without_output()],
                    err_msg: Some(message),
                };
                serde_json::to_string(&chunk).expect("a chunk serializes")
            })
            .collect()
    }

    /// The chunk `stream_options.include_usage` asks for, after every choice has ended: the
    /// usage and no choices, as OpenAI sends it. The chunk that ended the last choice
    /// carries the usage too (the seeds' shape).
    pub(crate) fn usage_chunk(&self) -> String {
        let chunk: Chunk<'_, AnyChoice<'_>> = Chunk {
            head: self.head(true),
            full_text: None,
            usage: Some(self.usage()),
            choices: Vec::new(),
            err_msg: None,
        };
        serde_json::to_string(&chunk).expect("a chunk serializes")
    }

    /// Where each shown choice's `text_offset`s start: seed 002's responses continue them
    /// from one choice to the next (its second choice's offsets start at the length of the
    /// first one's text), so each starts after the texts of the choices shown before it.
    fn offset_bases(&self, shown: impl Iterator<Item = usize>) -> Vec<usize> {
        shown
            .scan(0, |base, i| {
                let start = *base;
                *base += self.choices[i].content.chars().count();
                Some(start)
            })
            .collect()
    }

    /// One chunk with every choice whole, and the usage.
    pub(crate) fn whole_chunk(&self) -> String {
        let whole: Vec<Released> = self
            .choices
            .iter()
            .map(|c| Released {
                content: c.content.clone(),
                reasoning: c.reasoning.clone(),
                calls: 0..c.calls.len(),
            })
            .collect();
        let bases = self.offset_bases(0..self.choices.len());
        let chunk = Chunk {
            head: self.head(true),
            // The best hypothesis's, as the last chunk of any stream carries its choice's.
            full_text: self.choices.first().and_then(|c| self.full_text(c)),
            usage: Some(self.usage()),
            choices: self
                .choices
                .iter()
                .zip(&whole)
                .zip(bases)
                .enumerate()
                .map(|(index, ((c, w), base))| {
                    self.choice(index, c, Some(w), (&c.entries, base), c.finish)
                })
                .collect(),
            err_msg: None,
        };
        serde_json::to_string(&chunk).expect("a chunk serializes")
    }

    /// The non-streamed body: the n best sequences by cumulative logprob (all of them, in
    /// order, without best_of).
    pub(crate) fn response(&self) -> Whole<'_, AnyChoice<'_>> {
        let mut order: Vec<usize> = (0..self.choices.len()).collect();
        if self.choices.len() > self.spec.n {
            order.sort_by(|&a, &b| {
                self.choices[b]
                    .cumulative_logprob
                    .total_cmp(&self.choices[a].cumulative_logprob)
            });
            order.truncate(self.spec.n);
        }
        let bases = self.offset_bases(order.iter().copied());
        Whole {
            head: self.head(false),
            choices: order
                .iter()
                .zip(bases)
                .enumerate()
                .map(|(index, (&i, base))| {
                    let c = &self.choices[i];
                    self.choice(index, c, None, (&c.entries, base), c.finish)
                })
                .collect(),
            usage: self.usage(),
            prefill_time: ms(self.tally.prefill_ms),
            decode_time_arr: &self.tally.decode_ms,
        }
    }
}
