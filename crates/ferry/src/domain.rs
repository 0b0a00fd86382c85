//! A protection domain's view of the bulk-transfer state: its pool list
//! ([ETH-BT] §6.5.3) and, for every buffer of every pool it knows, the
//! per-domain state of [ETH-BT] §5.1.1 with the copy bookkeeping of
//! Algorithms 9–10. Every buffer-state transition of the library happens in
//! this file; channels call these transitions, backends never do.
//!
//! Normally a domain is a process; the local backend lets several domains
//! live in one process, each with its own mapping of every pool it knows.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::buffer::{Buffer, BufferCopy, BufferId, BufferState};
use crate::error::Result;
use crate::pool::{Geometry, PoolId, PoolMap, PoolMemory, PoolView, TrustLevel};
use crate::sys::Access;
use crate::ErrorKind;

/// Identifies a channel end inside its domain.
pub(crate) type ChanKey = u64;

/// A protection domain: owner of buffers and endpoint of channels.
///
/// Cloning gives another handle to the same domain.
///
/// ```
/// let d = ferry::Domain::new("app");
/// assert_eq!(d.name(), "app");
/// assert!(d.pools().is_empty());
/// ```
#[derive(Clone)]
pub struct Domain {
    pub(crate) shared: Arc<DomainShared>,
}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain").field("id", &self.shared.id).field("name", &self.shared.name).finish()
    }
}

/// See [`DomainShared::has_deferred`].
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct DeferredFlag(AtomicBool);

impl std::ops::Deref for DeferredFlag {
    type Target = AtomicBool;
    fn deref(&self) -> &AtomicBool {
        &self.0
    }
}

/// Its lock is taken for every buffer operation: whole 128-byte blocks
/// of its own keep another domain's lock, in another thread, off its cache
/// lines (two domains made one after the other are neighbours in memory).
#[repr(align(128))]
pub(crate) struct DomainShared {
    pub(crate) id: u64,
    name: String,
    /// Every buffer state of the domain, behind one lock taken once per
    /// operation: alloc, a send (move, pass, copy), a delivery, a handle
    /// dropped; a release twice (its state changes only after it is sent),
    /// a flush of dropped copies twice however many. A move and pass back
    /// is six acquisitions in all, wherever the two ends live.
    ///
    /// Not split per pool or per buffer: the two ends of one channel use
    /// the same pools and buffers, so a finer lock would not keep them
    /// apart; and the domain-wide parts (the pool list that every
    /// operation looks its pool up in, the free clock, deferred releases,
    /// pinned buffers, closed channels' copies) would need a second lock
    /// taken with the first in a fixed order. What two threads of one
    /// domain share is kept short instead: a buffer operation's critical
    /// section is a look-up and a few field updates (system calls only for
    /// the `mprotect` of a trust level that asks for it, and once per pool
    /// for its ledger).
    state: Mutex<DomainState>,
    next_chan: AtomicU64,
    /// Some copy handle was dropped and waits for its channel to release
    /// it: lets channels skip the lock on every poll. Read by every send
    /// of every thread of the domain, written rarely: on a line of its own,
    /// away from the lock and the state that operations write.
    pub(crate) has_deferred: DeferredFlag,
    /// Held by a channel from finding an offered pool unknown until it is
    /// in the list: two threads taking offers of the same new pool at once
    /// must not both import it (the second would replace the first's
    /// memory in the list, under the first channel's feet). Offers are
    /// rare; the state lock is not held across the import's system calls.
    imports: Mutex<()>,
}

impl std::fmt::Debug for DomainShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DomainShared").field("id", &self.id).field("name", &self.name).finish()
    }
}

static NEXT_DOMAIN: AtomicU64 = AtomicU64::new(1);

impl Domain {
    /// A new, empty domain.
    pub fn new(name: &str) -> Domain {
        let shared = Arc::new(DomainShared {
            id: NEXT_DOMAIN.fetch_add(1, Ordering::Relaxed),
            name: name.to_owned(),
            state: Mutex::new(DomainState::default()),
            next_chan: AtomicU64::new(1),
            has_deferred: DeferredFlag::default(),
            imports: Mutex::new(()),
        });
        crate::inspect::register_domain(&shared);
        Domain { shared }
    }

    /// The name given at creation.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// This domain's state of a buffer (`Invalid` for unknown pools). A
    /// buffer moved or passed between two ends of this domain over a local
    /// channel at trust FULL stays this domain's while it travels (see
    /// docs/SEMANTICS.md, "Both ends in one domain"): `ReadWrite` then,
    /// where a buffer on its way to another domain is `Invalid`.
    pub fn buffer_state(&self, id: BufferId) -> BufferState {
        self.shared.lock_settled().buffer_state(id.pool, id.index)
    }

    /// The pools in this domain's pool list.
    pub fn pools(&self) -> Vec<PoolId> {
        let mut v: Vec<PoolId> = self.shared.lock().pools.keys().copied().collect();
        v.sort();
        v
    }

    /// A handle to a pool in this domain's pool list (it keeps the pool
    /// there while it lives, like the pool's [`crate::Allocator`]).
    pub fn pool(&self, id: PoolId) -> Option<Pool> {
        let mut st = self.shared.lock();
        let e = st.pools.get_mut(&id)?;
        e.handles += 1;
        Some(Pool { view: e.view.clone(), domain: self.shared.clone() })
    }

    /// The trust level this domain records for a pool.
    pub fn pool_trust(&self, id: PoolId) -> Option<TrustLevel> {
        self.shared.lock().pools.get(&id).map(|e| e.trust)
    }

    /// Take a free buffer of `pool` that this domain owns (LIFO: the most
    /// recently freed first, so its cache lines and TLB entries are warm).
    pub fn alloc(&self, pool: PoolId) -> Option<Buffer> {
        let mut st = self.shared.lock_settled();
        let entry = st.pools.get_mut(&pool)?;
        if let Some(index) = entry.pop_free() {
            let (domain, view) = entry.spare_refs(&self.shared);
            drop(st);
            return Some(Buffer::new(domain, view, index));
        }
        // Empty: what a process that has exited since its channel closed
        // still held comes back first.
        if !self.shared.reclaim_from_exited(&mut st) {
            return None;
        }
        let entry = st.pools.get_mut(&pool)?;
        let index = entry.pop_free()?;
        let (domain, view) = entry.spare_refs(&self.shared);
        drop(st);
        Some(Buffer::new(domain, view, index))
    }

    /// Take the most recently freed buffer of any of `pools` (a data path's):
    /// the top of the free list whose top was freed last (buffers never
    /// freed count as oldest, the first pool first among them).
    pub(crate) fn alloc_latest(&self, pools: &[PoolId]) -> Option<Buffer> {
        let mut st = self.shared.lock_settled();
        let stamp = |e: &PoolEntry| e.free.last().map(|&i| e.records[i as usize].freed_at);
        let mut best: Option<(PoolId, u64)> = None;
        for id in pools {
            if let Some(t) = st.pools.get(id).and_then(stamp) {
                if best.is_none_or(|(_, b)| t > b) {
                    best = Some((*id, t));
                }
            }
        }
        let Some((best, _)) = best else {
            // Empty: what exited processes held may come back (see `alloc`).
            if self.shared.reclaim_from_exited(&mut st) {
                drop(st);
                return self.alloc_latest(pools);
            }
            return None;
        };
        let entry = st.pools.get_mut(&best)?;
        let index = entry.pop_free()?;
        let (domain, view) = entry.spare_refs(&self.shared);
        drop(st);
        Some(Buffer::new(domain, view, index))
    }

    /// Number of free buffers of `pool` owned by this domain.
    pub fn free_count(&self, pool: PoolId) -> usize {
        self.shared.lock().pools.get(&pool).map_or(0, |e| e.free.len())
    }

    /// What this domain holds of each pool in its list: free, in use,
    /// lent, copies held and out (docs/INSPECT.md).
    ///
    /// ```
    /// let d = ferry::Domain::new("app");
    /// let alloc = ferry::Allocator::new(&d, 4, 4096, ferry::PoolConstraints::default())?;
    /// let _taken = alloc.alloc().unwrap();
    /// let stats = d.stats();
    /// assert_eq!((stats.pools[0].2.free, stats.pools[0].2.in_use), (3, 1));
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn stats(&self) -> crate::DomainStats {
        let st = self.shared.lock();
        let pools = st.pools.iter().map(|(id, e)| (*id, e.view.geometry(), e.stats())).collect();
        crate::DomainStats { name: self.shared.name.clone(), pools }
    }

    pub(crate) fn id(&self) -> u64 {
        self.shared.id
    }

