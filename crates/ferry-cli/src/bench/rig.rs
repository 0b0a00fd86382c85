//! The one place that knows how each of Ferry's backends is reached: a
//! source domain with the TX end of a channel, and an echo domain on the
//! other end — a thread (local), a process this command starts (shm), or a
//! process started by hand (`--peer`).
//!
//! Adding a backend is one arm in [`process_endpoint`] (the endpoint the
//! source creates or `--peer` names, and the descriptor the echo process
//! binds to); everything else (spawning the echo, pools, teardown, a peer
//! that dies) is shared.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event};

use super::{trust_error, Backend};
use crate::echo::{self, EchoOptions};
use crate::setup::{describe_event, describe_wait};
use crate::tls_args::{Side, TlsFlags};
use crate::{pin, CliError};

/// How long setup steps may take before we call the peer dead.
const STEP: Duration = Duration::from_secs(10);
/// How long we wait for an echo started by hand.
const BY_HAND: Duration = Duration::from_secs(60);

/// Which echo loop runs on the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EchoRole {
    /// `ferry echo`: pass every buffer straight back ([ETH-NET] §5.1).
    Standard,
    /// The fbufs receiver: read one word per page, pass back, accept pool
    /// removals ([`super::fbufs::serve`]).
    Fbufs,
}

/// The echo domain wanted.
#[derive(Debug, Clone, Copy)]
pub struct EchoSpec {
    /// Which loop.
    pub role: EchoRole,
    /// Spin instead of sleeping.
    pub busy: bool,
    /// Check every payload byte against the sender's pattern (standard echo; `--touch`).
    pub touch: bool,
    /// Both ends publish messages in batches (`Channel::set_batching`).
    pub batch: bool,
    /// The standard echo passes every buffer back without its contents
    /// (`Channel::pass_unfilled`): the payload travels one way.
    pub unfilled: bool,
    /// A local echo in the source's domain instead of its own.
    pub one_domain: bool,
}

impl EchoSpec {
    /// The options of the standard echo. With `touch` the echo checks every
    /// byte against the sender's pattern, as the peers' echoes do (reading
    /// alone would be less work than theirs).
    fn echo_options(&self) -> EchoOptions {
        EchoOptions { busy: self.busy, touch: false, verify: self.touch, batch: self.batch, unfilled: self.unfilled }
    }
}

enum Echo {
    Thread(Option<JoinHandle<Result<u64, String>>>),
    Process(Option<Child>),
    External,
}

/// A connected source and its echo domain.
pub struct Rig {
    /// The source domain (owns the pools).
    pub domain: Domain,
    /// The TX end (master) of the channel.
    pub source: Channel,
    echo: Echo,
}

/// How a process backend is reached: the endpoint the source creates — a
/// fresh one, or the one named by `--peer` — and the descriptor the echo
/// process binds to (`ferry echo --endpoint …`). The one place that knows
/// each backend's endpoints.
fn process_endpoint(
    backend: Backend,
    name: &str,
    peer: Option<&str>,
    tls: &TlsFlags,
) -> Result<(Endpoint, String), CliError> {
    match backend {
        Backend::Shm => match peer {
            Some(p) if p.starts_with("shm") => Ok((peer_endpoint(p)?, p.to_string())),
            Some(p) => Err(CliError::Usage(format!(
                "--peer {p}: not a shared-memory endpoint; with --backend shm give shm:PATH or shm@NAME"
            ))),
            None => Ok((Endpoint::shm_abstract(name), format!("shm@{name}"))),
        },
        // With `--peer tcp:HOST:PORT` that address; else loopback on a port
        // the kernel picks: the descriptor is known once the channel listens
        // (see `connect`).
        Backend::Net => match peer {
            Some(p) if p.starts_with("tcp:") => {
                Ok((echo::secure_endpoint(p, tls, Side::Accept, "--peer")?, p.to_string()))
            }
            Some(p) => {
                Err(CliError::Usage(format!("--peer {p}: not a TCP endpoint; with --backend net give tcp:HOST:PORT")))
            }
            None => {
                let addr = ([127, 0, 0, 1], 0).into();
                let options = tls.net_options(Side::Accept, "the echo's endpoint", "127.0.0.1", addr)?;
                Ok((Endpoint::tcp_with(addr, options), String::new()))
            }
        },
        // Loopback on a port the kernel picks, as for net.
        Backend::Fabric => match peer {
            Some(p) => {
                Err(CliError::Usage(format!("--peer {p}: --backend fabric starts its own echo process; drop --peer")))
            }
            None => Ok((echo::parse_endpoint("fabric:127.0.0.1:0").map_err(CliError::Usage)?, String::new())),
        },
        other => Err(CliError::Usage(format!(
            "--backend {}: not one of Ferry's process backends; give shm, net or fabric",
            other.name()
        ))),
    }
}

