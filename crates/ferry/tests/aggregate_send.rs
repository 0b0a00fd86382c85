//! Aggregates sent as one unit (`Channel::send_aggregate`, one
//! `Event::Aggregate` at the receiver) on every backend: between threads,
//! between processes over shared memory, and over TCP (loopback) to another
//! process. Three domains: A sends an aggregate over buffers of two pools,
//! B (a thread, or this test binary run again as a child process) edits it
//! and forwards it in two pieces, C receives them. Every buffer ends where
//! the ownership rules say, whatever order the last references go in.

mod support;

use std::collections::VecDeque;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    Aggregate, Allocator, BindParams, BufferId, BufferState, Channel, ChannelSetup, ChannelState, Direction, Domain,
    Endpoint, Error, ErrorKind, Event, Meta, PoolConstraints, PoolPolicy,
};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 4096;
/// B's header, prepended to what A sent.
const HDR: &[u8] = b"HDR-B:";
/// Where B cuts the edited aggregate in two: after its header, A's first
/// two fragments and half of the third.
const SPLIT: usize = HDR.len() + 100 + 50 + 50;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Local,
    Shm,
    Tcp,
}

fn loopback() -> std::net::SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

// ------------------------------------------------------------------ domain B

/// Domain B: bind to `ep1` (from A) and `ep2` (to C); offer C every pool A
/// assigns, and a header pool of its own; forward each aggregate with a
/// header in front, cut in two at [`SPLIT`]. Panics on anything unexpected.
/// Runs until both channels are closed.
fn relay(ep1: &Endpoint, ep2: &Endpoint) {
    let b = Domain::new("B");
    let mut ch1 = Channel::connect(&b, ep1, BindParams::default(), T).expect("relay: bind to A");
    let mut ch2 = Channel::connect(&b, ep2, BindParams::default(), T).expect("relay: bind to C");
    // The relay learns of A's pool from the (accepted) request, to offer it on.
    ch1.set_pool_policy(PoolPolicy::AcceptAndReport);
    ch2.set_pool_policy(PoolPolicy::AcceptAll);
    assert_eq!((ch1.direction(), ch2.direction()), (Direction::Rx, Direction::Tx));
    let hdr = Allocator::new(&b, 2, SIZE, PoolConstraints::default()).unwrap();
    // (Answered when C polls; forwarding waits for it.)
    ch2.assign_pool(hdr.pool()).expect("relay: header pool");
    let mut pending: VecDeque<(Aggregate, Vec<u8>)> = VecDeque::new();
    let mut x1: Option<BufferId> = None;
    let mut x1_free = false;
    let mut closed = [false; 2];
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(closed[0] && closed[1]) {
        assert!(Instant::now() < deadline, "relay: timed out");
        // Forward what waits, as far as assigned pools and queue room allow.
        while let Some((agg, meta)) = pending.pop_front() {
            match ch2.send_aggregate(agg, &meta) {
                Ok(()) => {}
                Err(r) if matches!(r.error.kind(), ErrorKind::PoolNotAssigned(_) | ErrorKind::QueueFull) => {
                    pending.push_front((r.into_inner(), meta));
                    break;
                }
                Err(r) => panic!("relay: forwarding: {}", r.error),
            }
        }
        // x1 was moved to us and copied on to C twice: once both copies
        // are back it is ours, read-write and free.
        if let Some(id) = x1 {
            x1_free |= b.buffer_state(id) == BufferState::ReadWrite && b.free_count(id.pool) == 1;
        }
        let mut chans = [&mut ch1, &mut ch2];
        let Ok((i, ev)) = ferry::wait_any(&mut chans, Some(Duration::from_millis(100))) else { continue };
        match ev {
            Event::PoolAssignRequest(req) if i == 0 => {
                let pool = b.pool(req.pool).expect("accepted pool");
                ch2.assign_pool(&pool).expect("relay: offer A's pool to C");
            }
            Event::Aggregate { agg, meta } if i == 0 => {
                let copies: Vec<bool> = agg.fragments().map(|f| f.is_copy()).collect();
                assert_eq!(copies, [false, true, false, false], "relay: x1 and w moved to B, y copied");
                x1 = Some(agg.fragments().next().unwrap().buffer_id());
                assert_eq!(b.buffer_state(x1.unwrap()), BufferState::ReadWrite, "relay: B owns x1");
                let mut msg = Aggregate::from_bytes_in(hdr.alloc().unwrap(), HDR).unwrap();
                msg.append(agg);
                let second = msg.split_off(SPLIT).unwrap();
                pending.push_back((msg, meta.to_vec()));
                pending.push_back((second, meta.to_vec()));
            }
            Event::Closed { .. } => closed[i] = true,
            Event::Error(e) => panic!("relay: channel {i}: {e}"),
            _ => {}
        }
    }
    assert!(x1_free, "relay: x1 came back to B's free list");
}

