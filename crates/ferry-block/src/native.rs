//! The block service over Ferry channels: [`BlockClient`] and
//! [`serve_channel`](crate::serve_channel).
//!
//! As in the network block service of the ETH bulk-transfer specification,
//! the client is the transmit master of its request channel: it assigns
//! two pools of its own — data buffers (the largest request each) and
//! small request buffers of 4 KiB — and moves a buffer to the server for
//! every request, the request in the buffer's meta data. A write moves a
//! data buffer holding the data; the server passes it back unfilled (its
//! bytes need not travel back) with the reply in the meta data. Requests
//! that carry no data (`INFO`, `FLUSH`, `TRIM`, `WRITE_ZEROES`) travel in
//! a request buffer, answered the same way.
//!
//! Reads come back in buffers the server fills:
//!
//! * Over TCP the server is the transmit master of a second channel, the
//!   read-data channel, which the client binds when it connects: the server
//!   assigns a pool of its own for the client (as many buffers as the
//!   client's, as large), and for each read fills one of them from the
//!   store and moves it to the client, the reply in its meta data. The
//!   client takes the data and passes the buffer back unfilled
//!   ([`BlockClient::recycle`]): no payload. The read requests themselves
//!   are descriptors packed into a request buffer (up to 170 in one, sent
//!   when the client waits for a completion and none is ready, or when it
//!   is full), which the server passes back unfilled. So a read's bytes
//!   cross the network once, and a request costs a share of 4 KiB.
//! * Between threads and processes of one host the buffers' memory is
//!   shared and only descriptors travel: a read moves a data buffer of the
//!   client's, which the server fills in place and passes back.
//!
//! Over TCP both channels take the endpoint's [`NetOptions`] and so its
//! security ([`BlockClient::connect`] and
//! [`serve_endpoint`](crate::serve_endpoint) with a TCP endpoint, or
//! [`BlockClient::connect_tcp`] and [`serve_tcp`](crate::serve_tcp) with
//! an address and options): with
//! [`Security::Tls`](ferry::tls::Security::Tls) every request, payload and
//! reply goes through TLS 1.3 with mutual certificate authentication
//! (the server's certificate checked against the CA and the name, the
//! client's against the CA), the read-data channel as well.
//!
//! Many requests may be in flight, matched by request id, answered in the
//! order they are done. The server ([`crate::server`]) serves all clients
//! of an endpoint from one thread.
//!
//! [`run_proxy`] is the client proxy: user domains of one host reach it
//! over shared memory, and it forwards their requests over one channel to
//! a remote server, their own buffers moved on as they came. A read
//! through the proxy crosses TCP twice: the user's buffer goes to the
//! server (its old bytes with it) and comes back filled. Why, and what
//! would avoid it:
//!
//! * The proxy forwards the user's buffer with a move, and over TCP a move
//!   carries its buffer's bytes — all of the pool's buffer size, whatever
//!   the request's length — because a move hands the sink the contents;
//!   the TCP wire format refuses a move without its payload. Only a pass
//!   may go without its bytes ([`ferry::Channel::pass_unfilled`]), and the
//!   proxy is the source on its server channel, so it cannot pass.
//! * The direct TCP client avoids the crossing with packed read
//!   descriptors and the server's read-data channel. The proxy could do
//!   the same upstream, but the data would then arrive in buffers of the
//!   server's pool, in the proxy's private memory, while the user waits
//!   for its own shared-memory buffer: either the proxy copies the bytes
//!   over (one memory copy in place of a second network crossing), or it
//!   becomes the transmit master of a second channel to every user and
//!   hands it the server's buffers — which live in memory of the TCP
//!   backend's own mapping, not shared with the user.
//! * The cheapest fix is a move whose contents do not matter to the sink
//!   (a `move_unfilled` mirroring `pass_unfilled`; the wire format would
//!   accept a move without payload): the proxy would forward read
//!   requests without their bytes, and a read's bytes would cross TCP
//!   once, as for a direct client. That is a change to the Ferry library's
//!   channel API and TCP wire format.
//!
//! Request meta data (24 bytes, little-endian): op (1 byte: 0 `INFO`, 1
//! `READ`, 2 `WRITE`, 3 `FLUSH`, 4 `TRIM`, 5 `WRITE_ZEROES`, 6 packed
//! reads), flags (1 byte; bit 0 FUA, bit 1 with `INFO`: the client wants
//! a read-data channel), 2 bytes zero, length (u32), request id (u64),
//! offset (u64). `INFO` gives the client's buffer size as its length and
//! its buffer count as its offset. Packed reads: the length is the number
//! of descriptors at the start of the request buffer, each laid out as a
//! request's meta data (op `READ`). Reply meta data (24 bytes): request id
//! (u64), status (u32: 0 or an errno value), for `INFO` the TCP port of
//! the read-data channel (u32, 0 for none), and for `INFO` the store size,
//! for a read on the read-data channel its length (u64).
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

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, Buffer, Channel, ChannelSetup, Direction, Domain, Endpoint, Event, LinkStats, NetOptions,
    PoolConstraints, PoolPolicy, Role,
};

