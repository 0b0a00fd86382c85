//! Early demultiplexing: many channels over one TCP connection
//! (`ferry::MuxSession`), on real loopback sockets and with a real child
//! process as the peer (the test binary runs itself again, `mux_child`).

mod support;

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    Aggregate, Allocator, BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, ErrorKind, Event, MuxSession,
    NetOptions, Pool, PoolConstraints, Role,
};

use support::payload::{check, fill, wait_exit};
use support::scenarios::{copy_resent_after_a_discarded_one, idle_then_move, Triangle};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;

fn seq_of(meta: &[u8]) -> u64 {
    u64::from_le_bytes(meta[..8].try_into().unwrap())
}

fn next(ch: &mut Channel) -> Event {
    match ch.wait(Some(T)) {
        Ok(ev) => ev,
        Err(_) => panic!("no event within {T:?} (state {:?})", ch.state()),
    }
}

fn tx_setup() -> ChannelSetup {
    ChannelSetup { direction: Direction::Tx, role: Role::Master, ..ChannelSetup::default() }
}

/// Two sessions over loopback: (accepting side, connecting side).
fn session_pair(options: NetOptions) -> (MuxSession, MuxSession) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let theirs = options.clone();
    let other = std::thread::spawn(move || MuxSession::connect(addr, theirs, T).unwrap());
    let ours = MuxSession::accept(&listener, options, T).unwrap();
    (ours, other.join().unwrap())
}

/// Channels `1..=n` on both sessions: (creators on `a`, binders on `b`).
fn open_channels(a: &MuxSession, b: &MuxSession, n: u32, da: &Domain, db: &Domain) -> (Vec<Channel>, Vec<Channel>) {
    let mut txs: Vec<Channel> = (1..=n).map(|id| Channel::create(da, &a.endpoint(id), tx_setup()).unwrap()).collect();
    let mut rxs: Vec<Channel> =
        (1..=n).map(|id| Channel::bind(db, &b.endpoint(id), BindParams::default()).unwrap()).collect();
    for ch in txs.iter_mut().chain(rxs.iter_mut()) {
        ch.wait_connected(T).unwrap();
    }
    (txs, rxs)
}

/// Assign `alloc`'s pool on `tx` while `rx` (the peer) accepts it.
fn assign_pair(tx: &mut Channel, rx: &mut Channel, alloc: &Allocator) {
    offer_pool(tx, rx, alloc.pool());
}

/// Assign `pool` on `tx` while `rx` (the peer) accepts it.
fn offer_pool(tx: &mut Channel, rx: &mut Channel, pool: &Pool) {
    tx.assign_pool(pool).unwrap();
    let deadline = Instant::now() + T;
    let mut accepted = false;
    loop {
        assert!(Instant::now() < deadline, "pool assignment did not finish");
        if !accepted {
            match rx.wait(Some(Duration::from_millis(5))) {
                Ok(Event::PoolAssignRequest(req)) => {
                    rx.respond_pool(req.pool, true).unwrap();
                    accepted = true;
                }
                Ok(Event::Bound) | Err(_) => {}
                Ok(ev) => panic!("binder: unexpected {ev:?}"),
            }
        }
        match tx.wait(Some(Duration::from_millis(5))) {
            Ok(Event::PoolAssigned(_)) => return,
            Ok(Event::BindRequest { .. }) | Err(_) => {}
            Ok(ev) => panic!("creator: unexpected {ev:?}"),
        }
    }
}

/// A session pair with one channel, from domain `a` (its end and an
/// allocator of 8 buffers whose pool is assigned) to domain `b`: (the
/// sessions, which must outlive the channel, `b`, `a`'s end, `b`'s end,
/// the allocator).
fn one_channel() -> ((MuxSession, MuxSession), Domain, Channel, Channel, Allocator) {
    let (a, b) = session_pair(NetOptions::default());
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let (mut txs, mut rxs) = open_channels(&a, &b, 1, &da, &db);
    let (mut tx, mut rx) = (txs.pop().unwrap(), rxs.pop().unwrap());
    let alloc = Allocator::new(&da, 8, SIZE, PoolConstraints::default()).unwrap();
    assign_pair(&mut tx, &mut rx, &alloc);
    ((a, b), db, tx, rx, alloc)
}

/// One channel: moves there, passes back, every byte checked.
#[test]
fn one_channel_moves_and_passes_back() {
    let (_sessions, _db, mut tx, mut rx, alloc) = one_channel();
    let sink = std::thread::spawn(move || {
        let mut n = 0;
        loop {
            match next(&mut rx) {
                Event::MoveReceived { mut buffer, meta } => {
                    let seq = seq_of(&meta);
                    assert!(check(&buffer, seq), "move {seq} arrived corrupted");
                    fill(buffer.as_mut_slice().unwrap(), seq + 1);
                    rx.pass(buffer, &meta).unwrap();
                    n += 1;
                }
                Event::Closed { .. } => return n,
                ev => panic!("sink: unexpected {ev:?}"),
            }
        }
    });
    support::payload::move_and_take_back(&mut tx, &alloc, 300, |seq| seq + 1);
    tx.teardown().unwrap();
    assert!(matches!(next(&mut tx), Event::Closed { by_peer: false }));
    assert_eq!(sink.join().unwrap(), 300);
    assert_eq!(alloc.available(), 8);
    let stats = tx.link_stats().unwrap();
    assert_eq!(stats.payload_staged, 0, "{stats:?}");
}

/// A sink that tears down, whose source answers and closes, can still
/// flush while the answer waits in its queue (the close the session read
/// while serving another channel is not a dead peer), and then reads
/// the answer: the channel closes as on a connection of its own.
#[test]
fn a_flush_after_the_peer_answered_a_teardown_is_not_an_error() {
    let (a, b) = session_pair(NetOptions::default());
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let (mut txs, mut rxs) = open_channels(&a, &b, 2, &da, &db);
    let alloc = Allocator::new(&da, 8, SIZE, PoolConstraints::default()).unwrap();
    assign_pair(&mut txs[1], &mut rxs[1], &alloc);
    rxs[0].teardown().unwrap();
    assert!(matches!(next(&mut txs[0]), Event::Closed { by_peer: true }));
    // The close of channel 1 is read on the way to this move on channel 2.
    txs[1].move_buffer(alloc.alloc().unwrap(), b"m").unwrap();
    assert!(matches!(next(&mut rxs[1]), Event::MoveReceived { .. }));
    rxs[0].flush().expect("flush after the peer's answer");
    assert!(matches!(next(&mut rxs[0]), Event::Closed { by_peer: false }));
}

/// An aggregate crosses a session channel as one unit, as on the other
/// backends: a header buffer moved, a body buffer that appears in two
/// fragments (and is still held by the sender, so copied) crossing once.
#[test]
fn an_aggregate_crosses_as_one_unit() {
    let (_sessions, db, mut tx, mut rx, alloc) = one_channel();
    let mut body = alloc.alloc().unwrap();
    fill(body.as_mut_slice().unwrap(), 7);
    let body = Aggregate::from_buffer_range(body, 0..SIZE).unwrap();
    let mut msg = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"HDR ").unwrap();
    msg.append(body.slice(0..100).unwrap());
    msg.append(body.slice(SIZE - 50..SIZE).unwrap());
    let want = msg.to_vec();
    tx.send_aggregate(msg, b"agg").unwrap();
    match next(&mut rx) {
        Event::Aggregate { agg, meta } => {
            assert_eq!(&meta[..], b"agg");
            assert_eq!(agg.to_vec(), want);
            let copies: Vec<bool> = agg.fragments().map(|f| f.is_copy()).collect();
            assert_eq!(copies, [false, true, true], "the header moved, the shared body copied");
        }
        ev => panic!("expected the aggregate, got {ev:?}"),
    }
    // The body crossed once: two payloads (header and body), not three.
    let stats = tx.link_stats().unwrap();
    assert_eq!(stats.payload_sent, 2 * SIZE as u64, "{stats:?}");
    drop(body);
    rx.flush().unwrap();
    assert!(matches!(next(&mut tx), Event::CopyReleased { writable: true, .. }));
    // The body is back in the sender's allocator; the moved header was freed
    // in the receiving domain, which owns it now.
    assert_eq!(alloc.available(), 7);
    assert_eq!(db.free_count(alloc.pool().id()), 1);
}

// ------------------------------------------------------- many channels

/// What the sending side of [`run_channels`] saw on one channel.
#[derive(Debug, Default, Clone)]
struct Tally {
    back: u64,
    queue_full: bool,
}

