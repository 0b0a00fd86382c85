//! The helpers of the short path (`Channel::accept`, `connect`,
//! `wait_connected`, `PoolPolicy::AcceptAll`, `assign_pool_and_wait`) and the
//! typed views of buffer memory, on the three backends: local (threads),
//! shm and TCP (both ends in this process, on two threads, over real
//! sockets). Covered: both start orders, timeouts and refusals as typed
//! errors, vetoes, and that no event is lost while a helper waits.
//!
//! Every wait has a timeout, so a bug fails a test instead of hanging it.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use ferry::{
    Allocator, BindParams, Channel, ChannelConstraints, ChannelSetup, ChannelState, Direction, Domain, Endpoint,
    ErrorKind, Event, PoolConstraints, PoolPolicy, TrustLevel,
};

/// Upper bound of every wait that should succeed.
const T: Duration = Duration::from_secs(10);
/// The timeout of the waits that should time out.
const SHORT: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy)]
enum Backend {
    Local,
    Shm,
    Tcp,
}

const ALL: [Backend; 3] = [Backend::Local, Backend::Shm, Backend::Tcp];

/// A fresh endpoint nobody listens on. For TCP, a port that was free a
/// moment ago (taken from the kernel and given back).
fn endpoint(b: Backend) -> Endpoint {
    static N: AtomicU32 = AtomicU32::new(0);
    match b {
        Backend::Local => Endpoint::local(),
        Backend::Shm => {
            let n = N.fetch_add(1, Ordering::Relaxed);
            Endpoint::shm_abstract(&format!("ferry-convenience-{}-{n}", std::process::id()))
        }
        Backend::Tcp => {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            Endpoint::tcp(SocketAddr::from(([127, 0, 0, 1], port)))
        }
    }
}

fn spawn_connect(d: &Domain, ep: &Endpoint, params: BindParams, t: Duration) -> JoinHandle<ferry::Result<Channel>> {
    let (d, ep) = (d.clone(), ep.clone());
    std::thread::spawn(move || Channel::connect(&d, &ep, params, t))
}

/// A connected pair through the helpers: creator (`setup`) and binder.
fn pair(b: Backend, setup: ChannelSetup, params: BindParams) -> (Channel, Channel) {
    let (a, z) = (Domain::new("creator"), Domain::new("binder"));
    let ep = endpoint(b);
    let binder = spawn_connect(&z, &ep, params, T);
    let creator = Channel::accept(&a, &ep, setup, T).unwrap_or_else(|e| panic!("{b:?}: accept: {e}"));
    let binder = binder.join().unwrap().unwrap_or_else(|e| panic!("{b:?}: connect: {e}"));
    (creator, binder)
}

fn alloc(ch: &Channel, count: u64) -> Allocator {
    Allocator::new(ch.domain(), count, 4096, PoolConstraints::default()).unwrap()
}

#[track_caller]
fn next(ch: &mut Channel) -> Event {
    ch.wait(Some(T)).unwrap_or_else(|e| panic!("no event within {T:?} on {ch:?}: {e}"))
}

/// Run `f` on `ch` in a thread; `join` gives the channel back.
fn on_thread<R: Send + 'static>(
    mut ch: Channel,
    f: impl FnOnce(&mut Channel) -> R + Send + 'static,
) -> JoinHandle<(Channel, R)> {
    std::thread::spawn(move || {
        let r = f(&mut ch);
        (ch, r)
    })
}

// ---------------------------------------------------------------------------
// accept / connect / wait_connected

