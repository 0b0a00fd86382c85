//! Integration tests of Ferry over the local backend, through the public API
//! only: flows across real threads, zero copy, every typed error that the
//! handle API can produce (docs/SEMANTICS.md, "Operations: preconditions"),
//! vetoes, copies, pool removal, teardown, drops, and the page protection of
//! trust HALF (read from /proc/self/maps, and a real fault in a child process).
//!
//! Every wait has a timeout, so a bug fails a test instead of hanging it.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ferry::BufferState::{Invalid, ReadOnly, ReadOnlyOwned, ReadWrite};
use ferry::{
    Allocator, BindParams, Buffer, BufferCopy, BufferId, BufferState, Channel, ChannelConstraints, ChannelSetup,
    ChannelState, Direction, Domain, Endpoint, Error, ErrorKind, Event, Meta, Pool, PoolConstraints, PoolId,
    PoolRequest, Refused, Role, TrustLevel, WaitError, MAX_META_SIZE,
};

/// Upper bound of every wait: long enough for a loaded CI machine, short
/// enough that a lost message fails the test.
const T: Duration = Duration::from_secs(10);

/// Buffers in the pools of the small tests.
const COUNT: u64 = 8;

// ---------------------------------------------------------------------------
// Helpers.

/// The page size (AT_PAGESZ from the auxiliary vector), which is also the
/// smallest buffer size.
fn page() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        let auxv = std::fs::read("/proc/self/auxv").expect("read /proc/self/auxv");
        let word = |b: &[u8]| u64::from_ne_bytes(b.try_into().expect("8 bytes"));
        auxv.chunks_exact(16)
            .map(|e| (word(&e[..8]), word(&e[8..])))
            .find(|&(key, _)| key == 6) // AT_PAGESZ
            .map(|(_, v)| v as usize)
            .expect("AT_PAGESZ in auxv")
    })
}

fn new_alloc(d: &Domain, count: u64) -> Allocator {
    Allocator::new(d, count, page(), PoolConstraints::default()).expect("allocator")
}

/// The next event on `ch`, failing the test after `T`.
#[track_caller]
fn next(ch: &mut Channel) -> Event {
    match ch.wait(Some(T)) {
        Ok(ev) => ev,
        Err(_) => panic!("no event within {T:?} on {ch:?}"),
    }
}

/// `ch` has nothing to report.
#[track_caller]
fn assert_quiet(ch: &mut Channel) {
    if let Some(ev) = ch.poll() {
        panic!("unexpected event {ev:?} on {ch:?}");
    }
}

#[track_caller]
fn recv_move(ch: &mut Channel) -> (Buffer, Meta) {
    match next(ch) {
        Event::MoveReceived { buffer, meta } => (buffer, meta),
        other => panic!("expected MoveReceived, got {other:?}"),
    }
}

#[track_caller]
fn recv_pass(ch: &mut Channel) -> (Buffer, Meta) {
    match next(ch) {
        Event::BufferPassed { buffer, meta } => (buffer, meta),
        other => panic!("expected BufferPassed, got {other:?}"),
    }
}

#[track_caller]
fn recv_copy(ch: &mut Channel) -> (BufferCopy, Meta) {
    match next(ch) {
        Event::CopyReceived { copy, meta } => (copy, meta),
        other => panic!("expected CopyReceived, got {other:?}"),
    }
}

/// The next event is `CopyReleased` for `id`; returns its `writable`.
#[track_caller]
fn recv_released(ch: &mut Channel, id: BufferId) -> bool {
    match next(ch) {
        Event::CopyReleased { buffer, writable } => {
            assert_eq!(buffer, id);
            writable
        }
        other => panic!("expected CopyReleased, got {other:?}"),
    }
}

#[track_caller]
fn recv_request(ch: &mut Channel) -> PoolRequest {
    match next(ch) {
        Event::PoolAssignRequest(req) => req,
        other => panic!("expected PoolAssignRequest, got {other:?}"),
    }
}

/// The next event is exactly `want` (for the events without handles).
#[track_caller]
fn expect(ch: &mut Channel, want: &str) {
    let got = format!("{:?}", next(ch));
    assert_eq!(got, want);
}

/// The operation was refused with exactly `want`; the consumed value back.
#[track_caller]
fn refused<T: std::fmt::Debug>(r: Result<(), Refused<T>>, want: Error) -> T {
    match r {
        Ok(()) => panic!("operation succeeded, expected {want:?}"),
        Err(e) => {
            assert_eq!(e.error, want);
            e.into_inner()
        }
    }
}

/// Create on a fresh local endpoint in `creator`, bind from `binder`, and
/// complete the handshake. Returns (creator's end, binder's end).
fn connect(creator: &Domain, binder: &Domain, setup: ChannelSetup, params: BindParams) -> (Channel, Channel) {
    let ep = Endpoint::local();
    let mut c = Channel::create(creator, &ep, setup).expect("create");
    let mut b = Channel::bind(binder, &ep, params).expect("bind");
    assert!(matches!(next(&mut c), Event::BindRequest { .. }));
    assert!(matches!(next(&mut b), Event::Bound));
    assert_eq!((c.state(), b.state()), (ChannelState::Connected, ChannelState::Connected));
    (c, b)
}

/// A source→sink channel of the given trust: (source end, sink end).
fn link(source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
    let (tx, rx) = connect(source, sink, ChannelSetup { trust, ..ChannelSetup::default() }, BindParams::default());
    assert_eq!((tx.direction(), rx.direction()), (Direction::Tx, Direction::Rx));
    (tx, rx)
}

/// Two-phase assignment of `pool` by `from`, accepted by `to`.
#[track_caller]
fn assign(from: &mut Channel, to: &mut Channel, pool: &Pool) {
    let id = pool.id();
    from.assign_pool(pool).expect("assign_pool");
    let req = recv_request(to);
    assert_eq!(req.pool, id);
    to.respond_pool(id, true).expect("respond_pool");
    expect(from, &format!("{:?}", Event::PoolAssigned(id)));
    assert!(from.is_assigned(id) && to.is_assigned(id));
}

/// Domain `a` sources a channel to `b`, with a pool of `a` assigned.
struct Fx {
    a: Domain,
    b: Domain,
    tx: Channel,
    rx: Channel,
    alloc: Allocator,
}

impl Fx {
    fn pool(&self) -> PoolId {
        self.alloc.pool().id()
    }

    fn buf(&self) -> Buffer {
        self.alloc.alloc().expect("a free buffer")
    }

    /// `[state in a, state in b]`.
    fn states(&self, id: BufferId) -> [BufferState; 2] {
        [self.a.buffer_state(id), self.b.buffer_state(id)]
    }

    /// Move a fresh buffer to `b`; `b`'s handle.
    fn moved(&mut self) -> Buffer {
        let buf = self.buf();
        self.tx.move_buffer(buf, b"").expect("move");
        recv_move(&mut self.rx).0
    }

    /// The address of buffer `index` in `a`'s and in `b`'s view of the pool.
    fn addrs(&self, index: u32) -> (usize, usize) {
        let off = index as usize * page();
        let b_pool = self.b.pool(self.pool()).expect("b knows the pool");
        (self.alloc.pool().base_address() + off, b_pool.base_address() + off)
    }
}

fn fixture(trust: TrustLevel) -> Fx {
    fixture_with(ChannelSetup { trust, ..ChannelSetup::default() })
}

fn fixture_with(setup: ChannelSetup) -> Fx {
    assert_eq!(setup.direction, Direction::Tx);
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let (mut tx, mut rx) = connect(&a, &b, setup, BindParams::default());
    let alloc = new_alloc(&a, COUNT);
    assign(&mut tx, &mut rx, alloc.pool());
    Fx { a, b, tx, rx, alloc }
}

/// A→B→C: the fixture plus a channel from `b` to a third domain `c`, with
/// `a`'s pool assigned to it by `b`.
struct Chain {
    f: Fx,
    c: Domain,
    btx: Channel,
    crx: Channel,
}

fn chain() -> Chain {
    let f = fixture(TrustLevel::Full);
    let c = Domain::new("c");
    let (mut btx, mut crx) = link(&f.b, &c, TrustLevel::Full);
    assign(&mut btx, &mut crx, &f.b.pool(f.pool()).expect("b accepted the pool"));
    Chain { f, c, btx, crx }
}

impl Chain {
    /// `[a, b, c]` states.
    fn states(&self, id: BufferId) -> [BufferState; 3] {
        [self.f.a.buffer_state(id), self.f.b.buffer_state(id), self.c.buffer_state(id)]
    }
}

/// Permissions ("rw-", "r--", "---") of the mapping that contains `addr`.
fn perms(addr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (range, perms) = (fields.next().expect("range"), fields.next().expect("perms"));
        let (lo, hi) = range.split_once('-').expect("lo-hi");
        let lo = usize::from_str_radix(lo, 16).expect("hex");
        let hi = usize::from_str_radix(hi, 16).expect("hex");
        if (lo..hi).contains(&addr) {
            return perms[..3].to_owned();
        }
    }
    panic!("no mapping contains {addr:#x}");
}

/// Word `j` of the test pattern of message `seq`.
fn word(seq: u64, j: usize) -> u64 {
    seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (j as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ 0x5555
}

fn fill(buf: &mut [u8], seq: u64) {
    for (j, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&word(seq, j).to_le_bytes());
    }
}

/// Index of the first 8-byte word of `buf` that differs from pattern `seq`.
fn mismatch(buf: &[u8], seq: u64) -> Option<usize> {
    mismatch_from(buf, seq, 0)
}

/// As [`mismatch`], ignoring the first `skip` words.
fn mismatch_from(buf: &[u8], seq: u64, skip: usize) -> Option<usize> {
    buf.chunks_exact(8).enumerate().skip(skip).find(|&(j, w)| w != word(seq, j).to_le_bytes()).map(|(j, _)| j)
}

fn seq_of(meta: &[u8]) -> u64 {
    u64::from_le_bytes(meta.try_into().expect("8-byte meta"))
}

// ---------------------------------------------------------------------------
// 1. Flows across real threads.

const FLOW_N: u64 = 10_000;

/// The transmit-master flow of [`FLOW_N`] buffers from `tx` to `rx` and
/// back (see `transmit_master_flow_across_threads`), every byte, meta and
/// stamp checked in order; returns the sink's end.
fn transmit_flow(tx: &mut Channel, mut rx: Channel, alloc: &Allocator) -> Channel {
    std::thread::scope(|s| {
        let sink = s.spawn(move || {
            for want in 0..FLOW_N {
                let (mut buf, meta) = recv_move(&mut rx);
                assert_eq!(seq_of(&meta), want, "moves arrive in order");
                assert_eq!(mismatch(&buf, want), None, "payload of message {want}");
                buf.as_mut_slice().expect("sink owns it read-write")[..8].copy_from_slice(&(!want).to_le_bytes());
                rx.pass(buf, &meta).expect("pass back");
            }
            // With batching on, the last passes wait for a flush.
            rx.flush().expect("flush");
            rx
        });
        let (mut sent, mut back) = (0u64, 0u64);
        while back < FLOW_N {
            while sent < FLOW_N {
                let Some(mut buf) = alloc.alloc() else { break };
                fill(buf.as_mut_slice().expect("fresh buffer is writable"), sent);
                tx.move_buffer(buf, &sent.to_le_bytes()).expect("move");
                sent += 1;
            }
            let (buf, meta) = recv_pass(tx);
            assert_eq!(seq_of(&meta), back, "passes arrive in order");
            assert_eq!(buf[..8], (!back).to_le_bytes(), "the sink's stamp is visible to the source");
            assert_eq!(mismatch_from(&buf, back, 1), None, "the rest of message {back} is intact");
            back += 1;
        }
        sink.join().expect("sink thread")
    })
}

/// Transmit master ([ETH-BT] §5.2.4): the source allocates, assigns and moves
/// 10 000 patterned buffers (meta = sequence number) from a small pool; the
/// sink thread checks every byte and meta in order, stamps the buffer and
/// passes it back; the source checks the stamp. At the end every buffer is
/// back on the source's free list and the sink owns none.
#[test]
fn transmit_master_flow_across_threads() {
    const POOL: u64 = 64;
    let (a, b) = (Domain::new("source"), Domain::new("sink"));
    let (mut tx, mut rx) = link(&a, &b, TrustLevel::Full);
    let alloc = new_alloc(&a, POOL);
    let pool = alloc.pool().id();
    assign(&mut tx, &mut rx, alloc.pool());

    let rx = transmit_flow(&mut tx, rx, &alloc);
    assert_eq!(b.free_count(pool), 0);
    drop(rx);
    assert_eq!(alloc.available(), POOL as usize, "every buffer is back in the allocator");
    for index in 0..POOL as u32 {
        let id = BufferId { pool, index };
        assert_eq!((a.buffer_state(id), b.buffer_state(id)), (ReadWrite, Invalid));
    }
}

