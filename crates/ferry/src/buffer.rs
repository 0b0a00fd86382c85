//! Buffer handles.
//!
//! A [`Buffer`] is a buffer this domain owns; a [`BufferCopy`] is a read-only
//! copy this domain received. Both are small (three words) and not `Clone`:
//! a handle is the proof of a buffer state, so the operations that change the
//! state consume it (move, pass, release) or borrow it (copy). Dropping an
//! owned buffer puts it back on its domain's free list for the pool;
//! dropping a copy releases it the next time its channel runs.

use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::Arc;

use crate::domain::{ChanKey, DomainShared};
use crate::error::{Error, Result};
use crate::pool::{PoolId, PoolView};

/// Names one buffer: its pool and its index in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId {
    /// The pool.
    pub pool: PoolId,
    /// Index of the buffer in its pool.
    pub index: u32,
}

/// Per-domain state of a buffer (seed 003 §5.1.1, Listing 6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum BufferState {
    /// Not present in this domain.
    Invalid = 0,
    /// A read-only copy held by this domain.
    ReadOnly = 1,
    /// Owned by this domain, read-only because copies are out.
    ReadOnlyOwned = 2,
    /// Owned by this domain, readable and writable.
    ReadWrite = 3,
}

/// A buffer owned by this domain.
///
/// It reads as a byte slice; [`Buffer::as_mut_slice`] gives write access
/// while no read-only copies of it are out.
pub struct Buffer {
    /// `None` once the handle has been consumed by an operation.
    domain: Option<Arc<DomainShared>>,
    /// Taken out exactly once: by `drop` or by [`Spares::keep`].
    view: ManuallyDrop<Arc<PoolView>>,
    index: u32,
}

impl Buffer {
    pub(crate) fn new(domain: Arc<DomainShared>, view: Arc<PoolView>, index: u32) -> Self {
        Buffer { domain: Some(domain), view: ManuallyDrop::new(view), index }
    }

    /// The buffer's id.
    pub fn id(&self) -> BufferId {
        BufferId { pool: self.view.id(), index: self.index }
    }

    /// Size of the buffer in bytes (the pool's buffer size).
    pub fn len(&self) -> usize {
        self.view.geometry().buffer_size()
    }

    /// Never true: buffers are at least a page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Write access, refused with [`Error::CopiesOutstanding`] while
    /// read-only copies of this buffer are out.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        let domain = self.domain.as_ref().expect("live handle");
        let state = domain.lock().buffer_state(self.view.id(), self.index);
        if state != BufferState::ReadWrite {
            return Err(Error::CopiesOutstanding);
        }
        // SAFETY: this domain owns the buffer read-write (checked just now
        // under the domain lock), and nothing but an operation taking this
        // handle by `&`/value can change that: `&mut self` excludes those for
        // the lifetime of the slice. The view's mapping lives as long as the
        // `Arc` we hold. No other domain has access to an owned read-write
        // buffer (Algorithm 2, invariants 2–4), so the slice is unaliased.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.view.buffer_ptr(self.index), self.len()) })
    }

    pub(crate) fn domain_id(&self) -> u64 {
        self.domain.as_ref().expect("live handle").id
    }

    /// Whether the buffer is READ_WRITE for its domain (no copies out or
    /// in), read without the domain lock from the view's mirror of the
    /// state. As current as a check under the lock that is released at
    /// once: a transition on another thread can follow right after.
    pub(crate) fn is_read_write(&self) -> bool {
        self.view.is_read_write(self.index)
    }
}

impl Drop for Buffer {
    /// Back to the free list of its domain (or aside until its copies are
    /// back); the domain keeps the view reference for its next `alloc`.
    fn drop(&mut self) {
        let id = self.id();
        // SAFETY: drop runs once, and nothing uses `self.view` after it.
        let view = unsafe { ManuallyDrop::take(&mut self.view) };
        match self.domain.take() {
            Some(domain) => crate::domain::buffer_dropped(&domain, id, view),
            None => drop(view),
        }
    }
}

impl Deref for Buffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the owner always has at least read access to its buffer in
        // its own view (READ_WRITE or READ_ONLY_OWNED); writes happen only
        // through `as_mut_slice`, which needs `&mut self`. The mapping lives
        // as long as the `Arc<PoolView>` we hold.
        unsafe { std::slice::from_raw_parts(self.view.buffer_ptr(self.index), self.len()) }
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer").field("pool", &self.view.id()).field("index", &self.index).finish()
    }
}

/// The references a channel end's buffer handles hold (their domain and
/// their pool's view), kept from the handles it gives away (move, pass) for
/// the handles it receives next. Each reference is an atomic count, and
/// taking or dropping one is a locked instruction; recycling them saves
/// four per buffer that comes back over the channel.
#[derive(Default)]
pub(crate) struct Spares {
    domains: Vec<Arc<DomainShared>>,
    views: Vec<Arc<PoolView>>,
}

/// Enough for the buffers a deep queue has in flight.
const SPARES_MAX: usize = 1024;

