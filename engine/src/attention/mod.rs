//! Causal attention. Off the CPU, where our kernels cannot read the tensors, candle's ops
//! ([`generic`]); on it, the rest of this note.
//!
//! On the CPU: one path for prompts and decode steps alike, whose values for a query row
//! depend only on that row's query, its position and the keys and values up to it, never
//! on how many rows are attended with it.
//!
//! That is what lets a prompt be split anywhere and still give the whole prompt's bits: at
//! a cached prefix, between a prefill node and a decode node, or when a migrated stream is
//! prefilled again. candle's ops could not promise it. `gemm` takes another kernel at 64
//! rows or fewer and a matrix-vector product at one row, and candle's row sum adds a
//! row's tail in another order when the row is longer; a 40-token prompt split 39 + 1 gave
//! logits up to 0.48 apart from the whole.
//!
//! For a query row at position `p` that sees keys `s ..= p` (`s` is 0, or `p + 1 - w` in
//! a layer with a sliding window of `w`), in this order:
//! - each score `s <= j <= p`: eight chains of fused multiply-adds, lane `l` over the head
//!   dimensions `l` modulo 8, the lanes then added in pairs, then times the scale
//!   (`kernels::scores`; over a Q8_0 cache, integer products of the query's own Q8_0
//!   blocks, `q8_scores`), and with a soft cap `c`, `c * tanh(score / c)`;
//! - the softmax of those scores ([`softmax`]);
//! - each output value: one fused multiply-add chain over keys `s ..= p` from zero
//!   (`kernels::weighted_values`). A block of rows runs the chain from the block's
//!   earliest `s`, each row's weights before its own `s` zero: a zero weight adds an exact
//!   zero to a chain still at zero, so the row's bits are the same.

#[cfg(feature = "cuda")]
mod cuda;
mod format;
mod kernels;
mod q8_scores;
mod splits;
#[cfg(target_arch = "x86_64")]
mod zmm;

use std::ops::Range;

use candle_core::{DType, Device, Storage, Tensor, WithDType};
use half::f16;
use rayon::prelude::*;

use crate::error::{EngineError, Result};
use crate::kv_cache::KvDtype;
use crate::split::{map_on_pool, SharedOut};
use crate::vexp::exp_minus;
use format::Format;
use kernels::Kernel;

/// Query rows of one K/V head attended together: they share each pass over its keys, and
/// each key is widened to f32 once a block. Sixteen rather than eight halved the widening
/// and took a 2,048-token prompt's attention from 0.276 to 0.262 of the products' time in a
/// 1.5B (bench/HISTORY.md, "2026-12-07, sixth session").
const ROWS: usize = 16;

/// How one layer forms a row's attention scores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Scores {
    /// What the dot products are multiplied by.
    pub(crate) scale: f64,
    /// Gemma 2's `cap * tanh(score / cap)`, after the scale.
    pub(crate) softcap: Option<f64>,
    /// The keys a row sees: all up to its own, or only the last `window` of them.
    pub(crate) window: Option<usize>,
}

/// Attention of the last `t` positions of a sequence: `q` is `(heads, t, head_dim)`,
/// already rotated; `keys` and `values` are `(kv_heads, len)` views of the cache's rows,
/// f16 or Q8_0 (`SeqCache::view`), rows contiguous, ending with the `t` new positions.
/// Returns `(t, heads * head_dim)`.
///
/// The work goes out in blocks of [`ROWS`] query rows of one K/V head. A prompt's blocks
/// spread over rayon's pool, whose stealing evens out the later rows' longer spans. A decode
/// step has one block per K/V head: with `spread` they go over candle's pool (for a lone
/// sequence, whose workers would otherwise wait), else they run here, as a batch's
/// sequences already share the pool out.
pub(crate) fn causal(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    scores: Scores,
    spread: bool,
) -> Result<Tensor> {
    let (heads, t, hd) = q.dims3()?;
    let mut out = vec![0f32; t * heads * hd];
    let q = q.contiguous()?;
    let (q_store, q_layout) = q.storage_and_layout();
    let q = &cpu_data::<f32>(&q_store)?[q_layout.start_offset()..][..heads * t * hd];
    attend_rows(q, heads, t, keys, values, scores, spread, &mut out)?;
    Ok(Tensor::from_vec(out, (t, heads * hd), keys.device())?)
}

