//! ferry-io on real fds: files (buffered and O_DIRECT), pipes, Unix and TCP
//! stream sockets, UDP datagrams, /dev/null; every error typed, naming the
//! file and the offset, and every buffer back in its allocator afterwards.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use ferry::{Allocator, Domain, PoolConstraints};
use ferry_io::{Chunk, IoError, Kind, Port};

const BUF: usize = 16 << 10;
const COUNT: u64 = 8;

fn alloc() -> Allocator {
    Allocator::new(&Domain::new("io-test"), COUNT, BUF, PoolConstraints::default()).unwrap()
}

mod common;
use common::data;

/// A fresh scratch directory for one test.
fn dir(name: &str) -> PathBuf {
    common::dir("io", name)
}

/// A pipe: (read end, write end), as files.
fn pipe() -> (std::fs::File, std::fs::File) {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two fds pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both fds were just created and are owned by nothing else.
    unsafe { (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1])) }
}

/// Copy `src` to `dst` through the pool, `batch` buffers at a time.
fn copy(src: &mut Port, dst: &mut Port, a: &Allocator, batch: usize) -> Result<u64, IoError> {
    let mut total = 0;
    loop {
        let filled = src.read(a, batch)?;
        if filled.is_empty() {
            return Ok(total);
        }
        total += dst.write(filled)?;
    }
}

