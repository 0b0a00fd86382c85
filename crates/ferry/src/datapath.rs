//! Data paths, after the fbufs of Druschel and Peterson ("Fbufs: A
//! High-Bandwidth Cross-Domain Transfer Facility", SOSP 1993, §3.2): the
//! buffers that travel along one path of domains (A → B → C) come from
//! pools that are mapped in every domain of the path *before* the first
//! transfer, so a transfer maps nothing.
//!
//! A [`DataPath`] lives in the path's originating domain. It holds the
//! path's first channel(s) (owned, or borrowed as `&mut Channel`), makes the
//! path's pools lazily — one when a buffer is asked for and none is free —
//! and assigns each new pool to every one of those channels at once. A
//! domain further along forwards every pool it is offered on the path to its
//! own outgoing channel(s) with [`forward_pool`] before it forwards any
//! buffer of it: the ETH bulk-transfer specification lets a domain offer a
//! pool it did not create once it has *accepted* it (a pool merely offered
//! to it may not be offered on), so the middle domain accepts the pool
//! upstream, then assigns it downstream and waits for the answer. Over shm
//! the memfd travels on; over TCP each hop keeps a mirror of its own.
//!
//! Buffers come back to the originator by the usual ways (passed back, or
//! dropped there) and return to their pool's free list, most recently
//! freed first. Nothing is ever zero-filled by Ferry: a buffer used before
//! holds its old bytes; a buffer of a fresh pool reads as zeros because the
//! kernel hands out fresh pages zeroed.
//!
//! A [`PathQuota`] bounds the pools a path may make (count and bytes): a
//! domain along the path that never gives buffers back can only use up its
//! own path's quota ([`ErrorKind::QuotaExceeded`]), never the memory of the
//! machine or another path's buffers.

use crate::ErrorKind;
use std::borrow::BorrowMut;
use std::time::Duration;

use crate::alloc::Allocator;
use crate::buffer::Buffer;
use crate::channel::Channel;
use crate::domain::{Domain, Pool};
use crate::error::Result;
use crate::pool::{Geometry, PoolConstraints, PoolId};

/// Limits on the pool memory of one [`DataPath`].
///
/// ```
/// let q = ferry::PathQuota { max_pools: 4, max_bytes: 16 << 20 };
/// assert_eq!(q.max_pools, 4);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathQuota {
    /// At most this many pools.
    pub max_pools: u32,
    /// At most this many bytes of pool memory in all.
    pub max_bytes: u64,
}

/// How a [`DataPath`] makes its pools.
#[derive(Debug, Clone, Copy)]
pub struct PathConfig {
    /// Size of every buffer (a power of two, a multiple of the page size).
    pub buffer_size: usize,
    /// Buffers per pool (each pool the path grows by has this many).
    pub buffers_per_pool: u64,
    /// The path's limits.
    pub quota: PathQuota,
    /// Trust level and alignment of the pools (the trust must be that of
    /// the path's channels, or `Uninitialized` to take theirs).
    pub constraints: PoolConstraints,
    /// How long to wait for each channel's answer when a new pool is
    /// assigned along the path.
    pub assign_timeout: Duration,
}

impl PathConfig {
    /// `buffers_per_pool` buffers of `buffer_size` bytes per pool, at most
    /// `quota`; default constraints, 10 s to assign a pool.
    pub fn new(buffer_size: usize, buffers_per_pool: u64, quota: PathQuota) -> Self {
        PathConfig {
            buffer_size,
            buffers_per_pool,
            quota,
            constraints: PoolConstraints::default(),
            assign_timeout: Duration::from_secs(10),
        }
    }
}

