//! Per-sequence KV state that the caller owns, and its wire form.
//!
//! A `SeqCache` holds, for every layer, K and V as `(kv_heads, capacity, head_dim)` f16
//! tensors of which the first `len()` positions are filled. f16, as llama.cpp's caches are
//! by default: half of f32's bytes to keep, to send, and for every decode step to read (a
//! batch-16 step at 145 keys read 107 MB of f32 cache, as many bytes as the weights).
//! It leaves the process as `KvChunk`s (one layer, a run of positions) that can be sent
//! while later layers are still being computed, and `KvAssembler` rebuilds it bit for bit
//! on the other side.

use bytes::Bytes;
use candle_core::{DType, Device, Tensor};
use half::f16;

use crate::error::{EngineError, Result};
use text::ModelConfig;

mod assembler;
mod dtype;
mod quantize;
mod staging;
mod storage;
pub use assembler::{ChunkWrite, KvAssembler};
#[cfg(feature = "cuda")]
pub(crate) use dtype::F16_BYTES;
pub use dtype::{KvDtype, UnknownKvDtype, KV_DTYPE, Q8_0_BYTES, Q8_0_VALUES};
pub(crate) use quantize::quantize_row;
pub use staging::{Staged, Stager};
use storage::{Locate, WriteRows, ZeroFrom};

/// Positions are allocated in multiples of this, so growth does not copy every step.
const GROW_TOKENS: usize = 64;

/// The allocator's bookkeeping before each allocation (glibc's chunk header).
const ALLOC_HEADER: usize = 16;
/// The unit the kernel maps memory in.
const PAGE: usize = 4096;

/// Most K+V bytes one position may take over all layers (the largest models take about
/// 1 MiB a position): a layout past it is garbage, not a model.
const MAX_POSITION_BYTES: usize = 4 << 20;

/// More layers than any model has: a layout past it is garbage, not a model, and one
/// tensor pair per layer is allocated before any position.
const MAX_LAYERS: usize = 4096;

/// What a cache must agree on to be moved between two engines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Element type of the K/V payloads.
    pub dtype: KvDtype,
}

impl KvLayout {
    /// The layout a model's caches have when they hold `dtype`.
    pub fn for_model(cfg: &ModelConfig, dtype: KvDtype) -> Self {
        Self {
            n_layers: cfg.num_hidden_layers,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            dtype,
        }
    }

    /// Bytes of one head's row: one position's K (or V) in one head of one layer.
    pub fn head_row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.head_dim)
    }

    /// Bytes of K (or of V) that one position of one layer takes.
    pub fn bytes_per_token_layer(&self) -> usize {
        self.n_kv_heads * self.head_row_bytes()
    }

    /// Bytes of K and V that one position takes over every layer.
    pub fn bytes_per_position(&self) -> usize {
        2 * self.n_layers * self.bytes_per_token_layer()
    }

    /// Memory a cache of `positions` takes from the allocator: each layer's K and V are one
    /// allocation each, which costs its bytes and the allocator's header, rounded up to
    /// whole pages, as a block mapped on its own takes them (a node takes every block from
    /// its arena instead, `runtime::hold_freed_memory`, which takes no more). A budget
    /// counted in this unit counts resident memory.
    pub fn resident_bytes(&self, positions: usize) -> usize {
        let one = positions
            .saturating_mul(self.bytes_per_token_layer())
            .saturating_add(ALLOC_HEADER);
        2 * self.n_layers * one.next_multiple_of(PAGE)
    }

    /// Checks a layout that came from elsewhere (a transfer header): no empty dimension,
    /// rows of whole blocks, and sizes whose arithmetic cannot overflow (its dtype is one
    /// the engine stores by its type). Returns the K+V bytes of one position over all
    /// layers.
    pub fn validate(&self) -> Result<usize> {
        let bad = |why: String| Err(EngineError::BadKv(format!("layout {self:?}: {why}")));
        if self.n_layers == 0 || self.n_kv_heads == 0 || self.head_dim == 0 {
            return bad("a dimension is 0".into());
        }
        if self.n_layers > MAX_LAYERS {
            return bad(format!("more than {MAX_LAYERS} layers"));
        }
        if !self.dtype.holds(self.head_dim) {
            return bad(format!(
                "{} rows of {} values are not whole blocks",
                self.dtype.name(),
                self.head_dim
            ));
        }
        let per_position = self
            .dtype
            .checked_row_bytes(self.head_dim)
            .and_then(|x| x.checked_mul(self.n_kv_heads))
            .and_then(|x| x.checked_mul(2 * self.n_layers))
            .filter(|&x| x <= MAX_POSITION_BYTES);
        match per_position {
            Some(bytes) => Ok(bytes),
            None => bad(format!(
                "one position would take more than {MAX_POSITION_BYTES} bytes"
            )),
        }
    }
}

