//! What a grammar costs a decode step: the same batch decoded with sampling alone and with
//! each sequence's token masked by its grammar (the mask computed, applied and the token fed
//! back), alternated round by round so that both see the same machine.

use std::time::Instant;

use engine::grammar::Constraint;
use engine::sampling::{sample, Context, SamplingParams};
use engine::{Model, SeqCache, SeqInput};

/// One batch of sequences that keeps decoding: each starts from a prompt of its own, and a
/// masked sequence starts its grammar again whenever the grammar ends.
pub struct Batch {
    caches: Vec<SeqCache>,
    next: Vec<u32>,
    outputs: Vec<Vec<u32>>,
    constraints: Vec<Constraint>,
    fresh: Constraint,
}

impl Batch {
    /// `batch` sequences with `context` tokens of prompt each, masked by `fresh`'s grammar.
    pub fn new(
        model: &Model,
        batch: usize,
        context: usize,
        fresh: Constraint,
    ) -> engine::Result<Self> {
        let vocab = model.config().vocab_size;
        let mut caches = Vec::with_capacity(batch);
        for i in 0..batch {
            let prompt: Vec<u32> = (0..context)
                .map(|j| ((j * 7919 + i * 104_729 + 13) % vocab) as u32)
                .collect();
            let mut cache = model.new_cache()?;
            model.forward(&mut [SeqInput {
                tokens: &prompt,
                cache: &mut cache,
            }])?;
            caches.push(cache);
        }
        Ok(Self {
            next: vec![0; batch],
            outputs: vec![Vec::new(); batch],
            constraints: vec![fresh.clone(); batch],
            caches,
            fresh,
        })
    }

    /// Runs `steps` decode steps at temperature 1, masked or not; the mean seconds a step.
    pub fn steps(&mut self, model: &Model, steps: usize, masked: bool) -> anyhow::Result<f64> {
        let p = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let start = Instant::now();
        for _ in 0..steps {
            let tokens: Vec<[u32; 1]> = self.next.iter().map(|&t| [t]).collect();
            let mut inputs: Vec<SeqInput> = tokens
                .iter()
                .zip(self.caches.iter_mut())
                .map(|(t, cache)| SeqInput { tokens: t, cache })
                .collect();
            let rows: Vec<Vec<f32>> = model.forward(&mut inputs)?.to_vec2()?;
            for (i, row) in rows.iter().enumerate() {
                let mask = if masked {
                    Some(self.constraints[i].mask()?)
                } else {
                    None
                };
                let out = &self.outputs[i];
                let cx = Context::of(&[], out).masked(mask.as_ref());
                let t = sample(row, &p, &cx, out.len() as u64, 0).token;
                if masked {
                    let c = &mut self.constraints[i];
                    c.advance(&[t])?;
                    if c.finished() {
                        *c = self.fresh.clone();
                    }
                }
                self.outputs[i].push(t);
                self.next[i] = t;
            }
        }
        Ok(start.elapsed().as_secs_f64() / steps as f64)
    }
}
