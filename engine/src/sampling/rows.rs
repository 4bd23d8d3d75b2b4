//! What of a step's logits comes back to the host. On the CPU every row is there already.
//! On a GPU a row of a large vocabulary is most of a decode step's copy (64 rows of
//! Qwen2's 151,936 logits are 39 MB), so a row is decided where it lies: first moved by
//! its logit bias, `min_tokens`' hold and penalties (`moves`: the entries they touch come
//! back, are moved as the host's sampler moves them, and go back) and masked by its
//! grammar (its mask, made on the host, goes there as a byte a token), then greedy, its
//! argmax; tempered, a draw by the same rule and the same uniform as the host's sampler,
//! of which only sums of runs of the vocabulary and the one run the draw lands in come
//! back (`runs`); filtered by top-k, min-p or top-p, from its best candidates (`best`).
//! Its log-probability and alternatives are the model's own, from the row before its
//! moves.

use candle_core::Tensor;

use super::best::{alternatives_in_place, filtered_in_place, Filtered, BEST_CANDIDATES};
use super::draw::Cuts;
use super::moves::{masked_in_place, moved_in_place, Moves};
use super::runs::draw_in_place;
use super::{uniform, Context, SamplingParams, MAX_TOP_LOGPROBS};
use crate::error::Result;
use crate::logprobs::Sampled;

/// What sampling needs of one row of logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Need<'a> {
    /// The whole row, on the host.
    Whole,
    /// Its token chosen where it lies by `rule`, after its `moves` (a logit bias,
    /// `min_tokens`' hold, penalties, a grammar's mask), with the token's log-probability
    /// and the `top` most likely tokens' (the request's alternatives, at most
    /// [`MAX_TOP_LOGPROBS`]), both of the model's own distribution; from the whole row where
    /// the rule or the alternatives cannot be settled there.
    InPlace {
        rule: Rule,
        top: usize,
        moves: Option<Moves<'a>>,
    },
}

/// How a row's token is chosen where the row lies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// Its argmax.
    Argmax,
    /// A draw from `softmax(logits / temperature)`, nothing filtered, by the uniform `u`
    /// (`sampling::uniform` of the row's seed and step).
    Draw { temperature: f64, u: f64 },
    /// A draw cut by top-k (at most [`BEST_CANDIDATES`]), min-p or top-p, from the row's
    /// best candidates where they settle it.
    Filtered(Filtered),
}

/// One row as [`fetch`] brought it back.
#[derive(Debug, Clone, PartialEq)]
pub enum Fetched {
    Whole(Vec<f32>),
    /// The token chosen where the logits lie, with its log-probability.
    Decided(Sampled),
}

impl Fetched {
    /// The row's token: as decided, or drawn from the whole row by `sample`.
    pub fn or_sample(self, sample: impl FnOnce(&[f32]) -> Sampled) -> Sampled {
        match self {
            Fetched::Decided(s) => s,
            Fetched::Whole(row) => sample(&row),
        }
    }
}

/// What a sequence's next row needs, its tokens so far and its grammar's mask in `cx`,
/// reporting `top_logprobs` alternatives: decided where it lies when top-k keeps at most
/// [`BEST_CANDIDATES`] or the whole vocabulary; the whole row where it keeps more, or
/// where a grammar's mask is still to be made (`unmasked`: the host masks the row after).
pub fn need<'a>(
    p: &'a SamplingParams,
    cx: Context<'a>,
    top_logprobs: usize,
    unmasked: bool,
) -> Need<'a> {
    let in_place = !unmasked && top_logprobs <= MAX_TOP_LOGPROBS;
    let unfiltered = p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0;
    let u = uniform(p.seed, cx.output.len() as u64);
    let rule = match (in_place, p.temperature <= 0.0) {
        (false, _) => return Need::Whole,
        (true, true) => Rule::Argmax,
        (true, false) if unfiltered => Rule::Draw {
            temperature: p.temperature as f64,
            u,
        },
        (true, false) if p.top_k <= BEST_CANDIDATES => Rule::Filtered(Filtered {
            top_k: p.top_k,
            cuts: Cuts::of(p),
            u,
        }),
        (true, false) => return Need::Whole,
    };
    let moves = Moves {
        params: p,
        prompt: cx.prompt,
        output: cx.output,
        allowed: cx.allowed,
    };
    Need::InPlace {
        rule,
        top: top_logprobs,
        moves: moves.any().then_some(moves),
    }
}

