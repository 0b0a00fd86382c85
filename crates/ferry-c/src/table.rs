//! The pools this process knows, their C objects, the program's buffer
//! handles and the allocators. The table (an index from ids and addresses
//! to pools) is read-mostly; each buffer has its own lock, so threads
//! working on different buffers never wait for each other. Locks are taken
//! in this order: a waitset's, the table's, a buffer's.
//!
//! An allocator has no lock of its own: an allocator call takes only the
//! lock of the buffer it hands out or takes back (see
//! [`PoolEntry::allocator`] for why that is enough).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, RwLock};

use ferry::{Allocator, Buffer, BufferCopy, BufferId, BufferState, Pool, PoolConstraints, PoolId, TrustLevel};

use crate::boundary;
use crate::cmem::{CArray, CRef};
use crate::codes::*;
use crate::ffi::*;
use crate::lock::{GuardWithC, SpinLock, SpinLockWithC};
use crate::state::{new_token, Res, DOMAIN};

static TABLE: LazyLock<RwLock<Table>> = LazyLock::new(Default::default);

/// Counts the moments a channel may have started to refer to a pool (an
/// assignment, an offer), so that collecting pools can tell that what it
/// saw of the channels is out of date.
pub static GENERATION: AtomicU64 = AtomicU64::new(0);

fn read() -> std::sync::RwLockReadGuard<'static, Table> {
    TABLE.read().unwrap_or_else(|p| p.into_inner())
}

fn write() -> std::sync::RwLockWriteGuard<'static, Table> {
    TABLE.write().unwrap_or_else(|p| p.into_inner())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which of a buffer's two C objects a pointer names.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum View {
    /// The owner's (allocator, move, pass; `pool->buffers`).
    Owner,
    /// The second one, for a copy held beside the owner's buffer.
    Copy,
}

/// A copy the program holds: the channel it came over, the copy, and the
/// C object it was given with.
pub type Held = (usize, BufferCopy, View);

/// The copies the program holds of one buffer. Most buffers never have
/// any: boxed, the list takes one word of the slot's first cache line
/// (see [`Slot`]); once made it stays, so a buffer copied over and over
/// does not allocate each time.
#[derive(Default)]
// Boxed on purpose: one word in the slot's first line, where a Vec takes three.
#[allow(clippy::box_collection)]
pub struct Copies(Option<Box<Vec<Held>>>);

impl Copies {
    /// Adds one.
    pub fn push(&mut self, h: Held) {
        self.0.get_or_insert_default().push(h);
    }

    /// Puts one back at `at`.
    pub fn insert(&mut self, at: usize, h: Held) {
        let v = self.0.get_or_insert_default();
        v.insert(at.min(v.len()), h);
    }

    /// Takes the one at `at`, if there is one.
    pub fn remove(&mut self, at: usize) -> Option<Held> {
        let v = self.0.as_mut()?;
        (at < v.len()).then(|| v.remove(at))
    }

    /// Keeps those `keep` chooses.
    pub fn retain(&mut self, keep: impl FnMut(&Held) -> bool) {
        if let Some(v) = &mut self.0 {
            v.retain(keep);
        }
    }

    /// Lets every one go.
    pub fn clear(&mut self) {
        if let Some(v) = &mut self.0 {
            v.clear();
        }
    }
}

impl std::ops::Deref for Copies {
    type Target = [Held];
    fn deref(&self) -> &[Held] {
        self.0.as_deref().map_or(&[], |v| v.as_slice())
    }
}

/// One buffer: the program's handles of it, and its second C object (the
/// owner's object is the one its [`SlotCell`]'s lock guards).
///
/// Laid out (`repr(C)`) so that `owned`, the one field a move, a pass or a
/// delivery writes, comes first: behind the owner's object and the lock's
/// flag it ends the slot's first cache line (see [`SlotCell`]). The rest
/// is only read on the data path, and written when copies come and go.
#[repr(C)]
pub struct Slot {
    /// The program owns the buffer.
    pub owned: Option<Buffer>,
    /// Copies the program received.
    pub copies: Copies,
    copy_obj: CRef<BulkBuffer>,
    /// The `state` and `local_ref_count` last written to the second object
    /// (compared instead of read back: it is written only when copies
    /// change).
    copy_written: (u32, u32),
    /// The buffer's pool, in words: a `PoolId` would align the slot, and
    /// the lock's flag before it, to 16 bytes.
    pool: BulkPoolId,
    index: u32,
}

impl Slot {
    /// The buffer's id.
    fn id(&self) -> BufferId {
        BufferId { pool: pool_id_of(self.pool), index: self.index }
    }

