//! The connections an [`NbdServer`](crate::NbdServer) serves, as its
//! accepting thread sees them: which are still in their handshake, since
//! when, and a way to close one from outside its own thread (shutting its
//! socket down wakes the thread wherever it waits on the client).
//!
//! A connection's thread takes its entry out before it closes its socket,
//! so the accepting thread only ever shuts down sockets that are open.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The live connections of one server.
#[derive(Default)]
pub(crate) struct Conns {
    table: Mutex<Table>,
    /// Told each time a connection has ended and closed its socket.
    ended: Condvar,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    /// By id: the order they were accepted in, oldest first.
    live: BTreeMap<u64, Live>,
    /// Connections that have ended so far.
    ends: u64,
}

struct Live {
    /// The connection's socket: open while the entry is here.
    fd: RawFd,
    peer: String,
    since: Instant,
    handshaking: bool,
    /// Why the server closed it, once it has.
    closed: Option<String>,
}

impl Conns {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection just accepted on socket `fd` (open until its thread
    /// calls [`Conns::remove`]): its id.
    pub(crate) fn add(&self, fd: RawFd, peer: &str) -> u64 {
        let mut t = self.lock();
        t.next_id += 1;
        let id = t.next_id;
        t.live.insert(id, Live { fd, peer: peer.to_string(), since: Instant::now(), handshaking: true, closed: None });
        id
    }

    /// Connections the server has not closed.
    pub(crate) fn active(&self) -> usize {
        self.lock().live.values().filter(|c| c.closed.is_none()).count()
    }

    /// Close the oldest connection still in its handshake, saying `why`:
    /// its peer, or `None` if every connection is past its handshake.
    pub(crate) fn shed_oldest_handshaking(&self, why: &str) -> Option<String> {
        let mut t = self.lock();
        let c = t.live.values_mut().find(|c| c.handshaking && c.closed.is_none())?;
        close(c, why);
        Some(c.peer.clone())
    }

    /// Close the connections whose handshake has lasted `timeout`; when
    /// the next of the others reaches it.
    pub(crate) fn expire(&self, timeout: Duration) -> Option<Instant> {
        let now = Instant::now();
        let mut t = self.lock();
        let mut next: Option<Instant> = None;
        for c in t.live.values_mut().filter(|c| c.handshaking && c.closed.is_none()) {
            let deadline = c.since + timeout;
            if deadline <= now {
                close(c, &format!("no handshake within {:.1} s", timeout.as_secs_f64()));
            } else {
                next = Some(next.map_or(deadline, |n| n.min(deadline)));
            }
        }
        next
    }

    /// Connection `id` has finished its handshake: false if the server
    /// closed it meanwhile.
    pub(crate) fn enter_transmission(&self, id: u64) -> bool {
        let mut t = self.lock();
        match t.live.get_mut(&id) {
            Some(c) if c.closed.is_none() => {
                c.handshaking = false;
                true
            }
            _ => false,
        }
    }

    /// Connection `id` is about to close its socket: why the server
    /// closed it, if it did.
    pub(crate) fn remove(&self, id: u64) -> Option<String> {
        self.lock().live.remove(&id).and_then(|c| c.closed)
    }

    /// A connection taken out with [`Conns::remove`] has closed its socket.
    pub(crate) fn closed_one(&self) {
        self.lock().ends += 1;
        self.ended.notify_all();
    }

    /// Connections that have ended so far.
    pub(crate) fn ends(&self) -> u64 {
        self.lock().ends
    }

    /// Wait until more than `seen` connections have ended, or `timeout`.
    pub(crate) fn wait_for_end(&self, seen: u64, timeout: Duration) {
        let t = self.lock();
        let _ = self.ended.wait_timeout_while(t, timeout, |t| t.ends <= seen);
    }
}

/// Shut the connection's socket down: its thread wakes, finds the
/// connection ended, and ends it.
fn close(c: &mut Live, why: &str) {
    // SAFETY: the entry's socket stays open until its thread has taken
    // the entry out of the table, which it cannot do while the caller
    // holds the table's lock.
    let fd = unsafe { BorrowedFd::borrow_raw(c.fd) };
    let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
    c.closed = Some(why.to_string());
}

/// Lines about the server itself (not one client): at most one a kind
/// every [`NOTICE_EVERY`], with a count of those held back.
pub(crate) struct Notices {
    say: Arc<dyn Fn(&str) + Send + Sync>,
    last: HashMap<&'static str, (Instant, u64)>,
}

/// How often a kind of notice is given at most.
const NOTICE_EVERY: Duration = Duration::from_secs(10);

impl Notices {
    pub(crate) fn new(say: Arc<dyn Fn(&str) + Send + Sync>) -> Self {
        Notices { say, last: HashMap::new() }
    }

    /// Give `line` unless a notice of `kind` went out within
    /// [`NOTICE_EVERY`] (then it is counted, and said with the next).
    pub(crate) fn notice(&mut self, kind: &'static str, line: impl FnOnce() -> String) {
        let now = Instant::now();
        match self.last.get_mut(kind) {
            Some((at, held)) if now.duration_since(*at) < NOTICE_EVERY => *held += 1,
            Some((at, held)) => {
                let n = std::mem::take(held);
                *at = now;
                let line = line();
                if n == 0 {
                    (self.say)(&line);
                } else {
                    (self.say)(&format!("{line} ({n} more like it in the last {} s)", NOTICE_EVERY.as_secs()));
                }
            }
            None => {
                self.last.insert(kind, (now, 0));
                (self.say)(&line());
            }
        }
    }
}