/// [`causal`] of one new row (a decode step's) into `out`, its `heads * head_dim` values:
/// `q` is the row's `heads` rotated query heads, one after another. The blocks run here:
/// for a batch's sequences, which already share candle's pool out, each writing its own
/// row of the batch's output. Nothing here takes memory from the allocator's arena, which
/// both pool threads would otherwise queue on (see [`SCRATCH`]).
pub(crate) fn causal_row(
    q: &[f32],
    heads: usize,
    keys: &Tensor,
    values: &Tensor,
    scores: Scores,
    out: &mut [f32],
) -> Result<()> {
    attend_rows(q, heads, 1, keys, values, scores, false, out)
}

/// [`causal`]'s work, into `out`, `(t, heads * head_dim)`: `q` is `(heads, t, head_dim)`.
#[allow(clippy::too_many_arguments)] // the queries and their shape, the cache, how, where
fn attend_rows(
    q: &[f32],
    heads: usize,
    t: usize,
    keys: &Tensor,
    values: &Tensor,
    scores: Scores,
    spread: bool,
    out: &mut [f32],
) -> Result<()> {
    let Shape {
        hd,
        kv_heads,
        len,
        dtype,
    } = Shape::of(heads, t, keys)?;
    if q.len() != heads * t * hd || out.len() != t * heads * hd {
        return Err(EngineError::InvalidInput(format!(
            "attention of {t} rows of {heads} heads from {} query values into {}",
            q.len(),
            out.len()
        )));
    }
    let pos = len - t;
    if values.dtype() != keys.dtype() || values.dims3()? != keys.dims3()? {
        return Err(EngineError::KvCache("keys and values of two shapes".into()));
    }
    let (k_store, k_layout) = keys.storage_and_layout();
    let (v_store, v_layout) = values.storage_and_layout();
    let row = dtype.row_bytes(hd);
    let k = Heads::new(cpu_bytes(&k_store)?, k_layout, kv_heads, len, row)?;
    let v = Heads::new(cpu_bytes(&v_store)?, v_layout, kv_heads, len, row)?;
    // A K/V head's query rows: those of its `group` query heads, each `t` rows.
    let per_head = heads / kv_heads * t;
    let blocks = per_head.div_ceil(ROWS);
    // Block `item`'s K/V head, its first row and its rows.
    let place = |item: usize| {
        let (h, first) = (item / blocks, item % blocks * ROWS);
        (h, first, ROWS.min(per_head - first))
    };
    let block = |item: usize, out: &mut [f32]| {
        let (h, first, rows) = place(item);
        let spans: [Range<usize>; ROWS] =
            std::array::from_fn(|n| span(pos + (first + n) % t, scores.window));
        let q = &q[(h * per_head + first) * hd..][..rows * hd];
        let (keys, values, spans) = (k.head(h), v.head(h), &spans[..rows]);
        match dtype {
            KvDtype::F16 => attend_block::<format::F16>(q, spans, keys, values, hd, &scores, out),
            KvDtype::Q8_0 => attend_block::<format::Q8>(q, spans, keys, values, hd, &scores, out),
        }
    };
    let items = kv_heads * blocks;
    if t == 1 {
        // Row `i` of K/V head `h` is query head `h * group + i`: the blocks' rows, one
        // after another, are the output's own order.
        let at = |item: usize| {
            let (h, first, rows) = place(item);
            ((h * per_head + first) * hd, rows * hd)
        };
        if spread {
            let shared = SharedOut::new(out);
            map_on_pool(items, |item| {
                let (start, n) = at(item);
                // SAFETY: each block writes only its own rows' values.
                block(item, unsafe { shared.slice(start, n) })
            });
        } else {
            for item in 0..items {
                let (start, n) = at(item);
                block(item, &mut out[start..][..n]);
            }
        }
        return Ok(());
    }
    let outs: Vec<Vec<f32>> = (0..items)
        .into_par_iter()
        .map(|item| {
            let mut o = vec![0f32; place(item).2 * hd];
            block(item, &mut o);
            o
        })
        .collect();
    // Row `i` of K/V head `h` is query head `h * group + i / t` at new position `i % t`.
    for (item, vals) in outs.iter().enumerate() {
        let (h, first, _) = place(item);
        for (n, row) in vals.chunks_exact(hd).enumerate() {
            let i = h * per_head + first + n;
            let (head, r) = (i / t, i % t);
            out[(r * heads + head) * hd..][..hd].copy_from_slice(row);
        }
    }
    Ok(())
}

