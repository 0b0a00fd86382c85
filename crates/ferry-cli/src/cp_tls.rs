//! `ferry cp` over TLS: the same framed stream as over plain TCP (each
//! batch's 8-byte length, its bytes, a zero length at the end), inside a
//! TLS 1.3 connection with mutual certificates. The side that listens
//! (`tcp:` as SRC) presents the server certificate, the side that connects
//! (`tcp:` as DST) the client certificate.
//!
//! After its handshake the receiver sends one byte, so the sender knows its
//! certificate was accepted before it sends any data (in TLS 1.3 the client
//! finishes its handshake before the server has checked it).
//!
//! Encryption needs the bytes in user memory, so a file is read into pool
//! buffers (no `sendfile`), encrypted from them, and received data is
//! decrypted into pool buffers and written from them: one copy each way,
//! the one TLS needs. Only bytes of records whose authentication passed
//! are ever written to the destination: a byte changed on the way ends the
//! copy with an error, and what the destination holds is a prefix of the
//! source.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use ferry::tls::{rustls, TlsConfig};
use ferry::Allocator;
use ferry_io::{Chunk, IoError, Port};

use crate::cp::{amount, failed, read_batch, receive_failed, seconds, BATCH, BUFFER_SIZE};
use crate::CliError;

/// What the receiver sends once it accepted the sender's certificate.
const READY: u8 = 1;

/// One TLS connection of `ferry cp` on a blocking socket whose send and
/// receive timeouts are the copy's `--timeout`.
pub enum TlsStream {
    /// The sender's end (connects, presents the client certificate).
    Client(rustls::StreamOwned<rustls::ClientConnection, TcpStream>),
    /// The receiver's end (listens, presents the server certificate).
    Server(rustls::StreamOwned<rustls::ServerConnection, TcpStream>),
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            TlsStream::Client(s) => s.read(buf),
            TlsStream::Server(s) => s.read(buf),
        }
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            TlsStream::Client(s) => s.write(buf),
            TlsStream::Server(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            TlsStream::Client(s) => s.flush(),
            TlsStream::Server(s) => s.flush(),
        }
    }
}

impl TlsStream {
    fn handshake(&mut self) -> io::Result<()> {
        match self {
            TlsStream::Client(s) => {
                while s.conn.is_handshaking() {
                    s.conn.complete_io(&mut s.sock)?;
                }
            }
            TlsStream::Server(s) => {
                while s.conn.is_handshaking() {
                    s.conn.complete_io(&mut s.sock)?;
                }
            }
        }
        Ok(())
    }

    /// Say close_notify and send what waits: the peer sees a clean end.
    fn close(&mut self) -> io::Result<()> {
        match self {
            TlsStream::Client(s) => s.conn.send_close_notify(),
            TlsStream::Server(s) => s.conn.send_close_notify(),
        }
        self.flush()
    }
}

