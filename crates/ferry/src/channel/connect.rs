//! The short path from nothing to the first move: helpers over the explicit
//! operations of [`Channel`], for the common cases.
//!
//! - [`Channel::accept`] creates a channel and waits until a binder is
//!   connected; [`Channel::connect`] binds, retrying while nobody listens
//!   yet (two processes may start in any order), and waits for the reply;
//!   [`Channel::wait_connected`] is the waiting half of both.
//! - [`PoolPolicy::AcceptAll`] lets the library accept every pool the peer
//!   offers; [`Channel::assign_pool_and_wait`] offers one and waits for the
//!   answer.
//!
//! Nothing is lost while a helper waits: the events it takes that are not
//! the one it waits for are kept, and [`Channel::poll`] and
//! [`Channel::wait`] hand them out first, in the order they arrived.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{BindParams, Channel, ChannelSetup, ChannelState, Event};
use crate::backend::Endpoint;
use crate::domain::Domain;
use crate::domain::Pool;
use crate::error::{Result, ResultExt};
use crate::proto::Message;
use crate::ErrorKind;

/// How a channel end answers the pool-assignment requests of its peer
/// ([`Channel::set_pool_policy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolPolicy {
    /// The application answers each [`Event::PoolAssignRequest`] with
    /// [`Channel::respond_pool`] (the default).
    #[default]
    Ask,
    /// The library accepts every pool the peer offers, as the request is
    /// delivered (the answer goes out at once, also on a backend that
    /// batches sends), and reports nothing: no
    /// [`Event::PoolAssignRequest`] reaches the application's event loop,
    /// which has nothing to do with it ([`Channel::is_assigned`] tells
    /// whether a pool is on the channel; the first buffer of a pool
    /// arrives after its acceptance). Pools the library vetoes by itself
    /// (outside the channel's constraints or limits) are still vetoed and
    /// reported as such. A request that arrives after this end started a
    /// teardown cannot be answered: it is reported, and stays pending.
    AcceptAll,
    /// As [`AcceptAll`](PoolPolicy::AcceptAll), and each accepted request
    /// is still reported as an [`Event::PoolAssignRequest`], for
    /// information: the pool is already assigned
    /// ([`Channel::is_assigned`] is true) and there is nothing to answer
    /// ([`Channel::respond_pool`] would fail with
    /// [`ErrorKind::NoPendingRequest`]). For a domain that learns of pools to
    /// pass them on (along a data path, with
    /// [`forward_pool`](crate::forward_pool)) or that counts them.
    AcceptAndReport,
}

/// The helpers' state in a channel end.
#[derive(Debug, Default)]
pub(super) struct Helpers {
    policy: PoolPolicy,
    /// Events a waiting helper took, for the next `poll`.
    pub(super) held: VecDeque<Event>,
}

/// How long [`Channel::connect`] pauses between two binds at most.
pub(crate) const RETRY_MAX: Duration = Duration::from_millis(50);

impl Channel {
    /// Create a channel on `endpoint` ([`Channel::create`]) and wait until
    /// a binder is connected ([`Channel::wait_connected`]): the channel is
    /// returned `Connected`, the [`Event::BindRequest`] taken.
    /// [`ErrorKind::TimedOut`] if no binder came within `timeout` (the endpoint
    /// is free again); the errors of [`Channel::create`].
    ///
    /// For a TCP endpoint on port 0, whose address the binder must learn
    /// first, call [`Channel::create`], read
    /// [`listen_addr`](Channel::listen_addr), then
    /// [`wait_connected`](Channel::wait_connected).
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{BindParams, Channel, ChannelSetup, ChannelState, Domain, Endpoint};
    ///
    /// let ep = Endpoint::local();
    /// let binder = {
    ///     let ep = ep.clone();
    ///     std::thread::spawn(move || {
    ///         Channel::connect(&Domain::new("receiver"), &ep, BindParams::default(), Duration::from_secs(10))
    ///     })
    /// };
    /// let tx = Channel::accept(&Domain::new("sender"), &ep, ChannelSetup::default(), Duration::from_secs(10))?;
    /// let rx = binder.join().unwrap()?;
    /// assert_eq!((tx.state(), rx.state()), (ChannelState::Connected, ChannelState::Connected));
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn accept(domain: &Domain, endpoint: &Endpoint, setup: ChannelSetup, timeout: Duration) -> Result<Channel> {
        let accepted = Channel::create_bare(domain, endpoint, setup).and_then(|mut ch| {
            ch.wait_connected_bare(timeout)?;
            Ok(ch)
        });
        accepted.context(|| format!("accept a channel on {endpoint}"))
    }

