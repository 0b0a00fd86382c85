//! The fabric backend over real libfabric: the `tcp` provider (through
//! `ofi_rxm` for its reliable datagram endpoints) on loopback. Moves,
//! passes and copies between two domains with every byte checked, two
//! processes moving 1 GiB, a peer killed with SIGKILL, providers that
//! cannot serve the backend, and libfabric loaded only when a fabric
//! endpoint opens, leaving the process's signal dispositions as they were.

mod support;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, Channel, ChannelSetup, Direction, Domain, Endpoint, Error, ErrorKind, Event, FabricOptions,
    PoolConstraints, Role, TrustLevel,
};

use support::payload::{check, fill};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;

fn options() -> FabricOptions {
    FabricOptions::default().with_provider("tcp")
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn seq_of(meta: &[u8]) -> u64 {
    u64::from_le_bytes(meta[..8].try_into().unwrap())
}

fn next(ch: &mut Channel) -> Event {
    match ch.wait(Some(T)) {
        Ok(ev) => ev,
        Err(_) => panic!("no event within {T:?} (state {:?})", ch.state()),
    }
}

/// The next event of `ch` while `other`, an end in the same thread, is
/// flushed meanwhile: with manual progress (the tcp provider's) an end's
/// messages move only while it is polled.
fn next_beside(ch: &mut Channel, other: &mut Channel) -> Event {
    let t = Instant::now();
    loop {
        let _ = other.flush();
        if let Ok(ev) = ch.wait(Some(Duration::from_millis(1))) {
            return ev;
        }
        assert!(t.elapsed() < T, "no event within {T:?} (state {:?})", ch.state());
    }
}

/// A TX master listening on loopback, and the address to bind to.
fn listen(domain: &Domain, trust: TrustLevel) -> (Channel, SocketAddr) {
    let setup = ChannelSetup { direction: Direction::Tx, role: Role::Master, trust, ..ChannelSetup::default() };
    let ch = Channel::create(domain, &Endpoint::fabric_with(loopback(), options()), setup).expect("create");
    let addr = ch.listen_addr().expect("listening");
    (ch, addr)
}

fn assign(ch: &mut Channel, alloc: &Allocator) {
    ch.assign_pool(alloc.pool()).unwrap();
    match next(ch) {
        Event::PoolAssigned(_) => {}
        ev => panic!("expected the pool assigned, got {ev:?}"),
    }
}

/// Moves, passes and copies between two domains of this process, every
/// byte checked on arrival; the counters show every payload went by RMA
/// straight from buffer to buffer.
fn flows_at(trust: TrustLevel) {
    let src = Domain::new("src");
    let (tx, addr) = listen(&src, trust);
    let bind =
        move |d: &Domain| Channel::bind(d, &Endpoint::fabric_with(addr, options()), BindParams::default()).unwrap();
    support::scenarios::flows(&src, tx, SIZE, bind);
}

#[test]
fn flows_full_trust() {
    flows_at(TrustLevel::Full);
}

#[test]
fn flows_half_trust() {
    flows_at(TrustLevel::Half);
}

/// The first error event, within `within` (passes and releases on the
/// way are fine).
fn error_within(ch: &mut Channel, within: Duration) -> Error {
    let t = Instant::now();
    loop {
        match ch.wait(Some(within)) {
            Ok(Event::Error(e)) => return e,
            Ok(Event::CopyReleased { .. }) | Ok(Event::BufferPassed { .. }) => {}
            Ok(ev) => panic!("unexpected {ev:?}"),
            Err(_) => assert!(t.elapsed() < within, "no error event within {within:?}"),
        }
    }
}

// ------------------------------------------------------------- failures

/// A provider that does not exist, and ones that cannot serve the
/// backend, fail the creation (and the bind) with a fabric error that says
/// what the backend needs.
#[test]
fn unusable_providers_fail_at_creation() {
    let d = Domain::new("d");
    // udp (through ofi_rxd) and shm have RMA here, but no completion queue
    // with a file descriptor, which the channel's waiting needs.
    let cases = [("no-such-provider", "RMA writes"), ("udp", "file descriptor"), ("shm", "file descriptor")];
    for (provider, says) in cases {
        let ep = Endpoint::fabric_with(loopback(), FabricOptions::default().with_provider(provider));
        match Channel::create(&d, &ep, ChannelSetup::default()) {
            Err(e) if matches!(e.kind(), ErrorKind::Fabric(_)) => {
                assert!(e.to_string().contains(says), "{provider}: {e}")
            }
            other => panic!("{provider}: expected a fabric error, got {:?}", other.map(|c| c.state())),
        }
    }
    // A binder finds out before it sends anything of its own.
    let listener = std::net::TcpListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let ep = Endpoint::fabric_with(addr, FabricOptions::default().with_provider("no-such-provider"));
    match Channel::bind(&d, &ep, BindParams::default()) {
        Err(e) if matches!(e.kind(), ErrorKind::Fabric(_)) => assert!(e.to_string().contains("fi_getinfo"), "{e}"),
        other => panic!("expected a fabric error, got {:?}", other.map(|c| c.state())),
    }
}

/// Trust NONE promises memory the peer cannot write; with RMA the peer
/// writes registered memory by itself, so the backend refuses it.
#[test]
fn trust_none_is_refused() {
    let d = Domain::new("d");
    let setup = ChannelSetup { trust: TrustLevel::None, ..ChannelSetup::default() };
    let e = Channel::create(&d, &Endpoint::fabric_with(loopback(), options()), setup).map(|c| c.state());
    assert!(
        matches!(
            e.as_ref().map_err(|e| e.kind()),
            Err(ErrorKind::TrustNotSupported { trust: TrustLevel::None, backend: "fabric" })
        ),
        "{e:?}"
    );
}

/// The fabric is not encrypted: an address beyond loopback only on purpose.
#[test]
fn addresses_beyond_loopback_only_on_purpose() {
    let d = Domain::new("d");
    let at: SocketAddr = "192.0.2.1:7000".parse().unwrap();
    let e = Channel::create(&d, &Endpoint::fabric_with(at, options()), ChannelSetup::default()).map(|c| c.state());
    assert!(matches!(e.as_ref().map_err(|e| e.kind()), Err(ErrorKind::InsecureAddress(_))), "{e:?}");
}

/// Both ends must run the same provider: a binder on another one is told
/// which, and the creator keeps listening for a binder that fits.
#[test]
fn ends_on_different_providers_are_told_which() {
    let src = Domain::new("src");
    let (mut tx, addr) = listen(&src, TrustLevel::Full);
    let d = Domain::new("other");
    let ep = Endpoint::fabric_with(addr, FabricOptions::default().with_provider("sockets"));
    let mut other = Channel::bind(&d, &ep, BindParams::default()).unwrap();
    let t = Instant::now();
    let e = loop {
        let _ = tx.poll();
        match other.wait(Some(Duration::from_millis(50))) {
            Ok(Event::Error(e)) => break e,
            Ok(ev) => panic!("unexpected {ev:?}"),
            Err(_) => assert!(t.elapsed() < T, "no answer"),
        }
    };
    assert!(matches!(e.kind(), ErrorKind::Fabric(why) if why.contains("sockets") && why.contains("tcp")), "{e:?}");
    // The right binder still gets through.
    let sink = std::thread::spawn(move || {
        let mut rx =
            Channel::connect(&Domain::new("sink"), &Endpoint::fabric_with(addr, options()), BindParams::default(), T);
        rx.as_mut().map(|rx| rx.state()).map_err(|e| e.clone())
    });
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    assert!(sink.join().unwrap().is_ok());
}

/// An end dropped after a move to it arrived: the buffer is the dropping
/// domain's, and the drop says goodbye, so the peer fails with `PeerGone`
/// but does not take the buffer back, as from a peer that closed on
/// purpose (a dead peer's buffers come back instead, see
/// `killed_peer_returns_everything`).
#[test]
fn a_dropped_end_keeps_what_it_took_in() {
    let src = Domain::new("src");
    let (mut tx, addr) = listen(&src, TrustLevel::Full);
    let d = Domain::new("sink");
    let mut rx = Channel::bind(&d, &Endpoint::fabric_with(addr, options()), BindParams::default()).unwrap();
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    assert!(matches!(next_beside(&mut rx, &mut tx), Event::Bound));
    let alloc = Allocator::new(&src, 4, SIZE, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    let req = match next_beside(&mut rx, &mut tx) {
        Event::PoolAssignRequest(req) => req,
        ev => panic!("expected the offer, got {ev:?}"),
    };
    rx.respond_pool(req.pool, true).unwrap();
    assert!(matches!(next_beside(&mut tx, &mut rx), Event::PoolAssigned(_)));
    let mut b = alloc.alloc().unwrap();
    fill(b.as_mut_slice().unwrap(), 3);
    tx.move_buffer(b, &3u64.to_le_bytes()).unwrap();
    match next_beside(&mut rx, &mut tx) {
        Event::MoveReceived { buffer, .. } => assert!(check(&buffer, 3)),
        ev => panic!("expected the move, got {ev:?}"),
    }
    drop(rx);
    let e = error_within(&mut tx, T);
    assert_eq!(e, ErrorKind::PeerGone);
    assert_eq!(alloc.available(), 3, "the moved buffer stays with the domain that took it in");
}

// --------------------------------------------------------- other processes

fn spawn_child(role: &str, addr: SocketAddr) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "fabric_child", "--ignored", "--nocapture", "--test-threads=1", "-q"])
        .env("FERRY_FABRIC_ROLE", role)
        .env("FERRY_FABRIC_ADDR", addr.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child")
}

