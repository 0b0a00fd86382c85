//! The pool allocator of [ETH-BT] §6.4: creates a pool in a domain and hands
//! out its free buffers, most recently freed first.

use crate::buffer::Buffer;
use crate::domain::Pool;
use crate::domain::{self, Domain};
use crate::error::{Error, Refused, Result};
use crate::pool::{Geometry, PoolConstraints, PoolMemory};

/// Allocates one pool and hands out its buffers.
///
/// The free list is the domain's: a buffer that comes back (passed back,
/// dropped, or freed here) is available again, whoever allocated it.
/// Dropping the allocator frees nothing that is in use: buffers and the
/// pool's mapping live as long as their handles. Once nothing refers to the
/// pool any more — no allocator or [`Pool`] handle, no buffer or copy handle,
/// no channel it is assigned to — it leaves the domain: unmapped, its fds
/// closed, gone from [`Domain::pools`] (docs/SEMANTICS.md, "When a pool
/// goes away").
///
/// ```
/// use ferry::{Allocator, Domain, PoolConstraints};
/// let domain = Domain::new("producer");
/// let alloc = Allocator::new(&domain, 4, 4096, PoolConstraints::default())?;
/// let mut buf = alloc.alloc().expect("a free buffer");
/// buf.as_mut_slice()?[..5].copy_from_slice(b"hello");
/// assert_eq!(&buf[..5], b"hello");
/// assert_eq!(alloc.available(), 3);
/// drop(buf); // back on the free list
/// assert_eq!(alloc.available(), 4);
/// # Ok::<(), ferry::Error>(())
/// ```
#[derive(Debug)]
pub struct Allocator {
    domain: Domain,
    pool: Pool,
}

impl Allocator {
    /// Create a pool of `count` buffers of `size` bytes in `domain`.
    ///
    /// `size` must be a power of two and a multiple of the page size, `count`
    /// at least one; the alignment constraint must be a power of two no
    /// larger than `size`.
    pub fn new(domain: &Domain, count: u64, size: usize, constraints: PoolConstraints) -> Result<Self> {
        let geometry = Geometry::new(size, count)?;
        if constraints.alignment != 0 && (!constraints.alignment.is_power_of_two() || constraints.alignment > size) {
            return Err(Error::BadAlignment(constraints.alignment));
        }
        let memory = PoolMemory::create(geometry)?;
        let pool = domain::create_pool(domain, memory, constraints.trust, constraints.alignment)?;
        Ok(Allocator { domain: domain.clone(), pool })
    }

    /// The pool, to assign it to channels.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// A free buffer, or `None` when all are in use.
    pub fn alloc(&self) -> Option<Buffer> {
        self.domain.alloc(self.pool.id())
    }

    /// Give a buffer back (the same as dropping it, but refuses buffers of
    /// other pools or domains, handing them back).
    pub fn free(&self, buffer: Buffer) -> Result<(), Refused<Buffer>> {
        if buffer.domain_id() != self.domain.id() {
            return Err(Refused::new(Error::ForeignBuffer, buffer));
        }
        if buffer.id().pool != self.pool.id() {
            return Err(Refused::new(Error::UnknownPool(buffer.id().pool), buffer));
        }
        drop(buffer);
        Ok(())
    }

