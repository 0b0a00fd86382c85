//! The TCP backend: transparent semantics without the copy, across real
//! processes (the test binary runs itself again as the peer, `net_child`),
//! real kills, hostile peers speaking raw frames, IPv4 and IPv6.

mod support;

use support::raw_peer::{self, RawPeer};

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, BufferState, Channel, ChannelSetup, ChannelState, Direction, Domain, Endpoint, Error,
    ErrorKind, Event, NetOptions, PoolConstraints, Role, TrustLevel,
};

use support::payload::{check, fill};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;

fn seq_of(meta: &[u8]) -> u64 {
    u64::from_le_bytes(meta[..8].try_into().unwrap())
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A TX channel listening on `at` (port 0), and the address to bind to.
fn listen(domain: &Domain, at: SocketAddr, trust: TrustLevel, options: NetOptions) -> (Channel, SocketAddr) {
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, trust, ..ChannelSetup::default() };
    let ch = Channel::create(domain, &Endpoint::tcp_with(at, options), setup).expect("create");
    let addr = ch.listen_addr().expect("listening");
    (ch, addr)
}

fn next(ch: &mut Channel) -> Event {
    match ch.wait(Some(T)) {
        Ok(ev) => ev,
        Err(_) => panic!("no event within {T:?} (state {:?})", ch.state()),
    }
}

fn assign(ch: &mut Channel, alloc: &Allocator) {
    ch.assign_pool(alloc.pool()).unwrap();
    match next(ch) {
        Event::PoolAssigned(_) => {}
        ev => panic!("expected the pool assigned, got {ev:?}"),
    }
}

/// The first error event, within `within`.
fn error_within(ch: &mut Channel, within: Duration) -> Error {
    let t = Instant::now();
    loop {
        match ch.wait(Some(within)) {
            Ok(Event::Error(e)) => return e,
            Ok(Event::CopyReleased { .. }) | Ok(Event::BufferPassed { .. }) => {}
            Ok(ev) => panic!("unexpected {ev:?}"),
            Err(_) => assert!(t.elapsed() < within, "no error event within {within:?}"),
        }
    }
}

// ------------------------------------------------------------- in process

/// Moves, passes and copies between two domains over loopback TCP, every
/// byte checked on arrival, at each trust level; the counters show the
/// payload went straight from buffer to buffer, in batched frames.
fn flows_at(trust: TrustLevel, at: SocketAddr) {
    let src = Domain::new("src");
    let (tx, addr) = listen(&src, at, trust, NetOptions::default());
    let bind = move |d: &Domain| Channel::bind(d, &Endpoint::tcp(addr), BindParams::default()).unwrap();
    let (ours, _) = support::scenarios::flows(&src, tx, SIZE, bind);
    assert!(ours.send_calls < ours.frames_sent, "frames are batched: {ours:?}");
}

#[test]
fn flows_full_trust() {
    flows_at(TrustLevel::Full, loopback());
}

#[test]
fn flows_half_trust() {
    flows_at(TrustLevel::Half, loopback());
}

#[test]
fn flows_no_trust() {
    flows_at(TrustLevel::None, loopback());
}

#[test]
fn flows_over_ipv6() {
    flows_at(TrustLevel::Full, "[::1]:0".parse().unwrap());
}

