//! The echo domain of the [ETH-NET] experiments: pass every moved buffer
//! straight back, release every copy; used as a thread by `ferry bench
//! --backend local` and as a process (`ferry echo`) by the demo and by the
//! benchmarks of the other backends.
//!
//! The echo never spins on a full outgoing queue: a pass that finds no room
//! waits in a backlog, and the echo sleeps on the channel's fd (armed, so
//! the peer's taking a slot wakes it, as does a new message) until it can
//! send again.

use std::collections::VecDeque;
use std::time::Duration;

use clap::Args;
use ferry::{BindParams, Buffer, Channel, ChannelSetup, Domain, Endpoint, Event, Meta};

use crate::setup::{describe_event, describe_wait, next_event};
use crate::tls_args::{host_of, Side, TlsFlags};
use crate::{pattern, pin, CliError};

/// How the echo behaves.
#[derive(Debug, Clone, Copy, Default)]
pub struct EchoOptions {
    /// Spin instead of sleeping.
    pub busy: bool,
    /// Read every payload byte.
    pub touch: bool,
    /// Check every payload against the demo pattern (sequence number in
    /// the first 8 bytes of meta data).
    pub verify: bool,
    /// Publish passes in batches (`Channel::set_batching`).
    pub batch: bool,
    /// Give every buffer back without its contents
    /// (`Channel::pass_unfilled`), as a consumer that is done with the
    /// data does: over the network the payload then travels one way only.
    pub unfilled: bool,
}

#[derive(Debug, Args)]
pub struct EchoArgs {
    /// Endpoint to bind to: `shm:PATH`, `shm@ABSTRACT-NAME`, `tcp:HOST:PORT` or `fabric:HOST:PORT`
    /// (libfabric RMA, provider from FI_PROVIDER; feature `fabric`). Over TCP the echo
    /// connects: with --tls-certificates DIR it presents client-cert.pem and takes only a server
    /// whose certificate ca-cert.pem signed for HOST; without TLS, HOST must be a loopback address
    /// unless --insecure is given.
    #[arg(long, value_parser = endpoint_arg)]
    endpoint: String,
    /// Spin instead of sleeping.
    #[arg(long)]
    busy_poll: bool,
    /// Read every payload byte.
    #[arg(long)]
    touch: bool,
    /// Verify every payload against the demo pattern.
    #[arg(long)]
    verify: bool,
    /// Publish passes back in batches (`Channel::set_batching`).
    #[arg(long)]
    batch: bool,
    /// Pass every buffer back without its contents (`Channel::pass_unfilled`): over TCP the
    /// payload then travels one way only.
    #[arg(long)]
    unfilled: bool,
    /// Pin to this CPU (0 to the number of CPUs less one).
    #[arg(allow_negative_numbers = true, long, value_parser = crate::args::cpu)]
    cpu: Option<usize>,
    // TLS on a tcp: endpoint (the echo is the connecting side).
    #[command(flatten)]
    tls: TlsFlags,
}

/// Parse an endpoint descriptor; the error says what is allowed (the
/// caller names the flag).
pub fn parse_endpoint(s: &str) -> Result<Endpoint, String> {
    if let Some(path) = s.strip_prefix("shm:").filter(|p| !p.is_empty()) {
        return Ok(Endpoint::shm(path));
    }
    if let Some(name) = s.strip_prefix("shm@").filter(|n| !n.is_empty()) {
        return Ok(Endpoint::shm_abstract(name));
    }
    if let Some(hostport) = s.strip_prefix("tcp:") {
        use std::net::ToSocketAddrs;
        return hostport
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .map(Endpoint::tcp)
            .ok_or_else(|| "not a reachable TCP address; give tcp:HOST:PORT (IPv6: tcp:[::1]:PORT)".to_string());
    }
    if let Some(hostport) = s.strip_prefix("fabric:") {
        return fabric_endpoint(hostport);
    }
    Err("not an endpoint; give shm:PATH, shm@NAME, tcp:HOST:PORT or fabric:HOST:PORT".to_string())
}

