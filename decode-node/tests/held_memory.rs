//! `hold_freed_memory` keeps freed KV-sized blocks resident for the next cache. A test of
//! its own without the test harness, so that no other thread has a malloc arena first.

/// Resident pages of this process.
fn resident_pages() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("reading /proc/self/statm");
    statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("statm's second field")
}

/// Bytes per page that /proc/self/statm counts in: 4 KiB on the x86-64 Linux this runs on.
const PAGE: usize = 4096;

/// Pages as MiB.
fn mib(pages: usize) -> usize {
    pages * PAGE / (1 << 20)
}

fn main() {
    decode_node::hold_freed_memory();
    // A 4096-token SmolLM2 cache: 60 layer tensors of 3 MiB, each written in full.
    let layers: Vec<Vec<u8>> = (0..60).map(|i| vec![i as u8 | 1; 3 << 20]).collect();
    let held = resident_pages();
    drop(layers);
    let after = resident_pages();
    let cache = 60 * (3 << 20);
    assert!(
        held * PAGE >= cache,
        "the cache was not resident: {} MiB",
        mib(held)
    );
    assert!(
        (after + (16 << 20) / PAGE) >= held,
        "freeing the cache gave {} MiB of {} back to the kernel",
        mib(held.saturating_sub(after)),
        mib(held)
    );
    // The next cache of the same size takes the same memory.
    let again: Vec<Vec<u8>> = (0..60).map(|i| vec![i as u8 | 1; 3 << 20]).collect();
    let grown = resident_pages().saturating_sub(held);
    assert!(
        grown * PAGE < 16 << 20,
        "the next cache took {} MiB of new memory",
        mib(grown)
    );
    drop(again);
    println!("held_memory: ok ({} MiB held)", mib(after));
}
