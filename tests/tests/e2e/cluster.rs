//! A cluster that finds its workers through etcd: workers that register get traffic,
//! workers that leave (SIGTERM, kill -9, SIGSTOP) cost no request that could be retried,
//! registrations nothing can serve are never used, and an etcd outage leaves the router
//! serving the workers it knew. Workers killed or stopped under requests: failures.rs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{
    metric, post_sse, registration_key, sse_chunks, tiny_model, wait_metric, workers_in, Fleet,
    Role, Worker,
};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Mutex};
use tokio::task::JoinSet;

/// Router flags of every test: workers are probed often, so that a change shows in
/// well under a second.
pub(crate) const ROUTER: &[&str] = &["--health-interval-ms", "200"];
/// Worker flags of every test: a short lease, so that a killed worker's key expires within
/// seconds, and a bounded drain.
pub(crate) const WORKER: &[&str] = &["--lease-ttl-s", "3", "--drain-grace-s", "10"];
/// Router flags that let a request make up to 1900 tokens.
pub(crate) const LONG_ROUTER: &[&str] = &["--max-iter-times", "1900"];
/// How long the router (or etcd) may take to reflect a change of the worker set: a
/// registration, a lease expiry, a few health probes.
pub(crate) const SEE: Duration = Duration::from_secs(20);
/// How long a SIGTERMed worker may take to finish what it holds and exit.
pub(crate) const EXIT: Duration = Duration::from_secs(20);
/// How long a worker may take to free what an ended request held.
pub(crate) const FREE: Duration = Duration::from_secs(15);

/// A greedy completion request (the same text on every run): prompt `words` words long,
/// `max_tokens` tokens out.
pub(crate) fn request(i: usize, words: usize, max_tokens: usize, stream: bool) -> Value {
    let prompt = format!("request {i}: {}", "the decode node batches ".repeat(words));
    json!({"model": "test", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": stream})
}

/// `base` flags followed by `extra` ones.
pub(crate) fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    [base, extra].concat()
}

/// The text of a non-streamed completion; panics with the logs unless it got 200.
pub(crate) async fn text_of(f: &Fleet, body: &Value) -> String {
    let (status, v) = f.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{v}\nlogs:\n{}", f.logs());
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {v}"))
        .to_string()
}

/// A stream's text; panics unless it ended whole: a finish_reason, no error event, then
/// `[DONE]`.
pub(crate) fn streamed_text(data: &[String]) -> String {
    let chunks = sse_chunks(data);
    assert!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "an error event: {data:?}"
    );
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"].is_string()),
        "no finish_reason: {data:?}"
    );
    chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
        .collect()
}

/// A router with `router_extra` flags and the given numbers of prefill and decode nodes,
/// all of them ready in the router.
pub(crate) async fn start_fleet(
    router_extra: &[&str],
    prefills: usize,
    prefill_args: &[&str],
    decodes: usize,
    decode_args: &[&str],
) -> Fleet {
    let mut f = Fleet::start(&tiny_model(), &with(ROUTER, router_extra)).await;
    for _ in 0..prefills {
        f.add_prefill(prefill_args);
    }
    for _ in 0..decodes {
        f.add_decode(decode_args);
    }
    f.wait_workers(Role::Prefill, "ready", prefills, SEE).await;
    f.wait_workers(Role::Decode, "ready", decodes, SEE).await;
    f.wait_ready(SEE).await;
    f
}

/// SIGTERMs worker `i` of `role`; panics unless it drains and exits with status 0.
pub(crate) async fn terminate_cleanly(f: &mut Fleet, role: Role, i: usize) {
    let status = f.terminate(role, i, EXIT).await;
    assert!(
        status.success(),
        "{} node {i} exited with {status} after SIGTERM; logs:\n{}",
        role.name(),
        f.logs()
    );
}

/// Prompts a prefill node completed.
pub(crate) async fn prefills_completed(w: &Worker) -> f64 {
    w.metric("prefill_requests_total", "{outcome=\"completed\"}")
        .await
}

