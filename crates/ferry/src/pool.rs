//! Pools: contiguous ranges of equal-sized buffers backed by one `memfd`
//! ([ETH-BT] §4.2.5, §6.2.4).
//!
//! A pool's memory is a [`PoolMemory`] (the memfd, shareable with other
//! processes). Each domain that knows the pool maps it once into a
//! [`PoolView`]; buffer *i* of a view lives at `base + i * buffer_size`, so
//! id ↔ address is arithmetic both ways. Each domain has its own view so that
//! protection changes (trust HALF) in one domain never affect another, even
//! when both live in one process (the local backend).

use crate::ErrorKind;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::error::{Error, Result};
use crate::ledger::Ledger;
use crate::sys::{self, Access, Mapping};

/// Globally unique pool identifier: 128 random bits made at allocation.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(u128);

impl PoolId {
    pub(crate) fn random() -> Self {
        PoolId(sys::random_u128())
    }

    /// The id as a number (for wire formats and logs).
    pub fn as_u128(self) -> u128 {
        self.0
    }

    /// Rebuild an id received from a peer.
    pub fn from_u128(v: u128) -> Self {
        PoolId(v)
    }
}

/// Hasher for maps keyed by [`PoolId`]: the ids are 128 random bits
/// already, so their low 64 bits are a perfectly good hash (SipHash of a
/// u128 showed up at 7% of a throughput profile).
#[derive(Default, Clone, Copy)]
pub(crate) struct PoolIdHasher(u64);

impl std::hash::Hasher for PoolIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u128 keys; fold the bytes in.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 ^= v as u64;
    }
}

/// `HashMap` keyed by pool ids.
pub(crate) type PoolMap<V> = std::collections::HashMap<PoolId, V, std::hash::BuildHasherDefault<PoolIdHasher>>;

impl fmt::Debug for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PoolId({self})")
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Short form: 16 hex digits folding all 128 bits, so ids that differ
        // anywhere (random ones, and small ones made with `from_u128`)
        // print differently; the full 32 digits when the fold would be zero.
        let fold = (self.0 >> 64) as u64 ^ self.0 as u64;
        if fold == 0 && self.0 != 0 {
            write!(f, "{:032x}", self.0)
        } else {
            write!(f, "{fold:016x}")
        }
    }
}

/// Names one buffer: its pool and its index in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId {
    /// The pool.
    pub pool: PoolId,
    /// Index of the buffer in its pool.
    pub index: u32,
}

/// `buffer 3 of pool 00000000000000a1`.
impl fmt::Display for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "buffer {} of pool {}", self.index, self.pool)
    }
}

/// Per-domain state of a buffer ([ETH-BT] §5.1.1, Listing 6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum BufferState {
    /// Not present in this domain.
    Invalid = 0,
    /// A read-only copy held by this domain.
    ReadOnly = 1,
    /// Owned by this domain, read-only because copies are out.
    ReadOnlyOwned = 2,
    /// Owned by this domain, readable and writable.
    ReadWrite = 3,
}