/// `fabric:HOST:PORT`: the fabric backend, its setup connection at that
/// address, the provider from `FI_PROVIDER` (or libfabric's first choice).
#[cfg(feature = "fabric")]
fn fabric_endpoint(hostport: &str) -> Result<Endpoint, String> {
    use std::net::ToSocketAddrs;
    hostport
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .map(Endpoint::fabric)
        .ok_or_else(|| "not a reachable address; give fabric:HOST:PORT (IPv6: fabric:[::1]:PORT)".to_string())
}

#[cfg(not(feature = "fabric"))]
fn fabric_endpoint(_: &str) -> Result<Endpoint, String> {
    Err("this ferry was built without the fabric backend; build it with `cargo build -p ferry-cli --features fabric`"
        .to_string())
}

/// The endpoint `s` names, with what protects it when it is TCP (the TLS
/// flags, as `side`); `flag` names where `s` was given, for messages. The
/// TLS flags on a shared-memory endpoint are a usage error.
pub fn secure_endpoint(s: &str, flags: &TlsFlags, side: Side, flag: &str) -> Result<Endpoint, CliError> {
    let ep = parse_endpoint(s).map_err(|why| CliError::Usage(format!("{flag} {s}: {why}")))?;
    let Some(hostport) = s.strip_prefix("tcp:") else {
        if !flags.is_default() {
            return Err(CliError::Usage(format!(
                "{flag} {s}: --tls, --tls-certificates and --insecure apply to tcp: endpoints only; drop them"
            )));
        }
        return Ok(ep);
    };
    use std::net::ToSocketAddrs;
    let addr = hostport
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| CliError::Usage(format!("{flag} {s}: not a reachable TCP address")))?;
    Ok(Endpoint::tcp_with(addr, flags.net_options(side, s, host_of(hostport), addr)?))
}

/// `--endpoint`: checked when the command line is read.
pub fn endpoint_arg(s: &str) -> Result<String, String> {
    parse_endpoint(s).map(|_| s.to_string())
}

/// How the echo process is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory (an abstract socket name for the setup).
    Shm,
    /// TCP over loopback.
    Tcp,
    /// The fabric backend on libfabric's tcp provider over loopback.
    #[cfg(feature = "fabric")]
    Fabric,
}

/// `ferry echo`: bind to the endpoint, echo until the peer closes, print
/// how many buffers came through.
pub fn run(args: &EchoArgs) -> Result<(), CliError> {
    let ep = secure_endpoint(&args.endpoint, &args.tls, Side::Connect, "--endpoint")?;
    if let Some(cpu) = args.cpu {
        pin::to_cpu(cpu);
    }
    let domain = Domain::new("echo");
    let mut ch = Channel::bind(&domain, &ep, BindParams::default())?;
    let opts = EchoOptions {
        busy: args.busy_poll,
        touch: args.touch,
        verify: args.verify,
        batch: args.batch,
        unfilled: args.unfilled,
    };
    let n = serve(&mut ch, opts).map_err(CliError::Failed)?;
    println!("echoed {n}");
    Ok(())
}

