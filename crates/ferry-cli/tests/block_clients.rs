//! `ferry block serve` used by unmodified NBD clients: qemu-io and
//! qemu-img (qemu-utils), nbdinfo and nbdcopy (libnbd-bin), fio's nbd
//! engine, and libnbd's Python binding for the error paths. Each test
//! starts the real `ferry` binary and the real client programs; the tools
//! come from `scripts/setup`, and a test fails (saying so) where one is
//! missing.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

mod block_support;
use block_support::{run, run_with_input, Server, LIMIT};

/// Run a tool and insist it succeeds; its stdout.
fn ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-block-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A file of `len` bytes that are not all alike (a simple generator).
fn pattern_file(path: &Path, len: usize, seed: u64) {
    let mut x = seed | 1;
    let mut data = Vec::with_capacity(len);
    while data.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.extend_from_slice(&x.to_le_bytes());
    }
    data.truncate(len);
    std::fs::write(path, data).expect("write pattern file");
}

fn sha256(path: &Path) -> String {
    let out = ok("sha256sum", &[path.to_str().expect("utf-8 path")]);
    out.split_whitespace().next().expect("a checksum").to_string()
}

/// The summary lines of `n` clients (the server prints one per client
/// when it disconnects).
fn summaries(server: &Server, n: usize) -> Vec<String> {
    let t0 = Instant::now();
    let mut got = Vec::new();
    while got.len() < n && t0.elapsed() < LIMIT {
        match server.next_line() {
            Some(l) if l.starts_with("client ") => got.push(l),
            Some(_) => {}
            None => break,
        }
    }
    got
}