/// Trust levels of channels and pools ([ETH-BT] §4.2.4, Listing 6.1).
///
/// A channel's trust is set by its creator ([`ChannelSetup::trust`](crate::ChannelSetup::trust));
/// a pool takes the trust of the first channel it is assigned to (or is
/// fixed by [`PoolConstraints::trust`]) and can then travel only on
/// channels of that trust.
///
/// ```
/// use std::time::Duration;
/// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Error, ErrorKind, PoolConstraints, TrustLevel};
///
/// // HALF: the sender's own view of a buffer it moved is inaccessible until
/// // it comes back (a guard against accidents, not against the peer).
/// let (a, b) = (Domain::new("a"), Domain::new("b"));
/// let ep = Endpoint::local();
/// let mut tx = Channel::create(&a, &ep, ChannelSetup { trust: TrustLevel::Half, ..ChannelSetup::default() })?;
/// let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
/// tx.wait_connected(Duration::from_secs(10))?;
/// rx.wait_connected(Duration::from_secs(10))?;
/// assert_eq!(rx.trust(), TrustLevel::Half);
///
/// // A pool fixed at FULL cannot be assigned to this channel.
/// let full = PoolConstraints { trust: TrustLevel::Full, ..PoolConstraints::default() };
/// let alloc = Allocator::new(&a, 2, 4096, full)?;
/// assert_eq!(
///     tx.assign_pool(alloc.pool()),
///     Err(ErrorKind::TrustMismatch { pool: TrustLevel::Full, channel: TrustLevel::Half }.into())
/// );
/// // Trust NONE needs two processes: one address space cannot be protected from itself.
/// let none = ChannelSetup { trust: TrustLevel::None, ..ChannelSetup::default() };
/// assert!(matches!(Channel::create(&a, &Endpoint::local(), none).map_err(ferry::Error::into_kind), Err(ErrorKind::TrustNotSupported { .. })));
/// # Ok::<(), ferry::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TrustLevel {
    /// Only for pools not yet assigned to any channel.
    Uninitialized,
    /// No trust: protection enforced by the kernel (shared-memory and TCP
    /// backends; each side has memory the other cannot write).
    None,
    /// Protection applied in the sender's own process against accidents.
    Half,
    /// No protection changes at all.
    Full,
}

impl TrustLevel {
    pub(crate) fn to_u8(self) -> u8 {
        match self {
            TrustLevel::Uninitialized => 0,
            TrustLevel::None => 1,
            TrustLevel::Half => 2,
            TrustLevel::Full => 3,
        }
    }

    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => TrustLevel::Uninitialized,
            1 => TrustLevel::None,
            2 => TrustLevel::Half,
            3 => TrustLevel::Full,
            _ => return None,
        })
    }

    /// Whether buffer state changes are mirrored by page protections.
    pub(crate) fn protects(self) -> bool {
        matches!(self, TrustLevel::Half | TrustLevel::None)
    }
}

/// Shape of a pool: `count` buffers of `buffer_size` bytes each.
///
/// ```
/// use ferry::{Error, ErrorKind, Geometry};
/// let g = Geometry::new(64 << 10, 16)?;
/// assert_eq!((g.buffer_size(), g.count(), g.len()), (65536, 16, 1 << 20));
/// // The buffer size is a power of two, at least a page; there is a buffer.
/// assert!(matches!(Geometry::new(5000, 16).map_err(ferry::Error::into_kind), Err(ErrorKind::BadBufferSize { .. })));
/// assert!(matches!(Geometry::new(4096, 0).map_err(ferry::Error::into_kind), Err(ErrorKind::BadBufferCount { .. })));
/// # Ok::<(), ferry::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Geometry {
    buffer_size: usize,
    count: u32,
}

/// Largest pool Ferry maps: 1 TiB of address space.
const MAX_POOL_BYTES: u64 = 1 << 40;

impl Geometry {
    /// Validate a geometry: the buffer size is a power of two and a multiple
    /// of the page size; there is at least one buffer; the pool fits in 1 TiB.
    pub fn new(buffer_size: usize, count: u64) -> Result<Self> {
        let page = sys::page_size();
        if !buffer_size.is_power_of_two() || buffer_size < page {
            return Err(ErrorKind::BadBufferSize { size: buffer_size, page }.into());
        }
        let max = (MAX_POOL_BYTES / buffer_size as u64).min(u64::from(u32::MAX));
        if count == 0 || count > max {
            return Err(ErrorKind::BadBufferCount { count, max }.into());
        }
        Ok(Geometry { buffer_size, count: count as u32 })
    }

    /// Bytes per buffer.
    pub fn buffer_size(&self) -> usize {
        self.buffer_size
    }

    /// Number of buffers.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Bytes in the whole pool.
    pub fn len(&self) -> usize {
        self.buffer_size * self.count as usize
    }

