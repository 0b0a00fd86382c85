//! `ferry.Channel`: one end of a channel, its operations and its events.
//!
//! Every wait releases the GIL (other Python threads run meanwhile) and
//! wakes at least every [`SLICE`] to let Python handle signals (Ctrl-C).

use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use ferry::{
    BindParams, Channel, ChannelConstraints, ChannelSetup, ChannelState, Direction, Error, ErrorKind, PoolPolicy,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::buffer::{Held, PyBuf};
use crate::errors::{invalid, raise, to_py};
use crate::events::{role_name, to_py_event, trust_name};
use crate::{duration, parse_role, parse_trust, pool_id_of, pool_of, PyDomain, PyEndpoint};

/// The longest a wait runs without the GIL before it lets Python check for
/// signals.
const SLICE: Duration = Duration::from_millis(100);

/// One end of a channel.
///
/// One end creates the channel on an endpoint (`Channel.create`, or
/// `Channel.accept`, which also waits for the peer), the other binds to it
/// (`Channel.bind`, or `Channel.connect`, which retries until the channel
/// exists and waits until it is connected). Once connected, a pool is
/// assigned (`assign_pool_and_wait`), then the source ("tx" end) moves or
/// copies buffers and the sink ("rx" end) passes them back or releases the
/// copies.
///
/// Events come from `poll()` (never waits), `wait(timeout)`, iteration
/// (`for event in channel`, until the channel closes), and asyncio
/// (`await channel.next_event()`, `async for event in channel`). A channel
/// that fails (its peer died, went silent or broke the protocol) raises the
/// failure from these once (`ferry.PeerGone`, `ferry.ProtocolError`, …);
/// it is closed then, and buffers it had lent come back to their
/// allocator.
///
/// A channel is a context manager: `with` closes it. One thread uses a
/// channel at a time; another thread that calls it meanwhile waits
/// (without the GIL) until the first is done.
#[pyclass(module = "ferry", name = "Channel", frozen)]
pub struct PyChannel {
    inner: Mutex<Option<Channel>>,
    /// Which channel this is, for messages: its domain and endpoint.
    label: String,
}

/// The operations that give a buffer handle away.
#[derive(Clone, Copy)]
enum Give {
    Move,
    Pass,
    PassUnfilled,
}

impl Give {
    fn name(self) -> &'static str {
        match self {
            Give::Move => "move",
            Give::Pass => "pass",
            Give::PassUnfilled => "pass_unfilled",
        }
    }

    fn gone(self) -> &'static str {
        match self {
            Give::Move => "moved over a channel (its receiver owns it now)",
            Give::Pass | Give::PassUnfilled => "passed back over a channel (its source owns it now)",
        }
    }
}

fn state_name(state: ChannelState) -> &'static str {
    match state {
        ChannelState::Uninitialized => "uninitialized",
        ChannelState::Initialized => "initialized",
        ChannelState::Binding => "binding",
        ChannelState::BindNegotiate => "bind_negotiate",
        ChannelState::Connected => "connected",
        ChannelState::Teardown => "teardown",
        ChannelState::Closed => "closed",
    }
}

fn direction_of(py: Python<'_>, s: &str) -> PyResult<Direction> {
    match s {
        "tx" => Ok(Direction::Tx),
        "rx" => Ok(Direction::Rx),
        other => Err(invalid(py, format!("direction {other:?} is not one of \"tx\" (source) and \"rx\" (sink)"))),
    }
}

fn constraints(alignment: usize, min_buffer_size: usize, max_buffer_size: usize) -> ChannelConstraints {
    ChannelConstraints { alignment, min_buffer_size, max_buffer_size }
}

impl PyChannel {
    fn new(channel: Channel, endpoint: &PyEndpoint) -> PyChannel {
        // A TCP creator of port 0 is named by the port the kernel chose.
        let place = channel.listen_addr().map_or_else(|| endpoint.label.clone(), |addr| format!("tcp:{addr}"));
        let label = format!("channel of domain {:?} on {place}", channel.domain().name());
        PyChannel { inner: Mutex::new(Some(channel)), label }
    }

