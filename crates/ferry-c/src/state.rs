//! The library's state behind the C interface: channels, waitsets, pools
//! and the table of buffer handles the program holds, in one registry
//! behind one lock. Everything here is safe Rust; C memory is reached only
//! through [`crate::boundary`] and [`crate::cmem`].
//!
//! The process is one Ferry [`Domain`], as in the original implementation
//! (a domain per process). A local channel joins two ends in that domain
//! (Ferry allows it): a buffer moved over it keeps its `struct bulk_buffer`
//! and its address.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::{LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use ferry::{
    Allocator, BindParams, Buffer, BufferCopy, BufferId, BufferState, Channel, ChannelConstraints, ChannelSetup,
    ChannelState, Direction, Domain, Endpoint, Event, Meta, Pool, PoolConstraints, PoolId, Selector, TrustLevel,
    MAX_META_SIZE,
};
use rustix::event::{epoll, eventfd, EventfdFlags};

use crate::boundary::{self, call, ChannelFields};
use crate::cmem::CArray;
use crate::codes::*;
use crate::ffi::*;

/// A result whose error is a C error code.
pub type Res<T> = Result<T, Errval>;

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(|| Mutex::new(Registry::new()));

/// The registry, locked. A panic while it was held leaves it usable: every
/// change is made after the checks that can fail.
pub fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// A continuation the program gave with a call that was accepted.
#[derive(Clone, Copy)]
pub struct Cont {
    handler: ContHandler,
    arg: usize,
}

impl Cont {
    /// `None` for a continuation without handler (nothing to run).
    pub fn of(c: BulkContinuation) -> Option<Cont> {
        c.handler.map(|handler| Cont { handler, arg: c.arg as usize })
    }
}

/// Whether a buffer callback hands over ownership or a copy.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Handed {
    /// Ownership.
    Owned,
    /// A read-only copy.
    Copy,
}

/// One thing for dispatch to run, outside the lock.
pub enum Work {
    /// A continuation.
    Cont { cont: Cont, err: Errval, ch: usize },
    /// `bind_received`.
    Bind { f: unsafe extern "C" fn(*mut BulkChannel) -> Errval, ch: usize, token: usize },
    /// `teardown_received`.
    Teardown { f: unsafe extern "C" fn(*mut BulkChannel), ch: usize, token: usize },
    /// `pool_assigned`, whose answer goes back to the peer.
    PoolAssigned {
        f: unsafe extern "C" fn(*mut BulkChannel, *mut BulkPool) -> Errval,
        ch: usize,
        token: usize,
        pool_ptr: usize,
        pool: PoolId,
    },
    /// `pool_removed`.
    PoolRemoved {
        f: unsafe extern "C" fn(*mut BulkChannel, *mut BulkPool) -> Errval,
        ch: usize,
        token: usize,
        pool_ptr: usize,
    },
    /// `move_received`, `buffer_received`, `copy_received`.
    Buffer { f: BufferCallback, ch: usize, token: usize, buffer: usize, id: BufferId, handed: Handed, meta: Vec<u8> },
    /// `copy_released`.
    Released { f: unsafe extern "C" fn(*mut BulkChannel, *mut BulkBuffer), ch: usize, token: usize, buffer: usize },
}

impl Work {
    /// The channel a callback is for (`None` for continuations, which run
    /// even after their channel is destroyed).
    fn callback_token(&self) -> Option<usize> {
        match self {
            Work::Cont { .. } => None,
            Work::Bind { token, .. }
            | Work::Teardown { token, .. }
            | Work::PoolAssigned { token, .. }
            | Work::PoolRemoved { token, .. }
            | Work::Buffer { token, .. }
            | Work::Released { token, .. } => Some(*token),
        }
    }

    /// Runs it. Called without the registry lock.
    pub fn run(self) {
        match self {
            Work::Cont { cont, err, ch } => call::cont(cont.handler, cont.arg, err, ch),
            Work::Bind { f, ch, .. } => call::channel_only_errval(f, ch),
            Work::Teardown { f, ch, .. } => call::channel_only(f, ch),
            Work::PoolAssigned { f, ch, token, pool_ptr, pool } => {
                let answer = call::pool(f, ch, pool_ptr);
                registry().answer_pool(token, pool, answer == OK);
            }
            Work::PoolRemoved { f, ch, pool_ptr, .. } => {
                call::pool(f, ch, pool_ptr);
            }
            Work::Buffer { f, ch, buffer, mut meta, .. } => call::buffer_meta(f, ch, buffer, &mut meta),
            Work::Released { f, ch, buffer, .. } => call::buffer(f, ch, buffer),
        }
    }
}

/// What dispatch does next.
pub enum Step {
    /// Run this, then return.
    Run(Work),
    /// An event that needed no callback was handled: look again.
    Again,
    /// Nothing is due: wait for `fd`. `live`: something can still happen.
    Idle { fd: i32, live: bool },
}

/// Where a channel end is.
enum Link {
    /// In its waitset's selector, under this key.
    Attached(usize),
    /// Out of the selector because it closed (kept until destroyed).
    Detached(Box<Channel>),
}

/// A channel end created or bound through the C interface.
struct Chan {
    /// Address of the program's `struct bulk_channel`.
    c_addr: usize,
    /// Address of the program's callbacks.
    callbacks: usize,
    /// The waitset (its key in the registry).
    ws: usize,
    link: Link,
    /// A local creator's endpoint, for the binder to find.
    local_ep: Option<Endpoint>,
    bind_cont: Option<Cont>,
    /// Our pool assignments and removals waiting for the peer's answer.
    assigning: Vec<(PoolId, Option<Cont>)>,
    removing: Vec<(PoolId, Option<Cont>)>,
    /// Bound once: its end is reported by teardown_received.
    connected_once: bool,
}

