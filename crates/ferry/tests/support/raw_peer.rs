//! A TCP peer that speaks the wire format by hand (see the module docs of
//! the TCP backend), for tests of what a hostile peer can do.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Frame types of the wire format.
pub const MOVE: u8 = 1;
/// A read-only copy.
pub const COPY: u8 = 2;
/// A pass (sink to source).
pub const PASS: u8 = 3;
/// A pool assignment request.
pub const ASSIGN: u8 = 5;
/// The answer to an assignment request.
pub const ASSIGN_REPLY: u8 = 6;
/// Flags: a payload follows the header and meta.
pub const FLAG_PAYLOAD: u8 = 2;

/// The header fields of one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    /// Frame type.
    pub kind: u8,
    /// Flags.
    pub flags: u8,
    /// Buffer index.
    pub index: u32,
    /// Payload length (buffer frames) or buffer size (assignments).
    pub aux: u64,
    /// Pool id.
    pub pool: u128,
}

/// One frame as it goes on the wire: one argument per header field, in
/// wire order.
#[allow(clippy::too_many_arguments)]
pub fn frame_bytes(kind: u8, flags: u8, index: u32, aux: u64, pool: u128, meta: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut f = vec![kind, flags];
    f.extend_from_slice(&(meta.len() as u16).to_le_bytes());
    f.extend_from_slice(&index.to_le_bytes());
    f.extend_from_slice(&aux.to_le_bytes());
    f.extend_from_slice(&pool.to_le_bytes());
    f.extend_from_slice(meta);
    f.extend_from_slice(payload);
    f
}

/// A connected raw peer.
pub struct RawPeer {
    /// The connection.
    pub s: TcpStream,
}

impl RawPeer {
    /// Connect and bind (any role, any trust): the creator's answer is
    /// read and must be an acceptance.
    pub fn bind(addr: SocketAddr) -> RawPeer {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // FRY1, kind 1: role generic, trust any, max meta 224, no constraints.
        let mut req = b"FRY1\x01\x00\xff".to_vec();
        req.extend_from_slice(&224u16.to_le_bytes());
        req.extend_from_slice(&[0u8; 24]);
        // Our peer timeout after the message: 10 s.
        req.extend_from_slice(&10_000u32.to_le_bytes());
        let mut framed = (req.len() as u16).to_le_bytes().to_vec();
        framed.extend_from_slice(&req);
        s.write_all(&framed).unwrap();
        let mut len = [0u8; 2];
        s.read_exact(&mut len).unwrap();
        let mut reply = vec![0u8; usize::from(u16::from_le_bytes(len))];
        s.read_exact(&mut reply).unwrap();
        assert_eq!(&reply[..5], b"FRY1\x02", "bind accepted");
        RawPeer { s }
    }

    /// Send one frame: one argument per header field, in wire order.
    #[allow(clippy::too_many_arguments)]
    pub fn frame(&mut self, kind: u8, flags: u8, index: u32, aux: u64, pool: u128, meta: &[u8], payload: &[u8]) {
        let f = frame_bytes(kind, flags, index, aux, pool, meta, payload);
        self.send(&f);
    }

    /// Send bytes as they are (e.g. several frames at once, in one write).
    pub fn send(&mut self, bytes: &[u8]) {
        // The victim may close as soon as it has seen enough.
        let _ = self.s.write_all(bytes);
    }

    /// Read the next frame, its meta and payload (skipped).
    pub fn next_frame(&mut self) -> Head {
        let mut h = [0u8; 32];
        self.s.read_exact(&mut h).unwrap();
        let head = Head {
            kind: h[0],
            flags: h[1],
            index: u32::from_le_bytes(h[4..8].try_into().unwrap()),
            aux: u64::from_le_bytes(h[8..16].try_into().unwrap()),
            pool: u128::from_le_bytes(h[16..32].try_into().unwrap()),
        };
        let meta = usize::from(u16::from_le_bytes([h[2], h[3]]));
        let buffer_frame = matches!(head.kind, MOVE | COPY | PASS);
        let payload = if buffer_frame && head.flags & FLAG_PAYLOAD != 0 { head.aux as usize } else { 0 };
        let mut skip = vec![0u8; meta + payload];
        self.s.read_exact(&mut skip).unwrap();
        head
    }

    /// Read frames until a pool assignment arrives; accept it. Returns the
    /// pool and its buffer size.
    pub fn accept_pool(&mut self) -> (u128, usize) {
        loop {
            let h = self.next_frame();
            if h.kind == ASSIGN {
                self.frame(ASSIGN_REPLY, 1, 0, 0, h.pool, &[], &[]);
                return (h.pool, h.aux as usize);
            }
        }
    }

    /// On a thread of its own: connect and bind to `addr`, accept the
    /// first pool the victim assigns, then run `body` with the peer, the
    /// pool and its buffer size. The hostile tests' common opening.
    pub fn spawn_with_pool<T: Send + 'static>(
        addr: SocketAddr,
        body: impl FnOnce(&mut RawPeer, u128, usize) -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        std::thread::spawn(move || {
            let mut peer = RawPeer::bind(addr);
            let (pool, size) = peer.accept_pool();
            body(&mut peer, pool, size)
        })
    }

    /// Read until the victim hangs up.
    pub fn drain(&mut self) {
        let mut sink = [0u8; 4096];
        while matches!(self.s.read(&mut sink), Ok(n) if n > 0) {}
    }
}
