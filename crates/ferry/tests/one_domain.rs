//! Channels whose two ends belong to one domain (threads of one program
//! that use a single domain, as Ferry's C interface does): over a local
//! link at trust FULL a buffer moved or passed between the ends never
//! leaves the domain, so the domain's records of it do not change while it
//! travels (docs/SEMANTICS.md, "Both ends in one domain"). These tests hold
//! that to what a program can see: the bytes, the buffer states, the free
//! counts (no buffer lost when an end goes away with buffers in flight),
//! copies, and the protection of trust HALF, which keeps the full
//! accounting; and random sequences of every operation over two such
//! channels, checked after every step against where the program put each
//! buffer.
//!
//! Every wait has a timeout, so a bug fails a test instead of hanging it.

use std::collections::HashMap;
use std::time::Duration;

use ferry::BufferState::{Invalid, ReadOnlyOwned, ReadWrite};
use ferry::{
    Allocator, BindParams, Buffer, BufferCopy, BufferId, Channel, ChannelSetup, ChannelState, Domain, Endpoint,
    ErrorKind, Event, PoolConstraints, TrustLevel,
};
use proptest::prelude::*;

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 4096;

#[track_caller]
fn next(ch: &mut Channel) -> Event {
    match ch.wait(Some(T)) {
        Ok(ev) => ev,
        Err(e) => panic!("no event within {T:?}: {e:?}"),
    }
}

#[track_caller]
fn recv_buffer(ch: &mut Channel) -> (Buffer, Vec<u8>) {
    match next(ch) {
        Event::MoveReceived { buffer, meta } | Event::BufferPassed { buffer, meta } => (buffer, meta.to_vec()),
        other => panic!("expected a buffer, got {other:?}"),
    }
}

/// A local source→sink channel from `source` to `sink` at `trust`, with
/// `alloc`'s pool assigned: (source end, sink end).
fn channel(source: &Domain, sink: &Domain, trust: TrustLevel, alloc: &Allocator) -> (Channel, Channel) {
    let ep = Endpoint::local();
    let mut tx = Channel::create(source, &ep, ChannelSetup { trust, ..ChannelSetup::default() }).expect("create");
    let mut rx = Channel::bind(sink, &ep, BindParams::default()).expect("bind");
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    assert!(matches!(next(&mut rx), Event::Bound));
    tx.assign_pool(alloc.pool()).expect("assign");
    let Event::PoolAssignRequest(req) = next(&mut rx) else { panic!("expected the pool's offer") };
    rx.respond_pool(req.pool, true).expect("accept");
    assert!(matches!(next(&mut tx), Event::PoolAssigned(_)));
    (tx, rx)
}

/// [`channel`] with a new pool of `count` buffers of `source`: (source end,
/// sink end, allocator).
fn linked(source: &Domain, sink: &Domain, trust: TrustLevel, count: u64) -> (Channel, Channel, Allocator) {
    let alloc = Allocator::new(source, count, SIZE, PoolConstraints::default()).expect("allocator");
    let (tx, rx) = channel(source, sink, trust, &alloc);
    (tx, rx, alloc)
}

