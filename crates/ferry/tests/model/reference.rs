//! Reference model of Ferry's transfer semantics: a deliberately plain
//! transcription of `docs/SEMANTICS.md` ([ETH-BT], Algorithms 1–10, refined
//! for asynchronous delivery). It is the oracle the model-based tests hold
//! the real library to, so it uses std only and never the `ferry` crate.
//!
//! The model is one global state ([`Model`]). [`Model::apply`] runs one
//! [`Op`]; it either fails with the *first* failing precondition's
//! [`Reject`] and changes nothing, or succeeds. Messages travel in two FIFO
//! queues per channel (`data`: source → sink, `control`: sink → source) and
//! take effect at the receiver only when an [`Op::Deliver`] pops them.
//! Queues are unbounded: `QueueFull` never happens in the model. Only bound
//! channels are modelled ([`Op::Connect`] creates a channel whose two sides
//! are both `CONNECTED`).
//!
//! # Precondition order (first failing check wins)
//!
//! Every channel operation first runs the common prefix
//!
//! 1. `InvalidArgument`: unknown channel id, or a buffer id naming no buffer;
//! 2. `NotADomainOfChannel`: the domain is neither endpoint of the channel;
//!
//! and then, per operation:
//!
//! | operation | checks after the prefix, in order |
//! |---|---|
//! | `Move` | state, `WrongDirection` (source), `ForeignBuffer` (not delivered owner), `PoolNotAssigned`, `PoolRemovalPending`, `CopiesOutstanding`, `MetaTooLarge` |
//! | `Pass` | as `Move`, but the direction check wants the sink |
//! | `Copy` | state, `WrongDirection` (source), `ForeignBuffer` (neither delivered owner nor holder), `PoolNotAssigned`, `PoolRemovalPending`, `MetaTooLarge` |
//! | `Release` | state, `WrongDirection` (sink), `ForeignBuffer` (state `INVALID` at the caller), `PoolNotAssigned`, `PoolRemovalPending`, `NotCopyHolder`, `CopiesForwarded` |
//! | `FullCopy` | state, `WrongDirection` (source), `ForeignBuffer` (source not readable), `ForeignBuffer` (destination not delivered owner), `SameBuffer`, `PoolNotAssigned` (destination), `PoolRemovalPending` (destination), `CopiesOutstanding` (destination), `MetaTooLarge` |
//! | `AssignPool` | state, `UnknownPool` (not permanently in the caller's pool list), `PoolAlreadyAssigned`, `TrustMismatch` |
//! | `RespondAssign` | state, `NoPendingRequest` |
//! | `RemovePool` | state, `PoolNotAssigned`, `PoolRemovalPending`, `PoolInUse` |
//! | `Teardown` | state |
//!
//! "state" is the caller's side of the channel: `TEARDOWN` gives
//! `TearingDown`, `CLOSED` gives `NotConnected`.
//! `CreatePool` rejects an unknown domain or `count == 0`, `Connect` an
//! unknown domain, `source == sink` or `Trust::Uninitialized`, all with
//! `InvalidArgument`. `Deliver` rejects an unknown channel
//! (`InvalidArgument`), then an empty queue (`QueueEmpty`).
//!
//! # Decisions where SEMANTICS.md is silent
//!
//! * **Release by the owner.** "Forwarded" copies are copies sent by a domain
//!   that is *not* the owner: the owner's own copies are originals. So an
//!   owner that got a copy of its own buffer back (A→B→A) may release it
//!   while its own copies are out; everybody else gets `CopiesForwarded` while
//!   any copy of `b` it sent (over any channel it is the source of) is still
//!   in `copies`, unless it holds `(b, c)` at least twice. (Counting the
//!   owner's copies too would make A→B→A unreleasable.) As written, the rule
//!   also makes a B→C→B cycle permanent: B and C each wait for the other.
//! * **Release ForeignBuffer.** A release is `ForeignBuffer` when `b` is
//!   `INVALID` at the caller; a caller that can see `b` but holds no
//!   `(b, c)` gets `NotCopyHolder`.
//! * **Assignment is per side.** Each side of a channel has its own list of
//!   assigned pools. The responder lists the pool when it accepts
//!   ([`Op::RespondAssign`]); the assigner when the accepting reply is
//!   delivered. `PoolNotAssigned` looks at the caller's side only.
//!   `PoolAlreadyAssigned` means: on the caller's side the pool is listed, or
//!   the caller's own request for it is unanswered, or a request for it from
//!   the peer was delivered and not yet answered. Both sides assigning the
//!   same pool concurrently: each side, receiving the other's offer while its
//!   own is out, vetoes it by itself (event `PoolVetoed` there), so neither
//!   ends up listing the pool and both agree. (Letting both accept admits an
//!   interleaving with a pool removal in which only one side lists it.)
//! * **Domain pool list.** A delivered `PoolAssignRequest` inserts the pool
//!   in the receiver's list (if absent) as a *provisional* entry. An entry is
//!   *permanent* once the domain created the pool, accepted an assignment of
//!   it, or had its own assignment of it accepted. A veto removes the
//!   responder's entry only if it is provisional and the responder has no
//!   other reference to the pool (listed, requested or request pending on
//!   any of its channel sides, or owns or holds one of its buffers). A pool
//!   stays in the list after a removal from a channel. [`Model::knows_pool`]
//!   is true for provisional entries too, but `AssignPool` needs a permanent
//!   entry (`UnknownPool` otherwise): a domain cannot offer onward a pool
//!   it has not accepted yet.
//! * **Trust** is one value per pool. The first assignment sets it; a
//!   delivered veto resets it to `UNINITIALIZED` when the pool was never
//!   accepted anywhere and no channel side lists, requested or has a pending
//!   request for it any more.
//! * **Pool removal.** `RemovePool` requires the pool to be listed on the
//!   caller's side, no removal of it by the caller pending, and not
//!   `PoolInUse`: the caller as source has no `(b, c)` in `copies`, as sink
//!   holds no `(b, c)`, for `b` in the pool. The request travels like other
//!   messages. On delivery the peer checks the same for itself: not in use →
//!   it drops the pool from its side and replies accepted; in use → replies
//!   refused; event [`Event::PoolRemoveRequest`] with `accepted` telling
//!   which. When the reply is delivered the requester drops the pool
//!   (accepted) and raises [`Event::PoolRemoved`], or keeps it and raises
//!   [`Event::PoolRemoveRefused`]. `PoolRemovalPending` (buffer operations
//!   and a second `RemovePool`) applies only to the requester while its
//!   request is unanswered: the peer decides at delivery and has nothing
//!   pending.
//! * **Teardown.** A side that has sent its marker sends nothing more: it
//!   cannot answer requests (`RespondAssign` is refused with `TearingDown` /
//!   `NotConnected` like any send). A removal request delivered to such a
//!   side changes nothing and gets no reply (event `PoolRemoveRequest` with
//!   `accepted: false`); the requester's removal stays pending forever.
//!   Requests delivered there stay unanswered until the side closes. A
//!   side that becomes `CLOSED` frees its resources (Listing 6.1): it lists
//!   no pool any more, its unanswered requests are dropped, and a pool its
//!   domain only knew provisionally through one leaves the domain's list;
//!   copies held or sent stay as they are. Receiving the peer's
//!   marker: a side that had not sent one answers with its own at once and,
//!   having then sent and received a marker, is `CLOSED` immediately (its
//!   `TEARDOWN` is momentary); it observes [`Event::TeardownReceived`]. A
//!   side that had already sent its marker becomes `CLOSED` and observes
//!   [`Event::Closed`]. Nothing can reach a `CLOSED` side afterwards.
//! * **Pool lifetime.** A domain other than a pool's creator keeps the pool
//!   in its list only while it refers to it: a channel side of the domain
//!   lists it or has a request for it (assignment or removal) out or
//!   unanswered, or the domain owns
//!   one of its buffers (in flight to it included) or holds a copy of one.
//!   After any step that leaves no such reference the pool leaves the list
//!   (the library's rule, docs/SEMANTICS.md "When a pool goes away", with
//!   every buffer and copy handle held and the creator's allocator alive).
//! * **Full copy** needs only the destination's pool assigned to the channel;
//!   its delivery is an ordinary [`Event::MoveReceived`] of the destination.
//!   The destination takes the source's contents when the full copy is
//!   issued.
//! * **Contents.** Each buffer has one contents, the seed of the pattern last
//!   written into it ([`Model::write`]; [`initial_seed`] at creation). Only
//!   a `READ_WRITE` owner writes, so every domain that can read a buffer
//!   sees the same bytes: a move, pass or copy carries them, whatever
//!   backend each channel uses.
//! * **Ids.** Pools and channels are numbered from 0 in creation order; a
//!   buffer is `(pool, index)`. Accessors panic on ids that name nothing.

// The model is shared by several test crates, each using part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// A protection domain (thread, process or machine), numbered from 0.
pub type DomainId = usize;
/// A channel, numbered from 0 in `Connect` order.
pub type ChanId = usize;
/// A pool, numbered from 0 in `CreatePool` order.
pub type PoolId = usize;

/// Side index of the source endpoint in [`Channel::sides`].
pub const SOURCE: usize = 0;
/// Side index of the sink endpoint in [`Channel::sides`].
pub const SINK: usize = 1;

/// A buffer: the `index`-th buffer of `pool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufId {
    /// The pool the buffer belongs to (`buffers_to_pools`).
    pub pool: PoolId,
    /// Position of the buffer in its pool.
    pub index: usize,
}

