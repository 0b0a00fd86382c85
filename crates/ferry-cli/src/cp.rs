//! `ferry cp SRC DST`: copy a file, standard input/output or a socket
//! stream through a Ferry pool with container-shipping I/O (ferry-io): the
//! kernel reads into pool buffers and writes from them, the command never
//! copies a byte itself. A regular file as the source skips the pool: the
//! kernel moves its pages to the destination itself (`sendfile`).

use std::io::IsTerminal;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use ferry::tls::{Security, TlsConfig};
use ferry::{Allocator, Domain, PoolConstraints};
use ferry_io::{Chunk, Completion, Done, Filled, IoError, Kind, Port, Ring};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::args::whole;
use crate::cp_tls::{self, Input, Output};
use crate::tls_args::{host_of, Side, TlsFlags, TlsMode};
use crate::CliError;

/// Buffers in the pool of `ferry cp`.
pub const POOL_BUFFERS: u64 = 16;
/// Size of each buffer of that pool (1 MiB: the pool is 16 MiB).
pub const BUFFER_SIZE: usize = 1 << 20;
/// Buffers one read fills at most (the other half of the pool is free for
/// the next read while these are written).
pub(crate) const BATCH: usize = 8;
/// Seconds a socket peer may go without sending or taking a byte, and a
/// connect may take, unless `--timeout` says otherwise.
pub const DEFAULT_TIMEOUT_SECS: u64 = 30;
/// The largest `--timeout` (a day).
const MAX_TIMEOUT_SECS: u64 = 86_400;

/// Arguments of `ferry cp`.
#[derive(Debug, Args)]
#[command(after_help = "SRC and DST are each one of:\n  \
    PATH            a file (a directory as DST: the file keeps its name inside it)\n  \
    -               standard input (SRC) or standard output (DST)\n  \
    tcp:HOST:PORT   SRC: listen there and receive one connection; DST: connect and send\n  \
    unix:PATH       SRC: listen on a Unix socket there and receive one connection; DST: connect and send\n\n\
    Over a socket, both ends are `ferry cp`: the stream carries each batch's length and an end\n\
    mark, so a sender that stops early makes the receiver fail instead of reporting success.\n\
    The copy runs in a fixed pool of 16 buffers of 1 MiB (16 MiB), whatever its size; a regular\n\
    file as SRC goes to a socket, file or pipe without passing through user memory at all\n\
    (sendfile: the kernel sends the file's pages, or copies them once to a file); into a file from a\n\
    socket or pipe, the writes run on an io_uring queue beside the reads. A progress bar is shown when\n\
    standard error is a terminal; a summary line (bytes, time, GB/s) goes to standard error.\n\
    Over a socket, a peer that sends nothing (receiving) or takes nothing (sending) for --timeout\n\
    seconds (default 30; 0: no limit), or a connect that gets no answer that long, ends the copy;\n\
    the wait for a sender to connect to a listening SRC is not limited.\n\n\
    Exit status 0 only when every byte was copied; otherwise 1, with one line that names the file or\n\
    socket that failed and why: a receiver that closed or reset the connection, a sender that stopped\n\
    before the end mark or reset it, a peer past the timeout, a full device. A receiver's line says\n\
    how many bytes are in the destination file (\"the copy is incomplete (N bytes written to DST)\"),\n\
    a sender's how many it had sent. A sender's exit 0 means every byte went out on the socket with\n\
    the end mark; only the receiver's exit 0 says they are all in DST. A bad command line exits 2.\n\n\
    Across machines: with --tls-certificates DIR (the same directory layout as nbdkit and qemu; `ferry tls\n\
    gen DIR` writes one) a tcp: stream is TLS 1.3 and both ends check each other's certificate: the\n\
    receiver (tcp: as SRC) needs ca-cert.pem, server-cert.pem and server-key.pem, the sender (tcp: as DST)\n\
    ca-cert.pem, client-cert.pem and client-key.pem, and connects by a name the server certificate\n\
    carries. Both ends must choose TLS: a plain end against a TLS end fails. A byte changed on the way\n\
    ends the copy (exit 1) and the destination holds only bytes that arrived intact (a prefix of the\n\
    source). Over TLS a file is read into the pool and encrypted from there (no sendfile). Plain TCP\n\
    is allowed on loopback addresses only, unless --insecure is given.\n\n\
    Examples:\n  \
    ferry tls gen certs --host receiver.example      (copy certs/ to both machines)\n  \
    receiver$ ferry cp --tls-certificates certs tcp:0.0.0.0:7000 disk.img\n  \
    sender$   ferry cp --tls-certificates certs disk.img tcp:receiver.example:7000")]
