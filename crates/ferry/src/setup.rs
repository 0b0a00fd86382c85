//! What a channel is set up with, and the bind negotiation ([ETH-BT]
//! §4.2.4, §5.2.2, Listing 6.1): directions, roles, states, constraints,
//! the creator's [`ChannelSetup`], the binder's [`BindParams`] and what
//! negotiation settles. Below both the channels and the backends: each
//! backend negotiates at bind time, the channel uses the result.

use crate::ErrorKind;
use std::time::Duration;

use crate::error::Result;
use crate::pool::{Geometry, TrustLevel};
use crate::proto::MAX_META_SIZE;

/// Direction of data flow, seen from the local end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The local end is the source: it moves and copies buffers.
    Tx,
    /// The local end is the sink: it receives, passes back and releases.
    Rx,
}

impl Direction {
    /// The other direction.
    pub fn opposite(self) -> Direction {
        match self {
            Direction::Tx => Direction::Rx,
            Direction::Rx => Direction::Tx,
        }
    }
}

/// Role of an end ([ETH-BT] §4.2.4): the master provides the buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Let the binder decide (only at create/bind time).
    Generic,
    /// Provides pools.
    Master,
    /// Uses the master's pools.
    Slave,
}

/// Channel states ([ETH-BT] Listing 6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChannelState {
    /// Nothing set up.
    Uninitialized,
    /// Created, waiting for a binder (creator side).
    Initialized,
    /// Bind sent, waiting for the reply (binder side).
    Binding,
    /// Properties being negotiated.
    BindNegotiate,
    /// Fully operable.
    Connected,
    /// Teardown marker sent; in-transit messages still arrive.
    Teardown,
    /// Closed; resources freed.
    Closed,
}

/// Constraints on the pools a channel accepts ([ETH-BT] §6.2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChannelConstraints {
    /// Required alignment of buffer addresses (0: page alignment).
    pub alignment: usize,
    /// Smallest buffer size accepted (0: any).
    pub min_buffer_size: usize,
    /// Largest buffer size accepted (0: any).
    pub max_buffer_size: usize,
}

impl ChannelConstraints {
    pub(crate) fn merge(self, other: ChannelConstraints) -> ChannelConstraints {
        let max_nonzero = |a: usize, b: usize| match (a, b) {
            (0, x) | (x, 0) => x,
            (a, b) => a.min(b),
        };
        ChannelConstraints {
            alignment: self.alignment.max(other.alignment),
            min_buffer_size: self.min_buffer_size.max(other.min_buffer_size),
            max_buffer_size: max_nonzero(self.max_buffer_size, other.max_buffer_size),
        }
    }

    pub(crate) fn admits(&self, g: Geometry) -> bool {
        let size = g.buffer_size();
        size >= self.min_buffer_size
            && (self.max_buffer_size == 0 || size <= self.max_buffer_size)
            && (self.alignment == 0 || self.alignment <= size)
    }
}

/// Parameters of [`Channel::create`](crate::Channel::create); the default
/// is a TX end, trust FULL, 16 bytes of meta data, a queue of 1024 messages
/// each way.
///
/// ```
/// use ferry::{ChannelSetup, Direction, Role, TrustLevel};
/// // The creator receives, the binder will provide the pools.
/// let setup = ChannelSetup {
///     direction: Direction::Rx,
///     role: Role::Slave,
///     trust: TrustLevel::Half,
///     meta_size: 32,
///     ..ChannelSetup::default()
/// };
/// # let _ = setup;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelSetup {
    /// The creator's direction.
    pub direction: Direction,
    /// The creator's role; `Generic` lets the binder choose.
    pub role: Role,
    /// Trust level of the channel (never `Uninitialized`).
    pub trust: TrustLevel,
    /// Bytes of meta data each message may carry (≤ [`MAX_META_SIZE`]).
    pub meta_size: usize,
    /// Constraints on assigned pools.
    pub constraints: ChannelConstraints,
    /// Messages that fit in each direction's queue (power of two, 2..=65536).
    pub queue_depth: u32,
    /// What the binder may make this end take on (see [`ChannelLimits`]).
    pub limits: ChannelLimits,
}

impl Default for ChannelSetup {
    fn default() -> Self {
        ChannelSetup {
            direction: Direction::Tx,
            role: Role::Generic,
            trust: TrustLevel::Full,
            meta_size: 16,
            constraints: ChannelConstraints::default(),
            queue_depth: 1024,
            limits: ChannelLimits::default(),
        }
    }
}