/// A waitset: a selector over its channels, and the work due.
struct Waitset {
    /// The allocation whose address is the `struct waitset *`.
    _tag: Box<u64>,
    selector: Selector,
    /// Selector key → channel token.
    keys: HashMap<usize, usize>,
    /// The program's fd: the selector's fd and `bell`.
    epoll: OwnedFd,
    /// Readable while `pending` has work (or a new channel wants a poll).
    bell: OwnedFd,
    rung: bool,
    pending: VecDeque<Work>,
    /// Channel events served since queued work last ran.
    streak: u32,
}

/// Channel events served in a row before one queued work runs.
const FAIRNESS: u32 = 32;

impl Waitset {
    fn new() -> Res<(usize, Waitset)> {
        let no_fd = |_| ERR_NO_RESOURCES;
        let selector = Selector::new().map_err(|e| of_error(&e))?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(no_fd)?;
        let bell = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(no_fd)?;
        epoll::add(&ep, selector.as_fd(), epoll::EventData::new_u64(0), epoll::EventFlags::IN).map_err(no_fd)?;
        epoll::add(&ep, &bell, epoll::EventData::new_u64(1), epoll::EventFlags::IN).map_err(no_fd)?;
        let tag = Box::new(0u64);
        let key = &*tag as *const u64 as usize;
        let ws = Waitset {
            _tag: tag,
            selector,
            keys: HashMap::new(),
            epoll: ep,
            bell,
            rung: false,
            pending: VecDeque::new(),
            streak: 0,
        };
        Ok((key, ws))
    }

    /// The oldest queued work (the fd stays readable while more is queued).
    fn pop(&mut self) -> Option<Work> {
        let w = self.pending.pop_front()?;
        self.streak = 0;
        if self.pending.is_empty() {
            self.quiet();
        }
        Some(w)
    }

    fn push(&mut self, w: Work) {
        self.pending.push_back(w);
        self.ring();
    }

    fn ring(&mut self) {
        if !self.rung {
            self.rung = true;
            let _ = rustix::io::write(&self.bell, &1u64.to_ne_bytes());
        }
    }

    fn quiet(&mut self) {
        if self.rung {
            let mut b = [0u8; 8];
            let _ = rustix::io::read(&self.bell, &mut b);
            self.rung = false;
        }
    }
}

/// The handles of one buffer that the program holds.
#[derive(Default)]
struct Slot {
    /// The program owns the buffer.
    owned: Option<Buffer>,
    /// Copies the program received, with the channel each came over and
    /// the C object it was given with.
    copies: Vec<(usize, BufferCopy, View)>,
}

/// A pool this process knows, with its C objects.
struct PoolEntry {
    pool: Pool,
    cpool: CArray<BulkPool>,
    bufs: CArray<BulkBuffer>,
    /// The copy view: what a program holding a read-only copy of buffer
    /// *i* is given (same address; its own state and count).
    copy_bufs: CArray<BulkBuffer>,
    /// The pool's `buffers` array.
    _ptrs: CArray<*mut BulkBuffer>,
    slots: Vec<Slot>,
    /// Made by bulk_alloc_init.
    allocator: Option<Allocator>,
}

/// An allocator struct initialized by bulk_alloc_init.
struct AllocEntry {
    c_addr: usize,
    pool: PoolId,
}

/// Everything.
pub struct Registry {
    domain: Domain,
    next_token: usize,
    channels: HashMap<usize, Chan>,
    waitsets: HashMap<usize, Waitset>,
    default_ws: Option<usize>,
    pools: HashMap<PoolId, PoolEntry>,
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

/// Ferry's pool id of `struct bulk_pool_id`.
pub fn pool_id_of(w: BulkPoolId) -> PoolId {
    let v = (u128::from(w.machine) << 96) | (u128::from(w.dom) << 64) | (u128::from(w.local) << 32) | u128::from(w.tag);
    PoolId::from_u128(v)
}

fn fields_of(c: &Channel) -> ChannelFields {
    ChannelFields {
        state: state_to(c.state()),
        direction: direction_to(c.direction()),
        role: role_to(c.role()),
        trust: trust_to(c.trust()),
        meta_size: c.meta_size(),
    }
}

/// The bytes a callback sees as meta data: the channel's meta size, zero-padded
/// (a pointer to at least one byte even when the size is 0).
fn meta_bytes(meta: &Meta, meta_size: usize) -> Vec<u8> {
    let mut v = vec![0u8; meta_size.max(1)];
    let n = meta.len().min(meta_size);
    v[..n].copy_from_slice(&meta[..n]);
    v
}

/// The channel of `chan`, wherever it is.
fn channel_of<'a>(waitsets: &'a mut HashMap<usize, Waitset>, chan: &'a mut Chan) -> Option<&'a mut Channel> {
    match &mut chan.link {
        Link::Attached(key) => waitsets.get_mut(&chan.ws)?.selector.get_mut(*key),
        Link::Detached(c) => Some(c),
    }
}

/// Checks that a channel may send: connected, and this direction.
fn check_sending(c: &Channel, dir: Direction) -> Res<()> {
    match c.state() {
        ChannelState::Connected => {}
        ChannelState::Teardown | ChannelState::Closed => return Err(ERR_CHANNEL_CLOSED),
        _ => return Err(ERR_CHANNEL_STATE),
    }
    if c.direction() != dir {
        return Err(ERR_WRONG_DIRECTION);
    }
    Ok(())
}

fn refresh(domain: &Domain, e: &mut PoolEntry, i: usize) {
    let id = BufferId { pool: e.pool.id(), index: i as u32 };
    let slot = &e.slots[i];
    let held = |v: View| slot.copies.iter().filter(|c| c.2 == v).count() as u32;
    let (owner_copies, view_copies) = (held(View::Owner), held(View::Copy));
    let read_only = buffer_state_to(BufferState::ReadOnly);
    // The owner's object: the domain's state while the program owns the
    // buffer (READ_WRITE, or RO_OWNED with copies out); READ_ONLY while a
    // copy was given with it; else INVALID. The copy object: READ_ONLY
    // while a copy was given with it.
    let owner_state = match (&slot.owned, owner_copies) {
        (Some(_), _) => buffer_state_to(domain.buffer_state(id)),
        (None, 0) => 0,
        (None, _) => read_only,
    };
    let copy_state = if view_copies > 0 { read_only } else { 0 };
    e.bufs.update(i, |b| {
        b.state = owner_state;
        b.local_ref_count = owner_copies;
    });
    e.copy_bufs.update(i, |b| {
        b.state = copy_state;
        b.local_ref_count = view_copies;
    });
}

fn refresh_trust(domain: &Domain, e: &mut PoolEntry) {
    let t = trust_to(domain.pool_trust(e.pool.id()).unwrap_or(TrustLevel::Uninitialized));
    e.cpool.update(0, |p| p.trust = t);
}

impl Registry {
    fn new() -> Registry {
        Registry {
            domain: Domain::new(&format!("process {}", std::process::id())),
            next_token: 0x1000,
            channels: HashMap::new(),
            waitsets: HashMap::new(),
            default_ws: None,
            pools: HashMap::new(),
            pool_addr: HashMap::new(),
            buffer_addr: BTreeMap::new(),
            allocators: HashMap::new(),
        }
    }

