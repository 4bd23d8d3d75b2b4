//! A tempered row's draw decided where its logits lie, nothing filtered: the sums of runs
//! of its vocabulary come back, then the one run the draw lands in, whose tokens the host
//! walks as its sampler walks the whole row.

use candle_core::{DType, Tensor};

use super::rows::{select, shifted};
use crate::error::Result;

/// Tokens in a run of a tempered row's vocabulary: the host gets each run's sum, finds the
/// run the draw lands in, and gets that run alone (about the square root of the
/// vocabularies in use, so that both copies stay small: 2.4 and 4 KB a row at 151,936).
pub(super) const DRAW_RUN: usize = 512;

/// The host sampler's unfiltered draw (`draw_unfiltered`) of each of `rows`, with its
/// `(temperature, u)`: weights `exp((x - max) / t)` in f64, the first token whose running
/// sum passes `u` times their total. The sums of the rows' runs of `DRAW_RUN` tokens come
/// back, then the run each draw lands in, whose tokens the host walks as the sampler does.
pub(super) fn draw_in_place(
    logits: &Tensor,
    rows: &[u32],
    draws: &[(f64, f64)],
) -> Result<Vec<u32>> {
    let Some(picked) = select(logits, rows)? else {
        return Ok(Vec::new());
    };
    let (n, vocab) = picked.dims2()?;
    let runs = vocab.div_ceil(DRAW_RUN);
    let temperatures: Vec<f64> = draws.iter().map(|d| d.0).collect();
    let temperatures = Tensor::from_vec(temperatures, (n, 1), picked.device())?;
    // Padded with zero weights, never drawn, to whole runs.
    let pad = runs * DRAW_RUN - vocab;
    let weights = shifted(&picked)?
        .to_dtype(DType::F64)?
        .broadcast_div(&temperatures)?
        .exp()?
        .pad_with_zeros(1, 0, pad)?
        .reshape((n * runs, DRAW_RUN))?;
    let sums: Vec<Vec<f64>> = weights.sum(1)?.reshape((n, runs))?.to_vec2()?;
    let landed: Vec<Landing> = sums
        .iter()
        .zip(draws)
        .map(|(sums, &(_, u))| Landing::of(sums, u))
        .collect();
    let at: Vec<u32> = landed
        .iter()
        .enumerate()
        .map(|(i, l)| (i * runs + l.run) as u32)
        .collect();
    let at = Tensor::new(at.as_slice(), picked.device())?;
    let run_weights: Vec<Vec<f64>> = weights.index_select(&at, 0)?.to_vec2()?;
    Ok(landed
        .iter()
        .zip(&run_weights)
        .map(|(l, w)| (l.run * DRAW_RUN + l.walk(w)) as u32)
        .collect())
}

/// Where a draw lands among a row's runs: the run, the draw's target (`u` times the
/// weights' total) and the runs' weight before it.
#[derive(Debug, PartialEq)]
struct Landing {
    run: usize,
    target: f64,
    before: f64,
}

impl Landing {
    /// The run whose running sum first passes `u` times the total of `sums`; where
    /// rounding leaves the target at the very top, the last run with any weight.
    fn of(sums: &[f64], u: f64) -> Self {
        let target = u * sums.iter().sum::<f64>();
        let mut before = 0.0;
        for (run, &s) in sums.iter().enumerate() {
            if target < before + s {
                return Self {
                    run,
                    target,
                    before,
                };
            }
            before += s;
        }
        let run = sums.iter().rposition(|&s| s > 0.0).unwrap_or(0);
        let before = sums[..run].iter().sum();
        Self {
            run,
            target,
            before,
        }
    }

    /// The token within the run (its `weights`) whose running sum passes the target;
    /// where rounding leaves it past them all, the last with any weight.
    fn walk(&self, weights: &[f64]) -> usize {
        let mut acc = self.before;
        for (i, &w) in weights.iter().enumerate() {
            acc += w;
            if self.target < acc {
                return i;
            }
        }
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where rounding leaves a draw past every run's sum, it lands in the last run with
    /// weight, at that run's last token with weight: as the host sampler falls back.
    #[test]
    fn a_draw_past_the_total_lands_on_the_last_weighted_token() {
        let landing = Landing::of(&[0.5, 0.25, 0.0], 1.0);
        assert_eq!(landing.run, 1);
        assert_eq!(landing.before, 0.5);
        assert_eq!(landing.walk(&[0.125, 0.125, 0.0]), 1);
        let inside = Landing::of(&[0.5, 0.25, 0.25], 0.6);
        assert_eq!((inside.run, inside.before), (1, 0.5));
        assert_eq!(inside.walk(&[0.0625, 0.0625, 0.125]), 1);
    }
}
