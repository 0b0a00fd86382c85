//! Setting up channels for the demo and the benchmarks: connect two ends,
//! assign a pool, with every step checked.

use std::time::Duration;

use ferry::{BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, Pool, WaitError};

use crate::CliError;

const STEP: Duration = Duration::from_secs(10);

fn unexpected(what: &str, ev: Result<Event, WaitError>) -> CliError {
    CliError::Failed(format!("while waiting for {what} the channel gave {}; run the command again", describe_wait(&ev)))
}

/// What an event is, in words (for messages: never Rust's debug form).
pub fn describe_event(ev: &Event) -> String {
    match ev {
        Event::BindRequest { .. } => "a bind request".into(),
        Event::Bound => "the reply to our bind".into(),
        Event::PoolAssignRequest(req) => format!("a request to assign pool {}", req.pool),
        Event::PoolAssigned(id) => format!("the assignment of pool {id}"),
        Event::PoolVetoed(id) => format!("a refusal of pool {id}"),
        Event::PoolRemoved(id) => format!("the removal of pool {id}"),
        Event::PoolRemoveRefused(id) => format!("a refusal to remove pool {id}"),
        Event::MoveReceived { buffer, .. } => format!("buffer {} moved to us", buffer.id().index),
        Event::BufferPassed { buffer, .. } => format!("buffer {} passed back", buffer.id().index),
        Event::CopyReceived { copy, .. } => format!("a read-only copy of buffer {}", copy.id().index),
        Event::CopyReleased { buffer, .. } => format!("the release of a copy of buffer {}", buffer.index),
        Event::Closed { by_peer: true } => "the close of the channel by the peer".into(),
        Event::Closed { by_peer: false } => "the close of the channel".into(),
        Event::Error(e) => format!("an error ({e})"),
        Event::PoolOfferRefused { pool, reason } => format!("a pool offer (pool {pool}) refused here ({reason})"),
        Event::Aggregate { agg, .. } => format!("an aggregate of {} bytes", agg.len()),
    }
}

/// What a poll (or [`next_event`]) returned, in words: an event, or nothing.
pub fn describe(ev: &Option<Event>) -> String {
    match ev {
        Some(ev) => describe_event(ev),
        None => "nothing (the peer may be stuck or gone)".into(),
    }
}

/// What a wait returned, in words: an event, nothing in time, or the end.
pub fn describe_wait(ev: &Result<Event, WaitError>) -> String {
    match ev {
        Ok(ev) => describe_event(ev),
        Err(WaitError::TimedOut) => "nothing in time (the peer may be stuck or gone)".into(),
        Err(WaitError::Closed) => "nothing more (the channel is closed)".into(),
    }
}

/// Create a channel in `creator` and bind `binder` to it, both in this
/// process; returns (creator end, binder end), both connected.
pub fn connect_local(
    creator: &Domain,
    binder: &Domain,
    setup: ChannelSetup,
    params: BindParams,
) -> Result<(Channel, Channel), CliError> {
    let ep = Endpoint::local();
    let mut c = Channel::create(creator, &ep, setup)?;
    let mut b = Channel::bind(binder, &ep, params)?;
    match c.wait(Some(STEP)) {
        Ok(Event::BindRequest { .. }) => {}
        ev => return Err(unexpected("the bind request", ev)),
    }
    match b.wait(Some(STEP)) {
        Ok(Event::Bound) => {}
        ev => return Err(unexpected("the bind reply", ev)),
    }
    Ok((c, b))
}

/// Assign `pool` from `assigner` to the channel; `peer` (the other end, in
/// this thread) accepts.
pub fn assign(assigner: &mut Channel, peer: &mut Channel, pool: &Pool) -> Result<(), CliError> {
    assigner.assign_pool(pool)?;
    match peer.wait(Some(STEP)) {
        Ok(Event::PoolAssignRequest(req)) => peer.respond_pool(req.pool, true)?,
        ev => return Err(unexpected("the pool-assignment request", ev)),
    }
    match assigner.wait(Some(STEP)) {
        Ok(Event::PoolAssigned(_)) => Ok(()),
        ev => Err(unexpected("the pool-assignment reply", ev)),
    }
}

/// Wait for the next event, busy-polling or blocking; `None` once the
/// channel is closed and its last event was delivered.
pub fn next_event(ch: &mut Channel, busy: bool) -> Option<Event> {
    if busy {
        loop {
            if let Some(ev) = ch.poll() {
                return Some(ev);
            }
            if ch.state() == ferry::ChannelState::Closed {
                return None;
            }
            std::hint::spin_loop();
        }
    }
    ch.wait(None).ok()
}

/// Run a send (`move_buffer`, `pass`) until the queue has room: on
/// `QueueFull` take the buffer back and try again, spinning when `busy`,
/// yielding the core otherwise (the peer may need it to make room).
pub fn send_when_room<T>(
    mut buf: T,
    busy: bool,
    mut send: impl FnMut(T) -> Result<(), ferry::Refused<T>>,
) -> Result<(), CliError> {
    loop {
        match send(buf) {
            Ok(()) => return Ok(()),
            Err(r) if r.error == ferry::ErrorKind::QueueFull => {
                buf = r.into_inner();
                if busy {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            Err(r) => return Err(r.into()),
        }
    }
}
