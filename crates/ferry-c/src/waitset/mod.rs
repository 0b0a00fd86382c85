//! A waitset: a Ferry [`Selector`] over its channel ends, the ends' C-side
//! state, and the work due (continuations, further callbacks). Each
//! waitset has its own lock; the table's lock is taken inside it when an
//! event or a call touches buffers or pools, never the other way round.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ferry::{Buffer, BufferState, Channel, ChannelState, Direction, Event, Meta, PoolId, Selector};
use rustix::event::{epoll, eventfd, EventfdFlags};

use crate::boundary::{self, ChannelFields};
use crate::closing::Closing;
use crate::codes::*;
use crate::ffi::*;
use crate::state::Res;
use crate::table::{
    drop_channel_handles, pool_at, with_buffer_in, with_pool, with_pool_in, PoolCache, PoolEntry, View, GENERATION,
};

mod chans;
mod meta;
mod work;

use chans::{channel_of, Chan, Chans, Link, Polled};
pub use chans::{ChanId, IdMap};
use meta::meta_bytes;
pub use meta::MetaBuf;
pub use work::{BufferCall, Cont, Sending, Step, Work};

/// What a direct poll of the channels found.
enum Found {
    /// A buffer moved or passed to us, the program's now: its callback,
    /// if it has one.
    Buffer(Option<BufferCall>),
    /// Any other event, of the channel end `at` (whose meta size is the
    /// number).
    Other(Polled, usize, Event),
}

/// Channel events served in a row before one queued work runs.
const FAIRNESS: u32 = 32;

/// How long dispatch polls the channels before it arms them and, with a
/// timeout, sleeps: Ferry's own spin before sleeping. A busy-polling
/// program thereby never makes its peer ring a doorbell.
pub const DEFAULT_SPIN: Duration = ferry::DEFAULT_SPIN;

/// A waitset that handed out work this recently is busy: dispatch spins
/// on it. One that has been idle longer arms at once.
const BUSY: Duration = Duration::from_millis(1);

/// A spinning dispatch reads the clock once per this many empty polls.
const CLOCK_EVERY: u32 = 16;

/// A dispatch's spin: until when it polls (`None` until its first empty
/// poll), and its empty polls since.
#[derive(Default)]
pub struct SpinClock {
    until: Option<Instant>,
    polls: u32,
}

/// A channel end and the parts of its waitset a call on it uses.
type ChanParts<'a> = (&'a mut Chan, &'a mut Selector, &'a mut PoolCache, &'a mut bool);

/// After an accepted send without continuation of `payload` bytes on
/// `chan`: publishes it, or notes in `held_back` that a callback held it
/// back for batching (see [`Waitset::sent`]).
#[inline]
fn sent_unanswered(chan: &mut Chan, selector: &mut Selector, held_back: &mut bool, payload: u64, batched: bool) {
    chan.queued_payload += payload;
    if batched {
        *held_back = true;
    } else if let Some(c) = channel_of(selector, chan) {
        let _ = c.flush();
    }
}

/// A waitset.
pub struct Waitset {
    selector: Selector,
    /// Selector key → channel token.
    keys: IdMap<usize>,
    /// The attached channel ends, in the order they are polled (so that a
    /// polled buffer event needs no lookup of its channel end).
    order: Vec<Polled>,
    /// The channel ends.
    chans: Chans,
    /// The program's fd: the selector's fd, `bell` and `closing`'s fd.
    epoll: OwnedFd,
    /// Readable while `pending` has work (or a new channel wants a poll).
    bell: OwnedFd,
    rung: bool,
    pending: VecDeque<Work>,
    /// Channel events served since queued work last ran.
    streak: u32,
    /// Continuations waiting for their bytes to be written, on all channels.
    unsent: usize,
    /// Where the next direct poll of the channels starts (fairness).
    next_poll: usize,
    /// A callback held a send back for batching since the channels were
    /// last polled (see [`Waitset::poll_channels`]).
    held_back: bool,
    /// The last round of polls started at the channel of the event before
    /// it (see [`Waitset::poll_channels`]).
    started_at_sender: bool,
    /// See [`DEFAULT_SPIN`].
    pub spin: Duration,
    /// About when the last work was handed to dispatch: read when a
    /// dispatch first finds nothing after `worked`.
    last_work: Instant,
    /// Work was handed out since `last_work` was read.
    worked: bool,
    /// The program took the fd (`bulk_waitset_fd`): it may sleep on it, so
    /// a dispatch that finds nothing arms the channels even when it does
    /// not sleep itself.
    fd_taken: bool,
    /// The pools its calls and events used last.
    pools: PoolCache,
    /// Destroyed channel ends waiting for their peers' closing markers.
    closing: Closing,
}