/// Requests a decode node admitted.
pub(crate) async fn decodes_admitted(w: &Worker) -> f64 {
    w.metric("decode_requests_total", "{outcome=\"admitted\"}")
        .await
}

/// Waits until `w` (a decode node) holds no KV blocks, no unclaimed transfer and no call
/// waiting for one.
pub(crate) async fn decode_holds_nothing(w: &Worker) {
    wait_metric(&w.addr, "decode_kv_blocks_used", "", 0.0, FREE).await;
    wait_metric(&w.addr, "decode_held_transfers", "", 0.0, FREE).await;
    wait_metric(&w.addr, "decode_awaited_transfers", "", 0.0, FREE).await;
}

/// Waits until `w` (a prefill node) holds no KV.
pub(crate) async fn prefill_holds_nothing(w: &Worker) {
    wait_metric(&w.addr, "prefill_kv_bytes_held", "", 0.0, FREE).await;
}

/// Checks a registration against what the worker serves: its role and address, the tiny
/// model's name, KV layout and engine version, and a capacity object.
pub(crate) fn check_registration(reg: &Value, w: &Worker) {
    let model = tiny_model();
    let cfg = text::ModelConfig::from_hf_file(&model.join("config.json"))
        .expect("the tiny model's config");
    let layout = engine::KvLayout::for_model(&cfg, engine::KV_DTYPE);
    assert_eq!(reg["role"], w.role.name(), "{reg}");
    assert_eq!(reg["addr"], w.addr.as_str(), "{reg}");
    let name = model.file_name().unwrap().to_string_lossy();
    assert_eq!(reg["model"], name.as_ref(), "{reg}");
    assert_eq!(
        reg["layout"],
        json!({"n_layers": layout.n_layers, "n_kv_heads": layout.n_kv_heads,
            "head_dim": layout.head_dim, "dtype": layout.dtype.name()}),
        "{reg}"
    );
    // Every crate of the workspace, the engine included, has the workspace's version.
    assert_eq!(reg["engine_version"], env!("CARGO_PKG_VERSION"), "{reg}");
    assert!(reg["capacity"].is_object(), "{reg}");
}

#[tokio::test]
async fn discovery_follows_workers() {
    let mut f = Fleet::start(&tiny_model(), &with(ROUTER, &["--policy", "round-robin"])).await;
    let (status, body) = f.ready().await;
    assert_eq!(status, 503, "ready without workers: {body}");

    f.add_prefill(WORKER);
    f.add_decode(WORKER);
    f.wait_workers(Role::Prefill, "ready", 1, SEE).await;
    f.wait_workers(Role::Decode, "ready", 1, SEE).await;
    f.wait_ready(SEE).await;
    let (_, body) = f.ready().await;
    assert_eq!(body["discovery"], "ok", "{body}");
    let req = request(0, 3, 12, false);
    let expected = text_of(&f, &req).await;
    for w in f.prefill.iter().chain(&f.decode) {
        let reg = f
            .registration(w)
            .unwrap_or_else(|| panic!("{} is not in etcd", w.key()));
        check_registration(&reg, w);
    }

    // A second prefill node gets its turn.
    f.add_prefill(WORKER);
    f.wait_workers(Role::Prefill, "ready", 2, SEE).await;
    for _ in 0..4 {
        assert_eq!(text_of(&f, &req).await, expected);
    }
    for (i, w) in f.prefill.iter().enumerate() {
        let done = prefills_completed(w).await;
        assert!(done > 0.0, "prefill node {i} completed nothing");
    }

    // The first one leaves: deregistered, out of rotation, and no request notices.
    terminate_cleanly(&mut f, Role::Prefill, 0).await;
    assert!(
        f.registration(&f.prefill[0]).is_none(),
        "a drained worker's key outlives it"
    );
    f.wait_workers(Role::Prefill, "ready", 1, SEE).await;
    let before = prefills_completed(&f.prefill[1]).await;
    for _ in 0..3 {
        assert_eq!(text_of(&f, &req).await, expected);
    }
    assert_eq!(prefills_completed(&f.prefill[1]).await, before + 3.0);
}

