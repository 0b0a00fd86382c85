//! Fan-out: one source, many sinks, each receiving the same buffer as a
//! read-only copy ([ETH-BT] Algorithm 9 over several channels), the buffer
//! back in the source's hands, writable, once the last copy is released.
//!
//! Nothing here goes beyond the copy semantics of docs/SEMANTICS.md: a
//! published buffer is copied over every sink's channel, it is
//! `READ_ONLY_OWNED` while any copy is out, and the release of each copy
//! comes back as an [`Event::CopyReleased`] on that sink's channel. A
//! [`FanOut`] keeps the buffer handle meanwhile and counts the releases.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use crate::buffer::{Buffer, BufferId};
use crate::channel::{Channel, Event};
use crate::domain::Pool;
use crate::error::{ErrorKind, Refused, Result};
use crate::setup::{ChannelState, Direction};

/// What a [`FanOut`] reports ([`FanOut::poll`], [`FanOut::wait`]).
#[derive(Debug)]
pub enum FanOutEvent {
    /// A published buffer is back: no sink holds a copy of it any more.
    /// `writable` is true when every copy was released (or void: its sink's
    /// process died) and the buffer is `READ_WRITE` again; it is false only
    /// when a sink's channel closed while the sink still held its copy — by
    /// the copy semantics that copy stays out, and the buffer read-only, for
    /// good (drop it: it then waits aside, as any buffer with copies out).
    /// Each published buffer comes back exactly once.
    Returned {
        /// The buffer.
        buffer: Buffer,
        /// Whether it is `READ_WRITE` (see above).
        writable: bool,
    },
    /// Any other event of sink `sink`'s channel, as [`Channel::poll`] gives
    /// it: its end ([`Event::Closed`], [`Event::Error`]), pool events, the
    /// release of a copy the application made itself, …
    Sink {
        /// The sink's index (the order of the channels given to
        /// [`FanOut::new`]).
        sink: usize,
        /// The event.
        event: Event,
    },
}

/// A published buffer with copies out.
#[derive(Debug)]
struct Published {
    buffer: Buffer,
    /// The sinks whose copy has not come back yet.
    waiting: Vec<usize>,
    /// A sink's channel closed with its copy still out: the buffer cannot
    /// become writable again.
    stuck: bool,
}

/// One source and many sinks: [`publish`](FanOut::publish) sends a buffer
/// to every sink as a read-only copy, and the buffer comes back
/// ([`FanOutEvent::Returned`]), writable, when the last sink has released
/// its copy. A sink whose process dies gives its copy back by dying; a
/// sink that leaves (its channel closes) is published to no more.
///
/// The `FanOut` holds the source ends (TX) of the sinks' channels, all of
/// one domain. It is driven like a channel: [`poll`](FanOut::poll) or
/// [`wait`](FanOut::wait) take the sinks' events in, count the releases,
/// and report the buffers that are back and the sinks' other events.
///
/// ```
/// use std::time::Duration;
/// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, FanOut, FanOutEvent, PoolConstraints, PoolPolicy};
///
/// let t = Duration::from_secs(10);
/// let source = Domain::new("source");
/// let (mut channels, mut sinks) = (Vec::new(), Vec::new());
/// for i in 0..3 {
///     let ep = Endpoint::local();
///     sinks.push(std::thread::spawn({
///         let ep = ep.clone();
///         move || -> ferry::Result<u64> {
///             let mut rx = Channel::connect(&Domain::new(&format!("sink {i}")), &ep, BindParams::default(), t)?;
///             rx.set_pool_policy(PoolPolicy::AcceptAll);
///             let mut sum = 0;
///             while let Ok(ev) = rx.wait(Some(t)) {
///                 if let Event::CopyReceived { copy, .. } = ev {
///                     sum += copy[0] as u64; // read-only
///                     rx.release(copy).map_err(|r| r.error)?;
///                 }
///             }
///             Ok(sum)
///         }
///     }));
///     channels.push(Channel::accept(&source, &ep, ChannelSetup::default(), t)?);
/// }
/// let mut fan = FanOut::new(channels).map_err(|r| r.error)?;
/// let alloc = Allocator::new(&source, 1, 4096, PoolConstraints::default())?;
/// fan.assign_pool_and_wait(alloc.pool(), t)?;
/// let mut buf = alloc.alloc().unwrap();
/// for round in 1..=5u8 {
///     buf.as_mut_slice()?[0] = round;
///     fan.publish(buf, &[]).map_err(|r| r.error)?; // a copy to each sink
///     buf = loop {
///         match fan.wait(Some(t)) {
///             Some(FanOutEvent::Returned { buffer, writable: true }) => break buffer, // all 3 released
///             other => panic!("{other:?}"),
///         }
///     };
/// }
/// fan.teardown()?;
/// for sink in sinks {
///     assert_eq!(sink.join().unwrap()?, 15);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct FanOut {
    sinks: Vec<Channel>,
    /// Published buffers with copies out, or waiting to be `READ_WRITE`.
    published: Vec<Published>,
    /// Events found and not handed out yet.
    ready: VecDeque<FanOutEvent>,
    /// The sink polled first next time (round robin: a busy sink does not
    /// starve the others).
    next: usize,
}

