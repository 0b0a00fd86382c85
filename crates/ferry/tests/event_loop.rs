//! The event-loop API on every backend, with real parts: a channel's fd in
//! `poll(2)` and in an application's own epoll set (level- and
//! edge-triggered), the fd through setup, a peer killed or stopped while
//! we sleep on it, TCP keep-alives served only when the fd says so, a full
//! outgoing queue woken by the consumer, `wait_any` across backends and a
//! `Selector` of many channels (fairness, churn, nesting, fd counts).
//!
//! Shared-memory and TCP peers are other processes: the test binary runs
//! itself again (`event_loop_child`, selected by environment) and takes
//! commands on its stdin, answering with `@ev ...` lines on its stdout.
//! Every wait is bounded; the tests assert on outcomes (which events, how
//! many, which bytes), never on how long something took.

mod support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rustix::event::{epoll, PollFd, PollFlags, Timespec};

use ferry::{
    wait_any, Allocator, BindParams, Buffer, Channel, ChannelSetup, ChannelState, Direction, Domain, Endpoint,
    ErrorKind, Event, NetOptions, PoolConstraints, PoolPolicy, Selector, WaitError,
};

use support::payload::{check, fill};

/// The bound of every wait that should end well before it.
const T: Duration = Duration::from_secs(10);
/// A TCP peer timeout whose keep-alive timer (a quarter of it) fires after
/// every wait here: only the traffic wakes such a channel.
const QUIET: Duration = Duration::from_secs(60);
const SIZE: usize = 4096;

// ------------------------------------------------------------------ fds

fn ts(d: Duration) -> Timespec {
    Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) }
}

/// Whether `fd` becomes readable within `within` (`poll(2)`).
fn readable(fd: BorrowedFd<'_>, within: Duration) -> bool {
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    loop {
        match rustix::event::poll(&mut fds, Some(&ts(within))) {
            Ok(n) => return n > 0,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => panic!("poll: {e}"),
        }
    }
}

/// An application's own epoll set.
struct AppEpoll {
    fd: OwnedFd,
    events: Vec<epoll::Event>,
}

impl AppEpoll {
    fn new() -> AppEpoll {
        AppEpoll { fd: epoll::create(epoll::CreateFlags::CLOEXEC).unwrap(), events: Vec::with_capacity(64) }
    }

    /// Watch `fd` for input under `key`, edge-triggered if `edge`.
    fn add(&self, fd: BorrowedFd<'_>, key: u64, edge: bool) {
        let flags = if edge { epoll::EventFlags::IN | epoll::EventFlags::ET } else { epoll::EventFlags::IN };
        epoll::add(&self.fd, fd, epoll::EventData::new_u64(key), flags).unwrap();
    }

    /// The keys that fired within `within` (empty on timeout).
    fn wait(&mut self, within: Duration) -> Vec<u64> {
        self.events.clear();
        loop {
            match epoll::wait(&self.fd, rustix::buffer::spare_capacity(&mut self.events), Some(&ts(within))) {
                Ok(_) => return self.events.iter().map(|e| e.data.u64()).collect(),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => panic!("epoll_wait: {e}"),
            }
        }
    }
}

/// What the doorbells (eventfds) in `ch`'s wake set have counted: the
/// channel's fd is an epoll set, whose fdinfo lists the fds it watches.
fn bell_count(ch: &Channel) -> u64 {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", ch.as_fd().as_raw_fd())).unwrap();
    let (mut bells, mut total) = (0, 0);
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("tfd:") else { continue };
        let tfd: i32 = rest.split_whitespace().next().unwrap().parse().unwrap();
        let Ok(target) = std::fs::read_to_string(format!("/proc/self/fdinfo/{tfd}")) else { continue };
        if let Some(count) = target.lines().find_map(|l| l.strip_prefix("eventfd-count:")) {
            bells += 1;
            total += u64::from_str_radix(count.trim(), 16).unwrap();
        }
    }
    assert!(bells >= 1, "no doorbell in the channel's wake set:\n{info}");
    total
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Every event `ch` has now.
fn drain(ch: &mut Channel) -> Vec<Event> {
    std::iter::from_fn(|| ch.poll()).collect()
}

/// The next event of `ch`, waiting the application's way: poll, arm, then
/// sleep on the fd in `poll(2)`.
fn next_via_fd(ch: &mut Channel) -> Event {
    let end = Instant::now() + T;
    loop {
        if let Some(ev) = ch.poll() {
            return ev;
        }
        assert!(Instant::now() < end, "no event within {T:?} (state {:?})", ch.state());
        if ch.arm() {
            readable(ch.as_fd(), T);
        }
    }
}

fn seq_of(meta: &[u8]) -> u64 {
    u64::from_le_bytes(meta[..8].try_into().unwrap())
}

/// A buffer of `alloc` holding the pattern of `seq`.
fn filled(alloc: &Allocator, seq: u64) -> Buffer {
    let mut b = alloc.alloc().expect("a free buffer");
    fill(b.as_mut_slice().unwrap(), seq);
    b
}

/// A moved buffer that arrived: its bytes are the pattern of its meta's
/// sequence number. Returns the buffer, the meta and the sequence number.
fn received(ev: Event) -> (Buffer, Vec<u8>, u64) {
    match ev {
        Event::MoveReceived { buffer, meta } => {
            let seq = seq_of(&meta);
            assert!(check(&buffer, seq), "buffer {seq} arrived with the wrong bytes");
            (buffer, meta.to_vec(), seq)
        }
        ev => panic!("expected a moved buffer, got {ev:?}"),
    }
}

// ------------------------------------------------------------ backends

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Local,
    Shm,
    Tcp,
}

/// A channel created on a fresh endpoint of `kind`, and the endpoint's
/// description for a child process (`shm:NAME`, `tcp:ADDR`) or the local
/// endpoint to bind to.
fn create(kind: Kind, domain: &Domain, setup: ChannelSetup, timeout: Duration) -> (Channel, String, Endpoint) {
    let (ep, spec) = match kind {
        Kind::Local => (Endpoint::local(), String::new()),
        Kind::Shm => {
            let name = support::unique_name("evloop");
            (Endpoint::shm_abstract(&name), format!("shm:{name}"))
        }
        Kind::Tcp => {
            (Endpoint::tcp_with("127.0.0.1:0".parse().unwrap(), NetOptions::with_peer_timeout(timeout)), String::new())
        }
    };
    let ch = Channel::create(domain, &ep, setup).expect("create");
    let spec = match kind {
        Kind::Tcp => format!("tcp:{}", ch.listen_addr().expect("listening")),
        _ => spec,
    };
    (ch, spec, ep)
}

fn rx_setup() -> ChannelSetup {
    ChannelSetup { direction: Direction::Rx, ..ChannelSetup::default() }
}

// -------------------------------------------------------- child processes

