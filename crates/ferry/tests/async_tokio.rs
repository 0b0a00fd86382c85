//! `ferry::tokio::AsyncChannel` on tokio's multi-threaded runtime: many
//! channels with a task each, a peer in another process (shared memory and
//! TCP; the test binary runs itself again as the peer, `async_child`),
//! cancellation in `tokio::select!`, full queues, and a peer killed while a
//! task waits. Every wait is bounded by `tokio::time::timeout`.
#![cfg(feature = "tokio")]

mod support;

use std::future::{poll_fn, Future};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use ferry::tokio::AsyncChannel;
use ferry::{
    Allocator, BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, ErrorKind, Event, PoolConstraints,
    PoolPolicy, Role,
};
use support::payload::{check, fill};
use tokio::time::timeout;

/// The bound of every wait in these tests.
const T: Duration = Duration::from_secs(30);
const SIZE: usize = 4096;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn seq_of(meta: &[u8]) -> u64 {
    u64::from_le_bytes(meta[..8].try_into().unwrap())
}

/// A connected local pair, both ends wrapped (call inside a runtime):
/// `tx` a transmit master with `alloc`'s pool assigned, `rx` accepting pools.
async fn local_pair(a: &Domain, b: &Domain, alloc: &Allocator, depth: u32) -> (AsyncChannel, AsyncChannel) {
    let ep = Endpoint::local();
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, queue_depth: depth, ..Default::default() };
    let mut tx = AsyncChannel::new(Channel::create(a, &ep, setup).unwrap()).unwrap();
    let mut rx = AsyncChannel::new(Channel::bind(b, &ep, BindParams::default()).unwrap()).unwrap();
    rx.get_mut().set_pool_policy(PoolPolicy::AcceptAndReport);
    timeout(T, tx.wait_connected()).await.unwrap().unwrap();
    timeout(T, rx.wait_connected()).await.unwrap().unwrap();
    // The sink must run for the answer to go out: it waits in its own task.
    let sink = tokio::spawn(async move {
        let ev = rx.next_event().await;
        assert!(matches!(ev, Some(Event::PoolAssignRequest(_))), "{ev:?}");
        rx
    });
    timeout(T, tx.assign_pool_and_wait(alloc.pool())).await.unwrap().unwrap();
    let rx = timeout(T, sink).await.unwrap().unwrap();
    (tx, rx)
}

/// The sink's side of the echo: verify each moved buffer (pattern of its
/// sequence number), write the pattern of `seq + 1`, pass it back, until
/// the channel closes. Returns how many it echoed.
async fn echo(mut rx: AsyncChannel) -> u64 {
    let mut n = 0;
    while let Some(ev) = rx.next_event().await {
        match ev {
            Event::MoveReceived { mut buffer, meta } => {
                let seq = seq_of(&meta);
                assert!(check(&buffer, seq), "sink: buffer {seq} arrived corrupted");
                fill(buffer.as_mut_slice().unwrap(), seq + 1);
                rx.pass(buffer, &meta).await.unwrap();
                n += 1;
            }
            Event::Closed { .. } => break,
            ev => panic!("sink: unexpected {ev:?}"),
        }
    }
    n
}

/// The source's side: `rounds` round trips, `inflight` buffers out at a
/// time, each checked when it comes back (the sink wrote `seq + 1`); then a
/// teardown. Returns the number of round trips.
async fn ping_pong(tx: &mut AsyncChannel, alloc: &Allocator, rounds: u64, inflight: u64) -> u64 {
    let (mut sent, mut back) = (0u64, 0u64);
    while back < rounds {
        while sent < rounds && sent - back < inflight {
            let mut b = alloc.alloc().expect("a free buffer");
            fill(b.as_mut_slice().unwrap(), sent);
            tx.move_buffer(b, &sent.to_le_bytes()).await.unwrap();
            sent += 1;
        }
        match tx.next_event().await {
            Some(Event::BufferPassed { buffer, meta }) => {
                let seq = seq_of(&meta);
                assert_eq!(seq, back, "passes come back in order");
                assert!(check(&buffer, seq + 1), "buffer {seq} came back with the wrong bytes");
                back += 1;
            }
            ev => panic!("source: unexpected {ev:?} (state {:?})", tx.get_ref().state()),
        }
    }
    tx.teardown().await.unwrap();
    let ev = tx.next_event().await;
    assert!(matches!(ev, Some(Event::Closed { by_peer: false })), "source: expected the close, got {ev:?}");
    assert!(tx.next_event().await.is_none(), "a closed channel has no more events");
    back
}

