//! The local backend: both ends in one process (threads, or domains that
//! share a thread). Each direction is a single-producer/single-consumer
//! ring of `Message` values (`ring::value_pair`): the shared-memory
//! backend's ring protocol (counters, publication marks, batches, the
//! sleep and room handshakes, the closed bits) without its encoding into
//! bytes and checked decoding, which guard against a peer in another
//! process; here the peer is this process's own code. Pools travel as
//! `Arc`s of their memfd, so every domain maps the same memory: zero copy
//! by construction.

use crate::ErrorKind;
use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::unshared::WriteBack;
use super::{Link, Pending, PendingSetup, SetupDone};
use crate::error::{Error, Result};
use crate::pool::{Geometry, PoolId, PoolMemory, TrustLevel};
use crate::proto::{self, Message};
use crate::ring::{self, RingError, RingLayout, ValueConsumer, ValueProducer};
use crate::setup::{negotiate, BindParams, ChannelSetup, Negotiated};
use crate::wake::{Arm, Doorbell, Interest, WakeSet};

/// An in-process endpoint. Clones name the same endpoint.
#[derive(Debug, Clone, Default)]
pub struct LocalEndpoint {
    shared: Arc<EpShared>,
}

#[derive(Debug, Default)]
struct EpShared {
    state: Mutex<EpState>,
}

#[derive(Debug, Default)]
struct EpState {
    /// The creator's setup, once a channel is created here.
    setup: Option<ChannelSetup>,
    /// The creator's domain (see [`Link::same_domain`]).
    creator_domain: u64,
    /// Rung for the creator when a bind offer arrives (and, once
    /// connected, when its peer sends).
    creator: Option<Arc<Doorbell>>,
    /// A binder's offer, waiting for the creator to poll.
    offer: Option<Offer>,
    /// A binder was accepted: the endpoint is used up.
    connected: bool,
}

type Reply = Arc<Mutex<Option<Result<Negotiated>>>>;

#[derive(Debug)]
struct Offer {
    params: BindParams,
    creator_link: LocalLink,
    reply: Reply,
    binder: Arc<Doorbell>,
}

impl LocalEndpoint {
    /// A fresh endpoint.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EpState> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn listen(&self, setup: &ChannelSetup, domain: u64) -> Result<Pending> {
        if setup.trust == TrustLevel::None {
            // Within one address space nothing can be enforced against the
            // process itself; NONE needs separate processes (shm backend).
            return Err(ErrorKind::TrustNotSupported { trust: TrustLevel::None, backend: "local" }.into());
        }
        let mut st = self.lock();
        if st.setup.is_some() {
            return Err(ErrorKind::EndpointInUse.into());
        }
        let bell = Arc::new(Doorbell::new()?);
        st.setup = Some(*setup);
        st.creator_domain = domain;
        st.creator = Some(bell.clone());
        Ok(Box::new(CreatorPending { ep: self.shared.clone(), setup: *setup, bell }))
    }

    pub(crate) fn connect(&self, params: &BindParams, domain: u64) -> Result<Pending> {
        let mut st = self.lock();
        let (Some(setup), Some(creator_bell)) = (st.setup, st.creator.clone()) else {
            return Err(ErrorKind::EndpointNotListening.into());
        };
        if st.connected || st.offer.is_some() {
            return Err(ErrorKind::EndpointInUse.into());
        }
        // The byte ring's limits, so that a setup valid here is valid
        // over shared memory too.
        let layout = RingLayout::new(setup.queue_depth, proto::slot_size(setup.meta_size))
            .map_err(|_| ErrorKind::InvalidArgument("queue depth"))?;
        let (to_creator_tx, to_creator_rx) = ring::value_pair(layout.capacity());
        let (to_binder_tx, to_binder_rx) = ring::value_pair(layout.capacity());
        let binder_bell = Arc::new(Doorbell::new()?);
        let (to_creator_pools, to_binder_pools) = (Arc::default(), Arc::default());
        let meta = setup.meta_size;
        let (to_creator_last, to_binder_last) = (Arc::default(), Arc::default());
        let same_domain = st.creator_domain == domain;
        let creator_link = LocalLink {
            tx: to_binder_tx,
            rx: to_creator_rx,
            meta_size: meta,
            me: creator_bell.clone(),
            peer: binder_bell.clone(),
            exports: Arc::clone(&to_binder_pools),
            imports: Arc::clone(&to_creator_pools),
            last_out: Arc::clone(&to_binder_last),
            last_in: Arc::clone(&to_creator_last),
            batching: false,
            write_back: WriteBack::default(),
            same_domain,
        };
        let binder_link = LocalLink {
            tx: to_creator_tx,
            rx: to_binder_rx,
            meta_size: meta,
            me: binder_bell.clone(),
            peer: creator_bell.clone(),
            exports: to_creator_pools,
            imports: to_binder_pools,
            last_out: to_creator_last,
            last_in: to_binder_last,
            batching: false,
            write_back: WriteBack::default(),
            same_domain,
        };
        let reply: Reply = Arc::new(Mutex::new(None));
        st.offer = Some(Offer { params: *params, creator_link, reply: reply.clone(), binder: binder_bell.clone() });
        drop(st);
        creator_bell.ring();
        Ok(Box::new(BinderPending { reply, link: Some(binder_link), bell: binder_bell }))
    }
}

