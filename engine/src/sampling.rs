//! Turning logits into the next token: penalties, temperature, top-k, top-p, a seeded draw,
//! and log-probabilities.
//!
//! The draw for step `n` of a request depends only on its seed and `n`, so prefill and decode
//! nodes continue one stream without shipping generator state, and batch mates never matter.

mod best;
mod draw;
mod moves;
mod ranked;
mod rows;
mod runs;

use crate::logprobs::{log_z, ranked_by};
pub use crate::logprobs::{ranked, scored, Sampled, TokenLogprob};
pub use best::{Filtered, BEST_CANDIDATES};
use draw::draw;
pub use draw::Cuts;
pub use moves::Moves;
pub use ranked::fetch_ranked;
pub use rows::{fetch, need, Fetched, Need, Rule};
pub use text::grammar::TokenMask;

/// The most alternatives one token reports (the API's `top_logprobs` limit); the workers
/// refuse requests for more, so a request's logprob entries stay bounded.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Per-request sampling settings, already validated by the caller.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 or ≥ vocabulary keeps all.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Hugging Face's repetition penalty over prompt and output; 1 is off.
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty over output tokens; 0 is off.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty over output tokens; 0 is off.
    pub frequency_penalty: f32,
    pub seed: u64,
    /// Keep only the tokens at least `min_p` times as likely as the most likely one, after
    /// the temperature; 0 is off.
    pub min_p: f32,
    /// Added to these tokens' logits before anything else, greedy decoding included; each
    /// token once, inside the vocabulary.
    pub logit_bias: Vec<(u32, f32)>,
    /// While a sequence has fewer tokens than this, the tokens of `held` cannot be sampled.
    pub min_tokens: usize,
    /// What `min_tokens` holds back: the request's stop tokens, each once, sorted.
    pub held: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            held: Vec::new(),
        }
    }
}

/// SplitMix64: a tiny, well-mixed hash from (seed, step) to 64 random bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The SplitMix64 sequence from a seed: fast, well mixed, and the same on every platform.
#[derive(Debug, Clone, Copy)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// The sequence that starts from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let z = self.0;
        self.0 = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(z)
    }
}

