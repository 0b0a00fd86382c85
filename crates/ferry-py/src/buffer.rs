//! `ferry.Buffer`: a buffer this domain owns, or a read-only copy it
//! received, exported through Python's buffer protocol over the pool
//! memory itself (`memoryview(buf)`, `numpy.frombuffer(buf)`, no copy).
//!
//! The handle counts the views it exported: moving, passing, copying,
//! releasing or freeing it is refused while one is out (a view would
//! otherwise let Python read or write memory another domain now owns),
//! and once its ownership left, every access raises `ferry.BufferGone`.

use std::ffi::{c_char, c_int};
use std::sync::{Mutex, MutexGuard};

use ferry::{Buffer, BufferCopy};
use pyo3::exceptions::{PyIndexError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView, PySlice};

use crate::errors::{invalid, raise};

/// What a `ferry.Buffer` object holds.
pub(crate) enum Held {
    /// A buffer this domain owns.
    Owned(Buffer),
    /// A read-only copy this domain received.
    Copy(BufferCopy),
    /// Nothing any more: what happened to it, in words.
    Gone(&'static str),
}

/// A handle and the number of buffer-protocol views exported from it.
pub(crate) struct BufState {
    pub(crate) held: Held,
    pub(crate) exports: usize,
}

/// A buffer of a Ferry pool: one this domain owns (read-write, or read-only
/// while copies of it are out), or a read-only copy received over a
/// channel.
///
/// It implements Python's buffer protocol over the pool memory itself:
/// `memoryview(buf)`, `numpy.frombuffer(buf, dtype)` and `buf[a:b]` (a
/// memoryview) read and write the buffer in place; `bytes(buf)` copies it
/// out. A received copy exports read-only views.
///
/// While any view is exported, the buffer cannot be moved, passed, copied,
/// released or freed (`ferry.BufferError`): release the views first
/// (`del array`, `memoryview.release()`). Once the buffer was moved or
/// passed away, released or freed, the object gives no access any more
/// (`ferry.BufferGone`). Dropping the last reference to an owned buffer
/// puts it back on its allocator's free list; dropping a copy releases it
/// the next time its channel runs.
#[pyclass(module = "ferry", name = "Buffer", frozen)]
pub struct PyBuf {
    pub(crate) state: Mutex<BufState>,
}

impl PyBuf {
    pub(crate) fn owned(buffer: Buffer) -> PyBuf {
        PyBuf { state: Mutex::new(BufState { held: Held::Owned(buffer), exports: 0 }) }
    }

    pub(crate) fn copy(copy: BufferCopy) -> PyBuf {
        PyBuf { state: Mutex::new(BufState { held: Held::Copy(copy), exports: 0 }) }
    }

    /// The state, whatever a panic elsewhere left in the lock (every
    /// change under it is a single assignment).
    pub(crate) fn lock(&self) -> MutexGuard<'_, BufState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// `ferry.BufferGone` for a handle whose buffer left: `what` happened.
pub(crate) fn gone(py: Python<'_>, what: &str) -> PyErr {
    raise(
        py,
        "BufferGone",
        "BufferGone",
        format!("this buffer was {what}; it gives no access any more (use the buffer the channel hands back, or allocate another)"),
    )
}

/// `ferry.BufferError` for an operation refused while views are exported.
pub(crate) fn exported(py: Python<'_>, op: &str, views: usize) -> PyErr {
    raise(
        py,
        "BufferError",
        "ViewExported",
        format!(
            "cannot {op} this buffer: {views} view(s) of it (memoryview, numpy array, slice) are still exported; \
             release them first (del the array, call memoryview.release())"
        ),
    )
}

impl BufState {
    /// Refuse `op` while views are exported, or when the buffer is gone.
    pub(crate) fn check_unexported(&self, py: Python<'_>, op: &str) -> PyResult<()> {
        if self.exports > 0 {
            return Err(exported(py, op, self.exports));
        }
        if let Held::Gone(what) = self.held {
            return Err(gone(py, what));
        }
        Ok(())
    }

    /// The memory: its address, length, and whether it is read-only now.
    fn region(&mut self, py: Python<'_>) -> PyResult<(*mut u8, usize, bool)> {
        match &mut self.held {
            Held::Owned(buffer) => {
                let len = buffer.len();
                let read_only = buffer.as_ptr().cast_mut();
                match buffer.as_mut_slice() {
                    Ok(slice) => Ok((slice.as_mut_ptr(), len, false)),
                    // Copies of it are out: it reads, but must not change.
                    Err(_) => Ok((read_only, len, true)),
                }
            }
            Held::Copy(copy) => Ok((copy.as_ptr().cast_mut(), copy.len(), true)),
            Held::Gone(what) => Err(gone(py, what)),
        }
    }

