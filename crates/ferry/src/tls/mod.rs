//! TLS 1.3 for channels and sessions between machines: who may connect,
//! and what a network in between can see or change.
//!
//! A [`TlsConfig`] holds certificates and keys for mutual X.509
//! authentication: the side that accepts connections (the creator of a TCP
//! channel, the side that accepts a [`MuxSession`](crate::MuxSession))
//! presents the server certificate and takes only clients whose
//! certificate the CA signed; the side that connects presents the client
//! certificate and takes only a server whose certificate the CA signed for
//! the name it connects to ([`TlsConfig::server_name`]). TLS 1.3 only, with
//! the cipher suites of rustls's `ring` provider (AES-GCM and
//! ChaCha20-Poly1305, X25519 and NIST curves), no session resumption
//! tickets across processes, no 0-RTT data.
//!
//! Give it to an endpoint with [`Security::Tls`] in
//! [`NetOptions`](crate::NetOptions). TLS wraps the whole connection from
//! the first byte after the TCP connect: the setup messages, every frame
//! and every payload. A payload is encrypted from the buffer's memory into
//! TLS records (the one copy encryption needs) and decrypted from the
//! records into the receiving buffer; a record whose authentication fails
//! never reaches a buffer: the channel fails with [`ErrorKind::Tls`] instead.
//!
//! # Files
//!
//! [`TlsConfig::from_dir`] reads the layout that nbdkit, qemu and libnbd
//! share, so one directory serves Ferry and those tools alike:
//!
//! | file | used by |
//! |---|---|
//! | `ca-cert.pem` | both sides: the CA that signs the peer's certificate |
//! | `server-cert.pem`, `server-key.pem` | the accepting side |
//! | `client-cert.pem`, `client-key.pem` | the connecting side |
//!
//! A machine that only accepts needs no client pair, one that only
//! connects no server pair; using the missing one is a
//! [`ErrorKind::TlsConfig`] naming the file. `ferry tls gen DIR` writes a CA
//! and both pairs for testing.
//!
//! # Secure by default across machines
//!
//! [`Security::LoopbackOnly`], the default, is plain TCP and refuses any
//! address that is not a loopback address ([`ErrorKind::InsecureAddress`]):
//! a channel or session that leaves the machine is encrypted and
//! authenticated ([`Security::Tls`]) unless the program says
//! [`Security::None`] on purpose.
//!
//! # Kernel TLS
//!
//! The tested path is TLS in user space: rustls encrypts into its own
//! record buffers and the socket sends those. Where the kernel has kTLS
//! (the `tls` module, `TCP_ULP`), a later version can hand the traffic
//! keys to the kernel after the handshake (rustls's
//! `dangerous_extract_secrets`); the kernel then encrypts while it copies
//! from the buffer's memory, so a payload again goes from the buffer to
//! the socket with no user-space copy, and received records are decrypted
//! into the buffer by `recvmsg`. The frames and their order stay exactly
//! as they are; what changes is who encrypts, and that key updates and
//! alerts arrive as control messages. This machine's kernel has no kTLS,
//! so that path is neither built nor tested.

#[cfg(not(loom))]
mod session;

use crate::ErrorKind;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::error::{Error, Result};

#[cfg(all(test, not(loom)))]
pub(crate) use session::testing;
#[cfg(not(loom))]
pub(crate) use session::{failure, TlsSession};

/// The rustls version Ferry is built with, for programs that build a
/// [`TlsConfig`] from rustls configurations of their own.
pub use rustls;

/// The CA certificate file of the shared layout.
pub const CA_CERT: &str = "ca-cert.pem";
/// The server certificate (chain) file of the shared layout.
pub const SERVER_CERT: &str = "server-cert.pem";
/// The server's private key file of the shared layout.
pub const SERVER_KEY: &str = "server-key.pem";
/// The client certificate (chain) file of the shared layout.
pub const CLIENT_CERT: &str = "client-cert.pem";
/// The client's private key file of the shared layout.
pub const CLIENT_KEY: &str = "client-key.pem";

/// What protects a TCP endpoint or session ([`crate::NetOptions::security`]).
#[derive(Clone, Debug, Default)]
pub enum Security {
    /// Plain TCP, and only between loopback addresses: an endpoint or
    /// session on any other address is refused with
    /// [`ErrorKind::InsecureAddress`]. The default.
    #[default]
    LoopbackOnly,
    /// Plain TCP on any address, chosen on purpose: anyone who reaches the
    /// port may connect, and the network sees and can change every byte.
    None,
    /// TLS 1.3 with mutual certificate authentication.
    Tls(Arc<TlsConfig>),
}

