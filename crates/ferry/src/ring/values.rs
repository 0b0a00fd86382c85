//! A single-producer/single-consumer ring of typed values, for two ends
//! in one process (the local backend).
//!
//! Between threads of one process the peer is not an untrusted party, so
//! nothing needs encoding into bytes, copying through a private slot copy
//! or decoding with every check: a value is moved into its slot and moved
//! out again. Everything else is the byte ring's protocol (see the module
//! docs of [`super`]), with the same words, orderings and handshakes:
//!
//! * free-running `u64` counters: the producer's head (private, no copy in
//!   shared memory: the consumer never needs it) and the consumer's tail
//!   (stored for the producer, Release, after the value is moved out);
//!   full is `head - tail == capacity`;
//! * a per-slot publication mark the consumer polls instead of a head,
//!   the byte ring's phase bit made a whole word: the slot for counter `c`
//!   is published when its `stamp` is `c + 1` (a zeroed slot reads as
//!   "not yet"; no lap ever reuses a stamp value, so no parity is needed);
//!   the stamp shares the slot's cache line, so a message costs one line
//!   crossing cores;
//! * batches: [`ValueProducer::stage`] moves a value in without publishing,
//!   [`ValueProducer::publish`] stores the stamps of every staged slot
//!   (Release) and does the sleep handshake once for the batch;
//! * the sleep handshake (`consumer_sleeping`, SeqCst fences on both
//!   sides), the room handshake (`room_wanted`, on the tail's line) and the
//!   closed bits, word for word as in the byte ring;
//! * each hot word on 128 bytes of its own, each slot on whole 128-byte
//!   blocks (adjacent-line prefetch).
//!
//! What the byte ring does and this one does not: validate the peer's
//! counters (both ends are this process's code), and keep values out of
//! Rust references (the memory is ours alone). Values still in the ring
//! when both ends are gone (published, not taken) are dropped with it:
//! nothing a value owns leaks.

use std::fmt;
use std::mem::MaybeUninit;

// loom's `Arc` under loom: the last end's drop of the ring then
// happens-after the other end's last access, as std's `Arc` guarantees,
// and the model can check the drop of leftovers against it.
#[cfg(loom)]
use loom::sync::Arc;
#[cfg(not(loom))]
use std::sync::Arc;

use super::sync::{fence, AtomicU32, AtomicU64, Ordering};
use super::{RingError, CONSUMER_CLOSED, PRODUCER_CLOSED};

/// One value's place, on whole 128-byte blocks: the stamp and the value
/// cross cores together, and no neighbour's writes share its lines.
#[repr(C, align(128))]
struct Slot<T> {
    /// `c + 1` once the value for counter `c` is published (Release).
    stamp: AtomicU64,
    value: Cell<MaybeUninit<T>>,
}

/// A hot word on 128 bytes of its own.
#[repr(C, align(128))]
struct Line<T>(T);

/// The consumer's counter and the producer's room request: the consumer
/// looks at the request right after storing the tail, on a line it owns.
struct TailLine {
    tail: AtomicU64,
    room_wanted: AtomicU32,
}

/// What both ends share.
struct Shared<T> {
    tail: Line<TailLine>,
    sleeping: Line<AtomicU32>,
    closed: Line<AtomicU32>,
    slots: Box<[Slot<T>]>,
    cap: u64,
    mask: u64,
}

// SAFETY: the ring moves `T` values from the producer's thread to the
// consumer's, so `T: Send` is needed and enough: each slot's value is
// accessed by one end at a time, handed over by the stamp (producer to
// consumer) and the tail (consumer to producer), Release/Acquire pairs.
unsafe impl<T: Send> Send for Shared<T> {}
// SAFETY: as above; `&Shared` gives no access to a value outside the
// protocol, which the two ends (each `&mut self`) follow.
unsafe impl<T: Send> Sync for Shared<T> {}

impl<T> Shared<T> {
    #[inline]
    fn slot(&self, counter: u64) -> &Slot<T> {
        // Masked: never out of bounds (the compiler drops the check).
        &self.slots[(counter & self.mask) as usize]
    }

    /// Whether the slot for `counter` holds its published value. Acquire:
    /// pairs with the producer's Release store of the stamp, so the value's
    /// write happens-before the consumer's read.
    #[inline]
    fn published(&self, counter: u64) -> bool {
        self.slot(counter).stamp.load(Ordering::Acquire) == counter.wrapping_add(1)
    }
}