/// f16 values seen as their bytes, so that a cache export becomes `Bytes` without a copy.
struct F16Bytes(Vec<f16>);

impl AsRef<[u8]> for F16Bytes {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

#[cfg(target_endian = "big")]
compile_error!("KV chunks travel as little-endian f16 in native order");

/// One layer's K and V for the positions `start .. start + len`, as the cache stores them:
/// `(kv_heads, len)` rows of a head's values, each little-endian f16 or Q8_0 blocks
/// ([`KvDtype`]).
#[derive(Debug, Clone, PartialEq)]
pub struct KvChunk {
    pub layer: u32,
    pub start: u32,
    pub len: u32,
    pub k: Bytes,
    pub v: Bytes,
}

#[derive(Debug, Clone)]
pub(crate) struct LayerKv {
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
}

/// The KV state of one sequence across all layers. Not `Clone`: a clone of the tensors
/// would share their storage, and the next write would show in both; use `fork`.
#[derive(Debug)]
pub struct SeqCache {
    layout: KvLayout,
    layers: Vec<LayerKv>,
    capacity: usize,
    tokens: Vec<u32>,
    device: Device,
}

/// How new storage starts out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fill {
    Zeros,
    /// Not written: zeroing a received cache cost as much as copying its bytes in. Only
    /// the assembler uses it, which writes every position before the cache is read (the
    /// received ones from the wire, the rest zeroed in `finish`) and keeps only what it
    /// has written when it grows.
    Unwritten,
}

/// Storage for `capacity` positions of every layer.
///
/// # Safety
/// With `Fill::Unwritten` every position must be written before it is read.
unsafe fn alloc(
    layout: &KvLayout,
    capacity: usize,
    device: &Device,
    fill: Fill,
) -> Result<Vec<LayerKv>> {
    let dtype = layout.dtype;
    let shape = (
        layout.n_kv_heads,
        capacity,
        dtype.row_elems(layout.head_dim),
    );
    let make = || match fill {
        Fill::Zeros => Tensor::zeros(shape, dtype.storage(), device),
        Fill::Unwritten => Tensor::empty(shape, dtype.storage(), device),
    };
    (0..layout.n_layers)
        .map(|_| {
            Ok(LayerKv {
                k: make()?,
                v: make()?,
            })
        })
        .collect()
}

impl SeqCache {
    /// An empty cache for a model with this layout. A Q8_0 cache is the CPU's only: no GPU
    /// kernel reads its blocks.
    pub fn new(layout: KvLayout, device: &Device) -> Result<Self> {
        layout.dtype.check(layout.head_dim, device)?;
        Ok(Self {
            // SAFETY: zeroed storage is written.
            layers: unsafe { alloc(&layout, 0, device, Fill::Zeros)? },
            layout,
            capacity: 0,
            tokens: Vec::new(),
            device: device.clone(),
        })
    }

    /// An independent copy of the cache, in storage of its own: one prompt's KV serving
    /// several sequences (n > 1).
    pub fn fork(&self) -> Result<Self> {
        self.copied(&self.device, Tensor::copy)
    }

    /// The cache in `device`'s memory: itself where it is there already, else a copy of
    /// its storage. A received cache is assembled in host memory, where the wire's bytes
    /// are written in place, and moves to a GPU whole.
    pub fn into_device(self, device: &Device) -> Result<Self> {
        if self.device.same_device(device) {
            return Ok(self);
        }
        self.copied(device, |t| t.to_device(device))
    }