/// Receive master ([ETH-BT] §5.2.4): the sink creates the channel as master,
/// allocates and assigns the pool, and passes its empty buffers to the
/// source first; the source thread fills each buffer it gets and moves it;
/// the sink checks them and passes them back until 10 000 have travelled.
/// At the end all buffers are back in the sink's allocator.
#[test]
fn receive_master_flow_across_threads() {
    const POOL: u64 = 32;
    let (a, b) = (Domain::new("source"), Domain::new("sink"));
    let ep = Endpoint::local();
    let setup = ChannelSetup { direction: Direction::Rx, role: Role::Master, ..ChannelSetup::default() };
    let mut rx = Channel::create(&b, &ep, setup).expect("create");
    let mut tx = Channel::bind(&a, &ep, BindParams::default()).expect("bind");
    assert!(matches!(next(&mut rx), Event::BindRequest { binder_role: Role::Slave }));
    assert!(matches!(next(&mut tx), Event::Bound));
    assert_eq!((tx.direction(), tx.role(), rx.role()), (Direction::Tx, Role::Slave, Role::Master));

    let alloc = new_alloc(&b, POOL);
    let pool = alloc.pool().id();
    assign(&mut rx, &mut tx, alloc.pool());
    while let Some(buf) = alloc.alloc() {
        rx.pass(buf, b"").expect("pass an empty buffer");
    }

    std::thread::scope(|s| {
        let source = s.spawn(move || {
            for seq in 0..FLOW_N {
                let (mut buf, meta) = recv_pass(&mut tx);
                assert!(meta.is_empty());
                assert_eq!(a.buffer_state(buf.id()), ReadWrite);
                fill(buf.as_mut_slice().expect("passed buffer is writable"), seq);
                tx.move_buffer(buf, &seq.to_le_bytes()).expect("move");
            }
            assert_eq!(a.free_count(pool), 0, "the source kept nothing");
            tx
        });

        for want in 0..FLOW_N {
            let (buf, meta) = recv_move(&mut rx);
            assert_eq!(seq_of(&meta), want);
            assert_eq!(mismatch(&buf, want), None, "payload of message {want}");
            if want + POOL < FLOW_N {
                rx.pass(buf, b"").expect("pass back");
            }
        }
        let tx = source.join().expect("source thread");
        drop(tx);
    });
    assert_eq!(alloc.available(), POOL as usize, "every buffer is back in the sink's allocator");
}

// ---------------------------------------------------------------------------
// 2. Zero copy.

/// Sender and receiver map the same memfd: bytes written by the sender are
/// read by the receiver after a move, a write by the receiver shows up in
/// the sender's mapping at once (no message carries it), and after the pass
/// back the sender's handle has the receiver's bytes at its old address.
#[test]
fn move_and_pass_share_memory() {
    let mut f = fixture(TrustLevel::Full);
    let mut x = f.buf();
    let id = x.id();
    fill(x.as_mut_slice().unwrap(), 7);
    let (a_addr, b_addr) = f.addrs(id.index);
    assert_eq!(x.as_ptr() as usize, a_addr);
    f.tx.move_buffer(x, b"").unwrap();

    let (mut y, _) = recv_move(&mut f.rx);
    assert_eq!(y.id(), id);
    assert_eq!(y.as_ptr() as usize, b_addr, "the receiver's handle points into its own view");
    assert_ne!(a_addr, b_addr, "each domain has its own mapping");
    assert_eq!(mismatch(&y, 7), None);

    y.as_mut_slice().unwrap()[..8].copy_from_slice(b"receiver");
    // SAFETY: FULL trust leaves the sender's mapping readable; the pool
    // (and so the mapping) is alive; volatile reads see the shared page.
    let seen: Vec<u8> = (0..8).map(|i| unsafe { std::ptr::read_volatile((a_addr + i) as *const u8) }).collect();
    assert_eq!(seen, b"receiver", "the receiver's write is in the sender's mapping: one memfd");

    f.rx.pass(y, b"").unwrap();
    let (z, _) = recv_pass(&mut f.tx);
    assert_eq!((z.id(), z.as_ptr() as usize), (id, a_addr));
    assert_eq!(&z[..8], b"receiver");
    assert_eq!(mismatch_from(&z, 7, 1), None, "the rest is the sender's pattern");
}

/// `Pool::base_address` and `Pool::index_of` agree with the buffers'
/// addresses in both domains, and the alignment constraints of the pool
/// (creator's view) and of the channel (receiver's view) are honoured.
#[test]
fn pool_addresses_are_consistent() {
    let size = 4 * page();
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup {
        constraints: ChannelConstraints { alignment: size, ..ChannelConstraints::default() },
        ..ChannelSetup::default()
    };
    let (mut tx, mut rx) = connect(&a, &b, setup, BindParams::default());
    let alloc = Allocator::new(&a, 4, size, PoolConstraints { alignment: size, ..PoolConstraints::default() }).unwrap();
    let pool = alloc.pool();
    assert_eq!((pool.geometry().buffer_size(), pool.geometry().count()), (size, 4));
    assign(&mut tx, &mut rx, pool);
    let b_pool = b.pool(pool.id()).unwrap();
    for (p, what) in [(pool, "creator"), (&b_pool, "receiver")] {
        let base = p.base_address();
        assert_eq!(base % size, 0, "{what} view aligned");
        assert_eq!(p.index_of((base - 1) as *const u8), None);
        assert_eq!(p.index_of((base + 4 * size) as *const u8), None);
        for i in 0..4u32 {
            let start = base + i as usize * size;
            assert_eq!(p.index_of(start as *const u8), Some(i), "{what}");
            assert_eq!(p.index_of((start + size - 1) as *const u8), Some(i), "{what}");
        }
    }
    let bufs: Vec<Buffer> = std::iter::from_fn(|| alloc.alloc()).collect();
    assert_eq!(bufs.len(), 4);
    for buf in bufs {
        let i = buf.id().index;
        assert_eq!(buf.as_ptr() as usize, pool.base_address() + i as usize * size);
        tx.move_buffer(buf, b"").unwrap();
        let (got, _) = recv_move(&mut rx);
        assert_eq!(got.as_ptr() as usize, b_pool.base_address() + i as usize * size);
        assert_eq!(b_pool.index_of(got.as_ptr()), Some(i));
        assert_eq!(pool.index_of(got.as_ptr()), None, "the receiver's address is not in the creator's view");
    }
}

/// Full copy: the destination receives the source's bytes as a move, the
/// source stays read-write with the sender; a destination with copies out is
/// refused with `CopiesOutstanding`.
#[test]
fn full_copy_moves_a_copy_of_the_bytes() {
    let mut f = fixture(TrustLevel::Full);
    let mut s = f.buf();
    fill(s.as_mut_slice().unwrap(), 3);
    let t = f.buf();
    let (sid, tid) = (s.id(), t.id());
    f.tx.full_copy(&s, t, b"fc").unwrap();
    let (got, meta) = recv_move(&mut f.rx);
    assert_eq!((got.id(), &meta[..]), (tid, &b"fc"[..]));
    assert_eq!(mismatch(&got, 3), None);
    assert_eq!(f.states(sid), [ReadWrite, Invalid]);
    assert_eq!(f.states(tid), [Invalid, ReadWrite]);

    let d = f.buf();
    let did = d.id();
    f.tx.copy(&d, b"").unwrap();
    let d = refused(f.tx.full_copy(&s, d, b""), ErrorKind::CopiesOutstanding.into());
    assert_eq!((d.id(), f.states(did)), (did, [ReadOnlyOwned, Invalid]));
    assert!(s.as_mut_slice().is_ok());
}

// ---------------------------------------------------------------------------
// 3. Typed errors. Each refusal hands the value back, changes no state, sends
// nothing, and a valid operation afterwards succeeds.

/// `NotConnected` before the bind completes, on both ends and for every
/// kind of operation; once connected the same operations succeed.
#[test]
fn not_connected_before_bind_completes() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let ep = Endpoint::local();
    let mut tx = Channel::create(&a, &ep, ChannelSetup::default()).unwrap();
    let alloc = new_alloc(&a, COUNT);
    let init = ErrorKind::NotConnected(ChannelState::Initialized);
    assert_eq!(tx.assign_pool(alloc.pool()), Err(init.clone().into()));
    let x = alloc.alloc().unwrap();
    let x = refused(tx.move_buffer(x, b""), init.clone().into());
    assert_eq!(tx.copy(&x, b""), Err(init.clone().into()));
    assert_eq!(tx.teardown(), Err(init.clone().into()));
    assert_eq!(tx.remove_pool(alloc.pool().id()), Err(init.clone().into()));
    assert_eq!(a.buffer_state(x.id()), ReadWrite);

    let mut rx = Channel::bind(&b, &ep, BindParams::default()).unwrap();
    assert_eq!(rx.state(), ChannelState::Binding);
    let binding = ErrorKind::NotConnected(ChannelState::Binding);
    let b_alloc = new_alloc(&b, 1);
    let y = b_alloc.alloc().unwrap();
    let y = refused(rx.pass(y, b""), binding.clone().into());
    assert_eq!(rx.assign_pool(b_alloc.pool()), Err(binding.clone().into()));
    assert_eq!(rx.respond_pool(alloc.pool().id(), true), Err(binding.clone().into()));
    assert_eq!(rx.teardown(), Err(binding.into()));
    assert_eq!(b.buffer_state(y.id()), ReadWrite);

    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    assert!(matches!(next(&mut rx), Event::Bound));
    assign(&mut tx, &mut rx, alloc.pool());
    let id = x.id();
    tx.move_buffer(x, b"ok").unwrap();
    assert_eq!(recv_move(&mut rx).0.id(), id);
}

/// `TearingDown` after our own teardown: nothing is sent (the peer sees only
/// the marker), the buffer comes back read-write.
#[test]
fn tearing_down_refuses_new_messages() {
    let mut f = fixture(TrustLevel::Full);
    let x = f.buf();
    let id = x.id();
    let pool = f.pool();
    f.tx.teardown().unwrap();
    assert_eq!(f.tx.state(), ChannelState::Teardown);
    let mut x = refused(f.tx.move_buffer(x, b""), ErrorKind::TearingDown.into());
    assert_eq!(f.tx.copy(&x, b""), Err(ErrorKind::TearingDown.into()));
    assert_eq!(f.tx.assign_pool(f.alloc.pool()), Err(ErrorKind::TearingDown.into()));
    assert_eq!(f.tx.remove_pool(pool), Err(ErrorKind::TearingDown.into()));
    assert_eq!(f.tx.teardown(), Err(ErrorKind::TearingDown.into()));
    assert_eq!((x.id(), f.states(id)), (id, [ReadWrite, Invalid]));
    expect(&mut f.rx, "Closed { by_peer: true }");
    expect(&mut f.tx, "Closed { by_peer: false }");
    x.as_mut_slice().unwrap()[0] = 1;
    drop(x);
    assert_eq!(f.alloc.available(), COUNT as usize);
}

/// `WrongDirection`: move, copy and full copy from the sink; pass and
/// release from the source. It is checked before `ForeignBuffer`.
#[test]
fn wrong_direction() {
    let mut f = fixture(TrustLevel::Full);
    let y = f.moved();
    let yid = y.id();
    let y = refused(f.rx.move_buffer(y, b""), ErrorKind::WrongDirection.into());
    assert_eq!(f.rx.copy(&y, b""), Err(ErrorKind::WrongDirection.into()));
    assert_eq!(f.states(yid), [Invalid, ReadWrite]);

    let x = f.buf();
    let xid = x.id();
    let x = refused(f.tx.pass(x, b""), ErrorKind::WrongDirection.into());
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);
    f.tx.copy(&x, b"").unwrap();
    let (copy, _) = recv_copy(&mut f.rx);
    // The copy belongs to b, the channel end to a: direction comes first.
    let copy = refused(f.tx.release(copy), ErrorKind::WrongDirection.into());
    assert_eq!(f.states(xid), [ReadOnlyOwned, ReadOnly]);
    // b's buffer through a's source end: direction is fine, the domain is not.
    let y = refused(f.tx.move_buffer(y, b""), ErrorKind::ForeignBuffer.into());
    assert_quiet(&mut f.rx);
    assert_quiet(&mut f.tx);

    f.rx.release(copy).unwrap();
    f.rx.pass(y, b"").unwrap();
    assert!(recv_released(&mut f.tx, xid));
    assert_eq!(recv_pass(&mut f.tx).0.id(), yid);
}

