//! The pool allocator of [ETH-BT] §6.4: creates a pool in a domain and hands
//! out its free buffers, most recently freed first.

use std::time::{Duration, Instant};

use crate::buffer::Buffer;
use crate::channel::{Channel, Event};
use crate::domain::Pool;
use crate::domain::{self, Domain};
use crate::error::{Refused, Result, ResultExt};
use crate::pool::{Geometry, PoolConstraints, PoolMemory};
use crate::setup::ChannelState;

/// How long [`Allocator::alloc_wait`] waits on the channel before it looks
/// at the free list again (a buffer may come back without a wake-up of the
/// channel: dropped on another thread).
const RECHECK: Duration = Duration::from_millis(5);
use crate::ErrorKind;

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
            return Err(ErrorKind::BadAlignment(constraints.alignment).into());
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

    /// A free buffer, waiting up to `timeout` for one to come back over
    /// `channel` while all are in use: the producer's "allocate, or wait
    /// for the sink to pass one back" in one call. The channel's events are
    /// processed meanwhile:
    ///
    /// - A buffer of this allocator's pool passed back
    ///   ([`Event::BufferPassed`]) is taken: it goes to the free list, and
    ///   from there to this call. **Its meta data is dropped**: a sink that
    ///   answers something in it needs the explicit loop
    ///   ([`Channel::wait`], then [`alloc`](Allocator::alloc)). Such passes
    ///   already kept in the channel by an earlier helper are taken too.
    /// - Every other event is kept in the channel, in the order it arrived,
    ///   and handed out by the next [`Channel::poll`] or [`Channel::wait`]:
    ///   passes of buffers of other pools, released copies
    ///   ([`Event::CopyReleased`]; a buffer dropped with copies out comes
    ///   back to the free list when the last one is released, and this call
    ///   sees it), pool events, and on a channel this domain is the sink of,
    ///   received moves: a moved buffer holds the peer's data, so it is the
    ///   caller's to read and drop even when it is of this pool; it is not
    ///   free until then.
    ///
    /// A buffer that comes back another way (dropped on another thread,
    /// passed back over another channel) is seen within a few milliseconds.
    ///
    /// Errors: [`ErrorKind::TimedOut`] after `timeout`; the error of a channel
    /// that failed meanwhile ([`Event::Error`], kept for `poll` too) or
    /// [`ErrorKind::NotConnected`] for one that is closed (its
    /// [`Event::Closed`] kept likewise); [`ErrorKind::InvalidArgument`] if the
    /// channel belongs to another domain (nothing of this pool could come
    /// back over it).
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};
    ///
    /// let t = Duration::from_secs(10);
    /// let ep = Endpoint::local();
    /// let sink = {
    ///     let ep = ep.clone();
    ///     std::thread::spawn(move || -> ferry::Result<u64> {
    ///         let mut rx = Channel::connect(&Domain::new("sink"), &ep, BindParams::default(), t)?;
    ///         rx.set_pool_policy(PoolPolicy::AcceptAll);
    ///         let mut sum = 0;
    ///         while let Ok(ev) = rx.wait(Some(t)) {
    ///             if let Event::MoveReceived { buffer, .. } = ev {
    ///                 sum += buffer[0] as u64;
    ///                 rx.pass(buffer, &[]).map_err(|r| r.error)?;
    ///             }
    ///         }
    ///         Ok(sum)
    ///     })
    /// };
    /// let app = Domain::new("producer");
    /// let mut tx = Channel::accept(&app, &ep, ChannelSetup::default(), t)?;
    /// let alloc = Allocator::new(&app, 2, 4096, PoolConstraints::default())?; // only 2 buffers
    /// tx.assign_pool_and_wait(alloc.pool(), t)?;
    /// for i in 1..=10u8 {
    ///     let mut buf = alloc.alloc_wait(&mut tx, t)?; // waits for a pass back when both are out
    ///     buf.as_mut_slice()?[0] = i;
    ///     tx.move_buffer(buf, &[])?;
    /// }
    /// tx.teardown()?;
    /// assert_eq!(sink.join().unwrap()?, 55);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_wait(&self, channel: &mut Channel, timeout: Duration) -> Result<Buffer> {
        if channel.domain().id() != self.domain.id() {
            return Err(ErrorKind::InvalidArgument("the channel belongs to another domain than the allocator").into());
        }
        let deadline = Instant::now() + timeout;
        let pool = self.pool.id();
        channel.drop_held_passes(pool);
        loop {
            if let Some(buffer) = self.alloc() {
                return Ok(buffer);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ErrorKind::TimedOut.into());
            }
            match channel.wait_unheld(left.min(RECHECK)) {
                Some(Event::BufferPassed { buffer, .. }) if buffer.id().pool == pool => drop(buffer),
                Some(ev) => {
                    let stop = match &ev {
                        Event::Error(e) => Some(e.clone()),
                        Event::Closed { .. } => Some(ErrorKind::NotConnected(ChannelState::Closed).into()),
                        _ => None,
                    };
                    channel.hold(ev);
                    if let Some(e) = stop {
                        return Err(e);
                    }
                }
                None if channel.state() == ChannelState::Closed => {
                    return Err(ErrorKind::NotConnected(ChannelState::Closed).into())
                }
                None => {}
            }
        }
    }

    /// Give a buffer back (the same as dropping it, but refuses buffers of
    /// other pools or domains, handing them back).
    pub fn free(&self, buffer: Buffer) -> Result<(), Refused<Buffer>> {
        let id = buffer.id();
        self.free_bare(buffer).context(|| format!("free {id} into an allocator of domain {:?}", self.domain.name()))
    }

    /// [`Allocator::free`], its errors without context.
    fn free_bare(&self, buffer: Buffer) -> Result<(), Refused<Buffer>> {
        if buffer.domain_id() != self.domain.id() {
            return Err(Refused::new(ErrorKind::ForeignBuffer, buffer));
        }
        if buffer.id().pool != self.pool.id() {
            return Err(Refused::new(ErrorKind::UnknownPool(buffer.id().pool), buffer));
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
        let Ok(Event::CopyReceived { copy, .. }) = rx.wait(Some(t)) else { panic!("no copy") };
        rx.release(copy).unwrap();
        assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: true, .. })));
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
        assert_eq!(r.error, ErrorKind::ForeignBuffer);
        let b = r.into_inner();
        assert_eq!(b.id().pool, a2.pool().id());
        let c = other.alloc().unwrap();
        assert!(matches!(a1.free(c).unwrap_err().error.kind(), ErrorKind::UnknownPool(_)));
    }

    #[test]
    fn bad_geometry_is_typed() {
        let d = Domain::new("d");
        assert!(matches!(
            Allocator::new(&d, 1, 1000, PoolConstraints::default()).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::BadBufferSize { .. })
        ));
        assert!(matches!(
            Allocator::new(&d, 0, 4096, PoolConstraints::default()).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::BadBufferCount { .. })
        ));
        let c = PoolConstraints { alignment: 3, ..PoolConstraints::default() };
        assert!(matches!(
            Allocator::new(&d, 1, 4096, c).as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::BadAlignment(3))
        ));
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
