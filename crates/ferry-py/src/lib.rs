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

use ferry::{Channel, ChannelState, PoolConstraints, PoolId, Role, TrustLevel};
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
                state.held = Held::Owned(refused.value);
                drop(state);
                let err = to_py(py, &refused.error, "Allocator.free");
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
/// without the GIL: `wait(timeout)` returns `(channel, event)` from the
/// first channel that has one, serving them in turn so a busy channel does
/// not starve the others. For a handful to a few dozen channels; the
/// channels stay usable on their own between waits.
#[pyclass(module = "ferry", name = "Selector", frozen)]
pub struct PySelector {
    channels: Mutex<Vec<Py<PyChannel>>>,
}

#[pymethods]
impl PySelector {
    /// A selector over `channels` (more can be added).
    #[new]
    #[pyo3(signature = (channels=Vec::new()))]
    fn new(channels: Vec<Py<PyChannel>>) -> Self {
        PySelector { channels: Mutex::new(channels) }
    }

    /// Add a channel (once).
    fn add(&self, py: Python<'_>, channel: Py<PyChannel>) {
        let mut list = self.list();
        if !list.iter().any(|c| c.is(&channel)) {
            list.push(channel.clone_ref(py));
        }
    }

    /// Remove a channel; False if it was not there.
    fn remove(&self, channel: &Bound<'_, PyChannel>) -> bool {
        let mut list = self.list();
        let before = list.len();
        list.retain(|c| !c.is(channel));
        list.len() != before
    }

    /// How many channels the selector waits on.
    fn __len__(&self) -> usize {
        self.list().len()
    }

    /// The channels, in order.
    #[getter]
    fn channels(&self, py: Python<'_>) -> Vec<Py<PyChannel>> {
        self.list().iter().map(|c| c.clone_ref(py)).collect()
    }

    /// Wait up to `timeout` seconds (None: no limit) for an event on any
    /// channel: `(channel, event)`, or None on timeout or when every
    /// channel is closed. A channel that failed raises its failure (the
    /// exception's `channel` attribute says which).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<(Py<PyChannel>, Py<PyAny>)>> {
        let deadline = duration(py, timeout, "timeout")?.map(|t| Instant::now() + t);
        let chans: Vec<Py<PyChannel>> = self.list().iter().map(|c| c.clone_ref(py)).collect();
        loop {
            let slice = match deadline {
                None => Duration::from_millis(100),
                Some(d) => d
                    .checked_duration_since(Instant::now())
                    .map_or(Duration::ZERO, |l| l.min(Duration::from_millis(100))),
            };
            // The channels are locked only while a slice runs, not while
            // Python runs signal handlers or builds the event.
            let got = {
                let mut guards: Vec<(usize, MutexGuard<'_, Option<Channel>>)> = Vec::with_capacity(chans.len());
                for (i, c) in chans.iter().enumerate() {
                    let guard = c.get().inner().try_lock().map_err(|_| {
                        errors::raise(
                            py,
                            "Error",
                            "ChannelBusy",
                            format!(
                                "Selector.wait: {} is in use by another thread; use a channel from one thread at a time",
                                c.get().label()
                            ),
                        )
                    })?;
                    if guard.is_some() {
                        guards.push((i, guard));
                    }
                }
                let which: Vec<usize> = guards.iter().map(|(i, _)| *i).collect();
                let mut refs: Vec<&mut Channel> = guards.iter_mut().filter_map(|(_, g)| g.as_mut()).collect();
                if refs.is_empty() {
                    return Ok(None);
                }
                let waiting = &mut refs;
                match py.detach(move || ferry::wait_any(waiting, Some(slice))) {
                    Some((k, ev)) => Some((which[k], ev)),
                    None if refs.iter().all(|c| c.state() == ChannelState::Closed) => return Ok(None),
                    None => None,
                }
            };
            if let Some((i, ev)) = got {
                let chan = &chans[i];
                let context = format!("Selector.wait ({})", chan.get().label());
                return match events::to_py_event(py, ev, &context) {
                    Ok(obj) => Ok(Some((chan.clone_ref(py), obj))),
                    Err(err) => {
                        let _ = err.value(py).setattr("channel", chan);
                        Err(err)
                    }
                };
            }
            if slice.is_zero() {
                return Ok(None);
            }
            py.check_signals()?;
        }
    }
}

impl PySelector {
    fn list(&self) -> MutexGuard<'_, Vec<Py<PyChannel>>> {
        self.channels.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
