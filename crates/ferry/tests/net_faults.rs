//! Network faults under the TCP backend: a silent peer (half-open), a reset
//! connection, a peer that stops reading, a corrupted frame, a connection
//! cut mid-stream — each injected by a real TCP proxy between the two ends
//! (`support::fault_proxy`; this machine has no `tc netem`) — and two real
//! processes in two network namespaces joined by a veth pair.

mod support;

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, Channel, ChannelSetup, ChannelState, Direction, Domain, Endpoint, Error, ErrorKind, Event,
    NetOptions, PoolConstraints, Role,
};
use support::fault_proxy::{Fault, FaultProxy};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 16 << 10;
/// Peer timeout of both ends in these tests.
const TIMEOUT: Duration = Duration::from_secs(1);

fn options() -> NetOptions {
    NetOptions::with_peer_timeout(TIMEOUT)
}

/// What the sink thread does with moved buffers.
#[derive(Clone, Copy, PartialEq)]
enum Sink {
    /// Pass each back at once.
    Echo,
    /// Keep them.
    Hold,
}

/// Source (creator, TX) in this thread; the sink binds through a proxy in a
/// thread and reports its last event. Returns the source end, the proxy,
/// the allocator, and a receiver for the sink's final event.
fn through_proxy(d: &Domain, sink: Sink) -> (Channel, FaultProxy, Allocator, mpsc::Receiver<Event>) {
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() };
    let mut ch = Channel::create(d, &Endpoint::tcp_with("127.0.0.1:0".parse().unwrap(), options()), setup).unwrap();
    let proxy = FaultProxy::start(ch.listen_addr().unwrap()).unwrap();
    let via: SocketAddr = proxy.addr();
    let (tell, told) = mpsc::channel();
    std::thread::spawn(move || {
        let d = Domain::new("sink");
        let mut rx = Channel::bind(&d, &Endpoint::tcp_with(via, options()), BindParams::default()).unwrap();
        let mut kept = Vec::new();
        loop {
            match rx.wait(Some(T)) {
                Ok(Event::Bound) => {}
                Ok(Event::PoolAssignRequest(r)) => rx.respond_pool(r.pool, true).unwrap(),
                Ok(Event::MoveReceived { buffer, meta }) if sink == Sink::Echo => {
                    let _ = rx.pass(buffer, &meta);
                }
                Ok(Event::MoveReceived { buffer, .. }) => kept.push(buffer),
                Ok(ev @ (Event::Error(_) | Event::Closed { .. })) => {
                    let _ = tell.send(ev);
                    return;
                }
                Ok(_) => {}
                Err(_) if rx.state() == ChannelState::Closed => return,
                Err(_) => {}
            }
        }
    });
    assert!(matches!(ch.wait(Some(T)), Ok(Event::BindRequest { .. })));
    let alloc = Allocator::new(d, 8, SIZE, PoolConstraints::default()).unwrap();
    ch.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::PoolAssigned(_))));
    (ch, proxy, alloc, told)
}

/// Move `n` buffers and wait until the sink has them (proxy forwarded).
fn lend(ch: &mut Channel, alloc: &Allocator, n: usize) {
    for i in 0..n {
        let b = alloc.alloc().unwrap();
        ch.move_buffer(b, &(i as u64).to_le_bytes()).unwrap();
    }
    ch.flush().unwrap();
    std::thread::sleep(Duration::from_millis(100));
}

/// The first error event of `ch` and how long it took.
fn error_event(ch: &mut Channel) -> (Error, Duration) {
    let t = Instant::now();
    loop {
        match ch.wait(Some(T)) {
            Ok(Event::Error(e)) => return (e, t.elapsed()),
            Ok(Event::BufferPassed { .. }) => {}
            Ok(ev) => panic!("unexpected {ev:?}"),
            Err(_) => assert!(t.elapsed() < 2 * T, "no error event"),
        }
    }
}

