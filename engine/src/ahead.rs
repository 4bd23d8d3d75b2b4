//! Weights a product's kernel asks the memory for while it computes with others: the next
//! pair of groups' bytes, a part with each block of the pair it works on. Attention's
//! kernels ask for their keys and values a fixed distance ahead with [`ask_for`] and
//! [`ask_first`].
//!
//! A decode step reads every layer's weights once, with attention's K/V cache read between
//! them, so the weights come from memory, not the caches. A pair's runs are a few KiB, and
//! the cores' prefetchers stop at every 4 KiB page, so each pair began by waiting: on a
//! 512-bit Xeon the products of a batch-16 step of SmolLM2 took about 1.4x (Q4_1) and 1.6x
//! (the Q8_0 head) their time in `product-bench`, where each matrix stays in the caches.
//! Asked for a pair ahead, the products took about 9% fewer samples and the step ran a
//! median 1.06x faster (bench/HISTORY.md, "2026-12-06, second session").

/// Byte runs asked for in `parts` parts, one part at a time. It keeps no borrow of them: a
/// prefetch of any address, freed or never mapped, reads nothing and never faults.
#[derive(Clone, Copy)]
pub(crate) struct Ahead<const N: usize> {
    /// Each run's first byte and length.
    runs: [(*const u8, usize); N],
    /// Bytes of a part of each run.
    step: [usize; N],
}

impl<const N: usize> Ahead<N> {
    /// Nothing to ask for.
    pub(crate) const NONE: Self = Self {
        runs: [(std::ptr::null(), 0); N],
        step: [0; N],
    };

    /// `runs` in `parts` parts: part `i` is each run's `i`-th `1 / parts` of its bytes.
    pub(crate) fn of(runs: [&[u8]; N], parts: usize) -> Self {
        let runs = runs.map(|r| (r.as_ptr(), r.len()));
        Self {
            step: runs.map(|(_, len)| len.div_ceil(parts.max(1))),
            runs,
        }
    }

    /// The cache lines its first `parts` parts ask for.
    #[cfg(test)]
    pub(crate) fn lines(&self, parts: usize) -> std::collections::BTreeSet<usize> {
        let mut lines = std::collections::BTreeSet::new();
        for i in 0..parts {
            self.each_line(i, |at| {
                lines.insert(at as usize / LINE);
            });
        }
        lines
    }

    /// What the tile of activation rows from row `y` asks for: all of it for a pair's first
    /// tile, nothing for the others, so each line is asked for once, as early as it can be.
    #[inline(always)]
    pub(crate) fn for_tile_from(&self, y: usize) -> &Self {
        if y == 0 {
            self
        } else {
            &Self::NONE
        }
    }

    /// Asks for part `i`'s cache lines of every run.
    #[inline(always)]
    pub(crate) fn part(&self, i: usize) {
        self.each_line(i, prefetch);
    }

    /// `f` of an address in each cache line that part `i` of a run asks for: the lines that
    /// start inside the part, and for the first part the line that holds the run's first
    /// byte too. Each line of a run is asked for once over all its parts.
    #[inline(always)]
    fn each_line(&self, i: usize, mut f: impl FnMut(*const u8)) {
        for (&(at, len), &step) in self.runs.iter().zip(&self.step) {
            let from = (i * step).min(len);
            let to = (from + step).min(len);
            if from == to {
                continue;
            }
            let mut next = from + (LINE - (at as usize + from) % LINE) % LINE;
            if from == 0 && next > 0 {
                f(at);
            }
            while next < to {
                f(at.wrapping_add(next));
                next += LINE;
            }
        }
    }
}

/// Bytes of a cache line.
const LINE: usize = 64;

/// Bytes a pair kernel asks for a block at a time, as runs of each block.
pub(crate) trait BlockRuns {
    /// `f(at, len)` for each run of bytes of block `b` (`len` at least 1).
    fn each_run(&self, b: usize, f: impl FnMut(*const u8, usize));

