//! A peer of a multiplexed session (`ferry::MuxSession`) that speaks the
//! wire format by hand (see the module docs of `ferry::backend::mux`), for
//! tests of what a hostile peer can do.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::Duration;

use ferry::backend::mux::{MuxHead, MUX_HEAD};

/// The session's magic.
pub const MAGIC: &[u8; 8] = b"FERRYMX3";

/// A hello as a peer sends it: the magic and a peer timeout of `ms`
/// milliseconds.
pub fn hello(ms: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&ms.to_le_bytes());
    h
}

/// Read the session's hello from `s`: it must start with the magic.
pub fn read_hello(s: &mut TcpStream) {
    let mut got = [0u8; 12];
    s.read_exact(&mut got).expect("the session's hello");
    assert_eq!(&got[..8], MAGIC);
}

/// Frame kinds of the session.
pub const K_MESSAGE: u8 = 1;
/// A payload chunk.
pub const K_CHUNK: u8 = 2;
/// An open: the binder's bind request.
pub const K_OPEN: u8 = 4;
/// The creator's answer to an open.
pub const K_REPLY: u8 = 5;
/// A close.
pub const K_CLOSE: u8 = 6;

/// The TCP backend's message types carried in message frames.
pub const ASSIGN: u8 = 5;
/// The answer to a pool assignment.
pub const ASSIGN_REPLY: u8 = 6;

/// A bind request: generic role, any trust, max meta 224, no constraints.
pub fn bind_request() -> Vec<u8> {
    let mut req = b"FRY1\x01\x00\xff".to_vec();
    req.extend_from_slice(&224u16.to_le_bytes());
    req.extend_from_slice(&[0u8; 24]);
    req
}

/// One frame: its header and its body.
pub fn frame(kind: u8, channel: u32, body: &[u8]) -> Vec<u8> {
    MuxHead { kind, flags: 0, channel, len: 0, credit: 0 }.frame(body)
}

/// A connected peer whose magic was exchanged.
pub struct MuxPeer {
    /// The connection.
    pub s: TcpStream,
}

impl MuxPeer {
    /// Connect, with a receive buffer of about `recv_buffer` bytes (small:
    /// what the peer does not read backs up on the session's side soon),
    /// and exchange the magic.
    pub fn connect(addr: SocketAddr, recv_buffer: usize) -> MuxPeer {
        let mut s = TcpStream::connect(addr).unwrap();
        rustix::net::sockopt::set_socket_recv_buffer_size(s.as_fd(), recv_buffer).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&hello(10_000)).unwrap();
        read_hello(&mut s);
        MuxPeer { s }
    }

    /// Open channel `id` (a bind request); the reply is not read.
    pub fn open(&mut self, id: u32) {
        self.s.write_all(&frame(K_OPEN, id, &bind_request())).unwrap();
    }

    /// Read the next frame: its header and body (a chunk's payload).
    pub fn next_frame(&mut self) -> (MuxHead, Vec<u8>) {
        let mut h = [0u8; MUX_HEAD];
        self.s.read_exact(&mut h).unwrap();
        let head = MuxHead::decode(&h).unwrap();
        let mut body = vec![0u8; head.len as usize];
        self.s.read_exact(&mut body).unwrap();
        (head, body)
    }

    /// Read frames until channel `id` offers a pool; accept it. Returns
    /// the pool id.
    pub fn accept_pool(&mut self, id: u32) -> u128 {
        loop {
            let (head, body) = self.next_frame();
            if head.kind == K_MESSAGE && head.channel == id && body[0] == ASSIGN {
                let pool = u128::from_le_bytes(body[16..32].try_into().unwrap());
                let mut reply = vec![ASSIGN_REPLY, 1, 0, 0];
                reply.extend_from_slice(&[0u8; 12]);
                reply.extend_from_slice(&pool.to_le_bytes());
                self.s.write_all(&frame(K_MESSAGE, id, &reply)).unwrap();
                return pool;
            }
        }
    }

    /// Read frames until a message of channel `id` and its whole payload
    /// came: the message's type.
    pub fn take_message(&mut self, id: u32) -> u8 {
        loop {
            let (head, body) = self.next_frame();
            if head.kind != K_MESSAGE || head.channel != id {
                continue;
            }
            let mut payload = u64::from_le_bytes(body[8..16].try_into().unwrap()) as usize;
            if body[1] & 2 == 0 {
                payload = 0;
            }
            while payload > 0 {
                let (chunk, bytes) = self.next_frame();
                assert_eq!((chunk.kind, chunk.channel), (K_CHUNK, id), "a chunk of the message");
                payload -= bytes.len();
            }
            return body[0];
        }
    }
}