struct CreatorPending {
    ep: Arc<EpShared>,
    setup: ChannelSetup,
    bell: Arc<Doorbell>,
}

impl Drop for CreatorPending {
    /// A creator that gives up before a binder connected (its channel was
    /// dropped): the endpoint is free again, and a binder whose offer it
    /// never took learns that nobody listens any more.
    fn drop(&mut self) {
        let mut st = self.ep.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.connected {
            return;
        }
        st.setup = None;
        st.creator = None;
        if let Some(offer) = st.offer.take() {
            *offer.reply.lock().unwrap_or_else(|p| p.into_inner()) = Some(Err(ErrorKind::EndpointNotListening.into()));
            offer.binder.ring();
        }
    }
}

impl PendingSetup for CreatorPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        let mut st = self.ep.state.lock().unwrap_or_else(|p| p.into_inner());
        let offer = st.offer.take()?;
        let outcome = negotiate(&self.setup, &offer.params);
        let answer = outcome.map_err(|why| Error::from(ErrorKind::BindRefused(why)));
        *offer.reply.lock().unwrap_or_else(|p| p.into_inner()) = Some(answer.clone());
        offer.binder.ring();
        match answer {
            Ok(neg) => {
                st.connected = true;
                Some(Ok((Box::new(offer.creator_link), neg, true)))
            }
            // Refused: keep listening for another binder.
            Err(_) => None,
        }
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        if wake.watch(self.bell.fd().as_fd(), Interest::Read).is_err() {
            return Arm::Ready;
        }
        // Take an old ring before looking: an offer made after the look
        // rings again.
        self.bell.reset();
        if self.ep.state.lock().unwrap_or_else(|p| p.into_inner()).offer.is_some() {
            return Arm::Ready;
        }
        Arm::SLEEP
    }
}

struct BinderPending {
    reply: Reply,
    link: Option<LocalLink>,
    bell: Arc<Doorbell>,
}

impl PendingSetup for BinderPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        let answer = self.reply.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        Some(answer.map(|neg| {
            let link: Box<dyn Link> = Box::new(self.link.take().expect("polled once"));
            (link, neg, false)
        }))
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        if wake.watch(self.bell.fd().as_fd(), Interest::Read).is_err() {
            return Arm::Ready;
        }
        self.bell.reset();
        if self.reply.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
            return Arm::Ready;
        }
        Arm::SLEEP
    }
}

