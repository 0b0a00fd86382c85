//! The library's messages and their encoding into fixed-size descriptor
//! slots. Every message of a channel direction travels in one ordered stream
//! ([ETH-BT]'s data queue source→sink and control queue sink→source), so a
//! teardown marker or a pool removal can never overtake a buffer.
//!
//! Slot layout (little endian; slot size is a power of two ≥ 64):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | opcode |
//! | 1 | 1 | flags (accept bit, trust level) |
//! | 2 | 2 | meta length |
//! | 4 | 4 | buffer index / buffer count |
//! | 8 | 8 | aux (buffer size for pool assignment) |
//! | 16 | 16 | pool id |
//! | 32 | meta length | meta data |
//!
//! `decode` checks everything a peer could get wrong; the channel then checks
//! what needs its state (pool assigned, index in range, buffer ownership).

use crate::ErrorKind;
use std::fmt;
use std::ops::Deref;

use crate::error::Error;
use crate::pool::BufferId;
use crate::pool::{Geometry, PoolId, TrustLevel};

/// Size of the fixed slot header.
pub(crate) const HEADER: usize = 32;

/// Largest meta-data size a channel can have (a 256-byte slot).
pub const MAX_META_SIZE: usize = 224;

/// Slot size for a channel with `meta_size` bytes of meta data.
pub(crate) fn slot_size(meta_size: usize) -> u32 {
    (HEADER + meta_size.max(32)).next_power_of_two().max(64) as u32
}

/// Meta data up to this many bytes is stored inline in a [`Meta`];
/// longer meta data (channels with a meta size above it) is allocated.
pub const META_INLINE: usize = 46;

/// Meta data carried with a buffer (block number, request id, length...),
/// at most the channel's meta size. Reads as a byte slice.
///
/// Up to [`META_INLINE`] bytes live in the value itself, so a `Meta` (and
/// an [`Event`](crate::Event) carrying one) stays small and cheap to move;
/// longer meta data (up to [`MAX_META_SIZE`]) is kept in a heap allocation.
#[derive(Clone)]
pub struct Meta(MetaRepr);

#[derive(Clone)]
enum MetaRepr {
    Inline { len: u8, bytes: [u8; META_INLINE] },
    Heap(Box<[u8]>),
}

// Small enough to move around freely (it was 225 bytes, and copying it
// several times per message showed up at 13% of a throughput profile).
const _: () = assert!(std::mem::size_of::<Meta>() <= 48);

impl Meta {
    /// Meta data from a slice (`None` if longer than [`MAX_META_SIZE`]).
    pub fn new(data: &[u8]) -> Option<Meta> {
        if data.len() > MAX_META_SIZE {
            return None;
        }
        if data.len() > META_INLINE {
            return Some(Meta(MetaRepr::Heap(data.into())));
        }
        let mut bytes = [0; META_INLINE];
        bytes[..data.len()].copy_from_slice(data);
        Some(Meta(MetaRepr::Inline { len: data.len() as u8, bytes }))
    }

    /// The first `len` bytes of `src` (`len <= src.len()`, `len <=
    /// MAX_META_SIZE`). Short meta data is copied as a fixed 32-byte block
    /// when `src` has that many bytes (no call to a variable-length copy);
    /// the bytes past `len` are then whatever followed in `src`, which no
    /// reader of a `Meta` ever sees.
    #[inline(always)]
    fn from_prefix(src: &[u8], len: usize) -> Meta {
        const BLOCK: usize = 32;
        debug_assert!(len <= src.len() && len <= MAX_META_SIZE);
        if len <= BLOCK && src.len() >= BLOCK {
            let mut bytes = [0; META_INLINE];
            bytes[..BLOCK].copy_from_slice(&src[..BLOCK]);
            return Meta(MetaRepr::Inline { len: len as u8, bytes });
        }
        Meta::new(&src[..len]).expect("length checked by the caller")
    }

    /// The meta data padded to a 32-byte block with the bytes that follow
    /// it inline (see [`Meta::from_prefix`]), if it is that short.
    fn block(&self) -> Option<&[u8; 32]> {
        match &self.0 {
            MetaRepr::Inline { len, bytes } if *len <= 32 => bytes[..32].try_into().ok(),
            _ => None,
        }
    }

    /// Empty meta data.
    pub const fn empty() -> Meta {
        Meta(MetaRepr::Inline { len: 0, bytes: [0; META_INLINE] })
    }
}

impl Default for Meta {
    fn default() -> Self {
        Meta::empty()
    }
}

impl Deref for Meta {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            MetaRepr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            MetaRepr::Heap(bytes) => bytes,
        }
    }
}

impl fmt::Debug for Meta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Meta({:02x?})", &**self)
    }
}

impl PartialEq for Meta {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}
impl Eq for Meta {}

/// A library message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    /// [ETH-BT] Algorithm 7 (data queue).
    Move { buf: BufferId, meta: Meta },
    /// [ETH-BT] Algorithm 9 (data queue).
    Copy { buf: BufferId, meta: Meta },
    /// [ETH-BT] Algorithm 8 (control queue).
    Pass { buf: BufferId, meta: Meta },
    /// [ETH-BT] Algorithm 10 (control queue).
    Release { buf: BufferId },
    /// Phase one of a pool assignment (Algorithm 6, §5.2.3).
    AssignRequest { pool: PoolId, geometry: Geometry, trust: TrustLevel },
    /// Phase two: the peer accepted or vetoed.
    AssignReply { pool: PoolId, accepted: bool },
    /// Ask the peer to drop a pool from the channel.
    RemoveRequest { pool: PoolId },
    /// The peer dropped the pool (or refused: it still has copies).
    RemoveReply { pool: PoolId, accepted: bool },
    /// No more messages follow from this side (teardown marker).
    Teardown,
    /// The head of an aggregate run (data queue): `members` member slots
    /// follow (a move or a copy per distinct buffer, without meta data),
    /// then the fragment table of `frags` entries covering `total` bytes.
    AggHeader { members: u32, frags: u32, total: u64, meta: Meta },
    /// Entries of an aggregate's fragment table, the first being entry
    /// number `first`.
    AggFrags { first: u32, entries: Vec<FragEntry> },
}

