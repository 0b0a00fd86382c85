//! Pools whose memory the two ends of a local or shared-memory link do not
//! share, so the link carries the bytes of their buffers.
//!
//! Normally both ends of such a link map the same memory of a pool, and a
//! buffer crosses as a descriptor alone. Two cases break that:
//!
//! - trust NONE on shm: each end keeps memory of its own, and the peer may
//!   only read it (see `shm.rs`);
//! - a pool that reached the two ends along different ways: one end got it
//!   over TCP (its own mirror of the pool) or from another process, and the
//!   other end has other memory under the same pool id. The end that learns
//!   of it — the one offered a pool it already has, when the peer's memory
//!   is not its own — keeps both memories here and *writes back*: it copies
//!   a buffer in from the peer's memory when the buffer arrives, and out
//!   into the peer's memory before it gives the buffer away. The other end
//!   does nothing special: whenever it holds a buffer, its own memory has
//!   the bytes.

use crate::ErrorKind;
use std::sync::Arc;

use crate::error::Result;
use crate::pool::BufferId;
use crate::pool::{Geometry, PoolId, PoolMap, PoolMemory};
use crate::proto::Message;
use crate::sys::{self, Access, Mapping};

/// One pool whose memory differs at the two ends of a link.
pub(crate) struct UnsharedPool {
    geometry: Geometry,
    /// Our memory of the pool, writable (arriving bytes land here).
    own: Mapping,
    /// The peer's memory of the pool: read-only under trust NONE (and only
    /// once the peer sent it), writable when we write back.
    peer: Option<Mapping>,
    /// We copy a buffer's bytes into the peer's memory when we give it away.
    write_back: bool,
    /// Trust NONE: the peer has our read-only fd of `memory`.
    pub(crate) shared: bool,
    /// The memory `own` maps.
    pub(crate) memory: Arc<PoolMemory>,
}

impl UnsharedPool {
    /// Our memory of a pool on a link of trust NONE; the peer's (read-only)
    /// memory comes later ([`UnsharedPool::set_peer`]).
    pub(crate) fn untrusted(memory: &Arc<PoolMemory>) -> Result<Self> {
        Ok(UnsharedPool {
            geometry: memory.geometry(),
            own: memory.map(Access::ReadWrite, 1)?,
            peer: None,
            write_back: false,
            shared: false,
            memory: memory.clone(),
        })
    }

    /// Our memory and the peer's, which differ, on a link whose ends trust
    /// each other to write (FULL, HALF): we write back.
    pub(crate) fn write_back(memory: &Arc<PoolMemory>, peer: &PoolMemory) -> Result<Self> {
        if peer.geometry() != memory.geometry() {
            return Err(
                ErrorKind::Protocol(format!("pool {}: the peer's memory has another geometry", memory.id())).into()
            );
        }
        Ok(UnsharedPool {
            geometry: memory.geometry(),
            own: memory.map(Access::ReadWrite, 1)?,
            peer: Some(peer.map(Access::ReadWrite, 1)?),
            write_back: true,
            shared: true,
            memory: memory.clone(),
        })
    }

    /// Whether the peer's memory is mapped.
    pub(crate) fn has_peer(&self) -> bool {
        self.peer.is_some()
    }

    /// Map the peer's memory read-only (trust NONE: it sent it with the
    /// first buffer of the pool).
    pub(crate) fn set_peer(&mut self, peer: &PoolMemory) -> Result<()> {
        if peer.geometry() != self.geometry {
            return Err(
                ErrorKind::Protocol(format!("pool {}: the peer's memory has another geometry", peer.id())).into()
            );
        }
        self.peer = Some(Mapping::map_shared(sys::borrow(peer.fd()), self.geometry.len(), Access::Read, 1)?);
        Ok(())
    }

    /// Keep the peer's mapping of `old` (trust NONE: the peer's memory did
    /// not change when ours did).
    pub(crate) fn take_peer_from(&mut self, old: UnsharedPool) {
        self.peer = old.peer;
    }

    /// Copy buffer `index` from the peer's memory into ours. The channel's
    /// payload gate has admitted it (on the channel, in range, not held by
    /// any domain of this process).
    pub(crate) fn copy_in(&self, index: u32) -> Result<()> {
        let peer = self
            .peer
            .as_ref()
            .ok_or_else(|| ErrorKind::Protocol("a buffer arrived before its pool's memory".into()))?;
        self.check(index)?;
        Ok(sys::copy_buffer(peer, &self.own, index, self.geometry.buffer_size())?)
    }

    /// Before buffer `index` goes to the peer: copy it into the peer's
    /// memory if we write back (no one of the peer's process holds it: we
    /// own it or hold a copy, and the buffer is not writable by anyone).
    pub(crate) fn copy_out(&self, index: u32) -> Result<()> {
        let Some(peer) = self.peer.as_ref().filter(|_| self.write_back) else { return Ok(()) };
        self.check(index)?;
        Ok(sys::copy_buffer(&self.own, peer, index, self.geometry.buffer_size())?)
    }

    fn check(&self, index: u32) -> Result<()> {
        if index >= self.geometry.count() {
            return Err(ErrorKind::Protocol(format!("buffer index {index} out of range")).into());
        }
        Ok(())
    }
}

/// The buffer a message carries, if it is a move, pass or copy.
pub(crate) fn carried(msg: &Message) -> Option<BufferId> {
    match msg {
        Message::Move { buf, .. } | Message::Copy { buf, .. } | Message::Pass { buf, .. } => Some(*buf),
        _ => None,
    }
}

