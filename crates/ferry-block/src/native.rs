//! The block service over Ferry channels: [`BlockClient`] and
//! [`serve_channel`].
//!
//! As in the network block service of the ETH bulk-transfer specification,
//! the client is the transmit master: it assigns a pool of its own to the
//! channel and moves a buffer to the server for every request, the request
//! in the buffer's meta data. For a write the buffer holds the data; for a
//! read the server fills it from the store. The server passes every buffer
//! back with the reply in its meta data (a write's buffer unfilled: its
//! bytes need not travel back). Many requests may be in flight, matched by
//! request id. Local clients reach the server over shared memory (or
//! between threads), remote ones over TCP; the code is the same. (Over
//! TCP a read costs its buffer's size twice: a move carries the buffer's
//! bytes, so the empty buffer travels to the server before it comes back
//! filled. Between threads and processes of one host only descriptors
//! travel.)
//!
//! [`run_proxy`] is the client proxy: user domains of one host reach it
//! over shared memory, and it forwards their requests over one channel to
//! a remote server, their own buffers moved on as they came.
//!
//! Request meta data (24 bytes, little-endian): op (1 byte), flags (1
//! byte; bit 0 FUA), 2 bytes zero, length (u32), request id (u64),
//! offset (u64). Reply meta data (16 bytes): request id (u64), status
//! (u32: 0 or an errno value), and for `INFO` the store size in a second
//! u64.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use ferry::{Domain, Endpoint};
//! use ferry_block::{serve_channel, BlockClient, MemStore, Store};
//!
//! let t = Duration::from_secs(10);
//! let ep = Endpoint::local();
//! let store: Arc<dyn Store> = Arc::new(MemStore::new(1 << 20)?);
//! let server = {
//!     let (ep, store) = (ep.clone(), store.clone());
//!     std::thread::spawn(move || serve_channel(&Domain::new("block server"), &ep, &*store, t))
//! };
//! let mut client = BlockClient::connect(&Domain::new("app"), &ep, 8, 64 << 10, t)?;
//! assert_eq!(client.size(), 1 << 20);
//! client.write(4096, b"through Ferry")?;
//! client.flush()?;
//! let mut back = [0u8; 13];
//! client.read(4096, &mut back)?;
//! assert_eq!(&back, b"through Ferry");
//! drop(client);
//! server.join().unwrap()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, Buffer, Channel, ChannelSetup, Direction, Domain, Endpoint, Event, PoolConstraints,
    PoolPolicy, Role,
};

use crate::store::Store;
use crate::Error;

/// Bytes of request meta data.
const REQUEST_META: usize = 24;
/// Meta size of the channel (the larger of request and reply).
const META_SIZE: usize = 24;

const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const EIO: u32 = 5;

/// A request of the block service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// The store's size (connect asks it).
    Info = 0,
    /// Fill the buffer from the store.
    Read = 1,
    /// Write the buffer to the store.
    Write = 2,
    /// Put every answered write on stable storage.
    Flush = 3,
    /// The range is no longer needed.
    Trim = 4,
    /// The range reads as zeroes.
    WriteZeroes = 5,
}

impl Op {
    fn from_u8(b: u8) -> Option<Op> {
        Some(match b {
            0 => Op::Info,
            1 => Op::Read,
            2 => Op::Write,
            3 => Op::Flush,
            4 => Op::Trim,
            5 => Op::WriteZeroes,
            _ => return None,
        })
    }
}

fn request_meta(op: Op, fua: bool, len: u32, id: u64, offset: u64) -> [u8; REQUEST_META] {
    let mut m = [0u8; REQUEST_META];
    m[0] = op as u8;
    m[1] = u8::from(fua);
    m[4..8].copy_from_slice(&len.to_le_bytes());
    m[8..16].copy_from_slice(&id.to_le_bytes());
    m[16..24].copy_from_slice(&offset.to_le_bytes());
    m
}

