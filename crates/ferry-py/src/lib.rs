//! Ferry from Python: the native half of the `ferry` package (`ferry._ferry`),
//! built with maturin. The package's Python half (`python/ferry/`) holds
//! the exception classes, the asyncio glue and the type stubs.
//!
//! The API is the library's, shaped for Python: domains, endpoints,
//! allocators, channels with move/pass/copy/release, events as small
//! objects, and buffers that export the pool memory itself through the
//! buffer protocol. Every wait releases the GIL.

use std::net::ToSocketAddrs;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry::{ChannelState, PoolConstraints, PoolId, Role, TrustLevel};
use pyo3::prelude::*;

mod buffer;
mod channel;
mod errors;
mod events;

use buffer::{Held, PyBuf};
use channel::PyChannel;
use errors::{invalid, to_py};

/// A wait without a limit, as a duration that cannot overflow an instant.
pub(crate) const FOREVER: Duration = Duration::from_secs(1 << 32);

/// Seconds from Python as a duration: None (and infinity) is no limit;
/// negative or NaN is refused.
pub(crate) fn duration(py: Python<'_>, seconds: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_infinite() && s > 0.0 => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s.min(FOREVER.as_secs_f64())))),
        Some(s) => Err(invalid(
            py,
            format!("{what} of {s} seconds is not possible; give a number of seconds ≥ 0, or None for no limit"),
        )),
    }
}

pub(crate) fn parse_role(py: Python<'_>, role: &str) -> PyResult<Role> {
    match role {
        "generic" => Ok(Role::Generic),
        "master" => Ok(Role::Master),
        "slave" => Ok(Role::Slave),
        other => Err(invalid(py, format!("role {other:?} is not one of \"generic\", \"master\" and \"slave\""))),
    }
}

pub(crate) fn parse_trust(py: Python<'_>, trust: &str) -> PyResult<TrustLevel> {
    match trust {
        "full" => Ok(TrustLevel::Full),
        "half" => Ok(TrustLevel::Half),
        "none" => Ok(TrustLevel::None),
        other => Err(invalid(py, format!("trust level {other:?} is not one of \"full\", \"half\" and \"none\""))),
    }
}

/// A pool given from Python: a `Pool`, or an `Allocator` (its pool).
pub(crate) fn pool_of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<ferry::Pool> {
    if let Ok(a) = obj.cast::<PyAllocator>() {
        return Ok(a.get().inner.pool().clone());
    }
    if let Ok(p) = obj.cast::<PyPool>() {
        return Ok(p.get().inner.clone());
    }
    Err(invalid(py, format!("expected a ferry.Pool or a ferry.Allocator, got {}", type_name(obj))))
}

/// A pool id given from Python: an int, a `Pool` or an `Allocator`.
pub(crate) fn pool_id_of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<PoolId> {
    if let Ok(id) = obj.extract::<u128>() {
        return Ok(PoolId::from_u128(id));
    }
    if obj.is_instance_of::<pyo3::types::PyInt>() {
        return Err(invalid(py, format!("{obj} is not a pool id; a pool id is an int in 0..2**128 (Pool.id)")));
    }
    pool_of(py, obj).map(|p| p.id()).map_err(|_| {
        invalid(py, format!("expected a pool id (an int), a ferry.Pool or a ferry.Allocator, got {}", type_name(obj)))
    })
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "an object".into())
}

/// A protection domain: the owner of buffers, pools and channel ends
/// (one per process is usual; two domains of one process model two
/// parties that share nothing but channels).
#[pyclass(module = "ferry", name = "Domain", frozen)]
pub struct PyDomain {
    pub(crate) inner: ferry::Domain,
}

#[pymethods]
impl PyDomain {
    /// A new domain; `name` appears in messages.
    #[new]
    fn new(name: &str) -> Self {
        PyDomain { inner: ferry::Domain::new(name) }
    }