use crate::Error;

/// Bytes of request meta data.
pub(crate) const REQUEST_META: usize = 24;
/// Meta size of the channel (the larger of request and reply).
pub(crate) const META_SIZE: usize = 24;
/// Bytes of one read descriptor in a request buffer.
pub(crate) const DESCRIPTOR: usize = 24;
/// Request flag: the client wants a read-data channel (with `INFO`).
pub(crate) const FLAG_DATA_CHANNEL: u8 = 2;
/// The op of a request buffer that carries read descriptors.
pub(crate) const OP_READ_BATCH: u8 = 6;
/// Size of a request buffer (the smallest a pool has).
const REQUEST_BUFFER: usize = 4096;
/// Request buffers of a client.
const REQUEST_BUFFERS: u64 = 64;

pub(crate) const EINVAL: u32 = 22;
pub(crate) const ENOSPC: u32 = 28;
pub(crate) const EIO: u32 = 5;

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
    pub(crate) fn from_u8(b: u8) -> Option<Op> {
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
    request_meta_flags(op, u8::from(fua), len, id, offset)
}

fn request_meta_flags(op: Op, flags: u8, len: u32, id: u64, offset: u64) -> [u8; REQUEST_META] {
    request_meta_flags_op(op as u8, flags, len, id, offset)
}

fn request_meta_flags_op(op: u8, flags: u8, len: u32, id: u64, offset: u64) -> [u8; REQUEST_META] {
    let mut m = [0u8; REQUEST_META];
    m[0] = op;
    m[1] = flags;
    m[4..8].copy_from_slice(&len.to_le_bytes());
    m[8..16].copy_from_slice(&id.to_le_bytes());
    m[16..24].copy_from_slice(&offset.to_le_bytes());
    m
}

pub(crate) fn reply_meta(id: u64, status: u32, extra: u64) -> [u8; 24] {
    let mut m = [0u8; 24];
    m[..8].copy_from_slice(&id.to_le_bytes());
    m[8..12].copy_from_slice(&status.to_le_bytes());
    m[16..24].copy_from_slice(&extra.to_le_bytes());
    m
}

/// A finished request.
#[derive(Debug)]
pub struct Completion {
    /// The id [`BlockClient::submit`] or [`BlockClient::submit_read`] returned.
    pub id: u64,
    /// What it was.
    pub op: Op,
    /// `Ok` or the server's errno value.
    pub status: Result<(), u32>,
    /// The buffer, back: for a read it holds the data from its start. A
    /// read's buffer may be the server's (over TCP): give it back with
    /// [`BlockClient::recycle`] once the data is taken.
    pub buffer: Buffer,
    /// Bytes the request covered.
    pub len: usize,
}

/// A client of the block service over one Ferry channel (and, over TCP,
/// a second one for read data): a pool of its own buffers, requests moved
/// to the server, replies matched by request id.
pub struct BlockClient {
    ch: Channel,
    /// The read-data channel (TCP): the server moves reads' buffers here.
    data: Option<Channel>,
    alloc: Allocator,
    requests: Allocator,
    /// The request buffer being filled with read descriptors, and how many.
    batch: Option<(Buffer, usize)>,
    size: u64,
    next_id: u64,
    /// Request id → (op, length) of every request in flight.
    inflight: HashMap<u64, (Op, usize)>,
    timeout: Duration,
    /// The extra value of the last reply (the size, for INFO).
    last_extra: u64,
    /// Buffers of the server's read-data pool.
    server_buffers: usize,
    /// Reads in flight on the read-data channel plus server buffers held.
    server_out: usize,
    /// Completions taken while waiting for something else, in order.
    stash: VecDeque<(Completion, Option<u16>)>,
}