    fn id(&self) -> Option<ferry::BufferId> {
        match &self.held {
            Held::Owned(b) => Some(b.id()),
            Held::Copy(c) => Some(c.id()),
            Held::Gone(_) => None,
        }
    }
}

/// The element format of every view: unsigned bytes.
static FORMAT_BYTES: &[u8; 2] = b"B\0";

#[pymethods]
impl PyBuf {
    /// Export a view of the buffer's memory (Python's buffer protocol).
    ///
    /// # Safety
    ///
    /// Called by Python with a `Py_buffer` to fill (PyO3 checks the
    /// object's type).
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let py = slf.py();
        if view.is_null() {
            return Err(pyo3::exceptions::PyBufferError::new_err("no view to fill"));
        }
        let mut state = slf.get().lock();
        let (ptr, len, read_only) = state.region(py)?;
        if read_only && (flags & ffi::PyBUF_WRITABLE) == ffi::PyBUF_WRITABLE {
            let why = match state.held {
                Held::Copy(_) => "it is a read-only copy received over a channel",
                _ => "read-only copies of it are out (it is writable again when they are all released)",
            };
            return Err(raise(
                py,
                "BufferError",
                "ReadOnly",
                format!("cannot export a writable view of this buffer: {why}; ask for a read-only view"),
            ));
        }
        state.exports += 1;
        drop(state);
        // SAFETY: `view` is a valid, writable `Py_buffer` (checked non-null;
        // Python hands us one to fill). The memory stays mapped while the
        // view lives: the view holds a reference to this object (`obj`),
        // and the handle cannot leave the object while `exports` is
        // non-zero (every consuming operation checks it first). `shape`
        // and `strides` point into the `Py_buffer` itself, which Python
        // keeps for the life of the export. The format string is static
        // and never written.
        unsafe {
            (*view).obj = slf.into_any().into_ptr();
            (*view).buf = ptr.cast();
            (*view).len = len as ffi::Py_ssize_t;
            (*view).readonly = c_int::from(read_only);
            (*view).itemsize = 1;
            (*view).format = if (flags & ffi::PyBUF_FORMAT) == ffi::PyBUF_FORMAT {
                FORMAT_BYTES.as_ptr().cast::<c_char>().cast_mut()
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape =
                if (flags & ffi::PyBUF_ND) == ffi::PyBUF_ND { &mut (*view).len } else { std::ptr::null_mut() };
            (*view).strides = if (flags & ffi::PyBUF_STRIDES) == ffi::PyBUF_STRIDES {
                &mut (*view).itemsize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    /// A view exported by `__getbuffer__` was released.
    ///
    /// # Safety
    ///
    /// Called by Python once for each successful `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        let mut state = self.lock();
        state.exports = state.exports.saturating_sub(1);
    }

    /// Size of the buffer in bytes.
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        let mut state = self.lock();
        state.region(py).map(|(_, len, _)| len)
    }

    /// `buf[i]`: one byte as an int; `buf[a:b]`: a memoryview of those
    /// bytes in place (an exported view: release it before moving the
    /// buffer).
    fn __getitem__<'py>(slf: &Bound<'py, Self>, index: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        if let Ok(slice) = index.cast::<PySlice>() {
            let whole = PyMemoryView::from(slf.as_any())?;
            return whole.get_item(slice);
        }
        let i: isize =
            index.extract().map_err(|_| PyTypeError::new_err("a buffer index is an int or a slice of ints"))?;
        let mut state = slf.get().lock();
        let (ptr, len, _) = state.region(py)?;
        let at = position(i, len)?;
        // SAFETY: `at < len`, inside the buffer's mapping, which the handle
        // keeps alive while we hold its lock.
        let byte = unsafe { *ptr.add(at) };
        Ok(byte.into_pyobject(py)?.into_any())
    }