/// The line the child prints that starts with `tag`.
fn child_says(child: &mut Child, tag: &str) -> String {
    use std::io::BufRead;
    let out = child.stdout.as_mut().expect("piped");
    let mut lines = std::io::BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) if line.starts_with(tag) => return line,
            Some(Ok(_)) => {}
            other => panic!("the child ended without saying {tag}: {other:?}"),
        }
    }
}

/// FNV-1a over the 64-bit words of `bytes` (a length multiple of 8),
/// continuing from `h`.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for w in bytes.chunks_exact(8) {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(0x100_0000_01b3);
    }
    h
}

const FNV: u64 = 0xcbf2_9ce4_8422_2325;

/// The peer process. Roles: `sink` (check every moved buffer, fold it into
/// a checksum, pass it back unfilled; print the checksum at the close),
/// `hold` (keep what arrives, say so once 6 moves and a copy are here,
/// and wait to be killed).
#[test]
#[ignore = "run as a child process by the other tests"]
fn fabric_child() {
    let (Ok(role), Ok(addr)) = (std::env::var("FERRY_FABRIC_ROLE"), std::env::var("FERRY_FABRIC_ADDR")) else {
        return;
    };
    let d = Domain::new("child");
    let ep = Endpoint::fabric_with(addr.parse().unwrap(), options());
    let mut ch = Channel::bind(&d, &ep, BindParams::default()).expect("bind");
    let (mut kept, mut copies, mut sum, mut bytes) = (Vec::new(), Vec::new(), FNV, 0u64);
    loop {
        match ch.wait(Some(Duration::from_secs(60))) {
            Ok(Event::Bound) => {}
            Ok(Event::PoolAssignRequest(req)) => ch.respond_pool(req.pool, true).unwrap(),
            Ok(Event::MoveReceived { buffer, meta }) => {
                let seq = seq_of(&meta);
                assert!(check(&buffer, seq), "child: buffer {seq} arrived corrupted");
                if role == "hold" {
                    kept.push(buffer);
                } else {
                    sum = fnv(sum, &buffer);
                    bytes += buffer.len() as u64;
                    ch.pass_unfilled(buffer, &meta).unwrap();
                }
            }
            Ok(Event::CopyReceived { copy, meta }) => {
                assert!(check(&copy, seq_of(&meta)), "child: copy arrived corrupted");
                copies.push(copy);
            }
            Ok(Event::Closed { .. }) | Err(_) => break,
            Ok(Event::Error(e)) => panic!("child: {e}"),
            Ok(ev) => panic!("child: unexpected {ev:?}"),
        }
        if role == "hold" && kept.len() == 6 && copies.len() == 1 {
            println!("held");
            // Killed here; a parent that is gone leaves it to exit alone.
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
    }
    println!("sum {sum:016x} {bytes}");
}

fn start_child(d: &Domain, role: &str) -> (Channel, Child) {
    let (mut ch, addr) = listen(d, TrustLevel::Full);
    let child = spawn_child(role, addr);
    assert!(matches!(next(&mut ch), Event::BindRequest { .. }));
    (ch, child)
}

/// 1 GiB to another process in 1 MiB buffers, every byte checked there
/// and the whole checksummed on both sides.
#[test]
fn one_gib_between_processes() {
    const BUF: usize = 1 << 20;
    const MOVES: u64 = 1024;
    let d = Domain::new("parent");
    let (mut ch, mut child) = start_child(&d, "sink");
    let alloc = Allocator::new(&d, 16, BUF, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    let (mut sent, mut back, mut sum) = (0u64, 0u64, FNV);
    let started = Instant::now();
    while back < MOVES {
        while sent < MOVES {
            let Some(mut b) = alloc.alloc() else { break };
            fill(b.as_mut_slice().unwrap(), sent);
            sum = fnv(sum, &b);
            ch.move_buffer(b, &sent.to_le_bytes()).unwrap();
            sent += 1;
        }
        match ch.wait(Some(Duration::from_secs(30))) {
            Ok(Event::BufferPassed { .. }) => back += 1,
            ev => panic!("unexpected {ev:?} (state {:?})", ch.state()),
        }
    }
    let took = started.elapsed();
    ch.teardown().unwrap();
    assert!(matches!(next(&mut ch), Event::Closed { by_peer: false }));
    let line = child_says(&mut child, "sum ");
    assert_eq!(line, format!("sum {sum:016x} {}", MOVES * BUF as u64), "the child's checksum");
    let stats = ch.link_stats().unwrap();
    assert_eq!(stats.payload_sent, MOVES * BUF as u64, "{stats:?}");
    assert_eq!(stats.payload_received, 0, "the passes came back unfilled: {stats:?}");
    assert_eq!(alloc.available(), 16);
    assert!(support::payload::wait_exit(&mut child, T).success());
    eprintln!("1 GiB over the fabric in {took:?} (checksumming included, debug build)");
}

/// SIGKILL of the peer while it holds moved buffers and a read-only copy:
/// a typed error in bounded time, every buffer back in the allocator, the
/// copied buffer writable again.
#[test]
fn killed_peer_returns_everything() {
    let d = Domain::new("parent");
    let (mut ch, mut child) = start_child(&d, "hold");
    let alloc = Allocator::new(&d, 8, SIZE, PoolConstraints::default()).unwrap();
    assign(&mut ch, &alloc);
    for seq in 0..6u64 {
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), seq);
        ch.move_buffer(b, &seq.to_le_bytes()).unwrap();
    }
    let mut kept = alloc.alloc().unwrap();
    fill(kept.as_mut_slice().unwrap(), 9);
    ch.copy(&kept, &9u64.to_le_bytes()).unwrap();
    ch.flush().unwrap();
    // The child says when it holds everything; our side keeps polling so
    // the provider progresses meanwhile.
    let (said, heard) = std::sync::mpsc::channel();
    let mut out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let held = std::io::BufReader::new(&mut out).lines().any(|l| l.is_ok_and(|l| l == "held"));
        let _ = said.send(held);
    });
    let t = Instant::now();
    loop {
        assert!(ch.wait(Some(Duration::from_millis(20))).is_err(), "no event while the child holds");
        match heard.try_recv() {
            Ok(held) => {
                assert!(held, "the child ended without holding everything");
                break;
            }
            Err(_) => assert!(t.elapsed() < T, "the child never held everything"),
        }
    }
    child.kill().unwrap();
    let t = Instant::now();
    let e = error_within(&mut ch, T);
    assert!(matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::Fabric(_)), "{e:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "noticed after {:?}", t.elapsed());
    assert_eq!(alloc.available(), 7, "the six moved buffers are back");
    assert!(kept.as_mut_slice().is_ok(), "the copy held by the dead peer is void");
    let _ = child.wait();
}