/// One entry of an aggregate's fragment table: `len` bytes from byte
/// `offset` of the run's member number `member`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FragEntry {
    /// Ordinal of the member slot (0-based, in the order they were sent).
    pub member: u32,
    /// First byte in the member's buffer.
    pub offset: u64,
    /// Length in bytes (never zero).
    pub len: u64,
}

/// Bytes of one fragment-table entry: member `u32`, offset and length as
/// 48-bit numbers (a buffer is at most 1 TiB).
pub(crate) const FRAG_ENTRY: usize = 16;

/// The member number of a repeat entry in a table on the wire: its
/// offset field is a group size `k`, its length field a count `n`, and it
/// stands for the `k` fragments before it repeated `n` times, each copy of
/// a fragment taking the bytes of its member right after the previous
/// copy's, with the same length (a train of units behind their headers,
/// each unit header and piece where the last ended, is a few entries).
pub(crate) const REPEAT: u32 = u32::MAX;

/// Most members (distinct buffers) one aggregate run may have.
pub(crate) const MAX_AGG_MEMBERS: u32 = 65535;

/// Most fragments one aggregate run may have.
pub(crate) const MAX_AGG_FRAGS: u32 = 1 << 20;

/// Fragment-table entries per slot on a channel with `meta_size` bytes of
/// meta data (at least two: every slot has 32 bytes after its header).
pub(crate) fn entries_per_slot(meta_size: usize) -> usize {
    (slot_size(meta_size) as usize - HEADER) / FRAG_ENTRY
}

/// Slots of an aggregate run: its header, one per member, and the table.
pub(crate) fn run_slots(members: usize, frags: usize, meta_size: usize) -> usize {
    1 + members + frags.div_ceil(entries_per_slot(meta_size))
}

/// The largest body (the bytes after the fixed header) a slot of opcode
/// `op` may carry on a channel with `meta_size` bytes of meta data; `None`
/// for an unknown opcode. Backends that frame messages themselves check
/// lengths with it.
pub(crate) fn body_limit(op: u8, meta_size: usize) -> Option<usize> {
    let meta = meta_size.min(MAX_META_SIZE);
    match op {
        OP_MOVE | OP_COPY | OP_PASS | OP_AGG => Some(meta),
        OP_AGG_FRAGS => Some(entries_per_slot(meta) * FRAG_ENTRY),
        OP_RELEASE..=OP_TEARDOWN => Some(0),
        _ => None,
    }
}

/// The fields of a slot's fixed header (the table at the top of this
/// module), read as they are: checking them is the reader's job. The TCP
/// frames of the network backends begin with the same header.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotHead {
    pub(crate) op: u8,
    pub(crate) flags: u8,
    pub(crate) meta_len: usize,
    pub(crate) index: u32,
    pub(crate) aux: u64,
    pub(crate) pool: PoolId,
}

impl SlotHead {
    /// The header at the start of `bytes` (`None` if shorter than [`HEADER`]).
    pub(crate) fn read(bytes: &[u8]) -> Option<SlotHead> {
        let h: &[u8; HEADER] = bytes.get(..HEADER)?.try_into().ok()?;
        Some(SlotHead {
            op: h[0],
            flags: h[1],
            meta_len: usize::from(u16::from_le_bytes([h[2], h[3]])),
            index: u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")),
            aux: u64::from_le_bytes(h[8..16].try_into().expect("8 bytes")),
            pool: PoolId::from_u128(u128::from_le_bytes(h[16..32].try_into().expect("16 bytes"))),
        })
    }

    /// What a backend that carries payloads asks its gate about before the
    /// payload of this move, copy or pass lands: the message without its
    /// meta data (`None` for an opcode that carries no buffer).
    pub(crate) fn payload_probe(&self) -> Option<Message> {
        let buf = BufferId { pool: self.pool, index: self.index };
        let meta = Meta::empty();
        match self.op {
            OP_MOVE => Some(Message::Move { buf, meta }),
            OP_COPY => Some(Message::Copy { buf, meta }),
            OP_PASS => Some(Message::Pass { buf, meta }),
            _ => None,
        }
    }
}

impl Message {
    /// The message's kind, for error messages.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Message::Move { .. } => "a move",
            Message::Copy { .. } => "a copy",
            Message::Pass { .. } => "a pass",
            Message::Release { .. } => "a release",
            Message::AssignRequest { .. } => "a pool offer",
            Message::AssignReply { .. } => "a pool offer's answer",
            Message::RemoveRequest { .. } => "a pool removal",
            Message::RemoveReply { .. } => "a pool removal's answer",
            Message::Teardown => "a teardown",
            Message::AggHeader { .. } => "an aggregate header",
            Message::AggFrags { .. } => "a fragment table",
        }
    }

    /// The buffer whose bytes a move, copy or pass carries.
    pub(crate) fn payload_buffer(&self) -> Option<BufferId> {
        match self {
            Message::Move { buf, .. } | Message::Copy { buf, .. } | Message::Pass { buf, .. } => Some(*buf),
            _ => None,
        }
    }
}

