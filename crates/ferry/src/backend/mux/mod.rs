//! Early demultiplexing: many channels between two hosts over one TCP
//! connection, after the application device channels of Druschel,
//! Peterson and Davie ("Experiences with a High-Speed Network Adaptor: A
//! Software Perspective", SIGCOMM 1994).
//!
//! A [`MuxSession`] is one TCP connection shared by the channels opened on
//! it. Each side opens logical channels by number
//! ([`MuxSession::endpoint`]): one side creates (`Channel::create` or
//! `Channel::accept` on the endpoint), the other binds, with the usual
//! [`ChannelSetup`](crate::ChannelSetup) and [`BindParams`](crate::BindParams). From then on they are ordinary
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
//! takes messages (in grants of a quarter of the depth, written with the
//! next frames that side sends: its reply, or the write of its next poll
//! that finds nothing, so that a round trip costs the peer one wake-up,
//! not two; a grant never waits behind another, so a receiver that only
//! takes keeps its sender at most one grant short). Payload bytes need
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
//! [`MAX_CHUNK`] bytes, each its own frame. The scheduler commits a few
//! frames at a time (about 256 KiB) to one vectored send; a frame of a
//! higher priority goes before committed frames of lower priority that
//! have not started to go out. So a bulk channel's large buffer delays a
//! priority frame by at most the one chunk half out plus what the kernel
//! holds, and the kernel holds little: the socket takes more only while
//! fewer than [`UNSENT_LOW_WATER`] bytes of what it took are unsent
//! (`TCP_NOTSENT_LOWAT`), and its send buffer is kept small
//! ([`SEND_BUFFER`]). What the peer's kernel has received and its
//! application not yet read is ahead of a priority frame too: the
//! receiver reads the stream in order. So the session also keeps a *bulk
//! budget* ([`MuxSession::set_bulk_budget`], default [`BULK_BUDGET`]): the
//! receiver reports the bytes it has read from the connection (a *read
//! report* every [`READ_REPORT_EVERY`] bytes), and the sender commits a
//! frame of a bulk channel (priority 0) only while the bytes on their way
//! — committed, not yet reported read — stay within the budget. Frames of
//! channels of higher priority and the session's own frames are never
//! held. What a priority frame queues behind, in the sender's queue and
//! in both kernels together, is then at most the budget, plus frames of
//! priority channels and of the session committed before it. A channel's
//! priority also orders reading: a poll of a channel that reads the connection for its own
//! message stops once a message of a channel of higher priority is
//! complete (that channel's doorbell rings), so an application's loop gets
//! back to its priority channel instead of reading on through bulk.
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
//! [`MuxSession::accept`] serves the connections on its listener side by
//! side: the first whose magic arrives becomes the session. Each
//! connection has [`HANDSHAKE_TIMEOUT`] to send its magic, and at most
//! [`MAX_HANDSHAKES`] wait at once (one more closes the oldest); so silent
//! connections delay a good client by nothing. A [`MuxListener`] accepts
//! session after session and keeps the connections still handshaking from
//! one call to the next; the one-shot [`MuxSession::accept`] closes them
//! when it returns.
//!
//! # TLS
//!
//! With [`Security::Tls`](crate::tls::Security::Tls) in the session's
//! [`NetOptions`], the whole connection is one TLS 1.3 connection from the
//! first byte after the TCP connect (the magic and every frame are its
//! plaintext; the connecting side is the TLS client). The handshake runs
//! within the same deadline as the magic, side by side with the other
//! connections of a listener; one that fails it (no certificate, one the
//! CA did not sign, plain text) is closed like a silent one. Chunks are
//! encrypted from the buffer's memory and decrypted into the target
//! buffer; only authenticated bytes land, and a record that fails its
//! authentication ends the session with [`ErrorKind::Tls`]. TLS holds at most
//! one chunk of ciphertext for the socket beyond what the kernel holds, so
//! priority frames queue behind little more than without it. A plain
//! session to or from an address that is not a loopback address needs
//! [`Security::None`](crate::tls::Security::None) on purpose.
//!
//! # What a peer can make a session hold
//!
//! Everything a peer can make this side keep is bounded, and a peer that
//! reads what it is sent never reaches a bound:
//!
//! - *Control frames waiting for the connection* (open replies, closes,
//!   credit grants, read reports, keep-alives): at most the session's
//!   control limit ([`MuxSession::set_control_limit`], default
//!   [`CONTROL_LIMIT`], 1 MiB). A peer provokes them (each close of a
//!   channel it opened is answered with a close, each message taken gives
//!   credit back, each [`READ_REPORT_EVERY`] bytes read are reported); a
//!   grant or report behind one of its kind that still waits is merged
//!   into it, so a peer that reads keeps a few frames per channel waiting.
//!   One that provokes more than the limit without reading is cut off:
//!   the session fails with [`ErrorKind::PeerBacklog`] on every channel and
//!   what was lent over it comes back, as when a peer dies. This side's
//!   own opens never count against the peer: past the limit a bind says
//!   [`ErrorKind::QueueFull`].
//! - *Opens nobody listens on*: 64 bind requests of at most 64 bytes; one
//!   more is a protocol error.
//! - *Messages of a channel its application has not taken*: the channel's
//!   queue depth (its credit) plus 64 (a closing end's last messages); one
//!   more is a protocol error. Payloads land in the buffers the messages
//!   name: they take no memory of the session's.
//! - *A payload on its way*: one per channel, read straight into its
//!   buffer (or, for a channel closed here, into one 64 KiB scratch buffer
//!   and dropped).
//! - *Time*: a peer that sends nothing for the peer timeout, or takes
//!   nothing of what waits for it as long, is declared dead
//!   ([`ErrorKind::PeerUnresponsive`]).
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
//!   most the chunk going out, plus what the kernel has queued. A chunk is
//!   one frame of its own, read straight into the buffer at its offset.
//! - *A low-water mark for unsent bytes, not only a small send buffer.*
//!   Bytes handed to the kernel leave in the order they were handed over,
//!   so every unsent byte there is a byte a priority frame waits behind
//!   that the scheduler can no longer reorder. `TCP_NOTSENT_LOWAT` bounds
//!   exactly those (HTTP/2 servers use it for the same reason), whatever
//!   the send buffer holds of bytes sent and not yet acknowledged.
//! - *A budget at the sender, not a small receive buffer.* The receiver's
//!   kernel fills with whatever the sender wrote until its application
//!   reads it; a small receive buffer bounds that, but it also closes the
//!   TCP window on the bulk channels whenever the reader is late, and
//!   (measured on loopback) made priority round trips longer, not shorter.
//!   The sender knows which frames are bulk and can hold exactly those;
//!   the read reports cost one 16-byte frame per [`READ_REPORT_EVERY`]
//!   bytes read.
//! - *Header read-ahead.* Each body or chunk is read together with the next
//!   frame's header (into the session's own 16 bytes, never into a
//!   buffer), so a stream of frames costs one `recvmsg` each.
//!
//! # Wire format, version 3 (little endian)
//!
//! Both ends first send a hello: the 8 bytes `FERRYMX3` and their peer
//! timeout in milliseconds (u32); each sends keep-alives for the shorter of
//! the two. Then frames:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | kind: 1 message, 2 payload chunk, 3 credit, 4 open, 5 open reply, 6 close, 7 keep-alive, 8 goodbye, 9 read report |
//! | 1 | 1 | flags: close: bit 0 abort (the sender's end failed) |
//! | 2 | 2 | zero |
//! | 4 | 4 | channel (0 for keep-alive, goodbye and read report, which are the session's) |
//! | 8 | 4 | body length |
//! | 12 | 4 | credit: messages granted (credit frames), bytes read (read reports); zero otherwise |
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
//!   shorter of the two ends' peer timeouts; *goodbye*: the session ends on purpose.
//! - *read report*: the sender of the report has read this many more bytes
//!   of the stream (counted from the first byte after the magic, every
//!   frame whole: headers, bodies, chunks). A receiver reports once it
//!   has read [`READ_REPORT_EVERY`] bytes or more since its last report,
//!   with the next frames it writes (at the latest when one of its
//!   channels polls and finds nothing, or arms, or when the next report
//!   comes due)
//!   (without a body, at least one byte); reports never add up to more
//!   than the bytes the peer wrote. A sender must not rely on a report
//!   for fewer than [`READ_REPORT_EVERY`] bytes, so it never keeps less
//!   than [`MIN_BULK_BUDGET`] on the way.
//!
//! Anything else — an unknown kind, lengths that do not fit the kind, a
//! frame for a channel that was never opened, a chunk without a message,
//! a message beyond the credit, a payload the gate refuses, a read report
//! beyond the bytes written — is a protocol
//! error: the session stops, every channel on it fails with
//! [`ErrorKind::Protocol`] on the receiving side, and the peer sees its
//! connection end. The end of the stream without a goodbye fails every
//! open channel with [`ErrorKind::PeerGone`], and the buffers lent to the peer
//! come back.