/// B as a child process (this test binary run again, selected by the
/// environment).
#[test]
#[ignore = "run as a child process by the other tests"]
fn relay_child() {
    let (Ok(kind), Ok(ep1), Ok(ep2)) =
        (std::env::var("FERRY_AGG_KIND"), std::env::var("FERRY_AGG_EP1"), std::env::var("FERRY_AGG_EP2"))
    else {
        return;
    };
    let ep = |s: &str| match kind.as_str() {
        "shm" => Endpoint::shm_abstract(s),
        _ => Endpoint::tcp(s.parse().unwrap()),
    };
    relay(&ep(&ep1), &ep(&ep2));
}

// --------------------------------------------------------------- A and C

/// The order in which the last references go.
#[derive(Clone, Copy, Debug)]
enum Drops {
    /// C's two aggregates (first, second), then A's own reference to y.
    ReceiverFirst,
    /// A's reference to y, then C's second aggregate, then the first.
    SenderFirst,
    /// C's second aggregate, A's reference, C's first.
    Interleaved,
}

/// Poll A's channel and C's until `done` (panics after a while): C's
/// aggregates go to `got`; A's and C's channels take their releases.
fn settle(
    ch1: &mut Channel,
    ch2: &mut Channel,
    got: &mut Vec<(Aggregate, Meta)>,
    mut done: impl FnMut(&[(Aggregate, Meta)]) -> bool,
    mut or: impl FnMut(&Channel) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(done(got) || or(ch1)) {
        assert!(Instant::now() < deadline, "timed out; {} aggregates at C", got.len());
        let mut chans = [&mut *ch1, &mut *ch2];
        match ferry::wait_any(&mut chans, Some(Duration::from_millis(50))) {
            Ok((1, Event::Aggregate { agg, meta })) => got.push((agg, meta)),
            Ok((i, Event::Error(e))) => panic!("channel {i}: {e}"),
            Ok((i, Event::Closed { by_peer: true })) => panic!("channel {i} closed by B"),
            _ => {}
        }
    }
}

fn fill(alloc: &Allocator, byte: u8) -> ferry::Buffer {
    let mut b = alloc.alloc().unwrap();
    for (i, x) in b.as_mut_slice().unwrap().iter_mut().enumerate() {
        *x = byte.wrapping_add(i as u8);
    }
    b
}

