//! One channel end on a session: the `Link` the channel drives.

use crate::ErrorKind;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::codec::{MuxHead, FLAG_ABORT, FLAG_PAYLOAD, K_CREDIT, K_MESSAGE, MSG_HEAD};
use super::session::{Inner, OutMsg, Span, CLOSE_FLUSH};
use super::wire::poll_out;
use super::MuxSession;
use crate::backend::{Link, LinkStats, PayloadGate};
use crate::error::Result;
use crate::pool::{Geometry, PoolId, PoolMemory};
use crate::proto::{self, Message};
use crate::wake::{Arm, Interest, WakeSet};

/// One channel end on a session.
pub(super) struct MuxLink {
    pub(super) session: MuxSession,
    pub(super) id: u32,
    pub(super) closed: bool,
    /// Grant credit after this many messages taken.
    pub(super) grant_every: usize,
    /// The channel's queue depth (its credit): the longest run of messages
    /// that can ever be queued at once.
    pub(super) depth: usize,
    pub(super) died: bool,
    /// The counters as they were when the channel closed.
    pub(super) final_stats: LinkStats,
    /// What the channel's wake set watches the session's socket for
    /// (`None`: not known).
    pub(super) watching: Option<Interest>,
}

impl MuxLink {
    pub(super) fn new(session: MuxSession, id: u32) -> MuxLink {
        let depth = session.lock().chans.get(&id).map_or(1, |c| c.depth);
        MuxLink {
            session,
            id,
            closed: false,
            grant_every: (depth / 4).max(1),
            depth,
            died: false,
            final_stats: LinkStats::default(),
            watching: None,
        }
    }
}

impl Link for MuxLink {
    fn queued(&mut self) -> Option<usize> {
        // The channel's messages the session has not written yet, the one
        // whose payload is going out included.
        let inner = self.session.lock();
        Some(inner.chans.get(&self.id).map_or(0, |c| c.outq.len() + usize::from(c.sending.is_some())))
    }

    fn peer(&self) -> String {
        self.session.peer_addr().map(|a| a.to_string()).unwrap_or_default()
    }

    fn has_room(&mut self) -> bool {
        self.room() > 0
    }

    fn room(&mut self) -> usize {
        let mut inner = self.session.lock();
        let room = |inner: &Inner| inner.chans.get(&self.id).map_or(0, |c| c.depth.saturating_sub(c.outq.len()));
        // An empty queue has all the room there is: nothing to write for it
        // (the send that follows writes anyway).
        if inner.chans.get(&self.id).is_some_and(|c| c.outq.is_empty()) {
            return room(&inner);
        }
        let _ = inner.pump_write();
        if room(&inner) == 0 {
            // The queue may wait for the peer's read reports: read them
            // (a sender that never polls must not stall).
            let _ = inner.pump_read(None);
        }
        room(&inner)
    }

    fn capacity(&self) -> usize {
        self.depth
    }

    fn send(&mut self, msg: &Message) -> Result<()> {
        self.queue(msg, true, false)
    }

    fn send_unfilled(&mut self, msg: &Message) -> Result<()> {
        self.queue(msg, false, false)
    }

