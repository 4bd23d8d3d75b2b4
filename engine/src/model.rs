//! The Llama, Mistral, Qwen2, Qwen3, Gemma 2/3 and Phi-3 decoders, dense or mixtures of
//! experts (Qwen3-MoE, Qwen2-MoE, Mixtral), as Hugging Face defines them, over
//! caller-owned KV caches.
//!
//! Weights are immutable and shared; every call names the sequences it advances and their
//! caches. The dense layers see all the batch's tokens as one matrix; attention runs per
//! sequence because each has its own length.

use std::sync::OnceLock;

use candle_core::{DType, Device, IndexOp, Tensor};
use rayon::prelude::*;

use crate::attention::{self, Scores};
use crate::embedding::Embedding;
use crate::error::{EngineError, Result};
use crate::kv_cache::{KvLayout, SeqCache};
use crate::weights::{Linear, Stacked};
use ffn::Ffn;
use text::{ModelConfig, RopeStyle};

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
        Ok(candle_nn::ops::rms_norm(&heads, weight, eps)?.reshape((rows, width))?)
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
        KvLayout::for_model(&self.cfg)
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
        for (li, layer) in self.layers.iter().enumerate() {
            xs = self.layer_forward(li, layer, xs, batch, &spans)?;
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

    /// One layer over the batch's rows `xs`, its K/V appended to each sequence's cache.
    fn layer_forward(
        &self,
        li: usize,
        layer: &Layer,
        xs: Tensor,
        batch: &[SeqInput<'_>],
        spans: &[(usize, usize)],
    ) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps as f32;
        let norm = |x: &Tensor, w: &Tensor| candle_nn::ops::rms_norm(x, w, eps);
        let h = norm(&xs, &layer.attn_norm)?;
        let mut qkv = layer.qkv.forward(&h)?;
        if let Some(n) = &layer.qk_norm {
            qkv[0] = QkNorm::apply(&qkv[0], &n.q, eps)?;
            qkv[1] = QkNorm::apply(&qkv[1], &n.k, eps)?;
        }
        let (q, k, v) = (&qkv[0], &qkv[1], &qkv[2]);
        let outs = self.attend_all(li, batch, spans, q, k, v)?;
        let mut attn = layer.o.forward(&Tensor::cat(&outs, 0)?)?;
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
        let rows = candle_nn::ops::rms_norm(rows, &self.norm, self.cfg.rms_norm_eps as f32)?;
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

    /// Each sequence's attention, in batch order. Sequences attend independently, so they
    /// spread over the cores, and each one's values do not depend on where it runs. A
    /// decode step (one new row each) spreads over candle's pool, the one the products
    /// use: over rayon's, each pool's idle thread spun on the cores the other's threads
    /// needed (median batch-16 step 5% faster, slowest of eight runs 408 tokens/s against
    /// 336). Prompts keep rayon's pool, where their blocks of rows spread in turn; a lone
    /// decoding sequence spreads its heads instead.
    fn attend_all(
        &self,
        layer: usize,
        batch: &[SeqInput<'_>],
        spans: &[(usize, usize)],
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let one = |i: usize, spread: bool| {
            let (row, t) = spans[i];
            self.attend(
                spread,
                layer,
                batch[i].cache,
                &q.narrow(0, row, t)?,
                &k.narrow(0, row, t)?,
                &v.narrow(0, row, t)?,
            )
        };
        if batch.len() == 1 {
            return Ok(vec![one(0, true)?]);
        }
        if spans.iter().any(|&(_, t)| t > 1) {
            return (0..batch.len())
                .into_par_iter()
                .map(|i| one(i, false))
                .collect();
        }
        let done: Vec<OnceLock<Result<Tensor>>> = batch.iter().map(|_| OnceLock::new()).collect();
        candle_core::utils::barrier_pool().execute_chunked(batch.len(), |range| {
            for i in range {
                let _ = done[i].set(one(i, false));
            }
        });
        done.into_iter()
            .map(|d| d.into_inner().expect("every sequence attended"))
            .collect()
    }

    /// Causal attention of `t` new rows of one sequence over its cache plus themselves.
    /// Heads sharing a K/V head are folded into one matrix, so K/V are never repeated.
    fn attend(
        &self,
        spread: bool,
        layer: usize,
        cache: &SeqCache,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (t, hd) = (q.dim(0)?, cfg.head_dim);
        let (n_heads, n_kv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let pos = cache.len();
        let how = self.scores(layer);
        let tables = match (&self.sliding_rope, how.window) {
            (Some(sliding), Some(_)) => sliding,
            _ => &self.rope,
        };
        let q = self.rope(tables, &q.reshape((t, n_heads, hd))?.transpose(0, 1)?, pos)?;
        let k = self.rope(tables, &k.reshape((t, n_kv, hd))?.transpose(0, 1)?, pos)?;
        let v = v.reshape((t, n_kv, hd))?.transpose(0, 1)?.contiguous()?;
        cache.write(layer, &k, &v)?;
        let (keys, values) = cache.view(layer, t)?;
        if self.device.is_cpu() {
            attention::causal(&q, &keys, &values, how, spread)
        } else {
            // Off the CPU, where none of our kernels run.
            attention::generic(&q, &keys, &values, how)
        }
    }

    /// How layer `layer` forms its attention scores: scaled by the head size's inverse
    /// root (Gemma: `query_pre_attn_scalar`'s), soft-capped where Gemma 2 caps them,
    /// over the layer's window.
    fn scores(&self, layer: usize) -> Scores {
        let gemma = self.cfg.gemma.as_ref();
        let scale = match gemma {
            Some(g) => g.query_pre_attn_scalar.powf(-0.5),
            None => 1.0 / (self.cfg.head_dim as f64).sqrt(),
        };
        Scores {
            scale,
            softcap: gemma.and_then(|g| g.attn_logit_softcapping),
            window: self.cfg.attention_windows[layer],
        }
    }

    /// Rotates `(heads, t, head_dim)` for positions `pos .. pos + t` by `tables`: the
    /// leading `rotary_dim` dimensions of each head, the others passed through.
    fn rope(&self, tables: &RopeTables, x: &Tensor, pos: usize) -> Result<Tensor> {
        let t = x.dim(1)?;
        let cos = tables.cos.narrow(0, pos, t)?;
        let sin = tables.sin.narrow(0, pos, t)?;
        let (rotary, head_dim) = (self.cfg.rotary_dim, self.cfg.head_dim);
        let x = x.unsqueeze(0)?;
        let rotating = x.narrow(3, 0, rotary)?.contiguous()?;
        let y = match self.cfg.rope_style {
            RopeStyle::Half => candle_nn::rotary_emb::rope(&rotating, &cos, &sin)?,
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&rotating, &cos, &sin)?,
        };
        let y = if rotary < head_dim {
            Tensor::cat(&[y, x.narrow(3, rotary, head_dim - rotary)?], 3)?
        } else {
            y
        };
        Ok(y.squeeze(0)?)
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

/// Index of the largest logit; ties go to the lowest id, as `torch.argmax` does.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}
