//! Early demultiplexing: many channels between two hosts over one TCP
//! connection, after the application device channels of Druschel,
//! Peterson and Davie ("Experiences with a High-Speed Network Adaptor: A
//! Software Perspective", SIGCOMM 1994).
//!
//! A [`MuxSession`] is one TCP connection shared by the channels opened on
//! it. Each side opens logical channels by number
//! ([`MuxSession::endpoint`]): one side creates (`Channel::create` or
//! `Channel::accept` on the endpoint), the other binds, with the usual
//! [`ChannelSetup`] and [`BindParams`]. From then on they are ordinary
//! channels: the same move, pass, copy and release, events, `AsFd`/`arm`,
//! [`Selector`](crate::Selector).
//!
//! # Early demultiplexing
//!
//! Whichever channel of a session polls reads the socket for all of them.
//! It reads a frame's 16-byte header, picks the channel from it and reads
//! the payload straight into that channel's pool buffer (vectored
//! `recvmsg` into the buffer's memory, as the one-channel TCP backend
//! does): there is no shared receive buffer, and no user-space copy. The
//! landing is checked as for the TCP backend: the pool must be one the
//! channel gave the session, the index in range, the size the pool's, and
//! the buffer neither owned nor read by the receiving domain (the
//! channel's payload gate, detached from the channel so that another
//! channel's poll can ask it). When the channel takes the message, its own
//! gate checks it once more. Messages of channel X read while channel Y
//! polls are queued for X in order, and X's doorbell (an eventfd in X's
//! wake set) rings if X sleeps.
//!
//! # Flow control and priorities
//!
//! Every channel has its own credit, counted in messages. A sender starts
//! with the channel's queue depth in credit and spends one per message it
//! puts on the wire; the receiver gives credit back as its application
//! takes messages (in grants of a quarter of the depth). Payload bytes need
//! no credit: they land in the buffer the message names, memory the
//! receiver has anyway. So what the receiver must hold for a channel that
//! nobody reads is bounded (the depth in message headers), and it can
//! always drain the socket: a channel whose reader stops fills only its own
//! credit, and its sender's queue then says `QueueFull` — the other
//! channels go on (no head-of-line blocking).
//!
//! The sender's scheduler picks the next frame by channel priority
//! ([`MuxSession::endpoint_with_priority`], higher first), round-robin
//! among channels of equal priority. Payloads go out in chunks of at most
//! [`MAX_CHUNK`] bytes, each its own frame, so a bulk channel's large
//! buffer delays a priority frame by at most one chunk plus what the
//! kernel holds: the socket's send buffer is kept small
//! ([`SEND_BUFFER`]) so that the scheduler, not the kernel's queue,
//! decides the order.
//!
//! # Channel numbers and setup
//!
//! Channels are named by a number both sides agree on, as ports are. A
//! bind sends an *open* with its bind request; an open for a number nobody
//! listens on yet waits (up to 64 of them) until someone does. A bind that
//! gives up (timeout, refusal) says *close* and keeps its number until the
//! peer answers with a close, reading and dropping whatever the creator may
//! have sent meanwhile; a closed channel's number is free again once both
//! sides have said close.
//!
//! # Why this way
//!
//! - *No thread of its own.* The channels drive the session under one
//!   lock, as the one-channel backend drives its socket: an application
//!   that serves all its channels from one event loop pays no lock
//!   contention and no thread hand-off, and one that uses several threads
//!   still works (a thread's poll lands what it reads for the others and
//!   rings their doorbells).
//! - *Credit in messages, not bytes.* What a receiver would have to buffer
//!   for a channel it does not read is message headers only; payloads
//!   always have their place (the named buffer). Byte credit would only
//!   repeat what the pools' sizes already bound.
//! - *Chunks.* Without them one 1 GiB buffer would hold the connection for
//!   its whole transfer; with 64 KiB chunks a priority frame waits for at
//!   most one chunk of each frame already committed, plus what the kernel
//!   has queued. A chunk is one frame of its own, read straight into the
//!   buffer at its offset.
//! - *Header read-ahead.* Each body or chunk is read together with the next
//!   frame's header (into the session's own 16 bytes, never into a
//!   buffer), so a stream of frames costs one `recvmsg` each.
//!
//! # Wire format, version 1 (little endian)
//!
//! Both ends first send the 8 bytes `FERRYMX1`. Then frames:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | kind: 1 message, 2 payload chunk, 3 credit, 4 open, 5 open reply, 6 close, 7 keep-alive, 8 goodbye |
//! | 1 | 1 | flags: close: bit 0 abort (the sender's end failed) |
//! | 2 | 2 | zero |
//! | 4 | 4 | channel (0 for keep-alive and goodbye, which are the session's) |
//! | 8 | 4 | body length |
//! | 12 | 4 | credit: messages granted (credit frames) |
//! | 16 | body length | body |
//!
//! - *message*: the body is a TCP-backend frame header and meta (32 bytes
//!   plus the meta; see `backend/net.rs`); if it announces a payload, the
//!   payload follows in *chunk* frames of the same channel (other
//!   channels' frames may come between), each at most [`MAX_CHUNK`] bytes,
//!   until the announced length is complete. A message frame costs one
//!   credit. An aggregate is its run of messages (header, members,
//!   fragment tables), so it needs credit and queue room for the whole run
//!   before its first message is queued, as on the other backends.
//! - *open*: the binder's bind request for the channel; *open reply*: the
//!   creator's acceptance or refusal (the setup messages of the TCP
//!   backend).
//! - *close*: the sender closed its end of the channel (after everything it
//!   sent on it); with the abort flag, its end failed and buffers it
//!   holds are lost.
//! - *keep-alive*: sent when nothing else went out for a quarter of the
//!   peer timeout; *goodbye*: the session ends on purpose.
//!
//! Anything else — an unknown kind, lengths that do not fit the kind, a
//! frame for a channel that was never opened, a chunk without a message,
//! a message beyond the credit, a payload the gate refuses — is a protocol
//! error: the session stops, every channel on it fails with
//! [`Error::Protocol`] on the receiving side, and the peer sees its
//! connection end. The end of the stream without a goodbye fails every
//! open channel with [`Error::PeerGone`], and the buffers lent to the peer
//! come back.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::setup_msg;
use super::{Endpoint, Landing, Link, LinkStats, PayloadGate, Pending, PendingSetup, SetupDone};
use crate::error::{Error, Result};
use crate::pool::{BufferId, Geometry, PoolId, PoolMap, PoolMemory};
use crate::proto::{self, Message, Meta};
use crate::setup::{check_reply, negotiate, BindParams, ChannelSetup, Negotiated};
use crate::sys::{self, Access, Mapping, RecvPart, SendPart};
use crate::wake::{Arm, Doorbell, Interest, WakeSet};
use crate::NetOptions;

/// Size of a multiplexed frame header.
pub const MUX_HEAD: usize = 16;
/// Largest payload chunk: a priority frame waits for at most one.
pub const MAX_CHUNK: usize = 64 << 10;
/// The socket send buffer asked for: small, so the scheduler's order holds
/// (what the kernel has queued goes out before any priority frame). On
/// loopback (one pair of runs, busy machine) 1 MiB gave about 30 % more
/// aggregate throughput but priority
/// round trips no better than equal priorities; 256 KiB keeps them about
/// half of those.
pub const SEND_BUFFER: usize = 256 << 10;
const MAGIC: &[u8; 8] = b"FERRYMX1";

/// Frame kinds.
pub(crate) const K_MESSAGE: u8 = 1;
pub(crate) const K_CHUNK: u8 = 2;
pub(crate) const K_CREDIT: u8 = 3;
pub(crate) const K_OPEN: u8 = 4;
pub(crate) const K_REPLY: u8 = 5;
pub(crate) const K_CLOSE: u8 = 6;
pub(crate) const K_KEEPALIVE: u8 = 7;
pub(crate) const K_GOODBYE: u8 = 8;
const FLAG_ABORT: u8 = 1;

