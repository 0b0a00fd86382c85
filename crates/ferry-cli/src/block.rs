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
use std::sync::Arc;

use clap::{Args, Subcommand};
use ferry::{Endpoint, NetOptions};

use ferry_block::{open_store, parse_size, Listen, NbdServer, NbdTls, ServerConfig, StoreSpec};

use crate::tls_args::{Side, TlsFlags, TlsMode};
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

/// How the NBD server uses TLS, from the flags every command shares:
/// none without certificates, offered beside plain text with `--tls=on`
/// (NBD clients negotiate it with NBD_OPT_STARTTLS), required with
/// `--tls=require`. Ferry's own protocol has no negotiation: with
/// certificates its clients always use TLS.
fn nbd_tls(flags: &TlsFlags) -> Result<NbdTls, CliError> {
    // The server's name is only checked by clients: any valid one will do.
    Ok(match flags.config(Side::Accept, "localhost")? {
        None => NbdTls::Off,
        Some(c) if flags.tls == TlsMode::Require => NbdTls::Require(c),
        Some(c) => NbdTls::On(c),
    })
}

/// Refuse an NBD listening address off the loopback where clients could
/// use the store in plain text (TLS off or only offered), unless
/// `--insecure` says so on purpose.
fn check_nbd_listen(flags: &TlsFlags, tls: &NbdTls, listen: &Listen, addr: SocketAddr) -> Result<(), CliError> {
    let plain = !matches!(tls, NbdTls::Require(_));
    if plain && !flags.insecure && !addr.ip().to_canonical().is_loopback() {
        return Err(CliError::Usage(format!(
            "--nbd {listen}: not a loopback address, and NBD clients could use the store in plain text there \
             while the network sees every byte; give --tls=require --tls-certificates DIR, \
             or --insecure (without certificates) on a network you trust"
        )));
    }
    Ok(())
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
    let nbd_tls = nbd_tls(&a.tls)?;
    for listen in &a.nbd {
        if let Listen::Tcp(addr) = listen {
            check_nbd_listen(&a.tls, &nbd_tls, listen, *addr)?;
        }
    }
    let mut ferry_eps = Vec::new();
    for at in &a.ferry {
        let ep = match tcp_parts(at) {
            Some((_, addr)) => {
                FerryEndpoint::Tcp(addr, a.tls.net_options(Side::Accept, &format!("--ferry {at}"), "", addr)?)
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
    let tls_note = match &config.tls {
        NbdTls::Off => "",
        NbdTls::On(_) => " (TLS for NBD clients that ask; Ferry clients: TLS)",
        NbdTls::Require(_) => " (TLS required)",
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
    let endpoint = |flag: &str, spec: &str| -> Result<Endpoint, CliError> {
        match tcp_parts(spec) {
            Some((_, addr)) => Ok(Endpoint::tcp_with(
                addr,
                a.tls.net_options(Side::Connect, &format!("{flag} {spec}"), &server_host, addr)?,
            )),
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
