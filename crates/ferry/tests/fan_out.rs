//! `FanOut`: one source, several sinks, each receiving every published
//! buffer as a read-only copy; the buffer comes back to the source,
//! writable, exactly once, after the last sink released its copy. Sinks
//! are real processes over shared memory (the test binary runs itself
//! again as `fan_child`, selected by environment) and threads.

mod support;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ferry::{
    Allocator, BindParams, BufferId, Channel, ChannelSetup, Domain, Endpoint, ErrorKind, Event, FanOut, FanOutEvent,
    PoolConstraints, PoolPolicy,
};
use support::payload::{check, fill, wait_exit};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;

/// The sink process. Roles: `release` (check every copy's bytes against
/// the pattern of its sequence number, release it), `die` (check the first
/// copy, print FERRY-FAN-HELD, keep it until killed), `release-when-told`
/// (check each copy, print FERRY-FAN-HELD, release it once a line comes
/// on stdin).
#[test]
#[ignore = "run as a child process by the other tests"]
fn fan_child() {
    let (Ok(role), Ok(name)) = (std::env::var("FERRY_FAN_ROLE"), std::env::var("FERRY_FAN_EP")) else { return };
    let ep = Endpoint::shm_abstract(&name);
    let mut rx = Channel::connect(&Domain::new("sink"), &ep, BindParams::default(), T).expect("connect");
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    loop {
        match rx.wait(Some(Duration::from_secs(30))) {
            Ok(Event::CopyReceived { copy, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&copy, seq), "sink: copy {seq} arrived with the wrong bytes");
                if role == "die" || role == "release-when-told" {
                    println!("\nFERRY-FAN-HELD");
                }
                if role == "die" {
                    std::thread::sleep(Duration::from_secs(60));
                    unreachable!("killed before");
                }
                if role == "release-when-told" {
                    std::io::stdin().read_line(&mut String::new()).unwrap();
                }
                rx.release(copy).unwrap();
            }
            Ok(Event::Closed { .. }) | Err(_) => return,
            Ok(ev) => panic!("sink: unexpected {ev:?}"),
        }
    }
}

/// `roles.len()` sink processes, each on a channel of its own from `source`.
fn start_sinks(source: &Domain, roles: &[&str]) -> (FanOut, Vec<Child>) {
    let (mut channels, mut children) = (Vec::new(), Vec::new());
    for role in roles {
        let name = support::unique_name("fan-out");
        let mut tx = Channel::create(source, &Endpoint::shm_abstract(&name), ChannelSetup::default()).unwrap();
        children.push(
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "fan_child", "--ignored", "--nocapture", "--test-threads=1"])
                .env("FERRY_FAN_ROLE", role)
                .env("FERRY_FAN_EP", &name)
                .stdout(if *role == "release" { Stdio::null() } else { Stdio::piped() })
                .stdin(if *role == "release-when-told" { Stdio::piped() } else { Stdio::null() })
                .spawn()
                .unwrap(),
        );
        tx.wait_connected(T).unwrap();
        channels.push(tx);
    }
    (FanOut::new(channels).unwrap(), children)
}

fn publish(fan: &mut FanOut, alloc: &Allocator, seq: u64) -> BufferId {
    let mut buf = alloc.alloc().expect("a free buffer");
    fill(buf.as_mut_slice().unwrap(), seq);
    let id = buf.id();
    fan.publish(buf, &seq.to_le_bytes()).unwrap();
    id
}

/// The next buffer back: it must be one in flight (taken out of the set),
/// writable. Sink events other than `allowed` fail the test.
fn next_returned(fan: &mut FanOut, in_flight: &mut HashSet<BufferId>, allowed: impl Fn(usize, &Event) -> bool) {
    loop {
        match fan.wait(Some(T)) {
            Some(FanOutEvent::Returned { mut buffer, writable }) => {
                assert!(writable, "back writable");
                assert!(in_flight.remove(&buffer.id()), "{:?} came back twice, or was never published", buffer.id());
                assert!(buffer.as_mut_slice().is_ok(), "READ_WRITE again: every copy is back");
                return;
            }
            Some(FanOutEvent::Sink { sink, event }) if allowed(sink, &event) => {}
            other => panic!("expected a buffer back, got {other:?}"),
        }
    }
}

