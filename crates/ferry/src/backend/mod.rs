//! Backends carry the library's messages between the two ends of a channel
//! ([ETH-BT] §4.2.1, §6.5.1). They never change buffer states: the library
//! has done that before it hands a message over, and does it again on the
//! receiving side when the backend hands the message up.
//!
//! A backend provides two things: an [`Endpoint`] kind (how ends find each
//! other and negotiate) and a `Link` (the connected channel's two ordered
//! message streams plus the way pools travel).

use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::pool::{Geometry, PoolId, PoolMemory};
use crate::proto::Message;
use crate::ring::PUBLISH_EVERY;
use crate::setup::{BindParams, ChannelSetup, Negotiated};
use crate::wake::{Arm, WakeSet};

#[cfg(all(feature = "fabric", not(loom)))]
pub mod fabric;
pub mod local;
#[cfg(not(loom))]
pub mod mux;
#[cfg(not(loom))]
pub mod net;
#[cfg(not(loom))]
pub(crate) mod setup_msg;
#[cfg(not(loom))]
pub mod shm;
#[cfg(not(loom))]
mod uds;
mod unshared;

#[cfg(all(feature = "fabric", not(loom)))]
pub use fabric::{FabricEndpoint, FabricOptions};
pub use local::LocalEndpoint;
#[cfg(not(loom))]
pub use mux::{MuxEndpoint, MuxListener, MuxSession};
#[cfg(not(loom))]
pub use net::{NetEndpoint, NetOptions};
#[cfg(not(loom))]
pub use shm::ShmEndpoint;