/// 32 local channels, each end a task of its own on a two-thread runtime
/// (a few of them spinning before they wait): every round trip of every
/// channel is checked byte by byte.
#[test]
fn many_local_channels_one_task_each() {
    const CHANNELS: usize = 32;
    const ROUNDS: u64 = 300;
    runtime().block_on(async {
        let mut tasks = Vec::new();
        for i in 0..CHANNELS {
            let (a, b) = (Domain::new(&format!("src{i}")), Domain::new(&format!("sink{i}")));
            let alloc = Allocator::new(&a, 8, SIZE, PoolConstraints::default()).unwrap();
            let (mut tx, mut rx) = local_pair(&a, &b, &alloc, 8).await;
            // A few channels busy-poll a little before they wait.
            if i % 8 == 1 {
                tx.set_spin(ferry::DEFAULT_SPIN);
                rx.set_spin(ferry::DEFAULT_SPIN);
            }
            let sink = tokio::spawn(echo(rx));
            let source = tokio::spawn(async move {
                // Some channels one buffer at a time, others pipelined.
                let n = ping_pong(&mut tx, &alloc, ROUNDS, 1 + (i as u64 % 8)).await;
                assert_eq!(alloc.available(), 8, "channel {i}: every buffer is back");
                n
            });
            tasks.push((source, sink));
        }
        for (i, (source, sink)) in tasks.into_iter().enumerate() {
            assert_eq!(timeout(T, source).await.unwrap().unwrap(), ROUNDS, "channel {i}");
            assert_eq!(timeout(T, sink).await.unwrap().unwrap(), ROUNDS, "channel {i}");
        }
    });
}