impl FanOut {
    /// A fan-out over `channels`: the source ends (TX) of channels of one
    /// domain, connected or not yet. Refused, the channels handed back,
    /// with [`ErrorKind::InvalidArgument`] if there are none, if one is a sink
    /// end (RX) once connected, or if they belong to different domains.
    // The error holds the channels, by value as the caller gave them.
    #[allow(clippy::result_large_err)]
    pub fn new(channels: Vec<Channel>) -> Result<FanOut, Refused<Vec<Channel>>> {
        let refuse = |why, channels| Err(Refused::new(ErrorKind::InvalidArgument(why), channels));
        let Some(first) = channels.first() else { return refuse("a fan-out needs at least one channel", channels) };
        let domain = first.domain().id();
        if channels.iter().any(|c| c.domain().id() != domain) {
            return refuse("the channels of a fan-out belong to one domain", channels);
        }
        if channels.iter().any(|c| c.state() == ChannelState::Connected && c.direction() != Direction::Tx) {
            return refuse("a fan-out publishes over the source ends (TX) of its channels", channels);
        }
        Ok(FanOut { sinks: channels, published: Vec::new(), ready: VecDeque::new(), next: 0 })
    }

    /// Assign `pool` to every sink's channel and wait for each answer
    /// ([`Channel::assign_pool_and_wait`], the whole within `timeout`).
    /// Stops at the first error: a veto, a timeout, a sink that failed. The
    /// other events that arrive meanwhile are kept for
    /// [`poll`](FanOut::poll).
    pub fn assign_pool_and_wait(&mut self, pool: &Pool, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for ch in &mut self.sinks {
            if !ch.is_assigned(pool.id()) {
                ch.assign_pool_and_wait(pool, deadline.saturating_duration_since(Instant::now()))?;
            }
        }
        Ok(())
    }

    /// Send a read-only copy of `buffer` to every connected sink
    /// ([`Channel::copy`]); the fan-out keeps the buffer until it is back
    /// ([`FanOutEvent::Returned`]). Sinks whose channel is not connected
    /// (not yet, or no more: tearing down, closed) get none.
    ///
    /// All or nothing: before any copy goes out, each connected sink's
    /// channel is checked as [`Channel::copy`] checks it (the buffer is of
    /// this domain, its pool is assigned to the channel, `meta` fits, the
    /// outgoing queue has room). The first failure refuses the publication
    /// with that error and hands the buffer back; nothing was sent
    /// ([`ErrorKind::QueueFull`]: [`poll`](FanOut::poll) and publish again).
    /// [`ErrorKind::NotConnected`] if no sink is connected.
    ///
    /// A sink whose copy could not be sent after these checks (its peer
    /// vanished at that moment) is not waited for; its channel reports its
    /// end at the next poll.
    pub fn publish(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        let live: Vec<usize> =
            (0..self.sinks.len()).filter(|&i| self.sinks[i].state() == ChannelState::Connected).collect();
        if live.is_empty() {
            return Err(Refused::new(ErrorKind::NotConnected(ChannelState::Closed), buffer));
        }
        for &i in &live {
            if let Err(e) = self.sinks[i].check_copy(&buffer, meta) {
                return Err(Refused::new(e, buffer));
            }
        }
        let mut waiting = Vec::with_capacity(live.len());
        let mut failed = None;
        for i in live {
            match self.sinks[i].copy(&buffer, meta) {
                Ok(()) => waiting.push(i),
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) if waiting.is_empty() => Err(Refused::new(e, buffer)),
            _ => {
                self.published.push(Published { buffer, waiting, stuck: false });
                Ok(())
            }
        }
    }