// ------------------------------------------------- loading libfabric lazily

/// The signals whose dispositions a provider's library took at load time
/// (Debian's psm provider: a backtrace and exit in place of the signal).
const WATCHED_SIGNALS: [i32; 6] =
    [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGABRT, libc::SIGINT, libc::SIGTERM];

/// Whether libfabric is mapped into this process, and the watched signals
/// whose handler lives in a shared library (Rust's own handlers for stack
/// overflows live in the executable), with that library's file.
fn loaded_and_handled() -> (bool, Vec<(i32, String)>) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let handled = WATCHED_SIGNALS
        .into_iter()
        .filter_map(|sig| {
            // SAFETY: struct sigaction is plain data; all zeroes is a valid value.
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: a query only (no new action); `old` is a valid out place.
            assert_eq!(unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) }, 0);
            if old.sa_sigaction == libc::SIG_DFL || old.sa_sigaction == libc::SIG_IGN {
                return None;
            }
            // SAFETY: struct Dl_info is plain data; dladdr only fills it in.
            let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
            // SAFETY: dladdr reads no memory at the address; `info` is a valid out place.
            if unsafe { libc::dladdr(old.sa_sigaction as *const libc::c_void, &mut info) } == 0
                || info.dli_fname.is_null()
            {
                return Some((sig, "?".to_string()));
            }
            // SAFETY: dli_fname is a NUL-terminated string of the loader's.
            let file = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
            file.contains(".so").then_some((sig, file))
        })
        .collect();
    (maps.contains("libfabric"), handled)
}

