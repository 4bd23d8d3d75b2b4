//! What moves a row's logits before its token is chosen: the logit bias, `min_tokens`' hold
//! and the penalties, each at the tokens it names, then a grammar's mask. The first three
//! are written once over [`Entries`], so that a whole row (the host's sampler) and the few
//! entries of a row that a GPU sends back ([`moved_in_place`]) are moved by the same
//! operations, to the same bits; a mask goes to the device as one flag a token
//! ([`masked_in_place`]).

use std::collections::HashMap;

use candle_core::Tensor;

use super::{SamplingParams, TokenMask};
use crate::error::Result;

/// A row's logits, or some of them, by token.
pub(super) trait Entries {
    /// Token `t`'s logit, where the row has it.
    fn at(&mut self, t: u32) -> Option<&mut f32>;
}

impl Entries for [f32] {
    fn at(&mut self, t: u32) -> Option<&mut f32> {
        self.get_mut(t as usize)
    }
}

/// The logits of `tokens` (sorted, each once) of a row: `values`.
pub(super) struct Sparse<'a> {
    pub(super) tokens: &'a [u32],
    pub(super) values: &'a mut [f32],
}

impl Entries for Sparse<'_> {
    fn at(&mut self, t: u32) -> Option<&mut f32> {
        let i = self.tokens.binary_search(&t).ok()?;
        self.values.get_mut(i)
    }
}

/// What moves a row's logits before its rule chooses, the tokens so far they look at, and
/// the tokens its grammar allows next, if it has one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Moves<'a> {
    pub params: &'a SamplingParams,
    pub prompt: &'a [u32],
    pub output: &'a [u32],
    pub allowed: Option<&'a TokenMask>,
}

impl Moves<'_> {
    /// Whether anything moves the logits. `min_tokens` counts while it holds tokens back
    /// where no grammar has a say: a grammar may take that hold back (see [`holds`]), and
    /// then the entries read come back unmoved.
    pub(super) fn any(&self) -> bool {
        let p = self.params;
        !p.logit_bias.is_empty()
            || p.repetition_penalty != 1.0
            || p.presence_penalty != 0.0
            || p.frequency_penalty != 0.0
            || (self.output.len() < p.min_tokens && !p.held.is_empty())
            || self.allowed.is_some()
    }

    /// The tokens [`move_entries`] may change, sorted, each once, below `vocab`.
    fn touched(&self, vocab: usize) -> Vec<u32> {
        let p = self.params;
        let mut t: Vec<u32> = p.logit_bias.iter().map(|&(t, _)| t).collect();
        if holds(p, self.output, self.allowed, vocab) {
            t.extend(&p.held);
        }
        if p.repetition_penalty != 1.0 {
            t.extend(self.prompt);
        }
        if p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            t.extend(self.output);
        }
        t.retain(|&t| (t as usize) < vocab);
        t.sort_unstable();
        t.dedup();
        t
    }
}

/// Whether `min_tokens` holds its tokens back from a row of `vocab` logits after `output`:
/// until it has that many tokens, unless its grammar (`allowed`) allows only held ones
/// (stop tokens: the grammar is complete, and a sequence that could take no token at all
/// would have no next token).
pub(super) fn holds(
    p: &SamplingParams,
    output: &[u32],
    allowed: Option<&TokenMask>,
    vocab: usize,
) -> bool {
    output.len() < p.min_tokens
        && allowed.is_none_or(|m| {
            (0..vocab as u32).any(|t| m.allows(t) && p.held.binary_search(&t).is_err())
        })
}