    /// The next event, without waiting: a buffer that is back, or another
    /// event of a sink's channel. `None` when there is nothing now.
    pub fn poll(&mut self) -> Option<FanOutEvent> {
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Some(ev);
            }
            self.settle();
            if let Some(ev) = self.ready.pop_front() {
                return Some(ev);
            }
            let n = self.sinks.len();
            let start = self.next % n;
            let found = (0..n).map(|k| (start + k) % n).find_map(|i| self.sinks[i].poll().map(|ev| (i, ev)));
            let (sink, event) = found?;
            self.next = sink + 1;
            self.take(sink, event);
        }
    }

    /// Wait up to `timeout` (forever with `None`) for the next event (see
    /// [`poll`](FanOut::poll)), sleeping on the sinks' fds. `None` on
    /// timeout, or when every sink's channel is closed and no published
    /// buffer can come back any more.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Option<FanOutEvent> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(ev) = self.poll() {
                return Some(ev);
            }
            if self.sinks.iter().all(|c| c.state() == ChannelState::Closed) && self.published.is_empty() {
                return None;
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return None,
                },
                None => None,
            };
            if !self.sinks.iter_mut().all(|c| c.arm()) {
                continue;
            }
            // A buffer waiting to become writable may settle without any
            // fd waking (see `settle`): look again soon while there is one.
            let settling = self.published.iter().any(|p| p.waiting.is_empty());
            let most = if settling { Duration::from_millis(1) } else { Duration::from_secs(1) };
            let sleep = left.map_or(most, |l| l.min(most));
            let mut fds: Vec<PollFd<'_>> =
                self.sinks.iter().map(|c| PollFd::from_borrowed_fd(c.as_fd(), PollFlags::IN)).collect();
            let ts = rustix::event::Timespec { tv_sec: sleep.as_secs() as i64, tv_nsec: sleep.subsec_nanos() as _ };
            // An interrupted or failed poll only means looking again.
            let _ = rustix::event::poll(&mut fds, Some(&ts));
        }
    }

    /// Tear down every sink's channel that is still connected
    /// ([`Channel::teardown`]); their [`Event::Closed`] follow from
    /// [`poll`](FanOut::poll). The first error, after trying them all.
    pub fn teardown(&mut self) -> Result<()> {
        let mut first = Ok(());
        for ch in &mut self.sinks {
            if ch.state() == ChannelState::Connected {
                if let Err(e) = ch.teardown() {
                    first = first.and(Err(e));
                }
            }
        }
        first
    }

    /// Published buffers not back yet.
    pub fn in_flight(&self) -> usize {
        self.published.len()
    }

    /// The number of sinks (channels), connected or not.
    pub fn sinks(&self) -> usize {
        self.sinks.len()
    }

    /// Sink `sink`'s channel.
    pub fn channel(&self, sink: usize) -> Option<&Channel> {
        self.sinks.get(sink)
    }

    /// Sink `sink`'s channel, for the operations the fan-out does not do.
    /// Its events are the fan-out's to take: poll the fan-out, not the
    /// channel, or releases go uncounted.
    pub fn channel_mut(&mut self, sink: usize) -> Option<&mut Channel> {
        self.sinks.get_mut(sink)
    }

    /// The channels back. The buffers not back yet are dropped: each goes
    /// to its domain's free list once its copies are released, as the
    /// channels deliver the releases.
    pub fn into_channels(self) -> Vec<Channel> {
        self.sinks
    }

    /// An event of sink `sink`'s channel: a release of a copy published
    /// here is counted; everything else goes to the application.
    fn take(&mut self, sink: usize, event: Event) {
        if let Event::CopyReleased { buffer, .. } = event {
            if self.count_release(sink, buffer) {
                return;
            }
        }
        self.ready.push_back(FanOutEvent::Sink { sink, event });
        if self.sinks[sink].state() == ChannelState::Closed {
            self.sink_ended(sink);
        }
    }

    /// Whether `id`'s release from `sink` was one of ours (counted).
    fn count_release(&mut self, sink: usize, id: BufferId) -> bool {
        let Some(p) = self.published.iter_mut().find(|p| p.buffer.id() == id && p.waiting.contains(&sink)) else {
            return false;
        };
        p.waiting.retain(|&s| s != sink);
        true
    }

    /// Sink `sink`'s channel is closed: nothing more comes back over it.
    /// A copy voided by its peer's death counts as released; one the peer
    /// still held at an orderly close stays out for good.
    fn sink_ended(&mut self, sink: usize) {
        let ch = &self.sinks[sink];
        for p in &mut self.published {
            if p.waiting.contains(&sink) {
                p.waiting.retain(|&s| s != sink);
                p.stuck |= ch.copies_out_here(p.buffer.id()) > 0;
            }
        }
    }

    /// Hand out the published buffers that no sink holds any more: as soon
    /// as they are `READ_WRITE`, or at once if they never will be.
    fn settle(&mut self) {
        if !self.published.iter().any(|p| p.waiting.is_empty()) {
            return;
        }
        // Buffers kept read-only after a peer's death until every copy
        // between processes is back turn writable here.
        drop(self.sinks[0].domain().shared.lock_settled());
        let mut i = 0;
        while i < self.published.len() {
            let p = &self.published[i];
            if p.waiting.is_empty() && (p.stuck || p.buffer.is_read_write()) {
                let p = self.published.remove(i);
                let writable = !p.stuck && p.buffer.is_read_write();
                self.ready.push_back(FanOutEvent::Returned { buffer: p.buffer, writable });
            } else {
                i += 1;
            }
        }
    }
}