/// The write-back pools of a link at trust FULL or HALF (local and shm).
#[derive(Default)]
pub(crate) struct WriteBack {
    pools: PoolMap<UnsharedPool>,
}

impl WriteBack {
    /// The peer offered a pool we already have: `ours` is our memory of it,
    /// `peers` the peer's. The same memory needs nothing; other memory is
    /// kept here, so the link carries the bytes of its buffers.
    pub(crate) fn offered(&mut self, ours: &Arc<PoolMemory>, peers: &PoolMemory) -> Result<()> {
        if ours.same_memory(peers) {
            self.pools.remove(&ours.id());
        } else {
            self.pools.insert(ours.id(), UnsharedPool::write_back(ours, peers)?);
        }
        Ok(())
    }

    /// We took the peer's memory of a pool as ours: nothing to carry.
    pub(crate) fn imported(&mut self, memory: &PoolMemory) {
        if !self.pools.is_empty() {
            self.pools.remove(&memory.id());
        }
    }

    /// The channel no longer has pool `id`: drop both mappings.
    pub(crate) fn forget(&mut self, id: PoolId) {
        if !self.pools.is_empty() {
            self.pools.remove(&id);
        }
    }

    /// `msg` is about to go to the peer: a buffer of a write-back pool goes
    /// into the peer's memory first.
    #[inline]
    pub(crate) fn depart(&self, msg: &Message) -> Result<()> {
        if self.pools.is_empty() {
            return Ok(());
        }
        match carried(msg).and_then(|buf| self.pools.get(&buf.pool).map(|p| (p, buf.index))) {
            Some((pool, index)) => pool.copy_out(index),
            None => Ok(()),
        }
    }

    /// `msg` arrived from the peer: a buffer of a write-back pool is copied
    /// into our memory, if the channel's gate lets it land.
    #[inline]
    pub(crate) fn arrive(&self, msg: &Message, gate: &mut dyn super::PayloadGate) -> Result<()> {
        if self.pools.is_empty() {
            return Ok(());
        }
        if let Some((pool, index)) = carried(msg).and_then(|buf| self.pools.get(&buf.pool).map(|p| (p, buf.index))) {
            if gate.admit(msg)? == super::Landing::Land {
                pool.copy_in(index)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memories() -> (Arc<PoolMemory>, Arc<PoolMemory>) {
        let g = Geometry::new(4096, 4).unwrap();
        let ours = PoolMemory::create(g).unwrap();
        let peers = PoolMemory::mirror(ours.id(), g, None).unwrap();
        (ours, peers)
    }

    fn write(memory: &PoolMemory, index: u32, byte: u8) {
        let map = memory.map(Access::ReadWrite, 1).unwrap();
        let size = memory.geometry().buffer_size();
        // SAFETY: test-only: the range is inside the mapping, and nothing
        // else in this test touches the buffer meanwhile.
        unsafe { std::ptr::write_bytes(map.as_ptr().add(index as usize * size), byte, size) };
    }

    fn read(memory: &PoolMemory, index: u32) -> Vec<u8> {
        let map = memory.map(Access::Read, 1).unwrap();
        let size = memory.geometry().buffer_size();
        // SAFETY: test-only: the range is inside the mapping.
        unsafe { std::slice::from_raw_parts(map.as_ptr().add(index as usize * size), size) }.to_vec()
    }

    fn mv(pool: PoolId, index: u32) -> Message {
        Message::Move { buf: BufferId { pool, index }, meta: crate::proto::Meta::new(&[]).unwrap() }
    }

    struct Admit(super::super::Landing);

    impl super::super::PayloadGate for Admit {
        fn admit(&mut self, _msg: &Message) -> Result<super::super::Landing> {
            Ok(self.0)
        }
    }

    #[test]
    fn the_same_memory_carries_nothing() {
        let (ours, _) = memories();
        let again = PoolMemory::from_peer(ours.id(), ours.geometry(), ours.fd().try_clone().unwrap(), None).unwrap();
        let mut wb = WriteBack::default();
        wb.offered(&ours, &again).unwrap();
        assert!(wb.pools.is_empty());
    }

    #[test]
    fn other_memory_is_written_back_and_copied_in() {
        let (ours, peers) = memories();
        let mut wb = WriteBack::default();
        wb.offered(&ours, &peers).unwrap();
        // Leaving: our bytes go into the peer's memory.
        write(&ours, 1, 0xab);
        wb.depart(&mv(ours.id(), 1)).unwrap();
        assert!(read(&peers, 1).iter().all(|&b| b == 0xab));
        assert!(read(&peers, 0).iter().all(|&b| b == 0), "other buffers are untouched");
        // Arriving: the peer's bytes come into ours, if the gate lets them.
        write(&peers, 2, 0xcd);
        wb.arrive(&mv(ours.id(), 2), &mut Admit(super::super::Landing::Discard)).unwrap();
        assert!(read(&ours, 2).iter().all(|&b| b == 0), "a discarded payload does not land");
        wb.arrive(&mv(ours.id(), 2), &mut Admit(super::super::Landing::Land)).unwrap();
        assert!(read(&ours, 2).iter().all(|&b| b == 0xcd));
        // Out of range is a protocol error, not a stray write.
        assert!(matches!(wb.depart(&mv(ours.id(), 4)).as_ref().map_err(|e| e.kind()), Err(ErrorKind::Protocol(_))));
        // Importing the peer's memory ends it.
        wb.imported(&ours);
        assert!(wb.pools.is_empty());
    }
}