const OP_MOVE: u8 = 1;
const OP_COPY: u8 = 2;
const OP_PASS: u8 = 3;
const OP_RELEASE: u8 = 4;
const OP_ASSIGN: u8 = 5;
const OP_ASSIGN_REPLY: u8 = 6;
const OP_REMOVE: u8 = 7;
const OP_REMOVE_REPLY: u8 = 8;
const OP_TEARDOWN: u8 = 9;
// 10 and 11 are the TCP backend's keep-alive and goodbye frames.
const OP_AGG: u8 = 12;
const OP_AGG_FRAGS: u8 = 13;
// Bit 7 of a slot's first byte is the ring's phase bit (crate::ring): the
// opcode must not need it.
const _: () = {
    let ops = [
        OP_MOVE,
        OP_COPY,
        OP_PASS,
        OP_RELEASE,
        OP_ASSIGN,
        OP_ASSIGN_REPLY,
        OP_REMOVE,
        OP_REMOVE_REPLY,
        OP_TEARDOWN,
        OP_AGG,
        OP_AGG_FRAGS,
    ];
    let mut i = 0;
    while i < ops.len() {
        assert!(ops[i] & 0x80 == 0);
        i += 1;
    }
};

const FLAG_ACCEPT: u8 = 1;

impl Message {
    /// Encode into `slot` (zeroed, at least [`slot_size`] of the meta size).
    pub(crate) fn encode(&self, slot: &mut [u8]) {
        const NONE: &Meta = &Meta::empty();
        if let Message::AggFrags { first, entries } = self {
            slot[0] = OP_AGG_FRAGS;
            slot[2..4].copy_from_slice(&((entries.len() * FRAG_ENTRY) as u16).to_le_bytes());
            slot[4..8].copy_from_slice(&first.to_le_bytes());
            for (e, out) in entries.iter().zip(slot[HEADER..].chunks_exact_mut(FRAG_ENTRY)) {
                out[..4].copy_from_slice(&e.member.to_le_bytes());
                out[4..10].copy_from_slice(&e.offset.to_le_bytes()[..6]);
                out[10..16].copy_from_slice(&e.len.to_le_bytes()[..6]);
            }
            return;
        }
        let (op, flags, index, aux, pool, meta): (u8, u8, u32, u64, u128, &Meta) = match self {
            Message::Move { buf, meta } => (OP_MOVE, 0, buf.index, 0, buf.pool.as_u128(), meta),
            Message::Copy { buf, meta } => (OP_COPY, 0, buf.index, 0, buf.pool.as_u128(), meta),
            Message::Pass { buf, meta } => (OP_PASS, 0, buf.index, 0, buf.pool.as_u128(), meta),
            Message::Release { buf } => (OP_RELEASE, 0, buf.index, 0, buf.pool.as_u128(), NONE),
            Message::AssignRequest { pool, geometry, trust } => {
                (OP_ASSIGN, trust.to_u8() << 4, geometry.count(), geometry.buffer_size() as u64, pool.as_u128(), NONE)
            }
            Message::AssignReply { pool, accepted } => {
                (OP_ASSIGN_REPLY, if *accepted { FLAG_ACCEPT } else { 0 }, 0, 0, pool.as_u128(), NONE)
            }
            Message::RemoveRequest { pool } => (OP_REMOVE, 0, 0, 0, pool.as_u128(), NONE),
            Message::RemoveReply { pool, accepted } => {
                (OP_REMOVE_REPLY, if *accepted { FLAG_ACCEPT } else { 0 }, 0, 0, pool.as_u128(), NONE)
            }
            Message::Teardown => (OP_TEARDOWN, 0, 0, 0, 0, NONE),
            Message::AggHeader { members, frags, total, meta } => {
                (OP_AGG, 0, *members, u64::from(*frags), u128::from(*total), meta)
            }
            Message::AggFrags { .. } => unreachable!("encoded above"),
        };
        slot[0] = op;
        slot[1] = flags;
        slot[2..4].copy_from_slice(&(meta.len() as u16).to_le_bytes());
        slot[4..8].copy_from_slice(&index.to_le_bytes());
        slot[8..16].copy_from_slice(&aux.to_le_bytes());
        slot[16..32].copy_from_slice(&pool.to_le_bytes());
        match meta.block() {
            // Every slot has room for a 32-byte block after the header.
            Some(block) if slot.len() >= HEADER + block.len() => {
                slot[HEADER..HEADER + block.len()].copy_from_slice(block);
            }
            _ => slot[HEADER..HEADER + meta.len()].copy_from_slice(meta),
        }
    }

