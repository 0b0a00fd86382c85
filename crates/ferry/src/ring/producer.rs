//! The writing end of a ring: stages and publishes descriptor slots, and
//! wakes a consumer that declared itself asleep (see the module docs of
//! [`super`] for the layout, the ordering argument and the sleep handshake).

use std::fmt;

use super::sync::{fence, AtomicU32, Ordering};
use super::*;

/// The writing end. `Send`, not `Sync`; `&mut self` makes it single-producer.
pub(crate) struct Producer {
    pub(super) sh: Shared,
    /// Our head: every slot filled so far, published or only staged;
    /// authoritative (the region copy is for the consumer only).
    pub(super) head: u64,
    /// The head last stored to the region, i.e. what the consumer may see;
    /// invariant `cached_tail <= published <= head` (wrapping).
    pub(super) published: u64,
    /// Last tail read from the region; invariant `0 <= head - cached_tail <= cap`.
    pub(super) cached_tail: u64,
    /// The CPU has a write prefetch (x86 `prefetchw`).
    pub(super) prefetch_write: bool,
    /// The private staging copy of the slot being filled: reused, and only
    /// its `slot_size` bytes cleared (a fresh 256-byte array per message
    /// cost a 256-byte clear).
    pub(super) stage: Box<SlotCopy>,
}

// SAFETY: the only non-Send field is the raw `base` pointer into memory that
// `Shared::_mem` (Send + Sync) keeps alive; it is used only for atomic
// accesses, which are valid from any thread. Producer is deliberately not
// Sync (the raw pointer keeps it !Sync): all mutation needs `&mut self`.
unsafe impl Send for Producer {}

impl Producer {
    /// Fill the next slot with `fill` (it gets a zeroed `&mut [u8]` of
    /// `slot_size` bytes, a private staging copy, then copied into the slot;
    /// bit 7 of its first byte is the ring's phase bit and is not carried),
    /// publish it: [`stage`](Self::stage) then [`publish`](Self::publish).
    ///
    /// Returns `Ok(true)` when the consumer had declared itself asleep: the
    /// flag has been cleared (so `futex_wait(word, 1)` will not block) and
    /// the caller must wake it. Only the first push after the consumer fell
    /// asleep returns `true`. Errors: `Full`, `Closed` (either end closed),
    /// `Corrupt` (the tail in the region is inconsistent).
    pub(crate) fn try_push(&mut self, fill: impl FnOnce(&mut [u8])) -> Result<bool, RingError> {
        self.stage(fill)?;
        Ok(self.publish())
    }

    /// Fill the next slot like [`try_push`](Self::try_push) but do not
    /// publish it yet: the consumer sees staged slots only after the next
    /// [`publish`](Self::publish) (or [`close`](Self::close)), which makes a
    /// whole batch visible with one head store and one fence. Same errors as
    /// `try_push`; staged slots count against the capacity.
    ///
    /// Inlined into each link's send (once per message): left to the
    /// partitioning of the build into code units, it is inlined in some
    /// builds and not in others.
    #[inline]
    pub(crate) fn stage(&mut self, fill: impl FnOnce(&mut [u8])) -> Result<(), RingError> {
        // Relaxed: nothing is read on the strength of this flag; it only
        // stops us early. (A hostile consumer may set any bits: we just stop.)
        if self.sh.closed().load(Ordering::Relaxed) & (PRODUCER_CLOSED | CONSUMER_CLOSED) != 0 {
            return Err(RingError::Closed);
        }
        if self.head.wrapping_sub(self.cached_tail) >= self.sh.cap {
            // Looks full with the cached tail: only now touch the
            // consumer's cache line.
            self.refresh_tail()?;
            if self.head.wrapping_sub(self.cached_tail) >= self.sh.cap {
                return Err(RingError::Full);
            }
        }
        let stage = &mut self.stage.0[..self.sh.slot_size];
        stage.fill(0);
        fill(stage);
        // The slot at head is free: head - cached_tail < cap, and the Acquire
        // load that produced cached_tail ordered the consumer's reads of this
        // slot before our writes.
        self.sh.write_slot(self.head, &self.stage.0);
        self.head = self.head.wrapping_add(1);
        // Ask for the lines of a slot a few pushes ahead now, so that the
        // write then finds them in our cache instead of waiting for the
        // consumer's core to give them up (the consumer read them one lap
        // ago). Only slots known free: the consumer is done with them.
        if self.head.wrapping_sub(self.cached_tail) + PREFETCH_WRITE_AHEAD < self.sh.cap {
            self.sh.prefetch_slot(self.head.wrapping_add(PREFETCH_WRITE_AHEAD), self.prefetch_write);
        }
        Ok(())
    }

    /// Make every staged slot visible to the consumer (one Release store of
    /// head), then do the sleep handshake once for the whole batch.
    /// Returns `true` when the consumer had declared itself asleep (see
    /// [`try_push`](Self::try_push): the caller must wake it). Nothing
    /// staged: nothing to do, `false`.
    pub(crate) fn publish(&mut self) -> bool {
        if self.published == self.head {
            return false;
        }
        self.publish_staged();
        // Dekker handshake with prepare_sleep (see module docs): the fence
        // orders the head and phase stores before the flag load in the
        // SeqCst order (the consumer's re-check reads a phase: those stores
        // must not come after the fence; loom catches it if they do).
        fence(Ordering::SeqCst);
        let sleeping = self.sh.sleeping();
        // Plain load first so the common case (consumer awake) does not write
        // the consumer's line. Relaxed is enough: the fence above gives the
        // guarantee, and a Relaxed RMW after a release fence still publishes
        // the head to a consumer that reads the cleared flag with Acquire.
        if sleeping.load(Ordering::Relaxed) != 0 {
            return sleeping.swap(0, Ordering::Relaxed) != 0;
        }
        false
    }

