//! Peers of a real decode node's KV data plane that hold no valid ticket, on raw TCP: no
//! ticket, a wrong one, a replayed one, a header over the size a prompt can take, a
//! thousand connections that send the preface and then nothing, and a sender of one byte a
//! second. Each is refused or closed within its deadline, costs the node little memory, and
//! a real request through the router succeeds while it happens.

use std::time::{Duration, Instant};

use e2e::kv::DecodeNode;
use e2e::{tiny_model, Cluster, Mode};
use kvwire::Item;
use proto::v1::{FirstTokens, KvHeader, Token};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::{Code, Status};

/// The decode node's `--kv-header-timeout-ms`: short, so that the test is.
const HEADER_MS: u64 = 2_000;
/// How long a refused peer's connection may take to close beyond its deadline: the node
/// reads what it still sends for 2 s (kv.rs's REFUSAL_DRAIN), and then some.
const CLOSE_SLACK: Duration = Duration::from_secs(5);
/// Most resident memory the node may add for one hostile case.
const MAX_COST: u64 = 50 << 20;
/// Idle connections opened at once.
const IDLE_CONNECTIONS: usize = 1000;

const PROMPT: [u32; 3] = [1, 2, 3];

/// The decode node under test, with the transfers this test sends it.
struct Node(DecodeNode);

impl std::ops::Deref for Node {
    type Target = DecodeNode;
    fn deref(&self) -> &DecodeNode {
        &self.0
    }
}

impl Node {
    /// A whole, well-formed transfer of `PROMPT` under `ticket`.
    fn transfer(&self, id: &str, ticket: &[u8]) -> Vec<Item> {
        let per_layer = PROMPT.len()
            * kvwire::convert::layout_from_proto(&self.layout)
                .expect("a layout of a dtype an engine stores")
                .bytes_per_token_layer();
        let mut items = vec![Item::Header(KvHeader {
            request_id: id.into(),
            layout: Some(self.layout.clone()),
            tokens: PROMPT.to_vec(),
            max_tokens: 3,
            ticket: ticket.to_vec(),
            ..KvHeader::default()
        })];
        for layer in 0..self.layout.n_layers {
            items.push(Item::Chunk(engine::KvChunk {
                layer,
                start: 0,
                len: PROMPT.len() as u32,
                k: vec![0u8; per_layer].into(),
                v: vec![0u8; per_layer].into(),
            }));
        }
        items.push(Item::First(FirstTokens {
            tokens: vec![Token {
                id: 4,
                ..Default::default()
            }],
        }));
        items
    }

    /// Sends `items` on a new connection; the node's answer and how long it took.
    async fn send(&self, items: &[Item]) -> (Result<proto::v1::TransferAck, Status>, Duration) {
        let mut conn = self.open().await;
        let mut bytes = Vec::new();
        for i in items {
            kvwire::write_item(&mut bytes, i).await.expect("encoding");
        }
        let started = Instant::now();
        conn.write_all(&bytes).await.expect("sending");
        let answer = tokio::time::timeout(
            Duration::from_millis(HEADER_MS) + CLOSE_SLACK,
            kvwire::read_reply(&mut conn),
        )
        .await
        .expect("an answer within the header deadline")
        .map_err(Status::from);
        (answer, started.elapsed())
    }
}