    fn states(&self, known: Option<BufferState>) -> (u32, u32, u32, u32) {
        let owned_state = || buffer_state_to(known.unwrap_or_else(|| DOMAIN.buffer_state(self.id())));
        if self.copies.is_empty() {
            // The usual case: no copies, through either object.
            let owner_state = if self.owned.is_some() { owned_state() } else { 0 };
            return (owner_state, 0, 0, 0);
        }
        let held = |v: View| self.copies.iter().filter(|c| c.2 == v).count() as u32;
        let (owner_copies, view_copies) = (held(View::Owner), held(View::Copy));
        let read_only = buffer_state_to(BufferState::ReadOnly);
        // The owner's object: the domain's state while the program owns the
        // buffer (READ_WRITE, or RO_OWNED with copies out); READ_ONLY while
        // a copy was given with it; else INVALID. The second object:
        // READ_ONLY while a copy was given with it.
        let owner_state = match (&self.owned, owner_copies) {
            (Some(_), _) => owned_state(),
            (None, 0) => 0,
            (None, _) => read_only,
        };
        let copy_state = if view_copies > 0 { read_only } else { 0 };
        (owner_state, owner_copies, copy_state, view_copies)
    }

    /// The state the object of `view` shows.
    fn state_of(&self, view: View) -> u32 {
        let (owner_state, _, copy_state, _) = self.states(None);
        match view {
            View::Owner => owner_state,
            View::Copy => copy_state,
        }
    }

    /// Whether the program holds nothing of it.
    fn is_empty(&self) -> bool {
        self.owned.is_none() && self.copies.is_empty()
    }
}

/// A buffer's slot and its owner's C object (`pool->buffers[i]`), under one
/// lock, on two cache lines of their own. The first holds what a move, a
/// pass or a delivery writes: the object (its `state`), the lock's flag and
/// the slot's `owned`. A buffer that goes between two threads of the
/// process (both ends of a local channel) then takes one line from core to
/// core per hop, and two threads working on neighbouring buffers (a
/// stream, many buffers in flight) never share one.
#[repr(C, align(64))]
struct SlotCell(SpinLockWithC<BulkBuffer, Slot>);

/// A buffer's slot, locked, with its owner's C object.
pub type SlotGuard<'a> = GuardWithC<'a, BulkBuffer, Slot>;

impl SlotGuard<'_> {
    /// Rewrites the C objects from the handles and the domain.
    pub fn refresh(&mut self) {
        self.refresh_as(None);
    }

    /// [`refresh`](Self::refresh) when the caller knows the domain's state
    /// of a buffer the program owns (a buffer moved, passed or allocated to
    /// it is READ_WRITE: nothing can be copied from a buffer in flight or
    /// free), sparing the domain's lock on the data path. An object is
    /// written only if it changes (another thread reading the buffer's
    /// object next then does not have to fetch the line again).
    pub fn refresh_as(&mut self, known: Option<BufferState>) {
        let (owner_state, owner_copies, copy_state, view_copies) = self.states(known);
        let obj = self.c();
        if (obj.state, obj.local_ref_count) != (owner_state, owner_copies) {
            self.update_c(|b| {
                b.state = owner_state;
                b.local_ref_count = owner_copies;
            });
        }
        if self.copy_written != (copy_state, view_copies) {
            self.copy_written = (copy_state, view_copies);
            self.copy_obj.update(|b| {
                b.state = copy_state;
                b.local_ref_count = view_copies;
            });
        }
    }

    /// What the owner's object says now.
    pub fn owner_state(&self) -> u32 {
        self.c().state
    }
}

/// A pool this process knows, with its C objects.
pub struct PoolEntry {
    /// Ferry's handle (keeps the pool in the domain's list).
    pub pool: Pool,
    cpool: CArray<BulkPool>,
    /// Writes the pool's `trust`.
    cpool_ref: Mutex<CRef<BulkPool>>,
    /// The second object of each buffer (same address; its own state and
    /// count), for a copy held beside the owner's buffer (the owner's
    /// objects are in `slots`).
    copy_bufs: CArray<BulkBuffer>,
    /// The pool's `buffers` array.
    _ptrs: CArray<*mut BulkBuffer>,
    slots: Box<[SlotCell]>,
    /// Made by bulk_alloc_init: the allocator. It stays as long as the
    /// entry (it is two handles, of the domain and the pool, which the
    /// entry holds anyway), so a call that found the entry may use it
    /// without a lock; whether the program may still use it is
    /// `alloc_token`.
    ///
    /// The protocol (modelled in `lock::loom_tests`): `alloc_token` is the
    /// token of the allocator struct while it lives and 0 once
    /// `bulk_alloc_free` began. An allocator call reads it **with the lock
    /// of the buffer's slot held**, and writes the slot (and the struct's
    /// `num_free`) only if it is its own token; `alloc_free` stores 0 and
    /// then takes every slot's lock in turn to give the program's buffers
    /// back, and clears the struct only after that walk. So for each slot
    /// either the call holds its lock before the walk does (and the walk
    /// gives back what the call put there) or after it (and the call
    /// reads 0, the store being ordered before the walk's release of that
    /// slot's lock, and refuses, handing an allocated buffer back to the
    /// allocator): no buffer is handed out or taken back by an allocator
    /// once its free has given the buffers back, and the slot lock alone
    /// keeps two calls on one buffer apart (a double return is refused as
    /// before). Reading the token before taking the slot's lock would let
    /// a call write a slot the walk had already passed.
    allocator: Option<Allocator>,
    /// The allocator struct's token while it lives; 0 without allocator
    /// or once `bulk_alloc_free` began (see `allocator`).
    alloc_token: AtomicUsize,
    /// Buffers the program returned to its allocator, handed out again
    /// (the latest first) before the allocator asks the domain for one: a
    /// return and the next allocation stay inside this library, without
    /// the domain's free list and its lock, which the threads of a
    /// process share (the peer end of a local channel takes it on every
    /// delivery). The domain counts them as owned; the program, as free
    /// (`num_free`, and their objects say INVALID: no slot holds them).
    /// Pushed with the returned buffer's slot locked, and emptied into the
    /// domain by `bulk_alloc_free` after its walk of the slots (see
    /// `allocator`), so none stays behind a freed allocator. Its lock is
    /// the innermost: taken alone or inside a slot's.
    kept: SpinLock<Vec<Buffer>>,
}

