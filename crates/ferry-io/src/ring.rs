//! [`Ring`]: many reads and writes in flight on one io_uring queue, the
//! pool's memory registered with the kernel as fixed buffers, completions
//! signalled on an eventfd that an event loop waits on beside Ferry
//! channels.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use ferry::{Allocator, Buffer, Pool, PoolId};
use io_uring::{opcode, types, IoUring};

use crate::error::IoError;
use crate::port::{Chunk, Filled, Port};

/// How a [`Ring`] runs its requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// io_uring with the pool registered as fixed buffers: the kernel pins
    /// the pool once instead of for every request.
    Fixed,
    /// io_uring with plain reads and writes (nothing registered, or the
    /// buffer is not of the registered pool); the reason is the kernel's.
    Unregistered(String),
    /// No io_uring: each request runs at once as `preadv`/`pwritev` and its
    /// completion is queued; the reason is why io_uring is not used.
    Blocking(String),
}

/// What a finished request gives.
#[derive(Debug)]
pub enum Done {
    /// A read: the buffer and what the kernel put in it (`len` 0 at end of
    /// file).
    Read(Filled),
    /// A write: bytes written (its buffer is back in its allocator).
    Written(u64),
}

/// One finished request: the caller's `tag` and the outcome. The buffer of
/// a failed request is back in its allocator.
#[derive(Debug)]
pub struct Completion {
    /// The tag given when the request was submitted.
    pub tag: u64,
    /// The outcome.
    pub result: Result<Done, IoError>,
}

enum Pending {
    Read { buffer: Buffer, name: String, offset: Option<u64> },
    Write { chunk: Chunk, name: String, offset: Option<u64>, written: u64 },
}

struct Request {
    tag: u64,
    fd: RawFd,
    pending: Pending,
}

struct Registered {
    pool: Pool,
}

/// Many reads and writes in flight: submit requests, collect their
/// completions. Its fd ([`AsFd`]) is an eventfd that becomes readable when
/// a completion is waiting, so one thread can wait on it and on Ferry
/// channels in one `poll`/`epoll` set; [`Ring::completions`] takes what is
/// finished and clears it.
///
/// A request owns its buffer until it completes; dropping the ring waits
/// for the requests in flight, then returns their buffers. The fd of a
/// [`Port`] given to a request must stay open until the request completes.
pub struct Ring {
    uring: Option<IoUring>,
    mode: Mode,
    eventfd: OwnedFd,
    registered: Option<Registered>,
    in_flight: HashMap<u64, Request>,
    next_id: u64,
    ready: VecDeque<Completion>,
    capacity: usize,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("mode", &self.mode).field("in_flight", &self.in_flight.len()).finish()
    }
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ring_err(op: &'static str, e: io::Error) -> IoError {
    IoError::Os { name: "io_uring".into(), op, offset: 0, source: e }
}

impl Ring {
    /// A queue of `entries` requests in flight (a power of two from 1 to
    /// 4096); without io_uring (kernel too old, disabled by
    /// `kernel.io_uring_disabled` or a seccomp filter) the ring runs in
    /// [`Mode::Blocking`] and says why.
    pub fn new(entries: u32) -> Result<Ring, IoError> {
        let eventfd = eventfd().map_err(|e| ring_err("eventfd", e))?;
        let entries = entries.clamp(1, 4096);
        let (uring, mode) = match IoUring::new(entries) {
            Ok(u) => match u.submitter().register_eventfd(eventfd.as_raw_fd()) {
                Ok(()) => (Some(u), Mode::Unregistered("no pool registered".into())),
                Err(e) => {
                    (None, Mode::Blocking(format!("the kernel refused an eventfd for io_uring completions: {e}")))
                }
            },
            Err(e) => (None, Mode::Blocking(format!("io_uring is not available: {e}"))),
        };
        let capacity = match &uring {
            Some(u) => u.params().sq_entries() as usize,
            None => entries as usize,
        };
        Ok(Ring {
            uring,
            mode,
            eventfd,
            registered: None,
            in_flight: HashMap::new(),
            next_id: 0,
            ready: VecDeque::new(),
            capacity,
        })
    }

