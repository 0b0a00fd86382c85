//! The pools this process knows, their C objects, the program's buffer
//! handles (by pool and index) and the allocators: one table behind one
//! lock. Taken after a waitset's lock, never before (see `state`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{LazyLock, Mutex, MutexGuard};

use ferry::{Allocator, Buffer, BufferCopy, BufferId, BufferState, Pool, PoolConstraints, PoolId, TrustLevel};

use crate::boundary;
use crate::cmem::CArray;
use crate::codes::*;
use crate::ffi::*;
use crate::state::{new_token, Res, DOMAIN};

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(|| Mutex::new(Table::default()));

/// The table, locked. A panic while it was held leaves it usable: every
/// change is made after the checks that can fail.
pub fn table() -> MutexGuard<'static, Table> {
    TABLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which of a buffer's two C objects a pointer names.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum View {
    /// The owner's (allocator, move, pass; `pool->buffers`).
    Owner,
    /// The second one, for a copy held beside the owner's buffer.
    Copy,
}

/// The handles of one buffer that the program holds.
#[derive(Default)]
pub struct Slot {
    /// The program owns the buffer.
    pub owned: Option<Buffer>,
    /// Copies the program received, with the channel each came over and
    /// the C object it was given with.
    pub copies: Vec<(usize, BufferCopy, View)>,
}

/// A pool this process knows, with its C objects.
pub struct PoolEntry {
    /// Ferry's handle (keeps the pool in the domain's list).
    pub pool: Pool,
    cpool: CArray<BulkPool>,
    bufs: CArray<BulkBuffer>,
    /// The second object of each buffer (same address; its own state and
    /// count), for a copy held beside the owner's buffer.
    copy_bufs: CArray<BulkBuffer>,
    /// The pool's `buffers` array.
    _ptrs: CArray<*mut BulkBuffer>,
    /// The program's handles, by index.
    pub slots: Vec<Slot>,
    /// Made by bulk_alloc_init.
    allocator: Option<Allocator>,
}

impl PoolEntry {
    /// The `struct bulk_pool`.
    pub fn pool_ptr(&self) -> usize {
        self.cpool.ptr(0) as usize
    }

    /// Buffer `i`'s C object of `view`.
    pub fn buffer_ptr(&self, i: usize, view: View) -> usize {
        match view {
            View::Owner => self.bufs.ptr(i) as usize,
            View::Copy => self.copy_bufs.ptr(i) as usize,
        }
    }

    /// Rewrites buffer `i`'s C objects from the handles and the domain.
    pub fn refresh(&mut self, i: usize) {
        let id = BufferId { pool: self.pool.id(), index: i as u32 };
        let slot = &self.slots[i];
        let held = |v: View| slot.copies.iter().filter(|c| c.2 == v).count() as u32;
        let (owner_copies, view_copies) = (held(View::Owner), held(View::Copy));
        let read_only = buffer_state_to(BufferState::ReadOnly);
        // The owner's object: the domain's state while the program owns the
        // buffer (READ_WRITE, or RO_OWNED with copies out); READ_ONLY while
        // a copy was given with it; else INVALID. The second object:
        // READ_ONLY while a copy was given with it.
        let owner_state = match (&slot.owned, owner_copies) {
            (Some(_), _) => buffer_state_to(DOMAIN.buffer_state(id)),
            (None, 0) => 0,
            (None, _) => read_only,
        };
        let copy_state = if view_copies > 0 { read_only } else { 0 };
        self.bufs.update(i, |b| {
            b.state = owner_state;
            b.local_ref_count = owner_copies;
        });
        self.copy_bufs.update(i, |b| {
            b.state = copy_state;
            b.local_ref_count = view_copies;
        });
    }

    /// Rewrites the pool's trust from the domain.
    pub fn refresh_trust(&mut self) {
        let t = trust_to(DOMAIN.pool_trust(self.pool.id()).unwrap_or(TrustLevel::Uninitialized));
        self.cpool.update(0, |p| p.trust = t);
    }

    /// Whether nothing but channels may refer to the pool.
    fn unheld(&self) -> bool {
        self.allocator.is_none() && self.slots.iter().all(|s| s.owned.is_none() && s.copies.is_empty())
    }
}

/// An allocator struct initialized by bulk_alloc_init.
struct AllocEntry {
    c_addr: usize,
    pool: PoolId,
}

