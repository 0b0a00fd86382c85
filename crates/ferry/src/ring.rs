//! Single-producer / single-consumer ring of fixed-size descriptor slots in a
//! raw memory region.
//!
//! The same code serves threads of one process (region on the heap,
//! [`HeapRegion`]) and two processes sharing a memfd mapping, where the peer
//! may be hostile and may write anything into the region at any time.
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
//! |      4 |    4 | version (`1`)        | creator, at init      |
//! |      8 |    4 | capacity (slots)     | creator, at init      |
//! |     12 |    4 | slot_size (bytes)    | creator, at init      |
//! |     16 |  112 | reserved, zero       | creator, at init      |
//! |    128 |    8 | `head: AtomicU64`    | producer only         |
//! |    136 |  120 | padding              |                       |
//! |    256 |    8 | `tail: AtomicU64`    | consumer only         |
//! |    264 |  120 | padding              |                       |
//! |    384 |    4 | `consumer_sleeping: AtomicU32` (futex word) | consumer sets, producer clears |
//! |    388 |  124 | padding              |                       |
//! |    512 |    4 | `closed: AtomicU32` (bit 0 producer closed, bit 1 consumer closed) | each side its bit |
//! |    516 |  124 | padding              |                       |
//! |    640 | capacity * slot_size | slots | producer only |
//!
//! `region_size = 640 + capacity * slot_size`. Each hot word has 128 bytes to
//! itself (two 64-byte lines, so adjacent-line prefetch does not pull the
//! peer's counter in with ours). capacity is a power of two in `2..=65536`,
//! slot_size a power of two in `64..=256`, so the slot array is 128-byte
//! aligned and every slot is a whole number of 64-byte lines.
//! `crossbeam_utils::CachePadded` is not used: its size is target-dependent
//! (64 or 128 bytes) and a cross-process layout needs fixed offsets.
//!
//! # Cached counters (why it is fast)
//!
//! Each side keeps its own counter in a private field (the copy in the region
//! is only for the peer) and a cached copy of the peer's counter. The producer
//! re-reads `tail` only when the ring looks full according to its cached
//! tail, and the consumer re-reads `head` only when the ring looks empty
//! according to its cached head. In steady state a push or pop therefore
//! touches the slot, its own counter line and nothing else of the peer's, so
//! the two cache lines are not bounced between cores on every operation.
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
//!   one or more staged slots, then `head.store(h + n, Release)`. The
//!   consumer loads `head` with `Acquire`; if it reads `h + n` (or later) the
//!   Release/Acquire pair makes the writes of all `n` slots happen-before its
//!   slot reads, so it sees every descriptor whole.
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
//!   P1 head.store(h+n, Release)          C1 sleeping.store(1, SeqCst)
//!   P2 fence(SeqCst)                     C2 fence(SeqCst)
//!   P3 sleeping.load -> swap(0)          C3 head.load(Acquire) (+ closed)
//!   ```
//!
//!   The two fences are totally ordered in the single SeqCst order S.
//!   If P2 precedes C2 in S, then C3 (sequenced after C2) must read the
//!   value stored by P1 (sequenced before P2) or a later one
//!   (C++20 [atomics.order], the rule for two SeqCst fences): the consumer sees the item, `prepare_sleep`
//!   returns false and it does not block. If C2 precedes P2, then P3 must
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

use self::sync::{fence, AtomicU32, AtomicU64, Ordering};

/// Picks std or loom atomics for the protocol words (`head`, `tail`,
/// `consumer_sleeping`, `closed`). Header and slot words in the raw region
/// always use std atomics.
mod sync {
    #[cfg(loom)]
    pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
    #[cfg(not(loom))]
    pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
}

/// Largest supported slot size in bytes (size of the private copy buffers).
pub(crate) const MAX_SLOT: usize = 256;

const MIN_SLOT: usize = 64;
const MIN_CAPACITY: u32 = 2;
const MAX_CAPACITY: u32 = 65536;

/// "FRRG" as little-endian bytes.
const MAGIC: u32 = 0x4752_5246;
const VERSION: u32 = 1;

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
const SLEEPING_OFF: usize = 3 * LINE;
const CLOSED_OFF: usize = 4 * LINE;
/// Start of the slot array == size of the header.
const SLOTS_OFF: usize = 5 * LINE;