    pub(crate) fn new_chan_key(&self) -> ChanKey {
        self.shared.next_chan.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, DomainState> {
        self.shared.lock()
    }
}

impl DomainShared {
    /// The name given at creation.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Serialize the offers of pools this domain may not know yet (see
    /// `DomainShared::imports`); never taken while the state lock is held.
    pub(crate) fn importing(&self) -> MutexGuard<'_, ()> {
        self.imports.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, DomainState> {
        // A panic while holding the lock leaves consistent data (every
        // transition is a few field updates), so poisoning is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`DomainState::reclaim_from_exited`] under the lock `st` of this
    /// domain, flagging what it left pending (read-only buffers waiting for
    /// copies); true if a process was found gone.
    pub(crate) fn reclaim_from_exited(&self, st: &mut DomainState) -> bool {
        if !st.reclaim_from_exited() {
            return false;
        }
        if !st.nothing_pending() {
            self.has_deferred.store(true, Ordering::Release);
        }
        true
    }

    /// The lock, after unpinning the buffers whose copies are all back
    /// (see [`DomainState::pin_if_copies_out`]): for the calls that read
    /// or hand out buffers without a channel.
    pub(crate) fn lock_settled(&self) -> MutexGuard<'_, DomainState> {
        let mut st = self.lock();
        if self.has_deferred.load(Ordering::Acquire) {
            st.settle_pinned();
        }
        st
    }
}

/// Per-domain record of one buffer.
#[derive(Debug, Default, Clone)]
pub(crate) struct BufRecord {
    /// This domain owns the buffer and it has been delivered here.
    owned: bool,
    /// Copies sent from here, per channel (owner's copies and forwarded ones).
    copies_out: Vec<(ChanKey, u32)>,
    /// Copies received here and not released, per channel.
    copies_in: Vec<(ChanKey, u32)>,
    /// The owner dropped its handle while copies were out: free it when the
    /// last copy comes back.
    free_when_writable: bool,
    /// Protection currently applied to this buffer in this domain's view.
    applied: Option<Access>,
    /// The channel the buffer last arrived on (moved or passed to us).
    arrived_via: Option<ChanKey>,
    /// The channel to a peer process we last gave it away on, and the
    /// pool ledger's departure count then (see [`crate::ledger`]).
    lent_on: Option<(ChanKey, u32)>,
    /// When it last went on the free list (the domain's free clock), for
    /// the most-recently-freed-first choice across pools of a data path.
    freed_at: u64,
}

fn count(list: &[(ChanKey, u32)], chan: ChanKey) -> u32 {
    list.iter().find(|(c, _)| *c == chan).map_or(0, |(_, n)| *n)
}

fn bump(list: &mut Vec<(ChanKey, u32)>, chan: ChanKey) {
    match list.iter_mut().find(|(c, _)| *c == chan) {
        Some((_, n)) => *n += 1,
        None => list.push((chan, 1)),
    }
}

fn drop_one(list: &mut Vec<(ChanKey, u32)>, chan: ChanKey) -> bool {
    if let Some(pos) = list.iter().position(|(c, _)| *c == chan) {
        list[pos].1 -= 1;
        if list[pos].1 == 0 {
            list.swap_remove(pos);
        }
        true
    } else {
        false
    }
}

impl BufRecord {
    pub(crate) fn state(&self) -> BufferState {
        if self.owned {
            if self.copies_out.is_empty() && self.copies_in.is_empty() {
                BufferState::ReadWrite
            } else {
                BufferState::ReadOnlyOwned
            }
        } else if !self.copies_in.is_empty() {
            BufferState::ReadOnly
        } else {
            BufferState::Invalid
        }
    }

    pub(crate) fn held_via(&self, chan: ChanKey) -> u32 {
        count(&self.copies_in, chan)
    }

    pub(crate) fn has_forwarded(&self) -> bool {
        !self.copies_out.is_empty()
    }

    pub(crate) fn copies_out_via(&self, chan: ChanKey) -> u32 {
        count(&self.copies_out, chan)
    }

    pub(crate) fn is_owned(&self) -> bool {
        self.owned
    }

    /// Whether a copy of this buffer may arrive here. A copy exists only
    /// because its owner sent one, so an owner with no copy out cannot
    /// receive one back: a peer that sends it forged it (and would leave
    /// our buffer read-only until that copy went back).
    pub(crate) fn may_receive_copy(&self) -> bool {
        !self.owned || !self.copies_out.is_empty()
    }
}

#[derive(Debug)]
pub(crate) struct PoolEntry {
    pub(crate) view: Arc<PoolView>,
    pub(crate) trust: TrustLevel,
    /// Created here, or an assignment of it was accepted: this domain may
    /// offer it on its channels (a pool only offered to us may not).
    pub(crate) permanent: bool,
    /// Live [`Pool`] handles of the pool in this domain (an allocator holds
    /// one). With `channels`, the buffer handles and the copies held here,
    /// what keeps the entry in the list (see [`PoolEntry::unused`]).
    pub(crate) handles: u32,
    /// The trust level can no longer go back to `Uninitialized` (set at
    /// creation, or some assignment was accepted).
    pub(crate) trust_fixed: bool,
    /// Channel relations of this domain to the pool: one per channel that
    /// lists it or has our request out, plus one per unanswered request.
    pub(crate) channels: u32,
    /// What `stats` reports that the free list does not say.
    holdings: Holdings,
    records: Vec<BufRecord>,
    /// Changed only through `pop_free` and `push_free`, which keep the
    /// view's count of it (read without the lock) in step.
    free: Vec<u32>,
    /// References to `view` from dropped buffer handles, for the next
    /// `alloc` (taking a new one is a locked instruction, and so is
    /// dropping one).
    spare_views: Vec<Arc<PoolView>>,
    /// References to the domain itself from dropped buffer handles, for
    /// the next `alloc`, as `spare_views`. A reference to the domain held
    /// in its own state is a cycle, so they are kept only while a [`Pool`]
    /// handle lives (`handles > 0`), which holds the domain anyway: the
    /// last handle's drop lets them go (see `pool_handle_dropped`), and
    /// the domain lives no longer than it did without them.
    spare_domains: Vec<Arc<DomainShared>>,
}

/// Counts of a pool entry's records, kept with each state change (for
/// [`PoolEntry::stats`], so the registry never walks the records).
#[derive(Debug, Default)]
struct Holdings {
    created: bool,
    owned: u32,
    copies_held: u32,
    copies_out: u32,
}

impl PoolEntry {
    /// What the domain holds of the pool (see [`crate::PoolStats`]).
    pub(crate) fn stats(&self) -> crate::PoolStats {
        let h = &self.holdings;
        let free = self.free.len() as u32;
        crate::PoolStats {
            free,
            in_use: h.owned.saturating_sub(free),
            lent: if h.created { self.view.geometry().count().saturating_sub(h.owned) } else { 0 },
            copies_held: h.copies_held,
            copies_out: h.copies_out,
        }
    }

    /// No pool handle and no channel relation: the entry lives on only
    /// while buffers or copies of it are held here. One test of two fields,
    /// cheap enough for every dropped buffer handle.
    #[inline]
    fn orphaned(&self) -> bool {
        self.handles == 0 && self.channels == 0
    }

    /// Nothing of this domain refers to the pool any more: no pool handle,
    /// no channel relation, no copy held here (its handle live or its
    /// release pending), and every buffer owned here is at rest on the free
    /// list (no buffer handle; an owned buffer waiting for its copies to
    /// come back has no handle either). Buffers this domain gave away and
    /// copies it sent do not count: they travel only on channels the pool
    /// is on, and after those closed, their holders have views of their
    /// own.
    fn unused(&self) -> bool {
        if !self.orphaned() {
            return false;
        }
        let mut resting = self.free.len();
        for r in &self.records {
            if !r.copies_in.is_empty() {
                return false;
            }
            if r.owned && !r.free_when_writable {
                // Owned, read-write, no handle: on the free list.
                if resting == 0 {
                    return false;
                }
                resting -= 1;
            }
        }
        true
    }

    /// The references a new buffer handle holds: kept ones from dropped
    /// handles if there are (no locked instruction), else new ones.
    #[inline]
    fn spare_refs(&mut self, domain: &Arc<DomainShared>) -> (Arc<DomainShared>, Arc<PoolView>) {
        let domain = self.spare_domains.pop().unwrap_or_else(|| domain.clone());
        let view = self.spare_views.pop().unwrap_or_else(|| self.view.clone());
        (domain, view)
    }

    /// Takes the most recently freed buffer off the free list.
    fn pop_free(&mut self) -> Option<u32> {
        let index = self.free.pop()?;
        self.view.set_free_count(self.free.len());
        Some(index)
    }

    /// Puts a buffer on the free list.
    fn push_free(&mut self, index: u32) {
        self.free.push(index);
        self.view.set_free_count(self.free.len());
    }

    /// Any copy of a buffer of this pool out over, or held via, `chan`.
    pub(crate) fn copies_on(&self, chan: ChanKey) -> bool {
        self.records.iter().any(|r| r.copies_out_via(chan) > 0 || r.held_via(chan) > 0)
    }
}

/// A domain's pool list: the entries in a vector, found through the one
/// found last (a domain's traffic is mostly on one pool) or else a hash
/// index. Each buffer operation looks its pool up once or twice, and the
/// hash lookup cost ~45 instructions each (15% of a move's round trip).
#[derive(Default)]
pub(crate) struct PoolList {
    entries: Vec<(PoolId, PoolEntry)>,
    index: PoolMap<usize>,
    /// Position of the entry found last (may be stale: it is checked).
    last: Cell<usize>,
}

impl PoolList {
    #[inline]
    fn find(&self, id: &PoolId) -> Option<usize> {
        let last = self.last.get();
        if self.entries.get(last).is_some_and(|(p, _)| p == id) {
            return Some(last);
        }
        self.find_indexed(id)
    }

    #[inline(never)]
    fn find_indexed(&self, id: &PoolId) -> Option<usize> {
        let i = *self.index.get(id)?;
        self.last.set(i);
        Some(i)
    }

