//! `GET /health` (liveness) and `GET /health/ready` (readiness).

use serde::Serialize;

/// `/health`: the process serves.
#[derive(Debug, Serialize)]
pub struct Liveness {
    pub status: &'static str,
}

/// `/health/ready`: 200 only while at least one prefill and one decode worker are ready.
#[derive(Debug, Serialize)]
pub struct Readiness {
    pub ready: bool,
    pub prefill_ready: usize,
    pub decode_ready: usize,
    /// `static`, `ok` or `degraded`.
    pub discovery: &'static str,
}
