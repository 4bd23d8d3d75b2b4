//! The receiving side of a cache's wire form: `KvAssembler` takes `KvChunk`s as they
//! arrive, checks each against the layout and the positions expected, and writes their bytes
//! straight into the storage of the `SeqCache` it rebuilds.

use super::*;

/// Rebuilds a `SeqCache` from chunks that arrive in order within each layer. Everything it
/// is given may be garbage (it comes off the network): a bad chunk is an error, never a
/// panic. The cache is allocated once, at the size the caller reserved for it, in host
/// memory, and the chunks' bytes are written straight into it; a cache for a GPU moves
/// there whole once complete.
pub struct KvAssembler {
    cache: SeqCache,
    /// Where the finished cache goes.
    device: Device,
    expected: Vec<u32>,
    filled: Vec<usize>,
    /// Each layer's K and V storage: `(start, bytes)`.
    storage: Vec<[(*mut u8, usize); 2]>,
}

impl std::fmt::Debug for KvAssembler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvAssembler")
            .field("layout", &self.cache.layout)
            .field("expected", &self.expected.len())
            .field("filled", &self.filled)
            .finish_non_exhaustive()
    }
}

// SAFETY: the pointers address storage the assembler's own tensors own, which nothing else
// references (see `new`); moving the assembler to another thread moves that ownership.
unsafe impl Send for KvAssembler {}

/// Where one chunk's bytes go: K's run of each head, then V's, in the order the wire
/// carries them. [`done`](Self::done) records them as received once they are written.
pub struct ChunkWrite<'a> {
    runs: Vec<&'a mut [u8]>,
    filled: &'a mut usize,
    len: usize,
}

impl<'a> ChunkWrite<'a> {
    /// The runs to fill, in wire order; each must be written whole before `done`.
    pub fn runs(&mut self) -> &mut [&'a mut [u8]] {
        &mut self.runs
    }

    /// Records the chunk's positions as received.
    pub fn done(self) {
        *self.filled += self.len;
    }
}

impl KvAssembler {
    /// Expects K/V for `tokens` in a cache of `layout` that holds `capacity` positions in
    /// all (at least the tokens), allocated now: the caller has reserved that memory and
    /// bounded `capacity` by it, and the cache is never moved to grow. `finish` gives it on
    /// `device`.
    pub fn new(
        layout: KvLayout,
        tokens: Vec<u32>,
        capacity: usize,
        device: &Device,
    ) -> Result<Self> {
        let per_position = layout.validate()?;
        if tokens.is_empty() {
            return Err(EngineError::BadKv(
                "a transfer covers at least one position".into(),
            ));
        }
        let capacity = capacity.max(tokens.len());
        if capacity.checked_mul(per_position).is_none() {
            return Err(EngineError::BadKv(format!(
                "{capacity} positions of {per_position} bytes do not fit in memory"
            )));
        }
        let mut cache = SeqCache::new(layout, &Device::Cpu)?;
        let n_layers = cache.layout.n_layers;
        // SAFETY: the assembler writes every position before the cache leaves it (`finish`).
        unsafe { cache.move_to(capacity, &vec![0; n_layers], Fill::Unwritten)? };
        let locate = |t: &Tensor| -> Result<(*mut u8, usize)> {
            let found = Locate::default();
            t.inplace_op1(&found)?;
            found
                .0
                .get()
                .ok_or_else(|| EngineError::KvCache("a KV layer was not located".into()))
        };
        let storage = cache
            .layers
            .iter()
            .map(|l| Ok([locate(&l.k)?, locate(&l.v)?]))
            .collect::<Result<_>>()?;
        Ok(Self {
            cache,
            device: device.clone(),
            expected: tokens,
            filled: vec![0; n_layers],
            storage,
        })
    }

    /// Positions the transfer covers.
    pub fn expected(&self) -> usize {
        self.expected.len()
    }

    /// Positions received so far, summed over layers.
    pub fn received_tokens(&self) -> usize {
        self.filled.iter().sum()
    }

    /// Bytes the cache being rebuilt occupies.
    pub fn allocated_bytes(&self) -> usize {
        self.cache.allocated_bytes()
    }

    /// Stores one chunk; it must continue its layer where the previous one stopped.
    pub fn accept(&mut self, chunk: &KvChunk) -> Result<()> {
        self.accept_parts(chunk.layer, chunk.start, chunk.len, &chunk.k, &chunk.v)
    }

