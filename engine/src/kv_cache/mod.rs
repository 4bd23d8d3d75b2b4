//! Per-sequence KV state that the caller owns, and its wire form.
//!
//! A `SeqCache` holds, for every layer, K and V as `(kv_heads, capacity, head_dim)` f32
//! tensors of which the first `len()` positions are filled. It leaves the process as
//! `KvChunk`s (one layer, a run of positions) that can be sent while later layers are still
//! being computed, and `KvAssembler` rebuilds it bit for bit on the other side.

use bytes::Bytes;
use candle_core::{DType, Device, Tensor};

use crate::error::{EngineError, Result};
use text::ModelConfig;

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

    /// Memory a cache of `positions` takes from the allocator: each layer's K and V are one
    /// allocation each, which costs its bytes, the allocator's header, rounded up to whole
    /// pages (large ones are mapped pages of their own; a decode node makes every cache
    /// one: `decode_node::hold_freed_memory`). A budget counted in this unit counts
    /// resident memory.
    pub fn resident_bytes(&self, positions: usize) -> usize {
        let one = positions
            .saturating_mul(self.bytes_per_token_layer())
            .saturating_add(ALLOC_HEADER);
        2 * self.n_layers * one.next_multiple_of(PAGE)
    }

    /// Checks a layout that came from elsewhere (a transfer header): a dtype the engine
    /// stores, no empty dimension, and sizes whose arithmetic cannot overflow. Returns the
    /// K+V bytes of one position over all layers.
    pub fn validate(&self) -> Result<usize> {
        let bad = |why: String| Err(EngineError::KvCache(format!("layout {self:?}: {why}")));
        if self.dtype != "f32" {
            return bad(format!("dtype {:?} is not f32", self.dtype));
        }
        if self.n_layers == 0 || self.n_kv_heads == 0 || self.head_dim == 0 {
            return bad("a dimension is 0".into());
        }
        if self.n_layers > MAX_LAYERS {
            return bad(format!("more than {MAX_LAYERS} layers"));
        }
        let per_position = self
            .n_kv_heads
            .checked_mul(self.head_dim)
            .and_then(|x| x.checked_mul(4 * 2))
            .and_then(|x| x.checked_mul(self.n_layers))
            .filter(|&x| x <= MAX_POSITION_BYTES);
        match per_position {
            Some(bytes) => Ok(bytes),
            None => bad(format!(
                "one position would take more than {MAX_POSITION_BYTES} bytes"
            )),
        }
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
    let shape = (layout.n_kv_heads, capacity, layout.head_dim);
    let make = || match fill {
        Fill::Zeros => Tensor::zeros(shape, DType::F32, device),
        Fill::Unwritten => Tensor::empty(shape, DType::F32, device),
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
    /// An empty cache for a model with this layout.
    pub fn new(layout: KvLayout, device: &Device) -> Result<Self> {
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
            device: self.device.clone(),
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

/// `positions` rounded up to the allocation unit.
fn rounded(positions: usize) -> usize {
    positions.div_ceil(GROW_TOKENS) * GROW_TOKENS
}

/// One layer's `(kv_heads, capacity, head_dim)` storage as an in-place op sees it.
struct LayerStorage<'a> {
    data: &'a mut [f32],
    /// Offset of the layer's first value in `data`.
    first: usize,
    heads: usize,
    capacity: usize,
    head_dim: usize,
}

impl<'a> LayerStorage<'a> {
    fn of(
        storage: &'a mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<Self> {
        let candle_core::CpuStorage::F32(data) = storage else {
            candle_core::bail!("KV caches hold f32");
        };
        let (heads, capacity, head_dim) = layout.shape().dims3()?;
        let Some((first, _)) = layout.contiguous_offsets() else {
            candle_core::bail!("a KV cache layer is one contiguous tensor");
        };
        Ok(Self {
            data,
            first,
            heads,
            capacity,
            head_dim,
        })
    }

    /// Head `h`'s values for positions `start .. start + len`.
    fn run(&mut self, h: usize, start: usize, len: usize) -> &mut [f32] {
        let at = self.first + (h * self.capacity + start) * self.head_dim;
        &mut self.data[at..at + len * self.head_dim]
    }
}

/// Zeroes positions `.0 ..` of one layer's `(kv_heads, capacity, head_dim)` storage.
struct ZeroFrom(usize);

impl candle_core::InplaceOp1 for ZeroFrom {
    fn name(&self) -> &'static str {
        "kv-zero-from"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let mut layer = LayerStorage::of(storage, layout)?;
        let from = self.0.min(layer.capacity);
        for h in 0..layer.heads {
            layer.run(h, from, layer.capacity - from).fill(0.0);
        }
        Ok(())
    }
}

/// Finds where one layer's `(kv_heads, capacity, head_dim)` storage lies, for writing into
/// it from outside an op.
#[derive(Default)]
struct Locate(std::cell::Cell<Option<(*mut f32, usize)>>);

impl candle_core::InplaceOp1 for Locate {
    fn name(&self) -> &'static str {
        "kv-locate"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let layer = LayerStorage::of(storage, layout)?;
        let n = layer.heads * layer.capacity * layer.head_dim;
        if layer.first + n > layer.data.len() {
            candle_core::bail!("a KV cache layer lies outside its storage");
        }
        let at = layer.data[layer.first..].as_mut_ptr();
        self.0.set(Some((at, n)));
        Ok(())
    }
}

