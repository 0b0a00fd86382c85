//! The library's state behind the C interface, and the operations on it.
//! Everything here is safe Rust; C memory is reached only through
//! [`crate::boundary`] and [`crate::cmem`].
//!
//! The process is one Ferry [`Domain`], as in the original implementation
//! (a domain per process). A local channel joins two ends in that domain
//! (Ferry allows it).
//!
//! Locks, in the order they are taken (never the other way round): a
//! waitset's ([`Waitset`], with its channel ends), then the table's and a
//! buffer's ([`crate::table`]; an allocator has no lock). The two
//! directories below map C handles to waitsets; each is the last lock a
//! thread takes, held only while looking up or changing an entry. A thread
//! that busy-polls its own waitset thereby takes no lock another thread's
//! waitset needs.

use std::cell::{Cell, RefCell};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, RwLock};
use std::time::{Duration, Instant};

use ferry::{
    BindParams, Channel, ChannelConstraints, ChannelSetup, Direction, Domain, Endpoint, PoolId, TrustLevel,
    MAX_META_SIZE,
};

use crate::boundary::{self, call};
use crate::codes::*;
use crate::ffi::*;
use crate::lock::{SpinGuard, SpinLock};
use crate::table::{forget, unheld_pools, GENERATION};
use crate::waitset::{ChanId, Cont, IdMap, MetaBuf, Sending, SpinClock, Step, Waitset};

/// A result whose error is a C error code.
pub type Res<T> = Result<T, Errval>;

/// The process's domain.
pub static DOMAIN: LazyLock<Domain> = LazyLock::new(|| Domain::new(&format!("process {}", std::process::id())));

static NEXT_TOKEN: AtomicUsize = AtomicUsize::new(0x1000);

/// A new token for a channel's or allocator's `impl_data` (never 0, never reused).
pub fn new_token() -> usize {
    NEXT_TOKEN.fetch_add(16, Ordering::Relaxed) + 16
}

/// A waitset. The address of the cell is the `struct waitset *` given to
/// C: it is not reused while anything (a thread's cache, a dispatch
/// running one of its callbacks) still refers to the cell.
pub struct WsCell {
    /// `None` once destroyed: its selector and fds are closed then, even
    /// while a thread's cache still holds the cell.
    ws: SpinLock<Option<Waitset>>,
}

/// What a thread keeps between its calls into the library, in one
/// thread-local so that a call reaches all of it with one look-up (in a
/// shared library each thread-local access is a call into the dynamic
/// loader).
struct ThreadState {
    /// The waitset (the address of its cell) whose callback or
    /// continuation this thread runs from its dispatch now, else 0. Sends
    /// it makes on that waitset's channels are published by the waitset
    /// (see [`Waitset::send`]); others at once. Only this thread reads or
    /// writes it, and only compares it: the cell lives while its dispatch
    /// runs the callback.
    in_callback: Cell<usize>,
    /// The waitset this thread dispatched last (a thread usually serves
    /// one), held, so that a busy dispatch loop takes no directory lock and
    /// counts no reference (the cell's address, its key, is not reused
    /// meanwhile). A destroyed one says so under its lock.
    last_waitset: RefCell<Option<(usize, WsRef)>>,
    /// The channel ends this thread called last, the latest first: token,
    /// struct address and waitset (held: a call that finds it counts no
    /// reference). A stale entry is harmless: a waitset checks token and
    /// address again under its lock (tokens are never reused), and a
    /// destroyed waitset has closed its fds.
    last_channels: RefCell<Vec<KnownChannel>>,
}

thread_local! {
    static THREAD: ThreadState = const {
        ThreadState { in_callback: Cell::new(0), last_waitset: RefCell::new(None), last_channels: RefCell::new(Vec::new()) }
    };
}

/// Puts the previous [`ThreadState::in_callback`] back when dropped (a
/// nested dispatch of another waitset returns to the outer one's
/// callback; a panic of the library on the way out leaves no stale mark).
struct CallbackMark<'a>(&'a Cell<usize>, usize);

impl Drop for CallbackMark<'_> {
    fn drop(&mut self) {
        self.0.set(self.1);
    }
}

