//! Scores against a Q8_0 cache's keys as integer products, as llama.cpp computes them over
//! its own Q8_0 caches: each query row quantized to Q8_0 blocks (the cache's own
//! quantizer), each block pair's 32 byte products summed exactly in an `i32`, and a key's
//! score the chain `s = fma(sum_b, d_query_b * d_key_b, s)` over its blocks in order from
//! zero, times the scale ([`dot`]). The sums are exact, so any order of the bytes gives
//! the same chain: the vector kernels and the scalar code give the same bits.
//!
//! Widening each key to f32 and multiplying in floats took a third of a batch-16 step's
//! attention on a 512-bit Xeon, bound by instructions rather than reads (the f16 and Q8_0
//! caches' scores took the same time at half the bytes). Here a run of keys' blocks is
//! turned so that each 32-bit lane holds one key's four bytes, and one multiply-add of
//! bytes against four of a query's bytes, broadcast, adds them for the whole run: 16 keys
//! with AVX-512 VNNI's `vpdpbusd`, 8 with AVX2's `vpmaddubsw`.
//!
//! A query of 16-bit integers (a scale per block) was tried too: twice the multiply-adds,
//! and on SmolLM2 no closer to the f32 query's log-probabilities than the 8-bit one. Both
//! sat about 0.12 nats from them on average: in a model whose every product requantizes
//! its activations, a change of the scores as small as the 16-bit query's moves them as
//! far (bench/HISTORY.md, "2026-12-06, fourth session").

use half::f16;

use super::kernels::Kernel;
use crate::kv_cache::{quantize_row, KvDtype, Q8_0_BYTES};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod vnni;

/// The integer scores' working memory, reused from call to call.
#[derive(Default)]
pub(super) struct Working {
    /// The query rows as Q8_0 blocks.
    query: Vec<u8>,
    /// Per query block, -128 times its bytes' sum (the VNNI kernel's: see `vnni::score`).
    bias: Vec<i32>,
    /// The last run of keys, beside rows of zeros.
    tail: Vec<u8>,
}

/// `out[r * len + j]` is query row `r`'s score against key `j` (rows of Q8_0 blocks), as
/// `super::kernels::scores` for a Q8_0 cache, which has checked that this CPU runs
/// `kernel`.
#[allow(clippy::too_many_arguments)] // `super::kernels::scores`'
pub(super) fn scores(
    kernel: Kernel,
    q: &[f32],
    keys: &[u8],
    len: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
    work: &mut Working,
) {
    let row = KvDtype::Q8_0.row_bytes(head_dim);
    let rows = q.len() / head_dim;
    assert!(keys.len() >= len * row && out.len() >= rows * len);
    let Working { query, bias, tail } = work;
    query.resize(rows * row, 0);
    for (x, o) in q.chunks_exact(head_dim).zip(query.chunks_exact_mut(row)) {
        quantize_row(x, o);
    }
    #[cfg(target_arch = "x86_64")]
    if kernel != Kernel::Scalar {
        let run = Run {
            bias: Run::biases(query, bias),
            query,
            rows,
            row,
            len,
            scale,
        };
        return run.score_all(kernel, keys, tail, out);
    }
    let _ = (kernel, bias, tail);
    for (j, key) in keys.chunks_exact(row).take(len).enumerate() {
        for (r, qr) in query.chunks_exact(row).enumerate() {
            out[r * len + j] = dot(qr, key) * scale;
        }
    }
}

/// Two rows of Q8_0 blocks' product: per block the exact sum of the byte products, then
/// the chain over the blocks.
fn dot(query: &[u8], key: &[u8]) -> f32 {
    let mut s = 0f32;
    for (a, b) in query
        .chunks_exact(Q8_0_BYTES)
        .zip(key.chunks_exact(Q8_0_BYTES))
    {
        let sum: i32 = a[2..]
            .iter()
            .zip(&b[2..])
            .map(|(&x, &y)| i32::from(x as i8) * i32::from(y as i8))
            .sum();
        s = (sum as f32).mul_add(scale_of(a) * scale_of(b), s);
    }
    s
}