/// Creator first, or binder first (it retries while nobody listens): both
/// end connected, with the negotiated properties, and nothing left to poll.
#[test]
fn accept_and_connect_in_either_order() {
    for b in ALL {
        let (mut tx, mut rx) = pair(b, ChannelSetup::default(), BindParams::default());
        assert_eq!((tx.state(), rx.state()), (ChannelState::Connected, ChannelState::Connected), "{b:?}");
        assert_eq!((tx.direction(), rx.direction()), (Direction::Tx, Direction::Rx), "{b:?}");
        assert!(tx.poll().is_none() && rx.poll().is_none(), "{b:?}: the setup events were taken");

        // The binder starts well before anybody listens.
        let (a, z) = (Domain::new("late creator"), Domain::new("early binder"));
        let ep = endpoint(b);
        let binder = spawn_connect(&z, &ep, BindParams::default(), T);
        std::thread::sleep(Duration::from_millis(50));
        let tx = Channel::accept(&a, &ep, ChannelSetup::default(), T).unwrap_or_else(|e| panic!("{b:?}: {e}"));
        let rx = binder.join().unwrap().unwrap_or_else(|e| panic!("{b:?}: {e}"));
        assert_eq!((tx.state(), rx.state()), (ChannelState::Connected, ChannelState::Connected), "{b:?}");
    }
}

/// Nobody binds: `accept` times out and the endpoint is free again.
/// Nobody listens: `connect` says so after its timeout.
#[test]
fn timeouts_are_typed() {
    for b in ALL {
        let d = Domain::new("d");
        let ep = endpoint(b);
        let err = Channel::connect(&d, &ep, BindParams::default(), SHORT).unwrap_err();
        assert_eq!(err, ErrorKind::EndpointNotListening, "{b:?}");
        let err = Channel::accept(&d, &ep, ChannelSetup::default(), SHORT).unwrap_err();
        assert_eq!(err, ErrorKind::TimedOut, "{b:?}");
        // The endpoint is free again: a new channel can be created there.
        let mut ch = Channel::create(&d, &ep, ChannelSetup::default()).unwrap_or_else(|e| panic!("{b:?}: {e}"));
        assert_eq!(ch.wait_connected(Duration::ZERO), Err(ErrorKind::TimedOut.into()), "{b:?}");
        assert_eq!(ch.state(), ChannelState::Initialized);
    }
}

/// A binder the creator cannot accept gets the refusal as an error, not a
/// timeout; the creator keeps waiting for a proper binder.
#[test]
fn refused_bind_is_an_error() {
    for b in ALL {
        let (a, z) = (Domain::new("creator"), Domain::new("binder"));
        let ep = endpoint(b);
        let mut creator = Channel::create(&a, &ep, ChannelSetup::default()).unwrap();
        let strict = BindParams { trust: Some(TrustLevel::Half), ..BindParams::default() };
        let binder = spawn_connect(&z, &ep, strict, T);
        // Local: the creator's setup fails with the refusal too.
        // TCP and shm: it keeps listening, and times out.
        match creator.wait_connected(SHORT * 5) {
            Err(err) if matches!(err.kind(), ErrorKind::TimedOut | ErrorKind::BindRefused(_)) => {}
            other => panic!("{b:?}: {other:?}"),
        }
        match binder.join().unwrap() {
            Err(why) if matches!(why.kind(), ErrorKind::BindRefused(_)) => {
                assert!(why.to_string().contains("trust"), "{b:?}: {why}")
            }
            other => panic!("{b:?}: expected a refusal, got {other:?}"),
        }
    }
}

/// `wait_connected` on a connected channel is Ok at once; on a closed one
/// it is a typed error.
#[test]
fn wait_connected_states() {
    for b in ALL {
        let (mut tx, mut rx) = pair(b, ChannelSetup::default(), BindParams::default());
        assert_eq!(tx.wait_connected(Duration::ZERO), Ok(()));
        tx.teardown().unwrap();
        tx.flush().unwrap();
        assert_eq!(tx.wait_connected(T), Err(ErrorKind::NotConnected(ChannelState::Teardown).into()));
        assert!(matches!(next(&mut rx), Event::Closed { by_peer: true }), "{b:?}");
        assert_eq!(rx.wait_connected(T), Err(ErrorKind::NotConnected(ChannelState::Closed).into()));
    }
}

// ---------------------------------------------------------------------------
// Pool policy and assign_pool_and_wait