    /// The domain's name.
    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_string()
    }

    /// The pool `pool_id` as this domain knows it (one it made, or one a
    /// peer assigned to it), or None.
    fn pool(&self, pool_id: u128) -> Option<PyPool> {
        self.inner.pool(PoolId::from_u128(pool_id)).map(|inner| PyPool { inner })
    }

    /// Ids of the pools this domain knows.
    fn pools(&self) -> Vec<u128> {
        self.inner.pools().into_iter().map(PoolId::as_u128).collect()
    }

    /// How it reads in the interpreter.
    fn __repr__(&self) -> String {
        format!("<ferry.Domain {:?}>", self.inner.name())
    }
}

/// Where a channel is created and bound: `Endpoint.local()` (threads of
/// this process), `Endpoint.shm(path)` and `Endpoint.shm_abstract(name)`
/// (processes of this host, shared memory), `Endpoint.tcp(host, port)`
/// (machines).
#[pyclass(module = "ferry", name = "Endpoint", frozen)]
pub struct PyEndpoint {
    pub(crate) inner: ferry::Endpoint,
    /// How it reads in messages.
    pub(crate) label: String,
}

#[pymethods]
impl PyEndpoint {
    /// A fresh endpoint for two domains of this process (threads): create
    /// a channel on it in one, bind to it from the other.
    #[staticmethod]
    fn local() -> Self {
        PyEndpoint { inner: ferry::Endpoint::local(), label: "a local endpoint".into() }
    }

    /// A shared-memory endpoint named by a socket file `path`: the creator
    /// listens there, a process binds to it. The file goes away once
    /// connected.
    #[staticmethod]
    fn shm(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        if path.as_os_str().is_empty() {
            return Err(invalid(
                py,
                "a shared-memory endpoint needs a socket path; give one such as /tmp/app.sock".into(),
            ));
        }
        let label = format!("shm:{}", path.display());
        Ok(PyEndpoint { inner: ferry::Endpoint::shm(path), label })
    }

    /// A shared-memory endpoint with a Linux abstract socket name (no
    /// file).
    #[staticmethod]
    fn shm_abstract(py: Python<'_>, name: &str) -> PyResult<Self> {
        if name.is_empty() || name.contains('\0') {
            return Err(invalid(py, "an abstract socket name is a non-empty string without NUL characters".into()));
        }
        Ok(PyEndpoint { inner: ferry::Endpoint::shm_abstract(name), label: format!("shm@{name}") })
    }

    /// A TCP endpoint: the creator listens at `host`:`port` (port 0: the
    /// kernel picks one, `Channel.listen_addr` says which), a binder
    /// connects there.
    #[staticmethod]
    fn tcp(py: Python<'_>, host: &str, port: i64) -> PyResult<Self> {
        let port = u16::try_from(port).map_err(|_| {
            invalid(py, format!("port {port} is not in 0..=65535; give a TCP port (0: the kernel picks one)"))
        })?;
        let host_owned = host.to_string();
        let addr = py
            .detach(move || (host_owned.as_str(), port).to_socket_addrs().ok().and_then(|mut a| a.next()))
            .ok_or_else(|| {
                invalid(py, format!("host {host:?} does not resolve to an address; give a name or an IP address"))
            })?;
        Ok(PyEndpoint { inner: ferry::Endpoint::tcp(addr), label: format!("tcp:{addr}") })
    }

    /// How it reads in the interpreter.
    fn __repr__(&self) -> String {
        format!("<ferry.Endpoint {}>", self.label)
    }
}

/// A pool of buffers of one size, made in a domain, as a channel sees it:
/// offered with `Channel.assign_pool`.
#[pyclass(module = "ferry", name = "Pool", frozen)]
pub struct PyPool {
    pub(crate) inner: ferry::Pool,
}

#[pymethods]
impl PyPool {
    /// The pool's id (an int, unique across processes).
    #[getter]
    fn id(&self) -> u128 {
        self.inner.id().as_u128()
    }

    /// Bytes per buffer.
    #[getter]
    fn buffer_size(&self) -> usize {
        self.inner.geometry().buffer_size()
    }

    /// Buffers in the pool.
    #[getter]
    fn count(&self) -> u32 {
        self.inner.geometry().count()
    }

