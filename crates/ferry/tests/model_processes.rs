//! Model-based tests with every domain in its own OS process: the
//! shared-memory backend (`Endpoint::shm_abstract`) between real processes,
//! held to the reference model (`tests/model/`) step by step.
//!
//! The test process is the coordinator: it runs proptest and the model,
//! and drives one domain process per model domain (this binary run again
//! as `domain_server`, see `model_processes/cluster.rs`). A domain process
//! owns its `ferry::Domain`, allocators, channel ends and buffer handles and
//! carries out typed commands (`model_processes/wire.rs`); it reports what
//! the library did, never what the model says. After every step the
//! coordinator checks, as `model_based.rs` does in one process, that the
//! library accepted or refused exactly what the model did (same error),
//! delivered the same event, and is in the same state (per-domain buffer
//! states, channel-end states, pool assignment per end, pool lists and
//! trust, the model's invariants), and beyond that: every handle a process
//! holds is one the model says it has (owned handles, copies per channel),
//! and the bytes each process reads through its own mapping are the ones
//! last written by the buffer's owner in whichever process that was (every
//! move and pass stamps the buffer first). Under trust HALF that puts the
//! sender's `mprotect` in its own process on the path of every step.
//!
//! Aggregates are drawn too: the sending process builds one of the
//! handles it holds (two fragments of each buffer, a member kept by the
//! sender shares its buffer, so it goes as a copy), the receiving process
//! takes it apart into handles, and the coordinator checks its members,
//! which were moved, and the bytes of each, as for single transfers.
//!
//! Operations that need another domain's handle (to provoke ForeignBuffer,
//! or to offer a pool the domain does not know) cannot be expressed across
//! processes: they count as inexpressible, as in the single-process
//! harness when it finds no handle, and the model must then have refused.
//!
//! `batched_shm_processes_follow_the_model` runs the same with batching on
//! at both ends of every channel (the sending end's process flushes before
//! each delivery). Only separate processes can show what a `kill -9` does:
//! `killed_domain_gives_back_what_it_was_lent` runs a random sequence,
//! delivers everything, kills one domain process and checks the survivors.

mod model;
mod support;

#[path = "model_processes/cluster.rs"]
mod cluster;
#[path = "model_processes/kill.rs"]
mod kill;
#[path = "model_processes/server.rs"]
mod server;
#[path = "model_processes/wire.rs"]
mod wire;

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

use ferry::{BufferId, BufferState, ChannelState, PoolId};
use model::coverage::{round_seed, run_covered, seed, Floors};
use model::gen::{pick_op, setup, use_aggregates, use_trusts, RawStep, DOMAINS, LINKS, POOLS};
use model::lib_map::{buffer_state, cases as model_cases, channel_state, meta_bytes, trust_level, Stats};
use model::reference::{
    BufId, BufferState as MState, ChanId, ChannelState as MChan, DomainId, Event as MEvent, Model, Op, Outcome, Queue,
    Reject, Trust,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};

use cluster::{endpoint_name, Cluster};
use wire::{Cmd, Ev, LibError, Reply, StateReport};

/// Trust levels of the shared-memory backend across processes, drawn
/// uniformly (repeat an entry to weight it).
const TRUSTS: &[Trust] = &[Trust::Full, Trust::Full, Trust::Half, Trust::None];

/// How long a delivery the model expects may take to cross.
const DELIVER_WAIT_MS: u32 = 10_000;

/// Random sequences of the model suite: `FERRY_MODEL_PROCESSES_CASES`,
/// else an eighth of `FERRY_MODEL_CASES` (the count of the single-process
/// suites, which CI sets to 4096), else 256. A step here is a round trip to
/// one process and a state query to all four: about 25 ms per sequence.
/// The batched suite runs half as many, the kill suite a quarter.
fn cases() -> u32 {
    match std::env::var("FERRY_MODEL_PROCESSES_CASES").ok().and_then(|v| v.parse().ok()) {
        Some(n) => n,
        None => (model_cases(2048) / 8).max(1),
    }
}

/// Kill sequences: each ends in a `kill -9` and a process start.
fn kill_cases() -> u32 {
    (cases() / 4).max(1)
}

fn config(cases: u32, seed: u64) -> Config {
    Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        // Shrinking re-runs whole sequences against processes: bounded.
        max_shrink_iters: 300,
        max_shrink_time: 120_000,
        ..Config::default()
    }
}

/// The library side of a run: the processes, the library's ids of the
/// model's pools, and what the coordinator tracks across processes.
struct Harness<'c> {
    cl: &'c mut Cluster,
    /// Batching on at both ends of every channel; the sending end is
    /// flushed before each delivery.
    batched: bool,
    /// Per model pool: the library's id.
    pools: Vec<PoolId>,
    /// Per model channel: [source, sink].
    chans: Vec<[DomainId; 2]>,
    /// Per buffer: the first 8 bytes its owner wrote last (0: never).
    content: HashMap<BufId, u64>,
    next_stamp: u64,
    /// Per buffer: the channel end that gave it to its current owner.
    lender: HashMap<BufId, (DomainId, ChanId)>,
    /// Per channel end: buffers it moved or passed and did not get back
    /// over the same channel (the library's record of what a peer process
    /// that dies owes it).
    lent: HashMap<(DomainId, ChanId), BTreeSet<BufId>>,
}

