//! The reading end of a ring: copies descriptor slots out, validates what
//! a possibly hostile producer published, and declares itself asleep (see
//! the module docs of [`super`]).

use std::fmt;

use super::sync::{fence, AtomicU32, Ordering};
use super::*;

/// The reading end. `Send`, not `Sync`; `&mut self` makes it single-consumer.
pub(crate) struct Consumer {
    pub(super) sh: Shared,
    /// Our tail; authoritative (the region copy is for the producer only).
    pub(super) tail: u64,
    /// Last head read from the region, or `tail + 1` after a slot found
    /// published by its phase; invariant `0 <= cached_head - tail <= cap`.
    pub(super) cached_head: u64,
    /// The last `try_pop` found a slot by its phase: a run of messages may
    /// be under way, whose extent the head tells (for the read prefetch).
    pub(super) in_run: bool,
    /// The private copy of the slot being read: reused, since `read_slot`
    /// overwrites the `slot_size` bytes handed out (a fresh zeroed array per
    /// pop cost a 256-byte clear).
    pub(super) copy: Box<SlotCopy>,
}

// SAFETY: as for Producer: the raw pointer is only used for atomic accesses
// to memory kept alive by a Send + Sync Arc. Not Sync.
unsafe impl Send for Consumer {}

impl Consumer {
    /// Copy the next slot out into a private stack buffer (so a hostile
    /// producer cannot change it while we decode), advance tail, and hand
    /// the copy to `read`.
    ///
    /// `Ok(None)` if empty. `Err(Corrupt)` if head, when read, is
    /// inconsistent (more than capacity ahead of tail, behind tail, or moved
    /// backwards); the ring is left unchanged.
    ///
    /// Inlined into each link's receive, as `Producer::stage` into its
    /// send: once per message and once per empty poll.
    #[inline]
    pub(crate) fn try_pop<R>(&mut self, read: impl FnOnce(&[u8]) -> R) -> Result<Option<R>, RingError> {
        if self.cached_head == self.tail {
            // Looks empty with the cached head: look at the phase of the
            // next slot, whose line we must fetch anyway (the head's line
            // stays with the producer; see "Phase bit").
            if !self.sh.slot_published(self.tail) {
                self.in_run = false;
                return Ok(None);
            }
            if self.in_run {
                // Two in a row: a batch, probably. Its extent (one look at
                // the head's line per batch) lets the prefetch run ahead.
                // The head store came before the phase store we saw
                // (Acquire), so an honest head covers this slot.
                self.refresh_head()?;
                if self.cached_head == self.tail {
                    return Err(RingError::Corrupt("ring head is behind a published slot"));
                }
            } else {
                self.cached_head = self.tail.wrapping_add(1);
            }
            self.in_run = true;
        }
        // Visible: the Acquire load that produced cached_head > tail (of the
        // head or of this slot's phase) synchronized with the producer's
        // Release store after its writes.
        self.sh.read_slot(self.tail, &mut self.copy.0);
        self.tail = self.tail.wrapping_add(1);
        // Ask for a published slot a few pops ahead, so its lines are on
        // their way from the producer's core by the time we read it.
        if self.cached_head.wrapping_sub(self.tail) > PREFETCH_READ_AHEAD {
            self.sh.prefetch_slot(self.tail.wrapping_add(PREFETCH_READ_AHEAD), false);
        }
        // Release: our reads of the slot happen-before the producer's reuse
        // of it (it loads tail with Acquire).
        self.sh.tail().store(self.tail, Ordering::Release);
        Ok(Some(read(&self.copy.0[..self.sh.slot_size])))
    }

    /// Re-read head (Acquire: see try_pop) and validate it: within
    /// `0..=capacity` ahead of our tail, and not behind the last value seen.
    fn refresh_head(&mut self) -> Result<(), RingError> {
        let head = self.sh.head().load(Ordering::Acquire);
        let avail = counter_distance(head, self.tail, self.sh.cap)?;
        if avail < self.cached_head.wrapping_sub(self.tail) {
            return Err(RingError::Corrupt("ring head went backwards"));
        }
        self.cached_head = head;
        Ok(())
    }