/// `ForeignBuffer`: buffers and copies of another domain, even of a pool
/// assigned to the channel; it is checked before `PoolNotAssigned`.
#[test]
fn foreign_buffer() {
    let mut f = fixture(TrustLevel::Full);
    // b's buffer of the assigned pool, offered to a's end.
    let y = f.moved();
    let yid = y.id();
    let y = refused(f.tx.move_buffer(y, b""), ErrorKind::ForeignBuffer.into());
    assert_eq!(f.tx.copy(&y, b""), Err(ErrorKind::ForeignBuffer.into()));
    let x = f.buf();
    let xid = x.id();
    let x = refused(f.tx.full_copy(&y, x, b""), ErrorKind::ForeignBuffer.into());
    // a's buffer offered to b's end.
    let x = refused(f.rx.pass(x, b""), ErrorKind::ForeignBuffer.into());
    // A third domain's buffer, of a pool assigned nowhere.
    let c = Domain::new("c");
    let c_alloc = new_alloc(&c, 1);
    let z = c_alloc.alloc().unwrap();
    let z = refused(f.tx.move_buffer(z, b""), ErrorKind::ForeignBuffer.into());
    // A copy held by c, released over b's end.
    let (mut atx, mut crx) = link(&f.a, &c, TrustLevel::Full);
    assign(&mut atx, &mut crx, f.alloc.pool());
    atx.copy(&x, b"").unwrap();
    let (c_copy, _) = recv_copy(&mut crx);
    let c_copy = refused(f.rx.release(c_copy), ErrorKind::ForeignBuffer.into());
    assert_eq!(f.states(yid), [Invalid, ReadWrite]);
    assert_eq!((f.states(xid), c.buffer_state(xid)), ([ReadOnlyOwned, Invalid], ReadOnly));
    assert_eq!(c.buffer_state(z.id()), ReadWrite);
    assert_quiet(&mut f.tx);
    assert_quiet(&mut f.rx);

    crx.release(c_copy).unwrap();
    assert!(recv_released(&mut atx, xid));
    f.rx.pass(y, b"").unwrap();
    f.tx.move_buffer(x, b"").unwrap();
    assert_eq!(recv_pass(&mut f.tx).0.id(), yid);
    assert_eq!(recv_move(&mut f.rx).0.id(), xid);
}

/// `PoolNotAssigned`: a pool never assigned, and a pool whose assignment is
/// still pending (until the reply reaches the assigner).
#[test]
fn pool_not_assigned() {
    let mut f = fixture(TrustLevel::Full);
    let other = new_alloc(&f.a, 2);
    let p2 = other.pool().id();
    let x = other.alloc().unwrap();
    let xid = x.id();
    let x = refused(f.tx.move_buffer(x, b""), ErrorKind::PoolNotAssigned(p2).into());
    assert_eq!(f.tx.copy(&x, b""), Err(ErrorKind::PoolNotAssigned(p2).into()));
    assert_eq!(f.tx.remove_pool(p2), Err(ErrorKind::PoolNotAssigned(p2).into()));

    f.tx.assign_pool(other.pool()).unwrap();
    let x = refused(f.tx.move_buffer(x, b""), ErrorKind::PoolNotAssigned(p2).into());
    assert_eq!(recv_request(&mut f.rx).pool, p2);
    assert!(!f.rx.is_assigned(p2));
    f.rx.respond_pool(p2, true).unwrap();
    // Accepted at b, but the reply has not reached a yet.
    let x = refused(f.tx.move_buffer(x, b""), ErrorKind::PoolNotAssigned(p2).into());
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);
    expect(&mut f.tx, &format!("PoolAssigned({p2:?})"));
    f.tx.move_buffer(x, b"").unwrap();
    assert_eq!(recv_move(&mut f.rx).0.id(), xid);
}

/// `PoolRemovalPending` while our removal request is out; afterwards the
/// pool is not assigned any more (`PoolNotAssigned`).
#[test]
fn pool_removal_pending() {
    let mut f = fixture(TrustLevel::Full);
    let p = f.pool();
    let x = f.buf();
    let xid = x.id();
    f.tx.remove_pool(p).unwrap();
    let x = refused(f.tx.move_buffer(x, b""), ErrorKind::PoolRemovalPending(p).into());
    assert_eq!(f.tx.copy(&x, b""), Err(ErrorKind::PoolRemovalPending(p).into()));
    assert_eq!(f.tx.remove_pool(p), Err(ErrorKind::PoolRemovalPending(p).into()));
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);
    expect(&mut f.rx, &format!("PoolRemoved({p:?})"));
    expect(&mut f.tx, &format!("PoolRemoved({p:?})"));
    let x = refused(f.tx.move_buffer(x, b""), ErrorKind::PoolNotAssigned(p).into());
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);
    assign(&mut f.tx, &mut f.rx, f.alloc.pool());
    f.tx.move_buffer(x, b"").unwrap();
    assert_eq!(recv_move(&mut f.rx).0.id(), xid);
}

/// `CopiesOutstanding`: move, full-copy destination and `as_mut_slice` of a
/// buffer with a copy out (source side), and pass of a buffer the sink has
/// copied onward (sink side, A→B→C).
#[test]
fn copies_outstanding() {
    let mut ch = chain();
    let mut x = ch.f.buf();
    let xid = x.id();
    ch.f.tx.copy(&x, b"").unwrap();
    assert_eq!(x.as_mut_slice().err(), Some(ErrorKind::CopiesOutstanding.into()));
    let mut x = refused(ch.f.tx.move_buffer(x, b""), ErrorKind::CopiesOutstanding.into());
    // Precedence: CopiesOutstanding is checked before MetaTooLarge.
    x = refused(ch.f.tx.move_buffer(x, &[0; 17]), ErrorKind::CopiesOutstanding.into());
    let s = ch.f.buf();
    let x = refused(ch.f.tx.full_copy(&s, x, b""), ErrorKind::CopiesOutstanding.into());
    assert_eq!(ch.states(xid), [ReadOnlyOwned, Invalid, Invalid]);
    let (copy, _) = recv_copy(&mut ch.f.rx);
    ch.f.rx.release(copy).unwrap();
    assert!(recv_released(&mut ch.f.tx, xid));
    ch.f.tx.move_buffer(x, b"").unwrap();

    // b owns x and copies it on to c: b cannot pass it back yet.
    let (mut y, _) = recv_move(&mut ch.f.rx);
    ch.btx.copy(&y, b"").unwrap();
    let (c_copy, _) = recv_copy(&mut ch.crx);
    assert_eq!(y.as_mut_slice().err(), Some(ErrorKind::CopiesOutstanding.into()));
    let y = refused(ch.f.rx.pass(y, b""), ErrorKind::CopiesOutstanding.into());
    assert_eq!(ch.states(xid), [Invalid, ReadOnlyOwned, ReadOnly]);
    assert_quiet(&mut ch.f.tx);
    ch.crx.release(c_copy).unwrap();
    assert!(recv_released(&mut ch.btx, xid));
    ch.f.rx.pass(y, b"").unwrap();
    assert_eq!(recv_pass(&mut ch.f.tx).0.id(), xid);
    assert_eq!(ch.states(xid), [ReadWrite, Invalid, Invalid]);
}

/// `NotCopyHolder`: a copy received over one channel cannot be released over
/// another channel between the same domains, even with the pool assigned
/// to both.
#[test]
fn not_copy_holder() {
    let mut f = fixture(TrustLevel::Full);
    let (mut tx2, mut rx2) = link(&f.a, &f.b, TrustLevel::Full);
    assign(&mut tx2, &mut rx2, f.alloc.pool());
    let x = f.buf();
    let xid = x.id();
    f.tx.copy(&x, b"").unwrap();
    let (copy, _) = recv_copy(&mut f.rx);
    let copy = refused(rx2.release(copy), ErrorKind::NotCopyHolder.into());
    assert_eq!(f.states(xid), [ReadOnlyOwned, ReadOnly]);
    assert_quiet(&mut tx2);
    assert_quiet(&mut f.tx);
    f.rx.release(copy).unwrap();
    assert!(recv_released(&mut f.tx, xid));
    assert_quiet(&mut tx2);
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);
}

/// `CopiesForwarded` (A→B→C): B forwarded its copy to C, so B's release is
/// refused until C's release has been delivered at B; then it is allowed
/// and A gets the buffer read-write again.
#[test]
fn copies_forwarded() {
    let mut ch = chain();
    let x = ch.f.buf();
    let xid = x.id();
    ch.f.tx.copy(&x, b"").unwrap();
    let (b_copy, _) = recv_copy(&mut ch.f.rx);
    ch.btx.copy(&b_copy, b"").unwrap();
    let (c_copy, _) = recv_copy(&mut ch.crx);
    assert_eq!(&c_copy[..], &x[..]);
    let b_copy = refused(ch.f.rx.release(b_copy), ErrorKind::CopiesForwarded.into());
    assert_eq!(ch.states(xid), [ReadOnlyOwned, ReadOnly, ReadOnly]);

    ch.crx.release(c_copy).unwrap();
    // Issued by C, not yet delivered at B.
    let b_copy = refused(ch.f.rx.release(b_copy), ErrorKind::CopiesForwarded.into());
    assert_quiet(&mut ch.f.tx);
    assert!(!recv_released(&mut ch.btx, xid), "B is not the owner");
    assert_eq!(ch.states(xid), [ReadOnlyOwned, ReadOnly, Invalid]);
    ch.f.rx.release(b_copy).unwrap();
    assert!(recv_released(&mut ch.f.tx, xid));
    assert_eq!(ch.states(xid), [ReadWrite, Invalid, Invalid]);
}

/// The exception of the `CopiesForwarded` rule: a holder of two copies over
/// one channel that forwarded one may release one, not both.
#[test]
fn copies_forwarded_allows_release_of_a_second_copy() {
    let mut ch = chain();
    let x = ch.f.buf();
    let xid = x.id();
    ch.f.tx.copy(&x, b"1").unwrap();
    ch.f.tx.copy(&x, b"2").unwrap();
    let (first, _) = recv_copy(&mut ch.f.rx);
    let (second, _) = recv_copy(&mut ch.f.rx);
    ch.btx.copy(&first, b"").unwrap();
    ch.f.rx.release(first).unwrap();
    assert!(!recv_released(&mut ch.f.tx, xid), "one copy is still out");
    let second = refused(ch.f.rx.release(second), ErrorKind::CopiesForwarded.into());
    let (c_copy, _) = recv_copy(&mut ch.crx);
    ch.crx.release(c_copy).unwrap();
    assert!(!recv_released(&mut ch.btx, xid));
    ch.f.rx.release(second).unwrap();
    assert!(recv_released(&mut ch.f.tx, xid));
    assert_eq!(ch.states(xid), [ReadWrite, Invalid, Invalid]);
}

/// `MetaTooLarge` for move, copy, pass and full copy at one byte over the
/// channel's meta size (exactly the size is fine), and at create time.
#[test]
fn meta_too_large() {
    let mut f = fixture(TrustLevel::Full);
    let big = ErrorKind::MetaTooLarge { len: 17, max: 16 };
    let x = f.buf();
    let xid = x.id();
    let x = refused(f.tx.move_buffer(x, &[1; 17]), big.clone().into());
    assert_eq!(f.tx.copy(&x, &[1; 17]), Err(big.clone().into()));
    let s = f.buf();
    let x = refused(f.tx.full_copy(&s, x, &[1; 17]), big.clone().into());
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);
    assert_quiet(&mut f.rx);
    f.tx.move_buffer(x, &[1; 16]).unwrap();
    let (y, meta) = recv_move(&mut f.rx);
    assert_eq!(&meta[..], &[1; 16]);
    let y = refused(f.rx.pass(y, &[2; 17]), big.into());
    assert_eq!(f.states(xid), [Invalid, ReadWrite]);
    f.rx.pass(y, &[2; 16]).unwrap();
    assert_eq!(&recv_pass(&mut f.tx).1[..], &[2; 16]);

    let setup = ChannelSetup { meta_size: MAX_META_SIZE + 1, ..ChannelSetup::default() };
    let ep = Endpoint::local();
    let e = Channel::create(&f.a, &ep, setup).unwrap_err();
    assert_eq!(e, ErrorKind::MetaTooLarge { len: MAX_META_SIZE + 1, max: MAX_META_SIZE });
    Channel::create(&f.a, &ep, ChannelSetup { meta_size: MAX_META_SIZE, ..ChannelSetup::default() }).unwrap();
}