    /// Decode a slot received from a peer; `max_meta` is the channel's meta
    /// size. Anything malformed is a protocol error, never a panic.
    pub(crate) fn decode(slot: &[u8], max_meta: usize) -> Result<Message, Error> {
        let Some(SlotHead { op, flags, meta_len, index, aux, pool }) = SlotHead::read(slot) else {
            return Err(ErrorKind::Protocol(format!("slot of {} bytes is shorter than the header", slot.len())).into());
        };
        let limit = body_limit(op, max_meta).ok_or_else(|| ErrorKind::Protocol(format!("unknown opcode {op}")))?;
        if meta_len > limit {
            return Err(ErrorKind::Protocol(format!("meta length {meta_len} out of range (op {op})")).into());
        }
        if HEADER + meta_len > slot.len() {
            return Err(ErrorKind::Protocol(format!("meta length {meta_len} exceeds the slot")).into());
        }
        let meta = || Meta::from_prefix(&slot[HEADER..], meta_len);
        let buf = BufferId { pool, index };
        let accepted = flags & FLAG_ACCEPT != 0;
        Ok(match op {
            // The messages of every transfer: their meta copied in line,
            // in one place for the three.
            OP_MOVE | OP_COPY | OP_PASS => {
                let meta = Meta::from_prefix(&slot[HEADER..], meta_len);
                match op {
                    OP_MOVE => Message::Move { buf, meta },
                    OP_COPY => Message::Copy { buf, meta },
                    _ => Message::Pass { buf, meta },
                }
            }
            OP_RELEASE => Message::Release { buf },
            OP_ASSIGN => {
                let trust = TrustLevel::from_u8(flags >> 4)
                    .filter(|t| *t != TrustLevel::Uninitialized)
                    .ok_or_else(|| ErrorKind::Protocol(format!("bad trust level {}", flags >> 4)))?;
                let size = usize::try_from(aux).map_err(|_| ErrorKind::Protocol("buffer size too large".into()))?;
                let geometry = Geometry::new(size, u64::from(index))
                    .map_err(|e| ErrorKind::Protocol(format!("bad pool geometry: {e}")))?;
                Message::AssignRequest { pool, geometry, trust }
            }
            OP_ASSIGN_REPLY => Message::AssignReply { pool, accepted },
            OP_REMOVE => Message::RemoveRequest { pool },
            OP_REMOVE_REPLY => Message::RemoveReply { pool, accepted },
            OP_TEARDOWN => Message::Teardown,
            OP_AGG => {
                let frags = u32::try_from(aux)
                    .map_err(|_| ErrorKind::Protocol("aggregate table-entry count too large".into()))?;
                let total = u64::try_from(pool.as_u128())
                    .map_err(|_| ErrorKind::Protocol("aggregate length too large".into()))?;
                if flags != 0 {
                    return Err(ErrorKind::Protocol(format!("aggregate header with flags {flags:#x}")).into());
                }
                Message::AggHeader { members: index, frags, total, meta: meta() }
            }
            OP_AGG_FRAGS => {
                if flags != 0 || aux != 0 || pool.as_u128() != 0 {
                    return Err(ErrorKind::Protocol("fragment table slot with stray header fields".into()).into());
                }
                if meta_len == 0 || meta_len % FRAG_ENTRY != 0 {
                    return Err(ErrorKind::Protocol(format!("fragment table of {meta_len} bytes")).into());
                }
                let entries = slot[HEADER..HEADER + meta_len]
                    .chunks_exact(FRAG_ENTRY)
                    .map(|c| {
                        let u48 = |b: &[u8]| {
                            let mut v = [0u8; 8];
                            v[..6].copy_from_slice(b);
                            u64::from_le_bytes(v)
                        };
                        FragEntry {
                            member: u32::from_le_bytes(c[..4].try_into().expect("4 bytes")),
                            offset: u48(&c[4..10]),
                            len: u48(&c[10..16]),
                        }
                    })
                    .collect();
                Message::AggFrags { first: index, entries }
            }
            other => return Err(ErrorKind::Protocol(format!("unknown opcode {other}")).into()),
        })
    }
}

/// The receiving side of an aggregate run, as far as the slots go: the
/// header's counts, the lengths of the member buffers received so far and
/// the fragment table, each checked as it comes. Pure (no buffer, no
/// channel): the channel feeds it, and so does the fuzz target.
#[derive(Debug)]
pub(crate) struct AggRun {
    members: u32,
    frags: u32,
    total: u64,
    meta: Meta,
    member_lens: Vec<u64>,
    used: Vec<bool>,
    /// The table's entries on the wire so far.
    wire: u32,
    /// Those entries, as they came (repeat entries folded).
    wire_entries: Vec<FragEntry>,
    /// The fragments they stand for (repeat entries unfolded).
    entries: Vec<FragEntry>,
    sum: u64,
}

impl AggRun {
    /// A run announced by an [`Message::AggHeader`].
    pub(crate) fn start(members: u32, frags: u32, total: u64, meta: Meta) -> Result<AggRun, Error> {
        let bad = |what: String| Err(ErrorKind::Protocol(format!("aggregate header: {what}")).into());
        if members > MAX_AGG_MEMBERS || frags > MAX_AGG_FRAGS {
            return bad(format!("{members} members and {frags} fragments exceed the limits"));
        }
        if frags < members || (frags == 0) != (total == 0) || total < u64::from(frags) {
            return bad(format!("{members} members, {frags} fragments and {total} bytes do not fit together"));
        }
        Ok(AggRun {
            members,
            frags,
            total,
            meta,
            member_lens: Vec::new(),
            used: Vec::new(),
            wire: 0,
            wire_entries: Vec::new(),
            entries: Vec::new(),
            sum: 0,
        })
    }

    /// Whether the next slot of the run is a member.
    pub(crate) fn wants_member(&self) -> bool {
        self.member_lens.len() < self.members as usize
    }

    /// A member buffer of `len` bytes arrived.
    pub(crate) fn add_member(&mut self, len: usize) {
        debug_assert!(self.wants_member());
        self.member_lens.push(len as u64);
        self.used.push(false);
    }

