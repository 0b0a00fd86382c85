//! The typed error of every read and write: what went wrong, on which file
//! (its path or a description of the fd) and at which byte.

use std::io;

/// A failed read, write or open. Every variant names the file (`name`: a
/// path, `-` for standard input/output, or a description such as
/// `tcp:127.0.0.1:9000`) and, where it applies, the byte `offset` at which
/// the operation stopped (bytes transferred through the port until then).
///
/// The buffers of a failed operation are back in their allocator when the
/// error is returned.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The file does not exist.
    #[error("{name}: no such file or directory")]
    NotFound {
        /// The file.
        name: String,
    },
    /// The file may not be opened, read or written by this user.
    #[error("{name}: permission denied")]
    PermissionDenied {
        /// The file.
        name: String,
    },
    /// A directory where a file was expected.
    #[error("{name}: is a directory")]
    IsDirectory {
        /// The directory.
        name: String,
    },
    /// The file ended before the bytes requested were read.
    #[error("{name}: ended at byte {offset}, {missing} bytes short of the request")]
    UnexpectedEof {
        /// The file.
        name: String,
        /// Where it ended.
        offset: u64,
        /// How many requested bytes were not there.
        missing: u64,
    },
    /// The device holding the file is full.
    #[error("{name}: no space left on device at byte {offset}")]
    NoSpace {
        /// The file.
        name: String,
        /// Bytes written before the device was full.
        offset: u64,
    },
    /// The reading end of the pipe or socket is closed.
    #[error("{name}: the reader went away at byte {offset} (broken pipe)")]
    BrokenPipe {
        /// The pipe or socket.
        name: String,
        /// Bytes written before.
        offset: u64,
    },
    /// The peer reset the connection.
    #[error("{name}: connection reset by the peer at byte {offset}")]
    ConnectionReset {
        /// The socket.
        name: String,
        /// Bytes transferred before.
        offset: u64,
    },
    /// A received datagram did not fit its buffer (the kernel cut it short;
    /// it is dropped, never handed on truncated).
    #[error("{name}: a datagram of {size} bytes does not fit a buffer of {limit} bytes, at byte {offset}")]
    DatagramTooLarge {
        /// The socket.
        name: String,
        /// Bytes received before.
        offset: u64,
        /// The datagram's size.
        size: usize,
        /// The buffer size.
        limit: usize,
    },
    /// The socket refused to send a datagram this large (`EMSGSIZE`).
    #[error("{name}: the socket refuses a datagram of {size} bytes as too large, at byte {offset}")]
    DatagramRefused {
        /// The socket.
        name: String,
        /// Bytes sent before.
        offset: u64,
        /// The datagram's size.
        size: usize,
    },
    /// The allocator had no free buffer for a read.
    #[error("{name}: no free buffer in the pool for a read at byte {offset}")]
    NoBuffer {
        /// The file.
        name: String,
        /// Bytes read before.
        offset: u64,
    },
    /// A byte range outside its buffer.
    #[error("bytes {start}..{end} are outside a buffer of {len} bytes")]
    BadRange {
        /// Start of the range.
        start: usize,
        /// End of the range.
        end: usize,
        /// The buffer's size.
        len: usize,
    },
    /// The buffer has read-only copies out: it cannot be read into.
    #[error("{name}: a buffer with read-only copies out cannot be read into")]
    BufferShared {
        /// The file.
        name: String,
    },
    /// No byte could move for the port's timeout ([`crate::Port::set_timeout`]):
    /// the peer sent nothing, or took nothing, for that long.
    #[error("{name}: {op} moved nothing for {} s, the port's timeout, at byte {offset}", limit.as_secs_f64())]
    TimedOut {
        /// The socket or pipe.
        name: String,
        /// What was being done (`read`, `write`, `sendfile`, ...).
        op: &'static str,
        /// Bytes transferred before.
        offset: u64,
        /// The timeout.
        limit: std::time::Duration,
    },
    /// Any other failure of the operating system.
    #[error("{name}: {op} failed at byte {offset}: {source}")]
    Os {
        /// The file.
        name: String,
        /// What was being done (`open`, `read`, `write`, ...).
        op: &'static str,
        /// Bytes transferred before.
        offset: u64,
        /// The system's error.
        source: io::Error,
    },
}

impl IoError {
    /// The error for `err` of operation `op` on `name` at `offset`: the
    /// kinds users meet get their own variant.
    pub fn from_os(name: &str, op: &'static str, offset: u64, err: io::Error) -> IoError {
        let name = name.to_string();
        match err.raw_os_error() {
            Some(libc::ENOENT) => IoError::NotFound { name },
            Some(libc::EACCES) | Some(libc::EPERM) => IoError::PermissionDenied { name },
            Some(libc::EISDIR) => IoError::IsDirectory { name },
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => IoError::NoSpace { name, offset },
            Some(libc::EPIPE) => IoError::BrokenPipe { name, offset },
            Some(libc::ECONNRESET) => IoError::ConnectionReset { name, offset },
            _ => IoError::Os { name, op, offset, source: err },
        }
    }

    /// The file the error is about (empty for [`IoError::BadRange`]).
    pub fn name(&self) -> &str {
        match self {
            IoError::NotFound { name }
            | IoError::PermissionDenied { name }
            | IoError::IsDirectory { name }
            | IoError::UnexpectedEof { name, .. }
            | IoError::NoSpace { name, .. }
            | IoError::BrokenPipe { name, .. }
            | IoError::ConnectionReset { name, .. }
            | IoError::DatagramTooLarge { name, .. }
            | IoError::DatagramRefused { name, .. }
            | IoError::NoBuffer { name, .. }
            | IoError::BufferShared { name }
            | IoError::TimedOut { name, .. }
            | IoError::Os { name, .. } => name,
            IoError::BadRange { .. } => "",
        }
    }

    /// The byte offset where the operation stopped, when there is one.
    pub fn offset(&self) -> Option<u64> {
        match self {
            IoError::UnexpectedEof { offset, .. }
            | IoError::NoSpace { offset, .. }
            | IoError::BrokenPipe { offset, .. }
            | IoError::ConnectionReset { offset, .. }
            | IoError::DatagramTooLarge { offset, .. }
            | IoError::DatagramRefused { offset, .. }
            | IoError::NoBuffer { offset, .. }
            | IoError::TimedOut { offset, .. }
            | IoError::Os { offset, .. } => Some(*offset),
            _ => None,
        }
    }
}
