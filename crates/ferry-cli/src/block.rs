//! `ferry block`: Ferry's network block service on the command line.
//!
//! `ferry block serve --store mem:1G --nbd tcp:127.0.0.1:10809` serves a
//! store to NBD clients; it prints where it listens and one line per
//! client when the client disconnects, and serves until it is stopped.
//!
//! `--tls=off|on|require` and `--tls-certificates DIR` mean what they mean
//! to nbdkit and qemu-nbd: NBD clients start TLS with `NBD_OPT_STARTTLS`
//! (libnbd: `nbds://HOST:PORT/?tls-certificates=DIR`; qemu: a
//! `tls-creds-x509` object), DIR holds `ca-cert.pem`, `server-cert.pem`
//! and `server-key.pem` (and, for `ferry block proxy`, `client-cert.pem`
//! and `client-key.pem`), and `ferry tls gen DIR` writes such a directory
//! for testing. Off the loopback, plain text needs `--insecure`.
//!
//! `ferry block bench` measures the block service's throughput by request
//! size: through Ferry channels ([`ferry_block::BlockClient`] between
//! threads, over shm, over TCP) and through NBD over TCP loopback, against
//! nbdkit's memory plugin driven by the same client.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Subcommand, ValueEnum};
use ferry::tls::{Security, TlsConfig};
use ferry::{Endpoint, NetOptions};
use ferry_block::{open_store, parse_size, Listen, NbdServer, NbdTls, ServerConfig, StoreSpec};

use crate::CliError;

mod bench;
use bench::BenchArgs;

#[derive(Debug, Args)]
pub struct BlockArgs {
    #[command(subcommand)]
    command: BlockCommand,
}

#[derive(Debug, Subcommand)]
enum BlockCommand {
    /// Serve a store to NBD clients (qemu-img, nbdcopy, nbdinfo, fio, the
    /// Linux nbd driver) until stopped.
    Serve(ServeArgs),
    /// Throughput of the block service by request size (writes, then reads
    /// of what was written), through Ferry channels or NBD.
    Bench(BenchArgs),
    /// The client proxy: user domains on this host connect over shared
    /// memory, their requests go on over one channel to a remote
    /// `ferry block serve --ferry tcp:HOST:PORT`.
    Proxy(ProxyArgs),
}

#[derive(Debug, Args)]
struct ProxyArgs {
    /// Where user domains connect: `shm:PATH` or `shm@NAME`.
    #[arg(long, value_parser = crate::echo::endpoint_arg)]
    listen: String,
    /// The server's Ferry endpoint: `tcp:HOST:PORT`.
    #[arg(long, value_parser = crate::echo::endpoint_arg)]
    server: String,
    #[command(flatten)]
    tls: TlsFlags,
}

/// When TLS is used (nbdkit's and qemu-nbd's `--tls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TlsMode {
    /// No TLS (NBD clients that ask for it are refused).
    Off,
    /// TLS for NBD clients that ask for it, plain text for the others
    /// (Ferry's own protocol: TLS for every client).
    On,
    /// TLS only: an NBD client gets the export only after NBD_OPT_STARTTLS.
    Require,
}

/// The TLS flags of `block serve` and `block proxy`.
#[derive(Debug, Args)]
struct TlsFlags {
    /// TLS: off, on or require, as nbdkit and qemu-nbd mean them. Default
    /// off; a listening or server address off the loopback needs require
    /// (or --insecure).
    #[arg(long, value_enum, value_name = "MODE")]
    tls: Option<TlsMode>,
    /// The certificates and keys: ca-cert.pem, and server-cert.pem and
    /// server-key.pem to serve or client-cert.pem and client-key.pem to
    /// connect (the layout nbdkit, qemu and libnbd share; `ferry tls gen
    /// DIR` writes one for testing).
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Plain text off the loopback, chosen on purpose: anyone who reaches
    /// the port may use the store, and the network sees every byte.
    #[arg(long)]
    insecure: bool,
}

impl TlsFlags {
    fn mode(&self) -> TlsMode {
        self.tls.unwrap_or(TlsMode::Off)
    }