impl PoolEntry {
    /// The `struct bulk_pool`.
    pub fn pool_ptr(&self) -> usize {
        self.cpool.ptr(0) as usize
    }

    /// Buffer `i`'s C object of `view`.
    pub fn buffer_ptr(&self, i: usize, view: View) -> usize {
        match view {
            View::Owner => self.slots[i].0.c_ptr() as usize,
            View::Copy => self.copy_bufs.ptr(i) as usize,
        }
    }

    /// Buffer `i`, locked.
    pub fn slot(&self, i: usize) -> SlotGuard<'_> {
        self.slots[i].0.lock()
    }

    /// The address of the first owner's object (they are a [`SlotCell`]
    /// apart).
    fn owner_objs_base(&self) -> usize {
        self.slots.as_ptr() as usize
    }

    /// Rewrites the pool's trust from the domain.
    pub fn refresh_trust(&self) {
        let t = trust_to(DOMAIN.pool_trust(self.pool.id()).unwrap_or(TrustLevel::Uninitialized));
        lock(&self.cpool_ref).update(|p| p.trust = t);
    }

    /// Whether nothing but channels may refer to the pool.
    fn unheld(&self) -> bool {
        self.alloc_token.load(Ordering::Acquire) == 0 && self.slots.iter().all(|s| s.0.lock().is_empty())
    }

    /// The pool's allocator, if the allocator struct with `token` lives.
    /// Only a hint outside a slot's lock: see [`PoolEntry::allocator`].
    fn allocator_of(&self, token: usize) -> Option<&Allocator> {
        self.allocator.as_ref().filter(|_| self.alloc_token.load(Ordering::Acquire) == token)
    }
}

/// An allocator struct initialized by bulk_alloc_init.
struct AllocEntry {
    c_addr: usize,
    pool: PoolId,
}

/// The index of the pools.
#[derive(Default)]
pub struct Table {
    pools: HashMap<PoolId, Arc<PoolEntry>>,
    /// `struct bulk_pool` address → pool.
    pool_addr: HashMap<usize, PoolId>,
    /// Address of a pool's first `struct bulk_buffer` of each view → pool.
    buffer_addr: BTreeMap<usize, (PoolId, View)>,
    allocators: HashMap<usize, AllocEntry>,
}

fn pool_id_words(id: PoolId) -> BulkPoolId {
    let v = id.as_u128();
    BulkPoolId { machine: (v >> 96) as u32, dom: (v >> 64) as u32, local: (v >> 32) as u32, tag: v as u32 }
}

/// Ferry's pool id of a `struct bulk_pool_id`.
pub fn pool_id_of(w: BulkPoolId) -> PoolId {
    let v = (u128::from(w.machine) << 96) | (u128::from(w.dom) << 64) | (u128::from(w.local) << 32) | u128::from(w.tag);
    PoolId::from_u128(v)
}

/// Buffer `i`'s C object, INVALID.
fn buffer_object(i: usize, base: usize, size: usize, pool: *mut BulkPool) -> BulkBuffer {
    BulkBuffer {
        address: (base + i * size) as *mut std::ffi::c_void,
        pool,
        bufferid: i as u32,
        state: 0,
        local_ref_count: 0,
        reserved: 0,
    }
}