fn fields_of(c: &Channel, closed: bool) -> ChannelFields {
    ChannelFields {
        state: if closed { STATE_CLOSED } else { state_to(c.state()) },
        direction: direction_to(c.direction()),
        role: role_to(c.role()),
        trust: trust_to(c.trust()),
        meta_size: c.meta_size(),
    }
}

/// Checks that a channel may send: connected, and this direction.
fn check_sending(c: &Channel, dir: Direction) -> Res<()> {
    match c.state() {
        ChannelState::Connected => {}
        ChannelState::Teardown | ChannelState::Closed => return Err(ERR_CHANNEL_CLOSED),
        _ => return Err(ERR_CHANNEL_STATE),
    }
    if c.direction() != dir {
        return Err(ERR_WRONG_DIRECTION);
    }
    Ok(())
}

impl Waitset {
    /// A new waitset.
    pub fn new() -> Res<Waitset> {
        let no_fd = |_| ERR_NO_RESOURCES;
        let selector = Selector::new().map_err(|e| of_error(&e))?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(no_fd)?;
        let bell = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(no_fd)?;
        epoll::add(&ep, selector.as_fd(), epoll::EventData::new_u64(0), epoll::EventFlags::IN).map_err(no_fd)?;
        epoll::add(&ep, &bell, epoll::EventData::new_u64(1), epoll::EventFlags::IN).map_err(no_fd)?;
        let closing = Closing::new().map_err(no_fd)?;
        epoll::add(&ep, closing.as_fd(), epoll::EventData::new_u64(2), epoll::EventFlags::IN).map_err(no_fd)?;
        Ok(Waitset {
            selector,
            keys: IdMap::default(),
            order: Vec::new(),
            chans: Chans::default(),
            epoll: ep,
            bell,
            rung: false,
            pending: VecDeque::new(),
            streak: 0,
            unsent: 0,
            next_poll: 0,
            held_back: false,
            started_at_sender: false,
            spin: DEFAULT_SPIN,
            last_work: Instant::now(),
            worked: false,
            fd_taken: false,
            pools: PoolCache::default(),
            closing,
        })
    }

    /// The program's fd, for the program to wait on. Until the program
    /// takes it, a dispatch that does not sleep leaves the channels unarmed;
    /// so the fd is made readable once, and the program's loop dispatches
    /// until `BULK_ERR_TIMEOUT`, which arms them.
    pub fn take_fd(&mut self) -> i32 {
        if !self.fd_taken {
            self.fd_taken = true;
            self.ring();
        }
        self.epoll.as_raw_fd()
    }

    /// Whether channels are on it or work is queued.
    pub fn busy(&self) -> bool {
        !self.chans.is_empty() || !self.pending.is_empty()
    }

    /// The oldest queued work (the fd stays readable while more is queued).
    fn pop(&mut self) -> Option<Work> {
        let w = self.pending.pop_front()?;
        self.streak = 0;
        if self.pending.is_empty() {
            self.quiet();
        }
        Some(w)
    }

    fn push(&mut self, w: Work) {
        self.pending.push_back(w);
        self.ring();
    }

    fn ring(&mut self) {
        if !self.rung {
            self.rung = true;
            let _ = rustix::io::write(&self.bell, &1u64.to_ne_bytes());
        }
    }

    fn quiet(&mut self) {
        if self.rung {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(&self.bell, &mut b);
            self.rung = false;
        }
    }

    /// Adds a channel end; its place (see [`ChanId`]).
    pub fn insert(
        &mut self,
        token: usize,
        (ch, callbacks, local): (usize, usize, bool),
        mut channel: Channel,
        bind_cont: Option<Cont>,
    ) -> usize {
        // Armed, its fd tells the program's loop when it has an event; one
        // that may have one already makes the loop look at once.
        let may_have_event = !channel.arm();
        let key = self.selector.insert(channel);
        self.keys.insert(key, token);
        self.order.push(Polled { key, token, c_addr: ch, callbacks, local });
        let place = self.chans.insert(Chan {
            token,
            c_addr: ch,
            callbacks,
            link: Link::Attached(key),
            bind_cont,
            assigning: Vec::new(),
            removing: Vec::new(),
            connected_once: false,
            queued_payload: 0,
            unsent: VecDeque::new(),
        });
        if may_have_event {
            self.ring();
        }
        place
    }

