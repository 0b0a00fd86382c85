//! A small fault-injecting TCP proxy for integration tests (std only, plain threads).
//!
//! [`FaultProxy`] listens on a local address and forwards every accepted connection to an upstream
//! address. The test points its client at [`FaultProxy::addr`] and, at any time, injects a [`Fault`] with
//! [`FaultProxy::set`]: the fault applies to every current and future connection and takes effect within
//! about [`POLL`] (10 ms), because every forwarding thread wakes up at least that often to look at it.
//!
//! Each connection has two forwarding threads, one per direction ("towards server" reads the client
//! socket and writes the upstream socket; "towards client" the reverse). Byte offsets ("absolute stream
//! offset") count the bytes the proxy has forwarded in one direction of one connection, from 0.
//! A clean end of stream (FIN) from one side is passed on as a FIN to the other side (half-close);
//! a reset or an I/O error on either side resets both sides.
//!
//! Linux (and other Unix) only: [`Fault::Reset`] needs `SO_LINGER`, set through `setsockopt`.
#![allow(dead_code)]

use std::ffi::{c_int, c_void};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How often every proxy thread wakes up (read/write timeouts, accept polling, sleeps) to notice a new
/// fault or the proxy being dropped.
pub const POLL: Duration = Duration::from_millis(10);

/// Largest chunk read from one socket and forwarded as a unit.
const CHUNK: usize = 64 * 1024;

/// Time allowed for connecting to the upstream server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long `Drop` waits for the forwarding threads before detaching the stragglers.
const DROP_WAIT: Duration = Duration::from_millis(100);

/// A fault injected into all current and future connections of a [`FaultProxy`].
///
/// "Towards server" is the client → upstream direction, "towards client" the upstream → client one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    /// Plain forwarding in both directions. Data held back by an earlier fault (`Blackhole`, `StopReading`)
    /// flows again, nothing is lost.
    #[default]
    None,
    /// Stop forwarding both ways silently and keep all sockets open: a silent peer or a network partition.
    /// The proxy stops reading, so unforwarded data stays queued in the sockets (the senders eventually
    /// block) and flows again, in order, once the fault is lifted. A chunk whose write had already begun
    /// is finished first. New connections are accepted and connected upstream but forward nothing.
    Blackhole,
    /// Reset both sides of every connection now (`SO_LINGER` 0, then close: the peers get RST, so their
    /// reads and writes fail with `ConnectionReset` or `BrokenPipe`). While this fault stays set, new
    /// connections are reset as soon as they are accepted, without connecting upstream.
    Reset,
    /// Stop reading from one side, so that its sender fills the socket buffers and then blocks
    /// (back-pressure). `towards_server: true` stops reading from the client; `false` stops reading from
    /// the upstream server. The other direction keeps forwarding.
    StopReading {
        /// `true`: the client → server direction stalls; `false`: the server → client direction stalls.
        towards_server: bool,
    },
    /// Forward one direction only, one chunk (up to 64 KiB) per `delay` at most, and read nothing from the
    /// other side (as `StopReading`): a slow reader whose peer's answers are held back, so that the sender
    /// of the trickling direction has nothing but its socket draining to wake it.
    Trickle {
        /// `true`: client → server trickles and server → client stalls; `false`: the reverse.
        towards_server: bool,
        /// How long each chunk is held after it was read.
        delay: Duration,
    },
    /// Hold each forwarded chunk (in both directions) until this long after the proxy read it. A
    /// direction forwards one chunk at a time, so this also limits throughput to about one chunk (up to
    /// 64 KiB) per delay.
    Delay(Duration),
    /// XOR the byte at absolute stream offset `offset` of one direction with `xor` as it is forwarded.
    /// Affects only that one byte of each connection, and only if it has not been forwarded yet.
    CorruptAt {
        /// The direction to corrupt: `true` for client → server, `false` for server → client.
        towards_server: bool,
        /// Absolute offset of the byte in that direction's stream of each connection.
        offset: u64,
        /// Bits to flip in that byte.
        xor: u8,
    },
    /// Forward exactly `bytes` bytes of one direction (counting from the start of each connection), then
    /// close both sides cleanly: FIN to the client and to the server, anything read afterwards is
    /// discarded. A connection that has already forwarded `bytes` or more in that direction is closed at
    /// once.
    TruncateAfter {
        /// The direction that is cut: `true` for client → server, `false` for server → client.
        towards_server: bool,
        /// How many bytes of that direction are forwarded before the close.
        bytes: u64,
    },
}

