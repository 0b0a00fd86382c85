//! Channels: create/bind with negotiation, pool assignment, and the buffer
//! operations of [ETH-BT] (Algorithms 3–10), whatever backend carries them.
//!
//! Each operation checks its preconditions in the order given in
//! `docs/SEMANTICS.md` and fails with the first failing check before touching
//! anything; on success the library changes the buffer states (in
//! [`crate::domain`]) and hands one message to the backend. Arrivals are
//! reported by [`Channel::poll`] as [`Event`]s, one per message.

use crate::ErrorKind;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::aggregate::{Aggregate, Held};
use crate::backend::{Endpoint, Landing, Link, PayloadGate, Pending};
use crate::buffer::{Buffer, BufferCopy, BufferId, BufferState, CopySource, Spares};
use crate::domain::Pool;
use crate::domain::{ChanKey, Domain, DomainState, LentSet};
use crate::error::{Error, Refused, Result, ResultExt, WaitError};
use crate::inspect::{ChanEntry, ChannelStats, Op};
use crate::pool::{Geometry, PoolId, PoolView, TrustLevel};
use crate::proto::{self, AggRun, FragEntry, Message, Meta, MAX_META_SIZE};
use crate::setup::{BindParams, ChannelConstraints, ChannelLimits, ChannelSetup, ChannelState, Direction, Role};
use crate::sys::Access;
use crate::wake::{Arm, WakeSet};

