//! Each thread's share of [`super::in_ranges`]' items, taken a chunk at a time from its own
//! cache line, and taken from the other threads' shares (the unclaimed half) once its own
//! is done.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// One thread's unclaimed items, `next .. end`, packed in one word on a cache line of its
/// own: its owner's claims touch no other core's line; only a steal moves it.
#[repr(align(128))]
pub(super) struct Share(AtomicU64);

impl Share {
    pub(super) fn new(items: Range<usize>) -> Self {
        Self(AtomicU64::new(pack(items)))
    }

    /// The next `chunk` of this share's items (fewer at its end), or `None` once none is
    /// left.
    pub(super) fn claim(&self, chunk: usize) -> Option<Range<usize>> {
        self.take(|left| Some(left.start..left.end.min(left.start + chunk)))
    }

    /// The later half of this share's unclaimed items, where at least `least` are left
    /// (and two at the least): the owner keeps the earlier half, which it reaches first.
    pub(super) fn steal_half(&self, least: usize) -> Option<Range<usize>> {
        self.take(|left| {
            (left.len() >= least.max(2)).then(|| left.start + left.len() / 2..left.end)
        })
    }

    /// Gives this (spent) share `items`, which it had stolen, for others to steal from.
    pub(super) fn refill(&self, items: Range<usize>) {
        self.0.store(pack(items), Ordering::Release);
    }

    /// `pick` of the unclaimed items, taken from them whole at one end or the other.
    fn take(&self, pick: impl Fn(Range<usize>) -> Option<Range<usize>>) -> Option<Range<usize>> {
        let mut word = self.0.load(Ordering::Acquire);
        loop {
            let left = unpack(word);
            let taken = pick(left.clone()).filter(|t| !t.is_empty())?;
            let rest = if taken.start == left.start {
                taken.end..left.end
            } else {
                left.start..taken.start
            };
            match self.0.compare_exchange_weak(
                word,
                pack(rest),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(taken),
                Err(now) => word = now,
            }
        }
    }
}

fn pack(items: Range<usize>) -> u64 {
    let bound = |i: usize| u32::try_from(i).expect("fewer than 2^32 items") as u64;
    bound(items.start) << 32 | bound(items.end)
}

fn unpack(word: u64) -> Range<usize> {
    (word >> 32) as usize..(word & u64::from(u32::MAX)) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_claims_in_chunks_and_a_thief_takes_the_later_half() {
        let share = Share::new(10..30);
        assert_eq!(share.claim(4), Some(10..14));
        assert_eq!(share.steal_half(2), Some(22..30));
        assert_eq!(share.claim(4), Some(14..18));
        assert_eq!(share.claim(4), Some(18..22));
        assert_eq!(share.claim(4), None);
        assert_eq!(share.steal_half(2), None);
        share.refill(40..43);
        assert_eq!(share.steal_half(2), Some(41..43));
        assert_eq!(share.claim(8), Some(40..41));
        assert_eq!(share.steal_half(2), None, "one item is left to its owner");
    }
}