/// Parameters of [`Channel::bind`](crate::Channel::bind); the default takes
/// what the creator offers. A binder that cannot live with the creator's
/// setup says so here, and the bind is refused
/// ([`ErrorKind::BindRefused`](crate::ErrorKind::BindRefused)).
///
/// ```
/// use std::time::Duration;
/// use ferry::{BindParams, Channel, ChannelSetup, Domain, Endpoint, Error, ErrorKind, TrustLevel};
///
/// let ep = Endpoint::local();
/// let mut creator = Channel::create(&Domain::new("a"), &ep, ChannelSetup::default())?; // trust FULL
/// let params = BindParams { trust: Some(TrustLevel::Half), ..BindParams::default() };
/// let mut binder = Channel::bind(&Domain::new("b"), &ep, params)?;
/// let _ = creator.wait_connected(Duration::from_secs(1));
/// assert!(matches!(binder.wait_connected(Duration::from_secs(10)).map_err(ferry::Error::into_kind), Err(ErrorKind::BindRefused(_))));
/// # Ok::<(), ferry::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindParams {
    /// Role the binder wants (`Generic`: whatever the creator leaves).
    pub role: Role,
    /// Trust level the binder requires, if any.
    pub trust: Option<TrustLevel>,
    /// Largest meta size the binder can take.
    pub max_meta_size: usize,
    /// The binder's own constraints on pools (merged with the creator's).
    pub constraints: ChannelConstraints,
    /// What the creator may make this end take on (see [`ChannelLimits`]).
    /// Local: not sent to the creator.
    pub limits: ChannelLimits,
    /// How long the bind may take until the creator has answered: past it
    /// the channel fails with [`ErrorKind::TimedOut`] (an
    /// [`Event::Error`](crate::Event::Error); or
    /// [`Channel::bind`](crate::Channel::bind) itself returns it, when not
    /// even the connection could be made in time). Default
    /// [`DEFAULT_BIND_TIMEOUT`]. Local: not sent to the creator.
    pub timeout: Duration,
}

/// How long a bind waits for the creator's answer unless
/// [`BindParams::timeout`] says otherwise: long enough for a creator that
/// is busy serving other binders, short enough that a silent one is noticed.
pub const DEFAULT_BIND_TIMEOUT: Duration = Duration::from_secs(10);

/// Limits on what the peer of a channel may make this end take on: pools
/// it assigns (each one an fd and a mapping here) and their size. Checked
/// when the peer's assignment request arrives, before anything of the pool
/// is mapped; an offer over a limit is vetoed by the library and reported
/// as [`Event::PoolOfferRefused`](crate::Event::PoolOfferRefused) with
/// [`ErrorKind::LimitExceeded`], and the channel goes on. Local to each end:
/// never sent to the peer.
///
/// The meta size the peer may impose is bounded by
/// [`BindParams::max_meta_size`] (binder) and [`MAX_META_SIZE`] (both).
///
/// ```
/// use ferry::{ChannelLimits, ChannelSetup};
/// let setup = ChannelSetup {
///     limits: ChannelLimits { max_peer_pools: 8, ..ChannelLimits::default() },
///     ..ChannelSetup::default()
/// };
/// assert_eq!(setup.limits.max_peer_bytes, 16 << 30);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelLimits {
    /// Most pools assigned by the peer at once (accepted or waiting for an
    /// answer). Default 256: each pool costs an fd (shared memory) or a
    /// memory file (network), and a process has 1024 fds by default.
    pub max_peer_pools: usize,
    /// Most bytes of pool memory assigned by the peer at once, all its
    /// pools together (a single larger pool is refused too). Default
    /// 16 GiB: room for many large pools on a 64-bit host, yet far from
    /// what a hostile peer could otherwise ask us to map (terabytes).
    pub max_peer_bytes: usize,
}

impl Default for ChannelLimits {
    fn default() -> Self {
        ChannelLimits { max_peer_pools: 256, max_peer_bytes: 16 << 30 }
    }
}

impl ChannelLimits {
    /// Whether one more pool of `geometry` fits beside `pools` pools of
    /// `bytes` bytes: the limit it would pass otherwise.
    pub(crate) fn admit(&self, pools: usize, bytes: usize, geometry: Geometry) -> Result<()> {
        if pools >= self.max_peer_pools {
            return Err(ErrorKind::LimitExceeded {
                what: "pools assigned by the peer",
                limit: self.max_peer_pools as u64,
            }
            .into());
        }
        if bytes.saturating_add(geometry.len()) > self.max_peer_bytes {
            return Err(ErrorKind::LimitExceeded {
                what: "bytes of pools assigned by the peer",
                limit: self.max_peer_bytes as u64,
            }
            .into());
        }
        Ok(())
    }
}

impl Default for BindParams {
    fn default() -> Self {
        BindParams {
            role: Role::Generic,
            trust: None,
            max_meta_size: MAX_META_SIZE,
            constraints: ChannelConstraints::default(),
            limits: ChannelLimits::default(),
            timeout: DEFAULT_BIND_TIMEOUT,
        }
    }
}