/// Runs `f`, the program's callback or continuation, as one of `ws`'s.
fn as_callback_of(t: &ThreadState, ws: &WsCell, f: impl FnOnce()) {
    let _mark = CallbackMark(&t.in_callback, t.in_callback.replace(ws as *const WsCell as usize));
    f();
}

type WsRef = Arc<WsCell>;

/// A new waitset and its key (the address given to C).
fn new_ws() -> Res<(usize, WsRef)> {
    let ws = Arc::new(WsCell { ws: SpinLock::new(Some(Waitset::new()?)) });
    Ok((Arc::as_ptr(&ws) as usize, ws))
}

fn lock(ws: &WsCell) -> SpinGuard<'_, Option<Waitset>> {
    ws.ws.lock()
}

/// The waitset behind a locked cell, unless it was destroyed.
fn live<'a>(g: &'a mut SpinGuard<'_, Option<Waitset>>) -> Res<&'a mut Waitset> {
    g.as_mut().ok_or(ERR_INVALID_WAITSET)
}

/// A send on a channel of `ws` with `cont`: batched if this thread runs a
/// callback of `ws` from its dispatch now.
fn sending(t: &ThreadState, ws: &WsCell, cont: Option<Cont>) -> Sending {
    Sending { cont, batched: t.in_callback.get() == ws as *const WsCell as usize }
}

/// A channel end as the directory knows it.
struct ChanRef {
    /// Address of the program's `struct bulk_channel`.
    c_addr: usize,
    /// Its place on its waitset.
    place: usize,
    ws: WsRef,
    /// A local creator's endpoint, for its binder.
    local_ep: Option<Endpoint>,
}

/// Waitsets by the address given to C, and the default one.
#[derive(Default)]
struct Waitsets {
    by_key: IdMap<WsRef>,
    default: Option<usize>,
}

static WAITSETS: LazyLock<RwLock<Waitsets>> = LazyLock::new(Default::default);
static CHANNELS: LazyLock<RwLock<IdMap<ChanRef>>> = LazyLock::new(Default::default);

fn waitsets_read() -> std::sync::RwLockReadGuard<'static, Waitsets> {
    WAITSETS.read().unwrap_or_else(|p| p.into_inner())
}

fn waitsets_write() -> std::sync::RwLockWriteGuard<'static, Waitsets> {
    WAITSETS.write().unwrap_or_else(|p| p.into_inner())
}

fn channels_read() -> std::sync::RwLockReadGuard<'static, IdMap<ChanRef>> {
    CHANNELS.read().unwrap_or_else(|p| p.into_inner())
}

fn channels_write() -> std::sync::RwLockWriteGuard<'static, IdMap<ChanRef>> {
    CHANNELS.write().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------- waitsets

fn waitset(key: usize) -> Res<WsRef> {
    waitsets_read().by_key.get(&key).cloned().ok_or(ERR_INVALID_WAITSET)
}

/// `bulk_waitset_create`.
pub fn waitset_create() -> Res<usize> {
    let (key, ws) = new_ws()?;
    waitsets_write().by_key.insert(key, ws);
    Ok(key)
}

/// `bulk_waitset_default`.
pub fn waitset_default() -> Res<usize> {
    if let Some(k) = waitsets_read().default {
        return Ok(k);
    }
    let (key, ws) = new_ws()?;
    let mut w = waitsets_write();
    if let Some(k) = w.default {
        return Ok(k); // another thread made it meanwhile
    }
    w.by_key.insert(key, ws);
    w.default = Some(key);
    Ok(key)
}

/// The waitset a setup names (NULL: the default one).
fn waitset_or_default(key: usize) -> Res<(usize, WsRef)> {
    let key = if key == 0 { waitset_default()? } else { key };
    Ok((key, waitset(key)?))
}

/// `bulk_waitset_destroy`.
pub fn waitset_destroy(key: usize) -> Res<()> {
    let ws = waitset(key)?;
    {
        let mut g = lock(&ws);
        if live(&mut g)?.busy() {
            return Err(ERR_WAITSET_BUSY);
        }
        // Closes its fds now: a thread's cache may hold the cell longer.
        *g = None;
    }
    let mut all = waitsets_write();
    all.by_key.remove(&key);
    if all.default == Some(key) {
        all.default = None;
    }
    Ok(())
}

