//! The access log: one line per completion request when it ends, under the target
//! [`TARGET`] (`RUST_LOG=tandem::access=off` silences it). The line is an event in the
//! request's span, so it carries the span's fields too: the request id, the endpoint, the
//! prompt's tokens, and where the request ran (`placement`, the `prefill` and `decode`
//! workers' names, recorded by the dispatcher). With `--log-format json` it is one JSON
//! object.
//!
//! A request ends in one of two places: its handler, for a whole answer or an error, or its
//! stream's task, for SSE. Both hold an [`Access`] (the handler from the start, the output
//! from its first token), and the line is written when the last of them lets go, so it has
//! both the status and the token counts.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The access log's tracing target.
pub const TARGET: &str = "tandem::access";

/// What the line says of a request, filled in as the request goes.
#[derive(Debug, Default)]
pub struct Fields {
    /// The answer's HTTP status (for a stream, the status it started with).
    pub status: u16,
    /// The status of the error that ended a stream after its first token, if one did.
    pub stream_error: Option<u16>,
    pub streamed: bool,
    /// The API key's id (never the key): a digest's first bytes, as in its cache partition.
    pub key: Option<String>,
    pub time_to_first_token: Option<Duration>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

struct Line {
    started: Instant,
    fields: Mutex<Fields>,
}

impl Drop for Line {
    fn drop(&mut self) {
        let f = self.fields.get_mut().unwrap_or_else(|e| e.into_inner());
        write(f, self.started.elapsed());
    }
}

/// One request's line, shared by what ends the request; written once, when the last
/// holder drops it.
#[derive(Clone)]
pub struct Access(Arc<Line>);

impl Access {
    /// A line for a request that arrived now, sent with `key` (its id).
    pub fn start(key: Option<String>) -> Self {
        Self(Arc::new(Line {
            started: Instant::now(),
            fields: Mutex::new(Fields {
                key,
                ..Fields::default()
            }),
        }))
    }

    /// Changes the line's fields.
    pub fn update(&self, f: impl FnOnce(&mut Fields)) {
        f(&mut self.0.fields.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Notes that the first token is in, now.
    pub fn first_token(&self) {
        let at = self.0.started.elapsed();
        self.update(|f| f.time_to_first_token = Some(at));
    }
}

fn write(f: &Fields, latency: Duration) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    tracing::info!(
        target: TARGET,
        status = f.status,
        stream_error = f.stream_error,
        streamed = f.streamed,
        latency_ms = ms(latency),
        ttft_ms = f.time_to_first_token.map(ms),
        prompt_tokens = f.prompt_tokens,
        completion_tokens = f.completion_tokens,
        key = f.key.as_deref(),
        "request ended"
    );
}
