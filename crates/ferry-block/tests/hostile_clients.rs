//! The NBD server against clients that mean it harm: writes announced and
//! never sent, writes cut off in the middle of a sector, connections that
//! never finish their handshake, more connections than the server takes.
//! Each client here is written from the protocol specification and talks
//! to a real server on a loopback socket.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_block::{ConnSummary, FileStore, MemStore, NbdServer, ServerConfig, Store, MEM_CHUNK};

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Every wait here ends within this.
const LIMIT: Duration = Duration::from_secs(30);

/// A server on a kernel-chosen loopback port; connection summaries come
/// back through the receiver.
fn serve(store: Arc<dyn Store>, config: ServerConfig) -> (String, mpsc::Receiver<ConnSummary>) {
    let server = NbdServer::bind(&"tcp:127.0.0.1:0".parse().expect("addr"), store, config).expect("bind");
    let addr = server.local_addr().to_string().strip_prefix("tcp:").expect("tcp").to_string();
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    server
        .spawn(move |summary| {
            let _ = tx.lock().unwrap().send(summary.clone());
        })
        .expect("accept thread");
    (addr, rx)
}

fn request_header(flags: u16, kind: u16, handle: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut m = 0x2560_9513u32.to_be_bytes().to_vec();
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&handle.to_be_bytes());
    m.extend_from_slice(&offset.to_be_bytes());
    m.extend_from_slice(&len.to_be_bytes());
    m
}

/// Connect and read the greeting; nothing sent yet.
fn connect_silent(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(LIMIT)).expect("timeout");
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).expect("greeting");
    assert_eq!(&hello[..8], b"NBDMAGIC");
    s
}

/// Connect, greet and enter transmission with NBD_OPT_EXPORT_NAME "".
fn connect(addr: &str) -> TcpStream {
    let mut s = connect_silent(addr);
    let mut m = 3u32.to_be_bytes().to_vec(); // FIXED_NEWSTYLE | NO_ZEROES
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&1u32.to_be_bytes());
    m.extend_from_slice(&0u32.to_be_bytes());
    s.write_all(&m).expect("export name");
    let mut r = [0u8; 10];
    s.read_exact(&mut r).expect("export reply");
    s
}

/// Send a whole write and take its simple reply; the reply's error.
fn write(s: &mut TcpStream, handle: u64, offset: u64, data: &[u8]) -> u32 {
    let mut m = request_header(0, 1, handle, offset, data.len() as u32);
    m.extend_from_slice(data);
    s.write_all(&m).expect("send write");
    let mut h = [0u8; 16];
    s.read_exact(&mut h).expect("reply");
    assert_eq!(u64::from_be_bytes(h[8..].try_into().unwrap()), handle);
    u32::from_be_bytes(h[4..8].try_into().unwrap())
}

/// Wait for the summary of one connection that ended.
fn ended(rx: &mpsc::Receiver<ConnSummary>) -> ConnSummary {
    rx.recv_timeout(LIMIT).expect("a connection ended")
}

/// Wait until `cond` holds (polled), failing after [`LIMIT`].
fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < LIMIT, "not within {LIMIT:?}: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-hostile-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Writes of 32 MiB announced on 4 connections, each with 1000 bytes of
/// payload sent and the rest never: the memory store holds memory for
/// the bytes that came (one chunk each), not for the 128 MiB announced,
/// and no more once the clients are gone. The payloads land in the store
/// (the connections wrote a large write before, so the server receives
/// these straight into the store's chunks).
#[test]
fn a_write_announced_and_not_sent_allocates_nothing_for_the_missing_bytes() {
    let store = Arc::new(MemStore::new(256 << 20).expect("store"));
    let (addr, summaries) = serve(store.clone(), ServerConfig::default());
    let first = pattern(64 << 10, 7);
    let sent = pattern(1000, 99);
    let mut clients = Vec::new();
    for i in 0..4u64 {
        let mut c = connect(&addr);
        assert_eq!(write(&mut c, 1, 0, &first), 0);
        let at = (1 + i) * (32 << 20);
        let mut m = request_header(0, 1, 2, at, 32 << 20);
        m.extend_from_slice(&sent);
        c.write_all(&m).expect("header and 1000 bytes");
        clients.push((c, at));
    }
    // The server has taken what came once the first sector of each write
    // is in the store.
    for (_, at) in &clients {
        until("the first sector of each stalled write is in the store", || {
            let mut b = [0u8; 512];
            store.read_at(*at, &mut b).unwrap();
            b[..] == sent[..512]
        });
    }
    assert_eq!(
        store.allocated_bytes(),
        5 * MEM_CHUNK,
        "chunk 0 and one chunk for each write's bytes, not the 128 MiB announced"
    );
    for (c, _) in clients.drain(..) {
        drop(c);
    }
    for _ in 0..4 {
        let s = ended(&summaries);
        assert!(s.end.contains("dropped") && s.landed_bytes > 0, "{s}");
    }
    assert_eq!(store.allocated_bytes(), 5 * MEM_CHUNK, "nothing allocated for the missing bytes afterwards");
    let extents = store.extents(32 << 20, 32 << 20, 16).unwrap();
    assert_eq!(extents[0].len, MEM_CHUNK, "{extents:?}");
    assert!(!extents[0].hole && extents[1].hole && extents[1].len == (32 << 20) - MEM_CHUNK, "{extents:?}");
}