#[test]
fn qemu_io_and_qemu_img_read_write_map_convert_compare() {
    let dir = scratch("qemu");
    let server = Server::start(&["--store", "mem:64M", "--nbd", "tcp:127.0.0.1:0"]);
    let uri = server.uri();

    // qemu-img sees the size.
    let info = ok("qemu-img", &["info", "-f", "raw", &uri]);
    assert!(info.contains("64 MiB") && info.contains("67108864"), "qemu-img info: {info}");

    // Writes (one with FUA), a flush, write-zeroes, discard; reads check
    // the pattern byte by byte.
    let io = ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0x5a 1M 256k",
            "-c",
            "write -f -P 0xc3 3M 4k",
            "-c",
            "flush",
            "-c",
            "write -z 8M 64k",
            "-c",
            "discard 1M 64k",
            "-c",
            "read -P 0x00 1M 64k",
            "-c",
            "read -P 0x5a 1088k 192k",
            "-c",
            "read -P 0xc3 3M 4k",
            "-c",
            "read -P 0x00 8M 64k",
            "-c",
            "read -P 0x00 32M 1M",
            &uri,
        ],
    );
    assert!(!io.contains("Pattern verification failed"), "qemu-io: {io}");
    assert_eq!(io.matches("read ").count(), 5, "qemu-io: {io}");

    // The map: data where it was written, holes elsewhere.
    let map = ok("qemu-img", &["map", "-f", "raw", "--output=json", &uri]);
    // (1 MiB never written and the 64 KiB discarded after it: one hole)
    assert!(
        map.contains(
            "{ \"start\": 0, \"length\": 1114112, \"depth\": 0, \"present\": true, \"zero\": true, \"data\": false"
        ),
        "map: {map}"
    );
    assert!(map.contains("{ \"start\": 1114112, \"length\": 196608, \"depth\": 0, \"present\": true, \"zero\": false, \"data\": true"), "map: {map}");
    assert!(
        map.contains(
            "{ \"start\": 3145728, \"length\": 65536, \"depth\": 0, \"present\": true, \"zero\": false, \"data\": true"
        ),
        "map: {map}"
    );

    // convert a raw file in, compare it.
    let src = dir.join("src.img");
    pattern_file(&src, 8 << 20, 7);
    ok("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw", src.to_str().unwrap(), &uri]);
    // The export is larger: compare wants the rest to read as zeroes (it does).
    let compare = || run("qemu-img", &["compare", "-f", "raw", "-F", "raw", src.to_str().unwrap(), &uri]);
    let cmp = compare();
    assert_eq!(cmp.status.code(), Some(0), "qemu-img compare: {}", String::from_utf8_lossy(&cmp.stdout));
    ok("qemu-io", &["-f", "raw", "-c", "write -P 0x01 12M 512", &uri]);
    let cmp = compare();
    assert_eq!(cmp.status.code(), Some(1), "qemu-img compare must see the difference at 12 MiB");
    ok("qemu-io", &["-f", "raw", "-c", "write -z 12M 512", &uri]);
    let back = dir.join("back.img");
    ok("qemu-img", &["convert", "-f", "raw", "-O", "raw", &uri, back.to_str().unwrap()]);
    let back_head = std::fs::read(&back).expect("read back");
    assert_eq!(back_head.len(), 64 << 20);
    assert!(back_head[..8 << 20] == std::fs::read(&src).expect("src")[..], "the first 8 MiB came back changed");
    assert!(back_head[8 << 20..].iter().all(|&b| b == 0), "the rest (zeroed or never written) reads as zeroes");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nbdinfo_lists_and_maps_nbdcopy_copies_in_and_out_over_several_connections() {
    let dir = scratch("nbdcopy");
    let sock = dir.join("nbd.sock");
    let unix = format!("unix:{}", sock.display());
    let server = Server::start(&["--store", "mem:32M", "--nbd", "tcp:127.0.0.1:0", "--nbd", &unix]);
    let uri = server.uri();
    let unix_uri = format!("nbd+unix:///?socket={}", sock.display());

    let list = ok("nbdinfo", &["--list", &uri]);
    assert!(list.contains("export=\"\":") && list.contains("export-size: 33554432"), "nbdinfo --list: {list}");
    let info = ok("nbdinfo", &[&unix_uri]);
    for feature in ["can_multi_conn: true", "can_flush: true", "can_fua: true", "can_trim: true", "can_zero: true"] {
        assert!(info.contains(feature), "nbdinfo lacks {feature}: {info}");
    }
    assert!(info.contains("block_size_maximum: 33554432"), "nbdinfo: {info}");

    // In and out with checksums: 24 MiB of data, the rest left a hole.
    let src = dir.join("src.img");
    pattern_file(&src, 24 << 20, 11);
    ok("nbdcopy", &["--connections=4", "--flush", src.to_str().unwrap(), &uri]);
    let map = ok("nbdinfo", &["--map", &uri]);
    assert!(map.lines().any(|l| l.contains("25165824") && l.contains("hole,zero")), "map: {map}");
    let back = dir.join("back.img");
    ok("nbdcopy", &["--connections=4", &unix_uri, back.to_str().unwrap()]);
    assert_eq!(std::fs::metadata(&back).expect("back").len(), 32 << 20);
    let head = dir.join("head.img");
    std::fs::write(&head, &std::fs::read(&back).expect("back")[..24 << 20]).expect("head");
    assert_eq!(sha256(&head), sha256(&src), "nbdcopy: the data came back changed");

    // One summary line per client connection; nbdcopy used 4 of them.
    let lines = summaries(&server, 4);
    assert_eq!(lines.len(), 4, "summary lines: {lines:?}");
    assert!(lines.iter().all(|l| l.contains(" after ")), "{lines:?}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fio_nbd_engine_verifies_crc32c() {
    let server = Server::start(&["--store", "mem:64M", "--nbd", "tcp:127.0.0.1:0"]);
    let uri = server.uri();
    let out = ok(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bsrange=4k-64k",
            "--iodepth=8",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
        ],
    );
    assert!(out.contains("err= 0"), "fio: {out}");
    assert!(!out.contains("verify: bad"), "fio: {out}");
}