/// Meta of every length up to the largest a channel allows, inline and
/// kept apart on the heap alike, crosses intact both ways, several
/// messages queued before the receiver looks.
#[test]
fn meta_of_every_length_crosses_intact() {
    let mut f = fixture_with(ChannelSetup { meta_size: MAX_META_SIZE, ..ChannelSetup::default() });
    let lens = [0, 1, 45, 46, 47, 100, MAX_META_SIZE - 1, MAX_META_SIZE];
    let pattern = |len: usize, salt: u8| (0..len).map(|i| (i as u8).wrapping_mul(7) ^ salt).collect::<Vec<u8>>();
    for &len in &lens {
        let x = f.buf();
        f.tx.move_buffer(x, &pattern(len, 1)).unwrap();
    }
    let mut back = Vec::new();
    for &len in &lens {
        let (y, meta) = recv_move(&mut f.rx);
        assert_eq!(&meta[..], &pattern(len, 1)[..], "moved with {len} bytes of meta");
        back.push(y);
    }
    for (y, &len) in back.into_iter().zip(&lens) {
        f.rx.pass(y, &pattern(len, 2)).unwrap();
    }
    for &len in &lens {
        let (_, meta) = recv_pass(&mut f.tx);
        assert_eq!(&meta[..], &pattern(len, 2)[..], "passed with {len} bytes of meta");
    }
    assert_quiet(&mut f.rx);
}

/// `UnknownPool`: assigning another domain's pool, and assigning onward a
/// pool that was only offered to us (not yet accepted). After accepting,
/// the onward assignment works.
#[test]
fn unknown_pool() {
    let (a, b, c) = (Domain::new("a"), Domain::new("b"), Domain::new("c"));
    let (mut ab, mut ba) = link(&a, &b, TrustLevel::Full);
    let (mut bc, mut cb) = link(&b, &c, TrustLevel::Full);
    let c_alloc = new_alloc(&c, 1);
    let cp = c_alloc.pool().id();
    assert_eq!(ab.assign_pool(c_alloc.pool()), Err(ErrorKind::UnknownPool(cp).into()));
    assert_eq!(c.pool_trust(cp), Some(TrustLevel::Uninitialized));

    let alloc = new_alloc(&a, 2);
    let p = alloc.pool().id();
    ab.assign_pool(alloc.pool()).unwrap();
    recv_request(&mut ba);
    let offered = b.pool(p).expect("b maps an offered pool");
    assert_eq!(bc.assign_pool(&offered), Err(ErrorKind::UnknownPool(p).into()));
    assert_eq!(bc.assign_pool(alloc.pool()), Err(ErrorKind::UnknownPool(p).into()), "a's handle in b's channel");
    assert_quiet(&mut cb);
    ba.respond_pool(p, true).unwrap();
    expect(&mut ab, &format!("PoolAssigned({p:?})"));
    assign(&mut bc, &mut cb, &offered);
}

/// `PoolAlreadyAssigned`: assigning an assigned pool (from either end) and
/// a pool whose assignment is pending; only one request reaches the peer.
#[test]
fn pool_already_assigned() {
    let mut f = fixture(TrustLevel::Full);
    let p = f.pool();
    assert_eq!(f.tx.assign_pool(f.alloc.pool()), Err(ErrorKind::PoolAlreadyAssigned(p).into()));
    assert_eq!(f.rx.assign_pool(&f.b.pool(p).unwrap()), Err(ErrorKind::PoolAlreadyAssigned(p).into()));
    let other = new_alloc(&f.a, 1);
    let p2 = other.pool().id();
    f.tx.assign_pool(other.pool()).unwrap();
    assert_eq!(f.tx.assign_pool(other.pool()), Err(ErrorKind::PoolAlreadyAssigned(p2).into()));
    assert_eq!(recv_request(&mut f.rx).pool, p2);
    assert_quiet(&mut f.rx);
    assert_eq!(f.rx.pending_requests().len(), 1);
    f.rx.respond_pool(p2, true).unwrap();
    expect(&mut f.tx, &format!("PoolAssigned({p2:?})"));
    assert!(f.tx.is_assigned(p) && f.tx.is_assigned(p2));

    // A request from the peer, delivered and unanswered, counts too.
    let (mut tx2, mut rx2) = link(&f.a, &f.b, TrustLevel::Full);
    tx2.assign_pool(f.alloc.pool()).unwrap();
    assert_eq!(recv_request(&mut rx2).pool, p);
    assert_eq!(rx2.assign_pool(&f.b.pool(p).unwrap()), Err(ErrorKind::PoolAlreadyAssigned(p).into()));
    assert_quiet(&mut tx2);
    rx2.respond_pool(p, true).unwrap();
    expect(&mut tx2, &format!("PoolAssigned({p:?})"));
}

/// `TrustMismatch`: a pool that took FULL trust from its first channel
/// cannot go to a HALF channel, and a pool created HALF cannot go to a FULL
/// channel; a pool of the right trust can.
#[test]
fn trust_mismatch() {
    let f = fixture(TrustLevel::Full);
    let p = f.pool();
    assert_eq!(f.a.pool_trust(p), Some(TrustLevel::Full));
    let c = Domain::new("c");
    let (mut half_tx, mut half_rx) = link(&f.a, &c, TrustLevel::Half);
    assert_eq!(
        half_tx.assign_pool(f.alloc.pool()),
        Err(ErrorKind::TrustMismatch { pool: TrustLevel::Full, channel: TrustLevel::Half }.into())
    );
    assert_quiet(&mut half_rx);
    assert_eq!(f.a.pool_trust(p), Some(TrustLevel::Full));
    assert_eq!(c.pool(p).map(|p| p.id()), None);

    let half = Allocator::new(&f.a, 1, page(), PoolConstraints { trust: TrustLevel::Half, alignment: 0 }).unwrap();
    let mut full_tx = f.tx;
    assert_eq!(
        full_tx.assign_pool(half.pool()),
        Err(ErrorKind::TrustMismatch { pool: TrustLevel::Half, channel: TrustLevel::Full }.into())
    );
    assign(&mut half_tx, &mut half_rx, half.pool());
}

/// `PoolInUse`: neither end can remove a pool while a copy of one of its
/// buffers is out over the channel; once the release is delivered, removal
/// goes through.
#[test]
fn pool_in_use() {
    let mut f = fixture(TrustLevel::Full);
    let p = f.pool();
    let x = f.buf();
    f.tx.copy(&x, b"").unwrap();
    assert_eq!(f.tx.remove_pool(p), Err(ErrorKind::PoolInUse(p).into()));
    let (copy, _) = recv_copy(&mut f.rx);
    assert_eq!(f.rx.remove_pool(p), Err(ErrorKind::PoolInUse(p).into()));
    assert_quiet(&mut f.tx);
    f.rx.release(copy).unwrap();
    assert_eq!(f.tx.remove_pool(p), Err(ErrorKind::PoolInUse(p).into()), "release not delivered yet");
    assert!(recv_released(&mut f.tx, x.id()));
    f.tx.remove_pool(p).unwrap();
    expect(&mut f.rx, &format!("PoolRemoved({p:?})"));
    expect(&mut f.tx, &format!("PoolRemoved({p:?})"));
}

/// `NoPendingRequest`: answering a request nobody made, twice, or our own.
#[test]
fn no_pending_request() {
    let mut f = fixture(TrustLevel::Full);
    let nobody = PoolId::from_u128(42);
    assert_eq!(f.rx.respond_pool(nobody, true), Err(ErrorKind::NoPendingRequest(nobody).into()));
    let p = f.pool();
    assert_eq!(f.rx.respond_pool(p, true), Err(ErrorKind::NoPendingRequest(p).into()), "already answered");
    let other = new_alloc(&f.a, 1);
    let p2 = other.pool().id();
    f.tx.assign_pool(other.pool()).unwrap();
    assert_eq!(f.tx.respond_pool(p2, true), Err(ErrorKind::NoPendingRequest(p2).into()), "the assigner's own request");
    recv_request(&mut f.rx);
    f.rx.respond_pool(p2, false).unwrap();
    assert_eq!(f.rx.respond_pool(p2, true), Err(ErrorKind::NoPendingRequest(p2).into()));
    expect(&mut f.tx, &format!("PoolVetoed({p2:?})"));
}

/// `QueueFull` with a queue depth of 2: the third move is refused with the
/// buffer handed back (and copy and teardown too), checked after
/// `MetaTooLarge`; once the peer has polled one message, it succeeds.
#[test]
fn queue_full() {
    let mut f = fixture_with(ChannelSetup { queue_depth: 2, ..ChannelSetup::default() });
    let ids: Vec<BufferId> = (0..2)
        .map(|i| {
            let x = f.buf();
            let id = x.id();
            f.tx.move_buffer(x, &[i]).unwrap();
            id
        })
        .collect();
    let x = f.buf();
    let xid = x.id();
    let x = refused(f.tx.move_buffer(x, &[2]), ErrorKind::QueueFull.into());
    let x = refused(f.tx.move_buffer(x, &[0; 17]), ErrorKind::MetaTooLarge { len: 17, max: 16 }.into());
    assert_eq!(f.tx.copy(&x, b""), Err(ErrorKind::QueueFull.into()));
    assert_eq!(f.tx.teardown(), Err(ErrorKind::QueueFull.into()));
    assert_eq!(f.tx.state(), ChannelState::Connected);
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);

    let (y0, m0) = recv_move(&mut f.rx);
    assert_eq!((y0.id(), &m0[..]), (ids[0], &[0][..]));
    f.tx.move_buffer(x, &[2]).unwrap();
    let (y1, m1) = recv_move(&mut f.rx);
    let (y2, m2) = recv_move(&mut f.rx);
    assert_eq!((y1.id(), &m1[..], y2.id(), &m2[..]), (ids[1], &[1][..], xid, &[2][..]));

    // The sink's queue: a does not poll, b fills it with two passes; then
    // pass and release are refused, and a dropped copy waits its turn.
    let z = f.buf();
    let zid = z.id();
    f.tx.copy(&z, b"").unwrap();
    let (copy, _) = recv_copy(&mut f.rx);
    f.rx.pass(y0, b"").unwrap();
    f.rx.pass(y1, b"").unwrap();
    let copy = refused(f.rx.release(copy), ErrorKind::QueueFull.into());
    let y2 = refused(f.rx.pass(y2, b""), ErrorKind::QueueFull.into());
    assert_eq!((f.states(zid), f.states(xid)), ([ReadOnlyOwned, ReadOnly], [Invalid, ReadWrite]));
    drop(copy);
    assert!(f.rx.poll().is_none());
    assert_eq!(recv_pass(&mut f.tx).0.id(), ids[0]);
    assert!(f.rx.poll().is_none(), "room again: the dropped copy's release goes out");
    assert_eq!(recv_pass(&mut f.tx).0.id(), ids[1]);
    assert!(recv_released(&mut f.tx, zid));
    f.rx.pass(y2, b"").unwrap();
    assert_eq!(recv_pass(&mut f.tx).0.id(), xid);
}

/// `EndpointInUse`: a second create on an endpoint, and a second bind (while
/// the first is pending, and after it connected). The first pair works.
#[test]
fn endpoint_in_use() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let ep = Endpoint::local();
    let mut tx = Channel::create(&a, &ep, ChannelSetup::default()).unwrap();
    assert_eq!(Channel::create(&b, &ep, ChannelSetup::default()).unwrap_err(), ErrorKind::EndpointInUse);
    let mut rx = Channel::bind(&b, &ep, BindParams::default()).unwrap();
    assert_eq!(Channel::bind(&b, &ep, BindParams::default()).unwrap_err(), ErrorKind::EndpointInUse);
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    assert!(matches!(next(&mut rx), Event::Bound));
    assert_eq!(Channel::bind(&b, &ep, BindParams::default()).unwrap_err(), ErrorKind::EndpointInUse);
    let alloc = new_alloc(&a, 1);
    assign(&mut tx, &mut rx, alloc.pool());
}

