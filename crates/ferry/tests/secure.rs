//! Volatile and secured buffers against a hostile sender: a real child
//! process (this test binary run again, `secure_child`) moves a buffer to
//! the test process over shm and then keeps writing it — through its own
//! mapping of the pool and through a new writable mapping of the pool's
//! memfd it makes itself. The receiver's volatile view changes; the bytes
//! it secured never do. Over TCP the receiver's memory is its own, so
//! securing copies nothing.

mod support;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, Buffer, Channel, ChannelSetup, Direction, Domain, Endpoint, Event, PoolConstraints,
    PoolPolicy, Role, TrustLevel,
};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;
const FIRST: u8 = 0xA5;

/// The hostile sender: bind, assign a pool, move one buffer full of
/// `FIRST`, then write the buffer over and over (new values each round)
/// through its own view and through a fresh writable mapping of the memfd
/// (under trust NONE the memfd is sealed: it re-enables write on its own
/// view instead; under HALF its own view of the moved buffer is protected:
/// it makes it writable again, its own mapping), until killed (at most
/// 30 s).
#[test]
#[ignore = "run as a child process by the other tests"]
fn secure_child() {
    let (Ok(name), Ok(trust)) = (std::env::var("FERRY_SECURE_EP"), std::env::var("FERRY_SECURE_TRUST")) else {
        return;
    };
    let trust = match trust.as_str() {
        "none" => TrustLevel::None,
        "half" => TrustLevel::Half,
        _ => TrustLevel::Full,
    };
    let d = Domain::new("hostile");
    let mut ch = Channel::connect(&d, &Endpoint::shm_abstract(&name), BindParams::default(), T).expect("bind");
    let alloc = Allocator::new(&d, 1, SIZE, PoolConstraints { trust, ..PoolConstraints::default() }).unwrap();
    ch.assign_pool_and_wait(alloc.pool(), T).expect("assigned");
    let mut buf = alloc.alloc().unwrap();
    buf.as_mut_slice().unwrap().fill(FIRST);
    ch.move_buffer(buf, b"").unwrap();
    ch.flush().unwrap();
    // Our own second mapping of the pool's memory, writable.
    let fd = alloc.pool().memory_fd();
    // SAFETY: a new shared mapping of the pool's memfd (SIZE bytes, one
    // buffer); nothing else in this process uses the address range.
    let mine = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            0,
        )
    };
    let view = alloc.pool().base_address() as *mut u8;
    let mine = if mine == libc::MAP_FAILED {
        // Trust NONE: the memfd is sealed against new writable mappings.
        // Make our own view (protected since the buffer left) writable
        // again instead: it is our process's mapping, we may.
        assert_eq!(trust, TrustLevel::None, "only trust NONE seals the memory");
        // SAFETY: our own mapping of the pool, SIZE bytes at `view`.
        assert_eq!(unsafe { libc::mprotect(view.cast(), SIZE, libc::PROT_READ | libc::PROT_WRITE) }, 0);
        view.cast()
    } else {
        if trust == TrustLevel::Half {
            // SAFETY: our own mapping of the pool, SIZE bytes at `view`.
            assert_eq!(unsafe { libc::mprotect(view.cast(), SIZE, libc::PROT_READ | libc::PROT_WRITE) }, 0);
        }
        mine
    };
    let end = Instant::now() + Duration::from_secs(30);
    let mut round = 0u8;
    while Instant::now() < end {
        round = round.wrapping_add(1) | 1;
        // SAFETY: both are read-write mappings of this process of SIZE
        // bytes of the pool (our view: read-write under trust FULL, made so
        // above under HALF and NONE); volatile writes, as a hostile sender would do
        // them.
        unsafe {
            std::ptr::write_bytes(mine as *mut u8, round, SIZE);
            std::ptr::write_bytes(view, round.wrapping_add(1), SIZE);
        }
        let _ = ch.poll();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Create the receiving end on a fresh endpoint, start the hostile sender,
/// and take the buffer it moves.
fn receive_from_hostile(trust: TrustLevel) -> (Channel, Child, Buffer) {
    let name = support::unique_name("secure");
    let setup = ChannelSetup { direction: Direction::Rx, role: Role::Slave, trust, ..ChannelSetup::default() };
    let d = Domain::new("receiver");
    let mut ch = Channel::create(&d, &Endpoint::shm_abstract(&name), setup).unwrap();
    ch.set_pool_policy(PoolPolicy::AcceptAll);
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "secure_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("FERRY_SECURE_EP", &name)
        .env("FERRY_SECURE_TRUST", format!("{trust:?}").to_lowercase())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn the sender");
    let deadline = Instant::now() + T;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match ch.wait(Some(left)) {
            Ok(Event::BindRequest { .. } | Event::PoolAssignRequest(_)) => {}
            Ok(Event::MoveReceived { buffer, .. }) => return (ch, child, buffer),
            other => panic!("receiver: expected the buffer, got {other:?}"),
        }
    }
}

fn stop(mut child: Child) {
    let _ = child.kill();
    support::payload::wait_exit(&mut child, T);
}

/// Wait (bounded) until `f` holds.
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