impl BlockClient {
    /// Connect to a server on `endpoint` with a pool of `buffers` buffers
    /// of `buffer_size` bytes (the largest request; a power of two, a
    /// multiple of the page size). `timeout` bounds every wait.
    ///
    /// Over TCP the client also binds the server's read-data channel, with
    /// the endpoint's [`NetOptions`] (so with its security), and reads come
    /// back in `buffers` buffers of the server's pool.
    pub fn connect(
        domain: &Domain,
        endpoint: &Endpoint,
        buffers: u64,
        buffer_size: usize,
        timeout: Duration,
    ) -> Result<BlockClient, Error> {
        let data_options = match endpoint {
            Endpoint::Net(ep) => ep.options().clone(),
            _ => NetOptions::default(),
        };
        BlockClient::connect_with(domain, endpoint, data_options, buffers, buffer_size, timeout)
    }

    /// [`BlockClient::connect`] to a server on TCP at `addr` (one that
    /// [`serve_tcp`](crate::serve_tcp) serves with the same security):
    /// the request channel and the read-data channel connect with
    /// `options`, so [`ferry::tls::Security::Tls`] protects both (the
    /// configuration's client certificate, the server's checked against
    /// its CA and name).
    pub fn connect_tcp(
        domain: &Domain,
        addr: std::net::SocketAddr,
        options: NetOptions,
        buffers: u64,
        buffer_size: usize,
        timeout: Duration,
    ) -> Result<BlockClient, Error> {
        BlockClient::connect(domain, &Endpoint::tcp_with(addr, options), buffers, buffer_size, timeout)
    }

    /// [`BlockClient::connect`], the read-data channel (over TCP)
    /// connecting with `data_options`.
    fn connect_with(
        domain: &Domain,
        endpoint: &Endpoint,
        data_options: NetOptions,
        buffers: u64,
        buffer_size: usize,
        timeout: Duration,
    ) -> Result<BlockClient, Error> {
        let params = BindParams { role: Role::Master, max_meta_size: META_SIZE, ..BindParams::default() };
        let mut ch = connect_retrying(domain, endpoint, params, timeout)?;
        let alloc = Allocator::new(domain, buffers, buffer_size, PoolConstraints::default())?;
        let requests = Allocator::new(domain, REQUEST_BUFFERS, REQUEST_BUFFER, PoolConstraints::default())?;
        ch.assign_pool_and_wait(alloc.pool(), timeout)?;
        ch.assign_pool_and_wait(requests.pool(), timeout)?;
        let mut client = BlockClient {
            ch,
            data: None,
            alloc,
            requests,
            batch: None,
            size: 0,
            next_id: 1,
            inflight: HashMap::new(),
            timeout,
            last_extra: 0,
            server_buffers: 0,
            server_out: 0,
            stash: VecDeque::new(),
        };
        let server_ip = match endpoint {
            Endpoint::Net(ep) => Some(ep.addr().ip()),
            _ => None,
        };
        let buf = client.requests.alloc().ok_or(Error::NoBuffer)?;
        let flags = if server_ip.is_some() { FLAG_DATA_CHANNEL } else { 0 };
        let id = client.next_id;
        client.next_id += 1;
        let meta = request_meta_flags(Op::Info, flags, buffer_size as u32, id, buffers);
        client.ch.move_buffer(buf, &meta).map_err(|r| Error::from(r.error))?;
        client.inflight.insert(id, (Op::Info, 0));
        let (c, port) = client.wait_for_port(id)?;
        c.status.map_err(Error::Remote)?;
        client.size = client.last_extra;
        if let (Some(ip), Some(port)) = (server_ip, port) {
            let params = BindParams { role: Role::Slave, max_meta_size: META_SIZE, ..BindParams::default() };
            let data_ep = Endpoint::tcp_with((ip, port).into(), data_options);
            let mut data = connect_retrying(domain, &data_ep, params, timeout)?;
            data.set_pool_policy(PoolPolicy::AcceptAll);
            client.data = Some(data);
            client.server_buffers = buffers as usize;
        }
        Ok(client)
    }

