//! A quantized product's output rows split across candle's pool workers, each writing its
//! own columns of one shared buffer (which other kernels share out the same way), and
//! other work mapped over that pool in order (`map_on_pool`).

use std::marker::PhantomData;
use std::sync::OnceLock;

/// `f` of each item `0..items`, run on candle's pool (the products' workers), in item order.
pub(crate) fn map_on_pool<T: Send + Sync>(items: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let done: Vec<OnceLock<T>> = (0..items).map(|_| OnceLock::new()).collect();
    candle_core::utils::barrier_pool().execute_chunked(items, |range| {
        for item in range {
            let _ = done[item].set(f(item));
        }
    });
    done.into_iter()
        .map(|d| d.into_inner().expect("the pool ran every item"))
        .collect()
}

/// An output buffer shared by pool workers that each write their own disjoint part of it.
pub(crate) struct SharedOut<'a, T = f32> {
    ptr: *mut T,
    len: usize,
    buf: PhantomData<&'a mut [T]>,
}

// SAFETY: workers write disjoint ranges (callers promise it at `slice`), of values that may
// be sent between threads.
unsafe impl<T: Send> Sync for SharedOut<'_, T> {}

impl<'a, T> SharedOut<'a, T> {
    /// Shares `buf`, which stays borrowed while this lives.
    pub(crate) fn new(buf: &'a mut [T]) -> Self {
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
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.len, "outside the shared buffer");
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// Weight rows stored interleaved together by the kernels.
pub(crate) const GROUP: usize = 8;

/// Activation rows from which a product takes its groups two at a time, where the CPU
/// runs a kernel for pairs of groups on 512-bit registers. One row reads each weight once,
/// from memory, and ran slower on pairs: the 1.5B's batch-1 decode (Q4_K) 16-23 tokens/s
/// against 28-31 (engine-bench, alternated); Q8_0 10-15% slower, in the 0.5B's batch-1
/// decode and in `product-bench`, though there Q4_K's and Q6_K's pairs ran 1.1-1.3x faster
/// at one row (it repeats one product on one matrix).
pub(crate) const PAIRED_FROM_ROWS: usize = 4;

/// Where one group's (or one loose row's) outputs go: its columns of each activation row.
pub(crate) struct Columns<'a> {
    out: &'a SharedOut<'a>,
    rows: usize,
    col: usize,
    width: usize,
}

impl Columns<'_> {
    /// How many columns these are.
    pub(crate) fn width(&self) -> usize {
        self.width
    }

    /// Activation row `y`'s outputs for these columns.
    #[inline]
    pub(crate) fn put(&self, y: usize, vals: &[f32]) {
        assert!(vals.len() <= self.width, "more outputs than columns");
        // SAFETY: these columns belong to the one worker that got this group or row.
        let o = unsafe { self.out.slice(y * self.rows + self.col, vals.len()) };
        o.copy_from_slice(vals);
    }

    /// Activation row `y`'s `n` columns from the first, where these columns are that many
    /// or more: for a kernel to store its outputs in place.
    ///
    /// # Safety
    /// No other reference to these columns of row `y` lives while this one does.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub(crate) unsafe fn whole_row(&self, y: usize, n: usize) -> Option<&mut [f32]> {
        // SAFETY: these columns belong to the one worker that got them; the caller holds
        // no other reference to them.
        (self.width >= n).then(|| unsafe { self.out.slice(y * self.rows + self.col, n) })
    }

    /// Activation row `y`'s outputs from a whole group's (or pair's) lanes: as many as
    /// these columns hold (fewer only in a matrix's last, padded group).
    #[inline]
    pub(crate) fn put_lanes<const N: usize>(&self, y: usize, vals: &[f32; N]) {
        if self.width < N {
            return self.put(y, &vals[..self.width]);
        }
        // SAFETY: these columns belong to the one worker that got this group.
        let o = unsafe { self.out.slice(y * self.rows + self.col, N) };
        // A copy of a known length, which needs no call to `memmove` (once a group and
        // activation row, that call was 5-6% of a profile of the 1.5B's batch-16 step).
        let o: &mut [f32; N] = o.try_into().expect("a group's columns");
        *o = *vals;
    }
}

