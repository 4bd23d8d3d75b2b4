//! `hold_freed_memory` keeps freed KV-sized and prompt-sized blocks resident for the next
//! ones, and `return_freed_memory` gives them back. A test of its own without the test
//! harness, so that no other thread has a malloc arena first.

/// Resident pages of this process.
fn resident_pages() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("reading /proc/self/statm");
    statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("statm's second field")
}

/// Minor page faults this process has taken: pages it touched for the first time since
/// they were mapped.
fn minor_faults() -> i64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole rusage into the pointer it is given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage");
    // SAFETY: getrusage succeeded, so it wrote the struct (zeroed before in any case).
    unsafe { usage.assume_init() }.ru_minflt
}

/// Bytes per page that /proc/self/statm counts in: 4 KiB on the x86-64 Linux this runs on.
const PAGE: usize = 4096;

/// Pages as MiB.
fn mib(pages: usize) -> usize {
    pages * PAGE / (1 << 20)
}

fn main() {
    runtime::hold_freed_memory();
    // A 512-token prompt's gate and up outputs in a 1.5B Qwen2.5: 37 MB, past the 32 MiB
    // from which glibc always maps a block on its own, freed and taken again at every
    // layer. First, while nothing else is freed: a block that a freed one can hold comes
    // from the arena either way. Mapped afresh, each would fault in its 9,000 pages.
    let block = 512 * 17920 * 4;
    let mut worst = 0;
    for layer in 0..8 {
        let before = minor_faults();
        let outputs = vec![layer as u8 | 1; block];
        let faults = minor_faults() - before;
        if layer > 0 {
            worst = worst.max(faults);
        }
        drop(outputs);
    }
    assert!(
        worst * (PAGE as i64) < 1 << 20,
        "a prompt's block took {worst} page faults after the first"
    );
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
    // Once a model has loaded, what it freed goes back.
    let held = resident_pages();
    runtime::return_freed_memory();
    let returned = held.saturating_sub(resident_pages());
    assert!(
        returned * PAGE >= cache - (16 << 20),
        "return_freed_memory gave back {} MiB of the {} MiB cache",
        mib(returned),
        cache >> 20
    );
    println!("held_memory: ok ({} MiB held)", mib(after));
}