pub struct CpArgs {
    /// What to copy.
    pub src: String,
    /// Where to copy it.
    pub dst: String,
    /// Read and write files with O_DIRECT where the file system allows
    /// (bypasses the page cache).
    #[arg(long)]
    pub direct: bool,
    /// No summary line, no "listening on" line.
    #[arg(long, short)]
    pub quiet: bool,
    /// Seconds a socket peer may send or take nothing, and a connect may
    /// wait for an answer, before the copy fails (0: no limit).
    #[arg(allow_negative_numbers = true, long, value_name = "SECONDS", default_value_t = DEFAULT_TIMEOUT_SECS,
          value_parser = whole::<u64>(0, MAX_TIMEOUT_SECS))]
    pub timeout: u64,
    #[command(flatten)]
    pub tls: TlsFlags,
}

impl CpArgs {
    /// The limit on a stalled socket; `None`: no limit.
    fn limit(&self) -> Option<Duration> {
        (self.timeout > 0).then(|| Duration::from_secs(self.timeout))
    }
}

/// One side of a copy, as written on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Place {
    Std,
    File(PathBuf),
    Tcp(String),
    Unix(PathBuf),
}

impl Place {
    fn parse(s: &str) -> Place {
        if s == "-" {
            Place::Std
        } else if let Some(a) = s.strip_prefix("tcp:") {
            Place::Tcp(a.to_string())
        } else if let Some(p) = s.strip_prefix("unix:") {
            Place::Unix(PathBuf::from(p))
        } else {
            Place::File(PathBuf::from(s))
        }
    }
}

pub(crate) fn failed(e: IoError, copied: u64) -> CliError {
    if copied == 0 {
        CliError::Failed(format!("{e}; nothing was copied"))
    } else {
        CliError::Failed(format!("{e}; the copy is incomplete ({copied} bytes written)"))
    }
}

/// `n` bytes for people: exact, with MiB beside a large count.
pub(crate) fn amount(n: u64) -> String {
    if n >= 1 << 20 {
        format!("{n} bytes ({:.1} MiB)", n as f64 / (1u64 << 20) as f64)
    } else {
        format!("{n} bytes")
    }
}

/// Whether `e` is the `--timeout` of a socket running out.
fn timed_out(e: &IoError) -> bool {
    matches!(e, IoError::TimedOut { .. })
}

/// The `--timeout` in words.
pub(crate) fn seconds(limit: Option<Duration>) -> String {
    limit.map_or_else(|| "no limit".to_string(), |d| format!("{} s", d.as_secs()))
}

/// The line for a write to `output` that failed with `e` after `sent`
/// bytes of the copy. To a socket it names the receiver and what it did
/// (closed, reset, stalled), never the source; elsewhere the error as it is.
fn send_failed(e: IoError, output: &Port, sent: u64, limit: Option<Duration>) -> CliError {
    if output.kind() != Kind::Stream {
        return failed(e, sent);
    }
    let why = match &e {
        IoError::ConnectionReset { .. } => {
            format!("the receiver closed the connection after {} (connection reset by peer)", amount(sent))
        }
        IoError::BrokenPipe { .. } => {
            format!("the receiver closed the connection after {} (broken pipe)", amount(sent))
        }
        e if timed_out(e) => {
            format!("the receiver took nothing for {} after {} (timeout, see --timeout)", seconds(limit), amount(sent))
        }
        _ => return failed(e, sent),
    };
    CliError::Failed(format!("{}: {why}; the copy is incomplete", output.name()))
}