/// Trust level of a channel or pool (Listing 6.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trust {
    /// A pool not yet assigned to any channel.
    Uninitialized,
    /// No trust.
    None,
    /// Half trust.
    Half,
    /// Full trust.
    Full,
}

/// Per-domain buffer state (§5.1.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferState {
    /// Not accessible in this domain.
    Invalid,
    /// A received read-only copy.
    ReadOnly,
    /// Owned, delivered, but copies are out.
    ReadOnlyOwned,
    /// Owned, delivered, no copies out.
    ReadWrite,
}

/// State of one side of a (bound) channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelState {
    /// Bound; may send.
    Connected,
    /// Sent its teardown marker, not yet received the peer's.
    Teardown,
    /// Sent and received a marker.
    Closed,
}

/// One of the two queues of a channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queue {
    /// Source → sink.
    Data,
    /// Sink → source.
    Control,
}

/// An operation of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Alg. 5: `domain` creates a pool of `count` buffers, all owned by it.
    CreatePool {
        /// Creator.
        domain: DomainId,
        /// Number of buffers (> 0).
        count: usize,
    },
    /// Alg. 3 + 4: a bound channel from `source` to `sink`.
    Connect {
        /// Source endpoint's domain.
        source: DomainId,
        /// Sink endpoint's domain.
        sink: DomainId,
        /// Channel trust (not `Uninitialized`).
        trust: Trust,
    },
    /// Alg. 6, phase one: `domain` asks to assign `pool` to `chan`.
    AssignPool {
        /// Caller.
        domain: DomainId,
        /// Channel.
        chan: ChanId,
        /// Pool.
        pool: PoolId,
    },
    /// Alg. 6, phase two: `domain` answers a delivered `PoolAssignRequest`.
    RespondAssign {
        /// Responder.
        domain: DomainId,
        /// Channel.
        chan: ChanId,
        /// Pool of the request.
        pool: PoolId,
        /// Accept (true) or veto (false).
        accept: bool,
    },
    /// Two-phase removal of `pool` from `chan` (not in [ETH-BT]).
    RemovePool {
        /// Caller.
        domain: DomainId,
        /// Channel.
        chan: ChanId,
        /// Pool.
        pool: PoolId,
    },
    /// Alg. 7.
    Move {
        /// Caller (source).
        domain: DomainId,
        /// Channel.
        chan: ChanId,
        /// Buffer.
        buf: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// Alg. 8.
    Pass {
        /// Caller (sink).
        domain: DomainId,
        /// Channel.
        chan: ChanId,
        /// Buffer.
        buf: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// Alg. 9.
    Copy {
        /// Caller (source).
        domain: DomainId,
        /// Channel.
        chan: ChanId,
        /// Buffer.
        buf: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// Alg. 10.
    Release {
        /// Caller (sink).
        domain: DomainId,
        /// Channel.
        chan: ChanId,
        /// Buffer.
        buf: BufId,
    },
    /// §5.1.11: copy the bytes of `src` into `dst`, then move `dst`.
    FullCopy {
        /// Caller (source).
        domain: DomainId,
        /// Channel.
        chan: ChanId,
        /// Readable source buffer.
        src: BufId,
        /// Read-write destination buffer.
        dst: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// Start tearing the channel down from `domain`'s side.
    Teardown {
        /// Caller.
        domain: DomainId,
        /// Channel.
        chan: ChanId,
    },
    /// Send an aggregate over the members' buffers as one unit (the
    /// library's `send_aggregate`): every check for every member first,
    /// then per member, in order, a move (the domain owns the buffer
    /// READ_WRITE and does not keep a reference: `share` false) or a copy
    /// (a copy it holds is forwarded; an owned buffer it keeps, or one with
    /// copies out, stays its own read-only). The data queue gets a header
    /// and the members' messages, delivered together as one event.
    SendAggregate {
        /// Caller (source).
        domain: DomainId,
        /// Channel.
        chan: ChanId,
        /// Distinct buffers and whether the caller keeps a reference.
        members: AggMembers,
        /// Meta-data length.
        meta_len: usize,
    },
    /// Pop the head message of a queue and apply it at the receiver.
    Deliver {
        /// Channel.
        chan: ChanId,
        /// Which queue.
        queue: Queue,
    },
}

/// Most members of a generated aggregate.
pub const AGG_MAX: usize = 3;

/// The members of an aggregate: up to [`AGG_MAX`] buffers with a flag
/// (for [`Op::SendAggregate`]: the sender keeps a reference; for
/// [`Event::AggregateReceived`]: the buffer was moved).
pub type AggMembers = [Option<(BufId, bool)>; AGG_MAX];

/// Why an operation was refused (SEMANTICS.md error names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reject {
    /// The caller's side is `CLOSED`.
    NotConnected,
    /// The caller's side is in `TEARDOWN`.
    TearingDown,
    /// The caller is the wrong endpoint for this operation.
    WrongDirection,
    /// The caller does not hold the buffer in the required way.
    ForeignBuffer,
    /// The buffer's pool is not assigned to the channel on the caller's side.
    PoolNotAssigned,
    /// The caller's removal of the pool from the channel is pending.
    PoolRemovalPending,
    /// The buffer is not `READ_WRITE` at the caller.
    CopiesOutstanding,
    /// Release of a copy the caller does not hold over this channel.
    NotCopyHolder,
    /// Release while copies the caller forwarded are still out.
    CopiesForwarded,
    /// Meta-data longer than the model's meta size.
    MetaTooLarge,
    /// The pool is assigned or pending on this channel already.
    PoolAlreadyAssigned,
    /// The pool's trust differs from the channel's.
    TrustMismatch,
    /// The caller's domain pool list lacks the pool.
    UnknownPool,
    /// Removal while copies of the pool's buffers are out or held.
    PoolInUse,
    /// `RespondAssign` without a delivered, unanswered request.
    NoPendingRequest,
    /// Full copy with source = destination.
    SameBuffer,
    /// The domain is neither endpoint of the channel.
    NotADomainOfChannel,
    /// Malformed operation (ids naming nothing, bad arguments).
    InvalidArgument,
    /// `Deliver` on an empty queue.
    QueueEmpty,
}

impl Reject {
    /// Every reason, in declaration order (what coverage checks and wire
    /// codes enumerate).
    pub const ALL: [Reject; 19] = [
        Reject::NotConnected,
        Reject::TearingDown,
        Reject::WrongDirection,
        Reject::ForeignBuffer,
        Reject::PoolNotAssigned,
        Reject::PoolRemovalPending,
        Reject::CopiesOutstanding,
        Reject::NotCopyHolder,
        Reject::CopiesForwarded,
        Reject::MetaTooLarge,
        Reject::PoolAlreadyAssigned,
        Reject::TrustMismatch,
        Reject::UnknownPool,
        Reject::PoolInUse,
        Reject::NoPendingRequest,
        Reject::SameBuffer,
        Reject::NotADomainOfChannel,
        Reject::InvalidArgument,
        Reject::QueueEmpty,
    ];
}

/// What the receiving side observes when a `Deliver` step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A moved (or full-copied) buffer arrived; the receiver owns it.
    MoveReceived {
        /// Buffer.
        buf: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// A passed buffer arrived; the receiver owns it.
    BufferPassed {
        /// Buffer.
        buf: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// A read-only copy arrived; the receiver holds it.
    CopyReceived {
        /// Buffer.
        buf: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// A copy came back.
    CopyReleased {
        /// Buffer.
        buf: BufId,
        /// Whether the buffer is now `READ_WRITE` at the receiver.
        writable: bool,
    },
    /// The peer asks to assign a pool; answer with `RespondAssign`.
    PoolAssignRequest {
        /// Pool.
        pool: PoolId,
    },
    /// The peer accepted our assignment.
    PoolAssigned {
        /// Pool.
        pool: PoolId,
    },
    /// The peer vetoed our assignment.
    PoolVetoed {
        /// Pool.
        pool: PoolId,
    },
    /// The peer asks to remove a pool; the library answered by itself.
    PoolRemoveRequest {
        /// Pool.
        pool: PoolId,
        /// True: dropped here and accepted. False: refused (in use), or not
        /// answered because this side has sent its teardown marker.
        accepted: bool,
    },
    /// The peer accepted our removal; the pool left the channel.
    PoolRemoved {
        /// Pool.
        pool: PoolId,
    },
    /// The peer refused our removal; the pool stays.
    PoolRemoveRefused {
        /// Pool.
        pool: PoolId,
    },
    /// An aggregate arrived: its members (moved: owned now; else a copy
    /// held now), one event for the whole.
    AggregateReceived {
        /// Members, flagged `true` if moved.
        members: AggMembers,
        /// Meta-data length.
        meta_len: usize,
    },
    /// The peer's teardown marker arrived first; we answered and are `CLOSED`.
    TeardownReceived,
    /// The peer's marker answered ours; we are `CLOSED`.
    Closed,
}

/// Result of a successful operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done, nothing to report.
    Done,
    /// A pool or channel was created with this id.
    Created(usize),
    /// A message was delivered to domain `to`, which observes `event`.
    Delivered {
        /// Receiving domain.
        to: DomainId,
        /// What it observes.
        event: Event,
    },
}

/// A message in a channel queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Head of an aggregate run (data queue): `count` member messages
    /// (moves and copies) follow, delivered with it as one event.
    AggHeader {
        /// Members that follow.
        count: usize,
        /// Meta-data length.
        meta_len: usize,
    },
    /// Move (data queue), also the second half of a full copy.
    Move {
        /// Buffer.
        buf: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// Pass (control queue).
    Pass {
        /// Buffer.
        buf: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// Read-only copy (data queue).
    Copy {
        /// Buffer.
        buf: BufId,
        /// Meta-data length.
        meta_len: usize,
    },
    /// Copy release (control queue).
    Release {
        /// Buffer.
        buf: BufId,
    },
    /// Pool assignment request.
    AssignRequest {
        /// Pool.
        pool: PoolId,
    },
    /// Answer to an assignment request.
    AssignReply {
        /// Pool.
        pool: PoolId,
        /// Accepted or vetoed.
        accepted: bool,
    },
    /// Pool removal request.
    RemoveRequest {
        /// Pool.
        pool: PoolId,
    },
    /// Answer to a removal request.
    RemoveReply {
        /// Pool.
        pool: PoolId,
        /// Accepted or refused.
        accepted: bool,
    },
    /// Teardown marker.
    Marker,
}

/// A pool and the owners of its buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// Domain that created it.
    pub creator: DomainId,
    /// The pool's trust level.
    pub trust: Trust,
    /// Some assignment of the pool was accepted: its trust is fixed.
    pub ever_accepted: bool,
    /// `buffer_ownership`, per buffer index.
    pub owner: Vec<DomainId>,
    /// `in_flight`, per buffer index: the channel of the undelivered move/pass.
    pub in_flight: Vec<Option<ChanId>>,
    /// The contents of each buffer, as the seed of the pattern last written
    /// into it (see [`Model::write`]); [`initial_seed`] at creation.
    pub contents: Vec<u64>,
}

/// The seed of the pattern the creator writes into buffer `index` of pool
/// `pool` when it creates the pool: distinct for every buffer.
pub fn initial_seed(pool: PoolId, index: usize) -> u64 {
    0x1_0000_0000 | (pool as u64) << 16 | index as u64
}

/// What one side of a channel knows and has done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Side {
    /// This side has sent its teardown marker.
    pub sent_marker: bool,
    /// This side has received the peer's teardown marker.
    pub received_marker: bool,
    /// Pools assigned to the channel, as this side sees it.
    pub assigned: BTreeSet<PoolId>,
    /// Pools this side asked to assign, reply not yet delivered.
    pub assign_out: BTreeSet<PoolId>,
    /// Assignment requests delivered here and not yet answered.
    pub assign_in: BTreeSet<PoolId>,
    /// Pools this side asked to remove, reply not yet delivered.
    pub remove_out: BTreeSet<PoolId>,
}

/// A bound channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Channel {
    /// Domain of the source endpoint.
    pub source: DomainId,
    /// Domain of the sink endpoint.
    pub sink: DomainId,
    /// Trust level.
    pub trust: Trust,
    /// `[source side, sink side]`, indexed by [`SOURCE`] and [`SINK`].
    pub sides: [Side; 2],
    /// Source → sink queue.
    pub data: VecDeque<Msg>,
    /// Sink → source queue.
    pub control: VecDeque<Msg>,
}

/// The whole model state (Algorithm 1, refined).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Model {
    /// Number of domains (ids `0..domains`).
    pub domains: usize,
    /// Largest meta-data length accepted.
    pub meta_size: usize,
    /// Valid pools, by id.
    pub pools: Vec<Pool>,
    /// Valid channels, by id.
    pub channels: Vec<Channel>,
    /// Multiset `copies` of `(b, c)`: count > 0 only (absent means 0).
    pub copies: BTreeMap<(BufId, ChanId), usize>,
    /// Multiset `held` of `(b, c)`: count > 0 only.
    pub held: BTreeMap<(BufId, ChanId), usize>,
    /// Domain pool lists: pool → permanent (true) or provisional (false).
    pub pool_lists: Vec<BTreeMap<PoolId, bool>>,
}