/// Reads `conn` until the node closes it; how long that took from `since`.
async fn closed_after(mut conn: TcpStream, since: Instant, limit: Duration) -> Duration {
    let mut sink = [0u8; 1024];
    tokio::time::timeout(limit, async {
        while matches!(conn.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await
    .unwrap_or_else(|_| panic!("a connection was still open after {limit:?}"));
    since.elapsed()
}

fn refused(what: &str, got: Result<proto::v1::TransferAck, Status>, code: Code, says: &str) {
    match got {
        Err(s) => {
            assert_eq!(s.code(), code, "{what}: {s}");
            assert!(s.message().contains(says), "{what}: {s}");
        }
        Ok(ack) => panic!("{what}: acknowledged ({ack:?})"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn peers_without_a_valid_ticket_are_refused_cheaply_while_the_node_serves() {
    let header_ms = HEADER_MS.to_string();
    let mut c = Cluster::start_full(
        Mode::Pd,
        &tiny_model(),
        &[],
        &[],
        &["--kv-header-timeout-ms", &header_ms],
    )
    .await;
    c.assert_serving("warm-up").await;
    let node = Node(DecodeNode::connect(&c.decode).await);
    let deadline = Duration::from_millis(HEADER_MS);
    let base = c.procs[0].memory().rss;

    // No ticket, and a wrong one, for a request that holds a real one: refused at once,
    // and the real ticket still works after them.
    let (ticket, events) = node.reserve("held", &PROMPT, 2).await;
    let (got, took) = node.send(&node.transfer("held", &[])).await;
    refused("no ticket", got, Code::PermissionDenied, "no ticket");
    assert!(took < deadline, "no ticket: refused after {took:?}");
    let mut wrong = ticket.clone();
    wrong[0] ^= 0x5a;
    let (got, _) = node.send(&node.transfer("held", &wrong)).await;
    refused("wrong ticket", got, Code::PermissionDenied, "no ticket");
    let (got, _) = node.send(&node.transfer("held", &ticket)).await;
    got.expect("the real ticket, after the wrong ones");
    let mut events = events;
    while events
        .message()
        .await
        .expect("the held request decodes")
        .is_some()
    {}
    // Replayed: the ticket was spent by its transfer.
    let (got, _) = node.send(&node.transfer("held", &ticket)).await;
    refused("replayed ticket", got, Code::PermissionDenied, "no ticket");

    // A header frame claiming 100 MB: refused from its length, before it is read.
    let mut conn = node.open().await;
    let mut huge = vec![1u8];
    huge.extend_from_slice(&(100u32 << 20).to_le_bytes());
    conn.write_all(&huge).await.expect("the frame's prefix");
    let started = Instant::now();
    let got = tokio::time::timeout(deadline, kvwire::read_reply(&mut conn))
        .await
        .expect("refused within the header deadline")
        .map_err(Status::from);
    refused(
        "oversized header",
        got,
        Code::InvalidArgument,
        "this connection takes",
    );
    closed_after(conn, started, deadline + CLOSE_SLACK).await;

    // A thousand connections that send the preface and then nothing: each is closed once
    // its header deadline passes, and while they are open the node serves and holds little.
    let opened = Instant::now();
    let mut idle = Vec::with_capacity(IDLE_CONNECTIONS);
    for _ in 0..IDLE_CONNECTIONS {
        idle.push(node.open().await);
    }
    c.assert_serving("1000 idle connections").await;
    let cost = c.procs[0].memory().rss.saturating_sub(base);
    eprintln!(
        "{IDLE_CONNECTIONS} idle connections: {} KiB resident",
        cost >> 10
    );
    assert!(
        cost < MAX_COST,
        "{IDLE_CONNECTIONS} idle connections cost {} MiB",
        cost >> 20
    );
    // The last one opened is closed within its deadline of its opening.
    let limit = opened.elapsed() + deadline + CLOSE_SLACK;
    let closes: Vec<_> = idle
        .into_iter()
        .map(|conn| tokio::spawn(closed_after(conn, opened, limit)))
        .collect();
    let mut slowest = Duration::ZERO;
    for close in closes {
        let took = close
            .await
            .expect("each idle connection is closed within its deadline");
        slowest = slowest.max(took);
    }
    eprintln!("the last idle connection closed {slowest:?} after the first opened");

    // One byte a second: the header never comes whole, and the deadline for it ends the
    // connection however steadily the bytes come.
    let mut conn = node.open().await;
    let mut bytes = Vec::new();
    kvwire::write_item(&mut bytes, &node.transfer("slow", &[0; 32])[0])
        .await
        .expect("encoding");
    let (mut r, mut w) = conn.split();
    let started = Instant::now();
    let trickle = async {
        for b in bytes {
            if w.write_all(&[b]).await.is_err() {
                return;
            }
            // The sender's pace is what is under test, not a wait for the node.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    };
    let answer = async {
        tokio::time::timeout(deadline + CLOSE_SLACK, kvwire::read_reply(&mut r))
            .await
            .expect("the slow sender is answered")
            .map_err(Status::from)
    };
    let got = tokio::select! {
        a = answer => a,
        () = trickle => panic!("the whole header went out one byte a second"),
    };
    let took = started.elapsed();
    eprintln!("the one-byte-a-second sender was cut after {took:?}");
    refused(
        "one byte a second",
        got,
        Code::InvalidArgument,
        "no whole header",
    );
    // The node's clock started as the preface came, a moment before this one.
    assert!(
        took + Duration::from_millis(500) >= deadline && took < deadline + Duration::from_secs(2),
        "the slow sender was cut after {took:?}, its deadline is {deadline:?}"
    );
    c.assert_serving("after the slow sender").await;

    // Each is counted, not logged a line each.
    let page = e2e::scrape(&c.decode).await;
    let counted = e2e::metric(&page, "decode_kv_refused_total", "").unwrap_or(0.0);
    assert!(
        counted >= (IDLE_CONNECTIONS + 5) as f64,
        "{counted} refusals counted:\n{page}"
    );
    let warned = std::fs::read_to_string(&c.procs[0].log)
        .unwrap_or_default()
        .matches("WARN")
        .count();
    assert!(
        warned < 10,
        "{warned} warnings logged for the hostile peers"
    );
    let cost = c.procs[0].memory().rss.saturating_sub(base);
    eprintln!(
        "after the hostile peers: {} KiB resident over the start",
        cost >> 10
    );
    assert!(cost < MAX_COST, "the hostile peers left {} MiB", cost >> 20);
    assert!(
        c.procs.iter_mut().all(|p| p.running()),
        "a process died; logs:\n{}",
        c.logs()
    );
}
