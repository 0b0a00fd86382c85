//! TLS for the benchmarks: the test certificates a run uses (made once,
//! by `ferry tls gen`'s code), and the `rustls-stream` baseline — what an
//! application gets from rustls on a plain stream, moving the same bytes
//! as Ferry's throughput: a source keeps `--inflight` messages of
//! `--size` bytes on their way over one TLS connection on loopback, an
//! echo thread (`rustls::StreamOwned`, blocking) reads each message whole
//! into its buffer and writes it back, and the source reads every echo
//! whole. Every byte is encrypted and decrypted once each way, as with
//! `--backend net-tls`.
//!
//! Each size is measured twice, each time on a connection of its own:
//!
//! - `rustls-stream` (no `variant`): the same working set as Ferry's side.
//!   Ferry's throughput cycles through a pool of `--inflight` buffers (all
//!   of them on their way at once), on each end of the connection; so
//!   does this baseline: message `k` leaves from and its echo lands in
//!   the source's buffer `k mod inflight`, and the echo reads it into its
//!   own buffer `k mod inflight`. Both pay for memory that is cold in the
//!   caches (250 MiB per end at 1 MiB), and `--compare`'s ratio for
//!   net-tls is read against this row: like with like.
//! - `rustls-stream hot` (`"variant": "hot"`): one buffer to send from and
//!   one to receive into at the source, one at the echo, `--size` bytes
//!   each, as a program with a single message buffer has. At sizes whose
//!   working set outgrows the caches this is faster than anything that
//!   moves distinct buffers; its ratio shows how much of the difference
//!   is the memory rather than the transport.
//!
//! The `buffers` field of each point says how many distinct buffers each
//! end cycles through.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ferry::tls::rustls;
use ferry::tls::TlsConfig;
use serde_json::json;

use super::point::{Head, Point};
use super::{Backend, Ctx};
use crate::stats::{round, Summary};
use crate::CliError;

/// The run's certificates: a CA and both pairs for 127.0.0.1, written
/// to a directory of its own and read back as Ferry reads them. Made
/// once per process: callers on other threads wait for the first (the
/// directory is the process's, and is removed once read).
pub fn config() -> Result<Arc<TlsConfig>, CliError> {
    static CONFIG: Mutex<Option<Arc<TlsConfig>>> = Mutex::new(None);
    let mut made = CONFIG.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = made.as_ref() {
        return Ok(c.clone());
    }
    let dir = std::env::temp_dir().join(format!("ferry-bench-tls-{}", std::process::id()));
    let read = crate::tls::generate(&dir, &["127.0.0.1".to_owned()], true)
        .and_then(|()| TlsConfig::from_dir(&dir, "127.0.0.1").map_err(CliError::from));
    let _ = std::fs::remove_dir_all(&dir);
    let config = Arc::new(read?);
    *made = Some(config.clone());
    Ok(config)
}

fn failed(what: impl std::fmt::Display) -> CliError {
    CliError::Failed(format!("rustls-stream: {what}; run the benchmark again"))
}

/// The buffers one end of a run moves the bytes of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Buffers {
    /// As many distinct buffers as messages in flight, as Ferry's pool.
    Pool(usize),
    /// One buffer (at the source: one to send from, one to receive into).
    Hot,
}

impl Buffers {
    /// Distinct buffers per end (the echo's count; the source's hot pair
    /// is one buffer each way).
    fn count(self) -> usize {
        match self {
            Buffers::Pool(n) => n,
            Buffers::Hot => 1,
        }
    }

    /// The source's buffers of `size` bytes, written (pre-faulted) with
    /// the pattern Ferry's throughput sends.
    fn source(self, size: usize) -> Vec<Vec<u8>> {
        let n = match self {
            Buffers::Pool(n) => n,
            Buffers::Hot => 2,
        };
        (0..n)
            .map(|_| {
                let mut b = vec![0u8; size];
                crate::pattern::fill(&mut b, 1);
                b
            })
            .collect()
    }

    /// Which of the source's buffers message `k` leaves from.
    fn send_index(self, k: u64) -> usize {
        match self {
            Buffers::Pool(n) => (k % n as u64) as usize,
            Buffers::Hot => 0,
        }
    }

    /// Which of the source's buffers the echo of message `k` lands in
    /// (with a pool the one it left from, as a buffer Ferry moves and gets
    /// back; a message is sent only once the echo `window` messages
    /// earlier, the last in that buffer, landed whole).
    fn recv_index(self, k: u64) -> usize {
        match self {
            Buffers::Pool(n) => (k % n as u64) as usize,
            Buffers::Hot => 1,
        }
    }
}

/// The echo: read a message whole, write it back, until end of stream;
/// message `k` goes through buffer `k mod buffers`.
fn echo(stream: TcpStream, config: Arc<rustls::ServerConfig>, size: usize, buffers: usize) -> Result<u64, String> {
    let conn = rustls::ServerConnection::new(config).map_err(|e| e.to_string())?;
    let mut tls = rustls::StreamOwned::new(conn, stream);
    // Written through, so that no page is first touched while measuring.
    let mut bufs: Vec<Vec<u8>> = (0..buffers).map(|_| vec![1u8; size]).collect();
    let mut echoed = 0u64;
    loop {
        let buf = &mut bufs[(echoed % buffers as u64) as usize];
        match tls.read_exact(buf) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(echoed),
            Err(e) => return Err(e.to_string()),
        }
        tls.write_all(buf).map_err(|e| e.to_string())?;
        echoed += 1;
    }
}

