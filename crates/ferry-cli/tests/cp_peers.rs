//! `ferry cp` against a peer that misbehaves, played by a raw socket of the
//! test: a receiver that closes or resets the connection, a sender cut off
//! in the middle, a peer that goes silent. The real binary must exit 1 with
//! one line that names the side that failed and why, count what is really
//! in the destination, and never wait for ever.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Stdio;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod cp_support;
use cp_support::{dir, ferry, finish, receiver, s, Run, LIMIT};

/// A file far larger than what loopback socket buffers hold, so a sender
/// is still sending when its peer misbehaves.
const BIG: u64 = 256 << 20;
const MIB: usize = 1 << 20;
/// How long a run with `--timeout 2` may take to give up: a bound that a
/// loaded machine meets with room to spare, not a measure of speed.
const GIVES_UP: Duration = Duration::from_secs(30);

/// A file of `len` bytes (sparse: its pages read as zeros, written in no time).
fn big_file(path: &Path, len: u64) {
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
}

/// The one line of a failed copy: exit 1, starts with `ferry: `, names
/// `side`, says `what`; no success summary, no debug text.
fn assert_failed(r: &Run, side: &str, what: &[&str]) -> String {
    assert_eq!(r.code, Some(1), "exit code; stderr: {}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.starts_with("ferry cp: listening on")).collect();
    assert_eq!(lines.len(), 1, "one line on stderr:\n{}", r.stderr);
    let line = lines[0];
    assert!(line.starts_with("ferry: ") && line.contains(side), "names {side}: {line}");
    for w in what {
        assert!(line.contains(w), "says {w:?}: {line}");
    }
    assert!(!line.contains("GB/s"), "a failed copy reports no success: {line}");
    for bad in ["panicked", "Os {", "Some(", "::", "shrank"] {
        assert!(!line.contains(bad), "{bad} in {line}");
    }
    line.to_string()
}

/// The number in "(N bytes written to DST)" of a receiver's line; 0 for
/// "nothing was copied".
fn reported_written(line: &str, dst: &Path) -> u64 {
    if line.ends_with("; nothing was copied") {
        return 0;
    }
    let tail = format!(" bytes written to {})", s(dst));
    let end = line.find(&tail).unwrap_or_else(|| panic!("no {tail:?} in {line}"));
    let start = line[..end].rfind('(').expect("an opening parenthesis") + 1;
    line[start..end].parse().unwrap_or_else(|_| panic!("a byte count in {line}"))
}

/// The first connection to `l`, or `None` if none comes within LIMIT (a
/// `ferry` that never connects must not leave the test waiting).
fn accept_within(l: &TcpListener) -> Option<TcpStream> {
    l.set_nonblocking(true).unwrap();
    let t0 = Instant::now();
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                return Some(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && t0.elapsed() < LIMIT => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => return None,
        }
    }
}

/// Make closing `s` reset the connection (SO_LINGER 0) instead of ending it.
fn reset_on_close(s: &TcpStream) {
    rustix::net::sockopt::set_socket_linger(s, Some(Duration::ZERO)).unwrap();
}

/// How a raw receiver ends its part.
#[derive(Clone, Copy, Debug)]
enum End {
    Close,
    Reset,
}

/// A receiver that accepts one connection, reads 1 MiB of it, then closes
/// or resets it.
fn rude_receiver(end: End) -> (SocketAddr, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        let Some(mut s) = accept_within(&l) else { return };
        s.set_read_timeout(Some(LIMIT)).unwrap();
        let mut got = vec![0u8; MIB];
        if s.read_exact(&mut got).is_err() {
            return;
        }
        if let End::Reset = end {
            reset_on_close(&s);
        }
        drop(s);
    });
    (at, peer)
}