/// A batching producer publishes at the latest after this many staged
/// slots, so the consumer can start on a long batch while the rest is being
/// written (the backends' policy; the ring itself publishes on demand).
pub(crate) const PUBLISH_EVERY: u32 = 32;

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
    sleeping: AtomicU32,
    closed: AtomicU32,
    slots: Box<[loom::cell::UnsafeCell<[u8; MAX_SLOT]>]>,
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
                sleeping: AtomicU32::new(0),
                closed: AtomicU32::new(0),
                slots: (0..layout.capacity).map(|_| loom::cell::UnsafeCell::new([0u8; MAX_SLOT])).collect(),
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
    fn sleeping(&self) -> &AtomicU32 {
        &self.model.sleeping
    }
    #[cfg(loom)]
    fn closed(&self) -> &AtomicU32 {
        &self.model.closed
    }

    /// Copies `src[..slot_size]` into the slot for `counter`, word by word
    /// with Relaxed atomic stores (publication is by the later Release store
    /// of head).
    #[cfg(not(loom))]
    fn write_slot(&self, counter: u64, src: &[u8; MAX_SLOT]) {
        let off = self.slot_off(counter);
        for (i, chunk) in src[..self.slot_size].chunks_exact(8).enumerate() {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.raw_u64(off + i * 8).store(u64::from_ne_bytes(word), Ordering::Relaxed);
        }
    }

    /// Copies the slot for `counter` into `dst[..slot_size]`, word by word
    /// with Relaxed atomic loads (made visible by the earlier Acquire load of
    /// head).
    #[cfg(not(loom))]
    fn read_slot(&self, counter: u64, dst: &mut [u8; MAX_SLOT]) {
        let off = self.slot_off(counter);
        for (i, chunk) in dst[..self.slot_size].chunks_exact_mut(8).enumerate() {
            let word = self.raw_u64(off + i * 8).load(Ordering::Relaxed);
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
    }

    #[cfg(loom)]
    fn write_slot(&self, counter: u64, src: &[u8; MAX_SLOT]) {
        let idx = (counter & self.mask) as usize;
        // SAFETY: loom's UnsafeCell checks that this write does not race with
        // any other access to the slot; the pointer is valid for the closure.
        self.model.slots[idx].with_mut(|p| unsafe { *p = *src });
    }

    #[cfg(loom)]
    fn read_slot(&self, counter: u64, dst: &mut [u8; MAX_SLOT]) {
        let idx = (counter & self.mask) as usize;
        // SAFETY: loom's UnsafeCell checks that this read does not race with
        // a write to the slot; the pointer is valid for the closure.
        self.model.slots[idx].with(|p| unsafe { *dst = *p });
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
    let consumer = Consumer { sh: shared.share(), tail: 0, cached_head: 0 };
    let producer = Producer { sh: shared, head: 0, published: 0, cached_tail: 0, prefetch_write: has_prefetchw() };
    Ok((producer, consumer))
}

/// Attach the producer end to a ring another party laid out (validates
/// magic, layout and region size, and the counters).
#[cfg(not(loom))]
pub(crate) fn attach_producer(mem: Arc<dyn RingMemory>, layout: RingLayout) -> Result<Producer, RingError> {
    let sh = Shared::new(mem, layout)?;
    sh.validate_header()?;
    let (head, tail) = sh.read_counters()?;
    Ok(Producer { sh, head, published: head, cached_tail: tail, prefetch_write: has_prefetchw() })
}

/// Attach the consumer end to a ring another party laid out (validates
/// magic, layout and region size, and the counters).
#[cfg(not(loom))]
pub(crate) fn attach_consumer(mem: Arc<dyn RingMemory>, layout: RingLayout) -> Result<Consumer, RingError> {
    let sh = Shared::new(mem, layout)?;
    sh.validate_header()?;
    let (head, tail) = sh.read_counters()?;
    Ok(Consumer { sh, tail, cached_head: head })
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

/// The writing end. `Send`, not `Sync`; `&mut self` makes it single-producer.
pub(crate) struct Producer {
    sh: Shared,
    /// Our head: every slot filled so far, published or only staged;
    /// authoritative (the region copy is for the consumer only).
    head: u64,
    /// The head last stored to the region, i.e. what the consumer may see;
    /// invariant `cached_tail <= published <= head` (wrapping).
    published: u64,
    /// Last tail read from the region; invariant `0 <= head - cached_tail <= cap`.
    cached_tail: u64,
    /// The CPU has a write prefetch (x86 `prefetchw`).
    prefetch_write: bool,
}

// SAFETY: the only non-Send field is the raw `base` pointer into memory that
// `Shared::_mem` (Send + Sync) keeps alive; it is used only for atomic
// accesses, which are valid from any thread. Producer is deliberately not
// Sync (the raw pointer keeps it !Sync): all mutation needs `&mut self`.
unsafe impl Send for Producer {}

impl Producer {
    /// Fill the next slot with `fill` (it gets a zeroed `&mut [u8]` of
    /// `slot_size` bytes, a private staging copy, then copied into the slot),
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
        let mut stage = [0u8; MAX_SLOT];
        fill(&mut stage[..self.sh.slot_size]);
        // The slot at head is free: head - cached_tail < cap, and the Acquire
        // load that produced cached_tail ordered the consumer's reads of this
        // slot before our writes.
        self.sh.write_slot(self.head, &stage);
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
        self.published = self.head;
        // Release: publishes the slot contents to the consumer's Acquire load.
        self.sh.head().store(self.head, Ordering::Release);
        // Dekker handshake with prepare_sleep (see module docs): the fence
        // orders the head store before the flag load in the SeqCst order.
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
            self.published = self.head;
            self.sh.head().store(self.head, Ordering::Release);
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

/// The reading end. `Send`, not `Sync`; `&mut self` makes it single-consumer.
pub(crate) struct Consumer {
    sh: Shared,
    /// Our tail; authoritative (the region copy is for the producer only).
    tail: u64,
    /// Last head read from the region; invariant `0 <= cached_head - tail <= cap`.
    cached_head: u64,
}

// SAFETY: as for Producer: the raw pointer is only used for atomic accesses
// to memory kept alive by a Send + Sync Arc. Not Sync.
unsafe impl Send for Consumer {}

impl Consumer {
    /// Copy the next slot out into a private stack buffer (so a hostile
    /// producer cannot change it while we decode), advance tail, and hand
    /// the copy to `read`.
    ///
    /// `Ok(None)` if empty. `Err(Corrupt)` if head is inconsistent (more than
    /// capacity ahead of tail, behind tail, or moved backwards); the ring is
    /// left unchanged.
    pub(crate) fn try_pop<R>(&mut self, read: impl FnOnce(&[u8]) -> R) -> Result<Option<R>, RingError> {
        if self.cached_head == self.tail {
            // Looks empty with the cached head: only now touch the
            // producer's cache line.
            self.refresh_head()?;
            if self.cached_head == self.tail {
                return Ok(None);
            }
        }
        let mut copy = [0u8; MAX_SLOT];
        // Visible: the Acquire load that produced cached_head > tail
        // synchronized with the producer's Release store after its writes.
        self.sh.read_slot(self.tail, &mut copy);
        self.tail = self.tail.wrapping_add(1);
        // Ask for a published slot a few pops ahead, so its lines are on
        // their way from the producer's core by the time we read it.
        if self.cached_head.wrapping_sub(self.tail) > PREFETCH_READ_AHEAD {
            self.sh.prefetch_slot(self.tail.wrapping_add(PREFETCH_READ_AHEAD), false);
        }
        // Release: our reads of the slot happen-before the producer's reuse
        // of it (it loads tail with Acquire).
        self.sh.tail().store(self.tail, Ordering::Release);
        Ok(Some(read(&copy[..self.sh.slot_size])))
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

    /// Sleep protocol: declare asleep (SeqCst), then re-check for work.
    /// Returns true if the caller may block (still empty, producer not
    /// closed), false if work arrived, the producer closed, or head is
    /// corrupt (the flag is cleared again; `try_pop` reports the corruption).
    /// After a true return, block with `futex_wait(sleep_word(), 1)` (or
    /// park) and call `cancel_sleep` when woken.
    /// Spin for at most `spin` until there is work or the producer closed;
    /// `true` if there is (spinning is cheaper than a sleep and a wake-up
    /// across cores, ≈ 50 µs on the machines measured).
    pub(crate) fn spin_for_work(&mut self, spin: std::time::Duration) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < spin {
            if self.len().map_or(true, |n| n > 0) || self.peer_closed() {
                return true;
            }
            std::hint::spin_loop();
        }
        false
    }

    pub(crate) fn prepare_sleep(&mut self) -> bool {
        if self.cached_head != self.tail {
            return false;
        }
        self.sh.sleeping().store(1, Ordering::SeqCst);
        // Dekker handshake with try_push/close (see module docs): after this
        // fence either we see the producer's head/closed store, or the
        // producer sees our flag.
        fence(Ordering::SeqCst);
        let closed = self.sh.closed().load(Ordering::Acquire) & PRODUCER_CLOSED != 0;
        let refreshed = self.refresh_head();
        if closed || refreshed.is_err() || self.cached_head != self.tail {
            self.cancel_sleep();
            return false;
        }
        true
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::SeqCst;
    use std::thread;

    fn layout(cap: u32, slot: u32) -> RingLayout {
        RingLayout::new(cap, slot).unwrap()
    }

    fn heap(layout: RingLayout) -> Arc<dyn RingMemory> {
        Arc::new(HeapRegion::new(layout.region_size()))
    }

    /// Stands in for a hostile peer writing a word of the region.
    fn poke_u64(mem: &Arc<dyn RingMemory>, off: usize, val: u64) {
        assert!(off % 8 == 0 && off + 8 <= mem.len());
        // SAFETY: in bounds and 8-aligned (checked above, region 4096-aligned);
        // the region is only accessed atomically.
        unsafe { RawAtomicU64::from_ptr(mem.as_ptr().add(off).cast()) }.store(val, SeqCst);
    }

    fn poke_u32(mem: &Arc<dyn RingMemory>, off: usize, val: u32) {
        assert!(off % 4 == 0 && off + 4 <= mem.len());
        // SAFETY: as in poke_u64.
        unsafe { RawAtomicU32::from_ptr(mem.as_ptr().add(off).cast()) }.store(val, SeqCst);
    }

    fn peek_u64(mem: &Arc<dyn RingMemory>, off: usize) -> u64 {
        assert!(off % 8 == 0 && off + 8 <= mem.len());
        // SAFETY: as in poke_u64.
        unsafe { RawAtomicU64::from_ptr(mem.as_ptr().add(off).cast()) }.load(SeqCst)
    }

    fn fill_pattern(buf: &mut [u8], seq: u64) {
        buf[..8].copy_from_slice(&seq.to_le_bytes());
        for (i, b) in buf[8..].iter_mut().enumerate() {
            *b = (seq as u8).wrapping_mul(31).wrapping_add(i as u8);
        }
    }

    fn check_pattern(buf: &[u8], expect_len: usize) -> u64 {
        assert_eq!(buf.len(), expect_len);
        let seq = u64::from_le_bytes(buf[..8].try_into().unwrap());
        for (i, b) in buf[8..].iter().enumerate() {
            assert_eq!(*b, (seq as u8).wrapping_mul(31).wrapping_add(i as u8), "seq {seq} byte {i}");
        }
        seq
    }

    #[test]
    fn layout_validation() {
        for cap in [0, 1, 3, 6, 100, 131072, u32::MAX] {
            assert!(matches!(RingLayout::new(cap, 64), Err(RingError::BadLayout(_))), "{cap}");
        }
        for slot in [0, 8, 32, 63, 100, 128 + 64, 512, 4096] {
            assert!(matches!(RingLayout::new(4, slot), Err(RingError::BadLayout(_))), "{slot}");
        }
        for cap in [2, 4, 1024, 65536] {
            for slot in [64, 128, 256] {
                let l = layout(cap, slot);
                assert_eq!((l.capacity(), l.slot_size()), (cap, slot));
                assert_eq!(l.region_size(), 640 + cap as usize * slot as usize);
            }
        }
    }

    #[test]
    fn send_not_sync() {
        fn send<T: Send>() {}
        send::<Producer>();
        send::<Consumer>();
        send::<HeapRegion>();
    }

    #[test]
    fn fifo_across_wraparound() {
        for (cap, slot) in [(2, 64), (4, 128), (8, 256), (64, 64)] {
            let (mut p, mut c) = heap_pair(layout(cap, slot));
            let mut next_push = 0u64;
            let mut next_pop = 0u64;
            let mut batch = 1;
            while next_pop < 20_000 {
                for _ in 0..batch {
                    match p.try_push(|b| fill_pattern(b, next_push)) {
                        Ok(wake) => {
                            assert!(!wake);
                            next_push += 1;
                        }
                        Err(RingError::Full) => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                while let Some(seq) = c.try_pop(|b| check_pattern(b, slot as usize)).unwrap() {
                    assert_eq!(seq, next_pop);
                    next_pop += 1;
                }
                assert!(p.is_empty());
                batch = batch % (cap as usize + 1) + 1;
            }
            assert_eq!(next_push, next_pop);
        }
    }

    #[test]
    fn full_at_capacity() {
        let (mut p, mut c) = heap_pair(layout(8, 64));
        assert_eq!(p.free_slots(), 8);
        for i in 0..8 {
            p.try_push(|b| b[0] = i).unwrap();
        }
        assert_eq!(p.free_slots(), 0);
        assert_eq!(p.try_push(|_| panic!("must not be called when full")), Err(RingError::Full));
        assert_eq!(c.len(), Ok(8));
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(0)));
        assert_eq!(p.free_slots(), 1); // looked full: tail re-read
        p.try_push(|b| b[0] = 8).unwrap();
        assert_eq!(p.try_push(|_| ()), Err(RingError::Full));
        for i in 1..=8 {
            assert_eq!(c.try_pop(|b| b[0]), Ok(Some(i)));
        }
        assert_eq!(c.try_pop(|b| b[0]), Ok(None));
    }

    #[test]
    fn empty_and_staging_is_zeroed() {
        let (mut p, mut c) = heap_pair(layout(2, 128));
        assert_eq!(c.try_pop(|_| ()), Ok(None));
        assert_eq!(c.len(), Ok(0));
        assert!(p.is_empty());
        p.try_push(|b| b.fill(0xff)).unwrap();
        assert!(!p.is_empty());
        assert_eq!(c.len(), Ok(1));
        assert_eq!(c.try_pop(|b| b.iter().all(|&x| x == 0xff)), Ok(Some(true)));
        assert!(p.is_empty());
        // Next pushes reuse slots that held 0xff: fill must see zeroes.
        for _ in 0..4 {
            p.try_push(|b| {
                assert_eq!(b.len(), 128);
                assert!(b.iter().all(|&x| x == 0));
                b[5] = 5;
            })
            .unwrap();
            assert_eq!(c.try_pop(|b| (b.len(), b[5], b[6])), Ok(Some((128, 5, 0))));
        }
        assert_eq!(c.try_pop(|_| ()), Ok(None));
    }

    #[test]
    fn close_flags() {
        let (mut p, mut c) = heap_pair(layout(4, 64));
        assert!(!p.peer_closed() && !c.peer_closed());
        p.try_push(|b| b[0] = 1).unwrap();
        p.try_push(|b| b[0] = 2).unwrap();
        p.close();
        assert_eq!(p.try_push(|_| ()), Err(RingError::Closed));
        assert!(c.peer_closed());
        assert!(!p.peer_closed());
        assert!(!c.prepare_sleep() || c.len() == Ok(2));
        // Items pushed before close are still delivered.
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(1)));
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(2)));
        assert_eq!(c.try_pop(|b| b[0]), Ok(None));
        assert!(!c.prepare_sleep(), "must not sleep on a closed producer");
        assert_eq!(c.sleep_word().load(SeqCst), 0);

        let (mut p, mut c) = heap_pair(layout(4, 64));
        c.close();
        assert!(p.peer_closed());
        assert_eq!(p.try_push(|_| ()), Err(RingError::Closed));

        let (p, c) = heap_pair(layout(4, 64));
        drop(c);
        assert!(p.peer_closed());
        let (p, c) = heap_pair(layout(4, 64));
        drop(p);
        assert!(c.peer_closed());
    }

    #[test]
    fn attach_validates() {
        let l = layout(16, 128);
        let mem = heap(l);
        // Never initialised: no magic.
        assert!(matches!(attach_consumer(mem.clone(), l), Err(RingError::Corrupt(_))));
        assert!(matches!(attach_producer(mem.clone(), l), Err(RingError::Corrupt(_))));

        let (mut p, c) = create(mem.clone(), l).unwrap();
        for i in 0..3 {
            p.try_push(|b| b[0] = i).unwrap();
        }
        // A second handle on each end (in real use: the other process).
        let mut c2 = attach_consumer(mem.clone(), l).unwrap();
        assert_eq!(c2.layout(), l);
        assert_eq!(c2.len(), Ok(3));
        assert_eq!(c2.try_pop(|b| b[0]), Ok(Some(0)));
        let mut p2 = attach_producer(mem.clone(), l).unwrap();
        assert_eq!(p2.layout(), l);
        // p2 starts at the published head and sees c2's tail.
        p2.try_push(|b| b[0] = 3).unwrap();
        for i in 1..=3 {
            assert_eq!(c2.try_pop(|b| b[0]), Ok(Some(i)));
        }
        assert_eq!(p2.free_slots(), 13); // head 4, cached tail 1 (read at attach)
        assert!(p2.is_empty());

        // Layout mismatches.
        assert!(matches!(attach_consumer(mem.clone(), layout(8, 128)), Err(RingError::BadLayout(_))));
        assert!(matches!(attach_consumer(mem.clone(), layout(16, 64)), Err(RingError::BadLayout(_))));
        assert!(matches!(attach_producer(mem.clone(), layout(32, 128)), Err(RingError::BadLayout(_))));
        // Region too small for the layout.
        let small: Arc<dyn RingMemory> = Arc::new(HeapRegion::new(l.region_size() - 1));
        assert!(matches!(attach_consumer(small.clone(), l), Err(RingError::BadLayout(_))));
        assert!(matches!(create(small, l), Err(RingError::BadLayout(_))));
        // Misaligned region.
        struct Offset(Arc<dyn RingMemory>);
        impl RingMemory for Offset {
            fn as_ptr(&self) -> *mut u8 {
                self.0.as_ptr().wrapping_add(64)
            }
            fn len(&self) -> usize {
                self.0.len() - 64
            }
        }
        let big = heap(layout(32, 128));
        assert!(matches!(create(Arc::new(Offset(big)), l), Err(RingError::BadLayout(_))));
        // Bad version, bad magic.
        poke_u32(&mem, VERSION_OFF, 2);
        assert!(matches!(attach_consumer(mem.clone(), l), Err(RingError::BadLayout(_))));
        poke_u32(&mem, VERSION_OFF, VERSION);
        poke_u32(&mem, MAGIC_OFF, 0xdead_beef);
        assert!(matches!(attach_producer(mem.clone(), l), Err(RingError::Corrupt(_))));
        poke_u32(&mem, MAGIC_OFF, MAGIC);
        // Inconsistent counters at attach time.
        poke_u64(&mem, HEAD_OFF, 1 << 40);
        assert!(matches!(attach_consumer(mem.clone(), l), Err(RingError::Corrupt(_))));
        assert!(matches!(attach_producer(mem.clone(), l), Err(RingError::Corrupt(_))));
        drop((p, c, p2, c2));
    }

    #[test]
    fn corrupt_head_is_reported_not_panicking() {
        let l = layout(8, 64);
        let mem = heap(l);
        let (mut p, mut c) = create(mem.clone(), l).unwrap();

        // Head far ahead of tail.
        poke_u64(&mem, HEAD_OFF, u64::MAX / 2);
        assert!(matches!(c.try_pop(|_| ()), Err(RingError::Corrupt(_))));
        assert!(matches!(c.len(), Err(RingError::Corrupt(_))));
        assert!(!c.prepare_sleep());
        poke_u64(&mem, HEAD_OFF, 9); // capacity + 1
        assert!(matches!(c.try_pop(|_| ()), Err(RingError::Corrupt(_))));
        poke_u64(&mem, HEAD_OFF, 0); // restored: consistent again
        assert_eq!(c.try_pop(|_| ()), Ok(None));

        // Head behind tail.
        for i in 0..3 {
            p.try_push(|b| b[0] = i).unwrap();
        }
        for i in 0..3 {
            assert_eq!(c.try_pop(|b| b[0]), Ok(Some(i)));
        }
        poke_u64(&mem, HEAD_OFF, 1);
        assert_eq!(c.try_pop(|_| ()), Err(RingError::Corrupt("ring head is behind tail")));
        poke_u64(&mem, HEAD_OFF, u64::MAX); // "behind" by wrapping, too
        assert_eq!(c.try_pop(|_| ()), Err(RingError::Corrupt("ring head is behind tail")));

        // Head went backwards but is still ahead of tail.
        poke_u64(&mem, HEAD_OFF, 3);
        p.try_push(|b| b[0] = 3).unwrap();
        p.try_push(|b| b[0] = 4).unwrap();
        assert_eq!(c.len(), Ok(2));
        poke_u64(&mem, HEAD_OFF, 4);
        assert_eq!(c.len(), Err(RingError::Corrupt("ring head went backwards")));
        poke_u64(&mem, HEAD_OFF, 5);
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(3)));

        // Corrupt tail seen by the producer (only read when it looks full).
        while p.try_push(|_| ()).is_ok() {}
        let real_tail = peek_u64(&mem, TAIL_OFF);
        poke_u64(&mem, TAIL_OFF, u64::MAX / 3);
        assert!(matches!(p.try_push(|_| ()), Err(RingError::Corrupt(_))));
        assert_eq!(p.free_slots(), 0);
        poke_u64(&mem, TAIL_OFF, real_tail - 1); // backwards
        assert!(matches!(p.try_push(|_| ()), Err(RingError::Corrupt(_))));
        poke_u64(&mem, TAIL_OFF, real_tail);
        assert_eq!(p.try_push(|_| ()), Err(RingError::Full));
    }

    /// xorshift64*: a tiny deterministic PRNG for the scribbling peer.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    fn scribble(mem: &Arc<dyn RingMemory>, rng: &mut Rng) {
        let words = mem.len() / 8;
        let r = rng.next();
        let off = (r as usize % words) * 8;
        let val = match r >> 60 {
            0 => 0,
            1 => u64::MAX,
            2..=5 => rng.next() % 32,
            _ => rng.next(),
        };
        poke_u64(mem, off, val);
    }

    #[test]
    fn garbage_peer_never_panics() {
        let l = layout(4, 64);
        let mem = heap(l);
        let (mut p, mut c) = create(mem.clone(), l).unwrap();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut corrupt = 0;
        for i in 0..200_000u32 {
            // Scribble mostly on the hot header words.
            if rng.next() % 2 == 0 {
                let off = [HEAD_OFF, TAIL_OFF, SLEEPING_OFF, CLOSED_OFF, MAGIC_OFF][(rng.next() % 5) as usize];
                poke_u64(&mem, off, rng.next() % 16);
            } else {
                scribble(&mem, &mut rng);
            }
            let results = [
                p.try_push(|b| b[0] = i as u8).map(|_| ()),
                p.stage(|b| b[0] = i as u8),
                c.try_pop(|b| assert_eq!(b.len(), 64)).map(|_| ()),
                c.len().map(|_| ()),
            ];
            if i % 3 == 0 {
                let _ = p.publish();
            }
            assert!(p.staged() <= 4);
            corrupt += results.iter().filter(|r| matches!(r, Err(RingError::Corrupt(_)))).count();
            let _ = (p.free_slots(), p.is_empty(), p.peer_closed(), c.peer_closed());
            if c.prepare_sleep() {
                c.cancel_sleep();
            }
            let _ = attach_consumer(mem.clone(), l).map(|mut c| c.try_pop(|_| ()));
            let _ = attach_producer(mem.clone(), l).map(|mut p| p.try_push(|_| ()));
        }
        assert!(corrupt > 0, "the scribbler should have been noticed");
    }

    #[test]
    fn garbage_peer_concurrently_never_panics() {
        let l = layout(8, 128);
        let mem = heap(l);
        let (mut p, mut c) = create(mem.clone(), l).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let scribbler = {
            let (mem, stop) = (mem.clone(), stop.clone());
            thread::spawn(move || {
                let mut rng = Rng(12345);
                while !stop.load(SeqCst) {
                    scribble(&mem, &mut rng);
                    thread::yield_now();
                }
            })
        };
        let pusher = thread::spawn(move || {
            for i in 0..100_000u32 {
                let _ = p.try_push(|b| b[..4].copy_from_slice(&i.to_le_bytes()));
            }
        });
        for _ in 0..100_000 {
            let _ = c.try_pop(|b| assert_eq!(b.len(), 128));
            let _ = c.len();
        }
        pusher.join().unwrap();
        stop.store(true, SeqCst);
        scribbler.join().unwrap();
    }

    #[test]
    fn threaded_million_items() {
        const N: u64 = 1_000_000;
        let (mut p, mut c) = heap_pair(layout(1024, 64));
        let producer = thread::spawn(move || {
            let mut seq = 0;
            while seq < N {
                match p.try_push(|b| fill_pattern(b, seq)) {
                    Ok(_) => seq += 1,
                    Err(RingError::Full) => std::hint::spin_loop(),
                    Err(e) => panic!("{e}"),
                }
                if seq % 4096 == 0 {
                    thread::yield_now();
                }
            }
        });
        let mut expect = 0;
        let mut idle = 0u32;
        while expect < N {
            match c.try_pop(|b| check_pattern(b, 64)).unwrap() {
                Some(seq) => {
                    assert_eq!(seq, expect);
                    expect += 1;
                }
                None => {
                    idle += 1;
                    if idle % 64 == 0 {
                        thread::yield_now();
                    }
                }
            }
        }
        producer.join().unwrap();
        assert_eq!(c.try_pop(|_| ()), Ok(None));
        assert!(c.peer_closed()); // producer dropped
    }

    #[test]
    fn staged_slots_are_published_together() {
        let (mut p, mut c) = heap_pair(layout(4, 64));
        for i in 0..3 {
            p.stage(|b| b[0] = i).unwrap();
        }
        assert_eq!(p.staged(), 3);
        assert_eq!(c.len(), Ok(0), "staged slots are not visible yet");
        assert_eq!(c.try_pop(|b| b[0]), Ok(None));
        assert_eq!(p.free_slots(), 1, "staged slots take room");
        assert!(!p.publish(), "consumer awake: no wake-up");
        assert_eq!(p.staged(), 0);
        assert!(!p.publish(), "nothing new to publish");
        assert_eq!(c.len(), Ok(3));
        p.stage(|b| b[0] = 3).unwrap();
        assert_eq!(p.stage(|_| panic!("must not be called when full")), Err(RingError::Full));
        for i in 0..3 {
            assert_eq!(c.try_pop(|b| b[0]), Ok(Some(i)));
        }
        assert_eq!(c.try_pop(|b| b[0]), Ok(None));
        // try_push publishes the staged slot with its own.
        assert_eq!(p.try_push(|b| b[0] = 4), Ok(false));
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(3)));
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(4)));
        assert!(p.is_empty());
    }

    #[test]
    fn one_wake_up_per_published_batch() {
        let (mut p, mut c) = heap_pair(layout(8, 64));
        assert!(c.prepare_sleep());
        for i in 0..3 {
            p.stage(|b| b[0] = i).unwrap();
        }
        assert_eq!(c.sleep_word().load(SeqCst), 1, "staging alone does not touch the flag");
        assert!(p.publish(), "the consumer sleeps: wake it");
        assert_eq!(c.sleep_word().load(SeqCst), 0);
        p.stage(|b| b[0] = 3).unwrap();
        assert!(!p.publish(), "one wake-up per sleep");
        c.cancel_sleep();
        assert_eq!(c.len(), Ok(4));
    }

    #[test]
    fn close_publishes_staged_slots() {
        let (mut p, mut c) = heap_pair(layout(4, 64));
        p.stage(|b| b[0] = 7).unwrap();
        p.stage(|b| b[0] = 8).unwrap();
        drop(p); // closes
        assert!(c.peer_closed());
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(7)));
        assert_eq!(c.try_pop(|b| b[0]), Ok(Some(8)));
        assert_eq!(c.try_pop(|b| b[0]), Ok(None));
    }

    /// A consumer cannot have taken what was only staged: a tail beyond the
    /// published head is corrupt even if it is within the staged one.
    #[test]
    fn tail_beyond_published_head_is_corrupt() {
        let l = layout(4, 64);
        let mem = heap(l);
        let (mut p, _c) = create(mem.clone(), l).unwrap();
        p.try_push(|_| ()).unwrap();
        p.try_push(|_| ()).unwrap();
        p.stage(|_| ()).unwrap();
        p.stage(|_| ()).unwrap();
        poke_u64(&mem, TAIL_OFF, 3);
        assert!(matches!(p.stage(|_| ()), Err(RingError::Corrupt(_))));
        poke_u64(&mem, TAIL_OFF, 2);
        assert_eq!(p.stage(|_| ()), Ok(()));
    }

    #[test]
    fn sleep_handshake_basics() {
        let (mut p, mut c) = heap_pair(layout(4, 64));
        assert!(c.prepare_sleep());
        assert_eq!(c.sleep_word().load(SeqCst), 1);
        assert_eq!(p.sleep_word().load(SeqCst), 1);
        assert_eq!(p.try_push(|_| ()), Ok(true)); // consumer asleep: wake it
        assert_eq!(c.sleep_word().load(SeqCst), 0); // and the futex word is cleared
        assert_eq!(p.try_push(|_| ()), Ok(false)); // only one wake per sleep
        c.cancel_sleep();
        assert!(!c.prepare_sleep()); // work available
        assert_eq!(c.sleep_word().load(SeqCst), 0);
        assert_eq!(c.try_pop(|_| ()), Ok(Some(())));
        assert_eq!(c.try_pop(|_| ()), Ok(Some(())));
        assert!(c.prepare_sleep());
        c.cancel_sleep();
        assert_eq!(p.try_push(|_| ()), Ok(false)); // awake again: no wake
        assert_eq!(c.try_pop(|_| ()), Ok(Some(())));
        assert!(c.prepare_sleep());
        p.close(); // clears the word too
        assert_eq!(c.sleep_word().load(SeqCst), 0);
        c.cancel_sleep();
        assert!(!c.prepare_sleep());
    }

    /// The intended futex use: a lost wake-up shows up as a wait that times
    /// out while an item is ready.
    #[test]
    fn futex_sleep_wake_threaded() {
        use rustix::thread::futex;
        const N: u64 = 200_000;
        let (mut p, mut c) = heap_pair(layout(16, 64));
        let producer = thread::spawn(move || {
            let mut wakes = 0u64;
            let mut seq = 0;
            while seq < N {
                match p.try_push(|b| b[..8].copy_from_slice(&seq.to_le_bytes())) {
                    Ok(wake) => {
                        seq += 1;
                        if wake {
                            wakes += 1;
                            futex::wake(p.sleep_word(), futex::Flags::PRIVATE, 1).unwrap();
                        }
                    }
                    Err(RingError::Full) => thread::yield_now(),
                    Err(e) => panic!("{e}"),
                }
                if seq % 64 == 0 {
                    thread::yield_now(); // let the consumer run dry and sleep
                }
            }
            p.close();
            futex::wake(p.sleep_word(), futex::Flags::PRIVATE, 1).unwrap();
            wakes
        });
        let timeout = futex::Timespec { tv_sec: 5, tv_nsec: 0 };
        let (mut expect, mut sleeps, mut prepares, mut done) = (0u64, 0u64, 0u64, false);
        while !done {
            if let Some(seq) = c.try_pop(|b| u64::from_le_bytes(b[..8].try_into().unwrap())).unwrap() {
                assert_eq!(seq, expect);
                expect += 1;
                continue;
            }
            if c.peer_closed() {
                while let Some(seq) = c.try_pop(|b| u64::from_le_bytes(b[..8].try_into().unwrap())).unwrap() {
                    assert_eq!(seq, expect);
                    expect += 1;
                }
                done = true;
            } else {
                prepares += 1;
                if c.prepare_sleep() {
                    sleeps += 1;
                    let r = futex::wait(c.sleep_word(), futex::Flags::PRIVATE, 1, Some(&timeout));
                    assert!(
                        !matches!(r, Err(rustix::io::Errno::TIMEDOUT)),
                        "lost wake-up: slept 5 s with {:?} items ready",
                        c.len()
                    );
                    c.cancel_sleep();
                }
            }
        }
        let wakes = producer.join().unwrap();
        assert_eq!(expect, N);
        // Every wake answers a flag set by prepare_sleep (a false return can
        // still cause one harmless spurious wake).
        assert!(wakes <= prepares, "wakes {wakes} prepares {prepares}");
        eprintln!("futex test: {prepares} prepare_sleep, {sleeps} sleeps, {wakes} wakes");
    }
}