fn peer_endpoint(p: &str) -> Result<Endpoint, CliError> {
    echo::parse_endpoint(p).map_err(|why| CliError::Usage(format!("--peer {p}: {why}")))
}

fn wait_for<T>(
    source: &mut Channel,
    limit: Duration,
    what: &str,
    mut alive: impl FnMut() -> Result<(), CliError>,
    mut want: impl FnMut(Event) -> Option<Result<T, CliError>>,
) -> Result<T, CliError> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Ok(ev) = source.wait(Some(Duration::from_millis(100))) {
            if let Some(r) = want(ev) {
                return r;
            }
        }
        alive()?;
        if source.state() == ferry::ChannelState::Closed {
            break;
        }
    }
    Err(CliError::Failed(format!("no {what} within {} s", limit.as_secs())))
}

/// Connect a source to an echo domain over `backend`.
/// The TLS flags apply to `Backend::Net` (the source listens, the echo
/// connects): the echo process started here gets the same flags.
pub fn connect(
    backend: Backend,
    setup: ChannelSetup,
    spec: EchoSpec,
    peer: Option<&str>,
    tls: &TlsFlags,
) -> Result<Rig, CliError> {
    let domain = Domain::new("source");
    if backend == Backend::NetTls {
        let tls = super::tls_stream::config()?;
        let options = ferry::NetOptions::default().with_security(ferry::tls::Security::Tls(tls));
        return connect_thread(domain, setup, spec, options, "TLS echo thread");
    }
    if backend == Backend::Mux {
        return connect_mux(domain, setup, spec);
    }
    if backend == Backend::Local {
        let ep = Endpoint::local();
        let mut source = Channel::create(&domain, &ep, setup).map_err(trust_error)?;
        let echo_domain = if spec.one_domain { domain.clone() } else { Domain::new("echo") };
        let mut sink = Channel::bind(&echo_domain, &ep, BindParams::default())?;
        match source.wait(Some(STEP)) {
            Ok(Event::BindRequest { .. }) => {}
            ev => {
                return Err(CliError::Failed(format!(
                    "the local channel gave {} instead of a bind request; run the benchmark again",
                    describe_wait(&ev)
                )))
            }
        }
        let handle = std::thread::Builder::new()
            .name("echo".into())
            .spawn(move || {
                pin::to_cpu(1);
                let _keep = echo_domain;
                match spec.role {
                    EchoRole::Standard => echo::serve(&mut sink, spec.echo_options()),
                    EchoRole::Fbufs => super::fbufs::serve(&mut sink, spec.busy),
                }
            })
            .map_err(|e| CliError::Failed(format!("cannot start the echo thread: {e}")))?;
        pin::to_cpu(0);
        source.set_batching(spec.batch)?;
        return Ok(Rig { domain, source, echo: Echo::Thread(Some(handle)) });
    }
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!("ferry-bench-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    let (ep, descriptor) = process_endpoint(backend, &name, peer, tls)?;
    let mut source = Channel::create(&domain, &ep, setup).map_err(trust_error)?;
    if peer.is_some() {
        let mut flags = if tls.is_default() { String::new() } else { format!(" {}", tls.forward().join(" ")) };
        if spec.unfilled {
            flags.push_str(" --unfilled");
        }
        eprintln!(
            "ferry bench: waiting up to {} s for the echo: start `ferry echo --endpoint {descriptor}{flags}`",
            BY_HAND.as_secs()
        );
        wait_for(&mut source, BY_HAND, "echo process (--peer)", || Ok(()), bound)?;
        pin::to_cpu(0);
        source.set_batching(spec.batch)?;
        return Ok(Rig { domain, source, echo: Echo::External });
    }
    let descriptor = match source.listen_addr() {
        Some(addr) if backend == Backend::Net => format!("tcp:{addr}"),
        Some(addr) if backend == Backend::Fabric => format!("fabric:{addr}"),
        _ => descriptor,
    };
    let mut args: Vec<String> = match spec.role {
        EchoRole::Standard => vec!["echo".into()],
        EchoRole::Fbufs => vec!["bench-child".into(), "fbufs-echo".into()],
    };
    // CPU 1, or the only one there is (`--cpu` takes only CPUs this machine has).
    args.extend(["--endpoint".into(), descriptor, "--cpu".into(), (1 % pin::cpus()).to_string()]);
    if backend == Backend::Net && spec.role == EchoRole::Standard && !tls.is_default() {
        args.extend(tls.forward());
    }
    if spec.busy {
        args.push("--busy-poll".into());
    }
    if spec.touch && spec.role == EchoRole::Standard {
        args.push("--verify".into());
    }
    if spec.batch && spec.role == EchoRole::Standard {
        args.push("--batch".into());
    }
    if spec.unfilled && spec.role == EchoRole::Standard {
        args.push("--unfilled".into());
    }
    let mut child = spawn_self(&args)?;
    let alive = |c: &mut Child| match c.try_wait() {
        Ok(None) => Ok(()),
        Ok(Some(st)) => Err(CliError::Failed(format!("the echo process exited during setup ({st})"))),
        Err(e) => Err(CliError::Failed(format!("echo process: {e}"))),
    };
    let r = wait_for(&mut source, STEP, "bind from the echo process", || alive(&mut child), bound);
    if let Err(e) = r {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    pin::to_cpu(0);
    source.set_batching(spec.batch)?;
    Ok(Rig { domain, source, echo: Echo::Process(Some(child)) })
}

/// A source on loopback TCP without TLS, and its echo on a thread of this
/// process: the baseline of a session's channel ([`Backend::Mux`]), whose
/// echo is a thread as well.
pub fn connect_net_thread(setup: ChannelSetup, spec: EchoSpec) -> Result<Rig, CliError> {
    connect_thread(Domain::new("source"), setup, spec, ferry::NetOptions::default(), "echo thread")
}

/// A source on loopback TCP with `options` (TLS or not), and its echo on a
/// thread of this process binding with the same options.
fn connect_thread(
    domain: Domain,
    setup: ChannelSetup,
    spec: EchoSpec,
    options: ferry::NetOptions,
    what: &str,
) -> Result<Rig, CliError> {
    let ep = Endpoint::tcp_with(([127, 0, 0, 1], 0).into(), options.clone());
    let mut source = Channel::create(&domain, &ep, setup).map_err(trust_error)?;
    let addr =
        source.listen_addr().ok_or_else(|| CliError::Failed(format!("the channel to the {what} is not listening")))?;
    let handle = std::thread::Builder::new()
        .name("echo".into())
        .spawn(move || {
            pin::to_cpu(1);
            let echo_domain = Domain::new("echo");
            let ep = Endpoint::tcp_with(addr, options);
            let mut sink = Channel::bind(&echo_domain, &ep, BindParams::default()).map_err(|e| e.to_string())?;
            serve(&mut sink, spec)
        })
        .map_err(|e| CliError::Failed(format!("cannot start the echo thread: {e}")))?;
    let alive = || Ok(());
    wait_for(&mut source, STEP, &format!("bind from the {what}"), alive, bound)?;
    pin::to_cpu(0);
    source.set_batching(spec.batch)?;
    Ok(Rig { domain, source, echo: Echo::Thread(Some(handle)) })
}

/// The channel a multiplexed session over loopback TCP carries, its echo
/// on a thread of this process at the session's other end. The session is
/// the channel's only one on either side: what is measured is what the
/// session adds to one channel over its own connection.
fn connect_mux(domain: Domain, setup: ChannelSetup, spec: EchoSpec) -> Result<Rig, CliError> {
    /// The channel's number on the session (any will do: it is the only one).
    const CHANNEL: u32 = 1;
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| CliError::Failed(format!("cannot listen on loopback for the session: {e}")))?;
    let addr = listener.local_addr().map_err(|e| CliError::Failed(format!("session listener: {e}")))?;
    let handle = std::thread::Builder::new()
        .name("echo".into())
        .spawn(move || {
            pin::to_cpu(1);
            let echo_domain = Domain::new("echo");
            let session =
                ferry::MuxSession::connect(addr, ferry::NetOptions::default(), STEP).map_err(|e| e.to_string())?;
            let mut sink = Channel::bind(&echo_domain, &session.endpoint(CHANNEL), BindParams::default())
                .map_err(|e| e.to_string())?;
            // The channel holds the session from here on.
            drop(session);
            serve(&mut sink, spec)
        })
        .map_err(|e| CliError::Failed(format!("cannot start the echo thread: {e}")))?;
    let session = match ferry::MuxSession::accept(&listener, ferry::NetOptions::default(), STEP) {
        Ok(s) => s,
        Err(e) => {
            // The echo thread gives up within its own deadline.
            let why = match handle.join() {
                Ok(Err(echo)) => format!("{e} (echo thread: {echo})"),
                _ => e.to_string(),
            };
            return Err(CliError::Failed(format!("no session with the echo thread: {why}")));
        }
    };
    drop(listener);
    let mut source = Channel::create(&domain, &session.endpoint(CHANNEL), setup).map_err(trust_error)?;
    drop(session);
    let alive = || Ok(());
    wait_for(&mut source, STEP, "bind from the session's echo thread", alive, bound)?;
    pin::to_cpu(0);
    source.set_batching(spec.batch)?;
    Ok(Rig { domain, source, echo: Echo::Thread(Some(handle)) })
}

/// The echo loop `spec` asks for, on `sink`: how many buffers it passed back.
fn serve(sink: &mut Channel, spec: EchoSpec) -> Result<u64, String> {
    match spec.role {
        EchoRole::Standard => echo::serve(sink, spec.echo_options()),
        EchoRole::Fbufs => super::fbufs::serve(sink, spec.busy),
    }
}

fn bound(ev: Event) -> Option<Result<(), CliError>> {
    match ev {
        Event::BindRequest { .. } => Some(Ok(())),
        other => Some(Err(CliError::Failed(format!(
            "the echo did not bind: the channel gave {}; run the benchmark again",
            describe_event(&other)
        )))),
    }
}

/// Start this executable with `args`, stdout piped, stderr inherited.
pub fn spawn_self(args: &[String]) -> Result<Child, CliError> {
    let exe = std::env::current_exe().map_err(|e| CliError::Failed(format!("cannot find own executable: {e}")))?;
    Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| CliError::Failed(format!("cannot start `ferry {}`: {e}", args.join(" "))))
}