    /// The channel, after any other thread using it is done (waiting for
    /// that without the GIL).
    pub(crate) fn lock(&self, py: Python<'_>) -> MutexGuard<'_, Option<Channel>> {
        loop {
            match self.inner.try_lock() {
                Ok(guard) => return guard,
                Err(TryLockError::Poisoned(poisoned)) => return poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => py.detach(|| drop(self.inner.lock())),
            }
        }
    }

    /// What failed where, at the start of an exception's message.
    fn context(&self, op: &str) -> String {
        format!("{op} ({})", self.label)
    }

    fn err(&self, py: Python<'_>, e: &Error, op: &str) -> PyErr {
        to_py(py, e, &self.context(op))
    }

    fn closed_error(&self, py: Python<'_>, op: &str) -> PyErr {
        self.err(py, &ErrorKind::NotConnected(ChannelState::Closed).into(), op)
    }

    /// Run `f` on the open channel.
    fn with<T>(&self, py: Python<'_>, op: &str, f: impl FnOnce(&mut Channel) -> Result<T, Error>) -> PyResult<T> {
        let mut guard = self.lock(py);
        let ch = guard.as_mut().ok_or_else(|| self.closed_error(py, op))?;
        f(ch).map_err(|e| self.err(py, &e, op))
    }

    /// Wait in slices without the GIL until `step` returns `Some`, the
    /// deadline passes (`None`), or Python has a signal to raise. The
    /// channel is locked only while a slice runs, not while Python runs
    /// signal handlers (which may use or close the channel): a channel
    /// closed meanwhile ends the wait with `closed`.
    fn wait_sliced<T>(
        &self,
        py: Python<'_>,
        deadline: Option<Instant>,
        closed: impl Fn() -> PyResult<Option<T>>,
        mut step: impl FnMut(&mut Channel, Duration) -> Option<T> + Send,
    ) -> PyResult<Option<T>>
    where
        T: Send,
    {
        loop {
            let slice = match deadline {
                None => SLICE,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left.min(SLICE),
                    _ => return Ok(None),
                },
            };
            {
                let mut guard = self.lock(py);
                let Some(ch) = guard.as_mut() else { return closed() };
                if let Some(done) = py.detach(|| step(ch, slice)) {
                    return Ok(Some(done));
                }
            }
            py.check_signals()?;
        }
    }

    fn give(&self, py: Python<'_>, buffer: &Bound<'_, PyBuf>, meta: &[u8], op: Give) -> PyResult<()> {
        let mut guard = self.lock(py);
        let ch = guard.as_mut().ok_or_else(|| self.closed_error(py, op.name()))?;
        let mut state = buffer.get().lock();
        state.check_unexported(py, op.name())?;
        let handle = match std::mem::replace(&mut state.held, Held::Gone(op.gone())) {
            Held::Owned(b) => b,
            other => {
                state.held = other;
                return Err(raise(
                    py,
                    "CopyError",
                    "NotOwned",
                    format!(
                        "{}: this is a read-only copy received over a channel: only a buffer this domain owns can be moved or passed; release the copy instead",
                        self.context(op.name())
                    ),
                ));
            }
        };
        let result = match op {
            Give::Move => ch.move_buffer(handle, meta),
            Give::Pass => ch.pass(handle, meta),
            Give::PassUnfilled => ch.pass_unfilled(handle, meta),
        };
        match result {
            Ok(()) => Ok(()),
            Err(refused) => {
                let (error, value) = refused.into_parts();
                state.held = Held::Owned(value);
                drop(state);
                let err = self.err(py, &error, op.name());
                let _ = err.value(py).setattr("buffer", buffer);
                Err(err)
            }
        }
    }

