//! Waiting on many channels from one thread: [`wait_any`] for a handful,
//! [`Selector`] for many (an epoll set of the channels' own fds, so a wait
//! costs in proportion to the channels that woke, not to all of them).
//!
//! Both are fair: a channel that always has another event does not starve
//! its siblings. [`wait_any`] starts each scan after the channel it served
//! last; a [`Selector`] serves the channels that may be ready in turn
//! (first come, first served, and a channel that had an event goes to the
//! back), and looks for newly woken channels at least once per round.

use std::cell::Cell;
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::epoll;
use rustix::event::{PollFd, PollFlags};
use rustix::io::Errno;

use crate::channel::{Channel, Event};
use crate::error::{Result, WaitError};
use crate::setup::ChannelState;
use crate::wake::timespec;

thread_local! {
    /// Where this thread's next [`wait_any`] scan starts.
    static NEXT: Cell<usize> = const { Cell::new(0) };
}

/// The longest single sleep: a backstop for a wake-up no fd carries.
const MAX_SLEEP: Duration = Duration::from_secs(1);

/// Time left until `deadline`: `None` if it passed, `Some(None)` without one.
fn left(deadline: Option<Instant>) -> Option<Option<Duration>> {
    match deadline {
        None => Some(None),
        Some(d) => match d.checked_duration_since(Instant::now()) {
            Some(l) if !l.is_zero() => Some(Some(l)),
            _ => None,
        },
    }
}

/// Wait up to `timeout` (forever with `None`) for the next event on any of
/// `channels`: `(index, event)`; [`WaitError::TimedOut`] when the timeout
/// passed, [`WaitError::Closed`] when every channel is closed and has
/// delivered its last event (or the slice is empty). Works across backends (local, shm and TCP channels
/// mixed).
///
/// Scans start after the channel served last (per thread), so with the
/// same slice every call, a busy channel cannot starve the others. Each
/// call polls every channel, then spins for the shortest of the channels'
/// [`spin`](Channel::spin) times, then arms them all and sleeps in one
/// `poll(2)` on their fds: fine for a handful of channels; a
/// [`Selector`] scales to many.
///
/// ```
/// use std::time::Duration;
/// use ferry::*;
///
/// let t = Duration::from_secs(10);
/// let (app, sink) = (Domain::new("app"), Domain::new("sink"));
/// let alloc = Allocator::new(&app, 8, 4096, PoolConstraints::default())?;
/// // Two channels from `app` into `sink`, `alloc`'s pool assigned to both.
/// let (mut sinks, mut sources) = (Vec::new(), Vec::new());
/// for _ in 0..2 {
///     let ep = Endpoint::local();
///     let mut tx = Channel::create(&app, &ep, ChannelSetup::default())?;
///     let mut rx = Channel::bind(&sink, &ep, BindParams::default())?;
///     tx.wait_connected(t)?;
///     rx.wait_connected(t)?;
///     rx.set_pool_policy(PoolPolicy::AcceptAll);
///     tx.assign_pool(alloc.pool())?;
///     assert!(rx.poll().is_none()); // accepted by the policy, no event
///     assert!(matches!(tx.poll(), Some(Event::PoolAssigned(_))));
///     sinks.push(rx);
///     sources.push(tx);
/// }
/// sources[1].move_buffer(alloc.alloc().unwrap(), b"second")?;
/// let mut chans: Vec<&mut Channel> = sinks.iter_mut().collect();
/// match wait_any(&mut chans, Some(t)) {
///     Ok((i, Event::MoveReceived { meta, .. })) => assert_eq!((i, &meta[..]), (1, &b"second"[..])),
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn wait_any(channels: &mut [&mut Channel], timeout: Option<Duration>) -> Result<(usize, Event), WaitError> {
    let n = channels.len();
    if n == 0 {
        return Err(WaitError::Closed);
    }
    let deadline = timeout.map(|t| Instant::now() + t);
    let spin = channels.iter().map(|c| c.spin()).min().unwrap_or_default();
    loop {
        let start = NEXT.with(Cell::get) % n;
        let found = |chans: &mut [&mut Channel]| {
            (0..n).map(|k| (start + k) % n).find_map(|i| chans[i].poll().map(|ev| (i, ev)))
        };
        if let Some((i, ev)) = found(channels) {
            NEXT.with(|c| c.set(i + 1));
            return Ok((i, ev));
        }
        if channels.iter().all(|c| c.state() == ChannelState::Closed) {
            return Err(WaitError::Closed);
        }
        let left = left(deadline).ok_or(WaitError::TimedOut)?;
        // Spin: poll them all until something comes or the spin is over.
        let spin_end = Instant::now() + left.map_or(spin, |l| l.min(spin));
        let mut spun = None;
        while spun.is_none() && Instant::now() < spin_end {
            spun = found(channels);
            std::hint::spin_loop();
        }
        if let Some((i, ev)) = spun {
            NEXT.with(|c| c.set(i + 1));
            return Ok((i, ev));
        }
        if !channels.iter_mut().all(|c| c.arm()) {
            continue;
        }
        let mut fds: Vec<PollFd<'_>> = channels.iter().map(|c| PollFd::new(*c, PollFlags::IN)).collect();
        let sleep = left.map_or(MAX_SLEEP, |l| l.min(MAX_SLEEP));
        match rustix::event::poll(&mut fds, Some(&timespec(sleep))) {
            Ok(_) | Err(Errno::INTR) => {}
            // Cannot wait (out of memory for the poll table): poll again.
            Err(_) => std::thread::yield_now(),
        }
    }
}