type Applied = Option<Result<Option<Ev>, LibError>>;

impl<'c> Harness<'c> {
    fn new(cl: &'c mut Cluster, batched: bool) -> Self {
        Harness {
            cl,
            batched,
            pools: Vec::new(),
            chans: Vec::new(),
            content: HashMap::new(),
            next_stamp: 0,
            lender: HashMap::new(),
            lent: HashMap::new(),
        }
    }

    fn bid(&self, b: BufId) -> BufferId {
        BufferId { pool: self.pools[b.pool], index: b.index as u32 }
    }

    /// The library's id of a model pool; an id nobody has for one that
    /// does not exist.
    fn lib_pool(&self, p: usize) -> PoolId {
        self.pools.get(p).copied().unwrap_or(PoolId::from_u128(u128::MAX - p as u128))
    }

    fn create_pool(&mut self, domain: DomainId, count: usize) -> Result<(), String> {
        match self.cl.call(domain, &Cmd::CreatePool { count: count as u32 })? {
            Reply::Pool(id) => {
                self.pools.push(id);
                Ok(())
            }
            r => Err(format!("d{domain} answered {r:?} to CreatePool")),
        }
    }

    /// Source listens, sink binds, both wait until connected.
    fn connect(&mut self, source: DomainId, sink: DomainId, trust: Trust) -> Result<(), String> {
        let chan = self.chans.len() as u32;
        let name = endpoint_name("ch");
        let listen = Cmd::Listen { chan, name: name.clone(), trust: trust_level(trust) };
        expect_ok(source, self.cl.call(source, &listen)?)?;
        expect_ok(sink, self.cl.call(sink, &Cmd::Bind { chan, name })?)?;
        let wait = Cmd::AwaitConnect { chan };
        self.cl.send(source, &wait)?;
        self.cl.send(sink, &wait)?;
        expect_ok(source, self.cl.recv(source, &wait)?)?;
        expect_ok(sink, self.cl.recv(sink, &wait)?)?;
        if self.batched {
            expect_ok(source, self.cl.call(source, &Cmd::Batching { chan })?)?;
            expect_ok(sink, self.cl.call(sink, &Cmd::Batching { chan })?)?;
        }
        self.chans.push([source, sink]);
        Ok(())
    }

    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// Run an operation command in process `d`.
    fn op(&mut self, d: DomainId, cmd: Cmd) -> Result<Applied, String> {
        match self.cl.call(d, &cmd)? {
            Reply::Op(r) => Ok(Some(r.map(|()| None))),
            Reply::NoHandle => Ok(None),
            r => Err(format!("d{d} answered {r:?} to {cmd:?}")),
        }
    }