/// Why reading the source of a copy stopped.
#[derive(Debug)]
pub(crate) enum ReadFailure {
    /// The source failed.
    Io(IoError),
    /// A framed stream ended between batches, without the end mark.
    Stopped,
    /// A framed stream announced a batch no `ferry cp` sends.
    NotFerry(u64),
}

impl ReadFailure {
    /// `SOURCE: what happened`, in the words of the side that failed: from
    /// a socket, what the sender did (stopped, reset, went silent).
    pub(crate) fn describe(&self, input: &Port, framed: bool, limit: Option<Duration>) -> String {
        let name = input.name();
        let stream = input.kind() == Kind::Stream;
        match self {
            ReadFailure::Stopped => format!("{name}: the sender closed the connection before the end of the copy"),
            // A TLS handshake record starts 0x16 0x03.
            ReadFailure::NotFerry(len) if len & 0xffff == 0x0316 => {
                format!("{name}: the sender speaks TLS and this receiver does not; give both --tls-certificates DIR")
            }
            ReadFailure::NotFerry(len) => format!("{name}: not a `ferry cp` sender (a batch of {len} bytes announced)"),
            ReadFailure::Io(IoError::UnexpectedEof { missing, .. }) if framed => {
                format!(
                    "{name}: the sender closed the connection in the middle of a batch, {missing} bytes short of it"
                )
            }
            ReadFailure::Io(IoError::ConnectionReset { .. }) if stream => {
                format!("{name}: the sender reset the connection before the end of the copy (connection reset by peer)")
            }
            ReadFailure::Io(e) if stream && timed_out(e) => {
                format!("{name}: the sender sent nothing for {} (timeout, see --timeout)", seconds(limit))
            }
            ReadFailure::Io(e) => e.to_string(),
        }
    }
}

/// The line for a copy whose source failed (`why`, from
/// [`ReadFailure::describe`]) with `written` bytes in the destination `dst`.
pub(crate) fn receive_failed(why: String, written: u64, dst: &str) -> CliError {
    if written == 0 {
        CliError::Failed(format!("{why}; nothing was copied"))
    } else {
        CliError::Failed(format!("{why}; the copy is incomplete ({written} bytes written to {dst})"))
    }
}

/// The line for a socket whose connect timeout could not be set.
fn no_timeout(name: &str, e: std::io::Error) -> CliError {
    CliError::Failed(format!("{name}: cannot set the timeout: {e}; nothing was copied"))
}

