//! Ferry's errors as Python exceptions. The classes are plain Python
//! (`ferry/_errors.py`: some derive from two bases, such as
//! `ferry.BufferError` from `ferry.Error` and the builtin `BufferError`,
//! which a class made in Rust cannot); this module picks the class for
//! each `ferry::Error` and raises it with a message that names what failed.

use pyo3::prelude::*;
use pyo3::types::PyType;

/// An exception of class `class` (a name in `ferry._errors`) with
/// `message`, its `kind` attribute set to `kind`.
pub(crate) fn raise(py: Python<'_>, class: &str, kind: &str, message: String) -> PyErr {
    let ty = py
        .import("ferry._errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
    match ty {
        Ok(ty) => {
            let err = PyErr::from_type(ty, message);
            // An attribute on a fresh exception object cannot fail but for
            // memory; the exception is still the right one without it.
            let _ = err.value(py).setattr("kind", kind);
            err
        }
        // Only if the package is broken (its Python half missing).
        Err(e) => e,
    }
}

/// The exception class for each error of the library.
fn class_of(e: &ferry::Error) -> &'static str {
    use ferry::ErrorKind as E;
    match e.kind() {
        E::BadBufferSize { .. }
        | E::BadBufferCount { .. }
        | E::BadAlignment(_)
        | E::InvalidArgument(_)
        | E::TrustNotSupported { .. }
        | E::MetaTooLarge { .. }
        | E::BadView(_)
        | E::BadRange { .. }
        | E::SameBuffer => "InvalidArgument",
        E::Os(_) => "OsError",
        E::EndpointInUse => "EndpointInUse",
        E::EndpointNotListening => "EndpointNotListening",
        E::BindRefused(_) => "BindRefused",
        E::NotConnected(_) | E::TearingDown => "NotConnected",
        E::WrongDirection => "WrongDirection",
        E::ForeignBuffer => "ForeignBuffer",
        E::PoolVetoed(_) => "PoolVetoed",
        E::PoolNotAssigned(_)
        | E::PoolRemovalPending(_)
        | E::UnknownPool(_)
        | E::PoolAlreadyAssigned(_)
        | E::TrustMismatch { .. }
        | E::PoolInUse(_)
        | E::NoPendingRequest(_) => "PoolError",
        E::CopiesOutstanding | E::NotCopyHolder | E::CopiesForwarded => "CopyError",
        E::QueueFull | E::AggregateTooLarge { .. } => "QueueFull",
        E::PeerGone | E::PeerUnresponsive(_) => "PeerGone",
        E::Protocol(_) => "ProtocolError",
        E::TimedOut => "TimedOut",
        E::LimitExceeded { .. } | E::QuotaExceeded { .. } => "LimitExceeded",
        _ => "Error",
    }
}

/// The variant's name (`QueueFull`, `PoolNotAssigned`, …): the `kind`
/// attribute of the exception, for code that tells variants of one class
/// apart.
fn kind_of(e: &ferry::Error) -> String {
    format!("{:?}", e.kind()).chars().take_while(|c| c.is_ascii_alphanumeric()).collect()
}

/// `e` as a Python exception whose message starts with `context` (what
/// failed, on which channel or object).
pub(crate) fn to_py(py: Python<'_>, e: &ferry::Error, context: &str) -> PyErr {
    raise(py, class_of(e), &kind_of(e), format!("{context}: {e}"))
}

/// A bad argument given from Python (`ferry.InvalidArgument`, a
/// `ValueError`).
pub(crate) fn invalid(py: Python<'_>, message: String) -> PyErr {
    raise(py, "InvalidArgument", "InvalidArgument", message)
}
