//! KV caches in flight: a transfer and its Generate call meet here, whichever comes first.
//! A received cache waits for its call at most the KV timeout; a call waits for its
//! transfer at most the (longer) KV wait, since its prompt may queue at the prefill node
//! first.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::{Sampled, SeqCache};
use tokio::sync::oneshot;

use crate::error::DecodeError;

/// A complete transfer: the prompt's cache and the first token of each sequence.
pub struct Arrived {
    pub cache: SeqCache,
    pub first_tokens: Vec<Sampled>,
}

type Delivery = Result<Arrived, String>;

enum Slot {
    /// Delivered, not yet claimed; `u64` tells a reaper whether the slot is still its own.
    Delivered(Delivery, u64),
    /// Claimed, not yet delivered.
    Waiting(oneshot::Sender<Delivery>),
}

/// Transfers keyed by request id.
pub struct TransferStore {
    slots: Mutex<HashMap<String, Slot>>,
    timeout: Duration,
    wait: Duration,
    next_gen: AtomicU64,
}

impl TransferStore {
    /// A store whose caches live at most `timeout` unclaimed, and whose claims wait at most
    /// `wait` for their transfer.
    pub fn new(timeout: Duration, wait: Duration) -> Arc<Self> {
        Arc::new(Self {
            slots: Mutex::default(),
            timeout,
            wait,
            next_gen: AtomicU64::new(0),
        })
    }

    /// How long a received cache waits for its Generate call; also how long a transfer may
    /// go quiet before it is cut.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Hands a finished (or failed) transfer to its Generate call, or keeps it until that
    /// call comes or the timeout frees it.
    pub fn deliver(self: &Arc<Self>, id: &str, delivery: Delivery) {
        let mut slots = self.slots.lock().expect("store lock");
        let delivery = match slots.remove(id) {
            Some(Slot::Waiting(tx)) => match tx.send(delivery) {
                Ok(()) => return,
                // The waiter gave up; keep the cache until the reaper frees it, so a retried
                // Generate call can still find it.
                Err(d) => d,
            },
            _ => delivery,
        };
        let gen = self.next_gen.fetch_add(1, Ordering::Relaxed);
        slots.insert(id.to_string(), Slot::Delivered(delivery, gen));
        drop(slots);
        let store = Arc::clone(self);
        let id = id.to_string();
        tokio::spawn(async move {
            tokio::time::sleep(store.timeout).await;
            let mut slots = store.slots.lock().expect("store lock");
            if matches!(slots.get(&id), Some(Slot::Delivered(_, g)) if *g == gen) {
                slots.remove(&id);
                tracing::warn!(req_id = %id, "KV cache never claimed; freed");
            }
        });
    }

    /// Waits for the transfer of `id`, at most the store's KV wait.
    pub async fn claim(&self, id: &str) -> Result<Arrived, DecodeError> {
        let failed = |reason| DecodeError::TransferFailed {
            id: id.to_string(),
            reason,
        };
        let rx = {
            let mut slots = self.slots.lock().expect("store lock");
            match slots.remove(id) {
                Some(Slot::Delivered(d, _)) => return d.map_err(failed),
                Some(w @ Slot::Waiting(_)) => {
                    slots.insert(id.to_string(), w);
                    return Err(DecodeError::Duplicate(id.to_string()));
                }
                None => {
                    let (tx, rx) = oneshot::channel();
                    slots.insert(id.to_string(), Slot::Waiting(tx));
                    rx
                }
            }
        };
        let mut rx = rx;
        match tokio::time::timeout(self.wait, &mut rx).await {
            Ok(Ok(d)) => d.map_err(failed),
            Ok(Err(_)) => Err(DecodeError::ShuttingDown),
            Err(_) => {
                self.slots.lock().expect("store lock").remove(id);
                // A delivery may have landed between the timeout and the removal.
                match rx.try_recv() {
                    Ok(d) => d.map_err(failed),
                    Err(_) => Err(DecodeError::KvTimeout(
                        id.to_string(),
                        self.wait.as_millis() as u64,
                    )),
                }
            }
        }
    }