/// Streamed clients, one request per client per round.
const LOAD_CLIENTS: usize = 6;
/// The most requests the load may send (rounds × clients stay under it).
const LOAD_MAX: usize = 60;

/// Clients that each send their own streamed request whenever the test hands out a
/// ticket, and check every stream against that request's text from a healthy run. Rounds
/// of tickets go out just before each change of the worker set, so requests are in
/// flight while it happens.
struct Load {
    tickets: mpsc::Sender<()>,
    clients: JoinSet<usize>,
    released: usize,
}

impl Load {
    /// One client per `(body, expected text)`, waiting for tickets.
    fn start(url: &str, requests: Vec<(Value, String)>) -> Self {
        let (tickets, rx) = mpsc::channel(LOAD_MAX);
        let rx = Arc::new(Mutex::new(rx));
        let mut clients = JoinSet::new();
        for (client, (body, expected)) in requests.into_iter().enumerate() {
            let rx = Arc::clone(&rx);
            let url = url.to_string();
            clients.spawn(async move {
                let mut sent = 0;
                loop {
                    // The lock is let go at the end of this statement, before the request.
                    let ticket = rx.lock().await.recv().await;
                    if ticket.is_none() {
                        return sent;
                    }
                    let (status, data) = post_sse(&url, &body).await;
                    assert_eq!(status, 200, "client {client}, request {sent}: {data:?}");
                    assert_eq!(
                        streamed_text(&data),
                        expected,
                        "client {client}, request {sent}"
                    );
                    sent += 1;
                }
            });
        }
        Self {
            tickets,
            clients,
            released: 0,
        }
    }

    /// Lets each client send one more request.
    async fn round(&mut self) {
        assert!(self.released + LOAD_CLIENTS <= LOAD_MAX, "too many rounds");
        for _ in 0..LOAD_CLIENTS {
            // Fails only when every client has panicked; `finish` reports why.
            let _ = self.tickets.send(()).await;
        }
        self.released += LOAD_CLIENTS;
    }