impl<T> Drop for Shared<T> {
    /// Both ends are gone (the last `Arc`'s drop synchronizes with theirs):
    /// the values published and not taken are dropped. The producer's
    /// close, run by its drop, published whatever was staged.
    fn drop(&mut self) {
        let mut counter = self.tail.0.tail.load(Ordering::Acquire);
        // Stamps are unique per counter, so the walk stops within a lap.
        while self.published(counter) {
            // SAFETY: the slot's stamp says the value for `counter` was
            // written and published; the consumer's tail has not passed it,
            // so it was never moved out. No end is left to touch it.
            self.slot(counter).value.with_mut(|value| unsafe { (*value).assume_init_drop() });
            counter = counter.wrapping_add(1);
        }
    }
}

/// A ring of `capacity` values (a power of two, as the byte ring's; the
/// caller has validated it with [`super::RingLayout`]) and its two ends.
pub(crate) fn value_pair<T>(capacity: u32) -> (ValueProducer<T>, ValueConsumer<T>) {
    debug_assert!(capacity.is_power_of_two());
    let shared = Arc::new(Shared {
        tail: Line(TailLine { tail: AtomicU64::new(0), room_wanted: AtomicU32::new(0) }),
        sleeping: Line(AtomicU32::new(0)),
        closed: Line(AtomicU32::new(0)),
        slots: (0..capacity)
            .map(|_| Slot { stamp: AtomicU64::new(0), value: Cell::new(MaybeUninit::uninit()) })
            .collect(),
        cap: u64::from(capacity),
        mask: u64::from(capacity - 1),
    });
    let producer = ValueProducer { sh: Arc::clone(&shared), head: 0, published: 0, cached_tail: 0 };
    (producer, ValueConsumer { sh: shared, tail: 0 })
}

/// The writing end. `&mut self` makes it single-producer.
pub(crate) struct ValueProducer<T> {
    sh: Arc<Shared<T>>,
    /// Every slot filled so far, published or only staged.
    head: u64,
    /// The slots up to here carry their stamps; `cached_tail <= published <= head`.
    published: u64,
    /// Last tail read; `0 <= head - cached_tail <= cap`.
    cached_tail: u64,
}

impl<T> ValueProducer<T> {
    /// Move the value `make` returns into the next slot without publishing
    /// it (`make` runs only if there is room and neither end closed).
    /// Staged slots count against the capacity. Errors: `Full`, `Closed`.
    #[inline]
    pub(crate) fn stage(&mut self, make: impl FnOnce() -> T) -> Result<(), RingError> {
        // Relaxed: it only stops us early, as in the byte ring.
        if self.sh.closed.0.load(Ordering::Relaxed) & (PRODUCER_CLOSED | CONSUMER_CLOSED) != 0 {
            return Err(RingError::Closed);
        }
        if self.head.wrapping_sub(self.cached_tail) >= self.sh.cap {
            // Looks full with the cached tail: only now touch the
            // consumer's line.
            self.refresh_tail();
            if self.head.wrapping_sub(self.cached_tail) >= self.sh.cap {
                return Err(RingError::Full);
            }
        }
        let value = make();
        // SAFETY: head - cached_tail < cap, so the consumer has moved out
        // the value this slot held a lap ago (or it never held one), and
        // the Acquire load that produced cached_tail ordered that read
        // before this write; the consumer does not look at the value again
        // until the stamp says `head + 1`, stored after this write
        // (Release). So nothing else accesses the value meanwhile.
        self.sh.slot(self.head).value.with_mut(|slot| unsafe { (*slot).write(value) });
        self.head = self.head.wrapping_add(1);
        Ok(())
    }

    /// Make every staged value visible (its stamp, Release), then the
    /// sleep handshake once for the batch: `true` when the consumer had
    /// declared itself asleep (the flag is cleared; the caller must wake
    /// it). Nothing staged: `false`.
    #[inline]
    pub(crate) fn publish(&mut self) -> bool {
        if self.published == self.head {
            return false;
        }
        self.publish_staged();
        // The byte ring's Dekker handshake with `prepare_sleep`: the fence
        // orders the stamp stores before the flag load in the SeqCst order,
        // so either the consumer's re-check after its fence sees a stamp,
        // or this load sees its flag (loom: `values_sleep_handshake`).
        fence(Ordering::SeqCst);
        let sleeping = &self.sh.sleeping.0;
        // A plain load first: an awake consumer's line is not written.
        if sleeping.load(Ordering::Relaxed) != 0 {
            return sleeping.swap(0, Ordering::Relaxed) != 0;
        }
        false
    }

