//! The prefix cache: the KV caches of recent prompts, kept after their transfer so that a
//! prompt sharing a prefix with one of them (a system prompt, the earlier turns of a chat)
//! computes only the rest. Entries are whole prompts; a lookup takes the entry with the
//! longest common prefix, in whole blocks. Bounded in bytes, least recently used first out.
//!
//! Entries belong to a partition (the router gives one per API key) and a prompt reuses
//! only its own partition's: partitioned rather than shared with `cached_tokens` hidden,
//! because the time to the first token would tell one key what another key's prompts
//! were just as well. What it costs is reuse across keys (a system prompt that two keys
//! share is cached once for each).

use engine::{Result, SeqCache};

/// Positions per block: reuse is counted in whole blocks, as vLLM and SGLang report it.
pub const BLOCK_TOKENS: usize = 16;

struct Entry {
    partition: Vec<u8>,
    tokens: Vec<u32>,
    cache: SeqCache,
    last_used: u64,
}

/// Recent prompts' caches within a byte budget.
pub struct PrefixCache {
    entries: Vec<Entry>,
    budget: usize,
    clock: u64,
}

/// A reusable prefix: a cache holding the first `tokens` positions of the prompt.
pub struct Hit {
    pub cache: SeqCache,
    pub tokens: usize,
}

impl PrefixCache {
    /// An empty cache that holds at most `budget` bytes (0 turns it off).
    pub fn new(budget: usize) -> Self {
        Self {
            entries: Vec::new(),
            budget,
            clock: 0,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.cache.allocated_bytes()).sum()
    }

    /// A copy of the longest prefix of `prompt` cached in `partition`, in whole blocks,
    /// leaving at least its last token to compute (its logits give the first token), sized
    /// to hold all of `prompt`.
    pub fn lookup(&mut self, partition: &[u8], prompt: &[u32]) -> Result<Option<Hit>> {
        let limit = prompt.len().saturating_sub(1);
        let best = self
            .entries
            .iter_mut()
            .filter(|e| e.partition == partition)
            .map(|e| {
                let common = e
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                let usable = common.min(limit) / BLOCK_TOKENS * BLOCK_TOKENS;
                (usable, e)
            })
            .filter(|(usable, _)| *usable > 0)
            .max_by_key(|(usable, _)| *usable);
        let Some((tokens, entry)) = best else {
            return Ok(None);
        };
        self.clock += 1;
        entry.last_used = self.clock;
        let mut cache = entry.cache.fork()?;
        cache.truncate(tokens);
        cache.reserve_exact(prompt.len())?;
        Ok(Some(Hit { cache, tokens }))
    }