/// The table.
#[derive(Default)]
pub struct Table {
    /// The pools, by id.
    pub pools: HashMap<PoolId, PoolEntry>,
    /// `struct bulk_pool` address → pool.
    pool_addr: HashMap<usize, PoolId>,
    /// Address of a pool's first `struct bulk_buffer` of each view → pool.
    buffer_addr: BTreeMap<usize, (PoolId, View)>,
    allocators: HashMap<usize, AllocEntry>,
    /// Counts the moments a channel may have started to refer to a pool
    /// (an assignment, an offer), so that collecting pools can tell that
    /// what it saw of the channels is out of date.
    pub generation: u64,
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

fn new_buffers(n: usize, base: usize, size: usize, pool: *mut BulkPool) -> CArray<BulkBuffer> {
    CArray::new(
        (0..n)
            .map(|i| BulkBuffer {
                address: (base + i * size) as *mut std::ffi::c_void,
                pool,
                bufferid: i as u32,
                state: 0,
                local_ref_count: 0,
                reserved: 0,
            })
            .collect(),
    )
}

impl Table {
    /// The C pool of a pool this process knows (made on first sight).
    pub fn pool_ptr_or_add(&mut self, id: PoolId) -> Option<usize> {
        if let Some(e) = self.pools.get(&id) {
            return Some(e.pool_ptr());
        }
        let pool = DOMAIN.pool(id)?;
        Some(self.add_pool(pool, None))
    }

    /// Registers a pool and makes its C objects; the `struct bulk_pool`'s address.
    fn add_pool(&mut self, pool: Pool, allocator: Option<Allocator>) -> usize {
        let id = pool.id();
        let g = pool.geometry();
        let (n, size, base) = (g.count() as usize, g.buffer_size(), pool.base_address());
        let mut cpool = CArray::new(vec![BulkPool {
            id: pool_id_words(id),
            base_address: base,
            buffer_size: size,
            trust: 0,
            num_buffers: n,
            buffers: std::ptr::null_mut(),
        }]);
        let pool_ptr = cpool.ptr(0);
        let bufs = new_buffers(n, base, size, pool_ptr);
        let copy_bufs = new_buffers(n, base, size, pool_ptr);
        let ptrs = CArray::new((0..n).map(|i| bufs.ptr(i)).collect());
        let ptrs_base = ptrs.ptr(0);
        cpool.update(0, |p| p.buffers = ptrs_base);
        self.pool_addr.insert(pool_ptr as usize, id);
        self.buffer_addr.insert(bufs.base(), (id, View::Owner));
        self.buffer_addr.insert(copy_bufs.base(), (id, View::Copy));
        let slots = (0..n).map(|_| Slot::default()).collect();
        let mut e = PoolEntry { pool, cpool, bufs, copy_bufs, _ptrs: ptrs, slots, allocator };
        e.refresh_trust();
        for i in 0..n {
            e.refresh(i);
        }
        self.pools.insert(id, e);
        pool_ptr as usize
    }

    /// The pool at a `struct bulk_pool` address.
    pub fn pool_at(&self, p: usize) -> Res<PoolId> {
        self.pool_addr.get(&p).copied().ok_or(ERR_INVALID_POOL)
    }

    /// The pool, index and view of a `struct bulk_buffer` address.
    pub fn buffer_at(&self, p: usize) -> Res<(PoolId, usize, View)> {
        let (&base, &(id, view)) = self.buffer_addr.range(..=p).next_back().ok_or(ERR_INVALID_BUFFER)?;
        let e = self.pools.get(&id).ok_or(ERR_INVALID_BUFFER)?;
        let size = std::mem::size_of::<BulkBuffer>();
        let off = p - base;
        if off % size != 0 || off / size >= e.bufs.len() {
            return Err(ERR_INVALID_BUFFER);
        }
        Ok((id, off / size, view))
    }

    /// The pools that nothing but a channel may refer to.
    pub fn unheld_pools(&self) -> Vec<PoolId> {
        self.pools.iter().filter(|(_, e)| e.unheld()).map(|(id, _)| *id).collect()
    }

    /// Forgets a pool that is still unheld; its C objects are freed.
    pub fn forget(&mut self, id: PoolId) {
        if self.pools.get(&id).is_some_and(|e| e.unheld()) {
            if let Some(e) = self.pools.remove(&id) {
                self.pool_addr.remove(&e.pool_ptr());
                self.buffer_addr.remove(&e.bufs.base());
                self.buffer_addr.remove(&e.copy_bufs.base());
            }
        }
    }

    /// `bulk_pool_domain_list_get`.
    pub fn pool_by_id(&mut self, id: PoolId) -> Option<usize> {
        self.pool_ptr_or_add(id)
    }

    /// `bulk_buffer_change_state`.
    pub fn buffer_change_state(&mut self, buffer: usize, state: u32) -> Res<()> {
        let (id, i, view) = self.buffer_at(buffer)?;
        if state > 3 {
            return Err(ERR_INVALID_ARGUMENT);
        }
        let e = self.pools.get_mut(&id).ok_or(ERR_INVALID_BUFFER)?;
        e.refresh(i);
        let now = match view {
            View::Owner => e.bufs.read(i, |b| b.state),
            View::Copy => e.copy_bufs.read(i, |b| b.state),
        };
        if now == state {
            Ok(())
        } else {
            Err(ERR_BUFFER_STATE)
        }
    }

    // ------------------------------------------------------------------ allocators

