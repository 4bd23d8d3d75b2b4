//! Certificates for the TLS tests, made fresh in a scratch folder: a CA, leaves it signs
//! (valid or expired, with a cluster role or none), and a second CA that nobody trusts.
//! Leaves name `localhost` and 127.0.0.1, and carry both the server and client usages, as
//! the cluster's do.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// A certificate authority writing its files under one folder.
pub struct Pki {
    dir: PathBuf,
    name: String,
    cert: Certificate,
    key: KeyPair,
}

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// How long a leaf is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    /// From 2020 for a very long time.
    Good,
    /// For 2020 only: expired now.
    Expired,
}

impl Pki {
    /// A new CA called `name`, its certificate in `<dir>/<name>-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Self {
        std::fs::create_dir_all(dir).expect("the certificate folder can be made");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} test CA"));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("a CA key");
        let cert = params.self_signed(&key).expect("the CA signs itself");
        let pki = Self {
            dir: dir.to_path_buf(),
            name: name.to_string(),
            cert,
            key,
        };
        std::fs::write(pki.ca(), pki.cert.pem()).expect("the CA certificate is written");
        pki
    }

    /// The CA certificate's file.
    pub fn ca(&self) -> PathBuf {
        self.dir.join(format!("{}-ca.pem", self.name))
    }

    /// A leaf called `name` with no cluster role, signed by this CA, written as
    /// `<name>.pem` and `<name>.key`.
    pub fn leaf(&self, name: &str, validity: Validity) -> Leaf {
        self.leaf_as(None, name, validity)
    }

    /// A leaf called `name` whose URI SAN `spiffe://tandem/<role>` gives it a cluster role
    /// (`router`, `prefill`, `decode`), when `role` is set.
    pub fn leaf_as(&self, role: Option<&str>, name: &str, validity: Validity) -> Leaf {
        let mut params = CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        if let Some(role) = role {
            let uri = format!("spiffe://tandem/{role}");
            params
                .subject_alt_names
                .push(SanType::URI(uri.try_into().expect("an IA5 URI")));
        }
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = match validity {
            Validity::Good => rcgen::date_time_ymd(2100, 1, 1),
            Validity::Expired => rcgen::date_time_ymd(2021, 1, 1),
        };
        let key = KeyPair::generate().expect("a leaf key");
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("the CA signs the leaf");
        let leaf = Leaf {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}.key")),
        };
        std::fs::write(&leaf.cert, cert.pem()).expect("the leaf is written");
        std::fs::write(&leaf.key, key.serialize_pem()).expect("the key is written");
        leaf
    }
}

impl Leaf {
    /// The flags that give a worker or router this identity for mutual TLS under `ca`.
    pub fn mtls_args(&self, ca: &Path) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.cert.display().to_string(),
            "--tls-key".into(),
            self.key.display().to_string(),
            "--tls-ca".into(),
            ca.display().to_string(),
        ]
    }
}

/// A reqwest client that trusts `ca` (and only it), for the router's HTTPS.
pub fn https_client(ca: &Path) -> reqwest::Client {
    let pem = std::fs::read(ca).expect("the CA file reads");
    let cert = reqwest::Certificate::from_pem(&pem).expect("the CA parses");
    reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(cert)
        .build()
        .expect("an HTTPS client")
}
