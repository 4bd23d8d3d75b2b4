//! Speaking to a decode node as a router and a prefill node do, for tests that feed its KV
//! data plane themselves.

use std::time::Duration;

use proto::v1::decode_client::DecodeClient;
use proto::v1::generate_event::Event;
use proto::v1::{GenerateEvent, GenerateRequest, HealthRequest, KvLayout};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tonic::transport::Channel;
use tonic::Streaming;

/// The metadata key the nodes read a request id from (runtime::REQUEST_ID).
const REQUEST_ID: &str = "x-request-id";

/// A gRPC client of a decode node, its address, and the cache layout it serves.
pub struct DecodeNode {
    pub client: DecodeClient<Channel>,
    pub addr: String,
    pub layout: KvLayout,
}

impl DecodeNode {
    /// Connects to the decode node at `addr` and asks it for its layout.
    pub async fn connect(addr: &str) -> Self {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("an endpoint")
            .connect()
            .await
            .unwrap_or_else(|e| panic!("connecting to the decode node at {addr}: {e}"));
        let mut client = DecodeClient::new(channel);
        let layout = client
            .health(HealthRequest {})
            .await
            .expect("the decode node's health")
            .into_inner()
            .layout
            .expect("the decode node reports its layout");
        Self {
            client,
            addr: addr.to_string(),
            layout,
        }
    }

    /// Opens a Generate call for `id` whose KV a prefill node would send, as the router
    /// does, for `max_new` tokens after the prefill node's first: its ticket, and its events
    /// after it.
    pub async fn reserve(
        &self,
        id: &str,
        prompt: &[u32],
        max_new: u32,
    ) -> (Vec<u8>, Streaming<GenerateEvent>) {
        let mut req = tonic::Request::new(GenerateRequest {
            request_id: id.into(),
            prompt: prompt.to_vec(),
            max_tokens: max_new + 1,
            n: 1,
            ..Default::default()
        });
        req.metadata_mut()
            .insert(REQUEST_ID, id.parse().expect("an ASCII id"));
        let mut events = self
            .client
            .clone()
            .generate(req)
            .await
            .unwrap_or_else(|s| panic!("{id}: the Generate call was refused: {s}"))
            .into_inner();
        (ticket(id, &mut events).await, events)
    }

    /// A KV data-plane connection to the node with its preface sent.
    pub async fn open(&self) -> TcpStream {
        let mut conn = TcpStream::connect(&self.addr)
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.addr));
        conn.write_all(kvwire::PREFACE)
            .await
            .unwrap_or_else(|e| panic!("sending the preface to {}: {e}", self.addr));
        conn
    }
}

/// The ticket a decode node issues as the first event of a Generate call whose KV comes
/// from a prefill node; panics on anything else.
pub async fn ticket(id: &str, events: &mut Streaming<GenerateEvent>) -> Vec<u8> {
    let first = tokio::time::timeout(Duration::from_secs(30), events.message())
        .await
        .unwrap_or_else(|_| panic!("{id}: no KV reservation within 30 s"));
    match first {
        Ok(Some(GenerateEvent {
            event: Some(Event::Reserved(r)),
        })) => r.ticket,
        other => panic!("{id}: expected the KV reservation first, got {other:?}"),
    }
}
