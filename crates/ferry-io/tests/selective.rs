//! Selective mapping: a stage that only forwards buffers (a Ferry channel
//! in, a file out) never touches their pages with `write_unmapped`: the
//! minor page faults of its thread, counted by the kernel per buffer, stay
//! at zero, while forwarding the same way through its mapping (`write`)
//! faults the pages in. The output is checked byte for byte both ways.
//! The same for a stage that reads buffers in (`read_unmapped`).

use std::io::Write;
use std::os::fd::FromRawFd;
use std::path::Path;
use std::time::Duration;

use ferry::{Allocator, BindParams, Channel, ChannelSetup, Domain, Endpoint, Event, PoolConstraints, PoolPolicy};
use ferry_io::Port;

const BUF: usize = 64 << 10;
const COUNT: u64 = 16;
const T: Duration = Duration::from_secs(10);

/// Minor page faults of the calling thread so far.
fn minor_faults() -> i64 {
    // SAFETY: rusage is plain old data, filled by getrusage.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out pointer.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) }, 0);
    ru.ru_minflt
}

fn byte(buffer: u64, i: usize) -> u8 {
    (buffer as usize * 31 + i * 7) as u8
}

#[test]
fn forwarding_unmapped_takes_no_page_faults() {
    let ep = Endpoint::local();
    // The source domain fills COUNT distinct buffers and moves them over.
    let source = {
        let ep = ep.clone();
        std::thread::spawn(move || {
            let app = Domain::new("source");
            let mut tx = Channel::accept(&app, &ep, ChannelSetup::default(), T).unwrap();
            let alloc = Allocator::new(&app, COUNT, BUF, PoolConstraints::default()).unwrap();
            tx.assign_pool_and_wait(alloc.pool(), T).unwrap();
            let mut bufs = Vec::new();
            for n in 0..COUNT {
                let mut b = alloc.alloc().unwrap();
                b.as_mut_slice().unwrap().iter_mut().enumerate().for_each(|(i, x)| *x = byte(n, i));
                bufs.push(b);
            }
            for b in bufs {
                let n = [b.id().index as u8];
                tx.move_buffer(b, &n).unwrap();
            }
            // Stay until the forwarder is done with the pool.
            let _ = tx.wait(Some(T));
            tx
        })
    };
    // The forwarding domain: its own mapping of the pool, never touched here.
    let fwd = Domain::new("forwarder");
    let mut rx = Channel::connect(&fwd, &ep, BindParams::default(), T).unwrap();
    rx.set_pool_policy(PoolPolicy::AcceptAll);
    let mut received = Vec::new();
    while received.len() < COUNT as usize {
        match rx.wait(Some(T)) {
            Ok(Event::MoveReceived { buffer, meta }) => received.push((meta[0] as u64, buffer)),
            Ok(Event::PoolAssignRequest(_)) => {}
            other => panic!("{other:?}"),
        }
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ferry-io-selective-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut unmapped_out = Port::create(dir.join("unmapped")).unwrap();
    let mut mapped_out = Port::create(dir.join("mapped")).unwrap();

    // Half the buffers forwarded without mapping, half through the mapping.
    let mapped: Vec<(u64, ferry::Buffer)> = received.split_off(COUNT as usize / 2);
    let mut faults = (Vec::new(), Vec::new());
    let mut order = (Vec::new(), Vec::new());
    for (n, b) in received {
        let before = minor_faults();
        assert_eq!(unmapped_out.write_unmapped(&fwd, [b]).unwrap(), BUF as u64);
        faults.0.push(minor_faults() - before);
        order.0.push(n);
    }
    for (n, b) in mapped {
        let before = minor_faults();
        assert_eq!(mapped_out.write([b]).unwrap(), BUF as u64);
        faults.1.push(minor_faults() - before);
        order.1.push(n);
    }
    // What arrived is what the source wrote, both ways.
    for (file, order) in [("unmapped", &order.0), ("mapped", &order.1)] {
        let got = std::fs::read(dir.join(file)).unwrap();
        for (k, &n) in order.iter().enumerate() {
            assert!(
                got[k * BUF..(k + 1) * BUF].iter().enumerate().all(|(i, &x)| x == byte(n, i)),
                "{file}: buffer {n} differs"
            );
        }
    }
    eprintln!("minor page faults per forwarded buffer: unmapped {:?}, through the mapping {:?}", faults.0, faults.1);
    // A page fault that has nothing to do with the buffer (the allocator
    // touching fresh heap, the host reclaiming a page of this thread's) can
    // land in any one measurement; touching the buffer's pages would fault
    // every time, as the mapped half shows.
    let faulted = faults.0.iter().filter(|&&f| f > 0).count();
    assert!(faulted <= 1, "forwarding without mapping touched pages: {:?}", faults.0);
    assert!(faults.1.iter().all(|&f| f >= 1), "forwarding through the mapping faults its pages in: {:?}", faults.1);
    drop(rx);
    drop(source.join());
    std::fs::remove_dir_all(dir).unwrap();
}

/// The other direction: a stage that reads buffers in from an fd (a file,
/// then a pipe) to hand them on takes no page faults with
/// `read_unmapped`, while `read` faults the fresh buffers' pages in.
#[test]
fn reading_unmapped_takes_no_page_faults() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ferry-io-selective-read-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let n = COUNT as usize / 2;
    let want: Vec<u8> = (0..n * BUF).map(|i| byte(i as u64 / BUF as u64, i % BUF)).collect();
    std::fs::write(dir.join("in"), &want).unwrap();
    // A fresh pool: no page of it is mapped in yet.
    let alloc = Allocator::new(&Domain::new("reader"), COUNT, BUF, PoolConstraints::default()).unwrap();

    let mut unmapped_in = Port::open(dir.join("in")).unwrap();
    let mut mapped_in = Port::open(dir.join("in")).unwrap();
    let (mut unmapped, mut mapped) = (Vec::new(), Vec::new());
    let (mut faults_unmapped, mut faults_mapped) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let before = minor_faults();
        let f = unmapped_in.read_unmapped(&alloc, 1).unwrap();
        faults_unmapped.push(minor_faults() - before);
        unmapped.extend(f);
        let before = minor_faults();
        let f = mapped_in.read(&alloc, 1).unwrap();
        faults_mapped.push(minor_faults() - before);
        mapped.extend(f);
    }
    eprintln!("minor page faults per buffer read: unmapped {faults_unmapped:?}, through the mapping {faults_mapped:?}");
    for got in [&unmapped, &mapped] {
        assert_eq!(got.len(), n);
        let bytes: Vec<u8> = got.iter().flat_map(|f| f.bytes().iter().copied()).collect();
        assert!(bytes == want, "contents differ");
    }
    assert!(faults_unmapped.iter().all(|&f| f == 0), "reading without mapping touched pages: {faults_unmapped:?}");
    assert!(
        faults_mapped.iter().all(|&f| f >= 1),
        "reading through the mapping faults the pages in: {faults_mapped:?}"
    );
    drop((unmapped, mapped));

    // From a pipe: spliced straight into the memfd.
    let mut fds = [0; 2];
    // SAFETY: room for the two fds.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both new, owned by nothing else.
    let (r, w) = unsafe { (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1])) };
    let w2 = want.clone();
    let writer = std::thread::spawn(move || {
        let mut w = w;
        w.write_all(&w2).unwrap();
    });
    let mut p = Port::from_fd(r, "pipe").unwrap();
    let mut got = Vec::new();
    loop {
        let f = p.read_unmapped(&alloc, 2).unwrap();
        if f.is_empty() {
            break;
        }
        f.iter().for_each(|x| got.extend_from_slice(x.bytes()));
    }
    writer.join().unwrap();
    assert!(got == want);
    assert_eq!(alloc.available(), COUNT as usize);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A buffer written unmapped to a TCP socket or a pipe and then reused at
