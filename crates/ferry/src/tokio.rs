//! async/await over Ferry channels, on tokio (feature `tokio`).
//!
//! [`AsyncChannel`] wraps a [`Channel`] and waits on the channel's fd
//! ([`AsFd`]) with tokio's [`AsyncFd`], following the protocol of
//! [`Channel::arm`]: poll until nothing is left, arm, await readability,
//! poll again. Nothing blocks a runtime thread; a task per channel scales to
//! many channels on few threads.
//!
//! - [`AsyncChannel::next_event`] waits for the next [`Event`]. It is
//!   cancel-safe: an event is only taken from the channel inside one
//!   synchronous step that also returns it, so a `next_event` future dropped
//!   in a `tokio::select!` loses nothing.
//! - The operations that can find the outgoing queue full
//!   ([`move_buffer`](AsyncChannel::move_buffer),
//!   [`pass`](AsyncChannel::pass), [`copy`](AsyncChannel::copy),
//!   [`release`](AsyncChannel::release), …) wait for room instead of
//!   failing with [`ErrorKind::QueueFull`]; every other error is returned at
//!   once, as by the blocking operation.
//! - [`AsyncChannel::accept`] and [`AsyncChannel::connect`] are the
//!   async forms of [`Channel::accept`] and [`Channel::connect`] (the
//!   binder retries while nobody listens yet);
//!   [`wait_connected`](AsyncChannel::wait_connected) and
//!   [`assign_pool_and_wait`](AsyncChannel::assign_pool_and_wait) are the
//!   async forms of the blocking helpers.
//! - [`AsyncChannel::poll_next_event`] and the [`Stream`] implementation are
//!   the runtime-neutral core that the rest is built on.
//!
//! **Events that arrive while an operation waits.** Room in the outgoing
//! queue comes when the peer takes messages, and the peer may itself be
//! waiting for room in *its* outgoing queue — ours to read. So a wait for
//! room takes the arrivals that are in the way, as
//! [`Channel::assign_pool_and_wait`] does: they are kept in the channel, in
//! order, and [`next_event`](AsyncChannel::next_event),
//! [`Channel::poll`] and [`Channel::wait`] hand them out first. None is
//! lost, and two ends that both wait for room cannot block each other. The
//! waiting helpers keep the events that are not theirs the same way.
//!
//! ```
//! use std::time::Duration;
//! use ferry::tokio::AsyncChannel;
//! use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy, WaitError};
//!
//! let t = Duration::from_secs(10);
//! let ep = Endpoint::local();
//! // The sink: a plain thread with the blocking API, passing every buffer back.
//! let sink = {
//!     let ep = ep.clone();
//!     std::thread::spawn(move || -> ferry::Result<()> {
//!         let mut rx = Channel::connect(&Domain::new("sink"), &ep, BindParams::default(), t)?;
//!         rx.set_pool_policy(PoolPolicy::AcceptAll);
//!         loop {
//!             match rx.wait(Some(t)) {
//!                 Ok(Event::MoveReceived { buffer, meta }) => rx.pass(buffer, &meta)?,
//!                 Ok(Event::Closed { .. }) | Err(WaitError::Closed) => return Ok(()),
//!                 Ok(_) => {}
//!                 Err(timed_out) => return Err(timed_out.into()),
//!             }
//!         }
//!     })
//! };
//! let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
//! rt.block_on(async {
//!     let app = Domain::new("app");
//!     let tx = Channel::create(&app, &ep, ChannelSetup::default())?;
//!     let mut tx = AsyncChannel::new(tx)?;
//!     tx.wait_connected().await?;
//!     let alloc = Allocator::new(&app, 4, 4096, PoolConstraints::default())?;
//!     tx.assign_pool_and_wait(alloc.pool()).await?;
//!     let mut buf = alloc.alloc().expect("a free buffer");
//!     buf.as_mut_slice()?[0] = 42;
//!     tx.move_buffer(buf, b"hello").await?;
//!     match tx.next_event().await {
//!         Some(Event::BufferPassed { buffer, meta }) => assert_eq!((buffer[0], &meta[..]), (42, &b"hello"[..])),
//!         other => panic!("{other:?}"),
//!     }
//!     tx.get_mut().teardown()?;
//!     while let Some(ev) = tx.next_event().await {
//!         if let Event::Closed { .. } = ev {
//!             break;
//!         }
//!     }
//!     Ok::<(), Box<dyn std::error::Error>>(())
//! })?;
//! sink.join().unwrap()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::future::poll_fn;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use ::tokio::io::unix::AsyncFd;
use ::tokio::io::Interest;
use futures_core::Stream;