mod codec;
mod demux;
mod link;
mod session;
mod setup;
mod wire;

use crate::ErrorKind;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Endpoint;
use crate::error::{Error, Result, ResultExt};
use crate::sys::RecvPart;
use crate::tls::TlsSession;
use crate::NetOptions;
use codec::MAGIC;
use session::Inner;

pub use codec::{MuxHead, MAX_CHUNK, MUX_HEAD};
pub use session::{CONTROL_LIMIT, MIN_CONTROL_LIMIT};
pub use wire::{BULK_BUDGET, MIN_BULK_BUDGET, READ_REPORT_EVERY, SEND_BUFFER, UNSENT_LOW_WATER};

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
    ///
    /// With [`Security::Tls`](crate::tls::Security::Tls) in `options`, the
    /// TLS handshake and the magic both happen within `timeout`; a plain
    /// session to an address that is not a loopback address needs
    /// [`Security::None`](crate::tls::Security::None) on purpose
    /// ([`ErrorKind::InsecureAddress`]).
    pub fn connect(addr: SocketAddr, options: NetOptions, timeout: Duration) -> Result<MuxSession> {
        MuxSession::connect_bare(addr, options, timeout).context(|| format!("open a mux session with {addr}"))
    }

    /// [`MuxSession::connect`], its errors without context.
    fn connect_bare(addr: SocketAddr, options: NetOptions, timeout: Duration) -> Result<MuxSession> {
        options.security.check_address(addr)?;
        let tls = options.tls_client(TLS_SEND_LIMIT)?;
        let timeout = timeout.max(Duration::from_millis(1));
        let deadline = Instant::now() + timeout;
        let stream = super::net::connect_stream(addr, timeout)?;
        let mut hs = Handshake::new(stream, tls, deadline, options.peer_timeout).ok_or(ErrorKind::PeerGone)?;
        loop {
            if hs.poll(Instant::now()).map_err(|e| hs.error(e))? {
                return MuxSession::established(hs, options);
            }
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            let _ = wait_handshakes(None, std::slice::from_ref(&hs), left);
        }
    }

    /// Accept one session on `listener` (waiting up to `timeout`; the
    /// listener is left non-blocking).
    ///
    /// Connections are served side by side, as they come: the first whose
    /// magic arrives becomes the session, so connections that stay silent
    /// (or send something else) delay nobody. Each has
    /// [`HANDSHAKE_TIMEOUT`] (at most `timeout`) to send its magic and is
    /// closed then; at most [`MAX_HANDSHAKES`] are served at once, one
    /// more closes the oldest. Connections taken off the listener whose
    /// magic has not arrived when this returns are closed: a server that
    /// accepts many sessions uses a [`MuxListener`], which keeps them for
    /// its next call.
    ///
    /// With [`Security::Tls`](crate::tls::Security::Tls) in `options`, each
    /// connection's TLS handshake runs within its handshake deadline too,
    /// and one that fails it (no certificate, one the CA did not sign,
    /// plain text) is closed like a silent one. A plain session on a
    /// listener whose address is not a loopback address needs
    /// [`Security::None`](crate::tls::Security::None) on purpose
    /// ([`ErrorKind::InsecureAddress`]).
    pub fn accept(listener: &TcpListener, options: NetOptions, timeout: Duration) -> Result<MuxSession> {
        check_listener(listener, &options)?;
        let deadline = Instant::now() + timeout.max(Duration::from_millis(1));
        accept_session(listener, &mut VecDeque::new(), &options, deadline, Some(deadline))
    }

    /// A session over a stream whose magic was exchanged.
    fn established(hs: Handshake, options: NetOptions) -> Result<MuxSession> {
        let peer_timeout = hs.peer_timeout();
        let Handshake { stream, tls, .. } = hs;
        let peer = stream.peer_addr().ok();
        let _ = stream.set_nodelay(true);
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(stream.as_fd(), SEND_BUFFER);
        let inner = Inner::new(stream, tls, options, peer_timeout)?;
        Ok(MuxSession { shared: Arc::new(Shared { inner: Mutex::new(inner), peer }) })
    }

    /// A session over any connected stream socket whose magic was exchanged
    /// already (fuzzing: one end of a socket pair).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn over(stream: TcpStream) -> MuxSession {
        let options = NetOptions::default();
        let peer_timeout = options.peer_timeout;
        let inner = Inner::new(stream, None, options, peer_timeout).expect("socket options");
        MuxSession { shared: Arc::new(Shared { inner: Mutex::new(inner), peer: None }) }
    }

    /// An open channel `id` on this session as a link (fuzzing: frames for
    /// it without a peer that set it up).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn open_link(&self, id: u32, meta_size: usize, depth: u32) -> Box<dyn super::Link> {
        let mut inner = self.lock();
        inner.chans.insert(id, session::Chan::new(session::ChanState::Binding, 0).expect("eventfd"));
        let neg = crate::setup::Negotiated {
            binder_direction: crate::setup::Direction::Rx,
            binder_role: crate::setup::Role::Slave,
            creator_role: crate::setup::Role::Master,
            trust: crate::pool::TrustLevel::Full,
            meta_size,
            constraints: crate::setup::ChannelConstraints::default(),
        };
        inner.open(id, &neg, depth);
        drop(inner);
        Box::new(link::MuxLink::new(self.clone(), id))
    }

    /// The endpoint of logical channel `channel` (1 or more) on this
    /// session, at the default priority 0. One side creates the channel
    /// there, the other binds. A number is in use from `create` or `bind`
    /// until the channel is closed on both sides; a bind that gave up
    /// (timed out, refused) frees its number once the peer has answered
    /// the give-up (meanwhile `bind` and `create` on it say
    /// [`ErrorKind::EndpointInUse`]).
    pub fn endpoint(&self, channel: u32) -> Endpoint {
        self.endpoint_with_priority(channel, 0)
    }

    /// As [`MuxSession::endpoint`], with a priority for what this side
    /// sends on it: frames of a higher priority go first. Reading on this
    /// side, a poll of a channel of lower priority stops reading the
    /// connection once a message of this one has arrived.
    pub fn endpoint_with_priority(&self, channel: u32, priority: u8) -> Endpoint {
        Endpoint::Mux(MuxEndpoint { session: self.clone(), channel, priority })
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.shared.peer
    }

    /// What this side sends: keep at most `bytes` on their way before a
    /// frame of bulk (a channel at priority 0) goes out — bytes committed
    /// to the connection that the peer has not yet reported read (see the
    /// module docs). Frames of a channel of higher priority, and the
    /// session's own, are never held; what they queue behind in both
    /// kernels is at most this. Default [`BULK_BUDGET`], chosen on
    /// loopback; at least [`MIN_BULK_BUDGET`] (smaller values are raised to
    /// it), `usize::MAX` for no budget.
    ///
    /// The budget is bulk's window: at most one budget goes per round trip
    /// of the connection (and of the peer's event loop). 256 KiB over a
    /// 1 ms round trip is at most about 2 Gbit/s of bulk, so a session
    /// over a long or fast path wants about its bandwidth times its round
    /// trip; smaller budgets keep priority round trips shorter.
    ///
    /// ```
    /// # let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    /// # let addr = listener.local_addr()?;
    /// # let t = std::time::Duration::from_secs(10);
    /// # let other = std::thread::spawn(move || ferry::MuxSession::connect(addr, ferry::NetOptions::default(), t));
    /// use ferry::backend::mux::{BULK_BUDGET, MIN_BULK_BUDGET};
    ///
    /// let session = ferry::MuxSession::accept(&listener, ferry::NetOptions::default(), t)?;
    /// assert_eq!(session.bulk_budget(), BULK_BUDGET);
    /// session.set_bulk_budget(4 << 20); // 10 Gbit/s over about 3 ms
    /// assert_eq!(session.bulk_budget(), 4 << 20);
    /// session.set_bulk_budget(0);
    /// assert_eq!(session.bulk_budget(), MIN_BULK_BUDGET);
    /// # drop(other.join().unwrap()?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_bulk_budget(&self, bytes: usize) {
        self.lock().budget = bytes.max(MIN_BULK_BUDGET);
    }

    /// The session's bulk budget (see [`MuxSession::set_bulk_budget`]).
    pub fn bulk_budget(&self) -> usize {
        self.lock().budget
    }

    /// What this side holds for a peer that does not read: at most `bytes`
    /// of control frames (open replies, closes, credit grants, read
    /// reports, keep-alives) wait for the connection. A peer whose opens
    /// and closes, messages or bytes make this side queue more is cut off:
    /// the session fails with [`ErrorKind::PeerBacklog`] on every channel, and
    /// what was lent over it comes back, as when a peer dies. This side's
    /// own opens do not count against the peer: past the limit a bind on
    /// the session says [`ErrorKind::QueueFull`]. Default [`CONTROL_LIMIT`];
    /// at least [`MIN_CONTROL_LIMIT`] (smaller values are raised to it).
    ///
    /// ```
    /// # let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    /// # let addr = listener.local_addr()?;
    /// # let t = std::time::Duration::from_secs(10);
    /// # let other = std::thread::spawn(move || ferry::MuxSession::connect(addr, ferry::NetOptions::default(), t));
    /// use ferry::backend::mux::{CONTROL_LIMIT, MIN_CONTROL_LIMIT};
    ///
    /// let session = ferry::MuxSession::accept(&listener, ferry::NetOptions::default(), t)?;
    /// assert_eq!(session.control_limit(), CONTROL_LIMIT);
    /// session.set_control_limit(64 << 10);
    /// assert_eq!(session.control_limit(), 64 << 10);
    /// session.set_control_limit(0);
    /// assert_eq!(session.control_limit(), MIN_CONTROL_LIMIT);
    /// # drop(other.join().unwrap()?);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_control_limit(&self, bytes: usize) {
        self.lock().control_limit = bytes.max(MIN_CONTROL_LIMIT);
    }

    /// The session's control limit (see [`MuxSession::set_control_limit`]).
    pub fn control_limit(&self) -> usize {
        self.lock().control_limit
    }

    /// The session's counters so far.
    pub fn stats(&self) -> MuxStats {
        self.lock().counters
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.shared.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A session's counters ([`MuxSession::stats`]). Bytes count every frame
/// after the magic: headers, bodies and payload.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MuxStats {
    /// Bytes written to the connection.
    pub bytes_sent: u64,
    /// Bytes read from the connection.
    pub bytes_received: u64,
    /// Bytes of `bytes_sent` the peer has reported read.
    pub bytes_reported_read: u64,
    /// Bytes of `bytes_received` reported to the peer.
    pub bytes_reported_to_peer: u64,
    /// Times the scheduler stopped with bulk ready because the bulk budget
    /// was spent.
    pub budget_holds: u64,
    /// The most bytes on their way (committed to the connection, not
    /// reported read by the peer, less the frames it overtook) when a
    /// frame of a channel above priority 0 was committed: what that frame
    /// queued behind, in our wire queue and both kernels, plus at most
    /// [`READ_REPORT_EVERY`] the peer had read and not reported yet.
    pub max_ahead_of_priority: u64,
    /// The most bytes of control frames that waited for the connection at
    /// once: at most the control limit plus one frame
    /// ([`MuxSession::set_control_limit`]).
    pub max_control_queued: u64,
}

