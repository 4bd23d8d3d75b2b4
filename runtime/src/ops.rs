//! A worker's operations listener (`--metrics-listen`): plain HTTP on its own port, apart
//! from the gRPC port and its mutual TLS, for the kubelet's probes and for Prometheus,
//! which hold no client certificate. It is up from the start, before the model loads:
//! - `/health`: 200 while the process serves this listener (liveness);
//! - `/health/ready`: 200 once the model is loaded and the node serves, 503 while it
//!   loads and once it drains (readiness);
//! - `/metrics`: the node's metrics once it serves, 503 before.

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::worker::Gate;
use crate::ServeError;

/// The text of `/metrics`.
type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// What the node serves once its model is loaded.
struct Serving {
    gate: Gate,
    render: Render,
}

/// The handle a node tells that it serves, and that it stopped; the listener answers
/// from it.
#[derive(Clone, Default)]
pub struct Ops {
    serving: Arc<RwLock<Option<Serving>>>,
}

/// Whether a node that `serving` describes (`None`: still loading) takes work.
fn ready(serving: Option<&Serving>) -> bool {
    serving.is_some_and(|s| !s.gate.draining())
}

impl Ops {
    /// Binds `addr` (none: no listener) and serves it on this runtime until the process
    /// ends; the node calls [`Ops::serving`] once its model is loaded.
    pub async fn start(addr: Option<SocketAddr>) -> Result<Self, ServeError> {
        let ops = Self::default();
        let Some(addr) = addr else {
            return Ok(ops);
        };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(ServeError::Listen)?;
        tracing::info!(addr = %listener.local_addr().map_err(ServeError::Listen)?, "operations listener");
        let incoming =
            tls::accept(listener, None, crate::OPS_MAX_CONNECTIONS).map_err(ServeError::Listen)?;
        let limits = crate::http::Limits {
            max_header_bytes: crate::OPS_MAX_HEADER_BYTES,
            header_timeout: crate::OPS_TIMEOUT,
            write_stall: crate::OPS_TIMEOUT,
        };
        // Served until the process ends: probes must see the drain.
        tokio::spawn(crate::http::serve(
            incoming,
            ops.app(),
            limits,
            Arc::new(|| {}),
            std::future::pending(),
        ));
        Ok(ops)
    }

    /// The node serves: ready until `gate` drains, with `render` as its metrics.
    pub fn serving(&self, gate: Gate, render: impl Fn() -> String + Send + Sync + 'static) {
        *self.write() = Some(Serving {
            gate,
            render: Arc::new(render),
        });
    }

    /// The node has stopped serving: not ready, and what it served is let go (the
    /// metrics' closure holds the node's job queue, whose end stops its compute thread).
    pub fn stopped(&self) {
        *self.write() = None;
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Option<Serving>> {
        // A panic while holding the lock leaves nothing half-written: the value is whole.
        self.serving.write().unwrap_or_else(|e| e.into_inner())
    }

    fn app(&self) -> axum::Router {
        let ready_state = Arc::clone(&self.serving);
        let metrics_state = Arc::clone(&self.serving);
        axum::Router::new()
            .route("/health", get(|| async { StatusCode::OK }))
            .route(
                "/health/ready",
                get(move || {
                    let held = ready_state.read().unwrap_or_else(|e| e.into_inner());
                    let up = ready(held.as_ref());
                    drop(held);
                    async move {
                        if up {
                            StatusCode::OK
                        } else {
                            StatusCode::SERVICE_UNAVAILABLE
                        }
                    }
                }),
            )
            .route(
                "/metrics",
                get(move || {
                    let held = metrics_state.read().unwrap_or_else(|e| e.into_inner());
                    let response: Response = match held.as_ref() {
                        Some(s) => (
                            [("content-type", "text/plain; version=0.0.4")],
                            (s.render)(),
                        )
                            .into_response(),
                        None => StatusCode::SERVICE_UNAVAILABLE.into_response(),
                    };
                    drop(held);
                    async move { response }
                }),
            )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_once_serving_until_draining() {
        assert!(!ready(None));
        let gate = Gate::default();
        let serving = Serving {
            gate: gate.clone(),
            render: Arc::new(String::new),
        };
        assert!(ready(Some(&serving)));
        gate.start_draining();
        assert!(!ready(Some(&serving)));
    }
}
