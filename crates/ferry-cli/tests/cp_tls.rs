//! `ferry cp` over TLS, and the TLS flags of `cp`, `echo` and `bench`, with
//! the real binary on loopback and certificates from `ferry tls gen`: exact
//! bytes both ways, a man in the middle that flips a byte, a plain end
//! against a TLS end, a sender of another CA, the usage errors of bad
//! combinations, the loopback rule and `--insecure`, and one echo run over
//! TLS.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;

mod cp_support;
use cp_support::{dir, ferry, finish, receiver, s, Run};

const MIB: usize = 1 << 20;

/// A CA and both certificate pairs in `dir`, as users make them.
fn certificates(dir: &Path) -> PathBuf {
    let certs = dir.join("certs");
    let r = finish(ferry().args(["tls", "gen", s(&certs)]).spawn().unwrap(), None);
    assert_eq!(r.code, Some(0), "ferry tls gen: {}", r.stderr);
    certs
}

/// `len` bytes that differ from offset to offset (xorshift), so a byte in
/// the wrong place or changed shows.
fn data(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `ferry cp ARGS… SRC tcp:AT`, run to its end.
fn send(args: &[&str], src: &str, at: SocketAddr, input: Option<Vec<u8>>) -> Run {
    let mut c = ferry();
    if input.is_some() {
        c.stdin(Stdio::piped());
    }
    finish(c.arg("cp").args(args).args([src, &format!("tcp:{at}")]).spawn().unwrap(), input)
}

/// Exit 1 with one `ferry: ` line (besides "listening on") that says each
/// of `what`.
fn assert_failed(r: &Run, what: &[&str]) {
    assert_eq!(r.code, Some(1), "exit code; stderr: {}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().filter(|l| !l.starts_with("ferry cp: listening on")).collect();
    assert_eq!(lines.len(), 1, "one line on stderr:\n{}", r.stderr);
    assert!(lines[0].starts_with("ferry: "), "{}", lines[0]);
    for w in what {
        assert!(lines[0].contains(w), "says {w:?}: {}", lines[0]);
    }
    assert!(!lines[0].contains("GB/s") && !lines[0].contains("panicked"), "{}", lines[0]);
}

/// Exit 2 with one line that says each of `what`.
fn assert_usage(r: &Run, what: &[&str]) {
    assert_eq!(r.code, Some(2), "exit code; stderr: {}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line on stderr:\n{}", r.stderr);
    for w in what {
        assert!(lines[0].contains(w), "says {w:?}: {}", lines[0]);
    }
}

/// What the destination file holds (nothing if it is not there).
fn contents(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_default()
}

#[test]
fn a_file_goes_over_tls_byte_for_byte() {
    let d = dir("cp-tls", "file");
    let certs = certificates(&d);
    let (src, dst) = (d.join("src"), d.join("dst"));
    let bytes = data(24 * MIB + 12345);
    std::fs::write(&src, &bytes).unwrap();
    let (rx, at) = receiver(&["--tls-certificates", s(&certs)], "127.0.0.1:0", s(&dst));
    let tx = send(&["--tls-certificates", s(&certs)], s(&src), at, None);
    let rx = finish(rx, None);
    assert_eq!(tx.code, Some(0), "sender: {}", tx.stderr);
    assert_eq!(rx.code, Some(0), "receiver: {}", rx.stderr);
    assert!(rx.stderr.contains("over TLS"), "{}", rx.stderr);
    assert!(contents(&dst) == bytes, "the destination differs from the source");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_pipe_goes_over_tls_to_standard_output_byte_for_byte() {
    let d = dir("cp-tls", "pipe");
    let certs = certificates(&d);
    let bytes = data(9 * MIB + 7);
    // --tls=require on both ends: the same as the default with certificates.
    let flags = ["--tls=require", "--tls-certificates", s(&certs)];
    let (rx, at) = receiver(&flags, "127.0.0.1:0", "-");
    // Its standard output is read while the sender runs.
    let rx = std::thread::spawn(move || finish(rx, None));
    let tx = send(&flags, "-", at, Some(bytes.clone()));
    let rx = rx.join().unwrap();
    assert_eq!(tx.code, Some(0), "sender: {}", tx.stderr);
    assert_eq!(rx.code, Some(0), "receiver: {}", rx.stderr);
    assert!(rx.stdout == bytes, "standard output differs from the source ({} bytes)", rx.stdout.len());
    std::fs::remove_dir_all(&d).unwrap();
}

/// Forward `from` to `to`, flipping the byte at `flip` (if any) of this
/// direction; ends when either side does.
fn pump(mut from: TcpStream, mut to: TcpStream, flip: Option<u64>) {
    let mut buf = vec![0u8; 64 << 10];
    let mut at = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(f) = flip.filter(|f| (at..at + n as u64).contains(f)) {
            buf[(f - at) as usize] ^= 0x01;
        }
        at += n as u64;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

#[test]
fn a_byte_flipped_on_the_way_fails_the_copy_and_the_destination_is_a_prefix() {
    let d = dir("cp-tls", "mitm");
    let certs = certificates(&d);
    let (src, dst) = (d.join("src"), d.join("dst"));
    let bytes = data(48 * MIB);
    std::fs::write(&src, &bytes).unwrap();
    let (rx, at) = receiver(&["--tls-certificates", s(&certs)], "127.0.0.1:0", s(&dst));
    // The man in the middle: the sender connects to it, it connects to the
    // receiver and flips one bit 3 MiB into the sender's stream.
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_at = proxy.local_addr().unwrap();
    let middle = std::thread::spawn(move || {
        let (client, _) = proxy.accept().unwrap();
        let server = TcpStream::connect(at).unwrap();
        let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let back = std::thread::spawn(move || pump(s2, c2, None));
        pump(client, server, Some(3 << 20));
        back.join().unwrap();
    });
    let tx = send(&["--tls-certificates", s(&certs)], s(&src), proxy_at, None);
    let rx = finish(rx, None);
    middle.join().unwrap();
    assert_failed(&rx, &["changed on the way"]);
    assert_ne!(tx.code, Some(0), "the sender must not report success: {}", tx.stderr);
    let got = contents(&dst);
    assert!(got.len() < bytes.len(), "the receiver wrote the whole length");
    assert!(bytes.starts_with(&got), "the destination is not a prefix of the source ({} bytes)", got.len());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_plain_end_against_a_tls_end_is_refused_both_ways() {
    let d = dir("cp-tls", "plain");
    let certs = certificates(&d);
    let (src, dst) = (d.join("src"), d.join("dst"));
    std::fs::write(&src, data(4 * MIB)).unwrap();

    // A receiver that requires TLS and a plain sender.
    let (rx, at) = receiver(&["--tls=require", "--tls-certificates", s(&certs)], "127.0.0.1:0", s(&dst));
    let _ = send(&[], s(&src), at, None);
    let rx = finish(rx, None);
    assert_failed(&rx, &["does not speak TLS", "--tls-certificates", "nothing was copied"]);
    assert!(contents(&dst).is_empty(), "a refused sender's bytes reached the destination");

    // A plain receiver and a TLS sender.
    let (rx, at) = receiver(&[], "127.0.0.1:0", s(&dst));
    let tx = send(&["--tls-certificates", s(&certs)], s(&src), at, None);
    let rx = finish(rx, None);
    assert_failed(&tx, &["TLS handshake", "nothing was copied"]);
    assert_failed(&rx, &["the sender speaks TLS", "--tls-certificates"]);
    assert!(contents(&dst).is_empty());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_sender_without_the_right_ca_is_refused() {
    let d = dir("cp-tls", "ca");
    let certs = certificates(&d);
    let other = certificates(&d.join("other"));
    let (src, dst) = (d.join("src"), d.join("dst"));
    std::fs::write(&src, data(2 * MIB)).unwrap();

    // Another CA altogether: the sender does not accept the receiver.
    let (rx, at) = receiver(&["--tls-certificates", s(&certs)], "127.0.0.1:0", s(&dst));
    let tx = send(&["--tls-certificates", s(&other)], s(&src), at, None);
    let rx = finish(rx, None);
    assert_failed(&tx, &["receiver's certificate is not accepted", "nothing was copied"]);
    assert_failed(&rx, &["nothing was copied"]);
    assert!(contents(&dst).is_empty());

    // The right CA but a client certificate another CA signed: the
    // receiver refuses it, and the sender hears so before sending data.
    let mixed = d.join("mixed");
    std::fs::create_dir_all(&mixed).unwrap();
    std::fs::copy(certs.join("ca-cert.pem"), mixed.join("ca-cert.pem")).unwrap();
    for f in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(other.join(f), mixed.join(f)).unwrap();
    }
    let (rx, at) = receiver(&["--tls-certificates", s(&certs)], "127.0.0.1:0", s(&dst));
    let tx = send(&["--tls-certificates", s(&mixed)], s(&src), at, None);
    let rx = finish(rx, None);
    assert_failed(&tx, &["the receiver refused the connection", "nothing was copied"]);
    assert_failed(&rx, &["sender's certificate is not accepted", "nothing was copied"]);
    assert!(contents(&dst).is_empty());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_combinations_are_usage_errors_naming_the_flag_and_the_file() {
    let d = dir("cp-tls", "usage");
    let certs = certificates(&d);
    let src = d.join("src");
    std::fs::write(&src, b"x").unwrap();
    let run = |args: &[&str]| finish(ferry().args(args).spawn().unwrap(), None);
    assert_usage(&run(&["cp", "--tls=require", s(&src), "tcp:127.0.0.1:9"]), &["--tls=require", "--tls-certificates"]);
    assert_usage(
        &run(&["cp", "--tls=off", "--tls-certificates", s(&certs), s(&src), "tcp:127.0.0.1:9"]),
        &["--tls=off", "--tls-certificates"],
    );
    assert_usage(
        &run(&["cp", "--insecure", "--tls-certificates", s(&certs), s(&src), "tcp:127.0.0.1:9"]),
        &["--insecure", "--tls-certificates"],
    );
    assert_usage(
        &run(&["cp", "--tls=require", "--tls-certificates", s(&certs), s(&src), s(&d.join("dst"))]),
        &["--tls=require", "tcp:"],
    );
    assert_usage(&run(&["cp", "--tls=maybe", s(&src), "tcp:127.0.0.1:9"]), &["--tls", "off, on, require"]);
    // A sender needs the client pair: a directory without client-key.pem.
    let half = d.join("half");
    std::fs::create_dir_all(&half).unwrap();
    for f in ["ca-cert.pem", "client-cert.pem", "server-cert.pem", "server-key.pem"] {
        std::fs::copy(certs.join(f), half.join(f)).unwrap();
    }
    assert_usage(
        &run(&["cp", "--tls-certificates", s(&half), s(&src), "tcp:127.0.0.1:9"]),
        &["--tls-certificates", "client-key.pem"],
    );
    // A receiver needs the server pair.
    let client_only = d.join("client-only");
    std::fs::create_dir_all(&client_only).unwrap();
    for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        std::fs::copy(certs.join(f), client_only.join(f)).unwrap();
    }
    assert_usage(
        &run(&["cp", "--tls-certificates", s(&client_only), "tcp:127.0.0.1:0", s(&d.join("dst"))]),
        &["--tls-certificates", "server-cert.pem"],
    );
    // The same flags on echo and bench, with the same rules.
    assert_usage(&run(&["echo", "--endpoint", "tcp:127.0.0.1:9", "--tls=require"]), &["--tls-certificates"]);
    assert_usage(
        &run(&["echo", "--endpoint", "tcp:127.0.0.1:9", "--tls-certificates", s(&client_only.join("nowhere"))]),
        &["--tls-certificates", "ca-cert.pem"],
    );
    assert_usage(&run(&["echo", "--endpoint", "shm@x", "--tls-certificates", s(&certs)]), &["tcp: endpoints"]);
    assert_usage(
        &run(&["bench", "throughput", "--backend", "shm", "--tls-certificates", s(&certs)]),
        &["--backend net"],
    );
    assert_usage(
        &run(&["bench", "throughput", "--backend", "net", "--tls=require", "--peer", "tcp:127.0.0.1:9"]),
        &["--tls-certificates"],
    );
    for cmd in [&["cp", "--help"][..], &["echo", "--help"], &["bench", "--help"]] {
        let help = String::from_utf8(run(cmd).stdout).unwrap();
        for flag in ["--tls <off|on|require>", "--tls-certificates <DIR>", "--insecure", "ferry tls gen"] {
            assert!(help.contains(flag), "`ferry {}` shows no {flag}", cmd.join(" "));
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn plain_tcp_off_the_loopback_needs_insecure() {
    let d = dir("cp-tls", "insecure");
    let (src, dst) = (d.join("src"), d.join("dst"));
    let bytes = data(3 * MIB + 1);
    std::fs::write(&src, &bytes).unwrap();
    let run = |args: &[&str]| finish(ferry().args(args).spawn().unwrap(), None);
    // Refused before any socket is made.
    assert_usage(&run(&["cp", s(&src), "tcp:192.0.2.1:9"]), &["192.0.2.1 is not a loopback address", "--insecure"]);
    assert_usage(&run(&["cp", "tcp:0.0.0.0:0", s(&dst)]), &["0.0.0.0 is not a loopback address", "--insecure"]);
    assert_usage(&run(&["echo", "--endpoint", "tcp:192.0.2.1:9"]), &["--insecure", "--tls-certificates"]);
    assert_usage(
        &run(&["bench", "throughput", "--backend", "net", "--peer", "tcp:0.0.0.0:9"]),
        &["--insecure", "--tls-certificates"],
    );
    // --insecure lifts the rule: listen on every address, send to 0.0.0.0
    // (this host), which is not a loopback address either.
    let (rx, at) = receiver(&["--insecure"], "0.0.0.0:0", s(&dst));
    let to = format!("tcp:0.0.0.0:{}", at.port());
    assert_usage(&run(&["cp", s(&src), &to]), &["--insecure"]);
    let tx = finish(ferry().args(["cp", "--insecure", s(&src), &to]).spawn().unwrap(), None);
    let rx = finish(rx, None);
    assert_eq!(tx.code, Some(0), "sender: {}", tx.stderr);
    assert_eq!(rx.code, Some(0), "receiver: {}", rx.stderr);
    assert!(contents(&dst) == bytes);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A free loopback port (the kernel's pick, released for the command).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn bench_and_an_echo_started_by_hand_run_over_tls() {
    let d = dir("cp-tls", "echo");
    let certs = certificates(&d);
    let peer = format!("tcp:127.0.0.1:{}", free_port());
    let mut bench = ferry()
        .args(["bench", "throughput", "--backend", "net", "--size", "65536", "--runs", "1", "--moves", "300"])
        .args(["--peer", &peer, "--tls-certificates", s(&certs)])
        .spawn()
        .unwrap();
    let mut err = BufReader::new(bench.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("--tls-certificates"), "the bench tells how to start the echo: {line}");
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut err, &mut std::fs::File::from(w));
    });
    bench.stderr = Some(r.into());
    // A plain echo is refused by the TLS bench, which goes on waiting.
    let plain = finish(ferry().args(["echo", "--endpoint", &peer]).spawn().unwrap(), None);
    assert_eq!(plain.code, Some(1), "a plain echo against TLS: {}", plain.stderr);
    assert!(plain.stderr.contains("TLS"), "{}", plain.stderr);
    let echo =
        finish(ferry().args(["echo", "--endpoint", &peer, "--tls-certificates", s(&certs)]).spawn().unwrap(), None);
    let bench = finish(bench, None);
    assert_eq!(echo.code, Some(0), "echo: {}", echo.stderr);
    assert_eq!(bench.code, Some(0), "bench: {}", bench.stderr);
    assert!(String::from_utf8_lossy(&echo.stdout).starts_with("echoed "), "{:?}", echo.stdout);
    assert!(String::from_utf8_lossy(&bench.stdout).contains("throughput"), "{:?}", bench.stdout);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bench_starts_its_echo_with_the_same_tls_flags() {
    let d = dir("cp-tls", "bench");
    let certs = certificates(&d);
    let args = ["bench", "throughput", "--backend", "net", "--size", "65536", "--runs", "1", "--moves", "300"];
    let r = finish(ferry().args(args).args(["--tls-certificates", s(&certs)]).spawn().unwrap(), None);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_silent_peer_in_the_tls_handshake_times_out_on_both_sides() {
    let d = dir("cp-tls", "silent");
    let certs = certificates(&d);
    let (src, dst) = (d.join("src"), d.join("dst"));
    std::fs::write(&src, data(MIB)).unwrap();
    // A receiver whose sender connects and says nothing (no ClientHello).
    let (rx, at) = receiver(&["--timeout", "2", "--tls-certificates", s(&certs)], "127.0.0.1:0", s(&dst));
    let silent = TcpStream::connect(at).unwrap();
    let rx = finish(rx, None);
    drop(silent);
    assert_failed(&rx, &["did not finish the TLS handshake within 2 s", "--timeout", "nothing was copied"]);
    // A sender whose receiver accepts and says nothing (no ServerHello).
    let quiet = TcpListener::bind("127.0.0.1:0").unwrap();
    let to = quiet.local_addr().unwrap();
    let tx = send(&["--timeout", "2", "--tls-certificates", s(&certs)], s(&src), to, None);
    drop(quiet);
    assert_failed(&tx, &["did not finish the TLS handshake within 2 s", "--timeout", "nothing was copied"]);
    std::fs::remove_dir_all(&d).unwrap();
}