    /// Run `op` on the library; `Ok(None)` when the op cannot be expressed
    /// with the handles the acting process holds. `Err`: a process failed.
    fn apply(&mut self, op: &Op, before: &Model, expect: bool) -> Result<Applied, String> {
        let meta = |len: usize| len as u8;
        match *op {
            Op::CreatePool { .. } | Op::Connect { .. } => unreachable!("handled by the caller"),
            Op::SendAggregate { domain, chan, members, meta_len } => {
                let members: Vec<(BufId, bool, u64)> =
                    members.iter().flatten().map(|&(buf, share)| (buf, share, self.stamp())).collect();
                let cmd = Cmd::SendAggregate {
                    chan: chan as u32,
                    members: members.iter().map(|&(buf, share, stamp)| (self.bid(buf), share, stamp)).collect(),
                    meta_len: meta(meta_len),
                };
                let r = self.op(domain, cmd)?;
                // As for a move: the process stamps each member it can write.
                if r.is_some() {
                    for (buf, _, stamp) in members {
                        if before.buffer_state(buf, domain) == MState::ReadWrite {
                            self.content.insert(buf, stamp);
                        }
                    }
                }
                Ok(r)
            }
            Op::AssignPool { domain, chan, pool } => {
                // A pool that does not exist has no handle to offer.
                let Some(&id) = self.pools.get(pool) else { return Ok(None) };
                self.op(domain, Cmd::Assign { chan: chan as u32, pool: id })
            }
            Op::RespondAssign { domain, chan, pool, accept } => {
                self.op(domain, Cmd::Respond { chan: chan as u32, pool: self.lib_pool(pool), accept })
            }
            Op::RemovePool { domain, chan, pool } => {
                self.op(domain, Cmd::Remove { chan: chan as u32, pool: self.lib_pool(pool) })
            }
            Op::Move { domain, chan, buf, meta_len } | Op::Pass { domain, chan, buf, meta_len } => {
                let stamp = self.stamp();
                let (chan, b, meta_len) = (chan as u32, self.bid(buf), meta(meta_len));
                let cmd = if matches!(op, Op::Move { .. }) {
                    Cmd::Move { chan, buf: b, meta_len, stamp }
                } else {
                    Cmd::Pass { chan, buf: b, meta_len, stamp }
                };
                let r = self.op(domain, cmd)?;
                // The process stamps the buffer before the operation when
                // it can write it: READ_WRITE there (the last comparison
                // showed library and model agree on that).
                if r.is_some() && before.buffer_state(buf, domain) == MState::ReadWrite {
                    self.content.insert(buf, stamp);
                }
                Ok(r)
            }
            Op::Copy { domain, chan, buf, meta_len } => {
                self.op(domain, Cmd::Copy { chan: chan as u32, buf: self.bid(buf), meta_len: meta(meta_len) })
            }
            Op::Release { domain, chan, buf } => {
                self.op(domain, Cmd::Release { chan: chan as u32, buf: self.bid(buf) })
            }
            Op::FullCopy { domain, chan, src, dst, meta_len } => {
                let cmd = Cmd::FullCopy {
                    chan: chan as u32,
                    src: self.bid(src),
                    dst: self.bid(dst),
                    meta_len: meta(meta_len),
                };
                let r = self.op(domain, cmd)?;
                if matches!(r, Some(Ok(_))) {
                    let c = self.content.get(&src).copied().unwrap_or(0);
                    self.content.insert(dst, c);
                }
                Ok(r)
            }
            Op::Teardown { domain, chan } => self.op(domain, Cmd::Teardown { chan: chan as u32 }),
            Op::Deliver { chan, queue } => {
                let (to, from) = match queue {
                    Queue::Data => (self.chans[chan][1], self.chans[chan][0]),
                    Queue::Control => (self.chans[chan][0], self.chans[chan][1]),
                };
                if self.batched {
                    expect_ok(from, self.cl.call(from, &Cmd::Flush { chan: chan as u32 })?)?;
                }
                let cmd = Cmd::Deliver { chan: chan as u32, wait_ms: if expect { DELIVER_WAIT_MS } else { 0 } };
                match self.cl.call(to, &cmd)? {
                    Reply::Event { event, .. } => Ok(Some(Ok(event))),
                    r => Err(format!("d{to} answered {r:?} to {cmd:?}")),
                }
            }
        }
    }

    /// After the model and the library both accepted `op` (the model was
    /// `before` it): what the coordinator tracks (contents are handled in
    /// `apply`).
    fn accepted(&mut self, op: &Op, before: &Model) {
        match *op {
            Op::Move { domain, chan, buf, .. }
            | Op::Pass { domain, chan, buf, .. }
            | Op::FullCopy { domain, chan, dst: buf, .. } => {
                self.lent.entry((domain, chan)).or_default().insert(buf);
            }
            // The members the sender owned read-write and gave up were moved.
            Op::SendAggregate { domain, chan, members, .. } => {
                for &(buf, share) in members.iter().flatten() {
                    if !share && before.buffer_state(buf, domain) == MState::ReadWrite {
                        self.lent.entry((domain, chan)).or_default().insert(buf);
                    }
                }
            }
            _ => {}
        }
    }

    /// Check that the library's event is the model's.
    fn take_event(&mut self, m: &Model, to: DomainId, chan: ChanId, mev: MEvent, ev: Ev) -> Result<(), String> {
        let mismatch = |ev: &Ev| Err(format!("model delivered {mev:?} to d{to}, library {ev:?}"));
        let pool_of = |h: &Self, p: usize| h.pools[p];
        let from = if self.chans[chan][0] == to { self.chans[chan][1] } else { self.chans[chan][0] };
        match (mev, &ev) {
            (MEvent::MoveReceived { buf, meta_len }, Ev::MoveReceived { buf: got, meta, content })
            | (MEvent::BufferPassed { buf, meta_len }, Ev::BufferPassed { buf: got, meta, content })
                if *got == self.bid(buf) && *meta == meta_bytes(meta_len) =>
            {
                self.check_content(buf, *content, to)?;
                if let Some(set) = self.lent.get_mut(&(to, chan)) {
                    set.remove(&buf);
                }
                self.lender.insert(buf, (from, chan));
                Ok(())
            }
            (MEvent::CopyReceived { buf, meta_len }, Ev::CopyReceived { buf: got, meta, content })
                if *got == self.bid(buf) && *meta == meta_bytes(meta_len) =>
            {
                self.check_content(buf, *content, to)
            }
            (MEvent::CopyReleased { buf, writable }, Ev::CopyReleased { buf: got, writable: w })
                if *got == self.bid(buf) && writable == *w =>
            {
                Ok(())
            }
            (MEvent::PoolAssignRequest { pool }, Ev::PoolAssignRequest { pool: got, trust })
                if *got == pool_of(self, pool) && *trust == trust_level(m.channel_trust(chan)) =>
            {
                Ok(())
            }
            (MEvent::PoolAssigned { pool }, Ev::PoolAssigned(id))
            | (MEvent::PoolVetoed { pool }, Ev::PoolVetoed(id))
            | (MEvent::PoolRemoved { pool }, Ev::PoolRemoved(id))
            | (MEvent::PoolRemoveRefused { pool }, Ev::PoolRemoveRefused(id))
            | (MEvent::PoolRemoveRequest { pool, accepted: true }, Ev::PoolRemoved(id))
            | (MEvent::PoolRemoveRequest { pool, accepted: false }, Ev::PoolRemoveRefused(id))
                if *id == pool_of(self, pool) =>
            {
                Ok(())
            }
            (MEvent::AggregateReceived { members, meta_len }, Ev::Aggregate { members: got, meta })
                if *meta == meta_bytes(meta_len) =>
            {
                let want: Vec<(BufferId, bool)> =
                    members.iter().flatten().map(|&(b, moved)| (self.bid(b), moved)).collect();
                let seen: Vec<(BufferId, bool)> = got.iter().map(|&(b, moved, _)| (b, moved)).collect();
                if seen != want {
                    return mismatch(&ev);
                }
                for (&(buf, moved), &(_, _, content)) in members.iter().flatten().zip(got) {
                    self.check_content(buf, content, to)?;
                    if moved {
                        if let Some(set) = self.lent.get_mut(&(to, chan)) {
                            set.remove(&buf);
                        }
                        self.lender.insert(buf, (from, chan));
                    }
                }
                Ok(())
            }
            (MEvent::TeardownReceived, Ev::Closed { by_peer: true }) => Ok(()),
            (MEvent::Closed, Ev::Closed { by_peer: false }) => Ok(()),
            (_, ev) => mismatch(ev),
        }
    }

