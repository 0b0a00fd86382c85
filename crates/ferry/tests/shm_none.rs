//! Trust NONE over the shared-memory backend, between real processes: no
//! memory is shared writable. Each side keeps its own memory of a pool and
//! gives the peer a read-only fd of it, sealed against every new writer; a
//! buffer that arrives is copied from the peer's memory into ours before it
//! is delivered. The hostile peers here try what a hostile process can do
//! with its own memory and fds, and the victim's view must not change.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{
    Allocator, BindParams, BufferState, Channel, ChannelSetup, ChannelState, Direction, Domain, Endpoint, ErrorKind,
    Event, PoolConstraints, Role, TrustLevel,
};

use support::payload::{check, fill};

const T: Duration = Duration::from_secs(10);
const SIZE: usize = 64 << 10;

fn unique(tag: &str) -> String {
    support::unique_name(&format!("none-{tag}"))
}

/// Create a master channel of trust NONE going `direction` on a fresh
/// endpoint, start this test binary as the peer with `role`, and wait for
/// it to bind. The child's stdin and stdout are pipes to talk over.
fn start(domain: &Domain, role: &str, direction: Direction) -> (Channel, Child) {
    let name = unique(role);
    let setup = ChannelSetup { direction, role: Role::Master, trust: TrustLevel::None, ..ChannelSetup::default() };
    let mut ch = Channel::create(domain, &Endpoint::shm_abstract(&name), setup).expect("create");
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "none_child", "--ignored", "--nocapture", "--test-threads=1", "-q"])
        .env("FERRY_NONE_ROLE", role)
        .env("FERRY_NONE_EP", &name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    match ch.wait(Some(T)) {
        Ok(Event::BindRequest { .. }) => (ch, child),
        ev => panic!("expected a bind, got {ev:?}"),
    }
}

/// The next line the child prints that starts with `tag`, with the tag cut.
fn line_from(out: &mut BufReader<ChildStdout>, tag: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child closed stdout before saying {tag}");
        if let Some(rest) = line.trim_end().strip_prefix(tag) {
            return rest.trim().to_string();
        }
    }
}

fn wait_event(ch: &mut Channel) -> Event {
    ch.wait(Some(T)).expect("an event within the timeout")
}

/// Every attack on the peer's pool memory this process can mount with what
/// it has. Its own memory is the pool files it holds an fd of; any other
/// pool file it has mapped (/proc/self/map_files) is the peer's: reopened
/// read-write, then mapped writable, written with `pwrite` and
/// hole-punched; and each mapping of it `mprotect`ed to read-write.
/// Returns (peer files found, attacks the kernel refused, attacks that
/// went through).
fn attack_pool_fds() -> (usize, usize, usize) {
    use rustix::fs::{Mode, OFlags};
    use std::os::unix::fs::MetadataExt;
    let (mut tried, mut refused, mut through) = (0, 0, 0);
    let pool_files = |dir: &str| {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| std::fs::read_link(p).is_ok_and(|t| t.to_string_lossy().contains("ferry-pool")))
            .collect::<Vec<_>>()
    };
    let own: std::collections::HashSet<u64> =
        pool_files("/proc/self/fd").iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.ino()).collect();
    let mut seen = std::collections::HashSet::new();
    for path in pool_files("/proc/self/map_files") {
        let Ok(meta) = std::fs::metadata(&path) else { continue };
        if own.contains(&meta.ino()) || !seen.insert(meta.ino()) {
            continue;
        }
        let Ok(fd) = rustix::fs::open(path.as_path(), OFlags::RDWR, Mode::empty()) else {
            refused += 1;
            continue;
        };
        tried += 1;
        let len = rustix::fs::fstat(&fd).unwrap().st_size as usize;
        // SAFETY: a fresh mapping at a kernel-chosen address (if allowed).
        let map = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                &fd,
                0,
            )
        };
        match map {
            Ok(p) => {
                through += 1;
                // SAFETY: our own fresh mapping of `len` bytes.
                unsafe {
                    std::ptr::write_bytes(p.cast::<u8>(), 0xEE, len);
                    let _ = rustix::mm::munmap(p, len);
                }
            }
            Err(_) => refused += 1,
        }
        match rustix::io::pwrite(&fd, &[0xEE; 64], 0) {
            Ok(_) => through += 1,
            Err(_) => refused += 1,
        }
        let punch = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        match rustix::fs::fallocate(&fd, punch, 0, len as u64) {
            Ok(()) => through += 1,
            Err(_) => refused += 1,
        }
    }
    // Mappings of memory that is not ours: the peer's, read-only.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines().filter(|l| l.contains("ferry-pool")) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let inode: u64 = f[4].parse().unwrap();
        if own.contains(&inode) {
            continue;
        }
        let (lo, hi) = f[0].split_once('-').unwrap();
        let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap(), usize::from_str_radix(hi, 16).unwrap());
        let rw = rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE;
        // SAFETY: test-only hostile peer: a range the kernel reports as
        // mapped in this process; if the kernel allowed it, nothing of ours
        // would be written.
        match unsafe { rustix::mm::mprotect(lo as *mut _, hi - lo, rw) } {
            Ok(()) => through += 1,
            Err(_) => refused += 1,
        }
    }
    (tried, refused, through)
}