fn run_signals_child(mode: &str, libfabric: Option<&str>) -> std::process::Output {
    let mut child = Command::new(std::env::current_exe().unwrap());
    child.args(["--exact", "fabric_signals_child", "--ignored", "--nocapture", "--test-threads=1", "-q"]);
    child.env("FERRY_FABRIC_SIGNALS", mode);
    if let Some(file) = libfabric {
        child.env("FERRY_LIBFABRIC", file);
    }
    child.output().expect("run child")
}

/// Where libfabric is missing (here: `FERRY_LIBFABRIC` names a file that
/// is not there, or a library that is not libfabric), opening a fabric
/// endpoint fails with `FabricUnavailable` saying what the loader said,
/// on both ends; nothing else of the process is affected.
#[test]
fn a_missing_libfabric_is_a_typed_error() {
    for (file, says) in [("/nonexistent/libfabric.so.1", "/nonexistent/libfabric.so.1"), ("libc.so.6", "fi_getinfo")] {
        let out = run_signals_child("missing", Some(file));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{file}: {:?}: {stdout} {stderr}", out.status);
        let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("unavailable")).collect();
        assert_eq!(lines.len(), 2, "{file}: {stdout} {stderr}");
        for line in lines {
            assert!(line.contains(says) && line.contains("FERRY_LIBFABRIC"), "{file}: {line}");
        }
    }
}