/// One channel in a [`Selector`].
#[derive(Debug)]
struct Entry {
    channel: Channel,
    /// In the ready queue (may have an event); otherwise armed.
    queued: bool,
}

/// Many channels waited on by one thread: the selector owns them, keyed by
/// the number [`insert`](Selector::insert) returns, and
/// [`wait`](Selector::wait) returns the next event of any of them.
///
/// Each channel is either *queued* (it may have an event: it is polled in
/// turn) or *armed* (its fd, in the selector's epoll set, says when it may
/// have one), so a wait costs in proportion to the channels that woke.
/// Channels are served in turn, and newly woken ones are looked for at
/// least once per round, so no channel starves. The selector's own fd
/// ([`AsFd`]) is readable when a channel may be ready: a selector can sit in
/// another event loop.
///
/// Each `wait` returns one event. A server after throughput takes the
/// rest of a channel's burst itself (`get_mut(key)` and `poll` until
/// `None`), as an event loop does: that saves a look at the epoll set per
/// event, and the channel is armed only once it is drained.
///
/// A channel leaves with [`remove`](Selector::remove) (it is returned) or
/// with the selector (dropped). [`get_mut`](Selector::get_mut) gives access
/// to a channel to send on it; the channel is queued again (what it did
/// may have made an event ready).
///
/// ```
/// use std::time::Duration;
/// use ferry::*;
///
/// let t = Duration::from_secs(10);
/// let server = Domain::new("server");
/// let mut selector = Selector::new()?;
/// let mut clients = Vec::new();
/// for i in 0..3u8 {
///     let ep = Endpoint::local();
///     let setup = ChannelSetup { direction: Direction::Rx, ..Default::default() };
///     selector.insert(Channel::create(&server, &ep, setup)?);
///     // Each client: another domain on its own thread.
///     clients.push(std::thread::spawn(move || -> ferry::Result<()> {
///         let app = Domain::new("client");
///         let alloc = Allocator::new(&app, 4, 4096, PoolConstraints::default())?;
///         let mut tx = Channel::connect(&app, &ep, BindParams::default(), t)?;
///         tx.assign_pool_and_wait(alloc.pool(), t)?;
///         tx.move_buffer(alloc.alloc().unwrap(), &[i]).map_err(|r| r.error)?;
///         loop {
///             match tx.wait(Some(t)) {
///                 Ok(Event::BufferPassed { .. }) => return Ok(()),
///                 other => panic!("{other:?}"),
///             }
///         }
///     }));
/// }
/// let mut served = 0;
/// while !selector.is_empty() {
///     match selector.wait(Some(t)) {
///         Ok((key, Event::BindRequest { .. })) => selector.get_mut(key).unwrap().set_pool_policy(PoolPolicy::AcceptAll),
///         Ok((key, Event::MoveReceived { buffer, .. })) => {
///             selector.get_mut(key).unwrap().pass(buffer, &[])?;
///             served += 1;
///         }
///         // A client that is done: its channel leaves the selector.
///         Ok((key, Event::Error(e))) if e == ErrorKind::PeerGone => drop(selector.remove(key)),
///         other => panic!("{other:?}"),
///     }
/// }
/// assert_eq!(served, 3);
/// for c in clients {
///     c.join().unwrap()?;
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Selector {
    epoll: OwnedFd,
    entries: Vec<Option<Entry>>,
    /// Keys free for reuse.
    free: Vec<usize>,
    /// Channels that may have an event, in the order they are served.
    ready: VecDeque<usize>,
    /// Events served since the epoll set was last looked at.
    served: usize,
    spin: Duration,
}