    /// Address of the pool's first byte in this process; buffer `i` is at
    /// `base_address + i * buffer_size`.
    #[getter]
    fn base_address(&self) -> usize {
        self.inner.base_address()
    }

    /// How it reads in the interpreter.
    fn __repr__(&self) -> String {
        let g = self.inner.geometry();
        format!("<ferry.Pool {}: {} buffers of {} bytes>", self.inner.id(), g.count(), g.buffer_size())
    }
}

/// Makes a pool of `count` buffers of `size` bytes each (a power of two,
/// at least a page) in `domain`, and hands out its free buffers.
///
/// `trust` fixes the pool's trust level now ("full", "half", "none");
/// None takes the trust of the first channel it is assigned to.
/// `alignment` (a power of two up to `size`) aligns every buffer's
/// address.
#[pyclass(module = "ferry", name = "Allocator", frozen)]
pub struct PyAllocator {
    inner: ferry::Allocator,
}

#[pymethods]
impl PyAllocator {
    #[new]
    #[pyo3(signature = (domain, count, size, *, trust=None, alignment=0))]
    fn new(
        py: Python<'_>,
        domain: &PyDomain,
        count: u64,
        size: usize,
        trust: Option<&str>,
        alignment: usize,
    ) -> PyResult<Self> {
        let constraints = PoolConstraints {
            trust: trust.map(|t| parse_trust(py, t)).transpose()?.unwrap_or(TrustLevel::Uninitialized),
            alignment,
        };
        let d = &domain.inner;
        py.detach(|| ferry::Allocator::new(d, count, size, constraints))
            .map(|inner| PyAllocator { inner })
            .map_err(|e| to_py(py, &e, "Allocator"))
    }

    /// A free buffer (owned, read-write), or None if all are in use.
    fn alloc(&self) -> Option<PyBuf> {
        self.inner.alloc().map(PyBuf::owned)
    }

    /// Put `buffer` back on the free list now (dropping the last reference
    /// does the same later). Refused (`ferry.BufferError`) while a view of
    /// it is exported; the object gives no access afterwards.
    fn free(&self, py: Python<'_>, buffer: &Bound<'_, PyBuf>) -> PyResult<()> {
        let mut state = buffer.get().lock();
        state.check_unexported(py, "free")?;
        let handle = match std::mem::replace(&mut state.held, Held::Gone("freed (it is back on its free list)")) {
            Held::Owned(b) => b,
            other => {
                state.held = other;
                return Err(errors::raise(
                    py,
                    "CopyError",
                    "NotOwned",
                    "Allocator.free: this is a read-only copy received over a channel; release it on its channel instead"
                        .into(),
                ));
            }
        };
        match self.inner.free(handle) {
            Ok(()) => Ok(()),
            Err(refused) => {
                let (error, value) = refused.into_parts();
                state.held = Held::Owned(value);
                drop(state);
                let err = to_py(py, &error, "Allocator.free");
                let _ = err.value(py).setattr("buffer", buffer);
                Err(err)
            }
        }
    }

    /// Buffers free now.
    #[getter]
    fn available(&self) -> usize {
        self.inner.available()
    }

    /// The allocator's pool.
    #[getter]
    fn pool(&self) -> PyPool {
        PyPool { inner: self.inner.pool().clone() }
    }

    /// Bytes per buffer.
    #[getter]
    fn buffer_size(&self) -> usize {
        self.inner.pool().geometry().buffer_size()
    }

    /// Buffers in the pool.
    #[getter]
    fn count(&self) -> u32 {
        self.inner.pool().geometry().count()
    }

    /// How it reads in the interpreter.
    fn __repr__(&self) -> String {
        let g = self.inner.pool().geometry();
        format!(
            "<ferry.Allocator pool {}: {} of {} buffers of {} bytes free>",
            self.inner.pool().id(),
            self.inner.available(),
            g.count(),
            g.buffer_size()
        )
    }
}