    fn check_content(&self, buf: BufId, got: u64, at: DomainId) -> Result<(), String> {
        let want = self.content.get(&buf).copied().unwrap_or(0);
        if got != want {
            return Err(format!("{buf:?} reads {got:#x} in d{at}'s process, its owner last wrote {want:#x}"));
        }
        Ok(())
    }

    /// The library's view from the processes in `domains` (all at once).
    fn query(&mut self, m: &Model, domains: &[DomainId]) -> Result<Vec<Option<StateReport>>, String> {
        let bufs = m.all_buffers().into_iter().map(|b| self.bid(b)).collect();
        let cmd = Cmd::State { bufs, pools: self.pools.clone() };
        for &d in domains {
            self.cl.send(d, &cmd)?;
        }
        let mut reports: Vec<Option<StateReport>> = (0..DOMAINS).map(|_| None).collect();
        for &d in domains {
            match self.cl.recv(d, &"State")? {
                Reply::State(r) => reports[d] = Some(r),
                r => return Err(format!("d{d} answered {r:?} to State")),
            }
        }
        Ok(reports)
    }

    /// Every observable piece of state agrees with the model.
    fn compare(&mut self, m: &Model) -> Result<(), String> {
        let all: Vec<DomainId> = (0..DOMAINS).collect();
        let reports = self.query(m, &all)?;
        let reports: Vec<StateReport> = reports.into_iter().map(|r| r.expect("queried")).collect();
        for (p, id) in self.pools.iter().enumerate() {
            for (d, r) in reports.iter().enumerate() {
                let entry = r.pools.iter().find(|(q, _)| q == id);
                if entry.is_some() != m.knows_pool(d, p) {
                    return Err(format!("d{d} pool list: library {}, model {}", entry.is_some(), m.knows_pool(d, p)));
                }
                // A pool known only through a request that can no longer be
                // answered keeps, in that domain, the trust it was offered
                // with, while its owner may have set it back: not compared.
                let dead_offer = m.pool_lists[d].get(&p) == Some(&false) && m.pool_trust(p) == Trust::Uninitialized;
                if let (Some((_, t)), false) = (entry, dead_offer) {
                    if *t != trust_level(m.pool_trust(p)) {
                        return Err(format!("pool {p} trust at d{d}: library {t:?}, model {:?}", m.pool_trust(p)));
                    }
                }
            }
        }
        let bufs = m.all_buffers();
        for (d, r) in reports.iter().enumerate() {
            let mut owners = 0;
            for (i, &buf) in bufs.iter().enumerate() {
                let want = buffer_state(m.buffer_state(buf, d));
                if r.bufs[i] != want {
                    return Err(format!("{buf:?} at d{d}: library {:?}, model {want:?}", r.bufs[i]));
                }
                // The process holds an owned handle exactly for delivered
                // owners, and reads what the owner wrote last.
                let owner = matches!(want, BufferState::ReadWrite | BufferState::ReadOnlyOwned);
                owners += usize::from(owner);
                let id = self.bid(buf);
                match r.owned.iter().find(|(b, _)| *b == id) {
                    Some((_, content)) if owner => self.check_content(buf, content.unwrap_or(u64::MAX), d)?,
                    None if !owner => {}
                    h => return Err(format!("{buf:?} at d{d}: owned handle {h:?}, model owner {owner}")),
                }
                // Copies held, per channel, as the model counts them.
                for c in 0..self.chans.len() {
                    let want = if self.chans[c][1] == d { m.held_count(buf, c) } else { 0 };
                    let got = r.copies.iter().find(|(b, ch, _, _)| *b == id && *ch as usize == c);
                    match got {
                        None if want == 0 => {}
                        Some((_, _, n, content)) if *n as usize == want => {
                            self.check_content(buf, content.unwrap_or(u64::MAX), d)?
                        }
                        _ => return Err(format!("{buf:?} at d{d}: copies held via {c}: {got:?}, model {want}")),
                    }
                }
            }
            if r.owned.len() != owners || r.copies.iter().any(|(b, ..)| !bufs.iter().any(|x| self.bid(*x) == *b)) {
                return Err(format!("d{d} holds handles the model does not know of: {:?} {:?}", r.owned, r.copies));
            }
        }
        for (c, ends) in self.chans.iter().enumerate() {
            for &d in ends {
                let Some(end) = reports[d].ends.iter().find(|e| e.chan as usize == c) else {
                    return Err(format!("d{d} has no end of channel {c}"));
                };
                let want = channel_state(m.channel_state(c, d));
                if end.state != want {
                    return Err(format!("channel {c} at d{d}: library {:?}, model {want:?}", end.state));
                }
                for (p, got) in end.assigned.iter().enumerate() {
                    if *got != m.pool_assigned(p, c, d) {
                        return Err(format!("pool {p} on channel {c} at d{d}: library {got}, model {}", !got));
                    }
                }
            }
        }
        for (d, r) in reports.iter().enumerate() {
            let mine = self.chans.iter().filter(|e| e.contains(&d)).count();
            if r.ends.len() != mine {
                return Err(format!("d{d} has {} channel ends, the model {mine}", r.ends.len()));
            }
        }
        m.check_invariants()
    }
}

