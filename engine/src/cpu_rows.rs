//! The rows of a 2-D f32 tensor in CPU memory, read where they lie: a view into a stacked
//! product's output (its rows strided past their width) needs no contiguous copy.

use candle_core::{CpuStorage, Layout, Storage};

/// An f32 matrix's rows: row `r` is `width` values from `r * stride` of `data`.
pub(crate) struct CpuRows<'a> {
    data: &'a [f32],
    stride: usize,
    width: usize,
}

impl<'a> CpuRows<'a> {
    /// `rows` rows of `width` contiguous f32 values, if that is how `layout` lays out
    /// `storage`; None otherwise (another layout, dtype or device).
    pub(crate) fn of(
        storage: &'a Storage,
        layout: &Layout,
        rows: usize,
        width: usize,
    ) -> Option<Self> {
        let Storage::Cpu(CpuStorage::F32(data)) = storage else {
            return None;
        };
        let (start, stride) = (layout.start_offset(), layout.stride());
        let fits = layout.dims() == [rows, width]
            && (stride[1] == 1 || width == 1)
            && (stride[0] >= width || rows == 1)
            && (rows == 0 || start + (rows - 1) * stride[0] + width <= data.len());
        fits.then(|| Self {
            data: &data[start..],
            stride: stride[0],
            width,
        })
    }

    /// Row `r`'s values.
    pub(crate) fn row(&self, r: usize) -> &'a [f32] {
        &self.data[r * self.stride..][..self.width]
    }
}