/// A fault-injecting TCP proxy for tests; see the [module documentation](self).
///
/// Dropping it stops the accept thread and every forwarding thread and closes all sockets (the clients
/// see end of stream, or a reset if they had sent data the proxy had not read yet). `Drop` waits at most
/// about 100 ms for the threads and detaches any still running; they exit on their own shortly after.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept_thread: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:0` (an ephemeral port) and forwards each accepted connection to `upstream`.
    ///
    /// # Errors
    /// When the listener cannot be bound or the accept thread cannot be spawned. An unreachable `upstream`
    /// is not an error here: each client is then reset right after it is accepted.
    pub fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        FaultProxy::start_on(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), upstream)
    }

    /// Listens on `bind` (for instance `[::1]:0` for IPv6 tests) and forwards each accepted connection to
    /// `upstream`.
    ///
    /// # Errors
    /// As for [`FaultProxy::start`].
    pub fn start_on(bind: SocketAddr, upstream: SocketAddr) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind(bind)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            fault: Mutex::new(Fault::None),
            stop: AtomicBool::new(false),
            forwarded: [AtomicU64::new(0), AtomicU64::new(0)],
            accepted: AtomicUsize::new(0),
            conns: Mutex::new(Vec::new()),
            threads: Mutex::new(0),
            threads_done: Condvar::new(),
        });
        let accept_shared = Arc::clone(&shared);
        let accept_thread = thread::Builder::new()
            .name("fault-proxy-accept".into())
            .spawn(move || accept_loop(&accept_shared, &listener))?;
        Ok(FaultProxy { addr, shared, accept_thread: Some(accept_thread) })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The upstream address connections are forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Injects `fault` into all current and future connections, replacing the previous fault. Forwarding
    /// threads notice within about [`POLL`]; [`Fault::Reset`] is applied to the current connections
    /// before this returns (the RST goes out when their threads close the sockets, within about `POLL`).
    pub fn set(&self, fault: Fault) {
        *lock(&self.shared.fault) = fault;
        if fault == Fault::Reset {
            for conn in self.shared.live_conns() {
                conn.reset();
            }
        }
    }

    /// The fault currently in force.
    pub fn fault(&self) -> Fault {
        self.shared.fault()
    }

    /// Bytes forwarded so far over all connections: (client → server, server → client). A chunk is
    /// counted just after its write returns, so a peer may already have read bytes not yet counted.
    pub fn bytes_forwarded(&self) -> (u64, u64) {
        (
            self.shared.forwarded[Dir::ToServer as usize].load(Ordering::Relaxed),
            self.shared.forwarded[Dir::ToClient as usize].load(Ordering::Relaxed),
        )
    }

    /// How many client connections the proxy has accepted since it started (including closed ones). The
    /// accept thread polls every [`POLL`], so a connection is counted up to about that long after the
    /// client's `connect` returned.
    pub fn connections(&self) -> usize {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// How many connections are currently being forwarded: connected upstream and not yet fully closed
    /// (both directions ended, or reset, and their threads gone).
    pub fn active_connections(&self) -> usize {
        self.shared.live_conns().len()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        let deadline = Instant::now() + DROP_WAIT;
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(accept_thread) = self.accept_thread.take() {
            // The accept loop polls every POLL, so this returns promptly.
            let _ = accept_thread.join();
        }
        // Forwarding threads notice `stop` within POLL and drop their sockets. A thread still connecting
        // upstream may take up to CONNECT_TIMEOUT: after the deadline it is detached.
        let mut threads = lock(&self.shared.threads);
        while *threads > 0 {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            threads = self
                .shared
                .threads_done
                .wait_timeout(threads, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// State shared by the proxy handle, the accept thread and the forwarding threads.
struct Shared {
    upstream: SocketAddr,
    fault: Mutex<Fault>,
    stop: AtomicBool,
    /// Bytes forwarded, indexed by `Dir`.
    forwarded: [AtomicU64; 2],
    accepted: AtomicUsize,
    /// Connections being forwarded; weak so that the last forwarding thread closes the sockets.
    conns: Mutex<Vec<Weak<Conn>>>,
    /// Number of running connection threads, with a condvar signalled whenever one ends.
    threads: Mutex<usize>,
    threads_done: Condvar,
}

impl Shared {
    fn fault(&self) -> Fault {
        *lock(&self.fault)
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn live_conns(&self) -> Vec<Arc<Conn>> {
        lock(&self.conns).iter().filter_map(Weak::upgrade).collect()
    }
}

/// Counts a running connection thread in `Shared::threads` for as long as it lives.
struct ThreadGuard(Arc<Shared>);

impl ThreadGuard {
    fn new(shared: &Arc<Shared>) -> ThreadGuard {
        *lock(&shared.threads) += 1;
        ThreadGuard(Arc::clone(shared))
    }
}

impl Drop for ThreadGuard {
    fn drop(&mut self) {
        *lock(&self.0.threads) -= 1;
        self.0.threads_done.notify_all();
    }
}

/// One forwarding direction; the value indexes `Shared::forwarded`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dir {
    ToServer = 0,
    ToClient = 1,
}

impl Dir {
    fn towards_server(self) -> bool {
        self == Dir::ToServer
    }
}

const OPEN: u8 = 0;
const CLOSING: u8 = 1;
const RESET: u8 = 2;

/// A proxied connection: both sockets, shared by its two forwarding threads. The sockets close when the
/// last thread drops its `Arc`.
struct Conn {
    client: TcpStream,
    server: TcpStream,
    /// `OPEN`, `CLOSING` (FIN sent to both sides after a truncation; draining) or `RESET`.
    state: AtomicU8,
}

impl Conn {
    fn state(&self) -> u8 {
        self.state.load(Ordering::SeqCst)
    }

    /// Arranges for both sockets to send RST when they are closed (by the forwarding threads, which see
    /// the state and exit).
    fn reset(&self) {
        if self.state.swap(RESET, Ordering::SeqCst) != RESET {
            let _ = set_linger_zero(&self.client);
            let _ = set_linger_zero(&self.server);
        }
    }

    /// Sends FIN to both sides; the forwarding threads then drain and discard until end of stream.
    fn close_clean(&self) {
        if self.state.compare_exchange(OPEN, CLOSING, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            let _ = self.client.shutdown(Shutdown::Write);
            let _ = self.server.shutdown(Shutdown::Write);
        }
    }

    /// (source, destination) of a direction.
    fn sides(&self, dir: Dir) -> (&TcpStream, &TcpStream) {
        match dir {
            Dir::ToServer => (&self.client, &self.server),
            Dir::ToClient => (&self.server, &self.client),
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    while !shared.stopped() {
        match listener.accept() {
            Ok((client, _)) => {
                shared.accepted.fetch_add(1, Ordering::Relaxed);
                let guard = ThreadGuard::new(shared);
                let conn_shared = Arc::clone(shared);
                // If the spawn fails the closure is dropped: the client socket closes, the guard uncounts.
                let _ = thread::Builder::new().name("fault-proxy-conn".into()).spawn(move || {
                    let _guard = guard;
                    connection(&conn_shared, client);
                });
            }
            // WouldBlock when idle; other errors (EMFILE, ECONNABORTED...) are retried after a pause too.
            Err(_) => thread::sleep(POLL),
        }
    }
}

/// Runs one accepted connection: connects upstream, starts the towards-client thread and forwards
/// towards the server on this thread.
fn connection(shared: &Arc<Shared>, client: TcpStream) {
    if shared.fault() == Fault::Reset {
        let _ = set_linger_zero(&client);
        return;
    }
    let server = match TcpStream::connect_timeout(&shared.upstream, CONNECT_TIMEOUT) {
        Ok(server) => server,
        Err(_) => {
            // Upstream refused or unreachable: refuse the client the same way, with a reset.
            let _ = set_linger_zero(&client);
            return;
        }
    };
    let conn = Arc::new(Conn { client, server, state: AtomicU8::new(OPEN) });
    if configure(&conn.client).and_then(|()| configure(&conn.server)).is_err() {
        conn.reset();
        return;
    }
    if shared.stopped() {
        return;
    }
    {
        let mut conns = lock(&shared.conns);
        conns.retain(|c| c.strong_count() > 0);
        conns.push(Arc::downgrade(&conn));
    }
    let guard = ThreadGuard::new(shared);
    let (back_shared, back_conn) = (Arc::clone(shared), Arc::clone(&conn));
    let spawned = thread::Builder::new().name("fault-proxy-conn".into()).spawn(move || {
        let _guard = guard;
        pump(&back_shared, &back_conn, Dir::ToClient);
    });
    if spawned.is_err() {
        conn.reset();
        return;
    }
    pump(shared, &conn, Dir::ToServer);
}

fn configure(stream: &TcpStream) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(POLL))?;
    stream.set_write_timeout(Some(POLL))
}

/// Forwards one direction of `conn` until end of stream, an error, a reset, a truncation or the proxy's
/// drop, applying the current fault to every chunk.
fn pump(shared: &Shared, conn: &Conn, dir: Dir) {
    let (src, dst) = conn.sides(dir);
    let mut buf = vec![0u8; CHUNK];
    // Bytes read but not yet forwarded (they are held while a fault holds this direction).
    let mut pending = 0usize;
    let mut received_at = Instant::now();
    // Absolute offset of the next byte forwarded in this direction.
    let mut offset = 0u64;
    loop {
        if shared.stopped() {
            return;
        }
        match conn.state() {
            RESET => return,
            CLOSING => return drain(shared, conn, src, &mut buf),
            _ => {}
        }
        let fault = shared.fault();
        match fault {
            Fault::Reset => {
                conn.reset();
                return;
            }
            Fault::Blackhole => {
                thread::sleep(POLL);
                continue;
            }
            Fault::TruncateAfter { towards_server, bytes }
                if towards_server == dir.towards_server() && offset >= bytes =>
            {
                conn.close_clean();
                continue;
            }
            _ => {}
        }
        if pending == 0 {
            let trickle_stalled =
                matches!(fault, Fault::Trickle { towards_server, .. } if towards_server != dir.towards_server());
            if trickle_stalled || fault == (Fault::StopReading { towards_server: dir.towards_server() }) {
                thread::sleep(POLL);
                continue;
            }
            match read_from(src, &mut buf) {
                Ok(0) => {
                    // End of stream: pass the half-close on; the other direction keeps going.
                    if conn.state() == OPEN {
                        let _ = dst.shutdown(Shutdown::Write);
                    }
                    return;
                }
                Ok(n) => {
                    pending = n;
                    received_at = Instant::now();
                }
                Err(e) if is_retry(&e) => {}
                Err(_) => {
                    if conn.state() == OPEN {
                        conn.reset();
                    }
                }
            }
            // Look at the fault again (it may have changed while the read was waiting) before forwarding.
            continue;
        }
        let delay = match fault {
            Fault::Delay(delay) => Some(delay),
            Fault::Trickle { towards_server, delay } if towards_server == dir.towards_server() => Some(delay),
            _ => None,
        };
        if let Some(delay) = delay {
            let now = Instant::now();
            let due = received_at + delay;
            if now < due {
                thread::sleep((due - now).min(POLL));
                continue;
            }
        }
        let mut len = pending;
        match fault {
            Fault::CorruptAt { towards_server, offset: at, xor }
                if towards_server == dir.towards_server() && at >= offset && at - offset < len as u64 =>
            {
                buf[(at - offset) as usize] ^= xor;
            }
            Fault::TruncateAfter { towards_server, bytes } if towards_server == dir.towards_server() => {
                // `offset < bytes` here, or the connection would have been closed above.
                len = len.min(usize::try_from(bytes - offset).unwrap_or(usize::MAX));
            }
            _ => {}
        }
        match write_all(shared, conn, dst, &buf[..len]) {
            Ok(()) => {}
            Err(WriteEnd::Abandoned) => continue,
            Err(WriteEnd::Failed) => {
                conn.reset();
                return;
            }
        }
        offset += len as u64;
        shared.forwarded[dir as usize].fetch_add(len as u64, Ordering::Relaxed);
        // Bytes cut off by a truncation are dropped with the rest of the chunk.
        pending = 0;
    }
}

/// After a clean close: reads and discards until end of stream, so that closing the socket later sends no
/// RST for unread data.
fn drain(shared: &Shared, conn: &Conn, src: &TcpStream, buf: &mut [u8]) {
    while !shared.stopped() && conn.state() != RESET {
        if shared.fault() == Fault::Reset {
            conn.reset();
            return;
        }
        match read_from(src, buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if is_retry(&e) => {}
            Err(_) => return,
        }
    }
}

/// Why `write_all` gave up.
enum WriteEnd {
    /// The proxy is stopping or the connection is being reset or closed: the caller's loop handles that.
    Abandoned,
    /// The write failed: the destination is gone.
    Failed,
}

/// Writes all of `data`, waking up every `POLL` (write timeout) to give up if the proxy stops or the
/// connection is reset or closed meanwhile.
fn write_all(shared: &Shared, conn: &Conn, mut dst: &TcpStream, mut data: &[u8]) -> Result<(), WriteEnd> {
    while !data.is_empty() {
        if shared.stopped() || conn.state() != OPEN {
            return Err(WriteEnd::Abandoned);
        }
        match dst.write(data) {
            Ok(0) => return Err(WriteEnd::Failed),
            Ok(n) => data = &data[n..],
            Err(e) if is_retry(&e) => {}
            Err(_) if conn.state() != OPEN => return Err(WriteEnd::Abandoned),
            Err(_) => return Err(WriteEnd::Failed),
        }
    }
    Ok(())
}

fn read_from(mut src: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    src.read(buf)
}

/// A timeout (socket read/write timeout expired) or an interrupted call: try again.
fn is_retry(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `struct linger` of `<sys/socket.h>`.
#[repr(C)]
struct Linger {
    l_onoff: c_int,
    l_linger: c_int,
}

// (SOL_SOCKET, SO_LINGER): the generic Linux values, and the BSD ones that Linux also uses on MIPS and SPARC.
#[cfg(all(
    any(target_os = "linux", target_os = "android"),
    not(any(target_arch = "mips", target_arch = "mips64", target_arch = "sparc", target_arch = "sparc64"))
))]
const SOL_SOCKET_SO_LINGER: (c_int, c_int) = (1, 13);
#[cfg(not(all(
    any(target_os = "linux", target_os = "android"),
    not(any(target_arch = "mips", target_arch = "mips64", target_arch = "sparc", target_arch = "sparc64"))
)))]
const SOL_SOCKET_SO_LINGER: (c_int, c_int) = (0xffff, 0x80);

unsafe extern "C" {
    fn setsockopt(fd: c_int, level: c_int, name: c_int, value: *const c_void, len: u32) -> c_int;
}

/// Sets `SO_LINGER` to {on, 0 s}: closing the socket then sends RST instead of FIN. (std's
/// `TcpStream::set_linger` is unstable.)
fn set_linger_zero(stream: &TcpStream) -> io::Result<()> {
    let linger = Linger { l_onoff: 1, l_linger: 0 };
    let (level, name) = SOL_SOCKET_SO_LINGER;
    // SAFETY: the fd is a valid open socket owned by `stream` for the duration of the call; `linger` is a
    // live, properly aligned `struct linger` and the length passed is exactly its size; setsockopt only
    // reads that many bytes from the pointer and keeps no reference to it.
    let rc = unsafe {
        setsockopt(
            stream.as_raw_fd(),
            level,
            name,
            (&linger as *const Linger).cast::<c_void>(),
            std::mem::size_of::<Linger>() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
