//! Errors. Every operation checks its preconditions before it changes
//! anything; a failed check is one of these variants, and operations that
//! consume a buffer hand it back inside [`Refused`] so nothing is lost.

use crate::channel::ChannelState;
use crate::pool::{PoolId, TrustLevel};

/// Why an operation was refused or a channel failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // --- pool geometry and setup -------------------------------------------------
    /// Buffer size must be a power of two and a multiple of the page size.
    #[error("buffer size {size} is not a power of two multiple of the page size ({page})")]
    BadBufferSize {
        /// The size asked for.
        size: usize,
        /// The page size.
        page: usize,
    },
    /// A pool needs at least one buffer, and must fit in the address space.
    #[error("buffer count {count} is out of range (1..={max})")]
    BadBufferCount {
        /// The count asked for.
        count: u64,
        /// The largest count allowed for this buffer size.
        max: u64,
    },
    /// An alignment that is not a power of two, or larger than the buffer size.
    #[error("alignment {0} must be a power of two no larger than the buffer size")]
    BadAlignment(usize),
    /// A setup parameter is invalid (the message says which).
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The trust level is not supported by this backend.
    #[error("trust level {trust:?} is not supported by the {backend} backend")]
    TrustNotSupported {
        /// The level asked for.
        trust: TrustLevel,
        /// The backend.
        backend: &'static str,
    },
    /// A system call failed.
    #[error("system call failed: {0}")]
    Os(String),

    // --- endpoints and binding ---------------------------------------------------
    /// The endpoint already has a channel created on it.
    #[error("endpoint already in use")]
    EndpointInUse,
    /// Bind to an endpoint that nobody created a channel on.
    #[error("no channel is listening on that endpoint")]
    EndpointNotListening,
    /// The creator refused the bind (the message says why).
    #[error("bind refused: {0}")]
    BindRefused(&'static str),

    // --- channel-level preconditions (checked first) -------------------------------
    /// The channel is not connected (still binding, or closed).
    #[error("channel is not connected (state {0:?})")]
    NotConnected(ChannelState),
    /// The channel is tearing down: no new messages may be sent.
    #[error("channel is tearing down")]
    TearingDown,
    /// Move/copy need the local side to be the source (TX); pass/release the sink (RX).
    #[error("operation not allowed in this channel direction")]
    WrongDirection,

    // --- buffer preconditions -----------------------------------------------------
    /// The buffer (or pool) handle belongs to another domain.
    #[error("buffer belongs to another domain")]
    ForeignBuffer,
    /// The buffer's pool is not assigned to this channel.
    #[error("pool {0} is not assigned to this channel")]
    PoolNotAssigned(PoolId),
    /// A removal of the pool from this channel is pending.
    #[error("pool {0} is being removed from this channel")]
    PoolRemovalPending(PoolId),
    /// Move and pass need read-write ownership; read-only copies are still out.
    #[error("read-only copies of the buffer are still out")]
    CopiesOutstanding,
    /// Release of a copy that was not received over this channel.
    #[error("this copy was not received over this channel")]
    NotCopyHolder,
    /// Releasing this copy would strand a copy forwarded from it.
    #[error("a copy forwarded from this one is still out; it must come back first")]
    CopiesForwarded,
    /// Full copy into its own source.
    #[error("full copy source and destination are the same buffer")]
    SameBuffer,
    /// Meta data longer than the channel's meta size.
    #[error("meta data of {len} bytes exceeds the channel's meta size {max}")]
    MetaTooLarge {
        /// Length given.
        len: usize,
        /// The channel's meta size.
        max: usize,
    },

    // --- pool assignment -----------------------------------------------------------
    /// The pool handle does not belong to this domain's pool list.
    #[error("pool {0} is not known to this domain")]
    UnknownPool(PoolId),
    /// The pool is already assigned to (or pending on) this channel.
    #[error("pool {0} is already assigned to this channel")]
    PoolAlreadyAssigned(PoolId),
    /// The pool's trust level differs from the channel's.
    #[error("pool trust {pool:?} does not match channel trust {channel:?}")]
    TrustMismatch {
        /// The pool's trust.
        pool: TrustLevel,
        /// The channel's trust.
        channel: TrustLevel,
    },
    /// The pool still has copies out over this channel.
    #[error("pool {0} still has copies out over this channel")]
    PoolInUse(PoolId),
    /// No pool-assignment request for that pool is waiting for an answer.
    #[error("no assignment request for pool {0} is pending")]
    NoPendingRequest(PoolId),

    // --- backend ---------------------------------------------------------------------
    /// The backend's queue is full; try again after polling the channel.
    #[error("queue full")]
    QueueFull,
    /// The peer went away (closed, crashed or unreachable).
    #[error("peer is gone")]
    PeerGone,
    /// The peer sent nothing (not even a keep-alive) or took none of our
    /// data for this long: it is treated as dead.
    #[error("peer unresponsive for {0:?}")]
    PeerUnresponsive(std::time::Duration),
    /// The peer sent something malformed or impossible; the channel is closed.
    #[error("protocol violation by peer: {0}")]
    Protocol(String),
    /// Waiting timed out.
    #[error("timed out")]
    TimedOut,
    /// The peer asked for more than one of this end's limits allows (see
    /// [`crate::ChannelLimits`]); nothing of the request was taken on.
    #[error("limit exceeded: at most {limit} {what}")]
    LimitExceeded {
        /// Which limit.
        what: &'static str,
        /// Its value.
        limit: u64,
    },
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Os(e.to_string())
    }
}

impl From<rustix::io::Errno> for Error {
    fn from(e: rustix::io::Errno) -> Self {
        Error::Os(std::io::Error::from(e).to_string())
    }
}

/// An operation that consumed a value (a buffer) was refused: the value
/// comes back unchanged with the reason.
#[derive(Debug)]
pub struct Refused<T> {
    /// Why it was refused.
    pub error: Error,
    /// The value given to the operation, unchanged.
    pub value: T,
}

impl<T> Refused<T> {
    pub(crate) fn new(error: Error, value: T) -> Self {
        Refused { error, value }
    }

    /// The value back.
    pub fn into_inner(self) -> T {
        self.value
    }
}

impl<T> std::fmt::Display for Refused<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<T: std::fmt::Debug> std::error::Error for Refused<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T> From<Refused<T>> for Error {
    fn from(r: Refused<T>) -> Self {
        r.error
    }
}

/// Result alias for the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;
