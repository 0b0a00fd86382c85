//! A pool that reaches domains over different backends: its contents must
//! survive every move, pass and copy, whatever carries it.
//!
//! Over TCP each end keeps its own memory of a pool; over the local and
//! shared-memory backends the two ends normally map the same memory. When a
//! domain already has a pool in memory of its own (it got the pool over
//! TCP, say) and the pool then reaches it over a local or shm channel whose
//! other end has other memory for it, that channel carries the bytes.
//! Every domain here lives in this process; every channel is real (a local
//! ring, an shm segment over an abstract socket, a loopback TCP connection,
//! and with the feature `fabric` a libfabric endpoint on its tcp provider,
//! whose payloads are RMA writes into the peer's registered memory).
//!
//! Both ends of a channel live in one thread here, and a fabric provider
//! with manual progress moves an end's data only while that end is polled:
//! every wait polls the other end of its channel too ([`wait_beside`]).

mod support;

use std::time::Duration;

use ferry::{
    Allocator, BindParams, Buffer, Channel, ChannelSetup, Direction, Domain, Endpoint, Event, Pool, PoolConstraints,
    TrustLevel,
};
use support::payload::{check, fill};
use support::scenarios::{copy_resent_after_a_discarded_one, Triangle};

const WAIT: Duration = Duration::from_secs(10);
const SIZE: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Local,
    Shm,
    Tcp,
    #[cfg(feature = "fabric")]
    Fabric,
}

#[cfg(not(feature = "fabric"))]
const KINDS: &[Kind] = &[Kind::Local, Kind::Shm, Kind::Tcp];
#[cfg(feature = "fabric")]
const KINDS: &[Kind] = &[Kind::Local, Kind::Shm, Kind::Tcp, Kind::Fabric];

/// Whether channels of `kind` take trust NONE: the local backend has one
/// address space, and a fabric peer writes registered memory by itself.
fn takes_trust_none(kind: Kind) -> bool {
    matches!(kind, Kind::Shm | Kind::Tcp)
}

/// The next event of `ch` within [`WAIT`], polling `other` (the channel's
/// other end, in this thread) meanwhile.
fn wait_beside(ch: &mut Channel, other: &mut Channel) -> Event {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let _ = other.flush();
        match ch.wait(Some(Duration::from_millis(1))) {
            Ok(ev) => return ev,
            Err(e) => assert!(std::time::Instant::now() < deadline, "no event within {WAIT:?}: {e}"),
        }
    }
}

/// A connected channel from `source` (TX end) to `sink` (RX end).
fn connect(kind: Kind, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
    let setup = ChannelSetup { direction: Direction::Tx, trust, ..ChannelSetup::default() };
    let (mut tx, mut rx) = match kind {
        Kind::Local => {
            let ep = Endpoint::local();
            let tx = Channel::create(source, &ep, setup).expect("create");
            (tx, Channel::bind(sink, &ep, BindParams::default()).expect("bind"))
        }
        Kind::Shm => {
            let ep = Endpoint::shm_abstract(&support::unique_name("mixed"));
            let tx = Channel::create(source, &ep, setup).expect("create");
            (tx, Channel::bind(sink, &ep, BindParams::default()).expect("bind"))
        }
        Kind::Tcp => {
            let tx = Channel::create(source, &Endpoint::tcp("127.0.0.1:0".parse().unwrap()), setup).expect("create");
            let ep = Endpoint::tcp(tx.listen_addr().expect("listening"));
            (tx, Channel::bind(sink, &ep, BindParams::default()).expect("bind"))
        }
        #[cfg(feature = "fabric")]
        Kind::Fabric => {
            let options = ferry::FabricOptions::default().with_provider("tcp");
            let ep = Endpoint::fabric_with("127.0.0.1:0".parse().unwrap(), options.clone());
            let tx = Channel::create(source, &ep, setup).expect("create");
            let ep = Endpoint::fabric_with(tx.listen_addr().expect("listening"), options);
            (tx, Channel::bind(sink, &ep, BindParams::default()).expect("bind"))
        }
    };
    assert!(matches!(wait_beside(&mut tx, &mut rx), Event::BindRequest { .. }));
    assert!(matches!(wait_beside(&mut rx, &mut tx), Event::Bound));
    (tx, rx)
}

