//! What of a step's logits comes back to the host. On the CPU every row is there already.
//! On a GPU a row of a large vocabulary is most of a decode step's copy (64 rows of
//! Qwen2's 151,936 logits are 39 MB), so a row whose token is its raw logits' argmax and
//! which reports nothing else is decided where it lies: only its token and that token's
//! log-probability come back.

use candle_core::Tensor;

use super::SamplingParams;
use crate::error::Result;
use crate::logprobs::Sampled;

/// What sampling needs of one row of logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The whole row, on the host.
    Whole,
    /// Only its argmax and the argmax's log-probability.
    Argmax,
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

/// What a sequence's next row needs: only its argmax when it is greedy and nothing moves
/// its logits before the argmax (a logit bias, a penalty, `min_tokens`' hold, a grammar)
/// or reads more of the row (alternatives' logprobs); else the whole row.
pub fn need(p: &SamplingParams, generated: usize, top_logprobs: usize, grammar: bool) -> Need {
    let holds = generated < p.min_tokens && !p.held.is_empty();
    let plain = p.temperature <= 0.0
        && p.logit_bias.is_empty()
        && p.repetition_penalty == 1.0
        && p.presence_penalty == 0.0
        && p.frequency_penalty == 0.0
        && !holds
        && !grammar
        && top_logprobs == 0;
    if plain {
        Need::Argmax
    } else {
        Need::Whole
    }
}

/// The rows of `logits` `(rows, vocab)`, each as `needs` says: on the CPU all whole (the
/// sampler then decides every row as it always has); elsewhere the [`Need::Argmax`] rows
/// decided where they lie.
pub fn fetch(logits: &Tensor, needs: &[Need]) -> Result<Vec<Fetched>> {
    if logits.device().is_cpu() || !needs.contains(&Need::Argmax) {
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        return Ok(rows.into_iter().map(Fetched::Whole).collect());
    }
    decide_in_place(logits, needs)
}

/// [`fetch`] off the CPU: the argmax rows' tokens and log-probabilities in a few ops over
/// all of them (a row's log-probability of its largest logit is `-ln Σ exp(x - max)`),
/// the whole rows copied as they are. Ties go to the argmax op's choice.
pub(crate) fn decide_in_place(logits: &Tensor, needs: &[Need]) -> Result<Vec<Fetched>> {
    let device = logits.device();
    let of = |want: Need| -> Vec<u32> {
        (0..needs.len() as u32)
            .filter(|&i| needs[i as usize] == want)
            .collect()
    };
    let (argmax_rows, whole_rows) = (of(Need::Argmax), of(Need::Whole));
    let picked = logits.index_select(&Tensor::new(argmax_rows.as_slice(), device)?, 0)?;
    let tokens: Vec<u32> = picked.argmax_keepdim(1)?.flatten_all()?.to_vec1()?;
    let max = picked.max_keepdim(1)?;
    let spread = picked.broadcast_sub(&max)?.exp()?.sum_keepdim(1)?.log()?;
    let spread: Vec<f32> = spread.flatten_all()?.to_vec1()?;
    let mut whole = if whole_rows.is_empty() {
        Vec::new()
    } else {
        let rows = Tensor::new(whole_rows.as_slice(), device)?;
        logits.index_select(&rows, 0)?.to_vec2::<f32>()?
    }
    .into_iter();
    let mut decided = tokens
        .into_iter()
        .zip(spread)
        .map(|(token, spread)| Sampled {
            token,
            logprob: -spread,
            top: Vec::new(),
        });
    Ok(needs
        .iter()
        .map(|n| match n {
            Need::Argmax => Fetched::Decided(decided.next().expect("a token per argmax row")),
            Need::Whole => Fetched::Whole(whole.next().expect("a row per whole row")),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::sampling::{sample, Context};

    fn greedy() -> SamplingParams {
        SamplingParams::default()
    }

    #[test]
    fn only_a_plain_greedy_row_is_decided_where_it_lies() {
        assert_eq!(need(&greedy(), 0, 0, false), Need::Argmax);
        let whole = |p: SamplingParams| need(&p, 0, 0, false);
        assert_eq!(
            whole(SamplingParams {
                temperature: 0.7,
                ..greedy()
            }),
            Need::Whole
        );
        assert_eq!(
            whole(SamplingParams {
                logit_bias: vec![(3, 1.0)],
                ..greedy()
            }),
            Need::Whole
        );
        for p in [
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
            assert_eq!(whole(p), Need::Whole);
        }
        assert_eq!(need(&greedy(), 0, 2, false), Need::Whole, "alternatives");
        assert_eq!(need(&greedy(), 0, 0, true), Need::Whole, "a grammar");
        let held = SamplingParams {
            min_tokens: 3,
            held: vec![2],
            ..greedy()
        };
        assert_eq!(need(&held, 2, 0, false), Need::Whole, "held back");
        assert_eq!(need(&held, 3, 0, false), Need::Argmax, "no longer held");
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
        let needs = [
            Need::Argmax,
            Need::Whole,
            Need::Argmax,
            Need::Argmax,
            Need::Whole,
        ];
        let got = decide_in_place(&logits, &needs).unwrap();
        for ((row, need), got) in rows.iter().zip(needs).zip(got) {
            match (need, got) {
                (Need::Whole, Fetched::Whole(r)) => assert_eq!(&r, row),
                (Need::Argmax, Fetched::Decided(s)) => {
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
