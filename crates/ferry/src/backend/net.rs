//! The network backend: channels between machines over TCP ([ETH-NET],
//! network bulk transfer), with the transparent semantics of the other backends and
//! without the copy its transparent variant (§4.4.2) paid.
//!
//! A pool assigned over the channel is mirrored on the peer: fresh memory
//! with the same id and geometry. Buffer *i* moved or copied arrives in the
//! peer's buffer *i*: the sender writes the payload straight from the
//! buffer's memory (vectored `sendmsg`), the receiver reads the frame header,
//! asks the channel whether the payload may land (the buffer is on the
//! channel and not one the receiving domain owns or reads), and reads the
//! payload straight into the buffer (vectored `recvmsg`). No user-space copy
//! on either side, and no intermediate receive buffer; TCP gives
//! reliability, ordering and flow control.
//!
//! Frames go out when the channel is polled or waited on (or when a batch
//! is full), so many small frames share one system call; a payload is never
//! copied to be batched. On the way in, a run of frames without payload (a
//! peer's batch of unfilled passes or releases) is read at once into a
//! bounded buffer of the link's own: a look at what the socket holds (a
//! peek) shows where the next payload starts, and one read takes exactly
//! the headers and meta data before it. Each message is still parsed and
//! its payload admitted only after the ones before it were delivered.
//!
//! # Security
//!
//! [`NetOptions::security`] says what protects the connection (see
//! [`crate::tls`] and docs/SECURITY.md): by default plain TCP between
//! loopback addresses only; [`Security::Tls`] for TLS 1.3 with mutual
//! certificates; [`Security::None`] for plain TCP anywhere, on purpose.
//! With TLS, the sender encrypts each payload from the buffer's memory
//! into TLS records and the receiver decrypts the records into the
//! buffer (through rustls's buffers): what the kernel did in one copy on
//! each side, TLS does in user space, and only authenticated bytes land.
//! A record that fails authentication fails the channel with
//! [`ErrorKind::Tls`]. A creator runs the TLS handshakes of its half-open
//! connections side by side, within the same setup deadline and shedding
//! as the bind requests.
//!
//! # Wire format, version 1 (little endian)
//!
//! With TLS, everything below is the plaintext of one TLS 1.3 connection
//! that starts with the first byte after the TCP connect (the binder is the
//! TLS client, the creator the server); the frames are the same.
//!
//! Setup: the binder connects and sends its bind request; the creator
//! answers with the acceptance or a refusal (the messages of `setup_msg`,
//! each followed by the sender's peer timeout in milliseconds as a u32 and
//! preceded by the length of both as a u16). Then both ends send frames:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | type: 1 move, 2 copy, 3 pass, 4 release, 5 pool assign, 6 assign reply, 7 pool remove, 8 remove reply, 9 teardown, 10 keep-alive, 11 goodbye, 12 aggregate header, 13 aggregate table |
//! | 1 | 1 | flags: bit 0 accepted (replies), bit 1 payload follows, bits 4–7 trust (assign); 0 on types 12 and 13 |
//! | 2 | 2 | meta length (at most the channel's meta size; 0 unless move, copy, pass or aggregate header); table length (type 13: 16 × entries) |
//! | 4 | 4 | buffer index (buffer frames), buffer count (assign), member count (12), ordinal of the first entry (13) |
//! | 8 | 8 | payload length (buffer frames: 0 or the pool's buffer size), buffer size (assign), table-entry count (12); 0 (13) |
//! | 16 | 16 | pool id; the aggregate's total length in bytes (12); 0 (13) |
//! | 32 | meta length | meta data (types 1–3, 12); table entries (13) |
//! | 32 + meta | payload length | the buffer's bytes |
//!
//! An aggregate travels as a run of consecutive frames: its header (type
//! 12), one move or copy frame per distinct member buffer (no meta data of
//! its own; the payload rules below apply to each), then its table in as
//! many type-13 frames as needed. A table entry is 16 bytes: member ordinal
//! (u32), offset (u48), length (u48); an entry whose member is `u32::MAX`
//! is a repeat entry (offset field: group size k, length field: count n)
//! standing for the k fragments before it repeated n times. So the header
//! counts table entries, not fragments: a train of a thousand units behind
//! their headers is a few entries.
//!
//! Moves always carry the payload. A pass carries it unless the sender said
//! the contents do not matter ([`crate::Channel::pass_unfilled`]). A copy
//! carries it unless the peer still holds a copy of that buffer from us
//! (the buffer has been read-only since, so the peer's bytes are current).
//! A keep-alive is sent when nothing else went out for a quarter of the
//! shorter of the two ends' peer timeouts (so an end with a short timeout
//! never takes a healthy peer for dead); goodbye says the sender closed its end on purpose (so the
//! end of the stream is not a crash). Anything else — unknown type, flags or
//! lengths that do not fit the type, a pool or index the channel does not
//! have, a move, pass or payload for a buffer the receiver owns, a copy of
//! a buffer the receiver owns and has no copy out of — closes the channel
//! with [`ErrorKind::Protocol`] on the receiving side, and ends the connection
//! at once (the peer reads the end of the stream).

use crate::ErrorKind;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use super::setup_msg;
use super::{Landing, Link, LinkStats, PayloadGate, Pending, PendingSetup, SetupDone};
use crate::error::{Error, Result};
use crate::pool::BufferId;
use crate::pool::{Geometry, PoolId, PoolMap, PoolMemory};
use crate::proto::{self, Message, Meta};
use crate::setup::{check_reply, negotiate, BindParams, ChannelSetup};
use crate::sys::{self, Access, Mapping, RecvPart, SendPart};
use crate::tls::{self, Security, TlsSession};
use crate::wake::{timespec, Arm, Interest, WakeSet};

/// Size of a frame header.
pub(crate) const FRAME_HEAD: usize = 32;
const TYPE_MOVE: u8 = 1;
const TYPE_COPY: u8 = 2;
const TYPE_PASS: u8 = 3;
const TYPE_KEEPALIVE: u8 = 10;
const TYPE_GOODBYE: u8 = 11;
const FLAG_PAYLOAD: u8 = 2;

/// Frames queued before a send goes out without waiting for a poll.
const BATCH_FRAMES: usize = 64;
/// Payload bytes queued before a send goes out without waiting for a poll.
const BATCH_BYTES: usize = 1 << 20;
/// Most frames in one `sendmsg` (two parts each).
const FRAMES_PER_SEND: usize = 128;
/// The fewest bytes laid out for one `sendmsg` when the socket was full
/// last time (see `NetLink::send_budget`).
const MIN_SEND_BUDGET: usize = 64 << 10;
/// Most header and meta bytes read ahead of the frame being parsed (a run
/// of 64 unfilled passes with 16 bytes of meta data each is 3 KiB).
const AHEAD: usize = 4096;
/// How long a connection to a creator may take to send its bind request
/// (it is dropped then).
const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections a creator keeps reading a bind request from at once;
/// one more sheds the oldest, so stalled connectors cost a binder nothing.
const MAX_HALF_OPEN: usize = 16;
/// How long a closing end tries to get its last frames out.
const CLOSE_FLUSH: Duration = Duration::from_secs(2);
/// Most ciphertext a TLS link holds for the socket (rustls's default):
/// more makes the allocator return and fault in the records' memory over
/// and over.
const TLS_SEND_LIMIT: usize = 64 << 10;
/// Unsent ciphertext the kernel may hold for a TLS link
/// (`TCP_NOTSENT_LOWAT`, as the mux sessions have it). Without a bound it
/// queues megabytes beyond what the peer's window takes, and those go out
/// from whichever CPU handles the peer's acknowledgements, interleaved
/// with our own writes: on loopback segments then arrive out of order and
/// are retransmitted for nothing (in a bulk echo over TLS about ten times
/// the retransmissions and pacing stalls of a plain rustls stream, and
/// 10 to 20 % less throughput).
const TLS_UNSENT_LOW_WATER: usize = 128 << 10;
/// The same bound for a plain link: larger, since plain writes cost the
/// sender no records to keep. Unbounded, the same out-of-order arrivals
/// cost a 1 MiB stream about 9 % of its throughput on loopback (15.7
/// against 17.3 Gbit/s, every one of ten alternated rounds faster with
/// the bound, retransmitted segments 2,300 → 1,100 per 3 GiB); other
/// sizes run the same or a little faster (4 KiB 1.05×, 16 KiB 0.99×,
/// 64 KiB 1.01×, 4 MiB 1.03×). Smaller bounds help 1 MiB more but cost
/// smaller messages up to a tenth.
const PLAIN_UNSENT_LOW_WATER: usize = 1 << 20;

