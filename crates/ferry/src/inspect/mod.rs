//! What Ferry is doing, seen from inside and from outside the process.
//!
//! Inside: [`Channel::stats`](crate::Channel::stats),
//! [`Domain::stats`](crate::Domain::stats) and
//! [`Pool::stats`](crate::Pool::stats) return the counters of a channel end
//! and what a domain holds of its pools.
//!
//! Outside: every process that has a Ferry channel publishes its domains,
//! channels and pools with their counters in a small file of its own in a
//! per-user directory ([`registry_dir`]), rewritten a few times a second by
//! a thread of the library (started with the first channel) and removed
//! when the process exits. `ferry inspect` reads them ([`read_all`]).
//! `FERRY_INSPECT=0` in the environment turns the registry off (nothing is
//! written); failing to create it never fails the process (the reason is
//! printed once on stderr). docs/INSPECT.md says what each counter means.
//!
//! The counters are plain relaxed atomics that only the channel end's
//! thread writes (a load and a store, no locked instruction), all that a
//! transfer writes on one cache line, so they cost the data path next to
//! nothing; the registry thread only reads them.

// The loom build has no registry (no thread, no file): what only the
// registry uses is unused there.
#![cfg_attr(loom, allow(dead_code))]

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::setup::{ChannelState, Direction, Role};
use crate::TrustLevel;

mod format;
#[cfg(not(loom))]
mod registry;

pub use format::{
    encode, ChannelSnapshot, DomainSnapshot, PoolSnapshot, ProcessSnapshot, ReadError, CHANNEL_FIELDS, HEADER_LEN,
    MAGIC, VERSION,
};
#[cfg(not(loom))]
pub use registry::{publish_now, read_all, read_file, registry_dir, sweep, Listing};

/// Operations of one kind or another, sent or received on a channel end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    /// Buffers moved (ownership to the sink), aggregate members included.
    pub moves: u64,
    /// Buffers passed (ownership back to the source).
    pub passes: u64,
    /// Read-only copies lent, aggregate members included.
    pub copies: u64,
    /// Copies given back.
    pub releases: u64,
    /// Pool assignment requests.
    pub pool_assigns: u64,
    /// Pool removal requests.
    pub pool_removes: u64,
    /// Aggregates (each also counts its members as moves or copies).
    pub aggregates: u64,
}

/// The counters of one channel end ([`Channel::stats`](crate::Channel::stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChannelStats {
    /// Operations this end sent.
    pub sent: OpCounts,
    /// Operations this end received (delivered as events).
    pub received: OpCounts,
    /// Bytes of the buffers moved, passed and copied by this end (the
    /// buffers' sizes: what changed hands, not bytes copied).
    pub bytes_sent: u64,
    /// Bytes of the buffers this end received.
    pub bytes_received: u64,
    /// Messages the outgoing queue holds at most.
    pub queue_capacity: u32,
    /// Messages in the outgoing queue, not yet taken by the peer (over TCP
    /// or a session: not yet written to the connection), when last sampled
    /// (every 64 operations of a kind sent, and whenever the end prepares
    /// to sleep).
    pub queue_depth: u32,
    /// The most messages seen in the outgoing queue (the capacity once a
    /// send found it full).
    pub queue_high_water: u32,
    /// Sends refused because the outgoing queue was full.
    pub queue_full: u64,
    /// The last send was refused for a full queue and none has gone since:
    /// the peer is not taking messages.
    pub blocked: bool,
    /// Times the end armed itself to sleep ([`Channel::arm`](crate::Channel::arm)
    /// returned true, in `wait` or an event loop): each is a wake-up the
    /// peer or a timer had to give.
    pub wakeups: u64,
    /// Error events (a protocol violation, a dead peer, a failed setup).
    pub errors: u64,
}

/// What a domain holds of one pool ([`Pool::stats`](crate::Pool::stats)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Owned here and on the free list.
    pub free: u32,
    /// Owned here and taken: a live [`Buffer`](crate::Buffer) handle, or
    /// one dropped while read-only copies of it are still out.
    pub in_use: u32,
    /// For a pool this domain created: buffers it does not own now (moved
    /// to a peer, in flight in a queue, or held by a third domain). Zero
    /// for pools learned from a peer.
    pub lent: u32,
    /// Read-only copies of the pool's buffers held here, not released.
    pub copies_held: u32,
    /// Read-only copies this domain sent (owned or forwarded buffers) that
    /// have not come back.
    pub copies_out: u32,
}

/// A domain's pools ([`Domain::stats`](crate::Domain::stats)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainStats {
    /// The domain's name.
    pub name: String,
    /// Every pool in its pool list: id, geometry, holdings.
    pub pools: Vec<(crate::PoolId, crate::Geometry, PoolStats)>,
}