/// Offer `pool` on `from` and answer on `to`: `accept` or veto.
fn offer(from: &mut Channel, to: &mut Channel, pool: &Pool, accept: bool) {
    from.assign_pool(pool).expect("assign");
    from.flush().expect("flush");
    match wait_beside(to, from) {
        Event::PoolAssignRequest(req) => {
            to.respond_pool(req.pool, accept).expect("respond");
            to.flush().expect("flush");
        }
        ev => panic!("expected the assignment request, got {ev:?}"),
    }
    match wait_beside(from, to) {
        Event::PoolAssigned(id) if accept => assert_eq!(id, pool.id()),
        Event::PoolVetoed(id) if !accept => assert_eq!(id, pool.id()),
        ev => panic!("expected the answer to the assignment, got {ev:?}"),
    }
}

/// The pool as `domain` knows it (for offering it on).
fn pool_in(domain: &Domain, pool: &Pool) -> Pool {
    domain.pool(pool.id()).expect("the domain has the pool")
}

/// The buffer `ch` receives next (a move or a pass from `sender`, the
/// channel's other end).
fn received(ch: &mut Channel, sender: &mut Channel) -> Buffer {
    match wait_beside(ch, sender) {
        Event::MoveReceived { buffer, .. } | Event::BufferPassed { buffer, .. } => buffer,
        ev => panic!("expected a buffer, got {ev:?}"),
    }
}

/// Write the pattern of `seq` into `buf` and move it over `ch`.
fn write_and_move(ch: &mut Channel, mut buf: Buffer, seq: u64) {
    fill(buf.as_mut_slice().expect("owned read-write"), seq);
    ch.move_buffer(buf, &[]).expect("move");
    ch.flush().expect("flush");
}

/// Write the pattern of `seq` into `buf` and pass it back over `ch`.
fn write_and_pass(ch: &mut Channel, mut buf: Buffer, seq: u64) {
    fill(buf.as_mut_slice().expect("owned read-write"), seq);
    ch.pass(buf, &[]).expect("pass");
    ch.flush().expect("flush");
}

/// A pool vetoed on a channel, then offered again on the same channel and
/// accepted: moves and passes carry the bytes of the moment.
#[test]
fn a_pool_vetoed_then_accepted_on_the_same_channel_keeps_its_contents() {
    for &kind in KINDS {
        for trust in [TrustLevel::Full, TrustLevel::Half, TrustLevel::None] {
            if trust == TrustLevel::None && !takes_trust_none(kind) {
                continue;
            }
            let (a, b) = (Domain::new("a"), Domain::new("b"));
            let alloc = Allocator::new(&a, 4, SIZE, PoolConstraints::default()).unwrap();
            let (mut tx, mut rx) = connect(kind, &a, &b, trust);
            offer(&mut tx, &mut rx, alloc.pool(), false);
            offer(&mut tx, &mut rx, alloc.pool(), true);
            for round in 0..3u64 {
                write_and_move(&mut tx, alloc.alloc().unwrap(), 10 + round);
                let got = received(&mut rx, &mut tx);
                assert!(check(&got, 10 + round), "{kind:?}/{trust:?}: the move arrived with other bytes");
                write_and_pass(&mut rx, got, 20 + round);
                let back = received(&mut tx, &mut rx);
                assert!(check(&back, 20 + round), "{kind:?}/{trust:?}: the pass came back with other bytes");
            }
        }
    }
}

/// A pool reaches C along two paths: A assigns it to B and to C, and B to
/// C. A moves a buffer to B, B writes it and moves it on to C, C writes it
/// and passes it back to B, B passes it back to A: every hop sees the bytes
/// the previous owner wrote. Every combination of backends for the three
/// channels, at trust FULL and HALF, and NONE where the backends allow it.
#[test]
fn a_pool_reaching_a_domain_along_two_paths_keeps_its_contents() {
    let mut combos = 0;
    for &ab in KINDS {
        for &ac in KINDS {
            for &bc in KINDS {
                for trust in [TrustLevel::Full, TrustLevel::Half, TrustLevel::None] {
                    // Trust NONE needs memory the peer cannot write: the
                    // local and fabric backends refuse it.
                    if trust == TrustLevel::None && ![ab, ac, bc].into_iter().all(takes_trust_none) {
                        continue;
                    }
                    two_paths(ab, ac, bc, trust);
                    combos += 1;
                }
            }
        }
    }
    let n = KINDS.len();
    assert_eq!(combos, 2 * n * n * n + 8);
}

