//! The prefix cache: the KV caches of recent prompts, kept after their transfer so that a
//! prompt sharing a prefix with one of them (a system prompt, the earlier turns of a chat)
//! computes only the rest. Entries are whole prompts; a lookup takes the entry with the
//! longest common prefix, in whole blocks. Bounded in bytes, least recently used first out.

use engine::{Result, SeqCache};

/// Positions per block: reuse is counted in whole blocks, as vLLM and SGLang report it.
pub const BLOCK_TOKENS: usize = 16;

struct Entry {
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

    /// A copy of the longest cached prefix of `prompt` in whole blocks, leaving at least
    /// its last token to compute (its logits give the first token), sized to hold all of
    /// `prompt`.
    pub fn lookup(&mut self, prompt: &[u32]) -> Result<Option<Hit>> {
        let limit = prompt.len().saturating_sub(1);
        let best = self
            .entries
            .iter_mut()
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

    /// Keeps a finished prompt's cache. An entry it extends is dropped (it holds no prefix
    /// the new one lacks); then the least recently used go until the budget holds.
    pub fn insert(&mut self, tokens: Vec<u32>, cache: SeqCache) {
        if self.budget == 0 || cache.allocated_bytes() > self.budget {
            return;
        }
        self.entries
            .retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
        self.clock += 1;
        self.entries.push(Entry {
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

    fn layout() -> KvLayout {
        KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 2,
            dtype: "f32".into(),
        }
    }

    /// A cache of `tokens` whose K and V at position i are all i.
    fn cache(tokens: &[u32]) -> SeqCache {
        let n = tokens.len();
        let mut asm = KvAssembler::new(layout(), tokens.to_vec(), 0, &Device::Cpu).unwrap();
        let values: Vec<f32> = (0..n).flat_map(|i| [i as f32, i as f32]).collect();
        let t = Tensor::from_vec(values, (1, n, 2), &Device::Cpu).unwrap();
        let bytes: Vec<u8> = t
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
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
        pc.insert(system.clone(), cache(&system));
        let mut turn = system[..37].to_vec();
        turn.extend([900, 901, 902]);
        let hit = pc.lookup(&turn).unwrap().expect("a shared prefix");
        assert_eq!(hit.tokens, 32, "37 shared tokens are two whole blocks");
        assert_eq!(hit.cache.tokens(), &system[..32]);
        assert!(hit.cache.capacity() >= turn.len());
        let chunk = hit.cache.export(0, 31, 1).unwrap();
        assert_eq!(
            &chunk.k[..4],
            &31f32.to_le_bytes(),
            "the reused K is the cached one"
        );
        // The whole prompt cached: its last token is still computed.
        let again = pc.lookup(&system).unwrap().unwrap();
        assert_eq!(again.tokens, 32, "at most 39 of 40, in whole blocks");
        assert!(pc.lookup(&[7, 8, 9]).unwrap().is_none());
    }

    #[test]
    fn extended_entries_are_replaced_and_the_budget_evicts_the_least_recently_used() {
        let a: Vec<u32> = (0..32).collect();
        let b: Vec<u32> = (100..132).collect();
        let one = cache(&a).allocated_bytes();
        let mut pc = PrefixCache::new(2 * one);
        pc.insert(a.clone(), cache(&a));
        pc.insert(b.clone(), cache(&b));
        assert!(pc.lookup(&[a.clone(), vec![1]].concat()).unwrap().is_some());
        // `a` was used last, so a third entry evicts `b`.
        let c: Vec<u32> = (200..232).collect();
        pc.insert(c.clone(), cache(&c));
        assert!(pc.bytes() <= 2 * one);
        assert!(pc.lookup(&[b.clone(), vec![1]].concat()).unwrap().is_none());
        assert!(pc.lookup(&[a.clone(), vec![1]].concat()).unwrap().is_some());
        // A prompt that extends `a` replaces it.
        let longer = [a.clone(), (500..516).collect()].concat();
        let before = pc.entries.len();
        pc.insert(longer.clone(), cache(&longer));
        assert!(pc.entries.len() <= before);
        assert!(!pc.entries.iter().any(|e| e.tokens == a));
    }
}
