//! Channels: create/bind with negotiation, pool assignment, and the buffer
//! operations of [ETH-BT] (Algorithms 3–10), whatever backend carries them.
//!
//! Each operation checks its preconditions in the order given in
//! `docs/SEMANTICS.md` and fails with the first failing check before touching
//! anything; on success the library changes the buffer states (in
//! [`crate::domain`]) and hands one message to the backend. Arrivals are
//! reported by [`Channel::poll`] as [`Event`]s, one per message.
//!
//! This file holds the channel end itself, its creation and its queries;
//! the rest is one concern per file: `send` (the operations and their
//! checks), `receive` (polling, delivery, the payload gate), `pools`
//! (assignment and removal), `close` (teardown, drop, a dead peer) and
//! `connect` (the waiting helpers).

use crate::ErrorKind;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use crate::aggregate::{Aggregate, Held};
use crate::backend::{Endpoint, Link, Pending};
use crate::buffer::{Buffer, BufferCopy, BufferId, Spares};
use crate::domain::{ChanKey, Domain, LentSet};
use crate::error::{Error, Result, ResultExt};
use crate::inspect::{ChanEntry, ChannelStats};
use crate::pool::{Geometry, PoolId, TrustLevel};
use crate::proto::{AggRun, Message, Meta, MAX_META_SIZE};
use crate::setup::{BindParams, ChannelConstraints, ChannelLimits, ChannelSetup, ChannelState, Direction, Role};
use crate::wake::WakeSet;

mod close;
mod connect;
#[cfg(all(test, not(loom)))]
mod layout_tests;
mod pools;
mod receive;
mod send;
pub use connect::PoolPolicy;
#[cfg(feature = "tokio")]
pub(crate) use connect::RETRY_MAX;

/// A pool-assignment request from the peer, waiting for
/// [`Channel::respond_pool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolRequest {
    /// The pool.
    pub pool: PoolId,
    /// Its shape.
    pub geometry: Geometry,
    /// Its trust level (the channel's).
    pub trust: TrustLevel,
}

/// Something that happened on a channel, taken with [`Channel::poll`] or
/// [`Channel::wait`]. Events that bring a buffer or a copy hand over its
/// handle: dropping the event gives the buffer back to its domain's free
/// list, or releases the copy.
///
/// ```
/// use ferry::{Channel, Event};
///
/// /// A sink's loop body: check and return what arrives.
/// fn serve(rx: &mut Channel) -> Result<bool, Box<dyn std::error::Error>> {
///     match rx.wait(Some(std::time::Duration::from_secs(10))) {
///         Ok(Event::MoveReceived { buffer, meta }) => rx.pass(buffer, &meta)?,
///         Ok(Event::CopyReceived { copy, .. }) => rx.release(copy)?,
///         Ok(Event::PoolAssignRequest(req)) => rx.respond_pool(req.pool, true)?,
///         Ok(Event::Closed { .. }) => return Ok(false),
///         Ok(Event::Error(e)) => return Err(e.into()),
///         Ok(_) => {}
///         Err(_) => return Err("timed out".into()),
///     }
///     Ok(true)
/// }
/// ```
#[derive(Debug)]
pub enum Event {
    /// Creator: a binder connected; the channel is now connected.
    BindRequest {
        /// The role the binder ended up with.
        binder_role: Role,
    },
    /// Binder: the creator accepted; the channel is now connected.
    Bound,
    /// The peer wants to assign a pool: answer with
    /// [`Channel::respond_pool`].
    PoolAssignRequest(PoolRequest),
    /// A pool is assigned to the channel (our request was accepted).
    PoolAssigned(PoolId),
    /// Our assignment was vetoed by the peer (or by this library, when the
    /// peer's pool does not meet the channel's constraints).
    PoolVetoed(PoolId),
    /// A pool was removed from the channel (at either end's request).
    PoolRemoved(PoolId),
    /// A removal was refused because copies were still out.
    PoolRemoveRefused(PoolId),
    /// A buffer was moved to us (we own it now).
    MoveReceived {
        /// The buffer.
        buffer: Buffer,
        /// Its meta data.
        meta: Meta,
    },
    /// A buffer was passed back to us (we own it now).
    BufferPassed {
        /// The buffer.
        buffer: Buffer,
        /// Its meta data.
        meta: Meta,
    },
    /// A read-only copy arrived.
    CopyReceived {
        /// The copy.
        copy: BufferCopy,
        /// Its meta data.
        meta: Meta,
    },
    /// A copy we sent came back.
    CopyReleased {
        /// Which buffer.
        buffer: BufferId,
        /// Whether it is read-write for us again (all copies are back).
        writable: bool,
    },
    /// The channel is closed after a teardown.
    Closed {
        /// Whether the peer started the teardown.
        by_peer: bool,
    },
    /// The channel failed (peer gone, protocol violation, bind refused);
    /// it is closed.
    Error(Error),
    /// An aggregate arrived ([`Channel::send_aggregate`]): its buffers
    /// moved to us (the aggregate holds them, read-only, as this domain's
    /// own) or copied to us (released when the last fragment that refers to
    /// them is dropped), one event for the whole.
    Aggregate {
        /// The aggregate: the sender's fragments, over our handles.
        agg: Aggregate,
        /// Its meta data.
        meta: Meta,
    },
    /// The library vetoed the peer's offer of a pool by itself, because
    /// taking it would pass one of the channel's [`ChannelLimits`]
    /// (`reason`: [`ErrorKind::LimitExceeded`]). The peer sees a veto; the
    /// channel goes on.
    PoolOfferRefused {
        /// The pool offered.
        pool: PoolId,
        /// Why it was refused.
        reason: Error,
    },
}