    /// Store the stamp of every staged slot (Release: the value written
    /// before happens-before a consumer's read that finds the stamp).
    #[inline]
    fn publish_staged(&mut self) {
        let mut counter = self.published;
        while counter != self.head {
            self.sh.slot(counter).stamp.store(counter.wrapping_add(1), Ordering::Release);
            counter = counter.wrapping_add(1);
        }
        self.published = self.head;
    }

    /// Values staged and not yet published.
    #[inline]
    pub(crate) fn staged(&self) -> u32 {
        // published <= head and head - published <= cap <= 65536.
        self.head.wrapping_sub(self.published) as u32
    }

    /// Re-read the consumer's tail. Acquire: its moves out of the slots
    /// happen-before our reuse of them.
    fn refresh_tail(&mut self) {
        let tail = self.sh.tail.0.tail.load(Ordering::Acquire);
        debug_assert!(tail.wrapping_sub(self.cached_tail) <= self.published.wrapping_sub(self.cached_tail));
        self.cached_tail = tail;
    }

    /// Free slots according to the cached tail; the tail is re-read only
    /// when the ring looks full.
    pub(crate) fn free_slots(&mut self) -> u32 {
        if self.head.wrapping_sub(self.cached_tail) >= self.sh.cap {
            self.refresh_tail();
        }
        // head - cached_tail <= cap <= 65536 by the invariant.
        (self.sh.cap - self.head.wrapping_sub(self.cached_tail)) as u32
    }

    /// Free slots, the tail re-read first.
    pub(crate) fn free_slots_now(&mut self) -> u32 {
        self.refresh_tail();
        self.free_slots()
    }

    /// Slots in the ring.
    pub(crate) fn capacity(&self) -> u32 {
        self.sh.cap as u32
    }

    /// The room handshake of the byte ring: `true` if the caller may sleep
    /// (fewer than `slots` free: the consumer wakes us after its next
    /// pop), `false` if there is room now (the request is withdrawn).
    pub(crate) fn want_room_for(&mut self, slots: u32) -> bool {
        if self.free_slots() >= slots {
            return false;
        }
        self.sh.tail.0.room_wanted.store(1, Ordering::SeqCst);
        // Dekker with the consumer's tail store and `prepare_sleep`'s fence:
        // either we see the tail it stored, or it sees our request.
        fence(Ordering::SeqCst);
        self.refresh_tail();
        if self.sh.cap - self.head.wrapping_sub(self.cached_tail) >= u64::from(slots) {
            self.sh.tail.0.room_wanted.store(0, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Close our end: the staged values are published first, then the
    /// closed bit (Release: a consumer that sees it sees them), and a
    /// sleeping consumer's flag is cleared (the caller wakes it). Idempotent;
    /// also done on drop.
    pub(crate) fn close(&mut self) {
        if self.published != self.head {
            self.publish_staged();
        }
        self.sh.closed.0.fetch_or(PRODUCER_CLOSED, Ordering::Release);
        // The handshake of `publish`, for the closed bit.
        fence(Ordering::SeqCst);
        let sleeping = &self.sh.sleeping.0;
        if sleeping.load(Ordering::Relaxed) != 0 {
            sleeping.swap(0, Ordering::Relaxed);
        }
    }
}

impl<T> Drop for ValueProducer<T> {
    fn drop(&mut self) {
        self.close();
    }
}

impl<T> fmt::Debug for ValueProducer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValueProducer")
            .field("head", &self.head)
            .field("published", &self.published)
            .field("cached_tail", &self.cached_tail)
            .finish()
    }
}

/// The reading end. `&mut self` makes it single-consumer.
pub(crate) struct ValueConsumer<T> {
    sh: Arc<Shared<T>>,
    /// Our tail; the shared copy is for the producer.
    tail: u64,
}

impl<T> ValueConsumer<T> {
    /// Move the next published value out, or `None`.
    #[inline]
    pub(crate) fn try_pop(&mut self) -> Option<T> {
        if !self.sh.published(self.tail) {
            return None;
        }
        // SAFETY: the stamp (Acquire) says the producer wrote this value
        // and released it to us; it does not touch the slot again until
        // our tail store below says it may (its Acquire load of the tail),
        // and we move the value out exactly once: the tail passes it.
        let value = self.sh.slot(self.tail).value.with(|slot| unsafe { (*slot).assume_init_read() });
        self.tail = self.tail.wrapping_add(1);
        // Release: our move out happens-before the producer's reuse.
        self.sh.tail.0.tail.store(self.tail, Ordering::Release);
        Some(value)
    }