fn two_paths(ab: Kind, ac: Kind, bc: Kind, trust: TrustLevel) {
    let what = format!("A-B {ab:?}, A-C {ac:?}, B-C {bc:?}, {trust:?}");
    let (a, b, c) = (Domain::new("a"), Domain::new("b"), Domain::new("c"));
    let alloc = Allocator::new(&a, 8, SIZE, PoolConstraints::default()).unwrap();
    let (mut a_b, mut b_a) = connect(ab, &a, &b, trust);
    let (mut a_c, mut c_a) = connect(ac, &a, &c, trust);
    let (mut b_c, mut c_b) = connect(bc, &b, &c, trust);
    offer(&mut a_b, &mut b_a, alloc.pool(), true);
    offer(&mut a_c, &mut c_a, alloc.pool(), true);
    offer(&mut b_c, &mut c_b, &pool_in(&b, alloc.pool()), true);
    for round in 0..3u64 {
        let seq = 100 * round;
        write_and_move(&mut a_b, alloc.alloc().unwrap(), seq + 1);
        let at_b = received(&mut b_a, &mut a_b);
        assert!(check(&at_b, seq + 1), "{what}: B got other bytes than A wrote");
        write_and_move(&mut b_c, at_b, seq + 2);
        let at_c = received(&mut c_b, &mut b_c);
        assert!(check(&at_c, seq + 2), "{what}: C got other bytes than B wrote");
        write_and_pass(&mut c_b, at_c, seq + 3);
        let back_at_b = received(&mut b_c, &mut c_b);
        assert!(check(&back_at_b, seq + 3), "{what}: B got other bytes back than C wrote");
        // B has it from both A and C now; it writes it and moves it to C
        // over the other path's way back: C passes it to A directly.
        write_and_move(&mut b_c, back_at_b, seq + 4);
        let at_c = received(&mut c_b, &mut b_c);
        assert!(check(&at_c, seq + 4), "{what}: C got other bytes than B wrote (second time)");
        // C cannot pass it to A over a-c (A moved nothing to C on it): C
        // passes it back to B, and B to A.
        write_and_pass(&mut c_b, at_c, seq + 5);
        let at_b = received(&mut b_c, &mut c_b);
        assert!(check(&at_b, seq + 5), "{what}: B got other bytes back than C wrote (second time)");
        write_and_pass(&mut b_a, at_b, seq + 6);
        let home = received(&mut a_b, &mut b_a);
        assert!(check(&home, seq + 6), "{what}: A got other bytes back than B wrote");
        // And the direct path A -> C -> A.
        write_and_move(&mut a_c, home, seq + 7);
        let at_c = received(&mut c_a, &mut a_c);
        assert!(check(&at_c, seq + 7), "{what}: C got other bytes than A wrote (direct)");
        write_and_pass(&mut c_a, at_c, seq + 8);
        let home = received(&mut a_c, &mut c_a);
        assert!(check(&home, seq + 8), "{what}: A got other bytes back than C wrote (direct)");
    }
}

/// Read-only copies along the second path: B forwards a copy it received
/// from A to C; C reads what A wrote; the releases come back.
#[test]
fn a_copy_forwarded_along_a_second_path_shows_the_owners_bytes() {
    for &ab in KINDS {
        for &bc in KINDS {
            let what = format!("A-B {ab:?}, A-C Tcp, B-C {bc:?}");
            let (a, b, c) = (Domain::new("a"), Domain::new("b"), Domain::new("c"));
            let alloc = Allocator::new(&a, 4, SIZE, PoolConstraints::default()).unwrap();
            let (mut a_b, mut b_a) = connect(ab, &a, &b, TrustLevel::Full);
            let (mut a_c, mut c_a) = connect(Kind::Tcp, &a, &c, TrustLevel::Full);
            let (mut b_c, mut c_b) = connect(bc, &b, &c, TrustLevel::Full);
            offer(&mut a_b, &mut b_a, alloc.pool(), true);
            offer(&mut a_c, &mut c_a, alloc.pool(), true);
            offer(&mut b_c, &mut c_b, &pool_in(&b, alloc.pool()), true);
            let mut buf = alloc.alloc().unwrap();
            fill(buf.as_mut_slice().unwrap(), 42);
            a_b.copy(&buf, &[]).unwrap();
            a_b.flush().unwrap();
            let copy = match wait_beside(&mut b_a, &mut a_b) {
                Event::CopyReceived { copy, .. } => copy,
                ev => panic!("{what}: expected a copy, got {ev:?}"),
            };
            assert!(check(&copy, 42), "{what}: B's copy shows other bytes");
            b_c.copy(&copy, &[]).unwrap();
            b_c.flush().unwrap();
            let fwd = match wait_beside(&mut c_b, &mut b_c) {
                Event::CopyReceived { copy, .. } => copy,
                ev => panic!("{what}: expected a forwarded copy, got {ev:?}"),
            };
            assert!(check(&fwd, 42), "{what}: C's forwarded copy shows other bytes");
            c_b.release(fwd).unwrap();
            c_b.flush().unwrap();
            assert!(matches!(wait_beside(&mut b_c, &mut c_b), Event::CopyReleased { .. }));
            b_a.release(copy).unwrap();
            b_a.flush().unwrap();
            assert!(matches!(wait_beside(&mut a_b, &mut b_a), Event::CopyReleased { writable: true, .. }));
            fill(buf.as_mut_slice().expect("writable again"), 43);
            write_and_move(&mut a_c, buf, 44);
            assert!(check(&received(&mut c_a, &mut a_c), 44), "{what}: C got other bytes than A wrote");
        }
    }
}