/// `EndpointNotListening`: bind before anyone created a channel there; after
/// a create, the bind succeeds.
#[test]
fn endpoint_not_listening() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let ep = Endpoint::local();
    assert_eq!(Channel::bind(&b, &ep, BindParams::default()).unwrap_err(), ErrorKind::EndpointNotListening);
    let mut tx = Channel::create(&a, &ep, ChannelSetup::default()).unwrap();
    let mut rx = Channel::bind(&b, &ep, BindParams::default()).unwrap();
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    assert!(matches!(next(&mut rx), Event::Bound));
}

/// `BindRefused` reaches the binder as `Event::Error` (role conflict, trust
/// requirement, meta size); the binder is closed, the creator keeps
/// listening and accepts a compatible binder afterwards.
#[test]
fn bind_refused() {
    let cases = [
        (
            "Master/Master",
            Role::Master,
            TrustLevel::Full,
            16,
            BindParams { role: Role::Master, ..BindParams::default() },
        ),
        ("Slave/Slave", Role::Slave, TrustLevel::Full, 16, BindParams { role: Role::Slave, ..BindParams::default() }),
        (
            "trust",
            Role::Generic,
            TrustLevel::Full,
            16,
            BindParams { trust: Some(TrustLevel::Half), ..BindParams::default() },
        ),
        ("meta", Role::Generic, TrustLevel::Half, 64, BindParams { max_meta_size: 32, ..BindParams::default() }),
    ];
    for (what, role, trust, meta_size, params) in cases {
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let ep = Endpoint::local();
        let mut creator =
            Channel::create(&a, &ep, ChannelSetup { role, trust, meta_size, ..ChannelSetup::default() }).unwrap();
        let mut binder = Channel::bind(&b, &ep, params).unwrap();
        assert!(creator.poll().is_none(), "{what}: the creator reports nothing");
        assert_eq!(creator.state(), ChannelState::Initialized, "{what}");
        match next(&mut binder) {
            Event::Error(err) if matches!(err.kind(), ErrorKind::BindRefused(_)) => {}
            other => panic!("{what}: expected BindRefused, got {other:?}"),
        }
        assert_eq!(binder.state(), ChannelState::Closed, "{what}");
        assert_eq!(binder.teardown(), Err(ErrorKind::NotConnected(ChannelState::Closed).into()), "{what}");

        let mut binder = Channel::bind(&b, &ep, BindParams::default()).unwrap();
        assert!(matches!(next(&mut creator), Event::BindRequest { .. }), "{what}");
        assert!(matches!(next(&mut binder), Event::Bound), "{what}");
        assert_eq!((binder.trust(), binder.meta_size()), (trust, meta_size), "{what}: the creator's terms");
        assert_ne!(binder.role(), creator.role(), "{what}");
    }
}

/// `TrustNotSupported`: trust NONE on a local endpoint; nothing is
/// registered (a bind finds nobody), and a FULL create then works.
#[test]
fn trust_not_supported() {
    let a = Domain::new("a");
    let ep = Endpoint::local();
    let e = Channel::create(&a, &ep, ChannelSetup { trust: TrustLevel::None, ..ChannelSetup::default() });
    assert_eq!(e.unwrap_err(), ErrorKind::TrustNotSupported { trust: TrustLevel::None, backend: "local" });
    assert_eq!(Channel::bind(&a, &ep, BindParams::default()).unwrap_err(), ErrorKind::EndpointNotListening);
    Channel::create(&a, &ep, ChannelSetup::default()).unwrap();
}

/// `InvalidArgument`: UNINITIALIZED trust and queue depths that are not a
/// power of two in 2..=65536; nothing is registered; the bounds themselves
/// are accepted.
#[test]
fn invalid_argument() {
    let a = Domain::new("a");
    let ep = Endpoint::local();
    let bad = [
        ChannelSetup { trust: TrustLevel::Uninitialized, ..ChannelSetup::default() },
        ChannelSetup { queue_depth: 0, ..ChannelSetup::default() },
        ChannelSetup { queue_depth: 1, ..ChannelSetup::default() },
        ChannelSetup { queue_depth: 3, ..ChannelSetup::default() },
        ChannelSetup { queue_depth: 1000, ..ChannelSetup::default() },
        ChannelSetup { queue_depth: 1 << 17, ..ChannelSetup::default() },
    ];
    for setup in bad {
        match Channel::create(&a, &ep, setup) {
            Err(err) if matches!(err.kind(), ErrorKind::InvalidArgument(_)) => {}
            other => panic!("{setup:?}: {other:?}"),
        }
    }
    assert_eq!(Channel::bind(&a, &ep, BindParams::default()).unwrap_err(), ErrorKind::EndpointNotListening);
    Channel::create(&a, &ep, ChannelSetup { queue_depth: 2, ..ChannelSetup::default() }).unwrap();
    Channel::create(&a, &Endpoint::local(), ChannelSetup { queue_depth: 65536, ..ChannelSetup::default() }).unwrap();
}

/// `BadBufferSize` and `BadBufferCount` from `Allocator::new`, with the
/// values reported; no pool is created on error.
#[test]
fn bad_buffer_size_and_count() {
    let d = Domain::new("d");
    let pg = page();
    for size in [0, 1000, pg / 2, pg + 1, 3 * pg] {
        assert_eq!(
            Allocator::new(&d, 1, size, PoolConstraints::default()).unwrap_err(),
            ErrorKind::BadBufferSize { size, page: pg }
        );
    }
    let max = ((1u64 << 40) / pg as u64).min(u64::from(u32::MAX));
    for count in [0, max + 1] {
        assert_eq!(
            Allocator::new(&d, count, pg, PoolConstraints::default()).unwrap_err(),
            ErrorKind::BadBufferCount { count, max }
        );
    }
    assert!(d.pools().is_empty());
    let ok = Allocator::new(&d, 2, 2 * pg, PoolConstraints::default()).unwrap();
    assert_eq!(d.pools(), vec![ok.pool().id()]);
}

// ---------------------------------------------------------------------------
// 4. Vetoed assignment.

/// A veto by the peer: the assigner gets `PoolVetoed`, the peer forgets the
/// pool it learned only through the request, the pool's trust goes back to
/// UNINITIALIZED, moves are `PoolNotAssigned`; the pool can then be
/// assigned again and accepted.
#[test]
fn vetoed_assignment_undoes_everything() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let (mut tx, mut rx) = link(&a, &b, TrustLevel::Full);
    let alloc = new_alloc(&a, 2);
    let p = alloc.pool().id();
    assert_eq!(a.pool_trust(p), Some(TrustLevel::Uninitialized));
    tx.assign_pool(alloc.pool()).unwrap();
    assert_eq!(a.pool_trust(p), Some(TrustLevel::Full), "issuing sets the trust");
    let req = recv_request(&mut rx);
    assert_eq!(req, PoolRequest { pool: p, geometry: alloc.pool().geometry(), trust: TrustLevel::Full });
    assert_eq!(b.pools(), vec![p]);
    rx.respond_pool(p, false).unwrap();
    assert!(b.pools().is_empty() && b.pool(p).is_none(), "the vetoing peer forgot the pool");
    expect(&mut tx, &format!("PoolVetoed({p:?})"));
    assert_eq!(a.pool_trust(p), Some(TrustLevel::Uninitialized));
    assert!(!tx.is_assigned(p) && !rx.is_assigned(p));
    let x = alloc.alloc().unwrap();
    let x = refused(tx.move_buffer(x, b""), ErrorKind::PoolNotAssigned(p).into());

    assign(&mut tx, &mut rx, alloc.pool());
    assert_eq!((a.pool_trust(p), b.pool_trust(p)), (Some(TrustLevel::Full), Some(TrustLevel::Full)));
    let id = x.id();
    tx.move_buffer(x, b"").unwrap();
    assert_eq!(recv_move(&mut rx).0.id(), id);
}

/// After a veto the pool's trust really is UNINITIALIZED again: it can be
/// assigned to a HALF channel, after which the FULL one refuses it.
#[test]
fn vetoed_pool_can_take_another_trust() {
    let (a, b, c) = (Domain::new("a"), Domain::new("b"), Domain::new("c"));
    let (mut full_tx, mut full_rx) = link(&a, &b, TrustLevel::Full);
    let (mut half_tx, mut half_rx) = link(&a, &c, TrustLevel::Half);
    let alloc = new_alloc(&a, 1);
    let p = alloc.pool().id();
    full_tx.assign_pool(alloc.pool()).unwrap();
    recv_request(&mut full_rx);
    full_rx.respond_pool(p, false).unwrap();
    expect(&mut full_tx, &format!("PoolVetoed({p:?})"));
    assign(&mut half_tx, &mut half_rx, alloc.pool());
    assert_eq!(a.pool_trust(p), Some(TrustLevel::Half));
    assert_eq!(
        full_tx.assign_pool(alloc.pool()),
        Err(ErrorKind::TrustMismatch { pool: TrustLevel::Half, channel: TrustLevel::Full }.into())
    );
}

/// The trust goes back to UNINITIALIZED only when no channel has the pool
/// any more: with two pending FULL assignments, the first veto keeps FULL
/// (a HALF channel still refuses the pool), the second resets it.
#[test]
fn trust_resets_only_after_the_last_veto() {
    let (a, b, c, d) = (Domain::new("a"), Domain::new("b"), Domain::new("c"), Domain::new("d"));
    let (mut ab, mut ba) = link(&a, &b, TrustLevel::Full);
    let (mut ac, mut ca) = link(&a, &c, TrustLevel::Full);
    let (mut half, _half_rx) = link(&a, &d, TrustLevel::Half);
    let alloc = new_alloc(&a, 1);
    let p = alloc.pool().id();
    ab.assign_pool(alloc.pool()).unwrap();
    ac.assign_pool(alloc.pool()).unwrap();
    recv_request(&mut ba);
    recv_request(&mut ca);
    ba.respond_pool(p, false).unwrap();
    expect(&mut ab, &format!("PoolVetoed({p:?})"));
    assert_eq!(a.pool_trust(p), Some(TrustLevel::Full), "still pending on a-c");
    let mismatch = ErrorKind::TrustMismatch { pool: TrustLevel::Full, channel: TrustLevel::Half };
    assert_eq!(half.assign_pool(alloc.pool()), Err(mismatch.into()));
    ca.respond_pool(p, false).unwrap();
    expect(&mut ac, &format!("PoolVetoed({p:?})"));
    assert_eq!(a.pool_trust(p), Some(TrustLevel::Uninitialized));
    half.assign_pool(alloc.pool()).unwrap();
}

/// A veto does not make the peer forget a pool it already accepted on
/// another channel, and does not touch the assigner's (fixed) trust.
#[test]
fn veto_of_a_known_pool_keeps_it() {
    let mut f = fixture(TrustLevel::Full);
    let p = f.pool();
    let (mut tx2, mut rx2) = link(&f.a, &f.b, TrustLevel::Full);
    tx2.assign_pool(f.alloc.pool()).unwrap();
    assert_eq!(recv_request(&mut rx2).pool, p);
    rx2.respond_pool(p, false).unwrap();
    expect(&mut tx2, &format!("PoolVetoed({p:?})"));
    assert_eq!(f.b.pools(), vec![p]);
    assert_eq!((f.a.pool_trust(p), f.b.pool_trust(p)), (Some(TrustLevel::Full), Some(TrustLevel::Full)));
    assert!(f.rx.is_assigned(p) && f.tx.is_assigned(p) && !tx2.is_assigned(p) && !rx2.is_assigned(p));
    let y = f.moved();
    f.rx.pass(y, b"").unwrap();
    recv_pass(&mut f.tx);
}

