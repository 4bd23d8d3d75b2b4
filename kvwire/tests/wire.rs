//! The data plane over real loopback sockets: a `Client` against a receiver built on
//! `Reader` that answers as a decode node does (the decode node itself is tested end to
//! end in the e2e suite).

use std::time::Duration;

use kvwire::{Client, Frame, Item, Reader, WireError};
use proto::v1::{FirstTokens, KvHeader, Token, TransferAck};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(10);
const LIMITS: kvwire::Limits = kvwire::Limits {
    message: 1 << 20,
    chunk: 1 << 20,
};

/// How the receiver treats each transfer.
#[derive(Clone, Copy)]
enum Mode {
    /// Acknowledges it and waits for the next one on the same connection.
    Answer,
    /// Refuses it at its first chunk.
    Refuse,
    /// Acknowledges it and closes the connection.
    AnswerAndClose,
}

/// A chunk as received: layer, start, positions, K, V.
type Received = (u32, u32, u32, Vec<u8>, Vec<u8>);

/// What the receiver saw.
#[derive(Debug, PartialEq)]
enum Seen {
    Connection,
    Transfer {
        id: String,
        chunks: Vec<Received>,
        first: Vec<u32>,
    },
    Cut(String),
}

async fn receiver(mode: Mode) -> (String, mpsc::UnboundedReceiver<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            let tx = tx.clone();
            tx.send(Seen::Connection).unwrap();
            tokio::spawn(async move {
                let mut preface = [0u8; 12];
                tokio::io::AsyncReadExt::read_exact(&mut conn, &mut preface)
                    .await
                    .unwrap();
                assert_eq!(&preface[..], kvwire::PREFACE);
                let (r, mut w) = tokio::io::split(conn);
                let mut reader = Reader::new(r);
                loop {
                    let id = match reader.next(None, WAIT, LIMITS).await {
                        Ok(Some(Frame::Header(h))) => h.request_id,
                        Ok(None) => return,
                        other => panic!("expected a header, got {other:?}"),
                    };
                    let mut chunks = Vec::new();
                    let (mut bytes, first) = (
                        0,
                        loop {
                            match reader.next(Some(WAIT), WAIT, LIMITS).await {
                                Ok(Some(Frame::Chunk(head))) => {
                                    let (mut k, mut v) = (vec![0; head.k_len], vec![0; head.v_len]);
                                    reader.payload(&mut [&mut k, &mut v], WAIT).await.unwrap();
                                    if matches!(mode, Mode::Refuse) {
                                        let no = tonic::Status::invalid_argument("no thanks");
                                        kvwire::write_refusal(&mut w, &no).await.unwrap();
                                        reader.drain(WAIT).await;
                                        return;
                                    }
                                    chunks.push((head.layer, head.start, head.len, k, v));
                                }
                                Ok(Some(Frame::First(f))) => {
                                    break f.tokens.iter().map(|t| t.id).collect::<Vec<_>>()
                                }
                                Ok(Some(Frame::Header(_))) => panic!("a second header"),
                                Ok(None) => {
                                    tx.send(Seen::Cut("closed".into())).unwrap();
                                    return;
                                }
                                Err(e) => {
                                    tx.send(Seen::Cut(e.to_string())).unwrap();
                                    return;
                                }
                            }
                        },
                    );
                    for c in &chunks {
                        bytes += (c.3.len() + c.4.len()) as u64;
                    }
                    tx.send(Seen::Transfer { id, chunks, first }).unwrap();
                    kvwire::write_ack(&mut w, &TransferAck { bytes })
                        .await
                        .unwrap();
                    if matches!(mode, Mode::AnswerAndClose) {
                        return;
                    }
                }
            });
        }
    });
    (addr, rx)
}

async fn seen(rx: &mut mpsc::UnboundedReceiver<Seen>) -> Seen {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("the receiver saw something within the wait")
        .expect("the receiver runs")
}

fn header(id: &str) -> KvHeader {
    KvHeader {
        request_id: id.into(),
        tokens: vec![1, 2, 3],
        ..Default::default()
    }
}

fn chunk(layer: u32, fill: u8) -> Item {
    Item::Chunk(engine::KvChunk {
        layer,
        start: 0,
        len: 3,
        k: vec![fill; 24].into(),
        v: vec![fill + 1; 24].into(),
    })
}

fn first(id: u32) -> Item {
    Item::First(FirstTokens {
        tokens: vec![Token {
            id,
            ..Default::default()
        }],
    })
}

/// Items on a channel that is already closed behind them.
fn items(list: Vec<Item>) -> mpsc::UnboundedReceiver<Item> {
    let (tx, rx) = mpsc::unbounded_channel();
    for i in list {
        tx.send(i).unwrap();
    }
    rx
}