/// A receive master hands out empty buffers with `pass_unfilled`: no
/// payload crosses for them, only for the filled moves coming back.
#[test]
fn unfilled_passes_carry_no_payload() {
    let master = Domain::new("master");
    let setup = ChannelSetup { direction: Direction::Rx, role: Role::Master, ..ChannelSetup::default() };
    let mut rx = Channel::create(&master, &Endpoint::tcp(loopback()), setup).unwrap();
    let addr = rx.listen_addr().unwrap();
    let filler = std::thread::spawn(move || {
        let d = Domain::new("filler");
        let mut tx = Channel::bind(&d, &Endpoint::tcp(addr), BindParams::default()).unwrap();
        let mut filled = 0u64;
        loop {
            match next(&mut tx) {
                Event::Bound => {}
                Event::PoolAssignRequest(req) => tx.respond_pool(req.pool, true).unwrap(),
                Event::BufferPassed { mut buffer, .. } => {
                    fill(buffer.as_mut_slice().unwrap(), filled);
                    tx.move_buffer(buffer, &filled.to_le_bytes()).unwrap();
                    filled += 1;
                }
                Event::Closed { .. } => break,
                ev => panic!("filler: unexpected {ev:?}"),
            }
        }
        tx.link_stats().unwrap()
    });
    assert!(matches!(next(&mut rx), Event::BindRequest { .. }));
    let alloc = Allocator::new(&master, 4, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut rx, &alloc);
    let mut got = 0u64;
    while let Some(b) = alloc.alloc() {
        rx.pass_unfilled(b, &[]).unwrap();
    }
    while got < 50 {
        match next(&mut rx) {
            Event::MoveReceived { buffer, meta } => {
                assert!(check(&buffer, seq_of(&meta)));
                got += 1;
                if got + 4 <= 50 {
                    rx.pass_unfilled(buffer, &[]).unwrap();
                }
            }
            ev => panic!("master: unexpected {ev:?}"),
        }
    }
    rx.teardown().unwrap();
    assert!(matches!(next(&mut rx), Event::Closed { .. }));
    let master_stats = rx.link_stats().unwrap();
    let filler_stats = filler.join().unwrap();
    assert_eq!(master_stats.payload_sent, 0, "{master_stats:?}");
    assert_eq!(filler_stats.payload_received, 0, "{filler_stats:?}");
    assert_eq!(master_stats.payload_received, 50 * SIZE as u64);
}

