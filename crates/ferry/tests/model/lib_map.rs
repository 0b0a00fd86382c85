//! What the harnesses that hold the library to the model share: the
//! library's names for the model's values (trust levels, errors, states),
//! the meta-data pattern, the number of random sequences, and the counters
//! that show a suite did not pass vacuously. Unlike `reference.rs`, this
//! file uses the `ferry` crate.

use ferry::{Aggregate, BufferState, ChannelState, Error, ErrorKind, Member, TrustLevel};

use super::reference::{BufferState as MState, ChannelState as MChan, Reject, Trust};

/// The library's trust level for the model's.
pub fn trust_level(t: Trust) -> TrustLevel {
    match t {
        Trust::Uninitialized => TrustLevel::Uninitialized,
        Trust::None => TrustLevel::None,
        Trust::Half => TrustLevel::Half,
        Trust::Full => TrustLevel::Full,
    }
}

/// The model's name for a library error (None: an error the model has no
/// counterpart for, which is always a failure).
pub fn reject_of(e: &Error) -> Option<Reject> {
    Some(match e.kind() {
        ErrorKind::NotConnected(_) => Reject::NotConnected,
        ErrorKind::TearingDown => Reject::TearingDown,
        ErrorKind::WrongDirection => Reject::WrongDirection,
        ErrorKind::ForeignBuffer => Reject::ForeignBuffer,
        ErrorKind::PoolNotAssigned(_) => Reject::PoolNotAssigned,
        ErrorKind::PoolRemovalPending(_) => Reject::PoolRemovalPending,
        ErrorKind::CopiesOutstanding => Reject::CopiesOutstanding,
        ErrorKind::NotCopyHolder => Reject::NotCopyHolder,
        ErrorKind::CopiesForwarded => Reject::CopiesForwarded,
        ErrorKind::SameBuffer => Reject::SameBuffer,
        ErrorKind::MetaTooLarge { .. } => Reject::MetaTooLarge,
        ErrorKind::UnknownPool(_) => Reject::UnknownPool,
        ErrorKind::PoolAlreadyAssigned(_) => Reject::PoolAlreadyAssigned,
        ErrorKind::TrustMismatch { .. } => Reject::TrustMismatch,
        ErrorKind::PoolInUse(_) => Reject::PoolInUse,
        ErrorKind::NoPendingRequest(_) => Reject::NoPendingRequest,
        _ => return None,
    })
}

/// The library's buffer state for the model's.
pub fn buffer_state(s: MState) -> BufferState {
    match s {
        MState::Invalid => BufferState::Invalid,
        MState::ReadOnly => BufferState::ReadOnly,
        MState::ReadOnlyOwned => BufferState::ReadOnlyOwned,
        MState::ReadWrite => BufferState::ReadWrite,
    }
}

/// The library's channel state for the model's.
pub fn channel_state(s: MChan) -> ChannelState {
    match s {
        MChan::Connected => ChannelState::Connected,
        MChan::Teardown => ChannelState::Teardown,
        MChan::Closed => ChannelState::Closed,
    }
}

/// The meta data of a generated operation with `len` bytes.
pub fn meta_bytes(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8) ^ 0x5a).collect()
}

/// Random sequences per suite: `FERRY_MODEL_CASES`, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("FERRY_MODEL_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// What a suite compared: enough of each kind shows it did not pass
/// vacuously.
#[derive(Default, Debug)]
pub struct Stats {
    /// Operations run on both model and library and compared.
    pub compared: usize,
    /// Operations both accepted.
    pub accepted: usize,
    /// Operations both refused with the same error.
    pub refused: usize,
    /// Messages delivered with the same event.
    pub delivered: usize,
    /// Operations the harness could not express with the library's handles.
    pub inexpressible: usize,
    /// Buffer writes both accepted.
    pub writes: usize,
    /// Steps after which some buffer's page protection was checked.
    pub protection_checks: usize,
    /// Forbidden writes tried in a forked child (each must fault).
    pub fault_probes: usize,
    /// Aggregates both sent.
    pub aggregates_sent: usize,
    /// Aggregates delivered with the same members.
    pub aggregates_delivered: usize,
    /// Received aggregates dropped whole (copies released, moved buffers freed).
    pub held_dropped: usize,
    /// Received aggregates forwarded (whole or edited) and accepted.
    pub held_forwarded: usize,
    /// Forwards of received aggregates both refused with the same error.
    pub held_forward_refused: usize,
    /// Received aggregates split into two held ones.
    pub held_split: usize,
    /// Received aggregates taken apart into handles.
    pub held_taken_apart: usize,
}

/// The aggregate a harness sends for single-buffer `pieces`: two fragments
/// of each buffer (bytes 0..100, then 200..300), interleaved, so members
/// appear in the order of `pieces` and each buffer twice. Beside it, a
/// clone of each piece whose sender keeps a reference (`kept`): the
/// aggregate is then not the buffer's only reference, so it goes as a copy,
/// and the clone gives the handle back after the send.
pub fn harness_aggregate(pieces: Vec<Aggregate>, kept: &[bool]) -> (Aggregate, Vec<Option<Aggregate>>) {
    let keep = pieces.iter().zip(kept).map(|(p, &k)| k.then(|| p.clone())).collect();
    let mut msg = Aggregate::new();
    for range in [0..100, 200..300] {
        for p in &pieces {
            msg.append(p.slice(range.clone()).expect("inside a buffer"));
        }
    }
    (msg, keep)
}

/// The pieces of a refused aggregate (which comes back whole): one
/// single-buffer aggregate per member, in the order of the members.
pub fn pieces_of_refused(agg: Aggregate) -> Vec<Aggregate> {
    agg.into_members()
        .expect("a refused aggregate comes back whole")
        .into_iter()
        .map(|m| match m {
            Member::Buffer(b) => Aggregate::from(b),
            Member::Copy(c) => Aggregate::from(c),
        })
        .collect()
}