impl Table {
    /// Registers a pool and makes its C objects.
    fn add_pool(&mut self, pool: Pool, allocator: Option<(usize, Allocator)>) -> Arc<PoolEntry> {
        let (alloc_token, allocator) = match allocator {
            Some((token, a)) => (token, Some(a)),
            None => (0, None),
        };
        let id = pool.id();
        let g = pool.geometry();
        let (n, size, base) = (g.count() as usize, g.buffer_size(), pool.base_address());
        let (cpool, mut cpool_refs) = CArray::new(vec![BulkPool {
            id: pool_id_words(id),
            base_address: base,
            buffer_size: size,
            trust: 0,
            num_buffers: n,
            buffers: std::ptr::null_mut(),
        }]);
        let pool_ptr = cpool.ptr(0);
        let (copy_bufs, copy_objs) = CArray::new((0..n).map(|i| buffer_object(i, base, size, pool_ptr)).collect());
        let slots: Box<[SlotCell]> = copy_objs
            .into_iter()
            .enumerate()
            .map(|(i, copy_obj)| {
                let s = Slot {
                    owned: None,
                    copies: Copies::default(),
                    copy_obj,
                    copy_written: (0, 0),
                    pool: pool_id_words(id),
                    index: i as u32,
                };
                SlotCell(SpinLockWithC::new(buffer_object(i, base, size, pool_ptr), s))
            })
            .collect();
        for cell in slots.iter() {
            cell.0.lock().refresh();
        }
        let (ptrs, _) = CArray::new(slots.iter().map(|cell| cell.0.c_ptr()).collect());
        let ptrs_base = ptrs.ptr(0);
        let mut cpool_ref = cpool_refs.pop().expect("one pool object");
        cpool_ref.update(|p| p.buffers = ptrs_base);
        let owner_base = slots.as_ptr() as usize;
        self.pool_addr.insert(pool_ptr as usize, id);
        self.buffer_addr.insert(owner_base, (id, View::Owner));
        self.buffer_addr.insert(copy_bufs.base(), (id, View::Copy));
        let allocator_present = allocator.is_some();
        let e = Arc::new(PoolEntry {
            pool,
            cpool,
            cpool_ref: Mutex::new(cpool_ref),
            copy_bufs,
            _ptrs: ptrs,
            slots,
            allocator,
            alloc_token: AtomicUsize::new(alloc_token),
            kept: SpinLock::new(Vec::with_capacity(if allocator_present { n } else { 0 })),
        });
        e.refresh_trust();
        self.pools.insert(id, e.clone());
        e
    }
}

/// A pool this process knows, if it does.
pub fn pool(id: PoolId) -> Option<Arc<PoolEntry>> {
    read().pools.get(&id).cloned()
}

/// A pool this process knows, registered on first sight (a pool offered
/// by a peer, a buffer that arrives).
pub fn pool_or_add(id: PoolId) -> Option<Arc<PoolEntry>> {
    if let Some(e) = pool(id) {
        return Some(e);
    }
    let mut t = write();
    if let Some(e) = t.pools.get(&id) {
        return Some(e.clone());
    }
    let p = DOMAIN.pool(id)?;
    Some(t.add_pool(p, None))
}

/// The pool at a `struct bulk_pool` address.
pub fn pool_at(p: usize) -> Res<Arc<PoolEntry>> {
    let t = read();
    let id = t.pool_addr.get(&p).ok_or(ERR_INVALID_POOL)?;
    t.pools.get(id).cloned().ok_or(ERR_INVALID_POOL)
}

/// Bumped whenever a pool is forgotten: a thread's cache of pools is good
/// only while it has not changed.
static EPOCH: AtomicU64 = AtomicU64::new(0);

/// The pools and allocators a thread used last, held strongly so that a
/// lookup that hits costs no shared lock and no reference count (both would
/// move a cache line between the cores of two busy threads).
#[derive(Default)]
struct Cache {
    epoch: u64,
    pools: Vec<Arc<PoolEntry>>,
    /// Token and struct address of an allocator, and its pool.
    allocs: Vec<(usize, usize, Arc<PoolEntry>)>,
}

/// Entries a thread keeps of each kind.
const CACHED: usize = 4;

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
}

/// Runs `f` on the cached pool that `pick` chooses, if the cache is good
/// and has one; else gives `f` back.
fn try_cached<R, F: FnOnce(&PoolEntry) -> R>(pick: impl Fn(&PoolEntry) -> bool, f: F) -> Result<R, F> {
    let epoch = EPOCH.load(Ordering::Acquire);
    CACHE.with(|c| {
        let Ok(c) = c.try_borrow() else { return Err(f) };
        if c.epoch != epoch {
            return Err(f);
        }
        match c.pools.iter().find(|e| pick(e)) {
            Some(e) => Ok(f(e)),
            None => Err(f),
        }
    })
}

/// Keeps `e` in this thread's cache (looked up at `epoch`).
fn remember(e: Arc<PoolEntry>, epoch: u64) {
    CACHE.with(|c| {
        let Ok(mut c) = c.try_borrow_mut() else { return };
        if c.epoch != epoch {
            *c = Cache { epoch, ..Cache::default() };
        }
        c.pools.retain(|x| !Arc::ptr_eq(x, &e));
        c.pools.insert(0, e);
        c.pools.truncate(CACHED);
    });
}

impl PoolEntry {
    /// Index and view of a `struct bulk_buffer` address in this pool.
    fn locate(&self, p: usize) -> Option<(usize, View)> {
        let n = self.slots.len();
        [
            (self.owner_objs_base(), std::mem::size_of::<SlotCell>(), View::Owner),
            (self.copy_bufs.base(), std::mem::size_of::<BulkBuffer>(), View::Copy),
        ]
        .into_iter()
        .find_map(|(base, stride, view)| {
            let off = p.checked_sub(base)?;
            (off % stride == 0 && off / stride < n).then_some((off / stride, view))
        })
    }
}

