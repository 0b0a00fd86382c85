//! The protocol's numbers (magic values, options, replies, commands,
//! flags, errors) and this server's limits, and the readers of the
//! fields of a client's messages.

use super::*;

// Handshake magic numbers and flags.
pub(super) const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub(super) const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub(super) const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub(super) const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub(super) const FLAG_NO_ZEROES: u16 = 1 << 1;
pub(super) const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
pub(super) const CLIENT_NO_ZEROES: u32 = 1 << 1;

// Options.
pub(super) const OPT_EXPORT_NAME: u32 = 1;
pub(super) const OPT_ABORT: u32 = 2;
pub(super) const OPT_LIST: u32 = 3;
pub(super) const OPT_STARTTLS: u32 = 5;
pub(super) const OPT_INFO: u32 = 6;
pub(super) const OPT_GO: u32 = 7;
pub(super) const OPT_STRUCTURED_REPLY: u32 = 8;
pub(super) const OPT_LIST_META_CONTEXT: u32 = 9;
pub(super) const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
pub(super) const REP_ACK: u32 = 1;
pub(super) const REP_SERVER: u32 = 2;
pub(super) const REP_INFO: u32 = 3;
pub(super) const REP_META_CONTEXT: u32 = 4;
pub(super) const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub(super) const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub(super) const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub(super) const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub(super) const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

// Information types of NBD_OPT_INFO / NBD_OPT_GO.
pub(super) const INFO_EXPORT: u16 = 0;
pub(super) const INFO_NAME: u16 = 1;
pub(super) const INFO_DESCRIPTION: u16 = 2;
pub(super) const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub(super) const TF_HAS_FLAGS: u16 = 1 << 0;
pub(super) const TF_READ_ONLY: u16 = 1 << 1;
pub(super) const TF_SEND_FLUSH: u16 = 1 << 2;
pub(super) const TF_SEND_FUA: u16 = 1 << 3;
pub(super) const TF_SEND_TRIM: u16 = 1 << 5;
pub(super) const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub(super) const TF_SEND_DF: u16 = 1 << 7;
pub(super) const TF_CAN_MULTI_CONN: u16 = 1 << 8;
pub(super) const TF_SEND_CACHE: u16 = 1 << 10;

// Requests.
pub(super) const REQUEST_MAGIC: u32 = 0x2560_9513;
pub(super) const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub(super) const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub(super) const CMD_READ: u16 = 0;
pub(super) const CMD_WRITE: u16 = 1;
pub(super) const CMD_DISC: u16 = 2;
pub(super) const CMD_FLUSH: u16 = 3;
pub(super) const CMD_TRIM: u16 = 4;
pub(super) const CMD_CACHE: u16 = 5;
pub(super) const CMD_WRITE_ZEROES: u16 = 6;
pub(super) const CMD_BLOCK_STATUS: u16 = 7;
pub(super) const CMD_FLAG_FUA: u16 = 1 << 0;
pub(super) const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub(super) const CMD_FLAG_DF: u16 = 1 << 2;
pub(super) const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

// Structured reply chunks.
pub(super) const REPLY_FLAG_DONE: u16 = 1 << 0;
pub(super) const REPLY_TYPE_NONE: u16 = 0;
pub(super) const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub(super) const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub(super) const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub(super) const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

// Error values.
pub(super) const EPERM: u32 = 1;
pub(super) const EIO: u32 = 5;
pub(super) const ENOMEM: u32 = 12;
pub(super) const EINVAL: u32 = 22;
pub(super) const ENOSPC: u32 = 28;
pub(super) const EOVERFLOW: u32 = 75;

// base:allocation states.
pub(super) const STATE_HOLE: u32 = 1 << 0;
pub(super) const STATE_ZERO: u32 = 1 << 1;

/// The one metadata context, and the id it gets when selected.
pub(super) const BASE_ALLOCATION: &str = "base:allocation";
pub(super) const BASE_ALLOCATION_ID: u32 = 1;

/// Option data larger than this ends the connection (every option this
/// server knows fits in a few KiB: names and queries are at most 4096
/// bytes).
pub(super) const MAX_OPTION_DATA: u32 = 64 << 10;
/// Longest string (export name, query) the protocol allows.
pub(super) const MAX_STRING: usize = 4096;
/// Structured reads of at least this many bytes send the store's zero
/// extents as holes (`NBD_REPLY_TYPE_OFFSET_HOLE`) instead of zeroes.
pub(super) const SPARSE_READ_MIN: u32 = 64 << 10;
/// Most extents in one block status reply.
pub(super) const MAX_EXTENTS: usize = 2048;

/// Read a big-endian number from the front of `data`.
pub(super) fn take<const N: usize>(data: &mut &[u8]) -> Option<[u8; N]> {
    let (head, rest) = data.split_first_chunk::<N>()?;
    *data = rest;
    Some(*head)
}

pub(super) fn take_u16(data: &mut &[u8]) -> Option<u16> {
    take::<2>(data).map(u16::from_be_bytes)
}

pub(super) fn take_u32(data: &mut &[u8]) -> Option<u32> {
    take::<4>(data).map(u32::from_be_bytes)
}

/// A string of `len` bytes (UTF-8, no NUL, at most 4096 bytes).
pub(super) fn take_string(data: &mut &[u8], len: u32) -> Option<String> {
    let len = len as usize;
    if len > data.len() || len > MAX_STRING {
        return None;
    }
    let (s, rest) = data.split_at(len);
    *data = rest;
    let s = std::str::from_utf8(s).ok()?;
    (!s.contains('\0')).then(|| s.to_string())
}

/// The NBD error value for a store error.
pub(super) fn nbd_errno(e: &io::Error) -> u32 {
    match e.raw_os_error() {
        Some(1) | Some(13) | Some(30) => EPERM,
        Some(12) => ENOMEM,
        Some(22) => EINVAL,
        Some(28) | Some(27) | Some(122) => ENOSPC,
        Some(75) => EOVERFLOW,
        _ => EIO,
    }
}

#[derive(Clone, Copy)]
pub(super) struct Request {
    pub(super) flags: u16,
    pub(super) handle: u64,
    pub(super) offset: u64,
    pub(super) len: u32,
}
