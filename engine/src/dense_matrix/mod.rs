//! A bf16, f16 or f32 matrix used where it lies in a mapped file (a folder's safetensors or
//! a GGUF file), times f32 activations. Each weight is widened to f32 (exactly) as it is
//! loaded and the sums are f32 fused multiply-adds, so the products are those of the matrix
//! widened at load, to within the order of the sums, with half the memory and half the
//! bytes a step reads (an f32 matrix: the same bytes, not copied), and the pages shared by
//! every process that maps the file. candle's CPU products over bf16 and f16 ran 1.8-3.6x
//! slower than over f32, which is why the CPU widened every matrix at load before this
//! kernel. On a 1536x1536 matrix this one ran 4.9-6.0x candle's f32 product at 1 and 4
//! rows, 3.0x at 16 and 1.5x at 512 (`product-bench --only dense`, 2-core Emerald Rapids).
//!
//! Every output is one order of sums, whichever kernel computes it (512-bit or 256-bit
//! registers): sixteen chains, chain `l` adding `w[k] * x[k]` for `k = l, l + 16, ...` in
//! order with one fused multiply-add each (a last part of fewer than sixteen columns as if
//! padded with zeros), then the chains added in a fixed tree (chain `i` plus chain `i + 8`,
//! those eight halved the same way twice more, then the last two). So a row's outputs do
//! not depend on the rows beside it, on how the pool split the matrix, or on the CPU.

use bytes::Bytes;
use candle_core::quantized::GgmlDType;

use crate::error::{EngineError, Result};
use crate::split::{self, Columns, GROUP};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
pub(crate) mod tests;

/// Lanes of one chain register: the sums' order is defined over sixteen chains.
const LANES: usize = 16;

/// Groups a worker takes at once: each tile of activation rows is read once for 64
/// weight rows, from the cache, rather than once for eight (a prompt's activation rows,
/// megabytes, are otherwise read from memory once per group), while the run's weights
/// (196 KB at 1,536 columns) stay in a core's L2. On a 1536x1536 matrix at 512 rows: 96
/// GMAC/s against 81 by single groups, 92 by runs of four.
const RUN: usize = 8;

/// Weight rows a kernel takes at once at most: a run of groups.
const MAX_ROWS: usize = RUN * GROUP;

/// How a kernel reads a row's values: its `KIND`.
const F16: u8 = 0;
const BF16: u8 = 1;
const F32: u8 = 2;

/// Bytes a value of `KIND` takes.
const fn size(kind: u8) -> usize {
    match kind {
        F32 => 4,
        _ => 2,
    }
}

/// How a matrix's values are stored, little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    F16,
    Bf16,
    F32,
}

impl Stored {
    /// How a GGUF file stores values of this type.
    pub fn ggml(self) -> GgmlDType {
        match self {
            Self::F16 => GgmlDType::F16,
            Self::Bf16 => GgmlDType::BF16,
            Self::F32 => GgmlDType::F32,
        }
    }

    /// The type of GGUF data of `dtype`, where it is one of these.
    pub fn of_ggml(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::F16 => Some(Self::F16),
            GgmlDType::BF16 => Some(Self::Bf16),
            GgmlDType::F32 => Some(Self::F32),
            _ => None,
        }
    }

    /// How a safetensors file stores values of this type.
    pub fn of_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::F16 => Some(Self::F16),
            safetensors::Dtype::BF16 => Some(Self::Bf16),
            safetensors::Dtype::F32 => Some(Self::F32),
            _ => None,
        }
    }

    /// Bytes a value takes.
    pub fn size(self) -> usize {
        size(self.kind())
    }

    /// The value whose little-endian bytes start `b`, widened exactly.
    pub fn widen(self, b: &[u8]) -> f32 {
        match self {
            Self::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            Self::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            Self::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }

    /// The kernels' `KIND` for this type.
    fn kind(self) -> u8 {
        match self {
            Self::F16 => F16,
            Self::Bf16 => BF16,
            Self::F32 => F32,
        }
    }
}

/// The code that computes a product; every one gives the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// AVX-512 F (the widening and the sums), BW and VL (a last part of fewer than
    /// sixteen columns).
    Avx512,
    /// AVX2, FMA and F16C: the build's target (x86-64-v3).
    Avx2,
}

impl Kernel {
    /// Those this CPU runs, the fastest first.
    fn available() -> Vec<Self> {
        let mut all = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                all.push(Self::Avx512);
            }
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                all.push(Self::Avx2);
            }
        }
        all
    }
}