    fn event(&self, py: Python<'_>, ev: ferry::Event, op: &str) -> PyResult<Py<PyAny>> {
        to_py_event(py, ev, &self.context(op))
    }
}

#[allow(clippy::too_many_arguments)]
#[pymethods]
impl PyChannel {
    /// Create a channel on `endpoint` for a peer to bind to, and return at
    /// once (state "initialized"): the binder's request arrives as a
    /// `BindRequest` event (or use `wait_connected`). The creator decides
    /// the channel's properties: its own `direction` ("tx": it sends,
    /// "rx": it receives), `role` ("generic", "master": it provides the
    /// pools, "slave"), `trust` ("full", "half", "none"), the meta data
    /// size (bytes, at most `ferry.MAX_META_SIZE`), the queue depth and
    /// constraints on pools.
    #[staticmethod]
    #[pyo3(signature = (domain, endpoint, *, direction="tx", role="generic", trust="full", meta_size=16, queue_depth=1024, alignment=0, min_buffer_size=0, max_buffer_size=0))]
    fn create(
        py: Python<'_>,
        domain: &PyDomain,
        endpoint: &PyEndpoint,
        direction: &str,
        role: &str,
        trust: &str,
        meta_size: usize,
        queue_depth: u32,
        alignment: usize,
        min_buffer_size: usize,
        max_buffer_size: usize,
    ) -> PyResult<PyChannel> {
        let setup = ChannelSetup {
            direction: direction_of(py, direction)?,
            role: parse_role(py, role)?,
            trust: parse_trust(py, trust)?,
            meta_size,
            constraints: constraints(alignment, min_buffer_size, max_buffer_size),
            queue_depth,
            ..ChannelSetup::default()
        };
        let (d, ep) = (&domain.inner, &endpoint.inner);
        match py.detach(|| Channel::create(d, ep, setup)) {
            Ok(ch) => Ok(PyChannel::new(ch, endpoint)),
            Err(e) => Err(to_py(py, &e, &format!("Channel.create on {}", endpoint.label))),
        }
    }

    /// Bind to a channel created on `endpoint`, and return at once (state
    /// "binding"): the creator's answer arrives as a `Bound` event (or use
    /// `wait_connected`). `ferry.EndpointNotListening` at once if nobody
    /// created a channel there (`Channel.connect` retries). The binder may
    /// ask for a role, require a trust level, bound the meta size it takes,
    /// add constraints on pools, and give the time the bind may take.
    #[staticmethod]
    #[pyo3(signature = (domain, endpoint, *, role="generic", trust=None, max_meta_size=ferry::MAX_META_SIZE, alignment=0, min_buffer_size=0, max_buffer_size=0, timeout=10.0))]
    fn bind(
        py: Python<'_>,
        domain: &PyDomain,
        endpoint: &PyEndpoint,
        role: &str,
        trust: Option<&str>,
        max_meta_size: usize,
        alignment: usize,
        min_buffer_size: usize,
        max_buffer_size: usize,
        timeout: f64,
    ) -> PyResult<PyChannel> {
        let params = bind_params(py, role, trust, max_meta_size, alignment, min_buffer_size, max_buffer_size, timeout)?;
        let (d, ep) = (&domain.inner, &endpoint.inner);
        match py.detach(|| Channel::bind(d, ep, params)) {
            Ok(ch) => Ok(PyChannel::new(ch, endpoint)),
            Err(e) => Err(to_py(py, &e, &format!("Channel.bind to {}", endpoint.label))),
        }
    }