    /// Number of free buffers (read without the domain's lock: exact for
    /// the thread that allocated and freed last, a recent count for
    /// others).
    pub fn available(&self) -> usize {
        self.pool.view.free_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifo_reuse() {
        let d = Domain::new("d");
        let a = Allocator::new(&d, 3, 4096, PoolConstraints::default()).unwrap();
        let b0 = a.alloc().unwrap();
        let b1 = a.alloc().unwrap();
        assert_eq!((b0.id().index, b1.id().index), (0, 1));
        let id0 = b0.id();
        drop(b0);
        assert_eq!(a.alloc().unwrap().id(), id0, "most recently freed first");
    }

    #[test]
    fn exhaustion_and_return() {
        let d = Domain::new("d");
        let a = Allocator::new(&d, 2, 4096, PoolConstraints::default()).unwrap();
        let x = a.alloc().unwrap();
        let y = a.alloc().unwrap();
        assert!(a.alloc().is_none());
        a.free(x).unwrap();
        drop(y);
        assert_eq!(a.available(), 2);
    }

    /// `available` (read without the lock) follows the domain's free list
    /// through every way a buffer leaves and comes back: allocation, free,
    /// drop, and the free that waits for copies sent over a channel to
    /// come back.
    #[test]
    fn available_follows_the_free_list() {
        use crate::{BindParams, Channel, ChannelSetup, Endpoint, Event, PoolPolicy};
        let t = std::time::Duration::from_secs(10);
        let d = Domain::new("d");
        let a = Allocator::new(&d, 3, 4096, PoolConstraints::default()).unwrap();
        let same = |a: &Allocator| assert_eq!(a.available(), d.free_count(a.pool().id()));
        same(&a);
        assert_eq!(a.available(), 3);
        let x = a.alloc().unwrap();
        let y = a.alloc().unwrap();
        same(&a);
        assert_eq!(a.available(), 1);
        a.free(x).unwrap();
        same(&a);
        drop(y);
        same(&a);
        assert_eq!(a.available(), 3);
        let ep = Endpoint::local();
        let mut tx = Channel::create(&d, &ep, ChannelSetup::default()).unwrap();
        let mut rx = Channel::bind(&Domain::new("peer"), &ep, BindParams::default()).unwrap();
        tx.wait_connected(t).unwrap();
        rx.wait_connected(t).unwrap();
        rx.set_pool_policy(PoolPolicy::AcceptAll);
        tx.assign_pool(a.pool()).unwrap();
        while !tx.is_assigned(a.pool().id()) {
            rx.poll();
            tx.poll();
        }
        let b = a.alloc().unwrap();
        tx.copy(&b, &[]).unwrap();
        drop(b); // read-only while its copy is out: freed when it comes back
        same(&a);
        assert_eq!(a.available(), 2);
        let Some(Event::CopyReceived { copy, .. }) = rx.wait(Some(t)) else { panic!("no copy") };
        rx.release(copy).unwrap();
        assert!(matches!(tx.wait(Some(t)), Some(Event::CopyReleased { writable: true, .. })));
        same(&a);
        assert_eq!(a.available(), 3);
    }

    #[test]
    fn foreign_buffers_are_refused_and_returned() {
        let d1 = Domain::new("d1");
        let d2 = Domain::new("d2");
        let a1 = Allocator::new(&d1, 1, 4096, PoolConstraints::default()).unwrap();
        let a2 = Allocator::new(&d2, 1, 4096, PoolConstraints::default()).unwrap();
        let other = Allocator::new(&d1, 1, 4096, PoolConstraints::default()).unwrap();
        let b = a2.alloc().unwrap();
        let r = a1.free(b).unwrap_err();
        assert_eq!(r.error, Error::ForeignBuffer);
        let b = r.into_inner();
        assert_eq!(b.id().pool, a2.pool().id());
        let c = other.alloc().unwrap();
        assert!(matches!(a1.free(c).unwrap_err().error, Error::UnknownPool(_)));
    }

    #[test]
    fn bad_geometry_is_typed() {
        let d = Domain::new("d");
        assert!(matches!(Allocator::new(&d, 1, 1000, PoolConstraints::default()), Err(Error::BadBufferSize { .. })));
        assert!(matches!(Allocator::new(&d, 0, 4096, PoolConstraints::default()), Err(Error::BadBufferCount { .. })));
        let c = PoolConstraints { alignment: 3, ..PoolConstraints::default() };
        assert!(matches!(Allocator::new(&d, 1, 4096, c), Err(Error::BadAlignment(3))));
        assert!(d.pools().is_empty(), "nothing created on error");
    }

    #[test]
    fn dropping_allocator_keeps_buffers_valid() {
        let d = Domain::new("d");
        let a = Allocator::new(&d, 2, 4096, PoolConstraints::default()).unwrap();
        let mut b = a.alloc().unwrap();
        drop(a);
        b.as_mut_slice().unwrap()[0] = 7;
        assert_eq!(b[0], 7);
    }
}