/// Under AcceptAll the receiver's library accepts and reports nothing: the
/// sender's wait ends with Ok, and the receiver's first event is the first
/// move. Under AcceptAndReport the receiver still sees the request, already
/// answered.
#[test]
fn accept_all_and_assign_and_wait() {
    for (b, report) in ALL.into_iter().flat_map(|b| [(b, false), (b, true)]) {
        let (mut tx, mut rx) = pair(b, ChannelSetup::default(), BindParams::default());
        assert_eq!(rx.pool_policy(), PoolPolicy::Ask);
        rx.set_pool_policy(if report { PoolPolicy::AcceptAndReport } else { PoolPolicy::AcceptAll });
        let pool = alloc(&tx, 4);
        let id = pool.pool().id();
        let receiver = on_thread(rx, move |rx| {
            let mut ev = next(rx);
            if report {
                let req = match ev {
                    Event::PoolAssignRequest(req) => req,
                    ev => panic!("expected the request, got {ev:?}"),
                };
                assert!(rx.is_assigned(req.pool) && rx.pending_requests().is_empty());
                assert_eq!(rx.respond_pool(req.pool, true), Err(ErrorKind::NoPendingRequest(req.pool).into()));
                ev = next(rx);
            }
            match ev {
                Event::MoveReceived { buffer, meta } => (buffer.id().pool, buffer[0], meta.to_vec()),
                ev => panic!("expected a move (report: {report}), got {ev:?}"),
            }
        });
        tx.assign_pool_and_wait(pool.pool(), T).unwrap_or_else(|e| panic!("{b:?}: {e}"));
        assert!(tx.is_assigned(id));
        let mut buf = pool.alloc().unwrap();
        buf.as_mut_slice().unwrap()[0] = 42;
        tx.move_buffer(buf, b"m").unwrap();
        tx.flush().unwrap();
        let (rx, got) = receiver.join().unwrap();
        assert_eq!(got, (id, 42, b"m".to_vec()), "{b:?}");
        assert!(rx.is_assigned(id) && rx.pending_requests().is_empty());
        // Assigning it again is refused as before.
        assert_eq!(tx.assign_pool_and_wait(pool.pool(), T), Err(ErrorKind::PoolAlreadyAssigned(id).into()));
    }
}

/// A veto by the peer, and one by the peer's library (the pool is outside
/// the channel's constraints even under AcceptAll): `PoolVetoed`.
#[test]
fn vetoes_are_typed() {
    for b in ALL {
        let (mut tx, rx) = pair(b, ChannelSetup::default(), BindParams::default());
        let pool = alloc(&tx, 2);
        let id = pool.pool().id();
        let receiver = on_thread(rx, |rx| match next(rx) {
            // (TCP sends when polled or flushed.)
            Event::PoolAssignRequest(req) => rx.respond_pool(req.pool, false).and_then(|()| rx.flush()).unwrap(),
            ev => panic!("expected the request, got {ev:?}"),
        });
        assert_eq!(tx.assign_pool_and_wait(pool.pool(), T), Err(ErrorKind::PoolVetoed(id).into()), "{b:?}");
        assert!(!tx.is_assigned(id));
        receiver.join().unwrap();

        let params = BindParams {
            constraints: ChannelConstraints { min_buffer_size: 8192, ..ChannelConstraints::default() },
            ..BindParams::default()
        };
        let (mut tx, mut rx) = pair(b, ChannelSetup::default(), params);
        rx.set_pool_policy(PoolPolicy::AcceptAll);
        let small = alloc(&tx, 2);
        let receiver = on_thread(rx, |rx| {
            let ev = next(rx);
            rx.flush().unwrap();
            ev
        });
        let id = small.pool().id();
        assert_eq!(tx.assign_pool_and_wait(small.pool(), T), Err(ErrorKind::PoolVetoed(id).into()), "{b:?}");
        let (rx, seen) = receiver.join().unwrap();
        assert!(matches!(seen, Event::PoolVetoed(p) if p == id), "{b:?}: the library vetoed by itself: {seen:?}");
        assert!(!rx.is_assigned(id));
    }
}

