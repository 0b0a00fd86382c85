//! The listening server: accepting clients, the handshake deadline and
//! the connection cap, shedding under pressure.

use super::*;

pub(super) enum Listener {
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
        if let Some(tls) = config.tls.config() {
            // A configuration without the server's pair cannot serve: say
            // which file is missing now, not at the first client.
            tls.server_config()?;
        }
        if let Listen::Tcp(addr) = listen {
            let plain = match config.tls {
                NbdTls::Off => Some("without TLS"),
                NbdTls::On(_) => Some("with TLS only for the clients that ask for it (tls on)"),
                NbdTls::Require(_) => None,
            };
            if let (Some(how), false, false) = (plain, addr.ip().to_canonical().is_loopback(), config.insecure) {
                return Err(Error::BadSpec(format!(
                    "{listen} is not a loopback address, and serving it {how} lets anyone who reaches the port \
                     read and write the export in plain text; require TLS (NbdTls::Require, tls require), \
                     or choose plain text on purpose on a network you trust (insecure)"
                )));
            }
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
pub(super) const ACCEPT_WAIT: Duration = Duration::from_secs(1);
/// Waits of the accepting thread out of file descriptors or memory with
/// no connection to close: from the first to the last, doubling.
pub(super) const BACKOFF_MIN: Duration = Duration::from_millis(10);
pub(super) const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// Wait for a closed connection to give back what it held.
pub(super) const SHED_WAIT: Duration = Duration::from_millis(200);

/// The process is out of file descriptors or memory (`why`): close the
/// oldest connection still in its handshake and wait for it to end, or,
/// with none, wait a little (longer each time in a row).
pub(super) fn out_of_resources(conns: &Conns, notices: &mut Notices, why: &str, backoff: &mut Duration) {
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
pub(super) fn connection_buffer(max_payload: u32) -> Result<(Allocator, Buffer), String> {
    let domain = Domain::new("nbd connection");
    let pool = Allocator::new(&domain, 1, max_payload as usize, PoolConstraints::default())
        .map_err(|e| format!("no buffer for a connection ({e})"))?;
    let buffer = pool.alloc().ok_or_else(|| "the connection's pool is empty".to_string())?;
    Ok((pool, buffer))
}

/// A connection's entry in its server's table of connections.
pub(super) struct Guard<'a> {
    pub(super) conns: &'a Conns,
    pub(super) id: u64,
}