#[test]
fn a_receiver_that_closes_or_resets_is_named_with_the_cause() {
    let d = dir("cp-peers", "rude-receiver");
    big_file(&d.join("src"), BIG);
    for end in [End::Close, End::Reset] {
        // A file source: the kernel sends its pages (sendfile).
        let (at, peer) = rude_receiver(end);
        let dst = format!("tcp:{at}");
        let r = finish(ferry().args(["cp", "-q", s(&d.join("src")), &dst]).spawn().unwrap(), None);
        let line = assert_failed(&r, &dst, &["the receiver closed the connection after", "the copy is incomplete"]);
        peer.join().unwrap();
        // A reset the kernel reports on a send that moved some bytes is
        // gone by the next send, which meets a broken pipe: either is the
        // receiver's doing.
        assert!(line.contains("(connection reset by peer)") || line.contains("(broken pipe)"), "{end:?}: {line}");
        // Standard input as the source: the bytes go through the pool.
        let (at, peer) = rude_receiver(end);
        let dst = format!("tcp:{at}");
        let child = ferry().args(["cp", "-q", "-", &dst]).stdin(Stdio::piped()).spawn().unwrap();
        let r = finish(child, Some(vec![7u8; 64 * MIB]));
        assert_failed(&r, &dst, &["the receiver closed the connection after", "the copy is incomplete"]);
        peer.join().unwrap();
    }
    std::fs::remove_dir_all(d).unwrap();
}