use crate::{
    BindParams, Buffer, BufferCopy, Channel, ChannelSetup, ChannelState, CopySource, Domain, Endpoint, Error,
    ErrorKind, Event, Pool, Refused, Result,
};

/// How many times a wait looks again at once (the channel said something
/// may be ready, and it was not yet) before it lets the other tasks of its
/// thread run: a future that never returns `Pending` would hold its thread
/// and its timeouts.
const SPINS: u32 = 64;

/// `Pending`, with the task woken at once: the executor runs others first.
fn yield_to_others<T>(cx: &mut Context<'_>) -> Poll<T> {
    cx.waker().wake_by_ref();
    Poll::Pending
}

/// The channel behind [`AsyncFd`], which wants [`AsRawFd`].
struct Inner(Channel);

impl AsRawFd for Inner {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// A [`Channel`] whose waits are futures: see the [module](self) for the
/// rules, and [`next_event`](AsyncChannel::next_event) for the loop.
///
/// The channel stays usable as it is ([`get_ref`](AsyncChannel::get_ref),
/// [`get_mut`](AsyncChannel::get_mut): the operations without an async form
/// here, such as [`Channel::respond_pool`] or [`Channel::set_batching`], are
/// called there; one refused with [`ErrorKind::QueueFull`] is tried again after
/// the next event) and can be taken back
/// ([`into_inner`](AsyncChannel::into_inner)).
///
/// An `AsyncChannel` is `Send`: a task that owns it can move between the
/// threads of a multi-threaded runtime. Like the channel, it is used by one
/// task at a time (its methods take `&mut self`).
pub struct AsyncChannel {
    fd: AsyncFd<Inner>,
    /// How long `next_event` busy-polls before it arms (zero: never).
    spin: Duration,
}

impl std::fmt::Debug for AsyncChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AsyncChannel").field(self.get_ref()).finish()
    }
}

impl AsyncChannel {
    /// Wrap a channel, in any state, registering its fd with the current
    /// tokio runtime. Refused (the channel handed back) outside a runtime:
    /// [`ErrorKind::InvalidArgument`]; an fd tokio cannot watch: [`ErrorKind::Os`].
    ///
    /// # Panics
    ///
    /// Inside a runtime built without its I/O driver (tokio panics: build
    /// it with `enable_io` or `enable_all`).
    // Both variants hold the channel, by value as the caller gave it.
    #[allow(clippy::result_large_err)]
    pub fn new(channel: Channel) -> Result<AsyncChannel, Refused<Channel>> {
        if ::tokio::runtime::Handle::try_current().is_err() {
            return Err(Refused::new(Error::from(ErrorKind::InvalidArgument("not inside a tokio runtime")), channel));
        }
        // SAFETY: the fd is the channel's wake set (an epoll instance), owned
        // by the channel inside `Inner`: open, and the same fd, for the
        // channel's whole life (see its `AsFd`). The channel leaves `Inner`
        // only through `AsyncFd::into_inner` or the drop of the `AsyncFd`,
        // both of which deregister the fd first.
        match unsafe { AsyncFd::register_with_interest(Inner(channel), Interest::READABLE) } {
            Ok(fd) => Ok(AsyncChannel { fd, spin: Duration::ZERO }),
            Err(e) => {
                let (inner, e) = e.into_parts();
                Err(Refused::new(Error::from(e), inner.0))
            }
        }
    }