    /// Asks for block `b`'s runs.
    #[inline(always)]
    fn ask(&self, b: usize) {
        self.each_run(b, ask_for);
    }
}

/// The cache lines that `runs` asks for over its first `blocks` blocks.
#[cfg(test)]
pub(crate) fn lines_asked(
    runs: &impl BlockRuns,
    blocks: usize,
) -> std::collections::BTreeSet<usize> {
    let mut lines = std::collections::BTreeSet::new();
    for b in 0..blocks {
        runs.each_run(b, |at, len| {
            each_line_of(at, len, |at| {
                lines.insert(at as usize / LINE);
            })
        });
    }
    lines
}

/// Asks for the cache lines that hold the `len` bytes at `at` (`len` at least 1): the
/// line of every 64th byte from `at` and of the last. A kernel that asks for a block of
/// the next weights with each block it computes passes a constant `len`, so this is a few
/// prefetches with no arithmetic besides their addresses: `Ahead`'s per-part line
/// arithmetic, run once per 32-weight block, was about 90 instructions beside the Q4_1 pair
/// kernel's 250 for a block (bench/HISTORY.md, "2026-12-07, second session").
#[inline(always)]
pub(crate) fn ask_for(at: *const u8, len: usize) {
    each_line_of(at, len, prefetch);
}

/// Asks for the first `len` bytes of `run` (none where `len` is 0): a kernel that then
/// asks for the bytes a fixed distance ahead of each read starts with all of its first
/// distance asked for.
#[inline(always)]
pub(crate) fn ask_first(run: &[u8], len: usize) {
    if len > 0 {
        let run = &run[..len];
        ask_for(run.as_ptr(), run.len());
    }
}

/// `f` of an address in each cache line [`ask_for`] asks for; a line can come twice.
#[inline(always)]
pub(crate) fn each_line_of(at: *const u8, len: usize, mut f: impl FnMut(*const u8)) {
    let mut off = 0;
    while off < len {
        f(at.wrapping_add(off));
        off += LINE;
    }
    f(at.wrapping_add(len - 1));
}

#[inline(always)]
fn prefetch(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and never faults, whatever the
    // address; SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// The cache lines that hold a byte of `runs`.
#[cfg(test)]
pub(crate) fn lines_of(runs: &[&[u8]]) -> std::collections::BTreeSet<usize> {
    runs.iter()
        .flat_map(|r| r.iter().map(|b| b as *const u8 as usize / LINE))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// The parts ask for each line that holds a byte of a run once, and for no other line,
    /// whatever the run's length and alignment and however many parts.
    #[test]
    fn the_parts_ask_for_every_line_of_each_run_once() {
        let buf = vec![0u8; 8192];
        // Starts relative to a line's first byte.
        let base = buf.as_ptr().align_offset(LINE);
        let buf = &buf[base..];
        let cases = [
            (0, 2304, 18),
            (5, 576, 18),
            (63, 1, 4),
            (1, 200, 7),
            (3, 100, 200),
        ];
        for (start, len, parts) in cases {
            let runs = [
                &buf[start..start + len],
                &buf[start + 3000..start + 3000 + len / 2],
            ];
            let ahead = Ahead::of(runs, parts);
            let mut asked = Vec::new();
            for i in 0..parts {
                ahead.each_line(i, |at| asked.push(at as usize / LINE));
            }
            let want = lines_of(&runs);
            assert_eq!(
                asked.len(),
                want.len(),
                "{start} {len} {parts}: a line twice"
            );
            assert_eq!(asked.into_iter().collect::<BTreeSet<_>>(), want);
            assert_eq!(ahead.lines(parts), want);
        }
    }

    #[test]
    fn none_asks_for_nothing() {
        Ahead::<3>::NONE.each_line(0, |_| panic!("asked for a line"));
    }
}