    /// A slot of the fragment table arrived (all members are in).
    pub(crate) fn add_frags(&mut self, first: u32, entries: &[FragEntry]) -> Result<(), Error> {
        let bad = |what: String| Err(ErrorKind::Protocol(format!("aggregate fragment table: {what}")).into());
        if self.wants_member() {
            return bad("arrived before all members".into());
        }
        if first != self.wire {
            return bad(format!("entry {first} where entry {} was due", self.wire));
        }
        if self.wire as usize + entries.len() > self.frags as usize {
            return bad(format!("more than the {} entries announced", self.frags));
        }
        for e in entries {
            if e.member == REPEAT {
                self.repeat(e.offset, e.len)?;
                continue;
            }
            let Some(&size) = self.member_lens.get(e.member as usize) else {
                return bad(format!("member {} of {}", e.member, self.members));
            };
            if e.len == 0 || e.offset.checked_add(e.len).is_none_or(|end| end > size) {
                return bad(format!("{} bytes at {} of a {size}-byte buffer", e.len, e.offset));
            }
            if self.entries.len() >= MAX_AGG_FRAGS as usize {
                return bad(format!("more than {MAX_AGG_FRAGS} fragments"));
            }
            self.used[e.member as usize] = true;
            self.sum = self.sum.saturating_add(e.len);
            self.entries.push(*e);
        }
        self.wire += entries.len() as u32;
        self.wire_entries.extend_from_slice(entries);
        Ok(())
    }

    /// A repeat entry: the last `k` fragments repeated `n` times, each
    /// copy continuing its fragment, checked as a whole before any is
    /// added (every copy inside its member, the fragments within the
    /// limit).
    fn repeat(&mut self, k: u64, n: u64) -> Result<(), Error> {
        let bad =
            |what: String| Err(ErrorKind::Protocol(format!("aggregate fragment table: repeat entry: {what}")).into());
        let have = self.entries.len() as u64;
        if k == 0 || n == 0 || k > have {
            return bad(format!("group of {k} of the {have} fragments before it, {n} times"));
        }
        let more = k.checked_mul(n).filter(|m| have + m <= u64::from(MAX_AGG_FRAGS));
        let Some(more) = more else {
            return bad(format!("{k} fragments {n} times exceed the {MAX_AGG_FRAGS} fragments of a run"));
        };
        let group = self.entries.len() - k as usize;
        for e in &self.entries[group..] {
            // The last copy ends `n` lengths after the fragment repeated.
            let size = self.member_lens[e.member as usize];
            let end = e.len.checked_mul(n).and_then(|b| b.checked_add(e.offset)).and_then(|o| o.checked_add(e.len));
            if end.is_none_or(|end| end > size) {
                return bad(format!(
                    "{n} more times {} bytes after {} pass the end of a {size}-byte buffer",
                    e.len, e.offset
                ));
            }
            self.sum = self.sum.saturating_add(e.len.saturating_mul(n));
        }
        self.entries.reserve(more as usize);
        for _ in 0..n {
            for j in 0..k as usize {
                let prev = self.entries[self.entries.len() - k as usize];
                debug_assert_eq!(prev.member, self.entries[group + j].member);
                self.entries.push(FragEntry { offset: prev.offset + prev.len, ..prev });
            }
        }
        Ok(())
    }

    /// Whether every slot of the run is in.
    pub(crate) fn is_complete(&self) -> bool {
        !self.wants_member() && self.wire == self.frags
    }

    /// The meta data and the table of a complete run, once the whole is
    /// checked: the lengths add up to the announced total, and every member
    /// is in the table.
    /// Also the table as it came on the wire (valid to send on with the
    /// members in the order they came).
    #[allow(clippy::type_complexity)]
    pub(crate) fn finish(self) -> Result<(Meta, Vec<FragEntry>, Vec<FragEntry>), Error> {
        debug_assert!(self.is_complete());
        if self.sum != self.total {
            return Err(ErrorKind::Protocol(format!(
                "aggregate of {} bytes announced as {} bytes",
                self.sum, self.total
            ))
            .into());
        }
        if let Some(m) = self.used.iter().position(|u| !u) {
            return Err(ErrorKind::Protocol(format!("aggregate member {m} is in no fragment")).into());
        }
        Ok((self.meta, self.entries, self.wire_entries))
    }
}

/// Whether fragment `next` continues fragment `prev`: the bytes of the
/// same member right after it, as many.
fn continues(prev: &FragEntry, next: &FragEntry) -> bool {
    next.member == prev.member && next.len == prev.len && prev.offset.checked_add(prev.len) == Some(next.offset)
}

/// Largest group a sender folds into a repeat entry.
const MAX_GROUP: usize = 4;

/// A fragment table as it goes on the wire: where the fragments from some
/// point on repeat a group of the ones just before (each copy continuing
/// its fragment, see [`REPEAT`]), one repeat entry stands for them.
pub(crate) fn fold_table(entries: &[FragEntry]) -> Vec<FragEntry> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < entries.len() {
        // The smallest group the next fragments repeat, and how often.
        let found = (1..=MAX_GROUP.min(i)).find_map(|k| {
            let mut n = 0;
            while i + (n + 1) * k <= entries.len()
                && (0..k).all(|j| continues(&entries[i + n * k + j - k], &entries[i + n * k + j]))
            {
                n += 1;
            }
            (n > 0).then_some((k, n))
        });
        match found {
            // One fragment repeated once is no shorter as a repeat entry.
            Some((k, n)) if k * n > 1 => {
                out.push(FragEntry { member: REPEAT, offset: k as u64, len: n as u64 });
                i += k * n;
            }
            _ => {
                out.push(entries[i]);
                i += 1;
            }
        }
    }
    out
}

/// The slots of an aggregate run's fragment table (as it goes on the
/// wire, [`fold_table`]).
pub(crate) fn table_messages(entries: &[FragEntry], meta_size: usize) -> impl Iterator<Item = Message> + '_ {
    let per = entries_per_slot(meta_size);
    entries
        .chunks(per)
        .enumerate()
        .map(move |(i, chunk)| Message::AggFrags { first: (i * per) as u32, entries: chunk.to_vec() })
}

