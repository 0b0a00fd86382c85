//! One TLS connection over a non-blocking socket, with the shape of the
//! vectored socket calls the backends make (`send_parts`, `recv_parts`),
//! so the plain path keeps its system calls and TLS slots in beside it.

use crate::ErrorKind;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::BorrowedFd;

use super::TlsConfig;
use crate::error::{Error, Result};
use crate::sys::{RecvPart, SendPart};

/// Ciphertext taken off the socket per `recv` (rustls itself reads 4 KiB
/// at a time; one larger read saves most of those system calls).
const CIPHER_IN: usize = 64 << 10;

/// A TLS connection's state; the socket is the caller's, passed to each
/// call that does I/O.
pub(crate) struct TlsSession {
    conn: rustls::Connection,
    /// Ciphertext read from the socket and not yet given to rustls:
    /// `cipher[start..end]`.
    cipher: Box<[u8]>,
    start: usize,
    end: usize,
    /// Decrypted bytes rustls holds for us.
    plain: usize,
    /// The peer sent close_notify (what is decrypted is still ours to read).
    peer_closed: bool,
    /// The socket reached the end of the stream.
    eof: bool,
    /// Ciphertext bytes the socket took so far.
    written: u64,
    /// Writes the socket refused (it was full) so far.
    refused: u64,
}

impl std::fmt::Debug for TlsSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSession")
            .field("handshaking", &self.conn.is_handshaking())
            .field("written", &self.written)
            .field("refused", &self.refused)
            .finish()
    }
}

/// The socket as rustls's reader and writer: never blocking, never
/// raising `SIGPIPE`.
struct Sock<'a>(BorrowedFd<'a>);

impl Read for Sock<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Ok(rustix::net::recv(self.0, buf, rustix::net::RecvFlags::DONTWAIT)?.0)
    }
}

