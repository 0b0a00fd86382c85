//! Pool churn on long-lived domains: thousands of pools (and channels) come
//! and go, each used for a few transfers and then let go, and what the
//! process holds — open fds, mappings, resident memory — must stay flat,
//! with every domain's pool list empty at the start and at the end. One
//! test per backend and way of letting go: the local backend, the
//! shared-memory backend between two domains of this process over an
//! abstract socket (trust FULL and NONE), and TCP on 127.0.0.1.

mod support;

use std::sync::Mutex;
use std::time::Duration;

use ferry::{
    Allocator, BindParams, Buffer, Channel, ChannelConstraints, ChannelSetup, Direction, Domain, Endpoint, Event,
    PoolConstraints, TrustLevel,
};

/// The footprint is the whole process's: the tests of this file run one at
/// a time.
static SERIAL: Mutex<()> = Mutex::new(());

const WAIT: Duration = Duration::from_secs(10);
const BUF: usize = 64 << 10;
const WARM_UP: usize = 30;

/// What the process holds: open fds, mappings, resident KiB.
#[derive(Debug, Clone, Copy)]
struct Footprint {
    fds: usize,
    maps: usize,
    rss_kib: usize,
}

fn footprint() -> Footprint {
    let fds = std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count();
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps").lines().count();
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: usize = statm.split_whitespace().nth(1).and_then(|f| f.parse().ok()).expect("statm resident");
    let page = rustix::param::page_size();
    Footprint { fds, maps, rss_kib: pages * page / 1024 }
}

/// After `iterations` more rounds, the footprint is the one after the
/// warm-up, up to a small constant slack (no growth per round).
fn assert_flat(what: &str, iterations: usize, before: Footprint, after: Footprint) {
    println!(
        "{what}: {iterations} pools: fds {} -> {}, mappings {} -> {}, RSS {} -> {} KiB",
        before.fds, after.fds, before.maps, after.maps, before.rss_kib, after.rss_kib
    );
    assert!(after.fds <= before.fds + 4, "{what}: fds grew {} -> {}", before.fds, after.fds);
    assert!(after.maps <= before.maps + 16, "{what}: mappings grew {} -> {}", before.maps, after.maps);
    assert!(
        after.rss_kib <= before.rss_kib + 16 * 1024,
        "{what}: RSS grew {} -> {} KiB",
        before.rss_kib,
        after.rss_kib
    );
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    Local,
    Shm(TrustLevel),
    Tcp,
}

/// A connected channel: TX end in `source`, RX end in `sink`.
fn connect(backend: Backend, source: &Domain, sink: &Domain) -> (Channel, Channel) {
    let (trust, ep) = match backend {
        Backend::Local => (TrustLevel::Full, Endpoint::local()),
        Backend::Shm(trust) => (trust, Endpoint::shm_abstract(&support::unique_name("churn"))),
        Backend::Tcp => (TrustLevel::Full, Endpoint::tcp("127.0.0.1:0".parse().unwrap())),
    };
    let setup = ChannelSetup { direction: Direction::Tx, trust, meta_size: 8, ..ChannelSetup::default() };
    let mut tx = Channel::create(source, &ep, setup).expect("create");
    let ep = match backend {
        Backend::Tcp => Endpoint::tcp(tx.listen_addr().expect("listening")),
        _ => ep,
    };
    // Pools of buffers larger than `BUF` are vetoed by the sink's library.
    let constraints = ChannelConstraints { max_buffer_size: BUF, ..ChannelConstraints::default() };
    let mut rx = Channel::bind(sink, &ep, BindParams { constraints, ..BindParams::default() }).expect("bind");
    assert!(matches!(tx.wait(Some(WAIT)), Ok(Event::BindRequest { .. })));
    assert!(matches!(rx.wait(Some(WAIT)), Ok(Event::Bound)));
    (tx, rx)
}