/// One pool as this end of the channel sees it. Each end keeps its own
/// view (the two ends learn of accepts and removals at different times).
#[derive(Debug)]
struct ChanPool {
    id: PoolId,
    /// Assigned to the channel on our side: buffers may travel.
    listed: bool,
    /// Our assignment request is out, no reply yet.
    assigning: bool,
    /// Our removal request is out, no reply yet.
    removing: bool,
    /// Listed because we accepted the peer's offer (counts against the
    /// channel's [`ChannelLimits`]).
    by_peer: bool,
}

/// One end of a channel, owned by a domain.
///
/// A channel end is used from one thread at a time (`Send`, not `Sync`).
///
/// One end creates the channel on an [`Endpoint`], the other binds to it;
/// once connected, a pool is assigned, then the source (TX end) moves or
/// copies buffers and the sink (RX end) passes or releases them. The
/// helpers [`Channel::accept`], [`Channel::connect`] and
/// [`Channel::assign_pool_and_wait`] are the short way there; the
/// explicit steps are [`create`](Channel::create)/[`bind`](Channel::bind),
/// the [`Event::BindRequest`]/[`Event::Bound`] events,
/// [`assign_pool`](Channel::assign_pool) and
/// [`respond_pool`](Channel::respond_pool).
///
/// ```
/// use std::time::Duration;
/// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};
///
/// let t = Duration::from_secs(10);
/// let ep = Endpoint::local();
/// let sink = {
///     let ep = ep.clone();
///     std::thread::spawn(move || -> ferry::Result<Vec<u8>> {
///         let mut rx = Channel::connect(&Domain::new("sink"), &ep, BindParams::default(), t)?;
///         rx.set_pool_policy(PoolPolicy::AcceptAll);
///         loop {
///             match rx.wait(Some(t)) {
///                 Ok(Event::MoveReceived { buffer, .. }) => {
///                     let got = buffer[..5].to_vec();
///                     rx.pass(buffer, &[]).map_err(|r| r.error)?;
///                     return Ok(got);
///                 }
///                 other => panic!("{other:?}"),
///             }
///         }
///     })
/// };
/// let app = Domain::new("app");
/// let mut tx = Channel::accept(&app, &ep, ChannelSetup::default(), t)?;
/// let alloc = Allocator::new(&app, 8, 4096, PoolConstraints::default())?;
/// tx.assign_pool_and_wait(alloc.pool(), t)?;
/// let mut buf = alloc.alloc().unwrap();
/// buf.as_mut_slice()?[..5].copy_from_slice(b"hello");
/// tx.move_buffer(buf, &[])?;
/// assert!(matches!(tx.wait(Some(t)), Ok(Event::BufferPassed { .. })));
/// assert_eq!(sink.join().unwrap()?, b"hello");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Channel {
    domain: Domain,
    /// `the channel of domain "app" on the TCP endpoint 127.0.0.1:7000`,
    /// for the context of errors.
    name: Box<str>,
    key: ChanKey,
    state: ChannelState,
    direction: Direction,
    role: Role,
    trust: TrustLevel,
    meta_size: usize,
    constraints: ChannelConstraints,
    /// What the peer may make us take on.
    limits: ChannelLimits,
    /// How we got here, until connected.
    pending: Option<Pending>,
    link: Option<Box<dyn Link>>,
    pools: Vec<ChanPool>,
    /// Delivered assignment requests not answered yet.
    requests: Vec<PoolRequest>,
    /// Replies generated while delivering, waiting for queue space.
    outbox: VecDeque<Message>,
    sent_teardown: bool,
    got_teardown: bool,
    /// Buffers moved or passed to a peer that can die, not back yet: if the
    /// peer process exits they return to us.
    lent: Option<LentSet>,
    /// Both ends are this domain's, over a local link, at trust FULL: a
    /// buffer moved or passed between them never leaves the domain, so the
    /// domain's records of it do not change (it stays owned, read-write,
    /// while in the queue, and its handle's references travel as spares).
    /// Neither end takes the domain's lock for it, so the two threads of
    /// such a channel share no line but the queue's. Copies and aggregates
    /// keep the domain's accounting (read-only states, releases).
    same_domain: bool,
    /// References of the buffer handles we gave away, for those we receive.
    spares: Spares,
    /// The dropped copies a flush works on, kept for the next flush (no
    /// allocation per flush).
    deferred: Vec<(BufferId, send::Deferred)>,
    /// The pool policy and the events the waiting helpers took (connect.rs).
    helpers: connect::Helpers,
    /// Everything that wakes this end, behind the one fd of
    /// [`AsFd`](std::os::fd::AsFd).
    wake: WakeSet,
    /// How long [`wait`](Channel::wait) busy-polls before it sleeps.
    spin: Duration,
    /// A send was refused for a full queue and no arm has reported room
    /// since: room that came before the arm wakes nobody, so arm says so.
    room_refused: bool,
    /// The slots in a row the last refused send needed (1, or an
    /// aggregate's run).
    room_needed: usize,
    /// An aggregate run being received: its header is in, not all of its
    /// slots yet.
    assembling: Option<Assembly>,
    /// Counters and description, shared with the inspection registry.
    inspect: Arc<ChanEntry>,
}

