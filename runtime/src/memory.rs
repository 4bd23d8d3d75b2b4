//! How a node's process keeps the memory it frees.

/// Keeps the memory the process frees for its next allocations of the same size: one
/// malloc arena, trimmed only past 2 GiB free, and every block from that arena rather than
/// a mapping of its own. By default glibc maps large blocks on their own (those of 32 MiB
/// or more always) and unmaps them when freed, and a thread arena gives its 64 MiB heaps
/// back as soon as a large block in them is freed, so the next block of that size pays a
/// page fault and a cleared page per 4 KiB:
/// - a decode node's KV caches (bench/README.md, figure 3);
/// - a prompt's activations: a 512-token prompt's gate and up outputs are 37 MB in a
///   1.5B Qwen2.5, 78 MB in a 7B, one block per layer. With every block from the arena,
///   engine-bench's prefill of the 1.5B went 219-252 tokens/s against 169-195 with
///   glibc's defaults and 200-246 with blocks of 32 MiB and more still mapped (four
///   alternated rounds); page clearing went from 5.5% of a profile's samples to 2%.
///
/// The process's resident memory so stays near its peak, as with an inference server that
/// reserves its memory up front. Call it first thing in `main`: threads that already have
/// an arena keep it.
pub fn hold_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; no allocation is in flight on
    // another thread yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// Gives the kernel back the free memory the allocator holds: once, after the model has
/// loaded, when what is free is the load's own transient blocks (a tensor's file bytes
/// before they are repacked), which [`hold_freed_memory`] would otherwise keep beside the
/// weights for good: a 1.5B Qwen2.5 in Q4_K_M (a 0.99 GB file) holds 1.07 GB after its
/// load with this, 1.31 GB without.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory the allocator holds; it is safe to
    // call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