    /// `buf[i] = byte` or `buf[a:b] = data` (bytes-like, exactly `b - a`
    /// bytes; contiguous slices only): writes into the buffer in place.
    fn __setitem__(slf: &Bound<'_, Self>, index: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        if let Ok(slice) = index.cast::<PySlice>() {
            // The bytes first: `value` may be a view of this very buffer.
            let data = match value.cast::<PyBytes>() {
                Ok(b) => b.clone(),
                Err(_) => py.import("builtins")?.getattr("bytes")?.call1((value,))?.cast_into::<PyBytes>()?,
            };
            let data = data.as_bytes();
            let mut state = slf.get().lock();
            let (ptr, len, read_only) = state.region(py)?;
            if read_only {
                return Err(read_only_error(py, &state.held));
            }
            let range = slice.indices(len as isize)?;
            if range.step != 1 {
                return Err(invalid(py, "a buffer takes assignments to contiguous slices only (step 1)".into()));
            }
            let (start, count) = (range.start as usize, range.slicelength);
            if data.len() != count {
                return Err(invalid(
                    py,
                    format!(
                        "cannot assign {} bytes to a slice of {count} bytes; give exactly {count} bytes",
                        data.len()
                    ),
                ));
            }
            // SAFETY: `start + count <= len` (from `indices`), inside the
            // buffer, which this domain owns read-write (checked by
            // `region`); `data` is a separate `bytes` object, so the
            // ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.add(start), count) };
            return Ok(());
        }
        let i: isize =
            index.extract().map_err(|_| PyTypeError::new_err("a buffer index is an int or a slice of ints"))?;
        let byte: u8 = value.extract().map_err(|_| invalid(py, "a byte of a buffer is an int in 0..=255".into()))?;
        let mut state = slf.get().lock();
        let (ptr, len, read_only) = state.region(py)?;
        if read_only {
            return Err(read_only_error(py, &state.held));
        }
        let at = position(i, len)?;
        // SAFETY: `at < len`, inside the buffer this domain owns
        // read-write (checked by `region`).
        unsafe { *ptr.add(at) = byte };
        Ok(())
    }

    /// Address of the buffer's first byte in this process (what a numpy
    /// array over it has as its data address).
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<usize> {
        let mut state = self.lock();
        state.region(py).map(|(ptr, _, _)| ptr as usize)
    }

    /// Whether the buffer is read-only now: a received copy, or an owned
    /// buffer while read-only copies of it are out.
    #[getter]
    fn readonly(&self, py: Python<'_>) -> PyResult<bool> {
        let mut state = self.lock();
        state.region(py).map(|(_, _, ro)| ro)
    }

    /// Whether the object still gives access to the buffer (False once it
    /// was moved, passed, released or freed).
    #[getter]
    fn valid(&self) -> bool {
        !matches!(self.lock().held, Held::Gone(_))
    }

    /// `"owned"`, `"copy"` (a received read-only copy), or `"gone"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match self.lock().held {
            Held::Owned(_) => "owned",
            Held::Copy(_) => "copy",
            Held::Gone(_) => "gone",
        }
    }

    /// How many buffer-protocol views of it are exported now.
    #[getter]
    fn exports(&self) -> usize {
        self.lock().exports
    }

    /// The id of the buffer's pool (an int, as in `Pool.id`).
    #[getter]
    fn pool_id(&self, py: Python<'_>) -> PyResult<u128> {
        let state = self.lock();
        state.id().map(|id| id.pool.as_u128()).ok_or_else(|| gone_of(py, &state.held))
    }

    /// The buffer's index in its pool.
    #[getter]
    fn index(&self, py: Python<'_>) -> PyResult<u32> {
        let state = self.lock();
        state.id().map(|id| id.index).ok_or_else(|| gone_of(py, &state.held))
    }

    /// How it reads in the interpreter.
    fn __repr__(&self) -> String {
        let state = self.lock();
        match &state.held {
            Held::Owned(b) => {
                format!("<ferry.Buffer owned, pool {} #{}, {} bytes>", b.id().pool, b.id().index, b.len())
            }
            Held::Copy(c) => {
                format!("<ferry.Buffer read-only copy, pool {} #{}, {} bytes>", c.id().pool, c.id().index, c.len())
            }
            Held::Gone(what) => format!("<ferry.Buffer gone: {what}>"),
        }
    }
}

fn gone_of(py: Python<'_>, held: &Held) -> PyErr {
    match held {
        Held::Gone(what) => gone(py, what),
        _ => gone(py, "given away"),
    }
}

fn read_only_error(py: Python<'_>, held: &Held) -> PyErr {
    let why = match held {
        Held::Copy(_) => "it is a read-only copy received over a channel",
        _ => "read-only copies of it are out; write after they are all released",
    };
    raise(py, "BufferError", "ReadOnly", format!("cannot write this buffer: {why}"))
}

/// Index `i` (negative from the end) of `len` bytes.
fn position(i: isize, len: usize) -> PyResult<usize> {
    let at = if i < 0 { len as isize + i } else { i };
    if at < 0 || at as usize >= len {
        return Err(PyIndexError::new_err(format!("buffer index {i} out of range for {len} bytes")));
    }
    Ok(at as usize)
}
