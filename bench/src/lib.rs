//! Engine throughput measurements: prefill and batched decode tokens/s, and the memory
//! bandwidth ceiling measured in the same run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use engine::model::argmax;
use engine::sampling::{fetch, Fetched, Need, Rule};
use engine::{Model, SeqCache, SeqInput};

pub mod hostile;
pub mod load;
pub mod mask;
pub mod overhead;
pub mod perf_ctl;
pub mod recipes;
pub mod serve;
pub mod soak;
pub mod stats;
pub mod zero;

/// Read bandwidth in bytes/s: `threads` threads each sum their share of a buffer much larger
/// than the caches; the best of `rounds` passes.
pub fn memory_read_bandwidth(bytes: usize, threads: usize, rounds: usize) -> f64 {
    let words = bytes / 8 / threads * threads;
    let buf: Vec<u64> = (0..words as u64).collect();
    let per = words / threads;
    let mut best = Duration::MAX;
    for _ in 0..rounds {
        let start = Instant::now();
        std::thread::scope(|s| {
            for chunk in buf.chunks(per) {
                s.spawn(move || {
                    // Four accumulators so the loop is bound by loads, not by one add chain.
                    let mut acc = [0u64; 4];
                    for c in chunk.chunks_exact(4) {
                        for i in 0..4 {
                            acc[i] = acc[i].wrapping_add(c[i]);
                        }
                    }
                    black_box(acc);
                });
            }
        });
        best = best.min(start.elapsed());
    }
    (words * 8) as f64 / best.as_secs_f64()
}

/// Prompt tokens per second for one `len`-token prompt (best of `rounds`).
pub fn prefill_tokens_per_s(model: &Model, len: usize, rounds: usize) -> engine::Result<f64> {
    let prompt = synthetic_prompt(model, len, 0);
    let mut best = Duration::MAX;
    for _ in 0..rounds {
        let mut cache = model.new_cache()?;
        let start = Instant::now();
        model.forward(&mut [SeqInput {
            tokens: &prompt,
            cache: &mut cache,
        }])?;
        // A GPU's work is queued: the time is the queue's once it has run.
        model.device().synchronize()?;
        best = best.min(start.elapsed());
    }
    Ok(len as f64 / best.as_secs_f64())
}

/// A decode measurement at one batch size.
#[derive(Debug, Clone)]
pub struct DecodeResult {
    pub batch: usize,
    pub tokens_per_s: f64,
    /// The batch over the median step's time: what a run gives without the steps that
    /// another process on the cores slowed, which the mean keeps.
    pub median_tokens_per_s: f64,
    /// Weights plus the batch's KV cache, read once per step.
    pub bytes_per_step: usize,
}

/// Generated tokens per second with `batch` sequences of `context` tokens decoding together
/// for `steps` greedy steps.
pub fn decode_tokens_per_s(
    model: &Model,
    batch: usize,
    context: usize,
    steps: usize,
) -> engine::Result<DecodeResult> {
    Decoding::prefill(model, batch, context, steps)?.steps(steps)
}

/// `batch` sequences of `context` tokens, prefilled and ready to decode together: what
/// [`decode_tokens_per_s`] times the steps of, apart, so a profiler can be pointed at the
/// steps alone (`engine-bench --perf-ctl`).
pub struct Decoding<'a> {
    model: &'a Model,
    context: usize,
    caches: Vec<SeqCache>,
    next: Vec<u32>,
}

impl<'a> Decoding<'a> {
    /// Prefills each sequence's synthetic prompt alone, and reserves its cache room for
    /// `steps` more positions, as a decode node reserves a sequence's whole budget before
    /// its first step: a cache grown mid-run copied and zeroed every layer (1.5% of a
    /// batch-16 step's samples at 256 positions), which no served step pays.
    pub fn prefill(
        model: &'a Model,
        batch: usize,
        context: usize,
        steps: usize,
    ) -> engine::Result<Self> {
        let mut caches: Vec<SeqCache> = Vec::with_capacity(batch);
        let mut next = Vec::with_capacity(batch);
        for i in 0..batch {
            let mut cache = model.new_cache()?;
            let prompt = synthetic_prompt(model, context, i);
            let logits = model.forward(&mut [SeqInput {
                tokens: &prompt,
                cache: &mut cache,
            }])?;
            next.push(argmax(&logits.squeeze(0)?.to_vec1()?));
            cache.reserve_exact(cache.len() + steps)?;
            caches.push(cache);
        }
        Ok(Self {
            model,
            context,
            caches,
            next,
        })
    }

    /// `steps` greedy steps of the whole batch, timed.
    pub fn steps(self, steps: usize) -> engine::Result<DecodeResult> {
        let Self {
            model,
            context,
            mut caches,
            mut next,
        } = self;
        let batch = caches.len();
        let layout = model.kv_layout();
        let kv_bytes_per_token = 2 * layout.n_layers * layout.bytes_per_token_layer();
        let start = Instant::now();
        let mut step_s = Vec::with_capacity(steps);
        for _ in 0..steps {
            let step = Instant::now();
            let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let mut inputs: Vec<SeqInput> = tokens
                .iter()
                .zip(caches.iter_mut())
                .map(|(t, c)| SeqInput {
                    tokens: t,
                    cache: c,
                })
                .collect();
            let logits = model.forward(&mut inputs)?;
            // Greedy, as a server decides a plain greedy row: on a GPU where the logits are.
            let greedy = Need::InPlace {
                rule: Rule::Argmax,
                top: 0,
                moves: None,
            };
            next = fetch(&logits, &vec![greedy; batch])?
                .into_iter()
                .map(|row| match row {
                    Fetched::Decided(s) => s.token,
                    Fetched::Whole(row) => argmax(&row),
                })
                .collect();
            step_s.push(step.elapsed().as_secs_f64());
        }
        let elapsed = start.elapsed().as_secs_f64();
        step_s.sort_by(f64::total_cmp);
        let mean_context = context + steps / 2;
        Ok(DecodeResult {
            batch,
            tokens_per_s: (batch * steps) as f64 / elapsed,
            median_tokens_per_s: batch as f64 / step_s[steps / 2],
            bytes_per_step: model.weight_bytes_per_step()
                + batch * mean_context * kv_bytes_per_token,
        })
    }
}

/// Deterministic prompt ids spread over the vocabulary.
fn synthetic_prompt(model: &Model, len: usize, salt: usize) -> Vec<u32> {
    let vocab = model.config().vocab_size;
    (0..len)
        .map(|i| ((i * 7919 + salt * 104_729 + 13) % vocab) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::testmodel::{write_model, ModelSize, DEFAULT_SEED};

    #[test]
    fn measurements_run_on_the_tiny_model() {
        let dir = std::env::temp_dir().join(format!("bench-tiny-{}", std::process::id()));
        write_model(&dir, ModelSize::Tiny, candle_core::DType::F32, DEFAULT_SEED).unwrap();
        let model = Model::load(&dir, &candle_core::Device::Cpu).unwrap();
        assert!(memory_read_bandwidth(1 << 24, 2, 1) > 1e8);
        assert!(prefill_tokens_per_s(&model, 16, 1).unwrap() > 0.0);
        let r = decode_tokens_per_s(&model, 4, 8, 3).unwrap();
        assert_eq!(r.batch, 4);
        assert!(r.tokens_per_s > 0.0);
        let layout = model.kv_layout();
        let kv = 4 * (8 + 1) * 2 * layout.n_layers * layout.bytes_per_token_layer();
        assert_eq!(r.bytes_per_step, model.weight_bytes_per_step() + kv);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
