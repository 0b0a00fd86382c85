//! Single-producer / single-consumer ring of fixed-size descriptor slots in a
//! raw memory region.
//!
//! It serves two processes sharing a memfd mapping (the shared-memory
//! backend), where the peer may be hostile and may write anything into the
//! region at any time; a region on the heap ([`HeapRegion`]) serves the
//! tests and the fuzz targets. Between threads of one process the local
//! backend uses [`values`], a ring of typed values with the same protocol
//! and no encoding.
//!
//! # Discipline (OSIRIS host interface, \[OSIRIS\] §2.1)
//!
//! A one-reader-one-writer FIFO of descriptors with a head and a tail: the
//! producer alone writes `head`, the consumer alone writes `tail`, each on its
//! own cache line. The queue state is found by comparing the two. Unlike
//! OSIRIS, head and tail are free-running `u64` counters (index =
//! `counter & (capacity - 1)`), so a full ring holds all `capacity` slots:
//!
//! * `head == tail`            : empty
//! * `head - tail == capacity` : full
//! * `head - tail > capacity`  : corrupt (a hostile or broken peer)
//!
//! Completion is seen by the tail advancing ([`Producer::is_empty`],
//! [`Producer::free_slots`]), not by a notification. A wake-up is needed only
//! when the consumer has declared itself asleep (`consumer_sleeping`), the
//! analogue of OSIRIS interrupting the host only on the empty -> non-empty
//! transition.
//!
//! # Batches
//!
//! [`Producer::stage`] fills the next slot without publishing it;
//! [`Producer::publish`] makes every staged slot visible with one head store
//! and does the sleep handshake (one fence, at most one wake-up) once for the
//! whole batch. [`Producer::try_push`] is `stage` + `publish`. Staged slots
//! count against the capacity; `close` publishes them before the flag.
//!
//! # Layout of the region
//!
//! All offsets are from the start of the region, which must be 128-byte
//! aligned. Every field is a naturally aligned native-endian integer (both ends run on the same machine)
//! and is only ever accessed atomically (see "Hostile peers" below).
//!
//! | offset | size | field                | written by            |
//! |-------:|-----:|----------------------|-----------------------|
//! |      0 |    4 | magic `0x4752_5246` ("FRRG" as LE bytes) | creator, at init |
//! |      4 |    4 | version (`2`)        | creator, at init      |
//! |      8 |    4 | capacity (slots)     | creator, at init      |
//! |     12 |    4 | slot_size (bytes)    | creator, at init      |
//! |     16 |  112 | reserved, zero       | creator, at init      |
//! |    128 |    8 | `head: AtomicU64`    | producer only         |
//! |    136 |  120 | padding              |                       |
//! |    256 |    8 | `tail: AtomicU64`    | consumer only         |
//! |    264 |    4 | `room_wanted: AtomicU32` | producer sets, consumer clears |
//! |    268 |  116 | padding              |                       |
//! |    384 |    4 | `consumer_sleeping: AtomicU32` (futex word) | consumer sets, producer clears |
//! |    388 |  124 | padding              |                       |
//! |    512 |    4 | `closed: AtomicU32` (bit 0 producer closed, bit 1 consumer closed) | each side its bit |
//! |    516 |  124 | padding              |                       |
//! |    640 | capacity * slot_size | slots (bit 7 of each slot's first byte: its phase, see below) | producer only |
//!
//! `region_size = 640 + capacity * slot_size`. Each hot word has 128 bytes to
//! itself (two 64-byte lines, so adjacent-line prefetch does not pull the
//! peer's counter in with ours). capacity is a power of two in `2..=65536`,
//! slot_size a power of two in `64..=256`, so the slot array is 128-byte
//! aligned and every slot is a whole number of 64-byte lines.
//! `crossbeam_utils::CachePadded` is not used: its size is target-dependent
//! (64 or 128 bytes) and a cross-process layout needs fixed offsets.
//!
//! # Phase bit (the consumer polls the slot, not the head)
//!
//! Bit 7 of every slot's first byte is the ring's, not the caller's (the
//! fill closure's value there is replaced, and the copy handed to the
//! reader has it clear): it says which lap of the ring last published the
//! slot, like the phase tag of an NVMe completion queue. The slot for
//! counter `c` is published when the bit equals `phase(c)`, set on even
//! laps (`c & capacity == 0`) and clear on odd ones; a zeroed slot thus
//! reads as published by lap -1, i.e. not yet.
//!
//! The consumer that has nothing cached looks at the phase of the slot at
//! its tail instead of at `head`: the slot's line is the one it has to
//! fetch anyway, so a message costs one cache line crossing cores instead
//! of two (the head's and the slot's), and the head's line stays with the
//! producer. `head` is still stored on every publish (before the phase
//! bits) and read at the start of a run of several messages (for the read
//! prefetch), by [`Consumer::len`] and on attach.
//!
//! A staged slot is written whole, its first word with the *previous* lap's
//! phase (still unpublished); `publish` then stores `head` and re-stores
//! the first word of each staged slot with the current phase.
//!
//! # Cached counters (why it is fast)
//!
//! Each side keeps its own counter in a private field (the copy in the region
//! is only for the peer) and a cached copy of the peer's counter. The producer
//! re-reads `tail` only when the ring looks full according to its cached
//! tail; the consumer, when the ring looks empty according to its cached
//! head, looks at the next slot's phase bit (see above) and re-reads `head`
//! only at the second message of a run. In steady state a push or pop
//! therefore touches the slot, its own counter line and nothing else of the
//! peer's, so the two counter lines are not bounced between cores on every
//! operation.
//!
//! What a push or pop still moves between cores is the slot itself: the
//! producer writes lines the consumer read one lap ago, the consumer reads
//! lines the producer just wrote. Both sides prefetch a few slots ahead
//! (for writing: only slots the cached tail shows free; for reading: only
//! slots the cached head shows published), so those transfers overlap with
//! the work on earlier slots instead of stalling the next locked
//! instruction. A prefetch is a hint without memory semantics: nothing in
//! the hostile-peer argument below depends on it.
//!
//! # Memory ordering
//!
//! Written down crossbeam-style: every ordering below is the weakest that
//! makes the argument go through, except the SeqCst on the consumer's flag
//! store, which the fence after it makes redundant (kept as belt and braces;
//! the loom mutation runs confirm that every other one is needed).
//!
//! * **Publishing a slot.** The producer writes the slot words (Relaxed) of
//!   one or more staged slots, then `head.store(h + n, Release)`, then the
//!   first word of each of the `n` slots with its phase (Release). The
//!   consumer either loads `head` with `Acquire`: if it reads `h + n` (or
//!   later) the Release/Acquire pair makes the writes of all `n` slots
//!   happen-before its slot reads (their phase bits may still be old: the
//!   reader masks the bit, and the rest of the first word was written at
//!   staging); or it loads the first word of the slot at its tail with
//!   `Acquire` and finds the phase of this lap: that pair makes the writes
//!   of this slot, and the head store before it, happen-before its reads.
//!   So a consumer that went past a slot by its phase never reads a head
//!   behind it afterwards (the head check stays sound).
//! * **Releasing a slot.** The consumer copies the slot out (Relaxed word
//!   loads), then `tail.store(t + 1, Release)`. The producer loads `tail` with
//!   `Acquire` before reusing the slot, so the consumer's reads happen-before
//!   the producer's overwrite (no write-after-read race; loom checks this with
//!   an `UnsafeCell` per slot). The same Acquire in [`Producer::is_empty`]
//!   makes "the tail advanced" a happens-before edge from the consumer's taking
//!   of the descriptor.
//! * **Own counter.** Each side never reads its own counter back from the
//!   region (except once in `attach_*`), so a peer that scribbles over it
//!   cannot confuse us; it can only confuse itself.
//! * **Closed flags.** `fetch_or(bit, Release)`, read with `Acquire` by
//!   `peer_closed`. A producer pushes, then closes: a consumer that sees the
//!   closed bit therefore also sees every pushed item on its next `try_pop`.
//!   So the end-of-stream test is `if c.peer_closed() { drain with try_pop;
//!   done }` — check the flag *before* the final drain.
//! * **Sleep handshake (no lost wake-ups).** This is the store-buffering
//!   (Dekker) pattern and needs SeqCst fences on both sides:
//!
//!   ```text
//!   producer (publish)                   consumer (prepare_sleep)
//!   P1 head.store(h+n, Release),         C1 sleeping.store(1, SeqCst)
//!      then the n phase words (Release)
//!   P2 fence(SeqCst)                     C2 fence(SeqCst)
//!   P3 sleeping.load -> swap(0)          C3 phase of slot[tail] (Acquire) (+ closed)
//!   ```
//!
//!   The two fences are totally ordered in the single SeqCst order S.
//!   If P2 precedes C2 in S, then C3 (sequenced after C2) must read the
//!   value stored by P1 (sequenced before P2) or a later one
//!   (C++20 [atomics.order], the rule for two SeqCst fences): the consumer sees the item, `prepare_sleep`
//!   returns false and it does not block. (C3 reads the phase word of the
//!   slot at the consumer's tail, which is the first slot it has not seen
//!   published, so the batch that publishes it stores that word in P1; the
//!   word is stored again only a lap later, after the consumer has taken
//!   the slot.) If C2 precedes P2, then P3 must
//!   read the 1 stored by C1 or a later value of the flag: the producer sees
//!   the consumer asleep and `try_push` returns `Ok(true)`. Both may happen
//!   (a harmless spurious wake), but "consumer blocks" and "producer does not
//!   wake" cannot both happen, so no wake-up is lost. Without the fences
//!   each load could read the stale value (x86's store buffer does exactly
//!   that), which is the classic lost wake-up; a SeqCst *store* alone on one
//!   side is not enough (and loom models SeqCst accesses only as AcqRel but
//!   models SeqCst fences properly, so the fences are what the loom test
//!   checks).
//!
//!   "A later value of the flag" can only be a 0 written by the consumer's
//!   own `cancel_sleep` (it is awake) or by the producer's swap for this same
//!   sleep (that push already asked for the wake). The producer clears the
//!   flag with `swap(0)` when it finds it set, so only the first push after
//!   the consumer fell asleep asks for a wake-up, and so that a consumer
//!   about to `futex_wait(word, 1)` does not block once the wake is
//!   requested: the futex compares the word with 1 inside the kernel, which
//!   closes the window between `prepare_sleep` returning true and the wait.
//!
//! * **Room handshake (a producer waiting for a free slot).** The mirror
//!   image of the sleep handshake, for a producer that found the ring full
//!   and wants to sleep until the consumer makes room
//!   ([`Producer::want_room`]):
//!
//!   ```text
//!   consumer (try_pop, prepare_sleep)    producer (want_room)
//!   C1 tail.store(t+1, Release)          P1 room_wanted.store(1, SeqCst)
//!   C2 fence(SeqCst)  [prepare_sleep]    P2 fence(SeqCst)
//!   C3 room_wanted.load -> swap(0)       P3 tail.load(Acquire)
//!   ```
//!
//!   By the same argument, a producer that sleeps (P3 saw no room) is
//!   asked for by a consumer that reaches C2. The consumer also looks at the
//!   flag after every pop, without the fence (C2 would cost a full barrier
//!   per message): that load sees the flag as soon as the producer's store
//!   is visible, which in practice is at once; the fenced look in
//!   `prepare_sleep` makes it certain before the consumer sleeps. A
//!   consumer that never sleeps keeps popping (the ring is full, so it has
//!   work) and so keeps looking. The word sits on the tail's line, which the
//!   consumer has just written: the unfenced look costs no cache miss.
//!
//! Recommended use (the rest of the crate):
//!
//! ```text
//! // producer                                  // consumer
//! if p.try_push(fill)? { wake(p.sleep_word()) } loop {
//! // or a batch:                                 match c.try_pop(read)? { Some(x) => continue, None => {} }
//! p.stage(fill)?; p.stage(fill)?; ...            if c.peer_closed() { drain with try_pop; break }
//! if p.publish() { wake(p.sleep_word()) }        if c.prepare_sleep() { futex_wait(c.sleep_word(), 1); c.cancel_sleep() }
//! p.close(); wake(p.sleep_word()) // always    }
//! ```
//!
//! # Hostile peers
//!
//! When the region is shared with another process, that process may write
//! anything, at any time, to any byte of it. The rules that keep us sound:
//!
//! * No Rust reference to plain bytes of the region (`&[u8]`, `&mut [u8]`,
//!   `&u64`) is ever created: such a reference asserts that nobody else
//!   writes the memory while it lives, which the peer can violate, making it
//!   UB on our side. The only references into the region are `&AtomicU32` /
//!   `&AtomicU64`, which have interior mutability and explicitly allow
//!   concurrent modification.
//! * Every access to the region is an atomic access, slot contents included:
//!   slots are copied in and out one `u64` word at a time with Relaxed atomic
//!   loads/stores (plain `mov`s on x86-64 and AArch64) between the region and
//!   a private `[u8; MAX_SLOT]` stack buffer. A racing peer write can
//!   therefore only give us a torn *mix of values*, never a data race in the
//!   Rust abstract machine. This is stronger than `ptr::copy_nonoverlapping`,
//!   which would be a non-atomic read racing with the peer's writes
//!   (technically UB even if it compiles to the same loads); the cost is that
//!   the compiler cannot use vector moves for the copy, which for 64..256
//!   byte slots is negligible next to the cache miss on the slot itself.
//! * Decoding happens on the private copy, so the peer cannot change a
//!   descriptor between validation and use (no TOCTOU).
//! * Values read from the region are validated before use: the peer's
//!   counter must move monotonically and stay within `capacity` of ours (the
//!   tail: not beyond the head we published), else [`RingError::Corrupt`]. Slot addresses are computed from *our own*
//!   counter masked with `capacity - 1`, where capacity comes from the
//!   caller's [`RingLayout`], never from the region (the header copy is only
//!   compared with it in `attach_*`). Nothing read from the region is used as
//!   an index or length.
//! * A phase bit is only ever compared: a producer that sets phases at
//!   will makes us take slots it did not publish (garbage descriptors, which
//!   the caller validates like any other) or wait for ones it did; our tail
//!   then runs ahead of its head, which the next head read reports.
//! * A garbage peer can make us return `Corrupt`, `Closed` or `Full`, or
//!   make us ask for needless wake-ups; it cannot cause UB or a panic.
//!
//! # loom
//!
//! Under `--cfg loom` the four protocol atomics live in a separate
//! heap-allocated `LoomState` (loom atomics cannot be placed in raw memory)
//! and each slot is a `loom::cell::UnsafeCell`, so loom checks both the
//! orderings and that slot accesses never race. The model therefore covers
//! the ordering protocol, not the raw byte layout; the raw layout is covered
//! by the ordinary unit tests. `attach_*` is not available under loom.