/// A uniform draw in [0, 1) for step `step` of the stream `seed`.
pub fn uniform(seed: u64, step: u64) -> f64 {
    let bits = mix(mix(seed) ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

impl SamplingParams {
    /// The settings of sequence `choice` of a request with n > 1: sequence 0 keeps the
    /// request's seed, so n = 1 is unchanged; the others get streams of their own.
    pub fn for_choice(&self, choice: usize) -> Self {
        let seed = if choice == 0 {
            self.seed
        } else {
            mix(self.seed ^ mix(choice as u64))
        };
        Self {
            seed,
            ..self.clone()
        }
    }
}

/// The first token of each of `n` sequences that share one prompt, from the logits of its
/// last position: a sample each, or for a beam search the n most likely tokens. `cx.output`
/// is the request's output so far, empty but for a resumed request (whose prompt ends with
/// it): the draw is then the one of step `output.len()`, as in the uninterrupted run. The
/// sequences share one grammar state, so `cx.allowed` masks every one of them.
pub fn pick_first(
    raw: &[f32],
    p: &SamplingParams,
    cx: &Context<'_>,
    n: usize,
    top_logprobs: usize,
    beam: bool,
) -> Vec<Sampled> {
    if beam {
        return crate::beam::first_tokens(raw, n, top_logprobs);
    }
    let step = cx.output.len() as u64;
    (0..n)
        .map(|i| sample(raw, &p.for_choice(i), cx, step, top_logprobs))
        .collect()
}

/// A resumed request's tokens split into the prompt it was sent with and its output so far,
/// the last `resumed` tokens (see the proto's `resumed`).
pub fn split_resumed(tokens: &[u32], resumed: usize) -> (&[u32], &[u32]) {
    tokens.split_at(tokens.len().saturating_sub(resumed))
}

/// Whether a request can resume after `resumed` tokens of output (see the proto's
/// `resumed`): only one sequence without beam search moves, and its prompt of `tokens`
/// tokens must keep at least one token that is not output.
pub fn can_resume(tokens: usize, resumed: usize, sequences: usize, beam: bool) -> bool {
    resumed == 0 || (resumed < tokens && sequences <= 1 && !beam)
}

/// Applies the penalties in place. `prompt` and `output` are the tokens so far.
pub fn apply_penalties(logits: &mut [f32], p: &SamplingParams, prompt: &[u32], output: &[u32]) {
    moves::penalize(logits, p, prompt, output);
}

/// What sampling a sequence's next token looks at besides the logits: its tokens so far,
/// and the tokens its grammar allows (structured outputs), if it has one.
#[derive(Debug, Clone, Copy, Default)]
pub struct Context<'a> {
    pub prompt: &'a [u32],
    /// The sequence's output so far.
    pub output: &'a [u32],
    /// The only tokens it may take next; `None`: any.
    pub allowed: Option<&'a TokenMask>,
}

impl<'a> Context<'a> {
    /// A sequence of `prompt` that has generated `output`, without a grammar.
    pub fn of(prompt: &'a [u32], output: &'a [u32]) -> Self {
        Self {
            prompt,
            output,
            allowed: None,
        }
    }

    /// The same sequence, held to the tokens of `allowed`.
    pub fn masked(self, allowed: Option<&'a TokenMask>) -> Self {
        Self { allowed, ..self }
    }
}

/// The logits a request samples from: the model's, with the logit bias, `min_tokens`' mask
/// and then the penalties (vLLM's order), and last the grammar's mask, which nothing
/// overrides. `min_tokens` gives way where the grammar allows only stop tokens: the grammar
/// is complete, and a sequence that could take no token at all would have no next token.
pub fn processed(raw: &[f32], p: &SamplingParams, cx: &Context<'_>) -> Vec<f32> {
    let mut logits = raw.to_vec();
    let hold = moves::holds(p, cx.output, cx.allowed, logits.len());
    moves::move_entries(&mut logits[..], p, cx.prompt, cx.output, hold);
    if let Some(m) = cx.allowed {
        m.apply(&mut logits);
    }
    logits
}

/// Chooses the token for step `step` of a request.
///
/// `raw` are the model's logits; `cx` holds what else the choice depends on; `top_logprobs`
/// is how many alternatives to report (0 for none). The logprobs reported are those of the
/// model's own distribution, before any of the request's settings.
pub fn sample(
    raw: &[f32],
    p: &SamplingParams,
    cx: &Context<'_>,
    step: u64,
    top_logprobs: usize,
) -> Sampled {
    let logits = processed(raw, p, cx);
    let token = if p.temperature <= 0.0 {
        crate::model::argmax(&logits)
    } else {
        draw(&logits, p, uniform(p.seed, step))
    };
    // The raw distribution's normalizer, not every token's logprob: only the sampled token
    // and the alternatives asked for are reported.
    let log_z = log_z(raw);
    Sampled {
        token,
        logprob: (raw[token as usize] as f64 - log_z) as f32,
        top: ranked_by(raw, top_logprobs, log_z),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: 7,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let s = sample(&[0.1, 3.0, 2.0], &params(0.0), &Context::default(), 0, 2);
        assert_eq!(s.token, 1);
        assert_eq!(s.top.iter().map(|t| t.token).collect::<Vec<_>>(), [1, 2]);
        let total: f32 = [0.1f32, 3.0, 2.0].iter().map(|&x| (x - 3.0f32).exp()).sum();
        assert!((s.logprob + total.ln()).abs() < 1e-5);
    }

    #[test]
    fn same_seed_and_step_draw_the_same_token() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let a: Vec<u32> = (0..20)
            .map(|s| sample(&logits, &params(1.0), &Context::default(), s, 0).token)
            .collect();
        let b: Vec<u32> = (0..20)
            .map(|s| sample(&logits, &params(1.0), &Context::default(), s, 0).token)
            .collect();
        assert_eq!(a, b);
        let mut other = params(1.0);
        other.seed = 8;
        let c: Vec<u32> = (0..20)
            .map(|s| sample(&logits, &other, &Context::default(), s, 0).token)
            .collect();
        assert_ne!(a, c, "a different seed should give a different stream");
    }

    #[test]
    fn a_resumed_first_token_is_the_uninterrupted_run_s_draw_at_that_step() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut p = params(1.0);
        p.frequency_penalty = 0.5;
        let prompt = [3, 4, 5];
        let output = [6, 7];
        let tokens = [3, 4, 5, 6, 7];
        let (before, so_far) = split_resumed(&tokens, 2);
        assert_eq!((before, so_far), (&prompt[..], &output[..]));
        let resumed = pick_first(&logits, &p, &Context::of(before, so_far), 1, 0, false)[0].token;
        assert_eq!(
            resumed,
            sample(&logits, &p, &Context::of(&prompt, &output), 2, 0).token
        );
        assert_eq!(split_resumed(&tokens, 0), (&tokens[..], &[][..]));
        assert!(can_resume(5, 2, 1, false) && can_resume(5, 0, 4, true));
        assert!(!can_resume(5, 5, 1, false) && !can_resume(5, 2, 2, false));
        assert!(!can_resume(5, 2, 1, true));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_tiny_keeps_the_best() {
        let logits = [1.0, 5.0, 4.9, 0.0];
        for step in 0..50 {
            let mut p = params(2.0);
            p.top_k = 1;
            assert_eq!(sample(&logits, &p, &Context::default(), step, 0).token, 1);
            let mut p = params(2.0);
            p.top_p = 1e-6;
            assert_eq!(sample(&logits, &p, &Context::default(), step, 0).token, 1);
        }
    }

    #[test]
    fn draws_follow_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln()];
        let ones = (0..4000)
            .filter(|&s| sample(&logits, &params(1.0), &Context::default(), s, 0).token == 1)
            .count();
        assert!(
            (2800..3200).contains(&ones),
            "expected ~3000 of 4000, got {ones}"
        );
    }

    #[test]
    fn the_unranked_draw_has_the_ranked_draw_s_distribution() {
        let logits = [0.3f32, -1.0, 2.0, 0.0, 1.2, f32::NEG_INFINITY];
        let hot = SamplingParams {
            temperature: 0.7,
            ..params(0.7)
        };
        // top_p just below 1 takes the ranked path and cuts nothing here.
        let ranked = SamplingParams {
            top_p: 0.999_999,
            ..hot.clone()
        };
        let counts = |p: &SamplingParams| {
            let mut c = [0usize; 6];
            for u in 0..20_000 {
                c[draw(&logits, p, (u as f64 + 0.5) / 20_000.0) as usize] += 1;
            }
            c
        };
        let (a, b) = (counts(&hot), counts(&ranked));
        assert_eq!(a[5], 0, "a masked token is never drawn");
        for t in 0..6 {
            assert!(a[t].abs_diff(b[t]) <= 2, "token {t}: {a:?} against {b:?}");
        }
    }

    #[test]
    fn penalties_follow_their_definitions() {
        let mut l = vec![2.0, -2.0, 1.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        apply_penalties(&mut l, &p, &[0, 1], &[]);
        assert_eq!(l, [1.0, -4.0, 1.0]);
        let mut l = vec![0.0; 3];
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        apply_penalties(&mut l, &p, &[2], &[1, 1, 0]);
        assert_eq!(l, [-0.75, -1.0, 0.0]);
    }

    #[test]
    fn logit_bias_moves_greedy_and_stays_out_of_the_logprobs() {
        let raw = [3.0, 1.0, 2.0];
        let mut p = params(0.0);
        p.logit_bias = vec![(1, 5.0), (2, -100.0), (99, 100.0)];
        let s = sample(&raw, &p, &Context::default(), 0, 0);
        assert_eq!(
            s.token, 1,
            "3 + 0 < 1 + 5; an id outside the vocabulary is skipped"
        );
        let plain = sample(&raw, &params(0.0), &Context::default(), 0, 0);
        assert_eq!(plain.token, 0);
        let unbiased = crate::logprobs::log_softmax(&raw)[1];
        assert_eq!(s.logprob, unbiased, "logprobs are the model's own");
    }

    #[test]
    fn min_tokens_holds_back_stop_tokens_until_reached() {
        let raw = [0.0, 9.0, 1.0];
        let p = SamplingParams {
            min_tokens: 2,
            held: vec![1],
            ..params(0.0)
        };
        assert_eq!(sample(&raw, &p, &Context::default(), 0, 0).token, 2);
        assert_eq!(sample(&raw, &p, &Context::of(&[], &[5]), 1, 0).token, 2);
        assert_eq!(sample(&raw, &p, &Context::of(&[], &[5, 5]), 2, 0).token, 1);
        for step in 0..200 {
            let hot = SamplingParams {
                temperature: 2.0,
                ..p.clone()
            };
            assert_ne!(sample(&raw, &hot, &Context::default(), step, 0).token, 1);
        }
    }

    #[test]
    fn a_grammar_mask_limits_greedy_and_draws_but_not_the_logprobs() {
        let raw = [5.0, 1.0, 0.5, 0.2];
        let mask = TokenMask::of(&[1, 3], 4);
        let cx = Context::default().masked(Some(&mask));
        let greedy = sample(&raw, &params(0.0), &cx, 0, 1);
        assert_eq!(greedy.token, 1);
        assert_eq!(
            greedy.top[0].token, 0,
            "the model's own distribution is reported"
        );
        let mut seen = [0; 4];
        for step in 0..400 {
            seen[sample(&raw, &params(1.0), &cx, step, 0).token as usize] += 1;
        }
        assert_eq!((seen[0], seen[2]), (0, 0), "{seen:?}");
        assert!(seen[1] > 0 && seen[3] > 0, "{seen:?}");
    }

    #[test]
    fn a_draw_never_falls_back_to_a_masked_token() {
        // Weights whose sum rounds below 1, and draws at its very top.
        let raw = [0.1f32, 0.2, 0.3, 0.4, 0.5];
        let mask = TokenMask::of(&[1, 3], 5);
        let cx = Context::default().masked(Some(&mask));
        let logits = processed(&raw, &params(1.0), &cx);
        for u in [0.0, 0.5, 1.0 - f64::EPSILON, 1.0] {
            let t = draw(&logits, &params(1.0), u);
            assert!(t == 1 || t == 3, "u = {u}: {t}");
        }
    }

    #[test]
    fn min_tokens_gives_way_only_where_the_grammar_allows_nothing_but_stop_tokens() {
        let p = SamplingParams {
            min_tokens: 5,
            held: vec![2],
            ..params(0.0)
        };
        let raw = [0.0, 1.0, 5.0];
        let stop_or_1 = TokenMask::of(&[1, 2], 3);
        let cx = Context::default().masked(Some(&stop_or_1));
        assert_eq!(sample(&raw, &p, &cx, 0, 0).token, 1);
        let only_stop = TokenMask::of(&[2], 3);
        let cx = Context::default().masked(Some(&only_stop));
        assert_eq!(sample(&raw, &p, &cx, 0, 0).token, 2);
    }

    #[test]
    fn min_p_drops_the_unlikely_tokens() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1.
        let raw = [2f32.ln() * 2.0, 2f32.ln(), 0.0, 0.0];
        let drawn = |min_p: f32| -> std::collections::BTreeSet<u32> {
            let p = SamplingParams {
                min_p,
                ..params(1.0)
            };
            (0..500)
                .map(|s| sample(&raw, &p, &Context::default(), s, 0).token)
                .collect()
        };
        assert_eq!(drawn(0.0), [0, 1, 2, 3].into());
        assert_eq!(drawn(0.3), [0, 1].into(), "0.125 < 0.3 * 0.5 <= 0.25");
        assert_eq!(drawn(1.0), [0].into());
    }

    #[test]
    fn uniform_is_in_range_and_spread() {
        let xs: Vec<f64> = (0..1000).map(|s| uniform(42, s)).collect();
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((mean - 0.5).abs() < 0.05);
    }
}