    /// `accept` for a chunk whose K and V bytes lie in a buffer of the caller's.
    pub fn accept_parts(
        &mut self,
        layer: u32,
        start: u32,
        len: u32,
        k: &[u8],
        v: &[u8],
    ) -> Result<()> {
        let mut write = self.chunk(layer, start, len, k.len(), v.len())?;
        let row = write.runs.len() / 2;
        let (k_runs, v_runs) = write.runs().split_at_mut(row);
        for (runs, bytes) in [(k_runs, k), (v_runs, v)] {
            let mut at = 0;
            for run in runs.iter_mut() {
                run.copy_from_slice(&bytes[at..at + run.len()]);
                at += run.len();
            }
        }
        write.done();
        Ok(())
    }

    /// Checks a chunk's place and size, and gives the storage its K and V bytes go to, as
    /// the wire carries them (`(kv_heads, len)` rows of a head each, which is how the cache
    /// stores them: [`KvChunk`]).
    pub fn chunk(
        &mut self,
        layer: u32,
        start: u32,
        len: u32,
        k_len: usize,
        v_len: usize,
    ) -> Result<ChunkWrite<'_>> {
        let layer = layer as usize;
        let (start, len) = (start as usize, len as usize);
        let bad = |why: String| Err(EngineError::BadKv(why));
        if layer >= self.filled.len() {
            return bad(format!("chunk for layer {layer} of {}", self.filled.len()));
        }
        if len == 0 {
            return bad(format!("layer {layer}: a chunk of no positions"));
        }
        if start != self.filled[layer] || start + len > self.expected.len() {
            return bad(format!(
                "layer {layer}: chunk {start}..{} does not follow {} of {}",
                start + len,
                self.filled[layer],
                self.expected.len()
            ));
        }
        let layout = &self.cache.layout;
        let want = len * layout.bytes_per_token_layer();
        if k_len != want || v_len != want {
            return bad(format!(
                "layer {layer}: payloads of {k_len} and {v_len} bytes, expected {want}"
            ));
        }
        let (heads, row) = (layout.n_kv_heads, layout.head_row_bytes());
        let capacity = self.cache.capacity;
        let mut runs = Vec::with_capacity(2 * heads);
        for (data, bytes) in self.storage[layer] {
            debug_assert_eq!(bytes, heads * capacity * row);
            for h in 0..heads {
                let at = (h * capacity + start) * row;
                // SAFETY: `data` is this layer's storage of `bytes`, which the assembler's
                // own tensor owns and nothing else reads or writes while the assembler is
                // borrowed; `start + len <= expected <= capacity`, so the run lies within
                // it, and runs of different heads (and K and V) do not overlap. Any bytes
                // are a valid f16, and a valid Q8_0 block.
                let run = unsafe { std::slice::from_raw_parts_mut(data.add(at), len * row) };
                runs.push(run);
            }
        }
        Ok(ChunkWrite {
            runs,
            filled: &mut self.filled[layer],
            len,
        })
    }

    /// Whether every layer has every position.
    pub fn is_complete(&self) -> bool {
        self.filled.iter().all(|&n| n == self.expected.len())
    }

    /// The rebuilt cache, once complete.
    pub fn finish(self) -> Result<SeqCache> {
        if !self.is_complete() {
            return Err(EngineError::BadKv(format!(
                "incomplete transfer: {} of {} positions per layer",
                self.filled.iter().min().copied().unwrap_or(0),
                self.expected.len()
            )));
        }
        let mut cache = self.cache;
        // Every layer holds every received position; the room for decoding is zeroed, so
        // nothing unwritten is ever read.
        cache.zero_from(self.expected.len())?;
        cache.commit(&self.expected);
        cache.into_device(&self.device)
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::time::Instant;

    use super::*;
    use crate::fuzz::{settings as fuzz_settings, Rng};

    /// A small layout: f16 heads of a few values, or Q8_0 heads of one or two blocks.
    fn small_layout(rng: &mut Rng) -> KvLayout {
        let q8 = rng.chance(3);
        KvLayout {
            n_layers: 1 + rng.below(4),
            n_kv_heads: 1 + rng.below(3),
            head_dim: if q8 {
                32 << rng.below(2)
            } else {
                1 + rng.below(8)
            },
            dtype: if q8 { KvDtype::Q8_0 } else { KvDtype::F16 },
        }
    }

    /// A layout that is usually a model's and sometimes garbage. (A dtype no engine stores
    /// never gets this far: the wire's name for it does not parse, `kvwire::convert`.)
    fn layout(rng: &mut Rng) -> KvLayout {
        let mut l = small_layout(rng);
        match rng.below(10) {
            1 => l.n_layers = 0,
            2 => l.n_kv_heads = [0, u32::MAX as usize, 1 << 20][rng.below(3)],
            3 => l.head_dim = [0, u32::MAX as usize, usize::MAX / 2, 48][rng.below(4)],
            4 => l.n_layers = [MAX_LAYERS + 1, u32::MAX as usize][rng.below(2)],
            _ => {}
        }
        l
    }

    fn layout_is_valid(l: &KvLayout) -> bool {
        // Bytes of one head's row, in u128: no overflow to mind.
        let row = match l.dtype {
            KvDtype::F16 => 2 * l.head_dim as u128,
            KvDtype::Q8_0 if l.head_dim.is_multiple_of(32) => l.head_dim as u128 / 32 * 34,
            KvDtype::Q8_0 => return false,
        };
        l.n_layers > 0
            && l.n_layers <= MAX_LAYERS
            && l.n_kv_heads > 0
            && l.head_dim > 0
            && (2 * row * l.n_kv_heads as u128 * l.n_layers as u128) <= MAX_POSITION_BYTES as u128
    }

    /// Prompt lengths: mostly small, sometimes none. (How many positions a transfer may
    /// claim is the decode node's reservation to bound, not the assembler's.)
    fn token_count(rng: &mut Rng) -> usize {
        match rng.below(20) {
            0 => 0,
            1 | 2 => 200 + rng.below(400),
            _ => 1 + rng.below(40),
        }
    }

    /// What the assembler must make of a chunk, tracked independently of it.
    struct Oracle {
        filled: Vec<usize>,
        expected: usize,
        bytes_per_token_layer: usize,
    }

    impl Oracle {
        fn valid(&self, c: &KvChunk) -> bool {
            let layer = c.layer as usize;
            let (start, len) = (c.start as usize, c.len as usize);
            layer < self.filled.len()
                && len > 0
                && start == self.filled[layer]
                && start + len <= self.expected
                && c.k.len() == len * self.bytes_per_token_layer
                && c.v.len() == len * self.bytes_per_token_layer
        }

        /// A chunk that continues a layer, of a random length that fits.
        fn honest(&self, rng: &mut Rng) -> Option<KvChunk> {
            let open: Vec<usize> = (0..self.filled.len())
                .filter(|&l| self.filled[l] < self.expected)
                .collect();
            let layer = *open.get(rng.below(open.len().max(1)))?;
            let left = self.expected - self.filled[layer];
            let most = if rng.below(4) == 0 { 300 } else { 12 };
            let len = 1 + rng.below(left.min(most));
            let n = len * self.bytes_per_token_layer;
            Some(KvChunk {
                layer: layer as u32,
                start: self.filled[layer] as u32,
                len: len as u32,
                k: rng.bytes(n).into(),
                v: rng.bytes(n).into(),
            })
        }
    }

    /// One way a chunk goes wrong on the wire.
    fn corrupt(rng: &mut Rng, mut c: KvChunk, previous: Option<&KvChunk>) -> KvChunk {
        match rng.below(11) {
            0 => c.layer = [c.layer + 64, u32::MAX, c.layer.wrapping_add(1)][rng.below(3)],
            1 => c.start = [c.start + 1, c.start.wrapping_sub(1), u32::MAX][rng.below(3)],
            2 => c.len = [0, u32::MAX, c.len + 1, c.len.saturating_sub(1)][rng.below(4)],
            3 => {
                let cut = rng.below(c.k.len().max(1));
                c.k.truncate(cut);
            }
            4 => {
                let mut v = c.v.to_vec();
                let extra = 1 + rng.below(7);
                v.extend(rng.bytes(extra));
                c.v = v.into();
            }
            5 => {
                c.k = Bytes::new();
                c.v = Bytes::new();
            }
            6 => {
                // Lengths that do not divide into f16s.
                let odd = c.k.len() + 1 + rng.below(3);
                c.k = rng.bytes(odd).into();
                c.v = rng.bytes(odd).into();
            }
            7 => {
                c.len = 0;
                c.k = Bytes::new();
                c.v = Bytes::new();
            }
            8 => {
                if let Some(p) = previous {
                    return p.clone();
                }
                c.start = c.start.wrapping_add(7);
            }
            9 => c.len = c.len.saturating_mul(1 << 16),
            _ => c.k = c.v.slice(..c.v.len() / 2),
        }
        c
    }

    /// Runs one case; returns (chunks accepted, whether the transfer completed).
    fn case(rng: &mut Rng) -> (usize, bool) {
        let layout = layout(rng);
        let n = token_count(rng);
        let tokens: Vec<u32> = (0..n).map(|_| rng.next_u64() as u32).collect();
        // The room reserved for decoding: none (the prompt's), or a sequence's worth.
        let reserve = match rng.below(2) {
            0 => 0,
            _ => n + rng.below(300),
        };
        let asm = KvAssembler::new(layout.clone(), tokens.clone(), reserve, &Device::Cpu);
        let mut asm = match asm {
            Ok(a) => {
                assert!(layout_is_valid(&layout), "{layout:?} accepted");
                assert!(n > 0, "a transfer of no positions accepted");
                a
            }
            Err(e) => {
                assert!(
                    !layout_is_valid(&layout) || n == 0,
                    "{layout:?} with {n} tokens refused: {e}"
                );
                assert!(matches!(e, EngineError::BadKv(_)), "{e:?}");
                return (0, false);
            }
        };
        let per_position = layout.validate().expect("valid");
        let allocated = reserve.max(n) * per_position;
        assert_eq!(
            asm.allocated_bytes(),
            allocated,
            "allocated once, as reserved"
        );
        let mut oracle = Oracle {
            filled: vec![0; layout.n_layers],
            expected: n,
            bytes_per_token_layer: layout.bytes_per_token_layer(),
        };
        let mut stored: Vec<KvChunk> = Vec::new();
        // Enough messages to complete most small transfers, and some that never complete.
        for _ in 0..rng.below(4 * layout.n_layers * 8 + 4) {
            let Some(honest) = oracle.honest(rng) else {
                break;
            };
            let chunk = if rng.below(3) == 0 {
                corrupt(rng, honest, stored.last())
            } else {
                honest
            };
            let valid = oracle.valid(&chunk);
            match asm.accept(&chunk) {
                Ok(()) => {
                    assert!(valid, "a bad chunk was accepted: {}", describe(&chunk));
                    oracle.filled[chunk.layer as usize] += chunk.len as usize;
                    stored.push(chunk);
                }
                Err(e) => {
                    assert!(
                        !valid,
                        "a good chunk was refused ({e}): {}",
                        describe(&chunk)
                    );
                    assert!(matches!(e, EngineError::BadKv(_)), "{e:?}");
                }
            }
            assert_eq!(asm.allocated_bytes(), allocated, "the cache never moves");
            assert_eq!(asm.received_tokens(), oracle.filled.iter().sum::<usize>());
        }
        let complete = oracle.filled.iter().all(|&f| f == n);
        assert_eq!(asm.is_complete(), complete);
        match asm.finish() {
            Ok(cache) => {
                assert!(complete, "an incomplete transfer finished");
                assert_eq!(cache.tokens(), tokens.as_slice());
                assert_eq!(cache.capacity(), reserve.max(n), "the reserved positions");
                for c in &stored {
                    let back = cache
                        .export(c.layer as usize, c.start as usize, c.len as usize)
                        .expect("exporting what was stored");
                    assert!(
                        back.k == c.k && back.v == c.v,
                        "the cache does not hold what {} carried",
                        describe(c)
                    );
                }
            }
            Err(e) => {
                assert!(!complete, "a complete transfer failed to finish: {e}");
                assert!(e.to_string().contains("incomplete"), "{e}");
            }
        }
        (stored.len(), complete)
    }

    fn describe(c: &KvChunk) -> String {
        format!(
            "layer {} start {} len {} k {} B v {} B",
            c.layer,
            c.start,
            c.len,
            c.k.len(),
            c.v.len()
        )
    }

    /// Garbage, truncated and mismatched chunks: every one refused with a KV error, every
    /// good one stored bit for bit, nothing allocated beyond the reservation, never a panic.
    /// Runs `TANDEM_FUZZ_SECS` (10 by default) from `TANDEM_FUZZ_SEED` (else the clock).
    #[test]
    fn fuzzed_chunks_fail_cleanly_and_good_ones_survive() {
        let (seed, budget) = fuzz_settings(10);
        eprintln!(
            "KV assembler fuzz: TANDEM_FUZZ_SEED={seed:#x} for {budget:?} (TANDEM_FUZZ_SECS)"
        );
        let started = Instant::now();
        let mut rng = Rng(seed);
        let (mut cases, mut accepted, mut completed) = (0usize, 0usize, 0usize);
        while cases < 50 || started.elapsed() < budget {
            let mut case_rng = Rng(rng.next_u64() | 1);
            let outcome = catch_unwind(AssertUnwindSafe(|| case(&mut case_rng)));

            match outcome {
                Ok((a, c)) => {
                    accepted += a;
                    completed += usize::from(c);
                }
                Err(_) => panic!(
                    "case {cases} failed: rerun with TANDEM_FUZZ_SEED={seed:#x} (the panic is above)"
                ),
            }
            cases += 1;
        }
        eprintln!("{cases} cases, {accepted} chunks stored, {completed} transfers completed");
        // Both sides must be reached, or the run proves little.
        assert!(
            accepted > cases,
            "only {accepted} chunks stored in {cases} cases"
        );
        assert!(
            completed * 20 > cases,
            "only {completed} of {cases} transfers completed"
        );
    }

    #[test]
    fn a_cache_arrives_at_the_size_its_decoding_needs() {
        let layout = KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 4,
            dtype: KV_DTYPE,
        };
        let row = layout.bytes_per_token_layer();
        // Memory of the storage's size, dirtied and freed, for the allocator to hand back:
        // the room past the prompt must not show what was there before.
        let positions = 100 * layout.n_kv_heads * layout.head_dim;
        drop(
            (0..8)
                .map(|_| vec![f16::ONE; positions])
                .collect::<Vec<_>>(),
        );
        let mut asm = KvAssembler::new(layout.clone(), vec![7; 10], 100, &Device::Cpu).unwrap();
        for layer in 0..2 {
            let bytes: Vec<u8> = (0..10 * row).map(|i| (i % 199) as u8).collect();
            asm.accept(&KvChunk {
                layer,
                start: 0,
                len: 10,
                k: bytes.clone().into(),
                v: bytes.into(),
            })
            .unwrap();
        }
        let mut cache = asm.finish().unwrap();
        assert_eq!(cache.capacity(), 100);
        // The storage came unwritten: the room past the prompt reads as zeros.
        for layer in 0..2 {
            let (k, v) = cache.view(layer, 90).unwrap();
            for t in [k, v] {
                let tail: Vec<f16> = t
                    .narrow(1, 10, 90)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert!(
                    tail.iter().all(|&x| x == f16::ZERO),
                    "layer {layer}: {tail:?}"
                );
            }
        }
        let held = cache.allocated_bytes();
        cache.reserve_exact(100).unwrap();
        assert_eq!(cache.allocated_bytes(), held, "the arrived cache was moved");

        // A reservation that cannot be addressed is refused, not attempted.
        let err = KvAssembler::new(layout, vec![7; 10], usize::MAX, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
    }

    #[test]
    fn layouts_that_are_not_a_models_are_refused() {
        let ok = KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 16,
            dtype: KV_DTYPE,
        };
        assert_eq!(ok.validate().unwrap(), 2 * 2 * 2 * 16 * 2);
        let bad = [
            KvLayout {
                n_layers: 0,
                ..ok.clone()
            },
            KvLayout {
                head_dim: usize::MAX / 2,
                ..ok.clone()
            },
            KvLayout {
                n_layers: MAX_LAYERS + 1,
                ..ok.clone()
            },
        ];
        for l in bad {
            let err = KvAssembler::new(l.clone(), vec![1, 2], 0, &Device::Cpu).unwrap_err();
            assert!(err.to_string().contains("layout"), "{l:?}: {err}");
        }
        let err = KvAssembler::new(ok, vec![], 0, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("at least one position"), "{err}");
    }
}
