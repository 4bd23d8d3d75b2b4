//! K-quant weights (Q4_K, Q5_K, Q6_K: the types of a Q4_K_M or Q5_K_M file) times f32
//! activations on the CPU, with llama.cpp's arithmetic: activations quantized as Q8_K,
//! each super-block's sum exact in integers, then its scales in floats
//! ([`x86`] says how). The weights keep their own bits: eight rows' super-blocks are
//! interleaved into one group block ([`format`]), which for Q6_K is exactly the file's
//! bytes and for Q4_K and Q5_K 2-3% more (the six-bit scales unpacked). Each path (scalar,
//! AVX2, VNNI, two groups at once on 512-bit registers) gives the same bits, and a row's
//! outputs never depend on the rows batched beside it: PD gives colocated's tokens.
//!
//! Projections of one input may be stacked into one matrix whatever their K-quant types
//! (a Q4_K_M file's v is often Q6_K beside a Q4_K q and k): the input is quantized once,
//! and each part keeps its own type.

pub mod format;
pub(crate) mod q8k;
mod scalar;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod wide;
#[cfg(target_arch = "x86_64")]
mod x86;

use bytes::Bytes;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

#[cfg(target_arch = "x86_64")]
use crate::ahead::Ahead;
use crate::error::{EngineError, Result};
use crate::split::{self, GroupSpan, GROUP};
pub use format::KFormat;
use format::{SuperBlock, QK_K};
pub(crate) use q8k::{Q8KRow, Q8KRows};

/// One matrix of GGML K-quant data to stack: its type, bytes and rows.
pub struct KPart<'a> {
    pub format: KFormat,
    pub bytes: &'a [u8],
    pub rows: usize,
}

/// A `[rows, cols]` matrix of K-quant weights, in groups of eight rows: each part's last
/// group padded with zero rows, whose outputs are never written out. Its bytes are its own,
/// or a region of a mapped pack file ([`crate::pack`]) that processes on one host share.
#[derive(Debug)]
pub struct KMatrix {
    rows: usize,
    cols: usize,
    shape: Vec<PartShape>,
    data: Bytes,
    groups: Vec<Group>,
    spans: Vec<GroupSpan>,
    pair_spans: Vec<GroupSpan>,
}

/// One stacked part of a [`KMatrix`]: its type and rows. A matrix's parts decide where
/// each of its groups lies, so they and its bytes are all a pack stores of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartShape {
    pub format: KFormat,
    pub rows: usize,
}

/// Where each group of a matrix's parts lies in its bytes, and which outputs it gives.
struct Layout {
    groups: Vec<Group>,
    /// Each group's outputs.
    spans: Vec<GroupSpan>,
    /// Each pair of groups' outputs, for 512-bit kernels: a part's groups two by two, and
    /// the last alone where a part has an odd number.
    pair_spans: Vec<GroupSpan>,
    /// Where each part's first group starts.
    part_starts: Vec<usize>,
    bytes: usize,
}

impl Layout {
    fn of(shape: &[PartShape], cols: usize) -> Self {
        let nb = cols / QK_K;
        let mut layout = Self {
            groups: Vec::new(),
            spans: Vec::new(),
            pair_spans: Vec::new(),
            part_starts: Vec::with_capacity(shape.len()),
            bytes: 0,
        };
        let mut row = 0;
        for part in shape {
            let group_len = nb * part.format.group_bytes();
            layout.part_starts.push(layout.bytes);
            let groups = part.rows.div_ceil(GROUP);
            let first = layout.groups.len();
            for g in 0..groups {
                layout.groups.push(Group {
                    format: part.format,
                    at: layout.bytes + g * group_len,
                });
                layout.spans.push(GroupSpan {
                    group: first + g,
                    groups: 1,
                    col: row + g * GROUP,
                    width: GROUP.min(part.rows - g * GROUP),
                });
            }
            for pair in layout.spans[first..].chunks(2) {
                layout.pair_spans.push(GroupSpan {
                    groups: pair.len(),
                    width: pair.iter().map(|s| s.width).sum(),
                    ..pair[0]
                });
            }
            layout.bytes += groups * group_len;
            row += part.rows;
        }
        layout
    }
}

/// Where a group's blocks are, and their type.
#[derive(Debug, Clone, Copy)]
struct Group {
    format: KFormat,
    at: usize,
}

/// One product of [`KMatrix::products`]: a matrix and its activation rows, quantized.
pub(crate) struct KProduct<'a> {
    pub(crate) matrix: &'a KMatrix,
    pub(crate) rows: Vec<Q8KRow<'a>>,
}

