//! Volatile and secured buffers, after fbufs (Druschel and Peterson,
//! "Fbufs: A High-Bandwidth Cross-Domain Transfer Facility", SOSP 1993,
//! §3.2.4).
//!
//! A buffer a domain receives is *volatile*: under trust FULL or HALF the
//! originator may still map the memory writable (its own mapping of the
//! pool, or in another process the pool's memfd) and change the bytes while
//! the receiver reads them. A receiver that must interpret the bytes
//! (parse a header, check a length, then use it) secures the buffer first:
//! [`Buffer::secure`], [`BufferCopy::secure`], [`Aggregate::secure`]. From
//! then on the bytes it reads through the [`Secured`] cannot change.
//!
//! What the kernel enforces, per case (decided per buffer, at the call):
//!
//! * **memory nobody else can write** — the buffer's pool memory is this
//!   process's own mirror (TCP: the peer is on the other end of a socket;
//!   shm at trust NONE: the peer only ever gets a read-only, sealed fd) and
//!   no other domain of this process maps it writable (no other domain maps
//!   it, or the pool's trust is HALF/NONE, under which another domain's view
//!   of a buffer it does not own is `PROT_NONE`): secured *in place*, no
//!   byte copied.
//! * **otherwise** (shm at trust FULL/HALF, or a local pool at trust FULL
//!   mapped by the sender's domain too): the sender's writable mapping
//!   cannot be taken away. A read-only protection of the receiver's view
//!   does not stop the sender; memfd seals apply to the whole file and not
//!   to the mappings that exist already; so the bytes are *copied* into
//!   memory private to this process (anonymous memory no other process can
//!   map). The copies come from a small per-thread cache of private blocks
//!   (LIFO, like the pools), so securing costs one `memcpy` and no page
//!   faults in the steady state.
//!
//! Within one process, no mechanism stops a domain that wants to write
//! (all threads share the address space and may `mprotect` again): for the
//! local backend, securing guards against the sender's ordinary writes
//! through its own view, as trust HALF does. Between processes it is
//! kernel-enforced.

use std::cell::RefCell;
use std::ops::Deref;

use crate::aggregate::Aggregate;
use crate::buffer::{Buffer, BufferCopy};
use crate::domain::DomainShared;
use crate::error::Result;
use crate::pool::{BufferState, PoolView};

/// Whether buffer `index` of `view` in `domain` can be written by nobody
/// but this domain: then securing it needs no copy.
fn secure_in_place(domain: &DomainShared, view: &PoolView, index: u32) -> bool {
    let Some(trust) = domain.lock().entry(view.id()).map(|e| e.trust) else { return false };
    let memory = view.memory();
    if memory.maybe_written_by_other_process(trust) {
        return false;
    }
    if !memory.has_other_views(view) {
        return true;
    }
    // Another domain of this process maps the pool: under HALF (NONE has
    // no local backend) its view of a buffer it does not own read-write is
    // read-only or inaccessible; under FULL it is writable.
    trust.protects() && memory.held_elsewhere(index, view) != Some(BufferState::ReadWrite)
}

/// Blocks kept per thread for later copies: at most this many, none larger
/// than [`CACHE_BLOCK_MAX`], [`CACHE_BYTES`] in all.
const CACHE_BLOCKS: usize = 8;
const CACHE_BLOCK_MAX: usize = 4 << 20;
const CACHE_BYTES: usize = 16 << 20;