    /// A ring that never uses io_uring (each request is a `preadv` or
    /// `pwritev` at submission): the fallback, chosen on purpose.
    pub fn blocking(entries: u32) -> Result<Ring, IoError> {
        let eventfd = eventfd().map_err(|e| ring_err("eventfd", e))?;
        Ok(Ring {
            uring: None,
            mode: Mode::Blocking("chosen by the caller".into()),
            eventfd,
            registered: None,
            in_flight: HashMap::new(),
            next_id: 0,
            ready: VecDeque::new(),
            capacity: entries.clamp(1, 4096) as usize,
        })
    }

    /// How requests run.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// Requests submitted and not yet collected.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len() + self.ready.len()
    }

    /// Register the memory of `alloc`'s pool with the kernel as fixed
    /// buffers (one per pool buffer): later requests on its buffers skip
    /// pinning the pages each time. Only one pool at a time; the mode says
    /// whether it worked and, if not, the kernel's reason (requests then
    /// still run, unregistered). Returns the mode.
    pub fn register(&mut self, alloc: &Allocator) -> &Mode {
        let Some(uring) = &self.uring else { return &self.mode };
        let pool = alloc.pool().clone();
        let g = pool.geometry();
        if g.count() > 16384 || g.buffer_size() > (1 << 30) {
            self.mode = Mode::Unregistered(format!(
                "io_uring registers at most 16384 buffers of at most 1 GiB; the pool has {} of {} bytes",
                g.count(),
                g.buffer_size()
            ));
            return &self.mode;
        }
        let iov: Vec<libc::iovec> = (0..g.count() as usize)
            .map(|i| libc::iovec {
                iov_base: (pool.base_address() + i * g.buffer_size()) as *mut libc::c_void,
                iov_len: g.buffer_size(),
            })
            .collect();
        if self.registered.take().is_some() {
            let _ = uring.submitter().unregister_buffers();
        }
        // SAFETY: the iovecs cover the pool's mapping, which stays mapped
        // while `pool` (kept in `self.registered`) lives; the kernel pins
        // the pages, so even an unmapped pool would not make the kernel
        // write to memory that is not ours. Fixed requests are made only
        // for buffers of this pool whose handles the ring holds.
        match unsafe { uring.submitter().register_buffers(&iov) } {
            Ok(()) => {
                self.registered = Some(Registered { pool });
                self.mode = Mode::Fixed;
            }
            Err(e) => self.mode = Mode::Unregistered(format!("the kernel refused to register the pool's memory: {e}")),
        }
        &self.mode
    }

    fn fixed_pool(&self) -> Option<PoolId> {
        self.registered.as_ref().map(|r| r.pool.id())
    }

    /// Read into a new buffer of `alloc` from `port` at `offset` (`None`:
    /// at the file position, for pipes and sockets). The completion gives
    /// the buffer with the bytes read (a short read is reported as it is).
    /// [`IoError::NoBuffer`] if the allocator has none free.
    pub fn submit_read(
        &mut self,
        port: &Port,
        offset: Option<u64>,
        alloc: &Allocator,
        tag: u64,
    ) -> Result<(), IoError> {
        let Some(buffer) = alloc.alloc() else {
            return Err(IoError::NoBuffer { name: port.name().to_string(), offset: offset.unwrap_or(port.offset()) });
        };
        let pending = Pending::Read { buffer, name: port.name().to_string(), offset };
        self.start(Request { tag, fd: port.as_fd().as_raw_fd(), pending })
    }

    /// Write `chunk` to `port` at `offset` (`None`: at the file position,
    /// for pipes and sockets), consuming it: its buffer is back in its
    /// allocator when the completion is collected. Short writes are
    /// continued.
    pub fn submit_write(
        &mut self,
        port: &Port,
        offset: Option<u64>,
        chunk: impl Into<Chunk>,
        tag: u64,
    ) -> Result<(), IoError> {
        let pending = Pending::Write { chunk: chunk.into(), name: port.name().to_string(), offset, written: 0 };
        self.start(Request { tag, fd: port.as_fd().as_raw_fd(), pending })
    }

    fn start(&mut self, mut req: Request) -> Result<(), IoError> {
        while self.in_flight.len() >= self.capacity {
            self.reap(true)?;
        }
        if self.uring.is_none() {
            let c = run_blocking(req);
            self.ready.push_back(c);
            self.signal();
            return Ok(());
        }
        let id = self.next_id;
        self.next_id += 1;
        let sqe = self.sqe(&mut req).user_data(id);
        self.in_flight.insert(id, req);
        self.push(sqe)
    }

    fn push(&mut self, sqe: io_uring::squeue::Entry) -> Result<(), IoError> {
        let uring = self.uring.as_mut().expect("io_uring mode");
        // SAFETY: the entry's buffer belongs to a request in `in_flight`,
        // which keeps it (and its mapping) alive and untouched by us until
        // its completion is reaped; the fd is the caller's to keep open.
        while unsafe { uring.submission().push(&sqe) }.is_err() {
            uring.submit().map_err(|e| ring_err("submit", e))?;
        }
        uring.submit().map_err(|e| ring_err("submit", e))?;
        Ok(())
    }

    fn sqe(&self, req: &mut Request) -> io_uring::squeue::Entry {
        let fixed = self.fixed_pool();
        let fd = types::Fd(req.fd);
        match &mut req.pending {
            Pending::Read { buffer, offset, .. } => {
                let off = offset.unwrap_or(u64::MAX);
                let len = buffer.len() as u32;
                let index = buffer.id().index;
                let in_pool = fixed == Some(buffer.id().pool);
                // A buffer fresh from the allocator is read-write.
                let ptr = buffer.as_mut_slice().map(|s| s.as_mut_ptr()).unwrap_or(std::ptr::null_mut());
                if in_pool {
                    opcode::ReadFixed::new(fd, ptr, len, index as u16).offset(off).build()
                } else {
                    opcode::Read::new(fd, ptr, len).offset(off).build()
                }
            }
            Pending::Write { chunk, offset, written, .. } => {
                let done = *written as usize;
                let off = offset.map(|o| o + done as u64).unwrap_or(u64::MAX);
                let bytes = &chunk.bytes()[done..];
                let index = chunk.buffer_id().index;
                if fixed == Some(chunk.buffer_id().pool) {
                    opcode::WriteFixed::new(fd, bytes.as_ptr(), bytes.len() as u32, index as u16).offset(off).build()
                } else {
                    opcode::Write::new(fd, bytes.as_ptr(), bytes.len() as u32).offset(off).build()
                }
            }
        }
    }

    fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.eventfd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Take the kernel's completions into `ready`; with `wait`, wait for
    /// at least one first.
    fn reap(&mut self, wait: bool) -> Result<(), IoError> {
        let Some(uring) = self.uring.as_mut() else { return Ok(()) };
        if wait && !self.in_flight.is_empty() {
            match uring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => return Err(ring_err("wait", e)),
            }
        }
        let cqes: Vec<(u64, i32)> = uring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (id, res) in cqes {
            let Some(req) = self.in_flight.remove(&id) else { continue };
            match finish(req, res) {
                Ok(c) => self.ready.push_back(c),
                Err(mut req) => {
                    // A short write: the rest goes out as a new request.
                    let sqe = self.sqe(&mut req).user_data(id);
                    self.in_flight.insert(id, req);
                    self.push(sqe)?;
                }
            }
        }
        Ok(())
    }

    /// The completions finished so far (none waiting: an empty vector);
    /// clears the eventfd, which becomes readable again at the next one.
    pub fn completions(&mut self) -> Result<Vec<Completion>, IoError> {
        let mut n = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
        unsafe { libc::read(self.eventfd.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
        self.reap(false)?;
        Ok(self.ready.drain(..).collect())
    }

    /// Wait until at least one completion is there or `timeout` passes
    /// (`None`: no limit), then take them all.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<Vec<Completion>, IoError> {
        let ms = timeout.map(|t| t.as_millis().min(i32::MAX as u128) as i32).unwrap_or(-1);
        loop {
            let got = self.completions()?;
            if !got.is_empty() || self.in_flight.is_empty() {
                return Ok(got);
            }
            let mut pfd = libc::pollfd { fd: self.eventfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r == 0 {
                return Ok(Vec::new());
            }
        }
    }
}

/// The outcome of a completion with result `res`; the request back when a
/// short write needs another request for the rest.
fn finish(mut req: Request, res: i32) -> Result<Completion, Request> {
    let tag = req.tag;
    match req.pending {
        Pending::Read { buffer, name, offset } => {
            if res < 0 {
                drop(buffer); // back to its allocator before the error is seen
                let e = io::Error::from_raw_os_error(-res);
                return Ok(Completion { tag, result: Err(IoError::from_os(&name, "read", offset.unwrap_or(0), e)) });
            }
            Ok(Completion { tag, result: Ok(Done::Read(Filled { buffer, len: res as usize })) })
        }
        Pending::Write { chunk, name, offset, written } => {
            if res < 0 || (res == 0 && !chunk.is_empty()) {
                let e = if res < 0 { io::Error::from_raw_os_error(-res) } else { io::ErrorKind::WriteZero.into() };
                drop(chunk);
                return Ok(Completion {
                    tag,
                    result: Err(IoError::from_os(&name, "write", offset.unwrap_or(0) + written, e)),
                });
            }
            let written = written + res as u64;
            if (written as usize) < chunk.len() {
                req.pending = Pending::Write { chunk, name, offset, written };
                return Err(req);
            }
            Ok(Completion { tag, result: Ok(Done::Written(written)) })
        }
    }
}

/// A request run at once with `pread`/`pwrite` (or `read`/`write` at the
/// file position): the blocking fallback.
fn run_blocking(mut req: Request) -> Completion {
    loop {
        let res = match &mut req.pending {
            Pending::Read { buffer, offset, .. } => {
                let len = buffer.len();
                match buffer.as_mut_slice() {
                    // A buffer fresh from the allocator is read-write; were it
                    // not, the read fails as the kernel would fail a busy one.
                    Err(_) => {
                        // SAFETY: sets this thread's errno, read just below.
                        unsafe { *libc::__errno_location() = libc::EBUSY };
                        -1
                    }
                    Ok(s) => {
                        let ptr = s.as_mut_ptr();
                        match offset {
                            // SAFETY: `ptr..ptr+len` is the request's own buffer,
                            // owned read-write; the kernel writes at most `len` bytes.
                            Some(o) => unsafe { libc::pread(req.fd, ptr.cast(), len, *o as libc::off_t) },
                            // SAFETY: as above.
                            None => unsafe { libc::read(req.fd, ptr.cast(), len) },
                        }
                    }
                }
            }
            Pending::Write { chunk, offset, written, .. } => {
                let b = &chunk.bytes()[*written as usize..];
                match offset {
                    // SAFETY: `b` is the chunk's live memory, only read by the kernel.
                    Some(o) => unsafe {
                        libc::pwrite(req.fd, b.as_ptr().cast(), b.len(), (*o + *written) as libc::off_t)
                    },
                    // SAFETY: as above.
                    None => unsafe { libc::write(req.fd, b.as_ptr().cast(), b.len()) },
                }
            }
        };
        let res = if res < 0 {
            let errno = io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            if errno == libc::EINTR {
                continue;
            }
            -errno
        } else {
            res as i32
        };
        match finish(req, res) {
            Ok(c) => return c,
            Err(again) => req = again,
        }
    }
}

impl AsFd for Ring {
    /// The eventfd: readable while completions wait to be collected.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.eventfd.as_fd()
    }
}

impl Drop for Ring {
    /// Waits for the requests in flight (the kernel may still be using
    /// their buffers), then returns their buffers.
    fn drop(&mut self) {
        while !self.in_flight.is_empty() {
            if self.reap(true).is_err() {
                // The kernel will not say when it is done with them: keep
                // the buffers out of use rather than hand them out again.
                for (_, req) in self.in_flight.drain() {
                    std::mem::forget(req);
                }
                break;
            }
        }
    }
}
