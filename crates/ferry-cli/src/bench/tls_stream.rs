//! TLS for the benchmarks: the test certificates a run uses (made once,
//! by `ferry tls gen`'s code), and the `rustls-stream` baseline — what an
//! application gets from rustls on a plain stream, moving the same bytes
//! as Ferry's throughput: a source keeps `--inflight` messages of
//! `--size` bytes on their way over one TLS connection on loopback, an
//! echo thread (`rustls::StreamOwned`, blocking) reads each message whole
//! into its buffer and writes it back, and the source reads every echo
//! whole. Every byte is encrypted and decrypted once each way, as with
//! `--backend net-tls`.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use ferry::tls::rustls;
use ferry::tls::TlsConfig;
use serde_json::json;

use super::point::{Head, Point};
use super::{Backend, Ctx};
use crate::stats::{round, Summary};
use crate::CliError;

/// The run's certificates: a CA and both pairs for 127.0.0.1, written
/// to a directory of its own and read back as Ferry reads them.
pub fn config() -> Result<Arc<TlsConfig>, CliError> {
    static CONFIG: OnceLock<Arc<TlsConfig>> = OnceLock::new();
    if let Some(c) = CONFIG.get() {
        return Ok(c.clone());
    }
    let dir = std::env::temp_dir().join(format!("ferry-bench-tls-{}", std::process::id()));
    let made = crate::tls::generate(&dir, &["127.0.0.1".to_owned()], true)
        .and_then(|()| TlsConfig::from_dir(&dir, "127.0.0.1").map_err(CliError::from));
    let _ = std::fs::remove_dir_all(&dir);
    let config = Arc::new(made?);
    Ok(CONFIG.get_or_init(|| config).clone())
}

fn failed(what: impl std::fmt::Display) -> CliError {
    CliError::Failed(format!("rustls-stream: {what}; run the benchmark again"))
}

/// The echo: read a message whole, write it back, until end of stream.
fn echo(stream: TcpStream, config: Arc<rustls::ServerConfig>, size: usize) -> Result<u64, String> {
    let conn = rustls::ServerConnection::new(config).map_err(|e| e.to_string())?;
    let mut tls = rustls::StreamOwned::new(conn, stream);
    let mut buf = vec![0u8; size];
    let mut echoed = 0;
    loop {
        match tls.read_exact(&mut buf) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(echoed),
            Err(e) => return Err(e.to_string()),
        }
        tls.write_all(&buf).map_err(|e| e.to_string())?;
        echoed += 1;
    }
}