    /// `Channel.create`, then wait up to `timeout` seconds until a peer is
    /// connected (`ferry.TimedOut` otherwise). Takes the keyword arguments
    /// of `create`.
    #[staticmethod]
    #[pyo3(signature = (domain, endpoint, timeout=10.0, *, direction="tx", role="generic", trust="full", meta_size=16, queue_depth=1024, alignment=0, min_buffer_size=0, max_buffer_size=0))]
    fn accept(
        py: Python<'_>,
        domain: &PyDomain,
        endpoint: &PyEndpoint,
        timeout: f64,
        direction: &str,
        role: &str,
        trust: &str,
        meta_size: usize,
        queue_depth: u32,
        alignment: usize,
        min_buffer_size: usize,
        max_buffer_size: usize,
    ) -> PyResult<PyChannel> {
        let timeout = duration(py, Some(timeout), "timeout")?;
        let ch = PyChannel::create(
            py,
            domain,
            endpoint,
            direction,
            role,
            trust,
            meta_size,
            queue_depth,
            alignment,
            min_buffer_size,
            max_buffer_size,
        )?;
        ch.connected(py, timeout, "Channel.accept")?;
        Ok(ch)
    }

    /// Bind to the channel on `endpoint`, retrying while nobody created it
    /// yet, and wait until connected, all within `timeout` seconds
    /// (`ferry.TimedOut` otherwise). Takes the keyword arguments of `bind`.
    #[staticmethod]
    #[pyo3(signature = (domain, endpoint, timeout=10.0, *, role="generic", trust=None, max_meta_size=ferry::MAX_META_SIZE, alignment=0, min_buffer_size=0, max_buffer_size=0))]
    fn connect(
        py: Python<'_>,
        domain: &PyDomain,
        endpoint: &PyEndpoint,
        timeout: f64,
        role: &str,
        trust: Option<&str>,
        max_meta_size: usize,
        alignment: usize,
        min_buffer_size: usize,
        max_buffer_size: usize,
    ) -> PyResult<PyChannel> {
        let t = duration(py, Some(timeout), "timeout")?.unwrap_or(crate::FOREVER);
        let params = bind_params(py, role, trust, max_meta_size, alignment, min_buffer_size, max_buffer_size, timeout)?;
        let (d, ep) = (&domain.inner, &endpoint.inner);
        match py.detach(|| Channel::connect(d, ep, params, t)) {
            Ok(ch) => Ok(PyChannel::new(ch, endpoint)),
            Err(e) => Err(to_py(py, &e, &format!("Channel.connect to {}", endpoint.label))),
        }
    }

    /// Wait up to `timeout` seconds (None: no limit) until the channel is
    /// connected; the setup events it takes (`BindRequest`, `Bound`) are
    /// consumed. `ferry.TimedOut`, or the reason the bind failed.
    #[pyo3(signature = (timeout=10.0))]
    fn wait_connected(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = duration(py, timeout, "timeout")?;
        self.connected(py, timeout, "Channel.wait_connected")
    }

    /// The channel's state: "initialized", "binding", "bind_negotiate",
    /// "connected", "teardown" or "closed".
    #[getter]
    fn state(&self, py: Python<'_>) -> &'static str {
        self.lock(py).as_ref().map_or("closed", |ch| state_name(ch.state()))
    }

    /// Whether this end was closed (`close()`, or the end of a `with`).
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        self.lock(py).is_none()
    }

