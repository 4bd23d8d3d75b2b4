//! One output buffer filled by candle's pool workers, each writing its own part.

use std::marker::PhantomData;

/// An output buffer shared by pool workers that each write their own disjoint part of it.
pub(crate) struct SharedOut<'a> {
    ptr: *mut f32,
    len: usize,
    buf: PhantomData<&'a mut [f32]>,
}

// SAFETY: workers write disjoint ranges (callers promise it at `slice`).
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    /// Shares `buf`, which stays borrowed while this lives.
    pub(crate) fn new(buf: &'a mut [f32]) -> Self {
        Self {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            buf: PhantomData,
        }
    }

    /// `len` values from `start`.
    ///
    /// # Safety
    /// No other slice handed out overlaps this one while it lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start + len <= self.len, "outside the shared buffer");
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}
