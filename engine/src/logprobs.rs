//! Log-probabilities of the model's raw distribution and the tokens they describe: what both
//! the sampler and the beam search report.

/// One token's log-probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// What the sampler chose, with log-probabilities when asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` under the model's distribution (before sampling settings).
    pub logprob: f32,
    /// The most likely tokens, best first; as many as were asked for.
    pub top: Vec<TokenLogprob>,
}

/// The log-probability of each prompt token after the first, from the logits of the
/// positions before it: row `i` of `rows` (the logits after `tokens[..=i]` of the run) scores
/// `next[i]`, with its `top` best alternatives. What `echo` with logprobs reports.
pub fn scored(rows: &[Vec<f32>], next: &[u32], top: usize) -> Vec<Sampled> {
    rows.iter()
        .zip(next)
        .map(|(row, &token)| {
            let lp = log_softmax(row);
            Sampled {
                token,
                logprob: lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY),
                top: top_n(&lp, top),
            }
        })
        .collect()
}

/// The `n` most likely tokens of the raw logits `raw`, best first (ties keep the lower id
/// first), with their log-probabilities: the sampler's alternatives and a beam's
/// candidates.
pub fn ranked(raw: &[f32], n: usize) -> Vec<TokenLogprob> {
    ranked_by(raw, n, log_z(raw))
}

/// [`ranked`], `raw`'s [`log_z`] given.
pub(crate) fn ranked_by(raw: &[f32], n: usize, log_z: f64) -> Vec<TokenLogprob> {
    top_n(raw, n)
        .into_iter()
        .map(|t| TokenLogprob {
            logprob: (t.logprob as f64 - log_z) as f32,
            ..t
        })
        .collect()
}

/// Log-softmax of the raw logits, in f64 for stable sums.
pub(crate) fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let log_z = log_z(logits);
    logits.iter().map(|&x| (x as f64 - log_z) as f32).collect()
}

/// The log of the softmax's normalizer: a token's logprob is its logit minus this.
pub(crate) fn log_z(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    max as f64 + sum.ln()
}

/// The `n` best entries of `values`, best first; ties keep the lower id first.
pub(crate) fn top_n(values: &[f32], n: usize) -> Vec<TokenLogprob> {
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let n = n.min(idx.len());
    if n == 0 {
        return vec![];
    }
    let by_value = |a: &u32, b: &u32| {
        values[*b as usize]
            .total_cmp(&values[*a as usize])
            .then(a.cmp(b))
    };
    idx.select_nth_unstable_by(n - 1, by_value);
    idx.truncate(n);
    idx.sort_by(by_value);
    idx.into_iter()
        .map(|t| TokenLogprob {
            token: t,
            logprob: values[t as usize],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_scores_the_token_after_it() {
        let rows = vec![vec![0.0, 2.0f32.ln()], vec![1.0, 1.0]];
        let s = scored(&rows, &[1, 0], 1);
        assert_eq!(s.len(), 2);
        assert!((s[0].logprob - (2.0f32 / 3.0).ln()).abs() < 1e-6);
        assert_eq!(s[0].top[0].token, 1);
        assert!((s[1].logprob - 0.5f32.ln()).abs() < 1e-6);
        assert_eq!(s[1].token, 0);
    }
}