/// The TCP backend's message frame header (see `backend/net.rs`).
const MSG_HEAD: usize = proto::HEADER;
const TYPE_MOVE: u8 = 1;
const TYPE_COPY: u8 = 2;
const TYPE_PASS: u8 = 3;
const FLAG_PAYLOAD: u8 = 2;

/// Bytes committed to the wire at once (the scheduler decides again after).
const WIRE_BYTES: usize = 4 * MAX_CHUNK;
/// Frames committed to the wire at once.
const WIRE_FRAMES: usize = 64;
/// Frames read per poll before the polling channel gets its answer.
const READ_FRAMES: usize = 256;
/// Bind requests kept for channel numbers nobody listens on yet.
const MAX_UNCLAIMED: usize = 64;
/// How long a closing channel tries to get its last frames out.
const CLOSE_FLUSH: Duration = Duration::from_secs(2);
/// Messages a receiver takes beyond the credit it gave (its close's last
/// messages: replies and releases that bypass the queue).
const CREDIT_SLACK: usize = 64;

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MuxHead {
    /// The frame kind (1 ..= 8).
    pub kind: u8,
    /// Flags (close: abort).
    pub flags: u8,
    /// The channel number.
    pub channel: u32,
    /// Bytes of body that follow.
    pub len: u32,
    /// Credit granted (credit frames).
    pub credit: u32,
}

impl MuxHead {
    /// Encode into a header.
    pub fn encode(&self) -> [u8; MUX_HEAD] {
        let mut h = [0u8; MUX_HEAD];
        h[0] = self.kind;
        h[1] = self.flags;
        h[4..8].copy_from_slice(&self.channel.to_le_bytes());
        h[8..12].copy_from_slice(&self.len.to_le_bytes());
        h[12..16].copy_from_slice(&self.credit.to_le_bytes());
        h
    }

    /// Decode and check a header from a peer: the kind is known and the
    /// other fields fit it. A pure function (the fuzz target's).
    pub fn decode(h: &[u8; MUX_HEAD]) -> Result<MuxHead> {
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let head = MuxHead { kind: h[0], flags: h[1], channel: word(4), len: word(8), credit: word(12) };
        let bad = |what: &str| Err(Error::Protocol(format!("multiplexed frame kind {}: {what}", head.kind)));
        if h[2] != 0 || h[3] != 0 {
            return bad("reserved bytes set");
        }
        let len = head.len as usize;
        let session = matches!(head.kind, K_KEEPALIVE | K_GOODBYE);
        if session != (head.channel == 0) {
            return bad("channel 0 is the session's, and only its");
        }
        if head.flags != 0 && !(head.kind == K_CLOSE && head.flags == FLAG_ABORT) {
            return bad("unknown flags");
        }
        if head.credit != 0 && head.kind != K_CREDIT {
            return bad("credit on a frame that grants none");
        }
        let ok = match head.kind {
            K_MESSAGE => (MSG_HEAD..=MSG_HEAD + proto::MAX_META_SIZE).contains(&len),
            K_CHUNK => (1..=MAX_CHUNK).contains(&len),
            K_CREDIT => len == 0 && head.credit > 0,
            K_OPEN | K_REPLY => (1..=setup_msg::MAX_LEN).contains(&len),
            K_CLOSE | K_KEEPALIVE | K_GOODBYE => len == 0,
            _ => return bad("unknown kind"),
        };
        if !ok {
            return bad("length or credit out of range");
        }
        Ok(head)
    }
}

// ------------------------------------------------------------------ session

/// One TCP connection that many channels share (see the module docs).
/// Clones are handles of the same session; it ends (with a goodbye) when
/// the last handle and the last channel on it are gone.
///
/// The session has no thread of its own: its channels (and channels being
/// created or bound on it) read and write the connection when they are
/// polled, waited on or armed, and send its keep-alives. A side with no
/// channel on the session sends none, and its peer declares the session
/// dead after its peer timeout.
///
/// ```
/// use std::time::Duration;
/// use ferry::{BindParams, Channel, ChannelSetup, Domain, MuxSession, NetOptions};
///
/// let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
/// let addr = listener.local_addr()?;
/// let t = Duration::from_secs(10);
/// let other = std::thread::spawn(move || -> ferry::Result<Channel> {
///     let session = MuxSession::connect(addr, NetOptions::default(), t)?;
///     Channel::connect(&Domain::new("b"), &session.endpoint(1), BindParams::default(), t)
/// });
/// let session = MuxSession::accept(&listener, NetOptions::default(), t)?;
/// let tx = Channel::accept(&Domain::new("a"), &session.endpoint(1), ChannelSetup::default(), t)?;
/// let rx = other.join().unwrap()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct MuxSession {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MuxSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuxSession").field("peer", &self.shared.peer).finish()
    }
}

struct Shared {
    inner: Mutex<Inner>,
    peer: Option<SocketAddr>,
}

impl MuxSession {
    /// Connect to a peer that accepts sessions at `addr`.
    pub fn connect(addr: SocketAddr, options: NetOptions, timeout: Duration) -> Result<MuxSession> {
        let timeout = timeout.max(Duration::from_millis(1));
        let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| match e.kind() {
            io::ErrorKind::ConnectionRefused => Error::EndpointNotListening,
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Error::TimedOut,
            _ => Error::from(e),
        })?;
        if stream.local_addr()? == stream.peer_addr()? {
            return Err(Error::EndpointNotListening);
        }
        MuxSession::start(stream, options, timeout)
    }

    /// Accept one session on `listener` (waiting up to `timeout`; the
    /// listener is left non-blocking).
    pub fn accept(listener: &TcpListener, options: NetOptions, timeout: Duration) -> Result<MuxSession> {
        let deadline = Instant::now() + timeout;
        listener.set_nonblocking(true)?;
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false)?;
                    return MuxSession::start(stream, options, timeout);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                        return Err(Error::TimedOut);
                    };
                    let _ = crate::wake::wait_readable(&[listener.as_fd()], Some(left));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A session over a connected stream (both ends exchange the magic).
    fn start(stream: TcpStream, options: NetOptions, timeout: Duration) -> Result<MuxSession> {
        let timeout = timeout.max(Duration::from_millis(1));
        stream.set_write_timeout(Some(timeout))?;
        stream.set_read_timeout(Some(timeout))?;
        (&stream).write_all(MAGIC)?;
        let mut magic = [0u8; 8];
        (&stream).read_exact(&mut magic).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Error::TimedOut,
            io::ErrorKind::UnexpectedEof => Error::PeerGone,
            _ => Error::from(e),
        })?;
        if &magic != MAGIC {
            return Err(Error::Protocol("not a multiplexed session".into()));
        }
        let peer = stream.peer_addr().ok();
        let _ = stream.set_nodelay(true);
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(stream.as_fd(), SEND_BUFFER);
        Ok(MuxSession { shared: Arc::new(Shared { inner: Mutex::new(Inner::new(stream, options)?), peer }) })
    }

    /// A session over any connected stream socket whose magic was exchanged
    /// already (fuzzing: one end of a socket pair).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn over(stream: TcpStream) -> MuxSession {
        let inner = Inner::new(stream, NetOptions::default()).expect("socket options");
        MuxSession { shared: Arc::new(Shared { inner: Mutex::new(inner), peer: None }) }
    }

    /// An open channel `id` on this session as a link (fuzzing: frames for
    /// it without a peer that set it up).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn open_link(&self, id: u32, meta_size: usize, depth: u32) -> Box<dyn Link> {
        let mut inner = self.lock();
        inner.chans.insert(id, Chan::new(ChanState::Binding, 0).expect("eventfd"));
        let neg = Negotiated {
            binder_direction: crate::setup::Direction::Rx,
            binder_role: crate::setup::Role::Slave,
            creator_role: crate::setup::Role::Master,
            trust: crate::pool::TrustLevel::Full,
            meta_size,
            constraints: crate::setup::ChannelConstraints::default(),
        };
        inner.open(id, &neg, depth);
        drop(inner);
        Box::new(MuxLink::new(self.clone(), id))
    }

    /// The endpoint of logical channel `channel` (1 or more) on this
    /// session, at the default priority 0. One side creates the channel
    /// there, the other binds. A number is in use from `create` or `bind`
    /// until the channel is closed on both sides; a bind that gave up
    /// (timed out, refused) frees its number once the peer has answered
    /// the give-up (meanwhile `bind` and `create` on it say
    /// [`Error::EndpointInUse`]).
    pub fn endpoint(&self, channel: u32) -> Endpoint {
        self.endpoint_with_priority(channel, 0)
    }

    /// As [`MuxSession::endpoint`], with a priority for what this side
    /// sends on it: frames of a higher priority go first.
    pub fn endpoint_with_priority(&self, channel: u32, priority: u8) -> Endpoint {
        Endpoint::Mux(MuxEndpoint { session: self.clone(), channel, priority })
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.shared.peer
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.shared.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The endpoint of one logical channel of a [`MuxSession`].
#[derive(Clone)]
pub struct MuxEndpoint {
    session: MuxSession,
    channel: u32,
    priority: u8,
}

impl std::fmt::Debug for MuxEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuxEndpoint").field("channel", &self.channel).field("priority", &self.priority).finish()
    }
}

