//! Sequences the router ends early: with n > 1 it matches a stop string in one sequence
//! while the others go on, and asks (EndSequence) that this one stop decoding. Each running
//! request registers the flags of its sequences here under its id, for as long as any of
//! its sequences holds them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// The running requests' flags, by request id. An entry lives exactly as long as its
/// request's [`Ended`], so the map holds no more than the requests this node runs.
#[derive(Debug, Default)]
pub struct Live(Mutex<HashMap<String, Weak<Ended>>>);

/// Which sequences of one request the router has ended.
#[derive(Debug)]
pub struct Ended {
    flags: Vec<AtomicBool>,
    id: String,
    live: Arc<Live>,
}

impl Live {
    /// The flags of request `id`'s `n` sequences, registered until they are dropped. A
    /// second request under an id still running is not registered: EndSequence reaches the
    /// first one only.
    pub fn register(self: &Arc<Self>, id: &str, n: usize) -> Arc<Ended> {
        let ended = Arc::new(Ended {
            flags: (0..n).map(|_| AtomicBool::new(false)).collect(),
            id: id.to_string(),
            live: Arc::clone(self),
        });
        let mut map = self.0.lock().expect("the live map is never poisoned");
        if map.get(id).is_none_or(|w| w.strong_count() == 0) {
            map.insert(id.to_string(), Arc::downgrade(&ended));
        }
        ended
    }

    /// Marks sequence `choice` of request `id` ended; false when no running request has it.
    pub fn end(&self, id: &str, choice: usize) -> bool {
        let map = self.0.lock().expect("the live map is never poisoned");
        match map.get(id).and_then(Weak::upgrade) {
            Some(e) => match e.flags.get(choice) {
                Some(flag) => {
                    flag.store(true, Ordering::Relaxed);
                    true
                }
                None => false,
            },
            None => false,
        }
    }

    /// Requests registered.
    #[cfg(test)]
    fn registered(&self) -> usize {
        self.0.lock().expect("the live map is never poisoned").len()
    }
}

impl Ended {
    /// Whether the router ended sequence `choice`.
    pub fn is_set(&self, choice: usize) -> bool {
        self.flags
            .get(choice)
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }
}

impl Drop for Ended {
    fn drop(&mut self) {
        let mut map = self.live.0.lock().expect("the live map is never poisoned");
        // Only this request's own entry: a later one may have taken the id since.
        if map.get(&self.id).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_live_as_long_as_their_request() {
        let live = Arc::new(Live::default());
        let ended = live.register("r1", 2);
        assert!(!ended.is_set(1));
        assert!(live.end("r1", 1));
        assert!(ended.is_set(1) && !ended.is_set(0));
        assert!(!live.end("r1", 2), "no third sequence");
        assert!(!live.end("r2", 0), "no such request");
        let copy = Arc::clone(&ended);
        drop(ended);
        assert_eq!(live.registered(), 1, "a sequence still holds the flags");
        drop(copy);
        assert_eq!(live.registered(), 0, "the entry leaves with its request");
        assert!(!live.end("r1", 0));
    }
}