/// [`causal`] in candle's ops, for a device our kernels cannot read (a GPU): the same
/// inputs and output (of an f16 cache, or of values in f32), widened to f32, the heads
/// sharing a K/V head folded into one matrix (K/V never repeated), scores masked
/// additively. Its values are candle's products' and softmax's, so they may differ with the
/// number of rows attended.
pub(crate) fn generic(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    scores: Scores,
) -> Result<Tensor> {
    let (heads, t, hd) = q.dims3()?;
    let (kv_heads, len, _) = keys.dims3()?;
    Shape::check(heads, t, kv_heads, len)?;
    if !matches!(keys.dtype(), DType::F16 | DType::F32) {
        return Err(EngineError::KvCache(format!(
            "candle's attention reads f16 caches, not {:?}",
            keys.dtype()
        )));
    }
    let (group, pos) = (heads / kv_heads, len - t);
    let keys = keys.to_dtype(DType::F32)?;
    let values = values.to_dtype(DType::F32)?;
    let q = q.reshape((kv_heads, group * t, hd))?;
    let mut s = (q.matmul(&keys.t()?)? * scores.scale)?;
    if let Some(cap) = scores.softcap {
        s = ((s / cap)?.tanh()? * cap)?;
    }
    // A lone new row sees every key unless its window ends before them.
    if t > 1 || scores.window.is_some_and(|w| w <= pos) {
        s = s.broadcast_add(&causal_mask(group, t, pos, scores.window, q.device())?)?;
    }
    let probs = candle_nn::ops::softmax_last_dim(&s)?;
    Ok(probs
        .matmul(&values)?
        .reshape((heads, t, hd))?
        .transpose(0, 1)?
        .reshape((t, heads * hd))?)
}

/// A decode step's attention on a GPU: `q` `(n, heads, 1, head_dim)`, rotated, and `k`,
/// `v` `(n, kv_heads, 1, head_dim)`, each sequence's new row of layer `layer`, with
/// `caches` the `n` sequences' caches, room made for the row. Writes each row into its
/// cache (rounded to f16, as `SeqCache::write`) and returns `(n, heads * head_dim)`, each
/// sequence's attention over its cache, in one kernel launch each however many sequences
/// there are.
#[cfg(feature = "cuda")]
pub(crate) use cuda::step;

/// [`step`] in a build without the `cuda` feature, which can open no GPU to call it on.
#[cfg(not(feature = "cuda"))]
pub(crate) fn step(
    q: &Tensor,
    _k: &Tensor,
    _v: &Tensor,
    _caches: &[&crate::kv_cache::SeqCache],
    _layer: usize,
    _scores: Scores,
) -> Result<Tensor> {
    Err(EngineError::InvalidInput(format!(
        "a decode step on {:?} needs a build with the cuda feature",
        q.device().location()
    )))
}