/// Options of a TCP endpoint or session.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NetOptions {
    /// A peer that sends nothing (not even a keep-alive) or takes none of
    /// our data for this long is treated as dead: the channel fails with
    /// [`ErrorKind::PeerUnresponsive`] and the buffers lent to it come back.
    /// The ends announce their timeouts when they connect, and each sends
    /// keep-alives every quarter of the shorter one (of at least 100 ms).
    /// Default 10 s.
    pub peer_timeout: Duration,
    /// What protects the connection. Default [`Security::LoopbackOnly`]:
    /// plain TCP, and an address that is not a loopback address is
    /// refused ([`ErrorKind::InsecureAddress`]); across machines use
    /// [`Security::Tls`], or [`Security::None`] on purpose.
    pub security: Security,
}

impl Default for NetOptions {
    fn default() -> Self {
        NetOptions { peer_timeout: Duration::from_secs(10), security: Security::LoopbackOnly }
    }
}

impl NetOptions {
    /// Options with the given peer timeout (at least 100 ms).
    pub fn with_peer_timeout(timeout: Duration) -> NetOptions {
        NetOptions { peer_timeout: timeout.max(Duration::from_millis(100)), ..NetOptions::default() }
    }

    /// These options with `security`.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use ferry::tls::{Security, TlsConfig};
    /// use ferry::{Endpoint, NetOptions};
    ///
    /// let tls = Arc::new(TlsConfig::from_dir("/etc/ferry/tls", "server.example")?);
    /// let options = NetOptions::default().with_security(Security::Tls(tls));
    /// let endpoint = Endpoint::tcp_with("192.0.2.7:7000".parse()?, options);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_security(self, security: Security) -> NetOptions {
        NetOptions { security, ..self }
    }

    /// The accepting side's TLS state for a new connection, if TLS.
    pub(crate) fn tls_server(&self, send_limit: usize) -> Result<Option<Box<TlsSession>>> {
        self.security.tls().map(|c| TlsSession::server(c, send_limit).map(Box::new)).transpose()
    }

    /// The connecting side's TLS state for a new connection, if TLS.
    pub(crate) fn tls_client(&self, send_limit: usize) -> Result<Option<Box<TlsSession>>> {
        self.security.tls().map(|c| TlsSession::client(c, send_limit).map(Box::new)).transpose()
    }
}

/// An endpoint for channels between machines: a TCP address (IPv4 or IPv6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetEndpoint {
    addr: SocketAddr,
    options: NetOptions,
}

/// Connect to `addr` within `timeout`: nobody listening (refused, or the
/// socket connected to itself) is [`ErrorKind::EndpointNotListening`], no
/// answer in time [`ErrorKind::TimedOut`].
pub(crate) fn connect_stream(addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let timeout = timeout.max(Duration::from_millis(1));
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| match e.kind() {
        io::ErrorKind::ConnectionRefused => ErrorKind::EndpointNotListening.into(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => ErrorKind::TimedOut.into(),
        _ => Error::from(e),
    })?;
    // Connecting to a free port of our own host can connect the socket to
    // itself (TCP simultaneous open, when the kernel picks that very port
    // as our source port): nobody is listening there.
    if stream.local_addr()? == stream.peer_addr()? {
        return Err(ErrorKind::EndpointNotListening.into());
    }
    Ok(stream)
}

impl NetEndpoint {
    /// An endpoint at `addr`: `create` listens there (port 0: the kernel
    /// picks one, see [`crate::Channel::listen_addr`]), `bind` connects.
    pub fn new(addr: SocketAddr, options: NetOptions) -> Self {
        NetEndpoint { addr, options }
    }

    /// The address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The options, its security among them: what a program gives a
    /// further connection to the same peer (a second channel) so that it
    /// is protected as this one is.
    pub fn options(&self) -> &NetOptions {
        &self.options
    }

    pub(crate) fn listen(&self, setup: &ChannelSetup) -> Result<Pending> {
        self.options.security.check_address(self.addr)?;
        if let Some(c) = self.options.security.tls() {
            c.server_config()?;
        }
        let listener = TcpListener::bind(self.addr).map_err(|e| match e.kind() {
            io::ErrorKind::AddrInUse => ErrorKind::EndpointInUse.into(),
            _ => Error::from(e),
        })?;
        listener.set_nonblocking(true)?;
        Ok(Box::new(CreatorPending {
            listener: Some(listener),
            setup: *setup,
            options: self.options.clone(),
            half_open: VecDeque::new(),
        }))
    }

    pub(crate) fn connect(&self, params: &BindParams) -> Result<Pending> {
        self.options.security.check_address(self.addr)?;
        let mut tls = self.options.tls_client(TLS_SEND_LIMIT)?;
        let deadline = Instant::now() + params.timeout;
        let timeout = params.timeout.max(Duration::from_millis(1));
        let stream = connect_stream(self.addr, timeout)?;
        stream.set_nodelay(true)?;
        let request = framed(&setup_msg::encode_bind(params), self.options.peer_timeout);
        if let Some(t) = &mut tls {
            // rustls holds the request until the handshake is done; the
            // handshake goes on without waiting, as `poll` reads.
            stream.set_nonblocking(true)?;
            t.queue(stream.as_fd(), &request).map_err(|e| io_error(&e))?;
        } else {
            // A bind request fits in any socket buffer: this write does not wait.
            stream.set_write_timeout(Some(timeout))?;
            (&stream).write_all(&request)?;
            stream.set_nonblocking(true)?;
        }
        Ok(Box::new(BinderPending {
            conn: Some(SetupConn::new(stream, tls, deadline)),
            options: self.options.clone(),
            params: *params,
        }))
    }
}

/// The error an I/O error of a connection is: [`ErrorKind::Tls`] for a TLS
/// failure.
fn io_error(e: &io::Error) -> Error {
    tls::failure(e).unwrap_or_else(|| ErrorKind::Os(e.to_string()).into())
}

/// A setup message as it goes on the stream: the u16 length of what
/// follows, the message, and the sender's peer timeout (ms, u32).
fn framed(msg: &[u8], peer_timeout: Duration) -> Vec<u8> {
    let ms = u32::try_from(peer_timeout.as_millis()).unwrap_or(u32::MAX);
    let mut v = ((msg.len() + 4) as u16).to_le_bytes().to_vec();
    v.extend_from_slice(msg);
    v.extend_from_slice(&ms.to_le_bytes());
    v
}

/// A setup message read by [`SetupConn::poll`] and the peer timeout its
/// sender announced.
pub(crate) fn unframed(body: &[u8]) -> Result<(&[u8], Duration)> {
    let Some(split) = body.len().checked_sub(4) else {
        return Err(setup_msg::bad("truncated"));
    };
    let (msg, ms) = body.split_at(split);
    let ms = u32::from_le_bytes(ms.try_into().expect("4 bytes"));
    Ok((msg, Duration::from_millis(u64::from(ms))))
}

/// The shortest peer timeout a peer's announcement counts as: a hostile
/// peer announcing 0 cannot make us send keep-alives without pause.
const MIN_PEER_TIMEOUT: Duration = Duration::from_millis(100);

/// How often an end with `own` peer timeout sends keep-alives to a peer that
/// announced `peer`'s: often enough for the shorter of the two, and never
/// more often than a quarter of [`MIN_PEER_TIMEOUT`] whatever the peer asks.
pub(crate) fn keepalive_interval(own: Duration, peer: Duration) -> Duration {
    own.min(peer.max(MIN_PEER_TIMEOUT)) / 4
}

// -------------------------------------------------------------------- setup

/// A connection during setup, reading one length-prefixed setup message
/// without ever reading past it (frames may follow at once).
/// With TLS, the handshake runs within the same deadline, and what TLS
/// read ahead stays with the connection's TLS state.
pub(crate) struct SetupConn {
    stream: TcpStream,
    tls: Option<Box<TlsSession>>,
    buf: [u8; 2 + setup_msg::MAX_LEN],
    have: usize,
    deadline: Instant,
}

impl SetupConn {
    pub(crate) fn new(stream: TcpStream, tls: Option<Box<TlsSession>>, deadline: Instant) -> Self {
        SetupConn { stream, tls, buf: [0; 2 + setup_msg::MAX_LEN], have: 0, deadline }
    }

    /// Send a setup message without waiting: a fresh socket's buffer (or
    /// TLS's) takes it at once; `false` if the connection did not.
    fn send(&mut self, msg: &[u8]) -> bool {
        match &mut self.tls {
            None => (&self.stream).write_all(msg).is_ok(),
            Some(t) => t.queue(self.stream.as_fd(), msg).is_ok_and(|n| n == msg.len()),
        }
    }

    /// What to wake for: the socket's input, and its room while TLS has
    /// ciphertext for it.
    fn interest(&self) -> Interest {
        if self.tls.as_ref().is_some_and(|t| t.wants_write()) {
            Interest::ReadWrite
        } else {
            Interest::Read
        }
    }