fn three_domains(kind: Kind, drops: Drops) {
    let (a, c) = (Domain::new("A"), Domain::new("C"));
    let setup = |direction| ChannelSetup { direction, meta_size: 16, ..ChannelSetup::default() };
    let names = [support::unique_name("agg-1"), support::unique_name("agg-2")];
    let (ep1, ep2) = match kind {
        Kind::Local => (Endpoint::local(), Endpoint::local()),
        Kind::Shm => (Endpoint::shm_abstract(&names[0]), Endpoint::shm_abstract(&names[1])),
        Kind::Tcp => (Endpoint::tcp(loopback()), Endpoint::tcp(loopback())),
    };
    let mut ch1 = Channel::create(&a, &ep1, setup(Direction::Tx)).unwrap();
    let mut ch2 = Channel::create(&c, &ep2, setup(Direction::Rx)).unwrap();
    ch2.set_pool_policy(PoolPolicy::AcceptAll);
    enum Relay {
        Thread(std::thread::JoinHandle<()>),
        Process(std::process::Child),
    }
    let relay_b = match kind {
        Kind::Local => {
            let (e1, e2) = (ep1.clone(), ep2.clone());
            Relay::Thread(std::thread::spawn(move || relay(&e1, &e2)))
        }
        Kind::Shm | Kind::Tcp => {
            let (k, e1, e2) = match kind {
                Kind::Shm => ("shm", names[0].clone(), names[1].clone()),
                _ => ("tcp", ch1.listen_addr().unwrap().to_string(), ch2.listen_addr().unwrap().to_string()),
            };
            Relay::Process(
                Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", "relay_child", "--ignored", "--nocapture", "--test-threads=1"])
                    .env("FERRY_AGG_KIND", k)
                    .env("FERRY_AGG_EP1", e1)
                    .env("FERRY_AGG_EP2", e2)
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("spawn B"),
            )
        }
    };
    ch1.wait_connected(T).unwrap();
    ch2.wait_connected(T).unwrap();

    // A: two pools; x1 and w only in the aggregate (moved), y also kept by
    // A (copied); x1 in two fragments.
    let p1 = Allocator::new(&a, 4, SIZE, PoolConstraints::default()).unwrap();
    let p2 = Allocator::new(&a, 4, SIZE, PoolConstraints::default()).unwrap();
    ch1.assign_pool(p1.pool()).unwrap();
    ch1.assign_pool(p2.pool()).unwrap();
    let mut got = Vec::new();
    settle(
        &mut ch1,
        &mut ch2,
        &mut got,
        |_| false,
        |ch1| ch1.is_assigned(p1.pool().id()) && ch1.is_assigned(p2.pool().id()),
    );
    let (x1, y, w) = (Aggregate::from(fill(&p1, 1)), Aggregate::from(fill(&p2, 101)), Aggregate::from(fill(&p2, 201)));
    let y_id = y.fragments().next().unwrap().buffer_id();
    let keep = y.clone();
    let msg = x1.slice(0..100).unwrap().join(y.slice(0..50).unwrap()).join(x1.slice(200..300).unwrap()).join(w);
    drop((x1, y));
    let sent = msg.to_vec();
    assert_eq!(msg.fragments().len(), 4);
    ch1.send_aggregate(msg, b"agg-1").unwrap();
    assert!(keep.fragments().next().is_some());

    // C: the two pieces B forwarded, one event each.
    settle(&mut ch1, &mut ch2, &mut got, |g| g.len() == 2, |_| false);
    let mut whole = HDR.to_vec();
    whole.extend_from_slice(&sent);
    let (first, second) = (&got[0].0, &got[1].0);
    assert_eq!((&*got[0].1, &*got[1].1), (&b"agg-1"[..], &b"agg-1"[..]));
    assert_eq!(first.to_vec(), whole[..SPLIT]);
    assert_eq!(second.to_vec(), whole[SPLIT..]);
    let copies = |agg: &Aggregate| agg.fragments().map(|f| f.is_copy()).collect::<Vec<_>>();
    // First piece: B's header (moved), x1 (shared with the second piece:
    // copied), y (a copy B forwards), x1 again. Second: x1 (B still has a
    // copy out: copied), w (moved on).
    assert_eq!(copies(first), [false, true, true, true]);
    assert_eq!(copies(second), [true, false]);
    let ids = |agg: &Aggregate| agg.fragments().map(|f| f.buffer_id()).collect::<Vec<_>>();
    let (h_id, x1_id, w_id) = (ids(first)[0], ids(first)[1], ids(second)[1]);
    assert_eq!((ids(first)[2], ids(first)[3], ids(second)[0]), (y_id, x1_id, x1_id));
    assert_eq!(c.buffer_state(h_id), BufferState::ReadWrite);
    assert_eq!(c.buffer_state(w_id), BufferState::ReadWrite);
    assert_eq!(c.buffer_state(x1_id), BufferState::ReadOnly);
    assert_eq!(a.buffer_state(y_id), BufferState::ReadOnlyOwned, "A's y is read-only while copies are out");
    if kind == Kind::Tcp {
        // Each buffer's bytes crossed once, however many fragments name it:
        // A → B x1, y, w; B → C the header, x1 (once for both pieces), y, w.
        let sent_ab = ch1.link_stats().unwrap().payload_sent;
        let got_bc = ch2.link_stats().unwrap().payload_received;
        assert_eq!((sent_ab, got_bc), (3 * SIZE as u64, 4 * SIZE as u64));
    }

    let (mut first, mut second) = {
        let mut it = got.drain(..).map(|(agg, _)| Some(agg));
        (it.next().unwrap(), it.next().unwrap())
    };
    let mut keep = Some(keep);
    match drops {
        Drops::ReceiverFirst => {
            first.take();
            second.take();
            keep.take();
        }
        Drops::SenderFirst => {
            keep.take();
            second.take();
            first.take();
        }
        Drops::Interleaved => {
            second.take();
            keep.take();
            first.take();
        }
    }
    // Where each buffer ends: x1 with B (moved there, only copied on), y
    // back with A, B's header and w with C; every one read-write and free.
    let both = |_: &Channel| false;
    settle(
        &mut ch1,
        &mut ch2,
        &mut got,
        |_| {
            p1.available() == 3
                && p2.available() == 3
                && a.buffer_state(y_id) == BufferState::ReadWrite
                && c.free_count(h_id.pool) == 1
                && c.free_count(w_id.pool) == 1
                && c.buffer_state(x1_id) == BufferState::Invalid
                && c.buffer_state(y_id) == BufferState::Invalid
        },
        both,
    );
    assert_eq!(a.buffer_state(x1_id), BufferState::Invalid, "x1 is B's");
    assert_eq!(a.buffer_state(w_id), BufferState::Invalid, "w is C's");

    ch1.teardown().unwrap();
    ch2.teardown().unwrap();
    let mut closed = [false; 2];
    let deadline = Instant::now() + T;
    while closed != [true, true] {
        assert!(Instant::now() < deadline, "teardown timed out");
        let mut chans = [&mut ch1, &mut ch2];
        if let Ok((i, Event::Closed { .. })) = ferry::wait_any(&mut chans, Some(Duration::from_millis(50))) {
            closed[i] = true;
        }
    }
    match relay_b {
        Relay::Thread(h) => h.join().expect("B's checks"),
        Relay::Process(mut child) => {
            let status = support::payload::wait_exit(&mut child, T);
            assert!(status.success(), "B's checks failed: {status:?}");
        }
    }
}

