//! The fabric link against a hostile or failing peer, over real libfabric
//! (the tcp provider on loopback): two links of this process whose fabric
//! endpoints and lifeline are real, one of them made to say what an honest
//! end never says (a key or base that names no pool of its, a write into
//! the other's message ring) or to fail a registration for real (a key
//! that is taken).

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::pool::{Geometry, PoolId, PoolMemory};

const WITHIN: Duration = Duration::from_secs(10);

/// Admits every payload (the channel's checks are not what is tested).
struct LandAll;

impl PayloadGate for LandAll {
    fn admit(&mut self, _: &Message) -> Result<Landing> {
        Ok(Landing::Land)
    }
}

fn open() -> Fabric {
    sys::load().expect("libfabric");
    Fabric::open(Some("tcp"), Some("127.0.0.1"), 4 * MAX_SLOTS).expect("a tcp endpoint")
}

/// Two connected links (a, b), as the setup leaves them.
fn pair() -> (FabricLink, FabricLink) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let a_line = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (b_line, _) = listener.accept().unwrap();
    let (fa, fb) = (open(), open());
    fa.set_peer(&fb.name().unwrap()).unwrap();
    fb.set_peer(&fa.name().unwrap()).unwrap();
    (FabricLink::new(fa, a_line, 16, 64).unwrap(), FabricLink::new(fb, b_line, 16, 64).unwrap())
}

fn pool(id: u128) -> Arc<PoolMemory> {
    PoolMemory::mirror(PoolId::from_u128(id), Geometry::new(4096, 4).unwrap(), None).unwrap()
}