    /// The channel end `id` (checked against the C struct's address).
    fn chan(&mut self, id: ChanId, ch: usize) -> Res<(&mut Chan, &mut Selector)> {
        let (chan, selector, _, _) = self.chan_and_pools(id, ch)?;
        Ok((chan, selector))
    }

    /// [`chan`](Self::chan), the waitset's pool cache and its `held_back`.
    fn chan_and_pools(&mut self, id: ChanId, ch: usize) -> Res<ChanParts<'_>> {
        match self.chans.at_mut(id) {
            Some(c) if c.c_addr == ch => Ok((c, &mut self.selector, &mut self.pools, &mut self.held_back)),
            _ => Err(ERR_INVALID_CHANNEL),
        }
    }

    /// The next thing dispatch does: a channel event if one is due, else
    /// queued work (continuations, and the further callbacks of an event
    /// that called for several). Channel events come first because they
    /// carry the peer's actions, which a program waits for; a continuation
    /// only reports that one of its own calls completed. After
    /// [`FAIRNESS`] events in a row one queued work runs, so a busy peer
    /// cannot hold continuations back for ever. Until the end of `spin` the
    /// channels are only polled (no system call, no doorbell for the peer
    /// to ring); after it they are armed, and `Idle` means the fd will
    /// tell when to look again. A dispatch that will not sleep (`sleeps`
    /// false) on a waitset whose fd the program never took does not arm
    /// them (`Nothing`): arming costs system calls here and at the peer,
    /// and nobody could wait for what it announces.
    ///
    /// A buffer event's meta data is written to `meta` (as
    /// [`MetaBuf::new`] made it), for [`Step::Buffer`].
    pub fn next_step(&mut self, spin: &mut SpinClock, sleeps: bool, meta: &mut MetaBuf) -> Step {
        let step = self.next_step_inner(spin, sleeps, meta);
        if matches!(step, Step::Run(_) | Step::Buffer(_)) {
            self.worked = true;
        }
        step
    }

    /// Until when a dispatch that found nothing at `now` polls before
    /// arming: the spin, if the waitset is busy (the clock is read only
    /// once a dispatch finds nothing to do).
    fn spin_until(&mut self, now: Instant) -> Instant {
        if std::mem::take(&mut self.worked) {
            self.last_work = now;
        }
        if now.saturating_duration_since(self.last_work) < BUSY {
            now + self.spin
        } else {
            now
        }
    }

    fn next_step_inner(&mut self, spin: &mut SpinClock, sleeps: bool, meta: &mut MetaBuf) -> Step {
        self.release_written();
        if !self.closing.is_empty() {
            self.closing.poll();
        }
        if self.streak >= FAIRNESS {
            if let Some(w) = self.pop() {
                return Step::Run(w);
            }
        }
        if let Some(found) = self.poll_channels(meta) {
            self.streak += 1;
            let work = match found {
                Found::Buffer(Some(call)) => return Step::Buffer(call),
                Found::Buffer(None) => None,
                Found::Other(at, meta_size, ev) => self.take_event(at, meta_size, ev),
            };
            return work.map_or(Step::Spin, Step::Run);
        }
        if let Some(w) = self.pop() {
            return Step::Run(w);
        }
        // The clock is read at the first empty poll (an idle waitset arms
        // at once), then every CLOCK_EVERY polls: a busy poll stays a poll.
        match spin.until {
            Some(until) => {
                spin.polls += 1;
                if spin.polls % CLOCK_EVERY != 0 || Instant::now() < until {
                    return Step::Spin;
                }
            }
            None => {
                let now = Instant::now();
                let until = self.spin_until(now);
                spin.until = Some(until);
                if now < until {
                    return Step::Spin;
                }
            }
        }
        if self.pending.is_empty() {
            self.quiet();
        }
        // Nothing due: what callbacks sent goes out before the channels
        // are armed and dispatch returns or sleeps.
        self.flush_all();
        if !sleeps && !self.fd_taken {
            return Step::Nothing;
        }
        match self.selector.wait(Some(Duration::ZERO)) {
            Ok((key, ev)) => {
                self.streak += 1;
                match self.keys.get(&key).copied().and_then(|token| self.take_event_of(token, ev)) {
                    Some(w) => Step::Run(w),
                    None => Step::Spin,
                }
            }
            // A destroyed end that has something already: take it in first.
            Err(_) if !self.closing.is_empty() && !self.closing.arm() => Step::Spin,
            Err(_) => Step::Idle { fd: self.epoll.as_raw_fd(), live: !self.selector.is_empty() },
        }
    }

    /// Publishes what the attached channels hold back.
    fn flush_all(&mut self) {
        for p in &self.order {
            if let Some(c) = self.selector.get_mut(p.key) {
                let _ = c.flush();
            }
        }
    }

    /// Polls every attached channel once, starting after the one that
    /// had the last event: the first event, with its channel end and the
    /// channel's meta size. A channel's poll that finds
    /// nothing publishes what callbacks held back on it, which another
    /// channel of this waitset may be waiting for (both ends of a channel
    /// here): if callbacks held sends back, a round that found nothing is
    /// followed by a second one, rather than by a dispatch that returns
    /// `BULK_ERR_TIMEOUT` while the answer is there.
    ///
    /// If the last event's callback held sends back (the echo's pass) and
    /// its channel is local, the round starts at that channel: caught up,
    /// it publishes them before the others are polled (the answer's reader
    /// may be one of them: both ends of a local channel on one waitset),
    /// so that the answer is not found only by a second round; with more
    /// to deliver it delivers the next message and its batch goes on. At
    /// most every other round starts so, so that a channel whose callbacks
    /// always send cannot keep the others from their turn.
    fn poll_channels(&mut self, meta_out: &mut MetaBuf) -> Option<Found> {
        let n = self.order.len();
        if n == 0 {
            return None;
        }
        loop {
            let held_back = std::mem::take(&mut self.held_back);
            // Indices wrap by a compare, not a division (one per poll).
            let mut i = self.next_poll.min(n - 1);
            let sender = if i == 0 { n - 1 } else { i - 1 };
            self.started_at_sender = held_back && !self.started_at_sender && self.order[sender].local;
            if self.started_at_sender {
                i = sender;
            }
            for _ in 0..n {
                let at = self.order[i];
                i = if i + 1 == n { 0 } else { i + 1 };
                let Some(c) = self.selector.get_mut(at.key) else { continue };
                let Some(ev) = c.poll() else { continue };
                let meta_size = c.meta_size();
                self.next_poll = i;
                // Not every channel was polled: some may still hold back.
                self.held_back |= held_back;
                // The usual events, a buffer moved or passed to us, become
                // their callback here: the event is not moved again (its
                // meta data is read where it is).
                let (passed, buffer, meta) = match ev {
                    Event::MoveReceived { buffer, ref meta } => (false, buffer, meta),
                    Event::BufferPassed { buffer, ref meta } => (true, buffer, meta),
                    ev => return Some(Found::Other(at, meta_size, ev)),
                };
                let call = received_owned(&mut self.pools, at, passed, buffer).map(|(f, buffer)| {
                    meta_out.fill(meta, meta_size);
                    BufferCall { f, ch: at.c_addr, buffer }
                });
                return Some(Found::Buffer(call));
            }
            if !held_back {
                return None;
            }
        }
    }

    /// Writes the channel fields that follow its state.
    fn sync(&mut self, token: usize) {
        let Some(chan) = self.chans.get_mut(&token) else { return };
        let (ch, closed) = (chan.c_addr, matches!(chan.link, Link::Detached(_)));
        if let Some(c) = channel_of(&mut self.selector, chan) {
            boundary::write_channel_fields(ch as *mut BulkChannel, &fields_of(c, closed));
        }
    }

    /// Takes a closed channel out of the selector (its fd says nothing more).
    fn detach(&mut self, token: usize) {
        let Some(chan) = self.chans.get_mut(&token) else { return };
        if let Link::Attached(key) = chan.link {
            self.keys.remove(&key);
            self.order.retain(|p| p.key != key);
            if let Some(c) = self.selector.remove(key) {
                chan.link = Link::Detached(Box::new(c));
            }
        }
        self.sync(token);
    }

    /// [`take_event`](Self::take_event) for the channel of `token`, looked up.
    fn take_event_of(&mut self, token: usize, ev: Event) -> Option<Work> {
        let chan = self.chans.get_mut(&token)?;
        let (c_addr, callbacks) = (chan.c_addr, chan.callbacks);
        let meta_size = channel_of(&mut self.selector, chan).map_or(0, |c| c.meta_size());
        // The key is not used by take_event.
        self.take_event(Polled { key: usize::MAX, token, c_addr, callbacks, local: false }, meta_size, ev)
    }

    /// Turns the event of the channel end `at` into the work it calls for
    /// (more of it is queued).
    fn take_event(&mut self, at: Polled, meta_size: usize, ev: Event) -> Option<Work> {
        let (token, ch, cbs) = (at.token, at.c_addr, at.callbacks as *const BulkChannelCallbacks);
        // The usual events need one callback: only it is read.
        let ev = match ev {
            Event::MoveReceived { buffer, meta } => {
                return buffer_work(&mut self.pools, at, false, buffer, &meta, meta_size)
            }
            Event::BufferPassed { buffer, meta } => {
                return buffer_work(&mut self.pools, at, true, buffer, &meta, meta_size)
            }
            ev => ev,
        };
        let cbs = boundary::read(cbs)?;
        match ev {
            Event::BindRequest { .. } | Event::Bound => {
                let chan = self.chans.get_mut(&token)?;
                chan.connected_once = true;
                let bind_cont = chan.bind_cont.take();
                // Sends made by callbacks are published in batches (see
                // `Waitset::sent`).
                if let Some(c) = channel_of(&mut self.selector, chan) {
                    let _ = c.set_batching(true);
                }
                self.sync(token);
                if let Some(cont) = bind_cont {
                    return Some(Work::Cont { cont, err: OK, ch });
                }
                cbs.bind_received.map(|f| Work::Bind { f, ch, token })
            }
            Event::PoolAssignRequest(req) => {
                GENERATION.fetch_add(1, Ordering::Relaxed);
                let pool_ptr = with_pool(req.pool, true, |e| e.pool_ptr());
                match (pool_ptr, cbs.pool_assigned) {
                    (Some(pool_ptr), Some(f)) => Some(Work::PoolAssigned { f, ch, token, pool_ptr, pool: req.pool }),
                    (found, _) => {
                        // No callback: accepted, as in the original; a pool
                        // this process cannot map: refused.
                        self.answer_pool(token, req.pool, found.is_some());
                        None
                    }
                }
            }
            Event::PoolAssigned(id) | Event::PoolVetoed(id) => {
                let err = if matches!(ev, Event::PoolAssigned(_)) { OK } else { ERR_POOL_VETOED };
                with_pool(id, false, |e| e.refresh_trust());
                let chan = self.chans.get_mut(&token)?;
                let i = chan.assigning.iter().position(|(p, _)| *p == id)?;
                let (_, cont) = chan.assigning.remove(i);
                cont.map(|cont| Work::Cont { cont, err, ch })
            }
            Event::PoolRemoved(id) | Event::PoolRemoveRefused(id) => {
                let err = if matches!(ev, Event::PoolRemoved(_)) { OK } else { ERR_POOL_IN_USE };
                let chan = self.chans.get_mut(&token)?;
                if let Some(i) = chan.removing.iter().position(|(p, _)| *p == id) {
                    let (_, cont) = chan.removing.remove(i);
                    return cont.map(|cont| Work::Cont { cont, err, ch });
                }
                let f = cbs.pool_removed?;
                let pool_ptr = with_pool(id, false, |e| e.pool_ptr())?;
                Some(Work::PoolRemoved { f, ch, token, pool_ptr, pool: id })
            }
            // Served above.
            Event::MoveReceived { .. } | Event::BufferPassed { .. } => None,
            Event::CopyReceived { copy, meta } => {
                let id = copy.id();
                let i = id.index as usize;
                let buffer = with_pool(id.pool, true, |e| {
                    // A copy arriving where the program neither owns the
                    // buffer nor holds a copy of it through the owner's
                    // object (another process's buffer) comes in that
                    // object, the one in `pool->buffers`; a copy of a buffer
                    // the program owns or reads through it already (a local
                    // channel: one domain) comes in the second object, which
                    // has its own state.
                    let mut slot = e.slot(i);
                    let view = if slot.owned.is_none() && !slot.copies.iter().any(|c| c.2 == View::Owner) {
                        View::Owner
                    } else {
                        View::Copy
                    };
                    slot.copies.push((token, copy, view));
                    slot.refresh();
                    e.buffer_ptr(i, view)
                })?;
                let meta = meta_bytes(&meta, meta_size);
                cbs.copy_received.map(|f| Work::Buffer { f, ch, token, buffer, meta })
            }
            Event::CopyReleased { buffer: id, writable } => {
                let i = id.index as usize;
                let buffer = with_pool(id.pool, false, |e| {
                    let known = if writable { BufferState::ReadWrite } else { BufferState::ReadOnlyOwned };
                    e.slot(i).refresh_as(Some(known));
                    e.buffer_ptr(i, View::Owner)
                })?;
                cbs.copy_released.map(|f| Work::Released { f, ch, token, buffer })
            }
            Event::Closed { .. } | Event::Error(_) => {
                let err = match &ev {
                    Event::Error(e) => of_error(e),
                    _ => ERR_CHANNEL_CLOSED,
                };
                self.detach(token);
                let chan = self.chans.get_mut(&token)?;
                let mut works = Vec::new();
                if let Some(cont) = chan.bind_cont.take() {
                    works.push(Work::Cont { cont, err, ch });
                }
                let unsent = chan.unsent.len();
                let unanswered = chan.assigning.drain(..).chain(chan.removing.drain(..));
                let unanswered = unanswered.filter_map(|(_, c)| c).chain(chan.unsent.drain(..).map(|(_, c)| c));
                works.extend(unanswered.map(|cont| Work::Cont { cont, err: ERR_CHANNEL_CLOSED, ch }));
                self.unsent -= unsent;
                if chan.connected_once {
                    if let Some(f) = cbs.teardown_received {
                        works.push(Work::Teardown { f, ch, token });
                    }
                }
                let mut works = works.into_iter();
                let first = works.next();
                for w in works {
                    self.push(w);
                }
                first
            }
            // Ferry's own kinds of events, which C programs never cause:
            // aggregates (dropped: their buffers return, their copies are
            // released) and the library's own vetoes of offers.
            Event::Aggregate { .. } | Event::PoolOfferRefused { .. } => None,
        }
    }

    /// The program's answer to a pool offer, sent to the peer.
    pub fn answer_pool(&mut self, token: usize, pool: PoolId, accept: bool) {
        let Some(chan) = self.chans.get_mut(&token) else { return };
        if let Some(c) = channel_of(&mut self.selector, chan) {
            let _ = c.respond_pool(pool, accept);
            let _ = c.flush();
        }
        with_pool(pool, false, |e| e.refresh_trust());
    }

    /// `bulk_channel_destroy`: the channel end leaves; what it had not
    /// answered is queued with `BULK_ERR_CHANNEL_DESTROYED`, then `cont`.
    pub fn destroy(&mut self, id: ChanId, ch: usize, cont: Option<Cont>) -> Res<()> {
        self.chan(id, ch)?;
        let token = id.token;
        let mut chan = self.chans.remove(&token).ok_or(ERR_INVALID_CHANNEL)?;
        let channel = match std::mem::replace(&mut chan.link, Link::Attached(usize::MAX)) {
            Link::Attached(key) => {
                self.keys.remove(&key);
                self.order.retain(|p| p.key != key);
                self.selector.remove(key)
            }
            Link::Detached(c) => Some(*c),
        };
        if let Some(c) = channel {
            // Torn down, it lingers until the peer's closing marker came:
            // what the peer sent before it is taken in, not lost.
            self.closing.add(c);
        }
        // Callbacks queued for it are not run (buffer callbacks are never
        // queued: they run from the poll that found them); the copies
        // received over it go back.
        self.pending.retain(|w| w.callback_token() != Some(token));
        drop_channel_handles(token);
        self.unsent -= chan.unsent.len();
        let unanswered = chan
            .bind_cont
            .take()
            .into_iter()
            .chain(chan.assigning.drain(..).chain(chan.removing.drain(..)).filter_map(|(_, c)| c))
            .chain(chan.unsent.drain(..).map(|(_, c)| c));
        for c in unanswered {
            self.push(Work::Cont { cont: c, err: ERR_CHANNEL_DESTROYED, ch });
        }
        if let Some(cont) = cont {
            self.push(Work::Cont { cont, err: OK, ch });
        }
        boundary::clear_channel(ch as *mut BulkChannel, STATE_CLOSED);
        Ok(())
    }

    /// `bulk_channel_assign_pool` and `bulk_channel_remove_pool`.
    pub fn channel_pool(&mut self, id: ChanId, ch: usize, pool: usize, cont: Option<Cont>, assign: bool) -> Res<()> {
        let (chan, selector) = self.chan(id, ch)?;
        let e = pool_at(pool)?;
        let id = e.pool.id();
        let c = channel_of(selector, chan).ok_or(ERR_CHANNEL_CLOSED)?;
        if assign {
            c.assign_pool(&e.pool).map_err(|e| of_error(&e))?;
        } else {
            c.remove_pool(id).map_err(|e| of_error(&e))?;
        }
        let _ = c.flush();
        e.refresh_trust();
        GENERATION.fetch_add(1, Ordering::Relaxed);
        if assign {
            // As the original's local backend does, a continuation given
            // without an argument gets the pool as its argument.
            let cont = cont.map(|c| c.or_arg(pool));
            chan.assigning.push((id, cont));
        } else {
            chan.removing.push((id, cont));
        }
        Ok(())
    }

    /// After an accepted send of `payload` bytes: publishes it, or leaves
    /// it to the waitset, and queues the call's continuation.
    ///
    /// A send without continuation made by a callback of this waitset
    /// (`batched`) is published in a batch with the callback's neighbours:
    /// by this waitset's dispatch when it polls the channel and finds
    /// nothing to deliver, before it arms the channels (before it returns
    /// `BULK_ERR_TIMEOUT` or sleeps), every 32 messages, when the queue is
    /// full, and when the channel is destroyed. Every other send is
    /// published before the call returns: a program that sends from its
    /// own loop and then waits on something else is not left waiting for
    /// a message we hold back.
    ///
    /// A continuation runs once the message has left the process: over
    /// local and shm links once it is in the peer's ring (published now);
    /// over a network link once the link has written the payload queued so
    /// far to its socket (the TCP backend batches, and a program may exit
    /// once its continuation ran).
    fn sent(&mut self, token: usize, ch: usize, payload: u64, Sending { cont, batched }: Sending) {
        let Some(chan) = self.chans.get_mut(&token) else { return };
        let Some(cont) = cont else {
            sent_unanswered(chan, &mut self.selector, &mut self.held_back, payload, batched);
            return;
        };
        chan.queued_payload += payload;
        let queued = chan.queued_payload;
        let Some(c) = channel_of(&mut self.selector, chan) else { return };
        let _ = c.flush();
        let written = c.link_stats().map(|s| s.payload_sent);
        match written {
            Some(written) if written < queued => {
                chan.unsent.push_back((queued, cont));
                self.unsent += 1;
            }
            _ => self.push(Work::Cont { cont, err: OK, ch }),
        }
    }

    /// Queues the continuations of sends whose bytes are written now.
    fn release_written(&mut self) {
        if self.unsent == 0 {
            return;
        }
        let mut done = Vec::new();
        for chan in self.chans.values_mut() {
            if chan.unsent.is_empty() {
                continue;
            }
            let ch = chan.c_addr;
            let Some(c) = channel_of(&mut self.selector, chan) else { continue };
            let _ = c.flush();
            let written = c.link_stats().map_or(u64::MAX, |s| s.payload_sent);
            while chan.unsent.front().is_some_and(|(target, _)| *target <= written) {
                if let Some((_, cont)) = chan.unsent.pop_front() {
                    done.push(Work::Cont { cont, err: OK, ch });
                }
            }
        }
        self.unsent -= done.len();
        for w in done {
            self.push(w);
        }
    }

    /// A call on one of the program's buffers over the channel end `id`
    /// (`send`, `copy`, `release`): the end must be able to send in `dir`;
    /// `op` does the call's work on the buffer (the channel, its pool, its
    /// index and object) and says how many payload bytes went; then the
    /// send is published or left to the waitset, and its continuation
    /// queued (see [`Waitset::sent`]).
    fn buffer_call(
        &mut self,
        id: ChanId,
        ch: usize,
        buffer: usize,
        how: Sending,
        dir: Direction,
        op: impl FnOnce(&mut Channel, &PoolEntry, usize, View) -> Res<u64>,
    ) -> Res<()> {
        let (chan, selector, pools, held_back) = self.chan_and_pools(id, ch)?;
        let c = channel_of(selector, chan).ok_or(ERR_CHANNEL_CLOSED)?;
        check_sending(c, dir)?;
        let payload = with_buffer_in(pools, buffer, |e, i, view| op(c, e, i, view))?;
        if how.cont.is_none() {
            // The usual send: no second lookup of the channel.
            sent_unanswered(chan, selector, held_back, payload, how.batched);
            return Ok(());
        }
        self.sent(id.token, ch, payload, how);
        Ok(())
    }

    /// `bulk_channel_move` and `bulk_channel_pass`.
    pub fn send(
        &mut self,
        id: ChanId,
        ch: usize,
        buffer: usize,
        meta: *const std::ffi::c_void,
        how: Sending,
        dir: Direction,
    ) -> Res<()> {
        self.buffer_call(id, ch, buffer, how, dir, |c, e, i, view| {
            if view == View::Copy {
                return Err(ERR_BUFFER_NOT_OWNED);
            }
            let mut s = e.slot(i);
            let b = s.owned.take().ok_or(ERR_BUFFER_NOT_OWNED)?;
            let sent = boundary::with_meta(meta, c.meta_size(), |meta| match dir {
                Direction::Tx => c.move_buffer(b, meta),
                Direction::Rx => c.pass(b, meta),
            });
            if let Err(r) = sent {
                let (error, value) = r.into_parts();
                s.owned = Some(value);
                return Err(of_error(&error));
            }
            s.refresh();
            Ok(e.pool.geometry().buffer_size() as u64)
        })
    }

    /// `bulk_channel_copy`.
    pub fn copy(
        &mut self,
        id: ChanId,
        ch: usize,
        buffer: usize,
        meta: *const std::ffi::c_void,
        how: Sending,
    ) -> Res<()> {
        self.buffer_call(id, ch, buffer, how, Direction::Tx, |c, e, i, view| {
            let meta_size = c.meta_size();
            let mut slot = e.slot(i);
            let held = slot.copies.iter().find(|h| h.2 == view).map(|h| &h.1);
            // The bytes travel unless the peer may hold a copy already: an
            // owner's buffer with no copies out surely sends them; for
            // the rest the continuation does not wait for them.
            let size = e.pool.geometry().buffer_size() as u64;
            let payload = match (view, &slot.owned) {
                (View::Owner, Some(_)) if slot.owner_state() == buffer_state_to(BufferState::ReadWrite) => size,
                _ => 0,
            };
            let sent = boundary::with_meta(meta, meta_size, |meta| match (view, &slot.owned, held) {
                (View::Owner, Some(b), _) => Ok(c.copy(b, meta)),
                (_, _, Some(copy)) => Ok(c.copy(copy, meta)),
                _ => Err(ERR_BUFFER_NOT_OWNED),
            })?;
            sent.map_err(|e| of_error(&e))?;
            slot.refresh();
            Ok(payload)
        })
    }

    /// `bulk_channel_release`.
    pub fn release(&mut self, id: ChanId, ch: usize, buffer: usize, how: Sending) -> Res<()> {
        let token = id.token;
        self.buffer_call(id, ch, buffer, how, Direction::Rx, |c, e, i, view| {
            let mut s = e.slot(i);
            let at = s.copies.iter().position(|h| h.0 == token && h.2 == view).ok_or(ERR_NOT_A_COPY)?;
            let (_, copy, _) = s.copies.remove(at).ok_or(ERR_NOT_A_COPY)?;
            if let Err(r) = c.release(copy) {
                let (error, copy) = r.into_parts();
                s.copies.insert(at, (token, copy, view));
                return Err(of_error(&error));
            }
            s.refresh();
            Ok(0)
        })
    }

    /// Lets go of the pools its cache holds that were forgotten.
    pub fn forget_pools(&mut self) {
        self.pools.forget_stale();
    }

    /// Removes from `candidates` the pools a channel end or queued work
    /// here may still refer to.
    pub fn keep_used(&mut self, candidates: &mut Vec<PoolId>) {
        let Waitset { chans, selector, pending, .. } = self;
        candidates.retain(|id| !pending.iter().any(|w| w.pool() == Some(*id)));
        for chan in chans.values_mut() {
            let negotiating: Vec<PoolId> = chan.assigning.iter().chain(&chan.removing).map(|(p, _)| *p).collect();
            let c = channel_of(selector, chan);
            candidates.retain(|id| {
                let listed = c
                    .as_ref()
                    .is_some_and(|c| c.is_assigned(*id) || c.pending_requests().iter().any(|r| r.pool == *id));
                !listed && !negotiating.contains(id)
            });
        }
    }
}