/// The pools a waitset's calls and events used last, held strongly (as a
/// thread's cache): a lookup under the waitset's lock that hits costs no
/// shared lock, no reference count and no thread-local lookup.
#[derive(Default)]
pub struct PoolCache {
    epoch: u64,
    pools: Vec<Arc<PoolEntry>>,
}

impl PoolCache {
    /// The cached pool `pick` chooses, if the cache is good.
    fn find(&mut self, pick: impl Fn(&PoolEntry) -> bool) -> Option<&PoolEntry> {
        self.find_map(|e| pick(e).then_some(e))
    }

    /// The first `pick(pool)` that is `Some` among the cached pools, if
    /// the cache is good.
    fn find_map<'a, T>(&'a mut self, pick: impl Fn(&'a PoolEntry) -> Option<T>) -> Option<T> {
        let epoch = EPOCH.load(Ordering::Acquire);
        if self.epoch != epoch {
            // Pools were forgotten: let go of their objects at once.
            self.pools.clear();
            return None;
        }
        self.pools.iter().find_map(|e| pick(e))
    }

    /// Empties the cache if pools were forgotten since it was filled.
    pub fn forget_stale(&mut self) {
        if self.epoch != EPOCH.load(Ordering::Acquire) {
            self.pools.clear();
        }
    }

    /// Keeps `e` (looked up at `epoch`).
    fn remember(&mut self, e: Arc<PoolEntry>, epoch: u64) {
        if self.epoch != epoch {
            self.pools.clear();
            self.epoch = epoch;
        }
        self.pools.retain(|x| !Arc::ptr_eq(x, &e));
        self.pools.insert(0, e);
        self.pools.truncate(CACHED);
    }
}

/// [`with_buffer`] with a waitset's cache instead of the thread's.
pub fn with_buffer_in<R>(cache: &mut PoolCache, p: usize, f: impl FnOnce(&PoolEntry, usize, View) -> Res<R>) -> Res<R> {
    if let Some((e, i, view)) = cache.find_map(|e| e.locate(p).map(|(i, view)| (e, i, view))) {
        return f(e, i, view);
    }
    let epoch = EPOCH.load(Ordering::Acquire);
    let e = buffer_pool(p)?;
    let r = match e.locate(p) {
        Some((i, view)) => f(&e, i, view),
        None => Err(ERR_INVALID_BUFFER),
    };
    cache.remember(e, epoch);
    r
}

/// [`with_pool`] with a waitset's cache instead of the thread's.
pub fn with_pool_in<R>(cache: &mut PoolCache, id: PoolId, add: bool, f: impl FnOnce(&PoolEntry) -> R) -> Option<R> {
    if let Some(e) = cache.find(|e| e.pool.id() == id) {
        return Some(f(e));
    }
    let epoch = EPOCH.load(Ordering::Acquire);
    let e = if add { pool_or_add(id) } else { pool(id) }?;
    let r = f(&e);
    cache.remember(e, epoch);
    Some(r)
}

/// The pool whose buffer objects include address `p`.
fn buffer_pool(p: usize) -> Res<Arc<PoolEntry>> {
    let t = read();
    let (_, &(id, _)) = t.buffer_addr.range(..=p).next_back().ok_or(ERR_INVALID_BUFFER)?;
    t.pools.get(&id).cloned().ok_or(ERR_INVALID_BUFFER)
}

/// Runs `f` on the pool, index and view of a `struct bulk_buffer` address.
pub fn with_buffer<R>(p: usize, f: impl FnOnce(&PoolEntry, usize, View) -> Res<R>) -> Res<R> {
    let run = |e: &PoolEntry| match e.locate(p) {
        Some((i, view)) => f(e, i, view),
        None => Err(ERR_INVALID_BUFFER),
    };
    let run = match try_cached(|e| e.locate(p).is_some(), run) {
        Ok(r) => return r,
        Err(run) => run,
    };
    let epoch = EPOCH.load(Ordering::Acquire);
    let e = buffer_pool(p)?;
    let r = run(&e);
    remember(e, epoch);
    r
}

/// Runs `f` on a pool this process knows (registered on first sight with
/// `add`: a pool offered by a peer, a buffer that arrives).
pub fn with_pool<R>(id: PoolId, add: bool, f: impl FnOnce(&PoolEntry) -> R) -> Option<R> {
    let f = match try_cached(|e| e.pool.id() == id, f) {
        Ok(r) => return Some(r),
        Err(f) => f,
    };
    let epoch = EPOCH.load(Ordering::Acquire);
    let e = if add { pool_or_add(id) } else { pool(id) }?;
    let r = f(&e);
    remember(e, epoch);
    Some(r)
}

/// The pools that nothing but a channel may refer to.
pub fn unheld_pools() -> Vec<PoolId> {
    read().pools.iter().filter(|(_, e)| e.unheld()).map(|(id, _)| *id).collect()
}

/// Forgets pools that are still unheld; their C objects are freed once no
/// call that looked one up still holds it.
pub fn forget(ids: &[PoolId]) {
    let mut t = write();
    EPOCH.fetch_add(1, Ordering::AcqRel);
    for id in ids {
        if t.pools.get(id).is_some_and(|e| e.unheld()) {
            if let Some(e) = t.pools.remove(id) {
                t.pool_addr.remove(&e.pool_ptr());
                t.buffer_addr.remove(&e.owner_objs_base());
                t.buffer_addr.remove(&e.copy_bufs.base());
            }
        }
    }
}