/// `next_event` cancelled over and over by a timer in `tokio::select!`
/// while a sender thread moves buffers: every buffer arrives once, in
/// order, intact — a cancelled wait took nothing.
#[test]
fn cancelled_next_event_loses_nothing() {
    const TOTAL: u64 = 3000;
    let (a, b) = (Domain::new("sender"), Domain::new("receiver"));
    let ep = Endpoint::local();
    let sender = {
        let ep = ep.clone();
        std::thread::spawn(move || {
            let mut tx = Channel::accept(&a, &ep, ChannelSetup::default(), T).unwrap();
            let alloc = Allocator::new(&a, 16, SIZE, PoolConstraints::default()).unwrap();
            tx.assign_pool_and_wait(alloc.pool(), T).unwrap();
            let mut sent = 0u64;
            while sent < TOTAL {
                if let Some(mut buf) = alloc.alloc() {
                    fill(buf.as_mut_slice().unwrap(), sent);
                    match tx.move_buffer(buf, &sent.to_le_bytes()) {
                        Ok(()) => sent += 1,
                        Err(r) if r.error == ErrorKind::QueueFull => drop(r),
                        Err(r) => panic!("sender: {}", r.error),
                    }
                    // Pauses now and then, so that the receiver's timer
                    // fires while it waits.
                    if sent % 64 == 0 {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    continue;
                }
                match tx.wait(Some(T)) {
                    Ok(Event::BufferPassed { .. }) => {}
                    ev => panic!("sender: unexpected {ev:?}"),
                }
            }
            tx.teardown().unwrap();
            loop {
                match tx.wait(Some(T)) {
                    Ok(Event::Closed { .. }) => break,
                    Ok(Event::BufferPassed { .. }) => {}
                    ev => panic!("sender: unexpected {ev:?}"),
                }
            }
        })
    };
    let (received, cancelled) = runtime().block_on(async {
        let rx = Channel::connect(&b, &ep, BindParams::default(), T).unwrap();
        let mut rx = AsyncChannel::new(rx).unwrap();
        rx.get_mut().set_pool_policy(PoolPolicy::AcceptAll);
        let (mut received, mut cancelled) = (0u64, 0u64);
        let work = async {
            loop {
                tokio::select! {
                    biased;
                    ev = rx.next_event() => match ev {
                        Some(Event::MoveReceived { buffer, meta }) => {
                            let seq = seq_of(&meta);
                            assert_eq!(seq, received, "moves arrive once each, in order");
                            assert!(check(&buffer, seq), "buffer {seq} corrupted");
                            received += 1;
                            rx.pass(buffer, &[]).await.unwrap();
                        }
                        Some(Event::PoolAssignRequest(_)) => {}
                        Some(Event::Closed { .. }) => break,
                        ev => panic!("receiver: unexpected {ev:?}"),
                    },
                    _ = tokio::time::sleep(Duration::from_micros(100)) => cancelled += 1,
                }
            }
        };
        timeout(T, work).await.expect("the receiver finished in time");
        (received, cancelled)
    });
    sender.join().unwrap();
    assert_eq!(received, TOTAL);
    println!("{received} moves received, next_event cancelled {cancelled} times");
}

/// A queue of depth 2 that the peer does not empty: the async move waits
/// (its future stays pending) and completes once the peer starts taking;
/// the passes that arrive while the source waits for room are kept and
/// come out of `next_event`, none lost.
#[test]
fn a_full_queue_waits_for_room() {
    const TOTAL: u64 = 64;
    runtime().block_on(async {
        let (a, b) = (Domain::new("src"), Domain::new("sink"));
        let alloc = Allocator::new(&a, TOTAL, SIZE, PoolConstraints::default()).unwrap();
        let (mut tx, rx) = local_pair(&a, &b, &alloc, 2).await;
        let mut queued = 0u64;
        // Fill the queue with the blocking API until it says so.
        loop {
            let mut buf = alloc.alloc().unwrap();
            fill(buf.as_mut_slice().unwrap(), queued);
            match tx.get_mut().move_buffer(buf, &queued.to_le_bytes()) {
                Ok(()) => queued += 1,
                Err(r) if r.error == ErrorKind::QueueFull => break,
                Err(r) => panic!("{}", r.error),
            }
        }
        assert_eq!(queued, 2, "queue depth 2");
        // The async move of the next one: pending while nobody takes.
        let mut buf = alloc.alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), queued);
        let meta = queued.to_le_bytes();
        let sink = {
            let fut = tx.move_buffer(buf, &meta);
            tokio::pin!(fut);
            let first = poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
            assert!(first.is_pending(), "a full queue makes the move wait");
            // The sink starts taking (and passing back: our incoming queue
            // of depth 2 fills while we wait for room).
            let sink = tokio::spawn(echo(rx));
            timeout(T, fut).await.expect("the move completes once the peer takes").unwrap();
            sink
        };
        queued += 1;
        while queued < TOTAL {
            let mut buf = alloc.alloc().unwrap();
            fill(buf.as_mut_slice().unwrap(), queued);
            timeout(T, tx.move_buffer(buf, &queued.to_le_bytes())).await.unwrap().unwrap();
            queued += 1;
        }
        // Every pass is there, in order, the held ones first.
        for want in 0..TOTAL {
            match timeout(T, tx.next_event()).await.unwrap() {
                Some(Event::BufferPassed { buffer, meta }) => {
                    assert_eq!(seq_of(&meta), want);
                    assert!(check(&buffer, want + 1));
                }
                ev => panic!("expected pass {want}, got {ev:?}"),
            }
        }
        timeout(T, tx.teardown()).await.unwrap().unwrap();
        assert!(matches!(timeout(T, tx.next_event()).await.unwrap(), Some(Event::Closed { .. })));
        assert_eq!(timeout(T, sink).await.unwrap().unwrap(), TOTAL);
        assert_eq!(alloc.available(), TOTAL as usize);
    });
}

