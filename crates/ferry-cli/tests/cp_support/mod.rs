//! Running `ferry cp` (and the commands around it) as a user does, shared by
//! the cp tests: the command with piped output, a bounded wait that feeds
//! standard input and collects both outputs, and scratch directories.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The longest any run may take: a hang fails the test, a loaded machine
/// does not.
pub const LIMIT: Duration = Duration::from_secs(90);

/// `ferry` with no input, its outputs piped, no backtraces in messages.
pub fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env("RUST_BACKTRACE", "0").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// What a finished run left.
pub struct Run {
    /// Exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    /// Everything it wrote to standard output.
    pub stdout: Vec<u8>,
    /// Everything it wrote to standard error.
    pub stderr: String,
    /// From the call of [`finish`] to the exit.
    pub took: Duration,
}

/// Wait for `child` (feeding it `input` when given); a child still running
/// after [`LIMIT`] is killed and fails the test.
pub fn finish(mut child: Child, input: Option<Vec<u8>>) -> Run {
    let writer = input.map(|data| {
        let mut stdin = child.stdin.take().expect("piped stdin");
        std::thread::spawn(move || {
            let _ = stdin.write_all(&data);
        })
    });
    let (mut out, mut err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break Some(st);
        }
        if t0.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = t0.elapsed();
    if let Some(w) = writer {
        w.join().unwrap();
    }
    let stderr = err_reader.join().unwrap();
    assert!(status.is_some(), "ferry did not finish within {LIMIT:?}\nstderr: {stderr}");
    Run { code: status.and_then(|s| s.code()), stdout: out_reader.join().unwrap(), stderr, took }
}

/// A fresh scratch directory for one test of one file (`tag`).
pub fn dir(tag: &str, name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ferry-{tag}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Start `ferry cp ARGS… tcp:AT DST` and wait for its "listening on" line
/// (so never with `-q`): the child, whose stderr [`finish`] still reads,
/// and the address it listens on.
pub fn receiver(args: &[&str], at: &str, dst: &str) -> (Child, SocketAddr) {
    let mut child = ferry().arg("cp").args(args).args([&format!("tcp:{at}"), dst]).spawn().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let at = line.trim().strip_prefix("ferry cp: listening on tcp:").unwrap_or_else(|| panic!("{line}"));
    let at: SocketAddr = at.parse().unwrap();
    // Hand the rest of stderr back through a pipe that `finish` reads.
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut err, &mut std::fs::File::from(w));
    });
    child.stderr = Some(r.into());
    (child, at)
}