// ----------------------------------------------------------------------
// Multiset helpers.

fn ms_count(ms: &BTreeMap<(BufId, ChanId), usize>, key: (BufId, ChanId)) -> usize {
    ms.get(&key).copied().unwrap_or(0)
}

fn ms_add(ms: &mut BTreeMap<(BufId, ChanId), usize>, key: (BufId, ChanId)) {
    *ms.entry(key).or_insert(0) += 1;
}

fn ms_remove(ms: &mut BTreeMap<(BufId, ChanId), usize>, key: (BufId, ChanId)) {
    let count = ms.get_mut(&key).expect("multiset removal of an absent element");
    *count -= 1;
    if *count == 0 {
        ms.remove(&key);
    }
}

impl Model {
    /// An empty system of `domains` domains whose channels carry meta-data of
    /// at most `meta_size` bytes.
    pub fn new(domains: usize, meta_size: usize) -> Self {
        Model {
            domains,
            meta_size,
            pools: Vec::new(),
            channels: Vec::new(),
            copies: BTreeMap::new(),
            held: BTreeMap::new(),
            pool_lists: vec![BTreeMap::new(); domains],
        }
    }

    /// Apply one operation. On `Err` the state is unchanged.
    pub fn apply(&mut self, op: &Op) -> Result<Outcome, Reject> {
        let outcome = self.apply_op(op)?;
        self.drop_unreferenced_pools();
        Ok(outcome)
    }

    /// A domain other than the creator drops a pool it no longer refers to.
    fn drop_unreferenced_pools(&mut self) {
        for d in 0..self.domains {
            let listed: Vec<PoolId> = self.pool_lists[d].keys().copied().collect();
            for pool in listed {
                if self.pools[pool].creator != d && !self.domain_refers_to_pool(d, pool) {
                    self.pool_lists[d].remove(&pool);
                }
            }
        }
    }

    fn apply_op(&mut self, op: &Op) -> Result<Outcome, Reject> {
        match *op {
            Op::CreatePool { domain, count } => self.create_pool(domain, count),
            Op::Connect { source, sink, trust } => self.connect(source, sink, trust),
            Op::AssignPool { domain, chan, pool } => self.assign_pool(domain, chan, pool),
            Op::RespondAssign { domain, chan, pool, accept } => self.respond_assign(domain, chan, pool, accept),
            Op::RemovePool { domain, chan, pool } => self.remove_pool(domain, chan, pool),
            Op::Move { domain, chan, buf, meta_len } => self.move_buffer(domain, chan, buf, meta_len),
            Op::Pass { domain, chan, buf, meta_len } => self.pass_buffer(domain, chan, buf, meta_len),
            Op::Copy { domain, chan, buf, meta_len } => self.copy_buffer(domain, chan, buf, meta_len),
            Op::Release { domain, chan, buf } => self.release_copy(domain, chan, buf),
            Op::FullCopy { domain, chan, src, dst, meta_len } => self.full_copy(domain, chan, src, dst, meta_len),
            Op::Teardown { domain, chan } => self.teardown(domain, chan),
            Op::SendAggregate { domain, chan, members, meta_len } => {
                self.send_aggregate(domain, chan, members, meta_len)
            }
            Op::Deliver { chan, queue } => self.deliver(chan, queue),
        }
    }

    // ------------------------------------------------------------------
    // Queries (used by the harness and the test generators).

    /// Number of pools created so far (pool ids are `0..num_pools()`).
    pub fn num_pools(&self) -> usize {
        self.pools.len()
    }

    /// Number of channels created so far (ids `0..num_channels()`).
    pub fn num_channels(&self) -> usize {
        self.channels.len()
    }

    /// `(source, sink)` domains of a channel.
    pub fn endpoints(&self, chan: ChanId) -> (DomainId, DomainId) {
        (self.channels[chan].source, self.channels[chan].sink)
    }

    /// The trust level of a channel.
    pub fn channel_trust(&self, chan: ChanId) -> Trust {
        self.channels[chan].trust
    }

    /// All buffers of a pool.
    pub fn pool_buffers(&self, pool: PoolId) -> Vec<BufId> {
        (0..self.pools[pool].owner.len()).map(|index| BufId { pool, index }).collect()
    }

    /// All buffers of all pools.
    pub fn all_buffers(&self) -> Vec<BufId> {
        (0..self.pools.len()).flat_map(|pool| self.pool_buffers(pool)).collect()
    }

    /// `buffer_ownership(b)`.
    pub fn owner(&self, buf: BufId) -> DomainId {
        self.pools[buf.pool].owner[buf.index]
    }

    /// The contents of `b`: the seed of the pattern last written into it.
    /// Every domain that can read `b` (its delivered owner, the holders of
    /// its copies) sees these bytes; a move, pass or copy carries them.
    pub fn contents(&self, buf: BufId) -> u64 {
        self.pools[buf.pool].contents[buf.index]
    }

    /// `domain` writes the pattern of `seed` into `buf` (through its owned
    /// handle): `InvalidArgument` for ids naming nothing, `ForeignBuffer`
    /// unless `domain` is the delivered owner, `CopiesOutstanding` unless
    /// the buffer is `READ_WRITE` there. Not an [`Op`]: no message, no
    /// state change but the contents.
    pub fn write(&mut self, domain: DomainId, buf: BufId, seed: u64) -> Result<Outcome, Reject> {
        self.check_buffer(buf)?;
        if domain >= self.domains {
            return Err(Reject::InvalidArgument);
        }
        if !self.is_delivered_owner(buf, domain) {
            return Err(Reject::ForeignBuffer);
        }
        if self.buffer_state(buf, domain) != BufferState::ReadWrite {
            return Err(Reject::CopiesOutstanding);
        }
        self.pools[buf.pool].contents[buf.index] = seed;
        Ok(Outcome::Done)
    }