/// Echo until the channel closes; the number of buffers passed back.
pub fn serve(ch: &mut Channel, opts: EchoOptions) -> Result<u64, String> {
    let mut echoed = 0u64;
    let mut sum = 0u64;
    // Passes that found the outgoing queue full, in order.
    let mut backlog: VecDeque<(Buffer, Meta)> = VecDeque::new();
    if opts.batch && ch.state() == ferry::ChannelState::Connected {
        ch.set_batching(true).map_err(|e| e.to_string())?;
    }
    loop {
        while let Some((buffer, meta)) = backlog.pop_front() {
            let passed = if opts.unfilled { ch.pass_unfilled(buffer, &meta) } else { ch.pass(buffer, &meta) };
            match passed {
                Ok(()) => echoed += 1,
                Err(r) if r.error == ferry::ErrorKind::QueueFull => {
                    backlog.push_front((r.into_inner(), meta));
                    break;
                }
                Err(r) => return Err(r.error.to_string()),
            }
        }
        let ev = if backlog.is_empty() {
            next_event(ch, opts.busy)
        } else {
            match ch.poll() {
                Some(ev) => Some(ev),
                None if ch.state() == ferry::ChannelState::Closed => None,
                None => {
                    if !opts.busy {
                        sleep_until_ready(ch, Duration::from_millis(100));
                    }
                    continue;
                }
            }
        };
        match ev {
            Some(Event::Bound) => {
                if opts.batch {
                    ch.set_batching(true).map_err(|e| e.to_string())?;
                }
            }
            Some(Event::PoolAssignRequest(req)) => ch.respond_pool(req.pool, true).map_err(|e| e.to_string())?,
            Some(Event::MoveReceived { buffer, meta }) => {
                if opts.verify {
                    if !pattern::seq_of(&meta).is_some_and(|s| pattern::check(&buffer, s)) {
                        return Err(format!("echo: buffer {} arrived corrupted", buffer.id().index));
                    }
                } else if opts.touch {
                    sum = sum.wrapping_add(pattern::touch(&buffer));
                }
                // In order: behind the backlog, if there is one.
                backlog.push_back((buffer, meta));
            }
            Some(Event::CopyReceived { copy, .. }) => ch.release(copy).map_err(|r| r.error.to_string())?,
            Some(Event::Closed { .. }) | None => {
                std::hint::black_box(sum);
                return Ok(echoed);
            }
            Some(Event::Error(e)) => return Err(e.to_string()),
            Some(other) => {
                return Err(format!(
                    "the echo got {}, which it does not handle; check the other side",
                    describe_event(&other)
                ))
            }
        }
    }
}

/// Arm `ch` and sleep on its fd until it may have an event or room in its
/// outgoing queue (at most `limit`); at once if it may be ready already.
fn sleep_until_ready(ch: &mut Channel, limit: Duration) {
    if !ch.arm() {
        return;
    }
    let mut fds = [rustix::event::PollFd::new(&*ch, rustix::event::PollFlags::IN)];
    let t = rustix::event::Timespec { tv_sec: limit.as_secs() as i64, tv_nsec: limit.subsec_nanos() as i64 };
    // A failed poll(2) (interrupted, no memory) only means we look again sooner.
    let _ = rustix::event::poll(&mut fds, Some(&t));
}

/// Create the channel on a fresh endpoint of `transport` (shared memory, or
/// TCP on a loopback port the kernel picks) and start `ferry echo` on it as
/// a process pinned to CPU 1.
/// The libfabric provider of [`Transport::Fabric`]: tcp, which every
/// machine has.
#[cfg(feature = "fabric")]
const FABRIC_PROVIDER: &str = "tcp";