/// A peer process: the test binary run again as `event_loop_child`.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    /// Start a peer that binds to `spec` and plays `role` (TCP peer
    /// timeout `timeout`).
    fn spawn(spec: &str, role: &str, timeout: Duration) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "event_loop_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env("FERRY_EV_EP", spec)
            .env("FERRY_EV_ROLE", role)
            .env("FERRY_EV_TIMEOUT_MS", timeout.as_millis().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // The harness may print ahead of our text on the same line.
                if let Some(at) = line.find("@ev ") {
                    if tx.send(line[at + 4..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let stdin = child.stdin.take();
        Peer { child, stdin, lines }
    }

    fn send(&mut self, cmd: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{cmd}").expect("child stdin");
        stdin.flush().unwrap();
    }

    /// The child's next line; it must start with `word`.
    fn expect(&self, word: &str) -> String {
        let line = self.lines.recv_timeout(T).unwrap_or_else(|_| panic!("child: no `{word}` within {T:?}"));
        assert!(line.starts_with(word), "child said `{line}`, expected `{word}`");
        line
    }

    /// The child's next line, if one came already.
    fn try_line(&self) -> Option<String> {
        self.lines.try_recv().ok()
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        let r = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(r, 0, "kill");
    }

    /// SIGKILL, and wait until it is gone.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Wait for a clean exit.
    fn finish(mut self) {
        drop(self.stdin.take());
        let status = support::payload::wait_exit(&mut self.child, T);
        assert!(status.success(), "child failed: {status:?}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sleep on `ch`'s fd in an application epoll set (edge-triggered if
/// `edge`), serving it on each wake (poll until `None`, arm), for at least
/// `min` and until `done` says so (bounded by `T` more). Returns how many
/// times the set woke and every event seen.
fn idle_in_epoll(ch: &mut Channel, min: Duration, edge: bool, mut done: impl FnMut() -> bool) -> (usize, Vec<Event>) {
    let mut ep = AppEpoll::new();
    ep.add(ch.as_fd(), 1, edge);
    let start = Instant::now();
    let (mut wakes, mut events) = (0, Vec::new());
    loop {
        events.extend(drain(ch));
        if ch.state() == ChannelState::Closed {
            break;
        }
        let elapsed = start.elapsed();
        if elapsed >= min && done() {
            break;
        }
        assert!(elapsed < min + T, "the peer did not finish");
        if !ch.arm() {
            continue;
        }
        // Until `min`, wake only for the fd; after it, also look at `done`.
        let sleep = min.checked_sub(elapsed).filter(|l| !l.is_zero()).unwrap_or(Duration::from_millis(50));
        if !ep.wait(sleep).is_empty() {
            wakes += 1;
        }
    }
    (wakes, events)
}

/// The peer process. It binds to `FERRY_EV_EP`, accepts every pool, and
/// plays `FERRY_EV_ROLE`: `cmd` takes commands on stdin (`pool`: assign a
/// pool of 1100 buffers; `accept`: serve the channel until the peer's
/// pool request came (accepted); `send N`: move N buffers, taking passes back as it
/// needs buffers; `take N`: receive N moved buffers and hold them; `idle
/// MS`: sleep in its own epoll for MS ms serving the channel on each wake;
/// `quit`: tear down), `hold` receives moved buffers and holds them until
/// killed.
#[test]
#[ignore = "run as a child process by the other tests"]
fn event_loop_child() {
    let (Ok(spec), Ok(role)) = (std::env::var("FERRY_EV_EP"), std::env::var("FERRY_EV_ROLE")) else { return };
    let timeout: u64 = std::env::var("FERRY_EV_TIMEOUT_MS").unwrap().parse().unwrap();
    let ep = match spec.split_once(':').unwrap() {
        ("shm", name) => Endpoint::shm_abstract(name),
        ("tcp", addr) => {
            Endpoint::tcp_with(addr.parse().unwrap(), NetOptions::with_peer_timeout(Duration::from_millis(timeout)))
        }
        other => panic!("endpoint {other:?}"),
    };
    let d = Domain::new("child");
    let mut ch = Channel::connect(&d, &ep, BindParams::default(), T).expect("connect");
    ch.set_pool_policy(PoolPolicy::AcceptAndReport);
    println!("@ev bound");
    let mut kept = Vec::new();
    if role == "hold" {
        loop {
            match ch.wait(Some(Duration::from_secs(30))) {
                Ok(Event::PoolAssignRequest(_)) => {}
                Ok(ev @ Event::MoveReceived { .. }) => {
                    kept.push(received(ev).0);
                    println!("@ev held {}", kept.len());
                }
                other => panic!("child: {other:?}"),
            }
        }
    }
    let mut alloc = None;
    let mut seq = 0u64;
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let mut words = line.split_whitespace();
        let cmd = words.next().unwrap_or_default();
        let n: u64 = words.next().map_or(0, |w| w.parse().unwrap());
        match cmd {
            "pool" => {
                let a = Allocator::new(&d, 1100, SIZE, PoolConstraints::default()).unwrap();
                ch.assign_pool_and_wait(a.pool(), T).unwrap();
                alloc = Some(a);
                println!("@ev pooled");
            }
            "send" => {
                let a = alloc.as_ref().expect("a pool");
                for _ in 0..n {
                    while a.available() == 0 {
                        match ch.wait(Some(T)) {
                            Ok(Event::BufferPassed { .. }) => {}
                            other => panic!("child: {other:?}"),
                        }
                    }
                    ch.move_buffer(filled(a, seq), &seq.to_le_bytes()).unwrap();
                    seq += 1;
                }
                ch.flush().unwrap();
                println!("@ev sent {n}");
            }
            "accept" => {
                match ch.wait(Some(T)) {
                    Ok(Event::PoolAssignRequest(_)) => {}
                    other => panic!("child: {other:?}"),
                }
                println!("@ev accepted");
            }
            "take" => {
                let mut took = 0;
                while took < n {
                    match ch.wait(Some(T)) {
                        Ok(ev @ Event::MoveReceived { .. }) => {
                            kept.push(received(ev).0);
                            took += 1;
                        }
                        Ok(Event::PoolAssignRequest(_)) => {}
                        other => panic!("child: {other:?}"),
                    }
                }
                println!("@ev took {n}");
            }
            "idle" => {
                let (wakes, events) = idle_in_epoll(&mut ch, Duration::from_millis(n), false, || true);
                println!("@ev idle wakes={wakes} events={}", events.len());
                assert!(events.is_empty(), "child: {events:?}");
            }
            "quit" => {
                ch.teardown().unwrap();
                loop {
                    match ch.wait(Some(T)) {
                        Ok(Event::Closed { .. }) => break,
                        Ok(Event::BufferPassed { .. }) => {}
                        other => panic!("child: {other:?}"),
                    }
                }
                println!("@ev closed");
                return;
            }
            other => panic!("child: command {other:?}"),
        }
    }
}

// ------------------------------------------------------------- senders

/// The sending end of a channel whose receiving end the test holds: the
/// local source in this thread, or a child process.
#[allow(clippy::large_enum_variant)] // a few per test
enum Sender {
    Local { tx: Channel, alloc: Allocator, seq: u64 },
    Remote(Peer),
}

impl Sender {
    /// Move `n` buffers (the local source takes passes back as it needs
    /// buffers).
    fn send(&mut self, n: u64) {
        match self {
            Sender::Local { tx, alloc, seq } => {
                for _ in 0..n {
                    while alloc.available() == 0 {
                        match tx.wait(Some(T)) {
                            Ok(Event::BufferPassed { .. }) => {}
                            other => panic!("{other:?}"),
                        }
                    }
                    tx.move_buffer(filled(alloc, *seq), &seq.to_le_bytes()).unwrap();
                    *seq += 1;
                }
            }
            Sender::Remote(peer) => {
                peer.send(&format!("send {n}"));
                peer.expect("sent");
            }
        }
    }

    fn finish(self, rx: &mut Channel) {
        match self {
            Sender::Local { mut tx, .. } => {
                tx.teardown().unwrap();
                assert!(matches!(rx.wait(Some(T)), Ok(Event::Closed { by_peer: true })));
                loop {
                    match tx.wait(Some(T)) {
                        Ok(Event::Closed { .. }) => break,
                        Ok(Event::BufferPassed { .. }) => {}
                        other => panic!("{other:?}"),
                    }
                }
            }
            Sender::Remote(mut peer) => {
                peer.send("quit");
                match rx.wait(Some(T)) {
                    Ok(Event::Closed { by_peer: true }) => {}
                    other => panic!("{other:?}"),
                }
                peer.expect("closed");
                peer.finish();
            }
        }
    }
}

/// A receiving channel of `kind` (the test's), its sender with a pool
/// assigned (1100 buffers), every setup event taken.
fn receiver(kind: Kind, sink: &Domain) -> (Channel, Sender) {
    let (mut rx, spec, ep) = create(kind, sink, rx_setup(), QUIET);
    rx.set_pool_policy(PoolPolicy::AcceptAndReport);
    let sender = if kind == Kind::Local {
        let src = Domain::new("source");
        let mut tx = Channel::bind(&src, &ep, BindParams::default()).unwrap();
        rx.wait_connected(T).unwrap();
        tx.wait_connected(T).unwrap();
        let alloc = Allocator::new(&src, 1100, SIZE, PoolConstraints::default()).unwrap();
        tx.assign_pool(alloc.pool()).unwrap();
        assert!(matches!(rx.wait(Some(T)), Ok(Event::PoolAssignRequest(_))));
        assert!(matches!(tx.wait(Some(T)), Ok(Event::PoolAssigned(_))));
        Sender::Local { tx, alloc, seq: 0 }
    } else {
        let mut peer = Peer::spawn(&spec, "cmd", QUIET);
        rx.wait_connected(T).unwrap();
        peer.expect("bound");
        peer.send("pool");
        assert!(matches!(rx.wait(Some(T)), Ok(Event::PoolAssignRequest(_))));
        peer.expect("pooled");
        Sender::Remote(peer)
    };
    assert!(drain(&mut rx).is_empty());
    (rx, sender)
}

/// Take `n` moved buffers from `rx` (which has them already), check their
/// bytes and hand them back unfilled; their sequence numbers.
fn take_now(rx: &mut Channel, n: usize) -> Vec<u64> {
    take(rx, n, true)
}

/// Take `n` moved buffers from `rx`, which has them already (`now`) or
/// will have them (TCP: a wake-up may come with part of a frame).
fn take(rx: &mut Channel, n: usize, now: bool) -> Vec<u64> {
    let mut seqs = Vec::new();
    while seqs.len() < n {
        let ev = match rx.poll() {
            Some(ev) => ev,
            None if !now => next_via_fd(rx),
            None => panic!("only {} of {n} messages were there", seqs.len()),
        };
        let (buffer, meta, seq) = received(ev);
        rx.pass_unfilled(buffer, &meta).unwrap();
        seqs.push(seq);
    }
    seqs
}

// ------------------------------------------------- 1. the fd protocol

#[derive(Clone, Copy, Debug)]
enum Waiter {
    Poll,
    Level,
    Edge,
}

/// arm → the peer sends → the fd is readable → poll gives the message, in
/// `poll(2)` and in an application's epoll set, level- and
/// edge-triggered, several rounds each (an edge-triggered set fires again
/// only because every wake is followed by poll-until-None and arm). Then a
/// burst of 1000 messages (400 over TCP) while we are not armed: the
/// doorbell is rung at most once (not per message: its eventfd's count
/// says so), all of them are there to poll, and after arming the fd works
/// again.
fn fd_protocol(kind: Kind) {
    let sink = Domain::new("sink");
    let (mut rx, mut sender) = receiver(kind, &sink);
    let mut next_seq = 0;
    for waiter in [Waiter::Poll, Waiter::Level, Waiter::Edge] {
        let mut ep = AppEpoll::new();
        if !matches!(waiter, Waiter::Poll) {
            ep.add(rx.as_fd(), 42, matches!(waiter, Waiter::Edge));
        }
        for round in 0..3 {
            assert!(rx.poll().is_none());
            assert!(rx.arm(), "{waiter:?} {round}: nothing is waiting, the channel arms");
            assert!(!readable(rx.as_fd(), Duration::ZERO), "{waiter:?} {round}: armed and quiet");
            sender.send(1);
            match waiter {
                Waiter::Poll => assert!(readable(rx.as_fd(), T), "{waiter:?} {round}: the fd did not wake"),
                _ => assert_eq!(ep.wait(T), vec![42], "{waiter:?} {round}: the epoll set did not wake"),
            }
            assert_eq!(take(&mut rx, 1, kind != Kind::Tcp), vec![next_seq]);
            next_seq += 1;
            assert!(drain(&mut rx).is_empty());
        }
    }
    // A burst while we are not armed (poll returned None, no arm). The TCP
    // sender (another process) flushes once and then waits for its next
    // command, so its burst must fit in what the kernel takes between the
    // two sockets without this end reading: the unsent bytes the sender's
    // socket accepts (1 MiB, Ferry's bound on a plain link) and what the
    // receiver's buffer holds before it has grown.
    let burst: u64 = if kind == Kind::Tcp { 200 } else { 1000 };
    assert!(drain(&mut rx).is_empty());
    if kind != Kind::Tcp {
        assert!(bell_count(&rx) <= 1, "rung before the burst: {}", bell_count(&rx));
    }
    sender.send(burst);
    if kind != Kind::Tcp {
        let rings = bell_count(&rx);
        assert!(rings <= 1, "{kind:?}: the doorbell was rung {rings} times for {burst} messages to an unarmed end");
    }
    let mut got = Vec::new();
    let end = Instant::now() + T;
    while (got.len() as u64) < burst {
        // TCP: the bytes may still be on their way.
        match rx.poll() {
            Some(ev) => {
                let (buffer, meta, seq) = received(ev);
                rx.pass_unfilled(buffer, &meta).unwrap();
                got.push(seq);
            }
            None if kind == Kind::Tcp => {
                assert!(Instant::now() < end, "only {} of {burst} arrived", got.len());
                if rx.arm() {
                    readable(rx.as_fd(), T);
                }
            }
            None => panic!("only {} of {burst} messages were there", got.len()),
        }
    }
    assert_eq!(got, (next_seq..next_seq + burst).collect::<Vec<_>>(), "every message, in order");
    next_seq += burst;
    assert!(drain(&mut rx).is_empty());
    assert!(rx.arm());
    if kind != Kind::Tcp {
        assert_eq!(bell_count(&rx), 0, "arming takes the old ring");
    }
    assert!(!readable(rx.as_fd(), Duration::ZERO));
    sender.send(1);
    assert!(readable(rx.as_fd(), T), "the fd works again after the burst");
    assert_eq!(take(&mut rx, 1, kind != Kind::Tcp), vec![next_seq]);
    sender.finish(&mut rx);
}

#[test]
fn fd_protocol_local() {
    fd_protocol(Kind::Local);
}

#[test]
fn fd_protocol_shm() {
    fd_protocol(Kind::Shm);
}

#[test]
fn fd_protocol_tcp() {
    fd_protocol(Kind::Tcp);
}

// --------------------------------------- 2. the fd is stable over setup

/// A creator's fd registered in epoll sets (level- and edge-triggered)
/// before anybody binds: the bind wakes both, and the same fd then carries
/// the connected channel's messages.
fn fd_through_setup(kind: Kind) {
    let d = Domain::new("creator");
    let (mut tx, spec, ep) = create(kind, &d, ChannelSetup::default(), QUIET);
    let (mut level, mut edge) = (AppEpoll::new(), AppEpoll::new());
    level.add(tx.as_fd(), 1, false);
    edge.add(tx.as_fd(), 2, true);
    let fd_before = tx.as_fd().as_raw_fd();
    assert!(tx.poll().is_none());
    assert!(tx.arm(), "nobody bound yet: the creator arms");
    assert!(level.wait(Duration::ZERO).is_empty(), "quiet before the bind");
    let (mut local_rx, mut peer) = (None, None);
    match kind {
        Kind::Local => local_rx = Some(Channel::bind(&Domain::new("binder"), &ep, BindParams::default()).unwrap()),
        _ => peer = Some(Peer::spawn(&spec, "cmd", QUIET)),
    }
    assert_eq!(level.wait(T), vec![1], "the bind woke the level-triggered set");
    assert_eq!(edge.wait(T), vec![2], "the bind woke the edge-triggered set");
    assert!(matches!(next_via_fd(&mut tx), Event::BindRequest { .. }));
    assert_eq!(tx.as_fd().as_raw_fd(), fd_before, "the same fd");
    assert_eq!(tx.state(), ChannelState::Connected);
    // The connected channel goes on waking the sets it was put in.
    let alloc = Allocator::new(&d, 4, SIZE, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    assert!(tx.poll().is_none());
    assert!(tx.arm());
    if let Some(rx) = local_rx.as_mut() {
        rx.wait_connected(T).unwrap();
        rx.set_pool_policy(PoolPolicy::AcceptAndReport);
        assert!(matches!(rx.wait(Some(T)), Ok(Event::PoolAssignRequest(_))));
    } else {
        let peer = peer.as_mut().unwrap();
        peer.expect("bound");
        peer.send("accept");
        peer.expect("accepted");
    }
    assert_eq!(edge.wait(T), vec![2], "the pool's acceptance woke the edge-triggered set");
    assert!(matches!(next_via_fd(&mut tx), Event::PoolAssigned(_)));
    if let Some(mut peer) = peer {
        peer.send("quit");
        assert!(matches!(next_via_fd(&mut tx), Event::Closed { by_peer: true }));
        peer.expect("closed");
        peer.finish();
    }
}

#[test]
fn fd_through_setup_local() {
    fd_through_setup(Kind::Local);
}

#[test]
fn fd_through_setup_shm() {
    fd_through_setup(Kind::Shm);
}

#[test]
fn fd_through_setup_tcp() {
    fd_through_setup(Kind::Tcp);
}

/// A loop that takes one event per wake-up of a level-triggered wait and
/// arms only when `poll` has nothing: it relies on the fd staying
/// readable until the next `arm`. A creator that sleeps on its fd before
/// anybody binds, is woken by the bind and takes the bind request, and
/// then sleeps again without arming, must still be woken for the pool the
/// binder assigns right after it connected (the message may already wait
/// in the channel's queue, with nobody to ring for it).
fn one_event_per_wakeup_after_connect(kind: Kind) {
    let d = Domain::new("creator");
    let (mut rx, _, ep) = create(kind, &d, rx_setup(), QUIET);
    let ep = match kind {
        Kind::Tcp => Endpoint::tcp(rx.listen_addr().expect("listening")),
        _ => ep,
    };
    assert!(rx.poll().is_none());
    assert!(rx.arm(), "nobody bound yet: the creator arms");
    let (done, wait_done) = mpsc::channel::<()>();
    let binder = std::thread::spawn(move || {
        let b = Domain::new("binder");
        let mut tx = Channel::bind(&b, &ep, BindParams::default()).expect("bind");
        tx.wait_connected(T).expect("connected");
        let alloc = Allocator::new(&b, 4, SIZE, PoolConstraints::default()).unwrap();
        tx.assign_pool(alloc.pool()).unwrap();
        tx.flush().unwrap();
        assert!(matches!(tx.wait(Some(T)), Ok(Event::PoolAssigned(_))));
        // Stay connected until the creator has seen everything.
        let _ = wait_done.recv_timeout(T);
    });
    let mut seen = Vec::new();
    while seen.len() < 2 {
        assert!(readable(rx.as_fd(), T), "{kind:?}: the fd stayed quiet with an event due (seen so far: {seen:?})");
        match rx.poll() {
            Some(Event::PoolAssignRequest(req)) => {
                rx.respond_pool(req.pool, true).unwrap();
                rx.flush().unwrap();
                seen.push("pool offered");
            }
            Some(Event::BindRequest { .. }) => seen.push("bind request"),
            Some(ev) => panic!("{kind:?}: unexpected {ev:?}"),
            None => {
                rx.arm();
            }
        }
    }
    assert_eq!(seen, ["bind request", "pool offered"]);
    done.send(()).unwrap();
    binder.join().unwrap();
}

#[test]
fn one_event_per_wakeup_after_connect_local() {
    one_event_per_wakeup_after_connect(Kind::Local);
}

#[test]
fn one_event_per_wakeup_after_connect_shm() {
    one_event_per_wakeup_after_connect(Kind::Shm);
}

#[test]
fn one_event_per_wakeup_after_connect_tcp() {
    one_event_per_wakeup_after_connect(Kind::Tcp);
}

// ----------------------------------------------- 3. a peer killed

/// `kill -9` of a peer holding five of our buffers while we sleep in an
/// epoll set on the channel's fd: the set wakes, poll reports the peer gone,
/// the channel is closed, every buffer is back in the allocator, and the
/// closed channel's fd is quiet.
fn killed_peer_wakes_the_fd(kind: Kind) {
    let d = Domain::new("parent");
    let (mut tx, spec, _) = create(kind, &d, ChannelSetup::default(), QUIET);
    let mut peer = Peer::spawn(&spec, "hold", QUIET);
    tx.wait_connected(T).unwrap();
    peer.expect("bound");
    let alloc = Allocator::new(&d, 8, 64 << 10, PoolConstraints::default()).unwrap();
    tx.assign_pool_and_wait(alloc.pool(), T).unwrap();
    for seq in 0..5 {
        tx.move_buffer(filled(&alloc, seq), &seq.to_le_bytes()).unwrap();
    }
    tx.flush().unwrap();
    for n in 1..=5 {
        assert_eq!(peer.expect("held"), format!("held {n}"));
    }
    assert_eq!(alloc.available(), 3);
    let mut ep = AppEpoll::new();
    ep.add(tx.as_fd(), 9, true);
    assert!(drain(&mut tx).is_empty());
    assert!(tx.arm());
    peer.kill();
    let end = Instant::now() + T;
    assert_eq!(ep.wait(T), vec![9], "the peer's death did not wake the set");
    let ev = loop {
        if let Some(ev) = tx.poll() {
            break ev;
        }
        assert!(Instant::now() < end, "no event after the peer's death");
        // Edge-triggered: poll until None and arm before each wait.
        if tx.arm() {
            ep.wait(T);
        }
    };
    match (kind, &ev) {
        (_, Event::Error(err)) if matches!(err.kind(), ErrorKind::PeerGone) => {}
        (Kind::Tcp, Event::Error(err)) if matches!(err.kind(), ErrorKind::PeerUnresponsive(_)) => {}
        _ => panic!("{kind:?}: expected the peer gone, got {ev:?}"),
    }
    assert_eq!(tx.state(), ChannelState::Closed);
    assert_eq!(alloc.available(), 8, "the five buffers the dead peer held are back");
    assert!(tx.poll().is_none());
    assert!(tx.arm(), "a closed channel is armed");
    assert!(!readable(tx.as_fd(), Duration::from_millis(200)), "{kind:?}: the closed channel's fd stays readable");
}

#[test]
fn killed_peer_wakes_the_fd_shm() {
    killed_peer_wakes_the_fd(Kind::Shm);
}

#[test]
fn killed_peer_wakes_the_fd_tcp() {
    killed_peer_wakes_the_fd(Kind::Tcp);
}

// ------------------------------------------------ 4. TCP keep-alives

const SHORT: Duration = Duration::from_millis(400);

/// Both ends with a 400 ms peer timeout, each sleeping in its own epoll
/// set (one edge-, one level-triggered) and serving the channel only when
/// its fd says so: after more than 3 s (seven timeouts) neither has seen an
/// event, so the keep-alives went out on time from the fd's timer alone;
/// the fd did not spin either (far fewer wakes than a busy loop).
#[test]
fn tcp_keepalive_while_sleeping_in_app_epoll() {
    let d = Domain::new("parent");
    let (mut ch, spec, _) = create(Kind::Tcp, &d, ChannelSetup::default(), SHORT);
    let mut peer = Peer::spawn(&spec, "cmd", SHORT);
    ch.wait_connected(T).unwrap();
    peer.expect("bound");
    peer.send("idle 3500");
    let mut said = None;
    let (wakes, events) = idle_in_epoll(&mut ch, Duration::from_secs(3), true, || {
        said = said.take().or_else(|| peer.try_line());
        said.is_some()
    });
    assert!(events.is_empty(), "the idle channel had events: {events:?}");
    assert!(wakes >= 1, "the keep-alive timer never woke the set");
    assert!(wakes < 2000, "the fd spun: {wakes} wakes");
    let said = said.unwrap();
    assert!(said.starts_with("idle") && said.ends_with("events=0"), "child: {said}");
    peer.send("quit");
    assert!(matches!(next_via_fd(&mut ch), Event::Closed { by_peer: true }));
    peer.expect("closed");
    peer.finish();
}

/// The converse: a peer stopped with SIGSTOP sends no keep-alives (its
/// kernel still acknowledges): our fd fires on its own timer and poll
/// reports the peer unresponsive.
#[test]
fn tcp_stopped_peer_is_unresponsive() {
    let d = Domain::new("parent");
    let (mut ch, spec, _) = create(Kind::Tcp, &d, ChannelSetup::default(), SHORT);
    let mut peer = Peer::spawn(&spec, "cmd", SHORT);
    ch.wait_connected(T).unwrap();
    peer.expect("bound");
    peer.send("idle 30000");
    // Both ends alive: a second of sleeping in epoll, nothing happens.
    let (_, events) = idle_in_epoll(&mut ch, Duration::from_secs(1), false, || true);
    assert!(events.is_empty(), "{events:?}");
    peer.signal(libc::SIGSTOP);
    let (_, events) = idle_in_epoll(&mut ch, Duration::ZERO, false, || false);
    assert_eq!(ch.state(), ChannelState::Closed);
    assert!(
        matches!(&events[..], [Event::Error(e)] if matches!(e.kind(), ErrorKind::PeerUnresponsive(_))),
        "{events:?}"
    );
    assert!(ch.arm());
    assert!(!readable(ch.as_fd(), Duration::from_millis(200)), "the closed channel's fd stays readable");
    peer.signal(libc::SIGCONT);
    peer.kill();
}

// ------------------------------------------------------------- 5. room

/// The consumer of a channel whose producer the test holds: a thread
/// (local) or a child process, told how many messages to take.
enum Consumer {
    Local(mpsc::Sender<u64>, mpsc::Receiver<u64>, std::thread::JoinHandle<()>),
    Remote(Peer),
}

impl Consumer {
    fn take(&mut self, n: u64) {
        match self {
            Consumer::Local(cmd, done, _) => {
                cmd.send(n).unwrap();
                assert_eq!(done.recv_timeout(T).expect("consumer thread"), n);
            }
            Consumer::Remote(peer) => {
                peer.send(&format!("take {n}"));
                peer.expect("took");
            }
        }
    }
}

/// A producer with a short queue fills it (QueueFull), arms: its fd is
/// quiet while the consumer takes nothing, and becomes readable once the
/// consumer takes messages (the ring's room handshake; TCP: the socket
/// takes more); then the refused send goes through. Every other round the
/// consumer makes room between the refusal and the arm: arm returns
/// `false` or the fd is readable (a producer must not sleep on room it
/// already has).
fn room(kind: Kind, depth: u32, size: usize) {
    let d = Domain::new("producer");
    let setup = ChannelSetup { queue_depth: depth, ..ChannelSetup::default() };
    // TCP: only the socket wakes the producer.
    let (mut tx, spec, ep) = create(kind, &d, setup, QUIET);
    let mut consumer = match kind {
        Kind::Local => {
            let (cmd, cmds) = mpsc::channel::<u64>();
            let (done_tx, done) = mpsc::channel();
            let h = std::thread::spawn(move || {
                let mut rx = Channel::connect(&Domain::new("consumer"), &ep, BindParams::default(), T).unwrap();
                rx.set_pool_policy(PoolPolicy::AcceptAndReport);
                let mut kept = Vec::new();
                let mut pool_seen = false;
                // Serve the pool request, then take only what we are told.
                while !pool_seen {
                    pool_seen = matches!(rx.wait(Some(T)), Ok(Event::PoolAssignRequest(_)));
                }
                for n in cmds {
                    for _ in 0..n {
                        kept.push(received(rx.wait(Some(T)).expect("a message")).0);
                    }
                    done_tx.send(n).unwrap();
                }
            });
            tx.wait_connected(T).unwrap();
            Consumer::Local(cmd, done, h)
        }
        _ => {
            let mut peer = Peer::spawn(&spec, "cmd", QUIET);
            tx.wait_connected(T).unwrap();
            peer.expect("bound");
            peer.send("accept");
            Consumer::Remote(peer)
        }
    };
    let alloc = Allocator::new(&d, 64, size, PoolConstraints::default()).unwrap();
    tx.assign_pool_and_wait(alloc.pool(), T).unwrap();
    if let Consumer::Remote(peer) = &consumer {
        peer.expect("accepted");
    }
    let (mut seq, mut taken) = (0u64, 0u64);
    // Move `first` (if any), then new buffers, until the queue is full:
    // the buffer refused.
    let fill = |tx: &mut Channel, first: Option<Buffer>, seq: &mut u64, round: u32| -> Buffer {
        let mut next = first;
        loop {
            let b = match next.take() {
                Some(b) => b,
                None => {
                    assert!(alloc.available() > 0, "round {round}: {seq} buffers sent and never a full queue");
                    filled(&alloc, *seq)
                }
            };
            match tx.move_buffer(b, &seq.to_le_bytes()) {
                Ok(()) => *seq += 1,
                Err(r) if r.error == ErrorKind::QueueFull => return r.into_inner(),
                Err(r) => panic!("{}", r.error),
            }
        }
    };
    for round in 0..4 {
        let mut refused = fill(&mut tx, None, &mut seq, round);
        assert!(drain(&mut tx).is_empty());
        if round % 2 == 0 {
            // TCP: the kernel may go on taking what was written for a while
            // after the refusal (loopback delivery deferred on a loaded
            // machine, the peer's receive window growing), so the link may
            // find room again when it arms: fill again until it asks for
            // room and stays quiet. Local and shm never find room alone.
            let end = Instant::now() + T;
            while !tx.arm() || readable(tx.as_fd(), Duration::ZERO) {
                assert!(
                    kind == Kind::Tcp && Instant::now() < end,
                    "round {round}: a full queue arms (asking for room) and stays quiet while the consumer takes nothing"
                );
                refused = fill(&mut tx, Some(refused), &mut seq, round);
                assert!(drain(&mut tx).is_empty());
            }
        }
        // TCP: the socket takes more once its buffers drain: take every
        // message surely written (those still in our out queue are not).
        let take = if kind == Kind::Tcp { seq - taken - u64::from(depth) } else { 1 };
        if round % 2 == 0 {
            consumer.take(take);
            assert!(readable(tx.as_fd(), T), "round {round}: room did not wake the producer");
        } else {
            // Room made between the refused send and the arm: no wake-up
            // will come for it, so arm must say so.
            consumer.take(take);
            if tx.arm() {
                assert!(readable(tx.as_fd(), T), "round {round}: room made before arming is never reported");
            }
        }
        taken += take;
        assert!(drain(&mut tx).is_empty());
        let mut refused = Some(refused);
        let end = Instant::now() + T;
        while let Some(b) = refused.take() {
            match tx.move_buffer(b, &seq.to_le_bytes()) {
                Ok(()) => seq += 1,
                Err(r) if r.error == ErrorKind::QueueFull => {
                    assert!(Instant::now() < end, "round {round}: the queue stayed full");
                    refused = Some(r.into_inner());
                    if tx.arm() {
                        readable(tx.as_fd(), T);
                    }
                }
                Err(r) => panic!("{}", r.error),
            }
        }
    }
    match consumer {
        Consumer::Local(cmd, _, thread) => {
            drop(cmd);
            thread.join().unwrap();
        }
        Consumer::Remote(peer) => drop(peer),
    }
}

#[test]
fn room_local() {
    room(Kind::Local, 2, SIZE);
}

#[test]
fn room_shm() {
    room(Kind::Shm, 4, SIZE);
}

#[test]
fn room_tcp() {
    // Buffers large enough that the socket's buffers fill before the
    // out queue does.
    room(Kind::Tcp, 2, 1 << 20);
}

/// The room handshake under a busy consumer, many times: each time the
/// producer finds its queue full it arms and sleeps on the fd alone
/// (nothing comes back to it: the consumer keeps every buffer), so a room
/// wake-up lost between asking for room and sleeping would leave it
/// asleep for good.
#[test]
fn room_handshake_never_loses_a_wakeup() {
    const TOTAL: u64 = 12_000;
    let d = Domain::new("producer");
    let ep = Endpoint::local();
    let setup = ChannelSetup { queue_depth: 2, ..ChannelSetup::default() };
    let mut tx = Channel::create(&d, &ep, setup).unwrap();
    let consumer = std::thread::spawn(move || {
        let mut rx = Channel::connect(&Domain::new("consumer"), &ep, BindParams::default(), T).unwrap();
        rx.set_pool_policy(PoolPolicy::AcceptAndReport);
        let mut kept = Vec::with_capacity(TOTAL as usize);
        let mut x = 0x9E37_79B9u32;
        while (kept.len() as u64) < TOTAL {
            match rx.poll() {
                Some(Event::MoveReceived { buffer, .. }) => {
                    kept.push(buffer);
                    // A short, varying pause so the queue fills often.
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    for _ in 0..(x % 64) {
                        std::hint::spin_loop();
                    }
                }
                Some(Event::PoolAssignRequest(_)) => {}
                Some(ev) => panic!("{ev:?}"),
                None => {
                    if rx.arm() {
                        assert!(readable(rx.as_fd(), T), "the consumer was never woken");
                    }
                }
            }
        }
        kept.len()
    });
    tx.wait_connected(T).unwrap();
    let alloc = Allocator::new(&d, TOTAL, SIZE, PoolConstraints::default()).unwrap();
    tx.assign_pool_and_wait(alloc.pool(), T).unwrap();
    let (mut fulls, mut sleeps) = (0u64, 0u64);
    for seq in 0..TOTAL {
        let mut b = alloc.alloc().unwrap();
        loop {
            match tx.move_buffer(b, &seq.to_le_bytes()) {
                Ok(()) => break,
                Err(r) if r.error == ErrorKind::QueueFull => {
                    fulls += 1;
                    b = r.into_inner();
                    assert!(tx.poll().is_none());
                    if tx.arm() {
                        sleeps += 1;
                        assert!(
                            readable(tx.as_fd(), T),
                            "message {seq}: the producer slept on a full queue and was never woken"
                        );
                    }
                }
                Err(r) => panic!("{}", r.error),
            }
        }
    }
    assert_eq!(consumer.join().unwrap() as u64, TOTAL);
    println!("{fulls} full queues, {sleeps} sleeps on the fd");
    assert!(sleeps > 0, "the producer never slept: the test proves nothing");
}

// ----------------------------------------------------------- 6. wait_any

/// One call over a local, a shared-memory and a TCP channel: each event is
/// reported for the channel that had it, with its bytes; a message on each
/// at once yields all three; a quiet set times out.
#[test]
fn wait_any_mixes_backends() {
    let sink = Domain::new("sink");
    let mut ends: Vec<(Channel, Sender)> = [Kind::Local, Kind::Shm, Kind::Tcp].map(|k| receiver(k, &sink)).into();
    let mut next_seq = [0u64; 3];
    for i in [2usize, 0, 1, 1, 2, 0, 2] {
        ends[i].1.send(1);
        let mut chans: Vec<&mut Channel> = ends.iter_mut().map(|(c, _)| c).collect();
        let (at, ev) = wait_any(&mut chans, Some(T)).expect("an event");
        assert_eq!(at, i, "the event of channel {i} reported for {at}");
        let (buffer, meta, seq) = received(ev);
        assert_eq!(seq, next_seq[i]);
        next_seq[i] += 1;
        chans[at].pass_unfilled(buffer, &meta).unwrap();
    }
    for (_, s) in ends.iter_mut() {
        s.send(1);
    }
    let mut seen = Vec::new();
    for _ in 0..3 {
        let mut chans: Vec<&mut Channel> = ends.iter_mut().map(|(c, _)| c).collect();
        let (at, ev) = wait_any(&mut chans, Some(T)).expect("an event");
        let (buffer, meta, seq) = received(ev);
        assert_eq!(seq, next_seq[at]);
        chans[at].pass_unfilled(buffer, &meta).unwrap();
        seen.push(at);
    }
    seen.sort();
    assert_eq!(seen, [0, 1, 2]);
    {
        let mut chans: Vec<&mut Channel> = ends.iter_mut().map(|(c, _)| c).collect();
        assert_eq!(wait_any(&mut chans, Some(Duration::from_millis(100))).unwrap_err(), WaitError::TimedOut);
    }
    for (mut rx, s) in ends {
        s.finish(&mut rx);
    }
}

/// A channel with hundreds of messages waiting (its peer another process
/// over shared memory) does not starve its siblings: a sibling's single
/// message comes within two calls per channel; and every message is taken.
#[test]
fn wait_any_is_fair() {
    let sink = Domain::new("sink");
    let mut ends: Vec<(Channel, Sender)> = [Kind::Shm, Kind::Local, Kind::Local].map(|k| receiver(k, &sink)).into();
    ends[0].1.send(500);
    ends[1].1.send(1);
    let n = ends.len();
    let (mut calls, mut busy) = (0, 0);
    loop {
        let mut chans: Vec<&mut Channel> = ends.iter_mut().map(|(c, _)| c).collect();
        let (at, ev) = wait_any(&mut chans, Some(T)).expect("an event");
        calls += 1;
        let (buffer, meta, _) = received(ev);
        chans[at].pass_unfilled(buffer, &meta).unwrap();
        if at == 1 {
            break;
        }
        assert_eq!(at, 0);
        busy += 1;
        assert!(calls <= 2 * n, "the sibling's message waited {calls} calls behind the busy channel");
    }
    // The busy channel's messages are all there, in order.
    let rest = take_now(&mut ends[0].0, 500 - busy);
    assert_eq!(rest, (busy as u64..500).collect::<Vec<_>>());
    for (mut rx, s) in ends {
        s.finish(&mut rx);
    }
}

// ---------------------------------------------------------- 7. Selector

/// 64 local channels fed by four threads (each waiting on its sixteen
/// channels with `wait_any` for its buffers to come back), plus a
/// shared-memory and a TCP channel fed by other processes, all in one
/// selector: every message arrives once, in order per channel, with its
/// bytes, and every buffer goes back.
#[test]
fn selector_accounts_for_every_message() {
    const PER: u64 = 40;
    const THREADS: usize = 4;
    const EACH: usize = 16;
    let server = Domain::new("server");
    let mut sel = Selector::new().unwrap();
    let mut producers = Vec::new();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Arc::new(std::sync::Mutex::new(done_rx));
    for _ in 0..THREADS {
        let mut eps = Vec::new();
        for _ in 0..EACH {
            let ep = Endpoint::local();
            let mut rx = Channel::create(&server, &ep, rx_setup()).unwrap();
            rx.set_pool_policy(PoolPolicy::AcceptAndReport);
            sel.insert(rx);
            eps.push(ep);
        }
        let done = done_rx.clone();
        producers.push(std::thread::spawn(move || {
            let d = Domain::new("producer");
            let alloc = Allocator::new(&d, (EACH * 4) as u64, SIZE, PoolConstraints::default()).unwrap();
            let mut chans: Vec<Channel> = eps
                .iter()
                .map(|ep| {
                    let mut tx = Channel::connect(&d, ep, BindParams::default(), T).unwrap();
                    tx.assign_pool_and_wait(alloc.pool(), T).unwrap();
                    tx
                })
                .collect();
            let (mut sent, mut back) = (vec![0u64; EACH], 0u64);
            while back < PER * EACH as u64 {
                for (i, tx) in chans.iter_mut().enumerate() {
                    while sent[i] < PER && alloc.available() > 0 {
                        let seq = (i as u64) << 32 | sent[i];
                        tx.move_buffer(filled(&alloc, seq), &seq.to_le_bytes()).unwrap();
                        sent[i] += 1;
                    }
                }
                let mut refs: Vec<&mut Channel> = chans.iter_mut().collect();
                match wait_any(&mut refs, Some(T)) {
                    Ok((_, Event::BufferPassed { .. })) => back += 1,
                    other => panic!("producer: {other:?}"),
                }
            }
            assert_eq!(alloc.available(), EACH * 4);
            // Keep the channels until the selector has seen everything.
            let _ = done.lock().unwrap().recv_timeout(T);
            drop(chans);
        }));
    }
    let mut remotes = Vec::new();
    for kind in [Kind::Shm, Kind::Tcp] {
        let (rx, sender) = receiver(kind, &server);
        remotes.push((sel.insert(rx), sender));
    }
    for (_, s) in remotes.iter_mut() {
        let Sender::Remote(peer) = s else { unreachable!() };
        peer.send(&format!("send {PER}"));
    }
    let mut next: HashMap<usize, u64> = HashMap::new();
    let (mut messages, mut bytes, mut binds) = (0u64, 0usize, 0);
    let total = PER * (THREADS * EACH + remotes.len()) as u64;
    while messages < total {
        let (key, ev) = sel.wait(Some(T)).unwrap_or_else(|e| panic!("only {messages} of {total} messages: {e}"));
        match ev {
            Event::BindRequest { .. } => binds += 1,
            Event::PoolAssignRequest(_) => {}
            ev @ Event::MoveReceived { .. } => {
                let (buffer, meta, seq) = received(ev);
                let want = next.entry(key).or_default();
                assert_eq!(seq & 0xffff_ffff, *want, "channel {key}: out of order");
                *want += 1;
                bytes += buffer.len();
                messages += 1;
                sel.get_mut(key).unwrap().pass(buffer, &meta).unwrap();
            }
            ev => panic!("channel {key}: {ev:?}"),
        }
    }
    assert_eq!(binds, THREADS * EACH);
    assert_eq!(next.len(), THREADS * EACH + remotes.len(), "every channel had its messages");
    assert!(next.values().all(|&n| n == PER));
    assert_eq!(bytes, total as usize * SIZE);
    for (_, s) in remotes.iter_mut() {
        let Sender::Remote(peer) = s else { unreachable!() };
        peer.expect("sent");
    }
    // The passes go out as the selector polls: serve until every producer
    // has all its buffers back.
    for _ in 0..THREADS {
        done_tx.send(()).unwrap();
    }
    let end = Instant::now() + T;
    while producers.iter().any(|p| !p.is_finished()) {
        assert!(Instant::now() < end, "a producer did not get its buffers back");
        match sel.wait(Some(Duration::from_millis(20))) {
            Err(_) | Ok((_, Event::Closed { .. })) => {}
            Ok((_, Event::Error(err))) if matches!(err.kind(), ErrorKind::PeerGone) => {}
            Ok((key, ev)) => panic!("channel {key}: {ev:?}"),
        }
    }
    for p in producers {
        p.join().unwrap();
    }
    for (key, s) in remotes {
        let mut rx = sel.remove(key).unwrap();
        s.finish(&mut rx);
    }
}

/// In a selector of eight channels, one with 300 messages waiting does not
/// starve a sibling: the sibling's message comes within two waits per
/// channel.
#[test]
fn selector_is_fair() {
    let sink = Domain::new("sink");
    let mut sel = Selector::new().unwrap();
    let mut senders = Vec::new();
    for _ in 0..8 {
        let (rx, s) = receiver(Kind::Local, &sink);
        senders.push((sel.insert(rx), s));
    }
    // Everything quiet: the selector arms every channel.
    assert_eq!(sel.wait(Some(Duration::from_millis(50))).unwrap_err(), WaitError::TimedOut);
    let (busy, sib) = (senders[3].0, senders[6].0);
    senders[3].1.send(300);
    senders[6].1.send(1);
    let mut waits = 0;
    let mut from_busy = 0;
    loop {
        let (key, ev) = sel.wait(Some(T)).expect("an event");
        waits += 1;
        let (buffer, meta, _) = received(ev);
        sel.get_mut(key).unwrap().pass_unfilled(buffer, &meta).unwrap();
        if key == sib {
            break;
        }
        assert_eq!(key, busy);
        from_busy += 1;
        assert!(waits <= 2 * 8, "the sibling waited {waits} waits behind the busy channel");
    }
    let rest = take_now(sel.get_mut(busy).unwrap(), 300 - from_busy);
    assert_eq!(rest.last(), Some(&299));
    for (key, s) in senders {
        let mut rx = sel.remove(key).unwrap();
        s.finish(&mut rx);
    }
    assert!(sel.is_empty());
}

/// A selector's own fd in an application's epoll set, level- and
/// edge-triggered: quiet once `wait` returned `None`, readable when a
/// channel inside has an event, which `wait` with a zero timeout then
/// returns.
#[test]
fn selector_nested_in_app_epoll() {
    let sink = Domain::new("sink");
    let mut sel = Selector::new().unwrap();
    let mut senders = Vec::new();
    for _ in 0..4 {
        let (rx, s) = receiver(Kind::Local, &sink);
        senders.push((sel.insert(rx), s));
    }
    let (mut level, mut edge) = (AppEpoll::new(), AppEpoll::new());
    level.add(sel.as_fd(), 5, false);
    edge.add(sel.as_fd(), 6, true);
    let mut seqs = [0u64; 4];
    for round in 0..6 {
        assert_eq!(sel.wait(Some(Duration::ZERO)).unwrap_err(), WaitError::TimedOut);
        assert!(
            level.wait(Duration::ZERO).is_empty(),
            "round {round}: the selector's fd is readable with nothing to do"
        );
        let i = (round * 3 + 1) % 4;
        senders[i].1.send(1);
        assert_eq!(level.wait(T), vec![5], "round {round}");
        assert_eq!(edge.wait(T), vec![6], "round {round}");
        let (key, ev) = sel.wait(Some(Duration::ZERO)).expect("the event that woke the fd");
        assert_eq!(key, senders[i].0);
        let (buffer, meta, seq) = received(ev);
        assert_eq!(seq, seqs[i]);
        seqs[i] += 1;
        sel.get_mut(key).unwrap().pass_unfilled(buffer, &meta).unwrap();
    }
    for (key, s) in senders {
        let mut rx = sel.remove(key).unwrap();
        s.finish(&mut rx);
    }
}

/// Run `name` (an ignored test of this binary) alone in a child process:
/// for checks of the whole process's fds.
fn run_alone(name: &str) {
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--nocapture", "--test-threads=1"])
        .env("FERRY_EV_ALONE", "1")
        .status()
        .unwrap();
    assert!(status.success(), "{name} failed alone: {status:?}");
}

/// `selector_churn_alone` in a process of its own: it counts the whole
/// process's fds, which the other tests of this binary change.
#[test]
fn selector_churn() {
    run_alone("selector_churn_alone");
}

/// Channels come and go in a selector while eight others carry traffic: a
/// channel is removed with messages pending and dropped (its peer sees
/// the close), new ones are inserted (reusing the freed keys); the
/// channels that stay lose no message, and the process holds no more fds
/// at the end than after the warm-up.
#[test]
#[ignore = "run alone in a child process by selector_churn"]
fn selector_churn_alone() {
    if std::env::var("FERRY_EV_ALONE").is_err() {
        return;
    }
    const STAY: usize = 8;
    const PER: u64 = 150;
    const ROUNDS: usize = 150;
    const WARM_UP: usize = 20;
    let server = Domain::new("server");
    let mut sel = Selector::new().unwrap();
    let mut eps = Vec::new();
    for _ in 0..STAY {
        let ep = Endpoint::local();
        let mut rx = Channel::create(&server, &ep, rx_setup()).unwrap();
        rx.set_pool_policy(PoolPolicy::AcceptAndReport);
        sel.insert(rx);
        eps.push(ep);
    }
    let stayers: Vec<usize> = sel.keys().collect();
    let producer = std::thread::spawn(move || {
        let d = Domain::new("producer");
        let alloc = Allocator::new(&d, (STAY * 2) as u64, SIZE, PoolConstraints::default()).unwrap();
        let mut chans: Vec<Channel> = eps
            .iter()
            .map(|ep| {
                let mut tx = Channel::connect(&d, ep, BindParams::default(), T).unwrap();
                tx.assign_pool_and_wait(alloc.pool(), T).unwrap();
                tx
            })
            .collect();
        let (mut sent, mut back) = (vec![0u64; STAY], 0u64);
        while back < PER * STAY as u64 {
            for (i, tx) in chans.iter_mut().enumerate() {
                if sent[i] < PER && alloc.available() > 0 {
                    tx.move_buffer(filled(&alloc, sent[i]), &sent[i].to_le_bytes()).unwrap();
                    sent[i] += 1;
                }
            }
            let mut refs: Vec<&mut Channel> = chans.iter_mut().collect();
            match wait_any(&mut refs, Some(T)) {
                Ok((_, Event::BufferPassed { .. })) => back += 1,
                other => panic!("producer: {other:?}"),
            }
        }
        chans
    });
    let client = Domain::new("client");
    let mut next: HashMap<usize, u64> = HashMap::new();
    let mut stay_msgs = 0u64;
    let mut churn: Option<Channel> = None;
    let mut freed: Option<usize> = None;
    let mut before = None;
    let serve = |sel: &mut Selector, next: &mut HashMap<usize, u64>, stay_msgs: &mut u64, churn_key: Option<usize>| {
        let Ok((key, ev)) = sel.wait(Some(Duration::from_millis(2))) else { return };
        match ev {
            Event::BindRequest { .. } | Event::PoolAssignRequest(_) => {}
            ev @ Event::MoveReceived { .. } => {
                let (buffer, meta, seq) = received(ev);
                if Some(key) == churn_key {
                    // The churning channel's messages: some taken, some left pending.
                    drop(buffer);
                    return;
                }
                assert!(stayers.contains(&key), "an event of a removed channel: key {key}");
                let want = next.entry(key).or_default();
                assert_eq!(seq, *want, "channel {key} lost a message");
                *want += 1;
                *stay_msgs += 1;
                sel.get_mut(key).unwrap().pass(buffer, &meta).unwrap();
            }
            ev => panic!("channel {key}: {ev:?}"),
        }
    };
    // The staying channels are set up (the fds counted include theirs).
    let mut setups = 0;
    while setups < 2 * STAY {
        match sel.wait(Some(T)) {
            Ok((_, Event::BindRequest { .. } | Event::PoolAssignRequest(_))) => setups += 1,
            other => panic!("while setting up: {other:?}"),
        }
    }
    for round in 0..ROUNDS {
        if round == WARM_UP {
            before = Some(open_fds());
        }
        // A new channel in, its source here.
        let ep = Endpoint::local();
        let mut rx = Channel::create(&server, &ep, rx_setup()).unwrap();
        rx.set_pool_policy(PoolPolicy::AcceptAndReport);
        let key = sel.insert(rx);
        if let Some(k) = freed {
            assert_eq!(key, k, "the freed key is reused");
        }
        let mut tx = Channel::bind(&client, &ep, BindParams::default()).unwrap();
        let alloc = Allocator::new(&client, 4, SIZE, PoolConstraints::default()).unwrap();
        let end = Instant::now() + T;
        while tx.state() != ChannelState::Connected {
            assert!(Instant::now() < end, "round {round}: the bind was not served");
            serve(&mut sel, &mut next, &mut stay_msgs, Some(key));
            let _ = tx.poll();
        }
        tx.assign_pool(alloc.pool()).unwrap();
        while !matches!(tx.poll(), Some(Event::PoolAssigned(_))) {
            assert!(Instant::now() < end, "round {round}: the pool was not served");
            serve(&mut sel, &mut next, &mut stay_msgs, Some(key));
        }
        for seq in 0..3 {
            tx.move_buffer(filled(&alloc, seq), &seq.to_le_bytes()).unwrap();
        }
        // Serve a little (maybe some of the three), then out with it,
        // messages pending or not.
        for _ in 0..(round % 4) {
            serve(&mut sel, &mut next, &mut stay_msgs, Some(key));
        }
        // Last round's channel kept out of the selector goes now.
        drop(churn.take());
        let rx = sel.remove(key).expect("in the selector");
        assert!(sel.remove(key).is_none(), "removed once");
        if round % 2 == 0 {
            drop(rx);
        } else {
            // Kept out of the selector a while, dropped next round.
            churn = Some(rx);
        }
        freed = Some(key);
        if round % 2 == 0 {
            match tx.wait(Some(T)) {
                Ok(Event::Closed { by_peer: true }) => {}
                Ok(Event::Error(err)) if matches!(err.kind(), ErrorKind::PeerGone) => {}
                other => panic!("round {round}: the source of a dropped channel saw {other:?}"),
            }
            assert_eq!(tx.state(), ChannelState::Closed);
        }
        drop(tx);
        drop(alloc);
    }
    drop(churn);
    // The channels that stay: every message.
    let end = Instant::now() + T;
    while stay_msgs < PER * STAY as u64 {
        assert!(Instant::now() < end, "only {stay_msgs} messages of the staying channels");
        serve(&mut sel, &mut next, &mut stay_msgs, None);
    }
    let chans = loop {
        if producer.is_finished() {
            break producer.join().unwrap();
        }
        assert!(Instant::now() < end, "the producer did not get its buffers back");
        serve(&mut sel, &mut next, &mut stay_msgs, None);
    };
    assert!(next.values().all(|&n| n == PER) && next.len() == STAY);
    let after = open_fds();
    let before = before.unwrap();
    println!("fds: {before} after the warm-up, {after} after {} more rounds", ROUNDS - WARM_UP);
    assert!(after <= before + 4, "fds grew {before} -> {after}");
    drop(chans);
    drop(sel);
}

// --------------------------------------------------- 8. closed channels

/// A closed channel (by teardown, by its peer's teardown, by its peer's
/// drop) is armed and its fd quiet: no event loop spins on it; `wait_any`
/// over closed channels only returns `None` at once, also without a
/// timeout.
#[test]
fn closed_channels_are_quiet() {
    let mut closed = Vec::new();
    // Teardown: both ends closed.
    let (mut rx, sender) = receiver(Kind::Local, &Domain::new("sink"));
    let Sender::Local { mut tx, .. } = sender else { unreachable!() };
    tx.teardown().unwrap();
    assert!(matches!(rx.wait(Some(T)), Ok(Event::Closed { by_peer: true })));
    assert!(matches!(tx.wait(Some(T)), Ok(Event::Closed { by_peer: false })));
    closed.push(("teardown, the starting end", tx));
    closed.push(("teardown, the peer's end", rx));
    // The peer dropped.
    let (mut rx, sender) = receiver(Kind::Local, &Domain::new("sink"));
    drop(sender);
    match rx.wait(Some(T)) {
        Ok(Event::Closed { by_peer: true }) => {}
        Ok(Event::Error(err)) if matches!(err.kind(), ErrorKind::PeerGone) => {}
        other => panic!("{other:?}"),
    }
    closed.push(("the peer dropped", rx));
    // Over shared memory and TCP, the peer (another process) tore down.
    for kind in [Kind::Shm, Kind::Tcp] {
        let (mut rx, sender) = receiver(kind, &Domain::new("sink"));
        sender.finish(&mut rx);
        closed.push((if kind == Kind::Shm { "shm" } else { "tcp" }, rx));
    }
    for (what, ch) in closed.iter_mut() {
        assert_eq!(ch.state(), ChannelState::Closed, "{what}");
        assert!(ch.poll().is_none(), "{what}");
        assert!(ch.arm(), "{what}: a closed channel is armed");
        assert!(!readable(ch.as_fd(), Duration::from_millis(100)), "{what}: the closed channel's fd is readable");
    }
    let mut chans: Vec<Channel> = closed.into_iter().map(|(_, c)| c).collect();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut refs: Vec<&mut Channel> = chans.iter_mut().collect();
        let _ = tx.send(wait_any(&mut refs, None).err());
    });
    assert_eq!(rx.recv_timeout(T), Ok(Some(WaitError::Closed)), "wait_any over closed channels did not say so");
}

// ------------------------------------------------- timeout or closed

/// A connected pair over a local endpoint: (creator, binder).
fn local_pair() -> (Channel, Channel) {
    let ep = Endpoint::local();
    let mut tx = Channel::create(&Domain::new("tx"), &ep, ChannelSetup::default()).unwrap();
    let mut rx = Channel::bind(&Domain::new("rx"), &ep, BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    (tx, rx)
}

/// `Channel::wait` says which: nothing in time on an open channel, or
/// nothing ever again on a closed one (after its close was delivered).
#[test]
fn channel_wait_tells_a_timeout_from_a_closed_channel() {
    let (mut tx, mut rx) = local_pair();
    assert_eq!(rx.wait(Some(Duration::from_millis(5))).unwrap_err(), WaitError::TimedOut);
    tx.teardown().unwrap();
    assert!(matches!(rx.wait(Some(T)), Ok(Event::Closed { by_peer: true })));
    assert!(matches!(tx.wait(Some(T)), Ok(Event::Closed { by_peer: false })));
    let t = Instant::now();
    assert_eq!(rx.wait(Some(T)).unwrap_err(), WaitError::Closed);
    assert_eq!(tx.wait(None).unwrap_err(), WaitError::Closed, "no timeout: still returns");
    assert!(t.elapsed() < T, "a closed channel is reported at once");
}

/// `Selector::wait` likewise: timed out while a channel is open; closed
/// once every channel is closed and delivered its last event, also
/// without a timeout (it returned `None` or waited for ever before).
#[test]
fn selector_wait_tells_a_timeout_from_closed_channels() {
    let (mut tx, rx) = local_pair();
    let mut sel = Selector::new().unwrap();
    let key = sel.insert(rx);
    assert_eq!(sel.wait(Some(Duration::from_millis(5))).unwrap_err(), WaitError::TimedOut);
    tx.teardown().unwrap();
    assert!(matches!(sel.wait(Some(T)), Ok((k, Event::Closed { by_peer: true })) if k == key));
    assert_eq!(sel.wait(Some(Duration::from_millis(5))).unwrap_err(), WaitError::Closed);
    let (done, result) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(sel.wait(None).err());
    });
    assert_eq!(result.recv_timeout(T), Ok(Some(WaitError::Closed)), "wait(None) on closed channels ends");
    let mut empty = Selector::new().unwrap();
    assert_eq!(empty.wait(Some(T)).unwrap_err(), WaitError::Closed);
}