// Parts of this API (attach_*, layout(), Producer::sleep_word) serve
// backends that may not use them yet; the ordinary tests exercise all of it
// (the loom build only runs the loom models).
#![cfg_attr(any(not(test), loom), allow(dead_code))]

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32 as RawAtomicU32, AtomicU64 as RawAtomicU64};
use std::sync::Arc;

use self::sync::{AtomicU32, AtomicU64, Ordering};

/// Picks std or loom atomics for the protocol words (`head`, `tail`,
/// `room_wanted`, `consumer_sleeping`, `closed`). Header and slot words in the raw region
/// always use std atomics.
mod sync {
    #[cfg(loom)]
    pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
    #[cfg(not(loom))]
    pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
}

/// Largest supported slot size in bytes (size of the private copy buffers).
pub(crate) const MAX_SLOT: usize = 256;

/// A private copy of one slot: the producer's staging copy, the
/// consumer's read copy. Each is written for every message by one end
/// only; when both ends run in one process the two ends' copies come from
/// one allocator, which may put them side by side.
/// Aligned to, and filling, whole 128-byte blocks, they never share a
/// cache line with anything else, nor the pair of lines that adjacent-line
/// prefetch moves together (as the header's hot words, see the layout).
#[repr(C, align(128))]
pub(crate) struct SlotCopy(pub(crate) [u8; MAX_SLOT]);

