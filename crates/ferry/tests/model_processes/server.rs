//! A domain process: owns one `ferry::Domain`, its allocators, its channel
//! ends and every `Buffer`/`BufferCopy` handle it holds, and carries out the
//! coordinator's commands one at a time. It never decides anything about
//! the model: it only reports what the library did. It exits when the
//! command socket closes (the coordinator ended or died) or stays silent
//! for [`IDLE`].

use std::collections::{BTreeMap, HashMap};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::{Duration, Instant};

use ferry::{
    Aggregate, Allocator, BindParams, Buffer, BufferCopy, BufferId, BufferState, Channel, ChannelSetup, Direction,
    Domain, Endpoint, Error, ErrorKind, Event, Member, PoolConstraints,
};

use super::wire::{read_frame, write_frame, Chan, Cmd, EndReport, Ev, LibError, Reply, StateReport};
use crate::model::gen::META;
use crate::model::lib_map::{harness_aggregate, meta_bytes, pieces_of_refused, reject_of};

/// A domain process with no command for this long ends itself.
const IDLE: Duration = Duration::from_secs(120);
/// Bound on the wait for a channel to connect.
const CONNECT: Duration = Duration::from_secs(10);
/// Buffer size of every pool.
pub const BUFFER_SIZE: usize = 4096;

/// Serve the coordinator listening on the abstract socket `addr` as domain `d`.
pub fn serve(addr: &str, d: u32) {
    let sa = SocketAddr::from_abstract_name(addr.as_bytes()).expect("abstract name");
    let mut sock = UnixStream::connect_addr(&sa).expect("domain process: connect to the coordinator");
    sock.set_read_timeout(Some(IDLE)).expect("timeout");
    if write_frame(&mut sock, &Reply::Hello { domain: d }.encode()).is_err() {
        return;
    }
    let mut server = Server::new(d);
    loop {
        // End of stream, an error or the idle timeout: the coordinator is
        // gone or stuck; nothing lingers.
        let Ok(body) = read_frame(&mut sock) else { return };
        let cmd = Cmd::decode(&body).unwrap_or_else(|e| panic!("d{d}: bad command: {e}"));
        let reply = server.handle(cmd);
        if write_frame(&mut sock, &reply.encode()).is_err() {
            return;
        }
    }
}

/// Where a handle put into an aggregate came from: an owned buffer (and
/// whether the sender keeps it), or a copy held via a channel (always kept:
/// forwarding a copy does not give it up).
#[derive(Debug, Clone, Copy)]
enum Origin {
    Owned(BufferId, bool),
    Copy((BufferId, Chan)),
}

impl Origin {
    fn kept(self) -> bool {
        match self {
            Origin::Owned(_, keep) => keep,
            Origin::Copy(_) => true,
        }
    }
}

/// One channel end of this domain.
struct End {
    ch: Channel,
    creator: bool,
}

struct Server {
    d: u32,
    domain: Domain,
    allocators: Vec<Allocator>,
    ends: BTreeMap<Chan, End>,
    owned: HashMap<BufferId, Buffer>,
    /// Copies held, by buffer and the channel they came over.
    copies: BTreeMap<(BufferId, Chan), Vec<BufferCopy>>,
}

fn lib_err(e: &Error) -> LibError {
    LibError { reject: reject_of(e), text: format!("{e:?}") }
}

fn op(r: Result<(), Error>) -> Reply {
    Reply::Op(r.map_err(|e| lib_err(&e)))
}

fn first8(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes[..8].try_into().unwrap())
}

/// Whether `state` lets this domain read the buffer.
fn readable(state: BufferState) -> bool {
    state != BufferState::Invalid
}

impl Server {
    fn new(d: u32) -> Self {
        Server {
            d,
            domain: Domain::new(&format!("d{d}")),
            allocators: Vec::new(),
            ends: BTreeMap::new(),
            owned: HashMap::new(),
            copies: BTreeMap::new(),
        }
    }

