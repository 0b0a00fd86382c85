//! The command protocol between the coordinator (the test process, which
//! runs the model) and the domain processes. One frame per message: a
//! little-endian `u32` length, then the body; a body starts with a tag
//! byte. Encoded by hand (a few dozen lines, no dependency); integers are
//! little-endian, a list or byte string is a `u32` count then its items.
//!
//! The coordinator sends one [`Cmd`] and reads one [`Reply`]; a domain
//! process handles commands one at a time, in order.

use std::io::{self, Read, Write};

use ferry::{BufferId, BufferState, ChannelState, PoolId, TrustLevel};

use crate::model::reference::Reject;

/// A channel, as the model numbers it.
pub type Chan = u32;

/// What the coordinator asks a domain process to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Cmd {
    /// Drop every channel end, handle, allocator and the domain; start again
    /// with a fresh domain. Answered with [`Reply::Reset`].
    Reset,
    /// Create a pool of `count` buffers and take every buffer out of it
    /// (buffer `i` has index `i`). Answered with [`Reply::Pool`].
    CreatePool { count: u32 },
    /// Create the source (TX) end of `chan` on the abstract endpoint `name`.
    Listen { chan: Chan, name: String, trust: TrustLevel },
    /// Bind the sink end of `chan` to the abstract endpoint `name`.
    Bind { chan: Chan, name: String },
    /// Wait for the end of `chan` to connect (creator: `BindRequest`,
    /// binder: `Bound`).
    AwaitConnect { chan: Chan },
    /// `assign_pool` with this domain's handle of `pool` (none: [`Reply::NoHandle`]).
    Assign { chan: Chan, pool: PoolId },
    /// `respond_pool`.
    Respond { chan: Chan, pool: PoolId, accept: bool },
    /// `remove_pool`.
    Remove { chan: Chan, pool: PoolId },
    /// Write `stamp` into the first 8 bytes of the owned buffer (when it is
    /// read-write), then `move_buffer` it.
    Move { chan: Chan, buf: BufferId, meta_len: u8, stamp: u64 },
    /// As `Move`, with `pass`.
    Pass { chan: Chan, buf: BufferId, meta_len: u8, stamp: u64 },
    /// `copy` from the owned buffer, else from a copy held (lowest channel).
    Copy { chan: Chan, buf: BufferId, meta_len: u8 },
    /// `release` the copy held via `chan`, else one held via another channel.
    Release { chan: Chan, buf: BufferId },
    /// `full_copy` from `src` (owned, else a copy) into the owned `dst`.
    FullCopy { chan: Chan, src: BufferId, dst: BufferId, meta_len: u8 },
    /// `teardown`.
    Teardown { chan: Chan },
    /// `poll` (`wait_ms == 0`) or `wait` up to `wait_ms` on the end of `chan`;
    /// handles that arrive are kept. Answered with [`Reply::Event`].
    Deliver { chan: Chan, wait_ms: u32 },
    /// The library's view: `buffer_state` of `bufs`, every handle held,
    /// every channel end with `is_assigned` of `pools`, the pool list.
    State { bufs: Vec<BufferId>, pools: Vec<PoolId> },
    /// Take every free buffer of `pool` (`Domain::alloc`), write `stamp`
    /// into each and read it back; keep them. Answered with [`Reply::Allocated`].
    AllocFree { pool: PoolId, stamp: u64 },
    /// `set_batching(true)` on the end of `chan`.
    Batching { chan: Chan },
    /// `flush` the end of `chan`.
    Flush { chan: Chan },
    /// `send_aggregate` of the handles held for `members` (buffer, whether
    /// the sender keeps a reference, the stamp written into it first when
    /// it is writable), two fragments of each, interleaved (none held for
    /// some member: [`Reply::NoHandle`], nothing written).
    SendAggregate { chan: Chan, members: Vec<(BufferId, bool, u64)>, meta_len: u8 },
}

/// An error the library returned, as the model names it (if it does).
#[derive(Debug, Clone, PartialEq)]
pub struct LibError {
    /// The model's name (None: an error the model has no counterpart for).
    pub reject: Option<Reject>,
    /// The library's `Debug` of the error.
    pub text: String,
}