impl MuxEndpoint {
    fn claim(&self, state: ChanState) -> Result<()> {
        if self.channel == 0 {
            return Err(Error::Protocol("channel 0 is the session's".into()));
        }
        let mut inner = self.session.lock();
        // What the peer sent so far first: a close that frees the number
        // may be waiting.
        let _ = inner.pump_read(None);
        let _ = inner.pump_write();
        inner.check()?;
        if inner.chans.contains_key(&self.channel) {
            return Err(Error::EndpointInUse);
        }
        let chan = Chan::new(state, self.priority)?;
        inner.chans.insert(self.channel, chan);
        Ok(())
    }

    pub(crate) fn listen(&self, setup: &ChannelSetup) -> Result<Pending> {
        self.claim(ChanState::Listening { setup: *setup })?;
        Ok(Box::new(MuxPending { session: Some(self.session.clone()), id: self.channel, params: None, deadline: None }))
    }

    pub(crate) fn connect(&self, params: &BindParams) -> Result<Pending> {
        self.claim(ChanState::Binding)?;
        let mut inner = self.session.lock();
        let body = setup_msg::encode_bind(params);
        inner.queue_ctrl(K_OPEN, self.channel, body, 0);
        let _ = inner.pump_write();
        drop(inner);
        Ok(Box::new(MuxPending {
            session: Some(self.session.clone()),
            id: self.channel,
            params: Some(*params),
            deadline: Some(Instant::now() + params.timeout),
        }))
    }
}

struct MuxPending {
    session: Option<MuxSession>,
    id: u32,
    /// The binder's request (`None`: the creator).
    params: Option<BindParams>,
    deadline: Option<Instant>,
}

impl MuxPending {
    fn give_up(&mut self, e: Error) -> Option<Result<SetupDone>> {
        if let Some(s) = self.session.take() {
            MuxPending::release(&mut s.lock(), self.id, self.params.is_some());
        }
        Some(Err(e))
    }

    /// The setup ends without a channel. A binder's open is out: it says
    /// close and keeps the number until the peer's close (or reply) comes,
    /// dropping what the creator may send meanwhile.
    fn release(inner: &mut Inner, id: u32, binder: bool) {
        let Some(chan) = inner.chans.get_mut(&id) else { return };
        if !binder || inner.gone.is_some() || chan.peer_closed.is_some() {
            inner.chans.remove(&id);
            return;
        }
        chan.detached = true;
        chan.close_queued = Some(FLAG_ABORT);
        let _ = inner.pump_write();
    }
}

impl PendingSetup for MuxPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        let session = self.session.as_ref()?;
        let mut inner = session.lock();
        let _ = inner.pump_write();
        let read = inner.pump_read(None);
        if let Err(e) = read.and_then(|()| inner.check()) {
            drop(inner);
            return self.give_up(e);
        }
        let id = self.id;
        let Some(chan) = inner.chans.get_mut(&id) else { return Some(Err(Error::PeerGone)) };
        let listening = match chan.state {
            ChanState::Listening { setup } => Some(setup),
            _ => None,
        };
        let arrived = chan.setup_in.take();
        match (listening, self.params) {
            (Some(setup), None) => {
                let request = arrived.or_else(|| inner.unclaimed.remove(&id))?;
                let params = match setup_msg::parse_bind(&request) {
                    Ok(p) => p,
                    Err(e) => {
                        inner.fail(e.clone(), false);
                        drop(inner);
                        return self.give_up(e);
                    }
                };
                match negotiate(&setup, &params) {
                    Err(why) => {
                        inner.queue_ctrl(K_REPLY, id, setup_msg::encode_refuse(why), 0);
                        let _ = inner.pump_write();
                        None
                    }
                    Ok(neg) => {
                        let depth = setup.queue_depth;
                        inner.queue_ctrl(K_REPLY, id, setup_msg::encode_accept(&neg, depth), 0);
                        inner.open(id, &neg, depth);
                        let _ = inner.pump_write();
                        drop(inner);
                        let session = self.session.take().expect("present");
                        Some(Ok((Box::new(MuxLink::new(session, id)) as Box<dyn Link>, neg, true)))
                    }
                }
            }
            (None, Some(params)) => {
                let Some(reply) = arrived else {
                    drop(inner);
                    if self.deadline.is_some_and(|d| Instant::now() >= d) {
                        return self.give_up(Error::TimedOut);
                    }
                    return None;
                };
                match setup_msg::parse_reply(&reply)
                    .and_then(|(neg, depth)| check_reply(&params, &neg).map(|()| (neg, depth)))
                {
                    Ok((neg, _)) => {
                        drop(inner);
                        let session = self.session.take().expect("present");
                        Some(Ok((Box::new(MuxLink::new(session, id)) as Box<dyn Link>, neg, false)))
                    }
                    Err(e) => {
                        drop(inner);
                        self.give_up(e)
                    }
                }
            }
            _ => {
                drop(inner);
                self.give_up(Error::Protocol("channel setup out of order".into()))
            }
        }
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let Some(session) = &self.session else { return Arm::SLEEP };
        let mut inner = session.lock();
        let Some(chan) = inner.chans.get(&self.id) else { return Arm::Ready };
        if chan.setup_in.is_some() || inner.unclaimed.contains_key(&self.id) || inner.gone.is_some() {
            return Arm::Ready;
        }
        let _ = chan.bell.reset();
        if wake.watch(chan.bell.fd().as_fd(), Interest::Read).is_err() {
            return Arm::Ready;
        }
        inner.chans.get_mut(&self.id).expect("present").armed = true;
        match inner.arm_socket(wake) {
            Some(until) => Arm::Sleep { until: Some(self.deadline.map_or(until, |d| d.min(until))) },
            None => Arm::Ready,
        }
    }
}

impl Drop for MuxPending {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            MuxPending::release(&mut s.lock(), self.id, self.params.is_some());
        }
    }
}

// -------------------------------------------------------------- inner state

/// A pool as the session sees it: its own read-write mapping.
struct LinkPool {
    map: Mapping,
    geometry: Geometry,
    memory: Arc<PoolMemory>,
}

enum ChanState {
    Listening { setup: ChannelSetup },
    Binding,
    Open,
}