/// The additive mask of `t` new rows at positions `pos ..` of `group` query heads over
/// `pos + t` keys: 0 where a row sees the key (up to its own position, within `window`),
/// -inf elsewhere. `(group * t, pos + t)`, the heads' rows one after another.
fn causal_mask(
    group: usize,
    t: usize,
    pos: usize,
    window: Option<usize>,
    device: &Device,
) -> Result<Tensor> {
    let keys = pos + t;
    let mut m = Vec::with_capacity(group * t * keys);
    for _ in 0..group {
        for i in 0..t {
            let seen = span(pos + i, window);
            m.extend((0..keys).map(|j| {
                if seen.contains(&j) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            }));
        }
    }
    Ok(Tensor::from_vec(m, (group * t, keys), device)?)
}

/// The sizes of an attention's keys, `kv_heads` heads of `len` rows of `hd` values, and
/// what their rows hold.
#[derive(Debug, Clone, Copy)]
struct Shape {
    hd: usize,
    kv_heads: usize,
    len: usize,
    dtype: KvDtype,
}

impl Shape {
    /// The sizes, where `t` new rows (at least one, at most the keys) of `heads` heads
    /// grouped evenly over the K/V heads of `keys` can attend.
    fn of(heads: usize, t: usize, keys: &Tensor) -> Result<Self> {
        let (kv_heads, len, elems) = keys.dims3()?;
        Self::check(heads, t, kv_heads, len)?;
        let dtype = KvDtype::of_storage(keys.dtype())
            .ok_or_else(|| EngineError::KvCache(format!("a cache of {:?}", keys.dtype())))?;
        let hd = dtype.head_dim_of(elems).ok_or_else(|| {
            EngineError::KvCache(format!("Q8_0 rows of {elems} bytes are not whole blocks"))
        })?;
        Ok(Self {
            hd,
            kv_heads,
            len,
            dtype,
        })
    }

    /// Whether `t` new rows (at least one, at most the keys) of `heads` heads grouped
    /// evenly over `kv_heads` heads of `len` keys can attend.
    fn check(heads: usize, t: usize, kv_heads: usize, len: usize) -> Result<()> {
        if t == 0 || t > len || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(EngineError::InvalidInput(format!(
                "attention of {t} rows of {heads} heads over {len} keys of {kv_heads} heads"
            )));
        }
        Ok(())
    }
}

/// The keys a row at position `p` sees: all up to its own, or the last `window` of them.
fn span(p: usize, window: Option<usize>) -> Range<usize> {
    let start = window.map_or(0, |w| (p + 1).saturating_sub(w));
    start..p + 1
}