/// Decode a whole aggregate descriptor: `slots` are the header slot and
/// the table's slots (the member slots left out), `member_lens` the sizes
/// of the members' buffers. What the channel does slot by slot, in one
/// function for the fuzz target and the tests. Also gives the table as it
/// came (what a router sends on).
#[cfg(any(test, feature = "fuzzing"))]
#[allow(clippy::type_complexity)]
pub(crate) fn decode_descriptor<'a>(
    slots: impl IntoIterator<Item = &'a [u8]>,
    member_lens: &[usize],
    meta_size: usize,
) -> Result<(Meta, Vec<FragEntry>, Vec<FragEntry>), Error> {
    let mut slots = slots.into_iter();
    let head = slots.next().ok_or_else(|| ErrorKind::Protocol("no aggregate header".into()))?;
    let mut run = match Message::decode(head, meta_size)? {
        Message::AggHeader { members, frags, total, meta } => AggRun::start(members, frags, total, meta)?,
        other => return Err(ErrorKind::Protocol(format!("{other:?} where an aggregate header was due")).into()),
    };
    let mut lens = member_lens.iter();
    while run.wants_member() {
        let len = lens.next().ok_or_else(|| ErrorKind::Protocol("aggregate run cut short".into()))?;
        run.add_member(*len);
    }
    while !run.is_complete() {
        let slot = slots.next().ok_or_else(|| ErrorKind::Protocol("aggregate run cut short".into()))?;
        match Message::decode(slot, meta_size)? {
            Message::AggFrags { first, entries } => run.add_frags(first, &entries)?,
            other => return Err(ErrorKind::Protocol(format!("{other:?} interrupts an aggregate run")).into()),
        }
    }
    run.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(m: Message, meta_size: usize) {
        let mut slot = vec![0u8; slot_size(meta_size) as usize];
        m.encode(&mut slot);
        assert_eq!(Message::decode(&slot, meta_size).unwrap(), m);
    }

    #[test]
    fn every_message_roundtrips() {
        let pool = PoolId::from_u128(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        let buf = BufferId { pool, index: 7 };
        let meta = Meta::new(b"block 42").unwrap();
        for m in [
            Message::Move { buf, meta: meta.clone() },
            Message::Copy { buf, meta },
            Message::Pass { buf, meta: Meta::empty() },
            Message::Release { buf },
            Message::AssignRequest { pool, geometry: Geometry::new(1 << 20, 3).unwrap(), trust: TrustLevel::Half },
            Message::AssignReply { pool, accepted: true },
            Message::AssignReply { pool, accepted: false },
            Message::RemoveRequest { pool },
            Message::RemoveReply { pool, accepted: true },
            Message::Teardown,
        ] {
            roundtrip(m, 16);
        }
        let big = Meta::new(&[9u8; MAX_META_SIZE]).unwrap();
        roundtrip(Message::Move { buf, meta: big }, MAX_META_SIZE);
        for len in [META_INLINE - 1, META_INLINE, META_INLINE + 1] {
            let m = Meta::new(&vec![7u8; len]).unwrap();
            assert_eq!(&m[..], &vec![7u8; len][..]);
            roundtrip(Message::Pass { buf, meta: m }, 64);
        }
    }

    #[test]
    fn slot_sizes() {
        assert_eq!(slot_size(0), 64);
        assert_eq!(slot_size(32), 64);
        assert_eq!(slot_size(33), 128);
        assert_eq!(slot_size(MAX_META_SIZE), 256);
    }

    #[test]
    fn malformed_slots_are_errors() {
        let mut slot = [0u8; 64];
        assert!(Message::decode(&slot, 16).is_err(), "opcode 0");
        slot[0] = 99;
        assert!(Message::decode(&slot, 16).is_err(), "unknown opcode");
        slot[0] = OP_MOVE;
        slot[2] = 17;
        assert!(Message::decode(&slot, 16).is_err(), "meta longer than the channel's");
        slot[2] = 0;
        slot[0] = OP_ASSIGN;
        slot[1] = 2 << 4;
        assert!(Message::decode(&slot, 16).is_err(), "zero buffers");
        slot[4] = 1;
        slot[8..16].copy_from_slice(&4097u64.to_le_bytes());
        assert!(Message::decode(&slot, 16).is_err(), "bad size");
        slot[8..16].copy_from_slice(&4096u64.to_le_bytes());
        assert!(Message::decode(&slot, 16).is_ok());
        slot[1] = 0;
        assert!(Message::decode(&slot, 16).is_err(), "uninitialized trust");
        assert!(Message::decode(&slot[..8], 16).is_err(), "short slot");
    }

    fn entry(member: u32, offset: u64, len: u64) -> FragEntry {
        FragEntry { member, offset, len }
    }

    /// The header and table slots of a descriptor.
    fn descriptor(members: u32, entries: &[FragEntry], total: u64, meta_size: usize) -> Vec<Vec<u8>> {
        let meta = Meta::new(&b"m"[..meta_size.min(1)]).unwrap();
        let header = Message::AggHeader { members, frags: entries.len() as u32, total, meta };
        std::iter::once(header)
            .chain(table_messages(entries, meta_size))
            .map(|m| {
                let mut slot = vec![0u8; slot_size(meta_size) as usize];
                m.encode(&mut slot);
                slot
            })
            .collect()
    }

    fn decode(slots: &[Vec<u8>], lens: &[usize], meta_size: usize) -> Result<(Meta, Vec<FragEntry>), Error> {
        decode_descriptor(slots.iter().map(Vec::as_slice), lens, meta_size).map(|(meta, entries, _)| (meta, entries))
    }

    #[test]
    fn aggregate_slots_roundtrip() {
        roundtrip(Message::AggHeader { members: 3, frags: 9, total: 1 << 41, meta: Meta::new(b"x").unwrap() }, 16);
        let big = entry(7, (1 << 40) - 1, (1 << 40) + 5);
        roundtrip(Message::AggFrags { first: 4, entries: vec![entry(0, 1, 2), big] }, 0);
        roundtrip(Message::AggFrags { first: 0, entries: vec![entry(1, 0, 1); 14] }, MAX_META_SIZE);
        assert_eq!(entries_per_slot(0), 2);
        assert_eq!(entries_per_slot(MAX_META_SIZE), 14);
        assert_eq!(run_slots(2, 5, 0), 1 + 2 + 3);
    }

    #[test]
    fn descriptors_decode_and_bad_ones_are_errors() {
        let lens = [4096, 8192];
        let good = [entry(0, 0, 10), entry(1, 100, 20), entry(0, 50, 5)];
        let slots = descriptor(2, &good, 35, 0);
        assert_eq!(slots.len(), 3);
        assert_eq!(decode(&slots, &lens, 0).unwrap(), (Meta::empty(), good.to_vec()));
        let with_meta = descriptor(2, &good, 35, 8);
        assert_eq!(decode(&with_meta, &lens, 8).unwrap(), (Meta::new(b"m").unwrap(), good.to_vec()));
        let bad = |entries: &[FragEntry], members: u32, total: u64, lens: &[usize]| {
            let e = decode(&descriptor(members, entries, total, 0), lens, 0).unwrap_err();
            assert!(matches!(e.kind(), ErrorKind::Protocol(_)), "{e:?}");
        };
        bad(&[entry(2, 0, 1), entry(0, 0, 1)], 2, 2, &lens); // no member 2
        bad(&[entry(0, 4090, 7), entry(1, 0, 1)], 2, 8, &lens); // past the end
        bad(&[entry(0, u64::MAX >> 16, 2), entry(1, 0, 1)], 2, 3, &lens); // overflow
        bad(&[entry(0, 0, 0), entry(1, 0, 1)], 2, 1, &lens); // empty fragment
        bad(&[entry(0, 0, 1), entry(0, 1, 1)], 2, 2, &lens); // member 1 unused
        bad(&[entry(0, 0, 1), entry(1, 0, 1)], 2, 3, &lens); // total does not add up
        bad(&[entry(0, 0, 1)], 2, 1, &lens); // fewer fragments than members
        bad(&[], 1, 0, &lens);
        bad(&[entry(0, 0, 1)], MAX_AGG_MEMBERS + 1, 1, &lens);
        // Cut short, out of order, interrupted.
        assert!(decode(&slots[..2], &lens, 0).is_err());
        assert!(decode(&slots, &lens[..1], 0).is_err());
        let swapped = vec![slots[0].clone(), slots[2].clone(), slots[1].clone()];
        assert!(decode(&swapped, &lens, 0).is_err());
        let mut teardown = vec![0u8; 64];
        Message::Teardown.encode(&mut teardown);
        assert!(decode(&[slots[0].clone(), teardown.clone()], &lens, 0).is_err());
        assert!(decode(&[teardown], &lens, 0).is_err());
        // A table slot with stray fields or a ragged length.
        let mut stray = slots.clone();
        stray[1][8] = 1;
        assert!(decode(&stray, &lens, 0).is_err());
        let mut ragged = slots.clone();
        ragged[1][2] = 31;
        assert!(decode(&ragged, &lens, 0).is_err());
        let mut long = slots;
        long[1][2] = 48; // three entries do not fit a 64-byte slot
        assert!(decode(&long, &lens, 0).is_err());
        // An empty aggregate: a header alone.
        assert_eq!(decode(&descriptor(0, &[], 0, 0), &[], 0).unwrap().1, vec![]);
    }

    /// The fragment table of a train of `units` units of `unit` bytes (the
    /// last shorter), each behind a 16-byte header of member 0, cut from a
    /// payload (member 1) behind three 32-byte headers (members 2-4).
    fn train(units: u64, unit: u64) -> Vec<FragEntry> {
        let mut t = vec![entry(0, 0, 16), entry(2, 0, 32), entry(3, 0, 32), entry(4, 0, 32), entry(1, 0, unit - 96)];
        // A one-unit train is that unit alone, however short the payload.
        let payload = (units * unit - unit / 2).saturating_sub(96).max(unit - 96);
        let mut at = unit - 96;
        for u in 1..units {
            t.push(entry(0, 16 * u, 16));
            let piece = unit.min(payload - at);
            t.push(entry(1, at, piece));
            at += piece;
        }
        t
    }

    #[test]
    fn trains_fold_into_repeat_entries_and_unfold_again() {
        let t = train(257, 4096);
        let wire = fold_table(&t);
        // Unit 0 (five fragments), unit 1, one repeat entry, the last unit.
        assert_eq!(wire.len(), 5 + 2 + 1 + 2, "{wire:?}");
        assert_eq!(wire[7], FragEntry { member: REPEAT, offset: 2, len: 254 });
        let lens = [257 * 16, 257 * 4096, 32, 32, 32];
        let total = t.iter().map(|e| e.len).sum();
        let slots = descriptor(5, &wire, total, MAX_META_SIZE);
        assert_eq!(slots.len(), 2, "the header and one table slot, against 37");
        assert_eq!(decode(&slots, &lens, MAX_META_SIZE).unwrap().1, t);
        // Nothing to fold: the table as it is.
        let plain = [entry(0, 0, 10), entry(1, 100, 20), entry(0, 50, 5)];
        assert_eq!(fold_table(&plain), plain);
    }

    #[test]
    fn bad_repeat_entries_are_errors() {
        let lens = [4096, 1 << 30];
        let rep = |k, n| entry(REPEAT, k, n);
        let bad = |entries: &[FragEntry], total: u64| {
            let e = decode(&descriptor(2, entries, total, 0), &lens, 0).unwrap_err();
            assert!(matches!(e.kind(), ErrorKind::Protocol(_)), "{e:?}");
        };
        let ok = |entries: &[FragEntry], total: u64| decode(&descriptor(2, entries, total, 0), &lens, 0).unwrap().1;
        let base = [entry(0, 0, 16), entry(1, 0, 100)];
        assert_eq!(ok(&[base[0], base[1], rep(2, 3)], 464).len(), 8);
        assert_eq!(ok(&[base[0], base[1], rep(1, 2)], 316)[3], entry(1, 200, 100));
        bad(&[rep(1, 1), base[0], base[1]], 117); // nothing before it to repeat
        bad(&[base[0], base[1], rep(3, 1)], 232); // a group larger than what came before
        bad(&[base[0], base[1], rep(0, 5)], 116); // an empty group
        bad(&[base[0], base[1], rep(2, 0)], 116); // no repetition
        assert_eq!(ok(&[base[0], base[1], rep(2, 255)], 116 * 256).len(), 512); // member 0 full
        bad(&[base[0], base[1], rep(2, 256)], 116 * 257); // member 0 ends after 4096 bytes
        bad(&[base[0], base[1], rep(1, (1 << 48) - 1)], 116); // lengths overflow
                                                              // Inside the buffer, but more fragments than a run may have.
        bad(&[base[0], entry(1, 0, 1), rep(1, u64::from(MAX_AGG_FRAGS))], 17 + u64::from(MAX_AGG_FRAGS));
        // The total still has to add up.
        bad(&[base[0], base[1], rep(2, 3)], 463);
    }

    /// The fuzz target's seed is a valid descriptor, and its entry point
    /// takes it (and its every prefix) without a panic.
    #[cfg(feature = "fuzzing")]
    #[test]
    fn fuzz_seed_decodes() {
        let seed = include_bytes!("../../../fuzz/seeds/aggregate_descriptor/two_members_three_fragments");
        let slots: Vec<Vec<u8>> = seed[6..].chunks(64).map(<[u8]>::to_vec).collect();
        assert_eq!(decode(&slots, &[4096, 4096], 0).unwrap().1.len(), 3);
        for n in 0..=seed.len() {
            crate::fuzzing::aggregate_descriptor(&seed[..n]);
        }
        // A seed with a repeat entry: two fragments, repeated three times.
        let seed = include_bytes!("../../../fuzz/seeds/aggregate_descriptor/train_with_a_repeat_entry");
        let slots: Vec<Vec<u8>> = seed[6..].chunks(64).map(<[u8]>::to_vec).collect();
        let entries = decode(&slots, &[4096, 4096], 0).unwrap().1;
        assert_eq!((entries.len(), entries[7]), (8, entry(1, 300, 100)));
        for n in 0..=seed.len() {
            crate::fuzzing::aggregate_descriptor(&seed[..n]);
        }
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), meta in 0usize..300) {
            let _ = Message::decode(&bytes, meta);
        }

        #[test]
        fn descriptor_decode_never_panics(
            slots in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..80), 0..6),
            lens in proptest::collection::vec(1usize..10000, 0..5),
            meta in 0usize..64,
        ) {
            let _ = decode(&slots, &lens, meta);
        }

        #[test]
        fn valid_descriptors_decode(
            members in proptest::collection::vec(1usize..5000, 1..5),
            picks in proptest::collection::vec((any::<u32>(), any::<u32>(), any::<u32>()), 0..40),
            meta in 0usize..100,
        ) {
            // Every member once, then random fragments inside the members.
            let mut entries: Vec<FragEntry> = (0..members.len()).map(|m| entry(m as u32, 0, members[m] as u64)).collect();
            for (m, a, b) in picks {
                let m = m as usize % members.len();
                let off = a as u64 % members[m] as u64;
                let len = 1 + b as u64 % (members[m] as u64 - off);
                entries.push(entry(m as u32, off, len));
            }
            let total = entries.iter().map(|e| e.len).sum();
            let slots = descriptor(members.len() as u32, &entries, total, meta);
            prop_assert_eq!(decode(&slots, &members, meta).unwrap().1, entries);
        }

        #[test]
        fn folded_tables_unfold_to_the_same_fragments(
            units in 1u64..300,
            unit in 128u64..5000,
            cut in 0usize..600,
            meta in 0usize..100,
        ) {
            // A train, some of it, with a stray fragment in the middle.
            let mut t = train(units, unit);
            t.truncate(cut.max(5));
            let at = t.len() / 2;
            t.insert(at, entry(2, 3, 7));
            let wire = fold_table(&t);
            prop_assert!(wire.len() <= t.len());
            let lens = [(16 * units) as usize, (units * unit) as usize, 32, 32, 32];
            let total = t.iter().map(|e| e.len).sum();
            let slots = descriptor(5, &wire, total, meta);
            prop_assert_eq!(decode(&slots, &lens, meta).unwrap().1, t);
        }
    }
}