/// `bulk_waitset_fd`.
pub fn waitset_fd(key: usize) -> Res<i32> {
    let ws = waitset(key)?;
    let fd = live(&mut lock(&ws))?.take_fd();
    Ok(fd)
}

/// `bulk_waitset_set_spin`.
pub fn waitset_set_spin(key: usize, spin: Duration) -> Res<()> {
    let ws = waitset(key)?;
    live(&mut lock(&ws))?.spin = spin;
    Ok(())
}

/// `bulk_waitset_dispatch`: runs the next due work of the waitset `key`,
/// waiting up to the timeout (`None`: no limit) for some.
pub fn dispatch(key: usize, timeout: Option<Duration>) -> Res<()> {
    THREAD.with(|t| {
        // The cache stays borrowed while the callback runs: a nested
        // dispatch of the same waitset borrows it too, one of another
        // waitset does without it.
        if let Ok(l) = t.last_waitset.try_borrow() {
            if let Some((k, ws)) = &*l {
                if *k == key {
                    return dispatch_on(t, ws, timeout);
                }
            }
        }
        let ws = remember_waitset(t, key)?;
        dispatch_on(t, &ws, timeout)
    })
}

/// The waitset of `key` from the directory, kept in this thread's cache
/// (the first dispatch of a waitset: out of the usual path).
#[cold]
#[inline(never)]
fn remember_waitset(t: &ThreadState, key: usize) -> Res<WsRef> {
    let ws = waitset(key)?;
    if let Ok(mut l) = t.last_waitset.try_borrow_mut() {
        *l = Some((key, ws.clone()));
    }
    Ok(ws)
}

/// [`dispatch`] on a waitset found.
fn dispatch_on(t: &ThreadState, ws: &WsCell, timeout: Option<Duration>) -> Res<()> {
    // Read the clock only once there is nothing to do at once.
    let mut deadline: Option<Option<Instant>> = None;
    let mut spin_until = SpinClock::default();
    let sleeps = timeout != Some(Duration::ZERO);
    // A buffer event's meta data, for its callback: on this stack, written
    // once (a dispatch runs one callback).
    let mut meta = MetaBuf::new();
    loop {
        // The lock is held only to pick the work; callbacks run without it.
        let step = {
            let mut g = lock(ws);
            live(&mut g)?.next_step(&mut spin_until, sleeps, &mut meta)
        };
        match step {
            Step::Run(work) => {
                // Sends of the callback on this waitset's channels are
                // published by its polls (see `Waitset::send`). The mark is
                // this thread's own: a nested dispatch of another waitset
                // marks its callbacks and puts this mark back, and another
                // thread is never marked by this one. No shared write per
                // callback.
                as_callback_of(t, ws, || work.run());
                return Ok(());
            }
            Step::Buffer(call) => {
                as_callback_of(t, ws, || call.run(&mut meta));
                return Ok(());
            }
            Step::Spin => std::hint::spin_loop(),
            Step::Nothing => return Err(ERR_TIMEOUT),
            Step::Idle { fd, live } => {
                // A timeout too long to represent is no limit.
                let deadline = *deadline.get_or_insert_with(|| timeout.and_then(|t| Instant::now().checked_add(t)));
                let left = match deadline {
                    None if timeout.is_none() && !live => return Err(ERR_WAITSET_EMPTY),
                    None => None,
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Err(ERR_TIMEOUT);
                        }
                        Some(left)
                    }
                };
                call::poll_readable(fd, left);
            }
        }
    }
}

// ---------------------------------------------------------------------- channels

/// A channel end as a thread remembers it: token and place, struct
/// address, waitset.
type KnownChannel = (ChanId, usize, WsRef);

/// Channel ends a thread remembers (a thread serving a few channels, e.g.
/// both ends of a local channel, finds each of them there).
const KNOWN_CHANNELS: usize = 4;

