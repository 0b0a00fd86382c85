//! Channel events as small Python objects (`ferry.MoveReceived(buffer,
//! meta)`, …), one class per kind, usable in `match` statements.

use ferry::{Event, Role, TrustLevel};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::buffer::PyBuf;
use crate::errors::to_py;

/// Declare an event class: frozen, its fields readable as attributes and
/// matchable by position (`case ferry.MoveReceived(buf, meta):`).
macro_rules! event {
    ($(#[$doc:meta])* $name:ident { $($(#[$fdoc:meta])* $field:ident : $ty:ty),* }) => {
        $(#[$doc])*
        #[pyclass(module = "ferry", frozen, get_all)]
        pub struct $name {
            $($(#[$fdoc])* pub $field: $ty,)*
        }

        #[pymethods]
        impl $name {
            /// The field names, for positional patterns in `match`.
            #[classattr]
            fn __match_args__(py: Python<'_>) -> PyResult<pyo3::Bound<'_, PyTuple>> {
                PyTuple::new(py, [$(stringify!($field)),*] as [&str; 0 $(+ { let _ = stringify!($field); 1 })*])
            }

            /// How it reads in the interpreter.
            #[allow(unused_variables)]
            fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
                let fields: Vec<String> = vec![$(
                    format!("{}={}", stringify!($field), (&self.$field).into_pyobject(py)?.repr()?),
                )*];
                Ok(format!("{}({})", stringify!($name), fields.join(", ")))
            }
        }
    };
}

event!(
    /// Creator: a binder connected; the channel is connected now.
    BindRequest {
        /// The role the binder got: "master", "slave" or "generic".
        binder_role: &'static str
    }
);
event!(
    /// Binder: the creator accepted; the channel is connected now.
    Bound {}
);
event!(
    /// The peer offers a pool: answer with `Channel.respond_pool(pool,
    /// accept)`, unless the channel's pool policy is "accept_all" (then it
    /// is accepted already).
    PoolAssignRequest {
        /// The pool's id.
        pool: u128,
        /// Bytes per buffer.
        buffer_size: usize,
        /// Buffers in the pool.
        count: u32,
        /// Its trust level ("full", "half" or "none").
        trust: &'static str
    }
);
event!(
    /// Our pool was accepted: its buffers may travel on the channel.
    PoolAssigned {
        /// The pool's id.
        pool: u128
    }
);
event!(
    /// Our pool was vetoed by the peer (or by the library: it does not meet
    /// the channel's constraints).
    PoolAssignVetoed {
        /// The pool's id.
        pool: u128
    }
);
event!(
    /// A pool was removed from the channel.
    PoolRemoved {
        /// The pool's id.
        pool: u128
    }
);
event!(
    /// A removal of a pool was refused: copies were still out.
    PoolRemoveRefused {
        /// The pool's id.
        pool: u128
    }
);
event!(
    /// A buffer was moved to us: we own it now (read-write).
    MoveReceived {
        /// The buffer (`ferry.Buffer`).
        buffer: Py<PyBuf>,
        /// Its meta data.
        meta: Py<PyBytes>
    }
);
event!(
    /// A buffer we moved came back: we own it again.
    BufferPassed {
        /// The buffer (`ferry.Buffer`).
        buffer: Py<PyBuf>,
        /// Its meta data.
        meta: Py<PyBytes>
    }
);
event!(
    /// A read-only copy arrived: read it, then `Channel.release` it.
    CopyReceived {
        /// The copy (`ferry.Buffer`, read-only).
        buffer: Py<PyBuf>,
        /// Its meta data.
        meta: Py<PyBytes>
    }
);
event!(
    /// A copy we sent was released by its holder.
    CopyReleased {
        /// The buffer's pool id.
        pool: u128,
        /// The buffer's index in its pool.
        index: u32,
        /// Whether every copy is back (the buffer is writable again).
        writable: bool
    }
);
event!(
    /// The channel closed after a teardown.
    Closed {
        /// Whether the peer started the teardown.
        by_peer: bool
    }
);
event!(
    /// An aggregate (several buffers sent as one, from a Rust peer)
    /// arrived. The Python API does not take aggregates apart: it gives
    /// its buffers back at once (moved ones to our free list, copies
    /// released) and reports what came.
    AggregateReceived {
        /// The aggregate's length in bytes.
        length: usize,
        /// Its meta data.
        meta: Py<PyBytes>
    }
);
event!(
    /// The library vetoed the peer's offer of a pool by itself: taking it
    /// would pass one of the channel's limits. The channel goes on.
    PoolOfferRefused {
        /// The pool offered.
        pool: u128,
        /// Why, in words.
        reason: String
    }
);

pub(crate) fn role_name(role: Role) -> &'static str {
    match role {
        Role::Generic => "generic",
        Role::Master => "master",
        Role::Slave => "slave",
    }
}

pub(crate) fn trust_name(trust: TrustLevel) -> &'static str {
    match trust {
        TrustLevel::Uninitialized => "uninitialized",
        TrustLevel::None => "none",
        TrustLevel::Half => "half",
        TrustLevel::Full => "full",
    }
}

/// A library event as its Python object; a failed channel
/// (`Event::Error`) as the exception, its message starting with `context`.
pub(crate) fn to_py_event(py: Python<'_>, ev: Event, context: &str) -> PyResult<Py<PyAny>> {
    let obj = match ev {
        Event::BindRequest { binder_role } => {
            Py::new(py, BindRequest { binder_role: role_name(binder_role) })?.into_any()
        }
        Event::Bound => Py::new(py, Bound {})?.into_any(),
        Event::PoolAssignRequest(req) => Py::new(
            py,
            PoolAssignRequest {
                pool: req.pool.as_u128(),
                buffer_size: req.geometry.buffer_size(),
                count: req.geometry.count(),
                trust: trust_name(req.trust),
            },
        )?
        .into_any(),
        Event::PoolAssigned(id) => Py::new(py, PoolAssigned { pool: id.as_u128() })?.into_any(),
        Event::PoolVetoed(id) => Py::new(py, PoolAssignVetoed { pool: id.as_u128() })?.into_any(),
        Event::PoolRemoved(id) => Py::new(py, PoolRemoved { pool: id.as_u128() })?.into_any(),
        Event::PoolRemoveRefused(id) => Py::new(py, PoolRemoveRefused { pool: id.as_u128() })?.into_any(),
        Event::MoveReceived { buffer, meta } => Py::new(
            py,
            MoveReceived { buffer: Py::new(py, PyBuf::owned(buffer))?, meta: PyBytes::new(py, &meta).unbind() },
        )?
        .into_any(),
        Event::BufferPassed { buffer, meta } => Py::new(
            py,
            BufferPassed { buffer: Py::new(py, PyBuf::owned(buffer))?, meta: PyBytes::new(py, &meta).unbind() },
        )?
        .into_any(),
        Event::CopyReceived { copy, meta } => Py::new(
            py,
            CopyReceived { buffer: Py::new(py, PyBuf::copy(copy))?, meta: PyBytes::new(py, &meta).unbind() },
        )?
        .into_any(),
        Event::CopyReleased { buffer, writable } => {
            Py::new(py, CopyReleased { pool: buffer.pool.as_u128(), index: buffer.index, writable })?.into_any()
        }
        Event::Closed { by_peer } => Py::new(py, Closed { by_peer })?.into_any(),
        Event::Error(e) => return Err(to_py(py, &e, context)),
        Event::Aggregate { agg, meta } => {
            let length = agg.len();
            let meta = PyBytes::new(py, &meta).unbind();
            drop(agg);
            Py::new(py, AggregateReceived { length, meta })?.into_any()
        }
        Event::PoolOfferRefused { pool, reason } => {
            Py::new(py, PoolOfferRefused { pool: pool.as_u128(), reason: reason.to_string() })?.into_any()
        }
    };
    Ok(obj)
}