/// A buffer moved or passed to us over the channel end `at`: the program
/// owns it now. Its callback (`buffer_received` if `passed`, else
/// `move_received`) and its C object, if it has one (a NULL callbacks
/// struct: the event is dropped).
fn received_owned(pools: &mut PoolCache, at: Polled, passed: bool, buffer: Buffer) -> Option<(BufferCallback, usize)> {
    let f = boundary::buffer_callback(at.callbacks as *const BulkChannelCallbacks, passed)?;
    let id = buffer.id();
    let i = id.index as usize;
    let ptr = with_pool_in(pools, id.pool, true, |e| {
        let mut s = e.slot(i);
        s.owned = Some(buffer);
        s.refresh_as(Some(BufferState::ReadWrite));
        e.buffer_ptr(i, View::Owner)
    })?;
    Some((f?, ptr))
}

/// [`received_owned`] as queueable work (an event found by a wait on the
/// selector rather than by the direct poll).
fn buffer_work(
    pools: &mut PoolCache,
    at: Polled,
    passed: bool,
    buffer: Buffer,
    meta: &Meta,
    meta_size: usize,
) -> Option<Work> {
    let (f, buffer) = received_owned(pools, at, passed, buffer)?;
    Some(Work::Buffer { f, ch: at.c_addr, token: at.token, buffer, meta: meta_bytes(meta, meta_size) })
}
