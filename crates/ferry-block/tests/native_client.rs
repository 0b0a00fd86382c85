//! The block service over Ferry channels: a [`BlockClient`] and a served
//! channel, between threads, over shared memory and over TCP, with many
//! requests in flight matched by id, and the server's error answers.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use ferry::{Domain, Endpoint};
use ferry_block::{serve_channel, BlockClient, ChannelSummary, Error, MemStore, Op, Store};

const T: Duration = Duration::from_secs(20);

fn start(ep: &Endpoint, store: Arc<dyn Store>) -> JoinHandle<Result<ChannelSummary, Error>> {
    let ep = ep.clone();
    std::thread::spawn(move || serve_channel(&Domain::new("block server"), &ep, &*store, T))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Many writes in flight, completed by id; read back in one call; errors.
fn exercise(ep: Endpoint) {
    let store: Arc<dyn Store> = Arc::new(MemStore::new(8 << 20).unwrap());
    let server = start(&ep, store.clone());
    let mut c = BlockClient::connect(&Domain::new("app"), &ep, 8, 64 << 10, T).expect("connect");
    assert_eq!(c.size(), 8 << 20);

    // Eight writes of 64 KiB in flight at once, each its own pattern.
    let mut ids = Vec::new();
    for i in 0..8u8 {
        let mut b = c.buffer().expect("a free buffer");
        b.as_mut_slice().unwrap().copy_from_slice(&pattern(i, 64 << 10));
        ids.push((c.submit(Op::Write, b, (i as u64) << 16, 64 << 10, i == 7).unwrap(), i));
    }
    assert!(c.buffer().is_none(), "all eight buffers are in flight");
    assert_eq!(c.in_flight(), 8);
    let mut done = Vec::new();
    for _ in 0..8 {
        let comp = c.complete().expect("a completion");
        assert_eq!((comp.op, comp.status), (Op::Write, Ok(())));
        done.push(comp.id);
    }
    done.sort();
    assert_eq!(done, ids.iter().map(|(id, _)| *id).collect::<Vec<_>>());
    c.flush().unwrap();

    // The store holds them; read back through the channel across buffer
    // boundaries (unaligned), all in flight at once.
    let mut whole = vec![0u8; 8 << 16];
    store.read_at(0, &mut whole).unwrap();
    for i in 0..8usize {
        assert_eq!(whole[i << 16..(i + 1) << 16], pattern(i as u8, 64 << 10)[..]);
    }
    let mut back = vec![0u8; (8 << 16) - 1000];
    c.read(500, &mut back).unwrap();
    assert_eq!(back, whole[500..(8 << 16) - 500]);

    // Trim and write-zeroes read as zeroes after.
    c.trim(0, 64 << 10).unwrap();
    c.write_zeroes(64 << 10, 4096).unwrap();
    let mut z = vec![1u8; (64 << 10) + 4096];
    c.read(0, &mut z).unwrap();
    assert!(z.iter().all(|&b| b == 0));

    // Errors: past the end (read EINVAL, write ENOSPC), a request larger
    // than the buffer refused before it leaves; the channel goes on.
    let mut b = [0u8; 16];
    assert!(matches!(c.read((8 << 20) - 8, &mut b), Err(Error::Remote(22))));
    assert!(matches!(c.write((8 << 20) - 8, &b), Err(Error::Remote(28))));
    let big = c.buffer().unwrap();
    assert!(matches!(c.submit(Op::Read, big, 0, 128 << 10, false), Err(Error::BadSpec(_))));
    c.write(100, b"after the errors").unwrap();
    let mut b = [0u8; 16];
    c.read(100, &mut b).unwrap();
    assert_eq!(&b, b"after the errors");

    drop(c);
    let summary = server.join().expect("server thread").expect("served");
    assert_eq!(summary.errors, 2);
    assert!(summary.write_bytes >= 8 << 16 && summary.read_bytes >= 8 << 16, "{summary:?}");
}

#[test]
fn between_threads() {
    exercise(Endpoint::local());
}

#[test]
fn over_shared_memory() {
    let path = std::env::temp_dir().join(format!("ferry-block-shm-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    exercise(Endpoint::shm(&path));
    let _ = std::fs::remove_file(&path);
}

#[test]
fn over_tcp() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    exercise(Endpoint::tcp(std::net::SocketAddr::from(([127, 0, 0, 1], port))));
}

/// One endpoint, several clients at once: accept, hand the channel to a
/// thread, accept again.
#[test]
fn several_clients_on_one_shm_endpoint() {
    use ferry_block::{accept_client, serve_client};
    let path = std::env::temp_dir().join(format!("ferry-block-multi-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let ep = Endpoint::shm(&path);
    let store: Arc<dyn Store> = Arc::new(MemStore::new(1 << 20).unwrap());
    let acceptor = {
        let (ep, store) = (ep.clone(), store.clone());
        std::thread::spawn(move || {
            let mut served = Vec::new();
            for _ in 0..2 {
                let ch = accept_client(&Domain::new("block server"), &ep, T).expect("a client");
                let store = store.clone();
                served.push(std::thread::spawn(move || serve_client(ch, &*store)));
            }
            let mut n: Vec<u64> = served.into_iter().map(|h| h.join().unwrap().unwrap().requests).collect();
            n.sort();
            n
        })
    };
    let mut a = BlockClient::connect(&Domain::new("a"), &ep, 2, 4096, T).expect("first client");
    let mut b = BlockClient::connect(&Domain::new("b"), &ep, 2, 4096, T).expect("second client");
    a.write(0, b"from a").unwrap();
    b.write(8, b"from b").unwrap();
    let mut buf = [0u8; 14];
    a.read(0, &mut buf).unwrap();
    assert_eq!(&buf, b"from a\0\0from b");
    drop((a, b));
    // INFO and a write from b; INFO, a write and a read from a.
    assert_eq!(acceptor.join().unwrap(), vec![2, 3]);
    let _ = std::fs::remove_file(&path);
}

/// The client proxy: two user domains reach it over shared memory, it
/// forwards both over one TCP channel to the server, each reply comes back
/// to the user whose buffer it is.
#[test]
fn client_proxy_forwards_two_users_over_one_tcp_channel() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let remote = Endpoint::tcp(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    let path = std::env::temp_dir().join(format!("ferry-block-proxy-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let local = Endpoint::shm(&path);
    let store: Arc<dyn Store> = Arc::new(MemStore::new(4 << 20).unwrap());
    let server = start(&remote, store.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let proxy = {
        let (local, remote, stop) = (local.clone(), remote.clone(), stop.clone());
        std::thread::spawn(move || {
            ferry_block::run_proxy(&Domain::new("proxy"), &local, &remote, T, || stop.load(Ordering::Relaxed))
        })
    };
    let mut a = BlockClient::connect(&Domain::new("user a"), &local, 4, 64 << 10, T).expect("user a");
    let mut b = BlockClient::connect(&Domain::new("user b"), &local, 4, 64 << 10, T).expect("user b");
    assert_eq!((a.size(), b.size()), (4 << 20, 4 << 20));
    let pa = pattern(1, 200 << 10);
    let pb = pattern(2, 200 << 10);
    a.write(0, &pa).unwrap();
    b.write(1 << 20, &pb).unwrap();
    a.flush().unwrap();
    // Each reads the other's data back through the proxy.
    let mut got = vec![0u8; 200 << 10];
    a.read(1 << 20, &mut got).unwrap();
    assert!(got == pb);
    b.read(0, &mut got).unwrap();
    assert!(got == pa);
    let mut direct = vec![0u8; 200 << 10];
    store.read_at(1 << 20, &mut direct).unwrap();
    assert!(direct == pb, "the server's store holds what user b wrote");
    assert!(matches!(b.read(4 << 20, &mut got[..10]), Err(Error::Remote(22))));
    drop((a, b));
    stop.store(true, Ordering::Relaxed);
    proxy.join().expect("proxy thread").expect("proxy ran");
    let _ = std::fs::remove_file(&path);
    // The proxy's channel is gone with it: the server's ends too.
    let summary = server.join().expect("server thread").expect("served");
    assert_eq!(summary.errors, 1, "{summary:?}");
}

/// Over TCP a read's bytes cross the network once: the request travels as
/// a descriptor in a small request buffer, the data comes back in a buffer
/// of the server's on the read-data channel, and that buffer goes back
/// without its bytes.
#[test]
fn tcp_reads_carry_their_data_once() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let ep = Endpoint::tcp(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    let store: Arc<dyn Store> = Arc::new(MemStore::new(8 << 20).unwrap());
    let data = pattern(9, 4 << 20);
    store.write_at(0, &data, false).unwrap();
    let server = start(&ep, store.clone());
    let mut c = BlockClient::connect(&Domain::new("app"), &ep, 8, 256 << 10, T).expect("connect");
    assert!(c.has_data_channel());
    let before = c.link_stats().expect("TCP");
    let mut back = vec![0u8; 4 << 20];
    c.read(0, &mut back).unwrap();
    assert!(back == data);
    let after = c.link_stats().expect("TCP");
    let sent = after.payload_sent - before.payload_sent;
    let received = after.payload_received - before.payload_received;
    // 16 reads of 256 KiB: their descriptors fit a few 4 KiB request buffers.
    assert!(sent <= 16 * 4096, "the client sent {sent} payload bytes to read 4 MiB");
    assert_eq!(received, 4 << 20, "the data came once");
    drop(c);
    let summary = server.join().expect("server thread").expect("served");
    assert_eq!(summary.read_bytes, 4 << 20);
}

/// One thread serves every client of an endpoint: three clients at once,
/// over shared memory and over TCP, each with requests in flight; each is
/// reported when it goes, and the loop stops when asked.
#[test]
fn one_thread_serves_many_clients() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    let path = std::env::temp_dir().join(format!("ferry-block-loop-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let eps = [Endpoint::shm(&path), Endpoint::tcp(std::net::SocketAddr::from(([127, 0, 0, 1], port)))];
    let store: Arc<dyn Store> = Arc::new(MemStore::new(8 << 20).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let reports = Arc::new(Mutex::new(Vec::new()));
    let servers: Vec<_> = eps
        .iter()
        .map(|ep| {
            let (ep, store, stop, reports) = (ep.clone(), store.clone(), stop.clone(), reports.clone());
            std::thread::spawn(move || {
                ferry_block::serve_endpoint(
                    &Domain::new("block server"),
                    &ep,
                    &*store,
                    &|| stop.load(Ordering::Relaxed),
                    &mut |r| reports.lock().unwrap().push(r.clone()),
                )
            })
        })
        .collect();
    // Three clients per endpoint, all connected at once, each writing and
    // reading its own megabyte with requests in flight.
    let clients: Vec<_> = (0..6u8)
        .map(|i| {
            let ep = eps[usize::from(i % 2)].clone();
            std::thread::spawn(move || {
                let mut c = BlockClient::connect(&Domain::new("app"), &ep, 4, 64 << 10, T).expect("connect");
                let p = pattern(i, 1 << 20);
                let at = u64::from(i) << 20;
                c.write(at, &p).unwrap();
                let mut back = vec![0u8; 1 << 20];
                c.read(at, &mut back).unwrap();
                assert!(back == p, "client {i} reads what it wrote");
                c.flush().unwrap();
            })
        })
        .collect();
    for c in clients {
        c.join().expect("client");
    }
    let deadline = std::time::Instant::now() + T;
    while reports.lock().unwrap().len() < 6 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::Relaxed);
    for s in servers {
        s.join().expect("server thread").expect("served");
    }
    let reports = reports.lock().unwrap();
    assert_eq!(reports.len(), 6, "{reports:?}");
    for r in reports.iter() {
        assert_eq!((r.summary.read_bytes, r.summary.write_bytes, r.summary.errors), (1 << 20, 1 << 20, 0), "{r:?}");
        assert!(r.error.is_none(), "{r:?}");
    }
    let _ = std::fs::remove_file(&path);
}

/// Packed reads the server cannot take — more descriptors than the request
/// buffer holds, or without a read-data channel — are refused with EINVAL
/// and the channel goes on.
#[test]
fn malformed_packed_reads_are_refused() {
    use ferry::{Allocator, BindParams, Channel, Event, PoolConstraints, Role};
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let ep = Endpoint::tcp(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    let store: Arc<dyn Store> = Arc::new(MemStore::new(1 << 20).unwrap());
    let server = start(&ep, store);
    let app = Domain::new("raw client");
    let params = BindParams { role: Role::Master, max_meta_size: 24, ..BindParams::default() };
    let mut ch = Channel::connect(&app, &ep, params, T).expect("connect");
    let alloc = Allocator::new(&app, 2, 4096, PoolConstraints::default()).unwrap();
    ch.assign_pool_and_wait(alloc.pool(), T).unwrap();
    let mut ask = |op: u8, count: u32, id: u64| {
        let mut meta = [0u8; 24];
        meta[0] = op;
        meta[4..8].copy_from_slice(&count.to_le_bytes());
        meta[8..16].copy_from_slice(&id.to_le_bytes());
        ch.move_buffer(alloc.alloc().unwrap(), &meta).map_err(|r| r.error).unwrap();
        loop {
            match ch.wait(Some(T)) {
                Ok(Event::BufferPassed { meta, .. }) => {
                    assert_eq!(u64::from_le_bytes(meta[..8].try_into().unwrap()), id);
                    return u32::from_le_bytes(meta[8..12].try_into().unwrap());
                }
                Err(_) => panic!("no reply in time"),
                Ok(_) => {}
            }
        }
    };
    // No read-data channel was asked for: packed reads are refused.
    assert_eq!(ask(6, 1, 7), 22);
    // 1000 descriptors do not fit a 4 KiB request buffer.
    assert_eq!(ask(6, 1000, 8), 22);
    // An unknown op.
    assert_eq!(ask(99, 0, 9), 22);
    // The channel goes on: INFO is answered.
    assert_eq!(ask(0, 0, 10), 0);
    // A read-data channel with a pool too large (1024 buffers of 16 MiB)
    // is refused.
    let mut meta = [0u8; 24];
    meta[1] = 2;
    meta[4..8].copy_from_slice(&(16u32 << 20).to_le_bytes());
    meta[8..16].copy_from_slice(&11u64.to_le_bytes());
    meta[16..24].copy_from_slice(&1024u64.to_le_bytes());
    ch.move_buffer(alloc.alloc().unwrap(), &meta).map_err(|r| r.error).unwrap();
    loop {
        match ch.wait(Some(T)) {
            Ok(Event::BufferPassed { meta, .. }) => {
                assert_eq!(u64::from_le_bytes(meta[..8].try_into().unwrap()), 11);
                assert_eq!(u32::from_le_bytes(meta[8..12].try_into().unwrap()), 22);
                assert_eq!(u32::from_le_bytes(meta[12..16].try_into().unwrap()), 0, "no port");
                break;
            }
            Err(_) => panic!("no reply in time"),
            Ok(_) => {}
        }
    }
    drop(ch);
    let summary = server.join().expect("server thread").expect("served");
    assert_eq!((summary.requests, summary.errors), (5, 4), "{summary:?}");
}

/// A flush while writes are in flight: the writes' completions are not
/// lost, `complete` still hands them out. And many reads one after the
/// other over TCP (each in a request buffer of its own) never run out of
/// request buffers.
#[test]
fn completions_taken_while_waiting_are_kept() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let ep = Endpoint::tcp(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    let store: Arc<dyn Store> = Arc::new(MemStore::new(1 << 20).unwrap());
    let server = start(&ep, store);
    let mut c = BlockClient::connect(&Domain::new("app"), &ep, 4, 64 << 10, T).expect("connect");
    let mut ids = Vec::new();
    for i in 0..3u64 {
        let mut b = c.buffer().unwrap();
        b.as_mut_slice().unwrap()[..4].copy_from_slice(b"abcd");
        ids.push(c.submit(Op::Write, b, i << 16, 4096, false).unwrap());
    }
    c.flush().unwrap();
    assert_eq!(c.in_flight(), 3);
    let mut done: Vec<u64> = (0..3).map(|_| c.complete().expect("the write's completion").id).collect();
    done.sort();
    assert_eq!(done, ids);
    for i in 0..300u64 {
        let id = c.submit_read((i % 16) << 16, 4096).unwrap();
        let comp = c.complete().unwrap();
        assert_eq!((comp.id, comp.status), (id, Ok(())));
        if i % 16 < 3 {
            assert_eq!(&comp.buffer[..4], b"abcd");
        }
        c.recycle(comp.buffer).unwrap();
    }
    drop(c);
    server.join().expect("server thread").expect("served");
}
