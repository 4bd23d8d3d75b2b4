//! Server and client configurations built from PEM files, rebuilt when the files change.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::{Role, TlsError};

/// How often the files behind a configuration are checked for changes.
const RELOAD_POLL: Duration = Duration::from_secs(1);

/// The files a server presents and, for mutual TLS, the CA its clients' certificates must
/// chain to.
#[derive(Debug, Clone)]
pub struct ServerFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key of the leaf.
    pub key: PathBuf,
    /// PEM CA bundle; with it every client must present a certificate it signed.
    pub client_ca: Option<PathBuf>,
    /// ALPN protocols offered, most preferred first.
    pub alpn: Vec<Vec<u8>>,
}

/// The CA a client trusts and, for mutual TLS, the certificate it presents.
#[derive(Debug, Clone)]
pub struct ClientFiles {
    /// PEM CA bundle the server's certificate must chain to.
    pub ca: PathBuf,
    /// PEM certificate chain and key presented to servers that ask for one.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// ALPN protocols offered.
    pub alpn: Vec<Vec<u8>>,
}

/// Flags for mutual TLS between the cluster's processes (router→prefill, router→decode,
/// prefill→decode). One certificate per process serves both as its server certificate and
/// as its client certificate, so it needs both the serverAuth and clientAuth usages.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// PEM certificate (chain) this process presents to its cluster peers. With
    /// --tls-key and --tls-ca, every gRPC hop this process serves or dials is mutual TLS.
    #[arg(long, env = "TANDEM_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "TANDEM_TLS_KEY", requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle that peers' certificates must chain to.
    #[arg(long, env = "TANDEM_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// Name checked against the certificates of the workers this process dials; default:
    /// the host of the address dialed (so certificates need that IP or DNS name). Set it
    /// when workers are dialed by pod IP and their certificates carry a service name.
    #[arg(long, env = "TANDEM_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
}

impl TlsArgs {
    /// True when mutual TLS is configured.
    pub fn enabled(&self) -> bool {
        self.tls_cert.is_some()
    }

    /// The server side: every client must present a certificate from the CA. Gives
    /// HTTP/1.1 beside h2 so Prometheus can scrape `/metrics` on the same port.
    pub fn server(&self) -> Result<Option<ServerTls>, TlsError> {
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca)
        else {
            return Ok(None);
        };
        ServerTls::load(ServerFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: Some(ca.clone()),
            alpn: vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        })
        .map(Some)
    }

    /// The client side, for gRPC channels to peers.
    pub fn client(&self) -> Result<Option<ClientTls>, TlsError> {
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca)
        else {
            return Ok(None);
        };
        ClientTls::load(
            ClientFiles {
                ca: ca.clone(),
                identity: Some((cert.clone(), key.clone())),
                alpn: vec![b"h2".to_vec()],
            },
            self.tls_server_name.clone(),
        )
        .map(Some)
    }
}

/// A configuration shared by every connection, swapped whole when its files change.
#[derive(Debug)]
struct Reloading<C> {
    current: RwLock<Arc<C>>,
}

impl<C: Send + Sync + 'static> Reloading<C> {
    fn get(&self) -> Arc<C> {
        Arc::clone(&self.current.read().expect("config lock is never poisoned"))
    }

    /// Watches `files` from a background task and rebuilds with `build` when one changes;
    /// a rebuild that fails (a half-written file) keeps the configuration in use.
    fn watch(
        self: &Arc<Self>,
        what: &'static str,
        files: Vec<PathBuf>,
        build: impl Fn() -> Result<C, TlsError> + Send + 'static,
    ) {
        let this = Arc::downgrade(self);
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        handle.spawn(async move {
            let mut seen = fingerprint(&files);
            loop {
                tokio::time::sleep(RELOAD_POLL).await;
                let Some(this) = this.upgrade() else { return };
                let now = fingerprint(&files);
                if now == seen {
                    continue;
                }
                match build() {
                    Ok(c) => {
                        *this.current.write().expect("config lock is never poisoned") =
                            Arc::new(c);
                        seen = now;
                        tracing::info!(files = ?files, "{what}: reloaded the TLS files");
                    }
                    Err(e) => tracing::warn!(
                        "{what}: the TLS files changed but do not load ({e}); keeping the previous ones"
                    ),
                }
            }
        });
    }
}