/// `bulk_pool_domain_list_get`.
pub fn pool_by_id(id: PoolId) -> Option<usize> {
    pool_or_add(id).map(|e| e.pool_ptr())
}

/// `bulk_buffer_change_state`.
pub fn buffer_change_state(buffer: usize, state: u32) -> Res<()> {
    with_buffer(buffer, |e, i, view| {
        if state > 3 {
            return Err(ERR_INVALID_ARGUMENT);
        }
        let mut s = e.slot(i);
        s.refresh();
        if s.state_of(view) == state {
            Ok(())
        } else {
            Err(ERR_BUFFER_STATE)
        }
    })
}

/// Takes the copies the program held over a destroyed channel.
pub fn drop_channel_handles(token: usize) {
    let all: Vec<Arc<PoolEntry>> = read().pools.values().cloned().collect();
    for e in all {
        for slot in e.slots.iter() {
            let mut s = slot.0.lock();
            if s.copies.iter().any(|c| c.0 == token) {
                s.copies.retain(|c| c.0 != token);
                s.refresh();
            }
        }
    }
}

// ---------------------------------------------------------------------- allocators

/// Runs `f` on the token and pool of a live allocator struct (the pool's
/// allocator lock checks the token again).
fn with_allocator<R>(a: *mut BulkAllocator, f: impl FnOnce(usize, &PoolEntry) -> Res<R>) -> Res<R> {
    let token = boundary::allocator_token(a);
    let epoch = EPOCH.load(Ordering::Acquire);
    let mut f = Some(f);
    let hit = CACHE.with(|c| {
        let c = c.try_borrow().ok()?;
        if c.epoch != epoch {
            return None;
        }
        let (_, _, e) = c.allocs.iter().find(|(t, addr, _)| *t == token && *addr == a as usize)?;
        Some((f.take()?)(token, e))
    });
    if let Some(r) = hit {
        return r;
    }
    let e = {
        let t = read();
        match t.allocators.get(&token) {
            Some(ae) if ae.c_addr == a as usize => t.pools.get(&ae.pool).cloned().ok_or(ERR_INVALID_ALLOCATOR)?,
            _ => return Err(ERR_INVALID_ALLOCATOR),
        }
    };
    let r = (f.take().ok_or(ERR_INTERNAL)?)(token, &e);
    CACHE.with(|c| {
        let Ok(mut c) = c.try_borrow_mut() else { return };
        if c.epoch != epoch {
            *c = Cache { epoch, ..Cache::default() };
        }
        c.allocs.retain(|(t, _, _)| *t != token);
        c.allocs.insert(0, (token, a as usize, e));
        c.allocs.truncate(CACHED);
    });
    r
}

/// `bulk_alloc_init`.
pub fn alloc_init(a: *mut BulkAllocator, count: usize, size: usize, c: Option<BulkPoolConstraints>) -> Res<()> {
    let live = with_allocator(a, |token, e| Ok(e.allocator_of(token).is_some()));
    if live == Ok(true) {
        return Err(ERR_ALLOCATOR_IN_USE);
    }
    let (trust, alignment) = match c {
        Some(c) => (trust_from(c.trust).ok_or(ERR_INVALID_ARGUMENT)?, c.alignment),
        None => (TrustLevel::Uninitialized, 0),
    };
    let count = u64::try_from(count).map_err(|_| ERR_BAD_BUFFER_SIZE)?;
    let alloc = Allocator::new(&DOMAIN, count, size, PoolConstraints { trust, alignment }).map_err(|e| of_error(&e))?;
    let pool = DOMAIN.pool(alloc.pool().id()).ok_or(ERR_INTERNAL)?;
    let id = pool.id();
    let free = alloc.available();
    let token = new_token();
    let mut t = write();
    let e = t.add_pool(pool, Some((token, alloc)));
    t.allocators.insert(token, AllocEntry { c_addr: a as usize, pool: id });
    boundary::write_allocator(a, e.pool_ptr() as *mut BulkPool, free, token);
    Ok(())
}

/// `bulk_alloc_free` (the caller collects the pool afterwards).
pub fn alloc_free(a: *mut BulkAllocator) -> Res<()> {
    let token = boundary::allocator_token(a);
    let mut t = write();
    let e = match t.allocators.get(&token) {
        Some(ae) if ae.c_addr == a as usize => t.pools.get(&ae.pool).cloned(),
        _ => return Err(ERR_INVALID_ALLOCATOR),
    };
    t.allocators.remove(&token);
    EPOCH.fetch_add(1, Ordering::AcqRel);
    if let Some(e) = e {
        // The allocator is dead first, then the program's handles of the
        // pool go back, slot by slot; a call that holds a slot's lock
        // meanwhile finishes before the walk passes it, and one that takes
        // it later sees the token gone (see `PoolEntry::allocator`).
        e.alloc_token.store(0, Ordering::Release);
        for slot in e.slots.iter() {
            let mut s = slot.0.lock();
            s.owned = None;
            s.copies.clear();
            s.refresh();
        }
        // After the walk: a return that got past the token pushed before
        // the walk passed its slot; later ones are refused. The buffers go
        // back to the domain (its lock) once the kept list's lock is let go.
        let kept = std::mem::take(&mut *e.kept.lock());
        drop(kept);
    }
    // After the walk: no allocator call writes the struct any more.
    boundary::clear_allocator(a);
    Ok(())
}