/// A ring of three domains whose channels mix all three backends: a buffer
/// goes round and round, each domain writing it before moving it on. Each
/// channel's pool arrives over the previous one, so every domain gets the
/// pool once; the ring closes over a channel whose ends got it by other
/// ways.
#[test]
fn a_ring_of_mixed_channels_keeps_the_contents() {
    #[allow(unused_mut)]
    let mut orders = vec![
        [Kind::Tcp, Kind::Shm, Kind::Local],
        [Kind::Shm, Kind::Tcp, Kind::Local],
        [Kind::Local, Kind::Tcp, Kind::Shm],
    ];
    #[cfg(feature = "fabric")]
    orders.extend([
        [Kind::Fabric, Kind::Shm, Kind::Tcp],
        [Kind::Local, Kind::Fabric, Kind::Fabric],
        [Kind::Tcp, Kind::Local, Kind::Fabric],
    ]);
    for order in orders {
        let what = format!("ring {order:?}");
        let d = [Domain::new("r0"), Domain::new("r1"), Domain::new("r2")];
        let alloc = Allocator::new(&d[0], 4, SIZE, PoolConstraints::default()).unwrap();
        // Channel i goes from d[i] to d[i+1].
        let mut chans: Vec<(Channel, Channel)> =
            (0..3).map(|i| connect(order[i], &d[i], &d[(i + 1) % 3], TrustLevel::Full)).collect();
        for (i, (tx, rx)) in chans.iter_mut().enumerate() {
            offer(tx, rx, &pool_in(&d[i], alloc.pool()), true);
        }
        // Round and round: d0 -> d1 -> d2 -> d0 by moves, then the passes
        // unwind back the same way.
        let mut buf = alloc.alloc().unwrap();
        let mut seq = 1;
        for lap in 0..3 {
            for (i, (tx, rx)) in chans.iter_mut().enumerate() {
                write_and_move(tx, buf, seq);
                buf = received(rx, tx);
                assert!(check(&buf, seq), "{what}: lap {lap}, hop {i}: other bytes than the sender wrote");
                seq += 1;
            }
        }
        for _ in 0..3 {
            for (i, (tx, rx)) in chans.iter_mut().enumerate().rev() {
                write_and_pass(rx, buf, seq);
                buf = received(tx, rx);
                assert!(check(&buf, seq), "{what}: pass back on channel {i}: other bytes than the sender wrote");
                seq += 1;
            }
        }
    }
}

// ------------------------------------------------------------ across processes