/// The next event of `ch` (the TCP backend sends when polled: `from` is
/// flushed first).
fn next(ch: &mut Channel, from: &mut Channel) -> Event {
    from.flush().expect("flush");
    ch.wait(Some(WAIT)).expect("an event in time")
}

fn filled(alloc: &Allocator, byte: u8) -> Buffer {
    let mut b = alloc.alloc().expect("a free buffer");
    b.as_mut_slice().expect("read-write").fill(byte);
    b
}

/// One round on a connected channel: two pools offered and vetoed (by the
/// sink's library and by its user), then a new pool assigned, its buffers
/// moved, passed back, copied, released, one buffer and one copy kept by
/// the sink, one copy dropped unreleased. Returns what the sink keeps.
fn round(tx: &mut Channel, rx: &mut Channel, source: &Domain, i: usize) -> (Allocator, Buffer, ferry::BufferCopy) {
    let too_big = Allocator::new(source, 1, 2 * BUF, PoolConstraints::default()).expect("pool");
    tx.assign_pool(too_big.pool()).expect("assign");
    assert!(matches!(next(rx, tx), Event::PoolVetoed(_)), "round {i}: the library vetoes");
    assert!(matches!(next(tx, rx), Event::PoolVetoed(_)));
    let refused = Allocator::new(source, 1, BUF, PoolConstraints::default()).expect("pool");
    tx.assign_pool(refused.pool()).expect("assign");
    match next(rx, tx) {
        Event::PoolAssignRequest(req) => rx.respond_pool(req.pool, false).expect("veto"),
        ev => panic!("round {i}: {ev:?}"),
    }
    assert!(matches!(next(tx, rx), Event::PoolVetoed(_)));
    drop((too_big, refused));

    let alloc = Allocator::new(source, 4, BUF, PoolConstraints::default()).expect("pool");
    let pool = alloc.pool().id();
    tx.assign_pool(alloc.pool()).expect("assign");
    match next(rx, tx) {
        Event::PoolAssignRequest(req) => rx.respond_pool(req.pool, true).expect("accept"),
        ev => panic!("round {i}: {ev:?}"),
    }
    assert!(matches!(next(tx, rx), Event::PoolAssigned(p) if p == pool));

    // Move and pass back.
    tx.move_buffer(filled(&alloc, i as u8), b"move").expect("move");
    let Event::MoveReceived { buffer, .. } = next(rx, tx) else { panic!("round {i}: no move") };
    assert!(buffer.iter().all(|&b| b == i as u8));
    rx.pass(buffer, b"pass").expect("pass");
    let Event::BufferPassed { buffer, .. } = next(tx, rx) else { panic!("round {i}: no pass") };
    drop(buffer);

    // Copy and release; a copy dropped without release.
    let owned = filled(&alloc, 1);
    tx.copy(&owned, b"copy").expect("copy");
    tx.copy(&owned, b"copy").expect("copy");
    let Event::CopyReceived { copy, .. } = next(rx, tx) else { panic!("round {i}: no copy") };
    rx.release(copy).expect("release");
    let Event::CopyReceived { copy, .. } = next(rx, tx) else { panic!("round {i}: no copy") };
    drop(copy);
    assert!(matches!(next(tx, rx), Event::CopyReleased { .. }));
    assert!(matches!(next(tx, rx), Event::CopyReleased { writable: true, .. }));
    drop(owned);

    // What the sink keeps past the round: a buffer and a copy.
    tx.move_buffer(filled(&alloc, 2), b"keep").expect("move");
    let Event::MoveReceived { buffer: kept, .. } = next(rx, tx) else { panic!("round {i}: no move") };
    let lent = filled(&alloc, 3);
    tx.copy(&lent, b"copy").expect("copy");
    let Event::CopyReceived { copy: kept_copy, .. } = next(rx, tx) else { panic!("round {i}: no copy") };
    drop(lent);
    (alloc, kept, kept_copy)
}