/// The library vetoes by itself a pool that violates the channel's
/// constraints: the peer sees `PoolVetoed` (no request to answer) and never
/// lists the pool; the assigner sees `PoolVetoed`.
#[test]
fn constraint_violation_is_vetoed_by_the_library() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let constraints = ChannelConstraints { min_buffer_size: 2 * page(), ..ChannelConstraints::default() };
    let (mut tx, mut rx) =
        connect(&a, &b, ChannelSetup { constraints, ..ChannelSetup::default() }, BindParams::default());
    let small = new_alloc(&a, 1);
    let p = small.pool().id();
    tx.assign_pool(small.pool()).unwrap();
    match rx.poll() {
        None => {}
        Some(Event::PoolVetoed(id)) if id == p => {}
        Some(other) => panic!("no request may reach the application: {other:?}"),
    }
    assert!(rx.pending_requests().is_empty() && b.pools().is_empty());
    assert_eq!(rx.respond_pool(p, true), Err(ErrorKind::NoPendingRequest(p).into()));
    expect(&mut tx, &format!("PoolVetoed({p:?})"));
    assert_eq!(a.pool_trust(p), Some(TrustLevel::Uninitialized));
    let big = Allocator::new(&a, 1, 2 * page(), PoolConstraints::default()).unwrap();
    assign(&mut tx, &mut rx, big.pool());
}

// ---------------------------------------------------------------------------
// 5. Copies.

/// A copy makes the owner READ_ONLY_OWNED (no write access) and the holder
/// READ_ONLY with the same bytes; the owner stays read-only until the
/// release is delivered, then gets `CopyReleased { writable: true }`.
#[test]
fn copy_and_release() {
    let mut f = fixture(TrustLevel::Full);
    let mut x = f.buf();
    let xid = x.id();
    fill(x.as_mut_slice().unwrap(), 11);
    f.tx.copy(&x, b"cm").unwrap();
    assert_eq!(f.states(xid), [ReadOnlyOwned, Invalid]);
    assert_eq!(x.as_mut_slice().err(), Some(ErrorKind::CopiesOutstanding.into()));
    let (copy, meta) = recv_copy(&mut f.rx);
    assert_eq!((copy.id(), &meta[..]), (xid, &b"cm"[..]));
    assert_eq!(f.states(xid), [ReadOnlyOwned, ReadOnly]);
    assert_eq!(mismatch(&copy, 11), None);
    assert_eq!(copy.as_ptr() as usize, f.addrs(xid.index).1);
    f.rx.release(copy).unwrap();
    assert_eq!(f.states(xid), [ReadOnlyOwned, Invalid], "the owner waits for the delivery");
    assert!(x.as_mut_slice().is_err());
    assert!(recv_released(&mut f.tx, xid));
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);
    x.as_mut_slice().unwrap()[0] = 0xAB;
    assert_eq!(x[0], 0xAB);
}

/// The same buffer copied twice over one channel: two `CopyReceived`, and
/// two releases are needed before it is writable again.
#[test]
fn same_buffer_copied_twice_over_one_channel() {
    let mut f = fixture(TrustLevel::Full);
    let mut x = f.buf();
    let xid = x.id();
    f.tx.copy(&x, b"1").unwrap();
    f.tx.copy(&x, b"2").unwrap();
    let (c1, m1) = recv_copy(&mut f.rx);
    let (c2, m2) = recv_copy(&mut f.rx);
    assert_eq!((c1.id(), c2.id(), &m1[..], &m2[..]), (xid, xid, &b"1"[..], &b"2"[..]));
    f.rx.release(c1).unwrap();
    assert_eq!(f.states(xid), [ReadOnlyOwned, ReadOnly], "b still holds one copy");
    assert!(!recv_released(&mut f.tx, xid));
    assert_eq!(x.as_mut_slice().err(), Some(ErrorKind::CopiesOutstanding.into()));
    f.rx.release(c2).unwrap();
    assert!(recv_released(&mut f.tx, xid));
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);
    assert!(x.as_mut_slice().is_ok());
}

/// The owner may release a copy of its own buffer that came back to it
/// (A→B→A) even though its own copy is still out; then B can release too,
/// and A gets the buffer read-write again.
#[test]
fn owner_releases_a_copy_of_its_own_buffer() {
    let mut f = fixture(TrustLevel::Full);
    let (mut btx, mut arx) = link(&f.b, &f.a, TrustLevel::Full);
    assign(&mut btx, &mut arx, &f.b.pool(f.pool()).unwrap());
    let x = f.buf();
    let xid = x.id();
    f.tx.copy(&x, b"").unwrap();
    let (b_copy, _) = recv_copy(&mut f.rx);
    btx.copy(&b_copy, b"").unwrap();
    let (a_copy, _) = recv_copy(&mut arx);
    assert_eq!(&a_copy[..], &x[..]);
    assert_eq!(f.states(xid), [ReadOnlyOwned, ReadOnly]);
    let b_copy = refused(f.rx.release(b_copy), ErrorKind::CopiesForwarded.into());
    arx.release(a_copy).unwrap();
    assert!(!recv_released(&mut btx, xid), "b is not the owner");
    f.rx.release(b_copy).unwrap();
    assert!(recv_released(&mut f.tx, xid));
    assert_eq!(f.states(xid), [ReadWrite, Invalid]);
}

// ---------------------------------------------------------------------------
// 6. Pool removal.

/// Removal started by the source, accepted: `PoolRemoved` at both ends,
/// then moves and passes of the pool are `PoolNotAssigned`; the buffers keep
/// their owners (b still owns its buffer read-write); re-assigning the pool
/// lets b pass it back.
#[test]
fn pool_removal_by_source() {
    let mut f = fixture(TrustLevel::Full);
    let p = f.pool();
    let y = f.moved();
    let yid = y.id();
    f.tx.remove_pool(p).unwrap();
    expect(&mut f.rx, &format!("PoolRemoved({p:?})"));
    assert!(!f.rx.is_assigned(p));
    expect(&mut f.tx, &format!("PoolRemoved({p:?})"));
    assert!(!f.tx.is_assigned(p));
    let x = f.buf();
    let x = refused(f.tx.move_buffer(x, b""), ErrorKind::PoolNotAssigned(p).into());
    let mut y = refused(f.rx.pass(y, b""), ErrorKind::PoolNotAssigned(p).into());
    assert_eq!(f.states(yid), [Invalid, ReadWrite]);
    y.as_mut_slice().unwrap()[0] = 5;
    assert_eq!(f.states(x.id()), [ReadWrite, Invalid]);

    assign(&mut f.tx, &mut f.rx, f.alloc.pool());
    f.rx.pass(y, b"").unwrap();
    let (back, _) = recv_pass(&mut f.tx);
    assert_eq!((back.id(), back[0]), (yid, 5));
}

/// Removal started by the sink, accepted: `PoolRemoved` at both ends.
#[test]
fn pool_removal_by_sink() {
    let mut f = fixture(TrustLevel::Full);
    let p = f.pool();
    f.rx.remove_pool(p).unwrap();
    expect(&mut f.tx, &format!("PoolRemoved({p:?})"));
    expect(&mut f.rx, &format!("PoolRemoved({p:?})"));
    let x = f.buf();
    refused(f.tx.move_buffer(x, b""), ErrorKind::PoolNotAssigned(p).into());
    assert_eq!(f.a.pools(), vec![p], "the creator's allocator keeps the pool listed");
    assert!(f.b.pools().is_empty(), "nothing of the pool is left at the sink: it leaves the list");
}

/// Removal refused: the sink asks before a copy in flight reaches it; the
/// source has the copy out and refuses. Both ends see `PoolRemoveRefused`;
/// meanwhile the sink's release is `PoolRemovalPending`; afterwards the pool
/// is still assigned and a new removal succeeds.
#[test]
fn pool_removal_refused_with_copy_out() {
    let mut f = fixture(TrustLevel::Full);
    let p = f.pool();
    let x = f.buf();
    let xid = x.id();
    f.tx.copy(&x, b"").unwrap();
    f.rx.remove_pool(p).unwrap();
    expect(&mut f.tx, &format!("PoolRemoveRefused({p:?})"));
    let (copy, _) = recv_copy(&mut f.rx);
    let copy = refused(f.rx.release(copy), ErrorKind::PoolRemovalPending(p).into());
    assert_eq!(f.states(xid), [ReadOnlyOwned, ReadOnly]);
    expect(&mut f.rx, &format!("PoolRemoveRefused({p:?})"));
    assert!(f.tx.is_assigned(p) && f.rx.is_assigned(p));
    f.rx.release(copy).unwrap();
    assert!(recv_released(&mut f.tx, xid));
    f.rx.remove_pool(p).unwrap();
    expect(&mut f.tx, &format!("PoolRemoved({p:?})"));
    expect(&mut f.rx, &format!("PoolRemoved({p:?})"));
}

// ---------------------------------------------------------------------------
// 7. Teardown.

/// Messages queued before the marker reach the peer first, then it sees
/// `Closed { by_peer: true }`; the initiator sees `Closed { by_peer: false }`.
/// After close every operation on either end is `NotConnected(Closed)`,
/// `wait` returns at once, moved buffers stay with the receiver and a copy
/// still out stays read-only on both sides.
#[test]
fn teardown_delivers_queued_messages_then_closes() {
    let mut f = fixture(TrustLevel::Full);
    let moved: Vec<BufferId> = (0..3u8)
        .map(|i| {
            let x = f.buf();
            let id = x.id();
            f.tx.move_buffer(x, &[i]).unwrap();
            id
        })
        .collect();
    let y = f.buf();
    let yid = y.id();
    f.tx.copy(&y, b"c").unwrap();
    f.tx.teardown().unwrap();

    let mut got = Vec::new();
    for i in 0..3u8 {
        let (buf, meta) = recv_move(&mut f.rx);
        assert_eq!((buf.id(), &meta[..]), (moved[i as usize], &[i][..]));
        got.push(buf);
    }
    let (copy, _) = recv_copy(&mut f.rx);
    expect(&mut f.rx, "Closed { by_peer: true }");
    expect(&mut f.tx, "Closed { by_peer: false }");
    assert_eq!((f.tx.state(), f.rx.state()), (ChannelState::Closed, ChannelState::Closed));
    assert!(!f.tx.is_assigned(f.pool()) && !f.rx.is_assigned(f.pool()), "a closed side lists no pool");

    let closed = ErrorKind::NotConnected(ChannelState::Closed);
    let p = f.pool();
    let x = f.buf();
    let x = refused(f.tx.move_buffer(x, b""), closed.clone().into());
    let x = refused(f.tx.pass(x, b""), closed.clone().into());
    let x = refused(f.tx.full_copy(&y, x, b""), closed.clone().into());
    assert_eq!(f.tx.copy(&x, b""), Err(closed.clone().into()));
    assert_eq!(f.tx.assign_pool(f.alloc.pool()), Err(closed.clone().into()));
    assert_eq!(f.tx.remove_pool(p), Err(closed.clone().into()));
    assert_eq!(f.tx.respond_pool(p, true), Err(closed.clone().into()));
    assert_eq!(f.tx.teardown(), Err(closed.clone().into()));
    let b0 = got.pop().unwrap();
    let b0 = refused(f.rx.pass(b0, b""), closed.clone().into());
    let b0 = refused(f.rx.move_buffer(b0, b""), closed.clone().into());
    let copy = refused(f.rx.release(copy), closed.clone().into());
    assert_eq!(f.rx.assign_pool(&f.b.pool(p).unwrap()), Err(closed.clone().into()));
    assert_eq!(f.rx.remove_pool(p), Err(closed.clone().into()));
    assert_eq!(f.rx.teardown(), Err(closed.into()));
    let start = Instant::now();
    // Closed, not timed out: nothing more will come, and `wait` says so.
    assert!(
        matches!(f.tx.wait(Some(T)), Err(WaitError::Closed)) && matches!(f.rx.wait(Some(T)), Err(WaitError::Closed))
    );
    assert!(f.tx.poll().is_none() && f.rx.poll().is_none());
    assert!(start.elapsed() < Duration::from_secs(1), "wait on a closed channel returns at once");

    for id in &moved {
        assert_eq!(f.states(*id), [Invalid, ReadWrite]);
    }
    assert_eq!(f.states(yid), [ReadOnlyOwned, ReadOnly]);
    assert_eq!(&copy[..], &y[..]);
    assert_eq!((b0.id(), f.states(x.id())), (moved[2], [ReadWrite, Invalid]));
}

