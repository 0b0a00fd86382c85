//! `ferry cp SRC DST`: copy a file, standard input/output or a socket
//! stream through a Ferry pool with container-shipping I/O (ferry-io): the
//! kernel reads into pool buffers and writes from them, the command never
//! copies a byte itself. A regular file as the source skips the pool: the
//! kernel moves its pages to the destination itself (`sendfile`).

use std::io::IsTerminal;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use ferry::{Allocator, Domain, PoolConstraints};
use ferry_io::{Chunk, Done, Filled, IoError, Kind, Port, Ring};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::CliError;

/// Buffers in the pool of `ferry cp`.
pub const POOL_BUFFERS: u64 = 16;
/// Size of each buffer of that pool (1 MiB: the pool is 16 MiB).
pub const BUFFER_SIZE: usize = 1 << 20;
/// Buffers one read fills at most (the other half of the pool is free for
/// the next read while these are written).
const BATCH: usize = 8;

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
    Exit status 0 only when every byte was copied; otherwise 1, with one line naming the file.")]
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

fn failed(e: IoError, copied: u64) -> CliError {
    if copied == 0 {
        CliError::Failed(format!("{e}; nothing was copied"))
    } else {
        CliError::Failed(format!("{e}; the copy is incomplete ({copied} bytes written)"))
    }
}