/// once: the reader still gets the bytes as they were when written (the
/// kernel must not keep the pool's pages as the data of the stream).
#[test]
fn unmapped_writes_to_sockets_and_pipes_survive_reuse_of_the_buffer() {
    let domain = Domain::new("reuse");
    let alloc = Allocator::new(&domain, 1, BUF, PoolConstraints::default()).unwrap();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tcp = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut rx_tcp, _) = l.accept().unwrap();
    let mut fds = [0; 2];
    // SAFETY: room for the two fds pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both fds are new and owned by nothing else.
    let (mut rx_pipe, tx_pipe) = unsafe { (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1])) };
    for (name, port, rx) in [
        ("tcp", Port::from_fd(tcp, "tcp").unwrap(), &mut rx_tcp as &mut dyn std::io::Read),
        ("pipe", Port::from_fd(tx_pipe, "pipe").unwrap(), &mut rx_pipe as &mut dyn std::io::Read),
    ] {
        let mut port = port;
        let mut b = alloc.alloc().unwrap();
        b.as_mut_slice().unwrap().fill(0xAA);
        assert_eq!(port.write_unmapped(&domain, [b]).unwrap(), BUF as u64);
        // The buffer is back; the next user fills it with something else.
        let mut again = alloc.alloc().unwrap();
        again.as_mut_slice().unwrap().fill(0x55);
        let mut got = vec![0u8; BUF];
        rx.read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0xAA), "{name}: the stream carried the buffer's later contents");
    }
}

