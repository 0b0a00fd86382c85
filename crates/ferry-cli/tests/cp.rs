//! `ferry cp` as its users run it: the real binary copies files, standard
//! input/output and TCP and Unix socket streams; the copies are compared
//! byte for byte with their sources; failures exit 1 with one line that
//! names the file, and a partial copy never reports success.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

mod cp_support;
use cp_support::{dir, ferry, finish, s, Run};

fn cp(args: &[&str]) -> Run {
    finish(ferry().arg("cp").args(args).spawn().expect("start ferry"), None)
}

fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// FNV-1a: a checksum to compare copies by.
fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100000001b3))
}

/// The one line of a failed copy: exit 1, names `file`, nothing on stdout,
/// no success summary.
fn assert_failed(r: &Run, file: &str, what: &str) {
    assert_eq!(r.code, Some(1), "exit code; stderr: {}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line on stderr:\n{}", r.stderr);
    assert!(lines[0].starts_with("ferry: ") && lines[0].contains(file) && lines[0].contains(what), "{}", lines[0]);
    assert!(!r.stderr.contains("GB/s"), "a failed copy reports no success: {}", r.stderr);
    for bad in ["panicked", "Os {", "Some(", "::"] {
        assert!(!r.stderr.contains(bad), "{bad} in {}", r.stderr);
    }
}

#[test]
fn file_to_file_and_into_a_directory() {
    let d = dir("cp", "files");
    let want = data((5 << 20) + 333, 1); // more than a batch, an odd tail
    std::fs::write(d.join("a"), &want).unwrap();
    let r = cp(&[s(&d.join("a")), s(&d.join("b"))]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(checksum(&std::fs::read(d.join("b")).unwrap()), checksum(&want));
    let summary = r.stderr.lines().last().unwrap();
    assert!(summary.contains(&format!("{} bytes", want.len())) && summary.contains("GB/s"), "{summary}");
    assert!(r.stdout.is_empty());

    std::fs::create_dir_all(d.join("sub")).unwrap();
    let r = cp(&["--direct", s(&d.join("a")), s(&d.join("sub"))]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(checksum(&std::fs::read(d.join("sub/a")).unwrap()), checksum(&want));

    let r = cp(&["-q", s(&d.join("a")), s(&d.join("a"))]);
    assert_failed(&r, "same file", "nothing was copied");
    assert_eq!(checksum(&std::fs::read(d.join("a")).unwrap()), checksum(&want), "the source is intact");
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn stdin_to_stdout() {
    let want = data(3 << 20, 2);
    let child = ferry().args(["cp", "-", "-"]).stdin(Stdio::piped()).spawn().unwrap();
    let r = finish(child, Some(want.clone()));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(checksum(&r.stdout), checksum(&want));
    assert_eq!(r.stdout.len(), want.len());
}

/// Start `ferry cp SRC DST` as the receiving side and wait for its
/// "listening on" line; returns the child and the address it names.
fn listen(src: &str, dst: &Path) -> (Child, String) {
    let mut child = ferry().args(["cp", src, s(dst)]).spawn().unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let at = line.trim().strip_prefix("ferry cp: listening on ").unwrap_or_else(|| panic!("{line}")).to_string();
    // Hand the rest of stderr back through a pipe the `finish` helper reads.
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut err, &mut std::fs::File::from(w));
    });
    child.stderr = Some(r.into());
    (child, at)
}