    /// The TLS configuration for `--tls=on|require` (checking the server
    /// by `server_name` when connecting); `None` for off.
    fn config(&self, server_name: &str) -> Result<Option<Arc<TlsConfig>>, CliError> {
        match (self.mode(), &self.tls_certificates) {
            (TlsMode::Off, None) => Ok(None),
            (TlsMode::Off, Some(_)) => {
                Err(CliError::Usage("--tls-certificates is used with --tls=on or --tls=require; give one".into()))
            }
            (mode, None) => Err(CliError::Usage(format!(
                "--tls={} needs --tls-certificates DIR (`ferry tls gen DIR` writes one for testing)",
                if mode == TlsMode::On { "on" } else { "require" }
            ))),
            (_, Some(dir)) => TlsConfig::from_dir(dir, server_name)
                .map(|c| Some(Arc::new(c)))
                .map_err(|e| CliError::Usage(format!("--tls-certificates {}: {e}", dir.display()))),
        }
    }

    /// Refuse plain text at `addr` off the loopback without --insecure
    /// (`plain`: how plain text would be used, for the message).
    fn check_plain(&self, flag: &str, spec: &str, addr: SocketAddr, plain: bool) -> Result<(), CliError> {
        if plain && !self.insecure && !addr.ip().to_canonical().is_loopback() {
            return Err(CliError::Usage(format!(
                "{flag} {spec}: not a loopback address, and without TLS anyone who reaches it may use the store \
                 and the network sees every byte; give --tls=require --tls-certificates DIR, \
                 or --insecure on a network you trust"
            )));
        }
        Ok(())
    }

    /// The security of a Ferry TCP endpoint: TLS for on and require (the
    /// protocol has no plain-text fallback), else plain TCP.
    fn security(&self, tls: &Option<Arc<TlsConfig>>) -> Security {
        match tls {
            Some(c) => Security::Tls(c.clone()),
            None if self.insecure => Security::None,
            None => Security::LoopbackOnly,
        }
    }
}

/// `tcp:HOST:PORT` → (host as written, address); `None` for other endpoints.
fn tcp_parts(spec: &str) -> Option<(String, SocketAddr)> {
    use std::net::ToSocketAddrs;
    let hostport = spec.strip_prefix("tcp:")?;
    let addr = hostport.to_socket_addrs().ok()?.next()?;
    let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
    Some((host.trim_start_matches('[').trim_end_matches(']').to_string(), addr))
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// The blocks: `mem:SIZE` (sparse memory, e.g. mem:1G) or `file:PATH`.
    #[arg(long, value_parser = store_arg)]
    store: StoreSpec,
    /// Where NBD clients connect: `tcp:HOST:PORT` or `unix:PATH` (give it
    /// more than once to listen at several places).
    #[arg(long, required_unless_present = "ferry", value_parser = listen_arg)]
    nbd: Vec<Listen>,
    /// Where clients of Ferry's own block protocol (`ferry_block::BlockClient`)
    /// connect: `shm:PATH`, `shm@NAME` (local) or `tcp:HOST:PORT` (remote).
    #[arg(long, value_parser = crate::echo::endpoint_arg)]
    ferry: Vec<String>,
    /// Size of a file store: the file is created with it or extended to it
    /// (e.g. 64M, 10G).
    #[arg(long, value_parser = size_arg)]
    size: Option<u64>,
    /// Open a file store with O_DIRECT as well, for requests aligned to 4096 bytes.
    #[arg(long)]
    direct: bool,
    /// Refuse writes.
    #[arg(long)]
    read_only: bool,
    /// Keep connection threads under the normal scheduling policy instead
    /// of SCHED_BATCH (a woken batch thread does not preempt the one running,
    /// which speeds up bulk transfers to clients on the same machine).
    #[arg(long)]
    no_batch_threads: bool,
    /// The export's name (the default export is "").
    #[arg(long, default_value = "", value_parser = export_arg)]
    export: String,
    /// Most NBD connections served at once, per --nbd address. A client that
    /// comes at the limit closes the oldest connection still in its
    /// handshake; with every one past it, the client is refused.
    #[arg(long, default_value_t = ferry_block::DEFAULT_MAX_CONNECTIONS, value_parser = connections_arg)]
    max_connections: usize,
    /// Seconds an NBD client has from connecting to the end of its
    /// handshake before its connection is closed (e.g. 10, 0.5).
    #[arg(long, default_value = "10", value_parser = seconds_arg)]
    handshake_timeout: std::time::Duration,
    #[command(flatten)]
    tls: TlsFlags,
}

fn store_arg(s: &str) -> Result<StoreSpec, String> {
    s.parse::<StoreSpec>().map_err(|e| match e {
        ferry_block::Error::BadSpec(m) => m.strip_prefix(&format!("{s}: ")).unwrap_or(&m).to_string(),
        other => other.to_string(),
    })
}

