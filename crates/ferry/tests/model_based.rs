//! Model-based tests: random operation sequences run against the reference
//! model (`tests/model/reference.rs`) and the real library side by side.
//! After every step the library must have accepted exactly what the model
//! accepted (with the same error), delivered the same event, and be in the
//! same state: every buffer's per-domain state, every channel end's state,
//! every pool's assignment per end, every domain's pool list and trust.
//! The model's invariants are checked after every step too.
//!
//! The suite is generic over [`Backend`]: a backend says how it connects
//! two domains and which trust levels it supports; everything else is the
//! same for every backend.

mod model;

use std::collections::HashMap;

use ferry::{
    Allocator, BindParams, Buffer, BufferCopy, BufferId, Channel, ChannelSetup, Direction, Domain, Endpoint, Error,
    Event as FEvent, Pool, PoolConstraints, TrustLevel,
};
use model::gen::{pick_op, setup, use_trusts, RawStep, DOMAINS, LINKS, META, POOLS};
use model::lib_map::{buffer_state, cases as model_cases, channel_state, meta_bytes, reject_of, trust_level, Stats};
use model::reference::{
    BufId, BufferState as MState, ChanId, DomainId, Event as MEvent, Model, Op, Outcome, Queue, Reject, Trust,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// A backend under test: how two domains get a connected channel.
trait Backend {
    /// Trust levels its channels support (weighted by repetition).
    const TRUSTS: &'static [Trust];
    /// Connect `source` (TX end) and `sink` (RX end); returns (source end, sink end).
    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel);
    /// Take the next message queued to `to` from `from` (`expect`: the
    /// model has one queued). A backend that batches sends flushes `from`
    /// first and waits for the bytes to cross.
    fn deliver(&mut self, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        let _ = (from, expect);
        to.poll()
    }
}

/// The local backend: both domains in this process.
struct Local;

impl Backend for Local {
    const TRUSTS: &'static [Trust] = &[Trust::Full, Trust::Full, Trust::Full, Trust::Half];

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        let ep = Endpoint::local();
        let setup = ChannelSetup { direction: Direction::Tx, trust, meta_size: META, ..ChannelSetup::default() };
        let mut s = Channel::create(source, &ep, setup).expect("create");
        let mut r = Channel::bind(sink, &ep, BindParams::default()).expect("bind");
        assert!(matches!(s.poll(), Some(FEvent::BindRequest { .. })));
        assert!(matches!(r.poll(), Some(FEvent::Bound)));
        (s, r)
    }
}

/// The shared-memory backend: both ends in this process, but every message
/// crosses the real setup socket, the memfd segment and its rings, and
/// pools travel as memfds (SCM_RIGHTS).
struct Shm;

impl Backend for Shm {
    const TRUSTS: &'static [Trust] = &[Trust::Full, Trust::Full, Trust::Half, Trust::None];

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let name = format!("ferry-model-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let ep = Endpoint::shm_abstract(&name);
        let setup = ChannelSetup { direction: Direction::Tx, trust, meta_size: META, ..ChannelSetup::default() };
        let mut s = Channel::create(source, &ep, setup).expect("create");
        let mut r = Channel::bind(sink, &ep, BindParams::default()).expect("bind");
        let t = std::time::Duration::from_secs(10);
        assert!(matches!(s.wait(Some(t)), Some(FEvent::BindRequest { .. })));
        assert!(matches!(r.wait(Some(t)), Some(FEvent::Bound)));
        (s, r)
    }
}

/// A backend with batching on at both ends of every channel: messages are
/// published only when the sending end flushes (here: before each delivery)
/// or polls without finding anything; the model is the same.
struct Batched<B>(B);

impl<B: Backend> Backend for Batched<B> {
    const TRUSTS: &'static [Trust] = B::TRUSTS;

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        let (mut s, mut r) = self.0.connect(source, sink, trust);
        s.set_batching(true).expect("connected");
        r.set_batching(true).expect("connected");
        (s, r)
    }

    fn deliver(&mut self, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        from.flush().expect("flush");
        self.0.deliver(to, from, expect)
    }
}