/// libnbd from Python: the error paths a well-behaved client never takes
/// (strict checks off), each answered with the error the NBD protocol
/// names, and the connection (and the server) still serving afterwards.
#[test]
fn error_paths_from_libnbd_leave_the_server_serving() {
    let server = Server::start(&["--store", "mem:1M", "--nbd", "tcp:127.0.0.1:0"]);
    let script = r#"
import errno, sys
import nbd
uri = sys.argv[1]
h = nbd.NBD()
h.set_strict_mode(0)
h.add_meta_context("base:allocation")
h.connect_uri(uri)
size = h.get_size()
def expect(name, err, f):
    try:
        f()
    except nbd.Error as e:
        if e.errno not in (err, errno.errorcode[err]):
            print(f"{name}: errno {e.errno}, expected {err}: {e}")
            sys.exit(1)
        print(f"{name}: ok")
        return
    print(f"{name}: succeeded, expected errno {err}")
    sys.exit(1)
expect("read past the end", errno.EINVAL, lambda: h.pread(4096, size - 1024))
expect("read starting past the end", errno.EINVAL, lambda: h.pread(512, size + 4096))
# Writes (and write-zeroes) past the end: ENOSPC, as the NBD specification
# says a server SHOULD answer a write beyond the size of the device (as
# nbdkit does, and libnbd itself in strict mode); everything else past the
# end: EINVAL (nbdkit's answers too; qemu-nbd answers EINVAL to all).
expect("write past the end", errno.ENOSPC, lambda: h.pwrite(b"x" * 4096, size - 1024))
expect("trim past the end", errno.EINVAL, lambda: h.trim(8192, size - 4096))
expect("zero past the end", errno.ENOSPC, lambda: h.zero(8192, size - 4096))
expect("block status past the end", errno.EINVAL, lambda: h.block_status(8192, size - 4096, lambda *a: 0))
big = 64 << 20
expect("oversize read", errno.EINVAL, lambda: h.pread(big, 0))
expect("oversize write", errno.EINVAL, lambda: h.pwrite(bytes(big), 0))
assert h.pread(0, 0) == b"", "zero-length read"
print("zero-length read: ok")
h.pwrite(b"still here", 4096)
assert h.pread(10, 4096) == b"still here"
h.flush()
other = nbd.NBD()
other.connect_uri(uri)
assert other.pread(10, 4096) == b"still here"
print("other connection: ok")
h.shutdown()
other.shutdown()
"#;
    let python = if Path::new("/usr/bin/python3").exists() { "/usr/bin/python3" } else { "python3" };
    let out = run_with_input(python, &["-", &server.uri()], Some(script));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "libnbd probes failed:\n{text}");
    assert_eq!(text.matches(": ok").count(), 10, "{text}");
}