/// A connected channel end's transport.
pub(crate) trait Link: Send {
    /// Whether one more message fits in the outgoing queue now.
    fn has_room(&mut self) -> bool;
    /// How many messages in a row fit in the outgoing queue now (an
    /// aggregate run needs room for all of its slots before the first goes).
    fn room(&mut self) -> usize {
        usize::from(self.has_room())
    }
    /// The most messages the outgoing queue can ever hold.
    fn capacity(&self) -> usize {
        1
    }
    /// Queue one message to the peer (`QueueFull`, `PeerGone`).
    fn send(&mut self, msg: &Message) -> Result<()>;
    /// Send what is queued for the peer as far as the transport takes it
    /// now (backends that batch sends until the channel is polled).
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
    /// Batching on: `send` may hold messages back and publish them to the
    /// peer in batches — at the latest on `flush`, when a `recv` finds
    /// nothing, on `arm` (every wait arms), when the queue is full, and on `close`. Off (the
    /// default for the shared-memory rings): each `send` is visible to the
    /// peer when it returns.
    fn set_batching(&mut self, on: bool) {
        let _ = on;
    }
    /// Send a pass whose buffer contents do not matter to the peer, or a
    /// copy of a buffer the peer still holds a copy of: a backend that
    /// carries payloads sends none.
    fn send_unfilled(&mut self, msg: &Message) -> Result<()> {
        self.send(msg)
    }
    /// Take the next message from the peer, if any. `PeerGone` once the
    /// peer has closed and everything it sent has been taken; `Protocol`
    /// for malformed input. A backend that carries payloads asks `gate`
    /// before it writes one into our memory.
    fn recv(&mut self, gate: &mut dyn PayloadGate) -> Result<Option<Message>>;
    /// Add what wakes this end to the channel's wake set (once, when the
    /// link takes over from the setup).
    fn register(&mut self, wake: &WakeSet) -> Result<()>;
    /// The channel's payload gate detached from it (once, when the link
    /// takes over from the setup), for a link that lands payloads for this
    /// channel while another channel polls.
    fn set_gate(&mut self, gate: Box<dyn PayloadGate + Send>) {
        let _ = gate;
    }
    /// Take out of the channel's wake set what `register` added (the
    /// channel is closed: nothing of the link may wake it any more).
    fn unregister(&mut self, wake: &WakeSet);
    /// Busy-wait up to `spin` for a message (or the peer's close): `true`
    /// if one may be there. Backends whose waiting costs a system call
    /// anyway do not spin.
    fn spin(&mut self, spin: Duration) -> bool {
        let _ = spin;
        false
    }
    /// Prepare to sleep on the channel's wake set: send what is held back,
    /// declare sleep to the peer (the ring's handshake) and, if the
    /// outgoing queue is full, ask to be woken when it has room. `Ready`
    /// if a message (or room, or the peer's end) may be there already.
    fn arm(&mut self, wake: &WakeSet) -> Arm;
    /// [`arm`](Link::arm) for a sender that waits for `slots` free slots in
    /// a row (an aggregate run): a ring backend asks to be woken while
    /// fewer are free, not only when the queue is full.
    fn arm_for_room(&mut self, wake: &WakeSet, slots: usize) -> Arm {
        let _ = slots;
        self.arm(wake)
    }
    /// Make a pool's memory available to the peer (before its assignment
    /// request is sent).
    fn export_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()>;
    /// The memory of a pool the peer exported (called when this domain
    /// does not have the pool yet).
    fn import_pool(&mut self, id: PoolId, geometry: Geometry) -> Result<Arc<PoolMemory>>;
    /// The library vetoed the peer's offer of pool `id` by itself: forget
    /// whatever of the pool was sent ahead of the offer (without waiting).
    fn discard_pool(&mut self, id: PoolId) {
        let _ = id;
    }
    /// The peer offered a pool this domain already has: its memory, for a
    /// backend that writes payloads into it.
    fn use_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        let _ = memory;
        Ok(())
    }
    /// The channel end no longer relates to pool `id` (removed, vetoed):
    /// drop what the link keeps of it (mappings, fds), after the frames
    /// still queued that need it.
    fn forget_pool(&mut self, id: PoolId) {
        let _ = id;
    }
    /// No more messages from us; wake the peer so it notices. `last` are
    /// messages that did not fit in the queue (replies, releases of copies
    /// never seen): the peer receives them after everything sent before,
    /// whatever room the queue has.
    fn close(&mut self, last: Vec<Message>);
    /// The peer is another process that can die without closing: the
    /// channel then tracks the buffers it lends so it can take them back.
    fn peer_can_die(&self) -> bool {
        false
    }
    /// Both ends belong to one domain (a local link made by a bind from
    /// the creator's own domain): a buffer that travels over it never
    /// leaves the domain (see `Channel::same_domain`).
    fn same_domain(&self) -> bool {
        false
    }
    /// The memory this end writes for every message (address, length),
    /// for the tests that keep it off the peer end's cache lines.
    #[cfg(test)]
    fn private_memory(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }
    /// The channel failed (a protocol error, a dead or silent peer): stop
    /// talking to the peer, without the goodbye of an orderly close.
    /// Returns whether the peer is now treated as dead, so the buffers lent
    /// to it come back (a backend whose peer has memory of its own can say
    /// yes; one that shares memory with a live peer must not).
    fn abandon(&mut self) -> bool {
        false
    }
    /// Messages in the outgoing queue not yet taken by the peer (or the
    /// transport), for the counters; without side effects on sending
    /// (`None`: the backend cannot say cheaply).
    fn queued(&mut self) -> Option<usize> {
        None
    }
    /// Who the peer is, for the registry (`pid N`, an address); empty if
    /// the backend cannot say.
    fn peer(&self) -> String {
        String::new()
    }
    /// Transfer counters, for backends that keep them (the network).
    fn stats(&self) -> Option<LinkStats> {
        None
    }
    /// After `PeerGone`: whether the peer process has exited (its buffers
    /// and copies are then void and come back), as opposed to having only
    /// dropped its end of the channel.
    fn peer_died(&mut self) -> bool {
        false
    }
    /// A handle on the peer process that polls readable once it has exited
    /// (a pidfd), for a lender that keeps watching it after the channel
    /// closed; `None` where the backend cannot tell.
    fn peer_process(&self) -> Option<std::os::fd::OwnedFd> {
        None
    }
}

/// Counters of one network channel end: what crossed, in how many system
/// calls, and how many payload bytes went through user-space memory other
/// than the buffers themselves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Frames sent (keep-alives included).
    pub frames_sent: u64,
    /// Frames received.
    pub frames_received: u64,
    /// Payload bytes sent straight from buffer memory.
    pub payload_sent: u64,
    /// Payload bytes received straight into buffer memory.
    pub payload_received: u64,
    /// Payload bytes that passed through another user-space buffer: only
    /// extra copies of a buffer we already hold, read and dropped. Zero in
    /// every ordinary flow: the payload is never copied in user space.
    pub payload_staged: u64,
    /// `sendmsg` calls that sent something.
    pub send_calls: u64,
    /// `recvmsg` calls that received something (a look at what the socket
    /// holds, before a run of frames is read at once, counts as one).
    pub recv_calls: u64,
}