/// Both queues full at once: the source moves without reading, the sink
/// passes each buffer back as it arrives. Each waits for room in its own
/// outgoing queue, which only the other empties: the waits take the
/// arrivals in the way (kept for `next_event`), so neither blocks the other.
#[test]
fn both_ends_waiting_for_room_do_not_block_each_other() {
    const TOTAL: u64 = 200;
    runtime().block_on(async {
        let (a, b) = (Domain::new("src"), Domain::new("sink"));
        let alloc = Allocator::new(&a, TOTAL, SIZE, PoolConstraints::default()).unwrap();
        let (mut tx, rx) = local_pair(&a, &b, &alloc, 2).await;
        let sink = tokio::spawn(echo(rx));
        let source = async {
            for seq in 0..TOTAL {
                let mut buf = alloc.alloc().unwrap();
                fill(buf.as_mut_slice().unwrap(), seq);
                tx.move_buffer(buf, &seq.to_le_bytes()).await.unwrap();
            }
            for want in 0..TOTAL {
                match tx.next_event().await {
                    Some(Event::BufferPassed { buffer, meta }) => {
                        assert_eq!(seq_of(&meta), want);
                        assert!(check(&buffer, want + 1));
                    }
                    ev => panic!("expected pass {want}, got {ev:?}"),
                }
            }
            tx.teardown().await.unwrap();
            assert!(matches!(tx.next_event().await, Some(Event::Closed { .. })));
        };
        timeout(T, source).await.expect("no end blocks the other");
        assert_eq!(timeout(T, sink).await.unwrap().unwrap(), TOTAL);
    });
}

/// Outside a runtime: refused with a typed error, the channel handed back.
#[test]
fn wrapping_outside_a_runtime_is_refused() {
    let ch = Channel::create(&Domain::new("d"), &Endpoint::local(), ChannelSetup::default()).unwrap();
    let refused = AsyncChannel::new(ch).unwrap_err();
    assert!(matches!(refused.error.kind(), ErrorKind::InvalidArgument(_)), "{:?}", refused.error);
    let ch = refused.into_inner();
    assert_eq!(ch.state(), ferry::ChannelState::Initialized);
}

// ------------------------------------------------------------ other processes

/// Start this test binary as the peer process: `role` on endpoint `ep`
/// (`shm:NAME` or `tcp:ADDR`).
fn spawn_child(role: &str, ep: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "async_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("FERRY_ASYNC_ROLE", role)
        .env("FERRY_ASYNC_EP", ep)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn child")
}

fn endpoint_of(spec: &str) -> Endpoint {
    match spec.split_once(':') {
        Some(("shm", name)) => Endpoint::shm_abstract(name),
        Some(("tcp", addr)) => Endpoint::tcp(addr.parse().unwrap()),
        _ => panic!("bad endpoint {spec}"),
    }
}

/// The peer process, with the blocking API. Roles: `echo` (verify every
/// moved buffer, write the pattern of `seq + 1`, pass it back, until the
/// close), `hold` (keep what arrives, then wait to be killed).
#[test]
#[ignore = "run as a child process by the other tests"]
fn async_child() {
    let (Ok(role), Ok(ep)) = (std::env::var("FERRY_ASYNC_ROLE"), std::env::var("FERRY_ASYNC_EP")) else { return };
    let domain = Domain::new("child");
    let mut ch = Channel::connect(&domain, &endpoint_of(&ep), BindParams::default(), T).expect("connect");
    ch.set_pool_policy(PoolPolicy::AcceptAll);
    let mut kept = Vec::new();
    loop {
        match ch.wait(Some(Duration::from_secs(60))) {
            Ok(Event::PoolAssignRequest(_)) => {}
            Ok(Event::MoveReceived { mut buffer, meta }) => {
                let seq = seq_of(&meta);
                assert!(check(&buffer, seq), "child: buffer {seq} arrived corrupted");
                if role == "hold" {
                    kept.push(buffer);
                    continue;
                }
                fill(buffer.as_mut_slice().unwrap(), seq + 1);
                ch.pass(buffer, &meta).unwrap();
            }
            Ok(Event::Closed { .. }) | Err(_) => break,
            Ok(ev) => panic!("child: unexpected {ev:?}"),
        }
    }
    drop(kept);
}