/// An aggregate run in the middle of its arrival: the checks so far and
/// the member handles taken in (dropped with it if the run goes wrong:
/// moved buffers are ours and go to the free list, copies are released).
struct Assembly {
    run: AggRun,
    held: Vec<Held>,
}

/// How long [`Channel::wait`] busy-polls before it sleeps, unless told
/// otherwise ([`Channel::set_spin`]). A cross-core wake-up costs tens of
/// microseconds on the machines measured (BENCHMARKS.md), so spinning for a
/// fraction of that keeps a busy channel off the slow path.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("domain", &self.domain.name())
            .field("state", &self.state)
            .field("direction", &self.direction)
            .field("role", &self.role)
            .field("trust", &self.trust)
            .finish()
    }
}

impl Channel {
    /// Create a channel on a local endpoint and wait for a binder
    /// ([ETH-BT] Algorithm 3). The result is `INITIALIZED`; [`poll`] it to
    /// accept a bind ([`Event::BindRequest`]), or
    /// [`wait_connected`](Channel::wait_connected).
    ///
    /// ```
    /// use ferry::{BindParams, Channel, ChannelSetup, ChannelState, Domain, Endpoint, Event};
    /// let ep = Endpoint::local();
    /// let mut tx = Channel::create(&Domain::new("a"), &ep, ChannelSetup::default())?;
    /// assert_eq!(tx.state(), ChannelState::Initialized);
    /// let mut rx = Channel::bind(&Domain::new("b"), &ep, BindParams::default())?;
    /// assert!(matches!(tx.poll(), Some(Event::BindRequest { .. })));
    /// assert_eq!(tx.state(), ChannelState::Connected);
    /// # Ok::<(), ferry::Error>(())
    /// ```
    ///
    /// [`poll`]: Channel::poll
    pub fn create(domain: &Domain, endpoint: &Endpoint, setup: ChannelSetup) -> Result<Channel> {
        Channel::create_bare(domain, endpoint, setup).context(|| format!("create a channel on {endpoint}"))
    }