    /// This end's direction once connected: "tx" (source) or "rx" (sink).
    #[getter]
    fn direction(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, "Channel.direction", |ch| {
            Ok(match ch.direction() {
                Direction::Tx => "tx",
                Direction::Rx => "rx",
            })
        })
    }

    /// This end's role once connected: "master", "slave" or "generic".
    #[getter]
    fn role(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, "Channel.role", |ch| Ok(role_name(ch.role())))
    }

    /// The channel's trust level: "full", "half" or "none".
    #[getter]
    fn trust(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, "Channel.trust", |ch| Ok(trust_name(ch.trust())))
    }

    /// Bytes of meta data each message may carry.
    #[getter]
    fn meta_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, "Channel.meta_size", |ch| Ok(ch.meta_size()))
    }

    /// The domain this end belongs to.
    #[getter]
    fn domain(&self, py: Python<'_>) -> PyResult<PyDomain> {
        self.with(py, "Channel.domain", |ch| Ok(PyDomain { inner: ch.domain().clone() }))
    }

    /// `(host, port)` a channel being created on a TCP endpoint listens on
    /// (the port the kernel chose for port 0); None otherwise and once a
    /// binder is connected.
    #[getter]
    fn listen_addr(&self, py: Python<'_>) -> PyResult<Option<(String, u16)>> {
        self.with(py, "Channel.listen_addr", |ch| Ok(ch.listen_addr().map(|a| (a.ip().to_string(), a.port()))))
    }

    /// The TCP backend's counters as a dict (frames_sent, frames_received,
    /// payload_sent, payload_received: payload bytes straight from and into
    /// buffer memory; payload_staged: bytes that went through other memory,
    /// 0 in every ordinary flow; send_calls, recv_calls), None for other
    /// backends.
    #[getter]
    fn link_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(s) = self.with(py, "Channel.link_stats", |ch| Ok(ch.link_stats()))? else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("frames_sent", s.frames_sent)?;
        d.set_item("frames_received", s.frames_received)?;
        d.set_item("payload_sent", s.payload_sent)?;
        d.set_item("payload_received", s.payload_received)?;
        d.set_item("payload_staged", s.payload_staged)?;
        d.set_item("send_calls", s.send_calls)?;
        d.set_item("recv_calls", s.recv_calls)?;
        Ok(Some(d))
    }

    /// How this end answers the peer's pool offers: "ask" (the default:
    /// answer each `PoolAssignRequest` with `respond_pool`) or
    /// "accept_all" (the library accepts every pool the channel's
    /// constraints admit; the event is still reported, for information).
    fn set_pool_policy(&self, py: Python<'_>, policy: &str) -> PyResult<()> {
        let policy = match policy {
            "ask" => PoolPolicy::Ask,
            // The Python API reports the accepted offers, as it always has.
            "accept_all" => PoolPolicy::AcceptAndReport,
            other => {
                return Err(invalid(py, format!("pool policy {other:?} is not one of \"ask\" and \"accept_all\"")))
            }
        };
        self.with(py, "Channel.set_pool_policy", |ch| {
            ch.set_pool_policy(policy);
            Ok(())
        })
    }

    /// The pool policy: "ask" or "accept_all".
    #[getter]
    fn pool_policy(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, "Channel.pool_policy", |ch| {
            Ok(match ch.pool_policy() {
                PoolPolicy::AcceptAll | PoolPolicy::AcceptAndReport => "accept_all",
                PoolPolicy::Ask => "ask",
            })
        })
    }

    /// Offer a pool (a `ferry.Pool` or a `ferry.Allocator`'s) to the peer;
    /// the answer arrives as `PoolAssigned` or `PoolVetoed`.
    fn assign_pool(&self, py: Python<'_>, pool: &Bound<'_, PyAny>) -> PyResult<()> {
        let pool = pool_of(py, pool)?;
        self.with(py, "Channel.assign_pool", |ch| ch.assign_pool(&pool))
    }

    /// Offer a pool and wait up to `timeout` seconds for the answer:
    /// returns when it is assigned; `ferry.PoolVetoed`, `ferry.TimedOut`.
    /// Events that arrive meanwhile stay queued for `poll`/`wait`.
    #[pyo3(signature = (pool, timeout=10.0))]
    fn assign_pool_and_wait(&self, py: Python<'_>, pool: &Bound<'_, PyAny>, timeout: f64) -> PyResult<()> {
        let pool = pool_of(py, pool)?;
        let t = duration(py, Some(timeout), "timeout")?.unwrap_or(crate::FOREVER);
        let mut guard = self.lock(py);
        let op = "Channel.assign_pool_and_wait";
        let ch = guard.as_mut().ok_or_else(|| self.closed_error(py, op))?;
        let pool = &pool;
        py.detach(|| ch.assign_pool_and_wait(pool, t)).map_err(|e| self.err(py, &e, op))
    }

    /// Answer the peer's offer of `pool` (its id, from the
    /// `PoolAssignRequest` event): accept or veto.
    fn respond_pool(&self, py: Python<'_>, pool: &Bound<'_, PyAny>, accept: bool) -> PyResult<()> {
        let id = pool_id_of(py, pool)?;
        self.with(py, "Channel.respond_pool", |ch| ch.respond_pool(id, accept))
    }

    /// Ask to remove a pool from the channel; the answer arrives as
    /// `PoolRemoved` or `PoolRemoveRefused`.
    fn remove_pool(&self, py: Python<'_>, pool: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = pool_id_of(py, pool)?;
        self.with(py, "Channel.remove_pool", |ch| ch.remove_pool(id))
    }

    /// Whether `pool` (a Pool, an Allocator or a pool id) is assigned to
    /// the channel on this end's side.
    fn is_assigned(&self, py: Python<'_>, pool: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = pool_id_of(py, pool)?;
        self.with(py, "Channel.is_assigned", |ch| Ok(ch.is_assigned(id)))
    }

    /// Move `buffer` to the peer (source end), with `meta` (bytes, at most
    /// the channel's meta size): the peer owns it now, and this `Buffer`
    /// object gives no access any more. Refused (nothing changes, the
    /// exception's `buffer` attribute is the buffer): `ferry.BufferError`
    /// while a view of it is exported, `ferry.QueueFull`, and the other
    /// errors of the library.
    #[pyo3(name = "move", signature = (buffer, meta=b"" as &[u8]))]
    fn move_(&self, py: Python<'_>, buffer: &Bound<'_, PyBuf>, meta: &[u8]) -> PyResult<()> {
        self.give(py, buffer, meta, Give::Move)
    }

    /// Pass a received `buffer` back to the source (sink end), with
    /// `meta`: refused as `move` is.
    #[pyo3(name = "pass_", signature = (buffer, meta=b"" as &[u8]))]
    fn pass_(&self, py: Python<'_>, buffer: &Bound<'_, PyBuf>, meta: &[u8]) -> PyResult<()> {
        self.give(py, buffer, meta, Give::Pass)
    }

    /// `pass_` without the payload: the source's buffer keeps the bytes
    /// its memory last had (over TCP nothing travels back but the id).
    #[pyo3(signature = (buffer, meta=b"" as &[u8]))]
    fn pass_unfilled(&self, py: Python<'_>, buffer: &Bound<'_, PyBuf>, meta: &[u8]) -> PyResult<()> {
        self.give(py, buffer, meta, Give::PassUnfilled)
    }

    /// Send a read-only copy of `buffer` (one this domain owns, or a copy
    /// it holds) to the peer (source end): the buffer stays ours,
    /// read-only until every copy is released (`CopyReleased`). Refused
    /// (`ferry.BufferError`) while a view of it is exported.
    #[pyo3(signature = (buffer, meta=b"" as &[u8]))]
    fn copy(&self, py: Python<'_>, buffer: &Bound<'_, PyBuf>, meta: &[u8]) -> PyResult<()> {
        let op = "copy";
        let mut guard = self.lock(py);
        let ch = guard.as_mut().ok_or_else(|| self.closed_error(py, op))?;
        let state = buffer.get().lock();
        state.check_unexported(py, op)?;
        let result = match &state.held {
            Held::Owned(b) => ch.copy(b, meta),
            Held::Copy(c) => ch.copy(c, meta),
            Held::Gone(_) => unreachable!("checked by check_unexported"),
        };
        result.map_err(|e| self.err(py, &e, op))
    }

    /// Release a read-only copy received over this channel (sink end): it
    /// goes back to its owner, and this object gives no access any more.
    /// Refused (`ferry.BufferError`) while a view of it is exported.
    fn release(&self, py: Python<'_>, copy: &Bound<'_, PyBuf>) -> PyResult<()> {
        let op = "release";
        let mut guard = self.lock(py);
        let ch = guard.as_mut().ok_or_else(|| self.closed_error(py, op))?;
        let mut state = copy.get().lock();
        state.check_unexported(py, op)?;
        let handle = match std::mem::replace(&mut state.held, Held::Gone("released (the copy went back to its owner)"))
        {
            Held::Copy(c) => c,
            other => {
                state.held = other;
                return Err(raise(
                    py,
                    "CopyError",
                    "NotCopy",
                    format!(
                        "{}: this buffer is owned, not a received copy; pass it or free it instead",
                        self.context(op)
                    ),
                ));
            }
        };
        match ch.release(handle) {
            Ok(()) => Ok(()),
            Err(refused) => {
                let (error, value) = refused.into_parts();
                state.held = Held::Copy(value);
                drop(state);
                let err = self.err(py, &error, op);
                let _ = err.value(py).setattr("buffer", copy);
                Err(err)
            }
        }
    }

    /// Start an orderly close: nothing more can be sent; messages already
    /// on their way still arrive, then `Closed`.
    fn teardown(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, "Channel.teardown", |ch| ch.teardown())
    }

    /// Publish messages held back by batching (`set_batching`).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, "Channel.flush", |ch| ch.flush())
    }

    /// Publish outgoing messages in batches (one wake-up each) instead of
    /// one by one; `flush` publishes at once.
    fn set_batching(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        self.with(py, "Channel.set_batching", |ch| ch.set_batching(on))
    }

    /// How long (seconds) `wait` busy-polls before it sleeps.
    #[getter]
    fn get_spin(&self, py: Python<'_>) -> PyResult<f64> {
        self.with(py, "Channel.spin", |ch| Ok(ch.spin().as_secs_f64()))
    }

    /// Set how long (seconds) `wait` busy-polls before it sleeps (0: sleep
    /// at once).
    #[setter]
    fn set_spin(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let spin = duration(py, Some(seconds), "spin")?.unwrap_or(crate::FOREVER);
        self.with(py, "Channel.spin", |ch| {
            ch.set_spin(spin);
            Ok(())
        })
    }

    /// The next event, or None if none is waiting (never waits). A failed
    /// channel raises its failure once.
    fn poll(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let ev = self.lock(py).as_mut().and_then(Channel::poll);
        ev.map(|ev| self.event(py, ev, "Channel.poll")).transpose()
    }

    /// Wait up to `timeout` seconds (None: no limit) for the next event,
    /// without holding the GIL: the event, or None on timeout or once the
    /// channel is closed. A failed channel raises its failure once
    /// (`ferry.PeerGone` for a peer that died).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Py<PyAny>>> {
        let timeout = duration(py, timeout, "timeout")?;
        let deadline = timeout.map(|t| Instant::now() + t);
        // An event already there is taken without giving up the GIL.
        let first = {
            let mut guard = self.lock(py);
            match guard.as_mut() {
                None => return Ok(None),
                Some(ch) => ch.poll(),
            }
        };
        if let Some(ev) = first {
            return self.event(py, ev, "Channel.wait").map(Some);
        }
        let got = self.wait_sliced(
            py,
            deadline,
            || Ok(Some(None)),
            |ch, slice| match ch.wait(Some(slice)) {
                Ok(ev) => Some(Some(ev)),
                Err(ferry::WaitError::Closed) => Some(None),
                Err(ferry::WaitError::TimedOut) => None,
            },
        )?;
        match got.flatten() {
            Some(ev) => self.event(py, ev, "Channel.wait").map(Some),
            None => Ok(None),
        }
    }

    /// Prepare to wait on `fileno()` (in `selectors`, `select.poll`, an
    /// event loop): call it when `poll()` returned None. False: an event
    /// may be waiting already, poll again. True: the fd becomes readable
    /// when an event may be waiting (wake-ups can be spurious: `poll`
    /// tells). The protocol: poll until None, arm, wait for the fd, poll.
    fn arm(&self, py: Python<'_>) -> PyResult<bool> {
        let mut guard = self.lock(py);
        Ok(guard.as_mut().is_none_or(|ch| ch.arm()))
    }

    /// The channel's pollable fd, the same for its whole life: readable
    /// once armed (`arm`) and an event may be waiting.
    fn fileno(&self, py: Python<'_>) -> PyResult<i32> {
        self.with(py, "Channel.fileno", |ch| Ok(ch.as_fd().as_raw_fd()))
    }

    /// `await channel.next_event()`: the next event, waiting in the
    /// running asyncio loop (`loop.add_reader` on `fileno()`); None once
    /// the channel is closed. Cancel-safe: the event is taken from the
    /// channel only in the step that returns it, so a cancelled wait
    /// (`asyncio.wait_for` timing out, a task cancelled) loses nothing.
    fn next_event<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.py().import("ferry._aio")?.call_method1("next_event", (slf,))
    }

    /// The channel itself: `async for event in channel`.
    fn __aiter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// `async for event in channel`: events until the channel closes.
    fn __anext__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.py().import("ferry._aio")?.call_method1("anext", (slf,))
    }

    /// The channel itself: `for event in channel`.
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// `for event in channel`: wait for events until the channel closes.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        self.wait(py, None)
    }

    /// Close this end now. A connected peer sees the channel end abruptly
    /// (`teardown` first for an orderly close); buffers already queued to
    /// us come back to their free lists. Closing twice does nothing.
    fn close(&self, py: Python<'_>) {
        let channel = self.lock(py).take();
        drop(channel);
    }

    /// `with channel:` gives the channel and closes it at the end.
    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Close the channel at the end of a `with` block (exceptions go on).
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }

    /// How it reads in the interpreter.
    fn __repr__(&self) -> String {
        // Without waiting for a thread that is using the channel.
        let state = match self.inner.try_lock() {
            Ok(guard) => guard.as_ref().map_or("closed", |ch| state_name(ch.state())),
            Err(TryLockError::Poisoned(poisoned)) => {
                poisoned.into_inner().as_ref().map_or("closed", |ch| state_name(ch.state()))
            }
            Err(TryLockError::WouldBlock) => "in use by another thread",
        };
        format!("<ferry.Channel {}, {}>", self.label, state)
    }
}