fn listen_arg(s: &str) -> Result<Listen, String> {
    s.parse::<Listen>().map_err(|e| {
        let m = e.to_string();
        m.strip_prefix(&format!("{s}: ")).unwrap_or(&m).to_string()
    })
}

fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s)
}

fn connections_arg(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("give a whole number of connections, at least 1".into()),
    }
}

fn seconds_arg(s: &str) -> Result<std::time::Duration, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 86_400.0 => Ok(std::time::Duration::from_secs_f64(x)),
        _ => Err("give a number of seconds above 0, at most 86400 (e.g. 10 or 0.5)".into()),
    }
}

fn export_arg(s: &str) -> Result<String, String> {
    if s.len() > 4096 || s.contains('\0') {
        return Err("an export name is at most 4096 bytes of text".into());
    }
    Ok(s.to_string())
}

pub fn run(args: &BlockArgs) -> Result<(), CliError> {
    match &args.command {
        BlockCommand::Serve(a) => serve(a),
        BlockCommand::Bench(a) => bench::run(a),
        BlockCommand::Proxy(a) => proxy(a),
    }
}

fn setup_error(e: ferry_block::Error) -> CliError {
    match e {
        ferry_block::Error::BadSpec(m) => CliError::Usage(m),
        ferry_block::Error::Io { what, source } if source.kind() == std::io::ErrorKind::AddrInUse => {
            CliError::Failed(format!("{what}: a server listens there already; stop it or give another address"))
        }
        other => CliError::Failed(other.to_string()),
    }
}

fn serve(a: &ServeArgs) -> Result<(), CliError> {
    if matches!(a.store, StoreSpec::Memory { .. }) && a.size.is_some() {
        return Err(CliError::Usage("--size is for file stores; a memory store takes its size from mem:SIZE".into()));
    }
    // The server's name is only checked by clients: any valid one will do.
    let tls = a.tls.config("localhost")?;
    if let (Some(c), Some(dir)) = (&tls, &a.tls.tls_certificates) {
        if !c.can_accept() {
            return Err(CliError::Usage(format!(
                "--tls-certificates {}: no server-cert.pem and server-key.pem there, which a server needs",
                dir.display()
            )));
        }
    }
    let nbd_tls = match (a.tls.mode(), &tls) {
        (TlsMode::On, Some(c)) => NbdTls::On(c.clone()),
        (TlsMode::Require, Some(c)) => NbdTls::Require(c.clone()),
        _ => NbdTls::Off,
    };
    for listen in &a.nbd {
        if let Listen::Tcp(addr) = listen {
            a.tls.check_plain("--nbd", &listen.to_string(), *addr, a.tls.mode() != TlsMode::Require)?;
        }
    }
    let mut ferry_eps = Vec::new();
    for at in &a.ferry {
        let ep = match tcp_parts(at) {
            Some((_, addr)) => {
                a.tls.check_plain("--ferry", at, addr, tls.is_none())?;
                FerryEndpoint::Tcp(addr, NetOptions::default().with_security(a.tls.security(&tls)))
            }
            None => FerryEndpoint::Local(
                crate::echo::parse_endpoint(at).map_err(|m| CliError::Usage(format!("--ferry {at}: {m}")))?,
            ),
        };
        ferry_eps.push((at.clone(), ep));
    }
    let store = open_store(&a.store, a.size, a.direct).map_err(setup_error)?;
    let description = store.describe();
    let store: Arc<dyn ferry_block::Store> = Arc::from(store);
    let config = ServerConfig {
        export_name: a.export.clone(),
        description: format!("Ferry block store: {description}"),
        read_only: a.read_only,
        batch_threads: !a.no_batch_threads,
        max_connections: a.max_connections,
        handshake_timeout: a.handshake_timeout,
        tls: nbd_tls,
        insecure: a.tls.insecure,
        ..ServerConfig::default()
    };
    let mut servers = Vec::new();
    for listen in &a.nbd {
        servers.push(NbdServer::bind(listen, store.clone(), config.clone()).map_err(setup_error)?);
    }
    println!(
        "ferry block: serving {description} as export {:?}{}",
        a.export,
        if a.read_only { ", read-only" } else { "" }
    );
    let tls_note = match a.tls.mode() {
        TlsMode::Off => "",
        TlsMode::On => " (TLS for NBD clients that ask; Ferry clients: TLS)",
        TlsMode::Require => " (TLS required)",
    };
    for s in &servers {
        println!("listening for NBD clients on {}{tls_note}", s.local_addr());
    }
    for at in &a.ferry {
        println!("listening for Ferry clients on {at}{}", if tcp_parts(at).is_some() { tls_note } else { "" });
    }
    let mut handles = Vec::new();
    for (at, ep) in ferry_eps {
        let store = store.clone();
        let h = std::thread::Builder::new()
            .name(format!("ferry accept {at}"))
            .spawn(move || serve_ferry(&ep, &at, store))
            .map_err(|e| CliError::Failed(format!("cannot start a thread: {e}")))?;
        handles.push(h);
    }
    for s in servers {
        let h = s
            .spawn(|client| say(&client.to_string()))
            .map_err(|e| CliError::Failed(format!("cannot start a thread: {e}")))?;
        handles.push(h);
    }
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(CliError::Failed(e.to_string())),
            Err(_) => return Err(CliError::Failed("the accepting thread stopped".into())),
        }
    }
    Ok(())
}