thread_local! {
    static CACHE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// A private copy: heap memory of this process, which no other process
/// can map.
struct PrivateCopy(Vec<u8>);

impl PrivateCopy {
    /// An empty block with room for `len` bytes: the most recently returned
    /// block of this thread that fits, else a new one (never zero-filled).
    fn with_room(len: usize) -> Vec<u8> {
        let cached = CACHE.with(|c| {
            let mut c = c.borrow_mut();
            let pos = c.iter().rposition(|b| b.capacity() >= len && b.capacity() <= len.saturating_mul(2))?;
            Some(c.remove(pos))
        });
        cached.unwrap_or_else(|| Vec::with_capacity(len))
    }

    fn of(parts: &[&[u8]]) -> Self {
        let len = parts.iter().map(|p| p.len()).sum();
        let mut v = Self::with_room(len);
        for p in parts {
            v.extend_from_slice(p);
        }
        PrivateCopy(v)
    }
}

impl Drop for PrivateCopy {
    fn drop(&mut self) {
        let mut v = std::mem::take(&mut self.0);
        if v.capacity() > CACHE_BLOCK_MAX {
            return;
        }
        v.clear();
        // A thread that is ending has no cache any more: the block is freed.
        let _ = CACHE.try_with(|c| {
            let mut c = c.borrow_mut();
            // The oldest blocks go first to make room.
            while !c.is_empty()
                && (c.len() == CACHE_BLOCKS || c.iter().map(Vec::capacity).sum::<usize>() + v.capacity() > CACHE_BYTES)
            {
                c.remove(0);
            }
            c.push(v);
        });
    }
}

/// What can be secured: [`Buffer`], [`BufferCopy`], [`Aggregate`].
pub trait SecureSource: sealed::Sealed {
    /// The bytes as they are now, in the pool's memory (volatile), in
    /// order: one slice, or an aggregate's fragments.
    #[doc(hidden)]
    fn volatile_bytes(&self) -> Vec<&[u8]>;
    /// The bytes as one slice in the pool's memory, if they are one.
    #[doc(hidden)]
    fn contiguous(&self) -> Option<&[u8]>;
    /// Whether no one but this domain can write the bytes.
    #[doc(hidden)]
    fn private_in_place(&self) -> bool;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::Buffer {}
    impl Sealed for crate::BufferCopy {}
    impl Sealed for crate::Aggregate {}
}

/// A single buffer handle, whole and contiguous, is secured in place when
/// its pool's memory is private to this domain.
macro_rules! secure_source_for_handle {
    ($($handle:ty),*) => {$(
        impl SecureSource for $handle {
            fn volatile_bytes(&self) -> Vec<&[u8]> {
                vec![self]
            }
            fn contiguous(&self) -> Option<&[u8]> {
                Some(self)
            }
            fn private_in_place(&self) -> bool {
                let (d, v, i) = self.parts();
                secure_in_place(d, v, i)
            }
        }
    )*};
}

secure_source_for_handle!(Buffer, BufferCopy);

impl SecureSource for Aggregate {
    fn volatile_bytes(&self) -> Vec<&[u8]> {
        self.fragments().map(|f| f.bytes()).collect()
    }
    fn contiguous(&self) -> Option<&[u8]> {
        None
    }
    fn private_in_place(&self) -> bool {
        // Fragments do not say whose memory they are in: always copied.
        false
    }
}

/// A secured buffer, copy or aggregate: reads as the bytes it held when it
/// was secured, which no other domain can change any more (see the
/// [module notes](crate::Buffer::secure) for what enforces it). The handle
/// is kept: [`into_inner`](Secured::into_inner) gives it back, to pass or
/// release it.
pub struct Secured<H: SecureSource> {
    handle: H,
    copy: Option<PrivateCopy>,
}

impl<H: SecureSource> Secured<H> {
    fn new(handle: H) -> Self {
        let in_place = handle.contiguous().is_some() && handle.private_in_place();
        let copy = if in_place { None } else { Some(PrivateCopy::of(&handle.volatile_bytes())) };
        Secured { handle, copy }
    }

    /// Whether the bytes were copied into private memory (false: secured
    /// in place, the memory is this domain's alone).
    pub fn is_copy(&self) -> bool {
        self.copy.is_some()
    }

    /// The handle, whose bytes are volatile (a sender may still change
    /// them).
    pub fn handle(&self) -> &H {
        &self.handle
    }

    /// The handle back (the private copy, if any, goes).
    pub fn into_inner(self) -> H {
        self.handle
    }
}

impl<H: SecureSource> Deref for Secured<H> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.copy {
            Some(c) => &c.0,
            // In place only for the single-slice handles (Buffer, BufferCopy).
            None => self.handle.contiguous().unwrap_or_default(),
        }
    }
}

impl<H: SecureSource> AsRef<[u8]> for Secured<H> {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl<H: SecureSource + std::fmt::Debug> std::fmt::Debug for Secured<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secured").field("handle", &self.handle).field("copy", &self.is_copy()).finish()
    }
}

impl Buffer {
    /// Secure the buffer before interpreting it (fbufs' "secure" of a
    /// volatile buffer): the [`Secured`] reads as the bytes the buffer holds
    /// now, which no other domain can change any more. In place (no copy)
    /// when the memory is this domain's alone (TCP mirrors, shm at trust
    /// NONE, a local pool no other domain can write); otherwise a copy into
    /// memory private to this process. See docs/SEMANTICS.md, "Volatile and
    /// secured buffers".
    ///
    /// ```
    /// use ferry::{Allocator, Domain, PoolConstraints};
    /// let d = Domain::new("d");
    /// let alloc = Allocator::new(&d, 1, 4096, PoolConstraints::default())?;
    /// let mut buf = alloc.alloc().unwrap();
    /// buf.as_mut_slice()?[..4].copy_from_slice(b"head");
    /// let secured = buf.secure()?;
    /// assert_eq!(&secured[..4], b"head");
    /// assert!(!secured.is_copy(), "no other domain maps this pool");
    /// let buf = secured.into_inner(); // to pass it on or drop it
    /// # drop(buf);
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn secure(self) -> Result<Secured<Buffer>> {
        Ok(Secured::new(self))
    }
}

