//! `Channel::stats`, `Pool::stats` and `Domain::stats` after each kind of
//! operation, and the registry file of this process read back.

use std::time::Duration;

use ferry::inspect;
use ferry::{
    Aggregate, Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, ErrorKind, Event, OpCounts,
    PoolConstraints, PoolPolicy, PoolStats,
};

const T: Duration = Duration::from_secs(10);

fn pair(a: &Domain, b: &Domain, depth: u32) -> (Channel, Channel) {
    let ep = Endpoint::local();
    let setup = ChannelSetup { queue_depth: depth, ..ChannelSetup::default() };
    let mut tx = Channel::create(a, &ep, setup).unwrap();
    let mut rx = Channel::bind(b, &ep, BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    rx.set_pool_policy(PoolPolicy::AcceptAndReport);
    (tx, rx)
}

/// Assign `alloc`'s pool from `tx` (one thread plays both ends).
fn assign(tx: &mut Channel, rx: &mut Channel, alloc: &Allocator) {
    tx.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(next(rx), Event::PoolAssignRequest(_)));
    assert!(matches!(next(tx), Event::PoolAssigned(_)));
}

fn next(ch: &mut Channel) -> Event {
    ch.wait(Some(T)).expect("an event")
}

#[test]
fn every_kind_of_operation_is_counted_on_both_ends() {
    let (a, b) = (Domain::new("counting-a"), Domain::new("counting-b"));
    let (mut tx, mut rx) = pair(&a, &b, 4);
    let alloc = Allocator::new(&a, 8, 4096, PoolConstraints::default()).unwrap();
    assign(&mut tx, &mut rx, &alloc);
    let pool = alloc.pool().id();

    // A move: lent by a, in use at b.
    tx.move_buffer(alloc.alloc().unwrap(), &[]).unwrap();
    let Event::MoveReceived { buffer, .. } = next(&mut rx) else { panic!() };
    assert_eq!(alloc.pool().stats(), PoolStats { free: 7, in_use: 0, lent: 1, copies_held: 0, copies_out: 0 });
    let at_b = b.stats().pools.into_iter().find(|p| p.0 == pool).unwrap().2;
    assert_eq!(at_b, PoolStats { free: 0, in_use: 1, lent: 0, copies_held: 0, copies_out: 0 });
    rx.pass(buffer, &[]).unwrap();
    let Event::BufferPassed { buffer, .. } = next(&mut tx) else { panic!() };
    drop(buffer);

    // A copy and its release.
    let kept = alloc.alloc().unwrap();
    tx.copy(&kept, &[]).unwrap();
    let Event::CopyReceived { copy, .. } = next(&mut rx) else { panic!() };
    assert_eq!(alloc.pool().stats(), PoolStats { free: 7, in_use: 1, lent: 0, copies_held: 0, copies_out: 1 });
    let at_b = b.stats().pools.into_iter().find(|p| p.0 == pool).unwrap().2;
    assert_eq!(at_b.copies_held, 1);
    rx.release(copy).unwrap();
    assert!(matches!(next(&mut tx), Event::CopyReleased { writable: true, .. }));
    assert_eq!(alloc.pool().stats().copies_out, 0);
    drop(kept);

    // An aggregate of one moved member.
    let agg = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"abc").unwrap();
    tx.send_aggregate(agg, &[]).unwrap();
    let Event::Aggregate { agg, .. } = next(&mut rx) else { panic!() };
    drop(agg);

    // A full queue: refused, counted, blocked until a send goes.
    let mut refused = None;
    for _ in 0..5 {
        match tx.move_buffer(alloc.alloc().unwrap(), &[]) {
            Ok(()) => {}
            Err(r) => {
                assert_eq!(r.error, ErrorKind::QueueFull);
                refused = Some(r.into_inner());
                break;
            }
        }
    }
    let refused = refused.expect("a queue of 4 refuses the fifth move");
    let s = tx.stats();
    assert!(s.blocked);
    assert_eq!((s.queue_full, s.queue_capacity, s.queue_depth, s.queue_high_water), (1, 4, 4, 4));
    while let Some(ev) = rx.poll() {
        if let Event::MoveReceived { buffer, .. } = ev {
            rx.pass(buffer, &[]).unwrap();
        }
    }
    tx.move_buffer(refused, &[]).unwrap();
    assert!(!tx.stats().blocked);
    assert!(matches!(next(&mut rx), Event::MoveReceived { .. }));

    let s = tx.stats();
    // Moves: one, the aggregate's member, four, the refused one again.
    assert_eq!(s.sent, OpCounts { moves: 7, copies: 1, pool_assigns: 1, aggregates: 1, ..OpCounts::default() });
    assert_eq!(s.received, OpCounts { passes: 1, releases: 1, ..OpCounts::default() });
    assert_eq!(s.bytes_sent, 8 * 4096);
    let r = rx.stats();
    assert_eq!(r.received, OpCounts { moves: 7, copies: 1, pool_assigns: 1, aggregates: 1, ..OpCounts::default() });
    assert_eq!(r.sent, OpCounts { passes: 1 + 4, releases: 1, ..OpCounts::default() });
    assert_eq!(r.bytes_received, 8 * 4096);
    assert_eq!((s.errors, r.errors), (0, 0));

    // Waiting with nothing to come: one sleep, counted.
    let before = rx.stats().wakeups;
    assert_eq!(rx.wait(Some(Duration::from_millis(20))).unwrap_err(), ferry::WaitError::TimedOut);
    assert!(rx.stats().wakeups > before);
}