    #[inline]
    pub(crate) fn get(&self, id: &PoolId) -> Option<&PoolEntry> {
        self.find(id).map(|i| &self.entries[i].1)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, id: &PoolId) -> Option<&mut PoolEntry> {
        self.find(id).map(|i| &mut self.entries[i].1)
    }

    fn insert(&mut self, id: PoolId, entry: PoolEntry) {
        match self.find(&id) {
            Some(i) => self.entries[i].1 = entry,
            None => {
                self.index.insert(id, self.entries.len());
                self.entries.push((id, entry));
            }
        }
    }

    fn remove(&mut self, id: &PoolId) -> Option<PoolEntry> {
        let i = self.index.remove(id)?;
        let (_, entry) = self.entries.swap_remove(i);
        if let Some((moved, _)) = self.entries.get(i) {
            self.index.insert(*moved, i);
        }
        Some(entry)
    }

    fn keys(&self) -> impl Iterator<Item = &PoolId> {
        self.entries.iter().map(|(id, _)| id)
    }

    fn iter(&self) -> impl Iterator<Item = (&PoolId, &PoolEntry)> {
        self.entries.iter().map(|(id, e)| (id, e))
    }
}

/// The library state of one domain. Guarded by the domain's mutex.
#[derive(Default)]
pub(crate) struct DomainState {
    pub(crate) pools: PoolList,
    /// Copies whose handles were dropped: to be released over their channel
    /// the next time that channel runs.
    deferred_releases: Vec<(ChanKey, BufferId)>,
    /// Owned buffers kept read-only after a peer process died, while copies
    /// of them may still be read by live processes (see [`PINNED`]).
    pinned: Vec<BufferId>,
    /// Closed channels of which we still hold copies, and whether their
    /// peer was another process: a copy dropped now is released here.
    orphan_chans: Vec<(ChanKey, bool)>,
    /// Closed channels' lendings to peer processes that still held them:
    /// they come back if the process exits (see
    /// [`DomainState::reclaim_from_exited`]).
    watches: Vec<LendingWatch>,
    /// Counts buffers put on free lists (see [`BufRecord::freed_at`]).
    free_clock: u64,
}

/// Pseudo channel under which an owner counts one copy out while the pool
/// ledger says copies of the buffer sent between processes are not back,
/// after a process died that may have made or forwarded some: the owner
/// cannot know which, so it waits until none is out (see [`crate::ledger`]).
const PINNED: ChanKey = ChanKey::MAX;

impl DomainState {
    pub(crate) fn buffer_state(&self, pool: PoolId, index: u32) -> BufferState {
        match self.pools.get(&pool) {
            Some(e) if index < e.view.geometry().count() => e.records[index as usize].state(),
            _ => BufferState::Invalid,
        }
    }

    #[inline]
    pub(crate) fn entry(&self, pool: PoolId) -> Option<&PoolEntry> {
        self.pools.get(&pool)
    }

    #[inline]
    pub(crate) fn entry_mut(&mut self, pool: PoolId) -> Option<&mut PoolEntry> {
        self.pools.get_mut(&pool)
    }

    #[inline]
    pub(crate) fn record(&self, id: BufferId) -> Option<&BufRecord> {
        let e = self.pools.get(&id.pool)?;
        e.records.get(id.index as usize)
    }

    /// Insert a pool allocated here: every buffer owned, read-write, free;
    /// counted with one pool handle (the caller's).
    pub(crate) fn insert_created(&mut self, view: Arc<PoolView>, trust: TrustLevel) {
        let n = view.geometry().count();
        let records =
            vec![BufRecord { owned: true, applied: Some(Access::ReadWrite), ..BufRecord::default() }; n as usize];
        // Reverse order so that buffer 0 is handed out first.
        let free: Vec<u32> = (0..n).rev().collect();
        for i in 0..n {
            view.set_state(i, BufferState::ReadWrite);
        }
        view.set_free_count(free.len());
        let trust_fixed = trust != TrustLevel::Uninitialized;
        let entry = PoolEntry {
            view,
            trust,
            permanent: true,
            handles: 1,
            trust_fixed,
            channels: 0,
            holdings: Holdings { created: true, owned: n, ..Holdings::default() },
            records,
            free,
            spare_views: Vec::new(),
            spare_domains: Vec::new(),
        };
        self.pools.insert(entry.view.id(), entry);
    }

    /// Insert a pool learned from a peer: no buffer is ours yet.
    pub(crate) fn insert_received(&mut self, view: Arc<PoolView>, trust: TrustLevel) -> Result<()> {
        let n = view.geometry().count() as usize;
        let applied = if trust.protects() {
            view.protect_all(Access::None)?;
            Some(Access::None)
        } else {
            Some(Access::ReadWrite)
        };
        let records = vec![BufRecord { applied, ..BufRecord::default() }; n];
        self.pools.insert(
            view.id(),
            PoolEntry {
                view,
                trust,
                permanent: false,
                handles: 0,
                trust_fixed: false,
                channels: 0,
                holdings: Holdings::default(),
                records,
                free: Vec::new(),
                spare_views: Vec::new(),
                spare_domains: Vec::new(),
            },
        );
        Ok(())
    }

    /// After a state change of a buffer: record in the view whether it is
    /// ours read-write (the lock-free mirror move and pass check), and bring
    /// its page protection in line with its state when the pool's trust
    /// level asks for protection (HALF, NONE).
    #[inline]
    fn sync_protection(entry: &mut PoolEntry, index: u32) {
        let rec = &mut entry.records[index as usize];
        let state = rec.state();
        entry.view.set_state(index, state);
        if !entry.trust.protects() {
            return;
        }
        let want = match state {
            BufferState::ReadWrite => Access::ReadWrite,
            BufferState::ReadOnlyOwned | BufferState::ReadOnly => Access::Read,
            BufferState::Invalid => Access::None,
        };
        if rec.applied != Some(want) {
            // mprotect on a range of our own mapping cannot fail except for
            // ENOMEM when the kernel cannot split the VMA; then the buffer
            // keeps its old protection (HALF guards against accidents only).
            if entry.view.protect(index, want).is_ok() {
                rec.applied = Some(want);
            }
        }
    }

    #[inline]
    fn rec_mut(&mut self, id: BufferId) -> &mut PoolEntry {
        self.pools.get_mut(&id.pool).expect("pool checked by caller")
    }

    /// The owner gave the buffer away (move, pass, full-copy destination).
    #[cfg(test)]
    pub(crate) fn give_away(&mut self, id: BufferId) {
        Self::give_away_in(self.rec_mut(id), id.index);
    }

    /// [`DomainState::give_away`] in the pool's entry, looked up already.
    #[inline]
    fn give_away_in(e: &mut PoolEntry, index: u32) {
        e.holdings.owned -= u32::from(e.records[index as usize].owned);
        e.records[index as usize].owned = false;
        Self::sync_protection(e, index);
    }

    /// Give owned buffer `id` away over `chan` (move, pass): one look-up of
    /// its pool for the whole send. `cross`: the peer is another process,
    /// which can die holding it; then the ledger's mark is noted first
    /// (see `DomainState::note_lending`), and nothing changes if that
    /// fails.
    #[inline(always)]
    pub(crate) fn lend(&mut self, id: BufferId, chan: ChanKey, cross: bool) -> Result<()> {
        let e = self.rec_mut(id);
        if cross {
            Self::note_lending(e, id.index, chan)?;
        }
        Self::give_away_in(e, id.index);
        Ok(())
    }

    /// Before the owner gives buffer `index` of entry `e` to another
    /// process over `chan`: note the pool ledger's departure count, so that
    /// the buffer comes back if that process dies holding it, and not if it
    /// passed it on. If the buffer arrived here on another channel, this is
    /// a departure the one who lent it to us must learn of: counted first.
    /// A buffer going back on the channel it came by only reads the count
    /// (its lender, the peer, still takes it back if we die holding it, and
    /// must not if it moves on from here later).
    #[inline]
    fn note_lending(e: &mut PoolEntry, index: u32, chan: ChanKey) -> Result<()> {
        let memory = e.view.memory();
        let rec = &mut e.records[index as usize];
        let mark = match rec.arrived_via {
            Some(via) if via != chan => memory.ledger()?.depart(index),
            _ => memory.departures(index),
        };
        rec.lent_on = Some((chan, mark));
        Ok(())
    }

    /// A buffer this domain lent over `chan`, whose peer process died:
    /// whether it is still with that process (not given back, not passed
    /// on by it since).
    pub(crate) fn still_lent(&self, id: BufferId, chan: ChanKey) -> bool {
        let Some(e) = self.pools.get(&id.pool) else { return false };
        let rec = &e.records[id.index as usize];
        !rec.owned && rec.lent_on == Some((chan, e.view.memory().departures(id.index)))
    }

    /// The peer process of `chan` is gone: what it still held of `lent`
    /// is ours again (to the free list, read-only while copies it may have
    /// made are out), and the copies it held are void. What it passed on
    /// stays where it went (the pool's ledger says so).
    pub(crate) fn reclaim_lent(&mut self, chan: ChanKey, lent: LentSet) {
        for id in lent {
            if self.still_lent(id, chan) {
                self.take_ownership(id);
                self.pin_if_copies_out(id);
                self.free(id);
            }
        }
        self.void_copies_out(chan);
    }