/// A program built with the fabric backend loads libfabric only when it
/// opens a fabric endpoint, and loading it leaves the process's signal
/// dispositions as they were: a HALF-trust protection fault still kills
/// the process by SIGSEGV after the fabric was used.
#[test]
fn libfabric_loads_on_first_use_and_leaves_signals_alone() {
    use std::os::unix::process::ExitStatusExt;
    let out = run_signals_child("idle", None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{:?}: {stdout} {}", out.status, String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("before: loaded false handled []"), "{stdout}");

    let out = run_signals_child("used", None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("before: loaded false handled []"), "{stdout} {stderr}");
    assert!(stdout.contains("after: loaded true handled []"), "{stdout} {stderr}");
    assert!(stdout.contains("faulting"), "the child did not get to the fault: {stdout} {stderr}");
    assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "{:?}: {stdout} {stderr}", out.status);
}

/// Helper of `libfabric_loads_on_first_use_and_leaves_signals_alone`, run
/// in a child process: says whether libfabric is loaded and which watched
/// signals have handlers; in mode `used`, opens a fabric endpoint, says it
/// again, and writes into a buffer it moved away under HALF trust.
#[test]
#[ignore = "run as a child process by the other tests"]
fn fabric_signals_child() {
    use std::io::Write;
    let Ok(mode) = std::env::var("FERRY_FABRIC_SIGNALS") else { return };
    let say = |when: &str| {
        let (loaded, handled) = loaded_and_handled();
        println!("{when}: loaded {loaded} handled {handled:?}");
        std::io::stdout().flush().unwrap();
    };
    say("before");
    if mode == "missing" {
        let d = Domain::new("d");
        let listener = std::net::TcpListener::bind(loopback()).unwrap();
        let bind_to = Endpoint::fabric_with(listener.local_addr().unwrap(), options());
        let create = Channel::create(&d, &Endpoint::fabric_with(loopback(), options()), ChannelSetup::default());
        for end in [create, Channel::bind(&d, &bind_to, BindParams::default())] {
            match end {
                Err(e) if matches!(e.kind(), ErrorKind::FabricUnavailable(_)) => println!("unavailable: {e}"),
                other => panic!("expected FabricUnavailable, got {:?}", other.map(|c| c.state())),
            }
        }
        return;
    }
    if mode != "used" {
        return;
    }
    let d = Domain::new("d");
    let (_fabric, _) = listen(&d, TrustLevel::Half);
    say("after");
    // A protection fault under HALF trust, over the local backend.
    let setup = ChannelSetup { trust: TrustLevel::Half, ..ChannelSetup::default() };
    let ep = Endpoint::local();
    let mut tx = Channel::create(&d, &ep, setup).unwrap();
    let sink = Domain::new("sink");
    let mut rx = Channel::bind(&sink, &ep, BindParams::default()).unwrap();
    assert!(matches!(next(&mut tx), Event::BindRequest { .. }));
    assert!(matches!(next(&mut rx), Event::Bound));
    let alloc = Allocator::new(&d, 2, SIZE, PoolConstraints::default()).unwrap();
    tx.assign_pool(alloc.pool()).unwrap();
    match next(&mut rx) {
        Event::PoolAssignRequest(req) => rx.respond_pool(req.pool, true).unwrap(),
        ev => panic!("expected the offer, got {ev:?}"),
    }
    assert!(matches!(next(&mut tx), Event::PoolAssigned(_)));
    let mut b = alloc.alloc().unwrap();
    let addr = b.as_mut_slice().unwrap().as_mut_ptr();
    tx.move_buffer(b, b"").unwrap();
    println!("faulting");
    std::io::stdout().flush().unwrap();
    // SAFETY: none: the page is PROT_NONE after the move under HALF trust,
    // so this write must fault.
    unsafe { std::ptr::write_volatile(addr, 1) };
    println!("the write after the move did not fault");
}