/// Half-open connection: the peer (or the network) goes silent without a
/// FIN or RST. Keep-alives stop arriving; after the peer timeout the
/// channel fails and the buffers lent to the peer come back.
#[test]
fn silent_peer_times_out_and_buffers_come_back() {
    let d = Domain::new("src");
    let (mut ch, proxy, alloc, sink) = through_proxy(&d, Sink::Hold);
    lend(&mut ch, &alloc, 5);
    assert_eq!(alloc.available(), 3);
    proxy.set(Fault::Blackhole);
    let (e, after) = error_event(&mut ch);
    assert_eq!(e, ErrorKind::PeerUnresponsive(TIMEOUT));
    assert!(after < 4 * TIMEOUT, "noticed after {after:?}");
    assert_eq!(alloc.available(), 8, "lent buffers are back");
    assert_eq!(ch.state(), ChannelState::Closed);
    // The sink, equally cut off, gives up the same way.
    assert!(matches!(sink.recv_timeout(T), Ok(Event::Error(e)) if matches!(e.kind(), ErrorKind::PeerUnresponsive(_))));
}

/// Connection reset under both ends: each gets an error event at once and
/// the source's lent buffers come back.
#[test]
fn reset_connection_is_peer_gone() {
    let d = Domain::new("src");
    let (mut ch, proxy, alloc, sink) = through_proxy(&d, Sink::Hold);
    lend(&mut ch, &alloc, 4);
    proxy.set(Fault::Reset);
    let (e, after) = error_event(&mut ch);
    assert_eq!(e, ErrorKind::PeerGone);
    assert!(after < TIMEOUT, "a reset is noticed without waiting for the timeout ({after:?})");
    assert_eq!(alloc.available(), 8);
    assert!(matches!(sink.recv_timeout(T), Ok(Event::Error(e)) if e == ErrorKind::PeerGone));
}

/// A peer that stops reading: the source's sends queue up to the channel's
/// queue depth and are then refused with `QueueFull` (memory stays
/// bounded); once nothing moves for the peer timeout, the channel fails.
#[test]
fn peer_that_stops_reading_gives_back_pressure_then_an_error() {
    let d = Domain::new("src");
    let setup = ChannelSetup { direction: Direction::Tx, queue_depth: 32, ..ChannelSetup::default() };
    let mut ch = Channel::create(&d, &Endpoint::tcp_with("127.0.0.1:0".parse().unwrap(), options()), setup).unwrap();
    let proxy = FaultProxy::start(ch.listen_addr().unwrap()).unwrap();
    let via = proxy.addr();
    let sink = std::thread::spawn(move || {
        let d = Domain::new("sink");
        let mut rx = Channel::bind(&d, &Endpoint::tcp_with(via, options()), BindParams::default()).unwrap();
        let mut kept = Vec::new();
        let t = Instant::now();
        // Keep polling (so keep-alives flow towards the source) and echo
        // nothing; stop after a while.
        while t.elapsed() < 6 * TIMEOUT {
            match rx.wait(Some(Duration::from_millis(50))) {
                Ok(Event::PoolAssignRequest(r)) => rx.respond_pool(r.pool, true).unwrap(),
                Ok(Event::MoveReceived { buffer, .. }) => kept.push(buffer),
                Ok(Event::Error(_) | Event::Closed { .. }) => break,
                _ => {}
            }
        }
    });
    assert!(matches!(ch.wait(Some(T)), Ok(Event::BindRequest { .. })));
    let alloc = Allocator::new(&d, 4096, 64 << 10, PoolConstraints::default()).unwrap();
    ch.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::PoolAssigned(_))));
    proxy.set(Fault::StopReading { towards_server: false });
    // Data goes out until the socket buffers are full; then the queue fills.
    let mut moved = 0usize;
    let refused = loop {
        let b = alloc.alloc().expect("more buffers than the stalled path holds");
        match ch.move_buffer(b, &[]) {
            Ok(()) => moved += 1,
            Err(r) => break r,
        }
        let _ = ch.poll();
    };
    assert_eq!(refused.error, ErrorKind::QueueFull, "after {moved} moves");
    drop(refused.into_inner());
    // Either end may notice first: we see the stall (unresponsive), or the
    // sink, starved of our keep-alives, gives up and hangs up without a
    // goodbye (gone). Either way everything we lent comes back.
    let (e, after) = error_event(&mut ch);
    assert!(matches!(e.kind(), ErrorKind::PeerUnresponsive(TIMEOUT) | ErrorKind::PeerGone), "{e:?}");
    assert!(after < 4 * TIMEOUT, "noticed after {after:?}");
    assert_eq!(alloc.available(), 4096, "everything came back");
    drop(proxy);
    sink.join().unwrap();
}

