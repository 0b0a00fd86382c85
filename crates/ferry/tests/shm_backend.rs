//! The shared-memory backend between real processes: the test binary runs
//! itself again as the peer (`shm_child`, selected by environment), so every
//! test here crosses a process boundary: pools travel as memfds, the data
//! path is the shared rings, and crashes are real `kill -9`s.

mod support;

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, BufferState, Channel, ChannelSetup, ChannelState, Direction, Domain, Endpoint, ErrorKind,
    Event, PoolConstraints, Role, TrustLevel,
};

use support::payload::{check, fill};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;

fn unique(tag: &str) -> String {
    support::unique_name(&format!("test-{tag}"))
}

/// Start this test binary as the peer process with `role` on endpoint `name`.
fn spawn_child(role: &str, name: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "shm_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("FERRY_SHM_ROLE", role)
        .env("FERRY_SHM_EP", name)
        // The `hold-past-close` child exits once this closes.
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn child")
}

/// Create a TX master channel on a fresh endpoint, start the child with
/// `role` on it, and wait for the child to bind.
fn start(domain: &Domain, role: &str, trust: TrustLevel) -> (Channel, Child) {
    let name = unique(role);
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, trust, ..ChannelSetup::default() };
    let mut ch = Channel::create(domain, &Endpoint::shm_abstract(&name), setup).expect("create");
    let child = spawn_child(role, &name);
    match ch.wait(Some(T)) {
        Ok(Event::BindRequest { .. }) => (ch, child),
        ev => panic!("expected a bind, got {ev:?}"),
    }
}

fn assign(ch: &mut Channel, alloc: &Allocator) {
    ch.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::PoolAssigned(_))));
}

/// Moves `n` buffers of `alloc`, each filled with the pattern of its
/// sequence number (0, 1, …), which goes as its meta data.
fn move_filled(ch: &mut Channel, alloc: &Allocator, n: u64) {
    for seq in 0..n {
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), seq);
        ch.move_buffer(b, &seq.to_le_bytes()).unwrap();
    }
}

fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    support::payload::wait_exit(child, T)
}

/// The peer side. Roles: `echo` (verify every moved buffer, pass it back,
/// hold read-only copies until the teardown), `echo-batched` (the same with
/// batching on), `hold` (take everything, give nothing back, then wait to
/// be killed), `hold-past-close` (take everything, answer the teardown,
/// keep the buffers until its standard input closes, then exit),
/// `write-back` (write the sequence number + 1 into each buffer before
/// passing it back).
#[test]
#[ignore = "run as a child process by the other tests"]
fn shm_child() {
    let (Ok(role), Ok(name)) = (std::env::var("FERRY_SHM_ROLE"), std::env::var("FERRY_SHM_EP")) else { return };
    let domain = Domain::new("child");
    let mut ch = Channel::bind(&domain, &Endpoint::shm_abstract(&name), BindParams::default()).expect("bind");
    if role == "scribble" {
        scribble_over_segment(&mut ch);
        return;
    }
    let mut held = Vec::new();
    let mut kept = Vec::new();
    loop {
        match ch.wait(Some(Duration::from_secs(30))) {
            Ok(Event::Bound) => {
                if role == "echo-batched" {
                    ch.set_batching(true).unwrap();
                }
            }
            Ok(Event::PoolAssignRequest(req)) => ch.respond_pool(req.pool, true).unwrap(),
            Ok(Event::MoveReceived { mut buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&buffer, seq), "child: buffer {seq} arrived corrupted");
                match role.as_str() {
                    "hold" | "hold-past-close" => kept.push(buffer),
                    "write-back" => {
                        fill(buffer.as_mut_slice().unwrap(), seq + 1);
                        ch.pass(buffer, &meta).unwrap();
                    }
                    _ => ch.pass(buffer, &meta).unwrap(),
                }
            }
            Ok(Event::CopyReceived { copy, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&copy, seq), "child: copy {seq} arrived corrupted");
                held.push(copy);
            }
            Ok(Event::Closed { .. }) | Err(_) => break,
            Ok(Event::Error(e)) => panic!("child: {e}"),
            Ok(ev) => panic!("child: unexpected {ev:?}"),
        }
    }
    if role == "hold-past-close" {
        // The channel is closed; the buffers are still ours until we go.
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
        std::process::exit(0);
    }
    drop(held);
    drop(kept);
}

/// The hostile peer: once bound, overwrite our own mapping of the channel
/// segment (found in /proc/self/maps as `memfd:ferry-channel`) with garbage:
/// counters, flags and descriptor slots of both rings.
fn scribble_over_segment(ch: &mut Channel) {
    assert!(matches!(ch.wait(Some(T)), Ok(Event::Bound)));
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let line = maps.lines().find(|l| l.contains("ferry-channel")).expect("segment mapped");
    let range = line.split_whitespace().next().unwrap();
    let (lo, hi) = range.split_once('-').unwrap();
    let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap(), usize::from_str_radix(hi, 16).unwrap());
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for addr in (lo..hi).step_by(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // SAFETY: test-only hostile peer writing into its own shared
        // mapping of the segment, inside the range the kernel reported.
        unsafe { std::ptr::write_volatile(addr as *mut u64, x) };
    }
    // Stay alive so the victim sees garbage, not a hang-up.
    std::thread::sleep(Duration::from_secs(3));
}