#[test]
fn file_to_file_buffered_and_direct() {
    let d = dir("files");
    let a = alloc();
    // Whole buffers plus an unaligned tail, and a file smaller than a page.
    for (len, direct) in [(5 * BUF + 1234, false), (5 * BUF + 1234, true), (100, true), (0, false), (3 * BUF, true)] {
        let want = data(len, len as u64);
        std::fs::write(d.join("src"), &want).unwrap();
        let (mut src, mut dst) = if direct {
            (Port::open_direct(d.join("src")).unwrap(), Port::create_direct(d.join("dst")).unwrap())
        } else {
            (Port::open(d.join("src")).unwrap(), Port::create(d.join("dst")).unwrap())
        };
        assert_eq!(src.kind(), Kind::File);
        assert_eq!(src.is_direct(), direct, "ext4 takes O_DIRECT");
        assert_eq!(copy(&mut src, &mut dst, &a, 3).unwrap(), len as u64);
        drop(dst);
        assert!(std::fs::read(d.join("dst")).unwrap() == want, "{len} bytes, direct {direct}: contents differ");
        assert_eq!(a.available(), COUNT as usize);
    }
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn reads_do_not_clear_the_memory_they_do_not_fill() {
    let d = dir("noclear");
    let a = Allocator::new(&Domain::new("d"), 1, 4096, PoolConstraints::default()).unwrap();
    let mut b = a.alloc().unwrap();
    b.as_mut_slice().unwrap().fill(0xAB);
    drop(b);
    std::fs::write(d.join("f"), b"xyz").unwrap();
    let filled = Port::open(d.join("f")).unwrap().read(&a, 1).unwrap();
    assert_eq!(filled[0].len, 3);
    assert_eq!(&filled[0].buffer[..5], b"xyz\xAB\xAB", "the rest of the buffer is as it was");
    drop(filled);
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn byte_ranges_are_written_and_bad_ranges_refused() {
    let d = dir("ranges");
    let a = alloc();
    let mut b1 = a.alloc().unwrap();
    b1.as_mut_slice().unwrap()[..10].copy_from_slice(b"0123456789");
    let mut b2 = a.alloc().unwrap();
    b2.as_mut_slice().unwrap()[100..103].copy_from_slice(b"abc");
    let mut out = Port::create(d.join("out")).unwrap();
    assert_eq!(out.write([Chunk::new(b1, 2..5).unwrap(), Chunk::new(b2, 100..103).unwrap()]).unwrap(), 6);
    assert_eq!(std::fs::read(d.join("out")).unwrap(), b"234abc");
    let b3 = a.alloc().unwrap();
    assert!(matches!(Chunk::new(b3, 0..BUF + 1), Err(IoError::BadRange { end, .. }) if end == BUF + 1));
    assert_eq!(a.available(), COUNT as usize, "written and refused buffers are back");
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn open_errors_name_the_file() {
    let d = dir("open");
    let missing = d.join("missing");
    match Port::open(&missing) {
        Err(e @ IoError::NotFound { .. }) => assert!(e.to_string().contains(&*missing.to_string_lossy()), "{e}"),
        other => panic!("{other:?}"),
    }
    match Port::open(&d) {
        Err(e @ IoError::IsDirectory { .. }) => assert!(e.to_string().contains("is a directory"), "{e}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(Port::create(&d), Err(IoError::IsDirectory { .. })));
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn permission_denied_is_typed() {
    let d = dir("perm");
    let f = d.join("secret");
    std::fs::write(&f, b"x").unwrap();
    std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o000)).unwrap();
    // The tests run as root, whom file modes do not stop: this thread takes
    // the file-system identity of `nobody` (the kernel then drops its
    // capability to override file modes), for this thread only.
    let r = std::thread::spawn(move || {
        // SAFETY: setfsuid changes the calling thread's file-system uid only.
        unsafe { libc::syscall(libc::SYS_setfsuid, 65534) };
        Port::open(&f).map(|_| ())
    })
    .join()
    .unwrap();
    match r {
        Err(e @ IoError::PermissionDenied { .. }) => {
            assert!(e.to_string().contains("secret: permission denied"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn eof_in_the_middle_of_a_request_is_reported() {
    let d = dir("eof");
    let a = alloc();
    std::fs::write(d.join("f"), data(BUF + 100, 1)).unwrap();
    let mut p = Port::open(d.join("f")).unwrap();
    let got = p.read_exact(&a, 50).unwrap();
    assert_eq!((got.len(), got[0].len), (1, 50));
    drop(got);
    match p.read_exact(&a, 2 * BUF as u64) {
        Err(IoError::UnexpectedEof { offset, missing, ref name }) => {
            assert_eq!((offset, missing), ((BUF + 100) as u64, (BUF - 50) as u64));
            assert!(name.ends_with("/f"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.available(), COUNT as usize);
    // More than the pool holds: refused before reading.
    assert!(matches!(p.read_exact(&a, (COUNT + 1) * BUF as u64), Err(IoError::NoBuffer { .. })));
    std::fs::remove_dir_all(d).unwrap();
}

/// A tmpfs of 64 KiB mounted for one test, unmounted when dropped.
struct SmallFs(PathBuf);

impl SmallFs {
    fn mount(name: &str) -> SmallFs {
        let d = dir(name);
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k", "ferry-io-test"])
            .arg(&d)
            .status()
            .unwrap();
        assert!(st.success(), "mount a tmpfs (the tests run as root)");
        SmallFs(d)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_full_device_is_no_space_with_the_offset() {
    let fs = SmallFs::mount("enospc");
    let a = alloc();
    let mut bufs = Vec::new();
    for i in 0..COUNT {
        let mut b = a.alloc().unwrap();
        b.as_mut_slice().unwrap().fill(i as u8);
        bufs.push(b);
    }
    let mut p = Port::create(fs.0.join("big")).unwrap();
    match p.write(bufs) {
        Err(IoError::NoSpace { offset, ref name }) => {
            assert_eq!(offset, 64 << 10, "the device took what it had room for");
            assert!(name.ends_with("/big"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.available(), COUNT as usize, "every buffer back after the error");
}

#[test]
fn pipe_both_ways_with_short_reads() {
    let a = alloc();
    let (r, w) = pipe();
    let want = data(3 * BUF + 77, 9);
    let w2 = want.clone();
    // The writer writes in odd pieces: the reader sees short reads.
    let writer = std::thread::spawn(move || {
        let mut w = w;
        for piece in w2.chunks(5000) {
            w.write_all(piece).unwrap();
        }
    });
    let mut p = Port::from_fd(r, "pipe").unwrap();
    assert_eq!(p.kind(), Kind::Pipe);
    let mut got = Vec::new();
    loop {
        let f = p.read(&a, 2).unwrap();
        if f.is_empty() {
            break;
        }
        assert!(f.iter().rev().skip(1).all(|x| x.len == BUF), "only the last buffer of a read is partial");
        f.iter().for_each(|x| got.extend_from_slice(x.bytes()));
    }
    writer.join().unwrap();
    assert!(got == want);
    // Writing into a pipe whose reader is gone: broken pipe, buffers back.
    let (r, w) = pipe();
    drop(r);
    let mut p = Port::from_fd(w, "pipe to nobody").unwrap();
    let b = a.alloc().unwrap();
    assert!(matches!(p.write([b]), Err(IoError::BrokenPipe { offset: 0, .. })));
    assert_eq!(a.available(), COUNT as usize);
}

#[test]
fn unix_stream_roundtrip_and_broken_pipe() {
    let a = alloc();
    let (x, y) = UnixStream::pair().unwrap();
    let want = data(2 * BUF + 5, 3);
    let w2 = want.clone();
    let peer = std::thread::spawn(move || {
        let mut y = y;
        y.write_all(&w2).unwrap();
        y.shutdown(std::net::Shutdown::Write).unwrap();
        let mut back = Vec::new();
        y.read_to_end(&mut back).unwrap();
        back
    });
    let mut p = Port::from_fd(x, "unix:pair").unwrap();
    assert_eq!(p.kind(), Kind::Stream);
    let filled = p.read_exact(&a, want.len() as u64).unwrap();
    assert_eq!(filled.len(), 3);
    assert!(p.read(&a, 1).unwrap().is_empty(), "end of stream");
    assert_eq!(p.write(filled).unwrap(), want.len() as u64);
    drop(p);
    assert!(peer.join().unwrap() == want);
    assert_eq!(a.available(), COUNT as usize);

    let (x, y) = UnixStream::pair().unwrap();
    drop(y);
    let mut p = Port::from_fd(x, "unix:gone").unwrap();
    match p.write([a.alloc().unwrap()]) {
        Err(e @ IoError::BrokenPipe { .. }) => assert!(e.to_string().starts_with("unix:gone: "), "{e}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.available(), COUNT as usize);
}

#[test]
fn tcp_peer_reset_is_typed() {
    let a = alloc();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let c = TcpStream::connect(addr).unwrap();
    let (mut s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut p = Port::from_fd(c, format!("tcp:{addr}")).unwrap();
    let mut b = a.alloc().unwrap();
    b.as_mut_slice().unwrap()[..2].copy_from_slice(b"ab");
    p.write([Chunk::new(b, 0..2).unwrap()]).unwrap();
    // The peer takes one byte, then closes with one unread: the kernel
    // answers with a reset.
    let mut one = [0u8; 1];
    s.read_exact(&mut one).unwrap();
    drop(s);
    match p.read(&a, 2) {
        Err(e @ IoError::ConnectionReset { .. }) => assert!(e.to_string().contains(&format!("tcp:{addr}")), "{e}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.available(), COUNT as usize);
}

#[test]
fn udp_one_datagram_per_buffer_and_oversize_is_an_error() {
    let a = Allocator::new(&Domain::new("udp"), 4, 4096, PoolConstraints::default()).unwrap();
    let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
    tx.connect(rx.local_addr().unwrap()).unwrap();
    let mut txp = Port::from_fd(tx, "udp:tx").unwrap();
    assert_eq!(txp.kind(), Kind::Datagram);
    // Send three datagrams of 10, 0 and 4096 bytes from buffers.
    let chunks: Vec<Chunk> = [10usize, 0, 4096]
        .iter()
        .map(|&n| {
            let mut b = a.alloc().unwrap();
            b.as_mut_slice().unwrap()[..n].fill(n as u8);
            Chunk::new(b, 0..n).unwrap()
        })
        .collect();
    assert_eq!(txp.write(chunks).unwrap(), 4106);
    assert_eq!(a.available(), 4);
    let mut rxp = Port::from_fd(rx.try_clone().unwrap(), "udp:rx").unwrap();
    let mut lens = Vec::new();
    while lens.len() < 3 {
        for f in rxp.read(&a, 4).unwrap() {
            assert!(f.bytes().iter().all(|&x| x == f.len as u8));
            lens.push(f.len);
        }
    }
    assert_eq!(lens, [10, 0, 4096]);
    // A datagram larger than a buffer: an error, not a truncated buffer.
    let big = UdpSocket::bind("127.0.0.1:0").unwrap();
    big.send_to(&[7u8; 5000], rx.local_addr().unwrap()).unwrap();
    match rxp.read(&a, 4) {
        Err(IoError::DatagramTooLarge { size: 5000, limit: 4096, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(a.available(), 4);
}

#[test]
fn dev_null_both_ways() {
    let a = alloc();
    let mut null = Port::create("/dev/null").unwrap();
    assert_eq!(null.kind(), Kind::Device);
    let bufs: Vec<_> = (0..3).map(|_| a.alloc().unwrap()).collect();
    assert_eq!(null.write(bufs).unwrap(), 3 * BUF as u64);
    assert!(Port::open("/dev/null").unwrap().read(&a, 4).unwrap().is_empty());
    assert!(matches!(
        Port::open("/dev/null").unwrap().read_exact(&a, 1),
        Err(IoError::UnexpectedEof { offset: 0, missing: 1, .. })
    ));
    assert_eq!(a.available(), COUNT as usize);
}

#[test]
fn udp_batches_keep_the_datagrams_before_an_oversize_one() {
    let a = Allocator::new(&Domain::new("udp-batch"), 64, 4096, PoolConstraints::default()).unwrap();
    let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
    tx.connect(rx.local_addr().unwrap()).unwrap();
    let mut txp = Port::from_fd(tx.try_clone().unwrap(), "udp:tx").unwrap();
    // 40 datagrams in one write (one sendmmsg), each tagged with its number.
    let chunks: Vec<Chunk> = (0..40u8)
        .map(|i| {
            let mut b = a.alloc().unwrap();
            b.as_mut_slice().unwrap()[..100].fill(i);
            Chunk::new(b, 0..100).unwrap()
        })
        .collect();
    assert_eq!(txp.write(chunks).unwrap(), 4000);
    assert_eq!(a.available(), 64);
    // Then one too large for a buffer, then one more good one.
    tx.send(&[9u8; 5000]).unwrap();
    tx.send(&[41u8; 100]).unwrap();
    let mut rxp = Port::from_fd(rx, "udp:rx").unwrap();
    let mut seen = Vec::new();
    let err = loop {
        match rxp.read(&a, 64) {
            Ok(filled) => {
                assert!(!filled.is_empty());
                for f in filled {
                    assert_eq!(f.len, 100);
                    assert!(f.bytes().iter().all(|&x| x == f.bytes()[0]));
                    seen.push(f.bytes()[0]);
                }
            }
            Err(e) => break e,
        }
    };
    // Every datagram before the oversize one was handed out, in order.
    assert_eq!(seen, (0..40u8).collect::<Vec<_>>());
    assert!(matches!(err, IoError::DatagramTooLarge { size: 5000, limit: 4096, offset: 4000, .. }), "{err:?}");
    // The oversize datagram's buffer is back; at most the one behind it is
    // held by the port (received in the same call), for the next read.
    assert!(a.available() >= 63);
    // The next read hands out the datagram behind it.
    let next = rxp.read(&a, 64).unwrap();
    assert_eq!((next.len(), next[0].len, next[0].bytes()[0]), (1, 100, 41));
    drop(next);
    assert_eq!(a.available(), 64);
}

#[test]
fn udp_send_refused_midway_returns_every_buffer() {
    let a = Allocator::new(&Domain::new("udp-refused"), 4, 128 << 10, PoolConstraints::default()).unwrap();
    let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
    tx.connect(rx.local_addr().unwrap()).unwrap();
    let mut txp = Port::from_fd(tx, "udp:tx").unwrap();
    // Two that fit, one larger than any UDP datagram, one more.
    let chunks: Vec<Chunk> =
        [10usize, 20, 70_000, 30].iter().map(|&n| Chunk::new(a.alloc().unwrap(), 0..n).unwrap()).collect();
    match txp.write(chunks) {
        Err(IoError::DatagramRefused { size: 70_000, offset: 30, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(a.available(), 4);
    let mut buf = [0u8; 100];
    assert_eq!(rx.recv(&mut buf).unwrap(), 10);
    assert_eq!(rx.recv(&mut buf).unwrap(), 20);
}

#[test]
fn send_from_moves_a_file_to_a_socket_pipe_and_file_in_the_kernel() {
    let d = dir("send-from");
    let bytes = data(3 << 20, 11);
    std::fs::write(d.join("src"), &bytes).unwrap();
    // To a TCP socket, after a framing header sent with MSG_MORE.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        got
    });
    let mut src = Port::open(d.join("src")).unwrap();
    let mut sock = Port::from_fd(TcpStream::connect(addr).unwrap(), format!("tcp:{addr}")).unwrap();
    sock.send_more(b"HEAD").unwrap();
    assert_eq!(sock.send_from(&mut src, 1 << 20).unwrap(), 1 << 20);
    assert_eq!(src.offset(), 1 << 20);
    // More asked than is left: what is left, then 0 at the end.
    assert_eq!(sock.send_from(&mut src, 8 << 20).unwrap(), 2 << 20);
    assert_eq!(sock.send_from(&mut src, 8 << 20).unwrap(), 0);
    assert_eq!(sock.offset(), 4 + (3 << 20));
    drop(sock);
    let got = reader.join().unwrap();
    assert_eq!(&got[..4], b"HEAD");
    assert!(got[4..] == bytes[..], "the socket carried the file");
    // To a file.
    let mut src = Port::open(d.join("src")).unwrap();
    let mut dst = Port::create(d.join("dst")).unwrap();
    assert_eq!(dst.send_from(&mut src, u64::MAX).unwrap(), 3 << 20);
    assert!(std::fs::read(d.join("dst")).unwrap() == bytes);
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn send_from_refuses_what_sendfile_does_not_take() {
    let d = dir("send-from-refused");
    std::fs::write(d.join("src"), data(4096, 2)).unwrap();
    // A pipe as the source: not a file.
    let (r, _w) = pipe();
    let mut from_pipe = Port::from_fd(r, "pipe").unwrap();
    let mut null = Port::create("/dev/null").unwrap();
    match null.send_from(&mut from_pipe, 10) {
        Err(IoError::Os { op: "sendfile", source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::EINVAL)),
        other => panic!("{other:?}"),
    }
    // An O_APPEND file as the destination: the kernel refuses, typed.
    let f = std::fs::OpenOptions::new().append(true).create(true).open(d.join("log")).unwrap();
    let mut log = Port::from_fd(f, "log").unwrap();
    let mut src = Port::open(d.join("src")).unwrap();
    match log.send_from(&mut src, 4096) {
        Err(e @ IoError::Os { .. }) => assert!(e.to_string().contains("log"), "{e}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(src.offset(), 0);
    std::fs::remove_dir_all(d).unwrap();
}