    /// [`Channel::accept`] for tokio: create a channel on `endpoint`, wrap
    /// it, and wait until a binder is connected (its
    /// [`Event::BindRequest`] taken). [`ErrorKind::TimedOut`] if none came
    /// within `timeout`; the errors of [`Channel::create`] and
    /// [`AsyncChannel::new`]. Dropping the future drops the channel: the
    /// endpoint is free again.
    ///
    /// # Panics
    ///
    /// Inside a runtime built without its I/O driver or its timer (build
    /// it with `enable_all`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::tokio::AsyncChannel;
    /// use ferry::{BindParams, ChannelSetup, ChannelState, Domain, Endpoint};
    ///
    /// let t = Duration::from_secs(10);
    /// let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    /// rt.block_on(async {
    ///     let ep = Endpoint::local();
    ///     // The binder may start first: it retries until the channel exists.
    ///     let binder = tokio::spawn({
    ///         let ep = ep.clone();
    ///         async move { AsyncChannel::connect(&Domain::new("sink"), &ep, BindParams::default(), t).await }
    ///     });
    ///     let tx = AsyncChannel::accept(&Domain::new("source"), &ep, ChannelSetup::default(), t).await?;
    ///     let rx = binder.await.expect("the task ran")?;
    ///     assert_eq!((tx.get_ref().state(), rx.get_ref().state()), (ChannelState::Connected, ChannelState::Connected));
    ///     Ok::<(), ferry::Error>(())
    /// })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn accept(
        domain: &Domain,
        endpoint: &Endpoint,
        setup: ChannelSetup,
        timeout: Duration,
    ) -> Result<AsyncChannel> {
        let deadline = ::tokio::time::Instant::now() + timeout;
        let ch = AsyncChannel::new(Channel::create(domain, endpoint, setup)?).map_err(|r| r.error)?;
        ch.connected_by(deadline).await
    }

    /// [`Channel::connect`] for tokio: bind to `endpoint`, retrying (pausing
    /// up to 50 ms, without holding a runtime thread) while nobody listens
    /// there yet, wrap the channel, and wait for the creator's reply (its
    /// [`Event::Bound`] taken). The errors of [`Channel::connect`]:
    /// [`ErrorKind::EndpointNotListening`] if nobody listened within `timeout`,
    /// [`ErrorKind::TimedOut`] if the creator did not answer in time,
    /// [`ErrorKind::BindRefused`], the other errors of [`Channel::bind`] at
    /// once; and those of [`AsyncChannel::new`].
    ///
    /// Each bind attempt runs on tokio's blocking pool: over TCP it
    /// connects, which may take up to [`BindParams::timeout`] when the host
    /// does not answer. Dropping the future abandons the attempt under way
    /// (its channel is dropped when it completes) and makes no other.
    ///
    /// # Panics
    ///
    /// As [`accept`](AsyncChannel::accept).
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::tokio::AsyncChannel;
    /// use ferry::{BindParams, Domain, Endpoint, ErrorKind};
    ///
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    /// // Nobody creates a channel on this endpoint.
    /// let err = rt.block_on(AsyncChannel::connect(&Domain::new("d"), &Endpoint::local(), BindParams::default(), Duration::from_millis(20)));
    /// assert_eq!(err.unwrap_err(), ErrorKind::EndpointNotListening);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn connect(
        domain: &Domain,
        endpoint: &Endpoint,
        params: BindParams,
        timeout: Duration,
    ) -> Result<AsyncChannel> {
        let deadline = ::tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        let ch = loop {
            let (domain, endpoint) = (domain.clone(), endpoint.clone());
            let attempt = ::tokio::task::spawn_blocking(move || Channel::bind(&domain, &endpoint, params));
            match attempt.await {
                Ok(Ok(ch)) => break ch,
                Ok(Err(e)) if e == ErrorKind::EndpointNotListening => {
                    let left = deadline.saturating_duration_since(::tokio::time::Instant::now());
                    if left.is_zero() {
                        return Err(e);
                    }
                    ::tokio::time::sleep(pause.min(left)).await;
                    pause = (pause * 2).min(crate::channel::RETRY_MAX);
                }
                Ok(Err(e)) => return Err(e),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => return Err(ErrorKind::Os("the runtime is shutting down".into()).into()),
            }
        };
        let ch = AsyncChannel::new(ch).map_err(|r| r.error)?;
        ch.connected_by(deadline).await
    }

    /// [`wait_connected`](AsyncChannel::wait_connected) until `deadline`
    /// ([`ErrorKind::TimedOut`] past it).
    async fn connected_by(mut self, deadline: ::tokio::time::Instant) -> Result<AsyncChannel> {
        match ::tokio::time::timeout_at(deadline, self.wait_connected()).await {
            Ok(Ok(())) => Ok(self),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ErrorKind::TimedOut.into()),
        }
    }

    /// The channel.
    pub fn get_ref(&self) -> &Channel {
        &self.fd.get_ref().0
    }

    /// The channel, for the operations that never wait (and for
    /// [`Channel::poll`], which hands out the events kept by a wait first,
    /// like [`next_event`](AsyncChannel::next_event)).
    pub fn get_mut(&mut self) -> &mut Channel {
        &mut self.fd.get_mut().0
    }

    /// The channel back, its fd no longer watched by the runtime. Events
    /// kept by a wait stay in it, first in line for [`Channel::poll`].
    pub fn into_inner(self) -> Channel {
        self.fd.into_inner().0
    }

    /// Let [`next_event`](AsyncChannel::next_event) busy-poll up to
    /// `spin` before it arms the channel and waits for its fd, like
    /// [`Channel::wait`] ([`Channel::set_spin`]). Zero by default: a task
    /// never holds its worker thread, and each wait for an event that is
    /// not there yet costs a wake-up through the kernel and the runtime's
    /// reactor. A few microseconds take that cost off a busy channel whose
    /// peer answers at once, at the price of the thread's time meanwhile:
    /// for a latency-bound channel, not for a server of many channels.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// How long [`next_event`](AsyncChannel::next_event) busy-polls before
    /// it waits (see [`set_spin`](AsyncChannel::set_spin)).
    pub fn spin(&self) -> Duration {
        self.spin
    }

    // ------------------------------------------------------------------ events

    /// Wait for the next event: `Some(event)` as [`Channel::poll`] gives it
    /// (events kept while an operation waited come first, in order), `None`
    /// once the channel is closed and nothing is left. A dead peer shows as
    /// [`Event::Error`] (then `None`), never as a wait that does not end.
    ///
    /// Cancel-safe: dropping the future (a `tokio::select!` branch that lost,
    /// a timeout) loses no event.
    ///
    /// If the runtime's I/O driver is gone (the runtime is shutting down),
    /// the wait ends with an [`Event::Error`] ([`ErrorKind::Os`]) although the
    /// channel is not closed.
    ///
    /// A channel that always has an event ready never makes this future
    /// wait; a task that serves a busy channel and must leave room for
    /// others on its thread yields now and then
    /// (`tokio::task::yield_now`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::tokio::AsyncChannel;
    /// use ferry::{Channel, ChannelSetup, Domain, Endpoint, Event};
    ///
    /// let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    /// rt.block_on(async {
    ///     let ch = Channel::create(&Domain::new("d"), &Endpoint::local(), ChannelSetup::default())?;
    ///     let mut ch = AsyncChannel::new(ch).map_err(|r| r.error)?;
    ///     // Nobody binds: the timer wins, and the dropped wait took nothing.
    ///     tokio::select! {
    ///         ev = ch.next_event() => panic!("{ev:?}"),
    ///         _ = tokio::time::sleep(Duration::from_millis(10)) => {}
    ///     }
    ///     assert!(ch.get_mut().poll().is_none());
    ///     Ok::<(), ferry::Error>(())
    /// })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub async fn next_event(&mut self) -> Option<Event> {
        poll_fn(|cx| self.poll_next_event(cx)).await
    }

    /// The poll form of [`next_event`](AsyncChannel::next_event), for hand
    /// written futures and other executors (the waker is registered with
    /// the tokio reactor the channel was wrapped in, which must keep
    /// running). `Ready(Some(event))`, `Ready(None)` when the channel is
    /// closed, or `Pending` with `cx`'s waker registered; only a `Ready`
    /// result takes an event from the channel.
    pub fn poll_next_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let spin = self.spin;
        let mut spun = spin.is_zero();
        for _ in 0..SPINS {
            let ch = self.get_mut();
            if let Some(ev) = ch.poll() {
                return Poll::Ready(Some(ev));
            }
            if ch.state() == ChannelState::Closed {
                return Poll::Ready(None);
            }
            if !spun {
                spun = true;
                if ch.spin_for(spin) {
                    continue;
                }
            }
            if !ch.arm() {
                continue;
            }
            if let Err(e) = ready!(self.poll_wake(cx)) {
                return Poll::Ready(Some(Event::Error(e)));
            }
        }
        yield_to_others(cx)
    }

    /// After an armed channel: `Ready` once its fd was readable (the
    /// readiness is cleared: the caller polls next), `Pending` with the
    /// waker registered otherwise.
    fn poll_wake(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match ready!(self.fd.poll_read_ready(cx)) {
            Ok(mut guard) => {
                guard.clear_ready();
                Poll::Ready(Ok(()))
            }
            Err(e) => Poll::Ready(Err(e.into())),
        }
    }

    /// One step of a wait for room, after an operation failed with
    /// [`ErrorKind::QueueFull`]: `Ready` when it is worth trying again. An
    /// arrival in the way is kept in the channel for
    /// [`next_event`](AsyncChannel::next_event) (see the [module](self)).
    fn poll_room(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let ch = self.get_mut();
        if !ch.arm_unheld() {
            // Room, or an arrival: take the arrival so that the peer, which
            // may be waiting for room in its own queue, can go on.
            if let Some(ev) = ch.poll_unheld() {
                ch.hold(ev);
            }
            return Poll::Ready(Ok(()));
        }
        self.poll_wake(cx)
    }

    /// Wait until it is worth retrying an operation that found the queue
    /// full.
    async fn room(&mut self) -> Result<()> {
        poll_fn(|cx| self.poll_room(cx)).await
    }

    /// Run `op` until it does not fail with [`ErrorKind::QueueFull`], waiting
    /// for room in between. Refused for another reason: that error, with
    /// the value back.
    async fn with_room<T>(
        &mut self,
        mut value: T,
        mut op: impl FnMut(&mut Channel, T) -> Result<(), Refused<T>>,
    ) -> Result<(), Refused<T>> {
        let mut tries = 0;
        loop {
            match op(self.get_mut(), value) {
                Err(r) if r.error == ErrorKind::QueueFull => value = r.into_inner(),
                done => return done,
            }
            tries += 1;
            if tries % SPINS == 0 {
                // Room keeps looking near: let the other tasks run.
                let mut yielded = false;
                poll_fn(|cx| if std::mem::replace(&mut yielded, true) { Poll::Ready(()) } else { yield_to_others(cx) })
                    .await;
            }
            if let Err(e) = self.room().await {
                return Err(Refused::new(e, value));
            }
        }
    }

    // -------------------------------------------------------------- operations

    /// [`Channel::move_buffer`], waiting for room while the outgoing queue
    /// is full (arrivals meanwhile are kept for
    /// [`next_event`](AsyncChannel::next_event)); refused for any other
    /// reason at once, the buffer handed back.
    ///
    /// If the future is dropped before it completes, the buffer was not
    /// sent and is dropped with it (back to its domain's free list).
    pub async fn move_buffer(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        self.with_room(buffer, |ch, b| ch.move_buffer(b, meta)).await
    }

    /// [`Channel::send_aggregate`], waiting for room for the whole run like
    /// [`move_buffer`](AsyncChannel::move_buffer) (an aggregate that could
    /// never fit the queue is refused at once with
    /// [`ErrorKind::AggregateTooLarge`]).
    pub async fn send_aggregate(
        &mut self,
        agg: crate::Aggregate,
        meta: &[u8],
    ) -> Result<(), Refused<crate::Aggregate>> {
        self.with_room(agg, |ch, a| ch.send_aggregate(a, meta)).await
    }

    /// [`Channel::pass`], waiting for room like
    /// [`move_buffer`](AsyncChannel::move_buffer).
    pub async fn pass(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        self.with_room(buffer, |ch, b| ch.pass(b, meta)).await
    }

    /// [`Channel::pass_unfilled`], waiting for room like
    /// [`move_buffer`](AsyncChannel::move_buffer).
    pub async fn pass_unfilled(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        self.with_room(buffer, |ch, b| ch.pass_unfilled(b, meta)).await
    }

    /// [`Channel::full_copy`], waiting for room like
    /// [`move_buffer`](AsyncChannel::move_buffer).
    pub async fn full_copy<S: CopySource>(
        &mut self,
        source: &S,
        destination: Buffer,
        meta: &[u8],
    ) -> Result<(), Refused<Buffer>> {
        self.with_room(destination, |ch, b| ch.full_copy(source, b, meta)).await
    }

    /// [`Channel::copy`], waiting for room like
    /// [`move_buffer`](AsyncChannel::move_buffer). Dropping the future
    /// before it completes sends nothing.
    pub async fn copy<S: CopySource>(&mut self, source: &S, meta: &[u8]) -> Result<()> {
        let op = |ch: &mut Channel, ()| ch.copy(source, meta).map_err(|e| Refused::new(e, ()));
        self.with_room((), op).await.map_err(|r| r.error)
    }

    /// [`Channel::release`], waiting for room like
    /// [`move_buffer`](AsyncChannel::move_buffer). Dropping the future
    /// before it completes drops the copy, which releases it the next time
    /// the channel runs.
    pub async fn release(&mut self, copy: BufferCopy) -> Result<(), Refused<BufferCopy>> {
        self.with_room(copy, |ch, c| ch.release(c)).await
    }

    /// [`Channel::teardown`], waiting for room for the teardown marker.
    /// [`Event::Closed`] follows from [`next_event`](AsyncChannel::next_event).
    pub async fn teardown(&mut self) -> Result<()> {
        let op = |ch: &mut Channel, ()| ch.teardown().map_err(|e| Refused::new(e, ()));
        self.with_room((), op).await.map_err(|r| r.error)
    }

    // ----------------------------------------------------------------- helpers

    /// [`Channel::wait_connected`] without a timeout (put one around the
    /// future: `tokio::time::timeout`): `Ok` once a channel being created or
    /// bound is connected, its [`Event::BindRequest`] or [`Event::Bound`]
    /// taken; the error of a failed setup; [`ErrorKind::NotConnected`] for a
    /// channel that is tearing down or closed. The backend's own setup
    /// deadlines still apply. Other events are kept for
    /// [`next_event`](AsyncChannel::next_event). Cancel-safe.
    pub async fn wait_connected(&mut self) -> Result<()> {
        poll_fn(|cx| {
            for _ in 0..SPINS {
                let ch = self.get_mut();
                match ch.state() {
                    ChannelState::Connected => return Poll::Ready(Ok(())),
                    ChannelState::Initialized | ChannelState::Binding => {}
                    s => return Poll::Ready(Err(ErrorKind::NotConnected(s).into())),
                }
                match ch.poll_unheld() {
                    Some(Event::BindRequest { .. } | Event::Bound) => return Poll::Ready(Ok(())),
                    Some(Event::Error(e)) => return Poll::Ready(Err(e)),
                    Some(other) => {
                        ch.hold(other);
                        continue;
                    }
                    // Closed meanwhile: the next round says so.
                    None if !matches!(ch.state(), ChannelState::Initialized | ChannelState::Binding) => continue,
                    None => {}
                }
                if !ch.arm_unheld() {
                    continue;
                }
                ready!(self.poll_wake(cx))?;
            }
            yield_to_others(cx)
        })
        .await
    }

    /// [`Channel::assign_pool_and_wait`] without a timeout (put one around
    /// the future): assign `pool` (waiting for room if the queue is full),
    /// then wait for the peer's answer: `Ok` once assigned,
    /// [`ErrorKind::PoolVetoed`] if vetoed, the error of a channel that failed
    /// or closed meanwhile, the errors of [`Channel::assign_pool`]. Every
    /// other event that arrives meanwhile is kept, in order, for
    /// [`next_event`](AsyncChannel::next_event) (an [`Event::Error`] or
    /// [`Event::Closed`] too). Dropped after the request went out, the
    /// answer is delivered later as an event.
    pub async fn assign_pool_and_wait(&mut self, pool: &Pool) -> Result<()> {
        let op = |ch: &mut Channel, ()| ch.assign_pool(pool).map_err(|e| Refused::new(e, ()));
        self.with_room((), op).await.map_err(|r| r.error)?;
        let id = pool.id();
        poll_fn(|cx| {
            for _ in 0..SPINS {
                let ch = self.get_mut();
                match ch.poll_unheld() {
                    Some(Event::PoolAssigned(p)) if p == id => return Poll::Ready(Ok(())),
                    Some(Event::PoolVetoed(p)) if p == id => return Poll::Ready(Err(ErrorKind::PoolVetoed(id).into())),
                    Some(ev) => {
                        let stop = match &ev {
                            Event::Error(e) => Some(e.clone()),
                            Event::Closed { .. } => Some(ErrorKind::NotConnected(ChannelState::Closed).into()),
                            _ => None,
                        };
                        ch.hold(ev);
                        match stop {
                            Some(e) => return Poll::Ready(Err(e)),
                            None => continue,
                        }
                    }
                    None if ch.state() == ChannelState::Closed => {
                        return Poll::Ready(Err(ErrorKind::NotConnected(ChannelState::Closed).into()))
                    }
                    None => {}
                }
                if !ch.arm_unheld() {
                    continue;
                }
                ready!(self.poll_wake(cx))?;
            }
            yield_to_others(cx)
        })
        .await
    }
}

/// The events of the channel, as [`AsyncChannel::next_event`] gives them;
/// the stream ends when the channel is closed.
impl Stream for AsyncChannel {
    type Item = Event;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        self.get_mut().poll_next_event(cx)
    }
}