/// One end of a local channel. Its ring ends' counters are written for
/// every message, and the two ends of a channel are made side by side:
/// whole 128-byte blocks of its own keep each end's writes off the lines
/// (and adjacent-line pairs) the other end's core works on.
#[repr(align(128))]
pub(crate) struct LocalLink {
    tx: ValueProducer<Message>,
    rx: ValueConsumer<Message>,
    meta_size: usize,
    /// Rung by the peer when we sleep and it sends (or makes room we
    /// asked for), and the peer's.
    me: Arc<Doorbell>,
    peer: Arc<Doorbell>,
    /// Pools we exported, waiting for the peer to take them with our offer,
    /// and those the peer exported to us: each offer's entry is taken by
    /// its receiver, whether it imports, uses or declines the pool.
    exports: Stash,
    imports: Stash,
    /// Messages given to `close` that did not fit in the ring: ours to the
    /// peer, and the peer's to us (read after the ring is drained).
    last_out: Arc<Mutex<VecDeque<Message>>>,
    last_in: Arc<Mutex<VecDeque<Message>>>,
    /// Sends are published in batches (see `Link::set_batching`).
    batching: bool,
    /// Pools the peer has in other memory than ours (see `unshared`).
    write_back: WriteBack,
    /// The binder is of the creator's domain (see [`Link::same_domain`]).
    same_domain: bool,
}

impl std::fmt::Debug for LocalLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLink").field("meta_size", &self.meta_size).finish()
    }
}

impl LocalLink {
    fn ring_error(e: RingError) -> Error {
        match e {
            RingError::Full => ErrorKind::QueueFull.into(),
            RingError::Closed => ErrorKind::PeerGone.into(),
            // Not made by the value ring (it has no peer to distrust).
            other => ErrorKind::Protocol(format!("ring: {other}")).into(),
        }
    }

    /// Make the staged messages visible to the peer; wake it if it sleeps.
    fn publish(&mut self) {
        if self.tx.publish() {
            self.peer.ring();
        }
    }
}

impl LocalLink {
    /// The ring was empty: what we held back goes out, and a peer that
    /// closed may have left its last messages (in the ring, pushed just
    /// before it closed, or in `last_in`, those that did not fit).
    #[cold]
    fn recv_empty(&mut self) -> Result<Option<Message>> {
        if !self.rx.peer_closed() {
            // Nothing to do here for now: what we held back goes out.
            self.publish();
            return Ok(None);
        }
        if let Some(msg) = self.rx.try_pop() {
            return Ok(Some(msg));
        }
        match self.last_in.lock().unwrap_or_else(|p| p.into_inner()).pop_front() {
            Some(msg) => Ok(Some(msg)),
            None => Err(ErrorKind::PeerGone.into()),
        }
    }

    /// The memory the peer exported for pool `id`.
    fn exported(&mut self, id: PoolId, geometry: Geometry) -> Result<Arc<PoolMemory>> {
        let memory = self
            .take_import(id)
            .ok_or_else(|| ErrorKind::Protocol(format!("pool {id} was offered but not exported")))?;
        if memory.geometry() != geometry {
            return Err(
                ErrorKind::Protocol(format!("pool {id} offered with a geometry that differs from its memory")).into()
            );
        }
        Ok(memory)
    }
}

impl Link for LocalLink {
    fn same_domain(&self) -> bool {
        self.same_domain
    }

    fn queued(&mut self) -> Option<usize> {
        Some((self.tx.capacity() - self.tx.free_slots_now()) as usize)
    }

    fn peer(&self) -> String {
        "this process".to_owned()
    }

    fn has_room(&mut self) -> bool {
        if self.tx.free_slots() > 0 {
            return true;
        }
        // Full: whatever is held back must reach the consumer so it can
        // make room.
        self.publish();
        false
    }

    fn room(&mut self) -> usize {
        self.tx.free_slots_now() as usize
    }

    fn capacity(&self) -> usize {
        self.tx.capacity() as usize
    }

    fn send(&mut self, msg: &Message) -> Result<()> {
        // Copying out before we know the ring has room is harmless: if it
        // has none, the buffer stays ours and no one reads the peer's copy.
        self.write_back.depart(msg)?;
        self.tx.stage(|| msg.clone()).map_err(Self::ring_error)?;
        if super::publish_now(self.tx.staged(), self.batching, msg) {
            self.publish();
        }
        Ok(())
    }