fn reply_meta(id: u64, status: u32, extra: u64) -> [u8; 24] {
    let mut m = [0u8; 24];
    m[..8].copy_from_slice(&id.to_le_bytes());
    m[8..12].copy_from_slice(&status.to_le_bytes());
    m[16..24].copy_from_slice(&extra.to_le_bytes());
    m
}

/// What a served channel did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChannelSummary {
    /// Requests answered (errors included).
    pub requests: u64,
    /// Bytes read from the store into the client's buffers.
    pub read_bytes: u64,
    /// Bytes written to the store from the client's buffers.
    pub write_bytes: u64,
    /// Requests answered with an error.
    pub errors: u64,
}

/// Wait for one client on `endpoint` (the server creates the channel, as
/// the receiving slave) and serve it until it closes the channel or goes
/// away. `timeout` bounds the wait for the client.
pub fn serve_channel(
    domain: &Domain,
    endpoint: &Endpoint,
    store: &dyn Store,
    timeout: Duration,
) -> Result<ChannelSummary, Error> {
    let ch = accept_client(domain, endpoint, timeout)?;
    serve_client(ch, store)
}

/// Wait for one client on `endpoint`: the channel the server end of the
/// block service needs (receiving slave, pools of the client accepted).
pub fn accept_client(domain: &Domain, endpoint: &Endpoint, timeout: Duration) -> Result<Channel, Error> {
    let setup =
        ChannelSetup { direction: Direction::Rx, role: Role::Slave, meta_size: META_SIZE, ..ChannelSetup::default() };
    let mut ch = Channel::accept(domain, endpoint, setup, timeout)?;
    ch.set_pool_policy(PoolPolicy::AcceptAll);
    Ok(ch)
}

/// Serve the client of a channel [`accept_client`] gave until it closes
/// the channel or goes away.
pub fn serve_client(mut ch: Channel, store: &dyn Store) -> Result<ChannelSummary, Error> {
    let mut summary = ChannelSummary::default();
    loop {
        match ch.wait(Some(Duration::from_secs(1))) {
            Some(Event::MoveReceived { mut buffer, meta }) => {
                let (status, extra, fill) = execute(store, &mut buffer, &meta, &mut summary);
                summary.requests += 1;
                if status != 0 {
                    summary.errors += 1;
                }
                let id = meta.get(8..16).map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
                let reply = reply_meta(id, status, extra);
                let mut buf = buffer;
                loop {
                    let sent = if fill { ch.pass(buf, &reply) } else { ch.pass_unfilled(buf, &reply) };
                    match sent {
                        Ok(()) => break,
                        Err(r) if r.error == ferry::Error::QueueFull => {
                            buf = r.into_inner();
                            std::thread::yield_now();
                        }
                        Err(r) => return Err(r.error.into()),
                    }
                }
            }
            Some(Event::Closed { .. }) => return Ok(summary),
            // The client went away: what it asked for is done or not, as
            // answered; nothing is left for this channel to do.
            Some(Event::Error(_)) => return Ok(summary),
            Some(_) | None => {}
        }
    }
}