/// A message queued to go out.
struct OutMsg {
    /// Message frame header, message header and meta.
    head: Vec<u8>,
    payload: Option<(Arc<LinkPool>, usize, usize)>,
    /// Sent even without credit (a closing end's last messages).
    last: bool,
}

/// Where the payload of a message being received goes.
#[derive(Clone, Copy)]
enum Target {
    Land,
    Discard,
}

/// A message whose payload chunks are arriving.
struct Incoming {
    /// `None`: the channel is closed here, the payload is read and dropped.
    msg: Option<Message>,
    pool: Option<Arc<LinkPool>>,
    offset: usize,
    len: usize,
    got: usize,
    target: Target,
    copy: bool,
}

struct Chan {
    state: ChanState,
    priority: u8,
    meta_size: usize,
    depth: usize,
    /// A bind request (creator) or reply (binder) that arrived.
    setup_in: Option<Vec<u8>>,
    pools: PoolMap<Arc<LinkPool>>,
    gate: Option<Box<dyn PayloadGate + Send>>,
    /// Complete messages for the channel, in order; `true`: its payload landed.
    inq: VecDeque<(Message, bool)>,
    incoming: Option<Incoming>,
    outq: VecDeque<OutMsg>,
    /// The message whose chunks are going out, and how much of it went.
    sending: Option<(Arc<LinkPool>, usize, usize, usize)>,
    credit: usize,
    /// Messages our application took since the last grant.
    consumed: usize,
    /// Messages the peer may still send (what we granted, minus what came).
    allowed: usize,
    bell: Doorbell,
    armed: bool,
    /// The peer closed its end (`true`: it failed).
    peer_closed: Option<bool>,
    /// Our end closed: a close frame follows what is queued.
    close_queued: Option<u8>,
    /// Our close frame went out.
    close_sent: bool,
    /// The link is gone: frames for the channel are read and dropped.
    detached: bool,
    copied_in: HashSet<BufferId>,
    stats: LinkStats,
}

impl Chan {
    fn new(state: ChanState, priority: u8) -> Result<Chan> {
        Ok(Chan {
            state,
            priority,
            meta_size: 0,
            depth: 0,
            setup_in: None,
            pools: PoolMap::default(),
            gate: None,
            inq: VecDeque::new(),
            incoming: None,
            outq: VecDeque::new(),
            sending: None,
            credit: 0,
            consumed: 0,
            allowed: 0,
            bell: Doorbell::new()?,
            armed: false,
            peer_closed: None,
            close_queued: None,
            close_sent: false,
            detached: false,
            copied_in: HashSet::new(),
            stats: LinkStats::default(),
        })
    }

    fn wake(&mut self) {
        if self.armed {
            self.armed = false;
            self.bell.ring();
        }
    }

    /// Whether the channel has a frame to send now: `Some(true)` a chunk
    /// or close (no credit needed), `Some(false)` a message.
    fn ready(&self) -> bool {
        if self.sending.is_some() {
            return true;
        }
        match self.outq.front() {
            Some(m) => m.last || self.credit > 0,
            None => self.close_queued.is_some() && !self.close_sent,
        }
    }
}

/// One frame committed to the wire.
struct WireFrame {
    head: Vec<u8>,
    payload: Option<(Arc<LinkPool>, usize, usize)>,
}

impl WireFrame {
    fn len(&self) -> usize {
        self.head.len() + self.payload.as_ref().map_or(0, |p| p.2)
    }
}

enum RxState {
    Head { have: usize },
    Body { head: MuxHead, have: usize },
    Chunk { chan: u32, have: usize, len: usize },
}

struct Inner {
    stream: TcpStream,
    options: NetOptions,
    chans: HashMap<u32, Chan>,
    unclaimed: HashMap<u32, Vec<u8>>,
    ctrl: VecDeque<WireFrame>,
    wire: VecDeque<WireFrame>,
    wire_sent: usize,
    /// Round-robin position: the channel served last.
    last_served: u32,
    rx: RxState,
    head: [u8; MUX_HEAD],
    /// Header bytes of the next frame read together with a body or chunk.
    next: [u8; MUX_HEAD],
    body: [u8; MSG_HEAD + proto::MAX_META_SIZE],
    scratch: Vec<u8>,
    last_rx: Instant,
    last_tx: Instant,
    last_progress: Instant,
    goodbye_seen: bool,
    /// The session is over: the error, and whether the peer counts as dead.
    gone: Option<(Error, bool)>,
}

impl Inner {
    fn new(stream: TcpStream, options: NetOptions) -> Result<Inner> {
        stream.set_nonblocking(true)?;
        let _ = stream.set_read_timeout(None);
        let _ = stream.set_write_timeout(None);
        let now = Instant::now();
        Ok(Inner {
            stream,
            options,
            chans: HashMap::new(),
            unclaimed: HashMap::new(),
            ctrl: VecDeque::new(),
            wire: VecDeque::new(),
            wire_sent: 0,
            last_served: 0,
            rx: RxState::Head { have: 0 },
            head: [0; MUX_HEAD],
            next: [0; MUX_HEAD],
            body: [0; MSG_HEAD + proto::MAX_META_SIZE],
            scratch: Vec::new(),
            last_rx: now,
            last_tx: now,
            last_progress: now,
            goodbye_seen: false,
            gone: None,
        })
    }