const _: () = assert!(MAX_SLOT % 128 == 0);

impl SlotCopy {
    fn new() -> Box<SlotCopy> {
        Box::new(SlotCopy([0; MAX_SLOT]))
    }
}

const MIN_SLOT: usize = 64;
const MIN_CAPACITY: u32 = 2;
const MAX_CAPACITY: u32 = 65536;

/// "FRRG" as little-endian bytes.
const MAGIC: u32 = 0x4752_5246;
/// 3: the phase bit in every slot (2 had the consumer poll `head`).
const VERSION: u32 = 3;

/// The phase bit in a slot's first word (bit 7 of the slot's first byte,
/// whatever the byte order).
const PHASE: u64 = u64::from_ne_bytes([0x80, 0, 0, 0, 0, 0, 0, 0]);
/// The caller's part of a slot's first byte.
const FIRST_BYTE_MASK: u8 = 0x7f;

/// Spacing of the hot words: two 64-byte lines (adjacent-line prefetch).
const LINE: usize = 128;
/// Required alignment of the region start.
const REGION_ALIGN: usize = 128;

const MAGIC_OFF: usize = 0;
const VERSION_OFF: usize = 4;
const CAPACITY_OFF: usize = 8;
const SLOT_SIZE_OFF: usize = 12;
const HEAD_OFF: usize = LINE;
const TAIL_OFF: usize = 2 * LINE;
/// On the tail's line: the consumer reads it right after storing the tail,
/// from a line it owns already.
const ROOM_OFF: usize = 2 * LINE + 8;
const SLEEPING_OFF: usize = 3 * LINE;
const CLOSED_OFF: usize = 4 * LINE;
/// Start of the slot array == size of the header.
const SLOTS_OFF: usize = 5 * LINE;

