//! Model-based tests: random operation sequences run against the reference
//! model (`tests/model/reference.rs`) and the real library side by side.
//! After every step the library must have accepted exactly what the model
//! accepted (with the same error), delivered the same event, and be in the
//! same state: every buffer's per-domain state, every channel end's state,
//! every pool's assignment per end, every domain's pool list and trust.
//! The model's invariants are checked after every step too.
//!
//! The data is compared as well. The owner of a read-write buffer writes a
//! pattern into it now and then (a [`Step::Write`]; the model records its
//! seed); every buffer delivered (move, pass, copy, full-copy destination)
//! and, after every step, every buffer a domain holds must hold the
//! pattern the model says, and `as_mut_slice` must be refused exactly where
//! the model says the buffer is not writable. Where a pool's trust level
//! protects (HALF, NONE), each buffer's page protection in each domain's
//! mapping must match its state there (`/proc/self/maps`), and at sampled
//! steps a forbidden write must really fault (a forked child tries it).
//!
//! Received aggregates are mostly kept whole, in a set of held aggregates
//! per domain, and later steps work on them: drop one whole (the model
//! releases each copy it was the last reference to, in the order the
//! library drops them, and keeps each moved buffer with the domain, which
//! the harness takes back from the free list), split one into two pieces
//! dropped at different times, forward one over another channel (whole,
//! its front part, clipped, or behind a header from a buffer of the
//! domain's own: the model runs the same aggregate send), or take one
//! apart into handles. Steps that would need a handle inside a held
//! aggregate are left out.
//!
//! The suite is generic over [`Backend`]: a backend says how it connects
//! two domains and which trust levels it supports; everything else is the
//! same for every backend. [`Mixed`] gives each channel its own backend, so
//! that a pool reaches a domain along several paths over different ones.
//!
//! `FERRY_MODEL_CASES` sets the number of sequences per suite. Each suite
//! prints its seed; `FERRY_MODEL_SEED` replays it. A failure is shrunk and
//! reported with the channels (backend, trust) and the numbered steps of
//! the smallest failing sequence.

mod model;
mod support;

use std::collections::HashMap;

use ferry::{
    Aggregate, Allocator, BindParams, Buffer, BufferCopy, BufferId, Channel, ChannelSetup, Direction, Domain, Endpoint,
    Error, Event as FEvent, Member, MuxSession, NetOptions, Pool, PoolConstraints, TrustLevel,
};
use model::coverage::{round_seed, run_covered, seed, Floors};
use model::gen::{
    pick_step, setup_links, use_aggregates, use_trusts, RawStep, Step, DOMAINS, LINKS, META, MIXED_LINKS, POOLS,
};
use model::lib_map::{
    buffer_state, cases as model_cases, channel_state, harness_aggregate, meta_bytes, pieces_of_refused, reject_of,
    trust_level, Stats,
};
use model::reference::{
    initial_seed, BufId, BufferState as MState, ChanId, DomainId, Event as MEvent, Model, Op, Outcome, Queue, Reject,
    Trust,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use support::payload::fill;

/// Size of every buffer of the generated pools: one page.
const SIZE: usize = 4096;

/// A backend under test: how two domains get a connected channel.
trait Backend {
    /// Trust levels its channels support (weighted by repetition).
    const TRUSTS: &'static [Trust];
    /// The trust levels this run draws from (by default [`Backend::TRUSTS`]).
    fn trusts(&self) -> &'static [Trust] {
        Self::TRUSTS
    }
    /// Connect `source` (TX end) and `sink` (RX end); returns (source end, sink end).
    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel);
    /// Take the next message queued to `to` from `from` on channel `chan`
    /// (`expect`: the model has one queued). A backend that batches sends
    /// flushes `from` first and waits for the bytes to cross.
    fn deliver(&mut self, chan: ChanId, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        let _ = (chan, from, expect);
        to.poll()
    }
    /// The name of the backend of channel `chan`, for traces.
    fn name(&self, chan: ChanId) -> &'static str;
}

/// The local backend: both domains in this process.
struct Local;

impl Backend for Local {
    fn name(&self, _: ChanId) -> &'static str {
        "local"
    }

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
    fn name(&self, _: ChanId) -> &'static str {
        "shm"
    }

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
        assert!(matches!(s.wait(Some(t)), Ok(FEvent::BindRequest { .. })));
        assert!(matches!(r.wait(Some(t)), Ok(FEvent::Bound)));
        (s, r)
    }
}

/// A backend with batching on at both ends of every channel: messages are
/// published only when the sending end flushes (here: before each delivery)
/// or polls without finding anything; the model is the same.
struct Batched<B>(B);

impl<B: Backend> Backend for Batched<B> {
    fn name(&self, chan: ChanId) -> &'static str {
        match self.0.name(chan) {
            "local" => "batched local",
            "shm" => "batched shm",
            _ => "batched",
        }
    }

    const TRUSTS: &'static [Trust] = B::TRUSTS;

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        let (mut s, mut r) = self.0.connect(source, sink, trust);
        s.set_batching(true).expect("connected");
        r.set_batching(true).expect("connected");
        (s, r)
    }

    fn deliver(&mut self, chan: ChanId, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        from.flush().expect("flush");
        self.0.deliver(chan, to, from, expect)
    }
}

/// The TCP backend: both ends in this process, every message a frame on a
/// real loopback connection, every payload written from one domain's pool
/// memory and read into the other's mirror of it.
struct Net;

impl Backend for Net {
    fn name(&self, _: ChanId) -> &'static str {
        "tcp"
    }

    const TRUSTS: &'static [Trust] = &[Trust::Full, Trust::Full, Trust::Half, Trust::None];

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        let ep = Endpoint::tcp("127.0.0.1:0".parse().unwrap());
        let setup = ChannelSetup { direction: Direction::Tx, trust, meta_size: META, ..ChannelSetup::default() };
        let mut s = Channel::create(source, &ep, setup).expect("create");
        let ep = Endpoint::tcp(s.listen_addr().expect("listening"));
        let mut r = Channel::bind(sink, &ep, BindParams::default()).expect("bind");
        let t = std::time::Duration::from_secs(10);
        assert!(matches!(s.wait(Some(t)), Ok(FEvent::BindRequest { .. })));
        assert!(matches!(r.wait(Some(t)), Ok(FEvent::Bound)));
        (s, r)
    }

    fn deliver(&mut self, _: ChanId, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        from.flush().expect("flush");
        if expect {
            to.wait(Some(std::time::Duration::from_secs(10))).ok()
        } else {
            to.poll()
        }
    }
}

/// The fabric backend (feature `fabric`) on libfabric's tcp provider: every
/// message a send on a reliable datagram endpoint, every payload an RMA
/// write from one domain's pool memory into the other's mirror of it.
#[cfg(feature = "fabric")]
struct Fabric;

#[cfg(feature = "fabric")]
impl Backend for Fabric {
    fn name(&self, _: ChanId) -> &'static str {
        "fabric"
    }

    // No trust NONE: the peer writes registered memory by itself.
    const TRUSTS: &'static [Trust] = &[Trust::Full, Trust::Full, Trust::Half];

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        let options = ferry::FabricOptions::default().with_provider("tcp");
        let ep = Endpoint::fabric_with("127.0.0.1:0".parse().unwrap(), options.clone());
        let setup = ChannelSetup { direction: Direction::Tx, trust, meta_size: META, ..ChannelSetup::default() };
        let mut s = Channel::create(source, &ep, setup).expect("create");
        let ep = Endpoint::fabric_with(s.listen_addr().expect("listening"), options);
        let mut r = Channel::bind(sink, &ep, BindParams::default()).expect("bind");
        let t = std::time::Duration::from_secs(10);
        assert!(matches!(s.wait(Some(t)), Ok(FEvent::BindRequest { .. })));
        assert!(matches!(r.wait(Some(t)), Ok(FEvent::Bound)));
        (s, r)
    }

    /// With manual progress (the tcp provider's) a message moves while its
    /// sender polls: both ends are in this thread, so the sender is
    /// flushed again while the receiver waits.
    fn deliver(&mut self, _: ChanId, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            from.flush().expect("flush");
            if !expect {
                return to.poll();
            }
            if let Ok(ev) = to.wait(Some(std::time::Duration::from_millis(1))) {
                return Some(ev);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
        }
    }
}