/// Waits on many channels at once (of any backends), from one thread,
/// without the GIL: `wait(timeout)` returns `(channel, event)` from a
/// channel that has one. Built as the library's `Selector`: an epoll set of
/// the channels' fds, so a wait costs in proportion to the channels that
/// woke, not to all of them, and the channels that may have an event are
/// served in turn (one that always has another cannot starve the others).
/// The channels stay usable on their own between waits; while `wait` runs,
/// another thread that uses one of them gets `ferry.Error` (kind
/// "ChannelBusy").
#[pyclass(module = "ferry", name = "Selector", frozen)]
pub struct PySelector {
    state: Mutex<SelectorState>,
}

/// One channel of a selector.
struct Member {
    channel: Py<PyChannel>,
    /// In the ready queue (not asleep in the epoll set).
    queued: bool,
}

struct SelectorState {
    epoll: std::os::fd::OwnedFd,
    members: Vec<Option<Member>>,
    /// Keys free for reuse.
    free: Vec<usize>,
    /// Channels that may have an event, in the order they are served.
    ready: std::collections::VecDeque<usize>,
    /// Events served since the epoll set was last looked at.
    served: usize,
}

/// What one round of a selector's wait came to.
enum Round {
    Event(Py<PyChannel>, ferry::Event),
    Nothing,
}

impl SelectorState {
    fn key_of(&self, channel: &Bound<'_, PyChannel>) -> Option<usize> {
        self.members.iter().position(|m| m.as_ref().is_some_and(|m| m.channel.is(channel)))
    }