/// One run's moves over `conn` (the source, non-blocking): at most
/// `window` messages written and not yet echoed back whole. Message `k`
/// of the run leaves from and comes back into the buffers `buffers`
/// picks of `bufs`.
fn moves(
    conn: &mut rustls::ClientConnection,
    sock: &mut TcpStream,
    bufs: &mut [Vec<u8>],
    buffers: Buffers,
    window: u64,
    count: u64,
) -> Result<(), CliError> {
    use rustix::event::{PollFd, PollFlags};
    let (mut sent, mut done) = (0u64, 0u64);
    let (mut out_at, mut in_at) = (0usize, 0usize);
    while done < count {
        let mut progress = false;
        // Encrypt while the window allows and rustls takes more.
        while sent < count && sent - done < window {
            let msg = &bufs[buffers.send_index(sent)];
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
            let rbuf = &mut bufs[buffers.recv_index(done)];
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

/// Throughput at each size, through a pool of `--inflight` buffers per
/// end and through one hot buffer (see the module doc), each on a TLS
/// connection of its own: a warm-up run, then `--runs` measured runs of
/// `--moves` messages.
pub fn measure(ctx: &Ctx<'_>, sizes: &[usize]) -> Result<Vec<Point>, CliError> {
    let a = ctx.args;
    let window = a.inflight.unwrap_or(250);
    let sizes = if sizes.is_empty() { vec![4096] } else { sizes.to_vec() };
    let mut points = Vec::new();
    for size in sizes {
        for buffers in [Buffers::Pool(window), Buffers::Hot] {
            points.push(measure_one(ctx, size, buffers)?);
        }
    }
    Ok(points)
}

/// One point: `--runs` runs (after a warm-up) at `size` through `buffers`.
fn measure_one(ctx: &Ctx<'_>, size: usize, buffers: Buffers) -> Result<Point, CliError> {
    let a = ctx.args;
    let config = config()?;
    let (server, client) = (config.server_config()?, config.client_config()?);
    let window = a.inflight.unwrap_or(250) as u64;
    let runs = a.runs.unwrap_or(20);
    // As Ferry's net-tls throughput (every byte is encrypted), and not fewer than the window.
    let count = (a.moves.unwrap_or(super::default_moves(size, true)) as u64).max(window);
    let listener = TcpListener::bind("127.0.0.1:0").map_err(failed)?;
    let addr = listener.local_addr().map_err(failed)?;
    let echo_buffers = buffers.count();
    let echo = std::thread::Builder::new()
        .name("rustls-echo".into())
        .spawn(move || -> Result<u64, String> {
            crate::pin::to_cpu(1);
            let (stream, _) = listener.accept().map_err(|e| e.to_string())?;
            let _ = stream.set_nodelay(true);
            echo(stream, server, size, echo_buffers)
        })
        .map_err(failed)?;
    crate::pin::to_cpu(0);
    let mut sock = TcpStream::connect(addr).map_err(failed)?;
    sock.set_nodelay(true).map_err(failed)?;
    sock.set_nonblocking(true).map_err(failed)?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").map_err(failed)?;
    let mut conn = rustls::ClientConnection::new(client, name).map_err(failed)?;
    let mut bufs = buffers.source(size);
    let mut rates = Vec::with_capacity(runs);
    for run in 0..=runs {
        let t0 = Instant::now();
        moves(&mut conn, &mut sock, &mut bufs, buffers, window, count)?;
        if run > 0 {
            rates.push(count as f64 / t0.elapsed().as_secs_f64() / 1e6);
            // The bar counts the runs of the row --compare's ratio uses.
            if buffers != Buffers::Hot {
                ctx.progress.inc(1);
            }
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
    // The echoes came back whole and unchanged.
    if let Some(i) = bufs.iter().position(|b| !crate::pattern::check(b, 1)) {
        return Err(failed(format!("buffer {i} came back changed")));
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
    let mut extra = json!({
        "inflight": window, "moves_per_run": count, "gbit_s_median": gbit, "buffers": buffers.count(),
    });
    if buffers == Buffers::Hot {
        extra["variant"] = json!("hot");
    }
    Ok(Point::new(head, summary, None, extra))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::parse_bench_args;
    use crate::bench::progress::Progress;

    /// A pool cycles through every buffer, a message leaving from and
    /// coming back into the same one; the hot pair sends from one buffer
    /// and receives into the other.
    #[test]
    fn a_pool_cycles_through_its_buffers() {
        let pool = Buffers::Pool(4);
        let sent: Vec<usize> = (0..8).map(|k| pool.send_index(k)).collect();
        assert_eq!(sent, [0, 1, 2, 3, 0, 1, 2, 3]);
        assert!((0..8).all(|k| pool.recv_index(k) == pool.send_index(k)));
        assert_eq!((pool.count(), pool.source(4096).len()), (4, 4));
        let hot = Buffers::Hot;
        assert!((0..8).all(|k| hot.send_index(k) == 0 && hot.recv_index(k) == 1));
        assert_eq!((hot.count(), hot.source(4096).len()), (1, 2));
    }

    /// Each size gives a row through a pool of --inflight buffers per end
    /// (the one Ferry is compared with) and a row through one hot buffer,
    /// each with every message echoed (checked) and the buffers unchanged.
    #[test]
    fn measures_the_pool_and_the_hot_buffer() {
        let args = parse_bench_args("throughput --backend rustls-stream --size 65536 --inflight 8 --runs 1 --moves 20")
            .unwrap();
        let ctx = Ctx { args: &args, progress: Progress::hidden(), points: Vec::new() };
        let points = measure(&ctx, &[65536]).unwrap();
        let got: Vec<(&str, &str, Option<f64>, Option<f64>)> =
            points.iter().map(|p| (p.backend(), p.str("variant"), p.num("buffers"), p.num("samples"))).collect();
        assert_eq!(got, [("rustls-stream", "", Some(8.0), Some(1.0)), ("rustls-stream", "hot", Some(1.0), Some(1.0))]);
    }
}