/// A batching producer publishes at the latest after this many staged
/// slots, so the consumer can start on a long batch while the rest is being
/// written (the backends' policy; the ring itself publishes on demand).
pub(crate) const PUBLISH_EVERY: u32 = 32;

/// Spin for at most `spin` until `ready` holds; whether it did. Both rings'
/// consumers wait so before they sleep: spinning is cheaper than a sleep
/// and a wake-up across cores (≈ 50 µs on the machines measured).
pub(crate) fn spin_until(spin: std::time::Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < spin {
        if ready() {
            return true;
        }
        std::hint::spin_loop();
    }
    false
}

/// How many slots ahead the producer prefetches for writing, and the
/// consumer for reading.
const PREFETCH_WRITE_AHEAD: u64 = 6;
const PREFETCH_READ_AHEAD: u64 = 3;

const PRODUCER_CLOSED: u32 = 1;
const CONSUMER_CLOSED: u32 = 2;

const _: () = {
    assert!(HEAD_OFF == 128 && TAIL_OFF == 256 && SLEEPING_OFF == 384);
    assert!(CLOSED_OFF == 512 && SLOTS_OFF == 640);
    assert!(SLOTS_OFF % REGION_ALIGN == 0);
    assert!(MAX_SLOT % 8 == 0 && MIN_SLOT % 8 == 0);
    assert!(REGION_ALIGN >= std::mem::align_of::<RawAtomicU64>());
};

/// Errors of ring operations.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub(crate) enum RingError {
    /// The requested layout is invalid, or does not match the region.
    #[error("bad ring layout: {0}")]
    BadLayout(&'static str),
    /// No free slot (the consumer has not caught up).
    #[error("ring is full")]
    Full,
    /// The ring was closed (by the peer, or by this end).
    #[error("ring is closed")]
    Closed,
    /// The shared region holds values no honest peer could have written.
    #[error("ring memory is corrupt: {0}")]
    Corrupt(&'static str),
}

/// Capacity and slot size of a ring; validated on construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RingLayout {
    capacity: u32,
    slot_size: u32,
}

impl RingLayout {
    /// `capacity`: power of two in `2..=65536`; `slot_size`: power of two in
    /// `64..=256`.
    pub(crate) fn new(capacity: u32, slot_size: u32) -> Result<Self, RingError> {
        if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
            return Err(RingError::BadLayout("capacity must be a power of two in 2..=65536"));
        }
        if !slot_size.is_power_of_two() || !(MIN_SLOT..=MAX_SLOT).contains(&(slot_size as usize)) {
            return Err(RingError::BadLayout("slot size must be a power of two in 64..=256"));
        }
        Ok(Self { capacity, slot_size })
    }

    /// Bytes of memory the ring needs: header plus `capacity * slot_size`.
    pub(crate) fn region_size(&self) -> usize {
        SLOTS_OFF + self.capacity as usize * self.slot_size as usize
    }

    /// Number of slots.
    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Bytes per slot.
    pub(crate) fn slot_size(&self) -> u32 {
        self.slot_size
    }
}