/// The TCP backend: both ends in this process, every message a frame on a
/// real loopback connection, every payload written from one domain's pool
/// memory and read into the other's mirror of it.
struct Net;

impl Backend for Net {
    const TRUSTS: &'static [Trust] = &[Trust::Full, Trust::Full, Trust::Half, Trust::None];

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        let ep = Endpoint::tcp("127.0.0.1:0".parse().unwrap());
        let setup = ChannelSetup { direction: Direction::Tx, trust, meta_size: META, ..ChannelSetup::default() };
        let mut s = Channel::create(source, &ep, setup).expect("create");
        let ep = Endpoint::tcp(s.listen_addr().expect("listening"));
        let mut r = Channel::bind(sink, &ep, BindParams::default()).expect("bind");
        let t = std::time::Duration::from_secs(10);
        assert!(matches!(s.wait(Some(t)), Some(FEvent::BindRequest { .. })));
        assert!(matches!(r.wait(Some(t)), Some(FEvent::Bound)));
        (s, r)
    }

    fn deliver(&mut self, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        from.flush().expect("flush");
        if expect {
            to.wait(Some(std::time::Duration::from_secs(10)))
        } else {
            to.poll()
        }
    }
}

/// The library side of a run, with the buffer handles each domain holds.
struct Harness<B: Backend> {
    backend: B,
    domains: Vec<Domain>,
    /// Per model pool: the library's id and the creator's handle.
    pools: Vec<(ferry::PoolId, Pool)>,
    _allocators: Vec<Allocator>,
    /// Per model channel: [source end, sink end] and the two domains.
    chans: Vec<([Channel; 2], [DomainId; 2])>,
    owned: HashMap<(DomainId, BufId), Buffer>,
    copies: HashMap<(DomainId, BufId, ChanId), Vec<BufferCopy>>,
}

impl<B: Backend> Harness<B> {
    fn new(backend: B) -> Self {
        Harness {
            backend,
            domains: (0..DOMAINS).map(|d| Domain::new(&format!("d{d}"))).collect(),
            pools: Vec::new(),
            _allocators: Vec::new(),
            chans: Vec::new(),
            owned: HashMap::new(),
            copies: HashMap::new(),
        }
    }

    fn bid(&self, b: BufId) -> BufferId {
        BufferId { pool: self.pools[b.pool].0, index: b.index as u32 }
    }

    /// The library's id of a model pool; an id nobody has for one that
    /// does not exist.
    fn lib_pool(&self, p: usize) -> ferry::PoolId {
        self.pools.get(p).map_or(ferry::PoolId::from_u128(u128::MAX - p as u128), |(id, _)| *id)
    }

    fn end(&mut self, chan: ChanId, domain: DomainId) -> &mut Channel {
        let side = if self.chans[chan].1[0] == domain { 0 } else { 1 };
        &mut self.chans[chan].0[side]
    }

    fn create_pool(&mut self, domain: DomainId, count: usize) {
        let a = Allocator::new(&self.domains[domain], count as u64, 4096, PoolConstraints::default()).expect("pool");
        let id = a.pool().id();
        let p = self.pools.len();
        self.pools.push((id, a.pool().clone()));
        for index in 0..count {
            let buf = a.alloc().expect("fresh pool has free buffers");
            assert_eq!(buf.id(), BufferId { pool: id, index: index as u32 });
            self.owned.insert((domain, BufId { pool: p, index }), buf);
        }
        self._allocators.push(a);
    }

    fn connect(&mut self, source: DomainId, sink: DomainId, trust: Trust) {
        let (s, r) = self.backend.connect(&self.domains[source], &self.domains[sink], trust_level(trust));
        self.chans.push(([s, r], [source, sink]));
    }

