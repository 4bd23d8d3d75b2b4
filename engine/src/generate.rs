//! A plain single-sequence generation loop: the reference the batched paths are checked
//! against, and what a colocated worker runs for one request.

use crate::error::Result;
use crate::kv_cache::SeqCache;
use crate::model::{Model, SeqInput};
use crate::sampling::{fetch, need, sample, Context, Sampled, SamplingParams};

/// Runs `prompt` into `cache`, then samples up to `max_new` tokens, stopping after any id in
/// `stop_ids`. Step `n` of the sampler is the `n`-th generated token.
pub fn generate(
    model: &Model,
    cache: &mut SeqCache,
    prompt: &[u32],
    params: &SamplingParams,
    max_new: usize,
    stop_ids: &[u32],
) -> Result<Vec<Sampled>> {
    let mut out: Vec<Sampled> = Vec::with_capacity(max_new);
    let mut output_ids: Vec<u32> = Vec::with_capacity(max_new);
    let mut next: Vec<u32> = prompt.to_vec();
    while out.len() < max_new {
        let logits = model.forward(&mut [SeqInput {
            tokens: &next,
            cache,
        }])?;
        let cx = Context::of(prompt, &output_ids);
        let row = fetch(&logits, &[need(params, cx, 0, false)])?.pop();
        let row = row.expect("a forward pass of one sequence gives one row");
        let s = row.or_sample(|row| sample(row, params, &cx, out.len() as u64, 0));
        output_ids.push(s.token);
        next = vec![s.token];
        let stop = stop_ids.contains(&s.token);
        out.push(s);
        if stop {
            break;
        }
    }
    Ok(out)
}