    /// The message once it is complete; `PeerGone` at end of stream,
    /// `TimedOut` past the deadline.
    pub(crate) fn poll(&mut self) -> Result<Option<&[u8]>> {
        loop {
            let need = if self.have < 2 {
                2
            } else {
                let len = usize::from(u16::from_le_bytes([self.buf[0], self.buf[1]]));
                if len > setup_msg::MAX_LEN {
                    return Err(setup_msg::bad("too long"));
                }
                2 + len
            };
            if self.have == need && need > 2 {
                return Ok(Some(&self.buf[2..need]));
            }
            let got = match &mut self.tls {
                None => self.stream.read(&mut self.buf[self.have..need]),
                Some(t) => t.recv_parts(self.stream.as_fd(), &mut [RecvPart::slice(&mut self.buf[self.have..need])]),
            };
            let ended = || self.tls.as_ref().and_then(|t| t.ended_in_handshake());
            match got {
                Ok(0) => return Err(ended().unwrap_or(ErrorKind::PeerGone.into())),
                Ok(n) => self.have += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return if Instant::now() >= self.deadline { Err(ErrorKind::TimedOut.into()) } else { Ok(None) };
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(tls::failure(&e).or_else(ended).unwrap_or_else(|| e.into())),
            }
            // A TLS peer answering a plain one: its first record (an alert
            // or a handshake message) is no setup message.
            if self.tls.is_none() && self.have >= 2 && matches!(self.buf[..2], [0x15 | 0x16, 0x03]) {
                return Err(
                    ErrorKind::Tls("the peer speaks TLS and this end does not; give it Security Tls".into()).into()
                );
            }
        }
    }
}

struct CreatorPending {
    /// Dropped once a binder is accepted.
    listener: Option<TcpListener>,
    setup: ChannelSetup,
    options: NetOptions,
    /// Connections whose bind request is not complete yet, oldest first (at
    /// most [`MAX_HALF_OPEN`]), each read without waiting: whichever
    /// request completes first is served.
    half_open: VecDeque<SetupConn>,
}

impl CreatorPending {
    /// Answer a complete bind request: `Ok(None)` if refused or if the
    /// binder went away.
    fn answer(&mut self, mut conn: SetupConn) -> Result<Option<SetupDone>> {
        let (request, peer_timeout) = unframed(&conn.buf[2..conn.have])?;
        let params = setup_msg::parse_bind(request)?;
        let neg = match negotiate(&self.setup, &params) {
            Ok(neg) => neg,
            Err(why) => {
                conn.send(&framed(&setup_msg::encode_refuse(why), self.options.peer_timeout));
                return Ok(None);
            }
        };
        let depth = self.setup.queue_depth;
        // A fresh socket's buffer takes the reply at once (the stream is
        // non-blocking: a binder that reads nothing cannot hold us here).
        if !conn.send(&framed(&setup_msg::encode_accept(&neg, depth), self.options.peer_timeout)) {
            return Ok(None);
        }
        let link = NetLink::new(conn.stream, conn.tls, neg.meta_size, depth, self.options.clone(), peer_timeout)?;
        Ok(Some((Box::new(link), neg, true)))
    }

    /// Take the connections waiting on the listener (a bounded number per
    /// poll); shed the oldest beyond [`MAX_HALF_OPEN`].
    fn accept_all(&mut self) {
        let Some(listener) = &self.listener else { return };
        // Bounded, so a flood of connections cannot keep us here.
        for _ in 0..4 * MAX_HALF_OPEN {
            let Ok((stream, _)) = listener.accept() else { break };
            if stream.set_nonblocking(true).is_err() || stream.set_nodelay(true).is_err() {
                continue;
            }
            // The configuration was checked when the endpoint was created.
            let Ok(tls) = self.options.tls_server(TLS_SEND_LIMIT) else { continue };
            if self.half_open.len() == MAX_HALF_OPEN {
                self.half_open.pop_front();
            }
            self.half_open.push_back(SetupConn::new(stream, tls, Instant::now() + SETUP_TIMEOUT));
        }
    }
}

impl PendingSetup for CreatorPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        self.listener.as_ref()?;
        self.accept_all();
        let mut i = 0;
        while i < self.half_open.len() {
            match self.half_open[i].poll() {
                Ok(None) => i += 1,
                Ok(Some(_)) => {
                    let conn = self.half_open.remove(i).expect("in range");
                    match self.answer(conn) {
                        Ok(Some(done)) => {
                            self.listener = None;
                            self.half_open.clear();
                            return Some(Ok(done));
                        }
                        // Refused, gone, or a connector that does not speak
                        // the protocol: drop it and keep listening.
                        Ok(None) => {}
                        Err(e) if matches!(e.kind(), ErrorKind::Protocol(_)) => {}
                        Err(e) => return Some(Err(e)),
                    }
                }
                // The connector went away, stalled or spoke nonsense.
                Err(_) => {
                    self.half_open.remove(i);
                }
            }
        }
        None
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let Some(listener) = &self.listener else { return Arm::SLEEP };
        // A TLS handshake read ahead (or still has its answer to send).
        if self.half_open.iter().any(|c| c.tls.as_ref().is_some_and(|t| t.has_input())) {
            return Arm::Ready;
        }
        let arm =
            super::arm_listening(wake, listener.as_fd(), self.half_open.iter().map(|c| (c.stream.as_fd(), c.deadline)));
        for c in self.half_open.iter().filter(|c| c.interest() != Interest::Read) {
            if wake.watch(c.stream.as_fd(), c.interest()).is_err() {
                return Arm::Ready;
            }
        }
        arm
    }

    fn listen_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref()?.local_addr().ok()
    }
}

struct BinderPending {
    conn: Option<SetupConn>,
    options: NetOptions,
    params: BindParams,
}

impl PendingSetup for BinderPending {
    fn poll(&mut self) -> Option<Result<SetupDone>> {
        let conn = self.conn.as_mut()?;
        let reply = match conn.poll() {
            Ok(None) => return None,
            Ok(Some(reply)) => unframed(reply).and_then(|(reply, peer_timeout)| {
                let (neg, depth) = setup_msg::parse_reply(reply)?;
                check_reply(&self.params, &neg)?;
                Ok((neg, depth, peer_timeout))
            }),
            Err(e) => Err(e),
        };
        let conn = self.conn.take().expect("present");
        Some(reply.and_then(|(neg, depth, peer_timeout)| {
            let link = NetLink::new(conn.stream, conn.tls, neg.meta_size, depth, self.options.clone(), peer_timeout)?;
            Ok((Box::new(link) as Box<dyn Link>, neg, false))
        }))
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        let Some(c) = &self.conn else { return Arm::SLEEP };
        if c.tls.as_ref().is_some_and(|t| t.has_input()) {
            return Arm::Ready;
        }
        if wake.watch(c.stream.as_fd(), c.interest()).is_err() {
            return Arm::Ready;
        }
        Arm::Sleep { until: Some(c.deadline) }
    }
}

pub(crate) fn poll_fd(fd: std::os::fd::BorrowedFd<'_>, events: PollFlags, timeout: Duration) -> io::Result<PollFlags> {
    let mut pfd = [PollFd::from_borrowed_fd(fd, events)];
    match rustix::event::poll(&mut pfd, Some(&timespec(timeout))) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(pfd[0].revents()),
        Err(e) => Err(e.into()),
    }
}

// --------------------------------------------------------------------- link

/// A pool as the link sees it: its own read-write mapping, independent of
/// the domain's view (whose protection follows the buffer states).
struct LinkPool {
    map: Mapping,
    geometry: Geometry,
    _memory: Arc<PoolMemory>,
}

/// One queued frame: header and meta, and the buffer whose bytes follow.
struct OutFrame {
    head: [u8; FRAME_HEAD + proto::MAX_META_SIZE],
    head_len: usize,
    payload: Option<(PoolId, u32)>,
    payload_len: usize,
}

impl OutFrame {
    fn len(&self) -> usize {
        self.head_len + self.payload_len
    }
}

/// Where the payload of the frame being received goes.
#[derive(Clone, Copy)]
enum Target {
    /// Offset in the pool's mapping.
    Land { pool: PoolId, offset: usize },
    /// Read and dropped (see [`Landing::Discard`]).
    Discard,
}

enum RxState {
    /// Reading the fixed header into `head[..FRAME_HEAD]`.
    Head { have: usize },
    /// Reading meta into `head[FRAME_HEAD..]`, then the payload.
    Body { meta: usize, have_meta: usize, target: Option<Target>, len: usize, have: usize },
}