/// What changes when a file is rewritten or its symlink is swapped.
fn fingerprint(files: &[PathBuf]) -> Vec<Option<(SystemTime, u64)>> {
    files
        .iter()
        .map(|f| {
            std::fs::metadata(f)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

/// A server's TLS configuration, reloaded when its files change.
#[derive(Debug, Clone)]
pub struct ServerTls(Arc<Reloading<ServerConfig>>);

impl ServerTls {
    /// Loads `files`, and (inside a tokio runtime) watches them for changes.
    pub fn load(files: ServerFiles) -> Result<Self, TlsError> {
        let first = server_config(&files)?;
        let this = Arc::new(Reloading {
            current: RwLock::new(Arc::new(first)),
        });
        let mut paths = vec![files.cert.clone(), files.key.clone()];
        paths.extend(files.client_ca.clone());
        this.watch("server", paths, move || server_config(&files));
        Ok(Self(this))
    }

    /// The configuration new connections get.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.0.get()
    }
}

/// A client's TLS configuration, reloaded when its files change.
#[derive(Debug, Clone)]
pub struct ClientTls {
    config: Arc<Reloading<ClientConfig>>,
    server_name: Option<String>,
    /// The role a server's certificate must carry, where the dialer knows whom it dials.
    peer_role: Option<Role>,
}

impl ClientTls {
    /// Loads `files`, and (inside a tokio runtime) watches them for changes. Servers'
    /// certificates are checked against `server_name`, else the host dialed.
    pub fn load(files: ClientFiles, server_name: Option<String>) -> Result<Self, TlsError> {
        if let Some(n) = &server_name {
            ServerName::try_from(n.clone()).map_err(|_| TlsError::ServerName(n.clone()))?;
        }
        let first = client_config(&files)?;
        let config = Arc::new(Reloading {
            current: RwLock::new(Arc::new(first)),
        });
        let mut paths = vec![files.ca.clone()];
        if let Some((c, k)) = &files.identity {
            paths.extend([c.clone(), k.clone()]);
        }
        config.watch("client", paths, move || client_config(&files));
        Ok(Self {
            config,
            server_name,
            peer_role: None,
        })
    }

    /// The same configuration, for dialing peers whose certificates must carry `role`
    /// (`spiffe://tandem/<role>`) besides the name: a prefill node's certificate cannot
    /// serve as a decode node's, though the CA signed both for one shared name.
    pub fn expecting(mut self, role: Role) -> Self {
        self.peer_role = Some(role);
        self
    }

    /// The role servers dialed with this configuration must prove, if any.
    pub fn peer_role(&self) -> Option<Role> {
        self.peer_role
    }

    /// The configuration new connections get.
    pub fn config(&self) -> Arc<ClientConfig> {
        self.config.get()
    }

    /// The name a server at `host` must prove.
    pub fn server_name(&self, host: &str) -> Result<ServerName<'static>, TlsError> {
        let name = self.server_name.as_deref().unwrap_or(host);
        let name = name.trim_start_matches('[').trim_end_matches(']');
        ServerName::try_from(name.to_string()).map_err(|_| TlsError::ServerName(name.into()))
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::Read(path.into(), e.to_string()))
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Read(path.into(), e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.into()));
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|_| TlsError::NoKey(path.into()))
}

fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in certs(path)? {
        roots
            .add(c)
            .map_err(|e| TlsError::Verifier(path.into(), e.to_string()))?;
    }
    Ok(roots)
}

fn server_config(files: &ServerFiles) -> Result<ServerConfig, TlsError> {
    let builder =
        ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                    .build()
                    .map_err(|e| TlsError::Verifier(ca.clone(), e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs(&files.cert)?, key(&files.key)?)?;
    config.alpn_protocols = files.alpn.clone();
    Ok(config)
}

fn client_config(files: &ClientFiles) -> Result<ClientConfig, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(&files.ca)?);
    let mut config = match &files.identity {
        Some((cert, k)) => builder.with_client_auth_cert(certs(cert)?, key(k)?)?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = files.alpn.clone();
    Ok(config)
}