/// An event, with what the coordinator checks of it.
#[derive(Debug, Clone, PartialEq)]
pub enum Ev {
    /// `MoveReceived`; `content`: the first 8 bytes as the receiver reads them.
    MoveReceived { buf: BufferId, meta: Vec<u8>, content: u64 },
    /// `BufferPassed`.
    BufferPassed { buf: BufferId, meta: Vec<u8>, content: u64 },
    /// `CopyReceived`.
    CopyReceived { buf: BufferId, meta: Vec<u8>, content: u64 },
    /// `CopyReleased`.
    CopyReleased { buf: BufferId, writable: bool },
    /// `PoolAssignRequest`.
    PoolAssignRequest { pool: PoolId, trust: TrustLevel },
    /// `PoolAssigned`.
    PoolAssigned(PoolId),
    /// `PoolVetoed`.
    PoolVetoed(PoolId),
    /// `PoolRemoved`.
    PoolRemoved(PoolId),
    /// `PoolRemoveRefused`.
    PoolRemoveRefused(PoolId),
    /// `Closed`.
    Closed { by_peer: bool },
    /// `BindRequest`.
    BindRequest,
    /// `Bound`.
    Bound,
    /// `Error`; `peer_gone`: it is `ErrorKind::PeerGone`.
    Error { peer_gone: bool, text: String },
    /// `Aggregate`, taken apart into handles: per member in the order of its
    /// first fragment, the buffer, whether it was moved (an owned handle,
    /// else a copy) and its first 8 bytes as the receiver reads them.
    Aggregate { members: Vec<(BufferId, bool, u64)>, meta: Vec<u8> },
}

/// One channel end in a [`StateReport`].
#[derive(Debug, Clone, PartialEq)]
pub struct EndReport {
    /// The channel.
    pub chan: Chan,
    /// `state()`.
    pub state: ChannelState,
    /// `is_assigned` of each pool of the query, in order.
    pub assigned: Vec<bool>,
}

/// A domain process's answer to [`Cmd::State`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StateReport {
    /// `buffer_state` of each buffer of the query, in order.
    pub bufs: Vec<BufferState>,
    /// The owned handles held, with the first 8 bytes of each (None when
    /// the domain says the buffer is not readable here: not read).
    pub owned: Vec<(BufferId, Option<u64>)>,
    /// The copies held: buffer, channel received on, how many, content.
    pub copies: Vec<(BufferId, Chan, u32, Option<u64>)>,
    /// Every channel end.
    pub ends: Vec<EndReport>,
    /// `pools()` with `pool_trust` of each.
    pub pools: Vec<(PoolId, TrustLevel)>,
}

/// A domain process's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// First frame of a domain process: which domain it is.
    Hello { domain: u32 },
    /// An operation ran: accepted, or refused with an error.
    Op(Result<(), LibError>),
    /// The process holds no handle to express the operation with.
    NoHandle,
    /// The new pool's id.
    Pool(PoolId),
    /// What `poll`/`wait` returned, and how long it took.
    Event { event: Option<Ev>, elapsed_ms: u32 },
    /// The library's view.
    State(StateReport),
    /// Indices taken by [`Cmd::AllocFree`]; each flag: the stamp read back.
    Allocated(Vec<(u32, bool)>),
    /// Reset done; the process has this many file descriptors open.
    Reset { fds: u32 },
    /// The command could not be carried out (a harness failure).
    Failed(String),
}

// ------------------------------------------------------------------ frames

/// Write one frame.
pub fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    w.write_all(&frame)
}

/// Read one frame (`UnexpectedEof` when the peer closed between frames).
pub fn read_frame(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 1 << 24 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "frame too long"));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

// ------------------------------------------------------------------ coding

/// Every `Reject`, numbered by position (the wire code).
const REJECTS: [Reject; 19] = Reject::ALL;

const TRUSTS: [TrustLevel; 4] = [TrustLevel::Uninitialized, TrustLevel::None, TrustLevel::Half, TrustLevel::Full];
const BUFFER_STATES: [BufferState; 4] =
    [BufferState::Invalid, BufferState::ReadOnly, BufferState::ReadOnlyOwned, BufferState::ReadWrite];
const CHANNEL_STATES: [ChannelState; 7] = [
    ChannelState::Uninitialized,
    ChannelState::Initialized,
    ChannelState::Binding,
    ChannelState::BindNegotiate,
    ChannelState::Connected,
    ChannelState::Teardown,
    ChannelState::Closed,
];

fn code_of<T: PartialEq + std::fmt::Debug>(table: &[T], v: &T) -> u8 {
    table.iter().position(|t| t == v).unwrap_or_else(|| panic!("{v:?} has no wire code")) as u8
}

