//! Channel ends the program destroyed, kept until their peer has closed
//! too.
//!
//! `bulk_channel_destroy` tears the end down and returns at once, but the
//! peer may have sent messages before it saw the teardown: buffers passed
//! back, moves, copies. Over shared memory and TCP those wait in a ring or
//! a socket that only this end reads; dropped at once, the end would leave
//! them there, and their buffers would be lost to the pool for good (the
//! peer gave them up, this process never took them back). So a destroyed
//! end lingers on its waitset, off the program's sight, while dispatch
//! takes in what arrives (a buffer goes back to its pool's free list, a
//! copy is released) until the peer's own closing marker comes, the peer
//! goes, or [`LINGER`] passes; then it is dropped. Dropping the waitset
//! drops what still lingers, as a destroy did before.
//!
//! The lingering ends are armed with the waitset's channels: their fds and
//! a timer for the earliest deadline are in an epoll set of their own,
//! itself in the waitset's fd. A program that sleeps on `bulk_waitset_fd`
//! is woken for them as for its live channels, and a sleeping dispatch
//! does not need to wake up to look.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use ferry::{Channel, ChannelState, Event};
use rustix::event::epoll;
use rustix::time::{Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec};

/// How long a destroyed end waits for its peer's closing marker. A peer
/// that dispatches answers within microseconds; one that does not may
/// lose what it sends later, as with any closed channel.
pub const LINGER: Duration = Duration::from_secs(2);

/// Events one poll takes from one lingering end at most: a peer that keeps
/// sending cannot hold a dispatch.
const EVENTS_PER_POLL: usize = 64;

/// The destroyed channel ends of a waitset that wait for their peers.
pub struct Closing {
    ends: Vec<Lingering>,
    /// How long each waits ([`LINGER`]).
    linger: Duration,
    /// The armed ends' fds and `timer`: readable when one of them has
    /// something or the earliest deadline passed.
    epoll: OwnedFd,
    /// Fires at the earliest deadline of the ends (when armed).
    timer: OwnedFd,
    /// The deadline `timer` is set to.
    timer_at: Option<Instant>,
}

/// A destroyed end and until when it waits.
struct Lingering {
    channel: Channel,
    until: Instant,
}

impl Closing {
    /// An empty set, with its epoll set and timer.
    pub fn new() -> rustix::io::Result<Closing> {
        Closing::with_linger(LINGER)
    }