    /// Never true: a pool has at least one buffer.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Constraints on a new pool ([ETH-BT] §6.4.1), given to [`Allocator::new`](crate::Allocator::new).
///
/// ```
/// use ferry::{Allocator, Domain, PoolConstraints, TrustLevel};
/// let d = Domain::new("d");
/// // Buffers at 2 MiB boundaries (huge-page friendly), trust fixed at HALF.
/// let c = PoolConstraints { trust: TrustLevel::Half, alignment: 2 << 20 };
/// let alloc = Allocator::new(&d, 4, 2 << 20, c)?;
/// assert_eq!(alloc.pool().base_address() % (2 << 20), 0);
/// assert_eq!(d.pool_trust(alloc.pool().id()), Some(TrustLevel::Half));
/// # Ok::<(), ferry::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConstraints {
    /// Trust level fixed now, or `Uninitialized` to take the trust of the
    /// first channel the pool is assigned to.
    pub trust: TrustLevel,
    /// Alignment of every buffer's address in the creating domain (a power of
    /// two ≤ buffer size; 0 means page alignment).
    pub alignment: usize,
}

impl Default for PoolConstraints {
    fn default() -> Self {
        PoolConstraints { trust: TrustLevel::Uninitialized, alignment: 0 }
    }
}

/// The memory of a pool: a memfd of `geometry.len()` bytes. Shared by every
/// view of the pool in this process; sent to other processes as an fd.
#[derive(Debug)]
pub(crate) struct PoolMemory {
    id: PoolId,
    geometry: Geometry,
    fd: OwnedFd,
    /// Once the memory is readable by an untrusted peer (trust NONE), the
    /// file is sealed against new writable mappings, and every writable
    /// mapping this process makes later is a duplicate of this one.
    writer: Mutex<Option<Mapping>>,
    /// The custody ledger every process sharing the pool maps (made when
    /// first needed: a pool that never leaves its process needs none).
    ledger: OnceLock<Ledger>,
    /// The views of this memory in this process's domains: a buffer that
    /// lands from another process must not be one a domain here holds.
    views: Mutex<Vec<Weak<PoolView>>>,
    /// The fd came from another process (which can write the memory).
    from_peer: bool,
}

impl PoolMemory {
    pub(crate) fn create(geometry: Geometry) -> Result<Arc<Self>> {
        Self::mirror(PoolId::random(), geometry, None)
    }

    /// Memory of our own for a pool that another process has too, under the
    /// pool's own id and geometry: a pool from another machine (network
    /// backend), or from a peer of trust NONE, which shares no memory
    /// writable. `ledger` is the pool's ledger if the peer shared it.
    pub(crate) fn mirror(id: PoolId, geometry: Geometry, ledger: Option<Ledger>) -> Result<Arc<Self>> {
        let fd = sys::memfd(&format!("ferry-pool-{id}"), geometry.len())?;
        // A pool never changes size: sealed so, no process it is shared with
        // can shrink it under another's mappings (which would SIGBUS them).
        sys::seal_size(&fd)?;
        Ok(Self::new(id, geometry, fd, ledger))
    }

    fn new(id: PoolId, geometry: Geometry, fd: OwnedFd, ledger: Option<Ledger>) -> Arc<Self> {
        let ledger = ledger.map_or_else(OnceLock::new, OnceLock::from);
        Arc::new(PoolMemory {
            id,
            geometry,
            fd,
            writer: Mutex::new(None),
            ledger,
            views: Mutex::default(),
            from_peer: false,
        })
    }

    /// A pool received from a peer as an fd: accepted only if it is a
    /// memfd of exactly the announced size, sealed against resizing.
    pub(crate) fn from_peer(id: PoolId, geometry: Geometry, fd: OwnedFd, ledger: Option<Ledger>) -> Result<Arc<Self>> {
        sys::check_sealed_size(&fd, geometry.len())
            .map_err(|why| ErrorKind::Protocol(format!("pool {id} received with a bad fd: {why}")))?;
        let mut memory = Self::new(id, geometry, fd, ledger);
        Arc::get_mut(&mut memory).expect("just made").from_peer = true;
        Ok(memory)
    }

    /// Whether another process may be able to write this memory: it came
    /// from one, or it has a custody ledger (made when the pool is first
    /// shared with another process, or copied across one) — unless the
    /// pool's trust is NONE, whose memory no other process ever gets
    /// writable (see `read_only_fd`). Conservative: a pool that merely has
    /// a ledger counts as shared.
    pub(crate) fn maybe_written_by_other_process(&self, trust: TrustLevel) -> bool {
        trust != TrustLevel::None && (self.from_peer || self.ledger.get().is_some())
    }