    /// Keeps watching the peer process of the closed channel `chan` for
    /// what it still holds of `lent` (see [`LendingWatch`]).
    /// Watches that no longer wait for anything (what they lent came back
    /// another way, or its pool left the domain) go, with their pidfds.
    pub(crate) fn watch_lending(&mut self, chan: ChanKey, peer: std::os::fd::OwnedFd, lent: LentSet) {
        let mut watches = std::mem::take(&mut self.watches);
        watches.retain(|w| w.lent.iter().any(|id| self.still_lent(id, w.chan)));
        if lent.iter().any(|id| self.still_lent(id, chan)) {
            watches.push(LendingWatch { chan, peer, lent });
        }
        self.watches = watches;
    }

    /// Takes back what closed channels had lent to processes that have
    /// exited since; true if a process was found gone. One `poll` of the
    /// watched processes' pidfds: for the calls that found a pool empty,
    /// not for every allocation.
    pub(crate) fn reclaim_from_exited(&mut self) -> bool {
        if self.watches.is_empty() {
            return false;
        }
        let exited = {
            use std::os::fd::AsFd;
            let fds: Vec<_> = self.watches.iter().map(|w| w.peer.as_fd()).collect();
            crate::wake::readable_now(&fds).unwrap_or_default()
        };
        let mut exited = exited.into_iter();
        let (gone, live): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.watches).into_iter().partition(|_| exited.next().unwrap_or(false));
        self.watches = live;
        let found = !gone.is_empty();
        for w in gone {
            self.reclaim_lent(w.chan, w.lent);
        }
        found
    }

    /// A buffer arrived on `chan` (moved or passed): it is ours. False,
    /// and nothing changes, if it was ours already (the peer cannot give
    /// us what we own). One look-up of its pool for the whole delivery.
    #[cfg(test)]
    pub(crate) fn arrived(&mut self, id: BufferId, chan: ChanKey) -> bool {
        Self::arrived_in(self.rec_mut(id), id.index, chan)
    }

    /// [`DomainState::arrived`] in the pool's entry, looked up already.
    #[inline]
    pub(crate) fn arrived_in(e: &mut PoolEntry, index: u32, chan: ChanKey) -> bool {
        let rec = &mut e.records[index as usize];
        if rec.owned {
            return false;
        }
        rec.arrived_via = Some(chan);
        rec.lent_on = None;
        Self::take_ownership_in(e, index);
        true
    }

    /// A moved or passed buffer arrived: it is ours, read-write.
    pub(crate) fn take_ownership(&mut self, id: BufferId) {
        Self::take_ownership_in(self.rec_mut(id), id.index);
    }

    /// [`DomainState::take_ownership`] in the pool's entry, looked up already.
    #[inline]
    fn take_ownership_in(e: &mut PoolEntry, index: u32) {
        e.holdings.owned += u32::from(!e.records[index as usize].owned);
        e.records[index as usize].owned = true;
        Self::sync_protection(e, index);
    }

    /// Put an owned buffer without a handle on the free list (or keep it
    /// aside until its copies are back).
    pub(crate) fn free(&mut self, id: BufferId) {
        let now = self.tick_free_clock();
        Self::free_in(self.rec_mut(id), id.index, now);
    }

    /// The free clock's next value (see [`BufRecord::freed_at`]).
    #[inline]
    fn tick_free_clock(&mut self) -> u64 {
        self.free_clock += 1;
        self.free_clock
    }

    /// [`DomainState::free`] in the pool's entry, looked up already, at
    /// free-clock time `now`.
    #[inline]
    fn free_in(e: &mut PoolEntry, index: u32, now: u64) {
        let rec = &mut e.records[index as usize];
        if !rec.owned {
            return;
        }
        if rec.state() == BufferState::ReadWrite {
            rec.freed_at = now;
            e.push_free(index);
        } else {
            rec.free_when_writable = true;
        }
    }

    /// A copy of the buffer was sent over `chan`.
    #[cfg(test)]
    pub(crate) fn copy_sent(&mut self, id: BufferId, chan: ChanKey) {
        Self::copy_sent_in(self.rec_mut(id), id.index, chan);
    }

    /// [`DomainState::copy_sent`] in the pool's entry, looked up already.
    #[inline]
    fn copy_sent_in(e: &mut PoolEntry, index: u32, chan: ChanKey) {
        bump(&mut e.records[index as usize].copies_out, chan);
        e.holdings.copies_out += 1;
        Self::sync_protection(e, index);
    }

    /// A copy of `id` goes out over `chan` (checks done): counted in the
    /// pool ledger first if the peer is another process (`cross`: if we
    /// die, the owner learns that a copy may still be out), nothing changed
    /// if that fails. One look-up of the pool for the whole send. Returns
    /// whether a copy of it sent over `chan` was out already (the peer has
    /// its bytes) and the buffer size.
    #[inline]
    pub(crate) fn copy_going(&mut self, id: BufferId, chan: ChanKey, cross: bool) -> Result<(bool, usize)> {
        let e = self.rec_mut(id);
        if cross {
            e.view.memory().ledger()?.copy_out(id.index);
        }
        let resend = e.records[id.index as usize].copies_out_via(chan) > 0;
        Self::copy_sent_in(e, id.index, chan);
        Ok((resend, e.view.geometry().buffer_size()))
    }

    /// A copy arrived over `chan`.
    #[cfg(test)]
    pub(crate) fn copy_received(&mut self, id: BufferId, chan: ChanKey) {
        Self::copy_received_in(self.rec_mut(id), id.index, chan);
    }

    /// [`DomainState::copy_received`] in the pool's entry, looked up already.
    #[inline]
    fn copy_received_in(e: &mut PoolEntry, index: u32, chan: ChanKey) {
        bump(&mut e.records[index as usize].copies_in, chan);
        e.holdings.copies_held += 1;
        Self::sync_protection(e, index);
    }

    /// A copy arrived over `chan`: held here. False, and nothing changes,
    /// if it cannot exist (see [`BufRecord::may_receive_copy`]). One
    /// look-up of the pool for the whole delivery.
    #[cfg(test)]
    pub(crate) fn copy_arrived(&mut self, id: BufferId, chan: ChanKey) -> bool {
        Self::copy_arrived_in(self.rec_mut(id), id.index, chan)
    }

    /// [`DomainState::copy_arrived`] in the pool's entry, looked up already.
    #[inline]
    pub(crate) fn copy_arrived_in(e: &mut PoolEntry, index: u32, chan: ChanKey) -> bool {
        if !e.records[index as usize].may_receive_copy() {
            return false;
        }
        Self::copy_received_in(e, index, chan);
        true
    }

    /// We released a copy held via `chan` (the pool leaves the list if
    /// that copy was the last thing of it held here).
    pub(crate) fn copy_released_here(&mut self, id: BufferId, chan: ChanKey) {
        let e = self.rec_mut(id);
        e.holdings.copies_held -= u32::from(drop_one(&mut e.records[id.index as usize].copies_in, chan));
        Self::sync_protection(e, id.index);
        self.maybe_free(id);
        if self.rec_mut(id).orphaned() {
            self.release_if_unused(id.pool);
        }
    }

    /// A release of a copy we sent over `chan` came back. Returns whether
    /// the buffer is now read-write here, or `None` if no such copy was out
    /// (a peer protocol violation).
    pub(crate) fn copy_returned(&mut self, id: BufferId, chan: ChanKey) -> Option<bool> {
        self.copy_came_back(id, chan, false)
    }

    /// [`DomainState::copy_returned`], and if the copy went to another
    /// process (`cross`), counted back in the pool ledger: a release
    /// delivered, with one look-up of the pool.
    #[inline]
    pub(crate) fn copy_came_back(&mut self, id: BufferId, chan: ChanKey, cross: bool) -> Option<bool> {
        let DomainState { pools, free_clock, .. } = self;
        let e = pools.get_mut(&id.pool).expect("pool checked by caller");
        if !drop_one(&mut e.records[id.index as usize].copies_out, chan) {
            return None;
        }
        e.holdings.copies_out -= 1;
        Self::sync_protection(e, id.index);
        if cross {
            e.view.memory().copy_back(id.index);
        }
        let writable = e.records[id.index as usize].state() == BufferState::ReadWrite;
        Self::maybe_free_in(e, id.index, free_clock);
        Some(writable)
    }

    fn maybe_free(&mut self, id: BufferId) {
        let DomainState { pools, free_clock, .. } = self;
        Self::maybe_free_in(pools.get_mut(&id.pool).expect("pool checked by caller"), id.index, free_clock);
    }

    /// An owned buffer whose handle was dropped while copies were out goes
    /// on the free list once it is read-write (ticking the free clock).
    #[inline]
    fn maybe_free_in(e: &mut PoolEntry, index: u32, free_clock: &mut u64) {
        *free_clock += 1;
        let rec = &mut e.records[index as usize];
        if rec.free_when_writable && rec.state() == BufferState::ReadWrite {
            rec.free_when_writable = false;
            rec.freed_at = *free_clock;
            e.push_free(index);
        }
    }