/// Tear down and wait for every live sink's close and every child's exit.
fn finish(mut fan: FanOut, children: Vec<Child>, live: usize) {
    fan.teardown().unwrap();
    let mut closed = 0;
    while closed < live {
        match fan.wait(Some(T)) {
            Some(FanOutEvent::Sink { event: Event::Closed { .. }, .. }) => closed += 1,
            other => panic!("expected the closes, got {other:?}"),
        }
    }
    assert_eq!(fan.in_flight(), 0);
    for mut child in children {
        let status = wait_exit(&mut child, T);
        assert!(status.success() || status.code().is_none(), "sink failed: {status}");
    }
}

/// Three sink processes, 40 buffers published two at a time from a pool of
/// two: each sink checks every byte, and each buffer comes back writable
/// exactly once.
#[test]
fn three_processes_get_every_buffer() {
    let source = Domain::new("source");
    let (mut fan, children) = start_sinks(&source, &["release", "release", "release"]);
    let alloc = Allocator::new(&source, 2, SIZE, PoolConstraints::default()).unwrap();
    fan.assign_pool_and_wait(alloc.pool(), T).unwrap();
    let mut in_flight = HashSet::new();
    for seq in 0..40 {
        if alloc.available() == 0 {
            next_returned(&mut fan, &mut in_flight, |_, _| false);
        }
        assert!(in_flight.insert(publish(&mut fan, &alloc, seq)));
    }
    while !in_flight.is_empty() {
        next_returned(&mut fan, &mut in_flight, |_, _| false);
    }
    assert!(fan.poll().is_none(), "nothing came back twice");
    assert_eq!(alloc.available(), 2);
    finish(fan, children, 3);
}

/// A sink process killed while it holds its copy gives it back by dying:
/// the buffer returns writable once the other two released theirs, and the
/// next publication goes to the two that are left.
#[test]
fn a_sink_that_dies_gives_its_copy_back() {
    let source = Domain::new("source");
    let (mut fan, mut children) = start_sinks(&source, &["release", "die", "release"]);
    let alloc = Allocator::new(&source, 1, SIZE, PoolConstraints::default()).unwrap();
    fan.assign_pool_and_wait(alloc.pool(), T).unwrap();
    let mut in_flight = HashSet::from([publish(&mut fan, &alloc, 7)]);

    let out = children[1].stdout.take().unwrap();
    let held = BufReader::new(out).lines().map_while(Result::ok).any(|l| l.contains("FERRY-FAN-HELD"));
    assert!(held, "the dying sink got its copy");
    children[1].kill().unwrap();
    let dead = |sink: usize, ev: &Event| sink == 1 && matches!(ev, Event::Error(_));
    next_returned(&mut fan, &mut in_flight, dead);
    assert_eq!(alloc.available(), 1, "the test dropped it: free again, once");

    in_flight.insert(publish(&mut fan, &alloc, 8));
    next_returned(&mut fan, &mut in_flight, dead);
    assert!(fan.channel(1).unwrap().state() == ferry::ChannelState::Closed);
    finish(fan, children, 2);
}

