//! The `tandem.v1` gRPC contracts. They carry plain values (token ids, sampling settings, a
//! cache layout) and depend on no engine type; the nodes convert (`kvwire::convert`).

/// Generated messages, clients and servers of `tandem.v1`.
pub mod v1 {
    tonic::include_proto!("tandem.v1");
}