impl PyChannel {
    fn connected(&self, py: Python<'_>, timeout: Option<Duration>, op: &str) -> PyResult<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let got = self.wait_sliced(
            py,
            deadline,
            || Err(self.closed_error(py, op)),
            |ch, slice| match ch.wait_connected(slice) {
                Err(e) if e == ErrorKind::TimedOut => None,
                other => Some(other),
            },
        )?;
        match got {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(self.err(py, &e, op)),
            None => Err(self.err(py, &ErrorKind::TimedOut.into(), op)),
        }
    }

    /// The channel, for a selector's wait (which holds the lock itself).
    pub(crate) fn inner(&self) -> &Mutex<Option<Channel>> {
        &self.inner
    }

    pub(crate) fn label(&self) -> &str {
        &self.label
    }
}

#[allow(clippy::too_many_arguments)]
fn bind_params(
    py: Python<'_>,
    role: &str,
    trust: Option<&str>,
    max_meta_size: usize,
    alignment: usize,
    min_buffer_size: usize,
    max_buffer_size: usize,
    timeout: f64,
) -> PyResult<BindParams> {
    Ok(BindParams {
        role: parse_role(py, role)?,
        trust: trust.map(|t| parse_trust(py, t)).transpose()?,
        max_meta_size,
        constraints: constraints(alignment, min_buffer_size, max_buffer_size),
        timeout: duration(py, Some(timeout), "timeout")?.unwrap_or(crate::FOREVER),
        ..BindParams::default()
    })
}