/// Wait until `path` holds `len` bytes (the receiver wrote them).
fn wait_for_size(path: &Path, len: u64) {
    let t0 = Instant::now();
    while std::fs::metadata(path).map(|m| m.len()).unwrap_or(0) < len {
        assert!(t0.elapsed() < LIMIT, "{} never reached {len} bytes", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A framed batch of `len` bytes as a `ferry cp` sender writes it.
fn batch(len: usize) -> Vec<u8> {
    let mut b = (len as u64).to_le_bytes().to_vec();
    b.extend((0..len).map(|i| (i % 251) as u8));
    b
}

#[test]
fn a_sender_cut_off_mid_stream_reports_what_is_in_the_file() {
    let d = dir("cp-peers", "cut-sender");
    // Closed: one whole batch of 1 MiB and half of the next, all at once,
    // then the end of the stream without the end mark. The file write of
    // the whole batch may still be in flight when the stream ends: the
    // line must count it all the same. A few rounds, as that race goes
    // either way.
    for round in 0..4 {
        let out = d.join(format!("closed-{round}"));
        let (rx, at) = receiver(&[], "127.0.0.1:0", out.to_str().unwrap());
        let mut s = TcpStream::connect(at).unwrap();
        s.write_all(&[batch(MIB), batch(MIB)[..8 + MIB / 2].to_vec()].concat()).unwrap();
        drop(s);
        let r = finish(rx, None);
        let line = assert_failed(
            &r,
            "tcp:127.0.0.1:0",
            &["the sender closed the connection in the middle of a batch", "the copy is incomplete"],
        );
        let in_file = std::fs::metadata(&out).unwrap().len();
        assert_eq!(reported_written(&line, &out), in_file, "the line counts what is in the file: {line}");
        assert_eq!(in_file, MIB as u64, "the whole batch is kept");
    }
    // Reset: once the whole batch is in the file (a reset drops what the
    // sender's kernel still holds), half of the next, then SO_LINGER 0.
    let out = d.join("reset");
    let (rx, at) = receiver(&[], "127.0.0.1:0", out.to_str().unwrap());
    let mut s = TcpStream::connect(at).unwrap();
    s.write_all(&batch(MIB)).unwrap();
    wait_for_size(&out, MIB as u64);
    s.write_all(&batch(MIB)[..8 + MIB / 2]).unwrap();
    reset_on_close(&s);
    drop(s);
    let r = finish(rx, None);
    let line = assert_failed(
        &r,
        "tcp:127.0.0.1:0",
        &["the sender reset the connection before the end of the copy (connection reset by peer)", "incomplete"],
    );
    let in_file = std::fs::metadata(&out).unwrap().len();
    assert_eq!((reported_written(&line, &out), in_file), (MIB as u64, MIB as u64), "{line}");
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn a_receiver_times_out_on_a_silent_sender() {
    let d = dir("cp-peers", "silent-sender");
    // Connects and sends nothing at all.
    let out = d.join("out");
    let (rx, at) = receiver(&["--timeout", "2"], "127.0.0.1:0", out.to_str().unwrap());
    let s = TcpStream::connect(at).unwrap();
    let r = finish(rx, None);
    assert_failed(&r, "tcp:127.0.0.1:0", &["the sender sent nothing for 2 s", "timeout", "nothing was copied"]);
    assert!(r.took < GIVES_UP, "{:?}", r.took);
    drop(s);
    // Sends one batch, then goes silent with the connection open.
    let out = d.join("out2");
    let (rx, at) = receiver(&["--timeout", "2"], "127.0.0.1:0", out.to_str().unwrap());
    let mut s = TcpStream::connect(at).unwrap();
    s.write_all(&batch(MIB)).unwrap();
    let r = finish(rx, None);
    let line = assert_failed(&r, "tcp:127.0.0.1:0", &["the sender sent nothing for 2 s", "the copy is incomplete"]);
    let in_file = std::fs::metadata(&out).unwrap().len();
    assert_eq!((reported_written(&line, &out), in_file), (MIB as u64, MIB as u64), "{line}");
    assert!(r.took < GIVES_UP, "{:?}", r.took);
    drop(s);
    std::fs::remove_dir_all(d).unwrap();
}

/// A receiver that accepts one connection and never reads from it; the
/// connection stays open until `finish` is dropped.
fn deaf_receiver() -> (SocketAddr, JoinHandle<()>, std::sync::mpsc::Sender<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap();
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let Some(s) = accept_within(&l) else { return };
        let _ = wait.recv_timeout(LIMIT);
        drop(s);
    });
    (at, peer, done)
}

#[test]
fn a_sender_times_out_on_a_receiver_that_takes_nothing() {
    let d = dir("cp-peers", "deaf-receiver");
    big_file(&d.join("src"), BIG);
    // From a file (sendfile) and from standard input (through the pool).
    for from_stdin in [false, true] {
        let (at, peer, done) = deaf_receiver();
        let dst = format!("tcp:{at}");
        let r = if from_stdin {
            let child = ferry().args(["cp", "-q", "--timeout", "2", "-", &dst]).stdin(Stdio::piped()).spawn().unwrap();
            finish(child, Some(vec![7u8; 64 * MIB]))
        } else {
            finish(ferry().args(["cp", "-q", "--timeout", "2", s(&d.join("src")), &dst]).spawn().unwrap(), None)
        };
        assert_failed(
            &r,
            &dst,
            &["the receiver took nothing for 2 s after", "timeout, see --timeout", "the copy is incomplete"],
        );
        assert!(r.took < GIVES_UP, "{:?}", r.took);
        drop(done);
        peer.join().unwrap();
    }
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn timeout_zero_is_no_limit_and_bad_values_are_refused() {
    let d = dir("cp-peers", "timeout-flag");
    let want: Vec<u8> = (0..(3 * MIB + 5)).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(d.join("src"), &want).unwrap();
    let (rx, at) = receiver(&["--timeout", "0"], "127.0.0.1:0", d.join("out").to_str().unwrap());
    let tx =
        finish(ferry().args(["cp", "--timeout", "0", s(&d.join("src")), &format!("tcp:{at}")]).spawn().unwrap(), None);
    assert_eq!(tx.code, Some(0), "{}", tx.stderr);
    let rx = finish(rx, None);
    assert_eq!(rx.code, Some(0), "{}", rx.stderr);
    assert!(std::fs::read(d.join("out")).unwrap() == want, "the copy is whole");
    for bad in ["-1", "abc", "86401"] {
        let r =
            finish(ferry().args(["cp", "--timeout", bad, s(&d.join("src")), s(&d.join("x"))]).spawn().unwrap(), None);
        assert_eq!(r.code, Some(2), "--timeout {bad}: {}", r.stderr);
        assert!(r.stderr.contains("--timeout"), "{}", r.stderr);
    }
    let help = ferry().args(["cp", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--timeout <SECONDS>") && help.contains("[default: 30]"), "{help}");
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn a_connect_nobody_answers_times_out() {
    use rustix::net::{bind, connect, listen, socket, AddressFamily, SocketAddrUnix, SocketType};
    let d = dir("cp-peers", "connect");
    std::fs::write(d.join("src"), b"data").unwrap();
    // A Unix listener that never accepts, with a queue of one that one
    // connection fills: the next connect waits for room.
    let path = d.join("sock");
    let listener = socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
    bind(&listener, &SocketAddrUnix::new(&path).unwrap()).unwrap();
    listen(&listener, 0).unwrap();
    let first = socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
    connect(&first, &SocketAddrUnix::new(&path).unwrap()).unwrap();
    let dst = format!("unix:{}", s(&path));
    let r = finish(ferry().args(["cp", "--timeout", "2", s(&d.join("src")), &dst]).spawn().unwrap(), None);
    assert_failed(&r, &dst, &["cannot connect: no answer within 2 s", "timeout", "nothing was copied"]);
    assert!(r.took < GIVES_UP, "{:?}", r.took);
    drop((first, listener));
    std::fs::remove_dir_all(d).unwrap();
}