/// A body being written.
#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(v as u8)
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
    fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    fn pool(&mut self, v: PoolId) -> &mut Self {
        self.0.extend_from_slice(&v.as_u128().to_le_bytes());
        self
    }
    fn buf(&mut self, v: BufferId) -> &mut Self {
        self.pool(v.pool).u32(v.index)
    }
    fn trust(&mut self, v: TrustLevel) -> &mut Self {
        self.u8(code_of(&TRUSTS, &v))
    }
    fn opt_u64(&mut self, v: Option<u64>) -> &mut Self {
        match v {
            Some(v) => self.u8(1).u64(v),
            None => self.u8(0),
        }
    }
    /// Aggregate members: buffer, flag, first 8 bytes.
    fn members(&mut self, v: &[(BufferId, bool, u64)]) -> &mut Self {
        self.u32(v.len() as u32);
        for &(b, flag, word) in v {
            self.buf(b).bool(flag).u64(word);
        }
        self
    }
}

/// A body being read.
struct Dec<'a> {
    b: &'a [u8],
    at: usize,
}

type DResult<T> = Result<T, String>;

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> DResult<&'a [u8]> {
        let s = self.b.get(self.at..self.at + n).ok_or_else(|| format!("body ends at {} of {}", self.at, n))?;
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self) -> DResult<u8> {
        Ok(self.take(1)?[0])
    }
    fn bool(&mut self) -> DResult<bool> {
        Ok(self.u8()? != 0)
    }
    fn u32(&mut self) -> DResult<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> DResult<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn bytes(&mut self) -> DResult<Vec<u8>> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn str(&mut self) -> DResult<String> {
        String::from_utf8(self.bytes()?).map_err(|e| e.to_string())
    }
    fn pool(&mut self) -> DResult<PoolId> {
        Ok(PoolId::from_u128(u128::from_le_bytes(self.take(16)?.try_into().unwrap())))
    }
    fn buf(&mut self) -> DResult<BufferId> {
        Ok(BufferId { pool: self.pool()?, index: self.u32()? })
    }
    fn coded<T: Copy>(&mut self, table: &[T]) -> DResult<T> {
        let c = self.u8()?;
        table.get(usize::from(c)).copied().ok_or_else(|| format!("bad code {c}"))
    }
    fn trust(&mut self) -> DResult<TrustLevel> {
        self.coded(&TRUSTS)
    }
    fn opt_u64(&mut self) -> DResult<Option<u64>> {
        Ok(if self.bool()? { Some(self.u64()?) } else { None })
    }
    fn list<T>(&mut self, mut item: impl FnMut(&mut Self) -> DResult<T>) -> DResult<Vec<T>> {
        let n = self.u32()?;
        (0..n).map(|_| item(self)).collect()
    }
    fn members(&mut self) -> DResult<Vec<(BufferId, bool, u64)>> {
        self.list(|d| Ok((d.buf()?, d.bool()?, d.u64()?)))
    }
    fn end(&self) -> DResult<()> {
        if self.at == self.b.len() {
            Ok(())
        } else {
            Err(format!("{} bytes left over", self.b.len() - self.at))
        }
    }
}

