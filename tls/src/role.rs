//! Who a peer is in the cluster, as its certificate says. Under mutual TLS any certificate
//! the cluster CA signed passes the handshake; the role it carries decides what it may call:
//! only the router calls the workers' request services, only prefill nodes send KV caches.
//! A role is a URI SAN `spiffe://tandem/<role>` (SPIFFE's form, which cert-manager,
//! SPIRE and openssl all write).

use rustls::pki_types::CertificateDer;
use tonic::transport::server::TcpConnectInfo;

/// A process's part in the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Router,
    Prefill,
    Decode,
}

impl Role {
    const ALL: [Role; 3] = [Role::Router, Role::Prefill, Role::Decode];

    /// The URI SAN that gives a certificate this role.
    pub const fn uri(self) -> &'static str {
        match self {
            Role::Router => "spiffe://tandem/router",
            Role::Prefill => "spiffe://tandem/prefill",
            Role::Decode => "spiffe://tandem/decode",
        }
    }

    /// The role a certificate carries: its one tandem URI SAN. None for a certificate
    /// without one, one that does not parse, or one with two different roles (which
    /// would make a single key both, so neither is granted).
    pub fn of(cert: &CertificateDer<'_>) -> Option<Role> {
        let cert = webpki::EndEntityCert::try_from(cert).ok()?;
        let mut found = None;
        for uri in cert.valid_uri_names() {
            let Some(role) = Role::ALL.into_iter().find(|r| r.uri() == uri) else {
                continue;
            };
            if found.is_some_and(|f| f != role) {
                return None;
            }
            found = Some(role);
        }
        found
    }
}

/// What an accepted connection proved about its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Identity {
    /// Plain TCP: nothing; every caller is let through (TLS off is for trusted networks,
    /// and the KV plane's tickets still hold).
    Plain,
    /// TLS with a certificate from the CA, and the role it carries, if any.
    Certified(Option<Role>),
    /// TLS without a client certificate (a port that asks for none, like the router's API).
    Anonymous,
}

impl Identity {
    /// Whether a caller with this identity may use a service open to `roles`.
    pub fn may(self, roles: &[Role]) -> bool {
        match self {
            Identity::Plain => true,
            Identity::Certified(Some(r)) => roles.contains(&r),
            Identity::Certified(None) | Identity::Anonymous => false,
        }
    }
}

/// An accepted connection's peer, which the gRPC server puts in every request's
/// extensions.
#[derive(Debug, Clone)]
pub struct Peer {
    pub tcp: TcpConnectInfo,
    pub identity: Identity,
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair, SanType};

    fn cert(uris: &[&str]) -> CertificateDer<'static> {
        let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        for u in uris {
            params
                .subject_alt_names
                .push(SanType::URI(u.to_string().try_into().unwrap()));
        }
        let key = KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn a_certificate_s_role_is_its_one_tandem_uri() {
        assert_eq!(Role::of(&cert(&[])), None);
        for role in Role::ALL {
            assert_eq!(Role::of(&cert(&[role.uri()])), Some(role));
            assert_eq!(
                Role::of(&cert(&["spiffe://other/x", role.uri(), role.uri()])),
                Some(role)
            );
        }
        assert_eq!(Role::of(&cert(&["spiffe://tandem/admin"])), None);
        assert_eq!(Role::of(&cert(&["spiffe://tandem/router/x"])), None);
        assert_eq!(
            Role::of(&cert(&[Role::Router.uri(), Role::Prefill.uri()])),
            None,
            "two roles grant neither"
        );
        assert_eq!(Role::of(&CertificateDer::from(vec![0x30, 0x03])), None);
    }

    #[test]
    fn only_the_named_roles_pass_under_tls() {
        let router_only = [Role::Router];
        assert!(Identity::Plain.may(&router_only));
        assert!(Identity::Certified(Some(Role::Router)).may(&router_only));
        assert!(!Identity::Certified(Some(Role::Decode)).may(&router_only));
        assert!(!Identity::Certified(None).may(&router_only));
        assert!(!Identity::Anonymous.may(&router_only));
    }
}