/// What negotiation settled, from the binder's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Negotiated {
    pub(crate) binder_direction: Direction,
    pub(crate) binder_role: Role,
    pub(crate) creator_role: Role,
    pub(crate) trust: TrustLevel,
    pub(crate) meta_size: usize,
    pub(crate) constraints: ChannelConstraints,
}

/// The creator's side of the bind negotiation ([ETH-BT] §5.2.2).
pub(crate) fn negotiate(setup: &ChannelSetup, params: &BindParams) -> Result<Negotiated, &'static str> {
    if let Some(t) = params.trust {
        if t != setup.trust {
            return Err("the binder requires another trust level");
        }
    }
    if setup.meta_size > params.max_meta_size {
        return Err("the binder cannot take the channel's meta size");
    }
    let (creator_role, binder_role) = match (setup.role, params.role) {
        (Role::Generic, Role::Generic) | (Role::Generic, Role::Slave) => (Role::Master, Role::Slave),
        (Role::Generic, Role::Master) => (Role::Slave, Role::Master),
        (Role::Master, Role::Slave | Role::Generic) => (Role::Master, Role::Slave),
        (Role::Slave, Role::Master | Role::Generic) => (Role::Slave, Role::Master),
        (Role::Master, Role::Master) | (Role::Slave, Role::Slave) => return Err("both ends want the same role"),
    };
    Ok(Negotiated {
        binder_direction: setup.direction.opposite(),
        binder_role,
        creator_role,
        trust: setup.trust,
        meta_size: setup.meta_size,
        constraints: setup.constraints.merge(params.constraints),
    })
}

/// The binder's check of the creator's answer: what it settled must be
/// what the binder asked for (a creator could answer anything).
pub(crate) fn check_reply(params: &BindParams, neg: &Negotiated) -> Result<()> {
    let bad = |what: &str| Err(ErrorKind::Protocol(format!("bind reply: {what}")).into());
    if params.trust.is_some_and(|t| t != neg.trust) {
        return bad("a trust level the binder did not ask for");
    }
    if neg.meta_size > params.max_meta_size {
        return bad("a meta size larger than the binder can take");
    }
    if params.role != Role::Generic && params.role != neg.binder_role {
        return bad("a role the binder did not ask for");
    }
    if neg.binder_role == neg.creator_role || neg.binder_role == Role::Generic || neg.creator_role == Role::Generic {
        return bad("roles that do not pair");
    }
    if neg.constraints.merge(params.constraints) != neg.constraints {
        return bad("pool constraints looser than the binder's");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(dir: Direction, role: Role) -> ChannelSetup {
        ChannelSetup { direction: dir, role, ..ChannelSetup::default() }
    }

    #[test]
    fn role_negotiation() {
        let p = |role| BindParams { role, ..BindParams::default() };
        let n = negotiate(&setup(Direction::Tx, Role::Generic), &p(Role::Generic)).unwrap();
        assert_eq!((n.creator_role, n.binder_role, n.binder_direction), (Role::Master, Role::Slave, Direction::Rx));
        let n = negotiate(&setup(Direction::Rx, Role::Generic), &p(Role::Master)).unwrap();
        assert_eq!((n.creator_role, n.binder_role, n.binder_direction), (Role::Slave, Role::Master, Direction::Tx));
        assert!(negotiate(&setup(Direction::Tx, Role::Master), &p(Role::Master)).is_err());
        assert!(negotiate(&setup(Direction::Tx, Role::Slave), &p(Role::Slave)).is_err());
        let n = negotiate(&setup(Direction::Tx, Role::Slave), &p(Role::Generic)).unwrap();
        assert_eq!(n.binder_role, Role::Master);
    }

    #[test]
    fn trust_and_meta_negotiation() {
        let s = ChannelSetup { trust: TrustLevel::Half, meta_size: 64, ..ChannelSetup::default() };
        let strict = BindParams { trust: Some(TrustLevel::Full), ..BindParams::default() };
        assert!(negotiate(&s, &strict).is_err());
        let small = BindParams { max_meta_size: 32, ..BindParams::default() };
        assert!(negotiate(&s, &small).is_err());
        let ok = negotiate(&s, &BindParams::default()).unwrap();
        assert_eq!((ok.trust, ok.meta_size), (TrustLevel::Half, 64));
    }

    #[test]
    fn constraints_merge() {
        let a = ChannelConstraints { alignment: 4096, min_buffer_size: 0, max_buffer_size: 1 << 20 };
        let b = ChannelConstraints { alignment: 8192, min_buffer_size: 8192, max_buffer_size: 0 };
        let m = a.merge(b);
        assert_eq!(m, ChannelConstraints { alignment: 8192, min_buffer_size: 8192, max_buffer_size: 1 << 20 });
        assert!(m.admits(Geometry::new(8192, 1).unwrap()));
        assert!(!m.admits(Geometry::new(4096, 1).unwrap()));
        assert!(!m.admits(Geometry::new(1 << 21, 1).unwrap()));
    }
}