/// One end of a TCP channel.
pub(crate) struct NetLink {
    stream: TcpStream,
    /// The TLS state (`None`: plain TCP, sent and received by the kernel
    /// straight from and into buffer memory).
    tls: Option<Box<TlsSession>>,
    meta_size: usize,
    depth: usize,
    /// How often a keep-alive goes out when nothing else does (see
    /// [`keepalive_interval`]).
    keepalive: Duration,
    options: NetOptions,
    pools: PoolMap<LinkPool>,
    /// Pools the channel forgot while queued frames still carry their
    /// bytes: dropped from `pools` once the queue is empty.
    retired: Vec<PoolId>,
    out: VecDeque<OutFrame>,
    /// Bytes of the front frame already sent.
    out_sent: usize,
    /// About how many bytes to lay out for one `sendmsg`: twice what the
    /// socket took when it was last full, doubled after each send it took
    /// whole (a full socket takes a few payloads; laying out a hundred
    /// each time costs more than the call).
    send_budget: usize,
    out_payload: usize,
    rx: RxState,
    head: [u8; FRAME_HEAD + proto::MAX_META_SIZE],
    /// Header and meta bytes of the next frames, read ahead (together with
    /// a body, or a run of frames without payload at once): never a
    /// payload byte. `ahead[ahead_start..ahead_end]` is not parsed yet.
    ahead: Box<[u8; AHEAD]>,
    ahead_start: usize,
    ahead_end: usize,
    /// The last read took all it asked for: more may be waiting.
    more_waiting: bool,
    /// The last frame received carried a payload.
    last_payload: bool,
    scratch: Vec<u8>,
    /// Buffers whose bytes last landed here with a copy: a further copy of
    /// one may come without payload.
    copied_in: std::collections::HashSet<BufferId>,
    last_rx: Instant,
    last_tx: Instant,
    /// What the socket is watched for in the channel's wake set.
    interest: Interest,
    /// Last time the queue was empty or bytes went out.
    last_progress: Instant,
    goodbye_seen: bool,
    closed: bool,
    died: bool,
    /// The error every call returns once the stream is done.
    gone: Option<Error>,
    stats: LinkStats,
}

impl NetLink {
    fn new(
        stream: TcpStream,
        tls: Option<Box<TlsSession>>,
        meta_size: usize,
        depth: u32,
        options: NetOptions,
        peer_timeout: Duration,
    ) -> Result<Self> {
        stream.set_nonblocking(true)?;
        // Not a TCP socket under the fuzzer (a Unix socket pair).
        let _ = stream.set_nodelay(true);
        configure_liveness(&stream, options.peer_timeout);
        let unsent = if tls.is_some() { TLS_UNSENT_LOW_WATER } else { PLAIN_UNSENT_LOW_WATER };
        let _ = sys::set_unsent_low_water(&stream, unsent);
        let now = Instant::now();
        Ok(NetLink {
            stream,
            tls,
            meta_size,
            depth: depth as usize,
            keepalive: keepalive_interval(options.peer_timeout, peer_timeout),
            options,
            pools: PoolMap::default(),
            retired: Vec::new(),
            out: VecDeque::new(),
            out_sent: 0,
            send_budget: usize::MAX,
            out_payload: 0,
            rx: RxState::Head { have: 0 },
            head: [0; FRAME_HEAD + proto::MAX_META_SIZE],
            ahead: Box::new([0; AHEAD]),
            ahead_start: 0,
            ahead_end: 0,
            more_waiting: false,
            last_payload: false,
            scratch: Vec::new(),
            copied_in: std::collections::HashSet::new(),
            last_rx: now,
            last_tx: now,
            interest: Interest::Read,
            last_progress: now,
            goodbye_seen: false,
            closed: false,
            died: false,
            gone: None,
            stats: LinkStats::default(),
        })
    }

