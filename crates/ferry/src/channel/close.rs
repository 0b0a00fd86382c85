//! Closing: teardown, the abrupt close of a dropped end, a peer that
//! dies, and the buffers that come back.

use super::{Channel, Event};
use crate::aggregate::Held;
use crate::buffer::{BufferCopy, Spares};
use crate::error::{Error, Result, ResultExt};
use crate::pool::PoolId;
use crate::proto::Message;
use crate::setup::ChannelState;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Channel {
    /// Start a teardown: no new messages from this end; messages in transit
    /// are still delivered; [`Event::Closed`] once the peer's marker arrives.
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
    /// tx.teardown()?;
    /// assert_eq!(tx.move_buffer(alloc.alloc().unwrap(), &[]).unwrap_err().error, ErrorKind::TearingDown);
    /// // The move sent before still arrives, then the close.
    /// assert!(matches!(rx.wait(Some(t)), Ok(Event::MoveReceived { .. })));
    /// assert!(matches!(rx.wait(Some(t)), Ok(Event::Closed { by_peer: true })));
    /// assert!(matches!(tx.wait(Some(t)), Ok(Event::Closed { by_peer: false })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn teardown(&mut self) -> Result<()> {
        self.teardown_bare().context(|| format!("tear down {}", self.name))
    }

    /// [`Channel::teardown`], its errors without context.
    fn teardown_bare(&mut self) -> Result<()> {
        self.flush_deferred();
        self.check_sendable_any()?;
        self.check_room()?;
        self.link_mut().send(&Message::Teardown)?;
        self.sent_teardown = true;
        self.state = ChannelState::Teardown;
        self.inspect.update(|i| i.state = ChannelState::Teardown);
        Ok(())
    }

    /// Closed for good: give the pools and deferred copies up. Replies still
    /// waiting for queue room go out with the close.
    pub(super) fn close(&mut self) {
        self.close_with(Vec::new());
    }

    fn close_with(&mut self, mut last: Vec<Message>) {
        // An aggregate run cut short by the close: its buffers go back now.
        drop(self.assembling.take());
        self.state = ChannelState::Closed;
        self.inspect.update(|i| i.state = ChannelState::Closed);
        let mut pending: Vec<Message> = self.outbox.drain(..).collect();
        pending.append(&mut last);
        if let Some(link) = self.link.as_mut() {
            link.close(pending);
            // Nothing of the link wakes a closed end: its fd stays quiet
            // (a peer's hang-up or last ring would keep it readable).
            link.unregister(&self.wake);
        }
        let cross = self.link.as_ref().is_some_and(|l| l.peer_can_die());
        // What the peer process still holds of what we lent it is its own
        // now; it comes back if that process exits (see `LendingWatch`).
        let watch = match (self.lent.take(), self.link.as_ref().and_then(|l| l.peer_process())) {
            (Some(lent), Some(peer)) => Some((peer, lent)),
            _ => None,
        };
        let related: Vec<PoolId> =
            self.pools.drain(..).map(|p| p.id).chain(self.requests.drain(..).map(|r| r.pool)).collect();
        // A closed end keeps nothing of its pools (it may live on unused).
        if let Some(link) = self.link.as_mut() {
            for &pool in &related {
                link.forget_pool(pool);
            }
        }
        self.spares = Spares::default();
        let mut st = self.domain.lock();
        if let Some((peer, lent)) = watch {
            st.watch_lending(self.key, peer, lent);
        }
        st.forget_channel(self.key, cross);
        for &pool in &related {
            if let Some(e) = st.entry_mut(pool) {
                e.channels -= 1;
            }
        }
        // The pools this channel was the last reference to leave the list
        // (dropped after the lock: unmapping takes a while).
        let gone: Vec<_> = related.into_iter().filter_map(|pool| st.release_if_unused(pool)).collect();
        drop(st);
        drop(gone);
    }

    /// The peer process exited: what we lent it and it still had is ours
    /// again (to the free list), and the copies it held are void. What it
    /// passed on to a third process stays there (the pool's ledger says so).
    pub(super) fn reclaim_from_dead_peer(&mut self) {
        let mut st = self.domain.lock();
        st.reclaim_lent(self.key, self.lent.take().unwrap_or_default());
        if !st.nothing_pending() {
            self.domain.shared.has_deferred.store(true, Ordering::Release);
        }
    }

    pub(super) fn fail(&mut self, e: Error) -> Event {
        self.inspect.counters.error();
        if self.link.as_mut().is_some_and(|l| l.abandon()) {
            self.reclaim_from_dead_peer();
        }
        self.close();
        Event::Error(e)
    }
}

impl Channel {
    /// At drop: a copy nobody saw goes back, now if the queue has room,
    /// otherwise with the close (in `last`).
    fn release_unseen_event(&mut self, ev: Event, last: &mut Vec<Message>) {
        match ev {
            Event::CopyReceived { copy, .. } => self.release_unseen(copy, last),
            Event::Aggregate { agg, .. } => {
                // Nobody saw it: each member handle is the only one.
                for held in agg.into_parts().members.into_iter().flatten() {
                    if let Ok(Held::Copy(copy)) = Arc::try_unwrap(held) {
                        self.release_unseen(copy, last);
                    }
                }
            }
            _ => {}
        }
    }

    fn release_unseen(&mut self, copy: BufferCopy, last: &mut Vec<Message>) {
        if let Err(refused) = self.release(copy) {
            let copy = refused.into_inner();
            let id = copy.id();
            copy.consume();
            self.domain.lock().copy_released_here(id, self.key);
            last.push(Message::Release { buf: id });
        }
    }
}

impl Drop for Channel {
    /// Dropping a live channel is an abrupt close: messages already queued
    /// to us are taken in (moved and passed buffers become ours and go to the
    /// free list; copies never seen are released again), then the peer
    /// learns that we are gone.
    fn drop(&mut self) {
        if !matches!(self.state, ChannelState::Connected | ChannelState::Teardown) {
            return;
        }
        let mut last = Vec::new();
        // Events a helper took and nobody polled are unseen too.
        for ev in std::mem::take(&mut self.helpers.held) {
            self.release_unseen_event(ev, &mut last);
        }
        while let Ok(Some(msg)) = self.recv() {
            match self.take(msg) {
                Ok(Some(ev)) => self.release_unseen_event(ev, &mut last),
                Ok(None) => {}
                Err(_) => break,
            }
            if self.state == ChannelState::Closed {
                return;
            }
        }
        // An aggregate run cut short by the drop: its copies go back too.
        if let Some(a) = self.assembling.take() {
            for held in a.held {
                if let Held::Copy(copy) = held {
                    self.release_unseen(copy, &mut last);
                }
            }
        }
        self.close_with(last);
    }
}
