//! The frame layout: encoding and decoding of frame headers (pure, no I/O).

use crate::error::Result;
use crate::proto;
use crate::ErrorKind;

use crate::backend::setup_msg;

/// Size of a multiplexed frame header.
pub const MUX_HEAD: usize = 16;
/// Largest payload chunk: a priority frame waits for at most one.
pub const MAX_CHUNK: usize = 64 << 10;
pub(super) const MAGIC: &[u8; 8] = b"FERRYMX3";

/// Frame kinds.
pub(crate) const K_MESSAGE: u8 = 1;
pub(crate) const K_CHUNK: u8 = 2;
pub(crate) const K_CREDIT: u8 = 3;
pub(crate) const K_OPEN: u8 = 4;
pub(crate) const K_REPLY: u8 = 5;
pub(crate) const K_CLOSE: u8 = 6;
pub(crate) const K_KEEPALIVE: u8 = 7;
pub(crate) const K_GOODBYE: u8 = 8;
pub(crate) const K_READ: u8 = 9;
pub(super) const FLAG_ABORT: u8 = 1;

/// The TCP backend's message frame header (see `backend/net.rs`).
pub(super) const MSG_HEAD: usize = proto::HEADER;
pub(super) const TYPE_MOVE: u8 = 1;
pub(super) const TYPE_COPY: u8 = 2;
pub(super) const TYPE_PASS: u8 = 3;
pub(super) const FLAG_PAYLOAD: u8 = 2;

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MuxHead {
    /// The frame kind (1 ..= 9).
    pub kind: u8,
    /// Flags (close: abort).
    pub flags: u8,
    /// The channel number.
    pub channel: u32,
    /// Bytes of body that follow.
    pub len: u32,
    /// Credit granted (credit frames), or bytes of the stream read
    /// (read reports).
    pub credit: u32,
}

impl MuxHead {
    /// A header of `kind` for `channel` announcing `len` bytes of body,
    /// without flags or credit.
    pub fn new(kind: u8, channel: u32, len: u32) -> MuxHead {
        MuxHead { kind, flags: 0, channel, len, credit: 0 }
    }

    /// The encoded header followed by `body`, as one frame (the header's
    /// length is the body's).
    pub fn frame(self, body: &[u8]) -> Vec<u8> {
        let mut f = Vec::with_capacity(MUX_HEAD + body.len());
        f.extend_from_slice(&MuxHead { len: body.len() as u32, ..self }.encode());
        f.extend_from_slice(body);
        f
    }

    /// Encode into a header.
    pub fn encode(&self) -> [u8; MUX_HEAD] {
        let mut h = [0u8; MUX_HEAD];
        h[0] = self.kind;
        h[1] = self.flags;
        h[4..8].copy_from_slice(&self.channel.to_le_bytes());
        h[8..12].copy_from_slice(&self.len.to_le_bytes());
        h[12..16].copy_from_slice(&self.credit.to_le_bytes());
        h
    }

    /// Decode and check a header from a peer: the kind is known and the
    /// other fields fit it. A pure function (the fuzz target's).
    pub fn decode(h: &[u8; MUX_HEAD]) -> Result<MuxHead> {
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let head = MuxHead { kind: h[0], flags: h[1], channel: word(4), len: word(8), credit: word(12) };
        let bad = |what: &str| Err(ErrorKind::Protocol(format!("multiplexed frame kind {}: {what}", head.kind)).into());
        if h[2] != 0 || h[3] != 0 {
            return bad("reserved bytes set");
        }
        let len = head.len as usize;
        let session = matches!(head.kind, K_KEEPALIVE | K_GOODBYE | K_READ);
        if session != (head.channel == 0) {
            return bad("channel 0 is the session's, and only its");
        }
        if head.flags != 0 && !(head.kind == K_CLOSE && head.flags == FLAG_ABORT) {
            return bad("unknown flags");
        }
        if head.credit != 0 && !matches!(head.kind, K_CREDIT | K_READ) {
            return bad("credit on a frame that grants none");
        }
        let ok = match head.kind {
            K_MESSAGE => (MSG_HEAD..=MSG_HEAD + proto::MAX_META_SIZE).contains(&len),
            K_CHUNK => (1..=MAX_CHUNK).contains(&len),
            K_CREDIT | K_READ => len == 0 && head.credit > 0,
            K_OPEN | K_REPLY => (1..=setup_msg::MAX_LEN).contains(&len),
            K_CLOSE | K_KEEPALIVE | K_GOODBYE => len == 0,
            _ => return bad("unknown kind"),
        };
        if !ok {
            return bad("length or credit out of range");
        }
        Ok(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any 16 bytes decode to a header or a protocol error, never a
        /// panic; what decodes encodes back to the same bytes.
        #[test]
        fn decode_never_panics(bytes in proptest::array::uniform16(any::<u8>())) {
            match MuxHead::decode(&bytes) {
                Ok(head) => prop_assert_eq!(head.encode(), bytes),
                Err(e) => prop_assert!(matches!(e.kind(), ErrorKind::Protocol(_))),
            }
        }

        /// Valid headers of every kind survive the round trip.
        #[test]
        fn valid_heads_round_trip(kind in 1u8..=9, channel in 1u32.., len in 0u32..70_000, credit in 0u32..5) {
            let session = matches!(kind, K_KEEPALIVE | K_GOODBYE | K_READ);
            let head = MuxHead { kind, flags: 0, channel: if session { 0 } else { channel }, len, credit };
            if let Ok(back) = MuxHead::decode(&head.encode()) {
                prop_assert_eq!(back, head);
            }
        }
    }

    #[test]
    fn decode_checks_each_field() {
        let ok = MuxHead { kind: K_CHUNK, flags: 0, channel: 3, len: 100, credit: 0 };
        assert_eq!(MuxHead::decode(&ok.encode()), Ok(ok));
        let read = MuxHead { kind: K_READ, flags: 0, channel: 0, len: 0, credit: 65536 };
        assert_eq!(MuxHead::decode(&read.encode()), Ok(read));
        for bad in [
            MuxHead { kind: 0, ..ok },
            MuxHead { kind: 10, ..ok },
            MuxHead { len: 0, ..ok },
            MuxHead { len: MAX_CHUNK as u32 + 1, ..ok },
            MuxHead { channel: 0, ..ok },
            MuxHead { flags: 1, ..ok },
            MuxHead { credit: 1, ..ok },
            MuxHead { kind: K_KEEPALIVE, channel: 1, len: 0, ..ok },
            MuxHead { kind: K_CREDIT, len: 0, credit: 0, ..ok },
            MuxHead { kind: K_READ, channel: 0, len: 0, credit: 0, ..ok },
            MuxHead { kind: K_READ, channel: 1, len: 0, credit: 5, ..ok },
            MuxHead { kind: K_READ, channel: 0, len: 4, credit: 5, ..ok },
            MuxHead { kind: K_MESSAGE, len: 31, ..ok },
            MuxHead { kind: K_OPEN, len: setup_msg::MAX_LEN as u32 + 1, ..ok },
        ] {
            assert!(
                matches!(MuxHead::decode(&bad.encode()).as_ref().map_err(|e| e.kind()), Err(ErrorKind::Protocol(_))),
                "{bad:?}"
            );
        }
        let mut reserved = ok.encode();
        reserved[2] = 1;
        assert!(MuxHead::decode(&reserved).is_err());
    }
}