/// Carry out one request on `buffer`: (status, extra reply value, whether
/// the buffer's bytes go back).
fn execute(store: &dyn Store, buffer: &mut Buffer, meta: &[u8], summary: &mut ChannelSummary) -> (u32, u64, bool) {
    if meta.len() < REQUEST_META || meta[2..4] != [0, 0] || meta[1] & !1 != 0 {
        return (EINVAL, 0, false);
    }
    let Some(op) = Op::from_u8(meta[0]) else { return (EINVAL, 0, false) };
    let fua = meta[1] & 1 != 0;
    let len = u32::from_le_bytes(meta[4..8].try_into().expect("4 bytes")) as u64;
    let offset = u64::from_le_bytes(meta[16..24].try_into().expect("8 bytes"));
    let in_bounds = offset.checked_add(len).is_some_and(|end| end <= store.size());
    let errno = |e: std::io::Error| match e.raw_os_error() {
        Some(22) => EINVAL,
        Some(28) => ENOSPC,
        _ => EIO,
    };
    match op {
        Op::Info => (0, store.size(), false),
        Op::Flush => (store.flush().map_or_else(errno, |()| 0), 0, false),
        _ if len > buffer.len() as u64 && matches!(op, Op::Read | Op::Write) => (EINVAL, 0, false),
        Op::Read | Op::Trim if !in_bounds => (EINVAL, 0, false),
        Op::Write | Op::WriteZeroes if !in_bounds => (ENOSPC, 0, false),
        Op::Read => match buffer.as_mut_slice() {
            Ok(mem) => match store.read_at(offset, &mut mem[..len as usize]) {
                Ok(()) => {
                    summary.read_bytes += len;
                    (0, 0, true)
                }
                Err(e) => (errno(e), 0, false),
            },
            Err(_) => (EIO, 0, false),
        },
        Op::Write => match store.write_at(offset, &buffer[..len as usize], fua) {
            Ok(()) => {
                summary.write_bytes += len;
                (0, 0, false)
            }
            Err(e) => (errno(e), 0, false),
        },
        Op::Trim => (store.trim(offset, len, fua).map_or_else(errno, |()| 0), 0, false),
        Op::WriteZeroes => (store.write_zeroes(offset, len, true, fua).map_or_else(errno, |()| 0), 0, false),
    }
}

/// A finished request.
#[derive(Debug)]
pub struct Completion {
    /// The id [`BlockClient::submit`] returned.
    pub id: u64,
    /// What it was.
    pub op: Op,
    /// `Ok` or the server's errno value.
    pub status: Result<(), u32>,
    /// The buffer, back: for a read it holds the data from its start.
    pub buffer: Buffer,
    /// Bytes the request covered.
    pub len: usize,
}

/// A client of the block service over one Ferry channel: a pool of its own
/// buffers, requests moved to the server, replies matched by request id.
pub struct BlockClient {
    ch: Channel,
    alloc: Allocator,
    size: u64,
    next_id: u64,
    /// Request id → (op, length) of every request in flight.
    inflight: HashMap<u64, (Op, usize)>,
    timeout: Duration,
    /// The extra value of the last reply (the size, for INFO).
    last_extra: u64,
}

impl BlockClient {
    /// Connect to a server on `endpoint` with a pool of `buffers` buffers
    /// of `buffer_size` bytes (the largest request; a power of two, a
    /// multiple of the page size). `timeout` bounds every wait.
    pub fn connect(
        domain: &Domain,
        endpoint: &Endpoint,
        buffers: u64,
        buffer_size: usize,
        timeout: Duration,
    ) -> Result<BlockClient, Error> {
        let params = BindParams { role: Role::Master, max_meta_size: META_SIZE, ..BindParams::default() };
        let mut ch = Channel::connect(domain, endpoint, params, timeout)?;
        let alloc = Allocator::new(domain, buffers, buffer_size, PoolConstraints::default())?;
        ch.assign_pool_and_wait(alloc.pool(), timeout)?;
        let mut client =
            BlockClient { ch, alloc, size: 0, next_id: 1, inflight: HashMap::new(), timeout, last_extra: 0 };
        let buf = client.free_buffer()?;
        let id = client.send(Op::Info, buf, 0, 0, false)?;
        let c = client.wait_for(id)?;
        c.status.map_err(Error::Remote)?;
        client.size = client.last_extra;
        Ok(client)
    }

    /// Size of the store in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// A free buffer of the client's pool (to fill for a write), or `None`
    /// while all are in flight or held.
    pub fn buffer(&self) -> Option<Buffer> {
        self.alloc.alloc()
    }

