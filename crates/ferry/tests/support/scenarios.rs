//! Sequences of operations that more than one transport's tests run.

use std::time::Duration;

use ferry::{Allocator, BufferCopy, BufferState, Channel, Domain, Event, LinkStats, PoolConstraints};

use super::payload::{check, fill};

const WAIT: Duration = Duration::from_secs(10);

/// Three domains A, B and C, each pair joined by a connected channel from
/// the first to the second, A's pool assigned on all three; `b_c` is the
/// transport under test, and C got the pool over it before it got it from
/// A (so C's memory of the pool is its own).
pub struct Triangle {
    pub a_b: Channel,
    pub b_a: Channel,
    pub b_c: Channel,
    pub c_b: Channel,
    pub a_c: Channel,
    pub c_a: Channel,
}

fn copy_in(ch: &mut Channel, what: &str) -> BufferCopy {
    match ch.wait(Some(WAIT)) {
        Ok(Event::CopyReceived { copy, .. }) => copy,
        ev => panic!("{what}: expected a copy, got {ev:?}"),
    }
}

/// A copy from B reaches C while C already reads the buffer through A's
/// channel, so its bytes are discarded on arrival (they are the ones C
/// has). C releases both copies; B, which has not yet read the release,
/// copies again, without payload. C must take the bytes it has, and every
/// copy must come back to A.
pub fn copy_resent_after_a_discarded_one(alloc: &Allocator, t: &mut Triangle) {
    let mut buf = alloc.alloc().unwrap();
    fill(buf.as_mut_slice().unwrap(), 42);
    // C reads the buffer through the channel from A.
    t.a_c.copy(&buf, &[]).unwrap();
    t.a_c.flush().unwrap();
    let held = copy_in(&mut t.c_a, "C from A");
    // B gets a copy and copies it on to C: its bytes arrive where C
    // already reads them.
    t.a_b.copy(&buf, &[]).unwrap();
    t.a_b.flush().unwrap();
    let at_b = copy_in(&mut t.b_a, "B from A");
    t.b_c.copy(&at_b, &[]).unwrap();
    t.b_c.flush().unwrap();
    let first = copy_in(&mut t.c_b, "C from B");
    assert!(check(&first, 42));
    // C lets go of both; B copies again before it has read the release.
    t.c_b.release(first).unwrap();
    t.c_b.flush().unwrap();
    t.c_a.release(held).unwrap();
    t.c_a.flush().unwrap();
    t.b_c.copy(&at_b, &[]).unwrap();
    t.b_c.flush().unwrap();
    let again = copy_in(&mut t.c_b, "C from B, again");
    assert!(check(&again, 42), "the resent copy shows other bytes");
    t.c_b.release(again).unwrap();
    t.c_b.flush().unwrap();
    for _ in 0..2 {
        assert!(matches!(t.b_c.wait(Some(WAIT)), Ok(Event::CopyReleased { .. })));
    }
    t.b_a.release(at_b).unwrap();
    t.b_a.flush().unwrap();
    assert!(matches!(t.a_b.wait(Some(WAIT)), Ok(Event::CopyReleased { .. })));
    assert!(matches!(t.a_c.wait(Some(WAIT)), Ok(Event::CopyReleased { writable: true, .. })));
    assert!(buf.as_mut_slice().is_ok(), "A's buffer is writable once every copy is back");
}

/// Two connected ends, `tx`'s pool (`alloc`) assigned, whose peer timeouts
/// differ: both stay idle for `idle`, longer than the shorter timeout, and
/// must see no event (the keep-alives that keep them up are not events);
/// then a move made after the idle time still arrives intact.
pub fn idle_then_move(tx: &mut Channel, mut rx: Channel, alloc: &Allocator, idle: Duration) {
    const SEQ: u64 = 7;
    let (idled, sink_idled) = std::sync::mpsc::channel();
    let sink = std::thread::spawn(move || {
        // Idle: only keep-alives go out, from within the wait.
        let seen = rx.wait(Some(idle));
        assert!(matches!(seen, Err(ferry::WaitError::TimedOut)), "the long-timeout end saw {seen:?} while idle");
        idled.send(()).unwrap();
        match rx.wait(Some(WAIT)) {
            Ok(Event::MoveReceived { buffer, meta }) => {
                assert_eq!(&meta[..], &SEQ.to_le_bytes()[..]);
                assert!(check(&buffer, SEQ), "the bytes moved after the idle time");
            }
            ev => panic!("expected the move after the idle time, got {ev:?}"),
        }
    });
    let seen = tx.wait(Some(idle));
    assert!(
        matches!(seen, Err(ferry::WaitError::TimedOut)),
        "the short-timeout end saw {seen:?} while idle: the peer's keep-alives were too rare"
    );
    sink_idled.recv().expect("the sink stayed up while idle");
    let mut buf = alloc.alloc().unwrap();
    fill(buf.as_mut_slice().unwrap(), SEQ);
    tx.move_buffer(buf, &SEQ.to_le_bytes()).unwrap();
    tx.flush().unwrap();
    sink.join().unwrap();
}

