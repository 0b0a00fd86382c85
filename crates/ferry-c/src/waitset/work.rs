//! What a dispatch runs: continuations, the program's callbacks, and the
//! next step a waitset hands its dispatch.

use ferry::PoolId;

use super::meta::MetaBuf;
use crate::boundary::call;
use crate::codes::*;
use crate::ffi::*;
use crate::state;

/// A continuation the program gave with a call that was accepted.
#[derive(Clone, Copy)]
pub struct Cont {
    handler: ContHandler,
    arg: usize,
}

impl Cont {
    /// The same handler with `arg` if it was given none (NULL).
    pub(super) fn or_arg(self, arg: usize) -> Cont {
        Cont { arg: if self.arg == 0 { arg } else { self.arg }, ..self }
    }

    /// `None` for a continuation without handler (nothing to run).
    pub fn of(c: BulkContinuation) -> Option<Cont> {
        c.handler.map(|handler| Cont { handler, arg: c.arg as usize })
    }
}

/// One thing for dispatch to run, outside every lock.
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
        pool: PoolId,
    },
    /// `move_received`, `buffer_received`, `copy_received` (run straight
    /// from the poll that found the event: never queued).
    Buffer { f: BufferCallback, ch: usize, token: usize, buffer: usize, meta: MetaBuf },
    /// `copy_released`.
    Released { f: unsafe extern "C" fn(*mut BulkChannel, *mut BulkBuffer), ch: usize, token: usize, buffer: usize },
}

impl Work {
    /// The channel a callback is for (`None` for continuations, which run
    /// even after their channel is destroyed).
    pub(super) fn callback_token(&self) -> Option<usize> {
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

    /// A pool the work hands to the program.
    pub fn pool(&self) -> Option<PoolId> {
        match self {
            Work::PoolAssigned { pool, .. } | Work::PoolRemoved { pool, .. } => Some(*pool),
            _ => None,
        }
    }

    /// Runs it. Called without any lock held.
    pub fn run(self) {
        match self {
            Work::Cont { cont, err, ch } => call::cont(cont.handler, cont.arg, err, ch),
            Work::Bind { f, ch, .. } => call::channel_only_errval(f, ch),
            Work::Teardown { f, ch, .. } => call::channel_only(f, ch),
            Work::PoolAssigned { f, ch, token, pool_ptr, pool } => {
                let answer = call::pool(f, ch, pool_ptr);
                state::answer_pool(token, pool, answer == OK);
            }
            Work::PoolRemoved { f, ch, pool_ptr, .. } => {
                call::pool(f, ch, pool_ptr);
            }
            Work::Buffer { f, ch, buffer, mut meta, .. } => call::buffer_meta(f, ch, buffer, meta.bytes_mut()),
            Work::Released { f, ch, buffer, .. } => call::buffer(f, ch, buffer),
        }
    }
}

/// How a send goes out: its continuation, and whether a callback of the
/// channel's waitset made it (see [`Waitset::sent`](super::Waitset::sent)).
#[derive(Clone, Copy)]
pub struct Sending {
    /// The call's continuation.
    pub cont: Option<Cont>,
    /// Made by a callback of the channel's own waitset: published in a batch.
    pub batched: bool,
}

/// A `move_received` or `buffer_received` callback ready to run: the
/// usual event, handed to dispatch without a [`Work`] (its meta data is
/// written straight into the dispatch's own [`MetaBuf`]).
pub struct BufferCall {
    pub(super) f: BufferCallback,
    pub(super) ch: usize,
    pub(super) buffer: usize,
}

impl BufferCall {
    /// Runs it with the meta data `next_step` wrote. Called without any
    /// lock held.
    pub fn run(self, meta: &mut MetaBuf) {
        call::buffer_meta(self.f, self.ch, self.buffer, meta.bytes_mut());
    }
}

/// What dispatch does next.
pub enum Step {
    /// Run this, then return.
    Run(Work),
    /// Run this buffer callback with the meta data written to the
    /// dispatch's [`MetaBuf`], then return.
    Buffer(BufferCall),
    /// Nothing now, and the waitset is still spinning: look again.
    Spin,
    /// Nothing is due and the channels (destroyed ends that wait for their
    /// peers too) are armed: wait for `fd`. `live`: something can still
    /// happen.
    Idle { fd: i32, live: bool },
    /// Nothing is due, and the channels were not armed: the dispatch does
    /// not sleep and nobody else can wait on the waitset's fd.
    Nothing,
}