    fn free_buffer(&mut self) -> Result<Buffer, Error> {
        self.alloc.alloc().ok_or(Error::NoBuffer)
    }

    fn send(&mut self, op: Op, buffer: Buffer, offset: u64, len: usize, fua: bool) -> Result<u64, Error> {
        if len > buffer.len() {
            return Err(Error::BadSpec(format!(
                "a request of {len} bytes does not fit a {}-byte buffer",
                buffer.len()
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        let meta = request_meta(op, fua, len as u32, id, offset);
        let mut buf = buffer;
        let deadline = Instant::now() + self.timeout;
        loop {
            match self.ch.move_buffer(buf, &meta) {
                Ok(()) => break,
                Err(r) if r.error == ferry::Error::QueueFull && Instant::now() < deadline => {
                    buf = r.into_inner();
                    std::thread::yield_now();
                }
                Err(r) => return Err(r.error.into()),
            }
        }
        self.inflight.insert(id, (op, len));
        Ok(id)
    }

    /// Submit a request on `buffer` (the data of a write, the space of a
    /// read): its id, to match its [`Completion`].
    pub fn submit(&mut self, op: Op, buffer: Buffer, offset: u64, len: usize, fua: bool) -> Result<u64, Error> {
        self.send(op, buffer, offset, len, fua)
    }

    /// The next completion (of any request in flight), waiting up to the
    /// client's timeout.
    pub fn complete(&mut self) -> Result<Completion, Error> {
        if self.inflight.is_empty() {
            return Err(Error::BadSpec("no request in flight".into()));
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::TimedOut);
            }
            match self.ch.wait(Some(left)) {
                Some(Event::BufferPassed { buffer, meta }) => {
                    if meta.len() < 24 {
                        return Err(Error::Protocol("a reply without its meta data".into()));
                    }
                    let id = u64::from_le_bytes(meta[..8].try_into().expect("8 bytes"));
                    let status = u32::from_le_bytes(meta[8..12].try_into().expect("4 bytes"));
                    self.last_extra = u64::from_le_bytes(meta[16..24].try_into().expect("8 bytes"));
                    let Some((op, len)) = self.inflight.remove(&id) else {
                        return Err(Error::Protocol(format!("a reply to request {id}, which is not in flight")));
                    };
                    let status = if status == 0 { Ok(()) } else { Err(status) };
                    return Ok(Completion { id, op, status, buffer, len });
                }
                Some(Event::Error(e)) => return Err(e.into()),
                Some(Event::Closed { .. }) => return Err(Error::Protocol("the server closed the channel".into())),
                Some(_) | None => {}
            }
        }
    }

    fn wait_for(&mut self, id: u64) -> Result<Completion, Error> {
        loop {
            let c = self.complete()?;
            if c.id == id {
                return Ok(c);
            }
        }
    }

    /// Read `out.len()` bytes from `offset` (in requests of at most a
    /// buffer each, all in flight at once as far as buffers allow).
    pub fn read(&mut self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        let step = self.alloc.pool().geometry().buffer_size();
        let mut pending: HashMap<u64, usize> = HashMap::new();
        let mut next = 0usize;
        let mut first_error = None;
        while next < out.len() || !pending.is_empty() {
            if next < out.len() {
                if let Some(buf) = self.alloc.alloc() {
                    let n = step.min(out.len() - next);
                    let id = self.send(Op::Read, buf, offset + next as u64, n, false)?;
                    pending.insert(id, next);
                    next += n;
                    continue;
                }
            }
            let c = self.complete()?;
            if let Some(at) = pending.remove(&c.id) {
                match c.status {
                    Ok(()) => out[at..at + c.len].copy_from_slice(&c.buffer[..c.len]),
                    Err(e) => first_error = first_error.or(Some(e)),
                }
            }
        }
        first_error.map_or(Ok(()), |e| Err(Error::Remote(e)))
    }

    /// Write `data` at `offset` (FUA with `fua`), in requests of at most a
    /// buffer each.
    pub fn write_fua(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), Error> {
        let step = self.alloc.pool().geometry().buffer_size();
        let mut pending = 0usize;
        let mut next = 0usize;
        let mut first_error = None;
        while next < data.len() || pending > 0 {
            if next < data.len() {
                if let Some(mut buf) = self.alloc.alloc() {
                    let n = step.min(data.len() - next);
                    buf.as_mut_slice()?[..n].copy_from_slice(&data[next..next + n]);
                    self.send(Op::Write, buf, offset + next as u64, n, fua)?;
                    pending += 1;
                    next += n;
                    continue;
                }
            }
            let c = self.complete()?;
            pending -= 1;
            if let Err(e) = c.status {
                first_error = first_error.or(Some(e));
            }
        }
        first_error.map_or(Ok(()), |e| Err(Error::Remote(e)))
    }

    /// Write `data` at `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.write_fua(offset, data, false)
    }

    fn control(&mut self, op: Op, offset: u64, len: u64) -> Result<(), Error> {
        let len = u32::try_from(len).map_err(|_| Error::BadSpec("at most 4 GiB less one byte per request".into()))?;
        let buf = self.free_buffer()?;
        let id = self.next_id;
        self.next_id += 1;
        let meta = request_meta(op, false, len, id, offset);
        self.ch.move_buffer(buf, &meta).map_err(|r| Error::from(r.error))?;
        self.inflight.insert(id, (op, 0));
        self.wait_for(id)?.status.map_err(Error::Remote)
    }

    /// Put every answered write on stable storage.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.control(Op::Flush, 0, 0)
    }

