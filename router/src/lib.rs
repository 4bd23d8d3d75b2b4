//! The router: an OpenAI-style HTTP API (MindIE's flavour of it, docs/api.md) that
//! tokenizes and templates each request once, picks a prefill and a decode worker and
//! streams the tokens back.

pub mod access;
pub mod api;
pub mod budget;
mod chat;
pub mod config;
pub mod dispatch;
pub mod error;
mod intake;
pub mod keys;
pub mod metrics;
pub mod openai;
mod output;
pub mod params;
pub mod placement;
pub mod pool;
pub mod room;
pub mod routing;
pub mod state;
pub mod stops;
#[cfg(test)]
mod testing;
pub mod tokenize;
mod valid;
pub mod worker;

use std::future::Future;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio::net::TcpListener;

pub use config::{Config, Mode};
pub use error::ErrorFormat;
pub use error::RouterError;
pub use state::AppState;

/// The API's routes over shared state, with `/health` (the process serves): what clients
/// reach. Metrics and readiness are [`ops_app`]'s.
pub fn app(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            authorize,
        ));
    Router::new()
        .merge(api)
        .route("/health", get(live))
        .fallback(not_found)
        .with_state(state)
}

/// The operations listener's routes: `/metrics`, `/health` and `/health/ready`, for
/// Prometheus and probes. They name the workers, their states and their breakers, so they
/// stay off the port clients reach.
pub fn ops_app(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(live))
        .route("/health/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state)
}

async fn live() -> Json<api::health::Liveness> {
    Json(api::health::Liveness { status: "ok" })
}

/// Lets a request through only with a valid API key that has quota left, when keys are
/// configured; the key goes with the request so its tokens are charged to it.
async fn authorize(State(state): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let header = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match state.authorize(header) {
        Ok(key) => {
            if let Some(key) = key {
                req.extensions_mut().insert(key);
            }
            next.run(req).await
        }
        Err(e) => state.error_response(e),
    }
}

/// Ready while at least one prefill and one decode worker are in rotation (one colocated
/// worker in colocated mode): answering their health probes, compatible, not draining, and
/// with their breakers closed.
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let decode = state.decode.ready_count();
    let prefill = match state.cfg.mode {
        Mode::Pd => state.prefill.ready_count(),
        Mode::Colocated => 1,
    };
    let status = if prefill > 0 && decode > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = api::health::Readiness {
        ready: status == StatusCode::OK,
        prefill_ready: prefill,
        decode_ready: decode,
        discovery: state.discovery().as_str(),
    };
    (status, Json(body)).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let page = state.metrics.render_with(|r| {
        pool::publish(&[("prefill", &state.prefill), ("decode", &state.decode)], r);
        let degraded = u8::from(state.discovery() == state::Discovery::Degraded);
        r.gauge(
            "router_discovery_degraded",
            "1 while etcd cannot be reached and the last known workers are used.",
        )
        .set(f64::from(degraded));
    });
    ([("content-type", "text/plain; version=0.0.4")], page).into_response()
}

async fn not_found(State(state): State<Arc<AppState>>, uri: axum::http::Uri) -> Response {
    state.error_response(RouterError::NoRoute(uri.path().to_string()))
}

/// Why the router could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Setup(#[from] RouterError),
    #[error("HTTP server: {0}")]
    Io(#[from] std::io::Error),
}

/// The router's bound listeners.
pub struct Listeners {
    /// The HTTP API's (`--listen`).
    pub api: TcpListener,
    /// The operations listener's (`--metrics-listen`): metrics and health.
    pub ops: TcpListener,
}

/// Connections the operations listener holds open at once: Prometheus and the kubelet's
/// probes need a few.
const OPS_CONNECTIONS: usize = 64;

/// Serves the API on `listeners.api` and metrics and health on `listeners.ops`, both over
/// HTTPS when a certificate is configured, until `shutdown` resolves.
pub async fn serve(
    listeners: Listeners,
    cfg: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let https = match (&cfg.https_cert, &cfg.https_key) {
        (Some(cert), Some(key)) => Some(
            tls::ServerTls::load(tls::ServerFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: None,
                alpn: vec![b"http/1.1".to_vec()],
            })
            .map_err(RouterError::from)?,
        ),
        _ => None,
    };
    let limits = runtime::http::Limits {
        max_header_bytes: usize::try_from(cfg.max_header_bytes).unwrap_or(usize::MAX),
        header_timeout: std::time::Duration::from_millis(cfg.header_timeout_ms),
        write_stall: std::time::Duration::from_millis(cfg.client_stall_timeout_ms),
    };
    let max_connections = cfg.max_connections;
    let state = Arc::new(AppState::new(cfg)?);
    state.spawn_background().await?;
    tracing::info!(addr = %listeners.api.local_addr()?, ops = %listeners.ops.local_addr()?,
        model = %state.model_name, mode = ?state.cfg.mode, https = https.is_some(),
        "router serving");
    let (stop, stopping) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    let stopped = move || {
        let mut stopping = stopping.clone();
        async move {
            let _ = stopping.wait_for(|s| *s).await;
        }
    };
    let stalls = Arc::clone(&state.metrics);
    let on_stall: runtime::http::OnStall = Arc::new(move || stalls.client_stalled());
    let ops = runtime::http::serve(
        tls::accept(listeners.ops, https.clone(), OPS_CONNECTIONS)?,
        ops_app(Arc::clone(&state)),
        limits,
        Arc::clone(&on_stall),
        stopped(),
    );
    let api = runtime::http::serve(
        tls::accept(listeners.api, https, max_connections)?,
        app(state),
        limits,
        on_stall,
        stopped(),
    );
    tokio::join!(api, ops);
    Ok(())
}
