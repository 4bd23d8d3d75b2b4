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

/// Log-softmax of the raw logits, in f64 for stable sums.
pub(crate) fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    logits.iter().map(|&x| (x as f64 - log_z) as f32).collect()
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
