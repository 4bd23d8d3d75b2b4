//! A filtered row's draw (top-k, min-p, top-p) decided where its logits lie: the row's best
//! candidates are ranked there and come back, rather than the whole row.
//!
//! A row's best `n` are found by candle's sort, whose CUDA kernel ranks a row in one
//! block's shared memory: the vocabulary is cut into runs of [`SORT_RUN`], each run's best
//! `n` kept, and the survivors ranked the same way until one run holds them all (three
//! rounds at Qwen2's 151,936 tokens). The host then settles the draw from them exactly as
//! the sampler does from the whole row, or, where they cannot settle it, gets the row.

use candle_core::{DType, Tensor};

use super::draw::{draw_ranked, kept, Cuts, Ranked};
use super::rows::{select, shifted, Normalizers};
use crate::error::Result;
use crate::logprobs::TokenLogprob;

/// The most candidates a filtered row is decided from where it lies: top-k up to this
/// many, and min-p or top-p without top-k where the best this many settle the draw.
pub const BEST_CANDIDATES: usize = 256;

/// Columns one sort ranks: candle's CUDA sort takes four bytes of shared memory a column
/// (48 KB a block without opting in to more).
const SORT_RUN: usize = 4096;

/// A draw cut by top-k, min-p or top-p, with the uniform `u` it takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Filtered {
    /// 0 keeps the whole vocabulary; at most [`BEST_CANDIDATES`] otherwise.
    pub top_k: usize,
    pub cuts: Cuts,
    pub u: f64,
}

/// Each of `rows`' draw by its filter, or None where the row's best candidates do not
/// settle it (ties at the last of them reaching into top-k's set; min-p or top-p keeping
/// more than [`BEST_CANDIDATES`]).
pub(super) fn filtered_in_place(
    logits: &Tensor,
    rows: &[u32],
    filters: &[Filtered],
) -> Result<Vec<Option<u32>>> {
    let Some(picked) = select(logits, rows)? else {
        return Ok(Vec::new());
    };
    let (n, vocab) = picked.dims2()?;
    let keeps: Vec<usize> = filters.iter().map(|f| kept(f.top_k, vocab)).collect();
    // One past each row's cut, so that a tie across it shows.
    let wanted = keeps.iter().map(|&k| k.min(BEST_CANDIDATES) + 1).max();
    let (values, ids) = best(&picked, wanted.unwrap_or(1).min(vocab))?;
    let temperatures: Vec<f64> = filters.iter().map(|f| f.cuts.temperature).collect();
    let temperatures = Tensor::from_vec(temperatures, (n, 1), picked.device())?;
    let totals: Vec<f64> = shifted(&picked)?
        .to_dtype(DType::F64)?
        .broadcast_div(&temperatures)?
        .exp()?
        .sum(1)?
        .to_vec1()?;
    let values: Vec<Vec<f32>> = values.to_vec2()?;
    let ids: Vec<Vec<u32>> = ids.to_vec2()?;
    Ok((0..n)
        .map(|i| {
            let (cand, ranked) = settled(&values[i], &ids[i], keeps[i], vocab, totals[i])?;
            let f = &filters[i];
            draw_ranked(cand, ranked, &f.cuts, f.u)
        })
        .collect())
}

/// Each of `rows`' `tops` most likely tokens with their log-probabilities, best first and
/// ties by the lower id (as the host's sampler reports them), or None where ties at the
/// last of the row's best reach into them. `norms` normalizes the rows of `logits`.
pub(super) fn alternatives_in_place(
    logits: &Tensor,
    rows: &[u32],
    tops: &[usize],
    norms: &Normalizers,
) -> Result<Vec<Option<Vec<TokenLogprob>>>> {
    let Some(picked) = select(logits, rows)? else {
        return Ok(Vec::new());
    };
    let vocab = picked.dim(1)?;
    let wanted = tops.iter().max().map_or(1, |&t| t + 1).min(vocab);
    let (values, ids) = best(&picked, wanted)?;
    let values: Vec<Vec<f32>> = values.to_vec2()?;
    let ids: Vec<Vec<u32>> = ids.to_vec2()?;
    Ok((0..rows.len())
        .map(|i| {
            let (mut top, _) = settled(&values[i], &ids[i], tops[i].min(vocab), vocab, 0.0)?;
            top.truncate(tops[i]);
            for t in &mut top {
                t.logprob = norms.logprob(rows[i] as usize, t.logprob);
            }
            Some(top)
        })
        .collect())
}

