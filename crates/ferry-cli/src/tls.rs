//! `ferry tls gen DIR`: a CA and server and client certificates for
//! testing, in the directory layout nbdkit, qemu and libnbd share
//! (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`, `client-cert.pem`,
//! `client-key.pem`), so one directory serves Ferry and those tools alike.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use ferry::tls::{TlsConfig, CA_CERT, CLIENT_CERT, CLIENT_KEY, SERVER_CERT, SERVER_KEY};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

use crate::CliError;

#[derive(Debug, Args)]
pub struct TlsArgs {
    #[command(subcommand)]
    command: TlsCommand,
}

#[derive(Debug, Subcommand)]
enum TlsCommand {
    /// Write a new CA and a server and a client certificate it signed into
    /// DIR (keys readable by their owner only). For testing: the CA's key
    /// is not kept, so nothing more can be signed with it.
    Gen(GenArgs),
}

#[derive(Debug, Args)]
pub struct GenArgs {
    /// The directory to write (made if missing; existing files of the
    /// layout are not overwritten without --force).
    dir: PathBuf,
    /// A name the server's certificate carries: a DNS name or an IP
    /// address, as clients connect to it (repeat for more). Default:
    /// localhost, 127.0.0.1 and ::1.
    #[arg(long = "host", value_name = "NAME")]
    hosts: Vec<String>,
    /// Replace the files of the layout that are there.
    #[arg(long)]
    force: bool,
}

pub fn run(args: &TlsArgs) -> Result<(), CliError> {
    match &args.command {
        TlsCommand::Gen(g) => {
            let hosts = if g.hosts.is_empty() {
                vec!["localhost".to_owned(), "127.0.0.1".to_owned(), "::1".to_owned()]
            } else {
                g.hosts.clone()
            };
            generate(&g.dir, &hosts, g.force)?;
            println!(
                "wrote {CA_CERT}, {SERVER_CERT}, {SERVER_KEY}, {CLIENT_CERT} and {CLIENT_KEY} to {} (server names: {})",
                g.dir.display(),
                hosts.join(", ")
            );
            Ok(())
        }
    }
}

fn failed(what: impl std::fmt::Display) -> CliError {
    CliError::Failed(format!("cannot make the certificates: {what}; check the names given with --host"))
}

fn ca() -> Result<CertifiedIssuer<'static, KeyPair>, CliError> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(failed)?;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.distinguished_name.push(DnType::CommonName, "Ferry test CA");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    CertifiedIssuer::self_signed(params, KeyPair::generate().map_err(failed)?).map_err(failed)
}

/// A certificate and key the CA signed: (certificate PEM, key PEM).
fn leaf(
    ca: &CertifiedIssuer<'static, KeyPair>,
    common_name: &str,
    names: &[String],
    usage: ExtendedKeyUsagePurpose,
) -> Result<(String, String), CliError> {
    let mut params = CertificateParams::new(names.to_vec()).map_err(failed)?;
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.extended_key_usages = vec![usage];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let key = KeyPair::generate().map_err(failed)?;
    let cert = params.signed_by(&key, ca).map_err(failed)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Write a CA, a server pair for `hosts` and a client pair into `dir`,
/// then load them back as Ferry will.
pub fn generate(dir: &Path, hosts: &[String], force: bool) -> Result<(), CliError> {
    let Some(first) = hosts.first() else { return Err(failed("no server name")) };
    let files = [CA_CERT, SERVER_CERT, SERVER_KEY, CLIENT_CERT, CLIENT_KEY];
    if !force {
        if let Some(f) = files.iter().find(|f| dir.join(f).exists()) {
            return Err(CliError::Failed(format!(
                "{} exists already; give another directory, or --force to replace the set",
                dir.join(f).display()
            )));
        }
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| CliError::Failed(format!("cannot make {}: {e}; check the path and permissions", dir.display())))?;
    let ca = ca()?;
    let (server_cert, server_key) = leaf(&ca, first, hosts, ExtendedKeyUsagePurpose::ServerAuth)?;
    let (client_cert, client_key) = leaf(&ca, "ferry client", &[], ExtendedKeyUsagePurpose::ClientAuth)?;
    let write = |name: &str, text: &str, mode: u32| -> Result<(), CliError> {
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| CliError::Failed(format!("cannot write {}: {e}; check the permissions", path.display())))
    };
    write(CA_CERT, &ca.pem(), 0o644)?;
    write(SERVER_CERT, &server_cert, 0o644)?;
    write(SERVER_KEY, &server_key, 0o600)?;
    write(CLIENT_CERT, &client_cert, 0o644)?;
    write(CLIENT_KEY, &client_key, 0o600)?;
    TlsConfig::from_dir(dir, first)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn gen_writes_a_set_ferry_loads_with_private_keys() {
        let dir = std::env::temp_dir().join(format!("ferry-tls-gen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        generate(&dir, &["localhost".into(), "10.1.2.3".into()], false).unwrap();
        for (f, mode) in [(CA_CERT, 0o644), (SERVER_KEY, 0o600), (CLIENT_KEY, 0o600)] {
            let m = std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777;
            assert_eq!(m, mode, "{f}");
        }
        let config = TlsConfig::from_dir(&dir, "10.1.2.3").unwrap();
        assert!(config.can_accept() && config.can_connect());
        // A second run does not overwrite the set unless told to.
        assert!(generate(&dir, &["localhost".into()], false).is_err());
        generate(&dir, &["localhost".into()], true).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