    /// An owned handle of `buf` for an operation by `d`: d's own, or (to
    /// provoke ForeignBuffer) another domain's. Returns the holder too.
    fn take_owned(&mut self, d: DomainId, buf: BufId) -> Option<(DomainId, Buffer)> {
        if let Some(b) = self.owned.remove(&(d, buf)) {
            return Some((d, b));
        }
        let other = self.owned.keys().find(|(_, b)| *b == buf).map(|(o, _)| *o)?;
        self.owned.remove(&(other, buf)).map(|b| (other, b))
    }

    /// Where a readable handle of `buf` for `d` is: owned or a copy.
    fn find_source(&self, d: DomainId, buf: BufId, may_be_foreign: bool) -> Option<SourceRef> {
        if self.owned.contains_key(&(d, buf)) {
            return Some(SourceRef::Owned(d));
        }
        if let Some(((_, _, c), _)) = self.copies.iter().find(|((h, b, _), v)| *h == d && *b == buf && !v.is_empty()) {
            return Some(SourceRef::Copy(d, *c));
        }
        if !may_be_foreign {
            return None;
        }
        if let Some((o, _)) = self.owned.keys().find(|(_, b)| *b == buf) {
            return Some(SourceRef::Owned(*o));
        }
        self.copies
            .iter()
            .find(|((_, b, _), v)| *b == buf && !v.is_empty())
            .map(|((h, _, c), _)| SourceRef::Copy(*h, *c))
    }