/// The originating domain's end of a data path: its first channel(s) and
/// the pools assigned along it.
///
/// `C` is [`Channel`] (the path owns its channels) or `&mut Channel` (it
/// borrows them for a while). The peer at the other end of each channel
/// must answer pool assignments (for example with
/// [`PoolPolicy::AcceptAll`](crate::PoolPolicy::AcceptAll)) while the path
/// grows, and forward them further with [`forward_pool`].
///
/// ```
/// use std::time::Duration;
/// use ferry::{BindParams, Channel, ChannelSetup, DataPath, Domain, Endpoint, Error, ErrorKind, Event, PathConfig, PathQuota, PoolPolicy};
/// let t = Duration::from_secs(10);
/// let ep = Endpoint::local();
/// let sink = {
///     let ep = ep.clone();
///     std::thread::spawn(move || {
///         let mut rx = Channel::connect(&Domain::new("sink"), &ep, BindParams::default(), t).unwrap();
///         rx.set_pool_policy(PoolPolicy::AcceptAll);
///         loop {
///             match rx.wait(Some(t)) {
///                 Ok(Event::MoveReceived { buffer, .. }) => rx.pass(buffer, &[]).unwrap(),
///                 _ => return,
///             }
///         }
///     })
/// };
/// let app = Domain::new("app");
/// let tx = Channel::accept(&app, &ep, ChannelSetup::default(), t)?;
/// let quota = PathQuota { max_pools: 1, max_bytes: 1 << 20 };
/// let mut path = DataPath::new(&app, vec![tx], PathConfig::new(4096, 2, quota))?;
/// let first = path.alloc()?;               // the first pool is made and assigned now
/// let id = first.id();
/// path.channel_mut(0).move_buffer(first, &[])?;
/// let Ok(Event::BufferPassed { buffer, .. }) = path.channel_mut(0).wait(Some(t)) else { panic!() };
/// drop(buffer);                             // back on the free list
/// let again = path.alloc()?;                // most recently freed first; nothing mapped
/// assert_eq!(again.id(), id);
/// let second = path.alloc()?;
/// assert!(matches!(path.alloc().map_err(ferry::Error::into_kind), Err(ErrorKind::QuotaExceeded { pools: 1, max_pools: 1, .. })));
/// drop((again, second, path));              // the channel closes; the sink ends
/// sink.join().unwrap();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DataPath<C: BorrowMut<Channel> = Channel> {
    domain: Domain,
    channels: Vec<C>,
    config: PathConfig,
    geometry: Geometry,
    /// The path's pools, oldest first.
    pools: Vec<Allocator>,
    /// Their ids, in the same order.
    ids: Vec<PoolId>,
}

impl<C: BorrowMut<Channel>> std::fmt::Debug for DataPath<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPath")
            .field("domain", &self.domain)
            .field("channels", &self.channels.len())
            .field("pools", &self.pool_ids())
            .field("quota", &self.config.quota)
            .finish()
    }
}

impl<C: BorrowMut<Channel>> DataPath<C> {
    /// A path from `domain` over `channels` (its first hop: one channel, or
    /// several for a path that fans out). No pool is made yet.
    ///
    /// Errors: [`ErrorKind::InvalidArgument`] without channels, or with a
    /// channel of another domain, or with a quota that does not hold one
    /// pool; [`ErrorKind::BadBufferSize`]/[`ErrorKind::BadBufferCount`] for the
    /// geometry.
    pub fn new(domain: &Domain, channels: Vec<C>, config: PathConfig) -> Result<Self> {
        let geometry = Geometry::new(config.buffer_size, config.buffers_per_pool)?;
        if channels.is_empty() {
            return Err(ErrorKind::InvalidArgument("a data path needs at least one channel").into());
        }
        if channels.iter().any(|c| c.borrow().domain().id() != domain.id()) {
            return Err(ErrorKind::InvalidArgument("every channel of a data path must belong to its domain").into());
        }
        if config.quota.max_pools == 0 || (geometry.len() as u64) > config.quota.max_bytes {
            return Err(ErrorKind::InvalidArgument("the data path's quota does not hold a single pool").into());
        }
        Ok(DataPath { domain: domain.clone(), channels, config, geometry, pools: Vec::new(), ids: Vec::new() })
    }

    /// A free buffer of the path: the most recently freed one over all its
    /// pools (LIFO: its cache lines and TLB entries are the warmest; buffers
    /// never used yet come after every recycled one, oldest pool first), or a
    /// buffer of a new pool, made and assigned to every channel of the path
    /// now (waiting for each peer's answer up to
    /// [`PathConfig::assign_timeout`]).
    ///
    /// The buffer's bytes are what its last user left there (Ferry never
    /// clears a buffer); a new pool's buffers read as zeros.
    ///
    /// Errors: [`ErrorKind::QuotaExceeded`] when every buffer is in use and one
    /// more pool would exceed the quota; the errors of
    /// [`Channel::assign_pool_and_wait`] (then the new pool is removed from
    /// the channels it reached, and the path forgets it; after
    /// [`ErrorKind::TimedOut`] the request stays out on the channel that did
    /// not answer, and a late acceptance leaves the pool there, unused by
    /// the path, until it is removed or the channel closes).
    pub fn alloc(&mut self) -> Result<Buffer> {
        if let Some(b) = self.domain.alloc_latest(&self.ids) {
            return Ok(b);
        }
        self.grow()?;
        Ok(self.pools.last().and_then(Allocator::alloc).expect("a new pool has free buffers"))
    }