    fn new_token(&mut self) -> usize {
        self.next_token += 16;
        self.next_token
    }

    // ------------------------------------------------------------------ waitsets

    /// `bulk_waitset_create`.
    pub fn waitset_create(&mut self) -> Res<usize> {
        let (key, ws) = Waitset::new()?;
        self.waitsets.insert(key, ws);
        Ok(key)
    }

    /// `bulk_waitset_default`.
    pub fn waitset_default(&mut self) -> Res<usize> {
        if let Some(k) = self.default_ws {
            return Ok(k);
        }
        let k = self.waitset_create()?;
        self.default_ws = Some(k);
        Ok(k)
    }

    fn waitset_or_default(&mut self, ws: usize) -> Res<usize> {
        if ws == 0 {
            return self.waitset_default();
        }
        if self.waitsets.contains_key(&ws) {
            Ok(ws)
        } else {
            Err(ERR_INVALID_WAITSET)
        }
    }

    /// `bulk_waitset_destroy`.
    pub fn waitset_destroy(&mut self, ws: usize) -> Res<()> {
        let w = self.waitsets.get(&ws).ok_or(ERR_INVALID_WAITSET)?;
        if !w.pending.is_empty() || self.channels.values().any(|c| c.ws == ws) {
            return Err(ERR_WAITSET_BUSY);
        }
        self.waitsets.remove(&ws);
        if self.default_ws == Some(ws) {
            self.default_ws = None;
        }
        Ok(())
    }

    /// `bulk_waitset_fd`.
    pub fn waitset_fd(&self, ws: usize) -> Res<i32> {
        Ok(self.waitsets.get(&ws).ok_or(ERR_INVALID_WAITSET)?.epoll.as_raw_fd())
    }

    /// The next thing dispatch does on `ws`: a channel event if one is
    /// due, else queued work (continuations, and the further callbacks of
    /// an event that called for several). Channel events come first
    /// because they carry the peer's actions, which a program waits for;
    /// a continuation only reports that one of its own calls completed.
    /// After [`FAIRNESS`] events in a row one queued work runs, so a busy
    /// peer cannot hold continuations back for ever.
    pub fn next_step(&mut self, ws_key: usize) -> Res<Step> {
        let ws = self.waitsets.get_mut(&ws_key).ok_or(ERR_INVALID_WAITSET)?;
        if ws.streak >= FAIRNESS {
            if let Some(w) = ws.pop() {
                return Ok(Step::Run(w));
            }
        }
        if ws.pending.is_empty() {
            ws.quiet();
        }
        match ws.selector.wait(Some(Duration::ZERO)) {
            Some((key, ev)) => {
                ws.streak += 1;
                Ok(match self.take_event(ws_key, key, ev) {
                    Some(w) => Step::Run(w),
                    None => Step::Again,
                })
            }
            None => match ws.pop() {
                Some(w) => Ok(Step::Run(w)),
                None => Ok(Step::Idle { fd: ws.epoll.as_raw_fd(), live: !ws.selector.is_empty() }),
            },
        }
    }