/// The sink dies first, while the two others still hold their copies: the
/// buffer stays read-only (the dead process could have passed its copy on)
/// until both have released theirs, then comes back writable, once.
#[test]
fn a_sink_that_dies_first_then_the_others_release() {
    let source = Domain::new("source");
    let roles = ["release-when-told", "die", "release-when-told"];
    let (mut fan, mut children) = start_sinks(&source, &roles);
    let alloc = Allocator::new(&source, 1, SIZE, PoolConstraints::default()).unwrap();
    fan.assign_pool_and_wait(alloc.pool(), T).unwrap();
    let mut in_flight = HashSet::from([publish(&mut fan, &alloc, 9)]);
    // The readers stay open until the children exit (they print more).
    let mut readers = Vec::new();
    for child in &mut children {
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains("FERRY-FAN-HELD") {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "every sink got its copy");
        }
        readers.push(out);
    }
    children[1].kill().unwrap();
    match fan.wait(Some(T)) {
        Some(FanOutEvent::Sink { sink: 1, event: Event::Error(_) }) => {}
        other => panic!("expected sink 1's death, got {other:?}"),
    }
    assert!(fan.wait(Some(Duration::from_millis(50))).is_none(), "two copies are still out");
    for i in [0, 2] {
        let stdin = children[i].stdin.as_mut().unwrap();
        writeln!(stdin, "release").unwrap();
    }
    next_returned(&mut fan, &mut in_flight, |_, _| false);
    assert!(fan.poll().is_none());
    finish(fan, children, 2);
    drop(readers);
}

/// Threads, local backend: `n` sinks, each a channel end handed to the test.
fn local_fan(source: &Domain, n: usize) -> (FanOut, Vec<Channel>) {
    let (mut txs, mut rxs) = (Vec::new(), Vec::new());
    for i in 0..n {
        let ep = Endpoint::local();
        let mut tx = Channel::create(source, &ep, ChannelSetup::default()).unwrap();
        let mut rx = Channel::bind(&Domain::new(&format!("sink {i}")), &ep, BindParams::default()).unwrap();
        tx.wait_connected(T).unwrap();
        rx.wait_connected(T).unwrap();
        rx.set_pool_policy(PoolPolicy::AcceptAll);
        txs.push(tx);
        rxs.push(rx);
    }
    (FanOut::new(txs).unwrap(), rxs)
}

/// Assign `alloc`'s pool to every sink, answering on the sinks' side.
fn assign_local(fan: &mut FanOut, rxs: &mut [Channel], alloc: &Allocator) {
    for ch in 0..rxs.len() {
        fan.channel_mut(ch).unwrap().assign_pool(alloc.pool()).unwrap();
    }
    for rx in rxs.iter_mut() {
        assert!(rx.poll().is_none(), "accepted by the policy, quietly");
        assert!(rx.is_assigned(alloc.pool().id()));
    }
    for _ in 0..rxs.len() {
        assert!(matches!(fan.wait(Some(T)), Some(FanOutEvent::Sink { event: Event::PoolAssigned(_), .. })));
    }
}

fn take_copy(rx: &mut Channel) -> ferry::BufferCopy {
    match rx.wait(Some(T)) {
        Ok(Event::CopyReceived { copy, .. }) => copy,
        other => panic!("sink: {other:?}"),
    }
}

/// The buffer comes back only after the last release: while one sink
/// still holds its copy, nothing is returned, whatever the others did.
#[test]
fn returned_only_after_the_last_release() {
    let source = Domain::new("source");
    let (mut fan, mut rxs) = local_fan(&source, 3);
    let alloc = Allocator::new(&source, 1, 4096, PoolConstraints::default()).unwrap();
    assign_local(&mut fan, &mut rxs, &alloc);
    let mut buf = alloc.alloc().unwrap();
    buf.as_mut_slice().unwrap()[..5].copy_from_slice(b"hello");
    let id = buf.id();
    fan.publish(buf, b"m").unwrap();
    let mut copies: Vec<_> = rxs.iter_mut().map(take_copy).collect();
    assert!(copies.iter().all(|c| &c[..5] == b"hello" && c.id() == id));
    let last = copies.remove(1);
    for (i, c) in [0, 2].into_iter().zip(copies) {
        rxs[i].release(c).unwrap();
    }
    assert!(fan.wait(Some(Duration::from_millis(100))).is_none(), "sink 1 still holds its copy");
    assert_eq!(fan.in_flight(), 1);
    rxs[1].release(last).unwrap();
    match fan.wait(Some(T)) {
        Some(FanOutEvent::Returned { mut buffer, writable: true }) => {
            assert_eq!(buffer.id(), id);
            buffer.as_mut_slice().unwrap()[0] = b'j';
        }
        other => panic!("{other:?}"),
    }
    assert!(fan.poll().is_none());
    assert_eq!(fan.in_flight(), 0);
}