/// The peer side. Roles:
/// - `echo`: pass every moved buffer back after checking it; release
///   every copy after checking it;
/// - `write-back`: write the sequence number + 1 into each buffer before
///   passing it back;
/// - `hold`: take everything, give nothing back, wait to be killed;
/// - `hostile-sender`: move one buffer of its own pool, then on "go" try to
///   change it: reopen and map every pool fd writable, write, punch holes,
///   and `mprotect` its own view of the given-away buffer back to
///   read-write and overwrite it;
/// - `hostile-copy`: receive a read-only copy, attack the pool fds, then
///   write through the copy's own mapping (SIGSEGV expected).
#[test]
#[ignore = "run as a child process by the other tests"]
fn none_child() {
    let (Ok(role), Ok(name)) = (std::env::var("FERRY_NONE_ROLE"), std::env::var("FERRY_NONE_EP")) else { return };
    let domain = Domain::new("child");
    let mut ch = Channel::bind(&domain, &Endpoint::shm_abstract(&name), BindParams::default()).expect("bind");
    assert!(matches!(wait_event(&mut ch), Event::Bound));
    let mut stdin = BufReader::new(std::io::stdin());
    let say = |what: &str| {
        println!("{what}");
        std::io::stdout().flush().unwrap();
    };
    if role == "hostile-sender" {
        let alloc = Allocator::new(&domain, 2, SIZE, PoolConstraints::default()).unwrap();
        ch.assign_pool(alloc.pool()).unwrap();
        assert!(matches!(wait_event(&mut ch), Event::PoolAssigned(_)));
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), 7);
        let addr = b.as_ptr() as usize;
        ch.move_buffer(b, &7u64.to_le_bytes()).unwrap();
        let mut other = alloc.alloc().unwrap();
        fill(other.as_mut_slice().unwrap(), 8);
        ch.move_buffer(other, &8u64.to_le_bytes()).unwrap();
        // The victim passes that one back: we now map its memory (read-only).
        let back = match wait_event(&mut ch) {
            Event::BufferPassed { buffer, .. } => buffer,
            ev => panic!("child: unexpected {ev:?}"),
        };
        assert!(check(&back, 8));
        say("moved");
        let mut go = String::new();
        stdin.read_line(&mut go).unwrap();
        let (tried, refused, through) = attack_pool_fds();
        // Our own view of the buffer we gave away: the library made it
        // inaccessible; a hostile process simply makes it writable again.
        // SAFETY: test-only hostile peer: its own mapping of its own pool,
        // page aligned, SIZE bytes; no Rust reference into it is alive.
        unsafe {
            rustix::mm::mprotect(
                addr as *mut _,
                SIZE,
                rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE,
            )
            .unwrap();
            std::ptr::write_bytes(addr as *mut u8, 0xAB, SIZE);
        }
        say(&format!("attacked {tried} {refused} {through}"));
        // Stay until the victim has looked.
        let _ = stdin.read_line(&mut go);
        return;
    }
    let mut held = Vec::new();
    let mut kept = Vec::new();
    loop {
        match ch.wait(Some(Duration::from_secs(30))) {
            Ok(Event::PoolAssignRequest(req)) => ch.respond_pool(req.pool, true).unwrap(),
            Ok(Event::MoveReceived { mut buffer, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&buffer, seq), "child: buffer {seq} arrived corrupted");
                match role.as_str() {
                    "hold" => {
                        kept.push(buffer);
                        say("holding");
                    }
                    "write-back" => {
                        fill(buffer.as_mut_slice().unwrap(), seq + 1);
                        ch.pass(buffer, &meta).unwrap();
                    }
                    _ => ch.pass(buffer, &meta).unwrap(),
                }
            }
            Ok(Event::CopyReceived { copy, meta }) => {
                let seq = u64::from_le_bytes(meta[..8].try_into().unwrap());
                assert!(check(&copy, seq), "child: copy {seq} arrived corrupted");
                if role == "hostile-copy" {
                    let (tried, refused, through) = attack_pool_fds();
                    say(&format!("attacked {tried} {refused} {through}"));
                    // SAFETY: deliberately none: a hostile holder of a
                    // read-only copy writes through it. The kernel must stop
                    // it (SIGSEGV), which the victim's test expects.
                    unsafe { std::ptr::write_volatile(copy.as_ptr() as *mut u8, 0xCD) };
                    say("wrote the copy");
                }
                if role == "hold" {
                    held.push(copy);
                } else {
                    ch.release(copy).unwrap();
                }
            }
            Ok(Event::Closed { .. }) | Err(_) => break,
            Ok(Event::Error(e)) => panic!("child: {e}"),
            Ok(ev) => panic!("child: unexpected {ev:?}"),
        }
    }
    drop(held);
    drop(kept);
}