/// Everything `read_unmapped` returns until end of input, as bytes.
fn read_unmapped_to_end(port: &mut Port, alloc: &Allocator) -> (Vec<u8>, Vec<usize>) {
    let (mut bytes, mut lens) = (Vec::new(), Vec::new());
    loop {
        let filled = port.read_unmapped(alloc, 2).unwrap();
        if filled.is_empty() {
            return (bytes, lens);
        }
        for f in filled {
            lens.push(f.len);
            bytes.extend_from_slice(f.bytes());
        }
    }
}

/// Input whose size is not a multiple of the buffer size, read with
/// `read_unmapped` from a file and from a pipe: the last buffer, partly
/// filled, comes out with the rest (every byte, in order, the last
/// buffer's length the remainder), and every buffer is back afterwards.
#[test]
fn reading_unmapped_keeps_the_partly_filled_last_buffer() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ferry-io-selective-tail-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let alloc = Allocator::new(&Domain::new("reader"), COUNT, BUF, PoolConstraints::default()).unwrap();
    for len in [1234, 3 * BUF + 1234, 5 * BUF - 1] {
        let want: Vec<u8> = (0..len).map(|i| byte(i as u64 / 999, i)).collect();
        let tail = len % BUF;
        std::fs::write(dir.join("in"), &want).unwrap();
        let (got, lens) = read_unmapped_to_end(&mut Port::open(dir.join("in")).unwrap(), &alloc);
        assert_eq!((got.len(), lens.last().copied()), (len, Some(tail)), "file of {len} bytes: {lens:?}");
        assert!(got == want, "file of {len} bytes: contents differ");

        let mut fds = [0; 2];
        // SAFETY: room for the two fds.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: both new, owned by nothing else.
        let (r, w) = unsafe { (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1])) };
        let sent = want.clone();
        let writer = std::thread::spawn(move || {
            let mut w = w;
            w.write_all(&sent).unwrap();
        });
        let (got, lens) = read_unmapped_to_end(&mut Port::from_fd(r, "pipe").unwrap(), &alloc);
        writer.join().unwrap();
        assert_eq!(got.len(), len, "pipe of {len} bytes: {lens:?}");
        assert!(got == want, "pipe of {len} bytes: contents differ");
        assert_eq!(alloc.available(), COUNT as usize, "every buffer is back");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
