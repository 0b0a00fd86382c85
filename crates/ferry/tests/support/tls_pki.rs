//! Certificates for the TLS tests, made by the tests (rcgen): a CA, and a
//! server and a client pair it signed, in the directory layout nbdkit,
//! qemu and libnbd share; and a client pair another CA signed.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry::tls::{Security, TlsConfig};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// A directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(super::unique_name(tag));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

fn leaf(
    issuer: &CertifiedIssuer<'static, KeyPair>,
    names: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let mut params = CertificateParams::new(names).unwrap();
    params.distinguished_name.push(DnType::CommonName, "ferry test");
    params.extended_key_usages = vec![usage];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

/// A CA and both pairs in `dir`; the server's certificate names `hosts`.
pub fn write_pki(dir: &Path, hosts: &[&str]) {
    let ca = ca("ferry test CA");
    write(dir, "ca-cert.pem", &ca.pem());
    let (cert, key) = leaf(&ca, hosts, ExtendedKeyUsagePurpose::ServerAuth);
    write(dir, "server-cert.pem", &cert);
    write(dir, "server-key.pem", &key);
    let (cert, key) = leaf(&ca, &["ferry-client"], ExtendedKeyUsagePurpose::ClientAuth);
    write(dir, "client-cert.pem", &cert);
    write(dir, "client-key.pem", &key);
}

/// In `dir`: the CA certificate of `trusted` (so the server is believed)
/// and a client pair that another CA signed.
pub fn write_foreign_client(dir: &Path, trusted: &Path) {
    std::fs::copy(trusted.join("ca-cert.pem"), dir.join("ca-cert.pem")).unwrap();
    let other = ca("another CA");
    let (cert, key) = leaf(&other, &["ferry-client"], ExtendedKeyUsagePurpose::ClientAuth);
    write(dir, "client-cert.pem", &cert);
    write(dir, "client-key.pem", &key);
}

/// A test PKI on disk and its configuration for 127.0.0.1.
pub struct Pki {
    pub dir: TempDir,
    pub config: Arc<TlsConfig>,
}

impl Pki {
    pub fn new() -> Pki {
        let dir = TempDir::new("tls");
        write_pki(&dir.0, &["localhost", "127.0.0.1", "::1"]);
        let config = Arc::new(TlsConfig::from_dir(&dir.0, "127.0.0.1").expect("the test PKI loads"));
        Pki { dir, config }
    }

    pub fn security(&self) -> Security {
        Security::Tls(self.config.clone())
    }

    pub fn options(&self) -> ferry::NetOptions {
        ferry::NetOptions::default().with_security(self.security())
    }
}

/// A client configuration that trusts `pki`'s CA and presents no
/// certificate.
pub fn client_without_certificate(pki: &Pki) -> Arc<TlsConfig> {
    use ferry::tls::rustls;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(pki.dir.0.join("ca-cert.pem")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Arc::new(TlsConfig::from_rustls(None, Some(Arc::new(config)), "127.0.0.1").unwrap())
}