    /// After a peer process died: keep owned buffer `id` read-only while
    /// copies of it sent between processes are out (the dead process may
    /// have made or forwarded them to live ones).
    pub(crate) fn pin_if_copies_out(&mut self, id: BufferId) {
        let e = self.rec_mut(id);
        let rec = &mut e.records[id.index as usize];
        if !rec.owned || count(&rec.copies_out, PINNED) > 0 || e.view.memory().copies(id.index) == 0 {
            return;
        }
        bump(&mut rec.copies_out, PINNED);
        Self::sync_protection(e, id.index);
        self.pinned.push(id);
    }

    /// Unpin the buffers whose copies are all back.
    pub(crate) fn settle_pinned(&mut self) {
        let mut pinned = std::mem::take(&mut self.pinned);
        pinned.retain(|&id| {
            let Some(e) = self.pools.get_mut(&id.pool) else { return false };
            if e.view.memory().copies(id.index) > 0 {
                return true;
            }
            drop_one(&mut e.records[id.index as usize].copies_out, PINNED);
            Self::sync_protection(e, id.index);
            self.maybe_free(id);
            false
        });
        self.pinned = pinned;
    }

    /// Whether the channels have deferred work: copy releases, or pinned
    /// buffers to check.
    pub(crate) fn nothing_pending(&self) -> bool {
        self.deferred_releases.is_empty() && self.pinned.is_empty()
    }

    /// The holder of every copy sent over `chan` (to another process) is
    /// gone: count them all as released, here and in the pool ledgers.
    pub(crate) fn void_copies_out(&mut self, chan: ChanKey) {
        let ids: Vec<BufferId> = self
            .pools
            .iter()
            .flat_map(|(pool, e)| {
                e.records.iter().enumerate().flat_map(move |(i, r)| {
                    std::iter::repeat_n(BufferId { pool: *pool, index: i as u32 }, r.copies_out_via(chan) as usize)
                })
            })
            .collect();
        for &id in &ids {
            self.copy_returned(id, chan);
            self.rec_mut(id).view.memory().copy_back(id.index);
        }
        for id in ids {
            self.pin_if_copies_out(id);
        }
    }

    /// A copy handle was dropped: release it when its channel next runs.
    /// Returns false if the copy was released at once instead (its channel
    /// is closed).
    pub(crate) fn defer_release(&mut self, chan: ChanKey, id: BufferId) -> bool {
        if let Some(&(_, cross)) = self.orphan_chans.iter().find(|(c, _)| *c == chan) {
            self.orphan_released(id, chan, cross);
            return false;
        }
        self.deferred_releases.push((chan, id));
        true
    }

    /// A copy held via a closed channel is dropped: it is gone here, and if
    /// its sender was another process, the pool ledger learns it from us
    /// (the sender never will).
    fn orphan_released(&mut self, id: BufferId, chan: ChanKey, cross: bool) {
        if cross {
            self.rec_mut(id).view.memory().copy_back(id.index);
        }
        self.copy_released_here(id, chan);
        if !self.pools.iter().any(|(_, e)| e.records.iter().any(|r| r.held_via(chan) > 0)) {
            self.orphan_chans.retain(|(c, _)| *c != chan);
        }
    }

    /// Whether one more copy of `id` held via `chan` may be released, on
    /// top of `already` released in the same batch and not yet counted
    /// (the release preconditions of docs/SEMANTICS.md after the channel's
    /// own: a copy held, and the last one not while forwarded copies of a
    /// buffer we do not own are out).
    pub(crate) fn check_release(&self, id: BufferId, chan: ChanKey, already: u32) -> Result<()> {
        let rec = self.record(id).ok_or(ErrorKind::NotCopyHolder)?;
        let held = rec.held_via(chan).saturating_sub(already);
        if held == 0 {
            return Err(ErrorKind::NotCopyHolder.into());
        }
        if !rec.is_owned() && rec.has_forwarded() && held < 2 {
            return Err(ErrorKind::CopiesForwarded.into());
        }
        Ok(())
    }

    /// Take the deferred releases of one channel.
    pub(crate) fn take_deferred(&mut self, chan: ChanKey) -> Vec<BufferId> {
        let mut out = Vec::new();
        self.take_deferred_each(chan, |id| out.push(id));
        out
    }

    /// Take the deferred releases of one channel, handing each to `each`
    /// in the order the copies were dropped.
    pub(crate) fn take_deferred_each(&mut self, chan: ChanKey, mut each: impl FnMut(BufferId)) {
        if self.deferred_releases.is_empty() {
            return;
        }
        self.deferred_releases.retain(|(c, id)| {
            if *c == chan {
                each(*id);
                false
            } else {
                true
            }
        });
    }

    /// A channel is closed for good: copies dropped but never released over
    /// it are forgotten (their holder no longer reads them); copies still
    /// held are released here when dropped. `cross`: its peer was another
    /// process.
    pub(crate) fn forget_channel(&mut self, chan: ChanKey, cross: bool) {
        self.orphan_chans.push((chan, cross));
        for id in self.take_deferred(chan) {
            self.orphan_released(id, chan, cross);
        }
        if !self.pools.iter().any(|(_, e)| e.records.iter().any(|r| r.held_via(chan) > 0)) {
            self.orphan_chans.retain(|(c, _)| *c != chan);
        }
    }

    /// The registry's view of every pool in the list.
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn pool_snapshots(&self) -> Vec<crate::inspect::PoolSnapshot> {
        let pools = self.pools.iter().map(|(id, e)| crate::inspect::PoolSnapshot {
            id: id.as_u128(),
            buffers: e.view.geometry().count(),
            buffer_size: e.view.geometry().buffer_size() as u64,
            created_here: e.holdings.created,
            trust: format!("{:?}", e.trust),
            stats: e.stats(),
        });
        pools.collect()
    }

    /// Take `pool` out of the list if nothing of this domain refers to it
    /// any more (see [`PoolEntry::unused`]): its view (mapping) goes, and
    /// with the last view of the process, its memory and ledger fds.
    /// Returns the entry, for the caller to drop after the lock.
    pub(crate) fn release_if_unused(&mut self, pool: PoolId) -> Option<PoolEntry> {
        if self.pools.get(&pool).is_some_and(PoolEntry::unused) {
            self.pools.remove(&pool)
        } else {
            None
        }
    }
}

/// What a closed channel end had lent to another process and not got back,
/// with a handle on that process (a pidfd, readable once it has exited).
/// After an orderly close the peer owns those buffers (it may still use
/// them, in memory we share); once its process is gone, nobody does, and
/// they come back as from a peer that died with the channel open.
pub(crate) struct LendingWatch {
    chan: ChanKey,
    peer: std::os::fd::OwnedFd,
    lent: LentSet,
}

/// Buffers one channel end has moved or passed to a peer that can die, not
/// back yet: per pool, one bit per buffer. Insert and remove are a bit
/// operation after a scan of the (few) pools; the `HashSet<BufferId>` it
/// replaces cost 11% of a throughput profile in SipHash and table upkeep.
#[derive(Debug, Default)]
pub(crate) struct LentSet {
    pools: Vec<(PoolId, Vec<u64>)>,
    /// Position of the pool used last (may be stale: it is checked).
    last: usize,
}

impl LentSet {
    /// The word holding `id`'s bit, if the pool used last has it already.
    #[inline]
    fn word_fast(&mut self, id: &BufferId) -> Option<&mut u64> {
        match self.pools.get_mut(self.last) {
            Some((p, words)) if *p == id.pool => words.get_mut(id.index as usize / 64),
            _ => None,
        }
    }

    /// The word holding `id`'s bit, made if missing.
    #[inline(never)]
    fn word_slow(&mut self, id: &BufferId) -> &mut u64 {
        self.last = match self.pools.iter().position(|(p, _)| *p == id.pool) {
            Some(pos) => pos,
            None => {
                self.pools.push((id.pool, Vec::new()));
                self.pools.len() - 1
            }
        };
        let words = &mut self.pools[self.last].1;
        let word = id.index as usize / 64;
        if words.len() <= word {
            words.resize(word + 1, 0);
        }
        &mut words[word]
    }

    /// Add `id`; false if it was there already.
    #[inline]
    pub(crate) fn insert(&mut self, id: BufferId) -> bool {
        let bit = 1u64 << (id.index % 64);
        let w = match self.word_fast(&id) {
            Some(w) => w,
            None => self.word_slow(&id),
        };
        let was = *w & bit != 0;
        *w |= bit;
        !was
    }

    /// Remove `id`; false if it was not there.
    #[inline]
    pub(crate) fn remove(&mut self, id: &BufferId) -> bool {
        let bit = 1u64 << (id.index % 64);
        let w = match self.word_fast(id) {
            Some(w) => w,
            None => self.word_slow(id),
        };
        let was = *w & bit != 0;
        *w &= !bit;
        was
    }
}

impl LentSet {
    /// The buffers in it.
    pub(crate) fn iter(&self) -> impl Iterator<Item = BufferId> + '_ {
        self.pools.iter().flat_map(|&(pool, ref words)| {
            words.iter().enumerate().flat_map(move |(w, &word)| {
                let mut bits = word;
                std::iter::from_fn(move || {
                    if bits == 0 {
                        return None;
                    }
                    let b = bits.trailing_zeros();
                    bits &= bits - 1;
                    Some(BufferId { pool, index: w as u32 * 64 + b })
                })
            })
        })
    }

    /// The channel end no longer relates to `pool`: forget its buffers if
    /// `all`, else if none of them is lent (an empty entry would only grow
    /// the set, pool after pool).
    pub(crate) fn forget_pool(&mut self, pool: PoolId, all: bool) {
        self.pools.retain(|(p, words)| *p != pool || (!all && words.iter().any(|&w| w != 0)));
        self.last = 0;
    }
}