/// loom models of the ordering protocol (the header atomics and slots live
/// in `LoomState`, see the module docs). Run with `.ci/loom.sh`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::thread;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    /// Runs `f` under loom (LOOM_MAX_PREEMPTIONS, default 3 here) and
    /// prints how many interleavings were explored.
    fn model(name: &str, f: impl Fn() + Sync + Send + 'static) {
        static ITERS: AtomicUsize = AtomicUsize::new(0);
        let mut builder = loom::model::Builder::new();
        if builder.preemption_bound.is_none() {
            builder.preemption_bound = Some(3);
        }
        ITERS.store(0, Relaxed);
        builder.check(move || {
            ITERS.fetch_add(1, Relaxed);
            f();
        });
        eprintln!("loom {name}: {} iterations", ITERS.load(Relaxed));
    }

    /// Pop `n` items (their first byte) as a blocking consumer does: when the
    /// ring is empty, declare sleep and wait as `futex_wait(word, 1)` would,
    /// until the word is not 1. A lost wake-up leaves it waiting forever,
    /// which loom reports.
    fn pop_or_sleep(c: &mut Consumer, n: usize) -> Vec<u8> {
        let mut got = Vec::new();
        while got.len() < n {
            if let Some(x) = c.try_pop(|b| b[0]).unwrap() {
                got.push(x);
            } else if c.prepare_sleep() {
                while c.sleep_word().load(Ordering::Acquire) == 1 {
                    thread::yield_now();
                }
                c.cancel_sleep();
            }
        }
        got
    }

    /// Two threads, capacity 2, three items: FIFO order and contents survive
    /// wrap-around and Full; loom's UnsafeCell slots flag any slot race.
    #[test]
    fn push_pop_fifo_capacity_2() {
        model("push_pop_fifo_capacity_2", || {
            let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
            let producer = thread::spawn(move || {
                for i in 0..3u8 {
                    loop {
                        match p.try_push(|b| {
                            b[0] = i;
                            b[63] = 100 + i;
                        }) {
                            Ok(_) => break,
                            Err(RingError::Full) => thread::yield_now(),
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            });
            for i in 0..3u8 {
                loop {
                    match c.try_pop(|b| (b[0], b[63], b.len())).unwrap() {
                        Some(got) => {
                            assert_eq!(got, (i, 100 + i, 64));
                            break;
                        }
                        None => thread::yield_now(),
                    }
                }
            }
            producer.join().unwrap();
            assert_eq!(c.try_pop(|_| ()).unwrap(), None);
        });
    }

    /// No lost wake-up: if the consumer decides to block (prepare_sleep
    /// returned true), the concurrent push must have returned needs_wake and
    /// cleared the futex word; if it decides not to block, the item must be
    /// visible. Removing either SeqCst fence makes loom find a failing
    /// interleaving.
    #[test]
    fn sleep_handshake_never_loses_wakeup() {
        model("sleep_handshake_never_loses_wakeup", || {
            let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
            let producer = thread::spawn(move || {
                let wake = p.try_push(|b| b[0] = 42).unwrap();
                (wake, p)
            });
            let blocks = c.prepare_sleep();
            let (wake, p) = producer.join().unwrap();
            if blocks {
                // The consumer would now futex_wait(word, 1): it is only
                // woken if the producer asked for a wake, and only returns at
                // once if the word is no longer 1.
                assert!(wake, "lost wake-up: consumer sleeps, producer did not wake it");
                assert_eq!(c.sleep_word().load(Ordering::Relaxed), 0);
                c.cancel_sleep();
            } else {
                assert_eq!(c.sleep_word().load(Ordering::Relaxed), 0);
            }
            assert_eq!(c.try_pop(|b| b[0]).unwrap(), Some(42));
            drop(p);
        });
    }

    /// The futex protocol end to end: the consumer blocks (modelled as
    /// "wait while the word is 1") whenever prepare_sleep says so, and the
    /// producer pushes two items (no close, which would clear the word and
    /// mask a lost wake-up). A lost wake-up leaves the consumer waiting
    /// forever, which loom reports as a failure (branch limit exceeded).
    #[test]
    fn futex_protocol_two_items() {
        model("futex_protocol_two_items", || {
            let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
            let producer = thread::spawn(move || {
                for i in 1..=2u8 {
                    // Capacity 2: never Full. A true return means "futex_wake";
                    // the swap in try_push already released the waiter.
                    let _wake = p.try_push(|b| b[0] = i).unwrap();
                }
                p
            });
            assert_eq!(pop_or_sleep(&mut c, 2), [1, 2]);
            drop(producer.join().unwrap());
        });
    }

    /// Batching: three items staged and published in two batches (one head
    /// store each) arrive in order and intact; loom's UnsafeCell slots flag
    /// a consumer read of a slot that the publication did not order after
    /// its write (every slot of a batch, not only the last).
    #[test]
    fn batched_publish_fifo() {
        model("batched_publish_fifo", || {
            let (mut p, mut c) = heap_pair(RingLayout::new(4, 64).unwrap());
            let producer = thread::spawn(move || {
                p.stage(|b| b[0] = 0).unwrap();
                p.stage(|b| {
                    b[0] = 1;
                    b[63] = 101;
                })
                .unwrap();
                let _ = p.publish();
                p.stage(|b| b[0] = 2).unwrap();
                let _ = p.publish();
                p
            });
            let mut got = Vec::new();
            while got.len() < 3 {
                match c.try_pop(|b| (b[0], b[63])).unwrap() {
                    Some(x) => got.push(x),
                    None => thread::yield_now(),
                }
            }
            assert_eq!(got, [(0, 0), (1, 101), (2, 0)]);
            drop(producer.join().unwrap());
        });
    }

    /// The futex protocol with a batch: two items staged, one publication
    /// that does the sleep handshake once. A lost wake-up leaves the
    /// consumer waiting forever.
    #[test]
    fn futex_protocol_batch() {
        model("futex_protocol_batch", || {
            let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
            let producer = thread::spawn(move || {
                p.stage(|b| b[0] = 1).unwrap();
                p.stage(|b| b[0] = 2).unwrap();
                let _wake = p.publish();
                p
            });
            assert_eq!(pop_or_sleep(&mut c, 2), [1, 2]);
            drop(producer.join().unwrap());
        });
    }

    /// Close publishes what was staged, before the closed flag: a consumer
    /// that sees the flag and then drains finds the item.
    #[test]
    fn close_publishes_staged() {
        model("close_publishes_staged", || {
            let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
            let producer = thread::spawn(move || {
                p.stage(|b| b[0] = 7).unwrap();
                p.close();
                p
            });
            let mut got = Vec::new();
            loop {
                if let Some(x) = c.try_pop(|b| b[0]).unwrap() {
                    got.push(x);
                    continue;
                }
                if c.peer_closed() {
                    while let Some(x) = c.try_pop(|b| b[0]).unwrap() {
                        got.push(x);
                    }
                    break;
                }
                thread::yield_now();
            }
            assert_eq!(got, [7]);
            drop(producer.join().unwrap());
        });
    }

    /// Same handshake with close instead of a push: a consumer that decides
    /// to block must find the futex word cleared by close.
    #[test]
    fn sleep_handshake_close() {
        model("sleep_handshake_close", || {
            let (mut p, mut c) = heap_pair(RingLayout::new(2, 64).unwrap());
            let producer = thread::spawn(move || {
                p.close();
                p
            });
            let blocks = c.prepare_sleep();
            let p = producer.join().unwrap();
            if blocks {
                assert_eq!(c.sleep_word().load(Ordering::Relaxed), 0, "lost wake-up on close");
            }
            assert!(c.peer_closed());
            drop(p);
        });
    }
}

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