/// A listener that accepts many sessions, one per [`MuxListener::accept`]:
/// connections whose magic has not arrived yet stay with the listener
/// from one call to the next (each until its [`HANDSHAKE_TIMEOUT`]), so
/// clients that connect at the same time all get their session, and
/// silent connections delay none of them.
///
/// ```
/// use std::time::Duration;
/// use ferry::{MuxListener, MuxSession, NetOptions};
///
/// let t = Duration::from_secs(10);
/// let mut listener = MuxListener::bind("127.0.0.1:0".parse()?, NetOptions::default())?;
/// let addr = listener.local_addr()?;
/// let clients: Vec<_> =
///     (0..3).map(|_| std::thread::spawn(move || MuxSession::connect(addr, NetOptions::default(), t))).collect();
/// let sessions: Vec<MuxSession> = (0..3).map(|_| listener.accept(t)).collect::<Result<_, _>>()?;
/// assert_eq!(sessions.len(), 3);
/// for c in clients {
///     c.join().unwrap()?;
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct MuxListener {
    listener: TcpListener,
    options: NetOptions,
    pending: VecDeque<Handshake>,
}

impl MuxListener {
    /// Listen on `addr` (port 0: the kernel picks one, see
    /// [`MuxListener::local_addr`]); sessions get `options`.
    pub fn bind(addr: SocketAddr, options: NetOptions) -> Result<MuxListener> {
        let bound = TcpListener::bind(addr).map_err(Error::from);
        bound.and_then(|l| MuxListener::new(l, options)).context(|| format!("listen for mux sessions on {addr}"))
    }

