//! [`Port`]: one fd of any kind, read into new buffers of an allocator and
//! written from buffers that the write consumes.

use std::collections::VecDeque;
use std::ffi::CString;
use std::io;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use ferry::{Allocator, Buffer, Domain};

use crate::error::IoError;

/// The most iovecs one system call takes (`IOV_MAX` on Linux).
const IOV_MAX: usize = 1024;

/// The alignment `O_DIRECT` needs of addresses, lengths and file offsets
/// here (a page: at least the logical block size of every Linux device).
const DIRECT_ALIGN: usize = 4096;

/// What a [`Port`]'s fd is, as the kernel says (`fstat`, `SO_TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A regular file.
    File,
    /// A pipe or FIFO.
    Pipe,
    /// A stream socket (TCP, Unix stream).
    Stream,
    /// A datagram socket (UDP, Unix datagram, sequenced packets): one
    /// message per buffer.
    Datagram,
    /// A character device (`/dev/null`, a terminal).
    Device,
    /// Anything else (block devices, epoll, eventfd ...): read and written
    /// as a stream.
    Other,
}

/// A buffer produced by a read, with the number of bytes the read put in
/// it (`buffer[..len]`; the rest is whatever the buffer held before: reads
/// never clear memory they do not fill).
#[derive(Debug)]
pub struct Filled {
    /// The buffer, owned by the caller.
    pub buffer: Buffer,
    /// Bytes read into it, from its start.
    pub len: usize,
}

impl Filled {
    /// The bytes read.
    pub fn bytes(&self) -> &[u8] {
        &self.buffer[..self.len]
    }
}

/// A byte range of a buffer, to be written (and the buffer consumed).
#[derive(Debug)]
pub struct Chunk {
    buffer: Buffer,
    start: usize,
    end: usize,
}

impl Chunk {
    /// `buffer[range]`; [`IoError::BadRange`] (the buffer dropped, back in
    /// its allocator) when the range leaves the buffer.
    pub fn new(buffer: Buffer, range: Range<usize>) -> Result<Chunk, IoError> {
        if range.start > range.end || range.end > buffer.len() {
            return Err(IoError::BadRange { start: range.start, end: range.end, len: buffer.len() });
        }
        Ok(Chunk { buffer, start: range.start, end: range.end })
    }

    /// The whole buffer.
    pub fn whole(buffer: Buffer) -> Chunk {
        let end = buffer.len();
        Chunk { buffer, start: 0, end }
    }

    /// Bytes in the range.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// The bytes of the range.
    pub fn bytes(&self) -> &[u8] {
        &self.buffer[self.start..self.end]
    }

    /// The id of the chunk's buffer.
    pub fn buffer_id(&self) -> ferry::BufferId {
        self.buffer.id()
    }

    /// Give the buffer back (not written).
    pub fn into_buffer(self) -> Buffer {
        self.buffer
    }
}

impl From<Filled> for Chunk {
    fn from(f: Filled) -> Chunk {
        Chunk { buffer: f.buffer, start: 0, end: f.len }
    }
}

impl From<Buffer> for Chunk {
    fn from(b: Buffer) -> Chunk {
        Chunk::whole(b)
    }
}

/// One fd of any kind — file, pipe, socket, device, standard input or
/// output — that reads *produce* buffers from and writes *consume* buffers
/// into (the I/O of Container Shipping, by Pasquale, Anderson and Muller):
/// the kernel reads straight into pool memory and writes straight from it,
/// nothing in between copies the data.
///
/// ```
/// use ferry::{Allocator, Domain, PoolConstraints};
/// use ferry_io::Port;
/// let dir = std::env::temp_dir().join(format!("ferry-io-doc-{}", std::process::id()));
/// std::fs::write(&dir, b"hello, ferry")?;
/// let alloc = Allocator::new(&Domain::new("d"), 4, 4096, PoolConstraints::default())?;
/// let mut src = Port::open(&dir)?;
/// let filled = src.read(&alloc, 4)?;             // new buffers, filled by the kernel
/// assert_eq!((filled.len(), filled[0].bytes()), (1, &b"hello, ferry"[..]));
/// let mut null = Port::create("/dev/null")?;
/// assert_eq!(null.write(filled)?, 12);          // consumed: back in the allocator
/// assert_eq!(alloc.available(), 4);
/// # std::fs::remove_file(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Port {
    /// Keeps the fd open; `None` for standard input/output, which stay open.
    _owned: Option<OwnedFd>,
    fd: RawFd,
    name: String,
    kind: Kind,
    offset: u64,
    direct: bool,
    /// The pipe of [`Port::read_unmapped`], made on first use.
    pipe: Option<(OwnedFd, OwnedFd)>,
    /// Datagrams received by one `recvmmsg` but not yet handed out: those
    /// behind a datagram too large for its buffer (whose error is handed
    /// out in its turn).
    backlog: VecDeque<Result<Filled, IoError>>,
    /// Datagrams the last `recvmmsg` took: the next one offers at most
    /// twice as many buffers plus one, so a socket that holds one datagram
    /// at a time does not cost a whole batch of allocations per call.
    last_batch: usize,
    /// The longest a transfer waits for the fd to become ready
    /// ([`Port::set_timeout`]); `None`: the fd blocks as it was opened.
    timeout: Option<Duration>,
}