/// Trust FULL over shm: the sender keeps its writable mappings, so the
/// volatile view changes under the receiver; the secured bytes (a private
/// copy) keep what the buffer held when it was secured, while the sender
/// goes on writing.
#[test]
fn a_hostile_sender_cannot_change_secured_bytes_shm() {
    secured_bytes_outlast_a_hostile_sender(TrustLevel::Full);
}

/// Trust HALF over shm: protections are applied in the sender's own
/// process, which it may undo (its own view made writable again), and the
/// pool's memfd is not sealed (a new writable mapping of it works): the
/// memory is not the receiver's alone, so securing must copy it, and the
/// secured bytes keep what the buffer held while the sender writes on.
#[test]
fn half_trust_across_processes_is_secured_by_a_copy_shm() {
    secured_bytes_outlast_a_hostile_sender(TrustLevel::Half);
}

/// A buffer from the hostile sender of `trust`, secured while the sender
/// writes it: a private copy, whose bytes never change while the volatile
/// view changes under the receiver.
fn secured_bytes_outlast_a_hostile_sender(trust: TrustLevel) {
    let (_ch, child, buffer) = receive_from_hostile(trust);
    let secured = buffer.secure().unwrap();
    // The sender may be writing while we secure: what we secured is the
    // bytes at that time (a hostile sender decides what they are); from
    // then on they never change.
    let snapshot = secured.to_vec();
    let first = snapshot[0];
    let volatile = |s: &ferry::Secured<Buffer>| s.handle()[0];
    assert!(eventually(|| volatile(&secured) != first), "the volatile view changes (the sender is writing)");
    // Watch until the volatile view has changed three more times (bounded):
    // the secured bytes stay the same throughout.
    let mut changes = 0;
    let mut last = volatile(&secured);
    let deadline = Instant::now() + T;
    while changes < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        assert!(secured[..] == snapshot[..], "secured bytes changed");
        if volatile(&secured) != last {
            changes += 1;
            last = volatile(&secured);
        }
    }
    assert_eq!(changes, 3, "the sender kept writing meanwhile");
    assert!(secured[..] == snapshot[..], "secured bytes changed");
    assert!(secured.is_copy(), "{trust:?}: the sender's process maps the memory writable: a private copy");
    stop(child);
}

/// Trust NONE over shm: the receiver's memory is its own (the sender only
/// ever gets it read-only), so securing copies nothing, and the sender's
/// writes to its own memory (its own view, made writable again) never
/// show.
#[test]
fn trust_none_is_secured_in_place_shm() {
    let (_ch, child, buffer) = receive_from_hostile(TrustLevel::None);
    let secured = buffer.secure().unwrap();
    assert!(!secured.is_copy(), "trust NONE: the memory is the receiver's alone");
    // The bytes were copied in from the sender's memory when the buffer
    // was delivered (the sender may have been writing it then already);
    // from then on they never change.
    let snapshot = secured.to_vec();
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(2));
        assert!(secured[..] == snapshot[..], "secured bytes changed");
    }
    stop(child);
}

/// TCP: the receiver's pool is its own mirror; securing copies nothing,
/// and the sender's writes to its own memory after the move never reach
/// the bytes the receiver secured.
#[test]
fn tcp_is_secured_in_place() {
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let recv = Domain::new("receiver");
    let setup = ChannelSetup { direction: Direction::Rx, role: Role::Slave, ..ChannelSetup::default() };
    let mut rx = Channel::create(&recv, &Endpoint::tcp(loopback), setup).unwrap();
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    let addr = rx.listen_addr().unwrap();
    let (go, wait_done) = std::sync::mpsc::channel::<()>();
    let sender = std::thread::spawn(move || {
        let d = Domain::new("sender");
        let mut tx = Channel::connect(&d, &Endpoint::tcp(addr), BindParams::default(), T).unwrap();
        let alloc = Allocator::new(&d, 1, SIZE, PoolConstraints::default()).unwrap();
        tx.assign_pool_and_wait(alloc.pool(), T).unwrap();
        let mut buf = alloc.alloc().unwrap();
        buf.as_mut_slice().unwrap().fill(FIRST);
        tx.move_buffer(buf, b"").unwrap();
        tx.flush().unwrap();
        // Scribble on our own memory of the pool until told to stop.
        let view = alloc.pool().base_address() as *mut u8;
        while wait_done.recv_timeout(Duration::from_millis(1)).is_err() {
            // SAFETY: our mapping of the pool, read-write under trust FULL.
            unsafe { std::ptr::write_bytes(view, 0x11, SIZE) };
            let _ = tx.poll();
        }
        tx
    });
    let buffer = loop {
        match rx.wait(Some(T)) {
            Ok(Event::BindRequest { .. } | Event::PoolAssignRequest(_)) => {}
            Ok(Event::MoveReceived { buffer, .. }) => break buffer,
            other => panic!("receiver: {other:?}"),
        }
    };
    let secured = buffer.secure().unwrap();
    assert!(!secured.is_copy(), "over TCP the receiver's memory is its own");
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(2));
        assert!(secured.iter().all(|&b| b == FIRST));
    }
    go.send(()).unwrap();
    drop(sender.join().unwrap());
}