    /// Whether a view of this memory other than `ours` is alive in this
    /// process (another domain maps the pool).
    pub(crate) fn has_other_views(&self, ours: &PoolView) -> bool {
        let views = self.views.lock().unwrap_or_else(|e| e.into_inner());
        views.iter().filter_map(Weak::upgrade).any(|v| !std::ptr::eq(Arc::as_ptr(&v), ours))
    }

    /// The pool's custody ledger (see [`crate::ledger`]), made now if the
    /// pool had none yet.
    pub(crate) fn ledger(&self) -> Result<&Ledger> {
        if let Some(l) = self.ledger.get() {
            return Ok(l);
        }
        // Two threads may both make one; the first set wins, and nobody
        // has seen the other.
        let _ = self.ledger.set(Ledger::create(self.geometry.count())?);
        Ok(self.ledger.get().expect("set above"))
    }

    /// The strongest state buffer `index` has in a view of this memory other
    /// than `ours` (another domain of this process), if any holds it.
    pub(crate) fn held_elsewhere(&self, index: u32, ours: &PoolView) -> Option<BufferState> {
        let views = self.views.lock().unwrap_or_else(|e| e.into_inner());
        views
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|v| !std::ptr::eq(Arc::as_ptr(v), ours))
            .map(|v| v.state(index))
            .filter(|&s| s != BufferState::Invalid)
            .max_by_key(|&s| s as u8)
    }

    /// [`Ledger::departures`] of buffer `index` (zero while there is no
    /// ledger: the buffer never left the process on a forwarding channel).
    pub(crate) fn departures(&self, index: u32) -> u32 {
        self.ledger.get().map_or(0, |l| l.departures(index))
    }

    /// [`Ledger::copies`] of buffer `index`.
    pub(crate) fn copies(&self, index: u32) -> u32 {
        self.ledger.get().map_or(0, |l| l.copies(index))
    }

    /// [`Ledger::copy_back`] of buffer `index` (nothing to do without a
    /// ledger: then no copy of it was counted).
    pub(crate) fn copy_back(&self, index: u32) {
        if let Some(l) = self.ledger.get() {
            l.copy_back(index);
        }
    }

    /// Whether `other` is the same memory as this (the same memfd, even
    /// when it reached this process twice as two fds).
    pub(crate) fn same_memory(&self, other: &PoolMemory) -> bool {
        std::ptr::eq(self, other) || sys::same_file(sys::borrow(&self.fd), sys::borrow(&other.fd))
    }

    /// The memfd, to send to another process.
    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Map the whole pool with `access`, the base aligned to `align`.
    pub(crate) fn map(&self, access: Access, align: usize) -> Result<Mapping> {
        let writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        Ok(match &*writer {
            Some(w) => w.duplicate(access, align)?,
            None => Mapping::map_shared(sys::borrow(&self.fd), self.geometry.len(), access, align)?,
        })
    }

    /// An fd a peer of trust NONE may have: it can read the pool and nothing
    /// else. The first call seals the file against every new way of writing
    /// it (keeping one writable mapping here for later views), so neither
    /// the fd nor a read-write reopening of it can change the memory.
    pub(crate) fn read_only_fd(&self) -> Result<OwnedFd> {
        let mut writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if writer.is_none() {
            let map = Mapping::map_shared(sys::borrow(&self.fd), self.geometry.len(), Access::ReadWrite, 1)?;
            sys::seal_future_writes(&self.fd)?;
            *writer = Some(map);
        }
        Ok(sys::reopen_read_only(&self.fd)?)
    }

    pub(crate) fn id(&self) -> PoolId {
        self.id
    }

    pub(crate) fn geometry(&self) -> Geometry {
        self.geometry
    }
}