/// Connect to `addr` (each of its addresses in turn), each attempt
/// waiting at most `limit`.
fn connect_tcp(addr: &str, name: &str, limit: Option<Duration>) -> Result<TcpStream, CliError> {
    let cannot = |why: String| CliError::Failed(format!("{name}: cannot connect: {why}; nothing was copied"));
    let addrs = addr.to_socket_addrs().map_err(|e| cannot(e.to_string()))?;
    let mut last = None;
    for a in addrs {
        let attempt = match limit {
            Some(t) => TcpStream::connect_timeout(&a, t),
            None => TcpStream::connect(a),
        };
        match attempt {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(cannot(match last {
        Some(e) if e.kind() == std::io::ErrorKind::TimedOut && limit.is_some() => {
            format!("no answer within {} (timeout, see --timeout)", seconds(limit))
        }
        Some(e) => e.to_string(),
        None => "the name has no address".to_string(),
    }))
}

/// Connect to the Unix socket `path`, waiting at most `limit` (a listener
/// whose queue is full keeps a connect waiting; the send timeout bounds it).
fn connect_unix(path: &Path, name: &str, limit: Option<Duration>) -> Result<UnixStream, CliError> {
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    use rustix::net::{connect, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let cannot = |why: String| CliError::Failed(format!("{name}: cannot connect: {why}; nothing was copied"));
    let fd = socket_with(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None)
        .map_err(|e| cannot(std::io::Error::from(e).to_string()))?;
    set_socket_timeout(&fd, Timeout::Send, limit).map_err(|e| no_timeout(name, e.into()))?;
    let at = SocketAddrUnix::new(path).map_err(|e| cannot(std::io::Error::from(e).to_string()))?;
    match connect(&fd, &at) {
        Ok(()) => Ok(UnixStream::from(fd)),
        Err(rustix::io::Errno::AGAIN) if limit.is_some() => {
            Err(cannot(format!("no answer within {} (timeout, see --timeout)", seconds(limit))))
        }
        Err(e) => Err(cannot(std::io::Error::from(e).to_string())),
    }
}

/// Listen on `addr` and take one connection.
fn accept_tcp(addr: &str, name: &str, quiet: bool) -> Result<TcpStream, CliError> {
    let l = TcpListener::bind(addr)
        .map_err(|e| CliError::Failed(format!("{name}: cannot listen there: {e}; nothing was copied")))?;
    if !quiet {
        let at = l.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| addr.to_string());
        eprintln!("ferry cp: listening on tcp:{at}");
    }
    // The wait for a sender is not limited: the receiver is
    // started first, the sender whenever its user gets to it.
    let (s, _) = l
        .accept()
        .map_err(|e| CliError::Failed(format!("{name}: accepting a connection failed: {e}; nothing was copied")))?;
    Ok(s)
}

fn open_source(place: &Place, name: &str, direct: bool, quiet: bool) -> Result<Port, CliError> {
    let port = match place {
        Place::Std => Port::stdin(),
        Place::File(p) if direct => Port::open_direct(p),
        Place::File(p) => Port::open(p),
        Place::Tcp(addr) => {
            let s = accept_tcp(addr, name, quiet)?;
            Port::from_fd(s, name)
        }
        Place::Unix(path) => {
            let l = UnixListener::bind(path)
                .map_err(|e| CliError::Failed(format!("{name}: cannot listen there: {e}; nothing was copied")))?;
            if !quiet {
                eprintln!("ferry cp: listening on {name}");
            }
            let accepted = l.accept();
            // The socket file served its purpose once a sender connected.
            let _ = std::fs::remove_file(path);
            let (s, _) = accepted.map_err(|e| {
                CliError::Failed(format!("{name}: accepting a connection failed: {e}; nothing was copied"))
            })?;
            Port::from_fd(s, name)
        }
    };
    port.map_err(|e| failed(e, 0))
}

fn open_destination(place: &Place, name: &str, direct: bool, limit: Option<Duration>) -> Result<Port, CliError> {
    let port = match place {
        Place::Std => Port::stdout(),
        Place::File(p) if direct => Port::create_direct(p),
        Place::File(p) => Port::create(p),
        Place::Tcp(addr) => {
            let s = connect_tcp(addr, name, limit)?;
            Port::from_fd(s, name)
        }
        Place::Unix(path) => {
            let s = connect_unix(path, name, limit)?;
            Port::from_fd(s, name)
        }
    };
    port.map_err(|e| failed(e, 0))
}

/// Between two `ferry cp`s a socket stream is framed: each batch is an
/// 8-byte little-endian length and that many bytes, and a zero length ends
/// the copy, so a sender that stops early is told from a finished copy.
fn framed(place: &Place) -> bool {
    matches!(place, Place::Tcp(_) | Place::Unix(_))
}

/// The next batch of filled buffers; empty at the end of the input.
pub(crate) fn read_batch(input: &mut Port, alloc: &Allocator, framed: bool) -> Result<Vec<Filled>, ReadFailure> {
    if !framed {
        // Files are read in full batches; a pipe, socket or terminal gives
        // what it has, so the data flows on as it comes.
        let read = if input.kind() == Kind::File { input.read(alloc, BATCH) } else { input.read_some(alloc, BATCH) };
        return read.map_err(ReadFailure::Io);
    }
    let header = match input.read_exact(alloc, 8) {
        Ok(h) => h,
        Err(IoError::UnexpectedEof { .. }) => return Err(ReadFailure::Stopped),
        Err(e) => return Err(ReadFailure::Io(e)),
    };
    let mut word = [0u8; 8];
    word.copy_from_slice(&header[0].bytes()[..8]);
    drop(header);
    let len = u64::from_le_bytes(word);
    if len == 0 {
        return Ok(Vec::new());
    }
    if len > (BATCH * BUFFER_SIZE) as u64 {
        return Err(ReadFailure::NotFerry(len));
    }
    input.read_exact(alloc, len).map_err(ReadFailure::Io)
}

/// Write a batch (framed: after its length); returns the payload bytes
/// written. An empty framed batch is the end mark. On error, the payload
/// bytes of the batch that did go out are `output.offset()` past where it
/// was, less the 8 of the length when framed ([`payload`]).
fn write_batch(output: &mut Port, alloc: &Allocator, framed: bool, filled: Vec<Filled>) -> Result<u64, IoError> {
    if !framed {
        return output.write(filled);
    }
    let len: u64 = filled.iter().map(|f| f.len as u64).sum();
    let mut header =
        alloc.alloc().ok_or_else(|| IoError::NoBuffer { name: output.name().to_string(), offset: output.offset() })?;
    let bytes = header.as_mut_slice().map_err(|_| IoError::BufferShared { name: output.name().to_string() })?;
    bytes[..8].copy_from_slice(&len.to_le_bytes());
    let chunks = std::iter::once(Chunk::new(header, 0..8)?).chain(filled.into_iter().map(Chunk::from));
    Ok(output.write(chunks)? - 8)
}

/// Payload bytes among `moved` bytes of one [`write_batch`].
fn payload(moved: u64, framed: bool) -> u64 {
    if framed {
        moved.saturating_sub(8)
    } else {
        moved
    }
}

/// Count the bytes of finished writes into `written`; the first failure
/// among them, if any (every success is counted all the same).
fn tally(done: Vec<Completion>, written: &mut u64) -> Option<IoError> {
    let mut first = None;
    for c in done {
        match c.result {
            Ok(Done::Written(n)) => *written += n,
            Ok(Done::Read(_)) => {}
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    first
}

/// Wait for every write in flight on `ring`, counting what they wrote, so
/// a failed copy reports what is in the destination; the first failure.
fn drain(ring: &mut Ring, written: &mut u64) -> Option<IoError> {
    let mut first = None;
    while ring.in_flight() > 0 {
        match ring.wait(None) {
            Ok(done) => {
                if let Some(e) = tally(done, written) {
                    first.get_or_insert(e);
                }
            }
            Err(e) => {
                // The ring itself failed: its drop waits for the rest.
                first.get_or_insert(e);
                break;
            }
        }
    }
    first
}

/// A socket, pipe or standard input into a file: the writes go on an
/// io_uring [`Ring`] (the pool registered as fixed buffers), so the file
/// writes of one batch run while the next batch is read; the pool's other
/// half holds the batch being read. Returns the bytes written. On failure
/// every write in flight is waited for first, so the line counts the bytes
/// that are in `dst`.
fn receive_into_file(
    input: &mut Port,
    output: &mut Port,
    alloc: &Allocator,
    framed: bool,
    bar: Option<&ProgressBar>,
    limit: Option<Duration>,
    dst: &str,
) -> Result<u64, CliError> {
    let mut ring = Ring::new(32).map_err(|e| failed(e, 0))?;
    ring.register(alloc);
    let (mut submitted, mut written) = (0u64, 0u64);
    let write_failed = |ring: &mut Ring, e: IoError, written: &mut u64| {
        drain(ring, written);
        failed(e, *written)
    };
    loop {
        // A framed batch needs BATCH buffers and one for its header.
        while alloc.available() < BATCH + 1 && ring.in_flight() > 0 {
            let done = ring.wait(None);
            match done.map(|d| tally(d, &mut written)) {
                Ok(None) => {}
                Ok(Some(e)) | Err(e) => return Err(write_failed(&mut ring, e, &mut written)),
            }
        }
        let filled = match read_batch(input, alloc, framed) {
            Ok(f) => f,
            Err(why) => {
                // What the writes in flight put in the file counts too.
                let write_error = drain(&mut ring, &mut written);
                return Err(match write_error {
                    Some(e) => failed(e, written),
                    None => receive_failed(why.describe(input, framed, limit), written, dst),
                });
            }
        };
        if filled.is_empty() {
            break;
        }
        for f in filled {
            let len = f.len as u64;
            if let Err(e) = ring.submit_write(output, Some(submitted), f, submitted) {
                return Err(write_failed(&mut ring, e, &mut written));
            }
            submitted += len;
        }
        match ring.completions().map(|d| tally(d, &mut written)) {
            Ok(None) => {}
            Ok(Some(e)) | Err(e) => return Err(write_failed(&mut ring, e, &mut written)),
        }
        if let Some(b) = bar {
            b.set_position(written);
        }
    }
    if let Some(e) = drain(&mut ring, &mut written) {
        return Err(failed(e, written));
    }
    Ok(written)
}

/// Move the rest of the file `input` to `output` in the kernel; `false`
/// (nothing moved) when `output` does not take `sendfile`.
fn send_file_plain(
    input: &mut Port,
    output: &mut Port,
    bar: Option<&ProgressBar>,
    copied: &mut u64,
    limit: Option<Duration>,
) -> Result<bool, CliError> {
    let start = output.offset();
    loop {
        match output.send_from(input, 64 << 20) {
            Ok(0) => return Ok(true),
            Ok(n) => *copied += n,
            Err(IoError::Os { source, .. })
                if output.offset() == start && source.raw_os_error() == Some(libc::EINVAL) =>
            {
                return Ok(false)
            }
            Err(e) => return Err(send_failed(e, output, output.offset() - start, limit)),
        }
        if let Some(b) = bar {
            b.set_position(*copied);
        }
    }
}

/// Send the rest of the file `input` on the stream `output` in framed
/// batches, each moved by the kernel without passing through user memory.
/// Returns the payload bytes sent.
fn send_file_framed(
    input: &mut Port,
    output: &mut Port,
    bar: Option<&ProgressBar>,
    limit: Option<Duration>,
) -> Result<u64, CliError> {
    let start = input.offset();
    let mut copied = 0u64;
    loop {
        let size = rustix::fs::fstat(&*input)
            .map_err(|e| {
                CliError::Failed(format!(
                    "{}: fstat: {e}; the copy is incomplete ({copied} bytes written)",
                    input.name()
                ))
            })?
            .st_size as u64;
        let batch = size.saturating_sub(input.offset()).min((BATCH * BUFFER_SIZE) as u64);
        if batch == 0 {
            return Ok(copied);
        }
        output.send_more(&batch.to_le_bytes()).map_err(|e| send_failed(e, output, copied, limit))?;
        // An error comes back as it happens (the bytes moved before it
        // count in the file's offset): a short count is the file ending.
        let n = output.send_from(input, batch).map_err(|e| send_failed(e, output, input.offset() - start, limit))?;
        copied += n;
        if n < batch {
            return Err(CliError::Failed(format!(
                "{}: the file shrank while it was being copied (ended at byte {}); the copy is incomplete ({copied} bytes written)",
                input.name(),
                input.offset()
            )));
        }
        if let Some(b) = bar {
            b.set_position(copied);
        }
    }
}

/// A directory as destination stands for the file of the source's name in it.
fn destination_path(src: &Place, dst: PathBuf) -> PathBuf {
    match src {
        Place::File(s) if dst.is_dir() => match s.file_name() {
            Some(base) => dst.join(base),
            None => dst,
        },
        _ => dst,
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Run `ferry cp`.
pub fn run(args: &CpArgs) -> Result<(), CliError> {
    let src = Place::parse(&args.src);
    let mut dst = Place::parse(&args.dst);
    if let Place::File(d) = dst {
        dst = Place::File(destination_path(&src, d));
    }
    let dst_name = match &dst {
        Place::File(p) => p.display().to_string(),
        _ => args.dst.clone(),
    };
    if let (Place::File(s), Place::File(d)) = (&src, &dst) {
        if same_file(s, d) {
            return Err(CliError::Failed(format!("{} and {dst_name} are the same file; nothing was copied", args.src)));
        }
    }
    let limit = args.limit();
    let (src_tls, dst_tls) =
        (tls_for(&src, Side::Accept, &args.src, &args.tls)?, tls_for(&dst, Side::Connect, &args.dst, &args.tls)?);
    if src_tls.is_some() || dst_tls.is_some() {
        return run_tls(args, &src, &dst, &dst_name, src_tls, dst_tls);
    }
    if args.tls.tls == TlsMode::Require {
        return Err(CliError::Usage(
            "--tls=require: neither SRC nor DST is tcp:HOST:PORT, and TLS protects tcp: streams only; drop --tls=require"
                .into(),
        ));
    }
    let domain = Domain::new("ferry-cp");
    let alloc = Allocator::new(&domain, POOL_BUFFERS, BUFFER_SIZE, PoolConstraints::default())?;
    let mut input = open_source(&src, &args.src, args.direct, args.quiet)?;
    let mut output = open_destination(&dst, &dst_name, args.direct, limit)?;
    // Every wait on a socket, for data or for room, is bounded (a poll
    // each time the socket has nothing or no room).
    for (port, socket) in [(&mut input, framed(&src)), (&mut output, framed(&dst))] {
        if socket {
            port.set_timeout(limit).map_err(|e| failed(e, 0))?;
        }
    }

    let total = match &src {
        Place::File(p) => std::fs::metadata(p).ok().filter(|m| m.is_file()).map(|m| m.len()),
        _ => None,
    };
    let bar = progress(total);
    let t0 = Instant::now();
    let mut copied = 0u64;
    let (framed_in, framed_out) = (framed(&src), framed(&dst));
    // A file to a socket: the kernel sends the file's pages themselves
    // (sendfile), so the sending side copies nothing at all; through the
    // pool it would copy every byte once into a buffer, and on a 2-core
    // machine that copy halves the rate (measured: 0.89 against 1.68 GB/s
    // for iperf3 before, see BENCHMARKS.md).
    let from_file = input.kind() == Kind::File && !input.is_direct() && !output.is_direct();
    let mut by_kernel = false;
    if from_file && framed_out && output.kind() == Kind::Stream {
        copied = send_file_framed(&mut input, &mut output, bar.as_ref(), limit)?;
        by_kernel = true;
    } else if from_file && !framed_out && output.kind() != Kind::Datagram {
        // A file to a file, pipe or device: the kernel moves the pages
        // (sendfile: one copy, page cache to page cache) where a read and
        // a write through the pool copy twice, as `cat` does. An fd that
        // does not take sendfile (O_APPEND) goes through the pool.
        by_kernel = send_file_plain(&mut input, &mut output, bar.as_ref(), &mut copied, limit)?;
    }
    // A socket, pipe or terminal into a file: the file writes go through
    // the io_uring Ring so they overlap the next batch's reads. Measured
    // against the plain read-then-write loop, tcp → ext4 file, 1 GiB, three
    // alternations on the busy 2-CPU test machine: 0.67/0.71/0.76 GB/s
    // against 0.20/0.40/0.26 GB/s. File sources need no Ring: sendfile above.
    let ring_out = !by_kernel && output.kind() == Kind::File && !output.is_direct() && input.kind() != Kind::File;
    if ring_out {
        copied = receive_into_file(&mut input, &mut output, &alloc, framed_in, bar.as_ref(), limit, &dst_name)?;
    } else if !by_kernel {
        loop {
            let filled = read_batch(&mut input, &alloc, framed_in)
                .map_err(|why| receive_failed(why.describe(&input, framed_in, limit), copied, &dst_name))?;
            if filled.is_empty() {
                break;
            }
            let before = output.offset();
            copied += write_batch(&mut output, &alloc, framed_out, filled).map_err(|e| {
                let sent = copied + payload(output.offset() - before, framed_out);
                send_failed(e, &output, sent, limit)
            })?;
            if let Some(b) = &bar {
                b.set_position(copied);
            }
        }
    }
    if framed_out {
        write_batch(&mut output, &alloc, true, Vec::new()).map_err(|e| send_failed(e, &output, copied, limit))?;
    }
    drop(output); // closes a socket: the receiver sees the end
    let secs = t0.elapsed().as_secs_f64();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if !args.quiet {
        let rate = if secs > 0.0 { copied as f64 / secs / 1e9 } else { 0.0 };
        eprintln!("ferry cp: {copied} bytes from {} to {dst_name} in {secs:.3} s = {rate:.2} GB/s", args.src);
    }
    Ok(())
}

/// The TLS configuration of the side `place` (`None`: plain), after the
/// rules of the TLS flags: plain TCP off the loopback needs `--insecure`,
/// `--tls=require` needs a tcp: side.
fn tls_for(place: &Place, side: Side, text: &str, flags: &TlsFlags) -> Result<Option<Arc<TlsConfig>>, CliError> {
    let Place::Tcp(addr) = place else {
        flags.uses_tls()?;
        return Ok(None);
    };
    // A name that does not resolve fails at the bind or connect, with its reason.
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map(Iterator::collect).unwrap_or_default();
    match flags.security(side, text, host_of(addr), &addrs)? {
        Security::Tls(config) => Ok(Some(config)),
        _ => Ok(None),
    }
}

/// `ferry cp` with TLS on a tcp: side (see [`cp_tls`]); the other side is
/// opened as on the plain path.
fn run_tls(
    args: &CpArgs,
    src: &Place,
    dst: &Place,
    dst_name: &str,
    src_tls: Option<Arc<TlsConfig>>,
    dst_tls: Option<Arc<TlsConfig>>,
) -> Result<(), CliError> {
    let limit = args.limit();
    let domain = Domain::new("ferry-cp");
    let alloc = Allocator::new(&domain, POOL_BUFFERS, BUFFER_SIZE, PoolConstraints::default())?;
    let mut input = match (src, &src_tls) {
        (Place::Tcp(addr), Some(config)) => {
            let sock = accept_tcp(addr, &args.src, args.quiet)?;
            Input::Tls(Box::new(cp_tls::accept(sock, config, &args.src, limit)?))
        }
        _ => {
            let mut port = open_source(src, &args.src, args.direct, args.quiet)?;
            if framed(src) {
                port.set_timeout(limit).map_err(|e| failed(e, 0))?;
            }
            Input::Port(port, framed(src))
        }
    };
    let mut output = match (dst, &dst_tls) {
        (Place::Tcp(addr), Some(config)) => {
            let sock = connect_tcp(addr, dst_name, limit)?;
            Output::Tls(Box::new(cp_tls::connect(sock, config, dst_name, limit)?))
        }
        _ => {
            let mut port = open_destination(dst, dst_name, args.direct, limit)?;
            if framed(dst) {
                port.set_timeout(limit).map_err(|e| failed(e, 0))?;
            }
            Output::Port(port, framed(dst))
        }
    };
    let total = match src {
        Place::File(p) => std::fs::metadata(p).ok().filter(|m| m.is_file()).map(|m| m.len()),
        _ => None,
    };
    let bar = progress(total);
    let t0 = Instant::now();
    let copied = cp_tls::copy(&mut input, &mut output, &alloc, limit, &args.src, dst_name, |n| {
        if let Some(b) = &bar {
            b.set_position(n);
        }
    })?;
    drop(output); // closes a socket: the receiver sees the end
    let secs = t0.elapsed().as_secs_f64();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if !args.quiet {
        let rate = if secs > 0.0 { copied as f64 / secs / 1e9 } else { 0.0 };
        eprintln!("ferry cp: {copied} bytes from {} to {dst_name} over TLS in {secs:.3} s = {rate:.2} GB/s", args.src);
    }
    Ok(())
}

/// A progress bar on standard error when it is a terminal.
fn progress(total: Option<u64>) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = match total {
        Some(t) => {
            let b = ProgressBar::with_draw_target(Some(t), ProgressDrawTarget::stderr());
            if let Ok(style) =
                ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
            {
                b.set_style(style);
            }
            b
        }
        None => {
            let b = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{spinner} {bytes} {binary_bytes_per_sec}") {
                b.set_style(style);
            }
            b
        }
    };
    Some(bar)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_parse() {
        assert_eq!(Place::parse("-"), Place::Std);
        assert_eq!(Place::parse("tcp:127.0.0.1:9"), Place::Tcp("127.0.0.1:9".into()));
        assert_eq!(Place::parse("unix:/tmp/s"), Place::Unix("/tmp/s".into()));
        assert_eq!(Place::parse("a/b"), Place::File("a/b".into()));
    }
}