    /// Whether `try_pop` would find a value now.
    pub(crate) fn has_work(&self) -> bool {
        self.sh.published(self.tail)
    }

    /// The sleep handshake of the byte ring: declare asleep, then look
    /// again. `true` if the caller may block (still empty, the producer
    /// not closed): block until the doorbell rings, then `cancel_sleep`.
    pub(crate) fn prepare_sleep(&mut self) -> bool {
        self.sh.sleeping.0.store(1, Ordering::SeqCst);
        // Dekker with `publish`/`close`: after this fence either we see the
        // next stamp (or the closed bit), or the producer sees our flag.
        fence(Ordering::SeqCst);
        let closed = self.sh.closed.0.load(Ordering::Acquire) & PRODUCER_CLOSED != 0;
        if closed || self.sh.published(self.tail) {
            self.cancel_sleep();
            return false;
        }
        true
    }

    /// Clear the sleeping flag (we are awake and look ourselves).
    pub(crate) fn cancel_sleep(&mut self) {
        self.sh.sleeping.0.store(0, Ordering::Relaxed);
    }

    /// Whether the producer asked to be woken when a slot is free (the
    /// request is taken: the caller must wake it). Look after every pop,
    /// and after `prepare_sleep`, whose fence makes the look certain.
    #[inline]
    pub(crate) fn take_room_request(&mut self) -> bool {
        let room = &self.sh.tail.0.room_wanted;
        room.load(Ordering::Relaxed) != 0 && room.swap(0, Ordering::Relaxed) != 0
    }

    /// Spin for at most `spin` until there is work or the producer closed;
    /// `true` if there is (see [`super::spin_until`]).
    pub(crate) fn spin_for_work(&mut self, spin: std::time::Duration) -> bool {
        super::spin_until(spin, || self.has_work() || self.peer_closed())
    }

    /// Close our end: the producer's `stage` fails with `Closed`.
    pub(crate) fn close(&mut self) {
        self.sh.closed.0.fetch_or(CONSUMER_CLOSED, Ordering::Release);
    }

    /// The producer has closed. Acquire: values published before the close
    /// are found by the next `try_pop`, so look at this before the last drain.
    pub(crate) fn peer_closed(&self) -> bool {
        self.sh.closed.0.load(Ordering::Acquire) & PRODUCER_CLOSED != 0
    }
}

impl<T> Drop for ValueConsumer<T> {
    fn drop(&mut self) {
        self.close();
    }
}

impl<T> fmt::Debug for ValueConsumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ValueConsumer").field("tail", &self.tail).finish()
    }
}

/// The flags the loom models wait on, as a futex or doorbell wait would.
#[cfg(all(test, loom))]
impl<T> ValueConsumer<T> {
    pub(super) fn sleeping_word(&self) -> &AtomicU32 {
        &self.sh.sleeping.0
    }
}

#[cfg(all(test, loom))]
impl<T> ValueProducer<T> {
    pub(super) fn room_word(&self) -> &AtomicU32 {
        &self.sh.tail.0.room_wanted
    }
}

/// A value cell: loom's (which checks that the two ends' accesses never
/// race) under loom, a plain `UnsafeCell` otherwise.
#[cfg(loom)]
use loom::cell::UnsafeCell as Cell;

