//! A prompt this node computes itself (colocated): its cache, its first tokens and, when
//! asked, its prompt tokens scored.

use engine::grammar::TokenMask;

use super::*;

impl Scheduler {
    /// Runs the prompt and picks the first token of each of `n` sequences: samples, or the
    /// n most likely tokens for a beam search. With `prompt_logprobs`, also scores every
    /// prompt token after the first (else the last part is empty). `allowed`: the first
    /// tokens the request's grammar allows.
    pub(super) fn prefill(
        &self,
        a: &Admission,
        n: usize,
        positions: usize,
        allowed: Option<TokenMask>,
    ) -> Result<(SeqCache, Vec<Sampled>, Vec<Sampled>), DecodeError> {
        if a.prompt.is_empty() {
            return Err(DecodeError::InvalidRequest("the prompt is empty".into()));
        }
        let mut cache = self.model.new_cache()?;
        cache.reserve_exact(positions)?;
        let (logits, every) = self.model.forward_rows(
            &mut [SeqInput {
                tokens: &a.prompt,
                cache: &mut cache,
            }],
            &mut |_, _| Ok(()),
            &[a.prompt_logprobs],
        )?;
        let row: Vec<f32> = logits
            .squeeze(0)
            .and_then(|t| t.to_vec1())
            .map_err(EngineError::from)?;
        let scored = match every.into_iter().next().flatten() {
            Some(rows) => {
                let rows: Vec<Vec<f32>> = rows.to_vec2().map_err(EngineError::from)?;
                let last = rows.len().saturating_sub(1);
                engine::sampling::scored(&rows[..last], &a.prompt[1..], a.top_logprobs)
            }
            None => Vec::new(),
        };
        let (prompt, output) = engine::sampling::split_resumed(&a.prompt, a.resumed);
        let cx = Context::of(prompt, output).masked(allowed.as_ref());
        let first = engine::sampling::pick_first(
            &row,
            &a.sampling,
            &cx,
            n,
            a.top_logprobs,
            a.beam_width > 0,
        );
        Ok((cache, first, scored))
    }
}
