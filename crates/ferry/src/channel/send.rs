//! What an end sends: move, pass, copy, release, aggregates, and the
//! checks every send makes first (in the order of `docs/SEMANTICS.md`),
//! with the queue of replies and batched messages behind them.

use super::Channel;
use crate::aggregate::{Aggregate, Held};
use crate::buffer::{Buffer, BufferCopy, BufferId, CopySource};
use crate::error::{Error, Refused, Result, ResultExt};
use crate::inspect::Op;
use crate::pool::PoolId;
use crate::proto::{self, FragEntry, Message, Meta};
use crate::setup::{ChannelState, Direction};
use crate::ErrorKind;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Channel {
    /// Move a buffer to the sink ([ETH-BT] Algorithm 7): ownership goes to
    /// the peer. Refused operations hand the buffer back.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use ferry::*;
    /// # let t = Duration::from_secs(10);
    /// # let (a, b) = (Domain::new("a"), Domain::new("b"));
    /// # let ep = Endpoint::local();
    /// # let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    /// # let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    /// # tx.wait_connected(t)?;
    /// # rx.wait_connected(t)?;
    /// # rx.set_pool_policy(PoolPolicy::AcceptAll);
    /// # let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// # tx.assign_pool(alloc.pool())?;
    /// # rx.poll();
    /// # tx.poll();
    /// // `tx` (source) and `rx` (sink): a connected channel, `alloc`'s pool assigned.
    /// let mut buf = alloc.alloc().unwrap();
    /// buf.as_mut_slice()?[0] = 9;
    /// tx.move_buffer(buf, b"frame 1")?;
    /// let Ok(Event::MoveReceived { buffer, meta }) = rx.wait(Some(t)) else { panic!() };
    /// assert_eq!((buffer[0], &meta[..]), (9, &b"frame 1"[..]));
    /// // Refused: the buffer comes back with the reason.
    /// let refused = rx.move_buffer(buffer, &[]).unwrap_err();
    /// assert_eq!(refused.error, ErrorKind::WrongDirection);
    /// let buffer = refused.into_inner();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn move_buffer(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        let id = buffer.id();
        self.move_buffer_bare(buffer, meta).context(|| format!("move {id} over {}", self.name))
    }

    /// [`Channel::move_buffer`], its errors without context.
    fn move_buffer_bare(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        self.flush_deferred();
        match self.check_transfer(Direction::Tx, &buffer, meta.len()) {
            Ok(()) => self.send_owned(buffer, meta, false, |buf, meta| Message::Move { buf, meta }),
            Err(e) => Err(Refused::new(e, buffer)),
        }
    }

    /// Pass a buffer back to the source ([ETH-BT] Algorithm 8).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use ferry::*;
    /// # let t = Duration::from_secs(10);
    /// # let (a, b) = (Domain::new("a"), Domain::new("b"));
    /// # let ep = Endpoint::local();
    /// # let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    /// # let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    /// # tx.wait_connected(t)?;
    /// # rx.wait_connected(t)?;
    /// # rx.set_pool_policy(PoolPolicy::AcceptAll);
    /// # let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// # tx.assign_pool(alloc.pool())?;
    /// # rx.poll();
    /// # tx.poll();
    /// // `tx` (source) and `rx` (sink): a connected channel, `alloc`'s pool assigned.
    /// tx.move_buffer(alloc.alloc().unwrap(), &[])?;
    /// let Ok(Event::MoveReceived { mut buffer, .. }) = rx.wait(Some(t)) else { panic!() };
    /// buffer.as_mut_slice()?[0] = 7; // the sink owns it: it may write
    /// rx.pass(buffer, b"done")?;
    /// let Ok(Event::BufferPassed { buffer, meta }) = tx.wait(Some(t)) else { panic!() };
    /// assert_eq!((buffer[0], &meta[..]), (7, &b"done"[..]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn pass(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        let id = buffer.id();
        self.pass_bare(buffer, meta).context(|| format!("pass {id} back over {}", self.name))
    }

    /// [`Channel::pass`], its errors without context.
    fn pass_bare(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        self.flush_deferred();
        match self.check_transfer(Direction::Rx, &buffer, meta.len()) {
            Ok(()) => self.send_owned(buffer, meta, false, |buf, meta| Message::Pass { buf, meta }),
            Err(e) => Err(Refused::new(e, buffer)),
        }
    }

    /// Pass a buffer whose contents do not matter to the source: a receive
    /// master handing out empty buffers to be filled. The semantics are
    /// those of [`pass`](Channel::pass); the difference is the cost: over
    /// the network no payload travels, and the source's buffer then holds
    /// whatever bytes its memory last held for it (never another domain's
    /// live data). Between threads or processes of one host the two are
    /// the same.
    pub fn pass_unfilled(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        let id = buffer.id();
        self.pass_unfilled_bare(buffer, meta).context(|| format!("pass {id} back unfilled over {}", self.name))
    }

    /// [`Channel::pass_unfilled`], its errors without context.
    fn pass_unfilled_bare(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Refused<Buffer>> {
        self.flush_deferred();
        match self.check_transfer(Direction::Rx, &buffer, meta.len()) {
            Ok(()) => self.send_owned(buffer, meta, true, |buf, meta| Message::Pass { buf, meta }),
            Err(e) => Err(Refused::new(e, buffer)),
        }
    }

    /// Send a read-only copy ([ETH-BT] Algorithm 9). The source may be a
    /// buffer we own (it becomes read-only until every copy is back) or a
    /// copy we hold (forwarding it).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use ferry::*;
    /// # let t = Duration::from_secs(10);
    /// # let (a, b) = (Domain::new("a"), Domain::new("b"));
    /// # let ep = Endpoint::local();
    /// # let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    /// # let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    /// # tx.wait_connected(t)?;
    /// # rx.wait_connected(t)?;
    /// # rx.set_pool_policy(PoolPolicy::AcceptAll);
    /// # let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// # tx.assign_pool(alloc.pool())?;
    /// # rx.poll();
    /// # tx.poll();
    /// // `tx` (source) and `rx` (sink): a connected channel, `alloc`'s pool assigned.
    /// let mut buf = alloc.alloc().unwrap();
    /// tx.copy(&buf, &[])?;
    /// assert_eq!(buf.as_mut_slice().unwrap_err(), ErrorKind::CopiesOutstanding);
    /// let Ok(Event::CopyReceived { copy, .. }) = rx.wait(Some(t)) else { panic!() };
    /// rx.release(copy)?;
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: true, .. })));
    /// assert!(buf.as_mut_slice().is_ok());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn copy<S: CopySource>(&mut self, source: &S, meta: &[u8]) -> Result<()> {
        self.copy_bare(source, meta).context(|| format!("copy {} over {}", source.buffer_id(), self.name))
    }

    /// [`Channel::copy`], its errors without context.
    fn copy_bare<S: CopySource>(&mut self, source: &S, meta: &[u8]) -> Result<()> {
        self.check_copy(source, meta)?;
        self.send_copy(source.buffer_id(), Meta::new(meta).expect("meta checked"))
    }

    /// The checks of [`copy`](Channel::copy), in its order, sending
    /// nothing (for [`crate::FanOut`], which checks every channel first).
    pub(crate) fn check_copy<S: CopySource>(&mut self, source: &S, meta: &[u8]) -> Result<()> {
        self.flush_deferred();
        self.check_sendable(Direction::Tx)?;
        if source.source_domain() != self.domain.id() {
            return Err(ErrorKind::ForeignBuffer.into());
        }
        self.check_pool(source.buffer_id().pool)?;
        self.check_meta(meta.len())?;
        self.check_room()
    }

    /// How many copies of `id` this end sent that are still out.
    pub(crate) fn copies_out_here(&self, id: BufferId) -> u32 {
        self.domain.lock().record(id).map_or(0, |r| r.copies_out_via(self.key))
    }

    /// Send a copy of `id` (checks done).
    fn send_copy(&mut self, id: BufferId, meta: Meta) -> Result<()> {
        // A copy to a peer that still holds one of this buffer from us needs
        // no payload: the buffer has been read-only since, so the peer's
        // bytes are current (the TCP backend then sends none).
        let cross = self.lent.is_some();
        let (resend, size) = self.domain.lock().copy_going(id, self.key, cross)?;
        let msg = Message::Copy { buf: id, meta };
        let link = self.link_mut();
        let sent = if resend { link.send_unfilled(&msg) } else { link.send(&msg) };
        if let Err(e) = sent {
            // Peer vanished between the checks and the send: undo.
            let mut st = self.domain.lock();
            st.copy_returned(id, self.key);
            if cross {
                st.entry(id.pool).expect("pool checked").view.memory().copy_back(id.index);
            }
            return Err(e);
        }
        self.count_sent(Op::Copy, size);
        Ok(())
    }

    /// Release a copy received over this channel ([ETH-BT] Algorithm 10).
    /// Dropping a [`BufferCopy`] releases it too, the next time the channel
    /// runs.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use ferry::*;
    /// # let t = Duration::from_secs(10);
    /// # let (a, b) = (Domain::new("a"), Domain::new("b"));
    /// # let ep = Endpoint::local();
    /// # let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    /// # let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    /// # tx.wait_connected(t)?;
    /// # rx.wait_connected(t)?;
    /// # rx.set_pool_policy(PoolPolicy::AcceptAll);
    /// # let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// # tx.assign_pool(alloc.pool())?;
    /// # rx.poll();
    /// # tx.poll();
    /// // `tx` (source) and `rx` (sink): a connected channel, `alloc`'s pool assigned.
    /// let buf = alloc.alloc().unwrap();
    /// tx.copy(&buf, &[])?;
    /// tx.copy(&buf, &[])?; // two copies out
    /// let Ok(Event::CopyReceived { copy: first, .. }) = rx.wait(Some(t)) else { panic!() };
    /// let Ok(Event::CopyReceived { copy: second, .. }) = rx.wait(Some(t)) else { panic!() };
    /// rx.release(first)?;
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: false, .. })));
    /// rx.release(second)?;
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: true, .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn release(&mut self, copy: BufferCopy) -> Result<(), Refused<BufferCopy>> {
        let id = copy.id();
        self.release_bare(copy).context(|| format!("release the copy of {id} over {}", self.name))
    }

    /// [`Channel::release`], its errors without context.
    fn release_bare(&mut self, copy: BufferCopy) -> Result<(), Refused<BufferCopy>> {
        self.flush_deferred();
        if copy.domain_id() != self.domain.id() {
            // Check the channel-level preconditions first, as everywhere.
            let e = self.check_sendable(Direction::Rx).err().unwrap_or(ErrorKind::ForeignBuffer.into());
            return Err(Refused::new(e, copy));
        }
        if copy.chan() != self.key {
            let e = self
                .check_sendable(Direction::Rx)
                .and_then(|()| self.check_pool(copy.id().pool))
                .err()
                .unwrap_or(ErrorKind::NotCopyHolder.into());
            return Err(Refused::new(e, copy));
        }
        match self.release_id(copy.id()) {
            Ok(()) => {
                copy.consume();
                Ok(())
            }
            Err(e) => Err(Refused::new(e, copy)),
        }
    }

    /// Full copy ([ETH-BT] §5.1.11): copy the bytes of `source` into
    /// `destination` (a read-write buffer of ours in a pool assigned to this
    /// channel) and move `destination`. The receiver gets a move.
    pub fn full_copy<S: CopySource>(
        &mut self,
        source: &S,
        destination: Buffer,
        meta: &[u8],
    ) -> Result<(), Refused<Buffer>> {
        let id = destination.id();
        self.full_copy_bare(source, destination, meta)
            .context(|| format!("copy {} in full into {id} over {}", source.buffer_id(), self.name))
    }

    /// [`Channel::full_copy`], its errors without context.
    fn full_copy_bare<S: CopySource>(
        &mut self,
        source: &S,
        mut destination: Buffer,
        meta: &[u8],
    ) -> Result<(), Refused<Buffer>> {
        self.flush_deferred();
        let me = self.domain.id();
        let checks = self
            .check_sendable(Direction::Tx)
            .and_then(|()| if source.source_domain() != me { Err(ErrorKind::ForeignBuffer.into()) } else { Ok(()) })
            .and_then(|()| if destination.domain_id() != me { Err(ErrorKind::ForeignBuffer.into()) } else { Ok(()) })
            .and_then(
                |()| if source.buffer_id() == destination.id() { Err(ErrorKind::SameBuffer.into()) } else { Ok(()) },
            )
            .and_then(|()| self.check_transfer(Direction::Tx, &destination, meta.len()));
        if let Err(e) = checks {
            return Err(Refused::new(e, destination));
        }
        let n = source.len().min(destination.len());
        match destination.as_mut_slice() {
            Ok(dst) => dst[..n].copy_from_slice(&source[..n]),
            Err(e) => return Err(Refused::new(e, destination)),
        }
        self.send_owned(destination, meta, false, |buf, meta| Message::Move { buf, meta })
    }

    /// Send an aggregate as one unit: the peer receives one
    /// [`Event::Aggregate`](super::Event::Aggregate) with the same fragments over its own handles
    /// of the buffers.
    ///
    /// Each distinct buffer crosses once, however many fragments refer to
    /// it. A buffer the aggregate holds the only reference to (an owned
    /// [`Buffer`] handed to it, not shared with a clone or another
    /// aggregate, with no copies out) is moved: the receiver owns it. Every
    /// other buffer — a [`BufferCopy`], or an owned buffer that something
    /// else still refers to — is sent as a read-only copy: an owned one
    /// stays read-only here until every copy is back, a copy we hold is
    /// forwarded. The buffers' pools must be assigned to the channel.
    ///
    /// All or nothing: everything is checked, including room in the queue
    /// for the whole run of slots (header, one per buffer, fragment
    /// table), before anything goes; a refused aggregate comes back intact
    /// ([`ErrorKind::QueueFull`]: try again once the peer has taken messages;
    /// [`ErrorKind::AggregateTooLarge`]: the run could never fit the queue).
    /// An empty aggregate sends its meta data alone. (Once the checks pass,
    /// only a peer that goes away mid-send can still fail it: the
    /// fragments of the members not sent yet come back in the `Refused`.)
    ///
    /// The fragment table travels in the queue's slots, 16 bytes per
    /// entry, as many per slot as the channel's meta size makes room
    /// for: 2 with a meta size up to 32 bytes (64-byte slots), 14 with
    /// [`MAX_META_SIZE`](crate::MAX_META_SIZE) (256-byte slots). Where a
    /// group of fragments repeats, each copy of each fragment taking the
    /// bytes of its buffer right after the previous copy's (a train of
    /// units, each behind its header), one entry stands for all the
    /// copies: 1 MiB behind three 32-byte headers, cut into 257 units of
    /// 4 KiB each behind a 16-byte header (517 fragments), takes 10
    /// entries, one table slot with `MAX_META_SIZE` or 5 with the
    /// smallest slots. Other tables take an entry per fragment; a channel
    /// that carries those with many fragments is best set up with a meta
    /// size of `MAX_META_SIZE` and a queue deep enough for a few runs.
    /// An aggregate received and not edited since (a router's) goes on
    /// with the table it came with, its fragments not walked again.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use ferry::*;
    /// # let t = Duration::from_secs(10);
    /// # let (a, b) = (Domain::new("a"), Domain::new("b"));
    /// # let ep = Endpoint::local();
    /// # let mut tx = Channel::create(&a, &ep, ChannelSetup::default())?;
    /// # let mut rx = Channel::bind(&b, &ep, BindParams::default())?;
    /// # tx.wait_connected(t)?;
    /// # rx.wait_connected(t)?;
    /// # rx.set_pool_policy(PoolPolicy::AcceptAll);
    /// # let alloc = Allocator::new(&a, 4, 4096, PoolConstraints::default())?;
    /// # tx.assign_pool(alloc.pool())?;
    /// # rx.poll();
    /// # tx.poll();
    /// // `tx` (source) and `rx` (sink): a connected channel, `alloc`'s pool assigned.
    /// let body = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"payload")?;
    /// let mut msg = Aggregate::from_bytes_in(alloc.alloc().unwrap(), b"HDR ")?;
    /// msg.append(body.clone()); // `body` keeps a reference: its buffer is copied
    /// tx.send_aggregate(msg, b"m1")?;
    /// let Ok(Event::Aggregate { agg, meta }) = rx.wait(Some(t)) else { panic!() };
    /// assert_eq!((agg.to_vec(), &meta[..]), (b"HDR payload".to_vec(), &b"m1"[..]));
    /// let frags: Vec<bool> = agg.fragments().map(|f| f.is_copy()).collect();
    /// assert_eq!(frags, [false, true]); // the header buffer moved, the body copied
    /// drop(agg); // the copy is released, the moved buffer freed in `b`
    /// rx.flush()?; // (a dropped copy is released the next time `rx` runs)
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::CopyReleased { writable: true, .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn send_aggregate(&mut self, agg: Aggregate, meta: &[u8]) -> Result<(), Refused<Aggregate>> {
        let len = agg.len();
        self.send_aggregate_bare(agg, meta).context(|| format!("send an aggregate of {len} bytes over {}", self.name))
    }

    /// [`Channel::send_aggregate`], its errors without context.
    fn send_aggregate_bare(&mut self, mut agg: Aggregate, meta: &[u8]) -> Result<(), Refused<Aggregate>> {
        self.flush_deferred();
        agg.settle();
        let (members, table) = match self.check_aggregate(&agg, meta.len()) {
            Ok(table) => table,
            Err(e) => return Err(Refused::new(e, agg)),
        };
        let total = agg.len() as u64;
        let mut parts = agg.into_parts_with(members, table);
        let header = Message::AggHeader {
            members: parts.members.len() as u32,
            frags: parts.wire.len() as u32,
            total,
            meta: Meta::new(meta).expect("meta checked"),
        };
        if let Err(e) = self.link_mut().send(&header) {
            return Err(Refused::new(e, parts.rebuild()));
        }
        self.count_sent(Op::Aggregate, 0);
        for i in 0..parts.members.len() {
            let held = parts.members[i].take().expect("each member is sent once");
            let sent = match Arc::try_unwrap(held) {
                // The aggregate was the only reference: move the buffer.
                Ok(Held::Owned(buffer)) if buffer.is_read_write() => {
                    match self.send_owned(buffer, &[], false, |buf, meta| Message::Move { buf, meta }) {
                        Ok(()) => Ok(()),
                        Err(r) => Err((r.error.clone(), Arc::new(Held::Owned(r.into_inner())))),
                    }
                }
                // Shared (or read-only for its copies out): a copy; our
                // reference goes when `held` does (an owned buffer then
                // waits for its copies, a copy we hold is released once
                // the copies forwarded from it are back).
                Ok(held) => self.send_aggregate_copy(Arc::new(held)),
                Err(held) => self.send_aggregate_copy(held),
            };
            // Only a peer that went away makes a send fail once there is
            // room: what was not sent comes back.
            if let Err((e, held)) = sent {
                parts.members[i] = Some(held);
                return Err(Refused::new(e, parts.rebuild()));
            }
        }
        for msg in proto::table_messages(&parts.wire, self.meta_size) {
            if let Err(e) = self.link_mut().send(&msg) {
                return Err(Refused::new(e, Aggregate::new()));
            }
        }
        Ok(())
    }

    /// One member of an aggregate sent as a copy; the handle back on error.
    fn send_aggregate_copy(&mut self, held: Arc<Held>) -> Result<(), (Error, Arc<Held>)> {
        match self.send_copy(held.id(), Meta::empty()) {
            Ok(()) => Ok(()),
            Err(e) => Err((e, held)),
        }
    }

    /// Everything [`send_aggregate`](Channel::send_aggregate) checks
    /// before it sends anything (`agg` [settled](Aggregate::settle)); the
    /// number of distinct buffers, and the fragment table and the table as
    /// it goes on the wire if it may go (`None`: an aggregate received and
    /// not edited since goes with the table it came with, which names its
    /// members in the order they came).
    #[allow(clippy::type_complexity)]
    fn check_aggregate(
        &mut self,
        agg: &Aggregate,
        meta_len: usize,
    ) -> Result<(usize, Option<(Vec<FragEntry>, Vec<FragEntry>)>)> {
        self.check_sendable(Direction::Tx)?;
        let (members, entries) = match agg.received_members() {
            Some(members) => (members, None),
            None => {
                let (members, entries) = agg.distinct();
                (members, Some(entries))
            }
        };
        for m in &members {
            if m.domain_id() != self.domain.id() {
                return Err(ErrorKind::ForeignBuffer.into());
            }
            self.check_pool(m.id().pool)?;
        }
        self.check_meta(meta_len)?;
        let table = entries.map(|entries| {
            let wire = proto::fold_table(&entries);
            (entries, wire)
        });
        let (frags, wire) = match &table {
            Some((entries, wire)) => (entries.len(), wire.len()),
            None => agg.received_counts().expect("a received table"),
        };
        let slots = proto::run_slots(members.len(), wire, self.meta_size);
        let capacity = self.link.as_ref().map_or(0, |l| l.capacity());
        if members.len() > proto::MAX_AGG_MEMBERS as usize || frags > proto::MAX_AGG_FRAGS as usize || slots > capacity
        {
            return Err(ErrorKind::AggregateTooLarge { slots, capacity }.into());
        }
        self.check_room_for(slots)?;
        Ok((members.len(), table))
    }

    /// Batching (off by default): while on, the messages of this end's
    /// operations are not necessarily visible to the peer when the
    /// operation returns; they are published in batches, each with one
    /// shared-memory publication and at most one wake-up — at the latest by
    /// [`flush`](Channel::flush), by a [`poll`](Channel::poll) that finds
    /// nothing to deliver, by [`wait`](Channel::wait), when the queue is
    /// full or 32 messages are waiting, by a teardown, and when the channel
    /// is closed or dropped. (A shared-memory end may publish sooner, e.g.
    /// an answer the peer waits for: where batches end depends on timing.)
    /// Messages held back stay so while this end makes none of these
    /// calls: flush before waiting on anything other than the channel.
    /// Turning it off flushes. Nothing else changes: every operation still
    /// checks, changes states and fails as without batching.
    /// `NotConnected` before the channel is connected.
    pub fn set_batching(&mut self, on: bool) -> Result<()> {
        match self.link.as_mut() {
            Some(link) => {
                link.set_batching(on);
                Ok(())
            }
            None => Err(ErrorKind::NotConnected(self.state).into()),
        }
    }

    /// Send what this end has queued for the peer, without taking any
    /// arrival: the messages held back by batching
    /// ([`set_batching`](Channel::set_batching)). The TCP backend always
    /// batches (it sends when the channel is polled or waited on, or a batch
    /// is full); `flush` is for a caller that sends and then does not poll
    /// for a while.
    pub fn flush(&mut self) -> Result<()> {
        if !matches!(self.state, ChannelState::Connected | ChannelState::Teardown) {
            return Ok(());
        }
        self.flush_deferred();
        self.flush_outbox();
        self.link_mut().flush()
    }

    pub(super) fn check_sendable_any(&self) -> Result<()> {
        match self.state {
            ChannelState::Connected => Ok(()),
            ChannelState::Teardown => Err(ErrorKind::TearingDown.into()),
            s => Err(ErrorKind::NotConnected(s).into()),
        }
    }

    fn check_sendable(&self, dir: Direction) -> Result<()> {
        self.check_sendable_any()?;
        if self.direction != dir {
            return Err(ErrorKind::WrongDirection.into());
        }
        Ok(())
    }

    pub(super) fn check_pool(&self, pool: PoolId) -> Result<()> {
        match self.pools.iter().find(|p| p.id == pool && p.listed) {
            Some(p) if p.removing => Err(ErrorKind::PoolRemovalPending(pool).into()),
            Some(_) => Ok(()),
            None => Err(ErrorKind::PoolNotAssigned(pool).into()),
        }
    }

    fn check_meta(&self, len: usize) -> Result<()> {
        if len > self.meta_size {
            return Err(ErrorKind::MetaTooLarge { len, max: self.meta_size }.into());
        }
        Ok(())
    }

    pub(super) fn check_room(&mut self) -> Result<()> {
        if !self.outbox.is_empty() {
            self.flush_outbox();
        }
        if !self.outbox.is_empty() || !self.link_mut().has_room() {
            self.room_refused = true;
            self.room_needed = 1;
            self.inspect.counters.queue_full();
            return Err(ErrorKind::QueueFull.into());
        }
        Ok(())
    }

    /// Room for `slots` messages in a row (an aggregate run).
    fn check_room_for(&mut self, slots: usize) -> Result<()> {
        self.check_room()?;
        if self.link_mut().room() < slots {
            self.room_refused = true;
            self.room_needed = slots;
            self.inspect.counters.queue_full();
            return Err(ErrorKind::QueueFull.into());
        }
        self.room_needed = 1;
        Ok(())
    }

    /// Preconditions of move, pass and the destination of a full copy.
    #[inline(always)]
    fn check_transfer(&mut self, dir: Direction, buffer: &Buffer, meta_len: usize) -> Result<()> {
        self.check_sendable(dir)?;
        if buffer.domain_id() != self.domain.id() {
            return Err(ErrorKind::ForeignBuffer.into());
        }
        let id = buffer.id();
        self.check_pool(id.pool)?;
        if !buffer.is_read_write() {
            return Err(ErrorKind::CopiesOutstanding.into());
        }
        self.check_meta(meta_len)?;
        self.check_room()
    }

    /// Give an owned buffer away with `make(id, meta)` (checks done).
    fn send_owned(
        &mut self,
        buffer: Buffer,
        meta: &[u8],
        unfilled: bool,
        make: impl FnOnce(BufferId, Meta) -> Message,
    ) -> Result<(), Refused<Buffer>> {
        let id = buffer.id();
        // Between two ends of one domain the buffer stays the domain's (see
        // `Channel::same_domain`): its records do not change.
        if !self.same_domain {
            let lent = self.domain.lock().lend(id, self.key, self.lent.is_some());
            if let Err(e) = lent {
                return Err(Refused::new(e, buffer));
            }
        }
        let msg = make(id, Meta::new(meta).expect("meta checked"));
        let link = self.link_mut();
        let sent = if unfilled { link.send_unfilled(&msg) } else { link.send(&msg) };
        match sent {
            Ok(()) => {
                let op = if matches!(msg, Message::Move { .. }) { Op::Move } else { Op::Pass };
                self.count_sent(op, buffer.len());
                self.spares.keep(buffer);
                if let Some(lent) = &mut self.lent {
                    lent.insert(id);
                }
                Ok(())
            }
            Err(e) => {
                if !self.same_domain {
                    self.domain.lock().take_ownership(id);
                }
                Err(Refused::new(e, buffer))
            }
        }
    }

    /// Release one copy of `id` held via this channel (checks included).
    fn release_id(&mut self, id: BufferId) -> Result<()> {
        self.check_sendable(Direction::Rx)?;
        self.check_pool(id.pool)?;
        self.domain.lock().check_release(id, self.key, 0)?;
        // The state changes only once the release is on its way (a second
        // lock): until then the copy is held, and it stays held if the
        // send fails (the caller gets it back).
        self.send_release(id)?;
        self.domain.lock().copy_released_here(id, self.key);
        Ok(())
    }

    /// Send the release of a copy of `id` (checks done but the room).
    fn send_release(&mut self, id: BufferId) -> Result<()> {
        self.check_room()?;
        self.link_mut().send(&Message::Release { buf: id })?;
        self.count_sent(Op::Release, 0);
        Ok(())
    }

    /// Count an operation sent (one load and store per counter), and
    /// every 64 sends sample the depth of the outgoing queue.
    #[inline]
    pub(super) fn count_sent(&mut self, op: Op, bytes: usize) {
        if self.inspect.counters.sent(op, bytes as u64) {
            self.sample_queue();
        }
    }

    /// Record how full the outgoing queue is, where the backend can say
    /// without sending anything.
    pub(super) fn sample_queue(&mut self) {
        if let Some(link) = self.link.as_mut() {
            if let Some(queued) = link.queued() {
                self.inspect.counters.sample_queue(queued, link.capacity());
            }
        }
    }

    /// Release copies whose handles were dropped; keep those that cannot go
    /// yet (forwarded copies still out, queue full).
    #[inline]
    pub(super) fn flush_deferred(&mut self) {
        // The flag stays set while any channel of the domain has deferred
        // releases; only then is the domain lock worth taking (and the call).
        if self.domain.shared.has_deferred.load(Ordering::Acquire) {
            self.flush_deferred_now();
        }
    }

    /// Two domain locks however many copies were dropped: one to take
    /// them and check each as [`release`](Channel::release) would, in
    /// order (a copy counts as released for the checks of the copies after
    /// it), one to record what went. In between, nothing else can release
    /// or forward these copies (their handles are gone, and only this end
    /// releases copies held via it); a forwarded copy coming back meanwhile
    /// only makes one wait for the next flush.
    fn flush_deferred_now(&mut self) {
        let key = self.key;
        let mut batch = std::mem::take(&mut self.deferred);
        {
            let mut st = self.domain.lock();
            st.take_deferred_each(key, |id| batch.push((id, Deferred::Send)));
            for i in 0..batch.len() {
                let id = batch[i].0;
                let already = batch[..i].iter().filter(|&&(p, d)| p == id && d == Deferred::Send).count() as u32;
                let verdict = self
                    .check_sendable(Direction::Rx)
                    .and_then(|()| self.check_pool(id.pool))
                    .and_then(|()| st.check_release(id, key, already));
                if let Err(e) = verdict {
                    batch[i].1 = Deferred::refused(&e);
                }
            }
        }
        for (id, what) in &mut batch {
            if *what == Deferred::Send {
                *what = self.send_release(*id).map_or_else(|e| Deferred::refused(&e), |()| Deferred::Gone);
            }
        }
        // Clear the flag under the lock: a copy dropped meanwhile pushes its
        // entry under the same lock and sets the flag after it.
        let mut st = self.domain.lock();
        for (id, what) in batch.drain(..) {
            match what {
                Deferred::Keep => {
                    st.defer_release(key, id);
                }
                _ => st.copy_released_here(id, key),
            }
        }
        st.settle_pinned();
        if st.nothing_pending() {
            self.domain.shared.has_deferred.store(false, Ordering::Release);
        }
        drop(st);
        self.deferred = batch;
    }

    #[inline]
    pub(super) fn flush_outbox(&mut self) {
        if !self.outbox.is_empty() {
            self.flush_outbox_now();
        }
    }

    fn flush_outbox_now(&mut self) {
        while let Some(msg) = self.outbox.front() {
            let link = self.link.as_mut().expect("connected");
            if !link.has_room() {
                return;
            }
            if link.send(msg).is_err() {
                return;
            }
            self.outbox.pop_front();
        }
    }

    /// Queue an answer generated while delivering. A side that has sent its
    /// teardown marker sends nothing more: callers check that first.
    pub(super) fn reply(&mut self, msg: Message) {
        debug_assert!(!self.sent_teardown || msg == Message::Teardown);
        self.outbox.push_back(msg);
        self.flush_outbox();
    }
}

/// What becomes of a dropped copy in [`Channel::flush_deferred`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Deferred {
    /// Its release may go (checked, not sent yet).
    Send,
    /// Released, or gone with a channel no longer connected.
    Gone,
    /// It waits for the next flush: forwarded copies still out, or the
    /// queue full.
    Keep,
}

impl Deferred {
    /// The copy's fate when its release was refused with `e`.
    fn refused(e: &Error) -> Deferred {
        if matches!(e.kind(), ErrorKind::CopiesForwarded | ErrorKind::QueueFull) {
            Deferred::Keep
        } else {
            // Channel no longer connected: the copy is simply gone.
            Deferred::Gone
        }
    }
}