fn fill(buf: &mut [u8], seq: u64) {
    for (j, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(seq ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
    }
}

fn intact(buf: &[u8], seq: u64) -> bool {
    buf.chunks_exact(8)
        .enumerate()
        .all(|(j, w)| w == (seq ^ (j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes())
}

/// A moved buffer stays the domain's, read-write, while it is in the queue
/// (no end holds it: only the channel can give it back); it arrives with
/// its bytes, the sink's writes reach the source, and every buffer is
/// free again at the end.
#[test]
fn a_buffer_in_flight_stays_the_domains() {
    let d = Domain::new("one");
    let (mut tx, mut rx, alloc) = linked(&d, &d, TrustLevel::Full, 4);
    let pool = alloc.pool().id();
    let mut buf = alloc.alloc().expect("a buffer");
    let id = buf.id();
    fill(buf.as_mut_slice().expect("writable"), 7);
    tx.move_buffer(buf, b"seven").expect("move");
    assert_eq!(d.buffer_state(id), ReadWrite, "in flight within the domain");
    assert_eq!(d.free_count(pool), 3);

    let (mut got, meta) = recv_buffer(&mut rx);
    assert_eq!((got.id(), &meta[..]), (id, &b"seven"[..]));
    assert!(intact(&got, 7));
    got.as_mut_slice().expect("the sink may write")[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    rx.pass(got, b"back").expect("pass");
    assert_eq!(d.buffer_state(id), ReadWrite);

    let (back, meta) = recv_buffer(&mut tx);
    assert_eq!((back.id(), &meta[..]), (id, &b"back"[..]));
    assert_eq!(back[..8], u64::MAX.to_le_bytes());
    drop(back);
    assert_eq!(d.free_count(pool), 4, "every buffer is free again");
}

/// 20 000 buffers from one thread to another and back through a small
/// pool, every byte checked on arrival, each end in its own thread (the
/// case the shortcut is for); nothing is lost.
#[test]
fn a_stream_between_threads_of_one_domain_loses_nothing() {
    const N: u64 = 20_000;
    const POOL: u64 = 32;
    let d = Domain::new("one");
    let (mut tx, mut rx, alloc) = linked(&d, &d, TrustLevel::Full, POOL);
    let pool = alloc.pool().id();
    std::thread::scope(|s| {
        s.spawn(move || {
            for want in 0..N {
                let (mut buf, meta) = recv_buffer(&mut rx);
                assert_eq!(meta, want.to_le_bytes(), "in order");
                assert!(intact(&buf, want), "message {want} intact");
                buf.as_mut_slice().expect("the sink owns it")[..8].copy_from_slice(&(!want).to_le_bytes());
                rx.pass(buf, &meta).expect("pass");
            }
            rx.flush().expect("flush");
        });
        let (mut sent, mut back) = (0u64, 0u64);
        while back < N {
            while sent < N {
                let Some(mut buf) = alloc.alloc() else { break };
                fill(buf.as_mut_slice().expect("free buffers are writable"), sent);
                tx.move_buffer(buf, &sent.to_le_bytes()).expect("move");
                sent += 1;
            }
            let (buf, meta) = recv_buffer(&mut tx);
            assert_eq!(meta, back.to_le_bytes());
            assert_eq!(buf[..8], (!back).to_le_bytes(), "the sink's write is visible");
            back += 1;
        }
    });
    assert_eq!(d.free_count(pool), POOL as usize);
}

/// A sink dropped with moves still queued to it takes them in (they are
/// the domain's and go to the free list), and a source dropped with passes
/// queued to it does the same: no buffer stays behind.
#[test]
fn an_end_dropped_with_buffers_in_flight_frees_them() {
    const POOL: u64 = 8;
    let d = Domain::new("one");
    let (mut tx, rx, alloc) = linked(&d, &d, TrustLevel::Full, POOL);
    let pool = alloc.pool().id();
    for i in 0..5u64 {
        tx.move_buffer(alloc.alloc().expect("a buffer"), &i.to_le_bytes()).expect("move");
    }
    tx.flush().expect("flush");
    drop(rx);
    match next(&mut tx) {
        Event::Closed { .. } | Event::Error(_) => {}
        other => panic!("expected the close, got {other:?}"),
    }
    assert_eq!(d.free_count(pool), POOL as usize, "the dropped sink's buffers are free");

    let (mut tx, mut rx, alloc) = linked(&d, &d, TrustLevel::Full, POOL);
    let pool = alloc.pool().id();
    for _ in 0..3 {
        tx.move_buffer(alloc.alloc().expect("a buffer"), b"").expect("move");
    }
    for _ in 0..3 {
        let (buf, _) = recv_buffer(&mut rx);
        rx.pass(buf, b"").expect("pass");
    }
    rx.flush().expect("flush");
    drop(tx);
    assert!(matches!(next(&mut rx), Event::Closed { .. } | Event::Error(_)));
    drop(rx);
    assert_eq!(d.free_count(pool), POOL as usize, "the dropped source's passes are free");
}

/// Moves sent before a teardown still arrive, then the close.
#[test]
fn teardown_delivers_the_moves_before_it() {
    let d = Domain::new("one");
    let (mut tx, mut rx, alloc) = linked(&d, &d, TrustLevel::Full, 4);
    let pool = alloc.pool().id();
    for i in 0..3u64 {
        let mut buf = alloc.alloc().expect("a buffer");
        fill(buf.as_mut_slice().expect("writable"), i);
        tx.move_buffer(buf, &i.to_le_bytes()).expect("move");
    }
    tx.teardown().expect("teardown");
    for i in 0..3u64 {
        let (buf, meta) = recv_buffer(&mut rx);
        assert_eq!(meta, i.to_le_bytes());
        assert!(intact(&buf, i));
    }
    assert!(matches!(next(&mut rx), Event::Closed { by_peer: true }));
    assert!(matches!(next(&mut tx), Event::Closed { by_peer: false }));
    assert_eq!(rx.state(), ChannelState::Closed);
    assert_eq!(d.free_count(pool), 4, "the received buffers went back when dropped");
}

/// Copies keep the domain's accounting: a buffer moved in, then copied on
/// over a second channel of the same domain, is read-only while the copy is
/// out, cannot be passed back until it returns, and can be after.
#[test]
fn copies_of_a_moved_buffer_keep_it_read_only_until_they_return() {
    let d = Domain::new("one");
    let (mut tx, mut rx, alloc) = linked(&d, &d, TrustLevel::Full, 4);
    // A second channel, from the sink's side to a third end, with the pool.
    let (mut fwd, mut third) = channel(&d, &d, TrustLevel::Full, &alloc);

    tx.move_buffer(alloc.alloc().expect("a buffer"), b"").expect("move");
    let (buf, _) = recv_buffer(&mut rx);
    let id = buf.id();
    fwd.copy(&buf, b"").expect("copy");
    assert_eq!(d.buffer_state(id), ReadOnlyOwned);
    let buf = match rx.pass(buf, b"") {
        Err(r) => {
            assert_eq!(r.error, ErrorKind::CopiesOutstanding);
            r.into_inner()
        }
        Ok(()) => panic!("passed a buffer whose copy is out"),
    };
    let Event::CopyReceived { copy, .. } = next(&mut third) else { panic!("expected the copy") };
    third.release(copy).expect("release");
    third.flush().expect("flush");
    assert!(matches!(next(&mut fwd), Event::CopyReleased { .. }));
    assert_eq!(d.buffer_state(id), ReadWrite);
    rx.pass(buf, b"").expect("pass once the copy is back");
    let (back, _) = recv_buffer(&mut tx);
    assert_eq!(back.id(), id);
}

/// At trust HALF nothing changes: a buffer in flight within one domain is
/// the domain's no more (INVALID) until it arrives, so its pages are
/// protected while it travels, as between two domains.
#[test]
fn trust_half_keeps_a_buffer_in_flight_out_of_reach() {
    let d = Domain::new("one");
    let (mut tx, mut rx, alloc) = linked(&d, &d, TrustLevel::Half, 4);
    let buf = alloc.alloc().expect("a buffer");
    let id = buf.id();
    tx.move_buffer(buf, b"").expect("move");
    assert_eq!(d.buffer_state(id), Invalid, "given away until it arrives");
    let (buf, _) = recv_buffer(&mut rx);
    assert_eq!(d.buffer_state(id), ReadWrite);
    rx.pass(buf, b"").expect("pass");
    assert_eq!(d.buffer_state(id), Invalid);
    drop(recv_buffer(&mut tx));
}

/// Two domains never take the shortcut, whatever the trust: a moved
/// buffer is the source's no more.
#[test]
fn two_domains_keep_the_records_of_a_buffer_in_flight() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let (mut tx, mut rx, alloc) = linked(&a, &b, TrustLevel::Full, 4);
    let buf = alloc.alloc().expect("a buffer");
    let id = buf.id();
    tx.move_buffer(buf, b"").expect("move");
    assert_eq!((a.buffer_state(id), b.buffer_state(id)), (Invalid, Invalid));
    let (buf, _) = recv_buffer(&mut rx);
    assert_eq!((a.buffer_state(id), b.buffer_state(id)), (Invalid, ReadWrite));
    drop(buf);
}

// ---------------------------------------------------------------------------
// Random sequences: moves, passes, copies, releases, writes, drops and polls
// over two one-domain channels sharing a pool, against what the program
// knows of every buffer.

/// What the program knows of one buffer of the pool.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Where {
    /// In the allocator.
    Free,
    /// A handle the program holds (index in `held`).
    Held,
    /// Moved or passed over channel `.0`, not received yet.
    InFlight(usize),
}

struct Sim {
    d: Domain,
    alloc: Allocator,
    /// (source end, sink end) of each channel.
    chans: Vec<(Channel, Channel)>,
    held: Vec<Buffer>,
    /// Copies received, with the channel they came over.
    copies: Vec<(usize, BufferCopy)>,
    at: HashMap<BufferId, Where>,
    /// The pattern each buffer holds.
    seed: HashMap<BufferId, u64>,
    /// Copies sent and not yet reported released, per buffer.
    copies_out: HashMap<BufferId, u32>,
    next_seed: u64,
}

const POOL: u64 = 6;

impl Sim {
    fn new() -> Sim {
        let d = Domain::new("one");
        let alloc = Allocator::new(&d, POOL, SIZE, PoolConstraints::default()).expect("allocator");
        let chans = (0..2).map(|_| channel(&d, &d, TrustLevel::Full, &alloc)).collect();
        let pool = alloc.pool().id();
        let at = (0..POOL as u32).map(|index| (BufferId { pool, index }, Where::Free)).collect();
        Sim {
            d,
            alloc,
            chans,
            held: Vec::new(),
            copies: Vec::new(),
            at,
            seed: HashMap::new(),
            copies_out: HashMap::new(),
            next_seed: 1,
        }
    }

    fn take_held(&mut self, k: usize) -> Option<Buffer> {
        (!self.held.is_empty()).then(|| self.held.swap_remove(k % self.held.len()))
    }

    fn receive(&mut self, buffer: Buffer, meta: &[u8], chan: usize) {
        let id = buffer.id();
        assert_eq!(self.at[&id], Where::InFlight(chan), "{id} arrived over channel {chan}");
        let want = self.seed[&id];
        assert_eq!(meta, want.to_le_bytes(), "the meta data sent with {id}");
        assert!(intact(&buffer, want), "{id} holds its pattern");
        self.at.insert(id, Where::Held);
        self.held.push(buffer);
    }

    /// Takes what end `end` of channel `chan` has (true: the source end).
    fn poll(&mut self, chan: usize, source_end: bool) {
        loop {
            let ev = {
                let (tx, rx) = &mut self.chans[chan];
                if source_end {
                    tx.poll()
                } else {
                    rx.poll()
                }
            };
            match ev {
                None => return,
                Some(Event::MoveReceived { buffer, meta }) if !source_end => self.receive(buffer, &meta, chan),
                Some(Event::BufferPassed { buffer, meta }) if source_end => self.receive(buffer, &meta, chan),
                Some(Event::CopyReceived { copy, meta }) if !source_end => {
                    let want = self.seed[&copy.id()];
                    assert_eq!(&meta[..], &want.to_le_bytes()[..]);
                    assert!(intact(&copy, want), "the copy of {} holds its pattern", copy.id());
                    self.copies.push((chan, copy));
                }
                Some(Event::CopyReleased { buffer, .. }) if source_end => {
                    let n = self.copies_out.get_mut(&buffer).expect("a copy was out");
                    *n -= 1;
                }
                Some(other) => panic!("unexpected {other:?} on channel {chan}"),
            }
        }
    }

    fn step(&mut self, (kind, a, b): (u8, u8, u8)) {
        let chan = usize::from(b) % self.chans.len();
        match kind % 9 {
            0 => {
                if let Some(mut buf) = self.alloc.alloc() {
                    let id = buf.id();
                    assert_eq!(self.at[&id], Where::Free);
                    let s = self.next_seed;
                    self.next_seed += 1;
                    fill(buf.as_mut_slice().expect("a fresh buffer is writable"), s);
                    self.seed.insert(id, s);
                    self.at.insert(id, Where::Held);
                    self.held.push(buf);
                }
            }
            // A move over a channel's source end, a pass over its sink end.
            1 | 2 => {
                let Some(buf) = self.take_held(usize::from(a)) else { return };
                let id = buf.id();
                let meta = self.seed[&id].to_le_bytes();
                let (tx, rx) = &mut self.chans[chan];
                let sent = if kind % 9 == 1 { tx.move_buffer(buf, &meta) } else { rx.pass(buf, &meta) };
                match sent {
                    Ok(()) => {
                        assert_eq!(self.copies_out.get(&id).copied().unwrap_or(0), 0, "sent {id} with copies out");
                        self.at.insert(id, Where::InFlight(chan));
                    }
                    Err(r) if r.error == ErrorKind::QueueFull => self.held.push(r.into_inner()),
                    Err(r) => {
                        assert_eq!(r.error, ErrorKind::CopiesOutstanding, "refused {id}");
                        assert!(self.copies_out[&id] > 0);
                        self.held.push(r.into_inner());
                    }
                }
            }
            3 => {
                if self.held.is_empty() {
                    return;
                }
                let k = usize::from(a) % self.held.len();
                let id = self.held[k].id();
                match self.chans[chan].0.copy(&self.held[k], &self.seed[&id].to_le_bytes()) {
                    Ok(()) => *self.copies_out.entry(id).or_insert(0) += 1,
                    Err(e) => assert_eq!(e, ErrorKind::QueueFull, "copy of {id}"),
                }
            }
            4 => {
                if self.copies.is_empty() {
                    return;
                }
                let (via, copy) = self.copies.swap_remove(usize::from(a) % self.copies.len());
                if let Err(r) = self.chans[via].1.release(copy) {
                    assert_eq!(r.error, ErrorKind::QueueFull, "release");
                    self.copies.push((via, r.into_inner()));
                }
            }
            5 => {
                if self.held.is_empty() {
                    return;
                }
                let k = usize::from(a) % self.held.len();
                let id = self.held[k].id();
                let out = self.copies_out.get(&id).copied().unwrap_or(0);
                let s = self.next_seed;
                match self.held[k].as_mut_slice() {
                    Ok(bytes) => {
                        assert_eq!(out, 0, "{id} writable with copies out");
                        fill(bytes, s);
                        self.seed.insert(id, s);
                        self.next_seed += 1;
                    }
                    Err(e) => {
                        assert_eq!(e, ErrorKind::CopiesOutstanding);
                        assert!(out > 0, "{id} refused without copies out");
                    }
                }
            }
            6 => {
                // A buffer with no copies out goes back to the allocator.
                if self.held.is_empty() {
                    return;
                }
                let k = usize::from(a) % self.held.len();
                let id = self.held[k].id();
                if self.copies_out.get(&id).copied().unwrap_or(0) == 0 {
                    drop(self.held.swap_remove(k));
                    self.at.insert(id, Where::Free);
                }
            }
            7 => self.poll(chan, a % 2 == 0),
            _ => {
                for (tx, rx) in &mut self.chans {
                    tx.flush().expect("flush");
                    rx.flush().expect("flush");
                }
            }
        }
    }

    /// What the domain says of every buffer agrees with where the program
    /// put it, and the allocator holds exactly the free ones.
    fn check(&self) {
        let mut free = 0;
        for (&id, &at) in &self.at {
            let out = self.copies_out.get(&id).copied().unwrap_or(0);
            let owned = if out == 0 { ReadWrite } else { ReadOnlyOwned };
            let want = match at {
                // A free buffer is the domain's (on its free list).
                Where::Free => {
                    free += 1;
                    ReadWrite
                }
                // In flight between two ends of the domain: still its own.
                Where::Held | Where::InFlight(_) => owned,
            };
            assert_eq!(self.d.buffer_state(id), want, "{id}, {at:?}, {out} copies out");
        }
        assert_eq!(self.alloc.available(), free, "the allocator holds the free buffers");
    }

    /// Takes everything in, gives every copy back and every buffer to the
    /// allocator: the pool is whole again.
    fn finish(mut self) {
        for _ in 0..8 {
            for c in 0..self.chans.len() {
                for end in [true, false] {
                    self.poll(c, end);
                }
            }
            while let Some((via, copy)) = self.copies.pop() {
                self.chans[via].1.release(copy).expect("release at the end");
            }
            for (tx, rx) in &mut self.chans {
                tx.flush().expect("flush");
                rx.flush().expect("flush");
            }
        }
        assert!(self.copies_out.values().all(|&n| n == 0), "every copy came back");
        for buf in std::mem::take(&mut self.held) {
            let id = buf.id();
            drop(buf);
            self.at.insert(id, Where::Free);
        }
        assert!(self.at.values().all(|&w| w == Where::Free), "nothing left in flight: {:?}", self.at);
        self.check();
        assert_eq!(self.alloc.available(), POOL as usize);
    }
}

fn raw_step() -> impl Strategy<Value = (u8, u8, u8)> {
    (any::<u8>(), any::<u8>(), any::<u8>())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random allocations, moves, passes, copies, releases, writes, drops,
    /// polls and flushes over two channels of one domain sharing a pool:
    /// after every step each buffer's state is what the program can tell
    /// (read-write, or read-only-owned while copies are out, also in
    /// flight and when free), every buffer and copy arrives with its
    /// bytes and meta data, and at the end the whole pool is free again.
    #[test]
    fn random_sequences_keep_every_buffer_accounted_for(steps in proptest::collection::vec(raw_step(), 1..160)) {
        let mut sim = Sim::new();
        for s in steps {
            sim.step(s);
            sim.check();
        }
        sim.finish();
    }
}