/// `bulk_alloc_new_buffer`.
pub fn alloc_new_buffer(a: *mut BulkAllocator) -> Res<usize> {
    with_allocator(a, |token, e| {
        let alloc = e.allocator_of(token).ok_or(ERR_INVALID_ALLOCATOR)?;
        // One look at the kept list: the buffer and how many stay there.
        let (kept, still_kept) = {
            let mut k = e.kept.lock();
            (k.pop(), k.len())
        };
        let Some(b) = kept.or_else(|| alloc.alloc()) else {
            // Any slot's lock orders the write before a concurrent free's
            // clearing of the struct (which comes after its walk of every slot).
            let _s = e.slots.first().map(|s| s.0.lock());
            if e.alloc_token.load(Ordering::Acquire) != token {
                return Err(ERR_INVALID_ALLOCATOR);
            }
            boundary::set_num_free(a, 0);
            return Err(ERR_NO_RESOURCES);
        };
        let i = b.id().index as usize;
        let mut s = e.slot(i);
        if e.alloc_token.load(Ordering::Acquire) != token {
            // Freed since the look above: the buffer goes back, unseen.
            drop(s);
            let _ = alloc.free(b);
            return Err(ERR_INVALID_ALLOCATOR);
        }
        s.owned = Some(b);
        s.refresh_as(Some(BufferState::ReadWrite));
        boundary::set_num_free(a, alloc.available() + still_kept);
        Ok(e.buffer_ptr(i, View::Owner))
    })
}

