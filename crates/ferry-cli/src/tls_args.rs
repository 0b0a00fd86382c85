//! The TLS flags of every command that listens or connects over TCP
//! (`--tls`, `--tls-certificates`, `--insecure`), spelled as nbdkit and
//! qemu-nbd spell them, and the one place that turns them into the
//! library's [`Security`] and [`NetOptions`]: flatten [`TlsFlags`] into a
//! command's arguments and ask it for each address the command binds or
//! connects to.
//!
//! The rules, for every command alike:
//!
//! * `--tls=off`: plain TCP. `--tls=on` (the default): TLS when
//!   `--tls-certificates` is given, plain TCP when not (Ferry's own
//!   protocols have no negotiation, so "TLS if the peer offers it" becomes
//!   "TLS if this side has certificates", and both sides must agree).
//!   `--tls=require`: TLS or nothing, certificates required.
//! * Plain TCP on an address that is not a loopback address needs
//!   `--insecure`; without it the command stops with a usage error naming
//!   `--tls-certificates` and `--insecure`.
//! * A contradiction (`--tls=require` without certificates, `--tls=off`
//!   with them, `--insecure` with TLS) or a certificate directory missing a
//!   file the command needs is a usage error (exit 2), one line naming the
//!   flag and the file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use ferry::tls::{Security, TlsConfig};
use ferry::NetOptions;

use crate::CliError;

/// `--tls`: whether connections use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum TlsMode {
    /// Plain TCP, even with --tls-certificates.
    Off,
    /// TLS when --tls-certificates is given, plain TCP when not.
    #[default]
    On,
    /// TLS only: --tls-certificates is required.
    Require,
}

impl TlsMode {
    /// The spelling on the command line.
    pub fn name(self) -> &'static str {
        match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        }
    }
}

/// Which end of a connection this command is: the one that presents the
/// server certificate or the one that presents the client certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Listens and accepts: needs `server-cert.pem` and `server-key.pem`.
    Accept,
    /// Connects: needs `client-cert.pem` and `client-key.pem`.
    Connect,
}

/// The TLS flags, flattened into each command that listens or connects
/// over TCP.
#[derive(Debug, Clone, Default, Args)]
pub struct TlsFlags {
    /// TLS on TCP connections: off (plain TCP), on (TLS when
    /// --tls-certificates is given, plain TCP when not; both sides must
    /// choose alike, there is no negotiation), require (TLS only; needs
    /// --tls-certificates).
    #[arg(long, value_enum, value_name = "off|on|require", default_value_t = TlsMode::On)]
    pub tls: TlsMode,
    /// Directory of TLS 1.3 certificates in the layout nbdkit, qemu and
    /// libnbd share: ca-cert.pem (the CA that signs the peer), and
    /// server-cert.pem with server-key.pem to listen, client-cert.pem with
    /// client-key.pem to connect. Both sides authenticate each other.
    /// `ferry tls gen DIR` writes a set for testing.
    #[arg(long, value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,
    /// Allow plain TCP on an address that is not a loopback address
    /// (anyone on the network can read and change every byte). Without
    /// TLS, only loopback addresses are allowed unless this is given.
    #[arg(long)]
    pub insecure: bool,
}

/// The host part of `HOST:PORT` (`[::1]:7000` gives `::1`): the name a
/// server's certificate must carry.
pub fn host_of(hostport: &str) -> &str {
    let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}

impl TlsFlags {
    /// Whether the flags are all at their defaults (no TLS asked for).
    pub fn is_default(&self) -> bool {
        self.tls == TlsMode::On && self.tls_certificates.is_none() && !self.insecure
    }

    /// Whether connections use TLS; a usage error for flags that
    /// contradict each other.
    pub fn uses_tls(&self) -> Result<bool, CliError> {
        match (self.tls, &self.tls_certificates) {
            (TlsMode::Require, None) => Err(CliError::Usage(
                "--tls=require needs certificates; give --tls-certificates DIR (`ferry tls gen DIR` writes a set for testing)"
                    .into(),
            )),
            (TlsMode::Off, Some(dir)) => Err(CliError::Usage(format!(
                "--tls-certificates {}: not used with --tls=off; drop one of them",
                dir.display()
            ))),
            (_, Some(dir)) if self.insecure => Err(CliError::Usage(format!(
                "--insecure allows plain TCP, but --tls-certificates {} makes the connection TLS; drop one of them",
                dir.display()
            ))),
            (TlsMode::Off, None) => Ok(false),
            (_, Some(_)) => Ok(true),
            (TlsMode::On, None) => Ok(false),
        }
    }