    /// A link over any connected stream socket (fuzzing: a socket pair).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn over(stream: TcpStream, meta_size: usize) -> Self {
        NetLink::new(stream, None, meta_size, 256, NetOptions::default(), NetOptions::default().peer_timeout)
            .expect("socket options")
    }

    fn register(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        self.retired.retain(|&id| id != memory.id());
        // A pool offered again after a veto may come with new memory of
        // ours (the domain dropped the old): payloads land in what it maps now.
        if self.pools.get(&memory.id()).is_some_and(|p| Arc::ptr_eq(&p._memory, memory)) {
            return Ok(());
        }
        let g = memory.geometry();
        let map = memory.map(Access::ReadWrite, 1)?;
        self.pools.insert(memory.id(), LinkPool { map, geometry: g, _memory: memory.clone() });
        Ok(())
    }

    fn fail(&mut self, e: Error, died: bool) -> Error {
        if self.gone.is_none() {
            self.died = died;
            self.gone = Some(e.clone());
        }
        self.gone.clone().expect("set")
    }

    fn check(&self) -> Result<()> {
        match &self.gone {
            Some(e) => Err(e.clone()),
            None if self.closed => Err(ErrorKind::PeerGone.into()),
            None => Ok(()),
        }
    }

    /// Room for one more frame within the queue depth (`QueueFull`: the
    /// peer is not taking our data fast enough).
    fn make_room(&mut self) -> Result<()> {
        if self.out.len() >= self.depth {
            self.flush()?;
            if self.out.len() >= self.depth {
                return Err(ErrorKind::QueueFull.into());
            }
        }
        Ok(())
    }

    fn queue(&mut self, msg: &Message, with_payload: bool) -> Result<()> {
        self.check()?;
        let mut f =
            OutFrame { head: [0; FRAME_HEAD + proto::MAX_META_SIZE], head_len: 0, payload: None, payload_len: 0 };
        msg.encode(&mut f.head);
        f.head_len = FRAME_HEAD + usize::from(u16::from_le_bytes([f.head[2], f.head[3]]));
        if let (true, Message::Move { buf, .. } | Message::Copy { buf, .. } | Message::Pass { buf, .. }) =
            (with_payload, msg)
        {
            let pool = self
                .pools
                .get(&buf.pool)
                .ok_or_else(|| ErrorKind::Protocol(format!("pool {} unknown to the network link", buf.pool)))?;
            let size = pool.geometry.buffer_size();
            f.head[1] |= FLAG_PAYLOAD;
            f.head[8..16].copy_from_slice(&(size as u64).to_le_bytes());
            f.payload = Some((buf.pool, buf.index));
            f.payload_len = size;
        }
        self.push(f)
    }

    fn queue_control(&mut self, kind: u8) -> Result<()> {
        let mut f = OutFrame {
            head: [0; FRAME_HEAD + proto::MAX_META_SIZE],
            head_len: FRAME_HEAD,
            payload: None,
            payload_len: 0,
        };
        f.head[0] = kind;
        self.push(f)
    }

    fn push(&mut self, f: OutFrame) -> Result<()> {
        if self.out.is_empty() {
            self.last_progress = Instant::now();
        }
        self.out_payload += f.payload_len;
        self.out.push_back(f);
        if self.out.len() >= BATCH_FRAMES || self.out_payload >= BATCH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Send what the socket takes now.
    fn flush(&mut self) -> Result<()> {
        // TLS's `send_parts` ends with a write of all the ciphertext it
        // holds: once it ran, what still waits is what the socket refused
        // just now, and another write would only be refused again.
        let mut tls_tried = false;
        let written = self.tls.as_ref().map(|t| t.written());
        while !self.out.is_empty() {
            let sent = {
                let mut parts: Vec<SendPart<'_>> = Vec::with_capacity(2 * FRAMES_PER_SEND.min(self.out.len()));
                let mut skip = self.out_sent;
                // TLS takes at most its send limit per call, and a full
                // socket about what it took last time: frames past that
                // would only be laid out again next call.
                let budget = if self.tls.is_some() { TLS_SEND_LIMIT } else { self.send_budget };
                let mut laid = 0;
                for f in self.out.iter().take(FRAMES_PER_SEND) {
                    if laid >= budget {
                        break;
                    }
                    laid += f.len() - skip;
                    if skip < f.head_len {
                        parts.push(SendPart::slice(&f.head[skip..f.head_len]));
                        skip = 0;
                    } else {
                        skip -= f.head_len;
                    }
                    if let Some((pool, index)) = f.payload {
                        let p = &self.pools[&pool];
                        let offset = index as usize * p.geometry.buffer_size() + skip;
                        let part = SendPart::mapping(&p.map, offset, f.payload_len - skip).expect("index in range");
                        parts.push(part);
                    }
                    skip = 0;
                }
                let sent = match &mut self.tls {
                    None => sys::send_parts(self.stream.as_fd(), &parts),
                    Some(t) => {
                        tls_tried = true;
                        t.send_parts(self.stream.as_fd(), &parts)
                    }
                };
                (sent, laid)
            };
            let (sent, laid) = sent;
            let n = match sent {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return Err(self.fail(ErrorKind::PeerGone.into(), true)),
            };
            let now = Instant::now();
            self.last_tx = now;
            self.last_progress = now;
            self.stats.send_calls += 1;
            self.consume_sent(n);
            if self.tls.is_none() {
                if n < laid {
                    // The socket took less than it was given: it is full,
                    // and another try now would only be told so. Next time
                    // lay out about what it takes.
                    self.send_budget = (2 * n).max(MIN_SEND_BUDGET);
                    break;
                }
                self.send_budget = self.send_budget.saturating_mul(2);
            }
        }
        // Ciphertext of frames TLS has taken (their buffers are free
        // again) still goes out: what flushing means for this link.
        if let Some(t) = self.tls.as_mut() {
            if !tls_tried && t.flush(self.stream.as_fd()).is_err() {
                return Err(self.fail(ErrorKind::PeerGone.into(), true));
            }
            // Ciphertext that went out is progress, whichever write sent it.
            if Some(t.written()) != written {
                let now = Instant::now();
                self.last_tx = now;
                self.last_progress = now;
            }
        }
        if self.out.is_empty() && !self.retired.is_empty() {
            for id in std::mem::take(&mut self.retired) {
                self.pools.remove(&id);
            }
        }
        Ok(())
    }

    /// Whether anything waits to go out: queued frames, or ciphertext TLS
    /// holds for the socket.
    fn unsent(&self) -> bool {
        !self.out.is_empty() || self.tls.as_ref().is_some_and(|t| t.wants_write())
    }

    fn consume_sent(&mut self, mut n: usize) {
        while n > 0 {
            let f = self.out.front().expect("bytes sent belong to queued frames");
            let left = f.len() - self.out_sent;
            if n < left {
                self.out_sent += n;
                return;
            }
            n -= left;
            self.out_sent = 0;
            self.out_payload -= f.payload_len;
            self.stats.payload_sent += f.payload_len as u64;
            self.stats.frames_sent += 1;
            self.out.pop_front();
        }
    }

    /// Keep-alives and the peer's liveness.
    fn tick(&mut self) -> Result<()> {
        let now = Instant::now();
        let timeout = self.options.peer_timeout;
        if now.duration_since(self.last_rx) > timeout {
            return Err(self.fail(ErrorKind::PeerUnresponsive(timeout).into(), true));
        }
        if self.unsent() && now.duration_since(self.last_progress) > timeout {
            return Err(self.fail(ErrorKind::PeerUnresponsive(timeout).into(), true));
        }
        if !self.unsent() && now.duration_since(self.last_tx) > self.keepalive {
            self.queue_control(TYPE_KEEPALIVE)?;
            self.flush()?;
        }
        Ok(())
    }

    /// The end of the stream or a socket error.
    fn stream_ended(&mut self, err: Option<io::Error>) -> Error {
        // A goodbye first: the peer closed its end on purpose (even if the
        // close then raced our last frames into a reset).
        if self.goodbye_seen {
            return self.fail(ErrorKind::PeerGone.into(), false);
        }
        // A record that failed its authentication, or a TLS alert: like a
        // malformed frame, whoever sent it.
        if let Some(e) = err.as_ref().and_then(tls::failure) {
            return self.fail(e, false);
        }
        self.fail(ErrorKind::PeerGone.into(), true)
    }

    /// Parse a complete header: the next state, or a message complete in
    /// its header alone. Keep-alives and goodbyes are consumed here.
    fn parse_head(&mut self, gate: &mut dyn PayloadGate) -> Result<Option<Message>> {
        let head = proto::SlotHead::read(&self.head).expect("the frame head is a slot header");
        let proto::SlotHead { op: kind, flags, meta_len: meta, index, aux, pool } = head;
        let bad = |what: String| ErrorKind::Protocol(format!("frame type {kind}: {what}"));
        if kind == TYPE_KEEPALIVE || kind == TYPE_GOODBYE {
            if flags != 0 || meta != 0 || aux != 0 {
                return Err(bad("keep-alive or goodbye with content".into()).into());
            }
            if kind == TYPE_GOODBYE {
                self.goodbye_seen = true;
            }
            self.rx = RxState::Head { have: 0 };
            self.last_payload = false;
            return Ok(None);
        }
        // The slot's body (meta data, or an aggregate's fragment table).
        let Some(limit) = proto::body_limit(kind, self.meta_size) else {
            return Err(bad("unknown frame type".into()).into());
        };
        if meta > limit {
            return Err(bad(format!("meta length {meta} out of range")).into());
        }
        let payload = flags & FLAG_PAYLOAD != 0;
        let target = match (kind, payload) {
            (TYPE_MOVE | TYPE_COPY | TYPE_PASS, true) => {
                let p = self.pools.get(&pool).ok_or_else(|| bad(format!("pool {pool} not on this channel")))?;
                if index >= p.geometry.count() {
                    return Err(bad(format!("buffer index {index} out of range")).into());
                }
                if aux != p.geometry.buffer_size() as u64 {
                    return Err(bad(format!(
                        "payload of {aux} bytes for a pool of {}-byte buffers",
                        p.geometry.buffer_size()
                    ))
                    .into());
                }
                let probe = head.payload_probe().expect("a move, copy or pass");
                Some(match gate.admit(&probe)? {
                    Landing::Land => Target::Land { pool, offset: index as usize * aux as usize },
                    Landing::Discard => Target::Discard,
                })
            }
            (TYPE_COPY, false) => {
                // Another copy of a buffer whose bytes we received as a copy
                // (and which cannot have changed since: its owner keeps it
                // read-only while our copies are out).
                let buf = BufferId { pool, index };
                let probe = Message::Copy { buf, meta: Meta::empty() };
                if gate.admit(&probe)? == Landing::Land && !self.copied_in.contains(&buf) {
                    return Err(bad("copy without payload of a buffer we never received".into()).into());
                }
                None
            }
            (TYPE_MOVE, false) => return Err(bad("move without its payload".into()).into()),
            (_, true) => return Err(bad("payload on a frame that carries none".into()).into()),
            (_, false) => None,
        };
        let len = if target.is_some() { aux as usize } else { 0 };
        if meta == 0 && len == 0 {
            let msg = Message::decode(&self.head[..FRAME_HEAD], self.meta_size)?;
            self.rx = RxState::Head { have: 0 };
            self.last_payload = false;
            self.stats.frames_received += 1;
            return Ok(Some(msg));
        }
        self.rx = RxState::Body { meta, have_meta: 0, target, len, have: 0 };
        Ok(None)
    }

    /// Read and parse until one message is complete or the socket is dry.
    ///
    /// One message per call, each payload checked by `gate` only after the
    /// messages before it were delivered (the gate must see the state their
    /// delivery leaves). What is read ahead is header and meta bytes only,
    /// never a payload byte: a payload goes from the socket straight into
    /// its buffer.
    fn read_message(&mut self, gate: &mut dyn PayloadGate) -> Result<Option<Message>> {
        loop {
            // What was read ahead first.
            match self.rx {
                RxState::Head { have: FRAME_HEAD } => {
                    if let Some(msg) = self.parse_head(gate)? {
                        return Ok(Some(msg));
                    }
                    continue;
                }
                RxState::Head { have } if self.ahead_start < self.ahead_end => {
                    let take = self.take_ahead(have, FRAME_HEAD);
                    self.rx = RxState::Head { have: have + take };
                    continue;
                }
                RxState::Body { meta, have_meta, target, len, have }
                    if have_meta < meta && self.ahead_start < self.ahead_end =>
                {
                    let take = self.take_ahead(FRAME_HEAD + have_meta, FRAME_HEAD + meta);
                    let have_meta = have_meta + take;
                    if have_meta == meta && have == len {
                        return self.body_complete(target, len).map(Some);
                    }
                    self.rx = RxState::Body { meta, have_meta, target, len, have };
                    continue;
                }
                _ => {}
            }
            // Everything read ahead is parsed: from the socket now.
            debug_assert_eq!(self.ahead_start, self.ahead_end, "a payload is never read ahead");
            (self.ahead_start, self.ahead_end) = (0, 0);
            if let Some(skip) = self.run_continues() {
                match self.read_run(skip) {
                    Ok(0) => return Err(self.stream_ended(None)),
                    Ok(_) => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.more_waiting = false;
                        return Ok(None);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(self.stream_ended(Some(e))),
                }
            }
            let mut offered = 0;
            let got = match self.rx {
                RxState::Head { have } => {
                    offered = FRAME_HEAD - have;
                    let part = RecvPart::slice(&mut self.head[have..FRAME_HEAD]);
                    recv_into(&mut self.tls, self.stream.as_fd(), &mut [part])
                }
                RxState::Body { meta, have_meta, target, len, have } => {
                    // Meta, payload, the next header: no allocation.
                    let mut parts: [RecvPart<'_>; 3] = std::array::from_fn(|_| RecvPart::slice(&mut []));
                    let mut k = 0;
                    let mut push = |part| {
                        parts[k] = part;
                        k += 1;
                    };
                    let (head, ahead) = (&mut self.head, &mut self.ahead);
                    if have_meta < meta {
                        offered += meta - have_meta;
                        push(RecvPart::slice(&mut head[FRAME_HEAD + have_meta..FRAME_HEAD + meta]));
                    }
                    let mut whole = true;
                    match target {
                        Some(Target::Land { pool, offset }) if have < len => {
                            let p = &self.pools[&pool];
                            offered += len - have;
                            push(RecvPart::mapping(&p.map, offset + have, len - have).expect("checked range"));
                        }
                        Some(Target::Discard) if have < len => {
                            self.scratch.resize(64 << 10, 0);
                            let take = (len - have).min(self.scratch.len());
                            whole = take == len - have;
                            offered += take;
                            push(RecvPart::slice(&mut self.scratch[..take]));
                        }
                        _ => {}
                    }
                    if whole {
                        // The next frame's header: never payload, so it may
                        // be read ahead into our own memory.
                        offered += FRAME_HEAD;
                        push(RecvPart::slice(&mut ahead[..FRAME_HEAD]));
                    }
                    recv_into(&mut self.tls, self.stream.as_fd(), &mut parts[..k])
                }
            };
            let n = match got {
                Ok(0) => return Err(self.stream_ended(None)),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.more_waiting = false;
                    return Ok(None);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.stream_ended(Some(e))),
            };
            self.last_rx = Instant::now();
            self.stats.recv_calls += 1;
            // All we asked for came: the socket may well hold more.
            self.more_waiting = n == offered;
            match self.rx {
                RxState::Head { have } => {
                    if have + n < FRAME_HEAD {
                        self.rx = RxState::Head { have: have + n };
                        continue;
                    }
                    self.rx = RxState::Head { have: FRAME_HEAD };
                    if let Some(msg) = self.parse_head(gate)? {
                        return Ok(Some(msg));
                    }
                }
                RxState::Body { meta, have_meta, target, len, have } => {
                    let mut n = n;
                    let m = n.min(meta - have_meta);
                    n -= m;
                    let p = n.min(len - have);
                    n -= p;
                    if matches!(target, Some(Target::Discard)) {
                        self.stats.payload_staged += p as u64;
                    }
                    let (have_meta, have) = (have_meta + m, have + p);
                    if have_meta < meta || have < len {
                        self.rx = RxState::Body { meta, have_meta, target, len, have };
                        continue;
                    }
                    // The read-ahead header bytes: parsed on the next call,
                    // after this message has been delivered.
                    self.ahead_end = n;
                    return self.body_complete(target, len).map(Some);
                }
            }
        }
    }

    /// Move read-ahead bytes into `head[from..to]`; how many.
    fn take_ahead(&mut self, from: usize, to: usize) -> usize {
        let take = (to - from).min(self.ahead_end - self.ahead_start);
        self.head[from..from + take].copy_from_slice(&self.ahead[self.ahead_start..self.ahead_start + take]);
        self.ahead_start += take;
        take
    }

    /// A frame's header, meta and payload are all in: its message. The
    /// next frame starts with what was read ahead.
    fn body_complete(&mut self, target: Option<Target>, len: usize) -> Result<Message> {
        let meta = usize::from(u16::from_le_bytes([self.head[2], self.head[3]]));
        let msg = Message::decode(&self.head[..FRAME_HEAD + meta], self.meta_size)?;
        self.stats.frames_received += 1;
        self.last_payload = len > 0;
        if matches!(target, Some(Target::Land { .. })) {
            self.stats.payload_received += len as u64;
        }
        if let (Some(target), Some(buf)) = (target, msg.payload_buffer()) {
            // A copy's bytes are in our memory whether they landed or were
            // discarded because this process already reads the buffer
            // (same bytes, same memory): a further copy may come without
            // them.
            if self.head[0] == TYPE_COPY {
                self.copied_in.insert(buf);
            } else if matches!(target, Target::Land { .. }) {
                self.copied_in.remove(&buf);
            }
        }
        self.rx = RxState::Head { have: 0 };
        Ok(msg)
    }

    /// Whether to read a run of frames without payload at once, and if so
    /// how many bytes of the frame being read come before the next frame
    /// (its meta data still to read): when the last frame (or this one)
    /// has no payload and the last read took all it asked for, a batch of
    /// such frames (a peer's unfilled passes, releases, credits) is likely
    /// waiting.
    fn run_continues(&self) -> Option<usize> {
        if self.tls.is_some() || !self.more_waiting {
            return None;
        }
        match self.rx {
            RxState::Head { have: 0 } if !self.last_payload => Some(0),
            RxState::Body { meta, have_meta, target: None, .. } => Some(meta - have_meta),
            _ => None,
        }
    }

    /// Read the frames waiting on the socket up to the first payload byte
    /// into the read-ahead buffer: look at what is there (without taking
    /// it), find where the first payload starts, take exactly the bytes
    /// before it. `skip`: meta bytes of the current frame first. Two system
    /// calls for a run of any length (within [`AHEAD`] bytes).
    fn read_run(&mut self, skip: usize) -> io::Result<usize> {
        let fd = self.stream.as_fd();
        let seen = sys::peek(fd, &mut self.ahead[..])?;
        self.stats.recv_calls += 1;
        if seen == 0 {
            return Ok(0);
        }
        let take = header_bytes(&self.ahead[..seen], skip);
        let got = sys::recv_parts(fd, &[RecvPart::slice(&mut self.ahead[..take])])?;
        self.stats.recv_calls += 1;
        self.last_rx = Instant::now();
        self.ahead_end = got;
        // A full look may have left more of the run behind.
        self.more_waiting = seen == AHEAD && take == seen;
        Ok(got)
    }
}