    /// [`Channel::create`], its errors without context.
    pub(crate) fn create_bare(domain: &Domain, endpoint: &Endpoint, setup: ChannelSetup) -> Result<Channel> {
        if setup.trust == TrustLevel::Uninitialized {
            return Err(ErrorKind::InvalidArgument("a channel's trust level cannot be UNINITIALIZED").into());
        }
        if setup.meta_size > MAX_META_SIZE {
            return Err(ErrorKind::MetaTooLarge { len: setup.meta_size, max: MAX_META_SIZE }.into());
        }
        if !setup.queue_depth.is_power_of_two() || !(2..=65536).contains(&setup.queue_depth) {
            return Err(ErrorKind::InvalidArgument("queue depth must be a power of two in 2..=65536").into());
        }
        if setup.constraints.alignment != 0 && !setup.constraints.alignment.is_power_of_two() {
            return Err(ErrorKind::BadAlignment(setup.constraints.alignment).into());
        }
        let wake = WakeSet::new()?;
        let pending = endpoint.listen(&setup, domain.id())?;
        let mut ch = Channel::new(domain, endpoint, ChannelState::Initialized, pending, wake);
        ch.direction = setup.direction;
        ch.role = setup.role;
        ch.trust = setup.trust;
        ch.meta_size = setup.meta_size;
        ch.constraints = setup.constraints;
        ch.limits = setup.limits;
        Ok(ch)
    }

