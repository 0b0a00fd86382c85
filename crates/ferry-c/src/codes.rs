//! The numbers of the C interface: error codes (with their sentences),
//! enum values, and the conversions between them and Ferry's types.

use std::ffi::CStr;

use ferry::{BufferState, ChannelState, Direction, Error, ErrorKind, Role, TrustLevel};

use crate::ffi::Errval;

/// `BULK_OK`.
pub const OK: Errval = 0;

/// Declares the error codes, in order from 1, with their sentences.
macro_rules! error_codes {
    ($($name:ident = $value:literal : $text:literal,)*) => {
        $(
            #[doc = $text]
            pub const $name: Errval = $value;
        )*
        /// One past the largest code (`BULK_ERR_COUNT`).
        pub const ERR_COUNT: Errval = [$($value),*].len() + 1;
        /// `(name, value)` of every code, for the layout test.
        #[cfg(test)]
        pub const ALL: &[(&str, Errval)] = &[$((stringify!($name), $value)),*];
        /// The sentence of `err`.
        fn sentence(err: Errval) -> &'static CStr {
            match err {
                0 => c"success",
                $($value => text(concat!($text, "\0")),)*
                _ => c"unknown error code (not one of Ferry's BULK_ERR_* codes)",
            }
        }
    };
}

error_codes! {
    ERR_INTERNAL = 1: "internal error in the Ferry library; nothing was changed",
    ERR_NULL_ARGUMENT = 2: "a required pointer argument is NULL",
    ERR_INVALID_ARGUMENT = 3: "an argument has a value the call does not accept",
    ERR_TIMEOUT = 4: "nothing happened within the timeout",
    ERR_INVALID_ENDPOINT = 5: "the endpoint descriptor was not made by an endpoint function for this use, or was destroyed",
    ERR_ENDPOINT_IN_USE = 6: "the endpoint already has a channel or a binder",
    ERR_ENDPOINT_NOT_LISTENING = 7: "no channel is listening on the endpoint named for binding",
    ERR_CHANNEL_IN_USE = 8: "the channel struct is in use already; destroy it first",
    ERR_INVALID_CHANNEL = 9: "the channel struct was never created or bound, or was destroyed",
    ERR_CHANNEL_STATE = 10: "the channel is not connected yet",
    ERR_CHANNEL_CLOSED = 11: "the channel is torn down or closed",
    ERR_WRONG_DIRECTION = 12: "the call needs the other direction: move and copy from the source, pass and release from the sink",
    ERR_INVALID_BUFFER = 13: "the pointer is not a buffer of a pool this process knows",
    ERR_BUFFER_NOT_OWNED = 14: "the program does not own the buffer (it was moved, passed or returned, or never held)",
    ERR_FOREIGN_POOL = 15: "the buffer belongs to another pool than the allocator's",
    ERR_POOL_NOT_ASSIGNED = 16: "the buffer's pool is not assigned to the channel",
    ERR_POOL_ALREADY_ASSIGNED = 17: "the pool is assigned to the channel already, or its assignment is pending",
    ERR_POOL_VETOED = 18: "the peer vetoed the pool",
    ERR_POOL_IN_USE = 19: "the pool is in use: copies of its buffers are out",
    ERR_POOL_REMOVAL_PENDING = 20: "a removal of the buffer's pool from the channel is pending",
    ERR_INVALID_POOL = 21: "the pointer is not a pool this process knows",
    ERR_NOT_A_COPY = 22: "the buffer is no copy received over this channel",
    ERR_COPIES_OUTSTANDING = 23: "copies of the buffer are out: it is read-only until they are released",
    ERR_COPIES_FORWARDED = 24: "copies of the buffer that this process forwarded must be released first",
    ERR_QUEUE_FULL = 25: "the channel's queue is full; dispatch events and try again",
    ERR_TRUST_MISMATCH = 26: "the pool's trust level differs from the channel's",
    ERR_TRUST_NOT_SUPPORTED = 27: "the endpoint's backend cannot give this trust level (local channels: FULL or HALF)",
    ERR_BIND_REFUSED = 28: "the channel's creator refused the bind (trust level or meta size)",
    ERR_PEER_GONE = 29: "the peer is gone: its process exited or the connection broke",
    ERR_BAD_BUFFER_SIZE = 30: "buffer size or count not accepted: the size must be a power of two of at least a page, the count at least one",
    ERR_NO_RESOURCES = 31: "the system refused memory or a file descriptor",
    ERR_INVALID_ALLOCATOR = 32: "the allocator struct was never initialized, or was freed",
    ERR_WAITSET_BUSY = 33: "the waitset still has channels or continuations to run",
    ERR_WAITSET_EMPTY = 34: "waiting forever on a waitset on which nothing can happen",
    ERR_INVALID_WAITSET = 35: "the pointer is not a live waitset",
    ERR_CHANNEL_DESTROYED = 36: "the channel was destroyed before the call completed",
    ERR_IO = 37: "a system call failed",
    ERR_BUFFER_STATE = 38: "buffer states change only through move, pass, copy and release",
    ERR_PROTOCOL = 39: "the peer broke the protocol; the channel is closed",
    ERR_ALLOCATOR_IN_USE = 40: "the allocator struct is initialized already; free it first",
    ERR_UNKNOWN_POOL = 41: "the pool is not in this process's pool list",
}