/// A teardown started by the sink: the source's moves issued before it saw
/// the marker still reach the sink, before the sink's
/// `Closed { by_peer: false }`; the sink cannot send meanwhile.
#[test]
fn teardown_by_sink_still_receives_moves_in_transit() {
    let mut f = fixture(TrustLevel::Full);
    let ids: Vec<BufferId> = (0..2)
        .map(|_| {
            let x = f.buf();
            let id = x.id();
            f.tx.move_buffer(x, b"").unwrap();
            id
        })
        .collect();
    f.rx.teardown().unwrap();
    expect(&mut f.tx, "Closed { by_peer: true }");
    let (y0, _) = recv_move(&mut f.rx);
    assert_eq!(y0.id(), ids[0]);
    let y0 = refused(f.rx.pass(y0, b""), ErrorKind::TearingDown.into());
    assert_eq!(recv_move(&mut f.rx).0.id(), ids[1]);
    expect(&mut f.rx, "Closed { by_peer: false }");
    assert_eq!(f.states(y0.id()), [Invalid, ReadWrite]);
}

// ---------------------------------------------------------------------------
// 8. Drops.

/// Dropping the sink's end with moves and a copy queued to it: the moved
/// buffers become the sink domain's (its free list grows), the copy is
/// released, and the source sees `CopyReleased` then `Error(PeerGone)`.
#[test]
fn dropping_sink_with_buffers_in_flight() {
    let mut f = fixture(TrustLevel::Full);
    let p = f.pool();
    let moved: Vec<BufferId> = (0..3)
        .map(|_| {
            let x = f.buf();
            let id = x.id();
            f.tx.move_buffer(x, b"").unwrap();
            id
        })
        .collect();
    let y = f.buf();
    f.tx.copy(&y, b"").unwrap();
    assert_eq!(f.b.free_count(p), 0);
    // A handle keeps the pool in b's list once its channel is gone.
    let _listed = f.b.pool(p).expect("assigned");
    drop(f.rx);

    assert_eq!(f.b.free_count(p), 3, "the moved buffers went to the dropped end's free list");
    for &id in &moved {
        assert_eq!((f.a.buffer_state(id), f.b.buffer_state(id)), (Invalid, ReadWrite));
    }
    assert!(recv_released(&mut f.tx, y.id()), "the unseen copy was released");
    match next(&mut f.tx) {
        Event::Closed { .. } => {}
        Event::Error(err) if matches!(err.kind(), ErrorKind::PeerGone) => {}
        other => panic!("expected PeerGone, got {other:?}"),
    }
    assert_eq!(f.tx.state(), ChannelState::Closed);
    // b can allocate exactly those buffers from the pool now.
    let taken: Vec<Buffer> = std::iter::from_fn(|| f.b.alloc(p)).collect();
    let mut got: Vec<BufferId> = taken.iter().map(|b| b.id()).collect();
    got.sort();
    assert_eq!(got, moved);
}

/// Dropping the source's end with passes queued to it: the buffers go back
/// to its allocator, and the sink sees the peer gone.
#[test]
fn dropping_source_with_passes_in_flight() {
    let mut f = fixture(TrustLevel::Full);
    let ys: Vec<Buffer> = (0..3).map(|_| f.moved()).collect();
    assert_eq!(f.alloc.available(), COUNT as usize - 3);
    for y in ys {
        f.rx.pass(y, b"").unwrap();
    }
    drop(f.tx);
    assert_eq!(f.alloc.available(), COUNT as usize);
    match next(&mut f.rx) {
        Event::Closed { .. } => {}
        Event::Error(err) if matches!(err.kind(), ErrorKind::PeerGone) => {}
        other => panic!("expected PeerGone, got {other:?}"),
    }
}

/// Dropping the source's end right after moves: the moves were issued, so
/// the sink still receives every one of them before it sees the peer gone.
#[test]
fn dropping_source_after_moves_still_delivers_them() {
    let mut f = fixture(TrustLevel::Full);
    let ids: Vec<BufferId> = (0..3)
        .map(|_| {
            let x = f.buf();
            let id = x.id();
            f.tx.move_buffer(x, b"").unwrap();
            id
        })
        .collect();
    // A handle keeps the pool in b's list once its channel is gone.
    let _listed = f.b.pool(f.alloc.pool().id()).expect("assigned");
    drop(f.tx);
    for id in &ids {
        assert_eq!(recv_move(&mut f.rx).0.id(), *id);
    }
    match next(&mut f.rx) {
        Event::Closed { .. } => {}
        Event::Error(err) if matches!(err.kind(), ErrorKind::PeerGone) => {}
        other => panic!("expected PeerGone, got {other:?}"),
    }
    assert_eq!(f.b.free_count(f.alloc.pool().id()), 3, "the received buffers were dropped into b's free list");
}

/// Dropping the sink's end releases the copies it never saw even when its
/// outgoing queue is full at that moment (Channel's Drop: "copies never
/// seen are released again"): the owner gets its buffers back read-write.
#[test]
fn dropping_sink_releases_unseen_copies_even_with_full_queue() {
    let mut f = fixture_with(ChannelSetup { queue_depth: 2, ..ChannelSetup::default() });
    let y = f.moved();
    f.rx.pass(y, b"").unwrap(); // one slot of the sink's queue in use
    let xs: Vec<Buffer> = (0..2).map(|_| f.buf()).collect();
    for x in &xs {
        f.tx.copy(x, b"").unwrap();
    }
    drop(f.rx);
    recv_pass(&mut f.tx);
    let mut released = Vec::new();
    loop {
        match next(&mut f.tx) {
            Event::CopyReleased { buffer, writable } => released.push((buffer, writable)),
            Event::Closed { .. } => break,
            Event::Error(err) if matches!(err.kind(), ErrorKind::PeerGone) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    let want: Vec<(BufferId, bool)> = xs.iter().map(|x| (x.id(), true)).collect();
    assert_eq!(released, want);
    for x in &xs {
        assert_eq!(f.a.buffer_state(x.id()), ReadWrite);
    }
}

/// Messages in transit still reach a side in TEARDOWN: the peer accepts an
/// assignment before it sees the marker, and the initiator gets
/// `PoolAssigned` before `Closed { by_peer: false }`.
#[test]
fn teardown_initiator_still_gets_replies_in_transit() {
    let mut f = fixture(TrustLevel::Full);
    let other = new_alloc(&f.a, 1);
    let p2 = other.pool().id();
    f.tx.assign_pool(other.pool()).unwrap();
    f.tx.teardown().unwrap();
    assert_eq!(recv_request(&mut f.rx).pool, p2);
    f.rx.respond_pool(p2, true).unwrap();
    expect(&mut f.rx, "Closed { by_peer: true }");
    expect(&mut f.tx, &format!("PoolAssigned({p2:?})"));
    expect(&mut f.tx, "Closed { by_peer: false }");
    assert!(f.a.pools().contains(&p2), "the creator's allocator keeps it listed");
    assert!(!f.b.pools().contains(&p2), "the sink's channel is closed and it holds nothing of the pool");
}

/// Closing with a request still unanswered: the provisional pool leaves
/// the responder's list.
#[test]
fn closing_forgets_a_provisional_pool() {
    let mut f = fixture(TrustLevel::Full);
    let other = new_alloc(&f.a, 1);
    let p2 = other.pool().id();
    f.tx.assign_pool(other.pool()).unwrap();
    f.tx.teardown().unwrap();
    assert_eq!(recv_request(&mut f.rx).pool, p2);
    assert!(f.b.pools().contains(&p2) && f.b.pool(p2).is_some());
    expect(&mut f.rx, "Closed { by_peer: true }");
    assert!(f.b.pools().is_empty(), "the provisional pool is gone, and the accepted one with its channel");
    assert!(f.b.pool(p2).is_none());
    assert_eq!(f.rx.respond_pool(p2, true), Err(ErrorKind::NotConnected(ChannelState::Closed).into()));
    expect(&mut f.tx, "Closed { by_peer: false }");
    assert!(f.a.pools().contains(&p2));
}

/// Dropping an allocator frees nothing in use: its buffers stay valid and
/// writable, can still travel, and return to the domain's free list.
#[test]
fn dropping_allocator_keeps_buffers_valid() {
    let mut f = fixture(TrustLevel::Full);
    let p = f.pool();
    let mut x = f.buf();
    let mut z = f.buf();
    let alloc = std::mem::replace(&mut f.alloc, new_alloc(&f.a, 1));
    drop(alloc);
    fill(x.as_mut_slice().unwrap(), 1);
    fill(z.as_mut_slice().unwrap(), 2);
    let xid = x.id();
    f.tx.move_buffer(x, b"").unwrap();
    let (y, _) = recv_move(&mut f.rx);
    assert_eq!((y.id(), mismatch(&y, 1)), (xid, None));
    assert_eq!(mismatch(&z, 2), None);
    let free = f.a.free_count(p);
    let zid = z.id();
    drop(z);
    assert_eq!(f.a.free_count(p), free + 1);
    assert_eq!(f.a.alloc(p).map(|b| b.id()), Some(zid), "LIFO: the freed buffer comes out first");
}

/// Dropping a received copy releases it the next time the holder's channel
/// runs (not before): then the owner gets `CopyReleased { writable: true }`.
#[test]
fn dropping_a_copy_releases_it_on_next_poll() {
    let mut f = fixture(TrustLevel::Full);
    let mut x = f.buf();
    let xid = x.id();
    f.tx.copy(&x, b"").unwrap();
    let (copy, _) = recv_copy(&mut f.rx);
    drop(copy);
    assert_quiet(&mut f.tx);
    assert_eq!(f.a.buffer_state(xid), ReadOnlyOwned);
    assert!(f.rx.poll().is_none());
    assert_eq!(f.b.buffer_state(xid), Invalid);
    assert!(recv_released(&mut f.tx, xid));
    x.as_mut_slice().unwrap()[0] = 1;
}

/// A dropped copy that was forwarded is released only once the forwarded
/// copy is back (A→B→C): B's polls keep it until then.
#[test]
fn dropped_forwarded_copy_waits_for_the_forwarded_one() {
    let mut ch = chain();
    let x = ch.f.buf();
    let xid = x.id();
    ch.f.tx.copy(&x, b"").unwrap();
    let (b_copy, _) = recv_copy(&mut ch.f.rx);
    ch.btx.copy(&b_copy, b"").unwrap();
    drop(b_copy);
    assert!(ch.f.rx.poll().is_none());
    assert_quiet(&mut ch.f.tx);
    assert_eq!(ch.states(xid), [ReadOnlyOwned, ReadOnly, Invalid]);
    let (c_copy, _) = recv_copy(&mut ch.crx);
    ch.crx.release(c_copy).unwrap();
    assert!(!recv_released(&mut ch.btx, xid));
    assert!(ch.f.rx.poll().is_none());
    assert!(recv_released(&mut ch.f.tx, xid));
    assert_eq!(ch.states(xid), [ReadWrite, Invalid, Invalid]);
}

// ---------------------------------------------------------------------------
// 9. Page protection (trust HALF) as the kernel sees it.

/// With HALF trust each domain's view of a buffer follows its state: the
/// sender's page is rw- while it owns the buffer, --- once moved, rw- again
/// when the pass is delivered, r-- while a copy is out; the receiver's view
/// is rw- while it owns it, r-- while it holds a copy, --- otherwise. The
/// neighbouring buffer is untouched.
#[test]
fn half_trust_protects_pages() {
    let mut f = fixture(TrustLevel::Half);
    let x = f.buf();
    let id = x.id();
    let (a_addr, b_addr) = f.addrs(id.index);
    let (a_next, _) = f.addrs(id.index + 1);
    let views = || (perms(a_addr), perms(b_addr));
    let rw = || "rw-".to_owned();
    let ro = || "r--".to_owned();
    let no = || "---".to_owned();
    assert_eq!(views(), (rw(), no()));
    f.tx.move_buffer(x, b"").unwrap();
    assert_eq!(views(), (no(), no()), "moved, not delivered");
    let (y, _) = recv_move(&mut f.rx);
    assert_eq!(views(), (no(), rw()));
    assert_eq!(perms(a_next), rw());
    f.rx.pass(y, b"").unwrap();
    assert_eq!(views(), (no(), no()), "passed, not delivered");
    let (x, _) = recv_pass(&mut f.tx);
    assert_eq!(views(), (rw(), no()));
    f.tx.copy(&x, b"").unwrap();
    assert_eq!(views(), (ro(), no()));
    let (copy, _) = recv_copy(&mut f.rx);
    assert_eq!(views(), (ro(), ro()));
    f.rx.release(copy).unwrap();
    assert_eq!(views(), (ro(), no()));
    assert!(recv_released(&mut f.tx, id));
    assert_eq!(views(), (rw(), no()));
    assert_eq!(perms(a_next), rw());
}

/// With FULL trust nothing is ever protected: both views stay rw- through
/// move, pass, copy and release.
#[test]
fn full_trust_never_protects() {
    let mut f = fixture(TrustLevel::Full);
    let x = f.buf();
    let id = x.id();
    let (a_addr, b_addr) = f.addrs(id.index);
    let check = |when: &str| assert_eq!((perms(a_addr), perms(b_addr)), ("rw-".into(), "rw-".into()), "{when}");
    check("start");
    f.tx.move_buffer(x, b"").unwrap();
    check("moved");
    let (y, _) = recv_move(&mut f.rx);
    check("delivered");
    f.rx.pass(y, b"").unwrap();
    check("passed");
    let (x, _) = recv_pass(&mut f.tx);
    f.tx.copy(&x, b"").unwrap();
    check("copied");
    let (copy, _) = recv_copy(&mut f.rx);
    check("copy delivered");
    f.rx.release(copy).unwrap();
    assert!(recv_released(&mut f.tx, id));
    check("released");
}

// ---------------------------------------------------------------------------
// 10. HALF protection faults for real (child process).

const CHILD_TEST: &str = "half_trust_child_writes_after_move";

fn run_child(mode: &str) -> std::process::Output {
    let exe = std::env::current_exe().expect("current_exe");
    Command::new(exe)
        .args(["--ignored", "--exact", CHILD_TEST, "--nocapture", "--test-threads=1"])
        .env("FERRY_CHILD", mode)
        .output()
        .expect("run child")
}

/// A write through the sender's old address after a move under HALF trust
/// kills the process with SIGSEGV; the same write after the buffer came
/// back does not (control run).
#[test]
fn half_trust_write_after_move_faults() {
    let out = run_child("1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("child: wrote before move"), "child did not get that far: {stderr}");
    assert_eq!(out.status.signal(), Some(11), "child status {:?}, stderr: {stderr}", out.status);

    let out = run_child("control");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "control child failed: {:?}, stderr: {stderr}", out.status);
    assert!(stderr.contains("child: wrote after pass"), "control child did not run: {stderr}");
}

/// Helper of `half_trust_write_after_move_faults`, run in a child process;
/// does nothing unless FERRY_CHILD is set.
#[test]
#[ignore = "helper run in a child process by half_trust_write_after_move_faults"]
fn half_trust_child_writes_after_move() {
    let Ok(mode) = std::env::var("FERRY_CHILD") else { return };
    let mut f = fixture(TrustLevel::Half);
    let x = f.buf();
    let addr = f.addrs(x.id().index).0 as *mut u8;
    // SAFETY: the sender owns the buffer read-write; the mapping is alive.
    unsafe { std::ptr::write_volatile(addr, 1) };
    eprintln!("child: wrote before move");
    f.tx.move_buffer(x, b"").unwrap();
    if mode == "control" {
        let (y, _) = recv_move(&mut f.rx);
        f.rx.pass(y, b"").unwrap();
        let (back, _) = recv_pass(&mut f.tx);
        // SAFETY: the buffer is ours and read-write again.
        unsafe { std::ptr::write_volatile(addr, 3) };
        assert_eq!(back[0], 3);
        eprintln!("child: wrote after pass");
        return;
    }
    // SAFETY: none: the page is PROT_NONE now, this write must fault.
    unsafe { std::ptr::write_volatile(addr, 2) };
    eprintln!("child: write after move did not fault");
}

// ---------------------------------------------------------------------------
// 11. Batching (Channel::set_batching): when held-back messages go out.

/// A batching end publishes its messages on `flush`, on a `poll` that finds
/// nothing, at 32 held back, and with a teardown; never before.
#[test]
fn batching_publishes_on_flush_idle_poll_threshold_and_teardown() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let (mut tx, mut rx) = link(&a, &b, TrustLevel::Full);
    let alloc = new_alloc(&a, 64);
    assign(&mut tx, &mut rx, alloc.pool());
    tx.set_batching(true).unwrap();

    // Held back until flush.
    tx.move_buffer(alloc.alloc().unwrap(), b"1").unwrap();
    assert_quiet(&mut rx);
    tx.flush().unwrap();
    let (x, meta) = recv_move(&mut rx);
    assert_eq!(&meta[..], b"1");

    // A poll of the sender that finds nothing publishes too.
    tx.move_buffer(alloc.alloc().unwrap(), b"2").unwrap();
    assert_quiet(&mut rx);
    assert_quiet(&mut tx);
    let (y, _) = recv_move(&mut rx);

    // The receiving end batches its passes the same way.
    rx.set_batching(true).unwrap();
    rx.pass(x, b"").unwrap();
    rx.pass(y, b"").unwrap();
    assert_quiet(&mut tx);
    assert_quiet(&mut rx);
    recv_pass(&mut tx);
    recv_pass(&mut tx);

    // The 32nd message held back publishes the batch.
    for i in 0..31u8 {
        tx.move_buffer(alloc.alloc().unwrap(), &[i]).unwrap();
    }
    assert_quiet(&mut rx);
    tx.move_buffer(alloc.alloc().unwrap(), &[31]).unwrap();
    let mut got = Vec::new();
    while let Some(Event::MoveReceived { buffer, meta }) = rx.poll() {
        got.push(meta[0]);
        drop(buffer);
    }
    assert_eq!(got, (0..32).collect::<Vec<u8>>(), "all 32, in order, at once");

    // Turning batching off publishes what is held back.
    tx.move_buffer(alloc.alloc().unwrap(), b"3").unwrap();
    assert_quiet(&mut rx);
    tx.set_batching(false).unwrap();
    assert_eq!(&recv_move(&mut rx).1[..], b"3");

    // A teardown goes out at once, after what was held back.
    tx.set_batching(true).unwrap();
    tx.move_buffer(alloc.alloc().unwrap(), b"4").unwrap();
    tx.teardown().unwrap();
    assert_eq!(&recv_move(&mut rx).1[..], b"4");
    expect(&mut rx, "Closed { by_peer: true }");
    expect(&mut tx, "Closed { by_peer: false }");
}

/// A full queue publishes what is held back (so the peer can make room)
/// and refuses with `QueueFull` as without batching.
#[test]
fn batching_full_queue_publishes() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let setup = ChannelSetup { queue_depth: 4, ..ChannelSetup::default() };
    let (mut tx, mut rx) = connect(&a, &b, setup, BindParams::default());
    let alloc = new_alloc(&a, COUNT);
    assign(&mut tx, &mut rx, alloc.pool());
    tx.set_batching(true).unwrap();
    for _ in 0..4 {
        tx.move_buffer(alloc.alloc().unwrap(), b"").unwrap();
    }
    assert_quiet(&mut rx);
    let x = refused(tx.move_buffer(alloc.alloc().unwrap(), b""), ErrorKind::QueueFull.into());
    for _ in 0..4 {
        recv_move(&mut rx);
    }
    tx.move_buffer(x, b"").unwrap();
    tx.flush().unwrap();
    recv_move(&mut rx);
}