#[cfg(not(loom))]
struct Cell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> Cell<T> {
    fn new(value: T) -> Self {
        Self(std::cell::UnsafeCell::new(value))
    }
    #[inline]
    fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }
    #[inline]
    fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts its drops: a value the ring loses or drops twice shows.
    struct Counted(Arc<AtomicUsize>, u32);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A message and its stamp cross cores as one 128-byte block.
    #[test]
    fn a_message_slot_is_one_block() {
        assert_eq!(std::mem::size_of::<Slot<crate::proto::Message>>(), 128);
    }

    #[test]
    fn fifo_full_and_wrap_around() {
        let (mut p, mut c) = value_pair::<u32>(4);
        for lap in 0..3u32 {
            for i in 0..4 {
                p.stage(|| lap * 10 + i).unwrap();
            }
            assert_eq!(p.stage(|| panic!("made without room")), Err(RingError::Full));
            assert_eq!(p.free_slots(), 0);
            // Staged, not published: the consumer sees nothing yet.
            assert_eq!(c.try_pop(), None);
            assert!(!p.publish());
            assert_eq!(p.staged(), 0);
            for i in 0..4 {
                assert_eq!(c.try_pop(), Some(lap * 10 + i));
            }
            assert_eq!(c.try_pop(), None);
            assert_eq!(p.free_slots_now(), 4);
        }
    }

    #[test]
    fn values_left_in_the_ring_are_dropped_once() {
        let drops = Arc::new(AtomicUsize::new(0));
        let (mut p, mut c) = value_pair::<Counted>(4);
        for i in 0..3 {
            p.stage(|| Counted(drops.clone(), i)).unwrap();
        }
        p.publish();
        // One published and staged after the last publish: the close
        // publishes it.
        p.stage(|| Counted(drops.clone(), 3)).unwrap();
        let first = c.try_pop().unwrap();
        assert_eq!(first.1, 0);
        drop(first);
        assert_eq!(drops.load(std::sync::atomic::Ordering::Relaxed), 1);
        drop(p);
        assert!(c.peer_closed());
        drop(c);
        assert_eq!(drops.load(std::sync::atomic::Ordering::Relaxed), 4);
    }

    #[test]
    fn closed_either_way_stops_the_producer() {
        let (mut p, mut c) = value_pair::<u8>(2);
        c.close();
        assert_eq!(p.stage(|| 1), Err(RingError::Closed));
        let (mut p, mut c) = value_pair::<u8>(2);
        p.stage(|| 7).unwrap();
        p.close();
        assert_eq!(p.stage(|| 8), Err(RingError::Closed));
        // Closed after a staged value: the value is there for the drain.
        assert!(c.peer_closed());
        assert_eq!(c.try_pop(), Some(7));
        assert!(!c.prepare_sleep(), "a closed producer never lets the consumer sleep");
    }

    #[test]
    fn sleeping_consumer_is_woken_once_per_sleep() {
        let (mut p, mut c) = value_pair::<u8>(2);
        assert!(c.prepare_sleep());
        p.stage(|| 1).unwrap();
        assert!(p.publish(), "the first publish after the consumer slept wakes it");
        p.stage(|| 2).unwrap();
        assert!(!p.publish(), "the wake-up was asked for already");
        c.cancel_sleep();
        assert!(!c.prepare_sleep(), "work is there");
        assert_eq!(c.try_pop(), Some(1));
    }

    #[test]
    fn room_request_is_taken_by_the_next_pop() {
        let (mut p, mut c) = value_pair::<u8>(2);
        p.stage(|| 1).unwrap();
        p.stage(|| 2).unwrap();
        p.publish();
        assert!(p.want_room_for(2), "full: the producer may sleep");
        assert_eq!(c.try_pop(), Some(1));
        assert!(c.take_room_request());
        assert!(!c.take_room_request(), "taken once");
        assert!(p.want_room_for(2), "one free, two wanted");
        assert!(!p.want_room_for(1));
    }

    #[test]
    fn values_cross_threads_in_order() {
        let (mut p, mut c) = value_pair::<Box<u64>>(8);
        let n = 10_000u64;
        let producer = std::thread::spawn(move || {
            for i in 0..n {
                loop {
                    match p.stage(|| Box::new(i)) {
                        Ok(()) => break,
                        Err(RingError::Full) => {
                            p.publish();
                            std::thread::yield_now();
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                if p.staged() >= 3 {
                    p.publish();
                }
            }
        });
        let mut next = 0;
        while next < n {
            match c.try_pop() {
                Some(v) => {
                    assert_eq!(*v, next);
                    next += 1;
                }
                None => std::thread::yield_now(),
            }
        }
        producer.join().unwrap();
        assert!(c.peer_closed());
        assert_eq!(c.try_pop(), None);
    }
}