    /// Bind to `endpoint` ([`Channel::bind`]) and wait for the creator's
    /// reply ([`Channel::wait_connected`]): the channel is returned
    /// `Connected`, the [`Event::Bound`] taken. While nobody listens on the
    /// endpoint yet, the bind is retried (pausing up to 50 ms) until
    /// `timeout`: the creator may start after the binder.
    ///
    /// Errors: [`ErrorKind::EndpointNotListening`] if nobody listened within
    /// `timeout`; [`ErrorKind::TimedOut`] if the creator did not answer in time;
    /// [`ErrorKind::BindRefused`] if it refused; the other errors of
    /// [`Channel::bind`] at once. (Over TCP, one attempt to reach a host
    /// that does not answer at all may take the backend's setup timeout of
    /// 10 s, past `timeout`.)
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{BindParams, Channel, Domain, Endpoint, Error, ErrorKind};
    ///
    /// // Nobody creates a channel on this endpoint.
    /// let err = Channel::connect(&Domain::new("d"), &Endpoint::local(), BindParams::default(), Duration::from_millis(20));
    /// assert_eq!(err.unwrap_err(), ErrorKind::EndpointNotListening);
    /// ```
    pub fn connect(domain: &Domain, endpoint: &Endpoint, params: BindParams, timeout: Duration) -> Result<Channel> {
        Channel::connect_bare(domain, endpoint, params, timeout).context(|| format!("connect to {endpoint}"))
    }

