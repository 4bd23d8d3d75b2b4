//! A finished layer's chunks on their way to host memory, for a prefill node that sends
//! each layer while later layers compute.
//!
//! On the CPU a chunk is read when it is staged. On a GPU, reading it then would wait for
//! every op queued before it, and the GPU would idle until the thread had queued the next
//! layer's ops: once a layer. Instead its copy into page-locked host memory is queued
//! behind the layer on the device's stream, and the chunk is taken [`Stager::lookahead`]
//! layers later, when the GPU has long finished it and is computing the layers after it.

use candle_core::Device;

use super::{KvChunk, SeqCache};
use crate::error::Result;

#[cfg(feature = "cuda")]
mod pinned;

/// Most page-locked host memory a GPU node's stager holds for copies in flight. A step
/// stages at most its tokens' K and V for `LOOKAHEAD + 1` layers (an 8,192-token step of
/// an 8B model: 96 MiB); past this, a chunk is read at once instead, which is slower but
/// takes no more.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU's; CPU builds read at once
const PINNED_STAGING_BYTES: usize = 256 << 20;

/// How many layers a GPU's chunks stay queued before they are taken: enough that the
/// thread waits on a copy while the GPU computes the layers queued after it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const LOOKAHEAD: usize = 2;

/// Stages the chunks of one device's caches.
pub struct Stager {
    #[cfg(feature = "cuda")]
    pinned: Option<pinned::Pool>,
}

/// A chunk being copied, or read already.
pub struct Staged(Inner);

enum Inner {
    Read(KvChunk),
    #[cfg(feature = "cuda")]
    Copying(pinned::Pending),
}

impl Stager {
    /// A stager for caches on `device`.
    pub fn new(device: &Device) -> Self {
        #[cfg(feature = "cuda")]
        {
            Self {
                pinned: pinned::Pool::for_device(device, PINNED_STAGING_BYTES),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            Self {}
        }
    }

    /// How many layers after its own a staged chunk is best taken: 0 where staging reads.
    pub fn lookahead(&self) -> usize {
        #[cfg(feature = "cuda")]
        if self.pinned.is_some() {
            return LOOKAHEAD;
        }
        0
    }

    /// Starts moving `len` positions from `start` of `cache`'s layer `layer` (of which
    /// `pending` positions past its length are written but not yet counted) to host
    /// memory; what it holds is a copy, whatever is written to the cache after.
    pub fn stage(
        &self,
        cache: &SeqCache,
        layer: usize,
        start: usize,
        len: usize,
        pending: usize,
    ) -> Result<Staged> {
        #[cfg(feature = "cuda")]
        if let Some(pool) = &self.pinned {
            cache.check_export(layer, start, len, pending)?;
            if let Some(copy) = pool.copy(cache, layer, start, len)? {
                return Ok(Staged(Inner::Copying(copy)));
            }
        }
        Ok(Staged(Inner::Read(
            cache.export_pending(layer, start, len, pending)?,
        )))
    }
}

impl Staged {
    /// The chunk, once its copy is done.
    pub fn take(self) -> Result<KvChunk> {
        match self.0 {
            Inner::Read(chunk) => Ok(chunk),
            #[cfg(feature = "cuda")]
            Inner::Copying(copy) => copy.take(),
        }
    }
}

/// Where a chunk's copy goes: into the free buffer at an index of the free list, into a
/// new buffer of some elements, or nowhere (it is read at once).
#[derive(Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU pool's; tested in every build
enum Place {
    Reuse(usize),
    Allocate(usize),
    ReadNow,
}

/// Where a copy of `need` elements of `elem_bytes` goes, given the sizes (elements) of the
/// free buffers and the bytes all buffers take, under `cap` bytes. The smallest free buffer
/// that fits; else a new one of the next power of two (chunks differ in length, so that
/// later chunks of other lengths fit it), or of `need` if that passes the cap; else none.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn place(free: &[usize], held_bytes: usize, need: usize, elem_bytes: usize, cap: usize) -> Place {
    let fitting = free
        .iter()
        .enumerate()
        .filter(|&(_, &len)| len >= need)
        .min_by_key(|&(_, &len)| len);
    if let Some((i, _)) = fitting {
        return Place::Reuse(i);
    }
    let fits = |elems: usize| {
        elems
            .checked_mul(elem_bytes)
            .and_then(|b| b.checked_add(held_bytes))
            .is_some_and(|total| total <= cap)
    };
    let rounded = need.checked_next_power_of_two().unwrap_or(need);
    if fits(rounded) {
        Place::Allocate(rounded)
    } else if fits(need) {
        Place::Allocate(need)
    } else {
        Place::ReadNow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_takes_the_smallest_free_buffer_that_fits() {
        assert_eq!(
            place(&[64, 512, 128], 1 << 20, 100, 2, 2 << 20),
            Place::Reuse(2)
        );
        assert_eq!(place(&[64, 128], 1 << 20, 128, 2, 2 << 20), Place::Reuse(1));
    }

    #[test]
    fn a_new_buffer_is_rounded_up_while_the_cap_allows() {
        assert_eq!(place(&[64], 0, 100, 2, 1 << 20), Place::Allocate(128));
        // 128 elements would pass the cap by 56 bytes; 100 do not.
        assert_eq!(place(&[], 1000, 100, 2, 1200), Place::Allocate(100));
    }

    #[test]
    fn past_the_cap_a_chunk_is_read_at_once() {
        assert_eq!(place(&[64], 1000, 100, 2, 1199), Place::ReadNow);
        assert_eq!(
            place(&[], usize::MAX - 1, 100, 2, usize::MAX),
            Place::ReadNow
        );
    }
}