impl Write for Sock<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        use rustix::net::{SendAncillaryBuffer, SendFlags};
        let mut control = SendAncillaryBuffer::default();
        Ok(rustix::net::sendmsg(self.0, bufs, &mut control, SendFlags::DONTWAIT | SendFlags::NOSIGNAL)?)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The error a TLS failure becomes, if `e` is one (rustls's errors travel
/// inside `io::Error`s through the socket-shaped calls).
pub(crate) fn failure(e: &io::Error) -> Option<Error> {
    let inner = e.get_ref()?;
    inner.downcast_ref::<rustls::Error>().map(|e| ErrorKind::Tls(e.to_string()).into())
}

impl TlsSession {
    /// The accepting side's end of a new connection. At most `send_limit`
    /// bytes of ciphertext wait in rustls for the socket.
    pub(crate) fn server(config: &TlsConfig, send_limit: usize) -> Result<TlsSession> {
        let conn = rustls::ServerConnection::new(config.server_config()?).map_err(|e| ErrorKind::Tls(e.to_string()))?;
        Ok(TlsSession::new(conn.into(), send_limit))
    }

    /// The connecting side's end; the handshake starts with the first
    /// [`TlsSession::flush`].
    pub(crate) fn client(config: &TlsConfig, send_limit: usize) -> Result<TlsSession> {
        let conn = rustls::ClientConnection::new(config.client_config()?, config.server_name.clone())
            .map_err(|e| ErrorKind::Tls(e.to_string()))?;
        Ok(TlsSession::new(conn.into(), send_limit))
    }

    fn new(mut conn: rustls::Connection, send_limit: usize) -> TlsSession {
        conn.set_buffer_limit(Some(send_limit));
        TlsSession {
            conn,
            cipher: vec![0; CIPHER_IN].into_boxed_slice(),
            start: 0,
            end: 0,
            plain: 0,
            peer_closed: false,
            eof: false,
            written: 0,
            refused: 0,
        }
    }

    /// The error for a connection that ended (or was reset) during the
    /// handshake; `None` once the handshake is done.
    pub(crate) fn ended_in_handshake(&self) -> Option<Error> {
        self.conn.is_handshaking().then(|| {
            ErrorKind::Tls("the connection ended during the TLS handshake; does the peer use TLS".into()).into()
        })
    }

    /// Whether ciphertext waits for the socket: the caller must wake for
    /// writability (and call [`TlsSession::flush`]) until it is out.
    pub(crate) fn wants_write(&self) -> bool {
        self.conn.wants_write()
    }

    /// Whether input was taken off the socket and not given out yet
    /// (decrypted bytes, or ciphertext not yet decrypted): the socket
    /// will not signal it again, so the caller must not sleep on it.
    pub(crate) fn has_input(&self) -> bool {
        self.plain > 0 || self.start < self.end || (self.peer_closed && !self.eof)
    }

    /// Ciphertext bytes the socket took so far (progress, for liveness).
    pub(crate) fn written(&self) -> u64 {
        self.written
    }

    /// Writes the socket refused so far (each one a system call that
    /// moved nothing).
    #[cfg(test)]
    pub(crate) fn refused(&self) -> u64 {
        self.refused
    }

    /// Send the ciphertext waiting for the socket, as far as it takes it.
    pub(crate) fn flush(&mut self, fd: BorrowedFd<'_>) -> io::Result<()> {
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut Sock(fd)) {
                Ok(n) => self.written += n as u64,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.refused += 1;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Hand a small message (a setup message, a magic) to TLS whatever
    /// waits for the socket, and send what the socket takes: the bytes TLS
    /// took (all of them, within its send limit). Before the handshake is
    /// done TLS holds them and sends them once it is.
    pub(crate) fn queue(&mut self, fd: BorrowedFd<'_>, msg: &[u8]) -> io::Result<usize> {
        let n = self.conn.writer().write(msg)?;
        self.flush(fd)?;
        Ok(n)
    }

    /// Encrypt from `parts` in order, as much as rustls takes (up to its
    /// send limit), and send what the socket takes. The bytes counted are
    /// the caller's: encrypted and on their way (`WouldBlock` while
    /// earlier ciphertext still waits for the socket).
    pub(crate) fn send_parts(&mut self, fd: BorrowedFd<'_>, parts: &[SendPart<'_>]) -> io::Result<usize> {
        self.flush(fd)?;
        if self.conn.wants_write() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p.as_slice())).collect();
        let n = self.conn.writer().write_vectored(&slices)?;
        self.flush(fd)?;
        if n == 0 && slices.iter().any(|s| !s.is_empty()) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    /// Decrypt into `parts` in order: the bytes given (at least one),
    /// `Ok(0)` at the end of the stream, `WouldBlock` when the socket has
    /// nothing more. Drives the handshake (and answers what it needs).
    /// Only bytes of records whose authentication passed are written.
    pub(crate) fn recv_parts(&mut self, fd: BorrowedFd<'_>, parts: &mut [RecvPart<'_>]) -> io::Result<usize> {
        loop {
            if self.plain > 0 {
                let mut given = 0;
                for part in parts.iter_mut() {
                    let dst = part.as_mut_slice();
                    let mut at = 0;
                    while at < dst.len() && self.plain > 0 {
                        let n = self.conn.reader().read(&mut dst[at..])?;
                        if n == 0 {
                            break;
                        }
                        at += n;
                        self.plain -= n;
                    }
                    given += at;
                    if at < dst.len() {
                        break;
                    }
                }
                if given > 0 {
                    return Ok(given);
                }
            }
            if self.peer_closed || self.eof {
                self.eof = true;
                return Ok(0);
            }
            if self.start == self.end {
                match Sock(fd).read(&mut self.cipher) {
                    Ok(0) => {
                        self.eof = true;
                        return Ok(0);
                    }
                    Ok(n) => (self.start, self.end) = (0, n),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            }
            let mut input = &self.cipher[self.start..self.end];
            let taken = self.conn.read_tls(&mut input)?;
            self.start += taken;
            // Ciphertext already waiting means the socket refused the
            // last write (every write path tries until it does): the
            // caller waits for writability before trying again.
            let waiting = self.conn.wants_write();
            let state = match self.conn.process_new_packets() {
                Ok(state) => state,
                Err(e) => {
                    // rustls queued an alert saying why: send it.
                    let _ = self.flush(fd);
                    return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                }
            };
            self.plain = state.plaintext_bytes_to_read();
            self.peer_closed = state.peer_has_closed();
            // Handshake answers (and key updates) go out at once, unless
            // they queue behind ciphertext the full socket refused: another
            // write now (once per record read, in a bulk transfer both
            // ways) would only be refused again.
            if !waiting {
                self.flush(fd)?;
            }
            if taken == 0 && self.plain == 0 && !self.peer_closed {
                // rustls took nothing and gave nothing: a stream that
                // cannot go on.
                return Err(io::Error::new(io::ErrorKind::InvalidData, rustls::Error::General("stalled".into())));
            }
        }
    }

    /// Say close_notify (sent with the next flush).
    pub(crate) fn close(&mut self, fd: BorrowedFd<'_>) {
        self.conn.send_close_notify();
        let _ = self.flush(fd);
    }
}

