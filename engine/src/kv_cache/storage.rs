//! In-place ops on one layer's K or V storage, `(kv_heads, capacity)` rows of a head's
//! values as the cache's [`KvDtype`] stores them: zeroing, writing new rows (rounded to
//! f16 or quantized to Q8_0), and finding where the storage lies.

use candle_core::{CpuStorage, InplaceOp1, Layout};
use half::f16;
use half::slice::HalfFloatSliceExt;

use super::quantize::quantize_row;
use super::KvDtype;

/// One layer's storage as an in-place op sees it: bytes, whatever the element type.
struct LayerStorage<'a> {
    data: &'a mut [u8],
    /// Offset of the layer's first byte in `data`.
    first: usize,
    heads: usize,
    capacity: usize,
    /// Bytes of one head's row.
    row: usize,
}

impl<'a> LayerStorage<'a> {
    fn of(storage: &'a mut CpuStorage, layout: &Layout) -> candle_core::Result<Self> {
        let (heads, capacity, elems) = layout.shape().dims3()?;
        let Some((first, _)) = layout.contiguous_offsets() else {
            candle_core::bail!("a KV cache layer is one contiguous tensor");
        };
        let (data, size): (&mut [u8], usize) = match storage {
            CpuStorage::F16(data) => (bytemuck::cast_slice_mut(data), size_of::<f16>()),
            CpuStorage::U8(data) => (data, 1),
            _ => candle_core::bail!("KV caches hold f16 values or Q8_0 blocks"),
        };
        Ok(Self {
            data,
            first: first * size,
            heads,
            capacity,
            row: elems * size,
        })
    }

    /// Head `h`'s rows for positions `start .. start + len`.
    fn run(&mut self, h: usize, start: usize, len: usize) -> &mut [u8] {
        let at = self.first + (h * self.capacity + start) * self.row;
        &mut self.data[at..at + len * self.row]
    }
}

/// Zeroes positions `.0 ..` of one layer's storage: a zero f16 and a Q8_0 block of zero
/// scale are both zero bytes.
pub(super) struct ZeroFrom(pub(super) usize);

impl InplaceOp1 for ZeroFrom {
    fn name(&self) -> &'static str {
        "kv-zero-from"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let mut layer = LayerStorage::of(storage, layout)?;
        let from = self.0.min(layer.capacity);
        for h in 0..layer.heads {
            layer.run(h, from, layer.capacity - from).fill(0);
        }
        Ok(())
    }
}

/// Writes `rows` positions' values, `(kv_heads, rows, head_dim)` f32, at `at ..` of one
/// layer's storage, as `dtype` stores them.
pub(super) struct WriteRows<'a> {
    pub(super) at: usize,
    pub(super) rows: usize,
    pub(super) dtype: KvDtype,
    pub(super) values: &'a [f32],
}

impl InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "kv-write-rows"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let mut layer = LayerStorage::of(storage, layout)?;
        let fits = self.rows > 0
            && self.values.len().is_multiple_of(layer.heads * self.rows)
            && self.at + self.rows <= layer.capacity;
        if !fits {
            candle_core::bail!(
                "{} rows of {} values at {}",
                self.rows,
                self.values.len(),
                self.at
            );
        }
        let hd = self.values.len() / (layer.heads * self.rows);
        if self.dtype.row_bytes(hd) != layer.row || !self.dtype.holds(hd) {
            candle_core::bail!("rows of {hd} values in a {} cache", self.dtype.name());
        }
        for (i, src) in self.values.chunks_exact(hd).enumerate() {
            let (h, r) = (i / self.rows, i % self.rows);
            let dst = layer.run(h, self.at + r, 1);
            match self.dtype {
                // Eight at a time where the CPU converts in vectors: the same rounding as
                // `f16::from_f32` (candle's), and an eighth of the stores to lines the
                // cache has not touched yet, which filled the store buffer one value at a
                // time.
                KvDtype::F16 => match bytemuck::try_cast_slice_mut::<u8, f16>(dst) {
                    Ok(dst) => dst.convert_from_f32_slice(src),
                    Err(e) => candle_core::bail!("an f16 cache's row: {e}"),
                },
                KvDtype::Q8_0 => quantize_row(src, dst),
            }
        }
        Ok(())
    }
}

/// Finds where one layer's storage lies, as bytes, for writing into it from outside an op.
#[derive(Default)]
pub(super) struct Locate(pub(super) std::cell::Cell<Option<(*mut u8, usize)>>);

impl InplaceOp1 for Locate {
    fn name(&self) -> &'static str {
        "kv-locate"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let layer = LayerStorage::of(storage, layout)?;
        let n = layer.heads * layer.capacity * layer.row;
        if layer.first + n > layer.data.len() {
            candle_core::bail!("a KV cache layer lies outside its storage");
        }
        let at = layer.data[layer.first..].as_mut_ptr();
        self.0.set(Some((at, n)));
        Ok(())
    }
}
