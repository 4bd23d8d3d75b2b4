//! Download progress: one line redrawn on a terminal (bytes, rate, time left), a log line
//! every few seconds otherwise, so a pod's log shows a long fetch moving.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use crate::limits::LOG_EVERY_SECS;

/// How often a terminal's line is redrawn.
const REDRAW: Duration = Duration::from_millis(200);

/// One file's progress, as `hf-hub` reports it.
pub(crate) struct Reporter {
    file: String,
    total: u64,
    done: u64,
    /// When this transfer's first bytes were counted, and how many were already there
    /// (a resumed file starts part-way): the rate is this transfer's own.
    since: Option<(Instant, u64)>,
    shown: Instant,
    terminal: bool,
}

impl Reporter {
    pub(crate) fn new(file: &str) -> Self {
        Self {
            file: file.into(),
            total: 0,
            done: 0,
            since: None,
            shown: Instant::now(),
            terminal: std::io::stderr().is_terminal(),
        }
    }

    fn line(&self, now: Instant) -> String {
        let rate = self.since.map(|(t, start)| {
            let secs = now.duration_since(t).as_secs_f64();
            ((self.done - start) as f64 / secs.max(1e-3), secs)
        });
        describe(
            &self.file,
            self.done,
            self.total,
            rate.filter(|r| r.1 >= 1.0).map(|r| r.0),
        )
    }
}

impl hf_hub::api::Progress for Reporter {
    fn init(&mut self, size: usize, _filename: &str) {
        self.total = size as u64;
        self.done = 0;
        self.since = None;
    }

    fn update(&mut self, size: usize) {
        self.done += size as u64;
        let now = Instant::now();
        if self.since.is_none() {
            self.since = Some((now, self.done));
            if self.done > 0 {
                tracing::info!(file = %self.file, bytes = self.done, "resuming a partial download");
            }
            return;
        }
        let every = if self.terminal {
            REDRAW
        } else {
            Duration::from_secs(LOG_EVERY_SECS)
        };
        if now.duration_since(self.shown) < every {
            return;
        }
        self.shown = now;
        let line = self.line(now);
        if self.terminal {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r{line}\x1b[K");
            let _ = err.flush();
        } else {
            tracing::info!("{line}");
        }
    }

    fn finish(&mut self) {
        if self.terminal {
            eprintln!("\r{}\x1b[K", self.line(Instant::now()));
        } else {
            tracing::info!(file = %self.file, bytes = self.done, "fetched");
        }
    }
}

/// `model.safetensors: 512.0 MiB of 1.4 GiB (35%), 85.3 MiB/s, 11 s left`.
pub(crate) fn describe(file: &str, done: u64, total: u64, rate: Option<f64>) -> String {
    let pct = (done as f64 * 100.0 / total.max(1) as f64).min(100.0);
    let mut s = format!(
        "{file}: {} of {} ({pct:.0}%)",
        bytes(done as f64),
        bytes(total as f64)
    );
    if let Some(rate) = rate.filter(|r| *r > 0.0) {
        let left = total.saturating_sub(done) as f64 / rate;
        s.push_str(&format!(", {}/s, {} left", bytes(rate), duration(left)));
    }
    s
}

fn bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn duration(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_reads_as_bytes_rate_and_time_left() {
        let gib = 1u64 << 30;
        assert_eq!(
            describe(
                "model.safetensors",
                gib / 2,
                3 * gib / 2,
                Some(100.0 * 1048576.0)
            ),
            "model.safetensors: 512.0 MiB of 1.5 GiB (33%), 100.0 MiB/s, 10 s left"
        );
        assert_eq!(
            describe("config.json", 0, 726, None),
            "config.json: 0 B of 726 B (0%)"
        );
        assert_eq!(duration(3725.0), "1 h 2 min");
        assert_eq!(duration(61.0), "1 min 1 s");
    }
}