/// Move `total` patterned buffers on each channel of `txs` (64 KiB, their
/// allocator each, its pool assigned) and take every pass back (pattern
/// seq + 1), driven by one `Selector`; channels in `skip` get no more than
/// what fits (they are expected to fill up). Ends when every other channel
/// has all of its buffers back.
fn run_channels(
    txs: Vec<Channel>,
    allocs: &[Allocator],
    total: u64,
    skip: &[usize],
) -> (Vec<Tally>, ferry::Selector, Vec<usize>) {
    let mut sel = ferry::Selector::new().unwrap();
    let keys: Vec<usize> = txs.into_iter().map(|ch| sel.insert(ch)).collect();
    let n = keys.len();
    let mut sent = vec![0u64; n];
    let mut tally = vec![Tally::default(); n];
    let deadline = Instant::now() + Duration::from_secs(60);
    while (0..n).any(|i| !skip.contains(&i) && tally[i].back < total) {
        assert!(Instant::now() < deadline, "channels did not finish: {tally:?}");
        for i in 0..n {
            let ch = sel.get_mut(keys[i]).unwrap();
            while sent[i] < total && !(skip.contains(&i) && tally[i].queue_full) {
                let Some(mut b) = allocs[i].alloc() else { break };
                let seq = sent[i];
                fill(b.as_mut_slice().unwrap(), seq ^ ((i as u64) << 32));
                match ch.move_buffer(b, &seq.to_le_bytes()) {
                    Ok(()) => sent[i] += 1,
                    Err(r) if r.error == ErrorKind::QueueFull => {
                        tally[i].queue_full = true;
                        drop(r.into_inner());
                        break;
                    }
                    Err(r) => panic!("channel {i}: move failed: {}", r.error),
                }
            }
        }
        match sel.wait(Some(Duration::from_millis(100))) {
            Ok((key, Event::BufferPassed { buffer, meta })) => {
                let i = keys.iter().position(|&k| k == key).unwrap();
                let seq = seq_of(&meta);
                assert!(check(&buffer, (seq ^ ((i as u64) << 32)) + 1), "channel {i}: buffer {seq} came back wrong");
                assert_eq!(seq, tally[i].back, "channel {i}: passes out of order");
                tally[i].back += 1;
            }
            Ok((_, Event::PoolAssigned(_))) | Err(_) => {}
            Ok((key, ev)) => panic!("sender, key {key}: unexpected {ev:?}"),
        }
    }
    (tally, sel, keys)
}

/// The receiving side: every channel in a `Selector` (those in `stalled`
/// only once `resume` says so), each move checked for its pattern and
/// order, refilled with seq + 1 and passed back. Returns the moves taken
/// per channel once every channel is closed.
fn echo_channels(rxs: Vec<Channel>, stalled: Vec<usize>, resume: std::sync::mpsc::Receiver<()>) -> Vec<u64> {
    let mut sel = ferry::Selector::new().unwrap();
    let n = rxs.len();
    let mut held: Vec<Option<Channel>> = Vec::new();
    let mut keys = vec![usize::MAX; n];
    for (i, ch) in rxs.into_iter().enumerate() {
        if stalled.contains(&i) {
            held.push(Some(ch));
        } else {
            keys[i] = sel.insert(ch);
            held.push(None);
        }
    }
    let mut got = vec![0u64; n];
    let mut waiting: Vec<std::collections::VecDeque<(ferry::Buffer, ferry::Meta)>> =
        (0..n).map(|_| Default::default()).collect();
    let mut closed = 0;
    let deadline = Instant::now() + Duration::from_secs(90);
    while closed < n {
        assert!(Instant::now() < deadline, "echo did not finish: {got:?}");
        if resume.try_recv().is_ok() {
            for i in &stalled {
                keys[*i] = sel.insert(held[*i].take().unwrap());
            }
        }
        // Passes the queue had no room for (the sender's credit) first.
        for i in 0..n {
            while let Some((buffer, meta)) = waiting[i].pop_front() {
                match sel.get_mut(keys[i]).unwrap().pass(buffer, &meta) {
                    Ok(()) => {}
                    Err(r) if r.error == ErrorKind::QueueFull => {
                        waiting[i].push_front((r.into_inner(), meta));
                        break;
                    }
                    Err(r) => panic!("channel {i}: pass failed: {}", r.error),
                }
            }
        }
        match sel.wait(Some(Duration::from_millis(if waiting.iter().any(|w| !w.is_empty()) { 1 } else { 50 }))) {
            Ok((key, Event::MoveReceived { mut buffer, meta })) => {
                let i = keys.iter().position(|&k| k == key).unwrap();
                let seq = seq_of(&meta);
                let pattern = seq ^ ((i as u64) << 32);
                assert!(check(&buffer, pattern), "channel {i}: move {seq} arrived corrupted");
                assert_eq!(seq, got[i], "channel {i}: moves out of order");
                got[i] += 1;
                fill(buffer.as_mut_slice().unwrap(), pattern + 1);
                waiting[i].push_back((buffer, meta));
            }
            Ok((key, Event::Closed { .. })) => {
                closed += 1;
                sel.remove(key);
            }
            Ok((_, Event::Bound)) | Err(_) => {}
            Ok((key, ev)) => panic!("echo, key {key}: unexpected {ev:?}"),
        }
    }
    got
}

/// Channels `1..=n` with `buffers` buffers each, pools assigned.
fn setup_channels(
    n: u32,
    buffers: u64,
    depth: u32,
) -> (MuxSession, MuxSession, Vec<Channel>, Vec<Channel>, Vec<Allocator>) {
    let (a, b) = session_pair(NetOptions::default());
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup { queue_depth: depth, ..tx_setup() };
    let mut txs: Vec<Channel> = (1..=n).map(|id| Channel::create(&da, &a.endpoint(id), setup).unwrap()).collect();
    let mut rxs: Vec<Channel> =
        (1..=n).map(|id| Channel::bind(&db, &b.endpoint(id), BindParams::default()).unwrap()).collect();
    for ch in txs.iter_mut().chain(rxs.iter_mut()) {
        ch.wait_connected(T).unwrap();
    }
    let mut allocs = Vec::new();
    for (tx, rx) in txs.iter_mut().zip(rxs.iter_mut()) {
        let alloc = Allocator::new(&da, buffers, SIZE, PoolConstraints::default()).unwrap();
        assign_pair(tx, rx, &alloc);
        allocs.push(alloc);
    }
    (a, b, txs, rxs, allocs)
}

/// Tear down every channel of the sender's selector and wait for the
/// closes.
fn close_all(mut sel: ferry::Selector, keys: &[usize]) {
    for &k in keys {
        sel.get_mut(k).unwrap().teardown().unwrap();
    }
    let deadline = Instant::now() + T;
    while !sel.is_empty() {
        assert!(Instant::now() < deadline, "closes did not come");
        match sel.wait(Some(Duration::from_millis(100))) {
            Ok((k, Event::Closed { .. })) => {
                sel.remove(k);
            }
            Ok((_, Event::BufferPassed { .. })) | Err(_) => {}
            Ok((k, ev)) => panic!("closing {k}: unexpected {ev:?}"),
        }
    }
}

/// Sixteen channels on one connection, each moving 100 buffers there and
/// back at once, every byte and the order checked per channel.
#[test]
fn sixteen_channels_share_one_connection() {
    let (_a, _b, txs, rxs, allocs) = setup_channels(16, 8, 64);
    let (_resume, resumed) = std::sync::mpsc::channel();
    let echo = std::thread::spawn(move || echo_channels(rxs, Vec::new(), resumed));
    let (tally, sel, keys) = run_channels(txs, &allocs, 100, &[]);
    assert!(tally.iter().all(|t| t.back == 100), "{tally:?}");
    close_all(sel, &keys);
    assert_eq!(echo.join().unwrap(), vec![100; 16]);
    assert!(allocs.iter().all(|a| a.available() == 8));
}

/// A receiver that stops reading one channel does not slow the others:
/// they all finish while the stalled channel's sender sees `QueueFull`
/// (its credit is spent); once the receiver reads it again, everything
/// sent on it arrives, in order.
#[test]
fn a_stalled_channel_does_not_block_the_others() {
    let (_a, _b, txs, rxs, allocs) = setup_channels(4, 64, 8);
    let (resume, resumed) = std::sync::mpsc::channel();
    let echo = std::thread::spawn(move || echo_channels(rxs, vec![0], resumed));
    let (tally, mut sel, keys) = run_channels(txs, &allocs, 300, &[0]);
    assert!(tally[1..].iter().all(|t| t.back == 300), "{tally:?}");
    assert!(tally[0].queue_full, "the stalled channel's sender must have filled its queue: {tally:?}");
    assert_eq!(tally[0].back, 0, "nothing came back on the stalled channel");
    // Resume: what was sent on channel 0 arrives in order and comes back.
    resume.send(()).unwrap();
    let expect = (64 - allocs[0].available()) as u64;
    let mut back = 0;
    let deadline = Instant::now() + T;
    while back < expect {
        assert!(Instant::now() < deadline, "the stalled channel did not drain: {back} of {expect}");
        match sel.wait(Some(Duration::from_millis(100))) {
            Ok((k, Event::BufferPassed { .. })) => {
                assert_eq!(k, keys[0]);
                back += 1;
            }
            Err(_) => {}
            Ok((k, ev)) => panic!("{k}: unexpected {ev:?}"),
        }
    }
    close_all(sel, &keys);
    let got = echo.join().unwrap();
    assert_eq!(got[0], expect);
    assert_eq!(&got[1..], &[300, 300, 300]);
}