    /// Store head (Release: publishes the slot contents to a consumer that
    /// loads it with Acquire), then the phase of every staged slot (what a
    /// consumer polling its next slot looks at). Head first: a consumer that
    /// found a slot by its phase then reads a head that covers it.
    fn publish_staged(&mut self) {
        let from = self.published;
        self.published = self.head;
        self.sh.head().store(self.head, Ordering::Release);
        let mut counter = from;
        while counter != self.head {
            self.sh.publish_slot(counter);
            counter = counter.wrapping_add(1);
        }
    }

    /// Slots staged and not yet published.
    pub(crate) fn staged(&self) -> u32 {
        // published <= head and head - published <= cap <= 65536.
        self.head.wrapping_sub(self.published) as u32
    }

    /// Re-read the consumer's tail (Acquire: orders its slot reads before our
    /// reuse of the slots) and validate it: it must not move backwards nor
    /// pass our head.
    fn refresh_tail(&mut self) -> Result<(), RingError> {
        let tail = self.sh.tail().load(Ordering::Acquire);
        // The consumer can only have taken what we published.
        if tail.wrapping_sub(self.cached_tail) > self.published.wrapping_sub(self.cached_tail) {
            return Err(RingError::Corrupt("ring tail went backwards or passed head"));
        }
        self.cached_tail = tail;
        Ok(())
    }

    /// Free slots, the tail re-read first (for a caller that needs
    /// several in a row).
    pub(crate) fn free_slots_now(&mut self) -> u32 {
        if self.refresh_tail().is_err() {
            return 0;
        }
        self.free_slots()
    }

    /// Slots in the ring.
    pub(crate) fn capacity(&self) -> u32 {
        self.sh.cap as u32
    }

    /// Free slots according to the cached tail; the tail is re-read only
    /// when the ring looks full. 0 if the region's tail is corrupt.
    pub(crate) fn free_slots(&mut self) -> u32 {
        if self.head.wrapping_sub(self.cached_tail) >= self.sh.cap && self.refresh_tail().is_err() {
            return 0;
        }
        // head - cached_tail <= cap <= 65536 by the invariant.
        (self.sh.cap - self.head.wrapping_sub(self.cached_tail)) as u32
    }

    /// The consumer has taken everything pushed so far (tail == head):
    /// completion is seen by the tail advancing. Acquire, so whatever the
    /// consumer did before advancing tail happens-before our caller's next
    /// step. (The consumer advances tail when it has *copied* a descriptor,
    /// before processing it.)
    pub(crate) fn is_empty(&self) -> bool {
        self.sh.tail().load(Ordering::Acquire) == self.head
    }

    /// Set producer-closed (Release: everything pushed before is visible to
    /// a consumer that sees the flag; staged slots are published first). Also clears the sleeping flag so a
    /// consumer about to `futex_wait(word, 1)` does not block; the caller
    /// should always wake the consumer after closing (close is rare).
    /// Idempotent; also done on drop (which cannot wake anyone).
    pub(crate) fn close(&mut self) {
        // Staged slots go out with the close (Release, before the flag: a
        // consumer that sees the flag sees them).
        if self.published != self.head {
            self.publish_staged();
        }
        self.sh.closed().fetch_or(PRODUCER_CLOSED, Ordering::Release);
        // Same handshake as try_push: a consumer in prepare_sleep either sees
        // the closed bit or we see (and clear) its flag.
        fence(Ordering::SeqCst);
        let sleeping = self.sh.sleeping();
        if sleeping.load(Ordering::Relaxed) != 0 {
            sleeping.swap(0, Ordering::Relaxed);
        }
    }

    /// Room handshake (see the module docs): the ring is full and we want
    /// to sleep until the consumer makes room. Returns `true` if the caller
    /// may sleep (still full: the consumer will wake us when it takes a
    /// slot), `false` if there is room now (the request is withdrawn).
    pub(crate) fn want_room(&mut self) -> bool {
        self.want_room_for(1)
    }

    /// [`want_room`](Producer::want_room) for `slots` free slots in a row
    /// (a run of messages that goes all at once): `true` if the caller may
    /// sleep (fewer are free: the consumer wakes us after its next pop, and
    /// the caller asks again if that is still not enough).
    pub(crate) fn want_room_for(&mut self, slots: u32) -> bool {
        if self.free_slots() >= slots {
            return false;
        }
        self.sh.room().store(1, Ordering::SeqCst);
        // Dekker handshake with the consumer's pop + prepare_sleep.
        fence(Ordering::SeqCst);
        if self.refresh_tail().is_err()
            || self.sh.cap.saturating_sub(self.head.wrapping_sub(self.cached_tail)) >= u64::from(slots)
        {
            self.sh.room().store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// The consumer has closed its end.
    pub(crate) fn peer_closed(&self) -> bool {
        self.sh.closed().load(Ordering::Acquire) & CONSUMER_CLOSED != 0
    }

    /// The consumer's sleeping flag (the futex word to wake after `try_push`
    /// returned `Ok(true)` or after `close`).
    pub(crate) fn sleep_word(&self) -> &AtomicU32 {
        self.sh.sleeping()
    }

    /// The ring's layout.
    pub(crate) fn layout(&self) -> RingLayout {
        self.sh.layout
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.close();
    }
}

impl fmt::Debug for Producer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("ring", &self.sh)
            .field("head", &self.head)
            .field("published", &self.published)
            .field("cached_tail", &self.cached_tail)
            .finish()
    }
}
