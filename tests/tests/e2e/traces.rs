//! Distributed traces: with `--otlp-endpoint` on all three binaries, a PD request that names
//! a trace in its `traceparent` header arrives at the collector as that one trace, with a
//! span for each phase (the router's request, the prefill, the KV transfer, the decode),
//! each the child of the phase that caused it and each with its token counts.

use std::time::Duration;

use e2e::otlp::{Collector, Received};
use e2e::{tiny_model, Cluster, Mode};
use serde_json::{json, Value};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER: &str = "00f067aa0ba902b7";
const PHASES: [&str; 4] = ["request", "prefill", "kv_transfer", "generate"];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The spans of the test's trace.
fn in_trace(spans: &[Received]) -> Vec<&Received> {
    spans
        .iter()
        .filter(|r| hex(&r.span.trace_id) == TRACE)
        .collect()
}

/// The one span named `name` among `spans`.
fn one<'a>(spans: &[&'a Received], name: &str) -> &'a Received {
    let found: Vec<_> = spans.iter().filter(|r| r.span.name == name).collect();
    assert_eq!(found.len(), 1, "{name}: {spans:#?}");
    found[0]
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pd_request_is_one_trace_with_a_span_for_each_phase() {
    let collector = Collector::start().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint.as_str()),
        // Batches leave every 100 ms rather than 5 s: the test waits for them.
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let c = Cluster::launch_env(Mode::Pd, &tiny_model(), &[], &env).await;
    let body = json!({"model": c.model_name, "prompt": "hello there", "max_tokens": 4,
        "temperature": 0});
    let resp = c
        .client
        .post(format!("{}/v1/completions", c.url))
        .header("traceparent", format!("00-{TRACE}-{CALLER}-01"))
        .json(&body)
        .send()
        .await
        .expect("the request");
    assert_eq!(resp.status(), 200);
    let answer: Value = resp.json().await.expect("JSON");
    let prompt = answer["usage"]["prompt_tokens"].as_i64().expect("usage");
    let completion = answer["usage"]["completion_tokens"]
        .as_i64()
        .expect("usage");

    let all = collector
        .wait_for(Duration::from_secs(60), |spans| {
            let trace = in_trace(spans);
            PHASES
                .iter()
                .all(|p| trace.iter().any(|r| r.span.name == *p))
        })
        .await;
    let trace = in_trace(&all);
    let [request, prefill, kv, generate] = PHASES.map(|p| one(&trace, p));
    let id = |r: &Received| hex(&r.span.span_id);
    let parent = |r: &Received| hex(&r.span.parent_span_id);

    // The client's span is the request's parent; the router's request the parent of the
    // prefill and the decode; the prefill's the parent of the transfer it sent.
    assert_eq!(parent(request), CALLER);
    assert_eq!(parent(prefill), id(request));
    assert_eq!(parent(generate), id(request));
    assert_eq!(parent(kv), id(prefill));
    // Each from the process that ran the phase.
    let services = [request, prefill, kv, generate].map(|r| r.service.as_str());
    assert_eq!(
        services,
        [
            "tandem-router",
            "tandem-prefill",
            "tandem-decode",
            "tandem-decode"
        ]
    );
    // And with the request's token counts.
    let counts = [
        (request, "prompt_tokens", prompt),
        (prefill, "prompt_tokens", prompt),
        (kv, "tokens", prompt),
        (generate, "prompt_tokens", prompt),
        (generate, "completion_tokens", completion),
    ];
    for (span, field, want) in counts {
        assert_eq!(span.int(field), Some(want), "{field} of {span:#?}");
    }
}
