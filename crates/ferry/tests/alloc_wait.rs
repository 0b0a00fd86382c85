//! `Allocator::alloc_wait`: a producer that allocates, or waits for a
//! buffer to come back, in one call, over real channels (threads, local
//! backend): passes back are taken, every other event is kept in order.

use std::time::{Duration, Instant};

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, ErrorKind, Event, PoolConstraints};

const T: Duration = Duration::from_secs(10);

/// A connected pair: `tx` in `producer`, `rx` in a domain of its own.
fn pair(producer: &Domain) -> (Channel, Channel) {
    let ep = Endpoint::local();
    let mut tx = Channel::create(producer, &ep, ChannelSetup::default()).unwrap();
    let mut rx = Channel::bind(&Domain::new("sink"), &ep, BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    (tx, rx)
}

fn next(ch: &mut Channel) -> Event {
    ch.wait(Some(T)).unwrap_or_else(|e| panic!("no event within {T:?}: {e:?} (state {:?})", ch.state()))
}

/// While the producer waits for a buffer, the sink releases a copy, offers
/// a pool of its own and passes a buffer back with meta data: the pass is
/// taken (the buffer is what alloc_wait returns), the release and the
/// offer are kept for the producer's next poll, in the order they came.
#[test]
fn takes_passes_back_and_keeps_other_events() {
    let producer = Domain::new("producer");
    let (mut tx, mut rx) = pair(&producer);
    let alloc = Allocator::new(&producer, 2, 4096, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(next(&mut rx), Event::PoolAssignRequest(_)));
    rx.respond_pool(alloc.pool().id(), true).unwrap();
    assert!(matches!(next(&mut tx), Event::PoolAssigned(_)));

    let mut kept = alloc.alloc().unwrap();
    kept.as_mut_slice().unwrap()[0] = 1;
    tx.copy(&kept, b"copy").unwrap();
    let mut moved = alloc.alloc().unwrap();
    moved.as_mut_slice().unwrap()[0] = 2;
    let moved_id = moved.id();
    tx.move_buffer(moved, b"move").unwrap();
    assert!(alloc.alloc().is_none(), "both buffers are out");

    let sink = std::thread::spawn(move || {
        let sink_pool = Allocator::new(rx.domain(), 1, 4096, PoolConstraints::default()).unwrap();
        let Event::CopyReceived { copy, .. } = next(&mut rx) else { panic!("copy first") };
        assert_eq!(copy[0], 1);
        rx.release(copy).unwrap();
        let Event::MoveReceived { buffer, .. } = next(&mut rx) else { panic!("then the move") };
        assert_eq!(buffer[0], 2);
        rx.assign_pool(sink_pool.pool()).unwrap();
        rx.pass(buffer, b"answer: dropped").unwrap();
        // The producer answers the offer once alloc_wait has returned.
        match next(&mut rx) {
            Event::PoolAssigned(p) if p == sink_pool.pool().id() => rx,
            ev => panic!("sink: {ev:?}"),
        }
    });

    let got = alloc.alloc_wait(&mut tx, T).unwrap();
    assert_eq!(got.id(), moved_id, "the buffer passed back");
    assert_eq!(got[0], 2);
    match tx.poll() {
        Some(Event::CopyReleased { buffer, writable: true }) => assert_eq!(buffer, kept.id()),
        ev => panic!("expected the release first, got {ev:?}"),
    }
    let Some(Event::PoolAssignRequest(req)) = tx.poll() else { panic!("then the sink's offer") };
    assert!(kept.as_mut_slice().is_ok(), "the copy is back: the kept buffer is writable");
    tx.respond_pool(req.pool, true).unwrap();
    let _rx = sink.join().unwrap();
    assert!(tx.poll().is_none(), "nothing else arrived");
}

/// Passes back that an earlier helper kept in the channel count too: here
/// assign_pool_and_wait took one while waiting for its answer.
#[test]
fn takes_passes_kept_by_an_earlier_helper() {
    let producer = Domain::new("producer");
    let (mut tx, mut rx) = pair(&producer);
    rx.set_pool_policy(ferry::PoolPolicy::AcceptAll);
    let a = Allocator::new(&producer, 1, 4096, PoolConstraints::default()).unwrap();
    let b = Allocator::new(&producer, 1, 4096, PoolConstraints::default()).unwrap();
    tx.assign_pool(a.pool()).unwrap();
    assert!(rx.poll().is_none(), "accepted by the policy, quietly");
    assert!(rx.is_assigned(a.pool().id()));
    assert!(matches!(next(&mut tx), Event::PoolAssigned(_)));
    tx.move_buffer(a.alloc().unwrap(), &[]).unwrap();
    let Event::MoveReceived { buffer, .. } = next(&mut rx) else { panic!() };
    rx.pass(buffer, &[]).unwrap();
    // The pass arrives while tx waits for b's answer: it is kept.
    let sink = std::thread::spawn(move || {
        while rx.wait(Some(Duration::from_millis(200))).is_ok() {}
        rx
    });
    tx.assign_pool_and_wait(b.pool(), T).unwrap();
    assert_eq!(a.available(), 0, "the pass is kept in the channel");
    let got = a.alloc_wait(&mut tx, Duration::from_millis(100)).unwrap();
    assert_eq!(got.id().pool, a.pool().id());
    assert!(tx.poll().is_none());
    drop(sink.join().unwrap());
}

/// Nothing comes back: TimedOut after the timeout. Then the sink goes
/// away: the error, and the event stays for the producer's loop.
#[test]
fn times_out_then_reports_the_end_and_keeps_it() {
    let producer = Domain::new("producer");
    let (mut tx, mut rx) = pair(&producer);
    let alloc = Allocator::new(&producer, 1, 4096, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    let Event::PoolAssignRequest(req) = next(&mut rx) else { panic!() };
    rx.respond_pool(req.pool, true).unwrap();
    assert!(matches!(next(&mut tx), Event::PoolAssigned(_)));
    tx.move_buffer(alloc.alloc().unwrap(), &[]).unwrap();
    let Event::MoveReceived { buffer, .. } = next(&mut rx) else { panic!() };

    let t0 = Instant::now();
    assert_eq!(alloc.alloc_wait(&mut tx, Duration::from_millis(50)).unwrap_err(), ErrorKind::TimedOut);
    assert!(t0.elapsed() >= Duration::from_millis(50));

    rx.teardown().unwrap();
    drop(buffer);
    let err = alloc.alloc_wait(&mut tx, T).unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::NotConnected(_)), "{err}");
    assert!(matches!(tx.poll(), Some(Event::Closed { by_peer: true })), "the end is kept for the loop");
    drop(rx);
}

/// A buffer dropped on another thread comes back without any event on the
/// channel: alloc_wait sees it anyway.
#[test]
fn sees_a_buffer_dropped_on_another_thread() {
    let producer = Domain::new("producer");
    let (mut tx, _rx) = pair(&producer);
    let alloc = Allocator::new(&producer, 1, 4096, PoolConstraints::default()).unwrap();
    let buf = alloc.alloc().unwrap();
    let id = buf.id();
    let dropper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        drop(buf);
    });
    assert_eq!(alloc.alloc_wait(&mut tx, T).unwrap().id(), id);
    dropper.join().unwrap();
}

/// A channel of another domain: refused at once.
#[test]
fn refuses_a_channel_of_another_domain() {
    let (mut tx, _rx) = pair(&Domain::new("other"));
    let alloc = Allocator::new(&Domain::new("producer"), 1, 4096, PoolConstraints::default()).unwrap();
    let _held = alloc.alloc().unwrap();
    assert!(matches!(alloc.alloc_wait(&mut tx, T).map_err(|e| e.kind().clone()), Err(ErrorKind::InvalidArgument(_))));
}