    fn handle(&mut self, cmd: Cmd) -> Reply {
        match cmd {
            Cmd::Reset => {
                // Channels first (a dropped end takes in what is queued to
                // it and tells its peer), then the handles, then the pools.
                self.ends.clear();
                self.copies.clear();
                self.owned.clear();
                self.allocators.clear();
                *self = Server::new(self.d);
                let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u32);
                Reply::Reset { fds }
            }
            Cmd::CreatePool { count } => self.create_pool(count),
            Cmd::Listen { chan, name, trust } => {
                let setup =
                    ChannelSetup { direction: Direction::Tx, trust, meta_size: META, ..ChannelSetup::default() };
                match Channel::create(&self.domain, &Endpoint::shm_abstract(&name), setup) {
                    Ok(ch) => {
                        self.ends.insert(chan, End { ch, creator: true });
                        Reply::Op(Ok(()))
                    }
                    Err(e) => Reply::Failed(format!("d{}: create on {name}: {e:?}", self.d)),
                }
            }
            Cmd::Bind { chan, name } => {
                match Channel::bind(&self.domain, &Endpoint::shm_abstract(&name), BindParams::default()) {
                    Ok(ch) => {
                        self.ends.insert(chan, End { ch, creator: false });
                        Reply::Op(Ok(()))
                    }
                    Err(e) => Reply::Failed(format!("d{}: bind to {name}: {e:?}", self.d)),
                }
            }
            Cmd::AwaitConnect { chan } => {
                let Some(end) = self.ends.get_mut(&chan) else { return self.no_end(chan) };
                match (end.creator, end.ch.wait(Some(CONNECT))) {
                    (true, Ok(Event::BindRequest { .. })) | (false, Ok(Event::Bound)) => Reply::Op(Ok(())),
                    (_, ev) => Reply::Failed(format!("d{}: channel {chan} did not connect: {ev:?}", self.d)),
                }
            }
            Cmd::Assign { chan, pool } => {
                let Some(handle) = self.domain.pool(pool) else { return Reply::NoHandle };
                match self.ends.get_mut(&chan) {
                    Some(end) => op(end.ch.assign_pool(&handle)),
                    None => self.no_end(chan),
                }
            }
            Cmd::Respond { chan, pool, accept } => match self.ends.get_mut(&chan) {
                Some(end) => op(end.ch.respond_pool(pool, accept)),
                None => self.no_end(chan),
            },
            Cmd::Remove { chan, pool } => match self.ends.get_mut(&chan) {
                Some(end) => op(end.ch.remove_pool(pool)),
                None => self.no_end(chan),
            },
            Cmd::Teardown { chan } => match self.ends.get_mut(&chan) {
                Some(end) => op(end.ch.teardown()),
                None => self.no_end(chan),
            },
            Cmd::Batching { chan } => match self.ends.get_mut(&chan) {
                Some(end) => op(end.ch.set_batching(true)),
                None => self.no_end(chan),
            },
            Cmd::Flush { chan } => match self.ends.get_mut(&chan) {
                Some(end) => op(end.ch.flush()),
                None => self.no_end(chan),
            },
            Cmd::Move { chan, buf, meta_len, stamp } => self.give(chan, buf, meta_len, stamp, true),
            Cmd::Pass { chan, buf, meta_len, stamp } => self.give(chan, buf, meta_len, stamp, false),
            Cmd::Copy { chan, buf, meta_len } => self.copy(chan, buf, meta_len),
            Cmd::Release { chan, buf } => self.release(chan, buf),
            Cmd::FullCopy { chan, src, dst, meta_len } => self.full_copy(chan, src, dst, meta_len),
            Cmd::SendAggregate { chan, members, meta_len } => self.send_aggregate(chan, &members, meta_len),
            Cmd::Deliver { chan, wait_ms } => self.deliver(chan, wait_ms),
            Cmd::State { bufs, pools } => Reply::State(self.state(&bufs, &pools)),
            Cmd::AllocFree { pool, stamp } => {
                let mut taken = Vec::new();
                while let Some(mut b) = self.domain.alloc(pool) {
                    let ok = match b.as_mut_slice() {
                        Ok(s) => {
                            s[..8].copy_from_slice(&stamp.to_le_bytes());
                            first8(&b) == stamp
                        }
                        Err(_) => false,
                    };
                    taken.push((b.id().index, ok));
                    self.owned.insert(b.id(), b);
                }
                Reply::Allocated(taken)
            }
        }
    }

    fn no_end(&self, chan: Chan) -> Reply {
        Reply::Failed(format!("d{} has no end of channel {chan}", self.d))
    }

    fn create_pool(&mut self, count: u32) -> Reply {
        let a = match Allocator::new(&self.domain, u64::from(count), BUFFER_SIZE, PoolConstraints::default()) {
            Ok(a) => a,
            Err(e) => return Reply::Failed(format!("d{}: pool: {e:?}", self.d)),
        };
        let id = a.pool().id();
        for index in 0..count {
            match a.alloc() {
                Some(b) if b.id() == (BufferId { pool: id, index }) => {
                    self.owned.insert(b.id(), b);
                }
                other => {
                    let got = other.map(|b| b.id());
                    return Reply::Failed(format!("d{}: fresh pool gave {got:?} for index {index}", self.d));
                }
            }
        }
        self.allocators.push(a);
        Reply::Pool(id)
    }

    /// Move (`to_sink`) or pass an owned buffer, stamping it first when it
    /// is writable.
    fn give(&mut self, chan: Chan, buf: BufferId, meta_len: u8, stamp: u64, to_sink: bool) -> Reply {
        let Some(end) = self.ends.get_mut(&chan) else { return self.no_end(chan) };
        let Some(mut b) = self.owned.remove(&buf) else { return Reply::NoHandle };
        if let Ok(s) = b.as_mut_slice() {
            s[..8].copy_from_slice(&stamp.to_le_bytes());
        }
        let meta = meta_bytes(usize::from(meta_len));
        let r = if to_sink { end.ch.move_buffer(b, &meta) } else { end.ch.pass(b, &meta) };
        match r {
            Ok(()) => Reply::Op(Ok(())),
            Err(refused) => {
                let e = lib_err(&refused.error);
                self.owned.insert(buf, refused.into_inner());
                Reply::Op(Err(e))
            }
        }
    }

    /// A copy held of `buf`, preferring the one received over `chan`.
    fn held_key(&self, buf: BufferId, prefer: Option<Chan>) -> Option<(BufferId, Chan)> {
        if let Some(c) = prefer {
            if self.copies.get(&(buf, c)).is_some_and(|v| !v.is_empty()) {
                return Some((buf, c));
            }
        }
        self.copies.iter().find(|((b, _), v)| *b == buf && !v.is_empty()).map(|(k, _)| *k)
    }

    fn copy(&mut self, chan: Chan, buf: BufferId, meta_len: u8) -> Reply {
        let meta = meta_bytes(usize::from(meta_len));
        let key = self.held_key(buf, None);
        let Some(end) = self.ends.get_mut(&chan) else { return self.no_end(chan) };
        match (self.owned.get(&buf), key) {
            (Some(b), _) => op(end.ch.copy(b, &meta)),
            (None, Some(k)) => op(end.ch.copy(&self.copies[&k][0], &meta)),
            (None, None) => Reply::NoHandle,
        }
    }

    fn release(&mut self, chan: Chan, buf: BufferId) -> Reply {
        let Some(key) = self.held_key(buf, Some(chan)) else { return Reply::NoHandle };
        let Some(end) = self.ends.get_mut(&chan) else { return self.no_end(chan) };
        let copy = self.copies.get_mut(&key).and_then(Vec::pop).expect("non-empty");
        match end.ch.release(copy) {
            Ok(()) => Reply::Op(Ok(())),
            Err(refused) => {
                let e = lib_err(&refused.error);
                self.copies.entry(key).or_default().push(refused.into_inner());
                Reply::Op(Err(e))
            }
        }
    }

    fn full_copy(&mut self, chan: Chan, src: BufferId, dst: BufferId, meta_len: u8) -> Reply {
        // The source as the single-process harness picks it: the owned
        // handle, else a copy held; the same handle cannot be both.
        let src_owned = self.owned.contains_key(&src);
        let src_key = if src_owned { None } else { self.held_key(src, None) };
        if !src_owned && src_key.is_none() {
            return Reply::NoHandle;
        }
        if src_owned && src == dst {
            return Reply::NoHandle;
        }
        let Some(end) = self.ends.get_mut(&chan) else { return self.no_end(chan) };
        let Some(d) = self.owned.remove(&dst) else { return Reply::NoHandle };
        let meta = meta_bytes(usize::from(meta_len));
        let r = match src_key {
            None => end.ch.full_copy(&self.owned[&src], d, &meta),
            Some(k) => end.ch.full_copy(&self.copies[&k][0], d, &meta),
        };
        match r {
            Ok(()) => Reply::Op(Ok(())),
            Err(refused) => {
                let e = lib_err(&refused.error);
                self.owned.insert(dst, refused.into_inner());
                Reply::Op(Err(e))
            }
        }
    }

    /// `send_aggregate` as the single-process harness does it: per member
    /// the owned handle (stamped first when writable), else a copy held;
    /// two fragments of each buffer, interleaved. A member the sender keeps
    /// (`share`, a copy, or an owned buffer not read-write here) keeps a
    /// clone of its piece, so the aggregate is not its only reference, and
    /// its handle comes back after the send; a refused aggregate comes back
    /// whole and every handle goes back where it was.
    fn send_aggregate(&mut self, chan: Chan, members: &[(BufferId, bool, u64)], meta_len: u8) -> Reply {
        if !self.ends.contains_key(&chan) {
            return self.no_end(chan);
        }
        // Every handle first, so that nothing is written when one is
        // missing; a member listed twice has no second handle.
        let missing =
            |&(buf, _, _): &(BufferId, bool, u64)| !self.owned.contains_key(&buf) && self.held_key(buf, None).is_none();
        let twice = members.iter().enumerate().any(|(i, m)| members[..i].iter().any(|x| x.0 == m.0));
        if twice || members.iter().any(missing) {
            return Reply::NoHandle;
        }
        let mut origins = Vec::with_capacity(members.len());
        let mut pieces = Vec::with_capacity(members.len());
        for &(buf, share, stamp) in members {
            if let Some(mut b) = self.owned.remove(&buf) {
                let keep = share || self.domain.buffer_state(buf) != BufferState::ReadWrite;
                if let Ok(s) = b.as_mut_slice() {
                    s[..8].copy_from_slice(&stamp.to_le_bytes());
                }
                origins.push(Origin::Owned(buf, keep));
                pieces.push(Aggregate::from(b));
            } else {
                let key = self.held_key(buf, None).expect("checked above");
                let c = self.copies.get_mut(&key).and_then(Vec::pop).expect("non-empty");
                origins.push(Origin::Copy(key));
                pieces.push(Aggregate::from(c));
            }
        }
        let keep: Vec<bool> = origins.iter().map(|o| o.kept()).collect();
        let (msg, kept) = harness_aggregate(pieces, &keep);
        let meta = meta_bytes(usize::from(meta_len));
        let end = self.ends.get_mut(&chan).expect("checked");
        match end.ch.send_aggregate(msg, &meta) {
            Ok(()) => {
                let (origins, pieces): (Vec<Origin>, Vec<Aggregate>) =
                    origins.into_iter().zip(kept).filter_map(|(o, k)| k.map(|k| (o, k))).unzip();
                self.put_back(&origins, pieces);
                Reply::Op(Ok(()))
            }
            Err(refused) => {
                let e = lib_err(&refused.error);
                drop(kept);
                self.put_back(&origins, pieces_of_refused(refused.into_inner()));
                Reply::Op(Err(e))
            }
        }
    }

    /// Return the handles in `pieces` (one buffer each) to where `origins`
    /// say they came from.
    fn put_back(&mut self, origins: &[Origin], pieces: Vec<Aggregate>) {
        for (o, p) in origins.iter().zip(pieces) {
            let mut m = p.into_members().expect("the only reference");
            match (o, m.pop()) {
                (Origin::Owned(buf, _), Some(Member::Buffer(b))) => {
                    self.owned.insert(*buf, b);
                }
                (Origin::Copy(key), Some(Member::Copy(c))) => self.copies.entry(*key).or_default().push(c),
                (o, m) => panic!("d{}: {o:?} came back as {m:?}", self.d),
            }
        }
    }

    fn deliver(&mut self, chan: Chan, wait_ms: u32) -> Reply {
        let Some(end) = self.ends.get_mut(&chan) else { return self.no_end(chan) };
        let t = Instant::now();
        let ev =
            if wait_ms == 0 { end.ch.poll() } else { end.ch.wait(Some(Duration::from_millis(wait_ms.into()))).ok() };
        let elapsed_ms = t.elapsed().as_millis().min(u32::MAX.into()) as u32;
        let event = ev.map(|ev| self.keep(chan, ev));
        Reply::Event { event, elapsed_ms }
    }

    /// Describe an event for the coordinator, keeping the handles it brings.
    fn keep(&mut self, chan: Chan, ev: Event) -> Ev {
        match ev {
            Event::MoveReceived { buffer, meta } => {
                let (buf, content) = (buffer.id(), first8(&buffer));
                self.owned.insert(buf, buffer);
                Ev::MoveReceived { buf, meta: meta.to_vec(), content }
            }
            Event::BufferPassed { buffer, meta } => {
                let (buf, content) = (buffer.id(), first8(&buffer));
                self.owned.insert(buf, buffer);
                Ev::BufferPassed { buf, meta: meta.to_vec(), content }
            }
            Event::CopyReceived { copy, meta } => {
                let (buf, content) = (copy.id(), first8(&copy));
                self.copies.entry((buf, chan)).or_default().push(copy);
                Ev::CopyReceived { buf, meta: meta.to_vec(), content }
            }
            Event::CopyReleased { buffer, writable } => Ev::CopyReleased { buf: buffer, writable },
            Event::PoolAssignRequest(req) => Ev::PoolAssignRequest { pool: req.pool, trust: req.trust },
            Event::PoolAssigned(p) => Ev::PoolAssigned(p),
            Event::PoolVetoed(p) => Ev::PoolVetoed(p),
            Event::PoolRemoved(p) => Ev::PoolRemoved(p),
            Event::PoolRemoveRefused(p) => Ev::PoolRemoveRefused(p),
            Event::Closed { by_peer } => Ev::Closed { by_peer },
            Event::BindRequest { .. } => Ev::BindRequest,
            Event::Bound => Ev::Bound,
            Event::Error(e) => Ev::Error { peer_gone: e == ErrorKind::PeerGone, text: format!("{e:?}") },
            // The model's pools stay far below the channel's limits.
            Event::PoolOfferRefused { reason, .. } => Ev::Error { peer_gone: false, text: format!("{reason:?}") },
            Event::Aggregate { agg, meta } => match agg.into_members() {
                Ok(got) => {
                    let members = got
                        .into_iter()
                        .map(|m| match m {
                            Member::Buffer(b) => {
                                let (buf, content) = (b.id(), first8(&b));
                                self.owned.insert(buf, b);
                                (buf, true, content)
                            }
                            Member::Copy(c) => {
                                let (buf, content) = (c.id(), first8(&c));
                                self.copies.entry((buf, chan)).or_default().push(c);
                                (buf, false, content)
                            }
                        })
                        .collect();
                    Ev::Aggregate { members, meta: meta.to_vec() }
                }
                Err(a) => Ev::Error { peer_gone: false, text: format!("received {a:?} shares its buffers") },
            },
        }
    }

    fn state(&self, bufs: &[BufferId], pools: &[ferry::PoolId]) -> StateReport {
        let st = |b: &BufferId| self.domain.buffer_state(*b);
        let mut owned: Vec<_> = self.owned.iter().map(|(id, b)| (*id, readable(st(id)).then(|| first8(b)))).collect();
        owned.sort_by_key(|(id, _)| (id.pool, id.index));
        let copies = self
            .copies
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|((id, c), v)| (*id, *c, v.len() as u32, readable(st(id)).then(|| first8(&v[0]))))
            .collect();
        let ends = self
            .ends
            .iter()
            .map(|(c, e)| EndReport {
                chan: *c,
                state: e.ch.state(),
                assigned: pools.iter().map(|p| e.ch.is_assigned(*p)).collect(),
            })
            .collect();
        let pools = self
            .domain
            .pools()
            .into_iter()
            .map(|p| (p, self.domain.pool_trust(p).expect("listed pool has a trust level")))
            .collect();
        StateReport { bufs: bufs.iter().map(st).collect(), owned, copies, ends, pools }
    }
}