impl Rig {
    /// Assign the allocator's pool to the channel; the echo accepts.
    pub fn assign(&mut self, alloc: &Allocator) -> Result<(), CliError> {
        self.source.assign_pool(alloc.pool()).map_err(trust_error)?;
        let id = alloc.pool().id();
        let echo = &mut self.echo;
        wait_for(
            &mut self.source,
            STEP,
            "answer to the pool assignment",
            || echo_alive(echo),
            |ev| match ev {
                Event::PoolAssigned(p) if p == id => Some(Ok(())),
                other => Some(Err(CliError::Failed(format!(
                    "the echo did not take the pool: the channel gave {}; run the benchmark again",
                    describe_event(&other)
                )))),
            },
        )
    }

    /// Remove a pool from the channel (fbufs, uncached) and wait until it is gone.
    pub fn remove(&mut self, alloc: &Allocator) -> Result<(), CliError> {
        let id = alloc.pool().id();
        self.source.remove_pool(id)?;
        let echo = &mut self.echo;
        wait_for(
            &mut self.source,
            STEP,
            "answer to the pool removal",
            || echo_alive(echo),
            |ev| match ev {
                Event::PoolRemoved(p) if p == id => Some(Ok(())),
                other => Some(Err(CliError::Failed(format!(
                    "the echo did not remove the pool: the channel gave {}; run the benchmark again",
                    describe_event(&other)
                )))),
            },
        )
    }