/// The token, place and waitset of a live channel struct, from the directory.
fn channel_listed(ch: *mut BulkChannel) -> Res<(ChanId, WsRef)> {
    let token = boundary::channel_token(ch);
    match channels_read().get(&token) {
        Some(r) if r.c_addr == ch as usize => Ok((ChanId { token, place: r.place }, r.ws.clone())),
        _ => Err(ERR_INVALID_CHANNEL),
    }
}

/// Runs `f` on this thread's state, the channel end and the locked live
/// waitset of a channel struct (the call's one lock), found as
/// [`with_channel`] finds it.
fn with_channel_locked<R>(
    ch: *mut BulkChannel,
    f: impl FnOnce(&ThreadState, ChanId, &WsCell, &mut Waitset) -> Res<R>,
) -> Res<R> {
    with_channel(ch, |t, id, ws| f(t, id, ws, live(&mut lock(ws))?))
}

/// Runs `f` on this thread's state and the channel end and waitset of a
/// channel struct, for a call on it (which its waitset checks again): from
/// this thread's cache if it called on it lately, so that a thread busy
/// with a few channels shares no directory lock with others and counts no
/// reference. `f` does not call into the program (the cache stays
/// borrowed meanwhile).
fn with_channel<R>(ch: *mut BulkChannel, f: impl FnOnce(&ThreadState, ChanId, &WsRef) -> Res<R>) -> Res<R> {
    let token = boundary::channel_token(ch);
    THREAD.with(|t| {
        if let Ok(l) = t.last_channels.try_borrow() {
            if let Some((id, _, ws)) = l.iter().find(|(id, c, _)| id.token == token && *c == ch as usize) {
                return f(t, *id, ws);
            }
        }
        let (id, ws) = remember_channel(t, ch)?;
        f(t, id, &ws)
    })
}

/// A channel struct's end and waitset from the directory, kept in this
/// thread's cache (the first call on a channel: out of the usual path).
#[cold]
#[inline(never)]
fn remember_channel(t: &ThreadState, ch: *mut BulkChannel) -> Res<(ChanId, WsRef)> {
    let (id, ws) = channel_listed(ch)?;
    if let Ok(mut l) = t.last_channels.try_borrow_mut() {
        l.retain(|(known, _, _)| known.token != id.token);
        l.insert(0, (id, ch as usize, ws.clone()));
        l.truncate(KNOWN_CHANNELS);
    }
    Ok((id, ws))
}