/// A Q8_0 block's scale, widened.
fn scale_of(block: &[u8]) -> f32 {
    f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// The quantized query rows and where their scores go: what a kernel needs for each run
/// of keys.
#[cfg(target_arch = "x86_64")]
struct Run<'a> {
    /// The query rows, of Q8_0 blocks.
    query: &'a [u8],
    /// Per query block, -128 times its bytes' sum.
    bias: &'a [i32],
    rows: usize,
    /// Bytes of a row, query or key.
    row: usize,
    /// Keys a row sees: row `r`'s scores are `out[r * len..][..len]`.
    len: usize,
    scale: f32,
}

#[cfg(target_arch = "x86_64")]
impl<'a> Run<'a> {
    /// Each query block's -128 times its bytes' sum, into `bias`.
    fn biases(query: &[u8], bias: &'a mut Vec<i32>) -> &'a [i32] {
        bias.clear();
        bias.extend(query.chunks_exact(Q8_0_BYTES).map(|block| {
            let sum: i32 = block[2..].iter().map(|&x| i32::from(x as i8)).sum();
            -128 * sum
        }));
        bias
    }

    /// Every row's scores against the keys, by the vector kernel `kernel` allows: VNNI's
    /// where the CPU has it and `kernel` is 512-bit, else AVX2's.
    fn score_all(&self, kernel: Kernel, keys: &[u8], tail: &mut Vec<u8>, out: &mut [f32]) {
        if kernel == Kernel::Avx512 && crate::act_quant::has_vnni_512() {
            each_run(keys, self, vnni::RUN, tail, |from, j0, here| {
                // SAFETY: AVX-512 F, BW, VL and VNNI are present (checked just above), and
                // F16C (`Kernel::Avx512` has it); `each_run` hands out whole runs of rows.
                unsafe { vnni::score(self, from, j0, here, out) }
            });
        } else {
            each_run(keys, self, avx2::RUN, tail, |from, j0, here| {
                // SAFETY: AVX2 and F16C are present (`super::kernels::scores` checked that
                // the CPU runs `kernel`, and every kernel but the scalar code needs them);
                // `each_run` hands out whole runs of rows.
                unsafe { avx2::score(self, from, j0, here, out) }
            });
        }
    }
}

/// Keys ahead whose lines each run asks for, after asking for all of those before it
/// (4.3 KiB at heads of 64, as the f16 kernel asks): a step reads each head's keys once,
/// from memory, in runs the cores' prefetchers stop within.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 64;

/// `score(from, j0, here)` for each run of `run` keys of `keys`, from key `j0`, with
/// `here` keys in it: a whole run of rows readable from `from` every time. The last,
/// shorter run is copied into `tail` beside rows of zeros, whose scores a kernel computes
/// and never stores.
#[cfg(target_arch = "x86_64")]
fn each_run(
    keys: &[u8],
    at: &Run,
    run: usize,
    tail: &mut Vec<u8>,
    mut score: impl FnMut(*const u8, usize, usize),
) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let (len, row) = (at.len, at.row);
    let full = len / run * run;
    crate::ahead::ask_first(keys, AHEAD.min(full) * row);
    for j0 in (0..full).step_by(run) {
        let from = keys[j0 * row..].as_ptr();
        if j0 + AHEAD + run <= full {
            let next = keys[(j0 + AHEAD) * row..][..run * row]
                .as_ptr()
                .cast::<i8>();
            for line in (0..run * row).step_by(64) {
                // SAFETY: a prefetch reads nothing; `next` is a line of `keys` anyway.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(next.add(line)) };
            }
        }
        score(from, j0, run);
    }
    if full < len {
        let here = len - full;
        tail.clear();
        tail.extend_from_slice(&keys[full * row..][..here * row]);
        tail.resize(run * row, 0);
        score(tail.as_ptr(), full, here);
    }
}
