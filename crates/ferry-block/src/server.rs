//! The server end of the block service over Ferry channels: one thread
//! serves every client of an endpoint with a [`ferry::Selector`].
//!
//! The loop owns a listening channel on the endpoint (a creator waiting
//! for its binder); when a client binds, that channel becomes the client's
//! request channel and a new listening channel takes its place. Requests
//! of all clients are taken in the order their channels wake, and each is
//! answered as soon as it is done: replies leave out of order, and a
//! client keeps as many requests in flight as its buffers allow.
//!
//! A TCP client that asks for it gets a second channel, the read-data
//! channel, on which this server is the transmit master: it assigns a pool
//! of its own for the client, fills one of those buffers from the store
//! for each read and moves it to the client; the client passes it back
//! unfilled (no payload) once it has taken the data. See [`crate::native`]
//! for the protocol.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use ferry::{
    Allocator, Buffer, Channel, ChannelSetup, Direction, Domain, Endpoint, Event, NetOptions, PoolConstraints,
    PoolPolicy, Role, Selector,
};

use crate::native::{
    reply_meta, Op, DESCRIPTOR, EINVAL, EIO, ENOSPC, FLAG_DATA_CHANNEL, META_SIZE, OP_READ_BATCH, REQUEST_META,
};
use crate::store::Store;
use crate::Error;

/// What a served channel did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChannelSummary {
    /// Requests answered (errors included).
    pub requests: u64,
    /// Bytes read from the store into buffers for the client.
    pub read_bytes: u64,
    /// Bytes written to the store from the client's buffers.
    pub write_bytes: u64,
    /// Requests answered with an error.
    pub errors: u64,
}

/// A client that has gone, as [`serve_endpoint`] reports it.
#[derive(Debug, Clone)]
pub struct ClientReport {
    /// The client's number on this endpoint, from 1.
    pub number: u64,
    /// How long it was connected.
    pub connected: Duration,
    /// What it did.
    pub summary: ChannelSummary,
    /// Why it was dropped, when it did not leave on its own.
    pub error: Option<String>,
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
    let mut lp = Loop::new(domain, store, data_ip(endpoint))?;
    lp.add_client(ch)?;
    lp.run(None, &|| false, &mut |_| {})?;
    Ok(lp.last.take().map(|r| r.summary).unwrap_or_default())
}

/// Wait for one client on `endpoint`: the channel the server end of the
/// block service needs (receiving slave, pools of the client accepted).
pub fn accept_client(domain: &Domain, endpoint: &Endpoint, timeout: Duration) -> Result<Channel, Error> {
    let mut ch = Channel::accept(domain, endpoint, request_setup(), timeout)?;
    ch.set_pool_policy(PoolPolicy::AcceptAll);
    Ok(ch)
}

/// Serve the client of a channel [`accept_client`] gave until it closes
/// the channel or goes away. (Without its endpoint the server offers no
/// read-data channel: a TCP client's reads come back in its own buffers.)
pub fn serve_client(ch: Channel, store: &dyn Store) -> Result<ChannelSummary, Error> {
    let domain = ch.domain().clone();
    let mut lp = Loop::new(&domain, store, None)?;
    lp.add_client(ch)?;
    lp.run(None, &|| false, &mut |_| {})?;
    Ok(lp.last.take().map(|r| r.summary).unwrap_or_default())
}

/// Serve every client that connects to `endpoint`, all from this thread,
/// until `stop` returns true (checked at least every 200 ms). `gone` hears
/// of each client when it leaves. Fails only when the endpoint cannot be
/// listened on at all. On a TCP endpoint the read-data channels listen on
/// its address with its [`NetOptions`], so under the same security as
/// the request channels.
pub fn serve_endpoint(
    domain: &Domain,
    endpoint: &Endpoint,
    store: &dyn Store,
    stop: &dyn Fn() -> bool,
    gone: &mut dyn FnMut(&ClientReport),
) -> Result<(), Error> {
    let mut lp = Loop::new(domain, store, data_ip(endpoint))?;
    lp.run(Some(endpoint), stop, gone)
}