/// A peer that writes garbage over the shared rings: the victim fails the
/// channel with a protocol error (never a panic, a hang or a crash), and
/// its buffers are still its own.
#[test]
fn garbage_in_the_ring_is_a_protocol_error() {
    let d = Domain::new("victim");
    let (mut ch, mut child) = start(&d, "scribble", TrustLevel::Full);
    let alloc = Allocator::new(&d, 4, SIZE, PoolConstraints::default()).unwrap();
    // The garbage may already be there: then even this send is refused,
    // with a typed error.
    if let Err(e) = ch.assign_pool(alloc.pool()) {
        assert!(matches!(e.kind(), ErrorKind::Protocol(_) | ErrorKind::PeerGone), "send refused with {e:?}");
    }
    let t = Instant::now();
    let ev = loop {
        match ch.wait(Some(T)) {
            Ok(Event::Error(e)) => break e,
            Ok(ev) => panic!("unexpected {ev:?}"),
            Err(_) => assert!(t.elapsed() < T, "no error event"),
        }
    };
    assert!(matches!(ev.kind(), ErrorKind::Protocol(_) | ErrorKind::PeerGone), "got {ev:?}");
    assert_eq!(ch.state(), ChannelState::Closed);
    assert_eq!(alloc.available(), 4);
    let mut b = alloc.alloc().unwrap();
    b.as_mut_slice().unwrap()[0] = 1;
    let _ = child.kill();
    let _ = child.wait();
}

/// Transmit master across processes: the pool's memfd travels to the child,
/// every buffer is checked there byte by byte and comes back; at the end
/// the allocator has all its buffers and the child exits cleanly.
#[test]
fn transmit_master_between_processes() {
    let d = Domain::new("parent");
    let (mut ch, mut child) = start(&d, "echo", TrustLevel::Full);
    let alloc = Allocator::new(&d, 16, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    support::payload::move_and_take_back(&mut ch, &alloc, 2000, |seq| seq);
    ch.teardown().unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::Closed { by_peer: false })));
    assert_eq!(alloc.available(), 16);
    assert!(wait_exit(&mut child).success());
}

/// The same flow with batching on at both ends: messages go out in
/// batches (when an end runs out of arrivals, waits, or has 32 waiting),
/// and every buffer still comes back intact and in order.
#[test]
fn batched_transmit_between_processes() {
    let d = Domain::new("parent");
    let (mut ch, mut child) = start(&d, "echo-batched", TrustLevel::Full);
    ch.set_batching(true).unwrap();
    let alloc = Allocator::new(&d, 64, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    let order = support::payload::move_and_take_back(&mut ch, &alloc, 5000, |seq| seq);
    assert!(order.iter().copied().eq(0..5000), "passes arrive in order");
    ch.teardown().unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::Closed { by_peer: false })));
    assert_eq!(alloc.available(), 64);
    assert!(wait_exit(&mut child).success());
}

/// Writes by the other process land in our buffer: zero copy both ways.
#[test]
fn child_writes_are_seen_by_the_parent() {
    let d = Domain::new("parent");
    let (mut ch, mut child) = start(&d, "write-back", TrustLevel::Full);
    let alloc = Allocator::new(&d, 4, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    for seq in 0..20u64 {
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), seq);
        ch.move_buffer(b, &seq.to_le_bytes()).unwrap();
        match ch.wait(Some(T)) {
            Ok(Event::BufferPassed { buffer, .. }) => assert!(check(&buffer, seq + 1), "child's write not seen"),
            ev => panic!("unexpected {ev:?}"),
        }
    }
    ch.teardown().unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::Closed { .. })));
    assert!(wait_exit(&mut child).success());
}

/// `kill -9` of the peer while it holds moved buffers and read-only copies:
/// the survivor gets an error event in bounded time, every buffer returns to
/// the allocator, and the copied buffer is writable again.
#[test]
fn killed_peer_gives_buffers_back() {
    for busy_poll in [false, true] {
        let d = Domain::new("parent");
        let (mut ch, mut child) = start(&d, "hold", TrustLevel::Full);
        let alloc = Allocator::new(&d, 8, SIZE, PoolConstraints::default()).unwrap();
        assign(&mut ch, &alloc);
        move_filled(&mut ch, &alloc, 5);
        let mut owned = alloc.alloc().unwrap();
        fill(owned.as_mut_slice().unwrap(), 99);
        ch.copy(&owned, &99u64.to_le_bytes()).unwrap();
        assert_eq!(d.buffer_state(owned.id()), BufferState::ReadOnlyOwned);
        std::thread::sleep(Duration::from_millis(50));
        child.kill().unwrap();
        let status = wait_exit(&mut child);
        assert_eq!(status.signal(), Some(9));
        let t = Instant::now();
        let ev = if busy_poll {
            loop {
                if let Some(ev) = ch.poll() {
                    break Some(ev);
                }
                assert!(t.elapsed() < T, "no error event while busy-polling");
            }
        } else {
            ch.wait(Some(T)).ok()
        };
        assert!(matches!(&ev, Some(Event::Error(e)) if *e == ErrorKind::PeerGone), "got {ev:?}");
        assert!(t.elapsed() < Duration::from_secs(2), "noticed only after {:?}", t.elapsed());
        assert_eq!(ch.state(), ChannelState::Closed);
        assert_eq!(alloc.available(), 7, "the five moved buffers came back (one is still in our hand)");
        assert_eq!(d.buffer_state(owned.id()), BufferState::ReadWrite, "the dead peer's copy is void");
        owned.as_mut_slice().unwrap()[0] = 1;
    }
}

