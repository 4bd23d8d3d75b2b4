//! A quantized product's output rows split across candle's pool workers, each writing its
//! own columns of one shared buffer (which other kernels share out the same way), work of
//! even items in one range a thread (`in_ranges`), and other work mapped over that pool in
//! order (`map_on_pool`).

use std::cell::Cell;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use shares::Share;

mod shares;

thread_local! {
    /// Set while this thread runs a share of [`in_ranges`] or [`map_on_pool`] work: a call
    /// from inside it runs its items here, as `pool.execute` from inside its own work
    /// would wait on itself.
    static SHARING: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as running a share of pooled work until dropped.
struct Sharing(bool);

impl Sharing {
    fn enter() -> Self {
        Self(SHARING.replace(true))
    }
}

impl Drop for Sharing {
    fn drop(&mut self) {
        SHARING.set(self.0);
    }
}

/// `f` of consecutive ranges of `0..items` on candle's pool threads (the caller's among
/// them), all run before it returns: for work whose items cost about the same (a product's
/// groups, activation blocks, rows to norm). Each thread has a share of the items, one
/// range a thread, and takes it in [`CHUNKS`] chunks; a thread done with its share takes
/// the later half of what another has not yet taken, while that is [`STEAL_FROM`] chunks
/// or more.
///
/// candle's `execute_chunked` hands chunks out from a shared cursor, about eight grabs a
/// thread, and each grab moves the cursor's cache line from one core to the other. On this
/// project's 2-vCPU VMs that round trip took 90-110 ns, or for minutes at a time, as the
/// host placed the vCPUs, 390-470 ns: the "slow mode" in which `product-bench`'s Q4_1
/// products at 16 rows ran 0.6x. With fixed ranges SmolLM2's decode steps ran 1.05-1.18x
/// faster in either mode, a 1.5B's in Q4_K 1.02-1.03x (bench/HISTORY.md, "2026-12-07,
/// third session"). Here a share's claims touch only its own thread's line, and a line
/// crosses over only when a share is taken from: fixed ranges had left one thread waiting
/// at the end of a product while the other streamed its weights (about 5% of a 1.5B's
/// products at batch 1). With the taking, decode steps alternated inside one process ran
/// 1.01-1.05x at batch 16 (a 1.5B in Q4_K and SmolLM2) and 0.94-1.10x at batch 1, three
/// runs each (bench/HISTORY.md, "2026-12-07, fifth session"). Work whose items differ (a
/// batch's sequences, of different lengths) keeps the cursor: [`map_on_pool`]. A lone item
/// runs on the calling thread: handed to a worker, the caller would only wait for it.
pub(crate) fn in_ranges(items: usize, f: impl Fn(Range<usize>) + Sync) {
    if items == 0 {
        return;
    }
    if items == 1 || SHARING.get() {
        return f(0..items);
    }
    let pool = candle_core::utils::barrier_pool();
    let threads = pool.n_workers() + 1;
    let per = items.div_ceil(threads);
    let shares: Vec<Share> = (0..threads)
        .map(|t| Share::new((t * per).min(items)..((t + 1) * per).min(items)))
        .collect();
    let chunk = per.div_ceil(CHUNKS);
    pool.execute(|thread| {
        let _sharing = Sharing::enter();
        let own = &shares[thread];
        loop {
            while let Some(range) = own.claim(chunk) {
                f(range);
            }
            let stolen = (1..threads)
                .find_map(|d| shares[(thread + d) % threads].steal_half(STEAL_FROM * chunk));
            match stolen {
                Some(range) => own.refill(range),
                None => break,
            }
        }
    });
}

/// Chunks a thread's share of [`in_ranges`] is claimed in.
const CHUNKS: usize = 32;
/// Chunks a share must have left to be taken from: smaller leftovers (a few groups of a
/// product at one row, some tens of nanoseconds each) cost less to finish than the cache
/// lines a taking moves between the cores.
const STEAL_FROM: usize = 2;

/// `f` of each item `0..items`, run on candle's pool (the products' workers), in item order.
pub(crate) fn map_on_pool<T: Send + Sync>(items: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    if SHARING.get() {
        return (0..items).map(f).collect();
    }
    let done: Vec<OnceLock<T>> = (0..items).map(|_| OnceLock::new()).collect();
    candle_core::utils::barrier_pool().execute_chunked(items, |range| {
        let _sharing = Sharing::enter();
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

    /// Shares room for `len` values in `buf`'s spare capacity, not yet written: no value
    /// may be read before it is ([`Columns::finish`] checks a worker wrote its whole part). `buf`
    /// stays borrowed while this lives; its caller sets its length once every value is
    /// written.
    pub(crate) fn spare(buf: &'a mut Vec<T>, len: usize) -> Self {
        assert!(buf.is_empty() && buf.capacity() >= len, "no room to share");
        Self {
            ptr: buf.as_mut_ptr(),
            len,
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
/// A kernel writes each row's columns once, rows in order (`put`, `put_lanes`,
/// `whole_row`), and the driver checks it did ([`Columns::finish`]): the output's memory
/// comes from the allocator unwritten and is never cleared first. Clearing it cost a
/// second scattered write of every output (8% of a 2048-token prompt's samples).
pub(crate) struct Columns<'a> {
    out: &'a SharedOut<'a>,
    rows: usize,
    col: usize,
    width: usize,
    /// The activation row whose columns are written next.
    next: Cell<usize>,
    /// Set where a kernel wrote a row out of order or left one out. The driver panics on
    /// its own thread once the pool is done: a panic inside a pool job would poison the
    /// pool's lock for every later product.
    broken: &'a AtomicBool,
}

impl<'a> Columns<'a> {
    fn new(
        out: &'a SharedOut<'a>,
        rows: usize,
        col: usize,
        width: usize,
        broken: &'a AtomicBool,
    ) -> Self {
        Self {
            out,
            rows,
            col,
            width,
            next: Cell::new(0),
            broken,
        }
    }

    /// Counts row `y`'s columns as written: rows come in order, each once.
    #[inline]
    fn written(&self, y: usize) {
        if y != self.next.get() {
            self.broken.store(true, Ordering::Relaxed);
        }
        self.next.set(y + 1);
    }

    /// Checks that every one of the `n` activation rows' columns was written.
    fn finish(&self, n: usize) {
        if self.next.get() != n {
            self.broken.store(true, Ordering::Relaxed);
        }
    }

    /// How many columns these are.
    pub(crate) fn width(&self) -> usize {
        self.width
    }

    /// Activation row `y`'s outputs for these columns.
    #[inline]
    pub(crate) fn put(&self, y: usize, vals: &[f32]) {
        assert_eq!(vals.len(), self.width, "outputs for these columns");
        self.written(y);
        // SAFETY: these columns belong to the one worker that got this group or row.
        let o = unsafe { self.out.slice(y * self.rows + self.col, vals.len()) };
        o.copy_from_slice(vals);
    }

    /// Activation row `y`'s columns, where they are exactly `n`: for a kernel to store its
    /// outputs in place (else it `put`s them). They count as written.
    ///
    /// # Safety
    /// No other reference to these columns of row `y` lives while this one does, and the
    /// caller writes every one of them.
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub(crate) unsafe fn whole_row(&self, y: usize, n: usize) -> Option<&mut [f32]> {
        if self.width != n {
            return None;
        }
        self.written(y);
        // SAFETY: these columns belong to the one worker that got them; the caller holds
        // no other reference to them.
        Some(unsafe { self.out.slice(y * self.rows + self.col, n) })
    }

    /// Activation row `y`'s outputs from a whole group's (or pair's) lanes: as many as
    /// these columns hold (fewer only in a matrix's last, padded group).
    #[inline]
    pub(crate) fn put_lanes<const N: usize>(&self, y: usize, vals: &[f32; N]) {
        if self.width < N {
            return self.put(y, &vals[..self.width]);
        }
        // Every column counts as written below: none may lie past the lanes.
        assert_eq!(self.width, N, "more columns than lanes");
        self.written(y);
        // SAFETY: these columns belong to the one worker that got this group.
        let o = unsafe { self.out.slice(y * self.rows + self.col, N) };
        // A copy of a known length, which needs no call to `memmove` (once a group and
        // activation row, that call was 5-6% of a profile of the 1.5B's batch-16 step).
        let o: &mut [f32; N] = o.try_into().expect("a group's columns");
        *o = *vals;
    }

    /// Row `y`'s `n` outputs (at most two groups' worth) as `store` writes them from a
    /// kernel's register: straight into the row's columns where these are exactly `n`,
    /// else (a matrix's last, padded group) into lanes on the stack, of which as many as
    /// there are columns are copied. Through a stack array and a copy, once a row and
    /// group, the K-quant kernels' stores were 5-6% of a `perf` profile of the 1.5B's
    /// batch-16 step, and the Q4_1 and Q8_0 pair kernels ran 1.01-1.10x slower in
    /// `product-bench` on a Zen 5. `store` writes all `n` of the floats it is given.
    #[inline(always)]
    pub(crate) fn store_row(&self, y: usize, n: usize, store: impl FnOnce(&mut [f32])) {
        // SAFETY: these columns belong to the one worker that got them, and the slice
        // lives only while `store` fills it.
        match unsafe { self.whole_row(y, n) } {
            Some(to) => store(to),
            None => {
                let mut lanes = [0f32; 2 * GROUP];
                store(&mut lanes[..n]);
                self.put(y, &lanes[..self.width]);
            }
        }
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
    let run = |first: usize, columns: &Columns<'_>| match &pair {
        Some(pair) if columns.width() == 2 * GROUP => pair(first, columns),
        _ => one(first, columns),
    };
    by_runs(rows, n, per, run, loose)
}

/// [`by_groups`] by runs of up to `per` groups: `run(g, out)` computes the groups from `g`
/// into the columns `out` names (`per` groups' worth, or fewer in the last run).
pub(crate) fn by_runs<R, L>(rows: usize, n: usize, per: usize, run: R, loose: L) -> Vec<f32>
where
    R: Fn(usize, &Columns<'_>) + Sync,
    L: Fn(usize, &Columns<'_>) + Sync,
{
    let groups = rows / GROUP;
    let runs = groups.div_ceil(per);
    let mut out = Vec::with_capacity(n * rows);
    let shared = SharedOut::spare(&mut out, n * rows);
    let items = runs + rows - groups * GROUP;
    let broken = AtomicBool::new(false);
    in_ranges(items, |range| {
        for item in range {
            if item < runs {
                let first = item * per;
                let width = per.min(groups - first) * GROUP;
                let columns = Columns::new(&shared, rows, first * GROUP, width, &broken);
                run(first, &columns);
                columns.finish(n);
            } else {
                let r = groups * GROUP + item - runs;
                let columns = Columns::new(&shared, rows, r, 1, &broken);
                loose(r, &columns);
                columns.finish(n);
            }
        }
    });
    unwritten_check(&broken);
    // SAFETY: the items' columns are all `rows` (the runs the groups' `groups * GROUP`, the
    // loose rows the rest), each written in every activation row (checked just above), so
    // every value is written.
    unsafe { out.set_len(n * rows) };
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
    for p in products {
        assert!(
            covers(p.spans, p.rows),
            "a product's spans are not its columns"
        );
    }
    let mut outs: Vec<Vec<f32>> = products
        .iter()
        .map(|p| Vec::with_capacity(p.n * p.rows))
        .collect();
    let shared: Vec<SharedOut<'_>> = outs
        .iter_mut()
        .zip(products)
        .map(|(o, p)| SharedOut::spare(o, p.n * p.rows))
        .collect();
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
    let broken = AtomicBool::new(false);
    in_ranges(items, |range| {
        for i in range {
            let p = firsts.partition_point(|&f| f <= i) - 1;
            let product = &products[p];
            let span = product.spans[i - firsts[p]];
            assert!(span.width <= span.groups * GROUP && span.col + span.width <= product.rows);
            let columns = Columns::new(&shared[p], product.rows, span.col, span.width, &broken);
            item(p, &span, &columns);
            columns.finish(product.n);
        }
    });
    drop(shared);
    unwritten_check(&broken);
    for (o, p) in outs.iter_mut().zip(products) {
        // SAFETY: the product's spans cover its columns (checked above), each written in
        // every activation row (checked just above), so every value is written.
        unsafe { o.set_len(p.n * p.rows) };
    }
    outs
}

/// Panics, on the calling thread, where a kernel left a row of its columns unwritten or
/// wrote its rows out of order: the output must not be read.
fn unwritten_check(broken: &AtomicBool) {
    assert!(
        !broken.load(Ordering::Relaxed),
        "a kernel left rows unwritten or wrote them out of order"
    );
}

/// Whether `spans`, in order, are columns `0..rows`, each once.
fn covers(spans: &[GroupSpan], rows: usize) -> bool {
    let end = spans
        .iter()
        .try_fold(0, |at, s| (s.col == at).then_some(at + s.width));
    end == Some(rows)
}

#[cfg(test)]
mod tests;