fn expect_ok(d: DomainId, r: Reply) -> Result<(), String> {
    match r {
        Reply::Op(Ok(())) => Ok(()),
        r => Err(format!("d{d} answered {r:?}")),
    }
}

/// Counters of the process suites beyond [`Stats`].
#[derive(Default, Debug)]
struct ProcStats {
    base: Stats,
    /// Moves, passes, copies and full copies accepted on HALF channels.
    half_transfers: usize,
    /// Domain processes started.
    spawned: usize,
    /// Most file descriptors a domain process had open after a reset.
    max_fds: u32,
}

/// One run: the model and the library side by side.
struct Run<'c> {
    h: Harness<'c>,
    m: Model,
    trace: Vec<Op>,
}

impl<'c> Run<'c> {
    /// Reset the processes, create the pools and channels of `setup`.
    fn start(cl: &'c mut Cluster, batched: bool, trusts: &[u8], stats: &mut ProcStats) -> Result<Self, String> {
        use_trusts(TRUSTS);
        use_aggregates(true);
        let fds = cl.reset()?;
        stats.max_fds = stats.max_fds.max(fds.into_iter().max().unwrap_or(0));
        let m = setup(trusts);
        let mut h = Harness::new(cl, batched);
        for &(d, count) in &POOLS {
            h.create_pool(d, count)?;
        }
        for (i, &(source, sink)) in LINKS.iter().enumerate() {
            h.connect(source, sink, m.channel_trust(i))?;
        }
        h.compare(&m)?;
        Ok(Run { h, m, trace: Vec::new() })
    }

    /// Apply `op` to model and library and compare everything.
    fn step(&mut self, op: Op, stats: &mut ProcStats) -> Result<(), String> {
        self.trace.push(op);
        let before = self.m.clone();
        let expected = self.m.apply(&op);
        let trace = &self.trace;
        let fail = |what: String| format!("{what}\n  op {op:?}\n  trace {trace:?}");
        let h = &mut self.h;
        match (op, &expected) {
            (Op::CreatePool { domain, count }, Ok(_)) => h.create_pool(domain, count).map_err(fail)?,
            (Op::Connect { source, sink, trust }, Ok(_)) => h.connect(source, sink, trust).map_err(fail)?,
            (Op::CreatePool { .. } | Op::Connect { .. }, Err(_)) => {}
            // Ids naming nothing, or a domain off the channel: not
            // expressible with the library's typed handles.
            (_, Err(Reject::InvalidArgument | Reject::NotADomainOfChannel)) => {}
            _ => {
                let delivering = matches!(expected, Ok(Outcome::Delivered { .. }));
                match h.apply(&op, &before, delivering).map_err(fail)? {
                    None => {
                        stats.base.inexpressible += 1;
                        if expected.is_ok() {
                            return Err(fail("the model accepted an operation no process has the handles for".into()));
                        }
                    }
                    Some(got) => {
                        stats.base.compared += 1;
                        match (expected, got) {
                            (Ok(Outcome::Delivered { to, event }), Ok(Some(ev))) => {
                                stats.base.delivered += 1;
                                let Op::Deliver { chan, .. } = op else { unreachable!() };
                                stats.base.aggregates_delivered +=
                                    usize::from(matches!(event, MEvent::AggregateReceived { .. }));
                                h.take_event(&self.m, to, chan, event, ev).map_err(fail)?;
                            }
                            (Ok(Outcome::Done), Ok(None)) => {
                                stats.base.accepted += 1;
                                stats.base.aggregates_sent += usize::from(matches!(op, Op::SendAggregate { .. }));
                                h.accepted(&op, &before);
                                let half = |chan: ChanId| self.m.channel_trust(chan) == Trust::Half;
                                if let Op::Move { chan, .. }
                                | Op::Pass { chan, .. }
                                | Op::Copy { chan, .. }
                                | Op::FullCopy { chan, .. }
                                | Op::SendAggregate { chan, .. } = op
                                {
                                    stats.half_transfers += usize::from(half(chan));
                                }
                            }
                            (Err(Reject::QueueEmpty), Ok(None)) => {}
                            (Err(r), Err(e)) if e.reject == Some(r) => stats.base.refused += 1,
                            (want, got) => return Err(fail(format!("model {want:?}, library {got:?}"))),
                        }
                    }
                }
            }
        }
        // A domain whose pool left its list (nothing there referred to it
        // any more) gave up its claim on what it lent of the pool as well:
        // the pool may come back later, the lending does not.
        let m = &self.m;
        self.h.lender.retain(|b, &mut (l, _)| m.knows_pool(l, b.pool));
        self.h.compare(&self.m).map_err(|e| format!("{e}\n  op {op:?}\n  trace {:?}", self.trace))
    }