    /// The range is no longer needed (it reads as zeroes after).
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<(), Error> {
        self.control(Op::Trim, offset, len)
    }

    /// The range reads as zeroes.
    pub fn write_zeroes(&mut self, offset: u64, len: u64) -> Result<(), Error> {
        self.control(Op::WriteZeroes, offset, len)
    }
}

impl Drop for BlockClient {
    fn drop(&mut self) {
        let _ = self.ch.teardown();
    }
}

/// Handles on the proxy's local clients, for [`run_proxy`].
type Users = Vec<(Channel, Vec<ferry::PoolId>)>;

/// The client proxy of the block service: user domains on this host
/// connect to `local` (shared memory) with a [`BlockClient`]; the proxy
/// forwards every request over one channel to the server at `remote`
/// (over TCP) and every reply back to the user it belongs to.
///
/// Nothing is copied on the way: each user's pool is accepted by the proxy
/// and assigned onward to the server's channel, a request's buffer is moved
/// on as it came, and the reply's buffer (recognised by its pool) is passed
/// back to its user. Runs until `stop` returns true (checked between
/// events), or the server's channel fails.
pub fn run_proxy(
    domain: &Domain,
    local: &Endpoint,
    remote: &Endpoint,
    timeout: Duration,
    stop: impl Fn() -> bool,
) -> Result<(), Error> {
    let params = BindParams { role: Role::Master, max_meta_size: META_SIZE, ..BindParams::default() };
    let mut upstream = Channel::connect(domain, remote, params, timeout)?;
    let (tx, rx) = std::sync::mpsc::channel::<Channel>();
    let running = Arc::new(AtomicBool::new(true));
    // Stops the accepting thread however this function returns.
    struct Stop(Arc<AtomicBool>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Relaxed);
        }
    }
    let _stop = Stop(running.clone());
    {
        let (domain, local) = (domain.clone(), local.clone());
        std::thread::Builder::new()
            .name("block proxy accept".into())
            .spawn(move || loop {
                let setup = ChannelSetup {
                    direction: Direction::Rx,
                    role: Role::Slave,
                    meta_size: META_SIZE,
                    ..ChannelSetup::default()
                };
                match Channel::accept(&domain, &local, setup, Duration::from_secs(1)) {
                    Ok(ch) => {
                        if tx.send(ch).is_err() {
                            return;
                        }
                    }
                    // Nobody came (or a client failed during setup).
                    Err(_) => {
                        if !running.load(Ordering::Relaxed) {
                            return;
                        }
                    }
                }
            })
            .map_err(|e| Error::Io { what: "cannot start the proxy's accepting thread".into(), source: e })?;
    }
    let mut users: Users = Vec::new();
    while !stop() {
        while let Ok(ch) = rx.try_recv() {
            users.push((ch, Vec::new()));
        }
        let mut did = false;
        let mut i = 0;
        while i < users.len() {
            let mut gone = false;
            while let Some(ev) = users[i].0.poll() {
                did = true;
                match ev {
                    Event::PoolAssignRequest(req) => {
                        users[i].0.respond_pool(req.pool, true)?;
                        let pool =
                            domain.pool(req.pool).ok_or_else(|| Error::Protocol("accepted pool missing".into()))?;
                        upstream.assign_pool(&pool)?;
                        wait_assigned(&mut upstream, &mut users, req.pool, timeout)?;
                        users[i].1.push(req.pool);
                    }
                    Event::MoveReceived { buffer, meta } => {
                        let mut buf = buffer;
                        loop {
                            match upstream.move_buffer(buf, &meta) {
                                Ok(()) => break,
                                Err(r) if r.error == ferry::Error::QueueFull => {
                                    buf = r.into_inner();
                                    std::thread::yield_now();
                                }
                                Err(r) => return Err(r.error.into()),
                            }
                        }
                    }
                    Event::Closed { .. } | Event::Error(_) => {
                        gone = true;
                        break;
                    }
                    _ => {}
                }
            }
            if gone {
                let (_, pools) = users.swap_remove(i);
                for p in pools {
                    let _ = upstream.remove_pool(p);
                }
            } else {
                i += 1;
            }
        }
        while let Some(ev) = upstream.poll() {
            did = true;
            route(ev, &mut users)?;
        }
        if !did {
            if let Some(ev) = upstream.wait(Some(Duration::from_millis(1))) {
                route(ev, &mut users)?;
            }
        }
    }
    Ok(())
}

