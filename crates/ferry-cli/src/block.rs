//! `ferry block`: Ferry's network block service on the command line.
//!
//! `ferry block serve --store mem:1G --nbd tcp:127.0.0.1:10809` serves a
//! store to NBD clients; it prints where it listens and one line per
//! client when the client disconnects, and serves until it is stopped.
//!
//! `ferry block bench` measures the block service's throughput by request
//! size: through Ferry channels ([`ferry_block::BlockClient`] between
//! threads, over shm, over TCP) and through NBD over TCP loopback, against
//! nbdkit's memory plugin driven by the same client.

use std::sync::Arc;

use clap::{Args, Subcommand};
use ferry_block::{open_store, parse_size, Listen, NbdServer, ServerConfig, StoreSpec};

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
    for s in &servers {
        println!("listening for NBD clients on {}", s.local_addr());
    }
    for at in &a.ferry {
        println!("listening for Ferry clients on {at}");
    }
    let mut handles = Vec::new();
    for at in &a.ferry {
        let ep = crate::echo::parse_endpoint(at).map_err(|m| CliError::Usage(format!("--ferry {at}: {m}")))?;
        let (store, at) = (store.clone(), at.clone());
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

/// Serve the clients of Ferry's block protocol on `ep` until the process
/// ends, all from one thread (an event loop over their channels); one line
/// per client when it goes.
fn serve_ferry(ep: &ferry::Endpoint, at: &str, store: Arc<dyn ferry_block::Store>) -> Result<(), ferry_block::Error> {
    let domain = ferry::Domain::new("block server");
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    ferry_block::serve_endpoint(&domain, ep, &*store, &|| false, &mut |r| {
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
    })
    .map_err(|e| ferry_block::Error::Protocol(format!("cannot listen for Ferry clients on {at}: {e}")))
}

/// One line on stdout; a reader that went away does not stop the server.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{line}");
}

fn proxy(a: &ProxyArgs) -> Result<(), CliError> {
    let local =
        crate::echo::parse_endpoint(&a.listen).map_err(|m| CliError::Usage(format!("--listen {}: {m}", a.listen)))?;
    let remote =
        crate::echo::parse_endpoint(&a.server).map_err(|m| CliError::Usage(format!("--server {}: {m}", a.server)))?;
    let domain = ferry::Domain::new("block proxy");
    say(&format!("ferry block proxy: user domains connect on {}; forwarding to {}", a.listen, a.server));
    ferry_block::run_proxy(&domain, &local, &remote, std::time::Duration::from_secs(30), || false)
        .map_err(|e| CliError::Failed(format!("the proxy stopped: {e}")))
}
