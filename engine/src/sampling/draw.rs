//! The seeded draw from a row's tempered distribution: over the whole vocabulary, or over
//! the candidates top-k, min-p and top-p leave.

use super::SamplingParams;
use crate::logprobs::{top_n, TokenLogprob};

/// What a draw cuts after top-k: the temperature its weights take, then min-p and top-p.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cuts {
    pub temperature: f64,
    /// 0 is off.
    pub min_p: f32,
    /// 1 is off.
    pub top_p: f32,
}

impl Cuts {
    pub(super) fn of(p: &SamplingParams) -> Self {
        Self {
            temperature: p.temperature as f64,
            min_p: p.min_p,
            top_p: p.top_p,
        }
    }
}

/// How many tokens top-k keeps of a vocabulary of `vocab`.
pub(super) fn kept(top_k: usize, vocab: usize) -> usize {
    if top_k == 0 || top_k >= vocab {
        vocab
    } else {
        top_k
    }
}

/// Samples from the tempered distribution, filtered by top-k, min-p and top-p in that
/// order, with the draw `u`.
pub(super) fn draw(logits: &[f32], p: &SamplingParams, u: f64) -> u32 {
    let vocab = logits.len();
    let k = kept(p.top_k, vocab);
    if k == vocab && p.min_p <= 0.0 && p.top_p >= 1.0 {
        return draw_unfiltered(logits, p.temperature as f64, u);
    }
    draw_ranked(top_n(logits, k), Ranked::All, &Cuts::of(p), u)
        .expect("the whole set top-k keeps settles its draw")
}

/// What a draw's ranked candidates are of the tokens top-k keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Ranked {
    /// All of them.
    All,
    /// The best of a vocabulary top-k keeps whole, with the total of the whole
    /// vocabulary's tempered weights (`exp((x - max) / t)`, in f64).
    Best { total: f64 },
}

/// [`draw`]'s ranked path over the candidates `cand`, best first (ties by the lower id).
/// None where they do not settle it, which only [`Ranked::Best`] can leave: min-p's or
/// top-p's cut, or the draw itself, falls past them.
pub(super) fn draw_ranked(
    mut cand: Vec<TokenLogprob>,
    ranked: Ranked,
    cuts: &Cuts,
    u: f64,
) -> Option<u32> {
    // Masked tokens (a grammar's, min_tokens') have no probability at all: they must not be
    // the fallback below when rounding leaves the draw above the last cumulative sum.
    if let Some(masked) = cand.iter().position(|c| c.logprob == f32::NEG_INFINITY) {
        cand.truncate(masked.max(1));
    }
    let max = cand.first()?.logprob as f64;
    let t = cuts.temperature;
    let mut probs: Vec<f64> = cand
        .iter()
        .map(|c| ((c.logprob as f64 - max) / t).exp())
        .collect();
    let (mut whole, total) = match ranked {
        Ranked::All => (true, probs.iter().sum()),
        Ranked::Best { total } => (false, total),
    };
    probs.iter_mut().for_each(|x| *x /= total);
    if cuts.min_p > 0.0 {
        // Best first, so the kept tokens are a prefix; the most likely one always stays.
        let floor = probs[0] * cuts.min_p as f64;
        let keep = match probs.iter().position(|&x| x < floor) {
            Some(keep) => keep,
            None if whole => probs.len(),
            None => return None,
        };
        whole = true;
        keep_first(keep, &mut cand, &mut probs);
    }
    if cuts.top_p < 1.0 {
        let mut acc = 0.0;
        let reached = probs.iter().position(|&x| {
            acc += x;
            acc >= cuts.top_p as f64
        });
        let keep = match reached {
            Some(i) => i + 1,
            None if whole => probs.len(),
            None => return None,
        };
        whole = true;
        keep_first(keep, &mut cand, &mut probs);
    }
    let mut acc = 0.0;
    for (c, &pr) in cand.iter().zip(&probs) {
        acc += pr;
        if u < acc {
            return Some(c.token);
        }
    }
    whole.then(|| cand.last().map_or(0, |c| c.token))
}

/// The first `keep` candidates and their probabilities, renormalized.
fn keep_first(keep: usize, cand: &mut Vec<TokenLogprob>, probs: &mut Vec<f64>) {
    cand.truncate(keep);
    probs.truncate(keep);
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= total);
}

/// Samples from the whole tempered distribution with the draw `u`, walking the tokens in
/// id order: no filter needs them ranked, and sorting the vocabulary cost several
/// milliseconds a token (most of a batch-16 step at temperature 1).
fn draw_unfiltered(logits: &[f32], t: f64, u: f64) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&x| ((x - max) as f64 / t).exp())
        .collect();
    let target = u * weights.iter().sum::<f64>();
    let mut acc = 0.0;
    for (i, &w) in weights.iter().enumerate() {
        acc += w;
        if target < acc {
            return i as u32;
        }
    }
    // Rounding left the draw at the very top: the last token that has any weight (never a
    // masked one).
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
}