/// The rows of `logits` `(rows, vocab)`, each as `needs` says: on the CPU all whole (the
/// sampler then decides every row as it always has); elsewhere the rows that can be
/// decided where they lie are.
pub fn fetch(logits: &Tensor, needs: &[Need<'_>]) -> Result<Vec<Fetched>> {
    if logits.device().is_cpu() || needs.iter().all(|n| matches!(n, Need::Whole)) {
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        return Ok(rows.into_iter().map(Fetched::Whole).collect());
    }
    decide_in_place(logits, needs)
}

/// [`fetch`] off the CPU: the rows that move moved and masked where they lie; the argmax
/// rows, the draws and the filtered draws decided in a few ops over all of them, then the
/// alternatives of those that report them; the whole rows, and those whose rule or
/// alternatives could not be settled where they lie, copied as they are.
pub(crate) fn decide_in_place(logits: &Tensor, needs: &[Need<'_>]) -> Result<Vec<Fetched>> {
    // The model's own distribution, found once for the step: every log-probability
    // reported, the decided tokens' and the alternatives', is of the rows before their
    // moves. (The few whole rows are in it too: leaving them out would copy the rest.)
    let norms = Normalizers::of(logits)?;
    let moves: Vec<Option<Moves<'_>>> = needs
        .iter()
        .map(|n| match *n {
            Need::InPlace { moves, .. } => moves,
            Need::Whole => None,
        })
        .collect();
    let moved = moved_in_place(logits, &moves)?;
    let masks: Vec<_> = moves.iter().map(|m| m.and_then(|m| m.allowed)).collect();
    let masked = masked_in_place(moved.as_ref().unwrap_or(logits), &masks)?;
    let processed = masked.as_ref().or(moved.as_ref()).unwrap_or(logits);
    let tokens = decide_rules(processed, needs)?;
    let mut decided = with_logprobs(logits, &tokens, &norms)?;
    add_alternatives(logits, needs, &norms, &mut decided)?;
    let whole_rows: Vec<u32> = (0..needs.len() as u32)
        .filter(|&i| decided[i as usize].is_none())
        .collect();
    let mut whole = whole(logits, &whole_rows)?.into_iter();
    Ok(decided
        .into_iter()
        .map(|d| match d {
            Some(s) => Fetched::Decided(s),
            None => Fetched::Whole(whole.next().expect("a whole row for every undecided one")),
        })
        .collect())
}

/// Each row's token by its rule, from `logits`; None for the whole rows and the filtered
/// ones their best candidates did not settle.
fn decide_rules(logits: &Tensor, needs: &[Need<'_>]) -> Result<Vec<Option<u32>>> {
    let mut argmax_rows: Vec<u32> = Vec::new();
    let (mut draw_rows, mut draws): (Vec<u32>, Vec<(f64, f64)>) = (Vec::new(), Vec::new());
    let (mut filtered_rows, mut filters): (Vec<u32>, Vec<Filtered>) = (Vec::new(), Vec::new());
    for (i, n) in (0u32..).zip(needs) {
        match *n {
            Need::InPlace { rule, .. } => match rule {
                Rule::Argmax => argmax_rows.push(i),
                Rule::Draw { temperature, u } => {
                    draw_rows.push(i);
                    draws.push((temperature, u));
                }
                Rule::Filtered(f) => {
                    filtered_rows.push(i);
                    filters.push(f);
                }
            },
            Need::Whole => {}
        }
    }
    let mut decided: Vec<Option<u32>> = vec![None; needs.len()];
    let mut place = |rows: &[u32], got: Vec<Option<u32>>| {
        for (&r, t) in rows.iter().zip(got) {
            decided[r as usize] = t;
        }
    };
    let some = |got: Vec<u32>| got.into_iter().map(Some).collect();
    place(&argmax_rows, some(argmax_in_place(logits, &argmax_rows)?));
    place(&draw_rows, some(draw_in_place(logits, &draw_rows, &draws)?));
    place(
        &filtered_rows,
        filtered_in_place(logits, &filtered_rows, &filters)?,
    );
    Ok(decided)
}

/// Each decided token of `tokens` (row `r`'s, or None) with its log-probability under the
/// rows of `logits` `norms` normalizes: the chosen logits alone come back, one a row.
fn with_logprobs(
    logits: &Tensor,
    tokens: &[Option<u32>],
    norms: &Normalizers,
) -> Result<Vec<Option<Sampled>>> {
    let vocab = logits.dim(1)? as u32;
    let at: Vec<u32> = (0u32..)
        .zip(tokens)
        .filter_map(|(r, t)| t.map(|t| r * vocab + t))
        .collect();
    if at.is_empty() {
        return Ok(vec![None; tokens.len()]);
    }
    let at = Tensor::new(at.as_slice(), logits.device())?;
    let chosen: Vec<f32> = logits.flatten_all()?.index_select(&at, 0)?.to_vec1()?;
    let mut chosen = chosen.into_iter();
    Ok(tokens
        .iter()
        .enumerate()
        .map(|(r, t)| {
            t.map(|token| Sampled {
                token,
                logprob: norms.logprob(r, chosen.next().expect("a logit for every token")),
                top: Vec::new(),
            })
        })
        .collect())
}

/// The alternatives of each decided row that reports them, found where the rows lie; a
/// row whose alternatives cannot be settled there is undecided again.
fn add_alternatives(
    logits: &Tensor,
    needs: &[Need<'_>],
    norms: &Normalizers,
    decided: &mut [Option<Sampled>],
) -> Result<()> {
    let (rows, tops): (Vec<u32>, Vec<usize>) = (0..needs.len() as u32)
        .zip(needs)
        .filter_map(|(i, n)| match *n {
            Need::InPlace { top, .. } if top > 0 && decided[i as usize].is_some() => Some((i, top)),
            _ => None,
        })
        .unzip();
    let found = alternatives_in_place(logits, &rows, &tops, norms)?;
    for (&r, alternatives) in rows.iter().zip(found) {
        let row = &mut decided[r as usize];
        match alternatives {
            Some(top) => row.iter_mut().for_each(|s| s.top = top.clone()),
            None => *row = None,
        }
    }
    Ok(())
}

/// Rows `rows` of `logits`, or None where there are none.
pub(super) fn select(logits: &Tensor, rows: &[u32]) -> Result<Option<Tensor>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let at = Tensor::new(rows, logits.device())?;
    Ok(Some(logits.index_select(&at, 0)?))
}

/// Rows `rows` of `logits`, copied to the host whole.
pub(super) fn whole(logits: &Tensor, rows: &[u32]) -> Result<Vec<Vec<f32>>> {
    Ok(select(logits, rows)?
        .map(|t| t.to_vec2::<f32>())
        .transpose()?
        .unwrap_or_default())
}

/// Each of `rows`' argmax. Ties go to the argmax op's choice.
fn argmax_in_place(logits: &Tensor, rows: &[u32]) -> Result<Vec<u32>> {
    let Some(picked) = select(logits, rows)? else {
        return Ok(Vec::new());
    };
    Ok(picked.argmax_keepdim(1)?.flatten_all()?.to_vec1()?)
}

/// Rows `(rows, vocab)` less each row's max: the tempered weights' exponents before the
/// temperature.
pub(super) fn shifted(rows: &Tensor) -> Result<Tensor> {
    Ok(rows.broadcast_sub(&rows.max_keepdim(1)?)?)
}

/// Each row's max and log-normalizer less it (`ln Σ exp(x - max)`), brought to the host:
/// what log-probabilities are reported from.
pub(super) struct Normalizers {
    max: Vec<f32>,
    spread: Vec<f32>,
}

impl Normalizers {
    /// Of each row of `rows` `(rows, vocab)`, computed where they lie.
    pub(super) fn of(rows: &Tensor) -> Result<Self> {
        let max = rows.max_keepdim(1)?;
        let spread = rows.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()?;
        Ok(Self {
            max: max.flatten_all()?.to_vec1()?,
            spread: spread.flatten_all()?.to_vec1()?,
        })
    }

    /// The log-probability of logit `x` of row `i`: `x - max - spread`.
    pub(super) fn logprob(&self, i: usize, x: f32) -> f32 {
        x - self.max[i] - self.spread[i]
    }
}

/// Step `step`'s need of a sequence with no prompt and `step` tokens of output, for tests.
#[cfg(test)]
pub(super) fn need_at(p: &SamplingParams, step: usize, top: usize, unmasked: bool) -> Need<'_> {
    static OUTPUT: [u32; 64] = [0; 64];
    need(p, Context::of(&[], &OUTPUT[..step]), top, unmasked)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::super::runs::DRAW_RUN;
    use super::*;
    use crate::sampling::{sample, Context, TokenMask};

    fn greedy() -> SamplingParams {
        SamplingParams::default()
    }

    const ARGMAX: Need = Need::InPlace {
        rule: Rule::Argmax,
        top: 0,
        moves: None,
    };

    #[test]
    fn a_row_is_decided_where_it_lies_unless_its_grammar_s_mask_is_still_to_be_made() {
        assert_eq!(need_at(&greedy(), 0, 0, false), ARGMAX);
        let moved = |p: &SamplingParams, step: usize| match need_at(p, step, 0, false) {
            Need::InPlace { moves, .. } => moves.map(|m| (m.params.clone(), m.output.len())),
            Need::Whole => panic!("{p:?} came back whole"),
        };
        for p in [
            SamplingParams {
                logit_bias: vec![(3, 1.0)],
                ..greedy()
            },
            SamplingParams {
                repetition_penalty: 1.1,
                ..greedy()
            },
            SamplingParams {
                presence_penalty: 0.5,
                ..greedy()
            },
            SamplingParams {
                frequency_penalty: 0.5,
                ..greedy()
            },
        ] {
            assert_eq!(moved(&p, 5), Some((p.clone(), 5)));
        }
        let held = SamplingParams {
            min_tokens: 3,
            held: vec![2],
            ..greedy()
        };
        assert_eq!(moved(&held, 2), Some((held.clone(), 2)), "held back");
        assert_eq!(need_at(&held, 3, 0, false), ARGMAX, "no longer held");
        assert_eq!(
            need_at(&greedy(), 0, 2, false),
            Need::InPlace {
                rule: Rule::Argmax,
                top: 2,
                moves: None,
            },
            "alternatives"
        );
        let greedy = greedy();
        let many = need_at(&greedy, 0, MAX_TOP_LOGPROBS + 1, false);
        assert_eq!(
            many,
            Need::Whole,
            "more alternatives than a request may ask"
        );
        assert_eq!(need_at(&greedy, 0, 0, true), Need::Whole, "a mask to make");
        let mask = TokenMask::of(&[3, 5], 10);
        let masked = need(&greedy, Context::default().masked(Some(&mask)), 0, false);
        let Need::InPlace {
            rule: Rule::Argmax,
            moves: Some(moves),
            ..
        } = masked
        else {
            panic!("{masked:?}");
        };
        assert_eq!(moves.allowed, Some(&mask), "the mask goes with the row");
    }

    #[test]
    fn a_tempered_row_is_drawn_where_it_lies_filtered_or_not() {
        let tempered = SamplingParams {
            temperature: 0.7,
            seed: 11,
            ..greedy()
        };
        let u = uniform(11, 4);
        assert_eq!(
            need_at(&tempered, 4, 0, false),
            Need::InPlace {
                rule: Rule::Draw {
                    temperature: 0.7f32 as f64,
                    u
                },
                top: 0,
                moves: None,
            }
        );
        let cuts = |min_p: f32, top_p: f32| Cuts {
            temperature: 0.7f32 as f64,
            min_p,
            top_p,
        };
        for (p, top_k, want) in [
            (
                SamplingParams {
                    top_k: 40,
                    ..tempered.clone()
                },
                40,
                cuts(0.0, 1.0),
            ),
            (
                SamplingParams {
                    top_p: 0.9,
                    ..tempered.clone()
                },
                0,
                cuts(0.0, 0.9),
            ),
            (
                SamplingParams {
                    min_p: 0.05,
                    ..tempered.clone()
                },
                0,
                cuts(0.05, 1.0),
            ),
        ] {
            let filtered = Rule::Filtered(Filtered {
                top_k,
                cuts: want,
                u,
            });
            let want = Need::InPlace {
                rule: filtered,
                top: 3,
                moves: None,
            };
            assert_eq!(need_at(&p, 4, 3, false), want, "{p:?}");
        }
        let wide = SamplingParams {
            top_k: BEST_CANDIDATES + 1,
            ..tempered.clone()
        };
        assert_eq!(need_at(&wide, 4, 0, false), Need::Whole);
        assert_eq!(
            need_at(&tempered, 4, 0, true),
            Need::Whole,
            "a mask to make"
        );
    }

    /// The ops a GPU runs, run here: each tempered row drawn where it lies gets the token
    /// the host's sampler draws from the whole row with the same seed and step, over a
    /// vocabulary of two runs and a part, at three temperatures and many draws.
    #[test]
    fn rows_drawn_in_place_are_the_sampler_s_draws() {
        let vocab = 1100u32;
        let rows: Vec<Vec<f32>> = (0..6u32)
            .map(|r| {
                (0..vocab)
                    .map(|i| ((i * 37 + r * 101) % 997) as f32 / 120.0 - 4.0)
                    .collect()
            })
            .collect();
        let logits = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        let mut distinct = std::collections::HashSet::new();
        for step in 0..40u64 {
            let params: Vec<SamplingParams> = (0..rows.len())
                .map(|r| SamplingParams {
                    temperature: [0.5, 1.0, 1.5][r % 3],
                    seed: 1000 + r as u64,
                    ..greedy()
                })
                .collect();
            let mut needs: Vec<Need> = params
                .iter()
                .map(|p| need_at(p, step as usize, 0, false))
                .collect();
            needs[1] = Need::Whole;
            needs[4] = ARGMAX;
            let got = decide_in_place(&logits, &needs).unwrap();
            for (r, got) in got.into_iter().enumerate() {
                let p = if needs[r] == ARGMAX {
                    greedy()
                } else {
                    params[r].clone()
                };
                let want = sample(&rows[r], &p, &Context::default(), step, 0);
                match got {
                    Fetched::Whole(row) => assert_eq!((r, row), (1, rows[1].clone())),
                    Fetched::Decided(s) => {
                        assert_eq!(s.token, want.token, "row {r}, step {step}");
                        assert!((s.logprob - want.logprob).abs() < 1e-4, "{s:?} {want:?}");
                        distinct.insert(s.token);
                    }
                }
            }
        }
        // The draws spread over the vocabulary, past the first run.
        assert!(
            distinct.iter().any(|&t| t as usize >= DRAW_RUN),
            "{distinct:?}"
        );
        assert!(distinct.len() > 50, "{}", distinct.len());
    }

    /// The ops a GPU runs, run here: each decided row is what the host's sampler makes of
    /// the whole row, the whole rows come back as they are, in the rows' order.
    #[test]
    fn rows_decided_in_place_are_the_sampler_s_greedy_choice() {
        let vocab = 997;
        let rows: Vec<Vec<f32>> = (0..5u32)
            .map(|r| {
                (0..vocab)
                    .map(|i| ((i * 37 + r * 101) % 997) as f32 / 50.0 - 8.0)
                    .collect()
            })
            .collect();
        let logits = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        let needs = [ARGMAX, Need::Whole, ARGMAX, ARGMAX, Need::Whole];
        let got = decide_in_place(&logits, &needs).unwrap();
        for ((row, need), got) in rows.iter().zip(needs).zip(got) {
            match (need, got) {
                (Need::Whole, Fetched::Whole(r)) => assert_eq!(&r, row),
                (ARGMAX, Fetched::Decided(s)) => {
                    let want = sample(row, &greedy(), &Context::default(), 0, 0);
                    assert_eq!(s.token, want.token);
                    assert!((s.logprob - want.logprob).abs() < 1e-4, "{s:?} {want:?}");
                    assert!(s.top.is_empty());
                }
                (need, got) => panic!("{need:?} came back as {got:?}"),
            }
        }
        let all_whole = fetch(&logits, &needs).unwrap();
        assert!(all_whole.iter().all(|f| matches!(f, Fetched::Whole(_))));
    }
}