/// A channel per pool: each round on a fresh channel, closed by a teardown
/// while the sink still holds a buffer and a copy; the sink's pool goes
/// when it drops them, the source's when its allocator is gone.
fn churn_channels(backend: Backend, iterations: usize) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (a, b) = (Domain::new("source"), Domain::new("sink"));
    let mut before = None;
    for i in 0..WARM_UP + iterations {
        if i == WARM_UP {
            assert!(a.pools().is_empty() && b.pools().is_empty(), "{backend:?}: pools listed after warm-up");
            before = Some(footprint());
        }
        let (mut tx, mut rx) = connect(backend, &a, &b);
        let (alloc, kept, kept_copy) = round(&mut tx, &mut rx, &a, i);
        let pool = alloc.pool().id();
        drop(alloc);
        tx.teardown().expect("teardown");
        assert!(matches!(next(&mut rx, &mut tx), Event::Closed { by_peer: true }));
        assert!(matches!(next(&mut tx, &mut rx), Event::Closed { by_peer: false }));
        // The sink's domain still holds a buffer and a copy of the pool.
        assert_eq!(b.pools(), [pool], "{backend:?} round {i}: the sink holds buffers of the pool");
        drop(kept);
        assert_eq!(b.pools(), [pool], "{backend:?} round {i}: the sink holds a copy of the pool");
        drop(kept_copy);
        assert!(b.pools().is_empty(), "{backend:?} round {i}: nothing of the pool is held by the sink");
        // The source gave its handles up; its copy out went with the channel.
        assert!(a.pools().is_empty(), "{backend:?} round {i}: nothing of the pool is held by the source");
        drop((tx, rx));
    }
    assert!(a.pools().is_empty() && b.pools().is_empty());
    assert_flat(&format!("{backend:?}, a channel per pool"), iterations, before.unwrap(), footprint());
}

/// One long-lived channel: each round's pool is removed from it (after the
/// sink gave back what it kept) and its handles dropped.
fn churn_pools(backend: Backend, iterations: usize) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (a, b) = (Domain::new("source"), Domain::new("sink"));
    let (mut tx, mut rx) = connect(backend, &a, &b);
    let mut before = None;
    for i in 0..WARM_UP + iterations {
        if i == WARM_UP {
            assert!(a.pools().is_empty() && b.pools().is_empty(), "{backend:?}: pools listed after warm-up");
            before = Some(footprint());
        }
        let (alloc, kept, kept_copy) = round(&mut tx, &mut rx, &a, i);
        let pool = alloc.pool().id();
        drop(alloc);
        rx.pass(kept, b"back").expect("pass");
        rx.release(kept_copy).expect("release");
        let Event::BufferPassed { buffer, .. } = next(&mut tx, &mut rx) else { panic!("round {i}: no pass") };
        drop(buffer);
        assert!(matches!(next(&mut tx, &mut rx), Event::CopyReleased { .. }));
        // Every buffer is back; the channel still lists the pool.
        assert_eq!((a.pools(), b.pools()), (vec![pool], vec![pool]), "{backend:?} round {i}");
        // Alternate which end removes it.
        let (first, second) = if i % 2 == 0 { (&mut tx, &mut rx) } else { (&mut rx, &mut tx) };
        first.remove_pool(pool).expect("remove");
        assert!(matches!(next(second, first), Event::PoolRemoved(p) if p == pool));
        assert!(matches!(next(first, second), Event::PoolRemoved(p) if p == pool));
        assert!(a.pools().is_empty() && b.pools().is_empty(), "{backend:?} round {i}: pool still listed");
    }
    assert_flat(&format!("{backend:?}, pools removed from one channel"), iterations, before.unwrap(), footprint());
    drop((tx, rx));
    assert!(a.pools().is_empty() && b.pools().is_empty());
}

#[test]
fn local_channels() {
    churn_channels(Backend::Local, 1000);
}

#[test]
fn local_pools() {
    churn_pools(Backend::Local, 1000);
}

