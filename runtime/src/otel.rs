//! Distributed traces. With `--otlp-endpoint` the tracing spans of a request go to an
//! OpenTelemetry collector over OTLP/gRPC; without it nothing is exported and nothing here
//! costs more than a look at an empty context. The W3C trace context (`traceparent`) is taken
//! from the client's request and carried on every hop: in gRPC metadata from the router to
//! both nodes, and in the KV transfer's header from the prefill node to the decode node, so
//! that one trace holds every phase of a request.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C header (and metadata key) that names a request's trace and its parent span.
pub const TRACEPARENT: &str = "traceparent";

/// Why traces cannot be exported as asked.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    #[error("starting the trace exporter's thread: {0}")]
    Thread(std::io::Error),
    #[error("the OTLP exporter for {endpoint}: {source}")]
    Exporter {
        endpoint: String,
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

/// The exporter of a process that sends traces, and the thread its gRPC client runs on.
/// Dropped, it sends what is still buffered: keep it until the process ends.
pub struct Exporter {
    provider: SdkTracerProvider,
    // Its own thread, because a binary's runtime may have one thread (the router's
    // `--threads 1`) that the exporter's connection should not share. Dropped after the
    // provider's shutdown, which sends through it.
    _io: tokio::runtime::Runtime,
}

impl Exporter {
    /// An exporter to the collector at `endpoint` (`http://host:4317`) that names the
    /// process `service`. Spans are sent in batches from a thread of the SDK's
    /// (`OTEL_BSP_*` size and time them).
    pub fn start(endpoint: &str, service: &'static str) -> Result<Self, OtelError> {
        let io = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otlp")
            .enable_all()
            .build()
            .map_err(OtelError::Thread)?;
        // The gRPC channel starts its connection task on the runtime it is made in.
        let _inside = io.enter();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()
            .map_err(|source| OtelError::Exporter {
                endpoint: endpoint.into(),
                source,
            })?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        Ok(Self { provider, _io: io })
    }

    /// The tracer the tracing layer records spans with.
    pub fn tracer(&self, service: &'static str) -> SdkTracer {
        self.provider.tracer(service)
    }
}

impl Drop for Exporter {
    /// Sends the spans still buffered, then stops the exporter's thread. Blocks: the
    /// binaries drop it outside their runtime, once that has stopped.
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "sending the last traces");
        }
    }
}

/// A count as a span field that reaches the collector as a number: the trace layer records
/// signed integers as such but unsigned ones (`usize`, `u32`, `u64`) as text.
pub fn count(n: impl TryInto<i64>) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// The trace context of `span` as a `traceparent` value; empty when traces are off or the
/// span belongs to none.
pub fn traceparent(span: &tracing::Span) -> String {
    let mut fields = Fields::default();
    TraceContextPropagator::new().inject_context(&span.context(), &mut fields);
    fields.traceparent.unwrap_or_default()
}

/// Makes `span` a child of the span a `traceparent` value names; a value that names none
/// (empty, malformed) leaves `span` the root of a trace of its own.
pub fn follow(span: &tracing::Span, traceparent: &str) {
    let fields = Fields {
        traceparent: Some(traceparent.to_owned()),
    };
    follow_carrier(span, &fields);
}

/// [`follow`] with the `traceparent` of a client's HTTP headers.
pub fn follow_headers(span: &tracing::Span, headers: &http::HeaderMap) {
    follow_carrier(span, &Headers(headers));
}

/// [`follow`] with the `traceparent` of an incoming call's metadata.
pub fn follow_metadata(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    let fields = Fields {
        traceparent: metadata
            .get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
    };
    follow_carrier(span, &fields);
}

fn follow_carrier(span: &tracing::Span, carrier: &dyn Extractor) {
    let cx = TraceContextPropagator::new().extract(carrier);
    if cx.span().span_context().is_valid() {
        // Refused only when no exporter is set up (no layer to take it), or once the
        // span has started: this runs before either could happen, and then nothing is
        // sent anyway.
        let _ = span.set_parent(cx);
    }
}

/// Adds the current span's `traceparent` to the metadata of an outgoing call.
pub fn inject_current(metadata: &mut tonic::metadata::MetadataMap) {
    let value = traceparent(&tracing::Span::current());
    if value.is_empty() {
        return;
    }
    if let Ok(v) = value.parse() {
        metadata.insert(TRACEPARENT, v);
    }
}

/// The one field of the W3C trace context the hops carry (`tracestate` is vendor data that
/// no part of Tandem reads).
#[derive(Default)]
struct Fields {
    traceparent: Option<String>,
}

impl Injector for Fields {
    fn set(&mut self, key: &str, value: String) {
        if key == TRACEPARENT {
            self.traceparent = Some(value);
        }
    }
}

impl Extractor for Fields {
    fn get(&self, key: &str) -> Option<&str> {
        (key == TRACEPARENT)
            .then_some(self.traceparent.as_deref())
            .flatten()
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    /// A subscriber with the OpenTelemetry layer on a provider that exports nowhere.
    fn traced() -> impl tracing::Subscriber {
        let provider = SdkTracerProvider::builder().build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        tracing_subscriber::registry().with(layer)
    }

    #[test]
    fn a_span_follows_its_callers_trace_and_names_itself_to_the_next_hop() {
        tracing::subscriber::with_default(traced(), || {
            let span = tracing::info_span!("prefill");
            follow(&span, PARENT);
            let next = traceparent(&span);
            let parts: Vec<&str> = next.split('-').collect();
            assert_eq!(parts.len(), 4, "{next}");
            assert_eq!(
                parts[1], "0af7651916cd43dd8448eb211c80319c",
                "the same trace"
            );
            assert_ne!(parts[2], "b7ad6b7169203331", "its own span id");
            assert_eq!(parts[3], "01", "sampled, as the caller asked");
        });
    }

    #[test]
    fn a_header_or_nothing_that_names_no_span_starts_a_trace_of_its_own() {
        tracing::subscriber::with_default(traced(), || {
            let mut headers = http::HeaderMap::new();
            headers.insert(TRACEPARENT, "00-not-a-trace".parse().expect("a value"));
            let span = tracing::info_span!("request");
            follow_headers(&span, &headers);
            let own = traceparent(&span);
            assert_eq!(own.len(), PARENT.len(), "{own}");
            assert!(!own.contains("0af7651916cd43dd8448eb211c80319c"));
        });
    }

    #[test]
    fn counts_are_signed_and_saturate() {
        assert_eq!(count(5usize), 5);
        assert_eq!(count(u64::MAX), i64::MAX);
    }

    #[test]
    fn without_an_exporter_nothing_is_carried() {
        let span = tracing::info_span!("request");
        follow(&span, PARENT);
        assert_eq!(traceparent(&span), "");
        let mut metadata = tonic::metadata::MetadataMap::new();
        inject_current(&mut metadata);
        assert!(metadata.get(TRACEPARENT).is_none());
    }
}