/// Where clients of Ferry's block protocol connect.
enum FerryEndpoint {
    /// Shared memory.
    Local(Endpoint),
    /// TCP, with the options of its request and read-data channels.
    Tcp(SocketAddr, NetOptions),
}

/// Serve the clients of Ferry's block protocol on `ep` until the process
/// ends, all from one thread (an event loop over their channels); one line
/// per client when it goes.
fn serve_ferry(ep: &FerryEndpoint, at: &str, store: Arc<dyn ferry_block::Store>) -> Result<(), ferry_block::Error> {
    let domain = ferry::Domain::new("block server");
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut gone = |r: &ferry_block::ClientReport| {
        let s = &r.summary;
        match &r.error {
            None => say(&format!(
                "ferry client {at}#{} disconnected after {:.3} s: {} requests, {:.1} MiB read, {:.1} MiB written, {} errors",
                r.number,
                r.connected.as_secs_f64(),
                s.requests,
                mib(s.read_bytes),
                mib(s.write_bytes),
                s.errors
            )),
            Some(e) => say(&format!("ferry client {at}#{} dropped after {:.3} s: {e}", r.number, r.connected.as_secs_f64())),
        }
    };
    match ep {
        FerryEndpoint::Local(ep) => ferry_block::serve_endpoint(&domain, ep, &*store, &|| false, &mut gone),
        FerryEndpoint::Tcp(addr, options) => {
            ferry_block::serve_tcp(&domain, *addr, options.clone(), &*store, &|| false, &mut gone)
        }
    }
    .map_err(|e| ferry_block::Error::Protocol(format!("cannot listen for Ferry clients on {at}: {e}")))
}

/// One line on stdout; a reader that went away does not stop the server.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{line}");
}

fn proxy(a: &ProxyArgs) -> Result<(), CliError> {
    let server_host = tcp_parts(&a.server).map_or_else(|| "localhost".to_string(), |(host, _)| host);
    let tls = a.tls.config(&server_host)?;
    if let (Some(c), Some(dir)) = (&tls, &a.tls.tls_certificates) {
        if !c.can_connect() {
            return Err(CliError::Usage(format!(
                "--tls-certificates {}: no client-cert.pem and client-key.pem there, which the proxy needs",
                dir.display()
            )));
        }
    }
    let endpoint = |flag: &str, spec: &str| -> Result<Endpoint, CliError> {
        match tcp_parts(spec) {
            Some((_, addr)) => {
                a.tls.check_plain(flag, spec, addr, tls.is_none())?;
                Ok(Endpoint::tcp_with(addr, NetOptions::default().with_security(a.tls.security(&tls))))
            }
            None => crate::echo::parse_endpoint(spec).map_err(|m| CliError::Usage(format!("{flag} {spec}: {m}"))),
        }
    };
    let local = endpoint("--listen", &a.listen)?;
    let remote = endpoint("--server", &a.server)?;
    let domain = ferry::Domain::new("block proxy");
    say(&format!("ferry block proxy: user domains connect on {}; forwarding to {}", a.listen, a.server));
    ferry_block::run_proxy(&domain, &local, &remote, std::time::Duration::from_secs(30), || false)
        .map_err(|e| CliError::Failed(format!("the proxy stopped: {e}")))
}
