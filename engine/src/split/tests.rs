use std::sync::atomic::AtomicUsize;

use super::*;

/// Each item runs once, in consecutive ranges, for counts below, at and
/// above the pool's threads; a call from inside a share runs its items where it is
/// called (from the pool's one lock, it would wait on itself), as does one from inside
/// `map_on_pool`'s work.
#[test]
fn ranges_run_every_item_once_and_nest() {
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    for items in [0, 1, threads, 2 * threads + 1, 37] {
        let runs: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
        let ranges = AtomicUsize::new(0);
        let inner = AtomicUsize::new(0);
        in_ranges(items, |range| {
            ranges.fetch_add(1, Ordering::Relaxed);
            range.for_each(|i| {
                runs[i].fetch_add(1, Ordering::Relaxed);
            });
            in_ranges(3, |r| {
                inner.fetch_add(r.len(), Ordering::Relaxed);
            });
        });
        assert!(
            runs.iter().all(|r| r.load(Ordering::Relaxed) == 1),
            "{items}"
        );
        assert_eq!(
            inner.load(Ordering::Relaxed),
            3 * ranges.load(Ordering::Relaxed)
        );
    }
    let caller = std::thread::current().id();
    in_ranges(1, |_| assert_eq!(std::thread::current().id(), caller));
    let sums = map_on_pool(4, |i| {
        let n = AtomicUsize::new(0);
        in_ranges(i + 1, |r| {
            n.fetch_add(r.len(), Ordering::Relaxed);
        });
        map_on_pool(2, |j| j).len() + n.load(Ordering::Relaxed)
    });
    assert_eq!(sums, vec![3, 4, 5, 6]);
}

/// A thread held up inside its share (here by its first item, until another thread has
/// run an item of the same share) has the rest of the share taken by the others. With
/// fixed ranges the wait would end only at its bound, and the assertion fail.
#[test]
fn a_share_held_up_is_finished_by_another_thread() {
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    if threads < 2 {
        return;
    }
    let (items, per) = (64 * threads, 64);
    let ran_by: Vec<OnceLock<std::thread::ThreadId>> =
        (0..items).map(|_| OnceLock::new()).collect();
    let taken = || {
        let first = ran_by[0].get();
        (1..per).any(|i| ran_by[i].get().is_some_and(|t| Some(t) != first))
    };
    in_ranges(items, |range| {
        for i in range {
            let _ = ran_by[i].set(std::thread::current().id());
            if i == 0 {
                let bound = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while !taken() && std::time::Instant::now() < bound {
                    std::hint::spin_loop();
                }
            }
        }
    });
    assert!(
        taken(),
        "the held-up share's items all waited for its thread"
    );
    assert!(ran_by.iter().all(|t| t.get().is_some()));
}

/// (rows, activation rows): 5 groups and 3 loose rows (pairs, an odd last group, loose
/// rows), 7 activation rows.
const SHAPE: (usize, usize) = (5 * GROUP + 3, 7);

/// A kernel writing `rows` of its columns, in that order, each row's values its row
/// number plus its first column.
fn writes(rows: &[usize], out: &Columns<'_>) {
    for &y in rows {
        let vals: Vec<f32> = (0..out.width())
            .map(|c| (y * 1000 + out.col + c) as f32)
            .collect();
        out.put(y, &vals);
    }
}

#[test]
fn a_product_holds_what_its_kernels_wrote_in_every_column() {
    let (rows, n) = SHAPE;
    let all: Vec<usize> = (0..n).collect();
    let kernel = |_: usize, out: &Columns<'_>| writes(&all, out);
    let out = by_groups(rows, n, Some(kernel), kernel, kernel);
    for (i, &x) in out.iter().enumerate() {
        assert_eq!(x, (i / rows * 1000 + i % rows) as f32, "value {i}");
    }
}

#[test]
#[should_panic(expected = "left rows unwritten or wrote them out of order")]
fn a_kernel_that_skips_a_row_is_caught() {
    let (rows, n) = SHAPE;
    let kernel = |_: usize, out: &Columns<'_>| writes(&[0, 1, 2], out);
    by_groups(rows, n, None::<fn(usize, &Columns<'_>)>, kernel, kernel);
}

#[test]
#[should_panic(expected = "left rows unwritten or wrote them out of order")]
fn a_kernel_that_writes_a_row_twice_is_caught() {
    let (rows, n) = SHAPE;
    let twice: Vec<usize> = [0].into_iter().chain(0..n).collect();
    let kernel = |_: usize, out: &Columns<'_>| writes(&twice, out);
    by_groups(rows, n, None::<fn(usize, &Columns<'_>)>, kernel, kernel);
}

#[test]
#[should_panic(expected = "left rows unwritten or wrote them out of order")]
fn a_padded_product_whose_kernel_writes_nothing_is_caught() {
    let spans = [
        GroupSpan {
            group: 0,
            groups: 2,
            col: 0,
            width: 2 * GROUP,
        },
        GroupSpan {
            group: 2,
            groups: 1,
            col: 2 * GROUP,
            width: 3,
        },
    ];
    let product = PaddedProduct {
        rows: 2 * GROUP + 3,
        n: 5,
        spans: &spans,
    };
    by_padded_groups(&[product], |_, _, _| {});
}

#[test]
fn spans_cover_a_products_columns_only_in_order_and_once() {
    let span = |col, width| GroupSpan {
        group: 0,
        groups: 1,
        col,
        width,
    };
    assert!(covers(&[span(0, 8), span(8, 3)], 11));
    assert!(!covers(&[span(0, 8), span(9, 2)], 11), "a gap");
    assert!(!covers(&[span(0, 8), span(7, 4)], 11), "an overlap");
    assert!(!covers(&[span(0, 8)], 11), "short");
    assert!(!covers(&[span(8, 3), span(0, 8)], 11), "out of order");
}