/// Retry `f` while it fails with `EINTR`; a negative return is the errno.
fn retry(mut f: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = f();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

fn kind_of(fd: RawFd, name: &str) -> Result<Kind, IoError> {
    // SAFETY: `stat` is plain old data, fully written by a successful fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open for the duration of the call; `st` is a valid out pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(IoError::from_os(name, "fstat", 0, io::Error::last_os_error()));
    }
    Ok(match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Kind::File,
        libc::S_IFIFO => Kind::Pipe,
        libc::S_IFCHR => Kind::Device,
        libc::S_IFDIR => return Err(IoError::IsDirectory { name: name.to_string() }),
        libc::S_IFSOCK => {
            let mut ty: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: `ty` and `len` are valid out pointers of the right size.
            let r = unsafe {
                libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, (&mut ty as *mut libc::c_int).cast(), &mut len)
            };
            if r != 0 {
                return Err(IoError::from_os(name, "getsockopt", 0, io::Error::last_os_error()));
            }
            match ty {
                libc::SOCK_STREAM => Kind::Stream,
                _ => Kind::Datagram,
            }
        }
        _ => Kind::Other,
    })
}

impl Port {
    fn open_with(path: &Path, flags: libc::c_int) -> Result<Port, IoError> {
        let name = path.display().to_string();
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| IoError::Os {
            name: name.clone(),
            op: "open",
            offset: 0,
            source: io::ErrorKind::InvalidInput.into(),
        })?;
        let fd = loop {
            // SAFETY: `c` is a NUL-terminated path; the mode is read only with O_CREAT.
            let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC, 0o666 as libc::c_uint) };
            if fd >= 0 {
                break fd;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(IoError::from_os(&name, "open", 0, e));
            }
        };
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let kind = kind_of(fd, &name)?;
        Ok(Port {
            _owned: Some(owned),
            fd,
            name,
            kind,
            offset: 0,
            direct: flags & libc::O_DIRECT != 0,
            pipe: None,
            backlog: VecDeque::new(),
            last_batch: 0,
            timeout: None,
        })
    }

    /// Open `path` for reading (buffered: through the page cache).
    pub fn open(path: impl AsRef<Path>) -> Result<Port, IoError> {
        Port::open_with(path.as_ref(), libc::O_RDONLY)
    }

    /// Open `path` for reading with `O_DIRECT` where its file system
    /// allows (the device reads straight into the pool's page-aligned
    /// buffers, bypassing the page cache), buffered where not
    /// ([`Port::is_direct`] says which).
    pub fn open_direct(path: impl AsRef<Path>) -> Result<Port, IoError> {
        match Port::open_with(path.as_ref(), libc::O_RDONLY | libc::O_DIRECT) {
            Err(IoError::Os { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => Port::open(path),
            r => r,
        }
    }

    /// Create (or truncate) `path` for writing.
    pub fn create(path: impl AsRef<Path>) -> Result<Port, IoError> {
        Port::open_with(path.as_ref(), libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC)
    }

    /// Create (or truncate) `path` for writing with `O_DIRECT` where its
    /// file system allows; a write that is not page-aligned (the tail of a
    /// file) turns `O_DIRECT` off for the rest of the file.
    pub fn create_direct(path: impl AsRef<Path>) -> Result<Port, IoError> {
        let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC;
        match Port::open_with(path.as_ref(), flags | libc::O_DIRECT) {
            Err(IoError::Os { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => Port::create(path),
            r => r,
        }
    }

    fn standard(fd: RawFd, name: &str) -> Result<Port, IoError> {
        let kind = kind_of(fd, name)?;
        Ok(Port {
            _owned: None,
            fd,
            name: name.to_string(),
            kind,
            offset: 0,
            direct: false,
            pipe: None,
            backlog: VecDeque::new(),
            last_batch: 0,
            timeout: None,
        })
    }

    /// Standard input (left open when the port is dropped).
    pub fn stdin() -> Result<Port, IoError> {
        Port::standard(libc::STDIN_FILENO, "standard input")
    }

    /// Standard output (left open when the port is dropped).
    pub fn stdout() -> Result<Port, IoError> {
        Port::standard(libc::STDOUT_FILENO, "standard output")
    }

    /// Any open fd (a socket, a pipe end, a file), named `name` in errors
    /// (`tcp:127.0.0.1:9000`, `pipe`, a path).
    pub fn from_fd(fd: impl Into<OwnedFd>, name: impl Into<String>) -> Result<Port, IoError> {
        let owned: OwnedFd = fd.into();
        let name = name.into();
        let fd = owned.as_raw_fd();
        let kind = kind_of(fd, &name)?;
        Ok(Port {
            _owned: Some(owned),
            fd,
            name,
            kind,
            offset: 0,
            direct: false,
            pipe: None,
            backlog: VecDeque::new(),
            last_batch: 0,
            timeout: None,
        })
    }

    /// The name errors use.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the fd is.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Bytes transferred through this port so far (for a file opened
    /// here, the file offset).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Whether reads and writes bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    fn err(&self, op: &'static str, e: io::Error) -> IoError {
        match self.timeout {
            // Made by `wait_ready` (an errno ETIMEDOUT is the network's).
            Some(limit) if e.kind() == io::ErrorKind::TimedOut && e.raw_os_error().is_none() => {
                IoError::TimedOut { name: self.name.clone(), op, offset: self.offset, limit }
            }
            _ => IoError::from_os(&self.name, op, self.offset, e),
        }
    }

    /// Bound every wait of this port's reads and writes on a socket or
    /// pipe: a transfer that can move no byte for `limit` fails with
    /// [`IoError::TimedOut`] (the bytes moved before count, as with any
    /// error); `None` lifts the bound. The fd is made non-blocking
    /// (`O_NONBLOCK`, which every fd sharing its open file sees) and each
    /// wait is a `poll` for room or data, so the limit is the time without
    /// progress, however the kernel splits a transfer. Regular files and
    /// devices are not waited on: there the call changes nothing. A port
    /// with a timeout is not for a [`crate::Ring`], which would meet EAGAIN.
    pub fn set_timeout(&mut self, limit: Option<Duration>) -> Result<(), IoError> {
        if !matches!(self.kind, Kind::Stream | Kind::Datagram | Kind::Pipe) {
            return Ok(());
        }
        // SAFETY: F_GETFL/F_SETFL on our open fd.
        let flags = unsafe { libc::fcntl(self.fd, libc::F_GETFL) };
        let want = if limit.is_some() { flags | libc::O_NONBLOCK } else { flags & !libc::O_NONBLOCK };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(self.fd, libc::F_SETFL, want) } < 0 {
            return Err(self.err("fcntl", io::Error::last_os_error()));
        }
        self.timeout = limit;
        Ok(())
    }

    /// The limit of [`Port::set_timeout`].
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// `f`, a read or write of this port's fd, retried after EINTR and,
    /// with a timeout set, after EAGAIN once the fd is ready for `events`
    /// (`POLLIN`, `POLLOUT`) within the limit.
    fn transfer(&self, events: libc::c_short, mut f: impl FnMut() -> isize) -> io::Result<usize> {
        loop {
            match retry(&mut f) {
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && self.timeout.is_some() => {
                    self.wait_ready(events)?
                }
                r => return r,
            }
        }
    }

    /// Wait for `events` on the fd, at most the port's timeout; an
    /// `ErrorKind::TimedOut` without errno when it runs out. An error or a
    /// hang-up on the fd counts as ready: the next transfer reports it.
    fn wait_ready(&self, events: libc::c_short) -> io::Result<()> {
        let limit = self.timeout.unwrap_or(Duration::MAX);
        let deadline = std::time::Instant::now().checked_add(limit);
        loop {
            let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(std::time::Instant::now()));
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            // Rounded up: poll may wake a little early, and then waits on.
            let ms = left.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as libc::c_int;
            let mut pfd = libc::pollfd { fd: self.fd, events, revents: 0 };
            // SAFETY: one valid pollfd, alive for the call.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n > 0 {
                return Ok(());
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Err(e);
                }
            }
        }
    }

    /// Turn `O_DIRECT` off (an unaligned transfer, or a file system that
    /// refuses it after all).
    fn drop_direct(&mut self) -> Result<(), IoError> {
        // SAFETY: F_GETFL/F_SETFL on our open fd.
        let flags = unsafe { libc::fcntl(self.fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(self.fd, libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
            return Err(self.err("fcntl", io::Error::last_os_error()));
        }
        self.direct = false;
        Ok(())
    }

    /// Read into new buffers of `alloc`, up to `max_buffers` of them (as
    /// many as are free), until they are full or the input ends: the
    /// `cs_read` of Container Shipping. Each [`Filled`] is a buffer with
    /// the bytes the kernel put in it; only the last one of a stream may be
    /// partly filled, and an empty vector means end of input. Buffers are
    /// not cleared first.
    ///
    /// A datagram socket gives one datagram per buffer: it waits for the
    /// first, then takes those already queued, all in one `recvmmsg` (at
    /// most twice as many as the port's previous read got, plus one, so a
    /// socket that is seldom full does not cost a whole batch of buffer
    /// allocations per datagram; a full one reaches `max_buffers` within a
    /// few reads); a
    /// datagram larger than a buffer is [`IoError::DatagramTooLarge`], never
    /// cut short silently, and the datagrams received with it in the same
    /// system call are kept: those before it are returned first, the error
    /// by the next read, those after it by the reads after that (the port
    /// holds their buffers meanwhile).
    ///
    /// [`IoError::NoBuffer`] when the allocator has none free. On any error
    /// every buffer of the call is back in the allocator.
    pub fn read(&mut self, alloc: &Allocator, max_buffers: usize) -> Result<Vec<Filled>, IoError> {
        self.fill(alloc, max_buffers, None, false)
    }

    /// Like [`Port::read`], but one system call: returns as soon as the
    /// kernel has given anything (what a socket or pipe has now).
    pub fn read_some(&mut self, alloc: &Allocator, max_buffers: usize) -> Result<Vec<Filled>, IoError> {
        self.fill(alloc, max_buffers, None, true)
    }

    /// Read exactly `bytes` (in as many buffers of `alloc` as it takes):
    /// [`IoError::UnexpectedEof`] if the input ends first (the buffers go
    /// back), [`IoError::NoBuffer`] if the allocator has too few free.
    /// Not for datagram sockets ([`Port::read`] takes one message per
    /// buffer there).
    pub fn read_exact(&mut self, alloc: &Allocator, bytes: u64) -> Result<Vec<Filled>, IoError> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        let size = alloc.pool().geometry().buffer_size() as u64;
        let needed = bytes.div_ceil(size) as usize;
        self.fill(alloc, needed, Some(bytes), false)
    }

    fn fill(
        &mut self,
        alloc: &Allocator,
        max_buffers: usize,
        want: Option<u64>,
        once: bool,
    ) -> Result<Vec<Filled>, IoError> {
        if max_buffers == 0 {
            return Ok(Vec::new());
        }
        if self.kind == Kind::Datagram {
            return self.recv_datagrams(alloc, max_buffers);
        }
        let size = alloc.pool().geometry().buffer_size();
        let mut bufs: Vec<Buffer> = Vec::with_capacity(max_buffers.min(4096));
        while bufs.len() < max_buffers {
            match alloc.alloc() {
                Some(b) => bufs.push(b),
                None => break,
            }
        }
        if bufs.is_empty() || (want.is_some() && bufs.len() < max_buffers) {
            return Err(IoError::NoBuffer { name: self.name.clone(), offset: self.offset });
        }
        // Target length of each buffer: full, except the last of an exact
        // request.
        let mut targets = vec![size; bufs.len()];
        if let Some(w) = want {
            let last = (w - (bufs.len() as u64 - 1) * size as u64) as usize;
            *targets.last_mut().expect("at least one") = last;
        }
        let mut ptrs = Vec::with_capacity(bufs.len());
        for b in bufs.iter_mut() {
            // A buffer fresh from the allocator is read-write (no copies out).
            let s = b.as_mut_slice().map_err(|_| IoError::BufferShared { name: self.name.clone() })?;
            ptrs.push(s.as_mut_ptr());
        }
        let mut lens = vec![0usize; bufs.len()];
        let (mut cur, mut total) = (0usize, 0u64);
        while cur < bufs.len() {
            let iov: Vec<libc::iovec> = (cur..bufs.len().min(cur + IOV_MAX))
                .map(|i| libc::iovec {
                    // SAFETY: lens[i] <= targets[i] <= the buffer's size, so the
                    // pointer stays inside buffer i.
                    iov_base: unsafe { ptrs[i].add(lens[i]) }.cast(),
                    iov_len: targets[i] - lens[i],
                })
                .collect();
            // SAFETY: every iovec covers memory of a buffer in `bufs`, which
            // this call owns read-write (checked above) and keeps alive and
            // unaliased until it returns; the kernel writes at most iov_len
            // bytes to each.
            let r =
                self.transfer(libc::POLLIN, || unsafe { libc::readv(self.fd, iov.as_ptr(), iov.len() as libc::c_int) });
            let n = match r {
                Ok(n) => n,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && self.direct => {
                    self.drop_direct()?;
                    continue;
                }
                Err(e) => return Err(self.err("read", e)),
            };
            if n == 0 {
                break;
            }
            total += n as u64;
            self.offset += n as u64;
            let mut left = n;
            while left > 0 {
                let take = left.min(targets[cur] - lens[cur]);
                lens[cur] += take;
                left -= take;
                if lens[cur] == targets[cur] {
                    cur += 1;
                }
            }
            if once {
                break;
            }
        }
        if let Some(w) = want {
            if total < w {
                return Err(IoError::UnexpectedEof {
                    name: self.name.clone(),
                    offset: self.offset,
                    missing: w - total,
                });
            }
        }
        Ok(bufs.into_iter().zip(lens).filter(|(_, len)| *len > 0).map(|(buffer, len)| Filled { buffer, len }).collect())
    }

    /// Up to `max_buffers` datagrams, one per buffer, in one `recvmmsg`:
    /// it waits for the first and takes those already queued
    /// (`MSG_WAITFORONE`), so a busy socket costs one system call per batch
    /// rather than one per datagram. Buffers not filled go back at once.
    fn recv_datagrams(&mut self, alloc: &Allocator, max_buffers: usize) -> Result<Vec<Filled>, IoError> {
        if !self.backlog.is_empty() {
            return self.drain_backlog(max_buffers);
        }
        let offer = max_buffers.min(IOV_MAX).min(self.last_batch * 2 + 1);
        let mut bufs: Vec<Buffer> = Vec::with_capacity(offer);
        while bufs.len() < offer {
            match alloc.alloc() {
                Some(b) => bufs.push(b),
                None => break,
            }
        }
        if bufs.is_empty() {
            return Err(IoError::NoBuffer { name: self.name.clone(), offset: self.offset });
        }
        let mut iov = Vec::with_capacity(bufs.len());
        for b in bufs.iter_mut() {
            let s = b.as_mut_slice().map_err(|_| IoError::BufferShared { name: self.name.clone() })?;
            iov.push(libc::iovec { iov_base: s.as_mut_ptr().cast(), iov_len: s.len() });
        }
        let mut msgs = one_datagram_each(&mut iov);
        // MSG_TRUNC: each msg_len is the datagram's real size, so one too
        // large for its buffer is seen, never handed on cut short.
        let flags = libc::MSG_TRUNC | libc::MSG_WAITFORONE;
        // SAFETY: every mmsghdr points at one iovec of `iov`, each covering a
        // buffer of `bufs` owned read-write by this call and alive until it
        // returns; the kernel writes at most iov_len bytes into each.
        let r = self.transfer(libc::POLLIN, || unsafe {
            libc::recvmmsg(self.fd, msgs.as_mut_ptr(), msgs.len() as libc::c_uint, flags, std::ptr::null_mut()) as isize
        });
        let got = r.map_err(|e| self.err("receive", e))?;
        self.last_batch = got;
        let size = bufs[0].len();
        let mut out = Vec::with_capacity(got);
        for (b, m) in bufs.into_iter().zip(&msgs).take(got) {
            let n = m.msg_len as usize;
            let item = if n > size || m.msg_hdr.msg_flags & libc::MSG_TRUNC != 0 {
                // Its buffer goes back; the error is handed out in its turn.
                Err(IoError::DatagramTooLarge { name: self.name.clone(), offset: self.offset, size: n, limit: size })
            } else {
                self.offset += n as u64;
                Ok(Filled { buffer: b, len: n })
            };
            match item {
                Ok(f) if self.backlog.is_empty() => out.push(f),
                item => self.backlog.push_back(item),
            }
        }
        if out.is_empty() {
            return self.drain_backlog(max_buffers);
        }
        Ok(out)
    }

    /// The datagrams of the backlog up to the next error, or that error.
    fn drain_backlog(&mut self, max_buffers: usize) -> Result<Vec<Filled>, IoError> {
        if let Some(Err(_)) = self.backlog.front() {
            if let Some(Err(e)) = self.backlog.pop_front() {
                return Err(e);
            }
        }
        let mut out = Vec::new();
        while out.len() < max_buffers && matches!(self.backlog.front(), Some(Ok(_))) {
            if let Some(Ok(f)) = self.backlog.pop_front() {
                out.push(f);
            }
        }
        Ok(out)
    }

    /// Write the chunks in order, consuming them: each buffer goes back to
    /// its allocator as soon as the kernel has taken all its bytes, and on
    /// error too. Short writes are continued. Returns the bytes written.
    ///
    /// On a datagram socket each chunk is one datagram, many per system
    /// call (`sendmmsg`).
    pub fn write<C: Into<Chunk>>(&mut self, chunks: impl IntoIterator<Item = C>) -> Result<u64, IoError> {
        let mut q: VecDeque<Chunk> = chunks.into_iter().map(Into::into).collect();
        if self.kind == Kind::Datagram {
            return self.send_datagrams(q);
        }
        let mut done = 0usize; // bytes of q[0] already written
        let mut total = 0u64;
        while let Some(front) = q.front() {
            if front.len() == done {
                q.pop_front();
                done = 0;
                continue;
            }
            let iov: Vec<libc::iovec> = q
                .iter()
                .take(IOV_MAX)
                .enumerate()
                .map(|(i, c)| {
                    let skip = if i == 0 { done } else { 0 };
                    libc::iovec { iov_base: c.bytes()[skip..].as_ptr() as *mut libc::c_void, iov_len: c.len() - skip }
                })
                .filter(|v| v.iov_len > 0)
                .collect();
            if self.direct {
                let aligned = self.offset % DIRECT_ALIGN as u64 == 0
                    && iov.iter().all(|v| v.iov_base as usize % DIRECT_ALIGN == 0 && v.iov_len % DIRECT_ALIGN == 0);
                if !aligned {
                    self.drop_direct()?;
                }
            }
            let r = if self.kind == Kind::Stream {
                // SAFETY: msghdr is plain old data; only the iovec fields are set.
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
                msg.msg_iovlen = iov.len();
                // SAFETY: the iovecs cover live buffers in `q`, which the kernel
                // only reads; MSG_NOSIGNAL turns SIGPIPE into EPIPE.
                self.transfer(libc::POLLOUT, || unsafe { libc::sendmsg(self.fd, &msg, libc::MSG_NOSIGNAL) })
            } else {
                // SAFETY: the iovecs cover live buffers in `q`, which the kernel only reads.
                self.transfer(libc::POLLOUT, || unsafe {
                    libc::writev(self.fd, iov.as_ptr(), iov.len() as libc::c_int)
                })
            };
            let mut n = match r {
                Ok(0) => return Err(self.err("write", io::ErrorKind::WriteZero.into())),
                Ok(n) => n,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && self.direct => {
                    self.drop_direct()?;
                    continue;
                }
                Err(e) => return Err(self.err("write", e)),
            };
            total += n as u64;
            self.offset += n as u64;
            while n > 0 {
                let front = q.front().expect("the kernel wrote no more than was given");
                let left = front.len() - done;
                if n >= left {
                    n -= left;
                    q.pop_front(); // the kernel is done with it: back to its allocator
                    done = 0;
                } else {
                    done += n;
                    n = 0;
                }
            }
        }
        Ok(total)
    }

    /// Read like [`Port::read`], but the kernel puts the bytes into each
    /// buffer's pages through its pool's memfd (`splice`, through a pipe
    /// of this port's unless the fd is a pipe) instead of through this
    /// process's mapping: a stage that only reads buffers in and hands them
    /// on (an fd in, a channel out) never maps their pages in. A datagram
    /// socket, or an fd that `splice` does not take, is read as by
    /// [`Port::read`].
    pub fn read_unmapped(&mut self, alloc: &Allocator, max_buffers: usize) -> Result<Vec<Filled>, IoError> {
        if self.kind == Kind::Datagram || self.direct || max_buffers == 0 {
            return self.read(alloc, max_buffers);
        }
        let pool = alloc.pool().clone();
        let size = pool.geometry().buffer_size();
        let memfd = pool.memory_fd().as_raw_fd();
        let mut out: Vec<Filled> = Vec::new();
        'buffers: while out.len() < max_buffers {
            let Some(mut buffer) = alloc.alloc() else {
                if out.is_empty() {
                    return Err(IoError::NoBuffer { name: self.name.clone(), offset: self.offset });
                }
                break;
            };
            // Ownership check only: the slice is not touched.
            if buffer.as_mut_slice().is_err() {
                return Err(IoError::BufferShared { name: self.name.clone() });
            }
            let base = (buffer.id().index as usize * size) as libc::off_t;
            let mut len = 0usize;
            while len < size {
                let mut off = base + len as libc::off_t;
                let n = if self.kind == Kind::Pipe {
                    // SAFETY: `off` is a valid in/out pointer; the kernel writes
                    // into the memfd's pages of this buffer, which we own.
                    self.transfer(libc::POLLIN, || unsafe {
                        libc::splice(self.fd, std::ptr::null_mut(), memfd, &mut off, size - len, libc::SPLICE_F_MOVE)
                            as isize
                    })
                } else {
                    self.splice_via_pipe(memfd, off, size - len)
                };
                match n {
                    Ok(0) => {
                        if len > 0 {
                            out.push(Filled { buffer, len });
                        }
                        break 'buffers;
                    }
                    Ok(n) => {
                        len += n;
                        self.offset += n as u64;
                    }
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) && out.is_empty() && len == 0 => {
                        // This fd does not take splice: read it as usual.
                        drop(buffer);
                        return self.read(alloc, max_buffers);
                    }
                    Err(e) => return Err(self.err("splice", e)),
                }
            }
            out.push(Filled { buffer, len });
        }
        Ok(out)
    }

    /// Move up to `max` bytes from this fd into the memfd at `off`
    /// through the port's pipe; 0 at end of input.
    fn splice_via_pipe(&mut self, memfd: RawFd, off: libc::off_t, max: usize) -> io::Result<usize> {
        if self.pipe.is_none() {
            let mut fds = [0; 2];
            // SAFETY: room for the two fds.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: both new, owned by nothing else.
            let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            // SAFETY: F_SETPIPE_SZ on our own pipe (a larger pipe, fewer calls; failure is harmless).
            unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
            self.pipe = Some((r, w));
        }
        let (r, w) = self.pipe.as_ref().map(|(r, w)| (r.as_raw_fd(), w.as_raw_fd())).expect("made above");
        // SAFETY: no pointers but the null offsets (the file position is used).
        let n = self.transfer(libc::POLLIN, || unsafe {
            libc::splice(self.fd, std::ptr::null_mut(), w, std::ptr::null_mut(), max, libc::SPLICE_F_MOVE) as isize
        })?;
        let mut moved = 0;
        let mut off = off;
        while moved < n {
            // SAFETY: `off` is a valid in/out pointer; the kernel writes into
            // the memfd's pages of the caller's buffer.
            let m = retry(|| unsafe {
                libc::splice(r, std::ptr::null_mut(), memfd, &mut off, n - moved, libc::SPLICE_F_MOVE) as isize
            })?;
            if m == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            moved += m;
        }
        Ok(n)
    }

    /// Write the chunks like [`Port::write`], but hand the kernel each
    /// buffer's pages straight from its pool's memfd (`sendfile`) instead of
    /// through this process's mapping of them: a stage that only forwards
    /// buffers (a channel in, this fd out) never maps their pages in, so it
    /// takes no page faults for them (selective mapping, as in Container
    /// Shipping). `domain` is the one that owns the buffers. Only a file
    /// or a device is written this way: to a socket or a pipe the kernel
    /// would keep the buffer's pages as the stream's data after the call,
    /// so a buffer reused at once would change what the reader gets; those,
    /// and fds that do not take `sendfile` (an `O_APPEND` or `O_DIRECT`
    /// file), are written as by [`Port::write`].
    pub fn write_unmapped<C: Into<Chunk>>(
        &mut self,
        domain: &Domain,
        chunks: impl IntoIterator<Item = C>,
    ) -> Result<u64, IoError> {
        let mut total = 0u64;
        // No allocation on this path: nothing but the kernel's own work
        // happens between the caller's buffers and the fd.
        for c in chunks.into_iter().map(Into::into) {
            // Only where the kernel copies the bytes (a file's page cache)
            // or drops them (a device): to a TCP socket or a pipe, sendfile
            // hands the memfd's pages themselves to the stream, which would
            // carry whatever the buffer holds when it is reused.
            let pool = match domain.pool(c.buffer_id().pool) {
                Some(p) if matches!(self.kind, Kind::File | Kind::Device) && !self.direct => p,
                _ => {
                    total += self.write([c])?;
                    continue;
                }
            };
            let size = pool.geometry().buffer_size() as u64;
            let mut off = (c.buffer_id().index as u64 * size + c.start as u64) as libc::off_t;
            let end = off + c.len() as libc::off_t;
            let memfd = pool.memory_fd().as_raw_fd();
            while off < end {
                let want = (end - off) as usize;
                // SAFETY: `off` is a valid out pointer; both fds are open (the
                // pool lives while `pool` does). The kernel reads the memfd's
                // pages of this buffer, which the chunk's owner holds.
                match self.transfer(libc::POLLOUT, || unsafe { libc::sendfile(self.fd, memfd, &mut off, want) }) {
                    Ok(0) => return Err(self.err("sendfile", io::ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        total += n as u64;
                        self.offset += n as u64;
                    }
                    Err(e)
                        if e.raw_os_error() == Some(libc::EINVAL)
                            && off + want as libc::off_t == end
                            && want == c.len() =>
                    {
                        // This fd does not take sendfile: write it as usual.
                        total += self.write([Chunk { buffer: c.buffer, start: c.start, end: c.end }])?;
                        break;
                    }
                    Err(e) => return Err(self.err("sendfile", e)),
                }
            }
        }
        Ok(total)
    }

    /// Move up to `max` bytes of the regular file `src`, from its current
    /// offset, to this port inside the kernel (`sendfile`): the bytes never
    /// pass through user memory, and to a stream socket the kernel sends
    /// the file's page-cache pages themselves, without copying them. Both
    /// ports' offsets advance. Returns the bytes moved: fewer than `max`
    /// only where `src` ends (0 at its end). An error is returned as it
    /// happens, even after some bytes moved: those count in both ports'
    /// offsets (and in the error's), so a send that stopped because the
    /// peer went away or stalled past the socket's send timeout is told
    /// from a file that ended.
    ///
    /// To a socket or a pipe the kernel hands on the file's pages
    /// themselves: if the file is changed before the reader has them, the
    /// reader may get the new bytes (as with any `sendfile`).
    ///
    /// [`IoError::Os`] with `EINVAL` when the pair does not take `sendfile`
    /// (`src` not a regular file, an `O_APPEND` or `O_DIRECT` destination, a
    /// datagram socket): the caller reads and writes buffers instead.
    pub fn send_from(&mut self, src: &mut Port, max: u64) -> Result<u64, IoError> {
        if src.kind != Kind::File || src.direct || self.direct || self.kind == Kind::Datagram {
            let e = io::Error::from_raw_os_error(libc::EINVAL);
            return Err(self.err("sendfile", e));
        }
        let mut moved = 0u64;
        while moved < max {
            let want = (max - moved).min(1 << 30) as usize;
            // SAFETY: both fds are open while the ports live; a null offset
            // pointer makes the kernel use and advance `src`'s file position.
            let n = match self.transfer(libc::POLLOUT, || unsafe {
                libc::sendfile(self.fd, src.fd, std::ptr::null_mut(), want) as isize
            }) {
                Ok(n) => n,
                // What moved before counts in the offsets, the error's too.
                Err(e) => return Err(self.err("sendfile", e)),
            };
            if n == 0 {
                break;
            }
            moved += n as u64;
            src.offset += n as u64;
            self.offset += n as u64;
        }
        Ok(moved)
    }

    /// Write `bytes` (a few bytes of framing, from the caller's memory); on
    /// a stream socket with `MSG_MORE`, so the kernel sends them in one
    /// segment with the data that follows.
    pub fn send_more(&mut self, bytes: &[u8]) -> Result<(), IoError> {
        let mut done = 0;
        while done < bytes.len() {
            let rest = &bytes[done..];
            let n = if self.kind == Kind::Stream {
                let flags = libc::MSG_NOSIGNAL | libc::MSG_MORE;
                // SAFETY: `rest` is live memory the kernel only reads.
                self.transfer(libc::POLLOUT, || unsafe { libc::send(self.fd, rest.as_ptr().cast(), rest.len(), flags) })
            } else {
                // SAFETY: as above.
                self.transfer(libc::POLLOUT, || unsafe { libc::write(self.fd, rest.as_ptr().cast(), rest.len()) })
            }
            .map_err(|e| self.err("write", e))?;
            if n == 0 {
                return Err(self.err("write", io::ErrorKind::WriteZero.into()));
            }
            done += n;
            self.offset += n as u64;
        }
        Ok(())
    }

    /// Each chunk one datagram, as many per `sendmmsg` as `IOV_MAX` allows;
    /// each buffer goes back once the kernel has taken its datagram.
    fn send_datagrams(&mut self, mut q: VecDeque<Chunk>) -> Result<u64, IoError> {
        let mut total = 0u64;
        while !q.is_empty() {
            let mut iov: Vec<libc::iovec> = q
                .iter()
                .take(IOV_MAX)
                .map(|c| libc::iovec { iov_base: c.bytes().as_ptr() as *mut libc::c_void, iov_len: c.len() })
                .collect();
            let mut msgs = one_datagram_each(&mut iov);
            // SAFETY: every mmsghdr points at one iovec of `iov`, each covering
            // a live chunk of `q`, which the kernel only reads.
            let r = self.transfer(libc::POLLOUT, || unsafe {
                libc::sendmmsg(self.fd, msgs.as_mut_ptr(), msgs.len() as libc::c_uint, libc::MSG_NOSIGNAL) as isize
            });
            match r {
                Ok(sent) => {
                    for _ in 0..sent {
                        let c = q.pop_front().expect("the kernel sent no more than was given");
                        total += c.len() as u64;
                        self.offset += c.len() as u64;
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                    let size = q.front().map_or(0, Chunk::len);
                    return Err(IoError::DatagramRefused { name: self.name.clone(), offset: self.offset, size });
                }
                Err(e) => return Err(self.err("send", e)),
            }
        }
        Ok(total)
    }
}

impl AsFd for Port {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: `fd` is open while the port lives: owned by it, or standard
        // input/output, which the process keeps open.
        unsafe { BorrowedFd::borrow_raw(self.fd) }
    }
}

/// One `mmsghdr` per iovec, each a datagram of that one buffer, for
/// `recvmmsg`/`sendmmsg`. The headers point into `iov`, which must outlive
/// the call they are given to.
fn one_datagram_each(iov: &mut [libc::iovec]) -> Vec<libc::mmsghdr> {
    iov.iter_mut()
        .map(|v| {
            // SAFETY: mmsghdr is plain old data (integers and null
            // pointers are valid all-zero); only the iovec fields are set.
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = 1;
            m
        })
        .collect()
}