#[test]
fn local_three_domains_receiver_drops_first() {
    three_domains(Kind::Local, Drops::ReceiverFirst);
}

#[test]
fn local_three_domains_sender_drops_first() {
    three_domains(Kind::Local, Drops::SenderFirst);
}

#[test]
fn local_three_domains_interleaved_drops() {
    three_domains(Kind::Local, Drops::Interleaved);
}

#[test]
fn shm_three_domains_across_processes() {
    three_domains(Kind::Shm, Drops::ReceiverFirst);
    three_domains(Kind::Shm, Drops::SenderFirst);
}

#[test]
fn tcp_three_domains_across_processes() {
    three_domains(Kind::Tcp, Drops::Interleaved);
    three_domains(Kind::Tcp, Drops::SenderFirst);
}

// ---------------------------------------------------------- refusals, edges

/// A connected local pair (A source, B sink accepting every pool) with a
/// pool of A's assigned.
fn pair(depth: u32, count: u64) -> (Domain, Domain, Channel, Channel, Allocator) {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let ep = Endpoint::local();
    let setup = ChannelSetup { queue_depth: depth, meta_size: 8, ..ChannelSetup::default() };
    let mut tx = Channel::create(&a, &ep, setup).unwrap();
    let mut rx = Channel::bind(&b, &ep, BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    let alloc = Allocator::new(&a, count, SIZE, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    rx.poll();
    assert!(matches!(tx.wait(Some(T)), Ok(Event::PoolAssigned(_))));
    (a, b, tx, rx, alloc)
}

/// Refusals hand the aggregate back intact and send nothing.
#[test]
fn refused_aggregates_come_back_intact() {
    let (a, _b, mut tx, mut rx, alloc) = pair(4, 8);
    let parts = |n: usize| {
        (0..n)
            .map(|i| Aggregate::from_bytes_in(alloc.alloc().unwrap(), &[i as u8; 10]).unwrap())
            .fold(Aggregate::new(), Aggregate::join)
    };
    let check_back = |r: ferry::Refused<Aggregate>, e: Error, bytes: &[u8]| {
        assert_eq!(r.error, e);
        let agg = r.into_inner();
        assert_eq!(agg.to_vec(), bytes);
        agg
    };
    // 1 header + 4 members + 2 table slots do not fit a queue of 4.
    let big = parts(4);
    let bytes = big.to_vec();
    let r = tx.send_aggregate(big, b"").unwrap_err();
    drop(check_back(r, ErrorKind::AggregateTooLarge { slots: 7, capacity: 4 }.into(), &bytes));
    assert!(rx.poll().is_none(), "nothing was sent");
    // Meta data longer than the channel's.
    let one = parts(1);
    let r = tx.send_aggregate(one, &[0; 9]).unwrap_err();
    let one = check_back(r, ErrorKind::MetaTooLarge { len: 9, max: 8 }.into(), &[0; 10]);
    // A pool not assigned to the channel.
    let other = Allocator::new(&a, 1, SIZE, PoolConstraints::default()).unwrap();
    let mixed = one.join(Aggregate::from_bytes_in(other.alloc().unwrap(), b"xy").unwrap());
    let r = tx.send_aggregate(mixed, b"").unwrap_err();
    let mixed = check_back(r, ErrorKind::PoolNotAssigned(other.pool().id()).into(), b"\0\0\0\0\0\0\0\0\0\0xy");
    drop(mixed);
    // A buffer of another domain.
    let stranger = Allocator::new(&Domain::new("z"), 1, SIZE, PoolConstraints::default()).unwrap();
    let foreign = Aggregate::from_bytes_in(stranger.alloc().unwrap(), b"f").unwrap();
    assert_eq!(tx.send_aggregate(foreign, b"").unwrap_err().error, ErrorKind::ForeignBuffer);
    // The wrong direction.
    assert_eq!(rx.send_aggregate(Aggregate::new(), b"").unwrap_err().error, ErrorKind::WrongDirection);
    // A full queue: room for the whole run or nothing.
    tx.move_buffer(alloc.alloc().unwrap(), b"").unwrap();
    tx.move_buffer(alloc.alloc().unwrap(), b"").unwrap();
    let two = parts(1);
    let r = tx.send_aggregate(two, b"q").unwrap_err(); // needs 3 slots, 2 free
    let two = check_back(r, ErrorKind::QueueFull.into(), &[0; 10]);
    assert!(matches!(rx.poll(), Some(Event::MoveReceived { .. })));
    assert!(matches!(rx.poll(), Some(Event::MoveReceived { .. })));
    tx.send_aggregate(two, b"q").unwrap();
    match rx.wait(Some(T)) {
        Ok(Event::Aggregate { agg, meta }) => assert_eq!((agg.to_vec(), &meta[..]), (vec![0; 10], &b"q"[..])),
        ev => panic!("{ev:?}"),
    }
    assert_eq!(alloc.available(), 8 - 3, "the moved buffers are b's now");
}

/// A train of units behind their headers crosses in a few slots: 400
/// fragments that each continue the one two before go as three table
/// entries (a queue of 8 slots of 2 entries takes it), and arrive as the
/// same fragments with the same bytes.
#[test]
fn trains_of_units_cross_in_a_few_slots() {
    let (_a, _b, mut tx, mut rx, alloc) = pair(8, 2);
    let (mut hb, mut pb) = (alloc.alloc().unwrap(), alloc.alloc().unwrap());
    for (i, b) in hb.as_mut_slice().unwrap().iter_mut().enumerate() {
        *b = (i / 16) as u8;
    }
    for (i, b) in pb.as_mut_slice().unwrap().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let mut hdrs = Aggregate::from_buffer_range(hb, 0..200 * 16).unwrap();
    let mut payload = Aggregate::from_buffer_range(pb, 0..200 * 20).unwrap();
    let mut train = Aggregate::new();
    for _ in 0..200 {
        train.append_from(&mut hdrs, 16).unwrap();
        train.append_from(&mut payload, 20).unwrap();
    }
    let sent: Vec<(std::ops::Range<usize>, Vec<u8>)> =
        train.fragments().map(|f| (f.range(), f.bytes().to_vec())).collect();
    assert_eq!(sent.len(), 400);
    tx.send_aggregate(train, b"t").unwrap();
    match rx.wait(Some(T)) {
        Ok(Event::Aggregate { agg, meta }) => {
            let got: Vec<(std::ops::Range<usize>, Vec<u8>)> =
                agg.fragments().map(|f| (f.range(), f.bytes().to_vec())).collect();
            assert_eq!((got, &meta[..]), (sent, &b"t"[..]));
        }
        ev => panic!("{ev:?}"),
    }
}

/// An empty aggregate carries its meta data alone; an aggregate of copies
/// only leaves the sender's buffers read-only until the receiver drops it.
#[test]
fn empty_and_copy_only_aggregates() {
    let (a, b, mut tx, mut rx, alloc) = pair(64, 8);
    tx.send_aggregate(Aggregate::new(), b"nothing").unwrap();
    match rx.wait(Some(T)) {
        Ok(Event::Aggregate { agg, meta }) => assert!(agg.is_empty() && &meta[..] == b"nothing"),
        ev => panic!("{ev:?}"),
    }
    let shared = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"0123456789").unwrap();
    let id = shared.fragments().next().unwrap().buffer_id();
    // The same buffer three times, and the sender keeps it: one copy.
    let msg = shared.slice(0..2).unwrap().join(shared.slice(5..8).unwrap()).join(shared.slice(1..3).unwrap());
    tx.send_aggregate(msg, b"").unwrap();
    let Ok(Event::Aggregate { agg, .. }) = rx.wait(Some(T)) else { panic!() };
    assert_eq!(agg.to_vec(), b"0156712");
    assert!(agg.fragments().all(|f| f.is_copy() && f.buffer_id() == id));
    assert_eq!((a.buffer_state(id), b.buffer_state(id)), (BufferState::ReadOnlyOwned, BufferState::ReadOnly));
    let (head, tail) = agg.split_at(3).unwrap();
    drop(agg);
    drop(head);
    rx.flush().unwrap();
    assert!(tx.poll().is_none(), "the tail still holds the copy");
    drop(tail);
    rx.flush().unwrap();
    assert!(matches!(tx.wait(Some(T)), Ok(Event::CopyReleased { writable: true, .. })));
    drop(shared);
    assert_eq!(alloc.available(), 8);
}

/// Dropping the receiving end with an aggregate unseen releases its copies
/// to the sender and frees the buffers moved to it.
#[test]
fn unseen_aggregates_go_back_when_the_receiver_drops() {
    let (a, _b, mut tx, rx, alloc) = pair(64, 8);
    let kept = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"kept").unwrap();
    let moved = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"moved").unwrap();
    let id = kept.fragments().next().unwrap().buffer_id();
    tx.send_aggregate(kept.clone().join(moved), b"").unwrap();
    assert_eq!(a.buffer_state(id), BufferState::ReadOnlyOwned);
    drop(rx);
    let deadline = Instant::now() + T;
    while a.buffer_state(id) != BufferState::ReadWrite {
        assert!(Instant::now() < deadline);
        let _ = tx.wait(Some(Duration::from_millis(50)));
    }
    drop(kept);
    assert_eq!(alloc.available(), 7, "the moved buffer went with b");
}