/// How many bytes at the start of `bytes` (what the socket holds, the
/// current frame's meta data `skip` bytes first) are frame headers and meta
/// data: up to the first payload byte, or all of them. As [`NetLink::parse_head`]
/// reads a frame: a header, its meta length of meta data, a payload if the
/// payload flag is set. (A frame that parsing then refuses fails the
/// channel: what was read after it is never looked at.)
fn header_bytes(bytes: &[u8], skip: usize) -> usize {
    let mut pos = skip;
    while pos < bytes.len() {
        if pos + FRAME_HEAD > bytes.len() {
            // A header in part: the rest of it comes before any payload.
            return bytes.len();
        }
        let (flags, meta) = (bytes[pos + 1], usize::from(u16::from_le_bytes([bytes[pos + 2], bytes[pos + 3]])));
        pos += FRAME_HEAD + meta;
        if flags & FLAG_PAYLOAD != 0 {
            break;
        }
    }
    pos.min(bytes.len())
}

impl Link for NetLink {
    fn queued(&mut self) -> Option<usize> {
        Some(self.out.len())
    }

    fn peer(&self) -> String {
        self.stream.peer_addr().map(|a| a.to_string()).unwrap_or_default()
    }

    fn has_room(&mut self) -> bool {
        if self.out.len() >= self.depth {
            let _ = self.flush();
        }
        self.out.len() < self.depth
    }

    fn room(&mut self) -> usize {
        // Several frames are wanted in a row: send what the socket takes.
        if !self.out.is_empty() {
            let _ = self.flush();
        }
        self.depth.saturating_sub(self.out.len())
    }

    fn capacity(&self) -> usize {
        self.depth
    }

    fn send(&mut self, msg: &Message) -> Result<()> {
        self.make_room()?;
        self.queue(msg, true)
    }

    fn send_unfilled(&mut self, msg: &Message) -> Result<()> {
        self.make_room()?;
        self.queue(msg, false)
    }

    fn recv(&mut self, gate: &mut dyn PayloadGate) -> Result<Option<Message>> {
        if let Some(e) = &self.gone {
            return Err(e.clone());
        }
        // Read first: while messages keep arriving, what the application
        // sends in answer piles up and goes out in one system call once the
        // input runs dry (or a batch is full).
        match self.read_message(gate) {
            Ok(Some(msg)) => Ok(Some(msg)),
            Ok(None) => {
                self.flush()?;
                self.tick()?;
                Ok(None)
            }
            Err(e) if matches!(e.kind(), ErrorKind::Protocol(_) | ErrorKind::Tls(_)) => Err(self.fail(e, false)),
            Err(e) => Err(e),
        }
    }

    fn register(&mut self, wake: &WakeSet) -> Result<()> {
        wake.watch(self.stream.as_fd(), Interest::Read)?;
        self.interest = Interest::Read;
        Ok(())
    }

    fn unregister(&mut self, wake: &WakeSet) {
        wake.unwatch(self.stream.as_fd());
    }

