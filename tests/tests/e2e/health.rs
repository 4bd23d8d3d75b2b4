//! A worker's health as probes see it: the operations listener (`--metrics-listen`:
//! plain HTTP `/health`, `/health/ready`, `/metrics`) and `grpc.health.v1` on the gRPC
//! port, while it serves and once it drains with a prompt in flight.

use e2e::{free_port, metric, poll_until, tiny_model, try_get, Fleet};
use serde_json::json;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use super::cluster::*;
use super::failures::long_prompt;

/// The status `grpc.health.v1.Health/Check` gives for the whole server at `addr`.
async fn grpc_health(addr: &str) -> ServingStatus {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("an address")
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    let mut client = HealthClient::new(channel);
    let reply = client
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap_or_else(|e| panic!("health check of {addr}: {e}"));
    reply.into_inner().status()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_is_ready_while_it_serves_and_not_once_it_drains() {
    let ops = format!("127.0.0.1:{}", free_port());
    // One-token chunks: the long prompt below takes hundreds of steps, so the drain it
    // holds open is long enough to see.
    let prefill_args = with(
        WORKER,
        &[
            "--chunk-tokens",
            "1",
            "--prefix-cache-mb",
            "0",
            "--metrics-listen",
            &ops,
        ],
    );
    let mut f = start_fleet(&[], 1, &prefill_args, 1, WORKER).await;
    let get = |path: &str| {
        let url = format!("http://{ops}{path}");
        async move { try_get(&url).await }
    };
    assert_eq!(get("/health").await.map(|r| r.0), Some(200));
    assert_eq!(get("/health/ready").await.map(|r| r.0), Some(200));
    let (status, page) = get("/metrics").await.expect("the metrics page");
    assert_eq!(status, 200);
    assert!(metric(&page, "prefill_queue_depth", "").is_some(), "{page}");
    let grpc = f.prefill[0].addr.clone();
    assert_eq!(grpc_health(&grpc).await, ServingStatus::Serving);

    let body = json!({"model": "test", "prompt": long_prompt(1500), "max_tokens": 4,
        "temperature": 0, "ignore_eos": true});
    let url = format!("{}/v1/completions", f.url);
    let pending = tokio::spawn(async move { e2e::post(&url, &body).await });
    poll_until(SEE, || async {
        let (_, page) = get("/metrics").await?;
        (metric(&page, "prefill_running_prompts", "") == Some(1.0)).then_some(())
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "the prefill node never took the prompt; logs:\n{}",
            f.logs()
        )
    });

    f.prefill[0].proc.signal("TERM");
    poll_until(SEE, || async {
        (get("/health/ready").await?.0 == 503).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("still ready while draining; logs:\n{}", f.logs()));
    assert_eq!(
        get("/health").await.map(|r| r.0),
        Some(200),
        "alive while draining"
    );
    assert_eq!(grpc_health(&grpc).await, ServingStatus::NotServing);

    // The drain finishes the prompt it held, then the node exits.
    let (status, v) = pending.await.expect("the request task");
    assert_eq!(status, 200, "{v}\nlogs:\n{}", f.logs());
    let exit = f.prefill[0].proc.wait_exit(EXIT).await;
    assert!(
        exit.is_some_and(|s| s.success()),
        "{exit:?}; logs:\n{}",
        f.logs()
    );
}

/// A peer that opens the operations listener and drips half a request head is cut off
/// once the head has taken `runtime::OPS_TIMEOUT`: it cannot hold the probes' port.
#[tokio::test(flavor = "multi_thread")]
async fn a_half_sent_head_on_the_operations_listener_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ops = format!("127.0.0.1:{}", free_port());
    let mut f = Fleet::start(&tiny_model(), ROUTER).await;
    f.add_decode(&with(WORKER, &["--metrics-listen", &ops]));
    poll_until(SEE, || async {
        (try_get(&format!("http://{ops}/health")).await?.0 == 200).then_some(())
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "the operations listener never answered; logs:\n{}",
            f.logs()
        )
    });
    let mut sock = tokio::net::TcpStream::connect(&ops).await.unwrap();
    sock.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let limit = runtime::OPS_TIMEOUT + std::time::Duration::from_secs(5);
    let read = tokio::time::timeout(limit, sock.read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(_)) | Ok(Err(_))),
        "still open {limit:?} after half a head; logs:\n{}",
        f.logs()
    );
    let answer = try_get(&format!("http://{ops}/health")).await;
    assert_eq!(answer.map(|r| r.0), Some(200));
}

#[test]
fn every_binary_names_its_version() {
    for name in [
        "tandem-router",
        "tandem-prefill",
        "tandem-decode",
        "tandem-fetch",
    ] {
        let out = std::process::Command::new(e2e::bin(name))
            .arg("--version")
            .output()
            .expect("running the binary");
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name} --version: {out:?}");
        assert_eq!(said.trim(), format!("{name} {}", env!("CARGO_PKG_VERSION")));
    }
}