pub fn spawn_process_on(
    transport: Transport,
    domain: &Domain,
    setup: ChannelSetup,
    opts: EchoOptions,
) -> Result<(Channel, std::process::Child), CliError> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let (mut source, endpoint) = match transport {
        Transport::Shm => {
            let name = format!("ferry-echo-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
            (Channel::create(domain, &Endpoint::shm_abstract(&name), setup)?, format!("shm@{name}"))
        }
        Transport::Tcp => {
            let ch = Channel::create(domain, &Endpoint::tcp(([127, 0, 0, 1], 0).into()), setup)?;
            let addr = ch.listen_addr().ok_or_else(|| CliError::Failed("TCP channel has no address".into()))?;
            (ch, format!("tcp:{addr}"))
        }
        #[cfg(feature = "fabric")]
        Transport::Fabric => {
            let options = ferry::FabricOptions::default().with_provider(FABRIC_PROVIDER);
            let ch = Channel::create(domain, &Endpoint::fabric_with(([127, 0, 0, 1], 0).into(), options), setup)?;
            let addr = ch.listen_addr().ok_or_else(|| CliError::Failed("fabric channel has no address".into()))?;
            (ch, format!("fabric:{addr}"))
        }
    };
    let exe = std::env::current_exe().map_err(|e| CliError::Failed(format!("cannot find own executable: {e}")))?;
    let mut cmd = std::process::Command::new(exe);
    // CPU 1, or the only one there is.
    let cpu = (1 % pin::cpus()).to_string();
    cmd.args(["echo", "--endpoint", &endpoint, "--cpu", &cpu]);
    for (on, flag) in [
        (opts.busy, "--busy-poll"),
        (opts.touch, "--touch"),
        (opts.verify, "--verify"),
        (opts.batch, "--batch"),
        (opts.unfilled, "--unfilled"),
    ] {
        if on {
            cmd.arg(flag);
        }
    }
    #[cfg(feature = "fabric")]
    if matches!(transport, Transport::Fabric) {
        // The echo process takes its provider from FI_PROVIDER.
        cmd.env("FI_PROVIDER", FABRIC_PROVIDER);
    }
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| CliError::Failed(format!("cannot start the echo process: {e}")))?;
    match source.wait(Some(std::time::Duration::from_secs(10))) {
        Ok(Event::BindRequest { .. }) => Ok((source, child)),
        ev => {
            let _ = child.kill();
            Err(CliError::Failed(format!(
                "the echo process did not bind: the channel gave {}; run the command again",
                describe_wait(&ev)
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use ferry::{Allocator, PoolConstraints};

    use super::*;
    use crate::setup::{assign, connect_local};

    /// `fabric:HOST:PORT` names a fabric endpoint when the fabric backend
    /// is built in, and says how to build it in otherwise.
    #[test]
    fn fabric_endpoints_are_parsed_or_explained() {
        let parsed = parse_endpoint("fabric:127.0.0.1:7000");
        if cfg!(feature = "fabric") {
            let ep = parsed.expect("a fabric endpoint");
            assert!(format!("{ep:?}").contains("Fabric"), "{ep:?}");
        } else {
            assert!(parsed.expect_err("no fabric backend").contains("--features fabric"));
        }
        assert!(parse_endpoint("fabric:").is_err());
    }

    /// A source that moves every buffer of its pool before it takes any
    /// back, over queues of two: the echo's passes find the return queue
    /// full while more moves wait for it. An echo that waited for room
    /// before reading on would leave both sides waiting for each other; this
    /// one keeps reading, holds the passes back and sends them, in order,
    /// when the source makes room.
    #[test]
    fn a_full_return_queue_does_not_stop_the_echo_reading() {
        let (src_domain, echo_domain) = (Domain::new("source"), Domain::new("echo"));
        let setup = ChannelSetup { queue_depth: 2, meta_size: 16, ..ChannelSetup::default() };
        let (mut src, mut sink) = connect_local(&src_domain, &echo_domain, setup, BindParams::default()).unwrap();
        let alloc = Allocator::new(&src_domain, 32, 4096, PoolConstraints::default()).unwrap();
        assign(&mut src, &mut sink, alloc.pool()).unwrap();
        let echo = std::thread::spawn(move || {
            let _keep = echo_domain;
            serve(&mut sink, EchoOptions::default())
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        for seq in 0..32u64 {
            let mut buf = alloc.alloc().expect("a free buffer");
            loop {
                match src.move_buffer(buf, &seq.to_le_bytes()) {
                    Ok(()) => break,
                    Err(r) if r.error == ferry::ErrorKind::QueueFull => {
                        assert!(
                            Instant::now() < deadline,
                            "the echo stopped reading: move {seq} found no room for 10 s"
                        );
                        buf = r.into_inner();
                        std::thread::yield_now();
                    }
                    Err(r) => panic!("move {seq}: {}", r.error),
                }
            }
        }
        for want in 0..32u64 {
            match src.wait(Some(Duration::from_secs(10))) {
                Ok(Event::BufferPassed { meta, .. }) => assert_eq!(meta[..8], want.to_le_bytes()),
                ev => panic!("expected buffer {want} back, got {}", describe_wait(&ev)),
            }
        }
        src.teardown().unwrap();
        while let Ok(ev) = src.wait(Some(Duration::from_secs(10))) {
            if matches!(ev, Event::Closed { .. }) {
                break;
            }
        }
        assert_eq!(echo.join().unwrap(), Ok(32));
    }
}