impl BufferCopy {
    /// Secure a read-only copy before interpreting it: see
    /// [`Buffer::secure`]. (A copy's owner cannot write it through Ferry
    /// while it is out, but under trust FULL nothing stops its mapping.)
    pub fn secure(self) -> Result<Secured<BufferCopy>> {
        Ok(Secured::new(self))
    }
}

impl Aggregate {
    /// Secure an aggregate before interpreting it: its bytes, in order,
    /// copied into one block of memory private to this process (fragments
    /// do not tell whose memory they lie in, so an aggregate is always
    /// copied).
    ///
    /// ```
    /// use ferry::{Aggregate, Allocator, Domain, PoolConstraints};
    /// let alloc = Allocator::new(&Domain::new("d"), 2, 4096, PoolConstraints::default())?;
    /// let mut a = alloc.alloc().unwrap();
    /// a.as_mut_slice()?[..3].copy_from_slice(b"abc");
    /// let mut b = alloc.alloc().unwrap();
    /// b.as_mut_slice()?[..3].copy_from_slice(b"def");
    /// let agg = Aggregate::from_buffer_range(a, 0..3).unwrap().join(Aggregate::from_buffer_range(b, 0..3).unwrap());
    /// let secured = agg.secure()?;
    /// assert_eq!(&secured[..], b"abcdef");
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn secure(self) -> Result<Secured<Aggregate>> {
        Ok(Secured::new(self))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, TrustLevel};

    const T: Duration = Duration::from_secs(10);

    /// Two domains of one process over a local channel of `trust`, an
    /// allocator of `a` (two buffers of `size` bytes) assigned on it:
    /// (the allocator, `a`'s end, `b`'s end).
    fn connected(trust: TrustLevel, size: usize) -> (Allocator, Channel, Channel) {
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let ep = Endpoint::local();
        let mut tx = Channel::create(&a, &ep, ChannelSetup { trust, ..ChannelSetup::default() }).unwrap();
        let mut rx = Channel::bind(&b, &ep, BindParams::default()).unwrap();
        tx.wait_connected(T).unwrap();
        rx.wait_connected(T).unwrap();
        rx.set_pool_policy(crate::PoolPolicy::AcceptAll);
        let alloc = Allocator::new(&a, 2, size, PoolConstraints::default()).unwrap();
        tx.assign_pool(alloc.pool()).unwrap();
        assert!(rx.poll().is_none(), "accepted by the policy, quietly");
        assert!(matches!(tx.poll(), Some(Event::PoolAssigned(_))));
        (alloc, tx, rx)
    }

    /// Two domains of one process over a local channel of `trust`; `b`
    /// receives a buffer `a` moved, holding `fill`.
    fn moved(trust: TrustLevel, fill: u8) -> (Allocator, Channel, Channel, Buffer) {
        let (alloc, mut tx, mut rx) = connected(trust, 8192);
        let mut buf = alloc.alloc().unwrap();
        buf.as_mut_slice().unwrap().fill(fill);
        tx.move_buffer(buf, &[]).unwrap();
        let Some(Event::MoveReceived { buffer, .. }) = rx.poll() else { panic!() };
        (alloc, tx, rx, buffer)
    }

    /// Local, trust FULL: the sender's domain still maps the pool writable,
    /// so securing copies; the copy keeps the old bytes while the sender's
    /// view changes the volatile ones.
    #[test]
    fn full_trust_locally_is_secured_by_a_copy() {
        let (alloc, _tx, _rx, buffer) = moved(TrustLevel::Full, 7);
        let secured = buffer.secure().unwrap();
        assert!(secured.is_copy());
        // The sender writes through its own view of the pool (what a
        // misbehaving domain of trust FULL can do).
        let ptr = alloc.pool().base_address() as *mut u8;
        // SAFETY: the sender's mapping of the pool is read-write under
        // trust FULL and lives while `alloc` does; buffer 0 is 8192 bytes.
        unsafe { std::ptr::write_bytes(ptr, 9, 8192) };
        assert!(secured.handle().iter().all(|&x| x == 9), "volatile: the sender's writes show");
        assert!(secured.iter().all(|&x| x == 7), "secured: they do not");
        assert_eq!(secured.len(), 8192);
        assert!(AsRef::<[u8]>::as_ref(&secured) == &secured[..], "as_ref reads the secured bytes too");
        let shown = format!("{secured:?}");
        assert!(shown.starts_with("Secured {") && shown.ends_with("copy: true }"), "{shown}");
    }

    /// Local, trust HALF: the sender's view of a buffer it moved away is
    /// inaccessible, so the buffer is secured in place.
    #[test]
    fn half_trust_locally_is_secured_in_place() {
        let (_alloc, _tx, _rx, buffer) = moved(TrustLevel::Half, 3);
        let secured = buffer.secure().unwrap();
        assert!(!secured.is_copy());
        assert!(secured.iter().all(|&x| x == 3));
        let buffer = secured.into_inner();
        assert_eq!(buffer.len(), 8192);
    }