impl PartialEq for Security {
    fn eq(&self, other: &Security) -> bool {
        match (self, other) {
            (Security::LoopbackOnly, Security::LoopbackOnly) | (Security::None, Security::None) => true,
            (Security::Tls(a), Security::Tls(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for Security {}

impl Security {
    /// Whether an endpoint or session at `addr` (the address bound, or the
    /// one connected to) may use this: [`ErrorKind::InsecureAddress`] for plain
    /// TCP by default off the loopback.
    pub fn check_address(&self, addr: SocketAddr) -> Result<()> {
        let ip = addr.ip().to_canonical();
        match self {
            Security::LoopbackOnly if !ip.is_loopback() => Err(ErrorKind::InsecureAddress(ip).into()),
            _ => Ok(()),
        }
    }

    /// The TLS configuration, if any.
    pub fn tls(&self) -> Option<&Arc<TlsConfig>> {
        match self {
            Security::Tls(c) => Some(c),
            _ => None,
        }
    }
}

/// A TLS file (or setting) that cannot be used ([`ErrorKind::TlsConfig`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfigError {
    path: Option<PathBuf>,
    why: String,
}

impl TlsConfigError {
    fn file(path: &Path, why: impl Into<String>) -> Error {
        ErrorKind::TlsConfig(Box::new(TlsConfigError { path: Some(path.to_owned()), why: why.into() })).into()
    }

    fn setting(why: impl Into<String>) -> Error {
        ErrorKind::TlsConfig(Box::new(TlsConfigError { path: None, why: why.into() })).into()
    }

    #[cfg(test)]
    pub(crate) fn for_tests() -> TlsConfigError {
        TlsConfigError { path: Some("/etc/ferry/ca-cert.pem".into()), why: "is missing".into() }
    }

    /// The file at fault, if a file is.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// What is wrong with it.
    pub fn why(&self) -> &str {
        &self.why
    }
}

impl fmt::Display for TlsConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(p) => write!(f, "{}: {}", p.display(), self.why),
            None => f.write_str(&self.why),
        }
    }
}

/// Certificates and keys for TLS on TCP channels and sessions (see the
/// module docs). Cheap to clone; share one with [`Security::Tls`].
#[derive(Clone)]
pub struct TlsConfig {
    /// Where the files came from, for error messages.
    dir: Option<PathBuf>,
    server: Option<Arc<rustls::ServerConfig>>,
    client: Option<Arc<rustls::ClientConfig>>,
    server_name: ServerName<'static>,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("dir", &self.dir)
            .field("accepts", &self.server.is_some())
            .field("connects", &self.client.is_some())
            .field("server_name", &self.server_name)
            .finish()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn parse_name(name: &str) -> Result<ServerName<'static>> {
    ServerName::try_from(name.to_owned()).map_err(|_| {
        TlsConfigError::setting(format!("{name:?} is not a host name or IP address a certificate can name"))
    })
}

/// Read a file of the layout; `None` if it does not exist.
fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TlsConfigError::file(path, format!("cannot be read: {e}"))),
    }
}

fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| TlsConfigError::file(path, format!("is not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(TlsConfigError::file(path, "holds no certificate (no \"BEGIN CERTIFICATE\" section)"));
    }
    Ok(certs)
}

fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            TlsConfigError::file(path, "holds no private key (no \"BEGIN ... PRIVATE KEY\" section)")
        }
        e => TlsConfigError::file(path, format!("is not a valid PEM private key: {e}")),
    })
}

/// A certificate and key pair of the layout: both or neither.
fn pair(dir: &Path, cert: &str, key: &str) -> Result<Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>> {
    let (cert_path, key_path) = (dir.join(cert), dir.join(key));
    match (read_optional(&cert_path)?, read_optional(&key_path)?) {
        (None, None) => Ok(None),
        (Some(c), Some(k)) => Ok(Some((certificates(&cert_path, &c)?, private_key(&key_path, &k)?))),
        (Some(_), None) => Err(TlsConfigError::file(&key_path, format!("is missing, but {cert} is there"))),
        (None, Some(_)) => Err(TlsConfigError::file(&cert_path, format!("is missing, but {key} is there"))),
    }
}

