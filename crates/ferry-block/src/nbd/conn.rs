//! One client connection: its socket, the session that serves it, TLS
//! once the client asks for it, and the I/O helpers they share.

use super::*;

/// Send buffer of a TCP connection to a client on the same machine
/// (the kernel doubles it for its bookkeeping), instead of one the kernel
/// grows to 4 MiB. Over loopback the client copies each reply out of
/// memory the server filled moments before: with megabytes queued that
/// memory has left the caches by then, and the client's copy runs from
/// main memory. nbdcopy reading 1 GiB over 2 connections spent 0.46 s of
/// CPU against a grown buffer and 0.29 s with this one (0.36 s against
/// nbdkit), and read 1.24x faster. Between machines the kernel's sizing
/// stays: there the buffer must cover the path's delay.
pub(super) const LOOPBACK_SNDBUF: usize = 256 << 10;

/// Why a connection ends.
pub(super) enum End {
    /// The client said so (`NBD_OPT_ABORT`, `NBD_CMD_DISC`).
    Soft(&'static str),
    /// The client closed the connection or broke the protocol.
    Hard(String),
}

impl From<io::Error> for End {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            End::Hard("closed the connection".into())
        } else {
            End::Hard(format!("connection failed ({e})"))
        }
    }
}

pub(super) type Step<T> = Result<T, End>;

/// Serve one client on `stream` until it disconnects or breaks the
/// protocol; the summary says what it did. Never panics on anything the
/// client sends. The handshake has no deadline here: a caller that takes
/// clients it does not trust bounds the stream itself (as
/// [`NbdServer::run`] does).
pub fn serve_connection<S: Read + Write>(
    stream: S,
    store: &dyn Store,
    config: &ServerConfig,
    peer: String,
) -> ConnSummary {
    serve_socket(stream, store, config, peer, None, None, None)
}

/// The socket under a connection's stream, for what a byte stream cannot
/// do: look at what waits without taking it, wait until something waits,
/// receive and send without waiting.
pub(super) struct Socket {
    /// Open as long as the stream it belongs to.
    pub(super) fd: RawFd,
}

/// Smallest write payload received straight into the store: below it the
/// copy from the connection's buffer costs next to nothing.
pub(super) const LAND_MIN: usize = 64 << 10;
/// Reads of at least this many bytes are sent straight from stores that
/// hand out their memory ([`Store::read_direct`]); smaller ones are
/// gathered in the connection's buffer and leave together.
pub(super) const DIRECT_READ_MIN: usize = 64 << 10;