/// A channel's credit is its queue depth, all of it: while the receiving
/// application takes nothing, exactly as many messages cross as the
/// credit allows (their payloads land at the receiver, which reads the
/// connection through a poll of another channel of its session) and a
/// queue's worth more waits at the sender, which then says `QueueFull`.
/// Messages taken are granted back a quarter of the depth at a time, and
/// each grant lets exactly that many more cross. The pool assignment is a
/// message of the channel too: it took one credit, granted back with the
/// first data message taken.
#[test]
fn a_channel_uses_all_of_its_credit_and_no_more() {
    const DEPTH: u64 = 8;
    const GRANT: u64 = DEPTH / 4;
    const BUF: usize = 4096;
    // Data messages that may have crossed once `taken` have been taken.
    let crossed = |taken: u64| DEPTH + (1 + taken) / GRANT * GRANT - 1;
    let (a, b) = session_pair(NetOptions::default());
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup { queue_depth: DEPTH as u32, ..tx_setup() };
    let mut tx = Channel::create(&da, &a.endpoint(1), setup).unwrap();
    let mut idle_tx = Channel::create(&da, &a.endpoint(2), tx_setup()).unwrap();
    let mut rx = Channel::bind(&db, &b.endpoint(1), BindParams::default()).unwrap();
    let mut idle_rx = Channel::bind(&db, &b.endpoint(2), BindParams::default()).unwrap();
    for ch in [&mut tx, &mut idle_tx, &mut rx, &mut idle_rx] {
        ch.wait_connected(T).unwrap();
    }
    let alloc = Allocator::new(&da, 4 * DEPTH, BUF, PoolConstraints::default()).unwrap();
    assign_pair(&mut tx, &mut rx, &alloc);
    let mut sent = 0u64;
    let mut send_until_full = |tx: &mut Channel| loop {
        let mut buf = alloc.alloc().expect("more buffers than credit and queue");
        fill(buf.as_mut_slice().unwrap(), sent);
        match tx.move_buffer(buf, &sent.to_le_bytes()) {
            Ok(()) => sent += 1,
            Err(r) if r.error == ErrorKind::QueueFull => return sent,
            Err(r) => panic!("move: {}", r.error),
        }
    };
    // Messages whose payload landed at the receiver.
    let landed = |rx: &Channel| rx.link_stats().unwrap().payload_received / BUF as u64;
    let settle = |tx: &mut Channel, idle_rx: &mut Channel, rx: &Channel, want: u64| {
        let deadline = Instant::now() + T;
        while landed(rx) < want {
            assert!(
                Instant::now() < deadline,
                "{} of {want} messages crossed within {T:?}; receiver {:?}",
                landed(rx),
                rx.link_stats()
            );
            assert!(tx.wait(Some(Duration::from_millis(1))).is_err());
            assert!(idle_rx.wait(Some(Duration::from_millis(1))).is_err());
        }
        // A few more rounds both ways: nothing beyond the credit crosses.
        for _ in 0..20 {
            assert!(tx.wait(Some(Duration::from_millis(1))).is_err());
            assert!(idle_rx.wait(Some(Duration::from_millis(1))).is_err());
        }
        assert_eq!(landed(rx), want, "messages crossed beyond the credit");
    };
    send_until_full(&mut tx);
    settle(&mut tx, &mut idle_rx, &rx, crossed(0));
    assert_eq!(send_until_full(&mut tx), crossed(0) + DEPTH, "the credit's worth crossed, a queue's worth waits");
    let mut kept = Vec::new();
    // Every move arrives whole and in order.
    let keep = |ev: Event, kept: &mut Vec<ferry::Buffer>| match ev {
        Event::MoveReceived { buffer, meta } => {
            let seq = kept.len() as u64;
            assert_eq!(seq_of(&meta), seq);
            assert!(check(&buffer, seq), "move {seq} corrupted");
            kept.push(buffer);
        }
        ev => panic!("receiver: unexpected {ev:?}"),
    };
    // One message taken at a time: every grant lets its worth cross.
    for taken in 1..=2 * GRANT {
        keep(next(&mut rx), &mut kept);
        settle(&mut tx, &mut idle_rx, &rx, crossed(taken).min(sent));
    }
    // Then everything, in order (the sender's end kept going meanwhile).
    let deadline = Instant::now() + T;
    while (kept.len() as u64) < sent {
        assert!(Instant::now() < deadline, "{} of {sent} moves arrived", kept.len());
        assert!(tx.wait(Some(Duration::from_millis(1))).is_err());
        if let Ok(ev) = rx.wait(Some(Duration::from_millis(1))) {
            keep(ev, &mut kept);
        }
    }
}

/// A session channel keeps its queue depth in its counters: the messages
/// its credit holds back are counted, and none once the peer took them.
#[test]
fn a_session_channel_counts_what_waits_in_its_queue() {
    const DEPTH: u32 = 8;
    const BUF: usize = 4096;
    let (a, b) = session_pair(NetOptions::default());
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup { queue_depth: DEPTH, ..tx_setup() };
    let mut tx = Channel::create(&da, &a.endpoint(1), setup).unwrap();
    let mut rx = Channel::bind(&db, &b.endpoint(1), BindParams::default()).unwrap();
    for ch in [&mut tx, &mut rx] {
        ch.wait_connected(T).unwrap();
    }
    let alloc = Allocator::new(&da, 4 * u64::from(DEPTH), BUF, PoolConstraints::default()).unwrap();
    assign_pair(&mut tx, &mut rx, &alloc);
    // More than the credit lets cross, fewer than credit and queue hold.
    let sent = u64::from(DEPTH) + 3;
    for seq in 0..sent {
        tx.move_buffer(alloc.alloc().unwrap(), &seq.to_le_bytes()).unwrap();
    }
    // The end samples its queue when it goes to sleep in `wait`. The
    // session wrote what the credit allows at once (nothing else drives
    // it meanwhile): the rest waits, its payload not (all) written.
    let _ = tx.wait(Some(Duration::from_millis(1)));
    let s = tx.stats();
    let written = tx.link_stats().unwrap().payload_sent / BUF as u64;
    let waiting = (sent - written) as u32;
    assert!(waiting > 0, "the credit holds some back ({sent} sent, {written} written)");
    assert_eq!((s.queue_depth, s.queue_capacity, s.queue_high_water), (waiting, DEPTH, waiting));
    let deadline = Instant::now() + T;
    // The receiver takes everything: the queue empties.
    let mut taken = 0;
    while taken < sent {
        assert!(Instant::now() < deadline, "{taken} of {sent} moves arrived");
        let _ = tx.wait(Some(Duration::from_millis(1)));
        if let Ok(Event::MoveReceived { buffer, .. }) = rx.wait(Some(Duration::from_millis(1))) {
            drop(buffer);
            taken += 1;
        }
    }
    let _ = tx.wait(Some(Duration::from_millis(1)));
    assert_eq!(tx.stats().queue_depth, 0);
}

// ------------------------------------------------------- a real peer process

const CHILD_CHANNELS: u32 = 4;

/// The peer process (run by the tests below, ignored otherwise): connect a
/// session to FERRY_MUX_ADDR, bind channels 1..=4, check every move, pass
/// the first of each channel back and hold the rest until killed.
#[test]
#[ignore = "run as a child process by the other tests"]
fn mux_child() {
    let Ok(addr) = std::env::var("FERRY_MUX_ADDR") else { return };
    let options = NetOptions::with_peer_timeout(Duration::from_secs(2));
    let session = MuxSession::connect(addr.parse().unwrap(), options, T).expect("session");
    let d = Domain::new("child");
    let mut sel = ferry::Selector::new().unwrap();
    let mut keys = Vec::new();
    for id in 1..=CHILD_CHANNELS {
        let mut ch = Channel::connect(&d, &session.endpoint(id), BindParams::default(), T).expect("bind");
        ch.set_pool_policy(ferry::PoolPolicy::AcceptAll);
        keys.push(sel.insert(ch));
    }
    let mut kept = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        match sel.wait(Some(Duration::from_millis(100))) {
            Ok((key, Event::MoveReceived { buffer, meta })) => {
                let i = keys.iter().position(|&k| k == key).unwrap() as u64;
                let seq = seq_of(&meta);
                assert!(check(&buffer, seq ^ (i << 32)), "child: move {seq} corrupted");
                if seq == 0 {
                    sel.get_mut(key).unwrap().pass(buffer, &meta).unwrap();
                } else {
                    kept.push(buffer);
                }
            }
            Ok((_, Event::Closed { .. } | Event::Error(_))) => return,
            _ => {}
        }
    }
}

fn spawn_child(addr: SocketAddr) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "mux_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("FERRY_MUX_ADDR", addr.to_string())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn child")
}