fn client() -> Client {
    Client::new(WAIT, None)
}

#[tokio::test]
async fn transfers_arrive_whole_and_share_one_connection() {
    let (addr, mut rx) = receiver(Mode::Answer).await;
    let c = client();
    for (n, id) in ["a", "b"].into_iter().enumerate() {
        let ack = c
            .transfer(
                &addr,
                header(id),
                items(vec![chunk(0, 7), chunk(1, 9), first(42)]),
            )
            .await
            .unwrap_or_else(|e| panic!("transfer {id}: {e}"));
        assert_eq!(ack.bytes, 4 * 24, "{id}");
        if n == 0 {
            assert_eq!(seen(&mut rx).await, Seen::Connection);
        }
        assert_eq!(
            seen(&mut rx).await,
            Seen::Transfer {
                id: id.into(),
                chunks: vec![
                    (0, 0, 3, vec![7; 24], vec![8; 24]),
                    (1, 0, 3, vec![9; 24], vec![10; 24])
                ],
                first: vec![42],
            }
        );
    }
    assert!(rx.try_recv().is_err(), "the second transfer dialed again");
}

#[tokio::test]
async fn a_refusal_ends_the_transfer_before_it_is_sent() {
    let (addr, mut rx) = receiver(Mode::Refuse).await;
    // The sender keeps the channel open and never sends the first tokens: only the
    // refusal can end the transfer.
    let (tx, items) = mpsc::unbounded_channel();
    tx.send(chunk(0, 1)).unwrap();
    let got = tokio::time::timeout(WAIT, client().transfer(&addr, header("r"), items))
        .await
        .expect("the refusal ended the transfer within the wait");
    match got {
        Err(WireError::Refused(s)) => {
            assert_eq!(s.code(), tonic::Code::InvalidArgument);
            assert_eq!(s.message(), "no thanks");
        }
        other => panic!("expected the refusal, got {other:?}"),
    }
    assert_eq!(seen(&mut rx).await, Seen::Connection);
    drop(tx);
}

#[tokio::test]
async fn an_abandoned_transfer_is_cut_and_its_connection_not_reused() {
    let (addr, mut rx) = receiver(Mode::Answer).await;
    let c = client();
    let got = c
        .transfer(&addr, header("gone"), items(vec![chunk(0, 1)]))
        .await;
    assert!(matches!(got, Err(WireError::Abandoned)), "{got:?}");
    assert_eq!(seen(&mut rx).await, Seen::Connection);
    assert!(
        matches!(seen(&mut rx).await, Seen::Cut(_)),
        "the receiver saw the transfer end early"
    );
    c.transfer(&addr, header("next"), items(vec![chunk(0, 1), first(1)]))
        .await
        .expect("the next transfer, on a new connection");
    assert_eq!(seen(&mut rx).await, Seen::Connection);
}

#[tokio::test]
async fn a_connection_the_receiver_closed_is_not_reused() {
    let (addr, mut rx) = receiver(Mode::AnswerAndClose).await;
    let c = client();
    for id in ["one", "two"] {
        c.transfer(&addr, header(id), items(vec![chunk(0, 1), first(1)]))
            .await
            .unwrap_or_else(|e| panic!("transfer {id}: {e}"));
        assert_eq!(seen(&mut rx).await, Seen::Connection, "{id}");
        assert!(matches!(seen(&mut rx).await, Seen::Transfer { .. }), "{id}");
    }
}

#[tokio::test]
async fn a_transfer_abandoned_before_its_first_item_dials_nothing() {
    let (addr, mut rx) = receiver(Mode::Answer).await;
    let c = client();
    let got = c.transfer(&addr, header("never"), items(vec![])).await;
    assert!(matches!(got, Err(WireError::Abandoned)), "{got:?}");
    // The next transfer's connection is the first the receiver sees.
    c.transfer(&addr, header("after"), items(vec![chunk(0, 1), first(1)]))
        .await
        .expect("the next transfer");
    assert_eq!(seen(&mut rx).await, Seen::Connection);
    match seen(&mut rx).await {
        Seen::Transfer { id, .. } => assert_eq!(id, "after"),
        other => panic!("expected the transfer \"after\", got {other:?}"),
    }
}

#[tokio::test]
async fn a_bad_address_is_refused_before_dialing() {
    let got = client()
        .transfer("no-port", header("x"), items(vec![first(1)]))
        .await;
    assert!(matches!(got, Err(WireError::BadAddr(_))), "{got:?}");
    let status = tonic::Status::from(got.unwrap_err());
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
}