#[test]
fn shm_channels() {
    churn_channels(Backend::Shm(TrustLevel::Full), 400);
}

#[test]
fn shm_pools() {
    churn_pools(Backend::Shm(TrustLevel::Full), 400);
}

#[test]
fn shm_none_channels() {
    churn_channels(Backend::Shm(TrustLevel::None), 300);
}

#[test]
fn shm_none_pools() {
    churn_pools(Backend::Shm(TrustLevel::None), 300);
}

#[test]
fn tcp_channels() {
    churn_channels(Backend::Tcp, 300);
}

#[test]
fn tcp_pools() {
    churn_pools(Backend::Tcp, 400);
}

/// Offer `alloc`'s pool on `tx` and accept it on `rx`.
fn assign(tx: &mut Channel, rx: &mut Channel, alloc: &Allocator, what: &str) {
    tx.assign_pool(alloc.pool()).expect("assign");
    match next(rx, tx) {
        Event::PoolAssignRequest(req) => rx.respond_pool(req.pool, true).expect("accept"),
        ev => panic!("{what}: {ev:?}"),
    }
    assert!(matches!(next(tx, rx), Event::PoolAssigned(_)), "{what}");
}

/// Remove `pool` from the channel `tx`-`rx`.
fn remove(tx: &mut Channel, rx: &mut Channel, pool: ferry::PoolId, what: &str) {
    tx.remove_pool(pool).expect("remove");
    assert!(matches!(next(rx, tx), Event::PoolRemoved(p) if p == pool), "{what}");
    assert!(matches!(next(tx, rx), Event::PoolRemoved(p) if p == pool), "{what}");
}

/// Pools that reach the sink over TCP first (its own memory) and then over
/// a `backend` channel from the same source: that channel carries their
/// bytes (write-back), and what it keeps for that goes with the pool.
fn churn_write_back(backend: Backend, iterations: usize) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (a, b) = (Domain::new("source"), Domain::new("sink"));
    let (mut tcp_tx, mut tcp_rx) = connect(Backend::Tcp, &a, &b);
    let (mut tx, mut rx) = connect(backend, &a, &b);
    let mut before = None;
    for i in 0..WARM_UP + iterations {
        if i == WARM_UP {
            before = Some(footprint());
        }
        let what = format!("{backend:?} write-back round {i}");
        let alloc = Allocator::new(&a, 2, BUF, PoolConstraints::default()).expect("pool");
        let pool = alloc.pool().id();
        assign(&mut tcp_tx, &mut tcp_rx, &alloc, &what);
        assign(&mut tx, &mut rx, &alloc, &what);
        tx.move_buffer(filled(&alloc, i as u8), b"move").expect("move");
        let Event::MoveReceived { mut buffer, .. } = next(&mut rx, &mut tx) else { panic!("{what}: no move") };
        assert!(buffer.iter().all(|&x| x == i as u8), "{what}: the sink got other bytes");
        buffer.as_mut_slice().expect("owned").fill(!(i as u8));
        rx.pass(buffer, b"pass").expect("pass");
        let Event::BufferPassed { buffer, .. } = next(&mut tx, &mut rx) else { panic!("{what}: no pass") };
        assert!(buffer.iter().all(|&x| x == !(i as u8)), "{what}: the source got other bytes back");
        drop(buffer);
        remove(&mut tx, &mut rx, pool, &what);
        remove(&mut tcp_tx, &mut tcp_rx, pool, &what);
        drop(alloc);
        assert!(a.pools().is_empty() && b.pools().is_empty(), "{what}: pool still listed");
    }
    assert_flat(&format!("{backend:?}, write-back pools"), iterations, before.unwrap(), footprint());
}

#[test]
fn local_write_back_pools() {
    churn_write_back(Backend::Local, 300);
}

#[test]
fn shm_write_back_pools() {
    churn_write_back(Backend::Shm(TrustLevel::Full), 300);
}