    fn alloc_entry(&self, a: *mut BulkAllocator) -> Res<(usize, PoolId)> {
        let token = boundary::allocator_token(a);
        match self.allocators.get(&token) {
            Some(e) if e.c_addr == a as usize => Ok((token, e.pool)),
            _ => Err(ERR_INVALID_ALLOCATOR),
        }
    }

    /// `bulk_alloc_init`.
    pub fn alloc_init(
        &mut self,
        a: *mut BulkAllocator,
        count: usize,
        size: usize,
        c: Option<BulkPoolConstraints>,
    ) -> Res<()> {
        if self.alloc_entry(a).is_ok() {
            return Err(ERR_ALLOCATOR_IN_USE);
        }
        let (trust, alignment) = match c {
            Some(c) => (trust_from(c.trust).ok_or(ERR_INVALID_ARGUMENT)?, c.alignment),
            None => (TrustLevel::Uninitialized, 0),
        };
        let count = u64::try_from(count).map_err(|_| ERR_BAD_BUFFER_SIZE)?;
        let alloc =
            Allocator::new(&DOMAIN, count, size, PoolConstraints { trust, alignment }).map_err(|e| of_error(&e))?;
        let pool = DOMAIN.pool(alloc.pool().id()).ok_or(ERR_INTERNAL)?;
        let id = pool.id();
        let free = alloc.available();
        let pool_ptr = self.add_pool(pool, Some(alloc));
        let token = new_token();
        self.allocators.insert(token, AllocEntry { c_addr: a as usize, pool: id });
        boundary::write_allocator(a, pool_ptr as *mut BulkPool, free, token);
        Ok(())
    }

    /// `bulk_alloc_free` (the caller collects the pool afterwards).
    pub fn alloc_free(&mut self, a: *mut BulkAllocator) -> Res<()> {
        let (token, id) = self.alloc_entry(a)?;
        self.allocators.remove(&token);
        if let Some(e) = self.pools.get_mut(&id) {
            // The program's handles of the pool go back first, then the allocator.
            for s in &mut e.slots {
                s.owned = None;
                s.copies.clear();
            }
            e.allocator = None;
            for i in 0..e.slots.len() {
                e.refresh(i);
            }
        }
        boundary::clear_allocator(a);
        Ok(())
    }

    /// `bulk_alloc_new_buffer`.
    pub fn alloc_new_buffer(&mut self, a: *mut BulkAllocator) -> Res<usize> {
        let (_, id) = self.alloc_entry(a)?;
        let e = self.pools.get_mut(&id).ok_or(ERR_INTERNAL)?;
        let alloc = e.allocator.as_ref().ok_or(ERR_INTERNAL)?;
        let Some(b) = alloc.alloc() else {
            boundary::set_num_free(a, 0);
            return Err(ERR_NO_RESOURCES);
        };
        let free = alloc.available();
        let i = b.id().index as usize;
        e.slots[i].owned = Some(b);
        e.refresh(i);
        boundary::set_num_free(a, free);
        Ok(e.buffer_ptr(i, View::Owner))
    }

    /// `bulk_alloc_return_buffer`.
    pub fn alloc_return_buffer(&mut self, a: *mut BulkAllocator, buffer: usize) -> Res<()> {
        let (_, id) = self.alloc_entry(a)?;
        let (bpool, i, view) = self.buffer_at(buffer)?;
        if bpool != id {
            return Err(ERR_FOREIGN_POOL);
        }
        let e = self.pools.get_mut(&id).ok_or(ERR_INTERNAL)?;
        let alloc = e.allocator.as_ref().ok_or(ERR_INTERNAL)?;
        if view == View::Copy || e.slots[i].owned.is_none() {
            return Err(ERR_BUFFER_NOT_OWNED);
        }
        // A buffer whose copies are out stays with the program: handed out
        // again, its new user could not write it.
        if DOMAIN.buffer_state(BufferId { pool: id, index: i as u32 }) == BufferState::ReadOnlyOwned {
            return Err(ERR_COPIES_OUTSTANDING);
        }
        let b = e.slots[i].owned.take().ok_or(ERR_BUFFER_NOT_OWNED)?;
        if let Err(r) = alloc.free(b) {
            e.slots[i].owned = Some(r.value);
            return Err(of_error(&r.error));
        }
        let free = alloc.available();
        e.refresh(i);
        boundary::set_num_free(a, free);
        Ok(())
    }

    /// Takes the handles the program held of buffers received over a
    /// destroyed channel and never handed to it (their callbacks were
    /// dropped), and the copies it held over that channel.
    pub fn drop_channel_handles(&mut self, token: usize, never_handed: &[BufferId]) {
        for id in never_handed {
            if let Some(e) = self.pools.get_mut(&id.pool) {
                e.slots[id.index as usize].owned = None;
                e.refresh(id.index as usize);
            }
        }
        for e in self.pools.values_mut() {
            for i in 0..e.slots.len() {
                if e.slots[i].copies.iter().any(|c| c.0 == token) {
                    e.slots[i].copies.retain(|c| c.0 != token);
                    e.refresh(i);
                }
            }
        }
    }
}