    /// Tear the channel down and collect the echo: how many buffers it
    /// passed back (`None` for an echo started by hand).
    pub fn finish(mut self) -> Result<Option<u64>, CliError> {
        self.source.teardown()?;
        let t0 = Instant::now();
        loop {
            match self.source.wait(Some(Duration::from_millis(100))) {
                Ok(Event::Closed { .. }) => break,
                Ok(Event::BufferPassed { .. } | Event::PoolRemoved(_)) => {}
                Ok(other) => {
                    return Err(CliError::Failed(format!(
                        "at the teardown the channel gave {}; run the benchmark again",
                        describe_event(&other)
                    )))
                }
                Err(_) if self.source.state() == ferry::ChannelState::Closed => break,
                Err(_) if t0.elapsed() > STEP => {
                    return Err(CliError::Failed("teardown: the echo did not close".into()))
                }
                Err(_) => echo_alive(&mut self.echo)?,
            }
        }
        match &mut self.echo {
            Echo::Thread(h) => {
                let h = h.take().expect("joined once");
                let n = h.join().map_err(|_| CliError::Failed("echo thread panicked".into()))?;
                n.map(Some).map_err(CliError::Failed)
            }
            Echo::External => Ok(None),
            Echo::Process(c) => {
                let mut child = c.take().expect("collected once");
                let status = loop {
                    match child.try_wait() {
                        Ok(Some(st)) => break st,
                        Ok(None) if t0.elapsed() < STEP * 2 => std::thread::sleep(Duration::from_millis(1)),
                        Ok(None) => {
                            let _ = child.kill();
                            let _ = child.wait();
                            return Err(CliError::Failed("the echo process did not exit after teardown".into()));
                        }
                        Err(e) => return Err(CliError::Failed(format!("echo process: {e}"))),
                    }
                };
                let mut text = String::new();
                if let Some(mut out) = child.stdout.take() {
                    let _ = out.read_to_string(&mut text);
                }
                match text.trim().strip_prefix("echoed ").and_then(|n| n.parse().ok()) {
                    Some(n) if status.success() => Ok(Some(n)),
                    _ => Err(CliError::Failed(format!("echo process failed ({status}): {}", text.trim()))),
                }
            }
        }
    }
}