/// `bulk_alloc_return_buffer`.
pub fn alloc_return_buffer(a: *mut BulkAllocator, buffer: usize) -> Res<()> {
    with_allocator(a, |token, e| {
        let Some((i, view)) = e.locate(buffer) else {
            // Not this pool's: a buffer of another pool, or no buffer at all.
            return with_buffer(buffer, |_, _, _| Err(ERR_FOREIGN_POOL));
        };
        let alloc = e.allocator_of(token).ok_or(ERR_INVALID_ALLOCATOR)?;
        let mut s = e.slot(i);
        // Under the slot's lock: see `PoolEntry::allocator`.
        if e.alloc_token.load(Ordering::Acquire) != token {
            return Err(ERR_INVALID_ALLOCATOR);
        }
        if view == View::Copy || s.owned.is_none() {
            return Err(ERR_BUFFER_NOT_OWNED);
        }
        // A buffer whose copies are out stays with the program: handed out
        // again, its new user could not write it.
        if s.owner_state() == buffer_state_to(BufferState::ReadOnlyOwned) {
            return Err(ERR_COPIES_OUTSTANDING);
        }
        // The slot's own buffer: of this pool, in this process's domain.
        let b = s.owned.take().ok_or(ERR_BUFFER_NOT_OWNED)?;
        let kept = {
            let mut k = e.kept.lock();
            k.push(b);
            k.len()
        };
        s.refresh();
        boundary::set_num_free(a, alloc.available() + kept);
        Ok(())
    })
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The owner's object comes first, then the lock's flag and the slot's
    /// `owned`: all that a move, a pass or a delivery writes shares the
    /// cell's first cache line; the whole cell takes two lines, and the
    /// owner's objects are a cell apart (what `locate` counts on).
    #[test]
    fn a_buffers_written_fields_share_its_slots_first_cache_line() {
        let cell = std::mem::size_of::<SlotCell>();
        assert_eq!(cell, 128);
        assert_eq!(std::mem::align_of::<SlotCell>(), 64);
        let obj = std::mem::size_of::<BulkBuffer>();
        let lock = std::mem::size_of::<SpinLock<Slot>>();
        let flag = lock - std::mem::size_of::<Slot>();
        assert_eq!((obj, flag), (32, 8));
        assert_eq!(std::mem::offset_of!(Slot, owned), 0);
        let owned_end = obj + flag + std::mem::size_of::<Option<Buffer>>();
        assert!(owned_end <= 64, "`owned` ends at byte {owned_end}");

        let mut a =
            Box::new(BulkAllocator { pool: std::ptr::null_mut(), num_free: 0, impl_data: std::ptr::null_mut() });
        alloc_init(&mut *a, 3, 4096, None).expect("alloc_init");
        let e = pool_at(a.pool as usize).expect("the allocator's pool");
        let id = e.pool.id();
        for i in 0..3 {
            let p = e.buffer_ptr(i, View::Owner);
            assert_eq!(p, e.owner_objs_base() + i * cell);
            assert_eq!(p % 64, 0, "an owner's object starts a line");
            assert_eq!(e.locate(p), Some((i, View::Owner)));
            assert_eq!(e.locate(e.buffer_ptr(i, View::Copy)), Some((i, View::Copy)));
            assert_eq!(e.locate(p + 8), None, "inside an object is no object");
        }
        alloc_free(&mut *a).expect("alloc_free");
        drop(e);
        forget(&[id]);
    }

    /// A buffer never copied has no list of copies, and the list's calls
    /// on it do nothing (the C programs' copy tests hold real ones).
    #[test]
    fn no_copies_before_the_first() {
        let mut c = Copies::default();
        assert!(c.is_empty());
        assert!(c.remove(0).is_none());
        c.retain(|_| false);
        c.clear();
        assert!(c.is_empty());
    }

    /// A returned buffer stays with the allocator (free to the program:
    /// counted, INVALID, handed out next) and goes back to the domain when
    /// the allocator is freed.
    #[test]
    fn returned_buffers_are_handed_out_again_and_reach_the_domain_at_free() {
        let mut a =
            Box::new(BulkAllocator { pool: std::ptr::null_mut(), num_free: 0, impl_data: std::ptr::null_mut() });
        alloc_init(&mut *a, 4, 4096, None).expect("alloc_init");
        let e = pool_at(a.pool as usize).expect("the allocator's pool");
        let id = e.pool.id();
        let domain_free = || e.allocator.as_ref().expect("the allocator").available();
        let b = alloc_new_buffer(&mut *a).expect("a buffer");
        let c = alloc_new_buffer(&mut *a).expect("a second buffer");
        assert_eq!((a.num_free, domain_free()), (2, 2));
        alloc_return_buffer(&mut *a, b).expect("return");
        assert_eq!(a.num_free, 3, "the program counts a returned buffer as free");
        assert_eq!(domain_free(), 2, "the allocator keeps it (the domain still counts it as taken)");
        let (i, _) = e.locate(b).expect("a buffer object of the pool");
        let state = e.slot(i).owner_state();
        assert_eq!(state, buffer_state_to(BufferState::Invalid), "a returned buffer's object");
        assert_eq!(alloc_return_buffer(&mut *a, b), Err(ERR_BUFFER_NOT_OWNED), "a double return");
        assert_eq!(alloc_new_buffer(&mut *a), Ok(b), "the kept buffer is handed out first");
        assert_eq!(a.num_free, 2);
        alloc_return_buffer(&mut *a, b).expect("return");
        alloc_return_buffer(&mut *a, c).expect("return");
        assert_eq!((a.num_free, domain_free()), (4, 2));
        alloc_free(&mut *a).expect("alloc_free");
        assert_eq!(domain_free(), 4, "every buffer is back in the domain's free list");
        drop(e);
        forget(&[id]);
    }

    /// Two threads allocate and return while `alloc_free` runs: once the
    /// free and both threads are done, the program owns none of the
    /// pool's buffers (the free gave back everything handed out before its
    /// walk, and nothing was handed out after it). A call that checked the
    /// allocator's token before taking the buffer's lock would, now and
    /// then, put a buffer in a slot the walk had passed.
    #[test]
    fn nothing_owned_after_a_free_that_raced_allocations() {
        const ROUNDS: usize = 400;
        for round in 0..ROUNDS {
            let mut a =
                Box::new(BulkAllocator { pool: std::ptr::null_mut(), num_free: 0, impl_data: std::ptr::null_mut() });
            alloc_init(&mut *a, 8, 4096, None).expect("alloc_init");
            let id = pool_at(a.pool as usize).expect("the allocator's pool").pool.id();
            let addr = &mut *a as *mut BulkAllocator as usize;
            let go = std::sync::Arc::new(std::sync::Barrier::new(3));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let go = go.clone();
                    std::thread::spawn(move || {
                        let a = addr as *mut BulkAllocator;
                        go.wait();
                        loop {
                            match alloc_new_buffer(a) {
                                Ok(b) => match alloc_return_buffer(a, b) {
                                    Ok(()) | Err(ERR_INVALID_ALLOCATOR) => {}
                                    Err(e) => panic!("return: {e}"),
                                },
                                Err(ERR_NO_RESOURCES) => {}
                                Err(ERR_INVALID_ALLOCATOR) => return,
                                Err(e) => panic!("allocation: {e}"),
                            }
                        }
                    })
                })
                .collect();
            go.wait();
            for _ in 0..round % 64 {
                std::hint::spin_loop();
            }
            alloc_free(&mut *a).expect("alloc_free");
            for t in threads {
                t.join().expect("allocating thread");
            }
            let e = pool(id).expect("the pool stays until collected");
            let owned: Vec<usize> = (0..8).filter(|&i| e.slot(i).owned.is_some()).collect();
            assert!(owned.is_empty(), "round {round}: buffers {owned:?} owned after the allocator's free");
            let in_domain = e.allocator.as_ref().expect("the allocator").available();
            assert_eq!(in_domain, 8, "round {round}: the domain's free list after the allocator's free");
            drop(e);
            forget(&[id]);
        }
    }
}
