//! TLS on every hop. Certificates and keys come from PEM files and are read again when the
//! files change (a rotated Kubernetes secret, cert-manager's renewal): new connections get
//! the new certificate, open ones keep the one they started with. One listener type hands out
//! plain or TLS connections to both the HTTP API and the gRPC servers, and one connector
//! dials gRPC channels over TLS, so every hop is configured and logged the same way.

mod config;
mod conn;
mod role;

pub use config::{ClientFiles, ClientTls, ServerFiles, ServerTls, TlsArgs};
pub use conn::{
    accept, dial, handshakes_refused, ClientStream, Conn, Connector, Incoming, Io,
    HANDSHAKE_TIMEOUT,
};
pub use role::{Identity, Peer, Role};

use std::path::PathBuf;
use std::time::Duration;

/// How long a connection between the cluster's processes (a gRPC channel, a KV data-plane
/// connection) or from an API client is used for new work. Certificates are reloaded for new
/// connections only, so a connection that lived forever would keep a rotated (or revoked)
/// one forever: past this age a dialer opens a new connection for new calls, and the
/// router asks its clients to (`Connection: close`). Calls on the old connection finish.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(600);

/// Why TLS could not be set up from the configured files.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {0}: {1}")]
    Read(PathBuf, String),
    #[error("{0} holds no PEM certificate")]
    NoCertificate(PathBuf),
    #[error("{0} holds no PEM private key")]
    NoKey(PathBuf),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("the CA in {0} cannot verify peers: {1}")]
    Verifier(PathBuf, String),
    #[error("{0} is not a server name a certificate can carry")]
    ServerName(String),
    #[error("{0}")]
    Incomplete(String),
}