/// A sink that closes its channel in order while it holds its copy keeps
/// it out for good (docs/SEMANTICS.md, teardown): the buffer comes back
/// anyway, once, marked not writable.
#[test]
fn a_sink_closing_with_its_copy_returns_the_buffer_read_only() {
    let source = Domain::new("source");
    let (mut fan, mut rxs) = local_fan(&source, 2);
    let alloc = Allocator::new(&source, 1, 4096, PoolConstraints::default()).unwrap();
    assign_local(&mut fan, &mut rxs, &alloc);
    fan.publish(alloc.alloc().unwrap(), &[]).unwrap();
    let c0 = take_copy(&mut rxs[0]);
    let c1 = take_copy(&mut rxs[1]);
    rxs[0].release(c0).unwrap();
    rxs[1].teardown().unwrap();
    let mut events = Vec::new();
    let returned = loop {
        let _ = rxs[1].poll();
        match fan.wait(Some(T)) {
            Some(FanOutEvent::Returned { buffer, writable }) => break (buffer, writable),
            Some(FanOutEvent::Sink { sink, event }) => events.push((sink, format!("{event:?}"))),
            None => panic!("nothing came back; events {events:?}"),
        }
    };
    assert!(!returned.1, "copy 1 stays out");
    assert_eq!(returned.0.as_slice_of::<u8>().unwrap().len(), 4096);
    assert!(events.iter().any(|(s, e)| *s == 1 && e.starts_with("Closed")), "{events:?}");
    drop(c1);
    assert!(fan.poll().is_none());
    assert_eq!(fan.in_flight(), 0);
}

/// A publication a sink's channel would refuse is refused whole: the
/// buffer handed back, no sink got anything.
#[test]
fn publish_is_all_or_nothing() {
    let source = Domain::new("source");
    let (mut fan, mut rxs) = local_fan(&source, 2);
    let alloc = Allocator::new(&source, 1, 4096, PoolConstraints::default()).unwrap();
    fan.channel_mut(0).unwrap().assign_pool(alloc.pool()).unwrap();
    assert!(rxs[0].poll().is_none(), "accepted by the policy, quietly");
    assert!(matches!(fan.wait(Some(T)), Some(FanOutEvent::Sink { sink: 0, event: Event::PoolAssigned(_) })));
    // Sink 1 has no pool: refused, nothing sent to sink 0 either.
    let r = fan.publish(alloc.alloc().unwrap(), &[]).unwrap_err();
    assert_eq!(r.error, ErrorKind::PoolNotAssigned(alloc.pool().id()));
    assert!(rxs[0].poll().is_none(), "sink 0 got nothing");
    let mut buf = r.into_inner();
    assert!(buf.as_mut_slice().is_ok(), "no copy went out");
    assert_eq!(fan.in_flight(), 0);
    let too_long = [0u8; 4096];
    assert!(matches!(fan.publish(buf, &too_long).unwrap_err().error.kind(), ErrorKind::MetaTooLarge { .. }));
    // Channels of two domains, or none: refused, handed back.
    let other = local_fan(&Domain::new("other"), 1).0.into_channels();
    let mut mixed = fan.into_channels();
    mixed.extend(other);
    let r = FanOut::new(mixed).unwrap_err();
    assert!(matches!(r.error.kind(), ErrorKind::InvalidArgument(_)));
    assert_eq!(r.into_inner().len(), 3);
    assert!(matches!(FanOut::new(Vec::new()).unwrap_err().error.kind(), ErrorKind::InvalidArgument(_)));
}
