//! One server thread serving many client processes at once, over shared
//! memory and over TCP, from one `Selector`: every client moves 4 MiB in
//! 64 KiB buffers (`--bytes N` for another amount), the server checks every
//! byte of every buffer as it comes and passes it back, whichever client
//! it came from.
//!
//! Run without arguments, the program creates 4 shared-memory channels and
//! 4 TCP channels (loopback; `--clients N` for another number of each),
//! starts a client process of itself for each, and serves them all:
//!
//! ```text
//! cargo run -p ferry --release --example many_clients
//! ```
//!
//! A client alone (the server must be listening on that endpoint):
//!
//! ```text
//! cargo run -p ferry --release --example many_clients -- --role client --shm NAME
//! cargo run -p ferry --release --example many_clients -- --role client --tcp 127.0.0.1:PORT
//! ```

// The two-party examples' receiving loop is not used here: the server has its own.
#[allow(dead_code)]
mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Command, ExitCode};
use std::time::Instant;

use ferry::{
    BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, ErrorKind, Event, PoolPolicy, Role, Selector,
};

use common::{exit_code, send, summary, verify, Args, Result, BUFFER_SIZE, TIMEOUT};

/// Clients of each transport unless `--clients` says otherwise.
const DEFAULT_CLIENTS: usize = 4;
/// Bytes per client unless `--bytes` says otherwise.
const DEFAULT_BYTES: usize = 4 << 20;

fn main() -> ExitCode {
    exit_code(run())
}

fn run() -> Result<()> {
    let args = Args::parse(&["role", "shm", "tcp", "bytes", "clients"])?;
    let bytes = match args.get("bytes") {
        Some(_) => args.bytes()?,
        None => DEFAULT_BYTES,
    };
    if bytes == 0 {
        return Err("--bytes 0: give at least one byte".into());
    }
    let clients = match args.get("clients") {
        Some(c) => c
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=64).contains(n))
            .ok_or(format!("--clients {c}: give a number from 1 to 64 (clients of each transport)"))?,
        None => DEFAULT_CLIENTS,
    };
    match (args.get("role"), args.get("shm"), args.get("tcp")) {
        (Some("client"), Some(name), None) => client(Endpoint::shm_abstract(name), "shm", bytes),
        (Some("client"), None, Some(addr)) => {
            let addr: SocketAddr = addr.parse().map_err(|e| format!("--tcp {addr}: {e}"))?;
            client(Endpoint::tcp(addr), "tcp", bytes)
        }
        (None, None, None) => server(clients, bytes),
        _ => Err(
            "usage: many_clients [--clients N] [--bytes N] | --role client (--shm NAME | --tcp IP:PORT) [--bytes N]"
                .into(),
        ),
    }
}

/// A client: bind (retrying until the server listens), move `bytes` in
/// pattern-filled buffers, take every one back, tear down.
fn client(ep: Endpoint, transport: &str, bytes: usize) -> Result<()> {
    let start = Instant::now();
    let mut tx = Channel::connect(&Domain::new("client"), &ep, BindParams::default(), TIMEOUT)?;
    let sent = send(&mut tx, bytes)?;
    println!(
        "{}",
        summary(&format!("  client {transport} {:>5}", std::process::id()), sent, "moved, all passed back,", start)
    );
    Ok(())
}

/// What the server knows of one client.
struct Client {
    transport: &'static str,
    process: Child,
    /// The sequence number the next buffer must carry.
    next: u64,
    /// When the client closed its channel.
    closed: Option<Instant>,
}

