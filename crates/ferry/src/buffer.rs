//! Buffer handles.
//!
//! A [`Buffer`] is a buffer this domain owns; a [`BufferCopy`] is a read-only
//! copy this domain received. Both are small (three words) and not `Clone`:
//! a handle is the proof of a buffer state, so the operations that change the
//! state consume it (move, pass, release) or borrow it (copy). Dropping an
//! owned buffer puts it back on its domain's free list for the pool;
//! dropping a copy releases it the next time its channel runs.

use crate::ErrorKind;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::Arc;

use crate::domain::{ChanKey, DomainShared};
use crate::error::{Result, ViewMismatch};
pub use crate::pool::{BufferId, BufferState};
use crate::pool::{PoolId, PoolView};

/// A buffer owned by this domain.
///
/// It reads as a byte slice; [`Buffer::as_mut_slice`] gives write access
/// while no read-only copies of it are out ([`Buffer::as_slice_of`] and
/// [`Buffer::as_mut_slice_of`] view it as plain-old-data values). Moving or
/// passing it consumes the handle; dropping it puts the buffer back on its
/// domain's free list.
///
/// ```
/// use ferry::{Allocator, Domain, Error, PoolConstraints};
/// let alloc = Allocator::new(&Domain::new("d"), 2, 4096, PoolConstraints::default())?;
/// let mut buf = alloc.alloc().expect("a free buffer");
/// assert_eq!(buf.len(), 4096);
/// buf.as_mut_slice()?[..3].copy_from_slice(b"abc");
/// assert_eq!(&buf[..3], b"abc");                 // reads as &[u8]
/// let id = buf.id();
/// drop(buf);                                     // free again
/// assert_eq!(alloc.alloc().map(|b| b.id()), Some(id));
/// # Ok::<(), Error>(())
/// ```
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

    /// Write access, refused with [`ErrorKind::CopiesOutstanding`] while
    /// read-only copies of this buffer are out.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        let domain = self.domain.as_ref().expect("live handle");
        let state = domain.lock().buffer_state(self.view.id(), self.index);
        if state != BufferState::ReadWrite {
            return Err(ErrorKind::CopiesOutstanding.into());
        }
        // SAFETY: this domain owns the buffer read-write (checked just now
        // under the domain lock), and nothing but an operation taking this
        // handle by `&`/value can change that: `&mut self` excludes those for
        // the lifetime of the slice. The view's mapping lives as long as the
        // `Arc` we hold. No other domain has access to an owned read-write
        // buffer (Algorithm 2, invariants 2–4), so the slice is unaliased.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.view.buffer_ptr(self.index), self.len()) })
    }

    /// The whole buffer as a slice of `T`, a plain-old-data type
    /// ([`bytemuck::Pod`], re-exported as [`ferry::Pod`](crate::Pod)).
    /// [`ErrorKind::BadView`] if the buffer is not a whole number of `T`s.
    ///
    /// ```
    /// use ferry::{Allocator, Domain, Error, ErrorKind, PoolConstraints};
    /// let alloc = Allocator::new(&Domain::new("d"), 1, 4096, PoolConstraints::default())?;
    /// let mut buf = alloc.alloc().unwrap();
    /// buf.as_mut_slice_of::<u32>()?.iter_mut().enumerate().for_each(|(i, w)| *w = i as u32);
    /// let words: &[u32] = buf.as_slice_of()?;
    /// assert_eq!((words.len(), words[1023]), (1024, 1023));
    /// // A 4096-byte buffer is not a whole number of 12-byte elements.
    /// assert!(matches!(buf.as_slice_of::<[u32; 3]>().map_err(ferry::Error::into_kind), Err(ErrorKind::BadView { .. })));
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn as_slice_of<T: bytemuck::Pod>(&self) -> Result<&[T]> {
        typed(self, 0, None)
    }

    /// `count` elements of `T` from byte `offset`: [`ErrorKind::BadView`] if they
    /// leave the buffer or `offset` is not aligned for `T`.
    ///
    /// ```
    /// # use ferry::{Allocator, Domain, Error, ErrorKind, PoolConstraints};
    /// # let alloc = Allocator::new(&Domain::new("d"), 1, 4096, PoolConstraints::default())?;
    /// let mut buf = alloc.alloc().unwrap();
    /// buf.slice_of_mut::<u64>(8, 2)?.copy_from_slice(&[7, 9]);
    /// assert_eq!(buf.slice_of::<u64>(8, 2)?, &[7, 9]);
    /// assert!(matches!(buf.slice_of::<u64>(4, 1).map_err(ferry::Error::into_kind), Err(ErrorKind::BadView { .. })));     // misaligned
    /// assert!(matches!(buf.slice_of::<u64>(4088, 2).map_err(ferry::Error::into_kind), Err(ErrorKind::BadView { .. })));  // past the end
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn slice_of<T: bytemuck::Pod>(&self, offset: usize, count: usize) -> Result<&[T]> {
        typed(self, offset, Some(count))
    }

    /// One `T` at byte `offset`: a typed view of a struct of the
    /// application's own, made plain-old-data with
    /// `#[derive(ferry::Pod, ferry::Zeroable)]` (no bytemuck dependency
    /// needed). [`ErrorKind::BadView`] if it leaves the buffer or `offset` is not
    /// aligned for `T` (buffers are page-aligned: an offset that is a
    /// multiple of `T`'s alignment is).
    ///
    /// ```
    /// use ferry::{Allocator, Domain, ErrorKind, PoolConstraints};
    ///
    /// #[derive(Clone, Copy, Debug, PartialEq, ferry::Pod, ferry::Zeroable)]
    /// #[repr(C)]
    /// struct Header {
    ///     seq: u64,
    ///     len: u32,
    ///     flags: u32,
    /// }
    ///
    /// let alloc = Allocator::new(&Domain::new("d"), 1, 4096, PoolConstraints::default())?;
    /// let mut buf = alloc.alloc().unwrap();
    /// *buf.view_mut::<Header>(0)? = Header { seq: 7, len: 100, flags: 1 };
    /// assert_eq!(buf.view::<Header>(0)?.seq, 7);
    /// assert_eq!(&buf[..8], &7u64.to_ne_bytes());
    /// assert!(matches!(buf.view::<Header>(4).map_err(|e| e.kind().clone()), Err(ErrorKind::BadView { .. }))); // misaligned
    /// assert!(matches!(buf.view::<Header>(4088).map_err(|e| e.kind().clone()), Err(ErrorKind::BadView { .. }))); // past the end
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn view<T: bytemuck::Pod>(&self, offset: usize) -> Result<&T> {
        typed(self, offset, Some(1)).map(|one| &one[0])
    }

    /// One mutable `T` at byte `offset`: the checks of
    /// [`view`](Buffer::view), and [`ErrorKind::CopiesOutstanding`] as for
    /// [`as_mut_slice`](Buffer::as_mut_slice).
    pub fn view_mut<T: bytemuck::Pod>(&mut self, offset: usize) -> Result<&mut T> {
        typed_mut(self.as_mut_slice()?, offset, Some(1)).map(|one| &mut one[0])
    }

    /// The whole buffer as a mutable slice of `T`: [`ErrorKind::CopiesOutstanding`]
    /// as for [`as_mut_slice`](Buffer::as_mut_slice), [`ErrorKind::BadView`] as
    /// for [`as_slice_of`](Buffer::as_slice_of).
    pub fn as_mut_slice_of<T: bytemuck::Pod>(&mut self) -> Result<&mut [T]> {
        typed_mut(self.as_mut_slice()?, 0, None)
    }

    /// `count` mutable elements of `T` from byte `offset` (the checks of
    /// [`slice_of`](Buffer::slice_of) and [`as_mut_slice`](Buffer::as_mut_slice)).
    pub fn slice_of_mut<T: bytemuck::Pod>(&mut self, offset: usize, count: usize) -> Result<&mut [T]> {
        typed_mut(self.as_mut_slice()?, offset, Some(count))
    }

    pub(crate) fn domain_id(&self) -> u64 {
        self.domain.as_ref().expect("live handle").id
    }

    /// The domain, view and index behind the handle (for
    /// [`crate::secure`]).
    pub(crate) fn parts(&self) -> (&Arc<DomainShared>, &Arc<PoolView>, u32) {
        (self.domain.as_ref().expect("live handle"), &self.view, self.index)
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
            Some(domain) => crate::domain::buffer_dropped(domain, id, view),
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
    #[inline(always)]
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
    #[inline]
    pub(crate) fn view(&mut self, view: &Arc<PoolView>) -> Arc<PoolView> {
        match self.views.pop() {
            Some(v) if Arc::ptr_eq(&v, view) => v,
            _ => view.clone(),
        }
    }

    /// A kept reference to the view of pool `id`, if the last one kept is
    /// of it (a channel whose buffers go back and forth keeps them).
    #[inline]
    pub(crate) fn view_of(&mut self, id: PoolId) -> Option<Arc<PoolView>> {
        if self.views.last().is_some_and(|v| v.id() == id) {
            return self.views.pop();
        }
        None
    }

    /// Drop the kept references to views of pool `id` (it left the
    /// channel: they would keep its mapping alive).
    pub(crate) fn forget_pool(&mut self, id: PoolId) {
        self.views.retain(|v| v.id() != id);
    }

    /// A handle for a buffer that arrived (its view from [`Spares::view`]).
    #[inline]
    pub(crate) fn buffer(&mut self, domain: &Arc<DomainShared>, view: Arc<PoolView>, index: u32) -> Buffer {
        let domain = match self.domains.pop() {
            Some(d) if Arc::ptr_eq(&d, domain) => d,
            _ => domain.clone(),
        };
        Buffer::new(domain, view, index)
    }
}

