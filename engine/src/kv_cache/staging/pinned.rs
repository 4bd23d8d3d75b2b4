//! Copies of GPU caches' chunks into page-locked host memory, queued on the device's stream.
//!
//! The buffers are reused: allocating page-locked memory takes the driver's time, and
//! freeing it waits for the whole device. A buffer goes back to the pool when its chunk has
//! been copied out of it (or dropped), so the pool holds at most what the chunks staged at
//! once need, under its cap.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, PinnedHostSlice};
use candle_core::cuda_backend::WrapErr;
use candle_core::{Device, Storage, Tensor};
use half::f16;

use super::{place, Place};
use crate::error::{EngineError, Result};
use crate::kv_cache::{F16Bytes, KvChunk, SeqCache, F16_BYTES};

/// Page-locked buffers for one GPU's copies.
pub(super) struct Pool {
    stream: Arc<CudaStream>,
    cap: usize,
    buffers: Arc<Mutex<Buffers>>,
}

#[derive(Default)]
struct Buffers {
    free: Vec<PinnedHostSlice<f16>>,
    /// Bytes of every buffer, free or lent.
    held: usize,
}

/// One chunk's K and V on their way.
pub(super) struct Pending {
    layer: usize,
    start: usize,
    len: usize,
    k: Lease,
    v: Lease,
}

/// A buffer lent to a copy of `elems` elements; back to its pool when dropped.
struct Lease {
    buffer: Option<PinnedHostSlice<f16>>,
    elems: usize,
    pool: Arc<Mutex<Buffers>>,
}

impl Pool {
    /// The pool for `device`'s caches, if it is a GPU.
    pub(super) fn for_device(device: &Device, cap: usize) -> Option<Self> {
        let Device::Cuda(dev) = device else {
            return None;
        };
        Some(Self {
            stream: dev.cuda_stream(),
            cap,
            buffers: Arc::default(),
        })
    }

    /// Queues the copy of positions `start..start + len` of `cache`'s layer `layer` (in
    /// range: the caller checked), or None where the pool's cap leaves no room for it.
    pub(super) fn copy(
        &self,
        cache: &SeqCache,
        layer: usize,
        start: usize,
        len: usize,
    ) -> Result<Option<Pending>> {
        let l = cache.layer(layer);
        let (Some(k), Some(v)) = (self.queue(&l.k, start, len)?, self.queue(&l.v, start, len)?)
        else {
            return Ok(None);
        };
        Ok(Some(Pending {
            layer,
            start,
            len,
            k,
            v,
        }))
    }

    /// Queues one tensor's positions into a lent buffer: made contiguous on the GPU (where
    /// they are strided), then copied to the buffer, which records the copy's end for
    /// [`Lease::read`] to wait on. Queued on the one stream, the copy reads the cache as it
    /// is now, whatever is queued to write to it later; and the cache's memory, freed in
    /// the stream's order, outlives it.
    fn queue(&self, t: &Tensor, start: usize, len: usize) -> Result<Option<Lease>> {
        let (heads, _, head_dim) = t.dims3()?;
        let elems = heads * len * head_dim;
        // A buffer first: past the cap the chunk is read at once, and its copy on the GPU
        // would be wasted.
        let Some(mut lease) = self.lend(elems)? else {
            return Ok(None);
        };
        let part = t.narrow(1, start, len)?.contiguous()?;
        let (storage, layout) = part.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Err(EngineError::KvCache(
                "a GPU cache outside GPU memory".into(),
            ));
        };
        let from = layout.start_offset();
        let src = cs.as_cuda_slice::<f16>()?.slice(from..from + elems);
        let buffer = lease
            .buffer
            .as_mut()
            .expect("a lease holds its buffer until dropped");
        self.stream.memcpy_dtoh(&src, buffer).w()?;
        Ok(Some(lease))
    }

    /// A buffer of at least `elems` elements, if the cap allows one.
    fn lend(&self, elems: usize) -> Result<Option<Lease>> {
        let mut b = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        let sizes: Vec<usize> = b.free.iter().map(PinnedHostSlice::len).collect();
        let buffer = match place(&sizes, b.held, elems, F16_BYTES, self.cap) {
            Place::Reuse(i) => b.free.swap_remove(i),
            Place::Allocate(n) => {
                // No flags: cudarc's `alloc_pinned` asks for write-combined memory, which
                // suits copies to the GPU but is uncached for the CPU's reads, and the CPU
                // reads every byte of these.
                let ctx = self.stream.context();
                // SAFETY: the buffer is read only through `Lease::read`, after a copy
                // into it of the elements read has completed.
                let buffer = unsafe { ctx.alloc_pinned_with_flags::<f16>(n, 0) }.w()?;
                b.held += n * F16_BYTES;
                buffer
            }
            Place::ReadNow => return Ok(None),
        };
        Ok(Some(Lease {
            buffer: Some(buffer),
            elems,
            pool: self.buffers.clone(),
        }))
    }
}

impl Pending {
    /// The chunk, once both copies are done.
    pub(super) fn take(self) -> Result<KvChunk> {
        Ok(KvChunk {
            layer: self.layer as u32,
            start: self.start as u32,
            len: self.len as u32,
            k: self.k.read()?,
            v: self.v.read()?,
        })
    }
}

impl Lease {
    /// The copied elements, waiting for the copy first.
    fn read(&self) -> Result<Bytes> {
        let buffer = self
            .buffer
            .as_ref()
            .expect("a lease holds its buffer until dropped");
        let data = buffer.as_slice().w()?[..self.elems].to_vec();
        Ok(Bytes::from_owner(F16Bytes(data)))
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // A copy still in flight is harmless to reuse behind: every copy into a buffer is
        // queued on the one stream, and each read waits for the last one queued.
        if let Some(buffer) = self.buffer.take() {
            let mut b = self.pool.lock().unwrap_or_else(|e| e.into_inner());
            b.free.push(buffer);
        }
    }
}