impl Spares {
    /// Consume a handle that was given away, keeping its references.
    pub(crate) fn keep(&mut self, buffer: Buffer) {
        let buffer = ManuallyDrop::new(buffer);
        // SAFETY: `buffer` is never used or dropped after these two reads, so
        // each field is moved out of it exactly once (the index is Copy).
        let (domain, view) = unsafe { (std::ptr::read(&buffer.domain), std::ptr::read(&buffer.view)) };
        let view = ManuallyDrop::into_inner(view);
        if self.views.len() < SPARES_MAX {
            self.views.push(view);
        }
        if let Some(domain) = domain {
            if self.domains.len() < SPARES_MAX {
                self.domains.push(domain);
            }
        }
    }

    /// A reference to `view`: a kept one if there is (it is the same view
    /// unless the pool was mapped anew), else a new one.
    pub(crate) fn view(&mut self, view: &Arc<PoolView>) -> Arc<PoolView> {
        match self.views.pop() {
            Some(v) if Arc::ptr_eq(&v, view) => v,
            _ => view.clone(),
        }
    }

    /// Drop the kept references to views of pool `id` (it left the
    /// channel: they would keep its mapping alive).
    pub(crate) fn forget_pool(&mut self, id: PoolId) {
        self.views.retain(|v| v.id() != id);
    }

    /// A handle for a buffer that arrived (its view from [`Spares::view`]).
    pub(crate) fn buffer(&mut self, domain: &Arc<DomainShared>, view: Arc<PoolView>, index: u32) -> Buffer {
        let domain = match self.domains.pop() {
            Some(d) if Arc::ptr_eq(&d, domain) => d,
            _ => domain.clone(),
        };
        Buffer::new(domain, view, index)
    }
}

/// A read-only copy of a buffer, received over a channel.
pub struct BufferCopy {
    domain: Option<Arc<DomainShared>>,
    view: Arc<PoolView>,
    index: u32,
    chan: ChanKey,
}

impl BufferCopy {
    pub(crate) fn new(domain: Arc<DomainShared>, view: Arc<PoolView>, index: u32, chan: ChanKey) -> Self {
        BufferCopy { domain: Some(domain), view, index, chan }
    }

    /// The buffer's id.
    pub fn id(&self) -> BufferId {
        BufferId { pool: self.view.id(), index: self.index }
    }

    /// Size of the buffer in bytes.
    pub fn len(&self) -> usize {
        self.view.geometry().buffer_size()
    }

    /// Never true: buffers are at least a page.
    pub fn is_empty(&self) -> bool {
        false
    }

    pub(crate) fn domain_id(&self) -> u64 {
        self.domain.as_ref().expect("live handle").id
    }

    pub(crate) fn chan(&self) -> ChanKey {
        self.chan
    }

    pub(crate) fn consume(mut self) {
        self.domain = None;
    }

    pub(crate) fn release_parts(&mut self) -> Option<(Arc<DomainShared>, BufferId, ChanKey)> {
        let id = self.id();
        let chan = self.chan;
        self.domain.take().map(|d| (d, id, chan))
    }
}

impl Deref for BufferCopy {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: a holder of a copy has read access until it releases the
        // copy, which consumes this handle; the owner cannot write while any
        // copy is out (it is READ_ONLY_OWNED). The mapping lives as long as
        // the `Arc<PoolView>`.
        unsafe { std::slice::from_raw_parts(self.view.buffer_ptr(self.index), self.len()) }
    }
}

impl AsRef<[u8]> for BufferCopy {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl fmt::Debug for BufferCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferCopy").field("pool", &self.view.id()).field("index", &self.index).finish()
    }
}

/// What a copy can be made from: an owned buffer or a received copy
/// (forwarding it, seed 003 Algorithm 9).
pub trait CopySource: Deref<Target = [u8]> + sealed::Sealed {
    /// The buffer's id.
    fn buffer_id(&self) -> BufferId;
    #[doc(hidden)]
    fn source_domain(&self) -> u64;
}

impl CopySource for Buffer {
    fn buffer_id(&self) -> BufferId {
        self.id()
    }
    fn source_domain(&self) -> u64 {
        self.domain_id()
    }
}

impl CopySource for BufferCopy {
    fn buffer_id(&self) -> BufferId {
        self.id()
    }
    fn source_domain(&self) -> u64 {
        self.domain_id()
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Buffer {}
    impl Sealed for super::BufferCopy {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Allocator, Domain, PoolConstraints};

    /// A handle given away leaves its two references in the spares; the
    /// next handle received takes them instead of new ones.
    #[test]
    fn spares_recycle_references() {
        let d = Domain::new("d");
        let a = Allocator::new(&d, 2, 4096, PoolConstraints::default()).unwrap();
        let b = a.alloc().unwrap();
        let view = Arc::clone(&b.view);
        let counts = |v: &Arc<PoolView>| (Arc::strong_count(&d.shared), Arc::strong_count(v));
        let before = counts(&view);
        let mut s = Spares::default();
        s.keep(b);
        assert_eq!(counts(&view), before, "the references moved into the spares");
        let v = s.view(&view);
        assert!(Arc::ptr_eq(&v, &view));
        let c = s.buffer(&d.shared, v, 0);
        assert_eq!(counts(&view), before, "and from there into the new handle");
        assert_eq!((c.id().index, c.len()), (0, 4096));
        // Nothing kept: new references.
        let v = s.view(&view);
        assert_eq!(counts(&view), (before.0, before.1 + 1));
        drop(v);
        s.keep(c);
    }
}