/// A run of frames without payload that arrives at once (a peer's batch
/// of unfilled passes) is read in a few system calls, not one per frame:
/// the link reads the run's headers ahead into a bounded buffer of its own.
#[test]
fn payload_less_frames_share_a_receive_call() {
    const N: u32 = 48;
    let d = Domain::new("source");
    let (mut ch, addr) = listen(&d, loopback(), TrustLevel::Full, NetOptions::default());
    let (ready, moved) = std::sync::mpsc::channel();
    let peer = RawPeer::spawn_with_pool(addr, move |p, pool, _| {
        let mut got = Vec::new();
        while got.len() < N as usize {
            let h = p.next_frame();
            if h.kind == raw_peer::MOVE {
                got.push(h.index);
            }
        }
        moved.recv().unwrap();
        // Every buffer back unfilled, the whole run in one write.
        let run: Vec<u8> = got
            .iter()
            .flat_map(|&i| raw_peer::frame_bytes(raw_peer::PASS, 0, i, 0, pool, &u64::from(i).to_le_bytes(), &[]))
            .collect();
        p.send(&run);
        p.drain();
    });
    assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
    let alloc = Allocator::new(&d, N as u64, 4096, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    for i in 0..N {
        let b = alloc.alloc().unwrap();
        ch.move_buffer(b, &u64::from(i).to_le_bytes()).unwrap();
    }
    ch.flush().unwrap();
    let before = ch.link_stats().unwrap();
    ready.send(()).unwrap();
    for _ in 0..N {
        match next(&mut ch) {
            Event::BufferPassed { buffer, meta } => assert_eq!(seq_of(&meta), u64::from(buffer.id().index)),
            ev => panic!("expected a buffer back, got {ev:?}"),
        }
    }
    let after = ch.link_stats().unwrap();
    assert_eq!(after.frames_received - before.frames_received, u64::from(N), "{after:?}");
    assert_eq!(after.payload_received, before.payload_received, "unfilled passes carry no payload");
    let calls = after.recv_calls - before.recv_calls;
    assert!(calls <= u64::from(N) / 8, "{N} frames of one write took {calls} receive calls");
    drop(ch);
    peer.join().unwrap();
}

/// Frames read ahead and not delivered yet are an event waiting: the
/// channel does not arm (its fd would not say so, the socket is empty),
/// and the next poll delivers them.
#[test]
fn frames_read_ahead_keep_the_channel_awake() {
    let d = Domain::new("source");
    let (mut ch, addr) = listen(&d, loopback(), TrustLevel::Full, NetOptions::default());
    let (ready, moved) = std::sync::mpsc::channel();
    let peer = RawPeer::spawn_with_pool(addr, move |p, pool, _| {
        let mut got = Vec::new();
        while got.len() < 3 {
            let h = p.next_frame();
            if h.kind == raw_peer::MOVE {
                got.push(h.index);
            }
        }
        moved.recv().unwrap();
        let run: Vec<u8> =
            got.iter().flat_map(|&i| raw_peer::frame_bytes(raw_peer::PASS, 0, i, 0, pool, &[0; 8], &[])).collect();
        p.send(&run);
        p.drain();
    });
    assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
    let alloc = Allocator::new(&d, 3, 4096, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    for _ in 0..3 {
        ch.move_buffer(alloc.alloc().unwrap(), &[0; 8]).unwrap();
    }
    ch.flush().unwrap();
    ready.send(()).unwrap();
    // The run comes in one write: the first pass is delivered from it,
    // the others are read ahead with it.
    assert!(matches!(next(&mut ch), Event::BufferPassed { .. }));
    let mut back = 1;
    while back < 3 {
        assert!(!ch.arm(), "{back} of 3 passes delivered, the others read ahead: the channel must not sleep");
        match ch.poll() {
            Some(Event::BufferPassed { .. }) => back += 1,
            ev => panic!("expected a buffer back, got {ev:?}"),
        }
    }
    drop(ch);
    peer.join().unwrap();
}

/// Frames read ahead together are still checked one by one, each against
/// the state the ones before it left: a pass with payload of a buffer that
/// an unfilled pass of the same write gave back to us is a protocol error,
/// and our bytes stay as they are.
#[test]
fn frames_read_ahead_are_gated_in_order() {
    let d = Domain::new("victim");
    let (mut ch, addr) = listen(&d, loopback(), TrustLevel::Full, NetOptions::default());
    let peer = RawPeer::spawn_with_pool(addr, move |p, pool, size| {
        let mut got = Vec::new();
        while got.len() < 2 {
            let h = p.next_frame();
            if h.kind == raw_peer::MOVE {
                got.push(h.index);
            }
        }
        let mut run = Vec::new();
        for &i in &got {
            run.extend(raw_peer::frame_bytes(raw_peer::PASS, 0, i, 0, pool, &[], &[]));
        }
        run.extend(raw_peer::frame_bytes(raw_peer::PASS, 2, got[0], size as u64, pool, &[], &vec![0xee; size]));
        p.send(&run);
        p.drain();
    });
    assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
    let alloc = Allocator::new(&d, 2, 4096, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    for seq in 0..2 {
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), seq);
        ch.move_buffer(b, &seq.to_le_bytes()).unwrap();
    }
    let mut back = Vec::new();
    while back.len() < 2 {
        match next(&mut ch) {
            Event::BufferPassed { buffer, .. } => back.push(buffer),
            ev => panic!("expected a buffer back, got {ev:?}"),
        }
    }
    match error_within(&mut ch, T).kind() {
        ErrorKind::Protocol(_) => {}
        e => panic!("expected a protocol error, got {e:?}"),
    }
    assert_eq!(ch.state(), ChannelState::Closed);
    for (seq, b) in back.iter().enumerate() {
        assert!(check(b, seq as u64), "buffer {seq} changed under us");
    }
    drop(ch);
    peer.join().unwrap();
}

/// Nobody listening, and an address in use: typed errors.
#[test]
fn endpoint_errors() {
    let d = Domain::new("d");
    let (ch, addr) = listen(&d, loopback(), TrustLevel::Full, NetOptions::default());
    let again = Channel::create(&d, &Endpoint::tcp(addr), ChannelSetup::default());
    assert_eq!(again.unwrap_err(), ErrorKind::EndpointInUse);
    drop(ch);
    // A port nobody listens on and nobody else can take meanwhile (a
    // freed one could be reused by a test running beside this one).
    let holder = bound_not_listening(loopback());
    let free = rustix::net::getsockname(&holder).unwrap();
    let free = SocketAddr::try_from(free).unwrap();
    let err = Channel::bind(&d, &Endpoint::tcp(free), BindParams::default()).unwrap_err();
    assert_eq!(err, ErrorKind::EndpointNotListening);
}

/// A TCP socket bound to `addr` that never listens: connecting to it is
/// refused, and nobody else can bind its port while it lives.
fn bound_not_listening(addr: SocketAddr) -> rustix::fd::OwnedFd {
    use rustix::net::{bind, socket, AddressFamily, SocketType};
    let s = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    bind(&s, &addr).unwrap();
    s
}

/// A bind the creator cannot accept is refused with the reason; the
/// creator keeps listening and accepts the next binder.
#[test]
fn refused_bind_then_success() {
    let d = Domain::new("creator");
    let (mut ch, addr) = listen(&d, loopback(), TrustLevel::Full, NetOptions::default());
    let binder = std::thread::spawn(move || {
        let d = Domain::new("binder");
        let params = BindParams { trust: Some(TrustLevel::Half), ..BindParams::default() };
        let mut bad = Channel::bind(&d, &Endpoint::tcp(addr), params).unwrap();
        match next(&mut bad) {
            Event::Error(why) if matches!(why.kind(), ErrorKind::BindRefused(_)) => {
                assert!(why.to_string().contains("trust"), "{why}")
            }
            ev => panic!("expected a refusal, got {ev:?}"),
        }
        let mut good = Channel::bind(&d, &Endpoint::tcp(addr), BindParams::default()).unwrap();
        assert!(matches!(next(&mut good), Event::Bound));
        assert!(matches!(next(&mut good), Event::Closed { by_peer: true }));
    });
    assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
    ch.teardown().unwrap();
    assert!(matches!(next(&mut ch), Event::Closed { .. }));
    binder.join().unwrap();
}

/// Ends with different peer timeouts: the end with the long one sends its
/// keep-alives often enough for the short one (the two announce their
/// timeouts at setup), so an idle connection stays up on both ends for
/// several of the short timeouts, and data still flows after.
#[test]
fn keepalives_follow_the_shorter_peer_timeout() {
    let short = NetOptions::with_peer_timeout(Duration::from_secs(1));
    let src = Domain::new("short timeout");
    let alloc = Allocator::new(&src, 2, SIZE, PoolConstraints::default()).unwrap();
    let (mut tx, addr) = listen(&src, loopback(), TrustLevel::Full, short);
    let sink = std::thread::spawn(move || {
        // The default peer timeout: 10 s.
        let d = Domain::new("long timeout");
        let mut rx = Channel::bind(&d, &Endpoint::tcp(addr), BindParams::default()).unwrap();
        rx.wait_connected(T).unwrap();
        match next(&mut rx) {
            Event::PoolAssignRequest(req) => rx.respond_pool(req.pool, true).unwrap(),
            ev => panic!("expected the pool offer, got {ev:?}"),
        }
        // The answer goes out now, not with the next wait.
        rx.flush().unwrap();
        rx
    });
    tx.wait_connected(T).unwrap();
    assign(&mut tx, &alloc);
    let rx = sink.join().unwrap();
    support::scenarios::idle_then_move(&mut tx, rx, &alloc, Duration::from_secs(3));
}

// ------------------------------------------------------------ hostile peer

// The peer that speaks the wire format by hand is `support::raw_peer`.

/// Each malformed or hostile frame closes the channel with a protocol
/// error on the receiving side; the victim's buffers are intact and its own.
#[test]
fn hostile_frames_are_protocol_errors() {
    type Attack = fn(&mut RawPeer, u128, usize);
    let attacks: [(&str, Attack); 8] = [
        ("unknown frame type", |p, pool, _| p.frame(42, 0, 0, 0, pool, &[], &[])),
        ("buffer index out of range", |p, pool, size| p.frame(3, 2, 99, size as u64, pool, &[], &vec![0; size])),
        ("payload length not the pool's", |p, pool, size| p.frame(3, 2, 0, 100, pool, &[], &vec![0; size])),
        ("unknown pool", |p, _, size| p.frame(3, 2, 0, size as u64, 12345, &[], &vec![0; size])),
        ("meta too long", |p, pool, _| p.frame(3, 0, 0, 0, pool, &[1; 300], &[])),
        ("move against the direction", |p, pool, size| p.frame(1, 2, 0, size as u64, pool, &[], &vec![0; size])),
        ("pass of a buffer the victim owns", |p, pool, size| {
            p.frame(3, 2, 0, size as u64, pool, &[], &vec![0xee; size])
        }),
        ("release of a copy never sent", |p, pool, _| p.frame(4, 0, 1, 0, pool, &[], &[])),
    ];
    for (what, attack) in attacks {
        let d = Domain::new("victim");
        let (mut ch, addr) = listen(&d, loopback(), TrustLevel::Full, NetOptions::default());
        let peer = RawPeer::spawn_with_pool(addr, move |p, pool, size| {
            attack(p, pool, size);
            // Stay until the victim hangs up.
            p.drain();
        });
        assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
        let alloc = Allocator::new(&d, 2, 4096, PoolConstraints::default()).unwrap();
        let mut mine = alloc.alloc().unwrap();
        fill(mine.as_mut_slice().unwrap(), 5);
        assign(&mut ch, &alloc);
        match error_within(&mut ch, T).kind() {
            ErrorKind::Protocol(why) => eprintln!("{what}: {why}"),
            e => panic!("{what}: expected a protocol error, got {e:?}"),
        }
        assert_eq!(ch.state(), ChannelState::Closed, "{what}");
        assert!(check(&mine, 5), "{what}: the victim's buffer changed");
        assert!(mine.as_mut_slice().is_ok(), "{what}: the buffer is still ours");
        drop(ch);
        peer.join().unwrap();
    }
}

/// A peer passes a buffer that another domain of the victim's process owns
/// (lent to it over a local channel, in the memory both domains map): the
/// bytes would land where that domain reads and writes, so it is a
/// protocol error, and that domain's buffer is untouched.
#[test]
fn pass_of_a_buffer_a_local_neighbour_owns_is_refused() {
    let d = Domain::new("victim");
    let (mut ch, addr) = listen(&d, loopback(), TrustLevel::Full, NetOptions::default());
    let (go, wait_go) = std::sync::mpsc::channel::<()>();
    let peer = RawPeer::spawn_with_pool(addr, move |p, pool, size| {
        wait_go.recv().unwrap();
        p.frame(3, 2, 0, size as u64, pool, &[], &vec![0xee; size]);
        p.drain();
    });
    assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
    let alloc = Allocator::new(&d, 2, 4096, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);

    // Buffer 0 goes to a neighbour domain of this process, which fills it.
    let neighbour = Domain::new("neighbour");
    let ep = Endpoint::local();
    let mut tx = Channel::create(&d, &ep, ChannelSetup::default()).unwrap();
    let mut rx = Channel::bind(&neighbour, &ep, BindParams::default()).unwrap();
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    assert!(matches!(next(&mut rx), Event::Bound));
    tx.assign_pool(alloc.pool()).unwrap();
    let Event::PoolAssignRequest(req) = next(&mut rx) else { panic!("no offer") };
    rx.respond_pool(req.pool, true).unwrap();
    assert!(matches!(next(&mut tx), Event::PoolAssigned(_)));
    let b0 = alloc.alloc().unwrap();
    assert_eq!(b0.id().index, 0);
    tx.move_buffer(b0, &[]).unwrap();
    let Event::MoveReceived { buffer: mut theirs, .. } = next(&mut rx) else { panic!("no move") };
    fill(theirs.as_mut_slice().unwrap(), 9);

    go.send(()).unwrap();
    match error_within(&mut ch, T).kind() {
        ErrorKind::Protocol(why) => assert!(why.contains("another domain"), "{why}"),
        e => panic!("expected a protocol error, got {e:?}"),
    }
    assert!(check(&theirs, 9), "the neighbour's buffer changed");
    assert!(theirs.as_mut_slice().is_ok(), "the neighbour still owns it");
    drop(ch);
    peer.join().unwrap();
}

/// A peer that learned one of our pool ids (we assigned the pool to it on
/// another channel) offers that pool back on a channel where we are the
/// sink and sends a copy of a buffer we own and never copied: a free one
/// in our allocator, or one we hold. No such copy can exist, so it is a
/// protocol error, and our buffers stay ours and writable (before, the
/// forged copy was delivered and our buffer turned read-only until the
/// copy was dropped). Sent alone and as an aggregate member.
#[test]
fn a_forged_copy_of_a_buffer_we_own_is_refused() {
    const COPY: u8 = 2;
    const ASSIGN: u8 = 5;
    const AGG: u8 = 12;
    const TABLE: u8 = 13;
    let table_entry = |len: u64| {
        let mut v = 0u32.to_le_bytes().to_vec();
        v.extend_from_slice(&[0; 6]);
        v.extend_from_slice(&len.to_le_bytes()[..6]);
        v
    };
    type Forge = fn(&mut RawPeer, u128, u32, usize, &[u8]);
    let forgeries: [(&str, u32, Forge); 4] = [
        ("a copy of a free buffer", 1, |p, pool, index, size, _| {
            p.frame(COPY, 2, index, size as u64, pool, &[], &vec![0xee; size])
        }),
        ("a copy of a held buffer", 0, |p, pool, index, size, _| {
            p.frame(COPY, 2, index, size as u64, pool, &[], &vec![0xee; size])
        }),
        ("a copy without payload", 0, |p, pool, index, _, _| p.frame(COPY, 0, index, 0, pool, &[], &[])),
        ("an aggregate member", 1, |p, pool, index, size, table| {
            p.frame(AGG, 0, 1, 1, size as u128, &[], &[]);
            p.frame(COPY, 2, index, size as u64, pool, &[], &vec![0xee; size]);
            p.frame(TABLE, 0, 0, 0, 0, table, &[]);
        }),
    ];
    for (what, index, forge) in forgeries {
        let d = Domain::new("victim");
        let alloc = Allocator::new(&d, 2, 4096, PoolConstraints::default()).unwrap();
        let mut mine = alloc.alloc().unwrap();
        assert_eq!(mine.id().index, 0);
        fill(mine.as_mut_slice().unwrap(), 5);

        // Channel 1: we assign the pool to the peer, which learns its id.
        let (mut out, addr) = listen(&d, loopback(), TrustLevel::Full, NetOptions::default());
        let (learn, learned) = std::sync::mpsc::channel();
        let peer1 = std::thread::spawn(move || {
            let mut p = RawPeer::bind(addr);
            learn.send(p.accept_pool()).unwrap();
            p.drain();
        });
        assert!(matches!(next(&mut out), Event::BindRequest { .. }));
        assign(&mut out, &alloc);
        let (pool, size) = learned.recv().unwrap();
        assert_eq!(pool, alloc.pool().id().as_u128());

        // Channel 2: we are the sink; the peer offers our own pool back.
        let setup = ChannelSetup { direction: Direction::Rx, role: Role::Master, ..ChannelSetup::default() };
        let mut inbound = Channel::create(&d, &Endpoint::tcp(loopback()), setup).unwrap();
        let addr = inbound.listen_addr().unwrap();
        let table = table_entry(size as u64);
        let peer2 = std::thread::spawn(move || {
            let mut p = RawPeer::bind(addr);
            p.frame(ASSIGN, 3 << 4, 2, size as u64, pool, &[], &[]);
            forge(&mut p, pool, index, size, &table);
            p.drain();
        });
        assert!(matches!(next(&mut inbound), Event::BindRequest { .. }));
        let Event::PoolAssignRequest(req) = next(&mut inbound) else { panic!("{what}: no pool offer") };
        inbound.respond_pool(req.pool, true).unwrap();
        match error_within(&mut inbound, T).kind() {
            ErrorKind::Protocol(why) => assert!(why.contains("never copied"), "{what}: {why}"),
            e => panic!("{what}: expected a protocol error, got {e:?}"),
        }
        assert_eq!(d.buffer_state(mine.id()), BufferState::ReadWrite, "{what}");
        assert!(check(&mine, 5), "{what}: our buffer changed");
        assert!(mine.as_mut_slice().is_ok(), "{what}: our buffer is still writable");
        let free = alloc.alloc().expect("the free buffer is still in the allocator");
        assert_eq!(d.buffer_state(free.id()), BufferState::ReadWrite, "{what}");
        let mut free = free;
        assert!(free.as_mut_slice().is_ok(), "{what}: the free buffer came out writable");
        drop(inbound);
        drop(out);
        peer1.join().unwrap();
        peer2.join().unwrap();
    }
}

/// After a protocol error the connection ends at once, while the
/// application still holds the failed channel: the peer reads the end of
/// the stream (or a reset), and what it sends after is not taken in.
#[test]
fn a_protocol_error_ends_the_connection_at_once() {
    let d = Domain::new("victim");
    let (mut ch, addr) = listen(&d, loopback(), TrustLevel::Full, NetOptions::default());
    let (sent, wait_sent) = std::sync::mpsc::channel();
    let peer = RawPeer::spawn_with_pool(addr, move |p, pool, _| {
        p.frame(42, 0, 0, 0, pool, &[], &[]);
        sent.send(()).unwrap();
        // Well within the victim's peer timeout (10 s): only an end that
        // comes from the protocol error counts.
        p.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut sink = [0u8; 4096];
        loop {
            match p.s.read(&mut sink) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
    let alloc = Allocator::new(&d, 2, 4096, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    wait_sent.recv().unwrap();
    assert!(matches!(error_within(&mut ch, T).kind(), ErrorKind::Protocol(_)));
    let ended = peer.join().unwrap();
    assert!(ended.is_ok(), "the connection stayed open after the protocol error: {ended:?}");
    assert_eq!(ch.state(), ChannelState::Closed);
    drop(ch);
}

// --------------------------------------------------------- other processes

fn spawn_child(role: &str, addr: SocketAddr) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "net_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("FERRY_NET_ROLE", role)
        .env("FERRY_NET_ADDR", addr.to_string())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn child")
}

fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    support::payload::wait_exit(child, T)
}

/// The peer process. Roles: `echo` (check every moved buffer, write the
/// sequence number + 1 into it, pass it back; hold copies until the
/// teardown), `hold` (keep everything and wait to be killed).
#[test]
#[ignore = "run as a child process by the other tests"]
fn net_child() {
    let (Ok(role), Ok(addr)) = (std::env::var("FERRY_NET_ROLE"), std::env::var("FERRY_NET_ADDR")) else { return };
    let d = Domain::new("child");
    let ep = Endpoint::tcp_with(addr.parse().unwrap(), NetOptions::with_peer_timeout(Duration::from_secs(2)));
    let mut ch = Channel::bind(&d, &ep, BindParams::default()).expect("bind");
    let mut kept = Vec::new();
    let mut copies = Vec::new();
    loop {
        match ch.wait(Some(Duration::from_secs(30))) {
            Ok(Event::Bound) => {}
            Ok(Event::PoolAssignRequest(req)) => ch.respond_pool(req.pool, true).unwrap(),
            Ok(Event::MoveReceived { mut buffer, meta }) => {
                let seq = seq_of(&meta);
                assert!(check(&buffer, seq), "child: buffer {seq} arrived corrupted");
                if role == "hold" {
                    kept.push(buffer);
                } else {
                    fill(buffer.as_mut_slice().unwrap(), seq + 1);
                    ch.pass(buffer, &meta).unwrap();
                }
            }
            Ok(Event::CopyReceived { copy, meta }) => {
                assert!(check(&copy, seq_of(&meta)), "child: copy arrived corrupted");
                copies.push(copy);
            }
            Ok(Event::Closed { .. }) | Err(_) => break,
            Ok(Event::Error(e)) => panic!("child: {e}"),
            Ok(ev) => panic!("child: unexpected {ev:?}"),
        }
    }
}

fn start_child(d: &Domain, role: &str, options: NetOptions) -> (Channel, Child) {
    let (mut ch, addr) = listen(d, loopback(), TrustLevel::Full, options);
    let child = spawn_child(role, addr);
    assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
    (ch, child)
}

/// Thousands of buffers to another process and back, checked both ways.
#[test]
fn echo_between_processes() {
    let d = Domain::new("parent");
    let (mut ch, mut child) = start_child(&d, "echo", NetOptions::default());
    let alloc = Allocator::new(&d, 16, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    support::payload::move_and_take_back(&mut ch, &alloc, 2000, |seq| seq + 1);
    ch.teardown().unwrap();
    assert!(matches!(next(&mut ch), Event::Closed { by_peer: false }));
    assert_eq!(alloc.available(), 16);
    assert!(wait_exit(&mut child).success());
}

/// `kill -9` of the peer while it holds moved buffers and read-only
/// copies: an error event in bounded time, every buffer back in the
/// allocator, the copied buffer writable again.
#[test]
fn killed_peer_returns_everything() {
    let d = Domain::new("parent");
    let (mut ch, mut child) = start_child(&d, "hold", NetOptions::with_peer_timeout(Duration::from_secs(2)));
    let alloc = Allocator::new(&d, 8, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    for seq in 0..6u64 {
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), seq);
        ch.move_buffer(b, &seq.to_le_bytes()).unwrap();
    }
    let mut kept = alloc.alloc().unwrap();
    fill(kept.as_mut_slice().unwrap(), 9);
    ch.copy(&kept, &9u64.to_le_bytes()).unwrap();
    ch.flush().unwrap();
    // Let the child take everything in, then kill it.
    std::thread::sleep(Duration::from_millis(300));
    child.kill().unwrap();
    let t = Instant::now();
    let e = error_within(&mut ch, T);
    assert!(matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::PeerUnresponsive(_)), "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "noticed after {:?}", t.elapsed());
    assert_eq!(alloc.available(), 7, "the six moved buffers are back");
    assert!(kept.as_mut_slice().is_ok(), "the copy held by the dead peer is void");
    let _ = child.wait();
}