fn next(ch: &mut Channel) -> Event {
    match ch.wait(Some(WAIT)) {
        Ok(ev) => ev,
        Err(_) => panic!("no event within {WAIT:?} (state {:?})", ch.state()),
    }
}

fn seq_of(meta: &[u8]) -> u64 {
    u64::from_le_bytes(meta[..8].try_into().unwrap())
}

/// Moves, passes and copies between two domains over a transport that
/// mirrors the pool (TCP, the fabric): `tx` is a TX master of `src` that a
/// binder is about to reach; `bind` makes the sink end in a thread of its
/// own. 200 moves of `size`-byte buffers that the sink checks, writes and
/// passes back (each checked here), then four copies of one buffer that
/// the sink checks and releases (the owner reads while they are out and
/// writes once all are back). The counters of both ends show that every
/// payload went straight from buffer to buffer (the first copy carries
/// the bytes, the next three find them there) and none was staged; they
/// are returned (ours, the sink's) for the transport's own checks.
pub fn flows(
    src: &Domain,
    mut tx: Channel,
    size: usize,
    bind: impl FnOnce(&Domain) -> Channel + Send + 'static,
) -> (LinkStats, LinkStats) {
    let sink = std::thread::spawn(move || {
        let d = Domain::new("sink");
        let mut rx = bind(&d);
        let mut copies = Vec::new();
        loop {
            match next(&mut rx) {
                Event::Bound => {}
                Event::PoolAssignRequest(req) => rx.respond_pool(req.pool, true).unwrap(),
                Event::MoveReceived { mut buffer, meta } => {
                    let seq = seq_of(&meta);
                    assert!(check(&buffer, seq), "move {seq} arrived corrupted");
                    fill(buffer.as_mut_slice().unwrap(), seq + 1);
                    rx.pass(buffer, &meta).unwrap();
                }
                Event::CopyReceived { copy, meta } => {
                    assert!(check(&copy, seq_of(&meta)), "copy arrived corrupted");
                    copies.push(copy);
                    if copies.len() == 4 {
                        for c in copies.drain(..) {
                            rx.release(c).unwrap();
                        }
                    }
                }
                Event::Closed { .. } => break,
                ev => panic!("sink: unexpected {ev:?}"),
            }
        }
        rx.link_stats()
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    let alloc = Allocator::new(src, 8, size, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    match next(&mut tx) {
        Event::PoolAssigned(_) => {}
        ev => panic!("expected the pool assigned, got {ev:?}"),
    }
    // The sink writes seq + 1: its write must come back.
    let total = 200u64;
    super::payload::move_and_take_back(&mut tx, &alloc, total, |seq| seq + 1);
    let mut b = alloc.alloc().unwrap();
    fill(b.as_mut_slice().unwrap(), 7);
    for _ in 0..4 {
        tx.copy(&b, &7u64.to_le_bytes()).unwrap();
    }
    assert_eq!(src.buffer_state(b.id()), BufferState::ReadOnlyOwned);
    let mut released = 0;
    while released < 4 {
        match next(&mut tx) {
            Event::CopyReleased { writable, .. } => {
                released += 1;
                assert_eq!(writable, released == 4);
            }
            ev => panic!("unexpected {ev:?}"),
        }
    }
    assert!(b.as_mut_slice().is_ok());
    drop(b);
    tx.teardown().unwrap();
    assert!(matches!(next(&mut tx), Event::Closed { by_peer: false }));
    let ours = tx.link_stats().expect("the transport counts");
    let theirs = sink.join().unwrap().expect("the transport counts");
    let moved = total * size as u64;
    assert_eq!(ours.payload_sent, moved + size as u64, "{ours:?}");
    assert_eq!(ours.payload_received, moved, "{ours:?}");
    assert_eq!(theirs.payload_received, moved + size as u64, "{theirs:?}");
    assert_eq!((ours.payload_staged, theirs.payload_staged), (0, 0), "no payload byte copied in user space");
    assert_eq!(alloc.available(), 8);
    (ours, theirs)
}