/// The `[n, rows]` product of `n` activation rows with a `rows`-row weight matrix, computed
/// by candle's pool workers (a second pool would fight candle's for the cores), split by
/// pairs of groups of eight weight rows where there is a `pair` kernel (else, and for an
/// odd last group, by single groups) and then the rows after them: `pair(g, out)` computes
/// groups `g` and `g + 1` into the sixteen columns `out` names, `one(g, out)` group `g`
/// into its eight, `loose(r, out)` weight row `r`, each writing its own columns.
pub(crate) fn by_groups<P, O, L>(
    rows: usize,
    n: usize,
    pair: Option<P>,
    one: O,
    loose: L,
) -> Vec<f32>
where
    P: Fn(usize, &Columns<'_>) + Sync,
    O: Fn(usize, &Columns<'_>) + Sync,
    L: Fn(usize, &Columns<'_>) + Sync,
{
    let per = if pair.is_some() { 2 } else { 1 };
    let groups = rows / GROUP;
    let runs = groups.div_ceil(per);
    let mut out = vec![0f32; n * rows];
    let shared = SharedOut::new(&mut out);
    let items = runs + rows - groups * GROUP;
    candle_core::utils::barrier_pool().execute_chunked(items, |range| {
        for item in range {
            let columns = |col, width| Columns {
                out: &shared,
                rows,
                col,
                width,
            };
            if item < runs {
                let first = item * per;
                let width = per.min(groups - first) * GROUP;
                match &pair {
                    Some(pair) if width == 2 * GROUP => pair(first, &columns(first * GROUP, width)),
                    _ => one(first, &columns(first * GROUP, width)),
                }
            } else {
                let r = groups * GROUP + item - runs;
                loose(r, &columns(r, 1));
            }
        }
    });
    out
}

/// Where the outputs of one padded group, or of a run of them, go among a product's columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GroupSpan {
    /// Its (first) group.
    pub(crate) group: usize,
    /// How many groups it is, side by side: one, or two for a 512-bit kernel.
    pub(crate) groups: usize,
    /// Its first output column.
    pub(crate) col: usize,
    /// Its real rows: eight a group, or fewer in the last group of a matrix whose rows were
    /// padded.
    pub(crate) width: usize,
}

/// One `[n, rows]` product of [`by_padded_groups`]: its groups' output columns.
pub(crate) struct PaddedProduct<'a> {
    pub(crate) rows: usize,
    pub(crate) n: usize,
    pub(crate) spans: &'a [GroupSpan],
}

/// [`by_groups`] for kernels that pad each matrix's last rows into a group of their own,
/// for several products at once: their groups are shared out together, so small products
/// (a mixture's experts) cost the pool one hand-off rather than one each.
/// `item(p, span, out)` computes the groups `span` of product `p` names into the columns
/// it names, one of its `spans` a worker; each product's `[n, rows]` output comes back in
/// order.
pub(crate) fn by_padded_groups(
    products: &[PaddedProduct<'_>],
    item: impl Fn(usize, &GroupSpan, &Columns<'_>) + Sync,
) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = products.iter().map(|p| vec![0f32; p.n * p.rows]).collect();
    let shared: Vec<SharedOut<'_>> = outs.iter_mut().map(|o| SharedOut::new(o)).collect();
    // Each product's first item.
    let firsts: Vec<usize> = products
        .iter()
        .scan(0, |at, p| {
            let first = *at;
            *at += p.spans.len();
            Some(first)
        })
        .collect();
    let items: usize = products.iter().map(|p| p.spans.len()).sum();
    candle_core::utils::barrier_pool().execute_chunked(items, |range| {
        for i in range {
            let p = firsts.partition_point(|&f| f <= i) - 1;
            let product = &products[p];
            let span = product.spans[i - firsts[p]];
            assert!(span.width <= span.groups * GROUP && span.col + span.width <= product.rows);
            let columns = Columns {
                out: &shared[p],
                rows: product.rows,
                col: span.col,
                width: span.width,
            };
            item(p, &span, &columns);
        }
    });
    drop(shared);
    outs
}