/// [`serve_endpoint`] on TCP at `addr` with `options`: the request
/// channels and the read-data channels alike take the options' security
/// ([`ferry::tls::Security`]: TLS with mutual certificate
/// authentication, or plain TCP), so a client connects with the same
/// ([`BlockClient::connect_tcp`](crate::BlockClient::connect_tcp)). Under
/// TLS every request, payload and reply is encrypted, a read's data from
/// the server's buffer into TLS records and a write's from TLS records
/// into the server's buffer (the one copy encryption needs).
pub fn serve_tcp(
    domain: &Domain,
    addr: SocketAddr,
    options: NetOptions,
    store: &dyn Store,
    stop: &dyn Fn() -> bool,
    gone: &mut dyn FnMut(&ClientReport),
) -> Result<(), Error> {
    serve_endpoint(domain, &Endpoint::tcp_with(addr, options), store, stop, gone)
}

fn request_setup() -> ChannelSetup {
    ChannelSetup { direction: Direction::Rx, role: Role::Slave, meta_size: META_SIZE, ..ChannelSetup::default() }
}

/// Where read-data channels listen, and with what options: the address
/// and the options (its security among them) of a TCP endpoint.
fn data_ip(endpoint: &Endpoint) -> Option<(IpAddr, NetOptions)> {
    match endpoint {
        Endpoint::Net(ep) => Some((ep.addr().ip(), ep.options().clone())),
        _ => None,
    }
}

/// A read waiting for a buffer of the server's pool.
struct ReadReq {
    id: u64,
    offset: u64,
    len: u64,
}

/// What a selector key is.
#[derive(Clone, Copy)]
enum Slot {
    /// The channel waiting for the next client.
    Listener,
    /// A client's request channel.
    Request(u64),
    /// A client's read-data channel (listening until the client binds).
    Data(u64),
}

/// How a reply leaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Send {
    Move,
    Pass,
    PassUnfilled,
}

struct Client {
    request: usize,
    data: Option<usize>,
    /// The read-data channel is connected and the pool assigned.
    data_ready: bool,
    pool: Option<Allocator>,
    pending: VecDeque<ReadReq>,
    /// Replies that met a full queue, in order: (key, how, buffer, meta).
    outbox: VecDeque<(usize, Send, Buffer, [u8; 24])>,
    summary: ChannelSummary,
    since: Instant,
}

struct Loop<'a> {
    domain: Domain,
    store: &'a dyn Store,
    /// Where and how read-data channels listen (TCP only).
    data_ip: Option<(IpAddr, NetOptions)>,
    sel: Selector,
    slots: HashMap<usize, Slot>,
    clients: HashMap<u64, Client>,
    numbered: u64,
    /// The last client that left (for the one-client forms).
    last: Option<ClientReport>,
}

impl<'a> Loop<'a> {
    fn new(domain: &Domain, store: &'a dyn Store, data_ip: Option<(IpAddr, NetOptions)>) -> Result<Self, Error> {
        Ok(Loop {
            domain: domain.clone(),
            store,
            data_ip,
            sel: Selector::new()?,
            slots: HashMap::new(),
            clients: HashMap::new(),
            numbered: 0,
            last: None,
        })
    }

    fn add_client(&mut self, mut ch: Channel) -> Result<u64, Error> {
        ch.set_pool_policy(PoolPolicy::AcceptAll);
        let key = self.sel.insert(ch);
        Ok(self.client_on(key))
    }

    fn client_on(&mut self, key: usize) -> u64 {
        self.numbered += 1;
        let n = self.numbered;
        self.slots.insert(key, Slot::Request(n));
        self.clients.insert(
            n,
            Client {
                request: key,
                data: None,
                data_ready: false,
                pool: None,
                pending: VecDeque::new(),
                outbox: VecDeque::new(),
                summary: ChannelSummary::default(),
                since: Instant::now(),
            },
        );
        n
    }

    fn listen(&mut self, endpoint: &Endpoint) -> Result<(), Error> {
        let ch = Channel::create(&self.domain, endpoint, request_setup())?;
        let key = self.sel.insert(ch);
        self.slots.insert(key, Slot::Listener);
        Ok(())
    }

