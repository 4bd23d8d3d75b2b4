//! An OpenTelemetry collector stand-in: the OTLP/gRPC trace service that a collector serves,
//! on a free port, keeping every span the binaries send it. A stand-in rather than the
//! collector itself (a Go program this repository does not build): what the tests check is
//! what arrives on the wire, and this receives it through the protocol's own generated
//! server, as the collector does.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use tokio::sync::Notify;

/// One span as received, with the `service.name` of the process that sent it.
#[derive(Debug, Clone)]
pub struct Received {
    pub service: String,
    pub span: Span,
}

impl Received {
    /// The span's attribute `key` as an integer, if it has one.
    pub fn int(&self, key: &str) -> Option<i64> {
        self.span
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                Value::IntValue(i) => Some(*i),
                _ => None,
            })
    }
}

#[derive(Default)]
struct Store {
    spans: Mutex<Vec<Received>>,
    arrived: Notify,
}

/// The service, over the store the test reads.
struct Sink(Arc<Store>);

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for resource in req.into_inner().resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for scope in resource.scope_spans {
                got.extend(scope.spans.into_iter().map(|span| Received {
                    service: service.clone(),
                    span,
                }));
            }
        }
        self.0.spans.lock().expect("spans").extend(got);
        self.0.arrived.notify_waiters();
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A running stand-in; it serves until the test ends.
pub struct Collector {
    /// Its address, for `--otlp-endpoint`.
    pub endpoint: String,
    store: Arc<Store>,
}

impl Collector {
    /// Starts serving on a free port.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding");
        let endpoint = format!("http://{}", listener.local_addr().expect("address"));
        let store = Arc::new(Store::default());
        let service = TraceServiceServer::new(Sink(Arc::clone(&store)));
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Self { endpoint, store }
    }

    /// The spans received once `done` holds of them; panics after `limit` without.
    pub async fn wait_for(
        &self,
        limit: Duration,
        done: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let wait = async {
            loop {
                // Registered before the look, so that an export between the two wakes it.
                let arrived = self.store.arrived.notified();
                {
                    let spans = self.store.spans.lock().expect("spans");
                    if done(&spans) {
                        return spans.clone();
                    }
                }
                arrived.await;
            }
        };
        match tokio::time::timeout(limit, wait).await {
            Ok(spans) => spans,
            Err(_) => panic!(
                "after {limit:?} the collector holds {:#?}",
                self.store.spans.lock().expect("spans")
            ),
        }
    }
}