/// TLS connections for the backends' unit tests: test certificates, and
/// a handshaken pair over loopback TCP.
#[cfg(test)]
pub(crate) mod testing {
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    };

    use super::TlsSession;
    use crate::sys::RecvPart;
    use crate::tls::TlsConfig;

    /// A CA and a server pair for 127.0.0.1 and a client pair it signed,
    /// loaded as Ferry loads them.
    pub(crate) fn config() -> TlsConfig {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let dir = std::env::temp_dir().join(format!("ferry-unit-tls-{}-{:?}", std::process::id(), Instant::now()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(super::super::CA_CERT), ca.pem()).unwrap();
        for (names, usage, cert, key) in [
            (
                vec!["127.0.0.1".to_owned()],
                ExtendedKeyUsagePurpose::ServerAuth,
                super::super::SERVER_CERT,
                super::super::SERVER_KEY,
            ),
            (
                vec!["client".to_owned()],
                ExtendedKeyUsagePurpose::ClientAuth,
                super::super::CLIENT_CERT,
                super::super::CLIENT_KEY,
            ),
        ] {
            let mut params = CertificateParams::new(names).unwrap();
            params.extended_key_usages = vec![usage];
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            let pair = KeyPair::generate().unwrap();
            std::fs::write(dir.join(cert), params.signed_by(&pair, &ca).unwrap().pem()).unwrap();
            std::fs::write(dir.join(key), pair.serialize_pem()).unwrap();
        }
        let config = TlsConfig::from_dir(&dir, "127.0.0.1");
        let _ = std::fs::remove_dir_all(&dir);
        config.unwrap()
    }

    /// Two non-blocking loopback sockets, the accepting one's TLS server
    /// end and the connecting one's client end, with the handshake done
    /// (at most `send_limit` bytes of ciphertext wait in each).
    pub(crate) fn pair(send_limit: usize) -> ((TcpStream, TlsSession), (TcpStream, TlsSession)) {
        let config = config();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        for s in [&server, &client] {
            s.set_nonblocking(true).unwrap();
        }
        let mut server_tls = TlsSession::server(&config, send_limit).unwrap();
        let mut client_tls = TlsSession::client(&config, send_limit).unwrap();
        client_tls.flush(client.as_fd()).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while server_tls.ended_in_handshake().is_some() || client_tls.ended_in_handshake().is_some() {
            assert!(Instant::now() < until, "no TLS handshake within 10 s");
            for (sock, tls) in [(&server, &mut server_tls), (&client, &mut client_tls)] {
                let mut byte = [0u8];
                match tls.recv_parts(sock.as_fd(), &mut [RecvPart::slice(&mut byte)]) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    other => panic!("during the handshake: {other:?}"),
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        ((server, server_tls), (client, client_tls))
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::os::fd::AsFd;
    use std::time::{Duration, Instant};

    use super::testing;
    use crate::sys::{RecvPart, SendPart};

    /// Reading records leaves ciphertext the socket refused to the
    /// caller's next flush (which waits for writability): no write per
    /// record read, each one refused while the socket stays full.
    #[test]
    fn reading_leaves_refused_ciphertext_to_the_next_flush() {
        let ((server, mut server_tls), (client, mut client_tls)) = testing::pair(64 << 10);
        // A small send buffer: the client's way out fills after a few
        // records. (The server's receive buffer keeps its size: one that
        // small drops segments, and the acknowledgements they carry.)
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(client.as_fd(), 4096);
        let chunk = vec![7u8; 16 << 10];
        let mut queued = 0;
        while client_tls.refused() == 0 && queued < 64 << 20 {
            queued += client_tls.queue(client.as_fd(), &chunk).unwrap();
        }
        assert!(client_tls.refused() > 0, "the socket took {queued} bytes and never refused more");
        let refused = client_tls.refused();
        // The server sends 256 KiB (sixteen and more records); the client reads them all.
        let data: Vec<u8> = (0..256 << 10).map(|i| (i % 251) as u8).collect();
        let mut got = vec![0u8; data.len()];
        let (mut sent, mut have) = (0, 0);
        let until = Instant::now() + Duration::from_secs(10);
        while have < got.len() {
            assert!(Instant::now() < until, "only {have} of {} bytes arrived within 10 s", got.len());
            if sent < data.len() {
                match server_tls.send_parts(server.as_fd(), &[SendPart::slice(&data[sent..])]) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("server: {e}"),
                }
            } else {
                server_tls.flush(server.as_fd()).unwrap();
            }
            match client_tls.recv_parts(client.as_fd(), &mut [RecvPart::slice(&mut got[have..])]) {
                Ok(0) => panic!("the server closed the connection"),
                Ok(n) => have += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("client: {e}"),
            }
        }
        assert!(got == data, "the bytes arrived changed");
        assert!(client_tls.wants_write(), "reading wrote the refused ciphertext");
        assert_eq!(client_tls.refused(), refused, "writes the full socket refused while reading");
        // The next flush sends it, as far as the socket takes it.
        let written = client_tls.written();
        client_tls.flush(client.as_fd()).unwrap();
        assert!(client_tls.written() > written || client_tls.refused() > refused, "the flush did not try the socket");
    }
}