    fn recv(&mut self, gate: &mut dyn PayloadGate) -> Result<Option<Message>> {
        let mut guard = self.session.lock();
        let inner = &mut *guard;
        let id = self.id;
        let was_armed = {
            let chan = inner.chans.get_mut(&id).ok_or(ErrorKind::PeerGone)?;
            if chan.gate.is_none() {
                chan.gate = gate.detach();
            }
            // What this poll lands for the channel it takes itself: no
            // ringing its own doorbell (an eventfd write now, a read at the
            // next `arm`, and a wake-up for nothing). Still armed after it,
            // so that another channel's poll rings it as before.
            std::mem::replace(&mut chan.armed, false)
        };
        let read = inner.pump_read(Some(id));
        let chan = inner.chans.get_mut(&id).ok_or(ErrorKind::PeerGone)?;
        chan.armed |= was_armed;
        if let Some((msg, landed)) = chan.inq.pop_front() {
            chan.consumed += 1;
            if landed {
                // The channel's own gate, with the pools it lists now.
                if let Err(e) = gate.admit(&msg) {
                    return Err(inner.fail(e, false));
                }
            }
            if chan.consumed >= self.grant_every && chan.peer_closed.is_none() {
                let n = std::mem::take(&mut chan.consumed);
                chan.allowed += n;
                // A session this cuts off reports it on the next call: the
                // message taken here is the application's all the same.
                // The grant goes out with the next write: what the
                // application sends now (a reply, say), or the write of
                // its next poll that finds nothing, or of its `arm`. One
                // system call and one wake-up of the peer, not two. But a
                // grant waits behind no other: an application that takes
                // message after message and writes nothing keeps its peer
                // at most one grant short.
                let waiting = inner.ctrl_waiting(K_CREDIT, id);
                if inner.queue_ctrl(K_CREDIT, id, Vec::new(), n as u32).is_ok() && waiting {
                    let _ = inner.pump_write();
                }
            }
            return Ok(Some(msg));
        }
        let ended = match chan.peer_closed {
            Some(abort) if chan.incoming.is_none() => Some((ErrorKind::PeerGone.into(), abort)),
            _ => inner.gone.clone(),
        };
        if let Some((e, died)) = ended {
            self.died = died;
            return Err(e);
        }
        read?;
        inner.pump_write()?;
        inner.tick()?;
        Ok(None)
    }

    fn flush(&mut self) -> Result<()> {
        let mut inner = self.session.lock();
        // A peer end that died takes nothing more. One that closed after
        // the teardown handshake is not gone: its answer may still wait in
        // this channel's queue for `recv`, and nothing is left to send it.
        if inner.chans.get(&self.id).and_then(|c| c.peer_closed) == Some(true) {
            return Err(ErrorKind::PeerGone.into());
        }
        inner.pump_write()
    }

    fn register(&mut self, wake: &WakeSet) -> Result<()> {
        let inner = self.session.lock();
        let chan = inner.chans.get(&self.id).ok_or(ErrorKind::PeerGone)?;
        wake.watch(chan.bell.fd().as_fd(), Interest::Read)?;
        self.watching = None;
        wake.watch(inner.stream.as_fd(), Interest::Read)?;
        self.watching = Some(Interest::Read);
        Ok(())
    }

    fn set_gate(&mut self, gate: Box<dyn PayloadGate + Send>) {
        if let Some(chan) = self.session.lock().chans.get_mut(&self.id) {
            chan.gate = Some(gate);
        }
    }

    fn unregister(&mut self, wake: &WakeSet) {
        let inner = self.session.lock();
        if let Some(chan) = inner.chans.get(&self.id) {
            wake.unwatch(chan.bell.fd().as_fd());
        }
        wake.unwatch(inner.stream.as_fd());
        self.watching = None;
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let mut guard = self.session.lock();
        let inner = &mut *guard;
        // A socket the last read found empty need not be read again: the
        // wake set watches it, so whatever came meanwhile wakes it at once.
        if !inner.dry && inner.pump_read(Some(self.id)).is_err() {
            return Arm::Ready;
        }
        let Some(chan) = inner.chans.get_mut(&self.id) else { return Arm::Ready };
        if !chan.inq.is_empty() || chan.peer_closed.is_some() || inner.gone.is_some() {
            return Arm::Ready;
        }
        if std::mem::take(&mut chan.rung) {
            let _ = chan.bell.reset();
        }
        chan.armed = true;
        match inner.arm_socket(wake, &mut self.watching) {
            Some(until) => Arm::Sleep { until: Some(until) },
            None => Arm::Ready,
        }
    }