    /// Turns a channel's event into the work it calls for (more of it is
    /// queued on the waitset).
    fn take_event(&mut self, ws_key: usize, key: usize, ev: Event) -> Option<Work> {
        let token = *self.waitsets.get(&ws_key)?.keys.get(&key)?;
        let (ch, cbs) = {
            let chan = self.channels.get(&token)?;
            (chan.c_addr, boundary::read(chan.callbacks as *const BulkChannelCallbacks)?)
        };
        match ev {
            Event::BindRequest { .. } | Event::Bound => {
                let chan = self.channels.get_mut(&token)?;
                chan.connected_once = true;
                let bind_cont = chan.bind_cont.take();
                self.sync(token);
                if let Some(cont) = bind_cont {
                    return Some(Work::Cont { cont, err: OK, ch });
                }
                cbs.bind_received.map(|f| Work::Bind { f, ch, token })
            }
            Event::PoolAssignRequest(req) => {
                let Some(pool_ptr) = self.pool_ptr_or_add(req.pool) else {
                    self.answer_pool(token, req.pool, false);
                    return None;
                };
                match cbs.pool_assigned {
                    Some(f) => Some(Work::PoolAssigned { f, ch, token, pool_ptr, pool: req.pool }),
                    None => {
                        self.answer_pool(token, req.pool, true);
                        None
                    }
                }
            }
            Event::PoolAssigned(id) | Event::PoolVetoed(id) => {
                let err = if matches!(ev, Event::PoolAssigned(_)) { OK } else { ERR_POOL_VETOED };
                if let Some(e) = self.pools.get_mut(&id) {
                    refresh_trust(&self.domain, e);
                }
                let chan = self.channels.get_mut(&token)?;
                let i = chan.assigning.iter().position(|(p, _)| *p == id)?;
                let (_, cont) = chan.assigning.remove(i);
                cont.map(|cont| Work::Cont { cont, err, ch })
            }
            Event::PoolRemoved(id) | Event::PoolRemoveRefused(id) => {
                let err = if matches!(ev, Event::PoolRemoved(_)) { OK } else { ERR_POOL_IN_USE };
                let chan = self.channels.get_mut(&token)?;
                if let Some(i) = chan.removing.iter().position(|(p, _)| *p == id) {
                    let (_, cont) = chan.removing.remove(i);
                    return cont.map(|cont| Work::Cont { cont, err, ch });
                }
                let f = cbs.pool_removed?;
                let pool_ptr = self.pools.get(&id)?.cpool.ptr(0) as usize;
                Some(Work::PoolRemoved { f, ch, token, pool_ptr })
            }
            Event::MoveReceived { buffer, meta } => self.received_owned(token, ch, cbs.move_received, buffer, &meta),
            Event::BufferPassed { buffer, meta } => self.received_owned(token, ch, cbs.buffer_received, buffer, &meta),
            Event::CopyReceived { copy, meta } => {
                let id = copy.id();
                let meta_size = self.channel(token).map_or(0, |c| c.meta_size());
                self.pool_ptr_or_add(id.pool)?;
                let e = self.pools.get_mut(&id.pool)?;
                let i = id.index as usize;
                // A copy arriving where the program neither owns the buffer
                // nor holds a copy of it through the owner's object (another
                // process's buffer) comes in that object, the one in
                // `pool->buffers`; a copy of a buffer the program owns or
                // reads through it already (a local channel: one domain)
                // comes in the copy object, which has its own state.
                let slot = &mut e.slots[i];
                let view = if slot.owned.is_none() && !slot.copies.iter().any(|c| c.2 == View::Owner) {
                    View::Owner
                } else {
                    View::Copy
                };
                slot.copies.push((token, copy, view));
                refresh(&self.domain, e, i);
                let buffer = match view {
                    View::Owner => e.bufs.ptr(i),
                    View::Copy => e.copy_bufs.ptr(i),
                } as usize;
                let meta = meta_bytes(&meta, meta_size);
                cbs.copy_received.map(|f| Work::Buffer { f, ch, token, buffer, id, handed: Handed::Copy, meta })
            }
            Event::CopyReleased { buffer: id, .. } => {
                let e = self.pools.get_mut(&id.pool)?;
                let i = id.index as usize;
                refresh(&self.domain, e, i);
                let buffer = e.bufs.ptr(i) as usize;
                cbs.copy_released.map(|f| Work::Released { f, ch, token, buffer })
            }
            Event::Closed { .. } | Event::Error(_) => {
                let err = match &ev {
                    Event::Error(e) => of_error(e),
                    _ => ERR_CHANNEL_CLOSED,
                };
                self.detach(token);
                let chan = self.channels.get_mut(&token)?;
                let mut works = Vec::new();
                if let Some(cont) = chan.bind_cont.take() {
                    works.push(Work::Cont { cont, err, ch });
                }
                let unanswered = chan.assigning.drain(..).chain(chan.removing.drain(..));
                works.extend(unanswered.filter_map(|(_, c)| c).map(|cont| Work::Cont {
                    cont,
                    err: ERR_CHANNEL_CLOSED,
                    ch,
                }));
                if chan.connected_once {
                    if let Some(f) = cbs.teardown_received {
                        works.push(Work::Teardown { f, ch, token });
                    }
                }
                let mut works = works.into_iter();
                let first = works.next();
                let ws = self.waitsets.get_mut(&ws_key)?;
                for w in works {
                    ws.push(w);
                }
                first
            }
            // Ferry's own kinds of events, which C programs never cause:
            // aggregates (dropped: their buffers return, their copies are
            // released) and the library's own vetoes of offers.
            Event::Aggregate { .. } | Event::PoolOfferRefused { .. } => None,
        }
    }

    /// A buffer moved or passed to us: the program owns it now.
    fn received_owned(
        &mut self,
        token: usize,
        ch: usize,
        f: Option<BufferCallback>,
        buffer: Buffer,
        meta: &Meta,
    ) -> Option<Work> {
        let id = buffer.id();
        let meta_size = self.channel(token).map_or(0, |c| c.meta_size());
        self.pool_ptr_or_add(id.pool)?;
        let e = self.pools.get_mut(&id.pool)?;
        let i = id.index as usize;
        e.slots[i].owned = Some(buffer);
        refresh(&self.domain, e, i);
        let ptr = e.bufs.ptr(i) as usize;
        f.map(|f| Work::Buffer {
            f,
            ch,
            token,
            buffer: ptr,
            id,
            handed: Handed::Owned,
            meta: meta_bytes(meta, meta_size),
        })
    }

    /// The program's answer to a pool offer, sent to the peer.
    pub fn answer_pool(&mut self, token: usize, pool: PoolId, accept: bool) {
        if let Some(c) = self.channel(token) {
            let _ = c.respond_pool(pool, accept);
            let _ = c.flush();
        }
        if let Some(e) = self.pools.get_mut(&pool) {
            refresh_trust(&self.domain, e);
        }
        if !accept {
            self.collect_pools();
        }
    }