/// Moves, passes back and copies at trust NONE: every byte arrives, the
/// peer's writes come back (write-back), and everything returns.
#[test]
fn none_flows_between_processes() {
    for role in ["echo", "write-back"] {
        let d = Domain::new("parent");
        let (mut ch, mut child) = start(&d, role, Direction::Tx);
        let alloc = Allocator::new(&d, 8, SIZE, PoolConstraints::default()).unwrap();
        ch.assign_pool(alloc.pool()).unwrap();
        assert!(matches!(wait_event(&mut ch), Event::PoolAssigned(_)));
        let want = |seq: u64| if role == "write-back" { seq + 1 } else { seq };
        support::payload::move_and_take_back(&mut ch, &alloc, 300, want);
        // Copies: the child checks and releases them; ours is read-only
        // while any is out and writable once the last comes back.
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), 99);
        ch.copy(&b, &99u64.to_le_bytes()).unwrap();
        ch.copy(&b, &99u64.to_le_bytes()).unwrap();
        assert_eq!(d.buffer_state(b.id()), BufferState::ReadOnlyOwned);
        for last in [false, true] {
            match wait_event(&mut ch) {
                Event::CopyReleased { buffer, writable } => assert_eq!((buffer, writable), (b.id(), last)),
                ev => panic!("parent: unexpected {ev:?}"),
            }
        }
        assert_eq!(d.buffer_state(b.id()), BufferState::ReadWrite);
        b.as_mut_slice().unwrap()[0] = 1;
        drop(b);
        ch.teardown().unwrap();
        assert!(matches!(wait_event(&mut ch), Event::Closed { by_peer: false }));
        assert_eq!(ch.state(), ChannelState::Closed);
        assert!(support::payload::wait_exit(&mut child, T).success());
        assert_eq!(alloc.available(), 8);
    }
}

/// A sender that gave a buffer away cannot change what the receiver holds:
/// not through its fds (the kernel refuses every writable reopening), and
/// not through its own memory (writable again by `mprotect`, but ours is
/// another copy).
#[test]
fn none_sender_cannot_change_a_buffer_it_gave_away() {
    let d = Domain::new("victim");
    let (mut ch, mut child) = start(&d, "hostile-sender", Direction::Rx);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    match wait_event(&mut ch) {
        Event::PoolAssignRequest(req) => ch.respond_pool(req.pool, true).unwrap(),
        ev => panic!("unexpected {ev:?}"),
    }
    let mut got = Vec::new();
    while got.len() < 2 {
        match wait_event(&mut ch) {
            Event::MoveReceived { buffer, .. } => got.push(buffer),
            ev => panic!("unexpected {ev:?}"),
        }
    }
    let buffer = got.remove(0);
    ch.pass(got.remove(0), &8u64.to_le_bytes()).unwrap();
    line_from(&mut out, "moved");
    assert!(check(&buffer, 7));
    writeln!(stdin, "go").unwrap();
    let report = line_from(&mut out, "attacked");
    let n: Vec<usize> = report.split(' ').map(|x| x.parse().unwrap()).collect();
    // Our memory of the pool, which it maps read-only since we passed a
    // buffer back.
    assert_eq!(n[0], 1, "the hostile sender found {} pool files of ours", n[0]);
    assert_eq!(n[2], 0, "an attack on our memory went through: {report}");
    assert!(n[1] >= 4, "mmap, pwrite, punch and mprotect all refused: {report}");
    assert!(check(&buffer, 7), "the sender changed a buffer it gave away");
    assert_eq!(d.buffer_state(buffer.id()), BufferState::ReadWrite);
    drop(stdin);
    drop(buffer);
    let _ = child.kill();
    let _ = child.wait();
}