    /// A read-only copy: under HALF its owner's view is read-only while
    /// the copy is out, so it is secured in place; under FULL it is copied.
    /// An aggregate is always copied, its fragments in order.
    #[test]
    fn copies_and_aggregates() {
        for (trust, in_place) in [(TrustLevel::Half, true), (TrustLevel::Full, false)] {
            let (alloc, mut tx, mut rx) = connected(trust, 4096);
            let mut buf = alloc.alloc().unwrap();
            buf.as_mut_slice().unwrap()[..5].copy_from_slice(b"hello");
            tx.copy(&buf, &[]).unwrap();
            let Some(Event::CopyReceived { copy, .. }) = rx.poll() else { panic!() };
            let secured = copy.secure().unwrap();
            assert_eq!((secured.is_copy(), &secured[..5]), (!in_place, &b"hello"[..]), "{trust:?}");
            let first = secured.into_inner();
            tx.copy(&buf, &[]).unwrap();
            let Some(Event::CopyReceived { copy: second, .. }) = rx.poll() else { panic!() };
            let agg = Aggregate::from_copy_range(first, 1..5)
                .unwrap()
                .join(Aggregate::from_copy_range(second, 0..1).unwrap());
            let s = agg.secure().unwrap();
            assert!(s.is_copy());
            assert_eq!(&s[..], b"elloh");
        }
        let empty = Aggregate::new().secure().unwrap();
        assert!(empty.is_empty());
    }

    /// Blocks come back to the thread's cache and are reused, never more
    /// than the cache holds.
    #[test]
    fn private_blocks_are_recycled() {
        let a = PrivateCopy::of(&[b"abc", b"de"]);
        assert_eq!(&a.0[..], b"abcde");
        let (p, capacity) = (a.0.as_ptr(), a.0.capacity());
        drop(a);
        // A block of the same size asked of the allocator meanwhile: the
        // cache keeps the returned one (the allocator would hand it out).
        let other = Vec::<u8>::with_capacity(capacity);
        let b = PrivateCopy::of(&[b"xyz"]);
        assert_eq!((b.0.as_ptr(), &b.0[..]), (p, &b"xyz"[..]), "the block just returned");
        assert_ne!(other.as_ptr(), p);
        let many: Vec<_> = (0..20).map(|_| PrivateCopy::of(&[&[1u8; 100][..]])).collect();
        drop(many);
        assert_eq!(CACHE.with(|c| c.borrow().len()), CACHE_BLOCKS, "full, and no fuller");
        // Blocks of 3 MiB are kept (up to 4 MiB are), as many as fit in
        // the cache's bytes.
        let big = vec![7u8; 3 << 20];
        let large: Vec<_> = (0..8).map(|_| PrivateCopy::of(&[&big[..]])).collect();
        drop(large);
        let kept = CACHE.with(|c| c.borrow().iter().map(Vec::capacity).sum::<usize>());
        assert_eq!(kept, CACHE_BYTES / (3 << 20) * (3 << 20), "as many 3 MiB blocks as fit");
    }

    /// A cached block is taken only by a copy it suits (at least as large,
    /// at most twice as large); blocks up to [`CACHE_BLOCK_MAX`] are kept,
    /// larger ones freed, up to [`CACHE_BYTES`] in all.
    #[test]
    fn private_blocks_are_reused_only_where_they_fit() {
        let cached = || CACHE.with(|c| c.borrow().iter().map(Vec::capacity).collect::<Vec<_>>());
        drop(PrivateCopy::of(&[&[1u8; 100][..]]));
        assert_eq!(cached(), [100]);
        let larger = PrivateCopy::of(&[&[2u8; 1000][..]]);
        let tiny = PrivateCopy::of(&[&[3u8; 10][..]]);
        assert_eq!(cached(), [100], "too small for the one, more than twice the other");
        drop((larger, tiny));
        let half = PrivateCopy::of(&[&[4u8; 50][..]]);
        assert_eq!(half.0.capacity(), 100, "twice as large fits");
        drop(half);
        CACHE.with(|c| c.borrow_mut().clear());
        let largest = vec![5u8; CACHE_BLOCK_MAX + 1];
        let fit = CACHE_BYTES / CACHE_BLOCK_MAX;
        let mut copies: Vec<_> = (0..fit).map(|_| PrivateCopy::of(&[&largest[..CACHE_BLOCK_MAX]])).collect();
        copies.push(PrivateCopy::of(&[&largest[..]]));
        drop(copies);
        assert_eq!(cached(), vec![CACHE_BLOCK_MAX; fit], "the largest blocks kept, up to the cache's bytes exactly");
    }
}