/// A NUL-terminated sentence as a C string.
fn text(s: &'static str) -> &'static CStr {
    CStr::from_bytes_with_nul(s.as_bytes()).unwrap_or(c"(no text)")
}

/// `bulk_strerror`.
pub fn strerror(err: Errval) -> &'static CStr {
    sentence(err)
}

/// The code of a library error.
pub fn of_error(e: &Error) -> Errval {
    of_kind(e.kind())
}

/// The code of a kind of library error.
pub fn of_kind(e: &ErrorKind) -> Errval {
    match e {
        ErrorKind::BadBufferSize { .. } | ErrorKind::BadBufferCount { .. } => ERR_BAD_BUFFER_SIZE,
        ErrorKind::BadAlignment(_)
        | ErrorKind::InvalidArgument(_)
        | ErrorKind::SameBuffer
        | ErrorKind::MetaTooLarge { .. } => ERR_INVALID_ARGUMENT,
        ErrorKind::TrustNotSupported { .. } => ERR_TRUST_NOT_SUPPORTED,
        ErrorKind::Os(_) => ERR_IO,
        ErrorKind::EndpointInUse => ERR_ENDPOINT_IN_USE,
        ErrorKind::EndpointNotListening => ERR_ENDPOINT_NOT_LISTENING,
        ErrorKind::BindRefused(_) => ERR_BIND_REFUSED,
        ErrorKind::NotConnected(ChannelState::Teardown | ChannelState::Closed) | ErrorKind::TearingDown => {
            ERR_CHANNEL_CLOSED
        }
        ErrorKind::NotConnected(_) => ERR_CHANNEL_STATE,
        ErrorKind::WrongDirection => ERR_WRONG_DIRECTION,
        ErrorKind::ForeignBuffer => ERR_BUFFER_NOT_OWNED,
        ErrorKind::PoolNotAssigned(_) => ERR_POOL_NOT_ASSIGNED,
        ErrorKind::PoolRemovalPending(_) => ERR_POOL_REMOVAL_PENDING,
        ErrorKind::CopiesOutstanding => ERR_COPIES_OUTSTANDING,
        ErrorKind::NotCopyHolder => ERR_NOT_A_COPY,
        ErrorKind::CopiesForwarded => ERR_COPIES_FORWARDED,
        ErrorKind::UnknownPool(_) => ERR_UNKNOWN_POOL,
        ErrorKind::PoolAlreadyAssigned(_) => ERR_POOL_ALREADY_ASSIGNED,
        ErrorKind::TrustMismatch { .. } => ERR_TRUST_MISMATCH,
        ErrorKind::PoolInUse(_) => ERR_POOL_IN_USE,
        ErrorKind::QueueFull => ERR_QUEUE_FULL,
        ErrorKind::PeerGone | ErrorKind::PeerUnresponsive(_) => ERR_PEER_GONE,
        ErrorKind::Protocol(_) => ERR_PROTOCOL,
        ErrorKind::TimedOut => ERR_TIMEOUT,
        ErrorKind::PoolVetoed(_) => ERR_POOL_VETOED,
        ErrorKind::LimitExceeded { .. } | ErrorKind::QuotaExceeded { .. } => ERR_NO_RESOURCES,
        _ => ERR_INVALID_ARGUMENT,
    }
}