fn open_source(place: &Place, name: &str, direct: bool, quiet: bool) -> Result<Port, CliError> {
    let port = match place {
        Place::Std => Port::stdin(),
        Place::File(p) if direct => Port::open_direct(p),
        Place::File(p) => Port::open(p),
        Place::Tcp(addr) => {
            let l = TcpListener::bind(addr.as_str())
                .map_err(|e| CliError::Failed(format!("{name}: cannot listen there: {e}; nothing was copied")))?;
            if !quiet {
                let at = l.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| addr.clone());
                eprintln!("ferry cp: listening on tcp:{at}");
            }
            let (s, _) = l.accept().map_err(|e| {
                CliError::Failed(format!("{name}: accepting a connection failed: {e}; nothing was copied"))
            })?;
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

fn open_destination(place: &Place, name: &str, direct: bool) -> Result<Port, CliError> {
    let port = match place {
        Place::Std => Port::stdout(),
        Place::File(p) if direct => Port::create_direct(p),
        Place::File(p) => Port::create(p),
        Place::Tcp(addr) => {
            let s = TcpStream::connect(addr.as_str())
                .map_err(|e| CliError::Failed(format!("{name}: cannot connect: {e}; nothing was copied")))?;
            Port::from_fd(s, name)
        }
        Place::Unix(path) => {
            let s = UnixStream::connect(path)
                .map_err(|e| CliError::Failed(format!("{name}: cannot connect: {e}; nothing was copied")))?;
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
fn read_batch(input: &mut Port, alloc: &Allocator, framed: bool, copied: u64) -> Result<Vec<Filled>, CliError> {
    if !framed {
        // Files are read in full batches; a pipe, socket or terminal gives
        // what it has, so the data flows on as it comes.
        let read = if input.kind() == Kind::File { input.read(alloc, BATCH) } else { input.read_some(alloc, BATCH) };
        return read.map_err(|e| failed(e, copied));
    }
    let header = match input.read_exact(alloc, 8) {
        Ok(h) => h,
        Err(IoError::UnexpectedEof { .. }) => {
            return Err(CliError::Failed(format!(
                "{}: the sender stopped after {copied} bytes, before the end of the copy; the copy is incomplete",
                input.name()
            )))
        }
        Err(e) => return Err(failed(e, copied)),
    };
    let mut word = [0u8; 8];
    word.copy_from_slice(&header[0].bytes()[..8]);
    drop(header);
    let len = u64::from_le_bytes(word);
    if len == 0 {
        return Ok(Vec::new());
    }
    if len > (BATCH * BUFFER_SIZE) as u64 {
        return Err(CliError::Failed(format!(
            "{}: not a `ferry cp` sender (a batch of {len} bytes announced); the copy is incomplete ({copied} bytes written)",
            input.name()
        )));
    }
    input.read_exact(alloc, len).map_err(|e| failed(e, copied))
}

/// Write a batch (framed: after its length); returns the payload bytes
/// written. An empty framed batch is the end mark.
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

/// A socket, pipe or standard input into a file: the writes go on an
/// io_uring [`Ring`] (the pool registered as fixed buffers), so the file
/// writes of one batch run while the next batch is read; the pool's other
/// half holds the batch being read. Returns the bytes written.
fn receive_into_file(
    input: &mut Port,
    output: &mut Port,
    alloc: &Allocator,
    framed: bool,
    bar: Option<&ProgressBar>,
) -> Result<u64, CliError> {
    let mut ring = Ring::new(32).map_err(|e| failed(e, 0))?;
    ring.register(alloc);
    let (mut submitted, mut written) = (0u64, 0u64);
    let collect = |ring: &mut Ring, written: &mut u64, block: bool| -> Result<(), CliError> {
        let done = if block { ring.wait(None) } else { ring.completions() }.map_err(|e| failed(e, *written))?;
        for c in done {
            match c.result {
                Ok(Done::Written(n)) => *written += n,
                Ok(Done::Read(_)) => {}
                Err(e) => return Err(failed(e, *written)),
            }
        }
        Ok(())
    };
    loop {
        // A framed batch needs BATCH buffers and one for its header.
        while alloc.available() < BATCH + 1 && ring.in_flight() > 0 {
            collect(&mut ring, &mut written, true)?;
        }
        let filled = read_batch(input, alloc, framed, written)?;
        if filled.is_empty() {
            break;
        }
        for f in filled {
            let len = f.len as u64;
            ring.submit_write(output, Some(submitted), f, submitted).map_err(|e| failed(e, written))?;
            submitted += len;
        }
        collect(&mut ring, &mut written, false)?;
        if let Some(b) = bar {
            b.set_position(written);
        }
    }
    while ring.in_flight() > 0 {
        collect(&mut ring, &mut written, true)?;
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
) -> Result<bool, CliError> {
    loop {
        match output.send_from(input, 64 << 20) {
            Ok(0) => return Ok(true),
            Ok(n) => *copied += n,
            Err(IoError::Os { source, .. }) if *copied == 0 && source.raw_os_error() == Some(libc::EINVAL) => {
                return Ok(false)
            }
            Err(e) => return Err(failed(e, *copied)),
        }
        if let Some(b) = bar {
            b.set_position(*copied);
        }
    }
}

/// Send the rest of the file `input` on the stream `output` in framed
/// batches, each moved by the kernel without passing through user memory.
/// Returns the payload bytes sent.
fn send_file_framed(input: &mut Port, output: &mut Port, bar: Option<&ProgressBar>) -> Result<u64, CliError> {
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
        output.send_more(&batch.to_le_bytes()).map_err(|e| failed(e, copied))?;
        let n = output.send_from(input, batch).map_err(|e| failed(e, copied))?;
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
    let domain = Domain::new("ferry-cp");
    let alloc = Allocator::new(&domain, POOL_BUFFERS, BUFFER_SIZE, PoolConstraints::default())?;
    let mut input = open_source(&src, &args.src, args.direct, args.quiet)?;
    let mut output = open_destination(&dst, &dst_name, args.direct)?;

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
        copied = send_file_framed(&mut input, &mut output, bar.as_ref())?;
        by_kernel = true;
    } else if from_file && !framed_out && output.kind() != Kind::Datagram {
        // A file to a file, pipe or device: the kernel moves the pages
        // (sendfile: one copy, page cache to page cache) where a read and
        // a write through the pool copy twice, as `cat` does. An fd that
        // does not take sendfile (O_APPEND) goes through the pool.
        by_kernel = send_file_plain(&mut input, &mut output, bar.as_ref(), &mut copied)?;
    }
    // A socket, pipe or terminal into a file: the file writes go through
    // the io_uring Ring so they overlap the next batch's reads. Measured
    // against the plain read-then-write loop, tcp → ext4 file, 1 GiB, three
    // alternations on the busy 2-CPU test machine: 0.67/0.71/0.76 GB/s
    // against 0.20/0.40/0.26 GB/s. File sources need no Ring: sendfile above.
    let ring_out = !by_kernel && output.kind() == Kind::File && !output.is_direct() && input.kind() != Kind::File;
    if ring_out {
        copied = receive_into_file(&mut input, &mut output, &alloc, framed_in, bar.as_ref())?;
    } else if !by_kernel {
        loop {
            let filled = read_batch(&mut input, &alloc, framed_in, copied)?;
            if filled.is_empty() {
                break;
            }
            copied += write_batch(&mut output, &alloc, framed_out, filled)
                .map_err(|e| failed(e, copied.max(output.offset())))?;
            if let Some(b) = &bar {
                b.set_position(copied);
            }
        }
    }
    if framed_out {
        write_batch(&mut output, &alloc, true, Vec::new()).map_err(|e| failed(e, copied))?;
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