    /// Run `op` on the library; `None` when the op cannot be expressed with
    /// handles (no handle exists anywhere, e.g. the buffer is in flight).
    fn apply(&mut self, op: &Op, model_before: &Model, expect: bool) -> Option<Result<Option<FEvent>, Error>> {
        let unit = |r: Result<(), Error>| Some(r.map(|()| None));
        match *op {
            Op::CreatePool { .. } | Op::Connect { .. } => unreachable!("handled by the caller"),
            Op::AssignPool { domain, chan, pool } => {
                // A pool that does not exist has no handle to offer.
                let id = self.pools.get(pool)?.0;
                let handle = self.domains[domain].pool(id).unwrap_or_else(|| self.pools[pool].1.clone());
                unit(self.end(chan, domain).assign_pool(&handle))
            }
            Op::RespondAssign { domain, chan, pool, accept } => {
                let id = self.lib_pool(pool);
                unit(self.end(chan, domain).respond_pool(id, accept))
            }
            Op::RemovePool { domain, chan, pool } => {
                let id = self.lib_pool(pool);
                unit(self.end(chan, domain).remove_pool(id))
            }
            Op::Move { domain, chan, buf, meta_len } | Op::Pass { domain, chan, buf, meta_len } => {
                let (holder, b) = self.take_owned(domain, buf)?;
                let meta = meta_bytes(meta_len);
                let end = self.end(chan, domain);
                let r = if matches!(op, Op::Move { .. }) { end.move_buffer(b, &meta) } else { end.pass(b, &meta) };
                match r {
                    Ok(()) => Some(Ok(None)),
                    Err(refused) => {
                        let e = refused.error.clone();
                        self.owned.insert((holder, buf), refused.into_inner());
                        Some(Err(e))
                    }
                }
            }
            Op::Copy { domain, chan, buf, meta_len } => {
                let foreign_ok = model_before.buffer_state(buf, domain) == MState::Invalid;
                let src = self.find_source(domain, buf, foreign_ok)?;
                let meta = meta_bytes(meta_len);
                let side = if self.chans[chan].1[0] == domain { 0 } else { 1 };
                let (chans, owned, copies) = (&mut self.chans, &self.owned, &self.copies);
                let end = &mut chans[chan].0[side];
                Some(
                    match src {
                        SourceRef::Owned(h) => end.copy(&owned[&(h, buf)], &meta),
                        SourceRef::Copy(h, c) => end.copy(&copies[&(h, buf, c)][0], &meta),
                    }
                    .map(|()| None),
                )
            }
            Op::Release { domain, chan, buf } => {
                // The copy held via this channel; else one held via another
                // channel (NotCopyHolder); else, if the domain cannot see the
                // buffer at all, another domain's copy (ForeignBuffer).
                let key = if self.copies.get(&(domain, buf, chan)).is_some_and(|v| !v.is_empty()) {
                    (domain, buf, chan)
                } else if let Some(k) = self
                    .copies
                    .iter()
                    .find(|((h, b, _), v)| *h == domain && *b == buf && !v.is_empty())
                    .map(|(k, _)| *k)
                {
                    k
                } else if model_before.buffer_state(buf, domain) == MState::Invalid {
                    *self.copies.iter().find(|((_, b, _), v)| *b == buf && !v.is_empty()).map(|(k, _)| k)?
                } else {
                    return None;
                };
                let copy = self.copies.get_mut(&key).and_then(Vec::pop).expect("non-empty");
                match self.end(chan, domain).release(copy) {
                    Ok(()) => Some(Ok(None)),
                    Err(refused) => {
                        let e = refused.error.clone();
                        self.copies.entry(key).or_default().push(refused.into_inner());
                        Some(Err(e))
                    }
                }
            }
            Op::FullCopy { domain, chan, src, dst, meta_len } => {
                let foreign_src = model_before.buffer_state(src, domain) == MState::Invalid;
                let source = self.find_source(domain, src, foreign_src)?;
                let (holder, d) = self.take_owned(domain, dst)?;
                if matches!(source, SourceRef::Owned(h) if h == holder) && src == dst {
                    // The same handle cannot be both source and destination.
                    self.owned.insert((holder, dst), d);
                    return None;
                }
                let meta = meta_bytes(meta_len);
                let side = if self.chans[chan].1[0] == domain { 0 } else { 1 };
                let (chans, owned, copies) = (&mut self.chans, &self.owned, &self.copies);
                let end = &mut chans[chan].0[side];
                let r = match source {
                    SourceRef::Owned(h) => end.full_copy(&owned[&(h, src)], d, &meta),
                    SourceRef::Copy(h, c) => end.full_copy(&copies[&(h, src, c)][0], d, &meta),
                };
                match r {
                    Ok(()) => Some(Ok(None)),
                    Err(refused) => {
                        let e = refused.error.clone();
                        self.owned.insert((holder, dst), refused.into_inner());
                        Some(Err(e))
                    }
                }
            }
            Op::Teardown { domain, chan } => unit(self.end(chan, domain).teardown()),
            Op::Deliver { chan, queue } => {
                let side = match queue {
                    Queue::Data => 1,
                    Queue::Control => 0,
                };
                let [a, b] = &mut self.chans[chan].0;
                let (to, from) = if side == 1 { (b, a) } else { (a, b) };
                Some(Ok(self.backend.deliver(to, from, expect)))
            }
        }
    }