    /// Writes the channel fields that follow its state (CLOSED once it
    /// left its selector).
    fn sync(&mut self, token: usize) {
        let Some(chan) = self.channels.get_mut(&token) else { return };
        let (ch, detached) = (chan.c_addr, matches!(chan.link, Link::Detached(_)));
        if let Some(c) = channel_of(&mut self.waitsets, chan) {
            let mut f = fields_of(c);
            if detached {
                f.state = STATE_CLOSED;
            }
            boundary::write_channel_fields(ch as *mut BulkChannel, &f);
        }
    }

    fn channel(&mut self, token: usize) -> Option<&mut Channel> {
        let chan = self.channels.get_mut(&token)?;
        channel_of(&mut self.waitsets, chan)
    }

    /// Takes a closed channel out of its selector (its fd says nothing more).
    fn detach(&mut self, token: usize) {
        let Some(chan) = self.channels.get_mut(&token) else { return };
        if let Link::Attached(key) = chan.link {
            if let Some(ws) = self.waitsets.get_mut(&chan.ws) {
                ws.keys.remove(&key);
                if let Some(c) = ws.selector.remove(key) {
                    chan.link = Link::Detached(Box::new(c));
                }
            }
        }
        self.sync(token);
    }

    // ------------------------------------------------------------------ pools

    /// The C pool of a pool this process knows (made on first sight).
    fn pool_ptr_or_add(&mut self, id: PoolId) -> Option<usize> {
        if let Some(e) = self.pools.get(&id) {
            return Some(e.cpool.ptr(0) as usize);
        }
        let pool = self.domain.pool(id)?;
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
        let bufs = CArray::new(
            (0..n)
                .map(|i| BulkBuffer {
                    address: (base + i * size) as *mut std::ffi::c_void,
                    pool: pool_ptr,
                    bufferid: i as u32,
                    state: 0,
                    local_ref_count: 0,
                    reserved: 0,
                })
                .collect(),
        );
        let copy_bufs = CArray::new(
            (0..n)
                .map(|i| BulkBuffer {
                    address: (base + i * size) as *mut std::ffi::c_void,
                    pool: pool_ptr,
                    bufferid: i as u32,
                    state: 0,
                    local_ref_count: 0,
                    reserved: 0,
                })
                .collect(),
        );
        let ptrs = CArray::new((0..n).map(|i| bufs.ptr(i)).collect());
        let ptrs_base = ptrs.ptr(0);
        cpool.update(0, |p| p.buffers = ptrs_base);
        self.pool_addr.insert(pool_ptr as usize, id);
        self.buffer_addr.insert(bufs.base(), (id, View::Owner));
        self.buffer_addr.insert(copy_bufs.base(), (id, View::Copy));
        let mut e = PoolEntry {
            pool,
            cpool,
            bufs,
            copy_bufs,
            _ptrs: ptrs,
            slots: (0..n).map(|_| Slot::default()).collect(),
            allocator,
        };
        refresh_trust(&self.domain, &mut e);
        for i in 0..n {
            refresh(&self.domain, &mut e, i);
        }
        self.pools.insert(id, e);
        pool_ptr as usize
    }

    /// The pool at a `struct bulk_pool` address.
    fn pool_at(&self, p: usize) -> Res<PoolId> {
        self.pool_addr.get(&p).copied().ok_or(ERR_INVALID_POOL)
    }

    /// Forgets the pools nothing refers to any more: no allocator, no
    /// buffer or copy held by the program, no channel that lists or
    /// negotiates them. Their C objects are freed.
    fn collect_pools(&mut self) {
        let idle: Vec<PoolId> = self
            .pools
            .iter()
            .filter(|(_, e)| e.allocator.is_none() && e.slots.iter().all(|s| s.owned.is_none() && s.copies.is_empty()))
            .map(|(id, _)| *id)
            .collect();
        for id in idle {
            let mut used = false;
            let tokens: Vec<usize> = self.channels.keys().copied().collect();
            for t in tokens {
                let chan = self.channels.get_mut(&t).expect("listed");
                let negotiating = chan.assigning.iter().chain(&chan.removing).any(|(p, _)| *p == id);
                let listed = channel_of(&mut self.waitsets, chan)
                    .is_some_and(|c| c.is_assigned(id) || c.pending_requests().iter().any(|r| r.pool == id));
                if negotiating || listed {
                    used = true;
                    break;
                }
            }
            if !used {
                if let Some(e) = self.pools.remove(&id) {
                    self.pool_addr.remove(&(e.cpool.ptr(0) as usize));
                    self.buffer_addr.remove(&e.bufs.base());
                    self.buffer_addr.remove(&e.copy_bufs.base());
                }
            }
        }
    }

    /// `bulk_pool_domain_list_get`.
    pub fn pool_by_id(&mut self, id: PoolId) -> Option<usize> {
        self.pool_ptr_or_add(id)
    }

    /// `bulk_buffer_change_state`.
    pub fn buffer_change_state(&mut self, buffer: usize, state: u32) -> Res<()> {
        let (id, i, view) = buffer_at_in(&self.buffer_addr, &self.pools, buffer)?;
        if state > 3 {
            return Err(ERR_INVALID_ARGUMENT);
        }
        let e = self.pools.get_mut(&id).ok_or(ERR_INVALID_BUFFER)?;
        refresh(&self.domain, e, i);
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
        let alloc = Allocator::new(&self.domain, count, size, PoolConstraints { trust, alignment })
            .map_err(|e| of_error(&e))?;
        let pool = self.domain.pool(alloc.pool().id()).ok_or(ERR_INTERNAL)?;
        let id = pool.id();
        let free = alloc.available();
        let pool_ptr = self.add_pool(pool, Some(alloc));
        let token = self.new_token();
        self.allocators.insert(token, AllocEntry { c_addr: a as usize, pool: id });
        boundary::write_allocator(a, pool_ptr as *mut BulkPool, free, token);
        Ok(())
    }