/// A frame corrupted on the way (its type byte): the receiving end closes
/// with a protocol error and keeps its own buffers.
#[test]
fn corrupted_frame_is_a_protocol_error() {
    let d = Domain::new("src");
    let setup = ChannelSetup { direction: Direction::Tx, ..ChannelSetup::default() };
    let mut ch = Channel::create(&d, &Endpoint::tcp_with("127.0.0.1:0".parse().unwrap(), options()), setup).unwrap();
    let proxy = FaultProxy::start(ch.listen_addr().unwrap()).unwrap();
    // Server → client: the bind acceptance (2-byte length, 39 bytes and the
    // 4-byte peer timeout), then the first frame, whose type byte we flip.
    proxy.set(Fault::CorruptAt { towards_server: false, offset: 45, xor: 0x80 });
    let via = proxy.addr();
    let sink = std::thread::spawn(move || {
        let d = Domain::new("sink");
        let mut rx = Channel::bind(&d, &Endpoint::tcp_with(via, options()), BindParams::default()).unwrap();
        loop {
            match rx.wait(Some(T)) {
                Ok(Event::Bound) => {}
                Ok(ev) => return ev,
                Err(_) => panic!("sink: no event"),
            }
        }
    });
    assert!(matches!(ch.wait(Some(T)), Ok(Event::BindRequest { .. })));
    let alloc = Allocator::new(&d, 2, SIZE, PoolConstraints::default()).unwrap();
    ch.assign_pool(alloc.pool()).unwrap();
    ch.flush().unwrap();
    match sink.join().unwrap() {
        Event::Error(why) if matches!(why.kind(), ErrorKind::Protocol(_)) => {
            assert!(why.to_string().contains("unknown frame type"), "{why}")
        }
        ev => panic!("sink: expected a protocol error, got {ev:?}"),
    }
    // The source learns that the sink closed.
    let (e, _) = error_event(&mut ch);
    assert_eq!(e, ErrorKind::PeerGone);
    assert_eq!(alloc.available(), 2);
}

/// The connection is cut (FIN) in the middle of a payload: the receiver
/// does not take the partial buffer, and sees the end of the stream
/// without a goodbye as a dead peer; the sender's buffers come back.
#[test]
fn stream_cut_mid_payload() {
    let d = Domain::new("src");
    let (mut ch, proxy, alloc, sink) = through_proxy(&d, Sink::Hold);
    let (sent_to_client, _) = (proxy.bytes_forwarded().1, ());
    proxy.set(Fault::TruncateAfter { towards_server: false, bytes: sent_to_client + 100 + SIZE as u64 / 2 });
    lend(&mut ch, &alloc, 3);
    let (e, after) = error_event(&mut ch);
    assert_eq!(e, ErrorKind::PeerGone);
    assert!(after < TIMEOUT);
    assert_eq!(alloc.available(), 8);
    assert!(matches!(sink.recv_timeout(T), Ok(Event::Error(e)) if e == ErrorKind::PeerGone));
}

// ------------------------------------------------- two network namespaces