impl Socket {
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: `fd` stays open as long as the stream it belongs to,
        // which outlives the session holding this `Socket` (see
        // `NbdServer::run`).
        unsafe { BorrowedFd::borrow_raw(self.fd) }
    }

    /// Copy what waits on the socket into `look` without taking it or
    /// waiting: the number of bytes (0 if nothing waits or on an error).
    pub(super) fn peek(&self, look: &mut [u8]) -> usize {
        let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
        rustix::net::recv(self.fd(), look, flags).map_or(0, |(n, _)| n)
    }

    /// Receive into `parts` what waits on the socket, without waiting:
    /// `None` if nothing waits, `Some(0)` at the end of the stream.
    pub(super) fn recv_now(&self, parts: &mut [IoSliceMut<'_>]) -> io::Result<Option<usize>> {
        loop {
            let flags = rustix::net::RecvFlags::DONTWAIT;
            match rustix::net::recvmsg(self.fd(), parts, &mut Default::default(), flags) {
                Ok(r) => return Ok(Some(r.bytes)),
                Err(rustix::io::Errno::AGAIN) => return Ok(None),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// How many bytes wait on the socket (`FIONREAD`; 0 on an error).
    pub(super) fn waiting(&self) -> usize {
        rustix::io::ioctl_fionread(self.fd()).map_or(0, |n| n as usize)
    }

    /// Wait until something waits on the socket (or it ends or fails).
    pub(super) fn wait_readable(&self) {
        let fd = self.fd();
        let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
        loop {
            match rustix::event::poll(&mut fds, None) {
                Err(rustix::io::Errno::INTR) => {}
                _ => return,
            }
        }
    }

    /// Send as much of `parts` as the socket takes now: the bytes sent
    /// (0 if its buffer is full).
    pub(super) fn send_now(&self, parts: &[IoSlice<'_>]) -> io::Result<usize> {
        let flags = rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL;
        loop {
            match rustix::net::sendmsg(self.fd(), parts, &mut Default::default(), flags) {
                Ok(n) => return Ok(n),
                Err(rustix::io::Errno::AGAIN) => return Ok(0),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// [`serve_connection`], with the socket under the stream: then the
/// headers of several requests are taken in one read, the replies to
/// consecutive reads leave in one write, and (for stores that hand out
/// their memory) write payloads are received straight into the store and
/// large reads sent straight from it.
pub(super) fn serve_socket<S: Read + Write>(
    stream: S,
    store: &dyn Store,
    config: &ServerConfig,
    peer: String,
    socket: Option<Socket>,
    guard: Option<Guard<'_>>,
    buffer: Option<(Allocator, Buffer)>,
) -> ConnSummary {
    let started = Instant::now();
    let mut session =
        Session::new(stream, store, config, ConnSummary { peer, ..ConnSummary::default() }, socket, buffer);
    let negotiated = session.hello().and_then(|()| session.options());
    let mut summary = match (negotiated, config.tls.config()) {
        (Ok(Negotiated::StartTls), Some(tls)) => serve_tls(session, tls, guard),
        (negotiated, _) => session.serve(negotiated, guard),
    };
    summary.elapsed = started.elapsed();
    summary
}

/// What option haggling ended with.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Negotiated {
    /// The export was given: the transmission phase begins.
    Transmission,
    /// `NBD_OPT_STARTTLS` was acknowledged: the TLS handshake begins.
    StartTls,
}

/// Ciphertext taken off the socket per read under TLS (rustls itself
/// reads a few KiB at a time).
pub(super) const TLS_READ_AHEAD: usize = 64 << 10;

/// The plain stream under a TLS connection: reads go through a buffer (a
/// record or several per system call), writes straight to the stream.
pub(super) struct Ciphertext<S: Read + Write>(io::BufReader<S>);

impl<S: Read + Write> Read for Ciphertext<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl<S: Read + Write> Write for Ciphertext<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.get_mut().write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.get_mut().write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.get_mut().flush()
    }
}

pub(super) type TlsStream<S> = rustls::StreamOwned<rustls::ServerConnection, Ciphertext<S>>;

/// The rest of a connection after `NBD_OPT_STARTTLS` was acknowledged:
/// the TLS handshake (within the connection's handshake deadline, which
/// [`NbdServer::run`] keeps), then option haggling anew and the
/// transmission phase, every byte through TLS. What was negotiated in
/// plain text (structured replies, metadata contexts) is forgotten, as the
/// protocol asks: a man in the middle could have sent it. The socket is
/// not handed to the session, so every payload is decrypted and encrypted
/// through rustls (no zero-copy path).
pub(super) fn serve_tls<S: Read + Write>(
    plain: Session<'_, S>,
    tls: &TlsConfig,
    guard: Option<Guard<'_>>,
) -> ConnSummary {
    let Session { stream, store, config, no_zeroes, buffer, mut summary, .. } = plain;
    summary.tls = true;
    let conn = match tls.server_config().map(rustls::ServerConnection::new) {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => return ended(summary, format!("dropped: cannot start TLS ({e})")),
        Err(e) => return ended(summary, format!("dropped: cannot start TLS ({e})")),
    };
    let mut stream = rustls::StreamOwned::new(conn, Ciphertext(io::BufReader::with_capacity(TLS_READ_AHEAD, stream)));
    while stream.conn.is_handshaking() {
        if let Err(e) = stream.conn.complete_io(&mut stream.sock) {
            let why = match e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
                Some(e) => format!("dropped: TLS handshake failed ({e})"),
                None if e.kind() == io::ErrorKind::UnexpectedEof => {
                    "dropped: closed the connection during the TLS handshake".to_string()
                }
                None => format!("dropped: TLS handshake failed ({e})"),
            };
            return ended(summary, why);
        }
    }
    let mut session: Session<'_, TlsStream<S>> = Session::new(stream, store, config, summary, None, buffer);
    session.no_zeroes = no_zeroes;
    session.tls_up = true;
    session.decrypted = Some(decrypted::<S>);
    let negotiated = session.options();
    let summary = session.serve(negotiated, guard);
    // The TLS session ends with close_notify (the client may be gone).
    session.stream.conn.send_close_notify();
    let _ = session.stream.flush();
    summary
}

/// Bytes rustls holds decrypted for the server to read.
pub(super) fn decrypted<S: Read + Write>(stream: &mut TlsStream<S>) -> usize {
    // Records already taken off the socket are decrypted here; an error
    // counts as nothing held (the next read reports it).
    stream.conn.process_new_packets().map_or(0, |state| state.plaintext_bytes_to_read())
}

/// `summary` of a connection that ended `how` during its handshake.
pub(super) fn ended(mut summary: ConnSummary, how: String) -> ConnSummary {
    summary.end = how;
    summary
}

pub(super) struct Session<'a, S> {
    pub(super) stream: S,
    pub(super) store: &'a dyn Store,
    pub(super) config: &'a ServerConfig,
    pub(super) structured: bool,
    /// `base:allocation` selected.
    pub(super) meta: bool,
    pub(super) no_zeroes: bool,
    /// The connection's pool (kept alive with its one buffer) and the
    /// buffer every payload goes through.
    pub(super) buffer: Option<(Allocator, Buffer)>,
    pub(super) summary: ConnSummary,
    pub(super) socket: Option<Socket>,
    /// The next request's payload is in the store already.
    pub(super) landed: bool,
    /// Request headers taken from the socket, not yet served.
    pub(super) staged: std::collections::VecDeque<[u8; 28]>,
    /// Read replies not yet sent: (header, header length, data offset in
    /// the connection's buffer, data length).
    pub(super) replies: Vec<([u8; 28], usize, usize, usize)>,
    /// Where the next queued read's data goes in the connection's buffer.
    pub(super) cursor: usize,
    /// The next request's payload is in the connection's buffer already.
    pub(super) payload_read: bool,
    /// Bytes written by the writes whose replies are queued.
    pub(super) written: usize,
    /// Requests received ahead (headers and small write payloads), taken
    /// from the socket in one receive while small requests come: bytes
    /// `in_at..in_end` are still to be served.
    pub(super) inbuf: Vec<u8>,
    pub(super) in_at: usize,
    pub(super) in_end: usize,
    /// The last request was not a write large enough to land in the
    /// store: the next ones are received ahead into `inbuf`.
    pub(super) small: bool,
    /// The stream is a TLS connection (after `NBD_OPT_STARTTLS`).
    pub(super) tls_up: bool,
    /// Bytes the stream holds decrypted (under TLS): a read of that many
    /// does not wait.
    pub(super) decrypted: Option<fn(&mut S) -> usize>,
}

/// Bytes of requests received ahead in one receive at most.
pub(super) const IN_BUF: usize = 64 << 10;

/// Read replies sent in one write at most.
pub(super) const MAX_QUEUED_REPLIES: usize = 256;
/// Data of the read replies sent in one write at most: small reads are
/// gathered, large ones leave one by one from the start of the buffer
/// (which stays in the cache).
pub(super) const MAX_QUEUED_BYTES: usize = 256 << 10;

/// Fill all of `parts` (one `readv` in the common case); on an error,
/// also how many bytes arrived before it.
pub(super) fn read_parts_counted<R: Read>(r: &mut R, parts: &mut [IoSliceMut<'_>]) -> Result<(), (usize, io::Error)> {
    let mut parts = parts;
    let mut arrived = 0;
    while parts.iter().any(|p| !p.is_empty()) {
        match r.read_vectored(parts) {
            Ok(0) => return Err((arrived, io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => {
                arrived += n;
                IoSliceMut::advance_slices(&mut parts, n);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((arrived, e)),
        }
    }
    Ok(())
}

/// Sectors of the export: a write the client does not send whole (it goes
/// away in the middle of the payload, without a reply) is applied in
/// whole sectors from its start — each sector it covers holds either all
/// the bytes the write has for it or none of them — whatever the store
/// and however the payload was received.
pub const SECTOR: usize = 512;

/// Of a payload for `offset` of which `arrived` bytes are here, the bytes
/// that end on a sector boundary of the export (the part a write cut off
/// there is applied with).
pub(super) fn whole_sectors(offset: u64, arrived: usize) -> usize {
    let end = offset + arrived as u64;
    (end - end % SECTOR as u64).saturating_sub(offset) as usize
}

/// Write all of `parts` (one `writev` in the common case).
pub(super) fn write_all_parts<W: Write>(w: &mut W, parts: &mut [IoSlice<'_>]) -> io::Result<()> {
    let mut parts = parts;
    while !parts.is_empty() {
        match w.write_vectored(parts) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut parts, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl<'a, S: Read + Write> Session<'a, S> {
    pub(super) fn new(
        stream: S,
        store: &'a dyn Store,
        config: &'a ServerConfig,
        summary: ConnSummary,
        socket: Option<Socket>,
        buffer: Option<(Allocator, Buffer)>,
    ) -> Self {
        Session {
            stream,
            store,
            config,
            structured: false,
            meta: false,
            no_zeroes: false,
            buffer,
            summary,
            socket,
            landed: false,
            staged: std::collections::VecDeque::new(),
            replies: Vec::new(),
            cursor: 0,
            payload_read: false,
            written: 0,
            inbuf: Vec::new(),
            in_at: 0,
            in_end: 0,
            small: true,
            tls_up: false,
            decrypted: None,
        }
    }

    /// The transmission phase after option haggling ended with
    /// `negotiated`, and how the connection ended.
    pub(super) fn serve(&mut self, negotiated: Step<Negotiated>, guard: Option<Guard<'_>>) -> ConnSummary {
        let end = negotiated.and_then(|n| {
            if n != Negotiated::Transmission {
                return Err(End::Hard("TLS is not offered by this server".into()));
            }
            if guard.is_some_and(|g| !g.conns.enter_transmission(g.id)) {
                return Err(End::Hard("closed by the server".into()));
            }
            self.summary.transmission = true;
            let end = self.transmission();
            if end.is_err() {
                // The replies still queued: a client that has shut down its
                // side of the connection (or sent something the server
                // cannot serve) reads them before the end.
                let _ = self.flush_replies();
            }
            end
        });
        let mut summary = std::mem::take(&mut self.summary);
        summary.structured = self.structured;
        summary.end = match end {
            Ok(()) | Err(End::Soft(_)) if !summary.transmission => "left (NBD_OPT_ABORT)".into(),
            Ok(()) => "disconnected".into(),
            Err(End::Soft(how)) => format!("disconnected ({how})"),
            Err(End::Hard(why)) => format!("dropped: {why}"),
        };
        summary
    }
}