    /// Waits for every released request; how many were sent, or a client's failure.
    async fn finish(self) -> Result<usize, String> {
        let Self {
            tickets,
            mut clients,
            released,
        } = self;
        drop(tickets);
        let mut sent = 0;
        while let Some(done) = clients.join_next().await {
            sent += done.map_err(|e| e.to_string())?;
        }
        if sent != released {
            return Err(format!("{sent} requests of {released} were sent"));
        }
        Ok(sent)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn scale_under_load() {
    let mut f = start_fleet(&[], 1, WORKER, 1, WORKER).await;
    let mut requests = Vec::new();
    for i in 0..LOAD_CLIENTS {
        let body = request(i, 2 + i, 24, true);
        let mut solo = body.clone();
        solo["stream"] = json!(false);
        requests.push((body, text_of(&f, &solo).await));
    }
    let mut load = Load::start(&format!("{}/v1/completions", f.url), requests);

    // Up to 3 prefill and 2 decode nodes, each change under a round of requests.
    load.round().await;
    f.add_prefill(WORKER);
    f.wait_workers(Role::Prefill, "ready", 2, SEE).await;
    load.round().await;
    f.add_prefill(WORKER);
    f.wait_workers(Role::Prefill, "ready", 3, SEE).await;
    load.round().await;
    f.add_decode(WORKER);
    f.wait_workers(Role::Decode, "ready", 2, SEE).await;
    load.round().await;

    // Back to one of each, the first ones (which have served longest) leaving.
    for i in [0, 1] {
        load.round().await;
        terminate_cleanly(&mut f, Role::Prefill, i).await;
    }
    f.wait_workers(Role::Prefill, "ready", 1, SEE).await;
    load.round().await;
    terminate_cleanly(&mut f, Role::Decode, 0).await;
    f.wait_workers(Role::Decode, "ready", 1, SEE).await;
    load.round().await;
    if let Err(why) = load.finish().await {
        panic!("{why}\nlogs:\n{}", f.logs());
    }

    // The workers that joined under load served, and hold nothing now.
    let (p, d) = (&f.prefill[2], &f.decode[1]);
    assert!(
        prefills_completed(p).await > 0.0,
        "prefill node 2 got no work"
    );
    assert!(decodes_admitted(d).await > 0.0, "decode node 1 got no work");
    decode_holds_nothing(d).await;
    prefill_holds_nothing(p).await;
}

/// How long etcd stays down: the issue asks that a 30 s outage costs no request.
const OUTAGE: Duration = Duration::from_secs(30);
/// How often a request goes out during the outage.
const OUTAGE_PACE: Duration = Duration::from_millis(500);

#[tokio::test]
async fn etcd_outage() {
    let mut f = start_fleet(&[], 1, WORKER, 1, WORKER).await;
    let req = request(0, 2, 12, false);
    let expected = text_of(&f, &req).await;

    f.etcd.stop();
    let down = Instant::now();
    f.wait_router("discovery degraded", SEE, |page| {
        metric(page, "router_discovery_degraded", "") == Some(1.0)
    })
    .await;
    let mut pace = tokio::time::interval(OUTAGE_PACE);
    while down.elapsed() < OUTAGE {
        pace.tick().await;
        assert_eq!(text_of(&f, &req).await, expected, "during the outage");
        let (status, body) = f.ready().await;
        assert_eq!(status, 200, "not ready during the outage: {body}");
        assert_eq!(body["discovery"], "degraded", "{body}");
    }

    f.etcd.restart().await;
    f.wait_router("discovery back", SEE, |page| {
        metric(page, "router_discovery_degraded", "") == Some(0.0)
    })
    .await;
    // Their leases may have expired while etcd was down: the workers register again.
    f.wait_registration(&f.prefill[0], true, SEE).await;
    f.wait_registration(&f.decode[0], true, SEE).await;
    f.wait_workers(Role::Prefill, "ready", 1, SEE).await;
    f.wait_workers(Role::Decode, "ready", 1, SEE).await;
    let (status, body) = f.ready().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["discovery"], "ok", "{body}");

    // And the router follows new registrations again.
    f.add_decode(WORKER);
    f.wait_workers(Role::Decode, "ready", 2, SEE).await;
    assert_eq!(text_of(&f, &req).await, expected);
}

#[tokio::test]
async fn unservable_registrations_are_never_used() {
    let mut f = start_fleet(&[], 1, WORKER, 1, WORKER).await;
    let req = request(0, 2, 12, false);
    let expected = text_of(&f, &req).await;
    // Only the registration written below names this node: it registers nothing itself.
    let foreign = f.add_unregistered(Role::Decode, &[]).await;
    let real = f
        .registration(&f.decode[0])
        .expect("the decode node's registration");

    // (a) Nothing listens at the address; (b) a live node registered for another model.
    let closed = format!("127.0.0.1:{}", e2e::free_port());
    let mut dead = real.clone();
    dead["addr"] = json!(closed);
    f.etcd
        .put(&registration_key(Role::Decode, &closed), &dead.to_string());
    let mut other_model = real.clone();
    other_model["addr"] = json!(f.decode[foreign].addr);
    other_model["model"] = json!("other-model");
    f.etcd
        .put(&f.decode[foreign].key(), &other_model.to_string());

    let page = f
        .wait_router("both registrations classified", SEE, |page| {
            let count = |state| workers_in(page, Role::Decode, state).unwrap_or(0.0);
            count("unhealthy") >= 1.0 && count("incompatible") >= 1.0
        })
        .await;
    assert_eq!(
        workers_in(&page, Role::Decode, "ready"),
        Some(1.0),
        "{page}"
    );
    for _ in 0..8 {
        assert_eq!(text_of(&f, &req).await, expected);
    }
    let foreign = &f.decode[foreign];
    assert_eq!(
        decodes_admitted(foreign).await,
        0.0,
        "the other model's node was used"
    );
    assert_eq!(
        foreign.metric("decode_transfers_total", "").await,
        0.0,
        "a prefill node sent the other model's node a cache"
    );
}