/// Through `AsyncChannel`: aggregates whose runs need most of a small
/// queue wait for room for the whole run while the sink drains it.
#[cfg(feature = "tokio")]
#[test]
fn async_sends_wait_for_room_for_the_whole_run() {
    use ferry::tokio::AsyncChannel;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (_a, _b, tx, rx, alloc) = pair(8, 64);
    rt.block_on(async move {
        let (mut tx, mut rx) = (AsyncChannel::new(tx).unwrap(), AsyncChannel::new(rx).unwrap());
        let sink = tokio::spawn(async move {
            let mut got = Vec::new();
            while got.len() < 20 {
                match rx.next_event().await {
                    Some(Event::Aggregate { agg, meta }) => got.push((agg.to_vec(), meta[0])),
                    ev => panic!("{ev:?}"),
                }
            }
            got
        });
        for i in 0..20u8 {
            // Three buffers, six fragments: a run of 1 + 3 + 3 = 7 slots of 8.
            // (Moved buffers stay with b: 60 of the pool's 64 go.)
            let parts: Vec<Aggregate> =
                (0..3).map(|j| Aggregate::from_bytes_in(alloc.alloc().unwrap(), &[i, j, 0, 0]).unwrap()).collect();
            let mut msg = Aggregate::new();
            for range in [0..2, 2..4] {
                for p in &parts {
                    msg.append(p.slice(range.clone()).unwrap());
                }
            }
            drop(parts);
            tokio::time::timeout(T, tx.send_aggregate(msg, &[i])).await.unwrap().unwrap();
        }
        let got = tokio::time::timeout(T, sink).await.unwrap().unwrap();
        for (i, (bytes, meta)) in got.into_iter().enumerate() {
            let i = i as u8;
            assert_eq!((bytes, meta), (vec![i, 0, i, 1, i, 2, 0, 0, 0, 0, 0, 0], i));
        }
    });
}

