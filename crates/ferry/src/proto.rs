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

const FLAG_ACCEPT: u8 = 1;

impl Message {
    /// Encode into `slot` (zeroed, at least [`slot_size`] of the meta size).
    pub(crate) fn encode(&self, slot: &mut [u8]) {
        const NONE: &Meta = &Meta::empty();
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
        if slot.len() < HEADER {
            return Err(Error::Protocol(format!("slot of {} bytes is shorter than the header", slot.len())));
        }
        let op = slot[0];
        let flags = slot[1];
        let meta_len = u16::from_le_bytes([slot[2], slot[3]]) as usize;
        let index = u32::from_le_bytes(slot[4..8].try_into().expect("4 bytes"));
        let aux = u64::from_le_bytes(slot[8..16].try_into().expect("8 bytes"));
        let pool = PoolId::from_u128(u128::from_le_bytes(slot[16..32].try_into().expect("16 bytes")));
        let carries_meta = matches!(op, OP_MOVE | OP_COPY | OP_PASS);
        if meta_len > max_meta.min(MAX_META_SIZE) || (!carries_meta && meta_len != 0) {
            return Err(Error::Protocol(format!("meta length {meta_len} out of range (op {op})")));
        }
        if HEADER + meta_len > slot.len() {
            return Err(Error::Protocol(format!("meta length {meta_len} exceeds the slot")));
        }
        let meta = || Meta::from_prefix(&slot[HEADER..], meta_len);
        let buf = BufferId { pool, index };
        let accepted = flags & FLAG_ACCEPT != 0;
        Ok(match op {
            OP_MOVE => Message::Move { buf, meta: meta() },
            OP_COPY => Message::Copy { buf, meta: meta() },
            OP_PASS => Message::Pass { buf, meta: meta() },
            OP_RELEASE => Message::Release { buf },
            OP_ASSIGN => {
                let trust = TrustLevel::from_u8(flags >> 4)
                    .filter(|t| *t != TrustLevel::Uninitialized)
                    .ok_or_else(|| Error::Protocol(format!("bad trust level {}", flags >> 4)))?;
                let size = usize::try_from(aux).map_err(|_| Error::Protocol("buffer size too large".into()))?;
                let geometry = Geometry::new(size, u64::from(index))
                    .map_err(|e| Error::Protocol(format!("bad pool geometry: {e}")))?;
                Message::AssignRequest { pool, geometry, trust }
            }
            OP_ASSIGN_REPLY => Message::AssignReply { pool, accepted },
            OP_REMOVE => Message::RemoveRequest { pool },
            OP_REMOVE_REPLY => Message::RemoveReply { pool, accepted },
            OP_TEARDOWN => Message::Teardown,
            other => return Err(Error::Protocol(format!("unknown opcode {other}"))),
        })
    }
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

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), meta in 0usize..300) {
            let _ = Message::decode(&bytes, meta);
        }
    }
}