/// Each row's best `n` values of `rows` `(rows, vocab)`, best first, and their ids: two
/// `(rows, n)` tensors. Of values that tie, which come first (and which make the `n`) is
/// the sort's choice.
pub(super) fn best(rows: &Tensor, n: usize) -> Result<(Tensor, Tensor)> {
    let (count, vocab) = rows.dims2()?;
    assert!(
        (1..SORT_RUN).contains(&n) && n <= vocab,
        "{n} of {vocab} values"
    );
    let device = rows.device();
    let mut values = rows.contiguous()?;
    // None while each value's id is its column: the first round's ids come from the
    // sort's places, without a vocabulary of ids sent to the device each step.
    let mut ids: Option<Tensor> = None;
    loop {
        let width = values.dim(1)?;
        let runs = width.div_ceil(SORT_RUN);
        let run = width.min(SORT_RUN);
        let pad = runs * run - width;
        // Padding ranks last: below every value, an id past every token.
        let padded = |t: &Tensor, fill: Tensor| -> Result<Tensor> {
            let t = if pad == 0 {
                t.clone()
            } else {
                Tensor::cat(&[t, &fill.broadcast_as((count, pad))?], 1)?
            };
            Ok(t.reshape((count * runs, run))?)
        };
        let v = padded(&values, Tensor::new(&[f32::NEG_INFINITY], device)?)?;
        let keep = n.min(run);
        let order = v
            .arg_sort_last_dim(false)?
            .narrow(1, 0, keep)?
            .contiguous()?;
        let kept = match &ids {
            // A place in run `r` of a row is column `r * run` plus the place.
            None => {
                let firsts: Vec<u32> = (0..count * runs)
                    .map(|i| ((i % runs) * run) as u32)
                    .collect();
                let firsts = Tensor::from_vec(firsts, (count * runs, 1), device)?;
                order.broadcast_add(&firsts)?
            }
            Some(ids) => padded(ids, Tensor::new(&[u32::MAX], device)?)?.gather(&order, 1)?,
        };
        values = v.gather(&order, 1)?.reshape((count, runs * keep))?;
        let kept = kept.reshape((count, runs * keep))?;
        if runs == 1 {
            return Ok((values, kept));
        }
        ids = Some(kept);
    }
}

