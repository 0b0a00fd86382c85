//! How a channel end sleeps and is woken: doorbells (eventfds) that a peer
//! rings, and the [`WakeSet`] that gathers everything one channel end may be
//! woken by into one pollable fd.
//!
//! A channel end's fd is an epoll instance. Its backend adds what can wake
//! it — the doorbell the peer rings (local, shm), the socket that hangs up
//! when the peer process dies (shm) or that carries the data (TCP), a
//! listener during setup — and the set adds a timer for the backend's own
//! deadlines (keep-alives, setup timeouts). An epoll fd is itself pollable,
//! so the channel's fd works in `poll`, in an application's epoll, in mio
//! and in tokio's `AsyncFd`, and it stays the same fd for the channel's
//! whole life, whatever the backend adds or removes behind it.
//!
//! Doorbells are rung only on the empty → non-empty transition of a
//! consumer that declared itself asleep (the ring's sleep handshake;
//! \[OSIRIS\]: interrupt the host only when it waits), so arming the fd is
//! part of that protocol, not a wake-up per message.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::epoll;
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::time::{Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags};

/// What a backend asks of its channel after arming: wake when a registered
/// fd becomes ready, and at `until` at the latest (the backend's own
/// deadline), or do not sleep at all because something may be ready now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arm {
    /// Something may be ready now: poll again instead of sleeping.
    Ready,
    /// Armed: the channel's fd becomes readable when something may be
    /// ready, or at `until`.
    Sleep {
        /// A deadline of the backend's own (keep-alive, setup timeout).
        until: Option<Instant>,
    },
}

impl Arm {
    /// Armed, with no deadline of the backend's own.
    pub(crate) const SLEEP: Arm = Arm::Sleep { until: None };
}

/// What a registered fd wakes the set for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Interest {
    /// Readable (or hung up).
    Read,
    /// Readable or writable (a socket with output queued).
    ReadWrite,
    /// Only a hang-up of the peer (a socket that also carries messages the
    /// backend reads when it needs them, not when they come).
    HangUp,
}

impl Interest {
    fn flags(self) -> epoll::EventFlags {
        use epoll::EventFlags as F;
        match self {
            Interest::Read => F::IN | F::RDHUP,
            Interest::ReadWrite => F::IN | F::OUT | F::RDHUP,
            Interest::HangUp => F::RDHUP,
        }
    }
}

/// A doorbell: a non-blocking eventfd that a peer rings to wake us.
#[derive(Debug)]
pub(crate) struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    /// A fresh doorbell, not rung.
    pub(crate) fn new() -> io::Result<Doorbell> {
        Ok(Doorbell { fd: eventfd()? })
    }

    /// Ring it.
    pub(crate) fn ring(&self) {
        ring(&self.fd);
    }

    /// Take a ring that came, if any (before declaring sleep again):
    /// whether one came.
    pub(crate) fn reset(&self) -> bool {
        reset(&self.fd)
    }

    /// The eventfd, to register or send to a peer.
    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }
}

/// A non-blocking eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    Ok(rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?)
}

/// Ring an eventfd (non-blocking: a full counter means it is rung already).
pub(crate) fn ring(fd: &OwnedFd) {
    // EAGAIN only if the counter would overflow: it is rung already.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

/// Take what an eventfd counted: whether it was rung.
pub(crate) fn reset(fd: &OwnedFd) -> bool {
    let mut b = [0u8; 8];
    matches!(rustix::io::read(fd, &mut b), Ok(8))
}

/// One channel end's wake-up sources behind one pollable fd (see the
/// module docs).
#[derive(Debug)]
pub(crate) struct WakeSet {
    epoll: OwnedFd,
    /// Fires at the backend's deadline (made when first needed: a local or
    /// shared-memory channel end never needs one once connected).
    timer: Option<OwnedFd>,
    /// When the timer is set to fire, if it is.
    timer_at: Option<Instant>,
}

impl WakeSet {
    /// An empty set.
    pub(crate) fn new() -> io::Result<WakeSet> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        Ok(WakeSet { epoll, timer: None, timer_at: None })
    }

    /// The timer, made and added to the set the first time.
    fn timer(&mut self) -> io::Result<&OwnedFd> {
        if self.timer.is_none() {
            let flags = TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK;
            let timer = rustix::time::timerfd_create(TimerfdClockId::Monotonic, flags)?;
            epoll::add(&self.epoll, &timer, epoll::EventData::new_u64(0), epoll::EventFlags::IN)?;
            self.timer = Some(timer);
        }
        Ok(self.timer.as_ref().expect("made above"))
    }

    /// Wake for `fd` with `interest` (added, or changed if it is in already).
    pub(crate) fn watch(&self, fd: BorrowedFd<'_>, interest: Interest) -> io::Result<()> {
        let data = epoll::EventData::new_u64(0);
        match epoll::add(&self.epoll, fd, data, interest.flags()) {
            Err(Errno::EXIST) => Ok(epoll::modify(&self.epoll, fd, data, interest.flags())?),
            other => Ok(other?),
        }
    }

    /// Stop waking for `fd` (nothing if it is not watched).
    pub(crate) fn unwatch(&self, fd: BorrowedFd<'_>) {
        // ENOENT (not watched) is the only failure for an open fd.
        let _ = epoll::delete(&self.epoll, fd);
    }

    /// Fire the timer at `at` (or never). Cheap when nothing changes; a
    /// timer that fired is always re-set, which also makes it unreadable.
    /// Without a timer (out of fds), the caller's own backstop (a bounded
    /// sleep) still gets it there.
    pub(crate) fn set_timer(&mut self, at: Option<Instant>) {
        let now = Instant::now();
        let fired = self.timer_at.is_some_and(|t| t <= now);
        if at == self.timer_at && !fired {
            return;
        }
        if at.is_none() && self.timer_at.is_none() {
            return;
        }
        // Relative: the monotonic clock of Instant is CLOCK_MONOTONIC, but
        // a relative time needs no conversion. Zero would disarm: 1 ns.
        let value = match at {
            Some(t) => timespec(t.saturating_duration_since(now).max(Duration::from_nanos(1))),
            None => timespec(Duration::ZERO),
        };
        let spec = Itimerspec { it_interval: timespec(Duration::ZERO), it_value: value };
        let Ok(timer) = self.timer() else { return };
        if rustix::time::timerfd_settime(timer, TimerfdTimerFlags::empty(), &spec).is_ok() {
            self.timer_at = at;
        }
    }

    /// Block until the set is readable or `timeout` passes: `false` on
    /// timeout.
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        wait_readable(&[self.epoll.as_fd()], Some(timeout)).unwrap_or(true)
    }
}