    /// Number of items ready (always re-reads head).
    pub(crate) fn len(&mut self) -> Result<u32, RingError> {
        self.refresh_head()?;
        // <= cap <= 65536 by the invariant.
        Ok(self.cached_head.wrapping_sub(self.tail) as u32)
    }

    /// Spin for at most `spin` until there is work or the producer closed;
    /// `true` if there is (see [`super::spin_until`]).
    pub(crate) fn spin_for_work(&mut self, spin: std::time::Duration) -> bool {
        super::spin_until(spin, || self.has_work() || self.peer_closed())
    }

    /// Sleep protocol: declare asleep (SeqCst), then re-check for work.
    /// Returns true if the caller may block (still empty, producer not
    /// closed), false if work arrived or the producer closed (the flag is
    /// cleared again). After a true return, block with
    /// `futex_wait(sleep_word(), 1)` (or park) and call `cancel_sleep` when
    /// woken.
    pub(crate) fn prepare_sleep(&mut self) -> bool {
        if self.cached_head != self.tail {
            return false;
        }
        self.sh.sleeping().store(1, Ordering::SeqCst);
        // Dekker handshake with try_push/close (see module docs): after this
        // fence either we see the phase of the producer's next slot (or its
        // closed flag), or the producer sees our flag.
        fence(Ordering::SeqCst);
        let closed = self.sh.closed().load(Ordering::Acquire) & PRODUCER_CLOSED != 0;
        if closed || self.sh.slot_published(self.tail) {
            self.cancel_sleep();
            return false;
        }
        true
    }

    /// Everything this end knows to be published has been taken (the
    /// cached head is reached); no look at the region. After a slot found
    /// by its phase alone the cached head is only a lower bound: more may
    /// be published.
    pub(crate) fn caught_up(&self) -> bool {
        self.cached_head == self.tail
    }

    /// Whether `try_pop` would find a slot now (by the cached head or by
    /// the next slot's phase).
    fn has_work(&self) -> bool {
        self.cached_head != self.tail || self.sh.slot_published(self.tail)
    }

    /// Room handshake (see the module docs): whether the producer asked to
    /// be woken when a slot is free (the request is taken: the caller must
    /// wake it). Look after every pop, and after `prepare_sleep`, whose
    /// fence makes the look certain.
    #[inline]
    pub(crate) fn take_room_request(&mut self) -> bool {
        let room = self.sh.room();
        room.load(Ordering::Relaxed) != 0 && room.swap(0, Ordering::Relaxed) != 0
    }

    /// Clear the sleeping flag after waking. Relaxed: clearing only makes the
    /// producer skip wake-ups, and we are awake and about to re-check head
    /// ourselves.
    pub(crate) fn cancel_sleep(&mut self) {
        self.sh.sleeping().store(0, Ordering::Relaxed);
    }

    /// The `consumer_sleeping` word, for a futex wait (value 1 = asleep).
    pub(crate) fn sleep_word(&self) -> &AtomicU32 {
        self.sh.sleeping()
    }

    /// Set consumer-closed: the producer's `try_push` fails with `Closed`.
    /// Idempotent; also done on drop.
    pub(crate) fn close(&mut self) {
        self.sh.closed().fetch_or(CONSUMER_CLOSED, Ordering::Release);
    }

    /// The producer has closed its end. Acquire: items pushed before the
    /// close are visible to the next `try_pop`, so check this *before* the
    /// final drain.
    pub(crate) fn peer_closed(&self) -> bool {
        self.sh.closed().load(Ordering::Acquire) & PRODUCER_CLOSED != 0
    }

    /// The ring's layout.
    pub(crate) fn layout(&self) -> RingLayout {
        self.sh.layout
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.close();
    }
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("ring", &self.sh)
            .field("tail", &self.tail)
            .field("cached_head", &self.cached_head)
            .finish()
    }
}