    /// The same positions in new storage on `device`, each layer's K and V made by `copy`.
    fn copied(
        &self,
        device: &Device,
        copy: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerKv {
                    k: copy(&l.k)?,
                    v: copy(&l.v)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layout: self.layout.clone(),
            layers,
            capacity: self.capacity,
            tokens: self.tokens.clone(),
            device: device.clone(),
        })
    }

    /// The layout the cache was made for.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Number of positions whose K/V are stored.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether no position is stored yet.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The token ids the stored positions came from, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Bytes the cache's tensors occupy, filled or not.
    pub fn allocated_bytes(&self) -> usize {
        self.capacity * self.layout.bytes_per_position()
    }

    /// Makes room for `extra` more positions, keeping what is stored.
    pub(crate) fn reserve(&mut self, extra: usize) -> Result<()> {
        let need = self.len() + extra;
        if need <= self.capacity {
            return Ok(());
        }
        let capacity = rounded(need.max(self.capacity * 2));
        self.resize(capacity, self.len())
    }

    /// Sizes the storage to hold `positions` in all (never less than it holds), so later
    /// steps do not reallocate: a decode node reserves a sequence's whole budget up front
    /// and accounts exactly what it allocated.
    pub fn reserve_exact(&mut self, positions: usize) -> Result<()> {
        if positions <= self.capacity {
            return Ok(());
        }
        self.resize(positions, self.len())
    }

    /// Positions the storage holds without growing.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Moves the cache into zeroed storage of `capacity` positions, keeping the first
    /// `keep`.
    fn resize(&mut self, capacity: usize, keep: usize) -> Result<()> {
        let kept = vec![keep; self.layers.len()];
        // SAFETY: zeroed storage is written.
        unsafe { self.move_to(capacity, &kept, Fill::Zeros) }
    }

    /// Moves the cache into new storage of `capacity` positions, keeping the first
    /// `kept[layer]` positions of each layer.
    ///
    /// # Safety
    /// As `alloc`.
    unsafe fn move_to(&mut self, capacity: usize, kept: &[usize], fill: Fill) -> Result<()> {
        let grown = alloc(&self.layout, capacity, &self.device, fill)?;
        for ((new, old), &keep) in grown.iter().zip(&self.layers).zip(kept) {
            if keep > 0 {
                new.k
                    .slice_set(&old.k.narrow(1, 0, keep)?.contiguous()?, 1, 0)?;
                new.v
                    .slice_set(&old.v.narrow(1, 0, keep)?.contiguous()?, 1, 0)?;
            }
        }
        self.layers = grown;
        self.capacity = capacity;
        Ok(())
    }

    /// Zeroes positions `from ..` of every layer, up to the capacity.
    fn zero_from(&self, from: usize) -> Result<()> {
        for l in &self.layers {
            l.k.inplace_op1(&ZeroFrom(from))?;
            l.v.inplace_op1(&ZeroFrom(from))?;
        }
        Ok(())
    }

    /// Writes K/V `(kv_heads, n, head_dim)` for positions `len() .. len() + n` of one layer,
    /// rounded to f16 or quantized to Q8_0 (as [`SeqCache::write_row`] writes each);
    /// `reserve` must have made room. The position count moves only in `commit`.
    pub(crate) fn write(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let l = &self.layers[layer];
        match self.layout.dtype {
            KvDtype::F16 => {
                l.k.slice_set(&k.to_dtype(DType::F16)?, 1, self.len())?;
                l.v.slice_set(&v.to_dtype(DType::F16)?, 1, self.len())?;
            }
            KvDtype::Q8_0 => {
                let rows = k.dim(1)?;
                for (store, t) in [(&l.k, k), (&l.v, v)] {
                    let values: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                    self.write_rows(store, rows, &values)?;
                }
            }
        }
        Ok(())
    }

    /// [`SeqCache::write`] of one position from slices: `k` and `v` are its `kv_heads *
    /// head_dim` values, rounded to f16 as candle's conversion rounds them, or quantized
    /// to Q8_0 as candle's (and GGML's reference code) quantize a row. A decode step writes
    /// each sequence's row from the pool thread that attends it.
    pub(crate) fn write_row(&self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let l = &self.layers[layer];
        self.write_rows(&l.k, 1, k)?;
        self.write_rows(&l.v, 1, v)
    }

    /// Writes `rows` positions from `len()` on into one layer's K or V storage: `values`
    /// are `(kv_heads, rows, head_dim)`.
    fn write_rows(&self, store: &Tensor, rows: usize, values: &[f32]) -> Result<()> {
        let at = self.len();
        if at + rows > self.capacity {
            return Err(EngineError::KvCache(format!(
                "no room reserved for positions {at}..{}",
                at + rows
            )));
        }
        store.inplace_op1(&WriteRows {
            at,
            rows,
            dtype: self.layout.dtype,
            values,
        })?;
        Ok(())
    }

    /// K and V of one layer for the stored positions plus `pending` just written.
    pub(crate) fn view(&self, layer: usize, pending: usize) -> Result<(Tensor, Tensor)> {
        let l = &self.layers[layer];
        let n = self.len() + pending;
        Ok((l.k.narrow(1, 0, n)?, l.v.narrow(1, 0, n)?))
    }

    /// One layer's K and V storage, all `capacity()` positions: what a GPU's decode step
    /// writes its new row into and attends over (`attention::step`).
    #[cfg(feature = "cuda")]
    pub(crate) fn layer(&self, layer: usize) -> &LayerKv {
        &self.layers[layer]
    }

    /// Records that `tokens` now have K/V in every layer.
    pub(crate) fn commit(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    /// Drops every position from `len` on, so a shared prefix can be reused.
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
    }

    /// One layer's K/V for `start .. start + len`, in wire form. Positions written by a
    /// forward pass still running count once that layer is done (`pending`).
    pub fn export(&self, layer: usize, start: usize, len: usize) -> Result<KvChunk> {
        self.export_pending(layer, start, len, 0)
    }

    /// `export` during `Model::forward_with`: the `pending` positions of the running call
    /// count for the layers it has finished.
    pub fn export_pending(
        &self,
        layer: usize,
        start: usize,
        len: usize,
        pending: usize,
    ) -> Result<KvChunk> {
        self.check_export(layer, start, len, pending)?;
        let l = &self.layers[layer];
        let bytes = |t: &Tensor| -> Result<Bytes> {
            let run = t.narrow(1, start, len)?.flatten_all()?;
            Ok(match self.layout.dtype {
                KvDtype::F16 => Bytes::from_owner(F16Bytes(run.to_vec1()?)),
                KvDtype::Q8_0 => Bytes::from(run.to_vec1::<u8>()?),
            })
        };
        Ok(KvChunk {
            layer: layer as u32,
            start: start as u32,
            len: len as u32,
            k: bytes(&l.k)?,
            v: bytes(&l.v)?,
        })
    }

    /// Whether `export_pending` may take these positions.
    fn check_export(&self, layer: usize, start: usize, len: usize, pending: usize) -> Result<()> {
        if layer >= self.layout.n_layers || start + len > self.len() + pending {
            return Err(EngineError::KvCache(format!(
                "export of layer {layer} positions {start}..{} out of range",
                start + len
            )));
        }
        Ok(())
    }

    /// The whole cache as chunks of at most `max_tokens` positions, layer by layer.
    pub fn export_all(&self, max_tokens: usize) -> Result<Vec<KvChunk>> {
        let step = max_tokens.max(1);
        let mut out = Vec::new();
        for layer in 0..self.layout.n_layers {
            for start in (0..self.len()).step_by(step) {
                out.push(self.export(layer, start, step.min(self.len() - start))?);
            }
        }
        Ok(out)
    }
}

/// `positions` rounded up to the allocation unit.
fn rounded(positions: usize) -> usize {
    positions.div_ceil(GROW_TOKENS) * GROW_TOKENS
}