/// How this CPU runs the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Scalar,
    Avx2,
    Vnni,
    /// VNNI, with two groups at once on 512-bit registers for products of
    /// [`split::PAIRED_FROM_ROWS`] activation rows or more.
    Vnni512,
}

impl Path {
    /// Whether a product of `n` activation rows takes its groups two at a time.
    fn pairs(self, n: usize) -> bool {
        self == Self::Vnni512 && n >= split::PAIRED_FROM_ROWS
    }

    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2 && crate::act_quant::has_vnni_512() {
                return Self::Vnni512;
            }
            if avx2 && crate::act_quant::has_vnni() {
                return Self::Vnni;
            }
            if avx2 {
                return Self::Avx2;
            }
        }
        Self::Scalar
    }
}

impl KMatrix {
    /// Takes GGML data of `format` for a `[rows, cols]` tensor.
    pub fn from_ggml(format: KFormat, bytes: &[u8], rows: usize, cols: usize) -> Result<Self> {
        Self::stack(
            &[KPart {
                format,
                bytes,
                rows,
            }],
            cols,
        )
    }

    /// The matrices `parts`, each of `cols` columns, one under the other.
    pub fn stack(parts: &[KPart<'_>], cols: usize) -> Result<Self> {
        let nb = cols / QK_K;
        for part in parts {
            let format = part.format;
            if cols == 0
                || !cols.is_multiple_of(QK_K)
                || part.bytes.len() != part.rows * nb * format.ggml_bytes()
            {
                return Err(EngineError::InvalidInput(format!(
                    "{format:?} data of {} bytes does not make a [{}, {cols}] matrix",
                    part.bytes.len(),
                    part.rows
                )));
            }
        }
        let shape: Vec<PartShape> = parts
            .iter()
            .map(|p| PartShape {
                format: p.format,
                rows: p.rows,
            })
            .collect();
        let layout = Layout::of(&shape, cols);
        let mut data = vec![0u8; layout.bytes];
        for (part, &start) in parts.iter().zip(&layout.part_starts) {
            let format = part.format;
            let row_bytes = nb * format.ggml_bytes();
            let group_len = nb * format.group_bytes();
            let len = part.rows.div_ceil(GROUP) * group_len;
            // Each group's bytes are its own: repacked on every core, as a 7B's weights
            // took seconds on one.
            data[start..start + len]
                .par_chunks_mut(group_len)
                .zip(part.bytes.par_chunks(GROUP * row_bytes))
                .for_each(|(blocks, rows)| {
                    for (lane, row) in rows.chunks_exact(row_bytes).enumerate() {
                        for (b, sb) in row.chunks_exact(format.ggml_bytes()).enumerate() {
                            let block = &mut blocks[b * format.group_bytes()..];
                            SuperBlock::from_ggml(format, sb).put(format, block, lane);
                        }
                    }
                });
        }
        Ok(Self::laid_out(shape, cols, layout, Bytes::from(data)))
    }

    /// A matrix of parts `shape` whose group blocks are `data`, as [`KMatrix::data`] gave
    /// them: refused unless `data` is exactly the bytes that layout takes.
    pub(crate) fn from_packed(shape: Vec<PartShape>, cols: usize, data: Bytes) -> Result<Self> {
        if cols == 0 || !cols.is_multiple_of(QK_K) || shape.is_empty() {
            return Err(EngineError::InvalidInput(format!(
                "a packed K-quant matrix of {} parts and {cols} columns",
                shape.len()
            )));
        }
        let layout = Layout::of(&shape, cols);
        if data.len() != layout.bytes {
            return Err(EngineError::InvalidInput(format!(
                "a packed K-quant matrix of {} bytes where its parts take {}",
                data.len(),
                layout.bytes
            )));
        }
        Ok(Self::laid_out(shape, cols, layout, data))
    }

    fn laid_out(shape: Vec<PartShape>, cols: usize, layout: Layout, data: Bytes) -> Self {
        Self {
            rows: shape.iter().map(|p| p.rows).sum(),
            cols,
            shape,
            data,
            groups: layout.groups,
            spans: layout.spans,
            pair_spans: layout.pair_spans,
        }
    }

    /// Its parts, as [`KMatrix::from_packed`] takes them.
    pub(crate) fn shape(&self) -> &[PartShape] {
        &self.shape
    }

    /// Its group blocks, as [`KMatrix::from_packed`] takes them.
    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }

    /// Bytes of weight data read per product.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn blocks(&self, g: usize) -> &[u8] {
        let group = self.groups[g];
        let len = self.cols / QK_K * group.format.group_bytes();
        &self.data[group.at..group.at + len]
    }

    /// Row `r`'s weights, as GGML dequantizes them.
    #[cfg(test)]
    pub(crate) fn dequantized_row(&self, r: usize) -> Vec<f32> {
        let g = self
            .spans
            .iter()
            .rposition(|s| s.col <= r)
            .expect("a group");
        let (format, lane) = (self.groups[g].format, r - self.spans[g].col);
        self.blocks(g)
            .chunks_exact(format.group_bytes())
            .flat_map(|blk| {
                let sb = SuperBlock::get(format, blk, lane);
                (0..QK_K).map(move |i| sb.weight(format, i))
            })
            .collect()
    }

    /// `x Wᵀ` for `x` of `[n, cols]` (row-major): `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "activations of {n} rows");
        self.matmul_on(Path::detect(), x, n)
    }

    fn matmul_on(&self, path: Path, x: &[f32], n: usize) -> Vec<f32> {
        let quantized = Q8KRows::quantize(x, self.cols);
        let q: Vec<_> = (0..n).map(|y| quantized.row(y)).collect();
        let product = KProduct {
            matrix: self,
            rows: q,
        };
        Self::products_on(path, std::slice::from_ref(&product))
            .pop()
            .expect("one product")
    }

    /// Each of `products`, their groups shared out to the pool together: a mixture's
    /// experts, a few rows each, cost one hand-off instead of one per expert. Every output
    /// is the bits [`KMatrix::matmul`] gives for its rows.
    pub(crate) fn products(products: &[KProduct<'_>]) -> Vec<Vec<f32>> {
        Self::products_on(Path::detect(), products)
    }

    fn products_on(path: Path, products: &[KProduct<'_>]) -> Vec<Vec<f32>> {
        let shapes: Vec<split::PaddedProduct<'_>> = products
            .iter()
            .map(|p| split::PaddedProduct {
                rows: p.matrix.rows,
                n: p.rows.len(),
                spans: if path.pairs(p.rows.len()) {
                    &p.matrix.pair_spans
                } else {
                    &p.matrix.spans
                },
            })
            .collect();
        split::by_padded_groups(&shapes, |p, span, out| {
            let (m, q) = (products[p].matrix, &products[p].rows);
            let (format, blocks) = (m.groups[span.group].format, m.blocks(span.group));
            match path {
                Path::Scalar => {
                    scalar::group(format, blocks, q, &mut |y, vals| out.put_lanes(y, &vals))
                }
                #[cfg(target_arch = "x86_64")]
                Path::Vnni512 if span.groups == 2 => {
                    let pair = [blocks, m.blocks(span.group + 1)];
                    let ahead = m.ahead(span.group + 2);
                    // SAFETY: `Path::detect` found AVX2, FMA, F16C and AVX-512 F, BW, VL
                    // and VNNI on this CPU; both groups are of one part (`Layout::of`
                    // pairs no others), so of one format and length, whole blocks for
                    // each super-block of a row of `q`; `out` is theirs alone.
                    unsafe { x86::pair_kernel(format)(pair, q, &ahead, out) }
                }
                #[cfg(target_arch = "x86_64")]
                Path::Avx2 | Path::Vnni | Path::Vnni512 => {
                    let kernel = x86::kernel(format, path != Path::Avx2);
                    // SAFETY: `Path::detect` found AVX2, FMA and F16C (and VNNI for its
                    // kernel) on this CPU; `blocks` is the group's whole blocks, one for
                    // each super-block of a row of `q`; `out` is its alone.
                    unsafe { kernel(blocks, q, out) }
                }
                #[cfg(not(target_arch = "x86_64"))]
                Path::Avx2 | Path::Vnni | Path::Vnni512 => {
                    unreachable!("only x86-64 detects AVX2")
                }
            }
        })
    }

    /// The bytes of groups `g` and `g + 1`, those of them there are, to be asked for a
    /// super-block at a time while the pair before them computes.
    #[cfg(target_arch = "x86_64")]
    fn ahead(&self, g: usize) -> Ahead<2> {
        let bytes = |g: usize| self.groups.get(g).map_or(&[][..], |_| self.blocks(g));
        Ahead::of([bytes(g), bytes(g + 1)], self.cols / QK_K)
    }

    /// Values in a row of activations.
    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    /// Outputs of each activation row.
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }
}
