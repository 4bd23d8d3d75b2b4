//! Per-sequence KV state that the caller owns, and its wire form.
//!
//! A `SeqCache` holds, for every layer, K and V as `(kv_heads, capacity, head_dim)` f32
//! tensors of which the first `len()` positions are filled. It leaves the process as
//! `KvChunk`s (one layer, a run of positions) that can be sent while later layers are still
//! being computed, and `KvAssembler` rebuilds it bit for bit on the other side.

use bytes::Bytes;
use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// Positions are allocated in multiples of this, so growth does not copy every step.
const GROW_TOKENS: usize = 64;

/// What a cache must agree on to be moved between two engines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Element type of the K/V payloads; always `f32` today.
    pub dtype: String,
}

impl KvLayout {
    /// The layout a model's caches have.
    pub fn for_model(cfg: &ModelConfig) -> Self {
        Self {
            n_layers: cfg.num_hidden_layers,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            dtype: "f32".into(),
        }
    }

    /// Bytes of K (or of V) that one position of one layer takes.
    pub fn bytes_per_token_layer(&self) -> usize {
        self.n_kv_heads * self.head_dim * 4
    }
}

/// f32 values seen as their bytes, so that a cache export becomes `Bytes` without a copy.
struct F32Bytes(Vec<f32>);

impl AsRef<[u8]> for F32Bytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: any f32 is 4 initialized bytes, and u8 needs no alignment.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * 4) }
    }
}

#[cfg(target_endian = "big")]
compile_error!("KV chunks travel as little-endian f32 in native order");

/// One layer's K and V for the positions `start .. start + len`, as little-endian f32
/// in `(kv_heads, len, head_dim)` order.
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
}

fn alloc(layout: &KvLayout, capacity: usize, device: &Device) -> Result<Vec<LayerKv>> {
    let shape = (layout.n_kv_heads, capacity, layout.head_dim);
    (0..layout.n_layers)
        .map(|_| {
            Ok(LayerKv {
                k: Tensor::zeros(shape, DType::F32, device)?,
                v: Tensor::zeros(shape, DType::F32, device)?,
            })
        })
        .collect()
}

impl SeqCache {
    /// An empty cache for a model with this layout.
    pub fn new(layout: KvLayout, device: &Device) -> Result<Self> {
        Ok(Self {
            layers: alloc(&layout, 0, device)?,
            layout,
            capacity: 0,
            tokens: Vec::new(),
        })
    }

    /// An independent copy of the cache, in storage of its own: one prompt's KV serving
    /// several sequences (n > 1).
    pub fn fork(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerKv {
                    k: l.k.copy()?,
                    v: l.v.copy()?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layout: self.layout.clone(),
            layers,
            capacity: self.capacity,
            tokens: self.tokens.clone(),
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
        2 * self.layout.n_layers * self.capacity * self.layout.bytes_per_token_layer()
    }

    /// Makes room for `extra` more positions, keeping what is stored.
    pub(crate) fn reserve(&mut self, extra: usize) -> Result<()> {
        let need = self.len() + extra;
        if need <= self.capacity {
            return Ok(());
        }
        self.resize(need.max(self.capacity * 2).div_ceil(GROW_TOKENS) * GROW_TOKENS)
    }

    /// Sizes the storage to hold `positions` in all (never less than it holds), so later
    /// steps do not reallocate: a decode node reserves a sequence's whole budget up front
    /// and accounts exactly what it allocated.
    pub fn reserve_exact(&mut self, positions: usize) -> Result<()> {
        if positions <= self.capacity {
            return Ok(());
        }
        self.resize(positions)
    }

    /// Positions the storage holds without growing.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn resize(&mut self, capacity: usize) -> Result<()> {
        let device = self.layers[0].k.device().clone();
        let grown = alloc(&self.layout, capacity, &device)?;
        if !self.is_empty() {
            for (new, old) in grown.iter().zip(&self.layers) {
                new.k
                    .slice_set(&old.k.narrow(1, 0, self.len())?.contiguous()?, 1, 0)?;
                new.v
                    .slice_set(&old.v.narrow(1, 0, self.len())?.contiguous()?, 1, 0)?;
            }
        }
        self.layers = grown;
        self.capacity = capacity;
        Ok(())
    }

