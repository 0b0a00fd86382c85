//! The fabric backend over real libfabric: the `tcp` provider (through
//! `ofi_rxm` for its reliable datagram endpoints) on loopback. Moves,
//! passes and copies between two domains with every byte checked, two
//! processes moving 1 GiB, a peer killed with SIGKILL, and providers that
//! cannot serve the backend.

mod support;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, BufferState, Channel, ChannelSetup, Direction, Domain, Endpoint, Error, Event,
    FabricOptions, PoolConstraints, Role, TrustLevel,
};

use support::payload::{check, fill};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;

fn options() -> FabricOptions {
    FabricOptions::default().with_provider("tcp")
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn seq_of(meta: &[u8]) -> u64 {
    u64::from_le_bytes(meta[..8].try_into().unwrap())
}

fn next(ch: &mut Channel) -> Event {
    match ch.wait(Some(T)) {
        Some(ev) => ev,
        None => panic!("no event within {T:?} (state {:?})", ch.state()),
    }
}

/// A TX master listening on loopback, and the address to bind to.
fn listen(domain: &Domain, trust: TrustLevel) -> (Channel, SocketAddr) {
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, trust, ..ChannelSetup::default() };
    let ch = Channel::create(domain, &Endpoint::fabric_with(loopback(), options()), setup).expect("create");
    let addr = ch.listen_addr().expect("listening");
    (ch, addr)
}

fn assign(ch: &mut Channel, alloc: &Allocator) {
    ch.assign_pool(alloc.pool()).unwrap();
    match next(ch) {
        Event::PoolAssigned(_) => {}
        ev => panic!("expected the pool assigned, got {ev:?}"),
    }
}

/// Moves, passes and copies between two domains of this process, every
/// byte checked on arrival; the counters show every payload went by RMA
/// straight from buffer to buffer.
fn flows_at(trust: TrustLevel) {
    let src = Domain::new("src");
    let (mut tx, addr) = listen(&src, trust);
    let sink = std::thread::spawn(move || {
        let d = Domain::new("sink");
        let mut rx = Channel::bind(&d, &Endpoint::fabric_with(addr, options()), BindParams::default()).unwrap();
        let mut copies = Vec::new();
        loop {
            match next(&mut rx) {
                Event::Bound => {}
                Event::PoolAssignRequest(req) => rx.respond_pool(req.pool, true).unwrap(),
                Event::MoveReceived { mut buffer, meta } => {
                    let seq = seq_of(&meta);
                    assert!(check(&buffer, seq), "move {seq} arrived corrupted");
                    fill(buffer.as_mut_slice().unwrap(), seq + 1);
                    rx.pass(buffer, &meta).unwrap();
                }
                Event::CopyReceived { copy, meta } => {
                    assert!(check(&copy, seq_of(&meta)), "copy arrived corrupted");
                    copies.push(copy);
                    if copies.len() == 4 {
                        for c in copies.drain(..) {
                            rx.release(c).unwrap();
                        }
                    }
                }
                Event::Closed { .. } => break,
                ev => panic!("sink: unexpected {ev:?}"),
            }
        }
        rx.link_stats()
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    let alloc = Allocator::new(&src, 8, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut tx, &alloc);
    let total = 200u64;
    support::payload::move_and_take_back(&mut tx, &alloc, total, |seq| seq + 1);
    let mut b = alloc.alloc().unwrap();
    fill(b.as_mut_slice().unwrap(), 7);
    for _ in 0..4 {
        tx.copy(&b, &7u64.to_le_bytes()).unwrap();
    }
    assert_eq!(src.buffer_state(b.id()), BufferState::ReadOnlyOwned);
    let mut released = 0;
    while released < 4 {
        match next(&mut tx) {
            Event::CopyReleased { writable, .. } => {
                released += 1;
                assert_eq!(writable, released == 4);
            }
            ev => panic!("unexpected {ev:?}"),
        }
    }
    assert!(b.as_mut_slice().is_ok());
    drop(b);
    tx.teardown().unwrap();
    assert!(matches!(next(&mut tx), Event::Closed { by_peer: false }));
    let ours = tx.link_stats().expect("the fabric backend counts");
    let theirs = sink.join().unwrap().expect("the fabric backend counts");
    let moved = total * SIZE as u64;
    // The first copy carries the bytes; the next three find them there.
    assert_eq!(ours.payload_sent, moved + SIZE as u64, "{ours:?}");
    assert_eq!(ours.payload_received, moved, "{ours:?}");
    assert_eq!(theirs.payload_received, moved + SIZE as u64, "{theirs:?}");
    assert_eq!((ours.payload_staged, theirs.payload_staged), (0, 0), "no payload byte copied in user space");
    assert_eq!(alloc.available(), 8);
}

#[test]
fn flows_full_trust() {
    flows_at(TrustLevel::Full);
}

#[test]
fn flows_half_trust() {
    flows_at(TrustLevel::Half);
}
