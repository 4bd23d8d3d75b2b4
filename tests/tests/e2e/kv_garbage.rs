//! A real decode node fed garbage KV transfers on its real KV data plane (a TCP connection
//! to its port), each with the ticket of a Generate call that waits for it: frames that do
//! not decode, chunks of a wrong layer, shape or length, duplicated or missing, a header
//! that claims more than was reserved, a cache of another prompt, a first token outside the
//! vocabulary, a transfer cut or stalled mid-stream. Each fails its own call with an error
//! that says why, the node frees what it held, a sequence decoding beside them is
//! untouched, and the router serves right after. (Peers without a ticket are
//! `kv_hostile`'s.)

use std::time::Duration;

use e2e::kv::DecodeNode;
use e2e::{metric, scrape, tiny_model, wait_metric, Cluster, Mode};
use kvwire::Item;
use proto::v1::generate_event::Event;
use proto::v1::{FirstTokens, GenerateEvent, KvHeader, KvLayout, Token, TransferAck};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tonic::{Code, Status, Streaming};

/// The decode node's `--kv-timeout-ms`: short, so that the stalled transfer ends soon.
const KV_TIMEOUT_MS: u64 = 3_000;
/// Longest wait for any answer here: the KV timeout and then some.
const ANSWER: Duration = Duration::from_millis(KV_TIMEOUT_MS + 10_000);
/// The prompt every transfer here covers: token ids inside the tiny model's vocabulary.
const PROMPT: [u32; 3] = [1, 2, 3];

fn header(id: &str, ticket: &[u8], layout: &KvLayout, tokens: Vec<u32>) -> Item {
    Item::Header(KvHeader {
        request_id: id.into(),
        layout: Some(layout.clone()),
        tokens,
        max_tokens: 1,
        ticket: ticket.to_vec(),
        ..KvHeader::default()
    })
}

fn chunk(layer: u32, start: u32, len: u32, k: Vec<u8>, v: Vec<u8>) -> Item {
    Item::Chunk(engine::KvChunk {
        layer,
        start,
        len,
        k: k.into(),
        v: v.into(),
    })
}

fn first(token: u32) -> Item {
    Item::First(FirstTokens {
        tokens: vec![Token {
            id: token,
            ..Default::default()
        }],
    })
}