    /// Serve until `stop`, or (without an endpoint) until no client is left.
    fn run(
        &mut self,
        endpoint: Option<&Endpoint>,
        stop: &dyn Fn() -> bool,
        gone: &mut dyn FnMut(&ClientReport),
    ) -> Result<(), Error> {
        let mut listening = false;
        let mut relisten_at = None;
        if let Some(ep) = endpoint {
            self.listen(ep)?;
            listening = true;
        }
        loop {
            if stop() || (endpoint.is_none() && self.clients.is_empty()) {
                return Ok(());
            }
            if let (Some(ep), false, Some(at)) = (endpoint, listening, relisten_at) {
                if Instant::now() >= at {
                    match self.listen(ep) {
                        Ok(()) => listening = true,
                        // Out of fds or ports for a moment: try again soon.
                        Err(_) => relisten_at = Some(Instant::now() + Duration::from_millis(100)),
                    }
                }
            }
            let busy = self.clients.values().any(|c| !c.outbox.is_empty());
            let timeout = if busy { Duration::from_millis(1) } else { Duration::from_millis(200) };
            let Ok((key, ev)) = self.sel.wait(Some(timeout)) else {
                let ids: Vec<u64> = self.clients.keys().copied().collect();
                for id in ids {
                    self.pump(id, gone);
                }
                continue;
            };
            let Some(slot) = self.slots.get(&key).copied() else { continue };
            match slot {
                Slot::Listener => match ev {
                    Event::BindRequest { .. } => {
                        if let Some(ch) = self.sel.get_mut(key) {
                            ch.set_pool_policy(PoolPolicy::AcceptAll);
                        }
                        self.client_on(key);
                        listening = false;
                        relisten_at = Some(Instant::now());
                    }
                    Event::Error(_) | Event::Closed { .. } => {
                        // A binder that failed during setup: listen anew.
                        self.slots.remove(&key);
                        self.sel.remove(key);
                        listening = false;
                        relisten_at = Some(Instant::now());
                    }
                    _ => {}
                },
                Slot::Request(id) => self.on_request(id, ev, gone),
                Slot::Data(id) => self.on_data(id, ev, gone),
            }
            if let (Some(ep), false) = (endpoint, listening) {
                if relisten_at.is_some_and(|at| Instant::now() >= at) {
                    match self.listen(ep) {
                        Ok(()) => listening = true,
                        Err(_) => relisten_at = Some(Instant::now() + Duration::from_millis(100)),
                    }
                }
            }
        }
    }

    fn drop_client(&mut self, id: u64, error: Option<String>, gone: &mut dyn FnMut(&ClientReport)) {
        let Some(c) = self.clients.remove(&id) else { return };
        for key in std::iter::once(c.request).chain(c.data) {
            self.slots.remove(&key);
            if let Some(mut ch) = self.sel.remove(key) {
                let _ = ch.teardown();
            }
        }
        let report = ClientReport { number: id, connected: c.since.elapsed(), summary: c.summary, error };
        gone(&report);
        self.last = Some(report);
    }