/// Create a transmit master on `kind` (`shm` or `tcp`), start the child
/// with `role`, and wrap, connect and assign a pool of `alloc` (inside a
/// runtime).
async fn start_with_child(d: &Domain, alloc: &Allocator, kind: &str, role: &str) -> (AsyncChannel, Child) {
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, ..Default::default() };
    let (ch, spec) = if kind == "shm" {
        let name = support::unique_name("async");
        (Channel::create(d, &Endpoint::shm_abstract(&name), setup).unwrap(), format!("shm:{name}"))
    } else {
        let ch = Channel::create(d, &Endpoint::tcp("127.0.0.1:0".parse().unwrap()), setup).unwrap();
        let addr = ch.listen_addr().unwrap();
        (ch, format!("tcp:{addr}"))
    };
    let mut ch = AsyncChannel::new(ch).unwrap();
    let child = spawn_child(role, &spec);
    timeout(T, ch.wait_connected()).await.expect("the child binds in time").unwrap();
    timeout(T, ch.assign_pool_and_wait(alloc.pool())).await.unwrap().unwrap();
    (ch, child)
}

fn echo_with_a_process(kind: &str) {
    const ROUNDS: u64 = 2000;
    runtime().block_on(async {
        let d = Domain::new("parent");
        let alloc = Allocator::new(&d, 16, 64 << 10, PoolConstraints::default()).unwrap();
        let (mut ch, mut child) = start_with_child(&d, &alloc, kind, "echo").await;
        let n = timeout(T, ping_pong(&mut ch, &alloc, ROUNDS, 16)).await.expect("the round trips end in time");
        assert_eq!(n, ROUNDS);
        assert_eq!(alloc.available(), 16);
        assert!(support::payload::wait_exit(&mut child, T).success());
    });
}

/// Round trips with a process over shared memory, every byte checked at
/// both ends.
#[test]
fn echo_with_a_process_over_shm() {
    echo_with_a_process("shm");
}

/// The same over TCP on loopback.
#[test]
fn echo_with_a_process_over_tcp() {
    echo_with_a_process("tcp");
}

/// A task awaits `next_event` while the peer process holds our buffers;
/// the peer is killed (SIGKILL): the future resolves with the error event
/// (never a wait that does not end), the buffers come back, and the
/// channel is closed (`None`).
fn killed_peer(kind: &str) {
    runtime().block_on(async {
        let d = Domain::new("parent");
        let alloc = Arc::new(Allocator::new(&d, 4, SIZE, PoolConstraints::default()).unwrap());
        let (mut ch, mut child) = start_with_child(&d, &alloc, kind, "hold").await;
        for seq in 0..4u64 {
            let mut buf = alloc.alloc().unwrap();
            fill(buf.as_mut_slice().unwrap(), seq);
            ch.move_buffer(buf, &seq.to_le_bytes()).await.unwrap();
        }
        let waiter = tokio::spawn(async move {
            let ev = ch.next_event().await;
            (ev, ch)
        });
        // The task is waiting (nothing comes from a peer that holds
        // everything); now the peer dies.
        tokio::task::yield_now().await;
        child.kill().unwrap();
        let (ev, mut ch) = timeout(T, waiter).await.expect("the wait ends when the peer dies").unwrap();
        match ev {
            Some(Event::Error(err)) if matches!(err.kind(), ErrorKind::PeerGone | ErrorKind::PeerUnresponsive(_)) => {}
            ev => panic!("expected the peer's death, got {ev:?}"),
        }
        assert!(timeout(T, ch.next_event()).await.unwrap().is_none(), "closed");
        assert_eq!(alloc.available(), 4, "the buffers lent to the dead peer are back");
        let _ = child.wait();
    });
}

