//! API keys: who may call the API, and how many tokens each key may still use.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::config::ApiKey;
use crate::error::RouterError;

/// One accepted key and its token account.
#[derive(Debug)]
pub struct Key {
    secret: ApiKey,
    /// Most tokens (prompt plus completion, over all its requests) the key may use.
    quota: Option<u64>,
    used: AtomicU64,
    /// Tokens set aside for requests in flight: each holds the most it can use until it
    /// ends and is charged what it did use, so concurrent requests cannot overrun the quota.
    held: AtomicU64,
    in_flight: AtomicU64,
    /// The key's prefix-cache partition on the prefill nodes: a digest of the secret, the
    /// same on every router, from which the secret cannot be read back.
    partition: [u8; 16],
}

/// Tokens a request in flight holds of its key's quota. When dropped it charges the key
/// what the request used ([`QuotaHold::used`]), or at least what its workers spent on it
/// ([`Spent`]), and gives back the rest.
#[derive(Debug)]
pub struct QuotaHold {
    key: Arc<Key>,
    tokens: u64,
    used: u64,
    spent: Spent,
}

/// The least a request is charged, whatever becomes of it: raised to its prompt once a
/// worker takes the prompt to compute it, so that a client that leaves before its first
/// token still pays for the prefill it caused. Shared with the attempts that run it.
#[derive(Debug, Clone, Default)]
pub struct Spent(Arc<AtomicU64>);

impl Spent {
    /// Raises the charge to at least `tokens`.
    pub fn at_least(&self, tokens: u64) {
        self.0.fetch_max(tokens, Ordering::AcqRel);
    }
}

impl QuotaHold {
    /// Records that the request used `tokens` (its prompt and completion) in all.
    pub fn used(&mut self, tokens: u64) {
        self.used = self.used.max(tokens);
    }

    /// The handle through which the request's attempts raise its least charge.
    pub fn spent(&self) -> Spent {
        self.spent.clone()
    }
}

impl Drop for QuotaHold {
    /// Charges the key (at most what was held: a request cannot use more than its worst
    /// case) and gives the hold back.
    fn drop(&mut self) {
        let spent = self.spent.0.load(Ordering::Acquire);
        self.key.charge(self.used.max(spent).min(self.tokens));
        self.key.held.fetch_sub(self.tokens, Ordering::AcqRel);
    }
}

impl Key {
    /// Counts a request of this key as started, unless `max` (0: no limit) are in flight.
    pub fn begin(&self, max: usize) -> bool {
        let before = self.in_flight.fetch_add(1, Ordering::Relaxed);
        if max > 0 && before >= max as u64 {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Counts a request of this key as ended.
    pub fn end(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// What the access log calls the key: the first bytes of its partition, in hex, which
    /// name it among the keys without giving it away.
    pub fn id(&self) -> String {
        self.partition[..4]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The prefix-cache partition of this key's prompts.
    pub fn cache_partition(&self) -> &[u8] {
        &self.partition
    }

    /// Counts tokens a request of this key used.
    fn charge(&self, tokens: u64) {
        self.used.fetch_add(tokens, Ordering::AcqRel);
    }

    /// Sets aside `tokens` (a request's worst case: its prompt and every completion token it
    /// may make) if the quota has room for them beside what was used and what requests in
    /// flight hold; one atomic step, so concurrent requests cannot all pass one check.
    pub fn hold(self: &Arc<Self>, tokens: u64) -> Result<QuotaHold, RouterError> {
        if let Some(quota) = self.quota {
            self.held
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                    let used = self.used.load(Ordering::Acquire);
                    let taken = used.saturating_add(held);
                    (taken.saturating_add(tokens) <= quota).then(|| held + tokens)
                })
                .map_err(|held| RouterError::QuotaTooSmall {
                    need: tokens,
                    left: quota.saturating_sub(self.used.load(Ordering::Acquire) + held),
                    quota,
                })?;
        } else {
            self.held.fetch_add(tokens, Ordering::AcqRel);
        }
        Ok(QuotaHold {
            key: Arc::clone(self),
            tokens,
            used: 0,
            spent: Spent::default(),
        })
    }

    fn check_quota(&self) -> Result<(), RouterError> {
        let used = self.used.load(Ordering::Acquire);
        match self.quota {
            Some(quota) if used >= quota => Err(RouterError::QuotaExceeded { used, quota }),
            _ => Ok(()),
        }
    }
}

/// The configured keys; none means the API is open.
#[derive(Debug, Default)]
pub struct Keys(Vec<Arc<Key>>);

impl Keys {
    /// Keys from flags (no quota) and from a file of lines `<key>` or `<key> <token quota>`
    /// (blank lines and `#` comments skipped).
    pub fn load(flags: &[ApiKey], file: Option<&Path>) -> Result<Self, RouterError> {
        let mut keys: Vec<Arc<Key>> = flags
            .iter()
            .filter(|k| !k.0.is_empty())
            .map(|k| key(k.clone(), None))
            .collect();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                RouterError::Internal(format!("reading the API key file {}: {e}", path.display()))
            })?;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let mut fields = line.split_whitespace();
                let secret = ApiKey(fields.next().unwrap_or_default().to_string());
                let quota = match (fields.next(), fields.next()) {
                    (None, _) => None,
                    (Some(q), None) => Some(q.parse::<u64>().map_err(|_| {
                        RouterError::Internal(format!(
                            "{} line {}: the token quota must be a whole number",
                            path.display(),
                            n + 1
                        ))
                    })?),
                    (Some(_), Some(_)) => {
                        return Err(RouterError::Internal(format!(
                            "{} line {}: expected `<key>` or `<key> <token quota>`",
                            path.display(),
                            n + 1
                        )))
                    }
                };
                keys.push(key(secret, quota));
            }
        }
        Ok(Self(keys))
    }

    /// The key an `Authorization` header value carries (`None` when the API is open), if it
    /// is one of ours and has quota left.
    pub fn authorize(&self, header: Option<&str>) -> Result<Option<Arc<Key>>, RouterError> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let given = header
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(RouterError::MissingApiKey)?;
        // Every key is compared in full, so the time taken says nothing about which matched.
        let matched = self.0.iter().fold(None, |hit, k| {
            let eq = constant_time_eq(k.secret.0.as_bytes(), given.as_bytes());
            if eq && hit.is_none() {
                Some(Arc::clone(k))
            } else {
                hit
            }
        });
        let key = matched.ok_or(RouterError::BadApiKey)?;
        key.check_quota()?;
        Ok(Some(key))
    }
}

