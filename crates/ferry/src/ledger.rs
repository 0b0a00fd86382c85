//! A pool's custody ledger: what one process needs to know of the others
//! that share a pool when one of them dies.
//!
//! A channel end records what it lent to a peer process, so that the
//! buffers come back if the peer dies. But the peer may have passed a buffer
//! on to a third process before it died, and then it is not the lender's to
//! take back: two processes would own it. A dead process cannot say what it
//! passed on, so the processes say it as they go, in memory they all map
//! (a memfd beside the pool's, sent with it over the shared-memory setup
//! socket):
//!
//! * `departures[i]` counts the times buffer `i` left a process on a channel
//!   other than the one it arrived on (a buffer going back where it came
//!   from needs no word: the one who lent it takes it back by receiving it).
//!   A lender notes the count when it lends; when the borrower dies it takes
//!   the buffer back only if the count has not moved since.
//! * `copies[i]` counts the copies of buffer `i` that were sent from one
//!   process to another and are not back: the sender counts one up before
//!   it sends; whoever learns the copy's end counts it down (the sender when
//!   the release arrives or the holder dies, the holder when it drops a
//!   copy whose sender died). An owner that takes a buffer back from a dead
//!   process, or whose copy holder died, keeps it read-only while this is
//!   not zero: a copy the dead process made or forwarded may still be read
//!   by a live one, in memory the owner shares with it.
//!
//! Each counter has one writer at a time (the process that holds the buffer
//! or the copy), but the words are shared with processes of any trust, so
//! every value read from them is only compared, never trusted for memory
//! safety: a lying peer can make us keep a buffer it should have given back
//! (which it could do anyway by not giving it back) or take back one that
//! lives on in a third process's own memory (trust NONE: separate memory).

use crate::ErrorKind;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::Result;
use crate::sys::{self, Access, Mapping};

/// The counters of one pool's buffers, in shared memory.
#[derive(Debug)]
pub(crate) struct Ledger {
    fd: OwnedFd,
    map: Mapping,
    count: u32,
}

/// Counters per buffer: departures, copies out.
const WORDS: usize = 2;

fn file_len(count: u32) -> usize {
    let page = sys::page_size();
    (count as usize * WORDS * 4).div_ceil(page) * page
}

impl Ledger {
    /// A fresh ledger (every counter zero) for `count` buffers.
    pub(crate) fn create(count: u32) -> Result<Self> {
        let fd = sys::memfd("ferry-ledger", file_len(count))?;
        sys::seal_size(&fd)?;
        Self::map(fd, count)
    }

    /// A ledger received from a peer: a memfd of the right size, sealed
    /// against resizing (so the mapping can never fault past its end).
    pub(crate) fn from_peer(fd: OwnedFd, count: u32) -> Result<Self> {
        sys::check_sealed_size(&fd, file_len(count))
            .map_err(|why| ErrorKind::Protocol(format!("pool ledger received with a bad fd: {why}")))?;
        Self::map(fd, count)
    }

    fn map(fd: OwnedFd, count: u32) -> Result<Self> {
        let map = Mapping::map_shared(sys::borrow(&fd), file_len(count), Access::ReadWrite, 1)?;
        Ok(Ledger { fd, map, count })
    }

    /// The memfd, to send to another process.
    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    fn word(&self, index: u32, which: usize) -> &AtomicU32 {
        assert!(index < self.count, "buffer index {index} outside the ledger");
        let at = index as usize * WORDS + which;
        // SAFETY: the mapping is `file_len(count)` ≥ `count * WORDS * 4`
        // bytes, page aligned, readable and writable, and lives as long as
        // `self` (the returned reference borrows `self`); `at < count *
        // WORDS`, so the 4-byte word is inside it and 4-byte aligned. Other
        // processes access the same memory, but only through atomic
        // instructions of the same size (this type), so there is no data
        // race; any bit pattern is a valid `u32`.
        unsafe { &*self.map.as_ptr().cast::<AtomicU32>().add(at) }
    }

    /// How many times buffer `index` left a process for another on a
    /// channel other than the one it arrived on.
    pub(crate) fn departures(&self, index: u32) -> u32 {
        // Acquire: a departure counted before the departing message was
        // published is seen by whoever saw that message's effects.
        self.word(index, 0).load(Ordering::Acquire)
    }

    /// Buffer `index` leaves this process for a process other than the one
    /// it came from: count it before the message goes. Returns the new
    /// count.
    pub(crate) fn depart(&self, index: u32) -> u32 {
        self.word(index, 0).fetch_add(1, Ordering::AcqRel).wrapping_add(1)
    }

    /// Copies of buffer `index` sent from one process to another and not
    /// back.
    pub(crate) fn copies(&self, index: u32) -> u32 {
        self.word(index, 1).load(Ordering::Acquire)
    }

    /// A copy of buffer `index` is about to go to another process.
    pub(crate) fn copy_out(&self, index: u32) {
        self.word(index, 1).fetch_add(1, Ordering::AcqRel);
    }

    /// A copy of buffer `index` that went to another process is back, or
    /// void. Never below zero, whatever a peer wrote.
    pub(crate) fn copy_back(&self, index: u32) {
        let _ = self.word(index, 1).fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_shared_through_the_fd() {
        let a = Ledger::create(100).unwrap();
        let fd = rustix::io::dup(a.fd()).unwrap();
        let b = Ledger::from_peer(fd, 100).unwrap();
        assert_eq!(b.departures(99), 0);
        assert_eq!(a.depart(99), 1);
        assert_eq!(a.depart(99), 2);
        assert_eq!(b.departures(99), 2);
        assert_eq!(b.departures(98), 0);
        b.copy_out(7);
        assert_eq!(a.copies(7), 1);
        a.copy_back(7);
        a.copy_back(7);
        assert_eq!(b.copies(7), 0, "never below zero");
    }

    #[test]
    fn a_ledger_of_the_wrong_size_is_refused() {
        let a = Ledger::create(100).unwrap();
        let fd = rustix::io::dup(a.fd()).unwrap();
        assert!(matches!(Ledger::from_peer(fd, 100_000).as_ref().map_err(|e| e.kind()), Err(ErrorKind::Protocol(_))));
        let unsealed = sys::memfd("x", file_len(100)).unwrap();
        assert!(matches!(Ledger::from_peer(unsealed, 100).as_ref().map_err(|e| e.kind()), Err(ErrorKind::Protocol(_))));
    }

    #[test]
    #[should_panic(expected = "outside the ledger")]
    fn an_index_outside_the_pool_is_a_bug() {
        Ledger::create(1).unwrap().departures(1);
    }
}