/// Owns or keeps alive the memory the ring lives in.
///
/// Contract for implementors (relied upon by this module's unsafe code):
/// `as_ptr()` points to `len()` bytes that stay mapped, readable and
/// writable for as long as the object lives, and both return the same values
/// on every call. The memory may be written concurrently by other processes
/// but must not be accessed non-atomically by this process outside this
/// module.
pub(crate) trait RingMemory: Send + Sync + 'static {
    /// Start of the memory.
    fn as_ptr(&self) -> *mut u8;
    /// Length of the memory in bytes.
    fn len(&self) -> usize;
}

/// Zeroed, page-aligned heap allocation, freed on drop.
pub(crate) struct HeapRegion {
    ptr: NonNull<u8>,
    len: usize,
    layout: std::alloc::Layout,
}

const HEAP_ALIGN: usize = 4096;

impl HeapRegion {
    /// Allocates `len` zeroed bytes aligned to 4096. Aborts on allocation
    /// failure like `Vec` does.
    pub(crate) fn new(len: usize) -> Self {
        let layout =
            std::alloc::Layout::from_size_align(len.max(1), HEAP_ALIGN).expect("heap region size overflows isize");
        // SAFETY: `layout` has non-zero size (len.max(1)) and a valid
        // power-of-two alignment, as `alloc_zeroed` requires.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        Self { ptr, len, layout }
    }
}