    /// Deliver every queued message (replies included) until all queues
    /// are empty.
    fn quiesce(&mut self, stats: &mut ProcStats) -> Result<(), String> {
        for _ in 0..1000 {
            let pending = (0..self.m.num_channels())
                .flat_map(|c| [Queue::Data, Queue::Control].map(|q| (c, q)))
                .find(|&(c, q)| self.m.pending(c, q) > 0);
            match pending {
                Some((chan, queue)) => self.step(Op::Deliver { chan, queue }, stats)?,
                None => return Ok(()),
            }
        }
        Err("queues never drained".into())
    }
}

/// Run one random sequence against model and library.
fn run_case(
    cl: &mut Cluster,
    batched: bool,
    trusts: &[u8],
    steps: &[RawStep],
    stats: &mut ProcStats,
) -> Result<(), String> {
    let mut run = Run::start(cl, batched, trusts, stats)?;
    for &raw in steps {
        let op = pick_op(&run.m, raw);
        run.step(op, stats)?;
    }
    Ok(())
}

fn strategy() -> impl Strategy<Value = (Vec<u8>, Vec<RawStep>)> {
    (vec(any::<u8>(), LINKS.len()), vec(any::<RawStep>(), 1..150))
}

fn suite(batched: bool, n: u32) {
    let t = std::time::Instant::now();
    let cl = RefCell::new(Cluster::start("model", DOMAINS).expect("start the domain processes"));
    let stats = RefCell::new(ProcStats::default());
    let what = if batched { "batched model suite" } else { "model suite" };
    let seed = seed(what);
    // The comparison must not pass vacuously (see `model::coverage`).
    let floors = || {
        let stats = stats.borrow();
        let (s, n) = (&stats.base, n as usize);
        let mut f = Floors::default();
        f.at_least("accepted operations", s.accepted, 5 * n)
            .at_least("refusals", s.refused, 2 * n)
            .at_least("deliveries", s.delivered, 5 * n)
            .at_least("aggregates delivered", s.aggregates_delivered, n / 4);
        if TRUSTS.contains(&Trust::Half) {
            f.at_least("transfers under trust HALF", stats.half_transfers, n / 4);
        }
        f
    };
    let rounds = run_covered(
        what,
        |round| {
            let mut runner = TestRunner::new(config(n, round_seed(seed, round)));
            let result = runner.run(&strategy(), |(trusts, steps)| {
                run_case(&mut cl.borrow_mut(), batched, &trusts, &steps, &mut stats.borrow_mut())
                    .map_err(TestCaseError::fail)
            });
            if let Err(e) = result {
                panic!("{what} (seed {}): {e}", round_seed(seed, round));
            }
        },
        floors,
    );
    let mut stats = stats.into_inner();
    stats.spawned = cl.borrow().spawned;
    eprintln!("{what} across processes: {rounds} × {n} sequences in {:.1?}: {stats:?}", t.elapsed());
    // Every run started from fresh domains in the same processes: none
    // died, and resets give every descriptor back.
    assert_eq!(stats.spawned, DOMAINS, "domain processes were restarted: {stats:?}");
    assert!(stats.max_fds < 32, "descriptors pile up in the domain processes: {stats:?}");
}

/// The shared-memory backend, one process per domain, against the
/// reference model.
#[test]
fn shm_processes_follow_the_model() {
    suite(false, cases());
}

/// The same with batching on at both ends of every channel: what one
/// process holds back is published by its flush (or its poll) and then
/// seen by the other process.
#[test]
fn batched_shm_processes_follow_the_model() {
    suite(true, (cases() / 2).max(1));
}

