//! `Port::set_timeout`: a read from a peer that sends nothing and a write
//! or `send_from` to a peer that takes nothing fail with
//! `IoError::TimedOut` once nothing has moved for the limit, counting the
//! bytes that did move; a limit of `None` waits as before.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ferry::{Allocator, Domain, PoolConstraints};
use ferry_io::{IoError, Port};

const LIMIT: Duration = Duration::from_millis(300);
/// Far above LIMIT, so a loaded machine passes, yet a wait without bound fails.
const BOUND: Duration = Duration::from_secs(30);

/// A connected pair on loopback: (ours, the peer's).
fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (theirs, _) = l.accept().unwrap();
    (ours, theirs)
}

fn timed_out(e: &IoError, op: &str) -> bool {
    matches!(e, IoError::TimedOut { op: o, limit, .. } if *o == op && *limit == LIMIT)
}

#[test]
fn a_read_from_a_silent_peer_times_out_after_what_came() {
    let alloc = Allocator::new(&Domain::new("t"), 4, 1 << 16, PoolConstraints::default()).unwrap();
    let (ours, mut theirs) = pair();
    let mut port = Port::from_fd(ours, "tcp:peer").unwrap();
    port.set_timeout(Some(LIMIT)).unwrap();
    assert_eq!(port.timeout(), Some(LIMIT));
    theirs.write_all(b"12345").unwrap();
    let t0 = Instant::now();
    match port.read_exact(&alloc, 10) {
        Err(e) => {
            assert!(timed_out(&e, "read"), "{e:?}");
            assert_eq!(e.offset(), Some(5), "the bytes that came count: {e}");
            assert!(e.to_string().starts_with("tcp:peer: read moved nothing for 0.3 s"), "{e}");
        }
        Ok(f) => panic!("read {} buffers from a silent peer", f.len()),
    }
    assert!(t0.elapsed() >= LIMIT && t0.elapsed() < BOUND, "{:?}", t0.elapsed());
    assert_eq!(alloc.available(), 4, "the buffers are back");
    // Data that comes within the limit is read as usual.
    theirs.write_all(b"abc").unwrap();
    let got = port.read_some(&alloc, 1).unwrap();
    assert_eq!(got[0].bytes(), b"abc");
}

#[test]
fn a_write_or_send_from_to_a_peer_that_takes_nothing_times_out() {
    let alloc = Allocator::new(&Domain::new("t"), 64, 1 << 20, PoolConstraints::default()).unwrap();
    let (ours, _theirs) = pair(); // never read
    let mut port = Port::from_fd(ours, "tcp:peer").unwrap();
    port.set_timeout(Some(LIMIT)).unwrap();
    let t0 = Instant::now();
    let bufs: Vec<_> = (0..64).map(|_| alloc.alloc().unwrap()).collect();
    match port.write(bufs) {
        Err(e) => {
            assert!(timed_out(&e, "write"), "{e:?}");
            let moved = e.offset().unwrap();
            assert!(moved > 0 && moved == port.offset() && moved < 64 << 20, "{moved}");
        }
        Ok(n) => panic!("wrote {n} bytes to a peer that reads nothing"),
    }
    assert!(t0.elapsed() < BOUND, "{:?}", t0.elapsed());
    assert_eq!(alloc.available(), 64, "the buffers are back");

    let d = std::env::temp_dir().join(format!("ferry-io-timeouts-{}", std::process::id()));
    std::fs::File::create(&d).unwrap().set_len(256 << 20).unwrap();
    let (ours, _theirs) = pair();
    let mut port = Port::from_fd(ours, "tcp:peer").unwrap();
    port.set_timeout(Some(LIMIT)).unwrap();
    let mut src = Port::open(&d).unwrap();
    let t0 = Instant::now();
    match port.send_from(&mut src, 256 << 20) {
        Err(e) => {
            assert!(timed_out(&e, "sendfile"), "{e:?}");
            assert!(src.offset() > 0 && src.offset() == port.offset(), "{}", src.offset());
        }
        Ok(n) => panic!("sent {n} bytes to a peer that reads nothing"),
    }
    assert!(t0.elapsed() < BOUND, "{:?}", t0.elapsed());
    std::fs::remove_file(d).unwrap();
}