    /// The channel of `b`'s undelivered move/pass, if any.
    pub fn in_flight(&self, buf: BufId) -> Option<ChanId> {
        self.pools[buf.pool].in_flight[buf.index]
    }

    /// Count of `(b, c)` in `copies`.
    pub fn copies_count(&self, buf: BufId, chan: ChanId) -> usize {
        ms_count(&self.copies, (buf, chan))
    }

    /// Count of `(b, c)` in `held`.
    pub fn held_count(&self, buf: BufId, chan: ChanId) -> usize {
        ms_count(&self.held, (buf, chan))
    }

    /// The per-domain buffer state of `b` at `d`.
    pub fn buffer_state(&self, buf: BufId, domain: DomainId) -> BufferState {
        if self.is_delivered_owner(buf, domain) {
            if self.has_copies(buf) {
                BufferState::ReadOnlyOwned
            } else {
                BufferState::ReadWrite
            }
        } else if self.holds_some_copy(buf, domain) {
            BufferState::ReadOnly
        } else {
            BufferState::Invalid
        }
    }

    /// State of `domain`'s side of `chan` (panics if it is not an endpoint).
    pub fn channel_state(&self, chan: ChanId, domain: DomainId) -> ChannelState {
        let side = self.side_index(chan, domain).expect("channel_state: domain is not an endpoint");
        let s = &self.channels[chan].sides[side];
        if s.sent_marker && s.received_marker {
            ChannelState::Closed
        } else if s.sent_marker {
            ChannelState::Teardown
        } else {
            ChannelState::Connected
        }
    }

    /// Messages waiting in a queue.
    pub fn pending(&self, chan: ChanId, queue: Queue) -> usize {
        self.queue(chan, queue).len()
    }

    /// The messages of a queue, head first.
    pub fn queue(&self, chan: ChanId, queue: Queue) -> &VecDeque<Msg> {
        match queue {
            Queue::Data => &self.channels[chan].data,
            Queue::Control => &self.channels[chan].control,
        }
    }

    /// The trust level of a pool.
    pub fn pool_trust(&self, pool: PoolId) -> Trust {
        self.pools[pool].trust
    }

    /// Whether `pool` is assigned to `chan` on `domain`'s side (false if
    /// `domain` is not an endpoint).
    pub fn pool_assigned(&self, pool: PoolId, chan: ChanId, domain: DomainId) -> bool {
        match self.side_index(chan, domain) {
            Some(side) => self.channels[chan].sides[side].assigned.contains(&pool),
            None => false,
        }
    }

    /// Whether `pool` is in `domain`'s domain pool list.
    pub fn knows_pool(&self, domain: DomainId, pool: PoolId) -> bool {
        domain < self.domains && self.pool_lists[domain].contains_key(&pool)
    }

    /// Requests delivered to `domain` on `chan` and not yet answered.
    pub fn pending_requests(&self, chan: ChanId, domain: DomainId) -> Vec<PoolId> {
        match self.side_index(chan, domain) {
            Some(side) => self.channels[chan].sides[side].assign_in.iter().copied().collect(),
            None => Vec::new(),
        }
    }

    /// Whether `domain` waits for the answer to its removal of `pool` from `chan`.
    pub fn removal_pending(&self, chan: ChanId, domain: DomainId, pool: PoolId) -> bool {
        match self.side_index(chan, domain) {
            Some(side) => self.channels[chan].sides[side].remove_out.contains(&pool),
            None => false,
        }
    }

    // ------------------------------------------------------------------
    // Small predicates the operations are written with.

    /// `SOURCE` or `SINK` if `domain` is that endpoint of `chan`.
    fn side_index(&self, chan: ChanId, domain: DomainId) -> Option<usize> {
        let ch = &self.channels[chan];
        if ch.source == domain {
            Some(SOURCE)
        } else if ch.sink == domain {
            Some(SINK)
        } else {
            None
        }
    }

    fn domain_of_side(&self, chan: ChanId, side: usize) -> DomainId {
        if side == SOURCE {
            self.channels[chan].source
        } else {
            self.channels[chan].sink
        }
    }

    fn buffer_exists(&self, buf: BufId) -> bool {
        buf.pool < self.pools.len() && buf.index < self.pools[buf.pool].owner.len()
    }

    /// `owner(b) = d` and `b` delivered.
    fn is_delivered_owner(&self, buf: BufId, domain: DomainId) -> bool {
        self.owner(buf) == domain && self.in_flight(buf).is_none()
    }

    /// Some `(b, ·)` in `copies` ([ETH-BT]'s `b ∈ dom(buffer_copies)`).
    fn has_copies(&self, buf: BufId) -> bool {
        self.copies.keys().any(|&(b, _)| b == buf)
    }

    /// `d` holds some `(b, c)` (it is the sink of `c`).
    fn holds_some_copy(&self, buf: BufId, domain: DomainId) -> bool {
        self.held.keys().any(|&(b, c)| b == buf && self.channels[c].sink == domain)
    }

    /// `d` is not the owner of `b` and some copy of `b` it sent is still out.
    fn has_forwarded_copies(&self, buf: BufId, domain: DomainId) -> bool {
        self.owner(buf) != domain && self.copies.keys().any(|&(b, c)| b == buf && self.channels[c].source == domain)
    }

    /// `d`'s side of `c` sees a copy of one of `pool`'s buffers out or held.
    fn pool_in_use(&self, chan: ChanId, side: usize, pool: PoolId) -> bool {
        if side == SOURCE {
            self.copies.keys().any(|&(b, c)| b.pool == pool && c == chan)
        } else {
            self.held.keys().any(|&(b, c)| b.pool == pool && c == chan)
        }
    }

    /// Some channel side lists, requested, or has a request pending for `pool`.
    fn pool_on_some_channel(&self, pool: PoolId) -> bool {
        // A request waiting at a side that has sent its teardown marker can
        // never be answered (and its requester may have closed already):
        // it holds nothing.
        self.channels.iter().any(|ch| {
            ch.sides.iter().any(|s| {
                s.assigned.contains(&pool)
                    || s.assign_out.contains(&pool)
                    || (!s.sent_marker && s.assign_in.contains(&pool))
            })
        })
    }

    /// `domain`'s side of `chan` lists `pool` or has a request for it
    /// (assignment or removal) out or unanswered.
    pub fn side_refers_to_pool(&self, chan: ChanId, domain: DomainId, pool: PoolId) -> bool {
        match self.side_index(chan, domain) {
            Some(side) => {
                let s = &self.channels[chan].sides[side];
                s.assigned.contains(&pool)
                    || s.assign_out.contains(&pool)
                    || s.assign_in.contains(&pool)
                    || s.remove_out.contains(&pool)
            }
            None => false,
        }
    }

    /// `domain` refers to `pool` other than by its pool list entry.
    fn domain_refers_to_pool(&self, domain: DomainId, pool: PoolId) -> bool {
        let on_a_side = (0..self.channels.len()).any(|chan| self.side_refers_to_pool(chan, domain, pool));
        let has_buffer =
            self.pool_buffers(pool).into_iter().any(|b| self.owner(b) == domain || self.holds_some_copy(b, domain));
        on_a_side || has_buffer
    }

    /// A side became CLOSED: "the channel is closed and the resources are
    /// freed" (Listing 6.1). It lists no pool any more; unanswered requests
    /// are dropped, and a pool the domain only knew through such a request
    /// leaves its list. Copies already held stay readable (they live on
    /// in `held`), and copies sent stay out.
    fn close_side(&mut self, chan: ChanId, side: usize) {
        let d = self.domain_of_side(chan, side);
        let s = &mut self.channels[chan].sides[side];
        let offered: Vec<PoolId> = s.assign_in.iter().copied().collect();
        s.assigned.clear();
        s.assign_out.clear();
        s.assign_in.clear();
        s.remove_out.clear();
        for pool in offered {
            if self.pool_lists[d].get(&pool) == Some(&false) && !self.domain_refers_to_pool(d, pool) {
                self.pool_lists[d].remove(&pool);
            }
        }
    }

    fn outgoing_queue(&mut self, chan: ChanId, side: usize) -> &mut VecDeque<Msg> {
        if side == SOURCE {
            &mut self.channels[chan].data
        } else {
            &mut self.channels[chan].control
        }
    }

    // ------------------------------------------------------------------
    // Precondition checks shared by the operations, one per table row.

    /// Prefix 1: the channel id names a channel.
    fn check_channel(&self, chan: ChanId) -> Result<(), Reject> {
        if chan < self.channels.len() {
            Ok(())
        } else {
            Err(Reject::InvalidArgument)
        }
    }

    /// Prefix 1: the buffer id names a buffer.
    fn check_buffer(&self, buf: BufId) -> Result<(), Reject> {
        if self.buffer_exists(buf) {
            Ok(())
        } else {
            Err(Reject::InvalidArgument)
        }
    }

    /// Prefix 2: `ep_to_dom(ep) = domain` for an endpoint of the channel.
    fn check_endpoint(&self, chan: ChanId, domain: DomainId) -> Result<usize, Reject> {
        self.side_index(chan, domain).ok_or(Reject::NotADomainOfChannel)
    }

    /// "channel side is CONNECTED (TEARDOWN gives its own error)".
    fn check_connected(&self, chan: ChanId, domain: DomainId) -> Result<(), Reject> {
        match self.channel_state(chan, domain) {
            ChannelState::Connected => Ok(()),
            ChannelState::Teardown => Err(Reject::TearingDown),
            ChannelState::Closed => Err(Reject::NotConnected),
        }
    }