    /// Bind to a channel created on `endpoint` ([ETH-BT] Algorithm 4). The
    /// result is `BINDING`; [`poll`](Channel::poll) it until
    /// [`Event::Bound`] (or an error event). [`ErrorKind::EndpointNotListening`]
    /// at once if nobody created a channel there
    /// ([`Channel::connect`] retries).
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, Error, ErrorKind, Event};
    /// let ep = Endpoint::local();
    /// assert_eq!(Channel::bind(&Domain::new("b"), &ep, BindParams::default()).unwrap_err(), ErrorKind::EndpointNotListening);
    /// let mut tx = Channel::create(&Domain::new("a"), &ep, ChannelSetup::default())?;
    /// let mut rx = Channel::bind(&Domain::new("b"), &ep, BindParams::default())?;
    /// tx.poll(); // the creator accepts
    /// assert!(matches!(rx.wait(Some(Duration::from_secs(10))), Ok(Event::Bound)));
    /// assert_eq!(rx.direction(), Direction::Rx); // the opposite of the creator's
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn bind(domain: &Domain, endpoint: &Endpoint, params: BindParams) -> Result<Channel> {
        Channel::bind_bare(domain, endpoint, params).context(|| format!("bind to {endpoint}"))
    }

    /// [`Channel::bind`], its errors without context.
    pub(crate) fn bind_bare(domain: &Domain, endpoint: &Endpoint, params: BindParams) -> Result<Channel> {
        if params.constraints.alignment != 0 && !params.constraints.alignment.is_power_of_two() {
            return Err(ErrorKind::BadAlignment(params.constraints.alignment).into());
        }
        let wake = WakeSet::new()?;
        let pending = endpoint.connect(&params, domain.id())?;
        let mut ch = Channel::new(domain, endpoint, ChannelState::Binding, pending, wake);
        ch.limits = params.limits;
        Ok(ch)
    }

    fn new(domain: &Domain, endpoint: &Endpoint, state: ChannelState, pending: Pending, wake: WakeSet) -> Channel {
        let key = domain.new_chan_key();
        let (backend, described) = endpoint.describe();
        let inspect = Arc::new(ChanEntry::new(domain.id(), key, backend, described, state));
        crate::inspect::register_channel(&inspect);
        Channel {
            domain: domain.clone(),
            name: format!("the channel of domain {:?} on {endpoint}", domain.name()).into(),
            key,
            state,
            direction: Direction::Tx,
            role: Role::Generic,
            trust: TrustLevel::Uninitialized,
            meta_size: 0,
            constraints: ChannelConstraints::default(),
            limits: ChannelLimits::default(),
            pending: Some(pending),
            link: None,
            pools: Vec::new(),
            requests: Vec::new(),
            outbox: VecDeque::new(),
            sent_teardown: false,
            got_teardown: false,
            lent: None,
            same_domain: false,
            spares: Spares::default(),
            deferred: Vec::new(),
            helpers: connect::Helpers::default(),
            wake,
            spin: DEFAULT_SPIN,
            room_refused: false,
            room_needed: 1,
            assembling: None,
            inspect,
        }
    }

    /// Current state.
    pub fn state(&self) -> ChannelState {
        self.state
    }

    /// Local direction (meaningful once connected).
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// Local role (meaningful once connected).
    pub fn role(&self) -> Role {
        self.role
    }

    /// Trust level.
    pub fn trust(&self) -> TrustLevel {
        self.trust
    }

    /// Meta size in bytes.
    pub fn meta_size(&self) -> usize {
        self.meta_size
    }

    /// Negotiated pool constraints.
    pub fn constraints(&self) -> ChannelConstraints {
        self.constraints
    }

    /// The domain this end belongs to.
    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    /// Whether `pool` is assigned to this channel (on this end's side).
    pub fn is_assigned(&self, pool: PoolId) -> bool {
        self.pools.iter().any(|p| p.id == pool && p.listed)
    }

    /// The address a channel being created on a TCP endpoint listens on
    /// (the port the kernel chose when the endpoint said port 0); `None`
    /// for other endpoints and once a binder is connected.
    pub fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        self.pending.as_ref().and_then(|p| p.listen_addr())
    }

    /// Transfer counters of the backend, where it keeps them (the TCP
    /// backend: frames, payload bytes straight from and into buffers,
    /// payload bytes staged in user space, system calls).
    pub fn link_stats(&self) -> Option<crate::LinkStats> {
        self.link.as_ref().and_then(|l| l.stats())
    }

    /// This end's counters: operations sent and received by kind, bytes,
    /// queue depth, full queues, wake-ups, errors (docs/INSPECT.md). The
    /// same numbers `ferry inspect` shows from outside the process.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use ferry::*;
    /// # let t = Duration::from_secs(10);
    /// # let (a, b) = (Domain::new("a"), Domain::new("b"));
    /// # let ep = Endpoint::local();
    /// # let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    /// # let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    /// # tx.wait_connected(t)?;
    /// # rx.wait_connected(t)?;
    /// # rx.set_pool_policy(PoolPolicy::AcceptAll);
    /// # let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// # tx.assign_pool(alloc.pool())?;
    /// # rx.poll();
    /// # tx.poll();
    /// // `tx` (source) and `rx` (sink): a connected channel, `alloc`'s pool assigned.
    /// tx.move_buffer(alloc.alloc().unwrap(), &[])?;
    /// let Ok(Event::MoveReceived { .. }) = rx.wait(Some(t)) else { panic!() };
    /// assert_eq!((tx.stats().sent.moves, tx.stats().bytes_sent), (1, 4096));
    /// assert_eq!((rx.stats().received.moves, rx.stats().bytes_received), (1, 4096));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stats(&self) -> ChannelStats {
        self.inspect.counters.snapshot()
    }

    /// Pool-assignment requests waiting for an answer.
    pub fn pending_requests(&self) -> &[PoolRequest] {
        &self.requests
    }

    /// How long [`wait`](Channel::wait) busy-polls before it sleeps
    /// ([`DEFAULT_SPIN`] unless set). Zero: sleep at once (saves a core
    /// when latency matters less than CPU time).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// How long [`wait`](Channel::wait) busy-polls before it sleeps.
    pub fn spin(&self) -> Duration {
        self.spin
    }

    /// The memory this end writes for every message, named (address,
    /// length): its link's, its domain's lock and reference counts, its
    /// counters.
    #[cfg(test)]
    pub(crate) fn private_memory(&self) -> Vec<(&'static str, usize, usize)> {
        let mut all: Vec<_> = self.link.iter().flat_map(|l| l.private_memory()).map(|(a, n)| ("link", a, n)).collect();
        // The Arc's counts sit just before the value.
        let domain = Arc::as_ptr(&self.domain.shared) as usize;
        let counts = 2 * std::mem::size_of::<usize>();
        all.push(("domain", domain - counts, counts + std::mem::size_of::<crate::domain::DomainShared>()));
        all.push(("counters", &self.inspect.counters as *const _ as usize, 64));
        all
    }

    fn link_mut(&mut self) -> &mut dyn Link {
        self.link.as_deref_mut().expect("connected channel has a link")
    }
}

/// The channel end's fd: readable when an event may be waiting, once the
/// channel is armed ([`Channel::arm`], which says how to use it). The same
/// fd for the channel's whole life, whatever its backend and state.
impl std::os::fd::AsFd for Channel {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.wake.as_fd()
    }
}