/// The TCP backend over TLS 1.3 (mutual certificates from a test CA):
/// every frame and payload encrypted from one domain's pool memory and
/// decrypted into the other's mirror of it.
struct Tls(std::sync::Arc<support::tls_pki::Pki>);

impl Backend for Tls {
    fn name(&self, _: ChanId) -> &'static str {
        "tls"
    }

    const TRUSTS: &'static [Trust] = Net::TRUSTS;

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        let ep = Endpoint::tcp_with("127.0.0.1:0".parse().unwrap(), self.0.options());
        let setup = ChannelSetup { direction: Direction::Tx, trust, meta_size: META, ..ChannelSetup::default() };
        let mut s = Channel::create(source, &ep, setup).expect("create");
        let ep = Endpoint::tcp_with(s.listen_addr().expect("listening"), self.0.options());
        let mut r = Channel::bind(sink, &ep, BindParams::default()).expect("bind");
        let t = std::time::Duration::from_secs(10);
        // Both ends run their side of the handshake: wait on them in turn.
        let mut bound = (None, None);
        let until = std::time::Instant::now() + t;
        while bound.0.is_none() || bound.1.is_none() {
            assert!(std::time::Instant::now() < until, "no TLS channel within {t:?}");
            let slice = std::time::Duration::from_millis(5);
            if bound.0.is_none() {
                bound.0 = s.wait(Some(slice)).ok();
            }
            if bound.1.is_none() {
                bound.1 = r.wait(Some(slice)).ok();
            }
        }
        assert!(matches!(bound.0, Some(FEvent::BindRequest { .. })), "{:?}", bound.0);
        assert!(matches!(bound.1, Some(FEvent::Bound)), "{:?}", bound.1);
        (s, r)
    }

    fn deliver(&mut self, chan: ChanId, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        Net.deliver(chan, to, from, expect)
    }
}

/// Every channel on one multiplexed TCP session (early demultiplexing):
/// the run's channels share one connection, each with its own credits and
/// its own pool buffers for the payload the session reads off the stream.
/// A session pair per run; channel ids are never reused.
#[derive(Default)]
struct Mux {
    sessions: Option<(MuxSession, MuxSession)>,
    next_id: u32,
}

impl Backend for Mux {
    fn name(&self, _: ChanId) -> &'static str {
        "session"
    }

    const TRUSTS: &'static [Trust] = Net::TRUSTS;

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        let t = std::time::Duration::from_secs(10);
        let (a, b) = self.sessions.get_or_insert_with(|| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
            let addr = listener.local_addr().expect("address");
            let other = std::thread::spawn(move || MuxSession::connect(addr, NetOptions::default(), t));
            let ours = MuxSession::accept(&listener, NetOptions::default(), t).expect("accept a session");
            (ours, other.join().expect("connecting thread").expect("connect a session"))
        });
        self.next_id += 1;
        let setup = ChannelSetup { direction: Direction::Tx, trust, meta_size: META, ..ChannelSetup::default() };
        let mut s = Channel::create(source, &a.endpoint(self.next_id), setup).expect("create");
        let mut r = Channel::bind(sink, &b.endpoint(self.next_id), BindParams::default()).expect("bind");
        assert!(matches!(s.wait(Some(t)), Ok(FEvent::BindRequest { .. })));
        assert!(matches!(r.wait(Some(t)), Ok(FEvent::Bound)));
        (s, r)
    }

    fn deliver(&mut self, _: ChanId, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        // A failed flush is the library's answer: the harness compares it
        // with the model's (and reports the steps) instead of stopping here.
        if let Err(e) = from.flush() {
            return Some(FEvent::Error(e));
        }
        if expect {
            to.wait(Some(std::time::Duration::from_secs(10))).ok()
        } else {
            to.poll()
        }
    }
}

/// The backends a [`Mixed`] run picks from, per channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Local,
    Shm,
    Net,
}

/// Every channel on a backend of its own, picked at random among those
/// that support the channel's trust level (local: no NONE). A pool
/// assigned along several paths then reaches a domain over different
/// backends: one end of a local or shm channel may hold the pool in memory
/// of its own (a TCP mirror) while the other maps the creator's.
struct Mixed {
    /// The trust levels of this run's channels.
    trusts: &'static [Trust],
    /// Random picks, one per channel (cycled).
    picks: Vec<u8>,
    /// The backend of each channel, in connection order (= channel ids).
    kinds: Vec<Kind>,
}

impl Mixed {
    /// Trust modes a mixed run may draw: most runs give every channel one
    /// level, so that pools can be assigned along every path.
    const MODES: [&'static [Trust]; 4] = [&[Trust::Full], &[Trust::Half], &[Trust::None], Shm::TRUSTS];

    fn new(mode: u8, picks: Vec<u8>) -> Mixed {
        Mixed { trusts: Self::MODES[usize::from(mode) % Self::MODES.len()], picks, kinds: Vec::new() }
    }
}

impl Backend for Mixed {
    const TRUSTS: &'static [Trust] = Shm::TRUSTS;

    fn trusts(&self) -> &'static [Trust] {
        self.trusts
    }

    fn connect(&mut self, source: &Domain, sink: &Domain, trust: TrustLevel) -> (Channel, Channel) {
        let kinds: &[Kind] =
            if trust == TrustLevel::None { &[Kind::Shm, Kind::Net] } else { &[Kind::Local, Kind::Shm, Kind::Net] };
        let pick = self.picks.get(self.kinds.len() % self.picks.len().max(1)).copied().unwrap_or(0);
        let kind = kinds[usize::from(pick) % kinds.len()];
        self.kinds.push(kind);
        match kind {
            Kind::Local => Local.connect(source, sink, trust),
            Kind::Shm => Shm.connect(source, sink, trust),
            Kind::Net => Net.connect(source, sink, trust),
        }
    }

    fn deliver(&mut self, chan: ChanId, to: &mut Channel, from: &mut Channel, expect: bool) -> Option<FEvent> {
        match self.kinds[chan] {
            Kind::Local => Local.deliver(chan, to, from, expect),
            Kind::Shm => Shm.deliver(chan, to, from, expect),
            Kind::Net => Net.deliver(chan, to, from, expect),
        }
    }

    fn name(&self, chan: ChanId) -> &'static str {
        match self.kinds.get(chan) {
            Some(Kind::Local) => "local",
            Some(Kind::Shm) => "shm",
            Some(Kind::Net) => "tcp",
            None => "?",
        }
    }
}

/// Where a handle put into an aggregate came from: the domain's owned
/// buffer (and whether the sender keeps a reference), or its copy held via
/// a channel (always kept: forwarding does not give it up).
#[derive(Debug, Clone, Copy)]
enum Origin {
    Owned(BufId, bool),
    Copy((DomainId, BufId, ChanId)),
}

