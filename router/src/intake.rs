//! What every API request goes through before its own handler's work: the client's request id,
//! and large bodies prepared off the threads that serve every connection.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;

use crate::error::RouterError;
use crate::state::AppState;

/// Bodies up to this size are parsed, templated and tokenized on the thread serving the
/// connection: a few thousand tokens at most, about a millisecond, a bounded stall; the hop
/// to the blocking pool would cost every request two thread switches, and a one-thread
/// router (`--threads 1`) its single thread. Larger bodies go to the blocking pool.
const INLINE_BODY_BYTES: usize = 16 << 10;

/// Runs `work` (parsing, templating, tokenizing: work that grows with the body) on the
/// body: inline when it is small, else on the blocking pool, at most one per CPU at a time,
/// so that large bodies never stall the threads that serve every connection. `work` owns
/// the body, so that it can let it go once it is parsed.
pub(crate) async fn off_the_io_threads<T: Send + 'static>(
    state: &Arc<AppState>,
    body: Bytes,
    work: impl FnOnce(&AppState, Bytes) -> Result<T, RouterError> + Send + 'static,
) -> Result<T, RouterError> {
    if body.len() <= INLINE_BODY_BYTES {
        return work(state, body);
    }
    on_the_blocking_pool(state, move |st| work(st, body)).await
}

/// Runs `work` on the blocking pool, at most one per CPU at a time: for work whose cost
/// does not follow the body's size, such as compiling a grammar (a short regex can take
/// half a second). The turn goes with the work: a client that leaves while its work runs
/// frees nothing until the work ends, so leaving cannot start more work than CPUs.
pub(crate) async fn on_the_blocking_pool<T: Send + 'static>(
    state: &Arc<AppState>,
    work: impl FnOnce(&AppState) -> Result<T, RouterError> + Send + 'static,
) -> Result<T, RouterError> {
    let st = Arc::clone(state);
    state
        .preparing
        .run(move || work(&st))
        .await
        .map_err(|e| RouterError::Internal(format!("preparing the request: {e}")))?
}

/// The header a client names its request by, echoed on the response and carried to the
/// nodes' logs.
pub(crate) const REQUEST_ID_HEADER: &str = "x-request-id";

/// The most characters of a client's request id that are kept.
const MAX_REQUEST_ID: usize = 128;

/// The client's X-Request-Id, reduced to what is safe in a log line and a header: letters,
/// digits and `.`, `_`, `:`, `-`, at most 128 of them. `None` when absent or nothing is left.
pub(crate) fn client_request_id(headers: &HeaderMap) -> Option<String> {
    let raw = headers.get(REQUEST_ID_HEADER)?.as_bytes();
    let id: String = raw
        .iter()
        .map(|&b| b as char)
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'))
        .take(MAX_REQUEST_ID)
        .collect();
    (!id.is_empty()).then_some(id)
}