    fn arm(&mut self, wake: &WakeSet) -> Arm {
        // An error (or a keep-alive due) is for `recv` to report or send.
        if self.gone.is_some() || NetLink::flush(self).is_err() || self.tick().is_err() {
            return Arm::Ready;
        }
        // Bytes TLS took off the socket and has not given out, or frames
        // read ahead and not parsed yet: the socket will not say so again.
        if self.ahead_start < self.ahead_end || self.tls.as_ref().is_some_and(|t| t.has_input()) {
            return Arm::Ready;
        }
        // Output queued: wake when the socket takes more (room, progress).
        let interest = if self.unsent() { Interest::ReadWrite } else { Interest::Read };
        if interest != self.interest {
            if wake.watch(self.stream.as_fd(), interest).is_err() {
                return Arm::Ready;
            }
            self.interest = interest;
        }
        // Wake for the keep-alive and the liveness checks on time (`tick`
        // acts once a limit is passed, hence the millisecond after it).
        let timeout = self.options.peer_timeout;
        let ours = if self.unsent() { self.last_progress + timeout } else { self.last_tx + self.keepalive };
        let until = ours.min(self.last_rx + timeout) + Duration::from_millis(1);
        Arm::Sleep { until: Some(until) }
    }

    fn flush(&mut self) -> Result<()> {
        self.check()?;
        NetLink::flush(self)
    }

    fn export_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        self.register(memory)
    }

    fn import_pool(&mut self, id: PoolId, geometry: Geometry) -> Result<Arc<PoolMemory>> {
        let memory = PoolMemory::mirror(id, geometry, None)?;
        self.register(&memory)?;
        Ok(memory)
    }

    fn use_pool(&mut self, memory: &Arc<PoolMemory>) -> Result<()> {
        self.register(memory)
    }

    fn forget_pool(&mut self, id: PoolId) {
        self.copied_in.retain(|b| b.pool != id);
        if self.out.iter().any(|f| f.payload.is_some_and(|(pool, _)| pool == id)) {
            self.retired.push(id);
        } else {
            self.pools.remove(&id);
        }
    }

    fn close(&mut self, last: Vec<Message>) {
        if self.closed {
            return;
        }
        if self.gone.is_none() {
            for msg in &last {
                if self.queue(msg, true).is_err() {
                    break;
                }
            }
            let _ = self.queue_control(TYPE_GOODBYE);
            let deadline = Instant::now() + CLOSE_FLUSH.min(self.options.peer_timeout);
            let mut notified = false;
            loop {
                if !self.unsent() {
                    // TLS: close_notify after the goodbye, so the peer's
                    // TLS sees an orderly end of the stream too.
                    match &mut self.tls {
                        Some(t) if !notified => {
                            t.close(self.stream.as_fd());
                            notified = true;
                            continue;
                        }
                        _ => break,
                    }
                }
                if self.flush().is_err() {
                    break;
                }
                if !self.unsent() {
                    continue;
                }
                let Some(left) = deadline.checked_duration_since(Instant::now()) else { break };
                let _ = poll_fd(self.stream.as_fd(), PollFlags::OUT, left);
            }
            let _ = self.stream.shutdown(Shutdown::Write);
        }
        self.closed = true;
    }

    fn peer_can_die(&self) -> bool {
        true
    }

    /// A failed end does not say goodbye: the peer then sees the end of the
    /// stream as a failure too and takes back what it lent us. The peer's
    /// memory is its own, so what we lent it is safely ours again. The
    /// connection ends now, not when the application drops the channel: a
    /// peer that sent a bad frame gets nothing more through (what it still
    /// sends is answered with a reset).
    fn abandon(&mut self) -> bool {
        self.fail(ErrorKind::PeerGone.into(), true);
        let _ = self.stream.shutdown(Shutdown::Both);
        self.died
    }

    fn peer_died(&mut self) -> bool {
        self.died
    }

    fn stats(&self) -> Option<LinkStats> {
        Some(self.stats)
    }
}

impl Drop for NetLink {
    fn drop(&mut self) {
        // Take in what the peer still sent so closing does not reset the
        // connection under frames it has not read yet.
        let mut sink = [0u8; 4096];
        while matches!((&self.stream).read(&mut sink), Ok(n) if n > 0) {}
    }
}

/// Receive into `parts`: by the kernel straight into them, or decrypted
/// by TLS.
fn recv_into(tls: &mut Option<Box<TlsSession>>, fd: BorrowedFd<'_>, parts: &mut [RecvPart<'_>]) -> io::Result<usize> {
    match tls {
        None => sys::recv_parts(fd, parts),
        Some(t) => t.recv_parts(fd, parts),
    }
}