    /// Size of the store in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.inflight.len() + self.stash.len()
    }

    /// Whether reads come back in the server's buffers on a read-data
    /// channel (over TCP) rather than in the client's own.
    pub fn has_data_channel(&self) -> bool {
        self.data.is_some()
    }

    /// Traffic of the client's channels so far (summed over the request
    /// and read-data channels), over TCP; `None` between threads and
    /// processes, where no payload travels.
    pub fn link_stats(&self) -> Option<LinkStats> {
        let mut s = self.ch.link_stats()?;
        if let Some(d) = self.data.as_ref().and_then(|d| d.link_stats()) {
            s.frames_sent += d.frames_sent;
            s.frames_received += d.frames_received;
            s.payload_sent += d.payload_sent;
            s.payload_received += d.payload_received;
            s.payload_staged += d.payload_staged;
            s.send_calls += d.send_calls;
            s.recv_calls += d.recv_calls;
        }
        Some(s)
    }

    /// A free buffer of the client's pool (to fill for a write), or `None`
    /// while all are in flight or held.
    pub fn buffer(&self) -> Option<Buffer> {
        self.alloc.alloc()
    }

    /// Give back the buffer of a completed read once its data is taken:
    /// a buffer of the server (over TCP) is passed back to it without its
    /// bytes; one of the client's own goes back to its pool.
    pub fn recycle(&mut self, buffer: Buffer) -> Result<(), Error> {
        let own = [self.alloc.pool().id(), self.requests.pool().id()];
        let Some(data) = self.data.as_mut().filter(|_| !own.contains(&buffer.id().pool)) else {
            drop(buffer);
            return Ok(());
        };
        let deadline = Instant::now() + self.timeout;
        let mut buf = buffer;
        loop {
            match data.pass_unfilled(buf, &[]) {
                Ok(()) => break,
                Err(r) if r.error == ferry::ErrorKind::QueueFull && Instant::now() < deadline => {
                    buf = r.into_inner();
                    std::thread::yield_now();
                }
                Err(r) => return Err(r.error.into()),
            }
        }
        self.server_out = self.server_out.saturating_sub(1);
        Ok(())
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
        self.move_request(buffer, &meta)?;
        self.inflight.insert(id, (op, len));
        Ok(id)
    }

    fn move_request(&mut self, buffer: Buffer, meta: &[u8]) -> Result<(), Error> {
        let mut buf = buffer;
        let deadline = Instant::now() + self.timeout;
        loop {
            match self.ch.move_buffer(buf, meta) {
                Ok(()) => return Ok(()),
                Err(r) if r.error == ferry::ErrorKind::QueueFull && Instant::now() < deadline => {
                    buf = r.into_inner();
                    std::thread::yield_now();
                }
                Err(r) => return Err(r.error.into()),
            }
        }
    }

    /// Submit a request on `buffer` (the data of a write, the space of a
    /// read): its id, to match its [`Completion`].
    pub fn submit(&mut self, op: Op, buffer: Buffer, offset: u64, len: usize, fua: bool) -> Result<u64, Error> {
        self.send(op, buffer, offset, len, fua)
    }

    /// Submit a read of `len` bytes at `offset` (at most a buffer): its id.
    /// Over TCP the request travels as a descriptor packed with others in
    /// a small request buffer (sent when the client waits for a completion
    /// or the request buffer is full), and the data comes back once, in a
    /// buffer of the server's; elsewhere a buffer of the client's pool is
    /// moved and comes back filled. [`Error::NoBuffer`] while as many
    /// reads are out as there are buffers.
    pub fn submit_read(&mut self, offset: u64, len: usize) -> Result<u64, Error> {
        let step = self.alloc.pool().geometry().buffer_size();
        if len > step {
            return Err(Error::BadSpec(format!("a request of {len} bytes does not fit a {step}-byte buffer")));
        }
        if self.data.is_none() {
            let buf = self.alloc.alloc().ok_or(Error::NoBuffer)?;
            return self.send(Op::Read, buf, offset, len, false);
        }
        if self.server_out >= self.server_buffers {
            return Err(Error::NoBuffer);
        }
        let (mut buf, n) = match self.batch.take() {
            Some(b) => b,
            None => (self.request_buffer()?, 0),
        };
        let id = self.next_id;
        self.next_id += 1;
        let d = request_meta(Op::Read, false, len as u32, id, offset);
        buf.as_mut_slice()?[n * DESCRIPTOR..(n + 1) * DESCRIPTOR].copy_from_slice(&d);
        self.inflight.insert(id, (Op::Read, len));
        self.server_out += 1;
        self.batch = Some((buf, n + 1));
        if (n + 2) * DESCRIPTOR > REQUEST_BUFFER {
            self.send_batch()?;
        }
        Ok(id)
    }

    /// Send the request buffer of packed read descriptors, if any.
    fn send_batch(&mut self) -> Result<(), Error> {
        let Some((buf, n)) = self.batch.take() else { return Ok(()) };
        let meta = request_meta_flags_op(OP_READ_BATCH, 0, n as u32, 0, 0);
        self.move_request(buf, &meta)
    }

    /// The next completion (of any request in flight), waiting up to the
    /// client's timeout.
    pub fn complete(&mut self) -> Result<Completion, Error> {
        self.next_completion().map(|(c, _)| c)
    }

    fn next_completion(&mut self) -> Result<(Completion, Option<u16>), Error> {
        if let Some(x) = self.stash.pop_front() {
            return Ok(x);
        }
        self.arrival()
    }

    /// The next reply from the server (not from the stash).
    fn arrival(&mut self) -> Result<(Completion, Option<u16>), Error> {
        if self.inflight.is_empty() {
            return Err(Error::BadSpec("no request in flight".into()));
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            // What is there already, before packed reads leave: under load
            // the batch grows while completions come in.
            let ready = match self.ch.poll() {
                Some(ev) => Some((0, ev)),
                None => self.data.as_mut().and_then(|d| d.poll()).map(|ev| (1, ev)),
            };
            let ev = match ready {
                Some(ev) => Some(ev),
                None => {
                    self.send_batch()?;
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::TimedOut);
                    }
                    match self.data.as_mut() {
                        Some(d) => ferry::wait_any(&mut [&mut self.ch, d], Some(left)).ok(),
                        None => self.ch.wait(Some(left)).map(|ev| (0, ev)).ok(),
                    }
                }
            };
            if let Some((from, ev)) = ev {
                if let Some(x) = self.take(from, ev)? {
                    return Ok(x);
                }
            }
        }
    }

    /// An event of the request channel (`from` 0) or the read-data
    /// channel (1): the completion it brings, if any.
    fn take(&mut self, from: usize, ev: Event) -> Result<Option<(Completion, Option<u16>)>, Error> {
        match ev {
            Event::BufferPassed { buffer, meta } | Event::MoveReceived { buffer, meta } => {
                if meta.len() < 24 {
                    return Err(Error::Protocol("a reply without its meta data".into()));
                }
                let id = u64::from_le_bytes(meta[..8].try_into().expect("8 bytes"));
                let status = u32::from_le_bytes(meta[8..12].try_into().expect("4 bytes"));
                let port = u32::from_le_bytes(meta[12..16].try_into().expect("4 bytes"));
                let extra = u64::from_le_bytes(meta[16..24].try_into().expect("8 bytes"));
                if from == 0 && buffer.id().pool == self.requests.pool().id() && id == 0 {
                    // A request buffer of packed reads, back (to its pool).
                    if status != 0 {
                        return Err(Error::Protocol(format!("the server refused packed reads (errno {status})")));
                    }
                    return Ok(None);
                }
                self.last_extra = extra;
                let Some((op, len)) = self.inflight.remove(&id) else {
                    return Err(Error::Protocol(format!("a reply to request {id}, which is not in flight")));
                };
                let status = if status == 0 { Ok(()) } else { Err(status) };
                let port = u16::try_from(port).ok().filter(|&p| p != 0 && op == Op::Info);
                Ok(Some((Completion { id, op, status, buffer, len }, port)))
            }
            Event::Error(e) => Err(e.into()),
            Event::Closed { .. } => Err(Error::Protocol("the server closed the channel".into())),
            _ => Ok(None),
        }
    }

    /// A free request buffer, waiting for one to come back from the
    /// server if all are out (completions meanwhile are kept for
    /// [`complete`](BlockClient::complete)).
    fn request_buffer(&mut self) -> Result<Buffer, Error> {
        self.send_batch()?;
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(b) = self.requests.alloc() {
                return Ok(b);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::TimedOut);
            }
            if let Ok(ev) = self.ch.wait(Some(left)) {
                if let Some(x) = self.take(0, ev)? {
                    self.stash.push_back(x);
                }
            }
        }
    }

    fn wait_for(&mut self, id: u64) -> Result<Completion, Error> {
        self.wait_for_port(id).map(|(c, _)| c)
    }

    /// The completion of `id`; the others that come first are kept for
    /// [`complete`](BlockClient::complete).
    fn wait_for_port(&mut self, id: u64) -> Result<(Completion, Option<u16>), Error> {
        if let Some(at) = self.stash.iter().position(|(c, _)| c.id == id) {
            return Ok(self.stash.remove(at).expect("found"));
        }
        loop {
            let x = self.arrival()?;
            if x.0.id == id {
                return Ok(x);
            }
            self.stash.push_back(x);
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
                let n = step.min(out.len() - next);
                match self.submit_read(offset + next as u64, n) {
                    Ok(id) => {
                        pending.insert(id, next);
                        next += n;
                        continue;
                    }
                    Err(Error::NoBuffer) if !pending.is_empty() => {}
                    Err(e) => return Err(e),
                }
            }
            let c = self.complete()?;
            if let Some(at) = pending.remove(&c.id) {
                match c.status {
                    Ok(()) => out[at..at + c.len].copy_from_slice(&c.buffer[..c.len]),
                    Err(e) => first_error = first_error.or(Some(e)),
                }
            }
            self.recycle(c.buffer)?;
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

    /// A request without data, in a small request buffer.
    fn control(&mut self, op: Op, offset: u64, len: u64) -> Result<(), Error> {
        let len = u32::try_from(len).map_err(|_| Error::BadSpec("at most 4 GiB less one byte per request".into()))?;
        let buf = self.request_buffer()?;
        let id = self.next_id;
        self.next_id += 1;
        let meta = request_meta(op, false, len, id, offset);
        self.move_request(buf, &meta)?;
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

/// [`Channel::connect`], tried again while the server's listener was
/// replaced under a connection (several clients connecting at once: each
/// listening channel takes one, the others' connections are reset).
fn connect_retrying(
    domain: &Domain,
    endpoint: &Endpoint,
    params: BindParams,
    timeout: Duration,
) -> Result<Channel, Error> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match Channel::connect(domain, endpoint, params, left) {
            Ok(ch) => return Ok(ch),
            Err(e)
                if matches!(e.kind(), ferry::ErrorKind::Os(why)
                if (why.contains("os error 104") || why.contains("os error 111") || why.contains("os error 32"))
                    && Instant::now() < deadline) =>
            {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e == ferry::ErrorKind::PeerGone && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => return Err(e.into()),
        }
    }
}

impl Drop for BlockClient {
    fn drop(&mut self) {
        if let Some(d) = &mut self.data {
            let _ = d.teardown();
        }
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
                                Err(r) if r.error == ferry::ErrorKind::QueueFull => {
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
            if let Ok(ev) = upstream.wait(Some(Duration::from_millis(1))) {
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
                    Err(r) if r.error == ferry::ErrorKind::QueueFull => {
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
            Ok(Event::PoolAssigned(p)) if p == pool => return Ok(()),
            Ok(Event::PoolVetoed(p)) if p == pool => {
                return Err(Error::Protocol("the block server refused a client's pool".into()))
            }
            Ok(ev) => route(ev, users)?,
            Err(_) => {}
        }
    }
    Err(Error::TimedOut)
}