    /// Make the next pool now (as [`alloc`](DataPath::alloc) would when no
    /// buffer is free): to have the path's mappings in place before the
    /// first transfer. Returns the new pool's id.
    pub fn grow(&mut self) -> Result<PoolId> {
        let pool_bytes = self.geometry.len() as u64;
        let quota = self.config.quota;
        let (pools, bytes) = (self.pools.len() as u32, self.bytes());
        if pools >= quota.max_pools || bytes + pool_bytes > quota.max_bytes {
            return Err(
                ErrorKind::QuotaExceeded { pools, max_pools: quota.max_pools, max_bytes: quota.max_bytes }.into()
            );
        }
        let alloc = Allocator::new(
            &self.domain,
            self.config.buffers_per_pool,
            self.config.buffer_size,
            self.config.constraints,
        )?;
        let id = alloc.pool().id();
        for i in 0..self.channels.len() {
            if let Err(e) = self.channels[i].borrow_mut().assign_pool_and_wait(alloc.pool(), self.config.assign_timeout)
            {
                for ch in &mut self.channels[..i] {
                    // Best effort: the pool is dropped below either way.
                    let _ = ch.borrow_mut().remove_pool(id);
                }
                return Err(e);
            }
        }
        self.pools.push(alloc);
        self.ids.push(id);
        Ok(id)
    }

    /// The path's pools, oldest first.
    pub fn pool_ids(&self) -> Vec<PoolId> {
        self.ids.clone()
    }

    /// A handle to the path's `i`th pool (oldest first).
    pub fn pool(&self, i: usize) -> Option<&Pool> {
        self.pools.get(i).map(Allocator::pool)
    }

    /// Bytes of pool memory the path has made.
    pub fn bytes(&self) -> u64 {
        self.pools.len() as u64 * self.geometry.len() as u64
    }

    /// Free buffers of the path, over all its pools.
    pub fn available(&self) -> usize {
        self.pools.iter().map(Allocator::available).sum()
    }

    /// The path's configuration.
    pub fn config(&self) -> &PathConfig {
        &self.config
    }

    /// The originating domain.
    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    /// The path's `i`th first-hop channel (panics if there is none such).
    pub fn channel_mut(&mut self, i: usize) -> &mut Channel {
        self.channels[i].borrow_mut()
    }

    /// Number of first-hop channels.
    pub fn channel_count(&self) -> usize {
        self.channels.len()
    }

    /// Give the channels back. The pools stay assigned to them (each stays
    /// as long as a channel, buffer or handle refers to it).
    pub fn into_channels(self) -> Vec<C> {
        self.channels
    }
}