/// The candidates a row's best `values` (ids `ids`, best first, one more than the row's
/// cut takes where the row is longer) settle, ranked as the host's sampler ranks them, and
/// what they are of the tokens top-k keeps (`keep` of `vocab`). `total` is the row's
/// tempered weights' total.
///
/// The values above the last one are exactly the row's values above it, whichever way
/// the sort took ties, so they are taken and ranked again here; the last one's ties stay
/// out unless the values are the whole row. None where fewer than top-k's `keep` are
/// left: a tie at the last value reaches into top-k's set.
pub(super) fn settled(
    values: &[f32],
    ids: &[u32],
    keep: usize,
    vocab: usize,
    total: f64,
) -> Option<(Vec<TokenLogprob>, Ranked)> {
    if values.iter().any(|v| v.is_nan()) {
        return None;
    }
    let last = *values.last()?;
    let whole_row = values.len() == vocab;
    let mut cand: Vec<TokenLogprob> = values
        .iter()
        .zip(ids)
        .filter(|(&v, _)| whole_row || v > last)
        .map(|(&logprob, &token)| TokenLogprob { token, logprob })
        .collect();
    cand.sort_by(|a, b| b.logprob.total_cmp(&a.logprob).then(a.token.cmp(&b.token)));
    if keep < vocab {
        if cand.len() < keep {
            return None;
        }
        cand.truncate(keep);
        Some((cand, Ranked::All))
    } else if whole_row {
        Some((cand, Ranked::All))
    } else {
        Some((cand, Ranked::Best { total }))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::super::rows::{decide_in_place, need_at, Fetched, Need, Rule};
    use super::*;
    use crate::logprobs::top_n;
    use crate::sampling::{sample, Context, SamplingParams};

    /// Row `r` of `vocab` distinct logits, from 20 down in steps of 1/40, in an order of
    /// their own.
    fn distinct(r: u32, vocab: u32) -> Vec<f32> {
        // 7919 is prime to 9001, and 9001 to 70_001: each row a permutation.
        let m = if vocab <= 9001 { 9001 } else { 70_001 };
        (0..vocab)
            .map(|i| 20.0 - ((i * 7919 + r * 101) % m) as f32 / 40.0)
            .collect()
    }

    /// Over runs and rounds of the sort (three at 70,000 tokens, two at 9,000), each
    /// row's best are the host's `top_n`: the same values in order, each id a token of its
    /// value, no id twice. One row's values tie in nines.
    #[test]
    fn the_best_of_a_row_are_its_top_values_over_every_round() {
        for (vocab, n) in [(70_000u32, 257), (9_000, 41), (9_000, 1), (300, 300)] {
            let mut rows: Vec<Vec<f32>> = (0..2).map(|r| distinct(r, vocab)).collect();
            rows.push((0..vocab).map(|i| ((i * 37) % 997) as f32 / 8.0).collect());
            let t = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
            let (values, ids) = best(&t, n).unwrap();
            let values: Vec<Vec<f32>> = values.to_vec2().unwrap();
            let ids: Vec<Vec<u32>> = ids.to_vec2().unwrap();
            for ((row, v), i) in rows.iter().zip(&values).zip(&ids) {
                let want: Vec<f32> = top_n(row, n).iter().map(|c| c.logprob).collect();
                assert_eq!(v, &want, "{vocab} {n}");
                assert!(i.iter().zip(v).all(|(&i, &v)| row[i as usize] == v));
                let unique: std::collections::HashSet<_> = i.iter().collect();
                assert_eq!(unique.len(), n);
            }
        }
    }

    fn cand(values: &[(u32, f32)]) -> (Vec<f32>, Vec<u32>) {
        values.iter().map(|&(t, v)| (v, t)).unzip()
    }

    /// Top-k's set is taken only where the ties at the last value leave it whole; ties
    /// inside it are ranked by the lower id; without top-k the best are a prefix of the
    /// row, with its total.
    #[test]
    fn the_best_settle_top_k_only_where_the_last_value_s_ties_leave_it_whole() {
        let (v, i) = cand(&[(9, 3.0), (4, 2.0), (2, 2.0), (7, 1.0)]);
        let (got, ranked) = settled(&v, &i, 3, 100, 5.0).unwrap();
        let tokens: Vec<u32> = got.iter().map(|c| c.token).collect();
        assert_eq!((tokens, ranked), (vec![9, 2, 4], Ranked::All));
        let (v, i) = cand(&[(9, 3.0), (4, 2.0), (2, 1.0), (7, 1.0)]);
        assert_eq!(settled(&v, &i, 3, 100, 5.0), None, "a tie into the set");
        let (got, _) = settled(&v, &i, 1, 100, 5.0).unwrap();
        assert_eq!(got[0].token, 9);
        let (got, ranked) = settled(&v, &i, 100, 100, 5.0).unwrap();
        assert_eq!(got.len(), 2, "the last value's ties stay out");
        assert_eq!(ranked, Ranked::Best { total: 5.0 });
        let (got, ranked) = settled(&v, &i, 3, 4, 5.0).unwrap();
        assert_eq!((got.len(), ranked), (3, Ranked::All), "the whole row");
        assert_eq!(got[2].token, 2, "a tie in a whole row: the lower id");
        let (v, i) = cand(&[(9, 3.0), (4, f32::NAN), (7, 1.0)]);
        assert_eq!(settled(&v, &i, 2, 100, 5.0), None);
    }

    /// The ops a GPU runs, run here: each filtered row decided where it lies gets the token
    /// the host's sampler draws from the whole row with the same seed and step, ties in
    /// top-k's set among them; the rows their best candidates cannot settle (a tie across
    /// all of them, a top-p past them) come back whole.
    #[test]
    fn filtered_rows_decided_in_place_are_the_sampler_s_draws() {
        let vocab = 9_000;
        let tempered = |temperature: f32, seed: u64| SamplingParams {
            temperature,
            seed,
            ..SamplingParams::default()
        };
        let params = [
            SamplingParams {
                top_k: 40,
                ..tempered(1.0, 1)
            },
            SamplingParams {
                top_k: 1,
                ..tempered(0.7, 2)
            },
            SamplingParams {
                min_p: 0.05,
                ..tempered(0.7, 3)
            },
            SamplingParams {
                top_p: 0.9,
                ..tempered(1.3, 4)
            },
            SamplingParams {
                top_k: 200,
                top_p: 0.95,
                min_p: 0.02,
                ..tempered(2.0, 5)
            },
            SamplingParams {
                top_p: 0.999_999_9,
                ..tempered(1.0, 6)
            },
            SamplingParams {
                top_k: 20,
                ..tempered(1.0, 7)
            },
        ];
        let mut rows: Vec<Vec<f32>> = (0..5).map(|r| distinct(r, vocab)).collect();
        // Nine tokens a value: top-k's cut at 40 splits a tie, but the best hold it all.
        rows[0] = (0..vocab).map(|i| ((i * 37) % 997) as f32 / 8.0).collect();
        rows.push(distinct(5, vocab));
        // A third of the vocabulary ties for the best.
        rows.push(
            (0..vocab)
                .map(|i| if i % 3 == 0 { 1.0 } else { -(i as f32) })
                .collect(),
        );
        let logits = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        let mut drawn = vec![std::collections::HashSet::new(); rows.len()];
        for step in 0..40u64 {
            let needs: Vec<Need> = params
                .iter()
                .map(|p| need_at(p, step as usize, 0, false))
                .collect();
            let filtered = |n: &Need| {
                matches!(
                    n,
                    Need::InPlace {
                        rule: Rule::Filtered(_),
                        ..
                    }
                )
            };
            assert!(needs.iter().all(filtered));
            for (r, got) in decide_in_place(&logits, &needs)
                .unwrap()
                .into_iter()
                .enumerate()
            {
                let want = sample(&rows[r], &params[r], &Context::default(), step, 0);
                match got {
                    Fetched::Decided(s) => {
                        assert!(r < 5, "row {r} was decided");
                        assert_eq!(s.token, want.token, "row {r}, step {step}");
                        assert!((s.logprob - want.logprob).abs() < 1e-4, "{s:?} {want:?}");
                        drawn[r].insert(s.token);
                    }
                    Fetched::Whole(row) => {
                        assert!(r >= 5, "row {r} came back whole");
                        assert_eq!(row, rows[r]);
                    }
                }
            }
        }
        // A row alone: its best are one more than its top-k, as few as there can be.
        for step in 0..4 {
            let alone = [need_at(&params[1], step, 0, false)];
            let got = decide_in_place(&logits.narrow(0, 1, 1).unwrap(), &alone).unwrap();
            let want = sample(&rows[1], &params[1], &Context::default(), step as u64, 0);
            assert!(matches!(&got[0], Fetched::Decided(s) if s.token == want.token));
        }
        let spread: Vec<usize> = drawn.iter().map(|d| d.len()).collect();
        assert!(
            spread[0] > 10 && spread[1] == 1 && spread[4] > 10,
            "{spread:?}"
        );
    }

    /// The ops a GPU runs, run here: the alternatives of a row decided where it lies are
    /// the host sampler's (the same tokens, ties by the lower id, the same log-probabilities
    /// within f32's rounding), whatever chose its token and whichever rows report them; a
    /// row whose best tie past the alternatives it reports comes back whole.
    #[test]
    fn alternatives_found_in_place_are_the_sampler_s() {
        let vocab = 9_000;
        let mut rows: Vec<Vec<f32>> = (0..3).map(|r| distinct(r, vocab)).collect();
        // Ties in nines: the alternatives take the lower ids of a tie.
        rows.push((0..vocab).map(|i| ((i * 37) % 997) as f32 / 8.0).collect());
        rows.push(
            (0..vocab)
                .map(|i| if i % 3 == 0 { 1.0 } else { -(i as f32) })
                .collect(),
        );
        let params = [
            SamplingParams::default(),
            SamplingParams {
                temperature: 1.0,
                seed: 3,
                ..SamplingParams::default()
            },
            SamplingParams {
                temperature: 1.0,
                top_k: 30,
                seed: 4,
                ..SamplingParams::default()
            },
            SamplingParams::default(),
            SamplingParams::default(),
        ];
        // The first row reports none: the others' alternatives are then not the step's
        // first rows, and each must be normalized by its own row's sum.
        let tops = [0, 1, 20, 5, 3];
        let logits = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        for step in 0..8 {
            let needs: Vec<Need> = (0..rows.len())
                .map(|r| need_at(&params[r], step, tops[r], false))
                .collect();
            let got = decide_in_place(&logits, &needs).unwrap();
            for (r, got) in got.into_iter().enumerate() {
                let want = sample(
                    &rows[r],
                    &params[r],
                    &Context::default(),
                    step as u64,
                    tops[r],
                );
                match got {
                    Fetched::Decided(s) => {
                        assert!(r < 4, "row {r} was decided");
                        assert_eq!(s.token, want.token);
                        let tokens = |top: &[TokenLogprob]| -> Vec<u32> {
                            top.iter().map(|t| t.token).collect()
                        };
                        assert_eq!(tokens(&s.top), tokens(&want.top), "row {r}");
                        for (a, b) in s.top.iter().zip(&want.top) {
                            assert!((a.logprob - b.logprob).abs() < 1e-4, "{a:?} {b:?}");
                        }
                    }
                    Fetched::Whole(row) => {
                        assert_eq!(r, 4, "row {r} came back whole");
                        assert_eq!(row, rows[r]);
                    }
                }
            }
        }
    }
}