/// Where a payload that arrived with a buffer message may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Landing {
    /// Into our memory of the buffer.
    Land,
    /// Nowhere: we already hold the same bytes (another copy of a buffer
    /// whose copies cannot change).
    Discard,
}

/// The channel's check of a buffer message before its payload is written
/// (only backends that carry payloads ask): the buffer must be on the
/// channel, and must not be one this domain owns or reads.
pub(crate) trait PayloadGate {
    /// `msg` is a move, pass or copy whose payload is about to land.
    fn admit(&mut self, msg: &Message) -> Result<Landing>;
    /// A gate that keeps the domain and direction checks without borrowing
    /// the channel, for a link that lands payloads for this channel while
    /// another channel of the same connection is polling (the link checks
    /// the pool against the pools the channel gave it).
    fn detach(&self) -> Option<Box<dyn PayloadGate + Send>> {
        None
    }
}

/// The outcome of a finished setup: the link, what was negotiated, and
/// whether this end is the creator.
pub(crate) type SetupDone = (Box<dyn Link>, Negotiated, bool);

/// A channel end that is not connected yet (creator listening, or binder
/// waiting for the reply).
pub(crate) trait PendingSetup: Send {
    /// `Some` once the setup finished (or failed).
    fn poll(&mut self) -> Option<Result<SetupDone>>;
    /// Add what `poll` waits for to the channel's wake set (again after
    /// every `poll`: connections come and go); `Ready` if `poll` may have
    /// news already.
    fn arm(&mut self, wake: &WakeSet) -> Arm;
    /// The socket address a creator listens on (TCP), if any.
    fn listen_addr(&self) -> Option<std::net::SocketAddr> {
        None
    }
}

pub(crate) type Pending = Box<dyn PendingSetup>;

/// Where a channel is created or bound: a backend-specific endpoint
/// descriptor ([ETH-BT] §4.2.2, §6.2.3). The endpoint picks the backend;
/// everything after [`Channel::create`](crate::Channel::create) and
/// [`Channel::bind`](crate::Channel::bind) is the same whatever it is.
///
/// | endpoint | ends in | carries buffers by |
/// |---|---|---|
/// | [`Endpoint::local`] | threads of one process | sharing the pool's memory |
/// | [`Endpoint::shm`], [`Endpoint::shm_abstract`] | processes of one host | sharing the pool's memory (a sealed memfd) |
/// | [`Endpoint::tcp`], [`Endpoint::tcp_with`] | machines | sending the payload from and into buffer memory |
/// | [`MuxSession::endpoint`] | machines, many channels on one TCP connection | the same, demultiplexed into each channel's buffers |
/// | `Endpoint::fabric`, `Endpoint::fabric_with` (feature `fabric`) | machines on a fabric (libfabric: verbs, EFA, Slingshot, TCP) | RMA writes from buffer memory into the peer's buffer |
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Endpoint {
    /// An endpoint for channels between domains of this process.
    Local(LocalEndpoint),
    /// An endpoint for channels between processes on this host.
    #[cfg(not(loom))]
    Shm(ShmEndpoint),
    /// An endpoint for channels between machines (TCP).
    #[cfg(not(loom))]
    Net(NetEndpoint),
    /// A logical channel of a [`MuxSession`]: many channels over one TCP
    /// connection ([`MuxSession::endpoint`]).
    #[cfg(not(loom))]
    Mux(MuxEndpoint),
    /// An endpoint for channels over a fabric (libfabric RMA; feature
    /// `fabric`).
    #[cfg(all(feature = "fabric", not(loom)))]
    Fabric(FabricEndpoint),
}

/// The endpoint in words, as errors name it: `a local endpoint`, `the shm
/// endpoint /run/app.sock`, `the TCP endpoint 127.0.0.1:7000`.
impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Local(_) => f.write_str("a local endpoint"),
            #[cfg(not(loom))]
            Endpoint::Shm(ep) => write!(f, "the shm endpoint {ep}"),
            #[cfg(not(loom))]
            Endpoint::Net(ep) => write!(f, "the TCP endpoint {}", ep.addr()),
            #[cfg(not(loom))]
            Endpoint::Mux(ep) => write!(f, "{ep}"),
            #[cfg(all(feature = "fabric", not(loom)))]
            Endpoint::Fabric(ep) => write!(f, "the fabric endpoint {}", ep.addr()),
        }
    }
}