mod connect;
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
    /// References of the buffer handles we gave away, for those we receive.
    spares: Spares,
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
        let pending = endpoint.listen(&setup)?;
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
        let pending = endpoint.connect(&params)?;
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
            spares: Spares::default(),
            helpers: connect::Helpers::default(),
            wake,
            spin: DEFAULT_SPIN,
            room_refused: false,
            room_needed: 1,
            assembling: None,
            inspect,
        }
    }

    // ----------------------------------------------------------------- queries

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

    // -------------------------------------------------------------- operations

    /// Move a buffer to the sink ([ETH-BT] Algorithm 7): ownership goes to
    /// the peer. Refused operations hand the buffer back.
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
    /// let mut buf = alloc.alloc().unwrap();
    /// buf.as_mut_slice()?[0] = 9;
    /// tx.move_buffer(buf, b"frame 1")?;
    /// let Ok(Event::MoveReceived { buffer, meta }) = rx.wait(Some(t)) else { panic!() };
    /// assert_eq!((buffer[0], &meta[..]), (9, &b"frame 1"[..]));
    /// // Refused: the buffer comes back with the reason.
    /// let refused = rx.move_buffer(buffer, &[]).unwrap_err();
    /// assert_eq!(refused.error, ErrorKind::WrongDirection);
    /// let buffer = refused.into_inner();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn move_buffer(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        let id = buffer.id();
        self.move_buffer_bare(buffer, meta).context(|| format!("move {id} over {}", self.name))
    }

    /// [`Channel::move_buffer`], its errors without context.
    fn move_buffer_bare(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        self.flush_deferred();
        match self.check_transfer(Direction::Tx, &buffer, meta.len()) {
            Ok(()) => self.send_owned(buffer, meta, false, |buf, meta| Message::Move { buf, meta }),
            Err(e) => Err(Refused::new(e, buffer)),
        }
    }

    /// Pass a buffer back to the source ([ETH-BT] Algorithm 8).
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
    /// let Ok(Event::MoveReceived { mut buffer, .. }) = rx.wait(Some(t)) else { panic!() };
    /// buffer.as_mut_slice()?[0] = 7; // the sink owns it: it may write
    /// rx.pass(buffer, b"done")?;
    /// let Ok(Event::BufferPassed { buffer, meta }) = tx.wait(Some(t)) else { panic!() };
    /// assert_eq!((buffer[0], &meta[..]), (7, &b"done"[..]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn pass(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        let id = buffer.id();
        self.pass_bare(buffer, meta).context(|| format!("pass {id} back over {}", self.name))
    }

    /// [`Channel::pass`], its errors without context.
    fn pass_bare(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        self.flush_deferred();
        match self.check_transfer(Direction::Rx, &buffer, meta.len()) {
            Ok(()) => self.send_owned(buffer, meta, false, |buf, meta| Message::Pass { buf, meta }),
            Err(e) => Err(Refused::new(e, buffer)),
        }
    }

    /// Pass a buffer whose contents do not matter to the source: a receive
    /// master handing out empty buffers to be filled. The semantics are
    /// those of [`pass`](Channel::pass); the difference is the cost: over
    /// the network no payload travels, and the source's buffer then holds
    /// whatever bytes its memory last held for it (never another domain's
    /// live data). Between threads or processes of one host the two are
    /// the same.
    pub fn pass_unfilled(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        let id = buffer.id();
        self.pass_unfilled_bare(buffer, meta).context(|| format!("pass {id} back unfilled over {}", self.name))
    }

    /// [`Channel::pass_unfilled`], its errors without context.
    fn pass_unfilled_bare(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        self.flush_deferred();
        match self.check_transfer(Direction::Rx, &buffer, meta.len()) {
            Ok(()) => self.send_owned(buffer, meta, true, |buf, meta| Message::Pass { buf, meta }),
            Err(e) => Err(Refused::new(e, buffer)),
        }
    }

    /// Send a read-only copy ([ETH-BT] Algorithm 9). The source may be a
    /// buffer we own (it becomes read-only until every copy is back) or a
    /// copy we hold (forwarding it).
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
    /// let mut buf = alloc.alloc().unwrap();
    /// tx.copy(&buf, &[])?;
    /// assert_eq!(buf.as_mut_slice().unwrap_err(), ErrorKind::CopiesOutstanding);
    /// let Ok(Event::CopyReceived { copy, .. }) = rx.wait(Some(t)) else { panic!() };
    /// rx.release(copy)?;
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: true, .. })));
    /// assert!(buf.as_mut_slice().is_ok());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy<S: CopySource>(&mut self, source: &S, meta: &[u8]) -> Result<()> {
        self.copy_bare(source, meta).context(|| format!("copy {} over {}", source.buffer_id(), self.name))
    }

    /// [`Channel::copy`], its errors without context.
    fn copy_bare<S: CopySource>(&mut self, source: &S, meta: &[u8]) -> Result<()> {
        self.check_copy(source, meta)?;
        self.send_copy(source.buffer_id(), Meta::new(meta).expect("meta checked"))
    }

    /// The checks of [`copy`](Channel::copy), in its order, sending
    /// nothing (for [`crate::FanOut`], which checks every channel first).
    pub(crate) fn check_copy<S: CopySource>(&mut self, source: &S, meta: &[u8]) -> Result<()> {
        self.flush_deferred();
        self.check_sendable(Direction::Tx)?;
        if source.source_domain() != self.domain.id() {
            return Err(ErrorKind::ForeignBuffer.into());
        }
        self.check_pool(source.buffer_id().pool)?;
        self.check_meta(meta.len())?;
        self.check_room()
    }

    /// How many copies of `id` this end sent that are still out.
    pub(crate) fn copies_out_here(&self, id: BufferId) -> u32 {
        self.domain.lock().record(id).map_or(0, |r| r.copies_out_via(self.key))
    }

    /// Send a copy of `id` (checks done).
    fn send_copy(&mut self, id: BufferId, meta: Meta) -> Result<()> {
        // A copy to a peer that still holds one of this buffer from us needs
        // no payload: the buffer has been read-only since, so the peer's
        // bytes are current (the TCP backend then sends none).
        let cross = self.lent.is_some();
        let (resend, size) = {
            let mut st = self.domain.lock();
            if cross {
                // Counted in the pool ledger before it goes: if we die, the
                // owner learns that a copy may still be out.
                st.entry(id.pool).expect("pool checked").view.memory().ledger()?.copy_out(id.index);
            }
            let resend = st.record(id).is_some_and(|r| r.copies_out_via(self.key) > 0);
            st.copy_sent(id, self.key);
            (resend, st.entry(id.pool).map_or(0, |e| e.view.geometry().buffer_size()))
        };
        let msg = Message::Copy { buf: id, meta };
        let link = self.link_mut();
        let sent = if resend { link.send_unfilled(&msg) } else { link.send(&msg) };
        if let Err(e) = sent {
            // Peer vanished between the checks and the send: undo.
            let mut st = self.domain.lock();
            st.copy_returned(id, self.key);
            if cross {
                st.entry(id.pool).expect("pool checked").view.memory().copy_back(id.index);
            }
            return Err(e);
        }
        self.count_sent(Op::Copy, size);
        Ok(())
    }

    /// Release a copy received over this channel ([ETH-BT] Algorithm 10).
    /// Dropping a [`BufferCopy`] releases it too, the next time the channel
    /// runs.
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
    /// let buf = alloc.alloc().unwrap();
    /// tx.copy(&buf, &[])?;
    /// tx.copy(&buf, &[])?; // two copies out
    /// let Ok(Event::CopyReceived { copy: first, .. }) = rx.wait(Some(t)) else { panic!() };
    /// let Ok(Event::CopyReceived { copy: second, .. }) = rx.wait(Some(t)) else { panic!() };
    /// rx.release(first)?;
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: false, .. })));
    /// rx.release(second)?;
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: true, .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn release(&mut self, copy: BufferCopy) -> Result<(), Refused<BufferCopy>> {
        let id = copy.id();
        self.release_bare(copy).context(|| format!("release the copy of {id} over {}", self.name))
    }

    /// [`Channel::release`], its errors without context.
    fn release_bare(&mut self, copy: BufferCopy) -> Result<(), Refused<BufferCopy>> {
        self.flush_deferred();
        if copy.domain_id() != self.domain.id() {
            // Check the channel-level preconditions first, as everywhere.
            let e = self.check_sendable(Direction::Rx).err().unwrap_or(ErrorKind::ForeignBuffer.into());
            return Err(Refused::new(e, copy));
        }
        if copy.chan() != self.key {
            let e = self
                .check_sendable(Direction::Rx)
                .and_then(|()| self.check_pool(copy.id().pool))
                .err()
                .unwrap_or(ErrorKind::NotCopyHolder.into());
            return Err(Refused::new(e, copy));
        }
        match self.release_id(copy.id()) {
            Ok(()) => {
                copy.consume();
                Ok(())
            }
            Err(e) => Err(Refused::new(e, copy)),
        }
    }

    /// Full copy ([ETH-BT] §5.1.11): copy the bytes of `source` into
    /// `destination` (a read-write buffer of ours in a pool assigned to this
    /// channel) and move `destination`. The receiver gets a move.
    pub fn full_copy<S: CopySource>(
        &mut self,
        source: &S,
        destination: Buffer,
        meta: &[u8],
    ) -> Result<(), Refused<Buffer>> {
        let id = destination.id();
        self.full_copy_bare(source, destination, meta)
            .context(|| format!("copy {} in full into {id} over {}", source.buffer_id(), self.name))
    }

    /// [`Channel::full_copy`], its errors without context.
    fn full_copy_bare<S: CopySource>(
        &mut self,
        source: &S,
        mut destination: Buffer,
        meta: &[u8],
    ) -> Result<(), Refused<Buffer>> {
        self.flush_deferred();
        let me = self.domain.id();
        let checks = self
            .check_sendable(Direction::Tx)
            .and_then(|()| if source.source_domain() != me { Err(ErrorKind::ForeignBuffer.into()) } else { Ok(()) })
            .and_then(|()| if destination.domain_id() != me { Err(ErrorKind::ForeignBuffer.into()) } else { Ok(()) })
            .and_then(
                |()| if source.buffer_id() == destination.id() { Err(ErrorKind::SameBuffer.into()) } else { Ok(()) },
            )
            .and_then(|()| self.check_transfer(Direction::Tx, &destination, meta.len()));
        if let Err(e) = checks {
            return Err(Refused::new(e, destination));
        }
        let n = source.len().min(destination.len());
        match destination.as_mut_slice() {
            Ok(dst) => dst[..n].copy_from_slice(&source[..n]),
            Err(e) => return Err(Refused::new(e, destination)),
        }
        self.send_owned(destination, meta, false, |buf, meta| Message::Move { buf, meta })
    }

    /// Send an aggregate as one unit: the peer receives one
    /// [`Event::Aggregate`] with the same fragments over its own handles
    /// of the buffers.
    ///
    /// Each distinct buffer crosses once, however many fragments refer to
    /// it. A buffer the aggregate holds the only reference to (an owned
    /// [`Buffer`] handed to it, not shared with a clone or another
    /// aggregate, with no copies out) is moved: the receiver owns it. Every
    /// other buffer — a [`BufferCopy`], or an owned buffer that something
    /// else still refers to — is sent as a read-only copy: an owned one
    /// stays read-only here until every copy is back, a copy we hold is
    /// forwarded. The buffers' pools must be assigned to the channel.
    ///
    /// All or nothing: everything is checked, including room in the queue
    /// for the whole run of slots (header, one per buffer, fragment
    /// table), before anything goes; a refused aggregate comes back intact
    /// ([`ErrorKind::QueueFull`]: try again once the peer has taken messages;
    /// [`ErrorKind::AggregateTooLarge`]: the run could never fit the queue).
    /// An empty aggregate sends its meta data alone. (Once the checks pass,
    /// only a peer that goes away mid-send can still fail it: the
    /// fragments of the members not sent yet come back in the `Refused`.)
    ///
    /// The fragment table travels in the queue's slots, 16 bytes per
    /// entry, as many per slot as the channel's meta size makes room
    /// for: 2 with a meta size up to 32 bytes (64-byte slots), 14 with
    /// [`MAX_META_SIZE`](crate::MAX_META_SIZE) (256-byte slots). Where a
    /// group of fragments repeats, each copy of each fragment taking the
    /// bytes of its buffer right after the previous copy's (a train of
    /// units, each behind its header), one entry stands for all the
    /// copies: 1 MiB behind three 32-byte headers, cut into 257 units of
    /// 4 KiB each behind a 16-byte header (517 fragments), takes 10
    /// entries, one table slot with `MAX_META_SIZE` or 5 with the
    /// smallest slots. Other tables take an entry per fragment; a channel
    /// that carries those with many fragments is best set up with a meta
    /// size of `MAX_META_SIZE` and a queue deep enough for a few runs.
    /// An aggregate received and not edited since (a router's) goes on
    /// with the table it came with, its fragments not walked again.
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
    /// let body = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"payload")?;
    /// let mut msg = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"HDR ")?;
    /// msg.append(body.clone()); // `body` keeps a reference: its buffer is copied
    /// tx.send_aggregate(msg, b"m1")?;
    /// let Ok(Event::Aggregate { agg, meta }) = rx.wait(Some(t)) else { panic!() };
    /// assert_eq!((agg.to_vec(), &meta[..]), (b"HDR payload".to_vec(), &b"m1"[..]));
    /// let frags: Vec<bool> = agg.fragments().map(|f| f.is_copy()).collect();
    /// assert_eq!(frags, [false, true]); // the header buffer moved, the body copied
    /// drop(agg); // the copy is released, the moved buffer freed in `b`
    /// rx.flush()?; // (a dropped copy is released the next time `rx` runs)
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: true, .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send_aggregate(&mut self, agg: Aggregate, meta: &[u8]) -> Result<(), Refused<Aggregate>> {
        let len = agg.len();
        self.send_aggregate_bare(agg, meta).context(|| format!("send an aggregate of {len} bytes over {}", self.name))
    }

    /// [`Channel::send_aggregate`], its errors without context.
    fn send_aggregate_bare(&mut self, mut agg: Aggregate, meta: &[u8]) -> Result<(), Refused<Aggregate>> {
        self.flush_deferred();
        agg.settle();
        let (members, table) = match self.check_aggregate(&agg, meta.len()) {
            Ok(table) => table,
            Err(e) => return Err(Refused::new(e, agg)),
        };
        let total = agg.len() as u64;
        let mut parts = agg.into_parts_with(members, table);
        let header = Message::AggHeader {
            members: parts.members.len() as u32,
            frags: parts.wire.len() as u32,
            total,
            meta: Meta::new(meta).expect("meta checked"),
        };
        if let Err(e) = self.link_mut().send(&header) {
            return Err(Refused::new(e, parts.rebuild()));
        }
        self.count_sent(Op::Aggregate, 0);
        for i in 0..parts.members.len() {
            let held = parts.members[i].take().expect("each member is sent once");
            let sent = match Arc::try_unwrap(held) {
                // The aggregate was the only reference: move the buffer.
                Ok(Held::Owned(buffer)) if buffer.is_read_write() => {
                    match self.send_owned(buffer, &[], false, |buf, meta| Message::Move { buf, meta }) {
                        Ok(()) => Ok(()),
                        Err(r) => Err((r.error.clone(), Arc::new(Held::Owned(r.into_inner())))),
                    }
                }
                // Shared (or read-only for its copies out): a copy; our
                // reference goes when `held` does (an owned buffer then
                // waits for its copies, a copy we hold is released once
                // the copies forwarded from it are back).
                Ok(held) => self.send_aggregate_copy(Arc::new(held)),
                Err(held) => self.send_aggregate_copy(held),
            };
            // Only a peer that went away makes a send fail once there is
            // room: what was not sent comes back.
            if let Err((e, held)) = sent {
                parts.members[i] = Some(held);
                return Err(Refused::new(e, parts.rebuild()));
            }
        }
        for msg in proto::table_messages(&parts.wire, self.meta_size) {
            if let Err(e) = self.link_mut().send(&msg) {
                return Err(Refused::new(e, Aggregate::new()));
            }
        }
        Ok(())
    }

    /// One member of an aggregate sent as a copy; the handle back on error.
    fn send_aggregate_copy(&mut self, held: Arc<Held>) -> Result<(), (Error, Arc<Held>)> {
        match self.send_copy(held.id(), Meta::empty()) {
            Ok(()) => Ok(()),
            Err(e) => Err((e, held)),
        }
    }

    /// Everything [`send_aggregate`](Channel::send_aggregate) checks
    /// before it sends anything (`agg` [settled](Aggregate::settle)); the
    /// number of distinct buffers, and the fragment table and the table as
    /// it goes on the wire if it may go (`None`: an aggregate received and
    /// not edited since goes with the table it came with, which names its
    /// members in the order they came).
    #[allow(clippy::type_complexity)]
    fn check_aggregate(
        &mut self,
        agg: &Aggregate,
        meta_len: usize,
    ) -> Result<(usize, Option<(Vec<FragEntry>, Vec<FragEntry>)>)> {
        self.check_sendable(Direction::Tx)?;
        let (members, entries) = match agg.received_members() {
            Some(members) => (members, None),
            None => {
                let (members, entries) = agg.distinct();
                (members, Some(entries))
            }
        };
        for m in &members {
            if m.domain_id() != self.domain.id() {
                return Err(ErrorKind::ForeignBuffer.into());
            }
            self.check_pool(m.id().pool)?;
        }
        self.check_meta(meta_len)?;
        let table = entries.map(|entries| {
            let wire = proto::fold_table(&entries);
            (entries, wire)
        });
        let (frags, wire) = match &table {
            Some((entries, wire)) => (entries.len(), wire.len()),
            None => agg.received_counts().expect("a received table"),
        };
        let slots = proto::run_slots(members.len(), wire, self.meta_size);
        let capacity = self.link.as_ref().map_or(0, |l| l.capacity());
        if members.len() > proto::MAX_AGG_MEMBERS as usize || frags > proto::MAX_AGG_FRAGS as usize || slots > capacity
        {
            return Err(ErrorKind::AggregateTooLarge { slots, capacity }.into());
        }
        self.check_room_for(slots)?;
        Ok((members.len(), table))
    }

    /// Start assigning a pool to this channel ([ETH-BT] Algorithm 6,
    /// two-phase): completion is [`Event::PoolAssigned`] or
    /// [`Event::PoolVetoed`]. [`Channel::assign_pool_and_wait`] waits for
    /// it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints};
    /// let t = Duration::from_secs(10);
    /// let (a, b) = (Domain::new("a"), Domain::new("b"));
    /// let ep = Endpoint::local();
    /// let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    /// let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    /// tx.wait_connected(t)?;
    /// rx.wait_connected(t)?;
    /// let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// tx.assign_pool(alloc.pool())?;
    /// let Ok(Event::PoolAssignRequest(req)) = rx.wait(Some(t)) else { panic!() };
    /// assert_eq!(req.geometry, alloc.pool().geometry());
    /// rx.respond_pool(req.pool, true)?; // or false: a veto
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::PoolAssigned(p)) if p == alloc.pool().id()));
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn assign_pool(&mut self, pool: &Pool) -> Result<()> {
        self.assign_pool_bare(pool).context(|| format!("assign pool {} to {}", pool.id(), self.name))
    }

    /// [`Channel::assign_pool`], its errors without context.
    pub(crate) fn assign_pool_bare(&mut self, pool: &Pool) -> Result<()> {
        self.flush_deferred();
        self.check_sendable_any()?;
        let id = pool.id();
        // Only a pool this domain created or accepted can be offered: a pool
        // merely offered to us cannot be passed on before we accept it.
        if pool.domain.id != self.domain.id() || !self.domain.lock().entry(id).is_some_and(|e| e.permanent) {
            return Err(ErrorKind::UnknownPool(id).into());
        }
        let busy = self.pools.iter().any(|p| p.id == id && (p.listed || p.assigning));
        if busy || self.requests.iter().any(|r| r.pool == id) {
            return Err(ErrorKind::PoolAlreadyAssigned(id).into());
        }
        let (pool_trust, geometry, memory) = {
            let st = self.domain.lock();
            let e = st.entry(id).expect("checked");
            (e.trust, e.view.geometry(), e.view.memory().clone())
        };
        if pool_trust != TrustLevel::Uninitialized && pool_trust != self.trust {
            return Err(ErrorKind::TrustMismatch { pool: pool_trust, channel: self.trust }.into());
        }
        self.check_room()?;
        let link = self.link.as_mut().expect("connected");
        link.export_pool(&memory)?;
        link.send(&Message::AssignRequest { pool: id, geometry, trust: self.trust })?;
        self.count_sent(Op::PoolAssign, 0);
        self.domain.lock().entry_mut(id).expect("checked").trust = self.trust;
        self.chan_pool(id).assigning = true;
        Ok(())
    }

    /// Answer a [`Event::PoolAssignRequest`]: accept or veto.
    pub fn respond_pool(&mut self, pool: PoolId, accept: bool) -> Result<()> {
        let answer = if accept { "accept" } else { "veto" };
        self.respond_pool_bare(pool, accept).context(|| format!("{answer} pool {pool} on {}", self.name))
    }

    /// [`Channel::respond_pool`], its errors without context.
    fn respond_pool_bare(&mut self, pool: PoolId, accept: bool) -> Result<()> {
        self.flush_deferred();
        self.check_sendable_any()?;
        let pos = self.requests.iter().position(|r| r.pool == pool).ok_or(ErrorKind::NoPendingRequest(pool))?;
        self.check_room()?;
        self.link_mut().send(&Message::AssignReply { pool, accepted: accept })?;
        self.settle_request(pos, accept);
        Ok(())
    }

    /// The answer to `self.requests[pos]` is sent (or queued): forget the
    /// request, and list the pool if it was accepted.
    fn settle_request(&mut self, pos: usize, accept: bool) {
        let pool = self.requests.remove(pos).pool;
        if accept {
            // Listed first: the request's relation goes after the record's
            // is counted, so the pool never looks unused in between.
            let p = self.chan_pool(pool);
            p.listed = true;
            p.by_peer = true;
            self.fix_pool(pool);
        }
        self.detach(pool);
    }

    /// Start removing a pool from this channel; completion is
    /// [`Event::PoolRemoved`] or [`Event::PoolRemoveRefused`]. Refused with
    /// [`ErrorKind::PoolInUse`] while copies of its buffers are out over this
    /// channel in either direction. Buffers keep their owners.
    pub fn remove_pool(&mut self, pool: PoolId) -> Result<()> {
        self.remove_pool_bare(pool).context(|| format!("remove pool {pool} from {}", self.name))
    }

    /// [`Channel::remove_pool`], its errors without context.
    fn remove_pool_bare(&mut self, pool: PoolId) -> Result<()> {
        self.flush_deferred();
        self.check_sendable_any()?;
        self.check_pool(pool)?;
        if self.domain.lock().entry(pool).is_some_and(|e| e.copies_on(self.key)) {
            return Err(ErrorKind::PoolInUse(pool).into());
        }
        self.check_room()?;
        self.link_mut().send(&Message::RemoveRequest { pool })?;
        self.count_sent(Op::PoolRemove, 0);
        self.chan_pool(pool).removing = true;
        Ok(())
    }

    /// Start a teardown: no new messages from this end; messages in transit
    /// are still delivered; [`Event::Closed`] once the peer's marker arrives.
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
    /// tx.teardown()?;
    /// assert_eq!(tx.move_buffer(alloc.alloc().unwrap(), &[]).unwrap_err().error, ErrorKind::TearingDown);
    /// // The move sent before still arrives, then the close.
    /// assert!(matches!(rx.wait(Some(t)), Ok(Event::MoveReceived { .. })));
    /// assert!(matches!(rx.wait(Some(t)), Ok(Event::Closed { by_peer: true })));
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::Closed { by_peer: false })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn teardown(&mut self) -> Result<()> {
        self.teardown_bare().context(|| format!("tear down {}", self.name))
    }

    /// [`Channel::teardown`], its errors without context.
    fn teardown_bare(&mut self) -> Result<()> {
        self.flush_deferred();
        self.check_sendable_any()?;
        self.check_room()?;
        self.link_mut().send(&Message::Teardown)?;
        self.sent_teardown = true;
        self.state = ChannelState::Teardown;
        self.inspect.update(|i| i.state = ChannelState::Teardown);
        Ok(())
    }

    /// Batching (off by default): while on, the messages of this end's
    /// operations are not necessarily visible to the peer when the
    /// operation returns; they are published in batches, each with one
    /// shared-memory publication and at most one wake-up — at the latest by
    /// [`flush`](Channel::flush), by a [`poll`](Channel::poll) that finds
    /// nothing to deliver, by [`wait`](Channel::wait), when the queue is
    /// full or 32 messages are waiting, by a teardown, and when the channel
    /// is closed or dropped. (A shared-memory end may publish sooner, e.g.
    /// an answer the peer waits for: where batches end depends on timing.)
    /// Messages held back stay so while this end makes none of these
    /// calls: flush before waiting on anything other than the channel.
    /// Turning it off flushes. Nothing else changes: every operation still
    /// checks, changes states and fails as without batching.
    /// `NotConnected` before the channel is connected.
    pub fn set_batching(&mut self, on: bool) -> Result<()> {
        match self.link.as_mut() {
            Some(link) => {
                link.set_batching(on);
                Ok(())
            }
            None => Err(ErrorKind::NotConnected(self.state).into()),
        }
    }

    /// Send what this end has queued for the peer, without taking any
    /// arrival: the messages held back by batching
    /// ([`set_batching`](Channel::set_batching)). The TCP backend always
    /// batches (it sends when the channel is polled or waited on, or a batch
    /// is full); `flush` is for a caller that sends and then does not poll
    /// for a while.
    pub fn flush(&mut self) -> Result<()> {
        if !matches!(self.state, ChannelState::Connected | ChannelState::Teardown) {
            return Ok(());
        }
        self.flush_deferred();
        self.flush_outbox();
        self.link_mut().flush()
    }

    // ------------------------------------------------------------------ events

    /// Deliver at most one arrival, without blocking. Events a waiting
    /// helper took meanwhile ([`assign_pool_and_wait`](Channel::assign_pool_and_wait))
    /// come first, in the order they arrived.
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
    /// assert!(rx.poll().is_none()); // nothing yet
    /// tx.move_buffer(alloc.alloc().unwrap(), &[])?;
    /// while let Some(ev) = rx.poll() {
    ///     if let Event::MoveReceived { buffer, .. } = ev {
    ///         rx.pass(buffer, &[])?;
    ///     }
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn poll(&mut self) -> Option<Event> {
        if !self.helpers.held.is_empty() {
            return self.helpers.held.pop_front();
        }
        match self.state {
            ChannelState::Initialized | ChannelState::Binding => self.poll_setup(),
            ChannelState::Connected | ChannelState::Teardown => {
                self.flush_deferred();
                self.flush_outbox();
                self.poll_message()
            }
            _ => None,
        }
    }

    /// Wait up to `timeout` (forever with `None`) for the next event: spin
    /// briefly, then sleep until the peer wakes us.
    /// [`WaitError::TimedOut`] when the timeout passed (the channel is still
    /// open: wait again); [`WaitError::Closed`] once the channel is closed
    /// and its last event ([`Event::Closed`] or [`Event::Error`]) was
    /// delivered: nothing more will come.
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
    /// assert_eq!(rx.wait(Some(Duration::from_millis(1))).unwrap_err(), WaitError::TimedOut);
    /// tx.move_buffer(alloc.alloc().unwrap(), &[])?;
    /// assert!(matches!(rx.wait(Some(t)), Ok(Event::MoveReceived { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<Event, WaitError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(ev) = self.poll() {
                return Ok(ev);
            }
            if self.state == ChannelState::Closed {
                return Err(WaitError::Closed);
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return Err(WaitError::TimedOut),
                },
                None => None,
            };
            let spin = left.map_or(self.spin, |l| l.min(self.spin));
            if !spin.is_zero() && self.link.as_mut().is_some_and(|l| l.spin(spin)) {
                continue;
            }
            if !self.arm() {
                continue;
            }
            // Never sleep longer than a second at a time: belt and braces
            // for a wake-up that no fd carries.
            self.wake.wait(left.map_or(Duration::from_secs(1), |l| l.min(Duration::from_secs(1))));
        }
    }

    /// Prepare to wait on the channel's fd ([`AsFd`](std::os::fd::AsFd)):
    /// call it when [`poll`](Channel::poll) returned `None`, then wait for
    /// the fd to become readable (in `poll(2)`, an epoll set, mio, tokio's
    /// `AsyncFd`), then `poll` again until it returns `None`, and so on.
    ///
    /// Returns `false` if an event may be waiting already: `poll` again
    /// instead of waiting. `true`: the channel is armed, and its fd becomes
    /// readable when an event may be waiting — a message from the peer,
    /// room in a full outgoing queue (after a [`send_aggregate`](Channel::send_aggregate)
    /// refused with [`ErrorKind::QueueFull`]: room for its whole run), the
    /// peer's close or death, a timer of
    /// the backend's own (TCP keep-alives, setup deadlines). Wake-ups can
    /// be spurious; `poll` tells.
    ///
    /// Arming is what makes the fd work: a peer rings a channel end only
    /// after that end declared itself asleep (one wake-up on the empty →
    /// non-empty transition, never one per message), so a channel that is
    /// only polled costs its peer nothing. The fd is level-triggered: it
    /// stays readable until the next `arm`, so edge-triggered waiting works
    /// too as long as every wake-up is followed by `poll` until `None` and
    /// `arm`. A closed channel is always armed (nothing more will come).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use ferry::*;
    /// use std::os::fd::AsFd;
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
    /// let readable = |ch: &Channel| {
    ///     let mut fds = [rustix::event::PollFd::new(ch, rustix::event::PollFlags::IN)];
    ///     rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 10, tv_nsec: 0 })).unwrap() == 1
    /// };
    /// assert!(rx.poll().is_none());
    /// assert!(rx.arm()); // nothing waiting: rx's fd will say when
    /// tx.move_buffer(alloc.alloc().unwrap(), &[])?;
    /// assert!(readable(&rx));
    /// assert!(matches!(rx.poll(), Some(Event::MoveReceived { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn arm(&mut self) -> bool {
        if !self.helpers.held.is_empty() {
            return false;
        }
        let armed = match self.state {
            ChannelState::Initialized | ChannelState::Binding => match self.pending.as_mut() {
                Some(p) => p.arm(&self.wake),
                None => Arm::SLEEP,
            },
            ChannelState::Connected | ChannelState::Teardown => {
                self.flush_deferred();
                self.flush_outbox();
                // A refused aggregate run waits for room for all of it.
                let slots = if self.room_refused { self.room_needed } else { 1 };
                match self.link.as_mut() {
                    Some(link) => match link.arm_for_room(&self.wake, slots) {
                        // The link asks for a wake-up only for room that is
                        // still missing after it armed: room that came since
                        // a refused send is reported here.
                        Arm::Sleep { .. }
                            if self.room_refused
                                && self.outbox.is_empty()
                                && link.has_room()
                                && (slots <= 1 || link.room() >= slots) =>
                        {
                            self.room_refused = false;
                            Arm::Ready
                        }
                        armed => armed,
                    },
                    None => Arm::SLEEP,
                }
            }
            _ => Arm::SLEEP,
        };
        match armed {
            Arm::Ready => false,
            Arm::Sleep { until } => {
                self.wake.set_timer(until);
                self.inspect.counters.wakeup();
                self.sample_queue();
                true
            }
        }
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

    // --------------------------------------------------------------- internals

    fn link_mut(&mut self) -> &mut dyn Link {
        self.link.as_deref_mut().expect("connected channel has a link")
    }

    /// Our record of `id` on this channel, created (and counted in the
    /// domain's pool entry) if absent.
    fn chan_pool(&mut self, id: PoolId) -> &mut ChanPool {
        let pos = match self.pools.iter().position(|p| p.id == id) {
            Some(pos) => pos,
            None => {
                self.attach(id);
                self.pools.push(ChanPool { id, listed: false, assigning: false, removing: false, by_peer: false });
                self.pools.len() - 1
            }
        };
        &mut self.pools[pos]
    }

    /// Forget our record of `id` if nothing is left in it.
    fn tidy_pool(&mut self, id: PoolId) {
        if let Some(pos) = self.pools.iter().position(|p| p.id == id) {
            let p = &self.pools[pos];
            if !(p.listed || p.assigning || p.removing) {
                self.pools.remove(pos);
                self.detach(id);
            }
        }
    }

    fn attach(&self, pool: PoolId) {
        if let Some(e) = self.domain.lock().entry_mut(pool) {
            e.channels += 1;
        }
    }

    /// One relation of this end to `pool` (a record or a request, already
    /// taken out) is gone. With its last one, the link and the spares drop
    /// what they keep of the pool; the domain drops the pool if nothing
    /// else refers to it.
    fn detach(&mut self, pool: PoolId) {
        let related = self.pools.iter().any(|p| p.id == pool) || self.requests.iter().any(|r| r.pool == pool);
        if !related {
            if let Some(link) = self.link.as_mut() {
                link.forget_pool(pool);
            }
            self.spares.forget_pool(pool);
        }
        let mut st = self.domain.lock();
        if let Some(e) = st.entry_mut(pool) {
            e.channels -= 1;
        }
        let gone = st.release_if_unused(pool);
        let listed = st.entry(pool).is_some();
        drop(st);
        drop(gone);
        if let (false, Some(lent)) = (related, &mut self.lent) {
            // Buffers lent on this channel come back if the peer dies, to
            // a domain that still has their pool: kept only for that.
            lent.forget_pool(pool, !listed);
        }
    }

    /// An assignment of `pool` was accepted: our entry is permanent and the
    /// pool's trust level fixed.
    fn fix_pool(&self, pool: PoolId) {
        if let Some(e) = self.domain.lock().entry_mut(pool) {
            e.permanent = true;
            e.trust_fixed = true;
        }
    }

    fn check_sendable_any(&self) -> Result<()> {
        match self.state {
            ChannelState::Connected => Ok(()),
            ChannelState::Teardown => Err(ErrorKind::TearingDown.into()),
            s => Err(ErrorKind::NotConnected(s).into()),
        }
    }

    fn check_sendable(&self, dir: Direction) -> Result<()> {
        self.check_sendable_any()?;
        if self.direction != dir {
            return Err(ErrorKind::WrongDirection.into());
        }
        Ok(())
    }

    fn check_pool(&self, pool: PoolId) -> Result<()> {
        match self.pools.iter().find(|p| p.id == pool && p.listed) {
            Some(p) if p.removing => Err(ErrorKind::PoolRemovalPending(pool).into()),
            Some(_) => Ok(()),
            None => Err(ErrorKind::PoolNotAssigned(pool).into()),
        }
    }

    fn check_meta(&self, len: usize) -> Result<()> {
        if len > self.meta_size {
            return Err(ErrorKind::MetaTooLarge { len, max: self.meta_size }.into());
        }
        Ok(())
    }

    fn check_room(&mut self) -> Result<()> {
        if !self.outbox.is_empty() {
            self.flush_outbox();
        }
        if !self.outbox.is_empty() || !self.link_mut().has_room() {
            self.room_refused = true;
            self.room_needed = 1;
            self.inspect.counters.queue_full();
            return Err(ErrorKind::QueueFull.into());
        }
        Ok(())
    }

    /// Room for `slots` messages in a row (an aggregate run).
    fn check_room_for(&mut self, slots: usize) -> Result<()> {
        self.check_room()?;
        if self.link_mut().room() < slots {
            self.room_refused = true;
            self.room_needed = slots;
            self.inspect.counters.queue_full();
            return Err(ErrorKind::QueueFull.into());
        }
        self.room_needed = 1;
        Ok(())
    }

    /// Preconditions of move, pass and the destination of a full copy.
    fn check_transfer(&mut self, dir: Direction, buffer: &Buffer, meta_len: usize) -> Result<()> {
        self.check_sendable(dir)?;
        if buffer.domain_id() != self.domain.id() {
            return Err(ErrorKind::ForeignBuffer.into());
        }
        let id = buffer.id();
        self.check_pool(id.pool)?;
        if !buffer.is_read_write() {
            return Err(ErrorKind::CopiesOutstanding.into());
        }
        self.check_meta(meta_len)?;
        self.check_room()
    }

    /// Give an owned buffer away with `make(id, meta)` (checks done).
    fn send_owned(
        &mut self,
        buffer: Buffer,
        meta: &[u8],
        unfilled: bool,
        make: impl FnOnce(BufferId, Meta) -> Message,
    ) -> Result<(), Refused<Buffer>> {
        let id = buffer.id();
        {
            let mut st = self.domain.lock();
            if self.lent.is_some() {
                if let Err(e) = st.note_lending(id, self.key) {
                    drop(st);
                    return Err(Refused::new(e, buffer));
                }
            }
            st.give_away(id);
        }
        let msg = make(id, Meta::new(meta).expect("meta checked"));
        let link = self.link_mut();
        let sent = if unfilled { link.send_unfilled(&msg) } else { link.send(&msg) };
        match sent {
            Ok(()) => {
                let op = if matches!(msg, Message::Move { .. }) { Op::Move } else { Op::Pass };
                self.count_sent(op, buffer.len());
                self.spares.keep(buffer);
                if let Some(lent) = &mut self.lent {
                    lent.insert(id);
                }
                Ok(())
            }
            Err(e) => {
                self.domain.lock().take_ownership(id);
                Err(Refused::new(e, buffer))
            }
        }
    }

    /// Release one copy of `id` held via this channel (checks included).
    fn release_id(&mut self, id: BufferId) -> Result<()> {
        self.check_sendable(Direction::Rx)?;
        self.check_pool(id.pool)?;
        {
            let st = self.domain.lock();
            let rec = st.record(id).ok_or(ErrorKind::NotCopyHolder)?;
            if rec.held_via(self.key) == 0 {
                return Err(ErrorKind::NotCopyHolder.into());
            }
            if !rec.is_owned() && rec.has_forwarded() && rec.held_via(self.key) < 2 {
                return Err(ErrorKind::CopiesForwarded.into());
            }
        }
        self.check_room()?;
        self.link_mut().send(&Message::Release { buf: id })?;
        self.count_sent(Op::Release, 0);
        self.domain.lock().copy_released_here(id, self.key);
        Ok(())
    }

    /// Count an operation sent (one load and store per counter), and
    /// every 64 sends sample the depth of the outgoing queue.
    #[inline]
    fn count_sent(&mut self, op: Op, bytes: usize) {
        if self.inspect.counters.sent(op, bytes as u64) {
            self.sample_queue();
        }
    }

    /// Record how full the outgoing queue is, where the backend can say
    /// without sending anything.
    fn sample_queue(&mut self) {
        if let Some(link) = self.link.as_mut() {
            if let Some(queued) = link.queued() {
                self.inspect.counters.sample_queue(queued, link.capacity());
            }
        }
    }

    /// Release copies whose handles were dropped; keep those that cannot go
    /// yet (forwarded copies still out, queue full).
    #[inline]
    fn flush_deferred(&mut self) {
        // The flag stays set while any channel of the domain has deferred
        // releases; only then is the domain lock worth taking (and the call).
        if self.domain.shared.has_deferred.load(Ordering::Acquire) {
            self.flush_deferred_now();
        }
    }

    fn flush_deferred_now(&mut self) {
        let ids = self.domain.lock().take_deferred(self.key);
        for id in ids {
            match self.release_id(id) {
                Ok(()) => {}
                Err(e) if matches!(e.kind(), ErrorKind::CopiesForwarded | ErrorKind::QueueFull) => {
                    self.domain.lock().defer_release(self.key, id);
                }
                // Channel no longer connected: the copy is simply gone.
                Err(_) => self.domain.lock().copy_released_here(id, self.key),
            }
        }
        // Clear the flag under the lock: a copy dropped meanwhile pushes its
        // entry under the same lock and sets the flag after it.
        let mut st = self.domain.lock();
        st.settle_pinned();
        if st.nothing_pending() {
            self.domain.shared.has_deferred.store(false, Ordering::Release);
        }
    }

    #[inline]
    fn flush_outbox(&mut self) {
        if !self.outbox.is_empty() {
            self.flush_outbox_now();
        }
    }

    fn flush_outbox_now(&mut self) {
        while let Some(msg) = self.outbox.front() {
            let link = self.link.as_mut().expect("connected");
            if !link.has_room() {
                return;
            }
            if link.send(msg).is_err() {
                return;
            }
            self.outbox.pop_front();
        }
    }

    /// Queue an answer generated while delivering. A side that has sent its
    /// teardown marker sends nothing more: callers check that first.
    fn reply(&mut self, msg: Message) {
        debug_assert!(!self.sent_teardown || msg == Message::Teardown);
        self.outbox.push_back(msg);
        self.flush_outbox();
    }

    fn poll_setup(&mut self) -> Option<Event> {
        let pending = self.pending.as_mut()?;
        let outcome = pending.poll()?;
        match outcome {
            Ok((mut link, neg, creator)) => {
                if let Err(e) = link.register(&self.wake) {
                    self.state = ChannelState::Closed;
                    self.pending = None;
                    self.inspect.counters.error();
                    self.inspect.update(|i| i.state = ChannelState::Closed);
                    return Some(Event::Error(e));
                }
                if link.peer_can_die() {
                    self.lent = Some(LentSet::default());
                }
                self.pending = None;
                self.state = ChannelState::Connected;
                self.trust = neg.trust;
                self.meta_size = neg.meta_size;
                self.constraints = neg.constraints;
                if !creator {
                    self.direction = neg.binder_direction;
                }
                // For a link that lands payloads while another channel polls.
                let gate = ChannelGate { domain: &self.domain, pools: &self.pools, direction: self.direction };
                if let Some(gate) = gate.detach() {
                    link.set_gate(gate);
                }
                let role = if creator { neg.creator_role } else { neg.binder_role };
                self.inspect.counters.sample_queue(0, link.capacity());
                let (peer, direction, trust) = (link.peer(), self.direction, self.trust);
                self.inspect.update(|i| {
                    (i.peer, i.role, i.direction, i.trust) = (peer, role, direction, trust);
                    i.state = ChannelState::Connected;
                });
                self.link = Some(link);
                if creator {
                    self.role = neg.creator_role;
                    Some(Event::BindRequest { binder_role: neg.binder_role })
                } else {
                    self.role = neg.binder_role;
                    Some(Event::Bound)
                }
            }
            Err(e) => {
                self.state = ChannelState::Closed;
                self.pending = None;
                self.inspect.counters.error();
                self.inspect.update(|i| i.state = ChannelState::Closed);
                Some(Event::Error(e))
            }
        }
    }

    /// The next message from the link, its payload (if the backend carries
    /// one) admitted by this channel's [`ChannelGate`].
    fn recv(&mut self) -> Result<Option<Message>> {
        let mut gate = ChannelGate { domain: &self.domain, pools: &self.pools, direction: self.direction };
        match self.link.as_deref_mut() {
            Some(link) => link.recv(&mut gate),
            None => Ok(None),
        }
    }

    fn poll_message(&mut self) -> Option<Event> {
        loop {
            let received = self.recv();
            return match received {
                Ok(Some(msg)) => match self.take(msg) {
                    Ok(Some(ev)) => Some(ev),
                    // A slot of an aggregate run that is not complete yet.
                    Ok(None) => continue,
                    Err(e) => Some(self.fail(e)),
                },
                Ok(None) => None,
                Err(e) => Some(self.link_failed(e)),
            };
        }
    }

    /// The link reported an error instead of a message.
    fn link_failed(&mut self, e: Error) -> Event {
        if matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::PeerUnresponsive(_)) && self.link_mut().peer_died() {
            self.reclaim_from_dead_peer();
        }
        if self.sent_teardown && e == ErrorKind::PeerGone {
            // The peer went away after our marker: that is a close.
            self.close();
            return Event::Closed { by_peer: false };
        }
        self.fail(e)
    }

    /// Take one message in: an event, or `None` for a slot of an aggregate
    /// run that is not complete yet.
    fn take(&mut self, msg: Message) -> Result<Option<Event>> {
        if self.assembling.is_none() && !matches!(msg, Message::AggHeader { .. } | Message::AggFrags { .. }) {
            // A pool request the policy accepted quietly is no event.
            return self.deliver(msg).map(|ev| self.apply_pool_policy(ev));
        }
        let taken = self.take_aggregate(msg);
        if taken.is_err() {
            // What the bad run brought goes back (moved buffers are ours:
            // to the free list; copies are released).
            self.assembling = None;
        }
        taken
    }

    /// One slot of an aggregate run, checked against what came before.
    fn take_aggregate(&mut self, msg: Message) -> Result<Option<Event>> {
        let wants_member = self.assembling.as_ref().map(|a| a.run.wants_member());
        match msg {
            Message::AggHeader { members, frags, total, meta } => {
                if wants_member.is_some() {
                    return Err(ErrorKind::Protocol("an aggregate run interrupted by another".into()).into());
                }
                if self.direction != Direction::Rx {
                    return Err(ErrorKind::Protocol("aggregate against the channel direction".into()).into());
                }
                let run = AggRun::start(members, frags, total, meta)?;
                self.assembling = Some(Assembly { run, held: Vec::new() });
            }
            Message::Move { ref meta, .. } | Message::Copy { ref meta, .. } if wants_member == Some(true) => {
                if !meta.is_empty() {
                    return Err(ErrorKind::Protocol("aggregate member with meta data".into()).into());
                }
                let held = match self.deliver(msg)? {
                    Event::MoveReceived { buffer, .. } => Held::Owned(buffer),
                    Event::CopyReceived { copy, .. } => Held::Copy(copy),
                    other => unreachable!("a move or copy delivers as such, not {other:?}"),
                };
                let a = self.assembling.as_mut().expect("assembling");
                a.run.add_member(held.bytes().len());
                a.held.push(held);
            }
            Message::AggFrags { first, entries } if wants_member.is_some() => {
                self.assembling.as_mut().expect("assembling").run.add_frags(first, &entries)?;
            }
            Message::AggFrags { .. } => {
                return Err(ErrorKind::Protocol("aggregate fragment table outside a run".into()).into());
            }
            other => {
                return Err(ErrorKind::Protocol(format!("{} interrupts an aggregate run", other.name())).into());
            }
        }
        if !self.assembling.as_ref().is_some_and(|a| a.run.is_complete()) {
            return Ok(None);
        }
        let Assembly { run, held } = self.assembling.take().expect("assembling");
        let (meta, entries, wire) = run.finish()?;
        self.inspect.counters.received(Op::Aggregate, 0);
        Ok(Some(Event::Aggregate { agg: Aggregate::from_received(held, entries, wire), meta }))
    }

    /// Apply the receiver-side effects of one message.
    fn deliver(&mut self, msg: Message) -> Result<Event> {
        let key = self.key;
        let is_move = matches!(msg, Message::Move { .. });
        match msg {
            Message::Move { buf, meta } | Message::Pass { buf, meta } => {
                let want = if is_move { Direction::Rx } else { Direction::Tx };
                if self.direction != want {
                    return Err(ErrorKind::Protocol(format!(
                        "{} against the channel direction",
                        if is_move { "move" } else { "pass" }
                    ))
                    .into());
                }
                let (view, ()) = self.delivered_view(buf, |st| {
                    if st.record(buf).is_some_and(|r| r.is_owned()) {
                        return Err(
                            ErrorKind::Protocol(format!("peer gave us buffer {} which we own", buf.index)).into()
                        );
                    }
                    st.arrived(buf, key);
                    Ok(())
                })?;
                if let Some(lent) = &mut self.lent {
                    lent.remove(&buf);
                }
                let buffer = self.spares.buffer(&self.domain.shared, view, buf.index);
                self.inspect.counters.received(if is_move { Op::Move } else { Op::Pass }, buffer.len() as u64);
                Ok(if is_move { Event::MoveReceived { buffer, meta } } else { Event::BufferPassed { buffer, meta } })
            }
            Message::Copy { buf, meta } => {
                if self.direction != Direction::Rx {
                    return Err(ErrorKind::Protocol("copy against the channel direction".into()).into());
                }
                let (view, ()) = self.delivered_view(buf, |st| {
                    if st.record(buf).is_some_and(|r| !r.may_receive_copy()) {
                        return Err(forged_copy(buf));
                    }
                    st.copy_received(buf, key);
                    Ok(())
                })?;
                self.inspect.counters.received(Op::Copy, view.geometry().buffer_size() as u64);
                Ok(Event::CopyReceived {
                    copy: BufferCopy::new(self.domain.shared.clone(), view, buf.index, key),
                    meta,
                })
            }
            Message::Release { buf } => {
                if self.direction != Direction::Tx {
                    return Err(ErrorKind::Protocol("release against the channel direction".into()).into());
                }
                let cross = self.lent.is_some();
                let (_, writable) = self.delivered_view(buf, |st| {
                    let writable = st.copy_returned(buf, key).ok_or_else(|| {
                        ErrorKind::Protocol(format!("release of a copy of buffer {} never sent", buf.index))
                    })?;
                    if cross {
                        st.entry(buf.pool).expect("pool checked").view.memory().copy_back(buf.index);
                    }
                    Ok(writable)
                })?;
                self.inspect.counters.received(Op::Release, 0);
                Ok(Event::CopyReleased { buffer: buf, writable })
            }
            Message::AssignRequest { pool, geometry, trust } => {
                self.inspect.counters.received(Op::PoolAssign, 0);
                self.deliver_assign(pool, geometry, trust)
            }
            Message::AssignReply { pool, accepted } => {
                match self.pools.iter_mut().find(|p| p.id == pool && p.assigning) {
                    Some(p) => p.assigning = false,
                    None => return Err(ErrorKind::Protocol(format!("reply for pool {pool} we did not offer")).into()),
                }
                if accepted {
                    self.chan_pool(pool).listed = true;
                    self.fix_pool(pool);
                    return Ok(Event::PoolAssigned(pool));
                }
                self.tidy_pool(pool);
                // The pool's trust returns to UNINITIALIZED if this was its
                // only use and it was never accepted anywhere.
                if let Some(e) = self.domain.lock().entry_mut(pool) {
                    if !e.trust_fixed && e.channels == 0 {
                        e.trust = TrustLevel::Uninitialized;
                    }
                }
                Ok(Event::PoolVetoed(pool))
            }
            Message::RemoveRequest { pool } => {
                self.inspect.counters.received(Op::PoolRemove, 0);
                if self.sent_teardown {
                    // We send nothing after our marker; the pool stays.
                    return Ok(Event::PoolRemoveRefused(pool));
                }
                let in_use = self.domain.lock().entry(pool).is_some_and(|e| e.copies_on(key));
                if in_use {
                    self.reply(Message::RemoveReply { pool, accepted: false });
                    return Ok(Event::PoolRemoveRefused(pool));
                }
                if let Some(p) = self.pools.iter_mut().find(|p| p.id == pool) {
                    p.listed = false;
                }
                self.tidy_pool(pool);
                self.reply(Message::RemoveReply { pool, accepted: true });
                Ok(Event::PoolRemoved(pool))
            }
            Message::RemoveReply { pool, accepted } => {
                match self.pools.iter_mut().find(|p| p.id == pool && p.removing) {
                    Some(p) => {
                        p.removing = false;
                        if accepted {
                            p.listed = false;
                        }
                    }
                    None => {
                        return Err(ErrorKind::Protocol(format!(
                            "removal reply for pool {pool} we did not ask to remove"
                        ))
                        .into())
                    }
                }
                self.tidy_pool(pool);
                Ok(if accepted { Event::PoolRemoved(pool) } else { Event::PoolRemoveRefused(pool) })
            }
            // Taken by `take` (never delivered one by one).
            Message::AggHeader { .. } | Message::AggFrags { .. } => {
                Err(ErrorKind::Protocol("aggregate slot outside a run".into()).into())
            }
            Message::Teardown => {
                self.got_teardown = true;
                let by_peer = !self.sent_teardown;
                if !self.sent_teardown {
                    self.state = ChannelState::Teardown;
                    self.inspect.update(|i| i.state = ChannelState::Teardown);
                    self.sent_teardown = true;
                    self.reply(Message::Teardown);
                }
                self.close();
                Ok(Event::Closed { by_peer })
            }
        }
    }

    fn deliver_assign(&mut self, pool: PoolId, geometry: Geometry, trust: TrustLevel) -> Result<Event> {
        if trust != self.trust {
            return Err(ErrorKind::Protocol(format!(
                "pool {pool} offered with trust {trust:?} on a {:?} channel",
                self.trust
            ))
            .into());
        }
        // Offering a pool we list, or one already offered, is a protocol
        // error; a concurrent offer of a pool we are offering ourselves is not
        // (it is vetoed below).
        if self.pools.iter().any(|p| p.id == pool && p.listed) || self.requests.iter().any(|r| r.pool == pool) {
            return Err(ErrorKind::Protocol(format!("pool {pool} offered twice")).into());
        }
        // Both ends offered this pool at once: veto the peer's offer (ours is
        // out, and the peer vetoes it likewise), so the two ends agree that
        // the pool is not assigned; either may offer it again.
        if !self.sent_teardown && self.pools.iter().any(|p| p.id == pool && p.assigning) {
            self.reply(Message::AssignReply { pool, accepted: false });
            self.link_mut().discard_pool(pool);
            return Ok(Event::PoolVetoed(pool));
        }
        // From here until an unknown pool is in the list, no other channel
        // of the domain may import the same pool.
        let shared = Arc::clone(&self.domain.shared);
        let _importing = shared.importing();
        // A known pool's request relation is counted under the lock that
        // finds it, so the pool cannot leave the list while we answer.
        // A pool only offered to us so far (never created nor accepted
        // here) has the trust of the last offer, which binds nothing: its
        // owner may have set it back and offer it again at another.
        let known = self.domain.lock().entry_mut(pool).map(|e| {
            e.channels += 1;
            (e.view.geometry(), if e.permanent { e.trust } else { TrustLevel::Uninitialized })
        });
        let acceptable = match known {
            Some((g, t)) => g == geometry && (t == TrustLevel::Uninitialized || t == trust),
            None => true,
        } && self.constraints.admits(geometry);
        if !acceptable {
            // The library vetoes by itself: wrong geometry for a known id, a
            // trust conflict, or the channel's constraints.
            if known.is_some() {
                self.detach(pool);
            }
            self.reply(Message::AssignReply { pool, accepted: false });
            self.link_mut().discard_pool(pool);
            return Ok(Event::PoolVetoed(pool));
        }
        // The channel's limits, before anything of the pool is mapped.
        if let Err(reason) = self.peer_pools_admit(geometry) {
            if known.is_some() {
                self.detach(pool);
            }
            // (Nothing goes out after our teardown marker.)
            if !self.sent_teardown {
                self.reply(Message::AssignReply { pool, accepted: false });
            }
            self.link_mut().discard_pool(pool);
            return Ok(Event::PoolOfferRefused { pool, reason });
        }
        if known.is_some() {
            let memory = self.domain.lock().entry(pool).expect("counted").view.memory().clone();
            if let Err(e) = self.link_mut().use_pool(&memory) {
                self.detach(pool);
                return Err(e);
            }
        } else {
            let memory = self.link_mut().import_pool(pool, geometry)?;
            let initial = if trust.protects() { Access::None } else { Access::ReadWrite };
            let view = PoolView::map(memory, initial, self.constraints.alignment)?;
            let mut st = self.domain.lock();
            st.insert_received(view, trust)?;
            st.entry_mut(pool).expect("inserted").channels += 1;
        }
        self.domain.lock().entry_mut(pool).expect("counted").trust = trust;
        let req = PoolRequest { pool, geometry, trust };
        self.requests.push(req);
        Ok(Event::PoolAssignRequest(req))
    }

    /// Whether one more pool from the peer, of `geometry`, stays within the
    /// channel's limits (the peer's pools: accepted, or waiting for an answer).
    fn peer_pools_admit(&self, geometry: Geometry) -> Result<()> {
        let st = self.domain.lock();
        let accepted = self.pools.iter().filter(|p| p.listed && p.by_peer).map(|p| p.id);
        let (mut count, mut bytes) = (self.requests.len(), 0usize);
        for r in &self.requests {
            bytes = bytes.saturating_add(r.geometry.len());
        }
        for id in accepted {
            count += 1;
            bytes = bytes.saturating_add(st.entry(id).map_or(0, |e| e.view.geometry().len()));
        }
        self.limits.admit(count, bytes, geometry)
    }

    /// The view of a buffer named by the peer, checking that its pool is on
    /// this channel and the index is in range; then `apply` the delivery's
    /// state change under the same domain lock (one lock per delivery).
    fn delivered_view<R>(
        &mut self,
        buf: BufferId,
        apply: impl FnOnce(&mut DomainState) -> Result<R>,
    ) -> Result<(Arc<PoolView>, R)> {
        if !self.pools.iter().any(|p| p.id == buf.pool && p.listed) {
            return Err(ErrorKind::Protocol(format!("buffer of pool {} which is not assigned", buf.pool)).into());
        }
        let mut st = self.domain.lock();
        let e = st.entry(buf.pool).ok_or_else(|| ErrorKind::Protocol(format!("unknown pool {}", buf.pool)))?;
        if buf.index >= e.view.geometry().count() {
            return Err(ErrorKind::Protocol(format!("buffer index {} out of range", buf.index)).into());
        }
        let view = self.spares.view(&e.view);
        Ok((view, apply(&mut st)?))
    }

    /// Closed for good: give the pools and deferred copies up. Replies still
    /// waiting for queue room go out with the close.
    fn close(&mut self) {
        self.close_with(Vec::new());
    }

    fn close_with(&mut self, mut last: Vec<Message>) {
        // An aggregate run cut short by the close: its buffers go back now.
        drop(self.assembling.take());
        self.state = ChannelState::Closed;
        self.inspect.update(|i| i.state = ChannelState::Closed);
        let mut pending: Vec<Message> = self.outbox.drain(..).collect();
        pending.append(&mut last);
        if let Some(link) = self.link.as_mut() {
            link.close(pending);
            // Nothing of the link wakes a closed end: its fd stays quiet
            // (a peer's hang-up or last ring would keep it readable).
            link.unregister(&self.wake);
        }
        let cross = self.link.as_ref().is_some_and(|l| l.peer_can_die());
        let related: Vec<PoolId> =
            self.pools.drain(..).map(|p| p.id).chain(self.requests.drain(..).map(|r| r.pool)).collect();
        // A closed end keeps nothing of its pools (it may live on unused).
        if let Some(link) = self.link.as_mut() {
            for &pool in &related {
                link.forget_pool(pool);
            }
        }
        self.spares = Spares::default();
        let mut st = self.domain.lock();
        st.forget_channel(self.key, cross);
        for &pool in &related {
            if let Some(e) = st.entry_mut(pool) {
                e.channels -= 1;
            }
        }
        // The pools this channel was the last reference to leave the list
        // (dropped after the lock: unmapping takes a while).
        let gone: Vec<_> = related.into_iter().filter_map(|pool| st.release_if_unused(pool)).collect();
        drop(st);
        drop(gone);
    }

    /// The peer process exited: what we lent it and it still had is ours
    /// again (to the free list), and the copies it held are void. What it
    /// passed on to a third process stays there (the pool's ledger says so).
    fn reclaim_from_dead_peer(&mut self) {
        let mut st = self.domain.lock();
        for id in self.lent.take().unwrap_or_default() {
            if st.still_lent(id, self.key) {
                st.take_ownership(id);
                st.pin_if_copies_out(id);
                st.free(id);
            }
        }
        st.void_copies_out(self.key);
        if !st.nothing_pending() {
            self.domain.shared.has_deferred.store(true, Ordering::Release);
        }
    }

    fn fail(&mut self, e: Error) -> Event {
        self.inspect.counters.error();
        if self.link.as_mut().is_some_and(|l| l.abandon()) {
            self.reclaim_from_dead_peer();
        }
        self.close();
        Event::Error(e)
    }
}