/// A holder of a read-only copy cannot write it: its attacks on the pool
/// fds are refused, and a write through its mapping of the copy kills it
/// with SIGSEGV; the owner's buffer is unchanged and comes back writable.
#[test]
fn none_copy_holder_cannot_write_the_copy() {
    let d = Domain::new("owner");
    let (mut ch, mut child) = start(&d, "hostile-copy", Direction::Tx);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let alloc = Allocator::new(&d, 2, SIZE, PoolConstraints::default()).unwrap();
    ch.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(wait_event(&mut ch), Event::PoolAssigned(_)));
    let mut b = alloc.alloc().unwrap();
    fill(b.as_mut_slice().unwrap(), 5);
    ch.copy(&b, &5u64.to_le_bytes()).unwrap();
    let report = line_from(&mut out, "attacked");
    let n: Vec<usize> = report.split(' ').map(|x| x.parse().unwrap()).collect();
    // Our memory of the pool, which it maps read-only to copy from.
    assert_eq!(n[0], 1, "the copy holder found {} pool files of ours", n[0]);
    assert_eq!(n[2], 0, "an attack on our memory went through: {report}");
    assert!(n[1] >= 4, "mmap, pwrite, punch and mprotect all refused: {report}");
    let status = support::payload::wait_exit(&mut child, T);
    assert_eq!(status.signal(), Some(11), "the write through a read-only copy must fault: {status:?}");
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out, &mut rest);
    assert!(!rest.contains("wrote the copy"), "the copy holder wrote its read-only copy");
    assert!(check(&b, 5), "the owner's buffer changed");
    // The dead holder's copy is void: the buffer is writable again.
    let t = Instant::now();
    while d.buffer_state(b.id()) != BufferState::ReadWrite {
        let _ = ch.wait(Some(Duration::from_millis(100)));
        assert!(t.elapsed() < T, "the dead holder's copy never came back");
    }
    b.as_mut_slice().unwrap()[0] = 1;
}

/// `kill -9` of a peer holding moved buffers at trust NONE: an error event
/// in bounded time and every buffer back with its owner.
#[test]
fn none_peer_killed_gives_buffers_back() {
    let d = Domain::new("parent");
    let (mut ch, mut child) = start(&d, "hold", Direction::Tx);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let alloc = Allocator::new(&d, 6, SIZE, PoolConstraints::default()).unwrap();
    ch.assign_pool(alloc.pool()).unwrap();
    assert!(matches!(wait_event(&mut ch), Event::PoolAssigned(_)));
    for seq in 0..5u64 {
        let mut b = alloc.alloc().unwrap();
        fill(b.as_mut_slice().unwrap(), seq);
        ch.move_buffer(b, &seq.to_le_bytes()).unwrap();
        line_from(&mut out, "holding");
    }
    assert_eq!(alloc.available(), 1);
    child.kill().unwrap();
    let _ = child.wait();
    let t = Instant::now();
    let e = loop {
        match ch.wait(Some(T)) {
            Ok(Event::Error(e)) => break e,
            Ok(Event::Closed { .. }) => break ErrorKind::PeerGone.into(),
            Ok(ev) => panic!("unexpected {ev:?}"),
            Err(_) => assert!(t.elapsed() < T, "no error after the kill"),
        }
    };
    assert!(matches!(e.kind(), ErrorKind::PeerGone), "{e:?}");
    assert_eq!(alloc.available(), 6, "the dead peer's buffers came back");
}
