//! The NBD front end: a [`Store`] served to unmodified NBD clients
//! (qemu, libnbd's tools, fio, the Linux kernel's nbd driver) over TCP or
//! a Unix socket, as the NBD protocol specification states it.
//!
//! Handshake: fixed newstyle only, with `NBD_OPT_EXPORT_NAME`, `_GO`,
//! `_INFO` (export, name, description and block size information),
//! `_LIST`, `_ABORT`, `_STRUCTURED_REPLY`, `_LIST_META_CONTEXT` and
//! `_SET_META_CONTEXT` (the `base:allocation` context); any other option
//! is answered `NBD_REP_ERR_UNSUP`. Transmission: `READ`, `WRITE` (with
//! FUA), `FLUSH`, `TRIM`, `WRITE_ZEROES` (with `NO_HOLE`), `BLOCK_STATUS`,
//! `CACHE` and `DISC`, simple or structured replies (where structured
//! replies were negotiated, reads, block status and errors are answered
//! with structured chunks, and every other success with a simple reply, as
//! the protocol allows: the client takes one 16-byte header for it, not a
//! 20-byte chunk header in two parts). The server offers
//! multi-conn: every connection works on the one store, and a FLUSH on any
//! of them puts on stable storage every write any of them has been
//! answered for.
//!
//! Every write payload is read from the socket straight into a buffer of a
//! Ferry pool (an [`Allocator`] per connection) and written to the store
//! from there; every read reply is sent from the buffer the store filled
//! (one `writev` of header and buffer). Stores that keep their data in
//! memory ([`MemStore`](crate::MemStore)) save that copy: a write of 64 KiB
//! or more is received straight into the store's chunks as it arrives
//! (receives that do not wait, header and payload in one when they wait
//! together, [`Store::write_direct`]; the store makes memory ready for
//! the bytes that have arrived, never for a payload only announced),
//! and a read of 64 KiB or more is sent straight from them (one
//! `sendmsg` that does not wait, [`Store::read_direct`]; what the socket
//! does not take at once is copied into the connection's buffer and sent
//! from there), so no client ever holds a part of the store while the
//! server waits for it. A structured read of 64 KiB or
//! more over zero extents of the store sends those as holes
//! (`NBD_REPLY_TYPE_OFFSET_HOLE`): only the data crosses the wire.
//!
//! Clients that mean harm cost the server little: [`NbdServer::run`]
//! closes a connection that has not finished its handshake within
//! [`ServerConfig::handshake_timeout`], serves at most
//! [`ServerConfig::max_connections`] at once, and makes room for a new
//! client — at that limit, or out of file descriptors or memory — by
//! closing the oldest connection still in its handshake (the NBD
//! specification lets a server end a session it takes for a denial of
//! service). A write's payload takes store memory only as it arrives.
//!
//! A connection is served by [`serve_connection`], one thread each
//! (under `SCHED_BATCH` when [`NbdServer::run`] starts it: a server woken
//! for more room on its socket does not preempt its client); a
//! client that breaks the protocol loses its own connection and nothing
//! else. Requests a client pipelines are taken in batches: after a
//! request without a large payload, the server receives whatever waits on
//! the socket (up to 64 KiB: the headers of many requests and the
//! payloads of small writes, in one receive that does not wait) and
//! serves the requests from there, a small write's payload copied into
//! the connection's buffer; after a write large enough to land in the
//! store, it looks at what waits (`MSG_PEEK`) before taking it, so that
//! the next such write can land too (a write seen waiting has its header
//! and payload taken in one receive). It holds the replies of reads,
//! writes and the other requests answered without data until no request
//! waits, or until it has to wait for the rest of one (a payload still on
//! its way), then sends them in one `writev`, the reads' data from
//! consecutive parts of the connection's buffer: a client finds several
//! replies in one segment, and no reply waits for a request that has not
//! arrived. Replies still queued when the client shuts its side of the
//! connection down go before the server closes it.
//!
//! # TLS
//!
//! [`ServerConfig::tls`] offers TLS the protocol's own way
//! (`NBD_OPT_STARTTLS`), with the meanings nbdkit and qemu-nbd give
//! `--tls=off|on|require` ([`NbdTls`]): off refuses `NBD_OPT_STARTTLS`
//! with `NBD_REP_ERR_POLICY`; on serves clients that ask for TLS and
//! clients that do not; require answers every option but
//! `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` with `NBD_REP_ERR_TLS_REQD`
//! until TLS is up, and ends the connection of a client that asks for the
//! export in plain text with `NBD_OPT_EXPORT_NAME` (which cannot be
//! answered with an error), so no byte of the export leaves unencrypted.
//! After the server's `NBD_REP_ACK` comes the TLS 1.3 handshake (rustls,
//! through the library's [`TlsConfig`]): the server presents its
//! certificate and takes only a client whose certificate the CA signed;
//! a client without one, or with one of another CA, fails the handshake
//! and loses its connection. Then the rest of the option haggling and the
//! whole transmission phase go through TLS, and what was negotiated in
//! plain text before (structured replies, metadata contexts) is
//! forgotten, as the protocol asks: a man in the middle could have
//! injected it. A second `NBD_OPT_STARTTLS` is `NBD_REP_ERR_INVALID`;
//! `NBD_CMD_DISC` ends the TLS session with `close_notify`.
//!
//! The TLS handshake counts as part of the connection's handshake: the
//! handshake deadline and the connection cap of [`NbdServer::run`] bound
//! it as they bound the rest, so clients that stall in it cannot keep
//! others out.
//!
//! Under TLS the payload paths that go around the byte stream are not
//! taken: every write's payload is decrypted by rustls from its records
//! into the connection's buffer (never received straight into the store's
//! memory), and every read's data is encrypted from the buffer the store
//! filled into records. That is the one copy encryption needs; the plain
//! path keeps its zero-copy receives and sends unchanged. Replies are
//! held while requests the client pipelined are already decrypted, and
//! leave together (in as few records as rustls makes of them) before the
//! server waits for more.
//!
//! The TLS version is 1.3 only, as everywhere in Ferry
//! ([`TlsConfig`]). The NBD specification asks for TLS 1.2 as well;
//! libnbd and qemu (GnuTLS) negotiate 1.3, and a client that can only
//! talk 1.2 fails the handshake.
//!
//! libnbd and qemu offer X.509 certificates and pre-shared keys (PSK).
//! Only certificates are served: rustls has no TLS 1.3 PSK
//! authentication without certificates (its PSK support is for session
//! resumption), so a client that offers only a PSK fails the handshake.
//!
//! A write whose client goes away in the middle of its payload (it gets
//! no reply) is applied in whole sectors of 512 bytes ([`SECTOR`]) from
//! its start: every sector it covers holds all of its bytes for that
//! sector or none, the same for every store and every way the payload
//! came in; the bytes of a sector that did not arrive whole are dropped.

