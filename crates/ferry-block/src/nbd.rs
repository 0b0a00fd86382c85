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

use ferry::{Allocator, Buffer, Domain, PoolConstraints};

use crate::conns::{Conns, Notices};
use crate::store::{Extent, Store};
use crate::Error;

// Handshake magic numbers and flags.
const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
const FLAG_NO_ZEROES: u16 = 1 << 1;
const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
const CLIENT_NO_ZEROES: u32 = 1 << 1;

// Options.
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_LIST_META_CONTEXT: u32 = 9;
const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_INVALID: u32 = (1 << 31) + 3;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

// Information types of NBD_OPT_INFO / NBD_OPT_GO.
const INFO_EXPORT: u16 = 0;
const INFO_NAME: u16 = 1;
const INFO_DESCRIPTION: u16 = 2;
const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
const TF_HAS_FLAGS: u16 = 1 << 0;
const TF_READ_ONLY: u16 = 1 << 1;
const TF_SEND_FLUSH: u16 = 1 << 2;
const TF_SEND_FUA: u16 = 1 << 3;
const TF_SEND_TRIM: u16 = 1 << 5;
const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
const TF_SEND_DF: u16 = 1 << 7;
const TF_CAN_MULTI_CONN: u16 = 1 << 8;
const TF_SEND_CACHE: u16 = 1 << 10;

// Requests.
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_CACHE: u16 = 5;
const CMD_WRITE_ZEROES: u16 = 6;
const CMD_BLOCK_STATUS: u16 = 7;
const CMD_FLAG_FUA: u16 = 1 << 0;
const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
const CMD_FLAG_DF: u16 = 1 << 2;
const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

// Structured reply chunks.
const REPLY_FLAG_DONE: u16 = 1 << 0;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

// Error values.
const EPERM: u32 = 1;
const EIO: u32 = 5;
const ENOMEM: u32 = 12;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const EOVERFLOW: u32 = 75;

// base:allocation states.
const STATE_HOLE: u32 = 1 << 0;
const STATE_ZERO: u32 = 1 << 1;

/// The one metadata context, and the id it gets when selected.
const BASE_ALLOCATION: &str = "base:allocation";
const BASE_ALLOCATION_ID: u32 = 1;

/// Option data larger than this ends the connection (every option this
/// server knows fits in a few KiB: names and queries are at most 4096
/// bytes).
const MAX_OPTION_DATA: u32 = 64 << 10;
/// Longest string (export name, query) the protocol allows.
const MAX_STRING: usize = 4096;
/// Structured reads of at least this many bytes send the store's zero
/// extents as holes (`NBD_REPLY_TYPE_OFFSET_HOLE`) instead of zeroes.
const SPARSE_READ_MIN: u32 = 64 << 10;
/// Most extents in one block status reply.
const MAX_EXTENTS: usize = 2048;

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
    /// negotiation (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`) before
    /// [`NbdServer::run`] closes its connection (default
    /// [`DEFAULT_HANDSHAKE_TIMEOUT`]; more than zero).
    pub handshake_timeout: Duration,
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
        write!(f, "client {} {} after {:.3} s", self.peer, self.end, self.elapsed.as_secs_f64())?;
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

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

/// An NBD server: a listening socket and the store it serves.
///
/// ```no_run
/// use std::sync::Arc;
/// use ferry_block::{MemStore, NbdServer, ServerConfig};
/// let store = Arc::new(MemStore::new(64 << 20)?);
/// let server = NbdServer::bind(&"tcp:127.0.0.1:0".parse()?, store, ServerConfig::default())?;
/// println!("listening on {}", server.local_addr());
/// server.run(|summary| eprintln!("{summary}"))?; // serves until the process ends
/// # Ok::<(), ferry_block::Error>(())
/// ```
pub struct NbdServer {
    listener: Listener,
    store: Arc<dyn Store>,
    config: Arc<ServerConfig>,
    notice: Arc<dyn Fn(&str) + Send + Sync>,
}