/// Working memory a thread's attention blocks reuse: a decode step's blocks are small and
/// many (a batch of 16 over 30 layers, 1,440 a step), and both of candle's pool threads
/// taking each block's few KiB from the allocator's one arena (`runtime::hold_freed_memory`)
/// queued them on its lock, each wait a sleep and a wake-up.
#[derive(Default)]
struct Scratch {
    probs: Vec<f32>,
    work: kernels::Working,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// One block of query rows of a K/V head (rows of `F`): row `r` sees the keys `spans[r]`.
/// Writes the rows' outputs, one after another, into `out`.
fn attend_block<F: Format>(
    q: &[f32],
    spans: &[Range<usize>],
    keys: &[u8],
    values: &[u8],
    head_dim: usize,
    how: &Scores,
    out: &mut [f32],
) {
    assert!(spans.len() <= ROWS, "more rows than a block");
    let from = spans.iter().map(|s| s.start).min().unwrap_or(0);
    let mut visible = [0usize; ROWS];
    let visible = &mut visible[..spans.len()];
    for (v, s) in visible.iter_mut().zip(spans) {
        *v = s.end - from;
    }
    let seen = visible.iter().copied().max().unwrap_or(0);
    let row = format::row_bytes::<F>(head_dim);
    let (keys, values) = (&keys[from * row..], &values[from * row..]);
    SCRATCH.with_borrow_mut(|Scratch { probs, work }| {
        let probs = kernels::grown(probs, visible.len() * seen);
        // Scores past a row's own position are computed with the others' and never read.
        let scale = how.scale as f32;
        let kernel = Kernel::best(head_dim);
        kernels::scores::<F>(kernel, q, keys, seen, head_dim, scale, probs, work);
        for (row, s) in probs.chunks_exact_mut(seen).zip(spans) {
            let (start, end) = (s.start - from, s.end - from);
            row[..start].fill(0.0);
            if let Some(cap) = how.softcap.map(|c| c as f32) {
                row[start..end]
                    .iter_mut()
                    .for_each(|x| *x = (*x / cap).tanh() * cap);
            }
            softmax(&mut row[start..end]);
        }
        kernels::weighted_values::<F>(kernel, probs, seen, visible, values, head_dim, out);
    });
}

/// The softmax of one row of scores, in place. The max and the sum each run in eight lanes
/// (lane `i` takes the scores at `i` modulo 8), the lanes then combined in order; `exp` is
/// `crate::vexp`'s.
fn softmax(row: &mut [f32]) {
    let max = lanes(row, f32::NEG_INFINITY, f32::max);
    exp_minus(row, max);
    let sum = lanes(row, 0.0, |a, b| a + b);
    for x in row.iter_mut() {
        *x /= sum;
    }
}

/// `f` folded over `row` in eight lanes from `init`, then over the lanes in order.
fn lanes(row: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = f(*a, x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(tail) {
        *a = f(*a, x);
    }
    acc.into_iter().reduce(f).unwrap_or(init)
}

/// A tensor's values in CPU memory, as `T` (f32 queries).
fn cpu_data<T: WithDType>(storage: &Storage) -> Result<&[T]> {
    match storage {
        Storage::Cpu(data) => Ok(data.as_slice::<T>()?),
        _ => Err(EngineError::InvalidInput(
            "CPU attention reads tensors in CPU memory".into(),
        )),
    }
}

/// A cache's storage in CPU memory as bytes, and the bytes of one of its elements.
fn cpu_bytes(storage: &Storage) -> Result<Bytes<'_>> {
    match storage {
        Storage::Cpu(candle_core::CpuStorage::F16(data)) => Ok(Bytes {
            data: bytemuck::cast_slice(data),
            elem: size_of::<f16>(),
        }),
        Storage::Cpu(candle_core::CpuStorage::U8(data)) => Ok(Bytes { data, elem: 1 }),
        _ => Err(EngineError::InvalidInput(
            "CPU attention reads f16 or Q8_0 caches in CPU memory".into(),
        )),
    }
}

/// A tensor's storage as bytes, each element `elem` of them.
struct Bytes<'a> {
    data: &'a [u8],
    elem: usize,
}

/// The K or V heads of one layer, as bytes: head `h` is `len` rows of `row` bytes from
/// `h * stride`.
struct Heads<'a> {
    data: &'a [u8],
    stride: usize,
    len: usize,
    row: usize,
}

impl<'a> Heads<'a> {
    fn new(
        Bytes { data, elem }: Bytes<'a>,
        layout: &candle_core::Layout,
        heads: usize,
        len: usize,
        row: usize,
    ) -> Result<Self> {
        let stride: Vec<usize> = layout.stride().iter().map(|s| s * elem).collect();
        let start = layout.start_offset() * elem;
        let fits = stride.len() == 3
            && stride[2] == elem
            && stride[1] == row
            && stride[0] >= len * row
            && start + (heads - 1) * stride[0] + len * row <= data.len();
        if !fits {
            return Err(EngineError::KvCache(
                "cache view is not rows of contiguous heads".into(),
            ));
        }
        Ok(Self {
            data: &data[start..],
            stride: stride[0],
            len,
            row,
        })
    }

    fn head(&self, h: usize) -> &'a [u8] {
        &self.data[h * self.stride..][..self.len * self.row]
    }
}

#[cfg(test)]
mod tests;
