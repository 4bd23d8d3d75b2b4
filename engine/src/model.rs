//! The Llama, Mistral, Qwen2, Qwen3, Gemma 2/3 and Phi-3 decoders, dense or mixtures of
//! experts (Qwen3-MoE, Qwen2-MoE, Mixtral), as Hugging Face defines them, over
//! caller-owned KV caches.
//!
//! Weights are immutable and shared; every call names the sequences it advances and their
//! caches. The dense layers see all the batch's tokens as one matrix; attention runs per
//! sequence because each has its own length, except a decode step's on a GPU, which is one
//! kernel over every cache (`attend`).

use candle_core::{DType, Device, IndexOp, Tensor};

use crate::attention::Scores;
use crate::embedding::Embedding;
use crate::error::{EngineError, Result};
use crate::kv_cache::{KvDtype, KvLayout, SeqCache};
use crate::rms_norm::rms_norm;
use crate::weights::{Linear, Stacked};
use ffn::Ffn;
use text::ModelConfig;

mod attend;
mod ffn;
mod load;

pub(crate) use load::gguf_name_of;

struct Layer {
    attn_norm: Tensor,
    /// q, k and v.
    qkv: Stacked,
    /// Qwen3's and Gemma 3's RMSNorm of each head's query and key, before RoPE.
    qk_norm: Option<QkNorm>,
    o: Linear,
    /// Gemma's norm of the attention's output, before the residual sum.
    post_attn_norm: Option<Tensor>,
    mlp_norm: Tensor,
    ffn: Ffn,
    /// Gemma's norm of the feed-forward's output, before the residual sum.
    post_ffn_norm: Option<Tensor>,
}

/// The cos and sin of every position's rotary angles, `(positions, rotary_dim / 2)` each.
struct RopeTables {
    cos: Tensor,
    sin: Tensor,
}

impl RopeTables {
    /// The rotation a layer scored `how` uses: the sliding-window layers' own where the
    /// model has one (Gemma 3's).
    fn for_scores<'a>(global: &'a Self, sliding: Option<&'a Self>, how: &Scores) -> &'a Self {
        match (sliding, how.window) {
            (Some(sliding), Some(_)) => sliding,
            _ => global,
        }
    }
}

/// A decode step's rows of the rotation tables, each at its sequence's position
/// (`Model::step_tables`): gathered once a pass rather than once a layer.
struct StepTables {
    rope: RopeTables,
    sliding: Option<RopeTables>,
}

impl StepTables {
    fn for_scores(&self, how: &Scores) -> &RopeTables {
        RopeTables::for_scores(&self.rope, self.sliding.as_ref(), how)
    }
}

/// The weights of a per-head RMSNorm of queries and keys.
struct QkNorm {
    q: Tensor,
    k: Tensor,
}

impl QkNorm {
    /// Normalizes each `head_dim` slice of `(rows, heads * head_dim)` projections.
    fn apply(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        let (rows, width) = x.dims2()?;
        let hd = weight.dim(0)?;
        let heads = x.contiguous()?.reshape((rows * (width / hd), hd))?;
        Ok(rms_norm(&heads, weight, eps)?.reshape((rows, width))?)
    }
}

/// A loaded decoder-only model.
pub struct Model {
    cfg: ModelConfig,
    device: Device,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// Whether `lm_head` multiplies by `embed` itself (a tied folder's), so that its bytes
    /// are held once.
    embed_is_head: bool,
    rope: RopeTables,
    /// The sliding-window layers' rotation where it is not `rope` (Gemma 3's).
    sliding_rope: Option<RopeTables>,
    /// What its caches hold.
    kv_dtype: KvDtype,
}

/// One sequence's share of a forward pass: the new tokens and the cache they extend.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SeqCache,
}

impl Model {
    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Bytes of weights one token's decode step reads: every projection, norm and the
    /// head, and of a mixture the router and the experts a token picks (the embedding
    /// table is only gathered from, a row per token).
    pub fn weight_bytes_per_step(&self) -> usize {
        self.weight_bytes(Ffn::bytes_per_token)
    }