use std::fmt;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{TcpListener, ToSocketAddrs};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::tls::{rustls, TlsConfig};
use ferry::{Allocator, Buffer, Domain, PoolConstraints};

use crate::conns::{Conns, Notices};
use crate::store::{Extent, Store};
use crate::Error;

// The parts of the server share one namespace: each `use super::*`, which
// holds the imports above and the items below.
mod conn;
mod handshake;
mod proto;
mod server;
mod transmission;

use conn::*;
use proto::*;
use server::*;

pub use conn::{serve_connection, SECTOR};
pub use server::NbdServer;

/// Settings of a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The export's name; `""` is the default export.
    pub export_name: String,
    /// Shown to clients that ask (`NBD_INFO_DESCRIPTION`).
    pub description: String,
    /// Largest READ or WRITE payload, in bytes (a power of two, at least
    /// 4096): the size of each connection's pool buffer, advertised as
    /// the maximum block size.
    pub max_payload: u32,
    /// Refuse writes (`NBD_FLAG_READ_ONLY`).
    pub read_only: bool,
    /// Run each connection's thread under `SCHED_BATCH` (the default), so
    /// that a connection woken by its client does not preempt the thread
    /// on that core, which on one machine is often the client itself: bulk
    /// transfers go faster, a request may wait for the end of a time slice
    /// on a busy machine. `false` keeps the policy threads inherit.
    pub batch_threads: bool,
    /// Most connections [`NbdServer::run`] serves at once (default
    /// [`DEFAULT_MAX_CONNECTIONS`], at least 1). A client that comes when
    /// there are this many closes the oldest connection still in its
    /// handshake, or, if every one is past it, is refused (its connection
    /// closed at once). Running out of file descriptors or memory closes
    /// the oldest connection still in its handshake too.
    pub max_connections: usize,
    /// How long a client has from connecting to the end of its option
    /// negotiation (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`; a TLS handshake
    /// in between included) before
    /// [`NbdServer::run`] closes its connection (default
    /// [`DEFAULT_HANDSHAKE_TIMEOUT`]; more than zero).
    pub handshake_timeout: Duration,
    /// TLS through `NBD_OPT_STARTTLS` (see [`NbdTls`]). Default
    /// [`NbdTls::Off`].
    pub tls: NbdTls,
    /// Serve clients in plain text on a TCP address that is not a loopback
    /// address, chosen on purpose: anyone who reaches the port may use the
    /// export, and the network sees and can change every byte. Without
    /// it, [`NbdServer::bind`] takes such an address only with
    /// [`NbdTls::Require`] (plain text stays as easy as ever on the
    /// loopback and on Unix sockets).
    pub insecure: bool,
}

/// When a client talks TLS to the server: nbdkit's and qemu-nbd's
/// `--tls=off|on|require`. TLS starts the protocol's own way: the client
/// sends `NBD_OPT_STARTTLS` during option haggling, the server
/// acknowledges it, and from the TLS handshake on the whole connection
/// (the rest of the options, every request and reply) goes through TLS
/// 1.3 with mutual certificate authentication: the server presents the
/// configuration's server certificate and takes only a client whose
/// certificate the configuration's CA signed ([`TlsConfig`]).
#[derive(Debug, Clone, Default)]
pub enum NbdTls {
    /// No TLS: `NBD_OPT_STARTTLS` is refused with `NBD_REP_ERR_POLICY`.
    #[default]
    Off,
    /// TLS for the clients that ask for it; the others are served in
    /// plain text.
    On(Arc<TlsConfig>),
    /// TLS only: until TLS is up, every option but `NBD_OPT_STARTTLS` and
    /// `NBD_OPT_ABORT` is refused with `NBD_REP_ERR_TLS_REQD`, and a
    /// client that asks for the export in plain text
    /// (`NBD_OPT_EXPORT_NAME`, which cannot be refused) loses its
    /// connection: no byte of the export goes out unencrypted.
    Require(Arc<TlsConfig>),
}