/// How a cut-off write reaches the server.
#[derive(Debug, Clone, Copy)]
enum Path {
    /// The connection's first request: received ahead with what follows.
    First,
    /// After a large write: the header looked at before it is taken (a
    /// memory store receives the payload straight into its chunks).
    AfterLarge,
    /// After a large write, behind a FLUSH sent with it.
    BehindFlush,
}

/// A write whose payload stops in the middle of a sector, the client gone
/// then: every sector the write covers holds all its bytes for that
/// sector or none, on the memory and the file store and whichever way
/// the payload came in. The sectors that arrived whole are applied.
#[test]
fn a_write_cut_off_mid_sector_leaves_no_sector_half_written() {
    let dir = scratch("cut");
    for (n, path) in [Path::First, Path::AfterLarge, Path::BehindFlush].into_iter().enumerate() {
        let file: Arc<dyn Store> =
            Arc::new(FileStore::open(&dir.join(format!("d{n}.img")), Some(8 << 20), false).expect("file store"));
        let mem: Arc<dyn Store> = Arc::new(MemStore::new(8 << 20).expect("memory store"));
        for store in [mem, file] {
            let old = vec![0xeeu8; 1 << 20];
            store.write_at(1 << 20, &old, false).unwrap();
            let (addr, summaries) = serve(store.clone(), ServerConfig::default());
            let mut c = connect(&addr);
            // An offset inside a sector: the write covers the rest of that
            // one, then 2 whole sectors arrive, then 300 bytes of the next.
            let offset = (1 << 20) + 1000;
            let len: u32 = if matches!(path, Path::AfterLarge) { 256 << 10 } else { 8192 };
            let arrived = (1024 - 1000) + 2 * 512 + 300;
            let new = pattern(len as usize, n as u8);
            let mut m = Vec::new();
            if !matches!(path, Path::First) {
                assert_eq!(write(&mut c, 1, 6 << 20, &pattern(64 << 10, 3)), 0);
            }
            if matches!(path, Path::BehindFlush) {
                m.extend_from_slice(&request_header(0, 3, 2, 0, 0));
            }
            m.extend_from_slice(&request_header(0, 1, 3, offset, len));
            m.extend_from_slice(&new[..arrived]);
            c.write_all(&m).expect("send");
            c.shutdown(std::net::Shutdown::Write).expect("shut down");
            let s = ended(&summaries);
            assert!(s.end.contains("dropped"), "{path:?} {}: {s}", store.describe());
            if matches!(path, Path::AfterLarge) && store.describe().starts_with("memory") {
                assert!(s.landed_bytes > 0, "the payload went straight into the store: {s}");
            }
            let mut back = vec![0u8; 1 << 20];
            store.read_at(1 << 20, &mut back).unwrap();
            let applied = 1000 + (1024 - 1000) + 2 * 512;
            let mut expect = old.clone();
            expect[1000..applied].copy_from_slice(&new[..applied - 1000]);
            let first_bad = back.iter().zip(&expect).position(|(a, b)| a != b);
            assert_eq!(first_bad, None, "{path:?} {}: the whole sectors and nothing else", store.describe());
            drop(c);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A server whose lines about itself (notices) come back too.
fn serve_noticed(
    store: Arc<dyn Store>,
    config: ServerConfig,
) -> (String, mpsc::Receiver<ConnSummary>, Arc<std::sync::Mutex<Vec<String>>>) {
    let notices = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = notices.clone();
    let server = NbdServer::bind(&"tcp:127.0.0.1:0".parse().expect("addr"), store, config)
        .expect("bind")
        .on_notice(move |line| kept.lock().unwrap().push(line.to_string()));
    let addr = server.local_addr().to_string().strip_prefix("tcp:").expect("tcp").to_string();
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    server
        .spawn(move |summary| {
            let _ = tx.lock().unwrap().send(summary.clone());
        })
        .expect("accept thread");
    (addr, rx, notices)
}

/// Whether the server closed the connection (end of stream, or reset)
/// within [`LIMIT`].
fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Err(e) => return !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
            // Option replies the server sent before it closed.
            Ok(_) => {}
        }
    }
}

