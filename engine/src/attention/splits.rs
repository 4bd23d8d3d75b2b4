//! How many runs a GPU decode step cuts each sequence's keys into (flash-decoding). One
//! block attends one (sequence, query head) pair over its whole cache, so a small batch
//! of long caches leaves most of the GPU idle: one sequence of a model with 12 query heads
//! runs 12 blocks on an H100's 132 multiprocessors. Each run is attended by a block of its
//! own and the runs are merged after (`step.cu`'s `merge_splits`).

/// Shortest run worth its own block: each of a block's four warps then takes 64 keys or
/// more, against the merge's extra write and read of a row for each run.
const MIN_RUN_KEYS: usize = 256;

/// Most runs: past about two blocks a multiprocessor, more only adds merging.
const MAX_RUNS: usize = 32;

/// The runs for `pairs` (sequence, query head) pairs whose longest attends `longest` keys,
/// on a GPU of `multiprocessors`: enough blocks to give each multiprocessor about two, in
/// runs of at least `MIN_RUN_KEYS` keys; 1 (no merge) where the pairs fill the GPU already
/// or the caches are short.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU step's; tested in every build
pub(crate) fn key_runs(pairs: usize, longest: usize, multiprocessors: usize) -> usize {
    let fill = (2 * multiprocessors).div_ceil(pairs.max(1));
    fill.min(longest / MIN_RUN_KEYS).clamp(1, MAX_RUNS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_that_fills_the_gpu_is_not_split() {
        assert_eq!(key_runs(64 * 12, 32_768, 132), 1);
        assert_eq!(key_runs(264, 32_768, 132), 1);
    }

    #[test]
    fn short_caches_are_not_split() {
        assert_eq!(key_runs(12, 100, 132), 1);
        assert_eq!(key_runs(12, 511, 132), 1);
    }

    #[test]
    fn a_lone_long_sequence_is_split_to_fill_the_gpu_in_runs_long_enough() {
        // 22 runs of 12 heads give 264 blocks, two a multiprocessor.
        assert_eq!(key_runs(12, 8192, 132), 22);
        // 4,096 keys make at most 16 runs of 256.
        assert_eq!(key_runs(12, 4096, 132), 16);
        assert_eq!(key_runs(2, 1 << 20, 132), MAX_RUNS);
        assert_eq!(key_runs(0, 1 << 20, 132), MAX_RUNS);
    }
}