impl Cmd {
    /// The frame body.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        match self {
            Cmd::Reset => e.u8(0),
            Cmd::CreatePool { count } => e.u8(1).u32(*count),
            Cmd::Listen { chan, name, trust } => e.u8(2).u32(*chan).str(name).trust(*trust),
            Cmd::Bind { chan, name } => e.u8(3).u32(*chan).str(name),
            Cmd::AwaitConnect { chan } => e.u8(4).u32(*chan),
            Cmd::Assign { chan, pool } => e.u8(5).u32(*chan).pool(*pool),
            Cmd::Respond { chan, pool, accept } => e.u8(6).u32(*chan).pool(*pool).bool(*accept),
            Cmd::Remove { chan, pool } => e.u8(7).u32(*chan).pool(*pool),
            Cmd::Move { chan, buf, meta_len, stamp } => e.u8(8).u32(*chan).buf(*buf).u8(*meta_len).u64(*stamp),
            Cmd::Pass { chan, buf, meta_len, stamp } => e.u8(9).u32(*chan).buf(*buf).u8(*meta_len).u64(*stamp),
            Cmd::Copy { chan, buf, meta_len } => e.u8(10).u32(*chan).buf(*buf).u8(*meta_len),
            Cmd::Release { chan, buf } => e.u8(11).u32(*chan).buf(*buf),
            Cmd::FullCopy { chan, src, dst, meta_len } => e.u8(12).u32(*chan).buf(*src).buf(*dst).u8(*meta_len),
            Cmd::Teardown { chan } => e.u8(13).u32(*chan),
            Cmd::Deliver { chan, wait_ms } => e.u8(14).u32(*chan).u32(*wait_ms),
            Cmd::State { bufs, pools } => {
                e.u8(15).u32(bufs.len() as u32);
                for b in bufs {
                    e.buf(*b);
                }
                e.u32(pools.len() as u32);
                for p in pools {
                    e.pool(*p);
                }
                &mut e
            }
            Cmd::AllocFree { pool, stamp } => e.u8(16).pool(*pool).u64(*stamp),
            Cmd::Batching { chan } => e.u8(17).u32(*chan),
            Cmd::Flush { chan } => e.u8(18).u32(*chan),
            Cmd::SendAggregate { chan, members, meta_len } => e.u8(19).u32(*chan).u8(*meta_len).members(members),
        };
        e.0
    }

    /// Parse a frame body.
    pub fn decode(body: &[u8]) -> DResult<Cmd> {
        let mut d = Dec { b: body, at: 0 };
        let cmd = match d.u8()? {
            0 => Cmd::Reset,
            1 => Cmd::CreatePool { count: d.u32()? },
            2 => Cmd::Listen { chan: d.u32()?, name: d.str()?, trust: d.trust()? },
            3 => Cmd::Bind { chan: d.u32()?, name: d.str()? },
            4 => Cmd::AwaitConnect { chan: d.u32()? },
            5 => Cmd::Assign { chan: d.u32()?, pool: d.pool()? },
            6 => Cmd::Respond { chan: d.u32()?, pool: d.pool()?, accept: d.bool()? },
            7 => Cmd::Remove { chan: d.u32()?, pool: d.pool()? },
            8 => Cmd::Move { chan: d.u32()?, buf: d.buf()?, meta_len: d.u8()?, stamp: d.u64()? },
            9 => Cmd::Pass { chan: d.u32()?, buf: d.buf()?, meta_len: d.u8()?, stamp: d.u64()? },
            10 => Cmd::Copy { chan: d.u32()?, buf: d.buf()?, meta_len: d.u8()? },
            11 => Cmd::Release { chan: d.u32()?, buf: d.buf()? },
            12 => Cmd::FullCopy { chan: d.u32()?, src: d.buf()?, dst: d.buf()?, meta_len: d.u8()? },
            13 => Cmd::Teardown { chan: d.u32()? },
            14 => Cmd::Deliver { chan: d.u32()?, wait_ms: d.u32()? },
            15 => Cmd::State { bufs: d.list(Dec::buf)?, pools: d.list(Dec::pool)? },
            16 => Cmd::AllocFree { pool: d.pool()?, stamp: d.u64()? },
            17 => Cmd::Batching { chan: d.u32()? },
            18 => Cmd::Flush { chan: d.u32()? },
            19 => Cmd::SendAggregate { chan: d.u32()?, meta_len: d.u8()?, members: d.members()? },
            t => return Err(format!("unknown command tag {t}")),
        };
        d.end()?;
        Ok(cmd)
    }
}

impl Ev {
    fn encode(&self, e: &mut Enc) {
        match self {
            Ev::MoveReceived { buf, meta, content } => e.u8(0).buf(*buf).bytes(meta).u64(*content),
            Ev::BufferPassed { buf, meta, content } => e.u8(1).buf(*buf).bytes(meta).u64(*content),
            Ev::CopyReceived { buf, meta, content } => e.u8(2).buf(*buf).bytes(meta).u64(*content),
            Ev::CopyReleased { buf, writable } => e.u8(3).buf(*buf).bool(*writable),
            Ev::PoolAssignRequest { pool, trust } => e.u8(4).pool(*pool).trust(*trust),
            Ev::PoolAssigned(p) => e.u8(5).pool(*p),
            Ev::PoolVetoed(p) => e.u8(6).pool(*p),
            Ev::PoolRemoved(p) => e.u8(7).pool(*p),
            Ev::PoolRemoveRefused(p) => e.u8(8).pool(*p),
            Ev::Closed { by_peer } => e.u8(9).bool(*by_peer),
            Ev::BindRequest => e.u8(10),
            Ev::Bound => e.u8(11),
            Ev::Error { peer_gone, text } => e.u8(12).bool(*peer_gone).str(text),
            Ev::Aggregate { members, meta } => e.u8(13).bytes(meta).members(members),
        };
    }

