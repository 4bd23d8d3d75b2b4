//! A layer's attention over the batch's caches: each sequence's new rows rotated to their
//! positions, written to its cache, and attended over everything the cache holds.

use candle_core::Tensor;
use rayon::prelude::*;

use super::{Model, RopeTables, SeqInput, StepTables};
use crate::attention::{self, Scores};
use crate::cpu_rows::CpuRows;
use crate::error::{EngineError, Result};
use crate::kv_cache::SeqCache;
use crate::rope;
use crate::split::{map_on_pool, SharedOut};
use text::RopeStyle;

impl Model {
    /// Each sequence's attention, in batch order, as `(rows, heads * head_dim)`.
    /// Sequences attend independently, so they spread over the cores, and each one's values
    /// do not depend on where it runs. A decode step (one new row each) goes to
    /// [`Model::attend_step`]; prompts spread over rayon's pool, where their blocks of rows
    /// spread in turn. `step` is the decode step's rotations, where the pass is one.
    #[allow(clippy::too_many_arguments)] // the layer's inputs, as `layer_forward` has them
    pub(super) fn attend_all(
        &self,
        layer: usize,
        batch: &[SeqInput<'_>],
        spans: &[(usize, usize)],
        step: Option<&StepTables>,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        if let Some(step) = step {
            return self.attend_step(layer, batch, step, q, k, v);
        }
        let outs = (0..batch.len())
            .into_par_iter()
            .map(|i| {
                let (row, t) = spans[i];
                self.attend(
                    layer,
                    batch[i].cache,
                    &q.narrow(0, row, t)?,
                    &k.narrow(0, row, t)?,
                    &v.narrow(0, row, t)?,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&outs, 0)?)
    }

    /// Causal attention of `t` new rows of one sequence over its cache plus themselves.
    /// Heads sharing a K/V head are folded into one matrix, so K/V are never repeated.
    fn attend(
        &self,
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
        let tables = self.tables(&how);
        let cos = tables.cos.narrow(0, pos, t)?;
        let sin = tables.sin.narrow(0, pos, t)?;
        let heads_first = |x: &Tensor, heads: usize| -> Result<Tensor> {
            Ok(x.reshape((1, t, heads, hd))?.transpose(1, 2)?)
        };
        let q = self
            .rotate(&heads_first(q, n_heads)?, &cos, &sin)?
            .squeeze(0)?;
        let k = self
            .rotate(&heads_first(k, n_kv)?, &cos, &sin)?
            .squeeze(0)?;
        let v = heads_first(v, n_kv)?.squeeze(0)?.contiguous()?;
        cache.write(layer, &k, &v)?;
        let (keys, values) = cache.view(layer, t)?;
        if self.device.is_cpu() {
            attention::causal(&q, &keys, &values, how, false)
        } else {
            // Off the CPU, where none of our kernels run.
            attention::generic(&q, &keys, &values, how)
        }
    }

    /// A decode step's attention: one new row for each sequence, each at its own position
    /// (`step`'s rows of the rotation tables, gathered once for all layers). On the CPU
    /// each sequence's item rotates its query and key, writes its key and value to its
    /// cache and attends with our kernel: a batch's items over candle's pool, the one the
    /// products use (over rayon's, each pool's idle thread spun on the cores the other's
    /// threads needed: median batch-16 step 5% faster, slowest of eight runs 408 tokens/s
    /// against 336), a lone sequence's heads over it instead. Rotated and written by
    /// candle's ops before the items instead, they ran on the thread that hands the work
    /// out while the pool's other thread waited. On a GPU one kernel writes every
    /// sequence's K/V and one attends every sequence's heads, however many there are.
    fn attend_step(
        &self,
        layer: usize,
        batch: &[SeqInput<'_>],
        step: &StepTables,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (n, hd) = (batch.len(), cfg.head_dim);
        let (n_heads, n_kv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let how = self.scores(layer);
        let RopeTables { cos, sin } = step.for_scores(&how);
        if !self.device.is_cpu() {
            let q = self.rotate(&q.reshape((n, n_heads, 1, hd))?, cos, sin)?;
            let k = self.rotate(&k.reshape((n, n_kv, 1, hd))?, cos, sin)?;
            let v = v.reshape((n, n_kv, 1, hd))?.contiguous()?;
            let caches: Vec<&SeqCache> = batch.iter().map(|s| &*s.cache).collect();
            return attention::step(&q, &k, &v, &caches, layer, how);
        }
        let half = cfg.rotary_dim / 2;
        let (cos, sin) = (cos.reshape((n, half))?, sin.reshape((n, half))?);
        let held = [q, k, v, &cos, &sin].map(|t| t.storage_and_layout());
        let rows = |i: usize, width: usize| {
            CpuRows::of(&held[i].0, held[i].1, n, width).ok_or_else(|| {
                EngineError::InvalidInput(format!(
                    "a CPU decode step's input {i} is not {n} f32 rows of {width} in CPU memory"
                ))
            })
        };
        let (q, k, v) = (
            rows(0, n_heads * hd)?,
            rows(1, n_kv * hd)?,
            rows(2, n_kv * hd)?,
        );
        let (cos, sin) = (rows(3, half)?, rows(4, half)?);
        // Sequence `i`'s query and key rotated into `q_rot` and `k_rot`, its key and value
        // written; its cache's K and V, the new position with them.
        let cache_row = |i: usize, q_rot: &mut [f32], k_rot: &mut [f32]| {
            let (c, s) = (cos.row(i), sin.row(i));
            rope::rotate_row(q.row(i), hd, cfg.rope_style, c, s, q_rot);
            rope::rotate_row(k.row(i), hd, cfg.rope_style, c, s, k_rot);
            let cache = &*batch[i].cache;
            cache.write_row(layer, k_rot, v.row(i))?;
            cache.view(layer, 1)
        };
        let width = n_heads * hd;
        if n == 1 {
            let (mut q_rot, mut k_rot) = (vec![0f32; width], vec![0f32; n_kv * hd]);
            let (keys, values) = cache_row(0, &mut q_rot, &mut k_rot)?;
            let q = Tensor::from_vec(q_rot, (n_heads, 1, hd), &self.device)?;
            return attention::causal(&q, &keys, &values, how, true);
        }
        let mut out = vec![0f32; n * width];
        let shared = SharedOut::new(&mut out);
        map_on_pool(n, |i| {
            ROTATED.with_borrow_mut(|buf| {
                if buf.len() < width + n_kv * hd {
                    buf.resize(width + n_kv * hd, 0.0);
                }
                let (q_rot, k_rot) = buf.split_at_mut(width);
                let (keys, values) = cache_row(i, q_rot, &mut k_rot[..n_kv * hd])?;
                // SAFETY: sequence `i` writes only its own row of the output.
                let row = unsafe { shared.slice(i * width, width) };
                attention::causal_row(q_rot, n_heads, &keys, &values, how, row)
            })
        })
        .into_iter()
        .collect::<Result<()>>()?;
        Ok(Tensor::from_vec(out, (n, width), &self.device)?)
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

    /// The rotation a layer scored `how` uses: the sliding-window layers' own where the
    /// model has one (Gemma 3's).
    fn tables(&self, how: &Scores) -> &RopeTables {
        RopeTables::for_scores(&self.rope, self.sliding_rope.as_ref(), how)
    }

    /// A decode step's rotations: each sequence's row of every table at its own position,
    /// `(n, 1, rotary_dim / 2)`, gathered once for all layers.
    pub(super) fn step_tables(&self, batch: &[SeqInput<'_>]) -> Result<StepTables> {
        let positions: Vec<u32> = batch.iter().map(|s| s.cache.len() as u32).collect();
        let at = Tensor::new(positions.as_slice(), &self.device)?;
        let gather = |t: &RopeTables| -> Result<RopeTables> {
            Ok(RopeTables {
                cos: t.cos.index_select(&at, 0)?.unsqueeze(1)?,
                sin: t.sin.index_select(&at, 0)?.unsqueeze(1)?,
            })
        };
        Ok(StepTables {
            rope: gather(&self.rope)?,
            sliding: self.sliding_rope.as_ref().map(gather).transpose()?,
        })
    }

    /// Rotates `(batch, heads, t, head_dim)` by `cos` and `sin`, `(t, rotary_dim / 2)` for
    /// rows at consecutive positions or `(batch, t, rotary_dim / 2)` for each sequence's
    /// own: the leading `rotary_dim` dimensions of each head, the others passed through.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (rotary, head_dim) = (self.cfg.rotary_dim, self.cfg.head_dim);
        let rotating = x.narrow(3, 0, rotary)?.contiguous()?;
        let y = match self.cfg.rope_style {
            RopeStyle::Half => candle_nn::rotary_emb::rope(&rotating, cos, sin)?,
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&rotating, cos, sin)?,
        };
        if rotary < head_dim {
            Ok(Tensor::cat(
                &[y, x.narrow(3, rotary, head_dim - rotary)?],
                3,
            )?)
        } else {
            Ok(y)
        }
    }
}

thread_local! {
    /// A pool thread's rotated query and key of the sequence it attends: the items of a
    /// decode step are many (a batch of 16 over 30 layers, 480 a step), and both threads
    /// taking memory from the allocator's one arena queued them on its lock (see
    /// `attention::causal_row`).
    static ROTATED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}