    /// Forgets the claim of a Generate call whose caller left, unless its cache has come.
    pub fn abandon(&self, id: &str) {
        let mut slots = self.slots.lock().expect("store lock");
        if matches!(slots.get(id), Some(Slot::Waiting(_))) {
            slots.remove(id);
        }
    }

    /// Entries held now: delivered caches and waiting calls.
    pub fn len(&self) -> usize {
        self.slots.lock().expect("store lock").len()
    }

    /// What the store holds, for the gauges: delivered caches not yet claimed (memory
    /// outside the block budget, bounded by the timeout), then Generate calls waiting for
    /// their transfer. One look under the lock, so the two agree.
    pub fn held(&self) -> (usize, usize) {
        let slots = self.slots.lock().expect("store lock");
        slots
            .values()
            .fold((0, 0), |(delivered, awaited), s| match s {
                Slot::Delivered(Ok(_), _) => (delivered + 1, awaited),
                // A failed transfer is kept only to answer its Generate call at once; it holds
                // no cache.
                Slot::Delivered(Err(_), _) => (delivered, awaited),
                Slot::Waiting(_) => (delivered, awaited + 1),
            })
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrived() -> Arrived {
        let layout = engine::KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 2,
            dtype: "f32".into(),
        };
        Arrived {
            cache: SeqCache::new(layout, &candle_core::Device::Cpu).unwrap(),
            first_tokens: vec![Sampled {
                token: 7,
                logprob: -0.5,
                top: vec![],
            }],
        }
    }

    #[tokio::test]
    async fn transfer_first_then_claim() {
        let store = TransferStore::new(Duration::from_secs(5), Duration::from_secs(5));
        store.deliver("a", Ok(arrived()));
        assert_eq!(store.held(), (1, 0), "one cache delivered, no call waiting");
        assert_eq!(store.claim("a").await.unwrap().first_tokens[0].token, 7);
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn claim_first_then_transfer() {
        let store = TransferStore::new(Duration::from_secs(5), Duration::from_secs(5));
        let waiter = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.claim("b").await.map(|a| a.first_tokens[0].token) })
        };
        while store.is_empty() {
            tokio::task::yield_now().await;
        }
        assert_eq!(store.held(), (0, 1), "one call waiting, no cache");
        store.deliver("b", Ok(arrived()));
        assert_eq!(waiter.await.unwrap().unwrap(), 7);
        assert!(store.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn unclaimed_transfer_is_freed_after_the_timeout() {
        // A claim would wait far longer: the cache's own timeout frees it.
        let store = TransferStore::new(Duration::from_millis(500), Duration::from_secs(600));
        store.deliver("c", Ok(arrived()));
        assert_eq!(store.len(), 1);
        tokio::time::sleep(Duration::from_millis(501)).await;
        assert!(store.is_empty(), "the reaper frees the cache");
        assert!(matches!(
            store.claim("c").await,
            Err(DecodeError::KvTimeout(..))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn claim_without_transfer_times_out_and_leaves_nothing() {
        let store = TransferStore::new(Duration::from_millis(100), Duration::from_millis(300));
        let started = tokio::time::Instant::now();
        let err = store.claim("d").await.err().unwrap();
        assert!(matches!(err, DecodeError::KvTimeout(_, 300)), "{err}");
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(300),
            "the KV wait bounds it"
        );
        assert!(store.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn claim_outlasts_the_kv_timeout_while_its_prompt_queues() {
        let store = TransferStore::new(Duration::from_millis(100), Duration::from_secs(10));
        let waiter = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.claim("f").await.map(|a| a.first_tokens[0].token) })
        };
        // The prompt's turn at the prefill node comes long after the KV timeout.
        tokio::time::sleep(Duration::from_secs(5)).await;
        store.deliver("f", Ok(arrived()));
        assert_eq!(waiter.await.unwrap().unwrap(), 7);
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn failed_transfer_fails_its_claim() {
        let store = TransferStore::new(Duration::from_secs(5), Duration::from_secs(5));
        store.deliver("e", Err("prefill node went away".into()));
        assert_eq!(store.held(), (0, 0), "a failed transfer holds no cache");
        let err = store.claim("e").await.err().unwrap();
        assert!(err.to_string().contains("prefill node went away"), "{err}");
    }
}