/// `kill -9` of the peer process while it holds buffers of every channel
/// of the session: each channel gets a peer-death error, and every buffer
/// lent to the dead peer comes back to its allocator.
#[test]
fn killed_peer_fails_every_channel_and_buffers_come_back() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut child = spawn_child(listener.local_addr().unwrap());
    let options = NetOptions::with_peer_timeout(Duration::from_secs(2));
    let session = MuxSession::accept(&listener, options, T).unwrap();
    let d = Domain::new("parent");
    let mut chans = Vec::new();
    let mut allocs = Vec::new();
    let mut accepted: Vec<Channel> =
        (1..=CHILD_CHANNELS).map(|id| Channel::accept(&d, &session.endpoint(id), tx_setup(), T).unwrap()).collect();
    for (id, mut ch) in (1..=CHILD_CHANNELS).zip(accepted.drain(..)) {
        let alloc = Allocator::new(&d, 8, SIZE, PoolConstraints::default()).unwrap();
        ch.assign_pool(alloc.pool()).unwrap();
        match next(&mut ch) {
            Event::PoolAssigned(_) => {}
            ev => panic!("expected the pool assigned, got {ev:?}"),
        }
        for seq in 0..4u64 {
            let mut b = alloc.alloc().unwrap();
            fill(b.as_mut_slice().unwrap(), seq ^ (u64::from(id - 1) << 32));
            ch.move_buffer(b, &seq.to_le_bytes()).unwrap();
        }
        chans.push(ch);
        allocs.push(alloc);
    }
    // The first buffer of each channel comes back: the child has it all.
    for ch in &mut chans {
        match next(ch) {
            Event::BufferPassed { buffer, meta } => {
                assert_eq!(seq_of(&meta), 0);
                drop(buffer);
            }
            ev => panic!("expected the first buffer back, got {ev:?}"),
        }
    }
    assert!(allocs.iter().all(|a| a.available() == 5), "three buffers of each channel are lent");
    child.kill().unwrap();
    for (i, ch) in chans.iter_mut().enumerate() {
        match next(ch) {
            Event::Error(err) if matches!(err.kind(), ErrorKind::PeerGone | ErrorKind::PeerUnresponsive(_)) => {}
            ev => panic!("channel {i}: expected peer death, got {ev:?}"),
        }
        assert_eq!(allocs[i].available(), 8, "channel {i}: the lent buffers are back");
        assert!(ch.poll().is_none(), "a failed channel is closed");
    }
    let _ = wait_exit(&mut child, T);
}

// ------------------------------------------------------- a hostile peer

/// A raw peer speaking the session protocol by hand: the magic, then an
/// open of channel `id` with a bind request (any role, any trust, max meta
/// 224); the creator's reply is read and must be an acceptance.
fn raw_open(addr: SocketAddr, ids: &[u32]) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(&support::mux_peer::hello(10_000)).unwrap();
    support::mux_peer::read_hello(&mut s);
    for &id in ids {
        let mut req = b"FRY1\x01\x00\xff".to_vec();
        req.extend_from_slice(&224u16.to_le_bytes());
        req.extend_from_slice(&[0u8; 24]);
        s.write_all(
            &ferry::backend::mux::MuxHead { kind: 4, flags: 0, channel: id, len: req.len() as u32, credit: 0 }.encode(),
        )
        .unwrap();
        s.write_all(&req).unwrap();
    }
    s
}

