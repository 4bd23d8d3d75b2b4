//! `echo` on /v1/completions: the prompt shown before each choice's text, and with
//! `logprobs` each prompt token scored by the worker that ran the prompt (its first token
//! unscored, null in the response, as OpenAI and vLLM show it).

use super::{LogprobEntry, Output, Shown};
use crate::error::RouterError;

/// The echoed prompt of a request.
#[derive(Clone)]
pub(crate) struct Echo {
    /// Shown before each choice's output.
    pub(crate) text: String,
    pub(crate) chars: usize,
    /// The prompt's tokens, as the workers ran them.
    pub(crate) tokens: Vec<u32>,
    /// With logprobs, once a worker scored the prompt: the first token, then an entry for
    /// each token after it.
    pub(crate) scored: Option<(Shown, Vec<LogprobEntry>)>,
}

impl Echo {
    pub(crate) fn new(text: String, tokens: Vec<u32>) -> Self {
        Self {
            chars: text.chars().count(),
            text,
            tokens,
            scored: None,
        }
    }
}

impl Output {
    /// Takes a worker's scores of the prompt: one per prompt token after the first, in
    /// order, or the worker is at fault. A second set (a retried attempt) replaces the first.
    pub(crate) fn scored_prompt(&mut self, scored: &[proto::v1::Token]) -> Result<(), RouterError> {
        let Some(echo) = &self.spec.echo else {
            return Err(RouterError::Internal(
                "a worker scored a prompt that was not to be echoed".into(),
            ));
        };
        let tokens = &echo.tokens;
        let in_order = scored.len() + 1 == tokens.len()
            && scored.iter().zip(&tokens[1..]).all(|(s, &t)| s.id == t);
        if !in_order {
            return Err(RouterError::Internal(format!(
                "a worker scored {} tokens of a {}-token prompt, or not in order",
                scored.len(),
                tokens.len()
            )));
        }
        // Each token's offset is the characters decoded before it, as for the output.
        let tokenizer = &self.render.text.tokenizer;
        let mut decoder = text::IncrementalDecoder::new(false);
        let mut offsets = Vec::with_capacity(tokens.len());
        let mut chars = 0;
        for &t in tokens {
            offsets.push(chars);
            let piece = decoder
                .push(tokenizer, t)
                .map_err(|e| RouterError::Internal(e.to_string()))?;
            chars += piece.map_or(0, |p| p.chars().count());
        }
        let entries = scored
            .iter()
            .zip(&offsets[1..])
            .map(|(s, &offset)| LogprobEntry {
                token: self.shown(s.id),
                logprob: s.logprob,
                top: s
                    .top
                    .iter()
                    .map(|a| (self.shown(a.id), a.logprob))
                    .collect(),
                offset,
            })
            .collect();
        let first = self.shown(tokens[0]);
        if let Some(echo) = &mut self.spec.echo {
            echo.scored = Some((first, entries));
        }
        Ok(())
    }
}