    fn with_linger(linger: Duration) -> rustix::io::Result<Closing> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let timer =
            rustix::time::timerfd_create(TimerfdClockId::Monotonic, TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK)?;
        epoll::add(&epoll, &timer, epoll::EventData::new_u64(0), epoll::EventFlags::IN)?;
        Ok(Closing { ends: Vec::new(), linger, epoll, timer, timer_at: None })
    }

    /// Takes over a destroyed end: tears it down (again, if the queue was
    /// full the first time) and keeps it until its peer has closed, unless
    /// it is not connected (nothing can be on its way) or closed already,
    /// or its fd cannot be watched (then it is dropped as before lingering
    /// existed: what the peer sends after is lost).
    pub fn add(&mut self, mut channel: Channel) {
        if !matches!(channel.state(), ChannelState::Connected | ChannelState::Teardown) {
            return;
        }
        if channel.state() == ChannelState::Connected {
            let _ = channel.teardown();
        }
        let _ = channel.flush();
        if epoll::add(&self.epoll, &channel, epoll::EventData::new_u64(1), epoll::EventFlags::IN).is_ok() {
            self.ends.push(Lingering { channel, until: Instant::now() + self.linger });
        }
    }

    /// Whether an end lingers.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Takes in what the lingering ends received and drops each one whose
    /// peer has closed, has gone, or did not answer in time.
    pub fn poll(&mut self) {
        let now = Instant::now();
        let epoll = &self.epoll;
        self.ends.retain_mut(|end| {
            let keep = take_in(&mut end.channel) && now < end.until;
            if !keep {
                // Explicitly: the channel's fd may outlive it elsewhere.
                let _ = epoll::delete(epoll, &end.channel);
            }
            keep
        });
        if self.ends.is_empty() {
            self.set_timer(None);
        }
    }

    /// Arms every lingering end and the timer for the earliest deadline, so
    /// that [`Closing`]'s fd says when to [`Closing::poll`] again. False if
    /// an end has something now or a deadline passed: poll at once.
    pub fn arm(&mut self) -> bool {
        let mut first: Option<Instant> = None;
        for end in &mut self.ends {
            if !end.channel.arm() {
                return false;
            }
            first = Some(first.map_or(end.until, |t| t.min(end.until)));
        }
        if first.is_some_and(|t| t <= Instant::now()) {
            return false;
        }
        self.set_timer(first)
    }

    /// Sets the timer to fire at `at` (or never); false if it could not.
    /// Setting it also clears a firing that was not read.
    fn set_timer(&mut self, at: Option<Instant>) -> bool {
        if at == self.timer_at {
            return true;
        }
        // Relative: Instant's clock is CLOCK_MONOTONIC, but a relative time
        // needs no conversion. Zero disarms: at least 1 ns.
        let value =
            at.map_or(Duration::ZERO, |t| t.saturating_duration_since(Instant::now()).max(Duration::from_nanos(1)));
        let spec = Itimerspec { it_interval: timespec(Duration::ZERO), it_value: timespec(value) };
        let set = rustix::time::timerfd_settime(&self.timer, TimerfdTimerFlags::empty(), &spec).is_ok();
        if set {
            self.timer_at = at;
        }
        set
    }
}

impl AsFd for Closing {
    /// Readable when an armed lingering end has something or the earliest
    /// deadline passed (see [`Closing::arm`]).
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

fn timespec(d: Duration) -> Timespec {
    Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) }
}

