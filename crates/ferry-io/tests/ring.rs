//! The io_uring queue: many reads and writes in flight on real files, the
//! pool registered as fixed buffers, the blocking fallback doing the same,
//! errors typed with every buffer back, and one epoll set that waits on a
//! Ferry channel and on the queue's completions at once.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};
use ferry_io::{Done, IoError, Mode, Port, Ring};

const BUF: usize = 16 << 10;
const COUNT: u64 = 16;
const T: Duration = Duration::from_secs(10);

mod common;
use common::data;

/// A fresh scratch directory for one test.
fn dir(name: &str) -> PathBuf {
    common::dir("ring", name)
}

/// Read `src` with every buffer's read in flight at once, then write them
/// all at once to `dst` at the same offsets.
fn copy_in_flight(ring: &mut Ring, a: &Allocator, src: &Path, dst: &Path, len: usize) {
    let input = Port::open(src).unwrap();
    let output = Port::create(dst).unwrap();
    let n = len.div_ceil(BUF);
    for i in 0..n {
        ring.submit_read(&input, Some((i * BUF) as u64), a, i as u64).unwrap();
    }
    let mut filled = Vec::new();
    while filled.len() < n {
        let got = ring.wait(Some(T)).unwrap();
        assert!(!got.is_empty(), "no completion within {T:?}");
        for c in got {
            match c.result {
                Ok(Done::Read(f)) => filled.push((c.tag, f)),
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!(a.available(), COUNT as usize - n, "every read holds its buffer");
    let mut written = 0;
    for (tag, f) in filled {
        ring.submit_write(&output, Some(tag * BUF as u64), f, tag).unwrap();
    }
    let mut done = 0;
    while done < n {
        for c in ring.wait(Some(T)).unwrap() {
            match c.result {
                Ok(Done::Written(w)) => written += w,
                other => panic!("{other:?}"),
            }
            done += 1;
        }
    }
    assert_eq!(written, len as u64);
    assert_eq!(a.available(), COUNT as usize, "every written buffer is back");
}

#[test]
fn many_requests_in_flight_with_fixed_buffers_and_without_io_uring() {
    let d = dir("inflight");
    let len = 11 * BUF + 999;
    let want = data(len, 5);
    std::fs::write(d.join("src"), &want).unwrap();
    let a = Allocator::new(&Domain::new("ring"), COUNT, BUF, PoolConstraints::default()).unwrap();

    let mut ring = Ring::new(8).unwrap(); // fewer entries than requests: submission waits for room
    assert_eq!(ring.register(&a), &Mode::Fixed, "this kernel registers the pool's memfd memory");
    copy_in_flight(&mut ring, &a, &d.join("src"), &d.join("fixed"), len);
    assert!(std::fs::read(d.join("fixed")).unwrap() == want);

    let mut blocking = Ring::blocking(8).unwrap();
    assert!(matches!(blocking.mode(), Mode::Blocking(_)));
    copy_in_flight(&mut blocking, &a, &d.join("src"), &d.join("blocking"), len);
    assert!(std::fs::read(d.join("blocking")).unwrap() == want);
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn failed_requests_are_typed_and_return_their_buffers() {
    let d = dir("errors");
    let a = Allocator::new(&Domain::new("ring"), COUNT, BUF, PoolConstraints::default()).unwrap();
    for mut ring in [Ring::new(4).unwrap(), Ring::blocking(4).unwrap()] {
        ring.register(&a);
        let write_only = Port::create(d.join("wo")).unwrap();
        ring.submit_read(&write_only, Some(0), &a, 7).unwrap();
        let read_only = Port::open(d.join("wo")).unwrap();
        ring.submit_write(&read_only, Some(0), a.alloc().unwrap(), 8).unwrap();
        let mut got = Vec::new();
        while got.len() < 2 {
            got.extend(ring.wait(Some(T)).unwrap());
        }
        got.sort_by_key(|c| c.tag);
        for (c, op) in got.iter().zip(["read", "write"]) {
            match &c.result {
                Err(e @ IoError::Os { op: o, .. }) => {
                    assert_eq!(*o, op);
                    assert!(e.to_string().contains("/wo: "), "{e}");
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(a.available(), COUNT as usize);
    }
    std::fs::remove_dir_all(d).unwrap();
}

fn epoll() -> OwnedFd {
    // SAFETY: no pointers.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a new fd nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn epoll_add(ep: &OwnedFd, fd: RawFd, token: u64) {
    let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: token };
    // SAFETY: a valid event for a valid fd.
    assert_eq!(unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) }, 0);
}

/// The tokens of the fds ready within the timeout.
fn epoll_wait(ep: &OwnedFd) -> Vec<u64> {
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
    // SAFETY: room for 4 events.
    let n = unsafe { libc::epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), 4, T.as_millis() as i32) };
    assert!(n > 0, "nothing ready within {T:?}");
    evs[..n as usize].iter().map(|e| e.u64).collect()
}

/// Poll the channel until it has nothing, then arm it before sleeping.
fn drain(rx: &mut Channel, received: &mut Option<ferry::Buffer>) {
    loop {
        match rx.poll() {
            Some(Event::MoveReceived { buffer, .. }) => *received = Some(buffer),
            Some(Event::PoolAssignRequest(_)) => {}
            Some(other) => panic!("{other:?}"),
            None => {
                if rx.arm() {
                    return;
                }
            }
        }
    }
}

const CHANNEL: u64 = 1;
const RING: u64 = 2;

#[test]
fn one_epoll_set_waits_on_a_channel_and_the_ring() {
    let d = dir("epoll");
    std::fs::write(d.join("f"), b"from the file").unwrap();
    let ep_addr = Endpoint::local();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let source = {
        let ep_addr = ep_addr.clone();
        std::thread::spawn(move || {
            let app = Domain::new("source");
            let mut tx = Channel::accept(&app, &ep_addr, ChannelSetup::default(), T).unwrap();
            let alloc = Allocator::new(&app, 2, 4096, PoolConstraints::default()).unwrap();
            tx.assign_pool_and_wait(alloc.pool(), T).unwrap();
            go_rx.recv_timeout(T).unwrap();
            let mut b = alloc.alloc().unwrap();
            b.as_mut_slice().unwrap()[..12].copy_from_slice(b"over channel");
            tx.move_buffer(b, &[]).unwrap();
            let _ = done_rx.recv_timeout(T);
        })
    };
    let mut rx = Channel::connect(&Domain::new("sink"), &ep_addr, BindParams::default(), T).unwrap();
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    let a = Allocator::new(&Domain::new("io"), 4, 4096, PoolConstraints::default()).unwrap();
    let mut ring = Ring::new(4).unwrap();
    ring.register(&a);

    let ep = epoll();
    epoll_add(&ep, rx.as_fd().as_raw_fd(), CHANNEL);
    epoll_add(&ep, ring.as_fd().as_raw_fd(), RING);

    let mut received = None;
    drain(&mut rx, &mut received);

    // 1. A file read on the ring: the ring's fd wakes the loop.
    let input = Port::open(d.join("f")).unwrap();
    ring.submit_read(&input, Some(0), &a, 1).unwrap();
    let mut from_file = None;
    while from_file.is_none() {
        for token in epoll_wait(&ep) {
            if token == RING {
                for c in ring.completions().unwrap() {
                    from_file = Some(match c.result {
                        Ok(Done::Read(f)) => f,
                        other => panic!("{other:?}"),
                    });
                }
            } else {
                drain(&mut rx, &mut received);
            }
        }
    }
    assert_eq!(from_file.as_ref().unwrap().bytes(), b"from the file");

    // 2. A buffer moved over the channel: the channel's fd wakes the same loop.
    go_tx.send(()).unwrap();
    while received.is_none() {
        for token in epoll_wait(&ep) {
            if token == CHANNEL {
                drain(&mut rx, &mut received);
            } else {
                assert!(ring.completions().unwrap().is_empty(), "nothing else was submitted");
            }
        }
    }
    assert_eq!(&received.as_ref().unwrap()[..12], b"over channel");

    // 3. The received buffer is written through the ring (consumed: it goes
    // back to the source's domain when the channel passes it on drop).
    let out = Port::create(d.join("out")).unwrap();
    ring.submit_write(&out, Some(0), ferry_io::Chunk::new(received.take().unwrap(), 0..12).unwrap(), 2).unwrap();
    ring.submit_write(&out, Some(12), from_file.take().unwrap(), 3).unwrap();
    let mut done = 0;
    while done < 2 {
        for token in epoll_wait(&ep) {
            if token == RING {
                for c in ring.completions().unwrap() {
                    assert!(matches!(c.result, Ok(Done::Written(_))), "{c:?}");
                    done += 1;
                }
            } else {
                drain(&mut rx, &mut received);
            }
        }
    }
    assert_eq!(std::fs::read(d.join("out")).unwrap(), b"over channelfrom the file");
    assert_eq!(a.available(), 4);
    done_tx.send(()).unwrap();
    source.join().unwrap();
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn dropping_the_ring_waits_for_its_requests_and_returns_their_buffers() {
    let d = dir("drop");
    std::fs::write(d.join("f"), data(8 * BUF, 9)).unwrap();
    let a = Allocator::new(&Domain::new("ring"), COUNT, BUF, PoolConstraints::default()).unwrap();
    let input = Port::open(d.join("f")).unwrap();
    let mut ring = Ring::new(16).unwrap();
    ring.register(&a);
    for i in 0..8u64 {
        ring.submit_read(&input, Some(i * BUF as u64), &a, i).unwrap();
    }
    assert_eq!(ring.in_flight(), 8);
    assert_eq!(a.available(), COUNT as usize - 8, "each request holds its buffer");
    drop(ring);
    assert_eq!(a.available(), COUNT as usize, "all back once the kernel is done");
    std::fs::remove_dir_all(d).unwrap();
}

/// The file size limit (`RLIMIT_FSIZE`) of the short-write child: not a
/// multiple of anything the kernel or the pool rounds to.
const FSIZE_LIMIT: u64 = 5 * BUF as u64 + 1000;
/// Where its write starts: 5000 bytes below the limit, so the kernel
/// writes 5000 bytes of the 16 KiB chunk and reports a short write.
const SHORT_AT: u64 = FSIZE_LIMIT - 5000;

/// The child of `a_short_write_goes_on_where_it_stopped` (ignored
/// otherwise): under a file size limit, a chunk written across it with
/// io_uring (fixed buffers) and with the blocking fallback.
#[test]
#[ignore = "run as a child process by a_short_write_goes_on_where_it_stopped"]
fn short_write_child() {
    let Ok(d) = std::env::var("FERRY_RING_SHORT_DIR") else { return };
    let d = PathBuf::from(d);
    let want = data(BUF, 11);
    // The pool's memory is a file too: made before the limit.
    let a = Allocator::new(&Domain::new("ring"), COUNT, BUF, PoolConstraints::default()).unwrap();
    let rings = [("io_uring", Ring::new(4).unwrap()), ("blocking", Ring::blocking(4).unwrap())];
    // SAFETY: plain libc calls. SIGXFSZ ignored: a write past the limit
    // then fails with EFBIG instead of killing the process; the limit is
    // this child's own.
    unsafe {
        assert_ne!(libc::signal(libc::SIGXFSZ, libc::SIG_IGN), libc::SIG_ERR);
        let limit = libc::rlimit { rlim_cur: FSIZE_LIMIT, rlim_max: FSIZE_LIMIT };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
    for (name, mut ring) in rings {
        let registered = ring.register(&a).clone();
        if name == "io_uring" {
            assert_eq!(registered, Mode::Fixed, "this kernel registers the pool's memfd memory");
        }
        let path = d.join(name);
        let out = Port::create(&path).unwrap();
        let mut b = a.alloc().unwrap();
        b.as_mut_slice().unwrap().copy_from_slice(&want);
        ring.submit_write(&out, Some(SHORT_AT), b, 1).unwrap();
        let got = ring.wait(Some(T)).unwrap();
        assert_eq!(got.len(), 1, "{name}: one completion within {T:?}");
        // The first 5000 bytes fit; the rest, written where they belong
        // (at the limit), is refused: an error at that byte, never a
        // success, and the file holds the chunk's first 5000 bytes there.
        match &got[0].result {
            Err(IoError::Os { offset, source, .. }) => {
                assert_eq!(source.raw_os_error(), Some(libc::EFBIG), "{name}: {source}");
                assert_eq!(*offset, FSIZE_LIMIT, "{name}: the error is at the byte where the write stopped");
            }
            other => panic!("{name}: a write across the file size limit gave {other:?}"),
        }
        let file = std::fs::read(&path).unwrap();
        assert_eq!(file.len() as u64, FSIZE_LIMIT, "{name}");
        assert!(file[SHORT_AT as usize..] == want[..5000], "{name}: the bytes before the limit are the chunk's first");
        assert_eq!(a.available(), COUNT as usize, "{name}: the buffer is back");
    }
    println!("short write child: ok");
}

/// A write the kernel cuts short (a real short write: the file size limit
/// lets only part of it through) goes on at the offset where it stopped,
/// not at the one it started from; here the rest then fails, and the
/// failure is reported at that byte with the bytes before it in place. A
/// continuation at the starting offset would overwrite the start of the
/// chunk with its later bytes and report the whole chunk written. Run in a
/// child process, which alone carries the limit.
#[test]
fn a_short_write_goes_on_where_it_stopped() {
    let d = dir("short");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "short_write_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("FERRY_RING_SHORT_DIR", &d)
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("short write child: ok"),
        "child {}:\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(d).unwrap();
}