impl Channel {
    /// At drop: a copy nobody saw goes back, now if the queue has room,
    /// otherwise with the close (in `last`).
    fn release_unseen_event(&mut self, ev: Event, last: &mut Vec<Message>) {
        match ev {
            Event::CopyReceived { copy, .. } => self.release_unseen(copy, last),
            Event::Aggregate { agg, .. } => {
                // Nobody saw it: each member handle is the only one.
                for held in agg.into_parts().members.into_iter().flatten() {
                    if let Ok(Held::Copy(copy)) = Arc::try_unwrap(held) {
                        self.release_unseen(copy, last);
                    }
                }
            }
            _ => {}
        }
    }

    fn release_unseen(&mut self, copy: BufferCopy, last: &mut Vec<Message>) {
        if let Err(refused) = self.release(copy) {
            let copy = refused.into_inner();
            let id = copy.id();
            copy.consume();
            self.domain.lock().copy_released_here(id, self.key);
            last.push(Message::Release { buf: id });
        }
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

impl Drop for Channel {
    /// Dropping a live channel is an abrupt close: messages already queued
    /// to us are taken in (moved and passed buffers become ours and go to the
    /// free list; copies never seen are released again), then the peer
    /// learns that we are gone.
    fn drop(&mut self) {
        if !matches!(self.state, ChannelState::Connected | ChannelState::Teardown) {
            return;
        }
        let mut last = Vec::new();
        // Events a helper took and nobody polled are unseen too.
        for ev in std::mem::take(&mut self.helpers.held) {
            self.release_unseen_event(ev, &mut last);
        }
        while let Ok(Some(msg)) = self.recv() {
            match self.take(msg) {
                Ok(Some(ev)) => self.release_unseen_event(ev, &mut last),
                Ok(None) => {}
                Err(_) => break,
            }
            if self.state == ChannelState::Closed {
                return;
            }
        }
        // An aggregate run cut short by the drop: its copies go back too.
        if let Some(a) = self.assembling.take() {
            for held in a.held {
                if let Held::Copy(copy) = held {
                    self.release_unseen(copy, &mut last);
                }
            }
        }
        self.close_with(last);
    }
}

/// A channel's check of an arriving payload (see [`PayloadGate`]): the
/// buffer's pool is on the channel, the index is in range, the message goes
/// the channel's way, and the buffer is not one this domain owns (a peer
/// cannot overwrite our data) or reads (a copy we hold cannot change).
struct ChannelGate<'a> {
    domain: &'a Domain,
    pools: &'a [ChanPool],
    direction: Direction,
}

impl PayloadGate for ChannelGate<'_> {
    fn admit(&mut self, msg: &Message) -> Result<Landing> {
        let pools = self.pools;
        admit_payload(self.domain, self.direction, |id| pools.iter().any(|p| p.id == id && p.listed), msg)
    }