impl Endpoint {
    /// A fresh local endpoint: create a channel on it in one domain, bind to
    /// it from another (threads of one process). Clones name the same
    /// endpoint; it serves one connected channel (a creator that gives up
    /// before a binder came frees it).
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{BindParams, Channel, ChannelSetup, Domain, Endpoint};
    ///
    /// let ep = Endpoint::local();
    /// let binder = {
    ///     let ep = ep.clone();
    ///     std::thread::spawn(move || Channel::connect(&Domain::new("b"), &ep, BindParams::default(), Duration::from_secs(10)))
    /// };
    /// let tx = Channel::accept(&Domain::new("a"), &ep, ChannelSetup::default(), Duration::from_secs(10))?;
    /// let rx = binder.join().unwrap()?;
    /// # Ok::<(), ferry::Error>(())
    /// ```
    pub fn local() -> Endpoint {
        Endpoint::Local(LocalEndpoint::new())
    }

    /// A shared-memory endpoint named by a socket file: `create` listens
    /// there, `bind` connects (from another process). A socket file left by
    /// a process that died is replaced; the file is removed when the
    /// creator stops listening.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{BindParams, Channel, ChannelSetup, Domain, Endpoint};
    ///
    /// let path = std::env::temp_dir().join(format!("ferry-doc-{}.sock", std::process::id()));
    /// let ep = Endpoint::shm(&path);
    /// // Normally two processes; two domains of this one work the same way.
    /// let mut tx = Channel::create(&Domain::new("a"), &ep, ChannelSetup::default())?;
    /// let mut rx = Channel::bind(&Domain::new("b"), &ep, BindParams::default())?;
    /// tx.wait_connected(Duration::from_secs(10))?;
    /// rx.wait_connected(Duration::from_secs(10))?;
    /// assert!(!path.exists(), "the listener is gone once connected");
    /// # Ok::<(), ferry::Error>(())
    /// ```
    #[cfg(not(loom))]
    pub fn shm(path: impl Into<std::path::PathBuf>) -> Endpoint {
        Endpoint::Shm(ShmEndpoint::path(path))
    }

    /// A shared-memory endpoint with a Linux abstract socket name: no file,
    /// and the name is free again when its listener is gone.
    ///
    /// ```
    /// let ep = ferry::Endpoint::shm_abstract("my-app/frames");
    /// ```
    #[cfg(not(loom))]
    pub fn shm_abstract(name: &str) -> Endpoint {
        Endpoint::Shm(ShmEndpoint::abstract_name(name))
    }

    /// A TCP endpoint (IPv4 or IPv6) with default options: `create`
    /// listens at `addr`, `bind` connects to it. With port 0 the kernel
    /// picks a port: [`Channel::listen_addr`](crate::Channel::listen_addr)
    /// says which.
    ///
    /// ```
    /// use std::time::Duration;
    /// use ferry::{BindParams, Channel, ChannelSetup, Domain, Endpoint};
    ///
    /// let mut tx = Channel::create(&Domain::new("a"), &Endpoint::tcp("127.0.0.1:0".parse()?), ChannelSetup::default())?;
    /// let addr = tx.listen_addr().expect("listening");
    /// let mut rx = Channel::bind(&Domain::new("b"), &Endpoint::tcp(addr), BindParams::default())?;
    /// tx.wait_connected(Duration::from_secs(10))?;
    /// rx.wait_connected(Duration::from_secs(10))?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(not(loom))]
    pub fn tcp(addr: std::net::SocketAddr) -> Endpoint {
        Endpoint::Net(NetEndpoint::new(addr, NetOptions::default()))
    }

    /// A TCP endpoint with options (peer timeout).
    #[cfg(not(loom))]
    pub fn tcp_with(addr: std::net::SocketAddr, options: NetOptions) -> Endpoint {
        Endpoint::Net(NetEndpoint::new(addr, options))
    }

    /// The backend's name and the endpoint as the registry shows them.
    pub(crate) fn describe(&self) -> (&'static str, String) {
        match self {
            Endpoint::Local(_) => ("local", String::new()),
            #[cfg(not(loom))]
            Endpoint::Shm(ep) => ("shm", ep.describe()),
            #[cfg(not(loom))]
            Endpoint::Net(ep) => ("tcp", ep.addr().to_string()),
            #[cfg(not(loom))]
            Endpoint::Mux(ep) => ("mux", format!("{ep:?}")),
            #[cfg(all(feature = "fabric", not(loom)))]
            Endpoint::Fabric(ep) => ("fabric", ep.addr().to_string()),
        }
    }