/// One run's moves over `conn` (the source, non-blocking): at most
/// `window` messages written and not yet echoed back whole.
fn moves(
    conn: &mut rustls::ClientConnection,
    sock: &mut TcpStream,
    msg: &[u8],
    window: u64,
    count: u64,
) -> Result<(), CliError> {
    use rustix::event::{PollFd, PollFlags};
    let (mut sent, mut done) = (0u64, 0u64);
    let (mut out_at, mut in_at) = (0usize, 0usize);
    let mut rbuf = vec![0u8; msg.len()];
    while done < count {
        let mut progress = false;
        // Encrypt while the window allows and rustls takes more.
        while sent < count && sent - done < window {
            let n = conn.writer().write(&msg[out_at..]).map_err(failed)?;
            if n == 0 {
                break;
            }
            progress = true;
            out_at += n;
            if out_at == msg.len() {
                out_at = 0;
                sent += 1;
            }
        }
        while conn.wants_write() {
            match conn.write_tls(sock) {
                Ok(_) => progress = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(failed(e)),
            }
        }
        // Take every echo byte there is.
        loop {
            match conn.reader().read(&mut rbuf[in_at..]) {
                Ok(0) => return Err(failed("the echo closed the connection")),
                Ok(n) => {
                    progress = true;
                    in_at += n;
                    if in_at == rbuf.len() {
                        in_at = 0;
                        done += 1;
                    }
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(failed(e)),
            }
            match conn.read_tls(sock) {
                Ok(0) => return Err(failed("the echo closed the connection")),
                Ok(_) => {
                    conn.process_new_packets().map_err(failed)?;
                    progress = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(failed(e)),
            }
        }
        if !progress {
            let out = if conn.wants_write() { PollFlags::OUT } else { PollFlags::empty() };
            let mut fds = [PollFd::new(&*sock, PollFlags::IN | out)];
            let _ = rustix::event::poll(&mut fds, None);
        }
    }
    Ok(())
}

/// Throughput at each size on one TLS connection per size: a warm-up run,
/// then `--runs` measured runs of `--moves` messages.
pub fn measure(ctx: &Ctx<'_>, sizes: &[usize]) -> Result<Vec<Point>, CliError> {
    let a = ctx.args;
    let config = config()?;
    let (server, client) = (config.server_config()?, config.client_config()?);
    let window = a.inflight.unwrap_or(250) as u64;
    let runs = a.runs.unwrap_or(20);
    let sizes = if sizes.is_empty() { vec![4096] } else { sizes.to_vec() };
    let mut points = Vec::new();
    for size in sizes {
        // As Ferry's net-tls throughput (every byte is encrypted), and not fewer than the window.
        let count = (a.moves.unwrap_or(super::default_moves(size, true)) as u64).max(window);
        let listener = TcpListener::bind("127.0.0.1:0").map_err(failed)?;
        let addr = listener.local_addr().map_err(failed)?;
        let server = server.clone();
        let echo = std::thread::Builder::new()
            .name("rustls-echo".into())
            .spawn(move || -> Result<u64, String> {
                crate::pin::to_cpu(1);
                let (stream, _) = listener.accept().map_err(|e| e.to_string())?;
                let _ = stream.set_nodelay(true);
                echo(stream, server, size)
            })
            .map_err(failed)?;
        crate::pin::to_cpu(0);
        let mut sock = TcpStream::connect(addr).map_err(failed)?;
        sock.set_nodelay(true).map_err(failed)?;
        sock.set_nonblocking(true).map_err(failed)?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").map_err(failed)?;
        let mut conn = rustls::ClientConnection::new(client.clone(), name).map_err(failed)?;
        let mut msg = vec![0u8; size];
        crate::pattern::fill(&mut msg, 1);
        let mut rates = Vec::with_capacity(runs);
        for run in 0..=runs {
            let t0 = Instant::now();
            moves(&mut conn, &mut sock, &msg, window, count)?;
            if run > 0 {
                rates.push(count as f64 / t0.elapsed().as_secs_f64() / 1e6);
                ctx.progress.inc(1);
            }
        }
        conn.send_close_notify();
        sock.set_nonblocking(false).map_err(failed)?;
        while conn.wants_write() {
            conn.write_tls(&mut sock).map_err(failed)?;
        }
        let _ = sock.shutdown(std::net::Shutdown::Write);
        let echoed = echo.join().map_err(|_| failed("the echo thread panicked"))?.map_err(failed)?;
        if echoed != count * (runs as u64 + 1) {
            return Err(failed(format!("the echo saw {echoed} messages, expected {}", count * (runs as u64 + 1))));
        }
        let summary = Summary::of(&rates).ok_or_else(|| failed("no samples"))?;
        let gbit = round(summary.median * 1e6 * size as f64 * 8.0 / 1e9);
        let head = Head {
            experiment: a.experiment.name(),
            backend: Backend::RustlsStream.name(),
            size,
            trust: "n/a",
            mode: "blocking",
            touch: false,
            runs,
            unit: "Mops/s",
        };
        // One copy each way in user space on each side: into and out of
        // TLS's records (encrypting and decrypting).
        let extra = json!({ "inflight": window, "moves_per_run": count, "gbit_s_median": gbit });
        points.push(Point::new(head, summary, None, extra));
    }
    Ok(points)
}