    /// Check that the library's event is the model's, and keep its handle.
    fn take_event(&mut self, to: DomainId, chan: ChanId, mev: MEvent, ev: FEvent) -> Result<(), String> {
        let mismatch = |ev: &dyn std::fmt::Debug| Err(format!("model delivered {mev:?} to d{to}, library {ev:?}"));
        let pool_of = |h: &Self, p: usize| h.pools[p].0;
        match (mev, ev) {
            (MEvent::MoveReceived { buf, meta_len }, FEvent::MoveReceived { buffer, meta })
            | (MEvent::BufferPassed { buf, meta_len }, FEvent::BufferPassed { buffer, meta })
                if buffer.id() == self.bid(buf) && meta[..] == meta_bytes(meta_len)[..] =>
            {
                self.owned.insert((to, buf), buffer);
                Ok(())
            }
            (MEvent::CopyReceived { buf, meta_len }, FEvent::CopyReceived { copy, meta })
                if copy.id() == self.bid(buf) && meta[..] == meta_bytes(meta_len)[..] =>
            {
                self.copies.entry((to, buf, chan)).or_default().push(copy);
                Ok(())
            }
            (MEvent::CopyReleased { buf, writable }, FEvent::CopyReleased { buffer, writable: w })
                if buffer == self.bid(buf) && writable == w =>
            {
                Ok(())
            }
            (MEvent::PoolAssignRequest { pool }, FEvent::PoolAssignRequest(req)) if req.pool == pool_of(self, pool) => {
                Ok(())
            }
            (MEvent::PoolAssigned { pool }, FEvent::PoolAssigned(id))
            | (MEvent::PoolVetoed { pool }, FEvent::PoolVetoed(id))
            | (MEvent::PoolRemoved { pool }, FEvent::PoolRemoved(id))
            | (MEvent::PoolRemoveRefused { pool }, FEvent::PoolRemoveRefused(id))
            | (MEvent::PoolRemoveRequest { pool, accepted: true }, FEvent::PoolRemoved(id))
            | (MEvent::PoolRemoveRequest { pool, accepted: false }, FEvent::PoolRemoveRefused(id))
                if id == pool_of(self, pool) =>
            {
                Ok(())
            }
            (MEvent::TeardownReceived, FEvent::Closed { by_peer: true }) => Ok(()),
            (MEvent::Closed, FEvent::Closed { by_peer: false }) => Ok(()),
            (_, ev) => mismatch(&ev),
        }
    }

    /// Every observable piece of state agrees with the model.
    fn compare(&mut self, m: &Model) -> Result<(), String> {
        for (p, (id, _)) in self.pools.iter().enumerate() {
            for d in 0..DOMAINS {
                let knows = self.domains[d].pools().contains(id);
                if knows != m.knows_pool(d, p) {
                    return Err(format!("d{d} pool list: library {knows}, model {}", m.knows_pool(d, p)));
                }
                // A pool known only through a request that can no longer be
                // answered keeps, in that domain, the trust it was offered
                // with, while its owner may have set it back: not compared.
                let dead_offer = m.pool_lists[d].get(&p) == Some(&false) && m.pool_trust(p) == Trust::Uninitialized;
                if knows && !dead_offer {
                    let t = self.domains[d].pool_trust(*id).expect("known");
                    if t != trust_level(m.pool_trust(p)) {
                        return Err(format!("pool {p} trust at d{d}: library {t:?}, model {:?}", m.pool_trust(p)));
                    }
                }
            }
        }
        for buf in m.all_buffers() {
            let id = self.bid(buf);
            for d in 0..DOMAINS {
                let want = buffer_state(m.buffer_state(buf, d));
                let got = self.domains[d].buffer_state(id);
                if got != want {
                    return Err(format!("{buf:?} at d{d}: library {got:?}, model {want:?}"));
                }
                // The harness holds an owned handle exactly for delivered owners.
                let owner = matches!(want, ferry::BufferState::ReadWrite | ferry::BufferState::ReadOnlyOwned);
                if self.owned.contains_key(&(d, buf)) != owner {
                    return Err(format!("{buf:?} at d{d}: owned handle present {}, model owner {owner}", !owner));
                }
            }
        }
        for c in 0..self.chans.len() {
            for side in 0..2 {
                let d = self.chans[c].1[side];
                let got = self.chans[c].0[side].state();
                let want = channel_state(m.channel_state(c, d));
                if got != want {
                    return Err(format!("channel {c} at d{d}: library {got:?}, model {want:?}"));
                }
                for (p, (id, _)) in self.pools.iter().enumerate() {
                    let got = self.chans[c].0[side].is_assigned(*id);
                    if got != m.pool_assigned(p, c, d) {
                        return Err(format!("pool {p} on channel {c} at d{d}: library {got}, model {}", !got));
                    }
                }
            }
        }
        m.check_invariants()
    }
}

enum SourceRef {
    Owned(DomainId),
    Copy(DomainId, ChanId),
}