    fn export_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        self.session.lock().register(self.id, memory)
    }

    fn import_pool(&mut self, id: PoolId, geometry: Geometry) -> Result<Arc<PoolMemory>> {
        let memory = PoolMemory::mirror(id, geometry, None)?;
        self.session.lock().register(self.id, &memory)?;
        Ok(memory)
    }

    fn use_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        self.session.lock().register(self.id, memory)
    }

    fn forget_pool(&mut self, id: PoolId) {
        // Frames still queued hold the pool's mapping themselves.
        if let Some(chan) = self.session.lock().chans.get_mut(&self.id) {
            chan.pools.remove(&id);
            chan.copied_in.retain(|b| b.pool != id);
        }
    }

    fn close(&mut self, last: Vec<Message>) {
        if self.closed {
            return;
        }
        self.closed = true;
        for msg in &last {
            if self.queue(msg, true, true).is_err() {
                break;
            }
        }
        let id = self.id;
        let mut inner = self.session.lock();
        if let Some(chan) = inner.chans.get_mut(&id) {
            chan.close_queued.get_or_insert(0);
            chan.detached = true;
        }
        let deadline = Instant::now() + CLOSE_FLUSH.min(inner.options.peer_timeout);
        // Waited on without the lock: the other channels go on meanwhile.
        let Ok(stream) = inner.stream.try_clone() else { return };
        drop(inner);
        loop {
            let mut inner = self.session.lock();
            if inner.pump_write().is_err() || inner.pump_read(None).is_err() {
                break;
            }
            let Some(chan) = inner.chans.get(&id) else { break };
            self.final_stats = chan.stats;
            if chan.close_sent && inner.wire.is_empty() && !inner.tls_unsent() {
                if chan.peer_closed.is_some() {
                    inner.chans.remove(&id);
                }
                break;
            }
            let out = inner.wants_write();
            drop(inner);
            let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
            let _ = poll_out(&stream, out, left.min(Duration::from_millis(50)));
        }
    }

    fn peer_can_die(&self) -> bool {
        true
    }

    fn abandon(&mut self) -> bool {
        if self.closed {
            return self.died;
        }
        self.closed = true;
        let mut inner = self.session.lock();
        if let Some((_, died)) = inner.gone.clone() {
            self.died = died;
            return died;
        }
        if let Some(chan) = inner.chans.get_mut(&self.id) {
            chan.outq.clear();
            chan.sending = None;
            chan.close_queued = Some(FLAG_ABORT);
            chan.detached = true;
            if chan.peer_closed.is_some() {
                chan.close_queued = None;
                inner.chans.remove(&self.id);
            }
        }
        let _ = inner.pump_write();
        self.died = true;
        true
    }

    fn peer_died(&mut self) -> bool {
        self.died
    }

    fn stats(&self) -> Option<LinkStats> {
        Some(self.session.lock().chans.get(&self.id).map_or(self.final_stats, |c| c.stats))
    }
}

impl MuxLink {
    pub(super) fn queue(&mut self, msg: &Message, with_payload: bool, last: bool) -> Result<()> {
        let mut guard = self.session.lock();
        let inner = &mut *guard;
        inner.check()?;
        let chan = inner.chans.get_mut(&self.id).ok_or(ErrorKind::PeerGone)?;
        if chan.peer_closed.is_some() || chan.close_queued.is_some() {
            return Err(ErrorKind::PeerGone.into());
        }
        if !last && chan.outq.len() >= chan.depth {
            inner.pump_write()?;
            // Read reports may let held bulk go (see `room`).
            let _ = inner.pump_read(None);
            let chan = inner.chans.get_mut(&self.id).ok_or(ErrorKind::PeerGone)?;
            if chan.outq.len() >= chan.depth {
                return Err(ErrorKind::QueueFull.into());
            }
        }
        let chan = inner.chans.get_mut(&self.id).ok_or(ErrorKind::PeerGone)?;
        let mut h = [0u8; MSG_HEAD + proto::MAX_META_SIZE];
        msg.encode(&mut h);
        let meta = usize::from(u16::from_le_bytes([h[2], h[3]]));
        let mut payload = None;
        if let (true, Some(buf)) = (with_payload, msg.payload_buffer()) {
            let pool = chan
                .pools
                .get(&buf.pool)
                .ok_or_else(|| ErrorKind::Protocol(format!("pool {} unknown to the session", buf.pool)))?;
            let size = pool.geometry.buffer_size();
            h[1] |= FLAG_PAYLOAD;
            h[8..16].copy_from_slice(&(size as u64).to_le_bytes());
            payload = Some(Span { pool: pool.clone(), offset: buf.index as usize * size, len: size });
        }
        let head = MuxHead::new(K_MESSAGE, self.id, 0).frame(&h[..MSG_HEAD + meta]);
        chan.outq.push_back(OutMsg { head, payload, last });
        inner.pump_write()
    }
}

impl Drop for MuxLink {
    fn drop(&mut self) {
        if !self.closed {
            self.close(Vec::new());
        }
    }
}