/// The child processes of the namespace test. Roles: `listen-echo`
/// (create on FERRY_NET_ADDR, echo every buffer back), `source` (bind to
/// FERRY_NET_ADDR, move 500 patterned buffers, check them on return).
#[test]
#[ignore = "run as a child process by the namespace test"]
fn netns_child() {
    let (Ok(role), Ok(addr)) = (std::env::var("FERRY_NET_ROLE"), std::env::var("FERRY_NET_ADDR")) else { return };
    let addr: SocketAddr = addr.parse().unwrap();
    // Plain TCP between the namespaces, chosen on purpose.
    let insecure = NetOptions::default().with_security(ferry::tls::Security::None);
    let d = Domain::new(&role);
    if role == "listen-echo" {
        let setup = ChannelSetup { direction: Direction::Rx, ..ChannelSetup::default() };
        let mut ch = Channel::create(&d, &Endpoint::tcp_with(addr, insecure.clone()), setup).unwrap();
        loop {
            match ch.wait(Some(T)) {
                Ok(Event::BindRequest { .. }) => {}
                Ok(Event::PoolAssignRequest(r)) => ch.respond_pool(r.pool, true).unwrap(),
                Ok(Event::MoveReceived { buffer, meta }) => ch.pass(buffer, &meta).unwrap(),
                Ok(Event::Closed { .. }) => return,
                ev => panic!("listen-echo: {ev:?}"),
            }
        }
    }
    // The listener may not be up yet.
    let t = Instant::now();
    let mut ch = loop {
        match Channel::bind(&d, &Endpoint::tcp_with(addr, insecure.clone()), BindParams::default()) {
            Ok(ch) => break ch,
            Err(err) if matches!(err.kind(), ErrorKind::EndpointNotListening) && t.elapsed() < T => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("source: bind: {e}"),
        }
    };
    assert!(matches!(ch.wait(Some(T)), Ok(Event::Bound)));
    let alloc = Allocator::new(&d, 16, SIZE, PoolConstraints::default()).unwrap();
    ch.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::PoolAssigned(_))));
    let (mut sent, mut back) = (0u64, 0u64);
    while back < 500 {
        while sent < 500 {
            let Some(mut b) = alloc.alloc() else { break };
            b.as_mut_slice().unwrap().fill(sent as u8);
            ch.move_buffer(b, &sent.to_le_bytes()).unwrap();
            sent += 1;
        }
        match ch.wait(Some(T)) {
            Ok(Event::BufferPassed { buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(buffer.iter().all(|&x| x == seq as u8), "buffer {seq} came back corrupted");
                back += 1;
            }
            ev => panic!("source: {ev:?}"),
        }
    }
    ch.teardown().unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::Closed { .. })));
    assert_eq!(alloc.available(), 16);
    println!("source: 500 buffers there and back");
}

/// Two processes in two network namespaces (two network stacks, a veth
/// link between them, real IPv4 and IPv6 routing): the channel works end
/// to end. Needs root (CI runs as root).
#[test]
fn between_two_network_namespaces() {
    let pair = support::netns::NetnsPair::create().expect("network namespaces (needs root and iproute2)");
    let exe = std::env::current_exe().unwrap();
    let mut addrs = vec![pair.addr_b];
    addrs.extend(pair.addr6_b);
    for (i, ip) in addrs.into_iter().enumerate() {
        let addr = SocketAddr::new(ip, 7000 + i as u16);
        let spawn = |ns: &str, role: &str| {
            pair.command_in(ns, &exe)
                .args(["--exact", "netns_child", "--ignored", "--nocapture", "--test-threads=1"])
                .env("FERRY_NET_ROLE", role)
                .env("FERRY_NET_ADDR", addr.to_string())
                .output()
        };
        let listener = std::thread::scope(|s| {
            let l = s.spawn(|| spawn(&pair.b, "listen-echo"));
            let src = spawn(&pair.a, "source").expect("run source");
            let l = l.join().unwrap().expect("run listener");
            (src, l)
        });
        let (src, l) = listener;
        assert!(src.status.success(), "source in {}: {}", pair.a, String::from_utf8_lossy(&src.stderr));
        assert!(l.status.success(), "listener in {}: {}", pair.b, String::from_utf8_lossy(&l.stderr));
        assert!(String::from_utf8_lossy(&src.stdout).contains("500 buffers there and back"), "{addr}");
    }
}