/// Malformed frames from the peer: every channel of the session fails with
/// a protocol error (no panic, no hang), the peer's connection ends.
#[test]
fn malformed_frames_are_protocol_errors() {
    use std::io::{Read, Write};
    let bad_frames: Vec<Vec<u8>> = vec![
        // Unknown kind.
        vec![99, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        // A chunk without a message.
        ferry::backend::mux::MuxHead { kind: 2, flags: 0, channel: 1, len: 8, credit: 0 }.encode().to_vec(),
        // A message for a channel that was never opened.
        {
            let mut f =
                ferry::backend::mux::MuxHead { kind: 1, flags: 0, channel: 77, len: 32, credit: 0 }.encode().to_vec();
            f.extend_from_slice(&[0u8; 32]);
            f
        },
        // A message whose meta length disagrees with the frame.
        {
            let mut f =
                ferry::backend::mux::MuxHead { kind: 1, flags: 0, channel: 2, len: 32, credit: 0 }.encode().to_vec();
            let mut m = [0u8; 32];
            m[0] = 9;
            m[2] = 5;
            f.extend_from_slice(&m);
            f
        },
    ];
    for bad in bad_frames {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let raw = std::thread::spawn(move || raw_open(addr, &[1, 2]));
        let session = MuxSession::accept(&listener, NetOptions::default(), T).unwrap();
        let d = Domain::new("victim");
        let mut one = Channel::accept(&d, &session.endpoint(1), ChannelSetup::default(), T).unwrap();
        let mut two = Channel::accept(&d, &session.endpoint(2), ChannelSetup::default(), T).unwrap();
        let mut s = raw.join().unwrap();
        s.write_all(&bad).unwrap();
        for ch in [&mut one, &mut two] {
            match next(ch) {
                Event::Error(err) if matches!(err.kind(), ErrorKind::Protocol(_)) => {}
                ev => panic!("frame {bad:?}: expected a protocol error, got {ev:?}"),
            }
            assert!(ch.poll().is_none());
        }
        // The peer's connection ends (after the open replies).
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
}

// ------------------------------------------------------- priorities

/// A priority channel overtakes two bulk channels that saturate the link:
/// the bulk senders have filled their credit (the receiver does not read
/// them), then 32 priority messages are sent; while the receiver takes
/// them, at most a chunk of bulk payload arrives between the first and
/// the last (round-robin would interleave a bulk chunk per priority
/// chunk), and bulk payload is still on its way after the last.
#[test]
fn priority_frames_overtake_a_saturating_bulk_channel() {
    const BULK: usize = 1 << 20;
    const PRIO: u64 = 32;
    let (a, b) = session_pair(NetOptions::default());
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let bulk_setup = ChannelSetup { queue_depth: 8, ..tx_setup() };
    let prio_setup = ChannelSetup { queue_depth: 64, ..tx_setup() };
    let mut txs = vec![
        Channel::create(&da, &a.endpoint(1), bulk_setup).unwrap(),
        Channel::create(&da, &a.endpoint(2), bulk_setup).unwrap(),
        Channel::create(&da, &a.endpoint_with_priority(3, 7), prio_setup).unwrap(),
    ];
    let mut rxs: Vec<Channel> =
        (1..=3).map(|id| Channel::bind(&db, &b.endpoint(id), BindParams::default()).unwrap()).collect();
    for ch in txs.iter_mut().chain(rxs.iter_mut()) {
        ch.wait_connected(T).unwrap();
    }
    let allocs = [
        Allocator::new(&da, 32, BULK, PoolConstraints::default()).unwrap(),
        Allocator::new(&da, 32, BULK, PoolConstraints::default()).unwrap(),
        Allocator::new(&da, PRIO, SIZE, PoolConstraints::default()).unwrap(),
    ];
    for ((tx, rx), alloc) in txs.iter_mut().zip(rxs.iter_mut()).zip(&allocs) {
        assign_pair(tx, rx, alloc);
    }
    // Bulk first, until its queue is full (credit spent, queue full).
    let mut bulk_sent = [0u64; 2];
    for i in 0..2 {
        loop {
            let mut buf = allocs[i].alloc().expect("more bulk buffers than credit and queue");
            fill(buf.as_mut_slice().unwrap(), bulk_sent[i]);
            match txs[i].move_buffer(buf, &bulk_sent[i].to_le_bytes()) {
                Ok(()) => bulk_sent[i] += 1,
                Err(r) if r.error == ErrorKind::QueueFull => break,
                Err(r) => panic!("bulk move: {}", r.error),
            }
        }
    }
    for seq in 0..PRIO {
        let mut buf = allocs[2].alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), seq);
        txs[2].move_buffer(buf, &seq.to_le_bytes()).unwrap();
    }
    // The sender keeps its end going (frames go out as the socket takes
    // them); the receiver reads the priority channel only.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sender = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut txs = txs;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for tx in &mut txs {
                    if let Ok(ev) = tx.wait(Some(Duration::from_millis(1))) {
                        panic!("sender: unexpected {ev:?}");
                    }
                }
            }
            txs
        })
    };
    let bulk_landed =
        |rxs: &[Channel]| -> u64 { rxs[..2].iter().map(|c| c.link_stats().unwrap().payload_received).sum() };
    let mut first = None;
    let mut kept = Vec::new();
    for seq in 0..PRIO {
        match next(&mut rxs[2]) {
            Event::MoveReceived { buffer, meta } => {
                assert_eq!(seq_of(&meta), seq);
                assert!(check(&buffer, seq), "priority move {seq} corrupted");
                kept.push(buffer);
            }
            ev => panic!("priority channel: unexpected {ev:?}"),
        }
        first.get_or_insert_with(|| bulk_landed(&rxs));
    }
    let during = bulk_landed(&rxs) - first.unwrap();
    assert!(during <= 2 * ferry::backend::mux::MAX_CHUNK as u64, "{during} bulk bytes came between priority messages");
    let total = (bulk_sent[0] + bulk_sent[1]) * BULK as u64;
    assert!(bulk_landed(&rxs) < total, "the bulk channels were not saturating the link");
    // Then all of the bulk arrives, in order.
    for (i, rx) in rxs[..2].iter_mut().enumerate() {
        for seq in 0..bulk_sent[i] {
            match next(rx) {
                Event::MoveReceived { buffer, meta } => {
                    assert_eq!(seq_of(&meta), seq);
                    assert!(check(&buffer, seq), "bulk move {seq} corrupted");
                    kept.push(buffer);
                }
                ev => panic!("bulk channel {i}: unexpected {ev:?}"),
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(sender.join().unwrap());
}

/// A bulk sender against a slow reader: two bulk channels saturate the
/// session while the receiving application reads the connection only now
/// and then, and a priority channel sends one message after another. The
/// bytes on their way (written and not yet reported read by the peer)
/// stay within the session's bulk budget, and so does what each priority
/// message queued behind (the session's own counters); without the
/// budget, the kernels take megabytes of bulk ahead of it.
#[test]
fn bulk_on_its_way_stays_within_the_budget() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    const BULK: usize = 1 << 20;
    const BUDGET: usize = 512 << 10;
    const PROBES: u64 = 24;
    let (a, b) = session_pair(NetOptions::default());
    a.set_bulk_budget(BUDGET);
    assert_eq!(a.bulk_budget(), BUDGET);
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let mut txs = vec![
        Channel::create(&da, &a.endpoint(1), tx_setup()).unwrap(),
        Channel::create(&da, &a.endpoint(2), tx_setup()).unwrap(),
        Channel::create(&da, &a.endpoint_with_priority(3, 7), tx_setup()).unwrap(),
    ];
    let mut rxs: Vec<Channel> = (1..=3)
        .map(|id| {
            Channel::bind(&db, &b.endpoint_with_priority(id, if id == 3 { 7 } else { 0 }), BindParams::default())
                .unwrap()
        })
        .collect();
    for ch in txs.iter_mut().chain(rxs.iter_mut()) {
        ch.wait_connected(T).unwrap();
    }
    let allocs = [
        Allocator::new(&da, 32, BULK, PoolConstraints::default()).unwrap(),
        Allocator::new(&da, 32, BULK, PoolConstraints::default()).unwrap(),
        Allocator::new(&da, PROBES, 4096, PoolConstraints::default()).unwrap(),
    ];
    for ((tx, rx), alloc) in txs.iter_mut().zip(rxs.iter_mut()).zip(&allocs) {
        assign_pair(tx, rx, alloc);
    }
    // The slow reader: a look at its channels every millisecond; what
    // arrives is kept (the sender runs out of bulk eventually), probes are
    // counted.
    let probes = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (probes, stop) = (probes.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                for (i, rx) in rxs.iter_mut().enumerate() {
                    while let Some(ev) = rx.poll() {
                        match ev {
                            Event::MoveReceived { buffer, .. } => {
                                kept.push(buffer);
                                if i == 2 {
                                    probes.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            ev => panic!("reader, channel {i}: unexpected {ev:?}"),
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let landed: u64 = rxs[..2].iter().map(|c| c.link_stats().unwrap().payload_received).sum();
            (rxs, kept, landed)
        })
    };
    // The sender: bulk as long as it has buffers, one probe at a time.
    let mut sent = 0;
    let mut most_on_the_way = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while probes.load(Ordering::Relaxed) < PROBES {
        assert!(Instant::now() < deadline, "{} of {PROBES} probes arrived", probes.load(Ordering::Relaxed));
        for (tx, alloc) in txs[..2].iter_mut().zip(&allocs) {
            while let Some(buf) = alloc.alloc() {
                if let Err(r) = tx.move_buffer(buf, &[]) {
                    assert_eq!(r.error, ErrorKind::QueueFull);
                    break;
                }
            }
        }
        if sent == probes.load(Ordering::Relaxed) {
            let probe = allocs[2].alloc().expect("a probe buffer per probe");
            txs[2].move_buffer(probe, &[]).unwrap();
            sent += 1;
        }
        for tx in &mut txs {
            if let Ok(ev) = tx.wait(Some(Duration::from_millis(1))) {
                panic!("sender: unexpected {ev:?}");
            }
        }
        let stats = a.stats();
        most_on_the_way = most_on_the_way.max(stats.bytes_sent - stats.bytes_reported_read);
    }
    stop.store(true, Ordering::Relaxed);
    let (mut rxs, mut kept, landed) = reader.join().unwrap();
    let stats = a.stats();
    // What a priority frame may find ahead of it beyond the budget: the
    // session's control frames and the frames of the previous probe.
    let slack = (64 << 10) as u64;
    assert!(
        most_on_the_way <= (BUDGET as u64) + slack,
        "{most_on_the_way} bytes on their way with a budget of {BUDGET}: {stats:?}"
    );
    assert!(
        stats.max_ahead_of_priority <= (BUDGET as u64) + slack,
        "a probe queued behind {} bytes with a budget of {BUDGET}: {stats:?}",
        stats.max_ahead_of_priority
    );
    assert!(stats.budget_holds > 0, "the bulk channels never filled the budget: {stats:?}");
    assert!(landed < 64 * BULK as u64, "the bulk channels were not saturating the session: {stats:?}");
    // Every report the reader made reaches the sender (both sides polled
    // until then), and the reader never sits on a report's worth.
    let theirs = b.stats();
    assert!(theirs.bytes_received - theirs.bytes_reported_to_peer < ferry::backend::mux::READ_REPORT_EVERY as u64);
    while a.stats().bytes_reported_read != b.stats().bytes_reported_to_peer {
        assert!(Instant::now() < deadline, "reports lost on the way: {:?} against {:?}", a.stats(), b.stats());
        for ch in txs.iter_mut().chain(rxs.iter_mut()) {
            match ch.wait(Some(Duration::from_millis(1))) {
                Ok(Event::MoveReceived { buffer, .. }) => kept.push(buffer),
                Ok(ev) => panic!("unexpected {ev:?}"),
                Err(_) => {}
            }
        }
    }
}

/// Priority frames are never held by the bulk budget: with the budget
/// full of bulk the peer has not reported read (the receiving application
/// has not polled at all), a priority message larger than what is left of
/// the budget still goes to the socket at once, and no bulk with it; it
/// arrives whole, ahead of the held bulk, which then all follows in order.
/// (Small bulk buffers and the smallest budget: what is on its way fits in
/// the two kernels' buffers, so the socket takes all that is committed.)
#[test]
fn priority_frames_are_not_held_by_a_full_bulk_budget() {
    const BULK_BUF: usize = 4096;
    const BULK_COUNT: u64 = 64;
    const PRIO_BUF: usize = 16 << 10;
    let (a, b) = session_pair(NetOptions::default());
    a.set_bulk_budget(0);
    let budget = a.bulk_budget() as u64;
    assert_eq!(budget, ferry::backend::mux::MIN_BULK_BUDGET as u64);
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let bulk_setup = ChannelSetup { queue_depth: BULK_COUNT as u32, ..tx_setup() };
    let mut txs = vec![
        Channel::create(&da, &a.endpoint(1), bulk_setup).unwrap(),
        Channel::create(&da, &a.endpoint_with_priority(3, 7), tx_setup()).unwrap(),
    ];
    let mut rxs: Vec<Channel> =
        [1, 3].iter().map(|&id| Channel::bind(&db, &b.endpoint(id), BindParams::default()).unwrap()).collect();
    for ch in txs.iter_mut().chain(rxs.iter_mut()) {
        ch.wait_connected(T).unwrap();
    }
    let allocs = [
        Allocator::new(&da, BULK_COUNT, BULK_BUF, PoolConstraints::default()).unwrap(),
        Allocator::new(&da, 1, PRIO_BUF, PoolConstraints::default()).unwrap(),
    ];
    for ((tx, rx), alloc) in txs.iter_mut().zip(rxs.iter_mut()).zip(&allocs) {
        assign_pair(tx, rx, alloc);
    }
    let reported = a.stats().bytes_reported_read;
    // Bulk until the budget holds it back.
    let mut bulk_sent = 0u64;
    let deadline = Instant::now() + T;
    while a.stats().budget_holds == 0 {
        assert!(Instant::now() < deadline, "{bulk_sent} bulk moves never filled the budget: {:?}", a.stats());
        let mut buf = allocs[0].alloc().expect("more bulk buffers than the budget holds");
        fill(buf.as_mut_slice().unwrap(), bulk_sent);
        txs[0].move_buffer(buf, &bulk_sent.to_le_bytes()).expect("room in the bulk queue");
        bulk_sent += 1;
        assert!(txs[0].wait(Some(Duration::from_millis(1))).is_err());
    }
    let before = a.stats();
    assert_eq!(before.bytes_reported_read, reported, "the receiver has read nothing");
    assert!(before.bytes_sent - reported + PRIO_BUF as u64 > budget, "the priority message would fit: {before:?}");
    // The priority message: on the socket without a byte reported read.
    let mut buf = allocs[1].alloc().unwrap();
    fill(buf.as_mut_slice().unwrap(), 1000);
    txs[1].move_buffer(buf, &1000u64.to_le_bytes()).unwrap();
    // (Well before the peer timeout, which a sender that makes no
    // progress reaches.)
    let deadline = Instant::now() + T / 2;
    while a.stats().bytes_sent < before.bytes_sent + PRIO_BUF as u64 {
        let held =
            format!("the priority message did not go out past the full budget: {:?}, before it {before:?}", a.stats());
        assert!(Instant::now() < deadline, "{held}");
        for tx in &mut txs {
            if let Ok(ev) = tx.wait(Some(Duration::from_millis(1))) {
                panic!("{held}; then {ev:?}");
            }
        }
    }
    let after = a.stats();
    assert_eq!(after.bytes_reported_read, reported, "the receiver has read nothing");
    assert!(
        after.bytes_sent - before.bytes_sent < (PRIO_BUF + BULK_BUF) as u64,
        "bulk went out with the priority message: {after:?}, before it {before:?}"
    );
    match next(&mut rxs[1]) {
        Event::MoveReceived { buffer, meta } => {
            assert_eq!(seq_of(&meta), 1000);
            assert!(check(&buffer, 1000), "the priority move is corrupted");
        }
        ev => panic!("priority channel: unexpected {ev:?}"),
    }
    // The held bulk follows, all of it, in order.
    let mut kept = Vec::new();
    let deadline = Instant::now() + T;
    while (kept.len() as u64) < bulk_sent {
        assert!(Instant::now() < deadline, "{} of {bulk_sent} bulk moves arrived", kept.len());
        assert!(txs[0].wait(Some(Duration::from_millis(1))).is_err());
        match rxs[0].wait(Some(Duration::from_millis(1))) {
            Ok(Event::MoveReceived { buffer, meta }) => {
                let seq = kept.len() as u64;
                assert_eq!(seq_of(&meta), seq);
                assert!(check(&buffer, seq), "bulk move {seq} corrupted");
                kept.push(buffer);
            }
            Err(_) => {}
            Ok(ev) => panic!("bulk channel: unexpected {ev:?}"),
        }
    }
}

/// A sender that only sends (it does not poll or wait on its channel
/// until everything is queued) keeps going past the bulk budget: a full
/// queue makes the session read the peer's reports, which let the held
/// bulk go.
#[test]
fn a_sender_that_never_polls_gets_past_the_budget() {
    const MOVES: u64 = 64;
    let (a, b) = session_pair(NetOptions::default());
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup { queue_depth: 8, ..tx_setup() };
    let mut tx = Channel::create(&da, &a.endpoint(1), setup).unwrap();
    let mut rx = Channel::bind(&db, &b.endpoint(1), BindParams::default()).unwrap();
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    let alloc = Allocator::new(&da, MOVES, SIZE, PoolConstraints::default()).unwrap();
    assign_pair(&mut tx, &mut rx, &alloc);
    let reader = std::thread::spawn(move || {
        let mut kept = Vec::new();
        while (kept.len() as u64) < MOVES {
            match next(&mut rx) {
                Event::MoveReceived { buffer, .. } => kept.push(buffer),
                ev => panic!("reader: unexpected {ev:?}"),
            }
        }
        (rx, kept)
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut sent = 0;
    while sent < MOVES {
        assert!(Instant::now() < deadline, "{sent} of {MOVES} moves went: {:?}", a.stats());
        let buf = alloc.alloc().expect("a buffer per move");
        match tx.move_buffer(buf, &[]) {
            Ok(()) => sent += 1,
            Err(r) if r.error == ErrorKind::QueueFull => std::thread::sleep(Duration::from_millis(1)),
            Err(r) => panic!("move: {}", r.error),
        }
    }
    // What is still queued goes out as the channel waits for its close.
    while !reader.is_finished() {
        assert!(Instant::now() < deadline, "the last moves did not arrive: {:?}", a.stats());
        if let Ok(ev) = tx.wait(Some(Duration::from_millis(1))) {
            panic!("sender: unexpected {ev:?}");
        }
    }
    let (_rx, kept) = reader.join().unwrap();
    assert_eq!(kept.len() as u64, MOVES);
    assert!(a.stats().budget_holds > 0, "the budget never held anything: {:?}", a.stats());
}

// ------------------------------------------------------- setup edges

/// A bind that times out before anyone creates the channel does not hurt
/// the session: once the creator listens, the number is free again and a
/// new bind on it connects; a refused bind leaves the creator listening.
#[test]
fn a_bind_that_gave_up_or_was_refused_leaves_the_session_usable() {
    let (a, b) = session_pair(NetOptions::default());
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let quick = BindParams { timeout: Duration::from_millis(50), ..BindParams::default() };
    assert_eq!(Channel::connect(&db, &b.endpoint(5), quick, T).unwrap_err(), ErrorKind::TimedOut);
    let mut tx = Channel::create(&da, &a.endpoint(5), tx_setup()).unwrap();
    // A refused bind (a meta size the creator does not fit in).
    let setup = ChannelSetup { meta_size: 64, ..tx_setup() };
    let mut picky = Channel::create(&da, &a.endpoint(6), setup).unwrap();
    let small = BindParams { max_meta_size: 8, ..BindParams::default() };
    let deadline = Instant::now() + T;
    let refused = loop {
        let _ = tx.wait(Some(Duration::from_millis(5)));
        let _ = picky.wait(Some(Duration::from_millis(5)));
        match Channel::bind(&db, &b.endpoint(6), small) {
            Ok(mut ch) => {
                break loop {
                    // The creator's side answers when it polls.
                    let _ = picky.wait(Some(Duration::from_millis(5)));
                    match ch.wait(Some(Duration::from_millis(5))) {
                        Ok(Event::Error(e)) => break e,
                        Err(_) => assert!(Instant::now() < deadline, "no answer to the bind"),
                        Ok(ev) => panic!("refused bind: unexpected {ev:?}"),
                    }
                };
            }
            Err(err) if matches!(err.kind(), ErrorKind::EndpointInUse) => {
                assert!(Instant::now() < deadline, "number 6 never free")
            }
            Err(e) => panic!("bind: {e:?}"),
        }
    };
    assert!(matches!(refused.kind(), ErrorKind::BindRefused(_)), "{refused:?}");
    // Number 5 comes free once the creator's side has answered the give-up.
    let mut rx = loop {
        let _ = tx.wait(Some(Duration::from_millis(5)));
        let _ = picky.wait(Some(Duration::from_millis(5)));
        match Channel::bind(&db, &b.endpoint(5), BindParams::default()) {
            Ok(ch) => break ch,
            Err(err) if matches!(err.kind(), ErrorKind::EndpointInUse) => {
                assert!(Instant::now() < deadline, "number 5 never free")
            }
            Err(e) => panic!("bind: {e:?}"),
        }
    };
    let mut rx6 = loop {
        let _ = picky.wait(Some(Duration::from_millis(5)));
        match Channel::bind(&db, &b.endpoint(6), BindParams::default()) {
            Ok(ch) => break ch,
            Err(err) if matches!(err.kind(), ErrorKind::EndpointInUse) => {
                assert!(Instant::now() < deadline, "number 6 never free")
            }
            Err(e) => panic!("bind: {e:?}"),
        }
    };
    tx.wait_connected(T).unwrap();
    rx.wait_connected(T).unwrap();
    picky.wait_connected(T).unwrap();
    rx6.wait_connected(T).unwrap();
    let alloc = Allocator::new(&da, 2, SIZE, PoolConstraints::default()).unwrap();
    assign_pair(&mut tx, &mut rx, &alloc);
    let mut buf = alloc.alloc().unwrap();
    fill(buf.as_mut_slice().unwrap(), 3);
    tx.move_buffer(buf, &3u64.to_le_bytes()).unwrap();
    match next(&mut rx) {
        Event::MoveReceived { buffer, .. } => assert!(check(&buffer, 3)),
        ev => panic!("unexpected {ev:?}"),
    }
}

/// Sessions with different peer timeouts: the end with the long one sends
/// its keep-alives often enough for the short one (the hellos carry both),
/// so an idle session stays up on both ends for several of the short
/// timeouts, and data still flows after.
#[test]
fn session_keepalives_follow_the_shorter_peer_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let long = std::thread::spawn(move || MuxSession::connect(addr, NetOptions::default(), T).unwrap());
    let short = MuxSession::accept(&listener, NetOptions::with_peer_timeout(Duration::from_secs(1)), T).unwrap();
    let long = long.join().unwrap();
    let (a, b) = (Domain::new("short timeout"), Domain::new("long timeout"));
    let (mut txs, mut rxs) = open_channels(&short, &long, 1, &a, &b);
    let (mut tx, mut rx) = (txs.remove(0), rxs.remove(0));
    let alloc = Allocator::new(&a, 2, SIZE, PoolConstraints::default()).unwrap();
    assign_pair(&mut tx, &mut rx, &alloc);
    idle_then_move(&mut tx, rx, &alloc, Duration::from_secs(3));
}

/// A channel whose queue is full sleeps on its fd until room comes. When
/// another channel of the same session reads the peer's credit off the
/// socket (another thread's event loop, say), the full channel's fd must
/// become readable: the socket will not say so again.
#[test]
fn credit_read_by_another_channel_wakes_a_channel_waiting_for_room() {
    use std::os::fd::AsFd;
    const DEPTH: u32 = 4;
    // Keep-alive timers far away: only the credit may wake the channel.
    let (sa, sb) = session_pair(NetOptions::with_peer_timeout(Duration::from_secs(120)));
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup { queue_depth: DEPTH, ..tx_setup() };
    let mut full = Channel::create(&a, &sa.endpoint(1), setup).unwrap();
    let mut other = Channel::create(&a, &sa.endpoint(2), tx_setup()).unwrap();
    let mut sink = Channel::bind(&b, &sb.endpoint(1), BindParams::default()).unwrap();
    let mut other_peer = Channel::bind(&b, &sb.endpoint(2), BindParams::default()).unwrap();
    for ch in [&mut full, &mut other, &mut sink, &mut other_peer] {
        ch.wait_connected(T).unwrap();
    }
    let alloc = Allocator::new(&a, 64, 4096, PoolConstraints::default()).unwrap();
    assign_pair(&mut full, &mut sink, &alloc);

    // Fill the queue until the channel refuses, then sleep on its fd.
    let mut sent = 0u64;
    loop {
        let mut buf = alloc.alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), sent);
        match full.move_buffer(buf, &sent.to_le_bytes()) {
            Ok(()) => sent += 1,
            Err(r) if r.error == ErrorKind::QueueFull => break,
            Err(r) => panic!("move {sent}: {:?}", r.error),
        }
        full.flush().unwrap();
    }
    assert!(sent >= u64::from(DEPTH), "only {sent} moves fit");
    assert!(full.arm(), "nothing should be due on the full channel yet");

    // The sink takes what came (what the channel had credit for), granting
    // credit as it goes; the rest waits in the full channel's queue.
    let mut held = Vec::new();
    while let Ok(ev) = sink.wait(Some(Duration::from_millis(300))) {
        match ev {
            Event::MoveReceived { buffer, meta } => {
                assert!(check(&buffer, u64::from_le_bytes(meta[..8].try_into().unwrap())));
                held.push(buffer);
            }
            ev => panic!("unexpected {ev:?}"),
        }
    }
    assert!(held.len() >= DEPTH as usize / 4, "only {} moves came", held.len());
    sink.flush().unwrap();
    // The other channel reads everything the sink's session sent, the
    // credit among it.
    let deadline = Instant::now() + T;
    while sa.stats().bytes_received < sb.stats().bytes_sent {
        assert!(other.poll().is_none());
        assert!(Instant::now() < deadline, "the credit never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(support::readable(full.as_fd(), T), "the full channel's fd stayed quiet although its credit had come");
    // And the channel sends again: the rest, then one more, all arrive.
    assert!(full.poll().is_none());
    let mut buf = alloc.alloc().unwrap();
    fill(buf.as_mut_slice().unwrap(), sent);
    full.move_buffer(buf, &sent.to_le_bytes()).expect("room after the credit");
    full.flush().unwrap();
    let pump = std::thread::spawn(move || {
        // The full channel's session writes when polled.
        while full.wait(Some(Duration::from_millis(50))).is_err() && full.state() == ferry::ChannelState::Connected {
            if full.flush().is_err() {
                break;
            }
        }
    });
    while (held.len() as u64) <= sent {
        match next(&mut sink) {
            Event::MoveReceived { buffer, meta } => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert_eq!(seq, held.len() as u64, "in order");
                assert!(check(&buffer, seq));
                held.push(buffer);
            }
            ev => panic!("unexpected {ev:?}"),
        }
    }
    sink.teardown().unwrap();
    pump.join().unwrap();
}

/// A peer that opens a channel and then says nothing (no keep-alives):
/// the channel fails with `PeerUnresponsive` after the peer timeout, while
/// our own keep-alives go out meanwhile.
#[test]
fn a_silent_peer_is_unresponsive() {
    use std::io::Read;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let raw = std::thread::spawn(move || raw_open(addr, &[1]));
    let options = NetOptions::with_peer_timeout(Duration::from_millis(400));
    let session = MuxSession::accept(&listener, options, T).unwrap();
    let mut ch = Channel::accept(&Domain::new("d"), &session.endpoint(1), ChannelSetup::default(), T).unwrap();
    let mut s = raw.join().unwrap();
    match next(&mut ch) {
        Event::Error(err) if matches!(err.kind(), ErrorKind::PeerUnresponsive(_)) => {}
        ev => panic!("expected an unresponsive peer, got {ev:?}"),
    }
    // What we sent: the open reply, keep-alives (kind 7), and nothing after
    // the connection ended.
    s.set_read_timeout(Some(T)).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let (mut at, mut keepalives) = (0, 0);
    while at + 16 <= got.len() {
        let h = &got[at..at + 16];
        keepalives += usize::from(h[0] == 7 && h[4..8] == [0, 0, 0, 0]);
        at += 16 + u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
    }
    assert!(keepalives >= 1, "no keep-alive in {got:?}");
}

/// A copy that reaches a domain over a session while the domain already
/// reads the buffer through another channel lands nowhere (the bytes are
/// the ones it has). Once it has released both copies, the session's
/// sender, which has not yet seen the release, sends the next copy without
/// payload: the receiver must take the bytes it already has rather than
/// call the copy a protocol error.
#[test]
fn a_copy_resent_without_payload_after_one_that_was_already_here() {
    let (a, b, c) = (Domain::new("a"), Domain::new("b"), Domain::new("c"));
    let alloc = Allocator::new(&a, 4, SIZE, PoolConstraints::default()).unwrap();
    let local = |from: &Domain, to: &Domain| {
        let ep = Endpoint::local();
        let mut tx = Channel::create(from, &ep, tx_setup()).unwrap();
        let mut rx = Channel::bind(to, &ep, BindParams::default()).unwrap();
        tx.wait_connected(T).unwrap();
        rx.wait_connected(T).unwrap();
        (tx, rx)
    };
    let (mut a_b, mut b_a) = local(&a, &b);
    let (sb, sc) = session_pair(NetOptions::default());
    let (mut b_cs, mut c_bs) = open_channels(&sb, &sc, 1, &b, &c);
    let (mut b_c, mut c_b) = (b_cs.remove(0), c_bs.remove(0));
    let (mut a_c, mut c_a) = local(&a, &c);
    // C gets the pool over the session first (memory of its own), then over
    // the local channel, which therefore carries the bytes into C's memory.
    offer_pool(&mut a_b, &mut b_a, alloc.pool());
    offer_pool(&mut b_c, &mut c_b, &b.pool(alloc.pool().id()).unwrap());
    offer_pool(&mut a_c, &mut c_a, alloc.pool());
    let mut t = Triangle { a_b, b_a, b_c, c_b, a_c, c_a };
    copy_resent_after_a_discarded_one(&alloc, &mut t);
}

/// A channel woken by its own message, which it then reads itself, leaves
/// no doorbell ringing: once `poll` has taken everything and says `None`,
/// its fd is quiet (a rung doorbell would cost an eventfd write on the
/// way in and a read at the next `arm`, and wake a `Selector` for
/// nothing). Round trip after round trip, both ends.
#[test]
fn a_channel_that_reads_its_own_message_rings_no_doorbell() {
    use std::os::fd::AsFd;
    // Keep-alive timers far away: only the messages may wake a channel.
    let (sa, sb) = session_pair(NetOptions::with_peer_timeout(Duration::from_secs(120)));
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let (mut txs, mut rxs) = open_channels(&sa, &sb, 1, &da, &db);
    let (mut tx, mut rx) = (txs.pop().unwrap(), rxs.pop().unwrap());
    rx.set_pool_policy(ferry::PoolPolicy::AcceptAll);
    let alloc = Allocator::new(&da, 8, 4096, PoolConstraints::default()).unwrap();
    assign_pair(&mut tx, &mut rx, &alloc);
    // Whatever setup left on both ends is taken before the round trips.
    for ch in [&mut tx, &mut rx] {
        while ch.poll().is_some() {}
    }
    /// Sleep on `ch`'s fd until it wakes, take its one event, and check
    /// that the fd is quiet after `poll` said `None`.
    fn take(ch: &mut Channel, who: &str, round: u64) -> Event {
        assert!(ch.arm(), "{who}, round {round}: nothing should be due before the peer sends");
        assert!(support::readable(ch.as_fd(), T), "{who}, round {round}: no wake-up");
        let ev = ch.poll().unwrap_or_else(|| panic!("{who}, round {round}: woken for nothing"));
        assert!(ch.poll().is_none(), "{who}, round {round}: one event at a time");
        assert!(
            !support::readable(ch.as_fd(), Duration::ZERO),
            "{who}, round {round}: the fd stays readable after the channel read its own message (its doorbell rang)"
        );
        ev
    }
    for round in 0..20u64 {
        let mut buf = alloc.alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), round);
        tx.move_buffer(buf, &round.to_le_bytes()).unwrap();
        tx.flush().unwrap();
        let buffer = match take(&mut rx, "receiver", round) {
            Event::MoveReceived { buffer, meta } => {
                assert_eq!(seq_of(&meta), round);
                assert!(check(&buffer, round));
                buffer
            }
            ev => panic!("receiver: unexpected {ev:?}"),
        };
        rx.pass(buffer, &round.to_le_bytes()).unwrap();
        rx.flush().unwrap();
        match take(&mut tx, "sender", round) {
            Event::BufferPassed { buffer, .. } => drop(buffer),
            ev => panic!("sender: unexpected {ev:?}"),
        }
    }
    assert_eq!(alloc.available(), 8);
}

/// A channel armed and then polled again without arming (as a `Selector`
/// spinning over every channel does) stays armed: when another channel of
/// the session reads its message off the socket, its fd becomes readable
/// (the socket, drained by the other channel, will not say so).
#[test]
fn a_channel_polled_after_arming_is_still_rung_by_another_channels_read() {
    use std::os::fd::AsFd;
    // Keep-alive timers far away: only the doorbell may wake the channel.
    let (sa, sb) = session_pair(NetOptions::with_peer_timeout(Duration::from_secs(120)));
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let (mut txs, mut rxs) = open_channels(&sa, &sb, 2, &da, &db);
    let (mut armed, mut other) = (rxs.remove(0), rxs.remove(0));
    armed.set_pool_policy(ferry::PoolPolicy::AcceptAll);
    let alloc = Allocator::new(&da, 4, 4096, PoolConstraints::default()).unwrap();
    assign_pair(&mut txs[0], &mut armed, &alloc);
    for ch in txs.iter_mut().chain([&mut armed, &mut other]) {
        while ch.poll().is_some() {}
    }
    assert!(armed.arm(), "nothing should be due yet");
    assert!(armed.poll().is_none());
    let mut buf = alloc.alloc().unwrap();
    fill(buf.as_mut_slice().unwrap(), 7);
    txs[0].move_buffer(buf, &7u64.to_le_bytes()).unwrap();
    txs[0].flush().unwrap();
    // The other channel reads everything the sender's session wrote.
    let deadline = Instant::now() + T;
    while sb.stats().bytes_received < sa.stats().bytes_sent {
        assert!(other.poll().is_none());
        assert!(Instant::now() < deadline, "the move never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(support::readable(armed.as_fd(), T), "the armed channel's fd stayed quiet although its message had come");
    match armed.poll() {
        Some(Event::MoveReceived { buffer, meta }) => {
            assert_eq!(seq_of(&meta), 7);
            assert!(check(&buffer, 7));
        }
        ev => panic!("unexpected {ev:?}"),
    }
}

/// The credit a receiver gives back for the messages it took goes out
/// with what it sends next (here its pass back), not in a write of its
/// own: one system call and one wake-up of the peer per round trip, as on
/// a connection of its own. A receiver that sends nothing still gives it
/// back the next time it polls and finds nothing.
#[test]
fn credit_goes_out_with_the_next_write() {
    // Depth 8: a grant every 2 messages taken.
    let (sa, sb) = session_pair(NetOptions::with_peer_timeout(Duration::from_secs(120)));
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup { queue_depth: 8, ..tx_setup() };
    let mut tx = Channel::create(&da, &sa.endpoint(1), setup).unwrap();
    let mut rx = Channel::bind(&db, &sb.endpoint(1), BindParams::default()).unwrap();
    for ch in [&mut tx, &mut rx] {
        ch.wait_connected(T).unwrap();
    }
    rx.set_pool_policy(ferry::PoolPolicy::AcceptAll);
    let alloc = Allocator::new(&da, 8, 4096, PoolConstraints::default()).unwrap();
    assign_pair(&mut tx, &mut rx, &alloc);
    for ch in [&mut tx, &mut rx] {
        while ch.poll().is_some() {}
    }
    let mut kept = Vec::new();
    let mut alone = 0;
    for seq in 0..8u64 {
        let mut buf = alloc.alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), seq);
        tx.move_buffer(buf, &seq.to_le_bytes()).unwrap();
        tx.flush().unwrap();
        // Polls that find nothing write nothing either (nothing is due).
        let before = sb.stats().bytes_sent;
        let deadline = Instant::now() + T;
        let buffer = loop {
            match rx.poll() {
                Some(Event::MoveReceived { buffer, meta }) => {
                    assert_eq!(seq_of(&meta), seq);
                    break buffer;
                }
                Some(ev) => panic!("message {seq}: unexpected {ev:?}"),
                None => {
                    assert!(Instant::now() < deadline, "message {seq} never arrived");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        };
        assert_eq!(sb.stats().bytes_sent, before, "message {seq}: taking it wrote a grant on its own");
        if seq < 6 {
            rx.pass(buffer, &seq.to_le_bytes()).unwrap();
            assert!(sb.stats().bytes_sent > before, "message {seq}: the pass was not written");
            match next(&mut tx) {
                Event::BufferPassed { buffer, .. } => drop(buffer),
                ev => panic!("unexpected {ev:?}"),
            }
        } else {
            // Kept: the receiver sends nothing; its next empty poll writes.
            kept.push(buffer);
            assert!(rx.poll().is_none());
            alone += sb.stats().bytes_sent - before;
        }
    }
    assert_eq!(alone, 16, "the grant for the two kept messages, one frame on its own");
    drop(kept);
}

/// A receiver that takes message after message and writes nothing (a sink
/// that keeps what it gets) does not keep its credit back until it runs
/// dry: a grant waits behind no other, so the peer is at most one grant
/// short and keeps sending.
#[test]
fn a_receiver_that_never_writes_gives_credit_back_as_it_takes() {
    const DEPTH: u64 = 8;
    let (sa, sb) = session_pair(NetOptions::with_peer_timeout(Duration::from_secs(120)));
    let (da, db) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup { queue_depth: DEPTH as u32, ..tx_setup() };
    let mut tx = Channel::create(&da, &sa.endpoint(1), setup).unwrap();
    let mut rx = Channel::bind(&db, &sb.endpoint(1), BindParams::default()).unwrap();
    for ch in [&mut tx, &mut rx] {
        ch.wait_connected(T).unwrap();
    }
    rx.set_pool_policy(ferry::PoolPolicy::AcceptAll);
    let alloc = Allocator::new(&da, DEPTH, 4096, PoolConstraints::default()).unwrap();
    assign_pair(&mut tx, &mut rx, &alloc);
    for ch in [&mut tx, &mut rx] {
        while ch.poll().is_some() {}
    }
    // All the sender's credit on the wire at once.
    for seq in 0..DEPTH {
        let mut buf = alloc.alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), seq);
        tx.move_buffer(buf, &seq.to_le_bytes()).unwrap();
    }
    tx.flush().unwrap();
    let before = sb.stats().bytes_sent;
    let mut kept = Vec::new();
    let deadline = Instant::now() + T;
    // The channel's setup took some of the first credit: six are surely
    // on the wire.
    while kept.len() < 6 {
        match rx.poll() {
            Some(Event::MoveReceived { buffer, meta }) => {
                assert_eq!(seq_of(&meta), kept.len() as u64);
                kept.push(buffer);
            }
            Some(ev) => panic!("unexpected {ev:?}"),
            None => {
                // Only before the first message: the sender wrote all of
                // them at once, on loopback they are all there together.
                assert!(kept.is_empty(), "the receiver ran dry after {} messages", kept.len());
                assert!(Instant::now() < deadline, "no message within {T:?}");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    let granted = sb.stats().bytes_sent - before;
    assert!(granted > 0, "the receiver took 6 messages and gave no credit back");
    assert!(granted <= 2 * 16, "{granted} bytes of grants for 6 messages: not merged");
    // The rest come with the credit (the sender's session writes when its
    // channel is polled).
    while kept.len() < DEPTH as usize {
        assert!(tx.poll().is_none());
        match rx.wait(Some(Duration::from_millis(5))) {
            Ok(Event::MoveReceived { buffer, meta }) => {
                assert_eq!(seq_of(&meta), kept.len() as u64);
                kept.push(buffer);
            }
            Ok(ev) => panic!("unexpected {ev:?}"),
            Err(_) => assert!(Instant::now() < deadline, "the last moves never came"),
        }
    }
    drop(kept);
}
