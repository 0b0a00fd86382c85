//! Multiplexed sessions (`ferry::MuxSession`) against hostile peers, on
//! real loopback sockets: a peer that makes the session queue answers it
//! never reads, and connections that never say hello to a listening side.
//! Each is cut off or closed with a clear error, nothing hangs, and
//! well-behaved sessions and clients of the same process go on.

mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::backend::mux::MUX_HEAD;
use ferry::{
    Allocator, BindParams, Channel, ChannelSetup, Direction, Domain, ErrorKind, Event, MuxListener, MuxSession,
    NetOptions, PoolConstraints, Role,
};

use support::mux_peer::{frame, hello, read_hello, MuxPeer, K_CLOSE, K_OPEN, MAGIC};

const T: Duration = Duration::from_secs(10);

fn tx_setup() -> ChannelSetup {
    ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() }
}

/// A well-behaved session pair with one channel whose pool is assigned:
/// (the sessions, the sending end, its allocator, the echoing end's
/// thread, which passes every buffer back until its channel closes).
fn good_session() -> ((MuxSession, MuxSession), Channel, Allocator, std::thread::JoinHandle<u64>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let other = std::thread::spawn(move || MuxSession::connect(addr, NetOptions::default(), T).unwrap());
    let a = MuxSession::accept(&listener, NetOptions::default(), T).unwrap();
    let b = other.join().unwrap();
    let (da, db) = (Domain::new("good-a"), Domain::new("good-b"));
    let mut tx = Channel::create(&da, &a.endpoint(1), tx_setup()).unwrap();
    let mut rx = Channel::bind(&db, &b.endpoint(1), BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    let alloc = Allocator::new(&da, 4, 4096, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    let echo = std::thread::spawn(move || {
        let mut n = 0;
        loop {
            match rx.wait(Some(T)) {
                Ok(Event::PoolAssignRequest(req)) => rx.respond_pool(req.pool, true).unwrap(),
                Ok(Event::Bound) => {}
                Ok(Event::MoveReceived { buffer, meta }) => {
                    rx.pass(buffer, &meta).unwrap();
                    n += 1;
                }
                Ok(Event::Closed { .. }) => return n,
                ev => panic!("good session, receiving end: unexpected {ev:?}"),
            }
        }
    });
    loop {
        match tx.wait(Some(T)) {
            Ok(Event::PoolAssigned(_)) => break,
            Ok(Event::BindRequest { .. }) => {}
            ev => panic!("good session: pool assignment: unexpected {ev:?}"),
        }
    }
    ((a, b), tx, alloc, echo)
}

/// One round trip on the good session: a buffer there and back.
fn round_trip(tx: &mut Channel, alloc: &Allocator, seq: u64) {
    let b = alloc.alloc().expect("the good session's buffers are all back");
    tx.move_buffer(b, &seq.to_le_bytes()).unwrap();
    match tx.wait(Some(T)) {
        Ok(Event::BufferPassed { meta, .. }) => assert_eq!(meta[..8], seq.to_le_bytes()),
        ev => panic!("good session: round trip {seq}: unexpected {ev:?}"),
    }
}

/// The peer's flood: an open and a close of channel numbers nobody
/// listens on, over and over (each close makes the session queue a close
/// in answer), without reading anything, until `stop`, an error, or
/// `limit` bytes were sent. Returns the bytes sent.
fn flood(peer: &mut MuxPeer, stop: &AtomicBool, limit: usize) -> usize {
    let mut batch = Vec::new();
    for id in 1000..1256 {
        batch.extend_from_slice(&frame(K_OPEN, id, &support::mux_peer::bind_request()));
        batch.extend_from_slice(&frame(K_CLOSE, id, &[]));
    }
    let mut sent = 0;
    while sent < limit && !stop.load(Ordering::Relaxed) {
        if peer.s.write_all(&batch).is_err() {
            break;
        }
        sent += batch.len();
    }
    sent
}

/// A peer that opens a channel, takes a buffer the session's application
/// moves to it (lent), and then opens and closes channels nobody listens
/// on in a loop without reading a byte: every close queues a close in
/// answer. The session cuts it off once its control frames reach the
/// limit (`PeerBacklog`, on the channel as an error event), having queued
/// no more than the limit; the lent buffer comes back. A second session
/// of the same process does round trips all the while and after.
#[test]
fn a_peer_that_provokes_replies_it_never_reads_is_cut_off() {
    const LIMIT: usize = 64 << 10;
    // Far more than the limit and what both kernels hold: the answers to
    // a flood this long are some 4 MiB.
    const FLOOD: usize = 16 << 20;
    let ((_good_a, _good_b), mut good_tx, good_alloc, echo) = good_session();

    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let peer_stop = stop.clone();
    let flooded = Arc::new(AtomicBool::new(false));
    let peer_flooded = flooded.clone();
    let peer = std::thread::spawn(move || {
        let mut peer = MuxPeer::connect(addr, 4096);
        peer.open(1);
        peer.accept_pool(1);
        // The buffer the session moves to us: ours (lent) from now on.
        let kind = peer.take_message(1);
        let sent = flood(&mut peer, &peer_stop, FLOOD);
        peer_flooded.store(true, Ordering::Relaxed);
        // Still there (not read from) until the test has seen the end.
        let until = Instant::now() + Duration::from_secs(60);
        while !peer_stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        (sent, kind)
    });
    // A peer timeout that the flood cannot reach: it is the bound that
    // must cut the peer off, not its silence.
    let victim = MuxSession::accept(&listener, NetOptions::with_peer_timeout(Duration::from_secs(120)), T).unwrap();
    victim.set_control_limit(LIMIT);
    let d = Domain::new("victim");
    let mut ch = Channel::accept(&d, &victim.endpoint(1), tx_setup(), T).unwrap();
    let alloc = Allocator::new(&d, 4, 4096, PoolConstraints::default()).unwrap();
    ch.assign_pool(alloc.pool()).unwrap();
    match ch.wait(Some(T)) {
        Ok(Event::PoolAssigned(_)) => {}
        ev => panic!("victim: pool assignment: unexpected {ev:?}"),
    }
    ch.move_buffer(alloc.alloc().unwrap(), b"lent").unwrap();
    assert_eq!(alloc.available(), 3);

    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seq = 0;
    let (mut last_read, mut quiet) = (None, 0);
    let error = loop {
        assert!(Instant::now() < deadline, "no end within 120 s: {:?}", victim.stats());
        match ch.wait(Some(Duration::from_millis(10))) {
            Ok(Event::Error(e)) => break e,
            Ok(ev) => panic!("victim: unexpected {ev:?}"),
            Err(_) => {}
        }
        round_trip(&mut good_tx, &good_alloc, seq);
        seq += 1;
        // The whole flood has been read (nothing more came for a few
        // polls), and the session still stands.
        if flooded.load(Ordering::Relaxed) {
            let stats = victim.stats();
            if last_read == Some(stats.bytes_received) {
                quiet += 1;
            } else {
                (last_read, quiet) = (Some(stats.bytes_received), 0);
            }
            assert!(
                quiet < 5,
                "the flood was read and the session was not cut off: {} bytes of control frames were queued at \
                 once (limit {LIMIT}): {stats:?}",
                stats.max_control_queued
            );
        }
    };
    stop.store(true, Ordering::Relaxed);
    assert!(
        matches!(error.kind(), ErrorKind::PeerBacklog { limit, .. } if *limit == LIMIT as u64),
        "expected the peer to be cut off for its backlog, got {error:?}"
    );
    let stats = victim.stats();
    assert!(
        stats.max_control_queued <= (LIMIT + MUX_HEAD) as u64,
        "{} bytes of control frames queued (limit {LIMIT})",
        stats.max_control_queued
    );
    assert!(stats.max_control_queued > LIMIT as u64 / 2, "the flood never filled the queue: {stats:?}");
    // The session is over for every channel, and the buffer lent to the
    // peer is ours again.
    assert!(ch.poll().is_none());
    assert_eq!(alloc.available(), 4, "the buffer lent to the cut-off peer came back");
    // Closed with the peer's bytes unread: its writes fail from now on.
    drop((ch, victim));
    let (sent, kind) = peer.join().unwrap();
    assert_eq!(kind, 1, "the peer took a move");
    assert!(sent < FLOOD, "the peer's writes went on after the cut-off");

    // The good session goes on.
    for _ in 0..16 {
        round_trip(&mut good_tx, &good_alloc, seq);
        seq += 1;
    }
    good_tx.teardown().unwrap();
    loop {
        match good_tx.wait(Some(T)) {
            Ok(Event::Closed { .. }) => break,
            Ok(Event::BufferPassed { .. }) => {}
            ev => panic!("good session: teardown: unexpected {ev:?}"),
        }
    }
    assert_eq!(echo.join().unwrap(), seq);
}

/// Connections that connect and never send the magic, ahead of a good
/// client (more of them than are served at once): the listening side
/// serves them side by side, so the good client gets its session well
/// within its own timeout (an accept that waited for the first silent one
/// would have waited all of its timeout), and the silent ones are closed.
#[test]
fn silent_connections_do_not_delay_a_good_client() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // In the listener's queue before the good client, in this order; more
    // than are served at once, so the oldest are shed.
    let count = ferry::backend::mux::MAX_HANDSHAKES + 4;
    let mut silent: Vec<TcpStream> = (0..count).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let accepting = std::thread::spawn(move || MuxSession::accept(&listener, NetOptions::default(), 3 * T));
    let good = MuxSession::connect(addr, NetOptions::default(), Duration::from_secs(5));
    let good = good.expect("the good client got its session despite the silent connections");
    let ours = accepting.join().unwrap().expect("the accepting side's session");
    let theirs = ours.peer_addr().unwrap();
    assert!(silent.iter().all(|s| s.local_addr().unwrap() != theirs), "the session is the good client's");

    // The silent connections were closed when the session was found
    // (after our magic, nothing: the end of the stream).
    for s in &mut silent {
        s.set_read_timeout(Some(T)).unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("closed, not left open");
        assert_eq!(got.len(), 12, "a hello, then the end");
        assert_eq!(&got[..8], MAGIC);
    }

    // And the session works: a channel opens over it.
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let binder = std::thread::spawn(move || {
        let mut rx = Channel::bind(&db, &good.endpoint(3), BindParams::default()).unwrap();
        rx.wait_connected(T).map(|()| rx)
    });
    let mut tx = Channel::accept(&da, &ours.endpoint(3), tx_setup(), T).unwrap();
    let rx = binder.join().unwrap().unwrap();
    tx.teardown().unwrap();
    drop(rx);
}

/// A connection that never completes its magic is closed at its
/// deadline: an accept with nobody else there says `TimedOut` after its
/// timeout, and the connection sees its end; one that sends another magic
/// is closed at once and delays nobody either.
#[test]
fn handshakes_that_fail_are_closed() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut silent = TcpStream::connect(addr).unwrap();
    let mut half = TcpStream::connect(addr).unwrap();
    half.write_all(b"FERRY").unwrap();
    let mut wrong = TcpStream::connect(addr).unwrap();
    wrong.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let e = MuxSession::accept(&listener, NetOptions::default(), Duration::from_millis(300)).unwrap_err();
    assert_eq!(e, ErrorKind::TimedOut);
    for s in [&mut silent, &mut half] {
        s.set_read_timeout(Some(T)).unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("closed, not left open");
        assert_eq!(got.len(), 12, "a hello, then the end");
        assert_eq!(&got[..8], MAGIC);
    }
    // Closed with bytes of its own unread: a reset, or the end.
    wrong.set_read_timeout(Some(T)).unwrap();
    match wrong.read_to_end(&mut Vec::new()) {
        Ok(_) => {}
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "closed, not left open: {e}"),
    }
}