/// One domain's mapping of a pool.
#[derive(Debug)]
pub(crate) struct PoolView {
    memory: Arc<PoolMemory>,
    map: Mapping,
    /// Per buffer: its state in this domain (a [`BufferState`] as `u8`). A
    /// mirror of the state the domain keeps under its lock, written only
    /// under that lock, so that move and pass can check their precondition
    /// without the lock, and other domains of the process can see it.
    states: Box<[AtomicU8]>,
    /// The length of the domain's free list of the pool: a mirror written
    /// under the domain's lock, so that [`crate::Allocator::available`]
    /// needs no lock (a thread that allocates and frees reads its own
    /// writes; another sees some recent count). On a cache line of its own:
    /// every allocation and free writes it, and the fields above are read
    /// by every move and pass, from other threads too.
    free: FreeCount,
}

/// See [`PoolView::free`].
#[derive(Debug, Default)]
#[repr(align(128))]
struct FreeCount(AtomicUsize);

impl PoolView {
    /// Map the pool; `initial` is the protection of every buffer at first.
    pub(crate) fn map(memory: Arc<PoolMemory>, initial: Access, alignment: usize) -> Result<Arc<Self>> {
        let geometry = memory.geometry;
        let align = if alignment == 0 { 1 } else { alignment };
        if !align.is_power_of_two() || align > geometry.buffer_size {
            return Err(ErrorKind::BadAlignment(alignment).into());
        }
        let map = memory.map(initial, align)?;
        let states = (0..geometry.count).map(|_| AtomicU8::new(BufferState::Invalid as u8)).collect();
        let view = Arc::new(PoolView { memory: memory.clone(), map, states, free: FreeCount::default() });
        let mut views = memory.views.lock().unwrap_or_else(|e| e.into_inner());
        views.retain(|v| v.strong_count() > 0);
        views.push(Arc::downgrade(&view));
        drop(views);
        Ok(view)
    }

    pub(crate) fn id(&self) -> PoolId {
        self.memory.id
    }

    pub(crate) fn geometry(&self) -> Geometry {
        self.memory.geometry
    }

    pub(crate) fn memory(&self) -> &Arc<PoolMemory> {
        &self.memory
    }

    /// Whether this domain owns buffer `index` read-write (as last recorded
    /// by [`PoolView::set_state`]).
    pub(crate) fn is_read_write(&self, index: u32) -> bool {
        self.state(index) == BufferState::ReadWrite
    }

    /// The state of buffer `index` in this domain, as last recorded.
    pub(crate) fn state(&self, index: u32) -> BufferState {
        // Acquire: pairs with the Release store of the transition.
        match self.states.get(index as usize).map(|f| f.load(Ordering::Acquire)) {
            Some(3) => BufferState::ReadWrite,
            Some(2) => BufferState::ReadOnlyOwned,
            Some(1) => BufferState::ReadOnly,
            _ => BufferState::Invalid,
        }
    }

    /// Record the state of buffer `index`; called under the domain lock at
    /// every state transition.
    /// The domain's count of free buffers of the pool (see `free`).
    pub(crate) fn free_count(&self) -> usize {
        self.free.0.load(Ordering::Relaxed)
    }

    /// Records the domain's count of free buffers (under its lock).
    pub(crate) fn set_free_count(&self, n: usize) {
        self.free.0.store(n, Ordering::Relaxed);
    }

    pub(crate) fn set_state(&self, index: u32, state: BufferState) {
        if let Some(f) = self.states.get(index as usize) {
            f.store(state as u8, Ordering::Release);
        }
    }

    /// Address of buffer `index` in this view: inside the mapping, since
    /// `index` is checked against the count (in release builds too: callers
    /// make slices of `buffer_size` bytes from it).
    ///
    /// # Panics
    /// If `index` is out of range: handles are only ever made for buffers
    /// of their pool, so that would be a bug in Ferry, not bad input.
    #[inline]
    pub(crate) fn buffer_ptr(&self, index: u32) -> *mut u8 {
        let g = self.geometry();
        assert!(index < g.count, "buffer index {index} out of range for a pool of {} buffers", g.count);
        // No `unsafe` needed to compute it; in range by the check above.
        self.map.as_ptr().wrapping_add(index as usize * g.buffer_size)
    }