/// After a random sequence, `kill -9` of one domain process: the survivors
/// notice in bounded time and get back what they lent it (see
/// `model_processes/kill.rs` for what is checked).
#[test]
fn killed_domain_gives_back_what_it_was_lent() {
    let t = std::time::Instant::now();
    let cl = RefCell::new(Cluster::start("kill", DOMAINS).expect("start the domain processes"));
    let stats = RefCell::new(kill::KillStats::default());
    let n = kill_cases();
    let test = "kill suite";
    let seed = seed(test);
    let floors = || {
        let stats = stats.borrow();
        let n = n as usize;
        let mut f = Floors::default();
        // An end notices a death only if its channel to the victim was
        // still open at the kill (each case checks every such end): how
        // many there are is up to the sequences, a floor like the others.
        f.at_least("buffers that came back", stats.reclaimed, n / 4)
            .at_least("buffers allocated again", stats.reallocated, n / 8)
            .at_least("copies voided", stats.voided, n / 16)
            .at_least("ends that noticed a death", stats.notices, n);
        f
    };
    let rounds = run_covered(
        test,
        |round| {
            let mut runner = TestRunner::new(config(n, round_seed(seed, round)));
            let result = runner.run(&(strategy(), any::<u8>()), |((trusts, steps), victim)| {
                kill::kill_case(&mut cl.borrow_mut(), &trusts, &steps, victim, &mut stats.borrow_mut())
                    .map_err(TestCaseError::fail)
            });
            if let Err(e) = result {
                panic!("{test} (seed {}): {e}", round_seed(seed, round));
            }
        },
        floors,
    );
    let mut stats = stats.into_inner();
    stats.run.spawned = cl.borrow().spawned;
    eprintln!("kill suite: {rounds} × {n} sequences in {:.1?}: {stats:#?}", t.elapsed());
    let n = rounds as usize * n as usize;
    assert_eq!(stats.kills, n, "{stats:?}");
}

/// A fixed sequence (all channels FULL), everything delivered, then
/// `kill -9` of `victim`, checked.
fn scripted_kill(tag: &str, ops: &[Op], victim: DomainId) -> kill::KillStats {
    scripted_kill_then(tag, ops, victim, |_| Ok(()))
}