/// A read-only copy of a buffer, received over a channel
/// ([`Event::CopyReceived`](crate::Event::CopyReceived)). It reads as a byte
/// slice and never changes while held: the owner cannot write the buffer
/// until every copy is back. Give it back with
/// [`Channel::release`](crate::Channel::release) (dropping it releases it
/// the next time its channel runs), or forward it with
/// [`Channel::copy`](crate::Channel::copy).
///
/// ```
/// use std::time::Duration;
/// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};
/// # let t = Duration::from_secs(10);
/// # let (a, b) = (Domain::new("a"), Domain::new("b"));
/// # let ep = Endpoint::local();
/// # let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
/// # let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
/// # tx.wait_connected(t)?;
/// # rx.wait_connected(t)?;
/// # rx.set_pool_policy(PoolPolicy::AcceptAll);
/// # let alloc = Allocator::new(&a, 2, 4096, PoolConstraints::default())?;
/// # tx.assign_pool(alloc.pool())?;
/// # rx.poll();
/// # tx.poll();
/// // `tx` and `rx` are a connected channel with a pool assigned.
/// let mut buf = alloc.alloc().unwrap();
/// buf.as_mut_slice()?[0] = 1;
/// tx.copy(&buf, &[])?;
/// let Ok(Event::CopyReceived { copy, .. }) = rx.wait(Some(t)) else { panic!() };
/// assert_eq!(copy[0], 1);
/// assert!(buf.as_mut_slice().is_err(), "the owner is read-only while the copy is out");
/// rx.release(copy)?;
/// assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: true, .. })));
/// assert!(buf.as_mut_slice().is_ok());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
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

    /// The whole copy as a slice of `T` (see [`Buffer::as_slice_of`]).
    pub fn as_slice_of<T: bytemuck::Pod>(&self) -> Result<&[T]> {
        typed(self, 0, None)
    }

    /// `count` elements of `T` from byte `offset` (see [`Buffer::slice_of`]).
    pub fn slice_of<T: bytemuck::Pod>(&self, offset: usize, count: usize) -> Result<&[T]> {
        typed(self, offset, Some(count))
    }

    /// One `T` at byte `offset` (see [`Buffer::view`]).
    pub fn view<T: bytemuck::Pod>(&self, offset: usize) -> Result<&T> {
        typed(self, offset, Some(1)).map(|one| &one[0])
    }

    pub(crate) fn domain_id(&self) -> u64 {
        self.domain.as_ref().expect("live handle").id
    }

    pub(crate) fn chan(&self) -> ChanKey {
        self.chan
    }

    /// The domain, view and index behind the handle (for
    /// [`crate::secure`]).
    pub(crate) fn parts(&self) -> (&Arc<DomainShared>, &Arc<PoolView>, u32) {
        (self.domain.as_ref().expect("live handle"), &self.view, self.index)
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

/// The byte range of `count` elements of `T` at `offset` in `bytes` (all of
/// `bytes` with `None`), checked for size, bounds and alignment.
fn view_range<T>(bytes: &[u8], offset: usize, count: Option<usize>) -> Result<std::ops::Range<usize>> {
    let size = std::mem::size_of::<T>();
    let align = std::mem::align_of::<T>();
    let whole = count.is_none();
    let len = match count {
        Some(n) => n.checked_mul(size),
        None => Some(bytes.len().saturating_sub(offset)),
    };
    let bad = |bytes: usize, why| {
        ErrorKind::BadView(Box::new(ViewMismatch { ty: std::any::type_name::<T>(), size, align, offset, bytes, why }))
    };
    let Some(len) = len else { return Err(bad(usize::MAX, "the length overflows").into()) };
    if size == 0 {
        return Err(bad(len, "the type has no size").into());
    }
    if offset.checked_add(len).is_none_or(|end| end > bytes.len()) {
        return Err(bad(len, "the range leaves the buffer").into());
    }
    if whole && len % size != 0 {
        return Err(bad(len, "the buffer is not a whole number of elements").into());
    }
    if (bytes.as_ptr() as usize).wrapping_add(offset) % align != 0 {
        return Err(bad(len, "the offset is not aligned for the type").into());
    }
    Ok(offset..offset + len)
}

fn typed<T: bytemuck::Pod>(bytes: &[u8], offset: usize, count: Option<usize>) -> Result<&[T]> {
    let range = view_range::<T>(bytes, offset, count)?;
    // Size and alignment are checked above: the cast cannot fail.
    Ok(bytemuck::cast_slice(&bytes[range]))
}

fn typed_mut<T: bytemuck::Pod>(bytes: &mut [u8], offset: usize, count: Option<usize>) -> Result<&mut [T]> {
    let range = view_range::<T>(bytes, offset, count)?;
    Ok(bytemuck::cast_slice_mut(&mut bytes[range]))
}

/// What a copy can be made from: an owned buffer or a received copy
/// (forwarding it, [ETH-BT] Algorithm 9).
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

    fn why(e: crate::Error) -> &'static str {
        match e.kind() {
            ErrorKind::BadView(m) => m.why,
            other => panic!("expected BadView, got {other:?}"),
        }
    }

    /// Typed views: sizes, bounds, alignment and the ownership check, each a
    /// typed error; the views see the same bytes as the byte slice.
    #[test]
    fn typed_views_are_checked() {
        let d = Domain::new("d");
        let a = Allocator::new(&d, 1, 8192, PoolConstraints::default()).unwrap();
        let mut b = a.alloc().unwrap();
        let words = b.as_mut_slice_of::<u64>().unwrap();
        assert_eq!(words.len(), 1024);
        words[1] = 0x0102_0304_0506_0708;
        assert_eq!(&b[8..16], &0x0102_0304_0506_0708u64.to_ne_bytes());
        assert_eq!(b.slice_of::<u16>(8, 4).unwrap(), bytemuck::cast_slice::<u64, u16>(&[0x0102_0304_0506_0708]));
        assert_eq!(b.slice_of::<u64>(8192, 0).unwrap(), &[] as &[u64]);

        assert_eq!(why(b.as_slice_of::<[u8; 3]>().unwrap_err()), "the buffer is not a whole number of elements");
        assert_eq!(why(b.slice_of::<u32>(2, 1).unwrap_err()), "the offset is not aligned for the type");
        assert_eq!(why(b.slice_of_mut::<u32>(6, 1).unwrap_err()), "the offset is not aligned for the type");
        assert_eq!(why(b.slice_of::<u64>(8184, 2).unwrap_err()), "the range leaves the buffer");
        assert_eq!(why(b.slice_of::<u64>(8200, 0).unwrap_err()), "the range leaves the buffer");
        assert_eq!(why(b.slice_of::<u64>(0, usize::MAX).unwrap_err()), "the length overflows");
        assert_eq!(why(b.as_slice_of::<()>().unwrap_err()), "the type has no size");
        let e = b.slice_of::<u32>(2, 3).unwrap_err();
        assert_eq!(
            e,
            ErrorKind::BadView(Box::new(crate::error::ViewMismatch {
                ty: "u32",
                size: 4,
                align: 4,
                offset: 2,
                bytes: 12,
                why: "the offset is not aligned for the type"
            }))
        );
        assert!(e.to_string().contains("12 bytes at offset 2 of a buffer as elements of u32"), "{e}");
    }

    /// A buffer with copies out has no mutable typed view either.
    #[test]
    fn mutable_typed_views_need_read_write() {
        let d = Domain::new("d");
        let a = Allocator::new(&d, 1, 4096, PoolConstraints::default()).unwrap();
        let mut b = a.alloc().unwrap();
        let key = d.new_chan_key();
        d.lock().copy_sent(b.id(), key);
        assert_eq!(b.as_mut_slice_of::<u32>().unwrap_err(), ErrorKind::CopiesOutstanding);
        assert_eq!(b.slice_of_mut::<u32>(0, 1).unwrap_err(), ErrorKind::CopiesOutstanding);
        assert_eq!(b.as_slice_of::<u32>().unwrap().len(), 1024, "reading is still allowed");
        d.lock().copy_returned(b.id(), key);
        assert!(b.as_mut_slice_of::<u32>().is_ok());
    }

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