/// Kernel-level liveness on top of our keep-alives: TCP keep-alive probes
/// for a silent connection, and a bound on how long sent data may stay
/// unacknowledged.
pub(crate) fn configure_liveness(stream: &TcpStream, timeout: Duration) {
    use rustix::net::sockopt;
    let fd = stream.as_fd();
    let _ = sockopt::set_socket_keepalive(fd, true);
    let _ = sockopt::set_tcp_keepidle(fd, (timeout / 2).max(Duration::from_secs(1)));
    let _ = sockopt::set_tcp_keepintvl(fd, (timeout / 8).max(Duration::from_secs(1)));
    let _ = sockopt::set_tcp_keepcnt(fd, 4);
    let _ = sockopt::set_tcp_user_timeout(fd, timeout.as_millis().min(u128::from(u32::MAX)) as u32);
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;
    use crate::tls::testing;

    #[test]
    fn keepalives_go_out_for_the_shorter_timeout_within_bounds() {
        let s = Duration::from_secs;
        assert_eq!(keepalive_interval(s(10), s(10)), Duration::from_millis(2500));
        assert_eq!(keepalive_interval(s(10), s(1)), Duration::from_millis(250), "the peer's shorter timeout");
        assert_eq!(keepalive_interval(s(1), s(10)), Duration::from_millis(250), "our own shorter timeout");
        assert_eq!(keepalive_interval(s(10), Duration::ZERO), Duration::from_millis(25), "a peer asking for 0");
    }

    /// A frame as the wire has it: header, meta data, payload.
    fn frame(kind: u8, flags: u8, meta: usize, payload: usize) -> Vec<u8> {
        let mut f = vec![0u8; FRAME_HEAD + meta + payload];
        f[0] = kind;
        f[1] = flags;
        f[2..4].copy_from_slice(&(meta as u16).to_le_bytes());
        f[8..16].copy_from_slice(&(payload as u64).to_le_bytes());
        f
    }

    /// What is read ahead ends at the first payload byte: after a payload
    /// frame's header and meta, never inside a payload.
    #[test]
    fn header_bytes_end_where_a_payload_starts() {
        let pass = frame(TYPE_PASS, 0, 8, 0);
        let keepalive = frame(TYPE_KEEPALIVE, 0, 0, 0);
        let moved = frame(TYPE_MOVE, FLAG_PAYLOAD, 16, 4096);
        let run = [pass.clone(), keepalive.clone(), pass.clone()].concat();
        assert_eq!(header_bytes(&run, 0), run.len(), "frames without payload only");
        let then_move = [run.clone(), moved.clone(), pass.clone()].concat();
        assert_eq!(header_bytes(&then_move, 0), run.len() + FRAME_HEAD + 16, "up to the move's payload");
        assert_eq!(header_bytes(&then_move[..run.len() + 40], 0), run.len() + 40, "the move's meta in part");
        assert_eq!(header_bytes(&then_move[..run.len() + 10], 0), run.len() + 10, "a header in part");
        // The current frame's meta first.
        let rest = [vec![7u8; 5], moved.clone()].concat();
        assert_eq!(header_bytes(&rest, 5), 5 + FRAME_HEAD + 16);
        assert_eq!(header_bytes(&rest[..3], 5), 3, "not even the meta is all there");
        assert_eq!(header_bytes(&moved, 0), FRAME_HEAD + 16);
    }

    /// Lands every payload.
    struct LandAll;

    impl PayloadGate for LandAll {
        fn admit(&mut self, _: &Message) -> Result<Landing> {
            Ok(Landing::Land)
        }
    }

    /// A stream of passes with and without payload, keep-alives and
    /// releases, in pieces of random sizes: the link gives back every
    /// message in order, each payload whole in its buffer, with runs of
    /// frames without payload read ahead and payloads never.
    #[test]
    fn frames_in_random_pieces_arrive_whole_and_in_order() {
        use std::os::unix::net::UnixStream;
        const SIZE: usize = 4096;
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let stream = TcpStream::from(std::os::fd::OwnedFd::from(ours));
        let mut link = NetLink::new(stream, None, 16, 1024, NetOptions::default(), Duration::from_secs(10)).unwrap();
        let id = PoolId::from_u128(0xbeef);
        let memory = PoolMemory::mirror(id, Geometry::new(SIZE, 8).unwrap(), None).unwrap();
        link.use_pool(&memory).unwrap();
        let view = memory.map(Access::ReadWrite, 1).unwrap();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let (mut wire, mut expected) = (Vec::new(), Vec::new());
        for seq in 0..2000u64 {
            let buf = BufferId { pool: id, index: next(8) as u32 };
            let meta = Meta::new(&seq.to_le_bytes()[..next(9) as usize]).unwrap();
            let (msg, payload) = match next(8) {
                0 => (None, false),
                1 => (Some(Message::Release { buf }), false),
                2 | 3 => (Some(Message::Pass { buf, meta }), true),
                _ => (Some(Message::Pass { buf, meta }), false),
            };
            let mut head = [0u8; FRAME_HEAD + proto::MAX_META_SIZE];
            let len = match &msg {
                Some(m) => {
                    m.encode(&mut head);
                    FRAME_HEAD + usize::from(u16::from_le_bytes([head[2], head[3]]))
                }
                None => {
                    head[0] = TYPE_KEEPALIVE;
                    FRAME_HEAD
                }
            };
            if payload {
                head[1] |= FLAG_PAYLOAD;
                head[8..16].copy_from_slice(&(SIZE as u64).to_le_bytes());
            }
            wire.extend_from_slice(&head[..len]);
            if payload {
                wire.extend((0..SIZE).map(|i| (seq as usize + i) as u8));
            }
            if let Some(m) = msg {
                expected.push((m, payload.then_some(seq)));
            }
        }
        let pieces: Vec<usize> = (0..wire.len()).map(|_| 1 + next(6000) as usize).collect();
        let writer = std::thread::spawn(move || {
            let mut at = 0;
            for p in pieces {
                if at == wire.len() {
                    break;
                }
                let end = (at + p).min(wire.len());
                theirs.write_all(&wire[at..end]).unwrap();
                at = end;
            }
            theirs
        });
        for (i, (want, seq)) in expected.iter().enumerate() {
            let got = loop {
                match link.recv(&mut LandAll).unwrap() {
                    Some(m) => break m,
                    None => {
                        let _ = poll_fd(link.stream.as_fd(), PollFlags::IN, Duration::from_secs(10));
                    }
                }
            };
            assert_eq!(&got, want, "message {i}");
            if let (Some(seq), Message::Pass { buf, .. }) = (seq, want) {
                // SAFETY: the test's own view of the pool; the link wrote
                // the payload before giving back its message.
                let bytes = unsafe { std::slice::from_raw_parts(view.as_ptr().add(buf.index as usize * SIZE), SIZE) };
                assert!(bytes.iter().enumerate().all(|(i, &b)| b == (*seq as usize + i) as u8), "payload of {i}");
            }
        }
        assert_eq!(link.stats.payload_staged, 0);
        assert!(link.stats.recv_calls < expected.len() as u64, "runs are read at once: {:?}", link.stats);
        drop(writer.join().unwrap());
    }

    /// The fuzz target's seeds, and every prefix of each, go through the
    /// frame decoder (with runs read ahead) without a panic.
    #[cfg(feature = "fuzzing")]
    #[test]
    fn fuzz_seeds_decode() {
        for seed in [
            &include_bytes!("../../../../fuzz/seeds/net_frames/control")[..],
            include_bytes!("../../../../fuzz/seeds/net_frames/copy_again"),
            include_bytes!("../../../../fuzz/seeds/net_frames/copy_discard_then_pass"),
            include_bytes!("../../../../fuzz/seeds/net_frames/move_land"),
        ] {
            for n in 0..=seed.len() {
                crate::fuzzing::net_stream_from_peer(&seed[..n]);
            }
        }
    }

    #[test]
    fn setup_messages_carry_the_peer_timeout() {
        let framed = framed(b"FRY1\x03\x00", Duration::from_millis(1234));
        assert_eq!(usize::from(u16::from_le_bytes([framed[0], framed[1]])), framed.len() - 2);
        assert_eq!(unframed(&framed[2..]), Ok((&b"FRY1\x03\x00"[..], Duration::from_millis(1234))));
        assert!(unframed(&[1, 2, 3]).is_err(), "shorter than the timeout");
    }

    /// A flush whose TLS write the socket refused (it is full: the peer
    /// reads nothing) does not write again before it returns: one refused
    /// system call per flush, not two.
    #[test]
    fn a_flush_tries_a_full_socket_once() {
        let ((stream, tls), (_peer, _)) = testing::pair(TLS_SEND_LIMIT);
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(stream.as_fd(), 4096);
        let mut link =
            NetLink::new(stream, Some(Box::new(tls)), 0, 1024, NetOptions::default(), Duration::from_secs(10)).unwrap();
        let refused = |link: &NetLink| link.tls.as_ref().expect("TLS").refused();
        let mut full = false;
        for _ in 0..100_000 {
            link.queue_control(TYPE_KEEPALIVE).unwrap();
            NetLink::flush(&mut link).unwrap();
            if refused(&link) > 0 {
                full = true;
                break;
            }
        }
        assert!(full, "the socket never filled");
        let mut tries = Vec::new();
        for _ in 0..3 {
            link.queue_control(TYPE_KEEPALIVE).unwrap();
            let before = refused(&link);
            NetLink::flush(&mut link).unwrap();
            tries.push(refused(&link) - before);
        }
        assert!(tries.iter().all(|&n| n <= 1), "refused writes per flush: {tries:?}");
        assert!(tries.contains(&1), "the socket took everything: {tries:?}");
    }

    /// A TLS link's kernel holds little unsent ciphertext when the peer
    /// reads nothing, however large the socket's send buffer: what does
    /// not fit waits in TLS (within its send limit) and in the link's queue.
    #[test]
    fn a_tls_link_keeps_the_kernels_unsent_ciphertext_short() {
        let ((stream, tls), (peer, _)) = testing::pair(TLS_SEND_LIMIT);
        // Room for megabytes in the kernel, and a peer that takes little.
        rustix::net::sockopt::set_socket_send_buffer_size(stream.as_fd(), 4 << 20).unwrap();
        rustix::net::sockopt::set_socket_recv_buffer_size(peer.as_fd(), 4096).unwrap();
        let mut link =
            NetLink::new(stream, Some(Box::new(tls)), 0, 1024, NetOptions::default(), Duration::from_secs(10)).unwrap();
        let chunk = vec![7u8; 16 << 10];
        let t = link.tls.as_mut().expect("TLS");
        let fd = link.stream.as_fd();
        let mut queued = 0;
        // Write until the socket refuses ciphertext (at most 64 MiB).
        while t.refused() == 0 && queued < 64 << 20 {
            queued += t.queue(fd, &chunk).unwrap();
        }
        assert!(t.refused() > 0, "the socket took {queued} bytes and never refused more");
        let unsent = sys::unsent_bytes(&link.stream).unwrap();
        assert!(
            unsent <= TLS_UNSENT_LOW_WATER + TLS_SEND_LIMIT,
            "{unsent} bytes of ciphertext unsent in the kernel (low-water mark {TLS_UNSENT_LOW_WATER})"
        );
        drop(peer);
    }

    /// Ciphertext TLS took for the last queued frame and could not write
    /// (the socket is full): with no frame queued the link still watches
    /// for writability, and the ciphertext goes out once the peer reads.
    #[test]
    fn ciphertext_held_by_tls_alone_keeps_the_link_watching_for_writability() {
        let ((stream, tls), (mut peer, _)) = testing::pair(TLS_SEND_LIMIT);
        // Small buffers: the socket fills after a few frames.
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(stream.as_fd(), 4096);
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(peer.as_fd(), 4096);
        let mut link =
            NetLink::new(stream, Some(Box::new(tls)), 0, 1024, NetOptions::default(), Duration::from_secs(10)).unwrap();
        let wake = WakeSet::new().unwrap();
        Link::register(&mut link, &wake).unwrap();
        let mut held = false;
        for _ in 0..100_000 {
            link.queue_control(TYPE_KEEPALIVE).unwrap();
            NetLink::flush(&mut link).unwrap();
            if link.out.is_empty() && link.tls.as_ref().is_some_and(|t| t.wants_write()) {
                held = true;
                break;
            }
        }
        assert!(held, "the socket never filled with the last frame's ciphertext");
        assert!(matches!(Link::arm(&mut link, &wake), Arm::Sleep { .. }));
        assert_eq!(
            link.interest,
            Interest::ReadWrite,
            "TLS holds ciphertext: the link must wake when the socket drains"
        );
        let mut sink = vec![0u8; 64 << 10];
        loop {
            match peer.read(&mut sink) {
                Ok(n) => assert!(n > 0, "the link closed the connection"),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("peer: {e}"),
            }
        }
        assert!(wake.wait(Duration::from_secs(10)), "the drained socket did not wake the link");
        NetLink::flush(&mut link).unwrap();
        assert!(!link.unsent(), "the held ciphertext went out");
    }
}