impl TlsConfig {
    /// Read the certificates and keys in `dir` (the layout in the module
    /// docs): `ca-cert.pem` and at least one of the server and client
    /// pairs. The connecting side checks that the server's certificate
    /// names `server_name` (a DNS name or an IP address).
    ///
    /// Errors: [`ErrorKind::TlsConfig`] naming the file that is missing,
    /// unreadable or not what it should be, or a key that does not match
    /// its certificate.
    pub fn from_dir(dir: impl AsRef<Path>, server_name: &str) -> Result<TlsConfig> {
        let dir = dir.as_ref();
        let name = parse_name(server_name)?;
        let ca_path = dir.join(CA_CERT);
        let Some(ca_pem) = read_optional(&ca_path)? else {
            return Err(TlsConfigError::file(&ca_path, "is missing: the CA certificate is needed to check the peer"));
        };
        let mut roots = rustls::RootCertStore::empty();
        for cert in certificates(&ca_path, &ca_pem)? {
            roots
                .add(cert)
                .map_err(|e| TlsConfigError::file(&ca_path, format!("holds a certificate that cannot be a CA: {e}")))?;
        }
        let roots = Arc::new(roots);
        let server = match pair(dir, SERVER_CERT, SERVER_KEY)? {
            None => None,
            Some((certs, key)) => Some(Arc::new(server_config(roots.clone(), certs, key).map_err(|e| {
                TlsConfigError::file(&dir.join(SERVER_CERT), format!("cannot serve with {SERVER_KEY}: {e}"))
            })?)),
        };
        let client = match pair(dir, CLIENT_CERT, CLIENT_KEY)? {
            None => None,
            Some((certs, key)) => Some(Arc::new(client_config(roots, certs, key).map_err(|e| {
                TlsConfigError::file(&dir.join(CLIENT_CERT), format!("cannot connect with {CLIENT_KEY}: {e}"))
            })?)),
        };
        if server.is_none() && client.is_none() {
            return Err(TlsConfigError::file(
                dir,
                format!("holds neither {SERVER_CERT} and {SERVER_KEY} nor {CLIENT_CERT} and {CLIENT_KEY}"),
            ));
        }
        Ok(TlsConfig { dir: Some(dir.to_owned()), server, client, server_name: name })
    }

    /// A configuration from rustls configurations the program built (at
    /// least one of them). They should allow TLS 1.3 only and, for the
    /// server, require client certificates: Ferry takes them as they are.
    pub fn from_rustls(
        server: Option<Arc<rustls::ServerConfig>>,
        client: Option<Arc<rustls::ClientConfig>>,
        server_name: &str,
    ) -> Result<TlsConfig> {
        if server.is_none() && client.is_none() {
            return Err(TlsConfigError::setting("neither a server nor a client configuration was given"));
        }
        Ok(TlsConfig { dir: None, server, client, server_name: parse_name(server_name)? })
    }

    /// The same certificates, for connecting to a server known by another
    /// name.
    pub fn with_server_name(&self, server_name: &str) -> Result<TlsConfig> {
        Ok(TlsConfig { server_name: parse_name(server_name)?, ..self.clone() })
    }

    /// The name the server's certificate must carry.
    pub fn server_name(&self) -> String {
        self.server_name.to_str().into_owned()
    }

    /// Whether this configuration can accept connections (it has the
    /// server pair).
    pub fn can_accept(&self) -> bool {
        self.server.is_some()
    }

    /// Whether this configuration can connect (it has the client pair).
    pub fn can_connect(&self) -> bool {
        self.client.is_some()
    }

    /// The rustls configuration of the accepting side.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>> {
        self.server.clone().ok_or_else(|| self.missing(SERVER_CERT, "accept connections"))
    }

    /// The rustls configuration of the connecting side.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>> {
        self.client.clone().ok_or_else(|| self.missing(CLIENT_CERT, "connect"))
    }

    fn missing(&self, file: &str, to: &str) -> Error {
        match &self.dir {
            Some(dir) => TlsConfigError::file(&dir.join(file), format!("is missing: it is needed to {to} with TLS")),
            None => TlsConfigError::setting(format!("the TLS configuration cannot {to}: it has no {file} pair")),
        }
    }
}

fn server_config(
    roots: Arc<rustls::RootCertStore>,
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> std::result::Result<rustls::ServerConfig, rustls::Error> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider())
        .build()
        .map_err(|e| rustls::Error::General(e.to_string()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)?;
    // Tickets would outlive the connection for nothing: every channel or
    // session is one long connection.
    config.send_tls13_tickets = 0;
    Ok(config)
}

fn client_config(
    roots: Arc<rustls::RootCertStore>,
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> std::result::Result<rustls::ClientConfig, rustls::Error> {
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)?;
    config.resumption = rustls::client::Resumption::disabled();
    Ok(config)
}