/// Hand an event of the server's channel on: a reply's buffer goes back to
/// the user whose pool it is.
fn route(ev: Event, users: &mut Users) -> Result<(), Error> {
    match ev {
        Event::BufferPassed { buffer, meta } => {
            let pool = buffer.id().pool;
            let Some((user, _)) = users.iter_mut().find(|(_, pools)| pools.contains(&pool)) else {
                // Its user has gone: the buffer stays here and is freed.
                return Ok(());
            };
            let mut buf = buffer;
            loop {
                match user.pass(buf, &meta) {
                    Ok(()) => return Ok(()),
                    Err(r) if r.error == ferry::Error::QueueFull => {
                        buf = r.into_inner();
                        std::thread::yield_now();
                    }
                    // The user is going away: its buffer is freed here.
                    Err(_) => return Ok(()),
                }
            }
        }
        Event::Error(e) => Err(e.into()),
        Event::Closed { .. } => Err(Error::Protocol("the block server closed the channel".into())),
        _ => Ok(()),
    }
}

/// Wait for the server to accept `pool`, routing replies meanwhile.
fn wait_assigned(
    upstream: &mut Channel,
    users: &mut Users,
    pool: ferry::PoolId,
    timeout: Duration,
) -> Result<(), Error> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        match upstream.wait(Some(deadline.saturating_duration_since(Instant::now()))) {
            Some(Event::PoolAssigned(p)) if p == pool => return Ok(()),
            Some(Event::PoolVetoed(p)) if p == pool => {
                return Err(Error::Protocol("the block server refused a client's pool".into()))
            }
            Some(ev) => route(ev, users)?,
            None => {}
        }
    }
    Err(Error::TimedOut)
}