/// The peer process of [`write_back_across_processes`]: domain C binds the
/// two shm endpoints named in the environment, accepts every pool, and
/// echoes every moved buffer after checking the pattern its meta names and
/// writing the next one. Exits 0 once both channels closed with every check
/// passed, 1 on the first wrong byte.
#[test]
#[ignore = "the peer process of write_back_across_processes (run by it)"]
fn mixed_child() {
    let (Ok(from_a), Ok(from_b)) = (std::env::var("FERRY_MIXED_A"), std::env::var("FERRY_MIXED_B")) else { return };
    let c = Domain::new("c");
    let mut chans: Vec<Channel> = [from_a, from_b]
        .iter()
        .map(|name| {
            let mut ch = Channel::bind(&c, &Endpoint::shm_abstract(name), BindParams::default()).expect("bind");
            assert!(matches!(ch.wait(Some(WAIT)), Ok(Event::Bound)));
            ch
        })
        .collect();
    let mut open = chans.len();
    let mut idle = std::time::Instant::now();
    while open > 0 {
        let mut any = false;
        for ch in chans.iter_mut() {
            let Ok(ev) = ch.wait(Some(Duration::from_millis(1))) else { continue };
            any = true;
            match ev {
                Event::PoolAssignRequest(req) => ch.respond_pool(req.pool, true).expect("accept"),
                Event::MoveReceived { mut buffer, meta } => {
                    let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                    if !check(&buffer, seq) {
                        eprintln!("mixed child: buffer {seq} arrived with other bytes than its sender wrote");
                        std::process::exit(1);
                    }
                    fill(buffer.as_mut_slice().expect("owned"), seq + 1);
                    ch.pass(buffer, &(seq + 1).to_le_bytes()).expect("pass");
                }
                Event::Closed { .. } => open -= 1,
                ev => panic!("mixed child: unexpected {ev:?}"),
            }
        }
        if any {
            idle = std::time::Instant::now();
        }
        assert!(idle.elapsed() < WAIT, "mixed child: nothing happened for {WAIT:?}");
    }
    std::process::exit(0);
}

/// C is another process. It gets the pool from A over shm (A's memory), and
/// from B over shm too, but B has its own memory of the pool (its TCP
/// mirror): C writes back across the process boundary. Every hop checks the
/// bytes the previous owner wrote.
#[test]
fn write_back_across_processes() {
    for trust in [TrustLevel::Full, TrustLevel::Half] {
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let alloc = Allocator::new(&a, 8, SIZE, PoolConstraints::default()).unwrap();
        let (mut a_b, mut b_a) = connect(Kind::Tcp, &a, &b, trust);
        let (name_a, name_b) = (support::unique_name("mixed-a"), support::unique_name("mixed-b"));
        let setup = ChannelSetup { direction: Direction::Tx, trust, ..ChannelSetup::default() };
        let mut a_c = Channel::create(&a, &Endpoint::shm_abstract(&name_a), setup).expect("create");
        let mut b_c = Channel::create(&b, &Endpoint::shm_abstract(&name_b), setup).expect("create");
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "mixed_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env("FERRY_MIXED_A", &name_a)
            .env("FERRY_MIXED_B", &name_b)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn the peer process");
        for ch in [&mut a_c, &mut b_c] {
            assert!(matches!(ch.wait(Some(WAIT)), Ok(Event::BindRequest { .. })));
        }
        offer(&mut a_b, &mut b_a, alloc.pool(), true);
        for (ch, pool) in [(&mut a_c, alloc.pool().clone()), (&mut b_c, pool_in(&b, alloc.pool()))] {
            ch.assign_pool(&pool).expect("assign");
            assert!(matches!(ch.wait(Some(WAIT)), Ok(Event::PoolAssigned(_))));
        }
        let echoed = |ch: &mut Channel, want: u64| {
            let buf = match ch.wait(Some(WAIT)) {
                Ok(Event::BufferPassed { buffer, meta }) => {
                    assert_eq!(u64::from_le_bytes(meta[..8].try_into().unwrap()), want);
                    buffer
                }
                ev => panic!("{trust:?}: expected the echo, got {ev:?}"),
            };
            assert!(check(&buf, want), "{trust:?}: the echo of {want} came back with other bytes");
            buf
        };
        for round in 0..16u64 {
            let seq = 10 * round;
            // A -> B over TCP, B -> C over shm (write-back at C), back.
            write_and_move(&mut a_b, alloc.alloc().unwrap(), seq);
            let mut at_b = received(&mut b_a, &mut a_b);
            assert!(check(&at_b, seq), "{trust:?}: B got other bytes than A wrote");
            fill(at_b.as_mut_slice().unwrap(), seq + 1);
            b_c.move_buffer(at_b, &(seq + 1).to_le_bytes()).expect("move");
            let back = echoed(&mut b_c, seq + 2);
            write_and_pass(&mut b_a, back, seq + 3);
            let home = received(&mut a_b, &mut b_a);
            assert!(check(&home, seq + 3), "{trust:?}: A got other bytes back than B wrote");
            // A -> C directly (shared memory), back.
            let mut home = home;
            fill(home.as_mut_slice().unwrap(), seq + 4);
            a_c.move_buffer(home, &(seq + 4).to_le_bytes()).expect("move");
            drop(echoed(&mut a_c, seq + 5));
        }
        for ch in [&mut a_c, &mut b_c] {
            ch.teardown().expect("teardown");
            assert!(matches!(ch.wait(Some(WAIT)), Ok(Event::Closed { .. })));
        }
        let status = support::payload::wait_exit(&mut child, WAIT);
        assert!(status.success(), "{trust:?}: the peer process saw wrong bytes or failed: {status:?}");
    }
}

