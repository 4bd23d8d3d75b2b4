//! What the fuzz tests share: a small seeded generator, so that a whole run follows from
//! one seed, and the `TANDEM_FUZZ_SEED` / `TANDEM_FUZZ_SECS` settings.

use std::time::Duration;

/// xorshift64*: fast, and the whole run follows from its seed. Seed it with an odd number
/// (zero stays zero).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// One of `xs`, which must not be empty.
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }

    /// True once in `one_in` times.
    pub fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// The seed from `TANDEM_FUZZ_SEED` (decimal or 0x hex; else the clock), made odd, and the
/// run's length from `TANDEM_FUZZ_SECS` (else `default_secs`).
pub fn settings(default_secs: u64) -> (u64, Duration) {
    let seed = std::env::var("TANDEM_FUZZ_SEED")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => s.parse().ok(),
            }
        })
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
        | 1;
    let secs = std::env::var("TANDEM_FUZZ_SECS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default_secs);
    (seed, Duration::from_secs(secs))
}