/// The part of a data path in a domain along it: `pool`, offered on
/// `inbound` (an [`Event::PoolAssignRequest`](crate::Event::PoolAssignRequest)),
/// is accepted there (unless the channel's
/// [`PoolPolicy::AcceptAndReport`](crate::PoolPolicy::AcceptAndReport)
/// accepted it already; under
/// [`PoolPolicy::AcceptAll`](crate::PoolPolicy::AcceptAll) the middle
/// domain would not learn of the pool) and then assigned to every channel of `outbound`, waiting up to
/// `timeout` for each answer. Call it when the request arrives, before
/// forwarding any buffer: buffers of the pool arrive on `inbound` only
/// after the acceptance, and by then the pool is on the outgoing channels
/// too, so forwarding them maps nothing.
///
/// Errors: [`ErrorKind::NoPendingRequest`] if `pool` was neither offered on
/// `inbound` nor assigned to it; the errors of
/// [`Channel::respond_pool`] and [`Channel::assign_pool_and_wait`].
///
/// ```
/// use std::time::Duration;
/// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};
/// let t = Duration::from_secs(10);
/// let (ab, bc) = (Endpoint::local(), Endpoint::local());
/// let c = {
///     let bc = bc.clone();
///     std::thread::spawn(move || {
///         let mut rx = Channel::connect(&Domain::new("c"), &bc, BindParams::default(), t).unwrap();
///         rx.set_pool_policy(PoolPolicy::AcceptAndReport); // accept, and say which pool
///         match rx.wait(Some(t)) {
///             Ok(Event::PoolAssignRequest(req)) => req.pool,
///             other => panic!("{other:?}"),
///         }
///     })
/// };
/// let (a, b) = (Domain::new("a"), Domain::new("b"));
/// let mut a_tx = Channel::create(&a, &ab, ChannelSetup::default())?;
/// let mut b_rx = Channel::bind(&b, &ab, BindParams::default())?;
/// let mut b_tx = Channel::accept(&b, &bc, ChannelSetup::default(), t)?;
/// a_tx.wait_connected(t)?;
/// b_rx.wait_connected(t)?;
/// let alloc = Allocator::new(&a, 2, 4096, PoolConstraints::default())?;
/// a_tx.assign_pool(alloc.pool())?;
/// // b, the middle of the path a → b → c:
/// let Ok(Event::PoolAssignRequest(req)) = b_rx.wait(Some(t)) else { panic!() };
/// ferry::forward_pool(&mut b_rx, req.pool, &mut [&mut b_tx], t)?;
/// assert!(b_tx.is_assigned(alloc.pool().id()));
/// assert!(matches!(a_tx.wait(Some(t)), Ok(Event::PoolAssigned(_))));
/// assert_eq!(c.join().unwrap(), alloc.pool().id());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn forward_pool(
    inbound: &mut Channel,
    pool: PoolId,
    outbound: &mut [&mut Channel],
    timeout: Duration,
) -> Result<()> {
    if inbound.pending_requests().iter().any(|r| r.pool == pool) {
        inbound.respond_pool(pool, true)?;
    } else if !inbound.is_assigned(pool) {
        return Err(ErrorKind::NoPendingRequest(pool).into());
    }
    let handle = inbound.domain().pool(pool).ok_or(ErrorKind::UnknownPool(pool))?;
    for ch in outbound.iter_mut() {
        if !ch.is_assigned(pool) {
            ch.assign_pool_and_wait(&handle, timeout)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BindParams, ChannelSetup, Endpoint, Event, PoolPolicy};

    const T: Duration = Duration::from_secs(10);

    /// A channel from `a` whose peer, on its own thread, accepts every pool
    /// and passes every buffer back (after writing `mark` into its first
    /// byte when not zero), until the channel closes.
    fn echo_peer(a: &Domain, mark: u8) -> (Channel, std::thread::JoinHandle<()>) {
        let ep = Endpoint::local();
        let peer = {
            let ep = ep.clone();
            std::thread::spawn(move || {
                let mut rx = Channel::connect(&Domain::new("echo"), &ep, BindParams::default(), T).unwrap();
                rx.set_pool_policy(PoolPolicy::AcceptAll);
                loop {
                    match rx.wait(Some(T)) {
                        Ok(Event::MoveReceived { mut buffer, .. }) => {
                            if mark != 0 {
                                buffer.as_mut_slice().unwrap()[0] = mark;
                            }
                            rx.pass(buffer, &[]).unwrap();
                        }
                        Ok(Event::PoolAssignRequest(_) | Event::PoolRemoved(_)) => {}
                        Ok(Event::Closed { .. }) | Err(_) => return,
                        Ok(Event::Error(e)) if e == crate::ErrorKind::PeerGone => return,
                        other => panic!("echo: {other:?}"),
                    }
                }
            })
        };
        (Channel::accept(a, &ep, ChannelSetup::default(), T).unwrap(), peer)
    }

    fn quota(max_pools: u32) -> PathQuota {
        PathQuota { max_pools, max_bytes: 1 << 30 }
    }

    /// Pools are made one at a time as buffers run out, each assigned to
    /// the channel at once; LIFO reuse after that, nothing new mapped.
    #[test]
    fn grows_lazily_and_reuses_lifo() {
        let a = Domain::new("a");
        let (tx, peer) = echo_peer(&a, 0);
        let mut path = DataPath::new(&a, vec![tx], PathConfig::new(4096, 2, quota(3))).unwrap();
        assert!(path.pool_ids().is_empty() && a.pools().is_empty(), "nothing made before the first alloc");
        let b0 = path.alloc().unwrap();
        let p0 = path.pool_ids()[0];
        assert!(path.channel_mut(0).is_assigned(p0), "assigned when made");
        let b1 = path.alloc().unwrap();
        let b2 = path.alloc().unwrap();
        assert_eq!(path.pool_ids().len(), 2);
        assert_eq!((b0.id().pool, b1.id().pool, b2.id().pool), (p0, p0, path.pool_ids()[1]));
        let (id0, id1, id2) = (b0.id(), b1.id(), b2.id());
        drop(b0);
        drop(b2);
        drop(b1);
        // Across the path's pools: the most recently freed first.
        let (x, y, z) = (path.alloc().unwrap(), path.alloc().unwrap(), path.alloc().unwrap());
        assert_eq!((x.id(), y.id(), z.id()), (id1, id2, id0), "most recently freed first, across pools");
        assert_eq!(path.pool_ids().len(), 2);
        let fresh = path.alloc().unwrap();
        assert_eq!(fresh.id().index, 1, "then a buffer never used, of the second pool");
        drop((x, y, z, fresh));
        // Round trips over the channel make no new pool.
        for _ in 0..10 {
            let b = path.alloc().unwrap();
            path.channel_mut(0).move_buffer(b, &[]).unwrap();
            let Ok(Event::BufferPassed { buffer, .. }) = path.channel_mut(0).wait(Some(T)) else { panic!() };
            drop(buffer);
        }
        assert_eq!(path.pool_ids().len(), 2);
        assert_eq!(path.bytes(), 2 * 8192);
        let mut ch = path.into_channels().pop().unwrap();
        ch.teardown().unwrap();
        drop(ch);
        peer.join().unwrap();
    }

    /// Ferry does not clear buffers: a recycled buffer holds the bytes its
    /// last user left (here the peer's, written before it passed it back);
    /// a fresh pool's pages are the kernel's zeros.
    #[test]
    fn recycled_buffers_are_not_zero_filled() {
        let a = Domain::new("a");
        let (tx, peer) = echo_peer(&a, 0xEE);
        let mut path = DataPath::new(&a, vec![tx], PathConfig::new(8192, 1, quota(2))).unwrap();
        let mut b = path.alloc().unwrap();
        assert!(b.iter().all(|&x| x == 0), "a fresh pool's pages are zero");
        b.as_mut_slice().unwrap()[100..104].copy_from_slice(b"old!");
        path.channel_mut(0).move_buffer(b, &[]).unwrap();
        let Ok(Event::BufferPassed { buffer, .. }) = path.channel_mut(0).wait(Some(T)) else { panic!() };
        drop(buffer);
        let again = path.alloc().unwrap();
        assert_eq!((again[0], &again[100..104]), (0xEE, &b"old!"[..]), "recycled as it was left");
        assert_eq!(path.pool_ids().len(), 1);
        let fresh = path.alloc().unwrap();
        assert_eq!(path.pool_ids().len(), 2);
        assert!(fresh.iter().all(|&x| x == 0));
        drop((again, fresh));
        drop(path);
        peer.join().unwrap();
    }

    /// A path whose buffers are never given back stops at its quota with a
    /// typed error; another path and a plain allocator of the same domain
    /// go on, and the path itself goes on once a buffer comes back.
    #[test]
    fn quota_is_per_path() {
        let a = Domain::new("a");
        let (tx, peer) = echo_peer(&a, 0);
        let (tx2, peer2) = echo_peer(&a, 0);
        let config = PathConfig::new(4096, 2, PathQuota { max_pools: 8, max_bytes: 3 * 8192 });
        let mut hog = DataPath::new(&a, vec![tx], config).unwrap();
        let mut held: Vec<Buffer> = (0..6).map(|_| hog.alloc().unwrap()).collect();
        let e = hog.alloc().unwrap_err();
        assert_eq!(e, ErrorKind::QuotaExceeded { pools: 3, max_pools: 8, max_bytes: 3 * 8192 });
        assert_eq!(hog.grow().unwrap_err(), e);
        let mut other = DataPath::new(&a, vec![tx2], PathConfig::new(4096, 1, quota(1))).unwrap();
        let o = other.alloc().unwrap();
        assert!(matches!(
            other.alloc().as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::QuotaExceeded { pools: 1, max_pools: 1, .. })
        ));
        let plain = Allocator::new(&a, 1, 4096, PoolConstraints::default()).unwrap();
        assert!(plain.alloc().is_some(), "allocators outside the paths are not limited");
        let id = held[4].id();
        drop(held.remove(4));
        assert_eq!(hog.alloc().unwrap().id(), id);
        assert_eq!(hog.pool_ids().len(), 3);
        drop((held, o, hog, other));
        peer.join().unwrap();
        peer2.join().unwrap();
    }

    #[test]
    fn bad_paths_are_refused() {
        let a = Domain::new("a");
        let cfg = PathConfig::new(4096, 2, quota(1));
        let none: Vec<Channel> = Vec::new();
        assert!(matches!(
            DataPath::new(&a, none, cfg).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::InvalidArgument(_))
        ));
        let (tx, peer) = echo_peer(&Domain::new("elsewhere"), 0);
        let r = DataPath::new(&a, vec![tx], cfg);
        assert!(matches!(r.as_ref().map_err(|e| e.kind()), Err(ErrorKind::InvalidArgument(_))));
        let (tx, peer2) = echo_peer(&a, 0);
        let tiny = PathConfig::new(4096, 4, PathQuota { max_pools: 1, max_bytes: 4096 });
        let mut tx = tx;
        assert!(matches!(
            DataPath::new(&a, vec![&mut tx], tiny).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::InvalidArgument(_))
        ));
        assert!(matches!(
            DataPath::new(&a, vec![&mut tx], PathConfig::new(1000, 1, quota(1))).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::BadBufferSize { .. })
        ));
        drop((r, tx));
        peer.join().unwrap();
        peer2.join().unwrap();
    }

    /// A path that fans out: every pool goes on every first-hop channel
    /// when made; buffers go down either.
    #[test]
    fn fan_out_assigns_every_pool_to_every_channel() {
        let a = Domain::new("a");
        let (t1, p1) = echo_peer(&a, 0);
        let (t2, p2) = echo_peer(&a, 0);
        let mut path = DataPath::new(&a, vec![t1, t2], PathConfig::new(4096, 1, quota(2))).unwrap();
        assert_eq!(path.channel_count(), 2);
        let (x, y) = (path.alloc().unwrap(), path.alloc().unwrap());
        for ch in 0..2 {
            for pool in path.pool_ids() {
                assert!(path.channel_mut(ch).is_assigned(pool), "pool {pool} on channel {ch}");
            }
        }
        for (ch, b) in [(0, x), (1, y)] {
            path.channel_mut(ch).move_buffer(b, &[]).unwrap();
            assert!(matches!(path.channel_mut(ch).wait(Some(T)), Ok(Event::BufferPassed { .. })));
        }
        drop(path);
        p1.join().unwrap();
        p2.join().unwrap();
    }

    /// `forward_pool` for a pool never offered on the inbound channel is
    /// refused, and nothing is assigned downstream.
    #[test]
    fn forwarding_an_unoffered_pool_is_refused() {
        let (a, b) = (Domain::new("a"), Domain::new("b"));
        let ep = Endpoint::local();
        let mut a_tx = Channel::create(&a, &ep, ChannelSetup::default()).unwrap();
        let mut b_rx = Channel::bind(&b, &ep, BindParams::default()).unwrap();
        a_tx.wait_connected(T).unwrap();
        b_rx.wait_connected(T).unwrap();
        let (mut b_tx, peer) = echo_peer(&b, 0);
        let stranger = PoolId::from_u128(42);
        assert_eq!(
            forward_pool(&mut b_rx, stranger, &mut [&mut b_tx], T),
            Err(ErrorKind::NoPendingRequest(stranger).into())
        );
        assert!(!b_tx.is_assigned(stranger));
        drop((a_tx, b_rx, b_tx));
        peer.join().unwrap();
    }

    /// A vetoed pool is not kept: the path reports the veto and has no pool.
    #[test]
    fn a_vetoed_pool_is_dropped() {
        let a = Domain::new("a");
        let ep = Endpoint::local();
        let peer = {
            let ep = ep.clone();
            std::thread::spawn(move || {
                let mut rx = Channel::connect(&Domain::new("veto"), &ep, BindParams::default(), T).unwrap();
                loop {
                    match rx.wait(Some(T)) {
                        Ok(Event::PoolAssignRequest(r)) => rx.respond_pool(r.pool, false).unwrap(),
                        Ok(Event::Closed { .. }) | Err(_) => return,
                        Ok(Event::Error(e)) if e == ErrorKind::PeerGone => return,
                        other => panic!("{other:?}"),
                    }
                }
            })
        };
        let tx = Channel::accept(&a, &ep, ChannelSetup::default(), T).unwrap();
        let mut path = DataPath::new(&a, vec![tx], PathConfig::new(4096, 1, quota(1))).unwrap();
        assert!(matches!(path.alloc().as_ref().map_err(|e| e.kind()), Err(ErrorKind::PoolVetoed(_))));
        assert!(path.pool_ids().is_empty() && a.pools().is_empty());
        drop(path);
        peer.join().unwrap();
    }
}