    fn check(&self) -> Result<()> {
        match &self.gone {
            Some((e, _)) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The session is over: every channel hears of it.
    fn fail(&mut self, e: Error, died: bool) -> Error {
        if self.gone.is_none() {
            self.gone = Some((e, died));
            let _ = self.stream.shutdown(Shutdown::Both);
            for chan in self.chans.values_mut() {
                chan.armed = true;
                chan.wake();
            }
        }
        self.gone.as_ref().expect("set").0.clone()
    }

    fn open(&mut self, id: u32, neg: &Negotiated, depth: u32) {
        let chan = self.chans.get_mut(&id).expect("claimed");
        chan.state = ChanState::Open;
        chan.meta_size = neg.meta_size;
        chan.depth = depth as usize;
        chan.credit = depth as usize;
        chan.allowed = depth as usize;
    }

    fn queue_ctrl(&mut self, kind: u8, channel: u32, body: Vec<u8>, credit: u32) {
        let mut head = MuxHead { kind, flags: 0, channel, len: body.len() as u32, credit }.encode().to_vec();
        head.extend_from_slice(&body);
        if self.ctrl.is_empty() && self.wire.is_empty() {
            self.last_progress = Instant::now();
        }
        self.ctrl.push_back(WireFrame { head, payload: None });
    }

    fn has_output(&self) -> bool {
        !self.wire.is_empty() || !self.ctrl.is_empty() || self.chans.values().any(Chan::ready)
    }

    /// The next channel to send from: highest priority, round-robin among
    /// equals (the first after the one served last).
    fn pick(&self) -> Option<u32> {
        let mut best: Option<(u8, bool, u32)> = None;
        for (&id, chan) in &self.chans {
            if !chan.ready() {
                continue;
            }
            // Among equals, ids after the last served come first, then the
            // smallest id.
            let key = (chan.priority, id > self.last_served, u32::MAX - id);
            if best.is_none_or(|b| key > b) {
                best = Some(key);
            }
        }
        best.map(|(_, _, inv)| u32::MAX - inv)
    }

    /// Take the next frame of channel `id` for the wire.
    fn take_frame(&mut self, id: u32) -> Option<WireFrame> {
        let chan = self.chans.get_mut(&id)?;
        if let Some((pool, offset, len, sent)) = chan.sending.take() {
            let n = (len - sent).min(MAX_CHUNK);
            let head = MuxHead { kind: K_CHUNK, flags: 0, channel: id, len: n as u32, credit: 0 }.encode().to_vec();
            chan.stats.payload_sent += n as u64;
            if sent + n < len {
                chan.sending = Some((pool.clone(), offset, len, sent + n));
            }
            chan.stats.frames_sent += 1;
            return Some(WireFrame { head, payload: Some((pool, offset + sent, n)) });
        }
        if let Some(m) = chan.outq.pop_front() {
            if !m.last {
                chan.credit -= 1;
            }
            if let Some((pool, offset, len)) = m.payload {
                chan.sending = Some((pool, offset, len, 0));
            }
            chan.stats.frames_sent += 1;
            return Some(WireFrame { head: m.head, payload: None });
        }
        let flags = chan.close_queued?;
        chan.close_sent = true;
        let head = MuxHead { kind: K_CLOSE, flags, channel: id, len: 0, credit: 0 }.encode().to_vec();
        if chan.detached && chan.peer_closed.is_some() {
            self.chans.remove(&id);
        }
        Some(WireFrame { head, payload: None })
    }

    /// Commit frames to the wire (control first, then by priority) up to a
    /// bounded amount.
    fn schedule(&mut self) {
        let mut bytes: usize = self.wire.iter().map(WireFrame::len).sum();
        let mut frames = self.wire.len();
        while bytes < WIRE_BYTES && frames < WIRE_FRAMES {
            let f = if let Some(f) = self.ctrl.pop_front() {
                f
            } else {
                let Some(id) = self.pick() else { break };
                self.last_served = id;
                let Some(f) = self.take_frame(id) else { break };
                f
            };
            bytes += f.len();
            frames += 1;
            self.wire.push_back(f);
        }
    }

    /// Send what the socket takes now.
    fn pump_write(&mut self) -> Result<()> {
        self.check()?;
        loop {
            if self.wire.is_empty() {
                if self.ctrl.is_empty() && !self.chans.values().any(Chan::ready) {
                    return Ok(());
                }
                self.last_progress = Instant::now();
            }
            self.schedule();
            if self.wire.is_empty() {
                return Ok(());
            }
            let sent = {
                let mut parts: Vec<SendPart<'_>> = Vec::with_capacity(2 * self.wire.len());
                let mut skip = self.wire_sent;
                for f in &self.wire {
                    if skip < f.head.len() {
                        parts.push(SendPart::slice(&f.head[skip..]));
                        skip = 0;
                    } else {
                        skip -= f.head.len();
                    }
                    if let Some((pool, offset, len)) = &f.payload {
                        parts.push(SendPart::mapping(&pool.map, offset + skip, len - skip).expect("chunk in range"));
                    }
                    skip = 0;
                }
                sys::send_parts(self.stream.as_fd(), &parts)
            };
            let mut n = match sent {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return Err(self.fail(Error::PeerGone, true)),
            };
            let now = Instant::now();
            self.last_tx = now;
            self.last_progress = now;
            while n > 0 {
                let left = self.wire.front().expect("sent bytes are queued").len() - self.wire_sent;
                if n < left {
                    self.wire_sent += n;
                    break;
                }
                n -= left;
                self.wire_sent = 0;
                self.wire.pop_front();
            }
        }
    }

    /// Keep-alives and the peer's liveness.
    fn tick(&mut self) -> Result<()> {
        self.check()?;
        let now = Instant::now();
        let timeout = self.options.peer_timeout;
        if now.duration_since(self.last_rx) > timeout {
            return Err(self.fail(Error::PeerUnresponsive(timeout), true));
        }
        let busy = !self.wire.is_empty() || !self.ctrl.is_empty();
        if busy && now.duration_since(self.last_progress) > timeout {
            return Err(self.fail(Error::PeerUnresponsive(timeout), true));
        }
        if !busy && now.duration_since(self.last_tx) > timeout / 4 {
            self.queue_ctrl(K_KEEPALIVE, 0, Vec::new(), 0);
            self.pump_write()?;
        }
        Ok(())
    }

    /// Watch the socket in `wake` (for writing too if output is queued):
    /// the deadline to wake at for keep-alives and liveness, `None` if
    /// something is ready now.
    fn arm_socket(&mut self, wake: &WakeSet) -> Option<Instant> {
        if self.gone.is_some() || self.pump_write().is_err() || self.tick().is_err() {
            return None;
        }
        let out = !self.wire.is_empty() || !self.ctrl.is_empty();
        let interest = if out { Interest::ReadWrite } else { Interest::Read };
        if wake.watch(self.stream.as_fd(), interest).is_err() {
            return None;
        }
        let timeout = self.options.peer_timeout;
        let ours = if out { self.last_progress + timeout } else { self.last_tx + timeout / 4 };
        Some(ours.min(self.last_rx + timeout) + Duration::from_millis(1))
    }

    /// Read frames until the socket is dry, a bounded number was read, or
    /// (with `want`) that channel has a message.
    fn pump_read(&mut self, want: Option<u32>) -> Result<()> {
        self.check()?;
        for _ in 0..READ_FRAMES {
            if want.is_some_and(|id| self.chans.get(&id).is_some_and(|c| !c.inq.is_empty())) {
                return Ok(());
            }
            match self.read_frame() {
                Ok(true) => {}
                Ok(false) => return Ok(()),
                Err(e @ Error::Protocol(_)) => return Err(self.fail(e, false)),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Read one frame (or what of it is there): `false` when the socket is dry.
    fn read_frame(&mut self) -> Result<bool> {
        loop {
            // A body or chunk is read together with the next frame's
            // header (never payload: it may go into our own memory), so a
            // stream of frames costs one system call per frame.
            let next = RecvPart::slice(&mut self.next[..]);
            let got = match &self.rx {
                // A whole header read ahead: nothing to read.
                RxState::Head { have: MUX_HEAD } => Ok(usize::MAX),
                RxState::Head { have } => {
                    let have = *have;
                    sys::recv_parts(self.stream.as_fd(), &[RecvPart::slice(&mut self.head[have..])])
                }
                RxState::Body { head, have } => {
                    let (len, have) = (head.len as usize, *have);
                    sys::recv_parts(self.stream.as_fd(), &[RecvPart::slice(&mut self.body[have..len]), next])
                }
                RxState::Chunk { chan, have, len } => {
                    let (id, have, len) = (*chan, *have, *len);
                    let inc = self.chans.get(&id).and_then(|c| c.incoming.as_ref()).expect("chunk of a message");
                    match (inc.target, &inc.pool) {
                        (Target::Land, Some(pool)) => {
                            let at = inc.offset + inc.got + have;
                            let part = RecvPart::mapping(&pool.map, at, len - have).expect("checked range");
                            sys::recv_parts(self.stream.as_fd(), &[part, next])
                        }
                        _ => {
                            self.scratch.resize(MAX_CHUNK, 0);
                            let part = RecvPart::slice(&mut self.scratch[..len - have]);
                            sys::recv_parts(self.stream.as_fd(), &[part, next])
                        }
                    }
                }
            };
            let n = match got {
                Ok(usize::MAX) => 0,
                Ok(0) => return Err(self.stream_ended()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return Err(self.stream_ended()),
            };
            self.last_rx = Instant::now();
            match self.rx {
                RxState::Head { have } => {
                    if have + n < MUX_HEAD {
                        self.rx = RxState::Head { have: have + n };
                        continue;
                    }
                    let head = MuxHead::decode(&self.head)?;
                    if head.len == 0 {
                        self.rx = RxState::Head { have: 0 };
                        self.frame(head)?;
                        return Ok(true);
                    }
                    if head.kind == K_CHUNK {
                        self.start_chunk(head)?;
                    } else {
                        self.rx = RxState::Body { head, have: 0 };
                    }
                }
                RxState::Body { head, have } => {
                    if have + n < head.len as usize {
                        self.rx = RxState::Body { head, have: have + n };
                        continue;
                    }
                    self.read_ahead(have + n - head.len as usize);
                    self.frame(head)?;
                    return Ok(true);
                }
                RxState::Chunk { chan, have, len } => {
                    if have + n < len {
                        self.rx = RxState::Chunk { chan, have: have + n, len };
                        continue;
                    }
                    self.read_ahead(have + n - len);
                    self.end_chunk(chan, len);
                    return Ok(true);
                }
            }
        }
    }

    /// A frame is complete and `extra` bytes of the next header came with
    /// it: they start the next header.
    fn read_ahead(&mut self, extra: usize) {
        self.head[..extra].copy_from_slice(&self.next[..extra]);
        self.rx = RxState::Head { have: extra };
    }

    fn stream_ended(&mut self) -> Error {
        if self.goodbye_seen {
            return self.fail(Error::PeerGone, false);
        }
        self.fail(Error::PeerGone, true)
    }

    fn chan_of(&mut self, head: &MuxHead) -> Result<&mut Chan> {
        self.chans
            .get_mut(&head.channel)
            .ok_or_else(|| Error::Protocol(format!("frame for channel {} which is not open", head.channel)))
    }

    fn start_chunk(&mut self, head: MuxHead) -> Result<()> {
        let chan = self.chan_of(&head)?;
        let inc = chan.incoming.as_ref().ok_or_else(|| Error::Protocol("payload chunk without its message".into()))?;
        let len = head.len as usize;
        if len > inc.len - inc.got {
            return Err(Error::Protocol("payload chunk beyond the announced length".into()));
        }
        if matches!(inc.target, Target::Discard) {
            chan.stats.payload_staged += len as u64;
        } else {
            chan.stats.payload_received += len as u64;
        }
        self.rx = RxState::Chunk { chan: head.channel, have: 0, len };
        Ok(())
    }

    fn end_chunk(&mut self, id: u32, len: usize) {
        let chan = self.chans.get_mut(&id).expect("chunk of an open channel");
        let inc = chan.incoming.as_mut().expect("chunk of a message");
        inc.got += len;
        if inc.got == inc.len {
            let inc = chan.incoming.take().expect("present");
            let Some(msg) = inc.msg else { return };
            if let (Target::Land, Some(buf)) = (inc.target, buffer_of(&msg)) {
                if inc.copy {
                    chan.copied_in.insert(buf);
                } else {
                    chan.copied_in.remove(&buf);
                }
            }
            chan.inq.push_back((msg, true));
            chan.wake();
        }
    }

    /// A complete frame other than a chunk.
    fn frame(&mut self, head: MuxHead) -> Result<()> {
        let body_len = head.len as usize;
        match head.kind {
            K_KEEPALIVE => Ok(()),
            K_GOODBYE => {
                self.goodbye_seen = true;
                Ok(())
            }
            K_OPEN => {
                let body = self.body[..body_len].to_vec();
                match self.chans.get_mut(&head.channel) {
                    Some(chan) if matches!(chan.state, ChanState::Listening { .. }) && chan.setup_in.is_none() => {
                        chan.setup_in = Some(body);
                        chan.wake();
                        Ok(())
                    }
                    Some(_) => Err(Error::Protocol(format!("open of channel {} which is taken", head.channel))),
                    // A newer open of the same number replaces the older
                    // (its binder gave up and tried again).
                    None if self.unclaimed.len() < MAX_UNCLAIMED || self.unclaimed.contains_key(&head.channel) => {
                        self.unclaimed.insert(head.channel, body);
                        Ok(())
                    }
                    None => Err(Error::Protocol("too many opens of channels nobody listens on".into())),
                }
            }
            K_REPLY => {
                let body = self.body[..body_len].to_vec();
                let chan = self.chan_of(&head)?;
                if chan.detached {
                    return Ok(());
                }
                if !matches!(chan.state, ChanState::Binding) || chan.setup_in.is_some() {
                    return Err(Error::Protocol(format!("open reply for channel {} which did not ask", head.channel)));
                }
                chan.setup_in = Some(body.clone());
                chan.wake();
                // Accepted: the creator may send at once, before the
                // binder's setup has seen the reply (which it then checks).
                if let Ok((neg, depth)) = setup_msg::parse_reply(&body) {
                    self.open(head.channel, &neg, depth);
                }
                Ok(())
            }
            K_CREDIT => {
                let chan = self.chan_of(&head)?;
                chan.credit = chan.credit.saturating_add(head.credit as usize).min(1 << 24);
                Ok(())
            }
            K_CLOSE => {
                let id = head.channel;
                // A binder that gave up before its open was answered: the
                // close goes back so it can free the number.
                if !self.chans.contains_key(&id) && self.unclaimed.remove(&id).is_some() {
                    self.queue_ctrl(K_CLOSE, id, Vec::new(), 0);
                    return Ok(());
                }
                let chan = self.chan_of(&head)?;
                if matches!(chan.state, ChanState::Listening { .. }) {
                    chan.setup_in = None;
                    self.queue_ctrl(K_CLOSE, id, Vec::new(), 0);
                    return Ok(());
                }
                if chan.peer_closed.is_some() || chan.incoming.is_some() {
                    return Err(Error::Protocol(format!("close of channel {id} out of order")));
                }
                chan.peer_closed = Some(head.flags & FLAG_ABORT != 0);
                chan.wake();
                if chan.detached && chan.close_sent {
                    self.chans.remove(&id);
                }
                Ok(())
            }
            K_MESSAGE => self.message(head),
            _ => Err(Error::Protocol("unexpected frame kind".into())),
        }
    }

    /// A message frame: check it, and queue it (or expect its payload).
    fn message(&mut self, head: MuxHead) -> Result<()> {
        let body_len = head.len as usize;
        let h = &self.body[..body_len];
        let id = head.channel;
        let chan = self
            .chans
            .get_mut(&id)
            .ok_or_else(|| Error::Protocol(format!("message for channel {id} which is not open")))?;
        if chan.peer_closed.is_some() || chan.incoming.is_some() {
            return Err(Error::Protocol(format!("message for channel {id} out of order")));
        }
        if chan.detached {
            // Closed here (or given up while binding) and the peer does not
            // know yet: read and drop, payload included.
            let flags = self.body[1];
            let len = u64::from_le_bytes(self.body[8..16].try_into().expect("8 bytes"));
            if flags & FLAG_PAYLOAD != 0 && len > 0 {
                let len = usize::try_from(len).map_err(|_| Error::Protocol("payload too long".into()))?;
                let inc =
                    Incoming { msg: None, pool: None, offset: 0, len, got: 0, target: Target::Discard, copy: false };
                self.chans.get_mut(&id).expect("present").incoming = Some(inc);
            }
            return Ok(());
        }
        if !matches!(chan.state, ChanState::Open) {
            return Err(Error::Protocol(format!("message for channel {id} before it was open")));
        }
        if chan.allowed == 0 && chan.inq.len() >= chan.depth + CREDIT_SLACK {
            return Err(Error::Protocol(format!("channel {id}: message beyond its credit")));
        }
        chan.allowed = chan.allowed.saturating_sub(1);
        let head = proto::SlotHead::read(h)
            .ok_or_else(|| Error::Protocol(format!("channel {id}: message shorter than its header")))?;
        let proto::SlotHead { op: kind, flags, meta_len: meta, index, aux, pool } = head;
        let bad = |what: String| Error::Protocol(format!("channel {id}, message type {kind}: {what}"));
        if MSG_HEAD + meta != body_len {
            return Err(bad("meta length does not match the frame".into()));
        }
        if proto::body_limit(kind, chan.meta_size).is_none() {
            return Err(bad("unknown message type".into()));
        }
        let msg = Message::decode(h, chan.meta_size)?;
        let payload = flags & FLAG_PAYLOAD != 0;
        let buf = BufferId { pool, index };
        let gate = chan.gate.as_mut();
        match (kind, payload) {
            (TYPE_MOVE | TYPE_COPY | TYPE_PASS, true) => {
                let p = chan.pools.get(&pool).ok_or_else(|| bad(format!("pool {pool} not on this channel")))?.clone();
                if index >= p.geometry.count() {
                    return Err(bad(format!("buffer index {index} out of range")));
                }
                let size = p.geometry.buffer_size();
                if aux != size as u64 {
                    return Err(bad(format!("payload of {aux} bytes for a pool of {size}-byte buffers")));
                }
                let gate = gate.ok_or_else(|| bad("payload before the channel was polled".into()))?;
                let probe = head.payload_probe().expect("a move, copy or pass");
                let target = match gate.admit(&probe)? {
                    Landing::Land => Target::Land,
                    Landing::Discard => Target::Discard,
                };
                chan.incoming = Some(Incoming {
                    msg: Some(msg),
                    pool: Some(p),
                    offset: index as usize * size,
                    len: size,
                    got: 0,
                    target,
                    copy: kind == TYPE_COPY,
                });
                chan.stats.frames_received += 1;
                return Ok(());
            }
            (TYPE_COPY, false) => {
                let probe = Message::Copy { buf, meta: Meta::empty() };
                let gate = gate.ok_or_else(|| bad("copy before the channel was polled".into()))?;
                if gate.admit(&probe)? == Landing::Land && !chan.copied_in.contains(&buf) {
                    return Err(bad("copy without payload of a buffer we never received".into()));
                }
            }
            (TYPE_MOVE, false) => return Err(bad("move without its payload".into())),
            (_, true) => return Err(bad("payload on a message that carries none".into())),
            (_, false) => {}
        }
        chan.stats.frames_received += 1;
        chan.inq.push_back((msg, false));
        chan.wake();
        Ok(())
    }

    /// Register a pool of channel `id`.
    fn register(&mut self, id: u32, memory: &Arc<PoolMemory>) -> Result<()> {
        let chan = self.chans.get_mut(&id).ok_or(Error::PeerGone)?;
        if chan.pools.get(&memory.id()).is_some_and(|p| Arc::ptr_eq(&p.memory, memory)) {
            return Ok(());
        }
        let map = memory.map(Access::ReadWrite, 1)?;
        chan.pools.insert(memory.id(), Arc::new(LinkPool { map, geometry: memory.geometry(), memory: memory.clone() }));
        Ok(())
    }
}

/// The buffer a move, copy or pass carries.
fn buffer_of(msg: &Message) -> Option<BufferId> {
    match msg {
        Message::Move { buf, .. } | Message::Copy { buf, .. } | Message::Pass { buf, .. } => Some(*buf),
        _ => None,
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.gone.is_some() {
            return;
        }
        // The last handle is gone: what is queued, then goodbye.
        self.queue_ctrl(K_GOODBYE, 0, Vec::new(), 0);
        let deadline = Instant::now() + CLOSE_FLUSH.min(self.options.peer_timeout);
        while self.pump_write().is_ok() && self.has_output() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
            let _ = poll_out(&self.stream, left);
        }
        let _ = self.stream.shutdown(Shutdown::Write);
        let mut sink = [0u8; 4096];
        while matches!((&self.stream).read(&mut sink), Ok(n) if n > 0) {}
    }
}

fn poll_out(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    use rustix::event::{PollFd, PollFlags};
    let mut pfd = [PollFd::from_borrowed_fd(stream.as_fd(), PollFlags::OUT | PollFlags::IN)];
    match rustix::event::poll(&mut pfd, Some(&crate::wake::timespec(timeout))) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

// --------------------------------------------------------------------- link

/// One channel end on a session.
struct MuxLink {
    session: MuxSession,
    id: u32,
    closed: bool,
    /// Grant credit after this many messages taken.
    grant_every: usize,
    /// The channel's queue depth (its credit): the longest run of messages
    /// that can ever be queued at once.
    depth: usize,
    died: bool,
    /// The counters as they were when the channel closed.
    final_stats: LinkStats,
}

impl MuxLink {
    fn new(session: MuxSession, id: u32) -> MuxLink {
        let depth = session.lock().chans.get(&id).map_or(1, |c| c.depth);
        MuxLink {
            session,
            id,
            closed: false,
            grant_every: (depth / 4).max(1),
            depth,
            died: false,
            final_stats: LinkStats::default(),
        }
    }
}

impl Link for MuxLink {
    fn has_room(&mut self) -> bool {
        let mut inner = self.session.lock();
        let _ = inner.pump_write();
        inner.chans.get(&self.id).is_some_and(|c| c.outq.len() < c.depth)
    }

    fn room(&mut self) -> usize {
        let mut inner = self.session.lock();
        let _ = inner.pump_write();
        inner.chans.get(&self.id).map_or(0, |c| c.depth.saturating_sub(c.outq.len()))
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
        {
            let chan = inner.chans.get_mut(&id).ok_or(Error::PeerGone)?;
            if chan.gate.is_none() {
                chan.gate = gate.detach();
            }
        }
        let read = inner.pump_read(Some(id));
        let chan = inner.chans.get_mut(&id).ok_or(Error::PeerGone)?;
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
                inner.queue_ctrl(K_CREDIT, id, Vec::new(), n as u32);
                let _ = inner.pump_write();
            }
            return Ok(Some(msg));
        }
        let ended = match chan.peer_closed {
            Some(abort) if chan.incoming.is_none() => Some((Error::PeerGone, abort)),
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
        if let Some((e, _)) = inner.chans.get(&self.id).and_then(|c| c.peer_closed.map(|a| (Error::PeerGone, a))) {
            return Err(e);
        }
        inner.pump_write()
    }

    fn register(&mut self, wake: &WakeSet) -> Result<()> {
        let inner = self.session.lock();
        let chan = inner.chans.get(&self.id).ok_or(Error::PeerGone)?;
        wake.watch(chan.bell.fd().as_fd(), Interest::Read)?;
        wake.watch(inner.stream.as_fd(), Interest::Read)?;
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
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let mut guard = self.session.lock();
        let inner = &mut *guard;
        if inner.pump_read(Some(self.id)).is_err() {
            return Arm::Ready;
        }
        let Some(chan) = inner.chans.get_mut(&self.id) else { return Arm::Ready };
        if !chan.inq.is_empty() || chan.peer_closed.is_some() {
            return Arm::Ready;
        }
        let _ = chan.bell.reset();
        chan.armed = true;
        match inner.arm_socket(wake) {
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
            if chan.close_sent && inner.wire.is_empty() {
                if chan.peer_closed.is_some() {
                    inner.chans.remove(&id);
                }
                break;
            }
            drop(inner);
            let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
            let _ = poll_out(&stream, left.min(Duration::from_millis(50)));
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
    fn queue(&mut self, msg: &Message, with_payload: bool, last: bool) -> Result<()> {
        let mut guard = self.session.lock();
        let inner = &mut *guard;
        inner.check()?;
        let chan = inner.chans.get_mut(&self.id).ok_or(Error::PeerGone)?;
        if chan.peer_closed.is_some() || chan.close_queued.is_some() {
            return Err(Error::PeerGone);
        }
        if !last && chan.outq.len() >= chan.depth {
            inner.pump_write()?;
            let chan = inner.chans.get_mut(&self.id).ok_or(Error::PeerGone)?;
            if chan.outq.len() >= chan.depth {
                return Err(Error::QueueFull);
            }
        }
        let chan = inner.chans.get_mut(&self.id).ok_or(Error::PeerGone)?;
        let mut h = [0u8; MSG_HEAD + proto::MAX_META_SIZE];
        msg.encode(&mut h);
        let meta = usize::from(u16::from_le_bytes([h[2], h[3]]));
        let mut payload = None;
        if let (true, Some(buf)) = (with_payload, buffer_of(msg)) {
            let pool = chan
                .pools
                .get(&buf.pool)
                .ok_or_else(|| Error::Protocol(format!("pool {} unknown to the session", buf.pool)))?;
            let size = pool.geometry.buffer_size();
            h[1] |= FLAG_PAYLOAD;
            h[8..16].copy_from_slice(&(size as u64).to_le_bytes());
            payload = Some((pool.clone(), buf.index as usize * size, size));
        }
        let body = &h[..MSG_HEAD + meta];
        let mut head = MuxHead { kind: K_MESSAGE, flags: 0, channel: self.id, len: body.len() as u32, credit: 0 }
            .encode()
            .to_vec();
        head.extend_from_slice(body);
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any 16 bytes decode to a header or a protocol error, never a
        /// panic; what decodes encodes back to the same bytes.
        #[test]
        fn decode_never_panics(bytes in proptest::array::uniform16(any::<u8>())) {
            match MuxHead::decode(&bytes) {
                Ok(head) => prop_assert_eq!(head.encode(), bytes),
                Err(e) => prop_assert!(matches!(e, Error::Protocol(_))),
            }
        }

        /// Valid headers of every kind survive the round trip.
        #[test]
        fn valid_heads_round_trip(kind in 1u8..=8, channel in 1u32.., len in 0u32..70_000, credit in 0u32..5) {
            let session = matches!(kind, K_KEEPALIVE | K_GOODBYE);
            let head = MuxHead { kind, flags: 0, channel: if session { 0 } else { channel }, len, credit };
            if let Ok(back) = MuxHead::decode(&head.encode()) {
                prop_assert_eq!(back, head);
            }
        }
    }

    /// The fuzz target's entry on a few streams: valid frames for both
    /// channels, a chunk landing in buffer 0, and garbage.
    #[cfg(feature = "fuzzing")]
    #[test]
    fn fuzz_entry_runs_on_sample_streams() {
        let mut stream = vec![8u8];
        let mut msg = [0u8; MSG_HEAD + 8];
        Message::Move { buf: BufferId { pool: PoolId::from_u128(0xf00d), index: 0 }, meta: Meta::empty() }
            .encode(&mut msg);
        msg[1] |= FLAG_PAYLOAD;
        msg[8..16].copy_from_slice(&4096u64.to_le_bytes());
        stream.extend_from_slice(&MuxHead { kind: K_MESSAGE, flags: 0, channel: 1, len: 32, credit: 0 }.encode());
        stream.extend_from_slice(&msg[..32]);
        stream.extend_from_slice(&MuxHead { kind: K_CREDIT, flags: 0, channel: 2, len: 0, credit: 3 }.encode());
        stream.extend_from_slice(&MuxHead { kind: K_CHUNK, flags: 0, channel: 1, len: 4096, credit: 0 }.encode());
        stream.extend_from_slice(&[7u8; 4096]);
        stream.extend_from_slice(&MuxHead { kind: K_CLOSE, flags: 0, channel: 2, len: 0, credit: 0 }.encode());
        crate::fuzzing::mux_stream_from_peer(&stream);
        crate::fuzzing::mux_stream_from_peer(&[3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]);
        crate::fuzzing::mux_stream_from_peer(&[]);
    }

    struct LandAll;
    impl PayloadGate for LandAll {
        fn admit(&mut self, _: &Message) -> Result<Landing> {
            Ok(Landing::Land)
        }
        fn detach(&self) -> Option<Box<dyn PayloadGate + Send>> {
            Some(Box::new(LandAll))
        }
    }

    /// A payload in two chunks with another channel's frames between them
    /// lands whole in the named buffer of the right channel, and each
    /// channel gets its own message, whichever of them reads the socket.
    #[test]
    fn chunks_of_interleaved_channels_land_in_their_buffers() {
        use std::io::Write;
        use std::os::fd::OwnedFd;
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let session = MuxSession::over(TcpStream::from(OwnedFd::from(ours)));
        let mut links = [session.open_link(1, 8, 8), session.open_link(2, 8, 8)];
        let g = Geometry::new(8192, 2).unwrap();
        let pools: Vec<_> =
            (0..2).map(|i| PoolMemory::mirror(PoolId::from_u128(0x100 + i), g, None).unwrap()).collect();
        for (link, pool) in links.iter_mut().zip(&pools) {
            link.use_pool(pool).unwrap();
            link.set_gate(Box::new(LandAll));
        }
        let frame = |kind, channel, body: &[u8]| {
            let mut f = MuxHead { kind, flags: 0, channel, len: body.len() as u32, credit: 0 }.encode().to_vec();
            f.extend_from_slice(body);
            f
        };
        let message = |pool: u128, index: u32| {
            let mut h = [0u8; MSG_HEAD];
            let buf = BufferId { pool: PoolId::from_u128(pool), index };
            Message::Move { buf, meta: Meta::empty() }.encode(&mut h);
            h[1] |= FLAG_PAYLOAD;
            h[8..16].copy_from_slice(&8192u64.to_le_bytes());
            h
        };
        let mut stream = frame(K_MESSAGE, 1, &message(0x100, 1));
        stream.extend(frame(K_CHUNK, 1, &[1u8; 4096]));
        stream.extend(frame(K_MESSAGE, 2, &message(0x101, 0)));
        stream.extend(frame(K_CHUNK, 2, &[2u8; 8192]));
        stream.extend(frame(K_CHUNK, 1, &[3u8; 4096]));
        theirs.write_all(&stream).unwrap();
        // Channel 2 polls first: it reads channel 1's frames on the way.
        let two = links[1].recv(&mut LandAll).unwrap();
        assert!(matches!(two, Some(Message::Move { buf, .. }) if buf.index == 0));
        let one = links[0].recv(&mut LandAll).unwrap();
        assert!(matches!(one, Some(Message::Move { buf, .. }) if buf.index == 1));
        let bytes = |pool: &Arc<PoolMemory>, index: usize| {
            let map = pool.map(Access::Read, 1).unwrap();
            // SAFETY: the mapping is live and 2 × 8192 bytes long; nothing
            // writes the pool while the test reads it.
            unsafe { std::slice::from_raw_parts(map.as_ptr().add(index * 8192), 8192) }.to_vec()
        };
        let got = bytes(&pools[0], 1);
        assert!(got[..4096].iter().all(|&b| b == 1) && got[4096..].iter().all(|&b| b == 3));
        assert!(bytes(&pools[1], 0).iter().all(|&b| b == 2));
        assert!(bytes(&pools[0], 0).iter().all(|&b| b == 0), "the other buffer is untouched");
        assert_eq!(links[0].stats().unwrap().payload_received, 8192);
        assert_eq!(links[0].recv(&mut LandAll).unwrap(), None);
    }

    #[test]
    fn decode_checks_each_field() {
        let ok = MuxHead { kind: K_CHUNK, flags: 0, channel: 3, len: 100, credit: 0 };
        assert_eq!(MuxHead::decode(&ok.encode()), Ok(ok));
        for bad in [
            MuxHead { kind: 0, ..ok },
            MuxHead { kind: 9, ..ok },
            MuxHead { len: 0, ..ok },
            MuxHead { len: MAX_CHUNK as u32 + 1, ..ok },
            MuxHead { channel: 0, ..ok },
            MuxHead { flags: 1, ..ok },
            MuxHead { credit: 1, ..ok },
            MuxHead { kind: K_KEEPALIVE, channel: 1, len: 0, ..ok },
            MuxHead { kind: K_CREDIT, len: 0, credit: 0, ..ok },
            MuxHead { kind: K_MESSAGE, len: 31, ..ok },
            MuxHead { kind: K_OPEN, len: setup_msg::MAX_LEN as u32 + 1, ..ok },
        ] {
            assert!(matches!(MuxHead::decode(&bad.encode()), Err(Error::Protocol(_))), "{bad:?}");
        }
        let mut reserved = ok.encode();
        reserved[2] = 1;
        assert!(MuxHead::decode(&reserved).is_err());
    }
}