/// Batching is a property of a connected end.
#[test]
fn batching_needs_a_connected_channel() {
    let ep = Endpoint::local();
    let mut ch = Channel::create(&Domain::new("a"), &ep, ChannelSetup::default()).unwrap();
    assert_eq!(ch.set_batching(true), Err(ErrorKind::NotConnected(ChannelState::Initialized).into()));
    assert_eq!(ch.flush(), Ok(()));
}

/// Transmit master across two threads with batching at both ends: every
/// buffer comes back, in order, with its stamp (nothing is held back
/// forever by an end that waits).
#[test]
fn batched_flow_across_threads() {
    const POOL: u64 = 64;
    let (a, b) = (Domain::new("source"), Domain::new("sink"));
    let (mut tx, mut rx) = link(&a, &b, TrustLevel::Full);
    let alloc = new_alloc(&a, POOL);
    assign(&mut tx, &mut rx, alloc.pool());
    tx.set_batching(true).unwrap();
    rx.set_batching(true).unwrap();
    drop(transmit_flow(&mut tx, rx, &alloc));
    assert_eq!(alloc.available(), POOL as usize);
}

/// A pool offered to d1 on a channel d1 then tears down (the offer can no
/// longer be answered) returns to UNINITIALIZED at its owner after a veto
/// elsewhere, and is offered to d1 again at another trust: d1's record of
/// the dead offer's trust is provisional (the pool's trust is fixed only by
/// an accepted assignment), so the new offer reaches d1's application
/// instead of being vetoed by its library, and d1 records the new trust.
/// (Found by the model-based suite.)
#[test]
fn a_dead_offer_does_not_fix_the_trust_of_a_later_one() {
    let (d0, d1, d3) = (Domain::new("d0"), Domain::new("d1"), Domain::new("d3"));
    let alloc = new_alloc(&d0, 2);
    let id = alloc.pool().id();
    // d1 -> d0 at FULL: d0 (the sink) offers the pool; d1 tears down unanswered.
    let (mut d1_tx, mut d0_rx) = link(&d1, &d0, TrustLevel::Full);
    d0_rx.assign_pool(alloc.pool()).expect("offer");
    assert_eq!(recv_request(&mut d1_tx).trust, TrustLevel::Full);
    d1_tx.teardown().expect("teardown");
    assert!(matches!(next(&mut d0_rx), Event::Closed { by_peer: true }));
    assert_eq!(d1.pool_trust(id), Some(TrustLevel::Full), "d1 still has the offer it cannot answer");
    // A veto elsewhere: the pool was never accepted anywhere, its trust returns.
    let (mut d3_tx, mut d0_rx3) = link(&d3, &d0, TrustLevel::Full);
    d0_rx3.assign_pool(alloc.pool()).expect("offer");
    let offered = recv_request(&mut d3_tx).pool;
    d3_tx.respond_pool(offered, false).expect("veto");
    assert!(matches!(next(&mut d0_rx3), Event::PoolVetoed(p) if p == id));
    assert_eq!(d0.pool_trust(id), Some(TrustLevel::Uninitialized));
    // Offered to d1 again, at HALF.
    let (mut d0_tx, mut d1_rx) = link(&d0, &d1, TrustLevel::Half);
    d0_tx.assign_pool(alloc.pool()).expect("offer at HALF");
    let req = recv_request(&mut d1_rx);
    assert_eq!((req.pool, req.trust), (id, TrustLevel::Half));
    assert_eq!(d1.pool_trust(id), Some(TrustLevel::Half));
    d1_rx.respond_pool(id, true).expect("accept");
    assert!(matches!(next(&mut d0_tx), Event::PoolAssigned(p) if p == id));
    assert_eq!((d0.pool_trust(id), d1.pool_trust(id)), (Some(TrustLevel::Half), Some(TrustLevel::Half)));
}

/// A creator dropped before any binder came frees its local endpoint: a
/// bind then finds nobody listening (at once, not after a timeout), a
/// binder already waiting is told so, and a new channel may be created on
/// the same endpoint.
#[test]
fn a_creator_that_gives_up_frees_its_local_endpoint() {
    let (a, b) = (Domain::new("a"), Domain::new("b"));
    let ep = Endpoint::local();
    drop(Channel::create(&a, &ep, ChannelSetup::default()).expect("create"));
    assert_eq!(Channel::bind(&b, &ep, BindParams::default()).unwrap_err(), ErrorKind::EndpointNotListening);
    // A binder whose offer the creator never took.
    let creator = Channel::create(&a, &ep, ChannelSetup::default()).expect("create again");
    let mut binder = Channel::bind(&b, &ep, BindParams::default()).expect("bind");
    drop(creator);
    match binder.wait(Some(Duration::from_secs(10))) {
        Ok(Event::Error(e)) => assert_eq!(e, ErrorKind::EndpointNotListening),
        other => panic!("expected the binder to learn that nobody listens, got {other:?}"),
    }
    // And the endpoint serves a new channel.
    let (_c, _b) = {
        let mut c = Channel::create(&a, &ep, ChannelSetup::default()).expect("create a third time");
        let mut b2 = Channel::bind(&b, &ep, BindParams::default()).expect("bind");
        assert!(matches!(next(&mut c), Event::BindRequest { .. }));
        assert!(matches!(next(&mut b2), Event::Bound));
        (c, b2)
    };
}