/// [`scripted_kill`], then `after` with the survivors.
fn scripted_kill_then(
    tag: &str,
    ops: &[Op],
    victim: DomainId,
    after: impl FnOnce(&mut Run) -> Result<(), String>,
) -> kill::KillStats {
    let mut cl = Cluster::start(tag, DOMAINS).expect("start the domain processes");
    let mut stats = kill::KillStats::default();
    let result = Run::start(&mut cl, false, &[0; LINKS.len()], &mut stats.run).and_then(|mut run| {
        for &op in ops {
            run.step(op, &mut stats.run)?;
        }
        run.quiesce(&mut stats.run)?;
        kill::kill_and_check(&mut run, victim, &mut stats)?;
        after(&mut run)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    stats
}

/// Pool 0 (d0's) assigned to channel 0 (d0 → d1) and, by d1, to channel
/// 1 (d1 → d2).
fn pool0_on_0_and_1() -> Vec<Op> {
    use Op::*;
    vec![
        AssignPool { domain: 0, chan: 0, pool: 0 },
        Deliver { chan: 0, queue: Queue::Data },
        RespondAssign { domain: 1, chan: 0, pool: 0, accept: true },
        Deliver { chan: 0, queue: Queue::Control },
        AssignPool { domain: 1, chan: 1, pool: 0 },
        Deliver { chan: 1, queue: Queue::Data },
        RespondAssign { domain: 2, chan: 1, pool: 0, accept: true },
        Deliver { chan: 1, queue: Queue::Control },
    ]
}

const B0: BufId = BufId { pool: 0, index: 0 };
const B1: BufId = BufId { pool: 0, index: 1 };

/// Two domains: d0 moves one buffer to d1 and lends it a copy of another;
/// d1 is killed: both are d0's again, read-write, the moved one on the free
/// list.
#[test]
fn killed_domain_scripted_two_party() {
    let mut ops = pool0_on_0_and_1();
    ops.extend([
        Op::Move { domain: 0, chan: 0, buf: B0, meta_len: 1 },
        Op::Copy { domain: 0, chan: 0, buf: B1, meta_len: 1 },
    ]);
    let stats = scripted_kill("two-party", &ops, 1);
    assert_eq!((stats.reclaimed, stats.reallocated, stats.voided), (1, 1, 1), "{stats:?}");
}

/// d0 moves B0 to d1, d1 moves it on to d2, d1 is killed: B0 stays d2's.
/// d0's end to d1 still lists B0 as lent, but the pool's ledger shows that
/// it left d1's process since, so d0 does not take it back (two owners of
/// memory two processes share).
#[test]
fn killed_domain_does_not_give_back_what_it_passed_on() {
    let mut ops = pool0_on_0_and_1();
    ops.extend([
        Op::Move { domain: 0, chan: 0, buf: B0, meta_len: 0 },
        Op::Deliver { chan: 0, queue: Queue::Data },
        Op::Move { domain: 1, chan: 1, buf: B0, meta_len: 0 },
    ]);
    let stats = scripted_kill("passed-on", &ops, 1);
    assert_eq!((stats.reclaimed, stats.reallocated), (0, 0), "{stats:?}");
}

/// The same with a buffer that comes back: d1 moves it on to d2, d2
/// passes it back to d1, d1 dies owning it: it is d2's (the last lender),
/// not d0's. (d2 keeps B1, so the pool stays in its list once the channel
/// it came over is dead; without it, the pool would leave d2, B0 with it.)
#[test]
fn killed_domain_gives_back_to_the_last_lender() {
    let mut ops = pool0_on_0_and_1();
    ops.extend([
        Op::Move { domain: 0, chan: 0, buf: B1, meta_len: 0 },
        Op::Deliver { chan: 0, queue: Queue::Data },
        Op::Move { domain: 1, chan: 1, buf: B1, meta_len: 0 },
        Op::Deliver { chan: 1, queue: Queue::Data },
        Op::Move { domain: 0, chan: 0, buf: B0, meta_len: 0 },
        Op::Deliver { chan: 0, queue: Queue::Data },
        Op::Move { domain: 1, chan: 1, buf: B0, meta_len: 0 },
        Op::Deliver { chan: 1, queue: Queue::Data },
        Op::Pass { domain: 2, chan: 1, buf: B0, meta_len: 0 },
    ]);
    let stats = scripted_kill("last-lender", &ops, 1);
    assert_eq!((stats.reclaimed, stats.reallocated), (1, 1), "{stats:?}");
}

/// d0 moves B0 to d1 and tears their channel down (both ends close in
/// order); d1 is killed still owning B0: it is d0's again, not in the
/// state right after the kill but once d0 finds the pool empty and looks
/// for buffers held by processes that have exited since.
#[test]
fn killed_domain_gives_back_what_it_held_past_an_orderly_close() {
    let mut ops = pool0_on_0_and_1();
    ops.extend([
        Op::Move { domain: 0, chan: 0, buf: B0, meta_len: 0 },
        Op::Deliver { chan: 0, queue: Queue::Data },
        Op::Teardown { domain: 0, chan: 0 },
    ]);
    let stats = scripted_kill("past-close", &ops, 1);
    assert_eq!((stats.reclaimed_after_close, stats.reallocated), (1, 1), "{stats:?}");
}

/// d0 lends d1 a copy of B0, d1 forwards it to d2, d1 is killed: d2 still
/// reads its copy, so B0 stays read-only at d0 (the pool's ledger counts
/// copies sent between processes). Once d2 drops the copy (released in d2,
/// its channel being dead, and counted back in the ledger), d0 may write
/// B0 again.
#[test]
fn killed_domain_keeps_forwarded_copies_read_only() {
    let mut ops = pool0_on_0_and_1();
    ops.extend([
        Op::Copy { domain: 0, chan: 0, buf: B0, meta_len: 0 },
        Op::Deliver { chan: 0, queue: Queue::Data },
        Op::Copy { domain: 1, chan: 1, buf: B0, meta_len: 0 },
    ]);
    scripted_kill_then("forwarded-copy", &ops, 1, |run| {
        let b0 = run.h.bid(B0);
        let state_at_d0 = |run: &mut Run| match run.h.cl.call(0, &Cmd::State { bufs: vec![b0], pools: vec![] }) {
            Ok(Reply::State(r)) => Ok(r.bufs[0]),
            r => Err(format!("d0 answered {r:?} to State")),
        };
        if state_at_d0(run)? != BufferState::ReadOnlyOwned {
            return Err("B0 writable at d0 while d2 holds a copy".into());
        }
        match run.h.cl.call(2, &Cmd::Reset) {
            Ok(Reply::Reset { .. }) => {}
            r => return Err(format!("d2 answered {r:?} to Reset")),
        }
        match state_at_d0(run)? {
            BufferState::ReadWrite => Ok(()),
            s => Err(format!("B0 {s:?} at d0 after the last copy of it was dropped")),
        }
    });
}

/// A buffer d1 owned when it died, with a copy it made held by d2: d0
/// takes it back, read-only (off the free list) while d2 holds the copy.
#[test]
fn killed_owner_copy_keeps_the_reclaimed_buffer_read_only() {
    let mut ops = pool0_on_0_and_1();
    ops.extend([
        Op::Move { domain: 0, chan: 0, buf: B0, meta_len: 0 },
        Op::Deliver { chan: 0, queue: Queue::Data },
        Op::Copy { domain: 1, chan: 1, buf: B0, meta_len: 0 },
    ]);
    let stats = scripted_kill("owner-copy", &ops, 1);
    assert_eq!((stats.reclaimed, stats.pinned, stats.reallocated), (1, 1, 0), "{stats:?}");
}

/// Entry point of a domain process (see `model_processes/cluster.rs`):
/// does nothing unless started by a suite here.
#[test]
#[ignore = "run as a domain process by the other tests"]
fn domain_server() {
    let (Ok(addr), Ok(d)) = (std::env::var(cluster::SERVER_ENV), std::env::var(cluster::DOMAIN_ENV)) else { return };
    server::serve(&addr, d.parse().expect("domain number"));
}