    /// `bulk_alloc_free`.
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
                refresh(&self.domain, e, i);
            }
        }
        boundary::clear_allocator(a);
        self.collect_pools();
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
        refresh(&self.domain, e, i);
        boundary::set_num_free(a, free);
        Ok(e.bufs.ptr(i) as usize)
    }

    /// `bulk_alloc_return_buffer`.
    pub fn alloc_return_buffer(&mut self, a: *mut BulkAllocator, buffer: usize) -> Res<()> {
        let (_, id) = self.alloc_entry(a)?;
        let (bpool, i, view) = buffer_at_in(&self.buffer_addr, &self.pools, buffer)?;
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
        if self.domain.buffer_state(BufferId { pool: id, index: i as u32 }) == BufferState::ReadOnlyOwned {
            return Err(ERR_COPIES_OUTSTANDING);
        }
        let b = e.slots[i].owned.take().ok_or(ERR_BUFFER_NOT_OWNED)?;
        if let Err(r) = alloc.free(b) {
            e.slots[i].owned = Some(r.value);
            return Err(of_error(&r.error));
        }
        let free = alloc.available();
        refresh(&self.domain, e, i);
        boundary::set_num_free(a, free);
        Ok(())
    }

    // ------------------------------------------------------------------ channels

    /// The token of a live channel struct.
    fn chan_token(&self, ch: *mut BulkChannel) -> Res<usize> {
        let token = boundary::channel_token(ch);
        match self.channels.get(&token) {
            Some(c) if c.c_addr == ch as usize => Ok(token),
            _ => Err(ERR_INVALID_CHANNEL),
        }
    }

    /// The Ferry endpoint an endpoint descriptor names, and its backend.
    fn endpoint(&mut self, ep: *mut BulkEndpointDescriptor, remote: bool) -> Res<(Endpoint, u32)> {
        let d = boundary::read_endpoint(ep);
        if d.magic != EP_MAGIC {
            return Err(ERR_INVALID_ENDPOINT);
        }
        let endpoint = match d.backend {
            BACKEND_LOCAL => {
                let other = boundary::local_other_channel(ep);
                match (remote, other.is_null()) {
                    (false, true) => Endpoint::local(),
                    (true, false) => {
                        let t = self.chan_token(other).map_err(|_| ERR_ENDPOINT_NOT_LISTENING)?;
                        self.channels[&t].local_ep.clone().ok_or(ERR_INVALID_ENDPOINT)?
                    }
                    _ => return Err(ERR_INVALID_ENDPOINT),
                }
            }
            BACKEND_SM if (d.remote != 0) == remote => Endpoint::shm(OsStr::from_bytes(&boundary::sm_path(ep))),
            BACKEND_NET if (d.remote != 0) == remote => {
                let (ip, port) = boundary::net_addr(ep);
                let ip: std::net::IpAddr =
                    std::str::from_utf8(&ip).ok().and_then(|s| s.parse().ok()).ok_or(ERR_INVALID_ENDPOINT)?;
                Endpoint::tcp(std::net::SocketAddr::new(ip, port))
            }
            _ => return Err(ERR_INVALID_ENDPOINT),
        };
        Ok((endpoint, d.backend))
    }

    /// Registers a new channel end and fills the program's struct.
    #[allow(clippy::too_many_arguments)]
    fn register(
        &mut self,
        ch: *mut BulkChannel,
        ep: *mut BulkEndpointDescriptor,
        callbacks: *mut BulkChannelCallbacks,
        ws_key: usize,
        channel: Channel,
        local_ep: Option<Endpoint>,
        bind_cont: Option<Cont>,
        constraints: BulkChannelConstraints,
        user_state: *mut std::ffi::c_void,
    ) {
        let token = self.new_token();
        let f = fields_of(&channel);
        let ws = self.waitsets.get_mut(&ws_key).expect("checked by the caller");
        let key = ws.selector.insert(channel);
        ws.keys.insert(key, token);
        // The program's own loop polls the new channel once (it may
        // have an event before its fd was ever armed).
        ws.ring();
        self.channels.insert(
            token,
            Chan {
                c_addr: ch as usize,
                callbacks: callbacks as usize,
                ws: ws_key,
                link: Link::Attached(key),
                local_ep,
                bind_cont,
                assigning: Vec::new(),
                removing: Vec::new(),
                connected_once: false,
            },
        );
        boundary::init_channel(
            ch,
            BulkChannel {
                callbacks,
                ep,
                state: f.state,
                pools: std::ptr::null_mut(),
                direction: f.direction,
                role: f.role,
                trust: f.trust,
                constraints,
                meta_size: f.meta_size,
                waitset: ws_key as *mut std::ffi::c_void,
                user_state,
                impl_data: token as *mut std::ffi::c_void,
            },
        );
    }

    /// `bulk_channel_create`.
    pub fn channel_create(
        &mut self,
        ch: *mut BulkChannel,
        ep: *mut BulkEndpointDescriptor,
        callbacks: *mut BulkChannelCallbacks,
        s: BulkChannelSetup,
    ) -> Res<()> {
        if self.chan_token(ch).is_ok() {
            return Err(ERR_CHANNEL_IN_USE);
        }
        let direction = direction_from(s.direction).ok_or(ERR_INVALID_ARGUMENT)?;
        let role = role_from(s.role).ok_or(ERR_INVALID_ARGUMENT)?;
        let trust = trust_from(s.trust).filter(|t| *t != TrustLevel::Uninitialized).ok_or(ERR_INVALID_ARGUMENT)?;
        if s.meta_size > MAX_META_SIZE {
            return Err(ERR_INVALID_ARGUMENT);
        }
        let ws = self.waitset_or_default(s.waitset as usize)?;
        let (endpoint, backend) = self.endpoint(ep, false)?;
        let setup = ChannelSetup {
            direction,
            role,
            trust,
            meta_size: s.meta_size,
            constraints: ChannelConstraints { alignment: s.constraints.men_align, ..ChannelConstraints::default() },
            ..ChannelSetup::default()
        };
        let channel = Channel::create(&self.domain, &endpoint, setup).map_err(|e| of_error(&e))?;
        if backend == BACKEND_NET {
            if let Some(addr) = channel.listen_addr() {
                boundary::set_net_port(ep, addr.port());
            }
        }
        let local_ep = (backend == BACKEND_LOCAL).then_some(endpoint);
        self.register(ch, ep, callbacks, ws, channel, local_ep, None, s.constraints, s.user_state);
        Ok(())
    }

    /// `bulk_channel_bind`.
    pub fn channel_bind(
        &mut self,
        ch: *mut BulkChannel,
        ep: *mut BulkEndpointDescriptor,
        callbacks: *mut BulkChannelCallbacks,
        p: BulkChannelBindParams,
        cont: Option<Cont>,
    ) -> Res<()> {
        if self.chan_token(ch).is_ok() {
            return Err(ERR_CHANNEL_IN_USE);
        }
        let role = role_from(p.role).ok_or(ERR_INVALID_ARGUMENT)?;
        let trust = match trust_from(p.trust).ok_or(ERR_INVALID_ARGUMENT)? {
            TrustLevel::Uninitialized => None,
            t => Some(t),
        };
        let ws = self.waitset_or_default(p.waitset as usize)?;
        let (endpoint, _) = self.endpoint(ep, true)?;
        let params = BindParams {
            role,
            trust,
            constraints: ChannelConstraints { alignment: p.constraints.men_align, ..ChannelConstraints::default() },
            ..BindParams::default()
        };
        let channel = Channel::bind(&self.domain, &endpoint, params).map_err(|e| of_error(&e))?;
        self.register(ch, ep, callbacks, ws, channel, None, cont, p.constraints, p.user_state);
        Ok(())
    }

    /// `bulk_channel_destroy`.
    pub fn channel_destroy(&mut self, ch: *mut BulkChannel, cont: Option<Cont>) -> Res<()> {
        let token = self.chan_token(ch)?;
        let mut chan = self.channels.remove(&token).expect("checked");
        let ws_key = chan.ws;
        let channel = match std::mem::replace(&mut chan.link, Link::Attached(usize::MAX)) {
            Link::Attached(key) => self.waitsets.get_mut(&ws_key).and_then(|ws| {
                ws.keys.remove(&key);
                ws.selector.remove(key)
            }),
            Link::Detached(c) => Some(*c),
        };
        if let Some(mut c) = channel {
            if c.state() == ChannelState::Connected {
                let _ = c.teardown();
                let _ = c.flush();
            }
            // Dropping the end closes it: the peer learns of it.
            drop(c);
        }
        // Copies received over it go back; callbacks for it are not run,
        // and buffers they would have handed over go back too.
        let mut dropped = Vec::new();
        if let Some(ws) = self.waitsets.get_mut(&ws_key) {
            let (keep, gone): (VecDeque<Work>, VecDeque<Work>) =
                ws.pending.drain(..).partition(|w| w.callback_token() != Some(token));
            ws.pending = keep;
            dropped.extend(gone);
        }
        for w in dropped {
            if let Work::Buffer { id, handed: Handed::Owned, .. } = w {
                if let Some(e) = self.pools.get_mut(&id.pool) {
                    e.slots[id.index as usize].owned = None;
                }
            }
        }
        for e in self.pools.values_mut() {
            for i in 0..e.slots.len() {
                if e.slots[i].copies.iter().any(|c| c.0 == token) {
                    e.slots[i].copies.retain(|c| c.0 != token);
                    refresh(&self.domain, e, i);
                }
            }
        }
        if let Some(ws) = self.waitsets.get_mut(&ws_key) {
            let chp = ch as usize;
            let unanswered = chan
                .bind_cont
                .take()
                .into_iter()
                .chain(chan.assigning.drain(..).chain(chan.removing.drain(..)).filter_map(|(_, c)| c));
            for c in unanswered {
                ws.push(Work::Cont { cont: c, err: ERR_CHANNEL_DESTROYED, ch: chp });
            }
            if let Some(cont) = cont {
                ws.push(Work::Cont { cont, err: OK, ch: chp });
            }
        }
        boundary::clear_channel(ch, STATE_CLOSED);
        self.collect_pools();
        Ok(())
    }

    /// `bulk_channel_assign_pool` and `bulk_channel_remove_pool`.
    pub fn channel_pool(&mut self, ch: *mut BulkChannel, pool: usize, cont: Option<Cont>, assign: bool) -> Res<()> {
        let token = self.chan_token(ch)?;
        let id = self.pool_at(pool)?;
        let chan = self.channels.get_mut(&token).expect("checked");
        let c = channel_of(&mut self.waitsets, chan).ok_or(ERR_CHANNEL_CLOSED)?;
        let e = self.pools.get_mut(&id).ok_or(ERR_INVALID_POOL)?;
        if assign {
            c.assign_pool(&e.pool).map_err(|e| of_error(&e))?;
        } else {
            c.remove_pool(id).map_err(|e| of_error(&e))?;
        }
        let _ = c.flush();
        if assign {
            // As the original's local backend does, a continuation given
            // without an argument gets the pool as its argument.
            let cont = cont.map(|c| Cont { arg: if c.arg == 0 { pool } else { c.arg }, ..c });
            chan.assigning.push((id, cont));
        } else {
            chan.removing.push((id, cont));
        }
        refresh_trust(&self.domain, e);
        Ok(())
    }

    /// Queues an accepted call's continuation.
    fn queue_cont(&mut self, token: usize, ch: *mut BulkChannel, cont: Option<Cont>) {
        let Some(cont) = cont else { return };
        let Some(ws) = self.channels.get(&token).map(|c| c.ws) else { return };
        if let Some(ws) = self.waitsets.get_mut(&ws) {
            ws.push(Work::Cont { cont, err: OK, ch: ch as usize });
        }
    }

    /// `bulk_channel_move` and `bulk_channel_pass`.
    pub fn channel_send(
        &mut self,
        ch: *mut BulkChannel,
        buffer: usize,
        meta: *const std::ffi::c_void,
        cont: Option<Cont>,
        dir: Direction,
    ) -> Res<()> {
        let token = self.chan_token(ch)?;
        let chan = self.channels.get_mut(&token).expect("checked");
        let c = channel_of(&mut self.waitsets, chan).ok_or(ERR_CHANNEL_CLOSED)?;
        check_sending(c, dir)?;
        let (id, i, view) = buffer_at_in(&self.buffer_addr, &self.pools, buffer)?;
        let e = self.pools.get_mut(&id).ok_or(ERR_INVALID_BUFFER)?;
        if view == View::Copy {
            return Err(ERR_BUFFER_NOT_OWNED);
        }
        let b = e.slots[i].owned.take().ok_or(ERR_BUFFER_NOT_OWNED)?;
        let meta = boundary::read_meta(meta, c.meta_size());
        let sent = match dir {
            Direction::Tx => c.move_buffer(b, &meta),
            Direction::Rx => c.pass(b, &meta),
        };
        if let Err(r) = sent {
            e.slots[i].owned = Some(r.value);
            return Err(of_error(&r.error));
        }
        refresh(&self.domain, e, i);
        // The TCP backend holds messages back until the channel is polled;
        // a C program may send and then not dispatch for a while (or exit).
        let _ = c.flush();
        self.queue_cont(token, ch, cont);
        Ok(())
    }

    /// `bulk_channel_copy`.
    pub fn channel_copy(
        &mut self,
        ch: *mut BulkChannel,
        buffer: usize,
        meta: *const std::ffi::c_void,
        cont: Option<Cont>,
    ) -> Res<()> {
        let token = self.chan_token(ch)?;
        let chan = self.channels.get_mut(&token).expect("checked");
        let c = channel_of(&mut self.waitsets, chan).ok_or(ERR_CHANNEL_CLOSED)?;
        check_sending(c, Direction::Tx)?;
        let (id, i, view) = buffer_at_in(&self.buffer_addr, &self.pools, buffer)?;
        let e = self.pools.get_mut(&id).ok_or(ERR_INVALID_BUFFER)?;
        let meta = boundary::read_meta(meta, c.meta_size());
        let slot = &e.slots[i];
        let held = slot.copies.iter().find(|h| h.2 == view).map(|h| &h.1);
        let sent = match (view, &slot.owned, held) {
            (View::Owner, Some(b), _) => c.copy(b, &meta),
            (_, _, Some(copy)) => c.copy(copy, &meta),
            _ => return Err(ERR_BUFFER_NOT_OWNED),
        };
        sent.map_err(|e| of_error(&e))?;
        refresh(&self.domain, e, i);
        // The TCP backend holds messages back until the channel is polled;
        // a C program may send and then not dispatch for a while (or exit).
        let _ = c.flush();
        self.queue_cont(token, ch, cont);
        Ok(())
    }

    /// `bulk_channel_release`.
    pub fn channel_release(&mut self, ch: *mut BulkChannel, buffer: usize, cont: Option<Cont>) -> Res<()> {
        let token = self.chan_token(ch)?;
        let chan = self.channels.get_mut(&token).expect("checked");
        let c = channel_of(&mut self.waitsets, chan).ok_or(ERR_CHANNEL_CLOSED)?;
        check_sending(c, Direction::Rx)?;
        let (id, i, view) = buffer_at_in(&self.buffer_addr, &self.pools, buffer)?;
        let e = self.pools.get_mut(&id).ok_or(ERR_INVALID_BUFFER)?;
        let at = e.slots[i].copies.iter().position(|h| h.0 == token && h.2 == view).ok_or(ERR_NOT_A_COPY)?;
        let (_, copy, _) = e.slots[i].copies.remove(at);
        if let Err(r) = c.release(copy) {
            e.slots[i].copies.insert(at, (token, r.value, view));
            return Err(of_error(&r.error));
        }
        refresh(&self.domain, e, i);
        // The TCP backend holds messages back until the channel is polled;
        // a C program may send and then not dispatch for a while (or exit).
        let _ = c.flush();
        self.queue_cont(token, ch, cont);
        Ok(())
    }
}

/// Which of a buffer's two C objects a pointer names.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum View {
    /// The one given to the owner (allocator, move, pass; `pool->buffers`).
    Owner,
    /// The one given to the holder of a read-only copy.
    Copy,
}

/// The pool, index and view of a `struct bulk_buffer` address.
fn buffer_at_in(
    addrs: &BTreeMap<usize, (PoolId, View)>,
    pools: &HashMap<PoolId, PoolEntry>,
    p: usize,
) -> Res<(PoolId, usize, View)> {
    let (&base, &(id, view)) = addrs.range(..=p).next_back().ok_or(ERR_INVALID_BUFFER)?;
    let e = pools.get(&id).ok_or(ERR_INVALID_BUFFER)?;
    let size = std::mem::size_of::<BulkBuffer>();
    let off = p - base;
    if off % size != 0 || off / size >= e.bufs.len() {
        return Err(ERR_INVALID_BUFFER);
    }
    Ok((id, off / size, view))
}