    /// Writes K/V `(kv_heads, n, head_dim)` for positions `len() .. len() + n` of one layer;
    /// `reserve` must have made room. The position count moves only in `commit`.
    pub(crate) fn write(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let l = &self.layers[layer];
        l.k.slice_set(k, 1, self.len())?;
        l.v.slice_set(v, 1, self.len())?;
        Ok(())
    }

    /// K and V of one layer for the stored positions plus `pending` just written.
    pub(crate) fn view(&self, layer: usize, pending: usize) -> Result<(Tensor, Tensor)> {
        let l = &self.layers[layer];
        let n = self.len() + pending;
        Ok((l.k.narrow(1, 0, n)?, l.v.narrow(1, 0, n)?))
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
        if layer >= self.layout.n_layers || start + len > self.len() + pending {
            return Err(EngineError::KvCache(format!(
                "export of layer {layer} positions {start}..{} out of range",
                start + len
            )));
        }
        let l = &self.layers[layer];
        let bytes = |t: &Tensor| -> Result<Bytes> {
            let data: Vec<f32> = t.narrow(1, start, len)?.flatten_all()?.to_vec1()?;
            Ok(Bytes::from_owner(F32Bytes(data)))
        };
        Ok(KvChunk {
            layer: layer as u32,
            start: start as u32,
            len: len as u32,
            k: bytes(&l.k)?,
            v: bytes(&l.v)?,
        })
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

/// Rebuilds a `SeqCache` from chunks that arrive in order within each layer.
#[derive(Debug)]
pub struct KvAssembler {
    cache: SeqCache,
    expected: Vec<u32>,
    filled: Vec<usize>,
}

impl KvAssembler {
    /// Expects K/V for `tokens` in a cache of `layout`.
    pub fn new(layout: KvLayout, tokens: Vec<u32>, device: &Device) -> Result<Self> {
        let mut cache = SeqCache::new(layout, device)?;
        cache.reserve(tokens.len())?;
        let n_layers = cache.layout.n_layers;
        Ok(Self {
            cache,
            expected: tokens,
            filled: vec![0; n_layers],
        })
    }

    /// Positions received so far, summed over layers.
    pub fn received_tokens(&self) -> usize {
        self.filled.iter().sum()
    }

    /// Stores one chunk; it must continue its layer where the previous one stopped.
    pub fn accept(&mut self, chunk: &KvChunk) -> Result<()> {
        let layer = chunk.layer as usize;
        let (start, len) = (chunk.start as usize, chunk.len as usize);
        let bad = |why: String| Err(EngineError::KvCache(why));
        if layer >= self.filled.len() {
            return bad(format!("chunk for layer {layer} of {}", self.filled.len()));
        }
        if start != self.filled[layer] || start + len > self.expected.len() {
            return bad(format!(
                "layer {layer}: chunk {start}..{} does not follow {} of {}",
                start + len,
                self.filled[layer],
                self.expected.len()
            ));
        }
        let layout = &self.cache.layout;
        let want = len * layout.bytes_per_token_layer();
        if chunk.k.len() != want || chunk.v.len() != want {
            return bad(format!(
                "layer {layer}: payloads of {} and {} bytes, expected {want}",
                chunk.k.len(),
                chunk.v.len()
            ));
        }
        let shape = [layout.n_kv_heads, len, layout.head_dim];
        let device = self.cache.layers[layer].k.device().clone();
        // One copy from the wire's bytes (native order is the wire's little-endian on every
        // target we build for) into a tensor, one into the cache.
        let tensor = |bytes: &[u8]| Tensor::from_raw_buffer(bytes, DType::F32, &shape, &device);
        let l = &self.cache.layers[layer];
        l.k.slice_set(&tensor(&chunk.k)?, 1, start)?;
        l.v.slice_set(&tensor(&chunk.v)?, 1, start)?;
        self.filled[layer] += len;
        Ok(())
    }

    /// Whether every layer has every position.
    pub fn is_complete(&self) -> bool {
        self.filled.iter().all(|&n| n == self.expected.len())
    }

    /// The rebuilt cache, once complete.
    pub fn finish(self) -> Result<SeqCache> {
        if !self.is_complete() {
            return Err(EngineError::KvCache(format!(
                "incomplete transfer: {} of {} positions per layer",
                self.filled.iter().min().copied().unwrap_or(0),
                self.expected.len()
            )));
        }
        let mut cache = self.cache;
        cache.commit(&self.expected);
        Ok(cache)
    }
}