    fn set_batching(&mut self, on: bool) {
        self.batching = on;
        if !on {
            self.publish();
        }
    }

    fn flush(&mut self) -> Result<()> {
        self.publish();
        Ok(())
    }

    fn recv(&mut self, gate: &mut dyn super::PayloadGate) -> Result<Option<Message>> {
        // A message in the ring first, straight to the caller (passing it
        // through `Option`s and `Result`s of helpers moved it several
        // times, 90 instructions a message).
        match self.rx.try_pop() {
            Some(msg) => {
                if self.rx.take_room_request() {
                    self.peer.ring();
                }
                self.write_back.arrive(&msg, gate)?;
                Ok(Some(msg))
            }
            None => self.recv_empty(),
        }
    }

    fn register(&mut self, wake: &WakeSet) -> Result<()> {
        Ok(wake.watch(self.me.fd().as_fd(), Interest::Read)?)
    }

    fn unregister(&mut self, wake: &WakeSet) {
        wake.unwatch(self.me.fd().as_fd());
    }

    fn spin(&mut self, spin: Duration) -> bool {
        self.publish();
        self.rx.spin_for_work(spin)
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        self.arm_for_room(wake, 1)
    }

    fn arm_for_room(&mut self, _wake: &WakeSet, slots: usize) -> Arm {
        self.publish();
        // Take an old ring before asking for anything: a ring after the
        // requests (for a message or for room) stays.
        self.me.reset();
        let slots = u32::try_from(slots).unwrap_or(u32::MAX).max(1);
        if self.tx.free_slots() < slots && !self.tx.want_room_for(slots) {
            return Arm::Ready;
        }
        let sleep = self.rx.prepare_sleep();
        if self.rx.take_room_request() {
            self.peer.ring();
        }
        if !sleep || self.rx.peer_closed() {
            self.rx.cancel_sleep();
            return Arm::Ready;
        }
        Arm::SLEEP
    }

    fn export_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        self.exports.lock().unwrap_or_else(|p| p.into_inner()).insert(memory.id(), memory.clone());
        Ok(())
    }

    fn import_pool(&mut self, id: PoolId, geometry: Geometry) -> Result<Arc<PoolMemory>> {
        let memory = self.exported(id, geometry)?;
        self.write_back.imported(&memory);
        Ok(memory)
    }

    fn use_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        // We have the pool already, maybe in other memory than the peer's
        // (one of us got it over TCP, or from another process).
        let peers = self.exported(memory.id(), memory.geometry())?;
        self.write_back.offered(memory, &peers)
    }

    fn forget_pool(&mut self, id: PoolId) {
        self.write_back.forget(id);
    }

    fn discard_pool(&mut self, id: PoolId) {
        self.take_import(id);
    }

    #[cfg(test)]
    fn private_memory(&self) -> Vec<(usize, usize)> {
        // The ring ends' counters live in the link itself.
        vec![(self as *const Self as usize, std::mem::size_of::<Self>())]
    }

    fn close(&mut self, last: Vec<Message>) {
        if !last.is_empty() {
            self.last_out.lock().unwrap_or_else(|p| p.into_inner()).extend(last);
        }
        // The peer reads `last_out` only once it sees us closed, so the
        // messages are in place before the flag goes up.
        self.tx.close();
        self.rx.close();
        self.peer.ring();
    }
}

impl LocalLink {
    /// The peer's export of pool `id`, taken out of the stash.
    fn take_import(&self, id: PoolId) -> Option<Arc<PoolMemory>> {
        self.imports.lock().unwrap_or_else(|p| p.into_inner()).remove(&id)
    }
}

/// Pools one end exported, waiting for the other end to take them.
type Stash = Arc<Mutex<HashMap<PoolId, Arc<PoolMemory>>>>;

impl Drop for LocalLink {
    fn drop(&mut self) {
        self.close(Vec::new());
    }
}