    fn decode(d: &mut Dec) -> DResult<Ev> {
        Ok(match d.u8()? {
            0 => Ev::MoveReceived { buf: d.buf()?, meta: d.bytes()?, content: d.u64()? },
            1 => Ev::BufferPassed { buf: d.buf()?, meta: d.bytes()?, content: d.u64()? },
            2 => Ev::CopyReceived { buf: d.buf()?, meta: d.bytes()?, content: d.u64()? },
            3 => Ev::CopyReleased { buf: d.buf()?, writable: d.bool()? },
            4 => Ev::PoolAssignRequest { pool: d.pool()?, trust: d.trust()? },
            5 => Ev::PoolAssigned(d.pool()?),
            6 => Ev::PoolVetoed(d.pool()?),
            7 => Ev::PoolRemoved(d.pool()?),
            8 => Ev::PoolRemoveRefused(d.pool()?),
            9 => Ev::Closed { by_peer: d.bool()? },
            10 => Ev::BindRequest,
            11 => Ev::Bound,
            12 => Ev::Error { peer_gone: d.bool()?, text: d.str()? },
            13 => Ev::Aggregate { meta: d.bytes()?, members: d.members()? },
            t => return Err(format!("unknown event tag {t}")),
        })
    }
}

impl Reply {
    /// The frame body.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        match self {
            Reply::Hello { domain } => {
                e.u8(0).u32(*domain);
            }
            Reply::Op(Ok(())) => {
                e.u8(1);
            }
            Reply::Op(Err(err)) => {
                let code = err.reject.map_or(u8::MAX, |r| code_of(&REJECTS, &r));
                e.u8(2).u8(code).str(&err.text);
            }
            Reply::NoHandle => {
                e.u8(3);
            }
            Reply::Pool(p) => {
                e.u8(4).pool(*p);
            }
            Reply::Event { event, elapsed_ms } => {
                e.u8(5).u32(*elapsed_ms);
                match event {
                    Some(ev) => ev.encode(e.u8(1)),
                    None => {
                        e.u8(0);
                    }
                }
            }
            Reply::State(s) => {
                e.u8(6).u32(s.bufs.len() as u32);
                for b in &s.bufs {
                    e.u8(code_of(&BUFFER_STATES, b));
                }
                e.u32(s.owned.len() as u32);
                for (b, c) in &s.owned {
                    e.buf(*b).opt_u64(*c);
                }
                e.u32(s.copies.len() as u32);
                for (b, chan, n, c) in &s.copies {
                    e.buf(*b).u32(*chan).u32(*n).opt_u64(*c);
                }
                e.u32(s.ends.len() as u32);
                for end in &s.ends {
                    e.u32(end.chan).u8(code_of(&CHANNEL_STATES, &end.state)).u32(end.assigned.len() as u32);
                    for a in &end.assigned {
                        e.bool(*a);
                    }
                }
                e.u32(s.pools.len() as u32);
                for (p, t) in &s.pools {
                    e.pool(*p).trust(*t);
                }
            }
            Reply::Allocated(v) => {
                e.u8(7).u32(v.len() as u32);
                for (i, ok) in v {
                    e.u32(*i).bool(*ok);
                }
            }
            Reply::Reset { fds } => {
                e.u8(8).u32(*fds);
            }
            Reply::Failed(msg) => {
                e.u8(9).str(msg);
            }
        }
        e.0
    }

    /// Parse a frame body.
    pub fn decode(body: &[u8]) -> DResult<Reply> {
        let mut d = Dec { b: body, at: 0 };
        let reply = match d.u8()? {
            0 => Reply::Hello { domain: d.u32()? },
            1 => Reply::Op(Ok(())),
            2 => {
                let reject = match d.u8()? {
                    u8::MAX => None,
                    c => Some(*REJECTS.get(usize::from(c)).ok_or_else(|| format!("bad reject code {c}"))?),
                };
                Reply::Op(Err(LibError { reject, text: d.str()? }))
            }
            3 => Reply::NoHandle,
            4 => Reply::Pool(d.pool()?),
            5 => {
                let elapsed_ms = d.u32()?;
                let event = if d.bool()? { Some(Ev::decode(&mut d)?) } else { None };
                Reply::Event { event, elapsed_ms }
            }
            6 => Reply::State(StateReport {
                bufs: d.list(|d| d.coded(&BUFFER_STATES))?,
                owned: d.list(|d| Ok((d.buf()?, d.opt_u64()?)))?,
                copies: d.list(|d| Ok((d.buf()?, d.u32()?, d.u32()?, d.opt_u64()?)))?,
                ends: d.list(|d| {
                    Ok(EndReport { chan: d.u32()?, state: d.coded(&CHANNEL_STATES)?, assigned: d.list(Dec::bool)? })
                })?,
                pools: d.list(|d| Ok((d.pool()?, d.trust()?)))?,
            }),
            7 => Reply::Allocated(d.list(|d| Ok((d.u32()?, d.bool()?)))?),
            8 => Reply::Reset { fds: d.u32()? },
            9 => Reply::Failed(d.str()?),
            t => return Err(format!("unknown reply tag {t}")),
        };
        d.end()?;
        Ok(reply)
    }
}