/// Rebuilds a `SeqCache` from chunks that arrive in order within each layer. Everything it
/// is given may be garbage (it comes off the network): a bad chunk is an error, never a
/// panic. The cache is allocated once, at the size the caller reserved for it, and the
/// chunks' bytes are written straight into it.
pub struct KvAssembler {
    cache: SeqCache,
    expected: Vec<u32>,
    filled: Vec<usize>,
    /// Each layer's K and V storage: `(start, values)`.
    storage: Vec<[(*mut f32, usize); 2]>,
}

impl std::fmt::Debug for KvAssembler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvAssembler")
            .field("layout", &self.cache.layout)
            .field("expected", &self.expected.len())
            .field("filled", &self.filled)
            .finish_non_exhaustive()
    }
}

// SAFETY: the pointers address storage the assembler's own tensors own, which nothing else
// references (see `new`); moving the assembler to another thread moves that ownership.
unsafe impl Send for KvAssembler {}

/// Where one chunk's bytes go: K's run of each head, then V's, in the order the wire
/// carries them. [`done`](Self::done) records them as received once they are written.
pub struct ChunkWrite<'a> {
    runs: Vec<&'a mut [u8]>,
    filled: &'a mut usize,
    len: usize,
}

impl<'a> ChunkWrite<'a> {
    /// The runs to fill, in wire order; each must be written whole before `done`.
    pub fn runs(&mut self) -> &mut [&'a mut [u8]] {
        &mut self.runs
    }

    /// Records the chunk's positions as received.
    pub fn done(self) {
        *self.filled += self.len;
    }
}

impl KvAssembler {
    /// Expects K/V for `tokens` in a cache of `layout` that holds `capacity` positions in
    /// all (at least the tokens), allocated now: the caller has reserved that memory and
    /// bounded `capacity` by it, and the cache is never moved to grow.
    pub fn new(
        layout: KvLayout,
        tokens: Vec<u32>,
        capacity: usize,
        device: &Device,
    ) -> Result<Self> {
        let per_position = layout.validate()?;
        if tokens.is_empty() {
            return Err(EngineError::KvCache(
                "a transfer covers at least one position".into(),
            ));
        }
        let capacity = capacity.max(tokens.len());
        if capacity.checked_mul(per_position).is_none() {
            return Err(EngineError::KvCache(format!(
                "{capacity} positions of {per_position} bytes do not fit in memory"
            )));
        }
        let mut cache = SeqCache::new(layout, device)?;
        let n_layers = cache.layout.n_layers;
        // SAFETY: the assembler writes every position before the cache leaves it (`finish`).
        unsafe { cache.move_to(capacity, &vec![0; n_layers], Fill::Unwritten)? };
        let locate = |t: &Tensor| -> Result<(*mut f32, usize)> {
            let found = Locate::default();
            t.inplace_op1(&found)?;
            found
                .0
                .get()
                .ok_or_else(|| EngineError::KvCache("a KV layer was not located".into()))
        };
        let storage = cache
            .layers
            .iter()
            .map(|l| Ok([locate(&l.k)?, locate(&l.v)?]))
            .collect::<Result<_>>()?;
        Ok(Self {
            cache,
            expected: tokens,
            filled: vec![0; n_layers],
            storage,
        })
    }

