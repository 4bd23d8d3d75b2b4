//! Transport security and bounds: the API over HTTPS, mutual TLS on every gRPC hop
//! (router→prefill, router→decode, prefill→decode), peers with bad certificates refused
//! with a clear log line while good ones keep being served, certificates reloaded without
//! dropping connections, and the gRPC message bound at its edge.

use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e::pki::{Leaf, Pki, Validity};
use e2e::{bin, metric, poll_until, scratch, tiny_model, Cluster, Mode, Proc};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn certs_dir(name: &str) -> PathBuf {
    scratch().join(format!("tls-{name}-{}", e2e::free_port()))
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn chat(text: &str, max_tokens: u32) -> Value {
    json!({"model": "test", "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens, "temperature": 0})
}

/// A client for a worker's gRPC port presenting `identity` (none: no certificate).
fn worker_client(ca: &Path, identity: Option<&Leaf>) -> tls::Connector {
    let files = tls::ClientFiles {
        ca: ca.to_path_buf(),
        identity: identity.map(|l| (l.cert.clone(), l.key.clone())),
        alpn: vec![b"h2".to_vec()],
    };
    tls::Connector::new(tls::ClientTls::load(files, None).expect("client TLS loads"))
}

/// Calls Health on the decode node at `addr` through `connector` (None: plain text).
async fn decode_health(addr: &str, connector: Option<tls::Connector>) -> Result<(), String> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("an endpoint")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5));
    let channel = match connector {
        Some(c) => endpoint.connect_with_connector(c).await,
        None => endpoint.connect().await,
    }
    .map_err(|e| format!("connect: {e}"))?;
    proto::v1::decode_client::DecodeClient::new(channel)
        .health(proto::v1::HealthRequest {})
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Waits until `proc`'s log holds a line with every one of `needles`.
async fn wait_log_line(proc: &Proc, needles: &[&str], what: &str) {
    let found = poll_until(Duration::from_secs(15), || async {
        let log = std::fs::read_to_string(&proc.log).unwrap_or_default();
        log.lines()
            .any(|l| needles.iter().all(|n| l.contains(n)))
            .then_some(())
    })
    .await;
    assert!(
        found.is_some(),
        "{what}: no log line in {} holds {needles:?}:\n{}",
        proc.log.display(),
        std::fs::read_to_string(&proc.log).unwrap_or_default()
    );
}

/// The mutual-TLS flags of a router, a prefill and a decode node, each with a certificate
/// of its role from `pki`.
fn role_args(pki: &Pki, ca: &Path) -> [Vec<String>; 3] {
    ["router", "prefill", "decode"]
        .map(|role| pki.leaf_as(Some(role), role, Validity::Good).mtls_args(ca))
}

fn proc_tagged<'a>(c: &'a Cluster, tag: &str) -> &'a Proc {
    c.procs
        .iter()
        .find(|p| p.log.display().to_string().contains(tag))
        .unwrap_or_else(|| panic!("no {tag} process"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hop_is_tls_and_peers_without_a_good_certificate_are_refused() {
    let dir = certs_dir("hops");
    let pki = Pki::new(&dir, "cluster");
    let ca = pki.ca();
    let api = pki.leaf("api", Validity::Good);
    let [mut router_args, prefill, decode] = role_args(&pki, &ca);
    router_args.extend([
        "--https-cert".into(),
        api.cert.display().to_string(),
        "--https-key".into(),
        api.key.display().to_string(),
    ]);
    let c = Cluster::launch(
        Mode::Pd,
        &tiny_model(),
        &strs(&router_args),
        &strs(&prefill),
        &strs(&decode),
        Some(&ca),
    )
    .await;
    assert!(c.url.starts_with("https://"), "{}", c.url);

    // A whole request crosses HTTPS, then mutual TLS to P and D and from P to D.
    let (status, body) = c
        .post("/v1/chat/completions", &chat("hello there", 8))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");

    // Plain HTTP to the HTTPS port gets no API.
    let plain = c.url.replacen("https://", "http://", 1);
    let resp = reqwest::Client::new()
        .get(format!("{plain}/health"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(
        resp.as_ref().map_or(true, |r| !r.status().is_success()),
        "plain HTTP was served on the HTTPS port: {resp:?}"
    );
    wait_log_line(
        proc_tagged(&c, "router"),
        &["TLS handshake refused"],
        "plain HTTP",
    )
    .await;

    // The decode node's gRPC port: plain text, another CA, an expired certificate from
    // the right CA, and no certificate are each refused with the reason in its log.
    let d = proc_tagged(&c, "decode");
    let err = decode_health(&c.decode, None)
        .await
        .expect_err("plain text");
    println!("plain text: {err}");
    wait_log_line(
        d,
        &["TLS handshake refused", "corrupt message"],
        "plain text",
    )
    .await;

    let other = Pki::new(&dir, "other");
    let stranger = other.leaf("stranger", Validity::Good);
    let err = decode_health(&c.decode, Some(worker_client(&ca, Some(&stranger))))
        .await
        .expect_err("a certificate from another CA");
    println!("other CA: {err}");
    wait_log_line(d, &["TLS handshake refused", "UnknownIssuer"], "other CA").await;

    let expired = pki.leaf("expired", Validity::Expired);
    let err = decode_health(&c.decode, Some(worker_client(&ca, Some(&expired))))
        .await
        .expect_err("an expired certificate");
    println!("expired: {err}");
    wait_log_line(
        d,
        &["TLS handshake refused", "certificate expired"],
        "expired",
    )
    .await;

    let err = decode_health(&c.decode, Some(worker_client(&ca, None)))
        .await
        .expect_err("no client certificate");
    println!("no certificate: {err}");
    wait_log_line(d, &["TLS handshake refused", "no certificates"], "none").await;
    // Four refusals within a minute, each with its reason at debug, make one warning: a
    // scanner or a probe cannot flood the log.
    let log = std::fs::read_to_string(&d.log).unwrap_or_default();
    let warnings = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("TLS handshake refused"))
        .count();
    assert_eq!(warnings, 1, "{log}");

    // A peer with a good certificate and the router's role is served, and so is the
    // cluster.
    let good = pki.leaf_as(Some("router"), "good-client", Validity::Good);
    decode_health(&c.decode, Some(worker_client(&ca, Some(&good))))
        .await
        .expect("a good certificate is served");
    let (status, body) = c
        .post("/v1/chat/completions", &chat("still there?", 4))
        .await;
    assert_eq!(status, 200, "{body}");

    // Roles: the same CA's certificates without the router's role (none, a prefill
    // node's) may not call the decode node's services, and only a prefill node's may send
    // it KV.
    let no_role = pki.leaf("no-role", Validity::Good);
    let prefill_role = pki.leaf_as(Some("prefill"), "prefill-client", Validity::Good);
    for (what, leaf) in [("no role", &no_role), ("prefill", &prefill_role)] {
        let err = decode_health(&c.decode, Some(worker_client(&ca, Some(leaf))))
            .await
            .expect_err(what);
        assert!(
            err.contains("takes calls from spiffe://tandem/router only"),
            "{what}: {err}"
        );
    }
    let (host, port) = c.decode.rsplit_once(':').expect("host:port");
    for (what, leaf) in [("router", &good), ("no role", &no_role)] {
        let files = tls::ClientFiles {
            ca: ca.clone(),
            identity: Some((leaf.cert.clone(), leaf.key.clone())),
            alpn: vec![],
        };
        let client = tls::ClientTls::load(files, None).expect("client TLS loads");
        let mut io = tls::dial(Some(&client), host, port.parse().unwrap())
            .await
            .expect("the handshake passes: the CA signed it");
        io.write_all(kvwire::PREFACE).await.unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(10), kvwire::read_reply(&mut io))
            .await
            .expect("answered at once");
        assert!(
            matches!(&reply, Err(kvwire::WireError::Refused(s))
                if s.code() == tonic::Code::PermissionDenied),
            "{what}: {reply:?}"
        );
    }
    let (status, body) = c.post("/v1/chat/completions", &chat("and now?", 4)).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_skips_workers_whose_certificates_fail_and_serves_through_good_ones() {
    let dir = certs_dir("bad-workers");
    let pki = Pki::new(&dir, "cluster");
    let ca = pki.ca();
    let other = Pki::new(&dir, "other");
    let model = tiny_model().display().to_string();
    // Three more prefill nodes the router is told about: one with an expired certificate,
    // one with a certificate from a CA the router does not trust, and one with a good
    // certificate of the cluster's CA that makes it a decode node, not a prefill node.
    let mut bad = Vec::new();
    for (name, leaf) in [
        ("expired", pki.leaf("p-expired", Validity::Expired)),
        ("stranger", other.leaf("p-stranger", Validity::Good)),
        (
            "impostor",
            pki.leaf_as(Some("decode"), "p-impostor", Validity::Good),
        ),
    ] {
        let addr = format!("127.0.0.1:{}", e2e::free_port());
        let mut args = vec![
            "--model".to_string(),
            model.clone(),
            "--listen".into(),
            addr.clone(),
        ];
        args.extend(leaf.mtls_args(&ca));
        let p = Proc::spawn(
            &bin("tandem-prefill"),
            &args,
            &format!("tls-{name}-prefill"),
        );
        bad.push((name, addr, p));
    }
    let [mut router_args, prefill, decode] = role_args(&pki, &ca);
    for (_, addr, _) in &bad {
        router_args.extend(["--prefill-nodes".into(), addr.clone()]);
    }
    let c = Cluster::launch(
        Mode::Pd,
        &tiny_model(),
        &strs(&router_args),
        &strs(&prefill),
        &strs(&decode),
        None,
    )
    .await;
    let router = proc_tagged(&c, "router");
    for (name, addr, _) in &bad {
        let why = match *name {
            "expired" => "certificate expired",
            "stranger" => "UnknownIssuer",
            _ => "carries role spiffe://tandem/decode, not spiffe://tandem/prefill",
        };
        wait_log_line(
            router,
            &["TLS handshake with", addr, "refused", why],
            "a bad worker",
        )
        .await;
    }
    for i in 0..6 {
        let (status, body) = c
            .post("/v1/chat/completions", &chat(&format!("request {i}"), 4))
            .await;
        assert_eq!(status, 200, "request {i}: {body}");
    }
    // Only ready workers are routed to: both bad ones are out of rotation.
    let page = c.router_metrics().await;
    assert_eq!(
        e2e::workers_in(&page, e2e::Role::Prefill, "unhealthy"),
        Some(3.0),
        "the three bad prefill nodes are out of rotation:\n{page}"
    );
}

/// The leaf certificate the server at `port` presents to a new connection, as DER.
async fn presented(ca: &Path, port: u16) -> (Vec<u8>, tls::ClientStream) {
    let files = tls::ClientFiles {
        ca: ca.to_path_buf(),
        identity: None,
        alpn: vec![b"http/1.1".to_vec()],
    };
    let connector = tls::Connector::new(tls::ClientTls::load(files, None).expect("loads"));
    let stream = connector
        .connect("127.0.0.1", port)
        .await
        .expect("the handshake succeeds");
    let der = stream
        .get_ref()
        .1
        .peer_certificates()
        .expect("a certificate")[0]
        .to_vec();
    (der, stream)
}

/// Sends `GET /health` on an open connection and reads the status line.
async fn health_on(stream: &mut tls::ClientStream) -> String {
    stream
        .write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .expect("the request is written");
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .expect("an answer within 5 s")
        .expect("the connection reads");
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

fn der_of(pem_file: &Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    let pem = std::fs::read(pem_file).expect("the certificate reads");
    rustls::pki_types::CertificateDer::from_pem_slice(&pem)
        .expect("a PEM certificate")
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_https_certificate_reloads_without_dropping_open_connections() {
    let dir = certs_dir("reload");
    let pki = Pki::new(&dir, "cluster");
    let ca = pki.ca();
    let live = pki.leaf("api", Validity::Good);
    let first = der_of(&live.cert);
    let args = [
        "--https-cert".to_string(),
        live.cert.display().to_string(),
        "--https-key".into(),
        live.key.display().to_string(),
    ];
    let c = Cluster::launch(Mode::Pd, &tiny_model(), &strs(&args), &[], &[], Some(&ca)).await;
    let port: u16 = c.url.rsplit(':').next().unwrap().parse().unwrap();

    let (der, mut open) = presented(&ca, port).await;
    assert_eq!(der, first, "the first certificate is served");
    assert!(health_on(&mut open).await.contains("200"));

    // Rotate: the next certificate replaces the files (as a renewed secret does).
    let next = pki.leaf("api-next", Validity::Good);
    let second = der_of(&next.cert);
    assert_ne!(first, second);
    std::fs::copy(&next.key, &live.key).unwrap();
    std::fs::copy(&next.cert, &live.cert).unwrap();
    let rotated = poll_until(Duration::from_secs(15), || async {
        let (der, _) = presented(&ca, port).await;
        (der == second).then_some(())
    })
    .await;
    assert!(
        rotated.is_some(),
        "new connections never got the new certificate:\n{}",
        c.logs()
    );
    // The connection opened before the rotation still serves.
    assert!(
        health_on(&mut open).await.contains("200"),
        "the open connection was dropped"
    );

    // A broken file is refused and the certificate in use stays.
    std::fs::write(&live.cert, b"not a certificate").unwrap();
    wait_log_line(
        proc_tagged(&c, "router"),
        &["do not load", "keeping the previous ones"],
        "a broken certificate file",
    )
    .await;
    let (der, _) = presented(&ca, port).await;
    assert_eq!(
        der, second,
        "the certificate in use is kept when the new file is broken"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_chunks_are_bounded_by_their_reservation_not_by_the_grpc_message_limit() {
    // 32 KiB holds the tiny model's KV for about 120 tokens per layer message, and the
    // prefill node sends 1 MiB messages. A chunk goes straight into the cache reserved for
    // it, with no buffer of the message's size, so its bound is what the reservation
    // holds (one layer of the prompt), whatever gRPC's message limit.
    let c = Cluster::start_full(
        Mode::Pd,
        &tiny_model(),
        &[],
        &[],
        &["--grpc-max-message-bytes", "32768"],
    )
    .await;
    let long = "the quick brown fox jumps over the lazy dog ".repeat(60);
    let (status, body) = c
        .post(
            "/v1/completions",
            &json!({"model": "test", "prompt": long, "max_tokens": 4, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "a long prompt's KV arrives: {body}");
    let page = e2e::scrape(&c.decode).await;
    let received = metric(&page, "decode_transfer_bytes_total", "").unwrap_or(0.0);
    assert!(
        received > 32768.0,
        "the transfer carried {received} bytes, no more than one small message"
    );
    let d = c.decode.clone();
    let freed = poll_until(Duration::from_secs(10), || async {
        let page = e2e::scrape(&d).await;
        (metric(&page, "decode_kv_blocks_used", "") == Some(0.0)).then_some(())
    })
    .await;
    assert!(freed.is_some(), "the decode node freed the request's KV");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_register_through_an_etcd_with_tls_and_a_user() {
    let dir = certs_dir("etcd");
    let pki = Pki::new(&dir, "etcd");
    let security = e2e::EtcdSecurity {
        ca: pki.ca(),
        server: pki.leaf("etcd-server", Validity::Good),
        client: pki.leaf("etcd-client", Validity::Good),
        user: "tandem".into(),
        password: "canary-etcd-password-7f3a".into(),
        root_password: "canary-root-password-51c9".into(),
    };
    let etcd = e2e::Etcd::start_secured(security.clone()).await;
    let secured = security.client_args();
    let mut f = e2e::Fleet::start_on(etcd, &tiny_model(), &strs(&secured)).await;
    f.add_prefill(&strs(&secured));
    f.add_decode(&strs(&secured));
    // One more worker with the wrong password: etcd refuses it and it never registers.
    let mut wrong = secured.clone();
    let at = wrong.iter().position(|a| a == "--etcd-password").unwrap() + 1;
    wrong[at] = "not-the-password".into();
    let refused = f.add_decode(&strs(&wrong));
    f.wait_workers(e2e::Role::Prefill, "ready", 1, Duration::from_secs(60))
        .await;
    f.wait_workers(e2e::Role::Decode, "ready", 1, Duration::from_secs(60))
        .await;
    let (status, body) = e2e::post(
        &format!("{}/v1/chat/completions", f.url),
        &chat("through a secured etcd", 4),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let registered = f.registration(&f.workers(e2e::Role::Decode)[0]);
    assert!(registered.is_some(), "the decode node registered");
    wait_log_line(
        &f.workers(e2e::Role::Decode)[refused].proc,
        &["etcd refused the user tandem"],
        "a wrong password",
    )
    .await;
    assert!(
        f.registration(&f.workers(e2e::Role::Decode)[refused])
            .is_none(),
        "a worker etcd refused is not registered"
    );
    // Neither password is written to any log.
    let logs = f.logs();
    for secret in [&security.password, &security.root_password] {
        assert!(!logs.contains(secret.as_str()), "{secret} is in the logs");
    }
}

/// Under HTTPS, `--max-connections` counts sockets still in their TLS handshake: three
/// clients that connect and never say hello hold three of four places (the fourth is the
/// cluster's own client), so a new client waits until the handshake deadline closes them.
/// Each handshake used to run on a task of its own outside the cap, so any number of
/// silent sockets could be held open.
#[tokio::test(flavor = "multi_thread")]
async fn under_https_the_connection_cap_counts_handshakes_and_they_have_a_deadline() {
    let dir = certs_dir("cap");
    let pki = Pki::new(&dir, "cluster");
    let ca = pki.ca();
    let api = pki.leaf("api", Validity::Good);
    let router_args = [
        "--https-cert".into(),
        api.cert.display().to_string(),
        "--https-key".into(),
        api.key.display().to_string(),
        "--max-connections".into(),
        "4".into(),
    ];
    let c = Cluster::launch(
        Mode::Pd,
        &tiny_model(),
        &strs(&router_args),
        &[],
        &[],
        Some(&ca),
    )
    .await;
    let url = format!("{}/v1/chat/completions", c.url);
    let kept = &c.client;
    assert_eq!(
        kept.post(&url)
            .json(&chat("kept", 2))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // Their handshake deadlines run from their accept, which comes after this instant.
    let silent_since = std::time::Instant::now();
    let host = c.url.trim_start_matches("https://");
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(
            tokio::net::TcpStream::connect(host)
                .await
                .expect("connecting"),
        );
    }
    assert_eq!(
        kept.post(&url)
            .json(&chat("still kept", 2))
            .send()
            .await
            .unwrap()
            .status(),
        200,
        "an open connection keeps working at the cap"
    );
    let fresh = e2e::pki::https_client(&ca);
    let status = tokio::time::timeout(
        tls::HANDSHAKE_TIMEOUT + Duration::from_secs(10),
        fresh.post(&url).json(&chat("new", 2)).send(),
    )
    .await
    .expect("served once a place came free")
    .expect("the request")
    .status();
    let served_after = silent_since.elapsed();
    assert_eq!(status, 200);
    assert!(
        served_after >= tls::HANDSHAKE_TIMEOUT,
        "a fifth connection was served past the cap of 4, {served_after:?} after three \
         silent ones connected, before their handshake deadline"
    );
    for mut conn in silent {
        let mut rest = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut rest)).await;
        assert!(
            closed.is_ok(),
            "a silent connection outlived its handshake deadline"
        );
    }
}