/// One counter that only the channel end's thread writes: a plain load and
/// store (no locked instruction); readers see a recent value.
#[inline]
fn add(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// The kinds of [`OpCounts`], as counted in [`ChanCounters`]: the four
/// transfers first.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    Move = 0,
    Pass = 1,
    Copy = 2,
    Release = 3,
    PoolAssign = 4,
    PoolRemove = 5,
    Aggregate = 6,
}

/// The transfer kinds ([`Op::Move`] to [`Op::Release`]).
const TRANSFERS: usize = 4;

/// A channel end's counters, written by the end, read by `stats` and the
/// registry thread. (`--cfg ferry_counters_off` builds Ferry without the
/// counts of transfers, only to measure what they cost:
/// scripts/bench-counters.) On cache lines of their own: the two ends of a local
/// channel run on two cores, and their counters must not share a line.
///
/// Everything a transfer writes (its count, its bytes, the queue's
/// sample) is on the first line, so a round trip touches one line of
/// counters at each end; the rare counts follow.
#[derive(Debug, Default)]
#[repr(C, align(64))]
pub(crate) struct ChanCounters {
    /// Moves, passes, copies and releases through this end, by kind, sent
    /// or received: an end sends two of these kinds and receives the other
    /// two (a source sends moves and copies and receives passes and
    /// releases, a sink the reverse), so one count per kind says both, and
    /// `source` says which way.
    transfers: [AtomicU64; TRANSFERS],
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    queue_capacity: AtomicU32,
    queue_depth: AtomicU32,
    queue_high_water: AtomicU32,
    /// The end is the source (its direction is `Tx`), known at connection.
    source: AtomicBool,
    /// The other kinds ([`Op::PoolAssign`] on), sent.
    other_sent: [AtomicU64; 3],
    /// The other kinds, received.
    other_received: [AtomicU64; 3],
    queue_full: AtomicU64,
    /// Operations sent when a send was last refused for a full queue, plus
    /// one (0: never): still the count, the end is blocked. Kept on the
    /// refusal, so a send pays nothing for it.
    sent_at_full: AtomicU64,
    wakeups: AtomicU64,
    errors: AtomicU64,
}

// What a transfer writes fits the first cache line.
const _: () = assert!(std::mem::offset_of!(ChanCounters, other_sent) <= 64);

/// Whether an end that is the source sends operations of kind `op`
/// (the transfer kinds; the others go both ways).
fn source_sends(op: usize) -> bool {
    op == Op::Move as usize || op == Op::Copy as usize
}

impl ChanCounters {
    /// The end connected, as the source or not, with an outgoing queue of
    /// `capacity` messages.
    pub(crate) fn connected(&self, direction: Direction, capacity: usize) {
        self.source.store(direction == Direction::Tx, Ordering::Relaxed);
        self.sample_queue(0, capacity);
    }

    /// An operation of `bytes` payload went out. Returns whether the queue
    /// depth is due for a sample (every 64 operations of a kind).
    #[inline]
    pub(crate) fn sent(&self, op: Op, bytes: u64) -> bool {
        if cfg!(ferry_counters_off) {
            return false;
        }
        let op = op as usize;
        let c = if op < TRANSFERS { &self.transfers[op] } else { &self.other_sent[op - TRANSFERS] };
        let n = c.load(Ordering::Relaxed).wrapping_add(1);
        c.store(n, Ordering::Relaxed);
        add(&self.bytes_sent, bytes);
        n % 64 == 0
    }

    fn total_sent(&self) -> u64 {
        let source = self.source.load(Ordering::Relaxed);
        let transfers = (0..TRANSFERS).filter(|&op| source_sends(op) == source).map(|op| &self.transfers[op]);
        transfers.chain(&self.other_sent).map(|c| c.load(Ordering::Relaxed)).fold(0, u64::wrapping_add)
    }

    /// An operation of `bytes` payload was delivered.
    #[inline]
    pub(crate) fn received(&self, op: Op, bytes: u64) {
        if cfg!(ferry_counters_off) {
            return;
        }
        let op = op as usize;
        add(if op < TRANSFERS { &self.transfers[op] } else { &self.other_received[op - TRANSFERS] }, 1);
        add(&self.bytes_received, bytes);
    }

    /// A send was refused for a full queue.
    pub(crate) fn queue_full(&self) {
        add(&self.queue_full, 1);
        self.sent_at_full.store(self.total_sent().wrapping_add(1), Ordering::Relaxed);
        let cap = self.queue_capacity.load(Ordering::Relaxed);
        self.queue_depth.store(cap, Ordering::Relaxed);
        self.queue_high_water.store(cap, Ordering::Relaxed);
    }

