//! What an end takes in: `poll`/`wait`/`arm`, the setup handshake while
//! connecting, delivery of each arriving message, and the gate that
//! admits a payload before its bytes land.

use super::{Assembly, ChanPool, Channel, Event};
use crate::aggregate::{Aggregate, Held};
use crate::backend::{Landing, PayloadGate};
use crate::buffer::{BufferCopy, BufferId, BufferState};
use crate::domain::{Domain, DomainState, LentSet, PoolEntry};
use crate::error::{Error, Result, WaitError};
use crate::inspect::Op;
use crate::pool::{PoolId, PoolView, TrustLevel};
use crate::proto::{AggRun, Message};
use crate::setup::{ChannelState, Direction};
use crate::wake::Arm;
use crate::ErrorKind;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Channel {
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
                // Both ends see the same link and the same negotiated trust.
                self.same_domain = link.same_domain() && neg.trust == TrustLevel::Full;
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
                self.inspect.counters.connected(self.direction, link.capacity());
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
    pub(super) fn recv(&mut self) -> Result<Option<Message>> {
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
                // A buffer moved or passed outside an aggregate run (the
                // data path): straight to delivery. It is never a pool
                // request, so the pool policy has nothing to do with it,
                // and the event is not moved through `take`'s result.
                Ok(Some(msg))
                    if self.assembling.is_none() && matches!(msg, Message::Move { .. } | Message::Pass { .. }) =>
                {
                    Some(self.deliver(msg).unwrap_or_else(|e| self.fail(e)))
                }
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
    #[inline]
    pub(super) fn take(&mut self, msg: Message) -> Result<Option<Event>> {
        if self.assembling.is_none() && !matches!(msg, Message::AggHeader { .. } | Message::AggFrags { .. }) {
            let ev = self.deliver(msg)?;
            if let Event::PoolAssignRequest(_) = ev {
                // A pool request the policy accepted quietly is no event.
                return Ok(self.apply_pool_policy(ev));
            }
            // Every other event as it is: inlined here and without the
            // policy's look, the event (over 100 bytes) is not moved from
            // one frame to the next on its way to the caller.
            return Ok(Some(ev));
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
                if self.same_domain {
                    // It never left the domain: nothing to record.
                    let view = self.same_domain_view(buf)?;
                    let buffer = self.spares.buffer(&self.domain.shared, view, buf.index);
                    self.inspect.counters.received(if is_move { Op::Move } else { Op::Pass }, buffer.len() as u64);
                    return Ok(if is_move {
                        Event::MoveReceived { buffer, meta }
                    } else {
                        Event::BufferPassed { buffer, meta }
                    });
                }
                let (view, ()) = self.delivered_view(buf, |e| {
                    if !DomainState::arrived_in(e, buf.index, key) {
                        return Err(
                            ErrorKind::Protocol(format!("peer gave us buffer {} which we own", buf.index)).into()
                        );
                    }
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
                let (view, ()) = self.delivered_view(buf, |e| {
                    if !DomainState::copy_arrived_in(e, buf.index, key) {
                        return Err(forged_copy(buf));
                    }
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
                let writable = self.delivered(buf, |st| {
                    st.copy_came_back(buf, key, cross).ok_or_else(|| {
                        ErrorKind::Protocol(format!("release of a copy of buffer {} never sent", buf.index)).into()
                    })
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

    /// The view of a buffer named by the peer, checking that its pool is on
    /// this channel and the index is in range; then `apply` the delivery's
    /// state change to the pool's entry under the same domain lock (one
    /// lock and one look-up of the pool per delivery).
    #[inline]
    fn delivered_view<R>(
        &mut self,
        buf: BufferId,
        apply: impl FnOnce(&mut PoolEntry) -> Result<R>,
    ) -> Result<(Arc<PoolView>, R)> {
        self.check_listed(buf)?;
        let mut st = self.domain.lock();
        let e = named_entry_mut(&mut st, buf)?;
        let view = self.spares.view(&e.view);
        Ok((view, apply(e)?))
    }

    /// The view for a handle of `buf`, moved or passed to us by an end of
    /// our own domain (see [`Channel::same_domain`]): the one the last
    /// buffer we gave away left in the spares (a channel's buffers go back
    /// and forth), else the domain's, looked up without changing anything.
    fn same_domain_view(&mut self, buf: BufferId) -> Result<Arc<PoolView>> {
        self.check_listed(buf)?;
        if let Some(view) = self.spares.view_of(buf.pool) {
            if buf.index < view.geometry().count() {
                return Ok(view);
            }
        }
        let st = self.domain.lock();
        Ok(named_entry(&st, buf)?.view.clone())
    }

    /// [`Channel::delivered_view`] for a delivery that makes no handle (a
    /// release): no view reference taken and let go.
    fn delivered<R>(&mut self, buf: BufferId, apply: impl FnOnce(&mut DomainState) -> Result<R>) -> Result<R> {
        self.check_listed(buf)?;
        let mut st = self.domain.lock();
        named_entry(&st, buf)?;
        apply(&mut st)
    }

    /// A buffer named by the peer is of a pool on this channel (checked
    /// before the domain lock: nothing of the domain in it).
    #[inline]
    fn check_listed(&self, buf: BufferId) -> Result<()> {
        if !self.pools.iter().any(|p| p.id == buf.pool && p.listed) {
            return Err(ErrorKind::Protocol(format!("buffer of pool {} which is not assigned", buf.pool)).into());
        }
        Ok(())
    }
}

/// The entry of the pool of a buffer named by the peer: known here, the
/// index in range.
#[inline(always)]
fn named_entry(st: &DomainState, buf: BufferId) -> Result<&PoolEntry> {
    let e = st.entry(buf.pool).ok_or_else(|| ErrorKind::Protocol(format!("unknown pool {}", buf.pool)))?;
    if buf.index >= e.view.geometry().count() {
        return Err(ErrorKind::Protocol(format!("buffer index {} out of range", buf.index)).into());
    }
    Ok(e)
}

/// [`named_entry`], for a change.
#[inline(always)]
fn named_entry_mut(st: &mut DomainState, buf: BufferId) -> Result<&mut PoolEntry> {
    let e = st.entry_mut(buf.pool).ok_or_else(|| ErrorKind::Protocol(format!("unknown pool {}", buf.pool)))?;
    if buf.index >= e.view.geometry().count() {
        return Err(ErrorKind::Protocol(format!("buffer index {} out of range", buf.index)).into());
    }
    Ok(e)
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