    /// Buffer index of an address inside this view, if it is one.
    pub(crate) fn index_of(&self, addr: *const u8) -> Option<u32> {
        let base = self.map.as_ptr() as usize;
        let a = addr as usize;
        if a < base || a >= base + self.map.len() {
            return None;
        }
        Some(((a - base) / self.geometry().buffer_size) as u32)
    }

    /// Apply `access` to buffer `index` in this view.
    pub(crate) fn protect(&self, index: u32, access: Access) -> Result<()> {
        let size = self.geometry().buffer_size;
        self.map.protect(index as usize * size, size, access).map_err(Error::from)
    }

    /// Apply `access` to the whole view.
    pub(crate) fn protect_all(&self, access: Access) -> Result<()> {
        self.map.protect(0, self.map.len(), access).map_err(Error::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_validated() {
        let page = sys::page_size();
        assert!(Geometry::new(page, 1).is_ok());
        assert!(Geometry::new(1 << 20, 16).is_ok());
        assert!(matches!(
            Geometry::new(page + 1, 1).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::BadBufferSize { .. })
        ));
        assert!(matches!(
            Geometry::new(3 * page, 1).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::BadBufferSize { .. })
        ));
        assert!(matches!(
            Geometry::new(page / 2, 1).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::BadBufferSize { .. })
        ));
        assert!(matches!(Geometry::new(0, 1).as_ref().map_err(|e| e.kind()), Err(ErrorKind::BadBufferSize { .. })));
        assert!(matches!(Geometry::new(page, 0).as_ref().map_err(|e| e.kind()), Err(ErrorKind::BadBufferCount { .. })));
        assert!(matches!(
            Geometry::new(1 << 30, 1 << 20).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::BadBufferCount { .. })
        ));
    }

    #[test]
    fn id_and_address_are_arithmetic() {
        let g = Geometry::new(8192, 4).unwrap();
        let view = PoolView::map(PoolMemory::create(g).unwrap(), Access::ReadWrite, 0).unwrap();
        for i in 0..4 {
            let p = view.buffer_ptr(i);
            assert_eq!(p as usize - view.buffer_ptr(0) as usize, i as usize * 8192);
            assert_eq!(view.index_of(p), Some(i));
            // SAFETY: test-only: last byte of buffer i is inside the mapping.
            assert_eq!(view.index_of(unsafe { p.add(8191) }), Some(i));
        }
        assert_eq!(view.index_of(std::ptr::null()), None);
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn a_buffer_address_out_of_range_is_refused_in_every_build() {
        let g = Geometry::new(4096, 2).unwrap();
        let view = PoolView::map(PoolMemory::create(g).unwrap(), Access::ReadWrite, 0).unwrap();
        let _ = view.buffer_ptr(2);
    }

    #[test]
    fn same_memory_is_told_by_the_file() {
        let g = Geometry::new(4096, 1).unwrap();
        let a = PoolMemory::create(g).unwrap();
        let b = PoolMemory::mirror(a.id(), g, None).unwrap();
        let again = PoolMemory::from_peer(a.id(), g, a.fd().try_clone().unwrap(), None).unwrap();
        assert!(a.same_memory(&a) && a.same_memory(&again) && again.same_memory(&a));
        assert!(!a.same_memory(&b) && !b.same_memory(&again));
    }

    #[test]
    fn pool_ids_are_unique() {
        let g = Geometry::new(4096, 1).unwrap();
        let a = PoolMemory::create(g).unwrap();
        let b = PoolMemory::create(g).unwrap();
        assert_ne!(a.id(), b.id());
    }

    #[test]
    fn alignment_constraint() {
        let g = Geometry::new(1 << 16, 2).unwrap();
        let v = PoolView::map(PoolMemory::create(g).unwrap(), Access::ReadWrite, 1 << 16).unwrap();
        assert_eq!(v.buffer_ptr(0) as usize % (1 << 16), 0);
        assert!(matches!(
            PoolView::map(PoolMemory::create(g).unwrap(), Access::ReadWrite, 1 << 17).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::BadAlignment(_))
        ));
    }
}