impl AsFd for WakeSet {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

/// A duration as a `Timespec`.
pub(crate) fn timespec(t: Duration) -> Timespec {
    Timespec { tv_sec: t.as_secs().min(i64::MAX as u64) as i64, tv_nsec: i64::from(t.subsec_nanos()) }
}

/// Wait until any of `fds` is readable or hung up; `false` on timeout.
pub(crate) fn wait_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> io::Result<bool> {
    let mut pfds: Vec<PollFd<'_>> = fds.iter().map(|fd| PollFd::from_borrowed_fd(*fd, PollFlags::IN)).collect();
    let ts = timeout.map(timespec);
    loop {
        match rustix::event::poll(&mut pfds, ts.as_ref()) {
            Ok(n) => return Ok(n > 0),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Which of `fds` are readable or hung up now (one `poll`, no wait).
pub(crate) fn readable_now(fds: &[BorrowedFd<'_>]) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<PollFd<'_>> = fds.iter().map(|fd| PollFd::from_borrowed_fd(*fd, PollFlags::IN)).collect();
    let zero = timespec(Duration::ZERO);
    loop {
        match rustix::event::poll(&mut pfds, Some(&zero)) {
            Ok(_) => return Ok(pfds.iter().map(|p| !p.revents().is_empty()).collect()),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(set: &WakeSet) -> bool {
        wait_readable(&[set.as_fd()], Some(Duration::ZERO)).unwrap()
    }

    #[test]
    fn a_rung_doorbell_makes_the_set_readable_until_reset() {
        let set = WakeSet::new().unwrap();
        let bell = Doorbell::new().unwrap();
        set.watch(bell.fd().as_fd(), Interest::Read).unwrap();
        assert!(!readable(&set));
        bell.ring();
        assert!(readable(&set));
        assert!(set.wait(Duration::from_secs(5)));
        bell.reset();
        assert!(!readable(&set), "level-triggered: reset makes it quiet again");
        // Watching again changes the interest instead of failing.
        set.watch(bell.fd().as_fd(), Interest::HangUp).unwrap();
        bell.ring();
        assert!(!readable(&set), "a hang-up watch ignores data");
    }

    #[test]
    fn the_timer_fires_and_is_quiet_once_reset() {
        let mut set = WakeSet::new().unwrap();
        set.set_timer(Some(Instant::now() + Duration::from_millis(1)));
        assert!(set.wait(Duration::from_secs(10)), "the timer fired");
        assert!(readable(&set));
        set.set_timer(None);
        assert!(!readable(&set), "a fired timer that is re-set is quiet");
        set.set_timer(Some(Instant::now() + Duration::from_secs(3600)));
        assert!(!readable(&set));
    }

    #[test]
    fn a_hang_up_wakes_a_hang_up_watch() {
        let set = WakeSet::new().unwrap();
        let (a, b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        set.watch(a.as_fd(), Interest::HangUp).unwrap();
        rustix::net::send(&b, b"x", rustix::net::SendFlags::empty()).unwrap();
        assert!(!readable(&set), "data alone does not wake a hang-up watch");
        drop(b);
        assert!(readable(&set), "the peer's close does");
    }
}