    /// Positions the transfer covers.
    pub fn expected(&self) -> usize {
        self.expected.len()
    }

    /// Positions received so far, summed over layers.
    pub fn received_tokens(&self) -> usize {
        self.filled.iter().sum()
    }

    /// Bytes the cache being rebuilt occupies.
    pub fn allocated_bytes(&self) -> usize {
        self.cache.allocated_bytes()
    }

    /// Stores one chunk; it must continue its layer where the previous one stopped.
    pub fn accept(&mut self, chunk: &KvChunk) -> Result<()> {
        self.accept_parts(chunk.layer, chunk.start, chunk.len, &chunk.k, &chunk.v)
    }

    /// `accept` for a chunk whose K and V bytes lie in a buffer of the caller's.
    pub fn accept_parts(
        &mut self,
        layer: u32,
        start: u32,
        len: u32,
        k: &[u8],
        v: &[u8],
    ) -> Result<()> {
        let mut write = self.chunk(layer, start, len, k.len(), v.len())?;
        let row = write.runs.len() / 2;
        let (k_runs, v_runs) = write.runs().split_at_mut(row);
        for (runs, bytes) in [(k_runs, k), (v_runs, v)] {
            let mut at = 0;
            for run in runs.iter_mut() {
                run.copy_from_slice(&bytes[at..at + run.len()]);
                at += run.len();
            }
        }
        write.done();
        Ok(())
    }

