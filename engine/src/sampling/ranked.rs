//! A beam's next tokens: each row's most likely tokens with their log-probabilities,
//! ranked where the logits lie (`best`), so that on a GPU only they come back.

use candle_core::Tensor;

use super::best::alternatives_in_place;
use super::rows::{whole, Normalizers};
use crate::error::Result;
use crate::logprobs::{ranked, TokenLogprob};

/// Each row of `logits` `(rows, vocab)`'s `tops[i]` most likely tokens with their
/// log-probabilities, best first, ties by the lower id (`logprobs::ranked`: a beam's next
/// tokens): on the CPU from the whole rows; elsewhere ranked where they lie, a row whose
/// ties at the last of them reach into them copied back whole.
pub fn fetch_ranked(logits: &Tensor, tops: &[usize]) -> Result<Vec<Vec<TokenLogprob>>> {
    if logits.device().is_cpu() {
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        return Ok(rows.iter().zip(tops).map(|(r, &n)| ranked(r, n)).collect());
    }
    ranked_in_place(logits, tops)
}

/// [`fetch_ranked`] off the CPU.
pub(crate) fn ranked_in_place(logits: &Tensor, tops: &[usize]) -> Result<Vec<Vec<TokenLogprob>>> {
    let rows: Vec<u32> = (0..tops.len() as u32).collect();
    let found = alternatives_in_place(logits, &rows, tops, &Normalizers::of(logits)?)?;
    let unsettled: Vec<u32> = rows
        .into_iter()
        .filter(|&r| found[r as usize].is_none())
        .collect();
    let mut whole = whole(logits, &unsettled)?.into_iter();
    Ok(found
        .into_iter()
        .zip(tops)
        .map(|(found, &n)| {
            found.unwrap_or_else(|| {
                ranked(
                    &whole.next().expect("a whole row for each unsettled one"),
                    n,
                )
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// The ops a GPU runs, run here: each row's best tokens ranked where it lies are the
    /// host's ranking of the whole row (a beam's next tokens), in order with the same
    /// log-probabilities; a row whose ties reach into them comes back whole and is ranked
    /// on the host, ties by the lower id.
    #[test]
    fn rows_ranked_in_place_are_the_host_s_ranking() {
        let vocab = 997;
        let mut rows: Vec<Vec<f32>> = (0..4u32)
            .map(|r| {
                (0..vocab)
                    .map(|i| ((i * 37 + r * 101) % 997) as f32 / 50.0 - 8.0)
                    .collect()
            })
            .collect();
        // Row 4: its best value at 200 tokens, more than the step's best 41 (the most any
        // row asks for, and one past) that are ranked where the rows lie.
        rows.push(
            (0..vocab)
                .map(|i| if i % 5 == 2 { 3.0 } else { 0.0 })
                .collect(),
        );
        let logits = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        let tops = [4, 1, 16, 40, 4];
        let got = ranked_in_place(&logits, &tops).unwrap();
        for ((row, &n), got) in rows.iter().zip(&tops).zip(got) {
            let want = ranked(row, n);
            let tokens = |r: &[TokenLogprob]| r.iter().map(|t| t.token).collect::<Vec<_>>();
            assert_eq!(tokens(&got), tokens(&want));
            for (a, b) in got.iter().zip(&want) {
                assert!((a.logprob - b.logprob).abs() < 1e-4, "{a:?} {b:?}");
            }
        }
        let tied = ranked(&rows[4], 4);
        assert_eq!(
            tied.iter().map(|t| t.token).collect::<Vec<_>>(),
            [2, 7, 12, 17]
        );
    }
}