/// A client that connects and says nothing, and one that keeps sending
/// options without ever ending the negotiation, are closed once the
/// handshake deadline has passed; a client that finished its handshake in
/// time is served past it.
#[test]
fn a_handshake_not_finished_in_time_is_closed() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new(1 << 20).expect("store"));
    let config = ServerConfig { handshake_timeout: Duration::from_millis(1500), ..ServerConfig::default() };
    let (addr, summaries) = serve(store, config);
    let mut silent = connect_silent(&addr);
    let mut chatty = connect_silent(&addr);
    let mut good = connect(&addr);
    chatty.write_all(&3u32.to_be_bytes()).expect("client flags");
    let stop = Instant::now() + LIMIT;
    let mut chatty_closed = false;
    // NBD_OPT_LIST every 50 ms, its replies taken, until the server closes.
    while Instant::now() < stop {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&3u32.to_be_bytes());
        m.extend_from_slice(&0u32.to_be_bytes());
        if chatty.write_all(&m).is_err() {
            chatty_closed = true;
            break;
        }
        let mut reply = [0u8; 20 + 4 + 20];
        if chatty.read_exact(&mut reply).is_err() {
            chatty_closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(chatty_closed, "a client negotiating forever is closed");
    assert!(closed(&mut silent), "a silent client is closed");
    for _ in 0..2 {
        let s = ended(&summaries);
        assert!(s.end.contains("no handshake within 1.5 s") && !s.transmission, "{s}");
    }
    assert_eq!(write(&mut good, 1, 0, b"still served"), 0, "a client past its handshake is not closed");
}

/// At the limit of connections, a new client closes the oldest one still
/// in its handshake and is served; with every connection past its
/// handshake, a new client is refused. Each is said in a notice.
#[test]
fn at_the_connection_limit_the_oldest_handshake_makes_room() {
    let store: Arc<dyn Store> = Arc::new(MemStore::new(1 << 20).expect("store"));
    let config = ServerConfig { max_connections: 3, handshake_timeout: LIMIT * 4, ..ServerConfig::default() };
    let (addr, summaries, notices) = serve_noticed(store, config);
    let mut silent: Vec<TcpStream> = (0..3).map(|_| connect_silent(&addr)).collect();
    let mut real = connect(&addr);
    assert_eq!(write(&mut real, 1, 0, b"in"), 0, "a real client gets in");
    assert!(closed(&mut silent[0]), "the oldest silent connection made room");
    let s = ended(&summaries);
    assert!(s.end.contains("limit of 3 connections"), "{s}");
    // Two more real clients: the two other silent ones make room.
    let mut more: Vec<TcpStream> = (0..2).map(|_| connect(&addr)).collect();
    for (i, c) in more.iter_mut().enumerate() {
        assert_eq!(write(c, 2, 100 * i as u64, b"in too"), 0);
    }
    assert!(closed(&mut silent[1]) && closed(&mut silent[2]));
    // All 3 past their handshake: the next client is refused.
    let mut refused = TcpStream::connect(&addr).expect("connect");
    refused.set_read_timeout(Some(LIMIT)).unwrap();
    let mut b = [0u8; 18];
    let got = refused.read(&mut b);
    assert!(
        matches!(got, Ok(0)) || got.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "no greeting for a client over the limit: {got:?}"
    );
    assert_eq!(write(&mut real, 3, 0, b"served"), 0, "the connections past their handshake are kept");
    until("a notice of the shed and the refused client", || {
        let n = notices.lock().unwrap();
        n.iter().any(|l| l.contains("oldest still in its handshake")) && n.iter().any(|l| l.contains("refused"))
    });
}

/// The handshake deadline holds on a Unix socket too.
#[test]
fn a_silent_client_on_a_unix_socket_is_closed_at_the_deadline() {
    let dir = scratch("unix");
    let path = dir.join("nbd.sock");
    let store: Arc<dyn Store> = Arc::new(MemStore::new(1 << 20).expect("store"));
    let config = ServerConfig { handshake_timeout: Duration::from_millis(500), ..ServerConfig::default() };
    let server = NbdServer::bind(&ferry_block::Listen::Unix(path.clone()), store, config).expect("bind");
    let (tx, summaries) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    server
        .spawn(move |summary| {
            let _ = tx.lock().unwrap().send(summary.clone());
        })
        .expect("accept thread");
    let mut c = std::os::unix::net::UnixStream::connect(&path).expect("connect");
    c.set_read_timeout(Some(LIMIT)).unwrap();
    let mut hello = [0u8; 18];
    c.read_exact(&mut hello).expect("greeting");
    let mut b = [0u8; 1];
    assert!(matches!(c.read(&mut b), Ok(0)), "closed by the server");
    let s = ended(&summaries);
    assert!(s.end.contains("no handshake within 0.5 s"), "{s}");
    let _ = std::fs::remove_dir_all(&dir);
}