    /// [`Channel::connect`], its errors without context.
    fn connect_bare(domain: &Domain, endpoint: &Endpoint, params: BindParams, timeout: Duration) -> Result<Channel> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        let mut ch = loop {
            match Channel::bind_bare(domain, endpoint, params) {
                Ok(ch) => break ch,
                Err(e) if e == ErrorKind::EndpointNotListening => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ErrorKind::EndpointNotListening.into());
                    }
                    std::thread::sleep(pause.min(left));
                    pause = (pause * 2).min(RETRY_MAX);
                }
                Err(e) => return Err(e),
            }
        };
        ch.wait_connected_bare(deadline.saturating_duration_since(Instant::now()))?;
        Ok(ch)
    }

    /// Wait until a channel being created or bound is connected, taking its
    /// [`Event::BindRequest`] or [`Event::Bound`]. `Ok` at once if it is
    /// connected already; [`ErrorKind::TimedOut`] after `timeout`; the error of
    /// a failed setup ([`ErrorKind::BindRefused`], [`ErrorKind::PeerGone`], …);
    /// [`ErrorKind::NotConnected`] for a channel that is tearing down or closed.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{Channel, ChannelSetup, Domain, Endpoint, Error, ErrorKind};
    ///
    /// let mut ch = Channel::create(&Domain::new("d"), &Endpoint::local(), ChannelSetup::default())?;
    /// assert_eq!(ch.wait_connected(Duration::from_millis(10)), Err(ErrorKind::TimedOut.into())); // nobody binds
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn wait_connected(&mut self, timeout: Duration) -> Result<()> {
        self.wait_connected_bare(timeout).context(|| format!("set up {}", self.name))
    }

    /// [`Channel::wait_connected`], its errors without context.
    fn wait_connected_bare(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.state {
                ChannelState::Connected => return Ok(()),
                ChannelState::Initialized | ChannelState::Binding => {}
                s => return Err(ErrorKind::NotConnected(s).into()),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.wait_unheld(left) {
                Some(Event::BindRequest { .. } | Event::Bound) => return Ok(()),
                Some(Event::Error(e)) => return Err(e),
                // Nothing else arrives before the channel is connected.
                Some(other) => self.helpers.held.push_back(other),
                // Timed out, or closed (the next round says so).
                None if matches!(self.state, ChannelState::Initialized | ChannelState::Binding) => {
                    return Err(ErrorKind::TimedOut.into())
                }
                None => {}
            }
        }
    }

    /// Set how this end answers the peer's pool-assignment requests (see
    /// [`PoolPolicy`]); it applies to the requests delivered from now on.
    /// May be set in any state, also before the channel is connected.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, PoolConstraints, PoolPolicy};
    ///
    /// let (a, b) = (Domain::new("sender"), Domain::new("receiver"));
    /// let ep = Endpoint::local();
    /// let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    /// let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    /// rx.set_pool_policy(PoolPolicy::AcceptAll);
    /// let t = Duration::from_secs(10);
    /// tx.wait_connected(t)?;
    /// rx.wait_connected(t)?;
    ///
    /// let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// tx.assign_pool(alloc.pool())?;
    /// assert!(rx.poll().is_none());              // accepted as it arrived: no event
    /// assert!(rx.is_assigned(alloc.pool().id()));
    /// assert!(matches!(tx.wait(Some(t)), Ok(ferry::Event::PoolAssigned(_))));
    ///
    /// // AcceptAndReport accepts too, and says so.
    /// let other = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// rx.set_pool_policy(PoolPolicy::AcceptAndReport);
    /// tx.assign_pool(other.pool())?;
    /// assert!(matches!(rx.poll(), Some(ferry::Event::PoolAssignRequest(r)) if r.pool == other.pool().id()));
    /// assert!(rx.is_assigned(other.pool().id()));
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn set_pool_policy(&mut self, policy: PoolPolicy) {
        self.helpers.policy = policy;
    }

    /// The policy set by [`set_pool_policy`](Channel::set_pool_policy).
    pub fn pool_policy(&self) -> PoolPolicy {
        self.helpers.policy
    }

    /// Assign `pool` to the channel ([`Channel::assign_pool`]) and wait for
    /// the peer's answer: `Ok` once it is assigned; [`ErrorKind::PoolVetoed`] if
    /// the peer vetoed it; [`ErrorKind::TimedOut`] if no answer came within
    /// `timeout` (the request stays out: its answer is delivered as an
    /// event later); the error of a channel that failed or closed meanwhile;
    /// the errors of [`Channel::assign_pool`] (a full queue is waited out).
    ///
    /// Every other event that arrives meanwhile is kept, and handed out by
    /// the next [`poll`](Channel::poll) or [`wait`](Channel::wait), in
    /// order (an [`Event::Error`] or [`Event::Closed`] too).
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, PoolConstraints, PoolPolicy};
    ///
    /// let (a, b) = (Domain::new("sender"), Domain::new("receiver"));
    /// let ep = Endpoint::local();
    /// let t = Duration::from_secs(10);
    /// let receiver = {
    ///     let ep = ep.clone();
    ///     std::thread::spawn(move || -> ferry::Result<usize> {
    ///         let mut rx = Channel::connect(&b, &ep, BindParams::default(), t)?;
    ///         rx.set_pool_policy(PoolPolicy::AcceptAll);
    ///         loop {
    ///             if let Ok(ferry::Event::MoveReceived { buffer, .. }) = rx.wait(Some(t)) {
    ///                 return Ok(buffer.len());
    ///             }
    ///         }
    ///     })
    /// };
    /// let mut tx = Channel::accept(&a, &ep, ChannelSetup::default(), t)?;
    /// let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// tx.assign_pool_and_wait(alloc.pool(), t)?;
    /// tx.move_buffer(alloc.alloc().unwrap(), &[])?;
    /// assert_eq!(receiver.join().unwrap()?, 4096);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn assign_pool_and_wait(&mut self, pool: &Pool, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut taken = Vec::new();
        let result = self.assign_and_wait(pool, deadline, &mut taken);
        self.helpers.held.extend(taken);
        result.context(|| format!("assign pool {} to {}", pool.id(), self.name))
    }

    fn assign_and_wait(&mut self, pool: &Pool, deadline: Instant, taken: &mut Vec<Event>) -> Result<()> {
        let id = pool.id();
        // Keep what arrives (an end event too) and say why waiting stops.
        let keep = |ev: Event, taken: &mut Vec<Event>| -> Result<()> {
            let stop = match &ev {
                Event::Error(e) => Err(e.clone()),
                Event::Closed { .. } => Err(ErrorKind::NotConnected(ChannelState::Closed).into()),
                _ => Ok(()),
            };
            taken.push(ev);
            stop
        };
        loop {
            match self.assign_pool_bare(pool) {
                Ok(()) => break,
                Err(e) if e == ErrorKind::QueueFull => {
                    // Room comes when the peer takes messages: look again soon.
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ErrorKind::TimedOut.into());
                    }
                    if let Some(ev) = self.wait_unheld(left.min(Duration::from_millis(1))) {
                        keep(ev, taken)?;
                    }
                }
                Err(e) => return Err(e),
            }
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.wait_unheld(left) {
                Some(Event::PoolAssigned(p)) if p == id => return Ok(()),
                Some(Event::PoolVetoed(p)) if p == id => return Err(ErrorKind::PoolVetoed(id).into()),
                Some(ev) => keep(ev, taken)?,
                None if self.state == ChannelState::Closed => {
                    return Err(ErrorKind::NotConnected(ChannelState::Closed).into())
                }
                None => return Err(ErrorKind::TimedOut.into()),
            }
        }
    }

    /// [`Channel::wait`] for a new arrival, leaving the held events where
    /// they are (they stay first in line).
    pub(crate) fn wait_unheld(&mut self, timeout: Duration) -> Option<Event> {
        let held = std::mem::take(&mut self.helpers.held);
        let ev = self.wait(Some(timeout)).ok();
        debug_assert!(self.helpers.held.is_empty(), "wait holds nothing back");
        self.helpers.held = held;
        ev
    }

    /// [`Channel::poll`] for a new arrival, leaving the held events where
    /// they are (they stay first in line). For waiting helpers outside this
    /// module (the async ones of `ferry::tokio`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn poll_unheld(&mut self) -> Option<Event> {
        let held = std::mem::take(&mut self.helpers.held);
        let ev = self.poll();
        self.helpers.held = held;
        ev
    }

    /// [`Channel::arm`] as if no event were held: `false` when a new arrival
    /// (or room) may be waiting.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn arm_unheld(&mut self) -> bool {
        let held = std::mem::take(&mut self.helpers.held);
        let armed = self.arm();
        self.helpers.held = held;
        armed
    }

    /// Busy-wait up to `spin` for an arrival, as [`Channel::wait`] does
    /// before it sleeps: `true` if one may be there.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn spin_for(&mut self, spin: Duration) -> bool {
        !spin.is_zero() && self.link.as_mut().is_some_and(|l| l.spin(spin))
    }

    /// Keep an event a waiting helper took: [`Channel::poll`] hands it out
    /// after those held before it.
    pub(crate) fn hold(&mut self, ev: Event) {
        self.helpers.held.push_back(ev);
    }

    /// Take the buffers of `pool` that came back ([`Event::BufferPassed`])
    /// among the events a helper kept, and drop them (to their domain's free
    /// list): for [`Allocator::alloc_wait`](crate::Allocator::alloc_wait).
    /// The other held events stay, in order.
    pub(crate) fn drop_held_passes(&mut self, pool: crate::pool::PoolId) {
        self.helpers.held.retain(|ev| !matches!(ev, Event::BufferPassed { buffer, .. } if buffer.id().pool == pool));
    }

    /// Under [`PoolPolicy::AcceptAll`] and [`PoolPolicy::AcceptAndReport`],
    /// accept the pool of a request just delivered (the reply is queued
    /// like every reply made while delivering, so a full queue does not
    /// lose it). The event, or `None` when [`PoolPolicy::AcceptAll`]
    /// accepted it: there is nothing to report.
    pub(super) fn apply_pool_policy(&mut self, ev: Event) -> Option<Event> {
        let Event::PoolAssignRequest(req) = &ev else { return Some(ev) };
        if self.helpers.policy == PoolPolicy::Ask || self.state != ChannelState::Connected {
            return Some(ev);
        }
        let Some(pos) = self.requests.iter().position(|r| r.pool == req.pool) else { return Some(ev) };
        self.reply(Message::AssignReply { pool: req.pool, accepted: true });
        self.settle_request(pos, true);
        // The application does not know there is a reply to send: a
        // backend that batches sends it now (an error shows at the next
        // operation).
        let _ = self.link_mut().flush();
        match self.helpers.policy {
            PoolPolicy::AcceptAndReport => Some(ev),
            _ => None,
        }
    }
}
