//! Targeted tests beside the model-based suite: for what it cannot reach
//! (a call the reference model has no operation for, `pass_unfilled`, and
//! a peer that breaks the wire format), and a sequence it found.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, BufferState, Channel, ChannelSetup, ChannelState, Direction, Domain, Endpoint, ErrorKind,
    Event, PoolConstraints, TrustLevel,
};
use support::payload::{check, fill};
use support::raw_peer::{RawPeer, FLAG_PAYLOAD, MOVE, PASS};

const T: Duration = Duration::from_secs(10);

fn next(ch: &mut Channel) -> Event {
    match ch.wait(Some(T)) {
        Ok(ev) => ev,
        Err(_) => panic!("no event within {T:?} (state {:?})", ch.state()),
    }
}

/// A connected pair over `ep`: (source end in `source`, sink end in `sink`).
fn connect(source: &Domain, sink: &Domain, ep: &Endpoint) -> (Channel, Channel) {
    let setup = ChannelSetup { direction: Direction::Tx, trust: TrustLevel::Full, ..ChannelSetup::default() };
    let mut tx = Channel::create(source, ep, setup).expect("create");
    let ep = match tx.listen_addr() {
        Some(addr) => Endpoint::tcp(addr),
        None => ep.clone(),
    };
    let mut rx = Channel::bind(sink, &ep, BindParams::default()).expect("bind");
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    assert!(matches!(next(&mut rx), Event::Bound));
    (tx, rx)
}

/// `pass_unfilled` is a pass: only the sink may call it. Called by the
/// source, on every backend, it is refused with `WrongDirection`, the
/// buffer handed back unchanged and still the caller's, and nothing
/// reaches the sink.
#[test]
fn pass_unfilled_from_the_source_is_refused() {
    let backends: [(&str, Endpoint); 3] = [
        ("local", Endpoint::local()),
        ("shm", Endpoint::shm_abstract(&support::unique_name("gaps"))),
        ("tcp", Endpoint::tcp("127.0.0.1:0".parse().unwrap())),
    ];
    for (name, ep) in backends {
        let (a, b) = (Domain::new("source"), Domain::new("sink"));
        let (mut tx, mut rx) = connect(&a, &b, &ep);
        let alloc = Allocator::new(&a, 2, 4096, PoolConstraints::default()).unwrap();
        tx.assign_pool(alloc.pool()).unwrap();
        tx.flush().unwrap();
        let Event::PoolAssignRequest(req) = next(&mut rx) else { panic!("{name}: no offer") };
        rx.respond_pool(req.pool, true).unwrap();
        rx.flush().unwrap();
        assert!(matches!(next(&mut tx), Event::PoolAssigned(_)), "{name}");

        let mut buf = alloc.alloc().unwrap();
        fill(buf.as_mut_slice().unwrap(), 3);
        let id = buf.id();
        let refused = tx.pass_unfilled(buf, &[]).expect_err("a source cannot pass");
        assert_eq!(refused.error, ErrorKind::WrongDirection, "{name}");
        let mut buf = refused.into_inner();
        assert_eq!(buf.id(), id, "{name}");
        assert!(check(&buf, 3), "{name}: the buffer changed");
        assert_eq!(a.buffer_state(id), BufferState::ReadWrite, "{name}");
        assert!(buf.as_mut_slice().is_ok(), "{name}: the buffer is still the caller's");
        tx.flush().unwrap();
        assert!(rx.poll().is_none(), "{name}: something reached the sink");
        // The channel still works: a move of the same buffer goes through.
        tx.move_buffer(buf, &[]).unwrap();
        tx.flush().unwrap();
        match next(&mut rx) {
            Event::MoveReceived { buffer, .. } => assert!(check(&buffer, 3), "{name}: the move lost its bytes"),
            ev => panic!("{name}: {ev:?}"),
        }
    }
}