    /// The outgoing queue holds `depth` of `capacity` messages.
    pub(crate) fn sample_queue(&self, depth: usize, capacity: usize) {
        let cap = u32::try_from(capacity).unwrap_or(u32::MAX);
        let depth = u32::try_from(depth).unwrap_or(u32::MAX).min(cap);
        self.queue_capacity.store(cap, Ordering::Relaxed);
        self.queue_depth.store(depth, Ordering::Relaxed);
        if depth > self.queue_high_water.load(Ordering::Relaxed) {
            self.queue_high_water.store(depth, Ordering::Relaxed);
        }
    }

    /// The end armed itself to sleep.
    pub(crate) fn wakeup(&self) {
        add(&self.wakeups, 1);
    }

    /// An error event.
    pub(crate) fn error(&self) {
        add(&self.errors, 1);
    }

    pub(crate) fn snapshot(&self) -> ChannelStats {
        let source = self.source.load(Ordering::Relaxed);
        // The counts of one way: the transfer kinds that go that way, and
        // `others`.
        let ops = |sending: bool, others: &[AtomicU64; 3]| {
            let v = |op: Op| {
                let op = op as usize;
                match op.checked_sub(TRANSFERS) {
                    None if source_sends(op) == (source == sending) => self.transfers[op].load(Ordering::Relaxed),
                    None => 0,
                    Some(i) => others[i].load(Ordering::Relaxed),
                }
            };
            OpCounts {
                moves: v(Op::Move),
                passes: v(Op::Pass),
                copies: v(Op::Copy),
                releases: v(Op::Release),
                pool_assigns: v(Op::PoolAssign),
                pool_removes: v(Op::PoolRemove),
                aggregates: v(Op::Aggregate),
            }
        };
        ChannelStats {
            sent: ops(true, &self.other_sent),
            received: ops(false, &self.other_received),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            queue_capacity: self.queue_capacity.load(Ordering::Relaxed),
            queue_depth: self.queue_depth.load(Ordering::Relaxed),
            queue_high_water: self.queue_high_water.load(Ordering::Relaxed),
            queue_full: self.queue_full.load(Ordering::Relaxed),
            blocked: self.sent_at_full.load(Ordering::Relaxed) == self.total_sent().wrapping_add(1),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

/// What the registry says of a channel end besides its counters; changes
/// only at setup, connection and close.
#[derive(Debug, Clone)]
pub(crate) struct ChanInfo {
    pub(crate) backend: &'static str,
    pub(crate) endpoint: String,
    pub(crate) peer: String,
    pub(crate) role: Role,
    pub(crate) direction: Direction,
    pub(crate) trust: TrustLevel,
    pub(crate) state: ChannelState,
}

/// A channel end as the registry sees it: shared by the channel (which
/// writes) and the registry thread (which holds it weakly and reads).
#[derive(Debug)]
pub(crate) struct ChanEntry {
    pub(crate) domain: u64,
    pub(crate) key: u64,
    pub(crate) counters: ChanCounters,
    info: Mutex<ChanInfo>,
}

impl ChanEntry {
    pub(crate) fn new(domain: u64, key: u64, backend: &'static str, endpoint: String, state: ChannelState) -> Self {
        let info = ChanInfo {
            backend,
            endpoint,
            peer: String::new(),
            role: Role::Generic,
            direction: Direction::Tx,
            trust: TrustLevel::Uninitialized,
            state,
        };
        ChanEntry { domain, key, counters: ChanCounters::default(), info: Mutex::new(info) }
    }

    /// Change what is known of the end (rare: setup and close).
    pub(crate) fn update(&self, f: impl FnOnce(&mut ChanInfo)) {
        f(&mut self.info.lock().unwrap_or_else(|p| p.into_inner()));
    }

    pub(crate) fn info(&self) -> ChanInfo {
        self.info.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Add a new domain to the registry (no-op when it is off); published
/// once the process has a channel.
pub(crate) fn register_domain(domain: &std::sync::Arc<crate::domain::DomainShared>) {
    #[cfg(not(loom))]
    registry::register_domain(domain);
    #[cfg(loom)]
    let _ = domain;
}

/// Add a new channel end to the registry, starting the registry's file
/// and thread at the first (no-op when it is off).
pub(crate) fn register_channel(entry: &std::sync::Arc<ChanEntry>) {
    #[cfg(not(loom))]
    registry::register_channel(entry);
    #[cfg(loom)]
    let _ = entry;
}