fn key(secret: ApiKey, quota: Option<u64>) -> Arc<Key> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"tandem prefix-cache partition\0");
    ctx.update(secret.0.as_bytes());
    let mut partition = [0; 16];
    partition.copy_from_slice(&ctx.finish().as_ref()[..16]);
    Arc::new(Key {
        partition,
        secret,
        quota,
        used: AtomicU64::new(0),
        held: AtomicU64::new(0),
        in_flight: AtomicU64::new(0),
    })
}

/// Equality whose time depends only on the lengths, not on where the bytes differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let diff = a
        .iter()
        .zip(b)
        .fold(a.len() ^ b.len(), |acc, (x, y)| acc | usize::from(x ^ y));
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"key-1", b"key-1"));
        assert!(!constant_time_eq(b"key-1", b"key-2"));
        assert!(!constant_time_eq(b"key-1", b"key-10"));
        assert!(!constant_time_eq(b"", b"k"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn a_key_file_sets_quotas_that_run_out() {
        let dir = std::env::temp_dir().join(format!("tandem-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "# team keys\nsk-open\n\nsk-small 100\n").unwrap();
        let keys = Keys::load(&[ApiKey("sk-flag".into())], Some(&file)).unwrap();
        assert!(keys.authorize(Some("Bearer sk-flag")).unwrap().is_some());
        assert!(matches!(
            keys.authorize(Some("Bearer sk-nope")),
            Err(RouterError::BadApiKey)
        ));
        assert!(matches!(
            keys.authorize(None),
            Err(RouterError::MissingApiKey)
        ));
        let small = keys.authorize(Some("Bearer sk-small")).unwrap().unwrap();
        small.hold(99).unwrap().used(99);
        assert!(keys.authorize(Some("Bearer sk-small")).is_ok());
        small.hold(1).unwrap().used(1);
        assert!(matches!(
            keys.authorize(Some("Bearer sk-small")),
            Err(RouterError::QuotaExceeded {
                used: 100,
                quota: 100
            })
        ));
        let open = keys.authorize(Some("Bearer sk-open")).unwrap().unwrap();
        open.hold(u64::from(u32::MAX))
            .unwrap()
            .used(u64::from(u32::MAX));
        assert!(keys.authorize(Some("Bearer sk-open")).is_ok(), "no quota");
        std::fs::write(&file, "sk-bad lots\n").unwrap();
        assert!(Keys::load(&[], Some(&file)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn concurrent_requests_cannot_overrun_a_quota() {
        let k = key(ApiKey("sk".into()), Some(100));
        // Eight threads race to hold 30 tokens each: three fit in 100, never a fourth.
        let holds: Vec<_> = std::thread::scope(|s| {
            let tries: Vec<_> = (0..8).map(|_| s.spawn(|| k.hold(30))).collect();
            tries.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let mut granted: Vec<_> = holds.into_iter().filter_map(Result::ok).collect();
        assert_eq!(granted.len(), 3);
        assert!(matches!(
            k.hold(11),
            Err(RouterError::QuotaTooSmall {
                need: 11,
                left: 10,
                quota: 100
            })
        ));
        // Each used only 5: once they end, the unused tokens are free again.
        for h in &mut granted {
            h.used(5);
        }
        drop(granted);
        assert_eq!(k.used.load(Ordering::Acquire), 15);
        assert_eq!(k.held.load(Ordering::Acquire), 0);
        let mut h = k.hold(85).expect("85 of 100 are left");
        // A request is charged at most what it held.
        h.used(1000);
        drop(h);
        assert_eq!(k.used.load(Ordering::Acquire), 100);
    }

    #[test]
    fn a_request_abandoned_after_its_prompt_was_taken_pays_for_the_prompt() {
        let k = key(ApiKey("sk".into()), Some(100));
        drop(k.hold(50).unwrap());
        assert_eq!(
            k.used.load(Ordering::Acquire),
            0,
            "nothing was spent on a request no worker took"
        );
        let h = k.hold(50).unwrap();
        h.spent().at_least(20);
        drop(h);
        assert_eq!(
            k.used.load(Ordering::Acquire),
            20,
            "its prompt was computed"
        );
        let mut h = k.hold(50).unwrap();
        h.spent().at_least(20);
        h.used(30);
        drop(h);
        assert_eq!(
            k.used.load(Ordering::Acquire),
            50,
            "what it used, when it got further"
        );
    }
}