    /// Keeps a finished prompt's cache in `partition`. An entry of the partition that it
    /// extends is dropped (it holds no prefix the new one lacks); then the least recently
    /// used go until the budget holds.
    pub fn insert(&mut self, partition: Vec<u8>, tokens: Vec<u32>, cache: SeqCache) {
        if self.budget == 0 || cache.allocated_bytes() > self.budget {
            return;
        }
        self.entries.retain(|e| {
            !(e.partition == partition
                && e.tokens.len() <= tokens.len()
                && tokens.starts_with(&e.tokens))
        });
        self.clock += 1;
        self.entries.push(Entry {
            partition,
            tokens,
            cache,
            last_used: self.clock,
        });
        while self.bytes() > self.budget {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .expect("over budget means not empty");
            self.entries.swap_remove(oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};
    use engine::{KvAssembler, KvLayout};

    /// The partition of requests without an API key.
    const SHARED: &[u8] = b"";

    fn layout() -> KvLayout {
        KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 2,
            dtype: engine::KV_DTYPE,
        }
    }

    /// A cache of `tokens` whose K and V at position i are all i.
    fn cache(tokens: &[u32]) -> SeqCache {
        let n = tokens.len();
        let mut asm = KvAssembler::new(layout(), tokens.to_vec(), 0, &Device::Cpu).unwrap();
        let values: Vec<f32> = (0..n).flat_map(|i| [i as f32, i as f32]).collect();
        let t = Tensor::from_vec(values, (1, n, 2), &Device::Cpu).unwrap();
        let bytes: Vec<u8> = t
            .to_dtype(DType::F16)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        asm.accept(&engine::KvChunk {
            layer: 0,
            start: 0,
            len: n as u32,
            k: bytes.clone().into(),
            v: bytes.into(),
        })
        .unwrap();
        asm.finish().unwrap()
    }

    #[test]
    fn the_longest_shared_prefix_is_reused_in_whole_blocks() {
        let system: Vec<u32> = (0..40).collect();
        let mut pc = PrefixCache::new(1 << 20);
        pc.insert(SHARED.to_vec(), system.clone(), cache(&system));
        let mut turn = system[..37].to_vec();
        turn.extend([900, 901, 902]);
        let hit = pc.lookup(SHARED, &turn).unwrap().expect("a shared prefix");
        assert_eq!(hit.tokens, 32, "37 shared tokens are two whole blocks");
        assert_eq!(hit.cache.tokens(), &system[..32]);
        assert!(hit.cache.capacity() >= turn.len());
        let chunk = hit.cache.export(0, 31, 1).unwrap();
        assert_eq!(
            &chunk.k[..2],
            &half::f16::from_f32(31.0).to_le_bytes()[..],
            "the reused K is the cached one"
        );
        // The whole prompt cached: its last token is still computed.
        let again = pc.lookup(SHARED, &system).unwrap().unwrap();
        assert_eq!(again.tokens, 32, "at most 39 of 40, in whole blocks");
        assert!(pc.lookup(SHARED, &[7, 8, 9]).unwrap().is_none());
    }

    #[test]
    fn extended_entries_are_replaced_and_the_budget_evicts_the_least_recently_used() {
        let a: Vec<u32> = (0..32).collect();
        let b: Vec<u32> = (100..132).collect();
        let one = cache(&a).allocated_bytes();
        let mut pc = PrefixCache::new(2 * one);
        pc.insert(SHARED.to_vec(), a.clone(), cache(&a));
        pc.insert(SHARED.to_vec(), b.clone(), cache(&b));
        assert!(pc
            .lookup(SHARED, &[a.clone(), vec![1]].concat())
            .unwrap()
            .is_some());
        // `a` was used last, so a third entry evicts `b`.
        let c: Vec<u32> = (200..232).collect();
        pc.insert(SHARED.to_vec(), c.clone(), cache(&c));
        assert!(pc.bytes() <= 2 * one);
        assert!(pc
            .lookup(SHARED, &[b.clone(), vec![1]].concat())
            .unwrap()
            .is_none());
        assert!(pc
            .lookup(SHARED, &[a.clone(), vec![1]].concat())
            .unwrap()
            .is_some());
        // A prompt that extends `a` replaces it.
        let longer = [a.clone(), (500..516).collect()].concat();
        let before = pc.entries.len();
        pc.insert(SHARED.to_vec(), longer.clone(), cache(&longer));
        assert!(pc.entries.len() <= before);
        assert!(!pc.entries.iter().any(|e| e.tokens == a));
    }

    #[test]
    fn a_prompt_reuses_only_its_own_partition() {
        let system: Vec<u32> = (0..40).collect();
        let mut pc = PrefixCache::new(1 << 20);
        pc.insert(b"key-a".to_vec(), system.clone(), cache(&system));
        let turn = [system.clone(), vec![900]].concat();
        assert!(pc.lookup(b"key-b", &turn).unwrap().is_none());
        assert!(pc.lookup(SHARED, &turn).unwrap().is_none());
        assert_eq!(pc.lookup(b"key-a", &turn).unwrap().unwrap().tokens, 32);
        // Another partition's longer prompt does not replace this one's entry.
        pc.insert(b"key-b".to_vec(), turn.clone(), cache(&turn));
        assert_eq!(pc.entries.len(), 2);
        assert!(pc.lookup(b"key-a", &turn).unwrap().is_some());
    }
}