    /// The TLS configuration for `side`, checking the server certificate
    /// against `server_name` when connecting; `None` without TLS. A file
    /// missing or unusable is a usage error naming the flag and the file.
    pub fn config(&self, side: Side, server_name: &str) -> Result<Option<Arc<TlsConfig>>, CliError> {
        if !self.uses_tls()? {
            return Ok(None);
        }
        let Some(dir) = &self.tls_certificates else { return Ok(None) };
        let bad = |e: ferry::Error| CliError::Usage(format!("--tls-certificates {}: {}", dir.display(), why(&e)));
        let config = TlsConfig::from_dir(dir, server_name).map_err(bad)?;
        match side {
            Side::Accept => config.server_config().map(drop).map_err(bad)?,
            Side::Connect => config.client_config().map(drop).map_err(bad)?,
        }
        Ok(Some(Arc::new(config)))
    }

    /// What protects a connection `place` (as written on the command
    /// line, for the message) binds or connects to at `addrs`, as `side`,
    /// reaching the server by the name `host`. Plain TCP off the loopback
    /// without `--insecure` is a usage error.
    pub fn security(&self, side: Side, place: &str, host: &str, addrs: &[SocketAddr]) -> Result<Security, CliError> {
        // A listener's certificate is not checked against a name.
        let name = if side == Side::Accept || host.is_empty() { "localhost" } else { host };
        if let Some(config) = self.config(side, name)? {
            return Ok(Security::Tls(config));
        }
        if self.insecure {
            return Ok(Security::None);
        }
        if let Some(a) = addrs.iter().find(|a| Security::LoopbackOnly.check_address(**a).is_err()) {
            return Err(CliError::Usage(format!(
                "{place}: {} is not a loopback address, and plain TCP there lets anyone on the network read and change \
                 every byte; give --tls-certificates DIR for TLS, or --insecure for plain TCP all the same",
                a.ip().to_canonical()
            )));
        }
        Ok(Security::LoopbackOnly)
    }

    /// The library's options for a channel or session at `addr` (see
    /// [`TlsFlags::security`]).
    pub fn net_options(&self, side: Side, place: &str, host: &str, addr: SocketAddr) -> Result<NetOptions, CliError> {
        Ok(NetOptions::default().with_security(self.security(side, place, host, &[addr])?))
    }

    /// The same flags for a child process this command starts.
    pub fn forward(&self) -> Vec<String> {
        let mut args = vec![format!("--tls={}", self.tls.name())];
        if let Some(dir) = &self.tls_certificates {
            args.extend(["--tls-certificates".to_string(), dir.display().to_string()]);
        }
        if self.insecure {
            args.push("--insecure".into());
        }
        args
    }
}

/// A TLS configuration error without the library's prefix.
fn why(e: &ferry::Error) -> String {
    match e.kind() {
        ferry::ErrorKind::TlsConfig(c) => c.to_string(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(tls: TlsMode, dir: Option<&str>, insecure: bool) -> TlsFlags {
        TlsFlags { tls, tls_certificates: dir.map(PathBuf::from), insecure }
    }

    #[test]
    fn hosts() {
        assert_eq!(host_of("example.org:7000"), "example.org");
        assert_eq!(host_of("[::1]:7000"), "::1");
        assert_eq!(host_of("10.0.0.1:1"), "10.0.0.1");
    }

    #[test]
    fn contradictions_are_usage_errors() {
        let usage = |f: TlsFlags| matches!(f.uses_tls(), Err(CliError::Usage(_)));
        assert!(usage(flags(TlsMode::Require, None, false)));
        assert!(usage(flags(TlsMode::Off, Some("/x"), false)));
        assert!(usage(flags(TlsMode::On, Some("/x"), true)));
        assert!(usage(flags(TlsMode::Require, Some("/x"), true)));
        assert!(!flags(TlsMode::On, None, false).uses_tls().unwrap());
        assert!(!flags(TlsMode::Off, None, true).uses_tls().unwrap());
        assert!(flags(TlsMode::Require, Some("/x"), false).uses_tls().unwrap());
    }

    #[test]
    fn plain_tcp_off_the_loopback_needs_insecure() {
        let far: SocketAddr = "192.0.2.1:7000".parse().unwrap();
        let near: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let plain = TlsFlags::default();
        assert_eq!(plain.security(Side::Connect, "tcp:x", "x", &[near]).unwrap(), Security::LoopbackOnly);
        match plain.security(Side::Connect, "tcp:192.0.2.1:7000", "192.0.2.1", &[far]) {
            Err(CliError::Usage(m)) => assert!(m.contains("--insecure") && m.contains("--tls-certificates"), "{m}"),
            other => panic!("{other:?}"),
        }
        let insecure = flags(TlsMode::Off, None, true);
        assert_eq!(insecure.security(Side::Accept, "tcp:x", "x", &[far]).unwrap(), Security::None);
    }

    #[test]
    fn forwarded_flags_parse_back() {
        let f = flags(TlsMode::Require, Some("/etc/ferry tls"), false);
        assert_eq!(f.forward(), ["--tls=require", "--tls-certificates", "/etc/ferry tls"]);
    }
}