impl IntoIterator for LentSet {
    type Item = BufferId;
    type IntoIter = std::vec::IntoIter<BufferId>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter().collect::<Vec<_>>().into_iter()
    }
}

/// A buffer handle was dropped: the buffer goes back to the free list (or
/// aside until its copies are back), and its references to the view and
/// to the domain are kept for the next `alloc` of the pool (at most one
/// each per buffer; the domain's only while a pool handle lives, see
/// `PoolEntry::spare_domains`). If nothing else of the domain refers to
/// the pool, the pool leaves the list.
#[inline]
pub(crate) fn buffer_dropped(domain: Arc<DomainShared>, id: BufferId, view: Arc<PoolView>) {
    // SAFETY: `shared` points at the domain `domain` keeps alive until it
    // is moved into the domain's own state below, under the lock. From
    // there only the last pool handle's drop or the entry's removal lets
    // it go, each under the same lock, so not before the guard's unlock;
    // `shared` is not used after that unlock (which, like `Arc`'s own
    // drop, touches the lock word last).
    let shared: &DomainShared = unsafe { &*Arc::as_ptr(&domain) };
    let mut st = shared.lock();
    let now = st.tick_free_clock();
    // One look-up of the pool for the whole drop (a live handle keeps it
    // listed, so it is there).
    let Some(e) = st.pools.get_mut(&id.pool) else {
        drop(st);
        return;
    };
    DomainState::free_in(e, id.index, now);
    if e.orphaned() {
        return last_buffer_dropped(st, id.pool);
    }
    let room = e.records.len();
    let view = if Arc::ptr_eq(&view, &e.view) && e.spare_views.len() < room {
        e.spare_views.push(view);
        None
    } else {
        Some(view)
    };
    let domain = if e.handles > 0 && e.spare_domains.len() < room {
        e.spare_domains.push(domain);
        None
    } else {
        Some(domain)
    };
    drop(st);
    drop(view);
    drop(domain);
}

/// [`buffer_dropped`] of a buffer whose pool has no handle or channel
/// left: the pool leaves the list if that was the last thing of the domain
/// referring to it. Apart, so that the common drop does not move a pool
/// entry around.
#[cold]
#[inline(never)]
fn last_buffer_dropped(mut st: MutexGuard<'_, DomainState>, pool: PoolId) {
    let gone = st.release_if_unused(pool);
    drop(st);
    drop(gone);
}

/// A [`Pool`] handle was dropped: one handle fewer, and the pool leaves the
/// list if that was the last thing of the domain referring to it.
pub(crate) fn pool_handle_dropped(domain: &DomainShared, view: &Arc<PoolView>) {
    let mut st = domain.lock();
    let id = view.id();
    let (spares, gone) = match st.pools.get_mut(&id) {
        Some(e) if Arc::ptr_eq(view, &e.view) => {
            e.handles -= 1;
            // Without a pool handle, kept references to the domain would
            // keep it alive on their own.
            let spares = if e.handles == 0 { std::mem::take(&mut e.spare_domains) } else { Vec::new() };
            (spares, st.release_if_unused(id))
        }
        _ => (Vec::new(), None),
    };
    drop(st);
    drop(gone);
    drop(spares);
}

/// Another handle to the pool of `view`, counted in its entry.
pub(crate) fn pool_handle_cloned(domain: &DomainShared, view: &Arc<PoolView>) {
    if let Some(e) = domain.lock().pools.get_mut(&view.id()) {
        if Arc::ptr_eq(view, &e.view) {
            e.handles += 1;
        }
    }
}

/// Allocate a pool in `domain` (used by [`crate::Allocator`]).
pub(crate) fn create_pool(
    domain: &Domain,
    memory: Arc<PoolMemory>,
    trust: TrustLevel,
    alignment: usize,
) -> Result<Pool> {
    let view = PoolView::map(memory, Access::ReadWrite, alignment)?;
    let pool = Pool { view: view.clone(), domain: domain.shared.clone() };
    domain.lock().insert_created(view, trust);
    Ok(pool)
}

impl Drop for BufferCopy {
    fn drop(&mut self) {
        if let Some((domain, id, chan)) = self.release_parts() {
            if domain.lock().defer_release(chan, id) {
                // Release: a channel that sees the flag also sees the entry
                // (it takes the lock before reading the list anyway).
                domain.has_deferred.store(true, Ordering::Release);
            }
        }
    }
}

// ------------------------------------------------------------- pool handles

/// A handle naming a pool in one domain's pool list; what
/// [`Channel::assign_pool`](crate::Channel::assign_pool) takes. Made by an
/// [`Allocator`](crate::Allocator) ([`Allocator::pool`](crate::Allocator::pool)),
/// or for a pool a peer assigned, by [`Domain::pool`](crate::Domain::pool).
///
/// ```
/// use ferry::{Allocator, Domain, PoolConstraints};
/// let d = Domain::new("d");
/// let alloc = Allocator::new(&d, 8, 4096, PoolConstraints::default())?;
/// let pool = alloc.pool();
/// assert_eq!((pool.geometry().count(), pool.geometry().buffer_size()), (8, 4096));
/// assert_eq!(d.pools(), vec![pool.id()]);
/// // Buffer addresses map to indices and back.
/// let buf = alloc.alloc().unwrap();
/// assert_eq!(pool.index_of(buf.as_ptr()), Some(buf.id().index));
/// assert_eq!(pool.base_address() + 4096 * buf.id().index as usize, buf.as_ptr() as usize);
/// # Ok::<(), ferry::Error>(())
/// ```
///
/// While a handle lives, the pool stays in its domain's list (an
/// [`Allocator`](crate::Allocator) holds one); see docs/SEMANTICS.md, "When
/// a pool goes away".
pub struct Pool {
    pub(crate) view: Arc<PoolView>,
    pub(crate) domain: Arc<DomainShared>,
}

impl Clone for Pool {
    fn clone(&self) -> Self {
        pool_handle_cloned(&self.domain, &self.view);
        Pool { view: self.view.clone(), domain: self.domain.clone() }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        pool_handle_dropped(&self.domain, &self.view);
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("id", &self.view.id()).field("domain", &self.domain.id).finish()
    }
}

impl Pool {
    /// The pool's globally unique id.
    pub fn id(&self) -> PoolId {
        self.view.id()
    }

    /// What its domain holds of the pool now: free, in use, lent, copies
    /// held and out (docs/INSPECT.md).
    ///
    /// ```
    /// let d = ferry::Domain::new("app");
    /// let alloc = ferry::Allocator::new(&d, 4, 4096, ferry::PoolConstraints::default())?;
    /// let _taken = alloc.alloc().unwrap();
    /// let s = alloc.pool().stats();
    /// assert_eq!((s.free, s.in_use, s.lent), (3, 1, 0));
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn stats(&self) -> crate::PoolStats {
        self.domain.lock().entry(self.view.id()).map(PoolEntry::stats).unwrap_or_default()
    }

    /// The pool's shape.
    pub fn geometry(&self) -> Geometry {
        self.view.geometry()
    }

    /// Base address of the pool in this domain (buffers follow contiguously).
    pub fn base_address(&self) -> usize {
        self.view.buffer_ptr(0) as usize
    }