/// A frame of `kind` as the data plane lays one out (kvwire's docs): the kind, the body's
/// length as a little-endian u32, the body. For frames the encoder would never write.
fn frame(kind: u8, len: u32, body: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&len.to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// The bytes of `item`'s frame.
async fn encode(item: &Item) -> Vec<u8> {
    let mut out = Vec::new();
    kvwire::write_item(&mut out, item)
        .await
        .expect("writing to memory");
    out
}

/// Bytes of K (or V) for `positions` of one layer.
fn payload_len(layout: &KvLayout, positions: usize) -> usize {
    positions
        * kvwire::convert::layout_from_proto(layout)
            .expect("a layout of a dtype an engine stores")
            .bytes_per_token_layer()
}

/// A whole, well-formed cache of `PROMPT` whose values are `fill(i)` for byte i.
fn whole_cache(layout: &KvLayout, fill: impl Fn(usize) -> u8) -> Vec<Item> {
    let n = payload_len(layout, PROMPT.len());
    let bytes: Vec<u8> = (0..n).map(&fill).collect();
    (0..layout.n_layers)
        .map(|l| chunk(l, 0, PROMPT.len() as u32, bytes.clone(), bytes.clone()))
        .collect()
}

/// The decode node under test, with the ways this test feeds its data plane.
struct Node(DecodeNode);

impl std::ops::Deref for Node {
    type Target = DecodeNode;
    fn deref(&self) -> &DecodeNode {
        &self.0
    }
}

impl Node {
    async fn connect(addr: &str) -> Self {
        Self(DecodeNode::connect(addr).await)
    }

    /// A data-plane connection to the node, its preface sent, carrying `frames`.
    async fn open(&self, what: &str, frames: &[Vec<u8>]) -> TcpStream {
        let mut conn = self.0.open().await;
        for f in frames {
            conn.write_all(f)
                .await
                .unwrap_or_else(|e| panic!("{what}: sending a frame: {e}"));
        }
        conn
    }

    /// The node's answer on `conn`.
    async fn answer(what: &str, conn: &mut TcpStream) -> Result<TransferAck, Status> {
        tokio::time::timeout(ANSWER, kvwire::read_reply(conn))
            .await
            .unwrap_or_else(|_| panic!("{what}: no answer within {ANSWER:?}"))
            .map_err(Status::from)
    }

    /// Sends `items` as one transfer and ends the connection's sending side; the node's
    /// answer.
    async fn transfer(&self, what: &str, items: Vec<Item>) -> Result<TransferAck, Status> {
        let mut frames = Vec::new();
        for item in &items {
            frames.push(encode(item).await);
        }
        self.transfer_raw(what, frames).await
    }

    /// Sends raw frames, well-formed or not, as one transfer.
    async fn transfer_raw(&self, what: &str, frames: Vec<Vec<u8>>) -> Result<TransferAck, Status> {
        let mut conn = self.open(what, &frames).await;
        conn.shutdown()
            .await
            .unwrap_or_else(|e| panic!("{what}: closing the sending side: {e}"));
        Self::answer(what, &mut conn).await
    }
}

/// Every event of a Generate call up to its end, or the error that ended it.
async fn outcome(id: &str, mut events: Streaming<GenerateEvent>) -> Result<Vec<Event>, Status> {
    let read = async {
        let mut out = Vec::new();
        while let Some(e) = events.message().await? {
            out.extend(e.event);
        }
        Ok(out)
    };
    tokio::time::timeout(ANSWER, read)
        .await
        .unwrap_or_else(|_| panic!("{id}: the Generate call did not end within {ANSWER:?}"))
}

/// Asserts that `got` failed with `code` and a message holding every one of `says`.
fn assert_failed<T: std::fmt::Debug>(
    what: &str,
    got: Result<T, Status>,
    code: Code,
    says: &[&str],
) {
    let status = match got {
        Err(s) => s,
        Ok(v) => panic!("{what}: succeeded ({v:?}), expected {code:?} saying {says:?}"),
    };
    assert_eq!(status.code(), code, "{what}: {status}");
    for s in says {
        assert!(
            status.message().contains(s),
            "{what}: {:?} does not say {s:?}",
            status.message()
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn garbage_kv_fails_its_own_request_and_the_node_keeps_serving() {
    let kv_timeout = KV_TIMEOUT_MS.to_string();
    let mut c = Cluster::start_full(
        Mode::Pd,
        &tiny_model(),
        &[],
        &[],
        &["--kv-timeout-ms", &kv_timeout],
    )
    .await;
    let node = Node::connect(&c.decode).await;
    let layout = node.layout.clone();
    let per_layer = payload_len(&layout, PROMPT.len());
    let good = || vec![0u8; per_layer];
    let head = |id: &str, t: &[u8]| header(id, t, &layout, PROMPT.to_vec());
    let n_layers = layout.n_layers;

    // A sequence decoding the whole time, whose batch the bad requests must not disturb.
    // Its positions stay inside the tiny model's 2048.
    let bystander_new = 2000;
    let (ticket, bystander) = node.reserve("bystander", &PROMPT, bystander_new).await;
    let mut messages = vec![head("bystander", &ticket)];
    messages.extend(whole_cache(&layout, |i| (i % 7) as u8));
    messages.push(first(4));
    node.transfer("bystander", messages)
        .await
        .expect("a well-formed transfer is acknowledged");
    wait_metric(
        &c.decode,
        "decode_running_sequences",
        "",
        1.0,
        Duration::from_secs(10),
    )
    .await;

    // A first token outside the vocabulary, admitted beside the bystander: it would fail
    // the whole batch's next forward pass, so it is refused before it joins.
    let id = "first-outside-vocab";
    let (ticket, events) = node.reserve(id, &PROMPT, 4).await;
    let mut messages = vec![head(id, &ticket)];
    messages.extend(whole_cache(&layout, |_| 0));
    messages.push(first(u32::MAX));
    node.transfer(id, messages)
        .await
        .expect("the transfer itself is well-formed");
    assert_failed(
        &format!("{id}: its Generate call"),
        outcome(id, events).await,
        Code::InvalidArgument,
        &["outside the vocabulary"],
    );

    // Transfers the node must refuse, each with what its refusal says; each is built with
    // its call's ticket.
    let layer_after_last = n_layers;
    type Build<'a> = Box<dyn Fn(&str, &[u8]) -> Vec<Item> + 'a>;
    let cases: Vec<(&str, Build, &str)> = vec![
        (
            "wrong-layer",
            Box::new(|id, t| vec![head(id, t), chunk(layer_after_last, 0, 3, good(), good())]),
            "layer",
        ),
        (
            "huge-layer",
            Box::new(|id, t| vec![head(id, t), chunk(u32::MAX, 0, 3, good(), good())]),
            "layer",
        ),
        (
            "truncated-payload",
            Box::new(|id, t| {
                let mut k = good();
                k.truncate(per_layer - 3);
                vec![head(id, t), chunk(0, 0, 3, k, good())]
            }),
            "payloads of",
        ),
        (
            "wrong-shape",
            Box::new(|id, t| vec![head(id, t), chunk(0, 0, 2, good(), good())]),
            "payloads of",
        ),
        (
            "empty-payloads",
            Box::new(|id, t| vec![head(id, t), chunk(0, 0, 3, vec![], vec![])]),
            "payloads of",
        ),
        (
            "no-positions",
            Box::new(|id, t| vec![head(id, t), chunk(0, 0, 0, vec![], vec![])]),
            "no positions",
        ),
        (
            "past-the-end",
            Box::new(|id, t| vec![head(id, t), chunk(0, 0, u32::MAX, good(), good())]),
            "does not follow",
        ),
        (
            "duplicate-chunk",
            Box::new(|id, t| {
                let third = || vec![0; per_layer / 3];
                vec![
                    head(id, t),
                    chunk(0, 0, 1, third(), third()),
                    chunk(0, 0, 1, third(), third()),
                ]
            }),
            "does not follow",
        ),
        (
            "missing-layer",
            Box::new(|id, t| vec![head(id, t), chunk(0, 0, 3, good(), good()), first(4)]),
            "before the whole cache",
        ),
        (
            "cut-after-a-chunk",
            Box::new(|id, t| vec![head(id, t), chunk(0, 0, 3, good(), good())]),
            "ended before its first token",
        ),
        (
            "second-header",
            Box::new(|id, t| vec![head(id, t), head(id, t)]),
            "a second header",
        ),
        (
            "other-layout",
            Box::new(|id, t| {
                let bf16 = KvLayout {
                    dtype: "bf16".into(),
                    ..layout.clone()
                };
                vec![header(id, t, &bf16, PROMPT.to_vec())]
            }),
            "is not one an engine stores",
        ),
        (
            "no-first-tokens",
            Box::new(|id, t| {
                let mut m = vec![head(id, t)];
                m.extend(whole_cache(&layout, |_| 0));
                m.push(Item::First(FirstTokens { tokens: vec![] }));
                m
            }),
            "first tokens",
        ),
    ];
    let mut refused = 0;
    for (id, build, says) in cases {
        let (ticket, events) = node.reserve(id, &PROMPT, 4).await;
        let sent = node.transfer(id, build(id, &ticket)).await;
        assert_failed(
            &format!("{id}: the transfer"),
            sent,
            Code::InvalidArgument,
            &[says],
        );
        refused += 1;
        assert_failed(
            &format!("{id}: its Generate call"),
            outcome(id, events).await,
            Code::Aborted,
            &[id, "failed", says],
        );
    }

    // A header that asks for more than its ticket reserved: refused before anything is
    // allocated, and its call fails, since its ticket is spent.
    let id = "beyond-reservation";
    let (ticket, events) = node.reserve(id, &PROMPT, 4).await;
    let longer = [&PROMPT[..], &[4]].concat();
    let sent = node
        .transfer(id, vec![header(id, &ticket, &layout, longer)])
        .await;
    assert_failed(
        &format!("{id}: the transfer"),
        sent,
        Code::PermissionDenied,
        &["more than its ticket reserved", "4 prompt positions"],
    );
    refused += 1;
    assert_failed(
        &format!("{id}: its Generate call"),
        outcome(id, events).await,
        Code::Aborted,
        &[id, "more than its ticket reserved"],
    );

    // Frames the encoder never writes. Before a header the node cannot know the request,
    // so only the transfer is refused; after one, its Generate call fails too.
    let per_layer_u32 = per_layer as u32;
    let mut bad_k = frame(2, 16 + 2 * per_layer_u32, &[]);
    for field in [0, 0, 3, 2 * per_layer_u32 + 1] {
        bad_k.extend_from_slice(&field.to_le_bytes());
    }
    bad_k.extend(vec![0u8; 2 * per_layer]);
    let cache_frames = {
        let mut m = Vec::new();
        for c in whole_cache(&layout, |_| 0) {
            m.push(encode(&c).await);
        }
        m
    };
    // A first frame: fixed bytes, or a header with the call's ticket and then fixed bytes.
    enum Raw {
        Alone(Vec<Vec<u8>>),
        AfterHeader(Vec<Vec<u8>>),
    }
    let raw_cases: Vec<(&str, Raw, &str)> = vec![
        (
            "garbage-first",
            Raw::Alone(vec![vec![0xff, 0x13, 0x37, 0x00, 0xee]]),
            "this connection takes",
        ),
        (
            "chunk-first",
            Raw::Alone(vec![encode(&chunk(0, 0, 3, good(), good())).await]),
            "must start with its header",
        ),
        (
            "header-not-protobuf",
            Raw::Alone(vec![frame(
                1,
                7,
                &[0x12, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01],
            )]),
            "does not decode",
        ),
        (
            // Three million positions claimed: a header far over what a prompt of this
            // model can take, refused from its length before it is read.
            "huge-claim",
            Raw::Alone(vec![
                encode(&header("huge-claim", &[], &layout, vec![0; 3 << 20])).await,
            ]),
            "this connection takes",
        ),
        (
            "unknown-kind-after-header",
            Raw::AfterHeader(vec![frame(9, 0, &[])]),
            "kind 9",
        ),
        (
            "short-chunk",
            Raw::AfterHeader(vec![frame(2, 3, &[0, 0, 0])]),
            "a chunk of 3 bytes",
        ),
        (
            "k-past-payload",
            Raw::AfterHeader(vec![bad_k]),
            "exceeds its",
        ),
        (
            // A 4 GiB frame claimed: refused from its length, nothing allocated for it.
            "huge-frame",
            Raw::AfterHeader(vec![frame(2, u32::MAX, &[0; 64])]),
            "this connection takes",
        ),
        (
            "first-not-protobuf",
            Raw::AfterHeader({
                let mut m = cache_frames.clone();
                m.push(frame(3, 2, &[0x0a, 0x05]));
                m
            }),
            "does not decode",
        ),
    ];
    for (id, raw, says) in raw_cases {
        let (frames, events) = match raw {
            Raw::Alone(frames) => (frames, None),
            Raw::AfterHeader(rest) => {
                let (ticket, events) = node.reserve(id, &PROMPT, 4).await;
                let mut frames = vec![encode(&head(id, &ticket)).await];
                frames.extend(rest);
                (frames, Some(events))
            }
        };
        let sent = node.transfer_raw(id, frames).await;
        assert_failed(
            &format!("{id}: the transfer"),
            sent,
            Code::InvalidArgument,
            &["bad KV transfer", says],
        );
        refused += 1;
        if let Some(events) = events {
            assert_failed(
                &format!("{id}: its Generate call"),
                outcome(id, events).await,
                Code::Aborted,
                &[id, "bad KV transfer", says],
            );
        }
    }

    // A whole cache of another prompt: acknowledged, then refused by its Generate call.
    let id = "other-prompt";
    let (ticket, events) = node.reserve(id, &[7, 8, 9], 4).await;
    let mut messages = vec![head(id, &ticket)];
    messages.extend(whole_cache(&layout, |_| 0));
    messages.push(first(4));
    node.transfer(id, messages)
        .await
        .expect("the transfer itself is well-formed");
    assert_failed(
        &format!("{id}: its Generate call"),
        outcome(id, events).await,
        Code::InvalidArgument,
        &["not this call's prompt"],
    );

    // Values that are no numbers (NaN, infinities) in a well-formed cache: nonsense tokens,
    // but a whole answer.
    let id = "nan-values";
    let (ticket, events) = node.reserve(id, &PROMPT, 4).await;
    let mut messages = vec![head(id, &ticket)];
    messages.extend(whole_cache(&layout, |i| [0xff, 0xff, 0xc0, 0x7f][i % 4]));
    messages.push(first(4));
    node.transfer(id, messages)
        .await
        .expect("a well-formed transfer is acknowledged");
    let got = outcome(id, events)
        .await
        .expect("garbage values still decode");
    assert!(
        matches!(got.last(), Some(Event::Finish(_))),
        "{id}: no finish: {got:?}"
    );

    // Cut without a goodbye: the connection reset after a header and a chunk.
    let id = "reset-mid-stream";
    let (ticket, events) = node.reserve(id, &PROMPT, 4).await;
    let frames = [
        encode(&head(id, &ticket)).await,
        encode(&chunk(0, 0, 3, good(), good())).await,
    ];
    let conn = node.open(id, &frames).await;
    conn.set_zero_linger()
        .unwrap_or_else(|e| panic!("{id}: setting a zero linger: {e}"));
    drop(conn);
    // Whether the node read the frames before the reset or not, the Generate call fails.
    match outcome(id, events).await {
        Err(s) if s.code() == Code::Aborted || s.code() == Code::DeadlineExceeded => {
            assert!(s.message().contains(id), "{id}: {s}");
        }
        other => panic!("{id}: expected a failure, got {other:?}"),
    }

    // Stalled mid-stream: the sender keeps the connection open and sends nothing more. The
    // node ends the transfer itself once it has been quiet for the KV timeout, freeing the
    // partial cache.
    let id = "stalled";
    let (ticket, events) = node.reserve(id, &PROMPT, 4).await;
    let frames = [
        encode(&head(id, &ticket)).await,
        encode(&chunk(0, 0, 3, good(), good())).await,
    ];
    let mut conn = node.open(id, &frames).await;
    assert_failed(
        &format!("{id}: the transfer"),
        Node::answer(id, &mut conn).await,
        Code::DeadlineExceeded,
        &["nothing arrived"],
    );
    refused += 1;
    // Only now does this side let go of the connection: the node ended the transfer.
    drop(conn);
    match outcome(id, events).await {
        Err(s) if s.code() == Code::Aborted => {
            assert!(s.message().contains("nothing arrived"), "{id}: {s}");
        }
        other => panic!("{id}: expected a failure, got {other:?}"),
    }

    // The bystander decoded every token it was asked for, untouched by its batch mates.
    let got = outcome("bystander", bystander)
        .await
        .expect("the bystander's call succeeds");
    let tokens = got.iter().filter(|e| matches!(e, Event::Token(_))).count();
    assert_eq!(tokens, bystander_new as usize, "bystander: {got:?}");
    assert!(
        matches!(got.last(), Some(Event::Finish(_))),
        "bystander: {got:?}"
    );

    // Everything held is freed: no blocks, no received cache, nothing queued or running.
    for gauge in [
        "decode_kv_blocks_used",
        "decode_held_transfers",
        "decode_running_sequences",
        "decode_waiting_requests",
    ] {
        wait_metric(&c.decode, gauge, "", 0.0, ANSWER).await;
    }
    // Refusals before a ticket is redeemed are counted apart from failed transfers.
    let page = scrape(&c.decode).await;
    let failures = metric(&page, "decode_transfer_failures_total", "").unwrap_or(0.0)
        + metric(&page, "decode_kv_refused_total", "").unwrap_or(0.0);
    assert!(
        failures >= refused as f64,
        "{failures} transfer failures and refusals counted, {refused} refused:\n{page}"
    );
    assert!(
        c.procs.iter_mut().all(|p| p.running()),
        "a process died; logs:\n{}",
        c.logs()
    );

    // And a normal request right after goes through both nodes.
    let (status, v) = c
        .post(
            "/v1/completions",
            &json!({"model": c.model_name, "prompt": "still serving", "max_tokens": 4}),
        )
        .await;
    assert_eq!(status, 200, "{v}\nlogs:\n{}", c.logs());
    assert!(v["choices"][0]["text"].is_string(), "{v}");
}