/// Write and FLUSH to a file store, SIGKILL the server, start it again:
/// the data is there (and in the file).
#[test]
fn file_store_keeps_flushed_data_across_sigkill() {
    let dir = scratch("durable");
    let img = dir.join("disk.img");
    let store = format!("file:{}", img.display());
    let mut server = Server::start(&["--store", &store, "--size", "64M", "--nbd", "tcp:127.0.0.1:0"]);
    assert_eq!(std::fs::metadata(&img).expect("created").len(), 64 << 20);
    let uri = server.uri();
    let io = ok(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x3c 5M 1M", "-c", "write -f -P 0x7e 20M 64k", "-c", "flush", &uri],
    );
    assert!(io.contains("wrote 1048576/1048576"), "{io}");
    server.kill();

    let on_disk = std::fs::read(&img).expect("read image");
    assert!(on_disk[5 << 20..6 << 20].iter().all(|&b| b == 0x3c), "the flushed write is not in the file");
    assert!(on_disk[20 << 20..(20 << 20) + (64 << 10)].iter().all(|&b| b == 0x7e), "the FUA write is not in the file");

    // Restarted without --size (the file gives the size), with O_DIRECT
    // for aligned requests.
    let mut server = Server::start(&["--store", &store, "--direct", "--nbd", "tcp:127.0.0.1:0"]);
    let uri = server.uri();
    let io = ok(
        "qemu-io",
        &["-f", "raw", "-c", "read -P 0x3c 5M 1M", "-c", "read -P 0x7e 20M 64k", "-c", "read -P 0 0 5M", &uri],
    );
    assert!(!io.contains("Pattern verification failed"), "{io}");
    // The map of a file store comes from SEEK_DATA/SEEK_HOLE.
    let map = ok("nbdinfo", &["--map", &uri]);
    assert!(map.lines().any(|l| l.contains("5242880") && l.contains("data")), "map: {map}");

    // Four connections write, one FLUSH at the end covers them all (multi-conn).
    let src = dir.join("src.img");
    pattern_file(&src, 8 << 20, 3);
    ok("nbdcopy", &["--connections=4", "--flush", src.to_str().unwrap(), &uri]);
    server.kill();
    let on_disk = std::fs::read(&img).expect("read image");
    assert!(on_disk[..8 << 20] == std::fs::read(&src).expect("src")[..], "nbdcopy's flushed data is not in the file");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad command lines: one line naming the problem, exit code 2.
#[test]
fn bad_values_get_the_one_line_usage_error() {
    let dir = scratch("usage");
    let missing = format!("file:{}", dir.join("missing.img").display());
    let cases: Vec<Vec<&str>> = vec![
        vec!["block", "serve", "--store", "disk:1G", "--nbd", "tcp:127.0.0.1:0"],
        vec!["block", "serve", "--store", "mem:0", "--nbd", "tcp:127.0.0.1:0"],
        vec!["block", "serve", "--store", "mem:1.5G", "--nbd", "tcp:127.0.0.1:0"],
        vec!["block", "serve", "--store", "mem:1G", "--nbd", "udp:127.0.0.1:1"],
        vec!["block", "serve", "--store", "mem:1G"],
        vec!["block", "serve", "--store", "mem:1G", "--size", "1G", "--nbd", "tcp:127.0.0.1:0"],
        vec!["block", "serve", "--store", &missing, "--nbd", "tcp:127.0.0.1:0"],
        vec!["block", "serve", "--store", "mem:1G", "--nbd", "tcp:127.0.0.1:0", "--size", "lots"],
        vec!["block", "serve", "--store", "mem:1G", "--nbd", "tcp:127.0.0.1:0", "--max-connections", "0"],
        vec!["block", "serve", "--store", "mem:1G", "--nbd", "tcp:127.0.0.1:0", "--handshake-timeout", "0"],
        vec!["block", "serve", "--store", "mem:1G", "--nbd", "tcp:127.0.0.1:0", "--handshake-timeout", "soon"],
        vec!["block", "nothing"],
    ];
    for args in cases {
        let out = run(env!("CARGO_BIN_EXE_ferry"), &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "ferry {args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "ferry {args:?}: {err}");
        assert!(!err.contains("panicked") && !err.contains("Some("), "ferry {args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ferry block bench` (smoke): every transport, JSON lines with a rate.
#[test]
fn block_bench_measures_every_transport() {
    let out = ok(
        env!("CARGO_BIN_EXE_ferry"),
        &[
            "block", "bench", "--via", "local", "--via", "shm", "--via", "net", "--via", "nbd", "--via", "nbdkit",
            "--size", "65536", "--total", "4M", "--json",
        ],
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 10, "{out}");
    for via in ["local", "shm", "net", "nbd", "nbdkit"] {
        for op in ["write", "read"] {
            assert!(
                lines
                    .iter()
                    .any(|l| l.contains(&format!("\"via\":\"{via}\"")) && l.contains(&format!("\"op\":\"{op}\""))),
                "{via} {op} missing: {out}"
            );
        }
    }
    assert!(lines.iter().all(|l| l.contains("\"mb_per_s\":")), "{out}");
}

/// One store, two front ends: a Ferry client writes over shared memory
/// (`--ferry`), qemu-io reads it over NBD, and the Ferry client reads
/// what qemu-io wrote.
#[test]
fn ferry_clients_and_nbd_clients_share_the_store() {
    use ferry_block::BlockClient;
    let dir = scratch("ferry");
    let sock = dir.join("ferry.sock");
    let endpoint = format!("shm:{}", sock.display());
    let server = Server::start(&["--store", "mem:16M", "--nbd", "tcp:127.0.0.1:0", "--ferry", &endpoint]);
    let uri = server.uri();
    let mut c = BlockClient::connect(&ferry::Domain::new("app"), &ferry::Endpoint::shm(&sock), 4, 64 << 10, LIMIT)
        .expect("a Ferry client connects");
    assert_eq!(c.size(), 16 << 20);
    c.write(2 << 20, &vec![0xa7u8; 256 << 10]).unwrap();
    c.flush().unwrap();
    let io = ok("qemu-io", &["-f", "raw", "-c", "read -P 0xa7 2M 256k", "-c", "write -P 0x19 4M 8k", &uri]);
    assert!(!io.contains("Pattern verification failed"), "{io}");
    let mut back = vec![0u8; 8 << 10];
    c.read(4 << 20, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x19), "the Ferry client reads what the NBD client wrote");
    drop(c);
    // One line for the NBD client, one for the Ferry client.
    let t0 = Instant::now();
    let (mut nbd_line, mut ferry_line) = (None, None);
    while (nbd_line.is_none() || ferry_line.is_none()) && t0.elapsed() < LIMIT {
        match server.next_line() {
            Some(l) if l.starts_with("client tcp:") => nbd_line = Some(l),
            Some(l) if l.starts_with("ferry client ") => ferry_line = Some(l),
            Some(_) => {}
            None => break,
        }
    }
    assert!(nbd_line.is_some(), "no summary line for the NBD client");
    let ferry_line = ferry_line.expect("a summary line for the Ferry client");
    assert!(ferry_line.contains("disconnected") && ferry_line.contains("0 errors"), "{ferry_line}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Unix socket left by a killed server is taken over; one where a server
/// answers is refused with one line.
#[test]
fn unix_socket_left_by_a_killed_server_is_reused_a_live_one_refused() {
    let dir = scratch("unix");
    let sock = dir.join("nbd.sock");
    let at = format!("unix:{}", sock.display());
    let mut first = Server::start(&["--store", "mem:1M", "--nbd", &at]);
    first.kill();
    assert!(sock.exists(), "SIGKILL leaves the socket file");
    let second = Server::start(&["--store", "mem:2M", "--nbd", &at]);
    let size = ok("nbdinfo", &["--size", &format!("nbd+unix:///?socket={}", sock.display())]);
    assert_eq!(size.trim(), "2097152");
    let out = run(env!("CARGO_BIN_EXE_ferry"), &["block", "serve", "--store", "mem:1M", "--nbd", &at]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("a server listens there already") && err.lines().count() == 1, "{err}");
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The whole path of the block service: a user domain talks to a
/// `ferry block proxy` process over shared memory, the proxy forwards over
/// TCP to `ferry block serve --ferry`, and an NBD client of that server
/// sees the data.
#[test]
fn user_domain_to_proxy_process_to_server_process() {
    use ferry_block::BlockClient;
    let dir = scratch("proxy");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let remote = format!("tcp:127.0.0.1:{port}");
    let server = Server::start(&["--store", "mem:16M", "--nbd", "tcp:127.0.0.1:0", "--ferry", &remote]);
    let sock = dir.join("proxy.sock");
    let mut proxy = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["block", "proxy", "--listen", &format!("shm:{}", sock.display()), "--server", &remote])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("start ferry block proxy");
    let mut user = BlockClient::connect(&ferry::Domain::new("user"), &ferry::Endpoint::shm(&sock), 4, 64 << 10, LIMIT)
        .expect("the user domain reaches the proxy");
    assert_eq!(user.size(), 16 << 20);
    user.write(3 << 20, &vec![0x6bu8; 100 << 10]).unwrap();
    user.flush().unwrap();
    let io = ok("qemu-io", &["-f", "raw", "-c", "read -P 0x6b 3M 100k", "-c", "write -P 0x2d 5M 4k", &server.uri()]);
    assert!(!io.contains("Pattern verification failed"), "{io}");
    let mut back = vec![0u8; 4096];
    user.read(5 << 20, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x2d));
    drop(user);
    let _ = proxy.kill();
    let _ = proxy.wait();
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The first line from `lines` that contains `what`, within [`LIMIT`].
fn line_with(lines: &Receiver<String>, what: &str) -> Option<String> {
    let t0 = Instant::now();
    while let Some(left) = LIMIT.checked_sub(t0.elapsed()) {
        match lines.recv_timeout(left) {
            Ok(l) if l.contains(what) => return Some(l),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

/// A server that may open 64 file descriptors, and 100 connections that
/// never say a word (each would hold a descriptor until its handshake
/// deadline, here 10 minutes): nbdinfo and nbdcopy still get in, the
/// server closing the oldest silent connections to take them, and says
/// so on standard error.
#[test]
fn silent_connections_at_the_fd_limit_do_not_keep_real_clients_out() {
    let dir = scratch("fd-limit");
    let (server, errors) = Server::start_limited(
        64,
        &["--store", "mem:4M", "--nbd", "tcp:127.0.0.1:0", "--handshake-timeout", "600", "--max-connections", "1000"],
    );
    let at = server.listening[0].strip_prefix("tcp:").expect("tcp").to_string();
    let silent: Vec<std::net::TcpStream> =
        (0..100).map(|_| std::net::TcpStream::connect(&at).expect("connect")).collect();
    let size = ok("nbdinfo", &["--size", &server.uri()]);
    assert_eq!(size.trim(), "4194304", "nbdinfo --size");
    let out = dir.join("out.img");
    ok("nbdcopy", &[&server.uri(), out.to_str().unwrap()]);
    assert_eq!(std::fs::metadata(&out).expect("copied").len(), 4 << 20);
    let said = line_with(&errors, "still in its handshake").expect("a line on standard error about the shedding");
    assert!(said.contains("cannot accept") || said.contains("no buffer"), "{said}");
    drop(silent);
    let _ = std::fs::remove_dir_all(&dir);
}

/// CPU time (user and system) the process `pid` has used so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    let after_name = &stat[stat.rfind(')').expect("(comm)") + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime: fields 14 and 15 of stat(5), 12 and 13 after the name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf only reads its argument.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_millis(ticks * 1000 / per_second)
}

/// A server out of file descriptors with every connection past its
/// handshake (nothing to close) waits for one to end without spinning:
/// over 3 seconds it uses far less CPU time than a loop retrying
/// `accept` would (a generous bound: even a small share of a busy core
/// is more). Once clients leave, the waiting one gets in.
#[test]
fn out_of_fds_with_nothing_to_close_the_server_waits_without_spinning() {
    let (mut server, errors) = Server::start_limited(40, &["--store", "mem:1M", "--nbd", "tcp:127.0.0.1:0"]);
    let at = server.listening[0].strip_prefix("tcp:").expect("tcp").to_string();
    // Clients that finish their handshake, one after the other, until the
    // server takes no more.
    let (tx, served) = mpsc::channel();
    std::thread::spawn(move || {
        use std::io::Read;
        for _ in 0..40 {
            let Ok(mut c) = std::net::TcpStream::connect(&at) else { return };
            c.set_read_timeout(Some(LIMIT * 2)).unwrap();
            let mut hello = [0u8; 18];
            let mut m = 3u32.to_be_bytes().to_vec();
            m.extend_from_slice(&0x4948_4156_454f_5054u64.to_be_bytes());
            m.extend_from_slice(&1u32.to_be_bytes());
            m.extend_from_slice(&0u32.to_be_bytes());
            let mut reply = [0u8; 10];
            let done = c.read_exact(&mut hello).and_then(|()| c.write_all(&m)).and_then(|()| c.read_exact(&mut reply));
            if done.is_err() || tx.send(c).is_err() {
                return;
            }
        }
    });
    line_with(&errors, "new clients wait").expect("the server says it is out of descriptors");
    let mut clients: Vec<std::net::TcpStream> = served.try_iter().collect();
    assert!(!clients.is_empty() && clients.len() < 40, "{} clients served", clients.len());
    let pid = server.child.id();
    let before = cpu_time(pid);
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_time(pid) - before;
    assert!(used < Duration::from_millis(300), "the server used {used:?} of CPU in 3 s while it waited");
    // Clients leave: the waiting one is served.
    let n = clients.len();
    clients.truncate(n - 2);
    served.recv_timeout(LIMIT).expect("the waiting client got in once others left");
    server.kill();
}