    /// The memfd that holds the pool's memory (buffer *i* at byte
    /// `i * buffer_size`), for I/O that hands the kernel a buffer's pages
    /// without mapping them in this process (`sendfile`, `splice`). Reading
    /// or writing a buffer through it is the owner's business, as through
    /// the buffer's slice.
    pub fn memory_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.view.memory().fd().as_fd()
    }

    /// Index of the buffer containing `addr` in this domain's view, if any.
    pub fn index_of(&self, addr: *const u8) -> Option<u32> {
        self.view.index_of(addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The view's lock-free mirror follows every transition of the state.
    #[test]
    fn read_write_mirror_follows_the_state() {
        let d = Domain::new("d");
        let alloc = crate::Allocator::new(&d, 2, 4096, crate::PoolConstraints::default()).unwrap();
        let pool = alloc.pool().id();
        let view = d.lock().entry(pool).unwrap().view.clone();
        let id = BufferId { pool, index: 1 };
        let rw = |st: &DomainState| (view.is_read_write(1), st.buffer_state(pool, 1) == BufferState::ReadWrite);
        let mut st = d.lock();
        assert_eq!(rw(&st), (true, true), "created read-write");
        st.copy_sent(id, 7);
        assert_eq!(rw(&st), (false, false));
        st.copy_sent(id, 8);
        assert_eq!(st.copy_returned(id, 7), Some(false));
        assert_eq!(rw(&st), (false, false));
        assert_eq!(st.copy_returned(id, 8), Some(true));
        assert_eq!(rw(&st), (true, true));
        st.give_away(id);
        assert_eq!(rw(&st), (false, false));
        st.copy_received(id, 9);
        assert_eq!(rw(&st), (false, false));
        st.take_ownership(id);
        assert_eq!(rw(&st), (false, false), "owner and holder: read-only");
        st.copy_released_here(id, 9);
        assert_eq!(rw(&st), (true, true));
        assert!(view.is_read_write(0) && !view.is_read_write(2), "untouched, and out of range");
    }

    /// The fused transitions of a send and a delivery: `lend` gives the
    /// buffer away and notes the mark only towards another process;
    /// `arrived` refuses a buffer we own without changing anything.
    #[test]
    fn lend_and_arrive_in_one_look_up() {
        let d = Domain::new("d");
        let alloc = crate::Allocator::new(&d, 2, 4096, crate::PoolConstraints::default()).unwrap();
        let pool = alloc.pool().id();
        let id = BufferId { pool, index: 0 };
        let mut st = d.lock();
        let owned = |st: &DomainState| st.entry(pool).unwrap().holdings.owned;
        assert!(!st.arrived(id, 7), "ours already");
        assert_eq!((st.buffer_state(pool, 0), owned(&st)), (BufferState::ReadWrite, 2));
        assert_eq!(st.record(id).unwrap().arrived_via, None, "a refused arrival leaves no trace");
        st.lend(id, 7, false).unwrap();
        assert_eq!((st.buffer_state(pool, 0), owned(&st)), (BufferState::Invalid, 1));
        assert_eq!(st.record(id).unwrap().lent_on, None, "no mark towards a thread");
        assert!(st.arrived(id, 7));
        assert_eq!((st.buffer_state(pool, 0), owned(&st)), (BufferState::ReadWrite, 2));
        st.lend(id, 7, true).unwrap();
        assert_eq!(st.record(id).unwrap().lent_on, Some((7, 0)), "back where it came from: the count read");
        assert!(st.still_lent(id, 7) && !st.still_lent(id, 8));
        assert!(st.arrived(id, 7));
        assert!(!st.still_lent(id, 7), "back: nothing to reclaim");
    }

    /// The fused transitions of a copy sent, delivered and released:
    /// `copy_going` says whether the peer has the bytes already, and counts
    /// the copy in the ledger only towards another process; `copy_arrived`
    /// refuses a copy that cannot exist without changing anything;
    /// `copy_came_back` counts back in the ledger only what was out.
    #[test]
    fn copies_go_and_arrive_in_one_look_up() {
        let d = Domain::new("d");
        let alloc = crate::Allocator::new(&d, 2, 4096, crate::PoolConstraints::default()).unwrap();
        let pool = alloc.pool().id();
        let id = BufferId { pool, index: 1 };
        let mut st = d.lock();
        let held = |st: &DomainState| st.entry(pool).unwrap().holdings.copies_held;
        assert!(!st.copy_arrived(id, 7), "ours, no copy out: forged");
        assert_eq!((st.buffer_state(pool, 1), held(&st)), (BufferState::ReadWrite, 0));
        assert_eq!(st.copy_going(id, 7, false).unwrap(), (false, 4096));
        assert_eq!(st.copy_going(id, 7, false).unwrap(), (true, 4096), "the peer has the bytes");
        assert_eq!(st.copy_going(id, 8, false).unwrap(), (false, 4096), "not over this channel");
        let memory = st.entry(pool).unwrap().view.memory().clone();
        assert_eq!(memory.copies(1), 0, "between threads: no ledger");
        assert_eq!(st.copy_going(id, 8, true).unwrap(), (true, 4096));
        assert_eq!(memory.copies(1), 1, "to another process: counted before it goes");
        assert_eq!(st.buffer_state(pool, 1), BufferState::ReadOnlyOwned);
        assert!(st.copy_arrived(id, 9), "a copy of ours forwarded back");
        assert_eq!(held(&st), 1);
        assert_eq!(st.copy_came_back(id, 9, true), None, "none sent over 9");
        assert_eq!(memory.copies(1), 1, "a release of nothing counts nothing back");
        assert_eq!(st.copy_came_back(id, 8, true), Some(false));
        assert_eq!(memory.copies(1), 0, "from another process: counted back");
    }

    /// Copies dropped together are released in one flush, each checked as
    /// `release` would after the ones before it: of two copies held via a
    /// channel, one of them forwarded on, only one goes; the other waits
    /// for the forwarded copy to come back.
    #[test]
    fn a_flush_checks_each_dropped_copy_after_the_ones_before() {
        let (a, b, c) = (Domain::new("a"), Domain::new("b"), Domain::new("c"));
        let (mut ab, mut ba) = linked(&a, &b);
        let (mut bc, mut cb) = linked(&b, &c);
        let al = alloc(&a, 1);
        let id = al.pool().id();
        offer(&mut ab, &mut ba, al.pool(), true);
        offer(&mut bc, &mut cb, &b.pool(id).expect("accepted"), true);
        let buf = al.alloc().unwrap();
        ab.copy(&buf, b"").unwrap();
        ab.copy(&buf, b"").unwrap();
        let mut copies = Vec::new();
        while let Some(ev) = ba.poll() {
            let crate::Event::CopyReceived { copy, .. } = ev else { panic!("{ev:?}") };
            copies.push(copy);
        }
        assert_eq!(copies.len(), 2);
        bc.copy(&copies[0], b"").unwrap();
        let Some(crate::Event::CopyReceived { copy: at_c, .. }) = cb.poll() else { panic!("no copy at c") };
        drop(copies);
        assert!(ba.poll().is_none());
        let released = |ab: &mut crate::Channel| {
            let mut n = Vec::new();
            while let Some(ev) = ab.poll() {
                let crate::Event::CopyReleased { writable, .. } = ev else { panic!("{ev:?}") };
                n.push(writable);
            }
            n
        };
        assert_eq!(released(&mut ab), [false], "one copy stays at b while c reads the forwarded one");
        assert_eq!(b.buffer_state(buf.id()), BufferState::ReadOnly);
        cb.release(at_c).unwrap();
        assert!(matches!(bc.poll(), Some(crate::Event::CopyReleased { .. })));
        assert!(ba.poll().is_none());
        assert_eq!(released(&mut ab), [true]);
        assert_eq!(b.buffer_state(buf.id()), BufferState::Invalid);
    }

    #[test]
    fn pool_list() {
        let d = Domain::new("d");
        let allocs: Vec<_> =
            (0..3).map(|_| crate::Allocator::new(&d, 1, 4096, crate::PoolConstraints::default()).unwrap()).collect();
        let ids: Vec<PoolId> = allocs.iter().map(|a| a.pool().id()).collect();
        let mut st = d.lock();
        for &id in ids.iter().chain(ids.iter().rev()) {
            assert_eq!(st.pools.get(&id).map(|e| e.view.id()), Some(id));
        }
        let first = st.pools.remove(&ids[0]).expect("listed");
        assert_eq!(first.view.id(), ids[0]);
        assert!(st.pools.get(&ids[0]).is_none() && st.pools.remove(&ids[0]).is_none());
        // The last entry moved into the hole and is still found.
        assert_eq!(st.pools.get(&ids[2]).map(|e| e.view.id()), Some(ids[2]));
        assert_eq!(st.pools.get_mut(&ids[1]).map(|e| e.view.id()), Some(ids[1]));
        st.pools.insert(ids[0], first);
        let mut keys: Vec<PoolId> = st.pools.keys().copied().collect();
        keys.sort();
        let mut want = ids.clone();
        want.sort();
        assert_eq!(keys, want);
        assert_eq!(st.pools.iter().count(), 3);
    }

    fn alloc(d: &Domain, count: u64) -> crate::Allocator {
        crate::Allocator::new(d, count, 4096, crate::PoolConstraints::default()).unwrap()
    }

    /// A connected local channel: TX end in `a`, RX end in `b`.
    fn linked(a: &Domain, b: &Domain) -> (crate::Channel, crate::Channel) {
        let ep = crate::Endpoint::local();
        let mut tx = crate::Channel::create(a, &ep, crate::ChannelSetup::default()).unwrap();
        let mut rx = crate::Channel::bind(b, &ep, crate::BindParams::default()).unwrap();
        assert!(matches!(tx.poll(), Some(crate::Event::BindRequest { .. })));
        assert!(matches!(rx.poll(), Some(crate::Event::Bound)));
        (tx, rx)
    }

    /// Offer `pool` on `tx`; `rx` answers `accept`.
    fn offer(tx: &mut crate::Channel, rx: &mut crate::Channel, pool: &Pool, accept: bool) {
        tx.assign_pool(pool).unwrap();
        let Some(crate::Event::PoolAssignRequest(req)) = rx.poll() else { panic!("no request") };
        rx.respond_pool(req.pool, accept).unwrap();
        let ev = tx.poll();
        if accept {
            assert!(matches!(ev, Some(crate::Event::PoolAssigned(_))), "{ev:?}");
        } else {
            assert!(matches!(ev, Some(crate::Event::PoolVetoed(_))), "{ev:?}");
        }
    }

    fn closed(tx: &mut crate::Channel, rx: &mut crate::Channel) {
        tx.teardown().unwrap();
        assert!(matches!(rx.poll(), Some(crate::Event::Closed { by_peer: true })));
        assert!(matches!(tx.poll(), Some(crate::Event::Closed { by_peer: false })));
    }

    /// Without channels: the allocator, every other pool handle and every
    /// buffer handle keep the pool listed; the last of them to go takes it.
    #[test]
    fn a_pool_goes_with_its_last_handle() {
        let d = Domain::new("d");
        drop(alloc(&d, 2));
        assert!(d.pools().is_empty(), "nothing else referred to it");

        let a = alloc(&d, 2);
        let id = a.pool().id();
        let (b0, b1) = (a.alloc().unwrap(), a.alloc().unwrap());
        let handle = a.pool().clone();
        drop(a);
        let named = d.pool(id).expect("listed");
        drop(handle);
        drop(b0);
        assert_eq!(d.pools(), [id], "a buffer handle and a pool handle");
        drop(named);
        assert_eq!(d.pools(), [id], "a buffer handle");
        assert_eq!(d.free_count(id), 1);
        drop(b1);
        assert!(d.pools().is_empty() && d.pool(id).is_none() && d.free_count(id) == 0);
        assert_eq!(d.buffer_state(BufferId { pool: id, index: 0 }), BufferState::Invalid);
    }

    /// What counts as held in `PoolEntry::unused`: buffer handles and copies
    /// received; not free buffers, buffers given away, copies sent, nor a
    /// buffer whose handle was dropped while its copies are out.
    #[test]
    fn what_keeps_a_pool_without_handles_or_channels() {
        let d = Domain::new("d");
        let a = alloc(&d, 3);
        let id = a.pool().id();
        let b = a.alloc().unwrap();
        let buf = |index| BufferId { pool: id, index };
        let mut st = d.lock();
        let unused = |st: &DomainState| st.entry(id).unwrap().unused();
        st.entry_mut(id).unwrap().handles = 0;
        assert!(!unused(&st), "buffer 0 has a handle");
        st.give_away(buf(0));
        assert!(unused(&st), "given away: at a peer, not here");
        st.take_ownership(buf(0));
        st.copy_sent(buf(0), 7);
        st.free(buf(0));
        assert!(unused(&st), "handle dropped, copies out");
        st.copy_received(buf(1), 8);
        assert!(!unused(&st), "a copy held here");
        st.entry_mut(id).unwrap().records[1].copies_in.clear();
        assert!(unused(&st));
        st.entry_mut(id).unwrap().channels = 1;
        assert!(!unused(&st), "on a channel");
        st.entry_mut(id).unwrap().channels = 0;
        st.entry_mut(id).unwrap().handles = 1;
        drop(st);
        drop(b);
        drop(a);
        assert!(d.pools().is_empty());
    }

    /// A pool created here whose allocator is gone stays while its buffers
    /// are out at a peer over a channel it is assigned to, and while they
    /// are back in handles here; removing it from the channel lets it go at
    /// both ends. A pool received stays while assigned or a buffer of it is
    /// held here.
    #[test]
    fn channels_and_buffers_at_a_peer_keep_a_pool() {
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let (mut tx, mut rx) = linked(&a, &b);
        let al = alloc(&a, 2);
        let id = al.pool().id();
        offer(&mut tx, &mut rx, al.pool(), true);
        tx.move_buffer(al.alloc().unwrap(), b"").unwrap();
        drop(al);
        assert_eq!((a.pools(), b.pools()), (vec![id], vec![id]), "assigned at both ends");
        let Some(crate::Event::MoveReceived { buffer, .. }) = rx.poll() else { panic!("no move") };
        rx.pass(buffer, b"").unwrap();
        let Some(crate::Event::BufferPassed { buffer, .. }) = tx.poll() else { panic!("no pass") };
        rx.remove_pool(id).unwrap();
        assert!(matches!(tx.poll(), Some(crate::Event::PoolRemoved(_))));
        assert!(matches!(rx.poll(), Some(crate::Event::PoolRemoved(_))));
        assert_eq!((a.pools(), b.pools()), (vec![id], vec![]), "the passed buffer's handle is held at a");
        drop(buffer);
        assert!(a.pools().is_empty());
    }

    /// A received pool outlives its channel while a buffer or a copy of it
    /// is held; the creator's goes with its allocator although a copy of
    /// its buffer was out when the channel closed.
    #[test]
    fn a_closed_channel_leaves_what_is_held() {
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let (mut tx, mut rx) = linked(&a, &b);
        let al = alloc(&a, 2);
        let id = al.pool().id();
        offer(&mut tx, &mut rx, al.pool(), true);
        let lent = al.alloc().unwrap();
        tx.copy(&lent, b"").unwrap();
        tx.move_buffer(al.alloc().unwrap(), b"").unwrap();
        let Some(crate::Event::CopyReceived { copy, .. }) = rx.poll() else { panic!("no copy") };
        let Some(crate::Event::MoveReceived { buffer, .. }) = rx.poll() else { panic!("no move") };
        closed(&mut tx, &mut rx);
        drop((tx, rx));
        drop(al);
        assert_eq!(a.pools(), [id], "the owner's handle of the copied buffer");
        drop(lent);
        assert!(a.pools().is_empty(), "no handle left: the copy out went with the channel");
        drop(buffer);
        assert_eq!(b.pools(), [id], "the copy");
        drop(copy);
        assert!(b.pools().is_empty());
    }

    /// A veto: the sink forgets the pool it was offered; the source keeps
    /// it while its allocator lives.
    #[test]
    fn a_vetoed_pool_stays_only_with_its_creator() {
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let (mut tx, mut rx) = linked(&a, &b);
        let al = alloc(&a, 1);
        offer(&mut tx, &mut rx, al.pool(), false);
        assert_eq!((a.pools(), b.pools()), (vec![al.pool().id()], vec![]));
        drop(al);
        assert!(a.pools().is_empty());
    }

    #[test]
    fn lent_set() {
        let (p, q) = (PoolId::from_u128(1), PoolId::from_u128(2));
        let id = |pool, index| BufferId { pool, index };
        let mut s = LentSet::default();
        assert!(!s.remove(&id(p, 0)));
        assert!(s.insert(id(p, 0)));
        assert!(!s.insert(id(p, 0)));
        assert!(s.insert(id(p, 200)));
        assert!(s.insert(id(q, 63)));
        assert!(s.insert(id(q, 64)));
        assert!(!s.remove(&id(q, 65)));
        assert!(!s.remove(&id(q, 100_000)));
        assert!(s.remove(&id(q, 63)));
        assert!(!s.remove(&id(q, 63)));
        let mut left: Vec<BufferId> = s.into_iter().collect();
        left.sort();
        assert_eq!(left, [id(p, 0), id(p, 200), id(q, 64)]);
    }

    /// A pool the channel end forgets leaves the set when none of its
    /// buffers is lent, or when told to forget them all.
    #[test]
    fn lent_set_forgets_pools() {
        let (p, q) = (PoolId::from_u128(1), PoolId::from_u128(2));
        let mut s = LentSet::default();
        assert!(s.insert(BufferId { pool: p, index: 3 }));
        assert!(s.insert(BufferId { pool: q, index: 3 }));
        assert!(s.remove(&BufferId { pool: q, index: 3 }));
        s.forget_pool(q, false);
        s.forget_pool(p, false);
        assert_eq!(s.pools.len(), 1, "q had nothing lent; p has");
        assert!(!s.insert(BufferId { pool: p, index: 3 }), "still lent after its pool was looked up again");
        s.forget_pool(p, true);
        assert!(s.pools.is_empty());
        assert_eq!(s.into_iter().count(), 0);
    }

    /// A dropped buffer's reference to its domain waits in the pool's
    /// entry for the next `alloc`: drop and alloc change no reference
    /// count of the domain.
    #[test]
    fn drop_and_alloc_keep_the_domains_reference_count() {
        let d = Domain::new("d");
        let a = crate::Allocator::new(&d, 2, 4096, crate::PoolConstraints::default()).unwrap();
        let b = a.alloc().unwrap();
        let held = Arc::strong_count(&d.shared);
        drop(b);
        assert_eq!(Arc::strong_count(&d.shared), held, "the dropped handle's reference is kept");
        let b = a.alloc().unwrap();
        assert_eq!(Arc::strong_count(&d.shared), held, "and handed to the next buffer");
        let c = d.alloc(a.pool().id()).unwrap();
        assert_eq!(Arc::strong_count(&d.shared), held + 1, "none kept: a new one");
        drop((b, c));
        assert_eq!((a.available(), d.stats().pools[0].2.free, d.stats().pools[0].2.in_use), (2, 2, 0));
    }

    /// The references kept for the next `alloc` never keep a domain alive
    /// on their own: the domain goes with its last handle, buffer or pool
    /// handle, whichever order they drop in.
    #[test]
    fn kept_references_do_not_keep_the_domain() {
        type Order = fn(Domain, crate::Allocator, Pool, Buffer, Buffer);
        let orders: [Order; 3] = [
            |d, a, p, b, c| drop((b, c, p, a, d)),
            |d, a, p, b, c| drop((d, b, a, p, c)),
            |d, a, p, b, c| drop((p, d, c, a, b)),
        ];
        for (i, order) in orders.into_iter().enumerate() {
            let d = Domain::new("d");
            let weak = Arc::downgrade(&d.shared);
            let a = crate::Allocator::new(&d, 3, 4096, crate::PoolConstraints::default()).unwrap();
            let p = d.pool(a.pool().id()).unwrap();
            let (b, c) = (a.alloc().unwrap(), a.alloc().unwrap());
            drop(a.alloc().unwrap());
            order(d, a, p, b, c);
            assert!(weak.upgrade().is_none(), "order {i}: the domain outlived every handle");
        }
    }
}