    /// A fabric endpoint (feature `fabric`) with default options: the
    /// creator's setup connection listens at `addr` (TCP), the binder
    /// connects there, and then payloads go by RMA over the provider that
    /// `FI_PROVIDER` names (or the first that fits). See docs/FABRIC.md.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use ferry::{BindParams, Channel, ChannelSetup, Domain, Endpoint};
    ///
    /// let mut tx = Channel::create(&Domain::new("a"), &Endpoint::fabric("127.0.0.1:0".parse()?), ChannelSetup::default())?;
    /// let addr = tx.listen_addr().expect("listening");
    /// let mut rx = Channel::bind(&Domain::new("b"), &Endpoint::fabric(addr), BindParams::default())?;
    /// tx.wait_connected(Duration::from_secs(10))?;
    /// rx.wait_connected(Duration::from_secs(10))?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(all(feature = "fabric", not(loom)))]
    pub fn fabric(addr: std::net::SocketAddr) -> Endpoint {
        Endpoint::Fabric(FabricEndpoint::new(addr, FabricOptions::default()))
    }

    /// A fabric endpoint with options (the provider; addresses beyond
    /// loopback).
    #[cfg(all(feature = "fabric", not(loom)))]
    pub fn fabric_with(addr: std::net::SocketAddr, options: FabricOptions) -> Endpoint {
        Endpoint::Fabric(FabricEndpoint::new(addr, options))
    }

    /// Listen for a binder, for a channel of the domain `domain` (the id
    /// matters to the local backend alone: see [`Link::same_domain`]).
    pub(crate) fn listen(&self, setup: &ChannelSetup, domain: u64) -> Result<Pending> {
        match self {
            Endpoint::Local(ep) => ep.listen(setup, domain),
            #[cfg(not(loom))]
            Endpoint::Shm(ep) => ep.listen(setup),
            #[cfg(not(loom))]
            Endpoint::Net(ep) => ep.listen(setup),
            #[cfg(not(loom))]
            Endpoint::Mux(ep) => ep.listen(setup),
            #[cfg(all(feature = "fabric", not(loom)))]
            Endpoint::Fabric(ep) => ep.listen(setup),
        }
    }

    /// Bind to the channel created here, for a channel of the domain
    /// `domain` (as for [`Endpoint::listen`]).
    pub(crate) fn connect(&self, params: &BindParams, domain: u64) -> Result<Pending> {
        match self {
            Endpoint::Local(ep) => ep.connect(params, domain),
            #[cfg(not(loom))]
            Endpoint::Shm(ep) => ep.connect(params),
            #[cfg(not(loom))]
            Endpoint::Net(ep) => ep.connect(params),
            #[cfg(not(loom))]
            Endpoint::Mux(ep) => ep.connect(params),
            #[cfg(all(feature = "fabric", not(loom)))]
            Endpoint::Fabric(ep) => ep.connect(params),
        }
    }
}

/// Arm a creator that listens: wake for the listener, for each connection
/// whose bind request has not come yet, and at the first such connection's
/// deadline (to shed it). Closed connections leave the set by themselves.
#[cfg(not(loom))]
pub(crate) fn arm_listening<'a>(
    wake: &WakeSet,
    listener: std::os::fd::BorrowedFd<'a>,
    half_open: impl Iterator<Item = (std::os::fd::BorrowedFd<'a>, std::time::Instant)>,
) -> Arm {
    if wake.watch(listener, crate::wake::Interest::Read).is_err() {
        return Arm::Ready;
    }
    let mut first = None;
    for (fd, deadline) in half_open {
        if wake.watch(fd, crate::wake::Interest::Read).is_err() {
            return Arm::Ready;
        }
        first = Some(first.map_or(deadline, |f: std::time::Instant| f.min(deadline)));
    }
    Arm::Sleep { until: first }
}

/// After staging `msg` on a ring that now holds `staged` unpublished
/// messages: whether to publish now. Unbatched links publish every message;
/// batched ones every [`PUBLISH_EVERY`] messages (and on `flush`, `wait` or
/// a full ring), and a teardown marker at once.
#[inline]
pub(crate) fn publish_now(staged: u32, batching: bool, msg: &Message) -> bool {
    !batching || staged >= PUBLISH_EVERY || *msg == Message::Teardown
}