/// Takes in up to [`EVENTS_PER_POLL`] events of a lingering end; false
/// once it is closed.
fn take_in(channel: &mut Channel) -> bool {
    if channel.state() == ChannelState::Connected {
        // The teardown found the queue full: it goes out once there is room.
        let _ = channel.teardown();
    }
    for _ in 0..EVENTS_PER_POLL {
        let Some(event) = channel.poll() else { break };
        // A copy goes back to its owner (refused: the channel closed, and
        // with it the copy). Buffers moved or passed to us go back to
        // their pools' free lists as the event is dropped; the rest needs
        // no answer.
        if let Event::CopyReceived { copy, .. } = event {
            let _ = channel.release(copy);
        }
        if channel.state() == ChannelState::Closed {
            return false;
        }
    }
    channel.state() != ChannelState::Closed
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry::{Allocator, BindParams, ChannelSetup, Domain, Endpoint, PoolConstraints, PoolPolicy};

    const T: Duration = Duration::from_secs(10);

    /// A connected shm channel (`tx` in `a`, `rx` in `b`, both in this
    /// process) with `alloc`'s pool assigned.
    fn channel(name: &str) -> (Domain, Channel, Channel, Allocator) {
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let path = std::env::temp_dir().join(format!("ferry-c-closing-{}-{name}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let ep = Endpoint::shm(&path);
        let mut tx = Channel::create(&a, &ep, ChannelSetup::default()).expect("create");
        let mut rx = Channel::bind(&b, &ep, BindParams::default()).expect("bind");
        tx.wait_connected(T).expect("tx connected");
        rx.wait_connected(T).expect("rx connected");
        rx.set_pool_policy(PoolPolicy::AcceptAll);
        let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default()).expect("allocator");
        tx.assign_pool(alloc.pool()).expect("assign");
        rx.poll();
        tx.poll();
        (a, tx, rx, alloc)
    }

    /// What the peer passes back before it sees the teardown reaches the
    /// lingering end and goes back to the pool; the end goes once the
    /// peer's marker came.
    #[test]
    fn a_lingering_end_takes_in_what_the_peer_sent_before_its_marker() {
        let (_a, mut tx, mut rx, alloc) = channel("takes-in");
        tx.move_buffer(alloc.alloc().expect("buffer"), &[]).expect("move");
        let Ok(Event::MoveReceived { buffer, .. }) = rx.wait(Some(T)) else { panic!("no move") };
        let mut closing = Closing::new().expect("closing set");
        closing.add(tx);
        // The peer passes the buffer back before it polls the teardown.
        rx.pass(buffer, &[]).expect("pass back");
        assert!(matches!(rx.wait(Some(T)), Ok(Event::Closed { by_peer: true })));
        let deadline = Instant::now() + T;
        while !closing.is_empty() {
            assert!(Instant::now() < deadline, "the lingering end never closed");
            closing.poll();
        }
        assert_eq!(alloc.available(), 4, "the buffer passed back did not reach the pool");
    }

    /// Whether `fd` polls readable within `t`.
    fn readable(fd: BorrowedFd<'_>, t: Duration) -> bool {
        let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
        let ts = Timespec { tv_sec: t.as_secs() as i64, tv_nsec: i64::from(t.subsec_nanos()) };
        rustix::event::poll(&mut fds, Some(&ts)).expect("poll") == 1
    }

    /// Armed, the set's fd stays quiet until the peer sends something,
    /// then says so: a program sleeping on the waitset's fd is woken for
    /// what reaches a destroyed end.
    #[test]
    fn an_armed_lingering_end_wakes_the_fd_when_its_peer_sends() {
        let (_a, mut tx, mut rx, alloc) = channel("wakes");
        tx.move_buffer(alloc.alloc().expect("buffer"), &[]).expect("move");
        let Ok(Event::MoveReceived { buffer, .. }) = rx.wait(Some(T)) else { panic!("no move") };
        let mut closing = Closing::new().expect("closing set");
        closing.add(tx);
        closing.poll();
        assert!(closing.arm(), "nothing had come yet");
        assert!(!readable(closing.as_fd(), Duration::from_millis(20)), "readable with nothing come");
        rx.pass(buffer, &[]).expect("pass back");
        assert!(readable(closing.as_fd(), T), "the pass back did not wake the fd");
        closing.poll();
        assert_eq!(alloc.available(), 4, "the buffer passed back did not reach the pool");
        // The peer's closing marker: woken again, and the end goes.
        assert!(matches!(rx.wait(Some(T)), Ok(Event::Closed { by_peer: true })));
        let deadline = Instant::now() + T;
        while !closing.is_empty() {
            assert!(Instant::now() < deadline, "the lingering end never closed");
            if closing.arm() {
                assert!(readable(closing.as_fd(), T), "the closing marker did not wake the fd");
            }
            closing.poll();
        }
        assert!(!readable(closing.as_fd(), Duration::ZERO), "an empty set's fd is readable");
    }

    /// The deadline of an end whose peer never answers wakes the fd too;
    /// the end then goes and the fd is quiet again.
    #[test]
    fn a_lingering_end_s_deadline_wakes_the_fd() {
        let (_a, tx, _rx, _alloc) = channel("deadline");
        let mut closing = Closing::with_linger(Duration::from_millis(50)).expect("closing set");
        closing.add(tx);
        closing.poll();
        assert!(closing.arm());
        assert!(readable(closing.as_fd(), T), "the deadline did not wake the fd");
        closing.poll();
        assert!(closing.is_empty());
        assert!(!readable(closing.as_fd(), Duration::ZERO), "the fired timer left the fd readable");
    }

    /// A peer that never answers does not keep the end for ever.
    #[test]
    fn a_lingering_end_whose_peer_never_answers_goes_after_its_time() {
        let (_a, tx, _rx, _alloc) = channel("goes");
        let mut closing = Closing::with_linger(Duration::from_millis(20)).expect("closing set");
        closing.add(tx);
        assert!(!closing.is_empty());
        std::thread::sleep(Duration::from_millis(30));
        closing.poll();
        assert!(closing.is_empty());
    }
}