#[test]
fn pool_removal_and_errors_are_counted() {
    let (a, b) = (Domain::new("removing-a"), Domain::new("removing-b"));
    let (mut tx, mut rx) = pair(&a, &b, 16);
    let alloc = Allocator::new(&a, 2, 4096, PoolConstraints::default()).unwrap();
    assign(&mut tx, &mut rx, &alloc);
    tx.remove_pool(alloc.pool().id()).unwrap();
    assert!(matches!(next(&mut rx), Event::PoolRemoved(_)));
    assert!(matches!(next(&mut tx), Event::PoolRemoved(_)));
    assert_eq!((tx.stats().sent.pool_removes, rx.stats().received.pool_removes), (1, 1));
    // The peer goes away mid-channel: an error event, counted.
    drop(rx);
    drop(b);
    assert_eq!(tx.stats().errors, 0);
    assert!(matches!(next(&mut tx), Event::Error(e) if e == ErrorKind::PeerGone));
    assert_eq!(tx.stats().errors, 1);
}

#[test]
fn this_process_registry_file_holds_its_channels() {
    if std::env::var_os("FERRY_INSPECT").is_some_and(|v| v == "0") {
        return;
    }
    let (a, b) = (Domain::new("registry-a"), Domain::new("registry-b"));
    let (mut tx, mut rx) = pair(&a, &b, 8);
    let alloc = Allocator::new(&a, 4, 8192, PoolConstraints::default()).unwrap();
    assign(&mut tx, &mut rx, &alloc);
    tx.move_buffer(alloc.alloc().unwrap(), b"").unwrap();
    assert!(matches!(next(&mut rx), Event::MoveReceived { .. }));
    assert!(inspect::publish_now());
    let path = inspect::registry_dir().join(format!("{}.ferry", std::process::id()));
    let snap = inspect::read_file(&path).expect("our registry file");
    assert_eq!(snap.pid, std::process::id());
    let d = snap.domains.iter().find(|d| d.name == "registry-a").expect("domain a");
    assert_eq!(d.channels.len(), 1);
    let c = &d.channels[0];
    assert_eq!((c.backend.as_str(), c.direction.as_str(), c.state.as_str()), ("local", "Tx", "Connected"));
    assert_eq!(c.stats, tx.stats());
    assert_eq!(d.pools.len(), 1);
    assert_eq!(d.pools[0].id, alloc.pool().id().as_u128());
    assert_eq!((d.pools[0].buffers, d.pools[0].buffer_size), (4, 8192));
    assert_eq!(d.pools[0].stats, alloc.pool().stats());
    // A dropped channel leaves the next snapshot.
    drop(tx);
    assert!(inspect::publish_now());
    let snap = inspect::read_file(&path).unwrap();
    let d = snap.domains.iter().find(|d| d.name == "registry-a").unwrap();
    assert!(d.channels.is_empty());
}