/// A server that accepts session after session on a `MuxListener` loses
/// no client that was still handshaking when another one's session was
/// found: a client whose magic comes late (after the listener took its
/// connection, and after another client's session was returned) gets its
/// session from the next `accept`. (A one-shot `MuxSession::accept`
/// closes such a connection.)
#[test]
fn a_listener_keeps_clients_still_handshaking_for_its_next_accept() {
    let mut listener = MuxListener::bind("127.0.0.1:0".parse().unwrap(), NetOptions::default()).unwrap();
    let addr = listener.local_addr().unwrap();
    // The slow client connects first and says nothing yet.
    let mut slow = TcpStream::connect(addr).unwrap();
    let quick = std::thread::spawn(move || MuxSession::connect(addr, NetOptions::default(), T));
    let first = listener.accept(T).expect("the quick client's session");
    let _quick = quick.join().unwrap().expect("the quick client got its session");
    assert_ne!(first.peer_addr().unwrap(), slow.local_addr().unwrap(), "the first session is the quick client's");
    assert_eq!(listener.handshaking(), 1, "the slow client's connection is kept");

    // Now the slow client says hello, and the next accept is its session.
    slow.write_all(&hello(10_000)).unwrap();
    slow.set_read_timeout(Some(T)).unwrap();
    read_hello(&mut slow);
    let second = listener.accept(T).expect("the slow client's session");
    assert_eq!(second.peer_addr().unwrap(), slow.local_addr().unwrap());
    assert_eq!(listener.handshaking(), 0);
}