impl NbdServer {
    /// Listen at `listen` for clients of `store`. A Unix socket path where
    /// nobody listens any more (left by a server that was killed) is
    /// replaced; one where a server answers is refused.
    pub fn bind(listen: &Listen, store: Arc<dyn Store>, config: ServerConfig) -> Result<Self, Error> {
        if !config.max_payload.is_power_of_two() || config.max_payload < 4096 {
            return Err(Error::BadSpec(format!(
                "maximum payload {}: give a power of two of at least 4096 bytes",
                config.max_payload
            )));
        }
        if config.export_name.len() > MAX_STRING {
            return Err(Error::BadSpec("export name longer than 4096 bytes".into()));
        }
        if config.max_connections == 0 {
            return Err(Error::BadSpec("a server takes at least 1 connection".into()));
        }
        if config.handshake_timeout.is_zero() {
            return Err(Error::BadSpec("a handshake needs more than no time".into()));
        }
        let io_err = |e: io::Error| Error::Io { what: format!("cannot listen on {listen}"), source: e };
        let listener = match listen {
            Listen::Tcp(addr) => Listener::Tcp(TcpListener::bind(addr).map_err(io_err)?),
            Listen::Unix(path) => {
                if path.exists() && UnixStream::connect(path).is_err() {
                    use std::os::unix::fs::FileTypeExt;
                    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                        let _ = std::fs::remove_file(path);
                    }
                }
                Listener::Unix(UnixListener::bind(path).map_err(io_err)?, path.clone())
            }
        };
        let at = listen.to_string();
        let notice = Arc::new(move |line: &str| eprintln!("ferry block: NBD server on {at}: {line}"));
        Ok(NbdServer { listener, store, config: Arc::new(config), notice })
    }

    /// Where lines about the server itself go (connections closed or
    /// refused because it is at its limits), at most one of a kind every
    /// 10 s; standard error unless told otherwise.
    pub fn on_notice(mut self, notice: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.notice = Arc::new(notice);
        self
    }

    /// Where the server listens (with the port the kernel picked).
    pub fn local_addr(&self) -> Listen {
        match &self.listener {
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) => Listen::Tcp(a),
                Err(_) => Listen::Tcp(([0, 0, 0, 0], 0).into()),
            },
            Listener::Unix(_, p) => Listen::Unix(p.clone()),
        }
    }

    /// Accept clients until the process ends, each on a thread of its
    /// own; `on_end` is told about each connection when it ends. Returns
    /// only if the listening socket fails.
    ///
    /// A connection that has not finished its handshake within
    /// [`ServerConfig::handshake_timeout`] is closed. At
    /// [`ServerConfig::max_connections`], and when the process is out of
    /// file descriptors or memory, the oldest connection still in its
    /// handshake is closed to make room (a client that never negotiates
    /// does not keep the others out); with none to close, a new client
    /// is refused at the limit, and out of resources the server waits a
    /// little and tries again (never spinning). Such events are told to
    /// [`NbdServer::on_notice`].
    pub fn run(self, on_end: impl Fn(&ConnSummary) + Send + Sync + 'static) -> Result<(), Error> {
        let on_end = Arc::new(on_end);
        let conns = Arc::new(Conns::default());
        let mut notices = Notices::new(self.notice.clone());
        let listen_err = |e: io::Error| Error::Io { what: "cannot accept clients".into(), source: e };
        match &self.listener {
            Listener::Tcp(l) => l.set_nonblocking(true),
            Listener::Unix(l, _) => l.set_nonblocking(true),
        }
        .map_err(listen_err)?;
        let listen_fd = match &self.listener {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l, _) => l.as_raw_fd(),
        };
        let cap = self.config.max_connections;
        let mut unix_peers = 0u64;
        // The buffer of the next connection, made before it is accepted.
        let mut spare: Option<(Allocator, Buffer)> = None;
        let mut backoff = BACKOFF_MIN;
        loop {
            let next_deadline = conns.expire(self.config.handshake_timeout);
            // Wait for a client, or until the next handshake runs out.
            let wait = next_deadline.map_or(ACCEPT_WAIT, |d| d.saturating_duration_since(Instant::now()));
            let wait = rustix::event::Timespec::try_from(wait.min(ACCEPT_WAIT)).unwrap_or_default();
            // SAFETY: the listening socket is open as long as `self`.
            let lfd = unsafe { BorrowedFd::borrow_raw(listen_fd) };
            let mut fds = [rustix::event::PollFd::new(&lfd, rustix::event::PollFlags::IN)];
            match rustix::event::poll(&mut fds, Some(&wait)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => continue,
                Ok(_) => {}
                Err(e) => return Err(listen_err(e.into())),
            }
            // A client waits: its buffer first (then the connection needs
            // no file descriptor once accepted).
            if spare.is_none() {
                match connection_buffer(self.config.max_payload) {
                    Ok(b) => spare = Some(b),
                    Err(why) => {
                        out_of_resources(&conns, &mut notices, &why, &mut backoff);
                        continue;
                    }
                }
            }
            let accepted: io::Result<(Box<dyn Stream>, String, RawFd)> = match &self.listener {
                Listener::Tcp(l) => l.accept().and_then(|(s, a)| {
                    s.set_nonblocking(false)?;
                    let _ = s.set_nodelay(true);
                    // Urgent data is ordinary data: no receive stops short at it.
                    let _ = rustix::net::sockopt::set_socket_oobinline(&s, true);
                    if a.ip().is_loopback() {
                        // Fixed, so the kernel does not grow it (see the constant).
                        let _ = rustix::net::sockopt::set_socket_send_buffer_size(&s, LOOPBACK_SNDBUF);
                    }
                    let fd = s.as_raw_fd();
                    Ok((Box::new(s) as Box<dyn Stream>, format!("tcp:{a}"), fd))
                }),
                Listener::Unix(l, _) => l.accept().and_then(|(s, _)| {
                    s.set_nonblocking(false)?;
                    let _ = rustix::net::sockopt::set_socket_oobinline(&s, true);
                    unix_peers += 1;
                    let fd = s.as_raw_fd();
                    Ok((Box::new(s) as Box<dyn Stream>, format!("unix#{unix_peers}"), fd))
                }),
            };
            let (stream, peer, fd) = match accepted {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                // The listening socket itself is unusable: nothing to wait for.
                Err(e) if matches!(e.raw_os_error(), Some(9) | Some(22) | Some(88)) => return Err(listen_err(e)),
                // Out of file descriptors (EMFILE, ENFILE) or memory (ENOMEM, ENOBUFS).
                Err(e) if matches!(e.raw_os_error(), Some(24) | Some(23) | Some(12) | Some(105)) => {
                    out_of_resources(&conns, &mut notices, &format!("cannot accept a client ({e})"), &mut backoff);
                    continue;
                }
                // A client gone before it was accepted, and the like.
                Err(_) => continue,
            };
            backoff = BACKOFF_MIN;
            if conns.active() >= cap {
                let why = format!("closed to make room at the limit of {cap} connections");
                match conns.shed_oldest_handshaking(&why) {
                    Some(shed) => notices.notice("shed at the limit", || {
                        format!("at the limit of {cap} connections: closed {shed}, the oldest still in its handshake, to take {peer}")
                    }),
                    None => {
                        notices.notice("refused at the limit", || {
                            format!("at the limit of {cap} connections, all past their handshake: refused {peer}")
                        });
                        continue;
                    }
                }
            }
            let id = conns.add(fd, &peer);
            let (store, config, on_end, conns_t) =
                (self.store.clone(), self.config.clone(), on_end.clone(), conns.clone());
            let buffer = spare.take();
            let spawned = std::thread::Builder::new().name(format!("nbd {peer}")).spawn(move || {
                let mut stream = stream;
                if config.batch_threads {
                    // If the system refuses, the thread stays as it was.
                    let _ = crate::sys::batch_scheduling();
                }
                // `fd` is the socket of `stream`, which this thread keeps
                // open for as long as `serve_socket` uses `socket`.
                let socket = Socket { fd };
                let guard = Some(Guard { conns: &conns_t, id });
                let mut summary = serve_socket(&mut stream, &*store, &config, peer, Some(socket), guard, buffer);
                let closed = conns_t.remove(id);
                drop(stream);
                conns_t.closed_one();
                if let Some(why) = closed {
                    summary.end = format!("dropped: {why}");
                }
                on_end(&summary);
            });
            if spawned.is_err() {
                // No thread for it: the client's connection closed with the
                // dropped closure.
                conns.remove(id);
                conns.closed_one();
                out_of_resources(&conns, &mut notices, "cannot start a thread", &mut backoff);
            }
        }
    }

    /// [`run`](NbdServer::run) on a thread of its own.
    pub fn spawn(
        self,
        on_end: impl Fn(&ConnSummary) + Send + Sync + 'static,
    ) -> io::Result<std::thread::JoinHandle<Result<(), Error>>> {
        std::thread::Builder::new().name("nbd accept".into()).spawn(move || self.run(on_end))
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = &self.listener {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Longest wait for a client before the accepting thread looks at the
/// handshakes again.
const ACCEPT_WAIT: Duration = Duration::from_secs(1);
/// Waits of the accepting thread out of file descriptors or memory with
/// no connection to close: from the first to the last, doubling.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// Wait for a closed connection to give back what it held.
const SHED_WAIT: Duration = Duration::from_millis(200);

/// The process is out of file descriptors or memory (`why`): close the
/// oldest connection still in its handshake and wait for it to end, or,
/// with none, wait a little (longer each time in a row).
fn out_of_resources(conns: &Conns, notices: &mut Notices, why: &str, backoff: &mut Duration) {
    let seen = conns.ends();
    match conns.shed_oldest_handshaking(&format!("closed to make room: {why}")) {
        Some(shed) => {
            notices.notice("shed out of resources", || {
                format!("{why}: closed {shed}, the oldest connection still in its handshake, to make room")
            });
            conns.wait_for_end(seen, SHED_WAIT);
        }
        None => {
            notices.notice("out of resources", || {
                format!("{why}, and every connection is past its handshake: new clients wait")
            });
            conns.wait_for_end(seen, *backoff);
            *backoff = (*backoff * 2).min(BACKOFF_MAX);
        }
    }
}

/// A connection's pool of one buffer of `max_payload` bytes, in a domain
/// of its own (its memory is only touched, and so only allocated, as far
/// as requests reach).
fn connection_buffer(max_payload: u32) -> Result<(Allocator, Buffer), String> {
    let domain = Domain::new("nbd connection");
    let pool = Allocator::new(&domain, 1, max_payload as usize, PoolConstraints::default())
        .map_err(|e| format!("no buffer for a connection ({e})"))?;
    let buffer = pool.alloc().ok_or_else(|| "the connection's pool is empty".to_string())?;
    Ok((pool, buffer))
}

/// A connection's entry in its server's table of connections.
struct Guard<'a> {
    conns: &'a Conns,
    id: u64,
}

/// Send buffer of a TCP connection to a client on the same machine
/// (the kernel doubles it for its bookkeeping), instead of one the kernel
/// grows to 4 MiB. Over loopback the client copies each reply out of
/// memory the server filled moments before: with megabytes queued that
/// memory has left the caches by then, and the client's copy runs from
/// main memory. nbdcopy reading 1 GiB over 2 connections spent 0.46 s of
/// CPU against a grown buffer and 0.29 s with this one (0.36 s against
/// nbdkit), and read 1.24x faster. Between machines the kernel's sizing
/// stays: there the buffer must cover the path's delay.
const LOOPBACK_SNDBUF: usize = 256 << 10;

/// Why a connection ends.
enum End {
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

type Step<T> = Result<T, End>;

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
struct Socket {
    /// Open as long as the stream it belongs to.
    fd: RawFd,
}

/// Smallest write payload received straight into the store: below it the
/// copy from the connection's buffer costs next to nothing.
const LAND_MIN: usize = 64 << 10;
/// Reads of at least this many bytes are sent straight from stores that
/// hand out their memory ([`Store::read_direct`]); smaller ones are
/// gathered in the connection's buffer and leave together.
const DIRECT_READ_MIN: usize = 64 << 10;

impl Socket {
    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: `fd` stays open as long as the stream it belongs to,
        // which outlives the session holding this `Socket` (see
        // `NbdServer::run`).
        unsafe { BorrowedFd::borrow_raw(self.fd) }
    }

    /// Copy what waits on the socket into `look` without taking it or
    /// waiting: the number of bytes (0 if nothing waits or on an error).
    fn peek(&self, look: &mut [u8]) -> usize {
        let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
        rustix::net::recv(self.fd(), look, flags).map_or(0, |(n, _)| n)
    }

    /// Receive into `parts` what waits on the socket, without waiting:
    /// `None` if nothing waits, `Some(0)` at the end of the stream.
    fn recv_now(&self, parts: &mut [IoSliceMut<'_>]) -> io::Result<Option<usize>> {
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
    fn waiting(&self) -> usize {
        rustix::io::ioctl_fionread(self.fd()).map_or(0, |n| n as usize)
    }

    /// Wait until something waits on the socket (or it ends or fails).
    fn wait_readable(&self) {
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
    fn send_now(&self, parts: &[IoSlice<'_>]) -> io::Result<usize> {
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
fn serve_socket<S: Read + Write>(
    stream: S,
    store: &dyn Store,
    config: &ServerConfig,
    peer: String,
    socket: Option<Socket>,
    guard: Option<Guard<'_>>,
    buffer: Option<(Allocator, Buffer)>,
) -> ConnSummary {
    let started = Instant::now();
    let mut session = Session {
        stream,
        store,
        config,
        structured: false,
        meta: false,
        no_zeroes: false,
        buffer,
        summary: ConnSummary { peer, ..ConnSummary::default() },
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
    };
    let end = session.handshake().and_then(|()| {
        if guard.is_some_and(|g| !g.conns.enter_transmission(g.id)) {
            return Err(End::Hard("closed by the server".into()));
        }
        session.summary.transmission = true;
        let end = session.transmission();
        if end.is_err() {
            // The replies still queued: a client that has shut down its
            // side of the connection (or sent something the server cannot
            // serve) reads them before the end.
            let _ = session.flush_replies();
        }
        end
    });
    let mut summary = session.summary;
    summary.structured = session.structured;
    summary.end = match end {
        Ok(()) | Err(End::Soft(_)) if !summary.transmission => "left (NBD_OPT_ABORT)".into(),
        Ok(()) => "disconnected".into(),
        Err(End::Soft(how)) => format!("disconnected ({how})"),
        Err(End::Hard(why)) => format!("dropped: {why}"),
    };
    summary.elapsed = started.elapsed();
    summary
}

struct Session<'a, S> {
    stream: S,
    store: &'a dyn Store,
    config: &'a ServerConfig,
    structured: bool,
    /// `base:allocation` selected.
    meta: bool,
    no_zeroes: bool,
    /// The connection's pool (kept alive with its one buffer) and the
    /// buffer every payload goes through.
    buffer: Option<(Allocator, Buffer)>,
    summary: ConnSummary,
    socket: Option<Socket>,
    /// The next request's payload is in the store already.
    landed: bool,
    /// Request headers taken from the socket, not yet served.
    staged: std::collections::VecDeque<[u8; 28]>,
    /// Read replies not yet sent: (header, header length, data offset in
    /// the connection's buffer, data length).
    replies: Vec<([u8; 28], usize, usize, usize)>,
    /// Where the next queued read's data goes in the connection's buffer.
    cursor: usize,
    /// The next request's payload is in the connection's buffer already.
    payload_read: bool,
    /// Bytes written by the writes whose replies are queued.
    written: usize,
    /// Requests received ahead (headers and small write payloads), taken
    /// from the socket in one receive while small requests come: bytes
    /// `in_at..in_end` are still to be served.
    inbuf: Vec<u8>,
    in_at: usize,
    in_end: usize,
    /// The last request was not a write large enough to land in the
    /// store: the next ones are received ahead into `inbuf`.
    small: bool,
}

/// Bytes of requests received ahead in one receive at most.
const IN_BUF: usize = 64 << 10;

/// Read replies sent in one write at most.
const MAX_QUEUED_REPLIES: usize = 256;
/// Data of the read replies sent in one write at most: small reads are
/// gathered, large ones leave one by one from the start of the buffer
/// (which stays in the cache).
const MAX_QUEUED_BYTES: usize = 256 << 10;

/// Read a big-endian number from the front of `data`.
fn take<const N: usize>(data: &mut &[u8]) -> Option<[u8; N]> {
    let (head, rest) = data.split_first_chunk::<N>()?;
    *data = rest;
    Some(*head)
}

fn take_u16(data: &mut &[u8]) -> Option<u16> {
    take::<2>(data).map(u16::from_be_bytes)
}

fn take_u32(data: &mut &[u8]) -> Option<u32> {
    take::<4>(data).map(u32::from_be_bytes)
}

/// A string of `len` bytes (UTF-8, no NUL, at most 4096 bytes).
fn take_string(data: &mut &[u8], len: u32) -> Option<String> {
    let len = len as usize;
    if len > data.len() || len > MAX_STRING {
        return None;
    }
    let (s, rest) = data.split_at(len);
    *data = rest;
    let s = std::str::from_utf8(s).ok()?;
    (!s.contains('\0')).then(|| s.to_string())
}

/// The NBD error value for a store error.
fn nbd_errno(e: &io::Error) -> u32 {
    match e.raw_os_error() {
        Some(1) | Some(13) | Some(30) => EPERM,
        Some(12) => ENOMEM,
        Some(22) => EINVAL,
        Some(28) | Some(27) | Some(122) => ENOSPC,
        Some(75) => EOVERFLOW,
        _ => EIO,
    }
}

/// Fill all of `parts` (one `readv` in the common case); on an error,
/// also how many bytes arrived before it.
fn read_parts_counted<R: Read>(r: &mut R, parts: &mut [IoSliceMut<'_>]) -> Result<(), (usize, io::Error)> {
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
fn whole_sectors(offset: u64, arrived: usize) -> usize {
    let end = offset + arrived as u64;
    (end - end % SECTOR as u64).saturating_sub(offset) as usize
}

/// Write all of `parts` (one `writev` in the common case).
fn write_all_parts<W: Write>(w: &mut W, parts: &mut [IoSlice<'_>]) -> io::Result<()> {
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

impl<S: Read + Write> Session<'_, S> {
    fn transmission_flags(&self) -> u16 {
        let mut flags = TF_HAS_FLAGS
            | TF_SEND_FLUSH
            | TF_SEND_FUA
            | TF_SEND_TRIM
            | TF_SEND_WRITE_ZEROES
            | TF_CAN_MULTI_CONN
            | TF_SEND_CACHE;
        if self.structured {
            flags |= TF_SEND_DF;
        }
        if self.config.read_only {
            flags |= TF_READ_ONLY;
        }
        flags
    }

    // ----- handshake -----

    fn handshake(&mut self) -> Step<()> {
        let mut hello = [0u8; 18];
        hello[..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
        hello[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
        hello[16..].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        self.stream.write_all(&hello)?;
        let mut cf = [0u8; 4];
        self.stream.read_exact(&mut cf)?;
        let client_flags = u32::from_be_bytes(cf);
        if client_flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
            return Err(End::Hard(format!("sent unknown client flags {client_flags:#x}")));
        }
        self.no_zeroes = client_flags & CLIENT_NO_ZEROES != 0;
        loop {
            let mut head = [0u8; 16];
            self.stream.read_exact(&mut head)?;
            let magic = u64::from_be_bytes(head[..8].try_into().expect("8 bytes"));
            let option = u32::from_be_bytes(head[8..12].try_into().expect("4 bytes"));
            let len = u32::from_be_bytes(head[12..].try_into().expect("4 bytes"));
            if magic != IHAVEOPT {
                return Err(End::Hard("sent an option without the IHAVEOPT magic".into()));
            }
            if len > MAX_OPTION_DATA {
                return Err(End::Hard(format!("sent option {option} with {len} bytes of data")));
            }
            let mut data = vec![0u8; len as usize];
            self.stream.read_exact(&mut data)?;
            match option {
                OPT_EXPORT_NAME => {
                    let name = std::str::from_utf8(&data).unwrap_or("\u{fffd}");
                    if name != self.config.export_name {
                        return Err(End::Hard(format!("asked for export {name:?}, which does not exist")));
                    }
                    let mut reply = Vec::with_capacity(10 + 124);
                    reply.extend_from_slice(&self.store.size().to_be_bytes());
                    reply.extend_from_slice(&self.transmission_flags().to_be_bytes());
                    if !self.no_zeroes {
                        reply.resize(reply.len() + 124, 0);
                    }
                    self.stream.write_all(&reply)?;
                    return Ok(());
                }
                OPT_ABORT => {
                    if data.is_empty() {
                        // The client may have gone already: no matter.
                        let _ = self.opt_reply(option, REP_ACK, &[]);
                        return Err(End::Soft("NBD_OPT_ABORT"));
                    }
                    self.opt_error(option, REP_ERR_INVALID, "NBD_OPT_ABORT takes no data")?;
                }
                OPT_LIST => {
                    if !data.is_empty() {
                        self.opt_error(option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data")?;
                        continue;
                    }
                    let name = self.config.export_name.as_bytes();
                    let mut server = Vec::with_capacity(4 + name.len());
                    server.extend_from_slice(&(name.len() as u32).to_be_bytes());
                    server.extend_from_slice(name);
                    self.opt_reply(option, REP_SERVER, &server)?;
                    self.opt_reply(option, REP_ACK, &[])?;
                }
                OPT_INFO | OPT_GO => {
                    if self.info(option, &data)? && option == OPT_GO {
                        return Ok(());
                    }
                }
                OPT_STRUCTURED_REPLY => {
                    if !data.is_empty() {
                        self.opt_error(option, REP_ERR_INVALID, "NBD_OPT_STRUCTURED_REPLY takes no data")?;
                        continue;
                    }
                    self.structured = true;
                    self.opt_reply(option, REP_ACK, &[])?;
                }
                OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.meta_context(option, &data)?,
                _ => self.opt_error(option, REP_ERR_UNSUP, "option not supported by this server")?,
            }
        }
    }

    fn opt_reply(&mut self, option: u32, kind: u32, data: &[u8]) -> io::Result<()> {
        let mut head = [0u8; 20];
        head[..8].copy_from_slice(&REPLY_MAGIC.to_be_bytes());
        head[8..12].copy_from_slice(&option.to_be_bytes());
        head[12..16].copy_from_slice(&kind.to_be_bytes());
        head[16..].copy_from_slice(&(data.len() as u32).to_be_bytes());
        write_all_parts(&mut self.stream, &mut [IoSlice::new(&head), IoSlice::new(data)])
    }

    fn opt_error(&mut self, option: u32, kind: u32, message: &str) -> io::Result<()> {
        self.opt_reply(option, kind, message.as_bytes())
    }

    /// NBD_OPT_INFO and NBD_OPT_GO; true if the export was described (and
    /// for GO the transmission phase begins).
    fn info(&mut self, option: u32, data: &[u8]) -> Step<bool> {
        let mut d = data;
        let parsed = (|| {
            let name_len = take_u32(&mut d)?;
            let name = take_string(&mut d, name_len)?;
            let count = take_u16(&mut d)?;
            let mut wanted = Vec::new();
            for _ in 0..count {
                wanted.push(take_u16(&mut d)?);
            }
            d.is_empty().then_some((name, wanted))
        })();
        let Some((name, wanted)) = parsed else {
            self.opt_error(option, REP_ERR_INVALID, "malformed NBD_OPT_INFO/NBD_OPT_GO data")?;
            return Ok(false);
        };
        if name != self.config.export_name {
            self.opt_error(option, REP_ERR_UNKNOWN, "no such export")?;
            return Ok(false);
        }
        let mut export = INFO_EXPORT.to_be_bytes().to_vec();
        export.extend_from_slice(&self.store.size().to_be_bytes());
        export.extend_from_slice(&self.transmission_flags().to_be_bytes());
        self.opt_reply(option, REP_INFO, &export)?;
        // Block sizes go out whether asked for or not: any byte-aligned
        // request works, 4096 is best, payloads up to max_payload.
        let mut sizes = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [1u32, 4096, self.config.max_payload] {
            sizes.extend_from_slice(&v.to_be_bytes());
        }
        self.opt_reply(option, REP_INFO, &sizes)?;
        if wanted.contains(&INFO_NAME) {
            let mut r = INFO_NAME.to_be_bytes().to_vec();
            r.extend_from_slice(self.config.export_name.as_bytes());
            self.opt_reply(option, REP_INFO, &r)?;
        }
        if wanted.contains(&INFO_DESCRIPTION) {
            let mut r = INFO_DESCRIPTION.to_be_bytes().to_vec();
            let desc = self.config.description.as_bytes();
            r.extend_from_slice(&desc[..desc.len().min(MAX_STRING)]);
            self.opt_reply(option, REP_INFO, &r)?;
        }
        self.opt_reply(option, REP_ACK, &[])?;
        Ok(true)
    }

    /// NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT.
    fn meta_context(&mut self, option: u32, data: &[u8]) -> Step<()> {
        let list = option == OPT_LIST_META_CONTEXT;
        if !self.structured {
            self.opt_error(option, REP_ERR_INVALID, "negotiate structured replies first")?;
            return Ok(());
        }
        let mut d = data;
        let parsed = (|| {
            let name_len = take_u32(&mut d)?;
            let name = take_string(&mut d, name_len)?;
            let count = take_u32(&mut d)?;
            let mut queries = Vec::new();
            for _ in 0..count {
                let len = take_u32(&mut d)?;
                queries.push(take_string(&mut d, len)?);
            }
            d.is_empty().then_some((name, queries))
        })();
        let Some((name, queries)) = parsed else {
            self.opt_error(option, REP_ERR_INVALID, "malformed meta context data")?;
            return Ok(());
        };
        if queries.iter().any(|q| !q.contains(':')) {
            self.opt_error(option, REP_ERR_INVALID, "a query starts with a namespace, e.g. base:")?;
            return Ok(());
        }
        if name != self.config.export_name {
            self.opt_error(option, REP_ERR_UNKNOWN, "no such export")?;
            return Ok(());
        }
        let matches = if list {
            queries.is_empty() || queries.iter().any(|q| q == "base:" || q == BASE_ALLOCATION)
        } else {
            queries.iter().any(|q| q == BASE_ALLOCATION)
        };
        if !list {
            self.meta = matches;
        }
        if matches {
            let id = if list { 0u32 } else { BASE_ALLOCATION_ID };
            let mut r = id.to_be_bytes().to_vec();
            r.extend_from_slice(BASE_ALLOCATION.as_bytes());
            self.opt_reply(option, REP_META_CONTEXT, &r)?;
        }
        self.opt_reply(option, REP_ACK, &[])?;
        Ok(())
    }

    // ----- transmission -----

    /// The connection's buffer ([`connection_buffer`]): made before the
    /// connection was accepted when [`NbdServer::run`] serves it, else on
    /// first use.
    fn buffer(&mut self) -> Step<&mut Buffer> {
        if self.buffer.is_none() {
            self.buffer = Some(connection_buffer(self.config.max_payload).map_err(End::Hard)?);
        }
        Ok(&mut self.buffer.as_mut().expect("made just now").1)
    }

    fn transmission(&mut self) -> Step<()> {
        loop {
            let head = match self.next_header() {
                Ok(h) => h,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    return Err(End::Hard("closed the connection without NBD_CMD_DISC".into()))
                }
                Err(e) => return Err(e.into()),
            };
            let magic = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
            if magic != REQUEST_MAGIC {
                return Err(End::Hard(format!("sent a request with magic {magic:#x}")));
            }
            let flags = u16::from_be_bytes(head[4..6].try_into().expect("2 bytes"));
            let kind = u16::from_be_bytes(head[6..8].try_into().expect("2 bytes"));
            let handle = u64::from_be_bytes(head[8..16].try_into().expect("8 bytes"));
            let offset = u64::from_be_bytes(head[16..24].try_into().expect("8 bytes"));
            let len = u32::from_be_bytes(head[24..].try_into().expect("4 bytes"));
            let req = Request { flags, handle, offset, len };
            // After a write that lands in the store, the next header is
            // looked at before it is taken (another such write can land
            // too); after anything else, what waits is received ahead.
            self.small = !(kind == CMD_WRITE && len as usize >= LAND_MIN);
            if kind == CMD_WRITE && self.cursor > 0 {
                // A write's payload goes to the start of the connection's
                // buffer, where queued read replies have their data. (Every
                // other request sends the queued replies before its own.)
                self.flush_replies()?;
            }
            match kind {
                CMD_READ => self.read(req)?,
                CMD_WRITE => self.write(req)?,
                CMD_DISC => {
                    self.flush_replies()?;
                    return Err(End::Soft("NBD_CMD_DISC"));
                }
                CMD_FLUSH => self.simple_op(req, CMD_FLAG_FUA, |s| s.flush(), |c| c.flushes += 1)?,
                CMD_TRIM => {
                    let fua = flags & CMD_FLAG_FUA != 0;
                    self.range_op(
                        req,
                        CMD_FLAG_FUA,
                        true,
                        EINVAL,
                        |s| s.trim(offset, len as u64, fua),
                        |c| c.trims += 1,
                    )?
                }
                CMD_CACHE => {
                    self.range_op(req, CMD_FLAG_FUA, false, EINVAL, |s| s.cache(offset, len as u64), |c| c.caches += 1)?
                }
                CMD_WRITE_ZEROES => {
                    let fua = flags & CMD_FLAG_FUA != 0;
                    let may_trim = flags & CMD_FLAG_NO_HOLE == 0;
                    self.range_op(
                        req,
                        CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
                        true,
                        ENOSPC,
                        |s| s.write_zeroes(offset, len as u64, may_trim, fua),
                        |c| c.zeroes += 1,
                    )?
                }
                CMD_BLOCK_STATUS => self.block_status(req)?,
                _ => self.error(req.handle, EINVAL, &format!("unknown command {kind}"))?,
            }
        }
    }

    /// The next request header: a staged one, else the headers waiting
    /// on the socket — every one up to and including the first with a
    /// payload, so that a payload is still read straight into the
    /// connection's buffer — else (replies sent first) wait for one.
    fn next_header(&mut self) -> io::Result<[u8; 28]> {
        if let Some(h) = self.staged.pop_front() {
            return Ok(h);
        }
        if self.in_at < self.in_end || (self.small && self.socket.is_some()) {
            if let Some(head) = self.next_header_ahead()? {
                return Ok(head);
            }
        }
        let mut look = [0u8; 28 * 64];
        let mut seen = self.socket.as_ref().map_or(0, |s| s.peek(&mut look));
        if seen == 0 && self.socket.is_some() {
            // Nothing is waiting: the replies go, then wait until
            // something is, and look at it (a write seen whole can land in
            // the store). Nothing after the wait: the stream says why (end
            // of file, error).
            self.flush_replies()?;
            let socket = self.socket.as_ref().expect("checked above");
            socket.wait_readable();
            seen = socket.peek(&mut look);
        }
        let mut whole = 0;
        while whole + 28 <= seen {
            let h = &look[whole..whole + 28];
            whole += 28;
            if u32::from_be_bytes(h[..4].try_into().expect("4 bytes")) != REQUEST_MAGIC
                || u16::from_be_bytes(h[6..8].try_into().expect("2 bytes")) == CMD_WRITE
            {
                break;
            }
        }
        if whole == 28 && u16::from_be_bytes(look[6..8].try_into().expect("2 bytes")) == CMD_WRITE {
            // A write is next: its header and its payload (straight into
            // the connection's buffer) in one read.
            let len = u32::from_be_bytes(look[24..28].try_into().expect("4 bytes")) as usize;
            if u32::from_be_bytes(look[..4].try_into().expect("4 bytes")) == REQUEST_MAGIC
                && len > 0
                && len <= self.config.max_payload as usize
            {
                if self.cursor > 0 {
                    self.flush_replies()?;
                }
                let head: [u8; 28] = look[..28].try_into().expect("28 bytes");
                if let Some(head) = self.land_write(&head)? {
                    self.payload_read = true;
                    self.landed = true;
                    return Ok(head);
                }
                self.buffer().map_err(|e| match e {
                    End::Hard(why) => io::Error::other(why),
                    End::Soft(why) => io::Error::other(why),
                })?;
                // Its payload may still be on its way: the replies go first.
                self.flush_replies()?;
                let mut head = [0u8; 28];
                let (_, buf) = self.buffer.as_mut().expect("made just now");
                let mem = buf.as_mut_slice().map_err(|e| io::Error::other(e.to_string()))?;
                let read = read_parts_counted(
                    &mut self.stream,
                    &mut [IoSliceMut::new(&mut head), IoSliceMut::new(&mut mem[..len])],
                );
                if let Err((arrived, e)) = read {
                    if arrived > 28 {
                        self.apply_cut_write(&head, arrived - 28);
                    }
                    return Err(e);
                }
                self.payload_read = true;
                return Ok(head);
            }
        }
        if whole > 28 {
            self.stream.read_exact(&mut look[..whole])?;
            for h in look[..whole].chunks_exact(28) {
                self.staged.push_back(h.try_into().expect("28 bytes"));
            }
            return Ok(self.staged.pop_front().expect("staged"));
        }
        if whole == 0 {
            // Nothing more is waiting: the replies go before we wait.
            self.flush_replies()?;
        }
        let mut head = [0u8; 28];
        self.stream.read_exact(&mut head)?;
        Ok(head)
    }

    /// The next request header from the requests received ahead, after
    /// receiving what waits if none is left (without waiting: if nothing
    /// waits, the replies go first, then the server waits). A write's
    /// payload goes to the connection's buffer: what was received ahead is
    /// copied there, the rest is read straight into it. `None` if nothing
    /// is buffered and the socket has no request waiting right now and
    /// nothing was received (the caller's peek path then goes on: never
    /// with bytes buffered here).
    fn next_header_ahead(&mut self) -> io::Result<Option<[u8; 28]>> {
        if self.in_at == self.in_end {
            let Some(socket) = &self.socket else { return Ok(None) };
            if self.inbuf.is_empty() {
                self.inbuf = vec![0u8; IN_BUF];
            }
            self.in_at = 0;
            self.in_end = 0;
            let mut got = socket.recv_now(&mut [IoSliceMut::new(&mut self.inbuf)])?;
            if got.is_none() {
                // Nothing waits: the replies go, then wait for more.
                self.flush_replies()?;
                let socket = self.socket.as_ref().expect("checked above");
                socket.wait_readable();
                got = socket.recv_now(&mut [IoSliceMut::new(&mut self.inbuf)])?;
            }
            match got {
                Some(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Some(n) => self.in_end = n,
                // Woken without data (an error the stream will report).
                None => return Ok(None),
            }
        }
        // A header cut short: the rest of it is on its way (the replies
        // go before the server waits for it).
        if self.in_end - self.in_at < 28 {
            self.flush_replies()?;
            self.inbuf.copy_within(self.in_at..self.in_end, 0);
            self.in_end -= self.in_at;
            self.in_at = 0;
            while self.in_end < 28 {
                match self.stream.read(&mut self.inbuf[self.in_end..]) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => self.in_end += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        let head: [u8; 28] = self.inbuf[self.in_at..self.in_at + 28].try_into().expect("28 bytes");
        self.in_at += 28;
        let magic = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
        let kind = u16::from_be_bytes(head[6..8].try_into().expect("2 bytes"));
        let len = u32::from_be_bytes(head[24..28].try_into().expect("4 bytes")) as usize;
        if magic != REQUEST_MAGIC || kind != CMD_WRITE || len == 0 {
            return Ok(Some(head));
        }
        // The payload: what was received ahead, then the rest from the
        // stream. One larger than the connection's buffer is taken and
        // dropped here (the write is answered with an error).
        if self.cursor > 0 || self.in_end - self.in_at < len {
            // Read replies have their data where the payload goes; and a
            // payload not all received ahead may still be on its way: the
            // queued replies go before the server waits for it.
            self.flush_replies()?;
        }
        self.buffer().map_err(|e| match e {
            End::Hard(why) => io::Error::other(why),
            End::Soft(why) => io::Error::other(why),
        })?;
        let Session { stream, buffer, inbuf, in_at, in_end, .. } = self;
        let (_, buf) = buffer.as_mut().expect("made just now");
        let mem = buf.as_mut_slice().map_err(|e| io::Error::other(e.to_string()))?;
        let room = mem.len();
        let mut done = 0;
        let mut cut = None;
        while done < len {
            let at = done % room;
            let n = (len - done).min(room - at);
            let ahead = (*in_end - *in_at).min(n);
            mem[at..at + ahead].copy_from_slice(&inbuf[*in_at..*in_at + ahead]);
            *in_at += ahead;
            if let Err((arrived, e)) = read_parts_counted(stream, &mut [IoSliceMut::new(&mut mem[at + ahead..at + n])])
            {
                cut = Some((done + ahead + arrived, e));
                break;
            }
            done += n;
        }
        if let Some((arrived, e)) = cut {
            self.apply_cut_write(&head, arrived);
            return Err(e);
        }
        self.payload_read = true;
        Ok(Some(head))
    }

    /// Receive a write whose header `head` waits on the socket straight
    /// into the store, if the store hands out its memory and the request
    /// is valid: then the header read, else `None` and nothing read. The
    /// payload is taken as it arrives, with receives that do not wait
    /// (header and payload in one when they wait together), each of the
    /// bytes that wait: the store's memory is made ready for those only,
    /// so a payload announced and not sent costs nothing. Between them
    /// the server waits for more with the store let go, so a client that
    /// sends slowly holds no part of it. The store gets whole sectors of
    /// the export (see [`SECTOR`]): bytes that do not yet complete one
    /// wait here, and are dropped if the client goes away. (A concurrent
    /// read of the range may see part of the new sectors, as NBD allows
    /// for overlapping requests in flight.)
    fn land_write(&mut self, head: &[u8; 28]) -> io::Result<Option<[u8; 28]>> {
        if self.socket.is_none() {
            return Ok(None);
        }
        let flags = u16::from_be_bytes(head[4..6].try_into().expect("2 bytes"));
        let offset = u64::from_be_bytes(head[16..24].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(head[24..].try_into().expect("4 bytes")) as usize;
        if flags & !CMD_FLAG_FUA != 0
            || self.config.read_only
            || len < LAND_MIN
            || len > self.config.max_payload as usize
            || !self.in_bounds(offset, len as u32)
        {
            return Ok(None);
        }
        let store = self.store;
        // An empty range tells whether the store takes direct writes.
        if store.write_direct(offset, 0, &mut |_| Ok(())).is_none() {
            return Ok(None);
        }
        let mut got = [0u8; 28];
        let mut head_have = 0;
        // Payload bytes in the store, and bytes taken after them that do
        // not complete a sector yet.
        let mut applied = 0;
        let mut carry = [0u8; SECTOR];
        let mut carried = 0;
        while head_have < 28 || applied < len {
            let mut waiting = self.socket.as_ref().expect("checked above").waiting();
            if waiting == 0 {
                // The replies go before the server waits for more.
                self.flush_replies()?;
                let socket = self.socket.as_ref().expect("checked above");
                socket.wait_readable();
                waiting = socket.waiting();
            }
            let socket = self.socket.as_ref().expect("checked above");
            let head_want = 28 - head_have;
            let taken = applied + carried;
            let coming = waiting.saturating_sub(head_want).min(len - taken);
            let reach = taken + coming;
            let upto = if reach == len { len } else { whole_sectors(offset, reach) };
            if upto > applied {
                // Whole sectors: straight into the store's memory, the
                // carried bytes first, then what waits on the socket.
                let want = head_want + (upto - taken);
                let mut arrived = 0;
                let landed = store.write_direct(offset + applied as u64, upto - applied, &mut |parts| {
                    let mut all: Vec<IoSliceMut<'_>> = Vec::with_capacity(parts.len() + 1);
                    all.push(IoSliceMut::new(&mut got[head_have..]));
                    let mut skip = carried;
                    for p in parts.iter_mut() {
                        let n = skip.min(p.len());
                        p[..n].copy_from_slice(&carry[carried - skip..carried - skip + n]);
                        skip -= n;
                        all.push(IoSliceMut::new(&mut p[n..]));
                    }
                    // The kernel hands over every byte it counts as
                    // waiting; a second receive only if the first stops
                    // short all the same.
                    let mut rest = &mut all[..];
                    while arrived < want {
                        match socket.recv_now(rest)? {
                            Some(0) | None => break,
                            Some(n) => {
                                arrived += n;
                                IoSliceMut::advance_slices(&mut rest, n);
                            }
                        }
                    }
                    Ok(())
                });
                match landed {
                    Some(r) => r?,
                    None => return Err(io::Error::other("the store no longer takes the write's payload")),
                }
                let from_head = arrived.min(head_want);
                head_have += from_head;
                let now = taken + arrived - from_head;
                self.summary.landed_bytes += (now - taken) as u64;
                if now == upto {
                    applied = upto;
                    carried = 0;
                } else {
                    // Short of what waited: the bytes past the last whole
                    // sector are carried (and the sector completed with
                    // them) like any others.
                    let whole = whole_sectors(offset, now).max(applied);
                    carried = now - whole;
                    applied = whole;
                    store.read_at(offset + applied as u64, &mut carry[..carried])?;
                    if arrived == 0 {
                        return Err(io::Error::other("the socket counts bytes that cannot be received"));
                    }
                }
            } else {
                // Fewer bytes than complete a sector (or none: the end of
                // the stream or an error, which a receive tells): they
                // wait here.
                let to_boundary = SECTOR - ((offset + taken as u64) % SECTOR as u64) as usize;
                let room = if coming > 0 { coming } else { to_boundary.min(len - taken) };
                let mut parts =
                    [IoSliceMut::new(&mut got[head_have..]), IoSliceMut::new(&mut carry[carried..carried + room])];
                match socket.recv_now(&mut parts)? {
                    Some(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Some(n) => {
                        let from_head = n.min(head_want);
                        head_have += from_head;
                        carried += n - from_head;
                    }
                    None if waiting > 0 => {
                        return Err(io::Error::other("the socket counts bytes that cannot be received"))
                    }
                    // Woken without data: wait again.
                    None => {}
                }
                if carried > 0 && (applied + carried == len || whole_sectors(offset, applied + carried) > applied) {
                    store.write_at(offset + applied as u64, &carry[..carried], false)?;
                    applied += carried;
                    carried = 0;
                }
            }
        }
        Ok(Some(got))
    }

    /// Send a read reply (header `head`, then the store's bytes of the
    /// range) straight from the store's memory, as far as the socket takes
    /// it at once; the rest is copied into the connection's buffer and
    /// sent from there once the store is let go. False if the store cannot
    /// hand out its memory (nothing sent).
    fn send_direct(&mut self, head: &[u8], offset: u64, len: usize) -> Step<bool> {
        if self.socket.is_none() {
            return Ok(false);
        }
        self.flush_replies()?;
        self.buffer()?;
        let Session { socket, buffer, store, .. } = self;
        let socket = socket.as_ref().expect("checked above");
        let (_, buf) = buffer.as_mut().expect("made above");
        let mem = buf.as_mut_slice().map_err(|e| End::Hard(format!("connection buffer not writable ({e})")))?;
        // Of the reply, the bytes sent at once.
        let mut sent = 0;
        let done = store.read_direct(offset, len, &mut |parts| {
            let mut all: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len() + 1);
            all.push(IoSlice::new(head));
            all.extend_from_slice(parts);
            sent = socket.send_now(&all)?;
            // What did not go: into the connection's buffer.
            let mut skip = sent.saturating_sub(head.len());
            let mut at = 0;
            for p in parts {
                let from = skip.min(p.len());
                skip -= from;
                let n = p.len() - from;
                mem[at..at + n].copy_from_slice(&p[from..]);
                at += n;
            }
            Ok(())
        });
        match done {
            None => return Ok(false),
            Some(r) => r?,
        }
        let data_sent = sent.saturating_sub(head.len());
        self.summary.sent_direct_bytes += data_sent as u64;
        if sent < head.len() + len {
            let head_rest = &head[sent.min(head.len())..];
            let (_, buf) = self.buffer.as_ref().expect("made above");
            write_all_parts(&mut self.stream, &mut [IoSlice::new(head_rest), IoSlice::new(&buf[..len - data_sent])])?;
        }
        Ok(true)
    }

    /// Send the queued read replies, in one write.
    fn flush_replies(&mut self) -> io::Result<()> {
        if self.replies.is_empty() {
            return Ok(());
        }
        let replies = std::mem::take(&mut self.replies);
        self.cursor = 0;
        self.written = 0;
        let buf: &[u8] = self.buffer.as_ref().map_or(&[], |(_, b)| &b[..]);
        let mut parts: Vec<IoSlice<'_>> = Vec::with_capacity(replies.len() * 2);
        for (head, hlen, at, n) in &replies {
            parts.push(IoSlice::new(&head[..*hlen]));
            if *n > 0 {
                parts.push(IoSlice::new(&buf[*at..*at + *n]));
            }
        }
        write_all_parts(&mut self.stream, &mut parts)
    }

    /// A write whose header is `head` was cut off after `arrived` bytes of
    /// its payload, which are at the start of the connection's buffer:
    /// apply its whole sectors (see [`SECTOR`]) if the write is one the
    /// server would have carried out.
    fn apply_cut_write(&mut self, head: &[u8; 28], arrived: usize) {
        let flags = u16::from_be_bytes(head[4..6].try_into().expect("2 bytes"));
        let offset = u64::from_be_bytes(head[16..24].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(head[24..].try_into().expect("4 bytes"));
        if flags & !CMD_FLAG_FUA != 0
            || self.config.read_only
            || len > self.config.max_payload
            || arrived >= len as usize
            || !self.in_bounds(offset, len)
        {
            return;
        }
        let keep = whole_sectors(offset, arrived);
        if let (Some((_, buf)), true) = (&self.buffer, keep > 0) {
            // The client is gone: nobody to tell if the store fails.
            let _ = self.store.write_at(offset, &buf[..keep], false);
        }
    }

    fn in_bounds(&self, offset: u64, len: u32) -> bool {
        offset.checked_add(len as u64).is_some_and(|end| end <= self.store.size())
    }

    /// Answer a request with an error (structured if negotiated).
    fn error(&mut self, handle: u64, errno: u32, message: &str) -> io::Result<()> {
        self.summary.errors += 1;
        if self.structured {
            let msg = &message.as_bytes()[..message.len().min(4096)];
            let mut payload = Vec::with_capacity(6 + msg.len());
            payload.extend_from_slice(&errno.to_be_bytes());
            payload.extend_from_slice(&(msg.len() as u16).to_be_bytes());
            payload.extend_from_slice(msg);
            self.chunk(handle, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, &[&payload])
        } else {
            self.simple(handle, errno, &[])
        }
    }

    /// A simple reply, with `data` after the header.
    fn simple(&mut self, handle: u64, errno: u32, data: &[&[u8]]) -> io::Result<()> {
        self.flush_replies()?;
        let mut head = [0u8; 16];
        head[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        head[4..8].copy_from_slice(&errno.to_be_bytes());
        head[8..].copy_from_slice(&handle.to_be_bytes());
        let mut parts: Vec<IoSlice<'_>> =
            std::iter::once(IoSlice::new(&head)).chain(data.iter().map(|d| IoSlice::new(d))).collect();
        write_all_parts(&mut self.stream, &mut parts)
    }

    /// One structured reply chunk whose payload is `payload` (in parts).
    fn chunk(&mut self, handle: u64, flags: u16, kind: u16, payload: &[&[u8]]) -> io::Result<()> {
        self.flush_replies()?;
        let len: usize = payload.iter().map(|p| p.len()).sum();
        let mut head = [0u8; 20];
        head[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        head[4..6].copy_from_slice(&flags.to_be_bytes());
        head[6..8].copy_from_slice(&kind.to_be_bytes());
        head[8..16].copy_from_slice(&handle.to_be_bytes());
        head[16..].copy_from_slice(&(len as u32).to_be_bytes());
        let mut parts: Vec<IoSlice<'_>> =
            std::iter::once(IoSlice::new(&head)).chain(payload.iter().map(|d| IoSlice::new(d))).collect();
        write_all_parts(&mut self.stream, &mut parts)
    }

    /// Success without data, for any request but a read: a simple reply
    /// even where structured replies were negotiated (the protocol allows
    /// it for replies without data), so the client takes 16 bytes instead
    /// of a 20-byte chunk header it reads in two parts. It is queued with
    /// the replies of reads and writes (the request is done: a flush's
    /// data is on stable storage) and leaves with them.
    fn done(&mut self, handle: u64) -> io::Result<()> {
        self.queue_done(handle);
        if self.replies.len() >= MAX_QUEUED_REPLIES {
            self.flush_replies()?;
        }
        Ok(())
    }

    /// Queue the simple reply of a success without data.
    fn queue_done(&mut self, handle: u64) {
        let mut head = [0u8; 28];
        head[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        head[8..16].copy_from_slice(&handle.to_be_bytes());
        self.replies.push((head, 16, 0, 0));
    }

    fn read(&mut self, req: Request) -> Step<()> {
        let allowed = if self.structured { CMD_FLAG_FUA | CMD_FLAG_DF } else { CMD_FLAG_FUA };
        if req.flags & !allowed != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for NBD_CMD_READ")?);
        }
        if req.len > self.config.max_payload {
            return Ok(self.error(req.handle, EINVAL, "read larger than the maximum block size")?);
        }
        if !self.in_bounds(req.offset, req.len) {
            return Ok(self.error(req.handle, EINVAL, "read past the end of the export")?);
        }
        if req.len == 0 {
            self.summary.reads += 1;
            // A read is never answered with a simple reply once structured
            // replies were negotiated.
            if self.structured {
                return Ok(self.chunk(req.handle, REPLY_FLAG_DONE, REPLY_TYPE_NONE, &[])?);
            }
            return Ok(self.simple(req.handle, 0, &[])?);
        }
        let len = req.len as usize;
        let store = self.store;
        if self.structured && req.flags & CMD_FLAG_DF == 0 && req.len >= SPARSE_READ_MIN {
            if let Ok(extents) = store.extents(req.offset, req.len as u64, 64) {
                let covered: u64 = extents.iter().map(|e| e.len).sum();
                if covered == req.len as u64 && extents.iter().any(|e| e.zero) {
                    self.flush_replies()?;
                    return self.read_sparse(req, &extents);
                }
            }
        }
        if len >= DIRECT_READ_MIN && self.socket.is_some() {
            let (head, hlen) = self.read_reply_head(req, len);
            if self.send_direct(&head[..hlen], req.offset, len)? {
                self.summary.reads += 1;
                self.summary.read_bytes += len as u64;
                return Ok(());
            }
        }
        // The data goes after the data of the replies queued before it (if
        // it fits; else those leave first).
        if self.cursor + len > (self.config.max_payload as usize).min(MAX_QUEUED_BYTES.max(len)) {
            self.flush_replies()?;
        }
        let at = self.cursor;
        let buf = self.buffer()?;
        let filled = match buf.as_mut_slice() {
            Ok(mem) => store.read_at(req.offset, &mut mem[at..at + len]),
            Err(e) => Err(io::Error::other(e.to_string())),
        };
        if let Err(e) = filled {
            return Ok(self.error(req.handle, nbd_errno(&e), &format!("read failed: {e}"))?);
        }
        self.summary.reads += 1;
        self.summary.read_bytes += len as u64;
        let (head, hlen) = self.read_reply_head(req, len);
        self.replies.push((head, hlen, at, len));
        self.cursor = at + len;
        // Sent with the replies that follow, once no request waits (or the
        // queue is full).
        if self.replies.len() >= MAX_QUEUED_REPLIES || self.cursor >= MAX_QUEUED_BYTES {
            self.flush_replies()?;
        }
        Ok(())
    }

    /// The header of a successful read's reply (`len` bytes of data) and
    /// its length.
    fn read_reply_head(&self, req: Request, len: usize) -> ([u8; 28], usize) {
        let mut head = [0u8; 28];
        let hlen = if self.structured {
            head[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
            head[4..6].copy_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
            head[6..8].copy_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
            head[8..16].copy_from_slice(&req.handle.to_be_bytes());
            head[16..20].copy_from_slice(&(8 + len as u32).to_be_bytes());
            head[20..28].copy_from_slice(&req.offset.to_be_bytes());
            28
        } else {
            head[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            head[8..16].copy_from_slice(&req.handle.to_be_bytes());
            16
        };
        (head, hlen)
    }

    /// A structured read of a range with zero extents: an
    /// `NBD_REPLY_TYPE_OFFSET_HOLE` chunk for each, an `OFFSET_DATA` chunk
    /// (from the connection's buffer) for the rest, then a final `NONE`.
    fn read_sparse(&mut self, req: Request, extents: &[Extent]) -> Step<()> {
        let store = self.store;
        let mut at = req.offset;
        for x in extents {
            if x.zero {
                let mut payload = [0u8; 12];
                payload[..8].copy_from_slice(&at.to_be_bytes());
                payload[8..].copy_from_slice(&(x.len as u32).to_be_bytes());
                self.chunk(req.handle, 0, REPLY_TYPE_OFFSET_HOLE, &[&payload])?;
            } else {
                let n = x.len as usize;
                let buf = self.buffer()?;
                let filled = match buf.as_mut_slice() {
                    Ok(mem) => store.read_at(at, &mut mem[..n]),
                    Err(e) => Err(io::Error::other(e.to_string())),
                };
                if let Err(e) = filled {
                    return Ok(self.error(req.handle, nbd_errno(&e), &format!("read failed: {e}"))?);
                }
                let offset = at.to_be_bytes();
                let mut head = [0u8; 20];
                head[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
                head[6..8].copy_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
                head[8..16].copy_from_slice(&req.handle.to_be_bytes());
                head[16..].copy_from_slice(&(8 + n as u32).to_be_bytes());
                let (_, buf) = self.buffer.as_ref().expect("made above");
                write_all_parts(
                    &mut self.stream,
                    &mut [IoSlice::new(&head), IoSlice::new(&offset), IoSlice::new(&buf[..n])],
                )?;
            }
            at += x.len;
        }
        self.summary.reads += 1;
        self.summary.read_bytes += req.len as u64;
        Ok(self.chunk(req.handle, REPLY_FLAG_DONE, REPLY_TYPE_NONE, &[])?)
    }

    fn write(&mut self, req: Request) -> Step<()> {
        let len = req.len as usize;
        let max = self.config.max_payload as usize;
        // The payload is read in any case: what follows it is the next request.
        self.buffer()?;
        let payload_read = std::mem::take(&mut self.payload_read);
        if !payload_read {
            // It may still be on its way: the queued replies go first.
            self.flush_replies()?;
        }
        let landed = std::mem::take(&mut self.landed);
        let Session { stream, buffer, .. } = self;
        let (_, buf) = buffer.as_mut().expect("made just now");
        let mem = buf.as_mut_slice().map_err(|e| End::Hard(format!("connection buffer not writable ({e})")))?;
        if len > max {
            let mut left = if payload_read { 0 } else { len };
            while left > 0 {
                let n = left.min(max);
                stream.read_exact(&mut mem[..n])?;
                left -= n;
            }
            return Ok(self.error(req.handle, EINVAL, "write larger than the maximum block size")?);
        }
        if !payload_read {
            if let Err((arrived, e)) = read_parts_counted(stream, &mut [IoSliceMut::new(&mut mem[..len])]) {
                let mut head = [0u8; 28];
                head[4..6].copy_from_slice(&req.flags.to_be_bytes());
                head[16..24].copy_from_slice(&req.offset.to_be_bytes());
                head[24..].copy_from_slice(&req.len.to_be_bytes());
                self.apply_cut_write(&head, arrived);
                return Err(e.into());
            }
        }
        if req.flags & !CMD_FLAG_FUA != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for NBD_CMD_WRITE")?);
        }
        if self.config.read_only {
            return Ok(self.error(req.handle, EPERM, "the export is read-only")?);
        }
        if !self.in_bounds(req.offset, req.len) {
            return Ok(self.error(req.handle, ENOSPC, "write past the end of the export")?);
        }
        let fua = req.flags & CMD_FLAG_FUA != 0;
        let (_, buf) = self.buffer.as_ref().expect("made above");
        let stored = if landed {
            // The payload is in the store already.
            if fua {
                self.store.flush()
            } else {
                Ok(())
            }
        } else {
            self.store.write_at(req.offset, &buf[..len], fua)
        };
        if let Err(e) = stored {
            return Ok(self.error(req.handle, nbd_errno(&e), &format!("write failed: {e}"))?);
        }
        self.summary.writes += 1;
        self.summary.write_bytes += len as u64;
        // The reply waits for the replies that follow, like a read's; a
        // simple one, as for every success without data (see `done`).
        self.queue_done(req.handle);
        // Large writes are answered at once, so the client can send the
        // next while this one's reply would otherwise wait.
        self.written += len;
        if self.replies.len() >= MAX_QUEUED_REPLIES || self.written >= MAX_QUEUED_BYTES {
            self.flush_replies()?;
        }
        Ok(())
    }

    /// A request without a range (FLUSH).
    fn simple_op(
        &mut self,
        req: Request,
        allowed: u16,
        op: impl FnOnce(&dyn Store) -> io::Result<()>,
        count: impl FnOnce(&mut ConnSummary),
    ) -> Step<()> {
        if req.flags & !allowed != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for this command")?);
        }
        if let Err(e) = op(self.store) {
            return Ok(self.error(req.handle, nbd_errno(&e), &format!("failed: {e}"))?);
        }
        count(&mut self.summary);
        Ok(self.done(req.handle)?)
    }

    /// A request on a range without payload (TRIM, CACHE, WRITE_ZEROES):
    /// flags checked, then the range (`past_end` if it leaves the export),
    /// then `op`.
    #[allow(clippy::too_many_arguments)]
    fn range_op(
        &mut self,
        req: Request,
        allowed: u16,
        writes: bool,
        past_end: u32,
        op: impl FnOnce(&dyn Store) -> io::Result<()>,
        count: impl FnOnce(&mut ConnSummary),
    ) -> Step<()> {
        if req.flags & !allowed != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for this command")?);
        }
        if writes && self.config.read_only {
            return Ok(self.error(req.handle, EPERM, "the export is read-only")?);
        }
        if !self.in_bounds(req.offset, req.len) {
            return Ok(self.error(req.handle, past_end, "request past the end of the export")?);
        }
        if let Err(e) = op(self.store) {
            return Ok(self.error(req.handle, nbd_errno(&e), &format!("failed: {e}"))?);
        }
        count(&mut self.summary);
        Ok(self.done(req.handle)?)
    }

    fn block_status(&mut self, req: Request) -> Step<()> {
        if req.flags & !(CMD_FLAG_REQ_ONE | CMD_FLAG_FUA) != 0 {
            return Ok(self.error(req.handle, EINVAL, "flag not valid for NBD_CMD_BLOCK_STATUS")?);
        }
        if !self.structured || !self.meta {
            return Ok(self.error(req.handle, EINVAL, "no metadata context was selected")?);
        }
        if req.len == 0 || !self.in_bounds(req.offset, req.len) {
            return Ok(self.error(req.handle, EINVAL, "block status past the end of the export or empty")?);
        }
        let max = if req.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_EXTENTS };
        let extents = match self.store.extents(req.offset, req.len as u64, max) {
            Ok(x) if !x.is_empty() => x,
            // Status 0 ("allocated, contents unknown") is always true.
            Ok(_) => vec![Extent { len: req.len as u64, hole: false, zero: false }],
            Err(e) => return Ok(self.error(req.handle, nbd_errno(&e), &format!("block status failed: {e}"))?),
        };
        let mut payload = Vec::with_capacity(4 + 8 * extents.len());
        payload.extend_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
        let mut total = 0u64;
        for x in extents.iter().take(max) {
            let len = x.len.min(req.len as u64 - total);
            if len == 0 {
                break;
            }
            total += len;
            let state = if x.hole { STATE_HOLE } else { 0 } | if x.zero { STATE_ZERO } else { 0 };
            payload.extend_from_slice(&(len as u32).to_be_bytes());
            payload.extend_from_slice(&state.to_be_bytes());
        }
        self.summary.block_status += 1;
        Ok(self.chunk(req.handle, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, &[&payload])?)
    }
}

#[derive(Clone, Copy)]
struct Request {
    flags: u16,
    handle: u64,
    offset: u64,
    len: u32,
}