    /// Poll each queued channel once, in turn: the first event (its
    /// channel goes to the back of the queue), or `Nothing` once every
    /// queued channel is armed or asked to be polled again.
    fn serve_round(&mut self, py: Python<'_>) -> PyResult<Round> {
        for _ in 0..self.ready.len() {
            let Some(key) = self.ready.pop_front() else { break };
            let Some(member) = self.members.get_mut(key).and_then(Option::as_mut) else { continue };
            let chan = member.channel.get();
            let mut guard = match chan.inner().try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    self.ready.push_front(key);
                    return Err(errors::raise(
                        py,
                        "Error",
                        "ChannelBusy",
                        format!(
                            "Selector.wait: {} is in use by another thread; use a channel from one thread at a time",
                            chan.label()
                        ),
                    ));
                }
            };
            // A channel closed from Python is no longer served.
            let Some(ch) = guard.as_mut() else {
                member.queued = false;
                continue;
            };
            if let Some(ev) = ch.poll() {
                drop(guard);
                let channel = member.channel.clone_ref(py);
                self.ready.push_back(key);
                return Ok(Round::Event(channel, ev));
            }
            if ch.arm() {
                member.queued = false;
            } else {
                self.ready.push_back(key);
            }
        }
        Ok(Round::Nothing)
    }

    /// Wait up to `timeout` (without the GIL) for armed channels to wake,
    /// and queue them; how many woke.
    fn collect(&mut self, py: Python<'_>, timeout: Duration) -> usize {
        use rustix::event::{epoll, Timespec};
        let ts = Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: i64::from(timeout.subsec_nanos()) };
        let epfd = &self.epoll;
        let keys: Vec<usize> = py.detach(|| {
            let mut buf = [std::mem::MaybeUninit::uninit(); 64];
            match epoll::wait(epfd, &mut buf, Some(&ts)) {
                Ok((events, _)) => events.iter().map(|ev| ev.data.u64() as usize).collect(),
                Err(_) => Vec::new(),
            }
        });
        for &key in &keys {
            if let Some(Some(member)) = self.members.get_mut(key) {
                if !member.queued {
                    member.queued = true;
                    self.ready.push_back(key);
                }
            }
        }
        keys.len()
    }

    /// Whether every channel is closed (nothing more can come).
    fn all_closed(&self, py: Python<'_>) -> PyResult<bool> {
        for member in self.members.iter().flatten() {
            let chan = member.channel.get();
            let open = match chan.inner().try_lock() {
                Ok(g) => g.as_ref().is_some_and(|ch| ch.state() != ChannelState::Closed),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    p.into_inner().as_ref().is_some_and(|ch| ch.state() != ChannelState::Closed)
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    return Err(errors::raise(
                        py,
                        "Error",
                        "ChannelBusy",
                        format!(
                            "Selector.wait: {} is in use by another thread; use a channel from one thread at a time",
                            chan.label()
                        ),
                    ))
                }
            };
            if open {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Queue every channel (a backstop, when a long sleep found nothing).
    fn queue_all(&mut self) {
        for (key, member) in self.members.iter_mut().enumerate() {
            if let Some(m) = member {
                if !m.queued {
                    m.queued = true;
                    self.ready.push_back(key);
                }
            }
        }
    }
}

#[pymethods]
impl PySelector {
    /// A selector over `channels` (more can be added).
    #[new]
    #[pyo3(signature = (channels=Vec::new()))]
    fn new(py: Python<'_>, channels: Vec<Bound<'_, PyChannel>>) -> PyResult<Self> {
        let epoll = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)
            .map_err(|e| to_py(py, &ferry::ErrorKind::Os(std::io::Error::from(e).to_string()).into(), "Selector"))?;
        let sel = PySelector {
            state: Mutex::new(SelectorState {
                epoll,
                members: Vec::new(),
                free: Vec::new(),
                ready: std::collections::VecDeque::new(),
                served: 0,
            }),
        };
        for c in &channels {
            sel.add(py, c)?;
        }
        Ok(sel)
    }

    /// Add a channel (once; adding it again does nothing). A closed
    /// channel is refused (`ferry.NotConnected`).
    fn add(&self, py: Python<'_>, channel: &Bound<'_, PyChannel>) -> PyResult<()> {
        let mut st = self.lock(py);
        if st.key_of(channel).is_some() {
            return Ok(());
        }
        let key = st.free.pop().unwrap_or(st.members.len());
        {
            let guard = channel.get().lock(py);
            let Some(ch) = guard.as_ref() else {
                return Err(to_py(py, &ferry::ErrorKind::NotConnected(ChannelState::Closed).into(), "Selector.add"));
            };
            use rustix::event::epoll;
            // Registering fails only for lack of kernel memory; the channel
            // is then polled in turn instead (queued after each event).
            let _ = epoll::add(&st.epoll, ch, epoll::EventData::new_u64(key as u64), epoll::EventFlags::IN);
        }
        let member = Some(Member { channel: channel.clone().unbind(), queued: true });
        if key == st.members.len() {
            st.members.push(member);
        } else {
            st.members[key] = member;
        }
        st.ready.push_back(key);
        Ok(())
    }

    /// Remove a channel; False if it was not there.
    fn remove(&self, py: Python<'_>, channel: &Bound<'_, PyChannel>) -> bool {
        let mut st = self.lock(py);
        let Some(key) = st.key_of(channel) else { return false };
        let member = st.members[key].take().expect("found just now");
        {
            let guard = channel.get().lock(py);
            // A channel closed from Python left the epoll set with its fd.
            if let Some(ch) = guard.as_ref() {
                let _ = rustix::event::epoll::delete(&st.epoll, ch);
            }
        }
        if member.queued {
            st.ready.retain(|k| *k != key);
        }
        st.free.push(key);
        true
    }

    /// How many channels the selector waits on.
    fn __len__(&self, py: Python<'_>) -> usize {
        self.lock(py).members.iter().flatten().count()
    }

    /// The channels, in the order they were added.
    #[getter]
    fn channels(&self, py: Python<'_>) -> Vec<Py<PyChannel>> {
        self.lock(py).members.iter().flatten().map(|m| m.channel.clone_ref(py)).collect()
    }

    /// Wait up to `timeout` seconds (None: no limit) for an event on any
    /// channel: `(channel, event)`, or None on timeout or when the selector
    /// is empty. A channel that failed raises its failure (the exception's
    /// `channel` attribute says which).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<(Py<PyChannel>, Py<PyAny>)>> {
        let deadline = duration(py, timeout, "timeout")?.map(|t| Instant::now() + t);
        loop {
            // The selector is locked only for one round, not while Python
            // runs signal handlers or builds the event.
            let round = {
                let mut st = self.lock(py);
                if st.members.iter().flatten().next().is_none() {
                    return Ok(None);
                }
                // Once per round, take in the channels that woke meanwhile,
                // so busy channels in the queue cannot starve them.
                if st.served >= st.ready.len().max(1) {
                    st.served = 0;
                    st.collect(py, Duration::ZERO);
                }
                match st.serve_round(py)? {
                    Round::Event(ch, ev) => {
                        st.served += 1;
                        Round::Event(ch, ev)
                    }
                    Round::Nothing if !st.ready.is_empty() => {
                        // Armed channels said "poll again": do, after a look at the set.
                        st.collect(py, Duration::ZERO);
                        Round::Nothing
                    }
                    Round::Nothing if st.all_closed(py)? => return Ok(None),
                    Round::Nothing => {
                        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                        if left.is_some_and(|l| l.is_zero()) {
                            // Time is up, but channels may have woken meanwhile.
                            if st.collect(py, Duration::ZERO) == 0 {
                                return Ok(None);
                            }
                            match st.serve_round(py)? {
                                Round::Event(ch, ev) => {
                                    st.served += 1;
                                    Round::Event(ch, ev)
                                }
                                Round::Nothing => return Ok(None),
                            }
                        } else {
                            let slice = left.map_or(SELECTOR_SLICE, |l| l.min(SELECTOR_SLICE));
                            if st.collect(py, slice) == 0 && left.is_none() {
                                // A long sleep found nothing: poll every channel once.
                                st.queue_all();
                            }
                            Round::Nothing
                        }
                    }
                }
            };
            if let Round::Event(chan, ev) = round {
                let context = format!("Selector.wait ({})", chan.get().label());
                return match events::to_py_event(py, ev, &context) {
                    Ok(obj) => Ok(Some((chan, obj))),
                    Err(err) => {
                        let _ = err.value(py).setattr("channel", &chan);
                        Err(err)
                    }
                };
            }
            py.check_signals()?;
        }
    }
}