/// Run one random sequence against model and library.
fn run_case<B: Backend>(backend: B, trusts: &[u8], steps: &[RawStep], stats: &mut Stats) -> Result<(), String> {
    use_trusts(B::TRUSTS);
    let mut m = setup(trusts);
    let mut h = Harness::new(backend);
    for &(d, count) in &POOLS {
        h.create_pool(d, count);
    }
    for (i, &(source, sink)) in LINKS.iter().enumerate() {
        h.connect(source, sink, m.channel_trust(i));
    }
    h.compare(&m)?;
    let mut trace = Vec::new();
    for &raw in steps {
        let op = pick_op(&m, raw);
        trace.push(op);
        let before = m.clone();
        let expected = m.apply(&op);
        let fail = |what: String| format!("{what}\n  op {op:?}\n  trace {trace:?}");
        match (op, &expected) {
            (Op::CreatePool { domain, count }, Ok(_)) => h.create_pool(domain, count),
            (Op::Connect { source, sink, trust }, Ok(_)) => h.connect(source, sink, trust),
            (Op::CreatePool { .. } | Op::Connect { .. }, Err(_)) => {}
            // Ids naming nothing, or a domain off the channel: not
            // expressible with the library's typed handles.
            (_, Err(Reject::InvalidArgument | Reject::NotADomainOfChannel)) => {}
            _ => match h.apply(&op, &before, matches!(expected, Ok(Outcome::Delivered { .. }))) {
                None => {
                    stats.inexpressible += 1;
                    if expected.is_ok() {
                        return Err(fail("the model accepted an operation the harness found no handle for".into()));
                    }
                }
                Some(got) => {
                    stats.compared += 1;
                    match (expected, got) {
                        (Ok(Outcome::Delivered { to, event }), Ok(Some(ev))) => {
                            stats.delivered += 1;
                            let chan = match op {
                                Op::Deliver { chan, .. } => chan,
                                _ => unreachable!(),
                            };
                            h.take_event(to, chan, event, ev).map_err(fail)?;
                        }
                        (Ok(Outcome::Done), Ok(None)) => stats.accepted += 1,
                        (Err(Reject::QueueEmpty), Ok(None)) => {}
                        (Err(r), Err(e)) if reject_of(&e) == Some(r) => {
                            stats.refused += 1;
                        }
                        (want, got) => return Err(fail(format!("model {want:?}, library {got:?}"))),
                    }
                }
            },
        }
        h.compare(&m).map_err(fail)?;
    }
    Ok(())
}

fn cases() -> u32 {
    model_cases(1024)
}

fn suite<B: Backend>(make: impl Fn() -> B) {
    let mut stats = Stats::default();
    let mut runner = TestRunner::new(Config { cases: cases(), failure_persistence: None, ..Config::default() });
    let strategy = (vec(any::<u8>(), 6), vec(any::<RawStep>(), 1..150));
    let stats_cell = std::cell::RefCell::new(&mut stats);
    let result = runner.run(&strategy, |(trusts, steps)| {
        run_case(make(), &trusts, &steps, &mut stats_cell.borrow_mut()).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // The comparison must not pass vacuously.
    eprintln!("model-based suite: {stats:?}");
    let n = cases() as usize;
    assert!(stats.accepted >= 5 * n, "too few accepted operations: {stats:?}");
    assert!(stats.refused >= 2 * n, "too few refusals: {stats:?}");
    assert!(stats.delivered >= 5 * n, "too few deliveries: {stats:?}");
}

/// The local backend against the reference model.
#[test]
fn local_backend_follows_the_model() {
    suite(|| Local);
}

/// The shared-memory backend against the reference model.
#[test]
fn shm_backend_follows_the_model() {
    suite(|| Shm);
}

/// The local backend with batching on, against the reference model.
#[test]
fn batched_local_backend_follows_the_model() {
    suite(|| Batched(Local));
}

/// The shared-memory backend with batching on, against the reference model.
#[test]
fn batched_shm_backend_follows_the_model() {
    suite(|| Batched(Shm));
}

/// The TCP backend against the reference model.
#[test]
fn net_backend_follows_the_model() {
    suite(|| Net);
}