    /// Bytes the loaded weights hold: those a step reads, every expert, the q/k norms and
    /// the embedding table ([`crate::footprint`] predicts them from the files' headers).
    pub fn resident_bytes(&self) -> usize {
        let qk_norms: usize = self
            .layers
            .iter()
            .filter_map(|l| l.qk_norm.as_ref())
            .map(|n| 4 * (n.q.elem_count() + n.k.elem_count()))
            .sum();
        let embed = if self.embed_is_head {
            0
        } else {
            self.embed.resident_bytes()
        };
        self.weight_bytes(Ffn::resident_bytes) + qk_norms + embed
    }

    /// The bytes of every projection, norm and the head, each feed-forward's counted by
    /// `ffn`.
    fn weight_bytes(&self, ffn: fn(&Ffn) -> usize) -> usize {
        let norm = |t: &Tensor| t.elem_count() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.weight_bytes()
                    + l.o.weight_bytes()
                    + ffn(&l.ffn)
                    + norm(&l.attn_norm)
                    + norm(&l.mlp_norm)
                    + [&l.post_attn_norm, &l.post_ffn_norm]
                        .into_iter()
                        .flatten()
                        .map(norm)
                        .sum::<usize>()
            })
            .sum();
        layers + norm(&self.norm) + self.lm_head.weight_bytes()
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The layout this model's KV caches have.
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout::for_model(&self.cfg, self.kv_dtype)
    }

    /// Makes this model's caches hold `dtype` from now on, where they can
    /// ([`KvDtype::check`]).
    pub fn set_kv_dtype(&mut self, dtype: KvDtype) -> Result<()> {
        dtype.check(self.cfg.head_dim, &self.device)?;
        self.kv_dtype = dtype;
        Ok(())
    }

    /// A fresh, empty cache for one sequence.
    pub fn new_cache(&self) -> Result<SeqCache> {
        SeqCache::new(self.kv_layout(), &self.device)
    }

    /// Runs the new tokens of every sequence, appends their K/V to each cache, and returns
    /// the logits of each sequence's last new token as `(batch, vocab)`.
    pub fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Tensor> {
        self.forward_with(batch, &mut |_, _| Ok(()))
    }

    /// `forward`, calling `layer_done(layer, batch)` as soon as each layer's K/V are in
    /// the caches, so a transfer can start before the last layer has run. During the call
    /// the new positions count as pending: export them with `SeqCache::export_pending`.
    pub fn forward_with(
        &self,
        batch: &mut [SeqInput<'_>],
        layer_done: &mut dyn FnMut(usize, &[SeqInput<'_>]) -> Result<()>,
    ) -> Result<Tensor> {
        Ok(self.forward_rows(batch, layer_done, &[])?.0)
    }

    /// `forward_with`, also returning, for each sequence flagged in `every_row`, the logits
    /// of all its new tokens as `(tokens, vocab)`: what prompt logprobs are read from. The
    /// first tensor (each sequence's last token) is computed as `forward_with` computes it,
    /// so the tokens sampled from it do not depend on the flags.
    pub fn forward_rows(
        &self,
        batch: &mut [SeqInput<'_>],
        layer_done: &mut dyn FnMut(usize, &[SeqInput<'_>]) -> Result<()>,
        every_row: &[bool],
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        if batch.is_empty() {
            return Err(EngineError::InvalidInput("empty batch".into()));
        }
        join_own_rayon_pool();
        let mut all_tokens = Vec::new();
        for item in batch.iter_mut() {
            if item.tokens.is_empty() {
                return Err(EngineError::InvalidInput(
                    "a sequence has no new tokens".into(),
                ));
            }
            if item.cache.layout() != &self.kv_layout() {
                return Err(EngineError::KvCache(
                    "cache layout does not match the model".into(),
                ));
            }
            let end = item.cache.len() + item.tokens.len();
            if end > self.cfg.max_position_embeddings {
                return Err(EngineError::ContextOverflow {
                    got: end,
                    limit: self.cfg.max_position_embeddings,
                });
            }
            if let Some(&bad) = item
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.cfg.vocab_size)
            {
                return Err(EngineError::InvalidInput(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.cfg.vocab_size
                )));
            }
            item.cache.reserve(item.tokens.len())?;
            all_tokens.extend_from_slice(item.tokens);
        }
        let spans: Vec<(usize, usize)> = batch
            .iter()
            .scan(0, |row, item| {
                let span = (*row, item.tokens.len());
                *row += item.tokens.len();
                Some(span)
            })
            .collect();
        let mut xs = self.embed.lookup(&all_tokens, &self.device)?;
        if self.cfg.gemma.is_some() {
            xs = (xs * (self.cfg.hidden_size as f64).sqrt())?;
        }
        // A decode step (one new row each) rotates every layer's rows at the same positions.
        let step = if spans.iter().all(|&(_, t)| t == 1) {
            Some(self.step_tables(batch)?)
        } else {
            None
        };
        for (li, layer) in self.layers.iter().enumerate() {
            xs = self.layer_forward(li, layer, xs, batch, &spans, step.as_ref())?;
            layer_done(li, batch)?;
        }
        let mut last_rows = Vec::with_capacity(batch.len());
        let mut row = 0u32;
        for item in batch.iter_mut() {
            row += item.tokens.len() as u32;
            last_rows.push(row - 1);
            item.cache.commit(item.tokens);
        }
        let every = spans
            .iter()
            .enumerate()
            .map(|(i, &(row, t))| {
                if !every_row.get(i).copied().unwrap_or(false) {
                    return Ok(None);
                }
                Ok(Some(self.logits(&xs.narrow(0, row, t)?)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let last = xs.index_select(&Tensor::new(last_rows.as_slice(), &self.device)?, 0)?;
        Ok((self.logits(&last)?, every))
    }

    /// One layer over the batch's rows `xs`, its K/V appended to each sequence's cache;
    /// `step` is a decode step's rotations.
    fn layer_forward(
        &self,
        li: usize,
        layer: &Layer,
        xs: Tensor,
        batch: &[SeqInput<'_>],
        spans: &[(usize, usize)],
        step: Option<&StepTables>,
    ) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps as f32;
        let norm = |x: &Tensor, w: &Tensor| rms_norm(x, w, eps);
        let h = norm(&xs, &layer.attn_norm)?;
        let mut qkv = layer.qkv.forward(&h)?;
        if let Some(n) = &layer.qk_norm {
            qkv[0] = QkNorm::apply(&qkv[0], &n.q, eps)?;
            qkv[1] = QkNorm::apply(&qkv[1], &n.k, eps)?;
        }
        let (q, k, v) = (&qkv[0], &qkv[1], &qkv[2]);
        let outs = self.attend_all(li, batch, spans, step, q, k, v)?;
        let mut attn = layer.o.forward(&outs)?;
        if let Some(w) = &layer.post_attn_norm {
            attn = norm(&attn, w)?;
        }
        let xs = (xs + attn)?;
        let mut ffn = layer.ffn.forward(&norm(&xs, &layer.mlp_norm)?)?;
        if let Some(w) = &layer.post_ffn_norm {
            ffn = norm(&ffn, w)?;
        }
        Ok((xs + ffn)?)
    }

    /// The f32 logits of final hidden rows: normed, through the head, and soft-capped
    /// where the model caps them.
    fn logits(&self, rows: &Tensor) -> Result<Tensor> {
        let rows = rms_norm(rows, &self.norm, self.cfg.rms_norm_eps as f32)?;
        let logits = self.lm_head.forward(&rows)?.to_dtype(DType::F32)?;
        match self
            .cfg
            .gemma
            .as_ref()
            .and_then(|g| g.final_logit_softcapping)
        {
            Some(cap) => Ok(((logits / cap)?.tanh()? * cap)?),
            None => Ok(logits),
        }
    }

    /// Logits for the token after `tokens`, starting from an empty cache; for tests.
    pub fn logits_for(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut cache = self.new_cache()?;
        let logits = self.forward(&mut [SeqInput {
            tokens,
            cache: &mut cache,
        }])?;
        Ok(logits.i(0)?.to_vec1()?)
    }
}

/// Makes the calling thread the first thread of a rayon pool of its own, once per thread.
///
/// candle-nn's norms, ropes and softmaxes split even a decode step's small tensors across
/// rayon's pool. Called from a thread outside the pool, each op waits for a pool thread to
/// wake up and run it, which costs more than the op: a batch-16 step makes about 1,500 of
/// them. From inside its own pool the thread runs its share at once, and the other threads
/// only take work that is left over (large prefills still spread). The quantized matmuls
/// use candle's barrier pool, which is not rayon. If the thread already belongs to a rayon
/// pool, it stays as it is.
fn join_own_rayon_pool() {
    thread_local! {
        static POOL: std::cell::OnceCell<Option<rayon::ThreadPool>> =
            const { std::cell::OnceCell::new() };
    }
    POOL.with(|pool| {
        pool.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(candle_core::utils::get_num_threads())
                .use_current_thread()
                .build()
                .ok()
        });
    });
}

/// Index of the largest logit; ties go to the lowest id, as `torch.argmax` does. NaNs
/// never win, unless the first logit is one (then 0).
pub fn argmax(logits: &[f32]) -> u32 {
    let Some(&first) = logits.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    // Two passes the compiler turns into vector code, the largest value then its first
    // place, where one pass kept a running index it could not: that loop was 1.8% of a
    // batch-16 step's samples on a 512-bit Xeon (16 rows of 49,152, on the main thread).
    let mut lanes = [first; RUN];
    let mut runs = logits.chunks_exact(RUN);
    for run in runs.by_ref() {
        for (l, &x) in lanes.iter_mut().zip(run) {
            // `x > l` is false for a NaN `x`: it never enters a lane.
            *l = if x > *l { x } else { *l };
        }
    }
    let top = runs
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(first, |t, &x| if x > t { x } else { t });
    let hit = logits
        .chunks(RUN)
        .position(|run| run.iter().fold(false, |h, &x| h | (x == top)))
        .expect("the largest value is in the row");
    let at = logits[hit * RUN..]
        .iter()
        .position(|&x| x == top)
        .expect("in this run");
    (hit * RUN + at) as u32
}

/// Logits a pass of [`argmax`] takes at once: two 512-bit registers' worth.
const RUN: usize = 32;

#[cfg(test)]
mod tests {
    use super::argmax;

    #[test]
    fn argmax_takes_the_first_of_the_largest() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(argmax(&[5.0, -1.0]), 0);
        assert_eq!(argmax(&[-2.0, -1.0, f32::NAN, -1.5]), 1, "a NaN never wins");
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), 0);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 0, "a NaN first");
        // Rows longer than a run against the one-pass loop: the largest at each end, mid-run
        // and after the last whole run, tied later in the row, with NaNs about.
        let one_pass = |row: &[f32]| {
            let (mut best, mut top) = (0, row[0]);
            for (i, &x) in row.iter().enumerate() {
                if x > top {
                    (best, top) = (i, x);
                }
            }
            best as u32
        };
        for n in [31, 32, 33, 95, 1000] {
            for at in [0, 1, n / 2, n - 2, n - 1] {
                let mut row: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
                row[at] = 9.0;
                assert_eq!(argmax(&row) as usize, at, "{n} {at}");
                row[n - 1] = 9.0;
                assert_eq!(argmax(&row), one_pass(&row), "a tie later, {n} {at}");
                row.iter_mut()
                    .skip(1)
                    .step_by(3)
                    .for_each(|x| *x = f32::NAN);
                assert_eq!(argmax(&row), one_pass(&row), "NaNs, {n} {at}");
            }
        }
    }
}