/// The Ferry endpoint an endpoint descriptor names, and its backend.
fn endpoint(ep: *mut BulkEndpointDescriptor, remote: bool) -> Res<(Endpoint, u32)> {
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
                    let token = boundary::channel_token(other);
                    match channels_read().get(&token) {
                        Some(r) if r.c_addr == other as usize => r.local_ep.clone().ok_or(ERR_INVALID_ENDPOINT)?,
                        _ => return Err(ERR_ENDPOINT_NOT_LISTENING),
                    }
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

/// What a new channel end's struct and directory entry need.
struct NewEnd {
    ch: *mut BulkChannel,
    ep: *mut BulkEndpointDescriptor,
    callbacks: *mut BulkChannelCallbacks,
    constraints: BulkChannelConstraints,
    user_state: *mut std::ffi::c_void,
    /// Over a local channel.
    local: bool,
}

/// Registers a new channel end: the waitset (whose dispatch may write the
/// struct once the lock is let go), the directory, the program's struct.
fn register(
    end: NewEnd,
    ws_key: usize,
    ws: WsRef,
    channel: Channel,
    local_ep: Option<Endpoint>,
    bind_cont: Option<Cont>,
) -> Res<()> {
    let token = new_token();
    let fields = BulkChannel {
        callbacks: end.callbacks,
        ep: end.ep,
        state: state_to(channel.state()),
        pools: std::ptr::null_mut(),
        direction: direction_to(channel.direction()),
        role: role_to(channel.role()),
        trust: trust_to(channel.trust()),
        constraints: end.constraints,
        meta_size: channel.meta_size(),
        waitset: ws_key as *mut std::ffi::c_void,
        user_state: end.user_state,
        impl_data: token as *mut std::ffi::c_void,
    };
    let mut g = lock(&ws);
    let w = live(&mut g)?;
    // All under the waitset's lock: its dispatch sees the end only once
    // the struct is filled, and no call finds the end before the struct
    // holds its token.
    let place = w.insert(token, (end.ch as usize, end.callbacks as usize, end.local), channel, bind_cont);
    channels_write().insert(token, ChanRef { c_addr: end.ch as usize, place, ws: ws.clone(), local_ep });
    boundary::init_channel(end.ch, fields);
    Ok(())
}

/// Refuses a channel struct that is in use.
fn check_unused(ch: *mut BulkChannel) -> Res<()> {
    match channel_listed(ch) {
        Ok(_) => Err(ERR_CHANNEL_IN_USE),
        Err(_) => Ok(()),
    }
}

/// `bulk_channel_create`.
pub fn channel_create(
    ch: *mut BulkChannel,
    ep: *mut BulkEndpointDescriptor,
    callbacks: *mut BulkChannelCallbacks,
    s: BulkChannelSetup,
) -> Res<()> {
    check_unused(ch)?;
    let direction = direction_from(s.direction).ok_or(ERR_INVALID_ARGUMENT)?;
    let role = role_from(s.role).ok_or(ERR_INVALID_ARGUMENT)?;
    let trust = trust_from(s.trust).filter(|t| *t != TrustLevel::Uninitialized).ok_or(ERR_INVALID_ARGUMENT)?;
    if s.meta_size > MAX_META_SIZE {
        return Err(ERR_INVALID_ARGUMENT);
    }
    let (endpoint, backend) = endpoint(ep, false)?;
    let (ws_key, ws) = waitset_or_default(s.waitset as usize)?;
    let setup = ChannelSetup {
        direction,
        role,
        trust,
        meta_size: s.meta_size,
        constraints: ChannelConstraints { alignment: s.constraints.men_align, ..ChannelConstraints::default() },
        ..ChannelSetup::default()
    };
    let channel = Channel::create(&DOMAIN, &endpoint, setup).map_err(|e| of_error(&e))?;
    if backend == BACKEND_NET {
        if let Some(addr) = channel.listen_addr() {
            boundary::set_net_port(ep, addr.port());
        }
    }
    let local_ep = (backend == BACKEND_LOCAL).then_some(endpoint);
    let end =
        NewEnd { ch, ep, callbacks, constraints: s.constraints, user_state: s.user_state, local: local_ep.is_some() };
    register(end, ws_key, ws, channel, local_ep, None)
}

/// `bulk_channel_bind`.
pub fn channel_bind(
    ch: *mut BulkChannel,
    ep: *mut BulkEndpointDescriptor,
    callbacks: *mut BulkChannelCallbacks,
    p: BulkChannelBindParams,
    cont: Option<Cont>,
) -> Res<()> {
    check_unused(ch)?;
    let role = role_from(p.role).ok_or(ERR_INVALID_ARGUMENT)?;
    let trust = match trust_from(p.trust).ok_or(ERR_INVALID_ARGUMENT)? {
        TrustLevel::Uninitialized => None,
        t => Some(t),
    };
    let (endpoint, backend) = endpoint(ep, true)?;
    let (ws_key, ws) = waitset_or_default(p.waitset as usize)?;
    let params = BindParams {
        role,
        trust,
        constraints: ChannelConstraints { alignment: p.constraints.men_align, ..ChannelConstraints::default() },
        ..BindParams::default()
    };
    let channel = Channel::bind(&DOMAIN, &endpoint, params).map_err(|e| of_error(&e))?;
    let local = backend == BACKEND_LOCAL;
    let end = NewEnd { ch, ep, callbacks, constraints: p.constraints, user_state: p.user_state, local };
    register(end, ws_key, ws, channel, None, cont)
}

/// `bulk_channel_destroy`.
pub fn channel_destroy(ch: *mut BulkChannel, cont: Option<Cont>) -> Res<()> {
    with_channel_locked(ch, |_, id, _, w| {
        w.destroy(id, ch as usize, cont)?;
        Ok(id.token)
    })
    .map(|token| channels_write().remove(&token))?;
    collect_pools();
    Ok(())
}

/// `bulk_channel_assign_pool` and `bulk_channel_remove_pool`.
pub fn channel_pool(ch: *mut BulkChannel, pool: usize, cont: Option<Cont>, assign: bool) -> Res<()> {
    with_channel_locked(ch, |_, id, _, w| w.channel_pool(id, ch as usize, pool, cont, assign))
}

/// `bulk_channel_move` and `bulk_channel_pass`.
pub fn channel_send(
    ch: *mut BulkChannel,
    buffer: usize,
    meta: *const std::ffi::c_void,
    cont: Option<Cont>,
    dir: Direction,
) -> Res<()> {
    with_channel_locked(ch, |t, id, ws, w| w.send(id, ch as usize, buffer, meta, sending(t, ws, cont), dir))
}

/// `bulk_channel_copy`.
pub fn channel_copy(ch: *mut BulkChannel, buffer: usize, meta: *const std::ffi::c_void, cont: Option<Cont>) -> Res<()> {
    with_channel_locked(ch, |t, id, ws, w| w.copy(id, ch as usize, buffer, meta, sending(t, ws, cont)))
}

/// `bulk_channel_release`.
pub fn channel_release(ch: *mut BulkChannel, buffer: usize, cont: Option<Cont>) -> Res<()> {
    with_channel_locked(ch, |t, id, ws, w| w.release(id, ch as usize, buffer, sending(t, ws, cont)))
}

/// The program's answer to a pool offer (after its `pool_assigned` ran).
pub fn answer_pool(token: usize, pool: PoolId, accept: bool) {
    let ws = channels_read().get(&token).map(|r| r.ws.clone());
    if let Some(w) = ws.as_ref().map(|ws| lock(ws)).as_mut().and_then(|g| g.as_mut()) {
        w.answer_pool(token, pool, accept);
    }
    if !accept {
        collect_pools();
    }
}

// ---------------------------------------------------------------------- pools

/// `bulk_alloc_free`.
pub fn alloc_free(a: *mut BulkAllocator) -> Res<()> {
    crate::table::alloc_free(a)?;
    collect_pools();
    Ok(())
}

/// Forgets the pools nothing refers to any more: no allocator, no buffer
/// or copy held by the program, no channel end that lists or negotiates
/// them, no queued callback that hands them over. Their C objects are
/// freed. Called with no lock held.
pub fn collect_pools() {
    let generation = GENERATION.load(Ordering::SeqCst);
    let mut candidates = unheld_pools();
    if candidates.is_empty() {
        return;
    }
    let all: Vec<WsRef> = waitsets_read().by_key.values().cloned().collect();
    for ws in &all {
        if let Some(w) = lock(ws).as_mut() {
            w.keep_used(&mut candidates);
        }
    }
    // A channel may have taken up one of them while we looked: next time.
    if GENERATION.load(Ordering::SeqCst) != generation {
        return;
    }
    forget(&candidates);
    // The waitsets' caches let go of them now, not at their next lookup.
    for ws in &all {
        if let Some(w) = lock(ws).as_mut() {
            w.forget_pools();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A callback that dispatches another waitset (a nested callback)
    /// finds its own mark again once that returns: its sends on its own
    /// waitset's channels are batched before and after, and nothing is
    /// marked once the outer callback returned, even if the inner one
    /// panicked.
    #[test]
    fn a_nested_callback_puts_the_outer_mark_back() {
        let (_, outer) = new_ws().expect("a waitset");
        let (_, inner) = new_ws().expect("a waitset");
        THREAD.with(|t| {
            assert!(!sending(t, &outer, None).batched);
            as_callback_of(t, &outer, || {
                assert!(sending(t, &outer, None).batched);
                as_callback_of(t, &inner, || {
                    assert!(sending(t, &inner, None).batched);
                    assert!(!sending(t, &outer, None).batched);
                });
                assert!(sending(t, &outer, None).batched);
                assert!(!sending(t, &inner, None).batched);
                let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    as_callback_of(t, &inner, || panic!("the library failed inside a callback"));
                }));
                assert!(panicked.is_err());
                assert!(sending(t, &outer, None).batched);
            });
            assert_eq!(t.in_callback.get(), 0);
            assert!(!sending(t, &outer, None).batched);
        });
    }
}