impl Origin {
    fn kept(&self) -> bool {
        match self {
            Origin::Owned(_, keep) => *keep,
            Origin::Copy(_) => true,
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
    patterns: Patterns,
    /// The buffer the last step delivered: (to, buffer, channel).
    arrived: Option<(DomainId, BufId, ChanId)>,
    /// Received aggregates kept as aggregates (and pieces of them).
    held: Vec<HeldAgg>,
    /// Keep the next received aggregate whole (else take it apart).
    hold_next: bool,
    /// Receipts so far: each held aggregate's lineage.
    receipts: usize,
}

/// A received aggregate the harness keeps as one, or a piece of one (a
/// split, the part left after a forward). Pieces of one receipt (one
/// `lineage`) share its handles; receipts never do: two copies of one
/// buffer received twice are two handles.
struct HeldAgg {
    domain: DomainId,
    /// The channel it arrived on (its copies are held via it).
    chan: ChanId,
    lineage: usize,
    agg: Aggregate,
}

/// A step on a held aggregate, as the trace shows it (its fields are
/// read through `Debug` only).
#[allow(dead_code)]
#[derive(Debug, Clone)]
enum AggStep {
    /// Dropped whole: these copies released (in this order), these moved
    /// buffers back on the domain's free list.
    Drop { domain: DomainId, released: Vec<(BufId, ChanId)>, freed: Vec<BufId> },
    /// Split into two held pieces at byte `at`.
    Split { domain: DomainId, at: usize },
    /// Taken apart into handles.
    TakeApart { domain: DomainId },
    /// Sent on (edited as said) as the model's operation.
    Forward { edit: &'static str, op: Op },
}

/// One step of a trace.
#[derive(Debug, Clone)]
enum TraceStep {
    Model(Step),
    Agg(AggStep),
}

/// The bytes of the pattern of each seed met so far.
#[derive(Default)]
struct Patterns(HashMap<u64, Vec<u8>>);

impl Patterns {
    /// Whether `bytes` hold bytes `range` of the pattern of `seed`.
    fn check_range(&mut self, bytes: &[u8], range: std::ops::Range<usize>, seed: u64) -> Result<(), String> {
        let want = self.0.entry(seed).or_insert_with(|| {
            let mut v = vec![0; SIZE];
            fill(&mut v, seed);
            v
        });
        if want.get(range.clone()) == Some(bytes) {
            Ok(())
        } else {
            Err(format!("fragment {range:?} differs from the pattern of seed {seed:#x}"))
        }
    }

    /// Whether `bytes` hold the pattern of `seed`; else where they differ.
    fn check(&mut self, bytes: &[u8], seed: u64) -> Result<(), String> {
        let want = self.0.entry(seed).or_insert_with(|| {
            let mut v = vec![0; SIZE];
            fill(&mut v, seed);
            v
        });
        if bytes == &want[..] {
            return Ok(());
        }
        let first = bytes.iter().zip(want.iter()).position(|(a, b)| a != b).unwrap_or(bytes.len().min(want.len()));
        let last = bytes.iter().zip(want.iter()).rposition(|(a, b)| a != b).unwrap_or(first);
        let holds = self.0.iter().find(|(_, v)| v[..] == bytes[..]).map(|(s, _)| *s);
        Err(format!(
            "bytes {first}..={last} of {} differ from the pattern of seed {seed:#x}{}",
            bytes.len(),
            match holds {
                Some(s) => format!(" (they hold the pattern of seed {s:#x})"),
                None => String::new(),
            }
        ))
    }
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
            patterns: Patterns::default(),
            arrived: None,
            held: Vec::new(),
            hold_next: false,
            receipts: 0,
        }
    }

    /// The model's name of a library buffer id.
    fn mbuf(&self, id: BufferId) -> BufId {
        let pool = self.pools.iter().position(|(p, _)| *p == id.pool).expect("a pool of the run");
        BufId { pool, index: id.index as usize }
    }

    /// The distinct buffers of `agg` in the order of their first fragment,
    /// flagged `true` if held as a copy.
    fn members_of(&self, agg: &Aggregate) -> Vec<(BufId, bool)> {
        let mut out: Vec<(BufId, bool)> = Vec::new();
        for f in agg.fragments() {
            let b = self.mbuf(f.buffer_id());
            if !out.iter().any(|(x, _)| *x == b) {
                out.push((b, f.is_copy()));
            }
        }
        out
    }

    /// Buffers of the held aggregates of `lineage` other than number `skip`.
    fn lineage_bufs(&self, lineage: usize, skip: Option<usize>) -> Vec<BufId> {
        let mut out = Vec::new();
        for (i, h) in self.held.iter().enumerate() {
            if h.lineage == lineage && Some(i) != skip {
                out.extend(self.members_of(&h.agg).into_iter().map(|(b, _)| b));
            }
        }
        out
    }

    /// Whether `domain` holds a handle of `buf` inside a held aggregate.
    fn in_held(&self, domain: DomainId, buf: BufId) -> bool {
        self.held.iter().any(|h| h.domain == domain && self.members_of(&h.agg).iter().any(|(b, _)| *b == buf))
    }

    /// Whether a step needs a handle of a buffer that is inside one of
    /// the acting domain's held aggregates (such steps are skipped: the
    /// held-aggregate steps use those handles).
    fn touches_held(&self, step: &Step) -> bool {
        let bufs: Vec<(DomainId, BufId)> = match *step {
            Step::Write { domain, buf, .. } => vec![(domain, buf)],
            Step::Op(op) => match op {
                Op::Move { domain, buf, .. }
                | Op::Pass { domain, buf, .. }
                | Op::Copy { domain, buf, .. }
                | Op::Release { domain, buf, .. } => vec![(domain, buf)],
                Op::FullCopy { domain, src, dst, .. } => vec![(domain, src), (domain, dst)],
                Op::SendAggregate { domain, members, .. } => {
                    members.iter().flatten().map(|&(b, _)| (domain, b)).collect()
                }
                _ => Vec::new(),
            },
        };
        bufs.into_iter().any(|(d, b)| self.in_held(d, b))
    }

    /// Drop held aggregate `i` whole, if the model can follow: every copy
    /// it was the last reference to is released (by the library when the
    /// channel it arrived on next runs: the harness runs it at once), every
    /// moved buffer it was the last reference to goes back to the domain's
    /// free list (the harness takes it again, so that it keeps a handle of
    /// every buffer the model says the domain owns). `None` if the model
    /// would refuse such a release, or a freed buffer has copies out (it
    /// would wait aside).
    fn drop_held(&mut self, m: &mut Model, i: usize) -> Option<Result<AggStep, String>> {
        let (domain, chan, lineage) = (self.held[i].domain, self.held[i].chan, self.held[i].lineage);
        let others = self.lineage_bufs(lineage, Some(i));
        // The order the library drops them in: by each one's last fragment.
        let mut last: Vec<(BufId, bool)> = Vec::new();
        for f in self.held[i].agg.fragments() {
            let b = self.mbuf(f.buffer_id());
            last.retain(|(x, _)| *x != b);
            last.push((b, f.is_copy()));
        }
        last.retain(|(b, _)| !others.contains(b));
        let mut after = m.clone();
        let (mut released, mut freed) = (Vec::new(), Vec::new());
        for &(buf, copy) in &last {
            if copy {
                after.apply(&Op::Release { domain, chan, buf }).ok()?;
                released.push((buf, chan));
            } else {
                if m.buffer_state(buf, domain) != MState::ReadWrite {
                    return None;
                }
                freed.push(buf);
            }
        }
        // Pool handles keep the pools of freed buffers in the domain while
        // it holds no handle of them.
        let keep: Vec<Pool> = freed.iter().filter_map(|b| self.domains[domain].pool(self.pools[b.pool].0)).collect();
        drop(self.held.remove(i));
        if !released.is_empty() {
            if let Err(e) = self.end(chan, domain).flush() {
                return Some(Err(format!("flush after dropping an aggregate: {e:?}")));
            }
        }
        for &buf in &freed {
            let id = self.pools[buf.pool].0;
            while let Some(b) = self.domains[domain].alloc(id) {
                let got = self.mbuf(b.id());
                self.owned.insert((domain, got), b);
            }
            if !self.owned.contains_key(&(domain, buf)) {
                return Some(Err(format!("{buf:?} dropped in an aggregate at d{domain} is not on its free list")));
            }
        }
        drop(keep);
        *m = after;
        Some(Ok(AggStep::Drop { domain, released, freed }))
    }

    /// Take held aggregate `i` apart into handles (`None`: a piece of the
    /// same receipt still shares one).
    fn take_apart_held(&mut self, i: usize) -> Option<AggStep> {
        let h = self.held.remove(i);
        match h.agg.into_members() {
            Ok(members) => {
                for mem in members {
                    match mem {
                        Member::Buffer(b) => {
                            let buf = self.mbuf(b.id());
                            self.owned.insert((h.domain, buf), b);
                        }
                        Member::Copy(c) => {
                            let buf = self.mbuf(c.id());
                            self.copies.entry((h.domain, buf, h.chan)).or_default().push(c);
                        }
                    }
                }
                Some(AggStep::TakeApart { domain: h.domain })
            }
            Err(agg) => {
                self.held.insert(i, HeldAgg { agg, ..h });
                None
            }
        }
    }

    /// Split held aggregate `i` at byte `x % len` into two held pieces.
    fn split_held(&mut self, i: usize, x: usize) -> Option<AggStep> {
        let len = self.held[i].agg.len();
        if len < 2 {
            return None;
        }
        let at = 1 + x % (len - 1);
        let rest = self.held[i].agg.split_off(at).expect("inside");
        let (domain, chan, lineage) = (self.held[i].domain, self.held[i].chan, self.held[i].lineage);
        self.held.push(HeldAgg { domain, chan, lineage, agg: rest });
        Some(AggStep::Split { domain, at })
    }

    /// Forward held aggregate `i` over a channel its domain is the source
    /// of: whole, its front part (the rest stays held), clipped inside its
    /// first fragment, or behind a header (a range of a buffer the domain
    /// owns read-write). Copies it was the last reference to stay held in
    /// a piece kept here (forwarding does not give a copy up). The model
    /// runs the same [`Op::SendAggregate`]; both must agree.
    fn forward_held(
        &mut self,
        m: &mut Model,
        i: usize,
        (a, b, c): (usize, usize, usize),
        meta_len: usize,
    ) -> Option<Result<(AggStep, bool), String>> {
        use model::reference::AGG_MAX;
        let domain = self.held[i].domain;
        // Mostly a channel the aggregate's pools are assigned to.
        let mut outs: Vec<ChanId> = (0..self.chans.len()).filter(|&ch| self.chans[ch].1[0] == domain).collect();
        let fits: Vec<ChanId> = outs
            .iter()
            .copied()
            .filter(|&ch| self.members_of(&self.held[i].agg).iter().all(|(bf, _)| m.pool_assigned(bf.pool, ch, domain)))
            .collect();
        if a % 4 != 0 && !fits.is_empty() {
            outs = fits;
        }
        let to = *outs.get(a % outs.len().max(1))?;
        let HeldAgg { chan, lineage, mut agg, .. } = self.held.remove(i);
        let mut header: Option<BufId> = None;
        let edit = match b % 4 {
            1 if agg.len() >= 2 => {
                let rest = agg.split_off(1 + c % (agg.len() - 1)).expect("inside");
                self.held.push(HeldAgg { domain, chan, lineage, agg: rest });
                "front part"
            }
            2 => {
                let first = agg.fragments().next().map_or(0, |f| f.bytes().len());
                agg.clip_front(c % first.max(1));
                "clipped"
            }
            3 if self.members_of(&agg).len() < AGG_MAX => {
                let own: Vec<BufId> = self
                    .owned
                    .keys()
                    .filter(|(d, bf)| *d == domain && m.buffer_state(*bf, domain) == MState::ReadWrite)
                    .map(|(_, bf)| *bf)
                    .collect();
                if let Some(&hb) = own.get(c % own.len().max(1)) {
                    let buf = self.owned.remove(&(domain, hb)).expect("listed");
                    let hdr = Aggregate::from_buffer_range(buf, 0..16).expect("a read-write buffer");
                    agg.prepend(hdr);
                    header = Some(hb);
                    "behind a header"
                } else {
                    "whole"
                }
            }
            _ => "whole",
        };
        let others = self.lineage_bufs(lineage, None);
        // A piece kept here holds each buffer this aggregate is the last
        // reference to and that is not moved: a copy (forwarding does not
        // give it up), or an owned buffer with copies out (it would wait
        // aside, with no handle to take it back by).
        let mut keeper = Aggregate::new();
        let mut at = 0;
        let mut kept: Vec<BufId> = Vec::new();
        for f in agg.fragments() {
            let buf = self.mbuf(f.buffer_id());
            let stays = f.is_copy() || m.buffer_state(buf, domain) != MState::ReadWrite;
            if stays && Some(buf) != header && !others.contains(&buf) && !kept.contains(&buf) {
                keeper.append(agg.slice(at..at + 1).expect("inside"));
                kept.push(buf);
            }
            at += f.bytes().len();
        }
        let sent = self.members_of(&agg);
        let mut members: model::reference::AggMembers = [None; AGG_MAX];
        for (slot, &(buf, _)) in members.iter_mut().zip(&sent) {
            *slot = Some((buf, others.contains(&buf) || kept.contains(&buf)));
        }
        let op = Op::SendAggregate { domain, chan: to, members, meta_len };
        let expected = m.apply(&op);
        let meta = meta_bytes(meta_len);
        let got = self.end(to, domain).send_aggregate(agg, &meta);
        let step = AggStep::Forward { edit, op };
        match (expected, got) {
            (Ok(_), Ok(())) => {
                if !keeper.is_empty() {
                    self.held.push(HeldAgg { domain, chan, lineage, agg: keeper });
                }
                Some(Ok((step, true)))
            }
            (Err(r), Err(refused)) if reject_of(&refused.error) == Some(r) => {
                let mut agg = refused.into_inner();
                if let Some(hb) = header {
                    let rest = agg.split_off(16).expect("behind the header");
                    match agg.into_members().map(|mut v| v.pop()) {
                        Ok(Some(Member::Buffer(buf))) => {
                            self.owned.insert((domain, hb), buf);
                        }
                        _ => return Some(Err("the header did not come back".into())),
                    }
                    agg = rest;
                }
                self.held.push(HeldAgg { domain, chan, lineage, agg });
                drop(keeper);
                Some(Ok((step, false)))
            }
            (want, got) => Some(Err(format!("{step:?}: model {want:?}, library {:?}", got.map_err(|r| r.error)))),
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
        let a = Allocator::new(&self.domains[domain], count as u64, SIZE, PoolConstraints::default()).expect("pool");
        let id = a.pool().id();
        let p = self.pools.len();
        self.pools.push((id, a.pool().clone()));
        for index in 0..count {
            let mut buf = a.alloc().expect("fresh pool has free buffers");
            assert_eq!(buf.id(), BufferId { pool: id, index: index as u32 });
            fill(buf.as_mut_slice().expect("a fresh buffer is writable"), initial_seed(p, index));
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
            Op::SendAggregate { domain, chan, members, meta_len } => {
                self.send_aggregate(domain, chan, members, meta_len, model_before)
            }
            Op::Teardown { domain, chan } => unit(self.end(chan, domain).teardown()),
            Op::Deliver { chan, queue } => {
                let side = match queue {
                    Queue::Data => 1,
                    Queue::Control => 0,
                };
                let [a, b] = &mut self.chans[chan].0;
                let (to, from) = if side == 1 { (b, a) } else { (a, b) };
                Some(Ok(self.backend.deliver(chan, to, from, expect)))
            }
        }
    }

    /// An aggregate of the handles `domain` holds for `members` (an owned
    /// buffer, else a copy held via any channel), two fragments of each
    /// buffer, interleaved. A member the sender keeps (`share`, a copy, or
    /// an owned buffer with copies out) keeps a clone of its piece here, so
    /// the aggregate is not its only reference, and gets its handle back
    /// after the send. `None` if the domain holds no handle for a member.
    fn send_aggregate(
        &mut self,
        domain: DomainId,
        chan: ChanId,
        members: model::reference::AggMembers,
        meta_len: usize,
        model_before: &Model,
    ) -> Option<Result<Option<FEvent>, Error>> {
        let mut origins: Vec<Origin> = Vec::new();
        let mut pieces: Vec<Aggregate> = Vec::new();
        for (buf, share) in members.iter().flatten().copied() {
            let (origin, piece) = if let Some(b) = self.owned.remove(&(domain, buf)) {
                let keep = share || model_before.buffer_state(buf, domain) != MState::ReadWrite;
                (Origin::Owned(buf, keep), Aggregate::from(b))
            } else if let Some(key) =
                self.copies.iter().find(|((h, b, _), v)| *h == domain && *b == buf && !v.is_empty()).map(|(k, _)| *k)
            {
                let c = self.copies.get_mut(&key).and_then(Vec::pop).expect("non-empty");
                (Origin::Copy(key), Aggregate::from(c))
            } else {
                self.put_back(domain, &origins, pieces);
                return None;
            };
            origins.push(origin);
            pieces.push(piece);
        }
        let keep: Vec<bool> = origins.iter().map(Origin::kept).collect();
        let (msg, kept) = harness_aggregate(pieces, &keep);
        let meta = meta_bytes(meta_len);
        match self.end(chan, domain).send_aggregate(msg, &meta) {
            Ok(()) => {
                let back: Vec<(Origin, Aggregate)> =
                    origins.into_iter().zip(kept).filter_map(|(o, k)| k.map(|k| (o, k))).collect();
                let (origins, pieces): (Vec<Origin>, Vec<Aggregate>) = back.into_iter().unzip();
                self.put_back(domain, &origins, pieces);
                Some(Ok(None))
            }
            Err(refused) => {
                let e = refused.error.clone();
                drop(kept);
                self.put_back(domain, &origins, pieces_of_refused(refused.into_inner()));
                Some(Err(e))
            }
        }
    }

    /// Return the handles in `pieces` (one buffer each) to where `origins`
    /// say they came from.
    fn put_back(&mut self, domain: DomainId, origins: &[Origin], pieces: Vec<Aggregate>) {
        for (o, p) in origins.iter().zip(pieces) {
            let mut m = p.into_members().expect("the only reference");
            match (o, m.pop()) {
                (Origin::Owned(buf, _), Some(Member::Buffer(b))) => {
                    self.owned.insert((domain, *buf), b);
                }
                (Origin::Copy(key), Some(Member::Copy(c))) => self.copies.entry(*key).or_default().push(c),
                (o, m) => panic!("harness: {o:?} came back as {m:?}"),
            }
        }
    }

    /// Check that the library's event is the model's, and keep its handle
    /// (its contents are checked with all others, after the protections:
    /// a buffer wrongly left inaccessible must fail the test, not crash it).
    fn take_event(&mut self, to: DomainId, chan: ChanId, mev: MEvent, ev: FEvent) -> Result<(), String> {
        let mismatch = |ev: &dyn std::fmt::Debug| Err(format!("model delivered {mev:?} to d{to}, library {ev:?}"));
        let pool_of = |h: &Self, p: usize| h.pools[p].0;
        match (mev, ev) {
            (MEvent::MoveReceived { buf, meta_len }, FEvent::MoveReceived { buffer, meta })
            | (MEvent::BufferPassed { buf, meta_len }, FEvent::BufferPassed { buffer, meta })
                if buffer.id() == self.bid(buf) && meta[..] == meta_bytes(meta_len)[..] =>
            {
                self.owned.insert((to, buf), buffer);
                self.arrived = Some((to, buf, chan));
                Ok(())
            }
            (MEvent::CopyReceived { buf, meta_len }, FEvent::CopyReceived { copy, meta })
                if copy.id() == self.bid(buf) && meta[..] == meta_bytes(meta_len)[..] =>
            {
                self.copies.entry((to, buf, chan)).or_default().push(copy);
                self.arrived = Some((to, buf, chan));
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
            (MEvent::AggregateReceived { members, meta_len }, FEvent::Aggregate { agg, meta })
                if meta[..] == meta_bytes(meta_len)[..] =>
            {
                let want: Vec<(BufId, bool)> = members.iter().flatten().copied().collect();
                let seen: Vec<(BufId, bool)> = self.members_of(&agg).into_iter().map(|(b, c)| (b, !c)).collect();
                if seen != want {
                    return Err(format!("model delivered {mev:?} to d{to}, library members {seen:?}"));
                }
                if self.hold_next && !agg.is_empty() {
                    self.receipts += 1;
                    self.held.push(HeldAgg { domain: to, chan, lineage: self.receipts, agg });
                    return Ok(());
                }
                let got = agg.into_members().map_err(|a| format!("received {a:?} shares its buffers"))?;
                let ids: Vec<(BufferId, bool)> = got
                    .iter()
                    .map(|m| match m {
                        Member::Buffer(b) => (b.id(), true),
                        Member::Copy(c) => (c.id(), false),
                    })
                    .collect();
                if ids != want.iter().map(|&(b, moved)| (self.bid(b), moved)).collect::<Vec<_>>() {
                    return Err(format!("model delivered {mev:?} to d{to}, library members {ids:?}"));
                }
                for ((buf, _), m) in want.into_iter().zip(got) {
                    match m {
                        Member::Buffer(b) => {
                            self.owned.insert((to, buf), b);
                        }
                        Member::Copy(c) => self.copies.entry((to, buf, chan)).or_default().push(c),
                    }
                }
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
                // A pool known only through offers, never accepted anywhere,
                // keeps in that domain the trust of the last offer delivered
                // there, while its owner may have set it back, or offered it
                // again at another trust not delivered yet: not compared
                // (the model keeps one trust per pool).
                let dead_offer = m.pool_lists[d].get(&p) == Some(&false) && !m.pools[p].ever_accepted;
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
                let in_agg = self
                    .held
                    .iter()
                    .any(|h| h.domain == d && h.agg.fragments().any(|f| !f.is_copy() && f.buffer_id() == id));
                if (self.owned.contains_key(&(d, buf)) || in_agg) != owner {
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

    /// A write step: `domain` writes the pattern of `seed` into `buf`
    /// through its own handle (`None`: it has none).
    fn write(&mut self, domain: DomainId, buf: BufId, seed: u64) -> Option<Result<Option<FEvent>, Error>> {
        let b = self.owned.get_mut(&(domain, buf))?;
        Some(b.as_mut_slice().map(|bytes| {
            fill(bytes, seed);
            None
        }))
    }

    /// Every buffer a domain holds (owned or a copy) holds the contents the
    /// model says, and `as_mut_slice` is refused exactly where the model
    /// says the owner cannot write.
    fn check_data(&mut self, m: &Model) -> Result<(), String> {
        let arrived = self.arrived.take();
        let via = |d: DomainId, buf: BufId, held: Option<ChanId>, e: String| match arrived {
            // Name the channel that just delivered it.
            Some((to, b, c)) if (to, b) == (d, buf) && held.is_none_or(|h| h == c) => {
                format!("{buf:?} delivered to d{d} over channel {c} ({}): {e}", self.backend.name(c))
            }
            _ => match held {
                None => format!("{buf:?} owned by d{d}: {e}"),
                Some(c) => format!("{buf:?} held by d{d} via channel {c}: {e}"),
            },
        };
        for (&(d, buf), b) in self.owned.iter_mut() {
            let writable = m.buffer_state(buf, d) == MState::ReadWrite;
            if b.as_mut_slice().is_ok() != writable {
                return Err(format!("{buf:?} at d{d}: as_mut_slice allowed {}, model writable {writable}", !writable));
            }
            self.patterns.check(b, m.contents(buf)).map_err(|e| via(d, buf, None, e))?;
        }
        for (&(d, buf, c), v) in &self.copies {
            for copy in v {
                self.patterns.check(copy, m.contents(buf)).map_err(|e| via(d, buf, Some(c), e))?;
            }
        }
        let pool_ids: Vec<ferry::PoolId> = self.pools.iter().map(|(p, _)| *p).collect();
        for h in &self.held {
            for f in h.agg.fragments() {
                let id = f.buffer_id();
                let pool = pool_ids.iter().position(|p| *p == id.pool).expect("a pool of the run");
                let buf = BufId { pool, index: id.index as usize };
                self.patterns.check_range(f.bytes(), f.range(), m.contents(buf)).map_err(|e| {
                    format!("{buf:?} in an aggregate held by d{} via channel {}: {e}", h.domain, h.chan)
                })?;
            }
        }
        Ok(())
    }

    /// Where a domain records a protecting trust level (HALF, NONE) for a
    /// pool, every buffer's page protection in its mapping matches the
    /// state the model gives it there: READ_WRITE rw, READ_ONLY(_OWNED) r,
    /// INVALID none. Returns the buffers a write must fault on, by address.
    fn check_protection(&self, m: &Model) -> Result<Vec<(DomainId, BufId, usize)>, String> {
        let mut maps: Option<Vec<MapRange>> = None;
        let mut forbidden = Vec::new();
        for (p, (id, _)) in self.pools.iter().enumerate() {
            for d in 0..DOMAINS {
                if !matches!(self.domains[d].pool_trust(*id), Some(TrustLevel::Half | TrustLevel::None)) {
                    continue;
                }
                let pool = self.domains[d].pool(*id).expect("known");
                let maps = maps.get_or_insert_with(read_maps);
                for index in 0..pool.geometry().count() as usize {
                    let buf = BufId { pool: p, index };
                    let addr = pool.base_address() + index * SIZE;
                    let state = m.buffer_state(buf, d);
                    let want = match state {
                        MState::ReadWrite => (true, true),
                        MState::ReadOnly | MState::ReadOnlyOwned => (true, false),
                        MState::Invalid => (false, false),
                    };
                    let mut got = protection_at(maps, addr);
                    if got != Some(want) {
                        // Other tests of this process map and unmap while the
                        // kernel lists the mappings: read them again before
                        // blaming ours.
                        *maps = read_maps();
                        got = protection_at(maps, addr);
                    }
                    let got = got.ok_or_else(|| format!("{buf:?} at d{d}: {addr:#x} is in no mapping"))?;
                    if got != want {
                        let show = |(r, w): (bool, bool)| {
                            format!("{}{}", if r { 'r' } else { '-' }, if w { 'w' } else { '-' })
                        };
                        return Err(format!(
                            "{buf:?} at d{d} ({:?} trust, {state:?}): pages {} at {addr:#x}, want {}",
                            self.domains[d].pool_trust(*id).expect("known"),
                            show(got),
                            show(want)
                        ));
                    }
                    if !want.1 {
                        forbidden.push((d, buf, addr));
                    }
                }
            }
        }
        Ok(forbidden)
    }
}

/// One line of `/proc/self/maps`: [start, end), readable, writable.
type MapRange = (usize, usize, bool, bool);

/// The mappings of this process, sorted by address (as the kernel lists
/// them). Parsed by hand: this runs after most steps of debug builds.
fn read_maps() -> Vec<MapRange> {
    let text = std::fs::read("/proc/self/maps").expect("/proc/self/maps");
    let mut v = Vec::with_capacity(text.len() / 64);
    for line in text.split(|&c| c == b'\n') {
        let mut at = 0;
        let mut hex = |stop: u8| {
            let mut n = 0usize;
            while let Some(&c) = line.get(at) {
                at += 1;
                if c == stop {
                    break;
                }
                n = n << 4 | (c as char).to_digit(16).unwrap_or(0) as usize;
            }
            n
        };
        let (start, end) = (hex(b'-'), hex(b' '));
        if let Some(perms) = line.get(at..at + 2) {
            v.push((start, end, perms[0] == b'r', perms[1] == b'w'));
        }
    }
    v
}

/// (readable, writable) of the page at `addr`, if it is mapped.
fn protection_at(maps: &[MapRange], addr: usize) -> Option<(bool, bool)> {
    let i = maps.partition_point(|&(start, ..)| start <= addr);
    maps[..i].iter().rev().find(|&&(start, end, ..)| start <= addr && addr < end).map(|&(_, _, r, w)| (r, w))
}

/// Whether writing one byte at `addr` faults: a forked child reads the
/// byte and writes it back (so a write that wrongly succeeds changes
/// nothing, even in shared memory), then exits; the parent expects it
/// killed by SIGSEGV. The child does nothing else: in a process with other
/// threads only async-signal-safe work is allowed after `fork`.
fn write_faults(addr: usize) -> bool {
    // SAFETY: the child resets one signal's action, touches one byte of
    // memory mapped in this process and calls `_exit`, all async-signal-safe; the parent waits
    // for it. `addr` is inside a pool mapping (checked by the caller
    // against /proc/self/maps), so the access is either allowed or a fault.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // A fault is expected: no core dump of it.
            libc::prctl(libc::PR_SET_DUMPABLE, 0);
            // The kernel's action, whatever handler a library of this
            // process installed (Rust's own for stack overflows; a program
            // that links libfabric gets its psm provider's, which writes a
            // backtrace file and exits; Ferry's fabric backend loads it
            // without that).
            libc::signal(libc::SIGSEGV, libc::SIG_DFL);
            let p = addr as *mut u8;
            let v = std::ptr::read_volatile(p);
            std::ptr::write_volatile(p, v);
            libc::_exit(0);
        }
        let mut status = 0;
        let r = libc::waitpid(pid, &mut status, 0);
        assert_eq!(r, pid, "waitpid");
        libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV
    }
}

enum SourceRef {
    Owned(DomainId),
    Copy(DomainId, ChanId),
}

/// How often a run makes a forked child try the forbidden writes.
#[derive(Clone, Copy)]
enum Probe {
    /// At one step in 64, one forbidden buffer.
    Sampled,
    /// After every step, every forbidden buffer.
    Always,
}

/// A run's trace, one numbered step a line, with the backend of each
/// channel.
fn show_trace<B: Backend>(h: &Harness<B>, trace: &[TraceStep]) -> String {
    let mut out = String::from("\n  channels:");
    for (c, ([end, _], [source, sink])) in h.chans.iter().enumerate() {
        out += &format!(" {c}=d{source}->d{sink}/{}/{:?}", h.backend.name(c), end.trust());
    }
    for (i, step) in trace.iter().enumerate() {
        match step {
            TraceStep::Model(step) => out += &format!("\n  {i:3}: {step:?}"),
            TraceStep::Agg(step) => out += &format!("\n  {i:3}: held aggregate: {step:?}"),
        }
    }
    out
}

/// Assignments a run makes before its random steps: flag number
/// `link * POOLS.len() + pool` asks for `pool` on channel `link`, offered
/// by an end that holds it (its creator, or a domain that accepted it
/// earlier in the plan) and accepted, so that pools reach domains along
/// several paths.
struct Plan {
    todo: Vec<(ChanId, usize)>,
}

impl Plan {
    fn new(links: usize, flags: &[bool]) -> Plan {
        let todo = (0..links)
            .flat_map(|c| (0..POOLS.len()).map(move |p| (c, p)))
            .filter(|&(c, p)| flags.get(c * POOLS.len() + p) == Some(&true))
            .collect();
        Plan { todo }
    }

    /// The next step of the plan in state `m`, if any is left.
    fn next(&mut self, m: &Model) -> Option<Step> {
        if self.todo.is_empty() {
            return None;
        }
        for chan in 0..m.num_channels() {
            for queue in [Queue::Data, Queue::Control] {
                if m.pending(chan, queue) > 0 {
                    return Some(Step::Op(Op::Deliver { chan, queue }));
                }
            }
            let (source, sink) = m.endpoints(chan);
            for d in [source, sink] {
                if let Some(&pool) = m.pending_requests(chan, d).first() {
                    return Some(Step::Op(Op::RespondAssign { domain: d, chan, pool, accept: true }));
                }
            }
        }
        while !self.todo.is_empty() {
            let (chan, pool) = self.todo.remove(0);
            let (source, sink) = m.endpoints(chan);
            let holder = [source, sink].into_iter().find(|&d| m.pool_lists[d].get(&pool) == Some(&true));
            if let Some(domain) = holder {
                if !m.pool_assigned(pool, chan, domain) {
                    return Some(Step::Op(Op::AssignPool { domain, chan, pool }));
                }
            }
        }
        None
    }
}

/// Run one random sequence against model and library.
fn run_case<B: Backend>(
    backend: B,
    links: &[(DomainId, DomainId)],
    trusts: &[u8],
    plan: &[bool],
    steps: &[RawStep],
    probe: Probe,
    stats: &mut Stats,
) -> Result<(), String> {
    use_trusts(backend.trusts());
    use_aggregates(true);
    let mut m = setup_links(links, trusts);
    let mut h = Harness::new(backend);
    for &(d, count) in &POOLS {
        h.create_pool(d, count);
    }
    for (i, &(source, sink)) in links.iter().enumerate() {
        h.connect(source, sink, m.channel_trust(i));
    }
    h.compare(&m)?;
    let mut trace = Vec::new();
    let mut plan = Plan::new(links.len(), plan);
    let mut raws = steps.iter().copied();
    loop {
        let (step, raw) = match plan.next(&m) {
            Some(step) => (step, None),
            None => match raws.next() {
                Some(raw) => (pick_step(&m, raw), Some(raw)),
                None => break,
            },
        };
        // The next aggregate received is mostly kept whole.
        h.hold_next = raw.is_some_and(|r| r.3 % 4 != 0);
        // About one raw step in three works on a held aggregate, if any.
        if let Some(raw) = raw.filter(|r| r.0 % 3 == 1 && !h.held.is_empty()) {
            let (a, b, c) = (usize::from(raw.1), usize::from(raw.2), usize::from(raw.3));
            let i = a % h.held.len();
            let done = match b % 4 {
                0 => h.drop_held(&mut m, i).map(|r| r.map(|s| (s, true))),
                1 => h.forward_held(&mut m, i, (b / 4, c, a / 7), usize::from(raw.4) % (META + 1)),
                2 => h.split_held(i, c).map(|s| Ok((s, true))),
                _ => h.take_apart_held(i).map(|s| Ok((s, true))),
            };
            match done {
                None => stats.inexpressible += 1,
                Some(Err(e)) => {
                    return Err(format!("{e}\n  at a held-aggregate step after{}", show_trace(&h, &trace)));
                }
                Some(Ok((agg_step, accepted))) => {
                    match &agg_step {
                        AggStep::Drop { .. } => stats.held_dropped += 1,
                        AggStep::Forward { .. } if accepted => stats.held_forwarded += 1,
                        AggStep::Forward { .. } => stats.held_forward_refused += 1,
                        AggStep::Split { .. } => stats.held_split += 1,
                        AggStep::TakeApart { .. } => stats.held_taken_apart += 1,
                    }
                    trace.push(TraceStep::Agg(agg_step));
                    let fail = |h: &Harness<B>, what: String| {
                        format!("{what}\n  at step {}{}", trace.len() - 1, show_trace(h, &trace))
                    };
                    if let Err(e) = h.compare(&m) {
                        return Err(fail(&h, e));
                    }
                    if let Err(e) = h.check_protection(&m) {
                        return Err(fail(&h, e));
                    }
                    if let Err(e) = h.check_data(&m) {
                        return Err(fail(&h, e));
                    }
                }
            }
            continue;
        }
        // Steps that need a handle inside a held aggregate are left out.
        if h.touches_held(&step) {
            stats.inexpressible += 1;
            continue;
        }
        trace.push(TraceStep::Model(step));
        let before = m.clone();
        let (op, expected) = match step {
            Step::Op(op) => (Some(op), m.apply(&op)),
            Step::Write { domain, buf, seed } => (None, m.write(domain, buf, seed)),
        };
        let fail =
            |h: &Harness<B>, what: String| format!("{what}\n  at step {}{}", trace.len() - 1, show_trace(h, &trace));
        // Page protections change only with buffer states and trust levels:
        // checked after the operations the model accepted (reading the
        // mappings after every step would double the suite's time).
        let protections_may_change = expected.is_ok() && op.is_some();
        match (op, &expected) {
            (Some(Op::CreatePool { domain, count }), Ok(_)) => h.create_pool(domain, count),
            (Some(Op::Connect { source, sink, trust }), Ok(_)) => h.connect(source, sink, trust),
            (Some(Op::CreatePool { .. } | Op::Connect { .. }), Err(_)) => {}
            // Ids naming nothing, or a domain off the channel: not
            // expressible with the library's typed handles.
            (_, Err(Reject::InvalidArgument | Reject::NotADomainOfChannel)) => {}
            _ => {
                let got = match (op, step) {
                    (Some(op), _) => h.apply(&op, &before, matches!(expected, Ok(Outcome::Delivered { .. }))),
                    (None, Step::Write { domain, buf, seed }) => h.write(domain, buf, seed),
                    (None, Step::Op(_)) => unreachable!(),
                };
                match got {
                    None => {
                        stats.inexpressible += 1;
                        if expected.is_ok() {
                            let e = "the model accepted an operation the harness found no handle for".into();
                            return Err(fail(&h, e));
                        }
                    }
                    Some(got) => {
                        stats.compared += 1;
                        match (expected, got) {
                            (Ok(Outcome::Delivered { to, event }), Ok(Some(ev))) => {
                                stats.delivered += 1;
                                stats.aggregates_delivered +=
                                    usize::from(matches!(event, MEvent::AggregateReceived { .. }));
                                let Some(Op::Deliver { chan, .. }) = op else { unreachable!() };
                                if let Err(e) = h.take_event(to, chan, event, ev) {
                                    return Err(fail(&h, e));
                                }
                            }
                            (Ok(Outcome::Done), Ok(None)) => {
                                stats.accepted += 1;
                                stats.writes += usize::from(op.is_none());
                                stats.aggregates_sent += usize::from(matches!(op, Some(Op::SendAggregate { .. })));
                            }
                            (Err(Reject::QueueEmpty), Ok(None)) => {}
                            (Err(r), Err(e)) if reject_of(&e) == Some(r) => {
                                stats.refused += 1;
                            }
                            (want, got) => return Err(fail(&h, format!("model {want:?}, library {got:?}"))),
                        }
                    }
                }
            }
        }
        if let Err(e) = h.compare(&m) {
            return Err(fail(&h, e));
        }
        // Protections first: reading a buffer wrongly left inaccessible
        // would crash the test process instead of failing the case.
        if protections_may_change || matches!(probe, Probe::Always) {
            let forbidden = match h.check_protection(&m) {
                Ok(f) => f,
                Err(e) => return Err(fail(&h, e)),
            };
            stats.protection_checks += usize::from(!forbidden.is_empty());
            let probes: Vec<_> = match (probe, raw) {
                (Probe::Always, _) => forbidden,
                (Probe::Sampled, Some(raw)) if raw.4 % 64 == 5 && !forbidden.is_empty() => {
                    vec![forbidden[usize::from(raw.1) % forbidden.len()]]
                }
                (Probe::Sampled, _) => Vec::new(),
            };
            for (d, buf, addr) in probes {
                stats.fault_probes += 1;
                if !write_faults(addr) {
                    let state = m.buffer_state(buf, d);
                    return Err(fail(&h, format!("{buf:?} at d{d} ({state:?}): a write at {addr:#x} did not fault")));
                }
            }
        }
        if let Err(e) = h.check_data(&m) {
            return Err(fail(&h, e));
        }
    }
    Ok(())
}

fn cases() -> u32 {
    model_cases(1024)
}

/// Run `cases` random sequences from `seed`; a failure is shrunk and
/// reported with the seed and the trace of the smallest failing sequence.
fn run_suite<S: Strategy>(test: &str, seed: u64, cases: u32, strategy: S, one: impl Fn(S::Value) -> Result<(), String>)
where
    S::Value: std::fmt::Debug,
{
    let config = Config {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(seed),
        max_shrink_iters: 4096,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    match runner.run(&strategy, |v| one(v).map_err(TestCaseError::fail)) {
        Ok(()) => {}
        // The reason names the smallest failing sequence step by step; the
        // raw input it came from says no more.
        Err(proptest::test_runner::TestError::Fail(why, _)) => {
            panic!("{test} failed (seed {seed}, replay with FERRY_MODEL_SEED={seed}), smallest case: {why}")
        }
        Err(e) => panic!("{test} failed (seed {seed}): {e}"),
    }
}

fn suite<B: Backend>(test: &str, make: impl Fn() -> B) {
    suite_of(test, make, cases())
}

/// [`suite`] with `cases` cases a round.
fn suite_of<B: Backend>(test: &str, make: impl Fn() -> B, cases: u32) {
    let stats = std::cell::RefCell::new(Stats::default());
    // Half of the runs first assign every pool to every channel it can
    // reach, so that received aggregates can be forwarded.
    let strategy = (vec(any::<u8>(), LINKS.len()), any::<bool>(), vec(any::<RawStep>(), 1..150));
    let seed = seed(test);
    let n = cases as usize;
    // The comparison must not pass vacuously (see `model::coverage`).
    let floors = || {
        let stats = stats.borrow();
        let mut f = Floors::default();
        f.at_least("accepted operations", stats.accepted, 5 * n)
            .at_least("refusals", stats.refused, 2 * n)
            .at_least("deliveries", stats.delivered, 5 * n)
            .at_least("writes", stats.writes, n)
            // Received aggregates held, dropped whole, split and forwarded.
            .at_least("held aggregates dropped", stats.held_dropped, n / 8)
            .at_least("held aggregates split", stats.held_split, n / 8)
            .at_least("forwarded aggregates", stats.held_forwarded, n / 16);
        if B::TRUSTS.iter().any(|t| matches!(t, Trust::Half | Trust::None)) {
            f.at_least("protection checks", stats.protection_checks, n).at_least(
                "fault probes",
                stats.fault_probes,
                n / 16,
            );
        }
        f
    };
    run_covered(
        test,
        |round| {
            run_suite(test, round_seed(seed, round), cases, strategy.clone(), |(trusts, assigned, steps)| {
                let plan = vec![assigned; LINKS.len() * POOLS.len()];
                run_case(make(), &LINKS, &trusts, &plan, &steps, Probe::Sampled, &mut stats.borrow_mut())
            })
        },
        floors,
    );
    eprintln!("{test}: {:?}", stats.borrow());
}

/// The local backend against the reference model.
#[test]
fn local_backend_follows_the_model() {
    suite("local_backend_follows_the_model", || Local);
}

/// The shared-memory backend against the reference model.
#[test]
fn shm_backend_follows_the_model() {
    suite("shm_backend_follows_the_model", || Shm);
}

/// The local backend with batching on, against the reference model.
#[test]
fn batched_local_backend_follows_the_model() {
    suite("batched_local_backend_follows_the_model", || Batched(Local));
}

/// The shared-memory backend with batching on, against the reference model.
#[test]
fn batched_shm_backend_follows_the_model() {
    suite("batched_shm_backend_follows_the_model", || Batched(Shm));
}

/// The TCP backend against the reference model.
#[test]
fn net_backend_follows_the_model() {
    suite("net_backend_follows_the_model", || Net);
}

/// The TCP backend over TLS against the reference model (a quarter of
/// the cases: every channel pays a handshake).
#[test]
fn tls_backend_follows_the_model() {
    let pki = std::sync::Arc::new(support::tls_pki::Pki::new());
    suite_of("tls_backend_follows_the_model", || Tls(pki.clone()), (cases() / 4).max(1));
}

/// The fabric backend (libfabric's tcp provider) against the reference
/// model (a quarter of the cases: every channel opens a fabric endpoint).
#[cfg(feature = "fabric")]
#[test]
fn fabric_backend_follows_the_model() {
    suite_of("fabric_backend_follows_the_model", || Fabric, (cases() / 4).max(1));
}

/// Every channel on one multiplexed TCP session against the reference
/// model.
#[test]
fn session_backend_follows_the_model() {
    suite("session_backend_follows_the_model", Mux::default);
}

/// Every channel on a backend of its own (local, shm or TCP), pools
/// reaching a domain along several paths: a domain must see the bytes
/// the last owner wrote, whichever backends carried the buffer.
#[test]
fn mixed_backends_follow_the_model() {
    let test = "mixed_backends_follow_the_model";
    let cases = (cases() / 2).max(1);
    let stats = std::cell::RefCell::new(Stats::default());
    let links = MIXED_LINKS.len();
    let strategy = (
        (any::<u8>(), vec(any::<u8>(), links), vec(any::<u8>(), links)),
        vec(any::<bool>(), links * POOLS.len()),
        vec(any::<RawStep>(), 1..150),
    );
    let seed = seed(test);
    let n = cases as usize;
    let floors = || {
        let stats = stats.borrow();
        let mut f = Floors::default();
        f.at_least("deliveries", stats.delivered, 5 * n).at_least("writes", stats.writes, n);
        f
    };
    run_covered(
        test,
        |round| {
            run_suite(test, round_seed(seed, round), cases, strategy.clone(), |((mode, trusts, picks), plan, steps)| {
                let mixed = Mixed::new(mode, picks);
                run_case(mixed, &MIXED_LINKS, &trusts, &plan, &steps, Probe::Sampled, &mut stats.borrow_mut())
            })
        },
        floors,
    );
    eprintln!("{test}: {:?}", stats.borrow());
}

/// Page protections at HALF and NONE trust, over every backend (one per
/// run: one pick for all channels): after every step, a forked child
/// tries to write each buffer a domain may not write, and must fault.
#[test]
fn forbidden_writes_fault() {
    let test = "forbidden_writes_fault";
    let cases = (cases() / 256).max(2);
    let stats = std::cell::RefCell::new(Stats::default());
    let links = MIXED_LINKS.len();
    let strategy = (
        (any::<bool>(), vec(any::<u8>(), 1), vec(any::<u8>(), links)),
        vec(any::<bool>(), links * POOLS.len()),
        vec(any::<RawStep>(), 1..60),
    );
    let seed = seed(test);
    let floors = || {
        let mut f = Floors::default();
        f.at_least("fault probes", stats.borrow().fault_probes, cases as usize);
        f
    };
    run_covered(
        test,
        |round| {
            run_suite(test, round_seed(seed, round), cases, strategy.clone(), |((none, picks, trusts), plan, steps)| {
                let mixed = Mixed::new(if none { 2 } else { 1 }, picks);
                run_case(mixed, &MIXED_LINKS, &trusts, &plan, &steps, Probe::Always, &mut stats.borrow_mut())
            })
        },
        floors,
    );
    eprintln!("{test}: {:?}", stats.borrow());
}