    /// `dir_to_ep⁻¹(ep) = (chan, wanted)`.
    fn check_direction(&self, side: usize, wanted: usize) -> Result<(), Reject> {
        if side == wanted {
            Ok(())
        } else {
            Err(Reject::WrongDirection)
        }
    }

    /// `(buffer, chan) ∈ buffers_to_pools ∘ pools_to_channels`, on `d`'s side.
    fn check_pool_assigned(&self, chan: ChanId, side: usize, buf: BufId) -> Result<(), Reject> {
        if self.channels[chan].sides[side].assigned.contains(&buf.pool) {
            Ok(())
        } else {
            Err(Reject::PoolNotAssigned)
        }
    }

    /// "…and no removal of that pool from c is pending" (at the caller).
    fn check_no_removal(&self, chan: ChanId, side: usize, pool: PoolId) -> Result<(), Reject> {
        if self.channels[chan].sides[side].remove_out.contains(&pool) {
            Err(Reject::PoolRemovalPending)
        } else {
            Ok(())
        }
    }

    /// "meta-data no longer than the channel's meta size".
    fn check_meta(&self, meta_len: usize) -> Result<(), Reject> {
        if meta_len <= self.meta_size {
            Ok(())
        } else {
            Err(Reject::MetaTooLarge)
        }
    }

    // ------------------------------------------------------------------
    // Operations, one function each.

    /// Algorithm 5, CreatePool.
    fn create_pool(&mut self, domain: DomainId, count: usize) -> Result<Outcome, Reject> {
        // Alg. 5 "Require: domain ∈ DOMAINS"
        if domain >= self.domains {
            return Err(Reject::InvalidArgument);
        }
        // Alg. 5 "Require: bufs ⊆ BUFFERS \ valid_buffers ∧ bufs ≠ ∅"
        if count == 0 {
            return Err(Reject::InvalidArgument);
        }
        let pool = self.pools.len();
        // Alg. 5 "Ensure: ∀ b ∈ bufs: buffer_ownership(b) = domain"
        self.pools.push(Pool {
            creator: domain,
            trust: Trust::Uninitialized,
            ever_accepted: false,
            owner: vec![domain; count],
            in_flight: vec![None; count],
            contents: (0..count).map(|index| initial_seed(pool, index)).collect(),
        });
        // §5.2.3 step 1: the creator knows its pool.
        self.pool_lists[domain].insert(pool, true);
        Ok(Outcome::Created(pool))
    }

    /// Algorithms 3 and 4, create + bind, collapsed into one step.
    fn connect(&mut self, source: DomainId, sink: DomainId, trust: Trust) -> Result<Outcome, Reject> {
        // Alg. 3/4 "Require: domain ∈ DOMAINS"
        if source >= self.domains || sink >= self.domains {
            return Err(Reject::InvalidArgument);
        }
        // Model restriction: the two endpoints are different domains.
        if source == sink {
            return Err(Reject::InvalidArgument);
        }
        // Channel setup: "the trust level (never UNINITIALIZED)"
        if trust == Trust::Uninitialized {
            return Err(Reject::InvalidArgument);
        }
        let chan = self.channels.len();
        self.channels.push(Channel {
            source,
            sink,
            trust,
            sides: [Side::default(), Side::default()],
            data: VecDeque::new(),
            control: VecDeque::new(),
        });
        Ok(Outcome::Created(chan))
    }