/// The peer does not answer in time: `TimedOut`; its answer comes later
/// as an ordinary event.
#[test]
fn assign_timeout_then_the_answer_as_an_event() {
    for b in ALL {
        let (mut tx, mut rx) = pair(b, ChannelSetup::default(), BindParams::default());
        let pool = alloc(&tx, 2);
        let id = pool.pool().id();
        assert_eq!(tx.assign_pool_and_wait(pool.pool(), SHORT), Err(ErrorKind::TimedOut.into()), "{b:?}");
        match next(&mut rx) {
            Event::PoolAssignRequest(req) => rx.respond_pool(req.pool, true).unwrap(),
            ev => panic!("{b:?}: expected the request, got {ev:?}"),
        }
        rx.flush().unwrap();
        assert!(matches!(next(&mut tx), Event::PoolAssigned(p) if p == id), "{b:?}");
    }
}

/// Events that arrive while `assign_pool_and_wait` waits are handed out
/// afterwards, in order: passed buffers, the peer's own pool request.
#[test]
fn no_event_is_lost_while_waiting() {
    for b in ALL {
        let (mut tx, mut rx) = pair(b, ChannelSetup::default(), BindParams::default());
        rx.set_pool_policy(PoolPolicy::AcceptAndReport);
        let first = alloc(&tx, 4);
        let receiver = on_thread(rx, |rx| while !matches!(next(rx), Event::PoolAssignRequest(_)) {});
        tx.assign_pool_and_wait(first.pool(), T).unwrap();
        let (mut rx, ()) = receiver.join().unwrap();

        // Three moves, passed back, and a pool the receiver offers: five
        // messages on their way to the sender, which does not poll.
        let mut sent = Vec::new();
        for i in 0..3u8 {
            let mut buf = first.alloc().unwrap();
            buf.as_mut_slice().unwrap()[0] = i;
            sent.push(buf.id());
            tx.move_buffer(buf, &[i]).unwrap();
        }
        tx.flush().unwrap();
        for _ in 0..3 {
            match next(&mut rx) {
                Event::MoveReceived { buffer, meta } => rx.pass(buffer, &meta).unwrap(),
                ev => panic!("{b:?}: expected a move, got {ev:?}"),
            }
        }
        let theirs = alloc(&rx, 2);
        rx.assign_pool(theirs.pool()).unwrap();
        rx.flush().unwrap();

        // Now the sender assigns a second pool and waits for the answer.
        let second = alloc(&tx, 2);
        let receiver = on_thread(rx, |rx| while !matches!(next(rx), Event::PoolAssignRequest(_)) {});
        tx.assign_pool_and_wait(second.pool(), T).unwrap_or_else(|e| panic!("{b:?}: {e}"));
        let (_rx, ()) = receiver.join().unwrap();

        for (i, id) in sent.iter().enumerate() {
            match tx.poll() {
                Some(Event::BufferPassed { buffer, meta }) => {
                    assert_eq!((buffer.id(), buffer[0], &meta[..]), (*id, i as u8, &[i as u8][..]), "{b:?}")
                }
                ev => panic!("{b:?}: expected pass {i} back, got {ev:?}"),
            }
        }
        match tx.poll() {
            Some(Event::PoolAssignRequest(req)) => assert_eq!(req.pool, theirs.pool().id(), "{b:?}"),
            ev => panic!("{b:?}: expected the receiver's pool request, got {ev:?}"),
        }
        assert!(tx.poll().is_none(), "{b:?}: the assignment reply itself was taken");
        tx.respond_pool(theirs.pool().id(), true).unwrap();
        assert_eq!(first.available(), 4);
    }
}

/// The peer tears the channel down instead of answering: the wait ends
/// with an error, and the close is still reported by the next poll.
#[test]
fn close_while_waiting_is_reported_twice() {
    for b in ALL {
        let (mut tx, rx) = pair(b, ChannelSetup::default(), BindParams::default());
        let pool = alloc(&tx, 2);
        let receiver = on_thread(rx, |rx| {
            rx.teardown().unwrap();
            // Drain until closed (the request may or may not come first).
            while !matches!(next(rx), Event::Closed { .. }) {}
        });
        let err = tx.assign_pool_and_wait(pool.pool(), T).unwrap_err();
        assert_eq!(err, ErrorKind::NotConnected(ChannelState::Closed), "{b:?}");
        receiver.join().unwrap();
        assert!(matches!(tx.poll(), Some(Event::Closed { by_peer: true })), "{b:?}");
        assert!(tx.poll().is_none());
    }
}