/// A copy that reaches a domain over TCP while the domain already reads the
/// buffer through another channel lands nowhere (the bytes are the ones it
/// has). Once it has released both copies, the TCP sender, which has not
/// yet seen the release, sends the next copy without payload: the receiver
/// must take the bytes it already has rather than call the copy a protocol
/// error.
#[test]
fn a_copy_resent_without_payload_after_one_that_was_already_here() {
    let (a, b, c) = (Domain::new("a"), Domain::new("b"), Domain::new("c"));
    let alloc = Allocator::new(&a, 4, SIZE, PoolConstraints::default()).unwrap();
    let (mut a_b, mut b_a) = connect(Kind::Local, &a, &b, TrustLevel::Full);
    let (mut b_c, mut c_b) = connect(Kind::Tcp, &b, &c, TrustLevel::Full);
    let (mut a_c, mut c_a) = connect(Kind::Local, &a, &c, TrustLevel::Full);
    // C gets the pool over TCP first (memory of its own), then over the
    // local channel, which therefore carries the bytes into C's memory.
    offer(&mut a_b, &mut b_a, alloc.pool(), true);
    offer(&mut b_c, &mut c_b, &pool_in(&b, alloc.pool()), true);
    offer(&mut a_c, &mut c_a, alloc.pool(), true);
    let mut t = Triangle { a_b, b_a, b_c, c_b, a_c, c_a };
    copy_resent_after_a_discarded_one(&alloc, &mut t);
}

/// Two threads of one domain take offers of the same pool, unknown to the
/// domain, at the same moment, each on a channel of its own: the domain
/// must end with one copy of the pool that both channels use, so the
/// bytes moved over either channel are the ones the domain reads (two
/// imports, the second replacing the first in the domain's list, would
/// leave one channel landing payloads in memory the domain no longer
/// reads). Repeated, so the two offers overlap in many runs.
#[test]
fn offers_of_one_unknown_pool_on_two_threads_at_once_share_one_pool() {
    for kind in [Kind::Tcp, Kind::Shm] {
        for round in 0..60u64 {
            let (source, sink) = (Domain::new("source"), Domain::new("sink"));
            let alloc = Allocator::new(&source, 2, SIZE, PoolConstraints::default()).unwrap();
            let (mut tx1, rx1) = connect(kind, &source, &sink, TrustLevel::Full);
            let (mut tx2, rx2) = connect(kind, &source, &sink, TrustLevel::Full);
            let start = std::sync::Arc::new(std::sync::Barrier::new(3));
            let sinks: Vec<_> = [rx1, rx2]
                .into_iter()
                .map(|mut rx| {
                    let start = start.clone();
                    std::thread::spawn(move || {
                        start.wait();
                        let Ok(Event::PoolAssignRequest(req)) = rx.wait(Some(WAIT)) else { panic!("no offer") };
                        rx.respond_pool(req.pool, true).unwrap();
                        rx.flush().unwrap();
                        let buf = match rx.wait(Some(WAIT)) {
                            Ok(Event::MoveReceived { buffer, .. }) => buffer,
                            ev => panic!("expected a buffer, got {ev:?}"),
                        };
                        (rx, buf)
                    })
                })
                .collect();
            start.wait();
            tx1.assign_pool(alloc.pool()).unwrap();
            tx2.assign_pool(alloc.pool()).unwrap();
            tx1.flush().unwrap();
            tx2.flush().unwrap();
            for tx in [&mut tx1, &mut tx2] {
                assert!(matches!(tx.wait(Some(WAIT)), Ok(Event::PoolAssigned(_))), "{kind:?} round {round}");
            }
            write_and_move(&mut tx1, alloc.alloc().unwrap(), 2 * round + 1);
            write_and_move(&mut tx2, alloc.alloc().unwrap(), 2 * round + 2);
            for (i, s) in sinks.into_iter().enumerate() {
                let (_rx, buf) = s.join().unwrap();
                let seq = 2 * round + 1 + i as u64;
                assert!(check(&buf, seq), "{kind:?} round {round}: channel {i} delivered other bytes than were moved");
            }
        }
    }
}