#[test]
fn over_tcp_and_unix_sockets() {
    let d = dir("cp", "sockets");
    let want = data((4 << 20) + 7, 3);
    std::fs::write(d.join("src"), &want).unwrap();

    let (rx, at) = listen("tcp:127.0.0.1:0", &d.join("via-tcp"));
    let tx = cp(&[s(&d.join("src")), &at]);
    assert_eq!(tx.code, Some(0), "{}", tx.stderr);
    let rx = finish(rx, None);
    assert_eq!(rx.code, Some(0), "{}", rx.stderr);
    assert_eq!(checksum(&std::fs::read(d.join("via-tcp")).unwrap()), checksum(&want));

    let sock = format!("unix:{}", s(&d.join("sock")));
    let (rx, at) = listen(&sock, &d.join("via-unix"));
    assert_eq!(at, sock);
    let tx = cp(&[s(&d.join("src")), &sock]);
    assert_eq!(tx.code, Some(0), "{}", tx.stderr);
    let rx = finish(rx, None);
    assert_eq!(rx.code, Some(0), "{}", rx.stderr);
    assert_eq!(checksum(&std::fs::read(d.join("via-unix")).unwrap()), checksum(&want));
    assert!(!d.join("sock").exists(), "the socket file is removed");

    // Nobody listening: exit 1, naming the destination.
    let r = cp(&[s(&d.join("src")), &sock]);
    assert_failed(&r, &sock, "cannot connect");
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn a_sender_that_stops_early_fails_the_receiver() {
    let d = dir("cp", "early");
    // One whole batch of 5 bytes, then the connection closes without the end mark.
    let (rx, at) = listen("tcp:127.0.0.1:0", &d.join("out"));
    let mut s = std::net::TcpStream::connect(at.strip_prefix("tcp:").unwrap()).unwrap();
    s.write_all(&5u64.to_le_bytes()).unwrap();
    s.write_all(b"hello").unwrap();
    drop(s);
    let r = finish(rx, None);
    assert_failed(&r, "tcp:127.0.0.1:0", "the copy is incomplete");
    assert_eq!(std::fs::read(d.join("out")).unwrap(), b"hello", "what did arrive is kept, as cp does");
    // The middle of a batch.
    let (rx, at) = listen("tcp:127.0.0.1:0", &d.join("out2"));
    let mut s = std::net::TcpStream::connect(at.strip_prefix("tcp:").unwrap()).unwrap();
    s.write_all(&100u64.to_le_bytes()).unwrap();
    s.write_all(b"partial").unwrap();
    drop(s);
    let r = finish(rx, None);
    assert_failed(&r, "tcp:127.0.0.1:0", "93 bytes short");
    // Not a ferry cp sender at all.
    let (rx, at) = listen("tcp:127.0.0.1:0", &d.join("out3"));
    let mut s = std::net::TcpStream::connect(at.strip_prefix("tcp:").unwrap()).unwrap();
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    drop(s);
    let r = finish(rx, None);
    assert_failed(&r, "tcp:127.0.0.1:0", "not a `ferry cp` sender");
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn missing_source_and_directory_source_fail_with_one_line() {
    let d = dir("cp", "errors");
    let missing = d.join("missing");
    let r = cp(&[s(&missing), s(&d.join("out"))]);
    assert_failed(&r, s(&missing), "no such file or directory");
    assert!(!d.join("out").exists(), "no destination is created for a missing source");
    let r = cp(&[s(&d), s(&d.join("out"))]);
    assert_failed(&r, s(&d), "is a directory");
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn a_full_device_is_a_failed_partial_copy() {
    let d = dir("cp", "enospc");
    let mnt = d.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let st = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "ferry-cp-test"]).arg(&mnt).status().unwrap();
    assert!(st.success(), "mount a tmpfs (the tests run as root)");
    std::fs::write(d.join("big"), data(3 << 20, 4)).unwrap();
    let dst = mnt.join("big");
    let r = cp(&[s(&d.join("big")), s(&dst)]);
    let _ = Command::new("umount").arg(&mnt).status();
    assert_failed(&r, s(&dst), "no space left on device");
    assert!(r.stderr.contains("the copy is incomplete"), "{}", r.stderr);
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn a_full_device_behind_a_pipe_is_a_failed_partial_copy() {
    // Standard input into a file: the writes go through the io_uring queue,
    // and a write the device refuses still ends the copy with one line.
    let d = dir("cp", "enospc-pipe");
    let mnt = d.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let st = Command::new("mount").args(["-t", "tmpfs", "-o", "size=1m", "ferry-cp-test"]).arg(&mnt).status().unwrap();
    assert!(st.success(), "mount a tmpfs (the tests run as root)");
    let dst = mnt.join("big");
    let child = ferry().args(["cp", "-", s(&dst)]).stdin(Stdio::piped()).spawn().unwrap();
    let r = finish(child, Some(data(3 << 20, 5)));
    let kept = std::fs::metadata(&dst).map(|m| m.len()).unwrap_or(0);
    let _ = Command::new("umount").arg(&mnt).status();
    assert_failed(&r, s(&dst), "no space left on device");
    assert!(kept <= 1 << 20, "{kept}");
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn stdin_into_a_file_in_many_batches() {
    let d = dir("cp", "stdin-file");
    let want = data((40 << 20) + 4097, 6);
    let child = ferry().args(["cp", "-", s(&d.join("out"))]).stdin(Stdio::piped()).spawn().unwrap();
    let r = finish(child, Some(want.clone()));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let got = std::fs::read(d.join("out")).unwrap();
    assert_eq!((got.len(), checksum(&got)), (want.len(), checksum(&want)));
    std::fs::remove_dir_all(d).unwrap();
}

/// The largest batch a `ferry cp` sender puts in one frame: 8 buffers of
/// 1 MiB.
const FULL_BATCH: usize = 8 << 20;

/// Frames at the batch limit: a frame of exactly one full batch is a
/// `ferry cp` sender's and lands whole (from a raw sender, and from a real
/// `ferry cp` sending a file of two full batches and a few bytes); a frame
/// one byte larger is refused as not from `ferry cp`, naming its length.
#[test]
fn a_frame_of_exactly_one_full_batch_is_taken_and_one_byte_more_is_not() {
    let d = dir("cp", "full-batch");
    let want = data(FULL_BATCH, 8);
    let (rx, at) = listen("tcp:127.0.0.1:0", &d.join("raw"));
    let mut sock = std::net::TcpStream::connect(at.strip_prefix("tcp:").unwrap()).unwrap();
    sock.write_all(&(FULL_BATCH as u64).to_le_bytes()).unwrap();
    sock.write_all(&want).unwrap();
    sock.write_all(&0u64.to_le_bytes()).unwrap(); // the end mark
    let r = finish(rx, None);
    drop(sock);
    assert_eq!(r.code, Some(0), "a full batch from a sender: {}", r.stderr);
    assert_eq!(checksum(&std::fs::read(d.join("raw")).unwrap()), checksum(&want));

    let (rx, at) = listen("tcp:127.0.0.1:0", &d.join("over"));
    let mut sock = std::net::TcpStream::connect(at.strip_prefix("tcp:").unwrap()).unwrap();
    sock.write_all(&(FULL_BATCH as u64 + 1).to_le_bytes()).unwrap();
    let r = finish(rx, None);
    drop(sock);
    assert_failed(&r, "tcp:127.0.0.1:0", &format!("not a `ferry cp` sender (a batch of {} bytes", FULL_BATCH + 1));

    let want = data(2 * FULL_BATCH + 3, 9);
    std::fs::write(d.join("src"), &want).unwrap();
    let (rx, at) = listen("tcp:127.0.0.1:0", &d.join("copy"));
    let tx = cp(&[s(&d.join("src")), &at]);
    assert_eq!(tx.code, Some(0), "{}", tx.stderr);
    let rx = finish(rx, None);
    assert_eq!(rx.code, Some(0), "{}", rx.stderr);
    assert_eq!(checksum(&std::fs::read(d.join("copy")).unwrap()), checksum(&want));
    std::fs::remove_dir_all(d).unwrap();
}