    /// Checks a chunk's place and size, and gives the storage its K and V bytes go to, as
    /// the wire carries them (`(kv_heads, len, head_dim)` little-endian f32 each, which is
    /// how the cache stores them).
    pub fn chunk(
        &mut self,
        layer: u32,
        start: u32,
        len: u32,
        k_len: usize,
        v_len: usize,
    ) -> Result<ChunkWrite<'_>> {
        let layer = layer as usize;
        let (start, len) = (start as usize, len as usize);
        let bad = |why: String| Err(EngineError::KvCache(why));
        if layer >= self.filled.len() {
            return bad(format!("chunk for layer {layer} of {}", self.filled.len()));
        }
        if len == 0 {
            return bad(format!("layer {layer}: a chunk of no positions"));
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
        if k_len != want || v_len != want {
            return bad(format!(
                "layer {layer}: payloads of {k_len} and {v_len} bytes, expected {want}"
            ));
        }
        let (heads, head_dim) = (layout.n_kv_heads, layout.head_dim);
        let capacity = self.cache.capacity;
        let mut runs = Vec::with_capacity(2 * heads);
        for (data, values) in self.storage[layer] {
            debug_assert_eq!(values, heads * capacity * head_dim);
            for h in 0..heads {
                let at = (h * capacity + start) * head_dim;
                // SAFETY: `data` is this layer's storage of `values` f32s, which the
                // assembler's own tensor owns and nothing else reads or writes while the
                // assembler is borrowed; `start + len <= expected <= capacity`, so the run
                // lies within it, and runs of different heads (and K and V) do not overlap.
                // Any bytes are a valid f32.
                let run = unsafe {
                    std::slice::from_raw_parts_mut(data.add(at).cast::<u8>(), len * head_dim * 4)
                };
                runs.push(run);
            }
        }
        Ok(ChunkWrite {
            runs,
            filled: &mut self.filled[layer],
            len,
        })
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
        // Every layer holds every received position; the room for decoding is zeroed, so
        // nothing unwritten is ever read.
        cache.zero_from(self.expected.len())?;
        cache.commit(&self.expected);
        Ok(cache)
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::time::Instant;

    use super::*;
    use crate::fuzz::{settings as fuzz_settings, Rng};

    fn small_layout(rng: &mut Rng) -> KvLayout {
        KvLayout {
            n_layers: 1 + rng.below(4),
            n_kv_heads: 1 + rng.below(3),
            head_dim: 1 + rng.below(8),
            dtype: "f32".into(),
        }
    }

    /// A layout that is usually a model's and sometimes garbage.
    fn layout(rng: &mut Rng) -> KvLayout {
        let mut l = small_layout(rng);
        match rng.below(10) {
            0 => l.dtype = ["bf16", "f16", "", "F32", "f32 "][rng.below(5)].into(),
            1 => l.n_layers = 0,
            2 => l.n_kv_heads = [0, u32::MAX as usize, 1 << 20][rng.below(3)],
            3 => l.head_dim = [0, u32::MAX as usize, usize::MAX / 2][rng.below(3)],
            4 => l.n_layers = [MAX_LAYERS + 1, u32::MAX as usize][rng.below(2)],
            _ => {}
        }
        l
    }

    fn layout_is_valid(l: &KvLayout) -> bool {
        l.dtype == "f32"
            && l.n_layers > 0
            && l.n_layers <= MAX_LAYERS
            && l.n_kv_heads > 0
            && l.head_dim > 0
            && (2 * 4 * l.n_kv_heads as u128 * l.head_dim as u128 * l.n_layers as u128)
                <= MAX_POSITION_BYTES as u128
    }

    /// Prompt lengths: mostly small, sometimes none. (How many positions a transfer may
    /// claim is the decode node's reservation to bound, not the assembler's.)
    fn token_count(rng: &mut Rng) -> usize {
        match rng.below(20) {
            0 => 0,
            1 | 2 => 200 + rng.below(400),
            _ => 1 + rng.below(40),
        }
    }

    /// What the assembler must make of a chunk, tracked independently of it.
    struct Oracle {
        filled: Vec<usize>,
        expected: usize,
        bytes_per_token_layer: usize,
    }

    impl Oracle {
        fn valid(&self, c: &KvChunk) -> bool {
            let layer = c.layer as usize;
            let (start, len) = (c.start as usize, c.len as usize);
            layer < self.filled.len()
                && len > 0
                && start == self.filled[layer]
                && start + len <= self.expected
                && c.k.len() == len * self.bytes_per_token_layer
                && c.v.len() == len * self.bytes_per_token_layer
        }

        /// A chunk that continues a layer, of a random length that fits.
        fn honest(&self, rng: &mut Rng) -> Option<KvChunk> {
            let open: Vec<usize> = (0..self.filled.len())
                .filter(|&l| self.filled[l] < self.expected)
                .collect();
            let layer = *open.get(rng.below(open.len().max(1)))?;
            let left = self.expected - self.filled[layer];
            let most = if rng.below(4) == 0 { 300 } else { 12 };
            let len = 1 + rng.below(left.min(most));
            let n = len * self.bytes_per_token_layer;
            Some(KvChunk {
                layer: layer as u32,
                start: self.filled[layer] as u32,
                len: len as u32,
                k: rng.bytes(n).into(),
                v: rng.bytes(n).into(),
            })
        }
    }

    /// One way a chunk goes wrong on the wire.
    fn corrupt(rng: &mut Rng, mut c: KvChunk, previous: Option<&KvChunk>) -> KvChunk {
        match rng.below(11) {
            0 => c.layer = [c.layer + 64, u32::MAX, c.layer.wrapping_add(1)][rng.below(3)],
            1 => c.start = [c.start + 1, c.start.wrapping_sub(1), u32::MAX][rng.below(3)],
            2 => c.len = [0, u32::MAX, c.len + 1, c.len.saturating_sub(1)][rng.below(4)],
            3 => {
                let cut = rng.below(c.k.len().max(1));
                c.k.truncate(cut);
            }
            4 => {
                let mut v = c.v.to_vec();
                let extra = 1 + rng.below(7);
                v.extend(rng.bytes(extra));
                c.v = v.into();
            }
            5 => {
                c.k = Bytes::new();
                c.v = Bytes::new();
            }
            6 => {
                // Lengths that do not divide into f32s.
                let odd = c.k.len() + 1 + rng.below(3);
                c.k = rng.bytes(odd).into();
                c.v = rng.bytes(odd).into();
            }
            7 => {
                c.len = 0;
                c.k = Bytes::new();
                c.v = Bytes::new();
            }
            8 => {
                if let Some(p) = previous {
                    return p.clone();
                }
                c.start = c.start.wrapping_add(7);
            }
            9 => c.len = c.len.saturating_mul(1 << 16),
            _ => c.k = c.v.slice(..c.v.len() / 2),
        }
        c
    }

    /// Runs one case; returns (chunks accepted, whether the transfer completed).
    fn case(rng: &mut Rng) -> (usize, bool) {
        let layout = layout(rng);
        let n = token_count(rng);
        let tokens: Vec<u32> = (0..n).map(|_| rng.next_u64() as u32).collect();
        // The room reserved for decoding: none (the prompt's), or a sequence's worth.
        let reserve = match rng.below(2) {
            0 => 0,
            _ => n + rng.below(300),
        };
        let asm = KvAssembler::new(layout.clone(), tokens.clone(), reserve, &Device::Cpu);
        let mut asm = match asm {
            Ok(a) => {
                assert!(layout_is_valid(&layout), "{layout:?} accepted");
                assert!(n > 0, "a transfer of no positions accepted");
                a
            }
            Err(e) => {
                assert!(
                    !layout_is_valid(&layout) || n == 0,
                    "{layout:?} with {n} tokens refused: {e}"
                );
                assert!(matches!(e, EngineError::KvCache(_)), "{e:?}");
                return (0, false);
            }
        };
        let per_position = layout.validate().expect("valid");
        let allocated = reserve.max(n) * per_position;
        assert_eq!(
            asm.allocated_bytes(),
            allocated,
            "allocated once, as reserved"
        );
        let mut oracle = Oracle {
            filled: vec![0; layout.n_layers],
            expected: n,
            bytes_per_token_layer: layout.bytes_per_token_layer(),
        };
        let mut stored: Vec<KvChunk> = Vec::new();
        // Enough messages to complete most small transfers, and some that never complete.
        for _ in 0..rng.below(4 * layout.n_layers * 8 + 4) {
            let Some(honest) = oracle.honest(rng) else {
                break;
            };
            let chunk = if rng.below(3) == 0 {
                corrupt(rng, honest, stored.last())
            } else {
                honest
            };
            let valid = oracle.valid(&chunk);
            match asm.accept(&chunk) {
                Ok(()) => {
                    assert!(valid, "a bad chunk was accepted: {}", describe(&chunk));
                    oracle.filled[chunk.layer as usize] += chunk.len as usize;
                    stored.push(chunk);
                }
                Err(e) => {
                    assert!(
                        !valid,
                        "a good chunk was refused ({e}): {}",
                        describe(&chunk)
                    );
                    assert!(matches!(e, EngineError::KvCache(_)), "{e:?}");
                }
            }
            assert_eq!(asm.allocated_bytes(), allocated, "the cache never moves");
            assert_eq!(asm.received_tokens(), oracle.filled.iter().sum::<usize>());
        }
        let complete = oracle.filled.iter().all(|&f| f == n);
        assert_eq!(asm.is_complete(), complete);
        match asm.finish() {
            Ok(cache) => {
                assert!(complete, "an incomplete transfer finished");
                assert_eq!(cache.tokens(), tokens.as_slice());
                assert_eq!(cache.capacity(), reserve.max(n), "the reserved positions");
                for c in &stored {
                    let back = cache
                        .export(c.layer as usize, c.start as usize, c.len as usize)
                        .expect("exporting what was stored");
                    assert!(
                        back.k == c.k && back.v == c.v,
                        "the cache does not hold what {} carried",
                        describe(c)
                    );
                }
            }
            Err(e) => {
                assert!(!complete, "a complete transfer failed to finish: {e}");
                assert!(e.to_string().contains("incomplete"), "{e}");
            }
        }
        (stored.len(), complete)
    }

    fn describe(c: &KvChunk) -> String {
        format!(
            "layer {} start {} len {} k {} B v {} B",
            c.layer,
            c.start,
            c.len,
            c.k.len(),
            c.v.len()
        )
    }

    /// Garbage, truncated and mismatched chunks: every one refused with a KV error, every
    /// good one stored bit for bit, nothing allocated beyond the reservation, never a panic.
    /// Runs `TANDEM_FUZZ_SECS` (10 by default) from `TANDEM_FUZZ_SEED` (else the clock).
    #[test]
    fn fuzzed_chunks_fail_cleanly_and_good_ones_survive() {
        let (seed, budget) = fuzz_settings(10);
        eprintln!(
            "KV assembler fuzz: TANDEM_FUZZ_SEED={seed:#x} for {budget:?} (TANDEM_FUZZ_SECS)"
        );
        let started = Instant::now();
        let mut rng = Rng(seed);
        let (mut cases, mut accepted, mut completed) = (0usize, 0usize, 0usize);
        while cases < 50 || started.elapsed() < budget {
            let mut case_rng = Rng(rng.next_u64() | 1);
            let outcome = catch_unwind(AssertUnwindSafe(|| case(&mut case_rng)));

            match outcome {
                Ok((a, c)) => {
                    accepted += a;
                    completed += usize::from(c);
                }
                Err(_) => panic!(
                    "case {cases} failed: rerun with TANDEM_FUZZ_SEED={seed:#x} (the panic is above)"
                ),
            }
            cases += 1;
        }
        eprintln!("{cases} cases, {accepted} chunks stored, {completed} transfers completed");
        // Both sides must be reached, or the run proves little.
        assert!(
            accepted > cases,
            "only {accepted} chunks stored in {cases} cases"
        );
        assert!(
            completed * 20 > cases,
            "only {completed} of {cases} transfers completed"
        );
    }

    #[test]
    fn a_cache_arrives_at_the_size_its_decoding_needs() {
        let layout = KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 4,
            dtype: "f32".into(),
        };
        let row = layout.bytes_per_token_layer();
        // Memory of the storage's size, dirtied and freed, for the allocator to hand back:
        // the room past the prompt must not show what was there before.
        let positions = 100 * layout.n_kv_heads * layout.head_dim;
        drop((0..8).map(|_| vec![1.5f32; positions]).collect::<Vec<_>>());
        let mut asm = KvAssembler::new(layout.clone(), vec![7; 10], 100, &Device::Cpu).unwrap();
        for layer in 0..2 {
            let bytes: Vec<u8> = (0..10 * row).map(|i| (i % 199) as u8).collect();
            asm.accept(&KvChunk {
                layer,
                start: 0,
                len: 10,
                k: bytes.clone().into(),
                v: bytes.into(),
            })
            .unwrap();
        }
        let mut cache = asm.finish().unwrap();
        assert_eq!(cache.capacity(), 100);
        // The storage came unwritten: the room past the prompt reads as zeros.
        for layer in 0..2 {
            let (k, v) = cache.view(layer, 90).unwrap();
            for t in [k, v] {
                let tail: Vec<f32> = t
                    .narrow(1, 10, 90)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert!(tail.iter().all(|&x| x == 0.0), "layer {layer}: {tail:?}");
            }
        }
        let held = cache.allocated_bytes();
        cache.reserve_exact(100).unwrap();
        assert_eq!(cache.allocated_bytes(), held, "the arrived cache was moved");

        // A reservation that cannot be addressed is refused, not attempted.
        let err = KvAssembler::new(layout, vec![7; 10], usize::MAX, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
    }

    #[test]
    fn layouts_that_are_not_a_models_are_refused() {
        let ok = KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 16,
            dtype: "f32".into(),
        };
        assert_eq!(ok.validate().unwrap(), 2 * 2 * 2 * 16 * 4);
        let bad = [
            KvLayout {
                dtype: "bf16".into(),
                ..ok.clone()
            },
            KvLayout {
                n_layers: 0,
                ..ok.clone()
            },
            KvLayout {
                head_dim: usize::MAX / 2,
                ..ok.clone()
            },
            KvLayout {
                n_layers: MAX_LAYERS + 1,
                ..ok.clone()
            },
        ];
        for l in bad {
            let err = KvAssembler::new(l.clone(), vec![1, 2], 0, &Device::Cpu).unwrap_err();
            assert!(err.to_string().contains("layout"), "{l:?}: {err}");
        }
        let err = KvAssembler::new(ok, vec![], 0, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("at least one position"), "{err}");
    }
}