/// The logit bias, then `min_tokens`' hold where `hold`, then the penalties (vLLM's
/// order). `prompt` and `output` are the tokens so far.
pub(super) fn move_entries(
    row: &mut (impl Entries + ?Sized),
    p: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    hold: bool,
) {
    for &(t, bias) in &p.logit_bias {
        if let Some(x) = row.at(t) {
            *x += bias;
        }
    }
    if hold {
        for &t in &p.held {
            if let Some(x) = row.at(t) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    penalize(row, p, prompt, output);
}

/// The penalties, in place. `prompt` and `output` are the tokens so far.
pub(super) fn penalize(
    row: &mut (impl Entries + ?Sized),
    p: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
) {
    if p.repetition_penalty != 1.0 {
        let mut seen: Vec<u32> = prompt.iter().chain(output).copied().collect();
        seen.sort_unstable();
        seen.dedup();
        for t in seen {
            if let Some(x) = row.at(t) {
                *x = if *x > 0.0 {
                    *x / p.repetition_penalty
                } else {
                    *x * p.repetition_penalty
                };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, n) in counts {
            if let Some(x) = row.at(t) {
                *x -= p.presence_penalty + p.frequency_penalty * n as f32;
            }
        }
    }
}

/// `logits` `(rows, vocab)` with each row that `moves` names moved as the host's sampler
/// moves a whole row: the entries its moves touch come back, are moved here, and go back
/// in place. None where no row moves.
pub(super) fn moved_in_place(
    logits: &Tensor,
    moves: &[Option<Moves<'_>>],
) -> Result<Option<Tensor>> {
    let (rows, vocab) = logits.dims2()?;
    let touched: Vec<Vec<u32>> = moves
        .iter()
        .map(|m| m.map_or_else(Vec::new, |m| m.touched(vocab)))
        .collect();
    let width = touched.iter().map(Vec::len).max().unwrap_or(0);
    if width == 0 {
        return Ok(None);
    }
    // Each row's tokens, padded to the widest: with a token to read (0), or with an id
    // past every token, which candle's scatter leaves out.
    let padded = |fill: u32| -> Vec<u32> {
        touched
            .iter()
            .flat_map(|t| {
                t.iter()
                    .copied()
                    .chain(std::iter::repeat_n(fill, width - t.len()))
            })
            .collect()
    };
    let device = logits.device();
    let logits = logits.contiguous()?;
    let read = Tensor::from_vec(padded(0), (rows, width), device)?;
    let raw: Vec<Vec<f32>> = logits.gather(&read, 1)?.to_vec2()?;
    let mut moved: Vec<f32> = Vec::with_capacity(rows * width);
    for ((tokens, mut values), m) in touched.iter().zip(raw).zip(moves) {
        if let Some(m) = m {
            let values = &mut values[..tokens.len()];
            let mut row = Sparse { tokens, values };
            let hold = holds(m.params, m.output, m.allowed, vocab);
            move_entries(&mut row, m.params, m.prompt, m.output, hold);
        }
        moved.extend(values);
    }
    let write = Tensor::from_vec(padded(u32::MAX), (rows, width), device)?;
    let moved = Tensor::from_vec(moved, (rows, width), device)?;
    Ok(Some(logits.scatter(&write, &moved, 1)?))
}

/// `logits` `(rows, vocab)` with every token outside each masked row's mask at minus
/// infinity, as [`TokenMask::apply`] sets a whole row: the masked rows' flags go to the
/// device (a byte a token: a quarter of the row's logits), the rows are masked there and
/// put back in place. None where no row is masked.
pub(super) fn masked_in_place(
    logits: &Tensor,
    masks: &[Option<&TokenMask>],
) -> Result<Option<Tensor>> {
    let (_, vocab) = logits.dims2()?;
    let rows: Vec<u32> = (0u32..)
        .zip(masks)
        .filter_map(|(i, m)| m.map(|_| i))
        .collect();
    if rows.is_empty() {
        return Ok(None);
    }
    let mut flags = vec![0u8; rows.len() * vocab];
    for (m, f) in masks.iter().flatten().zip(flags.chunks_exact_mut(vocab)) {
        m.write_flags(f);
    }
    let device = logits.device();
    let shape = (rows.len(), vocab);
    let flags = Tensor::from_vec(flags, shape, device)?;
    let at = Tensor::new(rows.as_slice(), device)?;
    let none = Tensor::full(f32::NEG_INFINITY, shape, device)?.to_dtype(logits.dtype())?;
    let masked = flags.where_cond(&logits.index_select(&at, 0)?, &none)?;
    // Each masked row back where it came from: row `i` of `masked` to row `rows[i]`.
    let to = at
        .reshape((rows.len(), 1))?
        .broadcast_as(shape)?
        .contiguous()?;
    Ok(Some(logits.contiguous()?.scatter(&to, &masked, 0)?))
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::super::rows::{decide_in_place, need, Fetched};
    use super::*;
    use crate::logprobs::Sampled;
    use crate::sampling::{processed, sample, Context, TokenMask};

    /// A row of `vocab` distinct logits, its best at token `best`.
    fn row(vocab: u32, salt: u32, best: u32) -> Vec<f32> {
        (0..vocab)
            .map(|i| {
                let i = (i + vocab - best) % vocab;
                10.0 - ((i * 7919 + salt) % 9001) as f32 / 400.0 - if i == 0 { 0.0 } else { 0.5 }
            })
            .collect()
    }

    /// The entries a row's moves touch, moved alone, are the whole row's moved entries to
    /// the bit; the others do not move.
    #[test]
    fn moving_a_row_s_touched_entries_moves_them_as_the_whole_row() {
        let raw = row(500, 3, 17);
        let p = SamplingParams {
            logit_bias: vec![(4, 2.5), (17, -1.0), (900, 1.0)],
            repetition_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.2,
            min_tokens: 4,
            held: vec![9, 11],
            ..SamplingParams::default()
        };
        let (prompt, output) = ([1, 2, 17, 2, 600], [17, 5, 5]);
        let moves = Moves {
            params: &p,
            prompt: &prompt,
            output: &output,
            allowed: None,
        };
        let whole = processed(&raw, &p, &Context::of(&prompt, &output));
        let tokens = moves.touched(raw.len());
        assert_eq!(tokens, [1, 2, 4, 5, 9, 11, 17]);
        let mut values: Vec<f32> = tokens.iter().map(|&t| raw[t as usize]).collect();
        let mut sparse = Sparse {
            tokens: &tokens,
            values: &mut values,
        };
        let hold = holds(&p, &output, None, raw.len());
        move_entries(&mut sparse, &p, &prompt, &output, hold);
        for (t, (&w, &r)) in whole.iter().zip(&raw).enumerate() {
            match tokens.binary_search(&(t as u32)) {
                Ok(i) => assert_eq!(values[i].to_bits(), w.to_bits(), "token {t}"),
                Err(_) => assert_eq!(w.to_bits(), r.to_bits(), "token {t}"),
            }
        }
    }

    /// The test rows' vocabulary: row `r`'s best is token 41 + r, which its output holds.
    const VOCAB: u32 = 9_000;

    fn tempered(seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        }
    }

    /// Steps 1 to 7 of row `r` decided where it lies with `params[r]`, `tops[r]`
    /// alternatives and mask `masks[r]`: each is what the host's sampler makes of the
    /// whole row, the same token and alternatives, their log-probabilities (the model's
    /// own) within rounding. `check` sees each decided row.
    fn decided_as_the_sampler_decides(
        params: &[SamplingParams],
        tops: &[usize],
        masks: &[Option<TokenMask>],
        check: impl Fn(usize, &Sampled),
    ) {
        let n = params.len() as u32;
        let prompt = [3u32, 8, 8, 41];
        let outputs: Vec<Vec<u32>> = (0..n)
            .map(|r| vec![41 + r, 7, 41 + r, 7, 2, 9, 9, 1])
            .collect();
        let rows: Vec<Vec<f32>> = (0..n).map(|r| row(VOCAB, r, 41 + r)).collect();
        let logits = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        for step in 1..8 {
            let cx = |r: usize| Context::of(&prompt, &outputs[r][..step]).masked(masks[r].as_ref());
            let needs: Vec<_> = (0..params.len())
                .map(|r| need(&params[r], cx(r), tops[r], false))
                .collect();
            let got = decide_in_place(&logits, &needs).unwrap();
            for (r, got) in got.into_iter().enumerate() {
                let want = sample(&rows[r], &params[r], &cx(r), step as u64, tops[r]);
                let Fetched::Decided(s) = got else {
                    panic!("row {r} came back whole");
                };
                assert_eq!(s.token, want.token, "row {r}, step {step}");
                let tokens = |s: &Sampled| s.top.iter().map(|t| t.token).collect::<Vec<_>>();
                assert_eq!(tokens(&s), tokens(&want), "row {r}");
                let logprobs = std::iter::once((s.logprob, want.logprob)).chain(
                    s.top
                        .iter()
                        .zip(&want.top)
                        .map(|(a, b)| (a.logprob, b.logprob)),
                );
                for (a, b) in logprobs {
                    assert!((a - b).abs() < 1e-4, "row {r}: {s:?} {want:?}");
                }
                check(r, &s);
            }
        }
    }

    /// The ops a GPU runs, run here: rows moved by a logit bias, penalties and
    /// `min_tokens`' hold, beside a row nothing moves, then decided where they lie.
    #[test]
    fn moved_rows_decided_in_place_are_the_sampler_s() {
        let params = [
            SamplingParams {
                repetition_penalty: 2.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                logit_bias: vec![(7, 100.0)],
                presence_penalty: 0.5,
                ..SamplingParams::default()
            },
            SamplingParams {
                presence_penalty: 0.5,
                frequency_penalty: 0.3,
                ..tempered(2)
            },
            SamplingParams {
                top_k: 40,
                repetition_penalty: 1.2,
                ..tempered(3)
            },
            SamplingParams {
                min_tokens: 20,
                held: vec![45],
                ..SamplingParams::default()
            },
            tempered(5),
        ];
        let masks = vec![None; params.len()];
        decided_as_the_sampler_decides(&params, &[2, 0, 3, 1, 0, 4], &masks, |r, s| match r {
            // Each row's best is in its output, which the penalties push down.
            0 | 4 => assert_ne!(s.token, 41 + r as u32, "row {r}: the best is moved down"),
            1 => assert_eq!(s.token, 7, "the bias wins"),
            _ => {}
        });
    }

    /// The ops a GPU runs, run here: rows masked by a grammar (greedy, tempered, filtered
    /// and moved besides, `min_tokens` giving way where the mask allows only a held token),
    /// beside a row no grammar masks, decided where they lie.
    #[test]
    fn masked_rows_decided_in_place_are_the_sampler_s() {
        let held = SamplingParams {
            min_tokens: 20,
            held: vec![44, 45],
            ..SamplingParams::default()
        };
        let params = [
            SamplingParams::default(),
            tempered(2),
            SamplingParams {
                top_k: 40,
                top_p: 0.9,
                repetition_penalty: 1.2,
                ..tempered(3)
            },
            held.clone(),
            held,
        ];
        // Row 0's mask leaves out its best, row 1's a third of the vocabulary with its
        // best, row 2's half; row 3's allows only held token 45.
        let masks: Vec<Option<TokenMask>> = [
            Some((0..VOCAB).filter(|&t| t != 41).collect::<Vec<u32>>()),
            Some((0..VOCAB).filter(|t| t % 3 == 1).collect()),
            Some((0..VOCAB).filter(|t| t % 2 == 1).collect()),
            Some(vec![45]),
            None,
        ]
        .into_iter()
        .map(|m| m.map(|ids| TokenMask::of(&ids, VOCAB as usize)))
        .collect();
        decided_as_the_sampler_decides(&params, &[2, 0, 3, 1, 4], &masks, |r, s| match r {
            0 => assert_ne!(s.token, 41, "the best is masked"),
            1 => assert_eq!(s.token % 3, 1, "row 1 keeps to its mask"),
            2 => assert_eq!(s.token % 2, 1, "row 2 keeps to its mask"),
            3 => assert_eq!(s.token, 45, "the hold gives way to the grammar"),
            _ => assert_ne!(s.token, 45, "held back"),
        });
    }
}