/// Over shared memory.
#[test]
fn killed_peer_ends_the_wait_over_shm() {
    killed_peer("shm");
}

/// Over TCP.
#[test]
fn killed_peer_ends_the_wait_over_tcp() {
    killed_peer("tcp");
}

/// The runtime-neutral core: the events as a `futures_core::Stream`, which
/// ends once the channel is closed.
#[test]
fn events_as_a_stream() {
    use futures_core::Stream;
    const TOTAL: u64 = 50;
    runtime().block_on(async {
        let (a, b) = (Domain::new("src"), Domain::new("sink"));
        let alloc = Allocator::new(&a, TOTAL, SIZE, PoolConstraints::default()).unwrap();
        let (mut tx, mut rx) = local_pair(&a, &b, &alloc, 64).await;
        for seq in 0..TOTAL {
            let mut buf = alloc.alloc().unwrap();
            fill(buf.as_mut_slice().unwrap(), seq);
            tx.move_buffer(buf, &seq.to_le_bytes()).await.unwrap();
        }
        tx.teardown().await.unwrap();
        fn next(rx: &mut AsyncChannel) -> impl Future<Output = Option<Event>> + '_ {
            poll_fn(|cx| std::pin::Pin::new(&mut *rx).poll_next(cx))
        }
        for want in 0..TOTAL {
            match timeout(T, next(&mut rx)).await.unwrap() {
                Some(Event::MoveReceived { buffer, meta }) => {
                    assert_eq!(seq_of(&meta), want);
                    assert!(check(&buffer, want));
                }
                ev => panic!("expected move {want}, got {ev:?}"),
            }
        }
        assert!(matches!(timeout(T, next(&mut rx)).await.unwrap(), Some(Event::Closed { by_peer: true })));
        assert!(timeout(T, next(&mut rx)).await.unwrap().is_none(), "the stream ends with the channel");
        // The source learns of the close.
        assert!(matches!(timeout(T, tx.next_event()).await.unwrap(), Some(Event::Closed { by_peer: false })));
    });
}

/// Copies and releases through a queue of depth 2: the async `copy` and
/// `release` wait for room; every release comes back, and the buffer is
/// read-write again after the last.
#[test]
fn copies_and_releases_wait_for_room() {
    const COPIES: u64 = 40;
    runtime().block_on(async {
        let (a, b) = (Domain::new("src"), Domain::new("sink"));
        let alloc = Allocator::new(&a, 1, SIZE, PoolConstraints::default()).unwrap();
        let (mut tx, mut rx) = local_pair(&a, &b, &alloc, 2).await;
        let sink = tokio::spawn(async move {
            let mut released = 0u64;
            while let Some(ev) = rx.next_event().await {
                match ev {
                    Event::CopyReceived { copy, meta } => {
                        assert!(check(&copy, 7), "copy {} corrupted", seq_of(&meta));
                        rx.release(copy).await.unwrap();
                        released += 1;
                    }
                    Event::Closed { .. } => break,
                    ev => panic!("sink: unexpected {ev:?}"),
                }
            }
            released
        });
        let mut buf = alloc.alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), 7);
        let source = async {
            for seq in 0..COPIES {
                tx.copy(&buf, &seq.to_le_bytes()).await.unwrap();
            }
            let mut back = 0;
            while back < COPIES {
                match tx.next_event().await {
                    Some(Event::CopyReleased { writable, .. }) => {
                        back += 1;
                        assert_eq!(writable, back == COPIES, "read-write again after the last release only");
                    }
                    ev => panic!("source: unexpected {ev:?}"),
                }
            }
            tx.teardown().await.unwrap();
            assert!(matches!(tx.next_event().await, Some(Event::Closed { .. })));
        };
        timeout(T, source).await.expect("every copy released in time");
        assert!(buf.as_mut_slice().is_ok(), "the buffer is read-write again");
        assert_eq!(timeout(T, sink).await.unwrap().unwrap(), COPIES);
    });
}