/// A `[rows, cols]` matrix of `stored` values, row-major and little-endian, in `data`.
#[derive(Debug)]
pub struct DenseMatrix {
    rows: usize,
    cols: usize,
    stored: Stored,
    data: Bytes,
    kernel: Kernel,
}

impl DenseMatrix {
    /// Whether this CPU runs a kernel: AVX2, FMA and F16C at least (an f32 matrix's
    /// kernel is compiled with the halves' features, which every x86-64-v3 CPU has).
    pub fn supported() -> bool {
        !Kernel::available().is_empty()
    }

    /// `data`, exactly `rows * cols` values, as the matrix: refused otherwise, or where
    /// this CPU runs no kernel.
    pub fn new(stored: Stored, rows: usize, cols: usize, data: Bytes) -> Result<Self> {
        let Some(&kernel) = Kernel::available().first() else {
            return Err(EngineError::InvalidInput(
                "this CPU has no AVX2, FMA and F16C for the dense matrix kernel".into(),
            ));
        };
        let bytes = rows
            .checked_mul(cols)
            .and_then(|v| v.checked_mul(stored.size()));
        if cols == 0 || bytes != Some(data.len()) {
            return Err(EngineError::InvalidInput(format!(
                "{} bytes of {stored:?} are not a [{rows}, {cols}] matrix",
                data.len()
            )));
        }
        Ok(Self {
            rows,
            cols,
            stored,
            data,
            kernel,
        })
    }

    /// The matrix on the 256-bit kernel, where this CPU runs it: what a CPU without
    /// AVX-512 computes (the same bits), for `product-bench`.
    pub fn on_256_bit_registers(self) -> Option<Self> {
        let kernel = Kernel::Avx2;
        Kernel::available()
            .contains(&kernel)
            .then_some(Self { kernel, ..self })
    }

    /// Bytes a product reads: the matrix's.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// `x Wᵀ` for `x` of `[n, cols]` (row-major): `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            n * self.cols,
            "activations of [{n}, {}]",
            self.cols
        );
        let xs: Vec<&[f32]> = x.chunks_exact(self.cols).collect();
        let run = |g: usize, out: &Columns<'_>| {
            let (first, width) = (g * GROUP, out.width());
            let rows: [&[u8]; MAX_ROWS] =
                std::array::from_fn(|i| self.row(first + i.min(width - 1)));
            self.outputs(&rows[..width], &xs, &mut |y, vals| out.put(y, vals))
        };
        let loose = |r: usize, out: &Columns<'_>| {
            self.outputs(&[self.row(r)], &xs, &mut |y, vals| out.put(y, vals))
        };
        split::by_runs(self.rows, n, RUN, run, loose)
    }

    /// Row `r`'s bytes.
    fn row(&self, r: usize) -> &[u8] {
        let len = self.stored.size() * self.cols;
        &self.data[r * len..(r + 1) * len]
    }

    /// The outputs of weight rows `w` (one, or a run of groups) for each activation row,
    /// handed to `emit` in row order.
    fn outputs(&self, w: &[&[u8]], xs: &[&[f32]], emit: &mut dyn FnMut(usize, &[f32])) {
        assert!(
            !w.is_empty() && w.len() <= MAX_ROWS,
            "one row to a run of groups"
        );
        let cols = self.cols;
        let len = self.stored.size() * cols;
        assert!(w.iter().all(|r| r.len() == len) && xs.iter().all(|x| x.len() == cols));
        match self.stored {
            Stored::F16 => self.on_kernel::<F16>(w, xs, emit),
            Stored::Bf16 => self.on_kernel::<BF16>(w, xs, emit),
            Stored::F32 => self.on_kernel::<F32>(w, xs, emit),
        }
    }

    /// [`DenseMatrix::outputs`] on the matrix's kernel, for rows of `KIND` values.
    fn on_kernel<const KIND: u8>(
        &self,
        w: &[&[u8]],
        xs: &[&[f32]],
        emit: &mut dyn FnMut(usize, &[f32]),
    ) {
        let cols = self.cols;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `new` found the kernel's features; `outputs` checked the rows' lengths.
        unsafe {
            match self.kernel {
                Kernel::Avx512 => avx512::outputs::<KIND>(w, xs, cols, emit),
                Kernel::Avx2 => avx2::outputs::<KIND>(w, xs, cols, emit),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (w, xs, cols, emit);
            unreachable!("a matrix is only made where the kernel runs")
        }
    }
}