impl Drop for HeapRegion {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed(self.layout)` and is
        // freed exactly once, here. Rings hold an `Arc` to the region, so no
        // ring end can still use it.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: a HeapRegion is a uniquely owned allocation, like a Box<[u8]>. All
// access to its bytes from several threads goes through this module, which
// only uses atomic operations on it (see "Hostile peers").
unsafe impl Send for HeapRegion {}
// SAFETY: as above; `&HeapRegion` only hands out the raw pointer and length.
unsafe impl Sync for HeapRegion {}

impl RingMemory for HeapRegion {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl fmt::Debug for HeapRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeapRegion").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

/// Under loom, the protocol words and the slots live here instead of in the
/// raw region (loom atomics and cells cannot be placed in raw memory).
#[cfg(loom)]
struct LoomState {
    head: AtomicU64,
    tail: AtomicU64,
    room: AtomicU32,
    sleeping: AtomicU32,
    closed: AtomicU32,
    slots: Box<[loom::cell::UnsafeCell<[u8; MAX_SLOT]>]>,
    /// Each slot's phase bit (in the region: inside the slot's first word).
    phases: Box<[AtomicU64]>,
}

/// A validated view of the region, shared (by value) by both ends.
///
/// Invariants established by [`Shared::new`] and relied on by every unsafe
/// block below:
/// * `base == mem.as_ptr()`, non-null and `REGION_ALIGN`-aligned;
/// * `mem.len() >= layout.region_size()`, and `mem` (kept alive by `_mem`)
///   keeps those bytes mapped for as long as `self` lives;
/// * `mask == capacity - 1` and `slot_size` come from the caller's validated
///   `layout`, never from the region.
struct Shared {
    _mem: Arc<dyn RingMemory>,
    base: NonNull<u8>,
    layout: RingLayout,
    cap: u64,
    mask: u64,
    slot_size: usize,
    #[cfg(loom)]
    model: loom::sync::Arc<LoomState>,
}

impl Shared {
    fn new(mem: Arc<dyn RingMemory>, layout: RingLayout) -> Result<Self, RingError> {
        let Some(base) = NonNull::new(mem.as_ptr()) else {
            return Err(RingError::BadLayout("ring memory pointer is null"));
        };
        if base.as_ptr() as usize % REGION_ALIGN != 0 {
            return Err(RingError::BadLayout("ring memory must be 128-byte aligned"));
        }
        if mem.len() < layout.region_size() {
            return Err(RingError::BadLayout("ring memory is smaller than the layout's region size"));
        }
        Ok(Self {
            _mem: mem,
            base,
            layout,
            cap: u64::from(layout.capacity),
            mask: u64::from(layout.capacity - 1),
            slot_size: layout.slot_size as usize,
            #[cfg(loom)]
            model: loom::sync::Arc::new(LoomState {
                head: AtomicU64::new(0),
                tail: AtomicU64::new(0),
                room: AtomicU32::new(0),
                sleeping: AtomicU32::new(0),
                closed: AtomicU32::new(0),
                slots: (0..layout.capacity).map(|_| loom::cell::UnsafeCell::new([0u8; MAX_SLOT])).collect(),
                phases: (0..layout.capacity).map(|_| AtomicU64::new(0)).collect(),
            }),
        })
    }

    /// Another handle on the same ring (for the other end).
    fn share(&self) -> Self {
        Self {
            _mem: Arc::clone(&self._mem),
            base: self.base,
            layout: self.layout,
            cap: self.cap,
            mask: self.mask,
            slot_size: self.slot_size,
            #[cfg(loom)]
            model: loom::sync::Arc::clone(&self.model),
        }
    }

    /// Header word at `off` (a constant offset inside the header).
    fn raw_u32(&self, off: usize) -> &RawAtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= SLOTS_OFF);
        // SAFETY: off + 4 <= SLOTS_OFF <= region_size <= mem.len(), so the 4
        // bytes are inside the live region (type invariants); base is
        // 128-aligned and off a multiple of 4, so the pointer is aligned for
        // AtomicU32. The reference is tied to `&self`, which keeps `_mem`
        // alive. All accesses to the region by this process are atomic; the
        // peer may write concurrently, which `&AtomicU32` permits.
        unsafe { RawAtomicU32::from_ptr(self.base.as_ptr().add(off).cast()) }
    }

    /// Header or slot word at `off`.
    fn raw_u64(&self, off: usize) -> &RawAtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= self.layout.region_size());
        // SAFETY: callers pass constant header offsets or slot offsets built
        // by `slot_off` (masked index), so off + 8 <= region_size <=
        // mem.len(); off is a multiple of 8 and base is 128-aligned, so the
        // pointer is aligned for AtomicU64. Lifetime and concurrency as in
        // `raw_u32`.
        unsafe { RawAtomicU64::from_ptr(self.base.as_ptr().add(off).cast()) }
    }

    /// Hint the CPU to fetch the lines of the slot for `counter` (for
    /// writing if `write`). Only a hint: nothing is read or written, so a
    /// peer writing the slot meanwhile is harmless.
    #[inline]
    fn prefetch_slot(&self, counter: u64, write: bool) {
        #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
        for line in (0..self.slot_size).step_by(64) {
            let p = self.base.as_ptr().wrapping_add(self.slot_off(counter) + line);
            // SAFETY: prefetch instructions are hints: they never fault, not
            // even on an unmapped address, write nothing (`readonly`) and
            // have no effect the program can observe other than timing, so a
            // peer writing the line meanwhile races with nothing. `p` lies
            // inside the slot array anyway (masked counter). `prefetchw` is
            // only used when CPUID says the CPU has it (`has_prefetchw`).
            unsafe {
                if write {
                    std::arch::asm!("prefetchw [{p}]", p = in(reg) p, options(readonly, nostack, preserves_flags));
                } else {
                    std::arch::asm!("prefetcht0 [{p}]", p = in(reg) p, options(readonly, nostack, preserves_flags));
                }
            }
        }
        #[cfg(not(all(target_arch = "x86_64", not(loom), not(miri))))]
        let _ = (counter, write);
    }

    /// Offset of the slot for `counter`. The index is masked here, so no
    /// counter value (ours or a garbage one) can address outside the slots.
    fn slot_off(&self, counter: u64) -> usize {
        let idx = (counter & self.mask) as usize;
        SLOTS_OFF + idx * self.slot_size
    }

    #[cfg(not(loom))]
    fn head(&self) -> &AtomicU64 {
        self.raw_u64(HEAD_OFF)
    }
    #[cfg(not(loom))]
    fn tail(&self) -> &AtomicU64 {
        self.raw_u64(TAIL_OFF)
    }
    #[cfg(not(loom))]
    fn room(&self) -> &AtomicU32 {
        self.raw_u32(ROOM_OFF)
    }
    #[cfg(not(loom))]
    fn sleeping(&self) -> &AtomicU32 {
        self.raw_u32(SLEEPING_OFF)
    }
    #[cfg(not(loom))]
    fn closed(&self) -> &AtomicU32 {
        self.raw_u32(CLOSED_OFF)
    }

    #[cfg(loom)]
    fn head(&self) -> &AtomicU64 {
        &self.model.head
    }
    #[cfg(loom)]
    fn tail(&self) -> &AtomicU64 {
        &self.model.tail
    }
    #[cfg(loom)]
    fn room(&self) -> &AtomicU32 {
        &self.model.room
    }
    #[cfg(loom)]
    fn sleeping(&self) -> &AtomicU32 {
        &self.model.sleeping
    }
    #[cfg(loom)]
    fn closed(&self) -> &AtomicU32 {
        &self.model.closed
    }

    /// The phase bit that marks the slot for `counter` published: set on
    /// even laps, clear on odd ones (capacity is a power of two, so
    /// `counter & cap` is the lap's lowest bit).
    #[inline]
    fn phase(&self, counter: u64) -> u64 {
        if counter & self.cap == 0 {
            PHASE
        } else {
            0
        }
    }

    /// Copies `src[..slot_size]` into the slot for `counter`, word by word
    /// with Relaxed atomic stores, the first word with the previous lap's
    /// phase: the slot stays unpublished until [`publish_slot`](Self::publish_slot).
    #[cfg(not(loom))]
    fn write_slot(&self, counter: u64, src: &[u8; MAX_SLOT]) {
        let off = self.slot_off(counter);
        let word = |chunk: &[u8]| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(chunk);
            u64::from_ne_bytes(bytes)
        };
        let (first, rest) = src[..self.slot_size].split_at(8);
        let stale = self.phase(counter) ^ PHASE;
        self.raw_u64(off).store((word(first) & !PHASE) | stale, Ordering::Relaxed);
        for (i, chunk) in rest.chunks_exact(8).enumerate() {
            self.raw_u64(off + 8 + i * 8).store(word(chunk), Ordering::Relaxed);
        }
    }

    /// Publish the slot for `counter` (written by `write_slot`): its first
    /// word again, with this lap's phase. Release: a consumer that loads the
    /// word with Acquire and finds the phase sees the whole slot, and every
    /// head store before this one.
    #[cfg(not(loom))]
    fn publish_slot(&self, counter: u64) {
        let first = self.raw_u64(self.slot_off(counter));
        // Our own store of write_slot (a consumer scribbling over it would
        // only garble its own copy).
        let word = first.load(Ordering::Relaxed);
        first.store((word & !PHASE) | self.phase(counter), Ordering::Release);
    }

    /// Whether the slot for `counter` carries its lap's phase, i.e. the
    /// producer has published it. Acquire: pairs with `publish_slot`.
    #[cfg(not(loom))]
    fn slot_published(&self, counter: u64) -> bool {
        self.raw_u64(self.slot_off(counter)).load(Ordering::Acquire) & PHASE == self.phase(counter)
    }

    /// Copies the slot for `counter` into `dst[..slot_size]`, word by word
    /// with Relaxed atomic loads (made visible by the earlier Acquire load of
    /// head or of the slot's phase), the phase bit cleared.
    #[cfg(not(loom))]
    fn read_slot(&self, counter: u64, dst: &mut [u8; MAX_SLOT]) {
        let off = self.slot_off(counter);
        for (i, chunk) in dst[..self.slot_size].chunks_exact_mut(8).enumerate() {
            let word = self.raw_u64(off + i * 8).load(Ordering::Relaxed);
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        dst[0] &= FIRST_BYTE_MASK;
    }

    #[cfg(loom)]
    fn write_slot(&self, counter: u64, src: &[u8; MAX_SLOT]) {
        let idx = (counter & self.mask) as usize;
        // SAFETY: loom's UnsafeCell checks that this write does not race with
        // any other access to the slot; the pointer is valid for the closure.
        self.model.slots[idx].with_mut(|p| unsafe { *p = *src });
    }

    /// The phase lives apart from the slot bytes under loom: the model
    /// checks that finding the phase orders the slot's writes before our
    /// reads (the cell flags a race otherwise).
    #[cfg(loom)]
    fn publish_slot(&self, counter: u64) {
        self.model.phases[(counter & self.mask) as usize].store(self.phase(counter), Ordering::Release);
    }

    #[cfg(loom)]
    fn slot_published(&self, counter: u64) -> bool {
        self.model.phases[(counter & self.mask) as usize].load(Ordering::Acquire) == self.phase(counter)
    }

    #[cfg(loom)]
    fn read_slot(&self, counter: u64, dst: &mut [u8; MAX_SLOT]) {
        let idx = (counter & self.mask) as usize;
        // SAFETY: loom's UnsafeCell checks that this read does not race with
        // a write to the slot; the pointer is valid for the closure.
        self.model.slots[idx].with(|p| unsafe { *dst = *p });
        dst[0] &= FIRST_BYTE_MASK;
    }

    /// Writes a fresh header: zero everything, then layout, then the magic
    /// last with Release so an `attach` that sees the magic sees the rest.
    fn init_header(&self) {
        for off in (0..SLOTS_OFF).step_by(8) {
            self.raw_u64(off).store(0, Ordering::Relaxed);
        }
        self.raw_u32(VERSION_OFF).store(VERSION, Ordering::Relaxed);
        self.raw_u32(CAPACITY_OFF).store(self.layout.capacity, Ordering::Relaxed);
        self.raw_u32(SLOT_SIZE_OFF).store(self.layout.slot_size, Ordering::Relaxed);
        self.raw_u32(MAGIC_OFF).store(MAGIC, Ordering::Release);
    }

    /// Checks a header another party wrote against the expected layout.
    #[cfg(not(loom))]
    fn validate_header(&self) -> Result<(), RingError> {
        // Acquire pairs with the Release store of the magic in init_header.
        if self.raw_u32(MAGIC_OFF).load(Ordering::Acquire) != MAGIC {
            return Err(RingError::Corrupt("bad magic in ring header"));
        }
        if self.raw_u32(VERSION_OFF).load(Ordering::Relaxed) != VERSION {
            return Err(RingError::BadLayout("unsupported ring version"));
        }
        if self.raw_u32(CAPACITY_OFF).load(Ordering::Relaxed) != self.layout.capacity {
            return Err(RingError::BadLayout("ring capacity does not match"));
        }
        if self.raw_u32(SLOT_SIZE_OFF).load(Ordering::Relaxed) != self.layout.slot_size {
            return Err(RingError::BadLayout("ring slot size does not match"));
        }
        Ok(())
    }

    /// Reads both counters of an existing ring and checks them.
    #[cfg(not(loom))]
    fn read_counters(&self) -> Result<(u64, u64), RingError> {
        let tail = self.tail().load(Ordering::Acquire);
        let head = self.head().load(Ordering::Acquire);
        counter_distance(head, tail, self.cap)?;
        Ok((head, tail))
    }
}

/// Whether the CPU has `prefetchw` (CPUID 8000_0001h ECX bit 8, "3DNow!
/// prefetch" on AMD, "PREFETCHW" on Intel); checked once per process.
fn has_prefetchw() -> bool {
    #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            use std::arch::x86_64::__cpuid;
            __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
        })
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom), not(miri))))]
    false
}

/// `head - tail`, checked to be in `0..=cap` (wrapping arithmetic: the
/// counters are free-running).
fn counter_distance(head: u64, tail: u64, cap: u64) -> Result<u64, RingError> {
    let d = head.wrapping_sub(tail);
    if d <= cap {
        Ok(d)
    } else if (d as i64) < 0 {
        Err(RingError::Corrupt("ring head is behind tail"))
    } else {
        Err(RingError::Corrupt("ring head is more than capacity ahead of tail"))
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ring").field("base", &self.base).field("layout", &self.layout).finish()
    }
}

/// Lay out a fresh ring in `mem` (zeroes the header, writes magic/layout)
/// and return both ends.
/// Lay out a fresh ring in `mem` without creating its ends: both attach
/// later, possibly from two processes (the shared-memory backend).
#[cfg(not(loom))]
pub(crate) fn init(mem: Arc<dyn RingMemory>, layout: RingLayout) -> Result<(), RingError> {
    Shared::new(mem, layout)?.init_header();
    Ok(())
}

pub(crate) fn create(mem: Arc<dyn RingMemory>, layout: RingLayout) -> Result<(Producer, Consumer), RingError> {
    let shared = Shared::new(mem, layout)?;
    shared.init_header();
    let consumer = Consumer { sh: shared.share(), tail: 0, cached_head: 0, in_run: false, copy: SlotCopy::new() };
    let producer = Producer {
        sh: shared,
        head: 0,
        published: 0,
        cached_tail: 0,
        prefetch_write: has_prefetchw(),
        stage: SlotCopy::new(),
    };
    Ok((producer, consumer))
}

/// Attach the producer end to a ring another party laid out (validates
/// magic, layout and region size, and the counters).
#[cfg(not(loom))]
pub(crate) fn attach_producer(mem: Arc<dyn RingMemory>, layout: RingLayout) -> Result<Producer, RingError> {
    let sh = Shared::new(mem, layout)?;
    sh.validate_header()?;
    let (head, tail) = sh.read_counters()?;
    Ok(Producer {
        sh,
        head,
        published: head,
        cached_tail: tail,
        prefetch_write: has_prefetchw(),
        stage: SlotCopy::new(),
    })
}

/// Attach the consumer end to a ring another party laid out (validates
/// magic, layout and region size, and the counters).
#[cfg(not(loom))]
pub(crate) fn attach_consumer(mem: Arc<dyn RingMemory>, layout: RingLayout) -> Result<Consumer, RingError> {
    let sh = Shared::new(mem, layout)?;
    sh.validate_header()?;
    let (head, tail) = sh.read_counters()?;
    Ok(Consumer { sh, tail, cached_head: head, in_run: false, copy: SlotCopy::new() })
}

/// Not modelled under loom: the protocol words live outside the region.
#[cfg(loom)]
pub(crate) fn attach_producer(mem: Arc<dyn RingMemory>, layout: RingLayout) -> Result<Producer, RingError> {
    let _ = (mem, layout);
    Err(RingError::BadLayout("attach is not supported under cfg(loom)"))
}

/// Not modelled under loom: the protocol words live outside the region.
#[cfg(loom)]
pub(crate) fn attach_consumer(mem: Arc<dyn RingMemory>, layout: RingLayout) -> Result<Consumer, RingError> {
    let _ = (mem, layout);
    Err(RingError::BadLayout("attach is not supported under cfg(loom)"))
}

/// A ring in a fresh [`HeapRegion`], for in-process channels.
pub(crate) fn heap_pair(layout: RingLayout) -> (Producer, Consumer) {
    let mem: Arc<dyn RingMemory> = Arc::new(HeapRegion::new(layout.region_size()));
    create(mem, layout).expect("a fresh, aligned, large enough heap region is always valid")
}

mod consumer;
mod producer;
mod values;

pub(crate) use consumer::Consumer;
pub(crate) use producer::Producer;
pub(crate) use values::{value_pair, ValueConsumer, ValueProducer};

#[cfg(all(test, not(loom)))]
mod tests;

/// loom models of the ordering protocol (the header atomics and slots live
/// in `LoomState`, see the module docs). Run with `.ci/loom.sh`.
#[cfg(all(test, loom))]
mod loom_tests;

/// A heap ring region whose bytes after the header come from a peer we do
/// not trust (or, when `keep_header` is false, all of it): what the
/// shared-memory backend may find in a segment. For the fuzz targets.
#[cfg(all(feature = "fuzzing", not(loom)))]
pub(crate) fn region_written_by_peer(layout: RingLayout, bytes: &[u8], keep_header: bool) -> Arc<HeapRegion> {
    let region = Arc::new(HeapRegion::new(layout.region_size()));
    let mem: Arc<dyn RingMemory> = region.clone();
    drop(create(mem, layout).expect("valid layout"));
    let start = if keep_header { 128 } else { 0 };
    let n = bytes.len().min(region.len().saturating_sub(start));
    // SAFETY: both ring ends were dropped above, so nothing else accesses
    // the region; the destination range lies inside the allocation.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), region.as_ptr().add(start), n) };
    region
}