/// The server: create every channel, start a client process on each, then
/// serve them all from one thread and one selector.
fn server(clients: usize, bytes: usize) -> Result<()> {
    let domain = Domain::new("server");
    let setup = ChannelSetup { direction: Direction::Rx, role: Role::Slave, ..ChannelSetup::default() };
    let exe = std::env::current_exe()?;
    let mut selector = Selector::new()?;
    let mut known: HashMap<usize, Client> = HashMap::new();
    let start = Instant::now();
    for transport in ["shm", "tcp"] {
        for i in 0..clients {
            let (channel, flag, endpoint) = if transport == "shm" {
                let name = format!("ferry-many-clients-{}-{i}", std::process::id());
                (Channel::create(&domain, &Endpoint::shm_abstract(&name), setup)?, "--shm", name)
            } else {
                let ch = Channel::create(&domain, &Endpoint::tcp(SocketAddr::from(([127, 0, 0, 1], 0))), setup)?;
                let addr = ch.listen_addr().ok_or("a TCP channel without a listening address")?;
                (ch, "--tcp", addr.to_string())
            };
            let process = Command::new(&exe)
                .args(["--role", "client", flag, &endpoint, "--bytes", &bytes.to_string()])
                .spawn()?;
            let key = selector.insert(channel);
            known.insert(key, Client { transport, process, next: 0, closed: None });
        }
    }
    println!("server: one thread, one selector, {clients} clients over shared memory and {clients} over TCP (each a process)");
    let served = serve(&mut selector, &mut known);
    // Every client process is collected, whatever happened.
    let mut failed = Vec::new();
    for c in known.values_mut() {
        if served.is_err() {
            let _ = c.process.kill();
        }
        match c.process.wait() {
            Ok(st) if st.success() => {}
            Ok(st) => failed.push(format!("a {} client failed ({st})", c.transport)),
            Err(e) => failed.push(format!("a {} client: {e}", c.transport)),
        }
    }
    served?;
    if let Some(f) = failed.first() {
        return Err(f.clone().into());
    }
    let want = bytes.div_ceil(BUFFER_SIZE) as u64;
    for transport in ["shm", "tcp"] {
        let mine: Vec<&Client> = known.values().filter(|c| c.transport == transport).collect();
        if let Some(c) = mine.iter().find(|c| c.next != want) {
            return Err(format!("a {transport} client delivered {} buffers, {want} expected", c.next).into());
        }
        let buffers: u64 = mine.iter().map(|c| c.next).sum();
        let last = mine.iter().filter_map(|c| c.closed).max().unwrap_or(start);
        let secs = last.duration_since(start).as_secs_f64();
        let mib = (buffers as usize * BUFFER_SIZE) as f64 / f64::from(1 << 20);
        println!(
            "server: {} {transport} clients, {buffers} buffers ({mib:.1} MiB) received, every byte verified, all passed back; the last closed after {secs:.3} s",
            mine.len()
        );
    }
    let total: u64 = known.values().map(|c| c.next).sum();
    let secs = start.elapsed().as_secs_f64();
    let gb = (total as usize * BUFFER_SIZE) as f64 / 1e9;
    println!(
        "server: {} clients, {total} buffers, every byte verified: {:.2} GB/s, {:.0} buffers/s (processes started and connected included)",
        known.len(),
        gb / secs,
        total as f64 / secs
    );
    Ok(())
}

/// Serve until every client has closed its channel.
fn serve(selector: &mut Selector, known: &mut HashMap<usize, Client>) -> Result<()> {
    while !selector.is_empty() {
        let (key, ev) = selector.wait(Some(TIMEOUT)).map_err(|e| format!("no client did anything in time: {e}"))?;
        let client = known.get_mut(&key).ok_or("the selector returned a key it does not hold")?;
        let channel = selector.get_mut(key).ok_or("the selector lost a channel")?;
        match ev {
            // A client bound: take the pool it will offer.
            Event::BindRequest { .. } => channel.set_pool_policy(PoolPolicy::AcceptAll),
            Event::PoolAssignRequest(_) => {} // accepted by the policy
            Event::MoveReceived { buffer, meta } => {
                let seq = u64::from_le_bytes(meta[..8].try_into()?);
                if seq != client.next {
                    return Err(
                        format!("{} client: buffer {seq} arrived, {} expected", client.transport, client.next).into()
                    );
                }
                verify(&buffer, seq)?;
                // The client overwrites every byte: back without its contents.
                channel.pass_unfilled(buffer, &[])?;
                client.next += 1;
            }
            Event::Closed { .. } => {
                client.closed = Some(Instant::now());
                drop(selector.remove(key));
            }
            Event::Error(err) if matches!(err.kind(), ErrorKind::PeerGone) && client.closed.is_some() => {
                drop(selector.remove(key))
            }
            Event::Error(e) => return Err(format!("{} client: {e}", client.transport).into()),
            other => return Err(format!("{} client: unexpected event {other:?}", client.transport).into()),
        }
    }
    Ok(())
}
