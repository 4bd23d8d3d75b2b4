//! A bf16 or f16 matrix used where it lies in a mapped file (a folder's safetensors or a
//! GGUF file), times f32 activations. Each weight is widened to f32 (exactly) as it is loaded and the sums are
//! f32 fused multiply-adds, so the products are those of the matrix widened at load, to
//! within the order of the sums, with half the memory and half the bytes a step reads, and
//! the pages shared by every process that maps the file. candle's CPU products over bf16
//! and f16 ran 1.8-3.6x slower than over f32, which is why the CPU widened every matrix at
//! load before this kernel. On a 1536x1536 matrix this one ran 4.9-6.0x candle's f32
//! product at 1 and 4 rows, 3.0x at 16 and 1.5x at 512 (`product-bench --only dense`,
//! 2-core Emerald Rapids).
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
mod tests;

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

/// How a matrix's two bytes a value encode it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    F16,
    Bf16,
}

impl Stored {
    /// How a GGUF file stores values of this type.
    pub fn ggml(self) -> GgmlDType {
        match self {
            Self::F16 => GgmlDType::F16,
            Self::Bf16 => GgmlDType::BF16,
        }
    }

    /// The type of GGUF data of `dtype`, where it is one of these.
    pub fn of_ggml(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::F16 => Some(Self::F16),
            GgmlDType::BF16 => Some(Self::Bf16),
            _ => None,
        }
    }

    /// The value of the little-endian bytes `b`, widened exactly.
    pub fn widen(self, b: [u8; 2]) -> f32 {
        match self {
            Self::F16 => half::f16::from_le_bytes(b).to_f32(),
            Self::Bf16 => half::bf16::from_le_bytes(b).to_f32(),
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

/// A `[rows, cols]` matrix of `half` values, row-major and little-endian, in `data`.
#[derive(Debug)]
pub struct DenseMatrix {
    rows: usize,
    cols: usize,
    stored: Stored,
    data: Bytes,
    kernel: Kernel,
}

impl DenseMatrix {
    /// Whether this CPU runs a kernel: AVX2, FMA and F16C at least.
    pub fn supported() -> bool {
        !Kernel::available().is_empty()
    }

    /// `data`, exactly `rows * cols` values, as the matrix: refused otherwise, or where
    /// this CPU runs no kernel.
    pub fn new(stored: Stored, rows: usize, cols: usize, data: Bytes) -> Result<Self> {
        let Some(&kernel) = Kernel::available().first() else {
            return Err(EngineError::InvalidInput(
                "this CPU has no AVX2, FMA and F16C for the half-precision kernel".into(),
            ));
        };
        if cols == 0 || rows.checked_mul(cols).and_then(|v| v.checked_mul(2)) != Some(data.len()) {
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
            let first = g * GROUP;
            let rows: Vec<&[u8]> = (first..first + out.width()).map(|r| self.row(r)).collect();
            self.outputs(&rows, &xs, &mut |y, vals| out.put(y, vals))
        };
        let loose = |r: usize, out: &Columns<'_>| {
            self.outputs(&[self.row(r)], &xs, &mut |y, vals| out.put(y, vals))
        };
        split::by_runs(self.rows, n, RUN, run, loose)
    }

    /// Row `r`'s bytes.
    fn row(&self, r: usize) -> &[u8] {
        &self.data[r * 2 * self.cols..(r + 1) * 2 * self.cols]
    }

    /// The outputs of weight rows `w` (one, or a run of groups) for each activation row,
    /// handed to `emit` in row order.
    fn outputs(&self, w: &[&[u8]], xs: &[&[f32]], emit: &mut dyn FnMut(usize, &[f32])) {
        assert!(
            !w.is_empty() && w.len() <= MAX_ROWS,
            "one row to a run of groups"
        );
        let cols = self.cols;
        assert!(w.iter().all(|r| r.len() == 2 * cols) && xs.iter().all(|x| x.len() == cols));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `new` found the kernel's features; the rows' lengths are checked above.
        unsafe {
            match (self.kernel, self.stored) {
                (Kernel::Avx512, Stored::F16) => avx512::outputs::<F16>(w, xs, cols, emit),
                (Kernel::Avx512, Stored::Bf16) => avx512::outputs::<BF16>(w, xs, cols, emit),
                (Kernel::Avx2, Stored::F16) => avx2::outputs::<F16>(w, xs, cols, emit),
                (Kernel::Avx2, Stored::Bf16) => avx2::outputs::<BF16>(w, xs, cols, emit),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (w, xs, emit);
            unreachable!("a matrix is only made where the kernel runs")
        }
    }
}