/// `BULK_DIRECTION_*`.
pub fn direction_from(v: u32) -> Option<Direction> {
    match v {
        0 => Some(Direction::Tx),
        1 => Some(Direction::Rx),
        _ => None,
    }
}

/// The C value of a direction.
pub fn direction_to(d: Direction) -> u32 {
    match d {
        Direction::Tx => 0,
        Direction::Rx => 1,
    }
}

/// `BULK_ROLE_*`.
pub fn role_from(v: u32) -> Option<Role> {
    match v {
        0 => Some(Role::Generic),
        1 => Some(Role::Master),
        2 => Some(Role::Slave),
        _ => None,
    }
}

/// The C value of a role.
pub fn role_to(r: Role) -> u32 {
    match r {
        Role::Generic => 0,
        Role::Master => 1,
        Role::Slave => 2,
    }
}

/// `BULK_TRUST_*`.
pub fn trust_from(v: u32) -> Option<TrustLevel> {
    match v {
        0 => Some(TrustLevel::Uninitialized),
        1 => Some(TrustLevel::None),
        2 => Some(TrustLevel::Half),
        3 => Some(TrustLevel::Full),
        _ => None,
    }
}

/// The C value of a trust level.
pub fn trust_to(t: TrustLevel) -> u32 {
    match t {
        TrustLevel::Uninitialized => 0,
        TrustLevel::None => 1,
        TrustLevel::Half => 2,
        TrustLevel::Full => 3,
    }
}

/// `BULK_STATE_CLOSED`.
pub const STATE_CLOSED: u32 = 6;

/// The C value of a channel state.
pub fn state_to(s: ChannelState) -> u32 {
    match s {
        ChannelState::Uninitialized => 0,
        ChannelState::Initialized => 1,
        ChannelState::Binding => 2,
        ChannelState::BindNegotiate => 3,
        ChannelState::Connected => 4,
        ChannelState::Teardown => 5,
        ChannelState::Closed => STATE_CLOSED,
    }
}

/// The C value of a buffer state.
pub fn buffer_state_to(s: BufferState) -> u32 {
    match s {
        BufferState::Invalid => 0,
        BufferState::ReadOnly => 1,
        BufferState::ReadOnlyOwned => 2,
        BufferState::ReadWrite => 3,
    }
}

/// `BULK_BACKEND_LOCAL`.
pub const BACKEND_LOCAL: u32 = 1;
/// `BULK_BACKEND_SM`.
pub const BACKEND_SM: u32 = 2;
/// `BULK_BACKEND_NET`.
pub const BACKEND_NET: u32 = 3;

/// Marks an endpoint descriptor made by the library ("FERY").
pub const EP_MAGIC: u32 = 0x4645_5259;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_own_nonempty_sentence() {
        let mut seen = std::collections::HashSet::new();
        for err in 0..ERR_COUNT {
            let s = strerror(err).to_str().unwrap();
            assert!(!s.is_empty() && !s.starts_with("unknown"), "code {err}");
            assert!(seen.insert(s), "code {err} shares its sentence");
        }
        assert!(strerror(ERR_COUNT).to_str().unwrap().starts_with("unknown"));
        assert!(strerror(usize::MAX).to_str().unwrap().starts_with("unknown"));
    }
}