    fn on_request(&mut self, id: u64, ev: Event, gone: &mut dyn FnMut(&ClientReport)) {
        match ev {
            Event::MoveReceived { mut buffer, meta } => {
                let Some(c) = self.clients.get_mut(&id) else { return };
                let key = c.request;
                if meta.len() >= REQUEST_META && meta[0] == OP_READ_BATCH {
                    let status = if c.data.is_some() {
                        let count = u32::from_le_bytes(meta[4..8].try_into().expect("4 bytes")) as usize;
                        if count.checked_mul(DESCRIPTOR).is_some_and(|n| n <= buffer.len()) {
                            for d in buffer[..count * DESCRIPTOR].chunks_exact(DESCRIPTOR) {
                                let word = |r: std::ops::Range<usize>| {
                                    let mut b = [0u8; 8];
                                    b[..r.len()].copy_from_slice(&d[r]);
                                    u64::from_le_bytes(b)
                                };
                                c.pending.push_back(ReadReq { len: word(4..8), id: word(8..16), offset: word(16..24) });
                            }
                            0
                        } else {
                            EINVAL
                        }
                    } else {
                        EINVAL
                    };
                    if status != 0 {
                        c.summary.requests += 1;
                        c.summary.errors += 1;
                    }
                    let batch_id = u64::from_le_bytes(meta[8..16].try_into().expect("8 bytes"));
                    c.outbox.push_back((key, Send::PassUnfilled, buffer, reply_meta(batch_id, status, 0)));
                } else if meta.len() >= REQUEST_META && meta[0] == Op::Info as u8 && meta[1] & FLAG_DATA_CHANNEL != 0 {
                    let req_id = u64::from_le_bytes(meta[8..16].try_into().expect("8 bytes"));
                    let size = u32::from_le_bytes(meta[4..8].try_into().expect("4 bytes")) as usize;
                    let count = u64::from_le_bytes(meta[16..24].try_into().expect("8 bytes"));
                    let mut reply = reply_meta(req_id, 0, self.store.size());
                    c.summary.requests += 1;
                    if let (Some((ip, options)), None) = (&self.data_ip, c.data) {
                        // At most 1024 buffers and 1 GiB for one client.
                        let fits = (1..=1024).contains(&count) && (size as u64).saturating_mul(count) <= 1 << 30;
                        let made = fits.then_some(()).and_then(|()| {
                            let pool = Allocator::new(&self.domain, count, size, PoolConstraints::default()).ok()?;
                            let setup = ChannelSetup {
                                direction: Direction::Tx,
                                role: Role::Master,
                                meta_size: META_SIZE,
                                ..ChannelSetup::default()
                            };
                            let ep = Endpoint::tcp_with((*ip, 0).into(), options.clone());
                            let ch = Channel::create(&self.domain, &ep, setup).ok()?;
                            let port = ch.listen_addr()?.port();
                            Some((pool, ch, port))
                        });
                        match made {
                            Some((pool, ch, port)) => {
                                let dkey = self.sel.insert(ch);
                                self.slots.insert(dkey, Slot::Data(id));
                                let c = self.clients.get_mut(&id).expect("present");
                                c.data = Some(dkey);
                                c.pool = Some(pool);
                                reply[12..16].copy_from_slice(&u32::from(port).to_le_bytes());
                            }
                            None => reply[8..12].copy_from_slice(&EINVAL.to_le_bytes()),
                        }
                    }
                    let c = self.clients.get_mut(&id).expect("present");
                    if reply[8..12] != [0; 4] {
                        c.summary.errors += 1;
                    }
                    c.outbox.push_back((key, Send::PassUnfilled, buffer, reply));
                } else {
                    let (status, extra, fill) = execute(self.store, &mut buffer, &meta, &mut c.summary);
                    c.summary.requests += 1;
                    if status != 0 {
                        c.summary.errors += 1;
                    }
                    let req_id = meta.get(8..16).map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
                    let how = if fill { Send::Pass } else { Send::PassUnfilled };
                    c.outbox.push_back((key, how, buffer, reply_meta(req_id, status, extra)));
                }
                self.pump(id, gone);
            }
            Event::Closed { .. } => self.drop_client(id, None, gone),
            // The client went away: what it asked for is done or not, as
            // answered; nothing is left for this channel to do.
            Event::Error(e) if e == ferry::ErrorKind::PeerGone => self.drop_client(id, None, gone),
            Event::Error(e) => self.drop_client(id, Some(e.to_string()), gone),
            _ => {}
        }
    }