impl Selector {
    /// An empty selector.
    pub fn new() -> Result<Selector> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(std::io::Error::from)?;
        Ok(Selector {
            epoll,
            entries: Vec::new(),
            free: Vec::new(),
            ready: VecDeque::new(),
            served: 0,
            spin: Duration::ZERO,
        })
    }

    /// Add a channel (in any state: a creator still waiting for its binder
    /// is served its `BindRequest` like any other event). Returns its key.
    pub fn insert(&mut self, channel: Channel) -> usize {
        let key = self.free.pop().unwrap_or(self.entries.len());
        // Registering can only fail for lack of kernel memory; the channel
        // is then polled in turn instead (queued after each event anyway).
        let _ = epoll::add(&self.epoll, &channel, epoll::EventData::new_u64(key as u64), epoll::EventFlags::IN);
        let entry = Some(Entry { channel, queued: true });
        if key == self.entries.len() {
            self.entries.push(entry);
        } else {
            self.entries[key] = entry;
        }
        self.ready.push_back(key);
        key
    }

    /// Take a channel out (`None` if `key` is not in the selector).
    pub fn remove(&mut self, key: usize) -> Option<Channel> {
        let entry = self.entries.get_mut(key)?.take()?;
        let _ = epoll::delete(&self.epoll, &entry.channel);
        if entry.queued {
            self.ready.retain(|k| *k != key);
        }
        self.free.push(key);
        Some(entry.channel)
    }

    /// The channel under `key`.
    pub fn get(&self, key: usize) -> Option<&Channel> {
        self.entries.get(key)?.as_ref().map(|e| &e.channel)
    }

    /// The channel under `key`, to act on it; it is polled again at the
    /// next [`wait`](Selector::wait).
    pub fn get_mut(&mut self, key: usize) -> Option<&mut Channel> {
        let entry = self.entries.get_mut(key)?.as_mut()?;
        if !entry.queued {
            entry.queued = true;
            self.ready.push_back(key);
        }
        Some(&mut entry.channel)
    }

    /// How many channels the selector holds.
    pub fn len(&self) -> usize {
        self.entries.len() - self.free.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The keys of the channels it holds.
    pub fn keys(&self) -> impl Iterator<Item = usize> + '_ {
        self.entries.iter().enumerate().filter(|(_, e)| e.is_some()).map(|(k, _)| k)
    }

    /// How long [`wait`](Selector::wait) busy-polls every channel before it
    /// sleeps (zero unless set: with many channels, spinning over all of
    /// them rarely pays).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// Wait up to `timeout` (forever with `None`) for the next event of any
    /// channel: `(key, event)`; [`WaitError::TimedOut`] when the timeout
    /// passed, [`WaitError::Closed`] when the selector is empty or every
    /// channel in it is closed and has delivered its last event (remove
    /// closed channels to keep waiting on the others cheap).
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<(usize, Event), WaitError> {
        if self.is_empty() {
            return Err(WaitError::Closed);
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            // Once per round, take in the channels that woke meanwhile, so
            // busy channels in the queue cannot starve them.
            if self.served >= self.ready.len().max(1) {
                self.served = 0;
                self.collect(Duration::ZERO);
            }
            if let Some(found) = self.serve_round() {
                self.served += 1;
                return Ok(found);
            }
            if !self.ready.is_empty() {
                // Armed channels said "poll again": do, after a look at the set.
                self.collect(Duration::ZERO);
                continue;
            }
            let Some(left) = left(deadline) else {
                // Time is up, but channels may have woken meanwhile (with a
                // zero timeout: those that made the selector's fd readable).
                if self.collect(Duration::ZERO) == 0 {
                    return Err(self.nothing_came());
                }
                let found = self.serve_round();
                self.served += usize::from(found.is_some());
                return found.ok_or_else(|| self.nothing_came());
            };
            if !self.spin.is_zero() {
                if let Some(found) = self.spin_all(left.map_or(self.spin, |l| l.min(self.spin))) {
                    return Ok(found);
                }
            }
            if self.collect(left.map_or(MAX_SLEEP, |l| l.min(MAX_SLEEP))) == 0 && left.is_none() {
                if self.all_closed() {
                    return Err(WaitError::Closed);
                }
                // The backstop expired with nothing: every channel is polled once.
                self.queue_all();
            }
        }
    }

    /// Why a wait whose time ran out found nothing: every channel closed, or
    /// only the time.
    fn nothing_came(&self) -> WaitError {
        if self.all_closed() {
            WaitError::Closed
        } else {
            WaitError::TimedOut
        }
    }

    /// Every channel is closed and delivered its last event (its `poll`
    /// gives nothing once closed).
    fn all_closed(&self) -> bool {
        self.keys().all(|k| self.get(k).is_some_and(|c| c.state() == ChannelState::Closed))
    }

    /// Poll each queued channel once, in turn: the first event (its
    /// channel goes to the back of the queue), or `None` once every queued
    /// channel is armed or asked to be polled again.
    fn serve_round(&mut self) -> Option<(usize, Event)> {
        for _ in 0..self.ready.len() {
            let key = self.ready.pop_front()?;
            let Some(entry) = self.entries.get_mut(key).and_then(Option::as_mut) else { continue };
            if let Some(ev) = entry.channel.poll() {
                self.ready.push_back(key);
                return Some((key, ev));
            }
            if entry.channel.arm() {
                entry.queued = false;
            } else {
                self.ready.push_back(key);
            }
        }
        None
    }

    /// Busy-poll every channel for up to `spin`.
    fn spin_all(&mut self, spin: Duration) -> Option<(usize, Event)> {
        let end = Instant::now() + spin;
        while Instant::now() < end {
            for (key, entry) in self.entries.iter_mut().enumerate() {
                let Some(entry) = entry else { continue };
                if let Some(ev) = entry.channel.poll() {
                    if !entry.queued {
                        entry.queued = true;
                        self.ready.push_back(key);
                    }
                    return Some((key, ev));
                }
            }
            std::hint::spin_loop();
        }
        None
    }

    /// Queue every channel (a backstop, when a long sleep found nothing).
    fn queue_all(&mut self) {
        for (key, entry) in self.entries.iter_mut().enumerate() {
            if let Some(e) = entry {
                if !e.queued {
                    e.queued = true;
                    self.ready.push_back(key);
                }
            }
        }
    }

    /// Wait up to `timeout` for armed channels to wake and queue them;
    /// how many woke.
    fn collect(&mut self, timeout: Duration) -> usize {
        let mut buf = [std::mem::MaybeUninit::uninit(); 64];
        let Ok((events, _)) = epoll::wait(&self.epoll, &mut buf, Some(&timespec(timeout))) else { return 0 };
        for ev in events.iter() {
            let key = ev.data.u64() as usize;
            if let Some(Some(entry)) = self.entries.get_mut(key) {
                if !entry.queued {
                    entry.queued = true;
                    self.ready.push_back(key);
                }
            }
        }
        events.len()
    }
}

impl std::fmt::Debug for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Selector").field("channels", &self.len()).field("queued", &self.ready.len()).finish()
    }
}

impl AsFd for Selector {
    /// Readable when a channel in the selector may have an event (after a
    /// [`wait`](Selector::wait) that returned, channels still queued are
    /// served without it: call `wait` with a zero timeout until `None`
    /// before sleeping on this fd).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selector_can_move_to_another_thread() {
        fn send<T: Send>(_: &T) {}
        let s = Selector::new().unwrap();
        send(&s);
        std::thread::spawn(move || drop(s)).join().unwrap();
    }
}