/// A peer that still holds moved buffers when the channel closes in order
/// keeps them while its process lives (they are its own, in memory we
/// share), and they come back once it has exited: a closed channel does not
/// lose what it lent.
#[test]
fn buffers_a_peer_held_past_an_orderly_close_come_back_when_it_exits() {
    let d = Domain::new("parent");
    let (mut ch, mut child) = start(&d, "hold-past-close", TrustLevel::Full);
    let alloc = Allocator::new(&d, 8, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    move_filled(&mut ch, &alloc, 5);
    ch.teardown().unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::Closed { by_peer: false })));
    drop(ch);
    // The peer lives and holds five: three can be allocated, and they are
    // taken, so that the next allocation finds the pool empty and looks.
    let three: Vec<_> = (0..3).map_while(|_| alloc.alloc()).collect();
    assert_eq!(three.len(), 3);
    assert!(alloc.alloc().is_none(), "a buffer the live peer still holds came back");
    assert!(child.try_wait().unwrap().is_none(), "the peer exited before the check");
    drop(child.stdin.take());
    assert!(wait_exit(&mut child).success());
    let five: Vec<_> = (0..5).map_while(|_| alloc.alloc()).collect();
    assert_eq!(five.len(), 5, "the buffers the peer held did not come back after it exited");
    drop((three, five));
    assert_eq!(alloc.available(), 8);
}

/// Endpoint errors: nobody listening, two creators.
#[test]
fn bind_errors_between_processes() {
    let name = unique("err");
    // Nobody listening.
    let d = Domain::new("d");
    let e = Channel::bind(&d, &Endpoint::shm_abstract(&name), BindParams::default()).unwrap_err();
    assert_eq!(e, ErrorKind::EndpointNotListening);
    // Two creators on one name.
    let _c = Channel::create(&d, &Endpoint::shm_abstract(&name), ChannelSetup::default()).unwrap();
    let e = Channel::create(&d, &Endpoint::shm_abstract(&name), ChannelSetup::default()).unwrap_err();
    assert_eq!(e, ErrorKind::EndpointInUse);
}

/// Role conflict across processes: the binder gets BindRefused, the creator
/// keeps listening and accepts a compatible binder afterwards.
#[test]
fn refused_bind_then_accepted_one() {
    let name = unique("refuse");
    let d = Domain::new("creator");
    let setup = ChannelSetup { role: Role::Master, ..ChannelSetup::default() };
    let mut c = Channel::create(&d, &Endpoint::shm_abstract(&name), setup).unwrap();
    let b = Domain::new("binder");
    let want_master = BindParams { role: Role::Master, ..BindParams::default() };
    let mut wrong = Channel::bind(&b, &Endpoint::shm_abstract(&name), want_master).unwrap();
    let t = Instant::now();
    let ev = loop {
        assert!(c.poll().is_none(), "creator must not connect to a conflicting binder");
        if let Some(ev) = wrong.poll() {
            break ev;
        }
        assert!(t.elapsed() < T);
    };
    assert!(matches!(&ev, Event::Error(e) if matches!(e.kind(), ErrorKind::BindRefused(_))), "{ev:?}");
    let mut right = Channel::bind(&b, &Endpoint::shm_abstract(&name), BindParams::default()).unwrap();
    assert!(matches!(c.wait(Some(T)), Ok(Event::BindRequest { binder_role: Role::Slave })));
    assert!(matches!(right.wait(Some(T)), Ok(Event::Bound)));
    assert_eq!(right.direction(), Direction::Rx);
}

/// Trust HALF across processes: the sender's own view is protected while
/// the buffer is away, and everything still flows.
#[test]
fn half_trust_between_processes() {
    let d = Domain::new("parent");
    let (mut ch, mut child) = start(&d, "echo", TrustLevel::Half);
    let alloc = Allocator::new(&d, 4, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    for seq in 0..50u64 {
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), seq);
        let id = b.id();
        ch.move_buffer(b, &seq.to_le_bytes()).unwrap();
        assert_eq!(d.buffer_state(id), BufferState::Invalid);
        match ch.wait(Some(T)) {
            Ok(Event::BufferPassed { buffer, .. }) => assert!(check(&buffer, seq)),
            ev => panic!("unexpected {ev:?}"),
        }
    }
    ch.teardown().unwrap();
    assert!(matches!(ch.wait(Some(T)), Ok(Event::Closed { .. })));
    assert!(wait_exit(&mut child).success());
}