fn echo_alive(echo: &mut Echo) -> Result<(), CliError> {
    match echo {
        Echo::Process(Some(c)) => match c.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(st)) => Err(CliError::Failed(format!("the echo process died ({st})"))),
            Err(e) => Err(CliError::Failed(format!("echo process: {e}"))),
        },
        Echo::Thread(Some(h)) if h.is_finished() => Err(CliError::Failed("the echo thread ended early".into())),
        _ => Ok(()),
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Echo::Process(Some(c)) = &mut self.echo {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Check the echo's count against what we sent (an echo started by hand
/// reports to its own terminal).
pub fn check_echoed(echoed: Option<u64>, expected: u64) -> Result<(), CliError> {
    match echoed {
        Some(n) if n != expected => Err(CliError::Failed(format!("echo saw {n} moves, expected {expected}"))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_by_backend() {
        let (_, d) = process_endpoint(Backend::Shm, "x", None, &TlsFlags::default()).unwrap();
        assert_eq!(d, "shm@x");
        let (_, d) = process_endpoint(Backend::Shm, "x", Some("shm:/tmp/e"), &TlsFlags::default()).unwrap();
        assert_eq!(d, "shm:/tmp/e");
        let (_, d) = process_endpoint(Backend::Net, "x", Some("tcp:127.0.0.1:7000"), &TlsFlags::default()).unwrap();
        assert_eq!(d, "tcp:127.0.0.1:7000");
        // Without --peer the listener's port is chosen by the kernel, so the
        // descriptor is filled in by `connect` once the channel listens.
        let (_, d) = process_endpoint(Backend::Net, "x", None, &TlsFlags::default()).unwrap();
        assert_eq!(d, "");
        for (b, peer) in
            [(Backend::Shm, Some("tcp:1.2.3.4:5")), (Backend::Net, Some("shm@x")), (Backend::UdsCopy, None)]
        {
            assert!(
                matches!(process_endpoint(b, "x", peer, &TlsFlags::default()), Err(CliError::Usage(_))),
                "{b:?} {peer:?}"
            );
        }
    }
}