    /// Algorithm 6, phase one: send the assignment request.
    fn assign_pool(&mut self, domain: DomainId, chan: ChanId, pool: PoolId) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        let side = self.check_endpoint(chan, domain)?;
        // Alg. 6 "Require: ∃ chan, dir: dir_to_eps⁻¹(ep) = (chan, dir)": bound and CONNECTED
        self.check_connected(chan, domain)?;
        // Alg. 6 "Require: pool ∈ valid_pools", refined: d has the pool in its
        // list permanently (created it, or an assignment of it was accepted);
        // a pool only offered to d cannot be passed on before d accepts it.
        if self.pool_lists[domain].get(&pool) != Some(&true) {
            return Err(Reject::UnknownPool);
        }
        // Alg. 6 "Require: (pool, chan) ∉ pools_to_channels", refined: nor pending
        let s = &self.channels[chan].sides[side];
        if s.assigned.contains(&pool) || s.assign_out.contains(&pool) || s.assign_in.contains(&pool) {
            return Err(Reject::PoolAlreadyAssigned);
        }
        // Refinement: the pool's trust is UNINITIALIZED or the channel's
        let chan_trust = self.channels[chan].trust;
        let pool_trust = self.pools[pool].trust;
        if pool_trust != Trust::Uninitialized && pool_trust != chan_trust {
            return Err(Reject::TrustMismatch);
        }
        // Effects: an uninitialized pool takes the channel's trust; request enqueued.
        self.pools[pool].trust = chan_trust;
        self.channels[chan].sides[side].assign_out.insert(pool);
        self.outgoing_queue(chan, side).push_back(Msg::AssignRequest { pool });
        Ok(Outcome::Done)
    }

    /// Algorithm 6, phase two: answer a delivered assignment request.
    fn respond_assign(
        &mut self,
        domain: DomainId,
        chan: ChanId,
        pool: PoolId,
        accept: bool,
    ) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        let side = self.check_endpoint(chan, domain)?;
        // Model decision: answering is a send; only a CONNECTED side sends.
        self.check_connected(chan, domain)?;
        // §5.2.3 step 6: there is a delivered, unanswered request
        if !self.channels[chan].sides[side].assign_in.contains(&pool) {
            return Err(Reject::NoPendingRequest);
        }
        self.channels[chan].sides[side].assign_in.remove(&pool);
        if accept {
            // §5.2.3 step 7: "the pool added to the channel"
            self.channels[chan].sides[side].assigned.insert(pool);
            self.pool_lists[domain].insert(pool, true);
            self.pools[pool].ever_accepted = true;
        } else {
            // §5.2.3: "removing the pool from the domain list if this pool
            // was assigned for the first time"
            let provisional = self.pool_lists[domain].get(&pool) == Some(&false);
            if provisional && !self.domain_refers_to_pool(domain, pool) {
                self.pool_lists[domain].remove(&pool);
            }
        }
        self.outgoing_queue(chan, side).push_back(Msg::AssignReply { pool, accepted: accept });
        Ok(Outcome::Done)
    }

    /// Pool removal, phase one (not in [ETH-BT]).
    fn remove_pool(&mut self, domain: DomainId, chan: ChanId, pool: PoolId) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        let side = self.check_endpoint(chan, domain)?;
        // Channel side is CONNECTED
        self.check_connected(chan, domain)?;
        // The pool is assigned to c (on d's side)
        if !self.channels[chan].sides[side].assigned.contains(&pool) {
            return Err(Reject::PoolNotAssigned);
        }
        // No removal pending
        self.check_no_removal(chan, side, pool)?;
        // d has no copy of the pool's buffers out over c nor holds one received over c
        if self.pool_in_use(chan, side, pool) {
            return Err(Reject::PoolInUse);
        }
        self.channels[chan].sides[side].remove_out.insert(pool);
        self.outgoing_queue(chan, side).push_back(Msg::RemoveRequest { pool });
        Ok(Outcome::Done)
    }

    /// Algorithm 7, move.
    fn move_buffer(&mut self, domain: DomainId, chan: ChanId, buf: BufId, meta_len: usize) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        self.check_buffer(buf)?;
        let side = self.check_endpoint(chan, domain)?;
        // Alg. 7 "Require: ep ∈ valid_ep" (bound), refined: CONNECTED
        self.check_connected(chan, domain)?;
        // Alg. 7 "Require: dir_to_ep⁻¹(ep) = (chan, SOURCE)"
        self.check_direction(side, SOURCE)?;
        // Alg. 7 "Require: buffer_ownership(buffer) = domain", refined: delivered
        if !self.is_delivered_owner(buf, domain) {
            return Err(Reject::ForeignBuffer);
        }
        // Alg. 7 "Require: (buffer, chan) ∈ buffers_to_pools ∘ pools_to_channels"
        self.check_pool_assigned(chan, side, buf)?;
        self.check_no_removal(chan, side, buf.pool)?;
        // Refinement: the buffer is READ_WRITE (no copies out)
        if self.buffer_state(buf, domain) != BufferState::ReadWrite {
            return Err(Reject::CopiesOutstanding);
        }
        self.check_meta(meta_len)?;
        // Alg. 7 "Ensure: buffer_ownership'(buf) = ep_to_dom(other_ep)"
        let sink = self.channels[chan].sink;
        self.pools[buf.pool].owner[buf.index] = sink;
        self.pools[buf.pool].in_flight[buf.index] = Some(chan);
        // Alg. 7 "Ensure: data_queues'(chan) = enqueue(data_queues(chan), buf)"
        self.channels[chan].data.push_back(Msg::Move { buf, meta_len });
        Ok(Outcome::Done)
    }

    /// Algorithm 8, pass.
    fn pass_buffer(&mut self, domain: DomainId, chan: ChanId, buf: BufId, meta_len: usize) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        self.check_buffer(buf)?;
        let side = self.check_endpoint(chan, domain)?;
        // Alg. 8 "Require: ep ∈ valid_ep" (bound), refined: CONNECTED
        self.check_connected(chan, domain)?;
        // Alg. 8 "Require: dir_to_ep⁻¹(ep) = (chan, SINK)"
        self.check_direction(side, SINK)?;
        // Alg. 8 "Require: buffer_ownership(buffer) = domain", refined: delivered
        if !self.is_delivered_owner(buf, domain) {
            return Err(Reject::ForeignBuffer);
        }
        // Alg. 8 "Require: (buffer, chan) ∈ buffers_to_pools ∘ pools_to_channels"
        self.check_pool_assigned(chan, side, buf)?;
        self.check_no_removal(chan, side, buf.pool)?;
        // Refinement: the buffer is READ_WRITE (no copies out)
        if self.buffer_state(buf, domain) != BufferState::ReadWrite {
            return Err(Reject::CopiesOutstanding);
        }
        self.check_meta(meta_len)?;
        // Alg. 8 "Ensure: buffer_ownership'(buffer) = ep_to_dom(other_ep)"
        let source = self.channels[chan].source;
        self.pools[buf.pool].owner[buf.index] = source;
        self.pools[buf.pool].in_flight[buf.index] = Some(chan);
        // Alg. 8 "Ensure: control_queues'(chan) = enqueue(control_queues(chan), buffer)"
        self.channels[chan].control.push_back(Msg::Pass { buf, meta_len });
        Ok(Outcome::Done)
    }

    /// An aggregate sent as one unit: Algorithms 7 and 9 per member, all
    /// preconditions first (nothing changes if one fails).
    fn send_aggregate(
        &mut self,
        domain: DomainId,
        chan: ChanId,
        members: AggMembers,
        meta_len: usize,
    ) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        let side = self.check_endpoint(chan, domain)?;
        self.check_connected(chan, domain)?;
        self.check_direction(side, SOURCE)?;
        let list: Vec<(BufId, bool)> = members.iter().flatten().copied().collect();
        for (i, &(buf, _)) in list.iter().enumerate() {
            self.check_buffer(buf)?;
            if list[..i].iter().any(|(b, _)| *b == buf) {
                return Err(Reject::InvalidArgument);
            }
            if !self.is_delivered_owner(buf, domain) && !self.holds_some_copy(buf, domain) {
                return Err(Reject::ForeignBuffer);
            }
            self.check_pool_assigned(chan, side, buf)?;
            self.check_no_removal(chan, side, buf.pool)?;
        }
        self.check_meta(meta_len)?;
        self.channels[chan].data.push_back(Msg::AggHeader { count: list.len(), meta_len });
        let sink = self.channels[chan].sink;
        for (buf, share) in list {
            let owned_rw =
                self.is_delivered_owner(buf, domain) && self.buffer_state(buf, domain) == BufferState::ReadWrite;
            if owned_rw && !share {
                self.pools[buf.pool].owner[buf.index] = sink;
                self.pools[buf.pool].in_flight[buf.index] = Some(chan);
                self.channels[chan].data.push_back(Msg::Move { buf, meta_len: 0 });
            } else {
                ms_add(&mut self.copies, (buf, chan));
                self.channels[chan].data.push_back(Msg::Copy { buf, meta_len: 0 });
            }
        }
        Ok(Outcome::Done)
    }

    /// Algorithm 9, read-only copy (also a holder forwarding its copy).
    fn copy_buffer(&mut self, domain: DomainId, chan: ChanId, buf: BufId, meta_len: usize) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        self.check_buffer(buf)?;
        let side = self.check_endpoint(chan, domain)?;
        // Alg. 9 "Require: ep ∈ valid_ep" (bound), refined: CONNECTED
        self.check_connected(chan, domain)?;
        // Alg. 9 "Require: dir_to_ep⁻¹(ep) = (chan, SOURCE)"
        self.check_direction(side, SOURCE)?;
        // Alg. 9 "Require: buffer_ownership(buffer) = domain ∨ (∃ c: (buffer, c) ∈
        // buffer_copies ∧ ep_to_dom(dir_to_ep(c, SINK)) = ep_to_dom(ep))", refined:
        // delivered owner, or holder of a delivered copy
        if !self.is_delivered_owner(buf, domain) && !self.holds_some_copy(buf, domain) {
            return Err(Reject::ForeignBuffer);
        }
        // Alg. 9 "Require: (buffer, chan) ∈ buffers_to_pools ∘ pools_to_channels"
        self.check_pool_assigned(chan, side, buf)?;
        self.check_no_removal(chan, side, buf.pool)?;
        self.check_meta(meta_len)?;
        // Alg. 9 "Ensure: buffer_copies'[{buffer}] = buffer_copies[{buffer}] ∪ {chan}"
        ms_add(&mut self.copies, (buf, chan));
        // Alg. 9 "Ensure: data_queues'(chan) = enqueue(data_queues(chan), buf)"
        self.channels[chan].data.push_back(Msg::Copy { buf, meta_len });
        Ok(Outcome::Done)
    }

    /// Algorithm 10, release of a held copy.
    fn release_copy(&mut self, domain: DomainId, chan: ChanId, buf: BufId) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        self.check_buffer(buf)?;
        let side = self.check_endpoint(chan, domain)?;
        // Alg. 10 "Require: ep ∈ valid_ep" (bound), refined: CONNECTED
        self.check_connected(chan, domain)?;
        // Alg. 10 "Require: dir_to_ep⁻¹(ep) = (chan, SINK)"
        self.check_direction(side, SINK)?;
        // Refinement: the buffer handle belongs to d (b is not INVALID at d)
        if self.buffer_state(buf, domain) == BufferState::Invalid {
            return Err(Reject::ForeignBuffer);
        }
        // Alg. 10 "Require: (buffer, chan) ∈ buffers_to_pools ∘ pools_to_channels"
        self.check_pool_assigned(chan, side, buf)?;
        self.check_no_removal(chan, side, buf.pool)?;
        // Alg. 10 "Require: (buffer, chan) ∈ buffer_copies", refined: d holds (b, c)
        let held_here = self.held_count(buf, chan);
        if held_here == 0 {
            return Err(Reject::NotCopyHolder);
        }
        // Alg. 10 "Require: copy_reachability_satisfied(buffer_copies \ {(buffer, chan)})",
        // strengthened: no forwarded copy still out, unless (b, c) is held twice
        if self.has_forwarded_copies(buf, domain) && held_here < 2 {
            return Err(Reject::CopiesForwarded);
        }
        // Refinement: held -= (b, c) at issue; copies -= (b, c) at delivery
        ms_remove(&mut self.held, (buf, chan));
        self.channels[chan].control.push_back(Msg::Release { buf });
        Ok(Outcome::Done)
    }

    /// §5.1.11, full copy: copy `src` into `dst`, then move `dst`.
    fn full_copy(
        &mut self,
        domain: DomainId,
        chan: ChanId,
        src: BufId,
        dst: BufId,
        meta_len: usize,
    ) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        self.check_buffer(src)?;
        self.check_buffer(dst)?;
        let side = self.check_endpoint(chan, domain)?;
        // Alg. 7 "Require: ep ∈ valid_ep" (bound), refined: CONNECTED
        self.check_connected(chan, domain)?;
        // Alg. 7 "Require: dir_to_ep⁻¹(ep) = (chan, SOURCE)"
        self.check_direction(side, SOURCE)?;
        // §5.1.11: the source is readable by d (delivered owner or holder)
        if !self.is_delivered_owner(src, domain) && !self.holds_some_copy(src, domain) {
            return Err(Reject::ForeignBuffer);
        }
        // Alg. 7 "Require: buffer_ownership(buffer) = domain" for the destination
        if !self.is_delivered_owner(dst, domain) {
            return Err(Reject::ForeignBuffer);
        }
        // §5.1.11: "a destination t ≠ s"
        if src == dst {
            return Err(Reject::SameBuffer);
        }
        // Alg. 7 "Require: (buffer, chan) ∈ buffers_to_pools ∘ pools_to_channels" (destination)
        self.check_pool_assigned(chan, side, dst)?;
        self.check_no_removal(chan, side, dst.pool)?;
        // §5.1.11: d owns the destination READ_WRITE
        if self.buffer_state(dst, domain) != BufferState::ReadWrite {
            return Err(Reject::CopiesOutstanding);
        }
        self.check_meta(meta_len)?;
        // The bytes of src go into dst, then dst is moved (Alg. 7).
        self.pools[dst.pool].contents[dst.index] = self.contents(src);
        let sink = self.channels[chan].sink;
        self.pools[dst.pool].owner[dst.index] = sink;
        self.pools[dst.pool].in_flight[dst.index] = Some(chan);
        self.channels[chan].data.push_back(Msg::Move { buf: dst, meta_len });
        Ok(Outcome::Done)
    }

    /// Teardown: send this side's marker.
    fn teardown(&mut self, domain: DomainId, chan: ChanId) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        let side = self.check_endpoint(chan, domain)?;
        // CONNECTED → TEARDOWN (TEARDOWN: TearingDown, CLOSED: NotConnected)
        self.check_connected(chan, domain)?;
        self.channels[chan].sides[side].sent_marker = true;
        self.outgoing_queue(chan, side).push_back(Msg::Marker);
        Ok(Outcome::Done)
    }

    /// Pop the head message of a queue and apply it at the receiving side.
    fn deliver(&mut self, chan: ChanId, queue: Queue) -> Result<Outcome, Reject> {
        self.check_channel(chan)?;
        let msg = match queue {
            Queue::Data => self.channels[chan].data.pop_front(),
            Queue::Control => self.channels[chan].control.pop_front(),
        };
        let Some(msg) = msg else {
            return Err(Reject::QueueEmpty);
        };
        let side = match queue {
            Queue::Data => SINK,
            Queue::Control => SOURCE,
        };
        let to = self.domain_of_side(chan, side);
        let event = match msg {
            Msg::AggHeader { count, meta_len } => {
                let mut members: AggMembers = [None; AGG_MAX];
                for slot in members.iter_mut().take(count) {
                    *slot = match self.channels[chan].data.pop_front() {
                        Some(Msg::Move { buf, .. }) => {
                            self.pools[buf.pool].in_flight[buf.index] = None;
                            Some((buf, true))
                        }
                        Some(Msg::Copy { buf, .. }) => {
                            ms_add(&mut self.held, (buf, chan));
                            Some((buf, false))
                        }
                        other => unreachable!("an aggregate run holds moves and copies, not {other:?}"),
                    };
                }
                Event::AggregateReceived { members, meta_len }
            }
            Msg::Move { buf, meta_len } => {
                self.pools[buf.pool].in_flight[buf.index] = None;
                Event::MoveReceived { buf, meta_len }
            }
            Msg::Pass { buf, meta_len } => {
                self.pools[buf.pool].in_flight[buf.index] = None;
                Event::BufferPassed { buf, meta_len }
            }
            Msg::Copy { buf, meta_len } => {
                ms_add(&mut self.held, (buf, chan));
                Event::CopyReceived { buf, meta_len }
            }
            Msg::Release { buf } => {
                ms_remove(&mut self.copies, (buf, chan));
                let writable = self.buffer_state(buf, to) == BufferState::ReadWrite;
                Event::CopyReleased { buf, writable }
            }
            Msg::AssignRequest { pool } => self.deliver_assign_request(chan, side, pool),
            Msg::AssignReply { pool, accepted } => self.deliver_assign_reply(chan, side, pool, accepted),
            Msg::RemoveRequest { pool } => self.deliver_remove_request(chan, side, pool),
            Msg::RemoveReply { pool, accepted } => {
                let s = &mut self.channels[chan].sides[side];
                s.remove_out.remove(&pool);
                if accepted {
                    s.assigned.remove(&pool);
                    Event::PoolRemoved { pool }
                } else {
                    Event::PoolRemoveRefused { pool }
                }
            }
            Msg::Marker => {
                self.channels[chan].sides[side].received_marker = true;
                let event = if self.channels[chan].sides[side].sent_marker {
                    Event::Closed
                } else {
                    self.channels[chan].sides[side].sent_marker = true;
                    self.outgoing_queue(chan, side).push_back(Msg::Marker);
                    Event::TeardownReceived
                };
                // Sent and received a marker: this side is CLOSED.
                self.close_side(chan, side);
                event
            }
        };
        Ok(Outcome::Delivered { to, event })
    }

    /// §5.2.3 steps 4–6: the pool enters the receiver's list, the
    /// application is asked.
    fn deliver_assign_request(&mut self, chan: ChanId, side: usize, pool: PoolId) -> Event {
        let to = self.domain_of_side(chan, side);
        // Both ends offered the same pool at once: each vetoes the other's
        // offer (its own is still out), so neither lists the pool and the two
        // ends agree; either may offer again. A side that has sent its
        // marker cannot answer at all.
        let s = &self.channels[chan].sides[side];
        if s.assign_out.contains(&pool) && !s.sent_marker {
            self.outgoing_queue(chan, side).push_back(Msg::AssignReply { pool, accepted: false });
            return Event::PoolVetoed { pool };
        }
        self.pool_lists[to].entry(pool).or_insert(false);
        self.channels[chan].sides[side].assign_in.insert(pool);
        Event::PoolAssignRequest { pool }
    }

    /// §5.2.3 steps 8–9: the assigner learns the outcome.
    fn deliver_assign_reply(&mut self, chan: ChanId, side: usize, pool: PoolId, accepted: bool) -> Event {
        let to = self.domain_of_side(chan, side);
        self.channels[chan].sides[side].assign_out.remove(&pool);
        if accepted {
            self.channels[chan].sides[side].assigned.insert(pool);
            self.pool_lists[to].insert(pool, true);
            self.pools[pool].ever_accepted = true;
            Event::PoolAssigned { pool }
        } else {
            // "the assigner's pool returns to UNINITIALIZED trust if no channel
            // has it" — and it was never accepted anywhere: once accepted, the
            // trust level is fixed for good (docs/SEMANTICS.md, assign pool).
            if !self.pools[pool].ever_accepted && !self.pool_on_some_channel(pool) {
                self.pools[pool].trust = Trust::Uninitialized;
            }
            Event::PoolVetoed { pool }
        }
    }

    /// Removal, phase two at the peer: it checks for itself and answers.
    fn deliver_remove_request(&mut self, chan: ChanId, side: usize, pool: PoolId) -> Event {
        // A side that has sent its marker sends nothing more: no answer.
        if self.channels[chan].sides[side].sent_marker {
            return Event::PoolRemoveRequest { pool, accepted: false };
        }
        let accepted = !self.pool_in_use(chan, side, pool);
        if accepted {
            self.channels[chan].sides[side].assigned.remove(&pool);
        }
        self.outgoing_queue(chan, side).push_back(Msg::RemoveReply { pool, accepted });
        Event::PoolRemoveRequest { pool, accepted }
    }

    // ------------------------------------------------------------------
    // Invariants.

    /// Check every refined invariant of SEMANTICS.md (numbered as there),
    /// plus the model's own bookkeeping invariants (numbered 7 and up).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_inv1_ownership()?;
        self.check_inv2_to_4_states()?;
        self.check_inv5_reachability()?;
        self.check_inv6_held_within_copies()?;
        self.check_inv7_copies_need_assignment()?;
        self.check_inv8_pool_lists()?;
        self.check_inv9_teardown()?;
        self.check_inv10_requests()?;
        Ok(())
    }

    /// Every message of every queue, as `(chan, queue, msg)`.
    fn all_messages(&self) -> Vec<(ChanId, Queue, Msg)> {
        let mut out = Vec::new();
        for (chan, ch) in self.channels.iter().enumerate() {
            for m in &ch.data {
                out.push((chan, Queue::Data, *m));
            }
            for m in &ch.control {
                out.push((chan, Queue::Control, *m));
            }
        }
        out
    }

    /// 1. One owner per buffer; a buffer in flight is in exactly one queue,
    ///    as exactly one move/pass message, heading to its owner.
    fn check_inv1_ownership(&self) -> Result<(), String> {
        let messages = self.all_messages();
        for buf in self.all_buffers() {
            let owner = self.owner(buf);
            if owner >= self.domains {
                return Err(format!("inv 1: {buf:?} owned by unknown domain {owner}"));
            }
            let transfers: Vec<(ChanId, Queue)> = messages
                .iter()
                .filter(|(_, _, m)| match m {
                    Msg::Move { buf: b, .. } | Msg::Pass { buf: b, .. } => *b == buf,
                    _ => false,
                })
                .map(|&(c, q, _)| (c, q))
                .collect();
            match self.in_flight(buf) {
                None => {
                    if !transfers.is_empty() {
                        return Err(format!("inv 1: {buf:?} is delivered but has move/pass messages in {transfers:?}"));
                    }
                }
                Some(chan) => {
                    let want_queue = if owner == self.channels[chan].sink {
                        Queue::Data
                    } else if owner == self.channels[chan].source {
                        Queue::Control
                    } else {
                        return Err(format!(
                            "inv 1: {buf:?} in flight on channel {chan} but owner {owner} is no endpoint"
                        ));
                    };
                    if transfers != vec![(chan, want_queue)] {
                        return Err(format!(
                            "inv 1: {buf:?} in flight on {chan} to {owner}: expected one message in \
                             {want_queue:?}, found {transfers:?}"
                        ));
                    }
                    if self.has_copies(buf) {
                        return Err(format!("inv 1: {buf:?} in flight while copies exist"));
                    }
                }
            }
        }
        Ok(())
    }

    /// 2–4. The state function against its definition.
    fn check_inv2_to_4_states(&self) -> Result<(), String> {
        for buf in self.all_buffers() {
            let delivered = self.in_flight(buf).is_none();
            let copied = self.copies.keys().any(|(b, _)| *b == buf);
            for d in 0..self.domains {
                let state = self.buffer_state(buf, d);
                let owns = self.owner(buf) == d && delivered;
                let holds = self.held.keys().any(|(b, c)| *b == buf && self.channels[*c].sink == d);
                let rw = owns && !copied;
                let ro = (owns && copied) || holds;
                if (state == BufferState::ReadWrite) != rw {
                    return Err(format!("inv 2: {buf:?} at domain {d} is {state:?}, READ_WRITE condition is {rw}"));
                }
                let readable = matches!(state, BufferState::ReadOnly | BufferState::ReadOnlyOwned);
                if readable != ro {
                    return Err(format!("inv 3: {buf:?} at domain {d} is {state:?}, READ_ONLY condition is {ro}"));
                }
                if (state == BufferState::Invalid) != (!rw && !ro) {
                    return Err(format!("inv 4: {buf:?} at domain {d} is {state:?}"));
                }
                if state == BufferState::ReadOnlyOwned && !owns {
                    return Err(format!("inv 3: {buf:?} READ_ONLY_OWNED at non-owner {d}"));
                }
            }
        }
        Ok(())
    }

    /// 5. Every `(b, c)` in `copies` is reachable from `owner(b)` along copy edges.
    fn check_inv5_reachability(&self) -> Result<(), String> {
        for buf in self.all_buffers() {
            let edges: Vec<ChanId> = self.copies.keys().filter(|(b, _)| *b == buf).map(|&(_, c)| c).collect();
            let mut reached: BTreeSet<DomainId> = BTreeSet::new();
            reached.insert(self.owner(buf));
            loop {
                let before = reached.len();
                for &c in &edges {
                    if reached.contains(&self.channels[c].source) {
                        reached.insert(self.channels[c].sink);
                    }
                }
                if reached.len() == before {
                    break;
                }
            }
            for &c in &edges {
                if !reached.contains(&self.channels[c].source) {
                    return Err(format!(
                        "inv 5: copy of {buf:?} on channel {c} ({} -> {}) is not reachable from owner {}; \
                         copies of it: {edges:?}",
                        self.channels[c].source,
                        self.channels[c].sink,
                        self.owner(buf)
                    ));
                }
            }
        }
        Ok(())
    }

    /// 6. `held ≤ copies`; exactly: copies(b,c) = copy messages in data(c) +
    ///    held(b,c) + release messages in control(c).
    fn check_inv6_held_within_copies(&self) -> Result<(), String> {
        for (&(buf, chan), &n) in &self.held {
            if n == 0 || !self.buffer_exists(buf) || chan >= self.channels.len() {
                return Err(format!("inv 6: bad held entry {:?} x{n}", (buf, chan)));
            }
        }
        for (&(buf, chan), &n) in &self.copies {
            if n == 0 || !self.buffer_exists(buf) || chan >= self.channels.len() {
                return Err(format!("inv 6: bad copies entry {:?} x{n}", (buf, chan)));
            }
        }
        let mut keys: BTreeSet<(BufId, ChanId)> = self.copies.keys().copied().collect();
        keys.extend(self.held.keys().copied());
        for (chan, q, m) in self.all_messages() {
            match (q, m) {
                (Queue::Data, Msg::Copy { buf, .. }) | (Queue::Control, Msg::Release { buf }) => {
                    keys.insert((buf, chan));
                }
                _ => {}
            }
        }
        for (buf, chan) in keys {
            let copies = self.copies_count(buf, chan);
            let held = self.held_count(buf, chan);
            let ch = &self.channels[chan];
            let in_copy = ch.data.iter().filter(|m| matches!(m, Msg::Copy { buf: b, .. } if *b == buf)).count();
            let in_release = ch.control.iter().filter(|m| matches!(m, Msg::Release { buf: b } if *b == buf)).count();
            if held > copies || copies != in_copy + held + in_release {
                return Err(format!(
                    "inv 6: ({buf:?}, chan {chan}): copies {copies}, held {held}, copy messages {in_copy}, \
                     release messages {in_release}"
                ));
            }
        }
        Ok(())
    }

    /// 7 (model). A copy out over `c` keeps its pool on the source side of
    /// `c`; a held copy keeps it on the sink side (until that side closes).
    fn check_inv7_copies_need_assignment(&self) -> Result<(), String> {
        let closed = |chan: ChanId, side: usize| {
            let s = &self.channels[chan].sides[side];
            s.sent_marker && s.received_marker
        };
        for &(buf, chan) in self.copies.keys() {
            if closed(chan, SOURCE) {
                continue;
            }
            if !self.channels[chan].sides[SOURCE].assigned.contains(&buf.pool) {
                return Err(format!("inv 7: copy of {buf:?} out on {chan} but its pool is not on the source side"));
            }
        }
        for &(buf, chan) in self.held.keys() {
            if closed(chan, SINK) {
                continue;
            }
            if !self.channels[chan].sides[SINK].assigned.contains(&buf.pool) {
                return Err(format!("inv 7: copy of {buf:?} held on {chan} but its pool is not on the sink side"));
            }
        }
        Ok(())
    }

    /// 8 (model). Domain pool lists and trust: every pool a domain uses is in
    /// its list; listed pools are permanent; a pool on a channel has the
    /// channel's trust.
    fn check_inv8_pool_lists(&self) -> Result<(), String> {
        for (pool, p) in self.pools.iter().enumerate() {
            if self.pool_lists[p.creator].get(&pool) != Some(&true) {
                return Err(format!("inv 8: creator {} lost pool {pool}", p.creator));
            }
        }
        for buf in self.all_buffers() {
            let owner = self.owner(buf);
            if !self.knows_pool(owner, buf.pool) {
                return Err(format!("inv 8: owner {owner} of {buf:?} does not know its pool"));
            }
        }
        for &(buf, chan) in self.held.keys() {
            let holder = self.channels[chan].sink;
            if !self.knows_pool(holder, buf.pool) {
                return Err(format!("inv 8: holder {holder} of {buf:?} does not know its pool"));
            }
        }
        for (chan, ch) in self.channels.iter().enumerate() {
            for side in [SOURCE, SINK] {
                let d = self.domain_of_side(chan, side);
                let s = &ch.sides[side];
                for &pool in &s.assigned {
                    if self.pool_lists[d].get(&pool) != Some(&true) {
                        return Err(format!(
                            "inv 8: pool {pool} on side {side} of {chan} is not permanent in {d}'s list"
                        ));
                    }
                }
                for &pool in s.assign_out.iter().chain(&s.assign_in) {
                    if !self.knows_pool(d, pool) {
                        return Err(format!("inv 8: pool {pool} requested on {chan} unknown to {d}"));
                    }
                }
                let live_requests = s.assign_in.iter().filter(|_| !s.sent_marker);
                for &pool in s.assigned.iter().chain(&s.assign_out).chain(live_requests) {
                    if self.pools[pool].trust != ch.trust {
                        return Err(format!(
                            "inv 8: pool {pool} has trust {:?} but is on channel {chan} of trust {:?}",
                            self.pools[pool].trust, ch.trust
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// 9 (model). Teardown markers: at most one per queue, last in it;
    /// a side received a marker only if the peer sent one, and answered it.
    fn check_inv9_teardown(&self) -> Result<(), String> {
        for (chan, ch) in self.channels.iter().enumerate() {
            for (side, queue) in [(SOURCE, &ch.data), (SINK, &ch.control)] {
                let markers = queue.iter().filter(|m| **m == Msg::Marker).count();
                if markers > 1 || (markers == 1 && queue.back() != Some(&Msg::Marker)) {
                    return Err(format!("inv 9: channel {chan} side {side}: marker not alone at the tail: {queue:?}"));
                }
                let s = &ch.sides[side];
                let peer = &ch.sides[1 - side];
                if (markers == 1) && !s.sent_marker {
                    return Err(format!("inv 9: channel {chan} side {side}: marker queued but not sent"));
                }
                if s.sent_marker && markers == 0 && !peer.received_marker {
                    return Err(format!("inv 9: channel {chan} side {side}: marker sent but lost"));
                }
                if peer.received_marker && (!s.sent_marker || markers != 0) {
                    return Err(format!("inv 9: channel {chan} side {}: received a marker not sent", 1 - side));
                }
                if s.received_marker && !s.sent_marker {
                    return Err(format!("inv 9: channel {chan} side {side}: received a marker without answering"));
                }
            }
        }
        Ok(())
    }

    /// 10 (model). Each pending request is in exactly one place: request
    /// in flight, delivered and unanswered, or reply in flight.
    fn check_inv10_requests(&self) -> Result<(), String> {
        for (chan, ch) in self.channels.iter().enumerate() {
            // Once either side is CLOSED its requests are gone, and the
            // peer's requests can no longer be answered: nothing to match.
            if ch.sides.iter().any(|s| s.sent_marker && s.received_marker) {
                continue;
            }
            for side in [SOURCE, SINK] {
                let (out_q, back_q) = if side == SOURCE { (&ch.data, &ch.control) } else { (&ch.control, &ch.data) };
                let s = &ch.sides[side];
                let peer = &ch.sides[1 - side];
                for &pool in &s.assign_out {
                    let requests = out_q.iter().filter(|m| **m == Msg::AssignRequest { pool }).count();
                    let replies =
                        back_q.iter().filter(|m| matches!(m, Msg::AssignReply { pool: p, .. } if *p == pool)).count();
                    let waiting = usize::from(peer.assign_in.contains(&pool));
                    if requests + replies + waiting != 1 {
                        return Err(format!(
                            "inv 10: assignment of {pool} on {chan} by side {side}: {requests} requests, \
                             {waiting} waiting, {replies} replies"
                        ));
                    }
                }
                for &pool in &s.remove_out {
                    let requests = out_q.iter().filter(|m| **m == Msg::RemoveRequest { pool }).count();
                    let replies =
                        back_q.iter().filter(|m| matches!(m, Msg::RemoveReply { pool: p, .. } if *p == pool)).count();
                    let swallowed = usize::from(peer.sent_marker);
                    if requests + replies > 1 || requests + replies + swallowed == 0 {
                        return Err(format!(
                            "inv 10: removal of {pool} on {chan} by side {side}: {requests} requests, {replies} replies"
                        ));
                    }
                }
                // No stray messages: every request/reply belongs to a pending entry.
                for m in out_q {
                    match *m {
                        Msg::AssignRequest { pool } if !s.assign_out.contains(&pool) => {
                            return Err(format!("inv 10: stray assignment request {pool} on {chan}"));
                        }
                        Msg::RemoveRequest { pool } if !s.remove_out.contains(&pool) => {
                            return Err(format!("inv 10: stray removal request {pool} on {chan}"));
                        }
                        Msg::AssignReply { pool, .. } if !peer.assign_out.contains(&pool) => {
                            return Err(format!("inv 10: stray assignment reply {pool} on {chan}"));
                        }
                        Msg::RemoveReply { pool, .. } if !peer.remove_out.contains(&pool) => {
                            return Err(format!("inv 10: stray removal reply {pool} on {chan}"));
                        }
                        _ => {}
                    }
                }
            }
        }
        Ok(())
    }
}