/// A hostile peer moves back a buffer it holds (so the payload gate lets
/// the bytes land) with a payload length that is not the pool's buffer
/// size: shorter (the bytes would land inside another buffer) or longer
/// (they would run over the next buffers). Only the length check stands
/// between the frame and the victim's memory: the channel fails with a
/// protocol error, and every buffer the victim owns keeps its bytes.
#[test]
fn move_with_a_wrong_payload_length_is_a_protocol_error() {
    const SIZE: usize = 4096;
    for len in [100, SIZE - 1, SIZE + 1, 2 * SIZE] {
        let victim = Domain::new("victim");
        let setup = ChannelSetup { direction: Direction::Rx, trust: TrustLevel::Full, ..ChannelSetup::default() };
        let at: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut ch = Channel::create(&victim, &Endpoint::tcp(at), setup).unwrap();
        let addr = ch.listen_addr().unwrap();
        let (lent, go) = std::sync::mpsc::channel::<()>();
        let peer = std::thread::spawn(move || {
            let mut p = RawPeer::bind(addr);
            let (pool, size) = p.accept_pool();
            assert_eq!(size, SIZE);
            // The victim passes buffer 1: it is ours now.
            let h = p.next_frame();
            assert_eq!((h.kind, h.index, h.pool), (PASS, 1, pool), "{h:?}");
            go.recv().unwrap();
            p.frame(MOVE, FLAG_PAYLOAD, 1, len as u64, pool, &[], &vec![0xee; len]);
            p.drain();
        });
        assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
        let alloc = Allocator::new(&victim, 4, SIZE, PoolConstraints::default()).unwrap();
        let mut mine: Vec<_> = (0..4).map(|_| alloc.alloc().unwrap()).collect();
        for (i, b) in mine.iter_mut().enumerate() {
            fill(b.as_mut_slice().unwrap(), i as u64);
        }
        ch.assign_pool(alloc.pool()).unwrap();
        ch.flush().unwrap();
        assert!(matches!(next(&mut ch), Event::PoolAssigned(_)));
        let one = mine.remove(1);
        let id = one.id();
        ch.pass(one, &[]).unwrap();
        ch.flush().unwrap();
        lent.send(()).unwrap();

        let t = Instant::now();
        let why = loop {
            match ch.wait(Some(T)) {
                Ok(Event::Error(e)) if matches!(e.kind(), ErrorKind::Protocol(_)) => break e.to_string(),
                Ok(ev) => panic!("payload of {len} bytes: expected a protocol error, got {ev:?}"),
                Err(_) => assert!(t.elapsed() < T, "payload of {len} bytes: no error within {T:?}"),
            }
        };
        eprintln!("payload of {len} bytes: {why}");
        assert_eq!(ch.state(), ChannelState::Closed, "payload of {len} bytes");
        for (b, seed) in mine.iter_mut().zip([0, 2, 3]) {
            assert!(check(b, seed), "payload of {len} bytes: buffer {} changed", b.id().index);
            assert!(b.as_mut_slice().is_ok(), "payload of {len} bytes: buffer {} is still ours", b.id().index);
        }
        assert_eq!(victim.buffer_state(id), BufferState::Invalid, "payload of {len} bytes: buffer 1 is not ours");
        drop(ch);
        peer.join().unwrap();
    }
}

/// Over TCP, a pool offered, vetoed and offered again: a buffer passed
/// after the second offer was accepted arrives with its bytes (found by
/// the model-based suite: the receiver read zeros).
#[test]
fn tcp_pool_offered_again_after_a_veto_keeps_the_payload() {
    let (a, b) = (Domain::new("source"), Domain::new("creator"));
    let (mut tx, mut rx) = connect(&a, &b, &Endpoint::tcp("127.0.0.1:0".parse().unwrap()));
    let alloc = Allocator::new(&b, 2, 4096, PoolConstraints::default()).unwrap();
    let mut buf = alloc.alloc().unwrap();
    fill(buf.as_mut_slice().unwrap(), 42);
    for accept in [false, true] {
        rx.assign_pool(alloc.pool()).unwrap();
        rx.flush().unwrap();
        let Event::PoolAssignRequest(req) = next(&mut tx) else { panic!("no offer") };
        tx.respond_pool(req.pool, accept).unwrap();
        tx.flush().unwrap();
        match next(&mut rx) {
            Event::PoolVetoed(_) if !accept => {}
            Event::PoolAssigned(_) if accept => {}
            ev => panic!("{ev:?}"),
        }
    }
    rx.pass(buf, &[]).unwrap();
    rx.flush().unwrap();
    match next(&mut tx) {
        Event::BufferPassed { buffer, .. } => {
            assert!(check(&buffer, 42), "the passed buffer lost its bytes (it starts {:?})", &buffer[..8])
        }
        ev => panic!("{ev:?}"),
    }
}
