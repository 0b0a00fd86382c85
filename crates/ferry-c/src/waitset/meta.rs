//! The meta data a buffer callback sees.

use ferry::{Meta, MAX_META_SIZE};

/// The bytes a callback sees as meta data: the channel's meta size,
/// zero-padded (so never empty), aligned to 16 bytes (as malloc's memory
/// is: programs read their meta data as integers or structs). Small meta
/// data, the usual kind, is kept inline: no allocation per event, and
/// work stays small to move.
pub enum MetaBuf {
    /// Up to [`INLINE_META`] bytes.
    Inline(Aligned<INLINE_META>),
    /// Up to [`MAX_META_SIZE`] bytes.
    Heap(Box<Aligned<MAX_META_SIZE>>),
}

/// Bytes aligned to 16.
#[repr(C, align(16))]
pub struct Aligned<const N: usize>([u8; N]);

/// Meta data kept inline in a [`MetaBuf`].
const INLINE_META: usize = 32;

impl MetaBuf {
    /// Zeroed inline bytes: what a dispatch starts with.
    pub fn new() -> MetaBuf {
        MetaBuf::Inline(Aligned([0u8; INLINE_META]))
    }

    /// Writes `meta` for a channel of `meta_size` into a buffer that is
    /// still as [`new`](Self::new) made it (zero padding included).
    pub(super) fn fill(&mut self, meta: &Meta, meta_size: usize) {
        if meta_size > INLINE_META {
            *self = meta_bytes(meta, meta_size);
            return;
        }
        // One look at the bytes (the deref is a call into ferry).
        let meta: &[u8] = meta;
        let n = meta.len().min(meta_size);
        self.bytes_mut()[..n].copy_from_slice(&meta[..n]);
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            MetaBuf::Inline(b) => &mut b.0[..],
            MetaBuf::Heap(b) => &mut b.0[..],
        }
    }
}

/// The meta data as a callback sees it, in a buffer of its own (for work
/// that is queued).
pub(super) fn meta_bytes(meta: &Meta, meta_size: usize) -> MetaBuf {
    // One look at the bytes (the deref is a call into ferry).
    let meta: &[u8] = meta;
    let n = meta.len().min(meta_size).min(MAX_META_SIZE);
    if meta_size <= INLINE_META {
        let mut v = Aligned([0u8; INLINE_META]);
        v.0[..n].copy_from_slice(&meta[..n]);
        MetaBuf::Inline(v)
    } else {
        let mut v = Box::new(Aligned([0u8; MAX_META_SIZE]));
        v.0[..n].copy_from_slice(&meta[..n]);
        MetaBuf::Heap(v)
    }
}