// ----------------------------------------------------------- hostile peers

mod hostile {
    use super::*;
    use support::raw_peer::{RawPeer, FLAG_PAYLOAD, MOVE};

    const AGG: u8 = 12;
    const TABLE: u8 = 13;
    const ASSIGN: u8 = 5;
    const ASSIGN_REPLY: u8 = 6;
    const TEARDOWN: u8 = 9;
    const POOL: u128 = 0x5eed_0000_0000_0000_0000_0000_0000_0001;

    fn entries(list: &[(u32, u64, u64)]) -> Vec<u8> {
        let mut v = Vec::new();
        for &(m, o, l) in list {
            v.extend_from_slice(&m.to_le_bytes());
            v.extend_from_slice(&o.to_le_bytes()[..6]);
            v.extend_from_slice(&l.to_le_bytes()[..6]);
        }
        v
    }

    fn header(p: &mut RawPeer, members: u32, frags: u64, total: u64) {
        p.frame(AGG, 0, members, frags, u128::from(total), b"", &[]);
    }

    fn member(p: &mut RawPeer, index: u32) {
        p.frame(MOVE, FLAG_PAYLOAD, index, SIZE as u64, POOL, &[], &[0xab; SIZE]);
    }

    type Attack = fn(&mut RawPeer);

    /// Each malformed aggregate run from a TCP peer is a protocol error
    /// that closes the channel; the buffers of the partial run are not
    /// kept anywhere (the victim's domain lets go of the peer's pool).
    #[test]
    fn malformed_runs_are_protocol_errors() {
        let attacks: [(&str, Attack); 12] = [
            ("member ordinal out of range", |p| {
                header(p, 1, 1, 10);
                member(p, 0);
                p.frame(TABLE, 0, 0, 0, 0, &entries(&[(1, 0, 10)]), &[]);
            }),
            ("fragment past the buffer", |p| {
                header(p, 1, 1, 10);
                member(p, 0);
                p.frame(TABLE, 0, 0, 0, 0, &entries(&[(0, SIZE as u64 - 5, 10)]), &[]);
            }),
            ("total does not add up", |p| {
                header(p, 1, 1, 11);
                member(p, 0);
                p.frame(TABLE, 0, 0, 0, 0, &entries(&[(0, 0, 10)]), &[]);
            }),
            ("a member in no fragment", |p| {
                header(p, 2, 2, 20);
                member(p, 0);
                member(p, 1);
                p.frame(TABLE, 0, 0, 0, 0, &entries(&[(0, 0, 10), (0, 10, 10)]), &[]);
            }),
            ("run interrupted by a teardown", |p| {
                header(p, 2, 2, 20);
                member(p, 0);
                p.frame(TEARDOWN, 0, 0, 0, 0, &[], &[]);
            }),
            ("run interrupted by another header", |p| {
                header(p, 2, 2, 20);
                member(p, 0);
                header(p, 1, 1, 1);
            }),
            ("table before the members", |p| {
                header(p, 2, 2, 20);
                member(p, 0);
                p.frame(TABLE, 0, 0, 0, 0, &entries(&[(0, 0, 10), (0, 10, 10)]), &[]);
            }),
            ("table outside a run", |p| p.frame(TABLE, 0, 0, 0, 0, &entries(&[(0, 0, 10)]), &[])),
            ("member with meta data", |p| {
                header(p, 1, 1, 10);
                p.frame(MOVE, FLAG_PAYLOAD, 0, SIZE as u64, POOL, b"m", &[0; SIZE]);
            }),
            ("impossible counts", |p| header(p, 70_000, 70_000, 70_000)),
            ("a member the victim may not receive (a pass)", |p| {
                header(p, 1, 1, 10);
                p.frame(3, FLAG_PAYLOAD, 0, SIZE as u64, POOL, &[], &[0; SIZE]);
            }),
            ("a member of a pool not on the channel", |p| {
                header(p, 1, 1, 10);
                p.frame(MOVE, FLAG_PAYLOAD, 0, SIZE as u64, 12345, &[], &[0; SIZE]);
            }),
        ];
        for (what, attack) in attacks {
            let d = Domain::new("victim");
            let setup = ChannelSetup { direction: Direction::Rx, meta_size: 8, ..ChannelSetup::default() };
            let mut ch = Channel::create(&d, &Endpoint::tcp(loopback()), setup).unwrap();
            ch.set_pool_policy(PoolPolicy::AcceptAll);
            let addr = ch.listen_addr().unwrap();
            let peer = std::thread::spawn(move || {
                let mut p = RawPeer::bind(addr);
                // Offer a pool of two buffers (trust FULL), wait for the yes.
                p.frame(ASSIGN, 3 << 4, 2, SIZE as u64, POOL, &[], &[]);
                loop {
                    let h = p.next_frame();
                    if h.kind == ASSIGN_REPLY {
                        assert_eq!(h.flags & 1, 1, "pool accepted");
                        break;
                    }
                }
                attack(&mut p);
                let mut sink = [0u8; 4096];
                while matches!(p.s.read(&mut sink), Ok(n) if n > 0) {}
            });
            let deadline = Instant::now() + T;
            let why = loop {
                assert!(Instant::now() < deadline, "{what}: no error");
                match ch.wait(Some(Duration::from_millis(100))) {
                    Ok(Event::Error(e)) if matches!(e.kind(), ErrorKind::Protocol(_)) => break e.to_string(),
                    Ok(Event::Error(e)) => panic!("{what}: {e:?}"),
                    Ok(Event::Aggregate { .. }) => panic!("{what}: delivered"),
                    _ => {}
                }
            };
            eprintln!("{what}: {why}");
            assert_eq!(ch.state(), ChannelState::Closed, "{what}");
            drop(ch);
            assert!(d.pools().is_empty(), "{what}: something of the partial run is still held");
            peer.join().unwrap();
        }
    }
}