/// Poll both links (each receiving what comes) until `done` says so.
fn drive<T>(a: &mut FabricLink, b: &mut FabricLink, mut done: impl FnMut(&mut FabricLink) -> Option<T>) -> T {
    let deadline = Instant::now() + WITHIN;
    loop {
        let _ = b.flush();
        let _ = b.recv(&mut LandAll);
        if let Some(t) = done(a) {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "nothing within {WITHIN:?}: writes out {:?}, backlog {}, free writes {}, remote {:?}",
            a.pools.values().map(|p| p.writes_out).collect::<Vec<_>>(),
            a.backlog.len(),
            a.free_writes.len(),
            a.remote.values().map(|r| (r.key, r.base, r.len)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A key message as a peer sends it: pool, key, base, length.
fn key_slot(pool: PoolId, key: u64, base: u64, len: u64) -> OutMsg {
    let mut slot = [0u8; SLOT];
    slot[0] = TYPE_KEY;
    slot[8..16].copy_from_slice(&key.to_le_bytes());
    slot[16..32].copy_from_slice(&pool.as_u128().to_le_bytes());
    slot[32..40].copy_from_slice(&base.to_le_bytes());
    slot[40..48].copy_from_slice(&len.to_le_bytes());
    OutMsg { slot, len: 48, payload: None }
}

/// `a` exports `memory`, and `b`'s announcements (whatever `b` queued)
/// reach `a` until `a` holds `key` at `base` for the pool.
fn share(a: &mut FabricLink, b: &mut FabricLink, memory: &Arc<PoolMemory>, key: u64, base: u64) {
    a.export_pool(memory).unwrap();
    let id = memory.id();
    drive(a, b, |a| {
        let _ = a.flush();
        let _ = a.recv(&mut LandAll);
        a.remote.get(&id).is_some_and(|r| r.key == key && r.base == base).then_some(())
    });
}

/// Where `link` registered its memory of pool `id`: key, base, length.
fn registered(link: &FabricLink, id: PoolId) -> (u64, u64, u64) {
    let p = link.pools.get(&id).unwrap();
    let base = if link.fabric.virt_addr() { p.region.map().as_ptr() as u64 } else { 0 };
    (p.region.key(), base, p.geometry.len() as u64)
}

/// Move buffer 0 of `memory` from `a`.
fn move_first(a: &mut FabricLink, memory: &Arc<PoolMemory>) {
    let buf = BufferId { pool: memory.id(), index: 0 };
    a.queue(&Message::Move { buf, meta: Meta::empty() }, true).unwrap();
}

/// A peer announces a key that names none of its registrations, or its
/// real key with a base just past its registration. The write into it is
/// the peer's provider's to refuse (the tcp provider completes writes once
/// sent, so this end sees no error): this end does not hang or fail, its
/// own memory keeps its bytes, and once the peer goes without a goodbye
/// the link fails with `PeerGone` as a death, so the channel takes back
/// what it lent.
#[test]
fn a_peer_announcing_a_bad_key_or_base_gains_nothing_and_its_end_returns_the_buffers() {
    for bad_base in [false, true] {
        let (mut a, mut b) = pair();
        let memory = pool(7);
        let (key, base) = if bad_base {
            b.import_pool(memory.id(), memory.geometry()).unwrap();
            let (key, base, len) = registered(&b, memory.id());
            (key, base + len)
        } else {
            (0xdead_beef, 0)
        };
        b.backlog.push_back(key_slot(memory.id(), key, base, memory.geometry().len() as u64));
        share(&mut a, &mut b, &memory, key, base);
        let ours = memory.map(Access::ReadWrite, 1).unwrap();
        write_slot(&ours, 0, &[0xa5; 16384]);
        move_first(&mut a, &memory);
        // The write and its message leave this end.
        drive(&mut a, &mut b, |a| {
            a.flush().unwrap();
            assert!(a.recv(&mut LandAll).unwrap().is_none());
            (!a.busy()).then_some(())
        });
        if bad_base {
            let mut theirs = vec![0u8; memory.geometry().len()];
            read_slot(b.pools.get(&memory.id()).unwrap().region.map(), 0, &mut theirs);
            assert!(theirs.iter().all(|&x| x == 0), "a write past the peer's base landed in its pool");
        }
        drop(b);
        let deadline = Instant::now() + WITHIN;
        let e = loop {
            match a.recv(&mut LandAll) {
                Err(e) => break e,
                Ok(got) => assert!(got.is_none(), "{got:?}"),
            }
            assert!(Instant::now() < deadline, "the peer's end went unnoticed");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(e, ErrorKind::PeerGone, "bad base {bad_base}");
        assert!(a.peer_died(), "a peer gone without a goodbye died: what was lent comes back");
        let mut still = vec![0u8; 16384];
        read_slot(&ours, 0, &mut still);
        assert!(still.iter().all(|&x| x == 0xa5), "this end's pool changed");
    }
}

/// The message ring takes sends only: a peer that writes into it by RMA
/// (it knows the ring's key and, in one process, its address) has its
/// write refused, and the ring keeps what it had. A write the ring took
/// would land before the peer's next message on the same connection; the
/// tcp provider stalls that connection after a refused write instead, so
/// the check waits for that message or a grace of 2 s.
#[test]
fn the_message_ring_refuses_the_peers_writes() {
    let (mut a, mut b) = pair();
    let ring = a.control.map();
    let base = if a.fabric.virt_addr() { ring.as_ptr() as u64 } else { 0 };
    let ring_key = a.control.key();
    let mut before = vec![0u8; SLOT];
    read_slot(ring, 0, &mut before);
    // b writes one slot of its own ring (a send slot, idle) into a's ring.
    let slot = b.free_tx.pop().unwrap();
    write_slot(b.control.map(), slot * SLOT, &[0x5a; SLOT]);
    drive(&mut b, &mut a, |b| {
        let _ = b.flush();
        match b.fabric.write(&b.control, slot * SLOT, SLOT, base, ring_key, 0, &b.contexts, slot) {
            Err(rc) if rc == -sys::EAGAIN => None,
            posted => {
                posted.unwrap();
                Some(())
            }
        }
    });
    let marker = PoolId::from_u128(0x4d);
    b.backlog.push_back(key_slot(marker, 1, 2, 3));
    let grace = Instant::now() + Duration::from_secs(2);
    drive(&mut a, &mut b, |a| match a.recv(&mut LandAll) {
        Err(_) => Some(()),
        Ok(_) => (a.remote.contains_key(&marker) || Instant::now() > grace).then_some(()),
    });
    let mut after = vec![0u8; SLOT];
    read_slot(a.control.map(), 0, &mut after);
    assert_eq!(before, after, "the peer's write changed the message ring");
}

/// A registration the provider refuses for real (the key the link asks
/// for is taken in its domain): exporting the pool fails with a typed
/// fabric error naming the step, announces nothing, keeps nothing, and the
/// link goes on: the next export and a move through it work.
#[test]
fn a_refused_registration_is_a_typed_error_and_the_link_goes_on() {
    let (mut a, mut b) = pair();
    let squatter = pool(1);
    let map = Arc::new(squatter.map(Access::ReadWrite, 1).unwrap());
    let _taken = a.fabric.register(map, a.next_key, true).expect("a registration with the next key");
    let memory = pool(9);
    let e = a.export_pool(&memory).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Fabric(why) if why.contains("fi_mr_reg (a pool)")), "{e:?}");
    assert!(!a.pools.contains_key(&memory.id()) && a.backlog.is_empty(), "nothing kept or announced");
    // The link goes on: b takes the pool in, a exports it again and moves.
    b.import_pool(memory.id(), memory.geometry()).unwrap();
    let (key, base, _) = registered(&b, memory.id());
    share(&mut a, &mut b, &memory, key, base);
    let ours = memory.map(Access::ReadWrite, 1).unwrap();
    write_slot(&ours, 0, &[0x3c; 4096]);
    move_first(&mut a, &memory);
    let got = drive(&mut b, &mut a, |b| b.recv(&mut LandAll).unwrap());
    assert!(matches!(got, Message::Move { .. }), "{got:?}");
    let mut landed = vec![0u8; 4096];
    read_slot(b.pools.get(&memory.id()).unwrap().region.map(), 0, &mut landed);
    assert!(landed.iter().all(|&x| x == 0x3c), "the move's bytes did not land");
}

/// A peer that sends a message longer than a slot: the receive completes
/// with an error (truncated), and the link fails with a typed fabric error
/// as a death (what was lent comes back), within a bound.
#[test]
fn a_receive_completed_with_an_error_fails_the_link() {
    let (mut a, mut b) = pair();
    // Two idle send slots of b, next to each other: one send of both.
    let slot = b.free_tx.pop().unwrap();
    assert_eq!(b.free_tx.pop(), Some(slot + 1));
    write_slot(b.control.map(), slot * SLOT, &[0x11; 2 * SLOT]);
    drive(&mut b, &mut a, |b| match b.fabric.send(&b.control, slot * SLOT, 2 * SLOT, &b.contexts, slot) {
        Err(rc) if rc == -sys::EAGAIN => {
            let _ = b.flush();
            None
        }
        posted => {
            posted.unwrap();
            Some(())
        }
    });
    let deadline = Instant::now() + WITHIN;
    let e = loop {
        let mut done = [Completion::default(); 16];
        let _ = b.fabric.poll(&mut done);
        if let Err(e) = a.recv(&mut LandAll) {
            break e;
        }
        assert!(Instant::now() < deadline, "the oversized message went unnoticed");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(matches!(e.kind(), ErrorKind::Fabric(why) if why.contains("a receive failed")), "{e:?}");
    assert!(a.peer_died(), "a failed receive is the peer's loss: what was lent comes back");
}