    fn on_data(&mut self, id: u64, ev: Event, gone: &mut dyn FnMut(&ClientReport)) {
        let Some(c) = self.clients.get_mut(&id) else { return };
        let Some(key) = c.data else { return };
        match ev {
            Event::BindRequest { .. } => {
                let pool = c.pool.as_ref().map(|a| a.pool().clone());
                let assigned = match (self.sel.get_mut(key), pool) {
                    (Some(ch), Some(pool)) => ch.assign_pool(&pool).map_err(|e| e.to_string()),
                    _ => Err("the read-data channel is gone".into()),
                };
                if let Err(e) = assigned {
                    self.drop_client(id, Some(e), gone);
                }
            }
            Event::PoolAssigned(_) => {
                c.data_ready = true;
                self.pump(id, gone);
            }
            // A buffer of ours back from the client: free again.
            Event::BufferPassed { buffer, .. } => {
                drop(buffer);
                self.pump(id, gone);
            }
            Event::PoolVetoed(_) => {
                self.drop_client(id, Some("the client refused the server's read-data pool".into()), gone)
            }
            Event::Closed { .. } => self.drop_client(id, None, gone),
            Event::Error(e) if e == ferry::ErrorKind::PeerGone => self.drop_client(id, None, gone),
            Event::Error(e) => self.drop_client(id, Some(e.to_string()), gone),
            _ => {}
        }
    }

    /// Send what waits in the client's outbox, then answer pending reads
    /// while the server's pool has free buffers.
    fn pump(&mut self, id: u64, gone: &mut dyn FnMut(&ClientReport)) {
        let Some(c) = self.clients.get_mut(&id) else { return };
        loop {
            while let Some((key, how, buf, meta)) = c.outbox.pop_front() {
                let Some(ch) = self.sel.get_mut(key) else { continue };
                let sent = match how {
                    Send::Move => ch.move_buffer(buf, &meta),
                    Send::Pass => ch.pass(buf, &meta),
                    Send::PassUnfilled => ch.pass_unfilled(buf, &meta),
                };
                match sent {
                    Ok(()) => {}
                    Err(r) if r.error == ferry::ErrorKind::QueueFull => {
                        c.outbox.push_front((key, how, r.into_inner(), meta));
                        return;
                    }
                    Err(r) => {
                        let e = r.error.to_string();
                        self.drop_client(id, Some(e), gone);
                        return;
                    }
                }
            }
            if !c.data_ready || c.pending.is_empty() {
                return;
            }
            let Some(pool) = &c.pool else { return };
            let Some(mut buf) = pool.alloc() else { return };
            let r = c.pending.pop_front().expect("not empty");
            c.summary.requests += 1;
            let in_bounds = r.offset.checked_add(r.len).is_some_and(|end| end <= self.store.size());
            let status = if r.len > buf.len() as u64 || !in_bounds {
                EINVAL
            } else {
                match buf.as_mut_slice() {
                    Ok(mem) => match self.store.read_at(r.offset, &mut mem[..r.len as usize]) {
                        Ok(()) => {
                            c.summary.read_bytes += r.len;
                            0
                        }
                        Err(e) => errno(e),
                    },
                    Err(_) => EIO,
                }
            };
            if status != 0 {
                c.summary.errors += 1;
            }
            let key = c.data.expect("data channel ready");
            c.outbox.push_back((key, Send::Move, buf, reply_meta(r.id, status, r.len)));
        }
    }
}

fn errno(e: std::io::Error) -> u32 {
    match e.raw_os_error() {
        Some(22) => EINVAL,
        Some(28) => ENOSPC,
        _ => EIO,
    }
}

/// Carry out one request on `buffer`: (status, extra reply value, whether
/// the buffer's bytes go back).
fn execute(store: &dyn Store, buffer: &mut Buffer, meta: &[u8], summary: &mut ChannelSummary) -> (u32, u64, bool) {
    if meta.len() < REQUEST_META || meta[2..4] != [0, 0] || meta[1] & !(1 | FLAG_DATA_CHANNEL) != 0 {
        return (EINVAL, 0, false);
    }
    let Some(op) = Op::from_u8(meta[0]) else { return (EINVAL, 0, false) };
    let fua = meta[1] & 1 != 0;
    let len = u32::from_le_bytes(meta[4..8].try_into().expect("4 bytes")) as u64;
    let offset = u64::from_le_bytes(meta[16..24].try_into().expect("8 bytes"));
    let in_bounds = offset.checked_add(len).is_some_and(|end| end <= store.size());
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