/// A copy taken by a helper and never polled goes back to its owner when
/// the channel is dropped (as an unseen copy in the queue does).
#[test]
fn held_copies_go_back_on_drop() {
    for b in ALL {
        // The receiver is the one that waits here: it assigns its own pool
        // while a copy from the sender is on its way.
        let (mut tx, mut rx) = pair(b, ChannelSetup::default(), BindParams::default());
        tx.set_pool_policy(PoolPolicy::AcceptAndReport);
        rx.set_pool_policy(PoolPolicy::AcceptAndReport);
        let pool = alloc(&tx, 2);
        let receiver = on_thread(rx, |rx| while !matches!(next(rx), Event::PoolAssignRequest(_)) {});
        tx.assign_pool_and_wait(pool.pool(), T).unwrap();
        let (mut rx, ()) = receiver.join().unwrap();
        let buf = pool.alloc().unwrap();
        tx.copy(&buf, &[]).unwrap();
        tx.flush().unwrap();
        let theirs = alloc(&rx, 2);
        let sender = on_thread(tx, |tx| while !matches!(next(tx), Event::PoolAssignRequest(_)) {});
        rx.assign_pool_and_wait(theirs.pool(), T).unwrap_or_else(|e| panic!("{b:?}: {e}"));
        let (mut tx, ()) = sender.join().unwrap();
        drop(rx); // the copy is held, unseen
        match next(&mut tx) {
            Event::CopyReleased { buffer, writable } => assert_eq!((buffer, writable), (buf.id(), true), "{b:?}"),
            ev => panic!("{b:?}: expected the copy back, got {ev:?}"),
        }
        let mut buf = buf;
        assert!(buf.as_mut_slice().is_ok(), "{b:?}: the owner may write again");
    }
}

// ---------------------------------------------------------------------------
// Typed views through a channel

/// Words written through a typed view arrive as the same words, in a moved
/// buffer and in a copy.
#[test]
fn typed_views_round_trip() {
    for b in ALL {
        let (mut tx, mut rx) = pair(b, ChannelSetup::default(), BindParams::default());
        rx.set_pool_policy(PoolPolicy::AcceptAll);
        let pool = Allocator::new(tx.domain(), 2, 8192, PoolConstraints::default()).unwrap();
        let receiver = on_thread(rx, |rx| {
            let mut got = Vec::new();
            while got.len() < 2 {
                match next(rx) {
                    Event::MoveReceived { buffer, .. } => {
                        got.push(buffer.as_slice_of::<u64>().unwrap().to_vec());
                        rx.pass(buffer, &[]).unwrap();
                    }
                    Event::CopyReceived { copy, .. } => {
                        let pairs: &[[u32; 2]] = copy.slice_of(8, 1023).unwrap();
                        assert_eq!(pairs.len(), 1023);
                        got.push(copy.as_slice_of::<u64>().unwrap().to_vec());
                        rx.release(copy).unwrap();
                    }
                    Event::PoolAssignRequest(_) => {}
                    ev => panic!("unexpected {ev:?}"),
                }
            }
            rx.flush().unwrap();
            got
        });
        tx.assign_pool_and_wait(pool.pool(), T).unwrap();
        let mut a = pool.alloc().unwrap();
        let mut c = pool.alloc().unwrap();
        for (i, w) in a.as_mut_slice_of::<u64>().unwrap().iter_mut().enumerate() {
            *w = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
        c.as_mut_slice_of::<u64>().unwrap().fill(u64::MAX - 1);
        let want_a = a.as_slice_of::<u64>().unwrap().to_vec();
        tx.move_buffer(a, &[]).unwrap();
        tx.copy(&c, &[]).unwrap();
        tx.flush().unwrap();
        let (_rx, got) = receiver.join().unwrap();
        assert_eq!(got, vec![want_a, vec![u64::MAX - 1; 1024]], "{b:?}");
    }
}