/// The longest a selector's wait runs without the GIL before it lets
/// Python check for signals.
const SELECTOR_SLICE: Duration = Duration::from_millis(100);

impl PySelector {
    /// The selector's state, after a thread waiting in it is done (waiting
    /// for that without the GIL).
    fn lock(&self, py: Python<'_>) -> MutexGuard<'_, SelectorState> {
        loop {
            match self.state.try_lock() {
                Ok(guard) => return guard,
                Err(std::sync::TryLockError::Poisoned(poisoned)) => return poisoned.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => py.detach(|| drop(self.state.lock())),
            }
        }
    }
}

/// The native half of the `ferry` package.
#[pymodule]
fn _ferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDomain>()?;
    m.add_class::<PyEndpoint>()?;
    m.add_class::<PyPool>()?;
    m.add_class::<PyAllocator>()?;
    m.add_class::<PyBuf>()?;
    m.add_class::<PyChannel>()?;
    m.add_class::<PySelector>()?;
    m.add_class::<events::BindRequest>()?;
    m.add_class::<events::Bound>()?;
    m.add_class::<events::PoolAssignRequest>()?;
    m.add_class::<events::PoolAssigned>()?;
    m.add_class::<events::PoolAssignVetoed>()?;
    m.add_class::<events::PoolRemoved>()?;
    m.add_class::<events::PoolRemoveRefused>()?;
    m.add_class::<events::MoveReceived>()?;
    m.add_class::<events::BufferPassed>()?;
    m.add_class::<events::CopyReceived>()?;
    m.add_class::<events::CopyReleased>()?;
    m.add_class::<events::Closed>()?;
    m.add_class::<events::AggregateReceived>()?;
    m.add_class::<events::PoolOfferRefused>()?;
    m.add("MAX_META_SIZE", ferry::MAX_META_SIZE)?;
    m.add("DEFAULT_META_SIZE", ferry::ChannelSetup::default().meta_size)?;
    Ok(())
}