    /// Accept sessions on a listener the program made (it is made
    /// non-blocking).
    ///
    /// A plain listener on an address that is not a loopback address needs
    /// [`Security::None`](crate::tls::Security::None) on purpose
    /// ([`ErrorKind::InsecureAddress`]).
    pub fn new(listener: TcpListener, options: NetOptions) -> Result<MuxListener> {
        check_listener(&listener, &options)?;
        listener.set_nonblocking(true)?;
        Ok(MuxListener { listener, options, pending: VecDeque::new() })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// The next session, waiting up to `timeout` (`TimedOut` then; the
    /// connections still handshaking stay for the next call).
    pub fn accept(&mut self, timeout: Duration) -> Result<MuxSession> {
        let deadline = Instant::now() + timeout.max(Duration::from_millis(1));
        accept_session(&self.listener, &mut self.pending, &self.options, deadline, None)
    }

    /// Connections taken off the listener whose magic has not arrived yet.
    pub fn handshaking(&self) -> usize {
        self.pending.len()
    }
}

/// Serve the connections of `listener` side by side until one sends the
/// magic (it becomes the session) or `deadline` passes. `pending` holds
/// the connections still handshaking, before and after; `cap` bounds
/// each new one's deadline (a one-shot accept drops them when it returns).
fn accept_session(
    listener: &TcpListener,
    pending: &mut VecDeque<Handshake>,
    options: &NetOptions,
    deadline: Instant,
    cap: Option<Instant>,
) -> Result<MuxSession> {
    listener.set_nonblocking(true)?;
    loop {
        // A bounded number per round, so that a flood of connections
        // cannot keep us from reading the ones we hold.
        for _ in 0..4 * MAX_HANDSHAKES {
            match listener.accept() {
                Ok((stream, _)) => {
                    let own = Instant::now() + HANDSHAKE_TIMEOUT;
                    let tls = options.tls_server(TLS_SEND_LIMIT)?;
                    let deadline = cap.map_or(own, |c| c.min(own));
                    let Some(hs) = Handshake::new(stream, tls, deadline, options.peer_timeout) else {
                        continue;
                    };
                    if pending.len() == MAX_HANDSHAKES {
                        pending.pop_front();
                    }
                    pending.push_back(hs);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // A connection that was reset while it waited.
                Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < pending.len() {
            match pending[i].poll(now) {
                Ok(false) => i += 1,
                Ok(true) => {
                    let hs = pending.remove(i).expect("in range");
                    return MuxSession::established(hs, options.clone());
                }
                // Silent past its deadline, gone, not a session, or one
                // whose TLS handshake failed.
                Err(_) => {
                    pending.remove(i);
                }
            }
        }
        let Some(left) = deadline.checked_duration_since(now) else {
            return Err(ErrorKind::TimedOut.into());
        };
        let first = pending.iter().map(|hs| hs.deadline.saturating_duration_since(now)).min();
        pending.make_contiguous();
        let _ = wait_handshakes(Some(listener), pending.as_slices().0, first.map_or(left, |f| f.min(left)));
    }
}

/// The non-loopback rule for a listener, and a TLS configuration that can
/// accept.
fn check_listener(listener: &TcpListener, options: &NetOptions) -> Result<()> {
    options.security.check_address(listener.local_addr()?)?;
    if let Some(c) = options.security.tls() {
        c.server_config()?;
    }
    Ok(())
}

/// Wait up to `timeout` until the listener has a connection or a
/// handshake can go on (input, or room for TLS output); at once if TLS
/// holds input already.
fn wait_handshakes(listener: Option<&TcpListener>, pending: &[Handshake], timeout: Duration) -> io::Result<()> {
    use rustix::event::{PollFd, PollFlags};
    if pending.iter().any(|hs| hs.tls.as_ref().is_some_and(|t| t.has_input())) {
        return Ok(());
    }
    let mut fds: Vec<PollFd<'_>> = listener.map(|l| PollFd::new(l, PollFlags::IN)).into_iter().collect();
    for hs in pending {
        let out = hs.tls.as_ref().is_some_and(|t| t.wants_write());
        fds.push(PollFd::new(&hs.stream, if out { PollFlags::IN | PollFlags::OUT } else { PollFlags::IN }));
    }
    match rustix::event::poll(&mut fds, Some(&crate::wake::timespec(timeout))) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Most ciphertext a session's TLS holds for the socket: one chunk, so
/// priority frames queue behind little more than without TLS.
const TLS_SEND_LIMIT: usize = MAX_CHUNK + 4096;

/// How long a connection that [`MuxSession::accept`] took may take to send
/// its magic (it is closed then).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections [`MuxSession::accept`] waits for the magic of at once;
/// one more closes the oldest, so stalled connections cost a good client
/// nothing.
pub const MAX_HANDSHAKES: usize = 16;

/// A connection whose hello (the magic and the peer's timeout) has not
/// arrived (all of it) yet; with TLS, the handshake runs first, within the
/// same deadline.
struct Handshake {
    stream: TcpStream,
    tls: Option<Box<TlsSession>>,
    hello: [u8; HELLO],
    have: usize,
    deadline: Instant,
}

/// A hello's length: the magic and a u32 peer timeout in milliseconds.
const HELLO: usize = MAGIC.len() + 4;

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handshake").field("tls", &self.tls.is_some()).field("have", &self.have).finish()
    }
}

impl Handshake {
    /// Our hello (with our `peer_timeout`) goes out at once (a fresh
    /// socket's buffer takes it without waiting; TLS holds it until its
    /// handshake is done); `None` if the connection cannot take it.
    fn new(
        stream: TcpStream,
        mut tls: Option<Box<TlsSession>>,
        deadline: Instant,
        peer_timeout: Duration,
    ) -> Option<Handshake> {
        stream.set_nonblocking(true).ok()?;
        let mut hello = [0; HELLO];
        hello[..MAGIC.len()].copy_from_slice(MAGIC);
        let ms = u32::try_from(peer_timeout.as_millis()).unwrap_or(u32::MAX);
        hello[MAGIC.len()..].copy_from_slice(&ms.to_le_bytes());
        let sent = match &mut tls {
            None => (&stream).write(&hello),
            Some(t) => t.queue(stream.as_fd(), &hello),
        };
        match sent {
            Ok(n) if n == HELLO => Some(Handshake { stream, tls, hello: [0; HELLO], have: 0, deadline }),
            _ => None,
        }
    }

    /// The peer timeout the peer announced (once `poll` said `true`).
    fn peer_timeout(&self) -> Duration {
        let ms = u32::from_le_bytes(self.hello[MAGIC.len()..].try_into().expect("4 bytes"));
        Duration::from_millis(u64::from(ms))
    }

    /// The error a connecting side reports: a TLS peer answering a plain
    /// one is named as such.
    fn error(&self, e: Error) -> Error {
        match e.kind() {
            ErrorKind::Protocol(_)
                if self.tls.is_none() && self.have >= 2 && matches!(self.hello[..2], [0x15 | 0x16, 0x03]) =>
            {
                ErrorKind::Tls("the peer speaks TLS and this end does not; give it Security Tls".into()).into()
            }
            _ => e,
        }
    }

    /// `true` once the peer's hello is complete (nothing after it is
    /// read: its frames may follow at once); `TimedOut` past the deadline,
    /// `PeerGone` at the end of the stream, `Protocol` for another magic.
    fn poll(&mut self, now: Instant) -> Result<bool> {
        while self.have < HELLO {
            // The magic alone first: another protocol is refused as soon as
            // its first 8 bytes are in, without waiting for more.
            let want = if self.have < MAGIC.len() { MAGIC.len() } else { HELLO };
            let got = match &mut self.tls {
                None => (&self.stream).read(&mut self.hello[self.have..want]),
                Some(t) => t.recv_parts(self.stream.as_fd(), &mut [RecvPart::slice(&mut self.hello[self.have..want])]),
            };
            let ended = || self.tls.as_ref().and_then(|t| t.ended_in_handshake());
            match got {
                Ok(0) => return Err(ended().unwrap_or(ErrorKind::PeerGone.into())),
                Ok(n) => {
                    self.have += n;
                    if self.have == MAGIC.len() && &self.hello[..MAGIC.len()] != MAGIC {
                        return Err(ErrorKind::Protocol("not a multiplexed session".into()).into());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return if now >= self.deadline { Err(ErrorKind::TimedOut.into()) } else { Ok(false) };
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(crate::tls::failure(&e).or_else(ended).unwrap_or_else(|| e.into())),
            }
        }
        Ok(true)
    }
}

/// The endpoint of one logical channel of a [`MuxSession`].
#[derive(Clone)]
pub struct MuxEndpoint {
    session: MuxSession,
    channel: u32,
    priority: u8,
}

/// `channel 5 of the mux session with 127.0.0.1:7000`.
impl std::fmt::Display for MuxEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.session.peer_addr() {
            Some(peer) => write!(f, "channel {} of the mux session with {peer}", self.channel),
            None => write!(f, "channel {} of a mux session", self.channel),
        }
    }
}

impl std::fmt::Debug for MuxEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuxEndpoint").field("channel", &self.channel).field("priority", &self.priority).finish()
    }
}