/// The TLS error inside `e`, if it is one.
fn tls_error(e: &io::Error) -> Option<&rustls::Error> {
    e.get_ref()?.downcast_ref::<rustls::Error>()
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Why a TLS failure happened, in words, seen from the `us` side against
/// its `peer` ("sender" or "receiver").
fn tls_why(e: &rustls::Error, peer: &str) -> String {
    use rustls::{AlertDescription as A, Error as E};
    match e {
        E::InvalidCertificate(c) => format!(
            "the {peer}'s certificate is not accepted ({c:?}): it must be signed by the CA in --tls-certificates \
             (ca-cert.pem) and name the host connected to"
        ),
        E::NoCertificatesPresented => format!("the {peer} presented no certificate"),
        E::AlertReceived(A::BadRecordMac) => {
            format!("the {peer} found data changed on the way (TLS alert bad_record_mac)")
        }
        E::AlertReceived(a) => format!(
            "the {peer} refused the connection (TLS alert {a:?}): check that both sides have certificates of the same \
             CA (--tls-certificates)"
        ),
        E::DecryptError => "a TLS record failed its authentication: the data was changed on the way".into(),
        E::InvalidMessage(_) | E::InappropriateMessage { .. } | E::InappropriateHandshakeMessage { .. } => {
            format!("the {peer} does not speak TLS ({e}); both sides need --tls-certificates")
        }
        e => format!("TLS failed: {e}"),
    }
}

/// The line for a handshake with `peer` on `name` that failed with `e`.
fn handshake_failed(e: io::Error, name: &str, peer: &str, limit: Option<Duration>) -> CliError {
    let why = match tls_error(&e) {
        Some(t) => tls_why(t, peer),
        None if is_timeout(&e) => {
            format!("the {peer} did not finish the TLS handshake within {} (timeout, see --timeout)", seconds(limit))
        }
        None if matches!(
            e.kind(),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
        ) =>
        {
            format!(
                "the {peer} closed the connection during the TLS handshake ({e}); does it use TLS \
                 (--tls-certificates) and accept our certificate?"
            )
        }
        None => format!("the TLS handshake failed: {e}"),
    };
    CliError::Failed(format!("{name}: {why}; nothing was copied"))
}

fn set_timeouts(sock: &TcpStream, name: &str, limit: Option<Duration>) -> Result<(), CliError> {
    sock.set_read_timeout(limit)
        .and_then(|()| sock.set_write_timeout(limit))
        .map_err(|e| CliError::Failed(format!("{name}: cannot set the timeout: {e}; nothing was copied")))
}

/// The receiver's end of an accepted connection: the handshake (which
/// checks the sender's certificate), then the ready byte.
pub fn accept(sock: TcpStream, config: &TlsConfig, name: &str, limit: Option<Duration>) -> Result<TlsStream, CliError> {
    set_timeouts(&sock, name, limit)?;
    let server = config.server_config().map_err(|e| CliError::Usage(e.to_string()))?;
    let conn = rustls::ServerConnection::new(server)
        .map_err(|e| CliError::Failed(format!("{name}: {e}; nothing was copied")))?;
    let mut tls = TlsStream::Server(rustls::StreamOwned::new(conn, sock));
    tls.handshake().map_err(|e| handshake_failed(e, name, "sender", limit))?;
    tls.write_all(&[READY]).and_then(|()| tls.flush()).map_err(|e| handshake_failed(e, name, "sender", limit))?;
    Ok(tls)
}

/// The sender's end of a connected socket: the handshake (which checks the
/// receiver's certificate), then the ready byte that says the receiver
/// accepted ours.
pub fn connect(
    sock: TcpStream,
    config: &TlsConfig,
    name: &str,
    limit: Option<Duration>,
) -> Result<TlsStream, CliError> {
    set_timeouts(&sock, name, limit)?;
    let client = config.client_config().map_err(|e| CliError::Usage(e.to_string()))?;
    let server_name = rustls::pki_types::ServerName::try_from(config.server_name())
        .map_err(|e| CliError::Usage(format!("{name}: {e}")))?;
    let conn = rustls::ClientConnection::new(client, server_name)
        .map_err(|e| CliError::Failed(format!("{name}: {e}; nothing was copied")))?;
    let mut tls = TlsStream::Client(rustls::StreamOwned::new(conn, sock));
    tls.handshake().map_err(|e| handshake_failed(e, name, "receiver", limit))?;
    let mut ready = [0u8];
    tls.read_exact(&mut ready).map_err(|e| handshake_failed(e, name, "receiver", limit))?;
    if ready[0] != READY {
        return Err(CliError::Failed(format!(
            "{name}: not a `ferry cp` receiver (it sent {:#04x} after the TLS handshake); nothing was copied",
            ready[0]
        )));
    }
    Ok(tls)
}

/// Where the copy reads from.
pub enum Input {
    /// A file, standard input or a plain socket (framed when a socket).
    Port(Port, bool),
    /// A TLS connection from a sender.
    Tls(Box<TlsStream>),
}

/// Where the copy writes to.
pub enum Output {
    /// A file, standard output or a plain socket (framed when a socket).
    Port(Port, bool),
    /// A TLS connection to a receiver.
    Tls(Box<TlsStream>),
}

/// Why a TLS source stopped, in the words of the sender's side.
fn receive_why(e: io::Error, name: &str, in_batch: bool, limit: Option<Duration>) -> String {
    if let Some(t) = tls_error(&e) {
        return format!("{name}: {}", tls_why(t, "sender"));
    }
    if is_timeout(&e) {
        return format!("{name}: the sender sent nothing for {} (timeout, see --timeout)", seconds(limit));
    }
    match e.kind() {
        io::ErrorKind::UnexpectedEof if in_batch => {
            format!("{name}: the sender closed the connection in the middle of a batch")
        }
        io::ErrorKind::UnexpectedEof => format!("{name}: the sender closed the connection before the end of the copy"),
        io::ErrorKind::ConnectionReset => {
            format!("{name}: the sender reset the connection before the end of the copy (connection reset by peer)")
        }
        _ => format!("{name}: {e}"),
    }
}

/// The next batch from a TLS sender, decrypted into pool buffers; empty at
/// the end mark.
fn read_tls_batch(
    tls: &mut TlsStream,
    alloc: &Allocator,
    name: &str,
    limit: Option<Duration>,
) -> Result<Vec<Chunk>, String> {
    let mut word = [0u8; 8];
    tls.read_exact(&mut word).map_err(|e| receive_why(e, name, false, limit))?;
    let len = u64::from_le_bytes(word);
    if len > (BATCH * BUFFER_SIZE) as u64 {
        return Err(format!("{name}: not a `ferry cp` sender (a batch of {len} bytes announced)"));
    }
    let mut chunks = Vec::new();
    let mut left = len as usize;
    while left > 0 {
        let mut buffer = alloc.alloc().ok_or_else(|| format!("{name}: no free buffer in the pool"))?;
        let n = left.min(BUFFER_SIZE);
        let bytes = buffer.as_mut_slice().map_err(|e| format!("{name}: {e}"))?;
        tls.read_exact(&mut bytes[..n]).map_err(|e| receive_why(e, name, true, limit))?;
        chunks.push(Chunk::new(buffer, 0..n).map_err(|e| format!("{name}: {e}"))?);
        left -= n;
    }
    Ok(chunks)
}

/// The line for a write to a TLS receiver that failed with `e` after
/// `sent` bytes were handed to TLS.
fn send_why(e: io::Error, name: &str, sent: u64, limit: Option<Duration>) -> CliError {
    let why = match tls_error(&e) {
        Some(t) => format!("{} after {}", tls_why(t, "receiver"), amount(sent)),
        None if is_timeout(&e) => {
            format!("the receiver took nothing for {} after {} (timeout, see --timeout)", seconds(limit), amount(sent))
        }
        None if e.kind() == io::ErrorKind::ConnectionReset => {
            format!("the receiver closed the connection after {} (connection reset by peer)", amount(sent))
        }
        None if e.kind() == io::ErrorKind::BrokenPipe => {
            format!("the receiver closed the connection after {} (broken pipe)", amount(sent))
        }
        None => format!("{e} after {}", amount(sent)),
    };
    CliError::Failed(format!("{name}: {why}; the copy is incomplete"))
}

/// Write `chunks` to a TLS receiver after their length; `sent` counts the
/// payload bytes TLS took.
fn write_tls_batch(tls: &mut TlsStream, chunks: &[Chunk], sent: &mut u64) -> io::Result<()> {
    let len: u64 = chunks.iter().map(|c| c.len() as u64).sum();
    tls.write_all(&len.to_le_bytes())?;
    for c in chunks {
        let mut bytes = c.bytes();
        while !bytes.is_empty() {
            let n = tls.write(bytes)?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            *sent += n as u64;
            bytes = &bytes[n..];
        }
    }
    Ok(())
}

/// Write `chunks` to a port (framed: after their length); the payload
/// bytes written. On error, the payload bytes that did go out are counted
/// from the port's offset by the caller.
fn write_port_batch(output: &mut Port, alloc: &Allocator, framed: bool, chunks: Vec<Chunk>) -> Result<u64, IoError> {
    if !framed {
        return output.write(chunks);
    }
    let len: u64 = chunks.iter().map(|c| c.len() as u64).sum();
    let mut header =
        alloc.alloc().ok_or_else(|| IoError::NoBuffer { name: output.name().to_string(), offset: output.offset() })?;
    let bytes = header.as_mut_slice().map_err(|_| IoError::BufferShared { name: output.name().to_string() })?;
    bytes[..8].copy_from_slice(&len.to_le_bytes());
    let all = std::iter::once(Chunk::new(header, 0..8)?).chain(chunks);
    Ok(output.write(all)? - 8)
}

/// Copy `input` to `output` where at least one of them is TLS; the payload
/// bytes copied. `src` and `dst` name them in messages; `progress` is
/// told the count after each batch.
pub fn copy(
    input: &mut Input,
    output: &mut Output,
    alloc: &Allocator,
    limit: Option<Duration>,
    src: &str,
    dst: &str,
    progress: impl Fn(u64),
) -> Result<u64, CliError> {
    let mut copied = 0u64;
    let out_name = match output {
        Output::Port(p, _) => p.name().to_string(),
        Output::Tls(_) => dst.to_string(),
    };
    loop {
        let chunks: Vec<Chunk> = match input {
            Input::Port(port, framed) => match read_batch(port, alloc, *framed) {
                Ok(filled) => filled.into_iter().map(Chunk::from).collect(),
                Err(why) => return Err(receive_failed(why.describe(port, *framed, limit), copied, dst)),
            },
            Input::Tls(tls) => {
                read_tls_batch(tls, alloc, src, limit).map_err(|why| receive_failed(why, copied, dst))?
            }
        };
        if chunks.is_empty() {
            break;
        }
        match output {
            Output::Port(port, framed) => {
                let before = port.offset();
                copied += write_port_batch(port, alloc, *framed, chunks).map_err(|e| {
                    let moved = port.offset() - before;
                    failed(e, copied + if *framed { moved.saturating_sub(8) } else { moved })
                })?;
            }
            Output::Tls(tls) => {
                let mut sent = copied;
                write_tls_batch(tls, &chunks, &mut sent).map_err(|e| send_why(e, &out_name, sent, limit))?;
                copied = sent;
            }
        }
        progress(copied);
    }
    match output {
        Output::Port(port, true) => {
            write_port_batch(port, alloc, true, Vec::new()).map_err(|e| failed(e, copied))?;
        }
        Output::Port(..) => {}
        Output::Tls(tls) => {
            tls.write_all(&0u64.to_le_bytes())
                .and_then(|()| tls.close())
                .map_err(|e| send_why(e, &out_name, copied, limit))?;
        }
    }
    if let Input::Tls(tls) = input {
        // The sender's close_notify may be on its way: say ours.
        let _ = tls.close();
    }
    Ok(copied)
}