impl NbdTls {
    fn config(&self) -> Option<&Arc<TlsConfig>> {
        match self {
            NbdTls::Off => None,
            NbdTls::On(c) | NbdTls::Require(c) => Some(c),
        }
    }
}

/// [`ServerConfig::max_connections`] unless told otherwise: room for the
/// connections of many clients (nbdcopy opens 4, qemu one per
/// `multi-conn`), and two file descriptors each (the socket and the
/// connection's buffer) well within the usual limit of 1024.
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;

/// [`ServerConfig::handshake_timeout`] unless told otherwise: a client on
/// the other side of the world negotiates in well under a second.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            export_name: String::new(),
            description: "Ferry block store".into(),
            max_payload: 32 << 20,
            read_only: false,
            batch_threads: true,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            tls: NbdTls::Off,
            insecure: false,
        }
    }
}

/// Where a server listens: `tcp:HOST:PORT` or `unix:PATH`.
///
/// ```
/// use ferry_block::Listen;
/// assert!(matches!("tcp:127.0.0.1:10809".parse::<Listen>()?, Listen::Tcp(_)));
/// assert!(matches!("unix:/tmp/ferry-nbd.sock".parse::<Listen>()?, Listen::Unix(_)));
/// assert!("udp:1".parse::<Listen>().is_err());
/// # Ok::<(), ferry_block::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A TCP address (port 0: the kernel picks one).
    Tcp(std::net::SocketAddr),
    /// A Unix stream socket at this path.
    Unix(PathBuf),
}

impl std::str::FromStr for Listen {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |why: &str| Error::BadSpec(format!("{s}: {why}; give tcp:HOST:PORT or unix:PATH"));
        if let Some(hostport) = s.strip_prefix("tcp:") {
            let addr = hostport
                .to_socket_addrs()
                .map_err(|_| bad("not a host and port"))?
                .next()
                .ok_or_else(|| bad("the host has no address"))?;
            return Ok(Listen::Tcp(addr));
        }
        if let Some(path) = s.strip_prefix("unix:").filter(|p| !p.is_empty()) {
            return Ok(Listen::Unix(PathBuf::from(path)));
        }
        Err(bad("not a listening address"))
    }
}

impl fmt::Display for Listen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Listen::Tcp(a) => write!(f, "tcp:{a}"),
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// What happened on one client connection, reported when it ends.
#[derive(Debug, Clone, Default)]
pub struct ConnSummary {
    /// The client's address (`tcp:IP:PORT`, or `unix` and a number).
    pub peer: String,
    /// Whether the connection reached the transmission phase.
    pub transmission: bool,
    /// Whether structured replies were negotiated.
    pub structured: bool,
    /// Whether the connection went over TLS (`NBD_OPT_STARTTLS`).
    pub tls: bool,
    /// READ requests answered with data.
    pub reads: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// WRITE requests done.
    pub writes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// FLUSH requests done.
    pub flushes: u64,
    /// TRIM requests done.
    pub trims: u64,
    /// WRITE_ZEROES requests done.
    pub zeroes: u64,
    /// BLOCK_STATUS requests answered.
    pub block_status: u64,
    /// CACHE requests done.
    pub caches: u64,
    /// Requests answered with an error.
    pub errors: u64,
    /// Bytes of writes received straight into the store (no copy).
    pub landed_bytes: u64,
    /// Bytes of reads sent straight from the store (no copy).
    pub sent_direct_bytes: u64,
    /// How it ended, in a few words.
    pub end: String,
    /// How long it lasted.
    pub elapsed: Duration,
}

impl fmt::Display for ConnSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let tls = if self.tls { " (TLS)" } else { "" };
        write!(f, "client {}{tls} {} after {:.3} s", self.peer, self.end, self.elapsed.as_secs_f64())?;
        if !self.transmission {
            return write!(f, " (handshake only)");
        }
        write!(
            f,
            ": {} reads ({:.1} MiB), {} writes ({:.1} MiB), {} flushes, {} trims, {} write-zeroes, {} block-status, {} cache, {} errors; {:.1} MiB received into and {:.1} MiB sent from the store without a copy",
            self.reads,
            mib(self.read_bytes),
            self.writes,
            mib(self.write_bytes),
            self.flushes,
            self.trims,
            self.zeroes,
            self.block_status,
            self.caches,
            self.errors,
            mib(self.landed_bytes),
            mib(self.sent_direct_bytes)
        )
    }
}

/// A byte stream to one client.
pub trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}