    fn detach(&self) -> Option<Box<dyn PayloadGate + Send>> {
        Some(Box::new(DetachedGate { domain: self.domain.clone(), direction: self.direction }))
    }
}

/// The part of a [`ChannelGate`] that does not borrow the channel: the
/// domain's buffer states and the channel's direction. Whether the pool is
/// on the channel is for its holder (a link that lands payloads for a
/// channel that is not polling) to check against the pools the channel
/// gave it.
struct DetachedGate {
    domain: Domain,
    direction: Direction,
}

impl PayloadGate for DetachedGate {
    fn admit(&mut self, msg: &Message) -> Result<Landing> {
        admit_payload(&self.domain, self.direction, |_| true, msg)
    }
}

/// A copy of a buffer we own and have no copy out of: no such copy can
/// exist, so the peer made it up (see `BufRecord::may_receive_copy`).
fn forged_copy(buf: BufferId) -> Error {
    ErrorKind::Protocol(format!("peer sent a copy of buffer {} which we own and never copied", buf.index)).into()
}

/// See [`ChannelGate`]; `listed` says whether a pool is on the channel.
fn admit_payload(
    domain: &Domain,
    direction: Direction,
    listed: impl Fn(PoolId) -> bool,
    msg: &Message,
) -> Result<Landing> {
    {
        let (buf, want, gives) = match msg {
            Message::Move { buf, .. } => (*buf, Direction::Rx, true),
            Message::Pass { buf, .. } => (*buf, Direction::Tx, true),
            Message::Copy { buf, .. } => (*buf, Direction::Rx, false),
            _ => return Err(ErrorKind::Protocol("payload on a message that carries none".into()).into()),
        };
        if direction != want {
            return Err(ErrorKind::Protocol("buffer message against the channel direction".into()).into());
        }
        if !listed(buf.pool) {
            return Err(ErrorKind::Protocol(format!("buffer of pool {} which is not assigned", buf.pool)).into());
        }
        let st = domain.lock();
        let count = st.entry(buf.pool).map_or(0, |e| e.view.geometry().count());
        if buf.index >= count {
            return Err(ErrorKind::Protocol(format!("buffer index {} out of range", buf.index)).into());
        }
        if !gives && st.record(buf).is_some_and(|r| !r.may_receive_copy()) {
            return Err(forged_copy(buf));
        }
        let view = &st.entry(buf.pool).expect("pool listed on the channel").view;
        match st.buffer_state(buf.pool, buf.index) {
            // Not here, but maybe in another domain of this process that
            // shares the memory the bytes would land in.
            BufferState::Invalid => match view.memory().held_elsewhere(buf.index, view) {
                None => Ok(Landing::Land),
                Some(BufferState::ReadOnly | BufferState::ReadOnlyOwned) if !gives => Ok(Landing::Discard),
                Some(_) => Err(ErrorKind::Protocol(format!(
                    "peer sent buffer {} which another domain of this process holds",
                    buf.index
                ))
                .into()),
            },
            BufferState::ReadWrite | BufferState::ReadOnlyOwned if gives => {
                Err(ErrorKind::Protocol(format!("peer gave us buffer {} which we own", buf.index)).into())
            }
            // A copy of a buffer we own or already read: the bytes are the
            // ones we have (nobody may write it while copies are out).
            _ => Ok(Landing::Discard),
        }
    }
}
