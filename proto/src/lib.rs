//! The `tandem.v1` gRPC contracts, and conversions between their messages and engine types.

/// Generated messages, clients and servers of `tandem.v1`.
pub mod v1 {
    tonic::include_proto!("tandem.v1");
}

mod convert;

pub use convert::{layout_from_proto, layout_to_proto, token_from_proto, token_to_proto};
